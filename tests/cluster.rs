//! Redis Cluster-only behaviour (feature `cluster`) on a private cluster of 3 masters with one
//! replica each: exclusion over many slots, wake-ups by sharded pub/sub, a resharding of a held
//! and waited-on lock's slot, and a master failover. The shared suites run on the cluster too
//! (`on_cluster` in `lock_behaviour.rs` and `wait_behaviour.rs`).

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::cluster::ClusterSet;
use dlock::backend::Acquired;
use dlock::{Backend, ClusterBackend, Lock, LockError};

async fn cluster() -> Arc<ClusterSet> {
    Arc::new(
        tokio::task::spawn_blocking(|| ClusterSet::start(3, 1))
            .await
            .expect("start the cluster"),
    )
}

async fn backend(set: &ClusterSet) -> Arc<dyn Backend> {
    Arc::new(ClusterBackend::connect(set.urls()).await.expect("connect"))
}

/// Names whose slots are spread over every master.
fn spread_names(set: &ClusterSet, n: usize) -> Vec<String> {
    let names: Vec<String> = (0..n).map(|i| format!("slots:{i}")).collect();
    let masters: HashSet<usize> = names
        .iter()
        .map(|n| set.master_of_slot(ClusterSet::slot_of(&dlock::backend::redis_keys(n).lock)))
        .collect();
    assert_eq!(masters.len(), 3, "the names do not cover every master");
    names
}

/// Non-atomic counters (read, yield, write) per name, incremented under the lock by tasks on two
/// backends (two clients, as two processes would be): every increment survives, and no two
/// holders of one name ever overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_over_keys_in_many_slots() {
    let set = cluster().await;
    let names = spread_names(&set, 12);
    let slots: HashSet<u16> = names
        .iter()
        .map(|n| ClusterSet::slot_of(&dlock::backend::redis_keys(n).lock))
        .collect();
    assert_eq!(slots.len(), names.len(), "every name in its own slot");
    let clients = [backend(&set).await, backend(&set).await];
    let counters: Arc<HashMap<String, (AtomicU64, AtomicBool)>> = Arc::new(
        names
            .iter()
            .map(|n| (n.clone(), (AtomicU64::new(0), AtomicBool::new(false))))
            .collect(),
    );
    const TASKS_PER_NAME: usize = 4;
    const ROUNDS: u64 = 10;
    let mut tasks = Vec::new();
    for (i, name) in names.iter().enumerate() {
        for t in 0..TASKS_PER_NAME {
            let b = clients[(i + t) % 2].clone();
            let name = name.clone();
            let counters = counters.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..ROUNDS {
                    let g = Lock::new(name.as_str())
                        .with_backend(b.clone())
                        .ttl(Duration::from_secs(10))
                        .wait(Duration::from_secs(20))
                        .acquire()
                        .await
                        .expect("acquire");
                    let (count, busy) = &counters[&name];
                    assert!(!busy.swap(true, Ordering::SeqCst), "two holders of {name}");
                    let v = count.load(Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    count.store(v + 1, Ordering::SeqCst);
                    busy.store(false, Ordering::SeqCst);
                    g.release().await.expect("release");
                }
            }));
        }
    }
    let all = async {
        for t in tasks {
            t.await.expect("task");
        }
    };
    tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .expect("the workload finished within 60 s");
    for name in &names {
        assert_eq!(
            counters[name].0.load(Ordering::SeqCst),
            TASKS_PER_NAME as u64 * ROUNDS,
            "lost updates on {name}"
        );
    }
    let left = tokio::task::spawn_blocking({
        let set = set.clone();
        move || common::cluster::lock_keys_left(&set)
    })
    .await
    .unwrap();
    assert!(left.is_empty(), "lock keys left: {left:?}");
}

/// A waiter behind a 30 s-ttl holder that releases after 200 ms gets the lock well under a
/// second after the release: the release's SPUBLISH woke it, not the lease timer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_is_woken_by_the_release_on_its_shard() {
    let set = cluster().await;
    let (a, b) = (backend(&set).await, backend(&set).await);
    for name in spread_names(&set, 3) {
        let holder = Lock::new(name.as_str())
            .with_backend(a.clone())
            .ttl(Duration::from_secs(30))
            .acquire()
            .await
            .expect("holder");
        let token = holder.fencing_token();
        let waiter = tokio::spawn({
            let b = b.clone();
            let name = name.clone();
            async move {
                let g = Lock::new(name.as_str())
                    .with_backend(b)
                    .wait(Duration::from_secs(10))
                    .acquire()
                    .await;
                (g, Instant::now())
            }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        holder.release().await.expect("release");
        let released = Instant::now();
        let (g, got) = waiter.await.unwrap();
        let g = g.expect("the waiter gets the lock");
        let after = got.duration_since(released);
        assert!(
            after < Duration::from_millis(800),
            "{name}: waiter got the lock {after:?} after the release (the lease timer was 30 s)"
        );
        assert!(g.fencing_token() > token, "tokens increase");
        g.release().await.unwrap();
    }
}

/// The slot of a held lock with a waiter moves to another master (SETSLOT MIGRATING /
/// IMPORTING, MIGRATE, SETSLOT NODE) while a third client keeps trying it: no second holder, no
/// error reaches any caller (no CROSSSLOT, NOSCRIPT, MOVED or ASK), the holder keeps renewing
/// through the move, and after its release the waiter is woken on the slot's new shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resharding_a_held_and_waited_on_slot() {
    let set = cluster().await;
    let name = "reshard:me";
    let lock_key = dlock::backend::redis_keys(name).lock;
    let slot = ClusterSet::slot_of(&lock_key);
    let from = set.master_of_slot(slot);
    let to = (0..3).find(|&m| m != from).expect("another master");
    let (a, b, c) = (
        backend(&set).await,
        backend(&set).await,
        backend(&set).await,
    );
    // The target master forgets every script: calls there meet NOSCRIPT after the move.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut set.nodes[to].admin())
        .unwrap();
    let holder = Lock::new(name)
        .with_backend(a.clone())
        .ttl(Duration::from_secs(3))
        .acquire()
        .await
        .expect("holder");
    let token = holder.fencing_token();
    let waiter = tokio::spawn({
        let b = b.clone();
        async move {
            let g = Lock::new(name)
                .with_backend(b)
                .wait(Duration::from_secs(30))
                .acquire()
                .await;
            (g, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    // A prober that must always see Busy, never an error and never a grant.
    let stop = Arc::new(AtomicBool::new(false));
    let prober = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut tries = 0u32;
            while !stop.load(Ordering::SeqCst) && tries < 2000 {
                tries += 1;
                match c.try_acquire(name, "prober", Duration::from_secs(5)).await {
                    Ok(Acquired::Busy { .. }) => {}
                    Ok(Acquired::Granted { .. }) => panic!("the prober was granted a held lock"),
                    Err(e) => panic!("an error reached the caller during the resharding: {e}"),
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            tries
        }
    });
    tokio::task::spawn_blocking({
        let set = set.clone();
        move || {
            set.migrate_slot(slot, from, to, || {
                std::thread::sleep(Duration::from_millis(700))
            });
        }
    })
    .await
    .unwrap();
    assert_eq!(set.master_of_slot(slot), to, "the slot moved");
    // Renewals (every second) go to the new owner.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    stop.store(true, Ordering::SeqCst);
    let tries = prober.await.expect("the prober saw only Busy");
    assert!(tries > 20, "the prober ran ({tries} tries)");
    assert!(holder.is_valid(), "the holder lost its lease in the move");
    let mut on_new: redis::Connection = set.nodes[to].admin();
    let exists: i64 = redis::cmd("EXISTS")
        .arg(&lock_key)
        .query(&mut on_new)
        .unwrap();
    assert_eq!(exists, 1, "the lock lives on the new master");
    holder.release().await.expect("release after the move");
    // NOSCRIPT on the new owner was answered by EVAL there, not passed on.
    let evals = set.nodes[to]
        .commandstats()
        .get("eval")
        .copied()
        .unwrap_or(0);
    assert!(
        evals >= 1,
        "no EVAL ran on the new owner (NOSCRIPT path untested)"
    );
    let released = Instant::now();
    let (g, got) = waiter.await.unwrap();
    let g = g.expect("the waiter still gets the lock");
    let after = got.duration_since(released);
    assert!(
        after < Duration::from_millis(1500),
        "waiter took {after:?} after the release (the holder's lease was 3 s)"
    );
    assert!(g.fencing_token() > token);
    g.release().await.unwrap();
}

/// `CLUSTER FAILOVER` on the replica of the master owning a held lock's slot. The replica had
/// the grant (a coordinated failover waits for it): the holder keeps its lease through the
/// promotion (renewals follow MOVED to the new master) and a contender stays busy. Then the
/// grant is deleted on the new master, as if the promoted replica had missed it (a replica
/// cannot be written to directly in a cluster): the stale holder's `lost()` fires by its next
/// renewal, the next holder's token is larger, and calls work without re-initialising.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn master_failover_keeps_the_grant_and_a_lost_grant_fires_lost() {
    let set = cluster().await;
    let name = "failover:me";
    let keys = dlock::backend::redis_keys(name);
    let slot = ClusterSet::slot_of(&keys.lock);
    let master = set.master_of_slot(slot);
    let replica = set.replica_of(master);
    let (a, b) = (backend(&set).await, backend(&set).await);
    let ttl = Duration::from_secs(3);
    let holder = Lock::new(name)
        .with_backend(a.clone())
        .ttl(ttl)
        .acquire()
        .await
        .expect("holder");
    let lost = holder.lost();
    tokio::task::spawn_blocking({
        let set = set.clone();
        move || {
            let _: () = redis::cmd("CLUSTER")
                .arg("FAILOVER")
                .query(&mut set.nodes[replica].admin())
                .expect("CLUSTER FAILOVER");
            let started = Instant::now();
            while set.master_of_slot(slot) != replica {
                assert!(
                    started.elapsed() < Duration::from_secs(15),
                    "the replica was not promoted"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    })
    .await
    .unwrap();
    // Two renewal periods on the new master: still held, and only by the holder.
    for _ in 0..20 {
        match b.try_acquire(name, "contender", ttl).await {
            Ok(Acquired::Busy { .. }) => {}
            other => panic!("a contender after the failover got {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(holder.is_valid(), "the holder lost a grant the replica had");
    let exists: i64 = redis::cmd("EXISTS")
        .arg(&keys.lock)
        .query(&mut set.nodes[replica].admin())
        .unwrap();
    assert_eq!(exists, 1, "the grant is on the promoted replica");
    // The promoted replica "missed" the grant.
    let n: i64 = redis::cmd("DEL")
        .arg(&keys.lock)
        .arg(&keys.fence)
        .query(&mut set.nodes[replica].admin())
        .unwrap();
    assert_eq!(n, 2);
    let deleted = Instant::now();
    tokio::time::timeout(ttl + Duration::from_secs(2), lost)
        .await
        .expect("lost() fired by the next renewal");
    assert!(deleted.elapsed() <= ttl / 3 + Duration::from_secs(2));
    after_a_lost_grant(holder, &b, name, ttl).await;
}

/// A real lost grant in a master failover: the replica of the slot's master is stopped and its
/// replication link cut before the grant, the master is SIGKILLed after it, and the replica is
/// promoted (`CLUSTER FAILOVER TAKEOVER`) without ever having seen the grant. The stale holder's
/// `lost()` fires (its renewal finds no hold on the new master, or its deadline passes), a new
/// holder gets the lock on the new master with a larger token, and the stale holder's release
/// reports the loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn master_killed_before_replication_loses_the_grant_and_lost_fires() {
    let set = cluster().await;
    let name = "failover:killed";
    let keys = dlock::backend::redis_keys(name);
    let slot = ClusterSet::slot_of(&keys.lock);
    let master = set.master_of_slot(slot);
    let replica = set.replica_of(master);
    let (a, b) = (backend(&set).await, backend(&set).await);
    // The replica stops and the master drops its link: the grant below is never sent to it.
    signal(&set, replica, libc::SIGSTOP);
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query(&mut set.nodes[master].admin())
        .unwrap();
    let ttl = Duration::from_secs(3);
    let holder = Lock::new(name)
        .with_backend(a.clone())
        .ttl(ttl)
        .acquire()
        .await
        .expect("holder");
    let lost = holder.lost();
    signal(&set, master, libc::SIGKILL);
    signal(&set, replica, libc::SIGCONT);
    let killed = Instant::now();
    tokio::task::spawn_blocking({
        let set = set.clone();
        move || {
            let _: redis::RedisResult<()> = redis::cmd("CLUSTER")
                .arg("FAILOVER")
                .arg("TAKEOVER")
                .query(&mut set.nodes[replica].admin());
            let started = Instant::now();
            loop {
                let mine = set.topology(replica).into_iter().any(|i| {
                    i.master
                        && i.port == set.nodes[replica].port()
                        && i.slots.iter().any(|&(x, y)| x <= slot && slot <= y)
                });
                if mine {
                    break;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "the replica was not promoted"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    })
    .await
    .unwrap();
    let exists: i64 = redis::cmd("EXISTS")
        .arg(&keys.lock)
        .query(&mut set.nodes[replica].admin())
        .unwrap();
    assert_eq!(exists, 0, "the promoted replica never saw the grant");
    tokio::time::timeout(ttl + Duration::from_secs(2), lost)
        .await
        .expect("lost() fired");
    assert!(
        killed.elapsed() < ttl + Duration::from_secs(2),
        "{:?}",
        killed.elapsed()
    );
    after_a_lost_grant(holder, &b, name, ttl).await;
}

/// After the holder's grant was lost on a new master (and its `lost()` fired): the holder knows,
/// a new holder gets the lock there with a larger token, and the stale release reports the loss.
async fn after_a_lost_grant(
    holder: dlock::LockGuard,
    b: &Arc<dyn Backend>,
    name: &str,
    ttl: Duration,
) {
    assert!(!holder.is_valid());
    let token = holder.fencing_token();
    let g = Lock::new(name)
        .with_backend(b.clone())
        .ttl(ttl)
        .wait(Duration::from_secs(20))
        .acquire()
        .await
        .expect("the lock is free on the new master");
    assert!(
        g.fencing_token() > token,
        "token {} after {token}",
        g.fencing_token()
    );
    assert!(matches!(
        holder.release().await,
        Err(LockError::Lost { .. })
    ));
    g.release().await.expect("release on the new master");
}

/// Sends `sig` to the cluster node at index `i`.
fn signal(set: &ClusterSet, i: usize, sig: libc::c_int) {
    // SAFETY: kill(2) on a server this test's harness spawned and has not reaped.
    assert_eq!(
        unsafe { libc::kill(set.nodes[i].pid() as libc::pid_t, sig) },
        0
    );
}

/// `min_replicas(1, ..)`: with the replica of the slot's master up, grants are confirmed; with
/// it stopped, the acquire fails with a typed error naming the replicas and leaves no lock
/// behind; after it resumes, acquisitions work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_replicas_with_the_replica_stopped_fails_typed_and_leaves_no_lock() {
    let set = cluster().await;
    let name = "minrep:one";
    let keys = dlock::backend::redis_keys(name);
    let master = set.master_of_slot(ClusterSet::slot_of(&keys.lock));
    let replica = set.replica_of(master);
    let b: Arc<dyn Backend> = Arc::new(
        ClusterBackend::builder(set.urls())
            .min_replicas(1, Duration::from_millis(500))
            .connect()
            .await
            .unwrap(),
    );
    // A replica of a cluster just created may still be in its first sync: give it a few
    // seconds to confirm a grant at all.
    let mut g = Lock::new(name).with_backend(b.clone()).acquire().await;
    for _ in 0..25 {
        if g.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        g = Lock::new(name).with_backend(b.clone()).acquire().await;
    }
    let g = g.expect("confirmed by the replica");
    g.release().await.unwrap();
    signal(&set, replica, libc::SIGSTOP);
    let r = Lock::new(name).with_backend(b.clone()).acquire().await;
    signal(&set, replica, libc::SIGCONT);
    match r {
        Err(LockError::Backend { source, .. }) => {
            assert!(source.to_string().contains("replicas"), "{source}")
        }
        other => panic!("expected a backend error, got {other:?}"),
    }
    let exists: i64 = redis::cmd("EXISTS")
        .arg(&keys.lock)
        .query(&mut set.nodes[master].admin())
        .unwrap();
    assert_eq!(exists, 0, "the unconfirmed grant was given back");
    let g = Lock::new(name)
        .with_backend(b.clone())
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .expect("works again once the replica is back");
    g.release().await.unwrap();
}

/// Review finding #2: the redis crate's cluster client re-sent a script after the connection
/// dropped, even when the master had run it. An inner (re-entrant) guard's release, whose reply
/// is lost with its connection (a `CLIENT KILL` runs right behind it on the slot's master), must
/// not run twice: the outer holder keeps its hold and a second client stays `Busy`. Which of the
/// two the master reads first varies, so several rounds are run; in each, the outer hold must
/// remain (count 1 when the release ran, 2 when the kill came first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inner_release_whose_connection_drops_is_not_run_twice() {
    let set = cluster().await;
    let name = "resend:inner";
    let keys = dlock::backend::redis_keys(name);
    let master = set.master_of_slot(ClusterSet::slot_of(&keys.lock));
    let b = backend(&set).await;
    let other = backend(&set).await;
    let outer = Lock::new(name)
        .with_backend(b.clone())
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    // The release script is cached on the master, so no NOSCRIPT round trip interferes.
    let _ = other.release(name, "nobody", None, true).await;
    let mut ran = 0;
    for round in 0..6 {
        // The last round's kill dropped `b`'s connection too: its first call may fail (its
        // outcome unknown, it is not re-sent); a re-entry that failed leaves nothing to undo.
        let mut inner = Err(LockError::Config("not tried".into()));
        for _ in 0..20 {
            inner = outer
                .scope(
                    Lock::new(name)
                        .with_backend(b.clone())
                        .ttl(Duration::from_secs(30))
                        .acquire(),
                )
                .await;
            if !matches!(inner, Err(LockError::Backend { .. })) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let inner = inner.unwrap_or_else(|e| panic!("round {round}: re-entry: {e:?}"));
        assert_eq!(inner.hold_count(), 2);
        let mut admin = set.nodes[master].admin();
        signal(&set, master, libc::SIGSTOP);
        let release = tokio::spawn(async move { inner.release().await });
        // The release is written into the stopped master's socket; then the kill, from another
        // connection: on SIGCONT the master reads both, and when it runs the release first it
        // kills the connection before the release's reply is written.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let kill = tokio::task::spawn_blocking(move || {
            redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg("normal")
                .query::<i64>(&mut admin)
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        signal(&set, master, libc::SIGCONT);
        kill.await.unwrap().expect("CLIENT KILL");
        let r = tokio::time::timeout(Duration::from_secs(10), release)
            .await
            .expect("the release is bounded")
            .unwrap();
        let count: Option<String> = redis::cmd("HGET")
            .arg(&keys.lock)
            .arg(outer.owner())
            .query(&mut set.nodes[master].admin())
            .unwrap();
        match count.as_deref() {
            Some("1") => ran += 1,
            Some("2") => {
                // The kill came first: the release never ran. Take the inner hold off by hand.
                b.release(name, outer.owner(), None, false).await.unwrap();
            }
            other => panic!(
                "round {round}: the inner release ran twice (its result: {r:?}; the outer \
                 holder's count is {other:?}): the outer holder's lock is gone"
            ),
        }
        // The kill dropped `other`'s connection too: its first call may fail (unknown outcome).
        let mut second = Err(LockError::Config("not tried".into()));
        for _ in 0..20 {
            second = other
                .try_acquire(name, "second-owner", Duration::from_secs(10))
                .await;
            if !matches!(second, Err(LockError::Backend { .. })) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            matches!(second, Ok(Acquired::Busy { .. })),
            "round {round}: a second holder while the outer guard holds: {second:?}"
        );
    }
    eprintln!("the inner release ran before the kill in {ran} of 6 rounds");
    // The kill dropped `b`'s connection: a release written on it fails (outcome unknown), and
    // one on the reconnected connection frees the lock.
    let freed = common::eventually(Duration::from_secs(5), || async {
        matches!(
            b.release(name, outer.owner(), None, true).await,
            Ok(dlock::backend::Released::Freed)
        )
    })
    .await;
    assert!(freed, "the outer hold could not be released");
}

/// Protocol rule 3: a release lost with its connection (a `CLIENT KILL` that the slot's master
/// runs before it reads the release) is retried by the backend once the cluster answers,
/// instead of leaving the lock taken for the rest of its 30 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_lost_with_its_connection_is_retried() {
    let set = cluster().await;
    let name = "lost-release";
    let keys = dlock::backend::redis_keys(name);
    let master = set.master_of_slot(ClusterSet::slot_of(&keys.lock));
    let b = backend(&set).await;
    let other = backend(&set).await;
    let g = Lock::new(name)
        .with_backend(b.clone())
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let mut admin = set.nodes[master].admin();
    signal(&set, master, libc::SIGSTOP);
    // The kill is written first, then the release: on SIGCONT the master runs the kill first
    // and closes the connection with the release unread.
    let kill = tokio::task::spawn_blocking(move || {
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .query::<i64>(&mut admin)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let release = tokio::spawn(async move { g.release().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(&set, master, libc::SIGCONT);
    kill.await.unwrap().expect("CLIENT KILL");
    let r = tokio::time::timeout(Duration::from_secs(10), release)
        .await
        .expect("the release is bounded")
        .unwrap();
    let resumed = Instant::now();
    let g = Lock::new(name)
        .with_backend(other.clone())
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("the lost release ({r:?}) was not retried: {e:?}"));
    assert!(
        resumed.elapsed() < Duration::from_secs(5),
        "free only {:?} after the master resumed (the lease was 30 s)",
        resumed.elapsed()
    );
    g.release().await.unwrap();
}

/// Runs `ACL SETUSER default <rule>` on every node of the set.
fn acl_default(set: &ClusterSet, rule: &str) {
    for n in set.nodes.iter().filter(|n| n.is_running()) {
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("default")
            .arg(rule)
            .query(&mut n.admin())
            .unwrap();
    }
}

/// Review finding #7 (issue 19): after a lost pub/sub connection, waiters were woken at once
/// (they retry, busy) and not again once their channel was subscribed again, so a release in
/// between reached nobody and was slept through until the holder's lease end. The window is
/// held open here: the default user loses its channel permission and every pub/sub connection
/// is cut (`CLIENT KILL TYPE pubsub`), so the redis crate's own resubscription is refused;
/// the permission comes back and the holder releases at once. The waiter (ttl 10 s) must get
/// the lock within 2 s of the release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_while_the_pubsub_connection_is_resubscribed_is_not_slept_through() {
    let set = cluster().await;
    let name = "resub:me";
    let (a, b) = (backend(&set).await, backend(&set).await);
    let holder = Lock::new(name)
        .with_backend(a.clone())
        .ttl(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    let waiter = tokio::spawn({
        let b = b.clone();
        async move {
            let g = Lock::new(name)
                .with_backend(b)
                .ttl(Duration::from_secs(10))
                .wait(Duration::from_secs(9))
                .acquire()
                .await;
            (g, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    tokio::task::block_in_place(|| {
        acl_default(&set, "resetchannels");
        for n in set.nodes.iter() {
            let _: i64 = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg("pubsub")
                .query(&mut n.admin())
                .unwrap();
        }
    });
    // The waiter, woken by the lost connection, has retried (busy) and waits again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    tokio::task::block_in_place(|| acl_default(&set, "allchannels"));
    assert!(!waiter.is_finished(), "the waiter got a lock still held");
    holder.release().await.unwrap();
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
}

/// Review finding #8 (issue 19): one refused SSUBSCRIBE turned sharded wake-ups off until a
/// restart. Here the default user loses its channel permission, a waiter's SSUBSCRIBE is
/// refused (it times out on the lease timer), the permission comes back, and after the first
/// back-off (1 s) a new waiter behind a 10 s lease is woken by the release within 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_refusal_of_ssubscribe_is_retried_with_back_off() {
    let set = cluster().await;
    let (a, b) = (backend(&set).await, backend(&set).await);
    tokio::task::block_in_place(|| acl_default(&set, "resetchannels"));
    // The fault holds: SSUBSCRIBE of the name's channel is refused on its master.
    let keys = dlock::backend::redis_keys("refused:1");
    let master = set.master_of_slot(ClusterSet::slot_of(&keys.lock));
    let r: redis::RedisResult<redis::Value> = redis::cmd("SSUBSCRIBE")
        .arg(&keys.channel)
        .query(&mut set.nodes[master].admin());
    assert!(
        r.as_ref()
            .is_err_and(|e| e.to_string().to_ascii_lowercase().contains("noperm")),
        "{r:?}"
    );
    let h1 = Lock::new("refused:1")
        .with_backend(a.clone())
        .ttl(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    let r = Lock::new("refused:1")
        .with_backend(b.clone())
        .wait(Duration::from_millis(300))
        .acquire()
        .await;
    assert!(matches!(r, Err(LockError::TimedOut { .. })), "{r:?}");
    h1.release().await.unwrap();
    tokio::task::block_in_place(|| acl_default(&set, "allchannels"));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let h2 = Lock::new("refused:2")
        .with_backend(a.clone())
        .ttl(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    let waiter = tokio::spawn({
        let b = b.clone();
        async move {
            let g = Lock::new("refused:2")
                .with_backend(b)
                .wait(Duration::from_secs(9))
                .acquire()
                .await;
            (g, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    h2.release().await.unwrap();
    let released = Instant::now();
    let (g, got) = tokio::time::timeout(Duration::from_secs(12), waiter)
        .await
        .expect("the waiter returns")
        .unwrap();
    let g = g.expect("the waiter gets the lock");
    let lag = got.saturating_duration_since(released);
    assert!(
        lag < Duration::from_secs(2),
        "the waiter got the lock {lag:?} after the release (ttl 10 s): sharded wake-ups stayed off"
    );
    g.release().await.unwrap();
}

/// Issue 19, item 3: 1,000 waits of 200 ms that time out (each on its own name, held by another
/// owner, 100 at a time) leave no shard channel subscribed, no task and no waiter behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_timed_out_waits_leave_no_subscription_task_or_waiter() {
    let set = Arc::new(
        tokio::task::spawn_blocking(|| ClusterSet::start(3, 0))
            .await
            .unwrap(),
    );
    let cb = ClusterBackend::connect(set.urls()).await.unwrap();
    let b: Arc<dyn Backend> = Arc::new(cb.clone());
    let names: Vec<String> = (0..1000).map(|i| format!("leak:{i}")).collect();
    let held = futures_util::future::join_all(
        names
            .iter()
            .map(|n| b.try_acquire(n, "holder", Duration::from_secs(60))),
    )
    .await;
    assert!(
        held.iter()
            .all(|r| matches!(r, Ok(Acquired::Granted { .. })))
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
        set.nodes
            .iter()
            .map(|n| {
                let v: Vec<String> = redis::cmd("PUBSUB")
                    .arg("SHARDCHANNELS")
                    .arg("dlock:*")
                    .query(&mut n.admin())
                    .unwrap();
                v.len()
            })
            .sum()
    };
    let tasks = || {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    };
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
            && cb.waiter_count() == 0
    })
    .await;
    assert!(
        settled,
        "after 1,000 timed-out waits ({took:?}): {} tasks (before: {tasks_before}), {} shard \
         channels subscribed (before: {channels_before}), {} waiters",
        tasks(),
        tokio::task::block_in_place(channels),
        cb.waiter_count()
    );
    eprintln!(
        "1,000 timed-out waits in {took:?}; tasks {tasks_before} -> {}, shard channels {channels_before} -> {}",
        tasks(),
        tokio::task::block_in_place(channels)
    );
}
