//! The read-write lock's behaviour suite (issue 21, item 2), written once and run on every
//! engine that has read-write locks: each `async fn x(env: Env)` listed in `rw_backends!` runs
//! as `on_memory::x`, `on_redis::x` (a private redis-server), and so on.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{Env, Rng, section_pause};
use dlock::backend::{Acquired, RwSide};
use dlock::{Lock, LockError, RwLock};

/// Runs each listed `async fn name(env: Env)` on every engine with read-write locks.
macro_rules! rw_backends {
    ($($t:ident),* $(,)?) => {
        mod on_memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(crate::common::Env::memory()).await
                }
            )*
        }
        mod on_redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(crate::common::Env::redis().await).await
                }
            )*
        }
        // A lock table of its own per test (`Env::postgres`), in the machine's PostgreSQL.
        #[cfg(feature = "postgres")]
        mod on_postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(crate::common::Env::postgres().await).await
                }
            )*
        }
        // The advisory mode keeps semaphores and read-write locks in the same tables.
        #[cfg(feature = "postgres")]
        mod on_postgres_advisory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(crate::common::Env::pg_advisory().await).await
                }
            )*
        }
        #[cfg(feature = "cluster")]
        mod on_cluster {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(crate::common::Env::cluster().await).await
                }
            )*
        }
        #[cfg(feature = "sentinel")]
        mod on_sentinel {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(crate::common::Env::sentinel().await).await
                }
            )*
        }
        #[cfg(feature = "etcd")]
        mod on_etcd {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(crate::common::Env::etcd().await).await
                }
            )*
        }
        #[cfg(feature = "zookeeper")]
        mod on_zookeeper {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(crate::common::Env::zookeeper().await).await
                }
            )*
        }
    };
}

rw_backends!(
    readers_share_and_writers_exclude_everyone,
    no_writer_starvation_under_8_readers_reacquiring,
    downgrade_keeps_writers_out_and_lets_readers_in,
    upgrade_is_refused_with_a_typed_error_and_read_in_write_reenters,
    a_crashed_readers_hold_ends_after_its_ttl,
    a_dead_waiting_writers_marker_ends_with_its_lease,
    a_writer_that_stops_waiting_lets_readers_in_at_once,
    readers_are_not_held_back_once_a_refused_and_a_waiting_writer_are_gone,
    write_tokens_exceed_every_earlier_token,
    read_holds_reenter_and_renew,
    an_rwlock_and_a_lock_of_the_same_name_are_independent,
);

/// Eight readers of one client re-acquire the read side in a loop (20 ms holds, 8 s leases)
/// while, twenty times over, a writer of another client first tries once without waiting
/// (refused: readers hold) and then waits, holds and releases. Once the writer is gone no read
/// may stay blocked: every read gets in well within one reader's lease (3 s; a reader that
/// slept until a recorded lease end, of a reader or of the writer, would wait 8 s or more),
/// and none times out. Before the fix, a reader that arrived while this client's woken readers
/// were still retrying queued behind them without trying, missed their broadcast wake-up and
/// slept until the lease end last recorded in the client's wait queue.
async fn readers_are_not_held_back_once_a_refused_and_a_waiting_writer_are_gone(env: Env) {
    let name = "rw-refused-probe";
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let slowest = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..8u64 {
        let l = rw(&env, name)
            .ttl(Duration::from_secs(8))
            .wait(Duration::from_secs(20));
        let (stop, reads, slowest) = (stop.clone(), reads.clone(), slowest.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(i * 3)).await;
            while !stop.load(Ordering::SeqCst) {
                let t0 = Instant::now();
                let g = l
                    .read()
                    .await
                    .unwrap_or_else(|e| panic!("a read failed after {:?}: {e}", t0.elapsed()));
                slowest.fetch_max(t0.elapsed().as_millis() as u64, Ordering::SeqCst);
                reads.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                g.release().await.expect("release read");
            }
        }));
    }
    let writer = rw_other(&env, name).await.ttl(Duration::from_secs(30));
    for round in 0..20 {
        let before = reads.load(Ordering::SeqCst);
        assert!(
            common::eventually(Duration::from_secs(10), || async {
                reads.load(Ordering::SeqCst) >= before + 8
            })
            .await,
            "round {round}: the readers do not get in (slowest read so far {} ms)",
            slowest.load(Ordering::SeqCst)
        );
        // A reader of the writer's client holds, so that the try is refused whatever the
        // loop's readers are doing at this moment.
        let pin = writer.read().await.expect("read of the writer's client");
        let probe = writer.clone().write().await;
        pin.release().await.expect("release read");
        assert!(
            matches!(probe, Err(LockError::Busy { .. })),
            "round {round}: a write try while readers hold is refused: {probe:?}"
        );
        let w = writer
            .clone()
            .wait(Duration::from_secs(10))
            .write()
            .await
            .unwrap_or_else(|e| panic!("round {round}: the writer starved: {e}"));
        w.release().await.unwrap();
    }
    // The readers get going again after the last writer.
    let before = reads.load(Ordering::SeqCst);
    let again = common::eventually(Duration::from_secs(10), || async {
        reads.load(Ordering::SeqCst) >= before + 8
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.unwrap();
    }
    assert!(again, "the readers do not get in after the last writer");
    let slowest = slowest.load(Ordering::SeqCst);
    assert!(
        slowest < 3000,
        "a read waited {slowest} ms with no writer holding or waiting for most of it"
    );
}

fn rw(env: &Env, name: &str) -> RwLock {
    RwLock::new(name).with_backend(env.backend())
}

async fn rw_other(env: &Env, name: &str) -> RwLock {
    RwLock::new(name).with_backend(env.another_backend().await)
}

/// A counter every holder checks: readers count up and down in `readers` and see no writer;
/// a writer sets `writers` to 1 and sees no reader and no other writer. Half the tasks use a
/// second client (on Redis, connections of their own, as another process has). The readers
/// must also have overlapped (shared) at least once.
async fn readers_share_and_writers_exclude_everyone(env: Env) {
    let name = "rw-exclusion";
    let readers = Arc::new(AtomicI64::new(0));
    let writers = Arc::new(AtomicI64::new(0));
    let max_readers = Arc::new(AtomicI64::new(0));
    let violations = Arc::new(AtomicUsize::new(0));
    let writes = Arc::new(AtomicU64::new(0));
    let locks = [
        rw(&env, name).ttl(Duration::from_secs(5)),
        rw_other(&env, name).await.ttl(Duration::from_secs(5)),
    ];
    let mut tasks = Vec::new();
    for i in 0..12u64 {
        let l = locks[(i % 2) as usize]
            .clone()
            .wait(Duration::from_secs(20));
        let (readers, writers, max_readers, violations, writes) = (
            readers.clone(),
            writers.clone(),
            max_readers.clone(),
            violations.clone(),
            writes.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(i);
            let is_writer = i % 4 == 0;
            for _ in 0..15 {
                if is_writer {
                    let g = l.write().await.expect("write");
                    if writers.fetch_add(1, Ordering::SeqCst) != 0
                        || readers.load(Ordering::SeqCst) != 0
                    {
                        violations.fetch_add(1, Ordering::SeqCst);
                    }
                    section_pause(&mut rng).await;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    if readers.load(Ordering::SeqCst) != 0 {
                        violations.fetch_add(1, Ordering::SeqCst);
                    }
                    writes.fetch_add(1, Ordering::SeqCst);
                    writers.fetch_sub(1, Ordering::SeqCst);
                    g.release().await.expect("release write");
                } else {
                    let g = l.read().await.expect("read");
                    let n = readers.fetch_add(1, Ordering::SeqCst) + 1;
                    max_readers.fetch_max(n, Ordering::SeqCst);
                    if writers.load(Ordering::SeqCst) != 0 {
                        violations.fetch_add(1, Ordering::SeqCst);
                    }
                    section_pause(&mut rng).await;
                    tokio::time::sleep(Duration::from_millis(3)).await;
                    if writers.load(Ordering::SeqCst) != 0 {
                        violations.fetch_add(1, Ordering::SeqCst);
                    }
                    readers.fetch_sub(1, Ordering::SeqCst);
                    g.release().await.expect("release read");
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(violations.load(Ordering::SeqCst), 0, "exclusion violated");
    assert_eq!(writes.load(Ordering::SeqCst), 3 * 15);
    assert!(
        max_readers.load(Ordering::SeqCst) >= 2,
        "readers never held at the same time"
    );
}

/// 8 readers re-acquire in a loop, so that at every moment some reader holds the lock; a writer
/// that starts waiting must still get in, within a bound (here 3 s; each read hold is ~20 ms).
/// Without writer preference the readers overlap for ever and the writer times out.
async fn no_writer_starvation_under_8_readers_reacquiring(env: Env) {
    let name = "rw-starve";
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let other = env.another_backend().await;
    let mut tasks = Vec::new();
    for i in 0..8u64 {
        let b = if i % 2 == 0 {
            env.backend()
        } else {
            other.clone()
        };
        let l = RwLock::new(name)
            .with_backend(b)
            .ttl(Duration::from_secs(5))
            .wait(Duration::from_secs(20));
        let (stop, reads) = (stop.clone(), reads.clone());
        tasks.push(tokio::spawn(async move {
            // Staggered, so that the holds overlap.
            tokio::time::sleep(Duration::from_millis(i * 3)).await;
            while !stop.load(Ordering::SeqCst) {
                let g = l.read().await.expect("read");
                reads.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                g.release().await.expect("release read");
            }
        }));
    }
    // Let the readers get going.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(reads.load(Ordering::SeqCst) > 8, "the readers run");
    let t0 = Instant::now();
    let w = rw(&env, name)
        .ttl(Duration::from_secs(5))
        .wait(Duration::from_secs(8))
        .write()
        .await;
    let waited = t0.elapsed();
    stop.store(true, Ordering::SeqCst);
    let w = w.unwrap_or_else(|e| panic!("the writer starved: {e}"));
    assert!(
        waited < Duration::from_secs(3),
        "the writer got in only after {waited:?}"
    );
    w.release().await.unwrap();
    for t in tasks {
        t.await.unwrap();
    }
}

/// A downgrade keeps writers out (a waiting writer gets in only after the downgraded read hold
/// is released) while another reader joins at once when no writer waits.
async fn downgrade_keeps_writers_out_and_lets_readers_in(env: Env) {
    let name = "rw-downgrade";
    let l = rw(&env, name).ttl(Duration::from_secs(5));
    // 1. A reader waiting behind the writer joins right after the downgrade.
    let w = l.write().await.unwrap();
    let wt = w.fencing_token();
    let reader = {
        let l = rw_other(&env, name).await.wait(Duration::from_secs(5));
        tokio::spawn(async move {
            let g = l.read().await.expect("reader after the downgrade");
            (Instant::now(), g)
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!reader.is_finished(), "a reader got in beside the writer");
    let t0 = Instant::now();
    let r = w.downgrade().await.unwrap();
    assert!(r.is_valid());
    assert!(
        r.fencing_token() > wt,
        "the read hold's token is a new, larger one"
    );
    let (joined, other_reader) = reader.await.unwrap();
    assert!(
        joined.duration_since(t0) < Duration::from_secs(2),
        "the reader joined {:?} after the downgrade",
        joined.duration_since(t0)
    );
    other_reader.release().await.unwrap();
    r.release().await.unwrap();

    // 2. A writer waiting during the downgrade stays out until the read hold is released.
    let w = l.write().await.unwrap();
    let holds = Arc::new(AtomicBool::new(false));
    let writer = {
        let l = rw_other(&env, name).await.wait(Duration::from_secs(10));
        let holds = holds.clone();
        tokio::spawn(async move {
            let g = l.write().await.expect("second writer");
            holds.store(true, Ordering::SeqCst);
            g
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = w.downgrade().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !holds.load(Ordering::SeqCst),
        "a writer got in while the downgraded read hold lived"
    );
    assert!(r.is_valid());
    let t0 = Instant::now();
    r.release().await.unwrap();
    let g = writer.await.unwrap();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    g.release().await.unwrap();
}

/// Asking for the write side where the call chain holds the read side fails at once with
/// `UpgradeRefused` (never a wait for itself); a read inside a write re-enters the write hold.
async fn upgrade_is_refused_with_a_typed_error_and_read_in_write_reenters(env: Env) {
    let name = "rw-upgrade";
    let l = rw(&env, name).wait(Duration::from_secs(5));
    let r = l.read().await.unwrap();
    let t0 = Instant::now();
    let up = r.scope(l.write()).await;
    assert!(
        matches!(up, Err(LockError::UpgradeRefused { ref key }) if key == name),
        "{up:?}"
    );
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "{:?}",
        t0.elapsed()
    );
    // A nested read re-enters the read hold.
    let nested = r.scope(l.read()).await.unwrap();
    assert_eq!(nested.fencing_token(), r.fencing_token());
    assert_eq!(nested.hold_count(), 2);
    nested.release().await.unwrap();
    r.release().await.unwrap();

    let w = l.write().await.unwrap();
    let inner = w.scope(l.read()).await.unwrap();
    assert_eq!(inner.fencing_token(), w.fencing_token());
    assert_eq!(inner.hold_count(), 2);
    let again = w.scope(l.write()).await.unwrap();
    assert_eq!(again.hold_count(), 3);
    again.release().await.unwrap();
    inner.release().await.unwrap();
    w.release().await.unwrap();
    // Everything was given back: a writer of another client gets in at once.
    let w = rw_other(&env, name).await.write().await.unwrap();
    w.release().await.unwrap();
}

/// A reader that stops without a release or renewal (as a crashed process) keeps writers out
/// only until its lease ends by the store's clock.
async fn a_crashed_readers_hold_ends_after_its_ttl(env: Env) {
    #[cfg(feature = "zookeeper")]
    if env.is_session_based() {
        // Session-based engine: the lease is the session; check its equivalent.
        return a_crashed_readers_hold_ends_with_its_session(&env).await;
    }
    let name = "rw-crash";
    let r = rw(&env, name)
        .ttl(Duration::from_millis(600))
        .watchdog(false)
        .read()
        .await
        .unwrap();
    let survivor = rw(&env, name)
        .ttl(Duration::from_secs(5))
        .read()
        .await
        .unwrap();
    // The crash: no release and no renewal from here on.
    std::mem::forget(r);
    survivor.release().await.unwrap();
    let t0 = Instant::now();
    let w = rw_other(&env, name)
        .await
        .wait(Duration::from_secs(5))
        .write()
        .await
        .unwrap();
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(300),
        "the crashed reader's hold ended early ({waited:?})"
    );
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    w.release().await.unwrap();
}

/// ZooKeeper's equivalent of the ttl test: the reader's process hangs or crashes (its
/// connection goes silent); its session, which keeps its read node, ends by the server's
/// session timeout, and only then does a writer of another client get in.
#[cfg(feature = "zookeeper")]
async fn a_crashed_readers_hold_ends_with_its_session(env: &Env) {
    let name = "rw-crash-session";
    let (proxy, crashing) = env.zk_crashable_backend().await;
    let session = crashing.session_timeout();
    let r = RwLock::new(name)
        .with_backend(Arc::new(crashing.clone()))
        .ttl(Duration::from_secs(60))
        .watchdog(false)
        .read()
        .await
        .unwrap();
    let survivor = rw(env, name)
        .ttl(Duration::from_secs(5))
        .read()
        .await
        .unwrap();
    // The crash: no release, no renewal and no ping from here on.
    std::mem::forget(r);
    proxy.set_mode(common::proxy::Mode::Blackhole);
    let t0 = Instant::now();
    survivor.release().await.unwrap();
    let w = rw_other(env, name)
        .await
        .wait(Duration::from_secs(15))
        .write()
        .await
        .unwrap();
    let waited = t0.elapsed();
    assert!(
        waited >= session * 3 / 4,
        "the crashed reader's hold ended early ({waited:?}, session {session:?})"
    );
    assert!(waited < session + Duration::from_secs(3), "{waited:?}");
    w.release().await.unwrap();
    drop(proxy);
}

/// A writer that dies while waiting leaves its "writer waiting" marker behind; new readers are
/// held back by it only until its lease (the writer's ttl) ends.
async fn a_dead_waiting_writers_marker_ends_with_its_lease(env: Env) {
    #[cfg(feature = "zookeeper")]
    if env.is_session_based() {
        // Session-based engine: the marker (a queued write node) lives as long as the
        // session of the writer; check its equivalent.
        return a_dead_waiting_writers_node_ends_with_its_session(&env).await;
    }
    let name = "rw-ghost";
    let r = rw(&env, name).read().await.unwrap();
    // A writer's busy try, by hand: it sets the marker and then "dies".
    let b = env.backend();
    let a = b
        .rw_try_acquire(RwSide::Write, name, "ghost", Duration::from_millis(600))
        .await
        .unwrap();
    assert!(matches!(a, Acquired::Busy { .. }), "{a:?}");
    let busy = rw_other(&env, name).await.read().await;
    assert!(
        matches!(busy, Err(LockError::Busy { .. })),
        "writer preference: a new reader waits behind the marker: {busy:?}"
    );
    let t0 = Instant::now();
    let g = rw_other(&env, name)
        .await
        .wait(Duration::from_secs(5))
        .read()
        .await
        .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    g.release().await.unwrap();
    r.release().await.unwrap();
}

/// ZooKeeper's equivalent: a writer that dies while waiting leaves its queued write node;
/// new readers are held back by it only until its session ends (the server's session timeout
/// after its connection went silent).
#[cfg(feature = "zookeeper")]
async fn a_dead_waiting_writers_node_ends_with_its_session(env: &Env) {
    use dlock::Backend as _;
    let name = "rw-ghost-session";
    let r = rw(env, name).read().await.unwrap();
    let (proxy, crashing) = env.zk_crashable_backend().await;
    let session = crashing.session_timeout();
    // A writer's busy try, by hand: it queues its node and then "dies".
    let a = crashing
        .rw_try_acquire(RwSide::Write, name, "ghost", Duration::from_millis(600))
        .await
        .unwrap();
    assert!(matches!(a, Acquired::Busy { .. }), "{a:?}");
    proxy.set_mode(common::proxy::Mode::Blackhole);
    let t0 = Instant::now();
    let busy = rw_other(env, name).await.read().await;
    assert!(
        matches!(busy, Err(LockError::Busy { .. })),
        "writer preference: a new reader waits behind the queued writer: {busy:?}"
    );
    let g = rw_other(env, name)
        .await
        .wait(Duration::from_secs(15))
        .read()
        .await
        .unwrap();
    let waited = t0.elapsed();
    assert!(
        waited >= session * 3 / 4,
        "the dead writer's node went early ({waited:?}, session {session:?})"
    );
    assert!(waited < session + Duration::from_secs(3), "{waited:?}");
    g.release().await.unwrap();
    r.release().await.unwrap();
    drop(proxy);
}

/// A writer whose wait ran out takes its marker away with it: a new reader gets in at once.
async fn a_writer_that_stops_waiting_lets_readers_in_at_once(env: Env) {
    let name = "rw-giveup";
    let r = rw(&env, name).read().await.unwrap();
    let w = rw_other(&env, name)
        .await
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_millis(300))
        .write()
        .await;
    assert!(matches!(w, Err(LockError::TimedOut { .. })), "{w:?}");
    let ok = common::eventually(Duration::from_secs(2), || async {
        match rw(&env, name).read().await {
            Ok(g) => {
                g.release().await.unwrap();
                true
            }
            Err(_) => false,
        }
    })
    .await;
    assert!(
        ok,
        "readers stayed held back by a writer that stopped waiting"
    );
    r.release().await.unwrap();
}

/// Every write grant's token is larger than every earlier grant's, read or write; a read
/// grant's token is larger than every earlier write grant's.
async fn write_tokens_exceed_every_earlier_token(env: Env) {
    let name = "rw-tokens";
    let l = rw(&env, name).wait(Duration::from_secs(5));
    let other = rw_other(&env, name).await.wait(Duration::from_secs(5));
    let mut seen: Vec<(char, u64)> = Vec::new();
    for round in 0..4 {
        let a = l.read().await.unwrap();
        let b = other.read().await.unwrap();
        assert_ne!(a.fencing_token(), b.fencing_token());
        seen.push(('r', a.fencing_token()));
        seen.push(('r', b.fencing_token()));
        drop(a);
        b.release().await.unwrap();
        let w = if round % 2 == 0 {
            l.write().await.unwrap()
        } else {
            other.write().await.unwrap()
        };
        let wt = w.fencing_token();
        assert!(
            seen.iter().all(|(_, t)| *t < wt),
            "write token {wt} not above {seen:?}"
        );
        seen.push(('w', wt));
        let r = w.downgrade().await.unwrap();
        assert!(r.fencing_token() > wt);
        seen.push(('r', r.fencing_token()));
        r.release().await.unwrap();
    }
}

/// A reader re-enters its own hold (count 2, same token) even while a writer waits (no
/// deadlock of nested reads), and the watchdog keeps a short read lease alive past its ttl.
async fn read_holds_reenter_and_renew(env: Env) {
    let name = "rw-renew";
    let l = rw(&env, name).ttl(Duration::from_millis(600));
    let r = l.read().await.unwrap();
    let writer = {
        let l = rw_other(&env, name).await.wait(Duration::from_secs(10));
        tokio::spawn(async move { l.write().await.map(|g| (Instant::now(), g)) })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(r.is_valid(), "renewed past its 600 ms ttl");
    assert!(
        !writer.is_finished(),
        "the writer got in beside a live reader"
    );
    let nested = r.scope(l.read()).await.unwrap();
    assert_eq!(nested.hold_count(), 2);
    assert_eq!(nested.fencing_token(), r.fencing_token());
    nested.release().await.unwrap();
    let released = Instant::now();
    let rt = r.fencing_token();
    r.release().await.unwrap();
    let (got, g) = writer.await.unwrap().unwrap();
    assert!(got.duration_since(released) < Duration::from_secs(2));
    assert!(g.fencing_token() > rt);
    g.release().await.unwrap();
}

/// The read-write lock `x` and the lock `x` share nothing.
async fn an_rwlock_and_a_lock_of_the_same_name_are_independent(env: Env) {
    let name = "rw-vs-lock";
    let m = Lock::new(name)
        .with_backend(env.backend())
        .acquire()
        .await
        .unwrap();
    let w = rw(&env, name).write().await.unwrap();
    let m2 = Lock::new(name).with_backend(env.backend()).acquire().await;
    assert!(matches!(m2, Err(LockError::Busy { .. })), "{m2:?}");
    w.release().await.unwrap();
    m.release().await.unwrap();
    let r = rw(&env, name).read().await.unwrap();
    let m = Lock::new(name)
        .with_backend(env.backend())
        .acquire()
        .await
        .unwrap();
    m.release().await.unwrap();
    r.release().await.unwrap();
}

/// A backend of the lock only (no `rw_*` methods), counting the calls that reach it.
#[derive(Debug, Default)]
struct LockOnly {
    inner: dlock::MemoryBackend,
    calls: AtomicU64,
}

impl dlock::Backend for LockOnly {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> dlock::backend::BoxFuture<'a, Result<Acquired, LockError>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.try_acquire(name, owner, ttl)
    }
    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> dlock::backend::BoxFuture<'a, Result<dlock::backend::Released, LockError>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.release(name, owner, keep_for, all)
    }
    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> dlock::backend::BoxFuture<'a, Result<dlock::backend::Extended, LockError>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.extend(name, owner, ttl)
    }
    fn watch<'a>(
        &'a self,
        name: &'a str,
    ) -> dlock::backend::BoxFuture<'a, Result<dlock::backend::Watch, LockError>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.watch(name)
    }
    fn has_waiters(&self, name: &str) -> bool {
        self.inner.has_waiters(name)
    }
}

/// An engine without read-write locks fails at first use with `Unsupported`, at once and
/// before anything is sent, even with a wait.
#[tokio::test]
async fn an_engine_without_rw_locks_is_a_typed_unsupported_error() {
    let inner = Arc::new(LockOnly::default());
    let l = RwLock::new("rw-none")
        .with_backend(inner.clone())
        .wait(Duration::from_secs(5));
    let t0 = Instant::now();
    let r = l.read().await;
    assert!(
        matches!(r, Err(LockError::Unsupported { ref key, .. }) if key == "rw-none"),
        "{r:?}"
    );
    let w = l.write().await;
    assert!(matches!(w, Err(LockError::Unsupported { .. })), "{w:?}");
    assert!(t0.elapsed() < Duration::from_millis(500));
    assert_eq!(inner.calls.load(Ordering::SeqCst), 0, "nothing was sent");
}

/// MySQL/MariaDB has no read-write locks yet (README's engine table): `Unsupported` at once.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_answers_unsupported_at_once() {
    let env = common::Env::mysql().await;
    let l = RwLock::new("rw-none")
        .with_backend(env.backend())
        .wait(Duration::from_secs(5));
    let t0 = Instant::now();
    let r = l.read().await;
    assert!(matches!(r, Err(LockError::Unsupported { .. })), "{r:?}");
    let w = l.write().await;
    assert!(matches!(w, Err(LockError::Unsupported { .. })), "{w:?}");
    assert!(t0.elapsed() < Duration::from_millis(500));
}

// The attribute's `mode = "read"` / `mode = "write"`.

static IN_READ: AtomicI64 = AtomicI64::new(0);
static MAX_IN_READ: AtomicI64 = AtomicI64::new(0);

#[dlock::distributed_lock(key = "doc:{id}", mode = "read", wait = "5s", backend = "rw-macro")]
async fn read_doc(id: u64) -> Result<u64, LockError> {
    let n = IN_READ.fetch_add(1, Ordering::SeqCst) + 1;
    MAX_IN_READ.fetch_max(n, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(100)).await;
    IN_READ.fetch_sub(1, Ordering::SeqCst);
    Ok(id)
}

#[dlock::distributed_lock(key = "doc:{id}", mode = "write", wait = "5s", backend = "rw-macro")]
async fn write_doc(id: u64) -> Result<u64, LockError> {
    assert_eq!(
        IN_READ.load(Ordering::SeqCst),
        0,
        "a writer ran beside a reader"
    );
    Ok(dlock::fencing_token().expect("inside the write body"))
}

#[dlock::distributed_lock(key = "doc:{id}", mode = "read", wait = "5s", backend = "rw-macro")]
async fn read_then_write(id: u64) -> Result<u64, LockError> {
    write_doc(id).await
}

/// Two read bodies of one key overlap, a write body never runs beside one, and a write body
/// called from a read body of the same key fails at once with `UpgradeRefused`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_attributes_modes_share_exclude_and_refuse_an_upgrade() {
    dlock::register("rw-macro", dlock::MemoryBackend::new());
    let (a, b, w) = tokio::join!(read_doc(7), read_doc(7), async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        write_doc(7).await
    });
    assert_eq!((a.unwrap(), b.unwrap()), (7, 7));
    assert!(w.unwrap() > 0);
    assert_eq!(
        MAX_IN_READ.load(Ordering::SeqCst),
        2,
        "the read bodies overlapped"
    );
    let t0 = Instant::now();
    let up = read_then_write(7).await;
    assert!(
        matches!(up, Err(LockError::UpgradeRefused { .. })),
        "{up:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    // Nothing is left held: a write gets in at once.
    assert!(write_doc(7).await.is_ok());
}
