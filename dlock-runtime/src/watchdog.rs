//! The watchdog: one driver task per tokio runtime renews every live hold of that runtime at
//! ttl/3 and fires the lost signal at each hold's local deadline.
//!
//! A hold is an entry in the driver's timer queue, keyed by its next event (renewal or
//! deadline). Taking a lock inserts one entry; giving it back removes it; the driver task is only
//! woken when a new entry is due before the time it already sleeps until. So an acquire/release
//! pair costs two map updates, not a task spawn, and a million short holds leave nothing
//! behind. Renewals run as their own tasks, so a slow server delays no other hold's deadline.
//!
//! The driver runs on the runtime that took the lock: if that runtime's threads are blocked
//! (a body that blocks the executor), renewals stop too and the lease runs out, as it should for
//! code that no longer makes progress; `lost()` fires as soon as the runtime runs again.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::LostReason;
use crate::backend::Extended;
use crate::guard::Hold;

type Key = (Instant, u64);

/// The shortest wait before a renewal whose confirmation lost to an extend is sent again.
const RENEW_AGAIN_AFTER: Duration = Duration::from_millis(10);

/// The timer queue of one runtime.
#[derive(Debug, Default)]
pub(crate) struct Driver {
    state: Mutex<State>,
    notify: Notify,
}

#[derive(Debug, Default)]
struct State {
    queue: BTreeMap<Key, Arc<Hold>>,
    /// When the driver task wakes next (`None`: only when notified).
    target: Option<Instant>,
    /// Whether a hold was queued since the driver last woke.
    queued_since_wake: bool,
}

/// How long the driver sleeps with an empty queue while holds keep coming and going. A hold
/// queued within it (its first event is a renewal, ttl/3 away, or its deadline) is due after
/// the driver wakes, so queueing it needs no wake-up: back-to-back short holds (each released
/// before the driver runs) do not wake the driver once per hold. After a quiet period the driver
/// sleeps until notified.
const IDLE_WAKE: Duration = Duration::from_secs(1);

/// A hold's place in its driver's queue.
#[derive(Debug)]
pub(crate) struct Slot {
    driver: Weak<Driver>,
    id: u64,
    /// The queue key while queued; changed only under the driver's lock.
    key: Mutex<Option<Key>>,
    /// Whether renewals are still wanted (off without the watchdog, or past `max_hold`).
    renewing: Mutex<(bool, Instant)>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);
static DRIVERS: Mutex<Vec<(tokio::runtime::Id, Weak<Driver>)>> = Mutex::new(Vec::new());

thread_local! {
    static CACHE: RefCell<Option<(tokio::runtime::Id, Weak<Driver>)>> = const { RefCell::new(None) };
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The driver of the current runtime, started on first use.
fn driver(handle: &Handle) -> Arc<Driver> {
    let id = handle.id();
    let cached = CACHE.with(|c| {
        c.borrow()
            .as_ref()
            .filter(|(rid, _)| *rid == id)
            .and_then(|(_, d)| d.upgrade())
    });
    if let Some(d) = cached {
        return d;
    }
    let mut drivers = lock(&DRIVERS);
    drivers.retain(|(_, d)| d.strong_count() > 0);
    let d = match drivers
        .iter()
        .find(|(rid, _)| *rid == id)
        .and_then(|(_, d)| d.upgrade())
    {
        Some(d) => d,
        None => {
            let d = Arc::new(Driver::default());
            drivers.push((id, Arc::downgrade(&d)));
            // The task owns the driver: when the runtime shuts down the task is dropped, and
            // with it the driver and its queue.
            handle.spawn(run(d.clone()));
            d
        }
    };
    drop(drivers);
    CACHE.with(|c| *c.borrow_mut() = Some((id, Arc::downgrade(&d))));
    d
}

/// A place in the current runtime's watchdog for a new outermost hold. Without a runtime there
/// is no watchdog: the lease simply runs out after its ttl (and `is_valid` says so).
pub(crate) fn slot(renew: bool, first_renewal: Instant) -> Option<Slot> {
    let handle = Handle::try_current().ok()?;
    let d = driver(&handle);
    Some(Slot {
        driver: Arc::downgrade(&d),
        id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        key: Mutex::new(None),
        renewing: Mutex::new((renew, first_renewal)),
    })
}

/// Queues the hold's first event; called once the hold owns its slot.
pub(crate) fn arm(hold: &Arc<Hold>) {
    let Some(slot) = hold.slot() else { return };
    let (renewing, next) = *lock(&slot.renewing);
    let at = if renewing {
        next.min(hold.deadline())
    } else {
        hold.deadline()
    };
    schedule(hold, at);
}

/// After an extend: the next renewal at `next_renewal`, the deadline event at the (maybe
/// earlier) new deadline.
pub(crate) fn rescheduled(hold: &Arc<Hold>, next_renewal: Instant) {
    let Some(slot) = hold.slot() else { return };
    let renewing = {
        let mut r = lock(&slot.renewing);
        r.1 = next_renewal;
        r.0
    };
    let deadline = hold.deadline();
    schedule(
        hold,
        if renewing {
            next_renewal.min(deadline)
        } else {
            deadline
        },
    );
}

/// Takes the hold off the queue (release or drop). The stop token is already cancelled.
pub(crate) fn stop(hold: &Hold) {
    let Some(slot) = hold.slot() else { return };
    let Some(d) = slot.driver.upgrade() else {
        return;
    };
    let mut st = lock(&d.state);
    if let Some(k) = lock(&slot.key).take() {
        st.queue.remove(&k);
    }
}

fn schedule(hold: &Arc<Hold>, at: Instant) {
    let Some(slot) = hold.slot() else { return };
    let Some(d) = slot.driver.upgrade() else {
        return;
    };
    let mut st = lock(&d.state);
    // Checked under the driver's lock: `stop` cancels first and removes under this lock, so a
    // stopped hold is never queued again.
    if hold.is_stopped() {
        return;
    }
    let key = (at, slot.id);
    if let Some(old) = lock(&slot.key).replace(key) {
        st.queue.remove(&old);
    }
    st.queue.insert(key, hold.clone());
    st.queued_since_wake = true;
    if st.target.is_none_or(|t| at < t) {
        st.target = Some(at);
        d.notify.notify_one();
    }
}

async fn run(d: Arc<Driver>) {
    loop {
        let now = Instant::now();
        let (due, target) = {
            let mut st = lock(&d.state);
            let later = st.queue.split_off(&(now, u64::MAX));
            let due = std::mem::replace(&mut st.queue, later);
            for h in due.values() {
                if let Some(slot) = h.slot() {
                    *lock(&slot.key) = None;
                }
            }
            st.target = match st.queue.keys().next() {
                Some(k) => Some(k.0),
                // Empty while holds come and go: wake again soon instead of being notified
                // by the next one; empty after a quiet period: sleep until notified.
                None if st.queued_since_wake => now.checked_add(IDLE_WAKE),
                None => None,
            };
            st.queued_since_wake = false;
            (due, st.target)
        };
        for h in due.into_values() {
            event(&h, now);
        }
        let sleep = async {
            match target {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = d.notify.notified() => {}
            _ = sleep => {}
        }
    }
}

/// A hold's event is due: mark it lost at its deadline, start a renewal, or re-queue it.
fn event(h: &Arc<Hold>, now: Instant) {
    if h.is_stopped() {
        return;
    }
    let deadline = h.deadline();
    if now >= deadline {
        h.mark_lost(h.expiry_reason(now));
        return;
    }
    let Some(slot) = h.slot() else { return };
    let mut r = lock(&slot.renewing);
    if r.0 && h.hold_until().is_some_and(|cap| now >= cap) {
        tracing::info!(key = %h.name, "dlock: max_hold reached; the watchdog stops renewing");
        r.0 = false;
    }
    let (renewing, next) = *r;
    drop(r);
    if renewing && now >= next {
        tokio::spawn(renew(h.clone()));
    } else if renewing {
        schedule(h, next.min(deadline));
    } else {
        schedule(h, deadline);
    }
}

/// One renewal; transient errors are retried until the lease would have run out.
async fn renew(h: Arc<Hold>) {
    let (epoch, ttl) = h.renewal();
    let sent = Instant::now();
    let extend = h.backend.extend(&h.name, &h.owner, ttl);
    let r = tokio::select! {
        biased;
        _ = h.stopped() => return,
        r = tokio::time::timeout_at(h.deadline(), extend) => r,
    };
    let next = match r {
        Ok(Ok(Extended::Extended)) => {
            if !h.confirm(sent, ttl, false, epoch) {
                // An extend was sent meanwhile. If it succeeds it sets the lease and reschedules
                // this hold; if it fails nothing else would, and the hold would drop out of the
                // watchdog (no renewal, no deadline event). Keep it queued at the renewal time the
                // last successful extend set, or soon: either way harmless next to `rescheduled`.
                let next = h
                    .slot()
                    .map_or(sent, |s| lock(&s.renewing).1)
                    .max(Instant::now() + RENEW_AGAIN_AFTER);
                schedule(&h, next.min(h.deadline()));
                return;
            }
            let rtt = sent.elapsed();
            if rtt > ttl / 5 {
                tracing::warn!(key = %h.name, rtt_ms = rtt.as_millis() as u64, "dlock: renewal confirmed with less than 20% of the lease left");
            } else {
                tracing::trace!(key = %h.name, rtt_us = rtt.as_micros() as u64, "dlock: renewed");
            }
            // A third of the lease the guard counts on (ttl minus the backend's margin).
            sent + ttl.saturating_sub(h.backend.lease_margin(ttl)) / 3
        }
        Ok(Ok(Extended::Lost)) => {
            h.mark_lost(LostReason::NotOwner);
            return;
        }
        Ok(Err(e)) => {
            tracing::debug!(key = %h.name, error = %e, "dlock: renewal failed; retrying");
            Instant::now() + (ttl / 10).clamp(Duration::from_millis(10), Duration::from_millis(250))
        }
        Err(_elapsed) => {
            h.mark_lost(h.expiry_reason(Instant::now()));
            return;
        }
    };
    if let Some(slot) = h.slot() {
        lock(&slot.renewing).1 = next;
    }
    schedule(&h, next.min(h.deadline()));
}

#[cfg(test)]
impl Driver {
    fn queued(&self) -> usize {
        lock(&self.state).queue.len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use crate::{Backend, Lock, MemoryBackend};

    fn queued() -> usize {
        super::driver(&tokio::runtime::Handle::current()).queued()
    }

    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn renews_every_third_of_the_ttl() {
        let b: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
        let g = Lock::new("wd")
            .ttl(Duration::from_secs(3))
            .with_backend(b)
            .acquire()
            .await
            .unwrap();
        // Renewals at 1 s and 2 s move the deadline to 5 s; without them it would be 3 s.
        for _ in 0..25 {
            tokio::time::advance(Duration::from_millis(100)).await;
            settle().await;
        }
        assert!(g.is_valid());
        assert!(
            g.remaining() > Duration::from_secs(2),
            "{:?}",
            g.remaining()
        );
        g.release().await.unwrap();
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn lost_fires_at_the_deadline_without_the_watchdog() {
        let b: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
        let g = Lock::new("wd-off")
            .ttl(Duration::from_secs(1))
            .watchdog(false)
            .with_backend(b)
            .acquire()
            .await
            .unwrap();
        let token = g.lost_token();
        tokio::time::advance(Duration::from_millis(900)).await;
        settle().await;
        assert!(!token.is_cancelled());
        tokio::time::advance(Duration::from_millis(200)).await;
        settle().await;
        assert!(token.is_cancelled(), "lost did not fire at the deadline");
        assert_eq!(g.lost_reason(), Some(crate::LostReason::Deadline));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn short_holds_leave_nothing_queued() {
        let b: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
        let lock = Lock::new("many").with_backend(b);
        // No yield in the loop: nothing may pile up waiting for the driver to run.
        for _ in 0..10_000 {
            lock.acquire().await.unwrap().release().await.unwrap();
        }
        assert_eq!(queued(), 0);
        let g = lock.acquire().await.unwrap();
        assert_eq!(queued(), 1);
        drop(g);
        assert_eq!(queued(), 0);
    }
}
