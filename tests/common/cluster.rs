//! Redis Cluster test environments: private `redis-server --cluster-enabled yes` processes on
//! free loopback ports (each in its own temp dir), joined by `redis-cli --cluster create`.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock::{Backend, ClusterBackend};

use super::{Env, Kind, RedisProc};

/// A cluster of masters, each with `replicas` replicas.
#[derive(Debug)]
pub struct ClusterSet {
    /// The first `masters` were created as masters, the rest as their replicas.
    pub nodes: Vec<RedisProc>,
    /// A TLS cluster ([`ClusterSet::start_tls`]): each node's TLS port, in `nodes` order (the
    /// plain ports stay open for the harness's own checks). Empty for a plain cluster.
    pub tls_ports: Vec<u16>,
    /// A TLS cluster's CA and server certificate.
    #[cfg(feature = "tls")]
    pub certs: Option<super::tls::ServerCerts>,
}

/// What `CLUSTER NODES` says about one node.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub id: String,
    pub port: u16,
    pub master: bool,
    /// The master's id, for a replica.
    pub master_id: Option<String>,
    /// Slot ranges it serves (masters).
    pub slots: Vec<(u16, u16)>,
}

impl ClusterSet {
    /// Starts `masters` masters with `replicas` replicas each and waits until every node reports
    /// `cluster_state:ok` and every replica is in sync.
    pub fn start(masters: usize, replicas: usize) -> ClusterSet {
        let set = ClusterSet {
            nodes: Self::start_nodes(masters, replicas, Vec::new),
            tls_ports: Vec::new(),
            #[cfg(feature = "tls")]
            certs: None,
        };
        set.wait_ok(Duration::from_secs(30));
        set
    }

    /// Like [`ClusterSet::start`], with nodes that serve TLS on a port of their own (certificate
    /// from a fresh CA, [`super::tls::ServerCerts`]) and use it for the cluster bus
    /// (`tls-cluster`, on a free `cluster-port`) and replication (`tls-replication`). With
    /// `tls-cluster`, `CLUSTER SLOTS` / `CLUSTER NODES` give TLS clients the TLS ports and plain
    /// clients the plain ones, so the harness keeps working on the plain ports.
    #[cfg(feature = "tls")]
    pub fn start_tls(masters: usize, replicas: usize) -> ClusterSet {
        let certs = super::tls::ServerCerts::new();
        // Distinct within the set: a port picked twice would fail that node on every attempt.
        let picked = std::cell::RefCell::new(std::collections::HashSet::new());
        let port = || loop {
            let p = super::free_port();
            if picked.borrow_mut().insert(p) {
                return p.to_string();
            }
        };
        let nodes = Self::start_nodes(masters, replicas, || {
            let mut args: Vec<String> = [
                "--tls-port",
                port().as_str(),
                "--cluster-port",
                port().as_str(),
                "--tls-cluster",
                "yes",
                "--tls-replication",
                "yes",
            ]
            .map(String::from)
            .into();
            args.extend(certs.redis_args());
            args
        });
        let tls_ports = nodes
            .iter()
            .map(|n| {
                let kv: Vec<String> = redis::cmd("CONFIG")
                    .arg("GET")
                    .arg("tls-port")
                    .query(&mut n.admin())
                    .expect("CONFIG GET tls-port");
                kv[1].parse().expect("a TLS port")
            })
            .collect();
        let set = ClusterSet {
            nodes,
            tls_ports,
            certs: Some(certs),
        };
        set.wait_ok(Duration::from_secs(30));
        set
    }

    /// Starts the nodes (each with `node_args()` after the cluster settings) and joins them
    /// with `redis-cli --cluster create` on their plain ports.
    fn start_nodes(
        masters: usize,
        replicas: usize,
        node_args: impl Fn() -> Vec<String>,
    ) -> Vec<RedisProc> {
        let n = masters * (1 + replicas);
        let handles: Vec<_> = (0..n)
            .map(|_| {
                let mut args: Vec<String> = [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    "--cluster-require-full-coverage",
                    "yes",
                ]
                .map(String::from)
                .into();
                args.extend(node_args());
                std::thread::spawn(move || {
                    RedisProc::start_with(&args.iter().map(String::as_str).collect::<Vec<_>>())
                })
            })
            .collect();
        let nodes: Vec<RedisProc> = handles
            .into_iter()
            .map(|h| h.join().expect("start a cluster node"))
            .collect();
        let mut cmd = Command::new("redis-cli");
        cmd.arg("--cluster").arg("create");
        for node in &nodes {
            cmd.arg(format!("127.0.0.1:{}", node.port()));
        }
        cmd.arg("--cluster-replicas")
            .arg(replicas.to_string())
            .arg("--cluster-yes")
            .stdin(Stdio::null());
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("cannot run `redis-cli --cluster create`: {e}"));
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        nodes
    }

    /// Seed URLs: every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.url()).collect()
    }

    /// `rediss://` seed URLs of a TLS cluster: every node's TLS port, by `host`.
    pub fn tls_urls(&self, host: &str) -> Vec<String> {
        assert!(!self.tls_ports.is_empty(), "not a TLS cluster");
        self.tls_ports
            .iter()
            .map(|p| format!("rediss://{host}:{p}"))
            .collect()
    }

    /// Waits until every running node reports `cluster_state:ok`, agrees on the masters and
    /// every replica's link is up.
    pub fn wait_ok(&self, limit: Duration) {
        let started = Instant::now();
        loop {
            let ok = self.nodes.iter().filter(|n| n.is_running()).all(|n| {
                let Ok(mut con) = redis::Client::open(n.url())
                    .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(1)))
                else {
                    return false;
                };
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut con)
                    .unwrap_or_default();
                let repl: String = redis::cmd("INFO")
                    .arg("replication")
                    .query(&mut con)
                    .unwrap_or_default();
                info.contains("cluster_state:ok")
                    && (repl.contains("role:master") || repl.contains("master_link_status:up"))
            }) && self.views_agree();
            if ok {
                return;
            }
            assert!(
                started.elapsed() < limit,
                "the cluster did not reach cluster_state:ok within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn views_agree(&self) -> bool {
        let views: Vec<Vec<(u16, bool)>> = self
            .nodes
            .iter()
            .filter(|n| n.is_running())
            .map(|n| {
                let mut v: Vec<(u16, bool)> = self
                    .cluster_nodes_of(n)
                    .iter()
                    .map(|i| (i.port, i.master))
                    .collect();
                v.sort();
                v
            })
            .collect();
        views.windows(2).all(|w| w[0] == w[1])
    }

    fn cluster_nodes_of(&self, n: &RedisProc) -> Vec<NodeInfo> {
        let Ok(mut con) = redis::Client::open(n.url())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(1)))
        else {
            return Vec::new();
        };
        let text: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query(&mut con)
            .unwrap_or_default();
        parse_cluster_nodes(&text)
    }

    /// `CLUSTER NODES` as seen by node `i`.
    pub fn topology(&self, i: usize) -> Vec<NodeInfo> {
        self.cluster_nodes_of(&self.nodes[i])
    }

    /// Index of the node listening on `port`.
    pub fn index_of_port(&self, port: u16) -> usize {
        self.nodes
            .iter()
            .position(|n| n.port() == port)
            .expect("a node of this set")
    }

    /// The hash slot of `key`.
    pub fn slot_of(key: &str) -> u16 {
        // CRC16/XMODEM of the hash tag, as Redis computes it (keys here always have a tag).
        let bytes = key.as_bytes();
        let tagged = match bytes.iter().position(|&b| b == b'{') {
            Some(open) => match bytes[open + 1..].iter().position(|&b| b == b'}') {
                Some(len) if len > 0 => &bytes[open + 1..open + 1 + len],
                _ => bytes,
            },
            None => bytes,
        };
        let mut crc: u16 = 0;
        for &b in tagged {
            crc ^= (b as u16) << 8;
            for _ in 0..8 {
                crc = if crc & 0x8000 != 0 {
                    (crc << 1) ^ 0x1021
                } else {
                    crc << 1
                };
            }
        }
        crc % 16384
    }

    /// Index of the node that serves `slot` now, as a running node sees it.
    pub fn master_of_slot(&self, slot: u16) -> usize {
        let viewer = self
            .nodes
            .iter()
            .position(|n| n.is_running())
            .expect("a running node");
        let info = self
            .topology(viewer)
            .into_iter()
            .find(|i| i.master && i.slots.iter().any(|&(a, b)| a <= slot && slot <= b))
            .expect("a master serves the slot");
        self.index_of_port(info.port)
    }

    /// Index of a replica of the master at index `m`.
    pub fn replica_of(&self, m: usize) -> usize {
        let topo = self.topology(m);
        let id = topo
            .iter()
            .find(|i| i.port == self.nodes[m].port())
            .expect("the master itself")
            .id
            .clone();
        let r = topo
            .iter()
            .find(|i| i.master_id.as_deref() == Some(id.as_str()))
            .expect("a replica of that master");
        self.index_of_port(r.port)
    }

    /// `CLUSTER MYID` of node `i`.
    pub fn id_of(&self, i: usize) -> String {
        redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut self.nodes[i].admin())
            .expect("CLUSTER MYID")
    }

    /// Moves `slot` from node `from` to node `to` by hand (SETSLOT IMPORTING / MIGRATING, MIGRATE
    /// of every key in it in one command, SETSLOT NODE on both and then on every master), with
    /// `between` run after the keys have moved but before the slot is handed over, so that callers
    /// meet the ASK state.
    pub fn migrate_slot(&self, slot: u16, from: usize, to: usize, between: impl FnOnce()) {
        let from_id = self.id_of(from);
        let to_id = self.id_of(to);
        let mut src = self.nodes[from].admin();
        let mut dst = self.nodes[to].admin();
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("IMPORTING")
            .arg(&from_id)
            .query(&mut dst)
            .expect("SETSLOT IMPORTING");
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("MIGRATING")
            .arg(&to_id)
            .query(&mut src)
            .expect("SETSLOT MIGRATING");
        let keys: Vec<String> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(1000)
            .query(&mut src)
            .expect("GETKEYSINSLOT");
        if !keys.is_empty() {
            let _: redis::Value = redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(self.nodes[to].port())
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys)
                .query(&mut src)
                .expect("MIGRATE");
        }
        between();
        for (i, con) in [(to, &mut dst), (from, &mut src)] {
            let _: () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("NODE")
                .arg(&to_id)
                .query(con)
                .unwrap_or_else(|e| panic!("SETSLOT NODE on node {i}: {e}"));
        }
        for (i, n) in self.nodes.iter().enumerate() {
            if i == from || i == to || !n.is_running() {
                continue;
            }
            if self
                .topology(i)
                .iter()
                .any(|x| x.port == n.port() && x.master)
            {
                let _: redis::RedisResult<()> = redis::cmd("CLUSTER")
                    .arg("SETSLOT")
                    .arg(slot)
                    .arg("NODE")
                    .arg(&to_id)
                    .query(&mut n.admin());
            }
        }
    }

    /// An async cluster connection for checks behind the backend's back.
    pub async fn admin(&self) -> redis::cluster_async::ClusterConnection {
        redis::cluster::ClusterClient::new(self.urls())
            .expect("cluster urls")
            .get_async_connection()
            .await
            .expect("cluster admin connection")
    }
}

/// Parses `CLUSTER NODES`.
pub fn parse_cluster_nodes(text: &str) -> Vec<NodeInfo> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 {
                return None;
            }
            let port: u16 = f[1].split('@').next()?.rsplit(':').next()?.parse().ok()?;
            let flags = f[2];
            if flags.contains("fail") && !flags.contains("pfail") {
                return None;
            }
            let master = flags.contains("master");
            let master_id = (f[3] != "-").then(|| f[3].to_string());
            let slots = f[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|x| (x, x)),
                })
                .collect();
            Some(NodeInfo {
                id: f[0].to_string(),
                port,
                master,
                master_id,
                slots,
            })
        })
        .collect()
}

impl Env {
    /// Three masters without replicas and a `ClusterBackend` over them: the shared suites test
    /// the lock, not replication (half the servers to start per test). `tests/cluster.rs` keeps
    /// replicas for its failover tests.
    pub async fn cluster() -> Env {
        let set = tokio::task::spawn_blocking(|| ClusterSet::start(3, 0))
            .await
            .expect("start the cluster");
        let b = ClusterBackend::connect(set.urls())
            .await
            .expect("connect to the cluster");
        Env {
            kind: Kind::Cluster,
            server: None,
            nodes: Vec::new(),
            mem: None,
            db: None,
            #[cfg(feature = "zookeeper")]
            zk: None,
            primary: Arc::new(b),
            extra: vec![Box::new(Arc::new(set))],
        }
    }

    /// The cluster of a cluster environment.
    pub fn cluster_set(&self) -> &ClusterSet {
        self.extra
            .iter()
            .find_map(|e| e.downcast_ref::<Arc<ClusterSet>>())
            .expect("a cluster environment")
    }

    pub(crate) async fn cluster_another_backend(&self) -> Arc<dyn Backend> {
        Arc::new(
            ClusterBackend::connect(self.cluster_set().urls())
                .await
                .expect("second ClusterBackend"),
        )
    }

    pub(crate) async fn cluster_exists(&self, name: &str) -> bool {
        let mut con = self.cluster_set().admin().await;
        let n: i64 = redis::cmd("EXISTS")
            .arg(dlock::backend::redis_keys(name).lock)
            .query_async(&mut con)
            .await
            .expect("EXISTS");
        n == 1
    }

    pub(crate) async fn cluster_force_delete(&self, name: &str) {
        let mut con = self.cluster_set().admin().await;
        let n: i64 = redis::cmd("DEL")
            .arg(dlock::backend::redis_keys(name).lock)
            .query_async(&mut con)
            .await
            .expect("DEL");
        assert_eq!(n, 1, "the lock key of {name:?} existed");
    }
}

/// Lock keys (not fence keys) left on any master.
pub fn lock_keys_left(set: &ClusterSet) -> HashMap<u16, Vec<String>> {
    let mut out = HashMap::new();
    for n in set.nodes.iter().filter(|n| n.is_running()) {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("dlock:*")
            .query(&mut n.admin())
            .unwrap_or_default();
        let locks: Vec<String> = keys
            .into_iter()
            // Fence keys and the process's holder identity key outlive the locks.
            .filter(|k| !k.ends_with(":fence") && !k.starts_with("dlock:holder:"))
            .collect();
        if !locks.is_empty() {
            out.insert(n.port(), locks);
        }
    }
    out
}
