//! The Sentinel backend: one Redis master found through Redis Sentinel, followed across failovers.
//!
//! The master is looked up with `SENTINEL MASTER <name>` on every sentinel at once, and the
//! answer with the highest `config-epoch` wins (a sentinel that missed a failover, paused or cut
//! off, still names the old master under an older epoch: review redis-family #5). Every
//! sentinel's `+switch-master` channel is subscribed (RESP3 push, resubscribed after a
//! reconnect); a message, or a call that fails, makes the backend ask the sentinels again. It
//! moves to another master only when that answer's epoch is higher than the current master's and
//! the candidate itself answers `ROLE` as a master (never to a node that says it is a replica);
//! the composed [`RedisBackend`] is then swapped for one on the new master, and every local
//! waiter is woken so that it retries there, and woken again once its name is subscribed on the
//! new master (a release published in between is not slept through: review #7).
//!
//! With [`SentinelBuilder::min_replicas`], every grant is followed by `WAIT n timeout` on the
//! connection that wrote it; when fewer replicas confirm, the grant is given back and the acquire
//! fails with [`LockError::Backend`]. This narrows, but does not close, the window in which a
//! failover to a replica that missed the grant loses the lock (replication stays asynchronous).

pub(crate) mod admin;
mod semaphore;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ProtocolVersion, PushInfo, PushKind};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::redis::{RedisBackend, RedisBackendBuilder, unconfirmed};
use super::{Acquired, Backend, BoxFuture, Extended, Released, RwSide, Watch};
use crate::LockError;
use crate::wait::WaitQueues;

/// Settings of a [`SentinelBackend`]; start with [`SentinelBackend::builder`].
#[derive(Clone)]
pub struct SentinelBuilder {
    master_name: String,
    sentinels: Vec<String>,
    min_replicas: Option<(usize, Duration)>,
    username: Option<String>,
    password: Option<String>,
    db: i64,
    node: Arc<dyn Fn(RedisBackendBuilder) -> RedisBackendBuilder + Send + Sync>,
}

impl fmt::Debug for SentinelBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelBuilder")
            .field("master_name", &self.master_name)
            .field(
                "sentinels",
                &self
                    .sentinels
                    .iter()
                    .map(|u| super::redis::redact_url(u))
                    .collect::<Vec<_>>(),
            )
            .field("min_replicas", &self.min_replicas)
            .field("db", &self.db)
            .finish_non_exhaustive()
    }
}

impl SentinelBuilder {
    /// After every grant, `WAIT replicas timeout`, sent in one pipeline with the acquire script
    /// (so on the connection that wrote the grant): fewer confirmations give the lock back and
    /// fail the acquire with a [`LockError::Backend`]. The WAIT blocks the runtime's data
    /// connection to the master for up to `timeout`, and every call queued behind it waits too;
    /// keep `timeout` well below the master's response timeout (3 s by default), since a later
    /// reply fails the call with an unknown outcome. While a replica lags, a `Busy` answer also
    /// waits for the WAIT. It confirms grants only: renewals are not WAITed, so a failover right
    /// after a renewal that had not reached the replica leaves the new master with the lease of
    /// the renewal before, up to ttl/3 shorter than the holder's deadline.
    pub fn min_replicas(mut self, replicas: usize, timeout: Duration) -> Self {
        self.min_replicas = (replicas > 0).then_some((replicas, timeout));
        self
    }

    /// Credentials for the master (ACL user and password); the sentinels' own URLs carry theirs.
    pub fn master_auth(mut self, username: Option<&str>, password: &str) -> Self {
        self.username = username.map(str::to_string);
        self.password = Some(password.to_string());
        self
    }

    /// The database number on the master (default 0).
    pub fn db(mut self, db: i64) -> Self {
        self.db = db;
        self
    }

    /// Changes the settings of the master's [`RedisBackend`] (timeouts, retries).
    pub fn map_master(
        mut self,
        f: impl Fn(RedisBackendBuilder) -> RedisBackendBuilder + Send + Sync + 'static,
    ) -> Self {
        self.node = Arc::new(f);
        self
    }

    /// Finds the master through the sentinels, connects to it, and starts following failovers
    /// (the listener runs on the current tokio runtime).
    pub async fn connect(self) -> Result<SentinelBackend, LockError> {
        if self.sentinels.is_empty() {
            return Err(LockError::Config(
                "Sentinel needs at least one sentinel URL".into(),
            ));
        }
        let mut clients = Vec::new();
        for url in &self.sentinels {
            clients.push(redis::Client::open(url.as_str()).map_err(|e| {
                LockError::Config(format!(
                    "invalid sentinel URL {}: {e}",
                    super::redis::redact_url(url)
                ))
            })?);
        }
        let queues_cell: Arc<OnceLock<Weak<WaitQueues>>> = Arc::default();
        let proxies: Arc<Mutex<HashMap<String, Proxy>>> = Arc::default();
        let (p2, q2) = (proxies.clone(), queues_cell.clone());
        let queues = WaitQueues::with_on_empty(Some(Box::new(move |name: &str| {
            let mut map = p2.lock().unwrap_or_else(|e| e.into_inner());
            let still = q2
                .get()
                .and_then(Weak::upgrade)
                .is_some_and(|q| q.has_waiters(name));
            if !still && let Some(p) = map.remove(name) {
                p.stop.cancel();
            }
        })));
        let _ = queues_cell.set(Arc::downgrade(&queues));
        let (gen_tx, _) = tokio::sync::watch::channel(0u64);
        let inner = Arc::new(Inner {
            cfg: self,
            clients,
            current: RwLock::new(None),
            generation: gen_tx,
            queues,
            proxies,
            next_proxy: AtomicU64::new(0),
            last_refresh: Mutex::new(None),
        });
        let named = inner.resolve().await?;
        if inner.role_of(&named.addr).await == Role::Replica {
            return Err(LockError::backend(
                "",
                format!(
                    "the sentinels name {}:{} as the master {:?}, but it says it is a replica",
                    named.addr.0, named.addr.1, inner.cfg.master_name
                ),
            ));
        }
        inner.switch_to(&named, false)?;
        let master = inner.current();
        tokio::time::timeout(Duration::from_secs(2), master.backend.server_run_id())
            .await
            .map_err(|_| {
                LockError::backend("", format!("the master {:?} did not answer", master.addr))
            })??;
        start_listeners(&inner)?;
        Ok(SentinelBackend { inner })
    }
}

/// Locks in a Sentinel-managed Redis master, following failovers. Cheap to clone.
#[derive(Clone)]
pub struct SentinelBackend {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: SentinelBuilder,
    clients: Vec<redis::Client>,
    current: RwLock<Option<Arc<Current>>>,
    /// Bumped at every switch of master; waiting proxies re-subscribe on the new one.
    generation: tokio::sync::watch::Sender<u64>,
    queues: Arc<WaitQueues>,
    proxies: Arc<Mutex<HashMap<String, Proxy>>>,
    next_proxy: AtomicU64,
    last_refresh: Mutex<Option<Instant>>,
}

struct Current {
    addr: (String, u16),
    /// The sentinels' `config-epoch` for this master (only grows; see [`Inner::follow`]).
    epoch: AtomicU64,
    backend: RedisBackend,
}

/// One sentinel's answer: the master's address and its configuration epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Named {
    pub(crate) addr: (String, u16),
    pub(crate) epoch: u64,
}

/// Asks one sentinel for the master `master_name` (`SENTINEL MASTER <name>`), bounded by 1 s:
/// its address and the `config-epoch` of that answer.
pub(crate) async fn ask_sentinel(c: &redis::Client, master_name: &str) -> Result<Named, String> {
    let r = tokio::time::timeout(Duration::from_secs(1), async {
        let mut con = c.get_multiplexed_async_connection().await?;
        redis::cmd("SENTINEL")
            .arg("MASTER")
            .arg(master_name)
            .query_async::<Vec<String>>(&mut con)
            .await
    })
    .await;
    let fields = match r {
        Ok(Ok(f)) => f,
        Ok(Err(e)) if e.to_string().contains("No such master") => {
            return Err(format!(
                "a sentinel does not know a master named {:?}",
                master_name
            ));
        }
        Ok(Err(e)) => return Err(e.to_string()),
        Err(_) => return Err("no answer within 1 s".into()),
    };
    let field = |k: &str| {
        fields
            .chunks_exact(2)
            .find(|kv| kv[0] == k)
            .map(|kv| kv[1].as_str())
    };
    match (
        field("ip"),
        field("port").and_then(|p| p.parse::<u16>().ok()),
        field("config-epoch").and_then(|e| e.parse::<u64>().ok()),
    ) {
        (Some(ip), Some(port), Some(epoch)) => Ok(Named {
            addr: (ip.to_string(), port),
            epoch,
        }),
        _ => Err(format!("unexpected SENTINEL MASTER reply {fields:?}")),
    }
}

/// What a candidate master says of itself (`ROLE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Master,
    Replica,
    /// Not answered (refused by an ACL, unreachable, or an unexpected reply).
    Unknown,
}

struct Proxy {
    id: u64,
    stop: tokio_util::sync::CancellationToken,
    ready: tokio::sync::watch::Receiver<bool>,
}

impl fmt::Debug for SentinelBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelBackend")
            .field("master_name", &self.inner.cfg.master_name)
            .field("master", &self.inner.current().addr)
            .finish_non_exhaustive()
    }
}

impl SentinelBackend {
    /// Runs `call` on the current master's backend; a failed call makes the sentinels be asked
    /// again, so the next call goes to the master they name now.
    pub(super) async fn on_master<T, Fut>(
        &self,
        call: impl FnOnce(RedisBackend) -> Fut,
    ) -> Result<T, LockError>
    where
        Fut: std::future::Future<Output = Result<T, LockError>>,
    {
        let r = call(self.inner.current().backend.clone()).await;
        if r.is_err() {
            self.inner.refresh().await;
        }
        r
    }

    /// Starts building a backend for the master `master_name` watched by these sentinels
    /// (`redis://host:26379` URLs).
    pub fn builder<I, S>(master_name: &str, sentinel_urls: I) -> SentinelBuilder
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        SentinelBuilder {
            master_name: master_name.to_string(),
            sentinels: sentinel_urls
                .into_iter()
                .map(|s| s.as_ref().to_string())
                .collect(),
            min_replicas: None,
            username: None,
            password: None,
            db: 0,
            node: Arc::new(|b| b),
        }
    }

    /// Connects with default settings; see [`SentinelBackend::builder`].
    pub async fn connect<I, S>(master_name: &str, sentinel_urls: I) -> Result<Self, LockError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::builder(master_name, sentinel_urls).connect().await
    }

    /// The master in use now, as `host:port`.
    pub fn master_addr(&self) -> String {
        let c = self.inner.current();
        format!("{}:{}", c.addr.0, c.addr.1)
    }

    /// Number of local waiters on this backend.
    pub fn waiter_count(&self) -> usize {
        self.inner.queues.waiter_count()
    }
}

impl Inner {
    fn current(&self) -> Arc<Current> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .expect("a master is set before the backend is handed out")
    }

    fn master_url(&self, host: &str, port: u16) -> String {
        let auth = match (&self.cfg.username, &self.cfg.password) {
            (Some(u), Some(p)) => format!("{u}:{p}@"),
            (None, Some(p)) => format!(":{p}@"),
            _ => String::new(),
        };
        format!("redis://{auth}{host}:{port}/{}", self.cfg.db)
    }

    /// Asks every sentinel at once (each bounded by 1 s) and takes the answer with the highest
    /// `config-epoch`: a sentinel that missed a failover still names the old master, under an
    /// older epoch.
    async fn resolve(&self) -> Result<Named, LockError> {
        let answers = futures_util::future::join_all(
            self.clients
                .iter()
                .map(|c| ask_sentinel(c, &self.cfg.master_name)),
        )
        .await;
        let mut best: Option<Named> = None;
        let mut errs = Vec::new();
        for a in answers {
            match a {
                Ok(n) if best.as_ref().is_none_or(|b| n.epoch > b.epoch) => best = Some(n),
                Ok(_) => {}
                Err(e) => errs.push(e),
            }
        }
        best.ok_or_else(|| {
            LockError::backend(
                "",
                format!(
                    "no sentinel named the master {:?}: {}",
                    self.cfg.master_name,
                    errs.join("; ")
                ),
            )
        })
    }

    /// What the node at `addr` says it is (`ROLE`, bounded by 1 s).
    async fn role_of(&self, addr: &(String, u16)) -> Role {
        let Ok(client) = redis::Client::open(self.master_url(&addr.0, addr.1)) else {
            return Role::Unknown;
        };
        let r = tokio::time::timeout(Duration::from_secs(1), async {
            let mut con = client.get_multiplexed_async_connection().await?;
            redis::cmd("ROLE")
                .query_async::<redis::Value>(&mut con)
                .await
        })
        .await;
        let role = match r {
            Ok(Ok(redis::Value::Array(v))) => match v.first() {
                Some(redis::Value::BulkString(b)) => b.clone(),
                Some(redis::Value::SimpleString(s)) => s.clone().into_bytes(),
                _ => Vec::new(),
            },
            _ => Vec::new(),
        };
        match role.as_slice() {
            b"master" => Role::Master,
            b"slave" | b"replica" => Role::Replica,
            _ => Role::Unknown,
        }
    }

    /// Asks the sentinels (after a `+switch-master` or a failed call) and moves to the master
    /// they name when it is newer than the current one: a higher `config-epoch` and a `ROLE`
    /// that is not replica. An older epoch is a sentinel that missed a failover and is ignored,
    /// unless the current master itself now says it is a replica and the named one says master
    /// (the sentinels' configuration was reset, which restarts epochs).
    async fn follow(&self) {
        let named = match self.resolve().await {
            Ok(n) => n,
            Err(e) => {
                tracing::debug!(error = %e, "dlock: cannot ask the sentinels for the master");
                return;
            }
        };
        let cur = self.current();
        let cur_epoch = cur.epoch.load(Ordering::Acquire);
        if named.addr == cur.addr {
            cur.epoch.fetch_max(named.epoch, Ordering::AcqRel);
            return;
        }
        let force = if named.epoch > cur_epoch {
            false
        } else if self.role_of(&cur.addr).await == Role::Replica
            && self.role_of(&named.addr).await == Role::Master
        {
            true
        } else {
            tracing::debug!(
                master = %self.cfg.master_name,
                named = %format!("{}:{}", named.addr.0, named.addr.1),
                epoch = named.epoch,
                current_epoch = cur_epoch,
                "dlock: the sentinels that answered name an older master; staying"
            );
            return;
        };
        if !force && self.role_of(&named.addr).await == Role::Replica {
            tracing::debug!(
                master = %self.cfg.master_name,
                named = %format!("{}:{}", named.addr.0, named.addr.1),
                "dlock: the master the sentinels name says it is a replica; staying"
            );
            return;
        }
        if let Err(e) = self.switch_to(&named, force) {
            tracing::warn!(error = %e, "dlock: cannot follow the Sentinel failover");
        }
    }

    /// Uses the master `named` from now on: a no-op when it is the current one, or (unless
    /// `force`) when its epoch is not higher than the current master's (checked again here, under
    /// the lock, against a concurrent switch).
    fn switch_to(&self, named: &Named, force: bool) -> Result<bool, LockError> {
        let addr = &named.addr;
        let mut cur = self.current.write().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = cur.as_ref() {
            if &c.addr == addr {
                c.epoch.fetch_max(named.epoch, Ordering::AcqRel);
                return Ok(false);
            }
            if !force && named.epoch <= c.epoch.load(Ordering::Acquire) {
                return Ok(false);
            }
        }
        let url = self.master_url(&addr.0, addr.1);
        let backend = (self.cfg.node)(RedisBackend::builder(url)).build()?;
        let old = cur.replace(Arc::new(Current {
            addr: addr.clone(),
            epoch: AtomicU64::new(named.epoch),
            backend,
        }));
        drop(cur);
        if let Some(old) = old {
            tracing::warn!(
                master = %self.cfg.master_name,
                from = %format!("{}:{}", old.addr.0, old.addr.1),
                to = %format!("{}:{}", addr.0, addr.1),
                epoch = named.epoch,
                "dlock: Sentinel switched the master; following it"
            );
            self.generation.send_modify(|g| *g += 1);
            self.queues.wake_all();
        }
        Ok(true)
    }

    /// After a failed call: ask the sentinels again (at most every 200 ms).
    async fn refresh(&self) {
        {
            let mut last = self.last_refresh.lock().unwrap_or_else(|e| e.into_inner());
            if last.is_some_and(|t| t.elapsed() < Duration::from_millis(200)) {
                return;
            }
            *last = Some(Instant::now());
        }
        self.follow().await;
    }

    async fn acquire(&self, name: &str, owner: &str, ttl: Duration) -> Result<Acquired, LockError> {
        let backend = self.current().backend.clone();
        // WAIT goes in one pipeline with the script, on the connection that wrote the grant.
        let r = backend
            .acquire_then_wait(name, owner, ttl, self.cfg.min_replicas)
            .await;
        let (r, acked) = match r {
            Err(e) => {
                self.refresh().await;
                return Err(e);
            }
            Ok(r) => r,
        };
        if let (Acquired::Granted { count, .. }, Some(wait)) = (r, self.cfg.min_replicas)
            && let Some(e) = unconfirmed(name, acked, wait, "grant")
        {
            // Give back what this call added (a fresh grant entirely, a re-entry one hold).
            let _ = backend.release(name, owner, None, count <= 1).await;
            return Err(e);
        }
        Ok(r)
    }
}

/// Subscribes to `+switch-master` on every sentinel; a message naming our master switches to it.
fn start_listeners(inner: &Arc<Inner>) -> Result<(), LockError> {
    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    for c in &inner.clients {
        let info = c.get_connection_info().clone();
        let resp3 = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let client = redis::Client::open(info.set_redis_settings(resp3))
            .map_err(|e| LockError::Config(format!("sentinel client: {e}")))?;
        let tx = tx.clone();
        let push = move |p: PushInfo| -> Result<(), ()> {
            if p.kind == PushKind::Message
                && let Some(redis::Value::BulkString(payload)) = p.data.get(1)
                && let Ok(s) = std::str::from_utf8(payload)
            {
                tx.send(s.to_string()).map_err(|_| ())?;
            }
            Ok(())
        };
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(Duration::from_secs(2)))
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_number_of_retries(usize::MAX)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(500))
            .set_push_sender(push)
            .set_automatic_resubscription();
        let weak = Arc::downgrade(inner);
        let mut m = ConnectionManager::new_lazy_with_config(client, config)
            .map_err(|e| LockError::Config(format!("sentinel client: {e}")))?;
        tokio::spawn(async move {
            // Keep trying to subscribe while the backend lives (a sentinel may be down now);
            // after that the manager resubscribes by itself after reconnects.
            let mut subscribed = false;
            loop {
                if weak.strong_count() == 0 {
                    return;
                }
                if !subscribed {
                    subscribed =
                        tokio::time::timeout(Duration::from_secs(2), m.subscribe("+switch-master"))
                            .await
                            .is_ok_and(|r| r.is_ok());
                }
                tokio::time::sleep(Duration::from_millis(if subscribed { 1000 } else { 500 }))
                    .await;
            }
        });
    }
    drop(tx);
    let weak = Arc::downgrade(inner);
    let master = inner.cfg.master_name.clone();
    tokio::spawn(async move {
        while let Some(msg) = rx.recv().await {
            // "<master-name> <old-ip> <old-port> <new-ip> <new-port>": only the name is used;
            // the sentinels are asked again, so that the highest epoch wins (a sentinel that
            // catches up late publishes this too, and a forged or stale message moves nothing).
            let parts: Vec<&str> = msg.split_whitespace().collect();
            let [name, _, _, _, _] = parts.as_slice() else {
                continue;
            };
            if *name != master {
                continue;
            }
            let Some(inner) = weak.upgrade() else { return };
            inner.follow().await;
        }
    });
    Ok(())
}

/// One subscription on the current master per waited-on name; re-subscribed after a switch.
async fn run_proxy(
    inner: Arc<Inner>,
    name: String,
    id: u64,
    stop: tokio_util::sync::CancellationToken,
    ready: tokio::sync::watch::Sender<bool>,
) {
    struct Cleanup<'a>(&'a Inner, &'a str, u64);
    impl Drop for Cleanup<'_> {
        fn drop(&mut self) {
            let mut map = self.0.proxies.lock().unwrap_or_else(|e| e.into_inner());
            if map.get(self.1).is_some_and(|p| p.id == self.2) {
                map.remove(self.1);
            }
        }
    }
    let _cleanup = Cleanup(&inner, &name, id);
    let mut gen_rx = inner.generation.subscribe();
    // Whether waiters may have missed a release since the last confirmed subscription: after a
    // switch of master (they were woken by `switch_to` and retried before this proxy subscribed
    // on the new one) or while the master's subscription was not confirmed. Once it is, they are
    // woken again (review redis-family #7; the single-node backend's `stale` set).
    let mut stale = false;
    let mut backoff = RESUBSCRIBE_BACKOFF_MIN;
    loop {
        let generation = *gen_rx.borrow_and_update();
        let backend = inner.current().backend.clone();
        let w = tokio::select! {
            _ = stop.cancelled() => return,
            w = backend.watch(&name) => w,
        };
        let _ = ready.send(true);
        let Ok(w) = w else {
            stale = true;
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = gen_rx.changed() => {}
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(RESUBSCRIBE_BACKOFF_MAX);
            continue;
        };
        if w.is_fallback_only() {
            // Not subscribed on the master (yet): its backend wakes this watch once the channel
            // is confirmed; asked again after a back-off too (a refusal is not retried there).
            stale = true;
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = gen_rx.changed() => {}
                _ = w.woken() => {}
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(RESUBSCRIBE_BACKOFF_MAX);
            continue;
        }
        backoff = RESUBSCRIBE_BACKOFF_MIN;
        // `stale` is set again below before the next watch: the loop leaves only on a switch.
        if stale && *gen_rx.borrow() == generation {
            tracing::debug!(key = %name, "dlock: subscribed on the current master again; waking its waiters");
            wake_all_of(&inner.queues, &name);
        }
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = gen_rx.changed() => {
                    stale = true;
                    break;
                }
                _ = w.woken() => { inner.queues.wake_one(&name); }
            }
        }
    }
}

/// Back-off of a proxy whose subscription on the master is not confirmed.
const RESUBSCRIBE_BACKOFF_MIN: Duration = Duration::from_millis(100);
const RESUBSCRIBE_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Wakes every waiter of `key` (bounded by the number of waiters now, so that waiters that
/// re-register meanwhile do not keep it going).
fn wake_all_of(queues: &WaitQueues, key: &str) {
    for _ in 0..queues.waiter_count() {
        if !queues.wake_one(key) {
            break;
        }
    }
}

impl Backend for SentinelBackend {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(self.inner.acquire(name, owner, ttl))
    }

    /// Not with `min_replicas`: a fair grant is not followed by `WAIT` yet.
    fn supports_fair(&self) -> bool {
        self.inner.cfg.min_replicas.is_none()
    }

    fn try_acquire_fair<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
        heartbeat: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(async move {
            if self.inner.cfg.min_replicas.is_some() {
                // The fair try sends no WAIT behind its grant.
                return Err(LockError::unsupported(name, "fair locks with min_replicas"));
            }
            self.on_master(|b| async move { b.try_acquire_fair(name, owner, ttl, heartbeat).await })
                .await
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
            self.on_master(|b| async move { b.release(name, owner, keep_for, all).await })
                .await
        })
    }

    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(async move {
            self.on_master(|b| async move { b.extend(name, owner, ttl).await })
                .await
        })
    }

    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(async move {
            let inner = &self.inner;
            let (mut watch, mut ready) = {
                let mut map = inner.proxies.lock().unwrap_or_else(|e| e.into_inner());
                let watch = inner.queues.register(name);
                let ready = match map.get(name) {
                    Some(p) => p.ready.clone(),
                    None => {
                        let id = inner.next_proxy.fetch_add(1, Ordering::Relaxed);
                        let stop = tokio_util::sync::CancellationToken::new();
                        let (tx, rx) = tokio::sync::watch::channel(false);
                        map.insert(
                            name.to_string(),
                            Proxy {
                                id,
                                stop: stop.clone(),
                                ready: rx.clone(),
                            },
                        );
                        tokio::spawn(run_proxy(inner.clone(), name.to_string(), id, stop, tx));
                        rx
                    }
                };
                (watch, ready)
            };
            let r = tokio::time::timeout(Duration::from_secs(3), ready.wait_for(|v| *v)).await;
            if !matches!(r, Ok(Ok(_))) {
                watch.set_fallback_only();
            }
            Ok(watch)
        })
    }

    fn has_waiters(&self, name: &str) -> bool {
        self.inner.queues.has_waiters(name)
    }

    // Semaphores: `sentinel/semaphore.rs`.
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

    // Read-write locks: the Redis script on the current master (a failed call asks the
    // sentinels again). Waiting subscribes on the master of the moment and does not follow a
    // failover: waiters then retry by the leases (README, engine table).

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
        Box::pin(async move {
            self.on_master(|b| async move { b.rw_try_acquire(side, name, owner, ttl).await })
                .await
        })
    }

    fn rw_release<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        Box::pin(async move {
            self.on_master(|b| async move { b.rw_release(side, name, owner, all).await })
                .await
        })
    }

    fn rw_extend<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(async move {
            self.on_master(|b| async move { b.rw_extend(side, name, owner, ttl).await })
                .await
        })
    }

    fn rw_downgrade<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<u64>, LockError>> {
        Box::pin(async move {
            self.on_master(|b| async move { b.rw_downgrade(name, owner, ttl).await })
                .await
        })
    }

    fn rw_watch<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(async move {
            let b = self.inner.current().backend.clone();
            b.rw_watch(side, name).await
        })
    }

    fn rw_has_waiters(&self, side: RwSide, name: &str) -> bool {
        self.inner.current().backend.rw_has_waiters(side, name)
    }

    fn put_record<'a>(
        &'a self,
        name: &'a str,
        epoch: u64,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            self.on_master(|b| async move { b.put_record(name, epoch, value).await })
                .await
        })
    }

    fn get_record<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<crate::backend::Record>, LockError>> {
        Box::pin(async move {
            self.on_master(|b| async move { b.get_record(name).await })
                .await
        })
    }
}

/// Finds the master `master_name` through the sentinels and registers it under `name`
/// (replacing what was there); failovers are followed. `sentinel_urls` is any iterable of URL
/// strings such as `&["redis://127.0.0.1:26379", ...]`. For `min_replicas` and the other knobs,
/// use [`SentinelBackend::builder`] and [`crate::register`].
pub async fn init_sentinel<I, S>(
    name: &str,
    master_name: &str,
    sentinel_urls: I,
) -> Result<(), LockError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let backend = SentinelBackend::connect(master_name, sentinel_urls).await?;
    tracing::info!(backend = name, master = %backend.master_addr(), "dlock: Sentinel backend registered");
    crate::register(name, backend);
    Ok(())
}
