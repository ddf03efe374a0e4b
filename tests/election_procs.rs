//! The election across processes (issue 22, item 4): candidates are child processes (this test
//! binary re-executed, `election_child_process`), each running `Election::run` on its own client
//! of the lock server, reached through a fault proxy of its own (`tests/common/proxy.rs`). A
//! leader's body writes, every 20 ms, an epoch-fenced record to a shared store (a second private
//! redis-server, reached directly): a Lua script appends every attempt to `attempts` in server
//! order, refuses an epoch below the largest seen, and appends the accepted ones to `accepted`.
//! Each child logs, on the host's `CLOCK_MONOTONIC`, when it leads (`lead E`), before each write
//! (`sent E`), when the write returned (`wrote E`), when its body was dropped (`end E`) and when
//! it resigns.
//!
//! The faults: SIGKILL of the leader, SIGSTOP of the leader past its lease (then SIGCONT), a
//! blackhole between the leader and the lock server (its store connection stays up, so a leader
//! that went on working would be seen), and `resign`. The properties, on Redis, etcd, ZooKeeper
//! and PostgreSQL (table mode):
//! * one leader at a time: in the store's own order, no write attempt carries an epoch below one
//!   already attempted (no write of an old leader after a new leader's first), except the one
//!   write a paused leader had queued before it was stopped, which the store's fence refuses;
//!   no stale write accepted;
//! * the faulty leader is replaced within its engine's bound (the lease, or session, ttl plus a
//!   slack that only catches hangs), and its body was dropped: at its own deadline for a
//!   partitioned leader (before the new leader began), at once on waking for a paused one (no
//!   write sent after the SIGCONT);
//! * an observer (`Election::observe`, in this process, a client of its own) sees every term, in
//!   epoch order, with its value (engines with leader records);
//! * `resign` hands over at once (well under the ttl that a mere expiry would take).
//!
//! Each test fails without the loss cancellation of `Election::run` (checked by running the body
//! without the `lost` arm of its `select!`): the paused and partitioned leaders go on writing
//! with their old epoch.

mod common;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::proxy::{Mode, Proxy};
use common::{ChildProc, RedisProc, TempDir, spawn_self};
use dlock::{Backend, Election, LockError};

const CHILD_ENTRY: &str = "election_child_process";
const NAME: &str = "procs";

/// `CLOCK_MONOTONIC` in ns: one clock for every process on the host.
fn mono() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The fenced write: every attempt is logged in server order; an epoch below the largest seen is
/// refused (0), else accepted (1) and logged as such.
const FENCED_WRITE: &str = r"
redis.call('RPUSH', KEYS[2], ARGV[1] .. ' ' .. ARGV[2])
local m = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) < m then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[3], ARGV[1] .. ' ' .. ARGV[2])
return 1";

// ---------------------------------------------------------------------------------------------
// Engines
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    Redis,
    #[cfg(feature = "etcd")]
    Etcd,
    #[cfg(feature = "zookeeper")]
    Zookeeper,
    #[cfg(feature = "postgres")]
    Postgres,
}

impl Engine {
    fn as_str(self) -> &'static str {
        match self {
            Engine::Redis => "redis",
            #[cfg(feature = "etcd")]
            Engine::Etcd => "etcd",
            #[cfg(feature = "zookeeper")]
            Engine::Zookeeper => "zookeeper",
            #[cfg(feature = "postgres")]
            Engine::Postgres => "postgres",
        }
    }

    fn parse(s: &str) -> Engine {
        match s {
            #[cfg(feature = "etcd")]
            "etcd" => Engine::Etcd,
            #[cfg(feature = "zookeeper")]
            "zookeeper" => Engine::Zookeeper,
            #[cfg(feature = "postgres")]
            "postgres" => Engine::Postgres,
            _ => Engine::Redis,
        }
    }
}

/// A private lock server (PostgreSQL: the shared test server, with a table of this test's own).
enum LockServer {
    Redis(RedisProc),
    #[cfg(feature = "etcd")]
    Etcd(common::etcd::EtcdCluster),
    #[cfg(feature = "zookeeper")]
    Zookeeper(common::zookeeper::ZkProc),
    #[cfg(feature = "postgres")]
    Postgres(String),
}

impl LockServer {
    fn start(engine: Engine) -> LockServer {
        match engine {
            Engine::Redis => LockServer::Redis(RedisProc::start()),
            #[cfg(feature = "etcd")]
            Engine::Etcd => LockServer::Etcd(common::etcd::EtcdCluster::single()),
            #[cfg(feature = "zookeeper")]
            Engine::Zookeeper => LockServer::Zookeeper(common::zookeeper::ZkProc::start()),
            #[cfg(feature = "postgres")]
            Engine::Postgres => LockServer::Postgres(common::sql::pg_url()),
        }
    }

    /// The server's TCP port (what the proxies forward to).
    fn port(&self) -> u16 {
        match self {
            LockServer::Redis(r) => r.port(),
            #[cfg(feature = "etcd")]
            LockServer::Etcd(c) => c.members[0].client_port(),
            #[cfg(feature = "zookeeper")]
            LockServer::Zookeeper(z) => z.port(),
            #[cfg(feature = "postgres")]
            LockServer::Postgres(url) => pg_port(url),
        }
    }

    /// What a child connects to through the proxy on `port`.
    fn url_via(&self, port: u16) -> String {
        match self {
            LockServer::Redis(_) => format!("redis://127.0.0.1:{port}"),
            #[cfg(feature = "etcd")]
            LockServer::Etcd(_) => format!("127.0.0.1:{port}"),
            #[cfg(feature = "zookeeper")]
            LockServer::Zookeeper(_) => format!("127.0.0.1:{port}"),
            #[cfg(feature = "postgres")]
            LockServer::Postgres(url) => {
                let p = pg_port(url);
                url.replacen(&format!(":{p}/"), &format!(":{port}/"), 1)
            }
        }
    }

    /// What the observer (in this process) connects to, directly.
    fn direct_url(&self) -> String {
        self.url_via(self.port())
    }
}

#[cfg(feature = "postgres")]
fn pg_port(url: &str) -> u16 {
    // postgres://user@host:PORT/db
    url.rsplit_once(':')
        .and_then(|(_, rest)| rest.split('/').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or(5432)
}

/// The SQL table of this run (one per test, so that runs never share rows).
fn table_of(tag: &str) -> String {
    let tag: String = tag
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("dlock_elect_{tag}_{}", std::process::id())
}

/// A backend for `engine` at `url`, whose lease (or session) is `ttl`.
async fn connect(
    engine: Engine,
    url: &str,
    ttl: Duration,
    table: &str,
) -> Result<Arc<dyn Backend>, LockError> {
    let _ = (ttl, table);
    Ok(match engine {
        Engine::Redis => Arc::new(dlock::RedisBackend::connect(url).await?),
        #[cfg(feature = "etcd")]
        Engine::Etcd => Arc::new(
            dlock::EtcdBackend::builder(&[url.to_string()])
                .request_timeout(Duration::from_secs(1))
                .build()
                .await?,
        ),
        #[cfg(feature = "zookeeper")]
        Engine::Zookeeper => Arc::new(
            dlock::ZookeeperBackend::builder(url)
                .session_timeout(ttl)
                .build()
                .await?,
        ),
        #[cfg(feature = "postgres")]
        Engine::Postgres => Arc::new(
            dlock::PostgresBackend::builder(url)
                .table(table)
                .connect()
                .await?,
        ),
    })
}

// ---------------------------------------------------------------------------------------------
// The child: one candidate
// ---------------------------------------------------------------------------------------------

/// Child entry point: a no-op unless re-executed by `spawn_self`.
#[test]
#[ignore = "the entry point of the child processes"]
fn election_child_process() {
    if common::child_mode().is_none() {
        return;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(child_main());
}

struct Log(Mutex<std::fs::File>);

impl Log {
    fn line(&self, s: String) {
        let mut f = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let _ = f.write_all(format!("{s}\n").as_bytes());
    }
}

/// Logs `end E t` when the body is dropped (returned, or cancelled by `run` on loss).
struct EndMarker(Arc<Log>, u64);

impl Drop for EndMarker {
    fn drop(&mut self) {
        self.0.line(format!("end {} {}", self.1, mono()));
    }
}

fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} unset"))
}

async fn child_main() {
    let engine = Engine::parse(&env("EL_ENGINE"));
    let ttl = Duration::from_millis(env("EL_TTL_MS").parse().unwrap());
    let id = env("EL_ID");
    let log = Arc::new(Log(Mutex::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(env("EL_LOG"))
            .expect("open the child's log"),
    )));
    let backend = {
        let mut tries = 0;
        loop {
            match connect(engine, &env("EL_URL"), ttl, &env("EL_TABLE")).await {
                Ok(b) => break b,
                Err(e) if tries < 50 => {
                    tries += 1;
                    log.line(format!("connect_retry {e}"));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("cannot connect: {e}"),
            }
        }
    };
    let store = redis::Client::open(env("EL_STORE"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("connect to the store");
    log.line(format!("hello {} {}", std::process::id(), mono()));
    let election = Election::new(NAME)
        .ttl(ttl)
        .value(id.clone())
        .with_backend(backend);
    loop {
        let r = election
            .run(|term| {
                let (log, mut store, id) = (log.clone(), store.clone(), id.clone());
                async move {
                    let epoch = term.epoch();
                    log.line(format!("lead {epoch} {}", mono()));
                    let _end = EndMarker(log.clone(), epoch);
                    let mut seq = 0u64;
                    loop {
                        let req: Option<u64> = redis::cmd("GET")
                            .arg("resign")
                            .query_async(&mut store)
                            .await
                            .ok()
                            .flatten();
                        if req == Some(epoch) {
                            log.line(format!("resign {epoch} {}", mono()));
                            let r = term.resign().await;
                            log.line(format!("resigned {epoch} {} {}", mono(), r.is_ok()));
                            return;
                        }
                        log.line(format!("sent {epoch} {seq} {}", mono()));
                        let ok: redis::RedisResult<i64> = redis::Script::new(FENCED_WRITE)
                            .key("max")
                            .key("attempts")
                            .key("accepted")
                            .arg(epoch)
                            .arg(format!("{id}:{seq}"))
                            .invoke_async(&mut store)
                            .await;
                        log.line(format!(
                            "wrote {epoch} {seq} {} {}",
                            mono(),
                            ok.map(|v| v.to_string()).unwrap_or_else(|_| "err".into())
                        ));
                        seq += 1;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            })
            .await;
        match r {
            // Resigned: step aside for a moment. A candidate that campaigns again at once can
            // take the free name before the woken next candidate's try arrives (the Redis
            // family's queue orders wake-ups, not grants), and would lead again.
            Ok(()) => tokio::time::sleep(Duration::from_millis(500)).await,
            Err(e) => {
                log.line(format!("run_err {e}"));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The parent: a run of candidates and its checks
// ---------------------------------------------------------------------------------------------

/// A write in the store's logs: (epoch, writer:seq).
type Write = (u64, String);

#[derive(Debug, Clone)]
struct Ev {
    child: usize,
    kind: String,
    epoch: u64,
    t: u64,
    rest: Vec<String>,
}

struct Run {
    engine: Engine,
    ttl: Duration,
    server: LockServer,
    store: RedisProc,
    dir: TempDir,
    proxies: Vec<Proxy>,
    children: Vec<Option<ChildProc>>,
    observed: Arc<Mutex<Vec<(String, u64)>>>,
    /// False when the engine keeps no leader record (observe's one item is a `Config` error).
    records: Arc<Mutex<Option<bool>>>,
    observer: Option<tokio::task::JoinHandle<()>>,
}

impl Run {
    async fn start(engine: Engine, ttl: Duration, n: usize, tag: &str) -> Run {
        let server = LockServer::start(engine);
        let store = RedisProc::start();
        let dir = TempDir::new(&format!("elect-{tag}"));
        let table = table_of(tag);
        let mut run = Run {
            engine,
            ttl,
            server,
            store,
            dir,
            proxies: Vec::new(),
            children: Vec::new(),
            observed: Arc::new(Mutex::new(Vec::new())),
            records: Arc::new(Mutex::new(None)),
            observer: None,
        };
        // The observer: a client of its own, reading every 50 ms.
        let backend = connect(engine, &run.server.direct_url(), ttl, &table)
            .await
            .expect("observer backend");
        let mut obs = Election::new(NAME)
            .with_backend(backend)
            .observe_every(Duration::from_millis(50))
            .observe();
        let (seen, records) = (run.observed.clone(), run.records.clone());
        run.observer = Some(tokio::spawn(async move {
            while let Some(item) = obs.next().await {
                match item {
                    Ok(l) => {
                        *records.lock().unwrap() = Some(true);
                        seen.lock().unwrap().push((l.value, l.epoch));
                    }
                    Err(LockError::Config(_)) => {
                        *records.lock().unwrap() = Some(false);
                        return;
                    }
                    // A read error is an item; the stream goes on.
                    Err(_) => {}
                }
            }
        }));
        for i in 0..n {
            let proxy = Proxy::start(run.server.port());
            let url = run.server.url_via(proxy.port());
            let child = spawn_self(
                CHILD_ENTRY,
                "candidate",
                &[
                    ("EL_ENGINE", engine.as_str().to_string()),
                    ("EL_TTL_MS", ttl.as_millis().to_string()),
                    ("EL_ID", format!("c{i}")),
                    ("EL_LOG", run.log_path(i).display().to_string()),
                    ("EL_URL", url),
                    ("EL_STORE", run.store.url()),
                    ("EL_TABLE", table.clone()),
                ],
            );
            run.proxies.push(proxy);
            run.children.push(Some(child));
            // Arrival order is the campaign order.
            run.wait_for(Duration::from_secs(30), |evs| {
                evs.iter().any(|e| e.child == i && e.kind == "hello")
            })
            .await;
        }
        run
    }

    fn log_path(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("c{i}.log"))
    }

    fn events(&self) -> Vec<Ev> {
        let mut out = Vec::new();
        for i in 0..self.children.len() {
            out.extend(read_log(&self.log_path(i), i));
        }
        out.sort_by_key(|e| e.t);
        out
    }

    /// Polls the logs until `cond` holds (bounded: a hang is a failure).
    async fn wait_for(&self, limit: Duration, mut cond: impl FnMut(&[Ev]) -> bool) -> Vec<Ev> {
        let end = tokio::time::Instant::now() + limit;
        loop {
            let evs = self.events();
            if cond(&evs) {
                return evs;
            }
            assert!(
                tokio::time::Instant::now() < end,
                "[{}] condition not met within {limit:?}; events:\n{}",
                self.engine.as_str(),
                tail(&evs)
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The first term with an epoch above `after`: (child, epoch, t).
    async fn leader_after(&self, after: u64, limit: Duration) -> (usize, u64, u64) {
        let evs = self
            .wait_for(limit, |evs| {
                evs.iter().any(|e| e.kind == "lead" && e.epoch > after)
            })
            .await;
        let e = evs
            .iter()
            .find(|e| e.kind == "lead" && e.epoch > after)
            .unwrap();
        (e.child, e.epoch, e.t)
    }

    /// Waits until term `epoch` has had `n` writes accepted.
    async fn writes(&self, epoch: u64, n: usize) {
        self.wait_for(Duration::from_secs(20), |evs| {
            evs.iter()
                .filter(|e| {
                    e.kind == "wrote" && e.epoch == epoch && e.rest.get(1).is_some_and(|v| v == "1")
                })
                .count()
                >= n
        })
        .await;
    }

    fn pid(&self, i: usize) -> u32 {
        self.children[i].as_ref().expect("alive").pid()
    }

    fn signal(&self, i: usize, sig: libc::c_int) {
        // SAFETY: kill(2) on a child this test spawned and has not reaped.
        let r = unsafe { libc::kill(self.pid(i) as libc::pid_t, sig) };
        assert_eq!(r, 0, "kill: {}", std::io::Error::last_os_error());
    }

    /// The store's write attempts and accepted writes, in server order, read in one
    /// transaction (the leaders go on writing): (epoch, writer) each.
    fn store_logs(&self) -> (Vec<Write>, Vec<Write>) {
        let mut c = self.store.admin();
        let (attempts, accepted): (Vec<String>, Vec<String>) = redis::pipe()
            .atomic()
            .lrange("attempts", 0, -1)
            .lrange("accepted", 0, -1)
            .query(&mut c)
            .unwrap();
        let parse = |v: Vec<String>| -> Vec<Write> {
            v.iter()
                .map(|s| {
                    let (e, w) = s.split_once(' ').unwrap();
                    (e.parse().unwrap(), w.to_string())
                })
                .collect()
        };
        (parse(attempts), parse(accepted))
    }

    /// One leader at a time, as the store saw it: the number of attempts whose epoch is below
    /// one attempted before (a write of an older leader after a newer one's). The accepted
    /// writes must never go back (the fence), and every attempt is either accepted or stale.
    fn stale_attempts(&self) -> Vec<Write> {
        let (attempts, accepted) = self.store_logs();
        let mut max = 0;
        let mut stale = Vec::new();
        for a in &attempts {
            if a.0 < max {
                stale.push(a.clone());
            }
            max = max.max(a.0);
        }
        assert!(
            accepted.windows(2).all(|w| w[0].0 <= w[1].0),
            "a stale write was accepted: {accepted:?}"
        );
        assert_eq!(
            accepted.len() + stale.len(),
            attempts.len(),
            "every attempt is accepted or stale"
        );
        stale
    }

    /// The observer saw every term, in order, with its value: exactly the `lead` events by
    /// epoch. Bounded wait for the last one to be read.
    async fn check_observer(&self) {
        let leads = || {
            let mut v: Vec<(String, u64)> = self
                .events()
                .iter()
                .filter(|e| e.kind == "lead")
                .map(|e| (format!("c{}", e.child), e.epoch))
                .collect();
            v.sort_by_key(|x| x.1);
            v
        };
        let expected = leads();
        let end = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            match *self.records.lock().unwrap() {
                Some(false) => {
                    eprintln!(
                        "[{}] no leader records on this engine: the observer check is the Config error",
                        self.engine.as_str()
                    );
                    return;
                }
                Some(true) if *self.observed.lock().unwrap() == expected => return,
                _ => {}
            }
            assert!(
                tokio::time::Instant::now() < end,
                "[{}] the observer saw {:?}, the terms were {:?}",
                self.engine.as_str(),
                self.observed.lock().unwrap(),
                expected
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The bound on a failover after a kill, pause or partition: the engine's lease or session
    /// plus a slack that only catches hangs (the measured times are in BENCHMARKS.md).
    fn bound(&self) -> Duration {
        self.ttl + Duration::from_secs(3)
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if let Some(o) = self.observer.take() {
            o.abort();
        }
        for c in self.children.iter_mut().flatten() {
            // A stopped child must run again to die of SIGKILL at once (it does either way).
            c.kill();
        }
    }
}

fn read_log(path: &Path, child: usize) -> Vec<Ev> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    // Only whole lines: the child may be writing the last one.
    let whole = text.rfind('\n').map_or("", |i| &text[..i]);
    whole
        .lines()
        .filter_map(|l| {
            let mut it = l.split(' ');
            let kind = it.next()?.to_string();
            let rest: Vec<String> = it.map(String::from).collect();
            match kind.as_str() {
                "hello" => Some(Ev {
                    child,
                    kind,
                    epoch: 0,
                    t: rest.get(1)?.parse().ok()?,
                    rest,
                }),
                "lead" | "end" | "resign" => Some(Ev {
                    child,
                    kind,
                    epoch: rest.first()?.parse().ok()?,
                    t: rest.get(1)?.parse().ok()?,
                    rest,
                }),
                // sent E seq t / wrote E seq t ok / resigned E t ok
                "sent" | "wrote" => Some(Ev {
                    child,
                    kind,
                    epoch: rest.first()?.parse().ok()?,
                    t: rest.get(2)?.parse().ok()?,
                    rest: rest[2..].to_vec(),
                }),
                "resigned" => Some(Ev {
                    child,
                    kind,
                    epoch: rest.first()?.parse().ok()?,
                    t: rest.get(1)?.parse().ok()?,
                    rest,
                }),
                _ => None,
            }
        })
        .collect()
}

fn tail(evs: &[Ev]) -> String {
    evs.iter()
        .rev()
        .filter(|e| e.kind != "sent" && e.kind != "wrote")
        .take(20)
        .map(|e| format!("  c{} {} {} @{}", e.child, e.kind, e.epoch, e.t))
        .collect::<Vec<_>>()
        .join("\n")
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

// ---------------------------------------------------------------------------------------------
// The scenarios, per engine
// ---------------------------------------------------------------------------------------------

/// SIGKILL of the leader: another candidate leads within the bound with a larger epoch; no write
/// of the old epoch after the new leader's; the observer saw both terms.
async fn killed_leader(engine: Engine, ttl: Duration) {
    let mut run = Run::start(engine, ttl, 3, &format!("kill-{}", engine.as_str())).await;
    let (l1, e1, _) = run.leader_after(0, Duration::from_secs(20)).await;
    run.writes(e1, 5).await;
    let t_kill = mono();
    let mut killed = run.children[l1].take().expect("alive");
    killed.kill();
    let (l2, e2, t2) = run.leader_after(e1, run.bound()).await;
    assert_ne!(l1, l2);
    run.writes(e2, 5).await;
    eprintln!(
        "[{}] kill: replaced after {:.0} ms (ttl {:?})",
        engine.as_str(),
        ms(t2 - t_kill),
        ttl
    );
    let stale = run.stale_attempts();
    assert!(stale.is_empty(), "stale write attempts: {stale:?}");
    run.check_observer().await;
}

/// SIGSTOP of the leader past its lease: another leads within the bound; after SIGCONT the old
/// leader's body is dropped before it sends any write (its own deadline passed while stopped),
/// and the store saw no old-epoch attempt after the new leader's, except the one write the
/// stopped leader may have queued just before the stop (refused by the fence).
async fn paused_leader(engine: Engine, ttl: Duration) {
    let run = Run::start(engine, ttl, 3, &format!("pause-{}", engine.as_str())).await;
    let (l1, e1, _) = run.leader_after(0, Duration::from_secs(20)).await;
    run.writes(e1, 5).await;
    let t_stop = mono();
    run.signal(l1, libc::SIGSTOP);
    let (l2, e2, t2) = run.leader_after(e1, run.bound()).await;
    assert_ne!(l1, l2);
    run.writes(e2, 5).await;
    let t_cont = mono();
    run.signal(l1, libc::SIGCONT);
    let evs = run
        .wait_for(Duration::from_secs(10), |evs| {
            evs.iter()
                .any(|e| e.child == l1 && e.kind == "end" && e.epoch == e1)
        })
        .await;
    // Let the resumed process run long enough to show a write it would still send.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let evs2 = run.events();
    let end = evs
        .iter()
        .find(|e| e.kind == "end" && e.epoch == e1)
        .unwrap();
    let sent_after: Vec<&Ev> = evs2
        .iter()
        .filter(|e| e.child == l1 && e.kind == "sent" && e.epoch == e1 && e.t >= t_cont)
        .collect();
    assert!(
        sent_after.is_empty(),
        "the resumed leader sent {} writes of its lost term",
        sent_after.len()
    );
    let in_flight = evs2
        .iter()
        .filter(|e| e.child == l1 && e.kind == "sent" && e.epoch == e1)
        .count()
        - evs2
            .iter()
            .filter(|e| e.child == l1 && e.kind == "wrote" && e.epoch == e1 && e.t < t_cont)
            .count();
    eprintln!(
        "[{}] pause: replaced after {:.0} ms (ttl {:?}); the resumed leader's body dropped {:.1} ms after SIGCONT; {in_flight} write(s) in flight at the stop",
        engine.as_str(),
        ms(t2 - t_stop),
        ttl,
        ms(end.t.saturating_sub(t_cont))
    );
    let stale = run.stale_attempts();
    assert!(
        stale.len() <= in_flight.min(1),
        "stale write attempts beyond the one queued before the stop: {stale:?}"
    );
    run.check_observer().await;
}

/// The leader's connection to the lock server is blackholed (its store connection stays up):
/// its body is dropped at its own deadline, before the new leader begins; the new leader comes
/// within the bound; no old-epoch write after the new leader's.
async fn partitioned_leader(engine: Engine, ttl: Duration) {
    let run = Run::start(engine, ttl, 3, &format!("part-{}", engine.as_str())).await;
    let (l1, e1, _) = run.leader_after(0, Duration::from_secs(20)).await;
    run.writes(e1, 5).await;
    let t_cut = mono();
    run.proxies[l1].set_mode(Mode::Blackhole);
    let (l2, e2, t2) = run.leader_after(e1, run.bound()).await;
    assert_ne!(l1, l2);
    run.writes(e2, 5).await;
    let evs = run
        .wait_for(Duration::from_secs(10), |evs| {
            evs.iter()
                .any(|e| e.child == l1 && e.kind == "end" && e.epoch == e1)
        })
        .await;
    let end = evs
        .iter()
        .find(|e| e.kind == "end" && e.epoch == e1)
        .unwrap();
    eprintln!(
        "[{}] partition: old leader's body dropped {:.0} ms after the cut, new leader {:.0} ms after (ttl {:?})",
        engine.as_str(),
        ms(end.t - t_cut),
        ms(t2 - t_cut),
        ttl
    );
    assert!(
        end.t < t2,
        "the partitioned leader's body still ran when the new leader began ({:.1} ms later)",
        ms(end.t - t2)
    );
    let stale = run.stale_attempts();
    assert!(stale.is_empty(), "stale write attempts: {stale:?}");
    run.proxies[l1].set_mode(Mode::Pass);
    run.check_observer().await;
}

/// Three resigns in a row (ttl 10 s): each hands over to the next candidate in well under the
/// ttl (a term that merely expired would take it); the terms never overlap in the store; the
/// observer saw all four terms in order.
async fn resign_hands_over(engine: Engine) {
    let ttl = Duration::from_secs(10);
    let run = Run::start(engine, ttl, 3, &format!("resign-{}", engine.as_str())).await;
    let (mut l, mut e, _) = run.leader_after(0, Duration::from_secs(20)).await;
    let mut handovers = Vec::new();
    for _ in 0..3 {
        run.writes(e, 3).await;
        // The last resigner steps aside for 500 ms: let it queue again, so that the hand-over
        // measured is to a waiting candidate.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let mut c = run.store.admin();
        let _: () = redis::cmd("SET")
            .arg("resign")
            .arg(e)
            .query(&mut c)
            .unwrap();
        let (l2, e2, t2) = run.leader_after(e, Duration::from_secs(20)).await;
        let evs = run.events();
        let r = evs
            .iter()
            .find(|x| x.kind == "resign" && x.epoch == e)
            .expect("the leader resigned");
        assert_eq!(r.child, l);
        assert!(
            evs.iter().any(|x| x.kind == "resigned"
                && x.epoch == e
                && x.rest.get(2).is_some_and(|v| v == "true")),
            "resign returned an error"
        );
        assert_ne!(l2, l);
        handovers.push(ms(t2 - r.t));
        (l, e) = (l2, e2);
    }
    run.writes(e, 3).await;
    eprintln!(
        "[{}] resign: handed over after {handovers:?} ms (ttl {ttl:?})",
        engine.as_str()
    );
    for h in &handovers {
        assert!(
            *h < ttl.as_secs_f64() * 1000.0 / 4.0,
            "a resign took {h:.0} ms to hand over (a quarter of the ttl: it waited for expiry)"
        );
    }
    let stale = run.stale_attempts();
    assert!(stale.is_empty(), "stale write attempts: {stale:?}");
    run.check_observer().await;
}

macro_rules! engine_tests {
    ($m:ident, $engine:expr, $ttl:expr) => {
        mod $m {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_killed_leader_is_replaced_within_its_bound() {
                killed_leader($engine, $ttl).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_paused_leader_is_replaced_and_its_work_cancelled_before_it_writes() {
                paused_leader($engine, $ttl).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_partitioned_leader_stops_at_its_deadline_before_the_next_leads() {
                partitioned_leader($engine, $ttl).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn resign_hands_over_at_once_and_observers_see_every_term() {
                resign_hands_over($engine).await;
            }
        }
    };
}

engine_tests!(on_redis, Engine::Redis, Duration::from_secs(2));
#[cfg(feature = "etcd")]
engine_tests!(on_etcd, Engine::Etcd, Duration::from_secs(2));
#[cfg(feature = "zookeeper")]
engine_tests!(on_zookeeper, Engine::Zookeeper, Duration::from_secs(2));
#[cfg(feature = "postgres")]
engine_tests!(on_postgres, Engine::Postgres, Duration::from_secs(2));
