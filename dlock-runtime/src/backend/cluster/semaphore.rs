//! The Redis Cluster backend's semaphores: the single-node semaphore scripts
//! (`redis/semaphore_*.lua`, keys in `redis/semaphore.rs`) sent by `run_script` (never re-sent
//! unless the answer proves they did not run), the release's `PUBLISH` turned into `SPUBLISH`
//! as the lock scripts' are. Every key of a semaphore carries the lock's hash tag, so one
//! script touches one slot. With `min_replicas`, a grant is followed by `WAIT` on the same
//! connection, and a grant too few replicas confirmed is given back and fails.

use std::sync::LazyLock;
use std::time::Duration;

use tokio::sync::oneshot;

use super::{
    ClusterBackend, ClusterScript, Ctl, FENCE_GRACE, PUBLISH_CALL, SPUBLISH_CALL, is_refusal, ms,
    run_script,
};
use crate::LockError;
use crate::backend::redis::semaphore::{acquire_reply, sem_keys};
use crate::backend::redis::{unconfirmed, wait_reply};
use crate::backend::{Acquired, Extended, Released, Watch};

const ACQUIRE_SRC: &str = include_str!("../redis/semaphore_acquire.lua");
const RELEASE_SRC: &str = include_str!("../redis/semaphore_release.lua");
const EXTEND_SRC: &str = include_str!("../redis/semaphore_extend.lua");

static ACQUIRE: LazyLock<ClusterScript> =
    LazyLock::new(|| ClusterScript::new(ACQUIRE_SRC.to_string()));
static RELEASE: LazyLock<ClusterScript> =
    LazyLock::new(|| ClusterScript::new(RELEASE_SRC.replace(PUBLISH_CALL, SPUBLISH_CALL)));
static EXTEND: LazyLock<ClusterScript> =
    LazyLock::new(|| ClusterScript::new(EXTEND_SRC.to_string()));

impl ClusterBackend {
    pub(super) async fn sem_try_acquire(
        &self,
        name: &str,
        owner: &str,
        max: u32,
        permits: u32,
        ttl: Duration,
    ) -> Result<Acquired, LockError> {
        let (mut con, _) = self.conn(name)?;
        let k = sem_keys(name);
        let (max_s, n_s) = (max.to_string(), permits.to_string());
        let (ttl_ms, fence_ms) = (ms(ttl).to_string(), ms(ttl + FENCE_GRACE).to_string());
        let args: [&[u8]; 5] = [
            owner.as_bytes(),
            max_s.as_bytes(),
            n_s.as_bytes(),
            ttl_ms.as_bytes(),
            fence_ms.as_bytes(),
        ];
        let (r, acked) = run_script(
            &self.inner,
            &mut con,
            &ACQUIRE,
            &[&k.hash, &k.leases, &k.fence],
            &args,
            self.inner.min_replicas,
        )
        .await
        .map_err(|e| LockError::backend(name, e))?;
        let a = acquire_reply(name, max, &r)?;
        if let (Acquired::Granted { .. }, Some(wait)) = (a, self.inner.min_replicas)
            && let Some(e) = unconfirmed(name, wait_reply(acked), wait, "permit grant")
        {
            // Retried by the backend's reaper until the cluster answers.
            let _ = self.sem_release(name, owner).await;
            return Err(e);
        }
        Ok(a)
    }

    async fn sem_release_once(&self, name: &str, owner: &str) -> Result<Released, LockError> {
        let (mut con, _) = self.conn(name)?;
        let k = sem_keys(name);
        let args: [&[u8]; 2] = [owner.as_bytes(), k.channel.as_bytes()];
        let (r, _) = run_script(
            &self.inner,
            &mut con,
            &RELEASE,
            &[&k.hash, &k.leases],
            &args,
            None,
        )
        .await
        .map_err(|e| LockError::backend(name, e))?;
        let r: i64 = redis::from_redis_value(r).map_err(|e| LockError::backend(name, e))?;
        Ok(if r < 0 {
            Released::NotOwner
        } else {
            Released::Freed
        })
    }

    pub(super) async fn sem_release(&self, name: &str, owner: &str) -> Result<Released, LockError> {
        let r = self.sem_release_once(name, owner).await;
        if matches!(r, Err(LockError::Backend { .. })) {
            let me = self.clone();
            let (n, o) = (name.to_string(), owner.to_string());
            self.inner
                .reaper
                .retry(name, owner, self.inner.label.clone(), move || {
                    let (me, n, o) = (me.clone(), n.clone(), o.clone());
                    async move { me.sem_release_once(&n, &o).await }
                });
        }
        r
    }

    pub(super) async fn sem_extend(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Extended, LockError> {
        let (mut con, _) = self.conn(name)?;
        let k = sem_keys(name);
        let ttl_ms = ms(ttl).to_string();
        let args: [&[u8]; 2] = [owner.as_bytes(), ttl_ms.as_bytes()];
        let (r, _) = run_script(
            &self.inner,
            &mut con,
            &EXTEND,
            &[&k.hash, &k.leases],
            &args,
            None,
        )
        .await
        .map_err(|e| LockError::backend(name, e))?;
        let r: i64 = redis::from_redis_value(r).map_err(|e| LockError::backend(name, e))?;
        Ok(crate::scripts::extend_reply(r))
    }

    pub(super) async fn sem_watch(&self, name: &str) -> Result<Watch, LockError> {
        self.watch_channel(name, sem_keys(name).channel).await
    }

    pub(super) fn sem_has_waiters(&self, name: &str) -> bool {
        match self.conn(name) {
            Ok((_, sub)) => sub.queues.has_waiters(&sem_keys(name).channel),
            Err(_) => false,
        }
    }

    /// Registers a waiter on `channel`'s local queue, subscribed (SSUBSCRIBE) before this
    /// returns, or on the lease timer when the cluster refuses.
    pub(super) async fn watch_channel(
        &self,
        name: &str,
        channel: String,
    ) -> Result<Watch, LockError> {
        let (_, sub) = self.conn(name)?;
        let mut watch = sub.queues.register(&channel);
        if self.refused_now() {
            watch.set_fallback_only();
            return Ok(watch);
        }
        let (tx, rx) = oneshot::channel();
        if sub.ctl.send(Ctl::Subscribe(channel, tx)).is_err() {
            watch.set_fallback_only();
            return Ok(watch);
        }
        match rx.await {
            Ok(Ok(())) => self.note_accepted(),
            Ok(Err(e)) => {
                if is_refusal(&e) {
                    self.note_refusal(&e);
                }
                watch.set_fallback_only();
            }
            Err(_) => watch.set_fallback_only(),
        }
        Ok(watch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_semaphore_release_publishes_sharded() {
        assert!(RELEASE_SRC.contains(PUBLISH_CALL));
        assert!(RELEASE.src.contains(SPUBLISH_CALL));
        assert!(!RELEASE.src.contains("'PUBLISH'"));
        for src in [ACQUIRE_SRC, EXTEND_SRC] {
            assert!(!src.contains("PUBLISH"));
        }
    }
}
