//! Fair locks (`Lock::fair`, issue 21 item 3): waiters are served in arrival order across
//! processes, a queued waiter that dies leaves the queue within one renewal period (its
//! heartbeat lease, ttl/3, judged by the store's clock), and a waiter whose wait ends leaves it
//! at once. Run on memory, Redis, Sentinel and Redis Cluster; each waiter has a client of its own
//! (on the Redis family a backend with its own connections, as another process has).

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::counting::CountTries;
use common::{Env, Kind};
use dlock::{Backend, Lock, LockError};

/// Runs each listed `async fn name(env: Env)` on every engine with a fair queue of its own.
macro_rules! fair_backends {
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
    };
}

fair_backends!(
    waiters_of_separate_clients_get_the_lock_in_arrival_order,
    a_dead_queued_waiter_leaves_the_queue_within_one_renewal_period,
    a_waiter_whose_wait_ends_leaves_the_queue_at_once,
    a_leader_that_resigns_and_campaigns_again_goes_behind_the_waiting_candidate,
);

/// A client of its own: on the Redis family a new backend (its own connections and pub/sub, as
/// another process has; through the sentinels for a Sentinel environment); in memory the one
/// store there is.
async fn client(env: &Env) -> Arc<dyn Backend> {
    #[cfg(feature = "sentinel")]
    if let Some(set) = env
        .extra
        .iter()
        .find_map(|e| e.downcast_ref::<common::sentinel::SentinelSet>())
    {
        return Arc::new(
            dlock::SentinelBackend::connect(common::sentinel::MASTER, set.sentinel_urls())
                .await
                .expect("another client through the sentinels"),
        );
    }
    env.another_backend().await
}

/// How many owners the store has queued for the fair lock `name`.
async fn queued(env: &Env, name: &str) -> usize {
    let queue = format!("{}:fq", dlock::backend::redis_keys(name).lock);
    match env.kind {
        Kind::Memory => env.memory_backend().fair_queue_len(name),
        Kind::Redis => {
            let mut con = env.server().admin_async().await;
            redis::cmd("ZCARD")
                .arg(&queue)
                .query_async(&mut con)
                .await
                .expect("ZCARD")
        }
        #[cfg(feature = "cluster")]
        Kind::Cluster => {
            let mut con = env.cluster_set().admin().await;
            redis::cmd("ZCARD")
                .arg(&queue)
                .query_async(&mut con)
                .await
                .expect("ZCARD")
        }
        other => panic!("no fair queue probe for {other:?}"),
    }
}

/// Waits (bounded, 10 s) until the store has `n` owners queued for `name`.
async fn until_queued(env: &Env, name: &str, n: usize) {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let got = queued(env, name).await;
        if got == n {
            return;
        }
        assert!(
            Instant::now() < end,
            "{got} owners queued for {name}, expected {n}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A holder and five waiters, each on a client of its own, queued one after another (each is
/// seen queued on the store before the next starts): they get the lock in that order. The
/// earlier waiters ask for longer leases (all longer than the holder's), so an order by lease
/// expiry (the plain lock's process queue on the Redis family) would serve them last.
async fn waiters_of_separate_clients_get_the_lock_in_arrival_order(env: Env) {
    const N: usize = 5;
    let name = "fair-fifo";
    let holder = Lock::new(name)
        .with_backend(env.backend())
        .ttl(Duration::from_secs(5))
        .fair(true)
        .acquire()
        .await
        .expect("holder");
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..N {
        let b = client(&env).await;
        let order = order.clone();
        let ttl = Duration::from_secs(10 + 4 * (N - i) as u64);
        tasks.push(tokio::spawn(async move {
            let g = Lock::new(name)
                .with_backend(b)
                .ttl(ttl)
                .wait(Duration::from_secs(60))
                .fair(true)
                .acquire()
                .await
                .expect("a queued waiter gets the lock");
            order.lock().unwrap().push(i);
            tokio::time::sleep(Duration::from_millis(20)).await;
            g.release().await.expect("release");
        }));
        until_queued(&env, name, i + 1).await;
    }
    holder.release().await.unwrap();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("every waiter is served (bounded)")
            .unwrap();
    }
    assert_eq!(*order.lock().unwrap(), (0..N).collect::<Vec<_>>());
    assert_eq!(queued(&env, name).await, 0, "the queue is empty at the end");
}

/// A waiter queued first (ttl 1.5 s: its heartbeat lease, one renewal period, is 500 ms) dies
/// while queued: its client stops answering and reaching the store, so it never tries again nor
/// gives its place back. The holder (ttl 30 s) releases; the waiter queued behind it gets the
/// lock once the dead one's heartbeat has run out: within one renewal period of the death plus
/// the live waiter's own retry interval, not after the holder's lease nor a fixed multi-second
/// timeout. The bound (2.5 s) is generous, to catch a queue that never forgets a dead head.
async fn a_dead_queued_waiter_leaves_the_queue_within_one_renewal_period(env: Env) {
    let name = "fair-dead";
    let holder = Lock::new(name)
        .with_backend(env.backend())
        .ttl(Duration::from_secs(30))
        .fair(true)
        .acquire()
        .await
        .expect("holder");
    let mortal = CountTries::new(client(&env).await);
    let dead: Arc<dyn Backend> = mortal.clone();
    let doomed = tokio::spawn(async move {
        Lock::new(name)
            .with_backend(dead)
            .ttl(Duration::from_millis(1500))
            .wait(Duration::from_secs(60))
            .fair(true)
            .acquire()
            .await
    });
    until_queued(&env, name, 1).await;
    let live = client(&env).await;
    let waiter = tokio::spawn(async move {
        let g = Lock::new(name)
            .with_backend(live)
            .ttl(Duration::from_secs(3))
            .wait(Duration::from_secs(60))
            .fair(true)
            .acquire()
            .await;
        (Instant::now(), g)
    });
    until_queued(&env, name, 2).await;
    // The first waiter's process dies: no more tries, no give-back.
    mortal.die();
    doomed.abort();
    let died = Instant::now();
    holder.release().await.unwrap();
    let (at, g) = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the live waiter is served (bounded)")
        .unwrap();
    let g = g.expect("the live waiter gets the lock");
    let took = at.saturating_duration_since(died);
    eprintln!("lock handed past the dead waiter {took:?} after its death");
    assert!(
        took < Duration::from_millis(2500),
        "the dead waiter blocked the queue for {took:?} (its heartbeat lease was 500 ms)"
    );
    g.release().await.unwrap();
}

/// A waiter queued first whose wait (300 ms) runs out while the lock is held leaves the queue at
/// once: the holder's release hands the lock to the waiter behind it right away, not once the
/// first one's heartbeat lease (10 s, its ttl being 30 s) has run out.
async fn a_waiter_whose_wait_ends_leaves_the_queue_at_once(env: Env) {
    let name = "fair-deadline";
    let holder = Lock::new(name)
        .with_backend(env.backend())
        .ttl(Duration::from_secs(30))
        .fair(true)
        .acquire()
        .await
        .expect("holder");
    let impatient = client(&env).await;
    let first = tokio::spawn(async move {
        Lock::new(name)
            .with_backend(impatient)
            .ttl(Duration::from_secs(30))
            .wait(Duration::from_millis(300))
            .fair(true)
            .acquire()
            .await
    });
    until_queued(&env, name, 1).await;
    let patient = client(&env).await;
    let second = tokio::spawn(async move {
        let g = Lock::new(name)
            .with_backend(patient)
            .ttl(Duration::from_secs(30))
            .wait(Duration::from_secs(60))
            .fair(true)
            .acquire()
            .await;
        (Instant::now(), g)
    });
    let r = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("the first wait ends (bounded)")
        .unwrap();
    assert!(
        matches!(r, Err(LockError::TimedOut { .. })),
        "the first waiter's wait ends: {:?}",
        r.map(|g| g.fencing_token())
    );
    // Its give-up left the queue at once: only the second waiter is queued, well before the
    // first one's heartbeat lease (10 s) could have dropped it.
    let ended = Instant::now();
    loop {
        let n = queued(&env, name).await;
        if n == 1 {
            break;
        }
        assert!(
            ended.elapsed() < Duration::from_secs(2),
            "{n} owners still queued {:?} after the first waiter's wait ended",
            ended.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let released = Instant::now();
    holder.release().await.unwrap();
    let (at, g) = tokio::time::timeout(Duration::from_secs(20), second)
        .await
        .expect("the second waiter is served (bounded)")
        .unwrap();
    let g = g.expect("the second waiter gets the lock");
    let took = at.saturating_duration_since(released);
    assert!(
        took < Duration::from_secs(2),
        "the lock reached the second waiter {took:?} after the release (the first one's heartbeat lease was 10 s)"
    );
    g.release().await.unwrap();
    assert_eq!(queued(&env, name).await, 0);
}

/// Engines without a fair queue refuse `fair(true)` at the first try with a typed error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_refuses_a_fair_lock_with_unsupported() {
    let env = Env::redlock(3).await;
    let r = Lock::new("fair-rl")
        .with_backend(env.backend())
        .fair(true)
        .acquire()
        .await;
    assert!(
        matches!(r, Err(LockError::Unsupported { .. })),
        "{:?}",
        r.map(|g| g.fencing_token())
    );
}

/// Elections campaign fairly where the engine queues candidates: A leads, B waits, A resigns
/// and campaigns again at once. B leads next, and A's new campaign waits behind B. Before
/// elections used the fair lock, A's own try, sent right after its release, could win the free
/// name back before the woken B tried (seen across processes in `tests/election_procs.rs`).
async fn a_leader_that_resigns_and_campaigns_again_goes_behind_the_waiting_candidate(env: Env) {
    let name = "fair-resign";
    let (a_client, b_client) = (client(&env).await, client(&env).await);
    assert!(a_client.supports_fair(), "{:?}", env.kind);
    let elect = |c: &Arc<dyn Backend>| {
        dlock::Election::new(name)
            .ttl(Duration::from_secs(30))
            .with_backend(c.clone())
    };
    for round in 0..3 {
        let a = elect(&a_client).campaign().await.expect("A leads");
        let b_election = elect(&b_client);
        let b = tokio::spawn(async move { b_election.campaign().await });
        // B is queued (its first try was busy).
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!b.is_finished(), "B must wait while A leads");
        let a_epoch = a.epoch();
        a.resign().await.expect("resign");
        let a_again = elect(&a_client);
        let a2 = tokio::spawn(async move { a_again.campaign().await });
        let b_term = tokio::time::timeout(Duration::from_secs(10), b)
            .await
            .unwrap_or_else(|_| panic!("round {round}: B never led after A resigned"))
            .unwrap()
            .expect("B's term");
        assert!(b_term.epoch() > a_epoch);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !a2.is_finished(),
            "round {round}: A won again while B led (or before it)"
        );
        b_term.resign().await.unwrap();
        let a2 = tokio::time::timeout(Duration::from_secs(10), a2)
            .await
            .expect("A leads after B resigned")
            .unwrap()
            .expect("A's second term");
        a2.resign().await.unwrap();
    }
}
