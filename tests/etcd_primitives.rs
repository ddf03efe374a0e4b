//! etcd-specific properties of semaphores, read-write locks and leader records (feature `etcd`)
//! that the shared suites (`on_etcd::*` in semaphore_behaviour, rw_behaviour and election) do
//! not reach: permits and read holds of a SIGKILLed process come back when its lease ends,
//! permit waiters on separate clients are served in arrival order with one watch notification
//! per waiter (no herd), a downgrade keeps the writer's place in the queue (readers before the
//! next writer go in, readers after it do not), and everything released leaves no key behind.
#![cfg(feature = "etcd")]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::etcd::{EtcdCluster, admin, etcd_backend, keys_under_root};
use common::{child_mode, child_say, spawn_self};
use dlock::{RwLock, Semaphore};

const CHILD_ENTRY: &str = "child_process_entry";

/// Not a test of its own: the entry point of child processes started by the tests below.
#[test]
#[ignore = "child-process entry point; the tests below run it in their children"]
fn child_process_entry() {
    let _mode = child_mode().expect("a child entry point runs only in a child process");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let eps: Vec<String> = std::env::var("DLOCK_ETCD")
            .expect("DLOCK_ETCD")
            .split(',')
            .map(str::to_string)
            .collect();
        let b: Arc<dyn dlock::Backend> = Arc::new(
            dlock::EtcdBackend::builder(&eps)
                .request_timeout(Duration::from_secs(1))
                .build()
                .await
                .unwrap(),
        );
        // Takes both permits of `crash-sem` and a read hold of `crash-rw` (ttl 2 s, watchdog
        // on), says so, and holds them until killed.
        let p = Semaphore::new("crash-sem", 2)
            .permits(2)
            .ttl(Duration::from_secs(2))
            .with_backend(b.clone())
            .acquire()
            .await
            .unwrap();
        let r = RwLock::new("crash-rw")
            .ttl(Duration::from_secs(2))
            .with_backend(b)
            .read()
            .await
            .unwrap();
        child_say(format!(
            "acquired {} {}",
            p.fencing_token(),
            r.fencing_token()
        ));
        std::future::pending::<()>().await
    });
}

async fn start() -> EtcdCluster {
    tokio::task::spawn_blocking(|| EtcdCluster::start(1))
        .await
        .expect("start etcd")
}

/// Number of keys under `prefix` (an admin read).
async fn count(cluster: &EtcdCluster, prefix: &str) -> i64 {
    admin(cluster)
        .await
        .get(
            prefix,
            Some(
                dlock::etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_count_only(),
            ),
        )
        .await
        .unwrap()
        .count()
}

/// The keys under `prefix` with their create revisions.
async fn entries(cluster: &EtcdCluster, prefix: &str) -> Vec<(String, i64)> {
    let r = admin(cluster)
        .await
        .get(
            prefix,
            Some(dlock::etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    r.kvs()
        .iter()
        .map(|kv| {
            (
                String::from_utf8_lossy(kv.key()).into_owned(),
                kv.create_revision(),
            )
        })
        .collect()
}

/// Polls (bounded) until `prefix` holds `n` keys.
async fn until_count(cluster: &EtcdCluster, prefix: &str, n: i64) {
    let t0 = Instant::now();
    while count(cluster, prefix).await != n {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{prefix} never held {n} keys"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A process killed with SIGKILL while it holds both permits of a semaphore and a read hold
/// (ttl 2 s, watchdog on: its backend kept its lease alive) keeps them until its lease ends on
/// the server, then a waiter of another client gets the permits and a writer the lock, with
/// larger tokens; not at once (the lease still ran), and not much later than the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_process_s_permits_and_read_hold_come_back_when_its_lease_ends() {
    let cluster = start().await;
    let b: Arc<dyn dlock::Backend> = Arc::new(etcd_backend(&cluster).await);
    let mut child = spawn_self(
        CHILD_ENTRY,
        "hold",
        &[("DLOCK_ETCD", cluster.endpoints().join(","))],
    );
    let line = tokio::task::block_in_place(|| child.expect_line(Duration::from_secs(30)));
    let tokens: Vec<u64> = line
        .strip_prefix("acquired ")
        .unwrap_or_else(|| panic!("unexpected child line {line:?}"))
        .split(' ')
        .map(|t| t.parse().unwrap())
        .collect();
    // Let the keep-alives run a few times: a live process keeps its holds past the ttl.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let busy = Semaphore::new("crash-sem", 2)
        .with_backend(b.clone())
        .acquire()
        .await;
    assert!(
        matches!(busy, Err(ref e) if e.is_contended()),
        "held by the live child: {busy:?}"
    );
    child.kill();
    let killed = Instant::now();
    let sem = Semaphore::new("crash-sem", 2)
        .permits(2)
        .wait(Duration::from_secs(10))
        .with_backend(b.clone());
    let rwl = RwLock::new("crash-rw")
        .wait(Duration::from_secs(10))
        .with_backend(b.clone());
    let (permits, writer) = tokio::join!(sem.acquire(), rwl.write());
    let at = killed.elapsed();
    let permits = permits.expect("the dead holder's permits");
    let writer = writer.expect("the dead reader's lock");
    assert!(
        at >= Duration::from_millis(300),
        "freed {at:?} after the kill: before the lease ended"
    );
    assert!(
        at < Duration::from_secs(4),
        "freed only {at:?} after the kill"
    );
    assert!(permits.fencing_token() > tokens[0]);
    assert!(writer.fencing_token() > tokens[1]);
    permits.release().await.unwrap();
    writer.release().await.unwrap();
}

/// A holder of all 2 permits; 8 waiters, each on its own client (own lease and connection, as
/// 8 processes), queue one after another. The holder's release lets the first two in, then each
/// release of one permit lets exactly the next waiter in (arrival order across clients), and each waiter's watch fires once: 8
/// notifications in total for 8 grants (a herd would notify every waiter at every release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_waiters_on_separate_clients_go_in_arrival_order_one_notification_each() {
    let cluster = start().await;
    let holder_b = Arc::new(etcd_backend(&cluster).await);
    let dir = "/dlock/.sem/order/";
    let holder = Semaphore::new("order", 2)
        .permits(2)
        .ttl(Duration::from_secs(30))
        .with_backend(holder_b.clone())
        .acquire()
        .await
        .unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut backends = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..8usize {
        let b = etcd_backend(&cluster).await;
        backends.push(b.clone());
        let order = order.clone();
        tasks.push(tokio::spawn(async move {
            let g = Semaphore::new("order", 2)
                .ttl(Duration::from_secs(30))
                .wait(Duration::from_secs(30))
                .with_backend(Arc::new(b))
                .acquire()
                .await
                .expect("a waiter gets a permit");
            order.lock().unwrap().push((i, g.fencing_token()));
            // Hold until the test gives it back (one release lets one waiter in).
            g
        }));
        // Queued (its entry is on the server) before the next one starts.
        until_count(&cluster, dir, i as i64 + 2).await;
    }
    assert!(order.lock().unwrap().is_empty(), "a waiter barged in");
    // The holder gives back both permits: waiters 0 and 1 go in.
    holder.release().await.unwrap();
    let mut guards = Vec::new();
    for t in tasks {
        let g = tokio::time::timeout(Duration::from_secs(10), t)
            .await
            .expect("a waiter within 10 s")
            .unwrap();
        // Each grant frees a place for the next only when given back.
        guards.push(g);
        if guards.len() >= 2 {
            guards.remove(0).release().await.unwrap();
        }
    }
    for g in guards {
        g.release().await.unwrap();
    }
    let order = order.lock().unwrap().clone();
    // The holder's release lets the first two in together (in either order); after that one
    // at a time, in arrival order.
    let mut who: Vec<usize> = order.iter().map(|(i, _)| *i).collect();
    who[..2].sort_unstable();
    assert_eq!(
        who,
        (0..8).collect::<Vec<_>>(),
        "not in arrival order: {order:?}"
    );
    let first_two = order[0].1.max(order[1].1);
    assert!(
        order[2..].windows(2).all(|w| w[0].1 < w[1].1) && order[2].1 > first_two,
        "tokens {order:?}"
    );
    let notes: u64 = backends.iter().map(|b| b.watch_notifications()).sum();
    assert_eq!(notes, 8, "{notes} watch notifications for 8 waiters");
    // Nothing left behind (fences and bookkeeping aside).
    until_count(&cluster, dir, 0).await;
    assert!(keys_under_root(&cluster).await.is_empty());
}

/// Writer W1 holds; reader R1, writer W2 and reader R2 queue in that order on other clients.
/// W1's downgrade lets R1 in at once (no writer before it) but neither W2 (W1's read hold keeps
/// its place before W2) nor R2 (behind the waiting writer W2); the release of both read holds
/// lets W2 in, then R2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_downgrade_keeps_the_writers_place_in_the_queue() {
    let cluster = start().await;
    let dir = "/dlock/.rw/place/";
    let rw = |b: dlock::EtcdBackend| {
        RwLock::new("place")
            .ttl(Duration::from_secs(30))
            .wait(Duration::from_secs(30))
            .with_backend(Arc::new(b))
    };
    let w1 = rw(etcd_backend(&cluster).await).write().await.unwrap();
    let r1 = tokio::spawn({
        let l = rw(etcd_backend(&cluster).await);
        async move { l.read().await.unwrap() }
    });
    until_count(&cluster, dir, 2).await;
    let w2 = tokio::spawn({
        let l = rw(etcd_backend(&cluster).await);
        async move { l.write().await.unwrap() }
    });
    until_count(&cluster, dir, 3).await;
    let r2 = tokio::spawn({
        let l = rw(etcd_backend(&cluster).await);
        async move { l.read().await.unwrap() }
    });
    until_count(&cluster, dir, 4).await;
    let wt = w1.fencing_token();
    let d = w1.downgrade().await.unwrap();
    assert!(d.fencing_token() > wt);
    let r1 = tokio::time::timeout(Duration::from_secs(5), r1)
        .await
        .expect("the reader before the waiting writer joins the downgraded hold")
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !w2.is_finished(),
        "a writer got in beside the downgraded read hold"
    );
    assert!(!r2.is_finished(), "a reader passed the waiting writer");
    d.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!w2.is_finished(), "a writer got in beside the reader R1");
    let r1t = r1.fencing_token();
    r1.release().await.unwrap();
    let w2 = tokio::time::timeout(Duration::from_secs(5), w2)
        .await
        .expect("the waiting writer goes in once the reads end")
        .unwrap();
    assert!(w2.fencing_token() > r1t);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!r2.is_finished(), "a reader got in beside the writer");
    w2.release().await.unwrap();
    let r2 = tokio::time::timeout(Duration::from_secs(5), r2)
        .await
        .expect("the last reader")
        .unwrap();
    r2.release().await.unwrap();
    until_count(&cluster, dir, 0).await;
}

/// A reader whose wait ran out (its entry was queued on the server behind a writer) takes the
/// entry away with it: once the writer releases, another writer gets the lock at once with a
/// single try (a leftover reader entry, kept alive by its backend's lease, would hold every
/// writer back for as long as that process lives).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_stops_waiting_leaves_no_entry_behind() {
    let cluster = start().await;
    let dir = "/dlock/.rw/gone/";
    let b = Arc::new(etcd_backend(&cluster).await);
    let w1 = RwLock::new("gone")
        .with_backend(Arc::new(etcd_backend(&cluster).await))
        .write()
        .await
        .unwrap();
    let r = RwLock::new("gone")
        .wait(Duration::from_millis(300))
        .with_backend(b.clone())
        .read()
        .await;
    assert!(matches!(r, Err(dlock::LockError::TimedOut { .. })), "{r:?}");
    w1.release().await.unwrap();
    until_count(&cluster, dir, 0).await;
    let w2 = RwLock::new("gone")
        .with_backend(Arc::new(etcd_backend(&cluster).await))
        .write()
        .await
        .expect("no reader entry left behind");
    w2.release().await.unwrap();
}

/// A waiting writer's entry is its "writer waiting" marker, which ends with the writer's ttl
/// unless the writer's own retries renew it: a writer (ttl 600 ms) that waits 2 s behind a
/// reader still holds new readers back (its retries renewed the marker), and goes in once the
/// reader leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_writers_retries_keep_its_marker_past_its_ttl() {
    let cluster = start().await;
    let r = RwLock::new("marker")
        .ttl(Duration::from_secs(10))
        .with_backend(Arc::new(etcd_backend(&cluster).await))
        .read()
        .await
        .unwrap();
    let writer = tokio::spawn({
        let l = RwLock::new("marker")
            .ttl(Duration::from_millis(600))
            .wait(Duration::from_secs(10))
            .with_backend(Arc::new(etcd_backend(&cluster).await));
        async move { l.write().await.map(|g| (Instant::now(), g)) }
    });
    until_count(&cluster, "/dlock/.rw/marker/", 2).await;
    let before = entries(&cluster, "/dlock/.rw/marker/").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The same entries: the writer kept its place (not given up and queued anew).
    assert_eq!(entries(&cluster, "/dlock/.rw/marker/").await, before);
    let late = RwLock::new("marker")
        .with_backend(Arc::new(etcd_backend(&cluster).await))
        .read()
        .await;
    assert!(
        matches!(late, Err(ref e) if e.is_contended()),
        "the waiting writer's marker ended while it still waited: {late:?}"
    );
    let released = Instant::now();
    r.release().await.unwrap();
    let (got, w) = writer.await.unwrap().expect("the waiting writer");
    assert!(got.duration_since(released) < Duration::from_secs(2));
    w.release().await.unwrap();
}

/// The cost of an uncontended permit or hold, once the backend's lease exists: two requests to
/// acquire (the create transaction, which also reads the entries and the fence; the fence
/// write) and one to release (the delete).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncontended_grant_costs_two_requests_and_a_release_one() {
    let cluster = start().await;
    let b = etcd_backend(&cluster).await;
    let backend: Arc<dyn dlock::Backend> = Arc::new(b.clone());
    // Warm up: the lease of this ttl is granted once per backend.
    Semaphore::new("cost", 3)
        .with_backend(backend.clone())
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let r0 = b.requests();
    let p = Semaphore::new("cost", 3)
        .with_backend(backend.clone())
        .acquire()
        .await
        .unwrap();
    assert_eq!(b.requests() - r0, 2, "requests to acquire a permit");
    let r0 = b.requests();
    p.release().await.unwrap();
    assert_eq!(b.requests() - r0, 1, "requests to release a permit");
    let l = RwLock::new("cost").with_backend(backend.clone());
    let r0 = b.requests();
    let g = l.read().await.unwrap();
    assert_eq!(b.requests() - r0, 2, "requests to acquire a read hold");
    let r0 = b.requests();
    g.release().await.unwrap();
    assert_eq!(b.requests() - r0, 1, "requests to release a read hold");
    let r0 = b.requests();
    let g = l.write().await.unwrap();
    assert_eq!(b.requests() - r0, 2, "requests to acquire a write hold");
    let r0 = b.requests();
    g.release().await.unwrap();
    assert_eq!(b.requests() - r0, 1, "requests to release a write hold");
}
