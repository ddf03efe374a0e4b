//! The Redis backend: one instance or a master, over `ConnectionManager`s, Lua scripts run by
//! EVALSHA (NOSCRIPT falls back to loading the script), and pub/sub wake-ups for waiters.
//!
//! See [`RedisBackend`] for how connections follow runtimes and how waiting works.

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, ErrorKind, ProtocolVersion, PushInfo, PushKind, RedisError, ServerErrorKind};
use tokio::sync::{mpsc, oneshot};

use super::{Acquired, Backend, BoxFuture, Extended, Released, Watch};
use crate::key::redis_keys;
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
        backend.check_eviction_policy().await;
        Ok(backend)
    }

    /// Checks the URL without connecting; connections are made on first use.
    pub fn build(self) -> Result<RedisBackend, LockError> {
        let redacted = redact_url(&self.url);
        #[cfg(feature = "tls")]
        if self.url.starts_with("rediss://")
            && rustls::crypto::CryptoProvider::get_default().is_none()
        {
            // redis-rs builds its rustls config from the process-default provider and has none
            // of its own; install ring's once. An application's own choice, made earlier, wins
            // (install_default then fails and is ignored).
            let _ = rustls::crypto::ring::default_provider().install_default();
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
                pubsub_refused: AtomicBool::new(false),
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
/// Waiters of one runtime share its pub/sub connection (RESP3 push messages, resubscribed
/// automatically after a reconnect). The first waiter for a lock subscribes to its release
/// channel; the release script publishes once; the message wakes one waiter of the queue. A lost
/// pub/sub connection wakes every waiter so that none sleeps through a missed release. When the
/// server refuses pub/sub (an ACL user without `&dlock:*`, a server without RESP3), waiting falls
/// back to the holder's remaining lease as a timer, with one `warn` event.
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
    pubsub_refused: AtomicBool,
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
    sub: Arc<Subscriber>,
}

/// The pub/sub side of one runtime: its wait queues and the task that (un)subscribes.
struct Subscriber {
    queues: Arc<WaitQueues>,
    ctl: mpsc::UnboundedSender<Ctl>,
}

enum Ctl {
    Subscribe(String, oneshot::Sender<Result<(), RedisError>>),
    Unsubscribe(String),
}

/// Replaces the password of a URL with `***`.
pub(crate) fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let rest = &url[scheme_end + 3..];
    let auth_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..auth_end].rfind('@') else {
        return url.to_string();
    };
    let userinfo = &rest[..at];
    let user = match userinfo.find(':') {
        Some(colon) => format!("{}:***", &userinfo[..colon]),
        None => "***".to_string(),
    };
    format!("{}://{}@{}", &url[..scheme_end], user, &rest[at + 1..])
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
    fn conn(&self, key: &str) -> Result<(ConnectionManager, Arc<Subscriber>), LockError> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| {
            LockError::Config("dlock's Redis backend must be used inside a tokio runtime".into())
        })?;
        let id = handle.id();
        let mut conns = self.inner.conns.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = conns.iter().find(|c| c.runtime == id) {
            return Ok((c.data.clone(), c.sub.clone()));
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
        let sub = self.new_subscriber(&handle, key)?;
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

    fn new_subscriber(
        &self,
        handle: &tokio::runtime::Handle,
        key: &str,
    ) -> Result<Arc<Subscriber>, LockError> {
        let (ctl, mut rx) = mpsc::unbounded_channel::<Ctl>();
        let ctl_for_empty = ctl.clone();
        let queues = WaitQueues::with_on_empty(Some(Box::new(move |channel: &str| {
            let _ = ctl_for_empty.send(Ctl::Unsubscribe(channel.to_string()));
        })));
        let weak: Weak<WaitQueues> = Arc::downgrade(&queues);
        let push = move |info: PushInfo| -> Result<(), ()> {
            let Some(queues) = weak.upgrade() else {
                return Err(());
            };
            match info.kind {
                PushKind::Message => {
                    if let Some(redis::Value::BulkString(ch)) = info.data.first()
                        && let Ok(ch) = std::str::from_utf8(ch)
                    {
                        queues.wake_one(ch);
                    }
                }
                PushKind::Disconnection => {
                    tracing::debug!("dlock: pub/sub connection lost; waking every waiter");
                    queues.wake_all();
                }
                _ => {}
            }
            Ok(())
        };
        let config = self
            .manager_config()
            .set_push_sender(push)
            .set_automatic_resubscription();
        let mut pubsub =
            ConnectionManager::new_lazy_with_config(self.inner.pubsub_client.clone(), config)
                .map_err(|e| map_err(key, e))?;
        let queues_for_task = Arc::downgrade(&queues);
        handle.spawn(async move {
            let mut subscribed: HashSet<String> = HashSet::new();
            let mut batch = Vec::new();
            // Requests that queued up while a command was in flight are handled together: one
            // SUBSCRIBE for every new channel, then one UNSUBSCRIBE for every idle one. Handling
            // subscriptions first keeps "subscribed before the retry" for every requester, and an
            // unsubscribe is only sent for a channel nobody waits on at that moment.
            while rx.recv_many(&mut batch, 256).await > 0 {
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
                    }
                }
                let r = if new_channels.is_empty() {
                    Ok(())
                } else {
                    pubsub.subscribe(&new_channels).await
                };
                if r.is_ok() {
                    subscribed.extend(new_channels);
                }
                for ack in acks {
                    let _ = ack.send(r.clone());
                }
                let queues = queues_for_task.upgrade();
                let idle: Vec<String> = idle
                    .into_iter()
                    .filter(|ch| queues.as_ref().is_none_or(|q| !q.has_waiters(ch)))
                    .filter(|ch| subscribed.remove(ch))
                    .collect();
                if !idle.is_empty() {
                    let _ = pubsub.unsubscribe(&idle).await;
                }
            }
        });
        Ok(Arc::new(Subscriber { queues, ctl }))
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
        Box::pin(async move {
            let (mut con, _) = self.conn(name)?;
            let keys = redis_keys(name);
            let r: Vec<i64> = scripts::ACQUIRE
                .key(&keys.lock)
                .key(&keys.fence)
                .arg(owner)
                .arg(ms(ttl))
                .arg(ms(ttl + FENCE_GRACE))
                .invoke_async(&mut con)
                .await
                .map_err(|e| map_err(name, e))?;
            match r.as_slice() {
                [1, token, count] => Ok(Acquired::Granted {
                    token: *token as u64,
                    count: (*count).clamp(0, u32::MAX as i64) as u32,
                }),
                [0, pttl] => Ok(Acquired::Busy {
                    remaining: (*pttl >= 0).then(|| Duration::from_millis(*pttl as u64)),
                }),
                other => Err(LockError::backend(
                    name,
                    format!("unexpected reply from the acquire script: {other:?}"),
                )),
            }
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
            let (mut con, _) = self.conn(name)?;
            let keys = redis_keys(name);
            let keep = keep_for.filter(|d| !d.is_zero()).map(ms).unwrap_or(0);
            let r: i64 = scripts::RELEASE
                .key(&keys.lock)
                .arg(owner)
                .arg(keep)
                .arg(&keys.channel)
                .arg(if all { 1 } else { 0 })
                .invoke_async(&mut con)
                .await
                .map_err(|e| map_err(name, e))?;
            Ok(match r {
                n if n < 0 => Released::NotOwner,
                0 => Released::Freed,
                n => Released::Decremented(n.min(u32::MAX as i64) as u32),
            })
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
            let r: i64 = scripts::EXTEND
                .key(&keys.lock)
                .arg(owner)
                .arg(ms(ttl))
                .invoke_async(&mut con)
                .await
                .map_err(|e| map_err(name, e))?;
            Ok(if r == 1 {
                Extended::Extended
            } else {
                Extended::Lost
            })
        })
    }

    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(async move {
            let (_, sub) = self.conn(name)?;
            let channel = redis_keys(name).channel;
            let mut watch = sub.queues.register(&channel);
            if self.inner.pubsub_refused.load(Ordering::Relaxed) {
                watch.set_fallback_only();
                return Ok(watch);
            }
            // Every registration asks the subscriber task, which answers at once when the channel
            // is already subscribed; this keeps "subscribed before we retry" true even while a
            // first waiter's SUBSCRIBE is still in flight.
            let (tx, rx) = oneshot::channel();
            if sub.ctl.send(Ctl::Subscribe(channel, tx)).is_err() {
                watch.set_fallback_only();
                return Ok(watch);
            }
            match rx.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    if is_refusal(&e) && !self.inner.pubsub_refused.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            url = %self.inner.url,
                            error = %e,
                            "dlock: Redis refused SUBSCRIBE (an ACL user needs `&dlock:*`, the server RESP3); waiters fall back to the holder's remaining lease"
                        );
                    }
                    watch.set_fallback_only();
                }
                Err(_) => watch.set_fallback_only(),
            }
            Ok(watch)
        })
    }

    fn has_waiters(&self, name: &str) -> bool {
        match self.conn(name) {
            Ok((_, sub)) => sub.queues.has_waiters(&redis_keys(name).channel),
            Err(_) => false,
        }
    }
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
