//! The ZooKeeper backend: ephemeral sequential znodes, the lowest sequence holds the lock.
//!
//! Layout: `<root>/<escaped name>/_c_<32 hex>-lock-<sequence>`, data = the owner id, a newline
//! and the holder identity `name@host:pid` (what the
//! operator's `dlock::admin` shows). The lock parent is a container node (ZooKeeper >= 3.5.3
//! removes it once empty), the contender nodes are ephemeral, so the session is the lease.
//!
//! - `try_acquire` creates the caller's node once (protected mode: the `_c_<guid>` prefix lets a
//!   create whose reply was lost find and keep its own node instead of leaving an orphan), then
//!   lists the children: the lowest sequence holds. A contender that is not lowest stays queued
//!   (its node is kept under `(name, owner)`) and watches **its predecessor only**; the next try
//!   re-checks instead of creating again.
//! - `release` of a holder deletes its node (after `keep_for` when given); `release` of a queued
//!   contender (a wait that ended) deletes its node too and answers `NotOwner`. A hold is
//!   forgotten only once the server confirmed its node gone (deleted, `NoNode`, or its session
//!   ended): a delete that failed (a connection loss fails the written requests, and the client
//!   does not re-send them, while the session lives on) is retried by a per-node reaper on the
//!   driver thread with back-off until then, and the release answers `LockError::Backend`
//!   meanwhile, never `NotOwner`. `release` itself runs on the driver thread, so a caller's
//!   runtime that shuts down cannot cut it off.
//! - The fencing token follows the token rule of every engine: strictly increasing per name,
//!   and at least server time in µs. At the grant, `token = max(last + 1, ctime × 1000)`, where
//!   `last` is the token stored in the lock parent's data (`"<token> <holder node>"`) and `ctime`
//!   is the granted node's creation time (the leader's clock, ms). It is stored there before the
//!   guard is returned, by one `multi` that checks the holder's own node still exists (so a
//!   holder whose session ended meanwhile cannot write) and sets the parent's data at the
//!   version read (a stale read retries, bounded). `last` is on the servers, so tokens keep
//!   increasing across restarts and leader changes whatever the members' clocks; the ctime
//!   floor keeps them above the µs tokens of the other engines, and in order when an emptied
//!   lock parent was removed and made again. Cost: one more write per grant (the parent's
//!   data is read in the same round trip as the children).
//! - `extend` does not write: it `sync`s (through the leader) and checks that the node still
//!   exists (bounded by the request timeout). `ttl` is not sent to the server; the session is
//!   the lease. A session that expired makes every hold answer `Lost`, and the next acquisition
//!   opens a new session. The guard's own deadline covers a disconnected session or a follower
//!   cut off from the leader: at most [`session_lease`] (the session timeout less how far
//!   behind the leader's record of the session may be) from the send time of the last check or
//!   grant confirmed through the leader.
//!
//! Semaphores, read-write locks and leader records use the same nodes, tokens, watches and
//! reaper, each primitive in a directory of its own beside the lock's: see `zookeeper/prims.rs`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use zookeeper_client as zk;

use super::driver::Driver;
use super::{Acquired, Backend, BoxFuture, Extended, Record, Released, RwSide, Watch};
use crate::LockError;
use crate::wait::WaitQueues;

pub(crate) mod admin;
mod prims;

/// The default root of the lock nodes.
pub(crate) const DEFAULT_ROOT: &str = "/dlock";

/// Builder of a [`ZookeeperBackend`].
#[derive(Clone)]
pub struct ZookeeperBackendBuilder {
    hosts: String,
    root: String,
    session_timeout: Duration,
    request_timeout: Duration,
    /// `(user, password)` for ZooKeeper's `digest` scheme.
    digest: Option<(String, String)>,
    /// TLS on every host (`zks://`, `Self::tls`); `None`: plain text.
    tls: Option<TlsConf>,
}

/// The TLS settings of a ZooKeeper connection: CA certificates (PEM; none: the Mozilla roots of
/// `webpki-roots`) and an optional client certificate and key. Checked when connecting; `Debug`
/// shows counts, never the key.
#[derive(Clone, Default)]
pub(crate) struct TlsConf {
    ca_pem: Vec<Vec<u8>>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for TlsConf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConf")
            .field("ca_certs", &self.ca_pem.len())
            .field("client_identity", &self.identity.is_some())
            .finish()
    }
}

#[cfg(feature = "tls")]
fn tls_config_error(what: &str) -> LockError {
    LockError::Config(format!("ZooKeeper TLS: {what}"))
}

#[cfg(feature = "tls")]
impl TlsConf {
    /// The client's TLS options, every PEM checked (a bad one is [`LockError::Config`] whose
    /// message names the part, never its content).
    fn options(&self) -> Result<zk::TlsOptions, LockError> {
        use rustls::pki_types::pem::PemObject as _;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        fn certs(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>, LockError> {
            let certs = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| tls_config_error(&format!("the {what} is not valid PEM")))?;
            if certs.is_empty() {
                return Err(tls_config_error(&format!(
                    "no PEM certificate in the {what}"
                )));
            }
            Ok(certs)
        }
        fn text<'a>(pem: &'a [u8], what: &str) -> Result<&'a str, LockError> {
            std::str::from_utf8(pem)
                .map_err(|_| tls_config_error(&format!("the {what} is not valid PEM")))
        }
        let mut opts = if self.ca_pem.is_empty() {
            zk::TlsOptions::default()
        } else {
            zk::TlsOptions::no_ca()
        };
        for pem in &self.ca_pem {
            certs(pem, "CA certificate")?;
            opts = opts
                .with_pem_ca_certs(text(pem, "CA certificate")?)
                .map_err(|_| tls_config_error("the CA certificate is not a usable certificate"))?;
        }
        if let Some((cert, key)) = &self.identity {
            let chain = certs(cert, "client certificate")?;
            let der = PrivateKeyDer::from_pem_slice(key).map_err(|_| {
                tls_config_error("no PEM private key (PKCS#8, PKCS#1 or SEC1) in the client key")
            })?;
            // Key and certificate must belong together: checked now, not at the handshake.
            rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .map_err(|_| tls_config_error("no TLS protocol version available"))?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_client_auth_cert(chain, der)
            .map_err(|_| {
                tls_config_error(
                    "the client key does not match the client certificate or is not supported",
                )
            })?;
            opts = opts
                .with_pem_identity(text(cert, "client certificate")?, text(key, "client key")?)
                .map_err(|_| tls_config_error("the client certificate or key is not usable"))?;
        }
        Ok(opts)
    }
}

/// Readies `connector` for `tls` (TLS on every host) or plain text, and says whether to connect
/// securely. With the `tls` feature, zookeeper-client's rustls (built with both ring, for the
/// other backends, and its default aws-lc-rs) needs a process-wide crypto provider even for
/// plain connections: ring's is installed when none is.
pub(crate) fn prepare(
    connector: &mut zk::Connector,
    tls: Option<&TlsConf>,
) -> Result<bool, LockError> {
    #[cfg(feature = "tls")]
    {
        super::ensure_crypto_provider();
        if let Some(t) = tls {
            connector.tls(t.options()?);
            return Ok(true);
        }
        Ok(false)
    }
    #[cfg(not(feature = "tls"))]
    {
        let _ = connector;
        match tls {
            Some(_) => Err(no_tls_feature()),
            None => Ok(false),
        }
    }
}

/// Opens a session on `hosts`, TLS on every host when `secure` (see [`prepare`]).
pub(crate) async fn open_client(
    connector: &mut zk::Connector,
    hosts: &str,
    secure: bool,
) -> Result<zk::Client, zk::Error> {
    #[cfg(feature = "tls")]
    if secure {
        return connector.secure_connect(hosts).await;
    }
    debug_assert!(!secure, "TLS without the tls feature");
    connector.connect(hosts).await
}

#[cfg(not(feature = "tls"))]
fn no_tls_feature() -> LockError {
    LockError::Config("ZooKeeper over TLS (`zks://`) needs dlock's `tls` feature".to_string())
}

impl std::fmt::Debug for ZookeeperBackendBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        f.debug_struct("ZookeeperBackendBuilder")
            .field("hosts", &self.hosts)
            .field("root", &self.root)
            .field("session_timeout", &self.session_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("digest_user", &self.digest.as_ref().map(|(u, _)| u))
            .field("tls", &self.tls)
            .finish()
    }
}

impl ZookeeperBackendBuilder {
    /// Session timeout asked of the server (default 10 s): how long after a crash or a pause a
    /// holder's node stays.
    pub fn session_timeout(mut self, t: Duration) -> Self {
        self.session_timeout = t;
        self
    }

    /// Root path of the lock nodes (default `/dlock`).
    pub fn root(mut self, root: &str) -> Self {
        self.root = root.trim_end_matches('/').to_string();
        self
    }

    /// Bound of every request to the server (default 5 s).
    pub fn request_timeout(mut self, t: Duration) -> Self {
        self.request_timeout = t;
        self
    }

    /// Authenticates every session with ZooKeeper's `digest` scheme (`user:password`, sent at
    /// session start and again on every reconnect). The nodes this backend creates (lock
    /// parents and contender nodes) then carry the `auth` ACL (`creator_all`: all permissions for
    /// this digest identity only) instead of `world:anyone`, so other identities can neither
    /// queue under the same names nor delete the nodes.
    ///
    /// The root itself is not created with a restrictive ACL by dlock; to keep other identities
    /// out of it, create it beforehand with an ACL for this user (for example
    /// `setAcl /dlock digest:user:<base64 sha1(user:password)>:cdrwa`). A backend whose
    /// identity lacks a permission it needs gets [`LockError::Backend`] with the server's
    /// `NoAuth` as source (no retry, no orphan node). A digest with a wrong password is not
    /// refused at connect by ZooKeeper: it is simply another identity, refused by the ACLs.
    pub fn digest_auth(mut self, user: &str, password: &str) -> Self {
        self.digest = Some((user.to_string(), password.to_string()));
        self
    }

    /// TLS on every host (feature `tls`; `zks://` in a URL), the server's certificate checked
    /// against the Mozilla roots (`webpki-roots`) unless [`Self::tls_ca_pem`] gives CAs, and its
    /// name against the host name or IP address in `hosts`. The servers serve TLS on their
    /// `secureClientPort` (Netty); a plain-text port, a certificate that does not verify, or a
    /// server that wants a client certificate and gets none fail [`Self::build`] with
    /// [`LockError::Backend`] within the request timeout. `false` turns TLS off again.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls(mut self, on: bool) -> Self {
        self.tls = on.then(|| self.tls.take().unwrap_or_default());
        self
    }

    /// Trusts the CA certificate(s) in `pem` (feature `tls`; may be called again to add more):
    /// the server's certificate must then chain to one of these, not to the Mozilla roots.
    /// Turns TLS on. A PEM without a certificate is [`LockError::Config`] at [`Self::build`].
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls_ca_pem(mut self, pem: &[u8]) -> Self {
        let mut t = self.tls.take().unwrap_or_default();
        t.ca_pem.push(pem.to_vec());
        self.tls = Some(t);
        self
    }

    /// A client certificate (chain) and its private key, both PEM, for servers that require one
    /// (`ssl.clientAuth=need`; feature `tls`). Turns TLS on; combine with [`Self::tls_ca_pem`].
    /// A PEM that does not parse, or a key that does not match the certificate, is
    /// [`LockError::Config`] at [`Self::build`]; the key never appears in `Debug` or errors.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls_identity_pem(mut self, cert_pem: &[u8], key_pem: &[u8]) -> Self {
        let mut t = self.tls.take().unwrap_or_default();
        t.identity = Some((cert_pem.to_vec(), key_pem.to_vec()));
        self.tls = Some(t);
        self
    }

    /// The ACL of the nodes this backend creates (see [`Self::digest_auth`]).
    fn node_acls(&self) -> zk::Acls<'static> {
        if self.digest.is_some() {
            zk::Acls::creator_all()
        } else {
            zk::Acls::anyone_all()
        }
    }

    /// Connects: the same as [`Self::build`], under the name every other engine's builder
    /// uses (`PostgresBackend::builder(url)..connect()`, `RedisBackend::builder(url)..connect()`).
    pub async fn connect(self) -> Result<ZookeeperBackend, LockError> {
        self.build().await
    }

    /// Connects (bounded by the request timeout).
    pub async fn build(self) -> Result<ZookeeperBackend, LockError> {
        if !self.root.starts_with('/') || self.root.len() < 2 {
            return Err(LockError::Config(format!(
                "ZooKeeper root must be an absolute path other than `/`, got {:?}",
                self.root
            )));
        }
        // A bad PEM is a configuration error now, before any thread or connection.
        prepare(&mut zk::Client::connector(), self.tls.as_ref())?;
        // The client's session task and every task of this backend run on its own driver
        // thread, so it survives the shutdown of any caller's runtime (see `Driver`).
        ensure_chroot(&self).await?;
        let driver = Driver::start("dlock-zk")?;
        let session = Session::open(&self, &driver.handle).await?;
        Ok(ZookeeperBackend {
            inner: Arc::new(Inner {
                cfg: self,
                session: Mutex::new(session),
                holds: Mutex::new(HashMap::new()),
                waiters: WaitQueues::new(),
                sem_waiters: WaitQueues::new(),
                read_waiters: WaitQueues::new(),
                write_waiters: WaitQueues::new(),
                notifications: Default::default(),
                children_reads: Default::default(),
                watch_tasks: Default::default(),
                driver,
            }),
        })
    }
}

async fn connect(cfg: &ZookeeperBackendBuilder) -> Result<zk::Client, LockError> {
    connect_to(cfg, &cfg.hosts).await
}

/// A chroot (`host:port/chroot`) that does not exist yet is created, as Curator creates its
/// namespace: on a fresh ensemble every acquire would otherwise fail with `NoNode`. Persistent
/// nodes with the backend's node ACL, made through a short session without the chroot, and only
/// when a chroot is configured and missing.
async fn ensure_chroot(cfg: &ZookeeperBackendBuilder) -> Result<(), LockError> {
    let Some((hosts, chroot)) = cfg.hosts.split_once('/') else {
        return Ok(());
    };
    let chroot = format!("/{}", chroot.trim_end_matches('/'));
    if chroot == "/" {
        return Ok(());
    }
    let client = connect_to(cfg, hosts).await?;
    let bound = cfg.request_timeout;
    let exists = tokio::time::timeout(bound, client.check_stat(&chroot)).await;
    let made = match exists {
        Ok(Ok(Some(_))) => return Ok(()),
        Ok(Ok(None)) => {
            let opts = zk::CreateMode::Persistent.with_acls(root_acls(cfg));
            tokio::time::timeout(bound, client.mkdir(&chroot, &opts)).await
        }
        Ok(Err(e)) => Ok(Err(e)),
        Err(e) => Err(e),
    };
    match made {
        Ok(Ok(())) => {
            tracing::info!(chroot = %chroot, "dlock: created the ZooKeeper chroot");
            Ok(())
        }
        Ok(Err(e)) => Err(LockError::Config(format!(
            "the ZooKeeper chroot {chroot} does not exist and could not be created: {e}"
        ))),
        Err(_) => Err(be(
            "",
            format!("creating the ZooKeeper chroot {chroot} timed out"),
        )),
    }
}

async fn connect_to(cfg: &ZookeeperBackendBuilder, hosts: &str) -> Result<zk::Client, LockError> {
    let bound = cfg.request_timeout;
    let mut connector = zk::Client::connector();
    connector
        .session_timeout(cfg.session_timeout)
        .connection_timeout(bound);
    if let Some((user, password)) = &cfg.digest {
        connector.auth(
            "digest".to_string(),
            format!("{user}:{password}").into_bytes(),
        );
    }
    let secure = prepare(&mut connector, cfg.tls.as_ref())?;
    match tokio::time::timeout(bound, open_client(&mut connector, hosts, secure)).await {
        Ok(Ok(c)) => Ok(c),
        // The client's own deadline (the session timeout, when shorter than the bound).
        Ok(Err(zk::Error::Timeout)) if secure => Err(be("", tls_timeout(hosts))),
        Ok(Err(e)) => Err(be("", e)),
        Err(_) if secure => Err(be("", tls_timeout(hosts))),
        Err(_) => Err(be("", format!("connecting to ZooKeeper {hosts} timed out"))),
    }
}

/// The client retries a refused TLS handshake like any failed connection (its cause is only in
/// its `debug` log), so those failures end as a time-out.
fn tls_timeout(hosts: &str) -> String {
    format!(
        "connecting to ZooKeeper {hosts} over TLS timed out (an untrusted server certificate, a \
         plain-text port, or a refused or missing client certificate fails this way)"
    )
}

/// How long after sending a request that the leader answered (a `sync`, a write) a session is
/// sure to live on, given the negotiated session `timeout` and the client's connection timeout
/// (the request timeout): `timeout` less how far behind the leader's record of the session's
/// last activity may be.
///
/// The leader expires a session `timeout` after it last heard of it (rounded up to its tick),
/// and of a session on a follower it hears only through that follower's replies to its pings,
/// sent every half tick, each listing the sessions that made a request since the previous
/// one. A request answered through the leader proves the follower's link was up when it was
/// forwarded, so every ping reply sent before it was counted; not that the reply listing this
/// very request was (it is sent at the next ping, after the request, and a partition may take
/// it). What the leader has surely counted is an earlier request or ping of the session: at
/// most one ping period plus the longest gap between the client's sends before. The gap:
/// zookeeper-client 0.9 pings after 3 of its ticks without a send, checked every tick (a tick
/// is `timeout / 20`, or the connection timeout / 8 when that is at most 3/5 of `timeout`),
/// so at most 4 ticks. The ping period is half a tick of the servers, which the client is not
/// told: at most `timeout / 4`, since a session lasts at least 2 ticks (ZooKeeper's default
/// `minSessionTimeout`). Together at most 0.55 of `timeout`, and the rest is the lease.
/// (Review M3's follow-up: counting the whole `timeout` from the `sync`'s send time let a
/// holder on a follower cut off right after a renewal stay valid about half a second after the
/// leader granted the lock again, `tests/zk_faults.rs`.)
pub(crate) fn session_lease(timeout: Duration, connection_timeout: Duration) -> Duration {
    let client_tick = if connection_timeout.is_zero() || connection_timeout > timeout * 3 / 5 {
        timeout / 20
    } else {
        connection_timeout / 8
    }
    .max(Duration::from_millis(1));
    let leader_ping = timeout / 4;
    timeout.saturating_sub(leader_ping + client_tick * 4)
}

/// One ZooKeeper session: its client, the negotiated timeout, and a token cancelled once it
/// ended (expired, closed or failed authentication) or was replaced.
#[derive(Debug, Clone)]
struct Session {
    client: zk::Client,
    id: i64,
    timeout: Duration,
    gone: CancellationToken,
}

impl Session {
    /// Connects and starts the session-state watcher: a terminal state cancels `gone`, which
    /// every guard of this session listens to (`lost()` at once, not at the guard's deadline).
    async fn open(
        cfg: &ZookeeperBackendBuilder,
        driver: &tokio::runtime::Handle,
    ) -> Result<Session, LockError> {
        let c = cfg.clone();
        let client = driver
            .spawn(async move { connect(&c).await })
            .await
            .map_err(|e| be("", e))??;
        let gone = CancellationToken::new();
        let mut states = client.state_watcher();
        let id = client.session_id().0;
        let ended = gone.clone();
        driver.spawn(async move {
            loop {
                tokio::select! {
                    _ = ended.cancelled() => return,
                    s = states.changed() => match s {
                        zk::SessionState::Expired
                        | zk::SessionState::Closed
                        | zk::SessionState::AuthFailed => {
                            tracing::warn!(session = id, state = ?s, "dlock: ZooKeeper session ended; its holds are lost");
                            ended.cancel();
                            return;
                        }
                        zk::SessionState::Disconnected => {
                            // The guards' own deadlines (the session timeout from the last
                            // answered check) apply until the session is back or expired.
                            tracing::debug!(session = id, "dlock: ZooKeeper session disconnected");
                        }
                        _ => {}
                    },
                }
            }
        });
        Ok(Session {
            timeout: client.session_timeout(),
            id,
            client,
            gone,
        })
    }

    fn ended(&self) -> bool {
        self.gone.is_cancelled()
            || matches!(
                self.client.state(),
                zk::SessionState::Expired | zk::SessionState::Closed | zk::SessionState::AuthFailed
            )
    }
}

fn is_no_node(e: &LockError) -> bool {
    is_zk(e, &zk::Error::NoNode)
}

fn is_zk(e: &LockError, what: &zk::Error) -> bool {
    matches!(e, LockError::Backend { source, .. }
        if source.downcast_ref::<zk::Error>() == Some(what))
}

/// The ACL of the root and of the ancestors the backend creates above it (review m6): without
/// a digest identity, `world:anyone` (as every node then); with one, every identity may read
/// and create lock parents under it (`world:anyone:cr`) while only the creating identity may
/// delete, write or change its ACL. Lock parents and contender nodes keep the node ACL
/// (`creator_all`), so another identity can neither queue under a name it did not create nor
/// delete another identity's nodes, and a second service with its own digest user gets its own
/// names, not `NoAuth` on the whole root. An operator who wants the root closed creates it
/// beforehand with the ACL of their choice.
fn root_acls(cfg: &ZookeeperBackendBuilder) -> zk::Acls<'static> {
    static SHARED: std::sync::LazyLock<[zk::Acl; 2]> = std::sync::LazyLock::new(|| {
        [
            zk::Acl::new(
                zk::Permission::READ | zk::Permission::CREATE,
                zk::AuthId::new("world", "anyone"),
            ),
            zk::Acl::new(zk::Permission::ALL, zk::AuthId::new("auth", "")),
        ]
    });
    if cfg.digest.is_some() {
        zk::Acls::new(&SHARED[..])
    } else {
        zk::Acls::anyone_all()
    }
}

fn be(key: &str, e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> LockError {
    LockError::Backend {
        key: key.to_string(),
        source: e.into(),
    }
}

/// Which primitive a node belongs to: each has a directory of its own beside the lock's
/// (see [`Inner::dir_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Prim {
    Lock,
    /// A semaphore's permits.
    Sem,
    /// The read side of a read-write lock.
    Read,
    /// The write side of a read-write lock.
    Write,
}

/// A hold (or queued contender) of this backend: one node.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct HoldKey {
    prim: Prim,
    name: String,
    owner: String,
}

impl HoldKey {
    fn new(prim: Prim, name: &str, owner: &str) -> Self {
        HoldKey {
            prim,
            name: name.to_string(),
            owner: owner.to_string(),
        }
    }
}

#[derive(Debug, Clone)]
struct Hold {
    /// Full path of this contender's node (ending in `-lock-`: a create whose reply was not
    /// read, its node known only by that unique prefix).
    path: String,
    /// Session that created it.
    session: i64,
    held: bool,
    count: u32,
    /// Held: the granted fencing token. Queued: the token floor, the node's `ctime` in µs.
    token: u64,
    /// A predecessor watch is armed.
    watching: bool,
    /// The task waiting on that watch: aborted (which drops the client's watcher) when the
    /// contender leaves, so a busy try or a given-up wait leaves no task and no watcher behind.
    watch_task: Option<Arc<tokio::task::AbortHandle>>,
    /// Being deleted: the reaper's progress. The hold stays here until the server confirmed
    /// the node gone (or its session ended), so no later release of this owner can answer
    /// `NotOwner` for a node that may still be there.
    releasing: Option<tokio::sync::watch::Receiver<Reaping>>,
}

/// How a node was confirmed gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gone {
    /// Deleted by this backend.
    Deleted,
    /// The server answered `NoNode`, or the session that owned it ended (its ephemeral nodes
    /// go with it).
    Absent,
}

/// The progress of a node's reaper (see [`Inner::start_reaping`]).
#[derive(Debug, Clone, Default)]
struct Reaping {
    /// Delete attempts made so far.
    tries: u32,
    /// The first attempt waits for a `keep_for` (the release already answered `Freed`).
    delayed: bool,
    /// Confirmed gone: the hold is forgotten.
    done: Option<Gone>,
    /// Why the last attempt failed.
    last_error: Option<Arc<str>>,
}

/// Counts a live task (up at creation, down when dropped: finished or aborted).
struct TaskCount(Arc<std::sync::atomic::AtomicUsize>);

impl TaskCount {
    fn new(n: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        TaskCount(Arc::clone(n))
    }
}

impl Drop for TaskCount {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Attempts at storing a grant's token whose parent version moved on (see `grant_token`).
const TOKEN_CAS_TRIES: usize = 8;
/// The same for a semaphore's or a read-write lock's grant, whose holders grant at once.
const SHARED_TOKEN_CAS_TRIES: usize = 64;

/// The token stored in a lock parent's data (`"<token> <holder node>"`) and the node it was
/// granted to; `None` for a parent that has none (new, or written by nothing else).
pub(crate) fn last_token(data: &[u8]) -> Option<(u64, &str)> {
    let s = std::str::from_utf8(data).ok()?;
    let (t, node) = s.split_once(' ')?;
    Some((t.parse().ok()?, node))
}

/// A contender node's data: the owner id, a newline and the holder identity (name@host:pid).
fn node_data(owner: &str) -> Vec<u8> {
    let holder = crate::holder::holder_text();
    let mut data = Vec::with_capacity(owner.len() + 1 + holder.len());
    data.extend_from_slice(owner.as_bytes());
    data.push(b'\n');
    data.extend_from_slice(holder.as_bytes());
    data
}

/// The sequence of a node of any kind (see [`seq_after`]).
fn any_seq(child: &str) -> Option<i64> {
    ["-lock-", "-sem-", "-write-", "-read-"]
        .iter()
        .find_map(|m| seq_after(child, m))
}

/// A semaphore node's `(max, permits)`, from its name `_c_<guid>-<max>-<permits>-sem-<seq>`.
fn sem_shape(child: &str) -> Option<(u32, u32)> {
    let i = child.rfind("-sem-")?;
    let mut parts = child[..i].rsplitn(3, '-');
    let permits = parts.next()?.parse().ok()?;
    let max = parts.next()?.parse().ok()?;
    parts.next()?;
    Some((max, permits))
}

/// What a try found, by its primitive's rule (see [`Inner::decide`]).
enum Decision {
    Grant,
    /// Queued: wait for a change of this node (a child of the same directory).
    WaitNode(String),
    /// Queued as a semaphore's first waiter: wait for a change of the listing.
    WaitListing,
    /// Refused (a semaphore's `max` mismatch); the node goes.
    Refuse(LockError),
}

/// First and longest pause between a reaper's delete attempts.
const REAP_RETRY_FIRST: Duration = Duration::from_millis(50);
const REAP_RETRY_MAX: Duration = Duration::from_secs(1);

/// Where a hold's node is.
enum Target<'a> {
    Path(&'a str),
    /// A create whose reply was not read: the node, if made, is the child of `dir` whose name
    /// starts with `prefix` (protected mode).
    Prefix {
        dir: &'a str,
        prefix: &'a str,
    },
}

fn target_of(path: &str) -> Target<'_> {
    // A created node's name ends in its sequence (digits); a pending one in its kind's marker
    // (`-lock-`, `-sem-`, `-read-`, `-write-`).
    match path.rsplit_once('/') {
        Some((dir, prefix)) if path.ends_with('-') => Target::Prefix { dir, prefix },
        _ => Target::Path(path),
    }
}

#[derive(Debug)]
struct Inner {
    cfg: ZookeeperBackendBuilder,
    session: Mutex<Session>,
    holds: Mutex<HashMap<HoldKey, Hold>>,
    waiters: Arc<WaitQueues>,
    /// The local waiters for permits, read holds and write holds.
    sem_waiters: Arc<WaitQueues>,
    read_waiters: Arc<WaitQueues>,
    write_waiters: Arc<WaitQueues>,
    /// Predecessor-watch notifications received (for tests and metrics).
    notifications: std::sync::atomic::AtomicU64,
    /// Children listings sent by tries (for tests: the cost of a hand-off).
    children_reads: std::sync::atomic::AtomicU64,
    /// Predecessor-watch tasks alive (for tests: none may outlive its contender).
    watch_tasks: Arc<std::sync::atomic::AtomicUsize>,
    /// The thread whose runtime runs the sessions and this backend's own tasks (last: dropped
    /// after the session).
    driver: Driver,
}

/// Locks on ZooKeeper (feature `zookeeper`). See the module documentation for the protocol.
#[derive(Debug, Clone)]
pub struct ZookeeperBackend {
    inner: Arc<Inner>,
}

/// `(user, password)` from a URL, percent-decoded.
pub(crate) type UserPass = (String, String);

/// Splits `user:password@rest` (the `@` before the first `/`); no user part leaves `rest`
/// whole. Errors never contain the password.
pub(crate) fn split_userinfo(rest: &str) -> Result<(Option<UserPass>, &str), LockError> {
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return Ok((None, rest));
    };
    let (info, hosts) = (&rest[..at], &rest[at + 1..]);
    match info.split_once(':') {
        Some((user, password)) if !user.is_empty() => Ok((
            Some((
                super::url_decode(user, "user")?,
                super::url_decode(password, "password")?,
            )),
            hosts,
        )),
        _ => Err(LockError::Config(
            "the user part of the URL must be `user:password@`".to_string(),
        )),
    }
}

/// A parsed `zk://` or `zks://` URL (no `Debug`: it holds the password).
pub(crate) struct ZkUrl<'a> {
    pub(crate) userinfo: Option<UserPass>,
    /// `hosts[/chroot]`, without the query.
    pub(crate) hosts: &'a str,
    /// `zks://`: TLS, with the PEM files its query named already read.
    pub(crate) tls: Option<TlsConf>,
}

impl ZkUrl<'_> {
    /// `zk://` or `zks://`, the user (never the password) and the hosts: for messages.
    pub(crate) fn shown(&self) -> String {
        let scheme = if self.tls.is_some() { "zks" } else { "zk" };
        match &self.userinfo {
            Some((user, _)) => format!("{scheme}://{user}@{}", self.hosts),
            None => format!("{scheme}://{}", self.hosts),
        }
    }
}

/// Splits `zk[s]://[user:password@]hosts[/chroot][?tls_ca=<path>&tls_cert=<path>&tls_key=<path>]`
/// (see [`ZookeeperBackend::connect`]) and reads the PEM files the query names. Errors never
/// contain the password.
pub(crate) fn parse_url(url: &str) -> Result<ZkUrl<'_>, LockError> {
    let (rest, tls) = if let Some(rest) = url.strip_prefix("zk://") {
        (rest, false)
    } else if let Some(rest) = url.strip_prefix("zks://") {
        (rest, true)
    } else {
        return Err(LockError::Config(
            "a ZooKeeper URL starts with zk:// (or zks:// for TLS)".to_string(),
        ));
    };
    let (userinfo, rest) = split_userinfo(rest)?;
    let (hosts, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (mut ca, mut cert, mut key) = (None, None, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let slot = match k {
            "tls_ca" => &mut ca,
            "tls_cert" => &mut cert,
            "tls_key" => &mut key,
            _ => {
                return Err(LockError::Config(format!(
                    "unknown ZooKeeper URL parameter `{k}` (tls_ca, tls_cert, tls_key)"
                )));
            }
        };
        if !tls {
            return Err(LockError::Config(format!(
                "the ZooKeeper URL parameter `{k}` needs a zks:// URL"
            )));
        }
        *slot = Some(super::url_decode(v, k)?);
    }
    if !tls {
        return Ok(ZkUrl {
            userinfo,
            hosts,
            tls: None,
        });
    }
    #[cfg(not(feature = "tls"))]
    {
        let _ = (ca, cert, key);
        Err(no_tls_feature())
    }
    #[cfg(feature = "tls")]
    {
        let read = |param: &str, path: &str| {
            std::fs::read(path).map_err(|e| {
                LockError::Config(format!(
                    "ZooKeeper TLS: cannot read `{param}` file {path:?}: {e}"
                ))
            })
        };
        let mut conf = TlsConf::default();
        if let Some(p) = &ca {
            conf.ca_pem.push(read("tls_ca", p)?);
        }
        match (&cert, &key) {
            (Some(c), Some(k)) => conf.identity = Some((read("tls_cert", c)?, read("tls_key", k)?)),
            (None, None) => {}
            _ => {
                return Err(tls_config_error(
                    "`tls_cert` and `tls_key` go together (a client certificate and its key)",
                ));
            }
        }
        Ok(ZkUrl {
            userinfo,
            hosts,
            tls: Some(conf),
        })
    }
}

/// The sequence of a contender node, as an order key. ZooKeeper's sequence is a signed 32-bit
/// counter per parent, printed `%010d`: after 2^31 creates under one parent it wraps to
/// `-2147483648`. Negative sequences are later than every positive one (review m5), so they
/// map above them (`s + 2^32`).
pub(crate) fn seq_of(child: &str) -> Option<i64> {
    seq_after(child, "-lock-")
}

/// The sequence of a node whose kind's marker is `marker` (`-lock-`, `-sem-`, `-read-`,
/// `-write-`), as an order key (see [`seq_of`]).
pub(crate) fn seq_after(child: &str, marker: &str) -> Option<i64> {
    let i = child.rfind(marker)?;
    let s: i64 = child[i + marker.len()..].parse().ok()?;
    if !(i64::from(i32::MIN)..=i64::from(i32::MAX)).contains(&s) {
        return None;
    }
    Some(if s < 0 { s + (1i64 << 32) } else { s })
}

pub(crate) fn escape(name: &str) -> String {
    let mut s = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.' && !s.is_empty() {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

impl ZookeeperBackend {
    /// A builder for `hosts` (`host:port[,host:port...][/chroot]`).
    pub fn builder(hosts: &str) -> ZookeeperBackendBuilder {
        ZookeeperBackendBuilder {
            hosts: hosts.to_string(),
            root: DEFAULT_ROOT.to_string(),
            session_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(5),
            digest: None,
            tls: None,
        }
    }

    /// Connects to `zk://[user:password@]host:port[,host:port...][/chroot]` with the default
    /// settings; `user:password` is [`ZookeeperBackendBuilder::digest_auth`].
    ///
    /// `zks://` (feature `tls`) is the same over TLS on every host (the servers'
    /// `secureClientPort`), the server certificate checked against the Mozilla roots, or
    /// against the CA file of `?tls_ca=/path/ca.pem`;
    /// `&tls_cert=/path/client.pem&tls_key=/path/client.key` presents a client certificate
    /// (see `ZookeeperBackendBuilder::tls`). A `@` in a path is written `%40`. The files are
    /// read here; an unreadable one, or any `tls_*` parameter on a `zk://` URL, is
    /// [`LockError::Config`]. Without the feature, `zks://` is [`LockError::Config`].
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        let u = parse_url(url)?;
        let mut b = Self::builder(u.hosts);
        if let Some((user, password)) = u.userinfo {
            b = b.digest_auth(&user, &password);
        }
        b.tls = u.tls;
        b.build().await
    }

    /// The directory of `name`'s contender nodes.
    pub fn lock_dir(&self, name: &str) -> String {
        format!("{}/{}", self.inner.cfg.root, escape(name))
    }

    /// The current session id (changes after an expired session was replaced).
    pub fn session_id(&self) -> i64 {
        self.inner.client().session_id().0
    }

    /// The session timeout the server granted for the current session (it may differ from the
    /// one asked for: servers clamp it to 2..20 ticks). The guard's lease is at most this long.
    pub fn session_timeout(&self) -> Duration {
        self.inner.session().timeout
    }

    /// The current session's id and password, for tests that expire it from outside (attach a
    /// second client to the session and close it). Not a stable API.
    #[doc(hidden)]
    pub fn session_info(&self) -> zk::SessionInfo {
        self.inner.client().session().clone()
    }

    /// Predecessor-watch notifications this backend received so far: one per release that
    /// unblocks one of its contenders (no herd).
    pub fn watch_notifications(&self) -> u64 {
        self.inner
            .notifications
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Children listings this backend's tries sent so far (one per re-check that went to the
    /// server). Not a stable API: for tests of the hand-off cost.
    #[doc(hidden)]
    pub fn children_reads(&self) -> u64 {
        self.inner
            .children_reads
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Predecessor-watch tasks alive (each holds a client watcher). Not a stable API: for
    /// tests that no contender leaves one behind.
    #[doc(hidden)]
    pub fn watch_tasks(&self) -> usize {
        self.inner
            .watch_tasks
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Number of callers waiting in this process.
    pub fn waiter_count(&self) -> usize {
        self.inner.waiters.waiter_count()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Stops the state watcher of the current session.
        self.session().gone.cancel();
    }
}

impl Inner {
    fn session(&self) -> MutexGuard<'_, Session> {
        self.session.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn client(&self) -> zk::Client {
        self.session().client.clone()
    }

    fn holds(&self) -> MutexGuard<'_, HashMap<HoldKey, Hold>> {
        self.holds.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes the first local waiter of `name` that has no queued node of its own (by the owner
    /// id it tries with). Returns whether one was.
    fn wake_one_nodeless(&self, prim: Prim, name: &str) -> bool {
        let queued: Vec<String> = self
            .holds()
            .iter()
            .filter(|(k, h)| k.prim == prim && k.name == name && !h.held && h.releasing.is_none())
            .map(|(k, _)| k.owner.clone())
            .collect();
        self.queue(prim)
            .wake_first_where(name, |o| o.is_none_or(|o| !queued.iter().any(|q| q == o)))
    }

    /// The local wait queue of a primitive (each its own: a semaphore's waiters never share a
    /// queue with the lock's of the same name).
    fn queue(&self, prim: Prim) -> &Arc<WaitQueues> {
        match prim {
            Prim::Lock => &self.waiters,
            Prim::Sem => &self.sem_waiters,
            Prim::Read => &self.read_waiters,
            Prim::Write => &self.write_waiters,
        }
    }

    /// The client, replaced by a new session when the current one expired or closed.
    async fn live_client(&self) -> Result<zk::Client, LockError> {
        let old = self.session().clone();
        if !old.ended() {
            return Ok(old.client);
        }
        let fresh = Session::open(&self.cfg, &self.driver.handle).await?;
        let mut cur = self.session();
        if cur.id != old.id && !cur.ended() {
            // Another caller replaced it meanwhile: keep theirs, close ours.
            fresh.gone.cancel();
            return Ok(cur.client.clone());
        }
        old.gone.cancel();
        *cur = fresh.clone();
        drop(cur);
        tracing::warn!(
            old = old.id,
            new = fresh.id,
            "dlock: ZooKeeper session ended; a new session was opened"
        );
        Ok(fresh.client)
    }

    async fn bounded<T>(
        &self,
        key: &str,
        f: impl std::future::Future<Output = Result<T, zk::Error>>,
    ) -> Result<T, LockError> {
        match tokio::time::timeout(self.cfg.request_timeout, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(be(key, e)),
            Err(_) => Err(be(key, "ZooKeeper request timed out")),
        }
    }

    /// Creates the lock parent `dir` (a container with the node ACL). A missing root (and its
    /// missing ancestors) is made first, as plain persistent nodes with [`root_acls`]: not
    /// containers, and not owned by whichever identity happened to come first (review m6).
    async fn make_parent(&self, c: &zk::Client, name: &str, dir: &str) -> Result<(), LockError> {
        let parent = zk::CreateMode::Container.with_acls(self.cfg.node_acls());
        for _ in 0..2 {
            match self.bounded(name, c.create(dir, &[], &parent)).await {
                Ok(_) => return Ok(()),
                Err(e) if is_zk(&e, &zk::Error::NodeExists) => return Ok(()),
                Err(e) if is_no_node(&e) => {
                    let root = zk::CreateMode::Persistent.with_acls(root_acls(&self.cfg));
                    match self.bounded(name, c.mkdir(&self.cfg.root, &root)).await {
                        Ok(()) => {}
                        Err(e) if is_zk(&e, &zk::Error::NodeExists) => {}
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(be(name, "the ZooKeeper lock root keeps disappearing"))
    }

    /// Creates this contender's node (protected mode), returns (path, token floor: its `ctime`
    /// in µs).
    async fn create_node(
        self: &Arc<Self>,
        c: &zk::Client,
        name: &str,
        dir: &str,
        key: &HoldKey,
        session: i64,
        tag: &str,
    ) -> Result<(String, u64), LockError> {
        let mut guid = [0u8; 16];
        getrandom::fill(&mut guid).map_err(|e| be(name, e.to_string()))?;
        let guid: String = guid.iter().map(|b| format!("{b:02x}")).collect();
        let prefix = format!("_c_{guid}-{tag}");
        let path = format!("{dir}/{prefix}");
        // Recorded before the create is sent: a future dropped before the reply (a cancelled
        // wait) leaves this pending entry, and `release` then finds the node by its prefix.
        self.holds().insert(
            key.clone(),
            Hold {
                path: path.clone(),
                session,
                held: false,
                count: 0,
                token: 0,
                watching: false,
                watch_task: None,
                releasing: None,
            },
        );
        let opts = zk::CreateMode::EphemeralSequential.with_acls(self.cfg.node_acls());
        // The node's data: the owner id, a newline and the holder identity (name@host:pid).
        let data = node_data(&key.owner);
        // Nothing was created: forget the pending entry.
        let nothing = |e: LockError| {
            self.holds().remove(key);
            Err(e)
        };
        for _ in 0..3 {
            match tokio::time::timeout(self.cfg.request_timeout, c.create(&path, &data, &opts))
                .await
            {
                Ok(Ok((stat, seq))) => {
                    let floor = u64::try_from(stat.ctime).unwrap_or(0).saturating_mul(1000);
                    return Ok((format!("{path}{seq}"), floor));
                }
                Ok(Err(zk::Error::NoNode)) => {
                    if let Err(e) = self.make_parent(c, name, dir).await {
                        return nothing(e);
                    }
                }
                Ok(Err(
                    e @ (zk::Error::NoAuth | zk::Error::InvalidAcl | zk::Error::AuthFailed),
                )) => {
                    // Refused: nothing was created, nothing to clean up.
                    return nothing(be(name, e));
                }
                Ok(Err(e)) => {
                    // Any other error (connection loss, the client's own timeout, ...) may
                    // come after the server created the node: the reaper finds it by its
                    // unique prefix and deletes it (retried until done or the session ended;
                    // the hold stays until then), and the failure is reported (no orphan).
                    self.start_reaping(key, Duration::ZERO);
                    return Err(be(name, e));
                }
                Err(_) => {
                    self.start_reaping(key, Duration::ZERO);
                    return Err(be(
                        name,
                        "ZooKeeper create timed out; its node, if made, is removed",
                    ));
                }
            }
        }
        nothing(be(name, "ZooKeeper lock parent keeps disappearing"))
    }

    async fn try_acquire(
        self: &Arc<Self>,
        name: &str,
        owner: &str,
        _ttl: Duration,
    ) -> Result<Acquired, LockError> {
        self.try_node(HoldKey::new(Prim::Lock, name, owner), "lock-".to_string())
            .await
    }

    /// A try of any primitive (see [`Inner::decide`] for each one's rule): creates the caller's
    /// node once (protected mode, named `_c_<guid>-<tag><sequence>`), lists the directory, and
    /// grants, refuses, or leaves the node queued behind the one node (or, for a semaphore's
    /// first waiter, the listing) whose change can let it in.
    async fn try_node(self: &Arc<Self>, key: HoldKey, tag: String) -> Result<Acquired, LockError> {
        let name = key.name.as_str();
        let c = self.live_client().await?;
        let session = c.session_id().0;
        let existing = self.holds().get(&key).cloned();
        if existing.as_ref().is_some_and(|h| h.releasing.is_some()) {
            // Owners are fresh per acquisition; this one was given back already.
            return Err(be(name, "this owner's lock node is being deleted"));
        }
        if let Some(h) = &existing
            && h.session == session
            && !h.held
            && h.releasing.is_none()
            && h.watching
            && h.watch_task.is_some()
        {
            // Queued behind a predecessor that is still there (its change would have fired the
            // watch, which clears `watching` before it wakes anyone): still busy, no request.
            // The other local waiters a notification wakes end here, so a hand-off costs one
            // re-check in this process, not one per waiter (review m1, as etcd does).
            return Ok(Acquired::Busy { remaining: None });
        }
        let dir = self.dir_of(key.prim, name);
        let (path, floor) = match existing {
            Some(h) if h.session == session => {
                if h.held {
                    // A re-entry: the node must still be there (it may have been deleted).
                    let alive = self
                        .bounded(name, c.check_stat(&h.path))
                        .await?
                        .is_some_and(|st| st.ephemeral_owner == session);
                    if !alive {
                        self.holds().remove(&key);
                        return Box::pin(self.try_node(key, tag)).await;
                    }
                    let mut holds = self.holds();
                    let Some(h) = holds.get_mut(&key) else {
                        return Err(be(name, "ZooKeeper lock node vanished (session trouble)"));
                    };
                    h.count = h.count.saturating_add(1);
                    return Ok(Acquired::Granted {
                        token: h.token,
                        count: h.count,
                    });
                }
                (h.path, h.token)
            }
            _ => {
                // None, or a node of an expired session (gone with it).
                self.holds().remove(&key);
                // On an error, `create_node` forgot the entry (nothing created) or handed it to
                // the reaper (a create whose outcome is unknown).
                let (path, floor) = self
                    .create_node(&c, name, &dir, &key, session, &tag)
                    .await?;
                if let Some(h) = self.holds().get_mut(&key) {
                    h.path = path.clone();
                    h.token = floor;
                }
                (path, floor)
            }
        };
        let mine = path.rsplit('/').next().unwrap_or("").to_string();
        let my_seq = any_seq(&mine).unwrap_or(i64::MAX);
        // The children and the parent's data (the last token) in one round trip: both requests
        // are sent before either reply is awaited, and the server answers them in order.
        self.children_reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (children, parent) = tokio::join!(
            self.bounded(name, c.list_children(&dir)),
            self.bounded(name, c.get_data(&dir))
        );
        let (mut children, parent) = match (children, parent) {
            (Ok(ch), Ok(p)) => (ch, p),
            (Err(e), _) | (_, Err(e)) => {
                // Queued or not, the node goes (the reaper retries until confirmed).
                self.start_reaping(&key, Duration::ZERO);
                return Err(e);
            }
        };
        let mut listing_watch: Option<zk::OneshotWatcher> = None;
        for _ in 0..4 {
            if !children.contains(&mine) {
                self.holds().remove(&key);
                return Err(be(name, "ZooKeeper lock node vanished (session trouble)"));
            }
            let decision = match self.decide(&key, &c, &dir, &children, &mine, my_seq).await {
                Ok(d) => d,
                Err(e) => {
                    self.start_reaping(&key, Duration::ZERO);
                    return Err(e);
                }
            };
            match decision {
                Decision::Grant => {
                    let touch = key.prim == Prim::Sem;
                    let token = self
                        .grant_token(&c, name, &key, &dir, &path, &mine, floor, parent, touch)
                        .await?;
                    let mut holds = self.holds();
                    let Some(h) = holds.get_mut(&key) else {
                        return Err(be(name, "ZooKeeper lock node vanished (session trouble)"));
                    };
                    if let Some(t) = h.watch_task.take() {
                        t.abort();
                    }
                    h.watching = false;
                    h.held = true;
                    h.count = 1;
                    h.token = token;
                    return Ok(Acquired::Granted { token, count: 1 });
                }
                Decision::Refuse(e) => {
                    // The node goes; the wait's give-up finds it being deleted.
                    self.start_reaping(&key, Duration::ZERO);
                    return Err(e);
                }
                Decision::WaitNode(pred) => {
                    self.watch_predecessor(&c, &key, &format!("{dir}/{pred}"))
                        .await?;
                    return Ok(Acquired::Busy { remaining: None });
                }
                Decision::WaitListing => {
                    if let Some(w) = listing_watch.take() {
                        let arm = {
                            let mut holds = self.holds();
                            match holds.get_mut(&key) {
                                Some(h) => !std::mem::replace(&mut h.watching, true),
                                None => false,
                            }
                        };
                        if arm {
                            self.spawn_watch(&key, w);
                        }
                        return Ok(Acquired::Busy { remaining: None });
                    }
                    if self
                        .holds()
                        .get(&key)
                        .is_some_and(|h| h.watching && h.watch_task.is_some())
                    {
                        return Ok(Acquired::Busy { remaining: None });
                    }
                    // The listing again, now with a watch (fires at the next change of the
                    // children), decided again on what it shows.
                    self.children_reads
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    match self.bounded(name, c.list_and_watch_children(&dir)).await {
                        Ok((ch, w)) => {
                            children = ch;
                            listing_watch = Some(w);
                        }
                        Err(e) => {
                            self.start_reaping(&key, Duration::ZERO);
                            return Err(e);
                        }
                    }
                }
            }
        }
        // The listing kept changing: busy for now, woken by the next change of the children.
        if let Some(w) = listing_watch {
            let arm = {
                let mut holds = self.holds();
                match holds.get_mut(&key) {
                    Some(h) => !std::mem::replace(&mut h.watching, true),
                    None => false,
                }
            };
            if arm {
                self.spawn_watch(&key, w);
            }
        } else {
            self.queue(key.prim).wake_owner(name, &key.owner);
        }
        Ok(Acquired::Busy { remaining: None })
    }

    /// Arms a watch on the node at `pred_path` for the queued contender `key` (unless one is
    /// armed): its change or deletion wakes that contender only. A predecessor already gone
    /// wakes it at once.
    async fn watch_predecessor(
        self: &Arc<Self>,
        c: &zk::Client,
        key: &HoldKey,
        pred_path: &str,
    ) -> Result<(), LockError> {
        let name = key.name.as_str();
        let arm = {
            let mut holds = self.holds();
            match holds.get_mut(key) {
                Some(h) => !std::mem::replace(&mut h.watching, true),
                None => false,
            }
        };
        if !arm {
            return Ok(());
        }
        match self.bounded(name, c.check_and_watch_stat(pred_path)).await {
            Ok((Some(_), w)) => {
                self.spawn_watch(key, w);
                Ok(())
            }
            Ok((None, _)) => {
                // Predecessor already gone: the caller retries at once.
                if let Some(h) = self.holds().get_mut(key) {
                    h.watching = false;
                }
                self.queue(key.prim).wake_owner(name, &key.owner);
                Ok(())
            }
            Err(e) => {
                if let Some(h) = self.holds().get_mut(key) {
                    h.watching = false;
                }
                Err(e)
            }
        }
    }

    /// The task that waits on `w` for the queued contender `key` (`watching` already set): when
    /// it fires, it wakes that contender's waiter only.
    fn spawn_watch(self: &Arc<Self>, key: &HoldKey, w: zk::OneshotWatcher) {
        // Weak: a pending watch does not keep a dropped backend (its session and driver
        // thread) alive.
        let me = Arc::downgrade(self);
        let wkey = key.clone();
        let alive = TaskCount::new(&self.watch_tasks);
        let task = self.driver.handle.spawn(async move {
            let _alive = alive;
            let _ = w.changed().await;
            let Some(me) = me.upgrade() else {
                return;
            };
            me.notifications
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if let Some(h) = me.holds().get_mut(&wkey) {
                h.watching = false;
                h.watch_task = None;
            }
            // The predecessor left or changed: wake the waiter whose node follows it, so it
            // re-checks (one wake-up, not one per local waiter).
            me.queue(wkey.prim).wake_owner(&wkey.name, &wkey.owner);
        });
        match self.holds().get_mut(key) {
            Some(h) if h.releasing.is_none() && h.watching && !h.held => {
                h.watch_task = Some(Arc::new(task.abort_handle()));
            }
            // Left (or the watch fired) meanwhile: aborting a finished task is a no-op.
            _ => task.abort(),
        }
    }

    /// The token of a grant (see the module doc): `max(last + 1, floor)`, stored in the lock
    /// parent's data by one `multi` that also checks that the holder's node `path` still
    /// exists, before the guard exists. `parent` is the parent's data as read with the
    /// children; a version that moved on (another writer, or a read that lagged) is read again,
    /// at most [`TOKEN_CAS_TRIES`] times. A `multi` whose outcome is unknown is not sent again:
    /// the node goes (as for a failed listing) and the try fails.
    #[allow(clippy::too_many_arguments)]
    async fn grant_token(
        self: &Arc<Self>,
        c: &zk::Client,
        name: &str,
        key: &HoldKey,
        dir: &str,
        path: &str,
        mine: &str,
        floor: u64,
        parent: (Vec<u8>, zk::Stat),
        touch: bool,
    ) -> Result<u64, LockError> {
        let (mut data, mut stat) = parent;
        // Holders at once (permits, readers) store their tokens at once: each round one of
        // them wins, so they get more rounds than a lock's single holder.
        let tries = if key.prim == Prim::Lock {
            TOKEN_CAS_TRIES
        } else {
            SHARED_TOKEN_CAS_TRIES
        };
        for _ in 0..tries {
            let last = last_token(&data).map_or(0, |(t, _)| t);
            let token = last.saturating_add(1).max(floor);
            let mut w = c.new_check_writer(path, None).map_err(|e| be(name, e))?;
            if touch {
                // A semaphore's grant rewrites its own node (same data, next version): the
                // waiter queued behind it hears of the grant and checks whether it is next.
                w.add_set_data(path, &node_data(&key.owner), None)
                    .map_err(|e| be(name, e))?;
            }
            w.add_set_data(
                dir,
                format!("{token} {mine}").as_bytes(),
                Some(stat.version),
            )
            .map_err(|e| be(name, e))?;
            match tokio::time::timeout(self.cfg.request_timeout, w.commit()).await {
                Ok(Ok(_)) => return Ok(token),
                Ok(Err(zk::CheckWriteError::CheckFailed { .. })) => {
                    // The holder's node is gone (deleted by an operator, or its session ended).
                    self.holds().remove(key);
                    return Err(be(name, "ZooKeeper lock node vanished (session trouble)"));
                }
                Ok(Err(zk::CheckWriteError::OperationFailed {
                    source: zk::Error::BadVersion,
                    ..
                })) => match self.bounded(name, c.get_data(dir)).await {
                    Ok(p) => (data, stat) = p,
                    Err(e) => {
                        self.start_reaping(key, Duration::ZERO);
                        return Err(e);
                    }
                },
                Ok(Err(e)) => {
                    self.start_reaping(key, Duration::ZERO);
                    return Err(be(name, e));
                }
                Err(_) => {
                    self.start_reaping(key, Duration::ZERO);
                    return Err(be(name, "ZooKeeper request timed out (storing the token)"));
                }
            }
        }
        self.start_reaping(key, Duration::ZERO);
        Err(be(
            name,
            "the ZooKeeper lock parent's token kept changing under this grant",
        ))
    }

    /// One attempt at deleting the node at `path` (see [`target_of`]) on `c`, bounded by the
    /// request timeout: `Ok` once the server confirmed it gone.
    async fn delete_node(&self, name: &str, c: &zk::Client, path: &str) -> Result<Gone, LockError> {
        match target_of(path) {
            Target::Path(p) => match self.bounded(name, c.delete(p, None)).await {
                Ok(()) => Ok(Gone::Deleted),
                Err(e) if is_no_node(&e) => Ok(Gone::Absent),
                Err(e) => Err(e),
            },
            Target::Prefix { dir, prefix } => {
                // The session may have moved to another server since the create was sent: the
                // create, committed by the leader, may not be applied on this one yet. `sync`
                // first, so the listing below sees it.
                match self.bounded(name, c.sync(dir)).await {
                    Ok(()) => {}
                    Err(e) if is_no_node(&e) => return Ok(Gone::Absent),
                    Err(e) => return Err(e),
                }
                let children = match self.bounded(name, c.list_children(dir)).await {
                    Ok(ch) => ch,
                    Err(e) if is_no_node(&e) => return Ok(Gone::Absent),
                    Err(e) => return Err(e),
                };
                let mut gone = Gone::Absent;
                for ch in children.iter().filter(|ch| ch.starts_with(prefix)) {
                    match self
                        .bounded(name, c.delete(&format!("{dir}/{ch}"), None))
                        .await
                    {
                        Ok(()) => gone = Gone::Deleted,
                        Err(e) if is_no_node(&e) => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(gone)
            }
        }
    }

    /// Hands `key`'s hold (if any) to its reaper (see [`Self::reaping_locked`]).
    fn start_reaping(
        self: &Arc<Self>,
        key: &HoldKey,
        delay: Duration,
    ) -> Option<tokio::sync::watch::Receiver<Reaping>> {
        let mut holds = self.holds();
        let h = holds.get_mut(key)?;
        Some(self.reaping_locked(key, h, delay))
    }

    /// Marks hold `h` (of `key`) as being deleted and starts its reaper on the driver thread
    /// (unless one runs already): the first attempt after `delay` (a `keep_for`), then retries
    /// with back-off ([`REAP_RETRY_FIRST`] doubling to [`REAP_RETRY_MAX`]) until the server
    /// confirmed the node gone (deleted, or `NoNode`) or its session ended. Only then is the
    /// hold forgotten. A delete lost to a connection loss (zookeeper-client fails the written
    /// requests of a broken connection and does not re-send them; the session lives on) is
    /// thus sent again on the reconnected session instead of leaving the node to block the
    /// name for as long as the session lives. Returns the reaper's progress.
    fn reaping_locked(
        self: &Arc<Self>,
        key: &HoldKey,
        h: &mut Hold,
        delay: Duration,
    ) -> tokio::sync::watch::Receiver<Reaping> {
        if let Some(rx) = &h.releasing {
            return rx.clone();
        }
        let (tx, rx) = tokio::sync::watch::channel(Reaping {
            delayed: !delay.is_zero(),
            ..Reaping::default()
        });
        h.releasing = Some(rx.clone());
        // The contender leaves: its predecessor watch goes too (review M4).
        if let Some(t) = h.watch_task.take() {
            t.abort();
        }
        h.watching = false;
        self.driver.handle.spawn(reap(
            Arc::downgrade(self),
            key.clone(),
            h.path.clone(),
            h.session,
            delay,
            tx,
        ));
        rx
    }

    /// Waits for the reaper behind `rx`: `Some` once the node is confirmed gone, `None` when its
    /// first attempt waits for a `keep_for`. An attempt made that did not confirm it within the
    /// request timeout is a [`LockError::Backend`] (the reaper goes on).
    async fn await_reaped(
        &self,
        name: &str,
        mut rx: tokio::sync::watch::Receiver<Reaping>,
    ) -> Result<Option<Gone>, LockError> {
        let start = tokio::time::Instant::now();
        let bound = self.cfg.request_timeout;
        loop {
            let st = rx.borrow_and_update().clone();
            if let Some(g) = st.done {
                return Ok(Some(g));
            }
            if st.delayed && st.tries == 0 {
                return Ok(None);
            }
            // One attempt is itself bounded by the request timeout: wait for at least one,
            // then give up waiting once the bound passed.
            let until = start + if st.tries > 0 { bound } else { bound * 3 };
            if tokio::time::Instant::now() >= until {
                return Err(be(
                    name,
                    format!(
                        "deleting the ZooKeeper lock node is not confirmed ({}); the backend \
                         retries until it is or the session ends",
                        st.last_error.as_deref().unwrap_or("no answer yet")
                    ),
                ));
            }
            if let Ok(Err(_)) = tokio::time::timeout_at(until, rx.changed()).await {
                let st = rx.borrow().clone();
                return match st.done {
                    Some(g) => Ok(Some(g)),
                    None => Err(be(
                        name,
                        "the ZooKeeper backend stopped before its lock node was confirmed deleted",
                    )),
                };
            }
        }
    }

    /// Gives back `owner`'s hold of `name`. Runs on the driver thread (see
    /// `Backend::release`). The hold is forgotten only once its node is confirmed gone; until
    /// then the reaper retries, and this (and every later release of the owner) answers
    /// [`LockError::Backend`], never `NotOwner`.
    async fn release(
        self: &Arc<Self>,
        key: HoldKey,
        keep_for: Option<Duration>,
        all: bool,
    ) -> Result<Released, LockError> {
        let name = key.name.as_str();
        let session = {
            let s = self.session();
            (!s.ended()).then_some(s.id)
        };
        let (held, rx) = {
            let mut holds = self.holds();
            let Some(h) = holds.get_mut(&key) else {
                return Ok(Released::NotOwner);
            };
            if h.releasing.is_none() && h.held && h.count > 1 && !all {
                h.count -= 1;
                return Ok(Released::Decremented(h.count));
            }
            // A node whose session ended is gone already: no `keep_for` to honour.
            let delay = match keep_for {
                Some(k) if h.held && session == Some(h.session) => k,
                _ => Duration::ZERO,
            };
            (h.held, self.reaping_locked(&key, h, delay))
        };
        match self.await_reaped(name, rx).await? {
            // `None`: kept for `keep_for`, then deleted (answered now, as before).
            Some(Gone::Deleted) | None if held => Ok(Released::Freed),
            // Not ours any more (deleted by an operator, or its session ended), or a queued
            // contender's node (a wait that ended).
            _ => Ok(Released::NotOwner),
        }
    }

    async fn extend(&self, key: HoldKey) -> Result<Extended, LockError> {
        let name = key.name.as_str();
        let Some(h) = self.holds().get(&key).cloned() else {
            return Ok(Extended::Lost);
        };
        let sess = self.session().clone();
        if !h.held || h.releasing.is_some() || sess.id != h.session || sess.ended() {
            return Ok(Extended::Lost);
        }
        let c = sess.client;
        // `sync` first (review M3): a server answers reads and pings from its own state, so a
        // follower cut off from the leader would go on confirming the node after the leader
        // expired the session. A `sync` completes only through the leader, and the server
        // answers a session's requests in order, so the check is answered after it: a
        // renewal is confirmed only with the leader's say. Both are sent at once (one round
        // trip to the leader).
        let dir = h.path.rsplit_once('/').map_or("/", |(d, _)| d);
        let (synced, st) = tokio::join!(
            self.bounded(name, c.sync(dir)),
            self.bounded(name, c.check_stat(&h.path))
        );
        match synced {
            Ok(()) => {}
            // The parent went: so did the node.
            Err(e) if is_no_node(&e) => return Ok(Extended::Lost),
            Err(e) => return Err(e),
        }
        match st? {
            Some(st) if st.ephemeral_owner == h.session => Ok(Extended::Extended),
            _ => Ok(Extended::Lost),
        }
    }
}

/// The reaper of one node (see [`Inner::reaping_locked`]), a task on the driver thread. It keeps
/// only a weak reference to the backend: a dropped backend closes its session, which takes the
/// node along.
async fn reap(
    me: std::sync::Weak<Inner>,
    key: HoldKey,
    path: String,
    session: i64,
    delay: Duration,
    tx: tokio::sync::watch::Sender<Reaping>,
) {
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let mut backoff = REAP_RETRY_FIRST;
    let mut tries = 0u32;
    loop {
        let Some(inner) = me.upgrade() else {
            return;
        };
        let sess = inner.session().clone();
        let r = if sess.id != session || sess.ended() {
            Ok(Gone::Absent)
        } else {
            inner.delete_node(&key.name, &sess.client, &path).await
        };
        tries += 1;
        match r {
            Ok(gone) => {
                {
                    let mut holds = inner.holds();
                    if holds
                        .get(&key)
                        .is_some_and(|h| h.path == path && h.releasing.is_some())
                    {
                        holds.remove(&key);
                    }
                }
                tx.send_modify(|st| {
                    st.tries = tries;
                    st.done = Some(gone);
                });
                if tries > 1 {
                    tracing::info!(key = %key.name, tries, "dlock: a ZooKeeper lock node whose delete had failed is gone");
                }
                // A waiter of this process that queued behind local waiters without a node of
                // its own (the lock loop does not barge past them) watches nothing: wake one
                // so it tries. Without this, two tasks sharing a backend could each wait for
                // the other until their deadlines. Only such a waiter: one with a queued node
                // is woken by its own predecessor's watch (no local herd, issue 19).
                inner.wake_one_nodeless(key.prim, &key.name);
                return;
            }
            Err(e) => {
                if tries == 1 {
                    tracing::warn!(key = %key.name, error = %e, "dlock: deleting a ZooKeeper lock node failed; retrying until it is gone or its session ends");
                } else {
                    tracing::debug!(key = %key.name, error = %e, tries, "dlock: deleting a ZooKeeper lock node failed again");
                }
                let msg: Arc<str> = e.to_string().into();
                tx.send_modify(|st| {
                    st.tries = tries;
                    st.last_error = Some(msg);
                });
            }
        }
        drop(inner);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(REAP_RETRY_MAX);
    }
}

fn rw_prim(side: RwSide) -> Prim {
    match side {
        RwSide::Read => Prim::Read,
        RwSide::Write => Prim::Write,
    }
}

impl ZookeeperBackend {
    /// Gives back `key`'s hold, started at once on the driver thread, whatever runtime or
    /// thread calls: a caller's runtime shutting down (or the returned future being dropped)
    /// cannot cut the give-back off, and its retries (the reaper) run there too.
    fn release_on_driver<'a>(
        &'a self,
        key: HoldKey,
        keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        let inner = Arc::clone(&self.inner);
        let name = key.name.clone();
        let task = self
            .inner
            .driver
            .handle
            .spawn(async move { inner.release(key, keep_for, all).await });
        Box::pin(async move {
            task.await.unwrap_or_else(|e| {
                Err(be(
                    &name,
                    format!("the ZooKeeper backend's driver thread stopped: {e}"),
                ))
            })
        })
    }
}

impl Backend for ZookeeperBackend {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(self.inner.try_acquire(name, owner, ttl))
    }

    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        self.release_on_driver(HoldKey::new(Prim::Lock, name, owner), keep_for, all)
    }

    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        _ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(self.inner.extend(HoldKey::new(Prim::Lock, name, owner)))
    }

    /// Permits: one node per acquisition under `<lock dir>%sem` (see `zookeeper/prims.rs`),
    /// granted in arrival order while the permits of the nodes up to it fit in `max`. The
    /// session is the lease (`ttl` is not sent), as for the lock.
    fn try_acquire_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        max: u32,
        permits: u32,
        _ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(self.inner.try_node(
            HoldKey::new(Prim::Sem, name, owner),
            format!("{max}-{permits}-sem-"),
        ))
    }

    fn release_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        self.release_on_driver(HoldKey::new(Prim::Sem, name, owner), None, true)
    }

    fn extend_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        _ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(self.inner.extend(HoldKey::new(Prim::Sem, name, owner)))
    }

    fn watch_permits<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        let w = self.inner.sem_waiters.register(name);
        Box::pin(async move { Ok(w) })
    }

    fn has_permit_waiters(&self, name: &str) -> bool {
        self.inner.sem_waiters.has_waiters(name)
    }

    fn supports_rw(&self) -> bool {
        true
    }

    /// Read and write nodes under `<lock dir>%rw` (see `zookeeper/prims.rs`).
    fn rw_try_acquire<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        _ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        let (prim, tag) = match side {
            RwSide::Read => (Prim::Read, "read-"),
            RwSide::Write => (Prim::Write, "write-"),
        };
        Box::pin(
            self.inner
                .try_node(HoldKey::new(prim, name, owner), tag.to_string()),
        )
    }

    fn rw_release<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        self.release_on_driver(HoldKey::new(rw_prim(side), name, owner), None, all)
    }

    fn rw_extend<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        _ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(self.inner.extend(HoldKey::new(rw_prim(side), name, owner)))
    }

    fn rw_downgrade<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        _ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<u64>, LockError>> {
        Box::pin(self.inner.rw_downgrade(name, owner))
    }

    fn rw_watch<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        let w = self.inner.queue(rw_prim(side)).register(name);
        Box::pin(async move { Ok(w) })
    }

    fn rw_has_waiters(&self, side: RwSide, name: &str) -> bool {
        self.inner.queue(rw_prim(side)).has_waiters(name)
    }

    /// The record is a persistent node beside the lock's directory (`<lock dir>%leader`).
    fn put_record<'a>(
        &'a self,
        name: &'a str,
        epoch: u64,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(self.inner.put_record(name, epoch, value))
    }

    fn get_record<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<Record>, LockError>> {
        Box::pin(self.inner.get_record(name))
    }

    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        let w = self.inner.waiters.register(name);
        Box::pin(async move { Ok(w) })
    }

    fn has_waiters(&self, name: &str) -> bool {
        self.inner.waiters.has_waiters(name)
    }

    fn queues_contenders(&self) -> bool {
        true
    }

    /// The session (ZooKeeper) or the shared lease (etcd) keeps a node or key alive, not the
    /// hold's ttl.
    fn lease_expires_by_ttl(&self) -> bool {
        false
    }

    /// The session is the lease: the guard counts on at most the session lease (`session_lease`) from the send
    /// time of its last check confirmed through the leader (a renewal's `sync`, a grant's
    /// `multi`), so a holder cut off from the ensemble, or on a follower cut off from the
    /// leader, counts itself lost by the time the leader may expire its session.
    fn lease_margin(&self, ttl: Duration) -> Duration {
        let timeout = self.inner.session().timeout;
        ttl.saturating_sub(session_lease(timeout, self.inner.cfg.request_timeout))
    }

    fn lost_signal(&self, name: &str, owner: &str) -> Option<BoxFuture<'static, ()>> {
        // Owner ids are fresh per acquisition: the hold is found whatever its primitive (a
        // lock, permits, or a read or write hold).
        let held_by = self
            .inner
            .holds()
            .iter()
            .find(|(k, h)| k.name == name && k.owner == owner && h.held)
            .map(|(_, h)| h.session)?;
        let sess = self.inner.session();
        if sess.id != held_by {
            // Its session was already replaced: lost now.
            return Some(Box::pin(std::future::ready(())));
        }
        Some(Box::pin(sess.gone.clone().cancelled_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::session_lease;
    use std::time::Duration;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// The guard's lease is the session timeout less a quarter (the leader's ping period, at
    /// most) and 4 of the client's ticks (its longest gap between sends).
    #[test]
    fn the_session_lease_leaves_room_for_the_leaders_lag() {
        // 4 s session, 1 s request bound: client tick 125 ms.
        assert_eq!(session_lease(ms(4000), ms(1000)), ms(2500));
        // The defaults, 10 s and 5 s: client tick 625 ms.
        assert_eq!(session_lease(ms(10_000), ms(5000)), ms(5000));
        // A request bound above 3/5 of the session: client tick session / 20.
        assert_eq!(session_lease(ms(4000), ms(5000)), ms(2200));
        // The shortest lease: a request bound of exactly 3/5 of the session.
        assert_eq!(session_lease(ms(4000), ms(2400)), ms(1800));
        for (t, c) in [(2000, 1000), (4000, 1), (20_000, 5000), (40_000, 40_000)] {
            let l = session_lease(ms(t), ms(c));
            assert!(
                l >= ms(t) * 45 / 100 && l <= ms(t) * 3 / 4,
                "{t} {c}: {l:?}"
            );
        }
    }
}
