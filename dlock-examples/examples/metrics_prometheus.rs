//! dlock's metrics in the Prometheus text format: installs `metrics-exporter-prometheus`'s
//! recorder (any `metrics` exporter works; dlock only talks to the facade) with the README's
//! suggested histogram buckets, takes some locks, contends on one, loses one, and prints what a
//! `/metrics` endpoint would serve: `dlock_acquire_total{result=...}` (and `kind` for errors),
//! `dlock_lost_total{reason=...}`, the three histograms as true Prometheus histograms.
//!
//! ```text
//! cargo run -p dlock-examples --features metrics --example metrics_prometheus
//! ```

use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

/// Suggested buckets, in seconds (README, "Metrics"); add your own `wait`, ttl and `max_hold`.
const ACQUIRE_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
const WAIT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const HOLD_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

#[dlock::distributed_lock(key = "report:{day}", ttl = "5s")]
async fn build_report(day: u32) -> Result<u32, dlock::LockError> {
    tokio::time::sleep(Duration::from_millis(5)).await;
    Ok(day)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Install the recorder before the first lock is taken. Without buckets the exporter renders
    // the histograms as summaries.
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("dlock_acquire_seconds".into()),
            ACQUIRE_BUCKETS,
        )?
        .set_buckets_for_metric(Matcher::Full("dlock_wait_seconds".into()), WAIT_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full("dlock_hold_seconds".into()), HOLD_BUCKETS)?
        .install_recorder()?;
    if std::env::var_os(dlock::URL_ENV).is_some() {
        dlock::init_from_env().await?;
    } else {
        dlock::init("memory://").await?;
    }

    for day in 1..=3 {
        build_report(day).await?;
    }
    // Contention: a second caller finds the lock busy, a third waits for it.
    let held = dlock::Lock::new("export:daily")
        .metric_name("export")
        .acquire()
        .await?;
    let busy = dlock::Lock::new("export:daily")
        .metric_name("export")
        .acquire()
        .await;
    assert!(busy.is_err());
    let waiter = tokio::spawn(async {
        dlock::Lock::new("export:daily")
            .metric_name("export")
            .wait(Duration::from_secs(2))
            .acquire()
            .await
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    held.release().await?;
    waiter.await??.release().await?;
    // A configuration error: dlock_acquire_total{result="error",kind="config"}.
    let zero_ttl = dlock::Lock::new("export:weekly")
        .metric_name("export")
        .ttl(Duration::ZERO)
        .acquire()
        .await;
    assert!(matches!(zero_ttl, Err(dlock::LockError::Config(_))));
    // A lease that runs out: dlock_lost_total{reason="deadline"}.
    let short = dlock::Lock::new("export:hourly")
        .metric_name("export")
        .ttl(Duration::from_millis(50))
        .watchdog(false)
        .acquire()
        .await?;
    short.lost().await;
    drop(short);

    print!("{}", handle.render());
    Ok(())
}
