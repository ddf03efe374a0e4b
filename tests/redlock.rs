//! Redlock-only behaviour against 3 and 5 private redis-servers: quorum subsets, node kills and
//! restarts, a stopped or paused node, the restarted-node rule, and putting a hold back after a
//! node restart. The shared suites run on Redlock too (`on_redlock` in `lock_behaviour.rs` and
//! `wait_behaviour.rs`).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redlock::{connect_now, nodes_with_lock, start_nodes, urls, wait_uptime};
use common::{RedisProc, Rng, TempDir, child_mode, child_say, spawn_self};
use dlock::backend::Acquired;
use dlock::{Backend, Lock, LockError, RedisBackend, RedlockBackend};

async fn nodes(n: usize) -> Vec<RedisProc> {
    common::debug_events_in_test_output();
    tokio::task::spawn_blocking(move || start_nodes(n))
        .await
        .unwrap()
}

/// Every subset of `n` nodes, as bit masks.
fn subsets(n: usize) -> impl Iterator<Item = u32> {
    0..(1u32 << n)
}

async fn every_quorum_subset_is_busy_every_minority_is_not(n: usize) {
    let servers = nodes(n).await;
    let rl = connect_now(urls(&servers)).await;
    let singles: Vec<RedisBackend> = {
        let mut v = Vec::new();
        for s in &servers {
            v.push(RedisBackend::connect(&s.url()).await.unwrap());
        }
        v
    };
    let quorum = n / 2 + 1;
    let ttl = Duration::from_secs(30);
    for mask in subsets(n) {
        let name = format!("subset-{n}-{mask}");
        let locked: Vec<usize> = (0..n).filter(|i| mask & (1 << i) != 0).collect();
        for &i in &locked {
            let r = singles[i].try_acquire(&name, "foreign", ttl).await.unwrap();
            assert!(matches!(r, Acquired::Granted { .. }));
        }
        let r = rl.try_acquire(&name, "me", ttl).await.unwrap();
        if locked.len() >= quorum {
            assert!(
                matches!(r, Acquired::Busy { .. }),
                "{n} nodes, foreign holder on {locked:?}: {r:?}"
            );
            // The failed try left no hold of `me` anywhere: only the foreign nodes keep the lock.
            let left = nodes_with_lock(&servers, &name).await;
            assert_eq!(left, locked, "{n} nodes, foreign on {locked:?}");
            for (_, mut con) in common::redlock::admins(&servers).await {
                let mine: Option<String> = redis::cmd("HGET")
                    .arg(dlock::backend::redis_keys(&name).lock)
                    .arg("me")
                    .query_async(&mut con)
                    .await
                    .unwrap();
                assert_eq!(mine, None, "a failed try left a hold of `me`");
            }
        } else {
            assert!(
                matches!(r, Acquired::Granted { .. }),
                "{n} nodes, foreign holder only on {locked:?}: {r:?}"
            );
            rl.release(&name, "me", None, true).await.unwrap();
        }
        for &i in &locked {
            singles[i]
                .release(&name, "foreign", None, true)
                .await
                .unwrap();
        }
        assert!(nodes_with_lock(&servers, &name).await.is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_every_quorum_subset_is_busy_every_minority_is_not() {
    every_quorum_subset_is_busy_every_minority_is_not(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_nodes_every_quorum_subset_is_busy_every_minority_is_not() {
    every_quorum_subset_is_busy_every_minority_is_not(5).await;
}

async fn kill_minority_works_kill_majority_fails_fast_restart_works_again(n: usize) {
    let mut servers = nodes(n).await;
    let restart_delay = Duration::from_millis(600);
    // Nodes younger than the restart delay are not counted.
    wait_uptime(&servers, 1).await;
    let rl: Arc<dyn Backend> = Arc::new(
        RedlockBackend::builder(urls(&servers))
            .restart_delay(restart_delay)
            .connect()
            .await
            .unwrap(),
    );
    let quorum = n / 2 + 1;
    let lock = |name: &str| {
        Lock::new(name.to_string())
            .with_backend(rl.clone())
            .ttl(Duration::from_secs(2))
    };
    // Kill a minority: still works.
    for s in servers.iter_mut().take(n - quorum) {
        tokio::task::block_in_place(|| s.kill());
    }
    for i in 0..5 {
        let g = lock(&format!("minority-{i}"))
            .acquire()
            .await
            .expect("a minority down must not stop the lock");
        g.release().await.unwrap();
    }
    // Kill one more (a majority is down): a typed error, fast, and nothing left on live nodes.
    tokio::task::block_in_place(|| servers[n - quorum].kill());
    for i in 0..5 {
        let name = format!("majority-{i}");
        let t = Instant::now();
        let r = lock(&name).acquire().await;
        let took = t.elapsed();
        assert!(
            matches!(r, Err(LockError::Backend { .. })),
            "majority down: {r:?}"
        );
        assert!(
            took < Duration::from_millis(1000),
            "majority down: the error took {took:?} (per-node timeout 50 ms)"
        );
        assert!(
            nodes_with_lock(&servers, &name).await.is_empty(),
            "a failed try left a lock hash on a live node"
        );
    }
    // Bring them back: restarted nodes (new run_id) count again after the restart delay.
    for s in servers.iter_mut().take(n - quorum + 1) {
        tokio::task::block_in_place(|| s.restart());
    }
    let back = Instant::now();
    let mut ok_at = None;
    while back.elapsed() < Duration::from_secs(5) {
        if let Ok(g) = lock("back").acquire().await {
            ok_at = Some(back.elapsed());
            g.release().await.unwrap();
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ok_at = ok_at.expect("the lock works again after the nodes came back, without re-init");
    assert!(
        ok_at + Duration::from_millis(100) >= restart_delay,
        "restarted nodes were counted after {ok_at:?}, before the restart delay {restart_delay:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_kill_minority_works_kill_majority_fails_fast_restart_works_again() {
    kill_minority_works_kill_majority_fails_fast_restart_works_again(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_nodes_kill_minority_works_kill_majority_fails_fast_restart_works_again() {
    kill_minority_works_kill_majority_fails_fast_restart_works_again(5).await;
}

fn p99(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[(v.len() * 99 / 100).min(v.len() - 1)]
}

/// A SIGSTOPped node does not slow the acquire: the other two decide.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_node_does_not_slow_the_acquire() {
    let mut servers = nodes(3).await;
    let rl: Arc<dyn Backend> = Arc::new(connect_now(urls(&servers)).await);
    tokio::task::block_in_place(|| servers[0].pause());
    let mut lat = Vec::new();
    for i in 0..40 {
        // A wait absorbs a try that missed the 50 ms node timeout on a loaded machine; its
        // retry counts in the latency.
        let l = Lock::new(format!("stopped-{i}"))
            .with_backend(rl.clone())
            .wait(Duration::from_secs(2));
        let t = Instant::now();
        let g = l.acquire().await.expect("two of three nodes answer");
        lat.push(t.elapsed());
        g.release().await.unwrap();
    }
    tokio::task::block_in_place(|| servers[0].resume());
    let p = p99(lat);
    assert!(
        p < Duration::from_millis(200),
        "acquire p99 {p:?} with one node stopped"
    );
}

/// `CLIENT PAUSE 300 WRITE` on one node: acquire p99 stays far below the pause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_paused_node_does_not_slow_the_acquire() {
    let servers = nodes(3).await;
    let rl: Arc<dyn Backend> = Arc::new(connect_now(urls(&servers)).await);
    let mut admin = servers[1].admin_async().await;
    let mut lat = Vec::new();
    for round in 0..4 {
        let _: () = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(300)
            .arg("WRITE")
            .query_async(&mut admin)
            .await
            .unwrap();
        let start = Instant::now();
        let mut i = 0;
        while start.elapsed() < Duration::from_millis(250) && i < 200 {
            // A wait absorbs a try that missed the 50 ms node timeout on a loaded machine; its
            // retry counts in the latency.
            let l = Lock::new(format!("paused-{round}-{i}"))
                .with_backend(rl.clone())
                .wait(Duration::from_secs(2));
            let t = Instant::now();
            let g = l.acquire().await.expect("two of three nodes answer");
            lat.push(t.elapsed());
            g.release().await.unwrap();
            i += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let p = p99(lat.clone());
    assert!(
        p < Duration::from_millis(150),
        "acquire p99 {p:?} over {} acquisitions during a 300 ms write pause",
        lat.len()
    );
}

/// The delayed-restart rule: a node that restarted (and forgot the holder's hold) is not counted
/// toward a quorum until the restart delay passed, so a second client cannot assemble a quorum
/// from it while the first holder's lease is valid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_is_not_counted_until_the_restart_delay_passed() {
    let mut servers = nodes(3).await;
    let delay = Duration::from_millis(1500);
    // Nodes younger than the restart delay are not counted.
    wait_uptime(&servers, 2).await;
    let a: Arc<dyn Backend> = Arc::new(
        RedlockBackend::builder(urls(&servers))
            .restart_delay(delay)
            .connect()
            .await
            .unwrap(),
    );
    let b: Arc<dyn Backend> = Arc::new(
        RedlockBackend::builder(urls(&servers))
            .restart_delay(delay)
            .connect()
            .await
            .unwrap(),
    );
    let name = "restart-rule";
    let ttl = Duration::from_millis(1500);
    let holder = Lock::new(name)
        .with_backend(a.clone())
        .ttl(ttl)
        .watchdog(false)
        .acquire()
        .await
        .unwrap();
    // Node 2 loses the hold (as if it had missed it), node 1 restarts without persistence.
    let mut con = servers[2].admin_async().await;
    let _: i64 = redis::cmd("DEL")
        .arg(dlock::backend::redis_keys(name).lock)
        .query_async(&mut con)
        .await
        .unwrap();
    tokio::task::block_in_place(|| servers[1].restart());
    // Let B's connection to node 1 notice the restart (the first call may fail on the old
    // socket), so that the try below really gets node 1's grant.
    for _ in 0..3 {
        let _ = b.try_acquire("warm-up", "b-owner", ttl).await;
        let _ = b.release("warm-up", "b-owner", None, true).await;
    }
    // Nodes 1 and 2 would now grant B a majority; the rule keeps node 1 out.
    let r = b.try_acquire(name, "b-owner", ttl).await;
    assert!(
        !matches!(r, Ok(Acquired::Granted { .. })),
        "B got a quorum from a restarted node while A's lease is valid: {r:?}"
    );
    assert!(holder.is_valid());
    assert_eq!(
        nodes_with_lock(&servers, name).await,
        vec![0],
        "B's failed try left a hold behind"
    );
    // After the delay (A's lease has ended too), B gets it.
    tokio::time::sleep(delay).await;
    assert!(!holder.is_valid());
    let r = b.try_acquire(name, "b-owner", ttl).await.unwrap();
    assert!(matches!(r, Acquired::Granted { .. }), "{r:?}");
}

/// The restarted-node rule reads `INFO server` once per data connection, not per call: 200
/// acquire + extend + release rounds on a named connection send `CLIENT GETNAME` behind each
/// script and no `INFO`. A restart in between is still seen (the new connection has no name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_id_is_read_once_per_connection_and_a_restart_is_still_seen() {
    let mut servers = nodes(3).await;
    // Longer than the rounds below take after the restart; nodes younger than it are not
    // counted, so the test waits for that first.
    let delay = Duration::from_secs(3);
    wait_uptime(&servers, 3).await;
    let rl = RedlockBackend::builder(urls(&servers))
        .restart_delay(delay)
        .connect()
        .await
        .unwrap();
    let ttl = Duration::from_secs(5);
    let round = |i: u32| {
        let rl = &rl;
        async move {
            let name = format!("once-per-conn-{i}");
            let r = rl.try_acquire(&name, "owner", ttl).await;
            assert!(matches!(r, Ok(Acquired::Granted { .. })), "{r:?}");
            assert!(matches!(
                rl.extend(&name, "owner", ttl).await,
                Ok(dlock::backend::Extended::Extended)
            ));
            rl.release(&name, "owner", None, true).await.unwrap();
        }
    };
    round(0).await;
    let stats = |s: &RedisProc| {
        let mut c = s.admin();
        let text: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut c)
            .unwrap();
        let calls = |cmd: &str| -> u64 {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
                .and_then(|rest| rest.split(',').next())
                .map_or(0, |n| n.parse().unwrap())
        };
        (calls("info"), calls("client|getname"))
    };
    let before: Vec<(u64, u64)> = servers.iter().map(stats).collect();
    for i in 1..=200 {
        round(i).await;
    }
    for (s, (info0, getname0)) in servers.iter().zip(before) {
        let (info1, getname1) = stats(s);
        // This test's own INFO commandstats is the one INFO call in between.
        assert_eq!(info1 - info0, 1, "INFO sent during the rounds");
        assert!(
            getname1 - getname0 >= 400,
            "CLIENT GETNAME sent {} times for 200 acquires and 200 extends",
            getname1 - getname0
        );
    }
    // A restart behind the connection manager's back: its next connection has no name, so the
    // run_id is read again and the node is left out for the restart delay.
    tokio::task::block_in_place(|| servers[1].restart());
    tokio::task::block_in_place(|| servers[2].restart());
    let mut refused = 0;
    for i in 0..5 {
        let name = format!("after-restart-{i}");
        if !matches!(
            rl.try_acquire(&name, "owner", ttl).await,
            Ok(Acquired::Granted { .. })
        ) {
            refused += 1;
        }
    }
    assert_eq!(
        refused, 5,
        "two restarted nodes of three were counted toward a quorum"
    );
}

/// After a node restart, the holder's next renewal puts its hold back on that node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_renewal_puts_the_hold_back_on_a_restarted_node() {
    let mut servers = nodes(3).await;
    let rl: Arc<dyn Backend> = Arc::new(connect_now(urls(&servers)).await);
    let name = "put-back";
    let g = Lock::new(name)
        .with_backend(rl.clone())
        .ttl(Duration::from_millis(900))
        .acquire()
        .await
        .unwrap();
    assert_eq!(nodes_with_lock(&servers, name).await, vec![0, 1, 2]);
    tokio::task::block_in_place(|| servers[0].restart());
    assert_eq!(nodes_with_lock(&servers, name).await, vec![1, 2]);
    let back = common::eventually(Duration::from_secs(3), || {
        let servers = &servers;
        async move { nodes_with_lock(servers, name).await.contains(&0) }
    })
    .await;
    assert!(back, "the hold was not put back on the restarted node");
    let mut con = servers[0].admin_async().await;
    let owners: Vec<String> = redis::cmd("HKEYS")
        .arg(dlock::backend::redis_keys(name).lock)
        .query_async(&mut con)
        .await
        .unwrap();
    let owners: Vec<String> = owners.into_iter().filter(|o| !o.starts_with(':')).collect();
    assert_eq!(owners, vec![g.owner().to_string()]);
    assert!(g.is_valid());
    g.release().await.unwrap();
    assert!(nodes_with_lock(&servers, name).await.is_empty());
}

/// Fencing tokens of successive grants strictly increase even when each grant's quorum is a
/// different subset of the nodes (any two quorums share a node).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_across_different_quorums() {
    let mut servers = nodes(3).await;
    let rl: Arc<dyn Backend> = Arc::new(connect_now(urls(&servers)).await);
    let mut last = 0;
    for down in [0usize, 1, 2, 0, 1, 2] {
        tokio::task::block_in_place(|| servers[down].pause());
        // A wait absorbs a try that missed the 50 ms per-node timeout on a loaded machine.
        let g = Lock::new("tokens")
            .with_backend(rl.clone())
            .wait(Duration::from_secs(2))
            .acquire()
            .await
            .unwrap();
        assert!(
            g.fencing_token() > last,
            "{} after {last}",
            g.fencing_token()
        );
        last = g.fencing_token();
        g.release().await.unwrap();
        tokio::task::block_in_place(|| servers[down].resume());
    }
}

/// A quorum can grant while one node has not answered yet. That node's release must not
/// overtake its acquire: if it ran first it would free nothing, and the acquire would then leave
/// a hold there for the whole ttl, so that with another node down no quorum forms for 30 s. The
/// node's script cache is emptied first (a restart or `SCRIPT FLUSH` does that), so both calls
/// meet `NOSCRIPT` and are sent again, each on its own, after the node resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_does_not_overtake_a_slow_nodes_acquire() {
    let mut servers = nodes(3).await;
    let rl: Arc<dyn Backend> = Arc::new(connect_now(urls(&servers)).await);
    for round in 0..6 {
        let slow = round % 3;
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query(&mut servers[slow].admin())
            .unwrap();
        tokio::task::block_in_place(|| servers[slow].pause());
        let g = Lock::new("overtake")
            .with_backend(rl.clone())
            .wait(Duration::from_secs(2))
            .acquire()
            .await
            .unwrap();
        g.release().await.unwrap();
        tokio::task::block_in_place(|| servers[slow].resume());
        let key = dlock::backend::redis_keys("overtake").lock;
        let mut admin = servers[slow].admin();
        let gone = common::eventually(Duration::from_secs(3), || {
            let n: i64 = redis::cmd("EXISTS").arg(&key).query(&mut admin).unwrap();
            std::future::ready(n == 0)
        })
        .await;
        assert!(
            gone,
            "round {round}: node {slow} kept a hold after the release"
        );
    }
}

/// `dlock::init_redlock` registers a named backend from any iterable of URL strings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_redlock_registers_a_named_backend() {
    let servers = nodes(3).await;
    // The default restart delay is the longest ttl used (1 s here): nodes younger than that
    // are not counted.
    wait_uptime(&servers, 1).await;
    let u = urls(&servers);
    let refs: Vec<&str> = u.iter().map(|s| s.as_str()).collect();
    dlock::init_redlock("redlock-test", &refs).await.unwrap();
    dlock::init_redlock("redlock-test-2", u.clone())
        .await
        .unwrap();
    let g = Lock::new("registered")
        .backend("redlock-test")
        .ttl(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap();
    let r = Lock::new("registered")
        .backend("redlock-test-2")
        .ttl(Duration::from_secs(1))
        .acquire()
        .await;
    assert!(matches!(r, Err(LockError::Busy { .. })), "{r:?}");
    g.release().await.unwrap();
    // Nothing answers: a typed error, not a hang.
    let r = dlock::init_redlock(
        "redlock-bad",
        ["redis://127.0.0.1:1", "redis://127.0.0.1:2"],
    )
    .await;
    assert!(matches!(r, Err(LockError::Backend { .. })), "{r:?}");
}

const CHILD_ENTRY: &str = "redlock_child_entry";

/// Not a test of its own: the entry point of the child processes of
/// `two_processes_exclusion_non_atomic_counter_exact_tokens_increase`. Connects a Redlock backend
/// to `DLOCK_URLS` (comma-separated) and increments a file counter under the lock `rl-xp`.
#[test]
#[ignore = "child-process entry point; the two-process test runs it in its children"]
fn redlock_child_entry() {
    let mode = child_mode().expect("a child entry point runs only in a child process");
    assert_eq!(mode, "increment");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let list = std::env::var("DLOCK_URLS").unwrap();
        let backend: Arc<dyn Backend> = Arc::new(connect_now(list.split(',')).await);
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
                    let t0 = Instant::now();
                    let g = Lock::new("rl-xp")
                        .with_backend(backend.clone())
                        .ttl(Duration::from_secs(10))
                        .wait(Duration::from_secs(60))
                        .acquire()
                        .await
                        .unwrap();
                    // A wait of half the lease means a lost wake-up: the waiter slept until
                    // the lease of a hold that was given back long before ran out.
                    assert!(
                        t0.elapsed() < Duration::from_secs(5),
                        "pid {} task {t} waited {:?} for a lock held for milliseconds at a time",
                        std::process::id(),
                        t0.elapsed()
                    );
                    // Read, pause, write: a lost update unless the lock excludes the others.
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
    });
}

/// Issue 8: exclusion across two processes on Redlock(3): 2 processes × 4 tasks increment a
/// file counter (read, pause, write) under the lock; the count is exact and the fencing tokens,
/// logged in grant order, strictly increase (any two quorums share a node whose token grew). No
/// wait lasts half the 10 s lease (a child fails otherwise): the clean-ups of split votes publish
/// on some nodes only, and a release must still wake a waiter in each process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_exclusion_non_atomic_counter_exact_tokens_increase() {
    const PROCS: usize = 2;
    const TASKS: usize = 4;
    const ITERS: usize = 15;
    let servers = nodes(3).await;
    let dir = TempDir::new("rl-xp");
    let counter = dir.path().join("counter");
    let log = dir.path().join("tokens");
    let envs = [
        ("DLOCK_URLS", urls(&servers).join(",")),
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
            assert_eq!(c.expect_line(Duration::from_secs(90)), "done");
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
    assert!(started.elapsed() < Duration::from_secs(90));
}

/// Review finding #4 on Redlock: a try whose requests are held in a partition on every node and
/// delivered late after the heal (TCP retransmission) must not leave orphans for its ttl. Each
/// node's give-back goes on the connection the node's try used, behind it (waiting for the
/// node's task only is not enough: the task ends at its response timeout, long before the
/// server runs the held request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redlock_give_back_never_overtakes_its_tries_delivered_late_after_a_heal() {
    use common::proxy::{Mode, Proxy};
    let servers = nodes(3).await;
    let proxies: Vec<Proxy> = servers.iter().map(|s| Proxy::start(s.port())).collect();
    let via: Arc<dyn Backend> = Arc::new(
        RedlockBackend::builder(proxies.iter().map(|p| p.url()))
            .restart_delay(Duration::ZERO)
            .map_nodes(|b| b.response_timeout(Duration::from_millis(500)))
            .connect()
            .await
            .unwrap(),
    );
    let direct: Arc<dyn Backend> = Arc::new(connect_now(urls(&servers)).await);
    // Data connections through the proxies first.
    Lock::new("rl-late")
        .with_backend(via.clone())
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let fence = dlock::backend::redis_keys("rl-late").fence;
    for s in &servers {
        let _: () = redis::cmd("DEL").arg(&fence).query(&mut s.admin()).unwrap();
    }
    proxies.iter().for_each(|p| p.set_mode(Mode::Hold));
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        Lock::new("rl-late")
            .with_backend(via.clone())
            .ttl(Duration::from_secs(30))
            .acquire(),
    )
    .await
    .expect("the try is bounded");
    assert!(r.is_err(), "acquired through a partition: {r:?}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    proxies
        .iter()
        .for_each(|p| p.heal_delivering_held_after(Duration::from_millis(1500)));
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let ran = servers
        .iter()
        .filter(|s| {
            let n: i64 = redis::cmd("EXISTS")
                .arg(&fence)
                .query(&mut s.admin())
                .unwrap();
            n == 1
        })
        .count();
    assert_eq!(
        ran, 3,
        "the held tries did not all reach their nodes (the test proves nothing)"
    );
    let left = nodes_with_lock(&servers, "rl-late").await;
    let r = Lock::new("rl-late").with_backend(direct).acquire().await;
    match r {
        Ok(g) => g.release().await.unwrap(),
        Err(e) => panic!("the late tries left orphans on nodes {left:?}: {e:?}"),
    }
    assert!(left.is_empty(), "orphans on nodes {left:?}");
}

/// Review finding #10: the renewal's put-back of a hold on a node that lost it must not be
/// overtaken by a release sent right after the renewal (an orphan on that node for the ttl).
/// The node's script cache holds the release script but not the acquire script, so the
/// put-back needs two more round trips (NOSCRIPT, load, send again) than the release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_does_not_overtake_the_renewals_put_back() {
    let mut servers = nodes(3).await;
    let rl: Arc<dyn Backend> = Arc::new(connect_now(urls(&servers)).await);
    let name = "put-back-overtake";
    let lock_key = dlock::backend::redis_keys(name).lock;
    for round in 0..3 {
        let g = Lock::new(name)
            .with_backend(rl.clone())
            .ttl(Duration::from_secs(30))
            .acquire()
            .await
            .unwrap();
        let mut admin = servers[2].admin();
        let _: () = redis::cmd("DEL").arg(&lock_key).query(&mut admin).unwrap();
        let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut admin).unwrap();
        let _: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(include_str!("../dlock-runtime/src/scripts/release.lua"))
            .query(&mut admin)
            .unwrap();
        g.extend(Duration::from_secs(30))
            .await
            .expect("a quorum renewed");
        g.release().await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            nodes_with_lock(&servers, name).await.is_empty(),
            "round {round}: the put-back ran after the release and left an orphan"
        );
        let _ = &mut servers;
    }
}

/// Review finding #9: a fresh owner (kept after a `Busy`) that meets its own leftover hold from
/// an earlier try on a node (count 2 there) is not a re-entry: when the try fails, its clean-up
/// gives back everything, on the nodes that answered and, after their try ends, on the nodes
/// that had not answered. Inferring a re-entry from the count skipped those nodes and only
/// decremented the leftover, leaving orphans for the ttl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_owner_meeting_its_own_leftover_still_cleans_up_every_node() {
    let mut servers = nodes(3).await;
    let rl = connect_now(urls(&servers)).await;
    let name = "leftover";
    let owner = "fresh-owner";
    let lock_key = dlock::backend::redis_keys(name).lock;
    // Node 0: this owner's leftover from an earlier try whose clean-up has not landed.
    let _: () = redis::pipe()
        .cmd("HSET")
        .arg(&lock_key)
        .arg(owner)
        .arg(1)
        .arg(":fence")
        .arg(1)
        .ignore()
        .cmd("PEXPIRE")
        .arg(&lock_key)
        .arg(30_000)
        .ignore()
        .query(&mut servers[0].admin())
        .unwrap();
    // Node 1: held by someone else.
    let other = RedisBackend::connect(&servers[1].url()).await.unwrap();
    let r = other
        .try_acquire(name, "someone-else", Duration::from_secs(30))
        .await
        .unwrap();
    assert!(matches!(r, Acquired::Granted { .. }));
    // Node 2: does not answer in time; it runs the try after it resumes.
    tokio::task::block_in_place(|| servers[2].pause());
    let r = rl.try_acquire(name, owner, Duration::from_secs(30)).await;
    assert!(matches!(r, Ok(Acquired::Busy { .. })), "{r:?}");
    tokio::task::block_in_place(|| servers[2].resume());
    let clean = common::eventually(Duration::from_secs(3), || {
        let servers = &servers;
        let lock_key = &lock_key;
        async move {
            let mut left = 0;
            for i in [0usize, 2] {
                let mut con = servers[i].admin_async().await;
                let n: i64 = redis::cmd("HEXISTS")
                    .arg(lock_key)
                    .arg(owner)
                    .query_async(&mut con)
                    .await
                    .unwrap();
                left += n;
            }
            left == 0
        }
    })
    .await;
    let mut left = Vec::new();
    for i in [0usize, 2] {
        let n: i64 = redis::cmd("HEXISTS")
            .arg(&lock_key)
            .arg(owner)
            .query(&mut servers[i].admin())
            .unwrap();
        if n == 1 {
            left.push(i);
        }
    }
    assert!(
        clean,
        "the failed try left this owner's holds on nodes {left:?}"
    );
    let _ = &mut servers;
}

/// A release that a quorum did not confirm (two of three nodes cut off, their connections lost)
/// is not reported as done, and the nodes that did not confirm it are retried in the
/// background until they answer, instead of keeping the hold there (a quorum: the name
/// blocked) for the rest of its ttl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_lost_on_a_quorum_of_nodes_is_retried_until_they_answer() {
    use common::proxy::{Mode, Proxy};
    let servers = nodes(3).await;
    let proxies: Vec<Proxy> = servers.iter().map(|s| Proxy::start(s.port())).collect();
    let via: Arc<dyn Backend> = Arc::new(
        RedlockBackend::builder(proxies.iter().map(|p| p.url()))
            .restart_delay(Duration::ZERO)
            .map_nodes(|b| b.response_timeout(Duration::from_millis(300)))
            .connect()
            .await
            .unwrap(),
    );
    let direct: Arc<dyn Backend> = Arc::new(connect_now(urls(&servers)).await);
    let g = Lock::new("rl-lost-release")
        .with_backend(via.clone())
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    proxies[1].set_mode(Mode::Blackhole);
    proxies[2].set_mode(Mode::Blackhole);
    let r = g.release().await;
    assert!(
        !matches!(r, Ok(()) | Err(LockError::NotOwner { .. })),
        "a release confirmed by one node of three was reported as {r:?}"
    );
    // Leaving the blackhole closes the connections that dropped bytes: the release sent on
    // them is lost for good.
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxies[1].set_mode(Mode::Pass);
    proxies[2].set_mode(Mode::Pass);
    let healed = Instant::now();
    let g = Lock::new("rl-lost-release")
        .with_backend(direct)
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("the hold was given back on every node after the heal");
    assert!(
        healed.elapsed() < Duration::from_secs(5),
        "free only {:?} after the heal (the lease was 30 s)",
        healed.elapsed()
    );
    g.release().await.unwrap();
}

/// In a round of [`tokens_increase_with_paused_nodes`], `RESTART + i` restarts node `i`.
const RESTART: usize = 100;

/// Grants once per entry of `downs` on `name`, each time with the nodes it names paused (so
/// each grant is decided on another quorum; `RESTART + i`: node `i` restarted before the grant
/// instead) and alternating between `clients`, and asserts that every grant's token is larger
/// than every earlier one.
async fn tokens_increase_with_paused_nodes(
    servers: &mut [RedisProc],
    clients: &[Arc<dyn Backend>],
    name: &str,
    downs: &[Vec<usize>],
) {
    let mut tokens: Vec<u64> = Vec::new();
    for (round, down) in downs.iter().enumerate() {
        for &d in down {
            if d >= RESTART {
                // Killed and started again without persistence: its fence is gone.
                tokio::task::block_in_place(|| servers[d - RESTART].restart());
                continue;
            }
            tokio::task::block_in_place(|| servers[d].pause());
        }
        // A wait absorbs a try that missed the 50 ms per-node timeout on a loaded machine.
        let g = Lock::new(name)
            .with_backend(clients[round % clients.len()].clone())
            .wait(Duration::from_secs(5))
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("round {round}, nodes {down:?} paused: {e}"));
        let t = g.fencing_token();
        let max = tokens.iter().copied().max().unwrap_or(0);
        assert!(
            t > max,
            "round {round} (nodes {down:?} paused): token {t} is not above an earlier grant's {max} \
             (by {} µs); tokens so far {tokens:?}",
            max - t
        );
        tokens.push(t);
        g.release().await.unwrap();
        for &d in down.iter().filter(|&&d| d < RESTART) {
            tokio::task::block_in_place(|| servers[d].resume());
        }
    }
}

/// Review redis-family #1: each node mints `max(last + 1, its own TIME in µs)`, so with node
/// clocks 2 s apart a grant decided on the fast node and the next one decided without it went
/// backwards by about 2 s. The chosen token is now written back to a quorum before the guard is
/// returned, so every later quorum meets a node whose fence is at least that token. Three nodes
/// at -2 s, 0 and +2 s (the clock shim), one paused per round, two clients in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_across_quorums_with_per_node_clock_offsets() {
    common::debug_events_in_test_output();
    let (mut servers, _clocks) =
        tokio::task::spawn_blocking(|| common::redlock::start_offset_nodes(&[-2000, 0, 2000]))
            .await
            .unwrap();
    // The offsets are in effect: the nodes' TIME differ by about 2 s each.
    let mut times = Vec::new();
    for s in &servers {
        let (sec, us): (i64, i64) = redis::cmd("TIME").query(&mut s.admin()).unwrap();
        times.push(sec * 1_000_000 + us);
    }
    assert!(
        times[1] - times[0] > 1_500_000 && times[2] - times[1] > 1_500_000,
        "node clocks not offset: {times:?}"
    );
    let a: Arc<dyn Backend> = Arc::new(connect_now(urls(&servers)).await);
    let b: Arc<dyn Backend> = Arc::new(connect_now(urls(&servers)).await);
    let downs: Vec<Vec<usize>> = [0usize, 1, 2, 0, 2, 1, 1, 0, 2, 2]
        .into_iter()
        .map(|d| vec![d])
        .collect();
    tokens_increase_with_paused_nodes(&mut servers, &[a, b], "skewed-tokens", &downs).await;
}

/// The same with five nodes whose clocks are 150 ms apart (-300 ms to +300 ms) and two random
/// nodes paused per round (seeded), three clients in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_across_random_quorums_of_five_skewed_nodes() {
    common::debug_events_in_test_output();
    let (mut servers, _clocks) = tokio::task::spawn_blocking(|| {
        common::redlock::start_offset_nodes(&[-300, -150, 0, 150, 300])
    })
    .await
    .unwrap();
    let mut clients: Vec<Arc<dyn Backend>> = Vec::new();
    for _ in 0..3 {
        clients.push(Arc::new(connect_now(urls(&servers)).await));
    }
    let mut rng = Rng::new(0x5eed_0001);
    let downs: Vec<Vec<usize>> = (0..24)
        .map(|_| {
            let x = rng.below(5) as usize;
            let y = (x + 1 + rng.below(4) as usize) % 5;
            vec![x, y]
        })
        .collect();
    tokens_increase_with_paused_nodes(&mut servers, &clients, "skewed-tokens-5", &downs).await;
}

/// Review redis-family #6: a node that restarted without persistence while another process
/// held a lock on it is not counted by a process that never saw the restart (here one that
/// connects after it) until the restart delay has passed since the node started: its
/// `uptime_in_seconds` is read with its `run_id`. Before, the new process counted it at once
/// and granted the lock while the first holder's lease was valid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_client_does_not_count_a_node_restarted_before_it_connected() {
    let mut servers = nodes(3).await;
    // Generous: the steps between the grant and P2's try must fit in it on a loaded machine.
    let ttl = Duration::from_secs(6);
    let delay = ttl;
    // Every node has been up for longer than the delay, so only the restarted one is young.
    wait_uptime(&servers, 6).await;
    let p1: Arc<dyn Backend> = Arc::new(
        RedlockBackend::builder(urls(&servers))
            .restart_delay(delay)
            .connect()
            .await
            .unwrap(),
    );
    let name = "restart-unseen";
    let holder = Lock::new(name)
        .with_backend(p1.clone())
        .ttl(ttl)
        .watchdog(false)
        .wait(Duration::from_secs(2))
        .acquire()
        .await
        .unwrap();
    // Node 2 loses the hold (as if it had missed the grant), node 0 restarts without
    // persistence (the hold is gone there too), then a new process P2 connects.
    let mut con = servers[2].admin_async().await;
    let _: i64 = redis::cmd("DEL")
        .arg(dlock::backend::redis_keys(name).lock)
        .query_async(&mut con)
        .await
        .unwrap();
    tokio::task::block_in_place(|| servers[0].restart());
    assert_eq!(nodes_with_lock(&servers, name).await, vec![1]);
    let p2: Arc<dyn Backend> = Arc::new(
        RedlockBackend::builder(urls(&servers))
            .restart_delay(delay)
            .connect()
            .await
            .unwrap(),
    );
    // Nodes 0 and 2 would grant P2 a majority; node 0 is younger than the delay.
    let r = p2.try_acquire(name, "p2-owner", ttl).await;
    assert!(
        holder.is_valid(),
        "the holder's lease ended during the test"
    );
    assert!(
        !matches!(r, Ok(Acquired::Granted { .. })),
        "a new process counted a just-restarted node and granted the lock while the holder's \
         lease is valid: {r:?}"
    );
    // Once the holder's lease and the delay have passed, P2 gets it.
    tokio::time::sleep(delay + Duration::from_millis(500)).await;
    let r = p2.try_acquire(name, "p2-owner", ttl).await;
    assert!(matches!(r, Ok(Acquired::Granted { .. })), "{r:?}");
}

/// Review redis-family #12: settings that would overflow the backend's arithmetic are a
/// `Config` error at build.
#[test]
fn absurd_settings_are_a_config_error_at_build() {
    let urls = [
        "redis://127.0.0.1:1",
        "redis://127.0.0.1:2",
        "redis://127.0.0.1:3",
    ];
    let cases: Vec<(&str, dlock::RedlockBuilder)> = vec![
        (
            "node_timeout(MAX)",
            RedlockBackend::builder(urls).node_timeout(Duration::MAX),
        ),
        (
            "node_timeout(1 year)",
            RedlockBackend::builder(urls).node_timeout(Duration::from_secs(365 * 24 * 3600)),
        ),
        (
            "drift(0.01, MAX)",
            RedlockBackend::builder(urls).drift(0.01, Duration::MAX),
        ),
        (
            "drift(NaN)",
            RedlockBackend::builder(urls).drift(f64::NAN, Duration::ZERO),
        ),
        (
            "restart_delay(MAX)",
            RedlockBackend::builder(urls).restart_delay(Duration::MAX),
        ),
    ];
    for (what, b) in cases {
        let r = b.build();
        assert!(
            matches!(r, Err(LockError::Config(_))),
            "{what}: {:?}",
            r.map(|_| ())
        );
    }
    // A huge ttl passed straight to the backend does not overflow the drift either.
    let b = RedlockBackend::builder(urls).build().unwrap();
    assert!(b.drift(Duration::MAX) >= Duration::from_secs(1));
}

/// Polls `f` to completion on this thread, outside any tokio runtime.
fn poll_here<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let started = Instant::now();
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "a call outside a runtime did not finish"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Review redis-family #12: used outside a tokio runtime (a plain thread, `block_on` of
/// another executor) every call is a `Config` error, not a panic of `tokio::spawn`.
#[test]
fn calls_outside_a_tokio_runtime_are_a_config_error_not_a_panic() {
    let servers = start_nodes(3);
    let urls = urls(&servers);
    let rl = RedlockBackend::builder(&urls)
        .restart_delay(Duration::ZERO)
        .build()
        .unwrap();
    let ttl = Duration::from_secs(5);
    let r = std::thread::scope(|s| {
        s.spawn(|| {
            (
                poll_here(rl.try_acquire("no-rt", "o", ttl)).map(|_| ()),
                poll_here(rl.release("no-rt", "o", None, true)).map(|_| ()),
                poll_here(rl.extend("no-rt", "o", ttl)).map(|_| ()),
                poll_here(rl.watch("no-rt")).map(|_| ()),
                poll_here(RedlockBackend::builder(&urls).connect()).map(|_| ()),
            )
        })
        .join()
    });
    let (a, rel, ext, w, c) = r.expect("a call outside a runtime panicked");
    for (what, r) in [
        ("try_acquire", a),
        ("release", rel),
        ("extend", ext),
        ("watch", w),
        ("connect", c),
    ] {
        assert!(matches!(r, Err(LockError::Config(_))), "{what}: {r:?}");
    }
    // And through the lock API.
    let lock = Lock::new("no-rt-lock").with_backend(Arc::new(rl.clone()));
    let r = std::thread::scope(|s| s.spawn(|| poll_here(lock.acquire()).map(|_| ())).join());
    let r = r.expect("Lock::acquire outside a runtime panicked");
    assert!(
        matches!(r, Err(LockError::Config(_))),
        "Lock::acquire: {r:?}"
    );
}

/// The token rule under random pauses and restarts without persistence (seeded): five nodes
/// 150 ms apart, each round either one or two nodes paused, or one restarted (its fence is gone)
/// and one paused. The clients' restart delay (1 s) is longer than the clock spread (600 ms), so
/// by the time a restarted node counts again its own clock is past every token granted before
/// its restart (docs/redlock.md, fencing token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_under_random_pauses_and_restarts_of_five_skewed_nodes() {
    common::debug_events_in_test_output();
    let (mut servers, _clocks) = tokio::task::spawn_blocking(|| {
        common::redlock::start_offset_nodes(&[300, -150, 0, 150, -300])
    })
    .await
    .unwrap();
    wait_uptime(&servers, 1).await;
    let mut clients: Vec<Arc<dyn Backend>> = Vec::new();
    for _ in 0..2 {
        clients.push(Arc::new(
            RedlockBackend::builder(urls(&servers))
                .restart_delay(Duration::from_secs(1))
                .connect()
                .await
                .unwrap(),
        ));
    }
    let mut rng = Rng::new(0x5eed_0002);
    let downs: Vec<Vec<usize>> = (0..20)
        .map(|_| {
            let x = rng.below(5) as usize;
            let y = (x + 1 + rng.below(4) as usize) % 5;
            match rng.below(3) {
                0 => vec![x],
                1 => vec![x, y],
                _ => vec![RESTART + x, y],
            }
        })
        .collect();
    tokens_increase_with_paused_nodes(&mut servers, &clients, "skewed-restarts-5", &downs).await;
}

/// Issue 19: 8 contenders on 4 backends (4 clients, as 4 processes would be, each with its own
/// subscriptions and wait queues) hand one name over 120 times on 3 nodes. A try that
/// fails (another owner holds a quorum) gives back the node it took without waking anyone (its
/// clean-up is not a release), the copies of one release (one per node) wake one waiter, and a
/// try is never refused for this owner's own pending clean-up: tries per acquisition stay near
/// single-node Redis's. Before the fix every failed try's clean-up published a release on the
/// node it had taken, which woke the next waiter, whose try took that node again: a loop for the
/// whole hold (here ~10+ tries per acquisition). Since the nodes keep the waiters' queue (issue
/// 19), a release wakes one process, not one waiter per client: 7.8-7.9 tries per acquisition
/// before that (one per client and more), 1.35 after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contenders_make_few_tries_per_acquisition_no_wake_up_loop() {
    const TASKS: usize = 8;
    const ACQ: u64 = 120;
    const CLIENTS: usize = 4;
    let servers = nodes(3).await;
    let mut counting = Vec::new();
    for _ in 0..CLIENTS {
        counting.push(common::counting::CountTries::new(Arc::new(
            connect_now(urls(&servers)).await,
        )));
    }
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..TASKS {
        let backend: Arc<dyn Backend> = counting[i % CLIENTS].clone();
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            use std::sync::atomic::Ordering::SeqCst;
            while done.load(SeqCst) < ACQ {
                let g = Lock::new("rl-no-wake-loop")
                    .ttl(Duration::from_secs(10))
                    .wait(Duration::from_secs(20))
                    .with_backend(backend.clone())
                    .acquire()
                    .await
                    .unwrap();
                // A hold long enough for a wake-up loop to turn many times.
                tokio::time::sleep(Duration::from_millis(10)).await;
                done.fetch_add(1, SeqCst);
                g.release().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let acq = done.load(std::sync::atomic::Ordering::SeqCst);
    let tries: u64 = counting.iter().map(|c| c.tries()).sum();
    let per = tries as f64 / acq as f64;
    eprintln!(
        "{acq} acquisitions, {tries} tries ({per:.2} per acquisition) in {:?}",
        started.elapsed()
    );
    // Each release wakes the one process queued first on the nodes, whose waiter takes the lock:
    // about 1 try per acquisition, plus the first tries and the odd second process woken where
    // the nodes' queues differ. Generous: 3 (7.8-7.9 when every client woke a waiter per
    // release, 18 before the wake-up loop fix).
    assert!(
        per < 3.0,
        "{tries} tries for {acq} acquisitions ({per:.2} each): a wake-up loop"
    );
    assert!(started.elapsed() < Duration::from_secs(60));
}

/// Counts the tries through a backend that have answered (the test waits on it).
#[derive(Debug)]
struct AnsweredTries {
    inner: Arc<dyn Backend>,
    answered: tokio::sync::watch::Sender<u64>,
}

impl Backend for AnsweredTries {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> dlock::backend::BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(async move {
            let r = self.inner.try_acquire(name, owner, ttl).await;
            self.answered.send_modify(|n| *n += 1);
            r
        })
    }
    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> dlock::backend::BoxFuture<'a, Result<dlock::backend::Released, LockError>> {
        self.inner.release(name, owner, keep_for, all)
    }
    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> dlock::backend::BoxFuture<'a, Result<dlock::backend::Extended, LockError>> {
        self.inner.extend(name, owner, ttl)
    }
    fn watch<'a>(
        &'a self,
        name: &'a str,
    ) -> dlock::backend::BoxFuture<'a, Result<dlock::backend::Watch, LockError>> {
        self.inner.watch(name)
    }
    fn has_waiters(&self, name: &str) -> bool {
        self.inner.has_waiters(name)
    }
    fn lease_margin(&self, ttl: Duration) -> Duration {
        self.inner.lease_margin(ttl)
    }
    fn fresh_owner_per_try(&self) -> bool {
        self.inner.fresh_owner_per_try()
    }
}

/// A busy try's clean-up on a node can still run there long after the try answered: a release
/// that timed out (its request held in a partition and delivered after the heal), or the node
/// backend's background retry of it. Before, the next try of the same acquisition reused the
/// owner id, so once a later clean-up on that node was confirmed (which cleared the refusal of
/// the owner there) a later try could be granted on that node under that id, and the late
/// release then deleted the grant behind its guard: another owner got a quorum while the guard
/// was valid, and the guard's release answered `NotOwner` (the lock_behaviour failure on a
/// loaded machine). Every try on Redlock now has an owner id of its own.
///
/// A holds nodes 1 and 2 (another owner, `h`); A's first try takes node 0 only, whose reply is
/// late (500 ms). A partition starts before that reply arrives, so the try's clean-up on node 0
/// (sent once the reply is read) is held in it; after the heal it is delivered 5 s late. In
/// between, the node backend's retry frees node 0, `h` gives node 1 back, and A is granted
/// nodes 0 and 1. When the held clean-up lands, A must still hold both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_tries_late_clean_up_never_deletes_a_later_grant() {
    use common::proxy::{Mode, Proxy};
    const HELD: Duration = Duration::from_secs(5);
    let servers = nodes(3).await;
    let p0 = Proxy::start(servers[0].port());
    let name = "rl-late-clean-up";
    let keys = dlock::backend::redis_keys(name);
    let ttl = Duration::from_secs(30);
    let h1 = RedisBackend::connect(&servers[1].url()).await.unwrap();
    let h2 = RedisBackend::connect(&servers[2].url()).await.unwrap();
    for h in [&h1, &h2] {
        let r = h.try_acquire(name, "h", ttl).await.unwrap();
        assert!(matches!(r, Acquired::Granted { .. }), "{r:?}");
    }
    let rl = RedlockBackend::builder([p0.url(), servers[1].url(), servers[2].url()])
        .restart_delay(Duration::ZERO)
        .node_timeout(Duration::from_millis(100))
        .connect()
        .await
        .unwrap();
    let (answered, mut answers) = tokio::sync::watch::channel(0u64);
    let via: Arc<dyn Backend> = Arc::new(AnsweredTries {
        inner: Arc::new(rl),
        answered,
    });
    let node0_has_lock = || {
        let s = &servers[0];
        let k = &keys.lock;
        async move {
            let n: i64 = redis::cmd("EXISTS")
                .arg(k)
                .query_async(&mut s.admin_async().await)
                .await
                .unwrap();
            n == 1
        }
    };
    p0.set_mode(Mode::Delay(Duration::from_millis(500)));
    let a = tokio::spawn({
        let via = via.clone();
        async move {
            Lock::new(name)
                .with_backend(via)
                .ttl(ttl)
                .wait(Duration::from_secs(25))
                .acquire()
                .await
        }
    });
    // The first try's acquire ran on node 0; its reply is on its way back for 500 ms more.
    assert!(common::eventually(Duration::from_secs(2), node0_has_lock).await);
    p0.set_mode(Mode::Hold);
    // The clean-up is sent once the reply is read, held, and times out (1 s); the node's backend
    // retries it in the background (refused: no connection can be set up during the hold).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    p0.heal_delivering_held_after(HELD);
    let healed = Instant::now();
    // A retry on a new connection frees node 0.
    assert!(
        common::eventually(Duration::from_secs(3), || async { !node0_has_lock().await }).await,
        "the clean-up of the first try was not retried after the heal"
    );
    // Another try (`h` still holds nodes 1 and 2: busy), woken by a release message.
    let before = *answers.borrow_and_update();
    let _: i64 = redis::cmd("PUBLISH")
        .arg(&keys.channel)
        .arg("1")
        .query(&mut servers[1].admin())
        .unwrap();
    let _ = tokio::time::timeout(Duration::from_secs(2), answers.wait_for(|n| *n > before)).await;
    // `h` gives node 1 back (its release publishes): A's next try is granted nodes 0 and 1.
    assert_eq!(
        h1.release(name, "h", None, true).await.unwrap(),
        dlock::backend::Released::Freed
    );
    // The held clean-up of the first try reaches node 0.
    tokio::time::sleep_until((healed + HELD + Duration::from_millis(700)).into()).await;
    assert!(
        a.is_finished(),
        "A was not granted before the held clean-up was delivered (the test proves nothing)"
    );
    h2.release(name, "h", None, true).await.unwrap();
    let g = a.await.unwrap().expect("A's acquire");
    assert!(g.is_valid());
    let mut holding = Vec::new();
    for (i, s) in servers.iter().enumerate() {
        let n: i64 = redis::cmd("HEXISTS")
            .arg(&keys.lock)
            .arg(g.owner())
            .query(&mut s.admin())
            .unwrap();
        if n == 1 {
            holding.push(i);
        }
    }
    let third = RedlockBackend::builder(urls(&servers))
        .restart_delay(Duration::ZERO)
        .node_timeout(Duration::from_secs(1))
        .connect()
        .await
        .unwrap();
    let r = third.try_acquire(name, "third", ttl).await;
    assert!(
        holding.len() >= 2,
        "a valid guard holds only nodes {holding:?} (a late clean-up deleted its grant); another owner's try: {r:?}"
    );
    assert!(
        matches!(r, Ok(Acquired::Busy { .. })),
        "another owner's try while a guard is valid: {r:?}"
    );
    g.release().await.expect("the guard's release");
}
