//! Redlock: one lock over N independent Redis masters, held when a majority (N/2 + 1) granted it.
//!
//! Built by composing one [`RedisBackend`] per node through the [`Backend`] trait: every
//! operation runs the single-node script on every node in parallel, each node bounded by the
//! per-node timeout, and the outcome is decided as soon as the votes for or against reach a
//! quorum (a slow or stopped node does not slow the call).
//!
//! * **Validity.** A grant is valid for `ttl - elapsed - drift` from the send time, with
//!   `drift = ttl × drift_factor + drift_fixed` (default 1 % + 2 ms). The guard's deadline is
//!   that validity ([`Backend::lease_margin`] returns the drift).
//! * **Clean-up.** A failed acquire, and every release, runs the release script on every node,
//!   including those that did not answer in time (after their acquire finished). A failed
//!   try's clean-up runs to its end in a task of its own; this owner's next try on that node
//!   waits for it. A clean-up can still run on a node after that (retried by the node's
//!   backend, or a timed-out release delivered late), so the runtime sends every try under an
//!   owner id of its own, also after a busy answer ([`Backend::fresh_owner_per_try`]): a late
//!   clean-up then only meets its own try's grants, never a later try's. It publishes no wake-up when the try's busy answers (which name the holder)
//!   show one owner on a quorum: that owner's release wakes the waiters (issue 19: otherwise
//!   each waiter woken took the freed node again, failed and woke the next, for the whole hold).
//! * **Restarted nodes.** A node whose `run_id` changed (or that this backend first reaches
//!   after start-up) is not counted toward a quorum until the restart delay (default: the
//!   longest ttl in use) has passed since it came back; nor is a node whose server process
//!   started less than the restart delay ago (`uptime_in_seconds`, read with the `run_id`), so
//!   a process that never saw a restart (one started after it) does not count it either. The
//!   `run_id` is read (`INFO server`) once per data connection, which
//!   is then named (`CLIENT SETNAME`) in the same pipeline; every acquire and renewal sends
//!   `CLIENT GETNAME` behind its script on the same connection. A connection does not outlive
//!   its server process, so an answer with a name this backend gave names the process whose
//!   `run_id` was read with it; any other answer (a connection opened after a reconnect has no
//!   name) reads the `run_id` again, after the script, so it names the process the script ran
//!   on or a later one. This costs a cheap `CLIENT GETNAME` per call instead of an
//!   `INFO server`.
//! * **Fencing token.** Each node mints `max(last + 1, its TIME in µs)`; the grant's token is
//!   the largest among the counted grants, and it is written back (`fence.lua`: the node's
//!   `last` becomes at least that token) before the guard is returned, until a quorum of nodes
//!   confirmed it while the name was free there or held by this owner. Any later grant is
//!   decided on a quorum, which shares a node with that one, so its token is larger, whatever
//!   the nodes' clock offsets (within the fence key's life, see docs/redlock.md). A node whose own
//!   grant minted the token needs no write; the others cost one more round trip. Without a
//!   quorum of confirmations in time the grant is given back and the try fails.
//! * **Waiting.** Local waiters of a name share one subscription per node; a release publishes
//!   on every node it freed, and those messages are merged so that one release wakes one local
//!   waiter; a message heard while a try of the name runs here is held until the try ends, and
//!   dropped if it was granted. Across processes, each node keeps the single-node backend's
//!   waiters' queue (`dlock:{E}:q`, see [`RedisBackend`]): a busy try queues this process on
//!   every node that answered busy (its answer still names the holder), and a node's release
//!   wakes only the oldest live process queued there, so one release wakes one process (the
//!   nodes' queues hold the processes in the same order, as their tries reach every node in
//!   parallel; where they differ, each node wakes its own head and at most one process per node
//!   tries). A woken process that does not try has its turn passed on by each node's stall
//!   rule. Only the wake-ups changed: the scripts' lock and token logic, the owner ids and
//!   the order of a try and its give-back are as before.

pub(crate) mod admin;

use futures_util::future::join_all;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::redis::{RedisBackend, RedisBackendBuilder};
use super::{Acquired, Backend, BoxFuture, Extended, Released, Watch};
use crate::LockError;
use crate::wait::WaitQueues;

/// Settings of a [`RedlockBackend`]; start with [`RedlockBackend::builder`].
#[derive(Debug, Clone)]
pub struct RedlockBuilder {
    nodes: Vec<RedisBackendBuilder>,
    node_timeout: Duration,
    drift_factor: f64,
    drift_fixed: Duration,
    restart_delay: Option<Duration>,
}

impl RedlockBuilder {
    /// How long one node may take to answer an acquire, extend or release before its vote
    /// counts against (default 50 ms). Keep it small against the ttl.
    pub fn node_timeout(mut self, t: Duration) -> Self {
        self.node_timeout = t;
        self
    }

    /// The clock-drift allowance: `ttl × factor + fixed` is taken off every lease's validity
    /// (default `0.01` and 2 ms, as in the Redlock description).
    pub fn drift(mut self, factor: f64, fixed: Duration) -> Self {
        self.drift_factor = factor;
        self.drift_fixed = fixed;
        self
    }

    /// How long a restarted node (changed `run_id`) is left out of quorums. Default: the longest
    /// ttl this backend has used so far. Set it when other processes use longer ttls.
    pub fn restart_delay(mut self, d: Duration) -> Self {
        self.restart_delay = Some(d);
        self
    }

    /// Changes the settings of every node's [`RedisBackend`] (timeouts, TLS root, ...).
    pub fn map_nodes(mut self, f: impl Fn(RedisBackendBuilder) -> RedisBackendBuilder) -> Self {
        self.nodes = self.nodes.into_iter().map(f).collect();
        self
    }

    /// Checks the URLs without connecting; connections are made on first use, and every node is
    /// treated as freshly seen (left out of quorums for the restart delay) until reached.
    pub fn build(self) -> Result<RedlockBackend, LockError> {
        if self.nodes.is_empty() {
            return Err(LockError::Config(
                "Redlock needs at least one node URL".into(),
            ));
        }
        if !(self.drift_factor >= 0.0 && self.drift_factor < 1.0) {
            return Err(LockError::Config(
                "Redlock drift factor must be in [0, 1)".into(),
            ));
        }
        if self.node_timeout.is_zero() || self.node_timeout > MAX_NODE_TIMEOUT {
            return Err(LockError::Config(format!(
                "Redlock node timeout must be positive and at most {MAX_NODE_TIMEOUT:?} (got {:?})",
                self.node_timeout
            )));
        }
        if self.drift_fixed > crate::Lock::MAX_DURATION {
            return Err(LockError::Config(format!(
                "Redlock fixed drift must be at most {:?} (got {:?})",
                crate::Lock::MAX_DURATION,
                self.drift_fixed
            )));
        }
        if let Some(d) = self.restart_delay
            && d > crate::Lock::MAX_DURATION
        {
            return Err(LockError::Config(format!(
                "Redlock restart delay must be at most {:?} (got {d:?})",
                crate::Lock::MAX_DURATION
            )));
        }
        let mut nodes = Vec::with_capacity(self.nodes.len());
        for b in self.nodes {
            nodes.push(Node {
                backend: b.build()?,
                state: Mutex::new(NodeState::default()),
            });
        }
        let quorum = nodes.len() / 2 + 1;
        let proxies: Arc<Mutex<HashMap<String, Proxy>>> = Arc::default();
        let queues_cell: Arc<OnceLock<Weak<WaitQueues>>> = Arc::default();
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
        Ok(RedlockBackend {
            inner: Arc::new(Inner {
                nodes,
                quorum,
                node_timeout: self.node_timeout,
                drift_factor: self.drift_factor,
                drift_fixed: self.drift_fixed,
                restart_delay: self.restart_delay,
                max_ttl_ms: AtomicU64::new(0),
                queues,
                proxies,
                next_proxy: AtomicU64::new(0),
                dirty: Mutex::new(HashMap::new()),
                wake: Mutex::new(HashMap::new()),
                held: Mutex::new(HashSet::new()),
                inflight: Mutex::new(HashMap::new()),
                next_try: AtomicU64::new(0),
            }),
        })
    }

    /// Builds and reaches every node once (reading its `run_id`); fails unless a quorum answers.
    /// A node that started less than the restart delay ago (its `uptime_in_seconds`) is not
    /// counted until the delay has passed since its start: it may have restarted without
    /// persistence while another process held locks on it.
    pub async fn connect(self) -> Result<RedlockBackend, LockError> {
        runtime()?;
        let b = self.build()?;
        let t = b.inner.node_timeout.max(Duration::from_secs(2));
        let futs = b.inner.nodes.iter().map(|n| async move {
            let conn_name = new_conn_name();
            match tokio::time::timeout(t, n.backend.name_data_conn(&conn_name)).await {
                Ok(Ok((id, uptime))) => {
                    {
                        let mut st = n.lock_state();
                        st.remember_conn(conn_name, id.clone());
                        st.run_id = Some(id);
                        st.note_uptime(Instant::now(), uptime);
                    }
                    let _ = tokio::time::timeout(t, n.backend.load_scripts()).await;
                    let _ = tokio::time::timeout(t, n.backend.load_fence_script()).await;
                    Ok(())
                }
                Ok(Err(e)) => Err(format!("{}: {e}", n.backend.url())),
                Err(_) => Err(format!("{}: no answer within {t:?}", n.backend.url())),
            }
        });
        let results = join_all(futs).await;
        let ok = results.iter().filter(|r| r.is_ok()).count();
        if ok < b.inner.quorum {
            let errs: Vec<String> = results.into_iter().filter_map(Result::err).collect();
            return Err(LockError::backend(
                "",
                format!(
                    "Redlock: only {ok} of {} nodes answered (a quorum is {}): {}",
                    b.inner.nodes.len(),
                    b.inner.quorum,
                    errs.join("; ")
                ),
            ));
        }
        Ok(b)
    }
}

/// Locks held by a majority of N independent Redis masters (the Redlock algorithm).
///
/// Cheap to clone. See the module documentation for the rules, and docs/redlock.md for what it
/// promises: Redlock depends on bounded clock drift and on process pauses shorter than the
/// validity, which a single server does not.
#[derive(Clone)]
pub struct RedlockBackend {
    inner: Arc<Inner>,
}

struct Inner {
    nodes: Vec<Node>,
    quorum: usize,
    node_timeout: Duration,
    drift_factor: f64,
    drift_fixed: Duration,
    restart_delay: Option<Duration>,
    /// The longest ttl this backend was asked for, in ms (the default restart delay).
    max_ttl_ms: AtomicU64,
    queues: Arc<WaitQueues>,
    /// One subscription set per waited-on name.
    proxies: Arc<Mutex<HashMap<String, Proxy>>>,
    next_proxy: AtomicU64,
    /// (node, name, owner) whose clean-up after a failed acquire is still pending on that node,
    /// with a receiver that turns true once it ran: a later try of that owner there is sent
    /// after it (bounded), else its vote counts against.
    dirty: Mutex<HashMap<NodeCall, tokio::sync::watch::Receiver<Option<bool>>>>,
    /// Per waited-on name: this backend's tries in flight, and whether a release was heard
    /// meanwhile (see `run_proxy`).
    wake: Mutex<HashMap<String, WakeState>>,
    /// (name, owner) holds this backend granted to its caller and that were not given back
    /// entirely yet: a try of such an owner is a re-entry. Decided here rather than from the
    /// replies (a count above 1), which a fresh owner meeting its own leftover hold from an
    /// earlier try also gives (review redis-family #9).
    held: Mutex<HashSet<(String, String)>>,
    /// Acquire calls still running on a node, by (node, name, owner): a quorum may grant before a
    /// slow node answered, and that node's release must not overtake its acquire (it would find
    /// nothing to free, and the acquire would then leave a hold for the whole ttl). Each entry
    /// is (try id, a receiver that turns true when the call has ended); removed by the call.
    inflight: Mutex<HashMap<NodeCall, Vec<CallEnd>>>,
    next_try: AtomicU64,
}

/// Tries of one name in flight in this backend, and whether a node published a release
/// meanwhile (its wake-up is held until the tries end, and dropped if one was granted).
#[derive(Default)]
struct WakeState {
    trying: usize,
    heard: bool,
}

/// Ends one try in `Inner::wake` (also when the try's future is dropped): a release heard
/// during the tries wakes a local waiter once none is left, unless one was granted.
struct Trying<'a> {
    inner: &'a Inner,
    name: &'a str,
    granted: bool,
}

impl Drop for Trying<'_> {
    fn drop(&mut self) {
        let wake = {
            let mut map = self.inner.wake.lock().unwrap_or_else(|e| e.into_inner());
            let Some(st) = map.get_mut(self.name) else {
                return;
            };
            st.trying = st.trying.saturating_sub(1);
            if self.granted {
                st.heard = false;
            }
            // A release heard while a try was in flight may have freed a node after that
            // try's script ran there: it wakes, unless a try here was granted.
            let wake = st.trying == 0 && std::mem::take(&mut st.heard);
            if st.trying == 0 {
                map.remove(self.name);
            }
            wake
        };
        if wake {
            self.inner.queues.wake_one_unless_pending(self.name);
        }
    }
}

struct Node {
    backend: RedisBackend,
    state: Mutex<NodeState>,
}

#[derive(Default)]
struct NodeState {
    run_id: Option<String>,
    /// Not counted toward quorums before this instant (came back from a restart).
    excluded_until: Option<Instant>,
    /// When the node's server process started (now − `uptime_in_seconds`, read with the
    /// `run_id`): not counted before the restart delay has passed since then, also when this
    /// process never saw the restart (review redis-family #6).
    started: Option<Instant>,
    /// Names given to data connections (`CLIENT SETNAME`), each with the `run_id` read on that
    /// connection in the same pipeline.
    conn_names: HashMap<String, String>,
}

/// Connection names kept per node; beyond this (many runtimes, many reconnects) all are
/// forgotten, and each live connection is named again at its next call.
const MAX_CONN_NAMES: usize = 64;

/// A name for a new data connection to a node, unique in this process.
fn new_conn_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "dlock-redlock-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

impl NodeState {
    /// Remembers that the connection named `name` reached the process with this `run_id`.
    fn remember_conn(&mut self, name: String, run_id: String) {
        if self.conn_names.len() >= MAX_CONN_NAMES {
            self.conn_names.clear();
        }
        self.conn_names.insert(name, run_id);
    }

    /// Records the node process's start from its `uptime_in_seconds` (whole seconds, rounded
    /// down, so the start is taken as up to a second later than it was: a longer exclusion).
    fn note_uptime(&mut self, now: Instant, uptime: Option<u64>) {
        self.started = uptime.and_then(|u| now.checked_sub(Duration::from_secs(u)));
    }

    /// True when the node is out of its restart exclusion at `now` (`delay`: the restart delay).
    fn counts_now(&mut self, now: Instant, delay: Duration) -> bool {
        // Kept after the delay passed: a longer ttl used later lengthens the delay.
        if let Some(s) = self.started
            && now.saturating_duration_since(s) < delay
        {
            return false;
        }
        match self.excluded_until {
            Some(t) if now < t => false,
            Some(_) => {
                self.excluded_until = None;
                true
            }
            None => true,
        }
    }
}

impl Node {
    fn lock_state(&self) -> std::sync::MutexGuard<'_, NodeState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct Proxy {
    id: u64,
    stop: tokio_util::sync::CancellationToken,
    ready: tokio::sync::watch::Receiver<bool>,
}

impl fmt::Debug for RedlockBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let urls: Vec<&str> = self.inner.nodes.iter().map(|n| n.backend.url()).collect();
        f.debug_struct("RedlockBackend")
            .field("nodes", &urls)
            .field("quorum", &self.inner.quorum)
            .field("node_timeout", &self.inner.node_timeout)
            .finish_non_exhaustive()
    }
}

/// The largest per-node timeout a builder accepts (larger ones are a `Config` error).
const MAX_NODE_TIMEOUT: Duration = Duration::from_secs(3600);

/// The current tokio runtime: the backend spawns a task per node, which needs one. Outside a
/// runtime this is a `Config` error (as on the single-node backend), never a panic.
fn runtime() -> Result<tokio::runtime::Handle, LockError> {
    tokio::runtime::Handle::try_current().map_err(|_| {
        LockError::Config("dlock's Redlock backend must be used inside a tokio runtime".into())
    })
}

/// How long a node's release waits for this owner's acquire on that node to end. The acquire
/// is itself bounded by the node connection's response timeout (1 s by default), so this only
/// stops a release from waiting on a call that somehow outlives its own bound.
const INFLIGHT_BOUND: Duration = Duration::from_secs(5);

/// How long a clean-up that a node did not confirm keeps refusing its owner's tries there
/// (its release is retried in the background meanwhile, within 30 s).
const UNCONFIRMED_CLEAN_UP: Duration = Duration::from_secs(30);

/// (node index, lock name, owner id).
type NodeCall = (usize, String, String);
/// (try id, a receiver that turns true when the call has ended).
type CallEnd = (u64, tokio::sync::watch::Receiver<bool>);

/// An acquire call registered in `Inner::inflight`; dropped when the call's task ends.
struct Tracked {
    inner: Arc<Inner>,
    key: NodeCall,
    id: u64,
    done: tokio::sync::watch::Sender<bool>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let _ = self.done.send(true);
        let mut map = self
            .inner
            .inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(v) = map.get_mut(&self.key) {
            v.retain(|(id, _)| *id != self.id);
            if v.is_empty() {
                map.remove(&self.key);
            }
        }
    }
}

/// One node's answer to an acquire or extend, and whether it counts toward a quorum.
type NodeReply<T> = (usize, Result<(T, bool), LockError>);

impl RedlockBackend {
    /// Starts building a Redlock backend over these node URLs (each a `redis://` URL of an
    /// independent master; an odd count, 3 or 5, is typical).
    pub fn builder<I, S>(urls: I) -> RedlockBuilder
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        RedlockBuilder {
            nodes: urls
                .into_iter()
                .map(|u| {
                    RedisBackend::builder(u.as_ref())
                        .response_timeout(Duration::from_secs(1))
                        .connection_timeout(Duration::from_millis(250))
                        .reconnect_retries(1)
                })
                .collect(),
            node_timeout: Duration::from_millis(50),
            drift_factor: 0.01,
            drift_fixed: Duration::from_millis(2),
            restart_delay: None,
        }
    }

    /// Connects with default settings; see [`RedlockBackend::builder`].
    pub async fn connect<I, S>(urls: I) -> Result<Self, LockError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::builder(urls).connect().await
    }

    /// Number of nodes.
    pub fn node_count(&self) -> usize {
        self.inner.nodes.len()
    }

    /// Votes needed for a grant: N/2 + 1.
    pub fn quorum(&self) -> usize {
        self.inner.quorum
    }

    /// The drift allowance for a lease of `ttl`.
    pub fn drift(&self, ttl: Duration) -> Duration {
        self.inner.drift(ttl)
    }

    /// Number of local waiters on this backend.
    pub fn waiter_count(&self) -> usize {
        self.inner.queues.waiter_count()
    }
}

impl Inner {
    fn drift(&self, ttl: Duration) -> Duration {
        Duration::try_from_secs_f64(ttl.as_secs_f64() * self.drift_factor)
            .unwrap_or(Duration::MAX)
            .saturating_add(self.drift_fixed)
    }

    fn note_ttl(&self, ttl: Duration) {
        self.max_ttl_ms.fetch_max(
            ttl.as_millis().min(u64::MAX as u128) as u64,
            Ordering::Relaxed,
        );
    }

    fn restart_delay(&self) -> Duration {
        self.restart_delay
            .unwrap_or_else(|| Duration::from_millis(self.max_ttl_ms.load(Ordering::Relaxed)))
    }

    /// Whether a reply from node `i` that came back with `CLIENT GETNAME` answering
    /// `conn_name` counts toward a quorum: `None` when that name is not one this backend gave
    /// or its `run_id` is not the node's current one (the `run_id` must be read again), else
    /// whether the node is out of its restart exclusion.
    fn counts_by_conn_name(&self, i: usize, conn_name: Option<&str>) -> Option<bool> {
        let mut st = self.nodes[i].lock_state();
        let id = st.conn_names.get(conn_name?)?;
        if st.run_id.as_deref() != Some(id.as_str()) {
            // The node's run_id changed since this connection was named (a late reply from a
            // process it was restarted from, or the reverse): read it again.
            return None;
        }
        Some(st.counts_now(Instant::now(), self.restart_delay()))
    }

    /// Whether node `i`'s reply counts toward a quorum, given the answer of the
    /// `CLIENT GETNAME` sent behind it: reads the `run_id` again (naming the connection) when
    /// the connection is not one this backend named.
    async fn counts(&self, i: usize, backend: &RedisBackend, conn_name: Option<String>) -> bool {
        if let Some(counted) = self.counts_by_conn_name(i, conn_name.as_deref()) {
            return counted;
        }
        let name = new_conn_name();
        match backend.name_data_conn(&name).await {
            Ok((id, uptime)) => {
                self.nodes[i].lock_state().remember_conn(name, id.clone());
                self.note_run_id(i, id, uptime)
            }
            Err(_) => false,
        }
    }

    /// Records node `i`'s `run_id`; true when its votes count toward a quorum now.
    fn note_run_id(&self, i: usize, id: String, uptime: Option<u64>) -> bool {
        let node = &self.nodes[i];
        let mut st = node.lock_state();
        let now = Instant::now();
        st.note_uptime(now, uptime);
        let delay = self.restart_delay();
        if st.run_id.as_deref() != Some(id.as_str()) {
            tracing::warn!(
                node = %node.backend.url(),
                excluded_ms = delay.as_millis() as u64,
                "dlock: Redlock node restarted or first reached (new run_id); not counted toward quorums until the longest ttl has passed"
            );
            st.run_id = Some(id);
            st.excluded_until = now.checked_add(delay);
            return delay.is_zero();
        }
        st.counts_now(now, delay)
    }

    /// The pending clean-up of `owner`'s earlier try on node `i`, if any.
    fn dirty(
        &self,
        i: usize,
        name: &str,
        owner: &str,
    ) -> Option<tokio::sync::watch::Receiver<Option<bool>>> {
        let d = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        if d.is_empty() {
            return None;
        }
        d.get(&(i, name.to_string(), owner.to_string())).cloned()
    }

    /// Starts a try of `name`: a release heard while it runs wakes nobody until it ends.
    fn start_try<'a>(&'a self, name: &'a str) -> Trying<'a> {
        self.wake
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name.to_string())
            .or_default()
            .trying += 1;
        Trying {
            inner: self,
            name,
            granted: false,
        }
    }

    /// A node published a release of `name`: wakes the first local waiter, or, while a try of
    /// the name runs here, holds the wake-up until it ended (a grant drops it: the copies of
    /// one release, one per node, then wake one waiter, not one each).
    fn heard_release(&self, name: &str) {
        {
            let mut map = self.wake.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(st) = map.get_mut(name)
                && st.trying > 0
            {
                st.heard = true;
                return;
            }
        }
        self.queues.wake_one_unless_pending(name);
    }

    /// Registers an acquire call on node `i`; the returned value ends the registration (and
    /// wakes releases waiting for it) when dropped with the call's task.
    fn track(self: &Arc<Self>, i: usize, name: &str, owner: &str) -> Tracked {
        let id = self.next_try.fetch_add(1, Ordering::Relaxed);
        let (done, rx) = tokio::sync::watch::channel(false);
        let key = (i, name.to_string(), owner.to_string());
        self.inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key.clone())
            .or_default()
            .push((id, rx));
        Tracked {
            inner: self.clone(),
            key,
            id,
            done,
        }
    }

    /// Waits (at most `bound`) until every acquire call of `owner` on node `i` has ended.
    async fn after_inflight(&self, i: usize, name: &str, owner: &str, bound: Duration) {
        let waits: Vec<tokio::sync::watch::Receiver<bool>> = {
            let map = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
            if map.is_empty() {
                return;
            }
            map.get(&(i, name.to_string(), owner.to_string()))
                .map(|v| v.iter().map(|(_, rx)| rx.clone()).collect())
                .unwrap_or_default()
        };
        let _ = tokio::time::timeout(
            bound,
            join_all(waits.into_iter().map(|mut rx| async move {
                let _ = rx.wait_for(|d| *d).await;
            })),
        )
        .await;
    }

    /// Runs `op` on every node in a task of its own, also checking which server process
    /// answered (see the module documentation), and returns the receiver of the replies and
    /// the tasks.
    fn fan_out<T, F>(
        self: &Arc<Self>,
        rt: &tokio::runtime::Handle,
        name: &str,
        owner: &str,
        track: bool,
        op: F,
    ) -> (
        mpsc::UnboundedReceiver<NodeReply<T>>,
        Vec<Option<tokio::task::JoinHandle<()>>>,
    )
    where
        T: Send + 'static,
        F: Fn(RedisBackend, String, String) -> BoxFuture<'static, Result<T, LockError>>,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut tasks = Vec::with_capacity(self.nodes.len());
        for (i, node) in self.nodes.iter().enumerate() {
            // This owner's clean-up of an earlier try still runs on this node: the try goes
            // after it (a release of this owner sent later would delete the new grant).
            let dirty = self.dirty(i, name, owner);
            let fut = op(node.backend.clone(), name.to_string(), owner.to_string());
            let err_name = name.to_string();
            let backend = node.backend.clone();
            let me = self.clone();
            let tx = tx.clone();
            let tracked = track.then(|| self.track(i, name, owner));
            tasks.push(Some(rt.spawn(async move {
                let _tracked = tracked;
                if let Some(mut rx) = dirty {
                    let ran = tokio::time::timeout(INFLIGHT_BOUND, rx.wait_for(Option::is_some))
                        .await
                        .ok()
                        .and_then(|r| r.ok().and_then(|v| *v));
                    // Sent only after a confirmed clean-up there.
                    if ran != Some(true) {
                        let _ = tx.send((
                            i,
                            Err(LockError::backend(
                                &err_name,
                                "clean-up of an earlier try still pending on this node",
                            )),
                        ));
                        return;
                    }
                }
                // The script is polled first, so it is queued on the connection before
                // CLIENT GETNAME: a connection name read after it names the connection it ran
                // on, or a later one.
                let (r, conn_name) = tokio::join!(fut, backend.data_conn_name());
                let r = match r {
                    Ok(v) => {
                        let counted = match conn_name {
                            Ok(conn_name) => me.counts(i, &backend, conn_name).await,
                            Err(_) => false,
                        };
                        Ok((v, counted))
                    }
                    Err(e) => Err(e),
                };
                let _ = tx.send((i, r));
            })));
        }
        (rx, tasks)
    }

    async fn acquire(
        self: &Arc<Self>,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Acquired, LockError> {
        let rt = runtime()?;
        let sent = Instant::now();
        self.note_ttl(ttl);
        let n = self.nodes.len();
        let mut trying = self.start_try(name);
        let (mut rx, tasks) = self.fan_out(&rt, name, owner, true, move |b, name, owner| {
            Box::pin(async move { b.try_acquire_holder(&name, &owner, ttl).await })
        });
        // Owners that answered busy, with their node count: one with a quorum holds the lock,
        // and its release wakes the waiters.
        let mut holders: HashMap<String, usize> = HashMap::new();
        let deadline = sent + self.node_timeout;
        let mut answered: Vec<Option<Result<(Acquired, bool), ()>>> =
            (0..n).map(|_| None).collect();
        let (mut granted, mut against) = (0usize, 0usize);
        let (mut token, mut count) = (0u64, 0u32);
        let mut busy: Option<Option<Duration>> = None;
        let mut first_err: Option<LockError> = None;
        let reentry = self
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&(name.to_string(), owner.to_string()));
        while granted < self.quorum && against <= n - self.quorum {
            let Ok(Some((i, r))) = tokio::time::timeout_at(deadline, rx.recv()).await else {
                break;
            };
            match r {
                Ok(((a, holder), counted)) => {
                    if let Some(h) = holder {
                        *holders.entry(h).or_default() += 1;
                    }
                    match a {
                        Acquired::Granted { token: t, count: c } => {
                            if counted {
                                granted += 1;
                                token = token.max(t);
                                count = count.max(c);
                            } else {
                                against += 1;
                            }
                        }
                        Acquired::Busy { remaining } => {
                            against += 1;
                            let prev = busy.flatten();
                            busy = Some(match (prev, remaining) {
                                (Some(a), Some(b)) => Some(a.max(b)),
                                (a, b) => a.or(b),
                            });
                        }
                    }
                    answered[i] = Some(Ok((a, counted)));
                }
                Err(e) => {
                    against += 1;
                    first_err.get_or_insert(e);
                    answered[i] = Some(Err(()));
                }
            }
        }
        if granted >= self.quorum {
            let lease = ttl.saturating_sub(self.drift(ttl));
            let written = if lease > sent.elapsed() {
                self.write_back(
                    &rt,
                    name,
                    owner,
                    ttl,
                    token,
                    sent.checked_add(lease),
                    &answered,
                )
                .await
            } else {
                Ok(())
            };
            let validity = lease.saturating_sub(sent.elapsed());
            match written {
                Ok(()) if !validity.is_zero() => {
                    self.held
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert((name.to_string(), owner.to_string()));
                    trying.granted = true;
                    return Ok(Acquired::Granted { token, count });
                }
                Ok(()) => {
                    first_err = Some(LockError::backend(
                        name,
                        format!(
                            "Redlock: a quorum granted the lock but its validity was used up ({:?} elapsed, ttl {ttl:?})",
                            sent.elapsed()
                        ),
                    ));
                }
                Err(e) => first_err = Some(e),
            }
            busy = None;
        }
        // Failed: give back whatever this try took, on every node. When another owner holds a
        // quorum, freeing the nodes this try took is no release: it wakes nobody (else each
        // waiter it woke would take those nodes again, fail, and wake the next, for the whole
        // hold). Otherwise (a split vote, unanswered nodes) it wakes, so that a try follows.
        let publish = !holders.values().any(|&k| k >= self.quorum);
        self.clean_up(&rt, name, owner, reentry, &answered, tasks, publish)
            .await;
        drop(trying);
        if let Some(remaining) = busy {
            return Ok(Acquired::Busy { remaining });
        }
        Err(first_err.unwrap_or_else(|| {
            LockError::backend(
                name,
                format!(
                    "Redlock: no quorum ({granted} of {n} nodes granted within {:?}, {} needed)",
                    self.node_timeout, self.quorum
                ),
            )
        }))
    }

    /// Writes the granted `token` (the largest among the counted grants) back as the fence of
    /// `name` on the nodes, and returns once a quorum of them confirmed that every later grant
    /// there gets a larger token (the name is free there or `owner` holds it), at the latest by
    /// `until` (the end of the grant's validity) or one node timeout from now. A node whose own
    /// counted grant minted `token` already confirms it. Any later grant is decided on a quorum,
    /// which shares a node with this one, so its token is larger (docs/redlock.md, fencing token).
    /// Every node gets the write (it raises the fence only), also those that did not answer in
    /// time (behind the acquire on their connection). Fewer than a quorum in time: an error,
    /// and the caller gives the grant back.
    #[allow(clippy::too_many_arguments)]
    async fn write_back(
        self: &Arc<Self>,
        rt: &tokio::runtime::Handle,
        name: &str,
        owner: &str,
        ttl: Duration,
        token: u64,
        until: Option<Instant>,
        answered: &[Option<Result<(Acquired, bool), ()>>],
    ) -> Result<(), LockError> {
        let minted = |a: &Option<Result<(Acquired, bool), ()>>| matches!(a, Some(Ok((Acquired::Granted { token: t, .. }, true))) if *t == token);
        let mut acked = answered.iter().filter(|a| minted(a)).count();
        if acked >= self.quorum {
            return Ok(());
        }
        let (tx, mut rx) = mpsc::unbounded_channel();
        for (i, node) in self.nodes.iter().enumerate() {
            if minted(&answered[i]) {
                continue;
            }
            let backend = node.backend.clone();
            let (name, owner, tx) = (name.to_string(), owner.to_string(), tx.clone());
            rt.spawn(async move {
                let _ = tx.send(backend.raise_fence(&name, &owner, token, ttl).await);
            });
        }
        drop(tx);
        let soon = Instant::now() + self.node_timeout;
        let deadline = until.map_or(soon, |u| u.min(soon));
        let (mut refused, mut first_err) = (0usize, None);
        while acked < self.quorum {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(Ok(true))) => acked += 1,
                Ok(Some(Ok(false))) => refused += 1,
                Ok(Some(Err(e))) => {
                    first_err.get_or_insert(e);
                }
                Ok(None) | Err(_) => break,
            }
        }
        if acked >= self.quorum {
            return Ok(());
        }
        Err(LockError::backend(
            name,
            format!(
                "Redlock: a quorum granted the lock but its token could not be written back to a quorum in time ({acked} of {} confirmed, {refused} held by another owner{}); the grant is given back",
                self.nodes.len(),
                first_err.map_or_else(String::new, |e| format!(", {e}"))
            ),
        ))
    }

    /// Releases a failed try on every node. Nodes that answered are released now (bounded by
    /// the node timeout); on nodes still busy with the try, the release follows its end in the
    /// background, and until then this owner's votes there are not counted.
    #[allow(clippy::too_many_arguments)]
    async fn clean_up(
        self: &Arc<Self>,
        rt: &tokio::runtime::Handle,
        name: &str,
        owner: &str,
        reentry: bool,
        answered: &[Option<Result<(Acquired, bool), ()>>],
        tasks: Vec<Option<tokio::task::JoinHandle<()>>>,
        publish: bool,
    ) {
        let mut now = Vec::new();
        for (i, task) in tasks.into_iter().enumerate() {
            let Some(task) = task else { continue };
            // A re-entry only gives back the hold it added; a fresh try gives back everything
            // (also a leftover of this owner's earlier try that a node counted in).
            let all = match &answered[i] {
                Some(Ok((Acquired::Granted { count, .. }, _))) => !reentry || *count <= 1,
                Some(Ok((Acquired::Busy { .. }, _))) => continue,
                Some(Err(())) | None => !reentry,
            };
            if !all && !matches!(answered[i], Some(Ok(_))) {
                // A re-entry whose outcome is unknown: an extra count is cleared by the
                // outermost release; a release here could delete the outer hold.
                continue;
            }
            // Every clean-up runs to its end in a task of its own (a dropped release could
            // still run on the node after a later try of this owner there, and delete its
            // grant); until it is confirmed, this owner's next try on the node waits for it.
            let backend = self.nodes[i].backend.clone();
            let key = (i, name.to_string(), owner.to_string());
            let (ran, rx) = tokio::sync::watch::channel(None);
            self.dirty
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key.clone(), rx.clone());
            if answered[i].is_some() {
                now.push(rx.clone());
            }
            let me = self.clone();
            rt.spawn(async move {
                // Behind the try on this node, if it is still running.
                let _ = task.await;
                let ok = backend
                    .release_publishing(&key.1, &key.2, None, all, publish)
                    .await
                    .is_ok();
                let _ = ran.send(Some(ok));
                if !ok {
                    // Retried in the background by the node's backend: this owner's tries on
                    // the node are refused meanwhile (bounded: owners are fresh per call).
                    tokio::time::sleep(UNCONFIRMED_CLEAN_UP).await;
                }
                let mut d = me.dirty.lock().unwrap_or_else(|e| e.into_inner());
                if d.get(&key).is_some_and(|r| r.same_channel(&rx)) {
                    d.remove(&key);
                }
            });
        }
        // The nodes that answered are cleaned up before the try's answer (bounded).
        let _ = tokio::time::timeout(
            self.node_timeout,
            join_all(now.into_iter().map(|mut rx| async move {
                let _ = rx.wait_for(Option::is_some).await;
            })),
        )
        .await;
    }

    async fn release(
        self: &Arc<Self>,
        name: &str,
        owner: &str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> Result<Released, LockError> {
        let rt = runtime()?;
        if all {
            // Given back entirely: a later try of this owner is not a re-entry.
            let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
            if !held.is_empty() {
                held.remove(&(name.to_string(), owner.to_string()));
            }
        }
        // Every node gets the release in a task of its own (a node that answers late still gets
        // it); the answer is given once every node answered, or a quorum did and the node
        // timeout passed, or at the latest after one second.
        let n = self.nodes.len();
        let started = Instant::now();
        let (tx, mut rx) = mpsc::unbounded_channel();
        for (i, node) in self.nodes.iter().enumerate() {
            let backend = node.backend.clone();
            let (name, owner, tx) = (name.to_string(), owner.to_string(), tx.clone());
            let me = self.clone();
            rt.spawn(async move {
                // Behind this owner's acquire on the node, if that is still running (a quorum
                // granted before this node answered): bounded by the node's own call bounds.
                me.after_inflight(i, &name, &owner, INFLIGHT_BOUND).await;
                // A release of every hold that this node did not confirm is retried by the
                // node's RedisBackend in the background (see `redis::Reaper`).
                let _ = tx.send(backend.release(&name, &owner, keep_for, all).await);
            });
        }
        drop(tx);
        let mut results = Vec::with_capacity(n);
        let hard = started + self.node_timeout.max(Duration::from_secs(1));
        let soft = started + self.node_timeout;
        while results.len() < n {
            let until = if results.len() >= self.quorum {
                soft
            } else {
                hard
            };
            match tokio::time::timeout_at(until.max(Instant::now()), rx.recv()).await {
                Ok(Some(r)) => results.push(r),
                _ => break,
            }
        }
        let mut not_owner = 0;
        let mut decremented: Option<u32> = None;
        let mut ok = 0;
        let mut first_err = None;
        for r in results {
            match r {
                Ok(Released::NotOwner) => {
                    ok += 1;
                    not_owner += 1
                }
                Ok(Released::Decremented(c)) => {
                    ok += 1;
                    decremented = Some(decremented.map_or(c, |d| d.max(c)))
                }
                Ok(Released::Freed) => ok += 1,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if ok == 0 {
            return Err(first_err.unwrap_or_else(|| LockError::backend(name, "no node answered")));
        }
        if not_owner >= self.quorum || (not_owner == ok && ok == n) {
            return Ok(Released::NotOwner);
        }
        if ok < self.quorum {
            // Fewer than a quorum confirmed: the hold may still be on a quorum of nodes, so
            // neither "freed" nor "not the owner" is known (the unconfirmed nodes are retried
            // in the background when `all` is set).
            return Err(LockError::backend(
                name,
                format!(
                    "Redlock: only {ok} of {n} nodes confirmed the release ({}); the others are retried in the background",
                    first_err.map_or_else(|| "no answer in time".to_string(), |e| e.to_string())
                ),
            ));
        }
        Ok(match decremented {
            Some(c) => Released::Decremented(c),
            None => Released::Freed,
        })
    }

    async fn extend(
        self: &Arc<Self>,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Extended, LockError> {
        let rt = runtime()?;
        let sent = Instant::now();
        self.note_ttl(ttl);
        let n = self.nodes.len();
        let (mut rx, _tasks) = self.fan_out(&rt, name, owner, false, move |b, name, owner| {
            Box::pin(async move { b.extend(&name, &owner, ttl).await })
        });
        let deadline = sent + self.node_timeout;
        let (mut extended, mut lost, mut failed) = (0usize, 0usize, 0usize);
        let mut lost_nodes = Vec::new();
        let mut first_err = None;
        // Wait for every node (bounded): the nodes that lost the hold get it back below.
        while extended + lost + failed < n {
            let Ok(Some((i, r))) = tokio::time::timeout_at(deadline, rx.recv()).await else {
                break;
            };
            match r {
                Ok((Extended::Extended, true)) => extended += 1,
                Ok((Extended::Extended, false)) => failed += 1,
                Ok((Extended::Lost, _)) => {
                    lost += 1;
                    lost_nodes.push(i);
                }
                Err(e) => {
                    failed += 1;
                    first_err.get_or_insert(e);
                }
            }
            if lost > n - self.quorum {
                break;
            }
        }
        if extended >= self.quorum {
            let validity = ttl
                .saturating_sub(sent.elapsed())
                .saturating_sub(self.drift(ttl));
            if validity.is_zero() {
                return Err(LockError::backend(
                    name,
                    "Redlock: the renewal's validity was used up before a quorum answered",
                ));
            }
            // Put the hold back on nodes that forgot it (restarted, or its lease ran out
            // there); a node another owner holds by now is left alone. Tracked as an acquire
            // call on that node, so that a release sent meanwhile waits for it (and, through
            // the node's pin, goes behind it on its connection) instead of overtaking it and
            // leaving the put-back there as an orphan (review redis-family #10).
            for i in lost_nodes {
                let backend = self.nodes[i].backend.clone();
                let (name, owner) = (name.to_string(), owner.to_string());
                let tracked = self.track(i, &name, &owner);
                rt.spawn(async move {
                    let _tracked = tracked;
                    match backend.try_acquire(&name, &owner, ttl).await {
                        Ok(Acquired::Granted { .. }) => {
                            tracing::debug!(key = %name, node = %backend.url(), "dlock: Redlock hold put back on a node that had lost it")
                        }
                        other => {
                            tracing::debug!(key = %name, node = %backend.url(), result = ?other, "dlock: Redlock hold could not be put back on a node")
                        }
                    }
                });
            }
            return Ok(Extended::Extended);
        }
        if lost > n - self.quorum {
            return Ok(Extended::Lost);
        }
        Err(first_err.unwrap_or_else(|| {
            LockError::backend(
                name,
                format!(
                    "Redlock: renewal reached no quorum ({extended} of {n} nodes within {:?}, {} needed)",
                    self.node_timeout, self.quorum
                ),
            )
        }))
    }

    /// Makes sure node subscriptions exist for `name` while it has local waiters.
    async fn watch(self: &Arc<Self>, name: &str) -> Result<Watch, LockError> {
        let rt = runtime()?;
        let (mut watch, mut ready) = {
            let mut map = self.proxies.lock().unwrap_or_else(|e| e.into_inner());
            let watch = self.queues.register(name);
            let ready = match map.get(name) {
                Some(p) => p.ready.clone(),
                None => {
                    let id = self.next_proxy.fetch_add(1, Ordering::Relaxed);
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
                    rt.spawn(run_proxy(self.clone(), name.to_string(), id, stop, tx));
                    rx
                }
            };
            (watch, ready)
        };
        // Subscribed on the nodes (or given up on the slow ones) before returning.
        let t = self.node_timeout.saturating_mul(4);
        let r = tokio::time::timeout(t, ready.wait_for(|v| *v)).await;
        if !matches!(r, Ok(Ok(_))) {
            // No subscription confirmed in time: the holder's lease is the timer.
            watch.set_fallback_only();
        }
        Ok(watch)
    }
}

/// Subscribes to `name`'s release channel on every node and turns their messages into local
/// wake-ups. Each node's own subscriber decides whether a message is for this process (the
/// waiters' queue: its release named this process, or nobody was queued, or the turn of a
/// process that did not try came to this one) and then wakes this task's watch on that node. A
/// release publishes once on every node it freed, and so does the clean-up of a try
/// that failed to reach a quorum (on the nodes it had taken) unless another owner holds one:
/// the messages do not line up node by node, so none may be dropped by counting. Each message
/// wakes the first local waiter unless a waiter is already woken and has not started its retry
/// (that retry will see this release too); while a try of the name runs here it is held until
/// the try ends, and dropped if it was granted (`Inner::heard_release`): the copies of one
/// release wake about one waiter, and no release goes unheard.
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
    let n = inner.nodes.len();
    let (tx, mut rx) = mpsc::unbounded_channel::<usize>();
    let subscribed = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::with_capacity(n);
    for (i, node) in inner.nodes.iter().enumerate() {
        let backend = node.backend.clone();
        let (name, tx, stop) = (name.clone(), tx.clone(), stop.clone());
        let subscribed = subscribed.clone();
        let ready = ready.clone();
        tasks.push(tokio::spawn(async move {
            let w = tokio::select! {
                _ = stop.cancelled() => return,
                w = backend.watch(&name) => w,
            };
            let Ok(w) = w else { return };
            if !w.is_fallback_only() {
                let done = subscribed.fetch_add(1, Ordering::AcqRel) + 1;
                if done as usize == n {
                    let _ = ready.send(true);
                }
            }
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = w.woken() => {
                        if tx.send(i).is_err() {
                            return;
                        }
                    }
                }
            }
        }));
    }
    drop(tx);
    // Ready once every node subscribed, or after the node timeout with a quorum of them.
    let quorum = inner.quorum as u64;
    let sub2 = subscribed.clone();
    let ready2 = ready.clone();
    let timeout = inner.node_timeout;
    tokio::spawn(async move {
        tokio::time::sleep(timeout).await;
        while sub2.load(Ordering::Acquire) < quorum && !ready2.is_closed() {
            tokio::time::sleep(timeout).await;
        }
        let _ = ready2.send(true);
    });
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            m = rx.recv() => {
                if m.is_none() {
                    break;
                }
                inner.heard_release(&name);
            }
        }
    }
    for t in tasks {
        t.abort();
    }
}

impl Backend for RedlockBackend {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(self.inner.acquire(name, owner, ttl))
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
        Box::pin(self.inner.watch(name))
    }

    fn has_waiters(&self, name: &str) -> bool {
        self.inner.queues.has_waiters(name)
    }

    fn lease_margin(&self, ttl: Duration) -> Duration {
        self.inner.drift(ttl)
    }

    /// A busy try's clean-up runs on the nodes it took after the try answered (in the
    /// background, retried by the node's backend, possibly late after a timeout): under the
    /// same owner id it could delete a later try's grant there.
    fn fresh_owner_per_try(&self) -> bool {
        true
    }

    /// Written to every node (each call bounded by the node timeout): refused when any node
    /// holds a later epoch, written when a quorum wrote it, else an error.
    fn put_record<'a>(
        &'a self,
        name: &'a str,
        epoch: u64,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let t = self.inner.node_timeout.max(Duration::from_millis(500));
            let answers = join_all(
                self.inner
                    .nodes
                    .iter()
                    .map(|n| tokio::time::timeout(t, n.backend.put_record(name, epoch, value))),
            )
            .await;
            let mut written = 0;
            for a in answers {
                match a {
                    Ok(Ok(true)) => written += 1,
                    Ok(Ok(false)) => return Ok(false),
                    _ => {}
                }
            }
            if written >= self.inner.quorum {
                Ok(true)
            } else {
                Err(LockError::backend(
                    name,
                    format!(
                        "the leader record was written on {written} nodes, fewer than the quorum of {}",
                        self.inner.quorum
                    ),
                ))
            }
        })
    }

    /// Read from every node: the record with the largest epoch among a quorum's answers (a
    /// written record is on a quorum, which every read quorum meets).
    fn get_record<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<crate::backend::Record>, LockError>> {
        Box::pin(async move {
            let t = self.inner.node_timeout.max(Duration::from_millis(500));
            let answers = join_all(
                self.inner
                    .nodes
                    .iter()
                    .map(|n| tokio::time::timeout(t, n.backend.get_record(name))),
            )
            .await;
            let mut answered = 0;
            let mut best: Option<crate::backend::Record> = None;
            for r in answers.into_iter().flatten().flatten() {
                answered += 1;
                if let Some(r) = r
                    && best.as_ref().is_none_or(|b| r.epoch > b.epoch)
                {
                    best = Some(r);
                }
            }
            if answered < self.inner.quorum {
                return Err(LockError::backend(
                    name,
                    format!(
                        "{answered} nodes answered the leader record read, fewer than the quorum of {}",
                        self.inner.quorum
                    ),
                ));
            }
            Ok(best)
        })
    }
}

/// Connects to N independent Redis masters and registers them as one Redlock backend under
/// `name` (replacing what was there). `urls` is any iterable of URL strings, e.g.
/// `&["redis://10.0.0.1:6379", "redis://10.0.0.2:6379", "redis://10.0.0.3:6379"]`. Fails unless
/// a quorum of the nodes answers now. For the knobs, use [`RedlockBackend::builder`] and
/// [`crate::register`].
pub async fn init_redlock<I, S>(name: &str, urls: I) -> Result<(), LockError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let backend = RedlockBackend::connect(urls).await?;
    tracing::info!(
        backend = name,
        nodes = backend.node_count(),
        "dlock: Redlock backend registered"
    );
    crate::register(name, backend);
    Ok(())
}
