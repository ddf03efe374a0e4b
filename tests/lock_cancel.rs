//! B5, the cancellation storm: thousands of acquire futures dropped mid-flight (`timeout` of
//! 0–2 ms, or a `select!` that loses) against a private redis-server. Afterwards (past the ttl)
//! no lock hash remains, nothing renews any more (no orphaned watchdog), and the lock never had
//! two holders at once (sampled every 5 ms).

#[path = "../examples/torture/checker.rs"]
mod checker;
#[path = "../examples/torture/harness.rs"]
mod harness;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use dlock::{Backend, Lock, RedisBackend};
use harness::{RedisServer, Rng};

const NAME: &str = "storm";
const HASH: &str = "dlock:{storm}";

/// Sum of `calls=` over the EVAL/EVALSHA lines of `INFO commandstats`.
fn script_calls(srv: &RedisServer) -> u64 {
    let Ok(harness::Resp::Bulk(Some(info))) = srv.cmd(&["INFO", "commandstats"]) else {
        panic!("INFO commandstats");
    };
    info.lines()
        .filter(|l| l.starts_with("cmdstat_eval"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

fn holders(srv: &RedisServer) -> usize {
    srv.cmd(&["HKEYS", HASH])
        .map(|r| r.strings().iter().filter(|k| !k.starts_with(':')).count())
        .unwrap_or(0)
}

#[test]
fn cancellation_storm_leaves_no_lock_and_no_watchdog() {
    let dir = std::env::temp_dir().join(format!("dlock-cancel-storm-{}", std::process::id()));
    let srv = Arc::new(RedisServer::start(&dir).expect("redis-server"));
    let ttl = Duration::from_millis(500);
    let storm = Duration::from_secs(6);

    let stop = Arc::new(AtomicBool::new(false));
    let max_holders = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (srv, stop, max) = (srv.clone(), stop.clone(), max_holders.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                max.fetch_max(holders(&srv) as u64, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (cancels, grants) = rt.block_on(async {
        let backend: Arc<dyn Backend> =
            Arc::new(RedisBackend::connect(&srv.url()).await.expect("connect"));
        let cancels = Arc::new(AtomicU64::new(0));
        let grants = Arc::new(AtomicU64::new(0));
        let end = tokio::time::Instant::now() + storm;
        let tasks: Vec<_> = (0..4u64)
            .map(|t| {
                let lock = Lock::new(NAME)
                    .ttl(ttl)
                    .wait(Duration::from_secs(2))
                    .with_backend(backend.clone());
                let (cancels, grants) = (cancels.clone(), grants.clone());
                tokio::spawn(async move {
                    let mut rng = Rng::new(harness::mono() ^ t);
                    while tokio::time::Instant::now() < end {
                        let limit = Duration::from_micros(rng.range(0, 2001));
                        let guard = if rng.range(0, 2) == 0 {
                            tokio::time::timeout(limit, lock.acquire()).await.ok()
                        } else {
                            tokio::select! {
                                r = lock.acquire() => Some(r),
                                _ = tokio::time::sleep(limit) => None,
                            }
                        };
                        match guard {
                            None => {
                                cancels.fetch_add(1, Ordering::Relaxed);
                            }
                            Some(Ok(g)) => {
                                grants.fetch_add(1, Ordering::Relaxed);
                                tokio::task::yield_now().await;
                                if rng.range(0, 2) == 0 {
                                    drop(g); // released in the background
                                } else {
                                    let _ = g.release().await;
                                }
                            }
                            Some(Err(_)) => {}
                        }
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("storm task panicked");
        }
        // Past the ttl: every hold, whether released, dropped or left by a cancelled acquire,
        // is gone by now even if its clean-up failed.
        tokio::time::sleep(ttl * 3).await;
        (
            cancels.load(Ordering::Relaxed),
            grants.load(Ordering::Relaxed),
        )
    });
    stop.store(true, Ordering::Relaxed);
    sampler.join().expect("sampler");

    eprintln!(
        "cancellation storm: {cancels} acquires cancelled, {grants} granted, max holders seen {}",
        max_holders.load(Ordering::Relaxed)
    );
    assert!(
        cancels >= 3_000,
        "too few cancellations to mean anything: {cancels}"
    );
    assert!(grants > 0, "no acquisition went through");
    assert!(
        max_holders.load(Ordering::Relaxed) <= 1,
        "two holders at once"
    );
    let keys = srv.cmd(&["KEYS", "dlock:*"]).expect("KEYS").strings();
    // Fence keys and the process's holder identity key outlive the locks.
    let locks: Vec<_> = keys
        .iter()
        .filter(|k| !k.ends_with(":fence") && !k.starts_with("dlock:holder:"))
        .collect();
    assert!(locks.is_empty(), "lock keys left behind: {locks:?}");
    // A leaked watchdog would still be renewing (every ttl/3): no script may run any more.
    let before = script_calls(&srv);
    std::thread::sleep(ttl);
    assert_eq!(
        script_calls(&srv),
        before,
        "something still runs scripts: a leaked watchdog"
    );
    drop(rt);
    drop(srv);
    let _ = std::fs::remove_dir_all(&dir);
}
