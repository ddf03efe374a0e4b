//! The `Lock` builder and the acquire / wait loop.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use crate::backend::{Acquired, Backend, Watch};
use crate::context;
use crate::give_back::GiveBack;
use crate::guard::{GuardInit, LockGuard, backend_id};
use crate::{LockError, key, registry};

/// The default lease: 30 s.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// Pause between retries after a backend error while waiting.
const ERROR_BACKOFF: Duration = Duration::from_millis(100);

/// A lock to take: a name and how to take it.
///
/// ```
/// # use dlock_runtime as dlock;
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock::LockError> {
/// use std::time::Duration;
/// let guard = dlock::Lock::new("order:42")
///     .ttl(Duration::from_secs(10))
///     .wait(Duration::from_secs(2))
///     .acquire()
///     .await?;
/// println!("fencing token {}", guard.fencing_token());
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Lock {
    name: String,
    ttl: Duration,
    wait: Duration,
    watchdog: bool,
    max_hold: Option<Duration>,
    hold_at_least: Option<Duration>,
    backend: BackendRef,
    metric_name: Cow<'static, str>,
    /// Whether a nested acquisition in a guarded scope re-enters (false for a semaphore's
    /// permits: each acquisition is a holder of its own).
    reentrant: bool,
    /// Waiters are served in arrival order across processes ([`Lock::fair`]).
    fair: bool,
}

/// The heartbeat lease of a fair lock's queued waiter: one renewal period of its ttl (ttl/3, at
/// least 50 ms). A waiter tries again within half of it while it waits, so the store drops a
/// waiter whose process died within one renewal period of its last try.
pub(crate) fn fair_heartbeat(ttl: Duration) -> Duration {
    (ttl / 3).max(Duration::from_millis(50))
}

#[derive(Clone)]
enum BackendRef {
    Named(Cow<'static, str>),
    Direct(Arc<dyn Backend>),
}

impl std::fmt::Debug for Lock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let backend: &dyn std::fmt::Debug = match &self.backend {
            BackendRef::Named(n) => n,
            BackendRef::Direct(b) => b,
        };
        f.debug_struct("Lock")
            .field("name", &self.name)
            .field("ttl", &self.ttl)
            .field("wait", &self.wait)
            .field("watchdog", &self.watchdog)
            .field("max_hold", &self.max_hold)
            .field("hold_at_least", &self.hold_at_least)
            .field("fair", &self.fair)
            .field("backend", backend)
            .finish()
    }
}

impl Lock {
    /// The longest ttl, `extend`, `max_hold` and `hold_at_least` accepted: 365 days. Longer ones
    /// are refused with [`LockError::Config`] before anything is sent, so that no deadline
    /// arithmetic can overflow and no backend gets an out-of-range expiry. (`wait` is not
    /// capped: a wait too long to represent waits for ever.)
    pub const MAX_DURATION: Duration = dlock_template::MAX_DURATION;

    /// A lock named `name` (1 to 1024 bytes; see [`crate::backend::redis_keys`] for how it maps to Redis
    /// keys), with a 30 s ttl, no waiting, the watchdog on and the backend `"default"`.
    pub fn new(name: impl Into<String>) -> Self {
        Lock {
            name: name.into(),
            ttl: DEFAULT_TTL,
            wait: Duration::ZERO,
            watchdog: true,
            max_hold: None,
            hold_at_least: None,
            backend: BackendRef::Named(Cow::Borrowed(registry::DEFAULT_BACKEND)),
            metric_name: Cow::Borrowed(crate::metrics::DEFAULT_METRIC_NAME),
            reentrant: true,
            fair: false,
        }
    }

    /// Turns re-entry off: every acquisition gets a fresh owner id, also inside a guarded scope
    /// that holds the name (a semaphore's permits).
    pub(crate) fn not_reentrant(mut self) -> Self {
        self.reentrant = false;
        self
    }

    /// The `lock` label of this lock's metrics (feature `metrics`; default `"manual"`). Use a
    /// bounded name (the template, the job), never the rendered key: every distinct value is a
    /// new time series. The attribute sets it to the function's name.
    pub fn metric_name(mut self, name: impl Into<Cow<'static, str>>) -> Self {
        self.metric_name = name.into();
        self
    }

    /// The lease length (default 30 s). With the watchdog on it is renewed every ttl/3 (a third of
    /// the lease the guard counts on: on ZooKeeper, `min(ttl, session timeout)`).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long to wait for a busy lock (default zero: try once and fail with
    /// [`LockError::Busy`]).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Whether to renew the lease while the guard lives (default true).
    pub fn watchdog(mut self, on: bool) -> Self {
        self.watchdog = on;
        self
    }

    /// Caps how long the watchdog keeps renewing (default: no cap), so that hung code cannot
    /// hold a lock forever (ShedLock's `lockAtMostFor`). The lease then runs out and the guard
    /// is lost with [`crate::LostReason::MaxHold`].
    pub fn max_hold(mut self, max: Duration) -> Self {
        self.max_hold = Some(max);
        self
    }

    /// Keeps the lock taken at least this long after it was acquired, even when released earlier
    /// (ShedLock's `lockAtLeastFor`): the release shortens the lease to the remainder instead of
    /// deleting the lock.
    pub fn hold_at_least(mut self, min: Duration) -> Self {
        self.hold_at_least = Some(min);
        self
    }

    /// Serves waiters in arrival order across processes (default false: a release wakes one
    /// waiter per process and the first try to arrive wins, so a waiter can be overtaken).
    ///
    /// With `fair(true)` every waiting acquisition keeps a place in a queue on the store and
    /// the lock goes only to the queue's first live waiter. A queued waiter renews its place by
    /// trying again at least every half renewal period (ttl/6); one whose process died leaves
    /// the queue one renewal period (ttl/3) after its last try, and a wait that ends without a
    /// grant (its deadline, a dropped future) leaves it at once. Supported on memory, Redis,
    /// Sentinel and Redis Cluster (a queue of their own), and on ZooKeeper and etcd (whose
    /// waiters always queue in arrival order); any other backend answers
    /// [`LockError::Unsupported`] at the first try. Fairness holds among fair acquisitions of a
    /// name: a plain `acquire` of the same name is not queued and can still barge in.
    pub fn fair(mut self, on: bool) -> Self {
        self.fair = on;
        self
    }

    /// The registered backend to use (default `"default"`).
    pub fn backend(mut self, name: impl Into<Cow<'static, str>>) -> Self {
        self.backend = BackendRef::Named(name.into());
        self
    }

    /// A backend to use directly, without the registry.
    pub fn with_backend(mut self, backend: Arc<dyn Backend>) -> Self {
        self.backend = BackendRef::Direct(backend);
        self
    }

    fn metric_labels(&self) -> crate::metrics::Labels {
        const DIRECT: std::borrow::Cow<'static, str> = Cow::Borrowed("direct");
        let backend = match &self.backend {
            BackendRef::Named(n) => n,
            BackendRef::Direct(_) => &DIRECT,
        };
        crate::metrics::Labels::new(backend, &self.metric_name)
    }

    /// The lock name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The lease length set.
    pub(crate) fn ttl_value(&self) -> Duration {
        self.ttl
    }

    /// The backend this lock uses (looked up in the registry when named).
    pub(crate) fn resolve_backend(&self) -> Result<Arc<dyn Backend>, LockError> {
        match &self.backend {
            BackendRef::Named(n) => registry::backend(n),
            BackendRef::Direct(b) => Ok(b.clone()),
        }
    }

    /// Takes the lock, waiting up to the `wait` duration.
    ///
    /// Waiting subscribes to the lock's release channel and retries when a release wakes this
    /// waiter (one waiter per release and process) or when the holder's lease runs out, whichever
    /// comes first; there is no polling. Waiters of one process are served in arrival order.
    ///
    /// Inside a guarded scope that already holds this name on the same backend, the call
    /// re-enters (hold count + 1) and returns at once.
    pub async fn acquire(&self) -> Result<LockGuard, LockError> {
        let counted = |e| crate::metrics::setup_error(&self.metric_labels(), e);
        key::validate(&self.name).map_err(counted)?;
        require_runtime("acquire", &self.name).map_err(counted)?;
        if self.ttl.is_zero() {
            return Err(counted(LockError::Config(format!(
                "lock `{}`: the ttl must be positive",
                self.name
            ))));
        }
        for (what, d) in [
            ("ttl", Some(self.ttl)),
            ("max_hold", self.max_hold),
            ("hold_at_least", self.hold_at_least),
        ] {
            if let Some(d) = d
                && d > Self::MAX_DURATION
            {
                return Err(counted(LockError::Config(format!(
                    "lock `{}`: {what} {d:?} is above the cap of {:?}",
                    self.name,
                    Self::MAX_DURATION
                ))));
            }
        }
        let backend = match &self.backend {
            BackendRef::Named(n) => registry::backend(n).map_err(counted)?,
            BackendRef::Direct(b) => b.clone(),
        };
        // Re-enter only a hold of this name that the call chain already has; any other
        // acquisition gets a fresh owner, so two futures joined in one task still exclude
        // each other.
        let parent = context::current()
            .filter(|_| self.reentrant)
            .and_then(|f| f.find(backend_id(&backend), &self.name));
        if let Some(p) = &parent
            && !p.is_valid()
        {
            // Re-entering a lease that is already lost would hand out a guard for a lock this
            // chain no longer holds.
            return Err(counted(p.lost_error()));
        }
        let owner = match &parent {
            Some(h) => h.owner.clone(),
            None => context::new_owner(),
        };
        if parent.is_none() {
            // A guard of this name dropped here a moment ago is still being given back in the
            // background: wait for that first (one atomic load when nothing is pending), so a
            // drop followed by an acquire behaves like a `MutexGuard` within this process.
            crate::give_back::after_own_give_backs(
                &backend,
                &self.name,
                crate::give_back::OWN_GIVE_BACK_WAIT,
            )
            .await;
        }
        let span = tracing::debug_span!("dlock.acquire", key = %self.name);
        let started = Instant::now();
        // One label look-up per acquisition, shared by its outcome and its hold.
        let labels = self.metric_labels();
        let r = self
            .acquire_loop(&backend, owner, parent, started, &labels)
            .instrument(span.clone())
            .await;
        crate::metrics::acquire_done(&labels, &r, started, !self.wait.is_zero());
        match &r {
            Ok(g) => tracing::debug!(
                parent: &span,
                key = %self.name,
                token = g.fencing_token(),
                count = g.hold_count(),
                waited_us = started.elapsed().as_micros() as u64,
                "dlock: acquired"
            ),
            Err(e) => {
                tracing::debug!(parent: &span, key = %self.name, error = %e, "dlock: not acquired")
            }
        }
        r
    }

    /// The acquire loop, in four phases: **try** (one bounded try, whose unread reply is given
    /// back), **queue** (subscribe to the name's releases), **wait** (sleep until a release, the
    /// holder's lease end or the deadline) and **give back** (the drop guards: an unread try by
    /// [`InFlight`], a queued contender by [`GiveUp`], a late grant at once).
    async fn acquire_loop(
        &self,
        backend: &Arc<dyn Backend>,
        owner: Arc<str>,
        parent: Option<Arc<crate::guard::Hold>>,
        started: Instant,
        labels: &crate::metrics::Labels,
    ) -> Result<LockGuard, LockError> {
        let name = self.name.as_str();
        // Queue behind local waiters instead of barging in, unless this is a re-entry, a
        // single try, or nobody waits here.
        let try_first = self.wait.is_zero() || parent.is_some() || !backend.has_waiters(name);
        let mut a = Acquisition {
            lock: self,
            backend,
            // A backend that keeps failed tries queued (ZooKeeper, etcd) is told when this wait
            // ends without a grant, however it ends (return or a dropped future).
            give_up: GiveUp {
                backend: (parent.is_none() && (self.fair || backend.queues_contenders()))
                    .then_some(backend),
                name,
                owner: owner.clone(),
                ttl: self.ttl,
            },
            owner,
            parent,
            started,
            deadline: started.checked_add(self.wait),
            // Only a try made right away may reuse the start instant (no clock read on the
            // uncontended path): one made after queueing counts its lease from its own send time.
            first_try: try_first,
            watch: None,
            remaining: None,
            reported_end: None,
            heard_busy: false,
            last_err: None,
            labels,
        };
        let mut try_now = try_first;
        if !try_now {
            a.queue().await?;
            // Try at once only when nobody here knows of a lease that is still running, or when
            // the backend queues contenders on the server (ZooKeeper, etcd): there a try takes
            // its place behind the local waiters' own entries instead of barging past them, and
            // a waiter with an entry of its own is woken exactly when its predecessor leaves
            // (one wake-up per release; a waiter without one is woken by this process's next
            // delete, an extra try per release: issue 19).
            try_now = self.fair
                || backend.queues_contenders()
                || a.watch
                    .as_ref()
                    .and_then(Watch::lease_end)
                    .is_none_or(|t| t <= Instant::now());
        }
        loop {
            if try_now {
                let sent = a.send_time();
                match a.try_once(sent).await? {
                    Ok(Acquired::Granted { token, count }) => {
                        if let Some(guard) = a.granted(token, count, sent).await? {
                            return Ok(guard);
                        }
                        // A late grant, given back: try again.
                        continue;
                    }
                    Ok(Acquired::Busy { remaining }) => a.busy(remaining)?,
                    Err(e) => a.failed(e)?,
                }
            }
            if a.past_deadline() {
                return Err(a.timed_out());
            }
            if a.watch.is_none() {
                // Subscribe, then retry at once: a release between the failed try and the
                // subscription is then not missed.
                a.queue().await?;
                try_now = true;
                continue;
            }
            a.wait_for_turn().await;
            // A try sent now could only be cut off unread by the deadline (and then given back):
            // the wait is over.
            if a.past_deadline() {
                return Err(a.timed_out());
            }
            try_now = true;
        }
    }
}

/// One call of [`Lock::acquire`]: its settings and what its tries have learned so far.
struct Acquisition<'a> {
    lock: &'a Lock,
    backend: &'a Arc<dyn Backend>,
    /// The fresh owner id of the next try (the parent's for a re-entry).
    owner: Arc<str>,
    /// The hold this acquisition re-enters, if any.
    parent: Option<Arc<crate::guard::Hold>>,
    started: Instant,
    /// `started + wait`; `None` when too far to represent (waits for ever).
    deadline: Option<Instant>,
    /// The next try is the first and made right away: its lease counts from `started`.
    first_try: bool,
    watch: Option<Watch>,
    /// Time left on the holder's lease, as this call's last busy reply said.
    remaining: Option<Duration>,
    /// When the holder's lease ends, as this call's last busy reply said.
    reported_end: Option<Instant>,
    /// A try of this call was answered busy: a wait that runs out is contention.
    heard_busy: bool,
    last_err: Option<LockError>,
    give_up: GiveUp<'a>,
    labels: &'a crate::metrics::Labels,
}

impl Acquisition<'_> {
    fn name(&self) -> &str {
        &self.lock.name
    }

    fn past_deadline(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    fn send_time(&mut self) -> Instant {
        if std::mem::take(&mut self.first_try) {
            self.started
        } else {
            Instant::now()
        }
    }

    /// After a try whose outcome is unknown (it was cleaned up under its owner id), later tries
    /// use a new one, so a try that still runs late cannot be counted twice; after a busy one
    /// too where the backend asks for it (`Backend::fresh_owner_per_try`).
    fn new_owner(&mut self) {
        self.owner = context::new_owner();
        self.give_up.owner = self.owner.clone();
        if let Some(w) = &self.watch {
            w.set_owner(&self.owner);
        }
    }

    /// **Try**: one try, bounded by its lease and by the wait. `Err` ends the acquisition (a
    /// single try or the wait timed out); `Ok` carries the try's own outcome.
    async fn try_once(&mut self, sent: Instant) -> Result<Result<Acquired, LockError>, LockError> {
        let (lock, owner) = (self.lock, self.owner.clone());
        let attempt = try_acquire_guarded(
            self.backend,
            &lock.name,
            &owner,
            lock.ttl,
            self.parent.is_none(),
            lock.fair,
        );
        // A reply later than the lease it asks for is useless (a grant would be given back as
        // late), so one try never waits longer than the ttl, nor past the wait.
        let wait_end = self.deadline.filter(|_| !lock.wait.is_zero());
        let lease_end = sent.checked_add(lock.ttl);
        let limit = match (wait_end, lease_end) {
            (Some(w), Some(l)) => Some(w.min(l)),
            (w, l) => w.or(l),
        };
        let mut attempt = std::pin::pin!(attempt);
        // A try that is ready at once (the in-memory backend) needs no timer.
        let first = crate::guard::poll_once(&mut attempt).await;
        Ok(match (first, limit) {
            (std::task::Poll::Ready(r), _) => r,
            (_, Some(d)) => match tokio::time::timeout_at(d, attempt).await {
                Ok(r) => r,
                // The reply is late: if it turns out to be a grant, the try's drop guard gives it
                // back, so a timed-out acquire never leaves a hold (or an inflated count) behind.
                // The wait ran out: contention if the server said busy before, else the backend
                // did not answer, which is an error (a 503, not a "locked").
                Err(_) if wait_end.is_some_and(|w| Instant::now() >= w) => {
                    return Err(if self.heard_busy || self.last_err.is_some() {
                        self.timed_out()
                    } else {
                        LockError::backend(
                            &lock.name,
                            format!("no reply to the acquire within the wait ({:?})", lock.wait),
                        )
                    });
                }
                // A single try that got no answer within its lease: an error, not contention.
                Err(_) if lock.wait.is_zero() => {
                    return Err(LockError::backend(
                        &lock.name,
                        format!(
                            "no reply to the acquire within the lease's ttl ({:?})",
                            lock.ttl
                        ),
                    ));
                }
                Err(_) => Err(LockError::backend(
                    &lock.name,
                    format!(
                        "no reply to the acquire within the lease's ttl ({:?})",
                        lock.ttl
                    ),
                )),
            },
            (_, None) => attempt.await,
        })
    }

    /// A try was granted: the guard, or `None` when the grant came too late and was given back
    /// (try again).
    async fn granted(
        &mut self,
        token: u64,
        count: u32,
        sent: Instant,
    ) -> Result<Option<LockGuard>, LockError> {
        let lock = self.lock;
        if let Some(p) = &self.parent
            && count <= 1
        {
            // The server did not know the outer hold (its lease ended there): this is a fresh
            // grant, not a re-entry. Give it back and report the outer hold lost.
            p.mark_lost(crate::LostReason::NotOwner);
            // Awaited (so the name is free when this returns), but never past the fresh grant's
            // own lease; then it goes on in the background.
            let give_back = self.backend.release(&lock.name, &self.owner, None, true);
            if tokio::time::timeout(lock.ttl, give_back).await.is_err() {
                spawn_release(self.backend, &lock.name, &self.owner, lock.ttl);
            }
            return Err(p.lost_error());
        }
        if self.parent.is_none() && Instant::now() >= sent + lock.ttl {
            // The reply arrived after the lease it grants had run out (this process was paused
            // or starved): another owner may hold the lock by now, and a guard would be born
            // lost. Give the grant back (owner-checked) and go on as if it had not happened.
            tracing::warn!(
                key = %lock.name,
                late_ms = sent.elapsed().saturating_sub(lock.ttl).as_millis() as u64,
                "dlock: a grant arrived after its lease had run out; given back"
            );
            spawn_release(self.backend, &lock.name, &self.owner, lock.ttl);
            self.new_owner();
            if lock.wait.is_zero() {
                return Err(LockError::TimedOut {
                    key: lock.name.clone(),
                    waited: self.started.elapsed(),
                    retry_after: None,
                });
            }
            return Ok(None);
        }
        if let Some(w) = &self.watch {
            w.note_remaining(lock.ttl);
        }
        self.give_up.backend = None;
        Ok(Some(LockGuard::new(
            GuardInit {
                backend: self.backend.clone(),
                name: lock.name.clone(),
                owner: self.owner.clone(),
                token,
                sent,
                ttl: lock.ttl,
                watchdog: lock.watchdog,
                max_hold: lock.max_hold,
                hold_at_least: lock.hold_at_least,
                parent: self.parent.clone(),
                metric: self.labels.clone(),
            },
            count,
        )))
    }

    /// A try found the name busy: `Err` for a single try or a re-entry, else wait on.
    fn busy(&mut self, r: Option<Duration>) -> Result<(), LockError> {
        if let Some(p) = &self.parent {
            // The server gave this chain's lock to another owner: the outer hold is lost, and
            // waiting for ourselves would be wrong.
            p.mark_lost(crate::LostReason::NotOwner);
            return Err(p.lost_error());
        }
        self.heard_busy = true;
        self.remaining = r;
        // A remaining time the server reported is not trusted to be small: too far to represent
        // is no reported end.
        self.reported_end = r.and_then(|r| Instant::now().checked_add(r));
        self.last_err = None;
        if let Some(w) = &self.watch {
            if let Some(end) = self.reported_end {
                w.note_reported_end(end);
            }
            // No reported expiry (a key without a ttl): assume one lease of ours, so that
            // waiting never turns into a tight retry loop.
            w.note_remaining(r.unwrap_or(self.lock.ttl));
        }
        if self.lock.wait.is_zero() {
            return Err(LockError::Busy {
                key: self.lock.name.clone(),
                retry_after: r,
            });
        }
        if self.backend.fresh_owner_per_try() && !self.lock.fair {
            // The busy try's clean-up may still run on the server (Redlock: on the nodes it
            // took, in the background, or late after a timeout): under this owner id it would
            // delete a later try's grant behind its guard.
            self.new_owner();
        }
        Ok(())
    }

    /// A try failed (its outcome is unknown, and its drop guard gave it back): `Err` for a
    /// single try, else wait on with a new owner id.
    fn failed(&mut self, e: LockError) -> Result<(), LockError> {
        if self.lock.wait.is_zero() || e.is_definite_refusal() {
            return Err(e);
        }
        tracing::debug!(key = %self.name(), error = %e, "dlock: acquire failed while waiting; retrying");
        self.last_err = Some(e);
        if self.parent.is_none() {
            self.new_owner();
        }
        Ok(())
    }

    /// **Queue**: subscribe to the name's releases, bounded by the wait.
    async fn queue(&mut self) -> Result<(), LockError> {
        let fut = self.backend.watch(&self.lock.name);
        let w = match self.deadline {
            Some(d) => match tokio::time::timeout_at(d, fut).await {
                Ok(w) => w?,
                Err(_) => return Err(self.timed_out()),
            },
            None => fut.await?,
        };
        tracing::debug!(
            key = %self.name(),
            retry_after_ms = self.remaining.map(|r| r.as_millis() as u64),
            wait_ms = self.lock.wait.as_millis() as u64,
            "dlock: waiting for a release"
        );
        if let Some(end) = self.reported_end {
            w.note_reported_end(end);
        }
        w.set_owner(&self.owner);
        self.watch = Some(w);
        Ok(())
    }

    /// **Wait**: until a release wakes this waiter, the holder's lease ends, or the deadline.
    async fn wait_for_turn(&mut self) {
        let Some(w) = &self.watch else {
            return;
        };
        let now = Instant::now();
        let mut until = self.deadline;
        let lease_end = if self.last_err.is_some() {
            Some(now + ERROR_BACKOFF)
        } else {
            w.lease_end()
        };
        if let Some(t) = lease_end {
            // One millisecond past the reported end, as the server rounds to milliseconds.
            let t = t + Duration::from_millis(1);
            until = Some(until.map_or(t, |d| d.min(t)));
        }
        if self.lock.fair {
            // A queued waiter of a fair lock renews its place (its heartbeat) by trying again.
            let t = now + fair_heartbeat(self.lock.ttl) / 2;
            until = Some(until.map_or(t, |d| d.min(t)));
        }
        let sleep = async {
            match until {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            _ = w.woken() => {}
            _ = sleep => {}
        }
    }

    /// The error of a wait that ran out: the last backend error, else `TimedOut` with the time
    /// left on the holder's lease as this call's last busy reply said or, when its own tries
    /// went unanswered (queued behind other local waiters, a slow server), as another waiter of
    /// the name here last heard from the server.
    fn timed_out(&mut self) -> LockError {
        if let Some(e) = self.last_err.take() {
            return e;
        }
        let retry_after = self.remaining.or_else(|| {
            self.watch
                .as_ref()
                .and_then(Watch::reported_lease_end)
                .map(|t| t.saturating_duration_since(Instant::now()))
                .filter(|d| !d.is_zero())
        });
        LockError::TimedOut {
            key: self.lock.name.clone(),
            waited: self.started.elapsed(),
            retry_after,
        }
    }
}

/// One try, with a drop guard: when the caller stops waiting for it (a wait deadline, a
/// dropped acquire future) or it fails with an error, a grant that may still arrive late is
/// given back.
fn try_acquire_guarded<'a>(
    backend: &'a Arc<dyn Backend>,
    name: &'a str,
    owner: &'a Arc<str>,
    ttl: Duration,
    fresh_owner: bool,
    fair: bool,
) -> impl std::future::Future<Output = Result<Acquired, LockError>> + Send + 'a {
    // A re-entry needs no clean-up: an extra count it may leave is cleared by the outermost
    // release, which deletes the lock whatever the count.
    let mut done = InFlight {
        backend: fresh_owner.then_some(backend),
        name,
        owner,
        ttl,
    };
    async move {
        // A re-entry (not a fresh owner) is never queued: it holds the name already.
        let r = if fair && fresh_owner {
            backend
                .try_acquire_fair(name, owner, ttl, fair_heartbeat(ttl))
                .await
        } else {
            backend.try_acquire(name, owner, ttl).await
        };
        // An error (a response timeout, a dropped connection) leaves the outcome unknown: the
        // try may still run on the server. Stay armed, so the drop sends an owner-checked
        // release after it on the same connection, and a late grant is deleted.
        if r.is_ok() {
            done.disarm();
        }
        r
    }
}

/// Drop guard for an acquire whose reply was not read. The owner id is fresh and used by this
/// acquisition only, so releasing it is right whether or not the try reached the server: a grant
/// is deleted, anything else answers `NotOwner`. A cancelled acquire thus leaves no lock behind.
struct InFlight<'a> {
    backend: Option<&'a Arc<dyn Backend>>,
    name: &'a str,
    owner: &'a Arc<str>,
    ttl: Duration,
}

impl InFlight<'_> {
    /// The reply was read: nothing to clean up.
    fn disarm(&mut self) {
        self.backend = None;
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(backend) = self.backend.take() {
            spawn_release(backend, self.name, self.owner, self.ttl);
        }
    }
}

/// Drop guard of a wait on a backend that queues failed tries: unless disarmed by a grant,
/// releases `owner` (which removes its queued contender) when the wait ends.
struct GiveUp<'a> {
    backend: Option<&'a Arc<dyn Backend>>,
    name: &'a str,
    owner: Arc<str>,
    ttl: Duration,
}

impl Drop for GiveUp<'_> {
    fn drop(&mut self) {
        if let Some(backend) = self.backend.take() {
            spawn_release(backend, self.name, &self.owner, self.ttl);
        }
    }
}

/// Gives back every hold of `owner` on `name` in the background ([`GiveBack`]): owner-checked
/// (a lock that another owner holds by now is left alone) and retried with back-off until the
/// backend answers, so a try whose outcome was unknown during a partition is cleaned up as soon
/// as the server answers again instead of blocking the name for a whole lease. On a runtime that
/// is shutting down, or outside any runtime, it runs on a helper thread.
fn spawn_release(backend: &Arc<dyn Backend>, name: &str, owner: &Arc<str>, ttl: Duration) {
    GiveBack::all(backend.clone(), name, owner.clone(), ttl).spawn();
}

/// A `Config` error when `what` (acquire, extend, release) is polled outside a tokio runtime, as
/// under `futures::executor::block_on`: every call to a server is bounded by tokio's timers and
/// backends run background tasks, so without a runtime they would panic instead.
pub(crate) fn require_runtime(what: &str, name: &str) -> Result<(), LockError> {
    match tokio::runtime::Handle::try_current() {
        Ok(_) => Ok(()),
        Err(_) => Err(LockError::Config(format!(
            "lock `{name}`: {what} was polled outside a tokio runtime; dlock's calls need one \
             (run them on a tokio runtime, e.g. under #[tokio::main], not futures' block_on)"
        ))),
    }
}
