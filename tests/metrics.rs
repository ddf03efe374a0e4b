//! The `metrics` feature with a recording sink (metrics-util's `DebuggingRecorder`): every
//! documented metric moves when it should, labels are the backend and the template / function
//! name, never the rendered key, and the histograms are described in seconds.
//!
//! One test function: the recorder is process-global.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use metrics::Unit;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

/// Accumulates the recorder's snapshots (which reset counters, gauges and histograms).
struct Sink {
    snap: Snapshotter,
    /// (name, backend, lock) -> counter / gauge sum, or histogram sample count.
    values: Mutex<HashMap<(String, String, String), f64>>,
    units: Mutex<HashMap<String, Option<Unit>>>,
    label_values: Mutex<Vec<String>>,
}

impl Sink {
    fn take(&self) {
        let mut values = self.values.lock().unwrap();
        for (ck, unit, _desc, v) in self.snap.snapshot().into_vec() {
            let key = ck.key();
            let label = |n: &str| {
                key.labels()
                    .find(|l| l.key() == n)
                    .map(|l| l.value().to_string())
                    .unwrap_or_default()
            };
            self.label_values
                .lock()
                .unwrap()
                .extend(key.labels().map(|l| l.value().to_string()));
            self.units
                .lock()
                .unwrap()
                .insert(key.name().to_string(), unit);
            let k = (key.name().to_string(), label("backend"), label("lock"));
            let add = match v {
                DebugValue::Counter(c) => c as f64,
                DebugValue::Gauge(g) => g.into_inner(),
                DebugValue::Histogram(h) => h.len() as f64,
            };
            *values.entry(k).or_default() += add;
        }
    }

    fn get(&self, name: &str, lock: &str) -> f64 {
        self.take();
        *self
            .values
            .lock()
            .unwrap()
            .get(&(name.to_string(), "default".to_string(), lock.to_string()))
            .unwrap_or(&0.0)
    }
}

#[dlock::distributed_lock(key = "metrics-fn:{id}", ttl = "5s")]
async fn annotated(id: u64) -> Result<u64, dlock::LockError> {
    Ok(id)
}

/// A `skip` job whose policy is unknown never runs its body: only the error counter can say so.
#[dlock::distributed_lock(
    key = "metrics-skip",
    on_busy = "skip",
    policy = "metrics-never-defined"
)]
async fn skipped_with_unknown_policy() {
    panic!("the body ran without its lock");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_moves_when_it_should() {
    let recorder = DebuggingRecorder::new();
    let sink = Sink {
        snap: recorder.snapshotter(),
        values: Mutex::default(),
        units: Mutex::default(),
        label_values: Mutex::default(),
    };
    recorder
        .install()
        .expect("no other recorder in this test binary");

    // A plain acquisition and release: counted, timed, held, then not held.
    let g = dlock::Lock::new("metrics:a")
        .metric_name("m_acq")
        .acquire()
        .await
        .unwrap();
    assert_eq!(sink.get("dlock_acquisitions_total", "m_acq"), 1.0);
    assert_eq!(sink.get("dlock_acquire_seconds", "m_acq"), 1.0);
    assert_eq!(sink.get("dlock_held", "m_acq"), 1.0);
    assert_eq!(sink.get("dlock_hold_seconds", "m_acq"), 0.0);
    // Without waiting allowed, no wait time.
    assert_eq!(sink.get("dlock_wait_seconds", "m_acq"), 0.0);

    // Busy (no wait) and timed out (waited).
    let busy = dlock::Lock::new("metrics:a")
        .metric_name("m_busy")
        .acquire()
        .await
        .unwrap_err();
    assert!(matches!(busy, dlock::LockError::Busy { .. }));
    assert_eq!(sink.get("dlock_busy_total", "m_busy"), 1.0);
    assert_eq!(sink.get("dlock_acquisitions_total", "m_busy"), 0.0);
    let timed_out = dlock::Lock::new("metrics:a")
        .metric_name("m_wait")
        .wait(Duration::from_millis(50))
        .acquire()
        .await
        .unwrap_err();
    assert!(matches!(timed_out, dlock::LockError::TimedOut { .. }));
    assert_eq!(sink.get("dlock_timed_out_total", "m_wait"), 1.0);
    assert_eq!(sink.get("dlock_wait_seconds", "m_wait"), 1.0);
    assert_eq!(sink.get("dlock_busy_total", "m_wait"), 0.0);

    g.release().await.unwrap();
    assert_eq!(sink.get("dlock_held", "m_acq"), 0.0);
    assert_eq!(sink.get("dlock_hold_seconds", "m_acq"), 1.0);

    // A waiter that gets the lock records its wait.
    let g = dlock::Lock::new("metrics:a")
        .metric_name("m_wait")
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .unwrap();
    assert_eq!(sink.get("dlock_wait_seconds", "m_wait"), 2.0);
    drop(g); // a dropped guard ends its hold too
    assert_eq!(sink.get("dlock_held", "m_wait"), 0.0);
    assert_eq!(sink.get("dlock_hold_seconds", "m_wait"), 1.0);

    // Errors other than busy: an unknown backend (label "nowhere"), an invalid name.
    let e = dlock::Lock::new("metrics:b")
        .backend("nowhere")
        .metric_name("m_err")
        .acquire()
        .await
        .unwrap_err();
    assert!(matches!(e, dlock::LockError::UnknownBackend { .. }));
    sink.take();
    assert_eq!(
        sink.values.lock().unwrap().get(&(
            "dlock_errors_total".into(),
            "nowhere".into(),
            "m_err".into()
        )),
        Some(&1.0)
    );
    let _ = dlock::Lock::new("").metric_name("m_err").acquire().await;
    assert_eq!(sink.get("dlock_errors_total", "m_err"), 1.0);

    // A lost lease: counted once, and the hold ends (gauge back to 0) before the guard is gone.
    let g = dlock::Lock::new("metrics:c")
        .metric_name("m_lost")
        .ttl(Duration::from_millis(100))
        .watchdog(false)
        .acquire()
        .await
        .unwrap();
    assert_eq!(sink.get("dlock_held", "m_lost"), 1.0);
    tokio::time::timeout(Duration::from_secs(5), g.lost())
        .await
        .expect("lease not lost");
    assert_eq!(sink.get("dlock_lost_total", "m_lost"), 1.0);
    assert_eq!(sink.get("dlock_held", "m_lost"), 0.0);
    assert_eq!(sink.get("dlock_hold_seconds", "m_lost"), 1.0);
    drop(g);
    assert_eq!(sink.get("dlock_held", "m_lost"), 0.0, "hold ended twice");
    assert_eq!(sink.get("dlock_hold_seconds", "m_lost"), 1.0);
    assert_eq!(sink.get("dlock_lost_total", "m_lost"), 1.0);

    // The attribute labels with the function's name; a default Lock with "manual".
    assert_eq!(annotated(7).await.unwrap(), 7);
    assert_eq!(annotated(8).await.unwrap(), 8);
    assert_eq!(sink.get("dlock_acquisitions_total", "annotated"), 2.0);
    assert_eq!(sink.get("dlock_held", "annotated"), 0.0);
    dlock::Lock::new("metrics:d")
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    assert_eq!(sink.get("dlock_acquisitions_total", "manual"), 1.0);

    // A configuration failure of the attribute (an unknown policy) counts as an error, like an
    // unknown backend: before, it failed before any label existed and no counter moved.
    skipped_with_unknown_policy().await;
    assert_eq!(
        sink.get("dlock_errors_total", "skipped_with_unknown_policy"),
        1.0
    );

    // Rendered keys never become label values.
    sink.take();
    let labels = sink.label_values.lock().unwrap().clone();
    assert!(
        labels
            .iter()
            .all(|v| !v.contains("metrics:") && !v.contains("metrics-fn")),
        "{labels:?}"
    );
    // Described once, histograms in seconds.
    let units = sink.units.lock().unwrap().clone();
    for h in [
        "dlock_acquire_seconds",
        "dlock_wait_seconds",
        "dlock_hold_seconds",
    ] {
        assert_eq!(units.get(h), Some(&Some(Unit::Seconds)), "{h}: {units:?}");
    }
}
