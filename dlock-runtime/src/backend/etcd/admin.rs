//! [`Admin`] for etcd: reads the contender keys under the prefix (`/dlock/<escaped name>/<lease
//! hex>-<random hex>`, value = owner id, the lowest create revision holds; its fencing token is
//! the name's fence key, `/dlock/.fence/<escaped name>`, written at each grant),
//! force-releases by deleting the holder's key if its create revision is still the one shown
//! (its successor's predecessor watch fires), and watches with one prefix watch.
//!
//! The admin's client runs on the caller's runtime; every request is bounded by
//! [`CALL_TIMEOUT`](crate::admin::CALL_TIMEOUT).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use etcd_client as etcd;
use etcd_client::{
    Compare, CompareOp, GetOptions, SortOrder, SortTarget, Txn, TxnOp, WatchOptions,
};

use super::{DEFAULT_PREFIX, escape, parse_url};
use crate::admin::{
    Admin, AdminError, CALL_TIMEOUT, ForceReleased, Holder, Listing, LockEvent, LockInfo, Watching,
    still_held, without_secret,
};
use crate::backend::BoxFuture;

/// The operator's view of an etcd cluster's dlock keys.
#[derive(Clone)]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub struct EtcdAdmin {
    client: etcd::Client,
    /// `etcd://[user@]endpoints`: never the password.
    shown: String,
    prefix: String,
    /// Only to scrub messages; never shown.
    secret: Option<String>,
}

impl std::fmt::Debug for EtcdAdmin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAdmin")
            .field("target", &self.shown)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// gRPC codes of a request that did not get through (cancelled, deadline exceeded, unavailable,
/// unauthenticated) and failed logins are [`AdminError::connect`]; other answers are
/// [`AdminError::server`].
fn map(what: &str, e: &etcd::Error, secret: Option<&str>) -> AdminError {
    let msg = without_secret(format!("{what}: {e}"), secret);
    let connect = match e {
        etcd::Error::GRpcStatus(s) => {
            matches!(i32::from(s.code()), 1 | 4 | 14 | 16)
                || s.message().contains("authentication failed")
        }
        etcd::Error::TransportError(_) | etcd::Error::InvalidUri(_) => true,
        _ => false,
    };
    if connect {
        AdminError::connect(msg)
    } else {
        AdminError::server(msg)
    }
}

/// What a key under the prefix is.
#[derive(Debug, PartialEq, Eq)]
enum KeyKind {
    /// A contender key of this lock name.
    Contender(String),
    /// The fence key of this lock name (its last token).
    Fence(String),
    /// The backend's own bookkeeping (cancel markers under `<prefix>/.cancelled/`, lease
    /// sentinels under `<prefix>/.leases/`), and the semaphore, read-write and leader-record
    /// keys (`.sem/`, `.rw/`, `.record/`), which the admin does not show yet.
    Internal,
    /// Anything else.
    Foreign,
}

/// The lock name of an escaped path segment (it must escape back to itself).
fn unescape(escaped: &str) -> Option<String> {
    crate::admin::unescape_segment(escaped, escape)
}

fn kind_of(prefix: &str, key: &[u8]) -> KeyKind {
    let Some(rest) = std::str::from_utf8(key)
        .ok()
        .and_then(|k| k.strip_prefix(prefix))
        .and_then(|k| k.strip_prefix('/'))
    else {
        return KeyKind::Foreign;
    };
    if let Some(e) = rest.strip_prefix(".fence/") {
        if e.starts_with(".sem/") || e.starts_with(".rw/") {
            return KeyKind::Internal;
        }
        return match unescape(e) {
            Some(name) if !e.contains('/') => KeyKind::Fence(name),
            _ => KeyKind::Foreign,
        };
    }
    if [".cancelled/", ".leases/", ".sem/", ".rw/", ".record/"]
        .iter()
        .any(|p| rest.starts_with(p))
    {
        return KeyKind::Internal;
    }
    match rest.split_once('/') {
        Some((e, tail)) if !tail.is_empty() && !tail.contains('/') => match unescape(e) {
            Some(name) => KeyKind::Contender(name),
            None => KeyKind::Foreign,
        },
        _ => KeyKind::Foreign,
    }
}

fn owner_of(kv: &etcd::KeyValue) -> String {
    let v = String::from_utf8_lossy(kv.value());
    // After a newline: the holder identity (see `holder_of`).
    v.split_once('\n').map_or(&*v, |(o, _)| o).to_string()
}

/// The holder identity a contender key stores after its owner id and a newline (`None` for a
/// key of an older version).
fn holder_of(kv: &etcd::KeyValue) -> Option<&str> {
    std::str::from_utf8(kv.value())
        .ok()?
        .split_once('\n')
        .map(|(_, h)| h)
}

/// One contender key as the watch keeps it.
#[derive(Debug, Clone)]
struct Key {
    key: Vec<u8>,
    owner: String,
    lease: i64,
}

impl EtcdAdmin {
    /// Connects to `etcd://[user:password@]host:port[,host:port...]` (as
    /// `EtcdBackend::connect` parses it). The connection and the credentials are checked here.
    pub async fn connect(url: &str) -> Result<EtcdAdmin, AdminError> {
        let (userinfo, eps) = parse_url(url)
            .map_err(|e| AdminError::unsupported(format!("cannot use this etcd URL: {e}")))?;
        if eps.is_empty() {
            return Err(AdminError::unsupported(
                "cannot use this etcd URL: no endpoint given",
            ));
        }
        let shown = crate::redact::scrub(
            &match &userinfo {
                Some((user, _)) => format!("etcd://{user}@{}", eps.join(",")),
                None => format!("etcd://{}", eps.join(",")),
            },
            url,
        );
        let secret = userinfo.as_ref().map(|(_, p)| p.clone());
        let mut opts = etcd::ConnectOptions::new()
            .with_connect_timeout(CALL_TIMEOUT)
            .with_keep_alive(Duration::from_secs(2), CALL_TIMEOUT)
            .with_require_leader(true);
        if let Some((u, p)) = userinfo {
            opts = opts.with_user(u, p).with_auto_token_refresh(true);
        }
        let what = format!("connecting to {shown}");
        let client = match tokio::time::timeout(
            CALL_TIMEOUT,
            etcd::Client::connect(eps, Some(opts)),
        )
        .await
        {
            // Every failure to connect or log in is a connection failure.
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                return Err(AdminError::connect(without_secret(
                    format!("{what}: {e}"),
                    secret.as_deref(),
                )));
            }
            Err(_) => {
                return Err(AdminError::connect(format!(
                    "{what}: no answer within {CALL_TIMEOUT:?}"
                )));
            }
        };
        let admin = EtcdAdmin {
            client,
            shown,
            prefix: DEFAULT_PREFIX.to_string(),
            secret,
        };
        // One read, so a wrong address (a connection error) or a user without rights on the
        // prefix (a server error) fails here rather than at the first command.
        admin
            .get(
                format!("{}/", admin.prefix),
                GetOptions::new().with_prefix().with_count_only(),
            )
            .await?;
        Ok(admin)
    }

    /// Reads locks under another key prefix than `/dlock` (`EtcdBackendBuilder::prefix`).
    pub fn with_prefix(mut self, prefix: &str) -> Self {
        self.prefix = prefix.trim_end_matches('/').to_string();
        self
    }

    fn secret(&self) -> Option<&str> {
        self.secret.as_deref()
    }

    async fn call<T, Fut>(&self, what: &str, fut: Fut) -> Result<T, AdminError>
    where
        Fut: Future<Output = Result<T, etcd::Error>>,
    {
        match tokio::time::timeout(CALL_TIMEOUT, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(map(&format!("{what} on {}", self.shown), &e, self.secret())),
            Err(_) => Err(AdminError::connect(format!(
                "{what}: no answer from {} within {CALL_TIMEOUT:?}",
                self.shown
            ))),
        }
    }

    async fn get(&self, key: String, opts: GetOptions) -> Result<etcd::GetResponse, AdminError> {
        let mut c = self.client.clone();
        let what = format!("reading {key}");
        self.call(&what, c.get(key, Some(opts))).await
    }

    fn lock_prefix(&self, name: &str) -> String {
        format!("{}/{}/", self.prefix, escape(name))
    }

    fn fence_key(&self, name: &str) -> String {
        format!("{}/.fence/{}", self.prefix, escape(name))
    }

    /// Seconds left on a lease (`None`: no lease, gone, or not readable by this user).
    async fn lease_left(&self, lease: i64) -> Option<Duration> {
        if lease == 0 {
            return None;
        }
        let mut c = self.client.clone();
        match tokio::time::timeout(CALL_TIMEOUT, c.lease_time_to_live(lease, None)).await {
            Ok(Ok(r)) if r.ttl() >= 0 => Some(Duration::from_secs(r.ttl() as u64)),
            _ => None,
        }
    }

    /// A lock's info from its holder's key and the number of its keys.
    fn info(
        &self,
        name: &str,
        holder: &etcd::KeyValue,
        fence: Option<&etcd::KeyValue>,
        keys: u64,
        left: Option<Duration>,
    ) -> LockInfo {
        let mut info = LockInfo::new(name);
        info.holders = vec![Holder::new(owner_of(holder), 1).with_identity_text(holder_of(holder))];
        // The fence is the holder's token once its grant wrote it (at or after its key's
        // create); before that (a grant in flight) the token is not known yet.
        info.token = fence
            .filter(|f| f.mod_revision() >= holder.create_revision())
            .and_then(token_of);
        info.remaining = left;
        info.waiters = Some(keys.saturating_sub(1));
        info.waiters_are = "queued contenders";
        info.details = vec![
            ("server".into(), self.shown.clone()),
            (
                "holder key".into(),
                String::from_utf8_lossy(holder.key()).into_owned(),
            ),
            (
                "lease".into(),
                format!(
                    "{:x} (kept alive by the holder's process; the key goes with it)",
                    holder.lease()
                ),
            ),
            ("lock prefix".into(), self.lock_prefix(name)),
            (
                "create revision".into(),
                holder.create_revision().to_string(),
            ),
        ];
        info
    }

    /// Reads one lock in one request (the lowest create revision, the number of keys, and the
    /// fence).
    async fn read(&self, name: &str) -> Result<Option<LockInfo>, AdminError> {
        let txn = Txn::new().and_then([
            TxnOp::get(
                self.lock_prefix(name),
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_sort(SortTarget::Create, SortOrder::Ascend)
                        .with_limit(1),
                ),
            ),
            TxnOp::get(self.fence_key(name), None),
        ]);
        let mut c = self.client.clone();
        let r = self.call(&format!("reading {name}"), c.txn(txn)).await?;
        let ops = r.op_responses();
        let get = |i: usize| match ops.get(i) {
            Some(etcd::TxnOpResponse::Get(g)) => Some(g.clone()),
            _ => None,
        };
        let (Some(keys), fence) = (get(0), get(1)) else {
            return Err(AdminError::server(format!(
                "reading {name} on {}: a reply without its reads",
                self.shown
            )));
        };
        let Some(holder) = keys.kvs().first() else {
            return Ok(None);
        };
        let fence = fence.as_ref().and_then(|f| f.kvs().first());
        let left = self.lease_left(holder.lease()).await;
        Ok(Some(self.info(
            name,
            holder,
            fence,
            keys.count().max(1) as u64,
            left,
        )))
    }

    async fn listing(&self, prefix: &str) -> Result<Listing, AdminError> {
        let r = self
            .get(
                format!("{}/{}", self.prefix, escape(prefix)),
                GetOptions::new().with_prefix(),
            )
            .await?;
        let fences = self
            .get(
                format!("{}/.fence/{}", self.prefix, escape(prefix)),
                GetOptions::new().with_prefix(),
            )
            .await?;
        let fences: HashMap<String, &etcd::KeyValue> = fences
            .kvs()
            .iter()
            .filter_map(|kv| match kind_of(&self.prefix, kv.key()) {
                KeyKind::Fence(name) => Some((name, kv)),
                _ => None,
            })
            .collect();
        let mut skipped = 0;
        // name -> (holder: lowest create revision, number of keys)
        let mut by_name: BTreeMap<String, (&etcd::KeyValue, u64)> = BTreeMap::new();
        for kv in r.kvs() {
            match kind_of(&self.prefix, kv.key()) {
                KeyKind::Contender(name) if name.starts_with(prefix) => {
                    let e = by_name.entry(name).or_insert((kv, 0));
                    e.1 += 1;
                    if kv.create_revision() < e.0.create_revision() {
                        e.0 = kv;
                    }
                }
                KeyKind::Contender(_) | KeyKind::Fence(_) | KeyKind::Internal => {}
                KeyKind::Foreign => skipped += 1,
            }
        }
        let mut lefts: HashMap<i64, Option<Duration>> = HashMap::new();
        let mut locks = Vec::with_capacity(by_name.len());
        for (name, (holder, n)) in &by_name {
            let left = match lefts.get(&holder.lease()) {
                Some(l) => *l,
                None => {
                    let l = self.lease_left(holder.lease()).await;
                    lefts.insert(holder.lease(), l);
                    l
                }
            };
            locks.push(self.info(name, holder, fences.get(name).copied(), *n, left));
        }
        Ok(Listing::new(locks, skipped))
    }

    async fn force(
        &self,
        name: &str,
        expected: Option<&LockInfo>,
    ) -> Result<ForceReleased, AdminError> {
        let now = match still_held(self.read(name).await?, expected) {
            Ok(now) => now,
            Err(done) => return Ok(done),
        };
        let key = now
            .details
            .iter()
            .find(|(k, _)| k == "holder key")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        let rev: i64 = now
            .details
            .iter()
            .find(|(k, _)| k == "create revision")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        // Deleted only if it is still the key read (same create revision): a hold that changed
        // hands in between is not touched.
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, rev)])
            .and_then([TxnOp::delete(key.clone(), None)]);
        let mut c = self.client.clone();
        let r = self.call(&format!("deleting {key}"), c.txn(txn)).await?;
        if r.succeeded() {
            let woke = Some(u64::from(now.waiters.unwrap_or(0) > 0));
            return Ok(ForceReleased::Released {
                was: Box::new(now),
                woke,
            });
        }
        Ok(match self.read(name).await? {
            Some(_) => ForceReleased::Changed,
            None => ForceReleased::NotHeld,
        })
    }

    /// True when `lease` has ended (expired or revoked): a key deleted with it went with the
    /// lease, not by a release.
    async fn lease_ended(&self, lease: i64) -> bool {
        if lease == 0 {
            return false;
        }
        let mut c = self.client.clone();
        match tokio::time::timeout(CALL_TIMEOUT, c.lease_time_to_live(lease, None)).await {
            Ok(Ok(r)) => r.ttl() <= 0,
            Ok(Err(e)) => e.to_string().contains("lease not found"),
            Err(_) => false,
        }
    }

    async fn start_watch(&self, prefix: &str) -> Result<Watching, AdminError> {
        // The whole prefix, so that the fence keys (`<prefix>/.fence/`, written at each grant)
        // arrive in revision order with the contender keys; names are filtered here.
        let range = format!("{}/", self.prefix);
        let snap = self
            .get(range.clone(), GetOptions::new().with_prefix())
            .await?;
        let rev = snap.header().map_or(0, |h| h.revision());
        let mut state = WatchState::default();
        for kv in snap.kvs() {
            if let KeyKind::Contender(name) = kind_of(&self.prefix, kv.key())
                && name.starts_with(prefix)
            {
                state.insert(name, kv);
            }
        }
        let mut c = self.client.clone();
        let mut stream = self
            .call(
                &format!("watching {range}"),
                c.watch(
                    range.clone(),
                    Some(
                        WatchOptions::new()
                            .with_prefix()
                            .with_start_revision(rev + 1),
                    ),
                ),
            )
            .await?;
        // The server's `created` answer, so the watch is in place when this returns.
        match tokio::time::timeout(CALL_TIMEOUT, stream.message()).await {
            Ok(Ok(Some(r))) if r.created() && !r.canceled() => {}
            Ok(Ok(Some(r))) => {
                return Err(AdminError::server(format!(
                    "watching {range} on {}: refused ({})",
                    self.shown,
                    r.cancel_reason()
                )));
            }
            Ok(Ok(None)) => {
                return Err(AdminError::connect(format!(
                    "watching {range} on {}: the stream closed",
                    self.shown
                )));
            }
            Ok(Err(e)) => {
                return Err(map(
                    &format!("watching {range} on {}", self.shown),
                    &e,
                    self.secret(),
                ));
            }
            Err(_) => {
                return Err(AdminError::connect(format!(
                    "watching {range}: no answer from {} within {CALL_TIMEOUT:?}",
                    self.shown
                )));
            }
        }
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        let me = self.clone();
        let prefix = prefix.to_string();
        tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    m = stream.message() => m,
                    _ = tx.closed() => return,
                };
                let resp = match msg {
                    Ok(Some(r)) => r,
                    Ok(None) => {
                        let _ = tx
                            .send(Err(AdminError::connect(format!(
                                "{}: the watch stream closed",
                                me.shown
                            ))))
                            .await;
                        return;
                    }
                    Err(e) => {
                        let _ = tx
                            .send(Err(map(
                                &format!("watching on {}", me.shown),
                                &e,
                                me.secret(),
                            )))
                            .await;
                        return;
                    }
                };
                if resp.canceled() {
                    let _ = tx
                        .send(Err(AdminError::server(format!(
                            "{}: the watch was cancelled ({})",
                            me.shown,
                            resp.cancel_reason()
                        ))))
                        .await;
                    return;
                }
                let mut out = Vec::new();
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    match ev.event_type() {
                        etcd::EventType::Put => {
                            let name = match kind_of(&me.prefix, kv.key()) {
                                KeyKind::Contender(name) => name,
                                KeyKind::Fence(name) => {
                                    // A grant writes the name's fence: the acquisition, by the
                                    // lowest key, with the token written.
                                    if name.starts_with(&prefix) {
                                        out.push(LockEvent::Acquired {
                                            owner: state.holder(&name).map(|k| k.owner.clone()),
                                            name,
                                            token: token_of(kv),
                                        });
                                    }
                                    continue;
                                }
                                _ => continue,
                            };
                            if !name.starts_with(&prefix) {
                                continue;
                            }
                            if kv.create_revision() != kv.mod_revision() {
                                // The key moved to a longer lease (its create revision stays).
                                state.insert(name, kv);
                                continue;
                            }
                            if !state.insert(name.clone(), kv) {
                                out.push(LockEvent::Other {
                                    name,
                                    what: "a contender queued".into(),
                                });
                            }
                        }
                        etcd::EventType::Delete => {
                            let Some((name, removed, was_holder, _next)) = state.remove(kv.key())
                            else {
                                continue;
                            };
                            if !was_holder {
                                out.push(LockEvent::Other {
                                    name,
                                    what: "a queued contender left".into(),
                                });
                                continue;
                            }
                            // The next holder's acquisition is its fence write (a Put above).
                            out.push(if me.lease_ended(removed.lease).await {
                                LockEvent::Expired { name }
                            } else {
                                LockEvent::Released { name }
                            });
                        }
                    }
                }
                for e in out {
                    if tx.send(Ok(e)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Watching {
            events: rx,
            sees: "acquisitions (owner and token), releases, lease expiries, contenders \
                   queueing and leaving (a prefix watch)"
                .into(),
            sees_acquisitions: true,
        })
    }
}

/// What the watch knows: the contender keys of every lock, by create revision.
#[derive(Debug, Default)]
struct WatchState {
    locks: BTreeMap<String, BTreeMap<i64, Key>>,
    /// key -> (name, create revision)
    index: HashMap<Vec<u8>, (String, i64)>,
}

/// The token stored in a fence key (fixed-width decimal).
fn token_of(kv: &etcd::KeyValue) -> Option<u64> {
    std::str::from_utf8(kv.value()).ok()?.trim().parse().ok()
}

impl WatchState {
    /// The key that holds `name` (the lowest create revision).
    fn holder(&self, name: &str) -> Option<&Key> {
        self.locks.get(name)?.first_key_value().map(|(_, k)| k)
    }

    /// Records a key (or updates a known one); true when it is a new key that now holds.
    fn insert(&mut self, name: String, kv: &etcd::KeyValue) -> bool {
        let rev = kv.create_revision();
        let queue = self.locks.entry(name.clone()).or_default();
        let new = queue
            .insert(
                rev,
                Key {
                    key: kv.key().to_vec(),
                    owner: owner_of(kv),
                    lease: kv.lease(),
                },
            )
            .is_none();
        self.index.insert(kv.key().to_vec(), (name, rev));
        new && queue.first_key_value().map(|(r, _)| *r) == Some(rev)
    }

    /// Forgets a key: its lock name, the key, whether it held, and the new holder when it did.
    #[allow(clippy::type_complexity)]
    fn remove(&mut self, key: &[u8]) -> Option<(String, Key, bool, Option<(i64, Key)>)> {
        let (name, rev) = self.index.remove(key)?;
        let queue = self.locks.get_mut(&name)?;
        let was_holder = queue.first_key_value().map(|(r, _)| *r) == Some(rev);
        let removed = queue.remove(&rev)?;
        let next = if was_holder {
            queue.first_key_value().map(|(r, k)| (*r, k.clone()))
        } else {
            None
        };
        if queue.is_empty() {
            self.locks.remove(&name);
        }
        debug_assert_eq!(removed.key, key);
        Some((name, removed, was_holder, next))
    }
}

impl Admin for EtcdAdmin {
    fn engine(&self) -> &'static str {
        "etcd"
    }

    fn target(&self) -> String {
        self.shown.clone()
    }

    fn list<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Listing, AdminError>> {
        Box::pin(self.listing(prefix))
    }

    fn show<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<LockInfo>, AdminError>> {
        Box::pin(self.read(name))
    }

    fn force_release<'a>(
        &'a self,
        name: &'a str,
        expected: Option<&'a LockInfo>,
    ) -> BoxFuture<'a, Result<ForceReleased, AdminError>> {
        Box::pin(self.force(name, expected))
    }

    fn watch<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Watching, AdminError>> {
        Box::pin(self.start_watch(prefix))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_classified() {
        let k = |s: &str| kind_of("/dlock", s.as_bytes());
        assert_eq!(
            k(&format!(
                "/dlock/{}/00000000000000ab-0123456789abcdef",
                escape("order:42")
            )),
            KeyKind::Contender("order:42".into())
        );
        assert_eq!(k("/dlock/.cancelled/x/y"), KeyKind::Internal);
        assert_eq!(k("/dlock/.leases/00000000000000ab"), KeyKind::Internal);
        assert_eq!(k("/dlock/.sem/x/00ab-cd"), KeyKind::Internal);
        assert_eq!(k("/dlock/.rw/x/00ab-cd"), KeyKind::Internal);
        assert_eq!(k("/dlock/.record/x"), KeyKind::Internal);
        assert_eq!(k("/dlock/.fence/.sem/x"), KeyKind::Internal);
        assert_eq!(
            k(&format!("/dlock/.fence/{}", escape("order:42"))),
            KeyKind::Fence("order:42".into())
        );
        for f in [
            "/dlock/x",
            "/dlock/x/",
            "/dlock/a:b/c",
            "/dlock/x/y/z",
            "/other/x/y",
        ] {
            assert_eq!(k(f), KeyKind::Foreign, "{f}");
        }
    }
}
