//! The Sentinel backend's semaphores: the single-node scripts (`redis/semaphore.rs`) on the
//! current master, a failed call refreshing the master as a lock call does.
//!
//! With `min_replicas(n, t)`, every grant is followed by `WAIT n t` in one pipeline on the
//! connection that wrote it, exactly as a lock's grant is; a grant fewer than `n` replicas
//! confirmed is given back and answered with a backend error. A waiter is subscribed on the
//! master of the moment it queued, so after a failover it is woken by its lease timers (the
//! first holder's lease end), not by releases on the new master, until its acquisition ends.

use std::time::Duration;

use super::SentinelBackend;
use crate::LockError;
use crate::backend::redis::unconfirmed;
use crate::backend::{Acquired, Extended, Released, Watch};

impl SentinelBackend {
    pub(super) async fn sem_try_acquire(
        &self,
        name: &str,
        owner: &str,
        max: u32,
        permits: u32,
        ttl: Duration,
    ) -> Result<Acquired, LockError> {
        let b = self.inner.current().backend.clone();
        let min_replicas = self.inner.cfg.min_replicas;
        let r = b
            .sem_try_acquire_then_wait(name, owner, max, permits, ttl, min_replicas)
            .await;
        let (r, acked) = match r {
            // Only a failed call asks the sentinels again; a `max` mismatch is an answer.
            Err(e @ LockError::Backend { .. }) => {
                self.inner.refresh().await;
                return Err(e);
            }
            Err(e) => return Err(e),
            Ok(r) => r,
        };
        if let (Acquired::Granted { .. }, Some(wait)) = (r, min_replicas)
            && let Some(e) = unconfirmed(name, acked, wait, "permit grant")
        {
            // Give the permits back (the release is retried by the backend until the master
            // answers); the caller's give-back of this try finds nothing left.
            let _ = b.sem_release(name, owner).await;
            return Err(e);
        }
        Ok(r)
    }

    pub(super) async fn sem_release(&self, name: &str, owner: &str) -> Result<Released, LockError> {
        self.on_master(|b| async move { b.sem_release(name, owner).await })
            .await
    }

    pub(super) async fn sem_extend(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Extended, LockError> {
        self.on_master(|b| async move { b.sem_extend(name, owner, ttl).await })
            .await
    }

    pub(super) async fn sem_watch(&self, name: &str) -> Result<Watch, LockError> {
        let b = self.inner.current().backend.clone();
        b.sem_watch(name).await
    }

    pub(super) fn sem_has_waiters(&self, name: &str) -> bool {
        self.inner.current().backend.sem_has_waiters(name)
    }
}
