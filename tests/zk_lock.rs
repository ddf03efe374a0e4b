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
    let thief = common::zookeeper::connector()
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

const DIGEST_USER: &str = "locker";
/// With a `/` and an `@`: the URL form percent-encodes them (`DIGEST_PASSWORD_IN_URL`).
const DIGEST_PASSWORD: &str = "s3cr/et@Pw";
const DIGEST_PASSWORD_IN_URL: &str = "s3cr%2Fet%40Pw";

/// True for `LockError::Backend` whose source is ZooKeeper's `NoAuth`.
fn is_no_auth(e: &dlock::LockError) -> bool {
    matches!(e, dlock::LockError::Backend { source, .. }
        if source.downcast_ref::<zookeeper_client::Error>() == Some(&zookeeper_client::Error::NoAuth))
}

/// Digest auth (issue 10, builders): the operator creates the lock root with an ACL for one
/// digest user only. A backend authenticated as that user (builder or `zk://user:pw@` URL) takes
/// and releases locks, and its nodes carry the digest ACL rather than `world:anyone`. A backend
/// with a wrong password, or with none, gets a typed `LockError::Backend` (source `NoAuth`) at
/// once with `wait = 0`, a bounded `TimedOut` with a wait, and leaves no node behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn digest_auth_right_credentials_lock_wrong_or_none_get_a_typed_error() {
    use zookeeper_client as zk;
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let operator = common::zookeeper::connector()
        .session_timeout(Duration::from_secs(5))
        .auth(
            "digest".to_string(),
            format!("{DIGEST_USER}:{DIGEST_PASSWORD}").into_bytes(),
        )
        .connect(&server.hosts())
        .await
        .expect("operator client");
    operator
        .create(
            "/dlock",
            b"",
            &zk::CreateMode::Persistent.with_acls(zk::Acls::creator_all()),
        )
        .await
        .expect("create /dlock with the digest user's ACL");
    let (root_acl, _) = operator.get_acl("/dlock").await.unwrap();
    assert!(
        root_acl.iter().all(|a| a.scheme() == "digest"),
        "{root_acl:?}"
    );

    let good = dlock::ZookeeperBackend::builder(&server.hosts())
        .session_timeout(SESSION)
        .digest_auth(DIGEST_USER, DIGEST_PASSWORD)
        .build()
        .await
        .expect("connect with the right digest");
    let g = Lock::new("acl")
        .with_backend(Arc::new(good.clone()))
        .acquire()
        .await
        .expect("the digest user takes the lock");
    let dir = good.lock_dir("acl");
    let kids = operator.list_children(&dir).await.unwrap();
    assert_eq!(kids.len(), 1, "{kids:?}");
    for path in [dir.clone(), format!("{dir}/{}", kids[0])] {
        let (acl, _) = operator.get_acl(&path).await.unwrap();
        assert!(
            !acl.is_empty() && acl.iter().all(|a| a.scheme() == "digest"),
            "{path} has ACL {acl:?}, not the digest user's"
        );
    }

    // The URL form authenticates the same way.
    let by_url = dlock::ZookeeperBackend::connect(&format!(
        "zk://{DIGEST_USER}:{DIGEST_PASSWORD_IN_URL}@{}",
        server.hosts()
    ))
    .await
    .expect("connect by URL with credentials");
    let e = Lock::new("acl")
        .with_backend(Arc::new(by_url.clone()))
        .acquire()
        .await
        .unwrap_err();
    assert!(
        e.is_contended(),
        "the URL backend sees the lock held: {e:?}"
    );

    let wrong = dlock::ZookeeperBackend::builder(&server.hosts())
        .session_timeout(SESSION)
        .digest_auth(DIGEST_USER, "not-the-password")
        .build()
        .await
        .expect("ZooKeeper accepts any digest at connect; the ACLs refuse it");
    let none = zk_backend(&server).await;
    for (who, b) in [("wrong password", wrong), ("no credentials", none)] {
        let b: Arc<dyn dlock::Backend> = Arc::new(b);
        // Under an existing lock parent (held by the good user) and under a new name (the
        // parent must be created in the root).
        for name in ["acl", "acl-new"] {
            let t = Instant::now();
            let e = tokio::time::timeout(
                Duration::from_secs(10),
                Lock::new(name).with_backend(b.clone()).acquire(),
            )
            .await
            .unwrap_or_else(|_| panic!("{who}: acquire of {name} hung"))
            .unwrap_err();
            assert!(is_no_auth(&e), "{who}, {name}: expected NoAuth, got {e:?}");
            assert!(
                t.elapsed() < Duration::from_secs(3),
                "{who}, {name}: refused only after {:?}",
                t.elapsed()
            );
            let wait = Duration::from_millis(800);
            let t = Instant::now();
            let e = tokio::time::timeout(
                Duration::from_secs(10),
                Lock::new(name).with_backend(b.clone()).wait(wait).acquire(),
            )
            .await
            .unwrap_or_else(|_| panic!("{who}: waiting acquire of {name} hung"))
            .unwrap_err();
            assert!(
                matches!(e, dlock::LockError::TimedOut { .. }) || is_no_auth(&e),
                "{who}, {name} with a wait: {e:?}"
            );
            assert!(
                t.elapsed() < wait + Duration::from_millis(1500),
                "{who}, {name}: gave up after {:?} (wait {wait:?})",
                t.elapsed()
            );
        }
    }
    // Nothing queued by the refused backends; the new name's parent was never made.
    assert_eq!(operator.list_children(&dir).await.unwrap().len(), 1);
    assert_eq!(
        operator
            .check_stat(&good.lock_dir("acl-new"))
            .await
            .unwrap(),
        None
    );
    g.release().await.unwrap();
    // The URL backend (same identity) gets the lock after the release.
    let g2 = Lock::new("acl")
        .with_backend(Arc::new(by_url))
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .expect("same identity by URL takes it after the release");
    g2.release().await.unwrap();
}

/// Two tasks of one runtime share one `ZookeeperBackend` and take turns on one name (25 locked
/// non-atomic increments each, default ttl 30 s, wait 5 s). A task that arrives while the other
/// waits queues locally without a node of its own; before the fix, a release woke nobody, so
/// the two ended up waiting for each other until the wait ran out (both `TimedOut`). The count
/// is exact and nobody times out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tasks_sharing_a_backend_take_turns_without_stalling() {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let backend: Arc<dyn dlock::Backend> = Arc::new(zk_backend(&server).await);
    let counter = Arc::new(AtomicU64::new(0));
    let mut ts = Vec::new();
    for _ in 0..2 {
        let (b, c) = (backend.clone(), counter.clone());
        ts.push(tokio::spawn(async move {
            for _ in 0..25 {
                common::runtimes::locked_increment(&b, &c, None).await;
            }
        }));
    }
    for t in ts {
        t.await.unwrap();
    }
    assert_eq!(counter.load(Relaxed), 50, "lost updates");
}

/// The ZooKeeper twin of etcd_lock's cross-runtime test: one `ZookeeperBackend` built on runtime
/// A, used from A and from runtime B on another thread (exact non-atomic count); then A shuts
/// down while B keeps locking and holding a lock for three session timeouts.
#[test]
fn one_backend_two_runtimes_exact_count_and_no_hang_after_one_shuts_down() {
    let server = ZkProc::start();
    common::runtimes::one_backend_two_runtimes(
        async { Arc::new(zk_backend(&server).await) as Arc<dyn dlock::Backend> },
        None,
        SESSION * 3,
    );
}

/// The operator's view (issue 11) of a ZooKeeper lock: `show` names the holder's owner id (the
/// node's data), its token and the contender queued behind it; a force-release deletes the
/// holder's node only, so the queued contender's predecessor watch fires and it takes over at
/// once, and the evicted holder hears `lost()` (NotOwner) at its next check of its node (a
/// third of the session timeout), long before any lease would end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_released_holder_hears_lost_at_its_next_check_and_the_queued_contender_takes_over() {
    use dlock::admin::ForceReleased;
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let a: Arc<dyn dlock::Backend> = Arc::new(zk_backend(&server).await);
    let b: Arc<dyn dlock::Backend> = Arc::new(zk_backend(&server).await);
    let admin = dlock::admin::connect(&server.url()).await.expect("admin");
    assert_eq!(admin.engine(), "zookeeper");
    let holder = Lock::new("evict")
        .with_backend(a)
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let lost = holder.lost();
    let waiter = tokio::spawn(async move {
        Lock::new("evict")
            .with_backend(b)
            .wait(Duration::from_secs(30))
            .acquire()
            .await
    });
    let queued = common::eventually(Duration::from_secs(10), || async {
        admin
            .show("evict")
            .await
            .unwrap()
            .is_some_and(|i| i.waiters == Some(1))
    })
    .await;
    assert!(queued, "the contender never showed up queued");
    let info = admin.show("evict").await.unwrap().expect("held");
    assert_eq!(info.holders[0].owner, holder.owner(), "{info:?}");
    assert_eq!(info.token, Some(holder.fencing_token()));
    assert_eq!(
        info.remaining, None,
        "a session's lease has no per-lock expiry"
    );
    assert!(
        info.details
            .iter()
            .any(|(k, v)| k == "holder node" && v.starts_with("/dlock/evict/_c_")),
        "{:?}",
        info.details
    );

    let t0 = Instant::now();
    let r = admin.force_release("evict", Some(&info)).await.unwrap();
    assert!(
        matches!(&r, ForceReleased::Released { woke: Some(1), .. }),
        "{r:?}"
    );
    let g2 = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the queued contender was not handed the lock")
        .unwrap()
        .expect("the queued contender acquires");
    assert!(g2.fencing_token() > holder.fencing_token());
    let reason = tokio::time::timeout(SESSION / 3 + Duration::from_millis(1500), lost)
        .await
        .expect("the evicted holder did not hear lost() at its next check");
    assert_eq!(reason, dlock::LostReason::NotOwner);
    assert!(t0.elapsed() < SESSION * 2, "lost after {:?}", t0.elapsed());
    assert!(!holder.is_valid());
    // The evicted holder's give-back deletes nothing of the new holder's.
    let _ = holder.release().await;
    let now = admin
        .show("evict")
        .await
        .unwrap()
        .expect("held by the contender");
    assert_eq!(now.token, Some(g2.fencing_token()));
    assert_eq!(now.holders[0].owner, g2.owner());
    assert_eq!(now.waiters, Some(0));
    g2.release().await.unwrap();
    assert_eq!(admin.show("evict").await.unwrap(), None);
}

/// `zk://user:password@` for the admin (issue 11): with the lock root restricted to one digest
/// identity, the admin with that identity reads and unlocks; without it, or with a wrong
/// password, reading is a server error (NoAuth); an unreachable server is a connection error
/// within the bound. No target, `Debug` output or error message contains a password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_over_a_digest_url_reads_and_unlocks_and_never_shows_the_password() {
    use dlock::admin::{AdminErrorKind, ForceReleased};
    use zookeeper_client as zk;
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let operator = common::zookeeper::connector()
        .session_timeout(Duration::from_secs(5))
        .auth(
            "digest".to_string(),
            format!("{DIGEST_USER}:{DIGEST_PASSWORD}").into_bytes(),
        )
        .connect(&server.hosts())
        .await
        .expect("operator client");
    operator
        .create(
            "/dlock",
            b"",
            &zk::CreateMode::Persistent.with_acls(zk::Acls::creator_all()),
        )
        .await
        .expect("create /dlock with the digest user's ACL");
    let good = dlock::ZookeeperBackend::builder(&server.hosts())
        .session_timeout(SESSION)
        .digest_auth(DIGEST_USER, DIGEST_PASSWORD)
        .build()
        .await
        .unwrap();
    let g = Lock::new("acl-adm")
        .with_backend(Arc::new(good))
        .acquire()
        .await
        .unwrap();

    let url = format!(
        "zk://{DIGEST_USER}:{DIGEST_PASSWORD_IN_URL}@{}",
        server.hosts()
    );
    let admin = dlock::admin::connect(&url).await.expect("admin by URL");
    assert_eq!(
        admin.target(),
        format!("zk://{DIGEST_USER}@{}", server.hosts())
    );
    assert!(!format!("{admin:?}").contains(DIGEST_PASSWORD));
    let listing = admin.list("").await.expect("list as the digest user");
    assert_eq!(listing.locks.len(), 1, "{listing:?}");
    let info = &listing.locks[0];
    assert_eq!(info.name, "acl-adm");
    assert_eq!(info.token, Some(g.fencing_token()));
    assert!(!format!("{info:?}").contains(DIGEST_PASSWORD));

    for (who, url, secret) in [
        ("no credentials", server.url(), None),
        (
            "wrong password",
            format!("zk://{DIGEST_USER}:Wr0ng-Pw@{}", server.hosts()),
            Some("Wr0ng-Pw"),
        ),
    ] {
        // ZooKeeper accepts any digest at connect; the root's ACL refuses the reads.
        let other = dlock::admin::connect(&url).await.expect("session opens");
        let e = other.list("").await.unwrap_err();
        assert_eq!(e.kind, AdminErrorKind::Server, "{who}: {e}");
        assert!(e.message.contains("not authorized"), "{who}: {e}");
        let e = other.show("acl-adm").await.unwrap_err();
        assert_eq!(e.kind, AdminErrorKind::Server, "{who}: {e}");
        for s in [Some(DIGEST_PASSWORD), secret].into_iter().flatten() {
            assert!(!e.message.contains(s), "{who}: {e}");
            assert!(!format!("{other:?}").contains(s), "{who}");
            assert!(!other.target().contains(s), "{who}");
        }
    }

    // Nothing listens on this port: a connection error within the call bound.
    let closed = common::free_port();
    let t = Instant::now();
    let e = dlock::admin::connect(&format!(
        "zk://{DIGEST_USER}:{DIGEST_PASSWORD_IN_URL}@127.0.0.1:{closed}"
    ))
    .await
    .unwrap_err();
    assert_eq!(e.kind, AdminErrorKind::Connect, "{e}");
    assert!(!e.message.contains(DIGEST_PASSWORD), "{e}");
    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());

    let r = admin.force_release("acl-adm", Some(info)).await.unwrap();
    assert!(matches!(r, ForceReleased::Released { .. }), "{r:?}");
    let reason = tokio::time::timeout(Duration::from_secs(5), g.lost())
        .await
        .expect("the evicted holder hears lost()");
    assert_eq!(reason, dlock::LostReason::NotOwner);
    assert_eq!(admin.show("acl-adm").await.unwrap(), None);
}

async fn next(w: &mut dlock::admin::Watching) -> dlock::admin::LockEvent {
    match tokio::time::timeout(Duration::from_secs(15), w.events.recv()).await {
        Ok(Some(Ok(e))) => e,
        other => panic!("no watch event: {other:?}"),
    }
}

/// The admin's watch (issue 11) across a dropped connection of its own: events while it was
/// disconnected may be lost (ZOOKEEPER-4698), so it reads the locks again once reconnected and
/// reports what changed: the holder of before released, the holder of now acquired (owner and
/// token). Before that, a contender queueing and leaving shows as `Other`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_watch_reports_changes_missed_while_its_connection_was_down() {
    use dlock::admin::LockEvent;
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let proxy = Proxy::start(server.port());
    let admin = dlock::admin::connect(&format!("zk://127.0.0.1:{}", proxy.port()))
        .await
        .expect("admin through the proxy");
    let a: Arc<dyn dlock::Backend> = Arc::new(zk_backend(&server).await);
    let b: Arc<dyn dlock::Backend> = Arc::new(zk_backend(&server).await);
    let first = Lock::new("rc").with_backend(a).acquire().await.unwrap();
    let mut w = admin.watch("rc").await.expect("watch");
    // A contender that waits briefly queues a node and removes it when it gives up.
    let e = Lock::new("rc")
        .with_backend(b.clone())
        .wait(Duration::from_millis(300))
        .acquire()
        .await
        .unwrap_err();
    assert!(
        e.is_contended() || matches!(e, dlock::LockError::TimedOut { .. }),
        "{e:?}"
    );
    let mut seen = vec![next(&mut w).await, next(&mut w).await];
    seen.sort_by_key(|e| format!("{e:?}"));
    assert!(
        seen.iter()
            .all(|e| matches!(e, LockEvent::Other { name, .. } if name == "rc")),
        "{seen:?}"
    );

    proxy.set_mode(Mode::Reset);
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.release().await.unwrap();
    let second = Lock::new("rc").with_backend(b).acquire().await.unwrap();
    proxy.set_mode(Mode::Pass);

    let mut seen = Vec::new();
    while !seen.iter().any(|e| matches!(e, LockEvent::Acquired { .. })) {
        seen.push(next(&mut w).await);
    }
    assert_eq!(
        seen[0],
        LockEvent::Released { name: "rc".into() },
        "{seen:?}"
    );
    assert_eq!(
        seen.last(),
        Some(&LockEvent::Acquired {
            name: "rc".into(),
            owner: Some(second.owner().to_string()),
            token: Some(second.fencing_token()),
        }),
        "{seen:?}"
    );
    second.release().await.unwrap();
    assert_eq!(
        next(&mut w).await,
        LockEvent::Released { name: "rc".into() }
    );
}

/// Nodes under the lock root that dlock never writes (a root child whose name is not an
/// escaped lock name, a child of a lock parent that is not a contender node) are counted in the
/// admin's `skipped`, never listed; they do not hide the lock next to them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_list_counts_foreign_nodes_as_skipped() {
    use zookeeper_client as zk;
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let b = zk_backend(&server).await;
    let g = Lock::new("skip:1")
        .with_backend(Arc::new(b.clone()))
        .acquire()
        .await
        .unwrap();
    let c = admin(&server).await;
    let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    c.create("/dlock/skip:raw", b"", &persistent).await.unwrap();
    c.create(
        &format!("{}/foreign", b.lock_dir("skip:1")),
        b"",
        &persistent,
    )
    .await
    .unwrap();
    c.create("/dlock/other:raw", b"", &persistent)
        .await
        .unwrap();
    let admin = dlock::admin::connect(&server.url()).await.unwrap();
    let all = admin.list("").await.unwrap();
    assert_eq!(all.locks.len(), 1, "{all:?}");
    assert_eq!(all.locks[0].name, "skip:1");
    assert_eq!(all.locks[0].token, Some(g.fencing_token()));
    assert_eq!(all.skipped, 3, "{all:?}");
    let some = admin.list("skip").await.unwrap();
    assert_eq!(some.locks.len(), 1, "{some:?}");
    assert_eq!(
        some.skipped, 2,
        "only the foreign nodes under the prefix: {some:?}"
    );
    g.release().await.unwrap();
}

/// Busy tries leave no predecessor watch behind (review M4). Every try that finds the name held
/// queues a node and watches its predecessor; the give-back of a busy try (wait 0) must drop
/// that watch. After 1,000 busy tries on a second backend, the holder's release wakes nobody
/// there (0 predecessor-watch notifications: nobody waits), and only the holder's node was
/// left. Before, each try left a task (holding the backend) and a client watcher on the
/// holder's node until it changed, and the release fired all 1,000 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_busy_tries_leave_no_predecessor_watch_behind() {
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let b1 = zk_backend(&server).await;
    let b2 = zk_backend(&server).await;
    let holder = Lock::new("hot")
        .with_backend(Arc::new(b1.clone()))
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let b2d: Arc<dyn dlock::Backend> = Arc::new(b2.clone());
    for i in 0..1000 {
        let r = Lock::new("hot").with_backend(b2d.clone()).acquire().await;
        assert!(
            matches!(r, Err(dlock::LockError::Busy { .. })),
            "try {i}: {r:?}"
        );
    }
    let admin_c = admin(&server).await;
    let dir = b1.lock_dir("hot");
    let left = common::eventually(Duration::from_secs(10), || async {
        admin_c.list_children(&dir).await.unwrap().len() == 1
    })
    .await;
    assert!(left, "the busy tries' nodes are not all gone");
    // A try can queue behind the node of the try before it, whose give-back (in the
    // background) deletes it a moment later: that watch fires, rightly, while the try is
    // still there. Count only what the holder's release fires.
    let before = b2.watch_notifications();
    holder.release().await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    eprintln!("notifications before the release: {before}");
    assert_eq!(
        b2.watch_notifications() - before,
        0,
        "predecessor watches of busy tries fired after they had left"
    );
}

/// `zk://host:port/chroot`, the documented URL form (docs/zookeeper.md), on a fresh ensemble where the chroot does
/// not exist yet (issue 20: every acquire failed with `NoNode`): the backend creates it, as
/// Curator creates its namespace, and its locks live under it and exclude each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_chroot_is_created_and_locks_live_under_it() {
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let url = format!("{}/apps/dlock-chroot", server.url());
    let a = Arc::new(
        dlock::ZookeeperBackend::connect(&url)
            .await
            .expect("connect with a chroot that does not exist yet"),
    );
    let b = Arc::new(
        dlock::ZookeeperBackend::connect(&url)
            .await
            .expect("connect with the chroot now there"),
    );
    let g = Lock::new("chrooted")
        .with_backend(a)
        .acquire()
        .await
        .expect("an acquire under the new chroot");
    let busy = Lock::new("chrooted")
        .with_backend(b.clone())
        .acquire()
        .await;
    assert!(
        matches!(busy, Err(dlock::LockError::Busy { .. })),
        "{busy:?}"
    );
    let c = admin(&server).await;
    let under = c.list_children("/apps/dlock-chroot").await.unwrap();
    assert!(!under.is_empty(), "the lock tree lives under the chroot");
    g.release().await.unwrap();
    Lock::new("chrooted")
        .with_backend(b)
        .acquire()
        .await
        .expect("free after the release")
        .release()
        .await
        .unwrap();
}

/// K waiters in one process (one backend, one session) queue on one name: a hand-off must cost
/// about one children listing in that process, not one per waiter (review m1, issue 19). A
/// predecessor's notification wakes every local waiter of the name; only the one whose own
/// predecessor left may go to the server, the others answer busy from what they know. Counted
/// between the second and the last grant (by then every waiter has its node): before, each
/// hand-off re-listed the children once per remaining waiter (about K/2 per hand-off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_off_among_local_waiters_costs_one_listing_not_one_per_waiter() {
    const K: usize = 8;
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let holder_b = zk_backend(&server).await;
    let b = zk_backend(&server).await;
    let holder = Lock::new("local-herd")
        .with_backend(Arc::new(holder_b))
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let grants = Arc::new(Mutex::new(Vec::new()));
    let bd: Arc<dyn dlock::Backend> = Arc::new(b.clone());
    let mut tasks = Vec::new();
    for _ in 0..K {
        let (grants, bd, b) = (grants.clone(), bd.clone(), b.clone());
        tasks.push(tokio::spawn(async move {
            let g = Lock::new("local-herd")
                .with_backend(bd)
                .ttl(Duration::from_secs(60))
                .wait(Duration::from_secs(60))
                .acquire()
                .await
                .expect("a local waiter acquires");
            grants.lock().unwrap().push(b.children_reads());
            tokio::time::sleep(Duration::from_millis(200)).await;
            g.release().await.unwrap();
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    holder.release().await.unwrap();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("every waiter gets its turn")
            .unwrap();
    }
    let grants = grants.lock().unwrap().clone();
    assert_eq!(grants.len(), K);
    let per_hand_off = (grants[K - 1] - grants[1]) as f64 / (K - 2) as f64;
    eprintln!("children listings at each grant: {grants:?}; per hand-off: {per_hand_off:.2}");
    assert!(
        per_hand_off <= 1.5,
        "{per_hand_off:.2} children listings per hand-off among {K} local waiters"
    );
}

/// The server's watch count (`wchs`: "Total watches:N").
fn server_watches(server: &ZkProc) -> Option<u64> {
    let out = common::zookeeper::four_letter(server.port(), "wchs")?;
    let line = out.lines().find(|l| l.contains("Total watches:"))?;
    line.rsplit(':').next()?.trim().parse().ok()
}

/// Issue 19 item 3: 1,000 waits that time out and 1,000 busy tries against a held lock leave
/// nothing behind: no predecessor-watch task and no waiter in this process, no watch on the
/// server (`wchs`), and the holder's release wakes nobody here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_timed_out_waits_and_busy_tries_leave_no_task_and_no_watch() {
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let b1 = zk_backend(&server).await;
    let b2 = zk_backend(&server).await;
    let holder = Lock::new("held-long")
        .with_backend(Arc::new(b1.clone()))
        .ttl(Duration::from_secs(600))
        .acquire()
        .await
        .unwrap();
    assert_eq!(server_watches(&server), Some(0), "no watch before");
    let b2d: Arc<dyn dlock::Backend> = Arc::new(b2.clone());
    for i in 0..1000 {
        let r = Lock::new("held-long")
            .with_backend(b2d.clone())
            .wait(Duration::from_millis(20))
            .acquire()
            .await;
        // A wait this short ends timed out, or (its first reply later than the wait) as a
        // backend error: either way the contender leaves.
        assert!(
            matches!(
                r,
                Err(dlock::LockError::TimedOut { .. }
                    | dlock::LockError::Busy { .. }
                    | dlock::LockError::Backend { .. })
            ),
            "wait {i}: {r:?}"
        );
        let r = Lock::new("held-long")
            .with_backend(b2d.clone())
            .acquire()
            .await;
        assert!(
            matches!(r, Err(dlock::LockError::Busy { .. })),
            "try {i}: {r:?}"
        );
    }
    let admin_c = admin(&server).await;
    let dir = b1.lock_dir("held-long");
    let clean = common::eventually(Duration::from_secs(20), || async {
        admin_c.list_children(&dir).await.unwrap().len() == 1
            && b2.watch_tasks() == 0
            && server_watches(&server) == Some(0)
    })
    .await;
    assert!(
        clean,
        "left behind: {} nodes, {} watch tasks, server watches {:?}",
        admin_c.list_children(&dir).await.unwrap().len(),
        b2.watch_tasks(),
        server_watches(&server)
    );
    assert_eq!(b2.waiter_count(), 0, "no waiter left in the process");
    let before = b2.watch_notifications();
    holder.release().await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        b2.watch_notifications() - before,
        0,
        "the release woke a contender that had left"
    );
}

/// Review m6: the first digest identity to lock on a fresh ensemble creates the root. Before, it
/// made it (like every missing ancestor) a container with `creator_all`, so a second service with
/// its own digest user got `NoAuth` for every name until the root emptied and went. Now the root
/// is a plain persistent node that every identity may read and create lock parents under, while
/// each lock parent and node stays its creator's only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_made_by_one_digest_identity_lets_another_lock_its_own_names() {
    use zookeeper_client as zk;
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let with = |user: &'static str| {
        dlock::ZookeeperBackend::builder(&server.hosts())
            .session_timeout(SESSION)
            .root("/apps/dlock")
            .digest_auth(user, "pw")
    };
    let first = Arc::new(with("first").build().await.unwrap());
    let second = Arc::new(with("second").build().await.unwrap());
    let g1 = Lock::new("one")
        .with_backend(first.clone())
        .acquire()
        .await
        .unwrap();
    let g2 = Lock::new("two")
        .with_backend(second.clone())
        .acquire()
        .await
        .expect("another identity locks its own name under the root the first one made");
    // The other's lock parent stays closed to it.
    let e = Lock::new("one")
        .with_backend(second.clone())
        .acquire()
        .await
        .unwrap_err();
    assert!(is_no_auth(&e), "{e:?}");
    let c = admin(&server).await;
    for root in ["/apps", "/apps/dlock"] {
        let (_, st) = c.get_data(root).await.unwrap();
        assert_eq!(st.ephemeral_owner, 0, "{root} is not ephemeral");
        let (acl, _) = c.get_acl(root).await.unwrap();
        assert!(
            acl.iter().any(|a| a.scheme() == "world"
                && a.permission() == zk::Permission::READ | zk::Permission::CREATE),
            "{root}: {acl:?}"
        );
    }
    g1.release().await.unwrap();
    g2.release().await.unwrap();
    // Persistent, not a container: still there once every lock is gone (the container manager
    // runs every 500 ms on the test servers).
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(c.check_stat("/apps/dlock").await.unwrap().is_some());
}

/// Semaphores on ZooKeeper, across sessions (each waiter on a backend of its own, as separate
/// processes): a release of 3 permits to 6 waiters of 1 permit each grants the first three in
/// arrival order, and costs 4 watch notifications in all (the first waiter's listing watch,
/// then each grant's rewrite of its node wakes the next waiter; the fourth finds no permit and
/// watches the listing): no herd, the last two waiters hear nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_of_k_permits_wakes_k_waiters_in_arrival_order_across_sessions() {
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let holder_b = zk_backend(&server).await;
    let holder = dlock::Semaphore::new("zk-sem", 3)
        .permits(3)
        .ttl(Duration::from_secs(60))
        .with_backend(Arc::new(holder_b))
        .acquire()
        .await
        .unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut backends = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..6 {
        let b = zk_backend(&server).await;
        backends.push(b.clone());
        let (order, tx) = (order.clone(), tx.clone());
        tasks.push(tokio::spawn(async move {
            let g = dlock::Semaphore::new("zk-sem", 3)
                .ttl(Duration::from_secs(60))
                .wait(Duration::from_secs(30))
                .with_backend(Arc::new(b))
                .acquire()
                .await
                .expect("a permit");
            order.lock().unwrap().push(i);
            let _ = tx.send(g);
        }));
        // Arrival order: each waiter's node exists before the next starts.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let notified = |bs: &[dlock::ZookeeperBackend]| -> Vec<u64> {
        bs.iter().map(|b| b.watch_notifications()).collect()
    };
    let before = notified(&backends);
    holder.release().await.unwrap();
    let mut got = Vec::new();
    while got.len() < 3 {
        let g = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("three grants after the release")
            .expect("a grant");
        got.push(g);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2], "grant order");
    let after = notified(&backends);
    let per: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert_eq!(
        per,
        vec![1, 1, 1, 1, 0, 0],
        "watch notifications per waiter after the release"
    );
    // The next release of one permit lets the fourth in, and only it.
    got.pop().unwrap().release().await.unwrap();
    let g = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("the fourth waiter")
        .expect("a grant");
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3]);
    g.release().await.unwrap();
    for g in got {
        g.release().await.unwrap();
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("every waiter gets a permit")
            .unwrap();
    }
    while let Ok(g) = rx.try_recv() {
        g.release().await.unwrap();
    }
}

/// Read-write locks on ZooKeeper, across sessions: a writer queued behind a downgraded hold
/// waits for it (the downgraded node keeps its place), readers queued behind the writer wait
/// for the writer too (writer preference by arrival order), and the downgrade lets in at once
/// the reader that queued before the second writer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_downgraded_hold_keeps_its_place_before_queued_writers_and_their_readers() {
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let rw = |b: dlock::ZookeeperBackend| {
        dlock::RwLock::new("zk-rw")
            .ttl(Duration::from_secs(60))
            .wait(Duration::from_secs(30))
            .with_backend(Arc::new(b))
    };
    let w1 = rw(zk_backend(&server).await).write().await.unwrap();
    let events = Arc::new(Mutex::new(Vec::<&'static str>::new()));
    let spawn_side = |l: dlock::RwLock, what: &'static str, write: bool| {
        let events = events.clone();
        tokio::spawn(async move {
            if write {
                let g = l.write().await.expect("writer");
                events.lock().unwrap().push(what);
                tokio::time::sleep(Duration::from_millis(300)).await;
                g.release().await.unwrap();
            } else {
                let g = l.read().await.expect("reader");
                events.lock().unwrap().push(what);
                tokio::time::sleep(Duration::from_millis(300)).await;
                g.release().await.unwrap();
            }
        })
    };
    // Arrival order: r1, w2, r2 (each node exists before the next starts).
    let r1 = spawn_side(rw(zk_backend(&server).await), "r1", false);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let w2 = spawn_side(rw(zk_backend(&server).await), "w2", true);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r2 = spawn_side(rw(zk_backend(&server).await), "r2", false);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        events.lock().unwrap().is_empty(),
        "nobody beside the writer"
    );
    let r = w1.downgrade().await.unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        *events.lock().unwrap(),
        vec!["r1"],
        "the reader before w2 joins the downgraded hold; w2 and r2 wait"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        *events.lock().unwrap(),
        vec!["r1"],
        "w2 waits for the downgraded hold, r2 for w2"
    );
    r.release().await.unwrap();
    for t in [r1, w2, r2] {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("every waiter gets in")
            .unwrap();
    }
    assert_eq!(*events.lock().unwrap(), vec!["r1", "w2", "r2"]);
}
