//! Redis Cluster against one Redis server, same run (feature `cluster`): starts one private
//! `redis-server` and a private cluster of 3 masters (`redis-server --cluster-enabled yes` +
//! `redis-cli --cluster create`), all on free loopback ports in temp dirs, killed at exit (also
//! via `PR_SET_PDEATHSIG`).
//!
//! * W2: 64 tasks on distinct keys, acquire + release pairs through the `Backend` trait;
//!   pairs/s, interleaved rounds; ratio cluster / single.
//! * W3: 16 workers contend for one key (`Lock::wait`, non-atomic increment, release),
//!   1,000 acquisitions: cross-worker hand-off p50/p99 (release → the next worker's grant) and
//!   acquire-script runs (`try_acquire` calls) per acquisition.
//!
//! ```sh
//! cargo bench --bench cluster_bench --features cluster
//! DLOCK_BENCH_ROUNDS=5 DLOCK_BENCH_PAIRS=200 cargo bench --bench cluster_bench --features cluster
//! ```

#[path = "common/redis_server.rs"]
mod redis_server;

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock::backend::{Acquired, BoxFuture, Extended, Released, Watch};
use dlock::{Backend, ClusterBackend, Lock, LockError, RedisBackend};
use redis_server::Server;

const W2_TASKS: usize = 64;
const W3_TASKS: usize = 16;
const W3_ACQUISITIONS: usize = 1_000;
const W3_LIMIT: Duration = Duration::from_secs(60);

fn start_cluster() -> Vec<Server> {
    let nodes: Vec<Server> = (0..3)
        .map(|_| {
            Server::start(
                "clbench",
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                ],
            )
        })
        .collect();
    let out = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)))
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .stdin(Stdio::null())
        .output()
        .expect("redis-cli --cluster create");
    assert!(out.status.success(), "cluster create failed");
    let started = Instant::now();
    while !nodes.iter().all(|n| {
        redis::Client::open(n.url())
            .and_then(|c| c.get_connection())
            .and_then(|mut c| redis::cmd("CLUSTER").arg("INFO").query::<String>(&mut c))
            .is_ok_and(|i| i.contains("cluster_state:ok"))
    }) {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "cluster not ok"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    nodes
}

/// Counts `try_acquire` calls (one acquire-script run each) of the backend it wraps.
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn Backend>,
    tries: AtomicUsize,
}

impl Backend for Counting {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        self.tries.fetch_add(1, Ordering::Relaxed);
        self.inner.try_acquire(name, owner, ttl)
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
        self.inner.watch(name)
    }
    fn has_waiters(&self, name: &str) -> bool {
        self.inner.has_waiters(name)
    }
}

/// W2: pairs/s of 64 tasks on distinct keys.
async fn w2(b: Arc<dyn Backend>, tag: &str, per_task: usize) -> f64 {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..W2_TASKS {
        let b = b.clone();
        let key = format!("w2:{tag}:{i}");
        tasks.push(tokio::spawn(async move {
            for _ in 0..per_task {
                let r = b
                    .try_acquire(&key, "bench-owner", Duration::from_secs(30))
                    .await
                    .expect("acquire");
                assert!(matches!(r, Acquired::Granted { .. }), "{r:?}");
                b.release(&key, "bench-owner", None, true)
                    .await
                    .expect("release");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    (W2_TASKS * per_task) as f64 / start.elapsed().as_secs_f64()
}

struct W3 {
    done: usize,
    cross: Vec<Duration>,
    tries_per_acq: f64,
    lost_updates: u64,
}

/// W3: 16 workers, one key.
async fn w3(b: Arc<dyn Backend>, name: &'static str) -> W3 {
    let counting = Arc::new(Counting {
        inner: b,
        tries: AtomicUsize::new(0),
    });
    let tickets = Arc::new(AtomicUsize::new(0));
    let counter = Arc::new(AtomicU64::new(0));
    let recs = Arc::new(Mutex::new(Vec::with_capacity(W3_ACQUISITIONS)));
    let mut tasks = Vec::new();
    for worker in 0..W3_TASKS {
        let (b, tickets, counter, recs) = (
            counting.clone() as Arc<dyn Backend>,
            tickets.clone(),
            counter.clone(),
            recs.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while tickets.fetch_add(1, Ordering::Relaxed) < W3_ACQUISITIONS {
                let g = match Lock::new(name)
                    .with_backend(b.clone())
                    .wait(Duration::from_secs(10))
                    .acquire()
                    .await
                {
                    Ok(g) => g,
                    Err(e) => {
                        eprintln!("W3 worker {worker}: {e}");
                        continue;
                    }
                };
                let acquired = Instant::now();
                let v = counter.load(Ordering::Relaxed);
                tokio::task::yield_now().await;
                counter.store(v + 1, Ordering::Relaxed);
                let _ = g.release().await;
                recs.lock()
                    .unwrap()
                    .push((worker, acquired, Instant::now()));
            }
        }));
    }
    let all = async {
        for t in tasks {
            let _ = t.await;
        }
    };
    if tokio::time::timeout(W3_LIMIT, all).await.is_err() {
        eprintln!("W3 ({name}): stopped after {W3_LIMIT:?}");
    }
    let mut recs = recs.lock().unwrap().clone();
    recs.sort_by_key(|r| r.1);
    let cross = recs
        .windows(2)
        .filter(|w| w[0].0 != w[1].0)
        .map(|w| w[1].1.saturating_duration_since(w[0].2))
        .collect();
    let done = recs.len();
    W3 {
        done,
        cross,
        tries_per_acq: counting.tries.load(Ordering::Relaxed) as f64 / done.max(1) as f64,
        lost_updates: done as u64 - counter.load(Ordering::Relaxed),
    }
}

fn pct(v: &mut [Duration], p: usize) -> Duration {
    v.sort();
    v[(v.len() * p / 100).min(v.len() - 1)]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::var("DLOCK_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let per_task: usize = std::env::var("DLOCK_BENCH_PAIRS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    let single = Server::start("clbench", &[]);
    let cluster = start_cluster();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let s: Arc<dyn Backend> = Arc::new(RedisBackend::connect(&single.url()).await.unwrap());
        let c: Arc<dyn Backend> = Arc::new(
            ClusterBackend::connect(cluster.iter().map(Server::url))
                .await
                .unwrap(),
        );
        w2(s.clone(), "warm", 10).await;
        w2(c.clone(), "warm", 10).await;
        let (mut rs, mut rc, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            let (a, b) = if round % 2 == 0 {
                let a = w2(s.clone(), "s", per_task).await;
                (a, w2(c.clone(), "c", per_task).await)
            } else {
                let b = w2(c.clone(), "c", per_task).await;
                (w2(s.clone(), "s", per_task).await, b)
            };
            rs.push(a);
            rc.push(b);
            ratio.push(b / a);
        }
        println!(
            "dlock cluster_bench: W2 {rounds} rounds x {W2_TASKS} tasks x {per_task} pairs, 2 workers"
        );
        println!(
            "W2 single  {:>9.0} pairs/s (median)",
            median(rs)
        );
        println!(
            "W2 cluster {:>9.0} pairs/s (median)  ratio cluster/single {:.2}x (median of rounds)",
            median(rc),
            median(ratio)
        );
        let mut ws = w3(s.clone(), "w3:single").await;
        let mut wc = w3(c.clone(), "w3:cluster").await;
        for (label, r) in [("single ", &mut ws), ("cluster", &mut wc)] {
            println!(
                "W3 {label} {} acquisitions, hand-off p50 {:>7.0} us p99 {:>7.0} us, acquire-script runs per acquisition {:.2}, lost updates {}",
                r.done,
                us(pct(&mut r.cross, 50)),
                us(pct(&mut r.cross, 99)),
                r.tries_per_acq,
                r.lost_updates
            );
        }
        println!(
            "W3 ratio cluster/single: hand-off p99 {:.2}x, script runs per acquisition {:.2}x",
            us(pct(&mut wc.cross, 99)) / us(pct(&mut ws.cross, 99)),
            wc.tries_per_acq / ws.tries_per_acq
        );
        drop(cluster);
        drop(single);
    });
}
