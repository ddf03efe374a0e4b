//! Read-write locks on Redis ([`crate::RwLock`]): every operation is one call of
//! `scripts/rw.lua` on the name's own keys, which share the lock's hash tag (one slot) but
//! never a key with the lock of the same name:
//!
//! | role | key / channel |
//! |---|---|
//! | state hash (writer, its count, token and lease end; the waiting writer's marker; each reader's count and token) | `dlock:{E}:rw` |
//! | readers (zset owner -> lease end, server ms) | `dlock:{E}:rw:r` |
//! | fence (last token of either side) | `dlock:{E}:rw:fence` |
//! | readers' / writers' wake-up channels | `dlock:{E}:rw:rd`, `dlock:{E}:rw:wr` |

use std::time::Duration;

use super::{FENCE_GRACE, RedisBackend, map_err, ms};
use crate::backend::{Acquired, Extended, Released, RwSide};
use crate::{LockError, key, scripts};

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

impl RedisBackend {
    /// One call of the read-write script (see the header of `rw.lua`).
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
        let rd = key::suffixed(&lock, key::RW_READERS_CHANNEL_SUFFIX);
        let wr = key::suffixed(&lock, key::RW_WRITERS_SUFFIX);
        let mut cmd = scripts::evalsha(&scripts::RW, 3, 9, 6 * lock.len() + owner.len() + 60);
        cmd.arg(&state)
            .arg(&readers)
            .arg(&fence)
            .arg(op)
            .arg(owner)
            .arg(arg)
            .arg(ms(ttl + FENCE_GRACE))
            .arg(&rd)
            .arg(&wr);
        scripts::run::<redis::Value>(&scripts::RW, &cmd, &mut con)
            .await
            .map_err(|e| map_err(name, e))
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
        scripts::acquire_reply(&v).ok_or_else(|| {
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
        let v = self
            .rw_call(name, op, owner, arg, Duration::from_millis(1))
            .await?;
        match v {
            redis::Value::Int(n) => Ok(scripts::release_reply(n)),
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
        let v = self
            .rw_call(name, op, owner, &ms(ttl).to_string(), ttl)
            .await?;
        match v {
            redis::Value::Int(n) => Ok(scripts::extend_reply(n)),
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
        match scripts::acquire_reply(&v) {
            Some(Acquired::Granted { token, .. }) => Ok(Some(token)),
            _ if v == redis::Value::Int(0) => Ok(None),
            _ => Err(LockError::backend(
                name,
                format!("unexpected read-write downgrade reply {v:?}"),
            )),
        }
    }
}
