//! Fair locks on Redis ([`crate::Lock::fair`]): waiters served in arrival order across
//! processes, by `scripts/fair_acquire.lua` and `scripts/fair_release.lua` on the lock's keys
//! plus two of their own (same hash tag, so one Cluster slot):
//!
//! | role | key |
//! |---|---|
//! | queue (zset owner id -> arrival number) | `dlock:{E}:fq` |
//! | heartbeats (hash owner id -> deadline, server ms) | `dlock:{E}:fh` |
//!
//! A queued owner's heartbeat is set by each of its tries to one renewal period (ttl/3) past
//! the server's `TIME`; the runtime tries again every half period while it waits. A try or a
//! release that finds the head's heartbeat run out drops it, so a waiter whose process died
//! leaves within one renewal period of its last try. A release wakes exactly the head's waiter
//! (`f<owner>` on the release channel). A non-fair lock never touches these keys and its
//! scripts are unchanged.
//!
//! The backend remembers which owners tried fairly ([`FairOwners`]), so that their releases
//! (the holder's, and a give-up's or a lost try's `release(all)`) run the fair release, which
//! also leaves the queue. A release that misses it (another process's backend, a forgotten
//! entry) runs the plain script: the queue's head is then woken by the next try of any queued
//! owner (which publishes `f<head>` when the lock is free and it is not its turn) within half a
//! renewal period.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use redis::Value;
use tokio::time::Instant;

use super::{DataConn, FENCE_GRACE, PinOnDrop, RedisBackend, map_err, ms};
use crate::backend::{Acquired, Released};
use crate::{LockError, key, scripts};

/// How long an entry of [`FairOwners`] is kept without a release (a hold lost without one).
const FORGET_AFTER: Duration = Duration::from_secs(3600);

/// (lock name, owner) of the fair tries of this backend whose owner was not released yet.
#[derive(Default)]
pub(crate) struct FairOwners {
    owners: Mutex<HashMap<(String, String), Instant>>,
}

impl FairOwners {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Instant>> {
        self.owners.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn note(&self, name: &str, owner: &str) {
        let now = Instant::now();
        let mut m = self.map();
        if m.len() >= 1024 && m.len().is_power_of_two() {
            m.retain(|_, t| now.duration_since(*t) < FORGET_AFTER);
        }
        m.insert((name.to_string(), owner.to_string()), now);
    }

    /// True when `owner` tried `name` fairly (one uncontended lock and an empty check when no
    /// fair lock is in use).
    pub(crate) fn contains(&self, name: &str, owner: &str) -> bool {
        let m = self.map();
        !m.is_empty() && m.contains_key(&(name.to_string(), owner.to_string()))
    }

    pub(crate) fn forget(&self, name: &str, owner: &str) {
        self.map().remove(&(name.to_string(), owner.to_string()));
    }
}

/// The keys of the fair lock `name`: lock, fence, queue, heartbeats, release channel.
pub(crate) fn fair_keys(name: &str) -> [String; 5] {
    let lock = key::lock_key(name);
    [
        key::suffixed(&lock, key::FENCE_SUFFIX),
        key::suffixed(&lock, key::FAIR_QUEUE_SUFFIX),
        key::suffixed(&lock, key::FAIR_HEARTBEAT_SUFFIX),
        key::suffixed(&lock, key::CHANNEL_SUFFIX),
        lock,
    ]
}

impl RedisBackend {
    /// [`crate::Backend::try_acquire_fair`]; an unanswered call is pinned to its connection as a
    /// plain try is, so its owner's give-back (which also leaves the queue) runs behind it.
    pub(crate) async fn fair_try_acquire(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
        heartbeat: Duration,
    ) -> Result<Acquired, LockError> {
        self.inner.fair.note(name, owner);
        let (mut con, _) = self.conn(name)?;
        con.defer_replace = true;
        let mut pin = PinOnDrop {
            backend: self,
            name,
            owner,
            con: Some((con.con.clone(), con.runtime, con.generation)),
        };
        let [fence, queue, beats, channel, lock] = fair_keys(name);
        let mut cmd = scripts::evalsha(
            &scripts::FAIR_ACQUIRE,
            4,
            9,
            6 * lock.len() + owner.len() + 60,
        );
        cmd.arg(&lock)
            .arg(&fence)
            .arg(&queue)
            .arg(&beats)
            .arg(owner)
            .arg(ms(ttl))
            .arg(ms(ttl + FENCE_GRACE))
            .arg(ms(heartbeat))
            .arg(&channel);
        let r: redis::RedisResult<Value> =
            scripts::run(&scripts::FAIR_ACQUIRE, &cmd, &mut con).await;
        match &r {
            Ok(_) => pin.con = None,
            Err(e) => {
                drop(pin);
                if e.is_timeout() {
                    self.replace_data(con.runtime, con.generation);
                }
            }
        }
        let v = r.map_err(|e| map_err(name, e))?;
        scripts::acquire_reply(&v).ok_or_else(|| {
            LockError::backend(
                name,
                format!("unexpected reply from the fair acquire script: {v:?}"),
            )
        })
    }

    /// One owner-checked release of a fair lock's owner (see `fair_release.lua`), behind its
    /// unanswered tries (see `Pin`), as `release_once`.
    pub(super) async fn fair_release_once(
        &self,
        name: &str,
        owner: &str,
        keep_for: Option<Duration>,
        all: bool,
        publish: bool,
    ) -> Result<Released, LockError> {
        let (mut con, _) = self.conn(name)?;
        let [_, queue, beats, channel, lock] = fair_keys(name);
        let keep = keep_for.filter(|d| !d.is_zero()).map(ms).unwrap_or(0);
        let mut cmd = scripts::evalsha(
            &scripts::FAIR_RELEASE,
            3,
            7,
            5 * lock.len() + owner.len() + 40,
        );
        cmd.arg(&lock)
            .arg(&queue)
            .arg(&beats)
            .arg(owner)
            .arg(keep)
            .arg(if publish { channel.as_str() } else { "" })
            .arg(if all { 1 } else { 0 });
        let pinned = self.pinned(name, owner);
        let out = if pinned.is_empty() {
            let r: i64 = scripts::run(&scripts::FAIR_RELEASE, &cmd, &mut con)
                .await
                .map_err(|e| map_err(name, e))?;
            scripts::release_reply(r)
        } else {
            let pinned = if all {
                pinned
            } else {
                pinned.into_iter().last().into_iter().collect()
            };
            let mut out: Option<Released> = None;
            for (runtime, generation, pcon) in pinned {
                let mut pcon = DataConn {
                    con: pcon,
                    generation,
                    runtime,
                    backend: self,
                    defer_replace: false,
                };
                let r: i64 = scripts::run(&scripts::FAIR_RELEASE, &cmd, &mut pcon)
                    .await
                    .map_err(|e| map_err(name, e))?;
                self.settle(name, owner, runtime, generation);
                let r = scripts::release_reply(r);
                out = Some(match (out, r) {
                    (None, r) => r,
                    (Some(Released::Freed), _) | (_, Released::Freed) => Released::Freed,
                    (Some(Released::Decremented(_)), r @ Released::Decremented(_)) => r,
                    (Some(d @ Released::Decremented(_)), Released::NotOwner) => d,
                    (Some(Released::NotOwner), r) => r,
                });
            }
            out.unwrap_or(Released::NotOwner)
        };
        // Nothing of this owner is left on the server: every hold given back, and its place in
        // the queue with a release of every hold.
        if all || out == Released::Freed {
            self.inner.fair.forget(name, owner);
        }
        Ok(out)
    }
}
