//! Sentinel-only behaviour (feature `sentinel`): a master, one replica and three sentinels,
//! all private. Failover followed without re-init, waiters woken on the new master, tokens
//! larger; `min_replicas` with the replica stopped fails with a typed error and leaves no lock.
#![cfg(feature = "sentinel")]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::sentinel::{MASTER, SentinelSet};
use dlock::{Backend, Lock, LockError, SentinelBackend};

async fn start_set() -> SentinelSet {
    tokio::task::spawn_blocking(|| SentinelSet::start(true))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_is_followed_without_reinit_waiters_woken_tokens_larger() {
    let set = start_set().await;
    let old_port = set.master.as_ref().unwrap().port();
    let new_port = set.replica.as_ref().unwrap().port();
    let sb = SentinelBackend::connect(MASTER, set.sentinel_urls())
        .await
        .unwrap();
    assert_eq!(sb.master_addr(), format!("127.0.0.1:{old_port}"));
    let b: Arc<dyn Backend> = Arc::new(sb.clone());
    let other: Arc<dyn Backend> = Arc::new(
        SentinelBackend::connect(MASTER, set.sentinel_urls())
            .await
            .unwrap(),
    );
    let before = Lock::new("fo-token")
        .with_backend(b.clone())
        .acquire()
        .await
        .unwrap();
    let token_before = before.fencing_token();
    before.release().await.unwrap();
    // A holder with a long lease and a waiter behind it, across the failover.
    let holder = Lock::new("fo-held")
        .with_backend(b.clone())
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    // Let the grant reach the replica before it is promoted.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waiter_lock = Lock::new("fo-held")
        .with_backend(other.clone())
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(25));
    let waiter = tokio::spawn(async move {
        let g = waiter_lock.acquire().await;
        (g, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Force the failover.
    let _: String = tokio::task::block_in_place(|| {
        redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg(MASTER)
            .query(&mut set.sentinels[0].admin())
    })
    .unwrap();
    let t0 = Instant::now();
    let promoted = common::eventually(Duration::from_secs(20), || async {
        tokio::task::block_in_place(|| set.master_port_now()) == Some(new_port)
    })
    .await;
    assert!(
        promoted,
        "the sentinels did not promote the replica within 20 s"
    );
    let promoted_at = t0.elapsed();
    let followed = common::eventually(Duration::from_secs(5), || async {
        sb.master_addr() == format!("127.0.0.1:{new_port}")
    })
    .await;
    assert!(followed, "the backend did not follow the failover");
    let followed_at = t0.elapsed();
    assert!(
        followed_at < promoted_at + Duration::from_millis(1500),
        "followed {followed_at:?} after the failover command, promotion seen at {promoted_at:?}"
    );
    // Acquisitions work again within a bounded time, without re-init.
    let mut ok = None;
    while t0.elapsed() < Duration::from_secs(20) {
        match Lock::new("fo-token")
            .with_backend(b.clone())
            .acquire()
            .await
        {
            Ok(g) => {
                ok = Some(g);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let after = ok.expect("no acquisition on the new master within 20 s");
    assert!(
        after.fencing_token() > token_before,
        "token {} after the failover, {token_before} before",
        after.fencing_token()
    );
    after.release().await.unwrap();
    // The waiter is still waiting (the hold was replicated) and is woken on the new master
    // when the holder releases there.
    assert!(
        !waiter.is_finished(),
        "the waiter got a lock that is still held"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released_at = Instant::now();
    holder.release().await.expect("release on the new master");
    let (g, got_at) = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("waiter finished")
        .unwrap();
    let g = g.expect("the waiter acquires after the release");
    let lag = got_at.saturating_duration_since(released_at);
    assert!(
        lag < Duration::from_secs(2),
        "the waiter took {lag:?} after the release on the new master (a 30 s lease)"
    );
    g.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_replicas_with_the_replica_stopped_fails_typed_and_leaves_no_lock() {
    let mut set = start_set().await;
    let b: Arc<dyn Backend> = Arc::new(
        SentinelBackend::builder(MASTER, set.sentinel_urls())
            .min_replicas(1, Duration::from_millis(300))
            .connect()
            .await
            .unwrap(),
    );
    let g = Lock::new("wait-ok")
        .with_backend(b.clone())
        .acquire()
        .await
        .expect("the replica confirms");
    g.release().await.unwrap();
    tokio::task::block_in_place(|| set.replica.as_mut().unwrap().pause());
    let t = Instant::now();
    let r = Lock::new("wait-fail")
        .with_backend(b.clone())
        .acquire()
        .await;
    let took = t.elapsed();
    tokio::task::block_in_place(|| set.replica.as_mut().unwrap().resume());
    assert!(matches!(r, Err(LockError::Backend { .. })), "{r:?}");
    assert!(took < Duration::from_secs(3), "took {took:?}");
    let mut con = set.master.as_ref().unwrap().admin_async().await;
    let n: i64 = redis::cmd("EXISTS")
        .arg(dlock::backend::redis_keys("wait-fail").lock)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(n, 0, "the unconfirmed grant was left on the master");
}

/// The same for semaphores: with `min_replicas(1, ..)` a permit grant is confirmed by the
/// replica; with the replica stopped it fails with a typed error and leaves no permit on the
/// master. (Before, semaphores answered `Unsupported` with `min_replicas`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_replicas_semaphore_grants_wait_for_the_replica_and_leave_nothing_unconfirmed() {
    let mut set = start_set().await;
    let b: Arc<dyn Backend> = Arc::new(
        SentinelBackend::builder(MASTER, set.sentinel_urls())
            .min_replicas(1, Duration::from_millis(300))
            .connect()
            .await
            .unwrap(),
    );
    let g = dlock::Semaphore::new("sem-wait-ok", 2)
        .with_backend(b.clone())
        .acquire()
        .await
        .expect("the replica confirms");
    g.release().await.unwrap();
    tokio::task::block_in_place(|| set.replica.as_mut().unwrap().pause());
    let t = Instant::now();
    let r = dlock::Semaphore::new("sem-wait-fail", 2)
        .with_backend(b.clone())
        .acquire()
        .await;
    let took = t.elapsed();
    tokio::task::block_in_place(|| set.replica.as_mut().unwrap().resume());
    assert!(matches!(r, Err(LockError::Backend { .. })), "{r:?}");
    assert!(took < Duration::from_secs(3), "took {took:?}");
    let mut con = set.master.as_ref().unwrap().admin_async().await;
    // The semaphore's leases zset (`dlock:sem:{E}:z`) holds no owner.
    let leases = format!(
        "dlock:sem:{}:z",
        &dlock::backend::redis_keys("sem-wait-fail").lock["dlock:".len()..]
    );
    let n: i64 = redis::cmd("ZCARD")
        .arg(&leases)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(n, 0, "the unconfirmed permit grant was left on the master");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_sentinel_registers_and_bad_input_is_typed() {
    let set = tokio::task::spawn_blocking(|| SentinelSet::start(false))
        .await
        .unwrap();
    dlock::init_sentinel("sentinel-test", MASTER, set.sentinel_urls())
        .await
        .unwrap();
    let g = Lock::new("reg")
        .backend("sentinel-test")
        .acquire()
        .await
        .unwrap();
    g.release().await.unwrap();
    let r = dlock::init_sentinel("sentinel-bad", "no-such-master", set.sentinel_urls()).await;
    assert!(matches!(r, Err(LockError::Backend { .. })), "{r:?}");
    let r = dlock::init_sentinel("sentinel-bad", MASTER, ["not a url"]).await;
    assert!(matches!(r, Err(LockError::Config(_))), "{r:?}");
}

/// The operator's view through the sentinels: the admin finds the master they name and shows
/// and force-releases the lock there; an unknown master name is a typed connection error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_finds_the_master_through_the_sentinels() {
    use dlock::admin::{Admin, AdminErrorKind, ForceReleased, SentinelAdmin};
    let set = tokio::task::spawn_blocking(|| SentinelSet::start(false))
        .await
        .unwrap();
    let b = Arc::new(
        SentinelBackend::connect(MASTER, set.sentinel_urls())
            .await
            .unwrap(),
    );
    let g = Lock::new("adm:sentinel")
        .with_backend(b.clone())
        .ttl(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap();
    let admin = SentinelAdmin::connect(MASTER, set.sentinel_urls(), None, 0)
        .await
        .expect("admin through the sentinels");
    let port = set.master_port_now().expect("the sentinels name a master");
    assert!(
        admin.target().contains(&format!(":{port}")),
        "{}",
        admin.target()
    );
    let info = admin.show("adm:sentinel").await.unwrap().expect("held");
    assert_eq!(info.token, Some(g.fencing_token()));
    let r = admin
        .force_release("adm:sentinel", Some(&info))
        .await
        .unwrap();
    assert!(matches!(r, ForceReleased::Released { .. }), "{r:?}");
    tokio::time::timeout(Duration::from_secs(10), g.lost())
        .await
        .expect("the evicted holder hears it");

    let e = SentinelAdmin::connect("no-such-master", set.sentinel_urls(), None, 0)
        .await
        .expect_err("unknown master");
    assert_eq!(e.kind, AdminErrorKind::Connect);
    assert!(e.message.contains("no-such-master"), "{e}");
}

/// Issue 21: through the sentinels, the admin shows a semaphore's holders and evicts one (the
/// other keeps its permits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_shows_and_evicts_semaphore_holders_on_the_master() {
    use dlock::admin::{Admin, ForceReleased, LockKind, SentinelAdmin};
    let set = tokio::task::spawn_blocking(|| SentinelSet::start(false))
        .await
        .unwrap();
    let b: Arc<dyn dlock::Backend> = Arc::new(
        SentinelBackend::connect(MASTER, set.sentinel_urls())
            .await
            .unwrap(),
    );
    let sem = || {
        dlock::Semaphore::new("adm:sem", 2)
            .with_backend(b.clone())
            .ttl(Duration::from_secs(20))
    };
    let g1 = sem().acquire().await.unwrap();
    let g2 = sem().acquire().await.unwrap();
    let admin = SentinelAdmin::connect(MASTER, set.sentinel_urls(), None, 0)
        .await
        .expect("admin through the sentinels");
    let info = admin
        .show_kind("adm:sem", LockKind::Semaphore)
        .await
        .unwrap()
        .expect("held");
    assert_eq!(info.semaphore.unwrap().used, 2);
    assert_eq!(info.holders.len(), 2);
    let r = admin
        .evict("adm:sem", LockKind::Semaphore, g1.owner(), Some(&info))
        .await
        .unwrap();
    assert!(matches!(r, ForceReleased::Released { .. }), "{r:?}");
    tokio::time::timeout(Duration::from_secs(15), g1.lost())
        .await
        .expect("the evicted holder hears it");
    let info = admin
        .show_kind("adm:sem", LockKind::Semaphore)
        .await
        .unwrap()
        .expect("still held");
    assert_eq!(info.holders.len(), 1);
    assert_eq!(info.holders[0].owner, g2.owner());
    g2.release().await.unwrap();
}

/// Review finding #11: `WAIT` must run on the connection that wrote the grant. Here the data
/// connection is replaced between a grant and its WAIT (another call, blocked behind a WAIT of
/// its own, times out meanwhile); a WAIT sent afresh on the new connection answers for that
/// connection's writes only, not the grant's. (Before the fix this scenario happened to stay
/// safe: the other call's give-back, an EVALSHA on the new connection, set that connection's
/// replication offset, and Redis 7.0 then blocked its WAIT. A WAIT on a connection that ran
/// nothing answers at once with every connected replica.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_replicas_waits_on_the_connection_that_wrote_the_grant() {
    let mut set = start_set().await;
    let b: Arc<dyn Backend> = Arc::new(
        SentinelBackend::builder(MASTER, set.sentinel_urls())
            .min_replicas(1, Duration::from_millis(1500))
            .map_master(|m| m.response_timeout(Duration::from_secs(1)))
            .connect()
            .await
            .unwrap(),
    );
    let g = Lock::new("wait-warm")
        .with_backend(b.clone())
        .acquire()
        .await
        .expect("the replica confirms");
    g.release().await.unwrap();
    tokio::task::block_in_place(|| set.replica.as_mut().unwrap().pause());
    // Y: its WAIT blocks the shared connection for 1.5 s; Y times out at 1 s and the data
    // connection is replaced.
    let by = b.clone();
    let y = tokio::spawn(async move { Lock::new("wait-y").with_backend(by).acquire().await });
    // Y's grant is deleted behind its back, so that Y's give-back after its timeout (sent on
    // the new connection) writes nothing there: that connection stays one that wrote nothing.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut admin = set.master.as_ref().unwrap().admin_async().await;
    let deleted: i64 = redis::cmd("DEL")
        .arg(dlock::backend::redis_keys("wait-y").lock)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(deleted, 1, "Y was not granted");
    tokio::time::sleep(Duration::from_millis(300)).await;
    // X: sent on the old connection behind Y's WAIT, granted when it ends (at 1.5 s, before X's
    // own 1 s timeout), after the replacement.
    let x = Lock::new("wait-x").with_backend(b.clone()).acquire().await;
    let y = y.await.unwrap();
    tokio::task::block_in_place(|| set.replica.as_mut().unwrap().resume());
    assert!(y.is_err(), "Y confirmed with the replica stopped: {y:?}");
    assert!(
        x.is_err(),
        "X's grant was reported replicated while the only replica was stopped: {x:?}"
    );
}

/// `CLIENT KILL TYPE <kind>` on the server at `port` (every client of that kind but this one).
fn kill_clients(url: &str, kind: &str) {
    let mut con = redis::Client::open(url)
        .unwrap()
        .get_connection_with_timeout(Duration::from_secs(2))
        .unwrap();
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg(kind)
        .query(&mut con)
        .unwrap();
}

/// Review finding #5 (issue 18): a sentinel that missed a failover still names the old master.
/// S1 (the backend's first sentinel) is paused through a failover, with every link by which it
/// would hear of it cut (its hello subscriptions on both servers; the other sentinels forget it
/// by `SENTINEL RESET`); then it is resumed while the two others are paused, so that it alone
/// answers, and calls on the backend are made to fail (`CLIENT KILL` of its connections on the
/// new master), which makes it ask the sentinels again. The backend must stay on the new master
/// (S1 names the old one under an older `config-epoch`), and no script may run on the old
/// master. Before the fix the backend moved back to the old master at the first failed call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_sentinel_does_not_move_the_backend_back_to_the_old_master() {
    let set = start_set().await;
    let old = set.master.as_ref().unwrap();
    let new = set.replica.as_ref().unwrap();
    let (old_port, new_port) = (old.port(), new.port());
    let sb = SentinelBackend::connect(MASTER, set.sentinel_urls())
        .await
        .unwrap();
    assert_eq!(sb.master_addr(), format!("127.0.0.1:{old_port}"));
    let b: Arc<dyn Backend> = Arc::new(sb.clone());
    let (s1, s2, s3) = (&set.sentinels[0], &set.sentinels[1], &set.sentinels[2]);
    tokio::task::block_in_place(|| {
        s1.pause();
        kill_clients(&old.url(), "pubsub");
        kill_clients(&new.url(), "pubsub");
        for s in [s2, s3] {
            let _: i64 = redis::cmd("SENTINEL")
                .arg("RESET")
                .arg(MASTER)
                .query(&mut s.admin())
                .unwrap();
        }
        // S2 forced the failover as soon as it knows the replica again (INFO every 10 s).
        let started = Instant::now();
        loop {
            let r: redis::RedisResult<String> = redis::cmd("SENTINEL")
                .arg("FAILOVER")
                .arg(MASTER)
                .query(&mut s2.admin());
            if r.is_ok() {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(40),
                "SENTINEL FAILOVER was refused for 40 s: {r:?}"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    });
    let followed = common::eventually(Duration::from_secs(30), || async {
        tokio::task::block_in_place(|| s2.names()).is_some_and(|(_, p)| p == new_port)
            && sb.master_addr() == format!("127.0.0.1:{new_port}")
    })
    .await;
    assert!(followed, "the failover was not made or not followed");
    // S1 alone answers now, and it missed the failover.
    tokio::task::block_in_place(|| {
        s2.pause();
        s3.pause();
        s1.resume();
    });
    let evalsha_on_old = || {
        old.commandstats()
            .get("evalsha")
            .copied()
            .unwrap_or_default()
    };
    let scripts_before = tokio::task::block_in_place(evalsha_on_old);
    let mut failed_calls = 0;
    let mut moved_to = None;
    for round in 0..3 {
        tokio::task::block_in_place(|| kill_clients(&new.url(), "normal"));
        let r = Lock::new("stale:probe")
            .with_backend(b.clone())
            .ttl(Duration::from_secs(5))
            .acquire()
            .await;
        match r {
            Ok(g) => {
                let _ = g.release().await;
            }
            Err(_) => failed_calls += 1,
        }
        if sb.master_addr() != format!("127.0.0.1:{new_port}") {
            moved_to = Some((round, sb.master_addr()));
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // The fault held: S1 still names the old master (so it did answer stale).
    let s1_names = tokio::task::block_in_place(|| s1.names());
    let scripts_after = tokio::task::block_in_place(evalsha_on_old);
    tokio::task::block_in_place(|| {
        s2.resume();
        s3.resume();
    });
    assert_eq!(
        s1_names.map(|(_, p)| p),
        Some(old_port),
        "the fault did not hold: the resumed sentinel learned of the failover"
    );
    assert!(
        failed_calls > 0 || moved_to.is_some(),
        "no call failed, so the backend never asked the sentinels again"
    );
    assert_eq!(
        moved_to, None,
        "a stale sentinel moved the backend back (the new master is on port {new_port})"
    );
    assert_eq!(
        scripts_after, scripts_before,
        "scripts ran on the old master after the failover"
    );
}

/// Review finding #7 (issue 19): after a switch of master, waiters are woken (they retry on the
/// new master) before their name is subscribed there; a release in between reached nobody and
/// the waiter slept until the holder's lease end. Here the waiter's subscription on the new
/// master is held back 1 s by a proxy in front of it (the replica announces the proxy's
/// port), the holder releases 300 ms after the switch, and the waiter must get the lock well
/// before its 10 s ttl: it is woken again once subscribed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_before_the_waiter_is_subscribed_on_the_new_master_is_not_slept_through() {
    let front = common::sentinel::SubscribeDelay::start();
    let front_port = front.port();
    let set = tokio::task::spawn_blocking(move || {
        let set = SentinelSet::start_with_replica_behind(&front);
        (set, front)
    })
    .await
    .unwrap();
    let (set, front) = set;
    let new_addr = format!("127.0.0.1:{front_port}");
    let a = SentinelBackend::connect(MASTER, set.sentinel_urls())
        .await
        .unwrap();
    let w = SentinelBackend::connect(MASTER, set.sentinel_urls())
        .await
        .unwrap();
    let (ab, wb): (Arc<dyn Backend>, Arc<dyn Backend>) = (Arc::new(a.clone()), Arc::new(w.clone()));
    let holder = Lock::new("resub")
        .with_backend(ab)
        .ttl(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    // Let the grant reach the replica before it is promoted.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waiter = tokio::spawn(async move {
        let g = Lock::new("resub")
            .with_backend(wb)
            .ttl(Duration::from_secs(10))
            .wait(Duration::from_secs(9))
            .acquire()
            .await;
        (g, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    front.delay_subscribe(Duration::from_secs(1));
    let _: String = tokio::task::block_in_place(|| {
        redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg(MASTER)
            .query(&mut set.sentinels[0].admin())
    })
    .unwrap();
    let followed = common::eventually(Duration::from_secs(20), || async {
        a.master_addr() == new_addr && w.master_addr() == new_addr
    })
    .await;
    assert!(followed, "the backends did not follow the failover");
    // The waiter, woken by the switch, has retried on the new master (busy: the hold was
    // replicated); its subscription there is still held back.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "the waiter got a lock still held");
    holder.release().await.expect("release on the new master");
    let released = Instant::now();
    let (g, got) = tokio::time::timeout(Duration::from_secs(12), waiter)
        .await
        .expect("the waiter returns")
        .unwrap();
    let g = g.expect("the waiter gets the lock");
    let lag = got.saturating_duration_since(released);
    assert!(
        lag < Duration::from_secs(2),
        "the waiter got the lock {lag:?} after the release (ttl 10 s): it slept through it"
    );
    g.release().await.unwrap();
    drop(front);
}

/// Issue 19, item 3: 1,000 waits of 200 ms that time out (each on its own name, held by another
/// owner, 100 at a time) leave no subscription on the master, no task and no waiter behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_timed_out_waits_leave_no_subscription_task_or_waiter() {
    let set = tokio::task::spawn_blocking(|| SentinelSet::start(false))
        .await
        .unwrap();
    let master = set.master.as_ref().unwrap().url();
    let sb = SentinelBackend::connect(MASTER, set.sentinel_urls())
        .await
        .unwrap();
    let b: Arc<dyn Backend> = Arc::new(sb.clone());
    let names: Vec<String> = (0..1000).map(|i| format!("leak:{i}")).collect();
    let held = futures_util::future::join_all(
        names
            .iter()
            .map(|n| b.try_acquire(n, "holder", Duration::from_secs(60))),
    )
    .await;
    assert!(
        held.iter()
            .all(|r| matches!(r, Ok(dlock::backend::Acquired::Granted { .. })))
    );
    let waits = |names: &[String]| {
        let b = b.clone();
        let names = names.to_vec();
        async move {
            let rs = futures_util::future::join_all(names.iter().map(|n| {
                let (b, n) = (b.clone(), n.clone());
                async move {
                    Lock::new(n.as_str())
                        .with_backend(b)
                        .wait(Duration::from_millis(200))
                        .acquire()
                        .await
                }
            }))
            .await;
            // On a loaded machine a first try may get no reply within the wait (a backend
            // error, also a wait that timed out); most must have queued and timed out.
            let mut queued = 0;
            for r in &rs {
                match r {
                    Err(LockError::TimedOut { .. }) => queued += 1,
                    Err(LockError::Backend { .. }) => {}
                    other => panic!("{other:?}"),
                }
            }
            assert!(
                queued * 10 >= rs.len() * 9,
                "{queued} of {} queued",
                rs.len()
            );
        }
    };
    let channels = || -> usize {
        let v: Vec<String> = redis::cmd("PUBSUB")
            .arg("CHANNELS")
            .arg("dlock:*")
            .query(
                &mut redis::Client::open(master.as_str())
                    .unwrap()
                    .get_connection()
                    .unwrap(),
            )
            .unwrap();
        v.len()
    };
    let tasks = || {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    };
    // Warm up (the runtime's connections and their tasks), then count.
    waits(&names[..10]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (tasks_before, channels_before) = (tasks(), tokio::task::block_in_place(channels));
    let started = Instant::now();
    for chunk in names.chunks(100) {
        waits(chunk).await;
    }
    let took = started.elapsed();
    let settled = common::eventually(Duration::from_secs(5), || async {
        tasks() <= tasks_before
            && tokio::task::block_in_place(channels) <= channels_before
            && sb.waiter_count() == 0
    })
    .await;
    assert!(
        settled,
        "after 1,000 timed-out waits ({took:?}): {} tasks (before: {tasks_before}), {} channels \
         subscribed (before: {channels_before}), {} waiters",
        tasks(),
        tokio::task::block_in_place(channels),
        sb.waiter_count()
    );
    eprintln!(
        "1,000 timed-out waits in {took:?}; tasks {tasks_before} -> {}, channels {channels_before} -> {}",
        tasks(),
        tokio::task::block_in_place(channels)
    );
}

/// Review finding #5, the `ROLE` check: the sentinels name a node that says it is a replica
/// (turned into one by hand, behind their back); the backend refuses it with a typed error
/// instead of sending its calls there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_master_that_says_it_is_a_replica_is_not_used() {
    let (set, other) =
        tokio::task::spawn_blocking(|| (SentinelSet::start(false), common::RedisProc::start()))
            .await
            .unwrap();
    let master = set.master.as_ref().unwrap();
    let replicaof = |host: &str, port: &str| {
        let _: String = redis::cmd("REPLICAOF")
            .arg(host)
            .arg(port)
            .query(&mut master.admin())
            .unwrap();
    };
    tokio::task::block_in_place(|| replicaof("127.0.0.1", &other.port().to_string()));
    let r = SentinelBackend::connect(MASTER, set.sentinel_urls()).await;
    tokio::task::block_in_place(|| replicaof("NO", "ONE"));
    match r {
        Err(LockError::Backend { source, .. }) => {
            assert!(source.to_string().contains("replica"), "{source}")
        }
        other => panic!("expected a backend error naming the replica, got {other:?}"),
    }
}
