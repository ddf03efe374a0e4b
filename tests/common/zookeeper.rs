//! Private ZooKeeper servers for the tests (feature `zookeeper`): a standalone server in a temp
//! dir with its own `zoo.cfg` and data dir on a free 127.0.0.1 port, admin server off, started
//! from Debian's jars (`scripts/test` installs the `zookeeper` package). Killed and reaped on drop.
//! [`ZkProc::start_tls`] starts one that serves TLS only (Netty's `secureClientPort`, PEM key
//! and trust stores, no plain-text port).

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Env, Kind, TempDir, free_port, spawn_child};

/// `tickTime` of the test servers: sessions may last 2..20 ticks (0.5 s .. 5 s).
pub const TICK_MS: u64 = 250;

/// A private standalone ZooKeeper.
#[derive(Debug)]
pub struct ZkProc {
    port: u16,
    dir: TempDir,
    child: Option<Child>,
    tls: Option<ZkTls>,
}

/// TLS of a private server: its only client port is then a TLS one.
#[derive(Debug, Clone)]
pub struct ZkTls {
    /// The server's certificate and its key (PEM).
    pub cert_pem: String,
    pub key_pem: String,
    /// `Some`: client certificates are required (`ssl.clientAuth=need`) and must chain to this
    /// CA (PEM); `None`: none is asked for.
    pub client_ca_pem: Option<String>,
}

/// zookeeper-client's connector for the tests' own sessions. With dlock's `tls` feature the
/// client's rustls needs a process-wide crypto provider even for plain text (a backend installs
/// ring's when it connects; a test may connect before any backend did).
pub fn connector() -> zookeeper_client::Connector {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    zookeeper_client::Client::connector()
}

fn classpath() -> String {
    let dir = std::path::Path::new("/usr/share/java");
    let jars = [
        "zookeeper.jar",
        "zookeeper-jute.jar",
        "slf4j-api.jar",
        if std::env::var_os("DLOCK_ZK_SERVER_LOG").is_some() {
            "slf4j-simple.jar"
        } else {
            "slf4j-nop.jar"
        },
        "netty-all.jar",
        // Netty TLS servers (`start_tls`): Debian's zookeeper.jar lists netty's buffer, common,
        // handler and transport jars in its manifest, not the codec, resolver and unix jars
        // the Netty server factory needs (netty-all.jar is empty there).
        "netty-codec.jar",
        "netty-resolver.jar",
        "netty-transport-native-unix-common.jar",
        "metrics-core.jar",
        "commons-cli.jar",
        "commons-io.jar",
    ];
    assert!(
        dir.join("zookeeper.jar").exists(),
        "ZooKeeper is not installed (/usr/share/java/zookeeper.jar missing): run scripts/test \
         (it installs Debian's zookeeper) or `apt-get install zookeeper`"
    );
    jars.iter()
        .map(|j| dir.join(j))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(":")
}

/// Sends a four-letter word and returns the answer.
pub fn four_letter(port: u16, cmd: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(
        &format!("127.0.0.1:{port}").parse().ok()?,
        Duration::from_millis(500),
    )
    .ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(cmd.as_bytes()).ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

impl ZkProc {
    pub fn start() -> ZkProc {
        Self::start_with(None)
    }

    /// A server whose only client port serves TLS (`hosts()` is that port).
    pub fn start_tls(tls: ZkTls) -> ZkProc {
        Self::start_with(Some(tls))
    }

    fn start_with(tls: Option<ZkTls>) -> ZkProc {
        let mut p = ZkProc {
            port: 0,
            dir: TempDir::new("zk"),
            child: None,
            tls,
        };
        let mut last = String::new();
        for _ in 0..5 {
            p.port = free_port();
            match p.spawn_and_wait() {
                Ok(()) => return p,
                Err(e) => last = e,
            }
        }
        panic!("could not start ZooKeeper: {last}");
    }

    fn spawn_and_wait(&mut self) -> Result<(), String> {
        let data = self.dir.path().join("data");
        std::fs::create_dir_all(&data).map_err(|e| e.to_string())?;
        let cfg = self.dir.path().join("zoo.cfg");
        let listen = match &self.tls {
            None => format!("clientPort={0}\nclientPortAddress=127.0.0.1\n", self.port),
            Some(tls) => self.tls_cfg(tls)?,
        };
        std::fs::write(
            &cfg,
            format!(
                "tickTime={TICK_MS}\ndataDir={}\n{listen}\
                 admin.enableServer=false\n4lw.commands.whitelist=*\nmaxClientCnxns=0\n\
                 extendedTypesEnabled=true\n",
                data.display(),
            ),
        )
        .map_err(|e| e.to_string())?;
        let log =
            std::fs::File::create(self.dir.path().join("zk.log")).map_err(|e| e.to_string())?;
        let mut cmd = Command::new("java");
        cmd.arg("-Xmx256m")
            .arg("-Dznode.container.checkIntervalMs=500")
            .arg("-Dznode.container.maxPerMinute=100000")
            .arg("-XX:+UseSerialGC")
            .arg("-cp")
            .arg(classpath())
            .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        let mut child = spawn_child(cmd).map_err(|e| format!("spawn java: {e}"))?;
        let started = Instant::now();
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                let log =
                    std::fs::read_to_string(self.dir.path().join("zk.log")).unwrap_or_default();
                return Err(format!("ZooKeeper exited with {st}: {log}"));
            }
            if self.serving() {
                self.child = Some(child);
                return Ok(());
            }
            if started.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                let _ = child.wait();
                return Err("ZooKeeper did not answer ruok within 60 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The Netty TLS settings (ZooKeeper >= 3.5.5 reads PEM stores): the certificate and key in
    /// one PEM file as key store, the client CA as trust store.
    fn tls_cfg(&self, tls: &ZkTls) -> Result<String, String> {
        let keystore = self.dir.path().join("keystore.pem");
        std::fs::write(&keystore, format!("{}{}", tls.cert_pem, tls.key_pem))
            .map_err(|e| e.to_string())?;
        let mut cfg = format!(
            "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory\n\
             secureClientPort={}\nsecureClientPortAddress=127.0.0.1\n\
             ssl.keyStore.location={}\nssl.keyStore.type=PEM\n",
            self.port,
            keystore.display()
        );
        match &tls.client_ca_pem {
            Some(ca) => {
                let truststore = self.dir.path().join("truststore.pem");
                std::fs::write(&truststore, ca).map_err(|e| e.to_string())?;
                cfg.push_str(&format!(
                    "ssl.trustStore.location={}\nssl.trustStore.type=PEM\nssl.clientAuth=need\n",
                    truststore.display()
                ));
            }
            None => cfg.push_str("ssl.clientAuth=none\n"),
        }
        Ok(cfg)
    }

    /// Up: a plain server answers `ruok` and `srvr`; a TLS one (no plain-text port, so no
    /// four-letter words) accepts connections on its TLS port, which Netty binds once the
    /// server is configured (a session asked for a moment early is retried by the client).
    fn serving(&self) -> bool {
        if self.tls.is_some() {
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.port));
            return TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok();
        }
        four_letter(self.port, "ruok").as_deref() == Some("imok")
            && four_letter(self.port, "srvr").is_some_and(|s| s.contains("Mode"))
    }

    pub fn hosts(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `zk://127.0.0.1:<port>`, or `zks://...` for a TLS server (no CA parameter).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "zks" } else { "zk" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// The directory of the server's files (for a test's own PEM files).
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for ZkProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Session timeout of the test backends: 2 s.
pub const SESSION: Duration = Duration::from_secs(2);

pub async fn zk_backend(server: &ZkProc) -> dlock::ZookeeperBackend {
    dlock::ZookeeperBackend::builder(&server.hosts())
        .session_timeout(SESSION)
        .build()
        .await
        .expect("connect to the private ZooKeeper")
}

/// A plain client for inspection and for deleting nodes behind a holder's back.
pub async fn admin(server: &ZkProc) -> zookeeper_client::Client {
    connector()
        .session_timeout(Duration::from_secs(5))
        .connect(&server.hosts())
        .await
        .expect("admin client")
}

impl Env {
    /// A private standalone ZooKeeper and a `ZookeeperBackend` on it.
    pub async fn zookeeper() -> Env {
        let server = tokio::task::spawn_blocking(ZkProc::start)
            .await
            .expect("start ZooKeeper");
        let b = zk_backend(&server).await;
        let mut env = Env::with_primary(Kind::Zookeeper, Arc::new(b.clone()));
        env.zk = Some((Arc::new(server), b));
        env
    }

    pub fn zk_server(&self) -> &ZkProc {
        &self.zk.as_ref().expect("a ZooKeeper environment").0
    }

    pub(crate) async fn zk_force_delete(&self, name: &str) {
        let (server, b) = self.zk.as_ref().expect("zk env");
        let c = admin(server).await;
        let dir = b.lock_dir(name);
        let mut kids = c.list_children(&dir).await.expect("lock dir exists");
        kids.sort_by_key(|k| k.rsplit("-lock-").next().unwrap_or("").to_string());
        let first = kids.first().expect("a holder node");
        c.delete(&format!("{dir}/{first}"), None)
            .await
            .expect("delete holder node");
    }

    pub(crate) async fn zk_is_locked(&self, name: &str) -> bool {
        let (server, b) = self.zk.as_ref().expect("zk env");
        let c = admin(server).await;
        match c.list_children(&b.lock_dir(name)).await {
            Ok(k) => !k.is_empty(),
            Err(zookeeper_client::Error::NoNode) => false,
            Err(e) => panic!("list children: {e}"),
        }
    }

    /// Every path under `/dlock` (lock parents and their nodes).
    pub async fn zk_tree(&self) -> Vec<String> {
        let c = admin(self.zk_server()).await;
        let mut out = Vec::new();
        let Ok(dirs) = c.list_children("/dlock").await else {
            return out;
        };
        for d in dirs {
            let p = format!("/dlock/{d}");
            for k in c.list_children(&p).await.unwrap_or_default() {
                out.push(format!("{p}/{k}"));
            }
            out.push(p);
        }
        out
    }

    pub async fn zk_root_is_empty(&self) -> bool {
        self.zk_tree().await.is_empty()
    }

    pub(crate) async fn zk_another_backend(&self) -> Arc<dyn dlock::Backend> {
        Arc::new(zk_backend(&self.zk.as_ref().expect("zk env").0).await)
    }

    /// A client of this environment's server (session timeout [`SESSION`]) whose connection
    /// runs through a proxy: `proxy.set_mode(Mode::Blackhole)` makes it a crashed (or hung)
    /// process, whose session, and every node it holds, the server ends by its session timeout.
    pub async fn zk_crashable_backend(&self) -> (super::proxy::Proxy, dlock::ZookeeperBackend) {
        let proxy = super::proxy::Proxy::start(self.zk_server().port());
        let b = dlock::ZookeeperBackend::builder(&format!("127.0.0.1:{}", proxy.port()))
            .session_timeout(SESSION)
            .build()
            .await
            .expect("connect to the private ZooKeeper through a proxy");
        (proxy, b)
    }
}

/// libfaketime's preload library (Debian's `libfaketime`): a member started with it runs its
/// wall clock (`System.currentTimeMillis`, hence `ctime`/`mtime`) at an offset; monotonic time
/// (`System.nanoTime`, ZooKeeper's session and tick clock) is left alone.
pub const FAKETIME_LIB: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// How a [`ZkEnsemble`] is started.
#[derive(Debug, Clone, Default)]
pub struct EnsembleOpts {
    /// Per member: a libfaketime offset of its wall clock (`"+8s"`, `"-8s"`); `None`: the host's.
    pub clock_offsets: [Option<&'static str>; 3],
    /// Members reach each other only through proxies, one per direction, member pair and port
    /// (quorum and election), so that one member can be cut off from its peers
    /// ([`ZkEnsemble::partition`]) while its client port stays reachable.
    pub proxied_peers: bool,
    /// `syncLimit` in ticks (default 8): how long a follower cut off from its leader goes on
    /// serving before it notices.
    pub sync_limit: Option<u32>,
    /// `maxSessionTimeout` (default 20 ticks, 5 s).
    pub max_session: Option<Duration>,
}

/// A private 3-server ZooKeeper ensemble on free loopback ports (client, quorum and election
/// port per member), each member in its own temp dir. Members can be killed, restarted, paused,
/// run with their own clock offset, and (when started with proxied peers) partitioned. With
/// `DLOCK_ZK_SERVER_LOG=<dir>` the members log (slf4j-simple, INFO, times to the ms: session
/// expiries, elections) and their logs are copied to `<dir>/<pid>-m<n>.log` when the ensemble
/// is dropped.
#[derive(Debug)]
pub struct ZkEnsemble {
    dir: TempDir,
    /// (client, quorum, election) ports of members 1..=3.
    ports: Vec<(u16, u16, u16)>,
    children: Vec<Option<Child>>,
    opts: EnsembleOpts,
    /// `(from, to)` -> proxies to `to`'s quorum and election ports, used by `from`.
    peer_proxies:
        std::collections::HashMap<(usize, usize), (super::proxy::Proxy, super::proxy::Proxy)>,
}

impl ZkEnsemble {
    pub const SIZE: usize = 3;

    pub fn start() -> ZkEnsemble {
        Self::start_with(EnsembleOpts::default())
    }

    pub fn start_with(opts: EnsembleOpts) -> ZkEnsemble {
        let dir = TempDir::new("zk-ensemble");
        let ports = (0..Self::SIZE)
            .map(|_| (free_port(), free_port(), free_port()))
            .collect::<Vec<_>>();
        let mut peer_proxies = std::collections::HashMap::new();
        if opts.proxied_peers {
            for from in 0..Self::SIZE {
                for to in (0..Self::SIZE).filter(|&t| t != from) {
                    let q = super::proxy::Proxy::start(ports[to].1);
                    let el = super::proxy::Proxy::start(ports[to].2);
                    peer_proxies.insert((from, to), (q, el));
                }
            }
        }
        let mut e = ZkEnsemble {
            dir,
            ports,
            children: (0..Self::SIZE).map(|_| None).collect(),
            opts,
            peer_proxies,
        };
        for i in 0..Self::SIZE {
            e.spawn(i);
        }
        let started = Instant::now();
        // A JVM under libfaketime starts several times slower (every clock read is
        // intercepted): more time for an ensemble with clock offsets on a loaded machine.
        let limit = if e.opts.clock_offsets.iter().any(Option::is_some) {
            Duration::from_secs(300)
        } else {
            Duration::from_secs(90)
        };
        while !(0..Self::SIZE).all(|i| e.mode(i).is_some()) {
            assert!(
                started.elapsed() < limit,
                "the ensemble did not form within {limit:?}: {:?}",
                (0..Self::SIZE).map(|i| e.mode(i)).collect::<Vec<_>>(),
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        e
    }

    fn spawn(&mut self, i: usize) {
        let home = self.dir.path().join(format!("m{}", i + 1));
        let data = home.join("data");
        std::fs::create_dir_all(&data).unwrap();
        std::fs::write(data.join("myid"), format!("{}\n", i + 1)).unwrap();
        let mut cfg = format!(
            "tickTime={TICK_MS}\ninitLimit=40\nsyncLimit={}\ndataDir={}\nclientPort={}\n\
             clientPortAddress=127.0.0.1\nadmin.enableServer=false\n4lw.commands.whitelist=*\n\
             maxClientCnxns=0\nextendedTypesEnabled=true\ncnxTimeout=500\n",
            self.opts.sync_limit.unwrap_or(8),
            data.display(),
            self.ports[i].0
        );
        if let Some(m) = self.opts.max_session {
            cfg.push_str(&format!("maxSessionTimeout={}\n", m.as_millis()));
        }
        for (j, (_, q, el)) in self.ports.iter().enumerate() {
            // A member binds its own line; it reaches the others through its proxies to them.
            let (q, el) = match self.peer_proxies.get(&(i, j)) {
                Some((pq, pe)) => (pq.port(), pe.port()),
                None => (*q, *el),
            };
            cfg.push_str(&format!("server.{}=127.0.0.1:{q}:{el}\n", j + 1));
        }
        let cfg_path = home.join("zoo.cfg");
        std::fs::write(&cfg_path, cfg).unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(home.join("zk.log"))
            .unwrap();
        let mut cmd = Command::new("java");
        if std::env::var_os("DLOCK_ZK_SERVER_LOG").is_some() {
            cmd.arg("-Dorg.slf4j.simpleLogger.showDateTime=true")
                .arg("-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS");
        }
        cmd.arg("-Xmx192m")
            .arg("-XX:+UseSerialGC")
            .arg("-Dznode.container.checkIntervalMs=500")
            .arg("-Dznode.container.maxPerMinute=100000")
            .arg("-cp")
            .arg(classpath())
            .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
            .arg(&cfg_path)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        if let Some(offset) = self.opts.clock_offsets[i] {
            assert!(
                std::path::Path::new(FAKETIME_LIB).exists(),
                "libfaketime is not installed ({FAKETIME_LIB} missing): apt-get install libfaketime"
            );
            cmd.env("LD_PRELOAD", FAKETIME_LIB)
                .env("FAKETIME", offset)
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        }
        self.children[i] = Some(spawn_child(cmd).expect("spawn java"));
    }

    /// Cuts member `i` off from its peers (both directions, quorum and election ports: the
    /// proxies drop every byte, connections stay open as in a network partition); its client
    /// port stays reachable. Needs `proxied_peers`.
    pub fn partition(&self, i: usize) {
        self.set_peer_mode(i, super::proxy::Mode::Blackhole);
    }

    /// Ends [`Self::partition`] (the connections that dropped bytes are closed).
    pub fn heal(&self, i: usize) {
        self.set_peer_mode(i, super::proxy::Mode::Pass);
    }

    fn set_peer_mode(&self, i: usize, mode: super::proxy::Mode) {
        assert!(self.opts.proxied_peers, "an ensemble without proxied peers");
        for ((from, to), (q, el)) in &self.peer_proxies {
            if *from == i || *to == i {
                q.set_mode(mode);
                el.set_mode(mode);
            }
        }
    }

    /// `leader` / `follower` when member `i` serves clients, else `None`.
    pub fn mode(&self, i: usize) -> Option<String> {
        let srvr = four_letter(self.ports[i].0, "srvr")?;
        let line = srvr.lines().find(|l| l.starts_with("Mode: "))?;
        Some(line["Mode: ".len()..].trim().to_string())
    }

    pub fn leader(&self) -> Option<usize> {
        (0..Self::SIZE).find(|&i| self.mode(i).as_deref() == Some("leader"))
    }

    /// The member client connections of `session` are on (from the `cons` four-letter word).
    pub fn member_of_session(&self, session: i64) -> Option<usize> {
        let needle = format!("sid=0x{session:x}");
        (0..Self::SIZE)
            .find(|&i| four_letter(self.ports[i].0, "cons").is_some_and(|c| c.contains(&needle)))
    }

    /// `127.0.0.1:c1,127.0.0.1:c2,127.0.0.1:c3`.
    pub fn hosts(&self) -> String {
        self.ports
            .iter()
            .map(|(c, _, _)| format!("127.0.0.1:{c}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn client_port(&self, i: usize) -> u16 {
        self.ports[i].0
    }

    /// SIGKILL member `i` and reap it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.children[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Restarts a killed member (same ports and data).
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i);
    }

    pub fn pid(&self, i: usize) -> Option<u32> {
        self.children[i].as_ref().map(Child::id)
    }
}

impl Drop for ZkEnsemble {
    fn drop(&mut self) {
        for i in 0..Self::SIZE {
            if let Some(pid) = self.pid(i) {
                // A paused member must run again to die.
                // SAFETY: kill(2) on a child we spawned and have not reaped.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
            }
            self.kill(i);
        }
        if let Some(to) = std::env::var_os("DLOCK_ZK_SERVER_LOG") {
            let to = std::path::PathBuf::from(to);
            let _ = std::fs::create_dir_all(&to);
            for i in 0..Self::SIZE {
                let _ = std::fs::copy(
                    self.dir.path().join(format!("m{}", i + 1)).join("zk.log"),
                    to.join(format!("{}-m{}.log", std::process::id(), i + 1)),
                );
            }
        }
    }
}
