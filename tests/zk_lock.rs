//! ZooKeeper-specific properties (feature `zookeeper`): no herd and FIFO hand-off across
//! sessions. The shared suites (`on_zookeeper::*` in lock_behaviour / wait_behaviour) cover the
//! common contract.
#![cfg(feature = "zookeeper")]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::proxy::{Mode, Proxy};
use common::zookeeper::{SESSION, ZkProc, admin, zk_backend};
use dlock::Lock;

/// 16 contenders, each on its own backend (its own session, as 16 processes would have), queue
/// on one name in a known order. Every release must produce exactly one predecessor-watch
/// notification in total (no herd) and hand the lock to the next contender in arrival order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_contenders_one_notification_per_release_in_arrival_order() {
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let holder_b = zk_backend(&server).await;
    let holder = Lock::new("herd")
        .with_backend(Arc::new(holder_b))
        .acquire()
        .await
        .unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut backends = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..16 {
        let b = zk_backend(&server).await;
        backends.push(b.clone());
        let order = order.clone();
        let lock = Lock::new("herd")
            .with_backend(Arc::new(b))
            .wait(Duration::from_secs(60));
        tasks.push(tokio::spawn(async move {
            let g = lock.acquire().await.expect("contender acquires");
            order.lock().unwrap().push(i);
            // Hold briefly so the count per release can be checked between releases.
            tokio::time::sleep(Duration::from_millis(100)).await;
            g.release().await.unwrap();
        }));
        // Arrival order: each contender's node exists before the next starts.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let total = |bs: &[dlock::ZookeeperBackend]| -> u64 {
        bs.iter().map(|b| b.watch_notifications()).sum()
    };
    assert_eq!(total(&backends), 0, "notifications before any release");
    holder.release().await.unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    let order = order.lock().unwrap().clone();
    assert_eq!(order, (0..16).collect::<Vec<_>>(), "hand-off order");
    // 16 releases before the last contender's (holder + 15 contenders), each waking only its
    // successor: 16 notifications, not 16 + 15 + ... as with a watch on the lock node.
    assert_eq!(total(&backends), 16, "one notification per release");
    for (i, b) in backends.iter().enumerate() {
        assert_eq!(
            b.watch_notifications(),
            1,
            "contender {i} was notified once"
        );
    }
}

/// An expired session makes its holder's `lost()` fire at once. The holder's path to the server
/// is cut (a proxy refuses its connections), another connection attaches to its session and
/// closes it (as ZooKeeper's own tests expire sessions), then the path is restored: the holder's
/// client learns `Expired`. The watchdog is off and the lease is the session timeout, so without
/// the session watcher the only signal would be the deadline (reason `Deadline`). The same
/// backend then serves a later acquisition on a new session, with a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_session_fires_lost_at_once_and_later_acquisitions_get_a_new_session() {
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let proxy = Proxy::start(server.port());
    let b = dlock::ZookeeperBackend::builder(&format!("127.0.0.1:{}", proxy.port()))
        .session_timeout(Duration::from_secs(5))
        .build()
        .await
        .unwrap();
    let backend: Arc<dyn dlock::Backend> = Arc::new(b.clone());
    let lock = Lock::new("expire")
        .with_backend(backend.clone())
        .ttl(Duration::from_secs(60))
        .watchdog(false);
    let g = lock.acquire().await.unwrap();
    let deadline = Instant::now() + b.session_timeout();
    let old_session = b.session_id();
    proxy.set_mode(Mode::Reset);
    let thief = zookeeper_client::Client::connector()
        .session(b.session_info())
        .connect(&server.hosts())
        .await
        .expect("attach to the holder's session");
    drop(thief); // closes the session on the server
    let c = admin(&server).await;
    let dir = b.lock_dir("expire");
    while !c.list_children(&dir).await.unwrap_or_default().is_empty() {
        assert!(Instant::now() < deadline, "the session was not closed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.set_mode(Mode::Pass);
    let reason = tokio::time::timeout(Duration::from_secs(20), g.lost())
        .await
        .expect("lost() fired");
    assert_eq!(
        reason,
        dlock::LostReason::NotOwner,
        "lost by the session watcher"
    );
    assert!(
        Instant::now() < deadline,
        "lost() came only at the guard's deadline"
    );
    assert!(!g.is_valid());
    let first_token = g.fencing_token();
    drop(g);
    let g2 = tokio::time::timeout(Duration::from_secs(20), lock.acquire())
        .await
        .expect("acquire is bounded")
        .expect("a later acquisition works on a new session");
    assert_ne!(b.session_id(), old_session, "a new session was opened");
    assert!(g2.fencing_token() > first_token);
    g2.release().await.unwrap();
}

/// A holder cut off from the server (a proxy blackholes its connection) keeps its lock through a
/// short blip, and counts itself lost by its own deadline, the session timeout from its last
/// answered check, although its ttl is 60 s: reason `Deadline`, since nothing told it. Once the
/// path is back, the server has expired the session and the same backend acquires again on a
/// new session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnected_holder_is_lost_by_its_session_deadline_then_a_new_session_serves() {
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let proxy = Proxy::start(server.port());
    let b = dlock::ZookeeperBackend::builder(&format!("127.0.0.1:{}", proxy.port()))
        .session_timeout(SESSION)
        .build()
        .await
        .unwrap();
    let session = b.session_timeout();
    let backend: Arc<dyn dlock::Backend> = Arc::new(b.clone());
    let lock = Lock::new("cut")
        .with_backend(backend.clone())
        .ttl(Duration::from_secs(60));
    let g = lock.acquire().await.unwrap();
    // A blip well inside the session timeout: nothing is lost.
    proxy.set_mode(Mode::Blackhole);
    tokio::time::sleep(session / 5).await;
    proxy.set_mode(Mode::Pass);
    tokio::time::sleep(session * 2).await;
    assert!(g.is_valid(), "a short blip lost the lock");
    assert_eq!(g.lost_reason(), None);
    let old_session = b.session_id();
    // Cut for good: lost by the session deadline, not the 60 s ttl.
    let cut = Instant::now();
    proxy.set_mode(Mode::Blackhole);
    let reason = tokio::time::timeout(session * 3, g.lost())
        .await
        .expect("lost() by the session deadline");
    assert!(
        cut.elapsed() <= session + Duration::from_millis(1500),
        "lost() {:?} after the cut, session {session:?}",
        cut.elapsed()
    );
    assert_eq!(reason, dlock::LostReason::Deadline);
    // Let the server expire the session, then restore the path.
    tokio::time::sleep(session * 2).await;
    proxy.set_mode(Mode::Pass);
    drop(g);
    let start = Instant::now();
    let g2 = loop {
        match tokio::time::timeout(Duration::from_secs(10), lock.acquire()).await {
            Ok(Ok(g)) => break g,
            other => {
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "no acquisition after the path came back: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert_ne!(b.session_id(), old_session, "a new session was opened");
    g2.release().await.unwrap();
}
