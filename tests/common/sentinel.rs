//! Sentinel test environments: a master, one replica and three `redis-server --sentinel`
//! processes, all private on loopback ports.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
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

    /// SIGSTOP: the sentinel stops answering and reading; its sockets stay open.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// SIGCONT after [`SentinelProc::pause`].
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, sig: libc::c_int) {
        let pid = self.child.as_ref().expect("running").id();
        // SAFETY: kill(2) on a child this harness spawned and has not reaped.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, sig) }, 0);
    }

    /// The master's address as this sentinel names it now.
    pub fn names(&self) -> Option<(String, u16)> {
        redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(MASTER)
            .query(&mut self.admin())
            .ok()
            .flatten()
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
            // SAFETY: as in `signal`; a paused sentinel is killed all the same.
            unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGCONT) };
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
        Self::start_inner(with_replica, None)
    }

    /// Like `start(true)`, with the replica known to everyone (sentinels, and so clients after a
    /// failover) by the address of `front` (`replica-announce-port`), which forwards to it.
    pub fn start_with_replica_behind(front: &SubscribeDelay) -> SentinelSet {
        Self::start_inner(true, Some(front))
    }

    fn start_inner(with_replica: bool, front: Option<&SubscribeDelay>) -> SentinelSet {
        let master = RedisProc::start();
        let mport = master.port().to_string();
        let replica = with_replica.then(|| match front {
            None => RedisProc::start_with(&["--replicaof", "127.0.0.1", &mport]),
            Some(f) => {
                let announce = f.port().to_string();
                let r = RedisProc::start_with(&[
                    "--replicaof",
                    "127.0.0.1",
                    &mport,
                    "--replica-announce-port",
                    &announce,
                ]);
                f.forward_to(r.port());
                r
            }
        });
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

/// A loopback TCP proxy in front of one server that holds back, while a delay is set, every
/// chunk of client bytes that carries a `SUBSCRIBE` of a dlock channel by that delay (later
/// bytes of that connection wait behind it); everything else passes at once. With it, a
/// waiter's subscription on a new master is confirmed late while its tries and the holder's
/// release go through: the window in which a release reaches nobody, made wide.
#[derive(Debug)]
pub struct SubscribeDelay {
    port: u16,
    upstream: Arc<AtomicU16>,
    delay_ms: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl SubscribeDelay {
    /// Listens on a free loopback port; [`SubscribeDelay::forward_to`] names the server.
    pub fn start() -> SubscribeDelay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().expect("proxy addr").port();
        let upstream = Arc::new(AtomicU16::new(0));
        let delay_ms = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (up, delay, st) = (upstream.clone(), delay_ms.clone(), stop.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if st.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", up.load(Ordering::SeqCst)))
                else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (mut c_read, mut s_write) = (
                    client.try_clone().expect("clone"),
                    server.try_clone().expect("clone"),
                );
                let (mut s_read, mut c_write) = (server, client);
                let delay = delay.clone();
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match c_read.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        let chunk = &buf[..n];
                        let d = delay.load(Ordering::SeqCst);
                        if d > 0 && contains(chunk, b"SUBSCRIBE") && contains(chunk, b"dlock:") {
                            std::thread::sleep(Duration::from_millis(d));
                        }
                        if s_write.write_all(chunk).is_err() {
                            break;
                        }
                    }
                    let _ = s_write.shutdown(std::net::Shutdown::Both);
                });
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut s_read, &mut c_write);
                    let _ = c_write.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        SubscribeDelay {
            port,
            upstream,
            delay_ms,
            stop,
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn forward_to(&self, port: u16) {
        self.upstream.store(port, Ordering::SeqCst);
    }

    /// From now on, a chunk carrying a `SUBSCRIBE` of a dlock channel waits `d` (zero: none).
    pub fn delay_subscribe(&self, d: Duration) {
        self.delay_ms.store(d.as_millis() as u64, Ordering::SeqCst);
    }
}

impl Drop for SubscribeDelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
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
