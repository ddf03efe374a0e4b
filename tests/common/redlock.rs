//! Redlock test environments: N private redis-servers and a `RedlockBackend` over them.

use std::sync::Arc;
use std::time::Duration;

use dlock::{Backend, RedlockBackend};

use super::{Env, Kind, RedisProc};

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
            .arg(dlock::redis_keys(name).lock)
            .query_async(&mut con)
            .await
            .expect("EXISTS");
        if n == 1 {
            out.push(i);
        }
    }
    out
}

impl Env {
    /// `n` private redis-servers and a `RedlockBackend` over them.
    pub async fn redlock(n: usize) -> Env {
        let nodes = tokio::task::spawn_blocking(move || start_nodes(n))
            .await
            .expect("start redis-servers");
        let b = RedlockBackend::connect(urls(&nodes))
            .await
            .expect("connect Redlock to the private redis-servers");
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
        Arc::new(
            RedlockBackend::connect(urls(&self.nodes))
                .await
                .expect("second RedlockBackend"),
        )
    }

    pub(super) async fn redlock_force_delete(&self, name: &str) {
        let mut deleted = 0;
        for (_, mut con) in admins(&self.nodes).await {
            let n: i64 = redis::cmd("DEL")
                .arg(dlock::redis_keys(name).lock)
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
