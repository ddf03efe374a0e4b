//! Sentinel test environments: a master, one replica and three `redis-server --sentinel`
//! processes, all private on loopback ports.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Env, Kind, RedisProc, TempDir, spawn_child};

/// The master name the sentinels monitor.
pub const MASTER: &str = "dlockmaster";

/// One `redis-server --sentinel`, killed and reaped on drop.
#[derive(Debug)]
pub struct SentinelProc {
    port: u16,
    _dir: TempDir,
    child: Option<Child>,
}

impl SentinelProc {
    /// Starts a sentinel monitoring `master_port` (quorum 2, down after 1 s).
    pub fn start(master_port: u16) -> SentinelProc {
        for _ in 0..8 {
            let port = super::free_port();
            let dir = TempDir::new("sentinel");
            let conf = dir.path().join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor {MASTER} 127.0.0.1 {master_port} 2\n\
                     sentinel down-after-milliseconds {MASTER} 1000\nsentinel failover-timeout {MASTER} 5000\n\
                     sentinel parallel-syncs {MASTER} 1\n",
                    dir.path().display()
                ),
            )
            .expect("write sentinel.conf");
            let log = std::fs::File::create(dir.path().join("sentinel.log")).expect("log");
            let mut cmd = Command::new("redis-server");
            cmd.arg(&conf)
                .arg("--sentinel")
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log"))
                .stderr(log);
            let mut child = spawn_child(cmd).unwrap_or_else(|e| {
                panic!("cannot spawn `redis-server --sentinel` (scripts/test installs redis-server): {e}")
            });
            let url = format!("redis://127.0.0.1:{port}");
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(10) {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                if super::ping(&url) {
                    return SentinelProc {
                        port,
                        _dir: dir,
                        child: Some(child),
                    };
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("could not start a sentinel after 8 attempts");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A blocking connection to this sentinel.
    pub fn admin(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .expect("sentinel url")
            .get_connection_with_timeout(Duration::from_secs(5))
            .expect("sentinel connection")
    }
}

impl Drop for SentinelProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A master, one replica and three sentinels.
#[derive(Debug)]
pub struct SentinelSet {
    pub master: Option<RedisProc>,
    pub replica: Option<RedisProc>,
    pub sentinels: Vec<SentinelProc>,
}

impl SentinelSet {
    /// Starts everything and waits until the replica is in sync and every sentinel knows it
    /// (sentinels discover replicas through the master's INFO, every 10 s at first).
    pub fn start(with_replica: bool) -> SentinelSet {
        let master = RedisProc::start();
        let mport = master.port().to_string();
        let replica =
            with_replica.then(|| RedisProc::start_with(&["--replicaof", "127.0.0.1", &mport]));
        let sentinels: Vec<SentinelProc> =
            (0..3).map(|_| SentinelProc::start(master.port())).collect();
        let set = SentinelSet {
            master: Some(master),
            replica,
            sentinels,
        };
        if !with_replica {
            return set;
        }
        let started = Instant::now();
        loop {
            let ready = set.sentinels.iter().all(|s| {
                let r: redis::RedisResult<Vec<std::collections::HashMap<String, String>>> =
                    redis::cmd("SENTINEL")
                        .arg("replicas")
                        .arg(MASTER)
                        .query(&mut s.admin());
                r.is_ok_and(|v| {
                    v.iter().any(|m| {
                        m.get("flags").is_some_and(|f| f == "slave")
                            && m.get("master-link-status").is_some_and(|l| l == "ok")
                    })
                })
            }) && {
                let r: redis::RedisResult<Vec<redis::Value>> = redis::cmd("SENTINEL")
                    .arg("sentinels")
                    .arg(MASTER)
                    .query(&mut set.sentinels[0].admin());
                r.is_ok_and(|v| v.len() >= 2)
            };
            if ready {
                return set;
            }
            assert!(
                started.elapsed() < Duration::from_secs(40),
                "sentinels did not discover the replica and each other within 40 s"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(|s| s.url()).collect()
    }

    /// The master's port as the sentinels name it now.
    pub fn master_port_now(&self) -> Option<u16> {
        let r: redis::RedisResult<Option<(String, u16)>> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(MASTER)
            .query(&mut self.sentinels[0].admin());
        r.ok().flatten().map(|(_, p)| p)
    }
}

impl Env {
    /// A master watched by three sentinels (no replica) and a `SentinelBackend` over it: the
    /// master is `server`, so the Redis checks of the shared suites apply unchanged.
    pub async fn sentinel() -> Env {
        let mut set = tokio::task::spawn_blocking(|| SentinelSet::start(false))
            .await
            .expect("start the sentinel set");
        let b = dlock::SentinelBackend::connect(MASTER, set.sentinel_urls())
            .await
            .expect("connect through the sentinels");
        Env {
            kind: Kind::Redis,
            server: set.master.take(),
            nodes: Vec::new(),
            mem: None,
            db: None,
            #[cfg(feature = "zookeeper")]
            zk: None,
            primary: Arc::new(b),
            extra: vec![Box::new(set)],
        }
    }
}
