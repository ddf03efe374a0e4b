//! `cargo bench --features etcd --bench etcd_bench`: the etcd backend against the raw floor of
//! the same engine, measured in the same run.
//!
//! The program starts its own single-member etcd (`/usr/bin/etcd`, data on tmpfs when there is
//! one, free loopback ports) and prints one table.
//!
//! * E1 uncontended: 1 task, 1 name, acquire + release pairs (wait 0). Floor: the same two
//!   requests made raw on the same kind of client: a txn that creates the key under a lease if
//!   absent and reads the name's two newest keys, then a delete. Interleaved rounds; the ratio
//!   is dlock's rate over the floor's (target >= 0.8).
//! * E2 hand-off: 16 workers, each on its own backend (its own connection and lease, as 16
//!   processes would have), take one name in turn (wait 30 s); hand-off = from the holder's
//!   release call to the next holder's grant. p50/p99 as ratios to the floor's txn round trip of
//!   the same run; requests per acquisition from the backends' own counters.
//!
//! Environment: `DLOCK_BENCH_SCALE` (default 1) scales the run lengths.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock::etcd_client::{
    Client, Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
};
use dlock::{EtcdBackend, Lock};

const E2_WORKERS: usize = 16;
const E2_LIMIT: Duration = Duration::from_secs(60);

struct Etcd {
    child: Child,
    port: u16,
    dir: std::path::PathBuf,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("no free loopback port")
        .port()
}

impl Etcd {
    fn start() -> Etcd {
        let (port, peer) = (free_port(), free_port());
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            std::path::PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("dlock-etcd-bench-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("cannot create the server's directory");
        let client = format!("http://127.0.0.1:{port}");
        let peer = format!("http://127.0.0.1:{peer}");
        let child = Command::new("/usr/bin/etcd")
            .args(["--name", "bench"])
            .arg("--data-dir")
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("bench={peer}")])
            .args(["--log-level", "error", "--logger", "zap"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start /usr/bin/etcd (apt-get install etcd-server)");
        Etcd { child, port, dir }
    }

    fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn backend(ep: &str) -> EtcdBackend {
    let started = Instant::now();
    loop {
        match EtcdBackend::builder(&[ep]).build().await {
            Ok(b) => return b,
            Err(e) if started.elapsed() > Duration::from_secs(30) => panic!("etcd: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// One raw acquisition's requests: create-if-absent under the lease + read, then delete.
async fn raw_pair(c: &mut Client, lease: i64, i: u64) -> Duration {
    let key = format!("/raw/floor/{lease:016x}-{i:016x}");
    let t0 = Instant::now();
    let txn = Txn::new()
        .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
        .and_then([
            TxnOp::put(
                key.clone(),
                "owner",
                Some(PutOptions::new().with_lease(lease)),
            ),
            TxnOp::get(
                "/raw/floor/",
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_sort(SortTarget::Create, SortOrder::Descend)
                        .with_limit(2)
                        .with_keys_only(),
                ),
            ),
        ]);
    let r = c.txn(txn).await.expect("raw txn");
    assert!(r.succeeded());
    let rtt = t0.elapsed();
    c.delete(key, None).await.expect("raw delete");
    rtt
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn main() {
    let scale: u64 = std::env::var("DLOCK_BENCH_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let server = Etcd::start();
    let ep = server.endpoint();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let b = backend(&ep).await;
        let mut raw = Client::connect([ep.as_str()], None).await.unwrap();
        let lease = raw.lease_grant(30, None).await.unwrap().id();
        let (_keeper, _stream) = raw.lease_keep_alive(lease).await.unwrap();

        // E1: interleaved rounds of dlock and the raw floor.
        let per_round = 200 * scale;
        let rounds = 5;
        let (mut dl, mut fl) = (Duration::ZERO, Duration::ZERO);
        let mut rtts = Vec::new();
        let lock = Lock::new("e1")
            .with_backend(Arc::new(b.clone()))
            .ttl(Duration::from_secs(30));
        // Warm-up (grants the backend's lease).
        for i in 0..20 {
            lock.acquire().await.unwrap().release().await.unwrap();
            raw_pair(&mut raw, lease, i).await;
        }
        let req0 = b.requests();
        for r in 0..rounds {
            let t = Instant::now();
            for _ in 0..per_round {
                lock.acquire().await.unwrap().release().await.unwrap();
            }
            dl += t.elapsed();
            let t = Instant::now();
            for i in 0..per_round {
                rtts.push(raw_pair(&mut raw, lease, 1000 + r * per_round + i).await);
            }
            fl += t.elapsed();
        }
        let n = (per_round * rounds) as f64;
        let req_per = (b.requests() - req0) as f64 / n;
        let dl_rate = n / dl.as_secs_f64();
        let fl_rate = n / fl.as_secs_f64();
        rtts.sort();
        let txn_p50 = pct(&rtts, 0.5);

        // E2: 16 workers, one name.
        let acquisitions = 400 * scale as usize;
        let mut backends = Vec::new();
        for _ in 0..E2_WORKERS {
            backends.push(backend(&ep).await);
        }
        let req_before: u64 = backends.iter().map(|b| b.requests()).sum();
        let released_at: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
        let handoffs = Arc::new(Mutex::new(Vec::new()));
        let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let started = Instant::now();
        let mut tasks = Vec::new();
        for w in backends.iter() {
            let lock = Lock::new("e2")
                .with_backend(Arc::new(w.clone()))
                .ttl(Duration::from_secs(30))
                .wait(Duration::from_secs(30));
            let (released_at, handoffs, done) =
                (released_at.clone(), handoffs.clone(), done.clone());
            tasks.push(tokio::spawn(async move {
                loop {
                    if done.load(std::sync::atomic::Ordering::SeqCst) >= acquisitions
                        || started.elapsed() > E2_LIMIT
                    {
                        return;
                    }
                    let g = lock.acquire().await.expect("E2 acquire");
                    let now = Instant::now();
                    if let Some(t) = released_at.lock().unwrap().take() {
                        handoffs.lock().unwrap().push(now - t);
                    }
                    done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    *released_at.lock().unwrap() = Some(Instant::now());
                    g.release().await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let total = done.load(std::sync::atomic::Ordering::SeqCst);
        let e2_time = started.elapsed();
        let reqs: u64 = backends.iter().map(|b| b.requests()).sum::<u64>() - req_before;
        let notes: u64 = backends.iter().map(|b| b.watch_notifications()).sum();
        let mut h = handoffs.lock().unwrap().clone();
        h.sort();
        let (p50, p99) = (pct(&h, 0.5), pct(&h, 0.99));

        println!("etcd_bench (single etcd member on tmpfs, same-run floor)");
        println!("| workload | dlock | floor | ratio |");
        println!("| --- | --- | --- | --- |");
        println!(
            "| E1 uncontended acquire+release (pairs/s) | {dl_rate:.0} | {fl_rate:.0} (txn + delete) | {:.2} |",
            dl_rate / fl_rate
        );
        println!("| E1 requests per acquisition | {req_per:.2} | 2 | {:.2} |", 2.0 / req_per);
        println!(
            "| E2 16 workers hand-off p50 | {p50:?} | txn rtt p50 {txn_p50:?} | {:.1}x |",
            p50.as_secs_f64() / txn_p50.as_secs_f64()
        );
        println!(
            "| E2 16 workers hand-off p99 | {p99:?} | txn rtt p50 {txn_p50:?} | {:.1}x |",
            p99.as_secs_f64() / txn_p50.as_secs_f64()
        );
        println!(
            "| E2 requests per acquisition | {:.2} | - | - |",
            reqs as f64 / total as f64
        );
        println!(
            "| E2 watch notifications per acquisition | {:.2} | 1 (no herd) | - |",
            notes as f64 / total as f64
        );
        println!("E2: {total} acquisitions in {e2_time:?}");
    });
}
