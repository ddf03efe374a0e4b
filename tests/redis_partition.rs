//! Network partitions between client and Redis (RELIABILITY.md §7 D3, issue 7 deliverable 2):
//! the client talks to a private redis-server through a loopback proxy (`common::proxy`) that is
//! switched to delay, blackhole or reset while the test runs.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::RedisProc;
use common::proxy::{Mode, Proxy};
use dlock::{Backend, Lock, LockError, LostReason, RedisBackend, distributed_lock};

struct Net {
    server: RedisProc,
    proxy: Proxy,
    /// Through the proxy.
    via_proxy: Arc<dyn Backend>,
    /// Straight to the server.
    direct: Arc<dyn Backend>,
}

async fn net() -> Net {
    common::debug_events_in_test_output();
    let server = tokio::task::spawn_blocking(RedisProc::start)
        .await
        .expect("start redis-server");
    let proxy = Proxy::start(server.port());
    let via_proxy: Arc<dyn Backend> = Arc::new(
        RedisBackend::builder(proxy.url())
            .response_timeout(Duration::from_millis(500))
            .connection_timeout(Duration::from_millis(500))
            .connect()
            .await
            .expect("connect through the proxy"),
    );
    let direct: Arc<dyn Backend> = Arc::new(
        RedisBackend::connect(&server.url())
            .await
            .expect("connect directly"),
    );
    Net {
        server,
        proxy,
        via_proxy,
        direct,
    }
}

/// The proxy itself: pass forwards, blackhole drops without closing, reset refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_modes_pass_blackhole_reset() {
    let n = net().await;
    let g = Lock::new("p0")
        .with_backend(n.via_proxy.clone())
        .acquire()
        .await
        .expect("acquire through a passing proxy");
    g.release().await.unwrap();
    n.proxy.set_mode(Mode::Blackhole);
    let t = Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        Lock::new("p0").with_backend(n.via_proxy.clone()).acquire(),
    )
    .await
    .expect("an acquire through a blackhole is bounded");
    assert!(r.is_err(), "acquired through a blackhole");
    assert!(
        t.elapsed() >= Duration::from_millis(400),
        "{:?}",
        t.elapsed()
    );
    n.proxy.set_mode(Mode::Reset);
    let c = tokio::net::TcpStream::connect(("127.0.0.1", n.proxy.port())).await;
    if let Ok(mut c) = c {
        use tokio::io::AsyncReadExt;
        let mut b = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(2), c.read(&mut b))
            .await
            .expect("a reset proxy closes new connections");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    }
    drop(n.server);
}

/// D3: the holder's connection is blackholed: `lost()` fires by its own deadline, not later,
/// and a contender on a healthy connection gets the lock only after that deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackholed_holder_is_lost_by_its_own_deadline() {
    let n = net().await;
    let ttl = Duration::from_millis(900);
    let a = Lock::new("bh")
        .with_backend(n.via_proxy.clone())
        .ttl(ttl)
        .acquire()
        .await
        .unwrap();
    let deadline = Instant::now() + a.remaining();
    let lost = a.lost();
    n.proxy.set_mode(Mode::Blackhole);
    let reason = tokio::time::timeout(ttl + Duration::from_millis(500), lost)
        .await
        .expect("lost() did not fire by the holder's deadline while blackholed");
    let lost_at = Instant::now();
    assert_eq!(reason, LostReason::Deadline);
    assert!(
        lost_at <= deadline + Duration::from_millis(200),
        "lost {:?} after the deadline",
        lost_at - deadline
    );
    assert!(!a.is_valid());
    let b = Lock::new("bh")
        .with_backend(n.direct.clone())
        .ttl(Duration::from_secs(5))
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .expect("B acquires once A's lease ran out");
    assert!(
        Instant::now() >= deadline,
        "B was granted before A's deadline"
    );
    assert!(b.fencing_token() > a.fencing_token());
    n.proxy.set_mode(Mode::Pass);
    let e = tokio::time::timeout(Duration::from_secs(5), a.release())
        .await
        .expect("release of a lost guard is bounded")
        .unwrap_err();
    assert!(
        e.is_lost() || matches!(e, LockError::NotOwner { .. }) || e.is_backend(),
        "{e:?}"
    );
    b.release().await.unwrap();
}

static BODY_TICKS: AtomicU64 = AtomicU64::new(0);

#[distributed_lock(key = "bh-body", ttl = "900ms", backend = "partition_body")]
async fn ticking_body() -> Result<(), LockError> {
    for _ in 0..100 {
        BODY_TICKS.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// D3 with the annotated function: after the blackhole the body stops running soon after the
/// holder's deadline (cancelled at its next await) and the function returns `Lost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackholed_annotated_body_is_cancelled_and_returns_lost() {
    let n = net().await;
    dlock::register_arc("partition_body", n.via_proxy.clone());
    let started = Instant::now();
    let call = tokio::spawn(ticking_body());
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(BODY_TICKS.load(Ordering::SeqCst) > 0, "the body is running");
    n.proxy.set_mode(Mode::Blackhole);
    // The lease is at most 900 ms from the grant (granted after `started`).
    tokio::time::sleep(Duration::from_millis(900 + 300)).await;
    let at_cancel = BODY_TICKS.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        BODY_TICKS.load(Ordering::SeqCst),
        at_cancel,
        "the body still runs after its holder's deadline"
    );
    let r = tokio::time::timeout(Duration::from_secs(8), call)
        .await
        .expect("the annotated function returns (bounded) after its lease is lost")
        .unwrap();
    assert!(matches!(r, Err(ref e) if e.is_lost()), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(9));
    n.proxy.set_mode(Mode::Pass);
}

/// Issue 7 deliverable 1 seen through a partition: the annotated function returns `Lost` within
/// a small bound of the holder's own deadline even though its release cannot reach the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackholed_annotated_function_returns_by_deadline_plus_small_bound() {
    let n = net().await;
    let slow: Arc<dyn Backend> = Arc::new(
        RedisBackend::builder(n.proxy.url())
            .response_timeout(Duration::from_secs(3))
            .connect()
            .await
            .unwrap(),
    );
    dlock::register_arc("partition_prompt", slow);
    #[distributed_lock(key = "bh-prompt", ttl = "600ms", backend = "partition_prompt")]
    async fn body() -> Result<(), LockError> {
        tokio::time::sleep(Duration::from_secs(10)).await;
        Ok(())
    }
    let started = Instant::now();
    let call = tokio::spawn(body());
    tokio::time::sleep(Duration::from_millis(150)).await;
    n.proxy.set_mode(Mode::Blackhole);
    let r = call.await.unwrap();
    let took = started.elapsed();
    assert!(matches!(r, Err(ref e) if e.is_lost()), "{r:?}");
    assert!(
        took <= Duration::from_millis(600 + 100 + 150),
        "returned {took:?} after the call (deadline ≤ 600 ms after it)"
    );
}

/// D3: a waiter whose connection is blackholed while it waits returns by its `wait` deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackholed_waiter_honours_its_wait() {
    let n = net().await;
    let holder = Lock::new("bhw")
        .with_backend(n.direct.clone())
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let wait = Duration::from_millis(1500);
    let via = n.via_proxy.clone();
    let started = Instant::now();
    let waiter = tokio::spawn(async move {
        let r = Lock::new("bhw")
            .with_backend(via)
            .ttl(Duration::from_secs(5))
            .wait(wait)
            .acquire()
            .await;
        (Instant::now(), r)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    n.proxy.set_mode(Mode::Blackhole);
    let (done, r) = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("a blackholed waiter returns")
        .unwrap();
    let took = done - started;
    assert!(r.is_err(), "the waiter got a held lock");
    let e = r.unwrap_err();
    assert!(e.is_contended() || e.is_backend(), "{e:?}");
    assert!(
        took <= wait + Duration::from_millis(500),
        "waited {took:?} for a wait of {wait:?}"
    );
    n.proxy.set_mode(Mode::Pass);
    holder.release().await.unwrap();
}

/// A grant whose reply arrives after its lease ran out is not handed out as a guard born lost,
/// and no ghost keeps the key: once the call returns, another client acquires within the
/// unconfirmed grant's own lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_grant_is_given_back_not_born_lost() {
    let server = tokio::task::spawn_blocking(RedisProc::start).await.unwrap();
    let proxy = Proxy::start(server.port());
    let via: Arc<dyn Backend> = Arc::new(
        RedisBackend::builder(proxy.url())
            .response_timeout(Duration::from_secs(3))
            .connect()
            .await
            .unwrap(),
    );
    let direct: Arc<dyn Backend> = Arc::new(RedisBackend::connect(&server.url()).await.unwrap());
    let ttl = Duration::from_millis(400);
    proxy.set_mode(Mode::Delay(ttl + Duration::from_millis(300)));
    for i in 0..3 {
        let r = Lock::new("late")
            .with_backend(via.clone())
            .ttl(ttl)
            .acquire()
            .await;
        if let Ok(g) = r {
            panic!(
                "round {i}: a late grant was handed out (valid={}, remaining={:?})",
                g.is_valid(),
                g.remaining()
            );
        }
        // The try gives up at its ttl, about when the unconfirmed grant's lease ends on the
        // server: allow that lease (not more) to run out.
        let b = Lock::new("late")
            .with_backend(direct.clone())
            .ttl(Duration::from_secs(5))
            .wait(ttl)
            .acquire()
            .await
            .expect("a ghost holds the key after the late grant");
        b.release().await.unwrap();
    }
    proxy.set_mode(Mode::Pass);
    let g = Lock::new("late")
        .with_backend(via.clone())
        .ttl(Duration::from_secs(5))
        .acquire()
        .await
        .expect("acquire after the delay ends");
    assert!(g.is_valid());
    g.release().await.unwrap();
}

/// An acquire whose reply was lost after the server granted it leaves no ghost once the network
/// heals: its give-back, which cannot reach the server during the partition, is retried, so the
/// name is free right after the heal instead of for the whole 30 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_outcome_grant_is_given_back_after_the_heal() {
    let n = net().await;
    // Connect the data connection through the proxy first.
    Lock::new("ghost")
        .with_backend(n.via_proxy.clone())
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    n.proxy.set_mode(Mode::DropReplies);
    let via = n.via_proxy.clone();
    let attempt = tokio::spawn(async move {
        Lock::new("ghost")
            .with_backend(via)
            .ttl(Duration::from_secs(30))
            .acquire()
            .await
    });
    // The request reaches the server (a grant), its reply is dropped. Watched with a plain
    // EXISTS, so that no probe of ours competes for the name.
    let mut raw = redis::Client::open(n.server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let lock_key = dlock::backend::redis_keys("ghost").lock;
    let granted = Instant::now();
    loop {
        let held: bool = redis::cmd("EXISTS")
            .arg(&lock_key)
            .query_async(&mut raw)
            .await
            .unwrap();
        if held {
            break;
        }
        assert!(
            granted.elapsed() < Duration::from_secs(5),
            "the try never reached the server"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Now nothing gets through: the give-back after the try's error is lost too.
    n.proxy.set_mode(Mode::Blackhole);
    let r = tokio::time::timeout(Duration::from_secs(5), attempt)
        .await
        .expect("the try is bounded")
        .unwrap();
    assert!(r.is_err(), "a grant without a reply was handed out");
    // Longer than the client's own reconnect attempts (3 × the 500 ms connection timeout).
    tokio::time::sleep(Duration::from_secs(3)).await;
    n.proxy.set_mode(Mode::Pass);
    let healed = Instant::now();
    let g = Lock::new("ghost")
        .with_backend(n.direct.clone())
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("the ghost grant was given back after the heal");
    assert!(
        healed.elapsed() < Duration::from_secs(5),
        "the name was free only {:?} after the heal (the ghost's lease is 30 s)",
        healed.elapsed()
    );
    g.release().await.unwrap();
}

/// After a blackhole and after a reset heal, the same backend acquires again and a waiter is
/// woken by the release's pub/sub message, long before the holder's lease would end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_partition_heals_the_same_backend_works_and_waits_wake_by_pubsub() {
    let n = net().await;
    // Warm up both connections (data and pub/sub) through the proxy.
    let h = Lock::new("heal")
        .with_backend(n.direct.clone())
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let r = Lock::new("heal")
        .with_backend(n.via_proxy.clone())
        .wait(Duration::from_millis(300))
        .acquire()
        .await;
    assert!(r.is_err());
    h.release().await.unwrap();
    for fault in [Mode::Blackhole, Mode::Reset] {
        n.proxy.set_mode(fault);
        let _ = tokio::time::timeout(
            Duration::from_secs(3),
            Lock::new("heal")
                .with_backend(n.via_proxy.clone())
                .acquire(),
        )
        .await
        .expect("calls during the partition are bounded");
        tokio::time::sleep(Duration::from_millis(600)).await;
        n.proxy.set_mode(Mode::Pass);

        let healed = Instant::now();
        let g = loop {
            match Lock::new("heal")
                .with_backend(n.via_proxy.clone())
                .acquire()
                .await
            {
                Ok(g) => break g,
                Err(e) if healed.elapsed() < Duration::from_secs(5) => {
                    assert!(e.is_backend() || e.is_contended(), "{e:?}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("no recovery 5 s after healing {fault:?}: {e}"),
            }
        };
        g.release().await.unwrap();

        let holder = Lock::new("heal")
            .with_backend(n.direct.clone())
            .ttl(Duration::from_secs(30))
            .acquire()
            .await
            .unwrap();
        let via = n.via_proxy.clone();
        let waiter = tokio::spawn(async move {
            let r = Lock::new("heal")
                .with_backend(via)
                .wait(Duration::from_secs(10))
                .acquire()
                .await;
            (Instant::now(), r)
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        let released = Instant::now();
        holder.release().await.unwrap();
        let (at, r) = waiter.await.unwrap();
        let g = r.unwrap_or_else(|e| panic!("waiter after healing {fault:?}: {e}"));
        assert!(
            at - released < Duration::from_secs(2),
            "after healing {fault:?} the waiter woke {:?} after the release (not by pub/sub)",
            at - released
        );
        g.release().await.unwrap();
    }
    drop(n.server);
}

/// A partition that heals while the old TCP sessions stay silently dead (no close reaches the
/// client: NAT state lost, a peer gone without a reset). The data connection is replaced after
/// a response timeout and the pub/sub connection after a failed `PING`: after the heal the same
/// backend acquires again within a bounded time, and a waiter that waited through it all is
/// woken by the release's pub/sub message, without re-initialising.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_silent_connection_death_both_connections_recover() {
    let n = net().await;
    // A waiter through the proxy, subscribed, behind a holder on the direct connection.
    let holder = Lock::new("dead-wait")
        .with_backend(n.direct.clone())
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let via = n.via_proxy.clone();
    let waiter = tokio::spawn(async move {
        let r = Lock::new("dead-wait")
            .with_backend(via)
            .ttl(Duration::from_secs(5))
            .wait(Duration::from_secs(20))
            .acquire()
            .await;
        (Instant::now(), r)
    });
    let g = Lock::new("dead-data")
        .with_backend(n.via_proxy.clone())
        .acquire()
        .await
        .expect("acquire through the proxy");
    g.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;

    n.proxy.set_mode(Mode::Blackhole);
    // A data call during the partition, so that the data connection drops bytes.
    let r = tokio::time::timeout(
        Duration::from_secs(3),
        Lock::new("dead-data")
            .with_backend(n.via_proxy.clone())
            .acquire(),
    )
    .await
    .expect("a call during the partition is bounded");
    assert!(r.is_err(), "acquired through a blackhole");
    // Long enough for the pub/sub check to send its PING into the hole.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    n.proxy.heal_leaving_dead();

    let healed = Instant::now();
    let g = loop {
        match Lock::new("dead-data")
            .with_backend(n.via_proxy.clone())
            .acquire()
            .await
        {
            Ok(g) => break g,
            Err(e) if healed.elapsed() < Duration::from_secs(10) => {
                assert!(e.is_backend() || e.is_contended(), "{e:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("no recovery 10 s after the heal: {e}"),
        }
    };
    let recovered = healed.elapsed();
    g.release().await.unwrap();
    assert!(
        recovered < Duration::from_secs(3),
        "the data connection took {recovered:?} to recover (response timeout 500 ms)"
    );

    // Give the subscriber its check period and a reconnect, then release.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(!waiter.is_finished(), "the waiter got a held lock");
    let released = Instant::now();
    holder.release().await.unwrap();
    let (at, r) = tokio::time::timeout(Duration::from_secs(25), waiter)
        .await
        .expect("the waiter returns")
        .unwrap();
    let g = r.expect("the waiter gets the lock after the release");
    assert!(
        at.saturating_duration_since(released) < Duration::from_secs(2),
        "woken {:?} after the release: not by pub/sub (the holder's lease was 30 s)",
        at.saturating_duration_since(released)
    );
    g.release().await.unwrap();
}

/// Review finding #4: an acquire sent into a partition whose bytes are delivered late, after the
/// heal (TCP retransmission), must not leave an orphan for its whole ttl. Its give-back is sent
/// on the try's own connection, behind it, so it runs after the late try and frees the name;
/// a give-back on a fresh connection would overtake the try (answering `NotOwner`), and the
/// late grant would then hold the name for 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_give_back_never_overtakes_its_try_delivered_late_after_a_heal() {
    let n = net().await;
    // Connect the data connection through the proxy first.
    Lock::new("late-try")
        .with_backend(n.via_proxy.clone())
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let fence = dlock::backend::redis_keys("late-try").fence;
    let mut raw = redis::Client::open(n.server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("DEL")
        .arg(&fence)
        .query_async(&mut raw)
        .await
        .unwrap();
    n.proxy.set_mode(Mode::Hold);
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        Lock::new("late-try")
            .with_backend(n.via_proxy.clone())
            .ttl(Duration::from_secs(30))
            .acquire(),
    )
    .await
    .expect("the try is bounded by the response timeout");
    assert!(r.is_err(), "acquired through a partition: {r:?}");
    // The give-back is retried during the partition; new connections are refused meanwhile.
    tokio::time::sleep(Duration::from_secs(1)).await;
    n.proxy
        .heal_delivering_held_after(Duration::from_millis(1500));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ran: bool = redis::cmd("EXISTS")
        .arg(&fence)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(
        ran,
        "the held try never reached the server (the test proves nothing)"
    );
    let r = Lock::new("late-try")
        .with_backend(n.direct.clone())
        .acquire()
        .await;
    match r {
        Ok(g) => g.release().await.unwrap(),
        Err(e) => panic!(
            "the late-delivered try left an orphan after its give-back: {e:?} (retry_after {:?})",
            e.retry_after()
        ),
    }
}

/// Protocol rule 3: a holder's release that fails for want of an answer (the connection
/// blackholed, then closed) is retried by the backend once the server answers again, instead
/// of leaving the lock taken for the rest of its 30 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_lost_in_a_partition_is_retried_after_the_heal() {
    let n = net().await;
    let g = Lock::new("lost-release")
        .with_backend(n.via_proxy.clone())
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    n.proxy.set_mode(Mode::Blackhole);
    let r = g.release().await;
    assert!(
        r.is_err(),
        "a release through a blackhole was confirmed: {r:?}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Leaving the blackhole closes the connection that dropped the release.
    n.proxy.set_mode(Mode::Pass);
    let healed = Instant::now();
    let g = Lock::new("lost-release")
        .with_backend(n.direct.clone())
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("the release was retried after the heal");
    assert!(
        healed.elapsed() < Duration::from_secs(5),
        "free only {:?} after the heal (the lease was 30 s)",
        healed.elapsed()
    );
    g.release().await.unwrap();
}

/// Rule 2 on the read-write lock: a write try sent into a partition whose bytes are delivered
/// late, after the heal, must not leave an orphan write hold. Its give-back (`rw_release` of
/// every hold) is sent on the try's own connection, behind it, so it runs after the late try;
/// a give-back on a fresh connection would overtake the try (answering `NotOwner`), and the
/// late grant would then hold the write side for 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rw_give_back_never_overtakes_its_write_try_delivered_late_after_a_heal() {
    let n = net().await;
    // Connect the data connection through the proxy first.
    dlock::RwLock::new("late-rw")
        .with_backend(n.via_proxy.clone())
        .write()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let fence = format!("{}:rw:fence", dlock::backend::redis_keys("late-rw").lock);
    let mut raw = redis::Client::open(n.server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("DEL")
        .arg(&fence)
        .query_async(&mut raw)
        .await
        .unwrap();
    n.proxy.set_mode(Mode::Hold);
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        dlock::RwLock::new("late-rw")
            .with_backend(n.via_proxy.clone())
            .ttl(Duration::from_secs(30))
            .write(),
    )
    .await
    .expect("the try is bounded by the response timeout");
    assert!(r.is_err(), "acquired through a partition: {:?}", r.is_ok());
    // The give-back is retried during the partition; new connections are refused meanwhile.
    tokio::time::sleep(Duration::from_secs(1)).await;
    n.proxy
        .heal_delivering_held_after(Duration::from_millis(1500));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ran: bool = redis::cmd("EXISTS")
        .arg(&fence)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(
        ran,
        "the held try never reached the server (the test proves nothing)"
    );
    let r = dlock::RwLock::new("late-rw")
        .with_backend(n.direct.clone())
        .write()
        .await;
    match r {
        Ok(g) => g.release().await.unwrap(),
        Err(e) => panic!(
            "the late-delivered write try left an orphan after its give-back: {e:?} (retry_after {:?})",
            e.retry_after()
        ),
    }
}
