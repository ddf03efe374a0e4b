//! The in-memory backend: the same semantics as Redis inside one process.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use super::{Acquired, Backend, BoxFuture, Extended, Record, Released, RwSide, Watch};
use crate::LockError;
use crate::wait::WaitQueues;

mod rw;

mod semaphore;

#[derive(Debug)]
struct Entry {
    owner: String,
    count: u32,
    token: u64,
    expires: Instant,
}

/// Locks kept in this process: TTLs, re-entrancy, fencing tokens and wake-one waiting, with no
/// server. The default backend when nothing else is configured, and a stand-in for Redis in
/// users' own unit tests.
///
/// Fencing tokens come from one counter seeded from the wall clock in microseconds, so they
/// strictly increase per name (and across names) for the life of the process.
#[derive(Debug)]
pub struct MemoryBackend {
    locks: Mutex<HashMap<String, Entry>>,
    /// Leader records (`Backend::put_record`), by lock name.
    records: Mutex<HashMap<String, Record>>,
    /// Read-write locks ([`crate::RwLock`]): a state of their own, tokens from `next_token`.
    rw: rw::RwStore,
    next_token: AtomicU64,
    waiters: Arc<WaitQueues>,
    /// Semaphores, apart from the locks (`memory/semaphore.rs`).
    sems: semaphore::Semaphores,
    /// Fair locks' queues ([`crate::Lock::fair`]): by name, owners in arrival order with their
    /// heartbeat deadline. Taken before `locks` when both are.
    fair: Mutex<HashMap<String, VecDeque<(String, Instant)>>>,
    /// Set at the first fair try: until then a release never looks at `fair`.
    any_fair: AtomicBool,
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryBackend {
    /// A new, empty store.
    pub fn new() -> Self {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(1);
        MemoryBackend {
            records: Mutex::new(HashMap::new()),
            rw: rw::RwStore::new(),
            locks: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(seed),
            waiters: WaitQueues::new(),
            sems: semaphore::Semaphores::default(),
            fair: Mutex::new(HashMap::new()),
            any_fair: AtomicBool::new(false),
        }
    }

    fn fair_queues(&self) -> MutexGuard<'_, HashMap<String, VecDeque<(String, Instant)>>> {
        self.fair.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// True when `name` is free now.
    fn is_free(&self, name: &str, now: Instant) -> bool {
        self.lock().get(name).is_none_or(|e| e.expires <= now)
    }

    /// A fair try (see [`Backend::try_acquire_fair`]).
    fn try_acquire_fair_now(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
        heartbeat: Duration,
    ) -> Acquired {
        self.any_fair.store(true, Ordering::Release);
        let now = Instant::now();
        let mut fair = self.fair_queues();
        let q = fair.entry(name.to_string()).or_default();
        // Queued owners whose heartbeat ran out (dead or gone) leave from the head.
        while q.front().is_some_and(|(o, dl)| o != owner && *dl <= now) {
            q.pop_front();
        }
        let head = q.front().map(|(o, _)| o.clone());
        let reentry = self
            .lock()
            .get(name)
            .is_some_and(|e| e.expires > now && e.owner == owner);
        if reentry || head.as_deref().is_none_or(|h| h == owner) {
            let r = self.try_acquire_now(name, owner, ttl);
            if let Acquired::Granted { .. } = r {
                q.retain(|(o, _)| o != owner);
                if q.is_empty() {
                    fair.remove(name);
                }
                return r;
            }
            if let Some(e) = q.iter_mut().find(|(o, _)| o == owner) {
                e.1 = now + heartbeat;
            } else {
                q.push_back((owner.to_string(), now + heartbeat));
            }
            return r;
        }
        let head_deadline = q.front().map(|(_, dl)| *dl);
        if let Some(e) = q.iter_mut().find(|(o, _)| o == owner) {
            e.1 = now + heartbeat;
        } else {
            q.push_back((owner.to_string(), now + heartbeat));
        }
        drop(fair);
        let remaining = match self.lock().get(name) {
            Some(e) if e.expires > now => e.expires - now,
            // Free, but another waiter's turn: wake it (it may have missed the release), and
            // look again when its heartbeat would run out.
            _ => {
                if let Some(h) = &head {
                    self.waiters
                        .wake_first_where(name, |o| o == Some(h.as_str()));
                }
                head_deadline.map_or(heartbeat, |d| d.saturating_duration_since(now))
            }
        };
        Acquired::Busy {
            remaining: Some(remaining),
        }
    }

    /// Wakes the waiter whose turn it is after `name` was freed: the fair queue's first live
    /// owner, else the first local waiter.
    fn wake_next(&self, name: &str) {
        if self.any_fair.load(Ordering::Acquire) {
            let now = Instant::now();
            let mut fair = self.fair_queues();
            if let Some(q) = fair.get_mut(name) {
                while q.front().is_some_and(|(_, dl)| *dl <= now) {
                    q.pop_front();
                }
                if let Some((h, _)) = q.front() {
                    let h = h.clone();
                    drop(fair);
                    self.waiters
                        .wake_first_where(name, |o| o == Some(h.as_str()));
                    return;
                }
                fair.remove(name);
            }
        }
        self.waiters.wake_one(name);
    }

    /// Removes `owner` from `name`'s fair queue (a wait that ended without a grant); when the
    /// name is free, the new head is woken.
    fn leave_fair(&self, name: &str, owner: &str) {
        if !self.any_fair.load(Ordering::Acquire) {
            return;
        }
        let mut fair = self.fair_queues();
        let Some(q) = fair.get_mut(name) else {
            return;
        };
        let before = q.len();
        q.retain(|(o, _)| o != owner);
        if q.len() == before {
            return;
        }
        let empty = q.is_empty();
        if empty {
            fair.remove(name);
        }
        drop(fair);
        if !empty && self.is_free(name, Instant::now()) {
            self.wake_next(name);
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        self.locks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Number of names currently locked (expired entries are not counted).
    pub fn locked_count(&self) -> usize {
        let now = Instant::now();
        self.lock().values().filter(|e| e.expires > now).count()
    }

    /// Number of callers waiting in this process.
    pub fn waiter_count(&self) -> usize {
        self.waiters.waiter_count()
    }

    /// Number of owners queued for the fair lock `name` ([`crate::Lock::fair`]), including any
    /// whose heartbeat ran out but that no try or release has dropped yet.
    pub fn fair_queue_len(&self, name: &str) -> usize {
        self.fair_queues().get(name).map_or(0, VecDeque::len)
    }

    fn try_acquire_now(&self, name: &str, owner: &str, ttl: Duration) -> Acquired {
        let now = Instant::now();
        let mut map = self.lock();
        if let Some(e) = map.get_mut(name) {
            if e.expires > now {
                if e.owner == owner {
                    e.count = e.count.saturating_add(1);
                    e.expires = e.expires.max(now + ttl);
                    return Acquired::Granted {
                        token: e.token,
                        count: e.count,
                    };
                }
                return Acquired::Busy {
                    remaining: Some(e.expires - now),
                };
            }
            // A free or expired entry: reuse its allocations.
            let token = self.next_token.fetch_add(1, Ordering::Relaxed) + 1;
            e.owner.clear();
            e.owner.push_str(owner);
            e.count = 1;
            e.token = token;
            e.expires = now + ttl;
            return Acquired::Granted { token, count: 1 };
        }
        // Sweep free and expired entries now and then so abandoned names do not accumulate.
        if map.len() >= 1024 && map.len().is_power_of_two() {
            map.retain(|_, e| e.expires > now);
        }
        let token = self.next_token.fetch_add(1, Ordering::Relaxed) + 1;
        map.insert(
            name.to_string(),
            Entry {
                owner: owner.to_string(),
                count: 1,
                token,
                expires: now + ttl,
            },
        );
        Acquired::Granted { token, count: 1 }
    }

    fn release_now(
        &self,
        name: &str,
        owner: &str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> Released {
        let now = Instant::now();
        let mut map = self.lock();
        let Some(e) = map.get_mut(name) else {
            return Released::NotOwner;
        };
        if e.expires <= now || e.owner != owner || e.count == 0 {
            return Released::NotOwner;
        }
        e.count = if all { 0 } else { e.count - 1 };
        if e.count > 0 {
            return Released::Decremented(e.count);
        }
        match keep_for {
            Some(keep) if !keep.is_zero() => {
                e.expires = now + keep;
                Released::Freed
            }
            _ => {
                // Free: kept as an expired entry so the next acquisition reuses it.
                e.expires = now;
                drop(map);
                self.wake_next(name);
                Released::Freed
            }
        }
    }

    fn extend_now(&self, name: &str, owner: &str, ttl: Duration) -> Extended {
        let now = Instant::now();
        let mut map = self.lock();
        match map.get_mut(name) {
            // A count of zero is a released lock kept taken by `hold_at_least`: not extendable.
            Some(e) if e.expires > now && e.owner == owner && e.count > 0 => {
                e.expires = now + ttl;
                Extended::Extended
            }
            _ => Extended::Lost,
        }
    }

    /// Deletes every hold of the read-write lock `name` whatever its owners, as an operator
    /// would (for tests of the lost-lease signal).
    pub fn force_delete_rw(&self, name: &str) -> bool {
        self.rw.force_delete(name)
    }

    /// Deletes a lock whatever its owner, as an operator's `DEL` would (for tests of the
    /// lost-lease signal).
    pub fn force_delete(&self, name: &str) -> bool {
        let now = Instant::now();
        let removed = self.lock().remove(name).is_some_and(|e| e.expires > now);
        if removed {
            self.waiters.wake_one(name);
        }
        removed
    }
}

impl Backend for MemoryBackend {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        let r = self.try_acquire_now(name, owner, ttl);
        Box::pin(async move { Ok(r) })
    }

    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        if all {
            self.leave_fair(name, owner);
        }
        let r = self.release_now(name, owner, keep_for, all);
        Box::pin(async move { Ok(r) })
    }

    fn supports_fair(&self) -> bool {
        true
    }

    fn try_acquire_fair<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
        heartbeat: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        let r = self.try_acquire_fair_now(name, owner, ttl, heartbeat);
        Box::pin(async move { Ok(r) })
    }

    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        let r = self.extend_now(name, owner, ttl);
        Box::pin(async move { Ok(r) })
    }

    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        let w = self.waiters.register(name);
        Box::pin(async move { Ok(w) })
    }

    fn has_waiters(&self, name: &str) -> bool {
        self.waiters.has_waiters(name)
    }

    fn try_acquire_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        max: u32,
        permits: u32,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        let r = self.try_acquire_permits_now(name, owner, max, permits, ttl);
        Box::pin(async move { r })
    }

    fn release_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        let r = self.release_permits_now(name, owner);
        Box::pin(async move { Ok(r) })
    }

    fn extend_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        let r = self.extend_permits_now(name, owner, ttl);
        Box::pin(async move { Ok(r) })
    }

    fn watch_permits<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        let w = self.sems.waiters.register(name);
        Box::pin(async move { Ok(w) })
    }

    fn has_permit_waiters(&self, name: &str) -> bool {
        self.sems.waiters.has_waiters(name)
    }

    fn supports_rw(&self) -> bool {
        true
    }

    fn rw_try_acquire<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        let r = self
            .rw
            .try_acquire(&self.next_token, side, name, owner, ttl);
        Box::pin(async move { Ok(r) })
    }

    fn rw_release<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        let r = self.rw.release(side, name, owner, all);
        Box::pin(async move { Ok(r) })
    }

    fn rw_extend<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        let r = self.rw.extend(side, name, owner, ttl);
        Box::pin(async move { Ok(r) })
    }

    fn rw_downgrade<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<u64>, LockError>> {
        let r = self.rw.downgrade(&self.next_token, name, owner, ttl);
        Box::pin(async move { Ok(r) })
    }

    fn rw_watch<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        let w = self.rw.queues(side).register(name);
        Box::pin(async move { Ok(w) })
    }

    fn rw_has_waiters(&self, side: RwSide, name: &str) -> bool {
        self.rw.queues(side).has_waiters(name)
    }

    fn put_record<'a>(
        &'a self,
        name: &'a str,
        epoch: u64,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        let mut records = self.records.lock().unwrap_or_else(|e| e.into_inner());
        let written = match records.get(name) {
            Some(r) if r.epoch > epoch => false,
            _ => {
                let value = value.to_string();
                records.insert(name.to_string(), Record { epoch, value });
                true
            }
        };
        Box::pin(async move { Ok(written) })
    }

    fn get_record<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<Record>, LockError>> {
        let r = self
            .records
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned();
        Box::pin(async move { Ok(r) })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn freed_names_do_not_accumulate() {
        let b = MemoryBackend::new();
        let ttl = Duration::from_secs(30);
        for i in 0..10_000 {
            let name = format!("n{i}");
            assert!(matches!(
                b.try_acquire_now(&name, "o", ttl),
                Acquired::Granted { count: 1, .. }
            ));
            assert_eq!(b.release_now(&name, "o", None, true), Released::Freed);
        }
        assert_eq!(b.locked_count(), 0);
        assert!(b.lock().len() <= 2048, "{} entries kept", b.lock().len());
    }

    #[test]
    fn a_freed_entry_is_reused_with_a_new_owner_and_a_larger_token() {
        let b = MemoryBackend::new();
        let ttl = Duration::from_secs(30);
        let Acquired::Granted { token: t1, .. } = b.try_acquire_now("k", "a", ttl) else {
            panic!("not granted")
        };
        assert_eq!(b.release_now("k", "a", None, true), Released::Freed);
        let Acquired::Granted { token: t2, .. } = b.try_acquire_now("k", "b", ttl) else {
            panic!("not granted")
        };
        assert!(t2 > t1);
        // The old owner cannot touch the new hold.
        assert_eq!(b.release_now("k", "a", None, true), Released::NotOwner);
        assert_eq!(b.extend_now("k", "a", ttl), Extended::Lost);
        assert!(matches!(
            b.try_acquire_now("k", "c", ttl),
            Acquired::Busy { .. }
        ));
        assert!(b.force_delete("k"));
        assert!(!b.force_delete("k"));
    }
}
