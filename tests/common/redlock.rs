//! Redlock test environments: N private redis-servers and a `RedlockBackend` over them.

use std::sync::Arc;
use std::time::Duration;

use dlock::{Backend, RedlockBackend};

use super::{Env, Kind, RedisProc, TempDir};

/// Builds the LD_PRELOAD wall-clock shim (`tests/common/clockstep.c`, see `redis_clock.rs`) into
/// `dir` and returns its path.
pub fn build_clock_shim(dir: &TempDir) -> std::path::PathBuf {
    let lib = dir.path().join("libclockstep.so");
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/common/clockstep.c");
    let out = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&lib)
        .arg(src)
        .output()
        .expect("run cc (a C compiler is needed to build the clock shim)");
    assert!(
        out.status.success(),
        "cc {src}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    lib
}

/// Starts one private redis-server per entry of `offsets_ms`, each with its wall clock
/// (`TIME`, key expiry) shifted by that many milliseconds from the host's for its whole life,
/// restarts included (the clock shim, one offset file per server). Keep the returned directory
/// alive as long as the servers.
pub fn start_offset_nodes(offsets_ms: &[i64]) -> (Vec<RedisProc>, TempDir) {
    let dir = TempDir::new("redlock-clocks");
    let lib = build_clock_shim(&dir);
    let handles: Vec<_> = offsets_ms
        .iter()
        .enumerate()
        .map(|(i, &off)| {
            let file = dir.path().join(format!("offset-{i}"));
            std::fs::write(&file, (off * 1_000_000).to_ne_bytes()).expect("write offset file");
            let envs = [
                ("LD_PRELOAD".to_string(), lib.display().to_string()),
                (
                    "DLOCK_CLOCK_OFFSET_FILE".to_string(),
                    file.display().to_string(),
                ),
            ];
            std::thread::spawn(move || RedisProc::start_with_env(&[], &envs))
        })
        .collect();
    let nodes = handles
        .into_iter()
        .map(|h| h.join().expect("start redis-server"))
        .collect();
    (nodes, dir)
}

/// Starts `n` private redis-servers (in parallel threads).
pub fn start_nodes(n: usize) -> Vec<RedisProc> {
    let handles: Vec<_> = (0..n)
        .map(|_| std::thread::spawn(RedisProc::start))
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("start redis-server"))
        .collect()
}

/// The URLs of `nodes`.
pub fn urls(nodes: &[RedisProc]) -> Vec<String> {
    nodes.iter().map(|n| n.url()).collect()
}

/// Async admin connections to every running node (with a short timeout; a dead node is skipped).
pub async fn admins(nodes: &[RedisProc]) -> Vec<(usize, redis::aio::MultiplexedConnection)> {
    let mut out = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        if !n.is_running() {
            continue;
        }
        let client = redis::Client::open(n.url()).expect("admin url");
        if let Ok(Ok(c)) = tokio::time::timeout(
            Duration::from_secs(2),
            client.get_multiplexed_async_connection(),
        )
        .await
        {
            out.push((i, c));
        }
    }
    out
}

/// Indices of the running nodes that have `name`'s lock hash.
pub async fn nodes_with_lock(nodes: &[RedisProc], name: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for (i, mut con) in admins(nodes).await {
        let n: i64 = redis::cmd("EXISTS")
            .arg(dlock::backend::redis_keys(name).lock)
            .query_async(&mut con)
            .await
            .expect("EXISTS");
        if n == 1 {
            out.push(i);
        }
    }
    out
}

/// A `RedlockBackend` over `urls` that counts every node at once (restart delay zero), for
/// tests on just-started servers: with a delay, a node whose uptime is below it is not counted.
pub async fn connect_now<I, S>(urls: I) -> RedlockBackend
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    connect_with_node_timeout(urls, None).await
}

/// As [`connect_now`], with a 250 ms node timeout instead of the default 50 ms: the shared
/// behaviour suites assert busy, wait and exclusion, not Redlock's latency, and on a loaded
/// 2-core machine a contender's try once got no node's answer within 50 ms (a `Backend` error
/// "no quorum", where the suite expects `Busy`).
pub async fn connect_for_suite<I, S>(urls: I) -> RedlockBackend
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    connect_with_node_timeout(urls, Some(Duration::from_millis(250))).await
}

async fn connect_with_node_timeout<I, S>(urls: I, node_timeout: Option<Duration>) -> RedlockBackend
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let mut b = RedlockBackend::builder(urls).restart_delay(Duration::ZERO);
    if let Some(t) = node_timeout {
        b = b.node_timeout(t);
    }
    b.connect()
        .await
        .expect("connect Redlock to the private redis-servers")
}

/// Waits until every running node's `uptime_in_seconds` is at least `secs` (so a restart
/// delay of up to `secs` no longer leaves it out of quorums).
pub async fn wait_uptime(nodes: &[RedisProc], secs: u64) {
    let started = std::time::Instant::now();
    loop {
        let mut min = u64::MAX;
        for (_, mut con) in admins(nodes).await {
            let info: String = redis::cmd("INFO")
                .arg("server")
                .query_async(&mut con)
                .await
                .expect("INFO server");
            let up = info
                .lines()
                .find_map(|l| l.strip_prefix("uptime_in_seconds:"))
                .and_then(|v| v.trim().parse().ok())
                .expect("uptime_in_seconds");
            min = min.min(up);
        }
        if min >= secs {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(secs + 30),
            "nodes never reached {secs} s of uptime"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

impl Env {
    /// `n` private redis-servers and a `RedlockBackend` over them.
    pub async fn redlock(n: usize) -> Env {
        let nodes = tokio::task::spawn_blocking(move || start_nodes(n))
            .await
            .expect("start redis-servers");
        // Just-started servers: counted at once (the shared suites restart no node).
        let b = connect_for_suite(urls(&nodes)).await;
        Env {
            kind: Kind::Redlock,
            server: None,
            nodes,
            extra: Vec::new(),
            mem: None,
            db: None,
            #[cfg(feature = "zookeeper")]
            zk: None,
            primary: Arc::new(b),
        }
    }

    pub(super) async fn another_redlock(&self) -> Arc<dyn Backend> {
        Arc::new(connect_for_suite(urls(&self.nodes)).await)
    }

    pub(super) async fn redlock_force_delete(&self, name: &str) {
        let mut deleted = 0;
        for (_, mut con) in admins(&self.nodes).await {
            let n: i64 = redis::cmd("DEL")
                .arg(dlock::backend::redis_keys(name).lock)
                .query_async(&mut con)
                .await
                .expect("DEL");
            deleted += n;
        }
        assert!(
            deleted as usize > self.nodes.len() / 2,
            "the lock key of {name:?} existed on a quorum of nodes (found on {deleted})"
        );
    }

    /// Number of running nodes that have `name`'s lock hash.
    pub async fn redlock_locked_nodes(&self, name: &str) -> usize {
        nodes_with_lock(&self.nodes, name).await.len()
    }
}
