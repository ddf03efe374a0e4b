//! Every `#[distributed_lock]` option against a real `redis-server`. Each test starts its own
//! private server (tests/common: loopback, free port) and registers it under a backend name
//! used by that test only, so the tests of this binary run in parallel without sharing locks or
//! keys. The effect of each option is checked in Redis itself through an admin connection: the
//! lock hashes that exist while a body runs, their PTTL, the hold count, the fence key.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::extract::Path;
use common::{RedisProc, Rng, eventually, section_pause};
use dlock::{Lock, LockError, LockGuard, LostReason, OnBusy, Policy, distributed_lock};
use redis::aio::MultiplexedConnection;
use tokio::sync::oneshot;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Generous bound for anything that should happen "now" (a body entering, a hand-off).
const SOON: Duration = Duration::from_secs(10);

/// A private server registered as the backend `name`.
async fn server(name: &str) -> RedisProc {
    let redis = tokio::task::spawn_blocking(RedisProc::start)
        .await
        .expect("start redis-server");
    dlock::init_named(name, &redis.url())
        .await
        .unwrap_or_else(|e| panic!("init_named({name}): {e}"));
    redis
}

/// The Redis lock hash of a lock name.
fn lock_key(name: &str) -> String {
    dlock::backend::redis_keys(name).lock
}

async fn exists(con: &mut MultiplexedConnection, name: &str) -> bool {
    let n: i64 = redis::cmd("EXISTS")
        .arg(lock_key(name))
        .query_async(con)
        .await
        .expect("EXISTS");
    n == 1
}

async fn pttl(con: &mut MultiplexedConnection, name: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(lock_key(name))
        .query_async(con)
        .await
        .expect("PTTL")
}

async fn hash(con: &mut MultiplexedConnection, name: &str) -> HashMap<String, String> {
    redis::cmd("HGETALL")
        .arg(lock_key(name))
        .query_async(con)
        .await
        .expect("HGETALL")
}

/// The hold counts in a lock hash (every field but `:fence`), owner -> count.
async fn holders(con: &mut MultiplexedConnection, name: &str) -> HashMap<String, i64> {
    hash(con, name)
        .await
        .into_iter()
        .filter(|(k, _)| k != ":fence")
        .map(|(k, v)| (k, v.parse().expect("hold count is an integer")))
        .collect()
}

/// Every lock hash in the server right now (fence keys are strings and are left out).
async fn lock_hashes(con: &mut MultiplexedConnection) -> BTreeSet<String> {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("dlock:*")
        .query_async(con)
        .await
        .expect("KEYS");
    let mut out = BTreeSet::new();
    for k in keys {
        let t: String = redis::cmd("TYPE")
            .arg(&k)
            .query_async(con)
            .await
            .expect("TYPE");
        if t == "hash" {
            out.insert(k);
        }
    }
    out
}

fn set<const N: usize>(names: [&str; N]) -> BTreeSet<String> {
    names.iter().map(|n| lock_key(n)).collect()
}

/// A contender with its own owner, in its own task (so no lock context can be inherited).
async fn try_take(backend: &'static str, name: &str) -> Result<LockGuard, LockError> {
    let name = name.to_string();
    tokio::spawn(async move { Lock::new(name).backend(backend).acquire().await })
        .await
        .expect("contender task")
}

/// Asserts that another owner is refused the lock `name` right now.
async fn assert_refused(backend: &'static str, name: &str, what: &str) {
    match try_take(backend, name).await {
        Err(e) if e.is_contended() => {}
        Ok(g) => {
            let _ = g.release().await;
            panic!("{what}: a contender got `{name}` although it should be held");
        }
        Err(e) => panic!("{what}: contender on `{name}`: unexpected error {e:?}"),
    }
}

/// Lets a test hold an annotated body at a known point: the body calls [`Gate::pass`], which
/// reports that it is inside and waits for the test to let it go.
struct Gate {
    entered: oneshot::Sender<()>,
    go: oneshot::Receiver<()>,
}

struct GateCtl {
    entered: oneshot::Receiver<()>,
    go: oneshot::Sender<()>,
}

fn gate() -> (Gate, GateCtl) {
    let (etx, erx) = oneshot::channel();
    let (gtx, grx) = oneshot::channel();
    (
        Gate {
            entered: etx,
            go: grx,
        },
        GateCtl {
            entered: erx,
            go: gtx,
        },
    )
}

impl Gate {
    async fn pass(self) {
        let _ = self.entered.send(());
        let _ = self.go.await;
    }
}

impl GateCtl {
    /// Waits until the body is inside; panics when the call ended without entering it.
    async fn inside(&mut self) {
        tokio::time::timeout(SOON, &mut self.entered)
            .await
            .expect("the body did not enter within 10 s")
            .expect("the call returned without running the body");
    }

    fn release(self) {
        let _ = self.go.send(());
    }
}

/// Runs `call(gate)` and, while its body is held at the gate, runs `check`; then lets the body
/// go and returns the call's output with the check's.
async fn while_held<Fut, C, CFut>(
    call: impl FnOnce(Gate) -> Fut,
    check: C,
) -> (Fut::Output, CFut::Output)
where
    Fut: Future,
    C: FnOnce() -> CFut,
    CFut: Future,
{
    let (g, mut ctl) = gate();
    let observe = async move {
        ctl.inside().await;
        let out = check().await;
        ctl.release();
        out
    };
    tokio::join!(call(g), observe)
}

/// Sets a flag when dropped: proves a body future was dropped rather than finished.
struct SetOnDrop(Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

// ---------------------------------------------------------------------------------------------
// Key templates
// ---------------------------------------------------------------------------------------------

const KEYS_B: &str = "mr_keys";

#[distributed_lock(key = "a:{x}:{y}", backend = "mr_keys")]
async fn two_parts(x: &str, y: &str, gate: Gate) -> Result<(), LockError> {
    let _ = (x, y);
    gate.pass().await;
    Ok(())
}

struct Request {
    user: User,
    region: &'static str,
}

struct User {
    id: u32,
}

#[distributed_lock(key = "user:{req.user.id}@{region}", backend = "mr_keys")]
async fn field_paths(
    req: &Request,
    Request { region, .. }: &Request,
    gate: Gate,
) -> Result<u32, LockError> {
    let _ = region;
    gate.pass().await;
    Ok(req.user.id)
}

/// The axum handler shape, with axum's own extractor.
#[distributed_lock(key = "order:{order_id}", backend = "mr_keys")]
async fn handler(Path(order_id): Path<u64>, gate: Gate) -> Result<u64, LockError> {
    gate.pass().await;
    Ok(order_id * 2)
}

#[distributed_lock(key = "{{literal}}:{id}", backend = "mr_keys")]
async fn braces(id: u32, gate: Gate) -> Result<(), LockError> {
    let _ = id;
    gate.pass().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_templates_name_the_expected_redis_keys() {
    let redis = server(KEYS_B).await;
    let mut con = redis.admin_async().await;

    // Parameters, escaped: ("1:2", "3") and ("1", "2:3") are two locks, held at the same time.
    let c2 = con.clone();
    let (r1, (r2, keys)) = while_held(
        |g| two_parts("1:2", "3", g),
        || async move {
            let mut c3 = c2.clone();
            while_held(
                |g| two_parts("1", "2:3", g),
                || async move { lock_hashes(&mut c3).await },
            )
            .await
        },
    )
    .await;
    r1.unwrap();
    r2.expect("(\"1\", \"2:3\") is another lock than (\"1:2\", \"3\"), so it is free");
    assert_eq!(keys, set(["a:1\\:2:3", "a:1:2\\:3"]));
    assert_eq!(
        keys,
        BTreeSet::from([
            "dlock:{a:1\\\\:2:3}".to_string(),
            "dlock:{a:1:2\\\\:3}".to_string()
        ])
    );
    assert!(lock_hashes(&mut con).await.is_empty(), "both released");

    // A field path and a binding from a destructuring pattern.
    let req = Request {
        user: User { id: 5 },
        region: "eu",
    };
    let c = con.clone();
    let (r, keys) = while_held(
        |g| field_paths(&req, &req, g),
        || async move { lock_hashes(&mut c.clone()).await },
    )
    .await;
    assert_eq!(r.unwrap(), 5);
    assert_eq!(keys, set(["user:5@eu"]));

    // axum's `Path(order_id): Path<u64>`.
    let c = con.clone();
    let (r, keys) = while_held(
        |g| handler(Path(21), g),
        || async move { lock_hashes(&mut c.clone()).await },
    )
    .await;
    assert_eq!(r.unwrap(), 42);
    assert_eq!(keys, set(["order:21"]));

    // `{{` and `}}` are literal braces (escaped again by the Redis naming rule).
    let c = con.clone();
    let (r, keys) = while_held(
        |g| braces(7, g),
        || async move { lock_hashes(&mut c.clone()).await },
    )
    .await;
    r.unwrap();
    assert_eq!(keys, set(["{literal}:7"]));
    assert_eq!(
        keys,
        BTreeSet::from(["dlock:{\\(literal\\):7}".to_string()])
    );
    assert!(lock_hashes(&mut con).await.is_empty());
}

const PLAIN_B: &str = "mr_plain";

#[distributed_lock(key = "order:{order_id}", backend = "mr_plain")]
async fn by_order(order_id: u64, gate: Option<Gate>) -> Result<u64, LockError> {
    if let Some(g) = gate {
        g.pass().await;
    }
    Ok(order_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_value_names_the_same_lock_as_lock_new() {
    let redis = server(PLAIN_B).await;
    let mut con = redis.admin_async().await;

    // Held by the macro: the key is Lock::new's, and Lock::new is refused.
    let c = con.clone();
    let (r, keys) = while_held(
        |g| by_order(42, Some(g)),
        || async move {
            let keys = lock_hashes(&mut c.clone()).await;
            assert_refused(PLAIN_B, "order:42", "macro holds order:42").await;
            keys
        },
    )
    .await;
    assert_eq!(r.unwrap(), 42);
    assert_eq!(keys, BTreeSet::from(["dlock:{order:42}".to_string()]));

    // Held by Lock::new: the macro is refused on 42, free on 43.
    let g = Lock::new("order:42")
        .backend(PLAIN_B)
        .acquire()
        .await
        .unwrap();
    let e = by_order(42, None).await.unwrap_err();
    assert!(matches!(e, LockError::Busy { .. }), "{e:?}");
    assert_eq!(e.key(), Some("order:42"));
    assert_eq!(by_order(43, None).await.unwrap(), 43);
    g.release().await.unwrap();
    assert_eq!(by_order(42, None).await.unwrap(), 42);
    assert!(!exists(&mut con, "order:42").await);
}

// ---------------------------------------------------------------------------------------------
// ttl, wait
// ---------------------------------------------------------------------------------------------

const TTL_B: &str = "mr_ttl";

#[distributed_lock(key = "ttl5", backend = "mr_ttl", ttl = "5s")]
async fn ttl_five(gate: Gate) -> Result<(), LockError> {
    gate.pass().await;
    Ok(())
}

#[distributed_lock(key = "ttl-default", backend = "mr_ttl")]
async fn ttl_default(gate: Gate) -> Result<(), LockError> {
    gate.pass().await;
    Ok(())
}

#[distributed_lock(key = "ttl-90s", backend = "mr_ttl", ttl = "1m 30s")]
async fn ttl_humantime(gate: Gate) -> Result<(), LockError> {
    gate.pass().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_is_the_lease_in_redis() {
    let redis = server(TTL_B).await;
    let con = redis.admin_async().await;
    for (name, ttl_ms) in [
        ("ttl5", 5_000),
        ("ttl-default", 30_000),
        ("ttl-90s", 90_000),
    ] {
        let c = con.clone();
        let check = || async move { pttl(&mut c.clone(), name).await };
        let (r, seen) = match name {
            "ttl5" => while_held(ttl_five, check).await,
            "ttl-default" => while_held(ttl_default, check).await,
            _ => while_held(ttl_humantime, check).await,
        };
        r.unwrap();
        // At most the ttl; well above ttl - 1 s right after entering (the watchdog renews at
        // ttl/3, so it never drops below 2/3 of it either).
        assert!(
            seen <= ttl_ms && seen > ttl_ms - 1_000,
            "{name}: PTTL {seen} ms while the body runs, ttl {ttl_ms} ms"
        );
    }
    assert!(lock_hashes(&mut con.clone()).await.is_empty());
}

const WAIT_B: &str = "mr_wait";

#[distributed_lock(key = "w", backend = "mr_wait")]
async fn wait_holder(gate: Gate, inside: &AtomicBool) -> Result<(), LockError> {
    inside.store(true, Ordering::SeqCst);
    gate.pass().await;
    inside.store(false, Ordering::SeqCst);
    Ok(())
}

#[distributed_lock(key = "w", backend = "mr_wait", wait = "10s")]
async fn patient(holder_inside: &AtomicBool) -> Result<Instant, LockError> {
    assert!(
        !holder_inside.load(Ordering::SeqCst),
        "the waiter ran while the holder was inside"
    );
    Ok(Instant::now())
}

#[distributed_lock(key = "w", backend = "mr_wait", wait = "300ms")]
async fn impatient() -> Result<(), LockError> {
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_acquires_after_the_holder_returns_or_times_out() {
    let redis = server(WAIT_B).await;
    let mut con = redis.admin_async().await;
    let inside = AtomicBool::new(false);

    let (holder, (returned_at, waiter)) = while_held(
        |g| wait_holder(g, &inside),
        || async {
            // TimedOut at the deadline.
            let t0 = Instant::now();
            let e = impatient().await.unwrap_err();
            let waited = t0.elapsed();
            assert!(matches!(e, LockError::TimedOut { .. }), "{e:?}");
            assert_eq!(e.key(), Some("w"));
            assert!(
                waited >= Duration::from_millis(300) && waited < Duration::from_secs(5),
                "timed out after {waited:?}"
            );
            // A patient waiter is still waiting while the holder is inside.
            let mut waiter = Box::pin(patient(&inside));
            let early = tokio::time::timeout(Duration::from_millis(300), &mut waiter).await;
            assert!(
                early.is_err(),
                "the waiter finished while the lock was held: {early:?}"
            );
            (Instant::now(), waiter)
        },
    )
    .await;
    holder.unwrap();
    // The body has been let go; the waiter takes the lock after the holder returns.
    let got = tokio::time::timeout(SOON, waiter)
        .await
        .expect("the waiter got the lock within 10 s of the release")
        .expect("the waiter got the lock");
    assert!(got >= returned_at);
    assert!(!exists(&mut con, "w").await);
}

// ---------------------------------------------------------------------------------------------
// watchdog
// ---------------------------------------------------------------------------------------------

const WD_ON_B: &str = "mr_watchdog_on";
const WD_OFF_B: &str = "mr_watchdog_off";

#[distributed_lock(key = "wd-on", backend = "mr_watchdog_on", ttl = "500ms")]
async fn renewed(done: &AtomicBool) -> Result<u32, LockError> {
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    done.store(true, Ordering::SeqCst);
    Ok(1)
}

#[distributed_lock(
    key = "wd-off",
    backend = "mr_watchdog_off",
    ttl = "500ms",
    watchdog = false,
    on_lost = "continue"
)]
async fn not_renewed(started: &tokio::sync::Notify, done: &AtomicBool) -> Result<u32, LockError> {
    started.notify_one();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    done.store(true, Ordering::SeqCst);
    Ok(2)
}

#[distributed_lock(
    key = "wd-off-cancel",
    backend = "mr_watchdog_off",
    ttl = "400ms",
    watchdog = false
)]
async fn not_renewed_cancelled(dropped: Arc<AtomicBool>) -> Result<u32, LockError> {
    let _flag = SetOnDrop(dropped);
    tokio::time::sleep(Duration::from_secs(5)).await;
    Ok(3)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchdog_on_keeps_the_key_for_three_ttls() {
    let redis = server(WD_ON_B).await;
    let mut con = redis.admin_async().await;
    let done = AtomicBool::new(false);
    let observe = async {
        // Until the body (3 x ttl) is done: the key always exists, PTTL never above the ttl,
        // and another owner is always refused.
        let mut samples = 0;
        tokio::time::sleep(Duration::from_millis(50)).await;
        while !done.load(Ordering::SeqCst) {
            let t = pttl(&mut con, "wd-on").await;
            if done.load(Ordering::SeqCst) {
                break;
            }
            assert!(t > 0 && t <= 500, "PTTL {t} ms while the body runs");
            // The body may end (and its lock be released) between the check of `done` above
            // and this contender's try: a grant then is no failure (seen under load).
            if let Ok(g) = try_take(WD_ON_B, "wd-on").await {
                let _ = g.release().await;
                assert!(
                    done.load(Ordering::SeqCst),
                    "watchdog on: a contender got `wd-on` while the body runs"
                );
                break;
            }
            samples += 1;
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        samples
    };
    let (r, samples) = tokio::join!(renewed(&done), observe);
    assert_eq!(r.unwrap(), 1);
    assert!(samples >= 5, "only {samples} samples in 1.5 s");
    assert!(!exists(&mut con, "wd-on").await, "released after the body");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchdog_off_lets_the_key_expire_after_the_ttl() {
    let redis = server(WD_OFF_B).await;
    let mut con = redis.admin_async().await;
    let started = tokio::sync::Notify::new();
    let done = AtomicBool::new(false);
    let observe = async {
        started.notified().await;
        let t0 = Instant::now();
        let first = pttl(&mut con, "wd-off").await;
        assert!(first > 0 && first <= 500, "PTTL {first} ms at the start");
        let mut c = con.clone();
        assert!(
            eventually(Duration::from_secs(2), || {
                let mut c = c.clone();
                async move { !exists(&mut c, "wd-off").await }
            })
            .await,
            "the key still exists 2 s into a 500 ms lease without watchdog"
        );
        let gone_after = t0.elapsed();
        assert!(
            gone_after >= Duration::from_millis(300),
            "the key vanished after {gone_after:?}, before its 500 ms ttl"
        );
        assert!(!done.load(Ordering::SeqCst), "the body is still running");
        // The lock is free for others while the body still runs.
        let g = try_take(WD_OFF_B, "wd-off")
            .await
            .expect("the expired lock is free");
        assert!(holders(&mut c, "wd-off").await.len() == 1);
        g.release().await.unwrap();
    };
    let (r, ()) = tokio::join!(not_renewed(&started, &done), observe);
    assert_eq!(r.unwrap(), 2, "on_lost = \"continue\": the body finished");

    // With the default on_lost = "cancel", the expiry is noticed and the body dropped.
    let dropped = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let e = not_renewed_cancelled(dropped.clone()).await.unwrap_err();
    assert!(e.is_lost(), "{e:?}");
    assert!(dropped.load(Ordering::SeqCst));
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "lost noticed after {:?}",
        t0.elapsed()
    );
    // The client's deadline counts from the send, the server's expiry from its receipt, so the
    // key may outlive the client's `lost` by the one-way delay (a few ms; more under load).
    let gone = eventually(Duration::from_secs(1), || {
        let mut con = con.clone();
        async move { !exists(&mut con, "wd-off-cancel").await }
    })
    .await;
    assert!(gone, "the key outlived the lost lease by over a second");
}

// ---------------------------------------------------------------------------------------------
// on_busy
// ---------------------------------------------------------------------------------------------

const BUSY_B: &str = "mr_busy";

#[distributed_lock(key = "busy", backend = "mr_busy", on_busy = "skip")]
async fn skip_option() -> Option<u32> {
    Some(1)
}

#[distributed_lock(key = "busy", backend = "mr_busy", on_busy = "skip")]
async fn skip_unit(ran: &AtomicBool) {
    ran.store(true, Ordering::SeqCst);
}

#[derive(Debug)]
enum AppError {
    Locked(Option<Duration>),
    #[allow(dead_code)]
    Other(LockError),
}

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        if e.is_contended() {
            AppError::Locked(e.retry_after())
        } else {
            AppError::Other(e)
        }
    }
}

#[distributed_lock(key = "busy", backend = "mr_busy", on_busy = "error")]
async fn custom_error(ran: &AtomicBool) -> Result<u32, AppError> {
    ran.store(true, Ordering::SeqCst);
    Ok(2)
}

#[distributed_lock(key = "busy", backend = "mr_busy")]
async fn default_error(ran: &AtomicBool) -> Result<u32, LockError> {
    ran.store(true, Ordering::SeqCst);
    Ok(3)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_busy_error_and_skip() {
    let redis = server(BUSY_B).await;
    let mut con = redis.admin_async().await;
    let ran = AtomicBool::new(false);

    // Free: every variant runs.
    assert_eq!(skip_option().await, Some(1));
    skip_unit(&ran).await;
    assert!(ran.swap(false, Ordering::SeqCst));
    assert_eq!(custom_error(&ran).await.unwrap(), 2);
    assert!(ran.swap(false, Ordering::SeqCst));
    assert_eq!(default_error(&ran).await.unwrap(), 3);
    assert!(ran.swap(false, Ordering::SeqCst));
    assert!(!exists(&mut con, "busy").await);

    // Held by another owner with a 20 s lease.
    let g = Lock::new("busy")
        .backend(BUSY_B)
        .ttl(Duration::from_secs(20))
        .acquire()
        .await
        .unwrap();
    let before = hash(&mut con, "busy").await;
    assert_eq!(skip_option().await, None);
    skip_unit(&ran).await;
    match custom_error(&ran).await {
        Err(AppError::Locked(Some(d))) => assert!(
            d > Duration::from_secs(15) && d <= Duration::from_secs(20),
            "retry_after {d:?} from the holder's 20 s lease"
        ),
        other => panic!("expected AppError::Locked(Some(_)), got {other:?}"),
    }
    let e = default_error(&ran).await.unwrap_err();
    assert!(matches!(e, LockError::Busy { .. }), "{e:?}");
    assert_eq!(e.key(), Some("busy"));
    assert!(
        !ran.load(Ordering::SeqCst),
        "no body ran while the lock was held"
    );
    assert_eq!(
        hash(&mut con, "busy").await,
        before,
        "refused calls left the holder's hash alone"
    );
    g.release().await.unwrap();
    assert_eq!(skip_option().await, Some(1));
}

// ---------------------------------------------------------------------------------------------
// hold_at_least
// ---------------------------------------------------------------------------------------------

const HOLD_B: &str = "mr_hold";

#[distributed_lock(
    key = "job",
    backend = "mr_hold",
    hold_at_least = "1500ms",
    on_busy = "skip"
)]
async fn job(runs: &AtomicUsize) {
    runs.fetch_add(1, Ordering::SeqCst);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_at_least_keeps_the_key_for_the_remainder() {
    let redis = server(HOLD_B).await;
    let mut con = redis.admin_async().await;
    let runs = AtomicUsize::new(0);

    let t0 = Instant::now();
    job(&runs).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // The fn has returned; the key is kept for the rest of the 1.5 s, with a zero hold count.
    assert!(exists(&mut con, "job").await, "hold_at_least kept the key");
    let left = pttl(&mut con, "job").await;
    let elapsed = t0.elapsed().as_millis() as i64;
    assert!(
        left <= 1_500 && left >= 1_500 - elapsed - 200,
        "PTTL {left} ms, {elapsed} ms after the call started"
    );
    let h = holders(&mut con, "job").await;
    assert_eq!(h.values().copied().collect::<Vec<_>>(), vec![0], "{h:?}");

    // Skipped for as long as the key lives.
    let mut skipped = 0;
    while t0.elapsed() < Duration::from_millis(1_200) {
        job(&runs).await;
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "ran again inside hold_at_least"
        );
        skipped += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(skipped >= 3, "{skipped}");

    let mut c = con.clone();
    assert!(
        eventually(Duration::from_secs(3), || {
            let mut c = c.clone();
            async move { !exists(&mut c, "job").await }
        })
        .await,
        "the kept key expired"
    );
    let gone = t0.elapsed();
    assert!(
        gone >= Duration::from_millis(1_400),
        "the key vanished after {gone:?}, before hold_at_least"
    );
    job(&runs).await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "runs again once the key expired"
    );
    assert!(exists(&mut c, "job").await);
}

// ---------------------------------------------------------------------------------------------
// on_lost
// ---------------------------------------------------------------------------------------------

const LOST_CANCEL_B: &str = "mr_lost_cancel";
const LOST_CONTINUE_B: &str = "mr_lost_continue";

#[distributed_lock(key = "lost-cancel", backend = "mr_lost_cancel", ttl = "1500ms")]
async fn long_body(
    started: &tokio::sync::Notify,
    dropped: Arc<AtomicBool>,
    finished: &AtomicBool,
) -> Result<(), LockError> {
    let _flag = SetOnDrop(dropped);
    started.notify_one();
    tokio::time::sleep(Duration::from_secs(10)).await;
    finished.store(true, Ordering::SeqCst);
    Ok(())
}

#[distributed_lock(
    key = "lost-continue",
    backend = "mr_lost_continue",
    ttl = "600ms",
    on_lost = "continue"
)]
async fn finishes_anyway(
    started: &tokio::sync::Notify,
    deleted: &tokio::sync::Notify,
    finished: &AtomicBool,
) -> Result<u32, LockError> {
    started.notify_one();
    deleted.notified().await;
    // Longer than ttl/3: the watchdog has found the hold gone by now.
    tokio::time::sleep(Duration::from_millis(700)).await;
    finished.store(true, Ordering::SeqCst);
    Ok(7)
}

async fn del(con: &mut MultiplexedConnection, name: &str) {
    let n: i64 = redis::cmd("DEL")
        .arg(lock_key(name))
        .query_async(con)
        .await
        .expect("DEL");
    assert_eq!(n, 1, "the lock key of {name} existed while the body ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_lost_cancel_drops_the_body_when_the_key_is_deleted() {
    let redis = server(LOST_CANCEL_B).await;
    let mut con = redis.admin_async().await;
    let started = tokio::sync::Notify::new();
    let dropped = Arc::new(AtomicBool::new(false));
    let finished = AtomicBool::new(false);
    let call = async {
        let r = long_body(&started, dropped.clone(), &finished).await;
        (Instant::now(), r)
    };
    let delete = async {
        started.notified().await;
        assert!(!dropped.load(Ordering::SeqCst));
        del(&mut con.clone(), "lost-cancel").await;
        Instant::now()
    };
    let ((returned, r), deleted) = tokio::join!(call, delete);
    let e = r.unwrap_err();
    match &e {
        LockError::Lost { key, reason } => {
            assert_eq!(key, "lost-cancel");
            assert_eq!(
                *reason,
                LostReason::NotOwner,
                "found by the watchdog's renewal"
            );
        }
        other => panic!("expected Lost, got {other:?}"),
    }
    assert!(
        dropped.load(Ordering::SeqCst),
        "the body future was dropped"
    );
    assert!(!finished.load(Ordering::SeqCst), "the body did not finish");
    // Noticed at the next renewal (every ttl/3 = 500 ms), plus a margin.
    let after = returned.saturating_duration_since(deleted);
    assert!(
        after < Duration::from_millis(500 + 1_000),
        "Lost returned {after:?} after the DEL"
    );
    assert!(
        !exists(&mut con, "lost-cancel").await,
        "nothing re-created the deleted key"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_lost_continue_lets_the_body_finish() {
    let redis = server(LOST_CONTINUE_B).await;
    let mut con = redis.admin_async().await;
    let started = tokio::sync::Notify::new();
    let deleted = tokio::sync::Notify::new();
    let finished = AtomicBool::new(false);
    let delete = async {
        started.notified().await;
        del(&mut con.clone(), "lost-continue").await;
        deleted.notify_one();
    };
    let (r, ()) = tokio::join!(finishes_anyway(&started, &deleted, &finished), delete);
    assert_eq!(r.unwrap(), 7);
    assert!(finished.load(Ordering::SeqCst));
    assert!(!exists(&mut con, "lost-continue").await);
}

// ---------------------------------------------------------------------------------------------
// policy
// ---------------------------------------------------------------------------------------------

const POLICY_B: &str = "mr_policy";

#[distributed_lock(key = "pol-code", policy = "mr-policy-code")]
async fn policy_code(gate: Gate) -> Result<(), LockError> {
    gate.pass().await;
    Ok(())
}

#[distributed_lock(key = "pol-file", policy = "mr-policy-file")]
async fn policy_file(gate: Gate) -> Result<(), LockError> {
    gate.pass().await;
    Ok(())
}

#[distributed_lock(key = "pol-attr", policy = "mr-policy-file", ttl = "3s")]
async fn policy_attr(gate: Gate) -> Result<(), LockError> {
    gate.pass().await;
    Ok(())
}

#[distributed_lock(key = "pol-skip", policy = "mr-policy-code")]
async fn policy_skip(ran: &AtomicBool) -> Option<()> {
    ran.store(true, Ordering::SeqCst);
    Some(())
}

#[distributed_lock(key = "pol-wait", policy = "mr-policy-file")]
async fn policy_wait() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "pol-unknown", policy = "mr-policy-nobody-defined")]
async fn policy_unknown() -> Result<(), LockError> {
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_from_code_and_toml_on_redis() {
    let redis = server(POLICY_B).await;
    let mut con = redis.admin_async().await;

    let mut p = Policy::new();
    p.ttl = Some(Duration::from_secs(4));
    p.backend = Some(POLICY_B.to_string());
    p.on_busy = Some(OnBusy::Skip);
    dlock::define_policy("mr-policy-code", p);
    dlock::load_policies_str(&format!(
        "[policy.mr-policy-file]\nttl = \"7s\"\nwait = \"400ms\"\nbackend = \"{POLICY_B}\"\n"
    ))
    .expect("policy TOML");

    // The policies' backend is this server (the keys show up here) with the policies' ttl.
    for (name, ttl_ms) in [
        ("pol-code", 4_000),
        ("pol-file", 7_000),
        ("pol-attr", 3_000),
    ] {
        let c = con.clone();
        let check = || async move {
            let mut c = c.clone();
            (lock_hashes(&mut c).await, pttl(&mut c, name).await)
        };
        let (r, (keys, seen)) = match name {
            "pol-code" => while_held(policy_code, check).await,
            "pol-file" => while_held(policy_file, check).await,
            _ => while_held(policy_attr, check).await,
        };
        r.unwrap();
        assert_eq!(
            keys,
            set([name]),
            "{name}: held on the policy's Redis backend"
        );
        assert!(
            seen <= ttl_ms && seen > ttl_ms - 1_000,
            "{name}: PTTL {seen} ms, expected about {ttl_ms} ms"
        );
    }

    // on_busy = skip from the policy.
    let ran = AtomicBool::new(false);
    let g = Lock::new("pol-skip")
        .backend(POLICY_B)
        .acquire()
        .await
        .unwrap();
    assert_eq!(policy_skip(&ran).await, None);
    assert!(!ran.load(Ordering::SeqCst));
    g.release().await.unwrap();
    assert_eq!(policy_skip(&ran).await, Some(()));

    // wait = 400ms from the file: times out at that deadline.
    let g = Lock::new("pol-wait")
        .backend(POLICY_B)
        .acquire()
        .await
        .unwrap();
    let t0 = Instant::now();
    let e = policy_wait().await.unwrap_err();
    assert!(matches!(e, LockError::TimedOut { .. }), "{e:?}");
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(400) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    g.release().await.unwrap();
    policy_wait().await.unwrap();

    // An unknown policy: a configuration error at the call, naming the known policies.
    match policy_unknown().await {
        Err(LockError::UnknownPolicy { name, known }) => {
            assert_eq!(name, "mr-policy-nobody-defined");
            assert!(known.iter().any(|k| k == "mr-policy-code"), "{known:?}");
            assert!(known.iter().any(|k| k == "mr-policy-file"), "{known:?}");
        }
        other => panic!("expected UnknownPolicy, got {other:?}"),
    }
    assert!(lock_hashes(&mut con).await.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Reentrancy, fencing tokens
// ---------------------------------------------------------------------------------------------

const REENTER_B: &str = "mr_reenter";

#[distributed_lock(key = "acct:{id}", backend = "mr_reenter")]
async fn outer(id: u32, con: MultiplexedConnection) -> Result<(u64, u64), LockError> {
    let mut c = con.clone();
    let name = format!("acct:{id}");
    let mine = dlock::fencing_token().expect("inside the lock");
    let h = holders(&mut c, &name).await;
    assert_eq!(
        h.values().copied().collect::<Vec<_>>(),
        vec![1],
        "outer: {h:?}"
    );
    let inner_token = inner(id, con).await?;
    let after = holders(&mut c, &name).await;
    assert_eq!(after, h, "back to one hold after the inner call");
    // Another owner (a spawned task has no lock context) is still refused.
    assert_refused(REENTER_B, &name, "inside outer").await;
    Ok((mine, inner_token))
}

#[distributed_lock(key = "acct:{id}", backend = "mr_reenter")]
async fn inner(id: u32, mut con: MultiplexedConnection) -> Result<u64, LockError> {
    let h = holders(&mut con, &format!("acct:{id}")).await;
    assert_eq!(
        h.values().copied().collect::<Vec<_>>(),
        vec![2],
        "the nested call re-entered the same owner's hold: {h:?}"
    );
    Ok(dlock::fencing_token().expect("inside the lock"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_annotated_fns_on_one_key_reenter() {
    let redis = server(REENTER_B).await;
    let mut con = redis.admin_async().await;
    let (a, b) = tokio::time::timeout(SOON, outer(1, con.clone()))
        .await
        .expect("the nested call did not deadlock")
        .unwrap();
    assert_eq!(a, b, "one hold, one fencing token");
    assert!(
        !exists(&mut con, "acct:1").await,
        "deleted after the outer call"
    );
    // A second outer call is a fresh acquisition: a new, higher token.
    let (c, _) = outer(1, con.clone()).await.unwrap();
    assert!(c > a, "fencing tokens increase: {a} then {c}");
    assert!(!exists(&mut con, "acct:1").await);
    assert_eq!(dlock::fencing_token(), None);
}

const FENCE_B: &str = "mr_fence";

#[distributed_lock(key = "fenced:{id}", backend = "mr_fence")]
async fn fenced(id: u32, mut con: MultiplexedConnection) -> Result<u64, LockError> {
    let token = dlock::fencing_token().expect("inside the lock");
    let keys = dlock::backend::redis_keys(&format!("fenced:{id}"));
    let stored: String = redis::cmd("GET")
        .arg(&keys.fence)
        .query_async(&mut con)
        .await
        .expect("GET fence");
    assert_eq!(
        stored,
        token.to_string(),
        "fencing_token() is the fence key's value"
    );
    let in_hash: String = redis::cmd("HGET")
        .arg(&keys.lock)
        .arg(":fence")
        .query_async(&mut con)
        .await
        .expect("HGET :fence");
    assert_eq!(in_hash, token.to_string());
    Ok(token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_token_is_the_fence_value_in_redis() {
    let redis = server(FENCE_B).await;
    let con = redis.admin_async().await;
    let mut last = 0;
    for _ in 0..5 {
        let t = fenced(9, con.clone()).await.unwrap();
        assert!(t > last, "tokens increase: {last} then {t}");
        last = t;
    }
    // A manual guard on the same name gets the next token.
    let g = Lock::new("fenced:9")
        .backend(FENCE_B)
        .acquire()
        .await
        .unwrap();
    assert!(g.fencing_token() > last);
    g.release().await.unwrap();
    assert_eq!(dlock::fencing_token(), None, "outside any body");
}

// ---------------------------------------------------------------------------------------------
// Methods
// ---------------------------------------------------------------------------------------------

const METHODS_B: &str = "mr_methods";

struct Account {
    id: u32,
    balance: u64,
}

impl Account {
    #[distributed_lock(key = "acct:{self.id}", backend = "mr_methods")]
    async fn balance(&self, gate: Gate) -> Result<u64, LockError> {
        gate.pass().await;
        Ok(self.balance)
    }

    #[distributed_lock(key = "acct:{self.id}", backend = "mr_methods")]
    async fn deposit(&mut self, amount: u64, gate: Gate) -> Result<u64, LockError> {
        gate.pass().await;
        self.balance += amount;
        Ok(self.balance)
    }

    #[distributed_lock(key = "acct:{self.id}", backend = "mr_methods")]
    async fn shared(self: Arc<Self>, gate: Option<Gate>) -> Result<u32, LockError> {
        if let Some(g) = gate {
            g.pass().await;
        }
        Ok(self.id)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn methods_lock_on_self_fields() {
    let redis = server(METHODS_B).await;
    let mut con = redis.admin_async().await;
    let mut acct = Account { id: 7, balance: 10 };

    let c = con.clone();
    let (r, keys) = while_held(
        |g| acct.deposit(5, g),
        || async move { lock_hashes(&mut c.clone()).await },
    )
    .await;
    assert_eq!(r.unwrap(), 15);
    assert_eq!(keys, set(["acct:7"]), "&mut self");

    let acct = Arc::new(acct);
    let c = con.clone();
    let other = acct.clone();
    let (r, (keys, busy)) = while_held(
        |g| acct.balance(g),
        || async move {
            let keys = lock_hashes(&mut c.clone()).await;
            // self: Arc<Self> on the same account is another owner: refused.
            let busy = other.shared(None).await;
            (keys, busy)
        },
    )
    .await;
    assert_eq!(r.unwrap(), 15);
    assert_eq!(keys, set(["acct:7"]), "&self");
    let e = busy.unwrap_err();
    assert!(matches!(e, LockError::Busy { .. }), "{e:?}");

    let c = con.clone();
    let (r, keys) = while_held(
        |g| acct.clone().shared(Some(g)),
        || async move { lock_hashes(&mut c.clone()).await },
    )
    .await;
    assert_eq!(r.unwrap(), 7);
    assert_eq!(keys, set(["acct:7"]), "self: Arc<Self>");
    assert!(lock_hashes(&mut con).await.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Exclusion, release
// ---------------------------------------------------------------------------------------------

const EXCL_B: &str = "mr_exclusion";

struct Shared {
    counter: AtomicU64,
    inside: AtomicUsize,
    max_inside: AtomicUsize,
    last_token: AtomicU64,
}

#[distributed_lock(key = "counter", backend = "mr_exclusion", wait = "30s")]
async fn increment(s: Arc<Shared>, seed: u64) -> Result<(), LockError> {
    let now = s.inside.fetch_add(1, Ordering::SeqCst) + 1;
    s.max_inside.fetch_max(now, Ordering::SeqCst);
    let token = dlock::fencing_token().expect("inside the lock");
    let prev = s.last_token.swap(token, Ordering::SeqCst);
    assert!(token > prev, "fencing tokens increase: {prev} then {token}");
    // A non-atomic read-modify-write: only the lock keeps it exact.
    let mut rng = Rng::new(seed);
    let v = s.counter.load(Ordering::SeqCst);
    section_pause(&mut rng).await;
    s.counter.store(v + 1, Ordering::SeqCst);
    s.inside.fetch_sub(1, Ordering::SeqCst);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_tasks_count_exactly() {
    let redis = server(EXCL_B).await;
    let mut con = redis.admin_async().await;
    const TASKS: u64 = 16;
    const EACH: u64 = 25;
    let s = Arc::new(Shared {
        counter: AtomicU64::new(0),
        inside: AtomicUsize::new(0),
        max_inside: AtomicUsize::new(0),
        last_token: AtomicU64::new(0),
    });
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let s = s.clone();
            tokio::spawn(async move {
                for i in 0..EACH {
                    increment(s.clone(), t * 1_000 + i).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(20), t)
            .await
            .expect("16 x 25 locked increments within 20 s")
            .expect("task");
    }
    assert_eq!(s.counter.load(Ordering::SeqCst), TASKS * EACH);
    assert_eq!(
        s.max_inside.load(Ordering::SeqCst),
        1,
        "two bodies were inside at once"
    );
    assert!(!exists(&mut con, "counter").await);
}

const REL_B: &str = "mr_release";

#[distributed_lock(key = "rel", backend = "mr_release")]
async fn quick() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "rel-err", backend = "mr_release")]
async fn early_error(fail: bool) -> Result<(), LockError> {
    if fail {
        return Err(LockError::Config("early return".into()));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_release_is_awaited_before_the_fn_returns() {
    let redis = server(REL_B).await;
    let mut con = redis.admin_async().await;
    for i in 0..30 {
        quick().await.unwrap();
        assert!(
            !exists(&mut con, "rel").await,
            "call {i}: key still there after return"
        );
        let e = early_error(i % 2 == 0).await;
        assert_eq!(e.is_err(), i % 2 == 0);
        assert!(
            !exists(&mut con, "rel-err").await,
            "call {i}: key still there after an early return"
        );
        // And the lock is free for another owner at once.
        try_take(REL_B, "rel")
            .await
            .expect("free right after the call")
            .release()
            .await
            .unwrap();
    }
}
