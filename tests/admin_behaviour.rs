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
use dlock::admin::{AdminErrorKind, ForceReleased, LockEvent};

/// The admin shows the holder's fencing token. Redlock: the largest of the holder's node
/// tokens, which is at least the guard's (the guard keeps the largest of the grants it counted
/// before the quorum decision; a later node may have granted a larger one).
fn assert_token(env: &Env, shown: Option<u64>, holder: u64) {
    if !env.admin_sees_names_and_tokens() {
        // PostgreSQL advisory mode: the token lives only in the holder's process.
        assert_eq!(shown, None);
    } else if env.kind == Kind::Redlock {
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

/// The holder name every test of this binary sets: with a bell and a newline, which the stored
/// identity must not carry.
const HOLDER_NAME: &str = "adm-holder\u{7}\n-x";
const HOLDER_NAME_STORED: &str = "adm-holder-x";

/// Who holds a lock (issue 20): `list` and `show` report the holder's host, pid and the name the
/// application set, with the control characters stripped.
async fn held_locks_name_their_holder(env: Env) {
    dlock::set_holder_name(HOLDER_NAME);
    let admin = env.admin().await;
    let g = env
        .lock("adm:who:1")
        .ttl(Duration::from_secs(20))
        .acquire()
        .await
        .unwrap();
    let me = dlock::holder_identity();
    assert_eq!(me.name, HOLDER_NAME_STORED, "control characters stripped");
    let check = |what: &str, info: &dlock::admin::LockInfo| {
        assert_eq!(info.holders.len(), 1, "{what}: {info:?}");
        let id = info.holders[0]
            .identity
            .as_ref()
            .unwrap_or_else(|| panic!("{what} names no holder: {info:?}"));
        assert_eq!(id.name, HOLDER_NAME_STORED, "{what}: {id:?}");
        assert_eq!(id.host, me.host, "{what}: {id:?}");
        assert_eq!(id.pid, std::process::id(), "{what}: {id:?}");
        assert_eq!(
            id.to_string(),
            format!("{HOLDER_NAME_STORED}@{}:{}", me.host, me.pid)
        );
    };
    let shown = admin.show("adm:who:1").await.expect("show").expect("held");
    check("show", &shown);
    if env.admin_sees_names_and_tokens() {
        let listing = admin.list("adm:who:").await.expect("list");
        assert_eq!(listing.locks.len(), 1, "{:?}", listing.locks);
        check("list", &listing.locks[0]);
    }
    g.release().await.unwrap();
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
    assert_token(&env, now.token, g.fencing_token());
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
    assert_token(&env, now.token, second.fencing_token());
    if !env.admin_sees_names_and_tokens() {
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
    held_locks_name_their_holder,
    force_release_evicts_the_holder_and_wakes_a_waiter_elsewhere,
    force_release_leaves_a_hold_that_changed_hands,
    force_release_of_a_free_name_reports_not_held,
    watch_reports_releases_and_acquisitions_under_its_prefix,
);

/// Turns on the keyspace notifications the Redis watch reads (`Kghx`).
async fn keyspace_events_on(env: &Env) {
    let mut con = env.server().admin_async().await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("notify-keyspace-events")
        .arg("Kghx")
        .query_async(&mut con)
        .await
        .unwrap();
}

/// Redis with keyspace notifications on: acquisitions come with their holder and token, and a
/// lease that runs out without a release is reported as an expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keyspace_notifications_show_acquisitions_and_expiries() {
    let env = Env::redis().await;
    keyspace_events_on(&env).await;
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

/// A release with `hold_at_least` (the scheduled-job pattern) is reported as a release, and the
/// kept key's end is not reported as an expiry, which is a crashed holder's signature (review
/// surfaces.md m6: two `Acquired` and one `Expired`, no `Released`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_watch_reports_a_kept_release_as_a_release_not_an_expiry() {
    let env = Env::redis().await;
    keyspace_events_on(&env).await;
    let admin = env.admin().await;
    let mut w = admin.watch("kept:").await.expect("watch");
    let g = env
        .lock("kept:job")
        .hold_at_least(Duration::from_millis(300))
        .acquire()
        .await
        .unwrap();
    // The watch reads the hash when it hears of a change; a hold this short would be read
    // after its release (a real job runs longer).
    tokio::time::sleep(Duration::from_millis(200)).await;
    g.release().await.unwrap();
    let mut events = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_millis(1500);
    while let Ok(Some(Ok(e))) = tokio::time::timeout_at(deadline, w.events.recv()).await {
        events.push(e);
    }
    let of = |f: fn(&LockEvent) -> bool| events.iter().filter(|e| f(e)).count();
    assert_eq!(
        of(|e| matches!(e, LockEvent::Acquired { .. })),
        1,
        "{events:?}"
    );
    assert_eq!(
        of(|e| matches!(e, LockEvent::Released { .. })),
        1,
        "{events:?}"
    );
    assert_eq!(
        of(|e| matches!(e, LockEvent::Expired { .. })),
        0,
        "{events:?}"
    );
}

/// Keys under `dlock:{` that are not dlock locks (another type at a lock's key, a key the
/// library never writes) are counted as skipped, never listed; force-release does not touch a
/// key of another type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_foreign_keys_are_skipped_not_shown() {
    let env = Env::redis().await;
    let mut con = env.server().admin_async().await;
    let _: () = redis::cmd("SET")
        .arg(dlock::backend::redis_keys("str").lock)
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
        .arg(dlock::backend::redis_keys("str").lock)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(v, "x");
    g.release().await.unwrap();
}

/// Redis keeps the holder identity in one key per process (`dlock:holder:<process>`, expiring
/// after an hour), written beside the first acquisition and then once per 20 minutes: the lock
/// scripts do not change and later acquisitions and renewals send nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_holder_identity_is_written_once_per_process_not_per_call() {
    dlock::set_holder_name(HOLDER_NAME);
    let env = Env::redis().await;
    let calls = |stats: &std::collections::BTreeMap<String, u64>, c: &str| {
        stats.get(c).copied().unwrap_or(0)
    };
    let before = env.server().commandstats();
    let ttl = Duration::from_secs(30);
    let g = env.lock("who:once").ttl(ttl).acquire().await.unwrap();
    let first = env.server().commandstats();
    // The script's fence SET, and the identity's.
    assert_eq!(calls(&first, "set") - calls(&before, "set"), 2);
    for i in 0..20 {
        g.extend(ttl).await.unwrap();
        let again = env
            .lock(&format!("who:more:{i}"))
            .ttl(ttl)
            .acquire()
            .await
            .unwrap();
        again.release().await.unwrap();
    }
    let after = env.server().commandstats();
    // 20 first acquisitions: one fence SET each, no identity SET.
    assert_eq!(calls(&after, "set") - calls(&first, "set"), 20);
    assert_eq!(calls(&after, "evalsha") - calls(&first, "evalsha"), 60);

    let mut con = env.server().admin_async().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("dlock:holder:*")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let owner_process = g.owner().split(':').next().unwrap().to_string();
    assert_eq!(keys[0], format!("dlock:holder:{owner_process}"));
    let (value, left): (String, i64) = redis::pipe()
        .get(&keys[0])
        .ttl(&keys[0])
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(value, dlock::holder_identity().to_string());
    assert!(left > 3500 && left <= 3600, "{left}");
    g.release().await.unwrap();
}

/// What the database admins do beyond the shared suite: the `dlock_table` / `dlock_mode` URL
/// parameters, rows that are not dlock locks, expiries seen by a watch, advisory mode's refusal
/// to end a session that holds other locks, and no password in any error.
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod sql_admin {
    use std::time::Duration;

    use super::SOON;
    use crate::common::{Env, sql::with_param};
    use dlock::admin::{self, Admin, AdminErrorKind, ForceReleased, LockEvent};

    /// Another table of the same database: the admin of the env's table does not see it, and a
    /// table that does not exist is the server's answer, naming it.
    async fn the_url_names_the_table(env: Env) {
        let g = env
            .lock("sql:tbl")
            .ttl(Duration::from_secs(3))
            .acquire()
            .await
            .unwrap();
        let db = env.db();
        let url = with_param(&db.url, &format!("dlock_table={}", db.table));
        let a = admin::connect(&url)
            .await
            .expect("admin on the env's table");
        assert!(a.target().contains(&db.table), "{}", a.target());
        assert!(a.show("sql:tbl").await.unwrap().is_some());
        if let Some(rest) = url.strip_prefix("postgres://") {
            // The registry's other spelling.
            let a2 = admin::connect(&format!("postgresql://{rest}"))
                .await
                .expect("postgresql:// URL");
            assert!(a2.show("sql:tbl").await.unwrap().is_some());
        }
        let missing = format!("{}_missing", db.table);
        let e = admin::connect(&with_param(&db.url, &format!("dlock_table={missing}")))
            .await
            .expect_err("a table that does not exist");
        assert_eq!(e.kind, AdminErrorKind::Server, "{e}");
        assert!(e.message.contains(&missing), "{e}");
        for bad in ["dlock_table=a;b", "dlock_tabel=x", "dlock_mode=redis"] {
            let e = admin::connect(&with_param(&db.url, bad))
                .await
                .expect_err(bad);
            assert_eq!(e.kind, AdminErrorKind::Unsupported, "{bad}: {e}");
        }
        assert!(e.message.contains("dlock_table="), "a hint: {e}");
        // The table as an argument instead of a URL parameter.
        let b: Box<dyn Admin> = match env.kind {
            #[cfg(feature = "postgres")]
            crate::common::Kind::Postgres => Box::new(
                admin::PostgresAdmin::connect_with(&db.url, &db.table, admin::PgMode::Table)
                    .await
                    .unwrap(),
            ),
            #[cfg(feature = "mysql")]
            crate::common::Kind::Mysql => Box::new(
                admin::MysqlAdmin::connect_with(&db.url, &db.table)
                    .await
                    .unwrap(),
            ),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            b.show("sql:tbl").await.unwrap().and_then(|i| i.token),
            Some(g.fencing_token())
        );
        // Without `expected`, a force-release frees whatever holds the name.
        let r = a.force_release("sql:tbl", None).await.unwrap();
        assert!(matches!(r, ForceReleased::Released { .. }), "{r:?}");
        assert!(!env.is_locked("sql:tbl").await);
        tokio::time::timeout(SOON, g.lost()).await.expect("lost()");
    }

    /// A row whose name is not UTF-8 and one with a negative count are counted, never shown.
    async fn foreign_rows_are_skipped(env: Env) {
        let g = env.lock("sql:mine").acquire().await.unwrap();
        insert_foreign_rows(&env).await;
        let a = env.admin().await;
        let l = a.list("").await.expect("list");
        let names: Vec<&str> = l.locks.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["sql:mine"]);
        assert_eq!(l.skipped, 2, "{l:?}");
        // The prefix applies to the bytes: the foreign rows start with 0xff and "sql:bad".
        let l = a.list("sql:").await.expect("list sql:");
        assert_eq!(l.locks.len(), 1);
        assert_eq!(l.skipped, 1);
        let e = a
            .show("sql:bad")
            .await
            .expect_err("a row that is not a lock");
        assert_eq!(e.kind, AdminErrorKind::Server, "{e}");
        g.release().await.unwrap();
    }

    async fn insert_foreign_rows(env: &Env) {
        let t = &env.db().table;
        match env.kind {
            #[cfg(feature = "postgres")]
            crate::common::Kind::Postgres => {
                let c = crate::common::sql::pg_admin(&env.db().url).await;
                c.batch_execute(&format!(
                    "INSERT INTO {t} (name, owner, count, fence, expires_at) VALUES ('\\xff00', 'x', 1, 1, now() + interval '1 hour'); \
                     INSERT INTO {t} (name, owner, count, fence, expires_at) VALUES ('sql:bad', 'x', -1, 1, now() + interval '1 hour');"
                ))
                .await
                .expect("insert foreign rows");
            }
            #[cfg(feature = "mysql")]
            crate::common::Kind::Mysql => {
                use dlock::mysql_async::prelude::Queryable;
                let mut c = crate::common::sql::my_admin(&env.db().url).await;
                c.query_drop(format!(
                    "INSERT INTO {t} (name, owner, count, fence, expires_at) VALUES (X'ff00', 'x', 1, 1, UTC_TIMESTAMP(6) + INTERVAL 1 HOUR); \
                     INSERT INTO {t} (name, owner, count, fence, expires_at) VALUES ('sql:bad', 'x', -1, 1, UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)"
                ))
                .await
                .expect("insert foreign rows");
            }
            other => panic!("no rows to insert for {other:?}"),
        }
    }

    /// A row whose lease runs out without a release (a holder that died): the watch reports
    /// its grant, then its expiry.
    async fn watch_reports_an_expiry(env: Env) {
        let a = env.admin().await;
        let mut w = a.watch("sql:exp").await.expect("watch");
        assert!(w.sees_acquisitions);
        let t = &env.db().table;
        match env.kind {
            #[cfg(feature = "postgres")]
            crate::common::Kind::Postgres => {
                let c = crate::common::sql::pg_admin(&env.db().url).await;
                c.batch_execute(&format!(
                    "INSERT INTO {t} (name, owner, count, fence, expires_at) VALUES ('sql:exp', 'dead-owner', 1, 4242, \
                     clock_timestamp() + interval '600 milliseconds')"
                ))
                .await
                .unwrap();
            }
            #[cfg(feature = "mysql")]
            crate::common::Kind::Mysql => {
                use dlock::mysql_async::prelude::Queryable;
                let mut c = crate::common::sql::my_admin(&env.db().url).await;
                c.query_drop(format!(
                    "INSERT INTO {t} (name, owner, count, fence, expires_at) VALUES ('sql:exp', 'dead-owner', 1, 4242, \
                     UTC_TIMESTAMP(6) + INTERVAL 600000 MICROSECOND)"
                ))
                .await
                .unwrap();
            }
            other => panic!("{other:?}"),
        }
        let mut events = Vec::new();
        while !events
            .iter()
            .any(|e| matches!(e, LockEvent::Expired { .. }))
        {
            match tokio::time::timeout(SOON, w.events.recv()).await {
                Ok(Some(Ok(e))) => events.push(e),
                other => panic!("{other:?}; events so far {events:?}"),
            }
        }
        assert_eq!(
            events,
            [
                LockEvent::Acquired {
                    name: "sql:exp".into(),
                    owner: Some("dead-owner".into()),
                    token: Some(4242)
                },
                LockEvent::Expired {
                    name: "sql:exp".into()
                }
            ]
        );
    }

    /// A force-release wakes a waiter in another process at once, as a release does (NOTIFY on
    /// PostgreSQL, the waiters' 100–250 ms polls on MySQL), not when the holder's 30 s lease
    /// would have ended.
    async fn force_release_hands_over_at_once(env: Env) {
        let a = env.admin().await;
        let holder = env
            .lock("sql:hand")
            .ttl(Duration::from_secs(30))
            .acquire()
            .await
            .unwrap();
        let other = env.another_backend().await;
        let waiter = tokio::spawn(async move {
            dlock::Lock::new("sql:hand")
                .with_backend(other)
                .wait(Duration::from_secs(20))
                .acquire()
                .await
        });
        // The waiter has tried once and is waiting (listening / polling).
        tokio::time::sleep(Duration::from_millis(500)).await;
        let t = tokio::time::Instant::now();
        let r = a.force_release("sql:hand", None).await.unwrap();
        assert!(matches!(r, ForceReleased::Released { .. }), "{r:?}");
        let g = tokio::time::timeout(SOON, waiter)
            .await
            .expect("the waiter was not woken")
            .unwrap()
            .expect("the waiter acquires");
        let took = t.elapsed();
        assert!(
            took < env.handoff_budget() + Duration::from_millis(1000),
            "hand-over after a force-release took {took:?}"
        );
        g.release().await.unwrap();
        drop(holder);
    }

    /// A wrong password, or no server at all: typed errors that do not contain the password.
    async fn no_password_in_errors(env: Env) {
        let db = env.db();
        let secret = "Sup3rSecretPw";
        let (scheme, rest) = db.url.split_once("://").unwrap();
        let host_and_db = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
        let user = rest
            .rsplit_once('@')
            .map_or("root", |(u, _)| u.split(':').next().unwrap_or(u));
        // A closed port: a connection error.
        let db_name = host_and_db.split_once('/').map_or("test", |(_, d)| d);
        let closed = format!(
            "{scheme}://{user}:{secret}@127.0.0.1:{}/{db_name}",
            crate::common::free_port_pub()
        );
        let e = admin::connect(&closed).await.expect_err("nothing listens");
        assert_eq!(e.kind, AdminErrorKind::Connect, "{e}");
        assert!(!e.message.contains(secret), "{e}");
        // The real server with a password it does not expect (refused, or, with trust
        // authentication, accepted), and a table that does not exist.
        let wrong = with_param(
            &format!("{scheme}://{user}:{secret}@{host_and_db}"),
            "dlock_table=no_such_dlock_table",
        );
        let e = admin::connect(&wrong)
            .await
            .expect_err("refused or no table");
        assert!(
            matches!(e.kind, AdminErrorKind::Connect | AdminErrorKind::Server),
            "{e}"
        );
        assert!(!e.message.contains(secret), "{e}");
        assert!(!format!("{e:?}").contains(secret), "{e:?}");
    }

    macro_rules! sql_admin_tests {
        ($($t:ident),* $(,)?) => {
            #[cfg(feature = "postgres")]
            mod on_postgres {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $t() {
                        super::$t(crate::common::Env::postgres().await).await
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

    sql_admin_tests!(
        the_url_names_the_table,
        foreign_rows_are_skipped,
        watch_reports_an_expiry,
        force_release_hands_over_at_once,
        no_password_in_errors,
    );

    /// Advisory mode: `show` finds the session by the lock's key; force-release ends that
    /// session only when it holds nothing else.
    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn advisory_force_release_refuses_to_end_a_session_holding_other_locks() {
        let env = Env::pg_advisory().await;
        let a = admin::PostgresAdmin::connect_with(
            &env.db().url,
            &env.db().table,
            admin::PgMode::Advisory,
        )
        .await
        .expect("advisory admin");
        assert_eq!(a.show("adv:x").await.unwrap(), None);
        let g1 = env
            .lock("adv:x")
            .ttl(Duration::from_secs(3))
            .acquire()
            .await
            .unwrap();
        let g2 = env
            .lock("adv:y")
            .ttl(Duration::from_secs(3))
            .acquire()
            .await
            .unwrap();
        let info = a.show("adv:x").await.unwrap().expect("held");
        let key = dlock::postgres_advisory_key(&env.db().table, "adv:x");
        assert!(
            info.details
                .iter()
                .any(|(k, v)| k == "advisory key" && v.starts_with(&key.to_string())),
            "{:?}",
            info.details
        );
        assert_eq!(info.remaining, None);
        assert!(info.holders[0].owner.starts_with("pg-session:"), "{info:?}");
        let e = a
            .force_release("adv:x", Some(&info))
            .await
            .expect_err("the session holds adv:y too");
        // Refused (CLI exit 4, as the README's engine table says), not "unsupported" (exit 6).
        assert_eq!(e.kind, AdminErrorKind::Refused, "{e}");
        assert!(e.message.contains("pg_terminate_backend"), "{e}");
        // Nothing was done: both still held, both guards still valid after a renewal.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(g1.is_valid() && g2.is_valid());
        assert!(env.is_locked("adv:x").await && env.is_locked("adv:y").await);
        g2.release().await.unwrap();
        // Now the session holds adv:x alone: the force-release ends it.
        let r = a.force_release("adv:x", None).await.unwrap();
        assert!(matches!(r, ForceReleased::Released { .. }), "{r:?}");
        assert!(!env.is_locked("adv:x").await);
        tokio::time::timeout(SOON, g1.lost())
            .await
            .expect("the evicted holder's lost()");
        // The backend opens a new session for its next lock.
        let g3 = env.lock("adv:x").acquire().await.unwrap();
        g3.release().await.unwrap();
    }
}

/// Issue 21: the admin lists and shows semaphores and read-write locks beside the lock of the
/// same name (three things), with each holder's permits or side, token and lease, and evicts one
/// permit holder (the other keeps its permit) and one reader, each hearing `lost()`.
async fn semaphores_and_rw_locks_shown_and_one_holder_evicted(env: Env) {
    use dlock::admin::{HolderRole, LockKind, RwMode};
    let admin = env.admin().await;
    let b = env.backend();
    let sem = |n: u32| {
        dlock::Semaphore::new("adm:k", 3)
            .with_backend(b.clone())
            .permits(n)
            .ttl(Duration::from_secs(20))
    };
    let g1 = sem(2).acquire().await.unwrap();
    let g2 = sem(1).acquire().await.unwrap();
    let r1 = dlock::RwLock::new("adm:k")
        .with_backend(b.clone())
        .ttl(Duration::from_secs(20))
        .read()
        .await
        .unwrap();
    let r2 = dlock::RwLock::new("adm:k")
        .with_backend(b.clone())
        .ttl(Duration::from_secs(20))
        .read()
        .await
        .unwrap();
    let listing = admin.list("adm:").await.expect("list");
    let kinds: Vec<LockKind> = listing.locks.iter().map(|i| i.kind).collect();
    assert_eq!(
        kinds,
        [LockKind::Semaphore, LockKind::RwLock],
        "{listing:?}"
    );
    assert_eq!(admin.show("adm:k").await.expect("show"), None, "no lock");

    let s = admin
        .show_kind("adm:k", LockKind::Semaphore)
        .await
        .unwrap()
        .expect("semaphore held");
    let st = s.semaphore.expect("semaphore state");
    assert_eq!((st.max, st.used, st.free()), (3, 3, 0));
    for g in [&g1, &g2] {
        let h = s.holder(g.owner()).expect("holder shown");
        assert_eq!(h.role, HolderRole::Permits(g.permits()));
        assert_eq!(h.token, Some(g.fencing_token()));
        assert!(h.remaining.is_some_and(|d| d <= Duration::from_secs(20)));
    }
    let r = admin
        .evict("adm:k", LockKind::Semaphore, g1.owner(), Some(&s))
        .await
        .expect("evict");
    assert!(matches!(r, ForceReleased::Released { .. }), "{r:?}");
    tokio::time::timeout(Duration::from_secs(15), g1.lost())
        .await
        .expect("the evicted holder hears it");
    let s = admin
        .show_kind("adm:k", LockKind::Semaphore)
        .await
        .unwrap()
        .expect("still held by the other");
    assert_eq!(s.semaphore.unwrap().used, 1);
    assert_eq!(s.holders.len(), 1);
    assert_eq!(s.holders[0].owner, g2.owner());
    assert!(g2.is_valid());

    let w = admin
        .show_kind("adm:k", LockKind::RwLock)
        .await
        .unwrap()
        .expect("rw held");
    assert_eq!(w.rw.as_ref().unwrap().mode, RwMode::Read);
    let h = w.holder(r1.owner()).expect("reader shown");
    assert_eq!(h.role, HolderRole::Reader);
    assert_eq!(h.token, Some(r1.fencing_token()));
    let r = admin
        .evict("adm:k", LockKind::RwLock, r1.owner(), Some(&w))
        .await
        .expect("evict reader");
    assert!(matches!(r, ForceReleased::Released { .. }), "{r:?}");
    tokio::time::timeout(Duration::from_secs(15), r1.lost())
        .await
        .expect("the evicted reader hears it");
    let w = admin
        .show_kind("adm:k", LockKind::RwLock)
        .await
        .unwrap()
        .expect("the other reader");
    assert_eq!(w.holders.len(), 1);
    assert_eq!(w.holders[0].owner, r2.owner());
    g2.release().await.unwrap();
    r2.release().await.unwrap();
    assert!(admin.list("adm:").await.unwrap().locks.is_empty());
}

mod kinds_on_redis {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn semaphores_and_rw_locks_shown_and_one_holder_evicted() {
        super::semaphores_and_rw_locks_shown_and_one_holder_evicted(
            crate::common::Env::redis().await,
        )
        .await
    }
}

#[cfg(feature = "cluster")]
mod kinds_on_cluster {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn semaphores_and_rw_locks_shown_and_one_holder_evicted() {
        super::semaphores_and_rw_locks_shown_and_one_holder_evicted(
            crate::common::Env::cluster().await,
        )
        .await
    }
}

/// An admin that reads plain locks only (Redlock) answers a semaphore or read-write question
/// with `Unsupported`, and its listing still has the locks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_admin_answers_unsupported_for_semaphores_and_rw_locks() {
    use dlock::admin::LockKind;
    let env = Env::redlock(3).await;
    let admin = env.admin().await;
    let g = Lock::new("adm:rl")
        .with_backend(env.backend())
        .ttl(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    assert_eq!(admin.kinds(), [LockKind::Lock]);
    for kind in [LockKind::Semaphore, LockKind::RwLock] {
        let e = admin
            .show_kind("adm:rl", kind)
            .await
            .expect_err("unsupported");
        assert_eq!(e.kind, AdminErrorKind::Unsupported, "{e}");
        let e = admin
            .evict("adm:rl", kind, "o", None)
            .await
            .expect_err("unsupported");
        assert_eq!(e.kind, AdminErrorKind::Unsupported, "{e}");
    }
    let l = admin.list("adm:").await.unwrap();
    assert_eq!(l.locks.len(), 1);
    g.release().await.unwrap();
}
