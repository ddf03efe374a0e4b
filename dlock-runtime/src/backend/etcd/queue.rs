//! Semaphores, read-write locks and leader records on etcd.
//!
//! **Entries.** A semaphore `name` keeps one key per holder or waiter under
//! `<prefix>/.sem/<escaped name>/`, a read-write lock under `<prefix>/.rw/<escaped name>/`
//! (both outside every lock name's range: escaped names never start with `.`), named as a lock's
//! contender key (`<lease id hex>-<16 random hex>`, chosen before the create is sent) and put
//! under the backend's shared lease of the ttl's whole seconds, exactly as the lock's keys: the
//! same create-if-absent transaction with the cancel marker, the same to-delete set, reaper and
//! lease rules (see the parent module). The value is a first line saying what the entry is
//! (`p <permits> <max>`, `r` or `w`), the owner id and the holder identity.
//!
//! **Order.** Entries are ordered by create revision (first come, first served):
//! * a semaphore entry holds when its permits plus those of every entry before it are at most
//!   `max` (so a waiter never barges past an earlier one); the first entry's `max` is the name's
//!   `max`, and an entry with another is refused with [`LockError::SemaphoreMax`];
//! * a write entry holds when no entry is before it; a read entry when no write entry is before
//!   it. A queued write entry is the "writer waiting" marker: readers that come after it wait
//!   (writer preference), readers before it hold.
//!
//! **Waiting.** A queued entry watches the entries before it (one watch per waiter, from the
//! revision of its read on) and keeps their set locally: only when the deletes (and, for a
//! read-write lock, a downgrade's put) it hears make it grantable does it wake its waiter, which
//! re-checks in one read-only transaction. A release of `k` permits thus wakes the waiters those
//! permits let in, not every waiter.
//!
//! **Tokens.** Every grant (and a downgrade) writes `max(last + 1, client µs)` to the space's
//! fence key (`<prefix>/.fence/.sem/<escaped name>`, `<prefix>/.fence/.rw/<escaped name>`),
//! comparing its mod revision and the entry's create revision, before the guard is returned, so
//! tokens strictly increase per name in grant order.
//!
//! **Downgrade** puts `r` over the writer's own entry in one transaction with the fence: the
//! entry keeps its create revision, so a writer queued behind it stays behind it, and readers
//! queued between it and the next writer hear the put and go in.
//!
//! **A waiting writer's marker** ends with its ttl unless a try of its owner renews it (the
//! runtime's waiting writer retries at least every half ttl); a wait that ends gives it back
//! at once (`queues_contenders`).

use super::*;
use crate::backend::Record;

/// Which primitive a queue entry belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Space {
    Sem,
    Rw,
}

/// What an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Meta {
    Permits { n: u32, max: u32 },
    Read,
    Write,
}

impl Meta {
    pub(super) fn of(side: RwSide) -> Meta {
        match side {
            RwSide::Read => Meta::Read,
            RwSide::Write => Meta::Write,
        }
    }

    fn encode(self) -> String {
        match self {
            Meta::Permits { n, max } => format!("p {n} {max}"),
            Meta::Read => "r".to_string(),
            Meta::Write => "w".to_string(),
        }
    }

    fn decode(v: &[u8]) -> Option<Meta> {
        let v = std::str::from_utf8(v).ok()?;
        let first = v.split('\n').next()?;
        let mut parts = first.split(' ');
        match parts.next()? {
            "r" => Some(Meta::Read),
            "w" => Some(Meta::Write),
            "p" => {
                let n = parts.next()?.parse().ok()?;
                let max = parts.next()?.parse().ok()?;
                Some(Meta::Permits { n, max })
            }
            _ => None,
        }
    }
}

/// Whether an entry `me` holds given the entries before it.
fn grantable<'a>(me: Meta, mut ahead: impl Iterator<Item = &'a Meta>) -> bool {
    match me {
        Meta::Permits { n, max } => {
            let before: u64 = ahead
                .map(|m| match m {
                    Meta::Permits { n, .. } => u64::from(*n),
                    _ => 0,
                })
                .sum();
            before + u64::from(n) <= u64::from(max)
        }
        Meta::Write => ahead.next().is_none(),
        Meta::Read => !ahead.any(|m| *m == Meta::Write),
    }
}

fn entry_value(meta: Meta, owner: &str) -> Vec<u8> {
    let mut v = meta.encode().into_bytes();
    v.push(b'\n');
    v.extend_from_slice(&key_value(owner));
    v
}

/// One entry of a read.
struct Entry {
    key: String,
    rev: i64,
    meta: Meta,
}

/// The entries of a prefix read, in create-revision order (unreadable ones count as holding
/// nothing: they cannot be ours).
fn entries(kvs: &[etcd::KeyValue]) -> Vec<Entry> {
    let mut v: Vec<Entry> = kvs
        .iter()
        .filter_map(|kv| {
            Some(Entry {
                key: String::from_utf8(kv.key().to_vec()).ok()?,
                rev: kv.create_revision(),
                meta: Meta::decode(kv.value())?,
            })
        })
        .collect();
    v.sort_by_key(|e| e.rev);
    v
}

/// A semaphore or read-write entry of this backend.
#[derive(Debug)]
pub(super) struct QHold {
    key: String,
    lease: Arc<Lease>,
    /// Create revision of the key (0 while the create's reply is unknown).
    rev: i64,
    token: u64,
    held: bool,
    count: u32,
    meta: Meta,
    /// The armed watch on the entries before it: its task, and set once it fired.
    watching: Option<(tokio::task::AbortHandle, Arc<AtomicBool>)>,
    /// A queued write entry (the "writer waiting" marker) lives until then unless renewed.
    marker_until: Option<Instant>,
}

type QKey = (Space, String, String);

impl Inner {
    fn qholds(&self) -> MutexGuard<'_, HashMap<QKey, QHold>> {
        self.qholds.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn q_dir(&self, space: Space, name: &str) -> String {
        match space {
            Space::Sem => format!("{}/.sem/{}/", self.cfg.prefix, escape(name)),
            Space::Rw => format!("{}/.rw/{}/", self.cfg.prefix, escape(name)),
        }
    }

    fn q_fence(&self, space: Space, name: &str) -> String {
        match space {
            Space::Sem => format!("{}/.fence/.sem/{}", self.cfg.prefix, escape(name)),
            Space::Rw => format!("{}/.fence/.rw/{}", self.cfg.prefix, escape(name)),
        }
    }

    fn record_key(&self, name: &str) -> String {
        format!("{}/.record/{}", self.cfg.prefix, escape(name))
    }

    pub(super) fn q_waiters(&self, space: Space, meta: Meta) -> &Arc<WaitQueues> {
        match (space, meta) {
            (Space::Sem, _) => &self.sem_waiters,
            (Space::Rw, Meta::Write) => &self.write_waiters,
            (Space::Rw, _) => &self.read_waiters,
        }
    }

    /// After a delete: wakes the first local waiter of the space's queues that has no queued
    /// entry of its own (a waiter whose try failed): it tries rather than wait for nothing.
    pub(super) fn q_wake_keyless(&self, space: Space, name: &str) {
        let queued: Vec<String> = self
            .qholds()
            .iter()
            .filter(|((s, n, _), h)| *s == space && n == name && !h.held)
            .map(|((_, _, o), _)| o.clone())
            .collect();
        let pick = |o: Option<&str>| o.is_none_or(|o| !queued.iter().any(|q| q == o));
        match space {
            Space::Sem => {
                self.sem_waiters.wake_first_where(name, pick);
            }
            Space::Rw => {
                if !self.write_waiters.wake_first_where(name, pick) {
                    self.read_waiters.wake_first_where(name, pick);
                }
            }
        }
    }

    fn q_forget(&self, h: &QHold) {
        if let Some((t, _)) = &h.watching {
            t.abort();
        }
        let mut u = h.lease.users();
        *u = u.saturating_sub(1);
    }

    /// Gives up an entry (see [`Inner::abandon`]).
    async fn q_abandon(self: &Arc<Self>, hk: &QKey) {
        let Some(h) = self.qholds().remove(hk) else {
            return;
        };
        let key = self.q_start_delete(h, hk);
        let _ = self.delete_on_driver(key, None).await;
    }

    fn q_start_delete(&self, h: QHold, hk: &QKey) -> String {
        if let Some((t, _)) = &h.watching {
            t.abort();
        }
        let held = h.held && !h.lease.dead.load(Ordering::Acquire);
        self.deleting().insert(
            h.key.clone(),
            Deleting {
                space: Some(hk.0),
                name: hk.1.clone(),
                owner: hk.2.clone(),
                lease: h.lease,
                rev: h.rev,
                held,
                orphan: false,
            },
        );
        h.key
    }

    /// Takes (or re-enters) an entry `meta` of `name` in `space` for `owner`.
    pub(super) async fn q_try(
        self: &Arc<Self>,
        space: Space,
        name: &str,
        owner: &str,
        meta: Meta,
        ttl: Duration,
    ) -> Result<Acquired, LockError> {
        let hk: QKey = (space, name.to_string(), owner.to_string());
        let bound = self.bound(ttl);
        let sent = Instant::now();
        let dir = self.q_dir(space, name);
        let existing = {
            let mut holds = self.qholds();
            let h = holds.get_mut(&hk);
            if let Some(h) = &h
                && h.held
                && h.meta == Meta::Read
                && meta == Meta::Write
            {
                return Err(LockError::UpgradeRefused {
                    key: name.to_string(),
                });
            }
            if let Some(h) = h {
                if !h.held && h.marker_until.is_some() {
                    // A waiting writer's retry renews its marker.
                    h.marker_until = Some(sent + ttl);
                }
                if !h.held
                    && !h.lease.dead.load(Ordering::Acquire)
                    && h.watching
                        .as_ref()
                        .is_some_and(|(_, f)| !f.load(Ordering::Acquire))
                {
                    // Still behind entries that hold: no request needed.
                    return Ok(Acquired::Busy {
                        remaining: busy_remaining(h.meta, ttl),
                    });
                }
                Some((h.key.clone(), h.rev, h.held, h.lease.clone(), h.meta))
            } else {
                None
            }
        };
        let fence = self.q_fence(space, name);
        let list_opts = || {
            GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend)
        };
        let (key, rev, lease, all, header_rev, refreshed, last, new_key) = match existing {
            Some((key, rev, held, lease, hmeta))
                if rev > 0 && !lease.dead.load(Ordering::Acquire) =>
            {
                let txn = Txn::new().and_then([
                    TxnOp::get(key.clone(), Some(GetOptions::new().with_keys_only())),
                    TxnOp::get(dir.clone(), Some(list_opts())),
                    TxnOp::get(fence.clone(), None),
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
                if !range_kvs(ops.first())
                    .iter()
                    .any(|kv| kv.create_revision() == rev)
                {
                    if let Some(h) = self.qholds().remove(&hk) {
                        self.q_forget(&h);
                    }
                    if held {
                        return Box::pin(self.q_try(space, name, owner, meta, ttl)).await;
                    }
                    return Err(be(name, "etcd entry vanished (lease lost?)"));
                }
                if held {
                    let mut holds = self.qholds();
                    let Some(h) = holds.get_mut(&hk) else {
                        return Err(be(name, "etcd hold was given back meanwhile"));
                    };
                    h.count = h.count.saturating_add(1);
                    return Ok(Acquired::Granted {
                        token: h.token,
                        count: h.count,
                    });
                }
                let _ = hmeta;
                let hr = r.header().map_or(0, |h| h.revision());
                let all = entries(&range_kvs(ops.get(1)));
                let last = fence_of(range_kvs(ops.get(2)).first());
                (key, rev, lease, all, hr, refreshed, last, false)
            }
            other => {
                if other.is_some() {
                    self.q_abandon(&hk).await;
                }
                let lease = self.lease_for(name, lease_secs(ttl)).await?;
                let mut uid = [0u8; 8];
                if let Err(e) = getrandom::fill(&mut uid) {
                    *lease.users() -= 1;
                    return Err(be(name, e.to_string()));
                }
                let uid: String = uid.iter().map(|b| format!("{b:02x}")).collect();
                let key = format!("{dir}{:016x}-{uid}", lease.id);
                // Recorded before the create is sent: a give-up before the reply deletes it
                // by this name (with the cancel marker).
                self.qholds().insert(
                    hk.clone(),
                    QHold {
                        key: key.clone(),
                        lease: lease.clone(),
                        rev: 0,
                        token: 0,
                        held: false,
                        count: 0,
                        meta,
                        watching: None,
                        marker_until: None,
                    },
                );
                let txn = Txn::new()
                    .when([
                        Compare::create_revision(key.clone(), CompareOp::Equal, 0),
                        Compare::create_revision(self.cancel_marker(&key), CompareOp::Equal, 0),
                    ])
                    .and_then([
                        TxnOp::put(
                            key.clone(),
                            entry_value(meta, owner),
                            Some(PutOptions::new().with_lease(lease.id)),
                        ),
                        TxnOp::get(dir.clone(), Some(list_opts())),
                        TxnOp::get(fence.clone(), None),
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
                        self.q_abandon(&hk).await;
                        return Err(be(name, "etcd entry key already existed"));
                    }
                    Err(e) => {
                        if lease_gone(&e) {
                            self.lease_ended(&lease);
                        }
                        self.q_abandon(&hk).await;
                        return Err(e);
                    }
                };
                let ops = r.op_responses();
                let all = entries(&range_kvs(ops.get(1)));
                let Some(rev) = all.iter().find(|e| e.key == key).map(|e| e.rev) else {
                    self.q_abandon(&hk).await;
                    return Err(be(name, "etcd entry missing right after its create"));
                };
                if let Some(h) = self.qholds().get_mut(&hk) {
                    h.rev = rev;
                }
                let hr = r.header().map_or(rev, |h| h.revision());
                let last = fence_of(range_kvs(ops.get(2)).first());
                (key, rev, lease, all, hr, refreshed, last, true)
            }
        };
        let _ = &lease;
        // The name's max is the first entry's.
        if let (Meta::Permits { max, .. }, Some(first)) = (meta, all.first())
            && let Meta::Permits { max: stored, .. } = first.meta
            && stored != max
        {
            self.q_abandon(&hk).await;
            return Err(LockError::SemaphoreMax {
                key: name.to_string(),
                asked: max,
                stored,
            });
        }
        let ahead: Vec<&Entry> = all.iter().take_while(|e| e.rev < rev).collect();
        if grantable(meta, ahead.iter().map(|e| &e.meta)) {
            if let Some(Err(e)) = refreshed {
                self.q_abandon(&hk).await;
                return Err(e);
            }
            // Grants side by side (permits, readers) meet on the fence: a few more compares.
            let token = match self
                .write_fence_at(fence, 64, name, &key, rev, last, bound)
                .await
            {
                Ok(t) => t,
                Err(e) => {
                    self.q_abandon(&hk).await;
                    return Err(e);
                }
            };
            let mut holds = self.qholds();
            let Some(h) = holds.get_mut(&hk) else {
                return Err(be(name, "etcd acquire was given up"));
            };
            if let Some((t, _)) = h.watching.take() {
                t.abort();
            }
            h.held = true;
            h.count = 1;
            h.token = token;
            h.marker_until = None;
            return Ok(Acquired::Granted { token, count: 1 });
        }
        let waiters = self.q_waiters(space, meta).clone();
        if new_key && meta != Meta::Write && !waiters.has_waiters(name) {
            // A single try (or the first try of a wait, which subscribes and tries again):
            // take the entry back now rather than leave it queued. A writer's stays: it is the
            // "writer waiting" marker.
            let remaining = match (meta, all.first()) {
                (Meta::Permits { .. }, Some(first)) => {
                    self.lease_left(name, &first.key, bound).await
                }
                _ => None,
            };
            self.q_abandon(&hk).await;
            return Ok(Acquired::Busy { remaining });
        }
        if meta == Meta::Write {
            self.arm_marker(&hk, sent + ttl);
        }
        let mut ahead: HashMap<String, Meta> =
            ahead.iter().map(|e| (e.key.clone(), e.meta)).collect();
        let armed = self
            .qholds()
            .get(&hk)
            .and_then(|h| h.watching.as_ref().map(|(_, f)| !f.load(Ordering::Acquire)))
            .unwrap_or(false);
        if !armed {
            // Watch the entries from now (a watch from a past revision is served late, see the
            // lock's predecessor watch); when the store moved since the read, read them again.
            let watched = async {
                let mut opts = etcd::WatchOptions::new().with_prefix();
                if space == Space::Sem {
                    opts = opts.with_filters([etcd::WatchFilterType::NoPut]);
                }
                let mut stream = self
                    .call(name, bound, |mut c| {
                        let d = dir.clone();
                        let o = opts.clone();
                        async move { c.watch(d, Some(o)).await }
                    })
                    .await?;
                let created = match tokio::time::timeout(bound, stream.message()).await {
                    Ok(Ok(Some(r))) if r.created() && !r.canceled() => {
                        r.header().map_or(i64::MAX, |h| h.revision())
                    }
                    Ok(Err(e)) => return Err(be(name, e)),
                    _ => return Err(be(name, "etcd watch on the entries was not created")),
                };
                if created > header_rev {
                    let d = dir.clone();
                    let r = self
                        .call_idem(name, bound, |mut c| {
                            let d = d.clone();
                            async move { c.get(d, Some(GetOptions::new().with_prefix())).await }
                        })
                        .await?;
                    ahead = entries(r.kvs())
                        .into_iter()
                        .filter(|e| e.rev < rev)
                        .map(|e| (e.key, e.meta))
                        .collect();
                }
                Ok::<_, LockError>(stream)
            };
            let stream = match watched.await {
                Ok(s) => s,
                Err(e) => {
                    self.q_abandon(&hk).await;
                    return Err(e);
                }
            };
            let fired = Arc::new(AtomicBool::new(false));
            let task = self.driver.handle.spawn(watch_entries(
                Arc::downgrade(self),
                stream,
                waiters,
                name.to_string(),
                owner.to_string(),
                meta,
                ahead,
                fired.clone(),
            ));
            let mut holds = self.qholds();
            match holds.get_mut(&hk) {
                Some(h) => {
                    if let Some((old, _)) = h.watching.replace((task.abort_handle(), fired)) {
                        old.abort();
                    }
                }
                None => task.abort(),
            }
        }
        Ok(Acquired::Busy {
            remaining: busy_remaining(meta, ttl),
        })
    }

    /// The time left on the lease of the entry `key` (named by its lease id), for a busy reply.
    async fn lease_left(&self, name: &str, key: &str, bound: Duration) -> Option<Duration> {
        let tail = key.rsplit('/').next()?;
        let id = i64::from_str_radix(tail.split('-').next()?, 16).ok()?;
        let r = self
            .call_idem(name, bound, |mut c| async move {
                c.lease_time_to_live(id, None).await
            })
            .await
            .ok()?;
        (r.ttl() > 0).then(|| Duration::from_secs(r.ttl() as u64))
    }

    /// A queued write entry (the "writer waiting" marker) ends at `until` unless a retry of its
    /// owner renews it (a writer that stopped waiting without giving it back: readers are not
    /// held back for longer than its ttl).
    fn arm_marker(self: &Arc<Self>, hk: &QKey, until: Instant) {
        let first = {
            let mut holds = self.qholds();
            let Some(h) = holds.get_mut(hk) else {
                return;
            };
            let first = h.marker_until.is_none();
            h.marker_until = Some(h.marker_until.map_or(until, |u| u.max(until)));
            first
        };
        if !first {
            return;
        }
        let me = Arc::downgrade(self);
        let hk = hk.clone();
        self.driver.handle.spawn(async move {
            loop {
                let until = {
                    let Some(me) = me.upgrade() else { return };
                    let holds = me.qholds();
                    match holds
                        .get(&hk)
                        .and_then(|h| h.marker_until.filter(|_| !h.held))
                    {
                        Some(u) => u,
                        None => return,
                    }
                };
                tokio::time::sleep_until(until).await;
                let Some(me) = me.upgrade() else { return };
                let expired = me
                    .qholds()
                    .get(&hk)
                    .and_then(|h| h.marker_until.filter(|_| !h.held))
                    .is_some_and(|u| u <= Instant::now());
                if expired {
                    me.q_abandon(&hk).await;
                    return;
                }
            }
        });
    }

    /// Gives back `owner`'s entry: one hold (all with `all`; a semaphore's always all).
    pub(super) async fn q_release(
        self: &Arc<Self>,
        space: Space,
        side: Option<Meta>,
        name: &str,
        owner: &str,
        all: bool,
    ) -> Result<Released, LockError> {
        let hk: QKey = (space, name.to_string(), owner.to_string());
        let h = {
            let mut holds = self.qholds();
            match holds.get_mut(&hk) {
                None => None,
                // A read release of a write hold re-entered as a reader is one of its holds;
                // a write release of a read hold is not this owner's.
                Some(h) if side == Some(Meta::Write) && h.meta == Meta::Read => {
                    return Ok(Released::NotOwner);
                }
                Some(h) if h.held && h.count > 1 && !all => {
                    h.count -= 1;
                    return Ok(Released::Decremented(h.count));
                }
                Some(_) => holds.remove(&hk),
            }
        };
        let Some(h) = h else {
            return self.q_release_again(&hk).await;
        };
        let key = self.q_start_delete(h, &hk);
        let held = self.deleting().get(&key).is_some_and(|d| d.held);
        match self.delete_on_driver(key, None).await {
            Ok(Ok(true)) if held => Ok(Released::Freed),
            Ok(Ok(_)) => Ok(Released::NotOwner),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(be(name, e)),
        }
    }

    /// See [`Inner::release_again`].
    async fn q_release_again(self: &Arc<Self>, hk: &QKey) -> Result<Released, LockError> {
        let found = self
            .deleting()
            .iter()
            .find(|(_, d)| d.space == Some(hk.0) && d.name == hk.1 && d.owner == hk.2)
            .map(|(k, d)| (k.clone(), d.orphan, d.held));
        let Some((key, orphan, held)) = found else {
            return Ok(Released::NotOwner);
        };
        if !orphan {
            return Err(be(
                &hk.1,
                "etcd: the delete of this entry is still in flight",
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
            Err(e) => Err(be(&hk.1, e)),
        }
    }

    /// Refreshes the lease of `owner`'s held entry and checks that the entry is still there
    /// (see [`Inner::extend`]); a longer ttl moves the entry to a longer lease (same key, same
    /// create revision, so the same place).
    pub(super) async fn q_extend(
        self: &Arc<Self>,
        space: Space,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Extended, LockError> {
        let hk: QKey = (space, name.to_string(), owner.to_string());
        let Some((key, rev, lease, meta)) = self
            .qholds()
            .get(&hk)
            .filter(|h| h.held)
            .map(|h| (h.key.clone(), h.rev, h.lease.clone(), h.meta))
        else {
            return Ok(Extended::Lost);
        };
        if lease.dead.load(Ordering::Acquire) {
            return Ok(Extended::Lost);
        }
        let bound = self.bound(ttl);
        if lease_secs(ttl) > lease.secs {
            let new = self.lease_for(name, lease_secs(ttl)).await?;
            let txn = Txn::new()
                .when([Compare::create_revision(key.clone(), CompareOp::Equal, rev)])
                .and_then([TxnOp::put(
                    key,
                    entry_value(meta, owner),
                    Some(PutOptions::new().with_lease(new.id)),
                )]);
            let r = self
                .call(name, bound, |mut c| {
                    let t = txn.clone();
                    async move { c.txn(t).await }
                })
                .await;
            let ok = matches!(&r, Ok(r) if r.succeeded());
            let moved = ok
                && match self.qholds().get_mut(&hk) {
                    Some(h) if h.rev == rev => {
                        h.lease = new.clone();
                        true
                    }
                    _ => false,
                };
            if moved {
                *lease.users() -= 1;
                return Ok(Extended::Extended);
            }
            *new.users() -= 1;
            // Not moved: the put may still land (outcome unknown) on the new lease, which this
            // hold does not count; keep the old lease counted and report the error.
            return match r {
                Err(e) => Err(e),
                Ok(_) => Ok(Extended::Lost),
            };
        }
        let id = lease.id;
        let ksent = Instant::now();
        let keep = self.call_idem(name, bound, |c| async move {
            c.lease_client().keep_alive(id).await
        });
        let get = self.call_idem(name, bound, |mut c| {
            let k = key.clone();
            async move { c.get(k, Some(GetOptions::new().with_keys_only())).await }
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
        if g?.kvs().iter().any(|kv| kv.create_revision() == rev) {
            Ok(Extended::Extended)
        } else {
            Ok(Extended::Lost)
        }
    }

    /// Turns `owner`'s write entry into a read entry in one transaction with a new token.
    pub(super) async fn q_downgrade(
        self: &Arc<Self>,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Option<u64>, LockError> {
        let hk: QKey = (Space::Rw, name.to_string(), owner.to_string());
        let Some((key, rev, lease)) = self
            .qholds()
            .get(&hk)
            .filter(|h| h.held && h.meta == Meta::Write)
            .map(|h| (h.key.clone(), h.rev, h.lease.clone()))
        else {
            return Ok(None);
        };
        let bound = self.bound(ttl);
        let fence = self.q_fence(Space::Rw, name);
        let f = fence.clone();
        let r = self
            .call_idem(name, bound, |mut c| {
                let f = f.clone();
                async move { c.get(f, None).await }
            })
            .await?;
        let mut last = fence_of(r.kvs().first());
        for _ in 0..64 {
            let token = (last.0 + 1).max(now_micros());
            let txn = Txn::new()
                .when([
                    Compare::create_revision(key.clone(), CompareOp::Equal, rev),
                    Compare::mod_revision(fence.clone(), CompareOp::Equal, last.1),
                ])
                .and_then([
                    TxnOp::put(
                        key.clone(),
                        entry_value(Meta::Read, owner),
                        Some(PutOptions::new().with_lease(lease.id)),
                    ),
                    TxnOp::put(fence.clone(), fence_value(token), None),
                ])
                .or_else([
                    TxnOp::get(fence.clone(), None),
                    TxnOp::get(key.clone(), Some(GetOptions::new().with_count_only())),
                ]);
            let r = self
                .call(name, bound, |mut c| {
                    let t = txn.clone();
                    async move { c.txn(t).await }
                })
                .await?;
            if r.succeeded() {
                let mut holds = self.qholds();
                if let Some(h) = holds.get_mut(&hk) {
                    h.meta = Meta::Read;
                    h.count = 1;
                    h.token = token;
                }
                return Ok(Some(token));
            }
            let ops = r.op_responses();
            if !matches!(ops.get(1), Some(etcd::TxnOpResponse::Get(g)) if g.count() > 0) {
                return Ok(None);
            }
            last = fence_of(range_kvs(ops.first()).first());
        }
        Err(be(name, "etcd fence key kept changing"))
    }

    /// Writes the leader record of `name` unless a larger epoch is stored (one transaction:
    /// the value `<epoch, 20 digits>\n<value>` compared byte-wise).
    pub(super) async fn put_record(
        &self,
        name: &str,
        epoch: u64,
        value: &str,
    ) -> Result<bool, LockError> {
        let key = self.record_key(name);
        let stored = format!("{epoch:020}\n{value}");
        // Every value of an epoch <= `epoch` sorts below this bound (`\n` < `\x0b`).
        let bound_value = format!("{epoch:020}\x0b");
        let put = || TxnOp::put(key.clone(), stored.clone(), None);
        let txn = Txn::new()
            .when([Compare::value(key.clone(), CompareOp::Less, bound_value)])
            .and_then([put()])
            .or_else([TxnOp::txn(
                Txn::new()
                    .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                    .and_then([put()]),
            )]);
        // Idempotent: a second delivery writes the same value, or is refused by a later epoch.
        let r = self
            .call_idem(name, self.cfg.request_timeout, |mut c| {
                let t = txn.clone();
                async move { c.txn(t).await }
            })
            .await?;
        if r.succeeded() {
            return Ok(true);
        }
        Ok(matches!(
            r.op_responses().first(),
            Some(etcd::TxnOpResponse::Txn(t)) if t.succeeded()
        ))
    }

    pub(super) async fn get_record(&self, name: &str) -> Result<Option<Record>, LockError> {
        let key = self.record_key(name);
        let r = self
            .call_idem(name, self.cfg.request_timeout, |mut c| {
                let k = key.clone();
                async move { c.get(k, None).await }
            })
            .await?;
        let Some(kv) = r.kvs().first() else {
            return Ok(None);
        };
        let v = String::from_utf8_lossy(kv.value());
        let (e, value) = v.split_once('\n').unwrap_or((&v, ""));
        let epoch = e
            .trim()
            .parse()
            .map_err(|_| be(name, "etcd leader record is not `epoch\\nvalue`"))?;
        Ok(Some(Record {
            epoch,
            value: value.to_string(),
        }))
    }
}

/// A busy reply's `remaining`: a waiting writer is told to retry within half its ttl (the retry
/// renews its marker); others wait for their watch.
fn busy_remaining(meta: Meta, ttl: Duration) -> Option<Duration> {
    (meta == Meta::Write).then(|| (ttl / 2).max(Duration::from_millis(50)))
}

/// Follows the entries before a queued one (`ahead`, kept from the deletes and puts it hears)
/// and wakes its waiter once they let it hold (or the watch ended: it re-checks).
#[allow(clippy::too_many_arguments)]
async fn watch_entries(
    me: std::sync::Weak<Inner>,
    mut stream: etcd::WatchStream,
    waiters: Arc<WaitQueues>,
    name: String,
    owner: String,
    meta: Meta,
    mut ahead: HashMap<String, Meta>,
    fired: Arc<AtomicBool>,
) {
    while !grantable(meta, ahead.values()) {
        let Ok(Some(resp)) = stream.message().await else {
            break;
        };
        if resp.canceled() {
            break;
        }
        for e in resp.events() {
            let Some(kv) = e.kv() else { continue };
            let Ok(k) = std::str::from_utf8(kv.key()) else {
                continue;
            };
            match e.event_type() {
                etcd::EventType::Delete => {
                    ahead.remove(k);
                }
                etcd::EventType::Put => {
                    if let Some(m) = ahead.get_mut(k)
                        && let Some(new) = Meta::decode(kv.value())
                    {
                        *m = new;
                    }
                }
            }
        }
    }
    fired.store(true, Ordering::Release);
    if let Some(me) = me.upgrade() {
        me.notifications.fetch_add(1, Ordering::Relaxed);
    }
    waiters.wake_owner(&name, &owner);
}
