//! The Redis backend: one instance or a master, over `ConnectionManager`s, Lua scripts run by
//! EVALSHA (NOSCRIPT falls back to loading the script), and pub/sub wake-ups for waiters.
//!
//! See [`RedisBackend`] for how connections follow runtimes and how waiting works.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::{
    AsyncConnectionConfig, Client, Cmd, ErrorKind, Pipeline, ProtocolVersion, PushInfo, PushKind,
    RedisError, RedisFuture, Script, ServerErrorKind, Value,
};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::{Acquired, Backend, BoxFuture, Extended, Released, RwSide, Watch};

pub(crate) mod admin;
pub(crate) mod fair;
mod rw;
pub(crate) mod semaphore;
use crate::holder::Registration;
use crate::key::{self, redis_keys};
use crate::wait::WaitQueues;
use crate::{LockError, scripts};

/// How long a fence key outlives the last acquisition of its name, on top of the ttl. Tokens
/// stay increasing after it expires because they are at least the server time in µs; the fence
/// key only covers grants faster than one per µs and small backward steps of the server clock.
const FENCE_GRACE: Duration = Duration::from_secs(60);

/// Settings of a [`RedisBackend`]; build one with [`RedisBackend::builder`].
#[derive(Clone)]
pub struct RedisBackendBuilder {
    url: String,
    response_timeout: Duration,
    connection_timeout: Duration,
    reconnect_retries: usize,
    /// Extra trusted root certificate (PEM) for `rediss://`, instead of the system store.
    #[cfg(feature = "tls")]
    tls_root_cert: Option<Vec<u8>>,
}

impl fmt::Debug for RedisBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackendBuilder")
            .field("url", &redact_url(&self.url))
            .field("response_timeout", &self.response_timeout)
            .field("connection_timeout", &self.connection_timeout)
            .field("reconnect_retries", &self.reconnect_retries)
            .finish_non_exhaustive()
    }
}

impl RedisBackendBuilder {
    /// How long to wait for a reply before the call fails with a backend error (default 3 s).
    pub fn response_timeout(mut self, t: Duration) -> Self {
        self.response_timeout = t;
        self
    }

    /// How long one connection attempt may take (default 1 s).
    pub fn connection_timeout(mut self, t: Duration) -> Self {
        self.connection_timeout = t;
        self
    }

    /// How many times a lost connection is retried, with backoff from 50 ms to 500 ms, before a
    /// call fails; the next call starts a new attempt (default 2).
    pub fn reconnect_retries(mut self, n: usize) -> Self {
        self.reconnect_retries = n;
        self
    }

    /// Trusts `pem` (one or more PEM certificates, e.g. a private CA) as the root for `rediss://`
    /// connections instead of the system's trust store. Used by the data and pub/sub
    /// connections alike; ignored for `redis://`.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls_root_cert(mut self, pem: Vec<u8>) -> Self {
        self.tls_root_cert = Some(pem);
        self
    }

    /// Opens a redis-rs client for `info`, with the custom root certificate when one is set.
    fn open_client(&self, info: redis::ConnectionInfo) -> redis::RedisResult<Client> {
        #[cfg(feature = "tls")]
        if let Some(pem) = &self.tls_root_cert
            && self.url.starts_with("rediss://")
        {
            return Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem.clone()),
                },
            );
        }
        Client::open(info)
    }

    /// Checks the URL and connects, so that a wrong address or password fails here.
    pub async fn connect(self) -> Result<RedisBackend, LockError> {
        let backend = self.build()?;
        backend.ping().await?;
        backend.load_scripts().await;
        backend.check_eviction_policy().await;
        Ok(backend)
    }

    /// Checks the URL without connecting; connections are made on first use.
    pub fn build(self) -> Result<RedisBackend, LockError> {
        let redacted = redact_url(&self.url);
        // redis-rs builds its rustls config from the process-default provider and has none of
        // its own.
        #[cfg(feature = "tls")]
        if self.url.starts_with("rediss://") {
            super::ensure_crypto_provider();
        }
        let client = redis::IntoConnectionInfo::into_connection_info(self.url.as_str())
            .and_then(|info| self.open_client(info))
            .map_err(|e| {
                LockError::Config(format!(
                    "invalid Redis URL {redacted}: {}",
                    e.detail().unwrap_or("cannot parse it")
                ))
            })?;
        if self.url.starts_with("rediss://") && self.url.contains("#insecure") {
            tracing::warn!(
                url = %redacted,
                "dlock: `#insecure` on a rediss:// URL turns off certificate verification"
            );
        }
        let info = client.get_connection_info().clone();
        let resp3 = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let pubsub_client = self
            .open_client(info.set_redis_settings(resp3))
            .map_err(|e| {
                LockError::Config(format!(
                    "invalid Redis URL {redacted}: {}",
                    e.detail().unwrap_or("cannot parse it")
                ))
            })?;
        Ok(RedisBackend {
            inner: Arc::new(Inner {
                client,
                pubsub_client,
                url: redacted,
                config: self,
                conns: Mutex::new(Vec::new()),
                refusal: RefusalGate::default(),
                pins: Mutex::new(HashMap::new()),
                fair: fair::FairOwners::default(),
                reaper: Arc::default(),
                registration: Registration::default(),
            }),
        })
    }
}

/// Locks in one Redis server (or master), shared by every process that uses the same server.
///
/// Cheap to clone.
///
/// # Connections and runtimes
///
/// A redis-rs connection drives its socket from a task on the tokio runtime that created it, and
/// dies with that runtime. A backend registered once in a process-global registry must keep
/// working when that runtime is gone (one `#[tokio::test]` per runtime, a runtime per thread), so
/// the backend keeps one data connection and one pub/sub connection per live runtime, created on
/// first use in that runtime and forgotten when the runtime shuts down. In the usual service, one
/// runtime, that is one multiplexed data connection and one pub/sub connection per backend.
///
/// # Waiting
///
/// Waiters of one runtime share its pub/sub connection (RESP3 push messages). The first waiter
/// for a lock subscribes to its release channel, and `watch` returns only once the server has
/// confirmed that subscription; the release script publishes once; the message wakes one waiter
/// of the queue.
///
/// Across processes, a release wakes one process, not every subscribed one: a process with
/// waiters for a name queues on the server (the zset `dlock:{E}:q`, an entry per process with an
/// expiry in server time) with each busy try, and with its release when waiters of its own remain.
/// The release pops the oldest entry still live and publishes that process's id, and only that
/// process wakes a waiter; it also records that turn in the queue (`~<id>`, scored by the server's
/// time of the wake-up, negated so that it sorts first). The others arm a stall timer (`STALL_AFTER`, 100 ms) that the woken process's next try
/// stops (each queued try publishes `t`). A timer that runs out asks the server to pass the turn
/// on (the `wake` script): if the name is still free and the turn is still that process's, woken
/// at least `STALL_AFTER` ago by the server's clock, the next live entry is woken instead, once,
/// whichever process asked first. So a woken process that is stopped or dead costs one stall of
/// about 100 ms, and the lock goes to the next process in line, not to one waiter per process.
/// With nobody queued (or only stale entries) the release publishes to every process, as before.
/// A process whose last waiter leaves removes its entry, and passes on a wake-up it got but
/// cannot use (the `wake` script).
///
/// A lost pub/sub connection (closed, or silent past a `PING` every second while
/// anyone waits) is replaced and every waited-for channel subscribed again with back-off; every
/// waiter is woken when the loss is seen and again once its channel is confirmed, so that none
/// sleeps through a release published while nobody listened. When the server refuses pub/sub
/// (an ACL user without `&dlock:*`, a server without RESP3), waiting falls back to the holder's
/// remaining lease as a timer, with one `warn` event, and SUBSCRIBE is asked again after a
/// back-off (1 s doubling to 60 s).
///
/// A data call whose reply times out replaces the runtime's data connection (see `DataConn`):
/// a connection that died silently recovers at the next call, not when the kernel gives up.
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    pubsub_client: Client,
    url: String,
    config: RedisBackendBuilder,
    conns: Mutex<Vec<RtConn>>,
    /// Set while the server refuses SUBSCRIBE (see [`Refusal`]): the fast check in `watch`.
    refusal: RefusalGate,
    /// Acquire calls whose reply was not read (see [`Pin`]), by (lock name, owner).
    pins: Mutex<HashMap<(String, String), Vec<Pin>>>,
    /// Releases being retried in the background (see [`Reaper`]).
    reaper: Arc<Reaper>,
    /// Owners of fair tries (see `redis/fair.rs`): their releases also leave the fair queue.
    fair: fair::FairOwners,
    /// When this process's holder identity is written next (see [`write_holder`]).
    registration: Registration,
}

/// How long a release that failed is retried in the background (see [`Reaper`]): as long as
/// the core's give-back of a lease (its ttl, at most 30 s).
const REAP_FOR: Duration = Duration::from_secs(30);

/// Retries releases of every hold that failed for want of an answer (a timeout, a lost
/// connection) in the background, with back-off (50 ms doubling to 1 s), until the server
/// answers, for up to [`REAP_FOR`]: the hold is not left to its ttl because one call failed
/// (protocol rule 3; owner-checked and idempotent, so a retry after a release that did run finds
/// nothing). One retrying task per (name, owner). Shared by the Redis and Redis Cluster
/// backends; a Redlock node is a Redis backend, so a node that missed a release retries it too.
#[derive(Debug, Default)]
pub(crate) struct Reaper {
    reaping: Mutex<HashSet<(String, String)>>,
}

impl Reaper {
    /// Retries `release` for `(name, owner)` unless it is already being retried; `target` names
    /// the server(s) in the log line of a release never confirmed.
    pub(crate) fn retry<F, Fut>(
        self: &Arc<Self>,
        name: &str,
        owner: &str,
        target: String,
        release: F,
    ) where
        F: Fn() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<Released, LockError>> + Send,
    {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let key = (name.to_string(), owner.to_string());
        let fresh = self
            .reaping
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.clone());
        if !fresh {
            return;
        }
        let me = self.clone();
        rt.spawn(async move {
            let end = Instant::now() + REAP_FOR;
            let mut backoff = Duration::from_millis(50);
            let mut done = false;
            while Instant::now() + backoff < end {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                if release().await.is_ok() {
                    done = true;
                    break;
                }
            }
            if !done {
                tracing::debug!(key = %key.0, target = %target, "dlock: a release was not confirmed; the lease runs out by itself");
            }
            me.reaping
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&key);
        });
    }
}

/// The connection an acquire call went on when its reply was not read (a response timeout, a
/// dropped connection, a dropped future): the call may still run on the server, late (a
/// request held in TCP retransmission during a partition is delivered after the heal). Every
/// release of that owner on that name is sent on this same connection, behind the call, so it
/// takes effect after it whatever the transport does; the connection is kept open for that
/// (a response timeout replaces the runtime's data connection for new calls, not this one).
///
/// A release answered on the connection settles every call pinned to it (a connection
/// delivers and answers in order) and removes the pin. A connection that reports an error is
/// reconnected by its manager: the calls on the broken socket can no longer arrive, and the
/// release then goes on the new socket. A pin nothing settles (a connection that died
/// silently, no release ever sent) is dropped after [`PIN_FORGET_AFTER`], by when TCP has
/// given up retransmitting on it.
struct Pin {
    con: ConnectionManager,
    runtime: tokio::runtime::Id,
    generation: u64,
    since: Instant,
}

/// How long an unsettled [`Pin`] is kept: past Linux's default TCP retransmission give-up
/// (`tcp_retries2` = 15, about 15 minutes), after which its call can no longer arrive.
const PIN_FORGET_AFTER: Duration = Duration::from_secs(30 * 60);

/// Back-off state of a refused SUBSCRIBE (an ACL without channel permission, a server without
/// RESP3). Until `until`, waiters use the holder's lease as their timer without asking; then the
/// next waiter asks again, and a new refusal doubles the back-off (1 s up to 60 s). An ACL fixed
/// while the service runs is therefore picked up within a minute, without a restart.
#[derive(Default)]
struct Refusal {
    until: Option<Instant>,
    backoff: Duration,
}

const REFUSAL_BACKOFF_MIN: Duration = Duration::from_secs(1);
const REFUSAL_BACKOFF_MAX: Duration = Duration::from_secs(60);

/// The refusal back-off of one backend's subscriptions ([`Refusal`]), shared by the single-node
/// and the cluster backends (SUBSCRIBE and SSUBSCRIBE).
#[derive(Default)]
pub(crate) struct RefusalGate {
    refusing: AtomicBool,
    refusal: Mutex<Refusal>,
}

impl RefusalGate {
    /// True while a refusal is in its back-off: waiters do not ask now.
    pub(crate) fn refused_now(&self) -> bool {
        if !self.refusing.load(Ordering::Relaxed) {
            return false;
        }
        let r = self.refusal.lock().unwrap_or_else(|e| e.into_inner());
        r.until.is_some_and(|t| Instant::now() < t)
    }

    /// Records a refusal and doubles the back-off; true for the first one (to be logged).
    pub(crate) fn note_refusal(&self) -> bool {
        let mut r = self.refusal.lock().unwrap_or_else(|e| e.into_inner());
        let first = r.until.is_none();
        r.backoff = if first {
            REFUSAL_BACKOFF_MIN
        } else {
            (r.backoff * 2).min(REFUSAL_BACKOFF_MAX)
        };
        r.until = Some(Instant::now() + r.backoff);
        self.refusing.store(true, Ordering::Relaxed);
        first
    }

    /// Records an accepted subscription; true when it ends a refusal (to be logged).
    pub(crate) fn note_accepted(&self) -> bool {
        if !self.refusing.swap(false, Ordering::Relaxed) {
            return false;
        }
        *self.refusal.lock().unwrap_or_else(|e| e.into_inner()) = Refusal::default();
        true
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("url", &self.inner.url)
            .finish_non_exhaustive()
    }
}

struct RtConn {
    runtime: tokio::runtime::Id,
    /// Closed when the runtime is gone (its sentinel task was dropped).
    alive: oneshot::Receiver<()>,
    data: ConnectionManager,
    /// Bumped when `data` is replaced after a response timeout.
    data_gen: u64,
    sub: Arc<Subscriber>,
}

/// The data connection handed to one call: the runtime's `ConnectionManager`, and what is
/// needed to replace it when a reply times out.
///
/// `ConnectionManager` reconnects when the socket reports an error, not when a reply is late: a
/// connection that died silently (a partition that outlived the TCP session, a NAT entry that
/// expired, a server host that vanished) would time out every call until the kernel gives up on
/// it, many minutes later. After a response timeout the stream's state is unknown anyway (the
/// request may never have reached the server), so the runtime's manager is replaced by a new
/// one: the next call connects afresh. Calls still in flight on the old one finish or time out
/// on their own.
struct DataConn<'a> {
    con: ConnectionManager,
    generation: u64,
    runtime: tokio::runtime::Id,
    backend: &'a RedisBackend,
    /// Set by an acquire: a timeout does not replace the connection here; the acquire pins
    /// its call to the connection first (see [`Pin`]) and then replaces it.
    defer_replace: bool,
}

impl DataConn<'_> {
    fn after<T>(&self, r: &redis::RedisResult<T>) {
        if !self.defer_replace
            && let Err(e) = r
            && e.is_timeout()
        {
            self.backend.replace_data(self.runtime, self.generation);
        }
    }
}

/// Armed while an acquire call's reply is unread: dropped armed (an error, or the call's
/// future dropped), it pins the call to its connection (see [`Pin`]).
struct PinOnDrop<'a> {
    backend: &'a RedisBackend,
    name: &'a str,
    owner: &'a str,
    con: Option<(ConnectionManager, tokio::runtime::Id, u64)>,
}

impl Drop for PinOnDrop<'_> {
    fn drop(&mut self) {
        let Some((con, runtime, generation)) = self.con.take() else {
            return;
        };
        let now = Instant::now();
        let mut pins = self
            .backend
            .inner
            .pins
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        pins.retain(|_, v| {
            v.retain(|p| now.duration_since(p.since) < PIN_FORGET_AFTER);
            !v.is_empty()
        });
        let v = pins
            .entry((self.name.to_string(), self.owner.to_string()))
            .or_default();
        if let Some(p) = v
            .iter_mut()
            .find(|p| p.runtime == runtime && p.generation == generation)
        {
            p.since = now;
        } else {
            v.push(Pin {
                con,
                runtime,
                generation,
                since: now,
            });
        }
    }
}

impl ConnectionLike for DataConn<'_> {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let r = self.con.req_packed_command(cmd).await;
            self.after(&r);
            r
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let r = self.con.req_packed_commands(pipeline, offset, count).await;
            self.after(&r);
            r
        })
    }

    fn get_db(&self) -> i64 {
        self.con.get_db()
    }
}

/// The pub/sub side of one runtime: its wait queues and the task that (un)subscribes.
struct Subscriber {
    queues: Arc<WaitQueues>,
    ctl: mpsc::UnboundedSender<Ctl>,
    /// This runtime's place in the servers' waiters' queues.
    queueing: Arc<Queueing>,
}

/// How long a process that heard a release wake another process waits for that process's try
/// (its `t`) before it asks the server to pass the turn on (the `wake` script, mode `s`): the
/// woken process may be stopped, dead or slow. The server passes it only when the turn is at
/// least this old by its own clock. A woken process slower than this loses its turn (its late
/// try still takes the lock if it is free, or queues it again at the back): one extra wake-up,
/// never a herd. The Redis family's wake-up bound for a stopped queue head (issue 19).
pub(crate) const STALL_AFTER: Duration = Duration::from_millis(100);
/// How long the entry a release queues for the releasing process's own waiters lives (their
/// next busy try renews it).
pub(crate) const QUEUE_LIFE: Duration = Duration::from_secs(30);

/// One runtime's identity in the waiters' queues (`dlock:{E}:q`) and the names it may be queued
/// for (by channel).
pub(crate) struct Queueing {
    /// The id this runtime queues under, and that a release publishes to wake it (`w<id>`).
    pub(crate) id: String,
    /// Channels whose queue may hold an entry of this runtime (a busy try or a release queued
    /// it; a release that woke it popped it).
    queued: Mutex<HashSet<String>>,
}

impl Queueing {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Queueing {
            id: crate::context::new_owner().to_string(),
            queued: Mutex::new(HashSet::new()),
        })
    }

    pub(crate) fn mark(&self, channel: &str) {
        let mut q = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        if !q.contains(channel) {
            q.insert(channel.to_string());
        }
    }

    /// Forgets `channel`; true when it was marked.
    pub(crate) fn unmark(&self, channel: &str) -> bool {
        self.queued
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(channel)
    }
}

/// What a release message on a channel means to this runtime (its payload, see release.lua).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Heard {
    /// `1` (or an unknown payload): every process wakes one waiter.
    All,
    /// `w<our id>`: this process is the one woken.
    Us,
    /// `w<another id>`: another process is woken; arm the stall timer.
    Other,
    /// `t`: a queued process tried after the last release; stop the stall timer.
    Tried,
    /// `p<k>`: a semaphore release gave back `k` permits; every process wakes `k` waiters.
    Permits(u32),
}

/// Sorts a release message's payload (see [`Heard`]).
pub(crate) fn heard(payload: &[u8], id: &str) -> Heard {
    match payload {
        b"t" => Heard::Tried,
        [b'p', k @ ..] if !k.is_empty() => std::str::from_utf8(k)
            .ok()
            .and_then(|k| k.parse().ok())
            .map_or(Heard::All, Heard::Permits),
        [b'w', rest @ ..] if rest == id.as_bytes() => Heard::Us,
        [b'w', _, ..] => Heard::Other,
        _ => Heard::All,
    }
}

/// The push-message side of [`Heard`], shared by the single-node and cluster subscribers: wakes
/// the local waiter a message is for, and tells the subscriber task what to do about stall
/// timers and passing on (`ctl` gets `Stall(channel, armed)` / `Leave(channel, true)`).
pub(crate) fn on_release_message(
    queues: &WaitQueues,
    queueing: &Queueing,
    channel: &str,
    payload: &[u8],
    mut ctl: impl FnMut(StallCtl),
) {
    // A read-write lock's wake-ups (rw.lua): `a` wakes every waiting reader here, `o<owner>`
    // the waiting writer with that owner id (or the first writer here, see `wake_owner`).
    match payload {
        b"a" => {
            while queues.wake_one(channel) {}
            return;
        }
        [b'o', owner @ ..] if channel.ends_with(key::RW_WRITERS_SUFFIX) => {
            queues.wake_owner(channel, &String::from_utf8_lossy(owner));
            return;
        }
        // A fair lock's turn (fair_release.lua, fair_acquire.lua): only the waiter with that
        // owner id, if it waits here; else a waiter that named no owner (a Sentinel backend's
        // proxy, which wakes a waiter of its own).
        [b'f', owner @ ..] if !owner.is_empty() => {
            let owner = String::from_utf8_lossy(owner);
            if !queues.wake_first_where(channel, |o| o == Some(owner.as_ref())) {
                queues.wake_first_where(channel, |o| o.is_none());
            }
            return;
        }
        _ => {}
    }
    match heard(payload, &queueing.id) {
        Heard::All => {
            queues.wake_one(channel);
            ctl(StallCtl::Disarm(channel.to_string()));
        }
        Heard::Us => {
            queueing.unmark(channel);
            if !queues.wake_one(channel) && !queues.has_waiters(channel) {
                // Nobody here waits any more: pass the turn on.
                ctl(StallCtl::PassOn(channel.to_string()));
            }
            ctl(StallCtl::Disarm(channel.to_string()));
        }
        Heard::Other => {
            if queues.has_waiters(channel) {
                let id = String::from_utf8_lossy(&payload[1..]).into_owned();
                ctl(StallCtl::Arm(channel.to_string(), id));
            }
        }
        Heard::Tried => ctl(StallCtl::Disarm(channel.to_string())),
        Heard::Permits(k) => {
            for _ in 0..k {
                if !queues.wake_one(channel) {
                    break;
                }
            }
        }
    }
}

/// What a release message asks of the subscriber task (see [`on_release_message`]).
#[derive(Debug)]
pub(crate) enum StallCtl {
    /// Another process (the id) was woken on the channel: wait for its try.
    Arm(String, String),
    Disarm(String),
    PassOn(String),
}

/// The stall timers of one subscriber (see [`STALL_AFTER`]), shared by the single-node and
/// cluster subscriber tasks: by channel, when the timer runs out and the id of the process whose
/// try it waits for.
#[derive(Default)]
pub(crate) struct Stalls {
    timers: HashMap<String, (Instant, String)>,
}

impl Stalls {
    /// Arms (or re-arms) `channel`'s timer for the turn of process `id`, running out at `at`.
    pub(crate) fn arm(&mut self, channel: String, id: String, at: Instant) {
        self.timers.insert(channel, (at, id));
    }

    pub(crate) fn disarm(&mut self, channel: &str) {
        self.timers.remove(channel);
    }

    /// When the next timer runs out.
    pub(crate) fn next(&self) -> Option<Instant> {
        self.timers.values().map(|(t, _)| *t).min()
    }

    /// Removes the timers that ran out and returns them as (channel, id), for the channels that
    /// still have waiters here.
    pub(crate) fn due(&mut self, queues: Option<&WaitQueues>) -> Vec<(String, String)> {
        let now = Instant::now();
        if !self.timers.values().any(|(t, _)| *t <= now) {
            return Vec::new();
        }
        let mut out = Vec::new();
        self.timers.retain(|ch, (t, id)| {
            if *t > now {
                return true;
            }
            if queues.is_some_and(|q| q.has_waiters(ch)) {
                out.push((ch.clone(), std::mem::take(id)));
            }
            false
        });
        out
    }

    /// Acts on the server's answer to a stall pass of `channel` (the `wake` script in mode `s`
    /// for process `id`'s turn): negative, the turn is that many ms too young (asked again then);
    /// 2 (no turn record: a release by an older version) or an error, a waiter here is woken,
    /// as before turns were recorded; 0 or 1, nothing (the turn was taken, passed on now, or by
    /// another process).
    pub(crate) fn after_pass(
        &mut self,
        queues: Option<&WaitQueues>,
        channel: String,
        id: String,
        r: Result<i64, RedisError>,
    ) {
        match r {
            Ok(n) if n < 0 => {
                let at = Instant::now() + Duration::from_millis(n.unsigned_abs().min(60_000));
                self.arm(channel, id, at);
            }
            Ok(0) | Ok(1) => {}
            Ok(_) | Err(_) => {
                if let Some(q) = queues {
                    tracing::debug!(channel = %channel, "dlock: the process a release woke did not try, and the turn could not be passed on; waking a waiter here");
                    q.wake_one_unless_pending(&channel);
                }
            }
        }
    }
}

/// The `wake` script's keys and arguments for a stall pass of `channel`'s turn of process `id`
/// (mode `s`): `[lock, queue]`, `[our id, channel, "s", id, STALL_AFTER in ms]`.
pub(crate) fn stall_pass_args(channel: &str, our_id: &str, id: &str) -> Option<[String; 7]> {
    let lock = channel.strip_suffix(key::CHANNEL_SUFFIX)?;
    Some([
        lock.to_string(),
        key::suffixed(lock, key::QUEUE_SUFFIX),
        our_id.to_string(),
        channel.to_string(),
        "s".to_string(),
        id.to_string(),
        ms(STALL_AFTER).to_string(),
    ])
}

enum Ctl {
    /// Answered once the channel is subscribed on a live connection (or with the error that
    /// prevented it).
    Subscribe(String, oneshot::Sender<Result<(), RedisError>>),
    /// The channel's last local waiter left.
    Unsubscribe(String),
    /// The pub/sub connection of this generation closed.
    Disconnected(u64),
    /// A release message's stall timer or pass-on (see [`on_release_message`]).
    Stall(StallCtl),
    /// The channel's last local waiter left while this runtime may be queued for it, or with a
    /// wake-up it did not use (`true`: pass it on).
    Leave(String, bool),
}

/// How often a pub/sub connection with subscriptions is checked with `PING`: one that died
/// silently (no close seen) is replaced within about this plus the response timeout.
const PUBSUB_CHECK_EVERY: Duration = Duration::from_secs(1);
/// Back-off between attempts to (re)subscribe after a lost connection or a failed SUBSCRIBE.
const RESUBSCRIBE_BACKOFF_MIN: Duration = Duration::from_millis(50);
const RESUBSCRIBE_BACKOFF_MAX: Duration = Duration::from_secs(2);

/// The task that owns a runtime's pub/sub connection.
///
/// It keeps the set of channels somebody waits on (`wanted`) subscribed on a live connection:
/// a lost connection (closed, or silent past a `PING`) is replaced and every wanted channel is
/// subscribed again, with back-off, until the server confirms. A request is answered `Ok` only
/// once its channel is confirmed; while it is not, requests are answered with the error and the
/// channel is `stale`: when it is confirmed again, every local waiter is woken to retry, so a
/// release published while nobody listened is not slept through.
struct SubTask {
    client: Client,
    queueing: Arc<Queueing>,
    /// Stall timers by channel (see [`STALL_AFTER`]).
    stall: Stalls,
    /// Leaves and pass-ons to send (see the `wake` script).
    leaves: Vec<(String, bool)>,
    config: AsyncConnectionConfig,
    queues: Weak<WaitQueues>,
    ctl: mpsc::WeakUnboundedSender<Ctl>,
    conn: Option<MultiplexedConnection>,
    /// Generation of `conn`: a `Disconnected` of an older connection is ignored.
    generation: u64,
    wanted: HashSet<String>,
    /// Channels the server confirmed on `conn`.
    confirmed: HashSet<String>,
    /// Wanted channels whose waiters may have missed a release.
    stale: HashSet<String>,
    pending: Vec<(String, oneshot::Sender<Result<(), RedisError>>)>,
    retry_at: Option<Instant>,
    backoff: Duration,
    last_err: Option<RedisError>,
    last_check: Instant,
}

impl SubTask {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Ctl>) {
        let mut batch = Vec::new();
        loop {
            let check_at = (self.conn.is_some() && !self.confirmed.is_empty())
                .then(|| self.last_check + PUBSUB_CHECK_EVERY);
            let stall_at = self.stall.next();
            let timer = [self.retry_at, check_at, stall_at]
                .into_iter()
                .flatten()
                .min();
            // Requests that queued up while a command was in flight are handled together: one
            // SUBSCRIBE for every new channel, then one UNSUBSCRIBE for every idle one.
            tokio::select! {
                n = rx.recv_many(&mut batch, 256) => {
                    if n == 0 {
                        return;
                    }
                }
                _ = async {
                    match timer {
                        Some(t) => tokio::time::sleep_until(t).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
            let mut idle = Vec::new();
            for msg in batch.drain(..) {
                match msg {
                    Ctl::Subscribe(ch, ack) => {
                        if self.confirmed.contains(&ch) {
                            let _ = ack.send(Ok(()));
                        } else {
                            self.pending.push((ch.clone(), ack));
                        }
                        self.wanted.insert(ch);
                    }
                    Ctl::Unsubscribe(ch) => idle.push(ch),
                    Ctl::Disconnected(generation) => {
                        if generation == self.generation && self.conn.is_some() {
                            tracing::debug!("dlock: pub/sub connection closed; resubscribing");
                            self.drop_conn();
                        }
                    }
                    Ctl::Stall(StallCtl::Arm(ch, id)) => {
                        self.stall.arm(ch, id, Instant::now() + STALL_AFTER);
                    }
                    Ctl::Stall(StallCtl::Disarm(ch)) => {
                        self.stall.disarm(&ch);
                    }
                    Ctl::Stall(StallCtl::PassOn(ch)) => self.leaves.push((ch, true)),
                    Ctl::Leave(ch, pass) => self.leaves.push((ch, pass)),
                }
            }
            self.fire_stalls().await;
            self.send_leaves().await;
            let queues = self.queues.upgrade();
            for ch in idle {
                if queues.as_ref().is_none_or(|q| !q.has_waiters(&ch)) {
                    self.wanted.remove(&ch);
                    self.stale.remove(&ch);
                }
            }
            drop(queues);
            if check_at.is_some_and(|t| Instant::now() >= t) {
                self.check().await;
            }
            self.reconcile().await;
        }
    }

    /// Stall timers that ran out: the process a release woke did not try; the server is asked
    /// to pass its turn on (see [`STALL_AFTER`]), on the pub/sub connection.
    async fn fire_stalls(&mut self) {
        let queues = self.queues.upgrade();
        for (ch, id) in self.stall.due(queues.as_deref()) {
            let r = match (
                stall_pass_args(&ch, &self.queueing.id, &id),
                self.conn.as_mut(),
            ) {
                (Some([lock, queue, me, channel, mode, id, after]), Some(con)) => {
                    let mut cmd = scripts::evalsha(&scripts::WAKE, 2, 7, 3 * ch.len() + 80);
                    cmd.arg(lock)
                        .arg(queue)
                        .arg(me)
                        .arg(channel)
                        .arg(mode)
                        .arg(id)
                        .arg(after);
                    scripts::run::<i64>(&scripts::WAKE, &cmd, con).await
                }
                _ => Err(RedisError::from((ErrorKind::Io, "no pub/sub connection"))),
            };
            self.stall.after_pass(queues.as_deref(), ch, id, r);
        }
    }

    /// Leaves the waiters' queue of channels nobody here waits for any more, passing on an
    /// unused wake-up (the `wake` script, on the pub/sub connection: RESP3 takes commands
    /// there). A failure is left to the entry's expiry and the other processes' stall timers.
    async fn send_leaves(&mut self) {
        if self.leaves.is_empty() {
            return;
        }
        let leaves = std::mem::take(&mut self.leaves);
        let Some(con) = self.conn.as_mut() else {
            return;
        };
        for (ch, pass) in leaves {
            let Some(lock) = ch.strip_suffix(key::CHANNEL_SUFFIX) else {
                continue;
            };
            let queue = key::suffixed(lock, key::QUEUE_SUFFIX);
            let mut cmd = scripts::evalsha(&scripts::WAKE, 2, 5, 2 * ch.len() + 40);
            cmd.arg(lock)
                .arg(&queue)
                .arg(&self.queueing.id)
                .arg(&ch)
                .arg(if pass { "1" } else { "0" });
            if let Err(e) = scripts::run::<i64>(&scripts::WAKE, &cmd, con).await {
                tracing::debug!(channel = %ch, error = %e, "dlock: leaving the waiters' queue failed; the entry expires by itself");
            }
        }
    }

    /// Forgets the connection: its channels are stale, and every waiter retries at once (a
    /// release may have been missed), then again once its channel is confirmed.
    fn drop_conn(&mut self) {
        self.conn = None;
        self.generation += 1;
        let lost: Vec<String> = self.confirmed.drain().collect();
        self.stale
            .extend(lost.into_iter().filter(|c| self.wanted.contains(c)));
        // Resubscribe at the next turn of the loop, even if no request arrives.
        self.retry_at = Some(Instant::now());
        if let Some(q) = self.queues.upgrade() {
            q.wake_all();
        }
    }

    /// `PING` on a connection that carries subscriptions; a failure replaces it.
    async fn check(&mut self) {
        self.last_check = Instant::now();
        let Some(con) = self.conn.as_mut() else {
            return;
        };
        if let Err(e) = redis::cmd("PING").query_async::<Value>(con).await {
            tracing::debug!(error = %e, "dlock: pub/sub connection failed its check; replacing it");
            self.drop_conn();
        }
    }

    async fn connect(&mut self) -> Result<(), RedisError> {
        if self.conn.is_some() {
            return Ok(());
        }
        let generation = self.generation;
        let ctl = self.ctl.clone();
        let queues = self.queues.clone();
        let queueing = self.queueing.clone();
        let push = move |info: PushInfo| -> Result<(), ()> {
            let Some(queues) = queues.upgrade() else {
                return Err(());
            };
            match info.kind {
                PushKind::Message => {
                    if let Some(Value::BulkString(ch)) = info.data.first()
                        && let Ok(ch) = std::str::from_utf8(ch)
                    {
                        let payload = match info.data.get(1) {
                            Some(Value::BulkString(p)) => p.as_slice(),
                            _ => b"1",
                        };
                        on_release_message(&queues, &queueing, ch, payload, |c| {
                            if let Some(ctl) = ctl.upgrade() {
                                let _ = ctl.send(Ctl::Stall(c));
                            }
                        });
                    }
                }
                PushKind::Disconnection => {
                    queues.wake_all();
                    if let Some(ctl) = ctl.upgrade() {
                        let _ = ctl.send(Ctl::Disconnected(generation));
                    }
                }
                _ => {}
            }
            Ok(())
        };
        let config = self.config.clone().set_push_sender(push);
        let con = self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        self.conn = Some(con);
        self.last_check = Instant::now();
        Ok(())
    }

    async fn reconcile(&mut self) {
        let to_sub: Vec<String> = self
            .wanted
            .iter()
            .filter(|c| !self.confirmed.contains(*c))
            .cloned()
            .collect();
        if to_sub.is_empty() {
            self.retry_at = None;
            self.backoff = RESUBSCRIBE_BACKOFF_MIN;
        } else if self.retry_at.is_some_and(|t| Instant::now() < t) {
            // Backing off: answer now rather than keep a waiter's `watch` waiting; it will be
            // woken once its channel is confirmed.
            let e = self.last_err.clone().unwrap_or_else(|| {
                RedisError::from((ErrorKind::Io, "pub/sub connection unavailable"))
            });
            self.answer(Err(e), true);
        } else {
            let r = match self.connect().await {
                Ok(()) => match self.conn.as_mut() {
                    Some(con) => con.subscribe(&to_sub).await,
                    None => Ok(()),
                },
                Err(e) => Err(e),
            };
            match r {
                Ok(()) => {
                    let woke = to_sub.iter().any(|c| self.stale.remove(c));
                    self.confirmed.extend(to_sub);
                    self.retry_at = None;
                    self.backoff = RESUBSCRIBE_BACKOFF_MIN;
                    self.last_err = None;
                    self.answer(Ok(()), false);
                    if woke && let Some(q) = self.queues.upgrade() {
                        // Subscribed again: waiters that may have missed a release retry now.
                        tracing::debug!("dlock: pub/sub resubscribed; waking every waiter");
                        q.wake_all();
                    }
                }
                Err(e) if is_refusal(&e) => {
                    // Not retried here: `watch` backs off and asks again (see `Refusal`).
                    for c in &to_sub {
                        self.wanted.remove(c);
                        self.stale.remove(c);
                    }
                    self.answer(Err(e), false);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "dlock: SUBSCRIBE failed; retrying with back-off");
                    if !matches!(e.kind(), ErrorKind::Server(_)) {
                        // A timeout or a broken socket: the connection's state is unknown.
                        self.drop_conn();
                    }
                    self.stale.extend(to_sub);
                    self.retry_at = Some(Instant::now() + self.backoff);
                    self.backoff = (self.backoff * 2).min(RESUBSCRIBE_BACKOFF_MAX);
                    self.last_err = Some(e.clone());
                    self.answer(Err(e), true);
                }
            }
        }
        let to_unsub: Vec<String> = self
            .confirmed
            .iter()
            .filter(|c| !self.wanted.contains(*c))
            .cloned()
            .collect();
        if !to_unsub.is_empty()
            && let Some(con) = self.conn.as_mut()
        {
            match con.unsubscribe(&to_unsub).await {
                Err(e) if !matches!(e.kind(), ErrorKind::Server(_)) => self.drop_conn(),
                _ => {
                    for c in &to_unsub {
                        self.confirmed.remove(c);
                    }
                }
            }
        }
    }

    /// Answers the pending requests: those whose channel is confirmed (or no longer wanted)
    /// with `Ok`, the others with `r`, marking them stale when `stale` is set.
    fn answer(&mut self, r: Result<(), RedisError>, stale: bool) {
        for (ch, ack) in std::mem::take(&mut self.pending) {
            if self.confirmed.contains(&ch) || !self.wanted.contains(&ch) {
                let _ = ack.send(Ok(()));
            } else {
                if stale {
                    self.stale.insert(ch);
                }
                let _ = ack.send(r.clone());
            }
        }
    }
}

/// Writes this process's holder identity (`SET dlock:holder:<process> name@host:pid EX 3600`,
/// see `holder.rs`) on `con`. Sent by an acquire or a renewal whose [`Registration`] says it is
/// due (once per 20 minutes per backend), beside its script on the same connection, so it adds
/// no round trip and no work to the scripts. A failure (an ACL without `SET`, a timeout) never
/// fails the call: it is logged at `debug` and tried again 10 s later.
pub(crate) async fn write_holder(reg: &Registration, mut con: impl ConnectionLike, owner: &str) {
    let r: redis::RedisResult<()> = redis::cmd("SET")
        .arg(key::holder_key(crate::holder::process_of(owner)))
        .arg(&*crate::holder::holder_text())
        .arg("EX")
        .arg(Registration::TTL.as_secs())
        .query_async(&mut con)
        .await;
    if let Err(e) = r {
        reg.failed();
        tracing::debug!(error = %e, "dlock: writing the holder identity to Redis failed");
    }
}

/// The URL with every secret replaced by `***` (see `crate::redact`).
pub(crate) fn redact_url(url: &str) -> String {
    crate::redact::redact_url(url)
}

/// Runs `cmd` (an [`scripts::evalsha`] of `script`); with `wait = Some((n, timeout))` followed by
/// `WAIT n timeout` in one pipeline on the same connection, whose reply comes second.
pub(super) async fn run_then_wait(
    script: &Script,
    cmd: Cmd,
    wait: Option<(usize, Duration)>,
    con: &mut impl ConnectionLike,
) -> redis::RedisResult<(Value, Option<Value>)> {
    match wait {
        None => scripts::run(script, &cmd, con).await.map(|v| (v, None)),
        Some((n, timeout)) => {
            let mut pipe = redis::pipe();
            pipe.add_command(cmd)
                .cmd("WAIT")
                .arg(n)
                .arg(timeout.as_millis() as u64);
            run_with_wait(script, &pipe, con).await
        }
    }
}

/// The number of replicas a `WAIT` reply counts, or why it counts none.
pub(crate) fn wait_reply(v: Option<Value>) -> Option<Result<usize, String>> {
    v.map(|v| match v {
        Value::Int(k) => Ok(k.max(0) as usize),
        other => Err(format!("unexpected WAIT reply {other:?}")),
    })
}

/// `None` when a grant followed by `WAIT n timeout` (`wait`) was confirmed by at least `n`
/// replicas (`acked`, see [`wait_reply`]); otherwise the error to answer once the caller gave
/// the grant back (`what`: "grant", "permit grant").
pub(crate) fn unconfirmed(
    name: &str,
    acked: Option<Result<usize, String>>,
    wait: (usize, Duration),
    what: &str,
) -> Option<LockError> {
    let (n, timeout) = wait;
    let acked = acked.unwrap_or_else(|| Err("no WAIT reply".to_string()));
    if matches!(acked, Ok(k) if k >= n) {
        return None;
    }
    Some(LockError::backend(
        name,
        match acked {
            Ok(k) => format!(
                "only {k} of {n} replicas confirmed the {what} within {timeout:?}; given back"
            ),
            Err(e) => format!("WAIT for {n} replicas failed ({e}); {what} given back"),
        },
    ))
}

/// Sends `pipe` (an [`scripts::evalsha`] of `script` and a `WAIT`); a `NOSCRIPT` answer to the
/// script (which then did not run) loads it and sends the pipeline again.
async fn run_with_wait(
    script: &Script,
    pipe: &Pipeline,
    con: &mut impl ConnectionLike,
) -> redis::RedisResult<(Value, Option<Value>)> {
    let mut loaded = false;
    loop {
        let r = con.req_packed_commands(pipe, 0, 2).await;
        let no_script = |e: &RedisError| e.kind() == ErrorKind::Server(ServerErrorKind::NoScript);
        let values = match r {
            Err(e) if no_script(&e) && !loaded => None,
            Err(e) => return Err(e),
            Ok(values) => Some(values),
        };
        if let Some(values) = values {
            let mut values = values.into_iter();
            let first = values.next().unwrap_or(Value::Nil);
            let second = values.next();
            match first {
                Value::ServerError(e) => {
                    let e = RedisError::from(e);
                    if !no_script(&e) || loaded {
                        return Err(e);
                    }
                }
                first => return Ok((first, second)),
            }
        }
        script.prepare_invoke().load_async(con).await?;
        loaded = true;
    }
}

fn map_err(key: &str, e: RedisError) -> LockError {
    LockError::backend(key, e)
}

/// A SUBSCRIBE failure that will not go away by retrying: no channel permission (ACL), or a
/// server without RESP3 (`HELLO` unknown, Redis < 6). Transient errors are not refusals.
fn is_refusal(e: &RedisError) -> bool {
    matches!(e.kind(), ErrorKind::Server(ServerErrorKind::NoPerm))
        || e.kind() == ErrorKind::InvalidClientConfig
        || (matches!(e.kind(), ErrorKind::Server(ServerErrorKind::ResponseError))
            && e.to_string().to_ascii_lowercase().contains("hello"))
}

fn ms(d: Duration) -> u64 {
    (d.as_millis() as u64).max(1)
}

impl RedisBackend {
    /// Starts building a backend for a `redis://` (or `rediss://` with the `tls` feature) URL:
    /// `redis://[user[:password]@]host[:port][/db]`.
    pub fn builder(url: impl Into<String>) -> RedisBackendBuilder {
        RedisBackendBuilder {
            url: url.into(),
            response_timeout: Duration::from_secs(3),
            connection_timeout: Duration::from_secs(1),
            reconnect_retries: 2,
            #[cfg(feature = "tls")]
            tls_root_cert: None,
        }
    }

    /// Connects with default settings; see [`RedisBackend::builder`].
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::builder(url).connect().await
    }

    /// The URL, with any password replaced by `***`.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    fn manager_config(&self) -> ConnectionManagerConfig {
        let c = &self.inner.config;
        ConnectionManagerConfig::new()
            .set_response_timeout(Some(c.response_timeout))
            .set_connection_timeout(Some(c.connection_timeout))
            .set_number_of_retries(c.reconnect_retries)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(500))
    }

    /// The connections of the current runtime, created on first use.
    fn conn(&self, key: &str) -> Result<(DataConn<'_>, Arc<Subscriber>), LockError> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| {
            LockError::Config("dlock's Redis backend must be used inside a tokio runtime".into())
        })?;
        let id = handle.id();
        let mut conns = self.inner.conns.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = conns.iter().find(|c| c.runtime == id) {
            let data = DataConn {
                con: c.data.clone(),
                generation: c.data_gen,
                runtime: id,
                backend: self,
                defer_replace: false,
            };
            return Ok((data, c.sub.clone()));
        }
        // Forget the connections of runtimes that have shut down.
        conns.retain_mut(|c| {
            !matches!(
                c.alive.try_recv(),
                Err(oneshot::error::TryRecvError::Closed)
            )
        });
        let data = ConnectionManager::new_lazy_with_config(
            self.inner.client.clone(),
            self.manager_config(),
        )
        .map_err(|e| map_err(key, e))?;
        let sub = self.new_subscriber(&handle);
        let (tx, alive) = oneshot::channel::<()>();
        handle.spawn(async move {
            let _tx = tx;
            std::future::pending::<()>().await;
        });
        conns.push(RtConn {
            runtime: id,
            alive,
            data: data.clone(),
            data_gen: 0,
            sub: sub.clone(),
        });
        let data = DataConn {
            con: data,
            generation: 0,
            runtime: id,
            backend: self,
            defer_replace: false,
        };
        Ok((data, sub))
    }

    /// One owner-checked release (see `Backend::release`), behind this owner's unanswered
    /// acquire calls (see [`Pin`]).
    async fn release_once(
        &self,
        name: &str,
        owner: &str,
        keep_for: Option<Duration>,
        all: bool,
        publish: bool,
    ) -> Result<Released, LockError> {
        if self.inner.fair.contains(name, owner) {
            return self
                .fair_release_once(name, owner, keep_for, all, publish)
                .await;
        }
        let (mut con, sub) = self.conn(name)?;
        let lock = key::lock_key(name);
        let channel = if publish {
            key::suffixed(&lock, key::CHANNEL_SUFFIX)
        } else {
            String::new()
        };
        let keep = keep_for.filter(|d| !d.is_zero()).map(ms).unwrap_or(0);
        // With queueing, the release wakes the queue's head (see "Waiting" on `RedisBackend`),
        // and queues this runtime behind the others when waiters of its own remain.
        let queue = publish;
        let me = if queue {
            self.queue_channel(&sub, &lock)
        } else {
            None
        };
        let mut cmd = scripts::evalsha(
            &scripts::RELEASE,
            if queue { 2 } else { 1 },
            8,
            4 * lock.len() + owner.len() + sub.queueing.id.len() + 40,
        );
        cmd.arg(&lock);
        if queue {
            cmd.arg(key::suffixed(&lock, key::QUEUE_SUFFIX));
        }
        cmd.arg(owner)
            .arg(keep)
            .arg(&channel)
            .arg(if all { 1 } else { 0 });
        if me.is_some() {
            cmd.arg(&sub.queueing.id).arg(ms(QUEUE_LIFE));
        }
        let pinned = self.pinned(name, owner);
        if pinned.is_empty() {
            let r: i64 = scripts::run(&scripts::RELEASE, &cmd, &mut con)
                .await
                .map_err(|e| map_err(name, e))?;
            if r == 0
                && let Some(channel) = &me
            {
                sub.queueing.mark(channel);
            }
            return Ok(crate::scripts::release_reply(r));
        }
        // Behind this owner's unanswered acquire calls, on their connections (see `Pin`).
        // A release of every hold is owner-checked and idempotent, so it is sent behind
        // each of them in turn; a partial one (`all` unset, a re-entry's) only behind the
        // newest, so that it cannot take off more than one hold.
        let pinned = if all {
            pinned
        } else {
            pinned.into_iter().last().into_iter().collect()
        };
        let mut out: Option<Released> = None;
        for (runtime, generation, pcon) in pinned {
            let mut pcon = DataConn {
                con: pcon,
                generation,
                runtime,
                backend: self,
                defer_replace: false,
            };
            let r: i64 = scripts::run(&scripts::RELEASE, &cmd, &mut pcon)
                .await
                .map_err(|e| map_err(name, e))?;
            self.settle(name, owner, runtime, generation);
            let r = crate::scripts::release_reply(r);
            out = Some(match (out, r) {
                (None, r) => r,
                (Some(Released::Freed), _) | (_, Released::Freed) => Released::Freed,
                (Some(Released::Decremented(_)), r @ Released::Decremented(_)) => r,
                (Some(d @ Released::Decremented(_)), Released::NotOwner) => d,
                (Some(Released::NotOwner), r) => r,
            });
        }
        Ok(out.unwrap_or(Released::NotOwner))
    }

    /// The connections of `owner`'s unanswered acquire calls on `name`, oldest first (see [`Pin`]).
    fn pinned(&self, name: &str, owner: &str) -> Vec<(tokio::runtime::Id, u64, ConnectionManager)> {
        let pins = self.inner.pins.lock().unwrap_or_else(|e| e.into_inner());
        if pins.is_empty() {
            return Vec::new();
        }
        pins.get(&(name.to_string(), owner.to_string()))
            .map(|v| {
                v.iter()
                    .map(|p| (p.runtime, p.generation, p.con.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// A release of `owner` on `name` was answered on the pinned connection (`runtime`,
    /// `generation`): every call pinned to it ran before, so the pin goes.
    fn settle(&self, name: &str, owner: &str, runtime: tokio::runtime::Id, generation: u64) {
        let mut pins = self.inner.pins.lock().unwrap_or_else(|e| e.into_inner());
        let key = (name.to_string(), owner.to_string());
        if let Some(v) = pins.get_mut(&key) {
            v.retain(|p| !(p.runtime == runtime && p.generation == generation));
            if v.is_empty() {
                pins.remove(&key);
            }
        }
    }

    /// Replaces the data connection of `runtime` after a call on generation `generation` timed out
    /// (see [`DataConn`]); a no-op when another call already replaced it.
    fn replace_data(&self, runtime: tokio::runtime::Id, generation: u64) {
        let mut conns = self.inner.conns.lock().unwrap_or_else(|e| e.into_inner());
        let Some(c) = conns
            .iter_mut()
            .find(|c| c.runtime == runtime && c.data_gen == generation)
        else {
            return;
        };
        match ConnectionManager::new_lazy_with_config(
            self.inner.client.clone(),
            self.manager_config(),
        ) {
            Ok(data) => {
                c.data = data;
                c.data_gen += 1;
                tracing::debug!(
                    url = %self.inner.url,
                    "dlock: a Redis reply timed out; the data connection is replaced"
                );
            }
            Err(e) => tracing::debug!(
                url = %self.inner.url,
                error = %e,
                "dlock: cannot replace a timed-out data connection"
            ),
        }
    }

    fn new_subscriber(&self, handle: &tokio::runtime::Handle) -> Arc<Subscriber> {
        let (ctl, rx) = mpsc::unbounded_channel::<Ctl>();
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
        let c = &self.inner.config;
        let task = SubTask {
            client: self.inner.pubsub_client.clone(),
            queueing: queueing.clone(),
            stall: Stalls::default(),
            leaves: Vec::new(),
            config: AsyncConnectionConfig::new()
                .set_response_timeout(Some(c.response_timeout))
                .set_connection_timeout(Some(c.connection_timeout)),
            queues: Arc::downgrade(&queues),
            ctl: ctl.downgrade(),
            conn: None,
            generation: 0,
            wanted: HashSet::new(),
            confirmed: HashSet::new(),
            stale: HashSet::new(),
            pending: Vec::new(),
            retry_at: None,
            backoff: RESUBSCRIBE_BACKOFF_MIN,
            last_err: None,
            last_check: Instant::now(),
        };
        handle.spawn(task.run(rx));
        Arc::new(Subscriber {
            queues,
            ctl,
            queueing,
        })
    }

    /// True while a refused SUBSCRIBE is in its back-off (see [`Refusal`]).
    fn refused_now(&self) -> bool {
        self.inner.refusal.refused_now()
    }

    fn note_refusal(&self, e: &RedisError) {
        if self.inner.refusal.note_refusal() {
            tracing::warn!(
                url = %self.inner.url,
                error = %e,
                "dlock: Redis refused SUBSCRIBE (an ACL user needs `&dlock:*`, the server RESP3); waiters fall back to the holder's remaining lease, and SUBSCRIBE is retried with back-off"
            );
        }
    }

    fn note_accepted(&self) {
        if self.inner.refusal.note_accepted() {
            tracing::info!(url = %self.inner.url, "dlock: Redis accepts SUBSCRIBE again; waiters are woken by releases");
        }
    }

    async fn ping(&self) -> Result<(), LockError> {
        let (mut con, _) = self.conn("")?;
        redis::cmd("PING")
            .query_async::<String>(&mut con)
            .await
            .map_err(|e| LockError::Backend {
                key: String::new(),
                source: format!("cannot reach Redis at {}: {e}", self.inner.url).into(),
            })?;
        Ok(())
    }

    /// Loads the scripts into the server's script cache (`SCRIPT LOAD`), so that the first calls
    /// run at once instead of each answering `NOSCRIPT` and being sent again after a load. Two
    /// calls resent that way are no longer ordered as they were sent: a release of an owner sent
    /// right after its acquire could run first and find nothing to free. After a server restart
    /// (which empties the cache, and the locks with it) the first calls load them again.
    /// A failure (a user whose ACL lacks `SCRIPT`) is logged, not fatal: the calls then load the
    /// scripts themselves as before.
    pub(crate) async fn load_scripts(&self) {
        let Ok((mut con, _)) = self.conn("") else {
            return;
        };
        for script in [&*scripts::ACQUIRE, &*scripts::RELEASE, &*scripts::EXTEND] {
            if let Err(e) = script.prepare_invoke().load_async(&mut con).await {
                tracing::warn!(url = %self.inner.url, error = %e, "dlock: cannot preload the lock scripts; calls load them on first use");
                return;
            }
        }
    }

    /// Warns when the server may evict lock keys (`maxmemory-policy` other than `noeviction`):
    /// eviction deletes a held lock silently.
    async fn check_eviction_policy(&self) {
        let Ok((mut con, _)) = self.conn("") else {
            return;
        };
        let r: Result<Vec<String>, _> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .query_async(&mut con)
            .await;
        if let Ok(v) = r
            && let Some(policy) = v.get(1)
            && policy != "noeviction"
        {
            tracing::warn!(
                url = %self.inner.url,
                policy = %policy,
                "dlock: Redis may evict keys (maxmemory-policy is not noeviction); an evicted lock is lost silently"
            );
        }
    }

    /// Number of callers of the current runtime waiting on this backend.
    pub fn waiter_count(&self) -> usize {
        self.conn("")
            .map(|(_, s)| s.queues.waiter_count())
            .unwrap_or(0)
    }
}

impl Backend for RedisBackend {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(async move { Ok(self.acquire_then_wait(name, owner, ttl, None).await?.0) })
    }

    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        Box::pin(self.release_publishing(name, owner, keep_for, all, true))
    }

    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(async move {
            let (mut con, _) = self.conn(name)?;
            let lock = key::lock_key(name);
            let mut cmd = scripts::evalsha(&scripts::EXTEND, 1, 3, lock.len() + owner.len() + 20);
            cmd.arg(&lock).arg(owner).arg(ms(ttl));
            // A long hold renews the identity too (it outlives its key's expiry otherwise).
            let holder_write = self
                .inner
                .registration
                .due(owner)
                .then(|| write_holder(&self.inner.registration, con.con.clone(), owner));
            let call = scripts::run(&scripts::EXTEND, &cmd, &mut con);
            let r: redis::RedisResult<i64> = match holder_write {
                Some(w) => tokio::join!(w, call).1,
                None => call.await,
            };
            let r = r.map_err(|e| map_err(name, e))?;
            Ok(crate::scripts::extend_reply(r))
        })
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

    fn supports_fair(&self) -> bool {
        true
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

    // Semaphores: `redis/semaphore.rs`.
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
            let key = key::suffixed(&key::lock_key(name), key::RECORD_SUFFIX);
            let mut cmd = scripts::evalsha(&scripts::RECORD, 1, 3, key.len() + value.len() + 20);
            cmd.arg(&key).arg(epoch).arg(value);
            let r: i64 = scripts::run(&scripts::RECORD, &cmd, &mut con)
                .await
                .map_err(|e| map_err(name, e))?;
            Ok(r == 1)
        })
    }

    fn get_record<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<crate::backend::Record>, LockError>> {
        Box::pin(async move {
            let (mut con, _) = self.conn(name)?;
            let key = key::suffixed(&key::lock_key(name), key::RECORD_SUFFIX);
            let (epoch, value): (Option<u64>, Option<String>) = redis::cmd("HMGET")
                .arg(&key)
                .arg("epoch")
                .arg("value")
                .query_async(&mut con)
                .await
                .map_err(|e| map_err(name, e))?;
            Ok(epoch.map(|epoch| crate::backend::Record {
                epoch,
                value: value.unwrap_or_default(),
            }))
        })
    }
}

impl RedisBackend {
    /// True when this runtime has waiters on `channel` (a side of a read-write lock).
    fn channel_has_waiters(&self, name: &str, channel: &str) -> bool {
        match self.conn(name) {
            Ok((_, sub)) => sub.queues.has_waiters(channel),
            Err(_) => false,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Added for the Redlock backend (backend/redlock.rs), which composes one RedisBackend per node.
// ---------------------------------------------------------------------------------------------

impl RedisBackend {
    /// The acquire script, and with `wait = Some((n, timeout))` `WAIT n timeout` right behind it
    /// in one pipeline, so on the connection that wrote the grant (a WAIT on another connection,
    /// one that wrote nothing, answers at once with every connected replica: review
    /// redis-family #11). Returns the acquire's reply and WAIT's count (or why it failed).
    /// An unanswered call is pinned to its connection (see [`Pin`]).
    pub(crate) async fn acquire_then_wait(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
        wait: Option<(usize, Duration)>,
    ) -> Result<(Acquired, Option<Result<usize, String>>), LockError> {
        let (a, acked, _) = self.acquire_inner(name, owner, ttl, wait, false).await?;
        Ok((a, acked))
    }

    /// [`RedisBackend::acquire_then_wait`]; with `holder` set, a busy answer also names the
    /// holder's owner id.
    async fn acquire_inner(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
        wait: Option<(usize, Duration)>,
        holder: bool,
    ) -> Result<(Acquired, Option<Result<usize, String>>, Option<String>), LockError> {
        let (mut con, sub) = self.conn(name)?;
        con.defer_replace = true;
        let mut pin = PinOnDrop {
            backend: self,
            name,
            owner,
            con: Some((con.con.clone(), con.runtime, con.generation)),
        };
        let lock = key::lock_key(name);
        let fence = key::suffixed(&lock, key::FENCE_SUFFIX);
        // A waiter's try (its process has waiters for the name) queues the process on a busy
        // answer (see "Waiting" on `RedisBackend`).
        let queued = self.queue_channel(&sub, &lock);
        let mut cmd = match &queued {
            None => scripts::evalsha(&scripts::ACQUIRE, 2, 5, 2 * lock.len() + owner.len() + 30),
            Some(_) => scripts::evalsha(
                &scripts::ACQUIRE,
                3,
                9,
                4 * lock.len() + owner.len() + sub.queueing.id.len() + 40,
            ),
        };
        cmd.arg(&lock).arg(&fence);
        if queued.is_some() {
            cmd.arg(key::suffixed(&lock, key::QUEUE_SUFFIX));
        }
        cmd.arg(owner).arg(ms(ttl)).arg(ms(ttl + FENCE_GRACE));
        if let Some(channel) = &queued {
            cmd.arg(&sub.queueing.id).arg(channel);
            if holder {
                cmd.arg(1);
            }
        } else if holder {
            cmd.arg(1);
        }
        let holder_write = self
            .inner
            .registration
            .due(owner)
            .then(|| write_holder(&self.inner.registration, con.con.clone(), owner));
        let call = run_then_wait(&scripts::ACQUIRE, cmd, wait, &mut con);
        let r: redis::RedisResult<(Value, Option<Value>)> = match holder_write {
            // Written first on the same connection: answered before the script, no round trip
            // added.
            Some(w) => tokio::join!(w, call).1,
            None => call.await,
        };
        match &r {
            Ok(_) => pin.con = None,
            Err(e) => {
                // Pinned first, so that no release of this owner can take the new
                // connection before the pin exists.
                drop(pin);
                if e.is_timeout() {
                    self.replace_data(con.runtime, con.generation);
                }
            }
        }
        let (r, acked) = r.map_err(|e| map_err(name, e))?;
        let (r, held_by) = match r {
            Value::Array(a)
                if holder && matches!(a.as_slice(), [Value::Int(_), Value::BulkString(_)]) =>
            {
                let mut it = a.into_iter();
                let pttl = it.next().unwrap_or(Value::Nil);
                let h = match it.next() {
                    Some(Value::BulkString(b)) if !b.is_empty() => {
                        Some(String::from_utf8_lossy(&b).into_owned())
                    }
                    _ => None,
                };
                (pttl, h)
            }
            r => (r, None),
        };
        let acquired = scripts::acquire_reply(&r).ok_or_else(|| {
            LockError::backend(
                name,
                format!("unexpected reply from the acquire script: {r:?}"),
            )
        })?;
        if let (Some(channel), Acquired::Busy { .. }) = (&queued, acquired) {
            sub.queueing.mark(channel);
        }
        Ok((acquired, wait_reply(acked), held_by))
    }

    /// The release channel of `lock` when a call for it should queue this runtime on the
    /// server: this runtime has waiters for the name and its subscriptions are not refused (a
    /// waiter that cannot hear its turn must not take one).
    fn queue_channel(&self, sub: &Subscriber, lock: &str) -> Option<String> {
        if !sub.queues.any_waiters() || self.refused_now() {
            return None;
        }
        let channel = key::suffixed(lock, key::CHANNEL_SUFFIX);
        sub.queues.has_waiters(&channel).then_some(channel)
    }

    /// [`Backend::release`]; with `publish` unset a lock it frees publishes no wake-up (Redlock's
    /// clean-up of a failed try on a name another owner holds: that owner's release wakes).
    pub(crate) async fn release_publishing(
        &self,
        name: &str,
        owner: &str,
        keep_for: Option<Duration>,
        all: bool,
        publish: bool,
    ) -> Result<Released, LockError> {
        let r = self.release_once(name, owner, keep_for, all, publish).await;
        if all && matches!(r, Err(LockError::Backend { .. })) {
            let me = self.clone();
            let (n, o) = (name.to_string(), owner.to_string());
            self.inner
                .reaper
                .retry(name, owner, self.inner.url.clone(), move || {
                    let (me, n, o) = (me.clone(), n.clone(), o.clone());
                    async move { me.release_once(&n, &o, keep_for, true, publish).await }
                });
        }
        r
    }

    /// [`Backend::try_acquire`], also naming the holder in a busy answer (the owner id that holds
    /// the name on this server; `None` on a grant, or when the reply names none).
    pub(crate) async fn try_acquire_holder(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<(Acquired, Option<String>), LockError> {
        let (a, _, h) = self.acquire_inner(name, owner, ttl, None, true).await?;
        Ok((a, h))
    }

    /// The server's `run_id` (`INFO server`): it changes when the server restarts (used by the
    /// Sentinel backend to tell a new master process from the one it knew).
    #[cfg_attr(not(feature = "sentinel"), allow(dead_code))]
    pub(crate) async fn server_run_id(&self) -> Result<String, LockError> {
        let (mut con, _) = self.conn("")?;
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut con)
            .await
            .map_err(|e| map_err("", e))?;
        run_id_of(&info)
    }

    /// The name of this runtime's data connection (`CLIENT GETNAME`): `None` on a connection
    /// nobody named, such as one the connection manager opened after the last was lost.
    pub(crate) async fn data_conn_name(&self) -> Result<Option<String>, LockError> {
        let (mut con, _) = self.conn("")?;
        redis::cmd("CLIENT")
            .arg("GETNAME")
            .query_async(&mut con)
            .await
            .map_err(|e| map_err("", e))
    }

    /// Names this runtime's data connection `name` and reads the server's `run_id` on that same
    /// connection (one pipeline is written to one connection): a later `CLIENT GETNAME` that
    /// answers `name` was served by the process that gave this `run_id`, since a connection
    /// does not outlive its server process.
    /// Also returns the server's `uptime_in_seconds` from the same reply (`None` if absent).
    pub(crate) async fn name_data_conn(
        &self,
        name: &str,
    ) -> Result<(String, Option<u64>), LockError> {
        let (mut con, _) = self.conn("")?;
        let (info,): (String,) = redis::pipe()
            .cmd("CLIENT")
            .arg("SETNAME")
            .arg(name)
            .ignore()
            .cmd("INFO")
            .arg("server")
            .query_async(&mut con)
            .await
            .map_err(|e| map_err("", e))?;
        let uptime = info
            .lines()
            .find_map(|l| l.strip_prefix("uptime_in_seconds:"))
            .and_then(|v| v.trim().parse().ok());
        Ok((run_id_of(&info)?, uptime))
    }

    /// Raises `name`'s fence on this server to `token` (the fence script, see `fence.lua`):
    /// true when every later grant of the name here gets a larger token (the name is free here
    /// or `owner` holds it). Idempotent, so a call whose answer was lost may be sent again.
    pub(crate) async fn raise_fence(
        &self,
        name: &str,
        owner: &str,
        token: u64,
        ttl: Duration,
    ) -> Result<bool, LockError> {
        let (mut con, _) = self.conn(name)?;
        let lock = key::lock_key(name);
        let fence = key::suffixed(&lock, key::FENCE_SUFFIX);
        let mut cmd = scripts::evalsha(&scripts::FENCE, 2, 5, 2 * lock.len() + owner.len() + 40);
        cmd.arg(&lock)
            .arg(&fence)
            .arg(owner)
            .arg(token)
            .arg(ms(ttl.saturating_add(FENCE_GRACE)));
        let r: i64 = scripts::run(&scripts::FENCE, &cmd, &mut con)
            .await
            .map_err(|e| map_err(name, e))?;
        Ok(r == 1)
    }

    /// Loads the fence script into the server's script cache (see [`RedisBackend::load_scripts`]).
    pub(crate) async fn load_fence_script(&self) {
        let Ok((mut con, _)) = self.conn("") else {
            return;
        };
        let _ = scripts::FENCE.prepare_invoke().load_async(&mut con).await;
    }
}

/// The `run_id` line of an `INFO server` reply.
fn run_id_of(info: &str) -> Result<String, LockError> {
    info.lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .map(|id| id.trim().to_string())
        .ok_or_else(|| LockError::backend("", "INFO server has no run_id"))
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("redis://user:s3cret@127.0.0.1:6379/2"),
            "redis://user:***@127.0.0.1:6379/2"
        );
        assert_eq!(
            redact_url("redis://:s3cret@localhost"),
            "redis://:***@localhost"
        );
        assert_eq!(redact_url("redis://127.0.0.1/0"), "redis://127.0.0.1/0");
        assert_eq!(redact_url("rediss://u:p@w@h:1/0"), "rediss://u:***@h:1/0");
    }
}
