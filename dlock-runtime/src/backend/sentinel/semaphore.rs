//! The Sentinel backend's semaphores: the single-node scripts (`redis/semaphore.rs`) on the
//! current master, a failed call refreshing the master as a lock call does.
//!
//! Two limits, stated in the README's engine table: with `min_replicas` set, semaphores answer
//! [`LockError::Unsupported`] (a permit grant is not followed by `WAIT` yet, and a grant the
//! replicas never saw must not look as safe as a lock's); and a waiter is subscribed on the
//! master of the moment it queued, so after a failover it is woken by its lease timers (the
//! first holder's lease end), not by releases on the new master, until its acquisition ends.

use std::time::Duration;

use super::SentinelBackend;
use crate::LockError;
use crate::backend::{Acquired, Extended, Released, Watch};

impl SentinelBackend {
    fn sem_unsupported(&self, name: &str) -> Result<(), LockError> {
        match self.inner.cfg.min_replicas {
            Some(_) => Err(LockError::unsupported(name, "semaphores with min_replicas")),
            None => Ok(()),
        }
    }

    pub(super) async fn sem_try_acquire(
        &self,
        name: &str,
        owner: &str,
        max: u32,
        permits: u32,
        ttl: Duration,
    ) -> Result<Acquired, LockError> {
        self.sem_unsupported(name)?;
        let b = self.inner.current().backend.clone();
        let r = b.sem_try_acquire(name, owner, max, permits, ttl).await;
        if matches!(r, Err(LockError::Backend { .. })) {
            self.inner.refresh().await;
        }
        r
    }

    pub(super) async fn sem_release(&self, name: &str, owner: &str) -> Result<Released, LockError> {
        self.sem_unsupported(name)?;
        self.on_master(|b| async move { b.sem_release(name, owner).await })
            .await
    }

    pub(super) async fn sem_extend(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Extended, LockError> {
        self.sem_unsupported(name)?;
        self.on_master(|b| async move { b.sem_extend(name, owner, ttl).await })
            .await
    }

    pub(super) async fn sem_watch(&self, name: &str) -> Result<Watch, LockError> {
        self.sem_unsupported(name)?;
        let b = self.inner.current().backend.clone();
        b.sem_watch(name).await
    }

    pub(super) fn sem_has_waiters(&self, name: &str) -> bool {
        self.inner.current().backend.sem_has_waiters(name)
    }
}
