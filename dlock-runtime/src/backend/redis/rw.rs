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

use super::{DataConn, FENCE_GRACE, PinOnDrop, RedisBackend, map_err, ms};
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

/// The pin key of the read-write lock `name`'s tries (see `Pin` in `redis.rs`): its state key,
/// so that a try of a plain lock or a semaphore of the same name never shares a pin with it.
fn pin_name(name: &str) -> String {
    key::suffixed(&key::lock_key(name), key::RW_SUFFIX)
}

impl RedisBackend {
    /// The read-write script's call (see the header of `rw.lua`).
    fn rw_cmd(name: &str, op: &str, owner: &str, arg: &str, ttl: Duration) -> redis::Cmd {
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
        cmd
    }

    /// One call of the read-write script (a renewal, a downgrade, or a give-back of an owner
    /// with no unanswered try).
    async fn rw_call(
        &self,
        name: &str,
        op: &str,
        owner: &str,
        arg: &str,
        ttl: Duration,
    ) -> Result<redis::Value, LockError> {
        let (mut con, _) = self.conn(name)?;
        let cmd = Self::rw_cmd(name, op, owner, arg, ttl);
        scripts::run::<redis::Value>(&scripts::RW, &cmd, &mut con)
            .await
            .map_err(|e| map_err(name, e))
    }

    /// A try of the read-write script: an unanswered one is pinned to its connection (as a
    /// lock's try, see `Pin`), so that its owner's give-back runs behind it.
    async fn rw_try_call(
        &self,
        name: &str,
        op: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<redis::Value, LockError> {
        let (mut con, _) = self.conn(name)?;
        con.defer_replace = true;
        let pin_key = pin_name(name);
        let mut pin = PinOnDrop {
            backend: self,
            name: &pin_key,
            owner,
            con: Some((con.con.clone(), con.runtime, con.generation)),
        };
        let cmd = Self::rw_cmd(name, op, owner, &ms(ttl).to_string(), ttl);
        let r = scripts::run::<redis::Value>(&scripts::RW, &cmd, &mut con).await;
        match &r {
            Ok(_) => pin.con = None,
            Err(e) => {
                // Pinned first, so that no give-back of this owner can take the new connection
                // before the pin exists.
                drop(pin);
                if e.is_timeout() {
                    self.replace_data(con.runtime, con.generation);
                }
            }
        }
        r.map_err(|e| map_err(name, e))
    }

    /// A give-back of the read-write script, behind `owner`'s unanswered tries on their
    /// connections (see `Pin`): a give-back of every hold behind each of them in turn (it is
    /// owner-checked and idempotent), a partial one only behind the newest.
    async fn rw_give_back_call(
        &self,
        name: &str,
        op: &str,
        owner: &str,
        all: bool,
    ) -> Result<Released, LockError> {
        let arg = if all { "1" } else { "0" };
        let reply = |v: redis::Value| match v {
            redis::Value::Int(n) => Ok(scripts::release_reply(n)),
            v => Err(LockError::backend(
                name,
                format!("unexpected read-write release reply {v:?}"),
            )),
        };
        let pin_key = pin_name(name);
        let pinned = self.pinned(&pin_key, owner);
        if pinned.is_empty() {
            return reply(
                self.rw_call(name, op, owner, arg, Duration::from_millis(1))
                    .await?,
            );
        }
        let pinned = if all {
            pinned
        } else {
            pinned.into_iter().last().into_iter().collect()
        };
        let cmd = Self::rw_cmd(name, op, owner, arg, Duration::from_millis(1));
        let mut out: Option<Released> = None;
        for (runtime, generation, pcon) in pinned {
            let mut pcon = DataConn {
                con: pcon,
                generation,
                runtime,
                backend: self,
                defer_replace: false,
            };
            let v = scripts::run::<redis::Value>(&scripts::RW, &cmd, &mut pcon)
                .await
                .map_err(|e| map_err(name, e))?;
            self.settle(&pin_key, owner, runtime, generation);
            let r = reply(v)?;
            out = Some(match (out, r) {
                (None, r) => r,
                (Some(Released::Freed), _) | (_, Released::Freed) => Released::Freed,
                (Some(Released::Decremented(_)), r @ Released::Decremented(_)) => r,
                (Some(d @ Released::Decremented(_)), Released::NotOwner) => d,
                (Some(Released::NotOwner), r) => r,
            });
        }
        Ok(out.unwrap_or(Released::NotOwner))
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
        let v = self.rw_try_call(name, op, owner, ttl).await?;
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
        self.rw_give_back_call(name, op, owner, all).await
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
