//! The semaphore and the read-write lock across real OS processes on a private Redis (issue 21,
//! item 5): holders in child processes (this test binary re-executed, `child_process_entry`)
//! check a shared counter on a second private redis-server; SIGKILLed holders' permits and read
//! holds come back after their ttl on the server's clock, not before; writers exclude readers and
//! writers across processes, also through downgrades; 8 readers in two processes re-acquiring in
//! a loop do not starve a writer.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{RedisProc, Rng, child_say, run_child, spawn_self};
use dlock::{Backend, LockError, RedisBackend, RwLock, Semaphore};

const CHILD_ENTRY: &str = "child_process_entry";

/// Not a test of its own: the entry point of child processes started by the tests below.
#[test]
#[ignore = "child-process entry point; the tests below run it in their children"]
fn child_process_entry() {
    run_child(|mode, backend| async move {
        match mode.as_str() {
            "sem_count" => child_sem_count(backend).await,
            "sem_hold" => child_sem_hold(backend).await,
            "rw_mix" => child_rw_mix(backend).await,
            "read_hold" => child_read_hold(backend).await,
            "read_loop" => child_read_loop(backend).await,
            other => panic!("unknown child mode {other}"),
        }
    });
}

fn env_num(k: &str) -> u64 {
    std::env::var(k)
        .unwrap_or_else(|_| panic!("{k}"))
        .parse()
        .unwrap()
}

async fn check_con() -> redis::aio::MultiplexedConnection {
    redis::Client::open(std::env::var("DLOCK_CHECK_URL").unwrap())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// The checker's counters (on the second server, never the lock's)
// ---------------------------------------------------------------------------------------------

/// A semaphore holder comes in: `in` + 1, the peak kept, a violation counted above `ARGV[1]`.
const SEM_ENTER: &str = r"
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
if n > tonumber(ARGV[1]) then redis.call('INCR', KEYS[3]) end
return n";

/// A writer comes in: a violation when another writer or any reader is in.
const W_ENTER: &str = r"
local w = redis.call('INCR', KEYS[1])
local r = tonumber(redis.call('GET', KEYS[2]) or '0')
if w ~= 1 or r ~= 0 then redis.call('INCR', KEYS[3]) end
redis.call('INCR', KEYS[4])
return w";

/// A reader comes in: a violation when a writer is in; the readers' peak kept.
const R_ENTER: &str = r"
local r = redis.call('INCR', KEYS[2])
if r > tonumber(redis.call('GET', KEYS[4]) or '0') then redis.call('SET', KEYS[4], r) end
if tonumber(redis.call('GET', KEYS[1]) or '0') ~= 0 then redis.call('INCR', KEYS[3]) end
return r";

/// A writer about to downgrade counts as a reader from now on (while it still holds the write
/// side, so the counters never claim less than the lock grants).
const W_TO_R: &str = r"
redis.call('DECR', KEYS[1])
redis.call('INCR', KEYS[2])
redis.call('INCR', KEYS[3])
return 1";

const W: &str = "w";
const R: &str = "r";
const VIOL: &str = "viol";
const WRITES: &str = "writes";
const PEAK_R: &str = "peak_r";
const DOWNGRADES: &str = "downgrades";

/// The error of an acquisition that must fail.
fn refused<G>(r: Result<G, LockError>) -> LockError {
    match r {
        Ok(_) => panic!("granted where it must be refused"),
        Err(e) => e,
    }
}

async fn get(con: &mut redis::aio::MultiplexedConnection, key: &str) -> i64 {
    let v: Option<i64> = redis::cmd("GET").arg(key).query_async(con).await.unwrap();
    v.unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// Children
// ---------------------------------------------------------------------------------------------

/// `DLOCK_TASKS` tasks take one permit of `xsem` (`DLOCK_MAX`) `DLOCK_ITERS` times each; inside
/// each hold the counter `in` goes up and down, and a value above `DLOCK_LIMIT` is a violation.
async fn child_sem_count(backend: Arc<dyn Backend>) {
    let (max, limit) = (env_num("DLOCK_MAX") as u32, env_num("DLOCK_LIMIT"));
    let (tasks, iters) = (env_num("DLOCK_TASKS"), env_num("DLOCK_ITERS"));
    child_say("ready");
    let mut handles = Vec::new();
    for t in 0..tasks {
        let backend = backend.clone();
        handles.push(tokio::spawn(async move {
            let mut con = check_con().await;
            let mut rng = Rng::new(std::process::id() as u64 * 100 + t);
            for _ in 0..iters {
                let g = Semaphore::new("xsem", max)
                    .with_backend(backend.clone())
                    .ttl(Duration::from_secs(10))
                    .wait(Duration::from_secs(60))
                    .acquire()
                    .await
                    .unwrap();
                let _: i64 = redis::Script::new(SEM_ENTER)
                    .key("in")
                    .key("peak")
                    .key(VIOL)
                    .arg(limit)
                    .invoke_async(&mut con)
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(rng.below(15))).await;
                let _: i64 = redis::cmd("DECR")
                    .arg("in")
                    .query_async(&mut con)
                    .await
                    .unwrap();
                g.release().await.unwrap();
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    child_say("done");
}

/// Takes all permits of `xkill` (max 2, ttl 3 s, watchdog on), says its owner, holds until
/// killed.
async fn child_sem_hold(backend: Arc<dyn Backend>) {
    let g = Semaphore::new("xkill", 2)
        .permits(2)
        .ttl(Duration::from_secs(3))
        .with_backend(backend)
        .acquire()
        .await
        .unwrap();
    child_say(format!("acquired {} {}", g.owner(), g.fencing_token()));
    std::future::pending::<()>().await;
}

/// `DLOCK_READERS` reader tasks and `DLOCK_WRITERS` writer tasks on the read-write lock `xrw`,
/// `DLOCK_ITERS` holds each, every hold checked against the counters; every other write hold
/// downgrades to a read hold before it ends.
async fn child_rw_mix(backend: Arc<dyn Backend>) {
    let (readers, writers, iters) = (
        env_num("DLOCK_READERS"),
        env_num("DLOCK_WRITERS"),
        env_num("DLOCK_ITERS"),
    );
    child_say("ready");
    let mut handles = Vec::new();
    for t in 0..readers + writers {
        let backend = backend.clone();
        let writer = t >= readers;
        handles.push(tokio::spawn(async move {
            let mut con = check_con().await;
            let mut rng = Rng::new(std::process::id() as u64 * 100 + t);
            let lock = RwLock::new("xrw")
                .with_backend(backend)
                .ttl(Duration::from_secs(10))
                .wait(Duration::from_secs(60));
            for i in 0..iters {
                if writer {
                    let g = lock.write().await.unwrap();
                    let _: i64 = redis::Script::new(W_ENTER)
                        .key(W)
                        .key(R)
                        .key(VIOL)
                        .key(WRITES)
                        .invoke_async(&mut con)
                        .await
                        .unwrap();
                    tokio::time::sleep(Duration::from_millis(rng.below(4))).await;
                    if i % 2 == 0 {
                        let _: i64 = redis::Script::new(W_TO_R)
                            .key(W)
                            .key(R)
                            .key(DOWNGRADES)
                            .invoke_async(&mut con)
                            .await
                            .unwrap();
                        let r = g.downgrade().await.unwrap();
                        tokio::time::sleep(Duration::from_millis(rng.below(6))).await;
                        let _: i64 = redis::cmd("DECR")
                            .arg(R)
                            .query_async(&mut con)
                            .await
                            .unwrap();
                        r.release().await.unwrap();
                    } else {
                        let _: i64 = redis::cmd("DECR")
                            .arg(W)
                            .query_async(&mut con)
                            .await
                            .unwrap();
                        g.release().await.unwrap();
                    }
                } else {
                    let g = lock.read().await.unwrap();
                    let _: i64 = redis::Script::new(R_ENTER)
                        .key(W)
                        .key(R)
                        .key(VIOL)
                        .key(PEAK_R)
                        .invoke_async(&mut con)
                        .await
                        .unwrap();
                    tokio::time::sleep(Duration::from_millis(rng.below(6))).await;
                    let _: i64 = redis::cmd("DECR")
                        .arg(R)
                        .query_async(&mut con)
                        .await
                        .unwrap();
                    g.release().await.unwrap();
                }
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    child_say("done");
}

/// Takes the read side of `xrkill` (ttl 3 s, watchdog on), says its owner, holds until killed.
async fn child_read_hold(backend: Arc<dyn Backend>) {
    let g = RwLock::new("xrkill")
        .ttl(Duration::from_secs(3))
        .with_backend(backend)
        .read()
        .await
        .unwrap();
    child_say(format!("acquired {} {}", g.owner(), g.fencing_token()));
    std::future::pending::<()>().await;
}

/// 4 reader tasks re-acquire the read side of `xstarve` in a loop (holds of 150 ms, started
/// 40 ms apart), until `DLOCK_SECS` have passed; says "reading" once all four hold.
async fn child_read_loop(backend: Arc<dyn Backend>) {
    let secs = env_num("DLOCK_SECS");
    let end = Instant::now() + Duration::from_secs(secs);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(8);
    let mut handles = Vec::new();
    for _ in 0..4 {
        let lock = RwLock::new("xstarve")
            .with_backend(backend.clone())
            .ttl(Duration::from_secs(5))
            .wait(Duration::from_secs(10));
        let tx = tx.clone();
        handles.push(tokio::spawn(async move {
            let mut first = true;
            while Instant::now() < end {
                let t0 = Instant::now();
                let g = lock.read().await.unwrap_or_else(|e| {
                    panic!(
                        "pid {}: read failed after {:?}: {e:?}",
                        std::process::id(),
                        t0.elapsed()
                    )
                });
                if t0.elapsed() > Duration::from_secs(1) {
                    eprintln!(
                        "pid {}: a read waited {:?}",
                        std::process::id(),
                        t0.elapsed()
                    );
                }
                // Blocked well beyond the writer's visit (it gets in within 2 s): a reader that
                // slept until a lease end it had heard of (5 s) instead of being let in.
                assert!(
                    t0.elapsed() < Duration::from_secs(3),
                    "pid {}: a read waited {:?}",
                    std::process::id(),
                    t0.elapsed()
                );
                if first {
                    first = false;
                    let _ = tx.send(()).await;
                }
                tokio::time::sleep(Duration::from_millis(150)).await;
                g.release().await.unwrap();
            }
        }));
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    for _ in 0..4 {
        rx.recv().await.unwrap();
    }
    child_say("reading");
    for h in handles {
        h.await.unwrap();
    }
    child_say("done");
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

async fn start_servers() -> (RedisProc, RedisProc) {
    tokio::task::spawn_blocking(|| (RedisProc::start(), RedisProc::start()))
        .await
        .unwrap()
}

fn run_children(children: &mut [common::ChildProc], within: Duration) {
    tokio::task::block_in_place(|| {
        for c in children.iter() {
            assert_eq!(c.expect_line(Duration::from_secs(30)), "ready");
        }
        for c in children.iter_mut() {
            assert_eq!(c.expect_line(within), "done");
            c.wait_success(Duration::from_secs(10));
        }
    });
}

/// 4 processes × 4 tasks take one permit of a 3-permit semaphore 15 times each; every holder
/// increments a counter on a second server inside its hold and checks it: never above 3, and
/// the peak is exactly 3 (so the check bites: a checker limit of 2, or a max of 4 with the
/// limit at 3, fails this test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_max_holds_across_processes_by_a_shared_counter() {
    const MAX: u32 = 3;
    let (server, check) = start_servers().await;
    let envs = [
        ("DLOCK_URL", server.url()),
        ("DLOCK_CHECK_URL", check.url()),
        ("DLOCK_MAX", MAX.to_string()),
        ("DLOCK_LIMIT", MAX.to_string()),
        ("DLOCK_TASKS", "4".to_string()),
        ("DLOCK_ITERS", "15".to_string()),
    ];
    let mut children: Vec<_> = (0..4)
        .map(|_| spawn_self(CHILD_ENTRY, "sem_count", &envs))
        .collect();
    run_children(&mut children, Duration::from_secs(90));
    let mut con = check.admin_async().await;
    assert_eq!(
        get(&mut con, VIOL).await,
        0,
        "more than {MAX} holders at once across processes"
    );
    assert_eq!(
        get(&mut con, "peak").await,
        MAX as i64,
        "the holders never reached the max: the check proved nothing"
    );
    assert_eq!(get(&mut con, "in").await, 0);
    // Every permit came back: the whole max is free at once.
    let b: Arc<dyn Backend> = Arc::new(RedisBackend::connect(&server.url()).await.unwrap());
    let all = Semaphore::new("xsem", MAX)
        .permits(MAX)
        .with_backend(b)
        .acquire()
        .await
        .expect("all permits free after the run");
    all.release().await.unwrap();
}

/// Server time in ms (`TIME`).
async fn server_ms(con: &mut redis::aio::MultiplexedConnection) -> u64 {
    let (s, us): (u64, u64) = redis::cmd("TIME").query_async(con).await.unwrap();
    s * 1000 + us / 1000
}

/// A child holding both permits of a 2-permit semaphore (ttl 3 s, renewed) is SIGKILLed: right
/// after the kill the survivor still gets `Busy`; its waiting acquisition is granted after the
/// dead owner's lease end on the server's clock (its token, the server's µs at the grant, is
/// at or past the lease end read at the kill), and within the lease left plus 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_holders_permits_return_after_its_ttl_not_before() {
    let server = tokio::task::spawn_blocking(RedisProc::start).await.unwrap();
    let b: Arc<dyn Backend> = Arc::new(RedisBackend::connect(&server.url()).await.unwrap());
    let sem = || {
        Semaphore::new("xkill", 2)
            .permits(2)
            .with_backend(b.clone())
    };
    for round in 0..2 {
        let mut child = spawn_self(CHILD_ENTRY, "sem_hold", &[("DLOCK_URL", server.url())]);
        let line = tokio::task::block_in_place(|| child.expect_line(Duration::from_secs(30)));
        let mut parts = line.split(' ');
        assert_eq!(parts.next(), Some("acquired"), "{line}");
        let owner = parts.next().unwrap().to_string();
        let child_token: u64 = parts.next().unwrap().parse().unwrap();
        // Past the first renewal (ttl/3), so the lease at the kill comes from the watchdog.
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let e = refused(sem().acquire().await);
        assert!(matches!(e, LockError::Busy { .. }), "{e:?}");

        child.kill();
        let killed = Instant::now();
        let mut admin = server.admin_async().await;
        let lease_end: u64 = redis::cmd("ZSCORE")
            .arg("dlock:sem:{xkill}:z")
            .arg(&owner)
            .query_async(&mut admin)
            .await
            .unwrap();
        let left = lease_end.saturating_sub(server_ms(&mut admin).await);
        assert!(
            left > 500,
            "round {round}: only {left} ms of lease at the kill"
        );
        let e = refused(sem().acquire().await);
        assert!(
            matches!(e, LockError::Busy { .. }),
            "round {round}: the dead holder's permits came back at once: {e:?}"
        );

        let g = sem()
            .wait(Duration::from_secs(10))
            .acquire()
            .await
            .expect("the dead holder's permits come back");
        let at = killed.elapsed();
        assert!(
            g.fencing_token() / 1000 >= lease_end,
            "round {round}: granted at server µs {} before the dead lease's end {lease_end} ms",
            g.fencing_token()
        );
        assert!(g.fencing_token() > child_token);
        assert!(
            at <= Duration::from_millis(left) + Duration::from_secs(2),
            "round {round}: the permits came back {at:?} after the kill, {left} ms of lease left"
        );
        g.release().await.unwrap();
    }
}

/// 3 processes, each with 3 reader and 2 writer tasks, 12 holds per task on one read-write lock;
/// every hold checks counters on a second server: a writer never shares the lock with a reader
/// or another writer, also while half the write holds downgrade (the downgrading writer counts
/// as a reader before it downgrades, so a writer granted in a gap of the downgrade is caught);
/// readers do share (peak ≥ 2), and every write and downgrade happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rw_exclusion_and_downgrade_across_processes() {
    const PROCS: usize = 3;
    const ITERS: u64 = 12;
    let (server, check) = start_servers().await;
    let envs = [
        ("DLOCK_URL", server.url()),
        ("DLOCK_CHECK_URL", check.url()),
        ("DLOCK_READERS", "3".to_string()),
        ("DLOCK_WRITERS", "2".to_string()),
        ("DLOCK_ITERS", ITERS.to_string()),
    ];
    let mut children: Vec<_> = (0..PROCS)
        .map(|_| spawn_self(CHILD_ENTRY, "rw_mix", &envs))
        .collect();
    run_children(&mut children, Duration::from_secs(90));
    let mut con = check.admin_async().await;
    assert_eq!(get(&mut con, VIOL).await, 0, "a writer shared the lock");
    assert_eq!(
        get(&mut con, WRITES).await,
        (PROCS as i64) * 2 * ITERS as i64
    );
    assert_eq!(
        get(&mut con, DOWNGRADES).await,
        (PROCS as i64) * 2 * ITERS as i64 / 2
    );
    assert!(
        get(&mut con, PEAK_R).await >= 2,
        "readers never shared the lock"
    );
    assert_eq!((get(&mut con, W).await, get(&mut con, R).await), (0, 0));
}

/// A child holding the read side (ttl 3 s, renewed) is SIGKILLed: a writer still gets `Busy`
/// right after the kill, and its waiting `write()` is granted after the dead reader's lease end
/// on the server's clock and within the lease left plus 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_reader_blocks_writers_at_most_its_ttl() {
    let server = tokio::task::spawn_blocking(RedisProc::start).await.unwrap();
    let b: Arc<dyn Backend> = Arc::new(RedisBackend::connect(&server.url()).await.unwrap());
    let lock = RwLock::new("xrkill").with_backend(b);
    let mut child = spawn_self(CHILD_ENTRY, "read_hold", &[("DLOCK_URL", server.url())]);
    let line = tokio::task::block_in_place(|| child.expect_line(Duration::from_secs(30)));
    let mut parts = line.split(' ');
    assert_eq!(parts.next(), Some("acquired"), "{line}");
    let owner = parts.next().unwrap().to_string();
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let e = refused(lock.write().await);
    assert!(matches!(e, LockError::Busy { .. }), "{e:?}");
    // Another reader is not blocked by the live reader (a short wait: the refused writer's
    // marker is cleared by its give-back, in the background).
    lock.clone()
        .wait(Duration::from_secs(2))
        .read()
        .await
        .expect("a second reader shares the lock")
        .release()
        .await
        .unwrap();

    child.kill();
    let killed = Instant::now();
    let mut admin = server.admin_async().await;
    let lease_end: u64 = redis::cmd("ZSCORE")
        .arg("dlock:{xrkill}:rw:r")
        .arg(&owner)
        .query_async(&mut admin)
        .await
        .unwrap();
    let left = lease_end.saturating_sub(server_ms(&mut admin).await);
    assert!(left > 500, "only {left} ms of lease at the kill");
    let e = refused(lock.write().await);
    assert!(
        matches!(e, LockError::Busy { .. }),
        "the dead reader's hold ended at once: {e:?}"
    );
    let g = lock
        .clone()
        .wait(Duration::from_secs(10))
        .write()
        .await
        .expect("the writer gets in after the dead reader's ttl");
    let at = killed.elapsed();
    assert!(
        g.fencing_token() / 1000 >= lease_end,
        "write granted at server µs {} before the dead reader's lease end {lease_end} ms",
        g.fencing_token()
    );
    assert!(
        at <= Duration::from_millis(left) + Duration::from_secs(2),
        "the writer waited {at:?} after the kill, {left} ms of lease left"
    );
    g.release().await.unwrap();
}

/// Two processes with 4 readers each re-acquire the read side in a loop (150 ms holds,
/// staggered, so some reader always holds); a writer in this process gets in within 2 s (a
/// read hold plus the wake-ups), where without writer preference it would wait for a moment
/// with no reader at all, which this load never leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_writer_starvation_with_8_readers_in_two_processes() {
    let server = tokio::task::spawn_blocking(RedisProc::start).await.unwrap();
    let envs = [("DLOCK_URL", server.url()), ("DLOCK_SECS", "8".to_string())];
    let mut children: Vec<_> = (0..2)
        .map(|_| spawn_self(CHILD_ENTRY, "read_loop", &envs))
        .collect();
    tokio::task::block_in_place(|| {
        for c in &children {
            assert_eq!(c.expect_line(Duration::from_secs(30)), "reading");
        }
    });
    let b: Arc<dyn Backend> = Arc::new(RedisBackend::connect(&server.url()).await.unwrap());
    let lock = RwLock::new("xstarve").with_backend(b);
    // The readers do hold (read on the server, not by a try of the write side, which would
    // leave a marker behind for its give-back to clear).
    let mut admin = server.admin_async().await;
    let holding: u64 = redis::cmd("ZCARD")
        .arg("dlock:{xstarve}:rw:r")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(holding > 0, "no reader holds");
    // A try that does not wait is refused while readers hold, and its give-back (which clears
    // the marker the try left) must not leave the readers blocked after the writer has gone.
    let e = refused(lock.write().await);
    assert!(matches!(e, LockError::Busy { .. }), "{e:?}");
    let asked = Instant::now();
    let g = lock
        .clone()
        .wait(Duration::from_secs(5))
        .write()
        .await
        .expect("the writer is not starved by 8 looping readers");
    let took = asked.elapsed();
    assert!(took < Duration::from_secs(2), "the writer waited {took:?}");
    g.release().await.unwrap();
    tokio::task::block_in_place(|| {
        for c in children.iter_mut() {
            assert_eq!(c.expect_line(Duration::from_secs(30)), "done");
            c.wait_success(Duration::from_secs(10));
        }
    });
}
