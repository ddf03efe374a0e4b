//! `RwLock`: a distributed read-write lock on the lock's own guard machinery.
//!
//! Each side of a read-write lock is presented to the runtime as a [`Backend`] of its own (an
//! adapter, [`Side`], forwarding to the engine's `rw_*` methods), so the acquire loop, the
//! guard, the watchdog, the give-back and the waiting are exactly the lock's. The adapters of
//! one engine are shared by every `RwLock` of the process (a weak cache keyed by the engine), so
//! that re-entry in a call chain and the wait for this process's own give-backs find them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::{Acquired, Backend, BoxFuture, Extended, Released, RwSide, Watch};
use crate::give_back::GiveBack;
use crate::guard::{GuardInit, LockGuard, backend_id};
use crate::primitive::{Options, primitive_options, shared_adapter};
use crate::{Lock, LockError, LostReason, context};

/// One side of a read-write lock, as a [`Backend`] for the lock machinery.
#[derive(Debug)]
struct Side {
    inner: Arc<dyn Backend>,
    side: RwSide,
}

impl Backend for Side {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        self.inner.rw_try_acquire(self.side, name, owner, ttl)
    }

    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        _keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        self.inner.rw_release(self.side, name, owner, all)
    }

    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        self.inner.rw_extend(self.side, name, owner, ttl)
    }

    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        self.inner.rw_watch(self.side, name)
    }

    /// A reader never queues behind this process's waiting readers (the acquire loop's rule
    /// for a newcomer: no try while another waiter here knows of a running lease): a read grant
    /// excludes no other reader, so there is no turn to keep, and the wake-up of waiting readers
    /// (a freed write side, a writer that stopped waiting) reaches every reader queued at that
    /// moment at once. A newcomer that queued after it without trying, while the woken readers
    /// were still retrying, would hear nothing more and sleep until the lease end last recorded
    /// here (a writer's, a waiting writer's marker's, or a reader's own grant). So a reader
    /// always tries first: only the server's answer makes it wait, and then it subscribes and
    /// tries again before it sleeps.
    fn has_waiters(&self, name: &str) -> bool {
        self.side == RwSide::Write && self.inner.rw_has_waiters(self.side, name)
    }

    fn lease_margin(&self, ttl: Duration) -> Duration {
        self.inner.lease_margin(ttl)
    }

    /// A waiting writer leaves a "writer waiting" marker on the server: a wait that ends
    /// without a grant releases it (the lock's `GiveUp`), so readers are not held back by a
    /// writer that stopped waiting until the marker's lease ran out. On a backend that queues
    /// every busy try on the server (ZooKeeper's read and write nodes, etcd's entries), a
    /// waiting reader's entry goes the same way.
    fn queues_contenders(&self) -> bool {
        self.side == RwSide::Write || self.inner.queues_contenders()
    }

    fn lost_signal(&self, name: &str, owner: &str) -> Option<BoxFuture<'static, ()>> {
        self.inner.lost_signal(name, owner)
    }

    fn fresh_owner_per_try(&self) -> bool {
        self.inner.fresh_owner_per_try()
    }

    fn lease_expires_by_ttl(&self) -> bool {
        self.inner.lease_expires_by_ttl()
    }
}

/// The two adapters of one engine.
#[derive(Clone)]
struct Sides {
    inner: Arc<dyn Backend>,
    read: Arc<dyn Backend>,
    write: Arc<dyn Backend>,
}

type SideCache = HashMap<(usize, RwSide), Weak<dyn Backend>>;

/// The adapters of `inner`, each shared while anything holds it (a guard, a give-back, a
/// waiting acquisition): a call chain's hold of one side is found again by a later `RwLock`.
fn sides(inner: &Arc<dyn Backend>) -> Sides {
    static CACHE: Mutex<Option<SideCache>> = Mutex::new(None);
    let id = backend_id(inner);
    let side = |side: RwSide| {
        shared_adapter(&CACHE, (id, side), || {
            Arc::new(Side {
                inner: inner.clone(),
                side,
            }) as Arc<dyn Backend>
        })
    };
    Sides {
        inner: inner.clone(),
        read: side(RwSide::Read),
        write: side(RwSide::Write),
    }
}

/// A distributed read-write lock: many readers or one writer.
///
/// ```
/// # use dlock_runtime as dlock;
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock::LockError> {
/// use std::time::Duration;
/// let rw = dlock::RwLock::new("catalog").ttl(Duration::from_secs(10)).wait(Duration::from_secs(2));
/// let a = rw.read().await?;
/// let b = rw.read().await?; // readers share
/// drop((a, b));
/// let w = rw.write().await?; // a writer excludes readers and writers
/// let r = w.downgrade().await?; // atomically a reader; no writer gets in between
/// r.release().await?;
/// # Ok(()) }
/// ```
///
/// * **Guards**: [`ReadGuard`] and [`WriteGuard`] dereference to a [`LockGuard`] and keep its
///   whole contract: an owner id of their own, the watchdog renewing each hold's lease,
///   `lost()`, `is_valid()`, `extend`, `scope`, `release`, give-back on drop, a fencing token.
/// * **Writer preference**: once a writer waits, new readers wait too (a reader that already
///   holds the lock may still re-enter it), so a steady stream of readers cannot starve a
///   writer. The waiting writer's marker has a lease of the writer's ttl, renewed by its tries,
///   and goes when its wait ends, so a writer that died while waiting holds readers back for at
///   most its ttl.
/// * **Leases**: every reader's hold expires on its own with its lease, judged by the store's
///   clock: a crashed reader blocks writers for at most its ttl.
/// * **Fencing**: every grant (read or write) mints a token from one sequence per name, so a
///   write grant's token is larger than every earlier grant's, read or write. A read grant's
///   token is larger than the token of every write granted before it: a resource can refuse a
///   reader whose token is below the last write token it saw (a reader that outlived its lease
///   while a writer came and went). Readers holding at the same time have different tokens.
/// * **Downgrade** ([`WriteGuard::downgrade`]): the write hold becomes a read hold in one atomic
///   step on the server; no writer can get in between.
/// * **Upgrade** is refused: asking for the write lock in a call chain that holds the read lock
///   (inside [`LockGuard::scope`] or an annotated body) fails at once with
///   [`LockError::UpgradeRefused`]. A read asked for where the chain holds the write lock
///   re-enters the write hold (its token is the write token).
/// * The read-write lock `name` shares nothing with a [`Lock`] of the same name.
/// * Engines: see the README's engine table; others fail with [`LockError::Unsupported`]
///   before anything is sent.
#[derive(Clone)]
pub struct RwLock {
    name: String,
    opts: Options,
}

impl std::fmt::Debug for RwLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RwLock")
            .field("name", &self.name)
            .field("options", &self.opts)
            .finish()
    }
}

impl RwLock {
    /// A read-write lock named `name`, with a 30 s ttl, no waiting, the watchdog on and the
    /// backend `"default"`.
    pub fn new(name: impl Into<String>) -> Self {
        RwLock {
            name: name.into(),
            opts: Options::default(),
        }
    }

    primitive_options!("hold");

    /// The lock name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn sides(&self) -> Result<Sides, LockError> {
        crate::key::validate(&self.name)?;
        let inner = self.opts.resolve()?;
        if !inner.supports_rw() {
            return Err(crate::backend::rw_unsupported(&self.name));
        }
        Ok(sides(&inner))
    }

    fn lock_on(&self, side: &Arc<dyn Backend>) -> Lock {
        self.opts.lock(&self.name, side.clone())
    }

    /// The hold of this name's `side` that the current call chain has, if any.
    fn held_in_chain(&self, side: &Arc<dyn Backend>) -> bool {
        context::current().is_some_and(|f| f.find(backend_id(side), &self.name).is_some())
    }

    /// Takes the read side, waiting up to the `wait` duration: shared with other readers,
    /// excluded by a writer, and held back while a writer waits.
    ///
    /// In a call chain that holds the write side, this re-enters the write hold.
    pub async fn read(&self) -> Result<ReadGuard, LockError> {
        let sides = self.sides()?;
        if self.held_in_chain(&sides.write) {
            let g = self.lock_on(&sides.write).acquire().await?;
            return Ok(ReadGuard { guard: g });
        }
        let g = self.lock_on(&sides.read).acquire().await?;
        Ok(ReadGuard { guard: g })
    }

    /// Takes the write side, waiting up to the `wait` duration: excludes readers and writers.
    ///
    /// In a call chain that holds the read side (and not the write side) this is an upgrade,
    /// refused at once with [`LockError::UpgradeRefused`].
    pub async fn write(&self) -> Result<WriteGuard, LockError> {
        let sides = self.sides()?;
        if !self.held_in_chain(&sides.write) && self.held_in_chain(&sides.read) {
            return Err(LockError::UpgradeRefused {
                key: self.name.clone(),
            });
        }
        let g = self.lock_on(&sides.write).acquire().await?;
        Ok(WriteGuard {
            guard: g,
            inner: sides.inner,
            read: sides.read,
            metric: self.opts.metric_labels(),
            watchdog: self.opts.watchdog,
        })
    }
}

/// A held read side of an [`RwLock`]: a [`LockGuard`] (dereference it for the token, `lost()`,
/// `is_valid()`, `extend`, `scope`) whose release gives back this reader's hold only.
#[must_use = "the lock is released when the guard is dropped; bind it to a variable"]
#[clippy::has_significant_drop]
#[derive(Debug)]
pub struct ReadGuard {
    guard: LockGuard,
}

impl std::ops::Deref for ReadGuard {
    type Target = LockGuard;
    fn deref(&self) -> &LockGuard {
        &self.guard
    }
}

impl ReadGuard {
    /// Gives this read hold back and waits for the backend to confirm (see
    /// [`LockGuard::release`]).
    pub async fn release(self) -> Result<(), LockError> {
        self.guard.release().await
    }

    /// The underlying guard.
    pub fn into_inner(self) -> LockGuard {
        self.guard
    }
}

/// A held write side of an [`RwLock`]: a [`LockGuard`] (dereference it for the token, `lost()`,
/// `is_valid()`, `extend`, `scope`), which [`WriteGuard::downgrade`] turns into a reader.
#[must_use = "the lock is released when the guard is dropped; bind it to a variable"]
#[clippy::has_significant_drop]
pub struct WriteGuard {
    guard: LockGuard,
    /// The engine (for the downgrade call) and its read adapter (for the read guard).
    inner: Arc<dyn Backend>,
    read: Arc<dyn Backend>,
    metric: crate::metrics::Labels,
    watchdog: bool,
}

impl std::fmt::Debug for WriteGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("WriteGuard").field(&self.guard).finish()
    }
}

impl std::ops::Deref for WriteGuard {
    type Target = LockGuard;
    fn deref(&self) -> &LockGuard {
        &self.guard
    }
}

impl WriteGuard {
    /// Gives the write hold back and waits for the backend to confirm (see
    /// [`LockGuard::release`]).
    pub async fn release(self) -> Result<(), LockError> {
        self.guard.release().await
    }

    /// The underlying guard.
    pub fn into_inner(self) -> LockGuard {
        self.guard
    }

    /// Turns the write hold into a read hold in one atomic step on the server: readers may join
    /// at once, and no writer gets in between. The read hold has the same owner id, a new
    /// (larger) fencing token, a lease of the write hold's ttl and what is left of its
    /// `max_hold`.
    ///
    /// Only the outermost write guard of a call chain downgrades (a re-entered one is a
    /// [`LockError::Config`] error, and the guard is given back). A lost write hold gives
    /// [`LockError::Lost`]. When the backend's answer is lost (an error, or the lease's deadline
    /// passed first), the error is returned and both possible holds are given back in the
    /// background.
    pub async fn downgrade(self) -> Result<ReadGuard, LockError> {
        let name = self.guard.key().to_string();
        if !self.guard.is_outer() {
            drop(self);
            return Err(LockError::Config(format!(
                "lock `{name}`: only the outermost write guard can be downgraded"
            )));
        }
        self.guard.ensure_valid()?;
        crate::lock::require_runtime("downgrade", &name)?;
        let hold = self.guard.hold().clone();
        let ttl = hold.ttl();
        let owner = hold.owner.clone();
        let sent = Instant::now();
        let r =
            tokio::time::timeout_at(hold.deadline(), self.inner.rw_downgrade(&name, &owner, ttl))
                .await;
        let WriteGuard {
            guard,
            read,
            metric,
            watchdog,
            ..
        } = self;
        match r {
            Ok(Ok(Some(token))) => {
                let max_hold = hold.hold_until().map(|t| t.saturating_duration_since(sent));
                guard.forget();
                let g = LockGuard::new(
                    GuardInit {
                        backend: read,
                        name,
                        owner,
                        token,
                        sent,
                        ttl,
                        watchdog,
                        max_hold,
                        hold_at_least: None,
                        parent: None,
                        metric,
                    },
                    1,
                );
                Ok(ReadGuard { guard: g })
            }
            Ok(Ok(None)) => {
                hold.mark_lost(LostReason::NotOwner);
                let e = hold.lost_error();
                // Nothing of ours is left on the server; the drop's release answers NotOwner.
                drop(guard);
                Err(e)
            }
            Ok(Err(e)) => {
                // The outcome is unknown: give back the write hold (the guard's drop) and the
                // read hold the downgrade may have made.
                drop(guard);
                GiveBack::all(read, &name, owner, ttl).spawn();
                Err(e)
            }
            Err(_) => {
                hold.mark_lost(hold.expiry_reason(Instant::now()));
                let e = hold.lost_error();
                drop(guard);
                GiveBack::all(read, &name, owner, ttl).spawn();
                Err(e)
            }
        }
    }
}
