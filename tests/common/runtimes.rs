//! One backend used from two tokio runtimes, one of which shuts down while the other goes on
//! (the session engines' cross-runtime test; the SQL engines have their own, registry-based one).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock::{Backend, Lock};

/// How many locked increments each runtime makes before A shuts down.
const ROUNDS: u64 = 25;

fn runtime(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// One increment of a shared counter under the lock `rt`, by a non-atomic read-modify-write
/// with an await in between: an overlap of two holders loses an update.
pub async fn locked_increment(b: &Arc<dyn Backend>, counter: &AtomicU64, ttl: Option<Duration>) {
    let mut lock = Lock::new("rt")
        .with_backend(b.clone())
        .wait(Duration::from_secs(5));
    if let Some(ttl) = ttl {
        lock = lock.ttl(ttl);
    }
    let g = lock.acquire().await.expect("acquire `rt` within 5 s");
    let v = counter.load(Relaxed);
    tokio::time::sleep(Duration::from_millis(1)).await;
    counter.store(v + 1, Relaxed);
    g.release().await.expect("release `rt`");
}

/// The backend made by `make`, run on runtime A, shared as an `Arc<dyn Backend>` the way the
/// registry hands it out: A and a runtime B on another thread each make 25 locked increments of
/// one counter; B then takes `held-b`, and A shuts down while B keeps locking for `after`. The
/// count is exact (no overlap), every call of B after A's shutdown is answered (bounded waits,
/// no hang) and B's hold survives (no task of A kept it alive). With `ttl`, every lock uses it
/// and A first takes `keep-a` with it (so the lease of that length is granted and kept alive
/// from A), released before A shuts down.
pub fn one_backend_two_runtimes(
    make: impl Future<Output = Arc<dyn Backend>>,
    ttl: Option<Duration>,
    after: Duration,
) {
    let rt_a = runtime(2);
    let backend = rt_a.block_on(make);
    let with_ttl = move |l: Lock| match ttl {
        Some(t) => l.ttl(t),
        None => l,
    };
    let keep_a = ttl.map(|_| {
        rt_a.block_on(with_ttl(Lock::new("keep-a").with_backend(backend.clone())).acquire())
            .expect("A takes keep-a")
    });
    let counter = Arc::new(AtomicU64::new(0));
    let a_down: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let (phase1_tx, phase1_rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Result<u64, String>>();
    let thread_b = {
        let (b, counter, a_down) = (backend.clone(), counter.clone(), a_down.clone());
        std::thread::spawn(move || {
            let rt_b = runtime(1);
            let r = rt_b.block_on(async move {
                for _ in 0..ROUNDS {
                    locked_increment(&b, &counter, ttl).await;
                }
                let held = with_ttl(Lock::new("held-b").with_backend(b.clone()))
                    .acquire()
                    .await
                    .map_err(|e| format!("B takes held-b: {e}"))?;
                let _ = phase1_tx.send(());
                // Keep locking while A shuts down, and for `after` once it is down.
                let started = Instant::now();
                let mut n = 0u64;
                loop {
                    let down = *a_down.lock().unwrap();
                    if down.is_some_and(|t| t.elapsed() >= after) {
                        break;
                    }
                    if started.elapsed() > Duration::from_secs(60) {
                        return Err("runtime A never shut down".to_string());
                    }
                    tokio::time::timeout(
                        Duration::from_secs(10),
                        locked_increment(&b, &counter, ttl),
                    )
                    .await
                    .map_err(|_| "a locked increment on B hung".to_string())?;
                    n += 1;
                }
                if !held.is_valid() || held.lost_reason().is_some() {
                    return Err(format!(
                        "B's hold was lost after A shut down: {:?}",
                        held.lost_reason()
                    ));
                }
                held.release()
                    .await
                    .map_err(|e| format!("release held-b: {e}"))?;
                Ok(n)
            });
            let _ = done_tx.send(r);
        })
    };
    rt_a.block_on(async {
        for _ in 0..ROUNDS {
            locked_increment(&backend, &counter, ttl).await;
        }
    });
    phase1_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("B finished its first rounds");
    if let Some(g) = keep_a {
        rt_a.block_on(g.release()).expect("A releases keep-a");
    }
    // Shut A down while B keeps locking.
    drop(rt_a);
    *a_down.lock().unwrap() = Some(Instant::now());
    let n_b = match done_rx.recv_timeout(Duration::from_secs(90)) {
        Ok(r) => r.unwrap_or_else(|e| panic!("{e}")),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("thread B did not finish within 90 s (hang)")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            // B panicked: report its panic.
            std::panic::resume_unwind(thread_b.join().expect_err("B ended without a result"))
        }
    };
    thread_b.join().expect("thread B");
    assert!(n_b >= 5, "B locked only {n_b} times after A shut down");
    assert_eq!(
        counter.load(Relaxed),
        2 * ROUNDS + n_b,
        "lost updates: two holders overlapped"
    );
}
