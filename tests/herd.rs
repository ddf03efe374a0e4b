//! No remote herd (issue 19, item 2's target): several backends, each standing for one process
//! with waiters of its own, wait on one name; a release must wake exactly one of them, not one
//! waiter per backend. Tries are counted at the `Backend` trait, as `benches/handoff_bench.rs`
//! does. Redis here (one backend per simulated process, each with its own pub/sub connection
//! and queue id); the other engines beside it behind their features.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::RedisProc;
use dlock::{Backend, Lock, LockError, LockGuard, RedisBackend};

use common::counting::CountTries as Counting;

const TTL: Duration = Duration::from_secs(20);

/// Waits until no backend's try count moved for `quiet`, up to 10 s.
async fn settle(backends: &[Arc<Counting>], quiet: Duration) -> Vec<u64> {
    let end = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut last: Vec<u64> = backends.iter().map(|b| b.tries()).collect();
    loop {
        tokio::time::sleep(quiet).await;
        let now: Vec<u64> = backends.iter().map(|b| b.tries()).collect();
        if now == last || tokio::time::Instant::now() > end {
            return now;
        }
        last = now;
    }
}

/// The scenario: `holder` takes `name`; `per` waiters on each of `backends` queue behind it
/// (each a separate process's backend); `before_release` runs; the holder releases. Returns the
/// tries each backend made from just before the release until 1.5 s after the first grant (past
/// the stall timers), and the time from the release to that grant.
async fn release_among_waiting_backends(
    holder: Arc<dyn Backend>,
    backends: &[Arc<Counting>],
    name: &str,
    per: usize,
    before_release: impl std::future::Future<Output = ()>,
) -> (Vec<u64>, Duration) {
    let g = Lock::new(name)
        .ttl(TTL)
        .with_backend(holder)
        .acquire()
        .await
        .expect("holder");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<LockGuard>();
    let mut tasks = Vec::new();
    for b in backends {
        for _ in 0..per {
            let b: Arc<dyn Backend> = b.clone();
            let (tx, name) = (tx.clone(), name.to_string());
            tasks.push(tokio::spawn(async move {
                if let Ok(g) = Lock::new(name)
                    .ttl(TTL)
                    .wait(Duration::from_secs(15))
                    .with_backend(b)
                    .acquire()
                    .await
                {
                    let _ = tx.send(g);
                }
            }));
            // Arrival order across backends is the queue order.
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }
    let before = settle(backends, Duration::from_millis(400)).await;
    before_release.await;
    let released = tokio::time::Instant::now();
    g.release().await.expect("release");
    let first = tokio::time::timeout(Duration::from_secs(15), rx.recv())
        .await
        .expect("a waiter got the lock")
        .expect("guard");
    let took = released.elapsed();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after: Vec<u64> = backends.iter().map(|b| b.tries()).collect();
    drop(first);
    for t in tasks {
        t.abort();
    }
    (
        after.iter().zip(&before).map(|(a, b)| a - b).collect(),
        took,
    )
}

/// Tries after one release among three waiting processes on a Redis-family engine: one (the
/// woken process's), or two when that process took longer than the 100 ms stall bound to try
/// (a loaded test machine) and its turn was passed on to the next one. A herd is one per process
/// (3 here) or more.
fn assert_one_process_tried(tries: &[u64]) {
    let sum: u64 = tries.iter().sum();
    assert!(
        (1..=2).contains(&sum),
        "tries per backend after one release: {tries:?} (one process woken: one try, two if its try was slower than the stall bound)"
    );
}

/// `n` simulated processes: a backend each from `connect`, its tries counted.
async fn processes<B, F>(n: usize, mut connect: impl FnMut() -> F) -> Vec<Arc<Counting>>
where
    B: Backend,
    F: std::future::Future<Output = B>,
{
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(Counting::new(Arc::new(connect().await)));
    }
    v
}

async fn redis_backends(server: &RedisProc, n: usize) -> Vec<Arc<Counting>> {
    processes(n, || async {
        RedisBackend::connect(&server.url()).await.expect("connect")
    })
    .await
}

/// Three processes (backends) with two waiters each; one release: exactly one try in all (the
/// woken waiter's, granted), where before every backend woke a waiter of its own (3 tries).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_one_release_wakes_one_process_of_three() {
    let server = RedisProc::start();
    let holder = Arc::new(RedisBackend::connect(&server.url()).await.unwrap());
    let backends = redis_backends(&server, 3).await;
    let (tries, _) =
        release_among_waiting_backends(holder, &backends, "herd-one", 2, async {}).await;
    assert_one_process_tried(&tries);
}

/// Puts a dead process at the head of `queue` (live for 5 s by the server's clock, as a process
/// stopped right after its busy try would be), and a stale entry before it.
async fn add_dead_head(con: &mut impl redis::aio::ConnectionLike, queue: &str) {
    let now_ms: u64 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let _: () = redis::cmd("ZADD")
        .arg(queue)
        .arg(1)
        .arg("stale-process")
        .arg(now_ms + 5_000)
        .arg("dead-process")
        .query_async(con)
        .await
        .unwrap();
}

/// The first hand-off after a release that woke a stopped or dead queue head: about one stall
/// bound (100 ms: the other processes' stall timers ask the server to pass the turn on, which it
/// does once the turn is that old by its clock). 350 ms leaves room for a loaded machine; before
/// the turn was passed on by the server, every process waited out a 500 ms timer and then woke a
/// waiter of its own.
const STALLED_HEAD_BOUND: Duration = Duration::from_millis(350);

/// The dead-head scenario on any Redis-family engine: `holder` holds `name`, the three
/// processes of `backends` queue two waiters each, a dead process is put at the head of the
/// queue on every connection of `admins` (one per node that keeps the queue), and the holder
/// releases: the hand-off takes about one stall bound and only one process tries.
async fn a_dead_queue_head_costs_one_short_stall<C>(
    holder: Arc<dyn Backend>,
    backends: &[Arc<Counting>],
    name: &str,
    mut admins: Vec<C>,
) where
    C: redis::aio::ConnectionLike,
{
    let queue = format!("dlock:{{{name}}}:q");
    let (tries, took) = release_among_waiting_backends(holder, backends, name, 2, async {
        for con in &mut admins {
            add_dead_head(con, &queue).await;
        }
    })
    .await;
    eprintln!("hand-off after the dead head: {took:?}, tries {tries:?}");
    assert!(
        took < STALLED_HEAD_BOUND,
        "hand-off after the dead process was woken took {took:?}"
    );
    assert_one_process_tried(&tries);
}

/// A queued process that died or is stopped (its entry is still live on the server and heads
/// the queue) is woken by the release and never tries: the turn goes to the next process in
/// line within about one stall bound (not at the holder's lease end, 20 s, and not after a
/// 500 ms timer as before), and only that process tries (before, every process woke a waiter
/// after the timer: one try each, 3 here; see `assert_one_process_tried`). A stale entry (expired by the server's clock) is skipped
/// without costing anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_dead_queue_head_costs_one_short_stall_and_one_try() {
    let server = RedisProc::start();
    let holder = Arc::new(RedisBackend::connect(&server.url()).await.unwrap());
    let backends = redis_backends(&server, 3).await;
    let admin = server.admin_async().await;
    a_dead_queue_head_costs_one_short_stall(holder, &backends, "herd-dead", vec![admin]).await;
}

/// The same on Redlock: the dead process heads the queue on every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_a_dead_queue_head_costs_one_short_stall() {
    let nodes = tokio::task::spawn_blocking(|| common::redlock::start_nodes(3))
        .await
        .unwrap();
    let urls = common::redlock::urls(&nodes);
    let holder = Arc::new(common::redlock::connect_for_suite(&urls).await);
    let backends = processes(3, || common::redlock::connect_for_suite(&urls)).await;
    let admins = common::redlock::admins(&nodes)
        .await
        .into_iter()
        .map(|(_, con)| con)
        .collect();
    a_dead_queue_head_costs_one_short_stall(holder, &backends, "herd-rl-dead", admins).await;
}

/// Redlock (3 nodes): three processes (backends) with two waiters each; one release: one try
/// in all. Each node keeps the waiters' queue, and every node's release wakes the same head.
/// Before, Redlock's nodes did not queue: every node's release woke one waiter in every
/// process (3 or more tries, busy ones waking further waiters).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_one_release_wakes_one_process_of_three() {
    let nodes = tokio::task::spawn_blocking(|| common::redlock::start_nodes(3))
        .await
        .unwrap();
    let urls = common::redlock::urls(&nodes);
    let holder = Arc::new(common::redlock::connect_for_suite(&urls).await);
    let backends = processes(3, || common::redlock::connect_for_suite(&urls)).await;
    let (tries, _) =
        release_among_waiting_backends(holder, &backends, "herd-redlock", 2, async {}).await;
    assert_one_process_tried(&tries);
}

/// A waiter that gives up removes its process's entry: once the last waiter of a backend timed
/// out, the queue holds nothing of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_process_whose_waiters_left_leaves_the_queue() {
    let server = RedisProc::start();
    let holder = RedisBackend::connect(&server.url()).await.unwrap();
    let waiter = RedisBackend::connect(&server.url()).await.unwrap();
    let g = Lock::new("herd-leave")
        .ttl(TTL)
        .with_backend(Arc::new(holder))
        .acquire()
        .await
        .unwrap();
    let mut admin = server.admin_async().await;
    let w: Arc<dyn Backend> = Arc::new(waiter);
    let e = Lock::new("herd-leave")
        .ttl(TTL)
        .wait(Duration::from_millis(600))
        .with_backend(w.clone())
        .acquire()
        .await
        .unwrap_err();
    assert!(matches!(e, LockError::TimedOut { .. }), "{e}");
    // The leave is sent by the backend's subscriber task, right after the wait ended.
    let mut n: u64 = 1;
    for _ in 0..50 {
        n = redis::cmd("ZCARD")
            .arg("dlock:{herd-leave}:q")
            .query_async(&mut admin)
            .await
            .unwrap();
        if n == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(n, 0, "the waiter's process is still queued");
    g.release().await.unwrap();
}

/// The same on Sentinel: three `SentinelBackend`s over one master (each its own `RedisBackend`
/// on it), two waiters each; one release, one try.
#[cfg(feature = "sentinel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_one_release_wakes_one_process_of_three() {
    use common::sentinel::{MASTER, SentinelSet};
    let set = tokio::task::spawn_blocking(|| SentinelSet::start(false))
        .await
        .unwrap();
    let connect = || dlock::SentinelBackend::connect(MASTER, set.sentinel_urls());
    let holder = Arc::new(connect().await.unwrap());
    let backends = processes(3, || async { connect().await.unwrap() }).await;
    let (tries, _) =
        release_among_waiting_backends(holder, &backends, "herd-sentinel", 2, async {}).await;
    assert_one_process_tried(&tries);
}

/// The same on Redis Cluster (the queue key is in the lock's slot; SPUBLISH): three
/// `ClusterBackend`s over one cluster, two waiters each; one release, one try.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_one_release_wakes_one_process_of_three() {
    use common::cluster::ClusterSet;
    let set = tokio::task::spawn_blocking(|| ClusterSet::start(3, 0))
        .await
        .unwrap();
    let connect = || dlock::ClusterBackend::connect(set.urls());
    let holder = Arc::new(connect().await.unwrap());
    let backends = processes(3, || async { connect().await.unwrap() }).await;
    let (tries, _) =
        release_among_waiting_backends(holder, &backends, "herd-cluster", 2, async {}).await;
    assert_one_process_tried(&tries);
}

/// The stalled-head case on Redis Cluster (its subscriber task passes the turn on as the
/// single-node one does).
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_a_dead_queue_head_costs_one_short_stall_and_one_try() {
    use common::cluster::ClusterSet;
    let set = tokio::task::spawn_blocking(|| ClusterSet::start(3, 0))
        .await
        .unwrap();
    let connect = || dlock::ClusterBackend::connect(set.urls());
    let holder = Arc::new(connect().await.unwrap());
    let backends = processes(3, || async { connect().await.unwrap() }).await;
    let admin = set.admin().await;
    a_dead_queue_head_costs_one_short_stall(holder, &backends, "herd-cl-dead", vec![admin]).await;
}

/// etcd: three backends with two waiters each, then one backend with four: one release wakes
/// exactly one waiter (the one whose key followed the released one), not every local waiter of
/// the name in its process (before: all of them, `while wake_one {}`, 2 tries here and 4 in the
/// one-backend case, the others answered busy without a request).
#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_one_release_wakes_one_waiter_locally_and_across_processes() {
    use common::etcd::{EtcdCluster, etcd_backend};
    let cluster = tokio::task::spawn_blocking(EtcdCluster::single)
        .await
        .unwrap();
    let holder = Arc::new(etcd_backend(&cluster).await);
    let mut backends = Vec::new();
    for _ in 0..3 {
        backends.push(Counting::new(Arc::new(etcd_backend(&cluster).await)));
    }
    let (tries, _) =
        release_among_waiting_backends(holder.clone(), &backends, "herd-etcd", 2, async {}).await;
    assert_eq!(tries.iter().sum::<u64>(), 1, "tries per backend: {tries:?}");
    let one = vec![Counting::new(Arc::new(etcd_backend(&cluster).await))];
    let (tries, _) =
        release_among_waiting_backends(holder, &one, "herd-etcd-local", 4, async {}).await;
    assert_eq!(tries, vec![1], "tries of the one backend with four waiters");
}

/// ZooKeeper: the same as for etcd (before: every local waiter of the name was woken by the
/// predecessor's notification, and all but one answered busy without a request).
#[cfg(feature = "zookeeper")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_one_release_wakes_one_waiter_locally_and_across_processes() {
    use common::zookeeper::{ZkProc, zk_backend};
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let holder = Arc::new(zk_backend(&server).await);
    let mut backends = Vec::new();
    for _ in 0..3 {
        backends.push(Counting::new(Arc::new(zk_backend(&server).await)));
    }
    let (tries, _) =
        release_among_waiting_backends(holder.clone(), &backends, "herd-zk", 2, async {}).await;
    assert_eq!(tries.iter().sum::<u64>(), 1, "tries per backend: {tries:?}");
    let one = vec![Counting::new(Arc::new(zk_backend(&server).await))];
    let (tries, _) =
        release_among_waiting_backends(holder, &one, "herd-zk-local", 4, async {}).await;
    assert_eq!(tries, vec![1], "tries of the one backend with four waiters");
}

/// PostgreSQL advisory mode: three backends (each its own dedicated session, pool and listener,
/// as separate processes have) with two waiters each; one release wakes exactly one process,
/// which tries once and is granted. Before: the release NOTIFYd the table's channel, so every
/// backend woke a waiter (3 tries), and each backend's first waiter also re-tried every 500 ms
/// while it waited (the counts never settled).
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_advisory_one_release_wakes_one_process_of_three() {
    use common::Env;
    let env = Env::postgres().await;
    let (url, table) = (env.db().url.clone(), env.db().table.clone());
    let holder = Arc::new(common::sql::pg_advisory_backend(&url, &table).await);
    let mut backends = Vec::new();
    for _ in 0..3 {
        let b = common::sql::pg_advisory_backend(&url, &table).await;
        backends.push(Counting::new(Arc::new(b)));
    }
    let (tries, _) =
        release_among_waiting_backends(holder, &backends, "herd-pg-advisory", 2, async {}).await;
    assert_eq!(
        tries.iter().sum::<u64>(),
        1,
        "tries per backend after one release: {tries:?} (one process woken, one try)"
    );
}

/// PostgreSQL advisory mode, a chain of hand-offs: three backends with two waiters each queue
/// behind a holder; each waiter that gets the lock holds it 30 ms and releases. Over the six
/// hand-offs the backends make one try per release (asserted: at most 1.5 per release, the
/// issue's target; 9 in all). Before: a release woke one waiter in every backend that still
/// had waiters, plus a blind re-try every 500 ms per backend (3.7 per release in the hand-off
/// benchmark).
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_advisory_a_chain_of_releases_wakes_one_waiter_each() {
    use common::Env;
    let env = Env::postgres().await;
    let (url, table) = (env.db().url.clone(), env.db().table.clone());
    let name = "herd-pg-advisory-chain";
    let holder: Arc<dyn Backend> = Arc::new(common::sql::pg_advisory_backend(&url, &table).await);
    let mut backends = Vec::new();
    for _ in 0..3 {
        let b = common::sql::pg_advisory_backend(&url, &table).await;
        backends.push(Counting::new(Arc::new(b)));
    }
    let g = Lock::new(name)
        .ttl(TTL)
        .with_backend(holder)
        .acquire()
        .await
        .expect("holder");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let mut tasks = Vec::new();
    for b in &backends {
        for _ in 0..2 {
            let b: Arc<dyn Backend> = b.clone();
            let tx = tx.clone();
            tasks.push(tokio::spawn(async move {
                let g = Lock::new(name)
                    .ttl(TTL)
                    .wait(Duration::from_secs(15))
                    .with_backend(b)
                    .acquire()
                    .await
                    .expect("a waiter got the lock");
                tokio::time::sleep(Duration::from_millis(30)).await;
                g.release().await.expect("release");
                let _ = tx.send(());
            }));
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }
    let before = settle(&backends, Duration::from_millis(400)).await;
    g.release().await.expect("release");
    for i in 0..6 {
        tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .unwrap_or_else(|_| panic!("hand-off {i} stalled"))
            .expect("sender");
    }
    for t in tasks {
        t.await.expect("waiter task");
    }
    let after: Vec<u64> = backends.iter().map(|b| b.tries()).collect();
    let tries: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    let total: u64 = tries.iter().sum();
    eprintln!("6 releases, tries per backend {tries:?}");
    assert!(
        total <= 9,
        "{total} tries for 6 releases (per backend {tries:?}); target ≤ 1.5 per release"
    );
}

/// Semaphores on the Redis family (issue 21 item 1): a release of `k` permits wakes about `k`
/// waiters across all processes, not `k` in each. A busy permit try queues its owner on the
/// server (`dlock:sem:{E}:q`, with a heartbeat deadline by the server's clock) and the release
/// wakes exactly the first queued waiters its permits fit, by owner id.
mod permits {
    use super::*;
    use dlock::{Semaphore, SemaphoreGuard};

    /// Long enough that no waiter's heartbeat retry (every ttl/6 = 10 s) falls in a counting
    /// window: every try counted there was a wake-up's.
    const SEM_TTL: Duration = Duration::from_secs(60);

    /// Waits until no backend's permit try count moved for `quiet`, up to 10 s.
    async fn settle_permits(backends: &[Arc<Counting>], quiet: Duration) -> Vec<u64> {
        let end = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut last: Vec<u64> = backends.iter().map(|b| b.permit_tries()).collect();
        loop {
            tokio::time::sleep(quiet).await;
            let now: Vec<u64> = backends.iter().map(|b| b.permit_tries()).collect();
            if now == last || tokio::time::Instant::now() > end {
                return now;
            }
            last = now;
        }
    }

    /// `per` waiters of one permit on each of `backends` (each standing for a process) for the
    /// semaphore `name` of `max` permits with `ttl`; each sends its guard on `tx`.
    fn spawn_waiters(
        backends: &[Arc<Counting>],
        per: usize,
        name: &str,
        max: u32,
        ttl: Duration,
        tx: &tokio::sync::mpsc::UnboundedSender<SemaphoreGuard>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let mut tasks = Vec::new();
        for b in backends {
            for _ in 0..per {
                let b: Arc<dyn Backend> = b.clone();
                let (tx, name) = (tx.clone(), name.to_string());
                tasks.push(tokio::spawn(async move {
                    if let Ok(g) = Semaphore::new(name, max)
                        .ttl(ttl)
                        .wait(Duration::from_secs(15))
                        .with_backend(b)
                        .acquire()
                        .await
                    {
                        let _ = tx.send(g);
                    }
                }));
            }
        }
        tasks
    }

    /// The scenario: `holder` takes all `max` permits of `name` in one grant; two waiters of
    /// one permit on each of `backends` wait; `before_release` runs; the holder releases (`max`
    /// permits back). Returns the permit tries of each backend from just before the release
    /// until 1 s after the `max`-th grant, and the time from the release to the first grant.
    async fn permit_release_among_waiting_backends(
        holder: Arc<dyn Backend>,
        backends: &[Arc<Counting>],
        name: &str,
        max: u32,
        before_release: impl std::future::Future<Output = ()>,
    ) -> (Vec<u64>, Duration) {
        let g = Semaphore::new(name, max)
            .permits(max)
            .ttl(SEM_TTL)
            .with_backend(holder)
            .acquire()
            .await
            .expect("holder");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<SemaphoreGuard>();
        let tasks = spawn_waiters(backends, 2, name, max, SEM_TTL, &tx);
        let before = settle_permits(backends, Duration::from_millis(400)).await;
        before_release.await;
        let released = tokio::time::Instant::now();
        g.release().await.expect("release");
        let mut guards = Vec::new();
        let mut took = Duration::ZERO;
        for i in 0..max {
            let g = tokio::time::timeout(Duration::from_secs(15), rx.recv())
                .await
                .unwrap_or_else(|_| panic!("waiter {i} got no permit"))
                .expect("guard");
            if i == 0 {
                took = released.elapsed();
            }
            guards.push(g);
        }
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let after: Vec<u64> = backends.iter().map(|b| b.permit_tries()).collect();
        drop(guards);
        for t in tasks {
            t.abort();
        }
        (
            after.iter().zip(&before).map(|(a, b)| a - b).collect(),
            took,
        )
    }

    /// One release of 1 permit among 3 processes with 2 waiters each: one try in all (the
    /// woken waiter's, granted); two allowed for a try that raced the release. Before: every
    /// process woke one waiter of its own (3 tries).
    pub(super) async fn one_permit_wakes_one_waiter_of_all(
        holder: Arc<dyn Backend>,
        backends: &[Arc<Counting>],
        name: &str,
    ) {
        let (tries, took) =
            permit_release_among_waiting_backends(holder, backends, name, 1, async {}).await;
        eprintln!("1 permit back: tries per backend {tries:?}, first grant after {took:?}");
        let sum: u64 = tries.iter().sum();
        assert!(
            (1..=2).contains(&sum),
            "permit tries per backend after a release of 1 permit: {tries:?} (one waiter woken \
             across all processes, not one per process)"
        );
    }

    /// One release of 2 permits among 3 processes with 2 waiters each: two tries in all (three
    /// allowed for a raced try). Before: every process woke two waiters of its own (6 tries).
    pub(super) async fn two_permits_wake_two_waiters_of_all(
        holder: Arc<dyn Backend>,
        backends: &[Arc<Counting>],
        name: &str,
    ) {
        let (tries, took) =
            permit_release_among_waiting_backends(holder, backends, name, 2, async {}).await;
        eprintln!("2 permits back: tries per backend {tries:?}, first grant after {took:?}");
        let sum: u64 = tries.iter().sum();
        assert!(
            (2..=3).contains(&sum),
            "permit tries per backend after a release of 2 permits: {tries:?} (two waiters woken \
             across all processes, not two per process)"
        );
    }

    /// The waiters' queue is gone from the server when the release runs (deleted here, as a
    /// store that lost it would): the release finds no live waiter and wakes every process's
    /// waiters by count, so no waiter sleeps while a permit is free (the heartbeat retries are
    /// 10 s away).
    pub(super) async fn a_lost_queue_leaves_no_waiter_asleep<C>(
        holder: Arc<dyn Backend>,
        backends: &[Arc<Counting>],
        name: &str,
        mut admins: Vec<C>,
    ) where
        C: redis::aio::ConnectionLike,
    {
        let queue = format!("dlock:sem:{{{name}}}:q");
        let (_, took) = permit_release_among_waiting_backends(holder, backends, name, 1, async {
            for con in &mut admins {
                let n: u64 = redis::cmd("ZCARD")
                    .arg(&queue)
                    .query_async(con)
                    .await
                    .unwrap();
                assert_eq!(n, 6, "every waiter is queued on the server");
                let _: () = redis::cmd("DEL")
                    .arg(&queue)
                    .query_async(con)
                    .await
                    .unwrap();
            }
        })
        .await;
        assert!(
            took < Duration::from_secs(3),
            "a free permit waited {took:?} for a waiter"
        );
    }

    /// A queued waiter whose process died (it is first in the queue and still live by its
    /// heartbeat, so the release wakes it, and it never tries): the permit goes to a live
    /// waiter within about half a heartbeat (the live waiters' retries; heartbeat ttl/3 = 1 s
    /// here), not at a lease's end.
    pub(super) async fn a_dead_queued_waiter_holds_a_permit_back_at_most_a_heartbeat<C>(
        holder: Arc<dyn Backend>,
        dead: Arc<Counting>,
        backends: &[Arc<Counting>],
        name: &str,
        mut admin: C,
    ) where
        C: redis::aio::ConnectionLike,
    {
        let ttl = Duration::from_secs(3);
        let queue = format!("dlock:sem:{{{name}}}:q");
        let g = Semaphore::new(name, 1)
            .ttl(ttl)
            .with_backend(holder)
            .acquire()
            .await
            .expect("holder");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<SemaphoreGuard>();
        let mut tasks = spawn_waiters(std::slice::from_ref(&dead), 1, name, 1, ttl, &tx);
        // The dead process's waiter is queued (and has subscribed and tried again), then dies.
        let end = tokio::time::Instant::now() + Duration::from_secs(10);
        while dead.permit_tries() < 2 {
            assert!(tokio::time::Instant::now() < end, "the waiter never queued");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        dead.die();
        tasks.extend(spawn_waiters(backends, 2, name, 1, ttl, &tx));
        let died = tokio::time::Instant::now();
        let end = died + Duration::from_secs(10);
        loop {
            let n: u64 = redis::cmd("ZCARD")
                .arg(&queue)
                .query_async(&mut admin)
                .await
                .unwrap();
            if n as usize == 1 + 2 * backends.len() {
                break;
            }
            assert!(
                tokio::time::Instant::now() < end,
                "the waiters never queued ({n})"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The dead waiter's entry is still live (its heartbeat is 1 s from its last try) and
        // first (the live waiters' deadlines are later).
        let since_death = died.elapsed();
        assert!(
            since_death < Duration::from_millis(700),
            "the live waiters took {since_death:?} to queue: the dead entry may have lapsed"
        );
        let released = tokio::time::Instant::now();
        g.release().await.expect("release");
        let got = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("a live waiter got the permit")
            .expect("guard");
        let took = released.elapsed();
        eprintln!("permit after a dead queued waiter was woken: {took:?}");
        assert!(
            took < Duration::from_millis(1500),
            "the permit stayed unused {took:?} after the dead waiter was woken"
        );
        drop(got);
        for t in tasks {
            t.abort();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_permit_release_wakes_as_many_waiters_across_processes() {
    let server = RedisProc::start();
    let holder = Arc::new(RedisBackend::connect(&server.url()).await.unwrap());
    let backends = redis_backends(&server, 3).await;
    permits::one_permit_wakes_one_waiter_of_all(holder.clone(), &backends, "sem-herd-1").await;
    permits::two_permits_wake_two_waiters_of_all(holder.clone(), &backends, "sem-herd-2").await;
    let admin = server.admin_async().await;
    permits::a_lost_queue_leaves_no_waiter_asleep(holder, &backends, "sem-herd-lost", vec![admin])
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_dead_queued_permit_waiter_costs_at_most_a_heartbeat() {
    let server = RedisProc::start();
    let holder = Arc::new(RedisBackend::connect(&server.url()).await.unwrap());
    let backends = redis_backends(&server, 3).await;
    let dead = redis_backends(&server, 1).await.remove(0);
    let admin = server.admin_async().await;
    permits::a_dead_queued_waiter_holds_a_permit_back_at_most_a_heartbeat(
        holder,
        dead,
        &backends,
        "sem-herd-dead",
        admin,
    )
    .await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_a_permit_release_wakes_as_many_waiters_across_processes() {
    use common::cluster::ClusterSet;
    let set = tokio::task::spawn_blocking(|| ClusterSet::start(3, 0))
        .await
        .unwrap();
    let connect = || dlock::ClusterBackend::connect(set.urls());
    let holder = Arc::new(connect().await.unwrap());
    let backends = processes(3, || async { connect().await.unwrap() }).await;
    permits::one_permit_wakes_one_waiter_of_all(holder.clone(), &backends, "sem-herd-c1").await;
    permits::two_permits_wake_two_waiters_of_all(holder.clone(), &backends, "sem-herd-c2").await;
    let admin = set.admin().await;
    permits::a_lost_queue_leaves_no_waiter_asleep(
        holder.clone(),
        &backends,
        "sem-herd-clost",
        vec![admin],
    )
    .await;
    let dead = processes(1, || async { connect().await.unwrap() })
        .await
        .remove(0);
    let admin = set.admin().await;
    permits::a_dead_queued_waiter_holds_a_permit_back_at_most_a_heartbeat(
        holder,
        dead,
        &backends,
        "sem-herd-cdead",
        admin,
    )
    .await;
}

#[cfg(feature = "sentinel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_a_permit_release_wakes_as_many_waiters_across_processes() {
    use common::sentinel::{MASTER, SentinelSet};
    let set = tokio::task::spawn_blocking(|| SentinelSet::start(false))
        .await
        .unwrap();
    let connect = || dlock::SentinelBackend::connect(MASTER, set.sentinel_urls());
    let holder = Arc::new(connect().await.unwrap());
    let backends = processes(3, || async { connect().await.unwrap() }).await;
    permits::one_permit_wakes_one_waiter_of_all(holder.clone(), &backends, "sem-herd-s1").await;
    permits::two_permits_wake_two_waiters_of_all(holder, &backends, "sem-herd-s2").await;
}
