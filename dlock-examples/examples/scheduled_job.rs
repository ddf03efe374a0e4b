//! One scheduled job in N tasks standing for N replicas: each replica's scheduler fires every
//! tick, a little apart from the others, and `on_busy = "skip"` + `hold_at_least` make the job
//! run exactly once per tick across all of them (ShedLock's pattern).
//!
//! ```text
//! cargo run -p dlock-examples --example scheduled_job
//! DLOCK_URL=redis://127.0.0.1:6379 cargo run -p dlock-examples --example scheduled_job
//! ```
//!
//! Runs 6 ticks of 300 ms, prints which replica ran each tick, and exits.

use std::sync::Mutex;
use std::time::Duration;

use dlock::distributed_lock;

const REPLICAS: usize = 5;
const TICKS: u32 = 6;
const PERIOD: Duration = Duration::from_millis(300);
/// How far apart the replicas' schedulers fire: replica `i` fires `i * SKEW` after the tick.
const SKEW: Duration = Duration::from_millis(15);

/// Who ran which tick.
static RUNS: Mutex<Vec<(u32, usize, u64)>> = Mutex::new(Vec::new());

/// The job. A replica that finds the lock taken skips the tick; the lock stays taken for
/// 200 ms after it was acquired even though the job takes 20 ms, so a replica whose scheduler
/// fires late in the same tick skips too. `hold_at_least` must stay below the period (the next
/// tick must find it free) and above the schedulers' spread (`(REPLICAS - 1) * SKEW`).
#[distributed_lock(
    key = "job:nightly-report",
    ttl = "10s",
    on_busy = "skip",
    hold_at_least = "200ms"
)]
async fn nightly_report(tick: u32, replica: usize) {
    let token = dlock::fencing_token().unwrap_or_default();
    tokio::time::sleep(Duration::from_millis(20)).await;
    RUNS.lock().unwrap().push((tick, replica, token));
}

#[tokio::main]
async fn main() -> Result<(), dlock::LockError> {
    if std::env::var_os(dlock::URL_ENV).is_some() {
        dlock::init_from_env().await?;
        println!("backend: the store DLOCK_URL names");
    } else {
        dlock::init("memory://").await?;
        println!("backend: in-memory (set DLOCK_URL, e.g. redis://127.0.0.1:6379, to share locks)");
    }
    let start = tokio::time::Instant::now() + Duration::from_millis(50);
    let replicas: Vec<_> = (0..REPLICAS)
        .map(|replica| {
            tokio::spawn(async move {
                for tick in 0..TICKS {
                    // The replicas' clocks disagree a little, and which one fires first varies.
                    let lag = (replica + tick as usize) % REPLICAS;
                    let at = start + PERIOD * tick + SKEW * u32::try_from(lag).unwrap_or(0);
                    tokio::time::sleep_until(at).await;
                    nightly_report(tick, replica).await;
                }
            })
        })
        .collect();
    for r in replicas {
        r.await.expect("replica task");
    }

    let runs = RUNS.lock().unwrap().clone();
    for tick in 0..TICKS {
        let ran: Vec<_> = runs.iter().filter(|r| r.0 == tick).collect();
        let who: Vec<String> = ran
            .iter()
            .map(|(_, rep, tok)| format!("replica {rep} (token {tok})"))
            .collect();
        println!("tick {tick}: {}", who.join(", "));
    }
    let per_tick: Vec<usize> = (0..TICKS)
        .map(|t| runs.iter().filter(|r| r.0 == t).count())
        .collect();
    println!(
        "runs: {} for {TICKS} ticks across {REPLICAS} replicas",
        runs.len()
    );
    assert!(
        per_tick.iter().all(|&n| n == 1),
        "every tick must run exactly once: {per_tick:?}"
    );
    Ok(())
}
