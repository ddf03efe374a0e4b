//! Read-write locks on Redis Cluster ([`crate::RwLock`]): the single-node script
//! (`scripts/rw.lua`, keys and channels as on one node; all in the name's slot) with its
//! `PUBLISH` calls turned into `SPUBLISH`, run by [`super::run_script`] (which follows only the
//! answers that prove the script did not run).

use std::sync::LazyLock;
use std::time::Duration;

use super::{
    ClusterBackend, ClusterScript, FENCE_GRACE, PUBLISH_CALL, SPUBLISH_CALL, ms, run_script,
};
use crate::backend::{Acquired, Extended, Released, RwSide};
use crate::{LockError, key};

pub(super) const RW_SRC: &str = include_str!("../../scripts/rw.lua");
pub(super) static RW: LazyLock<ClusterScript> =
    LazyLock::new(|| ClusterScript::new(RW_SRC.replace(PUBLISH_CALL, SPUBLISH_CALL)));

/// The wake-up channel of `side` of the read-write lock `name`.
pub(super) fn channel(name: &str, side: RwSide) -> String {
    let lock = key::lock_key(name);
    key::suffixed(
        &lock,
        match side {
            RwSide::Read => key::RW_READERS_CHANNEL_SUFFIX,
            RwSide::Write => key::RW_WRITERS_SUFFIX,
        },
    )
}

impl ClusterBackend {
    async fn rw_call(
        &self,
        name: &str,
        op: &str,
        owner: &str,
        arg: &str,
        ttl: Duration,
    ) -> Result<redis::Value, LockError> {
        let (mut con, _) = self.conn(name)?;
        let lock = key::lock_key(name);
        let state = key::suffixed(&lock, key::RW_SUFFIX);
        let readers = key::suffixed(&lock, key::RW_READERS_SUFFIX);
        let fence = key::suffixed(&lock, key::RW_FENCE_SUFFIX);
        let rd = channel(name, RwSide::Read);
        let wr = channel(name, RwSide::Write);
        let fence_ms = ms(ttl + FENCE_GRACE).to_string();
        let keys = [state.as_str(), readers.as_str(), fence.as_str()];
        let args = [
            op.as_bytes(),
            owner.as_bytes(),
            arg.as_bytes(),
            fence_ms.as_bytes(),
            rd.as_bytes(),
            wr.as_bytes(),
        ];
        let (v, _) = run_script(&self.inner, &mut con, &RW, &keys, &args, None)
            .await
            .map_err(|e| LockError::backend(name, e))?;
        Ok(v)
    }

    pub(super) async fn rw_acquire(
        &self,
        side: RwSide,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Acquired, LockError> {
        let op = match side {
            RwSide::Read => "ar",
            RwSide::Write => "aw",
        };
        let v = self
            .rw_call(name, op, owner, &ms(ttl).to_string(), ttl)
            .await?;
        crate::scripts::acquire_reply(&v).ok_or_else(|| {
            LockError::backend(name, format!("unexpected read-write acquire reply {v:?}"))
        })
    }

    pub(super) async fn rw_give_back(
        &self,
        side: RwSide,
        name: &str,
        owner: &str,
        all: bool,
    ) -> Result<Released, LockError> {
        let op = match side {
            RwSide::Read => "rr",
            RwSide::Write => "rw",
        };
        let arg = if all { "1" } else { "0" };
        match self
            .rw_call(name, op, owner, arg, Duration::from_millis(1))
            .await?
        {
            redis::Value::Int(n) => Ok(crate::scripts::release_reply(n)),
            v => Err(LockError::backend(
                name,
                format!("unexpected read-write release reply {v:?}"),
            )),
        }
    }

    pub(super) async fn rw_renew(
        &self,
        side: RwSide,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Extended, LockError> {
        let op = match side {
            RwSide::Read => "er",
            RwSide::Write => "ew",
        };
        match self
            .rw_call(name, op, owner, &ms(ttl).to_string(), ttl)
            .await?
        {
            redis::Value::Int(n) => Ok(crate::scripts::extend_reply(n)),
            v => Err(LockError::backend(
                name,
                format!("unexpected read-write extend reply {v:?}"),
            )),
        }
    }

    pub(super) async fn rw_to_read(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Option<u64>, LockError> {
        let v = self
            .rw_call(name, "dg", owner, &ms(ttl).to_string(), ttl)
            .await?;
        match crate::scripts::acquire_reply(&v) {
            Some(Acquired::Granted { token, .. }) => Ok(Some(token)),
            _ if v == redis::Value::Int(0) => Ok(None),
            _ => Err(LockError::backend(
                name,
                format!("unexpected read-write downgrade reply {v:?}"),
            )),
        }
    }
}
