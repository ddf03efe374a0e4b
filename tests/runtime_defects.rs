//! Defects of the generic runtime found by reading it (issue 7, deliverable 6), each with the
//! test that showed it. Timing tests run on tokio's paused clock (the in-memory backend uses
//! tokio's `Instant`), so they are exact and fast.

mod common;

use std::sync::Arc;
use std::time::Duration;

use dlock::backend::{Acquired, BoxFuture, Extended, Released, Watch};
use dlock::{Backend, Lock, LockError, MemoryBackend};
use tokio::time::Instant;

type ExtendHook = Box<
    dyn for<'a> Fn(
            &'a MemoryBackend,
            &'a str,
            &'a str,
            Duration,
        ) -> BoxFuture<'a, Result<Extended, LockError>>
        + Send
        + Sync,
>;

/// The in-memory store with test hooks: `on_try` runs as each try is sent, and `extend`, when
/// set, stands in for the store's own extend (it is given the store to apply it to).
#[derive(Default)]
struct Hooked {
    inner: MemoryBackend,
    on_try: Option<Box<dyn Fn() + Send + Sync>>,
    extend: Option<ExtendHook>,
    /// How many releases still fail with a backend error (the server not answering), unapplied.
    failing_releases: std::sync::atomic::AtomicU32,
}

impl std::fmt::Debug for Hooked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooked").finish_non_exhaustive()
    }
}

impl Hooked {
    /// The store whose extend replies with a ttl of `slow_ttl` (the watchdog's renewals of a
    /// 30 s lease) arrive `delay` after the extend was applied.
    fn slow_renewal_replies(slow_ttl: Duration, delay: Duration) -> Hooked {
        Hooked {
            extend: Some(Box::new(move |inner, name, owner, ttl| {
                Box::pin(async move {
                    let r = inner.extend(name, owner, ttl).await;
                    if ttl == slow_ttl {
                        tokio::time::sleep(delay).await;
                    }
                    r
                })
            })),
            ..Hooked::default()
        }
    }
}

impl Backend for Hooked {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        if let Some(f) = &self.on_try {
            f();
        }
        self.inner.try_acquire(name, owner, ttl)
    }
    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        use std::sync::atomic::Ordering;
        if self
            .failing_releases
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Box::pin(async move {
                Err(LockError::Backend {
                    key: name.to_string(),
                    source: "connection reset (test)".into(),
                })
            });
        }
        self.inner.release(name, owner, keep_for, all)
    }
    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        match &self.extend {
            Some(f) => f(&self.inner, name, owner, ttl),
            None => self.inner.extend(name, owner, ttl),
        }
    }
    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        self.inner.watch(name)
    }
    fn has_waiters(&self, name: &str) -> bool {
        self.inner.has_waiters(name)
    }
}

fn memory() -> Arc<dyn Backend> {
    Arc::new(MemoryBackend::new())
}

/// A renewal applied on the server before an `extend(3s)` but confirmed after it must not move
/// the local deadline to the renewal's 30 s (the server's key expires 3 s after the extend).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_renewal_confirmed_after_a_shorter_extend_does_not_move_the_deadline() {
    let b: Arc<dyn Backend> = Arc::new(Hooked::slow_renewal_replies(
        Duration::from_secs(30),
        Duration::from_secs(1),
    ));
    let g = Lock::new("epoch")
        .ttl(Duration::from_secs(30))
        .with_backend(b)
        .acquire()
        .await
        .unwrap();
    // The renewal is sent at 10 s; its reply is held back until 11 s.
    tokio::time::sleep(Duration::from_millis(10_050)).await;
    g.extend(Duration::from_secs(3)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(
        g.remaining() <= Duration::from_secs(3),
        "the local deadline is {:?} away, past the server's expiry",
        g.remaining()
    );
    g.release().await.unwrap();
}

/// With the watchdog off, `lost()` and `lost_token()` follow a shorter extend.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn lost_follows_a_shorter_extend() {
    let g = Lock::new("shorter")
        .ttl(Duration::from_secs(30))
        .watchdog(false)
        .with_backend(memory())
        .acquire()
        .await
        .unwrap();
    let token = g.lost_token();
    // Both signals are already awaited when the extend shortens the lease.
    let lost = tokio::spawn(g.lost());
    let fired = tokio::spawn(async move { token.cancelled().await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    g.extend(Duration::from_secs(3)).await.unwrap();
    let t0 = Instant::now();
    let r = tokio::time::timeout(Duration::from_millis(3_200), fired).await;
    assert!(
        r.is_ok(),
        "lost_token() did not fire by the extended deadline"
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(2_900),
        "{:?}",
        t0.elapsed()
    );
    let r = tokio::time::timeout(Duration::from_millis(10), lost).await;
    assert!(
        r.is_ok(),
        "lost() did not complete by the extended deadline"
    );
}

/// The same for `lost()` alone (no watchdog event can fire the token first).
#[tokio::test(flavor = "current_thread")]
async fn lost_future_follows_a_shorter_extend_without_a_runtime_watchdog_event() {
    let g = Lock::new("shorter-lost")
        .ttl(Duration::from_secs(30))
        .watchdog(false)
        .with_backend(memory())
        .acquire()
        .await
        .unwrap();
    let lost = tokio::spawn(g.lost());
    tokio::task::yield_now().await;
    g.extend(Duration::from_millis(200)).await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(2), lost).await;
    assert!(r.is_ok(), "lost() still waits for the old 30 s deadline");
}

/// With the watchdog on, a shorter extend reschedules the next renewal before the new deadline.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_shorter_extend_is_renewed_before_its_deadline() {
    let g = Lock::new("shorter-renewed")
        .ttl(Duration::from_secs(30))
        .with_backend(memory())
        .acquire()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    g.extend(Duration::from_secs(3)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        g.is_valid(),
        "the 3 s lease was not renewed: {:?}",
        g.lost_reason()
    );
    assert!(g.remaining() <= Duration::from_secs(3));
    g.release().await.unwrap();
}

/// A waiter that queued behind another local waiter gets a full lease from its own try, not
/// one that counts from when its `acquire()` started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_waiters_lease_counts_from_its_own_try() {
    let b = memory();
    let holder = Lock::new("queue")
        .with_backend(b.clone())
        .acquire()
        .await
        .unwrap();
    let b1 = b.clone();
    let first = tokio::spawn(async move {
        let g = Lock::new("queue")
            .wait(Duration::from_secs(60))
            .with_backend(b1)
            .acquire()
            .await
            .unwrap();
        g.release().await.unwrap();
    });
    let t = std::time::Instant::now();
    while !b.has_waiters("queue") {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the first waiter never queued"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let b2 = b.clone();
    let second = tokio::spawn(async move {
        Lock::new("queue")
            .ttl(Duration::from_millis(1_500))
            .wait(Duration::from_secs(60))
            .with_backend(b2)
            .acquire()
            .await
            .unwrap()
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    holder.release().await.unwrap();
    first.await.unwrap();
    let g = second.await.unwrap();
    assert!(
        g.remaining() > Duration::from_millis(1_300),
        "a 1.5 s lease granted with {:?} left",
        g.remaining()
    );
    g.release().await.unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn huge_durations_are_refused_with_a_config_error() {
    let b = memory();
    let lock = || Lock::new("huge").with_backend(b.clone());
    for (what, r) in [
        ("ttl", lock().ttl(Duration::MAX).acquire().await),
        (
            "ttl u64::MAX ms",
            lock().ttl(Duration::from_millis(u64::MAX)).acquire().await,
        ),
        ("max_hold", lock().max_hold(Duration::MAX).acquire().await),
        (
            "hold_at_least",
            lock().hold_at_least(Duration::MAX).acquire().await,
        ),
    ] {
        assert!(matches!(r, Err(LockError::Config(_))), "{what}: {r:?}");
    }
    // The cap itself is accepted, and an extend above it is refused without losing the hold.
    let g = lock().ttl(Lock::MAX_DURATION).acquire().await.unwrap();
    let e = g.extend(Duration::MAX).await.unwrap_err();
    assert!(matches!(e, LockError::Config(_)), "{e:?}");
    assert!(g.is_valid());
    g.extend(Lock::MAX_DURATION).await.unwrap();
    g.release().await.unwrap();
    // A wait too long to represent waits (is not refused).
    let h = lock().acquire().await.unwrap();
    let waiting = tokio::time::timeout(
        Duration::from_millis(50),
        lock().wait(Duration::MAX).acquire(),
    )
    .await;
    assert!(waiting.is_err(), "the waiter should still be waiting");
    h.release().await.unwrap();
}

/// Re-entering a name that the server gave to another owner is a loss, not a wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reentering_a_lock_now_held_by_another_owner_is_lost() {
    let mem = Arc::new(MemoryBackend::new());
    let b: Arc<dyn Backend> = mem.clone();
    let outer = Lock::new("taken")
        .with_backend(b.clone())
        .acquire()
        .await
        .unwrap();
    assert!(mem.force_delete("taken"));
    let other = Lock::new("taken")
        .with_backend(b.clone())
        .acquire()
        .await
        .unwrap();
    let t0 = std::time::Instant::now();
    let nested = outer
        .scope(
            Lock::new("taken")
                .wait(Duration::from_secs(2))
                .with_backend(b.clone())
                .acquire(),
        )
        .await;
    assert!(matches!(nested, Err(LockError::Lost { .. })), "{nested:?}");
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert!(
        !outer.is_valid(),
        "the outer hold still believes it is valid"
    );
    assert!(other.is_valid());
    other.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inner_guard_that_outlives_the_outer_release_is_not_valid() {
    let b = memory();
    let outer = Lock::new("nest")
        .with_backend(b.clone())
        .acquire()
        .await
        .unwrap();
    let inner = outer
        .scope(Lock::new("nest").with_backend(b.clone()).acquire())
        .await
        .unwrap();
    assert!(inner.is_valid());
    outer.release().await.unwrap();
    assert!(
        !inner.is_valid(),
        "the inner guard outlived the outer release"
    );
    assert_eq!(inner.remaining(), Duration::ZERO);
    assert!(inner.ensure_valid().is_err());
    assert!(inner.release().await.unwrap_err().is_lost());
}

async fn released_hold_at_least_lock_cannot_be_extended(b: Arc<dyn Backend>) {
    let g = Lock::new("keep")
        .hold_at_least(Duration::from_secs(10))
        .with_backend(b.clone())
        .acquire()
        .await
        .unwrap();
    let owner = g.owner().to_string();
    g.release().await.unwrap();
    let r = b
        .extend("keep", &owner, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(r, Extended::Lost, "a released lock was extended");
    // Still kept taken until hold_at_least ran out.
    let e = Lock::new("keep")
        .with_backend(b)
        .acquire()
        .await
        .unwrap_err();
    assert!(e.is_contended(), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_hold_at_least_lock_cannot_be_extended_on_memory() {
    released_hold_at_least_lock_cannot_be_extended(memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_hold_at_least_lock_cannot_be_extended_on_redis() {
    let env = common::Env::redis().await;
    released_hold_at_least_lock_cannot_be_extended(env.backend()).await;
}

/// A guard held by a task when its runtime shuts down is given back (on a helper thread), not
/// left held for its ttl.
#[test]
fn runtime_shutdown_gives_back_held_locks() {
    let mem = Arc::new(MemoryBackend::new());
    let b: Arc<dyn Backend> = mem.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let g = Lock::new("shutdown")
            .ttl(Duration::from_secs(30))
            .with_backend(b.clone())
            .acquire()
            .await
            .unwrap();
        tokio::spawn(async move {
            let _g = g;
            std::future::pending::<()>().await;
        });
        tokio::task::yield_now().await;
    });
    assert_eq!(mem.locked_count(), 1);
    drop(rt);
    assert_eq!(
        mem.locked_count(),
        0,
        "the runtime's shutdown left the lock held for its ttl"
    );
}

/// A guard dropped outside any runtime gives back too.
#[test]
fn a_guard_dropped_outside_a_runtime_gives_back() {
    let mem = Arc::new(MemoryBackend::new());
    let b: Arc<dyn Backend> = mem.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let g = rt.block_on(
        Lock::new("outside")
            .ttl(Duration::from_secs(30))
            .with_backend(b)
            .acquire(),
    );
    drop(rt);
    drop(g.unwrap());
    assert_eq!(
        mem.locked_count(),
        0,
        "the dropped guard left the lock held"
    );
}

/// A wait that runs out while sleeping sends no last try at its deadline: such a try could only
/// be cut off unread (its limit is the deadline) and given back, and on a store where the give-back
/// can race the grant (a pooled database) that is how a cancelled grant became an orphan
/// (sql.md #1's amplifier).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_wait_that_runs_out_sends_no_try_at_its_deadline() {
    let tries: Arc<std::sync::Mutex<Vec<Instant>>> = Arc::default();
    let t = tries.clone();
    let backend: Arc<dyn Backend> = Arc::new(Hooked {
        on_try: Some(Box::new(move || t.lock().unwrap().push(Instant::now()))),
        ..Hooked::default()
    });
    let holder = Lock::new("deadline-try")
        .with_backend(backend.clone())
        .ttl(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    let started = Instant::now();
    let wait = Duration::from_secs(1);
    let r = Lock::new("deadline-try")
        .with_backend(backend)
        .wait(wait)
        .acquire()
        .await;
    assert!(matches!(r, Err(LockError::TimedOut { .. })), "{r:?}");
    let sent = tries.lock().unwrap().clone();
    // The holder's try, then the waiter's first try and its retry right after subscribing.
    assert_eq!(sent.len(), 3, "tries sent at {sent:?}");
    assert!(
        sent.iter().all(|t| *t < started + wait),
        "a try was sent at the deadline: {:?}",
        sent.iter().map(|t| *t - started).collect::<Vec<_>>()
    );
    holder.release().await.unwrap();
}

/// A renewal that falls due while an `extend` is in flight must not send the old ttl under the
/// extend's epoch: the server's lease would end at the old ttl while the guard counts on the new
/// one, and another owner would get the lock while this guard is valid (redis-family.md #3a).
/// The extend to 30 s is applied at once but answered 5 ms later; the renewal fires in between.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_renewal_racing_an_extend_leaves_the_server_lease_at_least_the_guards() {
    let b: Arc<dyn Backend> = Arc::new(Hooked::slow_renewal_replies(
        Duration::from_secs(30),
        Duration::from_millis(5),
    ));
    let start = Instant::now();
    let g = Lock::new("renew-vs-extend")
        .with_backend(b.clone())
        .ttl(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap();
    // The first renewal is due at 1 s: the extend is sent 1 ms before and answered after it.
    tokio::time::sleep_until(start + Duration::from_millis(999)).await;
    g.extend(Duration::from_secs(30)).await.unwrap();
    tokio::time::sleep_until(start + Duration::from_millis(4100)).await;
    assert!(g.is_valid(), "the guard counts on the 30 s lease");
    let other = Lock::new("renew-vs-extend").with_backend(b).acquire().await;
    assert!(
        matches!(other, Err(LockError::Busy { .. })),
        "another owner got the lock while the guard is valid: {other:?}"
    );
    g.release().await.unwrap();
}

/// A renewal whose confirmation is discarded because an `extend` was sent meanwhile, when that
/// extend then fails, must not drop the hold out of the watchdog: renewals go on (or, if they
/// cannot, `lost_token()` fires). Before, neither happened (redis-family.md #3b).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_renewal_discarded_for_a_failed_extend_keeps_the_hold_renewed() {
    use std::sync::atomic::Ordering::SeqCst;
    // The first renewal (an extend with the 3 s ttl) waits at the gate; the first extend with
    // another ttl (the user's) fails with a transport error.
    #[derive(Default)]
    struct Gate {
        gate: tokio::sync::Notify,
        renewals: std::sync::atomic::AtomicU32,
        user_extends: std::sync::atomic::AtomicU32,
    }
    let b = Arc::new(Gate::default());
    let gate = b.clone();
    let backend: Arc<dyn Backend> = Arc::new(Hooked {
        extend: Some(Box::new(move |inner, name, owner, ttl| {
            let gate = gate.clone();
            Box::pin(async move {
                if ttl == Duration::from_secs(3) {
                    if gate.renewals.fetch_add(1, SeqCst) == 0 {
                        gate.gate.notified().await;
                    }
                } else if gate.user_extends.fetch_add(1, SeqCst) == 0 {
                    return Err(LockError::Backend {
                        key: name.to_string(),
                        source: "connection reset (test)".into(),
                    });
                } else {
                    gate.renewals.fetch_add(1, SeqCst);
                }
                inner.extend(name, owner, ttl).await
            })
        })),
        ..Hooked::default()
    });
    let start = Instant::now();
    let g = Lock::new("renew-vs-failed-extend")
        .with_backend(backend)
        .ttl(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap();
    // The first renewal starts at 1 s and waits at the gate.
    tokio::time::sleep_until(start + Duration::from_millis(1100)).await;
    assert_eq!(b.renewals.load(SeqCst), 1, "the first renewal is in flight");
    let e = g.extend(Duration::from_secs(6)).await;
    assert!(matches!(e, Err(LockError::Backend { .. })), "{e:?}");
    // The renewal is answered now; its confirmation loses to the (failed) extend's epoch.
    b.gate.notify_one();
    tokio::time::sleep_until(start + Duration::from_secs(10)).await;
    assert!(
        b.renewals.load(SeqCst) >= 3,
        "no renewal after the discarded one ({} in all)",
        b.renewals.load(SeqCst)
    );
    assert!(g.is_valid() && !g.lost_token().is_cancelled());
    g.release().await.unwrap();
}

/// Polls `fut` to completion on this thread, with no tokio runtime (as `futures`' `block_on`).
fn block_on_without_runtime<F: std::future::Future>(fut: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let std::task::Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(Duration::from_millis(10));
    }
}

/// `acquire` polled outside a tokio runtime (review #12: Redlock's spawns and every backend's
/// bounded calls panicked there) is a `Config` error that says why, not a panic.
#[test]
fn acquire_outside_a_runtime_is_a_config_error_not_a_panic() {
    let mem = Arc::new(MemoryBackend::new());
    let b: Arc<dyn Backend> = mem.clone();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        block_on_without_runtime(
            Lock::new("no-runtime")
                .ttl(Duration::from_secs(30))
                .wait(Duration::from_secs(1))
                .with_backend(b)
                .acquire(),
        )
    }));
    let r = r.expect("acquire outside a runtime panicked");
    match r {
        Err(LockError::Config(m)) => assert!(m.contains("tokio runtime"), "{m}"),
        other => panic!("expected a Config error, got {other:?}"),
    }
    assert_eq!(mem.locked_count(), 0, "a refused acquire took the lock");
}

/// `extend` and `release` polled outside a runtime are `Config` errors too, and the released
/// lock is still given back (by the give-back's helper thread), never left for its ttl.
#[test]
fn extend_and_release_outside_a_runtime_are_config_errors_and_still_give_back() {
    let mem = Arc::new(MemoryBackend::new());
    let b: Arc<dyn Backend> = mem.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let g = rt
        .block_on(
            Lock::new("no-runtime-release")
                .ttl(Duration::from_secs(30))
                .with_backend(b)
                .acquire(),
        )
        .unwrap();
    let (ext, rel) = std::thread::spawn(move || {
        let ext = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            block_on_without_runtime(g.extend(Duration::from_secs(10)))
        }));
        let rel = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            block_on_without_runtime(g.release())
        }));
        (ext, rel)
    })
    .join()
    .unwrap();
    assert!(
        matches!(ext, Ok(Err(LockError::Config(_)))),
        "extend outside a runtime: {ext:?}"
    );
    assert!(
        matches!(rel, Ok(Err(LockError::Config(_)))),
        "release outside a runtime: {rel:?}"
    );
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while mem.locked_count() != 0 && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(mem.locked_count(), 0, "the release left the lock held");
    drop(rt);
}

/// A release the backend failed to answer (a transport error: its outcome is unknown) returns
/// the error to the caller, and the runtime goes on giving the lock back in the background until
/// the server confirms, instead of leaving it held for its whole ttl (the one retry lives in the
/// core, for every backend).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_release_is_retried_in_the_background_until_confirmed() {
    let hooked = Arc::new(Hooked::default());
    hooked
        .failing_releases
        .store(3, std::sync::atomic::Ordering::SeqCst);
    let b: Arc<dyn Backend> = hooked.clone();
    let g = Lock::new("failed-release")
        .ttl(Duration::from_secs(60))
        .with_backend(b.clone())
        .acquire()
        .await
        .unwrap();
    match g.release().await {
        Err(LockError::Backend { .. }) => {}
        other => panic!("a failed release must report the backend error, got {other:?}"),
    }
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while hooked.inner.locked_count() != 0 && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        hooked.inner.locked_count(),
        0,
        "the lock stays held for its 60 s ttl after a failed release"
    );
    assert_eq!(
        hooked
            .failing_releases
            .load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the background give-back did not retry through the failures"
    );
}

/// `fencing_token()` is `None` in a spawned task (task-locals are not inherited), and
/// `in_current_scope` carries the token and re-entry into it; a carried hold that was released
/// is not re-entered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_current_scope_carries_the_lock_context_into_a_spawned_task() {
    let b = memory();
    let g = Lock::new("carried")
        .ttl(Duration::from_secs(30))
        .with_backend(b.clone())
        .acquire()
        .await
        .unwrap();
    let token = g.fencing_token();
    let b2 = b.clone();
    let (plain, carried, reentered) = g
        .scope(async move {
            let plain = tokio::spawn(async { dlock::fencing_token() })
                .await
                .unwrap();
            let carried = tokio::spawn(dlock::in_current_scope(async { dlock::fencing_token() }))
                .await
                .unwrap();
            let reentered = tokio::spawn(dlock::in_current_scope(async move {
                let inner = Lock::new("carried").with_backend(b2).acquire().await?;
                let count = inner.hold_count();
                inner.release().await?;
                Ok::<_, LockError>(count)
            }))
            .await
            .unwrap();
            (plain, carried, reentered)
        })
        .await;
    assert_eq!(plain, None, "a spawned task has no lock context of its own");
    assert_eq!(carried, Some(token));
    assert_eq!(
        reentered.unwrap(),
        2,
        "the carried context re-enters the hold"
    );
    g.release().await.unwrap();
}
