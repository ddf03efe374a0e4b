//! Every await on a backend call is bounded (issue 7, deliverable 1): a backend whose calls
//! never answer (a gate that stays shut) cannot hold up an acquire past its ttl or wait, an
//! extend or a release past the lease's deadline, nor an annotated function past its deadline +
//! 100 ms. The give-back goes on in the background. The last test is the issue's measured case
//! against a private redis-server paused with `CLIENT PAUSE 2500 ALL`.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dlock::backend::{Acquired, BoxFuture, Extended, Released, Watch};
use dlock::{Backend, Lock, LockError, MemoryBackend, distributed_lock};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Slack past a deadline that the issue allows.
const SLACK: Duration = Duration::from_millis(100);

/// One kind of call that can be held back.
#[derive(Debug, Default)]
struct Gate {
    shut: AtomicBool,
    open: Notify,
}

impl Gate {
    fn shut(&self) {
        self.shut.store(true, Ordering::SeqCst);
    }

    fn open(&self) {
        self.shut.store(false, Ordering::SeqCst);
        self.open.notify_waiters();
    }

    async fn pass(&self) {
        loop {
            let n = self.open.notified();
            if !self.shut.load(Ordering::SeqCst) {
                return;
            }
            n.await;
        }
    }
}

/// The in-memory store behind gates: a shut gate makes that kind of call wait (for ever, unless
/// the test opens it again); the call is applied only once it passes, as with a server that
/// reads the request late.
#[derive(Debug, Default)]
struct Stalling {
    inner: MemoryBackend,
    acquire: Gate,
    release: Gate,
    extend: Gate,
    watch: Gate,
}

impl Backend for Stalling {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(async move {
            self.acquire.pass().await;
            self.inner.try_acquire(name, owner, ttl).await
        })
    }

    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        Box::pin(async move {
            self.release.pass().await;
            self.inner.release(name, owner, keep_for, all).await
        })
    }

    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(async move {
            self.extend.pass().await;
            self.inner.extend(name, owner, ttl).await
        })
    }

    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(async move {
            self.watch.pass().await;
            self.inner.watch(name).await
        })
    }

    fn has_waiters(&self, name: &str) -> bool {
        self.inner.has_waiters(name)
    }
}

fn stalling() -> (Arc<Stalling>, Arc<dyn Backend>) {
    let s = Arc::new(Stalling::default());
    let b: Arc<dyn Backend> = s.clone();
    (s, b)
}

/// Fails the test instead of hanging it.
async fn bounded<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .unwrap_or_else(|_| panic!("{what} still pending after 10 s"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_try_times_out_by_its_ttl_when_the_server_never_answers() {
    let (s, b) = stalling();
    s.acquire.shut();
    let ttl = Duration::from_millis(300);
    let t0 = Instant::now();
    let r = bounded("acquire", Lock::new("k").ttl(ttl).with_backend(b).acquire()).await;
    let took = t0.elapsed();
    // No answer is an error, not contention (a web layer answers 503, not "locked").
    assert!(matches!(r, Err(LockError::Backend { .. })), "{r:?}");
    assert!(!r.unwrap_err().is_contended());
    assert!(took <= ttl + SLACK, "returned after {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_acquire_honours_its_wait_when_the_server_never_answers() {
    let (s, b) = stalling();
    s.acquire.shut();
    let wait = Duration::from_millis(300);
    let t0 = Instant::now();
    let r = bounded(
        "acquire",
        Lock::new("k")
            .ttl(Duration::from_secs(30))
            .wait(wait)
            .with_backend(b)
            .acquire(),
    )
    .await;
    let took = t0.elapsed();
    // No try was ever answered: an error, not a `TimedOut` that says another owner held it.
    assert!(matches!(r, Err(LockError::Backend { .. })), "{r:?}");
    assert!(took <= wait + SLACK, "returned after {took:?}");
}

/// Deliverable 6: the first subscription of a newcomer that queues behind a local waiter is
/// bounded by its wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_newcomers_first_subscription_is_bounded_by_its_wait() {
    let (s, b) = stalling();
    let holder = Lock::new("q")
        .with_backend(b.clone())
        .acquire()
        .await
        .unwrap();
    let b2 = b.clone();
    let queued = tokio::spawn(async move {
        Lock::new("q")
            .wait(Duration::from_secs(5))
            .with_backend(b2)
            .acquire()
            .await
    });
    let t = Instant::now();
    while !b.has_waiters("q") {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the waiter never queued"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    s.watch.shut();
    let wait = Duration::from_millis(300);
    let t0 = Instant::now();
    let r = bounded(
        "queued acquire",
        Lock::new("q").wait(wait).with_backend(b.clone()).acquire(),
    )
    .await;
    let took = t0.elapsed();
    assert!(matches!(r, Err(LockError::TimedOut { .. })), "{r:?}");
    assert!(took <= wait + SLACK, "returned after {took:?}");
    s.watch.open();
    holder.release().await.unwrap();
    bounded("first waiter", queued)
        .await
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_returns_lost_by_the_deadline_when_the_server_never_answers() {
    let (s, b) = stalling();
    let ttl = Duration::from_millis(400);
    let t0 = Instant::now();
    let g = Lock::new("r")
        .ttl(ttl)
        .with_backend(b)
        .acquire()
        .await
        .unwrap();
    s.extend.shut();
    s.release.shut();
    let r = bounded("release", g.release()).await;
    let took = t0.elapsed();
    assert!(matches!(r, Err(LockError::Lost { .. })), "{r:?}");
    assert!(took <= ttl + SLACK, "returned {took:?} after the acquire");
    // The give-back goes on in the background once the server answers again.
    s.release.open();
    let t = Instant::now();
    while s.inner.locked_count() != 0 {
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "the background release did not give the lock back"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_of_a_lost_guard_returns_lost_at_once() {
    let (s, b) = stalling();
    let ttl = Duration::from_millis(200);
    let g = Lock::new("l")
        .ttl(ttl)
        .watchdog(false)
        .with_backend(b)
        .acquire()
        .await
        .unwrap();
    tokio::time::sleep(ttl + Duration::from_millis(50)).await;
    s.release.shut();
    let t0 = Instant::now();
    let r = bounded("release", g.release()).await;
    assert!(matches!(r, Err(LockError::Lost { .. })), "{r:?}");
    assert!(t0.elapsed() < SLACK, "took {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extend_returns_lost_by_the_deadline_when_the_server_never_answers() {
    let (s, b) = stalling();
    let ttl = Duration::from_millis(400);
    let t0 = Instant::now();
    let g = Lock::new("e")
        .ttl(ttl)
        .with_backend(b)
        .acquire()
        .await
        .unwrap();
    s.extend.shut();
    let r = bounded("extend", g.extend(Duration::from_secs(30))).await;
    let took = t0.elapsed();
    assert!(matches!(r, Err(LockError::Lost { .. })), "{r:?}");
    assert!(took <= ttl + SLACK, "returned {took:?} after the acquire");
    assert!(!g.is_valid());
    s.release.shut();
    assert!(bounded("release", g.release()).await.unwrap_err().is_lost());
}

/// Deliverable 6: a `release()` whose future is dropped before the backend answered (a request
/// timeout around it) still gives the lock back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_release_still_gives_the_lock_back() {
    let (s, b) = stalling();
    let g = Lock::new("c")
        .ttl(Duration::from_secs(30))
        .with_backend(b.clone())
        .acquire()
        .await
        .unwrap();
    s.release.shut();
    let r = tokio::time::timeout(Duration::from_millis(20), g.release()).await;
    assert!(r.is_err(), "the release was expected to be cut short");
    s.release.open();
    let t = Instant::now();
    while s.inner.locked_count() != 0 {
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "the cancelled release left the lock held for its 30 s ttl"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let again = Lock::new("c").with_backend(b).acquire().await;
    again
        .expect("free after the cancelled release")
        .release()
        .await
        .unwrap();
}

static STALL: std::sync::OnceLock<Arc<Stalling>> = std::sync::OnceLock::new();

#[distributed_lock(key = "f", backend = "bc_stalling", ttl = "400ms")]
async fn stops_answering_inside() -> Result<(), LockError> {
    let s = STALL.get().unwrap();
    s.extend.shut();
    s.release.shut();
    tokio::time::sleep(Duration::from_secs(5)).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_annotated_function_returns_lost_by_its_deadline_when_the_server_stops_answering() {
    let s = Arc::new(Stalling::default());
    STALL.set(s.clone()).unwrap();
    dlock::register_arc("bc_stalling", s.clone());
    let t0 = Instant::now();
    let r = bounded("annotated function", stops_answering_inside()).await;
    let took = t0.elapsed();
    assert!(matches!(r, Err(LockError::Lost { .. })), "{r:?}");
    assert!(
        took <= Duration::from_millis(400) + SLACK,
        "returned {took:?} after the call"
    );
}

static GRANTED: std::sync::Mutex<Option<(Instant, u16)>> = std::sync::Mutex::new(None);

#[distributed_lock(key = "paused-fn", backend = "bc_redis", ttl = "600ms")]
async fn paused_150ms_after_the_grant(port: u16) -> Result<(), LockError> {
    *GRANTED.lock().unwrap() = Some((Instant::now(), port));
    tokio::time::sleep(Duration::from_millis(150)).await;
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
    let mut admin = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(2500)
        .arg("ALL")
        .query_async(&mut admin)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    Ok(())
}

/// The issue's measured case: `ttl = "600ms"`, `CLIENT PAUSE 2500 ALL` 150 ms after the grant.
/// Before: `Err` after 2.5 s (the release waited for the pause to end). Now: `Err(Lost)` by the
/// holder's deadline + 100 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_after_the_grant_the_function_returns_lost_by_its_deadline() {
    let redis = tokio::task::spawn_blocking(common::RedisProc::start)
        .await
        .unwrap();
    dlock::init_named("bc_redis", &redis.url()).await.unwrap();
    let r = bounded(
        "annotated function",
        paused_150ms_after_the_grant(redis.port()),
    )
    .await;
    let end = Instant::now();
    let (granted, _) = GRANTED.lock().unwrap().expect("the body never ran");
    assert!(matches!(r, Err(LockError::Lost { .. })), "{r:?}");
    let after = end.duration_since(granted);
    assert!(
        after <= Duration::from_millis(600) + SLACK,
        "returned {after:?} after the grant (deadline 600 ms)"
    );
    // Let the pause end before the server is killed, so nothing else is affected.
    tokio::time::sleep(Duration::from_millis(2600)).await;
}
