//! Read-write locks in memory ([`crate::RwLock`] on [`super::MemoryBackend`]): the semantics of
//! the Redis scripts in one process, with the tokens of the backend's one counter.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::{Acquired, Extended, Released, RwSide};
use crate::wait::WaitQueues;

/// One hold: its count, token and lease end.
#[derive(Debug)]
struct Hold {
    count: u32,
    token: u64,
    expires: Instant,
}

/// The state of one read-write lock name.
#[derive(Debug, Default)]
struct Entry {
    writer: Option<(String, Hold)>,
    readers: HashMap<String, Hold>,
    /// The first waiting writer and its marker's lease end (writer preference).
    waiting: Option<(String, Instant)>,
}

impl Entry {
    /// Drops every hold and marker whose lease has ended.
    fn purge(&mut self, now: Instant) {
        if self.writer.as_ref().is_some_and(|(_, h)| h.expires <= now) {
            self.writer = None;
        }
        self.readers.retain(|_, h| h.expires > now);
        if self.waiting.as_ref().is_some_and(|(_, t)| *t <= now) {
            self.waiting = None;
        }
    }

    fn is_empty(&self) -> bool {
        self.writer.is_none() && self.readers.is_empty() && self.waiting.is_none()
    }

    /// When the holders that keep a writer out have all gone by their leases.
    fn holders_end(&self) -> Option<Instant> {
        let w = self.writer.as_ref().map(|(_, h)| h.expires);
        let r = self.readers.values().map(|h| h.expires).max();
        w.max(r)
    }
}

/// The read-write locks of one [`super::MemoryBackend`], with wait queues of their own per side.
#[derive(Debug)]
pub(crate) struct RwStore {
    map: Mutex<HashMap<String, Entry>>,
    readers: Arc<WaitQueues>,
    writers: Arc<WaitQueues>,
}

impl RwStore {
    pub(crate) fn new() -> Self {
        RwStore {
            map: Mutex::new(HashMap::new()),
            readers: WaitQueues::new(),
            writers: WaitQueues::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn queues(&self, side: RwSide) -> &Arc<WaitQueues> {
        match side {
            RwSide::Read => &self.readers,
            RwSide::Write => &self.writers,
        }
    }

    /// Wakes the writer whose turn it is: the one whose marker is set, else the first.
    fn wake_writer(&self, name: &str, waiting: Option<&str>) {
        match waiting {
            Some(owner) => self.writers.wake_owner(name, owner),
            None => self.writers.wake_one(name),
        };
    }

    /// Wakes every waiting reader of `name` (they can all go on together).
    fn wake_readers(&self, name: &str) {
        while self.readers.wake_one(name) {}
    }

    pub(crate) fn try_acquire(
        &self,
        tokens: &AtomicU64,
        side: RwSide,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Acquired {
        let now = Instant::now();
        let mut map = self.lock();
        let e = map.entry(name.to_string()).or_default();
        e.purge(now);
        let mint = || tokens.fetch_add(1, Ordering::Relaxed) + 1;
        match side {
            RwSide::Read => {
                if let Some((_, w)) = &e.writer {
                    return Acquired::Busy {
                        remaining: Some(w.expires - now),
                    };
                }
                if let Some(h) = e.readers.get_mut(owner) {
                    h.count = h.count.saturating_add(1);
                    h.expires = h.expires.max(now + ttl);
                    return Acquired::Granted {
                        token: h.token,
                        count: h.count,
                    };
                }
                if let Some((q, until)) = &e.waiting
                    && q != owner
                {
                    // A writer waits: new readers wait behind it (woken by its release, or by
                    // its marker's end).
                    return Acquired::Busy {
                        remaining: Some(*until - now),
                    };
                }
                let token = mint();
                e.readers.insert(
                    owner.to_string(),
                    Hold {
                        count: 1,
                        token,
                        expires: now + ttl,
                    },
                );
                Acquired::Granted { token, count: 1 }
            }
            RwSide::Write => {
                if let Some((w, h)) = &mut e.writer
                    && w == owner
                {
                    h.count = h.count.saturating_add(1);
                    h.expires = h.expires.max(now + ttl);
                    return Acquired::Granted {
                        token: h.token,
                        count: h.count,
                    };
                }
                let mine = e.waiting.as_ref().is_none_or(|(q, _)| q == owner);
                if let Some(end) = e.holders_end() {
                    if mine {
                        e.waiting = Some((owner.to_string(), now + ttl));
                    }
                    // Retry before the marker's lease ends, to renew it.
                    let remaining = (end - now).min(ttl / 2).max(Duration::from_millis(1));
                    return Acquired::Busy {
                        remaining: Some(remaining),
                    };
                }
                if !mine {
                    let until = e.waiting.as_ref().map(|(_, t)| *t - now);
                    return Acquired::Busy { remaining: until };
                }
                e.waiting = None;
                let token = mint();
                e.writer = Some((
                    owner.to_string(),
                    Hold {
                        count: 1,
                        token,
                        expires: now + ttl,
                    },
                ));
                Acquired::Granted { token, count: 1 }
            }
        }
    }

    pub(crate) fn release(&self, side: RwSide, name: &str, owner: &str, all: bool) -> Released {
        let now = Instant::now();
        let mut map = self.lock();
        let Some(e) = map.get_mut(name) else {
            return Released::NotOwner;
        };
        e.purge(now);
        let r = match side {
            RwSide::Read => match e.readers.get_mut(owner) {
                Some(h) if !all && h.count > 1 => {
                    h.count -= 1;
                    Released::Decremented(h.count)
                }
                Some(_) => {
                    e.readers.remove(owner);
                    if e.readers.is_empty() {
                        self.wake_writer(name, e.waiting.as_ref().map(|(q, _)| q.as_str()));
                    }
                    Released::Freed
                }
                None => Released::NotOwner,
            },
            RwSide::Write => match &mut e.writer {
                Some((w, h)) if w == owner => {
                    if !all && h.count > 1 {
                        h.count -= 1;
                        Released::Decremented(h.count)
                    } else {
                        e.writer = None;
                        match &e.waiting {
                            Some((q, _)) => self.wake_writer(name, Some(q)),
                            None => {
                                self.wake_readers(name);
                                self.wake_writer(name, None);
                            }
                        }
                        Released::Freed
                    }
                }
                _ => {
                    if all && e.waiting.as_ref().is_some_and(|(q, _)| q == owner) {
                        // A writer that stopped waiting: readers may go on, and the next writer
                        // may take its place.
                        e.waiting = None;
                        self.wake_readers(name);
                        self.wake_writer(name, None);
                    }
                    Released::NotOwner
                }
            },
        };
        if e.is_empty() {
            map.remove(name);
        }
        r
    }

    pub(crate) fn extend(&self, side: RwSide, name: &str, owner: &str, ttl: Duration) -> Extended {
        let now = Instant::now();
        let mut map = self.lock();
        let Some(e) = map.get_mut(name) else {
            return Extended::Lost;
        };
        e.purge(now);
        let h = match side {
            RwSide::Read => e.readers.get_mut(owner),
            RwSide::Write => e
                .writer
                .as_mut()
                .filter(|(w, _)| w == owner)
                .map(|(_, h)| h),
        };
        match h {
            Some(h) => {
                h.expires = now + ttl;
                Extended::Extended
            }
            None => Extended::Lost,
        }
    }

    pub(crate) fn downgrade(
        &self,
        tokens: &AtomicU64,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Option<u64> {
        let now = Instant::now();
        let mut map = self.lock();
        let e = map.get_mut(name)?;
        e.purge(now);
        if e.writer.as_ref().is_none_or(|(w, _)| w != owner) {
            return None;
        }
        e.writer = None;
        let token = tokens.fetch_add(1, Ordering::Relaxed) + 1;
        e.readers.insert(
            owner.to_string(),
            Hold {
                count: 1,
                token,
                expires: now + ttl,
            },
        );
        if e.waiting.is_none() {
            self.wake_readers(name);
        }
        Some(token)
    }

    /// Deletes every hold and marker of `name`, as an operator would (tests).
    pub(crate) fn force_delete(&self, name: &str) -> bool {
        let removed = self.lock().remove(name).is_some();
        if removed {
            self.wake_readers(name);
            self.writers.wake_one(name);
        }
        removed
    }
}
