//! Several workers contend for one annotated function.
//!
//! ```text
//! cargo run -p dlock-examples --example quickstart                                    # in-memory backend
//! DLOCK_URL=redis://127.0.0.1:6379 cargo run -p dlock-examples --example quickstart   # Redis
//! ```
//!
//! Each worker increments a shared counter with a non-atomic read-modify-write under the lock;
//! the final count is exact only because the lock excludes the others.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A counter that loses updates unless callers exclude each other.
#[derive(Default)]
struct Ledger {
    balance: AtomicU64,
    last_token: AtomicU64,
}

#[dlock::distributed_lock(key = "ledger:{account}", ttl = "10s", wait = "5s")]
async fn deposit(
    ledger: Arc<Ledger>,
    account: u32,
    worker: usize,
) -> Result<u64, dlock::LockError> {
    let token = dlock::fencing_token().unwrap_or(0);
    // A fenced resource refuses a lower token than the highest it has seen.
    let previous = ledger.last_token.fetch_max(token, Ordering::SeqCst);
    assert!(token > previous, "fencing tokens must increase");
    let read = ledger.balance.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(2)).await; // widen the race window
    ledger.balance.store(read + 1, Ordering::SeqCst);
    println!("worker {worker:>2} holds ledger:{account} with fencing token {token}");
    Ok(read + 1)
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
    let ledger = Arc::new(Ledger::default());
    let workers = 8;
    let rounds = 5;
    let mut tasks = Vec::new();
    for worker in 0..workers {
        let ledger = ledger.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..rounds {
                deposit(ledger.clone(), 7, worker).await?;
            }
            Ok::<_, dlock::LockError>(())
        }));
    }
    for t in tasks {
        t.await.expect("worker panicked")?;
    }
    let balance = ledger.balance.load(Ordering::SeqCst);
    println!("balance: {balance} (expected {})", workers * rounds);
    assert_eq!(
        balance,
        (workers * rounds) as u64,
        "lost updates: the lock did not exclude"
    );
    Ok(())
}
