//! Engine `cluster` of the torture (feature `cluster`): a private Redis Cluster of three masters
//! with one replica each (no persistence, node timeout 2 s), joined by
//! `redis-cli --cluster create`, as `tests/common/cluster.rs` starts it.
//!
//! Faults (besides the coordinator's worker kill / stop), all on the master that serves the
//! lock's slot: `CLUSTER FAILOVER` on its replica (a coordinated switch), a kill for 3–4 s (past
//! the node timeout: its replica takes over; the old master comes back empty and becomes a
//! replica), and a kill with an immediate restart (it comes back empty before anyone noticed,
//! still the master). The last two may lose recent grants (asynchronous replication, no
//! persistence): marked `state_loss`. With `--clock-offsets-ms`, node `i` of the six (the first
//! three start as masters) runs its wall clock at entry `i % len` through the clock shim, across
//! its restarts, so a failover moves the lock's slot to a node with another clock.

use super::*;

/// The cluster's nodes; killed on drop.
pub(crate) struct ClusterSet {
    nodes: Vec<RedisServer>,
}

/// `CLUSTER NODES` lines: `(port, is master, own id, master id)`.
fn cluster_nodes(port: u16) -> Vec<(u16, bool, String, String)> {
    let Ok(Resp::Bulk(Some(text))) = redis_cmd(port, &["CLUSTER", "NODES"], Duration::from_secs(2))
    else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let p = f.get(1)?.split(['@', ':']).nth(1)?.parse().ok()?;
            let flags = f.get(2)?;
            if flags.contains("fail") && !flags.contains("fail?") {
                return None;
            }
            Some((
                p,
                flags.contains("master"),
                f[0].to_string(),
                f.get(3)?.to_string(),
            ))
        })
        .collect()
}

impl ClusterSet {
    /// `offsets_ms(i)`: node `i`'s wall-clock offset (0: none), kept across its restarts.
    pub(crate) fn start(dir: &Path, offsets_ms: impl Fn(usize) -> i64) -> io::Result<ClusterSet> {
        let args: Vec<String> = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "2000",
        ]
        .map(String::from)
        .into();
        let nodes = (0..6)
            .map(|i| {
                let mut n = RedisServer::start_with(&dir.join(format!("cluster-node{i}")), &args)?;
                n.clock_offset(offsets_ms(i))?;
                Ok(n)
            })
            .collect::<io::Result<Vec<_>>>()?;
        let mut cmd = Command::new("redis-cli");
        cmd.args(["--cluster", "create"]);
        for n in &nodes {
            cmd.arg(format!("127.0.0.1:{}", n.port));
        }
        let out = cmd
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&out.stdout)
            )));
        }
        let set = ClusterSet { nodes };
        set.wait_ok(Duration::from_secs(30))?;
        Ok(set)
    }

    /// Waits until every node reports `cluster_state:ok` and all agree on who the masters are.
    fn wait_ok(&self, limit: Duration) -> io::Result<()> {
        let start = mono();
        loop {
            let ok = self.nodes.iter().all(|n| {
                matches!(n.cmd(&["CLUSTER", "INFO"]), Ok(Resp::Bulk(Some(ref i))) if i.contains("cluster_state:ok"))
            });
            let views: Vec<Vec<(u16, bool)>> = self
                .nodes
                .iter()
                .map(|n| {
                    let mut v: Vec<(u16, bool)> = cluster_nodes(n.port)
                        .into_iter()
                        .map(|(p, m, _, _)| (p, m))
                        .collect();
                    v.sort();
                    v
                })
                .collect();
            if ok && views.windows(2).all(|w| w[0] == w[1]) {
                return Ok(());
            }
            if mono() - start > limit.as_nanos() as u64 {
                return Err(io::Error::other(format!(
                    "the cluster did not reach cluster_state:ok within {limit:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Index of the master serving the lock's slot, and of its replica.
    fn lock_master(&self) -> Option<(usize, Option<usize>)> {
        let slot = self.nodes[0]
            .cmd(&["CLUSTER", "KEYSLOT", lock_hash()])
            .ok()?
            .as_i64()?;
        for n in &self.nodes {
            let Ok(Resp::Array(slots)) = n.cmd(&["CLUSTER", "SLOTS"]) else {
                continue;
            };
            for range in slots {
                let Resp::Array(r) = range else { continue };
                let (Some(a), Some(b)) = (
                    r.first().and_then(Resp::as_i64),
                    r.get(1).and_then(Resp::as_i64),
                ) else {
                    continue;
                };
                if a <= slot && slot <= b {
                    let port = |x: Option<&Resp>| match x {
                        Some(Resp::Array(node)) => node.get(1).and_then(Resp::as_i64),
                        _ => None,
                    };
                    let idx = |p: i64| self.nodes.iter().position(|n| i64::from(n.port) == p);
                    let m = idx(port(r.get(2))?)?;
                    let rep = port(r.get(3)).and_then(idx);
                    return Some((m, rep));
                }
            }
            break;
        }
        None
    }
}

impl Store for ClusterSet {
    fn url(&self) -> String {
        self.nodes
            .iter()
            .map(|n| n.url())
            .collect::<Vec<_>>()
            .join(",")
    }

    fn fault(&mut self, rng: &mut Rng, _ttl: Duration) -> io::Result<(&'static str, u64, bool)> {
        let Some((m, rep)) = self.lock_master() else {
            std::thread::sleep(Duration::from_millis(500));
            return Ok(("cluster_no_master_found", mono(), false));
        };
        let t = mono();
        let r = match (rng.range(0, 3), rep) {
            (0, Some(rep)) => {
                let _ = self.nodes[rep].cmd(&["CLUSTER", "FAILOVER"]);
                let start = mono();
                while self.lock_master().is_none_or(|(now, _)| now != rep)
                    && mono() - start < 10_000_000_000
                {
                    std::thread::sleep(Duration::from_millis(50));
                }
                ("cluster_failover", t, false)
            }
            (1, _) => {
                self.nodes[m].kill();
                std::thread::sleep(Duration::from_millis(rng.range(3000, 4001)));
                self.nodes[m].restart()?;
                ("cluster_kill_master", t, true)
            }
            _ => {
                self.nodes[m].restart()?;
                ("cluster_restart_master", t, true)
            }
        };
        self.wait_ok(Duration::from_secs(30))?;
        Ok(r)
    }
}
