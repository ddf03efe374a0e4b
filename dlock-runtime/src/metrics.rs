//! Metrics through the `metrics` facade (feature `metrics`; without it every call here is an
//! empty inline function). The exporter is the application's choice: install any `metrics`
//! recorder (Prometheus, StatsD, ...) before taking locks.
//!
//! | name | kind | when |
//! |---|---|---|
//! | `dlock_acquire_total` | counter | each acquire call, once, by its `result`: `acquired` (re-entries included), `busy` (no wait allowed, lock held), `timed_out` (the `wait` ran out), `error` (with a `kind`) |
//! | `dlock_lost_total` | counter | a held lease was lost, by `reason`: `deadline`, `not_owner`, `max_hold` |
//! | `dlock_acquire_seconds` | histogram | duration of each successful acquisition call |
//! | `dlock_wait_seconds` | histogram | for acquisitions allowed to wait (`wait > 0`): call to grant or time-out |
//! | `dlock_hold_seconds` | histogram | acquisition to release, drop or loss of a lease (outermost holds) |
//! | `dlock_held` | gauge | leases held by this process now (outermost holds) |
//!
//! Labels: `backend` (the registered backend's name, `"direct"` for [`crate::Lock::with_backend`])
//! and `lock`: the function's name for `#[distributed_lock]`, [`crate::Lock::metric_name`] for the
//! manual API (default `"manual"`), the layer's [`metric_name`](crate::web::LockLayer::metric_name)
//! (default `"http_layer"`). Never the rendered key: its cardinality is unbounded. The other
//! labels take fixed values only: `result`, `kind` (the [`LockError`] variant in snake_case,
//! [`error_kind`]) and `reason` (the [`crate::LostReason`] in snake_case, [`lost_reason`]). Every
//! value an acquisition can produce is registered at 0 with the first use of a (backend, lock)
//! pair, so `rate()` sees the first event.

#![cfg_attr(not(feature = "metrics"), allow(dead_code, unused_variables))]

use tokio::time::Instant;

use crate::{LockError, LostReason};

/// The `lock` label of a [`crate::Lock`] that was not given a metric name.
pub(crate) const DEFAULT_METRIC_NAME: &str = "manual";

/// The labels of one acquisition and its hold, with the metric handles registered for them.
#[derive(Debug, Clone)]
pub(crate) struct Labels {
    #[cfg(feature = "metrics")]
    h: std::sync::Arc<Handles>,
}

/// The handles of one (recorder, backend, lock) triple, registered once: every event after that
/// is an update of a handle, without building a key or labels.
#[cfg(feature = "metrics")]
#[derive(Debug)]
struct Handles {
    backend: String,
    lock: String,
    acquired: metrics::Counter,
    busy: metrics::Counter,
    timed_out: metrics::Counter,
    /// `result="error"`, one per kind of [`ACQUIRE_ERROR_KINDS`], in that order.
    errors: [metrics::Counter; ACQUIRE_ERROR_KINDS.len()],
    /// One per reason of [`LOST_REASONS`], in that order.
    lost: [metrics::Counter; LOST_REASONS.len()],
    acquire: metrics::Histogram,
    wait: metrics::Histogram,
    hold: metrics::Histogram,
    held: metrics::Gauge,
}

/// More distinct label pairs than this are not cached (registered on each use instead), so a
/// `metric_name` misused with rendered keys cannot grow memory without bound here.
#[cfg(feature = "metrics")]
const CACHE_LIMIT: usize = 10_000;

#[cfg(feature = "metrics")]
type Cache = std::collections::HashMap<
    usize,
    std::collections::HashMap<String, std::collections::HashMap<String, std::sync::Arc<Handles>>>,
>;

#[cfg(feature = "metrics")]
static CACHE: std::sync::LazyLock<std::sync::RwLock<(usize, Cache)>> =
    std::sync::LazyLock::new(Default::default);

/// The `kind` label of an error: its [`LockError`] variant in snake_case. A fixed set of values,
/// never a message or a key.
pub(crate) fn error_kind(e: &LockError) -> &'static str {
    match e {
        LockError::Busy { .. } => "busy",
        LockError::TimedOut { .. } => "timed_out",
        LockError::Lost { .. } => "lost",
        LockError::NotOwner { .. } => "not_owner",
        LockError::UnknownBackend { .. } => "unknown_backend",
        LockError::UnknownPolicy { .. } => "unknown_policy",
        LockError::InvalidKey { .. } => "invalid_key",
        LockError::Config(_) => "config",
        LockError::Unsupported { .. } => "unsupported",
        LockError::SemaphoreMax { .. } => "semaphore_max",
        LockError::Backend { .. } => "backend",
        LockError::UpgradeRefused { .. } => "upgrade_refused",
    }
}

/// The `reason` label of `dlock_lost_total`: the [`LostReason`] in snake_case.
pub(crate) fn lost_reason(r: LostReason) -> &'static str {
    match r {
        LostReason::Deadline => "deadline",
        LostReason::NotOwner => "not_owner",
        LostReason::MaxHold => "max_hold",
    }
}

/// The error kinds an acquire call can end with, registered at 0 up front (busy and timed-out
/// calls are results of their own; any other kind is registered at its first use).
const ACQUIRE_ERROR_KINDS: [&str; 6] = [
    "backend",
    "config",
    "invalid_key",
    "unknown_backend",
    "unknown_policy",
    "lost",
];

/// Every [`LostReason`], at its [`lost_index`].
const LOST_REASONS: [LostReason; 3] = [
    LostReason::Deadline,
    LostReason::NotOwner,
    LostReason::MaxHold,
];

fn lost_index(r: LostReason) -> usize {
    match r {
        LostReason::Deadline => 0,
        LostReason::NotOwner => 1,
        LostReason::MaxHold => 2,
    }
}

#[cfg(feature = "metrics")]
fn register(backend: &str, lock: &str) -> Handles {
    describe();
    let l = [("backend", backend.to_string()), ("lock", lock.to_string())];
    let result = |r: &'static str| {
        let [b, k] = l.clone();
        metrics::counter!("dlock_acquire_total", &[b, k, ("result", r.to_string())])
    };
    Handles {
        backend: backend.to_string(),
        lock: lock.to_string(),
        acquired: result("acquired"),
        busy: result("busy"),
        timed_out: result("timed_out"),
        errors: ACQUIRE_ERROR_KINDS.map(|kind| error_counter(backend, lock, kind)),
        lost: LOST_REASONS.map(|r| {
            let [b, k] = l.clone();
            metrics::counter!(
                "dlock_lost_total",
                &[b, k, ("reason", lost_reason(r).to_string())]
            )
        }),
        acquire: metrics::histogram!("dlock_acquire_seconds", &l),
        wait: metrics::histogram!("dlock_wait_seconds", &l),
        hold: metrics::histogram!("dlock_hold_seconds", &l),
        held: metrics::gauge!("dlock_held", &l),
    }
}

#[cfg(feature = "metrics")]
fn error_counter(backend: &str, lock: &str, kind: &'static str) -> metrics::Counter {
    metrics::counter!(
        "dlock_acquire_total",
        "backend" => backend.to_string(),
        "lock" => lock.to_string(),
        "result" => "error",
        "kind" => kind
    )
}

#[cfg(feature = "metrics")]
impl Handles {
    fn error(&self, e: &LockError) {
        let kind = error_kind(e);
        match ACQUIRE_ERROR_KINDS.iter().position(|k| *k == kind) {
            Some(i) => self.errors[i].increment(1),
            None => error_counter(&self.backend, &self.lock, kind).increment(1),
        }
    }
}

impl Labels {
    #[inline]
    pub(crate) fn new(backend: &str, lock: &str) -> Labels {
        #[cfg(feature = "metrics")]
        {
            // Keyed by the recorder in effect (global or thread-local), so handles registered
            // before an exporter was installed are not reused after.
            let rec = metrics::with_recorder(recorder_address);
            if !process_wide(rec) {
                // A local recorder (`metrics::with_local_recorder`, tests and benches): its
                // address can be reused by a later recorder once it is dropped, so its handles
                // are never cached (a new recorder at that address got a dead registry's).
                return Labels {
                    h: std::sync::Arc::new(register(backend, lock)),
                };
            }
            // A one-entry cache per thread in front of the shared one: a hot lock costs two
            // short string compares, no lock and no hashing.
            thread_local! {
                static LAST: std::cell::RefCell<Option<LastEntry>> =
                    const { std::cell::RefCell::new(None) };
            }
            let hit = LAST.with(|l| {
                l.borrow()
                    .as_ref()
                    .filter(|(r, b, k, _)| *r == rec && b == backend && k == lock)
                    .map(|(_, _, _, h)| h.clone())
            });
            if let Some(h) = hit {
                return Labels { h };
            }
            let h = shared(rec, backend, lock);
            LAST.with(|l| {
                *l.borrow_mut() = Some((rec, backend.to_string(), lock.to_string(), h.clone()))
            });
            Labels { h }
        }
        #[cfg(not(feature = "metrics"))]
        Labels {}
    }
}

#[cfg(feature = "metrics")]
fn recorder_address(r: &dyn metrics::Recorder) -> usize {
    r as *const dyn metrics::Recorder as *const () as usize
}

/// The address of the recorder a thread without a local recorder sees (the global one, or the
/// no-op one while none is installed), as last probed; 0 before the first probe.
#[cfg(feature = "metrics")]
static PROCESS_WIDE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// When the process-wide recorder was last probed (the probe spawns a thread).
#[cfg(feature = "metrics")]
static LAST_PROBE: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);

/// Whether `rec` is the process-wide recorder (global, or the no-op one), whose address no other
/// recorder can ever take, so handles registered with it may be cached for good. `metrics` does
/// not say whether a local recorder is set, so this asks a fresh thread (which has none) which
/// recorder it sees, at most once a second: a global recorder installed meanwhile is treated as
/// local (not cached) until the next probe, which is only slower.
#[cfg(feature = "metrics")]
fn process_wide(rec: usize) -> bool {
    use std::sync::atomic::Ordering;
    if rec == PROCESS_WIDE.load(Ordering::Acquire) {
        return true;
    }
    {
        let mut last = LAST_PROBE.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        if last.is_some_and(|t| now.duration_since(t) < std::time::Duration::from_secs(1)) {
            return false;
        }
        *last = Some(now);
    }
    let seen = std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("dlock-metrics-probe".into())
            .spawn_scoped(s, || metrics::with_recorder(recorder_address))
            .ok()
            .and_then(|h| h.join().ok())
    });
    match seen {
        Some(addr) => {
            PROCESS_WIDE.store(addr, Ordering::Release);
            rec == addr
        }
        None => false,
    }
}

#[cfg(feature = "metrics")]
type LastEntry = (usize, String, String, std::sync::Arc<Handles>);

#[cfg(feature = "metrics")]
fn shared(rec: usize, backend: &str, lock: &str) -> std::sync::Arc<Handles> {
    let cache = CACHE.read().unwrap_or_else(|e| e.into_inner());
    if let Some(h) = cache
        .1
        .get(&rec)
        .and_then(|m| m.get(backend))
        .and_then(|m| m.get(lock))
    {
        return h.clone();
    }
    drop(cache);
    let h = std::sync::Arc::new(register(backend, lock));
    let mut cache = CACHE.write().unwrap_or_else(|e| e.into_inner());
    if cache.0 < CACHE_LIMIT {
        cache.0 += 1;
        cache
            .1
            .entry(rec)
            .or_default()
            .entry(backend.to_string())
            .or_default()
            .insert(lock.to_string(), h.clone());
    }
    h
}

#[cfg(feature = "metrics")]
fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        describe_counter!(
            "dlock_acquire_total",
            "Acquire calls by result: acquired, busy, timed_out, error (by kind)"
        );
        describe_counter!(
            "dlock_lost_total",
            "Held leases that were lost, by reason: deadline, not_owner, max_hold"
        );
        describe_histogram!(
            "dlock_acquire_seconds",
            Unit::Seconds,
            "Duration of successful acquisitions"
        );
        describe_histogram!(
            "dlock_wait_seconds",
            Unit::Seconds,
            "Time from the call to the grant or time-out, for acquisitions allowed to wait"
        );
        describe_histogram!(
            "dlock_hold_seconds",
            Unit::Seconds,
            "Time from acquisition to release, drop or loss of a lease"
        );
        describe_gauge!("dlock_held", "Leases held by this process now");
    });
}

/// After an acquire call: counts its outcome and records its timings.
#[inline]
pub(crate) fn acquire_done(
    labels: &Labels,
    r: &Result<crate::LockGuard, LockError>,
    started: Instant,
    may_wait: bool,
) {
    #[cfg(feature = "metrics")]
    {
        // The clock is read only with the feature on.
        let elapsed = started.elapsed();
        let h = &labels.h;
        match r {
            Ok(_) => {
                h.acquired.increment(1);
                h.acquire.record(elapsed.as_secs_f64());
            }
            Err(LockError::Busy { .. }) => h.busy.increment(1),
            Err(LockError::TimedOut { .. }) => h.timed_out.increment(1),
            // A re-entry into a lease already lost is `kind="lost"` here; the loss itself was
            // counted in `dlock_lost_total` when it happened.
            Err(e) => h.error(e),
        }
        if may_wait && (r.is_ok() || matches!(r, Err(LockError::TimedOut { .. }))) {
            h.wait.record(elapsed.as_secs_f64());
        }
    }
}

/// An acquisition that failed before reaching the backend (invalid name, a ttl of zero or over
/// the cap, unknown backend or policy): counted as `result="error"` with its `kind`; returns the
/// error.
#[inline]
pub(crate) fn setup_error(labels: &Labels, e: LockError) -> LockError {
    #[cfg(feature = "metrics")]
    labels.h.error(&e);
    e
}

/// The metrics side of one outermost hold: the gauge went up when it began and goes down once,
/// at the first of release, drop or loss.
#[derive(Debug)]
pub(crate) struct HoldMetric {
    #[cfg(feature = "metrics")]
    labels: Labels,
    #[cfg(feature = "metrics")]
    ended: std::sync::atomic::AtomicBool,
}

impl HoldMetric {
    /// A new outermost hold began.
    #[inline]
    pub(crate) fn start(labels: Labels) -> HoldMetric {
        #[cfg(feature = "metrics")]
        labels.h.held.increment(1.0);
        HoldMetric {
            #[cfg(feature = "metrics")]
            labels,
            #[cfg(feature = "metrics")]
            ended: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The hold that began at `acquired_at` ended (released, dropped, or lost: counted once).
    #[inline]
    pub(crate) fn end(&self, acquired_at: Instant) {
        #[cfg(feature = "metrics")]
        if !self.ended.swap(true, std::sync::atomic::Ordering::AcqRel) {
            self.labels.h.held.decrement(1.0);
            self.labels
                .h
                .hold
                .record(acquired_at.elapsed().as_secs_f64());
        }
    }

    /// The lease of the hold that began at `acquired_at` was lost.
    #[inline]
    pub(crate) fn lost(&self, acquired_at: Instant, reason: LostReason) {
        #[cfg(feature = "metrics")]
        {
            self.labels.h.lost[lost_index(reason)].increment(1);
        }
        self.end(acquired_at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_lost_reason_has_its_own_slot_and_label() {
        for (i, r) in LOST_REASONS.iter().enumerate() {
            assert_eq!(lost_index(*r), i);
        }
        let labels: std::collections::HashSet<_> =
            LOST_REASONS.iter().map(|r| lost_reason(*r)).collect();
        assert_eq!(labels.len(), LOST_REASONS.len());
    }
}
