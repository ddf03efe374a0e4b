//! The operator's view (`dlock::admin`, what the `dlock` CLI runs on), written once and run
//! against every engine with a server: listing and showing held locks, force-release (the
//! evicted holder hears `lost()`, a waiter in another process gets the lock, a hold that changed
//! hands is not touched), and watching acquisitions and releases.
//!
//! The admin is connected from the store's address, as the CLI is, never through the backend
//! under test.

mod common;

use std::time::Duration;

use common::Env;
use dlock::Lock;
use dlock::admin::{AdminErrorKind, ForceReleased, LockEvent};

/// Generous bound for anything that should happen at once (catches a hang, not a slowdown).
const SOON: Duration = Duration::from_secs(10);

async fn held_locks_are_listed_and_shown_with_owner_token_and_lease(env: Env) {
    let admin = env.admin().await;
    let ttl = Duration::from_secs(20);
    let a1 = env.lock("adm:a:1").ttl(ttl).acquire().await.unwrap();
    let a2 = env.lock("adm:a:2").ttl(ttl).acquire().await.unwrap();
    let b1 = env.lock("adm:b:1").ttl(ttl).acquire().await.unwrap();

    // An engine whose store keeps no lock names (PostgreSQL advisory mode) says so.
    let names_and_tokens = env.admin_sees_names_and_tokens();
    if names_and_tokens {
        let listing = admin.list("adm:a:").await.expect("list");
        let names: Vec<&str> = listing.locks.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(
            names,
            ["adm:a:1", "adm:a:2"],
            "only the prefix's locks, sorted"
        );
        let all = admin.list("").await.expect("list all");
        assert_eq!(all.locks.len(), 3, "{:?}", all.locks);
    } else {
        let e = admin.list("adm:a:").await.expect_err("list is unsupported");
        assert_eq!(e.kind, AdminErrorKind::Unsupported, "{e}");
    }

    for (g, name) in [(&a1, "adm:a:1"), (&a2, "adm:a:2"), (&b1, "adm:b:1")] {
        let info = admin.show(name).await.expect("show").expect("held");
        assert_eq!(info.name, name);
        assert_eq!(
            info.token,
            names_and_tokens.then(|| g.fencing_token()),
            "the admin reports the holder's fencing token (where the store keeps it)"
        );
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
    if names_and_tokens {
        assert_ne!(o1, o2);
    } else {
        // Advisory mode: the owner is the backend's one session, the same for both.
        assert_eq!(o1, o2);
    }

    a1.release().await.unwrap();
    a2.release().await.unwrap();
    b1.release().await.unwrap();
    assert_eq!(admin.show("adm:a:1").await.expect("show"), None);
    assert_eq!(admin.show("adm:b:1").await.expect("show"), None);
    if names_and_tokens {
        let after = admin.list("adm:").await.expect("list");
        assert!(after.locks.is_empty(), "{:?}", after.locks);
    }
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
    let tokens = env.admin_sees_names_and_tokens();
    assert_eq!(before.token, tokens.then_some(old_token));
    let r = admin
        .force_release(name, Some(&before))
        .await
        .expect("unlock");
    let ForceReleased::Released { was, .. } = r else {
        panic!("expected Released, got {r:?}");
    };
    assert_eq!(was.token, tokens.then_some(old_token));
    assert_eq!(was.holders, before.holders);

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
    assert_eq!(now.token, tokens.then(|| g.fencing_token()));
    assert_ne!(now.holders, before.holders, "another holder now");
    g.release().await.unwrap();
    drop(holder);
}

async fn force_release_leaves_a_hold_that_changed_hands(env: Env) {
    let admin = env.admin().await;
    let name = "adm:changed";
    let first = env.lock(name).acquire().await.unwrap();
    let seen = admin.show(name).await.unwrap().expect("held");
    first.release().await.unwrap();
    // Where the store keeps tokens, any new hold is told apart; without them (advisory mode:
    // the holder is a session) a hold that changed hands is one taken by another process.
    let second = if env.admin_sees_names_and_tokens() {
        let second = env.lock(name).acquire().await.unwrap();
        assert_ne!(second.fencing_token(), seen.token.unwrap());
        second
    } else {
        assert_eq!(seen.token, None);
        Lock::new(name)
            .with_backend(env.another_backend().await)
            .acquire()
            .await
            .unwrap()
    };
    let r = admin
        .force_release(name, Some(&seen))
        .await
        .expect("unlock");
    assert_eq!(r, ForceReleased::Changed);
    let now = admin.show(name).await.unwrap().expect("still held");
    if env.admin_sees_names_and_tokens() {
        assert_eq!(now.token, Some(second.fencing_token()));
    } else {
        assert_ne!(now.holders, seen.holders);
    }
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
        if let Some(t) = acquired {
            assert_eq!(t, token);
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
        #[cfg(feature = "postgres")]
        mod on_postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(crate::common::Env::postgres().await).await
                }
            )*
        }
        #[cfg(feature = "postgres")]
        mod on_pg_advisory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(crate::common::Env::pg_advisory().await).await
                }
            )*
        }
        #[cfg(feature = "mysql")]
        mod on_mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t(crate::common::Env::mysql().await).await
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
