//! ZooKeeper faults (feature `zookeeper`): ensemble member kills, a paused holder process, a lost
//! create reply. Servers are private (tests/common/zookeeper.rs), on free loopback ports.
#![cfg(feature = "zookeeper")]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::proxy::{Mode, Proxy};
use common::zookeeper::{SESSION, ZkEnsemble, ZkProc, admin};
use common::{child_say, spawn_self};
use dlock::{Lock, LockError, ZookeeperBackend};

async fn backend(hosts: &str, session: Duration, request: Duration) -> ZookeeperBackend {
    ZookeeperBackend::builder(hosts)
        .session_timeout(session)
        .request_timeout(request)
        .build()
        .await
        .expect("connect")
}

async fn ensemble() -> ZkEnsemble {
    tokio::task::spawn_blocking(ZkEnsemble::start)
        .await
        .expect("start the ensemble")
}

/// Kill one follower of a 3-server ensemble (the one the holder is connected to, when it is a
/// follower): the holder keeps its lock (never told lost, renewals keep confirming), the lock
/// stays exclusive, and new acquisitions of other names work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_minority_keeps_locks_working_and_no_holder_is_told_lost() {
    let mut e = ensemble().await;
    let session = Duration::from_secs(4);
    let b = backend(&e.hosts(), session, Duration::from_secs(2)).await;
    let other = backend(&e.hosts(), session, Duration::from_secs(2)).await;
    let g = Lock::new("minority")
        .with_backend(Arc::new(b.clone()))
        .acquire()
        .await
        .unwrap();
    let leader = e.leader().expect("a leader");
    let victim = e
        .member_of_session(b.session_id())
        .filter(|&m| m != leader)
        .unwrap_or((leader + 1) % ZkEnsemble::SIZE);
    e.kill(victim);
    // Three session timeouts of renewals through the loss of a member.
    let until = Instant::now() + session * 3;
    let mut i = 0;
    while Instant::now() < until {
        let n = format!("minority-other-{i}");
        let g2 = tokio::time::timeout(
            Duration::from_secs(10),
            Lock::new(n.as_str())
                .with_backend(Arc::new(other.clone()))
                .wait(Duration::from_secs(5))
                .acquire(),
        )
        .await
        .expect("bounded")
        .expect("acquire with a minority down");
        g2.release().await.unwrap();
        let busy = Lock::new("minority")
            .with_backend(Arc::new(other.clone()))
            .acquire()
            .await;
        assert!(
            matches!(busy, Err(LockError::Busy { .. })),
            "the held lock is still exclusive: {busy:?}"
        );
        i += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(i > 0);
    assert!(
        g.is_valid(),
        "the holder lost its lock to a minority failure"
    );
    assert_eq!(g.lost_reason(), None);
    g.release().await.expect("release after a minority failure");
}

/// Kill two of three members: an acquisition fails with a typed error within its wait (plus one
/// request bound), and the holder's `lost()` fires by its session deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_majority_fails_acquire_with_a_typed_error_and_holders_see_lost() {
    let mut e = ensemble().await;
    let session = Duration::from_secs(2);
    let request = Duration::from_secs(1);
    let b = backend(&e.hosts(), session, request).await;
    let other = backend(&e.hosts(), session, request).await;
    let g = Lock::new("majority")
        .with_backend(Arc::new(b.clone()))
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let granted = b.session_timeout();
    let leader = e.leader().expect("a leader");
    let cut = Instant::now();
    e.kill(leader);
    e.kill((leader + 1) % ZkEnsemble::SIZE);
    let wait = Duration::from_secs(2);
    let r = tokio::time::timeout(
        Duration::from_secs(30),
        Lock::new("majority-other")
            .with_backend(Arc::new(other.clone()))
            .wait(wait)
            .acquire(),
    )
    .await
    .expect("acquire is bounded");
    let took = cut.elapsed();
    match r {
        Err(LockError::Backend { .. } | LockError::TimedOut { .. }) => {}
        other => panic!("expected a backend error or a timeout, got {other:?}"),
    }
    assert!(
        took <= wait + request * 2 + Duration::from_secs(2),
        "acquire took {took:?} (wait {wait:?}, request bound {request:?})"
    );
    let reason = tokio::time::timeout(granted * 3, g.lost())
        .await
        .expect("lost() fired");
    assert!(
        cut.elapsed() <= granted + Duration::from_millis(1500),
        "lost() {:?} after the kill; session {granted:?}",
        cut.elapsed()
    );
    assert!(!g.is_valid());
    let _ = reason;
}

/// Child side of the pause test: holds `paused` (ttl 60 s, so only the session bounds it) and
/// reports every completed await of its body with the time since the previous one, or `LOST`.
#[test]
#[ignore = "child-process entry point; run by paused_holder_process_loses_its_node_and_hears_lost_before_its_next_await"]
fn zk_child_entry() {
    let Some(_mode) = common::child_mode() else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let hosts = std::env::var("DLOCK_ZK").expect("DLOCK_ZK");
        let b = backend(&hosts, SESSION, Duration::from_secs(2)).await;
        let g = Lock::new("paused")
            .with_backend(Arc::new(b))
            .ttl(Duration::from_secs(60))
            .acquire()
            .await
            .unwrap();
        child_say(format!("HELD {}", g.fencing_token()));
        let mut last = Instant::now();
        for _ in 0..2000 {
            tokio::select! {
                biased;
                r = g.lost() => {
                    child_say(format!("LOST {r:?}"));
                    break;
                }
                _ = tokio::time::sleep(Duration::from_millis(20)) => {
                    child_say(format!("TICK {}", last.elapsed().as_millis()));
                    last = Instant::now();
                }
            }
        }
        drop(g);
    });
}

/// SIGSTOP the holder's process past its session timeout: the server deletes its node, the next
/// holder's token is larger, and after SIGCONT the stale holder's `lost()` fires before any
/// further await of its body completes (no `TICK` line spanning the pause comes before `LOST`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_holder_process_loses_its_node_and_hears_lost_before_its_next_await() {
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let mut child = spawn_self("zk_child_entry", "hold", &[("DLOCK_ZK", server.hosts())]);
    let line = child.expect_line(Duration::from_secs(60));
    let stale_token: u64 = line
        .strip_prefix("HELD ")
        .unwrap_or_else(|| panic!("unexpected line {line:?}"))
        .parse()
        .unwrap();
    let pid = child.pid();
    // SAFETY: kill(2) on our own child process.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) }, 0);
    let paused = Instant::now();
    let b = backend(&server.hosts(), SESSION, Duration::from_secs(2)).await;
    let g = tokio::time::timeout(
        Duration::from_secs(30),
        Lock::new("paused")
            .with_backend(Arc::new(b.clone()))
            .wait(Duration::from_secs(25))
            .acquire(),
    )
    .await
    .expect("bounded")
    .expect("the paused holder's session expires and the lock is taken");
    assert!(
        paused.elapsed() >= SESSION / 2,
        "the lock was taken while the paused holder's session should still live"
    );
    assert!(
        g.fencing_token() > stale_token,
        "the next holder's token is larger"
    );
    // The stale node is gone: only the new holder's node is left.
    let c = admin(&server).await;
    let kids = c.list_children(&b.lock_dir("paused")).await.unwrap();
    assert_eq!(kids.len(), 1, "nodes left: {kids:?}");
    let pause = paused.elapsed();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) }, 0);
    let mut ticks_before_stop = 0;
    loop {
        let l = child.expect_line(Duration::from_secs(30));
        if l.starts_with("LOST") {
            break;
        }
        let gap: u128 = l
            .strip_prefix("TICK ")
            .expect("TICK or LOST")
            .parse()
            .unwrap();
        assert!(
            gap < pause.as_millis() / 2,
            "an await of the stale holder's body completed across the pause ({gap} ms) before lost() fired"
        );
        ticks_before_stop += 1;
    }
    let _ = ticks_before_stop;
    g.release().await.unwrap();
    child.wait_success(Duration::from_secs(30));
}

/// Drop the replies of a contender's connection while it creates its node: the create reaches
/// the server, its answer does not. The acquisition fails with a typed error and, once the
/// connection is back (same session, still alive), the node is deleted: no orphan stays queued
/// in front of later contenders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_create_reply_leaves_no_orphan_node() {
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let proxy = Proxy::start(server.port());
    let holder_b = backend(&server.hosts(), SESSION, Duration::from_secs(2)).await;
    let holder = Lock::new("orphan")
        .with_backend(Arc::new(holder_b.clone()))
        .acquire()
        .await
        .unwrap();
    let session = Duration::from_secs(5);
    let c_b = backend(
        &format!("127.0.0.1:{}", proxy.port()),
        session,
        Duration::from_millis(500),
    )
    .await;
    let c_session = c_b.session_id();
    let admin_c = admin(&server).await;
    let dir = holder_b.lock_dir("orphan");
    proxy.set_mode(Mode::DropReplies);
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        Lock::new("orphan")
            .with_backend(Arc::new(c_b.clone()))
            .acquire(),
    )
    .await
    .expect("bounded");
    assert!(matches!(r, Err(LockError::Backend { .. })), "got {r:?}");
    // The create did reach the server: two nodes now.
    let kids = admin_c.list_children(&dir).await.unwrap();
    assert_eq!(
        kids.len(),
        2,
        "the contender's create reached the server: {kids:?}"
    );
    proxy.set_mode(Mode::Pass);
    let start = Instant::now();
    loop {
        let kids = admin_c.list_children(&dir).await.unwrap();
        if kids.len() == 1 {
            break;
        }
        assert!(
            start.elapsed() < session,
            "orphan node still there after {:?}: {kids:?}",
            start.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        c_b.session_id(),
        c_session,
        "removed by the backend, not by a session expiry"
    );
    holder.release().await.unwrap();
    // Nothing queued in front: the next contender gets the lock at once.
    let g = tokio::time::timeout(
        Duration::from_secs(5),
        Lock::new("orphan")
            .with_backend(Arc::new(c_b.clone()))
            .acquire(),
    )
    .await
    .expect("bounded")
    .expect("free after the holder released");
    g.release().await.unwrap();
}

/// A release whose delete is lost to a connection loss (the request was written, the connection
/// then broke, and the client does not re-send it) is retried by the backend on the same
/// session until the server confirms the node gone. The release itself reports a backend error
/// (never `NotOwner`: nothing answered that the node is not ours), and another backend gets the
/// name within a bound far below the session's lifetime, which never ends here (same session
/// id before and after), so the node was deleted by the retry, not by a session expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_lost_to_a_connection_loss_is_retried_until_the_node_is_gone() {
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let proxy = Proxy::start(server.port());
    // The servers clamp sessions to 20 ticks (5 s).
    let session = Duration::from_secs(5);
    let b = backend(
        &format!("127.0.0.1:{}", proxy.port()),
        session,
        Duration::from_millis(500),
    )
    .await;
    let sid = b.session_id();
    let g = Lock::new("stuck")
        .with_backend(Arc::new(b.clone()))
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let dir = b.lock_dir("stuck");
    let admin_c = admin(&server).await;
    assert_eq!(admin_c.list_children(&dir).await.unwrap().len(), 1);
    let owner = g.owner().to_string();
    proxy.set_mode(Mode::Blackhole);
    let r = tokio::time::timeout(Duration::from_secs(10), g.release())
        .await
        .expect("release is bounded");
    assert!(
        matches!(r, Err(LockError::Backend { .. })),
        "an unconfirmed delete is a backend error, not {r:?}"
    );
    // A later release of the same owner (the core's retried give-back) while the delete is
    // still unconfirmed is no `NotOwner` either.
    let again = tokio::time::timeout(
        Duration::from_secs(10),
        dlock::Backend::release(&b, "stuck", &owner, None, true),
    )
    .await
    .expect("release is bounded");
    assert!(
        matches!(again, Err(LockError::Backend { .. })),
        "a release retried while the delete is unconfirmed: {again:?}"
    );
    // Healing closes the connection that swallowed the delete: the client reconnects on the
    // same session, and the written delete is failed, not re-sent.
    proxy.set_mode(Mode::Pass);
    let healed = Instant::now();
    let other = backend(&server.hosts(), SESSION, Duration::from_secs(2)).await;
    let bound = Duration::from_secs(3);
    let g2 = tokio::time::timeout(
        bound + Duration::from_secs(5),
        Lock::new("stuck")
            .with_backend(Arc::new(other.clone()))
            .wait(bound)
            .acquire(),
    )
    .await
    .expect("bounded")
    .unwrap_or_else(|e| {
        panic!(
            "the name is still blocked {:?} after the heal: {e}",
            healed.elapsed()
        )
    });
    let took = healed.elapsed();
    assert!(took < session, "took {took:?}");
    eprintln!("the name was free {took:?} after the heal");
    assert_eq!(
        b.session_id(),
        sid,
        "the node went by the backend's retry, not with a new session"
    );
    // The old session is still alive on the server (it was not expired meanwhile).
    let st = admin_c
        .check_stat(&format!(
            "{dir}/{}",
            admin_c.list_children(&dir).await.unwrap()[0]
        ))
        .await
        .unwrap()
        .expect("the new holder's node");
    assert_eq!(st.ephemeral_owner, other.session_id());
    let probe = Lock::new("stuck-probe")
        .with_backend(Arc::new(b.clone()))
        .acquire()
        .await
        .expect("the first backend still works");
    assert_eq!(b.session_id(), sid, "same session after the heal");
    probe.release().await.unwrap();
    g2.release().await.unwrap();
}

/// A release goes on on the backend's driver thread whoever called it: a release future dropped
/// without ever being polled still deletes the node, and so does one whose caller's runtime is
/// dropped while its delete is lost (blackholed, then the connection breaks): the backend
/// retries it on the same session once the server is reachable. The core relies on this to give
/// back holds from a runtime that is shutting down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_goes_on_on_the_driver_when_its_caller_goes_away() {
    use dlock::Backend as _;
    use dlock::backend::Acquired;
    let server = tokio::task::spawn_blocking(ZkProc::start).await.unwrap();
    let proxy = Proxy::start(server.port());
    let b = backend(
        &format!("127.0.0.1:{}", proxy.port()),
        Duration::from_secs(5),
        Duration::from_millis(500),
    )
    .await;
    let sid = b.session_id();
    let ttl = Duration::from_secs(60);
    for (name, owner) in [("dropped", "owner-1"), ("cut-off", "owner-2")] {
        let r = b.try_acquire(name, owner, ttl).await.unwrap();
        assert!(matches!(r, Acquired::Granted { .. }), "{r:?}");
    }
    let admin_c = admin(&server).await;
    let gone = |name: &'static str| {
        let (admin_c, dir) = (&admin_c, b.lock_dir(name));
        async move {
            common::eventually(Duration::from_secs(3), || async {
                admin_c
                    .list_children(&dir)
                    .await
                    .map_or(true, |k| k.is_empty())
            })
            .await
        }
    };
    // Dropped unpolled.
    drop(b.release("dropped", "owner-1", None, true));
    assert!(
        gone("dropped").await,
        "a release dropped unpolled did nothing"
    );
    // Polled on a runtime that goes away while its delete is lost.
    proxy.set_mode(Mode::Blackhole);
    let b2 = b.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let r = rt.block_on(async {
            tokio::time::timeout(
                Duration::from_millis(100),
                b2.release("cut-off", "owner-2", None, true),
            )
            .await
        });
        assert!(r.is_err(), "the delete cannot be answered: {r:?}");
        drop(rt);
    })
    .join()
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.set_mode(Mode::Pass);
    assert!(
        gone("cut-off").await,
        "a release cut off with its caller's runtime left the node"
    );
    assert_eq!(b.session_id(), sid, "deleted on the same session");
}

/// The `ctime` in µs of the holder node (the lowest sequence) under `dir`, read by `c` (retried
/// while `c` reconnects after a member it was on went away).
async fn holder_ctime_us(hosts: &str, dir: &str) -> Option<u64> {
    let mut last_err = None;
    for _ in 0..40 {
        let read = async {
            let c = common::zookeeper::connector()
                .session_timeout(Duration::from_secs(10))
                .connect(hosts)
                .await?;
            let mut kids = c.list_children(dir).await?;
            kids.retain(|k| k.contains("-lock-"));
            kids.sort_by_key(|k| {
                k.rsplit("-lock-")
                    .next()
                    .and_then(|s| s.parse::<i64>().ok())
            });
            let Some(first) = kids.first() else {
                return Err(zookeeper_client::Error::NoNode);
            };
            let (_, st) = c.get_data(&format!("{dir}/{first}")).await?;
            Ok::<_, zookeeper_client::Error>(st.ctime as u64 * 1000)
        };
        match read.await {
            Ok(t) => return Some(t),
            // The holder is gone (its guard lost): no ctime to compare.
            Err(zookeeper_client::Error::NoNode) => return None,
            Err(e) => last_err = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    panic!("reading the holder node's ctime: {last_err:?}");
}

/// The token rule on ZooKeeper (issue 18): every grant's token is at least its node's `ctime` in
/// µs (so a fenced resource moved from Redis or MySQL, whose tokens are server µs, keeps
/// accepting writes) and strictly larger than every earlier grant's of the name, across leader
/// changes between members whose wall clocks differ by 120 s (libfaketime: +60 s, 0, −60 s; the
/// leader stamps `ctime`). The leader moves from the +60 s member to one at least 60 s behind,
/// so `ctime` itself steps back (60 or 120 s less the election's time): a token taken from `ctime` alone would
/// go backwards (seen: with ±8 s offsets, a slow election on a loaded machine hid the step); the
/// one stored in the lock parent does not. Before the fix the token was the `czxid` (about
/// 1e10, far below µs since the epoch): the first assertion failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_at_least_server_microseconds_and_increase_across_leaders_with_skewed_clocks() {
    use common::zookeeper::EnsembleOpts;
    let opts = EnsembleOpts {
        clock_offsets: [None, Some("-60s"), Some("+60s")],
        // Sessions outlive a slow election of members under libfaketime on a loaded machine.
        max_session: Some(Duration::from_secs(30)),
        ..EnsembleOpts::default()
    };
    let mut e = tokio::task::spawn_blocking(move || ZkEnsemble::start_with(opts))
        .await
        .unwrap();
    // Members under libfaketime answer slowly on a loaded machine: a first session may time out.
    let mut b = None;
    for _ in 0..5 {
        match ZookeeperBackend::builder(&e.hosts())
            .session_timeout(Duration::from_secs(20))
            .request_timeout(Duration::from_secs(10))
            .build()
            .await
        {
            Ok(x) => {
                b = Some(Arc::new(x));
                break;
            }
            Err(err) => eprintln!("connect: {err}; again"),
        }
    }
    let b = b.expect("a session on the ensemble");
    let hosts = e.hosts();
    let dir = b.lock_dir("skewed");
    let mut last;
    let mut ctimes = Vec::new();
    // Steer the leadership to member 3 (+60 s): the highest server id wins an election among
    // members with the same data, so killing any other leader moves it there.
    for round in 0..3 {
        let leader = wait_leader(&e).await;
        if leader == 2 {
            break;
        }
        assert!(round < 2, "member 3 never became the leader");
        e.kill(leader);
        let _ = wait_leader(&e).await;
        e.restart(leader);
    }
    // The lock parent is a container: once empty the server removes it (every 500 ms on the
    // test servers, 60 s by default), and `last` with it; the next grant's floor is then only
    // its node's ctime (docs/zookeeper.md states this limit). Keep it here with a foreign child, as a
    // name in use keeps it.
    {
        let asked = Instant::now();
        let g = Lock::new("skewed")
            .with_backend(b.clone())
            .wait(Duration::from_secs(20))
            .acquire()
            .await
            .expect("a first grant makes the lock parent");
        eprintln!(
            "first grant after {:?}, {:?} left on its guard",
            asked.elapsed(),
            g.remaining()
        );
        last = g.fencing_token();
        let c = common::zookeeper::connector()
            .session_timeout(Duration::from_secs(10))
            .connect(&hosts)
            .await
            .expect("admin client");
        let opts = zookeeper_client::CreateMode::Persistent
            .with_acls(zookeeper_client::Acls::anyone_all());
        c.create(&format!("{dir}/keep"), b"", &opts)
            .await
            .expect("a foreign child keeps the lock parent");
        let _ = g.release().await;
    }
    let grant = async |phase: &str, last: &mut u64, ctimes: &mut Vec<u64>| {
        for i in 0..5 {
            let g = Lock::new("skewed")
                .with_backend(b.clone())
                .wait(Duration::from_secs(20))
                .acquire()
                .await
                .unwrap_or_else(|err| panic!("{phase} grant {i}: {err}"));
            let t = g.fencing_token();
            let Some(ctime) = holder_ctime_us(&hosts, &dir).await else {
                // Lost before it could be read (a slow election on a loaded machine): its
                // token still counts for the order below.
                assert!(
                    !g.is_valid(),
                    "{phase} grant {i}: a valid holder without a node"
                );
                assert!(t > *last, "{phase} grant {i}: token {t} not above {last}");
                *last = t;
                let _ = g.release().await;
                continue;
            };
            assert!(
                t >= ctime,
                "{phase} grant {i}: token {t} is below its node's ctime in µs ({ctime})"
            );
            assert!(
                t > *last,
                "{phase} grant {i}: token {t} is not above the last one ({last})"
            );
            *last = t;
            ctimes.push(ctime);
            // Members under libfaketime on a loaded machine can be slow enough for a guard to
            // pass its deadline; the token order is what this test is about.
            match g.release().await {
                Ok(()) | Err(LockError::Lost { .. }) => {}
                Err(err) => panic!("{phase} release {i}: {err}"),
            }
        }
    };
    grant("leader +60 s", &mut last, &mut ctimes).await;
    let fast_max = *ctimes.iter().max().unwrap();
    // Member 3 goes.
    e.kill(2);
    // Member 2 (−60 s) or member 1 (host clock) leads, whichever has the later data: either
    // way its clock is at least 60 s behind member 3's.
    let leader = wait_leader(&e).await;
    assert_ne!(leader, 2, "member 3 is down");
    eprintln!("member {} leads after member 3 went", leader + 1);
    ctimes.clear();
    grant("leader -60 s", &mut last, &mut ctimes).await;
    let slow_min = *ctimes.iter().min().unwrap();
    eprintln!("ctime µs: +60 s leader up to {fast_max}, -60 s leader from {slow_min}");
    // libfaketime took effect on the JVM: the new leader's ctimes are well behind.
    assert!(
        slow_min + 30_000_000 < fast_max,
        "the members' clock offsets did not show in ctime ({fast_max} then {slow_min})"
    );
    // And back: member 3 again (its restart catches up first), the clock steps forward.
    e.restart(2);
    let back = common::eventually(Duration::from_secs(300), || async { e.mode(2).is_some() }).await;
    assert!(back, "member 3 did not rejoin");
    grant("member 3 back", &mut last, &mut ctimes).await;
}

/// The leader's index, waiting up to 300 s for one to be elected (members under libfaketime
/// start slowly on a loaded machine).
async fn wait_leader(e: &ZkEnsemble) -> usize {
    let until = Instant::now() + Duration::from_secs(300);
    loop {
        if let Some(l) = e.leader() {
            return l;
        }
        assert!(Instant::now() < until, "no leader within 300 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A holder connected to a follower that is cut off from its peers (proxied quorum and election
/// ports dropped both ways; its client port stays reachable) must count itself lost by the time
/// the leader expires its session and grants the lock to someone else (review M3, issue 18). The
/// follower goes on answering reads and pings from its own state until its `syncLimit` (here 40
/// ticks, 10 s) runs out, so a renewal that only reads the node kept moving the holder's
/// deadline: at the other contender's grant the stale holder was still valid. The renewal now
/// `sync`s first, which only the leader can complete.
///
/// The cut comes right after a renewal was confirmed, the moment the leader knows least about
/// the session: it hears of a follower's session only through the follower's replies to its
/// pings (every half tick), so the news of that renewal, confirmed through the leader, never
/// reached it, and its last record of the session is older (the client's previous request or
/// ping). A guard counting the whole session timeout from its renewal's send time was then
/// still valid when the leader granted the lock again (seen on a loaded machine, and in 4 of 6
/// runs of this test before the guard's lease left room for that lag).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_on_a_partitioned_follower_is_lost_before_the_leader_grants_again() {
    use common::zookeeper::EnsembleOpts;
    let opts = EnsembleOpts {
        proxied_peers: true,
        sync_limit: Some(40),
        ..EnsembleOpts::default()
    };
    let e = tokio::task::spawn_blocking(move || ZkEnsemble::start_with(opts))
        .await
        .unwrap();
    let leader = wait_leader(&e).await;
    let follower = (leader + 1) % ZkEnsemble::SIZE;
    assert_eq!(e.mode(follower).as_deref(), Some("follower"));
    let on = |i: usize| format!("127.0.0.1:{}", e.client_port(i));
    let session = Duration::from_secs(4);
    // A request bound of 3/5 of the session: the client's idle pings are then the furthest apart
    // (about 1.2 s), so the leader's last record of the session before the cut is the oldest.
    let a = backend(&on(follower), session, session * 3 / 5).await;
    let b = backend(&on(leader), session, Duration::from_secs(5)).await;
    let held = Lock::new("cut-off")
        .with_backend(Arc::new(a.clone()))
        .ttl(session)
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("the holder on the follower");
    // A few renewals through the healthy follower first.
    tokio::time::sleep(session).await;
    assert!(held.is_valid(), "renewals through a healthy follower");
    // Cut the follower off as soon as the next renewal is confirmed (the guard's time left
    // jumps up): spinning on this thread, so that the cut follows within microseconds.
    let (cut, left) = tokio::task::block_in_place(|| {
        let until = Instant::now() + session;
        let mut left = held.remaining();
        loop {
            let now = held.remaining();
            if now > left + Duration::from_millis(20) {
                e.partition(follower);
                return (Instant::now(), now);
            }
            left = now;
            assert!(
                Instant::now() < until,
                "no renewal within a session timeout"
            );
            std::thread::yield_now();
        }
    });
    eprintln!("cut with {left:?} left on the renewed guard");
    let (g, granted, stale_valid) = take_again(&b, "cut-off", session, &held, cut).await;
    eprintln!(
        "granted {granted:?} after the cut; the stale holder valid then: {stale_valid}, lost: {:?}",
        held.lost_reason()
    );
    assert!(
        !stale_valid,
        "the holder on the partitioned follower was still valid when the leader granted the \
         lock again ({granted:?} after the cut)"
    );
    assert!(
        held.lost_reason().is_some(),
        "the stale holder heard the loss"
    );
    // And it stays lost while the follower still answers (up to its syncLimit).
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!held.is_valid());
    g.release().await.unwrap();
    e.heal(follower);
}

/// Takes `name` on `b` (waiting up to 30 s), and says how long after `cut` the grant was seen
/// and whether `stale`, a guard of the same name, was still valid then (read at once: valid
/// then means valid at the grant).
async fn take_again(
    b: &ZookeeperBackend,
    name: &str,
    ttl: Duration,
    stale: &dlock::LockGuard,
    cut: Instant,
) -> (dlock::LockGuard, Duration, bool) {
    let g = Lock::new(name)
        .with_backend(Arc::new(b.clone()))
        .ttl(ttl)
        .wait(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("the leader grants {name} again: {e:?}"));
    let valid = stale.is_valid();
    (g, cut.elapsed(), valid)
}
