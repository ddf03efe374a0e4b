//! dlock's metrics in the Prometheus text format: installs `metrics-exporter-prometheus`'s
//! recorder (any `metrics` exporter works; dlock only talks to the facade), takes some locks,
//! contends on one, loses one, and prints what a `/metrics` endpoint would serve.
//!
//! ```text
//! cargo run -p dlock-examples --features metrics --example metrics_prometheus
//! ```

use std::time::Duration;

use metrics_exporter_prometheus::PrometheusBuilder;

#[dlock::distributed_lock(key = "report:{day}", ttl = "5s")]
async fn build_report(day: u32) -> Result<u32, dlock::LockError> {
    tokio::time::sleep(Duration::from_millis(5)).await;
    Ok(day)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Install the recorder before the first lock is taken.
    let handle = PrometheusBuilder::new().install_recorder()?;
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
    // A lease that runs out: counted in dlock_lost_total.
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
