//! Local wait queues: one FIFO per lock name, a release wakes one waiter, not all.
//!
//! Both backends use this: the in-memory backend wakes a queue on release directly, the Redis
//! backend from the pub/sub message of a release. A waiter stays in its queue while it retries,
//! so a release that lands during a retry marks it again instead of being lost; a waiter that
//! leaves with an unused wake-up passes it on to the next one.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

#[derive(Debug)]
struct Slot {
    id: u64,
    woken: AtomicBool,
    notify: Notify,
    /// The owner id of the waiter's tries (see [`Watch::set_owner`]).
    owner: Mutex<Option<Arc<str>>>,
}

impl Slot {
    fn owner_is(&self, owner: &str) -> bool {
        self.owner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_deref()
            == Some(owner)
    }

    fn owner(&self) -> Option<Arc<str>> {
        self.owner.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Slot {
    fn wake(&self) {
        self.woken.store(true, Ordering::Release);
        self.notify.notify_one();
    }
}

#[derive(Debug, Default)]
struct Queue {
    slots: VecDeque<Arc<Slot>>,
    /// When the current holder's lease ends, as last reported by a failed try.
    lease_end: Option<Instant>,
    /// The same, only as a server reported it (a busy reply with the time left; never a guess):
    /// a waiter whose own tries went unanswered reports it with its time-out. Cleared by a
    /// release.
    reported_end: Option<Instant>,
}

/// Called when a queue becomes empty (the Redis backend unsubscribes then).
pub(crate) type OnEmpty = Box<dyn Fn(&str) + Send + Sync>;

/// Called when a queue becomes empty, with whether the last waiter left holding a wake-up it
/// did not use (the PostgreSQL backend then passes the wake-up on to the next process in line).
pub(crate) type OnEmptyWoken = Box<dyn Fn(&str, bool) + Send + Sync>;

/// The wait queues of one backend: a FIFO per lock name; a release wakes one waiter.
///
/// A backend built outside this crate uses it to implement [`crate::Backend::watch`] (return
/// [`WaitQueues::register`]) and [`crate::Backend::has_waiters`], and calls
/// [`WaitQueues::wake_one`] when a lock is freed (or [`WaitQueues::wake_all`] when releases may
/// have been missed). Waiters also retry when the holder's lease ends, so a backend that cannot
/// observe releases stays correct, only slower.
pub struct WaitQueues {
    queues: Mutex<HashMap<String, Queue>>,
    next_id: AtomicU64,
    on_empty: Option<OnEmpty>,
    on_empty_woken: Option<OnEmptyWoken>,
}

impl fmt::Debug for WaitQueues {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WaitQueues")
            .field("queues", &self.lock().len())
            .finish()
    }
}

impl WaitQueues {
    /// Empty queues.
    pub fn new() -> Arc<Self> {
        Self::with_on_empty(None)
    }

    /// Empty queues that call `on_empty(key)` when a name's last waiter leaves.
    pub(crate) fn with_on_empty(on_empty: Option<OnEmpty>) -> Arc<Self> {
        Arc::new(WaitQueues {
            queues: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            on_empty,
            on_empty_woken: None,
        })
    }

    /// Empty queues that call `on_empty(key, woken)` when a name's last waiter leaves;
    /// `woken`: it left with a wake-up it did not use (PostgreSQL's waiters' FIFO).
    pub(crate) fn with_on_empty_woken(on_empty: OnEmptyWoken) -> Arc<Self> {
        Arc::new(WaitQueues {
            queues: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            on_empty: None,
            on_empty_woken: Some(on_empty),
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Queue>> {
        // A panic while holding this lock cannot leave the map inconsistent (every update is a
        // single push/remove), so a poisoned lock is still usable.
        self.queues.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a waiter at the back of `key`'s queue.
    pub fn register(self: &Arc<Self>, key: &str) -> Watch {
        let slot = Arc::new(Slot {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            woken: AtomicBool::new(false),
            notify: Notify::new(),
            owner: Mutex::new(None),
        });
        let mut map = self.lock();
        match map.get_mut(key) {
            Some(q) => q.slots.push_back(slot.clone()),
            None => {
                let mut q = Queue::default();
                q.slots.push_back(slot.clone());
                map.insert(key.to_string(), q);
            }
        }
        drop(map);
        Watch {
            queues: Arc::downgrade(self),
            key: key.to_string(),
            slot,
            fallback_only: false,
        }
    }

    /// True when `key` has waiters.
    pub fn has_waiters(&self, key: &str) -> bool {
        self.lock().contains_key(key)
    }

    /// True when any name has waiters (a cheap check before building a name's key).
    pub(crate) fn any_waiters(&self) -> bool {
        !self.lock().is_empty()
    }

    /// Wakes the first waiter of `key` that is not already woken. Returns whether one was.
    pub fn wake_one(&self, key: &str) -> bool {
        let mut map = self.lock();
        if let Some(q) = map.get_mut(key) {
            q.reported_end = None;
        }
        if let Some(q) = map.get(key)
            && let Some(s) = q.slots.iter().find(|s| !s.woken.load(Ordering::Acquire))
        {
            s.wake();
            return true;
        }
        false
    }

    /// Wakes the waiter of `key` whose tries use `owner` (see [`Watch::set_owner`]): a backend
    /// that queues each contender on the server (ZooKeeper, etcd) wakes exactly the one whose
    /// turn came, not the first local waiter. When no waiter has that owner (it changed its
    /// owner id after a failed try, or never said), the first waiter not yet woken is woken
    /// instead, so the turn is not lost. Returns whether one was.
    pub fn wake_owner(&self, key: &str, owner: &str) -> bool {
        {
            let map = self.lock();
            if let Some(q) = map.get(key)
                && let Some(s) = q.slots.iter().find(|s| s.owner_is(owner))
            {
                s.wake();
                return true;
            }
        }
        self.wake_one(key)
    }

    /// Wakes the first waiter of `key`, not yet woken, whose owner id (see
    /// [`Watch::set_owner`]; `None` when it never said) passes `pick`. `pick` runs under this
    /// queue's lock: it must not take locks that are held while calling into these queues.
    pub fn wake_first_where(&self, key: &str, pick: impl Fn(Option<&str>) -> bool) -> bool {
        let map = self.lock();
        if let Some(q) = map.get(key)
            && let Some(s) = q
                .slots
                .iter()
                .find(|s| !s.woken.load(Ordering::Acquire) && pick(s.owner().as_deref()))
        {
            s.wake();
            return true;
        }
        false
    }

    /// Wakes the first waiter of `key` unless one of its waiters is woken already and has not
    /// yet started its retry: that retry comes after the release being reported, so it sees it
    /// too. For a backend that hears one release several times (Redlock: once per node), so
    /// that the copies do not wake more waiters. Returns whether one was woken.
    pub(crate) fn wake_one_unless_pending(&self, key: &str) -> bool {
        let mut map = self.lock();
        if let Some(q) = map.get_mut(key) {
            q.reported_end = None;
        }
        if let Some(q) = map.get(key)
            && !q.slots.iter().any(|s| s.woken.load(Ordering::Acquire))
            && let Some(s) = q.slots.front()
        {
            s.wake();
            return true;
        }
        false
    }

    /// Wakes every waiter (after a lost pub/sub connection: releases may have been missed).
    pub fn wake_all(&self) {
        for q in self.lock().values() {
            for s in &q.slots {
                s.wake();
            }
        }
    }

    /// For every name, wakes its first waiter unless one of its waiters is already woken (a
    /// backend that cannot observe every release re-checks with this now and then).
    pub fn wake_first_of_each(&self) {
        for q in self.lock().values() {
            if !q.slots.iter().any(|s| s.woken.load(Ordering::Acquire))
                && let Some(s) = q.slots.front()
            {
                s.wake();
            }
        }
    }

    /// The names that have waiters now.
    pub(crate) fn names(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// Number of waiters over all names (for tests and metrics).
    pub fn waiter_count(&self) -> usize {
        self.lock().values().map(|q| q.slots.len()).sum()
    }

    fn set_lease_end(&self, key: &str, end: Instant) {
        if let Some(q) = self.lock().get_mut(key) {
            q.lease_end = Some(end);
        }
    }

    fn lease_end(&self, key: &str) -> Option<Instant> {
        self.lock().get(key).and_then(|q| q.lease_end)
    }

    fn set_reported_end(&self, key: &str, end: Instant) {
        if let Some(q) = self.lock().get_mut(key) {
            q.reported_end = Some(end);
        }
    }

    fn reported_end(&self, key: &str) -> Option<Instant> {
        self.lock().get(key).and_then(|q| q.reported_end)
    }

    fn remove(&self, key: &str, slot: &Slot) {
        let mut map = self.lock();
        let Some(q) = map.get_mut(key) else { return };
        q.slots.retain(|s| s.id != slot.id);
        if q.slots.is_empty() {
            map.remove(key);
            drop(map);
            if let Some(cb) = &self.on_empty {
                cb(key);
            }
            if let Some(cb) = &self.on_empty_woken {
                cb(key, slot.woken.load(Ordering::Acquire));
            }
            return;
        }
        // An unused wake-up goes to the next waiter, so a release is never swallowed by a
        // waiter that gave up.
        if slot.woken.load(Ordering::Acquire)
            && let Some(s) = q.slots.iter().find(|s| !s.woken.load(Ordering::Acquire))
        {
            s.wake();
        }
    }
}

/// A place in the wait queue of one lock name, returned by [`crate::Backend::watch`].
///
/// Dropping it leaves the queue; a wake-up it received but did not use is passed on.
pub struct Watch {
    queues: Weak<WaitQueues>,
    key: String,
    slot: Arc<Slot>,
    fallback_only: bool,
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watch")
            .field("key", &self.key)
            .field("woken", &self.slot.woken.load(Ordering::Relaxed))
            .field("fallback_only", &self.fallback_only)
            .finish()
    }
}

impl Watch {
    /// Names the owner id this waiter's tries use, so that a backend can wake exactly this
    /// waiter ([`WaitQueues::wake_owner`]). The acquire loop calls it when it queues and
    /// whenever it changes the owner id.
    pub fn set_owner(&self, owner: &Arc<str>) {
        *self.slot.owner.lock().unwrap_or_else(|e| e.into_inner()) = Some(owner.clone());
    }

    /// Marks this watch as one that cannot be woken by releases (pub/sub unavailable): waiting
    /// then relies on the holder's remaining lease alone.
    pub(crate) fn set_fallback_only(&mut self) {
        self.fallback_only = true;
    }

    /// True when wake-ups cannot reach this watch (the backend's pub/sub is unavailable).
    pub fn is_fallback_only(&self) -> bool {
        self.fallback_only
    }

    /// Waits until a release wakes this waiter, consuming the wake-up. Returns at once when a
    /// wake-up arrived since the last call.
    pub async fn woken(&self) {
        loop {
            let notified = self.slot.notify.notified();
            if self.slot.woken.swap(false, Ordering::AcqRel) {
                return;
            }
            notified.await;
        }
    }

    /// Records when the holder's lease ends, as a failed try reported it, for waiters that
    /// queue later without trying.
    pub fn note_remaining(&self, remaining: Duration) {
        if let Some(q) = self.queues.upgrade()
            && let Some(end) = Instant::now().checked_add(remaining)
        {
            q.set_lease_end(&self.key, end);
        }
    }

    /// When the holder's lease ends, as last reported to this queue.
    pub fn lease_end(&self) -> Option<Instant> {
        self.queues.upgrade().and_then(|q| q.lease_end(&self.key))
    }

    /// Records when the holder's lease ends as a server reported it (a busy reply's time left),
    /// for every waiter of this name in this process.
    pub fn note_reported_end(&self, end: Instant) {
        if let Some(q) = self.queues.upgrade() {
            q.set_reported_end(&self.key, end);
        }
    }

    /// The holder's lease end as last reported by a server to any waiter of this name here,
    /// since the last release; `None` when no busy reply said.
    pub fn reported_lease_end(&self) -> Option<Instant> {
        self.queues
            .upgrade()
            .and_then(|q| q.reported_end(&self.key))
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(q) = self.queues.upgrade() {
            q.remove(&self.key, &self.slot);
        }
    }
}
