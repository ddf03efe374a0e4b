//! Behaviour of every `#[distributed_lock]` option, on the in-memory backend. Each test registers
//! a fresh `MemoryBackend` under its own name, so the tests of this binary run in parallel
//! without sharing locks.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock::{Lock, LockError, MemoryBackend, distributed_lock};

fn fresh(name: &'static str) -> Arc<MemoryBackend> {
    let b = Arc::new(MemoryBackend::new());
    dlock::register_arc(name, b.clone());
    b
}

async fn hold(backend: &'static str, key: &str) -> dlock::LockGuard {
    Lock::new(key)
        .backend(backend)
        .acquire()
        .await
        .expect("manual acquire")
}

fn busy_key(r: Result<(), LockError>) -> String {
    match r {
        Err(e @ LockError::Busy { .. }) => e.key().unwrap().to_string(),
        other => panic!("expected Busy, got {other:?}"),
    }
}

// ---- key rendering -------------------------------------------------------------------------

#[distributed_lock(key = "a:{x}:{y}", backend = "mo_escape")]
async fn two_parts(x: &str, y: &str) -> Result<(), LockError> {
    let _ = (x, y);
    Ok(())
}

#[tokio::test]
async fn values_cannot_forge_another_key() {
    fresh("mo_escape");
    // Held under the name ("1", "2:3") renders to: every value escapes `:`.
    let g = hold("mo_escape", "a:1:2\\:3").await;
    assert_eq!(busy_key(two_parts("1", "2:3").await), "a:1:2\\:3");
    // ("1:2", "3") names another lock: it is free.
    two_parts("1:2", "3").await.unwrap();
    g.release().await.unwrap();

    // And the escaped form is exactly `\` before the separator in the first value.
    let g = hold("mo_escape", "a:1\\:2:3").await;
    assert_eq!(busy_key(two_parts("1:2", "3").await), "a:1\\:2:3");
    two_parts("1", "2:3").await.unwrap();
    g.release().await.unwrap();

    // A backslash in a value is always escaped, so it cannot fake an escape either.
    let g = hold("mo_escape", "a:1\\\\:2").await;
    assert_eq!(busy_key(two_parts("1\\", "2").await), "a:1\\\\:2");
    g.release().await.unwrap();
}

/// `dlock::key!` renders exactly as the attribute does (issue 23: the manual API could not): the
/// attribute holding the key `key!` renders for the same values makes `key!`'s lock busy, for
/// values with every special character.
#[tokio::test]
async fn key_macro_renders_as_the_attribute() {
    fresh("mo_key_macro");
    #[distributed_lock(key = "k:{x}-{y.0}:{z}", backend = "mo_key_macro")]
    async fn body(
        x: &str,
        y: (&str,),
        z: &str,
        gate: tokio::sync::oneshot::Receiver<()>,
    ) -> Result<(), LockError> {
        let _ = (x, y, z);
        let _ = gate.await;
        Ok(())
    }
    let cases = [
        ("1", "2", "3"),
        ("a:b", "c-d", "e\\f"),
        ("", "-", ":"),
        ("x\\", ":", ""),
    ];
    for (x, y0, z) in cases {
        let y = (y0,);
        let rendered = dlock::key!("k:{x}-{y.0}:{z}");
        let (tx, rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move { body(x, (y0,), z, rx).await });
        // Wait until the attribute holds its lock, then the key! name is busy.
        let mut busy = None;
        for _ in 0..200 {
            match Lock::new(rendered.clone())
                .backend("mo_key_macro")
                .acquire()
                .await
            {
                Err(e @ LockError::Busy { .. }) => {
                    busy = Some(e);
                    break;
                }
                Ok(g) => {
                    g.release().await.unwrap();
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                Err(e) => panic!("{e}"),
            }
        }
        let e =
            busy.unwrap_or_else(|| panic!("key! rendered {rendered:?}, not the attribute's key"));
        assert_eq!(e.key(), Some(rendered.as_str()));
        tx.send(()).unwrap();
        task.await.unwrap().unwrap();
    }
    let order_id = 42;
    assert_eq!(dlock::key!("order:{order_id}"), "order:42");
    let name = "bob:wallet";
    assert_eq!(dlock::key!("user:{name}"), "user:bob\\:wallet");
}

#[distributed_lock(key = "order:{order_id}", backend = "mo_plain")]
async fn by_order(order_id: u64) -> Result<u64, LockError> {
    Ok(order_id)
}

#[tokio::test]
async fn a_plain_value_names_the_same_lock_as_lock_new() {
    fresh("mo_plain");
    let g = hold("mo_plain", "order:42").await;
    let e = by_order(42).await.unwrap_err();
    assert!(matches!(e, LockError::Busy { .. }), "{e:?}");
    assert_eq!(e.key(), Some("order:42"));
    assert_eq!(by_order(43).await.unwrap(), 43);
    g.release().await.unwrap();
    assert_eq!(by_order(42).await.unwrap(), 42);
}

#[distributed_lock(key = "{{literal}}:{id}", backend = "mo_braces")]
async fn braces(id: u32) -> Result<(), LockError> {
    let _ = id;
    Ok(())
}

#[distributed_lock(key = "static-name", backend = "mo_braces")]
async fn no_placeholders() -> Result<(), LockError> {
    Ok(())
}

#[tokio::test]
async fn literal_braces_and_templates_without_placeholders() {
    fresh("mo_braces");
    let g = hold("mo_braces", "{literal}:7").await;
    assert_eq!(busy_key(braces(7).await), "{literal}:7");
    g.release().await.unwrap();
    let g = hold("mo_braces", "static-name").await;
    assert_eq!(busy_key(no_placeholders().await), "static-name");
    g.release().await.unwrap();
}

/// axum's extractor shape, without axum.
struct Path<T>(T);

struct Request {
    user: User,
    region: &'static str,
}

struct User {
    id: u32,
}

#[distributed_lock(key = "order:{order_id}", backend = "mo_pattern")]
async fn handler(Path(order_id): Path<u64>) -> Result<u64, LockError> {
    Ok(order_id * 2)
}

#[distributed_lock(key = "user:{req.user.id}@{region}", backend = "mo_pattern")]
async fn field_paths(req: &Request, Request { region, .. }: &Request) -> Result<u32, LockError> {
    let _ = region;
    Ok(req.user.id)
}

#[tokio::test]
async fn pattern_bindings_and_field_paths() {
    fresh("mo_pattern");
    assert_eq!(handler(Path(21)).await.unwrap(), 42);
    let g = hold("mo_pattern", "order:21").await;
    let e = handler(Path(21)).await.unwrap_err();
    assert_eq!(e.key(), Some("order:21"));
    g.release().await.unwrap();

    let req = Request {
        user: User { id: 5 },
        region: "eu",
    };
    assert_eq!(field_paths(&req, &req).await.unwrap(), 5);
    let g = hold("mo_pattern", "user:5@eu").await;
    let e = field_paths(&req, &req).await.unwrap_err();
    assert_eq!(e.key(), Some("user:5@eu"));
    g.release().await.unwrap();
}

// ---- reentrancy and fencing ----------------------------------------------------------------

#[distributed_lock(key = "acct:{id}", backend = "mo_reenter")]
async fn outer(id: u32) -> Result<(u64, u64), LockError> {
    let mine = dlock::fencing_token().expect("inside the lock");
    let inner_token = inner(id).await?;
    Ok((mine, inner_token))
}

#[distributed_lock(key = "acct:{id}", backend = "mo_reenter")]
async fn inner(id: u32) -> Result<u64, LockError> {
    let _ = id;
    Ok(dlock::fencing_token().expect("inside the lock"))
}

#[tokio::test]
async fn two_annotated_fns_on_one_key_reenter() {
    let b = fresh("mo_reenter");
    let (a, b_token) = outer(1).await.unwrap();
    assert_eq!(a, b_token, "the nested call re-enters the same hold");
    assert_eq!(b.locked_count(), 0, "released after the outer call");
    let (c, _) = outer(1).await.unwrap();
    assert!(c > a, "fencing tokens increase");
    assert_eq!(dlock::fencing_token(), None);
}

// ---- release, hold_at_least ----------------------------------------------------------------

#[distributed_lock(key = "rel", backend = "mo_release")]
async fn quick() -> Result<(), LockError> {
    Ok(())
}

#[tokio::test]
async fn the_release_is_awaited_before_the_fn_returns() {
    let b = fresh("mo_release");
    for _ in 0..20 {
        quick().await.unwrap();
        assert_eq!(b.locked_count(), 0);
        hold("mo_release", "rel").await.release().await.unwrap();
    }
}

#[distributed_lock(
    key = "job",
    backend = "mo_hold",
    hold_at_least = "400ms",
    on_busy = "skip"
)]
async fn job(runs: &AtomicUsize) {
    runs.fetch_add(1, Ordering::SeqCst);
}

#[tokio::test]
async fn hold_at_least_keeps_the_lock_after_the_body() {
    fresh("mo_hold");
    let runs = AtomicUsize::new(0);
    let t0 = Instant::now();
    job(&runs).await;
    job(&runs).await; // skipped: the lock is kept until 400 ms after the first acquisition
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let e = Lock::new("job")
        .backend("mo_hold")
        .acquire()
        .await
        .unwrap_err();
    let left = e
        .retry_after()
        .expect("the memory backend reports the remaining lease");
    assert!(
        left <= Duration::from_millis(400) && left > Duration::from_millis(200),
        "{left:?}"
    );
    tokio::time::sleep(Duration::from_millis(450).saturating_sub(t0.elapsed())).await;
    job(&runs).await;
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

// ---- on_lost -------------------------------------------------------------------------------

struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[distributed_lock(key = "lost", backend = "mo_lost_cancel", ttl = "300ms")]
async fn long_body(
    started: &tokio::sync::Notify,
    dropped: &AtomicBool,
    finished: &AtomicBool,
) -> Result<(), LockError> {
    let _flag = SetOnDrop(dropped);
    started.notify_one();
    tokio::time::sleep(Duration::from_secs(3)).await;
    finished.store(true, Ordering::SeqCst);
    Ok(())
}

#[tokio::test]
async fn on_lost_cancel_drops_the_body_and_returns_lost() {
    let b = fresh("mo_lost_cancel");
    let started = tokio::sync::Notify::new();
    let (dropped, finished) = (AtomicBool::new(false), AtomicBool::new(false));
    let t0 = Instant::now();
    let call = long_body(&started, &dropped, &finished);
    let delete = async {
        started.notified().await;
        assert!(b.force_delete("lost"), "the body runs under the lock");
    };
    let (r, ()) = tokio::join!(call, delete);
    let e = r.unwrap_err();
    assert!(e.is_lost(), "{e:?}");
    assert_eq!(e.key(), Some("lost"));
    assert!(
        dropped.load(Ordering::SeqCst),
        "the body future was dropped"
    );
    assert!(!finished.load(Ordering::SeqCst));
    // Noticed at the first renewal (ttl / 3), well before the body's 3 s.
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
}

#[distributed_lock(
    key = "lost",
    backend = "mo_lost_continue",
    ttl = "150ms",
    on_lost = "continue"
)]
async fn finishes_anyway(started: &tokio::sync::Notify) -> Result<u32, LockError> {
    started.notify_one();
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(7)
}

#[tokio::test]
async fn on_lost_continue_lets_the_body_finish() {
    let b = fresh("mo_lost_continue");
    let started = tokio::sync::Notify::new();
    let delete = async {
        started.notified().await;
        assert!(b.force_delete("lost"));
    };
    let (r, ()) = tokio::join!(finishes_anyway(&started), delete);
    assert_eq!(r.unwrap(), 7);
}

// ---- watchdog ------------------------------------------------------------------------------

#[distributed_lock(key = "wd", backend = "mo_watchdog", ttl = "150ms")]
async fn renewed() -> Result<u32, LockError> {
    tokio::time::sleep(Duration::from_millis(400)).await;
    Ok(1)
}

#[distributed_lock(
    key = "wd-off",
    backend = "mo_watchdog",
    ttl = "150ms",
    watchdog = false
)]
async fn not_renewed() -> Result<u32, LockError> {
    tokio::time::sleep(Duration::from_millis(400)).await;
    Ok(1)
}

#[tokio::test]
async fn watchdog_renews_and_can_be_turned_off() {
    fresh("mo_watchdog");
    assert_eq!(renewed().await.unwrap(), 1);
    let e = not_renewed().await.unwrap_err();
    assert!(
        e.is_lost(),
        "without renewal the 150 ms lease runs out: {e:?}"
    );
}

// ---- on_busy -------------------------------------------------------------------------------

#[distributed_lock(key = "busy", backend = "mo_busy", on_busy = "skip")]
async fn skip_option() -> Option<u32> {
    Some(1)
}

#[distributed_lock(key = "busy", backend = "mo_busy", on_busy = "skip")]
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

#[distributed_lock(key = "busy", backend = "mo_busy", on_busy = "error")]
async fn custom_error() -> Result<u32, AppError> {
    Ok(2)
}

#[tokio::test]
async fn on_busy_skip_and_error() {
    fresh("mo_busy");
    let ran = AtomicBool::new(false);
    assert_eq!(skip_option().await, Some(1));
    skip_unit(&ran).await;
    assert!(ran.swap(false, Ordering::SeqCst));
    assert_eq!(custom_error().await.unwrap(), 2);

    let g = hold("mo_busy", "busy").await;
    assert_eq!(skip_option().await, None);
    skip_unit(&ran).await;
    assert!(!ran.load(Ordering::SeqCst), "the body did not run");
    match custom_error().await {
        Err(AppError::Locked(Some(d))) => assert!(d <= Duration::from_secs(30)),
        other => panic!("{other:?}"),
    }
    g.release().await.unwrap();
}

// ---- wait ----------------------------------------------------------------------------------

#[distributed_lock(key = "w", backend = "mo_wait", wait = "3s")]
async fn patient() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "w", backend = "mo_wait", wait = "100ms")]
async fn impatient() -> Result<(), LockError> {
    Ok(())
}

#[tokio::test]
async fn wait_for_a_release_or_time_out() {
    fresh("mo_wait");
    let g = hold("mo_wait", "w").await;
    let t0 = Instant::now();
    let e = impatient().await.unwrap_err();
    assert!(matches!(e, LockError::TimedOut { .. }), "{e:?}");
    assert!(t0.elapsed() >= Duration::from_millis(100));
    let release = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        g.release().await.unwrap();
    };
    let t0 = Instant::now();
    let (r, ()) = tokio::join!(patient(), release);
    r.unwrap();
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(2),
        "{waited:?}"
    );
}

// ---- exclusion -----------------------------------------------------------------------------

#[distributed_lock(key = "counter", backend = "mo_exclusion", wait = "30s")]
async fn increment(counter: Arc<AtomicU64>, inside: Arc<AtomicUsize>) -> Result<(), LockError> {
    assert_eq!(
        inside.fetch_add(1, Ordering::SeqCst),
        0,
        "two bodies inside at once"
    );
    // A non-atomic read-modify-write: only the lock keeps it exact.
    let v = counter.load(Ordering::SeqCst);
    tokio::task::yield_now().await;
    counter.store(v + 1, Ordering::SeqCst);
    inside.fetch_sub(1, Ordering::SeqCst);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_tasks_exclude_each_other() {
    const TASKS: u64 = 16;
    const ROUNDS: u64 = 50;
    fresh("mo_exclusion");
    let counter = Arc::new(AtomicU64::new(0));
    let inside = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (counter, inside) = (counter.clone(), inside.clone());
            tokio::spawn(async move {
                for _ in 0..ROUNDS {
                    increment(counter.clone(), inside.clone()).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(counter.load(Ordering::SeqCst), TASKS * ROUNDS);
}

// ---- backend and crate ---------------------------------------------------------------------

#[distributed_lock(key = "x", backend = "mo_not_registered")]
async fn unknown_backend() -> Result<(), LockError> {
    Ok(())
}

#[tokio::test]
async fn an_unknown_backend_is_an_error_naming_it() {
    let e = unknown_backend().await.unwrap_err();
    assert!(
        matches!(e, LockError::UnknownBackend { ref name, .. } if name == "mo_not_registered"),
        "{e:?}"
    );
}

mod renamed {
    use ::dlock as lockkit;

    #[lockkit::distributed_lock(key = "renamed", backend = "mo_crate", crate = "lockkit")]
    pub(super) async fn through_a_renamed_path() -> Result<u64, lockkit::LockError> {
        Ok(lockkit::fencing_token().unwrap_or(0))
    }
}

#[tokio::test]
async fn crate_option_reaches_the_runtime_through_another_path() {
    fresh("mo_crate");
    assert!(renamed::through_a_renamed_path().await.unwrap() > 0);
}

/// `hold_at_least = "0s"` (the README's example, and what a policy accepts) compiles and means
/// no minimum: the lock is free as soon as the body returns (review surfaces.md m4: the attribute
/// refused zero while the policy took it).
#[distributed_lock(key = "zero-min", backend = "mo_zero_min", hold_at_least = "0s")]
async fn zero_minimum() -> Result<(), LockError> {
    Ok(())
}

#[tokio::test]
async fn hold_at_least_zero_is_accepted_and_keeps_nothing() {
    fresh("mo_zero_min");
    zero_minimum().await.unwrap();
    let g = Lock::new("zero-min")
        .backend("mo_zero_min")
        .acquire()
        .await
        .expect("a zero minimum kept the lock after the body returned");
    g.release().await.unwrap();
}
