//! `Semaphore`: owned, expiring permits with the lock guard's whole contract.
//!
//! A semaphore's holder is an owner id with a lease, exactly as a lock's: the guard, the
//! watchdog, the lost signal, the background give-back and the wait loop are the lock's own
//! (`lock.rs`, `guard.rs`), driven through [`Permits`], a [`Backend`] that turns the lock calls
//! into the backend's permit calls ([`Backend::try_acquire_permits`] and its siblings) for one
//! `(max, permits)` pair. Re-entry is off: every acquisition is a holder of its own.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::backend::{Acquired, Backend, BoxFuture, Extended, Released, Watch};
use crate::primitive::{Options, primitive_options, shared_adapter};
use crate::{LockError, LockGuard, LostReason};

/// A counting semaphore shared by every process that uses the same store: at most `max`
/// permits of a name are held at once, each by an owner with a lease.
///
/// ```
/// # use dlock_runtime as dlock;
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock::LockError> {
/// use std::time::Duration;
/// // At most 4 exports run at once across the fleet; this one takes 1 permit.
/// let permit = dlock::Semaphore::new("exports", 4)
///     .ttl(Duration::from_secs(30))
///     .wait(Duration::from_secs(5))
///     .acquire()
///     .await?;
/// println!("exporting under fencing token {}", permit.fencing_token());
/// permit.release().await?;
/// # Ok(()) }
/// ```
///
/// What it guarantees (on the engines that implement it: memory, Redis, Sentinel and Redis
/// Cluster; the others answer [`LockError::Unsupported`]):
///
/// * While the store keeps its state and no holder pauses past its lease, the permits held at
///   any instant sum to at most `max`. Permits belong to an owner and expire with its lease,
///   judged by the store's clock: a crashed holder's permits come back once its ttl has run out,
///   never a counter that leaks.
/// * Every grant mints a fencing token larger than every earlier grant's of the name (also
///   across restarts of the store without persistence, as a lock's): a resource that refuses
///   smaller tokens refuses a holder that lost its lease to a later one.
/// * A caller whose `max` differs from the `max` the name's live holders were granted under
///   gets [`LockError::SemaphoreMax`]: there is never a second limit in force. A name with no
///   live holder takes the `max` of its next grant.
/// * Giving back `k` permits wakes `k` waiters in each process waiting for the name, not all
///   of them.
/// * The guard is a [`LockGuard`]'s: watchdog renewal, `lost()`, `is_valid()`, `extend`,
///   `release`, background give-back on drop. A nested acquisition inside
///   [`SemaphoreGuard::scope`] takes permits of its own (no re-entry).
#[derive(Clone)]
pub struct Semaphore {
    name: String,
    max: u32,
    permits: u32,
    opts: Options,
}

impl fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Semaphore")
            .field("name", &self.name)
            .field("max", &self.max)
            .field("permits", &self.permits)
            .field("options", &self.opts)
            .finish()
    }
}

impl Semaphore {
    /// The semaphore `name` (1 to 1024 bytes; its store keys never collide with a lock's of the
    /// same name) with `max` permits in all; one permit per acquisition, a 30 s ttl, no waiting,
    /// the watchdog on and the backend `"default"`.
    pub fn new(name: impl Into<String>, max: u32) -> Self {
        Semaphore {
            name: name.into(),
            max,
            permits: 1,
            opts: Options::default(),
        }
    }

    /// How many permits one acquisition takes (default 1; from 1 to `max`). They are granted
    /// all at once or not at all.
    pub fn permits(mut self, n: u32) -> Self {
        self.permits = n;
        self
    }

    primitive_options!("grant's permits");

    /// The semaphore's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Takes the permits, waiting up to the `wait` duration.
    ///
    /// [`LockError::Config`] when `max` is zero or `permits` is zero or above `max` (nothing is
    /// sent); [`LockError::SemaphoreMax`] when the name's live holders have another `max`;
    /// [`LockError::Unsupported`] on an engine without semaphores; otherwise as
    /// [`Lock::acquire`](crate::Lock::acquire).
    pub async fn acquire(&self) -> Result<SemaphoreGuard, LockError> {
        if self.max == 0 {
            return Err(LockError::Config(format!(
                "semaphore `{}`: max must be at least 1",
                self.name
            )));
        }
        if self.permits == 0 || self.permits > self.max {
            return Err(LockError::Config(format!(
                "semaphore `{}`: permits must be from 1 to max ({}), not {}",
                self.name, self.max, self.permits
            )));
        }
        crate::key::validate(&self.name)?;
        let adapter: Arc<dyn Backend> =
            Permits::shared(self.opts.resolve()?, self.max, self.permits);
        let lock = self.opts.lock(&self.name, adapter).not_reentrant();
        let guard = lock.acquire().await?;
        Ok(SemaphoreGuard {
            guard,
            max: self.max,
            permits: self.permits,
        })
    }
}

/// Held permits of a [`Semaphore`]. Give them back with [`SemaphoreGuard::release`]; dropping
/// the guard gives them back in the background.
///
/// The contract is a [`LockGuard`]'s: the watchdog renews the lease every ttl/3, the guard keeps
/// its own deadline on a monotonic clock and counts itself lost once it passes ([`lost`],
/// [`is_valid`]).
///
/// [`lost`]: SemaphoreGuard::lost
/// [`is_valid`]: SemaphoreGuard::is_valid
#[must_use = "the permits are given back when the guard is dropped; bind it to a variable"]
#[clippy::has_significant_drop]
pub struct SemaphoreGuard {
    guard: LockGuard,
    max: u32,
    permits: u32,
}

impl fmt::Debug for SemaphoreGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SemaphoreGuard")
            .field("key", &self.guard.key())
            .field("permits", &self.permits)
            .field("max", &self.max)
            .field("fencing_token", &self.guard.fencing_token())
            .field("valid", &self.guard.is_valid())
            .finish()
    }
}

impl SemaphoreGuard {
    /// The semaphore's name.
    pub fn key(&self) -> &str {
        self.guard.key()
    }

    /// How many permits this guard holds.
    pub fn permits(&self) -> u32 {
        self.permits
    }

    /// The semaphore's `max`.
    pub fn max(&self) -> u32 {
        self.max
    }

    /// The fencing token of this grant: larger than every earlier grant's of this semaphore.
    pub fn fencing_token(&self) -> u64 {
        self.guard.fencing_token()
    }

    /// The owner id the permits are held under (one per acquisition).
    pub fn owner(&self) -> &str {
        self.guard.owner()
    }

    /// True while the lease is believed held (see [`LockGuard::is_valid`]).
    pub fn is_valid(&self) -> bool {
        self.guard.is_valid()
    }

    /// Time left until the local deadline (zero when lost).
    pub fn remaining(&self) -> Duration {
        self.guard.remaining()
    }

    /// `Ok(())` while valid, else the [`LockError::Lost`] to return.
    pub fn ensure_valid(&self) -> Result<(), LockError> {
        self.guard.ensure_valid()
    }

    /// Why the lease was lost, once it was.
    pub fn lost_reason(&self) -> Option<LostReason> {
        self.guard.lost_reason()
    }

    /// Completes when the lease is lost (see [`LockGuard::lost`]).
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        self.guard.lost()
    }

    /// A token cancelled when the lease is lost.
    pub fn lost_token(&self) -> CancellationToken {
        self.guard.lost_token()
    }

    /// Sets the lease to `ttl` from now, if this owner still holds its permits (see
    /// [`LockGuard::extend`]).
    pub async fn extend(&self, ttl: Duration) -> Result<(), LockError> {
        self.guard.extend(ttl).await
    }

    /// Runs `fut` with this grant's token as [`crate::fencing_token`].
    pub async fn scope<F: Future>(&self, fut: F) -> F::Output {
        self.guard.scope(fut).await
    }

    /// Gives the permits back and waits for the backend to confirm (see
    /// [`LockGuard::release`]).
    pub async fn release(self) -> Result<(), LockError> {
        self.guard.release().await
    }

    /// The lock guard that carries the permits (the attribute's expansion runs both alike).
    pub(crate) fn into_lock_guard(self) -> LockGuard {
        self.guard
    }
}

/// The lock calls of one `(backend, max, permits)` as permit calls. Shared by every
/// acquisition with the same three (see [`Permits::shared`]), so that the runtime's
/// per-backend bookkeeping (an acquisition waits for this process's own give-back of the name)
/// works across acquisitions; its identity never equals the inner backend's, so a permit is
/// never taken for a lock hold of the same name.
pub(crate) struct Permits {
    inner: Arc<dyn Backend>,
    max: u32,
    permits: u32,
}

impl fmt::Debug for Permits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permits")
            .field("inner", &self.inner)
            .field("max", &self.max)
            .field("permits", &self.permits)
            .finish()
    }
}

type AdapterKey = (usize, u32, u32);

impl Permits {
    /// The adapter for `(inner, max, permits)`: the live one when there is one. A live adapter
    /// keeps `inner` alive, so the inner pointer in the key cannot be reused meanwhile.
    fn shared(inner: Arc<dyn Backend>, max: u32, permits: u32) -> Arc<Permits> {
        static ADAPTERS: Mutex<Option<HashMap<AdapterKey, Weak<Permits>>>> = Mutex::new(None);
        let key = (crate::guard::backend_id(&inner), max, permits);
        shared_adapter(&ADAPTERS, key, || {
            Arc::new(Permits {
                inner,
                max,
                permits,
            })
        })
    }
}

impl Backend for Permits {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        self.inner
            .try_acquire_permits(name, owner, self.max, self.permits, ttl)
    }

    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        // No `hold_at_least` and no re-entry for permits: every release gives back the owner's
        // permits.
        let _ = (keep_for, all);
        Box::pin(async move {
            match self.inner.release_permits(name, owner).await {
                // Nothing was ever granted on such a backend: the give-back of a try that
                // failed this way has nothing to do.
                Err(e) if e.is_definite_refusal() => Ok(Released::NotOwner),
                r => r,
            }
        })
    }

    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        self.inner.extend_permits(name, owner, ttl)
    }

    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        self.inner.watch_permits(name)
    }

    fn has_waiters(&self, name: &str) -> bool {
        self.inner.has_permit_waiters(name)
    }

    fn lease_margin(&self, ttl: Duration) -> Duration {
        self.inner.lease_margin(ttl)
    }

    fn lease_expires_by_ttl(&self) -> bool {
        self.inner.lease_expires_by_ttl()
    }

    /// A backend that keeps a busy try queued on the server (ZooKeeper's nodes, etcd's entries)
    /// is told when a wait for permits ends without a grant, as for a lock: the give-up releases
    /// the entry, so later waiters are not held behind it.
    fn queues_contenders(&self) -> bool {
        self.inner.queues_contenders()
    }

    fn lost_signal(&self, name: &str, owner: &str) -> Option<BoxFuture<'static, ()>> {
        self.inner.lost_signal(name, owner)
    }
}
