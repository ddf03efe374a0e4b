//! A backend wrapper that forwards every `Backend` method to the wrapped backend and counts
//! `try_acquire` calls: the one place a new trait method has to be forwarded for the tests that
//! count tries (a wrapper that forgot one silently changed the behaviour under test). It can
//! also stop answering renewals ([`CountTries::stall_extends`]): a holder that stops renewing, as
//! a paused or partitioned process does, while its store and its other calls stay up.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use dlock::backend::{Acquired, BoxFuture, Extended, Record, Released, RwSide, Watch};
use dlock::{Backend, LockError};

/// `inner` with its `try_acquire` calls counted.
#[derive(Debug)]
pub struct CountTries {
    pub inner: Arc<dyn Backend>,
    tries: AtomicU64,
    stalled: AtomicBool,
    dead: AtomicBool,
    permit_tries: AtomicU64,
}

impl CountTries {
    pub fn new(inner: Arc<dyn Backend>) -> Arc<CountTries> {
        Arc::new(CountTries {
            inner,
            stalled: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            tries: AtomicU64::new(0),
            permit_tries: AtomicU64::new(0),
        })
    }

    /// `try_acquire` calls so far.
    pub fn tries(&self) -> u64 {
        self.tries.load(Ordering::SeqCst)
    }

    /// `try_acquire_permits` calls so far.
    #[allow(dead_code)]
    pub fn permit_tries(&self) -> u64 {
        self.permit_tries.load(Ordering::SeqCst)
    }

    /// From now on `extend` (the watchdog's renewal) never answers: the hold's lease runs out on
    /// the server by its ttl, or, where a session keeps it, once the runtime gives it back.
    pub fn stall_extends(&self) {
        self.stalled.store(true, Ordering::SeqCst);
    }

    /// From now on no try, release or renewal answers or reaches the store, as for a process
    /// that died: what it left on the store stays until the store drops it.
    #[allow(dead_code)]
    pub fn die(&self) {
        self.dead.store(true, Ordering::SeqCst);
    }

    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }
}

impl Backend for CountTries {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        if self.is_dead() {
            return Box::pin(std::future::pending());
        }
        self.tries.fetch_add(1, Ordering::SeqCst);
        self.inner.try_acquire(name, owner, ttl)
    }
    fn supports_fair(&self) -> bool {
        self.inner.supports_fair()
    }
    fn try_acquire_fair<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
        heartbeat: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        if self.is_dead() {
            return Box::pin(std::future::pending());
        }
        self.tries.fetch_add(1, Ordering::SeqCst);
        self.inner.try_acquire_fair(name, owner, ttl, heartbeat)
    }
    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        if self.is_dead() {
            return Box::pin(std::future::pending());
        }
        self.inner.release(name, owner, keep_for, all)
    }
    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        if self.stalled.load(Ordering::SeqCst) || self.is_dead() {
            return Box::pin(std::future::pending());
        }
        self.inner.extend(name, owner, ttl)
    }
    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        self.inner.watch(name)
    }
    fn has_waiters(&self, name: &str) -> bool {
        self.inner.has_waiters(name)
    }
    fn lease_margin(&self, ttl: Duration) -> Duration {
        self.inner.lease_margin(ttl)
    }
    fn queues_contenders(&self) -> bool {
        self.inner.queues_contenders()
    }
    fn fresh_owner_per_try(&self) -> bool {
        self.inner.fresh_owner_per_try()
    }
    fn lease_expires_by_ttl(&self) -> bool {
        self.inner.lease_expires_by_ttl()
    }
    fn lost_signal(&self, name: &str, owner: &str) -> Option<BoxFuture<'static, ()>> {
        self.inner.lost_signal(name, owner)
    }
    fn try_acquire_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        max: u32,
        permits: u32,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        self.permit_tries.fetch_add(1, Ordering::SeqCst);
        self.inner
            .try_acquire_permits(name, owner, max, permits, ttl)
    }
    fn release_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        self.inner.release_permits(name, owner)
    }
    fn extend_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        self.inner.extend_permits(name, owner, ttl)
    }
    fn watch_permits<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        self.inner.watch_permits(name)
    }
    fn has_permit_waiters(&self, name: &str) -> bool {
        self.inner.has_permit_waiters(name)
    }
    fn put_record<'a>(
        &'a self,
        name: &'a str,
        epoch: u64,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        self.inner.put_record(name, epoch, value)
    }
    fn get_record<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<Record>, LockError>> {
        self.inner.get_record(name)
    }
    fn supports_rw(&self) -> bool {
        self.inner.supports_rw()
    }
    fn rw_try_acquire<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        self.inner.rw_try_acquire(side, name, owner, ttl)
    }
    fn rw_release<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        self.inner.rw_release(side, name, owner, all)
    }
    fn rw_extend<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        self.inner.rw_extend(side, name, owner, ttl)
    }
    fn rw_downgrade<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<u64>, LockError>> {
        self.inner.rw_downgrade(name, owner, ttl)
    }
    fn rw_watch<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        self.inner.rw_watch(side, name)
    }
    fn rw_has_waiters(&self, side: RwSide, name: &str) -> bool {
        self.inner.rw_has_waiters(side, name)
    }
}
