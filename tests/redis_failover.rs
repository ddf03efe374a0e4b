//! Failover and persistence (RELIABILITY.md §7 D1, C2) against private redis-servers.
//!
//! D1: a replica that never saw a grant is promoted. The lock is lost (the overlap is the
//! documented, unpreventable case), but the fencing token the new holder gets is still larger
//! than the stale holder's, so a fenced resource refuses the stale holder; and the stale holder's
//! guard reports the loss by its own deadline. C2: with `appendfsync always`, a `kill -9` and a
//! quick restart keep the lock, its owner and its lease.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::RedisProc;
use dlock::{Backend, Lock, LockError, RedisBackend};

async fn backend(url: &str) -> Arc<dyn Backend> {
    Arc::new(
        RedisBackend::builder(url)
            .response_timeout(Duration::from_millis(300))
            .connect()
            .await
            .unwrap(),
    )
}

fn info_field(con: &mut redis::Connection, section: &str, field: &str) -> String {
    let info: String = redis::cmd("INFO").arg(section).query(con).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or("")
        .trim()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_to_a_replica_that_missed_the_grant_still_gives_a_larger_token() {
    let mut master = RedisProc::start();
    let master_port = master.port().to_string();
    let mut replica = RedisProc::start_with(&["--replicaof", "127.0.0.1", &master_port]);
    let mut radmin = replica.admin();
    let started = Instant::now();
    while info_field(&mut radmin, "replication", "master_link_status") != "up" {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "replica link never came up"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // Some history the replica does see.
    let a_backend = backend(&master.url()).await;
    for _ in 0..3 {
        let g = Lock::new("failover")
            .with_backend(a_backend.clone())
            .acquire()
            .await
            .unwrap();
        g.release().await.unwrap();
    }
    let mut madmin = master.admin();
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(2000)
        .query(&mut madmin)
        .unwrap();
    assert_eq!(acked, 1, "the replica did not confirm the history");

    // The replica misses A's grant: it is stopped, and the master drops its replication link
    // (otherwise the kernel would still buffer the grant for the stopped replica to read later).
    tokio::task::block_in_place(|| replica.pause());
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query(&mut madmin)
        .unwrap();
    assert_eq!(killed, 1, "no replication link to cut");
    let ttl = Duration::from_secs(1);
    let a = Lock::new("failover")
        .ttl(ttl)
        .with_backend(a_backend.clone())
        .acquire()
        .await
        .unwrap();
    let a_lost = a.lost();
    tokio::task::block_in_place(|| {
        master.kill();
        replica.resume();
    });
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query(&mut radmin)
        .unwrap();

    // B, on the promoted replica, gets the lock A still believes it holds...
    let b_backend = backend(&replica.url()).await;
    let b = Lock::new("failover")
        .with_backend(b_backend)
        .acquire()
        .await
        .expect("the promoted replica never saw A's grant");
    // ...but with a larger token, so a fenced resource refuses A from now on.
    assert!(
        b.fencing_token() > a.fencing_token(),
        "token repeated or went back after failover: A {} B {}",
        a.fencing_token(),
        b.fencing_token()
    );
    // And A learns it lost the lease by its own deadline (its server is gone).
    let reason = tokio::time::timeout(ttl + Duration::from_secs(1), a_lost)
        .await
        .expect("A's lost() did not fire by its deadline");
    assert_eq!(reason, dlock::LostReason::Deadline);
    assert!(!a.is_valid());
    b.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aof_always_restart_keeps_the_lock_its_owner_and_lease() {
    let mut server = RedisProc::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let b = backend(&server.url()).await;
    let ttl = Duration::from_secs(3);
    let a = Lock::new("aof")
        .ttl(ttl)
        .with_backend(b.clone())
        .acquire()
        .await
        .unwrap();
    let lost = a.lost_token();
    tokio::task::block_in_place(|| {
        server.kill();
        std::thread::sleep(Duration::from_millis(200));
        server.restart();
    });
    // The lock survived with its owner: another owner is refused, with the lease's remainder.
    let started = Instant::now();
    let refused = loop {
        match Lock::new("aof").with_backend(b.clone()).acquire().await {
            Err(e @ LockError::Busy { .. }) => break e,
            Err(e) if e.is_backend() && started.elapsed() < Duration::from_secs(2) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            other => panic!("the lock did not survive the restart: {other:?}"),
        }
    };
    assert!(refused.retry_after().is_some_and(|r| r <= ttl));
    // The watchdog keeps renewing across the restart: still held two leases later.
    tokio::time::sleep(ttl * 2).await;
    assert!(
        !lost.is_cancelled(),
        "lost() fired although the lock survived"
    );
    assert!(a.is_valid());
    assert!(matches!(
        Lock::new("aof").with_backend(b.clone()).acquire().await,
        Err(LockError::Busy { .. })
    ));
    a.release().await.unwrap();
    let g = Lock::new("aof").with_backend(b).acquire().await.unwrap();
    g.release().await.unwrap();
}
