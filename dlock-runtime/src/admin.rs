//! The operator's view of a backend: list the held locks, show one, force-release one, watch
//! acquisitions and releases. The `dlock` CLI is a thin layer over this module; an application
//! can use it too (an admin endpoint, a health check that reports stuck locks).
//!
//! Each engine family implements [`Admin`] in its own module under `backend/`; [`connect`]
//! picks one from a URL, as the registry does (`redis://`, `rediss://`, `unix://`,
//! `postgres://`, `mysql://`, `zk://`, `etcd://`, each behind its feature). Redlock, Redis
//! Cluster and Sentinel take several URLs: [`RedlockAdmin::connect`], `ClusterAdmin::connect`
//! (feature `cluster`), `SentinelAdmin::connect` (feature `sentinel`).
//!
//! Every call to a server is bounded (5 s by default, [`CALL_TIMEOUT`]); an error says whether
//! the server could not be reached ([`AdminErrorKind::Connect`]) or answered with an error
//! ([`AdminErrorKind::Server`]), and never contains a password.
//!
//! What an engine can see differs, and [`LockInfo`] says so with `Option`s: a lock table has no
//! waiters to count, a ZooKeeper lease is a session's (no remaining time per lock), an etcd
//! lease is the holder process's (its time left until the next keep-alive is what is shown).

use std::fmt;
use std::time::Duration;

use crate::backend::BoxFuture;

#[cfg(feature = "cluster")]
pub use crate::backend::cluster::admin::ClusterAdmin;
#[cfg(feature = "etcd")]
pub use crate::backend::etcd::admin::EtcdAdmin;
pub use crate::backend::redis::admin::RedisAdmin;
pub use crate::backend::redlock::admin::RedlockAdmin;
#[cfg(feature = "sentinel")]
pub use crate::backend::sentinel::admin::SentinelAdmin;
#[cfg(feature = "mysql")]
pub use crate::backend::sql::admin::MysqlAdmin;
#[cfg(feature = "postgres")]
pub use crate::backend::sql::admin::{PgMode, PostgresAdmin};
#[cfg(feature = "zookeeper")]
pub use crate::backend::zookeeper::admin::ZookeeperAdmin;

/// The bound of each call the admin implementations make to a server.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// One owner of a held lock.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holder {
    /// The owner id (process prefix + task; opaque, as the backend stores it).
    pub owner: String,
    /// Holds of this owner (re-entry counts). `0`: released, but kept taken until its lease
    /// ends (`hold_at_least`).
    pub holds: u32,
}

impl Holder {
    /// A holder with `holds` holds.
    pub fn new(owner: impl Into<String>, holds: u32) -> Holder {
        Holder {
            owner: owner.into(),
            holds,
        }
    }
}

/// What an engine shows of one held lock.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The lock name (as given to `Lock::new`, or rendered from the attribute's key).
    pub name: String,
    /// Who holds it (one owner, except for a name in the middle of a hand-over).
    pub holders: Vec<Holder>,
    /// Time left on the lease; `None` when the engine keeps no per-lock expiry (a session's
    /// lease: ZooKeeper, PostgreSQL advisory locks) or the lock never expires. etcd: the time
    /// left on the lease the holder's process keeps alive (whole seconds; it is renewed every
    /// third of it while the process lives).
    pub remaining: Option<Duration>,
    /// The fencing token of the current hold, when the engine stores it with the lock.
    pub token: Option<u64>,
    /// Waiters the engine can see (Redis: processes subscribed to the release channel;
    /// ZooKeeper and etcd: contenders queued behind the holder); `None`: not visible.
    pub waiters: Option<u64>,
    /// What `waiters` counts, in words (`"processes subscribed"`, `"queued contenders"`).
    pub waiters_are: &'static str,
    /// Engine-specific facts for `show`: keys, znode paths, table rows, per-node state.
    pub details: Vec<(String, String)>,
}

impl LockInfo {
    /// A lock `name` with no holders, lease, token or waiters filled in yet.
    pub fn new(name: impl Into<String>) -> LockInfo {
        LockInfo {
            name: name.into(),
            holders: Vec::new(),
            remaining: None,
            token: None,
            waiters: None,
            waiters_are: "waiters",
            details: Vec::new(),
        }
    }

    /// The sum of every holder's holds.
    pub fn holds(&self) -> u64 {
        self.holders.iter().map(|h| u64::from(h.holds)).sum()
    }
}

/// The held locks whose names start with the prefix asked for.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Listing {
    /// The locks, sorted by name.
    pub locks: Vec<LockInfo>,
    /// Entries in the lock namespace that are not dlock locks (foreign keys, unreadable rows):
    /// counted, never shown or changed.
    pub skipped: usize,
}

impl Listing {
    /// A listing of `locks` (sorted here) with `skipped` foreign entries.
    pub fn new(mut locks: Vec<LockInfo>, skipped: usize) -> Listing {
        locks.sort_by(|a, b| a.name.cmp(&b.name));
        Listing { locks, skipped }
    }
}

/// What a force-release did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForceReleased {
    /// The lock was deleted; `was` is what it held just before. `woke`: how many waiting
    /// processes or contenders the release reached, when the engine can tell.
    Released {
        /// The lock as it was.
        was: Box<LockInfo>,
        /// Wake-ups delivered, when known.
        woke: Option<u64>,
    },
    /// Nothing held that name.
    NotHeld,
    /// The lock changed hands since the caller looked (its fencing token is not the expected
    /// one); nothing was done.
    Changed,
}

/// One event of [`Admin::watch`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LockEvent {
    /// The lock was taken (a first acquisition, not a re-entry).
    Acquired {
        /// The lock name.
        name: String,
        /// The new holder, when the engine's notification names it.
        owner: Option<String>,
        /// Its fencing token, when known.
        token: Option<u64>,
    },
    /// The holder gave the lock back (a waiter is woken).
    Released {
        /// The lock name.
        name: String,
    },
    /// The lease ran out without a release (a crashed or stalled holder), or its session ended.
    Expired {
        /// The lock name.
        name: String,
    },
    /// Another change an operator may care about (a re-entry, a contender queued).
    Other {
        /// The lock name.
        name: String,
        /// What happened.
        what: String,
    },
}

impl LockEvent {
    /// The lock name of the event.
    pub fn name(&self) -> &str {
        match self {
            LockEvent::Acquired { name, .. }
            | LockEvent::Released { name }
            | LockEvent::Expired { name }
            | LockEvent::Other { name, .. } => name,
        }
    }
}

/// A running [`Admin::watch`]: events until the receiver is dropped or an error ends it (the
/// last item is then the error).
#[derive(Debug)]
#[non_exhaustive]
pub struct Watching {
    /// The events.
    pub events: tokio::sync::mpsc::Receiver<Result<LockEvent, AdminError>>,
    /// What this watch can see, in one line (e.g. "releases only: keyspace notifications are
    /// off").
    pub sees: String,
    /// Whether acquisitions are reported ([`LockEvent::Acquired`]); releases always are.
    pub sees_acquisitions: bool,
}

/// The kind of an [`AdminError`]; the CLI's exit code follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AdminErrorKind {
    /// The server could not be reached or did not answer in time (refused, DNS, TLS,
    /// authentication, timeout, dropped connection).
    Connect,
    /// The server answered with an error, or returned something unexpected.
    Server,
    /// The URL or its engine is not supported by this build (a feature is off), or is invalid.
    Unsupported,
}

/// An admin call's error. The message never contains a password.
#[derive(Debug, Clone)]
pub struct AdminError {
    /// What went wrong, broadly.
    pub kind: AdminErrorKind,
    /// What went wrong, in a sentence.
    pub message: String,
}

impl AdminError {
    /// A connection failure.
    pub fn connect(message: impl Into<String>) -> AdminError {
        AdminError {
            kind: AdminErrorKind::Connect,
            message: message.into(),
        }
    }

    /// A server error.
    pub fn server(message: impl Into<String>) -> AdminError {
        AdminError {
            kind: AdminErrorKind::Server,
            message: message.into(),
        }
    }

    /// An unsupported or invalid URL.
    pub fn unsupported(message: impl Into<String>) -> AdminError {
        AdminError {
            kind: AdminErrorKind::Unsupported,
            message: message.into(),
        }
    }
}

impl fmt::Display for AdminError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for AdminError {}

/// Runs `fut` within [`CALL_TIMEOUT`]; a time-out is a [`AdminErrorKind::Connect`] error that
/// says what was being done.
pub(crate) async fn bounded<T>(
    what: &str,
    fut: impl Future<Output = Result<T, AdminError>>,
) -> Result<T, AdminError> {
    match tokio::time::timeout(CALL_TIMEOUT, fut).await {
        Ok(r) => r,
        Err(_) => Err(AdminError::connect(format!(
            "{what}: no answer within {CALL_TIMEOUT:?}"
        ))),
    }
}

/// `message` with every occurrence of `secret` (a password from a URL) replaced by `***`: a
/// last guard for messages built from a client library's errors.
#[cfg(any(feature = "zookeeper", feature = "etcd"))]
pub(crate) fn without_secret(message: String, secret: Option<&str>) -> String {
    match secret {
        Some(s) if !s.is_empty() && message.contains(s) => message.replace(s, "***"),
        _ => message,
    }
}

/// Decodes a path segment that a backend escaped with `escape` (bytes other than ASCII
/// alphanumerics, `-`, `_` and a non-leading `.` as `%XX`): the lock name, or `None` when the
/// segment is not one the backend would write (it must escape back to itself).
#[cfg(any(feature = "zookeeper", feature = "etcd"))]
pub(crate) fn unescape_segment(escaped: &str, escape: fn(&str) -> String) -> Option<String> {
    let b = escaped.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = escaped.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    let s = String::from_utf8(out).ok()?;
    (!s.is_empty() && escape(&s) == escaped).then_some(s)
}

/// The literal start of a shell glob (everything before its first `*`, `?`, `[` or `\`): the
/// prefix an engine can filter on before the caller matches the whole pattern.
pub fn glob_prefix(pattern: &str) -> &str {
    let end = pattern.find(['*', '?', '[', '\\']).unwrap_or(pattern.len());
    &pattern[..end]
}

/// The operator's operations on one backend. Implemented once per engine family.
pub trait Admin: Send + Sync + fmt::Debug {
    /// The engine's name (`"redis"`, `"postgres"`, ...).
    fn engine(&self) -> &'static str;

    /// Where it is connected, without any password.
    fn target(&self) -> String;

    /// The held locks whose names start with `prefix` (`""`: every lock).
    fn list<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Listing, AdminError>>;

    /// One lock; `None` when it is not held.
    fn show<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<LockInfo>, AdminError>>;

    /// Deletes the lock whatever its owner and hold count, and wakes one waiter. With
    /// `expected_token`, only if the current hold still has that fencing token (an engine that
    /// stores no token compares the holders of `show` instead). The evicted holder's `lost()`
    /// fires at its next renewal or, on a session engine, when it next checks its node.
    fn force_release<'a>(
        &'a self,
        name: &'a str,
        expected: Option<&'a LockInfo>,
    ) -> BoxFuture<'a, Result<ForceReleased, AdminError>>;

    /// Acquisitions, releases and expiries of locks whose names start with `prefix`, as they
    /// happen, until the returned receiver is dropped.
    fn watch<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Watching, AdminError>>;
}

/// True when `current` is still the hold `expected` described: the same token when both have
/// one, otherwise the same holders.
pub fn same_hold(expected: &LockInfo, current: &LockInfo) -> bool {
    match (expected.token, current.token) {
        (Some(a), Some(b)) => a == b,
        _ => {
            let mut a: Vec<&str> = expected.holders.iter().map(|h| h.owner.as_str()).collect();
            let mut b: Vec<&str> = current.holders.iter().map(|h| h.owner.as_str()).collect();
            a.sort_unstable();
            b.sort_unstable();
            a == b
        }
    }
}

/// The hold a force-release may act on: `now`, unless nothing is held (`Err(NotHeld)`) or it
/// is no longer the hold `expected` described (`Err(Changed)`, see [`same_hold`]).
pub(crate) fn still_held(
    now: Option<LockInfo>,
    expected: Option<&LockInfo>,
) -> Result<LockInfo, ForceReleased> {
    let now = now.ok_or(ForceReleased::NotHeld)?;
    match expected {
        Some(exp) if !same_hold(exp, &now) => Err(ForceReleased::Changed),
        _ => Ok(now),
    }
}

/// The scheme of a URL, lower-cased (`None` without `://`).
fn scheme_of(url: &str) -> Option<String> {
    url.split_once("://").map(|(s, _)| s.to_ascii_lowercase())
}

/// Connects an [`Admin`] for a URL of any form the registry accepts: `redis://`, `rediss://`
/// (feature `tls`), `unix://`, `redis+unix://`, `postgres://`/`postgresql://` (feature
/// `postgres`), `mysql://` (feature `mysql`), `zk://` (feature `zookeeper`), `etcd://` (feature
/// `etcd`). The connection is checked here. The database URLs take the admin's own query
/// parameters `dlock_table=<table>` (default `dlock_locks`) and, for PostgreSQL,
/// `dlock_mode=table|advisory`, which are taken out before connecting (see `PostgresAdmin`,
/// `MysqlAdmin`). An engine whose feature is off is an
/// [`AdminErrorKind::Unsupported`] error that names the feature.
pub async fn connect(url: &str) -> Result<Box<dyn Admin>, AdminError> {
    let Some(scheme) = scheme_of(url) else {
        return Err(AdminError::unsupported(
            "not a URL (expected scheme://...; e.g. redis://127.0.0.1:6379)",
        ));
    };
    match scheme.as_str() {
        "redis" | "rediss" | "unix" | "redis+unix" => Ok(Box::new(
            crate::backend::redis::admin::RedisAdmin::connect(url).await?,
        )),
        #[cfg(feature = "zookeeper")]
        "zk" => Ok(Box::new(
            crate::backend::zookeeper::admin::ZookeeperAdmin::connect(url).await?,
        )),
        #[cfg(feature = "etcd")]
        "etcd" => Ok(Box::new(
            crate::backend::etcd::admin::EtcdAdmin::connect(url).await?,
        )),
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => Ok(Box::new(
            crate::backend::sql::admin::PostgresAdmin::connect(url).await?,
        )),
        #[cfg(feature = "mysql")]
        "mysql" => Ok(Box::new(
            crate::backend::sql::admin::MysqlAdmin::connect(url).await?,
        )),
        other => {
            let feature = match other {
                "postgres" | "postgresql" => Some("postgres"),
                "mysql" => Some("mysql"),
                "zk" => Some("zookeeper"),
                "etcd" => Some("etcd"),
                _ => None,
            };
            Err(AdminError::unsupported(match feature {
                Some(f) => format!("`{other}://` URLs need dlock's `{f}` feature"),
                None => format!(
                    "`{other}://` is not a dlock backend URL (redis, rediss, unix, postgres, \
                     mysql, zk, etcd)"
                ),
            }))
        }
    }
}

/// A [`Watching`] built by listing the locks under `prefix` every `every` and reporting the
/// differences: a new holder (name or token) is an [`LockEvent::Acquired`], a name gone is a
/// [`LockEvent::Released`] (a release and an expiry look the same from outside). For engines,
/// or server settings, without a change feed; changes shorter than `every` can be missed. The
/// first listing is taken before this returns, so every change after it is seen.
pub async fn poll_watch<A>(admin: A, prefix: &str, every: Duration) -> Result<Watching, AdminError>
where
    A: Admin + 'static,
{
    type Seen = std::collections::BTreeMap<String, Option<u64>>;
    fn snapshot(l: Listing) -> (Seen, Vec<LockInfo>) {
        let seen = l.locks.iter().map(|i| (i.name.clone(), i.token)).collect();
        (seen, l.locks)
    }
    let (mut known, _) = snapshot(admin.list(prefix).await?);
    let (tx, rx) = tokio::sync::mpsc::channel(1024);
    let prefix = prefix.to_string();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = tx.closed() => return,
            }
            let listing = tokio::select! {
                l = admin.list(&prefix) => l,
                _ = tx.closed() => return,
            };
            let (now, locks) = match listing {
                Ok(l) => snapshot(l),
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            };
            let mut events = Vec::new();
            for name in known.keys() {
                if !now.contains_key(name) {
                    events.push(LockEvent::Released { name: name.clone() });
                }
            }
            for l in locks {
                match known.get(&l.name) {
                    Some(t) if *t == l.token => continue,
                    // Another hold since the last look: the old one was released.
                    Some(_) => events.push(LockEvent::Released {
                        name: l.name.clone(),
                    }),
                    None => {}
                }
                events.push(LockEvent::Acquired {
                    owner: l.holders.first().map(|h| h.owner.clone()),
                    token: l.token,
                    name: l.name,
                });
            }
            known = now;
            for e in events {
                if tx.send(Ok(e)).await.is_err() {
                    return;
                }
            }
        }
    });
    Ok(Watching {
        events: rx,
        sees: format!(
            "acquisitions and releases by listing every {} ms (a hold shorter than that can be \
             missed; an expiry shows as a release)",
            every.as_millis()
        ),
        sees_acquisitions: true,
    })
}
