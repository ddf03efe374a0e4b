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

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use crate::backend::BoxFuture;
pub use crate::holder::HolderId;

#[cfg(feature = "cluster")]
#[cfg_attr(docsrs, doc(cfg(feature = "cluster")))]
pub use crate::backend::cluster::admin::ClusterAdmin;
#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub use crate::backend::etcd::admin::EtcdAdmin;
pub use crate::backend::redis::admin::RedisAdmin;
pub use crate::backend::redlock::admin::RedlockAdmin;
#[cfg(feature = "sentinel")]
#[cfg_attr(docsrs, doc(cfg(feature = "sentinel")))]
pub use crate::backend::sentinel::admin::SentinelAdmin;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use crate::backend::sql::admin::MysqlAdmin;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use crate::backend::sql::admin::{PgMode, PostgresAdmin};
#[cfg(feature = "zookeeper")]
#[cfg_attr(docsrs, doc(cfg(feature = "zookeeper")))]
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
    /// Who the owner is: its process's name, host and pid (see [`crate::set_holder_name`]);
    /// `None` when the store has none for it (a holder of an older version, an identity that
    /// expired, an engine that keeps none).
    pub identity: Option<HolderId>,
    /// What this owner holds: the lock, permits of a semaphore, or one side of a read-write
    /// lock.
    pub role: HolderRole,
    /// The fencing token of this owner's grant, when the engine stores one per holder
    /// (semaphores and read-write locks; a plain lock's is [`LockInfo::token`]).
    pub token: Option<u64>,
    /// Time left on this owner's own lease, when each holder has one (semaphores and
    /// read-write locks; a plain lock's is [`LockInfo::remaining`]).
    pub remaining: Option<Duration>,
}

/// What a [`Holder`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HolderRole {
    /// A plain lock (`holds` counts its re-entries).
    Lock,
    /// This many permits of a semaphore (`holds` is 1: permits are not re-entered).
    Permits(u32),
    /// A read hold of a read-write lock (`holds` counts its re-entries).
    Reader,
    /// The write hold of a read-write lock (`holds` counts its re-entries).
    Writer,
}

impl HolderRole {
    /// `"lock"`, `"permits"`, `"read"`, `"write"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            HolderRole::Lock => "lock",
            HolderRole::Permits(_) => "permits",
            HolderRole::Reader => "read",
            HolderRole::Writer => "write",
        }
    }
}

/// What a name is held as. A lock, a semaphore and a read-write lock of the same name are three
/// different things (their keys or rows never meet), so a name may be listed once per kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum LockKind {
    /// A [`crate::Lock`] (also an election's term).
    Lock,
    /// A [`crate::Semaphore`].
    Semaphore,
    /// A [`crate::RwLock`].
    RwLock,
}

impl LockKind {
    /// Every kind, in listing order.
    pub const ALL: [LockKind; 3] = [LockKind::Lock, LockKind::Semaphore, LockKind::RwLock];

    /// `"lock"`, `"semaphore"`, `"rwlock"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            LockKind::Lock => "lock",
            LockKind::Semaphore => "semaphore",
            LockKind::RwLock => "rwlock",
        }
    }

    /// The kind a word names (`lock`, `semaphore`/`sem`, `rwlock`/`rw`).
    pub fn parse(s: &str) -> Option<LockKind> {
        match s.to_ascii_lowercase().as_str() {
            "lock" => Some(LockKind::Lock),
            "semaphore" | "sem" => Some(LockKind::Semaphore),
            "rwlock" | "rw" => Some(LockKind::RwLock),
            _ => None,
        }
    }
}

impl fmt::Display for LockKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A semaphore's limit and use (its holders are [`LockInfo::holders`], each with
/// [`HolderRole::Permits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SemaphoreState {
    /// The `max` the name was created with.
    pub max: u32,
    /// Permits held by live holders (leases not ended by the server's clock).
    pub used: u32,
}

impl SemaphoreState {
    /// Permits free now (`max - used`).
    pub fn free(&self) -> u32 {
        self.max.saturating_sub(self.used)
    }
}

/// The mode of a read-write lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RwMode {
    /// No live hold (only a waiting writer's marker is left).
    Free,
    /// Held by one or more readers.
    Read,
    /// Held by one writer.
    Write,
}

impl RwMode {
    /// `"free"`, `"read"`, `"write"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            RwMode::Free => "free",
            RwMode::Read => "read",
            RwMode::Write => "write",
        }
    }
}

/// A read-write lock's mode and its waiting writer (its holders are [`LockInfo::holders`], each
/// with [`HolderRole::Reader`] or [`HolderRole::Writer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RwState {
    /// Free, read or write.
    pub mode: RwMode,
    /// The writer whose waiting marker stops new readers (writer preference): its owner, with
    /// the time left on its marker's lease (it renews it while it waits).
    pub waiting_writer: Option<Holder>,
}

impl Holder {
    /// A holder with `holds` holds and no identity.
    pub fn new(owner: impl Into<String>, holds: u32) -> Holder {
        Holder {
            owner: owner.into(),
            holds,
            identity: None,
            role: HolderRole::Lock,
            token: None,
            remaining: None,
        }
    }

    /// This holder with its identity parsed from the stored `name@host:pid` (`None`, or a value
    /// that does not parse, leaves it unknown).
    pub fn with_identity_text(mut self, stored: Option<&str>) -> Holder {
        self.identity = stored.and_then(HolderId::parse);
        self
    }
}

/// What an engine shows of one held lock.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The lock name (as given to `Lock::new`, `Semaphore::new`, `RwLock::new`, or rendered
    /// from the attribute's key).
    pub name: String,
    /// A lock, a semaphore or a read-write lock.
    pub kind: LockKind,
    /// A semaphore's `max` and permits in use (`kind` is [`LockKind::Semaphore`]).
    pub semaphore: Option<SemaphoreState>,
    /// A read-write lock's mode and waiting writer (`kind` is [`LockKind::RwLock`]).
    pub rw: Option<RwState>,
    /// Who holds it (one owner, except for a name in the middle of a hand-over).
    pub holders: Vec<Holder>,
    /// Time left on the lease (a semaphore or read-write lock: the longest lease of its holders
    /// and waiting writer, when the name is free at the latest); `None` when the engine keeps
    /// no per-lock expiry (a session's
    /// lease: ZooKeeper, PostgreSQL advisory locks) or the lock never expires. etcd: the time
    /// left on the lease the holder's process keeps alive (whole seconds; it is renewed every
    /// third of it while the process lives).
    pub remaining: Option<Duration>,
    /// The fencing token of the current hold, when the engine stores it with the lock (a
    /// read-write lock: its writer's; a semaphore: none, see each holder's).
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
            kind: LockKind::Lock,
            semaphore: None,
            rw: None,
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

    /// The holder with owner id `owner`.
    pub fn holder(&self, owner: &str) -> Option<&Holder> {
        self.holders.iter().find(|h| h.owner == owner)
    }
}

/// The held locks whose names start with the prefix asked for.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Listing {
    /// The locks, sorted by name, then kind (lock, semaphore, read-write lock).
    pub locks: Vec<LockInfo>,
    /// Entries in the lock namespace that are not dlock locks (foreign keys, unreadable rows):
    /// counted, never shown or changed.
    pub skipped: usize,
}

impl Listing {
    /// A listing of `locks` (sorted here) with `skipped` foreign entries.
    pub fn new(mut locks: Vec<LockInfo>, skipped: usize) -> Listing {
        locks.sort_by(|a, b| a.name.cmp(&b.name).then(a.kind.cmp(&b.kind)));
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
    /// The operation was refused because doing it would harm more than the named lock (e.g.
    /// freeing a PostgreSQL advisory lock whose session holds others). Nothing was done.
    Refused,
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

    /// A refused operation (nothing was done).
    pub fn refused(message: impl Into<String>) -> AdminError {
        AdminError {
            kind: AdminErrorKind::Refused,
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
    /// happen, until the returned receiver is dropped. Plain locks only: semaphores and
    /// read-write locks are not watched (list or show them).
    fn watch<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Watching, AdminError>>;

    /// The kinds [`Admin::list`] includes and [`Admin::show_kind`] reads on this engine
    /// (every engine: plain locks; the Redis family: semaphores and read-write locks too).
    fn kinds(&self) -> &'static [LockKind] {
        &[LockKind::Lock]
    }

    /// The name `name` held as `kind`; `None` when it is not held as that. A kind this engine's
    /// admin cannot read is an [`AdminErrorKind::Unsupported`] error.
    fn show_kind<'a>(
        &'a self,
        name: &'a str,
        kind: LockKind,
    ) -> BoxFuture<'a, Result<Option<LockInfo>, AdminError>> {
        match kind {
            LockKind::Lock => self.show(name),
            other => {
                let e = unsupported_kind(self.engine(), other);
                Box::pin(async move { Err(e) })
            }
        }
    }

    /// Evicts one holder of a semaphore (all its permits) or of a read-write lock (its read or
    /// write hold, with every re-entry) exactly as that owner's own full release would: the
    /// same owner-checked server call, which wakes as many waiters as it frees. With
    /// `expected`, only if that owner's hold is still the one `expected` shows (see
    /// [`same_holder`]); otherwise [`ForceReleased::Changed`] and nothing is done. The other
    /// holders keep theirs. The evicted owner's `lost()` fires at its next renewal. An engine
    /// (or a kind: a plain lock has one owner, use [`Admin::force_release`]) without it is an
    /// [`AdminErrorKind::Unsupported`] error.
    fn evict<'a>(
        &'a self,
        name: &'a str,
        kind: LockKind,
        owner: &'a str,
        expected: Option<&'a LockInfo>,
    ) -> BoxFuture<'a, Result<ForceReleased, AdminError>> {
        let _ = (name, owner, expected);
        let e = match kind {
            LockKind::Lock => AdminError::unsupported(
                "a plain lock has one owner: force-release the lock (no --owner)",
            ),
            other => unsupported_kind(self.engine(), other),
        };
        Box::pin(async move { Err(e) })
    }
}

/// The error of an engine whose admin cannot read or evict `kind`.
pub fn unsupported_kind(engine: &str, kind: LockKind) -> AdminError {
    AdminError::unsupported(format!(
        "the {engine} admin does not read {kind}s (plain locks only); semaphores and read-write \
         locks are shown on Redis, Sentinel and Redis Cluster"
    ))
}

/// True when `current` is still the hold of one owner that `expected` described: the same role
/// (lock, as many permits, read or write side) and the same token when both have one, otherwise
/// the same hold count.
pub fn same_holder(expected: &Holder, current: &Holder) -> bool {
    expected.owner == current.owner
        && expected.role == current.role
        && match (expected.token, current.token) {
            (Some(a), Some(b)) => a == b,
            _ => expected.holds == current.holds,
        }
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
/// `postgres`), `mysql://` (feature `mysql`), `zk://` and `zks://` (feature `zookeeper`; `zks://`
/// also `tls`), `etcd://` (feature `etcd`). The connection is checked here. The database URLs take the admin's own query
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
        "zk" | "zks" => Ok(Box::new(
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
                "zk" | "zks" => Some("zookeeper"),
                "etcd" => Some("etcd"),
                _ => None,
            };
            Err(AdminError::unsupported(match feature {
                Some(f) => format!("`{other}://` URLs need dlock's `{f}` feature"),
                None => format!(
                    "`{other}://` is not a dlock backend URL (redis, rediss, unix, postgres, \
                     mysql, zk, zks, etcd)"
                ),
            }))
        }
    }
}

/// One lock as a polling watch saw it at one read.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    /// Its fencing token (0 where the engine keeps none).
    pub(crate) token: u64,
    /// Its hold count (0: released but kept, or free).
    pub(crate) holds: i64,
    /// Its lease had not ended at the read.
    pub(crate) live: bool,
    /// When its lease would end, by this process's clock at the read plus the time left.
    pub(crate) ends: tokio::time::Instant,
    pub(crate) owner: Option<String>,
}

/// The locks one read saw, by name.
pub(crate) type Snapshot = HashMap<String, Seen>;

/// A snapshot of the locks a listing shows (all live).
fn snapshot_of(l: &Listing) -> Snapshot {
    let at = tokio::time::Instant::now();
    l.locks
        .iter()
        // Semaphores and read-write locks are not watched (their names may be a lock's too).
        .filter(|i| i.kind == LockKind::Lock)
        .map(|i| {
            (
                i.name.clone(),
                Seen {
                    token: i.token.unwrap_or(0),
                    holds: i.holds() as i64,
                    live: true,
                    // No known end: a lock that is gone was released, not expired.
                    ends: at + i.remaining.unwrap_or(Duration::from_secs(86_400)),
                    owner: i.holders.first().map(|h| h.owner.clone()),
                },
            )
        })
        .collect()
}

/// The events between two reads. `notified`: names whose release was announced (PostgreSQL
/// `NOTIFY`) since the last read. A live hold that is gone (or replaced) ended by a release
/// when it was announced or went before its lease's end, else its lease ran out.
pub(crate) fn changes(
    before: &Snapshot,
    after: &Snapshot,
    notified: &std::collections::HashSet<String>,
) -> Vec<LockEvent> {
    let now = tokio::time::Instant::now();
    let mut names: Vec<&String> = before.keys().chain(after.keys()).collect();
    names.sort();
    names.dedup();
    let mut out = Vec::new();
    let ended = |name: &str, prev: &Seen| {
        if notified.contains(name) || now < prev.ends {
            LockEvent::Released { name: name.into() }
        } else {
            LockEvent::Expired { name: name.into() }
        }
    };
    // A row read after its lease ended: given back (no holds left) or run out.
    let not_live = |name: &str, n: &Seen| {
        if n.holds == 0 {
            LockEvent::Released { name: name.into() }
        } else {
            LockEvent::Expired { name: name.into() }
        }
    };
    for name in names {
        match (before.get(name), after.get(name)) {
            (Some(p), None) => {
                if p.live {
                    out.push(ended(name, p));
                }
            }
            (None, None) => {}
            (p, Some(n)) => {
                if p.is_none_or(|p| p.token != n.token) {
                    if let Some(p) = p.filter(|p| p.live) {
                        out.push(ended(name, p));
                    }
                    out.push(LockEvent::Acquired {
                        name: name.clone(),
                        owner: n.owner.clone(),
                        token: (n.token != 0).then_some(n.token),
                    });
                    if !n.live {
                        out.push(not_live(name, n));
                    }
                } else if let Some(p) = p {
                    if p.live && !n.live {
                        out.push(not_live(name, n));
                    } else if p.live && n.live && p.holds != n.holds {
                        out.push(LockEvent::Other {
                            name: name.clone(),
                            what: format!("hold count {} -> {}", p.holds, n.holds),
                        });
                    }
                }
            }
        }
    }
    out
}

/// A poll-driven watch task: reads `read(prefix)` every `every` (sooner when `wake` delivers
/// announced release names) and sends the [`changes`] since the previous read, starting from
/// `before`. Ends when the receiver is dropped, on a read error, or when `alive`'s task
/// completes (a dropped listening connection: its error is the last item).
pub(crate) fn spawn_poll_watch<R, F>(
    prefix: String,
    mut before: Snapshot,
    every: Duration,
    read: R,
    mut wake: Option<tokio::sync::mpsc::UnboundedReceiver<String>>,
    mut alive: Option<(tokio::task::JoinHandle<()>, AdminError)>,
) -> tokio::sync::mpsc::Receiver<Result<LockEvent, AdminError>>
where
    R: Fn(String) -> F + Send + 'static,
    F: Future<Output = Result<Snapshot, AdminError>> + Send,
{
    let (tx, rx) = tokio::sync::mpsc::channel(1024);
    tokio::spawn(async move {
        loop {
            let mut notified = std::collections::HashSet::new();
            tokio::select! {
                _ = tx.closed() => return,
                _ = async { match alive.as_mut() { Some((h, _)) => { let _ = h.await; } None => std::future::pending().await } } => {
                    if let Some((_, lost)) = alive.take() {
                        let _ = tx.send(Err(lost)).await;
                    }
                    return;
                }
                n = async { match wake.as_mut() { Some(w) => w.recv().await, None => std::future::pending().await } } => {
                    if let Some(n) = n {
                        notified.insert(n);
                    }
                }
                _ = tokio::time::sleep(every) => {}
            }
            if let Some(w) = wake.as_mut() {
                while let Ok(n) = w.try_recv() {
                    notified.insert(n);
                }
            }
            let after = tokio::select! {
                r = read(prefix.clone()) => match r {
                    Ok(a) => a,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                },
                _ = tx.closed() => return,
            };
            for ev in changes(&before, &after, &notified) {
                if tx.send(Ok(ev)).await.is_err() {
                    return;
                }
            }
            before = after;
        }
    });
    rx
}

/// A [`Watching`] built by listing the locks under `prefix` every `every` and reporting the
/// differences as the lock tables' watch does: a new holder is an [`LockEvent::Acquired`], a
/// lock gone before its lease's end a [`LockEvent::Released`], after it an
/// [`LockEvent::Expired`]. For engines,
/// or server settings, without a change feed; a hold shorter than `every` can be missed. The
/// first listing is taken before this returns, so every change after it is seen.
pub async fn poll_watch<A>(admin: A, prefix: &str, every: Duration) -> Result<Watching, AdminError>
where
    A: Admin + Clone + 'static,
{
    let before = snapshot_of(&admin.list(prefix).await?);
    let read = move |p: String| {
        let admin = admin.clone();
        async move { admin.list(&p).await.map(|l| snapshot_of(&l)) }
    };
    let events = spawn_poll_watch(prefix.to_string(), before, every, read, None, None);
    Ok(Watching {
        events,
        sees: format!(
            "acquisitions, releases and expiries by listing every {} ms (a hold shorter than \
             that can be missed; a lock gone after its lease's end shows as an expiry)",
            every.as_millis()
        ),
        sees_acquisitions: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(token: u64, holds: i64, live: bool, ends_in_ms: u64) -> Seen {
        Seen {
            token,
            holds,
            live,
            ends: tokio::time::Instant::now() + Duration::from_millis(ends_in_ms),
            owner: Some("o".into()),
        }
    }

    #[test]
    fn changes_between_two_reads() {
        let none = std::collections::HashSet::new();
        let m = |v: Vec<(&str, Seen)>| {
            v.into_iter()
                .map(|(k, s)| (k.to_string(), s))
                .collect::<Snapshot>()
        };
        // Taken and given back between two reads: both, in order.
        let ev = changes(&m(vec![]), &m(vec![("a", seen(7, 0, false, 0))]), &none);
        assert_eq!(
            ev,
            [
                LockEvent::Acquired {
                    name: "a".into(),
                    owner: Some("o".into()),
                    token: Some(7)
                },
                LockEvent::Released { name: "a".into() }
            ]
        );
        // A free row seen before and unchanged: nothing.
        let b = m(vec![("a", seen(7, 0, false, 0))]);
        assert!(changes(&b, &b, &none).is_empty());
        // Held, then its lease ran out (count still 1).
        let ev = changes(
            &m(vec![("a", seen(7, 1, true, 0))]),
            &m(vec![("a", seen(7, 1, false, 0))]),
            &none,
        );
        assert_eq!(ev, [LockEvent::Expired { name: "a".into() }]);
        // A hand-over well before the lease's end: a release, then the new grant.
        let ev = changes(
            &m(vec![("a", seen(7, 1, true, 10_000))]),
            &m(vec![("a", seen(9, 1, true, 10_000))]),
            &none,
        );
        assert!(matches!(ev[0], LockEvent::Released { .. }), "{ev:?}");
        assert!(
            matches!(ev[1], LockEvent::Acquired { token: Some(9), .. }),
            "{ev:?}"
        );
        // A takeover after the lease ended, not announced: an expiry.
        let ev = changes(
            &m(vec![("a", seen(7, 1, true, 0))]),
            &m(vec![("a", seen(9, 1, true, 10_000))]),
            &none,
        );
        assert!(matches!(ev[0], LockEvent::Expired { .. }), "{ev:?}");
        // Re-entry.
        let ev = changes(
            &m(vec![("a", seen(7, 1, true, 10_000))]),
            &m(vec![("a", seen(7, 2, true, 10_000))]),
            &none,
        );
        assert!(matches!(ev[0], LockEvent::Other { .. }), "{ev:?}");
    }

    /// A listing's snapshot: a lock gone with time left on its lease was released; one whose
    /// lease had ended, expired; a new token on the same name is a hand-over.
    #[tokio::test]
    async fn listing_snapshots_tell_releases_from_expiries() {
        let none = std::collections::HashSet::new();
        let mut a = LockInfo::new("a");
        a.holders = vec![Holder::new("o", 1)];
        a.token = Some(7);
        a.remaining = Some(Duration::from_secs(10));
        let mut b = a.clone();
        b.name = "b".into();
        b.remaining = Some(Duration::ZERO);
        let before = snapshot_of(&Listing::new(vec![a.clone(), b], 0));
        let mut a2 = a.clone();
        a2.token = Some(9);
        let after = snapshot_of(&Listing::new(vec![a2], 0));
        let ev = changes(&before, &after, &none);
        assert_eq!(
            ev,
            [
                LockEvent::Released { name: "a".into() },
                LockEvent::Acquired {
                    name: "a".into(),
                    owner: Some("o".into()),
                    token: Some(9)
                },
                LockEvent::Expired { name: "b".into() },
            ]
        );
    }
}
