//! `cargo bench --bench prod_bench --features axum[,metrics]`: the costs of the production
//! features, each against a baseline measured in the same run.
//!
//! * **Layer**: one axum `Router` called in-process (`tower::ServiceExt::oneshot`, no socket, so
//!   the figure is the layer's own cost) on the in-memory backend, `current_thread` runtime,
//!   uncontended key. Variants: the handler without a lock; the handler with
//!   `#[distributed_lock]`; the plain handler under `LockLayer` with `path_key`. Overhead = layer
//!   minus attribute, per request.
//! * **Metrics**: the in-memory backend's single-task acquire + release (`Lock::with_backend`).
//!   With the `metrics` feature the run measures no recorder installed against a Prometheus
//!   recorder (`metrics-exporter-prometheus`, installed globally after the rounds without it:
//!   dlock caches metric handles only for the process-wide recorder); the feature-off figure
//!   comes from a second run without the feature (`BENCHMARKS.md`).
//!
//! Layer rounds interleave the variants (order rotating); figures are medians over rounds, ratios
//! the median of per-round ratios (the metrics ratio is the ratio of the two medians). `DLOCK_BENCH_SCALE` scales the run lengths (default 1).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::http::Request;
use axum::routing::get;
use dlock::web::{LockLayer, path_key};
use dlock::{Backend, Lock, MemoryBackend};
use tower::ServiceExt;

const ROUNDS: usize = 7;

fn scale() -> u64 {
    std::env::var("DLOCK_BENCH_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1)
}

async fn plain(Path(id): Path<u64>) -> String {
    id.to_string()
}

#[dlock::distributed_lock(key = "bench:attr:{id}")]
async fn attributed(Path(id): Path<u64>) -> Result<String, dlock::LockError> {
    Ok(id.to_string())
}

async fn per_request(app: &Router, path: &str, n: u64) -> Duration {
    let start = Instant::now();
    for _ in 0..n {
        let req = Request::builder().uri(path).body(Body::empty()).unwrap();
        let res = app.clone().oneshot(req).await.unwrap();
        assert!(res.status().is_success(), "{}", res.status());
        std::hint::black_box(res);
    }
    start.elapsed() / n as u32
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn layer_bench(rt: &tokio::runtime::Runtime) {
    let n = 20_000 * scale();
    let bare = Router::new().route("/p/{id}", get(plain));
    let attr = Router::new().route("/a/{id}", get(attributed));
    let layer = Router::new()
        .route("/l/{id}", get(plain))
        .route_layer(LockLayer::new(
            path_key("/l/{id}", "bench:layer:{id}").unwrap(),
        ));
    let mut t = [Vec::new(), Vec::new(), Vec::new()];
    let mut ratio = Vec::new();
    let mut diff = Vec::new();
    rt.block_on(async {
        // Warm-up (the attribute resolves its spec on the first call).
        per_request(&bare, "/p/1", 1000).await;
        per_request(&attr, "/a/1", 1000).await;
        per_request(&layer, "/l/1", 1000).await;
        for round in 0..ROUNDS {
            let mut r = [0.0; 3];
            for k in 0..3 {
                let v = (round + k) % 3;
                let d = match v {
                    0 => per_request(&bare, "/p/1", n).await,
                    1 => per_request(&attr, "/a/1", n).await,
                    _ => per_request(&layer, "/l/1", n).await,
                };
                r[v] = d.as_nanos() as f64;
            }
            for k in 0..3 {
                t[k].push(r[k]);
            }
            ratio.push(r[2] / r[1]);
            diff.push(r[2] - r[1]);
        }
    });
    let [b, a, l] = t.map(median);
    println!(
        "## Layer vs attribute (in-process axum Router, in-memory backend, {n} requests x {ROUNDS} rounds)"
    );
    println!("| variant | ns/request |");
    println!("|---|---|");
    println!("| handler, no lock | {b:.0} |");
    println!("| handler with #[distributed_lock] | {a:.0} |");
    println!("| handler under LockLayer (path_key) | {l:.0} |");
    println!(
        "layer / attribute: {:.3} (median of rounds); layer - attribute: {:.0} ns/request",
        median(ratio),
        median(diff)
    );
}

async fn pairs(lock: &Lock, n: u64) -> Duration {
    let start = Instant::now();
    for _ in 0..n {
        let g = lock.acquire().await.unwrap();
        g.release().await.unwrap();
    }
    start.elapsed() / n as u32
}

fn metrics_bench(rt: &tokio::runtime::Runtime) {
    // DLOCK_BENCH_PAIRS overrides the run length (for callgrind: per-pair instruction counts
    // are the difference of two runs with different lengths).
    let n = std::env::var("DLOCK_BENCH_PAIRS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200_000 * scale());
    // DLOCK_BENCH_ONLY=none|prom runs one variant of the feature-on run.
    let only = std::env::var("DLOCK_BENCH_ONLY").unwrap_or_default();
    let mem: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let lock = Lock::new("bench:metrics")
        .with_backend(mem)
        .metric_name("bench");
    rt.block_on(pairs(&lock, 10_000));
    #[cfg(feature = "metrics")]
    {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        // All rounds without a recorder, then the Prometheus recorder installed globally (as a
        // service installs it) for all rounds with it. Not interleaved: a local recorder
        // (`with_local_recorder`) is not cached by dlock (its address can be reused by the next
        // one), so it would measure handle registration on every acquire, not production.
        let mut without = Vec::new();
        let mut with = Vec::new();
        if only != "prom" {
            for _ in 0..ROUNDS {
                without.push(rt.block_on(pairs(&lock, n)).as_nanos() as f64);
            }
        }
        if only != "none" {
            metrics::set_global_recorder(recorder).expect("the only recorder of this bench");
            for _ in 0..ROUNDS {
                with.push(rt.block_on(pairs(&lock, n)).as_nanos() as f64);
            }
        }
        let med = |v: Vec<f64>| if v.is_empty() { f64::NAN } else { median(v) };
        let (without, with) = (med(without), med(with));
        println!(
            "## Metrics (feature on): in-memory acquire + release, 1 task, {n} pairs x {ROUNDS} rounds"
        );
        println!("| variant | ns/pair |");
        println!("|---|---|");
        println!("| no recorder installed | {without:.0} |");
        println!("| Prometheus recorder (global) | {with:.0} |");
        println!("Prometheus / none: {:.3}", with / without);
        if only != "none" {
            let rendered = handle.render();
            assert!(rendered.contains("dlock_acquire_total"), "{rendered}");
        }
    }
    #[cfg(not(feature = "metrics"))]
    {
        let v: Vec<f64> = (0..ROUNDS)
            .map(|_| rt.block_on(pairs(&lock, n)).as_nanos() as f64)
            .collect();
        println!(
            "## Metrics feature off: in-memory acquire + release, 1 task, {n} pairs x {ROUNDS} rounds"
        );
        println!("| variant | ns/pair |");
        println!("|---|---|");
        println!("| feature off | {:.0} |", median(v));
    }
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let want = |w: &str| args.is_empty() || args.iter().any(|a| a == w);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    if want("layer") {
        layer_bench(&rt);
    }
    if want("metrics") {
        metrics_bench(&rt);
    }
}
