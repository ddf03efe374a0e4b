//! Redlock(3) and Redlock(5) acquire + release latency against the slowest single node's pair
//! (the same node's `RedisBackend` try_acquire + release: two EVALSHA round trips), measured in
//! the same run, in interleaved rounds. Starts five private `redis-server`s on free loopback
//! ports (no persistence; killed at exit, also via `PR_SET_PDEATHSIG`). Also measures the
//! fan-out floor in the same rounds: the same pairs sent to all 3 (or 5) nodes at once by plain
//! `RedisBackend`s with no Redlock logic, which is what parallel round trips cost on this box.
//!
//! ```sh
//! cargo bench --bench redlock_bench
//! DLOCK_BENCH_ROUNDS=9 DLOCK_BENCH_PAIRS=2000 cargo bench --bench redlock_bench
//! ```

#[path = "common/redis_server.rs"]
mod redis_server;

use std::time::{Duration, Instant};

use dlock::{Backend, RedisBackend, RedlockBackend};
use redis_server::Server;

/// `pairs` acquire + release pairs on distinct free keys; the latency of each pair.
async fn pairs(b: &dyn Backend, tag: &str, pairs: usize) -> Vec<Duration> {
    let ttl = Duration::from_secs(30);
    let mut out = Vec::with_capacity(pairs);
    for i in 0..pairs {
        let key = format!("bench:{tag}:{}", i % 64);
        let t = Instant::now();
        let r = b
            .try_acquire(&key, "bench-owner", ttl)
            .await
            .expect("acquire");
        assert!(
            matches!(r, dlock::backend::Acquired::Granted { .. }),
            "{r:?}"
        );
        b.release(&key, "bench-owner", None, true)
            .await
            .expect("release");
        out.push(t.elapsed());
    }
    out
}

/// The fan-out floor: the same pairs sent to every node at once by plain `RedisBackend`s (all
/// acquires in parallel, then all releases), without any Redlock logic.
async fn parallel_pairs(nodes: &[RedisBackend], tag: &str, pairs: usize) -> Vec<Duration> {
    let ttl = Duration::from_secs(30);
    let mut out = Vec::with_capacity(pairs);
    for i in 0..pairs {
        let key = format!("bench:{tag}:{}", i % 64);
        let t = Instant::now();
        for r in futures_util::future::join_all(
            nodes
                .iter()
                .map(|b| b.try_acquire(&key, "bench-owner", ttl)),
        )
        .await
        {
            assert!(
                matches!(r, Ok(dlock::backend::Acquired::Granted { .. })),
                "{r:?}"
            );
        }
        for r in futures_util::future::join_all(
            nodes
                .iter()
                .map(|b| b.release(&key, "bench-owner", None, true)),
        )
        .await
        {
            r.expect("release");
        }
        out.push(t.elapsed());
    }
    out
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
    let n_pairs: usize = std::env::var("DLOCK_BENCH_PAIRS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(500);
    let servers: Vec<Server> = (0..5).map(|_| Server::start("rlbench", &[])).collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let urls: Vec<String> = servers.iter().map(Server::url).collect();
        let mut singles = Vec::new();
        for u in &urls {
            singles.push(RedisBackend::connect(u).await.unwrap());
        }
        // Just-started servers: counted at once (with a restart delay, a node younger than it
        // is left out of quorums).
        let connect = |u: &[String]| {
            RedlockBackend::builder(u.to_vec())
                .restart_delay(Duration::ZERO)
                .connect()
        };
        let rl3 = connect(&urls[..3]).await.unwrap();
        let rl5 = connect(&urls[..]).await.unwrap();
        // Warm-up: connections, script cache.
        for s in &singles {
            pairs(s, "warm", 50).await;
        }
        pairs(&rl3, "warm3", 50).await;
        pairs(&rl5, "warm5", 50).await;
        let (mut r3, mut r5) = (Vec::new(), Vec::new());
        let (mut f3, mut f5) = (Vec::new(), Vec::new());
        let (mut allf3, mut allf5) = (Vec::new(), Vec::new());
        let (mut all_single, mut all3, mut all5) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            // Per node p50 in this round; the slowest node is the baseline.
            let mut node_p50 = Vec::new();
            let order = round % 3;
            let mut p3 = Vec::new();
            let mut p5 = Vec::new();
            let (mut q3, mut q5) = (Vec::new(), Vec::new());
            for step in 0..3 {
                match (step + order) % 3 {
                    0 => {
                        for (i, s) in singles.iter().enumerate() {
                            let mut v = pairs(s, &format!("n{i}"), n_pairs).await;
                            node_p50.push(pct(&mut v, 50));
                            all_single.extend(v);
                        }
                    }
                    1 => {
                        p3 = pairs(&rl3, "rl3", n_pairs).await;
                        q3 = parallel_pairs(&singles[..3], "par3", n_pairs).await;
                    }
                    _ => {
                        p5 = pairs(&rl5, "rl5", n_pairs).await;
                        q5 = parallel_pairs(&singles, "par5", n_pairs).await;
                    }
                }
            }
            let slow3 = node_p50[..3].iter().max().copied().unwrap();
            let slow5 = node_p50.iter().max().copied().unwrap();
            let m3 = pct(&mut p3, 50);
            let m5 = pct(&mut p5, 50);
            r3.push(us(m3) / us(slow3));
            r5.push(us(m5) / us(slow5));
            f3.push(us(m3) / us(pct(&mut q3, 50)));
            f5.push(us(m5) / us(pct(&mut q5, 50)));
            allf3.extend(q3);
            allf5.extend(q5);
            all3.extend(p3);
            all5.extend(p5);
        }
        println!(
            "dlock redlock_bench: {rounds} rounds x {n_pairs} acquire+release pairs per variant, 2 workers"
        );
        println!(
            "single node pair  p50 {:>8.1} us  p99 {:>8.1} us",
            us(pct(&mut all_single, 50)),
            us(pct(&mut all_single, 99))
        );
        println!(
            "Redlock(3) pair   p50 {:>8.1} us  p99 {:>8.1} us  ratio to slowest node p50 (median of rounds) {:.2}x",
            us(pct(&mut all3, 50)),
            us(pct(&mut all3, 99)),
            median(r3)
        );
        println!(
            "Redlock(5) pair   p50 {:>8.1} us  p99 {:>8.1} us  ratio to slowest node p50 (median of rounds) {:.2}x",
            us(pct(&mut all5, 50)),
            us(pct(&mut all5, 99)),
            median(r5)
        );
        println!(
            "floor(3) parallel p50 {:>8.1} us  p99 {:>8.1} us  Redlock(3) / floor(3) p50 (median of rounds) {:.2}x",
            us(pct(&mut allf3, 50)),
            us(pct(&mut allf3, 99)),
            median(f3)
        );
        println!(
            "floor(5) parallel p50 {:>8.1} us  p99 {:>8.1} us  Redlock(5) / floor(5) p50 (median of rounds) {:.2}x",
            us(pct(&mut allf5, 50)),
            us(pct(&mut allf5, 99)),
            median(f5)
        );
        drop(servers);
    });
}
