//! `cargo bench --bench zk_bench --features zookeeper`: the ZooKeeper backend against floors and
//! a naive variant measured in the same run, on a private standalone ZooKeeper started from
//! Debian's jars (`/usr/share/java/zookeeper.jar`) on a free loopback port in a temp dir.
//!
//! * Z1 uncontended: 1 task, 1 name, acquire + release pairs through the `Backend` trait,
//!   against a floor of the same number of the raw operations one acquisition needs on a plain
//!   `zookeeper-client` session (create ephemeral sequential + getChildren + delete).
//!   Interleaved rounds; ratio = lock pairs/s ÷ floor pairs/s (target ≥ 0.8).
//! * Z2 hand-off: 16 workers, each with a session of its own (as 16 processes would have), on
//!   one name; each acquires (wait 60 s), holds ~1 ms, releases. Hand-off = next grant − previous
//!   release. Against a naive recipe in the same run: every contender watches the lock node's
//!   children (getChildren + watch, re-listed on every change: the herd). Reported: hand-off
//!   p50/p99, server packets received per acquisition (`mntr`), watch notifications per
//!   acquisition.
//!
//! `DLOCK_BENCH_ROUNDS` (default 5) rounds of `DLOCK_BENCH_PAIRS` (default 300) pairs for Z1;
//! `DLOCK_BENCH_ACQ` (default 20) acquisitions per worker for Z2.

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock::{Backend, Lock, ZookeeperBackend};
use zookeeper_client as zk;

const TTL: Duration = Duration::from_secs(30);
const WORKERS: usize = 16;

fn env_num(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn pct(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

struct Server {
    port: u16,
    dir: std::path::PathBuf,
    child: Child,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn four_letter(port: u16, cmd: &str) -> Option<String> {
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

fn packets_received(port: u16) -> u64 {
    four_letter(port, "mntr")
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("zk_packets_received"))
                .and_then(|v| v.trim().parse().ok())
        })
        .expect("mntr zk_packets_received")
}

fn start_server() -> Server {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = std::env::temp_dir().join(format!("dlock-zk-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("data")).unwrap();
    std::fs::write(
        dir.join("zoo.cfg"),
        format!(
            "tickTime=250\ndataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
             admin.enableServer=false\n4lw.commands.whitelist=*\nmaxClientCnxns=0\n\
             extendedTypesEnabled=true\n",
            dir.join("data").display()
        ),
    )
    .unwrap();
    let jars = [
        "zookeeper.jar",
        "zookeeper-jute.jar",
        "slf4j-api.jar",
        "slf4j-nop.jar",
        "netty-all.jar",
        "metrics-core.jar",
        "commons-cli.jar",
        "commons-io.jar",
    ];
    let cp = jars
        .iter()
        .map(|j| std::path::Path::new("/usr/share/java").join(j))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(":");
    let log = std::fs::File::create(dir.join("zk.log")).unwrap();
    let child = Command::new("java")
        .args(["-Xmx256m", "-XX:+UseSerialGC", "-cp", &cp])
        .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
        .arg(dir.join("zoo.cfg"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("java (install Debian's zookeeper)");
    let s = Server { port, dir, child };
    let start = Instant::now();
    while four_letter(port, "ruok").as_deref() != Some("imok")
        || !four_letter(port, "srvr").is_some_and(|x| x.contains("Mode"))
    {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "ZooKeeper did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    s
}

async fn client(hosts: &str) -> zk::Client {
    zk::Client::connector()
        .session_timeout(Duration::from_secs(10))
        .connect(hosts)
        .await
        .expect("client")
}

async fn lock_pairs(b: &dyn Backend, n: usize) -> Duration {
    let t = Instant::now();
    for _ in 0..n {
        let r = b.try_acquire("bench", "owner-1", TTL).await.unwrap();
        assert!(
            matches!(r, dlock::backend::Acquired::Granted { .. }),
            "{r:?}"
        );
        let r = b.release("bench", "owner-1", None, true).await.unwrap();
        assert_eq!(r, dlock::backend::Released::Freed);
    }
    t.elapsed()
}

async fn floor_pairs(c: &zk::Client, dir: &str, n: usize) -> Duration {
    let opts = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    let prefix = format!("{dir}/_c_00000000000000000000000000000000-lock-");
    let t = Instant::now();
    for _ in 0..n {
        let (_, seq) = c.create(&prefix, b"", &opts).await.unwrap();
        let kids = c.list_children(dir).await.unwrap();
        assert!(!kids.is_empty());
        c.delete(&format!("{prefix}{seq}"), None).await.unwrap();
    }
    t.elapsed()
}

#[derive(Default)]
struct Z2 {
    handoffs: Vec<Duration>,
    packets_per_acq: f64,
    notifications_per_acq: f64,
    acquisitions: usize,
}

/// Hand-off samples from (grant, release) instants in grant order.
fn handoffs(events: &mut [(Instant, Instant)]) -> Vec<Duration> {
    events.sort_by_key(|e| e.0);
    let mut out: Vec<Duration> = events
        .windows(2)
        .map(|w| w[1].0.saturating_duration_since(w[0].1))
        .collect();
    out.sort();
    out
}

async fn z2_dlock(hosts: &str, port: u16, per: usize) -> Z2 {
    let mut backends = Vec::new();
    for _ in 0..WORKERS {
        backends.push(
            ZookeeperBackend::builder(hosts)
                .session_timeout(Duration::from_secs(10))
                .build()
                .await
                .unwrap(),
        );
    }
    let events = Arc::new(Mutex::new(Vec::new()));
    let before = packets_received(port);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut tasks = Vec::new();
    for b in &backends {
        let lock = Lock::new("handoff")
            .with_backend(Arc::new(b.clone()))
            .wait(Duration::from_secs(60));
        let events = events.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..per {
                if Instant::now() > deadline {
                    break;
                }
                let g = lock.acquire().await.expect("acquire");
                let got = Instant::now();
                tokio::time::sleep(Duration::from_millis(1)).await;
                let rel = Instant::now();
                g.release().await.unwrap();
                events.lock().unwrap().push((got, rel));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let after = packets_received(port);
    let mut ev = events.lock().unwrap().clone();
    let n = ev.len();
    let notes: u64 = backends.iter().map(|b| b.watch_notifications()).sum();
    Z2 {
        handoffs: handoffs(&mut ev),
        packets_per_acq: (after - before) as f64 / n as f64,
        notifications_per_acq: notes as f64 / n as f64,
        acquisitions: n,
    }
}

/// The herd: every contender lists the lock node's children with a watch and re-lists on every
/// change until its node is the lowest.
async fn z2_naive(hosts: &str, port: u16, per: usize) -> Z2 {
    let dir = "/naive-handoff";
    let setup = client(hosts).await;
    let _ = setup
        .create(
            dir,
            b"",
            &zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()),
        )
        .await;
    let mut clients = Vec::new();
    for _ in 0..WORKERS {
        clients.push(client(hosts).await);
    }
    let events = Arc::new(Mutex::new(Vec::new()));
    let notes = Arc::new(AtomicU64::new(0));
    let before = packets_received(port);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut tasks = Vec::new();
    for c in clients {
        let events = events.clone();
        let notes = notes.clone();
        tasks.push(tokio::spawn(async move {
            let opts = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
            for _ in 0..per {
                if Instant::now() > deadline {
                    break;
                }
                let (_, seq) = c.create(&format!("{dir}/lock-"), b"", &opts).await.unwrap();
                let mine = format!("lock-{seq}");
                loop {
                    let (kids, w) = c.list_and_watch_children(dir).await.unwrap();
                    let lowest = kids.iter().min().cloned();
                    if lowest.as_deref() == Some(mine.as_str()) {
                        break;
                    }
                    let _ = tokio::time::timeout(Duration::from_secs(60), w.changed()).await;
                    notes.fetch_add(1, Ordering::Relaxed);
                }
                let got = Instant::now();
                tokio::time::sleep(Duration::from_millis(1)).await;
                let rel = Instant::now();
                c.delete(&format!("{dir}/{mine}"), None).await.unwrap();
                events.lock().unwrap().push((got, rel));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let after = packets_received(port);
    let mut ev = events.lock().unwrap().clone();
    let n = ev.len();
    Z2 {
        handoffs: handoffs(&mut ev),
        packets_per_acq: (after - before) as f64 / n as f64,
        notifications_per_acq: notes.load(Ordering::Relaxed) as f64 / n as f64,
        acquisitions: n,
    }
}

fn main() {
    let server = start_server();
    let hosts = format!("127.0.0.1:{}", server.port);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let rounds = env_num("DLOCK_BENCH_ROUNDS", 5);
        let n = env_num("DLOCK_BENCH_PAIRS", 300);
        let b = ZookeeperBackend::builder(&hosts).build().await.unwrap();
        let c = client(&hosts).await;
        let dir = "/floor";
        let _ = c
            .create(dir, b"", &zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()))
            .await;
        // Warm-up (lock parent, JIT of the server).
        lock_pairs(&b, 50).await;
        floor_pairs(&c, dir, 50).await;
        let (mut lock_t, mut floor_t) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..rounds {
            lock_t += lock_pairs(&b, n).await;
            floor_t += floor_pairs(&c, dir, n).await;
        }
        let total = (rounds * n) as f64;
        let lock_rate = total / lock_t.as_secs_f64();
        let floor_rate = total / floor_t.as_secs_f64();
        println!(
            "Z1 uncontended: dlock {lock_rate:.0} pairs/s, floor (create+getChildren+delete) {floor_rate:.0}/s, ratio {:.2} (target >= 0.8)",
            lock_rate / floor_rate
        );

        let per = env_num("DLOCK_BENCH_ACQ", 20);
        let d = z2_dlock(&hosts, server.port, per).await;
        let h = z2_naive(&hosts, server.port, per).await;
        for (name, z) in [("dlock (predecessor watch)", &d), ("naive (watch the lock node)", &h)] {
            println!(
                "Z2 {name}: {} acquisitions, hand-off p50 {:?} p99 {:?}, packets/acq {:.1}, notifications/acq {:.2}",
                z.acquisitions,
                pct(&z.handoffs, 0.5),
                pct(&z.handoffs, 0.99),
                z.packets_per_acq,
                z.notifications_per_acq
            );
        }
        println!(
            "Z2 ratios dlock/naive: hand-off p50 {:.2}, p99 {:.2}, packets/acq {:.2}, notifications/acq {:.2}",
            pct(&d.handoffs, 0.5).as_secs_f64() / pct(&h.handoffs, 0.5).as_secs_f64(),
            pct(&d.handoffs, 0.99).as_secs_f64() / pct(&h.handoffs, 0.99).as_secs_f64(),
            d.packets_per_acq / h.packets_per_acq,
            d.notifications_per_acq / h.notifications_per_acq
        );
    });
}
