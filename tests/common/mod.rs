//! Test harness shared by the integration tests: private `redis-server` processes on free
//! loopback ports, a backend-generic test environment, and a child-process mode (the test binary
//! re-executing itself) for cross-process tests.
//!
//! Rules: servers bind 127.0.0.1 only, on a port found by binding `127.0.0.1:0`; they never
//! outlive the test process (`PR_SET_PDEATHSIG` plus kill-and-reap on `Drop`); the machine's
//! shared Redis on 6379 is never touched. A missing `redis-server` fails the test with a clear
//! message (`scripts/test` installs it); nothing is skipped silently.
#![allow(dead_code, unreachable_pub)]

pub mod counting;
pub mod proxy;
pub mod runtimes;

use std::fmt::Write as _;
use std::io::{self, BufRead, BufReader};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use dlock::{Backend, Lock, MemoryBackend, RedisBackend};

#[cfg(feature = "cluster")]
pub mod cluster;
pub mod redlock;
#[cfg(feature = "sentinel")]
pub mod sentinel;
pub mod sql;
#[cfg(any(feature = "tls", feature = "postgres-tls", feature = "mysql-tls"))]
pub mod tls;

/// A hold on `a` (lease `ttl`) kept for `past` (longer than its lease or session timeout, so
/// only renewal keeps it) with a waiter on `b` queued behind it; `during(&guard)` runs before
/// the release. The waiter must get the lock within `woken` of the release, with a larger
/// token. Used by the TLS tests of the session engines to show the whole path works over TLS.
pub async fn hold_past_then_hand_over<F, Fut>(
    a: Arc<dyn Backend>,
    b: Arc<dyn Backend>,
    name: &str,
    ttl: Duration,
    past: Duration,
    woken: Duration,
    during: F,
) where
    F: FnOnce(dlock::LockGuard) -> Fut,
    Fut: std::future::Future<Output = dlock::LockGuard>,
{
    let g = Lock::new(name)
        .with_backend(a)
        .ttl(ttl)
        .acquire()
        .await
        .expect("the first hold");
    let waiter = {
        let name = name.to_string();
        tokio::spawn(async move {
            Lock::new(name)
                .with_backend(b)
                .wait(Duration::from_secs(20))
                .acquire()
                .await
        })
    };
    tokio::time::sleep(past).await;
    assert!(
        g.is_valid() && g.lost_reason().is_none(),
        "the hold did not outlive {past:?}: {:?}",
        g.lost_reason()
    );
    let g = during(g).await;
    let token = g.fencing_token();
    let released = Instant::now();
    g.release().await.unwrap();
    let g2 = tokio::time::timeout(Duration::from_secs(25), waiter)
        .await
        .expect("the waiter hangs")
        .unwrap()
        .expect("the waiter gets the lock");
    assert!(
        released.elapsed() < woken,
        "woken {:?} after the release",
        released.elapsed()
    );
    assert!(g2.fencing_token() > token);
    g2.release().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Spawning children
// ---------------------------------------------------------------------------------------------

type SpawnReq = (Command, mpsc::Sender<io::Result<Child>>);

/// `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the process. Test
/// functions run on short-lived libtest threads, so every child is forked by this one long-lived
/// thread instead: children then die exactly when the test process dies.
fn spawner() -> &'static Mutex<mpsc::Sender<SpawnReq>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnReq>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnReq>();
        std::thread::Builder::new()
            .name("test-child-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("start the child-spawner thread");
        Mutex::new(tx)
    })
}

/// Spawns `cmd` with `PR_SET_PDEATHSIG = SIGKILL`, from the long-lived spawner thread.
pub fn spawn_child(mut cmd: Command) -> io::Result<Child> {
    // SAFETY: the closure only calls async-signal-safe libc functions (prctl, getppid).
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died between fork and prctl.
            if libc::getppid() == 1 {
                return Err(io::Error::other("parent exited before the child started"));
            }
            Ok(())
        });
    }
    let (tx, rx) = mpsc::channel();
    spawner()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((cmd, tx))
        .expect("spawner thread alive");
    rx.recv().expect("spawner thread answers")
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: plain kill(2) on a pid we spawned and have not reaped.
    let r = unsafe { libc::kill(pid as libc::pid_t, sig) };
    assert_eq!(r, 0, "kill({pid}, {sig}): {}", io::Error::last_os_error());
}

/// A unique, empty scratch directory, removed on drop.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!(
            "dlock-test-{tag}-{}-{}-{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------------------------
// RedisProc
// ---------------------------------------------------------------------------------------------

/// A private `redis-server` on a free 127.0.0.1 port. Killed and reaped on drop.
#[derive(Debug)]
pub struct RedisProc {
    port: u16,
    dir: TempDir,
    extra: Vec<String>,
    child: Option<Child>,
    paused: bool,
    /// Extra environment of the server process (e.g. libfaketime's `LD_PRELOAD`).
    envs: Vec<(String, String)>,
}

/// A free loopback port (for the engine harnesses in sibling modules).
pub fn free_port_pub() -> u16 {
    free_port()
}

pub(crate) fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

impl RedisProc {
    /// Starts a server with the default test settings (no persistence, DEBUG allowed locally).
    pub fn start() -> RedisProc {
        Self::start_with(&[])
    }

    /// Starts a server with extra arguments appended (e.g. `["--appendonly", "yes"]`).
    pub fn start_with(extra: &[&str]) -> RedisProc {
        Self::start_with_env(extra, &[])
    }

    /// Like [`RedisProc::start_with`], with extra environment variables for the server process.
    pub fn start_with_env(extra: &[&str], envs: &[(String, String)]) -> RedisProc {
        let mut p = RedisProc {
            port: 0,
            dir: TempDir::new("redis"),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            child: None,
            paused: false,
            envs: envs.to_vec(),
        };
        let mut last_err = String::new();
        for _ in 0..8 {
            p.port = free_port();
            match p.spawn_and_wait() {
                Ok(()) => return p,
                Err(e) => last_err = e,
            }
        }
        panic!("could not start redis-server after 8 attempts: {last_err}");
    }

    fn spawn_and_wait(&mut self) -> Result<(), String> {
        let log_path = self.dir.path().join("redis.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| format!("open {}: {e}", log_path.display()))?;
        let mut cmd = Command::new("redis-server");
        cmd.arg("--port")
            .arg(self.port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--save")
            .arg("")
            .arg("--appendonly")
            .arg("no")
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--enable-debug-command")
            .arg("local")
            .arg("--logfile")
            .arg("")
            .args(&self.extra)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        let mut child = match spawn_child(cmd) {
            Ok(c) => c,
            Err(e) if e.kind() == io::ErrorKind::NotFound => panic!(
                "redis-server is not installed (not found in PATH). The integration tests need it: \
                 run scripts/test (it installs Debian's redis-server) or `apt-get install redis-server`."
            ),
            Err(e) => panic!("cannot spawn redis-server: {e}"),
        };
        let url = self.url();
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                return Err(format!(
                    "redis-server on port {} exited with {status}; log:\n{log}",
                    self.port
                ));
            }
            if ping(&url) {
                self.child = Some(child);
                return Ok(());
            }
            if started.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                let _ = child.wait();
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                return Err(format!(
                    "redis-server on port {} did not answer PING within 10 s; log:\n{log}",
                    self.port
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A URL with credentials: `redis://user:password@127.0.0.1:port`.
    pub fn url_with_auth(&self, user: &str, password: &str) -> String {
        format!("redis://{user}:{password}@127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server running").id()
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// SIGKILL and reap. The data is gone unless persistence was configured.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.paused = false;
    }

    /// Starts the server again on the same port and directory (with the same arguments).
    pub fn restart(&mut self) {
        self.kill();
        let started = Instant::now();
        loop {
            match self.spawn_and_wait() {
                Ok(()) => return,
                Err(e) if started.elapsed() > Duration::from_secs(10) => {
                    panic!("restart of redis-server on port {} failed: {e}", self.port)
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// SIGSTOP: the server stops answering, sockets stay open.
    pub fn pause(&mut self) {
        signal(self.pid(), libc::SIGSTOP);
        self.paused = true;
    }

    /// SIGCONT after [`RedisProc::pause`].
    pub fn resume(&mut self) {
        signal(self.pid(), libc::SIGCONT);
        self.paused = false;
    }

    /// A blocking admin connection (for setup and checks outside the hot path).
    pub fn admin(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .expect("admin url")
            .get_connection_with_timeout(Duration::from_secs(5))
            .expect("admin connection")
    }

    /// An async admin connection on the current runtime.
    pub async fn admin_async(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .expect("admin url")
            .get_multiplexed_async_connection()
            .await
            .expect("async admin connection")
    }

    /// Total calls per command from `INFO commandstats` (`cmdstat_<name>` → calls).
    pub fn commandstats(&self) -> std::collections::BTreeMap<String, u64> {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut self.admin())
            .expect("INFO commandstats");
        parse_commandstats(&info)
    }
}

impl Drop for RedisProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Parses `INFO commandstats` into `name -> calls`.
pub fn parse_commandstats(info: &str) -> std::collections::BTreeMap<String, u64> {
    let mut out = std::collections::BTreeMap::new();
    for line in info.lines() {
        let Some(rest) = line.strip_prefix("cmdstat_") else {
            continue;
        };
        let Some((name, fields)) = rest.split_once(':') else {
            continue;
        };
        for f in fields.split(',') {
            if let Some(v) = f.strip_prefix("calls=") {
                out.insert(name.to_string(), v.parse().unwrap_or(0));
            }
        }
    }
    out
}

pub(crate) fn ping(url: &str) -> bool {
    let Ok(client) = redis::Client::open(url) else {
        return false;
    };
    let Ok(mut con) = client.get_connection_with_timeout(Duration::from_millis(200)) else {
        return false;
    };
    let _ = con.set_read_timeout(Some(Duration::from_millis(500)));
    redis::cmd("PING")
        .query::<String>(&mut con)
        .is_ok_and(|s| s == "PONG")
}

// ---------------------------------------------------------------------------------------------
// One behavioural suite, two backends
// ---------------------------------------------------------------------------------------------

/// Which backend a test environment runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Redis,
    Memory,
    #[cfg(feature = "postgres")]
    Postgres,
    #[cfg(feature = "mysql")]
    Mysql,
    /// Redlock over several private redis-servers (`tests/common/redlock.rs`).
    Redlock,
    /// A private standalone ZooKeeper (feature `zookeeper`, `tests/common/zookeeper.rs`).
    #[cfg(feature = "zookeeper")]
    Zookeeper,
    /// A private Redis Cluster (feature `cluster`, `tests/common/cluster.rs`).
    #[cfg(feature = "cluster")]
    Cluster,
    /// A private single-member etcd (feature `etcd`, `tests/common/etcd.rs`).
    #[cfg(feature = "etcd")]
    Etcd,
    /// PostgreSQL's advisory-lock mode (session locks) on the machine's PostgreSQL.
    #[cfg(feature = "postgres")]
    PgAdvisory,
}

#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "zookeeper")]
pub mod zookeeper;

/// A test environment: a fresh backend (and, for Redis, its private server).
#[derive(Debug)]
pub struct Env {
    pub kind: Kind,
    pub server: Option<RedisProc>,
    /// The nodes of a Redlock environment (empty otherwise).
    pub nodes: Vec<RedisProc>,
    /// Other processes the environment keeps alive (e.g. the sentinels).
    pub extra: Vec<Box<dyn std::any::Any + Send + Sync>>,
    mem: Option<Arc<MemoryBackend>>,
    primary: Arc<dyn Backend>,
    /// The table of a database environment (`tests/common/sql.rs`).
    pub db: Option<sql::DbEnv>,
    #[cfg(feature = "zookeeper")]
    zk: Option<(Arc<zookeeper::ZkProc>, dlock::ZookeeperBackend)>,
}

impl Env {
    /// A private redis-server and a `RedisBackend` connected to it.
    pub async fn redis() -> Env {
        let server = tokio::task::spawn_blocking(RedisProc::start)
            .await
            .expect("start redis-server");
        let b = RedisBackend::connect(&server.url())
            .await
            .expect("connect to the private redis-server");
        Env {
            kind: Kind::Redis,
            server: Some(server),
            nodes: Vec::new(),
            extra: Vec::new(),
            mem: None,
            primary: Arc::new(b),
            db: None,
            #[cfg(feature = "zookeeper")]
            zk: None,
        }
    }

    /// A fresh `MemoryBackend`.
    pub fn memory() -> Env {
        let mem = Arc::new(MemoryBackend::new());
        Env {
            kind: Kind::Memory,
            server: None,
            nodes: Vec::new(),
            extra: Vec::new(),
            primary: mem.clone(),
            mem: Some(mem),
            db: None,
            #[cfg(feature = "zookeeper")]
            zk: None,
        }
    }

    /// A `PostgresBackend` on a table of its own in the machine's PostgreSQL.
    #[cfg(feature = "postgres")]
    pub async fn postgres() -> Env {
        let url = sql::pg_url();
        let table = sql::unique_table("pg");
        let b = sql::pg_backend(&url, &table).await;
        Env {
            kind: Kind::Postgres,
            server: None,
            nodes: Vec::new(),
            extra: Vec::new(),
            mem: None,
            primary: Arc::new(b),
            db: Some(sql::DbEnv { url, table }),
            #[cfg(feature = "zookeeper")]
            zk: None,
        }
    }

    /// A `MysqlBackend` on a table of its own in the machine's MariaDB / MySQL.
    #[cfg(feature = "mysql")]
    pub async fn mysql() -> Env {
        let url = sql::my_url();
        let table = sql::unique_table("my");
        let b = sql::my_backend(&url, &table).await;
        Env {
            kind: Kind::Mysql,
            server: None,
            nodes: Vec::new(),
            extra: Vec::new(),
            mem: None,
            primary: Arc::new(b),
            db: Some(sql::DbEnv { url, table }),
            #[cfg(feature = "zookeeper")]
            zk: None,
        }
    }

    /// A `PostgresBackend` in advisory-lock mode; its table names the key space (and mints
    /// the tokens), so tests running at the same time never share an advisory key.
    #[cfg(feature = "postgres")]
    pub async fn pg_advisory() -> Env {
        let url = sql::pg_url();
        let table = sql::unique_table("pga");
        let b = sql::pg_advisory_backend(&url, &table).await;
        Env {
            kind: Kind::PgAdvisory,
            server: None,
            nodes: Vec::new(),
            extra: Vec::new(),
            mem: None,
            primary: Arc::new(b),
            db: Some(sql::DbEnv { url, table }),
            #[cfg(feature = "zookeeper")]
            zk: None,
        }
    }

    /// The table of a database environment.
    pub fn db(&self) -> &sql::DbEnv {
        self.db.as_ref().expect("a database environment")
    }

    #[cfg(any(feature = "zookeeper", feature = "etcd"))]
    fn with_primary(kind: Kind, primary: Arc<dyn Backend>) -> Env {
        Env {
            kind,
            server: None,
            nodes: Vec::new(),
            extra: Vec::new(),
            mem: None,
            primary,
            db: None,
            #[cfg(feature = "zookeeper")]
            zk: None,
        }
    }

    /// True when a holder's lease ends by its ttl on the server (Redis, memory). False for a
    /// session-based engine (ZooKeeper): a node lives as long as its session, whatever the ttl,
    /// so tests of ttl expiry check the session-based equivalent instead.
    pub fn lease_expires_by_ttl(&self) -> bool {
        #[cfg(feature = "zookeeper")]
        if self.kind == Kind::Zookeeper {
            return false;
        }
        // etcd: the backend keeps its lease alive while a key uses it, so a key lives until
        // released or until its process stops keeping the lease alive, like a session.
        #[cfg(feature = "etcd")]
        if self.kind == Kind::Etcd {
            return false;
        }
        // Advisory locks live as long as the backend's session, whatever the ttl.
        #[cfg(feature = "postgres")]
        if self.kind == Kind::PgAdvisory {
            return false;
        }
        true
    }

    /// True when the admin reads lock names, owner ids and fencing tokens from the store, so it
    /// can list locks and compare holds by token. False for PostgreSQL advisory mode: the
    /// server keeps a hash of the name and the holding session only (`list` is unsupported,
    /// the owner is the session, there is no token).
    pub fn admin_sees_names_and_tokens(&self) -> bool {
        #[cfg(feature = "postgres")]
        if self.kind == Kind::PgAdvisory {
            return false;
        }
        true
    }

    pub fn is_redis(&self) -> bool {
        self.kind == Kind::Redis
    }

    /// True on ZooKeeper, where a hold lives as long as its session whatever its ttl and no
    /// other client keeps it alive: the suites' crash tests check the session's end instead of
    /// the ttl, and a busy answer carries no hold end (etcd, whose keys ride a lease kept alive
    /// by the holder's process, ends a crashed holder's hold by its ttl as the others do).
    pub fn is_session_based(&self) -> bool {
        #[cfg(feature = "zookeeper")]
        if self.kind == Kind::Zookeeper {
            return true;
        }
        false
    }

    pub fn server(&self) -> &RedisProc {
        self.server.as_ref().expect("a Redis environment")
    }

    pub fn server_mut(&mut self) -> &mut RedisProc {
        self.server.as_mut().expect("a Redis environment")
    }

    /// The backend of this environment.
    pub fn backend(&self) -> Arc<dyn Backend> {
        self.primary.clone()
    }

    /// Another client of the same store: for Redis a second `RedisBackend` with its own
    /// connections (as another process would have); in memory the same backend.
    pub async fn another_backend(&self) -> Arc<dyn Backend> {
        match self.kind {
            Kind::Redis => Arc::new(
                RedisBackend::connect(&self.server().url())
                    .await
                    .expect("second RedisBackend"),
            ),
            Kind::Memory => self.primary.clone(),
            #[cfg(feature = "postgres")]
            Kind::Postgres => Arc::new(sql::pg_backend(&self.db().url, &self.db().table).await),
            #[cfg(feature = "mysql")]
            Kind::Mysql => Arc::new(sql::my_backend(&self.db().url, &self.db().table).await),
            Kind::Redlock => self.another_redlock().await,
            #[cfg(feature = "zookeeper")]
            Kind::Zookeeper => self.zk_another_backend().await,
            #[cfg(feature = "cluster")]
            Kind::Cluster => self.cluster_another_backend().await,
            #[cfg(feature = "etcd")]
            Kind::Etcd => self.etcd_another_backend().await,
            #[cfg(feature = "postgres")]
            Kind::PgAdvisory => {
                Arc::new(sql::pg_advisory_backend(&self.db().url, &self.db().table).await)
            }
        }
    }

    /// The `MemoryBackend` of a memory environment.
    #[allow(dead_code)]
    pub fn memory_backend(&self) -> &MemoryBackend {
        self.mem.as_deref().expect("a memory environment")
    }

    /// `Lock::new(name)` on this environment's backend.
    pub fn lock(&self, name: &str) -> Lock {
        Lock::new(name).with_backend(self.primary.clone())
    }

    /// Deletes the lock behind its holder's back (`DEL` / `force_delete`).
    pub async fn force_delete(&self, name: &str) {
        match self.kind {
            Kind::Redis => {
                let mut con = self.server().admin_async().await;
                let n: i64 = redis::cmd("DEL")
                    .arg(dlock::backend::redis_keys(name).lock)
                    .query_async(&mut con)
                    .await
                    .expect("DEL");
                assert_eq!(n, 1, "the lock key of {name:?} existed");
            }
            Kind::Memory => assert!(self.mem.as_ref().unwrap().force_delete(name)),
            #[cfg(feature = "postgres")]
            Kind::Postgres => assert_eq!(self.db().pg_delete(name).await, 1, "row of {name:?}"),
            #[cfg(feature = "mysql")]
            Kind::Mysql => assert_eq!(self.db().my_delete(name).await, 1, "row of {name:?}"),
            Kind::Redlock => self.redlock_force_delete(name).await,
            #[cfg(feature = "zookeeper")]
            Kind::Zookeeper => self.zk_force_delete(name).await,
            #[cfg(feature = "cluster")]
            Kind::Cluster => self.cluster_force_delete(name).await,
            #[cfg(feature = "etcd")]
            Kind::Etcd => self.etcd_force_delete(name).await,
            // An advisory lock goes only with its session: terminate the session holding it.
            #[cfg(feature = "postgres")]
            Kind::PgAdvisory => assert_eq!(self.db().pg_advisory_kill(name).await, 1, "{name:?}"),
        }
    }

    /// Whether the lock is currently taken in the store (any owner).
    pub async fn is_locked(&self, name: &str) -> bool {
        match self.kind {
            Kind::Redis => {
                let mut con = self.server().admin_async().await;
                let n: i64 = redis::cmd("EXISTS")
                    .arg(dlock::backend::redis_keys(name).lock)
                    .query_async(&mut con)
                    .await
                    .expect("EXISTS");
                n == 1
            }
            Kind::Memory => {
                // Probe with a fresh owner, without waiting; give it back when it was free.
                let b = self.primary.clone();
                match b
                    .try_acquire(name, "probe-owner", Duration::from_secs(1))
                    .await
                {
                    Ok(dlock::backend::Acquired::Granted { .. }) => {
                        b.release(name, "probe-owner", None, true).await.unwrap();
                        false
                    }
                    Ok(_) => true,
                    Err(e) => panic!("probe failed: {e}"),
                }
            }
            #[cfg(feature = "postgres")]
            Kind::Postgres => self.db().pg_is_locked(name).await,
            #[cfg(feature = "mysql")]
            Kind::Mysql => self.db().my_is_locked(name).await,
            Kind::Redlock => self.redlock_locked_nodes(name).await > 0,
            #[cfg(feature = "zookeeper")]
            Kind::Zookeeper => self.zk_is_locked(name).await,
            #[cfg(feature = "cluster")]
            Kind::Cluster => self.cluster_exists(name).await,
            #[cfg(feature = "etcd")]
            Kind::Etcd => self.etcd_is_locked(name).await,
            #[cfg(feature = "postgres")]
            Kind::PgAdvisory => self.db().pg_advisory_is_locked(name).await,
        }
    }

    /// The operator's view of this environment's store (`dlock::admin`), connected the way the
    /// `dlock` CLI connects: from the store's address, not through the backend under test.
    pub async fn admin(&self) -> Box<dyn dlock::admin::Admin> {
        match self.kind {
            Kind::Redis => Box::new(
                dlock::admin::RedisAdmin::connect(&self.server().url())
                    .await
                    .expect("admin of the private redis-server"),
            ),
            Kind::Redlock => Box::new(
                dlock::admin::RedlockAdmin::connect(redlock::urls(&self.nodes))
                    .await
                    .expect("admin of the Redlock nodes"),
            ),
            #[cfg(feature = "cluster")]
            Kind::Cluster => Box::new(
                dlock::admin::ClusterAdmin::connect(self.cluster_set().urls())
                    .await
                    .expect("admin of the cluster"),
            ),
            Kind::Memory => panic!("the in-memory backend has no admin: it lives in one process"),
            // Through `admin::connect`, as the CLI dispatches a URL.
            #[cfg(feature = "zookeeper")]
            Kind::Zookeeper => dlock::admin::connect(&self.zk_server().url())
                .await
                .expect("admin of the private ZooKeeper"),
            #[cfg(feature = "etcd")]
            Kind::Etcd => dlock::admin::connect(&self.etcd_env().cluster.url())
                .await
                .expect("admin of the private etcd"),
            // The database engines: the store's URL with the admin's own `dlock_table` (and
            // `dlock_mode`) parameters, through `admin::connect` as the CLI calls it.
            #[cfg(feature = "postgres")]
            Kind::Postgres => dlock::admin::connect(&sql::with_param(
                &self.db().url,
                &format!("dlock_table={}", self.db().table),
            ))
            .await
            .expect("admin of the PostgreSQL lock table"),
            #[cfg(feature = "postgres")]
            Kind::PgAdvisory => dlock::admin::connect(&sql::with_param(
                &self.db().url,
                &format!("dlock_table={}&dlock_mode=advisory", self.db().table),
            ))
            .await
            .expect("admin of PostgreSQL advisory mode"),
            #[cfg(feature = "mysql")]
            Kind::Mysql => dlock::admin::connect(&sql::with_param(
                &self.db().url,
                &format!("dlock_table={}", self.db().table),
            ))
            .await
            .expect("admin of the MySQL lock table"),
            #[allow(unreachable_patterns)]
            other => panic!("no admin for {other:?}"),
        }
    }

    /// Memory backend: number of names locked right now.
    pub fn memory_locked_count(&self) -> usize {
        self.mem.as_ref().expect("memory env").locked_count()
    }
}

/// Runs each listed `async fn name(env: Env)` against both backends, as `on_redis::name` and
/// `on_memory::name`, each on a 2-worker multi-thread runtime.
#[macro_export]
macro_rules! both_backends {
    ($($t:ident),* $(,)?) => {
        mod on_redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::redis().await).await
                }
            )*
        }
        mod on_memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::memory()).await
                }
            )*
        }
        #[cfg(feature = "postgres")]
        mod on_postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::postgres().await).await
                }
            )*
        }
        #[cfg(feature = "mysql")]
        mod on_mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::mysql().await).await
                }
            )*
        }
        mod on_redlock {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::redlock(3).await).await
                }
            )*
        }
        #[cfg(feature = "sentinel")]
        mod on_sentinel {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::sentinel().await).await
                }
            )*
        }
        #[cfg(feature = "zookeeper")]
        mod on_zookeeper {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::zookeeper().await).await
                }
            )*
        }
        #[cfg(feature = "cluster")]
        mod on_cluster {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::cluster().await).await
                }
            )*
        }
        #[cfg(feature = "etcd")]
        mod on_etcd {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::etcd().await).await
                }
            )*
        }
        #[cfg(feature = "postgres")]
        mod on_pg_advisory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $t() {
                    super::$t($crate::common::Env::pg_advisory().await).await
                }
            )*
        }
    };
}

// ---------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------

/// Sends dlock's debug events to the test's captured output (shown when a test fails). Safe to
/// call from every test: only the first call installs the subscriber.
pub fn debug_events_in_test_output() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("dlock=debug,dlock_runtime=debug")
        .try_init();
}

/// A tiny xorshift PRNG (no `rand` dependency): deterministic per seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// The critical-section pause of the honest-test rules: `yield_now`, then sometimes a random
/// 0–500 µs sleep (tokio rounds it up to its 1 ms timer tick).
pub async fn section_pause(rng: &mut Rng) {
    tokio::task::yield_now().await;
    if rng.below(4) == 0 {
        tokio::time::sleep(Duration::from_micros(rng.below(500))).await;
    }
}

/// Polls `cond` every 20 ms until it holds or `limit` passes; returns whether it held.
pub async fn eventually<F, Fut>(limit: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if cond().await {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Child-process mode: the test binary re-executes itself
// ---------------------------------------------------------------------------------------------

/// Environment variable naming the child mode; set only in children.
pub const CHILD_ENV: &str = "DLOCK_TEST_CHILD";
/// Prefix of the lines a child prints for its parent.
pub const CHILD_LINE: &str = "DLOCK-CHILD:";

/// The child mode when this process was started by [`spawn_self`], else `None`.
pub fn child_mode() -> Option<String> {
    std::env::var(CHILD_ENV).ok()
}

/// A child process running one test function of this binary in child mode.
#[derive(Debug)]
pub struct ChildProc {
    child: Option<Child>,
    lines: mpsc::Receiver<String>,
}

/// The body of a child-process entry point: on a two-worker runtime, connects a Redis backend
/// to `DLOCK_URL` and runs `run(mode, backend)`. The entry point is an `#[ignore]`d `#[test]`
/// (so a normal run reports it as ignored, not as a passing test) that [`spawn_self`] runs.
pub fn run_child<F, Fut>(run: F)
where
    F: FnOnce(String, std::sync::Arc<dyn dlock::Backend>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mode = child_mode().expect("a child entry point runs only in a child process");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let url = std::env::var("DLOCK_URL").expect("DLOCK_URL");
        let backend = dlock::RedisBackend::connect(&url).await.unwrap();
        run(mode, std::sync::Arc::new(backend)).await
    });
}

/// Re-executes this test binary to run only `entry_test` (an `#[ignore]`d `#[test]` calling
/// [`run_child`]), with `mode` and extra environment variables.
pub fn spawn_self(entry_test: &str, mode: &str, envs: &[(&str, String)]) -> ChildProc {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.args([
        entry_test,
        "--exact",
        "--include-ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ENV, mode)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = spawn_child(cmd).expect("re-execute the test binary");
    let stdout: ChildStdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // libtest may print "test name ... " on the same line first.
            if let Some(at) = line.find(CHILD_LINE) {
                let rest = &line[at + CHILD_LINE.len()..];
                if tx.send(rest.trim().to_string()).is_err() {
                    break;
                }
            }
        }
    });
    ChildProc {
        child: Some(child),
        lines: rx,
    }
}

impl ChildProc {
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("child running").id()
    }

    /// The next protocol line from the child, or a panic after `timeout`.
    pub fn expect_line(&self, timeout: Duration) -> String {
        self.lines
            .recv_timeout(timeout)
            .unwrap_or_else(|e| panic!("child {} sent no line within {timeout:?}: {e}", self.pid()))
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the child to exit (bounded) and asserts success.
    pub fn wait_success(&mut self, timeout: Duration) {
        let mut c = self.child.take().expect("child running");
        let start = Instant::now();
        loop {
            if let Some(status) = c.try_wait().expect("try_wait") {
                assert!(status.success(), "child exited with {status}");
                return;
            }
            if start.elapsed() > timeout {
                let _ = c.kill();
                let _ = c.wait();
                panic!("child did not finish within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Prints a protocol line for the parent (child side).
pub fn child_say(msg: impl std::fmt::Display) {
    use std::io::Write;
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{CHILD_LINE} {msg}");
    let _ = out.flush();
}

// ---------------------------------------------------------------------------------------------
// Tracing capture (for the current thread: run the code under test on a current_thread runtime)
// ---------------------------------------------------------------------------------------------

/// Every event seen by the subscriber: (level, target, message and fields).
#[derive(Clone, Default)]
pub struct Events(Arc<Mutex<Vec<(tracing::Level, String, String)>>>);

impl Events {
    /// Every captured event at `level` whose message or fields contain `needle`.
    pub fn at_level_containing(&self, level: tracing::Level, needle: &str) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(l, _, m)| *l == level && m.contains(needle))
            .map(|(_, t, m)| format!("{t}: {m}"))
            .collect()
    }

    pub fn warns_containing(&self, needle: &str) -> Vec<String> {
        self.at_level_containing(tracing::Level::WARN, needle)
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Events {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        struct V(String);
        impl tracing::field::Visit for V {
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                let _ = write!(self.0, "{}={:?} ", f.name(), v);
            }
        }
        let mut v = V(String::new());
        event.record(&mut v);
        self.0.lock().unwrap().push((
            *event.metadata().level(),
            event.metadata().target().to_string(),
            v.0,
        ));
    }
}

pub fn capture() -> (Events, tracing::subscriber::DefaultGuard) {
    use tracing_subscriber::layer::SubscriberExt;
    let events = Events::default();
    let sub = tracing_subscriber::registry().with(events.clone());
    let guard = tracing::subscriber::set_default(sub);
    (events, guard)
}
