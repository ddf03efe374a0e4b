//! One hand-off benchmark for every engine (issue 19, item 2): 16 workers in 4 processes contend
//! for one lock name; a second variant adds a 5th process that queues as a waiter and is then
//! stopped (SIGSTOP) for the whole run.
//!
//! ```sh
//! cargo bench --bench handoff_bench --features sentinel,cluster,postgres,mysql,zookeeper,etcd
//! cargo bench --bench handoff_bench --features zookeeper -- --engine zookeeper,redis
//! DLOCK_BENCH_ACQ=2000 DLOCK_BENCH_SECS=20 DLOCK_BENCH_VARIANT=stall cargo bench --bench handoff_bench
//! ```
//!
//! Engines (each behind its feature; default: every enabled one, `--engine a,b` or
//! `DLOCK_BENCH_ENGINE` to pick): `redis`, `redlock` (3 nodes), `sentinel` (a master and 3
//! sentinels), `cluster` (3 masters), `postgres` (lock-table mode), `pg-advisory`, `mysql`,
//! `zookeeper`, `etcd`. Memory is per process, so it is not here. Every server is private: started
//! on free loopback ports in temp dirs through the test harness (`tests/common/`), killed at exit.
//!
//! The bench re-executes itself: `DLOCK_HANDOFF_CHILD=worker` children run 4 workers each (one
//! backend per process, a 2-thread tokio runtime), `DLOCK_HANDOFF_CHILD=stall` is the stalled
//! waiter. Each worker loops: `Lock::new(name).ttl(10 s).wait(10 s).acquire()`, a critical section
//! that reads a counter file, yields, and writes it back + 1 (a non-atomic check across processes:
//! the counter is also the run's shared ticket), `release()`; until the counter reaches
//! `DLOCK_BENCH_ACQ` (default 2,000) or `DLOCK_BENCH_SECS` (default 20) have passed. Every
//! acquisition is recorded as (acquire call start, grant, release return) in µs of the host's
//! realtime clock, shared by all processes; the parent merges them by grant time.
//!
//! Figures, per engine and variant:
//! * hand-off p50 / p99: next grant − previous release's return, over consecutive grants to
//!   different workers (negative, i.e. the grant reached the next holder before the releaser read
//!   its reply, counts as 0); `max gap`: the longest time nobody held the name while workers
//!   wanted it: between any release and the next grant, and from the last release to the end of
//!   the run (a run whose workers only time out shows its whole length); `≥ 1 s`: how many gaps
//!   were that long.
//! * worst wait: the longest grant − acquire call start; `timeouts`: acquire calls that failed.
//! * fairness: min / max acquisitions of the 16 workers.
//! * server calls per acquisition: server-side counter deltas over the run (Redis `INFO
//!   commandstats` calls on all nodes, without `INFO` itself and without the calls made inside dlock's scripts; PostgreSQL `pg_stat_database`
//!   xact_commit + xact_rollback; MySQL `Questions`; ZooKeeper `mntr` zk_packets_received; etcd
//!   `/metrics` grpc_server_msg_received_total), everything the processes sent, waiting included.
//! * wake-ups per release: tries made after a wait (a wake-up or a timer) / releases. A counting
//!   `Backend` wraps the engine's and sorts each `try_acquire` by what its task did before: a
//!   first try (the acquire call found no local waiter and tried at once), the retry right after
//!   subscribing (`watch`; made by every call that queues before it sleeps, except one that
//!   queued behind local waiters while the holder's lease is known to run on, on a backend that
//!   does not queue contenders on the server), or a try after a
//!   wait. 1.0 = each release woke one waiter, which took the lock. The brief's cruder
//!   (tries − first tries) / releases, which also counts the retries after subscribing, is
//!   printed beside it.
//! * stalled variant: the parent takes the name, the 5th process queues behind it (a try after
//!   its `watch` answered busy; then it blocks its only runtime thread) and the parent stops it
//!   (SIGSTOP) for the rest of the run (SIGCONT + SIGKILL at the end); the workers start and
//!   queue, then the parent releases (recorded as a 17th worker's hold). `max gap` is then the
//!   longest hand-off stall, against the engine's wake-up bound (printed per engine).

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write as _};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dlock::backend::{Acquired, BoxFuture, Extended, Released, Watch};
use dlock::{Backend, Lock, LockError};

const PROCS: usize = 4;
const PER_PROC: usize = 4;
const TTL: Duration = Duration::from_secs(10);
const WAIT: Duration = Duration::from_secs(10);
const CHILD_ENV: &str = "DLOCK_HANDOFF_CHILD";
const LINE: &str = "HANDOFF:";

/// Every engine this build can run, in the order they run.
fn all_engines() -> Vec<&'static str> {
    let mut v = vec!["redis", "redlock"];
    if cfg!(feature = "sentinel") {
        v.push("sentinel");
    }
    if cfg!(feature = "cluster") {
        v.push("cluster");
    }
    if cfg!(feature = "postgres") {
        v.extend(["postgres", "pg-advisory"]);
    }
    if cfg!(feature = "mysql") {
        v.push("mysql");
    }
    if cfg!(feature = "zookeeper") {
        v.push("zookeeper");
    }
    if cfg!(feature = "etcd") {
        v.push("etcd");
    }
    v
}

fn env_num(k: &str, d: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// The counting backend
// ---------------------------------------------------------------------------------------------

/// Wraps an engine's backend and counts what the lock loop asks of it. In the stalled waiter's
/// process (`stall`), a busy try made after a `watch` (the process is queued now, on every
/// engine: ZooKeeper's and etcd's first try created its node, PostgreSQL's retry put it in the
/// waiters' FIFO, Redis subscribed) says `QUEUED` and blocks its thread, so the waiter never
/// moves again; the parent then stops the whole process.
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn Backend>,
    tries: AtomicU64,
    granted: AtomicU64,
    busy: AtomicU64,
    errors: AtomicU64,
    queued_first: AtomicU64,
    watches: AtomicU64,
    /// Tries by kind: made at once by an acquire call (no local waiter), made right after the
    /// call subscribed (`watch`), made after a wait (a wake-up, or a timer).
    first: AtomicU64,
    after_watch: AtomicU64,
    woken: AtomicU64,
    /// What the next try of each task is (the lock loop calls the backend from the task that
    /// awaits `acquire`).
    next: Mutex<HashMap<tokio::task::Id, Next>>,
    stall: bool,
    watched: AtomicBool,
}

#[derive(Debug, Clone, Copy)]
enum Next {
    First,
    /// The call found local waiters and subscribes before any try.
    QueuedFirst,
    AfterWatch,
}

impl Counting {
    fn new(inner: Arc<dyn Backend>, stall: bool) -> Counting {
        Counting {
            inner,
            tries: AtomicU64::new(0),
            granted: AtomicU64::new(0),
            busy: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            queued_first: AtomicU64::new(0),
            watches: AtomicU64::new(0),
            first: AtomicU64::new(0),
            after_watch: AtomicU64::new(0),
            woken: AtomicU64::new(0),
            next: Mutex::new(HashMap::new()),
            stall,
            watched: AtomicBool::new(false),
        }
    }

    fn set_next(&self, n: Option<Next>) -> Option<Next> {
        let id = tokio::task::try_id()?;
        let mut m = self.next.lock().unwrap();
        match n {
            Some(n) => m.insert(id, n),
            None => m.remove(&id),
        }
    }
}

impl Backend for Counting {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        self.tries.fetch_add(1, Ordering::Relaxed);
        match self.set_next(None) {
            Some(Next::First) => &self.first,
            Some(Next::AfterWatch) => &self.after_watch,
            Some(Next::QueuedFirst) | None => &self.woken,
        }
        .fetch_add(1, Ordering::Relaxed);
        Box::pin(async move {
            let r = self.inner.try_acquire(name, owner, ttl).await;
            match &r {
                Ok(Acquired::Granted { .. }) => self.granted.fetch_add(1, Ordering::Relaxed),
                Ok(Acquired::Busy { .. }) => self.busy.fetch_add(1, Ordering::Relaxed),
                Err(e) => {
                    // The 1st, 10th, 100th, ... error of the process, so that a run with many
                    // shows what they were, not only the first.
                    let n = self.errors.fetch_add(1, Ordering::Relaxed) + 1;
                    if n == 10u64.pow(n.ilog10()) {
                        eprintln!(
                            "handoff: try error #{n} of process {}: {e}",
                            std::process::id()
                        );
                    }
                    0
                }
            };
            if self.stall
                && matches!(r, Ok(Acquired::Busy { .. }))
                && self.watched.load(Ordering::Relaxed)
            {
                say("QUEUED");
                // Blocks the stalled process's only runtime thread until the parent stops it.
                std::thread::sleep(Duration::from_secs(600));
            }
            r
        })
    }
    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        self.inner.release(name, owner, keep_for, all)
    }
    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        self.inner.extend(name, owner, ttl)
    }
    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        self.watches.fetch_add(1, Ordering::Relaxed);
        let before = self.set_next(None);
        Box::pin(async move {
            let r = self.inner.watch(name).await;
            if let Ok(w) = &r {
                self.watched.store(true, Ordering::Relaxed);
                // The lock loop retries right after subscribing, except for a call that queued
                // first behind local waiters while a holder's lease is known to run on: that one
                // waits first (`Lock::acquire_loop`), so its next try comes after a wait.
                // (A backend that queues contenders on the server tries at once: it cannot barge.)
                let waits_first = matches!(before, Some(Next::QueuedFirst))
                    && !self.inner.queues_contenders()
                    && w.lease_end()
                        .is_some_and(|t| t > tokio::time::Instant::now());
                if !waits_first {
                    self.set_next(Some(Next::AfterWatch));
                }
            }
            r
        })
    }
    fn has_waiters(&self, name: &str) -> bool {
        let w = self.inner.has_waiters(name);
        if w {
            self.queued_first.fetch_add(1, Ordering::Relaxed);
            self.set_next(Some(Next::QueuedFirst));
        } else {
            self.set_next(Some(Next::First));
        }
        w
    }
    fn lease_margin(&self, ttl: Duration) -> Duration {
        self.inner.lease_margin(ttl)
    }
    fn queues_contenders(&self) -> bool {
        self.inner.queues_contenders()
    }
    fn fresh_owner_per_try(&self) -> bool {
        self.inner.fresh_owner_per_try()
    }
    fn lease_expires_by_ttl(&self) -> bool {
        self.inner.lease_expires_by_ttl()
    }
    fn lost_signal(&self, name: &str, owner: &str) -> Option<BoxFuture<'static, ()>> {
        self.inner.lost_signal(name, owner)
    }
}

// ---------------------------------------------------------------------------------------------
// Backends by engine name (parent and children)
// ---------------------------------------------------------------------------------------------

/// The session timeout the ZooKeeper backends ask for (the harness's server, tickTime 250 ms,
/// grants at most 20 ticks = 5 s).
#[cfg(feature = "zookeeper")]
const ZK_SESSION: Duration = Duration::from_secs(10);

async fn connect(engine: &str, urls: &[String], table: &str) -> Arc<dyn Backend> {
    let _ = table;
    let r: Result<Arc<dyn Backend>, LockError> = match engine {
        "redis" => dlock::RedisBackend::connect(&urls[0])
            .await
            .map(|b| Arc::new(b) as _),
        "redlock" => dlock::RedlockBackend::connect(urls)
            .await
            .map(|b| Arc::new(b) as _),
        #[cfg(feature = "sentinel")]
        "sentinel" => dlock::SentinelBackend::connect(common::sentinel::MASTER, urls)
            .await
            .map(|b| Arc::new(b) as _),
        #[cfg(feature = "cluster")]
        "cluster" => dlock::ClusterBackend::connect(urls)
            .await
            .map(|b| Arc::new(b) as _),
        #[cfg(feature = "postgres")]
        "postgres" | "pg-advisory" => dlock::PostgresBackend::builder(&urls[0])
            .table(table)
            .advisory(engine == "pg-advisory")
            .connect()
            .await
            .map(|b| Arc::new(b) as _),
        #[cfg(feature = "mysql")]
        "mysql" => dlock::MysqlBackend::builder(&urls[0])
            .table(table)
            .connect()
            .await
            .map(|b| Arc::new(b) as _),
        #[cfg(feature = "zookeeper")]
        "zookeeper" => dlock::ZookeeperBackend::builder(&urls[0])
            .session_timeout(ZK_SESSION)
            .build()
            .await
            .map(|b| Arc::new(b) as _),
        #[cfg(feature = "etcd")]
        "etcd" => dlock::EtcdBackend::builder(urls)
            .build()
            .await
            .map(|b| Arc::new(b) as _),
        other => panic!("unknown engine `{other}` (or its feature is off)"),
    };
    r.unwrap_or_else(|e| panic!("{engine}: connect: {e}"))
}

// ---------------------------------------------------------------------------------------------
// Children
// ---------------------------------------------------------------------------------------------

fn say(msg: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{LINE} {msg}");
    let _ = out.flush();
}

fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("child without {k}"))
}

fn read_counter(path: &std::path::Path) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

fn child(mode: &str) {
    let engine = env("DLOCK_HANDOFF_ENGINE");
    let urls: Vec<String> = env("DLOCK_HANDOFF_URLS")
        .split(' ')
        .map(String::from)
        .collect();
    let table = env("DLOCK_HANDOFF_TABLE");
    let name = env("DLOCK_HANDOFF_NAME");
    let dir = std::path::PathBuf::from(env("DLOCK_HANDOFF_DIR"));
    let proc_no: usize = env("DLOCK_HANDOFF_PROC").parse().unwrap();
    let total: u64 = env("DLOCK_HANDOFF_TOTAL").parse().unwrap();
    let stall = mode == "stall";
    // The stalled waiter blocks its only runtime thread on purpose (see `Counting`).
    let rt = if stall {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    };
    rt.block_on(async move {
        let counting = Arc::new(Counting::new(connect(&engine, &urls, &table).await, stall));
        let b: Arc<dyn Backend> = counting.clone();
        say("READY");
        let mut go = String::new();
        std::io::stdin().read_line(&mut go).unwrap();
        let mut it = go
            .split_whitespace()
            .skip(1)
            .map(|v| v.parse::<i64>().unwrap());
        let (start, deadline) = (it.next().unwrap(), it.next().unwrap());
        let lock = Lock::new(name.clone())
            .with_backend(b.clone())
            .ttl(TTL)
            .wait(WAIT);
        if stall {
            // Queue as a waiter behind the parent's hold (a grant, if the parent's hold is gone
            // already, is given back and tried again).
            for _ in 0..100 {
                counting.watched.store(false, Ordering::Relaxed);
                if let Ok(g) = Lock::new(name.clone())
                    .with_backend(b.clone())
                    .ttl(TTL)
                    .wait(Duration::from_secs(60))
                    .acquire()
                    .await
                {
                    let _ = g.release().await;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            say("NEVER-QUEUED");
            return;
        }
        tokio::time::sleep(Duration::from_micros((start - now_us()).max(0) as u64)).await;
        let counter = dir.join("counter");
        let lock = Arc::new(lock);
        let (timeouts, rel_errs) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let recs = Arc::new(Mutex::new(Vec::new()));
        let calls = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for i in 0..PER_PROC {
            let worker = proc_no * PER_PROC + i;
            let (lock, counter, timeouts, rel_errs, recs, calls) = (
                lock.clone(),
                counter.clone(),
                timeouts.clone(),
                rel_errs.clone(),
                recs.clone(),
                calls.clone(),
            );
            tasks.push(tokio::spawn(async move {
                while now_us() < deadline {
                    let t0 = now_us();
                    calls.fetch_add(1, Ordering::Relaxed);
                    let g = match lock.acquire().await {
                        Ok(g) => g,
                        Err(e) => {
                            if timeouts.fetch_add(1, Ordering::Relaxed) < 3 {
                                eprintln!("handoff worker {worker}: {e}");
                            }
                            continue;
                        }
                    };
                    let granted = now_us();
                    // The critical section: a read-modify-write of a file no lock but this one
                    // protects. Its value is also the run's ticket.
                    let v = read_counter(&counter);
                    tokio::task::yield_now().await;
                    let _ = std::fs::write(&counter, (v + 1).to_string());
                    if g.release().await.is_err() {
                        rel_errs.fetch_add(1, Ordering::Relaxed);
                    }
                    let released = now_us();
                    recs.lock().unwrap().push((worker, t0, granted, released));
                    if v + 1 >= total {
                        break;
                    }
                }
            }));
        }
        for t in tasks {
            let _ = t.await;
        }
        let recs = recs.lock().unwrap().clone();
        let mut text = String::new();
        for (w, a, g, r) in &recs {
            text.push_str(&format!("{w} {a} {g} {r}\n"));
        }
        std::fs::write(dir.join(format!("rec-{proc_no}")), text).unwrap();
        let c = &counting;
        say(&format!(
            "DONE {} {} {} {} {} {} {} {} {} {} {} {}",
            c.tries.load(Ordering::Relaxed),
            c.granted.load(Ordering::Relaxed),
            c.busy.load(Ordering::Relaxed),
            c.errors.load(Ordering::Relaxed),
            c.queued_first.load(Ordering::Relaxed),
            c.watches.load(Ordering::Relaxed),
            calls.load(Ordering::Relaxed),
            timeouts.load(Ordering::Relaxed),
            rel_errs.load(Ordering::Relaxed),
            c.first.load(Ordering::Relaxed),
            c.after_watch.load(Ordering::Relaxed),
            c.woken.load(Ordering::Relaxed),
        ));
    });
}

// ---------------------------------------------------------------------------------------------
// Parent: servers, counters
// ---------------------------------------------------------------------------------------------

/// Where an engine's servers are and how to read its server-side call counter.
struct Setup {
    urls: Vec<String>,
    table: String,
    /// The longest a hand-off may stall when a waiter stops (the engine's wake-up bound), why.
    bound: Duration,
    bound_why: String,
    calls_what: &'static str,
    calls: Box<dyn Fn(&tokio::runtime::Runtime) -> u64>,
    _keep: Vec<Box<dyn std::any::Any>>,
}

/// Commands that dlock's Lua scripts run and that it never sends itself: `INFO commandstats`
/// counts them too, so they are left out (a script run counts once, as its `EVALSHA`).
const SCRIPT_CALLS: &[&str] = &[
    "del", "hexists", "hget", "hincrby", "hset", "pexpire", "pttl", "set", "time", "publish",
    "spublish",
];

fn redis_calls(ports: &[u16]) -> u64 {
    ports
        .iter()
        .map(|p| {
            let mut c = redis::Client::open(format!("redis://127.0.0.1:{p}/"))
                .unwrap()
                .get_connection_with_timeout(Duration::from_secs(5))
                .expect("admin connection");
            let info: String = redis::cmd("INFO")
                .arg("commandstats")
                .query(&mut c)
                .expect("INFO commandstats");
            common::parse_commandstats(&info)
                .iter()
                .filter(|(k, _)| !k.starts_with("info") && !SCRIPT_CALLS.contains(&k.as_str()))
                .map(|(_, v)| v)
                .sum::<u64>()
        })
        .sum()
}

fn redis_setup(ports: Vec<u16>, urls: Vec<String>, keep: Vec<Box<dyn std::any::Any>>) -> Setup {
    Setup {
        urls,
        table: String::new(),
        bound: Duration::from_millis(100),
        bound_why: "the stall timer (STALL_AFTER): a release wakes the queue's head only; when \
                    it does not try within 100 ms, the server passes its turn to the next process"
            .into(),
        calls_what: "Redis commands sent (INFO commandstats, script-internal calls left out)",
        calls: Box::new(move |_: &tokio::runtime::Runtime| redis_calls(&ports)),
        _keep: keep,
    }
}

#[cfg(feature = "etcd")]
fn etcd_msgs(port: u16) -> u64 {
    use std::io::Read as _;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("etcd /metrics");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.lines()
        .filter(|l| l.starts_with("grpc_server_msg_received_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn setup(engine: &str, rt: &tokio::runtime::Runtime) -> Setup {
    let table = format!("dlock_bench_handoff_{}", std::process::id());
    match engine {
        "redis" => {
            let s = common::RedisProc::start();
            redis_setup(vec![s.port()], vec![s.url()], vec![Box::new(s)])
        }
        "redlock" => {
            let nodes = common::redlock::start_nodes(3);
            // A node whose server started less than the restart delay ago (default: the longest
            // ttl in use, 10 s here) is not counted toward quorums: without this wait, the first
            // ~10 s of the run are tries failing with "no quorum" (and their clean-ups' wake-ups),
            // a start-up artifact that earlier runs of this bench measured as part of the herd.
            rt.block_on(common::redlock::wait_uptime(&nodes, TTL.as_secs() + 1));
            let ports = nodes.iter().map(|n| n.port()).collect();
            let urls = common::redlock::urls(&nodes);
            redis_setup(ports, urls, vec![Box::new(nodes)])
        }
        #[cfg(feature = "sentinel")]
        "sentinel" => {
            let set = common::sentinel::SentinelSet::start(false);
            let port = set.master.as_ref().unwrap().port();
            let urls = set.sentinel_urls();
            let mut s = redis_setup(vec![port], urls, vec![Box::new(set)]);
            s.calls_what = "Redis commands sent to the master (INFO commandstats, script-internal calls left out)";
            s
        }
        #[cfg(feature = "cluster")]
        "cluster" => {
            let set = common::cluster::ClusterSet::start(3, 0);
            let ports = set.nodes.iter().map(|n| n.port()).collect();
            let urls = set.urls();
            let mut s = redis_setup(ports, urls, vec![Box::new(set)]);
            s.calls_what = "Redis commands sent to the 3 masters (INFO commandstats, script-internal calls left out)";
            s
        }
        #[cfg(feature = "postgres")]
        "postgres" | "pg-advisory" => {
            let pg = common::sql::PgProc::start();
            let url = pg.url();
            let admin_url = url.clone();
            let advisory = engine == "pg-advisory";
            Setup {
                urls: vec![url],
                table,
                bound: if advisory {
                    Duration::from_secs(1)
                } else {
                    Duration::from_millis(1500)
                },
                bound_why: if advisory {
                    "1 s: a release notifies the head of the waiters' FIFO only; a name found free \
                     at two 500 ms re-checks (pg_locks) in a row wakes a waiter in each process"
                        .into()
                } else {
                    "1.5 s: a release notifies the head of the waiters' FIFO only; a silent head \
                     (heartbeat under 5 s old) is covered by the others' heartbeat once the name \
                     has been free 0.5 s, then skipped"
                        .into()
                },
                calls_what: "PostgreSQL transactions (pg_stat_database commit+rollback)",
                calls: Box::new(move |rt: &tokio::runtime::Runtime| {
                    rt.block_on(async {
                        let c = common::sql::pg_admin(&admin_url).await;
                        let row = c
                            .query_one(
                                "SELECT (xact_commit + xact_rollback)::bigint FROM \
                                 pg_stat_database WHERE datname = current_database()",
                                &[],
                            )
                            .await
                            .expect("pg_stat_database");
                        row.get::<_, i64>(0) as u64
                    })
                }),
                _keep: vec![Box::new(pg)],
            }
        }
        #[cfg(feature = "mysql")]
        "mysql" => {
            let my = common::sql::MyProc::start();
            let url = my.url();
            let admin_url = url.clone();
            Setup {
                urls: vec![url],
                table,
                bound: Duration::from_millis(250),
                bound_why: "250 ms: one poller per name and process reads the row every 100-250 ms"
                    .into(),
                calls_what: "MySQL statements (SHOW GLOBAL STATUS Questions)",
                calls: Box::new(move |rt: &tokio::runtime::Runtime| {
                    use dlock::mysql_async::prelude::Queryable;
                    rt.block_on(async {
                        let mut c = common::sql::my_admin(&admin_url).await;
                        let row: Option<(String, String)> = c
                            .query_first("SHOW GLOBAL STATUS LIKE 'Questions'")
                            .await
                            .expect("SHOW GLOBAL STATUS");
                        let _ = c.disconnect().await;
                        row.and_then(|(_, v)| v.parse().ok()).unwrap_or(0)
                    })
                }),
                _keep: vec![Box::new(my)],
            }
        }
        #[cfg(feature = "zookeeper")]
        "zookeeper" => {
            let zk = common::zookeeper::ZkProc::start();
            let port = zk.port();
            let hosts = zk.hosts();
            let granted = rt.block_on(async {
                dlock::ZookeeperBackend::builder(&hosts)
                    .session_timeout(ZK_SESSION)
                    .build()
                    .await
                    .expect("zookeeper backend")
                    .session_timeout()
            });
            Setup {
                urls: vec![hosts],
                table,
                bound: granted,
                bound_why: format!(
                    "session timeout ({granted:?} granted of {ZK_SESSION:?} asked): a stopped \
                     waiter's node holds the lock once its predecessor goes, until its session expires"
                ),
                calls_what: "ZooKeeper packets received (mntr)",
                calls: Box::new(move |_: &tokio::runtime::Runtime| {
                    common::zookeeper::four_letter(port, "mntr")
                        .and_then(|m| {
                            m.lines()
                                .find_map(|l| l.strip_prefix("zk_packets_received"))
                                .and_then(|v| v.trim().parse().ok())
                        })
                        .expect("mntr zk_packets_received")
                }),
                _keep: vec![Box::new(zk)],
            }
        }
        #[cfg(feature = "etcd")]
        "etcd" => {
            let etcd = common::etcd::EtcdCluster::single();
            let endpoints = etcd.endpoints();
            let port: u16 = endpoints[0].rsplit(':').next().unwrap().parse().unwrap();
            Setup {
                urls: endpoints,
                table,
                bound: TTL,
                bound_why: "lease ttl (ceil(ttl) = 10 s): a stopped waiter's key holds the lock \
                            once its predecessor goes, until its lease expires"
                    .into(),
                calls_what: "etcd gRPC messages received (/metrics)",
                calls: Box::new(move |_: &tokio::runtime::Runtime| etcd_msgs(port)),
                _keep: vec![Box::new(etcd)],
            }
        }
        other => panic!("unknown engine `{other}` (or its feature is off)"),
    }
}

// ---------------------------------------------------------------------------------------------
// Parent: one run
// ---------------------------------------------------------------------------------------------

struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Proc {
    fn spawn(
        mode: &str,
        engine: &str,
        s: &Setup,
        name: &str,
        dir: &std::path::Path,
        k: usize,
        total: u64,
    ) -> Proc {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.env(CHILD_ENV, mode)
            .env("DLOCK_HANDOFF_ENGINE", engine)
            .env("DLOCK_HANDOFF_URLS", s.urls.join(" "))
            .env("DLOCK_HANDOFF_TABLE", &s.table)
            .env("DLOCK_HANDOFF_NAME", name)
            .env("DLOCK_HANDOFF_DIR", dir)
            .env("DLOCK_HANDOFF_PROC", k.to_string())
            .env("DLOCK_HANDOFF_TOTAL", total.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = common::spawn_child(cmd).expect("re-execute the bench");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix(LINE)
                    && tx.send(rest.trim().to_string()).is_err()
                {
                    break;
                }
            }
        });
        Proc { child, lines: rx }
    }

    fn expect(&self, what: &str, limit: Duration) -> String {
        let line = self.lines.recv_timeout(limit).unwrap_or_else(|e| {
            panic!("child {}: no {what} within {limit:?}: {e}", self.child.id())
        });
        assert!(line.starts_with(what), "child {}: {line}", self.child.id());
        line
    }

    fn send(&mut self, line: &str) {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    /// Sends `sig` to the child unless it has exited (once reaped, its pid may be reused).
    fn signal(&mut self, sig: libc::c_int) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // SAFETY: kill(2) on a child this process spawned and has not reaped.
            unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug, Default)]
struct Row {
    acq: usize,
    counter: u64,
    secs: f64,
    cross: Vec<i64>,
    same: usize,
    max_gap: i64,
    worst_wait: i64,
    min_w: usize,
    max_w: usize,
    calls: u64,
    tries: u64,
    first_tries: u64,
    busy: u64,
    try_errors: u64,
    timeouts: u64,
    rel_errors: u64,
    stopped: Option<Duration>,
    cross_proc: usize,
    kind_first: u64,
    kind_after_watch: u64,
    kind_woken: u64,
    long_gaps: usize,
}

fn pct(sorted: &[i64], q: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn run(engine: &str, s: &Setup, stalled: bool, rt: &tokio::runtime::Runtime) -> Row {
    let total = env_num("DLOCK_BENCH_ACQ", 2000);
    let secs = env_num("DLOCK_BENCH_SECS", 20);
    let variant = if stalled { "stall" } else { "plain" };
    let dir = common::TempDir::new("handoff");
    let name = format!("bench:handoff:{engine}:{variant}");
    let mut workers: Vec<Proc> = (0..PROCS)
        .map(|k| Proc::spawn("worker", engine, s, &name, dir.path(), k, total))
        .collect();
    let mut staller =
        stalled.then(|| Proc::spawn("stall", engine, s, &name, dir.path(), PROCS, total));
    for p in workers.iter().chain(staller.iter()) {
        p.expect("READY", Duration::from_secs(60));
    }
    let before = (s.calls)(rt);
    let mut row = Row::default();
    // The stalled variant: the parent holds the name while the 5th process queues behind it and
    // is stopped; the workers start and queue too; then the parent releases (a hand-off, recorded
    // as a 17th "worker").
    let mut parent = None;
    if let Some(st) = &mut staller {
        let b = rt.block_on(connect(engine, &s.urls, &s.table));
        let t0 = now_us();
        let r = rt.block_on(b.try_acquire(&name, "bench-parent", TTL));
        assert!(
            matches!(r, Ok(Acquired::Granted { .. })),
            "{engine}: parent's hold: {r:?}"
        );
        let granted = now_us();
        st.send(&format!("GO {granted} {granted}"));
        let line = st
            .lines
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| "nothing".into());
        if line == "QUEUED" {
            st.signal(libc::SIGSTOP);
            row.stopped = Some(Duration::ZERO);
        } else {
            eprintln!("{engine}: the stalled waiter did not queue ({line})");
        }
        parent = Some((b, t0, granted));
    }
    let start = now_us() + 200_000;
    let deadline = start + secs as i64 * 1_000_000;
    for p in workers.iter_mut() {
        p.send(&format!("GO {start} {deadline}"));
    }
    let mut parent_rec = None;
    if let Some((b, t0, granted)) = &parent {
        std::thread::sleep(Duration::from_micros(
            (start - now_us()).max(0) as u64 + 300_000,
        ));
        let r = rt.block_on(b.release(&name, "bench-parent", None, true));
        assert!(
            matches!(r, Ok(Released::Freed)),
            "{engine}: parent's release: {r:?}"
        );
        parent_rec = Some((PROCS * PER_PROC, *t0, *granted, now_us()));
    }
    let stop_at = Instant::now();
    let mut done = Vec::new();
    for p in &workers {
        done.push(p.expect("DONE", Duration::from_secs(secs + 60)));
    }
    let end_us = now_us();
    if row.stopped.is_some() {
        row.stopped = Some(stop_at.elapsed());
    }
    if let Some(mut st) = staller.take() {
        st.signal(libc::SIGCONT);
        let _ = st.child.kill();
        let _ = st.child.wait();
    }
    for mut p in workers.drain(..) {
        let _ = p.child.wait();
    }
    drop(parent);
    // PostgreSQL counts a session's transactions when it ends.
    std::thread::sleep(Duration::from_millis(1500));
    row.calls = (s.calls)(rt).saturating_sub(before);
    for d in &done {
        let v: Vec<u64> = d
            .split_whitespace()
            .skip(1)
            .map(|x| x.parse().unwrap())
            .collect();
        // tries granted busy errors queued_first watches calls timeouts rel_errs
        row.tries += v[0];
        row.busy += v[2];
        row.try_errors += v[3];
        row.first_tries += v[6] - v[4];
        row.timeouts += v[7];
        row.rel_errors += v[8];
        row.kind_first += v[9];
        row.kind_after_watch += v[10];
        row.kind_woken += v[11];
    }
    let mut recs: Vec<(usize, i64, i64, i64)> = Vec::new();
    for k in 0..PROCS {
        let text = std::fs::read_to_string(dir.path().join(format!("rec-{k}"))).unwrap_or_default();
        for l in text.lines() {
            let v: Vec<i64> = l.split_whitespace().map(|x| x.parse().unwrap()).collect();
            recs.push((v[0] as usize, v[1], v[2], v[3]));
        }
    }
    recs.extend(parent_rec);
    recs.sort_by_key(|r| r.2);
    row.acq = recs.len() - usize::from(parent_rec.is_some());
    row.counter = read_counter(&dir.path().join("counter"));
    if let (Some(f), Some(l)) = (recs.first(), recs.iter().map(|r| r.3).max()) {
        row.secs = (l - f.2) as f64 / 1e6;
    }
    // The time nobody held the name while workers wanted it: between a release and the next
    // grant, and from the last release (or the start) to the end of the run.
    let last = recs.iter().map(|r| r.3).max().unwrap_or(start);
    row.max_gap = end_us - last;
    row.long_gaps = usize::from(row.max_gap >= 1_000_000);
    for w in recs.windows(2) {
        let gap = (w[1].2 - w[0].3).max(0);
        row.max_gap = row.max_gap.max(gap);
        row.long_gaps += usize::from(gap >= 1_000_000);
        if w[0].0 != w[1].0 {
            row.cross.push(gap);
            if w[0].0 / PER_PROC != w[1].0 / PER_PROC {
                row.cross_proc += 1;
            }
        } else {
            row.same += 1;
        }
    }
    row.cross.sort();
    row.worst_wait = recs.iter().map(|r| r.2 - r.1).max().unwrap_or(0);
    let mut per = [0usize; PROCS * PER_PROC];
    for r in &recs {
        if let Some(n) = per.get_mut(r.0) {
            *n += 1;
        }
    }
    row.min_w = per.iter().copied().min().unwrap_or(0);
    row.max_w = per.iter().copied().max().unwrap_or(0);
    row
}

fn ms(us: i64) -> String {
    if us < 10_000 {
        format!("{:.2} ms", us as f64 / 1000.0)
    } else {
        format!("{:.0} ms", us as f64 / 1000.0)
    }
}

fn print_row(engine: &str, s: &Setup, stalled: bool, r: &Row) {
    let per_rel = |x: f64| x / r.acq.max(1) as f64;
    let wake = per_rel(r.kind_woken as f64);
    let stall_ok = if stalled {
        if r.stopped.is_none() {
            "stall: waiter never queued".to_string()
        } else {
            let pass = r.max_gap <= 2 * s.bound.as_micros() as i64;
            format!(
                "stall ≤ 2×{}: {}",
                ms(s.bound.as_micros() as i64),
                if pass { "PASS" } else { "FAIL" }
            )
        }
    } else {
        String::new()
    };
    println!(
        "| {engine} | {} | {} in {:.1} s | {} | {} | {} ({} ≥ 1 s) | {} | {}/{} | {:.1} | {:.2} | {:.2} | {} | {} | wake ≤ 1.5: {}{}{} |",
        if stalled {
            "stalled waiter"
        } else {
            "16 workers"
        },
        r.acq,
        r.secs,
        ms(pct(&r.cross, 0.5)),
        ms(pct(&r.cross, 0.99)),
        ms(r.max_gap),
        r.long_gaps,
        ms(r.worst_wait),
        r.min_w,
        r.max_w,
        per_rel(r.calls as f64),
        wake,
        per_rel(r.busy as f64),
        r.timeouts,
        r.acq as i64 - r.counter as i64,
        if wake <= 1.5 { "PASS" } else { "FAIL" },
        if stalled { "; " } else { "" },
        stall_ok,
    );
    eprintln!(
        "  {engine} {}: {} cross hand-offs ({} cross-process), {} same-worker re-grants; tries {}: {} first, {} right after subscribing, {} after a wait; (tries - first tries)/releases {:.2}; busy {}, try errors {}, release errors {}, counter {}{}; {}",
        if stalled { "stalled" } else { "plain" },
        r.cross.len(),
        r.cross_proc,
        r.same,
        r.tries,
        r.kind_first,
        r.kind_after_watch,
        r.kind_woken,
        per_rel(r.tries.saturating_sub(r.first_tries) as f64),
        r.busy,
        r.try_errors,
        r.rel_errors,
        r.counter,
        r.stopped
            .map(|d| format!(", waiter stopped for {:.1} s", d.as_secs_f64()))
            .unwrap_or_default(),
        s.calls_what,
    );
}

fn main() {
    if let Ok(mode) = std::env::var(CHILD_ENV) {
        child(&mode);
        return;
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut picked: Vec<String> = std::env::var("DLOCK_BENCH_ENGINE")
        .map(|v| v.split(',').map(String::from).collect())
        .unwrap_or_default();
    for (i, a) in args.iter().enumerate() {
        if a == "--engine"
            && let Some(v) = args.get(i + 1)
        {
            picked.extend(v.split(',').map(String::from));
        }
    }
    let engines: Vec<&str> = all_engines()
        .into_iter()
        .filter(|e| picked.is_empty() || picked.iter().any(|p| p == e))
        .collect();
    let variant = std::env::var("DLOCK_BENCH_VARIANT").unwrap_or_else(|_| "both".into());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "dlock handoff_bench: {PROCS} processes x {PER_PROC} workers, one name, ttl {TTL:?}, wait {WAIT:?}, up to {} acquisitions or {} s per run; engines {engines:?}; loadavg {}",
        env_num("DLOCK_BENCH_ACQ", 2000),
        env_num("DLOCK_BENCH_SECS", 20),
        load.trim()
    );
    println!(
        "| engine | variant | acquisitions | hand-off p50 | p99 | max gap | worst wait | per worker min/max | server calls/acq | wake-ups/release | busy tries/acq | timeouts | lost updates | targets |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for engine in engines {
        let t = Instant::now();
        let s = setup(engine, &rt);
        // Schema, root nodes, script cache: made once, before the children race for them.
        rt.block_on(async {
            let b = connect(engine, &s.urls, &s.table).await;
            if let Ok(Acquired::Granted { .. }) =
                b.try_acquire("bench:handoff:warm", "warm", TTL).await
            {
                let _ = b.release("bench:handoff:warm", "warm", None, true).await;
            }
        });
        for stalled in [false, true] {
            if (stalled && variant == "plain") || (!stalled && variant == "stall") {
                continue;
            }
            let r = run(engine, &s, stalled, &rt);
            print_row(engine, &s, stalled, &r);
        }
        eprintln!(
            "  {engine}: wake-up bound {:?} ({}); {:.0} s with server start; loadavg {}",
            s.bound,
            s.bound_why,
            t.elapsed().as_secs_f64(),
            std::fs::read_to_string("/proc/loadavg")
                .unwrap_or_default()
                .trim()
        );
    }
}
