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
