//! Metrics through the `metrics` facade (feature `metrics`; without it every call here is an
//! empty inline function). The exporter is the application's choice: install any `metrics`
//! recorder (Prometheus, StatsD, ...) before taking locks.
//!
//! | name | kind | when |
//! |---|---|---|
//! | `dlock_acquisitions_total` | counter | a lock was acquired (re-entries included) |
//! | `dlock_busy_total` | counter | an acquisition without waiting found the lock held |
//! | `dlock_timed_out_total` | counter | an acquisition waited and its `wait` ran out |
//! | `dlock_lost_total` | counter | a held lease was lost (deadline, another owner, `max_hold`) |
//! | `dlock_errors_total` | counter | an acquisition failed otherwise (backend, config, invalid name) |
//! | `dlock_acquire_seconds` | histogram | duration of each successful acquisition call |
//! | `dlock_wait_seconds` | histogram | for acquisitions allowed to wait (`wait > 0`): call to grant or time-out |
//! | `dlock_hold_seconds` | histogram | acquisition to release, drop or loss of a lease (outermost holds) |
//! | `dlock_held` | gauge | leases held by this process now (outermost holds) |
//!
//! Labels: `backend` (the registered backend's name, `"direct"` for [`crate::Lock::with_backend`])
//! and `lock`: the function's name for `#[distributed_lock]`, [`crate::Lock::metric_name`] for the
//! manual API (default `"manual"`), the layer's [`metric_name`](crate::web::LockLayer::metric_name)
//! (default `"http_layer"`). Never the rendered key: its cardinality is unbounded.

#![cfg_attr(not(feature = "metrics"), allow(dead_code, unused_variables))]

use tokio::time::Instant;

use crate::LockError;

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
    acquisitions: metrics::Counter,
    busy: metrics::Counter,
    timed_out: metrics::Counter,
    lost: metrics::Counter,
    errors: metrics::Counter,
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

#[cfg(feature = "metrics")]
fn register(backend: &str, lock: &str) -> Handles {
    describe();
    let l = [("backend", backend.to_string()), ("lock", lock.to_string())];
    Handles {
        acquisitions: metrics::counter!("dlock_acquisitions_total", &l),
        busy: metrics::counter!("dlock_busy_total", &l),
        timed_out: metrics::counter!("dlock_timed_out_total", &l),
        lost: metrics::counter!("dlock_lost_total", &l),
        errors: metrics::counter!("dlock_errors_total", &l),
        acquire: metrics::histogram!("dlock_acquire_seconds", &l),
        wait: metrics::histogram!("dlock_wait_seconds", &l),
        hold: metrics::histogram!("dlock_hold_seconds", &l),
        held: metrics::gauge!("dlock_held", &l),
    }
}

impl Labels {
    #[inline]
    pub(crate) fn new(backend: &str, lock: &str) -> Labels {
        #[cfg(feature = "metrics")]
        {
            // Keyed by the recorder in effect (global or thread-local), so handles registered
            // before an exporter was installed are not reused after.
            let rec =
                metrics::with_recorder(|r| r as *const dyn metrics::Recorder as *const () as usize);
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
            "dlock_acquisitions_total",
            "Locks acquired (re-entries included)"
        );
        describe_counter!(
            "dlock_busy_total",
            "Acquisitions without waiting that found the lock held"
        );
        describe_counter!("dlock_timed_out_total", "Acquisitions whose wait ran out");
        describe_counter!("dlock_lost_total", "Held leases that were lost");
        describe_counter!(
            "dlock_errors_total",
            "Acquisitions that failed with an error other than busy or timed out"
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
                h.acquisitions.increment(1);
                h.acquire.record(elapsed.as_secs_f64());
            }
            Err(LockError::Busy { .. }) => h.busy.increment(1),
            Err(LockError::TimedOut { .. }) => h.timed_out.increment(1),
            // A re-entry into a lease already lost is counted where it was lost.
            Err(LockError::Lost { .. }) => {}
            Err(_) => h.errors.increment(1),
        }
        if may_wait && (r.is_ok() || matches!(r, Err(LockError::TimedOut { .. }))) {
            h.wait.record(elapsed.as_secs_f64());
        }
    }
}

/// An acquisition that failed before reaching the backend (invalid name, zero ttl, unknown
/// backend): counted in `dlock_errors_total`; returns the error.
#[inline]
pub(crate) fn setup_error(labels: &Labels, e: LockError) -> LockError {
    #[cfg(feature = "metrics")]
    labels.h.errors.increment(1);
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
    pub(crate) fn lost(&self, acquired_at: Instant) {
        #[cfg(feature = "metrics")]
        self.labels.h.lost.increment(1);
        self.end(acquired_at);
    }
}
