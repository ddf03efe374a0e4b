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
        .arg(dlock::redis_keys("wait-fail").lock)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(n, 0, "the unconfirmed grant was left on the master");
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
        .arg(dlock::redis_keys("wait-y").lock)
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
