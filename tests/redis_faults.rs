//! Redis-only behaviour under faults (RELIABILITY.md §7 groups A2, B1, C1, C3): several OS
//! processes, a holder killed with SIGKILL, a server killed and restarted, a paused server.
//!
//! Cross-process tests re-execute this test binary (`child_process_entry` in child mode).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Env, RedisProc, Rng, TempDir, child_say, run_child, spawn_self};
use dlock::{Backend, Lock, LockError, LostReason};

const CHILD_ENTRY: &str = "child_process_entry";

/// Not a test of its own: the entry point of child processes started by the tests below.
#[test]
#[ignore = "child-process entry point; the tests below run it in their children"]
fn child_process_entry() {
    run_child(|mode, backend| async move {
        match mode.as_str() {
            "hold" => child_hold(backend).await,
            "increment" => child_increment(backend).await,
            other => panic!("unknown child mode {other}"),
        }
    });
}

/// Takes `crash` (ttl 1 s, watchdog on), says so, and holds it until killed.
async fn child_hold(backend: Arc<dyn Backend>) {
    let g = Lock::new("crash")
        .with_backend(backend)
        .ttl(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap();
    child_say(format!("acquired {}", g.fencing_token()));
    std::future::pending::<()>().await;
}

/// Several tasks increment a counter file under the lock `xp`, appending each grant's token to a
/// log file (in grant order, as it happens under the lock).
async fn child_increment(backend: Arc<dyn Backend>) {
    let counter = std::env::var("DLOCK_COUNTER").unwrap();
    let log = std::env::var("DLOCK_LOG").unwrap();
    let tasks: usize = std::env::var("DLOCK_TASKS").unwrap().parse().unwrap();
    let iters: usize = std::env::var("DLOCK_ITERS").unwrap().parse().unwrap();
    child_say("ready");
    let mut handles = Vec::new();
    for t in 0..tasks {
        let (backend, counter, log) = (backend.clone(), counter.clone(), log.clone());
        handles.push(tokio::spawn(async move {
            let mut rng = Rng::new(std::process::id() as u64 * 100 + t as u64);
            for _ in 0..iters {
                let g = Lock::new("xp")
                    .with_backend(backend.clone())
                    .ttl(Duration::from_secs(10))
                    .wait(Duration::from_secs(60))
                    .acquire()
                    .await
                    .unwrap();
                let v: u64 = std::fs::read_to_string(&counter)
                    .unwrap_or_default()
                    .trim()
                    .parse()
                    .unwrap_or(0);
                common::section_pause(&mut rng).await;
                std::fs::write(&counter, format!("{}\n", v + 1)).unwrap();
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new()
                    .append(true)
                    .create(true)
                    .open(&log)
                    .unwrap();
                writeln!(f, "{}", g.fencing_token()).unwrap();
                drop(f);
                g.release().await.unwrap();
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    child_say("done");
}

/// A2 (small): 4 processes × 4 tasks increment a file counter under the lock on the private
/// Redis; the count is exact and the tokens, logged in grant order, strictly increase.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_process_exclusion_file_counter_exact_and_tokens_increase() {
    const PROCS: usize = 4;
    const TASKS: usize = 4;
    const ITERS: usize = 20;
    let server = tokio::task::spawn_blocking(RedisProc::start).await.unwrap();
    let dir = TempDir::new("xp");
    let counter = dir.path().join("counter");
    let log = dir.path().join("tokens");
    let envs = [
        ("DLOCK_URL", server.url()),
        ("DLOCK_COUNTER", counter.display().to_string()),
        ("DLOCK_LOG", log.display().to_string()),
        ("DLOCK_TASKS", TASKS.to_string()),
        ("DLOCK_ITERS", ITERS.to_string()),
    ];
    let started = Instant::now();
    let mut children: Vec<_> = (0..PROCS)
        .map(|_| spawn_self(CHILD_ENTRY, "increment", &envs))
        .collect();
    tokio::task::block_in_place(|| {
        for c in &children {
            assert_eq!(c.expect_line(Duration::from_secs(30)), "ready");
        }
        for c in &mut children {
            assert_eq!(c.expect_line(Duration::from_secs(60)), "done");
            c.wait_success(Duration::from_secs(10));
        }
    });
    let total = (PROCS * TASKS * ITERS) as u64;
    let got: u64 = std::fs::read_to_string(&counter)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(got, total, "lost updates across processes");
    let tokens: Vec<u64> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(tokens.len() as u64, total);
    for w in tokens.windows(2) {
        assert!(w[1] > w[0], "tokens out of order across processes: {w:?}");
    }
    assert!(started.elapsed() < Duration::from_secs(60));
}

/// B1: a holder process killed with SIGKILL (ttl 1 s, watchdog on) leaves its lock to expire: a
/// waiter gets it after the remaining lease (PTTL at the kill), not before, with a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_holder_process_lock_frees_after_its_ttl_not_before() {
    let env = Env::redis().await;
    let server = env.server();
    for round in 0..2 {
        let mut child = spawn_self(CHILD_ENTRY, "hold", &[("DLOCK_URL", server.url())]);
        let line = tokio::task::block_in_place(|| child.expect_line(Duration::from_secs(30)));
        let child_token: u64 = line
            .strip_prefix("acquired ")
            .unwrap_or_else(|| panic!("unexpected child line {line:?}"))
            .parse()
            .unwrap();
        // Let the watchdog renew a few times, so the lease at the kill comes from a renewal.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let e = env.lock("crash").acquire().await.unwrap_err();
        assert!(e.is_contended(), "held by the child: {e:?}");

        child.kill();
        let killed = Instant::now();
        let mut admin = server.admin_async().await;
        let pttl: i64 = redis::cmd("PTTL")
            .arg(dlock::backend::redis_keys("crash").lock)
            .query_async(&mut admin)
            .await
            .unwrap();
        assert!(
            pttl > 300,
            "round {round}: lease at the kill was only {pttl} ms"
        );
        let pttl = Duration::from_millis(pttl as u64);

        let g = env
            .lock("crash")
            .wait(Duration::from_secs(10))
            .acquire()
            .await
            .expect("waiter gets the dead holder's lock");
        let at = killed.elapsed();
        assert!(
            at + Duration::from_millis(20) >= pttl,
            "round {round}: waiter got the lock {at:?} after the kill, lease left was {pttl:?}"
        );
        assert!(
            at < pttl + Duration::from_millis(500),
            "round {round}: waiter got it only {at:?} after the kill (lease left {pttl:?})"
        );
        assert!(g.fencing_token() > child_token);
        g.release().await.unwrap();
    }
}

/// C1: the server is killed (no persistence) and restarted on the same port. During the
/// downtime calls fail with `LockError::Backend` (no panic) and the holder's lease is lost by its
/// deadline; after the restart calls succeed again without re-initialising, a waiter started
/// before the crash gets its lock, and tokens keep increasing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_mid_run_backend_errors_then_recovery_without_reinit() {
    let mut env = Env::redis().await;
    let b = env.backend();
    let ttl = Duration::from_secs(1);
    let holder = env.lock("restart").ttl(ttl).acquire().await.unwrap();
    let token_before = holder.fencing_token();
    let lost = holder.lost();
    let waiter = {
        let l = env.lock("restart").ttl(ttl).wait(Duration::from_secs(20));
        tokio::spawn(async move { l.acquire().await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;

    // When the lost signal fires, recorded as it happens: the calls below may take a while
    // against a dead server, and the bound is about the signal, not about them.
    let lost_at = {
        let token = holder.lost_token();
        tokio::spawn(async move {
            token.cancelled().await;
            Instant::now()
        })
    };
    let deadline = Instant::now() + holder.remaining();
    tokio::task::block_in_place(|| env.server_mut().kill());
    for name in ["restart", "other"] {
        let e = Lock::new(name)
            .with_backend(b.clone())
            .acquire()
            .await
            .unwrap_err();
        assert!(
            e.is_backend(),
            "{name}: expected a backend error, got {e:?}"
        );
        assert_eq!(e.key(), Some(name));
    }
    let e = holder.extend(ttl).await.unwrap_err();
    assert!(e.is_backend() || e.is_lost(), "extend while down: {e:?}");
    let reason = tokio::time::timeout(ttl + Duration::from_millis(700), lost)
        .await
        .expect("holder's lost() did not fire while the server was down");
    assert_eq!(reason, LostReason::Deadline);
    let fired = lost_at.await.unwrap();
    assert!(
        fired <= deadline + Duration::from_millis(500),
        "lost() fired {:?} after the holder's deadline",
        fired.saturating_duration_since(deadline)
    );
    assert!(
        !waiter.is_finished(),
        "waiter returned while the server was down"
    );

    tokio::task::block_in_place(|| env.server_mut().restart());
    let restarted = Instant::now();
    let g = loop {
        match Lock::new("other").with_backend(b.clone()).acquire().await {
            Ok(g) => break g,
            Err(e) if restarted.elapsed() < Duration::from_secs(5) => {
                assert!(e.is_backend(), "{e:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("no recovery 5 s after the restart: {e}"),
        }
    };
    g.release().await.unwrap();
    let wg = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("waiter did not wake after the restart")
        .unwrap()
        .expect("waiter acquires after the restart");
    assert!(
        wg.fencing_token() > token_before,
        "token after restart {} <= before {token_before}",
        wg.fencing_token()
    );
    wg.release().await.unwrap();
    // The stale holder knows it lost the lease: its release says so at once.
    let e = holder.release().await.unwrap_err();
    assert!(matches!(e, LockError::Lost { .. }), "{e:?}");
}

/// C1/R3: without persistence the fence key is lost with the restart; the token after the
/// restart is still larger than before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_after_restart_without_persistence_is_larger() {
    let mut env = Env::redis().await;
    let mut before = 0;
    for _ in 0..5 {
        let g = env.lock("fence").acquire().await.unwrap();
        before = before.max(g.fencing_token());
        g.release().await.unwrap();
    }
    tokio::task::block_in_place(|| env.server_mut().restart());
    let mut admin = env.server().admin_async().await;
    let n: i64 = redis::cmd("DBSIZE").query_async(&mut admin).await.unwrap();
    assert_eq!(n, 0, "the restart kept data; this test needs it lost");
    let started = Instant::now();
    let g = loop {
        match env.lock("fence").acquire().await {
            Ok(g) => break g,
            Err(e) if e.is_backend() && started.elapsed() < Duration::from_secs(5) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert!(
        g.fencing_token() > before,
        "token after the restart {} <= before {before}",
        g.fencing_token()
    );
    g.release().await.unwrap();
}

/// A server whose script cache was emptied (`SCRIPT FLUSH`; a restart does the same) answers
/// `NOSCRIPT` to the backend's `EVALSHA`s: each call loads its script and is sent again, so
/// acquire, extend and release go on working with no error reaching the caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_load_their_script_again_after_the_cache_is_flushed() {
    let env = Env::redis().await;
    let mut admin = env.server().admin_async().await;
    let flush = |mut a: redis::aio::MultiplexedConnection| async move {
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut a)
            .await
            .unwrap();
        a
    };
    let loaded = |mut a: redis::aio::MultiplexedConnection| async move {
        let shas = [
            include_str!("../dlock-runtime/src/scripts/acquire.lua"),
            include_str!("../dlock-runtime/src/scripts/release.lua"),
            include_str!("../dlock-runtime/src/scripts/extend.lua"),
        ]
        .map(|code| redis::Script::new(code).get_hash().to_string());
        let r: Vec<bool> = redis::cmd("SCRIPT")
            .arg("EXISTS")
            .arg(&shas[..])
            .query_async(&mut a)
            .await
            .unwrap();
        (a, r)
    };
    let g = env.lock("noscript").acquire().await.unwrap();
    admin = flush(admin).await;
    g.extend(Duration::from_secs(20)).await.unwrap();
    admin = flush(admin).await;
    g.release().await.unwrap();
    admin = flush(admin).await;
    let (admin, before) = loaded(admin).await;
    assert_eq!(
        before,
        vec![false, false, false],
        "the flush did not empty the cache"
    );
    let g = env.lock("noscript").acquire().await.unwrap();
    g.extend(Duration::from_secs(20)).await.unwrap();
    g.release().await.unwrap();
    let (_, after) = loaded(admin).await;
    assert_eq!(after, vec![true, true, true], "each call loads its script");
    let other = env.lock("noscript").acquire().await.unwrap();
    assert!(other.fencing_token() > 0);
    other.release().await.unwrap();
}

/// A fence value ahead of the server clock (a server whose clock stepped back, or tokens minted
/// faster than one per µs) still yields strictly increasing tokens: `last + 1`, not TIME.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_follows_the_fence_when_it_is_ahead_of_the_server_clock() {
    let env = Env::redis().await;
    let keys = dlock::backend::redis_keys("ahead");
    let ahead: u64 = 9_000_000_000_000_000; // far beyond TIME in µs
    let mut admin = env.server().admin_async().await;
    let _: () = redis::cmd("SET")
        .arg(&keys.fence)
        .arg(ahead)
        .query_async(&mut admin)
        .await
        .unwrap();
    let g = env.lock("ahead").acquire().await.unwrap();
    assert_eq!(g.fencing_token(), ahead + 1);
    g.release().await.unwrap();
    let g = env.lock("ahead").acquire().await.unwrap();
    assert_eq!(g.fencing_token(), ahead + 2);
    let fence: u64 = redis::cmd("GET")
        .arg(&keys.fence)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(fence, ahead + 2);
    g.release().await.unwrap();
}

/// C3: `CLIENT PAUSE 2500 ALL` with a 1 s ttl: the holder's guard becomes lost by its own
/// deadline, without waiting for Redis; the waiter wins only after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_pause_longer_than_ttl_makes_the_guard_lost_by_its_own_deadline() {
    let env = Env::redis().await;
    let ttl = Duration::from_secs(1);
    let a = env.lock("paused").ttl(ttl).acquire().await.unwrap();
    let acquired = Instant::now();
    let lost = a.lost();
    let other = env.another_backend().await;
    let waiter = tokio::spawn(async move {
        let g = Lock::new("paused")
            .with_backend(other)
            .ttl(Duration::from_secs(5))
            .wait(Duration::from_secs(10))
            .acquire()
            .await;
        (Instant::now(), g)
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut admin = env.server().admin_async().await;
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(2500)
        .arg("ALL")
        .query_async(&mut admin)
        .await
        .unwrap();
    let paused = Instant::now();
    let reason = tokio::time::timeout(ttl + Duration::from_millis(500), lost)
        .await
        .expect("lost() did not fire by the holder's deadline during the pause");
    let lost_at = Instant::now();
    assert_eq!(reason, LostReason::Deadline);
    assert!(
        lost_at.duration_since(acquired) <= ttl + Duration::from_millis(300),
        "lost {:?} after the acquire",
        lost_at.duration_since(acquired)
    );
    assert!(
        lost_at.duration_since(paused) < Duration::from_millis(2000),
        "lost() waited for the server"
    );
    assert!(!a.is_valid());
    let (b_at, g) = waiter.await.unwrap();
    let g = g.expect("waiter gets the lock after the pause");
    assert!(
        b_at > lost_at,
        "B was granted before A knew it had lost the lease"
    );
    assert!(g.fencing_token() > a.fencing_token());
    let e = a.release().await.unwrap_err();
    assert!(matches!(e, LockError::Lost { .. }), "{e:?}");
    g.release().await.unwrap();
}

/// C5-like: the server process is stopped (SIGSTOP) for longer than the ttl: the holder's guard
/// is lost by its deadline, calls resume working after SIGCONT without re-initialising.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstopped_server_guard_lost_by_deadline_and_recovery_after_sigcont() {
    let mut env = Env::redis().await;
    let ttl = Duration::from_secs(1);
    let a = env.lock("stopped").ttl(ttl).acquire().await.unwrap();
    let acquired = Instant::now();
    let lost = a.lost();
    env.server_mut().pause();
    let reason = tokio::time::timeout(ttl + Duration::from_millis(500), lost).await;
    let lost_after = acquired.elapsed();
    env.server_mut().resume();
    assert_eq!(
        reason.expect("lost() did not fire while the server was stopped"),
        LostReason::Deadline
    );
    assert!(
        lost_after <= ttl + Duration::from_millis(300),
        "{lost_after:?}"
    );
    let started = Instant::now();
    let g = loop {
        match env
            .lock("stopped2")
            .wait(Duration::from_secs(1))
            .acquire()
            .await
        {
            Ok(g) => break g,
            Err(e) if started.elapsed() < Duration::from_secs(5) => {
                assert!(e.is_backend() || e.is_contended(), "{e:?}");
            }
            Err(e) => panic!("no recovery after SIGCONT: {e}"),
        }
    };
    g.release().await.unwrap();
    drop(a);
}
