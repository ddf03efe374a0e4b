//! Private etcd servers for the tests (feature `etcd`): one member or a 3-member cluster, each
//! member in its own temp dir with client and peer ports on free 127.0.0.1 ports, started from
//! Debian's `/usr/bin/etcd` (`scripts/test` installs `etcd-server`). Members can be killed,
//! paused (SIGSTOP), resumed and restarted on the same ports and data; all are killed and
//! reaped on drop.

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Env, Kind, TempDir, free_port, signal, spawn_child};

/// A temp dir on tmpfs (`/dev/shm`) when there is one: etcd fsyncs its WAL on every write, and
/// on a slow disk that, not the lock protocol, would dominate the tests' timings.
fn shm_dir() -> TempDir {
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        return TempDir::new("etcd");
    }
    let t = TempDir::new("etcd");
    let p = shm.join(t.path().file_name().expect("temp dir name"));
    drop(t);
    std::fs::create_dir_all(&p).expect("create /dev/shm dir");
    TempDir(p)
}

/// One etcd member.
#[derive(Debug)]
pub struct EtcdMember {
    name: String,
    client_port: u16,
    peer_port: u16,
    dir: TempDir,
    child: Option<Child>,
    paused: bool,
    tls: Option<EtcdTls>,
}

/// TLS for a member: a second client URL, `https://127.0.0.1:<port>`, served with this
/// certificate and key (PEM files). The plain client port stays, for the harness's health check.
#[derive(Debug, Clone)]
pub struct EtcdTls {
    pub port: u16,
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
    /// Require a client certificate signed by this CA on the TLS port (`--client-cert-auth`).
    pub client_ca: Option<std::path::PathBuf>,
}

/// A private etcd cluster (1 or 3 members).
#[derive(Debug)]
pub struct EtcdCluster {
    pub members: Vec<EtcdMember>,
    initial_cluster: String,
}

fn etcd_bin() -> &'static str {
    assert!(
        std::path::Path::new("/usr/bin/etcd").exists(),
        "etcd is not installed (/usr/bin/etcd missing): run scripts/test (it installs Debian's \
         etcd-server) or `apt-get install etcd-server`"
    );
    "/usr/bin/etcd"
}

/// `GET /health` on a member's client port: true when it reports healthy (it has a leader).
pub fn healthy(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(
        &format!("127.0.0.1:{port}").parse().expect("addr"),
        Duration::from_millis(300),
    ) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.contains("\"health\":\"true\"")
}

impl EtcdMember {
    fn spawn(&mut self, initial_cluster: &str, state: &str) -> Result<(), String> {
        let data = self.dir.path().join("data");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("etcd.log"))
            .map_err(|e| e.to_string())?;
        let mut client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = Command::new(etcd_bin());
        if let Some(t) = &self.tls {
            client.push_str(&format!(",https://127.0.0.1:{}", t.port));
            cmd.arg("--cert-file")
                .arg(&t.cert)
                .arg("--key-file")
                .arg(&t.key);
            if let Some(ca) = &t.client_ca {
                cmd.arg("--client-cert-auth")
                    .arg("--trusted-ca-file")
                    .arg(ca);
            }
        }
        cmd.args(["--name", &self.name])
            .arg("--data-dir")
            .arg(&data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", initial_cluster])
            .args(["--initial-cluster-state", state])
            .args(["--initial-cluster-token", "dlock-test"])
            // Fast elections: a dead leader is replaced in about half a second.
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .env("ETCD_UNSUPPORTED_ARCH", "")
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        let child = spawn_child(cmd).map_err(|e| format!("spawn etcd: {e}"))?;
        self.child = Some(child);
        self.paused = false;
        Ok(())
    }

    fn exited(&mut self) -> Option<String> {
        let c = self.child.as_mut()?;
        if let Ok(Some(st)) = c.try_wait() {
            self.child = None;
            let log = std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
            let tail: String = log.lines().rev().take(15).collect::<Vec<_>>().join("\n");
            return Some(format!("etcd {} exited with {st}: {tail}", self.name));
        }
        None
    }

    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("member running").id()
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// SIGKILL and reap (the data dir stays, for a restart).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            if self.paused {
                let _ = signal_checked(c.id(), libc::SIGCONT);
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        self.paused = false;
    }

    /// SIGSTOP: the member stops answering, sockets stay open.
    pub fn pause(&mut self) {
        signal(self.pid(), libc::SIGSTOP);
        self.paused = true;
    }

    /// SIGCONT after [`EtcdMember::pause`].
    pub fn resume(&mut self) {
        signal(self.pid(), libc::SIGCONT);
        self.paused = false;
    }
}

fn signal_checked(pid: u32, sig: libc::c_int) -> bool {
    // SAFETY: plain kill(2) on a pid we spawned and have not reaped.
    unsafe { libc::kill(pid as libc::pid_t, sig) == 0 }
}

impl Drop for EtcdMember {
    fn drop(&mut self) {
        self.kill();
    }
}

impl EtcdCluster {
    /// A single member.
    pub fn single() -> EtcdCluster {
        Self::start(1)
    }

    /// Three members.
    pub fn three() -> EtcdCluster {
        Self::start(3)
    }

    /// `n` members on fresh ports, all healthy (tries new ports a few times).
    pub fn start(n: usize) -> EtcdCluster {
        let mut last = String::new();
        for _ in 0..3 {
            match Self::try_start(n) {
                Ok(c) => return c,
                Err(e) => last = e,
            }
        }
        panic!("could not start an etcd cluster of {n}: {last}");
    }

    /// A single member that also serves TLS (see [`EtcdTls`]); the port is given by the caller.
    pub fn single_tls(tls: EtcdTls) -> EtcdCluster {
        match Self::try_start_with(1, Some(tls)) {
            Ok(c) => c,
            Err(e) => panic!("could not start a TLS etcd: {e}"),
        }
    }

    fn try_start(n: usize) -> Result<EtcdCluster, String> {
        Self::try_start_with(n, None)
    }

    fn try_start_with(n: usize, tls: Option<EtcdTls>) -> Result<EtcdCluster, String> {
        let members: Vec<EtcdMember> = (0..n)
            .map(|i| EtcdMember {
                name: format!("m{i}"),
                client_port: free_port(),
                peer_port: free_port(),
                dir: shm_dir(),
                child: None,
                paused: false,
                tls: tls.clone(),
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut c = EtcdCluster {
            members,
            initial_cluster,
        };
        for m in &mut c.members {
            m.spawn(&c.initial_cluster, "new")?;
        }
        c.wait_healthy(&(0..n).collect::<Vec<_>>(), Duration::from_secs(60))?;
        Ok(c)
    }

    fn wait_healthy(&mut self, which: &[usize], limit: Duration) -> Result<(), String> {
        let started = Instant::now();
        loop {
            for &i in which {
                if let Some(e) = self.members[i].exited() {
                    return Err(e);
                }
            }
            if which.iter().all(|&i| healthy(self.members[i].client_port)) {
                return Ok(());
            }
            if started.elapsed() > limit {
                return Err(format!(
                    "etcd members {which:?} not healthy within {limit:?}"
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Client endpoints of every member (`127.0.0.1:port`).
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.endpoint()).collect()
    }

    /// `etcd://host:port[,host:port...]`.
    pub fn url(&self) -> String {
        format!("etcd://{}", self.endpoints().join(","))
    }

    /// Starts member `i` again on its ports and data dir, and waits until it is healthy.
    pub fn restart(&mut self, i: usize) {
        self.members[i].kill();
        let ic = self.initial_cluster.clone();
        self.members[i]
            .spawn(&ic, "existing")
            .unwrap_or_else(|e| panic!("restart etcd member {i}: {e}"));
        self.wait_healthy(&[i], Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("restart etcd member {i}: {e}"));
    }

    /// Index of the current leader among the running members (via a status call).
    pub async fn leader(&self) -> Option<usize> {
        for m in self.members.iter().filter(|m| m.is_running()) {
            let Ok(Ok(mut c)) = tokio::time::timeout(
                Duration::from_secs(2),
                dlock::etcd_client::Client::connect([m.endpoint()], None),
            )
            .await
            else {
                continue;
            };
            if let Ok(Ok(st)) = tokio::time::timeout(Duration::from_secs(2), c.status()).await {
                let leader = st.leader();
                if st.header().is_some_and(|h| h.member_id() == leader) {
                    return self
                        .members
                        .iter()
                        .position(|x| x.client_port == m.client_port);
                }
            }
        }
        None
    }
}

/// Request timeout of the test backends.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

pub async fn etcd_backend(cluster: &EtcdCluster) -> dlock::EtcdBackend {
    dlock::EtcdBackend::builder(&cluster.endpoints())
        .request_timeout(REQUEST_TIMEOUT)
        .build()
        .await
        .expect("connect to the private etcd")
}

/// A plain client for inspection and for deleting keys behind a holder's back.
pub async fn admin(cluster: &EtcdCluster) -> dlock::etcd_client::Client {
    dlock::etcd_client::Client::connect(cluster.endpoints(), None)
        .await
        .expect("admin client")
}

/// Every lock key under `/dlock/`: not the backend's own bookkeeping (cancel markers under
/// `/dlock/.cancelled/`, which stay until their lease ends, lease sentinels under
/// `/dlock/.leases/`, and the names' fence keys under `/dlock/.fence/`, which keep each name's
/// last token for good).
pub async fn keys_under_root(cluster: &EtcdCluster) -> Vec<String> {
    let mut c = admin(cluster).await;
    let r = c
        .get(
            "/dlock/",
            Some(dlock::etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .expect("get /dlock/");
    r.kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .filter(|k| {
            !k.starts_with("/dlock/.cancelled/")
                && !k.starts_with("/dlock/.leases/")
                && !k.starts_with("/dlock/.fence/")
        })
        .collect()
}

/// The etcd part of an [`Env`] (kept in `Env::extra`).
#[derive(Debug)]
pub struct EtcdEnv {
    pub cluster: Arc<EtcdCluster>,
    pub backend: dlock::EtcdBackend,
}

impl Env {
    /// A private single-member etcd and an `EtcdBackend` on it.
    pub async fn etcd() -> Env {
        let cluster = tokio::task::spawn_blocking(EtcdCluster::single)
            .await
            .expect("start etcd");
        let b = etcd_backend(&cluster).await;
        let mut env = Env::with_primary(Kind::Etcd, Arc::new(b.clone()));
        env.extra.push(Box::new(EtcdEnv {
            cluster: Arc::new(cluster),
            backend: b,
        }));
        env
    }

    pub fn etcd_env(&self) -> &EtcdEnv {
        self.extra
            .iter()
            .find_map(|e| e.downcast_ref::<EtcdEnv>())
            .expect("an etcd environment")
    }

    pub(crate) async fn etcd_force_delete(&self, name: &str) {
        let e = self.etcd_env();
        let mut c = admin(&e.cluster).await;
        let opts = dlock::etcd_client::GetOptions::new()
            .with_prefix()
            .with_sort(
                dlock::etcd_client::SortTarget::Create,
                dlock::etcd_client::SortOrder::Ascend,
            )
            .with_limit(1);
        let r = c
            .get(e.backend.lock_prefix(name), Some(opts))
            .await
            .expect("get");
        let first = r.kvs().first().expect("a holder key").key().to_vec();
        let d = c.delete(first, None).await.expect("delete holder key");
        assert_eq!(d.deleted(), 1);
    }

    pub(crate) async fn etcd_is_locked(&self, name: &str) -> bool {
        let e = self.etcd_env();
        let mut c = admin(&e.cluster).await;
        let opts = dlock::etcd_client::GetOptions::new()
            .with_prefix()
            .with_count_only();
        let r = c
            .get(e.backend.lock_prefix(name), Some(opts))
            .await
            .expect("get");
        r.count() > 0
    }

    pub(crate) async fn etcd_another_backend(&self) -> Arc<dyn dlock::Backend> {
        Arc::new(etcd_backend(&self.etcd_env().cluster).await)
    }
}
