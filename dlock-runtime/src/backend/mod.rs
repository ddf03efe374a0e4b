//! For those who write a backend (a lock store of their own): the [`Backend`] trait and the
//! types its methods take and return.
//!
//! Applications do not need this module: they name a backend by the URL given to
//! [`crate::init`] (or register a built one with [`crate::register`]) and take locks with the
//! attribute or [`crate::Lock`]. The guard, the watchdog, the waiting loop and the macro only
//! ever talk to a [`Backend`], so they never know which store holds the lock.
//!
//! * [`Backend`] (also at the crate root) with its results [`Acquired`], [`Released`] and
//!   [`Extended`], returned as a [`BoxFuture`];
//! * [`WaitQueues`] and [`Watch`]: the per-name FIFO of local waiters that a backend's
//!   [`Backend::watch`] hands out and its release notifications wake;
//! * [`redis_keys`] and [`RedisKeys`]: how a lock name maps to the Redis keys and channel that
//!   the built-in Redis engines use (for tools that read them).
//!
//! A minimal backend over [`crate::MemoryBackend`] (the shape of the crate's
//! `tests/custom_backend.rs`): it forwards every call and counts the grants.
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use std::time::Duration;
//! # use dlock_runtime as dlock;
//! use dlock::backend::{Acquired, Backend, BoxFuture, Extended, Released, Watch};
//! use dlock::{LockError, MemoryBackend};
//!
//! #[derive(Debug, Default)]
//! struct Counting {
//!     inner: MemoryBackend,
//!     grants: AtomicU64,
//! }
//!
//! impl Backend for Counting {
//!     fn try_acquire<'a>(
//!         &'a self,
//!         name: &'a str,
//!         owner: &'a str,
//!         ttl: Duration,
//!     ) -> BoxFuture<'a, Result<Acquired, LockError>> {
//!         Box::pin(async move {
//!             let r = self.inner.try_acquire(name, owner, ttl).await?;
//!             if let Acquired::Granted { .. } = r {
//!                 self.grants.fetch_add(1, Ordering::Relaxed);
//!             }
//!             Ok(r)
//!         })
//!     }
//!     fn release<'a>(
//!         &'a self,
//!         name: &'a str,
//!         owner: &'a str,
//!         keep_for: Option<Duration>,
//!         all: bool,
//!     ) -> BoxFuture<'a, Result<Released, LockError>> {
//!         self.inner.release(name, owner, keep_for, all)
//!     }
//!     fn extend<'a>(
//!         &'a self,
//!         name: &'a str,
//!         owner: &'a str,
//!         ttl: Duration,
//!     ) -> BoxFuture<'a, Result<Extended, LockError>> {
//!         self.inner.extend(name, owner, ttl)
//!     }
//!     fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
//!         self.inner.watch(name)
//!     }
//!     fn has_waiters(&self, name: &str) -> bool {
//!         self.inner.has_waiters(name)
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), LockError> {
//! let backend = Arc::new(Counting::default());
//! let guard = dlock::Lock::new("job:nightly").with_backend(backend.clone()).acquire().await?;
//! guard.release().await?;
//! assert_eq!(backend.grants.load(Ordering::Relaxed), 1);
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::LockError;

#[cfg(feature = "cluster")]
pub(crate) mod cluster;
#[cfg(any(feature = "etcd", feature = "zookeeper"))]
pub(crate) mod driver;
#[cfg(feature = "etcd")]
pub(crate) mod etcd;
pub(crate) mod memory;
pub(crate) mod redis;
pub(crate) mod redlock;
#[cfg(feature = "sentinel")]
pub(crate) mod sentinel;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod sql;
#[cfg(feature = "zookeeper")]
pub(crate) mod zookeeper;

#[cfg(any(feature = "etcd", feature = "zookeeper"))]
/// Percent-decodes one part of a URL's user information (`%2F` for `/`, `%40` for `@`, `%3A`
/// for `:`). Never shows the value in its error.
pub(crate) fn url_decode(part: &str, what: &str) -> Result<String, LockError> {
    percent_encoding::percent_decode_str(part)
        .decode_utf8()
        .map(|c| c.into_owned())
        .map_err(|_| LockError::Config(format!("the URL's {what} is not UTF-8 once decoded")))
}

/// A boxed, sendable future, as the [`Backend`] methods return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a try-acquire found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquired {
    /// The caller holds the lock now.
    Granted {
        /// The fencing token of this hold (for a re-entry, the token of the outermost hold).
        token: u64,
        /// The hold count after this acquisition (1 for a first acquisition).
        count: u32,
    },
    /// Another owner holds it.
    Busy {
        /// Time until the holder's lease ends, when known.
        remaining: Option<Duration>,
    },
}

/// What a release did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// The hold count reached zero: the lock is free (or kept until `keep_for` ran out).
    Freed,
    /// A re-entrant hold was given back; this many holds remain.
    Decremented(u32),
    /// The caller was not the owner: nothing was changed.
    NotOwner,
}

/// What an extend did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extended {
    /// The lease now ends `ttl` after the request was handled.
    Extended,
    /// The caller is no longer the owner.
    Lost,
}

/// A store of leases with owner-checked, re-entrant semantics.
///
/// Implementations must make `try_acquire`, `release` and `extend` atomic per lock name.
/// `owner` strings are opaque; `name` has been validated (non-empty, at most 1024 bytes).
pub trait Backend: Send + Sync + fmt::Debug + 'static {
    /// Takes the lock for `owner` for `ttl`, or re-enters it when `owner` already holds it
    /// (hold count + 1, lease at least `ttl`). A first acquisition mints a fencing token larger
    /// than every token handed out before for this name.
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>>;

    /// Gives back one hold of `owner`, or all of them with `all` (the outermost guard of a call
    /// chain). At zero holds the lock is deleted and one waiter is woken; with `keep_for`, the
    /// lock instead stays taken until `keep_for` has passed and no wake-up is sent.
    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>>;

    /// Sets the lease of `owner`'s hold to `ttl` from now, if `owner` still holds it.
    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>>;

    /// Registers the caller as a waiter for `name`'s next release. The returned [`Watch`] is
    /// subscribed before this future completes, so a release after that is never missed.
    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>>;

    /// True when other callers in this process already wait for `name`; a new waiter then queues
    /// behind them instead of barging in.
    fn has_waiters(&self, name: &str) -> bool;

    /// How much of a lease of `ttl` the guard must not count on: its local deadline after a
    /// confirmed acquire or renewal is `send time + ttl - lease_margin(ttl)`. Zero by default
    /// (one server's lease); the Redlock backend returns its clock-drift allowance, so that the
    /// guard's deadline is the Redlock validity `ttl - elapsed - drift` measured from the send time.
    fn lease_margin(&self, ttl: Duration) -> Duration {
        let _ = ttl;
        Duration::ZERO
    }

    /// True when a failed try leaves the caller queued on the server (ZooKeeper's sequential
    /// nodes): a wait that ends without a grant (busy, deadline, dropped future) then calls
    /// `release(name, owner, None, true)` so the queued contender is removed. Default: false.
    fn queues_contenders(&self) -> bool {
        false
    }

    /// A try of a fair lock ([`crate::Lock::fair`]): as [`Backend::try_acquire`], but waiters are
    /// served in arrival order across processes. A busy answer leaves `owner` queued on the
    /// store (at the back on its first try, in its place on later ones) with a heartbeat lease
    /// of `heartbeat` from this try, judged by the store's clock; a grant goes only to the
    /// queue's first live owner, or to anyone while nobody live is queued. A queued owner whose
    /// heartbeat ran out (its process died, its tries stopped) is dropped from the queue by the
    /// next try or release. The runtime tries again within `heartbeat / 2` while it waits, and
    /// ends a wait that ends without a grant (deadline, dropped future) with
    /// `release(name, owner, None, true)`, which must also remove `owner` from the queue.
    /// A re-entry (the caller holds the name) is granted as by `try_acquire`.
    ///
    /// Default: the plain try when the backend already queues every contender in arrival order
    /// ([`Backend::queues_contenders`]: ZooKeeper, etcd), else [`LockError::Unsupported`].
    fn try_acquire_fair<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
        heartbeat: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        let _ = heartbeat;
        if self.queues_contenders() {
            return self.try_acquire(name, owner, ttl);
        }
        Box::pin(async move { Err(LockError::unsupported(name, "fair locks")) })
    }

    /// True when [`Backend::try_acquire_fair`] serves waiters in arrival order on this backend
    /// (as configured) instead of answering [`LockError::Unsupported`]. An election campaigns
    /// fairly where this is true. Default: [`Backend::queues_contenders`], as the default
    /// `try_acquire_fair`.
    fn supports_fair(&self) -> bool {
        self.queues_contenders()
    }

    /// True when a try that was not granted can leave a release of its owner id still to run on
    /// the server after the try answered (Redlock: the clean-up of the nodes a busy try took
    /// runs in the background, its retries too, and one that timed out may be delivered late).
    /// The runtime then sends every try under an owner id of its own, also after a busy answer,
    /// so that such a release can only ever meet the grants of the try it cleans up, never a
    /// later try's. Default: false (a busy try leaves nothing behind, and the next try keeps the
    /// owner id; a backend that queues contenders needs it kept).
    fn fresh_owner_per_try(&self) -> bool {
        false
    }

    /// True when a hold that nobody renews ends by itself once its ttl has run out on the server
    /// (Redis, the lock tables, memory). False when the backend keeps the hold alive on its own
    /// (a ZooKeeper session, an etcd lease shared with other holds, a PostgreSQL advisory
    /// session): the runtime then gives such a hold back itself once its guard is lost or its
    /// `max_hold` is reached, since nothing else would ever free it. Default: true.
    fn lease_expires_by_ttl(&self) -> bool {
        true
    }

    /// A future that completes when the backend learns, without being asked, that `owner`'s
    /// hold of `name` is gone (ZooKeeper: the session that holds it expired or was closed). The
    /// guard then marks the hold lost at once ([`crate::LostReason::NotOwner`]) instead of at
    /// its next renewal or its deadline. Called once per outermost hold, right after the grant.
    /// Default: `None` (no such signal).
    fn lost_signal(&self, name: &str, owner: &str) -> Option<BoxFuture<'static, ()>> {
        let _ = (name, owner);
        None
    }

    // ---------------------------------------------------------------------------------------
    // Semaphores (`crate::Semaphore`): owned, expiring permits. A backend that does not
    // implement these answers `LockError::Unsupported` at first use. The runtime drives them
    // through the same guard, watchdog, give-back and wait loop as a lock's hold, with one fresh
    // owner id per acquisition (a permit never re-enters). A semaphore's state must never share
    // a key, a row or a wait queue with a lock of the same name.
    // ---------------------------------------------------------------------------------------

    /// Takes `permits` of the semaphore `name` (at most `max` permits held at once by all its
    /// owners) for `owner` for `ttl`, judged by the store's clock; a crashed owner's permits
    /// come back when its lease ends. A grant mints a fencing token larger than every token
    /// handed out before for this semaphore (`count` is 1). `Busy` carries the time until the
    /// first holder's lease ends. A `max` other than the one the name's live holders were
    /// granted under is refused with [`LockError::SemaphoreMax`]. Default: `Unsupported`.
    fn try_acquire_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        max: u32,
        permits: u32,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        let _ = (owner, max, permits, ttl);
        Box::pin(async move { Err(LockError::unsupported(name, "semaphores")) })
    }

    /// Gives back every permit `owner` holds of `name` (owner-checked, idempotent) and wakes as
    /// many waiters as permits were freed. `NotOwner` when `owner` holds none (never granted,
    /// already released, or expired). Default: `Unsupported`.
    fn release_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        let _ = owner;
        Box::pin(async move { Err(LockError::unsupported(name, "semaphores")) })
    }

    /// Sets the lease of `owner`'s permits of `name` to `ttl` from now, if it still holds them.
    /// Default: `Unsupported`.
    fn extend_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        let _ = (owner, ttl);
        Box::pin(async move { Err(LockError::unsupported(name, "semaphores")) })
    }

    /// Registers the caller as a waiter for permits of `name` (a queue of its own, never the
    /// lock's of the same name); see [`Backend::watch`]. Default: `Unsupported`.
    fn watch_permits<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(async move { Err(LockError::unsupported(name, "semaphores")) })
    }

    /// True when other callers in this process already wait for permits of `name`; see
    /// [`Backend::has_waiters`]. Default: false.
    fn has_permit_waiters(&self, name: &str) -> bool {
        let _ = name;
        false
    }

    // --- Read-write locks ([`crate::RwLock`]). A backend without them keeps these defaults:
    // `supports_rw` false, and [`crate::RwLock`] then fails with `LockError::Unsupported` before
    // anything is sent. A read-write lock's state is its own: it never shares a key, row or
    // waiter queue with a plain lock of the same name.

    /// True when the `rw_*` methods are implemented. Default: false.
    fn supports_rw(&self) -> bool {
        false
    }

    /// Takes (or re-enters, count + 1) `side` of the read-write lock `name` for `owner`.
    ///
    /// * [`RwSide::Read`]: granted unless a writer holds it or another owner's live
    ///   "writer waiting" marker is set (writer preference); a reader that already holds it
    ///   re-enters even then. Many owners hold the read side at once; each reader's hold has its
    ///   own lease of `ttl`, judged by the store's clock.
    /// * [`RwSide::Write`]: granted when no writer and no live reader hold it and no other
    ///   owner's live marker is set. A busy try sets the marker for `owner` (lease `ttl`) when
    ///   none is set, or renews its own; the marker goes with the grant, with a release of every
    ///   hold of `owner`, or by its lease.
    ///
    /// Every first grant (either side) mints a token larger than every token handed out before
    /// for this name (either side); a re-entry returns the hold's token. A busy reply's
    /// `remaining` is when to try again at the latest (a waiting writer's retry renews its marker).
    fn rw_try_acquire<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        let _ = (side, owner, ttl);
        Box::pin(async move { Err(rw_unsupported(name)) })
    }

    /// Gives back one hold of `owner` on `side` (every hold with `all`), owner-checked; on the
    /// write side `all` also clears `owner`'s "writer waiting" marker (a wait that ended without
    /// a grant), answering [`Released::NotOwner`] when `owner` held nothing. A release that frees
    /// the side wakes the waiters that can now go on (the last reader: a writer; a writer:
    /// readers and a writer).
    fn rw_release<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        let _ = (side, owner, all);
        Box::pin(async move { Err(rw_unsupported(name)) })
    }

    /// Sets the lease of `owner`'s hold of `side` to `ttl` from now, if it still holds it.
    fn rw_extend<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        let _ = (side, owner, ttl);
        Box::pin(async move { Err(rw_unsupported(name)) })
    }

    /// Atomically turns `owner`'s write hold into a read hold (count 1, lease `ttl`, a new
    /// token, returned) and wakes waiting readers; no writer can get in between. `None` when
    /// `owner` no longer holds the write side (nothing changed).
    fn rw_downgrade<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<u64>, LockError>> {
        let _ = (owner, ttl);
        Box::pin(async move { Err(rw_unsupported(name)) })
    }

    /// Registers the caller as a waiter for `side` of `name` (as [`Backend::watch`]).
    fn rw_watch<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        let _ = side;
        Box::pin(async move { Err(rw_unsupported(name)) })
    }

    /// True when other callers in this process already wait for `side` of `name`.
    fn rw_has_waiters(&self, side: RwSide, name: &str) -> bool {
        let _ = (side, name);
        false
    }

    /// Writes the leader record beside the lock `name` (an election's value, see
    /// [`crate::Election`]): `value` under `epoch`, unless the stored record has a larger epoch.
    /// `Ok(true)` when written (also over a record of the same epoch: a leader proclaiming a new
    /// value), `Ok(false)` when refused (a later term wrote first). The record outlives the lock
    /// (the next leader overwrites it). Default: [`LockError::Config`], this backend keeps no
    /// records (elections still run on it; only `proclaim` and `observe` need records).
    fn put_record<'a>(
        &'a self,
        name: &'a str,
        epoch: u64,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        let _ = (epoch, value);
        Box::pin(async move { Err(records_unsupported(name)) })
    }

    /// Reads the leader record beside the lock `name`: `None` when none was written. Default:
    /// [`LockError::Config`], as [`Backend::put_record`].
    fn get_record<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<Record>, LockError>> {
        Box::pin(async move { Err(records_unsupported(name)) })
    }
}

/// A leader record: the value a leader proclaimed and the epoch (the fencing token of its term)
/// it wrote it under. See [`Backend::put_record`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The epoch of the term that wrote it.
    pub epoch: u64,
    /// The value.
    pub value: String,
}

/// The error of a backend without leader records.
fn records_unsupported(name: &str) -> LockError {
    LockError::Config(format!(
        "`{name}`: this backend keeps no leader records (Election::proclaim / observe); \
         campaigning and terms work on it"
    ))
}

/// The side of a read-write lock a [`Backend`]'s `rw_*` method is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RwSide {
    /// Shared: many readers at once.
    Read,
    /// Exclusive: one writer, no reader.
    Write,
}

/// The error of a read-write call on a backend without read-write locks.
pub(crate) fn rw_unsupported(name: &str) -> LockError {
    LockError::Unsupported {
        key: name.to_string(),
        what: "read-write locks",
    }
}

pub use crate::key::{RedisKeys, redis_keys};
pub use crate::wait::{WaitQueues, Watch};

#[cfg(all(test, any(feature = "etcd", feature = "zookeeper")))]
mod tests {
    #[test]
    fn url_user_parts_are_percent_decoded() {
        assert_eq!(
            super::url_decode("s3cr%2Fet%40Pw%3A", "p").unwrap(),
            "s3cr/et@Pw:"
        );
        assert_eq!(super::url_decode("plain", "p").unwrap(), "plain");
        let e = super::url_decode("%ff%fe", "password")
            .unwrap_err()
            .to_string();
        assert!(e.contains("password") && !e.contains("%ff"), "{e}");
    }
}

/// Installs ring's rustls crypto provider as the process default when none is installed yet:
/// redis-rs, mysql_async and zookeeper-client build their TLS configs from the process default
/// and have none of their own. An application's own choice, made earlier, wins, and losing a
/// race to another installer is fine (a provider is then installed either way).
#[cfg(any(feature = "tls", feature = "mysql-tls"))]
pub(crate) fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}
