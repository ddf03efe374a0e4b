//! `cargo bench --bench primitives_bench`: the semaphore and the read-write lock on Redis (issue 21,
//! item 6), each figure beside baselines measured in the same run on the same private server.
//!
//! * P1 uncontended: 1 task, acquire + release pairs (`current_thread` runtime) of a permit of a
//!   4-permit semaphore, a read hold, a write hold; beside the lock's own pair, two raw round
//!   trips (`SET NX PX` + `DEL`) and two raw `EVAL`s of a trivial script. Interleaved rounds,
//!   median pairs/s. Per pair, from `INFO commandstats` deltas: top-level server calls (what the
//!   client sent: scripts and plain commands), all server calls (those run inside scripts too)
//!   and the server µs of the top-level calls.
//! * P2 16 workers on a 4-permit semaphore (`multi_thread`, 2 workers, one backend: one process),
//!   acquire (wait 10 s) + release until 4,000 grants; beside 16 workers on a lock (the same loop),
//!   and 16 tasks running raw `SET NX PX` + `DEL` pairs on 4 keys with no waiting (the floor: two
//!   round trips per pair under the same concurrency). Server calls per grant, waiting included.
//! * P3 hand-off latency: a holder on one backend, a waiter on another (two connections, two
//!   subscriptions: two processes' worth), the holder releases; from the release call to the
//!   waiter's grant, 200 times each: lock → lock (the baseline), permit → permit (a 1-permit
//!   semaphore), write → write, write → read, read → write.
//!
//! Environment: `DLOCK_BENCH_SCALE` (default 1) scales P1's pairs and P2's grants,
//! `DLOCK_BENCH_ROUNDS` (default 5) P1's rounds; `REDIS_SERVER` the redis-server binary. A filter
//! argument (`p1`, `p2`, `p3`) selects parts.

#[path = "common/redis_server.rs"]
mod redis_server;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock::{Backend, Lock, RedisBackend, RwLock, Semaphore};
use redis::aio::MultiplexedConnection;
use redis_server::Server;
use tokio::runtime::Runtime;

const TTL: Duration = Duration::from_secs(30);

fn env_f64(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|v: &f64| *v > 0.0)
        .unwrap_or(default)
}

fn current_thread() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn multi_thread() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn con(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn backend(url: &str) -> Arc<dyn Backend> {
    Arc::new(RedisBackend::connect(url).await.unwrap())
}

type Stats = HashMap<String, (u64, u64)>;

/// `INFO commandstats` as command -> (calls, usec); commands run inside scripts count too.
async fn commandstats(c: &mut MultiplexedConnection) -> Stats {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(c)
        .await
        .unwrap();
    let mut out = HashMap::new();
    for line in info.lines() {
        let Some((name, stats)) = line
            .strip_prefix("cmdstat_")
            .and_then(|r| r.split_once(':'))
        else {
            continue;
        };
        let field = |f: &str| {
            stats
                .split(',')
                .find_map(|kv| kv.strip_prefix(f))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        out.insert(name.to_string(), (field("calls="), field("usec=")));
    }
    out
}

/// Commands a client sends itself (never run inside a script here), besides the scripts.
const TOP_LEVEL: [&str; 12] = [
    "evalsha",
    "eval",
    "eval_ro",
    "evalsha_ro",
    "script|load",
    "subscribe",
    "unsubscribe",
    "ssubscribe",
    "sunsubscribe",
    "hello",
    "client|setname",
    "ping",
];

/// (top-level calls, all calls, top-level usec) between two snapshots, INFO excluded; `SET` and
/// `DEL` count as top-level when `raw` (the raw pair sends them; dlock's scripts run them inside).
fn calls(after: &Stats, before: &Stats, raw: bool) -> (u64, u64, u64) {
    let mut top = (0, 0);
    let mut all = 0;
    for (name, &(c, u)) in after {
        if name == "info" {
            continue;
        }
        let (c0, u0) = before.get(name).copied().unwrap_or((0, 0));
        let (dc, du) = (c - c0, u - u0);
        all += dc;
        if TOP_LEVEL.contains(&name.as_str()) || (raw && (name == "set" || name == "del")) {
            top.0 += dc;
            top.1 += du;
        }
    }
    (top.0, all, top.1)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn pct(sorted: &[Duration], q: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

// ---------------------------------------------------------------------------------------------
// P1: uncontended pairs
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum V {
    RawSetDel,
    RawEval2,
    Lock,
    Permit,
    Read,
    Write,
}

impl V {
    const ALL: [V; 6] = [
        V::RawSetDel,
        V::RawEval2,
        V::Lock,
        V::Permit,
        V::Read,
        V::Write,
    ];
    fn label(self) -> &'static str {
        match self {
            V::RawSetDel => "raw SET NX PX + DEL (2 round trips)",
            V::RawEval2 => "raw EVAL `return 1` ×2 (2 scripts)",
            V::Lock => "dlock Lock acquire + release",
            V::Permit => "dlock Semaphore(4) permit pair",
            V::Read => "dlock RwLock read pair",
            V::Write => "dlock RwLock write pair",
        }
    }
}

async fn pair(v: V, c: &mut MultiplexedConnection, b: &Arc<dyn Backend>) {
    match v {
        V::RawSetDel => {
            let _: Option<String> = redis::cmd("SET")
                .arg("raw:k")
                .arg("owner")
                .arg("NX")
                .arg("PX")
                .arg(30_000)
                .query_async(c)
                .await
                .unwrap();
            let _: i64 = redis::cmd("DEL").arg("raw:k").query_async(c).await.unwrap();
        }
        V::RawEval2 => {
            for _ in 0..2 {
                let _: i64 = redis::cmd("EVAL")
                    .arg("return 1")
                    .arg(1)
                    .arg("raw:e")
                    .query_async(c)
                    .await
                    .unwrap();
            }
        }
        V::Lock => Lock::new("p1-lock")
            .ttl(TTL)
            .with_backend(b.clone())
            .acquire()
            .await
            .unwrap()
            .release()
            .await
            .unwrap(),
        V::Permit => Semaphore::new("p1-sem", 4)
            .ttl(TTL)
            .with_backend(b.clone())
            .acquire()
            .await
            .unwrap()
            .release()
            .await
            .unwrap(),
        V::Read => RwLock::new("p1-rw")
            .ttl(TTL)
            .with_backend(b.clone())
            .read()
            .await
            .unwrap()
            .release()
            .await
            .unwrap(),
        V::Write => RwLock::new("p1-rw")
            .ttl(TTL)
            .with_backend(b.clone())
            .write()
            .await
            .unwrap()
            .release()
            .await
            .unwrap(),
    }
}

fn p1(url: &str, scale: f64, rounds: usize) {
    let rt = current_thread();
    let n = ((3000.0 * scale) as usize).max(50);
    rt.block_on(async {
        let b = backend(url).await;
        let mut c = con(url).await;
        let mut admin = con(url).await;
        let mut rates: HashMap<V, Vec<f64>> = HashMap::new();
        let mut per_pair: HashMap<V, (f64, f64, f64)> = HashMap::new();
        for v in V::ALL {
            // Warm-up: scripts loaded, connections up.
            for _ in 0..50 {
                pair(v, &mut c, &b).await;
            }
        }
        for round in 0..rounds {
            for v in V::ALL {
                let before = commandstats(&mut admin).await;
                let t = Instant::now();
                for _ in 0..n {
                    pair(v, &mut c, &b).await;
                }
                let dt = t.elapsed();
                let after = commandstats(&mut admin).await;
                rates
                    .entry(v)
                    .or_default()
                    .push(n as f64 / dt.as_secs_f64());
                if round == 0 {
                    let (top, all, usec) =
                        calls(&after, &before, matches!(v, V::RawSetDel | V::RawEval2));
                    per_pair.insert(
                        v,
                        (
                            top as f64 / n as f64,
                            all as f64 / n as f64,
                            usec as f64 / n as f64,
                        ),
                    );
                }
            }
        }
        let med: HashMap<V, f64> = rates
            .iter_mut()
            .map(|(v, r)| (*v, median(r)))
            .collect();
        println!("P1 uncontended, 1 task, {n} pairs × {rounds} interleaved rounds (median pairs/s)");
        println!(
            "| variant | pairs/s | ÷ raw SET+DEL | ÷ Lock | top-level calls/pair | all server calls/pair | server µs/pair |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|");
        for v in V::ALL {
            let (top, all, usec) = per_pair[&v];
            println!(
                "| {} | {:.0} | {:.2} | {:.2} | {top:.2} | {all:.2} | {usec:.1} |",
                v.label(),
                med[&v],
                med[&v] / med[&V::RawSetDel],
                med[&v] / med[&V::Lock],
            );
        }
        println!();
    });
}

// ---------------------------------------------------------------------------------------------
// P2: 16 workers
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum P2 {
    Semaphore4,
    Lock,
    RawFloor,
}

fn p2(url: &str, scale: f64) {
    const WORKERS: usize = 16;
    let grants = ((4000.0 * scale) as usize).max(200);
    let rt = multi_thread();
    println!(
        "P2 {WORKERS} workers in one process (multi_thread, 2 threads, one backend), {grants} grants in all"
    );
    println!(
        "| variant | grants/s | ÷ raw floor | ÷ Lock | top-level calls/grant | all server calls/grant |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    for v in [P2::RawFloor, P2::Lock, P2::Semaphore4] {
        let (rate, top, all) = rt.block_on(async {
            let b = backend(url).await;
            let mut admin = con(url).await;
            let c = con(url).await;
            // Warm-up.
            let _ = Semaphore::new("p2-sem", 4)
                .with_backend(b.clone())
                .acquire()
                .await
                .unwrap()
                .release()
                .await;
            let _ = Lock::new("p2-lock")
                .with_backend(b.clone())
                .acquire()
                .await
                .unwrap()
                .release()
                .await;
            let left = Arc::new(AtomicUsize::new(grants));
            let before = commandstats(&mut admin).await;
            let t = Instant::now();
            let mut tasks = Vec::new();
            for w in 0..WORKERS {
                let (b, left, mut c) = (b.clone(), left.clone(), c.clone());
                tasks.push(tokio::spawn(async move {
                    while left
                        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                        .is_ok()
                    {
                        match v {
                            P2::Semaphore4 => {
                                let g = Semaphore::new("p2-sem", 4)
                                    .ttl(TTL)
                                    .wait(Duration::from_secs(10))
                                    .with_backend(b.clone())
                                    .acquire()
                                    .await
                                    .unwrap();
                                tokio::task::yield_now().await;
                                g.release().await.unwrap();
                            }
                            P2::Lock => {
                                let g = Lock::new("p2-lock")
                                    .ttl(TTL)
                                    .wait(Duration::from_secs(10))
                                    .with_backend(b.clone())
                                    .acquire()
                                    .await
                                    .unwrap();
                                tokio::task::yield_now().await;
                                g.release().await.unwrap();
                            }
                            P2::RawFloor => {
                                let k = format!("raw:p2:{}", w % 4);
                                let _: Option<String> = redis::cmd("SET")
                                    .arg(&k)
                                    .arg(w)
                                    .arg("NX")
                                    .arg("PX")
                                    .arg(30_000)
                                    .query_async(&mut c)
                                    .await
                                    .unwrap();
                                tokio::task::yield_now().await;
                                let _: i64 =
                                    redis::cmd("DEL").arg(&k).query_async(&mut c).await.unwrap();
                            }
                        }
                    }
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
            let dt = t.elapsed();
            let after = commandstats(&mut admin).await;
            let (top, all, _) = calls(&after, &before, matches!(v, P2::RawFloor));
            (
                grants as f64 / dt.as_secs_f64(),
                top as f64 / grants as f64,
                all as f64 / grants as f64,
            )
        });
        rows.push((v, rate, top, all));
    }
    let floor = rows[0].1;
    let lock = rows[1].1;
    for (v, rate, top, all) in rows {
        let label = match v {
            P2::RawFloor => "raw SET NX PX + DEL pairs on 4 keys (no waiting)",
            P2::Lock => "dlock Lock, wait 10 s",
            P2::Semaphore4 => "dlock Semaphore(4), wait 10 s",
        };
        println!(
            "| {label} | {rate:.0} | {:.2} | {:.2} | {top:.2} | {all:.2} |",
            rate / floor,
            rate / lock
        );
    }
    println!();
}

// ---------------------------------------------------------------------------------------------
// P3: hand-off latency
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum H {
    Lock,
    Permit,
    WriteWrite,
    WriteRead,
    ReadWrite,
}

/// Holds `h`'s first side on `a`; returns a release future's outcome after the waiter on `b` is
/// queued; the time from the release call to the waiter's grant.
async fn handoff(h: H, a: &Arc<dyn Backend>, b: &Arc<dyn Backend>, i: usize) -> Duration {
    let name = format!("p3-{h:?}-{i}");
    let wait = Duration::from_secs(10);
    // The waiter, started once the holder holds; reports its grant time.
    let (tx, rx) = tokio::sync::oneshot::channel::<Instant>();
    macro_rules! waiter {
        ($acq:expr) => {{
            let fut = $acq;
            tokio::spawn(async move {
                let g = fut.await.unwrap();
                let _ = tx.send(Instant::now());
                drop(g);
            })
        }};
    }
    let rw = |be: &Arc<dyn Backend>| RwLock::new(name.clone()).ttl(TTL).with_backend(be.clone());
    let sem = |be: &Arc<dyn Backend>| {
        Semaphore::new(name.clone(), 1)
            .ttl(TTL)
            .with_backend(be.clone())
    };
    let lock = |be: &Arc<dyn Backend>| Lock::new(name.clone()).ttl(TTL).with_backend(be.clone());
    let settle = Duration::from_millis(30);
    let released;
    let task = match h {
        H::Lock => {
            let g = lock(a).acquire().await.unwrap();
            let l = lock(b).wait(wait);
            let t = waiter!(async move { l.acquire().await });
            tokio::time::sleep(settle).await;
            released = Instant::now();
            g.release().await.unwrap();
            t
        }
        H::Permit => {
            let g = sem(a).acquire().await.unwrap();
            let s = sem(b).wait(wait);
            let t = waiter!(async move { s.acquire().await });
            tokio::time::sleep(settle).await;
            released = Instant::now();
            g.release().await.unwrap();
            t
        }
        H::WriteWrite | H::WriteRead => {
            let g = rw(a).write().await.unwrap();
            let l = rw(b).wait(wait);
            let t = if matches!(h, H::WriteWrite) {
                waiter!(async move { l.write().await.map(|g| g.into_inner()) })
            } else {
                waiter!(async move { l.read().await.map(|g| g.into_inner()) })
            };
            tokio::time::sleep(settle).await;
            released = Instant::now();
            g.release().await.unwrap();
            t
        }
        H::ReadWrite => {
            let g = rw(a).read().await.unwrap();
            let l = rw(b).wait(wait);
            let t = waiter!(async move { l.write().await.map(|g| g.into_inner()) });
            tokio::time::sleep(settle).await;
            released = Instant::now();
            g.release().await.unwrap();
            t
        }
    };
    let granted = rx.await.expect("the waiter got it");
    task.await.unwrap();
    granted.saturating_duration_since(released)
}

fn p3(url: &str) {
    const N: usize = 200;
    let rt = multi_thread();
    println!(
        "P3 hand-off: holder on one backend, waiter on another; release call → waiter's grant, {N} each (interleaved)"
    );
    println!("| hand-off | p50 | p90 | p99 | p50 ÷ lock's |");
    println!("|---|---:|---:|---:|---:|");
    let all = [
        H::Lock,
        H::Permit,
        H::WriteWrite,
        H::WriteRead,
        H::ReadWrite,
    ];
    let res: Vec<Vec<Duration>> = rt.block_on(async {
        let a = backend(url).await;
        let b = backend(url).await;
        let mut res = vec![Vec::new(); all.len()];
        for i in 0..N {
            for (k, h) in all.iter().enumerate() {
                res[k].push(handoff(*h, &a, &b, i).await);
            }
        }
        res
    });
    let mut sorted: Vec<Vec<Duration>> = res;
    for s in &mut sorted {
        s.sort();
    }
    let lock_p50 = pct(&sorted[0], 0.5);
    for (k, h) in all.iter().enumerate() {
        let label = match h {
            H::Lock => "lock → lock",
            H::Permit => "permit → permit (Semaphore(1))",
            H::WriteWrite => "write → write",
            H::WriteRead => "write → read",
            H::ReadWrite => "read → write",
        };
        let s = &sorted[k];
        println!(
            "| {label} | {} | {} | {} | {:.2} |",
            us(pct(s, 0.5)),
            us(pct(s, 0.9)),
            us(pct(s, 0.99)),
            pct(s, 0.5).as_secs_f64() / lock_p50.as_secs_f64()
        );
    }
    println!();
}

fn main() {
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .map(|a| a.to_lowercase())
        .collect();
    let on = |w: &str| filter.is_empty() || filter.iter().any(|f| f == w);
    let scale = env_f64("DLOCK_BENCH_SCALE", 1.0);
    let rounds = env_f64("DLOCK_BENCH_ROUNDS", 5.0) as usize;
    let started = Instant::now();
    let server = Server::start("prims", &[]);
    let url = server.url();
    println!(
        "dlock primitives_bench: redis-server {} on 127.0.0.1:{} (no persistence), scale {scale}, {rounds} rounds",
        Server::version(),
        server.port
    );
    println!();
    if on("p1") {
        p1(&url, scale, rounds);
    }
    if on("p2") {
        p2(&url, scale);
    }
    if on("p3") {
        p3(&url);
    }
    println!("total {:.1} s", started.elapsed().as_secs_f64());
    drop(server);
}
