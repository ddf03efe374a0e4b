//! A fenced resource: a store that refuses a write whose fencing token is lower than the highest
//! it has seen, and the scenario it exists for, a paused holder's late write.
//!
//! ```text
//! cargo run -p dlock-examples --example fenced_store                                    # in-memory backend
//! DLOCK_URL=redis://127.0.0.1:6379 cargo run -p dlock-examples --example fenced_store   # Redis
//! ```
//!
//! Holder A takes the lock with a 300 ms lease and then stalls for 600 ms (standing in for a GC
//! pause, a SIGSTOP or a swapped-out process: its watchdog is off, so nothing renews the lease).
//! The lease runs out; B takes the lock with a larger token and writes. A wakes up and writes as
//! if it still held the lock. A lock alone cannot stop that write (A was not running when the
//! lease ended); the store can, because A's token is lower than B's. A could also have asked its
//! guard: `is_valid()` is false and `lost()` has fired, but a check can always come just before
//! another pause, and only the fence closes that gap.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock::{Backend, Lock, LockError};

/// A value guarded by fencing tokens: writes with a token lower than the highest seen are
/// refused. (On Redis the same check is a short Lua script; see `examples/torture/harness.rs`.)
#[derive(Debug, Default)]
struct FencedStore {
    inner: Mutex<StoreState>,
}

#[derive(Debug, Default)]
struct StoreState {
    highest_token: u64,
    value: String,
    log: Vec<String>,
}

/// Why the store refused a write.
#[derive(Debug)]
struct StaleToken {
    token: u64,
    highest: u64,
}

impl FencedStore {
    fn write(&self, token: u64, value: &str) -> Result<(), StaleToken> {
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let highest = s.highest_token;
        if token < highest {
            s.log
                .push(format!("refused {value:?} (token {token} < {highest})"));
            return Err(StaleToken {
                token,
                highest: s.highest_token,
            });
        }
        s.highest_token = token;
        s.value = value.to_string();
        s.log.push(format!("wrote {value:?} with token {token}"));
        Ok(())
    }

    fn value(&self) -> String {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .value
            .clone()
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), LockError> {
    if std::env::var_os(dlock::URL_ENV).is_some() {
        dlock::init_from_env().await?;
        println!("backend: the store DLOCK_URL names");
    } else {
        dlock::init("memory://").await?;
        println!("backend: in-memory (set DLOCK_URL, e.g. redis://127.0.0.1:6379, to share locks)");
    }
    let backend: Arc<dyn Backend> = dlock::backend(dlock::DEFAULT_BACKEND)?;
    let name = format!("fenced-store-demo:{}", std::process::id());
    let store = Arc::new(FencedStore::default());
    let ttl = Duration::from_millis(300);

    // A takes the lock, then stalls past its lease without renewing it.
    let a = Lock::new(&name)
        .ttl(ttl)
        .watchdog(false)
        .with_backend(backend.clone())
        .acquire()
        .await?;
    let a_token = a.fencing_token();
    println!("A holds {name} with token {a_token}; A stalls for 600 ms");
    let a_lost = a.lost();

    // B waits for the lock; it is granted once A's lease has run out.
    let b_task = {
        let (backend, name, store) = (backend.clone(), name.clone(), store.clone());
        tokio::spawn(async move {
            let b = Lock::new(&name)
                .ttl(Duration::from_secs(5))
                .wait(Duration::from_secs(5))
                .with_backend(backend)
                .acquire()
                .await?;
            println!("B holds {name} with token {} and writes", b.fencing_token());
            store
                .write(b.fencing_token(), "written by B")
                .expect("B holds the highest token");
            Ok::<_, LockError>(b)
        })
    };

    tokio::time::sleep(Duration::from_millis(600)).await; // the pause
    let b = b_task.await.expect("B's task")?;
    println!(
        "A wakes up: is_valid() = {}, lost() fired: {}",
        a.is_valid(),
        tokio::time::timeout(Duration::ZERO, a_lost).await.is_ok()
    );
    // A's late write, as a holder that did not check would send it.
    let refused = match store.write(a_token, "late write by A") {
        Err(StaleToken { token, highest }) => {
            println!("the store refused A's late write: token {token} < {highest}");
            true
        }
        Ok(()) => {
            println!("the store ACCEPTED A's late write");
            false
        }
    };
    match a.release().await {
        Err(LockError::Lost { .. } | LockError::NotOwner { .. }) => {
            println!("A's release: lost, not the owner any more (B's lock is untouched)")
        }
        other => println!("A's release: {other:?}"),
    }
    b.release().await?;
    println!("store value: {:?}", store.value());
    for line in &store.inner.lock().unwrap_or_else(|e| e.into_inner()).log {
        println!("  store log: {line}");
    }
    if !refused || store.value() != "written by B" {
        eprintln!("fenced_store: the stale write was not refused");
        std::process::exit(1);
    }
    Ok(())
}
