//! The in-memory backend's semaphores: owned permits with leases on this process's monotonic
//! clock, kept apart from the locks (a map and wait queues of their own).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use super::MemoryBackend;
use crate::LockError;
use crate::backend::{Acquired, Extended, Released};
use crate::wait::WaitQueues;

/// One semaphore: its `max` and its live holders.
#[derive(Debug)]
struct Sem {
    max: u32,
    /// owner -> (permits, lease end).
    holders: HashMap<String, (u32, Instant)>,
}

impl Sem {
    /// Drops the holders whose lease ended: their permits come back.
    fn purge(&mut self, now: Instant) {
        self.holders.retain(|_, (_, end)| *end > now);
    }

    fn used(&self) -> u64 {
        self.holders.values().map(|(n, _)| u64::from(*n)).sum()
    }
}

/// The semaphores of one [`MemoryBackend`].
#[derive(Debug)]
pub(super) struct Semaphores {
    map: Mutex<HashMap<String, Sem>>,
    pub(super) waiters: Arc<WaitQueues>,
}

impl Default for Semaphores {
    fn default() -> Self {
        Semaphores {
            map: Mutex::new(HashMap::new()),
            waiters: WaitQueues::new(),
        }
    }
}

impl Semaphores {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Sem>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl MemoryBackend {
    pub(super) fn try_acquire_permits_now(
        &self,
        name: &str,
        owner: &str,
        max: u32,
        permits: u32,
        ttl: Duration,
    ) -> Result<Acquired, LockError> {
        let now = Instant::now();
        let mut map = self.sems.lock();
        if map.len() >= 1024 && map.len().is_power_of_two() {
            map.retain(|_, s| {
                s.purge(now);
                !s.holders.is_empty()
            });
        }
        let sem = map.entry(name.to_string()).or_insert_with(|| Sem {
            max,
            holders: HashMap::new(),
        });
        sem.purge(now);
        if sem.holders.is_empty() {
            // No live holder: the name takes the max of this grant.
            sem.max = max;
        }
        if sem.max != max {
            return Err(LockError::SemaphoreMax {
                key: name.to_string(),
                asked: max,
                stored: sem.max,
            });
        }
        if sem.holders.contains_key(owner) {
            return Err(LockError::backend(
                name,
                "this owner id already holds permits of the semaphore",
            ));
        }
        if sem.used() + u64::from(permits) > u64::from(max) {
            let first_end = sem.holders.values().map(|(_, end)| *end).min();
            return Ok(Acquired::Busy {
                remaining: first_end.map(|e| e.saturating_duration_since(now)),
            });
        }
        let token = self.next_token.fetch_add(1, Ordering::Relaxed) + 1;
        sem.holders.insert(owner.to_string(), (permits, now + ttl));
        Ok(Acquired::Granted { token, count: 1 })
    }

    pub(super) fn release_permits_now(&self, name: &str, owner: &str) -> Released {
        let now = Instant::now();
        let mut map = self.sems.lock();
        let Some(sem) = map.get_mut(name) else {
            return Released::NotOwner;
        };
        sem.purge(now);
        let Some((n, _)) = sem.holders.remove(owner) else {
            return Released::NotOwner;
        };
        if sem.holders.is_empty() {
            map.remove(name);
        }
        drop(map);
        // As many waiters as permits were freed (a waiter needs at least one).
        for _ in 0..n {
            if !self.sems.waiters.wake_one(name) {
                break;
            }
        }
        Released::Freed
    }

    pub(super) fn extend_permits_now(&self, name: &str, owner: &str, ttl: Duration) -> Extended {
        let now = Instant::now();
        let mut map = self.sems.lock();
        match map.get_mut(name).and_then(|s| s.holders.get_mut(owner)) {
            Some((_, end)) if *end > now => {
                *end = now + ttl;
                Extended::Extended
            }
            _ => Extended::Lost,
        }
    }

    /// The permits held now of the semaphore `name` (expired holders not counted), for tests.
    pub fn permits_held(&self, name: &str) -> u32 {
        let now = Instant::now();
        self.sems.lock().get(name).map_or(0, |s| {
            s.holders
                .values()
                .filter(|(_, end)| *end > now)
                .map(|(n, _)| *n)
                .sum()
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn permits_are_owned_counted_and_refuse_another_max() {
        let b = MemoryBackend::new();
        let ttl = Duration::from_secs(30);
        let Ok(Acquired::Granted { token: t1, .. }) =
            b.try_acquire_permits_now("s", "a", 3, 2, ttl)
        else {
            panic!("not granted")
        };
        assert!(matches!(
            b.try_acquire_permits_now("s", "b", 3, 2, ttl),
            Ok(Acquired::Busy { remaining: Some(_) })
        ));
        let Ok(Acquired::Granted { token: t2, .. }) =
            b.try_acquire_permits_now("s", "c", 3, 1, ttl)
        else {
            panic!("not granted")
        };
        assert!(t2 > t1);
        assert!(matches!(
            b.try_acquire_permits_now("s", "d", 4, 1, ttl),
            Err(LockError::SemaphoreMax {
                asked: 4,
                stored: 3,
                ..
            })
        ));
        // Apart from the lock of the same name.
        assert!(matches!(
            b.try_acquire_now("s", "x", ttl),
            Acquired::Granted { .. }
        ));
        assert_eq!(b.permits_held("s"), 3);
        assert_eq!(b.release_permits_now("s", "b"), Released::NotOwner);
        assert_eq!(b.extend_permits_now("s", "b", ttl), Extended::Lost);
        assert_eq!(b.release_permits_now("s", "a"), Released::Freed);
        assert_eq!(b.release_permits_now("s", "a"), Released::NotOwner);
        assert_eq!(b.release_permits_now("s", "c"), Released::Freed);
        // No live holder: the next grant sets the max.
        assert!(matches!(
            b.try_acquire_permits_now("s", "d", 4, 4, ttl),
            Ok(Acquired::Granted { .. })
        ));
    }
}
