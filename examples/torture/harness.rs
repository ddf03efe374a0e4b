//! The torture harness (RELIABILITY.md §6 and §7 H): private redis-server processes, worker
//! processes that take one lock in a loop and log every hold, a nemesis, and the coordinator that
//! ties them together and hands the logs to the checker.
//!
//! The coordinator is plain synchronous code on one thread: it forks every child from that thread
//! (so `PR_SET_PDEATHSIG` kills them with it), talks to Redis with a minimal RESP client over
//! `std::net::TcpStream`, and signals workers by pid. Workers re-execute the current binary
//! (`std::env::current_exe`) with `DLOCK_TORTURE_WORKER=1` and their settings in the environment.
//!
//! Shared by `examples/torture.rs` and `tests/torture.rs` through `#[path]`.
#![allow(dead_code)]

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use dlock::backend::{Acquired, BoxFuture, Extended, Released, Watch};
use dlock::{Backend, Lock, LockError, LockGuard, MemoryBackend, RedisBackend};
use serde_json::{Value, json};

use crate::checker::{self, Report};

/// The loopback TCP proxy of the test harness, between the workers and the lock server.
#[path = "../../tests/common/proxy.rs"]
mod proxy;

/// The lock every worker contends for, and its Redis hash.
pub(crate) const LOCK_NAME: &str = "torture";
const LOCK_HASH: &str = "dlock:{torture}";
/// The election workload's lock (`Election::new(LOCK_NAME)` campaigns for `election:torture`)
/// and its Redis hash.
const ELECTION_LOCK_NAME: &str = "election:torture";
const ELECTION_LOCK_HASH: &str = "dlock:{election:torture}";

/// What the workers do (`--workload`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Workload {
    /// Every task takes the lock in a loop (the default).
    Lock,
    /// Every task takes one permit of a semaphore of `--sem-max` permits.
    Semaphore,
    /// A quarter of the tasks write (half of their holds downgrade), the rest read.
    Rw,
    /// One candidate per process runs `Election::run`: each term does a few epoch-fenced
    /// read-modify-writes of the fenced counter, then resigns; a lost term's body is dropped by
    /// `run`. Logged as holds (the term's epoch is the token), so the checker judges terms as it
    /// judges holds; the resource server's log of accepted fenced writes proves no stale epoch
    /// was accepted.
    Election,
}

impl Workload {
    pub(crate) fn parse(s: &str) -> Option<Workload> {
        match s {
            "lock" => Some(Workload::Lock),
            "semaphore" => Some(Workload::Semaphore),
            "rw" => Some(Workload::Rw),
            "election" => Some(Workload::Election),
            _ => None,
        }
    }
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Workload::Lock => "lock",
            Workload::Semaphore => "semaphore",
            Workload::Rw => "rw",
            Workload::Election => "election",
        }
    }
}

/// Set once per process (coordinator or worker) when the workload is an election.
static ELECTION_WORKLOAD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The name of the lock the workers contend for under this process's workload.
pub(crate) fn lock_name() -> &'static str {
    if ELECTION_WORKLOAD.load(Ordering::Relaxed) {
        ELECTION_LOCK_NAME
    } else {
        LOCK_NAME
    }
}

/// Its Redis hash.
pub(crate) fn lock_hash() -> &'static str {
    if ELECTION_WORKLOAD.load(Ordering::Relaxed) {
        ELECTION_LOCK_HASH
    } else {
        LOCK_HASH
    }
}
/// The environment variable that turns a process into a worker.
pub(crate) const WORKER_ENV: &str = "DLOCK_TORTURE_WORKER";

/// `CLOCK_MONOTONIC` in ns: one clock for every process on the host, so intervals logged by
/// different workers compare exactly (RELIABILITY.md §6.3).
pub(crate) fn mono() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// xorshift64*: enough randomness for jitter and fault choice, no dependency.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `lo..hi` (`lo` when the range is empty).
    pub(crate) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            lo
        } else {
            lo + self.next() % (hi - lo)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Child processes and Redis
// ---------------------------------------------------------------------------------------------

/// Spawns `cmd` so that it dies with the spawning thread (`PR_SET_PDEATHSIG = SIGKILL`).
pub(crate) fn spawn_tied(cmd: &mut Command) -> io::Result<Child> {
    // SAFETY: the closure only calls prctl, which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            );
            Ok(())
        });
    }
    cmd.spawn()
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: plain kill(2) on a pid this process spawned and has not reaped yet.
    unsafe { libc::kill(pid as libc::pid_t, sig) };
}

fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A RESP reply.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Resp {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<String>),
    Array(Vec<Resp>),
}

impl Resp {
    pub(crate) fn as_i64(&self) -> Option<i64> {
        match self {
            Resp::Int(i) => Some(*i),
            Resp::Bulk(Some(s)) | Resp::Simple(s) => s.parse().ok(),
            _ => None,
        }
    }
    pub(crate) fn strings(&self) -> Vec<String> {
        match self {
            Resp::Array(a) => a
                .iter()
                .filter_map(|x| match x {
                    Resp::Bulk(Some(s)) | Resp::Simple(s) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        }
    }
}

fn read_resp(r: &mut impl BufRead) -> io::Result<Resp> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed",
        ));
    }
    let line = line.trim_end_matches("\r\n");
    let (kind, rest) = line.split_at(1.min(line.len()));
    let bad = || {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad RESP line {line:?}"),
        )
    };
    Ok(match kind {
        "+" => Resp::Simple(rest.into()),
        "-" => Resp::Error(rest.into()),
        ":" => Resp::Int(rest.parse().map_err(|_| bad())?),
        "$" => {
            let n: i64 = rest.parse().map_err(|_| bad())?;
            if n < 0 {
                Resp::Bulk(None)
            } else {
                let mut buf = vec![0; n as usize + 2];
                r.read_exact(&mut buf)?;
                buf.truncate(n as usize);
                Resp::Bulk(Some(String::from_utf8_lossy(&buf).into_owned()))
            }
        }
        "*" => {
            let n: i64 = rest.parse().map_err(|_| bad())?;
            let mut items = Vec::new();
            for _ in 0..n.max(0) {
                items.push(read_resp(r)?);
            }
            Resp::Array(items)
        }
        _ => return Err(bad()),
    })
}

/// Sends one command on a fresh loopback connection and reads the reply.
pub(crate) fn redis_cmd(port: u16, args: &[&str], timeout: Duration) -> io::Result<Resp> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let mut req = format!("*{}\r\n", args.len());
    for a in args {
        req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    s.write_all(req.as_bytes())?;
    read_resp(&mut BufReader::new(s))
}

/// Builds `tests/common/clockstep.c` into `dir` (once per directory).
fn clock_shim(dir: &Path) -> io::Result<PathBuf> {
    let lib = dir.join("libclockstep.so");
    if lib.exists() {
        return Ok(lib);
    }
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/common/clockstep.c");
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&lib)
        .arg(src)
        .output()
        .map_err(|e| io::Error::other(format!("cc (needed for the clock shim): {e}")))?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "cc {src}: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(lib)
}

/// A private redis-server on a free 127.0.0.1 port, without persistence, with `DEBUG` allowed
/// from loopback. Killed and reaped on drop; dies with the spawning thread.
#[derive(Debug)]
pub(crate) struct RedisServer {
    pub(crate) port: u16,
    dir: PathBuf,
    child: Option<Child>,
    /// Extra arguments (`--replicaof ...` for a Sentinel replica).
    extra: Vec<String>,
    /// Extra environment (the clock shim's `LD_PRELOAD`, see [`RedisServer::clock_offset`]).
    env: Vec<(String, String)>,
}

impl RedisServer {
    pub(crate) fn start(dir: &Path) -> io::Result<RedisServer> {
        Self::start_with(dir, &[])
    }

    pub(crate) fn start_with(dir: &Path, extra: &[String]) -> io::Result<RedisServer> {
        std::fs::create_dir_all(dir)?;
        let mut last = None;
        for _ in 0..5 {
            let mut s = RedisServer {
                port: free_port()?,
                dir: dir.to_path_buf(),
                child: None,
                extra: extra.to_vec(),
                env: Vec::new(),
            };
            match s.spawn() {
                Ok(()) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("redis-server did not start")))
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Restarts the server with its wall clock `ms` off real time (`tests/common/clockstep.c`,
    /// an `LD_PRELOAD` shim built here with `cc`; monotonic clocks are not touched), kept
    /// across the nemesis's restarts. 0: no shim.
    pub(crate) fn clock_offset(&mut self, ms: i64) -> io::Result<()> {
        if ms == 0 {
            return Ok(());
        }
        let lib = clock_shim(&self.dir)?;
        let file = self.dir.join(format!("clock-offset-{}", self.port));
        std::fs::write(&file, (ms * 1_000_000).to_ne_bytes())?;
        self.env = vec![
            ("LD_PRELOAD".into(), lib.display().to_string()),
            ("DLOCK_CLOCK_OFFSET_FILE".into(), file.display().to_string()),
        ];
        self.kill();
        self.spawn()
    }

    fn spawn(&mut self) -> io::Result<()> {
        let port = self.port.to_string();
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            &port,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--enable-debug-command", "local", "--logfile", ""])
        .args(&self.extra)
        .envs(self.env.iter().map(|(k, v)| (k, v)))
        .arg("--dir")
        .arg(&self.dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        let mut child = spawn_tied(&mut cmd).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot run redis-server (is it installed?): {e}"),
            )
        })?;
        let start = mono();
        while mono() - start < 5_000_000_000 {
            if let Ok(Resp::Simple(p)) = redis_cmd(self.port, &["PING"], Duration::from_secs(1))
                && p == "PONG"
            {
                self.child = Some(child);
                return Ok(());
            }
            if let Ok(Some(_)) = child.try_wait() {
                return Err(io::Error::other(format!(
                    "redis-server exited on port {port}"
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        Err(io::Error::other(
            "redis-server did not answer PING within 5 s",
        ))
    }

    pub(crate) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// `kill -9` and start again on the same port: every key is gone (no persistence).
    pub(crate) fn restart(&mut self) -> io::Result<()> {
        self.kill();
        let mut last = None;
        for _ in 0..50 {
            match self.spawn() {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(last.unwrap_or_else(|| io::Error::other("restart failed")))
    }

    pub(crate) fn cmd(&self, args: &[&str]) -> io::Result<Resp> {
        redis_cmd(self.port, args, Duration::from_secs(5))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

// ---------------------------------------------------------------------------------------------
// The resource server: a fenced counter and an unfenced one
// ---------------------------------------------------------------------------------------------

/// Fenced read: refuses a token lower than the highest seen, else records it and returns the
/// counter (-1 when refused).
const FREAD: &str = r"
local m = redis.call('GET', KEYS[1])
if m and tonumber(m) > tonumber(ARGV[1]) then return -1 end
redis.call('SET', KEYS[1], ARGV[1])
return tonumber(redis.call('GET', KEYS[2]) or '0')";
/// Fenced write: the same check, then the write, appended to the server's own log of applied
/// writes (the ground truth for lost updates). Returns 1 when accepted, 0 when refused.
///
/// The token of each accepted write goes to a second log (`res:f:tokens`), from which the run
/// proves that no write with a token below one accepted before it was accepted.
const FWRITE: &str = r"
local m = redis.call('GET', KEYS[1])
if m and tonumber(m) > tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('RPUSH', KEYS[3], ARGV[2])
redis.call('RPUSH', KEYS[4], ARGV[1])
return 1";
/// Unfenced write, with the same applied-writes log.
const UWRITE: &str = r"
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1";
const F_MAX: &str = "res:f:max";
const F_COUNTER: &str = "res:f:counter";
const F_LOG: &str = "res:f:log";
const F_TOKENS: &str = "res:f:tokens";
const U_COUNTER: &str = "res:u:counter";
const U_LOG: &str = "res:u:log";

// ---------------------------------------------------------------------------------------------
// Worker
// ---------------------------------------------------------------------------------------------

/// Which lock service the workers use (`--engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Engine {
    /// One redis-server, reached through the fault proxy.
    Redis,
    /// Redlock over three independent redis-servers.
    Redlock,
    /// A Sentinel-managed master with one replica and three sentinels (feature `sentinel`).
    Sentinel,
    /// A private 3-member etcd cluster (feature `etcd`).
    Etcd,
    /// A private PostgreSQL server, table mode (feature `postgres`).
    Postgres,
    /// The same server, advisory-lock mode (feature `postgres`).
    PgAdvisory,
    /// A private MariaDB server (feature `mysql`).
    Mysql,
    /// A private Redis Cluster: three masters with a replica each (feature `cluster`).
    Cluster,
}

impl Engine {
    pub(crate) fn parse(s: &str) -> Option<Engine> {
        match s {
            "redis" => Some(Engine::Redis),
            "redlock" => Some(Engine::Redlock),
            "sentinel" => Some(Engine::Sentinel),
            "etcd" => Some(Engine::Etcd),
            "postgres" => Some(Engine::Postgres),
            "pg-advisory" => Some(Engine::PgAdvisory),
            "mysql" => Some(Engine::Mysql),
            "cluster" => Some(Engine::Cluster),
            _ => None,
        }
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Engine::Redis => "redis",
            Engine::Redlock => "redlock",
            Engine::Sentinel => "sentinel",
            Engine::Etcd => "etcd",
            Engine::Postgres => "postgres",
            Engine::PgAdvisory => "pg-advisory",
            Engine::Mysql => "mysql",
            Engine::Cluster => "cluster",
        }
    }

    /// The engines whose servers and faults live in a module of their own ([`Store`]).
    fn has_store(self) -> bool {
        !matches!(self, Engine::Redis | Engine::Redlock | Engine::Sentinel)
    }
}

/// The lock servers of an engine that lives in a module of its own (etcd, the SQL engines,
/// Redis Cluster): what workers connect to, and the engine's own faults.
pub(crate) trait Store {
    /// What workers pass to [`connect_engine`].
    fn url(&self) -> String;
    /// Injects one fault on the lock service and returns `(kind, t_start, state_loss)`; the
    /// fault ends when this returns. Kinds in [`checker::WORKER_FAULTS`] hit the workers'
    /// sessions, every other kind is a store-fault window.
    fn fault(&mut self, rng: &mut Rng, ttl: Duration) -> io::Result<(&'static str, u64, bool)>;
}

/// Starts the servers of a [`Store`] engine.
fn start_store(cfg: &RunCfg) -> io::Result<Box<dyn Store>> {
    #[allow(unused_variables)]
    let missing = |f: &str| -> io::Result<Box<dyn Store>> {
        Err(io::Error::other(format!(
            "engine {} needs `--features {f}`",
            cfg.engine.as_str()
        )))
    };
    match cfg.engine {
        #[cfg(feature = "etcd")]
        Engine::Etcd => Ok(Box::new(etcd::EtcdSet::start(&cfg.dir)?)),
        #[cfg(feature = "postgres")]
        Engine::Postgres | Engine::PgAdvisory => Ok(Box::new(sql::PgServer::start(
            &cfg.dir,
            cfg.clock_offsets_ms.clone(),
        )?)),
        #[cfg(feature = "mysql")]
        Engine::Mysql => Ok(Box::new(sql::MyServer::start(
            &cfg.dir,
            cfg.clock_offsets_ms.clone(),
        )?)),
        #[cfg(feature = "cluster")]
        Engine::Cluster => Ok(Box::new(cluster::ClusterSet::start(&cfg.dir, |i| {
            cfg.clock_offset_ms(i)
        })?)),
        #[cfg(not(feature = "etcd"))]
        Engine::Etcd => missing("etcd"),
        #[cfg(not(feature = "postgres"))]
        Engine::Postgres | Engine::PgAdvisory => missing("postgres"),
        #[cfg(not(feature = "mysql"))]
        Engine::Mysql => missing("mysql"),
        #[cfg(not(feature = "cluster"))]
        Engine::Cluster => missing("cluster"),
        Engine::Redis | Engine::Redlock | Engine::Sentinel => unreachable!("not a Store engine"),
    }
}

#[cfg(feature = "cluster")]
#[path = "cluster.rs"]
mod cluster;
#[cfg(feature = "etcd")]
#[path = "etcd.rs"]
mod etcd;
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[path = "sql.rs"]
mod sql;

/// The Sentinel master name of the torture's Sentinel set.
const SENTINEL_MASTER: &str = "tortmaster";

/// Which lock the workers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// dlock on Redis, as shipped.
    Dlock,
    /// Broken on purpose: a backend that grants every acquire (no exclusion, per-process tokens).
    NoExclude,
    /// Broken on purpose: a 20 ms lease that is never renewed, used by a naive worker that
    /// ignores `lost()` and `is_valid()` and whose body outlasts the lease.
    NoRenew,
    /// Broken on purpose: the give-back is disabled. The worker logs its release as done and
    /// forgets the guard instead (`mem::forget`), so the watchdog keeps the hold alive on the
    /// server for as long as the process lives: the orphan the checker must catch.
    NoReturn,
}

impl Mode {
    pub(crate) fn parse(s: &str) -> Option<Mode> {
        match s {
            "dlock" => Some(Mode::Dlock),
            "noexclude" => Some(Mode::NoExclude),
            "norenew" => Some(Mode::NoRenew),
            "noreturn" => Some(Mode::NoReturn),
            _ => None,
        }
    }
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Mode::Dlock => "dlock",
            Mode::NoExclude => "noexclude",
            Mode::NoRenew => "norenew",
            Mode::NoReturn => "noreturn",
        }
    }
}

/// The semaphore and read-write workers (`--workload semaphore|rw`).
#[path = "prims.rs"]
mod prims;
#[allow(unused_imports)]
pub(crate) use prims::engine_supported;

/// The test-only broken lock: every acquire is granted at once.
#[derive(Debug, Default)]
struct NoExclude {
    next: AtomicU64,
}

impl Backend for NoExclude {
    fn try_acquire<'a>(
        &'a self,
        _name: &'a str,
        _owner: &'a str,
        _ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        let token = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        Box::pin(async move { Ok(Acquired::Granted { token, count: 1 }) })
    }
    fn release<'a>(
        &'a self,
        _name: &'a str,
        _owner: &'a str,
        _keep_for: Option<Duration>,
        _all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        Box::pin(async { Ok(Released::Freed) })
    }
    fn extend<'a>(
        &'a self,
        _name: &'a str,
        _owner: &'a str,
        _ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(async { Ok(Extended::Extended) })
    }
    fn watch<'a>(&'a self, _name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(async {
            Err(LockError::Config(
                "NoExclude never makes anyone wait".into(),
            ))
        })
    }
    fn has_waiters(&self, _name: &str) -> bool {
        false
    }
}

/// Appends JSON lines, one `write` per line, so a SIGKILL loses at most the line being written.
#[derive(Debug)]
struct Log(Mutex<File>);

impl Log {
    fn line(&self, v: Value) {
        let mut s = v.to_string();
        s.push('\n');
        let mut f = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let _ = f.write_all(s.as_bytes());
    }
}

static WORKER_LOG: OnceLock<Arc<Log>> = OnceLock::new();

fn env_u64(k: &str, default: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Ctx {
    lock: Lock,
    workload: Workload,
    sem_max: u32,
    backend: Arc<dyn Backend>,
    ttl: Duration,
    wait: Duration,
    log: Arc<Log>,
    res: redis::aio::MultiplexedConnection,
    end: u64,
    body_us: u64,
    check: bool,
    seed: u64,
    mode: Mode,
}

/// Worker process entry: reads its settings from the environment, runs the tasks until the
/// end time, exits. Never returns.
pub(crate) fn worker_main() -> ! {
    let path = std::env::var("TORTURE_LOG").expect("TORTURE_LOG");
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .expect("open worker log");
    let log = Arc::new(Log(Mutex::new(file)));
    let _ = WORKER_LOG.set(log.clone());
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if let Some(l) = WORKER_LOG.get() {
            l.line(json!({"ev": "panic", "t": mono(), "msg": info.to_string()}));
        }
        default_hook(info);
    }));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let code = rt.block_on(worker(log));
    std::process::exit(code)
}

async fn worker(log: Arc<Log>) -> i32 {
    let mode =
        Mode::parse(&std::env::var("TORTURE_MODE").unwrap_or_default()).unwrap_or(Mode::Dlock);
    let tasks = env_u64("TORTURE_TASKS", 4);
    let ttl = Duration::from_millis(env_u64("TORTURE_TTL_MS", 1000));
    let wait = Duration::from_millis(env_u64("TORTURE_WAIT_MS", 5000));
    let lock_url = std::env::var("TORTURE_LOCK_URL").unwrap_or_default();
    let res_url = std::env::var("TORTURE_RES_URL").unwrap_or_default();
    // The owner-id prefix identifies this process in the lock hash, so the nemesis can find the
    // holder's pid. Any acquisition shows it; an in-memory one needs no server.
    let prefix = {
        let g = Lock::new("hello")
            .with_backend(Arc::new(MemoryBackend::new()))
            .acquire()
            .await
            .expect("in-memory acquire");
        let p = g.owner().split(':').next().unwrap_or("").to_string();
        let _ = g.release().await;
        p
    };
    let zk_hosts = std::env::var("TORTURE_ZK_HOSTS").unwrap_or_default();
    let backend: Arc<dyn Backend> = match mode {
        Mode::NoExclude => Arc::new(NoExclude::default()),
        #[cfg(feature = "zookeeper")]
        Mode::Dlock | Mode::NoRenew | Mode::NoReturn if !zk_hosts.is_empty() => {
            zkens::worker_backend(&zk_hosts, ttl, &log).await
        }
        Mode::Dlock | Mode::NoRenew | Mode::NoReturn => {
            assert!(
                zk_hosts.is_empty(),
                "ZooKeeper mode needs the `zookeeper` feature"
            );
            let engine = Engine::parse(&std::env::var("TORTURE_ENGINE").unwrap_or_default())
                .unwrap_or(Engine::Redis);
            let mut tries = 0;
            loop {
                match connect_engine(engine, &lock_url).await {
                    Ok(b) => break b,
                    Err(e) if tries < 50 => {
                        tries += 1;
                        log.line(
                            json!({"ev": "connect_retry", "t": mono(), "what": e.to_string()}),
                        );
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => panic!("cannot connect to the lock server: {e}"),
                }
            }
        }
    };
    let res = redis::Client::open(res_url.as_str())
        .expect("resource URL")
        .get_multiplexed_async_connection()
        .await
        .expect("connect to the resource server");
    let workload = Workload::parse(&std::env::var("TORTURE_WORKLOAD").unwrap_or_default())
        .unwrap_or(Workload::Lock);
    log.line(json!({"ev": "hello", "pid": std::process::id(), "prefix": prefix, "t": mono(), "mode": mode.as_str(), "workload": workload.as_str()}));
    ELECTION_WORKLOAD.store(workload == Workload::Election, Ordering::Relaxed);
    let election = dlock::Election::new(LOCK_NAME)
        .ttl(ttl)
        .wait(wait)
        .value(prefix.clone())
        .with_backend(backend.clone())
        .once();
    let ctx = Arc::new(Ctx {
        lock: Lock::new(LOCK_NAME)
            .ttl(ttl)
            .wait(wait)
            .watchdog(mode != Mode::NoRenew)
            .with_backend(backend.clone()),
        workload,
        sem_max: env_u64("TORTURE_SEM_MAX", 3) as u32,
        backend,
        ttl,
        wait,
        log,
        res,
        end: env_u64("TORTURE_END_NS", mono() + 10_000_000_000),
        body_us: env_u64("TORTURE_BODY_US", 500),
        check: mode != Mode::NoRenew,
        seed: mono() ^ ((std::process::id() as u64) << 32),
        mode,
    });
    if workload == Workload::Election {
        return match tokio::spawn(election_loop(ctx, election)).await {
            Ok(()) => 0,
            Err(_) => 101,
        };
    }
    let handles: Vec<_> = (0..tasks)
        .map(|t| tokio::spawn(task_loop(ctx.clone(), t)))
        .collect();
    let mut code = 0;
    for h in handles {
        if h.await.is_err() {
            code = 101;
        }
    }
    code
}

/// The worker's backend for `engine`; `urls` is one URL (Redis) or a comma-separated list
/// (Redlock's nodes, Sentinel's sentinels).
async fn connect_engine(engine: Engine, urls: &str) -> Result<Arc<dyn Backend>, LockError> {
    let list: Vec<&str> = urls.split(',').filter(|u| !u.is_empty()).collect();
    Ok(match engine {
        Engine::Redis => Arc::new(RedisBackend::connect(urls).await?),
        Engine::Redlock => Arc::new(dlock::RedlockBackend::connect(list).await?),
        #[cfg(feature = "sentinel")]
        Engine::Sentinel => {
            let mut b = dlock::SentinelBackend::builder(SENTINEL_MASTER, list);
            let n = env_u64("TORTURE_MIN_REPLICAS", 0) as usize;
            if n > 0 {
                b = b.min_replicas(n, Duration::from_millis(200));
            }
            Arc::new(b.connect().await?)
        }
        #[cfg(not(feature = "sentinel"))]
        Engine::Sentinel => {
            return Err(LockError::Config(
                "the Sentinel engine needs the `sentinel` feature".into(),
            ));
        }
        #[cfg(feature = "etcd")]
        Engine::Etcd => Arc::new(dlock::EtcdBackend::builder(&list).build().await?),
        #[cfg(feature = "postgres")]
        Engine::Postgres => Arc::new(
            dlock::PostgresBackend::builder(urls)
                .table(SQL_TABLE)
                .connect()
                .await?,
        ),
        #[cfg(feature = "postgres")]
        Engine::PgAdvisory => Arc::new(
            dlock::PostgresBackend::builder(urls)
                .table(SQL_TABLE)
                .advisory(true)
                .connect()
                .await?,
        ),
        #[cfg(feature = "mysql")]
        Engine::Mysql => Arc::new(
            dlock::MysqlBackend::builder(urls)
                .table(SQL_TABLE)
                .connect()
                .await?,
        ),
        #[cfg(feature = "cluster")]
        Engine::Cluster => Arc::new(dlock::ClusterBackend::connect(list).await?),
        #[allow(unreachable_patterns)]
        other => {
            return Err(LockError::Config(format!(
                "engine {} is not built in (see its feature)",
                other.as_str()
            )));
        }
    })
}

/// The lock table of the SQL engines.
const SQL_TABLE: &str = "dlock_torture";

/// The guard's deadline on the `mono()` clock, or `None` once it has passed. A passed deadline
/// lies somewhere before now, and `now + 0` would log it too late: a worker stopped between its
/// grant and this read (the nemesis's SIGSTOP of a fresh holder) would then claim a lease up to
/// the moment it resumed, and the checker would count every grant made meanwhile as a
/// lease-invariant violation. `now` is read first, so a pause between the two reads can only
/// make the logged deadline earlier than the true one.
fn deadline_of(g: &LockGuard) -> Option<u64> {
    let now = mono();
    let rem = g.remaining();
    (!rem.is_zero()).then(|| now + rem.as_nanos() as u64)
}

async fn task_loop(ctx: Arc<Ctx>, task: u64) {
    if matches!(ctx.workload, Workload::Semaphore | Workload::Rw) {
        return prims::task_loop(ctx, task).await;
    }
    let mut rng = Rng::new(ctx.seed ^ (task + 1).wrapping_mul(0x1234_5678_9ABC));
    let mut seq = 0u64;
    while mono() < ctx.end {
        let t_send = mono();
        let g = match ctx.lock.acquire().await {
            Ok(g) => g,
            Err(e) => {
                ctx.log
                    .line(json!({"ev": "err", "t": mono(), "task": null, "what": e.to_string()}));
                if !matches!(e, LockError::TimedOut { .. } | LockError::Busy { .. }) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                continue;
            }
        };
        seq += 1;
        let t_ok = mono();
        let token = g.fencing_token();
        ctx.log.line(
            json!({"ev": "acq", "task": task, "seq": seq, "token": token, "owner": g.owner(),
            "t_send": t_send, "t_ok": t_ok, "dl": deadline_of(&g)}),
        );
        let done = dlock::CancellationToken::new();
        let watcher = {
            let lost = g.lost();
            let done = done.clone();
            let log = ctx.log.clone();
            tokio::spawn(async move {
                tokio::select! {
                    biased;
                    reason = lost => log.line(json!({"ev": "lost", "task": task, "seq": seq, "t": mono(), "reason": reason.to_string()})),
                    _ = done.cancelled() => {}
                }
            })
        };
        let mut res = ctx.res.clone();
        body(&ctx, &g, &mut res, task, seq, &mut rng).await;
        let t_rel = mono();
        let dl = deadline_of(&g);
        done.cancel();
        if ctx.mode == Mode::NoReturn {
            ctx.log.line(json!({"ev": "rel", "task": task, "seq": seq, "t_send": t_rel, "t_done": mono(), "rel": "ok", "dl": dl}));
            std::mem::forget(g);
            let _ = watcher.await;
            continue;
        }
        let rel = match g.release().await {
            Ok(()) => "ok",
            // The lease was gone: the guard knew it (Lost, at once) or the server said so.
            Err(LockError::NotOwner { .. } | LockError::Lost { .. }) => "not_owner",
            Err(_) => "err",
        };
        ctx.log.line(json!({"ev": "rel", "task": task, "seq": seq, "t_send": t_rel, "t_done": mono(), "rel": rel, "dl": dl}));
        let _ = watcher.await;
    }
}

/// The election workload's candidate (one per process): campaigns (`Election::run`, once per
/// term, so that each term is logged as a hold of task 0 with the epoch as its token) until the
/// end of the run.
async fn election_loop(ctx: Arc<Ctx>, election: dlock::Election) {
    let mut rng = Rng::new(ctx.seed ^ 0xE1EC_7104);
    let end = tokio::time::Instant::now() + Duration::from_nanos(ctx.end.saturating_sub(mono()));
    let mut seq = 0u64;
    while mono() < ctx.end {
        seq += 1;
        let (s, t_send, term_seed) = (seq, mono(), rng.next());
        let run = election.run(|term| {
            let ctx = ctx.clone();
            async move { term_body(&ctx, term, s, t_send, term_seed).await }
        });
        let r = tokio::select! {
            r = run => r,
            _ = tokio::time::sleep_until(end) => break,
        };
        match r {
            // Resigned, or lost (the body's marker logged it).
            Ok(()) | Err(LockError::Lost { .. }) => {}
            Err(e) => {
                ctx.log
                    .line(json!({"ev": "err", "t": mono(), "task": null, "what": e.to_string()}));
                if !matches!(e, LockError::TimedOut { .. } | LockError::Busy { .. }) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }
}

/// The term's deadline on the `mono()` clock (see [`deadline_of`]).
fn term_deadline(t: &dlock::Term) -> Option<u64> {
    let now = mono();
    let rem = t.remaining();
    (!rem.is_zero()).then(|| now + rem.as_nanos() as u64)
}

/// Logs the end of a term's body when `run` drops it: `lost` when it was cancelled while
/// working, or the `rel` of a resign cut short (the term was lost while resigning).
struct TermEnd {
    log: Arc<Log>,
    seq: u64,
    /// Set when the resign was sent: `(t_send, deadline then)`.
    resigning: Option<(u64, Option<u64>)>,
    done: bool,
}

impl Drop for TermEnd {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        match self.resigning {
            None => self.log.line(
                json!({"ev": "lost", "task": 0, "seq": self.seq, "t": mono(),
                "reason": "term lost: run dropped the leader's body"}),
            ),
            Some((t, dl)) => self
                .log
                .line(json!({"ev": "rel", "task": 0, "seq": self.seq,
                "t_send": t, "t_done": mono(), "rel": "not_owner", "dl": dl})),
        }
    }
}

/// One term: 2 to 7 epoch-fenced read-modify-writes of the fenced counter (each checked
/// against the term's own deadline before the write, as a leader should), then `resign`.
async fn term_body(ctx: &Ctx, term: dlock::Term, seq: u64, t_send: u64, seed: u64) {
    let mut rng = Rng::new(seed);
    let t_ok = mono();
    let epoch = term.epoch();
    ctx.log.line(
        json!({"ev": "acq", "task": 0, "seq": seq, "token": epoch, "owner": term.value(),
        "t_send": t_send, "t_ok": t_ok, "dl": term_deadline(&term)}),
    );
    let mut end = TermEnd {
        log: ctx.log.clone(),
        seq,
        resigning: None,
        done: false,
    };
    let token = epoch.to_string();
    let op = |kind: &str, accepted: bool, t: u64, dl: Option<u64>| {
        ctx.log.line(
            json!({"ev": "op", "task": 0, "seq": seq, "kind": kind, "fenced": true,
            "accepted": accepted, "t": t, "t_done": mono(), "dl": dl}),
        );
    };
    let mut res = ctx.res.clone();
    for _ in 0..rng.range(2, 8) {
        if mono() >= ctx.end {
            break;
        }
        let (t, dl) = (mono(), term_deadline(&term));
        let r: redis::RedisResult<i64> = redis::Script::new(FREAD)
            .key(F_MAX)
            .key(F_COUNTER)
            .arg(&token)
            .invoke_async(&mut res)
            .await;
        let Ok(v) = r else { break };
        op("fread", v >= 0, t, dl);
        if v < 0 {
            break;
        }
        pause(&mut rng, ctx.body_us).await;
        if term.remaining().is_zero() {
            ctx.log
                .line(json!({"ev": "invalid", "task": 0, "seq": seq, "t": mono()}));
            break;
        }
        let (t, dl) = (mono(), term_deadline(&term));
        let r: redis::RedisResult<i64> = redis::Script::new(FWRITE)
            .key(F_MAX)
            .key(F_COUNTER)
            .key(F_LOG)
            .key(F_TOKENS)
            .arg(&token)
            .arg(v + 1)
            .invoke_async(&mut res)
            .await;
        let Ok(acc) = r else { break };
        op("fwrite", acc == 1, t, dl);
        if acc != 1 {
            break;
        }
        pause(&mut rng, ctx.body_us).await;
    }
    let (t_rel, dl) = (mono(), term_deadline(&term));
    end.resigning = Some((t_rel, dl));
    let rel = match term.resign().await {
        Ok(()) => "ok",
        Err(LockError::NotOwner { .. } | LockError::Lost { .. }) => "not_owner",
        Err(_) => "err",
    };
    end.done = true;
    ctx.log.line(json!({"ev": "rel", "task": 0, "seq": seq, "t_send": t_rel, "t_done": mono(), "rel": rel, "dl": dl}));
}

/// The critical section: a fenced read-modify-write of one counter, then an unfenced one of
/// another, each read → yield + random pause → validity check → write.
async fn body(
    ctx: &Ctx,
    g: &LockGuard,
    res: &mut redis::aio::MultiplexedConnection,
    task: u64,
    seq: u64,
    rng: &mut Rng,
) {
    let token = g.fencing_token().to_string();
    let op = |kind: &str, fenced: bool, accepted: bool, t: u64, dl: Option<u64>| {
        ctx.log.line(
            json!({"ev": "op", "task": task, "seq": seq, "kind": kind, "fenced": fenced,
            "accepted": accepted, "t": t, "t_done": mono(), "dl": dl}),
        );
    };
    let invalid = |t: u64| {
        ctx.log
            .line(json!({"ev": "invalid", "task": task, "seq": seq, "t": t}))
    };

    // Fenced.
    let (t, dl) = (mono(), deadline_of(g));
    let r: redis::RedisResult<i64> = redis::Script::new(FREAD)
        .key(F_MAX)
        .key(F_COUNTER)
        .arg(&token)
        .invoke_async(res)
        .await;
    let Ok(v) = r else { return };
    op("fread", true, v >= 0, t, dl);
    if v < 0 {
        return;
    }
    pause(rng, ctx.body_us).await;
    if ctx.check && !g.is_valid() {
        return invalid(mono());
    }
    let (t, dl) = (mono(), deadline_of(g));
    let r: redis::RedisResult<i64> = redis::Script::new(FWRITE)
        .key(F_MAX)
        .key(F_COUNTER)
        .key(F_LOG)
        .key(F_TOKENS)
        .arg(&token)
        .arg(v + 1)
        .invoke_async(res)
        .await;
    let Ok(acc) = r else { return };
    op("fwrite", true, acc == 1, t, dl);
    if acc != 1 {
        return;
    }

    // Unfenced.
    let (t, dl) = (mono(), deadline_of(g));
    let r: redis::RedisResult<Option<i64>> =
        redis::cmd("GET").arg(U_COUNTER).query_async(res).await;
    let Ok(v) = r else { return };
    op("uread", false, true, t, dl);
    pause(rng, ctx.body_us).await;
    if ctx.check && !g.is_valid() {
        return invalid(mono());
    }
    let (t, dl) = (mono(), deadline_of(g));
    // Logged before sending: if this future is dropped (the lease was lost and the body
    // cancelled) or the process dies with the write on its way, the checker still knows that a
    // write may have been applied after `t`.
    ctx.log.line(
        json!({"ev": "sent", "task": task, "seq": seq, "kind": "uwrite",
        "fenced": false, "t": t}),
    );
    let r: redis::RedisResult<i64> = redis::Script::new(UWRITE)
        .key(U_COUNTER)
        .key(U_LOG)
        .arg(v.unwrap_or(0) + 1)
        .invoke_async(res)
        .await;
    if r.is_ok() {
        op("uwrite", false, true, t, dl);
    }
}

/// `yield_now` plus a random sleep of 0 to `max_us` µs (tokio's timer rounds up to 1 ms).
async fn pause(rng: &mut Rng, max_us: u64) {
    tokio::task::yield_now().await;
    let us = rng.range(0, max_us + 1);
    if us > 0 {
        tokio::time::sleep(Duration::from_micros(us)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Coordinator and nemesis
// ---------------------------------------------------------------------------------------------

/// How to start a worker: the binary and the arguments that make it one (plus [`WORKER_ENV`]).
#[derive(Debug, Clone)]
pub(crate) struct WorkerCmd {
    pub(crate) exe: PathBuf,
    pub(crate) args: Vec<String>,
}

/// Settings of one run.
#[derive(Debug, Clone)]
pub(crate) struct RunCfg {
    pub(crate) workers: usize,
    pub(crate) tasks: usize,
    pub(crate) secs: f64,
    pub(crate) nemesis: bool,
    pub(crate) ttl_ms: u64,
    pub(crate) wait_ms: u64,
    pub(crate) body_us: u64,
    pub(crate) mode: Mode,
    pub(crate) engine: Engine,
    /// What the workers take (`--workload`).
    pub(crate) workload: Workload,
    /// The semaphore workload's `max` (`--sem-max`).
    pub(crate) sem_max: u32,
    pub(crate) dir: PathBuf,
    pub(crate) seed: u64,
    pub(crate) verbose: bool,
    /// Lock on a private 3-server ZooKeeper ensemble instead of Redis (feature `zookeeper`); the
    /// nemesis then kills ensemble members and pauses or kills holders.
    pub(crate) zookeeper: bool,
    /// The engine's stated give-back bound in ms (0: the checker's default, ttl + 2 s); the
    /// orphan check uses the larger of the two.
    pub(crate) give_back_ms: u64,
    /// Sentinel: `min_replicas(n, 200 ms)` on the workers' backends (`WAIT n 200` after each
    /// grant); 0: off.
    pub(crate) min_replicas: usize,
    /// Wall-clock offsets (ms) of the lock servers, `--clock-offsets-ms 0,400,-400`; empty:
    /// the host's clock. Server `i` gets entry `i % len`: Redis (server 0), Redlock's nodes,
    /// Sentinel's master and replica, the six Redis Cluster nodes, the three ZooKeeper members
    /// (the same shim), kept across restarts. PostgreSQL and MariaDB (one server) start at entry 0
    /// and move to the next entry at each restart. etcd (a Go binary, deaf to `LD_PRELOAD`, and
    /// whose token floor is the client's clock): worker process `i` gets entry `i % len`.
    pub(crate) clock_offsets_ms: Vec<i64>,
}

impl RunCfg {
    /// The clock offset of lock server `i` (see [`RunCfg::clock_offsets_ms`]).
    pub(crate) fn clock_offset_ms(&self, i: usize) -> i64 {
        match self.clock_offsets_ms.len() {
            0 => 0,
            n => self.clock_offsets_ms[i % n],
        }
    }

    /// H1's shape: 4 × 4, ttl 1 s, nemesis on.
    pub(crate) fn new(dir: PathBuf) -> RunCfg {
        RunCfg {
            workers: 4,
            tasks: 4,
            secs: 40.0,
            nemesis: true,
            ttl_ms: 1000,
            wait_ms: 5000,
            body_us: 500,
            mode: Mode::Dlock,
            engine: Engine::Redis,
            workload: Workload::Lock,
            sem_max: 3,
            dir,
            seed: mono(),
            verbose: false,
            zookeeper: false,
            give_back_ms: 0,
            min_replicas: 0,
            clock_offsets_ms: Vec::new(),
        }
    }
}

/// What a run produced beyond the checker's report.
#[derive(Debug)]
pub(crate) struct RunResult {
    pub(crate) report: Report,
    /// Workers that exited on their own before the end with a failure status.
    pub(crate) crashed: usize,
    /// Workers still running 15 s after the end (killed).
    pub(crate) hung: usize,
    pub(crate) elapsed: Duration,
}

struct Slot {
    idx: usize,
    generation: usize,
    child: Child,
    prefix: String,
}

struct Coordinator<'a> {
    cfg: &'a RunCfg,
    cmd: &'a WorkerCmd,
    /// The lock servers: one (Redis), the Redlock nodes, or the Sentinel master and replica.
    nodes: Vec<RedisServer>,
    sentinels: Vec<SentinelServer>,
    /// Engine Redis: workers reach the lock server through it (partition faults); the nemesis
    /// talks directly.
    lock_proxy: Option<proxy::Proxy>,
    /// What workers connect to (see `connect_engine`).
    lock_url: String,
    res_url: String,
    end: u64,
    slots: Vec<Slot>,
    faults: File,
    crashed: usize,
    #[cfg(feature = "zookeeper")]
    zk: Option<zkens::Ensemble>,
    /// The servers of a [`Store`] engine.
    store: Option<Box<dyn Store>>,
}

impl Coordinator<'_> {
    fn spawn_worker(&self, idx: usize, generation: usize) -> io::Result<Slot> {
        let log_path = self
            .cfg
            .dir
            .join(format!("w{idx:02}-g{generation:03}.jsonl"));
        let stderr = File::create(
            self.cfg
                .dir
                .join(format!("stderr-w{idx:02}-g{generation:03}.log")),
        )?;
        let mut cmd = Command::new(&self.cmd.exe);
        cmd.args(&self.cmd.args)
            .env(WORKER_ENV, "1")
            .env("TORTURE_LOG", &log_path)
            .env("TORTURE_TASKS", self.cfg.tasks.to_string())
            .env("TORTURE_TTL_MS", self.cfg.ttl_ms.to_string())
            .env("TORTURE_WAIT_MS", self.cfg.wait_ms.to_string())
            .env("TORTURE_BODY_US", self.cfg.body_us.to_string())
            .env("TORTURE_MIN_REPLICAS", self.cfg.min_replicas.to_string())
            .env("TORTURE_MODE", self.cfg.mode.as_str())
            .env("TORTURE_WORKLOAD", self.cfg.workload.as_str())
            .env("TORTURE_SEM_MAX", self.cfg.sem_max.to_string())
            .env("TORTURE_ENGINE", self.cfg.engine.as_str())
            .env("TORTURE_END_NS", self.end.to_string())
            .env("TORTURE_LOCK_URL", &self.lock_url)
            .env("TORTURE_RES_URL", &self.res_url)
            .env("TORTURE_ZK_HOSTS", self.zk_hosts())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        // etcd has no server clock in its API and its Go binary reads the clock without libc:
        // the token's floor is the client's clock, so on etcd the offsets go to the workers
        // (worker `idx` at entry `idx % len`).
        if self.cfg.engine == Engine::Etcd && self.cfg.clock_offset_ms(idx) != 0 {
            let dir = self.cfg.dir.join("worker-clock");
            std::fs::create_dir_all(&dir)?;
            let lib = clock_shim(&dir)?;
            let file = dir.join(format!("clock-offset-w{idx:02}"));
            std::fs::write(
                &file,
                (self.cfg.clock_offset_ms(idx) * 1_000_000).to_ne_bytes(),
            )?;
            cmd.env("LD_PRELOAD", &lib)
                .env("DLOCK_CLOCK_OFFSET_FILE", &file);
        }
        let mut child = spawn_tied(&mut cmd)?;
        // Wait for the worker's hello line, which carries its owner-id prefix.
        let start = mono();
        loop {
            if let Ok(text) = std::fs::read_to_string(&log_path)
                && let Some(v) = text
                    .lines()
                    .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                    .find(|v| v["ev"] == "hello")
            {
                let prefix = v["prefix"].as_str().unwrap_or("").to_string();
                return Ok(Slot {
                    idx,
                    generation,
                    child,
                    prefix,
                });
            }
            if let Ok(Some(st)) = child.try_wait() {
                return Err(io::Error::other(format!(
                    "worker {idx} exited at start: {st}"
                )));
            }
            if mono() - start > 30_000_000_000 {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io::Error::other(format!(
                    "worker {idx} did not start within 30 s"
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn fault(
        &mut self,
        kind: &str,
        t_start: u64,
        t_end: u64,
        pid: Option<u32>,
        state_loss: bool,
        holder: bool,
    ) {
        let line = json!({"kind": kind, "t_start": t_start, "t_end": t_end, "pid": pid,
            "state_loss": state_loss, "holder": holder});
        let _ = writeln!(self.faults, "{line}");
        if self.cfg.verbose {
            eprintln!(
                "torture: +{:.1}s {kind} ({:.2} s){}",
                (t_start as f64 - (self.end as f64 - self.cfg.secs * 1e9 - 3e9)) / 1e9,
                (t_end - t_start) as f64 / 1e9,
                if holder {
                    ""
                } else {
                    " (no holder found; random worker)"
                }
            );
        }
    }

    fn zk_hosts(&self) -> String {
        #[cfg(feature = "zookeeper")]
        if let Some(z) = &self.zk {
            return z.hosts();
        }
        String::new()
    }

    /// The slot whose process holds the lock now, found through the owner ids in the lock hash
    /// (ZooKeeper: the session owning the lowest node, matched to the sessions workers log).
    fn holder(&self, rng: &mut Rng) -> (usize, bool) {
        #[cfg(feature = "zookeeper")]
        if let Some(z) = &self.zk {
            for _ in 0..40 {
                if let Some(sid) = z.holder_session() {
                    let needle = format!("\"sid\":\"{sid}\"");
                    if let Some(i) = self.slots.iter().position(|s| {
                        std::fs::read_to_string(
                            self.cfg
                                .dir
                                .join(format!("w{:02}-g{:03}.jsonl", s.idx, s.generation)),
                        )
                        .is_ok_and(|t| t.contains(&needle))
                    }) {
                        return (i, true);
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            return (rng.range(0, self.slots.len() as u64) as usize, false);
        }
        if self.store.is_some() {
            return match self.holder_from_logs() {
                Some(i) => (i, true),
                None => (rng.range(0, self.slots.len() as u64) as usize, false),
            };
        }
        for _ in 0..40 {
            for node in &self.nodes {
                let Some(owners) = prims::holder_owners(self.cfg.workload, node) else {
                    continue;
                };
                for owner in owners {
                    let prefix = owner.split(':').next().unwrap_or("");
                    if let Some(i) = self.slots.iter().position(|s| s.prefix == prefix) {
                        return (i, true);
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        (rng.range(0, self.slots.len() as u64) as usize, false)
    }

    /// The slot whose worker's log shows a grant with no release or lost event after it (the
    /// [`Store`] engines, whose servers the coordinator does not query).
    fn holder_from_logs(&self) -> Option<usize> {
        for _ in 0..40 {
            for (i, s) in self.slots.iter().enumerate() {
                let path = self
                    .cfg
                    .dir
                    .join(format!("w{:02}-g{:03}.jsonl", s.idx, s.generation));
                let Ok(text) = std::fs::read_to_string(path) else {
                    continue;
                };
                let mut open = std::collections::HashMap::new();
                for v in text
                    .lines()
                    .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                {
                    let (Some(task), Some(seq)) = (v["task"].as_u64(), v["seq"].as_u64()) else {
                        continue;
                    };
                    match v["ev"].as_str() {
                        Some("acq") => {
                            open.insert(task, seq);
                        }
                        Some("rel" | "lost") if open.get(&task) == Some(&seq) => {
                            open.remove(&task);
                        }
                        _ => {}
                    }
                }
                if !open.is_empty() {
                    return Some(i);
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    }

    /// The faults of a [`Store`] engine: worker kill or stop (a third of the faults), or one of
    /// the store's own.
    fn store_fault(&mut self, rng: &mut Rng) -> io::Result<()> {
        match rng.range(0, 6) {
            0 => self.worker_fault(rng, true),
            1 => self.worker_fault(rng, false),
            _ => {
                let ttl = Duration::from_millis(self.cfg.ttl_ms);
                let store = self.store.as_mut().expect("a Store engine");
                let (kind, t, state_loss) = store.fault(rng, ttl)?;
                self.fault(kind, t, mono(), None, state_loss, true);
                Ok(())
            }
        }
    }

    /// Reaps workers that died on their own, and respawns them while the run goes on.
    fn reap(&mut self) -> io::Result<()> {
        for i in 0..self.slots.len() {
            if let Ok(Some(st)) = self.slots[i].child.try_wait() {
                if mono() < self.end {
                    self.crashed += 1;
                    eprintln!("torture: worker {} exited early: {st}", self.slots[i].idx);
                    let (idx, generation) = (self.slots[i].idx, self.slots[i].generation + 1);
                    self.slots[i] = self.spawn_worker(idx, generation)?;
                } else if !st.success() {
                    self.crashed += 1;
                }
            }
        }
        Ok(())
    }

    /// Process faults on the workers, shared by every engine: SIGKILL the holder (respawned), or
    /// SIGSTOP it past its lease.
    fn worker_fault(&mut self, rng: &mut Rng, kill: bool) -> io::Result<()> {
        let (i, holder) = self.holder(rng);
        let pid = self.slots[i].child.id();
        let t = mono();
        if kill {
            signal(pid, libc::SIGKILL);
            let _ = self.slots[i].child.wait();
            let (idx, generation) = (self.slots[i].idx, self.slots[i].generation + 1);
            self.slots[i] = self.spawn_worker(idx, generation)?;
            self.fault("kill_holder", t, mono(), Some(pid), false, holder);
        } else {
            signal(pid, libc::SIGSTOP);
            std::thread::sleep(Duration::from_millis(rng.range(1500, 3001)));
            signal(pid, libc::SIGCONT);
            self.fault("stop_holder", t, mono(), Some(pid), false, holder);
        }
        Ok(())
    }

    /// Redlock's faults: worker faults, and node faults that keep or break the majority. A
    /// restarted node comes back empty (no persistence); the restarted-node rule must keep it
    /// out of quorums for a ttl, so a minority restart is not a state loss. Restarting a
    /// majority at once is (marked `state_loss`).
    fn redlock_fault(&mut self, rng: &mut Rng) -> io::Result<()> {
        let n = self.nodes.len();
        let node = rng.range(0, n as u64) as usize;
        match rng.range(0, 7) {
            0 => self.worker_fault(rng, true)?,
            1 => self.worker_fault(rng, false)?,
            2 => {
                let t = mono();
                self.nodes[node].restart()?;
                self.fault("restart_node", t, mono(), None, false, true);
            }
            3 => {
                // Down for 1.5–3 s, then back empty.
                let t = mono();
                self.nodes[node].kill();
                std::thread::sleep(Duration::from_millis(rng.range(1500, 3001)));
                self.nodes[node].restart()?;
                self.fault("kill_node", t, mono(), None, false, true);
            }
            4 => {
                let t = mono();
                let _ = self.nodes[node].cmd(&["CLIENT", "PAUSE", "1500"]);
                std::thread::sleep(Duration::from_millis(1500));
                self.fault("pause_node", t, mono(), None, false, true);
            }
            5 => {
                let t = mono();
                let _ = redis_cmd(
                    self.nodes[node].port,
                    &["DEBUG", "SLEEP", "1.5"],
                    Duration::from_secs(10),
                );
                self.fault("sleep_node", t, mono(), None, false, true);
            }
            _ => {
                let t = mono();
                for i in 0..n / 2 + 1 {
                    self.nodes[(node + i) % n].restart()?;
                }
                self.fault("restart_majority", t, mono(), None, true, true);
            }
        }
        Ok(())
    }

    /// Index in `nodes` of the master the sentinels name now.
    fn sentinel_master(&self) -> Option<usize> {
        for s in &self.sentinels {
            if let Ok(r) = redis_cmd(
                s.port,
                &["SENTINEL", "get-master-addr-by-name", SENTINEL_MASTER],
                Duration::from_secs(2),
            ) && let Some(port) = r.strings().get(1).and_then(|p| p.parse::<u16>().ok())
            {
                return self.nodes.iter().position(|n| n.port == port);
            }
        }
        None
    }

    /// Waits (bounded) until the sentinels name a master other than `old`.
    fn await_switch(&self, old: usize, within: Duration) -> bool {
        let start = mono();
        while mono() - start < within.as_nanos() as u64 {
            if self.sentinel_master().is_some_and(|m| m != old) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// Waits (bounded) until node `i` reports itself a replica with its link up.
    fn await_replica(&self, i: usize, within: Duration) {
        let start = mono();
        while mono() - start < within.as_nanos() as u64 {
            if let Ok(Resp::Bulk(Some(info))) = self.nodes[i].cmd(&["INFO", "replication"])
                && info.contains("role:slave")
                && info.contains("master_link_status:up")
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sentinel's faults: worker faults, `SENTINEL FAILOVER` and a master kill (the old master
    /// comes back empty and the sentinels make it a replica), and stalls of the master. A
    /// failover may lose recent grants (asynchronous replication): marked `state_loss`.
    fn sentinel_fault(&mut self, rng: &mut Rng) -> io::Result<()> {
        let Some(master) = self.sentinel_master() else {
            std::thread::sleep(Duration::from_millis(500));
            return Ok(());
        };
        match rng.range(0, 6) {
            0 => self.worker_fault(rng, true)?,
            1 => self.worker_fault(rng, false)?,
            2 => {
                let t = mono();
                let s = self.sentinels[rng.range(0, self.sentinels.len() as u64) as usize].port;
                let _ = redis_cmd(
                    s,
                    &["SENTINEL", "FAILOVER", SENTINEL_MASTER],
                    Duration::from_secs(5),
                );
                let switched = self.await_switch(master, Duration::from_secs(15));
                if switched {
                    self.await_replica(master, Duration::from_secs(15));
                }
                self.fault(
                    if switched {
                        "sentinel_failover"
                    } else {
                        "sentinel_failover_refused"
                    },
                    t,
                    mono(),
                    None,
                    switched,
                    true,
                );
            }
            3 => {
                // The old master comes back empty and is a master of its own until the
                // sentinels demote it: the state-loss window lasts until it is a replica.
                let t = mono();
                self.nodes[master].kill();
                let switched = self.await_switch(master, Duration::from_secs(20));
                self.nodes[master].restart()?;
                self.await_replica(master, Duration::from_secs(15));
                self.fault("kill_master", t, mono(), None, true, switched);
            }
            // Stalls shorter than the sentinels' down-after (1 s), so that they do not fail
            // over: a slow master, not a failover (which the two faults above cover).
            4 => {
                let t = mono();
                let _ = self.nodes[master].cmd(&["CLIENT", "PAUSE", "700"]);
                std::thread::sleep(Duration::from_millis(700));
                self.fault("pause_master", t, mono(), None, false, true);
            }
            _ => {
                let t = mono();
                let _ = redis_cmd(
                    self.nodes[master].port,
                    &["DEBUG", "SLEEP", "0.7"],
                    Duration::from_secs(10),
                );
                self.fault("sleep_master", t, mono(), None, false, true);
            }
        }
        Ok(())
    }

    fn nemesis(&mut self, rng: &mut Rng) -> io::Result<()> {
        let mut next = mono() + rng.range(2_000, 4_000) * 1_000_000;
        // No new fault in the last 4 s, so that the run ends with the lock working.
        while next + 4_000_000_000 < self.end {
            while mono() < next {
                std::thread::sleep(Duration::from_millis(10));
                self.reap()?;
            }
            let t0 = mono();
            #[cfg(feature = "zookeeper")]
            if self.zk.is_some() {
                self.zk_fault(rng)?;
                next = t0 + rng.range(2_000, 3_501) * 1_000_000;
                continue;
            }
            if self.store.is_some() {
                self.store_fault(rng)?;
                next = t0 + rng.range(2_000, 3_501) * 1_000_000;
                continue;
            }
            match self.cfg.engine {
                Engine::Redis => {}
                Engine::Redlock => {
                    self.redlock_fault(rng)?;
                    next = t0 + rng.range(2_000, 3_501) * 1_000_000;
                    continue;
                }
                Engine::Sentinel => {
                    self.sentinel_fault(rng)?;
                    next = t0 + rng.range(2_000, 3_501) * 1_000_000;
                    continue;
                }
                _ => unreachable!("a Store engine has a store"),
            }
            match rng.range(0, 8) {
                0 => {
                    let (i, holder) = self.holder(rng);
                    let pid = self.slots[i].child.id();
                    let t = mono();
                    signal(pid, libc::SIGKILL);
                    let _ = self.slots[i].child.wait();
                    let (idx, generation) = (self.slots[i].idx, self.slots[i].generation + 1);
                    self.slots[i] = self.spawn_worker(idx, generation)?;
                    self.fault("kill_holder", t, mono(), Some(pid), false, holder);
                }
                1 => {
                    let (i, holder) = self.holder(rng);
                    let pid = self.slots[i].child.id();
                    let t = mono();
                    signal(pid, libc::SIGSTOP);
                    std::thread::sleep(Duration::from_millis(rng.range(1500, 3001)));
                    signal(pid, libc::SIGCONT);
                    self.fault("stop_holder", t, mono(), Some(pid), false, holder);
                }
                2 => {
                    let t = mono();
                    self.nodes[0].restart()?;
                    self.fault("restart_redis", t, mono(), None, true, true);
                }
                3 => {
                    let t = mono();
                    let r = self.nodes[0].cmd(&["CLIENT", "PAUSE", "1500"])?;
                    assert_eq!(r, Resp::Simple("OK".into()), "CLIENT PAUSE");
                    std::thread::sleep(Duration::from_millis(1500));
                    self.fault("client_pause", t, mono(), None, false, true);
                }
                5 => {
                    // Replies to every worker arrive 1.5 s late (more than the ttl) for 1.5 s.
                    let t = mono();
                    let p = self.lock_proxy.as_ref().expect("engine Redis has a proxy");
                    p.set_mode(proxy::Mode::Delay(Duration::from_millis(1500)));
                    std::thread::sleep(Duration::from_millis(1500));
                    p.set_mode(proxy::Mode::Pass);
                    self.fault("proxy_delay", t, mono(), None, false, true);
                }
                6 => {
                    // Workers' bytes to and from the lock server are dropped for 1.5–2.5 s.
                    let t = mono();
                    let p = self.lock_proxy.as_ref().expect("engine Redis has a proxy");
                    p.set_mode(proxy::Mode::Blackhole);
                    std::thread::sleep(Duration::from_millis(rng.range(1500, 2501)));
                    p.set_mode(proxy::Mode::Pass);
                    self.fault("proxy_blackhole", t, mono(), None, false, true);
                }
                7 => {
                    // The late-delivery partition: workers' bytes to and from the lock server
                    // are held (not dropped) for 1.5–2.5 s, then new connections work at once
                    // and the held bytes arrive 0–1 s after the heal, each connection's later
                    // bytes behind them (what TCP retransmission does). An acquire sent into
                    // the partition and given up by its caller reaches the server after the
                    // caller's give-back was sent on a new connection, unless the give-back is
                    // ordered behind it. The window ends when the held bytes are delivered.
                    let t = mono();
                    let p = self.lock_proxy.as_ref().expect("engine Redis has a proxy");
                    p.set_mode(proxy::Mode::Hold);
                    std::thread::sleep(Duration::from_millis(rng.range(1500, 2501)));
                    let late = Duration::from_millis(rng.range(0, 1001));
                    p.heal_delivering_held_after(late);
                    std::thread::sleep(late);
                    self.fault("proxy_hold", t, mono(), None, false, true);
                }
                _ => {
                    let t = mono();
                    let r = redis_cmd(
                        self.nodes[0].port,
                        &["DEBUG", "SLEEP", "1.5"],
                        Duration::from_secs(10),
                    )?;
                    assert_eq!(r, Resp::Simple("OK".into()), "DEBUG SLEEP");
                    self.fault("debug_sleep", t, mono(), None, false, true);
                }
            }
            next = t0 + rng.range(2_000, 3_501) * 1_000_000;
        }
        Ok(())
    }
}

#[cfg(feature = "zookeeper")]
impl Coordinator<'_> {
    /// One ZooKeeper-mode fault: holder kill or pause (past the session timeout, which is the
    /// ttl), or ensemble member kills (a follower or the leader: a minority; two members: the
    /// majority), each restarted after 1.5–3 s.
    fn zk_fault(&mut self, rng: &mut Rng) -> io::Result<()> {
        match rng.range(0, 5) {
            0 => {
                let (i, holder) = self.holder(rng);
                let pid = self.slots[i].child.id();
                let t = mono();
                signal(pid, libc::SIGKILL);
                let _ = self.slots[i].child.wait();
                let (idx, generation) = (self.slots[i].idx, self.slots[i].generation + 1);
                self.slots[i] = self.spawn_worker(idx, generation)?;
                self.fault("kill_holder", t, mono(), Some(pid), false, holder);
            }
            1 => {
                let (i, holder) = self.holder(rng);
                let pid = self.slots[i].child.id();
                let t = mono();
                signal(pid, libc::SIGSTOP);
                // Past the session timeout (the ttl), so the session expires meanwhile.
                std::thread::sleep(Duration::from_millis(
                    self.cfg.ttl_ms + rng.range(500, 2001),
                ));
                signal(pid, libc::SIGCONT);
                self.fault("stop_holder", t, mono(), Some(pid), false, holder);
            }
            k => {
                let z = self.zk.as_mut().expect("zk");
                let leader = z.leader();
                let victims: Vec<usize> = match (k, leader) {
                    (2, Some(l)) => vec![(l + 1) % 3],
                    (3, Some(l)) => vec![l],
                    (_, Some(l)) => vec![l, (l + 1) % 3],
                    (_, None) => vec![rng.range(0, 3) as usize],
                };
                let kind = match (k, victims.len()) {
                    (_, 2) => "zk_kill_majority",
                    (3, _) => "zk_kill_leader",
                    _ => "zk_kill_follower",
                };
                let t = mono();
                for &v in &victims {
                    z.kill(v);
                }
                std::thread::sleep(Duration::from_millis(rng.range(1500, 3001)));
                for &v in &victims {
                    z.spawn(v)?;
                }
                // The window ends when the ensemble serves again (JVM start and an election
                // take about 2 s after a majority restart), not when the processes are
                // spawned: the slow-recovery and orphan figures start counting there.
                let start = mono();
                while z.leader().is_none() && mono() - start < 30_000_000_000 {
                    std::thread::sleep(Duration::from_millis(50));
                }
                self.fault(kind, t, mono(), None, false, true);
            }
        }
        Ok(())
    }
}

/// A private 3-server ZooKeeper ensemble for the torture's ZooKeeper mode, and the worker side.
#[cfg(feature = "zookeeper")]
mod zkens {
    use super::*;

    pub(crate) struct Ensemble {
        dir: PathBuf,
        ports: Vec<(u16, u16, u16)>,
        children: Vec<Option<Child>>,
        /// Per member: its wall-clock offset in ms (0: the host's clock), kept across the
        /// nemesis's restarts of that member.
        offsets_ms: [i64; 3],
    }

    fn classpath() -> String {
        [
            "zookeeper.jar",
            "zookeeper-jute.jar",
            "slf4j-api.jar",
            "slf4j-nop.jar",
            "netty-all.jar",
            "metrics-core.jar",
            "commons-cli.jar",
            "commons-io.jar",
        ]
        .iter()
        .map(|j| Path::new("/usr/share/java").join(j))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(":")
    }

    fn four_letter(port: u16, cmd: &str) -> Option<String> {
        use std::io::Read;
        let mut s = TcpStream::connect_timeout(
            &format!("127.0.0.1:{port}").parse().ok()?,
            Duration::from_millis(500),
        )
        .ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        s.write_all(cmd.as_bytes()).ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        Some(out)
    }

    impl Ensemble {
        pub(crate) fn start(dir: &Path, offsets_ms: [i64; 3]) -> io::Result<Ensemble> {
            let mut ports = Vec::new();
            for _ in 0..3 {
                ports.push((free_port()?, free_port()?, free_port()?));
            }
            let mut e = Ensemble {
                dir: dir.to_path_buf(),
                ports,
                children: vec![None, None, None],
                offsets_ms,
            };
            for i in 0..3 {
                e.spawn(i)?;
            }
            let start = mono();
            while !(0..3).all(|i| e.mode(i).is_some()) {
                if mono() - start > 90_000_000_000 {
                    return Err(io::Error::other(
                        "the ZooKeeper ensemble did not form in 90 s",
                    ));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            Ok(e)
        }

        pub(crate) fn spawn(&mut self, i: usize) -> io::Result<()> {
            self.kill(i);
            let home = self.dir.join(format!("zk{}", i + 1));
            let data = home.join("data");
            std::fs::create_dir_all(&data)?;
            std::fs::write(data.join("myid"), format!("{}\n", i + 1))?;
            let mut cfg = format!(
                "tickTime=250\ninitLimit=40\nsyncLimit=8\ndataDir={}\nclientPort={}\n\
                 clientPortAddress=127.0.0.1\nadmin.enableServer=false\n4lw.commands.whitelist=*\n\
                 maxClientCnxns=0\nextendedTypesEnabled=true\ncnxTimeout=500\n",
                data.display(),
                self.ports[i].0
            );
            for (j, (_, q, el)) in self.ports.iter().enumerate() {
                cfg.push_str(&format!("server.{}=127.0.0.1:{q}:{el}\n", j + 1));
            }
            std::fs::write(home.join("zoo.cfg"), cfg)?;
            let log = OpenOptions::new()
                .create(true)
                .append(true)
                .open(home.join("zk.log"))?;
            let mut cmd = Command::new("java");
            cmd.args(["-Xmx192m", "-XX:+UseSerialGC"])
                .arg("-Dznode.container.checkIntervalMs=500")
                .arg("-cp")
                .arg(classpath())
                .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
                .arg(home.join("zoo.cfg"))
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log);
            // The member's wall clock (`System.currentTimeMillis`, which the JVM reads through
            // libc's `clock_gettime`: the nodes' `ctime`, the tokens' floor) at its offset, by
            // the clock shim `tests/common/clockstep.c`; monotonic time (sessions, ticks) is left
            // alone. Not libfaketime, which `tests/common/zookeeper.rs` uses: under it this JVM
            // runs several times slower (a restarted member took 10–28 s to serve again instead
            // of 2–4 s, and a 60 s run made 11 grants).
            if self.offsets_ms[i] != 0 {
                // Not in the run directory itself, whose files the checker reads as logs.
                let lib = clock_shim(&home)?;
                let file = home.join("clock-offset");
                std::fs::write(&file, (self.offsets_ms[i] * 1_000_000).to_ne_bytes())?;
                cmd.env("LD_PRELOAD", lib)
                    .env("DLOCK_CLOCK_OFFSET_FILE", file);
            }
            self.children[i] = Some(spawn_tied(&mut cmd)?);
            Ok(())
        }

        pub(crate) fn kill(&mut self, i: usize) {
            if let Some(mut c) = self.children[i].take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }

        fn mode(&self, i: usize) -> Option<String> {
            let srvr = four_letter(self.ports[i].0, "srvr")?;
            let line = srvr.lines().find(|l| l.starts_with("Mode: "))?;
            Some(line["Mode: ".len()..].trim().to_string())
        }

        pub(crate) fn leader(&self) -> Option<usize> {
            (0..3).find(|&i| self.mode(i).as_deref() == Some("leader"))
        }

        pub(crate) fn hosts(&self) -> String {
            self.ports
                .iter()
                .map(|(c, _, _)| format!("127.0.0.1:{c}"))
                .collect::<Vec<_>>()
                .join(",")
        }

        /// The session (hex, as workers log it) owning the lowest node of the torture lock,
        /// from the leader's `dump`.
        pub(crate) fn holder_session(&self) -> Option<String> {
            let dump = four_letter(self.ports[self.leader()?].0, "dump")?;
            let dir = format!("/dlock/{}/", lock_name());
            let mut session = None;
            let mut best: Option<(u64, String)> = None;
            for line in dump.lines() {
                let l = line.trim();
                if let Some(hex) = l.strip_prefix("0x").and_then(|x| x.strip_suffix(':')) {
                    session = Some(hex.to_string());
                } else if let (Some(rest), Some(sid)) = (l.strip_prefix(&dir), &session)
                    && let Some(seq) = rest.rsplit("-lock-").next().and_then(|q| q.parse().ok())
                    && best.as_ref().is_none_or(|(b, _)| seq < *b)
                {
                    best = Some((seq, sid.clone()));
                }
            }
            best.map(|(_, s)| s)
        }
    }

    impl Drop for Ensemble {
        fn drop(&mut self) {
            for i in 0..3 {
                self.kill(i);
            }
        }
    }

    /// A worker's backend: session timeout = the ttl (the guard's lease), requests bounded by it;
    /// logs its session id (hex) now and whenever a new session replaces it, so the nemesis can
    /// find the holder's process.
    pub(crate) async fn worker_backend(
        hosts: &str,
        ttl: Duration,
        log: &Arc<Log>,
    ) -> Arc<dyn Backend> {
        let mut tries = 0;
        let b = loop {
            match dlock::ZookeeperBackend::builder(hosts)
                .session_timeout(ttl)
                .request_timeout(ttl.max(Duration::from_millis(500)))
                .build()
                .await
            {
                Ok(b) => break b,
                Err(e) if tries < 50 => {
                    tries += 1;
                    log.line(json!({"ev": "connect_retry", "t": mono(), "what": e.to_string()}));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("cannot connect to ZooKeeper: {e}"),
            }
        };
        let (b2, log) = (b.clone(), log.clone());
        tokio::spawn(async move {
            let mut last = 0;
            loop {
                let sid = b2.session_id();
                if sid != last {
                    log.line(json!({"ev": "zk_session", "t": mono(), "sid": format!("{sid:x}")}));
                    last = sid;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        Arc::new(b)
    }
}

/// A sentinel process (`redis-server conf --sentinel`), killed on drop.
pub(crate) struct SentinelServer {
    pub(crate) port: u16,
    child: Child,
}

impl SentinelServer {
    fn start(dir: &Path, master_port: u16) -> io::Result<SentinelServer> {
        std::fs::create_dir_all(dir)?;
        let mut last = None;
        for _ in 0..5 {
            let port = free_port()?;
            let conf = dir.join(format!("sentinel-{port}.conf"));
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor {SENTINEL_MASTER} 127.0.0.1 {master_port} 2\n\
                     sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\nsentinel failover-timeout {SENTINEL_MASTER} 5000\n\
                     sentinel parallel-syncs {SENTINEL_MASTER} 1\n",
                    dir.display()
                ),
            )?;
            let mut cmd = Command::new("redis-server");
            cmd.arg(&conf)
                .arg("--sentinel")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let mut child = spawn_tied(&mut cmd)?;
            let start = mono();
            while mono() - start < 5_000_000_000 {
                if let Ok(Resp::Simple(p)) = redis_cmd(port, &["PING"], Duration::from_secs(1))
                    && p == "PONG"
                {
                    return Ok(SentinelServer { port, child });
                }
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
            last = Some(io::Error::other("sentinel did not start"));
        }
        Err(last.unwrap_or_else(|| io::Error::other("sentinel did not start")))
    }
}

impl Drop for SentinelServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

type Engineset = (
    Vec<RedisServer>,
    Vec<SentinelServer>,
    Option<proxy::Proxy>,
    String,
);

/// Starts the lock servers of `cfg.engine` and says what workers connect to.
fn start_engine(cfg: &RunCfg) -> io::Result<Engineset> {
    Ok(match cfg.engine {
        // Started by `start_store`.
        Engine::Etcd | Engine::Postgres | Engine::PgAdvisory | Engine::Mysql | Engine::Cluster => {
            (Vec::new(), Vec::new(), None, String::new())
        }
        Engine::Redis => {
            let mut srv = RedisServer::start(&cfg.dir.join("redis-lock"))?;
            srv.clock_offset(cfg.clock_offset_ms(0))?;
            let proxy = proxy::Proxy::start(srv.port);
            let url = proxy.url();
            (vec![srv], Vec::new(), Some(proxy), url)
        }
        Engine::Redlock => {
            let nodes = (0..3)
                .map(|i| {
                    let mut n = RedisServer::start(&cfg.dir.join(format!("redis-node{i}")))?;
                    n.clock_offset(cfg.clock_offset_ms(i))?;
                    Ok(n)
                })
                .collect::<io::Result<Vec<_>>>()?;
            let urls = nodes.iter().map(|n| n.url()).collect::<Vec<_>>().join(",");
            (nodes, Vec::new(), None, urls)
        }
        Engine::Sentinel => {
            let mut master = RedisServer::start(&cfg.dir.join("redis-master"))?;
            master.clock_offset(cfg.clock_offset_ms(0))?;
            let mut replica = RedisServer::start_with(
                &cfg.dir.join("redis-replica"),
                &[
                    "--replicaof".into(),
                    "127.0.0.1".into(),
                    master.port.to_string(),
                ],
            )?;
            replica.clock_offset(cfg.clock_offset_ms(1))?;
            let sentinels = (0..3)
                .map(|i| SentinelServer::start(&cfg.dir.join(format!("sentinel{i}")), master.port))
                .collect::<io::Result<Vec<_>>>()?;
            // Ready when every sentinel knows the replica and the other sentinels.
            let start = mono();
            loop {
                let ready = sentinels.iter().all(|s| {
                    let replicas = redis_cmd(
                        s.port,
                        &["SENTINEL", "replicas", SENTINEL_MASTER],
                        Duration::from_secs(2),
                    );
                    let peers = redis_cmd(
                        s.port,
                        &["SENTINEL", "sentinels", SENTINEL_MASTER],
                        Duration::from_secs(2),
                    );
                    matches!(replicas, Ok(Resp::Array(ref a)) if !a.is_empty())
                        && matches!(peers, Ok(Resp::Array(ref a)) if a.len() >= 2)
                });
                if ready {
                    break;
                }
                if mono() - start > 60_000_000_000 {
                    return Err(io::Error::other(
                        "sentinels did not discover the replica and each other within 60 s",
                    ));
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            let urls = sentinels
                .iter()
                .map(|s| format!("redis://127.0.0.1:{}", s.port))
                .collect::<Vec<_>>()
                .join(",");
            (vec![master, replica], sentinels, None, urls)
        }
    })
}

/// Runs the torture: servers, `cfg.workers` worker processes, the nemesis (if on), then the
/// checker on the logs in `cfg.dir`.
pub(crate) fn run(cfg: &RunCfg, cmd: &WorkerCmd) -> io::Result<RunResult> {
    let started = std::time::Instant::now();
    ELECTION_WORKLOAD.store(cfg.workload == Workload::Election, Ordering::Relaxed);
    std::fs::create_dir_all(&cfg.dir)?;
    for e in std::fs::read_dir(&cfg.dir)? {
        let p = e?.path();
        if p.is_file() {
            std::fs::remove_file(p)?;
        }
    }
    let (nodes, sentinels, lock_proxy, mut lock_url) = start_engine(cfg)?;
    // Formed before the clock starts, like the ZooKeeper ensemble.
    let store = if cfg.engine.has_store() {
        let s = start_store(cfg)?;
        lock_url = s.url();
        Some(s)
    } else {
        None
    };
    let res_srv = RedisServer::start(&cfg.dir.join("redis-resource"))?;
    #[cfg(feature = "zookeeper")]
    let zk = if cfg.zookeeper {
        // Formed before the clock starts: the JVMs take seconds.
        Some(zkens::Ensemble::start(
            &cfg.dir,
            [0, 1, 2].map(|i| cfg.clock_offset_ms(i)),
        )?)
    } else {
        None
    };
    let mut rng = Rng::new(cfg.seed);
    // Workers start before the clock runs, so the run length is time spent contending.
    let startup_allowance = 3_000_000_000;
    let end = mono() + startup_allowance + (cfg.secs * 1e9) as u64;
    let mut co = Coordinator {
        cfg,
        cmd,
        nodes,
        sentinels,
        lock_proxy,
        lock_url,
        res_url: res_srv.url(),
        end,
        slots: Vec::new(),
        faults: File::create(cfg.dir.join("faults.jsonl"))?,
        crashed: 0,
        #[cfg(feature = "zookeeper")]
        zk,
        store,
    };
    #[cfg(not(feature = "zookeeper"))]
    if cfg.zookeeper {
        return Err(io::Error::other(
            "ZooKeeper mode needs `--features zookeeper`",
        ));
    }
    for idx in 0..cfg.workers {
        let slot = co.spawn_worker(idx, 0)?;
        co.slots.push(slot);
    }
    if cfg.verbose {
        eprintln!(
            "torture: {} workers × {} tasks, mode {}, engine {}, ttl {} ms, nemesis {}, clock offsets {:?} ms, lock servers {:?}, resource :{}, logs in {}",
            cfg.workers,
            cfg.tasks,
            cfg.mode.as_str(),
            cfg.engine.as_str(),
            cfg.ttl_ms,
            cfg.nemesis,
            cfg.clock_offsets_ms,
            co.nodes.iter().map(|n| n.port).collect::<Vec<_>>(),
            res_srv.port,
            cfg.dir.display()
        );
    }
    if cfg.nemesis {
        co.nemesis(&mut rng)?;
    }
    while mono() < end {
        std::thread::sleep(Duration::from_millis(20));
        co.reap()?;
    }
    // Drain: workers stop once their current acquire (at most `wait`) and body end.
    let drain_until = end + cfg.wait_ms * 1_000_000 + 15_000_000_000;
    let mut hung = 0;
    for s in &mut co.slots {
        loop {
            match s.child.try_wait()? {
                Some(st) => {
                    if !st.success() {
                        co.crashed += 1;
                    }
                    break;
                }
                None if mono() > drain_until => {
                    hung += 1;
                    let _ = s.child.kill();
                    let _ = s.child.wait();
                    break;
                }
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
    let get = |k: &str| {
        res_srv
            .cmd(&["GET", k])
            .ok()
            .and_then(|r| r.as_i64())
            .unwrap_or(0)
    };
    let len = |k: &str| {
        res_srv
            .cmd(&["LLEN", k])
            .ok()
            .and_then(|r| r.as_i64())
            .unwrap_or(0)
    };
    // Semaphore and read-write workloads: everything came back (all permits at once, the
    // write side) within ttl + 2 s of the workers' exit.
    let returned = prims::all_returned(cfg, &co.lock_url);
    // `t_stop` (workers stop asking) and the give-back bound let the checker judge orphans,
    // also when it re-checks these logs later.
    // Fenced writes accepted with a token below one accepted before them (the fence's own
    // log, in the server's order): must be none.
    let tokens: Vec<u64> = match res_srv.cmd(&["LRANGE", F_TOKENS, "0", "-1"]) {
        Ok(r) => r.strings().iter().filter_map(|t| t.parse().ok()).collect(),
        Err(_) => Vec::new(),
    };
    let mut max = 0;
    let mut stale_accepted = 0u64;
    for t in &tokens {
        if *t < max {
            stale_accepted += 1;
        }
        max = max.max(*t);
    }
    let resource = json!({"f_counter": get(F_COUNTER), "f_applied": len(F_LOG),
        "f_stale_accepted": stale_accepted, "f_tokens_logged": tokens.len(),
        "u_counter": get(U_COUNTER), "u_applied": len(U_LOG), "t_end": mono(), "t_stop": end,
        "give_back_ns": cfg.give_back_ms * 1_000_000, "workload": cfg.workload.as_str(),
        "sem_max": cfg.sem_max, "wait_ns": cfg.wait_ms * 1_000_000, "returned": returned});
    std::fs::write(cfg.dir.join("resource.json"), resource.to_string())?;
    let crashed = co.crashed;
    drop(co);
    drop(res_srv);
    let report = checker::check_dir(&cfg.dir, cfg.ttl_ms * 1_000_000)?;
    Ok(RunResult {
        report,
        crashed,
        hung,
        elapsed: started.elapsed(),
    })
}
