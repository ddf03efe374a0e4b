//! The semaphore suite (issue 21, item 1), written once and run on every engine that implements
//! semaphores: every `async fn x(env: Env)` listed in `semaphore_backends!` runs as
//! `on_memory::x`, `on_redis::x` (a private redis-server), and behind their features on
//! Sentinel, Redis Cluster, ZooKeeper, etcd and PostgreSQL (`on_postgres`,
//! `on_postgres_advisory`: a lock table of its own per test). The engines without semaphores are
//! checked to answer `LockError::Unsupported` at once (`unsupported::*`, MySQL included).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::counting::CountTries;
use common::{Env, Rng, section_pause};
use dlock::{Backend, Lock, LockError, Semaphore};

macro_rules! semaphore_backends {
    ($($t:ident),* $(,)?) => {
        mod on_memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::memory()).await
                }
            )*
        }
        mod on_redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::redis().await).await
                }
            )*
        }
        #[cfg(feature = "sentinel")]
        mod on_sentinel {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::sentinel().await).await
                }
            )*
        }
        // A lock table of its own per test (`Env::postgres`), in the machine's PostgreSQL.
        #[cfg(feature = "postgres")]
        mod on_postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::postgres().await).await
                }
            )*
        }
        // The advisory mode keeps semaphores and read-write locks in the same tables.
        #[cfg(feature = "postgres")]
        mod on_postgres_advisory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::pg_advisory().await).await
                }
            )*
        }
        #[cfg(feature = "cluster")]
        mod on_cluster {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::cluster().await).await
                }
            )*
        }
        #[cfg(feature = "etcd")]
        mod on_etcd {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::etcd().await).await
                }
            )*
        }
        #[cfg(feature = "zookeeper")]
        mod on_zookeeper {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::zookeeper().await).await
                }
            )*
        }
    };
}

semaphore_backends!(
    at_most_max_permits_are_held_at_any_instant_across_tasks_and_clients,
    a_crashed_holders_permits_come_back_after_its_ttl,
    another_max_is_a_typed_error_at_once_even_while_waiting,
    a_wait_ends_at_its_deadline_and_wait_zero_is_busy,
    a_release_wakes_as_many_waiters_as_permits_it_freed,
    tokens_strictly_increase_per_grant,
    a_semaphore_and_a_lock_of_the_same_name_are_apart,
    a_nested_acquisition_takes_permits_of_its_own,
    the_watchdog_keeps_permits_past_their_ttl_and_lost_fires_once_they_expire,
    a_dropped_guard_gives_its_permits_back,
    waiters_are_not_held_back_once_a_refused_try_and_the_holders_are_gone,
);

/// Four tasks of one client take a permit of a 2-permit semaphore in a loop (20 ms holds, 8 s
/// leases) while, twenty times over, another client takes both permits, tries once more
/// without waiting (refused) and gives both back. The refused try must not hold the waiters
/// back: every acquisition gets in well within one lease (3 s; one that slept until a recorded
/// lease end would wait 8 s or more), and none times out.
async fn waiters_are_not_held_back_once_a_refused_try_and_the_holders_are_gone(env: Env) {
    let name = "sem-refused-probe";
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let takes = Arc::new(AtomicU64::new(0));
    let slowest = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..4u64 {
        let s = sem(&env, name, 2)
            .ttl(Duration::from_secs(8))
            .wait(Duration::from_secs(20));
        let (stop, takes, slowest) = (stop.clone(), takes.clone(), slowest.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(i * 5)).await;
            while !stop.load(Ordering::SeqCst) {
                let t0 = Instant::now();
                let g = s.acquire().await.unwrap_or_else(|e| {
                    panic!("an acquisition failed after {:?}: {e}", t0.elapsed())
                });
                slowest.fetch_max(t0.elapsed().as_millis() as u64, Ordering::SeqCst);
                takes.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                g.release().await.expect("release");
            }
        }));
    }
    let other = Semaphore::new(name, 2)
        .with_backend(env.another_backend().await)
        .ttl(Duration::from_secs(30));
    for round in 0..20 {
        let before = takes.load(Ordering::SeqCst);
        assert!(
            common::eventually(Duration::from_secs(10), || async {
                takes.load(Ordering::SeqCst) >= before + 4
            })
            .await,
            "round {round}: the loop does not get permits (slowest so far {} ms)",
            slowest.load(Ordering::SeqCst)
        );
        let pins = [
            other.clone().wait(Duration::from_secs(10)).acquire().await,
            other.clone().wait(Duration::from_secs(10)).acquire().await,
        ]
        .map(|p| p.unwrap_or_else(|e| panic!("round {round}: a pin: {e}")));
        let probe = other.acquire().await;
        assert!(
            matches!(probe, Err(LockError::Busy { .. })),
            "round {round}: a try with every permit taken is refused: {probe:?}"
        );
        for p in pins {
            p.release().await.unwrap();
        }
    }
    let before = takes.load(Ordering::SeqCst);
    let again = common::eventually(Duration::from_secs(10), || async {
        takes.load(Ordering::SeqCst) >= before + 4
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.unwrap();
    }
    assert!(again, "the loop does not get permits after the last round");
    let slowest = slowest.load(Ordering::SeqCst);
    assert!(
        slowest < 3000,
        "an acquisition waited {slowest} ms, with permits free for most of it"
    );
}

fn sem(env: &Env, name: &str, max: u32) -> Semaphore {
    Semaphore::new(name, max).with_backend(env.backend())
}

/// 16 tasks on two clients (for Redis two backends with their own connections, as two processes
/// would have) take 1 or 2 permits of a 5-permit semaphore in a loop; each holder adds its
/// permits to a shared counter, checks that it stays at most 5, pauses, and takes them off.
/// The peak must also exceed what a mutex would allow, so the test cannot pass by exclusion.
async fn at_most_max_permits_are_held_at_any_instant_across_tasks_and_clients(env: Env) {
    const MAX: u32 = 5;
    let name = "sem-max";
    let backends = [env.backend(), env.another_backend().await];
    let held = Arc::new(AtomicU32::new(0));
    let peak = Arc::new(AtomicU32::new(0));
    let grants = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..16u64 {
        let backend = backends[(i % 2) as usize].clone();
        let (held, peak, grants) = (held.clone(), peak.clone(), grants.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(i + 1);
            for _ in 0..8 {
                let n = 1 + (rng.below(2) as u32);
                let g = Semaphore::new(name, MAX)
                    .permits(n)
                    .ttl(Duration::from_secs(10))
                    .wait(Duration::from_secs(30))
                    .with_backend(backend.clone())
                    .acquire()
                    .await
                    .expect("permits within the wait");
                let now = held.fetch_add(n, Ordering::SeqCst) + n;
                assert!(now <= MAX, "{now} permits held at once, max {MAX}");
                peak.fetch_max(now, Ordering::SeqCst);
                grants.fetch_add(1, Ordering::SeqCst);
                section_pause(&mut rng).await;
                tokio::time::sleep(Duration::from_millis(rng.below(3))).await;
                held.fetch_sub(n, Ordering::SeqCst);
                g.release().await.expect("release");
            }
        }));
    }
    for t in tasks {
        t.await.expect("a holder task panicked");
    }
    assert_eq!(grants.load(Ordering::SeqCst), 16 * 8);
    assert!(
        peak.load(Ordering::SeqCst) >= 3,
        "never more than {} permits at once: the semaphore behaved as a mutex",
        peak.load(Ordering::SeqCst)
    );
}

/// A holder that crashed (its guard forgotten, no watchdog: nothing renews or gives back) keeps
/// its permits only until its ttl has run out on the store; then a waiter gets them.
async fn a_crashed_holders_permits_come_back_after_its_ttl(env: Env) {
    #[cfg(feature = "zookeeper")]
    if env.is_session_based() {
        // Session-based engine: the lease is the session; check its equivalent.
        return a_crashed_holders_permits_come_back_after_its_session(&env).await;
    }
    let name = "sem-crash";
    let ttl = Duration::from_millis(800);
    let crashed = sem(&env, name, 2)
        .permits(2)
        .ttl(ttl)
        .watchdog(false)
        .acquire()
        .await
        .unwrap();
    let t0 = Instant::now();
    std::mem::forget(crashed);
    let busy = sem(&env, name, 2).acquire().await;
    assert!(
        matches!(busy, Err(LockError::Busy { .. })),
        "the crashed holder's permits were free at once: {busy:?}"
    );
    let other = env.another_backend().await;
    let g = Semaphore::new(name, 2)
        .permits(2)
        .wait(Duration::from_secs(10))
        .with_backend(other)
        .acquire()
        .await
        .expect("the crashed holder's permits came back");
    let waited = t0.elapsed();
    assert!(
        waited >= ttl - Duration::from_millis(100),
        "granted after {waited:?}, before the crashed holder's ttl"
    );
    assert!(
        waited < ttl + Duration::from_secs(3),
        "granted only after {waited:?}"
    );
    g.release().await.unwrap();
}

/// ZooKeeper's equivalent of the ttl test: the holder's process hangs or crashes (its
/// connection goes silent), so its session, which keeps its permits, ends by the server's
/// session timeout; then a waiter on another client gets them. Not before the session timeout
/// less the client's longest silence (its ping interval), not long after it.
#[cfg(feature = "zookeeper")]
async fn a_crashed_holders_permits_come_back_after_its_session(env: &Env) {
    let name = "sem-crash-session";
    let (proxy, crashing) = env.zk_crashable_backend().await;
    let session = crashing.session_timeout();
    let crashed = Semaphore::new(name, 2)
        .permits(2)
        .ttl(Duration::from_secs(60))
        .watchdog(false)
        .with_backend(Arc::new(crashing.clone()))
        .acquire()
        .await
        .unwrap();
    std::mem::forget(crashed);
    proxy.set_mode(common::proxy::Mode::Blackhole);
    let t0 = Instant::now();
    let busy = sem(env, name, 2).acquire().await;
    assert!(
        matches!(busy, Err(LockError::Busy { .. })),
        "the crashed holder's permits were free at once: {busy:?}"
    );
    let other = env.another_backend().await;
    let g = Semaphore::new(name, 2)
        .permits(2)
        .wait(Duration::from_secs(15))
        .with_backend(other)
        .acquire()
        .await
        .expect("the crashed holder's permits came back");
    let waited = t0.elapsed();
    assert!(
        waited >= session * 3 / 4,
        "granted after {waited:?}, before the crashed holder's session ({session:?}) could end"
    );
    assert!(
        waited < session + Duration::from_secs(3),
        "granted only after {waited:?} (session {session:?})"
    );
    g.release().await.unwrap();
    drop(proxy);
}

/// A caller whose `max` differs from the live holders' gets `SemaphoreMax` with both values,
/// at once even with a long wait; once nobody holds the name, a new `max` is taken.
async fn another_max_is_a_typed_error_at_once_even_while_waiting(env: Env) {
    let name = "sem-mismatch";
    let g = sem(&env, name, 3).acquire().await.unwrap();
    let t0 = Instant::now();
    let r = sem(&env, name, 4)
        .wait(Duration::from_secs(5))
        .acquire()
        .await;
    match r {
        Err(LockError::SemaphoreMax {
            ref key,
            asked: 4,
            stored: 3,
        }) if key == name => {}
        other => panic!("expected SemaphoreMax 4 vs 3, got {other:?}"),
    }
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "the refusal waited {:?}",
        t0.elapsed()
    );
    // The same max still works beside the holder.
    let g2 = sem(&env, name, 3).acquire().await.unwrap();
    g.release().await.unwrap();
    g2.release().await.unwrap();
    let g4 = sem(&env, name, 4).permits(4).acquire().await.unwrap();
    g4.release().await.unwrap();
    // Settings refused before anything is sent.
    for (max, n) in [(0, 1), (2, 0), (2, 3)] {
        let r = sem(&env, name, max).permits(n).acquire().await;
        assert!(matches!(r, Err(LockError::Config(_))), "{max}/{n}: {r:?}");
    }
}

/// With every permit held, a wait ends with `TimedOut` at its deadline (not before, not much
/// after), and a single try is `Busy` with the time left on the first holder's lease.
async fn a_wait_ends_at_its_deadline_and_wait_zero_is_busy(env: Env) {
    let name = "sem-deadline";
    let g = sem(&env, name, 2)
        .permits(2)
        .ttl(Duration::from_secs(20))
        .acquire()
        .await
        .unwrap();
    let t0 = Instant::now();
    let r = sem(&env, name, 2)
        .wait(Duration::from_millis(400))
        .acquire()
        .await;
    let waited = t0.elapsed();
    assert!(matches!(r, Err(LockError::TimedOut { .. })), "{r:?}");
    assert!(waited >= Duration::from_millis(400), "{waited:?}");
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    match sem(&env, name, 2).acquire().await {
        Err(LockError::Busy {
            retry_after: Some(d),
            ..
        }) if !env.is_session_based() => assert!(
            d > Duration::from_secs(5) && d <= Duration::from_secs(20),
            "retry_after {d:?}"
        ),
        // A session-based hold has no known end: nothing to report (as for its lock).
        Err(LockError::Busy {
            retry_after: None, ..
        }) if env.is_session_based() => {}
        other => panic!("expected Busy with retry_after, got {other:?}"),
    }
    g.release().await.unwrap();
    sem(&env, name, 2)
        .permits(2)
        .acquire()
        .await
        .expect("free after the release")
        .release()
        .await
        .unwrap();
}

/// Five waiters for 1 permit each behind a holder of all 3: its release (3 permits) lets
/// exactly three of them in at once (the holder's 30 s lease is far away, so only wake-ups can
/// do it), with about one try each, not a try by every waiter; the other two stay waiting.
async fn a_release_wakes_as_many_waiters_as_permits_it_freed(env: Env) {
    let name = "sem-wake";
    let counting = CountTries::new(env.backend());
    let backend: Arc<dyn Backend> = counting.clone();
    let holder = Semaphore::new(name, 3)
        .permits(3)
        .ttl(Duration::from_secs(30))
        .with_backend(backend.clone())
        .acquire()
        .await
        .unwrap();
    let granted = Arc::new(AtomicU32::new(0));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut waiters = Vec::new();
    for _ in 0..5 {
        let (backend, granted, tx) = (backend.clone(), granted.clone(), tx.clone());
        waiters.push(tokio::spawn(async move {
            let g = Semaphore::new(name, 3)
                .ttl(Duration::from_secs(30))
                .wait(Duration::from_secs(20))
                .with_backend(backend)
                .acquire()
                .await
                .expect("a permit within the wait");
            granted.fetch_add(1, Ordering::SeqCst);
            let _ = tx.send(g);
        }));
    }
    // Every waiter has tried and queued.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(granted.load(Ordering::SeqCst), 0);
    let tries0 = counting.permit_tries();
    let t0 = Instant::now();
    holder.release().await.unwrap();
    let mut got = Vec::new();
    while got.len() < 3 {
        match tokio::time::timeout(Duration::from_secs(3), rx.recv()).await {
            Ok(Some(g)) => got.push(g),
            _ => panic!(
                "{} of 3 waiters got a permit within {:?} of the release",
                got.len(),
                t0.elapsed()
            ),
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let tries = counting.permit_tries() - tries0;
    assert_eq!(granted.load(Ordering::SeqCst), 3, "more than 3 granted");
    assert!(
        (3..=4).contains(&tries),
        "{tries} tries after a release of 3 permits to 5 waiters (a herd tries 5)"
    );
    for g in got {
        g.release().await.unwrap();
    }
    for w in waiters {
        w.await.expect("waiter");
    }
    while let Ok(g) = rx.try_recv() {
        g.release().await.unwrap();
    }
}

/// Grants one after another, and grants held at the same time, all get increasing tokens.
async fn tokens_strictly_increase_per_grant(env: Env) {
    let name = "sem-tokens";
    let mut last = 0;
    let mut held = Vec::new();
    for round in 0..6 {
        let g = sem(&env, name, 3).acquire().await.unwrap();
        assert!(
            g.fencing_token() > last,
            "round {round}: token {} after {last}",
            g.fencing_token()
        );
        last = g.fencing_token();
        held.push(g);
        if held.len() == 3 {
            for g in held.drain(..) {
                g.release().await.unwrap();
            }
        }
    }
    for g in held {
        g.release().await.unwrap();
    }
}

/// The semaphore `x` and the lock `x` share nothing: holding one never makes the other busy,
/// and a lock's release does not touch the permits.
async fn a_semaphore_and_a_lock_of_the_same_name_are_apart(env: Env) {
    let name = "sem-apart";
    let lock = env.lock(name).acquire().await.unwrap();
    let permit = sem(&env, name, 1)
        .acquire()
        .await
        .expect("the lock of the same name does not hold a permit");
    lock.release().await.unwrap();
    assert!(matches!(
        sem(&env, name, 1).acquire().await,
        Err(LockError::Busy { .. })
    ));
    let lock = env
        .lock(name)
        .acquire()
        .await
        .expect("a permit of the same name does not hold the lock");
    assert!(permit.is_valid());
    permit.release().await.unwrap();
    lock.release().await.unwrap();
}

/// Inside a permit's scope, another acquisition of the same semaphore is a holder of its own:
/// with max 1 it is busy instead of re-entering, and with max 2 it holds a second permit.
async fn a_nested_acquisition_takes_permits_of_its_own(env: Env) {
    let name = "sem-nested";
    let outer = sem(&env, name, 1).acquire().await.unwrap();
    let nested = outer.scope(sem(&env, name, 1).acquire()).await;
    assert!(
        matches!(nested, Err(LockError::Busy { .. })),
        "a nested permit re-entered: {nested:?}"
    );
    assert_eq!(
        outer.scope(async { dlock::fencing_token() }).await,
        Some(outer.fencing_token())
    );
    outer.release().await.unwrap();
    let name = "sem-nested-2";
    let outer = sem(&env, name, 2).acquire().await.unwrap();
    let inner = outer
        .scope(sem(&env, name, 2).acquire())
        .await
        .expect("a second permit");
    assert_ne!(inner.owner(), outer.owner());
    assert!(inner.fencing_token() > outer.fencing_token());
    assert!(matches!(
        sem(&env, name, 2).acquire().await,
        Err(LockError::Busy { .. })
    ));
    inner.release().await.unwrap();
    outer.release().await.unwrap();
}

/// With the watchdog, a 600 ms lease is kept for 2 s against a contender; `extend` works; with
/// the watchdog off the guard is lost at its deadline and its permits go to a waiter.
async fn the_watchdog_keeps_permits_past_their_ttl_and_lost_fires_once_they_expire(env: Env) {
    let name = "sem-watchdog";
    let ttl = Duration::from_millis(600);
    let g = sem(&env, name, 1).ttl(ttl).acquire().await.unwrap();
    let contender = sem(&env, name, 1)
        .wait(Duration::from_secs(2))
        .acquire()
        .await;
    assert!(
        matches!(contender, Err(LockError::TimedOut { .. })),
        "the renewed permit was taken: {contender:?}"
    );
    assert!(g.is_valid());
    g.extend(Duration::from_secs(5)).await.unwrap();
    // The lease a 5 s extend gives the guard: 5 s, less what the engine keeps back (ZooKeeper:
    // the lease is the session's, at most its session lease).
    let lease = Duration::from_secs(5) - env.backend().lease_margin(Duration::from_secs(5));
    assert!(
        g.remaining() > lease * 3 / 5,
        "{:?} left of a {lease:?} lease",
        g.remaining()
    );
    g.release().await.unwrap();

    let g = sem(&env, name, 1)
        .ttl(ttl)
        .watchdog(false)
        .acquire()
        .await
        .unwrap();
    let reason = tokio::time::timeout(Duration::from_secs(3), g.lost())
        .await
        .expect("lost() fired");
    assert_eq!(reason, dlock::LostReason::Deadline);
    assert!(!g.is_valid());
    let next = sem(&env, name, 1)
        .wait(Duration::from_secs(3))
        .acquire()
        .await
        .expect("the expired permit came back");
    assert!(next.fencing_token() > g.fencing_token());
    assert!(matches!(
        g.extend(Duration::from_secs(1)).await,
        Err(LockError::Lost { .. })
    ));
    drop(g);
    next.release().await.unwrap();
}

/// A guard dropped without `release` gives its permits back in the background: an acquisition
/// on the next line gets them, and one on another client soon after.
async fn a_dropped_guard_gives_its_permits_back(env: Env) {
    let name = "sem-drop";
    let g = sem(&env, name, 2).permits(2).acquire().await.unwrap();
    drop(g);
    let g = sem(&env, name, 2)
        .permits(2)
        .acquire()
        .await
        .expect("the dropped guard's permits, on the next line");
    drop(g);
    let other = env.another_backend().await;
    let g = Semaphore::new(name, 2)
        .permits(2)
        .wait(Duration::from_secs(2))
        .with_backend(other)
        .acquire()
        .await
        .expect("given back for another client");
    g.release().await.unwrap();
}

/// A backend without semaphores (here a lock-only wrapper of the memory backend) answers
/// `Unsupported` at once, also with a wait, and leaves nothing behind.
mod unsupported {
    use super::*;
    use dlock::MemoryBackend;
    use dlock::backend::{Acquired, BoxFuture, Extended, Released, Watch};

    #[derive(Debug, Default)]
    struct LockOnly(MemoryBackend);

    impl Backend for LockOnly {
        fn try_acquire<'a>(
            &'a self,
            name: &'a str,
            owner: &'a str,
            ttl: Duration,
        ) -> BoxFuture<'a, Result<Acquired, LockError>> {
            self.0.try_acquire(name, owner, ttl)
        }
        fn release<'a>(
            &'a self,
            name: &'a str,
            owner: &'a str,
            keep_for: Option<Duration>,
            all: bool,
        ) -> BoxFuture<'a, Result<Released, LockError>> {
            self.0.release(name, owner, keep_for, all)
        }
        fn extend<'a>(
            &'a self,
            name: &'a str,
            owner: &'a str,
            ttl: Duration,
        ) -> BoxFuture<'a, Result<Extended, LockError>> {
            self.0.extend(name, owner, ttl)
        }
        fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
            self.0.watch(name)
        }
        fn has_waiters(&self, name: &str) -> bool {
            self.0.has_waiters(name)
        }
    }

    #[tokio::test]
    async fn a_backend_without_semaphores_answers_unsupported_at_once() {
        let b: Arc<dyn Backend> = Arc::new(LockOnly::default());
        let t0 = Instant::now();
        let r = Semaphore::new("s", 2)
            .wait(Duration::from_secs(5))
            .with_backend(b.clone())
            .acquire()
            .await;
        match r {
            Err(LockError::Unsupported { ref key, what }) => {
                assert_eq!((key.as_str(), what), ("s", "semaphores"))
            }
            other => panic!("expected Unsupported, got {other:?}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        // The lock of the same name is untouched and works.
        Lock::new("s")
            .with_backend(b)
            .acquire()
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }

    /// MySQL/MariaDB has no semaphores yet (README's engine table): `Unsupported` at once.
    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_answers_unsupported_at_once() {
        let env = crate::common::Env::mysql().await;
        let t0 = Instant::now();
        let r = Semaphore::new("s", 2)
            .wait(Duration::from_secs(5))
            .with_backend(env.backend())
            .acquire()
            .await;
        assert!(
            matches!(
                r,
                Err(LockError::Unsupported {
                    what: "semaphores",
                    ..
                })
            ),
            "{r:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    }
}

/// `#[distributed_lock(semaphore = 3)]`: 9 concurrent calls, at most 3 bodies at once (and
/// more than one: not a mutex), each body sees its grant's token; with `permits = 2` of 3, one
/// body at a time; `wait = 0` skips a call when no permit is free.
mod attribute {
    use super::*;
    use dlock::MemoryBackend;

    static RUNNING: AtomicU32 = AtomicU32::new(0);
    static PEAK: AtomicU32 = AtomicU32::new(0);

    fn backend() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| dlock::register("sem-attr", MemoryBackend::new()));
    }

    async fn body(max: u32) -> Option<u64> {
        let now = RUNNING.fetch_add(1, Ordering::SeqCst) + 1;
        assert!(now <= max, "{now} bodies at once, max {max}");
        PEAK.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(30)).await;
        RUNNING.fetch_sub(1, Ordering::SeqCst);
        dlock::fencing_token()
    }

    #[dlock::distributed_lock(key = "attr:{k}", semaphore = 3, wait = "10s", backend = "sem-attr")]
    async fn three_at_once(k: u8) -> Result<Option<u64>, LockError> {
        Ok(body(3).await)
    }

    #[dlock::distributed_lock(
        key = "attr2:{k}",
        semaphore = 3,
        permits = 2,
        wait = "10s",
        backend = "sem-attr"
    )]
    async fn two_of_three(k: u8) -> Result<Option<u64>, LockError> {
        Ok(body(1).await)
    }

    #[dlock::distributed_lock(key = "attr3", semaphore = 1, on_busy = "skip", backend = "sem-attr")]
    async fn skip_when_full() -> Option<u64> {
        tokio::time::sleep(Duration::from_millis(200)).await;
        dlock::fencing_token()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_attribute_runs_bodies_under_permits() {
        backend();
        let calls: Vec<_> = (0..9).map(|_| tokio::spawn(three_at_once(1))).collect();
        let mut tokens = Vec::new();
        for c in calls {
            tokens.push(c.await.unwrap().unwrap().expect("a token in the body"));
        }
        tokens.sort();
        tokens.dedup();
        assert_eq!(tokens.len(), 9, "one token per grant");
        let peak = PEAK.swap(0, Ordering::SeqCst);
        assert!((2..=3).contains(&peak), "peak {peak}");

        let calls: Vec<_> = (0..4).map(|_| tokio::spawn(two_of_three(1))).collect();
        for c in calls {
            assert!(c.await.unwrap().unwrap().is_some());
        }
        assert_eq!(PEAK.swap(0, Ordering::SeqCst), 1);

        let (a, b) = tokio::join!(skip_when_full(), async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            skip_when_full().await
        });
        assert!(a.is_some());
        assert_eq!(b, None, "the second call ran with no free permit");
    }
}
