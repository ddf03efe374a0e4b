//! The Redis backend's semaphores: a hash of owner -> permits (plus the name's `max` and the
//! permits in use) and a zset of owner -> lease end in the server's milliseconds, changed only
//! by the scripts beside this file, which judge every lease by the server's `TIME`.
//!
//! | role | key | example for `exports` |
//! |---|---|---|
//! | holders (hash `owner -> permits`, `:max`, `:used`) | `dlock:sem:{E}` | `dlock:sem:{exports}` |
//! | leases (zset `owner -> lease end`, server ms) | `dlock:sem:{E}:z` | `dlock:sem:{exports}:z` |
//! | fencing counter (string, kept past release) | `dlock:sem:{E}:fence` | `dlock:sem:{exports}:fence` |
//! | release channel (pub/sub, payload `p<k>`) | `dlock:sem:{E}:rel` | `dlock:sem:{exports}:rel` |
//!
//! `E` is the lock's escaped name ([`crate::backend::redis_keys`]), so the hash tag, and the
//! Cluster slot, is the lock's of the same name; no key starts with `dlock:{`, so none is ever a
//! lock's key. Tokens come from the lock's counter family: `max(last + 1, server time in µs)`.
//!
//! Waiting reuses the runtime's pub/sub connection and wait queues under the semaphore's own
//! channel; a release publishes `p<k>` and every process with waiters wakes `k` of them (within
//! a process no herd; across processes up to `k` per process try).

use std::sync::LazyLock;
use std::time::Duration;

use redis::{Script, Value};
use tokio::sync::oneshot;

use super::{
    Ctl, DataConn, FENCE_GRACE, PinOnDrop, RedisBackend, is_refusal, map_err, ms, run_then_wait,
    wait_reply,
};
use crate::backend::{Acquired, Extended, Released, Watch};
use crate::{LockError, key, scripts};

static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("semaphore_acquire.lua")));
static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("semaphore_release.lua")));
static EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("semaphore_extend.lua")));

/// The Redis names of one semaphore (see the module's table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SemKeys {
    pub(crate) hash: String,
    pub(crate) leases: String,
    pub(crate) fence: String,
    pub(crate) channel: String,
}

/// The keys of the semaphore `name`: the lock key `dlock:{E}` with `sem:` after `dlock:`.
pub(crate) fn sem_keys(name: &str) -> SemKeys {
    let lock = key::lock_key(name);
    let hash = format!("dlock:sem:{}", &lock["dlock:".len()..]);
    SemKeys {
        leases: key::suffixed(&hash, ":z"),
        fence: key::suffixed(&hash, key::FENCE_SUFFIX),
        channel: key::suffixed(&hash, key::CHANNEL_SUFFIX),
        hash,
    }
}

/// The acquire script's reply (see `semaphore_acquire.lua`).
pub(crate) fn acquire_reply(name: &str, max: u32, v: &Value) -> Result<Acquired, LockError> {
    match v {
        Value::Array(a) => match a.as_slice() {
            [Value::BulkString(tag), Value::BulkString(stored)] if tag == b"max" => {
                let stored = std::str::from_utf8(stored)
                    .ok()
                    .and_then(|s| s.parse::<u32>().ok())
                    .ok_or_else(|| {
                        LockError::backend(name, format!("unreadable stored max {stored:?}"))
                    })?;
                Err(LockError::SemaphoreMax {
                    key: name.to_string(),
                    asked: max,
                    stored,
                })
            }
            _ => Err(unexpected(name, v)),
        },
        v => scripts::acquire_reply(v).ok_or_else(|| unexpected(name, v)),
    }
}

fn unexpected(name: &str, v: &Value) -> LockError {
    LockError::backend(
        name,
        format!("unexpected reply from the semaphore acquire script: {v:?}"),
    )
}

impl RedisBackend {
    /// [`crate::Backend::try_acquire_permits`]; an unanswered call is pinned to its connection,
    /// as a lock's acquire is, so the give-back of its owner runs behind it.
    pub(crate) async fn sem_try_acquire(
        &self,
        name: &str,
        owner: &str,
        max: u32,
        permits: u32,
        ttl: Duration,
    ) -> Result<Acquired, LockError> {
        self.sem_try_acquire_then_wait(name, owner, max, permits, ttl, None)
            .await
            .map(|(a, _)| a)
    }

    /// [`RedisBackend::sem_try_acquire`]; with `wait = Some((n, timeout))` the script is followed
    /// by `WAIT n timeout` in one pipeline on the same connection (the Sentinel backend's
    /// `min_replicas`), whose answer is returned beside the grant (as
    /// [`RedisBackend::acquire_then_wait`] does for a lock).
    pub(crate) async fn sem_try_acquire_then_wait(
        &self,
        name: &str,
        owner: &str,
        max: u32,
        permits: u32,
        ttl: Duration,
        wait: Option<(usize, Duration)>,
    ) -> Result<(Acquired, Option<Result<usize, String>>), LockError> {
        let (mut con, _) = self.conn(name)?;
        con.defer_replace = true;
        let mut pin = PinOnDrop {
            backend: self,
            name,
            owner,
            con: Some((con.con.clone(), con.runtime, con.generation)),
        };
        let k = sem_keys(name);
        let mut cmd = scripts::evalsha(
            &ACQUIRE,
            3,
            8,
            k.hash.len() + k.leases.len() + k.fence.len() + owner.len() + 60,
        );
        cmd.arg(&k.hash)
            .arg(&k.leases)
            .arg(&k.fence)
            .arg(owner)
            .arg(max)
            .arg(permits)
            .arg(ms(ttl))
            .arg(ms(ttl + FENCE_GRACE));
        let r = run_then_wait(&ACQUIRE, cmd, wait, &mut con).await;
        match &r {
            Ok(_) => pin.con = None,
            Err(e) => {
                drop(pin);
                if e.is_timeout() {
                    self.replace_data(con.runtime, con.generation);
                }
            }
        }
        let (v, acked) = r.map_err(|e| map_err(name, e))?;
        Ok((acquire_reply(name, max, &v)?, wait_reply(acked)))
    }

    /// One owner-checked release of every permit of `owner`, behind its unanswered acquire
    /// calls (on their connections, see `Pin`).
    async fn sem_release_once(&self, name: &str, owner: &str) -> Result<Released, LockError> {
        let (mut con, _) = self.conn(name)?;
        let k = sem_keys(name);
        let mut cmd = scripts::evalsha(
            &RELEASE,
            2,
            4,
            k.hash.len() + k.leases.len() + k.channel.len() + owner.len() + 20,
        );
        cmd.arg(&k.hash).arg(&k.leases).arg(owner).arg(&k.channel);
        let reply = |r: i64| {
            if r < 0 {
                Released::NotOwner
            } else {
                Released::Freed
            }
        };
        let pinned = self.pinned(name, owner);
        if pinned.is_empty() {
            let r: i64 = scripts::run(&RELEASE, &cmd, &mut con)
                .await
                .map_err(|e| map_err(name, e))?;
            return Ok(reply(r));
        }
        let mut out = Released::NotOwner;
        for (runtime, generation, pcon) in pinned {
            let mut pcon = DataConn {
                con: pcon,
                generation,
                runtime,
                backend: self,
                defer_replace: false,
            };
            let r: i64 = scripts::run(&RELEASE, &cmd, &mut pcon)
                .await
                .map_err(|e| map_err(name, e))?;
            self.settle(name, owner, runtime, generation);
            if reply(r) == Released::Freed {
                out = Released::Freed;
            }
        }
        Ok(out)
    }

    /// [`crate::Backend::release_permits`]: a release that got no answer is retried in the
    /// background by the backend's reaper (idempotent and owner-checked).
    pub(crate) async fn sem_release(&self, name: &str, owner: &str) -> Result<Released, LockError> {
        let r = self.sem_release_once(name, owner).await;
        if matches!(r, Err(LockError::Backend { .. })) {
            let me = self.clone();
            let (n, o) = (name.to_string(), owner.to_string());
            self.inner
                .reaper
                .retry(name, owner, self.inner.url.clone(), move || {
                    let (me, n, o) = (me.clone(), n.clone(), o.clone());
                    async move { me.sem_release_once(&n, &o).await }
                });
        }
        r
    }

    /// [`crate::Backend::extend_permits`].
    pub(crate) async fn sem_extend(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Extended, LockError> {
        let (mut con, _) = self.conn(name)?;
        let k = sem_keys(name);
        let mut cmd = scripts::evalsha(
            &EXTEND,
            2,
            4,
            k.hash.len() + k.leases.len() + owner.len() + 20,
        );
        cmd.arg(&k.hash).arg(&k.leases).arg(owner).arg(ms(ttl));
        let r: i64 = scripts::run(&EXTEND, &cmd, &mut con)
            .await
            .map_err(|e| map_err(name, e))?;
        Ok(scripts::extend_reply(r))
    }

    /// [`crate::Backend::watch_permits`]: a place in the semaphore channel's local queue,
    /// subscribed before this returns (see `RedisBackend::watch_channel`).
    pub(crate) async fn sem_watch(&self, name: &str) -> Result<Watch, LockError> {
        self.watch_channel(name, sem_keys(name).channel).await
    }

    /// [`crate::Backend::has_permit_waiters`].
    pub(crate) fn sem_has_waiters(&self, name: &str) -> bool {
        match self.conn(name) {
            Ok((_, sub)) => sub.queues.has_waiters(&sem_keys(name).channel),
            Err(_) => false,
        }
    }

    /// Registers a waiter on `channel`'s local queue and waits until the runtime's subscriber
    /// confirms the channel (or falls back to the lease timer when it cannot).
    pub(crate) async fn watch_channel(
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
        // Every registration asks the subscriber task, which answers once the channel is
        // subscribed on a live connection (at once when it already is); this keeps "subscribed
        // before we retry" true even while a first waiter's SUBSCRIBE is still in flight or a
        // lost connection is being replaced.
        let (tx, rx) = oneshot::channel();
        if sub.ctl.send(Ctl::Subscribe(channel, tx)).is_err() {
            watch.set_fallback_only();
            return Ok(watch);
        }
        match rx.await {
            Ok(Ok(())) => self.note_accepted(),
            Ok(Err(e)) => {
                // Not subscribed yet: the waiter uses the lease timer until the subscriber task
                // confirms the channel, which then wakes it to retry.
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
    fn semaphore_keys_share_the_lock_slot_and_never_are_lock_keys() {
        let k = sem_keys("exports");
        assert_eq!(k.hash, "dlock:sem:{exports}");
        assert_eq!(k.leases, "dlock:sem:{exports}:z");
        assert_eq!(k.fence, "dlock:sem:{exports}:fence");
        assert_eq!(k.channel, "dlock:sem:{exports}:rel");
        let k = sem_keys("a}b{c");
        assert_eq!(k.hash, "dlock:sem:{a\\)b\\(c}");
        for name in ["sem:{x}", "x", "dlock:sem:{x}"] {
            let lock = crate::backend::redis_keys(name);
            let k = sem_keys(name);
            for s in [&k.hash, &k.leases, &k.fence, &k.channel] {
                assert!(!s.starts_with("dlock:{"), "{s}");
                assert_ne!(s, &lock.lock);
            }
        }
    }

    #[test]
    fn a_max_mismatch_reply_is_a_typed_error() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        assert!(matches!(
            acquire_reply("s", 4, &Value::Array(vec![bulk("max"), bulk("3")])),
            Err(LockError::SemaphoreMax {
                asked: 4,
                stored: 3,
                ..
            })
        ));
        assert!(matches!(
            acquire_reply("s", 4, &bulk("17")),
            Ok(Acquired::Granted { token: 17, .. })
        ));
        assert!(matches!(
            acquire_reply("s", 4, &Value::Int(250)),
            Ok(Acquired::Busy { remaining: Some(d) }) if d == Duration::from_millis(250)
        ));
        assert!(acquire_reply("s", 4, &Value::Array(vec![bulk("max"), bulk("x")])).is_err());
    }
}

#[cfg(test)]
mod heard_tests {
    use super::super::{Heard, Queueing, heard, on_release_message};
    use crate::wait::WaitQueues;

    /// `p<k>` wakes `k` local waiters of the channel (no more, none of another channel); a
    /// malformed count is an ordinary release (one waiter).
    #[tokio::test]
    async fn a_permit_release_wakes_k_waiters() {
        assert_eq!(heard(b"p3", "x"), Heard::Permits(3));
        assert_eq!(heard(b"p", "x"), Heard::All);
        assert_eq!(heard(b"px", "x"), Heard::All);
        let queues = WaitQueues::new();
        let q = Queueing::new();
        let ws: Vec<_> = (0..5).map(|_| queues.register("ch")).collect();
        let other = queues.register("other");
        on_release_message(&queues, &q, "ch", b"p3", |_| {});
        let n = ws.iter().filter(|w| has_wake_up(w)).count();
        assert_eq!(n, 3);
        assert!(!has_wake_up(&other));
    }

    /// True when `w` holds a wake-up (consumes it).
    fn has_wake_up(w: &crate::backend::Watch) -> bool {
        let mut f = std::pin::pin!(w.woken());
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        std::future::Future::poll(f.as_mut(), &mut cx).is_ready()
    }
}
