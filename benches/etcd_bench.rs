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
//! * E3 the herd, in the same run as E2 and measured the same way: 16 workers on raw clients
//!   (a connection and a lease each) run the naive recipe: create the key under the lease, then
//!   every contender watches the **whole lock prefix** and re-reads the lowest key after every
//!   delete under it, until its own key is the lowest. Reported beside E2: hand-off p50/p99,
//!   client requests per acquisition, watch events received per acquisition, and (for both
//!   E2 and E3) gRPC messages the server received per acquisition (`/metrics`,
//!   `grpc_server_msg_received_total`, keep-alives included), with the ratios E2/E3.
//!
//! Environment: `DLOCK_BENCH_SCALE` (default 1) scales the run lengths.

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
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

/// gRPC messages the server has received so far (every method, keep-alives included), from its
/// Prometheus `/metrics` on the client port.
fn server_msgs(port: u16) -> u64 {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("metrics connection");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read /metrics");
    out.lines()
        .filter(|l| l.starts_with("grpc_server_msg_received_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// One herd worker's acquisition: create its key under its lease, then re-read the lowest key
/// after every delete its prefix watch saw, until its own key is the lowest.
async fn naive_acquire(
    c: &mut Client,
    key: &str,
    lease: i64,
    deleted: &tokio::sync::Notify,
    reqs: &AtomicU64,
) {
    let lowest_opts = GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(1)
        .with_keys_only();
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, 0)])
        .and_then([
            TxnOp::put(key, "owner", Some(PutOptions::new().with_lease(lease))),
            TxnOp::get(NAIVE_PREFIX, Some(lowest_opts.clone())),
        ]);
    reqs.fetch_add(1, Ordering::Relaxed);
    let r = c.txn(txn).await.expect("naive create");
    assert!(r.succeeded());
    let mut lowest = match r.op_responses().get(1) {
        Some(dlock::etcd_client::TxnOpResponse::Get(g)) => {
            g.kvs().first().map(|kv| kv.key().to_vec())
        }
        _ => None,
    };
    loop {
        if lowest.as_deref() == Some(key.as_bytes()) {
            return;
        }
        // Registered before the re-read, so a delete in between is not missed.
        let woken = deleted.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        reqs.fetch_add(1, Ordering::Relaxed);
        let g = c
            .get(NAIVE_PREFIX, Some(lowest_opts.clone()))
            .await
            .expect("naive re-read");
        lowest = g.kvs().first().map(|kv| kv.key().to_vec());
        if lowest.as_deref() == Some(key.as_bytes()) {
            return;
        }
        tokio::time::timeout(Duration::from_secs(30), woken)
            .await
            .expect("naive waiter woken within 30 s");
    }
}

const NAIVE_PREFIX: &str = "/naive/e3/";

#[derive(Debug)]
struct Contended {
    acquisitions: usize,
    handoffs: Vec<Duration>,
    requests: u64,
    events: u64,
    server_msgs: u64,
    took: Duration,
}

impl Contended {
    fn per(&self, n: u64) -> f64 {
        n as f64 / self.acquisitions as f64
    }
}

/// E3: 16 raw clients, each with its own lease and a watch on the whole lock prefix.
async fn e3_naive(ep: &str, port: u16, acquisitions: usize) -> Contended {
    let reqs = Arc::new(AtomicU64::new(0));
    let events = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for _ in 0..E2_WORKERS {
        let mut c = Client::connect([ep], None).await.expect("naive client");
        let lease = c.lease_grant(30, None).await.expect("naive lease").id();
        let (keeper, ka) = c.lease_keep_alive(lease).await.expect("naive keep-alive");
        let mut stream = c
            .watch(
                NAIVE_PREFIX,
                Some(dlock::etcd_client::WatchOptions::new().with_prefix()),
            )
            .await
            .expect("naive prefix watch");
        let deleted = Arc::new(tokio::sync::Notify::new());
        // The herd: every worker's watch delivers every put and delete under the prefix.
        let reader = {
            let (deleted, events) = (deleted.clone(), events.clone());
            tokio::spawn(async move {
                while let Ok(Some(resp)) = stream.message().await {
                    events.fetch_add(resp.events().len() as u64, Ordering::Relaxed);
                    if resp
                        .events()
                        .iter()
                        .any(|e| e.event_type() == dlock::etcd_client::EventType::Delete)
                    {
                        deleted.notify_one();
                    }
                }
            })
        };
        workers.push((c, lease, deleted, reader, keeper, ka));
    }
    // The watches are registered before the first acquisition.
    tokio::time::sleep(Duration::from_millis(200)).await;
    reqs.store(0, Ordering::Relaxed);
    events.store(0, Ordering::Relaxed);
    let msgs0 = server_msgs(port);
    let released_at: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let handoffs = Arc::new(Mutex::new(Vec::new()));
    let done = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    let mut readers = Vec::new();
    for (mut c, lease, deleted, reader, keeper, ka) in workers {
        readers.push((reader, keeper, ka));
        let (released_at, handoffs, done, reqs) = (
            released_at.clone(),
            handoffs.clone(),
            done.clone(),
            reqs.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let key = format!("{NAIVE_PREFIX}{lease:016x}");
            loop {
                if done.load(Ordering::SeqCst) >= acquisitions || started.elapsed() > E2_LIMIT {
                    return;
                }
                naive_acquire(&mut c, &key, lease, &deleted, &reqs).await;
                let now = Instant::now();
                if let Some(t) = released_at.lock().unwrap().take() {
                    handoffs.lock().unwrap().push(now - t);
                }
                done.fetch_add(1, Ordering::SeqCst);
                *released_at.lock().unwrap() = Some(Instant::now());
                reqs.fetch_add(1, Ordering::Relaxed);
                c.delete(key.as_str(), None).await.expect("naive release");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let took = started.elapsed();
    let server = server_msgs(port) - msgs0;
    for (r, _, _) in &readers {
        r.abort();
    }
    let mut h = handoffs.lock().unwrap().clone();
    h.sort();
    Contended {
        acquisitions: done.load(Ordering::SeqCst),
        handoffs: h,
        requests: reqs.load(Ordering::Relaxed),
        events: events.load(Ordering::Relaxed),
        server_msgs: server,
        took,
    }
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
    let port = server.port;
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
        let msgs_before = server_msgs(port);
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
        let e2_msgs = server_msgs(port) - msgs_before;
        let reqs: u64 = backends.iter().map(|b| b.requests()).sum::<u64>() - req_before;
        let notes: u64 = backends.iter().map(|b| b.watch_notifications()).sum();
        let mut h = handoffs.lock().unwrap().clone();
        h.sort();
        let (p50, p99) = (pct(&h, 0.5), pct(&h, 0.99));
        let e2 = Contended {
            acquisitions: total,
            handoffs: h,
            requests: reqs,
            events: notes,
            server_msgs: e2_msgs,
            took: e2_time,
        };
        drop(backends);

        // E3: the herd, same number of acquisitions.
        let e3 = e3_naive(&ep, port, acquisitions).await;

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
        println!();
        println!("E2 (dlock, predecessor watch) against E3 (naive: every contender watches the lock prefix), 16 workers, one name, same run");
        println!("| | E2 dlock | E3 naive | ratio E2/E3 |");
        println!("| --- | --- | --- | --- |");
        let row = |what: &str, a: f64, b: f64, unit: &str| {
            println!("| {what} | {a:.2}{unit} | {b:.2}{unit} | {:.2} |", a / b);
        };
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        row("hand-off p50", ms(pct(&e2.handoffs, 0.5)), ms(pct(&e3.handoffs, 0.5)), " ms");
        row("hand-off p99", ms(pct(&e2.handoffs, 0.99)), ms(pct(&e3.handoffs, 0.99)), " ms");
        row("client requests / acquisition", e2.per(e2.requests), e3.per(e3.requests), "");
        row("watch events (dlock: notifications) / acquisition", e2.per(e2.events), e3.per(e3.events), "");
        row("server gRPC messages / acquisition", e2.per(e2.server_msgs), e3.per(e3.server_msgs), "");
        println!(
            "acquisitions: E2 {} in {:?}, E3 {} in {:?}",
            e2.acquisitions, e2.took, e3.acquisitions, e3.took
        );
    });
}
