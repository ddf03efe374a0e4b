//! The etcd backend: a key per contender under a lease, the lowest create revision holds.
//!
//! Layout: `<prefix>/<escaped name>/<lease id hex>-<16 random hex>`, value = the owner id, a newline and the holder
//! identity `name@host:pid`.
//!
//! - **Leases: one per backend and whole-second ttl**, shared by every key this backend creates
//!   with that ttl (`ceil(ttl)` seconds, at least 1). Why not one per backend: a lock's ttl is the
//!   promise the guard keeps (its deadline is `send time + ttl` after each renewal), so the lease
//!   behind it must last at least that long after a renewal, and a crashed holder should free the
//!   name after its ttl, as on Redis. Why not one per guard: a grant per acquisition and a revoke
//!   per release would make an uncontended acquisition three requests instead of two. In
//!   practice an application uses one or two ttls, so this is one lease (or two) per process.
//!   A lease is granted on first use, kept alive by a background task every third of its ttl
//!   while any key uses it, and revoked after it has been unused for one ttl. A key put under a
//!   shared lease does not renew it: a try whose send time + ttl is not covered by the lease's
//!   last confirmed keep-alive sends one more keep-alive with its create (or re-check), so a
//!   grant's deadline never outlives the lease on the server. Each lease carries a sentinel key
//!   (`<prefix>/.leases/<id hex>`), watched: its delete (an operator's revoke, an expiry) ends
//!   the lease here at once, and every hold on it hears `lost()` through `lost_signal`.
//! - `try_acquire` creates the caller's key in one transaction: if absent, put it under the
//!   lease and read the two newest keys of the name (its own and its predecessor). Alone: the
//!   lock is granted. Its **fencing token** is `max(last + 1, client µs)` (issue 18's token
//!   rule), `last` kept in the name's fence key (`<prefix>/.fence/<escaped name>`, on no lease),
//!   written before the guard is returned: by a transaction nested in the create when the name
//!   had no key and the fence is below the floor (no extra request), else by one more
//!   transaction comparing the fence's mod revision (see [`Inner::write_fence`]). Only a grant
//!   writes the fence, so tokens strictly increase per name across holders and restarts; the
//!   floor, the client's clock (etcd's API has no server clock), matters only when a name moves
//!   between engines. Otherwise the contender
//!   stays queued and watches **its predecessor only** (the key with the largest create revision
//!   below its own, as etcd's `concurrency.Mutex` does): one notification per release. The next
//!   try re-checks in one read-only transaction (own key still there? predecessor left?).
//! - `release` deletes the key (after `keep_for` when given); a queued contender's key (a wait
//!   that ended) is deleted too. A create whose reply was lost is cancelled by its name, which
//!   the client chose before sending, in one transaction with a cancel marker that the create
//!   compares against (the marker stays until its lease ends), so it leaves no orphan.
//! - **Guaranteed deletes (issue 17).** A released or given-up key goes to a to-delete set and
//!   its delete runs on the driver thread (a caller's runtime that shuts down cannot cut it
//!   off). It is forgotten only once the server confirmed it gone (deleted, not found, or its
//!   lease ended). A delete that is not confirmed makes `release` an error (never `NotOwner`)
//!   and the key an orphan, retried by a reaper with back-off (50 ms doubling to 1 s). Its
//!   lease is tainted (no new keys on it) and, once it has no users left, retired (no more
//!   keep-alives) and revoked, which ends the orphan.
//! - `extend` refreshes the lease with one keep-alive and checks that the key is still there
//!   (both at once). A revoked or expired lease, or a deleted key, answers `Lost`; a server that
//!   does not answer makes the guard's own deadline (`ttl` from the last confirmed renewal, never
//!   later than the lease on the server) fire `lost()`.
//! - Every request is bounded by the request timeout and by the lease's ttl.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use etcd_client as etcd;
use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::driver::Driver;
use super::{Acquired, Backend, BoxFuture, Extended, Released, RwSide, Watch};
use crate::LockError;
use crate::wait::WaitQueues;

pub(crate) mod admin;
mod queue;

use queue::{QHold, Space};

/// The default key prefix of the lock keys.
pub(crate) const DEFAULT_PREFIX: &str = "/dlock";

/// Builder of an [`EtcdBackend`].
#[derive(Clone)]
pub struct EtcdBackendBuilder {
    endpoints: Vec<String>,
    prefix: String,
    request_timeout: Duration,
    connect_timeout: Duration,
    user: Option<(String, String)>,
    #[cfg(feature = "tls")]
    tls: Option<etcd::TlsOptions>,
}

impl std::fmt::Debug for EtcdBackendBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdBackendBuilder")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("request_timeout", &self.request_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .finish_non_exhaustive()
    }
}

impl EtcdBackendBuilder {
    /// Key prefix of the lock keys (default `/dlock`).
    pub fn prefix(mut self, prefix: &str) -> Self {
        self.prefix = prefix.trim_end_matches('/').to_string();
        self
    }

    /// Bound of every request to the server (default 5 s; a request is also never allowed to
    /// outlast the lease it works for).
    pub fn request_timeout(mut self, t: Duration) -> Self {
        self.request_timeout = t;
        self
    }

    /// Bound of connecting (default 5 s).
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t;
        self
    }

    /// etcd authentication (user and password).
    pub fn user(mut self, name: &str, password: &str) -> Self {
        self.user = Some((name.to_string(), password.to_string()));
        self
    }

    /// TLS with this CA certificate (PEM) for `https://` endpoints (feature `tls`).
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls_ca_pem(mut self, pem: &[u8]) -> Self {
        let ca = etcd::Certificate::from_pem(pem);
        self.tls = Some(self.tls.take().unwrap_or_default().ca_certificate(ca));
        self
    }

    /// A client certificate and its private key (PEM) for servers that require one (etcd's
    /// `--client-cert-auth`; feature `tls`). Combine with [`Self::tls_ca_pem`].
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls_identity_pem(mut self, cert_pem: &[u8], key_pem: &[u8]) -> Self {
        let id = etcd::Identity::from_pem(cert_pem, key_pem);
        self.tls = Some(self.tls.take().unwrap_or_default().identity(id));
        self
    }

    /// Connects: the same as [`Self::build`], under the name every other engine's builder
    /// uses (`PostgresBackend::builder(url)..connect()`, `RedisBackend::builder(url)..connect()`).
    pub async fn connect(self) -> Result<EtcdBackend, LockError> {
        self.build().await
    }

    /// Connects (bounded by the connect timeout) and checks that the cluster answers.
    pub async fn build(self) -> Result<EtcdBackend, LockError> {
        if !self.prefix.starts_with('/') || self.prefix.len() < 2 {
            return Err(LockError::Config(format!(
                "etcd key prefix must start with `/` and not be `/` alone, got {:?}",
                self.prefix
            )));
        }
        if self.endpoints.is_empty() {
            return Err(LockError::Config("etcd: no endpoint given".into()));
        }
        let mut opts = etcd::ConnectOptions::new()
            .with_connect_timeout(self.connect_timeout)
            .with_timeout(self.request_timeout)
            .with_keep_alive(Duration::from_secs(2), self.request_timeout)
            .with_require_leader(true);
        if let Some((u, p)) = &self.user {
            // Tokens expire (etcd's `--auth-token-ttl`, 5 min by default): get a new one then.
            opts = opts
                .with_user(u.clone(), p.clone())
                .with_auto_token_refresh(true);
        }
        #[cfg(feature = "tls")]
        if let Some(t) = &self.tls {
            opts = opts.with_tls(t.clone());
        }
        let bound = self.connect_timeout.max(self.request_timeout);
        let eps = self.endpoints.clone();
        // The client's channel (its tonic workers and connections) lives on the backend's own
        // driver thread, not on the caller's runtime: see [`Driver`].
        let driver = Driver::start("dlock-etcd")?;
        let connect = driver.handle.spawn(async move {
            tokio::time::timeout(bound, etcd::Client::connect(eps, Some(opts))).await
        });
        let mut client = match connect.await {
            Ok(Ok(Ok(c))) => c,
            Ok(Ok(Err(e))) => return Err(be("", e)),
            Ok(Err(_)) => return Err(be("", "connecting to etcd timed out")),
            Err(e) => return Err(be("", e)),
        };
        // One read, so a wrong address or credentials fail here rather than at the first lock.
        // A key inside the prefix: a user whose role grants only the prefix may read it.
        match tokio::time::timeout(
            bound,
            client.get(
                format!("{}/", self.prefix),
                Some(GetOptions::new().with_count_only()),
            ),
        )
        .await
        {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(be("", e)),
            Err(_) => return Err(be("", "etcd did not answer within the timeout")),
        }
        Ok(EtcdBackend {
            inner: Arc::new_cyclic(|this| Inner {
                this: this.clone(),
                cfg: self,
                client,
                driver,
                holds: Mutex::new(HashMap::new()),
                qholds: Mutex::new(HashMap::new()),
                sem_waiters: WaitQueues::new(),
                read_waiters: WaitQueues::new(),
                write_waiters: WaitQueues::new(),
                deleting: Mutex::new(HashMap::new()),
                leases: Mutex::new(HashMap::new()),
                waiters: WaitQueues::new(),
                notifications: AtomicU64::new(0),
                requests: AtomicU64::new(0),
            }),
        })
    }
}

fn be(key: &str, e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> LockError {
    LockError::Backend {
        key: key.to_string(),
        source: e.into(),
    }
}

/// One lease shared by the keys of one whole-second ttl.
#[derive(Debug)]
struct Lease {
    id: i64,
    secs: i64,
    /// Revoked, not found, not confirmed within its ttl, or retired (see [`Inner::retire`]):
    /// no new key goes on it; its keys are gone or going.
    dead: AtomicBool,
    /// The server confirmed it gone (revoked, expired, "lease not found"): so are its keys.
    ended: AtomicBool,
    /// Cancelled when the lease is found dead: the lost signal of the holds on it.
    lost: CancellationToken,
    /// Keys (held, queued, or being deleted for the first time) of this backend attached to it.
    users: Mutex<usize>,
    /// Keys whose delete was not confirmed, retried by the reaper. A lease with orphans is
    /// tainted: no new key goes on it, and once it has no users it is revoked, which ends them.
    orphans: AtomicUsize,
    /// Send time of the latest grant or keep-alive the server confirmed: the lease lives on the
    /// server at least until this plus `secs`.
    confirmed: Mutex<Instant>,
}

impl Lease {
    fn new(id: i64, secs: i64, granted: Instant) -> Lease {
        Lease {
            id,
            secs,
            confirmed: Mutex::new(granted),
            dead: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            lost: CancellationToken::new(),
            users: Mutex::new(1),
            orphans: AtomicUsize::new(0),
        }
    }

    fn users(&self) -> MutexGuard<'_, usize> {
        self.users.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A keep-alive sent at `sent` was confirmed.
    fn confirm(&self, sent: Instant) {
        let mut c = self.confirmed.lock().unwrap_or_else(|e| e.into_inner());
        *c = (*c).max(sent);
    }

    /// True when the lease is known to live on the server until at least `at + ttl`.
    fn covers(&self, at: Instant, ttl: Duration) -> bool {
        let c = *self.confirmed.lock().unwrap_or_else(|e| e.into_inner());
        c + Duration::from_secs(self.secs as u64) >= at + ttl
    }

    /// No longer usable; the holds on it hear `lost()`.
    fn kill(&self) {
        self.dead.store(true, Ordering::Release);
        self.lost.cancel();
    }

    /// The server said it is gone (so are its keys).
    fn end(&self) {
        self.ended.store(true, Ordering::Release);
        self.kill();
    }

    fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    fn usable(&self) -> bool {
        !self.dead.load(Ordering::Acquire) && self.orphans.load(Ordering::Acquire) == 0
    }
}

/// A key being deleted (a released or given-up contender), kept until the server confirms it
/// gone (deleted, not found, or its lease ended): the to-delete set.
#[derive(Debug)]
struct Deleting {
    /// `None` for a lock's key, else the semaphore's or read-write lock's space.
    space: Option<Space>,
    name: String,
    owner: String,
    lease: Arc<Lease>,
    /// 0 when its create's outcome is unknown: then it is cancelled with a marker.
    rev: i64,
    /// It held the lock when its release began.
    held: bool,
    /// Its first delete was not confirmed: it is counted in the lease's `orphans` (no longer in
    /// `users`), and the reaper retries it with back-off.
    orphan: bool,
}

/// What one delete attempt needs of a [`Deleting`].
struct DeleteJob {
    name: String,
    key: String,
    lease: Arc<Lease>,
    rev: i64,
}

#[derive(Debug)]
struct Hold {
    key: String,
    lease: Arc<Lease>,
    /// Create revision of the key (0 while the create's reply is unknown).
    rev: i64,
    /// The fencing token of the grant (0 until granted).
    token: u64,
    held: bool,
    count: u32,
    /// The armed watch on the predecessor.
    watching: Option<PredWatch>,
}

#[derive(Debug)]
struct PredWatch {
    pred: String,
    task: tokio::task::AbortHandle,
    /// Set when the predecessor was deleted (or the watch ended): only then is a re-check
    /// worth a request. Until then a try answers Busy locally.
    fired: Arc<AtomicBool>,
}

struct Inner {
    cfg: EtcdBackendBuilder,
    client: etcd::Client,
    /// The thread whose runtime runs the client's channel and this backend's own tasks (see
    /// [`Driver`]).
    driver: Driver,
    holds: Mutex<HashMap<(String, String), Hold>>,
    /// Semaphore and read-write entries (see [`queue`]), by (space, name, owner).
    qholds: Mutex<HashMap<(Space, String, String), QHold>>,
    /// Local waiters for permits, and for each side of read-write locks.
    sem_waiters: Arc<WaitQueues>,
    read_waiters: Arc<WaitQueues>,
    write_waiters: Arc<WaitQueues>,
    /// Keys being deleted, by key (see [`Deleting`]).
    deleting: Mutex<HashMap<String, Deleting>>,
    leases: Mutex<HashMap<i64, Arc<Lease>>>,
    waiters: Arc<WaitQueues>,
    notifications: AtomicU64,
    requests: AtomicU64,
    /// This backend's own `Arc` (for tasks it spawns).
    this: std::sync::Weak<Inner>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("cfg", &self.cfg)
            .field("leases", &self.leases().len())
            .field("holds", &self.holds().len())
            .finish_non_exhaustive()
    }
}

/// Locks on etcd (feature `etcd`). See the module documentation for the protocol.
#[derive(Debug, Clone)]
pub struct EtcdBackend {
    inner: Arc<Inner>,
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

/// `(user, password)` and the endpoints of `etcd://[user:password@]host:port[,host:port...]`.
/// Errors never contain the password.
pub(crate) type ParsedUrl<'a> = (Option<(String, String)>, Vec<&'a str>);

/// Splits an `etcd://` URL (see [`EtcdBackend::connect`]).
pub(crate) fn parse_url(url: &str) -> Result<ParsedUrl<'_>, LockError> {
    let rest = url
        .strip_prefix("etcd://")
        .ok_or_else(|| LockError::Config("an etcd URL starts with etcd://".to_string()))?;
    let rest = rest.trim_end_matches('/');
    let (userinfo, hosts) = match rest.rfind('@') {
        Some(at) => match rest[..at].split_once(':') {
            Some((u, p)) if !u.is_empty() => (
                Some((
                    super::url_decode(u, "user")?,
                    super::url_decode(p, "password")?,
                )),
                &rest[at + 1..],
            ),
            _ => {
                return Err(LockError::Config(
                    "the user part of an etcd URL must be `user:password@`".to_string(),
                ));
            }
        },
        None => (None, rest),
    };
    Ok((
        userinfo,
        hosts.split(',').filter(|s| !s.is_empty()).collect(),
    ))
}

fn lease_secs(ttl: Duration) -> i64 {
    let s = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    s.clamp(1, i64::MAX as u64) as i64
}

impl EtcdBackend {
    /// A builder for these endpoints (`host:port` or `http(s)://host:port`).
    pub fn builder<S: AsRef<str>>(endpoints: &[S]) -> EtcdBackendBuilder {
        EtcdBackendBuilder {
            endpoints: endpoints.iter().map(|e| e.as_ref().to_string()).collect(),
            prefix: DEFAULT_PREFIX.to_string(),
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            user: None,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }

    /// Connects to `etcd://[user:password@]host:port[,host:port...]` with the default
    /// settings; `user:password` is [`EtcdBackendBuilder::user`].
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        let (userinfo, eps) = parse_url(url)?;
        let mut b = Self::builder(&eps);
        if let Some((u, p)) = userinfo {
            b = b.user(&u, &p);
        }
        b.build().await
    }

    /// The key prefix of `name`'s contender keys (ends with `/`).
    pub fn lock_prefix(&self, name: &str) -> String {
        self.inner.lock_prefix(name)
    }

    /// The client this backend uses (for inspection and tools).
    pub fn client(&self) -> etcd::Client {
        self.inner.client.clone()
    }

    /// Predecessor-watch notifications this backend received so far: one per release that
    /// unblocks one of its contenders (no herd).
    pub fn watch_notifications(&self) -> u64 {
        self.inner.notifications.load(Ordering::Relaxed)
    }

    /// Requests sent to etcd by lock operations so far (acquire, re-check, watch, release,
    /// extend; not the background lease keep-alives).
    pub fn requests(&self) -> u64 {
        self.inner.requests.load(Ordering::Relaxed)
    }

    /// Number of callers waiting in this process.
    pub fn waiter_count(&self) -> usize {
        self.inner.waiters.waiter_count()
    }

    /// Ids of the leases this backend currently keeps alive.
    pub fn lease_ids(&self) -> Vec<i64> {
        self.inner.leases().keys().copied().collect()
    }
}

impl Inner {
    fn me(&self) -> Option<Arc<Inner>> {
        self.this.upgrade()
    }

    fn holds(&self) -> MutexGuard<'_, HashMap<(String, String), Hold>> {
        self.holds.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn leases(&self) -> MutexGuard<'_, HashMap<i64, Arc<Lease>>> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_prefix(&self, name: &str) -> String {
        format!("{}/{}/", self.cfg.prefix, escape(name))
    }

    fn bound(&self, ttl: Duration) -> Duration {
        self.cfg
            .request_timeout
            .min(ttl.max(Duration::from_millis(100)))
    }

    fn deleting(&self) -> MutexGuard<'_, HashMap<String, Deleting>> {
        self.deleting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One request that is not idempotent, bounded by `bound` in total. Retried (within the
    /// bound, with a short back-off) only after an error that means it was not applied: no
    /// connection (nothing sent), or refused before it was proposed ("no leader", "leader
    /// changed", "too many requests", a dropped proposal). Any other error leaves the outcome
    /// unknown and is returned (rule 1: never re-send a call that is not idempotent).
    async fn call<T, F, Fut>(&self, key: &str, bound: Duration, f: F) -> Result<T, LockError>
    where
        F: FnMut(etcd::Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd::Error>>,
    {
        self.call_with(key, bound, not_applied, f).await
    }

    /// One idempotent request (a read, a delete of this backend's own key, a cancel marker,
    /// a revoke), retried within `bound` after any transient error.
    async fn call_idem<T, F, Fut>(&self, key: &str, bound: Duration, f: F) -> Result<T, LockError>
    where
        F: FnMut(etcd::Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd::Error>>,
    {
        self.call_with(key, bound, transient, f).await
    }

    async fn call_with<T, F, Fut>(
        &self,
        key: &str,
        bound: Duration,
        retry: fn(&etcd::Error) -> bool,
        mut f: F,
    ) -> Result<T, LockError>
    where
        F: FnMut(etcd::Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd::Error>>,
    {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let deadline = Instant::now() + bound;
        let mut pause = RETRY_PAUSE;
        loop {
            match tokio::time::timeout_at(deadline, f(self.client.clone())).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(e)) if retry(&e) && Instant::now() + pause < deadline => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RETRY_PAUSE_MAX);
                }
                Ok(Err(e)) => return Err(be(key, e)),
                Err(_) => return Err(be(key, "etcd request timed out")),
            }
        }
    }

    /// Deletes one of this backend's own lock keys; true when it is gone by this call. A delete
    /// of a key is idempotent, so it is retried within `bound` after any transient error, also
    /// when the request may have been applied (a member killed mid-call): a retry that then
    /// finds nothing to delete counts as deleted, as only this backend writes the key and its
    /// lease's end would have made the hold lost.
    async fn delete_own_key(
        &self,
        name: &str,
        key: &str,
        bound: Duration,
    ) -> Result<bool, LockError> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let deadline = Instant::now() + bound;
        let mut maybe_applied = false;
        let mut pause = RETRY_PAUSE;
        loop {
            let mut c = self.client.clone();
            match tokio::time::timeout_at(deadline, c.delete(key, None)).await {
                Ok(Ok(d)) => return Ok(d.deleted() > 0 || maybe_applied),
                Ok(Err(e)) if transient(&e) && Instant::now() + pause < deadline => {
                    maybe_applied |= !not_applied(&e);
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RETRY_PAUSE_MAX);
                }
                Ok(Err(e)) => return Err(be(name, e)),
                Err(_) => return Err(be(name, "etcd request timed out")),
            }
        }
    }

    /// One attempt (bounded by the request timeout and the lease's ttl) to make a to-delete
    /// key gone for good: a delete by key, or for a key whose create's outcome is unknown, the
    /// cancel-marker transaction. `Ok(deleted_by_this_call)` when the server confirmed it gone.
    async fn delete_once(&self, j: &DeleteJob) -> Result<bool, LockError> {
        if j.lease.ended() {
            return Ok(false);
        }
        let bound = self.bound(Duration::from_secs(j.lease.secs as u64));
        let r = if j.rev == 0 {
            self.cancel_create(&j.name, &j.key, &j.lease, bound)
                .await
                .map(|()| false)
        } else {
            self.delete_own_key(&j.name, &j.key, bound).await
        };
        match r {
            Err(e) if lease_gone(&e) => {
                // Its lease ended: so did the key (and a create not applied yet cannot be).
                self.lease_ended(&j.lease);
                Ok(false)
            }
            r => r,
        }
    }

    fn lease_ended(&self, lease: &Lease) {
        lease.end();
        let mut leases = self.leases();
        if leases
            .get(&lease.id)
            .is_some_and(|l| std::ptr::eq(&**l, lease))
        {
            leases.remove(&lease.id);
        }
    }

    fn delete_job(&self, key: &str) -> Option<DeleteJob> {
        self.deleting().get(key).map(|d| DeleteJob {
            name: d.name.clone(),
            key: key.to_string(),
            lease: d.lease.clone(),
            rev: d.rev,
        })
    }

    /// Moves a hold (already taken out of `holds`) to the to-delete set; returns its key.
    fn start_delete(&self, h: Hold, name: &str, owner: &str) -> String {
        if let Some(w) = &h.watching {
            w.task.abort();
        }
        let held = h.held && !h.lease.dead.load(Ordering::Acquire);
        self.deleting().insert(
            h.key.clone(),
            Deleting {
                space: None,
                name: name.to_string(),
                owner: owner.to_string(),
                lease: h.lease,
                rev: h.rev,
                held,
                orphan: false,
            },
        );
        h.key
    }

    /// The server confirmed `key` gone: forgets it (its lease loses a user or an orphan) and
    /// wakes a local waiter of its name. Idempotent.
    fn finish_delete(&self, key: &str) {
        let Some(d) = self.deleting().remove(key) else {
            return;
        };
        if d.orphan {
            d.lease.orphans.fetch_sub(1, Ordering::AcqRel);
            tracing::info!(key = %d.name, "dlock: an etcd lock key whose delete had failed is gone now");
        } else {
            let mut u = d.lease.users();
            *u = u.saturating_sub(1);
        }
        // A waiter of this process that queued behind local waiters without a key of its own
        // (the lock loop does not barge past them) watches nothing: wake one so it tries,
        // rather than wait for the holder's ttl. Only such a waiter: one with a queued key is
        // woken by its own predecessor's delete (no local herd, issue 19).
        match d.space {
            None => {
                self.wake_one_keyless(&d.name);
            }
            Some(space) => self.q_wake_keyless(space, &d.name),
        }
    }

    /// Wakes the first local waiter of `name` that has no queued key of its own (by the owner
    /// id it tries with). Returns whether one was.
    fn wake_one_keyless(&self, name: &str) -> bool {
        let queued: Vec<String> = self
            .holds()
            .iter()
            .filter(|((n, _), h)| n == name && !h.held)
            .map(|((_, o), _)| o.clone())
            .collect();
        self.waiters
            .wake_first_where(name, |o| o.is_none_or(|o| !queued.iter().any(|q| q == o)))
    }

    /// The first delete of `key` was not confirmed: it becomes an orphan (its lease is tainted)
    /// and the reaper retries it.
    fn make_orphan(&self, key: &str) {
        let lease = {
            let mut del = self.deleting();
            let Some(d) = del.get_mut(key).filter(|d| !d.orphan) else {
                return;
            };
            d.orphan = true;
            // Counted as an orphan before it stops counting as a user: the lease never looks
            // unused meanwhile.
            d.lease.orphans.fetch_add(1, Ordering::AcqRel);
            d.lease.clone()
        };
        {
            let mut u = lease.users();
            *u = u.saturating_sub(1);
        }
        tracing::warn!(
            lease = lease.id,
            "dlock: deleting an etcd lock key was not confirmed; retrying in the background"
        );
        self.driver
            .handle
            .spawn(reap(self.this.clone(), key.to_string()));
    }

    /// Deletes the to-delete `key` on the driver thread, after `delay` when given: a caller that
    /// stops waiting (a dropped future, a runtime shutting down) does not stop it. One attempt;
    /// when it is not confirmed the key goes to the reaper and the error is returned.
    fn delete_on_driver(
        self: &Arc<Self>,
        key: String,
        delay: Option<Duration>,
    ) -> tokio::task::JoinHandle<Result<bool, LockError>> {
        let me = Arc::clone(self);
        self.driver.handle.spawn(async move {
            if let Some(d) = delay {
                tokio::time::sleep(d).await;
            }
            let Some(job) = me.delete_job(&key) else {
                return Ok(false);
            };
            match me.delete_once(&job).await {
                Ok(by_us) => {
                    me.finish_delete(&key);
                    Ok(by_us)
                }
                Err(e) => {
                    me.make_orphan(&key);
                    Err(e)
                }
            }
        })
    }

    /// The last resort for an orphan that cannot be deleted: once its (tainted) lease has no
    /// users left, retire it (no keep-alive any more, so the server ends it within its ttl
    /// whatever happens) and revoke it, which ends the orphan now. True when the server
    /// confirmed the lease gone.
    async fn revoke_if_unused(&self, name: &str, lease: &Lease) -> bool {
        if lease.ended() {
            return true;
        }
        if !self.retire(lease) {
            return false;
        }
        let id = lease.id;
        let bound = self.bound(Duration::from_secs(lease.secs as u64));
        match self
            .call_idem(name, bound, |mut c| async move { c.lease_revoke(id).await })
            .await
        {
            Ok(_) => {
                self.lease_ended(lease);
                true
            }
            Err(e) if lease_gone(&e) => {
                self.lease_ended(lease);
                true
            }
            Err(_) => false,
        }
    }

    /// Marks a lease without users dead (under the map lock, so no acquire picks it up
    /// meanwhile) and stops its keep-alive. False when it still has users.
    fn retire(&self, lease: &Lease) -> bool {
        let mut leases = self.leases();
        if *lease.users() > 0 {
            return false;
        }
        lease.kill();
        if leases
            .get(&lease.id)
            .is_some_and(|l| std::ptr::eq(&**l, lease))
        {
            leases.remove(&lease.id);
        }
        true
    }

    /// A live lease for `secs`, granted when there is none; its user count is incremented.
    async fn lease_for(self: &Arc<Self>, name: &str, secs: i64) -> Result<Arc<Lease>, LockError> {
        {
            let leases = self.leases();
            // Not a tainted one (with an orphan it could not delete): it is to be revoked.
            if let Some(l) = leases.values().find(|l| l.secs == secs && l.usable()) {
                *l.users() += 1;
                return Ok(l.clone());
            }
        }
        let bound = self.bound(Duration::from_secs(secs as u64));
        let sent = Instant::now();
        let r = self
            .call(name, bound, |mut c| async move {
                c.lease_grant(secs, None).await
            })
            .await?;
        let lease = Arc::new(Lease::new(r.id(), secs, sent));
        self.leases().insert(lease.id, lease.clone());
        let me = Arc::downgrade(self);
        self.driver
            .handle
            .spawn(keep_alive(me.clone(), lease.clone()));
        self.driver.handle.spawn(watch_lease(me, lease.clone()));
        Ok(lease)
    }

    /// One keep-alive of `lease`, sent now: a grant decided together with it may count on the
    /// lease for its whole ttl from the try's send time (issue 17, M2: a key put under a
    /// shared lease does not renew it, and the lease's last renewal may be up to a third of its
    /// ttl old). Not counted in `requests` (a lease keep-alive, as the background ones).
    async fn refresh_lease(
        &self,
        name: &str,
        lease: &Lease,
        bound: Duration,
    ) -> Result<(), LockError> {
        let id = lease.id;
        let sent = Instant::now();
        let r = self
            .call_with(name, bound, transient, |c| async move {
                c.lease_client().keep_alive(id).await
            })
            .await;
        self.requests.fetch_sub(1, Ordering::Relaxed);
        match r {
            Ok(_) => {
                lease.confirm(sent);
                Ok(())
            }
            Err(e) => {
                if lease_gone(&e) {
                    self.lease_ended(lease);
                }
                Err(e)
            }
        }
    }

    fn forget(&self, h: &Hold) {
        if let Some(w) = &h.watching {
            w.task.abort();
        }
        let mut u = h.lease.users();
        *u = u.saturating_sub(1);
    }

    async fn try_acquire(
        self: &Arc<Self>,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Acquired, LockError> {
        let hk = (name.to_string(), owner.to_string());
        let bound = self.bound(ttl);
        let sent = Instant::now();
        let existing = {
            let holds = self.holds();
            let h = holds.get(&hk);
            if let Some(h) = h
                && !h.held
                && !h.lease.dead.load(Ordering::Acquire)
                && h.watching
                    .as_ref()
                    .is_some_and(|w| !w.fired.load(Ordering::Acquire))
            {
                // Queued behind a predecessor that is still there (its delete would have fired
                // the watch): still busy, no request needed. Other local waiters woken for
                // this name end here, so a release costs one re-check, not one per waiter.
                return Ok(Acquired::Busy { remaining: None });
            }
            h.map(|h| (h.key.clone(), h.rev, h.held, h.lease.clone()))
        };
        // `refreshed`: the keep-alive sent with the try when the lease's last confirmation does
        // not cover `sent + ttl` (None: not needed).
        let (key, rev, lease, pred, header_rev, refreshed, fence) = match existing {
            Some((key, rev, held, lease)) if rev > 0 && !lease.dead.load(Ordering::Acquire) => {
                // Known key: a re-entry, or a queued contender re-checking.
                let txn = Txn::new().and_then([
                    TxnOp::get(key.clone(), None),
                    TxnOp::get(
                        self.lock_prefix(name),
                        Some(
                            GetOptions::new()
                                .with_prefix()
                                .with_sort(SortTarget::Create, SortOrder::Descend)
                                .with_max_create_revision(rev - 1)
                                .with_limit(1)
                                .with_keys_only(),
                        ),
                    ),
                    // The name's last token, for a grant (see `write_fence`).
                    TxnOp::get(self.fence_key(name), None),
                ]);
                let recheck = self.call_idem(name, bound, |mut c| {
                    let t = txn.clone();
                    async move { c.txn(t).await }
                });
                let refresh = async {
                    if held || lease.covers(sent, ttl) {
                        None
                    } else {
                        Some(self.refresh_lease(name, &lease, bound).await)
                    }
                };
                let (r, refreshed) = tokio::join!(recheck, refresh);
                let r = r?;
                let ops = r.op_responses();
                let mine = range_kvs(ops.first());
                if !mine.iter().any(|kv| kv.create_revision() == rev) {
                    // Deleted behind our back, or its lease ended.
                    if let Some(h) = self.holds().remove(&hk) {
                        self.forget(&h);
                    }
                    if held {
                        // A re-entry of a lost hold: the caller's chain reports it lost.
                        return Box::pin(self.try_acquire(name, owner, ttl)).await;
                    }
                    return Err(be(name, "etcd lock key vanished (lease lost?)"));
                }
                if held {
                    let mut holds = self.holds();
                    let h = holds.get_mut(&hk).expect("present");
                    h.count = h.count.saturating_add(1);
                    return Ok(Acquired::Granted {
                        token: h.token,
                        count: h.count,
                    });
                }
                let pred = range_kvs(ops.get(1))
                    .first()
                    .map(|kv| String::from_utf8_lossy(kv.key()).into_owned());
                let hr = r.header().map_or(0, |h| h.revision());
                let fence = Fence::Read(fence_of(range_kvs(ops.get(2)).first()));
                (key, rev, lease, pred, hr, refreshed, fence)
            }
            other => {
                if other.is_some() {
                    // A key of a dead lease (or one whose create was never confirmed).
                    self.abandon(&hk).await;
                }
                let lease = self.lease_for(name, lease_secs(ttl)).await?;
                let mut uid = [0u8; 8];
                if let Err(e) = getrandom::fill(&mut uid) {
                    *lease.users() -= 1;
                    return Err(be(name, e.to_string()));
                }
                let uid: String = uid.iter().map(|b| format!("{b:02x}")).collect();
                let prefix = self.lock_prefix(name);
                let key = format!("{prefix}{:016x}-{uid}", lease.id);
                // Recorded before the create is sent: a wait that ends before the reply
                // (a dropped future, a timeout) deletes the key by this name.
                self.holds().insert(
                    hk.clone(),
                    Hold {
                        key: key.clone(),
                        lease: lease.clone(),
                        rev: 0,
                        token: 0,
                        held: false,
                        count: 0,
                        watching: None,
                    },
                );
                let floor = now_micros();
                let txn = Txn::new()
                    .when([
                        Compare::create_revision(key.clone(), CompareOp::Equal, 0),
                        // Not given up already (see `cancel_create`).
                        Compare::create_revision(self.cancel_marker(&key), CompareOp::Equal, 0),
                    ])
                    .and_then([
                        TxnOp::put(
                            key.clone(),
                            key_value(owner),
                            Some(PutOptions::new().with_lease(lease.id)),
                        ),
                        TxnOp::get(
                            prefix.clone(),
                            Some(
                                GetOptions::new()
                                    .with_prefix()
                                    .with_sort(SortTarget::Create, SortOrder::Descend)
                                    .with_limit(2)
                                    .with_keys_only(),
                            ),
                        ),
                        TxnOp::txn(self.fence_on_first_create(name, &prefix, floor)),
                    ]);
                let create = self.call(name, bound, |mut c| {
                    let t = txn.clone();
                    async move { c.txn(t).await }
                });
                let refresh = async {
                    if lease.covers(sent, ttl) {
                        None
                    } else {
                        Some(self.refresh_lease(name, &lease, bound).await)
                    }
                };
                let (r, refreshed) = tokio::join!(create, refresh);
                let r = match r {
                    Ok(r) if r.succeeded() => r,
                    Ok(_) => {
                        self.abandon(&hk).await;
                        return Err(be(name, "etcd lock key already existed"));
                    }
                    Err(e) => {
                        if lease_gone(&e) {
                            // Expired or revoked (its keep-alive task may have stopped with the
                            // runtime that ran it): the next try grants a new one.
                            self.lease_ended(&lease);
                        }
                        // The reply may be lost after the server created the key: delete it
                        // by its name (no orphan).
                        self.abandon(&hk).await;
                        return Err(e);
                    }
                };
                let ops = r.op_responses();
                let kvs = range_kvs(ops.get(1));
                let Some(rev) = kvs
                    .iter()
                    .find(|kv| kv.key() == key.as_bytes())
                    .map(|kv| kv.create_revision())
                else {
                    self.abandon(&hk).await;
                    return Err(be(name, "etcd lock key missing right after its create"));
                };
                let pred = kvs
                    .iter()
                    .find(|kv| kv.create_revision() < rev)
                    .map(|kv| String::from_utf8_lossy(kv.key()).into_owned());
                let fence = first_create_fence(ops.get(2), floor);
                if let Some(h) = self.holds().get_mut(&hk) {
                    h.rev = rev;
                }
                if pred.is_some() && !self.waiters.has_waiters(name) {
                    // Busy and nobody in this process waits for the name: a single try (or
                    // the first try of a wait, which subscribes and tries again). Like etcd's
                    // TryLock, take the key back now rather than leave it queued until the
                    // give-up runs, so that it never becomes the holder of a name whose
                    // contender has already left.
                    self.abandon(&hk).await;
                    return Ok(Acquired::Busy { remaining: None });
                }
                let hr = r.header().map_or(rev, |h| h.revision());
                (key, rev, lease, pred, hr, refreshed, fence)
            }
        };
        let _ = (&key, &lease);
        if pred.is_none()
            && let Some(Err(e)) = refreshed
        {
            // Alone, but the lease may end before `sent + ttl`: not granted (the key is given
            // back; the caller's next try has a fresh lease or a confirmed one).
            self.abandon(&hk).await;
            return Err(e);
        }
        let Some(pred) = pred else {
            // Alone: the grant's token is written to the name's fence key before the guard
            // is returned (in the create's own transaction when it could be; see `Fence`).
            let token = match fence {
                Fence::Written(t) => t,
                Fence::Read(last) => match self.write_fence(name, &key, rev, last, bound).await {
                    Ok(t) => t,
                    Err(e) => {
                        // Not granted: the key is given back (a fence bumped without a grant
                        // only skips a value).
                        self.abandon(&hk).await;
                        return Err(e);
                    }
                },
            };
            let mut holds = self.holds();
            let Some(h) = holds.get_mut(&hk) else {
                // Given up meanwhile (the release ran first): not granted.
                return Err(be(name, "etcd acquire was given up"));
            };
            if let Some(w) = h.watching.take() {
                w.task.abort();
            }
            h.held = true;
            h.count = 1;
            h.token = token;
            return Ok(Acquired::Granted { token, count: 1 });
        };
        // Queued: watch the predecessor only (again only when it changed: it gave up).
        let armed = self
            .holds()
            .get(&hk)
            .and_then(|h| {
                h.watching
                    .as_ref()
                    .map(|w| w.pred == pred && !w.fired.load(Ordering::Acquire))
            })
            .unwrap_or(false);
        if !armed {
            // A watch from a past revision (the store moved on since the read above, as it
            // does under contention) is an "unsynced" watcher on the server, served by a
            // background loop that runs every 100 ms: a hand-off could wait that long. A watch
            // from now is served at once. So: watch from now, wait for the server's `created`
            // answer (its revision), and when the store moved since the read, read the
            // predecessor once: gone means it left in between (any later delete is an event).
            let watched = async {
                let mut stream = self
                    .call(name, bound, |mut c| {
                        let k = pred.clone();
                        async move { c.watch(k, None).await }
                    })
                    .await?;
                let created = match tokio::time::timeout(bound, stream.message()).await {
                    Ok(Ok(Some(r))) if r.created() && !r.canceled() => {
                        r.header().map_or(i64::MAX, |h| h.revision())
                    }
                    Ok(Err(e)) => return Err(be(name, e)),
                    _ => return Err(be(name, "etcd watch on the predecessor was not created")),
                };
                let mut gone = false;
                if created > header_rev {
                    let k = pred.clone();
                    let r = self
                        .call_idem(name, bound, |mut c| {
                            let k = k.clone();
                            async move { c.get(k, Some(GetOptions::new().with_count_only())).await }
                        })
                        .await?;
                    gone = r.count() == 0;
                }
                Ok((stream, gone))
            };
            let (stream, gone) = match watched.await {
                Ok(v) => v,
                Err(e) => {
                    // Not left queued under an owner id the caller is about to drop.
                    self.abandon(&hk).await;
                    return Err(e);
                }
            };
            let me = Arc::downgrade(self);
            let wname = name.to_string();
            let fired = Arc::new(AtomicBool::new(gone));
            if gone {
                // The caller retries at once.
                self.waiters.wake_owner(name, owner);
            }
            let task = self.driver.handle.spawn(watch_predecessor(
                me,
                stream,
                wname,
                owner.to_string(),
                fired.clone(),
            ));
            let mut holds = self.holds();
            match holds.get_mut(&hk) {
                Some(h) => {
                    let new = PredWatch {
                        pred,
                        task: task.abort_handle(),
                        fired,
                    };
                    if let Some(old) = h.watching.replace(new) {
                        old.task.abort();
                    }
                }
                None => task.abort(),
            }
        }
        Ok(Acquired::Busy { remaining: None })
    }

    /// Gives up a contender's key: moves it to the to-delete set and deletes it on the driver
    /// thread (see [`Inner::delete_on_driver`]); a delete that is not confirmed goes on in the
    /// reaper, so the key is never forgotten while it may still be on the server. A caller
    /// dropped meanwhile does not stop the delete, and a later `release` of the same owner
    /// answers from the to-delete set.
    async fn abandon(self: &Arc<Self>, hk: &(String, String)) {
        let Some(h) = self.holds().remove(hk) else {
            return;
        };
        let key = self.start_delete(h, &hk.0, &hk.1);
        let _ = self.delete_on_driver(key, None).await;
    }

    /// The name's fence key, `<prefix>/.fence/<escaped name>` (outside every name's range:
    /// escaped names never start with `.`): the last token granted for the name, as 20
    /// zero-padded decimal digits (so that etcd's byte-wise value compare is numeric), on no
    /// lease, so that it outlives every holder and a restart of the cluster.
    fn fence_key(&self, name: &str) -> String {
        format!("{}/.fence/{}", self.cfg.prefix, escape(name))
    }

    /// The fence write folded into a first create's transaction (nested, so its compares see
    /// the store before the create): when the name had no key (so the create is alone, a
    /// grant) and the fence is absent or below `floor`, the fence becomes `floor`, the grant's
    /// token; otherwise it is read, and [`Inner::write_fence`] writes `max(last + 1, floor)`.
    fn fence_on_first_create(&self, name: &str, prefix: &str, floor: u64) -> Txn {
        let fence = self.fence_key(name);
        let value = fence_value(floor);
        let empty = || Compare::create_revision(prefix, CompareOp::Equal, 0).with_prefix();
        let below = Txn::new()
            .when([
                empty(),
                Compare::value(fence.clone(), CompareOp::Less, value.clone()),
            ])
            .and_then([TxnOp::put(fence.clone(), value.clone(), None)])
            .or_else([TxnOp::get(fence.clone(), None)]);
        Txn::new()
            .when([
                empty(),
                Compare::create_revision(fence.clone(), CompareOp::Equal, 0),
            ])
            .and_then([TxnOp::put(fence, value, None)])
            .or_else([TxnOp::txn(below)])
    }

    /// Writes a grant's token, `max(last + 1, client µs)`, to the name's fence key, comparing
    /// the fence's mod revision with the one read (and the key's create revision with the
    /// grant's, so a key that is gone grants nothing). Only a holder writes the fence, so the
    /// compare fails only when a former holder's write landed between the read and this one;
    /// then it is read again (a few times at most). Not re-sent when its outcome is unknown
    /// (the caller gives the key back; a fence bumped without a grant only skips a value).
    async fn write_fence(
        &self,
        name: &str,
        key: &str,
        rev: i64,
        last: (u64, i64),
        bound: Duration,
    ) -> Result<u64, LockError> {
        self.write_fence_at(self.fence_key(name), 4, name, key, rev, last, bound)
            .await
    }

    /// [`Inner::write_fence`] on the fence key `fence`, with at most `attempts` compare
    /// failures (a semaphore's holders are granted side by side, so their fence writes meet).
    #[allow(clippy::too_many_arguments)]
    async fn write_fence_at(
        &self,
        fence: String,
        attempts: u32,
        name: &str,
        key: &str,
        rev: i64,
        mut last: (u64, i64),
        bound: Duration,
    ) -> Result<u64, LockError> {
        for _ in 0..attempts {
            let token = (last.0 + 1).max(now_micros());
            let txn = Txn::new()
                .when([
                    Compare::create_revision(key, CompareOp::Equal, rev),
                    Compare::mod_revision(fence.clone(), CompareOp::Equal, last.1),
                ])
                .and_then([TxnOp::put(fence.clone(), fence_value(token), None)])
                .or_else([
                    TxnOp::get(fence.clone(), None),
                    TxnOp::get(key, Some(GetOptions::new().with_count_only())),
                ]);
            let r = self
                .call(name, bound, |mut c| {
                    let t = txn.clone();
                    async move { c.txn(t).await }
                })
                .await?;
            if r.succeeded() {
                return Ok(token);
            }
            let ops = r.op_responses();
            if !matches!(ops.get(1), Some(etcd::TxnOpResponse::Get(g)) if g.count() > 0) {
                return Err(be(name, "etcd lock key vanished before its grant"));
            }
            last = fence_of(range_kvs(ops.first()).first());
        }
        Err(be(name, "etcd fence key kept changing"))
    }

    /// The sentinel key of a lease (`<prefix>/.leases/<id hex>`, on that lease): the server
    /// deletes it when the lease ends, which [`watch_lease`] hears at once.
    fn lease_sentinel(&self, id: i64) -> String {
        format!("{}/.leases/{id:016x}", self.cfg.prefix)
    }

    /// The key under which a given-up create is marked (outside every name's range: escaped
    /// names never start with `.`).
    fn cancel_marker(&self, key: &str) -> String {
        let tail = key.strip_prefix(&self.cfg.prefix).unwrap_or(key);
        format!("{}/.cancelled{tail}", self.cfg.prefix)
    }

    /// Removes a key whose create's outcome is unknown (its reply was not read: a dropped
    /// future, a timeout). The create may still be applied after a plain delete, leaving an
    /// orphan that its lease (kept alive for other keys) would never end. So one transaction
    /// writes a cancel marker, which the create compares against, and deletes the key: after it,
    /// the key is gone and cannot appear. The marker stays until its lease ends (a create can
    /// arrive late for as long as its lease lives); the transaction is idempotent, so it is
    /// retried after any transient error, and by the reaper after that.
    async fn cancel_create(
        &self,
        name: &str,
        key: &str,
        lease: &Lease,
        bound: Duration,
    ) -> Result<(), LockError> {
        let marker = self.cancel_marker(key);
        let txn = Txn::new().and_then([
            TxnOp::put(marker, "", Some(PutOptions::new().with_lease(lease.id))),
            TxnOp::delete(key.to_string(), None),
        ]);
        self.call_idem(name, bound, |mut c| {
            let t = txn.clone();
            async move { c.txn(t).await }
        })
        .await
        .map(|_| ())
    }

    /// A release by an owner that has no hold any more: its key may be in the to-delete set
    /// (an earlier release or give-up whose delete was not confirmed). Then one more attempt:
    /// confirmed, it is `Freed` (or `NotOwner` for a key that did not hold); not confirmed, an
    /// error (never `NotOwner`: rule 3). Nothing of this owner's: `NotOwner`.
    async fn release_again(
        self: &Arc<Self>,
        name: &str,
        owner: &str,
    ) -> Result<Released, LockError> {
        let found = self
            .deleting()
            .iter()
            .find(|(_, d)| d.space.is_none() && d.name == name && d.owner == owner)
            .map(|(k, d)| (k.clone(), d.orphan, d.held));
        let Some((key, orphan, held)) = found else {
            return Ok(Released::NotOwner);
        };
        if !orphan {
            return Err(be(
                name,
                "etcd: the delete of this lock key is still in flight",
            ));
        }
        let me = Arc::clone(self);
        let attempt = self.driver.handle.spawn(async move {
            let Some(job) = me.delete_job(&key) else {
                return Ok(());
            };
            me.delete_once(&job).await?;
            me.finish_delete(&key);
            Ok(())
        });
        match attempt.await {
            Ok(Ok(())) if held => Ok(Released::Freed),
            Ok(Ok(())) => Ok(Released::NotOwner),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(be(name, e)),
        }
    }

    /// Gives back `owner`'s hold. The key goes to the to-delete set and is deleted on the
    /// driver thread (a caller's runtime that shuts down cannot cut the delete off); it is
    /// forgotten only once the server confirmed it gone. A delete that is not confirmed is an
    /// error (the reaper goes on with it), never `NotOwner`.
    async fn release(
        self: &Arc<Self>,
        name: &str,
        owner: &str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> Result<Released, LockError> {
        let hk = (name.to_string(), owner.to_string());
        let h = {
            let mut holds = self.holds();
            match holds.get_mut(&hk) {
                None => None,
                Some(h) if h.held && h.count > 1 && !all => {
                    h.count -= 1;
                    return Ok(Released::Decremented(h.count));
                }
                Some(_) => holds.remove(&hk),
            }
        };
        let Some(h) = h else {
            return self.release_again(name, owner).await;
        };
        let key = self.start_delete(h, name, owner);
        let held = self.deleting().get(&key).is_some_and(|d| d.held);
        if let Some(k) = keep_for.filter(|k| held && !k.is_zero()) {
            // Stays taken for `k` (its lease kept alive meanwhile: it still counts as a user).
            drop(self.delete_on_driver(key, Some(k)));
            return Ok(Released::Freed);
        }
        match self.delete_on_driver(key, None).await {
            Ok(Ok(true)) if held => Ok(Released::Freed),
            Ok(Ok(_)) => Ok(Released::NotOwner),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(be(name, e)),
        }
    }

    async fn extend(&self, name: &str, owner: &str, ttl: Duration) -> Result<Extended, LockError> {
        let hk = (name.to_string(), owner.to_string());
        let Some((key, rev, lease)) = self
            .holds()
            .get(&hk)
            .filter(|h| h.held)
            .map(|h| (h.key.clone(), h.rev, h.lease.clone()))
        else {
            return Ok(Extended::Lost);
        };
        if lease.dead.load(Ordering::Acquire) {
            return Ok(Extended::Lost);
        }
        let bound = self.bound(ttl);
        if lease_secs(ttl) > lease.secs {
            // A longer lease than the key has: move the key to a lease of the new ttl (its
            // create revision, so its place, stays; the token is the guard's).
            return self.move_to_longer_lease(&hk, key, rev, lease, ttl).await;
        }
        let id = lease.id;
        let ksent = Instant::now();
        let keep = self.call_idem(name, bound, |c| async move {
            c.lease_client().keep_alive(id).await
        });
        let get = self.call_idem(name, bound, |mut c| {
            let k = key.clone();
            async move { c.get(k, None).await }
        });
        let (k, g) = tokio::join!(keep, get);
        if let Err(e) = &k
            && lease_gone(e)
        {
            self.lease_ended(&lease);
            return Ok(Extended::Lost);
        }
        k?;
        lease.confirm(ksent);
        let g = g?;
        if g.kvs().iter().any(|kv| kv.create_revision() == rev) {
            Ok(Extended::Extended)
        } else {
            Ok(Extended::Lost)
        }
    }
}

impl Inner {
    async fn move_to_longer_lease(
        self: &Inner,
        hk: &(String, String),
        key: String,
        rev: i64,
        old: Arc<Lease>,
        ttl: Duration,
    ) -> Result<Extended, LockError> {
        let name = &hk.0;
        let bound = self.bound(ttl);
        let Some(me) = self.me() else {
            return Err(be(name, "etcd backend is shutting down"));
        };
        let lease = me.lease_for(name, lease_secs(ttl)).await?;
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, rev)])
            .and_then([TxnOp::put(
                key,
                key_value(&hk.1),
                Some(PutOptions::new().with_lease(lease.id)),
            )]);
        let r = match self
            .call(name, bound, |mut c| {
                let t = txn.clone();
                async move { c.txn(t).await }
            })
            .await
        {
            Ok(r) => r,
            Err(e) => {
                *lease.users() -= 1;
                return Err(e);
            }
        };
        if !r.succeeded() {
            *lease.users() -= 1;
            return Ok(Extended::Lost);
        }
        match self.holds().get_mut(hk) {
            Some(h) if h.rev == rev => h.lease = lease,
            _ => {
                *lease.users() -= 1;
                return Ok(Extended::Lost);
            }
        }
        *old.users() -= 1;
        Ok(Extended::Extended)
    }
}

/// First pause before retrying a request (doubled up to [`RETRY_PAUSE_MAX`]).
const RETRY_PAUSE: Duration = Duration::from_millis(20);
const RETRY_PAUSE_MAX: Duration = Duration::from_millis(200);

/// The reaper's back-off: first retry after 50 ms, doubling up to 1 s.
const REAP_FIRST: Duration = Duration::from_millis(50);
const REAP_MAX: Duration = Duration::from_secs(1);

/// True for an error that means the request never reached a server (no connection to the
/// endpoint it was routed to), so sending it again is safe.
fn not_sent(e: &etcd::Error) -> bool {
    match e {
        etcd::Error::GRpcStatus(s) => {
            i32::from(s.code()) == 14 // UNAVAILABLE
                && (s.message().contains("connect") || s.message().contains("not ready"))
        }
        etcd::Error::TransportError(_) => true,
        _ => false,
    }
}

/// True for an error after which the request is known not to have been applied: not sent, or
/// refused by the server before it was proposed to the cluster.
fn not_applied(e: &etcd::Error) -> bool {
    if not_sent(e) {
        return true;
    }
    match e {
        etcd::Error::GRpcStatus(s) => [
            "etcdserver: no leader",
            "etcdserver: leader changed",
            "etcdserver: too many requests",
            "etcdserver: not capable",
            "raft proposal dropped",
        ]
        .iter()
        .any(|m| s.message().contains(m)),
        _ => false,
    }
}

/// True for an error worth retrying for an idempotent request: the transport, a member that is
/// down or without a leader, a server-side timeout (outcome unknown).
fn transient(e: &etcd::Error) -> bool {
    if not_applied(e) {
        return true;
    }
    match e {
        // CANCELLED, UNKNOWN, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, INTERNAL,
        // UNAVAILABLE (not NOT_FOUND: "lease not found" is an answer).
        etcd::Error::GRpcStatus(s) => [1, 2, 4, 8, 10, 13, 14].contains(&i32::from(s.code())),
        etcd::Error::TransportError(_) | etcd::Error::IoError(_) => true,
        _ => false,
    }
}

/// The server's answer that a lease is gone (revoked or expired), so are its keys.
fn lease_gone(e: &LockError) -> bool {
    matches!(e, LockError::Backend { source, .. } if source.to_string().contains("lease not found"))
}

/// The reaper of one orphan key (its first delete was not confirmed): retries the delete with
/// back-off (50 ms doubling to 1 s) until the server confirms it gone or its lease ended. After
/// each failure, the last resort: once the lease has no users left, revoke it. Holds only a weak
/// reference: a dropped backend stops keeping its leases alive, which ends them.
async fn reap(me: std::sync::Weak<Inner>, key: String) {
    let mut backoff = REAP_FIRST;
    loop {
        tokio::time::sleep(backoff).await;
        let Some(me) = me.upgrade() else {
            return;
        };
        let Some(job) = me.delete_job(&key) else {
            return;
        };
        let confirmed = match me.delete_once(&job).await {
            Ok(_) => true,
            Err(_) => me.revoke_if_unused(&job.name, &job.lease).await,
        };
        if confirmed {
            me.finish_delete(&key);
            return;
        }
        backoff = (backoff * 2).min(REAP_MAX);
    }
}

fn range_kvs(op: Option<&etcd::TxnOpResponse>) -> Vec<etcd::KeyValue> {
    match op {
        Some(etcd::TxnOpResponse::Get(g)) => g.kvs().to_vec(),
        _ => Vec::new(),
    }
}

/// The client's wall clock in µs since the Unix epoch: the floor of every token (etcd's API has
/// no server clock). It matters only when a name moves between engines; the order within etcd
/// comes from the fence key's `last + 1`.
fn now_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A token as the fence key stores it: fixed-width decimal, so byte order is numeric order.
fn fence_value(token: u64) -> String {
    format!("{token:020}")
}

/// A contender key's value: the owner id, a newline and the holder identity (`name@host:pid`,
/// see `holder.rs`), which the admin shows.
fn key_value(owner: &str) -> Vec<u8> {
    let holder = crate::holder::holder_text();
    let mut v = Vec::with_capacity(owner.len() + 1 + holder.len());
    v.extend_from_slice(owner.as_bytes());
    v.push(b'\n');
    v.extend_from_slice(holder.as_bytes());
    v
}

/// `(last token, mod revision)` of a fence key read (`(0, 0)`: absent; an unreadable value
/// counts as 0, and the mod-revision compare still orders the write after it).
fn fence_of(kv: Option<&etcd::KeyValue>) -> (u64, i64) {
    kv.map_or((0, 0), |kv| {
        let v = std::str::from_utf8(kv.value())
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        (v, kv.mod_revision())
    })
}

/// What a grant knows of its fence.
#[derive(Debug, Clone, Copy)]
enum Fence {
    /// Written in the create's transaction: this is the token.
    Written(u64),
    /// Read (last token, mod revision): [`Inner::write_fence`] writes the token.
    Read((u64, i64)),
}

/// The outcome of [`Inner::fence_on_first_create`] in a create's reply.
fn first_create_fence(op: Option<&etcd::TxnOpResponse>, floor: u64) -> Fence {
    let Some(etcd::TxnOpResponse::Txn(t)) = op else {
        return Fence::Read((0, 0));
    };
    if t.succeeded() {
        return Fence::Written(floor);
    }
    let Some(etcd::TxnOpResponse::Txn(t)) = t.op_responses().first().cloned() else {
        return Fence::Read((0, 0));
    };
    if t.succeeded() {
        return Fence::Written(floor);
    }
    Fence::Read(fence_of(range_kvs(t.op_responses().first()).first()))
}

/// Waits for the predecessor's delete (or the end of the watch), then wakes the local waiter
/// whose key it was the predecessor of (`owner`) so it re-checks: one wake-up per release, not
/// one per local waiter (issue 19).
async fn watch_predecessor(
    me: std::sync::Weak<Inner>,
    mut stream: etcd::WatchStream,
    name: String,
    owner: String,
    fired: Arc<AtomicBool>,
) {
    // Ends on the predecessor's delete, a cancelled watch, or a broken stream (then the
    // contender re-checks rather than wait on a dead watch).
    while let Ok(Some(resp)) = stream.message().await {
        if resp.canceled()
            || resp
                .events()
                .iter()
                .any(|e| e.event_type() == etcd::EventType::Delete)
        {
            break;
        }
    }
    fired.store(true, Ordering::Release);
    if let Some(me) = me.upgrade() {
        me.notifications.fetch_add(1, Ordering::Relaxed);
        me.waiters.wake_owner(&name, &owner);
    }
}

/// Puts the lease's sentinel key (see [`Inner::lease_sentinel`]) and watches it from right
/// after the put. Its delete means the lease may have ended (revoked by an operator, expired):
/// one `TimeToLive` read confirms it, and the lease is then ended here at once, so its holds
/// hear `lost()` without waiting for the next renewal. Ends with the lease (or the backend).
/// Best effort: without it, the keep-alive task and the renewals still find a dead lease.
async fn watch_lease(me: std::sync::Weak<Inner>, lease: Arc<Lease>) {
    let (key, client, bound) = {
        let Some(me) = me.upgrade() else {
            return;
        };
        let b = me.bound(Duration::from_secs(lease.secs as u64));
        (me.lease_sentinel(lease.id), me.client.clone(), b)
    };
    let mut c = client.clone();
    let put = tokio::time::timeout(
        bound,
        c.put(
            key.clone(),
            "",
            Some(PutOptions::new().with_lease(lease.id)),
        ),
    )
    .await;
    let mut from = match put {
        Ok(Ok(r)) => r.header().map_or(0, |h| h.revision()) + 1,
        Ok(Err(e)) if e.to_string().contains("lease not found") => {
            if let Some(me) = me.upgrade() {
                me.lease_ended(&lease);
            }
            return;
        }
        _ => return,
    };
    let mut pause = REAP_FIRST;
    loop {
        let ended = tokio::select! {
            _ = lease.lost.cancelled() => return,
            r = sentinel_deleted(client.clone(), &key, &mut from, lease.id) => r,
        };
        match ended {
            Some(true) => {
                if let Some(me) = me.upgrade() {
                    me.lease_ended(&lease);
                    tracing::warn!(
                        lease = lease.id,
                        "dlock: etcd lease ended (revoked or expired); its locks are lost"
                    );
                }
                return;
            }
            // Deleted, but the lease lives (an operator deleted the sentinel): no signal.
            Some(false) => return,
            // The watch broke (a member down or without a leader): watch again.
            None => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(REAP_MAX);
            }
        }
    }
}

/// Watches `key` from revision `from` until it is deleted: `Some(lease ended)` then (one
/// `TimeToLive` read), `None` when the watch ended first. A compacted start revision moves
/// `from` to the compaction point and answers from a read of the lease.
async fn sentinel_deleted(mut c: etcd::Client, key: &str, from: &mut i64, id: i64) -> Option<bool> {
    let opts = etcd::WatchOptions::new()
        .with_start_revision(*from)
        .with_filters([etcd::WatchFilterType::NoPut]);
    let mut stream = c.watch(key, Some(opts)).await.ok()?;
    let mut deleted = false;
    while let Ok(Some(resp)) = stream.message().await {
        if resp.compact_revision() > 0 {
            // The delete may be in the compacted past: ask the lease itself, then watch on
            // from the compaction point.
            *from = resp.compact_revision();
            return match c.lease_time_to_live(id, None).await {
                Ok(r) if r.ttl() <= -1 => Some(true),
                Err(e) if e.to_string().contains("lease not found") => Some(true),
                _ => None,
            };
        }
        if resp.canceled() {
            return None;
        }
        if resp
            .events()
            .iter()
            .any(|e| e.event_type() == etcd::EventType::Delete)
        {
            deleted = true;
            break;
        }
    }
    if !deleted {
        return None;
    }
    match c.lease_time_to_live(id, None).await {
        Ok(r) => Some(r.ttl() <= -1),
        Err(e) if e.to_string().contains("lease not found") => Some(true),
        Err(_) => None,
    }
}

/// Keeps `lease` alive every third of its ttl while this backend lives and the lease has users;
/// revokes it after one ttl without users. Marks it dead when the server says it is gone or no
/// keep-alive was confirmed within its ttl.
async fn keep_alive(me: std::sync::Weak<Inner>, lease: Arc<Lease>) {
    let ttl = Duration::from_secs(lease.secs as u64);
    let mut idle_since: Option<Instant> = None;
    let mut keeper: Option<(etcd::LeaseKeeper, etcd::LeaseKeepAliveStream)> = None;
    // `ended`: the server said so (its keys are gone too); otherwise not confirmed in time.
    let mark_dead = |me: &Inner, ended: bool| {
        if ended {
            me.lease_ended(&lease);
        } else {
            lease.kill();
            me.leases().remove(&lease.id);
        }
        tracing::warn!(
            lease = lease.id,
            "dlock: etcd lease lost; its locks are lost"
        );
    };
    loop {
        tokio::time::sleep((ttl / 3).max(Duration::from_millis(100))).await;
        let Some(me) = me.upgrade() else {
            return;
        };
        if lease.dead.load(Ordering::Acquire) {
            me.leases().remove(&lease.id);
            return;
        }
        let revoke = {
            let mut leases = me.leases();
            let users = *lease.users();
            if users == 0 && lease.orphans.load(Ordering::Acquire) > 0 {
                // Tainted and unused: retired (no more keep-alives, so the server ends it
                // within its ttl); the reaper revokes it, which ends its orphans at once.
                leases.remove(&lease.id);
                lease.kill();
                return;
            } else if users == 0 {
                let since = *idle_since.get_or_insert_with(Instant::now);
                // Unused for one ttl: give it back (under the map lock, so no acquire picks it
                // up meanwhile).
                let idle = since.elapsed() >= ttl;
                if idle {
                    leases.remove(&lease.id);
                    lease.kill();
                }
                idle
            } else {
                idle_since = None;
                false
            }
        };
        if revoke {
            let mut c = me.client.clone();
            let _ = tokio::time::timeout(me.cfg.request_timeout, c.lease_revoke(lease.id)).await;
            return;
        }
        let bound = me
            .cfg
            .request_timeout
            .min(ttl / 3)
            .max(Duration::from_millis(100));
        let sent = Instant::now();
        let r = tokio::time::timeout(bound, async {
            if keeper.is_none() {
                let mut lc = me.client.lease_client();
                keeper = Some(lc.keep_alive(lease.id).await?);
                return Ok::<i64, etcd::Error>(lease.secs);
            }
            let (k, s) = keeper.as_mut().expect("set");
            k.keep_alive().await?;
            match s.message().await? {
                Some(r) => Ok(r.ttl()),
                None => Err(etcd::Error::LeaseKeepAliveError("stream closed".into())),
            }
        })
        .await;
        match r {
            Ok(Ok(t)) if t > 0 => lease.confirm(sent),
            Ok(Ok(_)) => {
                mark_dead(&me, true);
                return;
            }
            Ok(Err(e)) if e.to_string().contains("lease not found") => {
                mark_dead(&me, true);
                return;
            }
            Ok(Err(_)) | Err(_) => keeper = None,
        }
        // Not confirmed within its ttl (by this task, a renewal or a grant's keep-alive).
        if !lease.covers(Instant::now(), Duration::ZERO) {
            mark_dead(&me, false);
            return;
        }
    }
}

impl Backend for EtcdBackend {
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
        Box::pin(self.inner.release(name, owner, keep_for, all))
    }

    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(self.inner.extend(name, owner, ttl))
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

    fn try_acquire_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        max: u32,
        permits: u32,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        let meta = queue::Meta::Permits { n: permits, max };
        Box::pin(self.inner.q_try(Space::Sem, name, owner, meta, ttl))
    }

    fn release_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        Box::pin(self.inner.q_release(Space::Sem, None, name, owner, true))
    }

    fn extend_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(self.inner.q_extend(Space::Sem, name, owner, ttl))
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

    fn rw_try_acquire<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(
            self.inner
                .q_try(Space::Rw, name, owner, queue::Meta::of(side), ttl),
        )
    }

    fn rw_release<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        let side = Some(queue::Meta::of(side));
        Box::pin(self.inner.q_release(Space::Rw, side, name, owner, all))
    }

    fn rw_extend<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        let _ = side;
        Box::pin(self.inner.q_extend(Space::Rw, name, owner, ttl))
    }

    fn rw_downgrade<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<u64>, LockError>> {
        Box::pin(self.inner.q_downgrade(name, owner, ttl))
    }

    fn rw_watch<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        let w = self
            .inner
            .q_waiters(Space::Rw, queue::Meta::of(side))
            .register(name);
        Box::pin(async move { Ok(w) })
    }

    fn rw_has_waiters(&self, side: RwSide, name: &str) -> bool {
        self.inner
            .q_waiters(Space::Rw, queue::Meta::of(side))
            .has_waiters(name)
    }

    fn put_record<'a>(
        &'a self,
        name: &'a str,
        epoch: u64,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(self.inner.put_record(name, epoch, value))
    }

    fn get_record<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<super::Record>, LockError>> {
        Box::pin(self.inner.get_record(name))
    }

    /// The session (ZooKeeper) or the shared lease (etcd) keeps a node or key alive, not the
    /// hold's ttl.
    fn lease_expires_by_ttl(&self) -> bool {
        false
    }

    /// Fires when the lease under the hold is found dead: the server said so (a keep-alive, a
    /// renewal, the lease's sentinel watch: revoked or expired), or no keep-alive was confirmed
    /// within its ttl. A hold moved to a longer lease (a renewal with a longer ttl) follows it.
    fn lost_signal(&self, name: &str, owner: &str) -> Option<BoxFuture<'static, ()>> {
        let hk = (name.to_string(), owner.to_string());
        let first = self
            .inner
            .holds()
            .get(&hk)
            .filter(|h| h.held)
            .map(|h| h.lease.lost.clone())?;
        let me = Arc::downgrade(&self.inner);
        Some(Box::pin(async move {
            let mut token = first;
            loop {
                token.cancelled().await;
                let now = me
                    .upgrade()
                    .and_then(|me| me.holds().get(&hk).map(|h| h.lease.lost.clone()));
                match now {
                    // Still on a lease that ended.
                    Some(t) if t.is_cancelled() => return,
                    Some(t) => token = t,
                    // Released (the guard no longer listens) or the backend is gone.
                    None => return std::future::pending().await,
                }
            }
        }))
    }
}
