//! Fair locks on Redis Cluster ([`crate::Lock::fair`]): the single-node scripts
//! (`scripts/fair_acquire.lua`, `scripts/fair_release.lua`; keys as on one node, all in the
//! lock's slot, see `redis/fair.rs`) with `PUBLISH` turned into `SPUBLISH`, run by
//! [`super::run_script`] (never re-sent unless the answer proves they did not run). Node
//! connections are not replaced on a timeout, so a give-back queues behind its try as for a
//! plain lock. With `min_replicas`, fair tries are refused (no `WAIT` rides them).

use std::sync::LazyLock;
use std::time::Duration;

use super::{
    ClusterBackend, ClusterScript, FENCE_GRACE, PUBLISH_CALL, SPUBLISH_CALL, ms, run_script,
};
use crate::LockError;
use crate::backend::redis::fair::fair_keys;
use crate::backend::{Acquired, Released};

pub(super) const ACQUIRE_SRC: &str = include_str!("../../scripts/fair_acquire.lua");
pub(super) const RELEASE_SRC: &str = include_str!("../../scripts/fair_release.lua");
pub(super) static ACQUIRE: LazyLock<ClusterScript> =
    LazyLock::new(|| ClusterScript::new(ACQUIRE_SRC.replace(PUBLISH_CALL, SPUBLISH_CALL)));
pub(super) static RELEASE: LazyLock<ClusterScript> =
    LazyLock::new(|| ClusterScript::new(RELEASE_SRC.replace(PUBLISH_CALL, SPUBLISH_CALL)));

impl ClusterBackend {
    pub(super) async fn fair_try_acquire(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
        heartbeat: Duration,
    ) -> Result<Acquired, LockError> {
        if self.inner.min_replicas.is_some() {
            return Err(LockError::unsupported(name, "fair locks with min_replicas"));
        }
        self.inner.fair.note(name, owner);
        let (mut con, _) = self.conn(name)?;
        let [fence, queue, beats, channel, lock] = fair_keys(name);
        let (ttl_ms, fence_ms, beat_ms) = (
            ms(ttl).to_string(),
            ms(ttl + FENCE_GRACE).to_string(),
            ms(heartbeat).to_string(),
        );
        let args: [&[u8]; 5] = [
            owner.as_bytes(),
            ttl_ms.as_bytes(),
            fence_ms.as_bytes(),
            beat_ms.as_bytes(),
            channel.as_bytes(),
        ];
        let (v, _) = run_script(
            &self.inner,
            &mut con,
            &ACQUIRE,
            &[&lock, &fence, &queue, &beats],
            &args,
            None,
        )
        .await
        .map_err(|e| LockError::backend(name, e))?;
        crate::scripts::acquire_reply(&v).ok_or_else(|| {
            LockError::backend(
                name,
                format!("unexpected reply from the fair acquire script: {v:?}"),
            )
        })
    }

    /// One owner-checked release of a fair lock's owner (see `fair_release.lua`), sent once.
    pub(super) async fn fair_release_once(
        &self,
        name: &str,
        owner: &str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> Result<Released, LockError> {
        let (mut con, _) = self.conn(name)?;
        let [_, queue, beats, channel, lock] = fair_keys(name);
        let keep = keep_for
            .filter(|d| !d.is_zero())
            .map(ms)
            .unwrap_or(0)
            .to_string();
        let args: [&[u8]; 4] = [
            owner.as_bytes(),
            keep.as_bytes(),
            channel.as_bytes(),
            if all { b"1" } else { b"0" },
        ];
        let (r, _) = run_script(
            &self.inner,
            &mut con,
            &RELEASE,
            &[&lock, &queue, &beats],
            &args,
            None,
        )
        .await
        .map_err(|e| LockError::backend(name, e))?;
        let r: i64 = redis::from_redis_value(r).map_err(|e| LockError::backend(name, e))?;
        let out = crate::scripts::release_reply(r);
        if all || out == Released::Freed {
            self.inner.fair.forget(name, owner);
        }
        Ok(out)
    }
}
