//! The operator's view (`dlock::admin`, what the `dlock` CLI runs on), written once and run
//! against every engine with a server: listing and showing held locks, force-release (the
//! evicted holder hears `lost()`, a waiter in another process gets the lock, a hold that changed
//! hands is not touched), and watching acquisitions and releases.
//!
//! The admin is connected from the store's address, as the CLI is, never through the backend
//! under test.

mod common;

use std::time::Duration;

use common::{Env, Kind};
use dlock::Lock;
use dlock::admin::{ForceReleased, LockEvent};

/// The admin shows the holder's fencing token. Redlock: the largest of the holder's node
/// tokens, which is at least the guard's (the guard keeps the largest of the grants it counted
/// before the quorum decision; a later node may have granted a larger one).
fn assert_token(env: &Env, shown: Option<u64>, holder: u64) {
    if env.kind == Kind::Redlock {
        assert!(shown >= Some(holder), "{shown:?} < {holder}");
    } else {
        assert_eq!(
            shown,
            Some(holder),
            "the admin reports the holder's fencing token"
        );
    }
}

/// Generous bound for anything that should happen at once (catches a hang, not a slowdown).
const SOON: Duration = Duration::from_secs(10);

async fn held_locks_are_listed_and_shown_with_owner_token_and_lease(env: Env) {
    let admin = env.admin().await;
    let ttl = Duration::from_secs(20);
    let a1 = env.lock("adm:a:1").ttl(ttl).acquire().await.unwrap();
    let a2 = env.lock("adm:a:2").ttl(ttl).acquire().await.unwrap();
    let b1 = env.lock("adm:b:1").ttl(ttl).acquire().await.unwrap();

    let listing = admin.list("adm:a:").await.expect("list");
    let names: Vec<&str> = listing.locks.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(
        names,
        ["adm:a:1", "adm:a:2"],
        "only the prefix's locks, sorted"
    );
    let all = admin.list("").await.expect("list all");
    assert_eq!(all.locks.len(), 3, "{:?}", all.locks);

    for (g, name) in [(&a1, "adm:a:1"), (&a2, "adm:a:2"), (&b1, "adm:b:1")] {
        let info = admin.show(name).await.expect("show").expect("held");
        assert_eq!(info.name, name);
        assert_token(&env, info.token, g.fencing_token());
        assert_eq!(info.holders.len(), 1, "{info:?}");
        assert!(info.holds() >= 1, "{info:?}");
        assert!(!info.holders[0].owner.is_empty());
        if env.lease_expires_by_ttl() {
            let left = info.remaining.expect("a ttl engine reports the lease left");
            assert!(left <= ttl && left > ttl / 2, "{left:?}");
        }
    }
    // Two holders in one process have different owner ids.
    let o1 = admin.show("adm:a:1").await.unwrap().unwrap().holders[0]
        .owner
        .clone();
    let o2 = admin.show("adm:a:2").await.unwrap().unwrap().holders[0]
        .owner
        .clone();
    assert_ne!(o1, o2);

    a1.release().await.unwrap();
    a2.release().await.unwrap();
    b1.release().await.unwrap();
    assert_eq!(admin.show("adm:a:1").await.expect("show"), None);
    let after = admin.list("adm:").await.expect("list");
    assert!(after.locks.is_empty(), "{:?}", after.locks);
}

async fn force_release_evicts_the_holder_and_wakes_a_waiter_elsewhere(env: Env) {
    let admin = env.admin().await;
    let name = "adm:force";
    let holder = env
        .lock(name)
        .ttl(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap();
    let old_token = holder.fencing_token();
    // A waiter on another client of the store (another process, as far as the store can tell).
    let other = env.another_backend().await;
    let waiter = tokio::spawn(async move {
        let started = std::time::Instant::now();
        let g = Lock::new(name)
            .with_backend(other)
            .ttl(Duration::from_secs(10))
            .wait(Duration::from_secs(30))
            .acquire()
            .await;
        (g, started.elapsed())
    });
    // Let the waiter register (an engine that can see its waiters says so).
    let seen = common::eventually(SOON, || async {
        match admin.show(name).await {
            Ok(Some(i)) => i.waiters.is_none_or(|w| w >= 1),
            _ => false,
        }
    })
    .await;
    assert!(seen, "the waiter did not show up");
    tokio::time::sleep(Duration::from_millis(300)).await;

    let before = admin.show(name).await.unwrap().expect("still held");
    assert_token(&env, before.token, old_token);
    let r = admin
        .force_release(name, Some(&before))
        .await
        .expect("unlock");
    let ForceReleased::Released { was, .. } = r else {
        panic!("expected Released, got {r:?}");
    };
    assert_eq!(was.token, before.token);

    // The waiter gets the lock long before the holder's renewed lease would have let it.
    let (g, waited) = tokio::time::timeout(SOON, waiter)
        .await
        .expect("the waiter was not woken")
        .unwrap();
    let g = g.expect("the waiter acquires after the force-release");
    assert!(g.fencing_token() > old_token);
    assert!(waited < Duration::from_secs(25), "{waited:?}");

    // The evicted holder hears it (at its next renewal, within a third of its ttl, or by its
    // session's own signal).
    tokio::time::timeout(SOON, holder.lost())
        .await
        .expect("the evicted holder's lost() fired");
    assert!(!holder.is_valid());
    let now = admin.show(name).await.unwrap().expect("held by the waiter");
    assert_token(&env, now.token, g.fencing_token());
    g.release().await.unwrap();
    drop(holder);
}

async fn force_release_leaves_a_hold_that_changed_hands(env: Env) {
    let admin = env.admin().await;
    let name = "adm:changed";
    let first = env.lock(name).acquire().await.unwrap();
    let seen = admin.show(name).await.unwrap().expect("held");
    first.release().await.unwrap();
    let second = env.lock(name).acquire().await.unwrap();
    assert_ne!(second.fencing_token(), seen.token.unwrap());
    let r = admin
        .force_release(name, Some(&seen))
        .await
        .expect("unlock");
    assert_eq!(r, ForceReleased::Changed);
    let now = admin.show(name).await.unwrap().expect("still held");
    assert_token(&env, now.token, second.fencing_token());
    assert!(second.is_valid());
    second.release().await.unwrap();
}

async fn force_release_of_a_free_name_reports_not_held(env: Env) {
    let admin = env.admin().await;
    assert_eq!(
        admin.force_release("adm:free", None).await.expect("unlock"),
        ForceReleased::NotHeld
    );
    assert_eq!(admin.show("adm:free").await.expect("show"), None);
}

async fn watch_reports_releases_and_acquisitions_under_its_prefix(env: Env) {
    let admin = env.admin().await;
    let mut w = admin.watch("adm:w:").await.expect("watch");
    let g = env.lock("adm:w:1").acquire().await.unwrap();
    let token = g.fencing_token();
    let x = env.lock("adm:x:1").acquire().await.unwrap();
    // Held across a few polls of an engine whose watch lists the locks periodically.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    x.release().await.unwrap();
    g.release().await.unwrap();
    let mut events = Vec::new();
    let deadline = tokio::time::Instant::now() + SOON;
    while !events
        .iter()
        .any(|e| matches!(e, LockEvent::Released { name } if name == "adm:w:1"))
    {
        match tokio::time::timeout_at(deadline, w.events.recv()).await {
            Ok(Some(Ok(e))) => events.push(e),
            Ok(Some(Err(e))) => panic!("watch failed: {e}"),
            Ok(None) => panic!("watch ended; events so far {events:?}"),
            Err(_) => panic!("no release event within {SOON:?}; events {events:?}"),
        }
    }
    assert!(
        events.iter().all(|e| e.name().starts_with("adm:w:")),
        "{events:?}"
    );
    if w.sees_acquisitions {
        let acquired = events
            .iter()
            .find_map(|e| match e {
                LockEvent::Acquired { name, token, .. } if name == "adm:w:1" => Some(*token),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no acquisition event: {events:?}"));
        if acquired.is_some() {
            assert_token(&env, acquired, token);
        }
    }
}

macro_rules! admin_backends {
    ($($t:ident),* $(,)?) => {
        mod on_redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(crate::common::Env::redis().await).await
                }
            )*
        }
        mod on_redlock {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(crate::common::Env::redlock(3).await).await
                }
            )*
        }
        #[cfg(feature = "cluster")]
        mod on_cluster {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(crate::common::Env::cluster().await).await
                }
            )*
        }
        #[cfg(feature = "zookeeper")]
        mod on_zookeeper {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(crate::common::Env::zookeeper().await).await
                }
            )*
        }
        #[cfg(feature = "etcd")]
        mod on_etcd {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(crate::common::Env::etcd().await).await
                }
            )*
        }
    };
}

admin_backends!(
    held_locks_are_listed_and_shown_with_owner_token_and_lease,
    force_release_evicts_the_holder_and_wakes_a_waiter_elsewhere,
    force_release_leaves_a_hold_that_changed_hands,
    force_release_of_a_free_name_reports_not_held,
    watch_reports_releases_and_acquisitions_under_its_prefix,
);

/// Redis with keyspace notifications on: acquisitions come with their holder and token, and a
/// lease that runs out without a release is reported as an expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keyspace_notifications_show_acquisitions_and_expiries() {
    let env = Env::redis().await;
    let mut con = env.server().admin_async().await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("notify-keyspace-events")
        .arg("Kghx")
        .query_async(&mut con)
        .await
        .unwrap();
    let admin = env.admin().await;
    let mut w = admin.watch("ks:").await.expect("watch");
    assert!(w.sees_acquisitions, "{}", w.sees);
    let g = env.lock("ks:held").acquire().await.unwrap();
    // A holder that never gives back (as if its process died): its lease runs out.
    env.backend()
        .try_acquire("ks:crashed", "crashed-owner", Duration::from_millis(300))
        .await
        .unwrap();
    let mut events = Vec::new();
    let deadline = tokio::time::Instant::now() + SOON;
    while !events
        .iter()
        .any(|e| matches!(e, LockEvent::Expired { name } if name == "ks:crashed"))
    {
        match tokio::time::timeout_at(deadline, w.events.recv()).await {
            Ok(Some(Ok(e))) => events.push(e),
            other => panic!("no expiry event: {other:?}; events {events:?}"),
        }
    }
    let held = events.iter().find_map(|e| match e {
        LockEvent::Acquired { name, owner, token } if name == "ks:held" => Some((owner, token)),
        _ => None,
    });
    let (owner, token) = held.unwrap_or_else(|| panic!("no acquisition event: {events:?}"));
    assert_eq!(*token, Some(g.fencing_token()));
    let shown = admin.show("ks:held").await.unwrap().unwrap();
    assert_eq!(owner.as_deref(), Some(shown.holders[0].owner.as_str()));
    assert!(events.iter().any(
        |e| matches!(e, LockEvent::Acquired { name, owner, .. } if name == "ks:crashed" && owner.as_deref() == Some("crashed-owner"))
    ));
    g.release().await.unwrap();
}

/// Keys under `dlock:{` that are not dlock locks (another type at a lock's key, a key the
/// library never writes) are counted as skipped, never listed; force-release does not touch a
/// key of another type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_foreign_keys_are_skipped_not_shown() {
    let env = Env::redis().await;
    let mut con = env.server().admin_async().await;
    let _: () = redis::cmd("SET")
        .arg(dlock::redis_keys("str").lock)
        .arg("x")
        .query_async(&mut con)
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg("dlock:{a}b}")
        .arg("x")
        .query_async(&mut con)
        .await
        .unwrap();
    let g = env.lock("real").acquire().await.unwrap();
    let admin = env.admin().await;
    let l = admin.list("").await.expect("list");
    let names: Vec<&str> = l.locks.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["real"]);
    assert_eq!(l.skipped, 2);
    let e = admin
        .force_release("str", None)
        .await
        .expect_err("wrong type");
    assert_eq!(e.kind, dlock::admin::AdminErrorKind::Server);
    let v: String = redis::cmd("GET")
        .arg(dlock::redis_keys("str").lock)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(v, "x");
    g.release().await.unwrap();
}
