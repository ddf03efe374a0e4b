//! `cargo bench --bench election_failover --all-features`: failover time of a leader election
//! after the leader's process is killed (issue 22, item 6), per engine, against its bound.
//!
//! Two candidate processes (this binary re-executed with `DLOCK_FAILOVER_CHILD`) campaign with
//! `Election::campaign` on a private server (PostgreSQL: the shared test server, a table of its
//! own); the one that leads prints its epoch and holds its term. The coordinator waits until the
//! other candidate is campaigning, SIGKILLs the leader (a real crash: no give-back, the watchdog
//! stops with the process), and measures, on the host's `CLOCK_MONOTONIC`, the time from the
//! kill to the moment the other candidate's term began; then it starts a fresh candidate in the
//! dead one's place, and repeats. The kill lands at a random point of the leader's renewal
//! cycle (renewals every ttl/3), so a failover after a crash takes between 2/3 of the bound and
//! the bound, plus the time the waiting candidate needs to notice.
//!
//! The bound per engine: the lease ttl (Redis, etcd, PostgreSQL table mode), the session
//! timeout (ZooKeeper, where the term's ttl is the session timeout here). Reported: median and
//! p99 over `DLOCK_BENCH_RUNS` (default 50) kills, as ratios of the bound.
//!
//! `DLOCK_BENCH_ENGINES=redis,etcd` picks engines (default: every engine of this build among
//! redis, etcd, zookeeper, postgres); `DLOCK_BENCH_TTL_MS` (default 2000) is the bound.

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use dlock::{Backend, Election, LockError};

const CHILD_ENV: &str = "DLOCK_FAILOVER_CHILD";
const LINE: &str = "FAILOVER:";
const NAME: &str = "failover";

fn mono() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn env_num(k: &str, d: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

/// Every engine of this build, in the order they run.
fn all_engines() -> Vec<&'static str> {
    let mut v = vec!["redis"];
    if cfg!(feature = "etcd") {
        v.push("etcd");
    }
    if cfg!(feature = "zookeeper") {
        v.push("zookeeper");
    }
    if cfg!(feature = "postgres") {
        v.push("postgres");
    }
    v
}

async fn connect(engine: &str, url: &str, ttl: Duration) -> Result<Arc<dyn Backend>, LockError> {
    let _ = ttl;
    Ok(match engine {
        #[cfg(feature = "etcd")]
        "etcd" => Arc::new(
            dlock::EtcdBackend::builder(&[url.to_string()])
                .request_timeout(Duration::from_secs(1))
                .build()
                .await?,
        ),
        #[cfg(feature = "zookeeper")]
        "zookeeper" => Arc::new(
            dlock::ZookeeperBackend::builder(url)
                .session_timeout(ttl)
                .build()
                .await?,
        ),
        #[cfg(feature = "postgres")]
        "postgres" => Arc::new(
            dlock::PostgresBackend::builder(url)
                .table(table())
                .connect()
                .await?,
        ),
        _ => Arc::new(dlock::RedisBackend::connect(url).await?),
    })
}

fn say(msg: String) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{LINE} {msg}");
    let _ = out.flush();
}

/// A candidate: campaigns once, says when it leads, holds the term until killed.
fn child_main() -> ! {
    let engine = std::env::var("FO_ENGINE").unwrap();
    let url = std::env::var("FO_URL").unwrap();
    let ttl = Duration::from_millis(env_num("FO_TTL_MS", 2000));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let backend = connect(&engine, &url, ttl).await.expect("connect");
        let election = Election::new(NAME).ttl(ttl).with_backend(backend);
        say(format!("campaigning {}", mono()));
        let term = election.campaign().await.expect("campaign");
        say(format!("lead {} {}", term.epoch(), mono()));
        let reason = term.lost().await;
        say(format!("lost {reason}"));
    });
    std::process::exit(3)
}

struct Candidate {
    child: Child,
}

impl Drop for Candidate {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Lines from every candidate: (slot, generation, text).
type Lines = mpsc::Sender<(usize, usize, String)>;

fn spawn(
    engine: &str,
    url: &str,
    ttl: Duration,
    slot: usize,
    generation: usize,
    tx: &Lines,
) -> Candidate {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env(CHILD_ENV, "1")
        .env("FO_ENGINE", engine)
        .env("FO_URL", url)
        .env("FO_TTL_MS", ttl.as_millis().to_string())
        .env("FO_TABLE", table())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = common::spawn_child(cmd).expect("spawn a candidate");
    let out = child.stdout.take().unwrap();
    let tx = tx.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix(LINE)
                && tx
                    .send((slot, generation, rest.trim().to_string()))
                    .is_err()
            {
                break;
            }
        }
    });
    Candidate { child }
}

/// The PostgreSQL table of this run (the coordinator's pid, passed down to the candidates).
fn table() -> String {
    std::env::var("FO_TABLE").unwrap_or_else(|_| format!("dlock_failover_{}", std::process::id()))
}

/// The lock server of `engine`, kept alive while the runs go on (held, never read), and its URL.
#[allow(dead_code)]
enum Server {
    Redis(common::RedisProc),
    #[cfg(feature = "etcd")]
    Etcd(common::etcd::EtcdCluster),
    #[cfg(feature = "zookeeper")]
    Zk(common::zookeeper::ZkProc),
    #[cfg(feature = "postgres")]
    Pg,
}

fn start(engine: &str) -> (Server, String) {
    match engine {
        #[cfg(feature = "etcd")]
        "etcd" => {
            let c = common::etcd::EtcdCluster::single();
            let url = c.endpoints()[0].clone();
            (Server::Etcd(c), url)
        }
        #[cfg(feature = "zookeeper")]
        "zookeeper" => {
            let z = common::zookeeper::ZkProc::start();
            let url = z.hosts();
            (Server::Zk(z), url)
        }
        #[cfg(feature = "postgres")]
        "postgres" => (Server::Pg, common::sql::pg_url()),
        _ => {
            let r = common::RedisProc::start();
            let url = r.url();
            (Server::Redis(r), url)
        }
    }
}

fn pct(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn main() {
    if std::env::var_os(CHILD_ENV).is_some() {
        child_main();
    }
    let runs = env_num("DLOCK_BENCH_RUNS", 50) as usize;
    let ttl = Duration::from_millis(env_num("DLOCK_BENCH_TTL_MS", 2000));
    let engines: Vec<String> = match std::env::var("DLOCK_BENCH_ENGINES") {
        Ok(v) => v.split(',').map(|s| s.trim().to_string()).collect(),
        Err(_) => all_engines().iter().map(|s| s.to_string()).collect(),
    };
    println!(
        "election failover after SIGKILL of the leader: {runs} runs per engine, bound (ttl / session timeout) {ttl:?}"
    );
    println!(
        "{:<10} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "engine", "p50 ms", "p99 ms", "max ms", "p50/bnd", "p99/bnd", "max/bnd"
    );
    for engine in &engines {
        let (server, url) = start(engine);
        let (tx, rx) = mpsc::channel();
        let mut slots = [
            Some(spawn(engine, &url, ttl, 0, 0, &tx)),
            Some(spawn(engine, &url, ttl, 1, 0, &tx)),
        ];
        let mut generation = [0usize; 2];
        let mut leader: Option<usize> = None;
        let mut campaigning = [false; 2];
        let mut times = Vec::new();
        let mut t_kill = 0u64;
        let deadline = |d: Duration| std::time::Instant::now() + d;
        let mut limit = deadline(ttl * 4 + Duration::from_secs(30));
        while times.len() < runs {
            let now = std::time::Instant::now();
            assert!(now < limit, "{engine}: no new leader in time");
            let Ok((slot, g, text)) = rx.recv_timeout(limit - now) else {
                panic!("{engine}: no line from the candidates in time");
            };
            if g != generation[slot] {
                continue;
            }
            let mut parts = text.split(' ');
            match parts.next() {
                Some("campaigning") => campaigning[slot] = true,
                Some("lead") => {
                    let t: u64 = parts.nth(1).and_then(|t| t.parse().ok()).unwrap();
                    if t_kill > 0 {
                        times.push((t - t_kill) as f64 / 1e6);
                    }
                    leader = Some(slot);
                    campaigning[slot] = false;
                }
                _ => {}
            }
            // Kill the leader once the other candidate campaigns (it is queued behind it after
            // a short settle).
            if let Some(l) = leader
                && campaigning[1 - l]
            {
                std::thread::sleep(Duration::from_millis(300 + (times.len() as u64 * 37) % 400));
                t_kill = mono();
                // SIGKILL and reap (Drop).
                slots[l] = None;
                generation[l] += 1;
                slots[l] = Some(spawn(engine, &url, ttl, l, generation[l], &tx));
                leader = None;
                campaigning[l] = false;
                limit = deadline(ttl * 4 + Duration::from_secs(30));
            }
        }
        drop(slots);
        drop(server);
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let b = ttl.as_secs_f64() * 1000.0;
        let (p50, p99, max) = (pct(&times, 0.5), pct(&times, 0.99), times[times.len() - 1]);
        println!(
            "{:<10} {:>8.0} {:>8.0} {:>8.0} {:>8.2} {:>8.2} {:>8.2}",
            engine,
            p50,
            p99,
            max,
            p50 / b,
            p99 / b,
            max / b
        );
    }
}
