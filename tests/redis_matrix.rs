//! Gaps of the RELIABILITY.md §7 matrix not covered by the other suites, each against its own
//! private redis-server on a free loopback port:
//!
//! * B3: a holder process SIGSTOPped for 400 ms (ttl 1 s) ten times: no false `lost()`, and the
//!   lease is renewed right after each resume.
//! * B4: executor starvation: a holder blocks its current-thread runtime for 2 × ttl; on return
//!   it is lost (at once or within a bound), a contender got the lock meanwhile, and the
//!   holder's release gives `Lost` without touching the contender's hold.
//! * C6: indeterminate acquire: `CLIENT PAUSE 1000` with a 200 ms response timeout; the outcome
//!   is a guard or a typed error, hold counts never exceed 1, and nothing of ours is left after
//!   the pause plus the ttl.
//! * C7: `CLIENT KILL TYPE pubsub` and `TYPE normal` every 200 ms for 5 s while 16 waiters cycle
//!   on one key: every acquire ends by its deadline, the non-atomic counter is exact.
//! * C8: an evicting `maxmemory-policy` gives a `warn` at connect; an evicted lock fires `lost()`
//!   within ttl/3 plus a margin; with `noeviction` an out-of-memory acquire is a typed
//!   `LockError::Backend`.
//! * G7b: 100 waiters (wait 1 s) on a lock that is never released all get `TimedOut` at 1 s.
//! * G7c: 1,000 waiters in one process share ONE pub/sub connection, and the hand-off chain costs
//!   about one acquire attempt per acquisition (counted in the backend and in `INFO
//!   commandstats`), not one per waiter per release.
//!
//! Child processes (B3) re-execute this test binary (`child_process_entry` in child mode).

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{RedisProc, Rng, TempDir, capture, child_say, run_child, spawn_self};
use dlock::backend::{Acquired, BoxFuture, Extended, Released, Watch};
use dlock::{Backend, Lock, LockError, LostReason, RedisBackend};

const CHILD_ENTRY: &str = "child_process_entry";

async fn start_server() -> RedisProc {
    tokio::task::spawn_blocking(RedisProc::start)
        .await
        .expect("start redis-server")
}

async fn connect(server: &RedisProc) -> Arc<RedisBackend> {
    Arc::new(
        RedisBackend::connect(&server.url())
            .await
            .expect("connect to the private redis-server"),
    )
}

async fn query<T: redis::FromRedisValue>(
    con: &mut redis::aio::MultiplexedConnection,
    cmd: &mut redis::Cmd,
) -> T {
    cmd.query_async(con).await.expect("admin command")
}

/// Owner -> hold count of a lock hash (fields starting with `:` are bookkeeping).
async fn holds(con: &mut redis::aio::MultiplexedConnection, name: &str) -> BTreeMap<String, i64> {
    let all: BTreeMap<String, String> = query(
        con,
        redis::cmd("HGETALL").arg(dlock::backend::redis_keys(name).lock),
    )
    .await;
    all.into_iter()
        .filter(|(k, _)| !k.starts_with(':'))
        .map(|(k, v)| (k, v.parse().unwrap_or(i64::MAX)))
        .collect()
}

fn script_calls(server: &RedisProc) -> u64 {
    server
        .commandstats()
        .iter()
        .filter(|(k, _)| k.starts_with("eval"))
        .map(|(_, v)| v)
        .sum()
}

// ---------------------------------------------------------------------------------------------
// Tracing capture
// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// Child processes
// ---------------------------------------------------------------------------------------------

/// Not a test of its own: the entry point of child processes started by the tests below.
#[test]
#[ignore = "child-process entry point; the B3 test runs it in its child"]
fn child_process_entry() {
    run_child(|mode, backend| async move {
        match mode.as_str() {
            "hold-until-file" => child_hold_until_file(backend).await,
            other => panic!("unknown child mode {other}"),
        }
    });
}

/// Takes `b3` (ttl 1 s, watchdog on), says `acquired <owner>`, and holds it until the file
/// `DLOCK_STOP_FILE` appears (`held`) or the lease is lost (`lost <reason>`); then releases and
/// says how that went.
async fn child_hold_until_file(backend: Arc<dyn Backend>) {
    let stop = std::path::PathBuf::from(std::env::var("DLOCK_STOP_FILE").unwrap());
    let g = Lock::new("b3")
        .with_backend(backend)
        .ttl(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap();
    child_say(format!("acquired {}", g.owner()));
    let lost = g.lost();
    let appeared = async {
        while !stop.exists() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::select! {
        r = lost => child_say(format!("lost {r:?}")),
        _ = appeared => child_say("held"),
    }
    match g.release().await {
        Ok(()) => child_say("released ok"),
        Err(e) => child_say(format!("released err {e}")),
    }
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) on a child this test spawned and has not reaped.
    let r = unsafe { libc::kill(pid as libc::pid_t, sig) };
    assert_eq!(r, 0, "kill({pid}, {sig}) failed");
}

/// B3: a holder process SIGSTOPped for ttl × 0.4 (400 ms of a 1 s lease), ten times, never
/// reports a lost lease, and each resume is followed by a renewal (PTTL back near the ttl).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b3_holder_sigstopped_for_less_than_half_the_ttl_is_never_falsely_lost() {
    const CYCLES: usize = 10;
    let server = start_server().await;
    let dir = TempDir::new("b3");
    let stop_file = dir.path().join("stop");
    let mut child = spawn_self(
        CHILD_ENTRY,
        "hold-until-file",
        &[
            ("DLOCK_URL", server.url()),
            ("DLOCK_STOP_FILE", stop_file.display().to_string()),
        ],
    );
    let line = tokio::task::block_in_place(|| child.expect_line(Duration::from_secs(20)));
    let owner = line
        .strip_prefix("acquired ")
        .unwrap_or_else(|| panic!("child said {line:?}"))
        .to_string();
    let mut con = server.admin_async().await;
    let key = dlock::backend::redis_keys("b3").lock;
    let mut renewed_after = Vec::new();
    for cycle in 0..CYCLES {
        tokio::time::sleep(Duration::from_millis(400)).await;
        signal(child.pid(), libc::SIGSTOP);
        let stopped = Instant::now();
        tokio::time::sleep(Duration::from_millis(400)).await;
        let pttl_stopped: i64 = query(&mut con, redis::cmd("PTTL").arg(&key)).await;
        signal(child.pid(), libc::SIGCONT);
        let resumed = Instant::now();
        let stop_len = resumed - stopped;
        assert!(
            pttl_stopped > 0,
            "cycle {cycle}: the lease ran out on the server during a 400 ms stop (PTTL {pttl_stopped})"
        );
        // Renewal right after resuming: the PTTL climbs back near the ttl.
        let mut back = None;
        while resumed.elapsed() < Duration::from_millis(800) {
            let pttl: i64 = query(&mut con, redis::cmd("PTTL").arg(&key)).await;
            if pttl >= 750 {
                back = Some(resumed.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let back = back.unwrap_or_else(|| {
            let said = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                child.expect_line(Duration::from_millis(500))
            }))
            .ok();
            panic!(
                "cycle {cycle}: no renewal within 800 ms of SIGCONT (PTTL stayed < 750) after a stop of {stop_len:?}; child said {said:?}"
            )
        });
        renewed_after.push((stop_len, back));
        let h = holds(&mut con, "b3").await;
        assert_eq!(
            h,
            BTreeMap::from([(owner.clone(), 1)]),
            "cycle {cycle}: the hold changed hands"
        );
    }
    std::fs::write(&stop_file, b"stop").unwrap();
    let (end, released) = tokio::task::block_in_place(|| {
        (
            child.expect_line(Duration::from_secs(10)),
            child.expect_line(Duration::from_secs(10)),
        )
    });
    assert_eq!(
        end, "held",
        "false lost event after SIGSTOPs shorter than ttl/2"
    );
    assert_eq!(released, "released ok");
    tokio::task::block_in_place(|| child.wait_success(Duration::from_secs(10)));
    eprintln!("b3: (stop, renewal seen after SIGCONT) per cycle: {renewed_after:?}");
}

// ---------------------------------------------------------------------------------------------
// B4: executor starvation
// ---------------------------------------------------------------------------------------------

/// B4: the holder's body blocks its current-thread runtime with `std::thread::sleep(2 × ttl)`, so
/// its watchdog cannot run. Meanwhile a contender on another runtime takes the lock (not before
/// the holder's lease could have ended); when the holder's body returns, its guard is already
/// invalid and `lost()` completes within 200 ms; its release gives `Lost` and leaves the
/// contender's hold intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b4_blocked_executor_holder_is_lost_and_its_release_is_not_owner() {
    let ttl = Duration::from_secs(1);
    let server = start_server().await;
    let backend = connect(&server).await;
    let (acq_tx, acq_rx) = std::sync::mpsc::channel::<Instant>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let holder_backend: Arc<dyn Backend> = backend.clone();
    let holder = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let sent = Instant::now();
            let g = Lock::new("b4")
                .with_backend(holder_backend)
                .ttl(ttl)
                .acquire()
                .await
                .expect("holder acquires");
            acq_tx.send(sent).unwrap();
            // The hung body: blocks the only thread of this runtime.
            std::thread::sleep(2 * ttl);
            let woke = Instant::now();
            let valid_on_return = g.is_valid();
            let lost = tokio::time::timeout(Duration::from_millis(200), g.lost()).await;
            let lost_after = woke.elapsed();
            // Release only once the contender holds the lock.
            go_rx.recv_timeout(Duration::from_secs(10)).unwrap();
            let release = g.release().await;
            (woke, valid_on_return, lost, lost_after, release)
        })
    });
    let holder_sent = tokio::task::block_in_place(|| acq_rx.recv_timeout(Duration::from_secs(10)))
        .expect("holder acquired");
    let contender = Lock::new("b4")
        .with_backend(backend.clone())
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .expect("contender gets the lock while the holder's runtime is blocked");
    let got_at = Instant::now();
    assert!(
        got_at >= holder_sent + ttl,
        "contender got the lock {:?} after the holder's acquire was sent, before its {ttl:?} lease could end",
        got_at - holder_sent
    );
    go_tx.send(()).unwrap();
    let (woke, valid_on_return, lost, lost_after, release) =
        tokio::task::block_in_place(|| holder.join()).expect("holder thread panicked");
    assert!(
        got_at < woke,
        "the contender got the lock only after the holder's runtime woke up"
    );
    assert!(
        !valid_on_return,
        "the guard still claims to be valid after its deadline"
    );
    let reason = lost.unwrap_or_else(|_| {
        panic!("lost() did not complete within 200 ms of the blocked body's return")
    });
    assert!(
        matches!(reason, LostReason::Deadline | LostReason::NotOwner),
        "{reason:?}"
    );
    assert!(lost_after < Duration::from_millis(200), "{lost_after:?}");
    assert!(
        matches!(release, Err(LockError::Lost { .. })),
        "the late holder's release: {release:?}"
    );
    // The owner-checked give-back runs in the background: let it reach the server.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut con = server.admin_async().await;
    assert_eq!(
        holds(&mut con, "b4").await,
        BTreeMap::from([(contender.owner().to_string(), 1)]),
        "the late holder's release touched the contender's hold"
    );
    contender.release().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// C6: indeterminate acquire
// ---------------------------------------------------------------------------------------------

/// C6 rounds: `CLIENT PAUSE 1000` lands just before (or just after) an acquire whose client has
/// a 200 ms response timeout. Asserts per round that the outcome is a guard or a typed error and
/// that after the pause plus the ttl no key of the lock is left; returns the outcomes and the
/// rounds where a hold count above 1 was seen (on the server once the pause ended, or on the
/// guard).
async fn c6_rounds(waits: &[Duration]) -> (Vec<String>, Vec<String>) {
    let ttl = Duration::from_millis(300);
    let pause = Duration::from_millis(1000);
    let server = start_server().await;
    let backend: Arc<dyn Backend> = Arc::new(
        RedisBackend::builder(server.url())
            .response_timeout(Duration::from_millis(200))
            .connect()
            .await
            .unwrap(),
    );
    let mut con = server.admin_async().await;
    let mut rng = Rng::new(6);
    let mut outcomes = Vec::new();
    let mut inflated = Vec::new();
    for (round, &wait) in waits.iter().enumerate() {
        let name = format!("c6-{round}");
        let lock = Lock::new(name.clone())
            .with_backend(backend.clone())
            .ttl(ttl)
            .wait(wait);
        // Mostly the pause lands first (the acquire is then indeterminate: its reply times out
        // while the server still holds the command); every third round the acquire is sent
        // first and the pause follows within a few milliseconds.
        let jitter = Duration::from_micros(rng.below(3_000));
        let pause_first = round % 3 != 2;
        let mut pause_cmd = redis::cmd("CLIENT");
        pause_cmd.arg("PAUSE").arg(pause.as_millis() as u64);
        let paused_at;
        let acquire;
        if pause_first {
            paused_at = Instant::now();
            let _: () = query(&mut con, &mut pause_cmd).await;
            tokio::time::sleep(jitter).await;
            acquire = tokio::spawn(async move { lock.acquire().await });
        } else {
            acquire = tokio::spawn(async move { lock.acquire().await });
            tokio::time::sleep(jitter).await;
            paused_at = Instant::now();
            let _: () = query(&mut con, &mut pause_cmd).await;
        }
        let r = tokio::time::timeout(wait + Duration::from_secs(5), acquire)
            .await
            .unwrap_or_else(|_| panic!("round {round}: acquire hangs"))
            .expect("acquire task panicked");
        let outcome = match &r {
            Ok(g) => format!("ok(count {})", g.hold_count()),
            Err(e) => {
                assert!(
                    e.is_backend() || matches!(e, LockError::TimedOut { .. }),
                    "round {round}: unexpected error kind {e:?}"
                );
                format!(
                    "err({})",
                    if e.is_backend() {
                        "backend"
                    } else {
                        "timed out"
                    }
                )
            }
        };
        // Once the pause is over, every queued try has run: no owner may hold more than one.
        let unpaused = paused_at + pause + Duration::from_millis(50);
        tokio::time::sleep_until(unpaused.into()).await;
        let h = holds(&mut con, &name).await;
        let guard_count = r.as_ref().map(|g| g.hold_count()).unwrap_or(0);
        if h.values().any(|&c| c > 1) || guard_count > 1 {
            inflated.push(format!(
                "round {round} (wait {wait:?}): server {h:?}, guard count {guard_count}"
            ));
        }
        if let Ok(g) = r {
            let _ = g.release().await;
        }
        // After the pause plus the ttl nothing of this lock may be left.
        tokio::time::sleep_until((paused_at + pause + ttl + Duration::from_millis(300)).into())
            .await;
        let left: i64 = query(
            &mut con,
            redis::cmd("EXISTS").arg(dlock::backend::redis_keys(&name).lock),
        )
        .await;
        assert_eq!(
            left, 0,
            "round {round}: the lock key outlived pause + ttl ({outcome})"
        );
        outcomes.push(outcome);
    }
    (outcomes, inflated)
}

/// C6: ten rounds, alternating `wait = 0` (one try) and `wait = 2 s` (tries repeated while the
/// server is paused). Every outcome is a guard or a typed error and nothing is left after the
/// pause plus the ttl; for single tries no hold count ever exceeds 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c6_acquire_during_client_pause_is_ok_or_typed_and_leaves_nothing() {
    let waits: Vec<Duration> = (0..10)
        .map(|r| {
            if r % 2 == 0 {
                Duration::ZERO
            } else {
                Duration::from_secs(2)
            }
        })
        .collect();
    let (outcomes, inflated) = c6_rounds(&waits).await;
    eprintln!("c6 outcomes: {outcomes:?}; counts above 1: {inflated:?}");
    let single_try: Vec<&String> = inflated.iter().filter(|s| s.contains("wait 0ns")).collect();
    assert!(
        single_try.is_empty(),
        "a single indeterminate try left a hold count above 1: {single_try:?}"
    );
    assert!(
        outcomes.iter().any(|o| o.starts_with("err")),
        "no acquire was ever caught by the pause: {outcomes:?}"
    );
}

/// C6, waiting variant (RELIABILITY.md: "a reentrant retry does not inflate the count"): a
/// waiting acquire whose tries time out during the pause retries; the queued tries all run when
/// the pause ends. Each failed try is released under its own owner id and later tries use a new
/// one, so the grant that comes back has `hold_count() == 1` and the server hash says the same.
/// (Before the fix the retries reused the owner id and the count came back as 2 to 4.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c6_waiting_acquire_retries_do_not_inflate_the_hold_count() {
    let waits = [Duration::from_secs(2); 3];
    let (outcomes, inflated) = c6_rounds(&waits).await;
    assert!(
        inflated.is_empty(),
        "hold counts above 1 after retried indeterminate tries: {inflated:?} (outcomes {outcomes:?})"
    );
}

// ---------------------------------------------------------------------------------------------
// C7: connection kills while waiters cycle
// ---------------------------------------------------------------------------------------------

/// C7: an admin thread runs `CLIENT KILL TYPE pubsub` and `CLIENT KILL TYPE normal` every 200 ms
/// for 5 s while 16 waiters (over two backends) cycle on one key: acquire with wait 5 s, a short
/// non-atomic read-modify-write, release. Every acquire ends (granted, timed out or a typed
/// backend error) by its deadline plus 1.5 s; none hangs; no panic; never two inside the section;
/// the counter equals the number of grants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c7_client_kill_storm_waiters_end_by_deadline_and_exclusion_holds() {
    const WAITERS: usize = 16;
    let run = Duration::from_secs(5);
    let wait = Duration::from_secs(5);
    let margin = Duration::from_millis(1500);
    let server = start_server().await;
    let clients: [Arc<dyn Backend>; 2] = [connect(&server).await, connect(&server).await];

    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let killer = {
        let mut admin = server.admin();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut pubsub, mut normal) = (0i64, 0i64);
            while !stop.load(Ordering::Relaxed) {
                pubsub += redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg("pubsub")
                    .query::<i64>(&mut admin)
                    .expect("CLIENT KILL TYPE pubsub");
                normal += redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg("normal")
                    .query::<i64>(&mut admin)
                    .expect("CLIENT KILL TYPE normal");
                std::thread::sleep(Duration::from_millis(200));
            }
            (pubsub, normal)
        })
    };

    let counter = Arc::new(AtomicU64::new(0));
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..WAITERS {
        let backend = clients[i % 2].clone();
        let (counter, inside, overlaps) = (counter.clone(), inside.clone(), overlaps.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(700 + i as u64);
            let (mut grants, mut timeouts, mut errors, mut late, mut release_errs) =
                (0u64, 0u64, 0u64, Vec::new(), 0u64);
            let lock = Lock::new("c7")
                .with_backend(backend)
                .ttl(Duration::from_secs(1))
                .wait(wait);
            while started.elapsed() < run {
                let t0 = Instant::now();
                let r = tokio::time::timeout(wait + Duration::from_secs(5), lock.acquire()).await;
                let took = t0.elapsed();
                let Ok(r) = r else {
                    panic!("waiter {i}: acquire stuck for {took:?} (wait {wait:?})");
                };
                if took > wait + margin {
                    late.push(took);
                }
                match r {
                    Ok(g) => {
                        grants += 1;
                        if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                            overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                        let v = counter.load(Ordering::SeqCst);
                        common::section_pause(&mut rng).await;
                        counter.store(v + 1, Ordering::SeqCst);
                        inside.fetch_sub(1, Ordering::SeqCst);
                        match g.release().await {
                            Ok(()) => {}
                            Err(e) if e.is_backend() => release_errs += 1,
                            Err(e) => panic!("waiter {i}: release after a ms-long hold: {e:?}"),
                        }
                    }
                    Err(LockError::TimedOut { waited, .. }) => {
                        assert!(
                            waited >= wait,
                            "waiter {i}: timed out early, after {waited:?}"
                        );
                        timeouts += 1;
                    }
                    Err(e) if e.is_backend() => errors += 1,
                    Err(e) => panic!("waiter {i}: untyped outcome {e:?}"),
                }
            }
            (grants, timeouts, errors, late, release_errs)
        }));
    }
    let (mut grants, mut timeouts, mut errors, mut release_errs) = (0, 0, 0, 0);
    let mut late = Vec::new();
    for t in tasks {
        let (g, t, e, l, r) = tokio::time::timeout(run + wait + Duration::from_secs(10), t)
            .await
            .expect("a waiter task never finished")
            .expect("a waiter task panicked");
        grants += g;
        timeouts += t;
        errors += e;
        release_errs += r;
        late.extend(l);
    }
    stop.store(true, Ordering::Relaxed);
    let (pubsub_kills, normal_kills) =
        tokio::task::block_in_place(|| killer.join()).expect("killer thread");
    eprintln!(
        "c7: {grants} grants, {timeouts} timed out, {errors} backend errors, {release_errs} failed releases; killed {pubsub_kills} pubsub and {normal_kills} normal connections"
    );
    assert!(
        pubsub_kills > 0 && normal_kills > 0,
        "the nemesis killed nothing (pubsub {pubsub_kills}, normal {normal_kills})"
    );
    assert!(
        late.is_empty(),
        "acquires that ended past deadline + {margin:?}: {late:?}"
    );
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "two holders inside the section"
    );
    assert_eq!(
        counter.load(Ordering::SeqCst),
        grants,
        "lost updates under the lock"
    );
    assert!(
        grants >= 20,
        "only {grants} grants in {run:?}: waiters starve under kills"
    );
}

// ---------------------------------------------------------------------------------------------
// C8: eviction
// ---------------------------------------------------------------------------------------------

/// C8: `allkeys-lru` set before connecting gives one `warn` about eviction (and `noeviction`
/// none); then, with a small `maxmemory`, junk writes evict the held lock and the holder's
/// `lost()` fires within ttl/3 + 400 ms of the eviction being seen.
#[test]
fn c8_evicting_policy_warns_and_an_evicted_lock_is_lost() {
    let server = RedisProc::start();
    let (events, _guard) = capture();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut con = server.admin_async().await;
        // Control: the default policy (noeviction) gives no such warning.
        let _quiet = connect(&server).await;
        assert!(
            events.warns_containing("evict").is_empty(),
            "warned under noeviction: {:?}",
            events.warns_containing("evict")
        );
        let _: () = query(
            &mut con,
            redis::cmd("CONFIG")
                .arg("SET")
                .arg("maxmemory-policy")
                .arg("allkeys-lru"),
        )
        .await;
        let backend = connect(&server).await;
        let warns = events.warns_containing("evict");
        assert_eq!(warns.len(), 1, "expected one eviction warning: {warns:?}");
        assert!(warns[0].contains("allkeys-lru"), "{warns:?}");

        let ttl = Duration::from_secs(1);
        let g = Lock::new("c8")
            .with_backend(backend.clone())
            .ttl(ttl)
            .acquire()
            .await
            .unwrap();
        let info: String = query(&mut con, redis::cmd("INFO").arg("memory")).await;
        let used: u64 = info
            .lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("used_memory");
        let _: () = query(
            &mut con,
            redis::cmd("CONFIG")
                .arg("SET")
                .arg("maxmemory")
                .arg(used + 2 * 1024 * 1024),
        )
        .await;
        let lock_key = dlock::backend::redis_keys("c8").lock;
        let junk = vec![b'j'; 256 * 1024];
        let t0 = Instant::now();
        let mut writes = 0u64;
        let evicted_at = loop {
            let _: () = query(&mut con, redis::cmd("SET").arg(format!("junk:{writes}")).arg(&junk)).await;
            writes += 1;
            let n: i64 = query(&mut con, redis::cmd("EXISTS").arg(&lock_key)).await;
            if n == 0 {
                break Instant::now();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the lock key survived {writes} junk writes"
            );
        };
        let evictions: String = query(&mut con, redis::cmd("INFO").arg("stats")).await;
        assert!(
            evictions
                .lines()
                .any(|l| l.starts_with("evicted_keys:") && l.trim() != "evicted_keys:0"),
            "the lock key vanished without an eviction"
        );
        let bound = ttl / 3 + Duration::from_millis(400);
        let reason = tokio::time::timeout(bound, g.lost())
            .await
            .unwrap_or_else(|_| panic!("lost() did not fire within {bound:?} of the eviction"));
        eprintln!(
            "c8: evicted after {writes} junk writes; lost ({reason:?}) {:?} after the eviction was seen",
            evicted_at.elapsed()
        );
        assert_eq!(reason, LostReason::NotOwner);
        assert!(g.extend(ttl).await.is_err());
    });
}

/// C8: with `noeviction` and memory over `maxmemory`, an acquire is refused with a typed
/// `LockError::Backend` naming the out-of-memory condition, not a panic; freeing memory makes
/// the same backend work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c8_noeviction_out_of_memory_acquire_is_a_typed_backend_error() {
    let server = start_server().await;
    let backend = connect(&server).await;
    let mut con = server.admin_async().await;
    let _: () = query(
        &mut con,
        redis::cmd("SET")
            .arg("junk")
            .arg(vec![b'j'; 2 * 1024 * 1024]),
    )
    .await;
    let _: () = query(
        &mut con,
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg(1024 * 1024),
    )
    .await;
    for wait in [Duration::ZERO, Duration::from_millis(500)] {
        let e = tokio::time::timeout(
            Duration::from_secs(5),
            Lock::new("c8-oom")
                .with_backend(backend.clone())
                .wait(wait)
                .acquire(),
        )
        .await
        .expect("acquire hangs under OOM")
        .expect_err("acquire succeeded over maxmemory with noeviction");
        assert!(
            matches!(e, LockError::Backend { .. }),
            "wait {wait:?}: {e:?}"
        );
        assert!(
            e.to_string().contains("OOM"),
            "the error does not say OOM: {e}"
        );
    }
    let _: () = query(&mut con, redis::cmd("DEL").arg("junk")).await;
    let _: () = query(
        &mut con,
        redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(0),
    )
    .await;
    let g = Lock::new("c8-oom")
        .with_backend(backend)
        .acquire()
        .await
        .expect("works again once memory is freed");
    g.release().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// G7b, G7c: many waiters
// ---------------------------------------------------------------------------------------------

/// G7b: 100 waiters with wait = 1 s against a holder that never releases (watchdog on) all end
/// with `TimedOut`, none before 1 s and none later than 1.5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g7b_hundred_waiters_on_a_never_released_lock_all_time_out_at_their_deadline() {
    let server = start_server().await;
    let backend = connect(&server).await;
    let _holder = Lock::new("g7b")
        .with_backend(backend.clone())
        .ttl(Duration::from_secs(2))
        .acquire()
        .await
        .unwrap();
    let wait = Duration::from_secs(1);
    let mut tasks = Vec::new();
    for _ in 0..100 {
        let lock = Lock::new("g7b").with_backend(backend.clone()).wait(wait);
        tasks.push(tokio::spawn(async move {
            let t0 = Instant::now();
            let r = lock.acquire().await;
            (t0.elapsed(), r)
        }));
    }
    let mut took = Vec::new();
    for t in tasks {
        let (d, r) = tokio::time::timeout(Duration::from_secs(10), t)
            .await
            .expect("a waiter hangs")
            .unwrap();
        match r {
            Err(LockError::TimedOut { waited, .. }) => {
                assert!(waited >= wait, "reported waited {waited:?}");
            }
            other => panic!("expected TimedOut, got {other:?}"),
        }
        took.push(d);
    }
    let (min, max) = (took.iter().min().unwrap(), took.iter().max().unwrap());
    eprintln!("g7b: 100 timeouts between {min:?} and {max:?}");
    assert!(*min >= wait, "a waiter gave up early: {min:?}");
    assert!(
        *max <= wait + Duration::from_millis(500),
        "a waiter overstayed: {max:?}"
    );
}

/// Counts the calls that reach the wrapped backend.
#[derive(Debug)]
struct Counting {
    inner: Arc<RedisBackend>,
    tries: AtomicU64,
    releases: AtomicU64,
    extends: AtomicU64,
}

impl Backend for Counting {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        self.tries.fetch_add(1, Ordering::Relaxed);
        self.inner.try_acquire(name, owner, ttl)
    }

    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        self.releases.fetch_add(1, Ordering::Relaxed);
        self.inner.release(name, owner, keep_for, all)
    }

    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        self.extends.fetch_add(1, Ordering::Relaxed);
        self.inner.extend(name, owner, ttl)
    }

    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        self.inner.watch(name)
    }

    fn has_waiters(&self, name: &str) -> bool {
        self.inner.has_waiters(name)
    }
}

fn client_list(admin: &mut redis::Connection, args: &[&str]) -> Vec<String> {
    let s: String = redis::cmd("CLIENT")
        .arg("LIST")
        .arg(args)
        .query(admin)
        .expect("CLIENT LIST");
    s.lines().map(str::to_string).collect()
}

/// G7c: 1,000 waiters on one key in one process (wait 20 s, hold ~0). While they wait there is
/// ONE pub/sub connection (`CLIENT LIST TYPE pubsub`, and one client with subscriptions). The
/// hand-off chain after the holder's release costs about one acquire attempt per acquisition:
/// backend-level tries ≤ 1,000 + 20 and EVAL/EVALSHA calls ≤ 2 × 1,000 + 40 (an acquire and a
/// release each), where waking every waiter per release would be ~500,000.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g7c_thousand_waiters_share_one_pubsub_connection_and_retry_once_per_wakeup() {
    const N: u64 = 1_000;
    let server = start_server().await;
    let inner = connect(&server).await;
    let counting = Arc::new(Counting {
        inner: inner.clone(),
        tries: AtomicU64::new(0),
        releases: AtomicU64::new(0),
        extends: AtomicU64::new(0),
    });
    let backend: Arc<dyn Backend> = counting.clone();
    let holder = Lock::new("g7c")
        .with_backend(backend.clone())
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..N {
        let lock = Lock::new("g7c")
            .with_backend(backend.clone())
            .ttl(Duration::from_secs(30))
            .wait(Duration::from_secs(20));
        let (inside, overlaps) = (inside.clone(), overlaps.clone());
        tasks.push(tokio::spawn(async move {
            let g = lock.acquire().await?;
            if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                overlaps.fetch_add(1, Ordering::SeqCst);
            }
            inside.fetch_sub(1, Ordering::SeqCst);
            g.release().await
        }));
    }
    let queued = common::eventually(Duration::from_secs(15), || {
        let n = inner.waiter_count();
        async move { n as u64 == N }
    })
    .await;
    assert!(
        queued,
        "only {} of {N} waiters queued",
        inner.waiter_count()
    );

    let (pubsub, subscribed) = tokio::task::block_in_place(|| {
        let mut admin = server.admin();
        let pubsub = client_list(&mut admin, &["TYPE", "pubsub"]);
        let subscribed: Vec<String> = client_list(&mut admin, &[])
            .into_iter()
            .filter(|l| l.split(' ').any(|f| f.starts_with("sub=") && f != "sub=0"))
            .collect();
        (pubsub, subscribed)
    });
    assert_eq!(pubsub.len(), 1, "pub/sub connections: {pubsub:#?}");
    assert_eq!(
        subscribed.len(),
        1,
        "clients with subscriptions: {subscribed:#?}"
    );

    // Let the waiters' entry tries settle: every call the wrapper counted has run on the server
    // (which also counts the one EVALSHA that met NOSCRIPT) and nothing moved for 80 ms. Only the hand-off chain after this point is measured.
    let calls = |c: &Counting| {
        c.tries.load(Ordering::SeqCst)
            + c.releases.load(Ordering::SeqCst)
            + c.extends.load(Ordering::SeqCst)
    };
    let mut last = (u64::MAX, u64::MAX);
    let settled = common::eventually(Duration::from_secs(10), || {
        let now = (calls(&counting), script_calls(&server));
        let stable = now == last && now.1 >= now.0;
        last = now;
        async move {
            if !stable {
                tokio::time::sleep(Duration::from_millis(80)).await;
            }
            stable
        }
    })
    .await;
    assert!(
        settled,
        "entry tries never settled: (wrapper, server) = {last:?}"
    );
    let tries0 = counting.tries.load(Ordering::SeqCst);
    let releases0 = counting.releases.load(Ordering::SeqCst);
    let stats0 = tokio::task::block_in_place(|| server.commandstats());
    let evals0 = tokio::task::block_in_place(|| script_calls(&server));
    let t0 = Instant::now();
    holder.release().await.unwrap();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("a waiter never got the lock")
            .unwrap()
            .expect("every waiter acquires and releases");
    }
    let drain = t0.elapsed();
    let tries = counting.tries.load(Ordering::SeqCst) - tries0;
    let evals = tokio::task::block_in_place(|| script_calls(&server)) - evals0;
    let releases = counting.releases.load(Ordering::SeqCst) - releases0;
    let stats1 = tokio::task::block_in_place(|| server.commandstats());
    let delta: BTreeMap<&String, u64> = stats1
        .iter()
        .map(|(k, v)| (k, v - stats0.get(k).copied().unwrap_or(0)))
        .filter(|(_, d)| *d > 0)
        .collect();
    eprintln!("g7c: {releases} releases; command deltas {delta:?}");
    eprintln!(
        "g7c: {N} hand-offs in {drain:?}; {tries} acquire attempts, {evals} script calls, {} renewals",
        counting.extends.load(Ordering::SeqCst)
    );
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two holders at once");
    assert!(
        tries <= N + 20,
        "{tries} acquire attempts for {N} acquisitions"
    );
    assert!(
        evals <= 2 * N + 40,
        "{evals} script calls for {N} acquire+release pairs"
    );
}
