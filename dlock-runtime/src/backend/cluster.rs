//! The Redis Cluster backend (feature `cluster`): the single-node Lua scripts on the redis
//! crate's async cluster client, and waiting by sharded pub/sub (`SSUBSCRIBE` / `SPUBLISH`).
//!
//! See [`ClusterBackend`].

pub(crate) mod admin;
mod fair;
mod rw;
mod semaphore;

use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;
use tokio::time::Instant;

use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{ErrorKind, ProtocolVersion, PushInfo, PushKind, RedisError, Script, ServerErrorKind};
use tokio::sync::{mpsc, oneshot};

use super::redis::{
    QUEUE_LIFE, Queueing, Reaper, RefusalGate, STALL_AFTER, StallCtl, Stalls, on_release_message,
    redact_url, stall_pass_args, unconfirmed, wait_reply,
};
use super::{Acquired, Backend, BoxFuture, Extended, Released, RwSide, Watch};
use crate::LockError;
use crate::key::{self, redis_keys};
use crate::wait::WaitQueues;

/// Same grace as the single-node backend (see backend/redis.rs).
const FENCE_GRACE: Duration = Duration::from_secs(60);

const ACQUIRE_SRC: &str = include_str!("../scripts/acquire.lua");
const EXTEND_SRC: &str = include_str!("../scripts/extend.lua");
const RELEASE_SRC: &str = include_str!("../scripts/release.lua");
const WAKE_SRC: &str = include_str!("../scripts/wake.lua");
/// The single-node scripts publish with `PUBLISH`; here the same scripts publish with
/// `SPUBLISH`, so a release (and a queued try's `t`) reaches only the shard that owns the lock's
/// slot. Derived from the single-node text (one script to maintain; the single-node path is
/// untouched), and checked by a unit test so a change of those calls cannot silently turn them
/// back into a cluster-wide PUBLISH.
const PUBLISH_CALL: &str = "redis.pcall('PUBLISH', ";
const SPUBLISH_CALL: &str = "redis.pcall('SPUBLISH', ";

struct ClusterScript {
    src: String,
    sha: String,
}

impl ClusterScript {
    fn new(src: String) -> ClusterScript {
        let sha = Script::new(&src).get_hash().to_string();
        ClusterScript { src, sha }
    }
}

static ACQUIRE: LazyLock<ClusterScript> =
    LazyLock::new(|| ClusterScript::new(ACQUIRE_SRC.replace(PUBLISH_CALL, SPUBLISH_CALL)));
static EXTEND: LazyLock<ClusterScript> =
    LazyLock::new(|| ClusterScript::new(EXTEND_SRC.to_string()));
static RELEASE: LazyLock<ClusterScript> =
    LazyLock::new(|| ClusterScript::new(RELEASE_SRC.replace(PUBLISH_CALL, SPUBLISH_CALL)));
static RECORD: LazyLock<ClusterScript> =
    LazyLock::new(|| ClusterScript::new(include_str!("../scripts/record.lua").to_string()));
static RECORD_GET: LazyLock<ClusterScript> =
    LazyLock::new(|| ClusterScript::new(include_str!("../scripts/record_get.lua").to_string()));
static WAKE: LazyLock<ClusterScript> =
    LazyLock::new(|| ClusterScript::new(WAKE_SRC.replace(PUBLISH_CALL, SPUBLISH_CALL)));

/// Settings of a [`ClusterBackend`]; build one with [`ClusterBackend::builder`].
#[derive(Clone)]
pub struct ClusterBackendBuilder {
    urls: Vec<String>,
    response_timeout: Duration,
    op_timeout: Duration,
    connection_timeout: Duration,
    retries: u32,
    username: Option<String>,
    password: Option<String>,
    min_replicas: Option<(usize, Duration)>,
    #[cfg(feature = "tls")]
    tls_root_cert: Option<Vec<u8>>,
}

impl fmt::Debug for ClusterBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterBackendBuilder")
            .field(
                "urls",
                &self.urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>(),
            )
            .field("response_timeout", &self.response_timeout)
            .field("op_timeout", &self.op_timeout)
            .field("connection_timeout", &self.connection_timeout)
            .field("retries", &self.retries)
            .field("username", &self.username)
            .field("min_replicas", &self.min_replicas)
            .finish_non_exhaustive()
    }
}

impl ClusterBackendBuilder {
    /// After every grant, `WAIT replicas timeout` on the master that owns the lock's slot, sent
    /// in one pipeline with the acquire script so that it runs on the connection that wrote the
    /// grant: fewer confirmations give the lock back and fail the acquire with a
    /// [`LockError::Backend`]. This narrows the failover window (a replica promoted after a
    /// confirmed grant has it); it does not close it. It confirms grants only: renewals are not
    /// WAITed, so a failover right after a renewal that had not reached the replica leaves the
    /// new master with the lease of the renewal before, up to ttl/3 shorter than the holder's
    /// deadline. The WAIT holds that master's shared data connection for up to `timeout`, and
    /// every call queued behind it waits too; keep `timeout` well below `response_timeout`
    /// (default 1 s): a reply later than that fails the call with an unknown outcome (the call is
    /// not sent again). While a replica lags, a `Busy` answer also waits for the WAIT.
    pub fn min_replicas(mut self, replicas: usize, timeout: Duration) -> Self {
        self.min_replicas = (replicas > 0).then_some((replicas, timeout));
        self
    }

    /// How long one node may take to answer one request (default 1 s).
    pub fn response_timeout(mut self, t: Duration) -> Self {
        self.response_timeout = t;
        self
    }

    /// How long one call may take in all, redirections (MOVED/ASK), `TRYAGAIN` retries during a
    /// resharding and reconnections included, before it fails with a backend error
    /// (default 3 s).
    pub fn op_timeout(mut self, t: Duration) -> Self {
        self.op_timeout = t;
        self
    }

    /// How long one connection attempt to one node may take (default 1 s).
    pub fn connection_timeout(mut self, t: Duration) -> Self {
        self.connection_timeout = t;
        self
    }

    /// How many times a call is sent again after an answer that guarantees it did not run
    /// (`MOVED`, `ASK`, `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `LOADING`, `READONLY`, or no
    /// connection to the slot's node), with backoff, within `op_timeout` (default 16). A call
    /// whose outcome is unknown (a timeout, a connection lost after the request was written) is
    /// never sent again: the scripts are not idempotent.
    pub fn retries(mut self, n: u32) -> Self {
        self.retries = n;
        self
    }

    /// ACL user name for every node (instead of one in the URLs).
    pub fn username(mut self, user: impl Into<String>) -> Self {
        self.username = Some(user.into());
        self
    }

    /// Password for every node (instead of one in the URLs). Never logged.
    pub fn password(mut self, password: impl Into<String>) -> Self {
        self.password = Some(password.into());
        self
    }

    /// Trusts `pem` as the root certificate for `rediss://` nodes instead of the system store.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls_root_cert(mut self, pem: Vec<u8>) -> Self {
        self.tls_root_cert = Some(pem);
        self
    }

    /// A client; `retries` is the redis crate's own re-send budget (0 for the data client: it
    /// would re-send a script after a dropped connection or a timeout, see `run_script`).
    fn client(&self, protocol: ProtocolVersion, retries: u32) -> Result<ClusterClient, LockError> {
        let mut b = ClusterClientBuilder::new(self.urls.iter().map(String::as_str))
            .response_timeout(self.response_timeout)
            .overall_response_timeout(Some(self.op_timeout))
            .connection_timeout(self.connection_timeout)
            .retries(retries)
            .min_retry_wait(10)
            .max_retry_wait(200)
            .use_protocol(protocol);
        if let Some(u) = &self.username {
            b = b.username(u);
        }
        if let Some(p) = &self.password {
            b = b.password(p);
        }
        // Only for `rediss://` seeds: redis-rs turns TLS on for every node once certificates
        // are given, and the CA is documented (as on one node) to apply to `rediss://` only.
        #[cfg(feature = "tls")]
        if let Some(pem) = &self.tls_root_cert
            && self.urls.iter().any(|u| u.starts_with("rediss://"))
        {
            b = b.certs(redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem.clone()),
            });
        }
        b.build().map_err(|e| {
            LockError::Config(format!(
                "invalid Redis Cluster seed URLs {:?}: {}",
                self.urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>(),
                e.detail().unwrap_or("cannot parse them")
            ))
        })
    }

    /// Checks the URLs and connects (one `PING` routed to a node), so that a wrong address or
    /// password fails here.
    pub async fn connect(self) -> Result<ClusterBackend, LockError> {
        let backend = self.build()?;
        backend.ping().await?;
        Ok(backend)
    }

    /// Checks the URLs without connecting; connections are made on first use.
    pub fn build(self) -> Result<ClusterBackend, LockError> {
        if self.urls.is_empty() {
            return Err(LockError::Config(
                "a Redis Cluster backend needs at least one seed URL".into(),
            ));
        }
        #[cfg(feature = "tls")]
        if self.urls.iter().any(|u| u.starts_with("rediss://")) {
            super::ensure_crypto_provider();
        }
        let data_client = self.client(ProtocolVersion::RESP2, 0)?;
        let pubsub_client = self.client(ProtocolVersion::RESP3, self.retries)?;
        let label = self
            .urls
            .iter()
            .map(|u| redact_url(u))
            .collect::<Vec<_>>()
            .join(",");
        Ok(ClusterBackend {
            inner: Arc::new(Inner {
                data_client,
                pubsub_client,
                label,
                conns: Mutex::new(Vec::new()),
                refusal: RefusalGate::default(),
                min_replicas: self.min_replicas,
                response_timeout: self.response_timeout,
                op_timeout: self.op_timeout,
                retries: self.retries,
                reaper: Arc::default(),
                fair: Default::default(),
                registration: Default::default(),
            }),
        })
    }
}

/// Locks in a Redis Cluster (feature `cluster`).
///
/// Cheap to clone. A lock's hash, fence key and release channel share one hash slot (the
/// `{escaped name}` tag, see [`crate::backend::redis_keys`]), so every script runs on the one master that
/// owns the slot; the redis crate's cluster client follows `MOVED` / `ASK` redirections and
/// topology changes, and retries `TRYAGAIN` while a slot is being migrated. The scripts are the
/// single-node ones, run by `EVALSHA`; a node that does not know one yet (a new master, an
/// importing node, a restart) answers `NOSCRIPT` and gets the script by `EVAL` on the same slot.
///
/// # Waiting
///
/// By sharded pub/sub (Redis 7): the release script `SPUBLISH`es on the lock's channel, which
/// reaches only the shard owning the slot, and waiters `SSUBSCRIBE` through one RESP3 cluster
/// connection per runtime. Waiting processes queue on the server as with one server (see
/// "Waiting" on [`crate::RedisBackend`]; the queue `dlock:{E}:q` is in the lock's slot), so a
/// release wakes one process. After a lost pub/sub connection every waiter is woken; a channel on
/// it, or one the server dropped (its slot moved away), is subscribed again (at its slot's owner,
/// with back-off until confirmed) and its waiters are woken again then, so a release published
/// while nobody listened is not slept through. Where the servers refuse it (Redis 6, an ACL user
/// without `&dlock:*`), waiting falls back to the holder's remaining lease as a timer, and
/// `SSUBSCRIBE` is asked again after a back-off (1 s doubling to 60 s).
///
/// As with [`crate::RedisBackend`], connections are kept per tokio runtime.
#[derive(Clone)]
pub struct ClusterBackend {
    inner: Arc<Inner>,
}

struct Inner {
    data_client: ClusterClient,
    pubsub_client: ClusterClient,
    label: String,
    conns: Mutex<Vec<RtConn>>,
    /// Set while the cluster refuses SSUBSCRIBE (see [`Refusal`]): the fast check in `watch`.
    refusal: RefusalGate,
    min_replicas: Option<(usize, Duration)>,
    response_timeout: Duration,
    op_timeout: Duration,
    retries: u32,
    /// Releases being retried in the background (see [`Reaper`]).
    reaper: Arc<Reaper>,
    /// Owners of fair tries: their releases also leave the fair queue (see `redis/fair.rs`).
    fair: super::redis::fair::FairOwners,
    /// When this process's holder identity is written next (see `redis::write_holder`).
    registration: crate::holder::Registration,
}

impl fmt::Debug for ClusterBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterBackend")
            .field("seeds", &self.inner.label)
            .finish_non_exhaustive()
    }
}

/// A refused SSUBSCRIBE (Redis 6, an ACL user without channel permission) backs off as on one
/// server ([`RefusalGate`]): 1 s doubling to 60 s, so an ACL fixed while the service runs is
/// picked up within a minute (review #8).
/// Back-off between attempts to subscribe a channel again after a lost connection.
const RESUBSCRIBE_BACKOFF_MIN: Duration = Duration::from_millis(50);
const RESUBSCRIBE_BACKOFF_MAX: Duration = Duration::from_secs(2);

struct RtConn {
    runtime: tokio::runtime::Id,
    alive: oneshot::Receiver<()>,
    data: ClusterConnection,
    sub: Arc<Subscriber>,
}

struct Subscriber {
    queues: Arc<WaitQueues>,
    ctl: mpsc::UnboundedSender<Ctl>,
    /// This runtime's place in the waiters' queues (as on one server, see `redis.rs`).
    queueing: Arc<Queueing>,
}

enum Ctl {
    /// A release message's stall timer or pass-on (see `redis::on_release_message`).
    Stall(StallCtl),
    /// The channel's last local waiter left while this runtime may be queued for it, or with a
    /// wake-up it did not use (`true`: pass it on).
    Leave(String, bool),
    Subscribe(String, oneshot::Sender<Result<(), RedisError>>),
    Unsubscribe(String),
    /// The server dropped this shard channel (its slot moved, or its master became a replica).
    Dropped(String),
    /// A pub/sub connection to a node was lost: its channels are gone until subscribed again.
    Disconnected,
}

fn is_refusal(e: &RedisError) -> bool {
    matches!(e.kind(), ErrorKind::Server(ServerErrorKind::NoPerm))
        || e.kind() == ErrorKind::InvalidClientConfig
        || e.to_string()
            .to_ascii_lowercase()
            .contains("unknown command")
        || e.to_string().to_ascii_lowercase().contains("hello")
}

fn ms(d: Duration) -> u64 {
    (d.as_millis() as u64).max(1)
}

fn channel_of(info: &PushInfo) -> Option<&str> {
    match info.data.first() {
        Some(redis::Value::BulkString(ch)) => std::str::from_utf8(ch).ok(),
        _ => None,
    }
}

/// Whether an error guarantees that the call did not run: a redirection or a refusal by the
/// node (`MOVED`, `ASK`, `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `LOADING`, `READONLY`, the
/// latter from a replica that got a write), or no connection to send it on.
fn did_not_run(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::Moved
                | ServerErrorKind::Ask
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::BusyLoading
                | ServerErrorKind::ReadOnly
        ) | ErrorKind::ClusterConnectionNotFound
    )
}

/// The `host:port` of a `MOVED` / `ASK` error.
fn redirect_of(e: &RedisError) -> Option<(String, u16)> {
    let (addr, _slot) = e.redirect_node()?;
    let (host, port) = addr.rsplit_once(':')?;
    Some((host.to_string(), port.parse().ok()?))
}

/// Runs `script` once on the master of `keys[0]`'s slot (EVALSHA; on NOSCRIPT, EVAL there,
/// which also caches it) and, with `wait`, `WAIT replicas timeout` in the same pipeline, so on
/// the same connection, right behind it. Returns the script's reply and WAIT's.
///
/// The redis crate's cluster client would re-send a request after a dropped connection or a
/// timeout, so that a script that already ran runs twice (an inner guard's release would take
/// off two holds and free the outer holder's lock: review redis-family #2). The data client is
/// therefore built with no retries, and this follows only the answers that guarantee the
/// script did not run (see [`did_not_run`]): `MOVED` and `ASK` to the node they name (`ASK`
/// with `ASKING` in the same pipeline), the others again by slot after a back-off, within
/// `op_timeout` and `retries`. Any other failure leaves the outcome unknown and is returned.
async fn run_script(
    inner: &Inner,
    con: &mut ClusterConnection,
    script: &ClusterScript,
    keys: &[&str],
    args: &[&[u8]],
    wait: Option<(usize, Duration)>,
) -> redis::RedisResult<(redis::Value, Option<redis::Value>)> {
    use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
    let slot = slot_of(keys[0]);
    let deadline = tokio::time::Instant::now() + inner.op_timeout;
    // None: the slot's master; Some((asking, host, port)): a node a redirection named.
    let mut target: Option<(bool, String, u16)> = None;
    let mut eval = false;
    let mut attempt = 0u32;
    let mut backoff = Duration::from_millis(10);
    loop {
        let mut pipe = redis::pipe();
        let asking = matches!(target, Some((true, ..)));
        if asking {
            pipe.cmd("ASKING");
        }
        let c = if eval {
            pipe.cmd("EVAL").arg(&script.src)
        } else {
            pipe.cmd("EVALSHA").arg(&script.sha)
        };
        c.arg(keys.len());
        for k in keys {
            c.arg(*k);
        }
        for a in args {
            c.arg(*a);
        }
        if let Some((n, t)) = wait {
            pipe.cmd("WAIT").arg(n).arg(t.as_millis() as u64);
        }
        let route = match &target {
            None => SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master)),
            Some((_, host, port)) => SingleNodeRoutingInfo::ByAddress {
                host: host.clone(),
                port: *port,
            },
        };
        let count = 1 + usize::from(wait.is_some());
        let err = match tokio::time::timeout_at(
            deadline,
            con.route_pipeline(pipe, usize::from(asking), count, route),
        )
        .await
        {
            Err(_) => {
                return Err(RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no reply within op_timeout",
                )));
            }
            Ok(Ok(values)) => {
                let mut values = values.into_iter();
                let first = values.next().unwrap_or(redis::Value::Nil);
                let second = values.next();
                match first {
                    redis::Value::ServerError(e) => {
                        let e = RedisError::from(e);
                        if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) && !eval {
                            eval = true;
                            continue;
                        }
                        e
                    }
                    first => return Ok((first, second)),
                }
            }
            Ok(Err(e)) => e,
        };
        if !did_not_run(&err) || attempt >= inner.retries {
            return Err(err);
        }
        attempt += 1;
        target = match err.kind() {
            ErrorKind::Server(ServerErrorKind::Moved) => {
                redirect_of(&err).map(|(h, p)| (false, h, p))
            }
            ErrorKind::Server(ServerErrorKind::Ask) => redirect_of(&err).map(|(h, p)| (true, h, p)),
            _ => None,
        };
        if target.is_none() {
            // The client refreshes its slot map and connections meanwhile.
            if tokio::time::Instant::now() + backoff >= deadline {
                return Err(err);
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(200));
        }
    }
}

impl ClusterBackend {
    /// Starts building a backend from seed node URLs (`redis://[user[:password]@]host:port`, or
    /// `rediss://` with the `tls` feature); any reachable seed is enough, the rest of the
    /// cluster is discovered.
    pub fn builder<I, S>(urls: I) -> ClusterBackendBuilder
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        ClusterBackendBuilder {
            urls: urls.into_iter().map(|u| u.as_ref().to_string()).collect(),
            response_timeout: Duration::from_secs(1),
            op_timeout: Duration::from_secs(3),
            connection_timeout: Duration::from_secs(1),
            retries: 16,
            username: None,
            password: None,
            min_replicas: None,
            #[cfg(feature = "tls")]
            tls_root_cert: None,
        }
    }

    /// Connects with default settings; see [`ClusterBackend::builder`].
    pub async fn connect<I, S>(urls: I) -> Result<Self, LockError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::builder(urls).connect().await
    }

    /// The seed URLs, passwords replaced by `***`.
    pub fn seeds(&self) -> &str {
        &self.inner.label
    }

    /// Checks the `WAIT` reply sent behind a grant (see `run_script`); with fewer than `n`
    /// confirmations, gives back what this acquisition added and fails.
    async fn confirm_replicas(
        &self,
        acked: Option<redis::Value>,
        name: &str,
        owner: &str,
        count: u32,
        n: usize,
        timeout: Duration,
    ) -> Result<(), LockError> {
        let Some(e) = unconfirmed(name, wait_reply(acked), (n, timeout), "grant") else {
            return Ok(());
        };
        // Give back what this call added (a fresh grant entirely, a re-entry one hold).
        let _ = self.release(name, owner, None, count <= 1).await;
        Err(e)
    }

    fn conn(&self, key: &str) -> Result<(ClusterConnection, Arc<Subscriber>), LockError> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| {
            LockError::Config(
                "dlock's Redis Cluster backend must be used inside a tokio runtime".into(),
            )
        })?;
        let id = handle.id();
        let mut conns = self.inner.conns.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = conns.iter().find(|c| c.runtime == id) {
            return Ok((c.data.clone(), c.sub.clone()));
        }
        conns.retain_mut(|c| {
            !matches!(
                c.alive.try_recv(),
                Err(oneshot::error::TryRecvError::Closed)
            )
        });
        let _enter = handle.enter();
        let data = self
            .inner
            .data_client
            .get_pending_async_connection_with_config(
                ClusterConfig::new().set_response_timeout(self.inner.response_timeout),
            );
        let sub = self.new_subscriber(&handle, key);
        let (tx, alive) = oneshot::channel::<()>();
        handle.spawn(async move {
            let _tx = tx;
            std::future::pending::<()>().await;
        });
        conns.push(RtConn {
            runtime: id,
            alive,
            data: data.clone(),
            sub: sub.clone(),
        });
        Ok((data, sub))
    }

    fn new_subscriber(&self, handle: &tokio::runtime::Handle, _key: &str) -> Arc<Subscriber> {
        let (ctl, mut rx) = mpsc::unbounded_channel::<Ctl>();
        let ctl_for_empty = ctl.clone();
        let queueing = Queueing::new();
        let q_for_empty = queueing.clone();
        let queues = WaitQueues::with_on_empty_woken(Box::new(move |channel: &str, woken| {
            // Leave the server's queue first, so that the unsubscription follows it.
            if q_for_empty.unmark(channel) || woken {
                let _ = ctl_for_empty.send(Ctl::Leave(channel.to_string(), woken));
            }
            let _ = ctl_for_empty.send(Ctl::Unsubscribe(channel.to_string()));
        }));
        let weak: Weak<WaitQueues> = Arc::downgrade(&queues);
        let ctl_for_push = ctl.clone();
        let queueing_for_push = queueing.clone();
        let push = move |info: PushInfo| -> Result<(), ()> {
            let Some(queues) = weak.upgrade() else {
                return Err(());
            };
            match info.kind {
                PushKind::SMessage | PushKind::Message => {
                    if let Some(ch) = channel_of(&info) {
                        let payload = match info.data.get(1) {
                            Some(redis::Value::BulkString(p)) => p.as_slice(),
                            _ => b"1",
                        };
                        on_release_message(&queues, &queueing_for_push, ch, payload, |c| {
                            let _ = ctl_for_push.send(Ctl::Stall(c));
                        });
                    }
                }
                PushKind::SUnsubscribe => {
                    if let Some(ch) = channel_of(&info) {
                        let _ = ctl_for_push.send(Ctl::Dropped(ch.to_string()));
                    }
                }
                PushKind::Disconnection => {
                    tracing::debug!(
                        "dlock: a cluster pub/sub connection was lost; waking every waiter"
                    );
                    queues.wake_all();
                    let _ = ctl_for_push.send(Ctl::Disconnected);
                }
                _ => {}
            }
            Ok(())
        };
        let _enter = handle.enter();
        let mut pubsub = self
            .inner
            .pubsub_client
            .get_pending_async_connection_with_config(ClusterConfig::new().set_push_sender(push));
        let queues_for_task = Arc::downgrade(&queues);
        let inner_for_task = Arc::downgrade(&self.inner);
        let queueing_for_task = queueing.clone();
        handle.spawn(async move {
            // Stall timers by channel (see `redis::STALL_AFTER`), and leaves to send.
            let mut stall = Stalls::default();
            let mut leaves: Vec<(String, bool)> = Vec::new();
            // Channels the server confirmed (and that we did not unsubscribe since).
            let mut subscribed: HashSet<String> = HashSet::new();
            // Wanted channels whose subscription may be gone (a lost connection, a channel the
            // server dropped, a SSUBSCRIBE that failed): subscribed again with back-off, and
            // once confirmed every waiter of the channel is woken, since a release published
            // meanwhile reached nobody (review #7; the single-node backend's `stale` set). The
            // redis crate resubscribes after a reconnection by itself too, but does not say when
            // it is done, nor retry one that failed.
            let mut stale: HashSet<String> = HashSet::new();
            let mut retry_at: Option<Instant> = None;
            let mut backoff = RESUBSCRIBE_BACKOFF_MIN;
            let mut batch = Vec::new();
            loop {
                tokio::select! {
                    n = rx.recv_many(&mut batch, 256) => {
                        if n == 0 {
                            return;
                        }
                    }
                    _ = async {
                        match [retry_at, stall.next()].into_iter().flatten().min() {
                            Some(t) => tokio::time::sleep_until(t).await,
                            None => std::future::pending().await,
                        }
                    } => {}
                }
                let mut acks = Vec::new();
                let mut new_channels: Vec<String> = Vec::new();
                let mut idle = Vec::new();
                for msg in batch.drain(..) {
                    match msg {
                        Ctl::Subscribe(ch, ack) => {
                            if !subscribed.contains(&ch) && !new_channels.contains(&ch) {
                                new_channels.push(ch);
                            }
                            acks.push(ack);
                        }
                        Ctl::Unsubscribe(ch) => idle.push(ch),
                        // A channel the server dropped while we still want it (our own
                        // SUNSUBSCRIBE removes it from `subscribed` first): subscribed again,
                        // routed to its slot's new owner.
                        Ctl::Dropped(ch) => {
                            if subscribed.contains(&ch) {
                                stale.insert(ch);
                                retry_at = Some(Instant::now());
                            }
                        }
                        Ctl::Disconnected => {
                            if !subscribed.is_empty() {
                                stale.extend(subscribed.iter().cloned());
                                retry_at = Some(Instant::now());
                            }
                        }
                        Ctl::Stall(StallCtl::Arm(ch, id)) => {
                            stall.arm(ch, id, Instant::now() + STALL_AFTER);
                        }
                        Ctl::Stall(StallCtl::Disarm(ch)) => {
                            stall.disarm(&ch);
                        }
                        Ctl::Stall(StallCtl::PassOn(ch)) => leaves.push((ch, true)),
                        Ctl::Leave(ch, pass) => leaves.push((ch, pass)),
                    }
                }
                let queues = queues_for_task.upgrade();
                // Stall timers that ran out: the process a release woke did not try; the turn
                // is passed on by the server (see `redis::STALL_AFTER`).
                for (ch, id) in stall.due(queues.as_deref()) {
                    let r = match (
                        stall_pass_args(&ch, &queueing_for_task.id, &id),
                        inner_for_task.upgrade(),
                    ) {
                        (Some([lock, queue, me, channel, mode, id, after]), Some(inner)) => {
                            run_script(
                                &inner,
                                &mut pubsub,
                                &WAKE,
                                &[&lock, &queue],
                                &[
                                    me.as_bytes(),
                                    channel.as_bytes(),
                                    mode.as_bytes(),
                                    id.as_bytes(),
                                    after.as_bytes(),
                                ],
                                None,
                            )
                            .await
                            .and_then(|(v, _)| Ok(redis::from_redis_value::<i64>(v)?))
                        }
                        _ => Err(RedisError::from((
                            redis::ErrorKind::Io,
                            "the backend is gone",
                        ))),
                    };
                    stall.after_pass(queues.as_deref(), ch, id, r);
                }
                // Leaves of the waiters' queue (the `wake` script), before any unsubscription.
                if !leaves.is_empty()
                    && let Some(inner) = inner_for_task.upgrade()
                {
                    for (ch, pass) in std::mem::take(&mut leaves) {
                        let Some(lock) = ch.strip_suffix(key::CHANNEL_SUFFIX) else {
                            continue;
                        };
                        let queue = key::suffixed(lock, key::QUEUE_SUFFIX);
                        let r = run_script(
                            &inner,
                            &mut pubsub,
                            &WAKE,
                            &[lock, &queue],
                            &[
                                queueing_for_task.id.as_bytes(),
                                ch.as_bytes(),
                                if pass { b"1" } else { b"0" },
                            ],
                            None,
                        )
                        .await;
                        if let Err(e) = r {
                            tracing::debug!(channel = %ch, error = %e, "dlock: leaving the waiters' queue failed; the entry expires by itself");
                        }
                    }
                }
                leaves.clear();
                let has_waiters = |ch: &str| queues.as_ref().is_some_and(|q| q.has_waiters(ch));
                // SSUBSCRIBE takes channels of one slot only: one command per channel.
                let mut result = Ok(());
                for ch in new_channels {
                    match pubsub.ssubscribe(&ch).await {
                        Ok(()) => {
                            stale.remove(&ch);
                            subscribed.insert(ch);
                        }
                        Err(e) => {
                            if !is_refusal(&e) {
                                // Not subscribed now: its waiters use the lease timer until it
                                // is, and are woken then.
                                stale.insert(ch);
                                retry_at.get_or_insert_with(|| Instant::now() + backoff);
                            }
                            result = Err(e);
                        }
                    }
                }
                for ack in acks {
                    let _ = ack.send(result.clone());
                }
                if retry_at.is_some_and(|t| Instant::now() >= t) {
                    retry_at = None;
                    let mut failed = false;
                    for ch in stale.iter().cloned().collect::<Vec<_>>() {
                        if !has_waiters(&ch) {
                            stale.remove(&ch);
                            continue;
                        }
                        match pubsub.ssubscribe(&ch).await {
                            Ok(()) => {
                                stale.remove(&ch);
                                subscribed.insert(ch.clone());
                                tracing::debug!(channel = %ch, "dlock: shard channel subscribed again; waking its waiters");
                                if let Some(q) = &queues {
                                    wake_all_of(q, &ch);
                                }
                            }
                            Err(e) => {
                                // The rest wait for the next pass: while a node is unreachable
                                // each attempt can take up to `op_timeout`, and new waiters'
                                // requests queue behind this pass.
                                tracing::debug!(channel = %ch, error = %e, "dlock: SSUBSCRIBE failed; retrying with back-off");
                                failed = true;
                                break;
                            }
                        }
                    }
                    if failed {
                        retry_at = Some(Instant::now() + backoff);
                        backoff = (backoff * 2).min(RESUBSCRIBE_BACKOFF_MAX);
                    } else {
                        backoff = RESUBSCRIBE_BACKOFF_MIN;
                    }
                }
                let idle: Vec<String> = idle
                    .into_iter()
                    .filter(|ch| !has_waiters(ch))
                    .filter(|ch| {
                        let was_stale = stale.remove(ch);
                        subscribed.remove(ch) || was_stale
                    })
                    .collect();
                for ch in idle {
                    let _ = pubsub.sunsubscribe(&ch).await;
                }
            }
        });
        Arc::new(Subscriber {
            queues,
            ctl,
            queueing,
        })
    }

    async fn ping(&self) -> Result<(), LockError> {
        let (mut con, _) = self.conn("")?;
        // PING is idempotent: sent again (the data client does not retry by itself) while the
        // shared connection is still being set up, within `op_timeout`.
        let deadline = tokio::time::Instant::now() + self.inner.op_timeout;
        let e = loop {
            match redis::cmd("PING").query_async::<String>(&mut con).await {
                Ok(_) => return Ok(()),
                Err(e) if tokio::time::Instant::now() + Duration::from_millis(50) < deadline => {
                    tracing::trace!(error = %e, "dlock: cluster PING failed; trying again");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => break e,
            }
        };
        // The shared connection connects in the background and keeps only "No connections
        // found" when no seed answers; one eager connection attempt tells why (a refused
        // certificate, a wrong password, a closed port). Bounded on its own too: it runs after
        // the failed ping, on the error path of `connect`.
        let attempt = tokio::time::timeout(
            Duration::from_secs(5),
            self.inner.data_client.get_async_connection(),
        );
        let cause = match attempt.await {
            Ok(Err(cause)) => format!(" ({cause})"),
            Ok(Ok(_)) | Err(_) => String::new(),
        };
        Err(LockError::Backend {
            key: String::new(),
            source: format!(
                "cannot reach the Redis Cluster at {}: {e}{cause}",
                self.inner.label
            )
            .into(),
        })
    }

    /// One owner-checked release, sent once (see `run_script`).
    async fn release_once(
        &self,
        name: &str,
        owner: &str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> Result<Released, LockError> {
        if self.inner.fair.contains(name, owner) {
            return self.fair_release_once(name, owner, keep_for, all).await;
        }
        let (mut con, sub) = self.conn(name)?;
        let keys = redis_keys(name);
        let keep = keep_for.filter(|d| !d.is_zero()).map(ms).unwrap_or(0);
        let all: &[u8] = if all { b"1" } else { b"0" };
        // The release wakes the queue's head, and queues this runtime behind the others when
        // waiters of its own remain (see "Waiting" on `RedisBackend`).
        let queue = key::suffixed(&keys.lock, key::QUEUE_SUFFIX);
        let me = self.queue_here(&sub, &keys.channel);
        let keep = keep.to_string();
        let life = ms(QUEUE_LIFE).to_string();
        let mut args: Vec<&[u8]> = vec![
            owner.as_bytes(),
            keep.as_bytes(),
            keys.channel.as_bytes(),
            all,
        ];
        if me {
            args.push(sub.queueing.id.as_bytes());
            args.push(life.as_bytes());
        }
        let (r, _) = run_script(
            &self.inner,
            &mut con,
            &RELEASE,
            &[&keys.lock, &queue],
            &args,
            None,
        )
        .await
        .map_err(|e| LockError::backend(name, e))?;
        let r: i64 = redis::from_redis_value(r).map_err(|e| LockError::backend(name, e))?;
        if r == 0 && me {
            sub.queueing.mark(&keys.channel);
        }
        Ok(crate::scripts::release_reply(r))
    }

    /// True when a call for `channel`'s name should queue this runtime on the server: it has
    /// waiters for the name and its subscriptions are not refused.
    fn queue_here(&self, sub: &Subscriber, channel: &str) -> bool {
        sub.queues.any_waiters() && !self.refused_now() && sub.queues.has_waiters(channel)
    }

    /// True while a refused SSUBSCRIBE is in its back-off (see [`RefusalGate`]).
    fn refused_now(&self) -> bool {
        self.inner.refusal.refused_now()
    }

    fn note_refusal(&self, e: &RedisError) {
        if self.inner.refusal.note_refusal() {
            tracing::warn!(
                seeds = %self.inner.label,
                error = %e,
                "dlock: the cluster refused SSUBSCRIBE (Redis 7 and, for an ACL user, `&dlock:*` are needed); waiters fall back to the holder's remaining lease, and SSUBSCRIBE is retried with back-off"
            );
        }
    }

    fn note_accepted(&self) {
        if self.inner.refusal.note_accepted() {
            tracing::info!(seeds = %self.inner.label, "dlock: the cluster accepts SSUBSCRIBE again; waiters are woken by releases");
        }
    }

    /// Number of callers of the current runtime waiting on this backend.
    pub fn waiter_count(&self) -> usize {
        self.conn("")
            .map(|(_, s)| s.queues.waiter_count())
            .unwrap_or(0)
    }
}

/// Wakes every waiter of `key` (bounded by the number of waiters now, so that waiters that
/// re-register meanwhile do not keep it going).
fn wake_all_of(queues: &WaitQueues, key: &str) {
    for _ in 0..queues.waiter_count() {
        if !queues.wake_one(key) {
            break;
        }
    }
}

/// The hash slot of a key, as Redis computes it: CRC16/XMODEM of its hash tag (the part between
/// the first `{` and the next `}`, when not empty) modulo 16384.
fn slot_of(key: &str) -> u16 {
    let b = key.as_bytes();
    let tagged = match b.iter().position(|&c| c == b'{') {
        Some(open) => match b[open + 1..].iter().position(|&c| c == b'}') {
            Some(len) if len > 0 => &b[open + 1..open + 1 + len],
            _ => b,
        },
        None => b,
    };
    crc16::State::<crc16::XMODEM>::calculate(tagged) % 16384
}

/// How long a call waits for its holder-identity write (`redis::write_holder`): the identity
/// key's slot may live on another master, which must not slow the call down by more than this
/// when it is slow or down (a write cut off is tried again 10 s later).
const HOLDER_WRITE_BOUND: Duration = Duration::from_millis(250);

/// [`super::redis::write_holder`] bounded by [`HOLDER_WRITE_BOUND`].
async fn write_holder_bounded(
    reg: &crate::holder::Registration,
    con: ClusterConnection,
    owner: &str,
) {
    let w = super::redis::write_holder(reg, con, owner);
    if tokio::time::timeout(HOLDER_WRITE_BOUND, w).await.is_err() {
        reg.failed();
    }
}

impl Backend for ClusterBackend {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(async move {
            let (mut con, sub) = self.conn(name)?;
            let keys = redis_keys(name);
            // A waiter's try queues its process on a busy answer (see `release_once`).
            let queued = self.queue_here(&sub, &keys.channel);
            let queue = key::suffixed(&keys.lock, key::QUEUE_SUFFIX);
            // The holder identity's key (`dlock:holder:<process>`) when due, in parallel with
            // the script (its slot may be on another master): no round trip added.
            let holder_write = self
                .inner
                .registration
                .due(owner)
                .then(|| write_holder_bounded(&self.inner.registration, con.clone(), owner));
            let (ttl_ms, fence_ms) = (ms(ttl).to_string(), ms(ttl + FENCE_GRACE).to_string());
            let mut args: Vec<&[u8]> =
                vec![owner.as_bytes(), ttl_ms.as_bytes(), fence_ms.as_bytes()];
            let mut script_keys: Vec<&str> = vec![&keys.lock, &keys.fence];
            if queued {
                script_keys.push(&queue);
                args.push(sub.queueing.id.as_bytes());
                args.push(keys.channel.as_bytes());
            }
            let call = run_script(
                &self.inner,
                &mut con,
                &ACQUIRE,
                &script_keys,
                &args,
                self.inner.min_replicas,
            );
            let r = match holder_write {
                Some(w) => tokio::join!(w, call).1,
                None => call.await,
            };
            let (r, acked) = r.map_err(|e| LockError::backend(name, e))?;
            let acquired = crate::scripts::acquire_reply(&r).ok_or_else(|| {
                LockError::backend(
                    name,
                    format!("unexpected reply from the acquire script: {r:?}"),
                )
            })?;
            if queued && matches!(acquired, Acquired::Busy { .. }) {
                sub.queueing.mark(&keys.channel);
            }
            if let (Acquired::Granted { count, .. }, Some((n, timeout))) =
                (acquired, self.inner.min_replicas)
            {
                self.confirm_replicas(acked, name, owner, count, n, timeout)
                    .await?;
            }
            Ok(acquired)
        })
    }

    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        Box::pin(async move {
            let r = self.release_once(name, owner, keep_for, all).await;
            if all && matches!(r, Err(LockError::Backend { .. })) {
                let me = self.clone();
                let (n, o) = (name.to_string(), owner.to_string());
                self.inner
                    .reaper
                    .retry(name, owner, self.inner.label.clone(), move || {
                        let (me, n, o) = (me.clone(), n.clone(), o.clone());
                        async move { me.release_once(&n, &o, keep_for, true).await }
                    });
            }
            r
        })
    }

    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(async move {
            let (mut con, _) = self.conn(name)?;
            let keys = redis_keys(name);
            let holder_write = self
                .inner
                .registration
                .due(owner)
                .then(|| write_holder_bounded(&self.inner.registration, con.clone(), owner));
            let ttl_ms = ms(ttl).to_string();
            let script_keys = [keys.lock.as_str()];
            let args = [owner.as_bytes(), ttl_ms.as_bytes()];
            let call = run_script(&self.inner, &mut con, &EXTEND, &script_keys, &args, None);
            let r = match holder_write {
                Some(w) => tokio::join!(w, call).1,
                None => call.await,
            };
            let (r, _) = r.map_err(|e| LockError::backend(name, e))?;
            let r: i64 = redis::from_redis_value(r).map_err(|e| LockError::backend(name, e))?;
            Ok(crate::scripts::extend_reply(r))
        })
    }

    /// Not with `min_replicas`: a fair grant is not followed by `WAIT` yet.
    fn supports_fair(&self) -> bool {
        self.inner.min_replicas.is_none()
    }

    fn try_acquire_fair<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
        heartbeat: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(self.fair_try_acquire(name, owner, ttl, heartbeat))
    }

    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(self.watch_channel(name, redis_keys(name).channel))
    }

    fn has_waiters(&self, name: &str) -> bool {
        match self.conn(name) {
            Ok((_, sub)) => sub.queues.has_waiters(&redis_keys(name).channel),
            Err(_) => false,
        }
    }

    // Semaphores: `cluster/semaphore.rs`.
    fn try_acquire_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        max: u32,
        permits: u32,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(self.sem_try_acquire(name, owner, max, permits, ttl))
    }

    fn release_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        Box::pin(self.sem_release(name, owner))
    }

    fn extend_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(self.sem_extend(name, owner, ttl))
    }

    fn watch_permits<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(self.sem_watch(name))
    }

    fn has_permit_waiters(&self, name: &str) -> bool {
        self.sem_has_waiters(name)
    }

    fn supports_rw(&self) -> bool {
        true
    }

    fn rw_try_acquire<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(self.rw_acquire(side, name, owner, ttl))
    }

    fn rw_release<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        Box::pin(self.rw_give_back(side, name, owner, all))
    }

    fn rw_extend<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(self.rw_renew(side, name, owner, ttl))
    }

    fn rw_downgrade<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<u64>, LockError>> {
        Box::pin(self.rw_to_read(name, owner, ttl))
    }

    fn rw_watch<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(self.watch_channel(name, rw::channel(name, side)))
    }

    fn rw_has_waiters(&self, side: RwSide, name: &str) -> bool {
        self.channel_has_waiters(name, &rw::channel(name, side))
    }

    fn put_record<'a>(
        &'a self,
        name: &'a str,
        epoch: u64,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let (mut con, _) = self.conn(name)?;
            let key = key::suffixed(&redis_keys(name).lock, key::RECORD_SUFFIX);
            let epoch = epoch.to_string();
            let args = [epoch.as_bytes(), value.as_bytes()];
            let (r, _) = run_script(&self.inner, &mut con, &RECORD, &[key.as_str()], &args, None)
                .await
                .map_err(|e| LockError::backend(name, e))?;
            let r: i64 = redis::from_redis_value(r).map_err(|e| LockError::backend(name, e))?;
            Ok(r == 1)
        })
    }

    fn get_record<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<crate::backend::Record>, LockError>> {
        Box::pin(async move {
            let (mut con, _) = self.conn(name)?;
            let key = key::suffixed(&redis_keys(name).lock, key::RECORD_SUFFIX);
            let (r, _) = run_script(
                &self.inner,
                &mut con,
                &RECORD_GET,
                &[key.as_str()],
                &[],
                None,
            )
            .await
            .map_err(|e| LockError::backend(name, e))?;
            let (epoch, value): (Option<u64>, Option<String>) =
                redis::from_redis_value(r).map_err(|e| LockError::backend(name, e))?;
            Ok(epoch.map(|epoch| crate::backend::Record {
                epoch,
                value: value.unwrap_or_default(),
            }))
        })
    }
}

impl ClusterBackend {
    /// True when this runtime has waiters on `channel` (a side of a read-write lock).
    fn channel_has_waiters(&self, name: &str, channel: &str) -> bool {
        match self.conn(name) {
            Ok((_, sub)) => sub.queues.has_waiters(channel),
            Err(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_the_redis_documentation() {
        assert_eq!(slot_of("somekey"), 11058);
        assert_eq!(slot_of("foo{hash_tag}"), 2515);
        assert_eq!(slot_of("{}x"), slot_of("{}x"));
        assert_eq!(
            slot_of("dlock:{order:42}"),
            slot_of("dlock:{order:42}:fence")
        );
    }

    #[test]
    fn scripts_publish_sharded() {
        for (what, src, script) in [
            ("release.lua", RELEASE_SRC, &*RELEASE),
            ("acquire.lua", ACQUIRE_SRC, &*ACQUIRE),
            ("wake.lua", WAKE_SRC, &*WAKE),
            ("rw.lua", rw::RW_SRC, &*rw::RW),
            ("fair_acquire.lua", fair::ACQUIRE_SRC, &*fair::ACQUIRE),
            ("fair_release.lua", fair::RELEASE_SRC, &*fair::RELEASE),
        ] {
            assert!(
                src.contains(PUBLISH_CALL),
                "{what} no longer has the PUBLISH call this backend rewrites to SPUBLISH"
            );
            assert!(script.src.contains(SPUBLISH_CALL));
            assert!(!script.src.contains(PUBLISH_CALL), "{what}");
            assert!(
                !script.src.contains("'PUBLISH'"),
                "{what} publishes in another form"
            );
            assert_ne!(script.sha, Script::new(src).get_hash());
        }
    }
}
