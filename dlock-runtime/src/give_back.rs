//! The one background give-back: a release nobody waits for any more.
//!
//! It serves every path that gives a hold back without a caller waiting for the reply: a dropped
//! guard, a release whose caller stopped waiting (a deadline, a cancelled future), a try whose
//! reply was not read (its outcome is unknown), a wait that ended on a backend that queues
//! contenders, and a lost hold on a backend whose hold outlives its ttl (ZooKeeper, etcd,
//! PostgreSQL advisory mode).
//!
//! The rules it follows (ARCHITECTURE.md, "Calls whose outcome is unknown"):
//! * a release of every hold (`all`) is owner-checked and idempotent, so it is sent again with
//!   back-off until the backend answers (`Freed`, `Decremented` or `NotOwner`: the server
//!   confirmed that nothing of this owner is left) or the bound has passed;
//! * a release of one re-entrant hold (a decrement) is not idempotent and is never sent twice:
//!   if its outcome is unknown, the outermost release deletes the lock whatever its count;
//! * a task cut off by its runtime's shutdown (or started outside any runtime) finishes on a
//!   helper thread with a runtime of its own.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

use crate::LockError;
use crate::backend::{Backend, Released};

/// A boxed release call.
pub(crate) type ReleaseFuture = Pin<Box<dyn Future<Output = Result<Released, LockError>> + Send>>;

/// Back-off between the tries of a background give-back: from the first to the most.
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(1);

/// How long a give-back during runtime shutdown (or outside a runtime) may block the dropping
/// thread.
pub(crate) const SHUTDOWN_GIVE_BACK: Duration = Duration::from_secs(1);

/// How long a background give-back may take on a backend whose leases end by their ttl: the
/// server frees the lock after its ttl anyway, so waiting longer than that (at least 1 s, at most
/// 30 s) serves nothing.
pub(crate) fn give_back_bound(ttl: Duration) -> Duration {
    ttl.clamp(Duration::from_secs(1), Duration::from_secs(30))
}

/// How long an acquisition waits for this process's own background give-back of the same name
/// (see [`after_own_give_backs`]): one release round trip is the normal case; a server that does
/// not answer within this leaves the acquisition to find the lock busy, as before.
pub(crate) const OWN_GIVE_BACK_WAIT: Duration = Duration::from_secs(1);

/// Background give-backs of whole holds running now in this process, by backend and name. The
/// count is read first so an acquisition with none pending pays one atomic load.
static PENDING_COUNT: AtomicUsize = AtomicUsize::new(0);

type PendingMap = HashMap<(usize, String), tokio::sync::watch::Sender<usize>>;

fn pending() -> std::sync::MutexGuard<'static, PendingMap> {
    static PENDING: OnceLock<Mutex<PendingMap>> = OnceLock::new();
    PENDING
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// One give-back counted in [`PENDING_COUNT`] until dropped (with its task, however it ends).
struct Pending {
    key: (usize, String),
}

impl Pending {
    fn register(backend: &Arc<dyn Backend>, name: &str) -> Pending {
        let key = (crate::guard::backend_id(backend), name.to_string());
        let mut map = pending();
        PENDING_COUNT.fetch_add(1, Ordering::AcqRel);
        match map.get(&key) {
            Some(tx) => tx.send_modify(|n| *n += 1),
            None => {
                map.insert(key.clone(), tokio::sync::watch::channel(1).0);
            }
        }
        Pending { key }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut map = pending();
        PENDING_COUNT.fetch_sub(1, Ordering::AcqRel);
        if let Some(tx) = map.get(&self.key) {
            tx.send_modify(|n| *n = n.saturating_sub(1));
            if *tx.borrow() == 0 {
                map.remove(&self.key);
            }
        }
    }
}

/// Waits (at most `bound`) until this process's background give-backs of `name` on `backend`
/// have ended: a guard dropped on the line before gives its lock back in the background, and
/// without this wait the acquisition on the next line found its own lock busy (newcomer review
/// 8: `Busy { retry_after: 30s }` 0.3 ms after the drop). Other processes are not waited for.
pub(crate) async fn after_own_give_backs(backend: &Arc<dyn Backend>, name: &str, bound: Duration) {
    if PENDING_COUNT.load(Ordering::Acquire) == 0 {
        return;
    }
    let rx = {
        let map = pending();
        match map.get(&(crate::guard::backend_id(backend), name.to_string())) {
            Some(tx) => tx.subscribe(),
            None => return,
        }
    };
    let mut rx = rx;
    let _ = tokio::time::timeout(bound, rx.wait_for(|n| *n == 0)).await;
}

/// A release already made by a caller that then stopped waiting for it.
pub(crate) struct Call {
    pub(crate) fut: ReleaseFuture,
    /// Set when `fut` was first polled: a future polled on a runtime holds that runtime's timers
    /// and cannot be finished on another one.
    pub(crate) polled: Arc<AtomicBool>,
}

/// One background give-back of `owner`'s hold of `name`.
pub(crate) struct GiveBack {
    backend: Arc<dyn Backend>,
    name: String,
    owner: Arc<str>,
    keep: Option<Duration>,
    all: bool,
    ttl: Duration,
    /// The caller's own call, awaited first when there is one.
    first: Option<Call>,
    finished: bool,
}

impl GiveBack {
    /// Gives back every hold of `owner` (owner-checked: a lock another owner holds is left alone).
    pub(crate) fn all(
        backend: Arc<dyn Backend>,
        name: &str,
        owner: Arc<str>,
        ttl: Duration,
    ) -> Self {
        GiveBack {
            backend,
            name: name.to_string(),
            owner,
            keep: None,
            all: true,
            ttl,
            first: None,
            finished: false,
        }
    }

    /// Keeps the lock taken for `keep` more (`hold_at_least`) instead of deleting it.
    pub(crate) fn keep(mut self, keep: Option<Duration>) -> Self {
        self.keep = keep;
        self
    }

    /// Finishes `call`, a release with these `keep` and `all` settings whose caller stopped
    /// waiting; sent again (with `all` only) when it fails.
    pub(crate) fn finish(
        backend: Arc<dyn Backend>,
        name: &str,
        owner: Arc<str>,
        ttl: Duration,
        call: Call,
        keep: Option<Duration>,
        all: bool,
    ) -> Self {
        let mut g = GiveBack::all(backend, name, owner, ttl);
        g.keep = keep;
        g.all = all;
        g.first = Some(call);
        g
    }

    /// Runs it on the current runtime, or on a helper thread when there is none or the runtime
    /// is shutting down (a task spawned then is dropped without being polled).
    pub(crate) fn spawn(self) {
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                // A whole hold given back: an acquisition of the name here waits for it. A
                // `hold_at_least` release keeps the lock taken, so nobody waits for that one.
                let pending = (self.all && self.keep.is_none())
                    .then(|| Pending::register(&self.backend, &self.name));
                rt.spawn(async move {
                    let _pending = pending;
                    self.run().await
                });
            }
            // Dropped unfinished: `Drop` runs it on a helper thread.
            Err(_) => drop(self),
        }
    }

    /// How long to keep trying. A hold that a session or a lease keeps alive never ends by
    /// itself, so its give-back is given the longest bound (and the backend's own reaper goes on
    /// after that); a ttl lease frees itself after its ttl.
    fn bound(&self) -> Duration {
        if self.backend.lease_expires_by_ttl() {
            give_back_bound(self.ttl)
        } else {
            give_back_bound(Duration::MAX)
        }
    }

    fn gives_up_how(&self) -> &'static str {
        if self.backend.lease_expires_by_ttl() {
            "the lock frees when its lease runs out"
        } else {
            "the backend keeps deleting it until its server confirms"
        }
    }

    async fn run(mut self) {
        let end = Instant::now() + self.bound();
        let mut backoff = RETRY_FIRST;
        let mut tries = 0u32;
        if let Some(mut call) = self.first.take() {
            tries += 1;
            let r = tokio::time::timeout_at(end, &mut call.fut).await;
            drop(call);
            let why = match r {
                Ok(Ok(_)) => {
                    self.finished = true;
                    return;
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => "no reply in time".to_string(),
            };
            if !self.all {
                // A decrement is not sent twice: the outermost release clears the count.
                self.finished = true;
                tracing::warn!(key = %self.name, error = %why, "dlock: background release of a re-entered hold failed; the outermost release gives the lock back");
                return;
            }
            if !self.wait_to_retry(end, &mut backoff, tries, &why).await {
                return;
            }
        }
        loop {
            tries += 1;
            let call = self
                .backend
                .release(&self.name, &self.owner, self.keep, self.all);
            let why = match tokio::time::timeout_at(end, call).await {
                Ok(Ok(_)) => {
                    self.finished = true;
                    return;
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => "no reply in time".to_string(),
            };
            if !self.wait_to_retry(end, &mut backoff, tries, &why).await {
                return;
            }
        }
    }

    /// Sleeps the back-off before the next try; false (and logged) when that would pass `end`.
    async fn wait_to_retry(
        &mut self,
        end: Instant,
        backoff: &mut Duration,
        tries: u32,
        why: &str,
    ) -> bool {
        let next = Instant::now() + *backoff;
        if next >= end {
            self.finished = true;
            tracing::warn!(key = %self.name, error = %why, tries, "dlock: giving the lock back in the background failed; {}", self.gives_up_how());
            return false;
        }
        tracing::debug!(key = %self.name, error = %why, tries, "dlock: giving the lock back in the background failed; retrying");
        tokio::time::sleep_until(next).await;
        *backoff = (*backoff * 2).min(RETRY_MAX);
        true
    }
}

impl Drop for GiveBack {
    /// Not finished: its runtime shut down (or there was none). A call never polled is sent as
    /// it is; one already polled on the dying runtime is sent anew when it gives back every hold
    /// (idempotent), and left to the outermost release when it is a decrement.
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let fut = match self.first.take() {
            Some(call) if !call.polled.load(Ordering::Acquire) => call.fut,
            _ if !self.all => {
                tracing::debug!(key = %self.name, "dlock: an inner release was cut off by its runtime's shutdown; the outermost release clears its count");
                return;
            }
            _ => {
                let (backend, name, owner, keep) = (
                    self.backend.clone(),
                    self.name.clone(),
                    self.owner.clone(),
                    self.keep,
                );
                Box::pin(async move { backend.release(&name, &owner, keep, true).await })
            }
        };
        on_a_helper_thread(&self.name, self.gives_up_how(), fut);
    }
}

/// Runs the release on a new thread with its own runtime, bounded by [`SHUTDOWN_GIVE_BACK`],
/// and waits for it as long; logs what could not be given back.
fn on_a_helper_thread(name: &str, gives_up_how: &'static str, fut: ReleaseFuture) {
    let (tx, rx) = std::sync::mpsc::channel();
    let key = name.to_string();
    let spawned = std::thread::Builder::new()
        .name("dlock-give-back".into())
        .spawn(move || {
            let r = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())
                .and_then(|rt| {
                    rt.block_on(async move { tokio::time::timeout(SHUTDOWN_GIVE_BACK, fut).await })
                        .map_err(|_| "no reply in time".to_string())
                        .and_then(|r| r.map(|_| ()).map_err(|e| e.to_string()))
                });
            if let Err(e) = &r {
                tracing::warn!(key = %key, error = %e, "dlock: could not give the lock back while its runtime shut down; {gives_up_how}");
            }
            let _ = tx.send(());
        });
    match spawned {
        Ok(_) => {
            if rx.recv_timeout(SHUTDOWN_GIVE_BACK).is_err() {
                tracing::warn!(key = %name, "dlock: giving the lock back at shutdown is still running; {gives_up_how} if the process exits first");
            }
        }
        Err(e) => {
            tracing::warn!(key = %name, error = %e, "dlock: no thread to give the lock back at shutdown; {gives_up_how}")
        }
    }
}
