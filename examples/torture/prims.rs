//! The torture's semaphore and read-write workloads (`--workload semaphore|rw`, issue 21): the
//! worker tasks, where the nemesis finds a holder, and the end-of-run check that every permit and
//! the write side came back. The checker's side is in `checker.rs` (`analyse_primitive`).
//!
//! Log lines are the lock workload's (`acq`, `op`, `rel`, `lost`, `invalid`), with `side`:
//! `sem` (one permit), `r` or `w`. A downgrade ends the write hold (`rel` with `"rel":
//! "downgraded"`, sent when the downgrade was sent) and opens a read hold under the next `seq`,
//! confirmed when the downgrade returned. Failed acquisitions log `err` with their `side`,
//! `t_send` and whether the wait ran out (`timed_out`), which the writer-starvation check reads.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use dlock::{LockError, LockGuard, LostReason, RwLock, Semaphore, SemaphoreGuard};
use serde_json::json;

use super::{
    Ctx, Engine, LOCK_NAME, RedisServer, Rng, RunCfg, Workload, body, connect_engine, mono, pause,
};

/// What the tasks log about a hold, for both guard types.
trait Held: Sync {
    fn token(&self) -> u64;
    fn owner_id(&self) -> String;
    fn left(&self) -> Duration;
    fn valid(&self) -> bool;
    fn lost_signal(&self) -> Pin<Box<dyn Future<Output = LostReason> + Send + 'static>>;
}

impl Held for LockGuard {
    fn token(&self) -> u64 {
        self.fencing_token()
    }
    fn owner_id(&self) -> String {
        self.owner().to_string()
    }
    fn left(&self) -> Duration {
        self.remaining()
    }
    fn valid(&self) -> bool {
        self.is_valid()
    }
    fn lost_signal(&self) -> Pin<Box<dyn Future<Output = LostReason> + Send + 'static>> {
        Box::pin(self.lost())
    }
}

impl Held for SemaphoreGuard {
    fn token(&self) -> u64 {
        self.fencing_token()
    }
    fn owner_id(&self) -> String {
        self.owner().to_string()
    }
    fn left(&self) -> Duration {
        self.remaining()
    }
    fn valid(&self) -> bool {
        self.is_valid()
    }
    fn lost_signal(&self) -> Pin<Box<dyn Future<Output = LostReason> + Send + 'static>> {
        Box::pin(self.lost())
    }
}

/// The guard's deadline on the `mono()` clock (see `deadline_of` in harness.rs).
fn deadline(g: &dyn Held) -> Option<u64> {
    let now = mono();
    let rem = g.left();
    (!rem.is_zero()).then(|| now + rem.as_nanos() as u64)
}

/// Logs the grant and starts the lost-signal watcher; cancel the token before the release.
fn open(
    ctx: &Ctx,
    g: &dyn Held,
    task: u64,
    seq: u64,
    side: &str,
    (t_send, t_ok): (u64, u64),
    downgrade: bool,
) -> (dlock::CancellationToken, tokio::task::JoinHandle<()>) {
    ctx.log.line(
        json!({"ev": "acq", "task": task, "seq": seq, "token": g.token(),
        "owner": g.owner_id(), "side": side, "t_send": t_send, "t_ok": t_ok,
        "dl": deadline(g), "downgrade": downgrade}),
    );
    let done = dlock::CancellationToken::new();
    let lost = g.lost_signal();
    let (d, log) = (done.clone(), ctx.log.clone());
    let watcher = tokio::spawn(async move {
        tokio::select! {
            biased;
            reason = lost => log.line(json!({"ev": "lost", "task": task, "seq": seq, "t": mono(), "reason": reason.to_string()})),
            _ = d.cancelled() => {}
        }
    });
    (done, watcher)
}

/// The body of a permit or read hold: a pause, the validity check (the deadline it saw is
/// logged), another pause.
async fn shared_body(ctx: &Ctx, g: &dyn Held, task: u64, seq: u64, rng: &mut Rng) {
    pause(rng, ctx.body_us).await;
    if !g.valid() {
        ctx.log
            .line(json!({"ev": "invalid", "task": task, "seq": seq, "t": mono()}));
        return;
    }
    ctx.log
        .line(json!({"ev": "dl", "task": task, "seq": seq, "t": mono(), "dl": deadline(g)}));
    pause(rng, ctx.body_us).await;
}

fn rel_kind(r: Result<(), LockError>) -> &'static str {
    match r {
        Ok(()) => "ok",
        Err(LockError::NotOwner { .. } | LockError::Lost { .. }) => "not_owner",
        Err(_) => "err",
    }
}

/// One task of the semaphore or read-write workload. In `rw`, every fourth task writes (the
/// lock workload's fenced and unfenced body: writers exclude each other) and half of its write
/// holds downgrade to a read hold; the others read.
pub(super) async fn task_loop(ctx: Arc<Ctx>, task: u64) {
    let mut rng = Rng::new(ctx.seed ^ (task + 1).wrapping_mul(0x1234_5678_9ABC));
    let mut seq = 0u64;
    let writer = ctx.workload == Workload::Rw && task % 4 == 3;
    let side = match (ctx.workload, writer) {
        (Workload::Semaphore, _) => "sem",
        (_, true) => "w",
        _ => "r",
    };
    let sem = Semaphore::new(super::LOCK_NAME, ctx.sem_max)
        .ttl(ctx.ttl)
        .wait(ctx.wait)
        .with_backend(ctx.backend.clone());
    let rw = RwLock::new(LOCK_NAME)
        .ttl(ctx.ttl)
        .wait(ctx.wait)
        .with_backend(ctx.backend.clone());
    while mono() < ctx.end {
        let t_send = mono();
        let err = |e: LockError| {
            ctx.log
                .line(json!({"ev": "err", "t": mono(), "task": task, "side": side,
                "t_send": t_send, "timed_out": matches!(e, LockError::TimedOut { .. }),
                "what": e.to_string()}));
            e
        };
        let backoff =
            |e: &LockError| !matches!(e, LockError::TimedOut { .. } | LockError::Busy { .. });
        match (ctx.workload, writer) {
            (Workload::Semaphore, _) => {
                let g: SemaphoreGuard = match sem.acquire().await.map_err(err) {
                    Ok(g) => g,
                    Err(e) => {
                        if backoff(&e) {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        continue;
                    }
                };
                seq += 1;
                let (done, watcher) = open(&ctx, &g, task, seq, side, (t_send, mono()), false);
                shared_body(&ctx, &g, task, seq, &mut rng).await;
                let (t_rel, dl) = (mono(), deadline(&g));
                done.cancel();
                let rel = rel_kind(g.release().await);
                ctx.log.line(json!({"ev": "rel", "task": task, "seq": seq, "t_send": t_rel, "t_done": mono(), "rel": rel, "dl": dl}));
                let _ = watcher.await;
            }
            (_, true) => {
                let g = match rw.write().await.map_err(err) {
                    Ok(g) => g,
                    Err(e) => {
                        if backoff(&e) {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        continue;
                    }
                };
                seq += 1;
                let (done, watcher) = open(&ctx, &*g, task, seq, side, (t_send, mono()), false);
                let mut res = ctx.res.clone();
                body(&ctx, &g, &mut res, task, seq, &mut rng).await;
                let (t_rel, dl) = (mono(), deadline(&*g));
                done.cancel();
                if rng.range(0, 2) == 0 {
                    let d = g.downgrade().await;
                    let t_done = mono();
                    let _ = watcher.await;
                    match d {
                        Ok(r) => {
                            ctx.log.line(json!({"ev": "rel", "task": task, "seq": seq, "t_send": t_rel, "t_done": t_done, "rel": "downgraded", "dl": dl}));
                            seq += 1;
                            let (done, watcher) =
                                open(&ctx, &*r, task, seq, "r", (t_rel, t_done), true);
                            shared_body(&ctx, &*r, task, seq, &mut rng).await;
                            let (t_rel, dl) = (mono(), deadline(&*r));
                            done.cancel();
                            let rel = rel_kind(r.release().await);
                            ctx.log.line(json!({"ev": "rel", "task": task, "seq": seq, "t_send": t_rel, "t_done": mono(), "rel": rel, "dl": dl}));
                            let _ = watcher.await;
                        }
                        Err(e) => {
                            let rel = rel_kind(Err(e));
                            ctx.log.line(json!({"ev": "rel", "task": task, "seq": seq, "t_send": t_rel, "t_done": t_done, "rel": rel, "dl": dl}));
                        }
                    }
                } else {
                    let rel = rel_kind(g.release().await);
                    ctx.log.line(json!({"ev": "rel", "task": task, "seq": seq, "t_send": t_rel, "t_done": mono(), "rel": rel, "dl": dl}));
                    let _ = watcher.await;
                }
            }
            _ => {
                let g = match rw.read().await.map_err(err) {
                    Ok(g) => g,
                    Err(e) => {
                        if backoff(&e) {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        continue;
                    }
                };
                seq += 1;
                let (done, watcher) = open(&ctx, &*g, task, seq, side, (t_send, mono()), false);
                shared_body(&ctx, &*g, task, seq, &mut rng).await;
                let (t_rel, dl) = (mono(), deadline(&*g));
                done.cancel();
                let rel = rel_kind(g.release().await);
                ctx.log.line(json!({"ev": "rel", "task": task, "seq": seq, "t_send": t_rel, "t_done": mono(), "rel": rel, "dl": dl}));
                let _ = watcher.await;
            }
        }
    }
}

/// The owner ids holding the workload's name on `node` now (for the nemesis's holder faults),
/// or `None` when the server did not answer.
pub(super) fn holder_owners(workload: Workload, node: &RedisServer) -> Option<Vec<String>> {
    match workload {
        Workload::Lock | Workload::Election => node
            .cmd(&["HKEYS", super::lock_hash()])
            .ok()
            .map(|r| r.strings()),
        Workload::Semaphore => node
            .cmd(&["ZRANGE", "dlock:sem:{torture}:z", "0", "-1"])
            .ok()
            .map(|r| r.strings()),
        Workload::Rw => {
            let mut v = node
                .cmd(&["HGET", "dlock:{torture}:rw", "w"])
                .ok()
                .map(|r| match r {
                    super::Resp::Bulk(Some(s)) => vec![s],
                    _ => Vec::new(),
                })?;
            v.extend(
                node.cmd(&["ZRANGE", "dlock:{torture}:rw:r", "0", "-1"])
                    .ok()?
                    .strings(),
            );
            Some(v)
        }
    }
}

/// The engines with semaphores and read-write locks.
pub(crate) fn engine_supported(engine: Engine) -> bool {
    matches!(engine, Engine::Redis | Engine::Sentinel | Engine::Cluster)
}

/// After the workers are gone: are all `max` permits (semaphore) or the write side (rw) free
/// within ttl + 2 s? `None` for the lock workload (its orphan check covers it).
pub(super) fn all_returned(cfg: &RunCfg, lock_url: &str) -> Option<bool> {
    if !matches!(cfg.workload, Workload::Semaphore | Workload::Rw) {
        return None;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    let wait = Duration::from_millis(cfg.ttl_ms) + Duration::from_secs(2);
    let (engine, workload, max) = (cfg.engine, cfg.workload, cfg.sem_max);
    let r = rt.block_on(async move {
        let b = connect_engine(engine, lock_url).await?;
        if workload == Workload::Semaphore {
            Semaphore::new(LOCK_NAME, max)
                .permits(max)
                .wait(wait)
                .with_backend(b)
                .acquire()
                .await?
                .release()
                .await
        } else {
            RwLock::new(LOCK_NAME)
                .wait(wait)
                .with_backend(b)
                .write()
                .await?
                .release()
                .await
        }
    });
    if let Err(e) = &r {
        eprintln!("torture: not everything came back after the run: {e}");
    }
    Some(r.is_ok())
}
