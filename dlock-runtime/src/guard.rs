//! The lock guard, its lease bookkeeping and the watchdog that renews it.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::{Backend, Extended, Released};
use crate::context::{self, Frame};
use crate::give_back::{Call, GiveBack, ReleaseFuture};
use crate::watchdog::{self, Slot};
use crate::{LockError, LostReason};

/// The state of one hold, shared by its guard, its watchdog and nested (re-entrant) guards.
pub(crate) struct Hold {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) name: String,
    pub(crate) owner: Arc<str>,
    pub(crate) token: u64,
    acquired_at: Instant,
    /// When the watchdog stops renewing (`max_hold`), if capped.
    hold_until: Option<Instant>,
    /// Lease length used by renewals, in ms (changed by `extend`).
    ttl_ms: AtomicU64,
    /// The local deadline: send time of the last confirmed acquire or renewal plus the ttl.
    deadline: Mutex<Instant>,
    /// Bumped by every `extend` when it is sent: a renewal sent before it must not confirm
    /// after it (its reply may arrive later than the extend's), and an older extend not after
    /// a newer one.
    epoch: AtomicU64,
    /// Notified when an extend sets the deadline (`lost()` re-reads it).
    deadline_changed: Notify,
    lost: CancellationToken,
    lost_reason: OnceLock<LostReason>,
    /// Stops the watchdog (release or drop of the outermost guard).
    stop: StopFlag,
    /// The hold's place in its runtime's watchdog, if it has one.
    wd: Option<Slot>,
    metric: crate::metrics::HoldMetric,
}

impl fmt::Debug for Hold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hold")
            .field("name", &self.name)
            .field("token", &self.token)
            .field("lost", &self.lost_reason.get())
            .finish_non_exhaustive()
    }
}

impl Hold {
    pub(crate) fn backend_id(&self) -> usize {
        backend_id(&self.backend)
    }

    pub(crate) fn slot(&self) -> Option<&Slot> {
        self.wd.as_ref()
    }

    pub(crate) fn is_stopped(&self) -> bool {
        self.stop.is_cancelled()
    }

    pub(crate) async fn stopped(&self) {
        self.stop.cancelled().await
    }

    pub(crate) fn hold_until(&self) -> Option<Instant> {
        self.hold_until
    }

    pub(crate) fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms.load(Ordering::Relaxed))
    }

    pub(crate) fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a confirmed acquire or renewal sent at `sent`. A renewal only moves the deadline
    /// forward (a late reply to an older renewal must not move it back); an explicit extend sets
    /// it, since a shorter lease on the server must shorten the local one too.
    ///
    /// `epoch` is [`Hold::epoch`] as read when the call was sent: a confirmation from before the
    /// latest extend is ignored (its lease on the server was replaced by the extend's). Returns
    /// whether it was applied.
    pub(crate) fn confirm(&self, sent: Instant, ttl: Duration, set: bool, epoch: u64) -> bool {
        let mut d = self.deadline.lock().unwrap_or_else(|e| e.into_inner());
        // Checked under the deadline's lock, which `extend` confirms under too.
        if self.epoch.load(Ordering::Acquire) != epoch {
            return false;
        }
        // Durations are capped at `Lock::MAX_DURATION`, so this cannot overflow in practice;
        // if it did, the deadline stays where it was.
        let Some(new) = sent.checked_add(ttl.saturating_sub(self.backend.lease_margin(ttl))) else {
            return false;
        };
        if set || new > *d {
            *d = new;
        }
        drop(d);
        if set {
            self.deadline_changed.notify_waiters();
        }
        true
    }

    /// The epoch and the ttl a renewal is about to send, read together: a renewal that sees an
    /// extend's epoch also sends that extend's ttl, so it cannot set the server's lease back to
    /// the old ttl after the extend set the new one.
    pub(crate) fn renewal(&self) -> (u64, Duration) {
        let _d = self.deadline.lock().unwrap_or_else(|e| e.into_inner());
        (self.epoch.load(Ordering::Acquire), self.ttl())
    }

    /// A new epoch for an extend to `ttl` about to be sent; renewals from now on send `ttl` too
    /// (also if this extend then fails: the next renewal sets the lease the caller asked for).
    fn begin_extend(&self, ttl: Duration) -> u64 {
        let _d = self.deadline.lock().unwrap_or_else(|e| e.into_inner());
        self.ttl_ms
            .store(ttl.as_millis().max(1) as u64, Ordering::Relaxed);
        self.epoch.fetch_add(1, Ordering::AcqRel) + 1
    }

    pub(crate) fn mark_lost(&self, reason: LostReason) {
        if self.lost_reason.set(reason).is_ok() {
            let late = Instant::now().saturating_duration_since(self.deadline());
            tracing::warn!(
                target: "dlock.lost",
                key = %self.name,
                token = self.token,
                reason = %reason,
                late_ms = late.as_millis() as u64,
                "dlock: lease lost"
            );
            // Counted before the signal, so that whoever hears `lost()` sees the count too.
            self.metric.lost(self.acquired_at, reason);
            self.lost.cancel();
            self.stop.cancel();
            // A hold kept alive by a session or a lease shared with other holds (ZooKeeper,
            // etcd, advisory mode) never ends by itself: once its guard can no longer vouch for
            // it (its deadline or `max_hold` passed), give it back, or code that hangs would hold
            // the name for as long as the process lives. The server already freed a hold lost
            // to another owner.
            if reason != LostReason::NotOwner && !self.backend.lease_expires_by_ttl() {
                GiveBack::all(
                    self.backend.clone(),
                    &self.name,
                    self.owner.clone(),
                    self.ttl(),
                )
                .spawn();
            }
        }
    }

    /// Why a lease whose deadline passed at `now` ended: the `max_hold` cap once it was reached
    /// (renewal stopped there), else the deadline. Shared by the watchdog, `lost()` and
    /// `lost_reason()`, so whichever notices first records the same reason.
    pub(crate) fn expiry_reason(&self, now: Instant) -> LostReason {
        if self.hold_until.is_some_and(|h| h <= now) {
            LostReason::MaxHold
        } else {
            LostReason::Deadline
        }
    }

    /// Not lost, not given back by its outermost guard (an inner guard that outlives the outer
    /// release is not valid), and before the deadline.
    pub(crate) fn is_valid(&self) -> bool {
        !self.lost.is_cancelled() && !self.stop.is_cancelled() && Instant::now() < self.deadline()
    }

    /// The error for a hold that is no longer valid.
    pub(crate) fn lost_error(&self) -> LockError {
        LockError::Lost {
            key: self.name.clone(),
            reason: self
                .lost_reason
                .get()
                .copied()
                .unwrap_or_else(|| self.expiry_reason(Instant::now())),
        }
    }
}

/// A one-way "stopped" flag that can be awaited; cheaper than a `CancellationToken` (no
/// allocation), which matters because every hold has one.
#[derive(Debug, Default)]
struct StopFlag {
    set: AtomicBool,
    notify: Notify,
}

impl StopFlag {
    fn cancel(&self) {
        if !self.set.swap(true, Ordering::AcqRel) {
            self.notify.notify_waiters();
        }
    }

    fn is_cancelled(&self) -> bool {
        self.set.load(Ordering::Acquire)
    }

    async fn cancelled(&self) {
        loop {
            let notified = self.notify.notified();
            if self.is_cancelled() {
                return;
            }
            notified.await;
        }
    }
}

pub(crate) fn backend_id(b: &Arc<dyn Backend>) -> usize {
    Arc::as_ptr(b) as *const () as usize
}

/// How a guard was made.
pub(crate) struct GuardInit {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) name: String,
    pub(crate) owner: Arc<str>,
    pub(crate) token: u64,
    pub(crate) sent: Instant,
    pub(crate) ttl: Duration,
    pub(crate) watchdog: bool,
    pub(crate) max_hold: Option<Duration>,
    pub(crate) hold_at_least: Option<Duration>,
    /// The hold this acquisition re-entered, if any.
    pub(crate) parent: Option<Arc<Hold>>,
    pub(crate) metric: crate::metrics::Labels,
}

/// A held lock. Give it back with [`LockGuard::release`]; dropping it releases in the background.
///
/// While it lives and the watchdog is on (the default), the lease is renewed every ttl/3. The guard
/// keeps its own deadline on a monotonic clock (the send time of the last confirmed acquire or
/// renewal plus the ttl) and counts itself lost once that passes, whether or not the server has
/// answered: see [`LockGuard::lost`] and [`LockGuard::is_valid`].
///
/// A guard for a re-entered lock (a nested acquisition of a name this call chain already holds)
/// shares the outer hold's lease, token and lost signal; releasing it gives back one hold.
#[must_use = "the lock is released when the guard is dropped; bind it to a variable"]
#[clippy::has_significant_drop]
pub struct LockGuard {
    hold: Arc<Hold>,
    outer: bool,
    count: u32,
    keep_until: Option<Instant>,
    done: bool,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.hold.name)
            .field("fencing_token", &self.hold.token)
            .field("hold_count", &self.count)
            .field("valid", &self.hold.is_valid())
            .finish()
    }
}

impl LockGuard {
    pub(crate) fn new(init: GuardInit, count: u32) -> LockGuard {
        let keep_until = init.hold_at_least.map(|d| init.sent + d);
        if let Some(parent) = init.parent {
            return LockGuard {
                hold: parent,
                outer: false,
                count,
                keep_until,
                done: false,
            };
        }
        let lease = init.ttl.saturating_sub(init.backend.lease_margin(init.ttl));
        let hold = Arc::new(Hold {
            backend: init.backend,
            name: init.name,
            owner: init.owner,
            token: init.token,
            acquired_at: init.sent,
            hold_until: init.max_hold.map(|m| init.sent + m),
            ttl_ms: AtomicU64::new(init.ttl.as_millis().max(1) as u64),
            deadline: Mutex::new(init.sent + lease),
            epoch: AtomicU64::new(0),
            deadline_changed: Notify::new(),
            lost: CancellationToken::new(),
            lost_reason: OnceLock::new(),
            stop: StopFlag::default(),
            wd: watchdog::slot(init.watchdog, init.sent + lease / 3),
            metric: crate::metrics::HoldMetric::start(init.metric),
        });
        watchdog::arm(&hold);
        // A backend that hears of a loss by itself (a ZooKeeper session expiry) reports it at once.
        if let Some(signal) = hold.backend.lost_signal(&hold.name, &hold.owner)
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            let h = hold.clone();
            rt.spawn(async move {
                tokio::select! {
                    biased;
                    _ = h.stopped() => {}
                    _ = signal => {
                        if !h.is_stopped() {
                            h.mark_lost(LostReason::NotOwner);
                        }
                    }
                }
            });
        }
        LockGuard {
            hold,
            outer: true,
            count,
            keep_until,
            done: false,
        }
    }

    /// The lock name.
    pub fn key(&self) -> &str {
        &self.hold.name
    }

    /// The backend that holds this lock.
    pub(crate) fn backend(&self) -> &Arc<dyn Backend> {
        &self.hold.backend
    }

    /// Marks the hold lost (the store proved a later grant: an election's refused record).
    pub(crate) fn mark_lost(&self, reason: LostReason) {
        self.hold.mark_lost(reason);
    }

    /// The fencing token of this hold: larger than every token handed out before for this name
    /// (on Redis, `max(last + 1, server time in µs)`, so it keeps increasing across a restart
    /// without persistence). Send it with writes to a resource that refuses lower tokens.
    pub fn fencing_token(&self) -> u64 {
        self.hold.token
    }

    /// The owner id this hold is registered under (a random process id and a counter).
    pub fn owner(&self) -> &str {
        &self.hold.owner
    }

    /// The hold count right after this acquisition (1 unless re-entered).
    pub fn hold_count(&self) -> u32 {
        self.count
    }

    /// True while the lease is believed held: not lost and before the local deadline.
    pub fn is_valid(&self) -> bool {
        self.hold.is_valid()
    }

    /// Time left until the local deadline (zero when lost).
    pub fn remaining(&self) -> Duration {
        if self.hold.lost.is_cancelled() || self.hold.stop.is_cancelled() {
            return Duration::ZERO;
        }
        self.hold
            .deadline()
            .saturating_duration_since(Instant::now())
    }

    /// `Ok(())` while valid, else the [`LockError::Lost`] to return.
    pub fn ensure_valid(&self) -> Result<(), LockError> {
        if self.is_valid() {
            Ok(())
        } else {
            Err(self.lost_error())
        }
    }

    /// Why the lease was lost, once it was.
    pub fn lost_reason(&self) -> Option<LostReason> {
        self.hold.lost_reason.get().copied().or_else(|| {
            let now = Instant::now();
            (now >= self.hold.deadline()).then(|| self.hold.expiry_reason(now))
        })
    }

    fn lost_error(&self) -> LockError {
        self.hold.lost_error()
    }

    /// Completes when the lease is lost: the local deadline passed, a renewal found another owner,
    /// or `max_hold` ran out. Never completes for a lease that is released first.
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        let hold = self.hold.clone();
        async move {
            loop {
                let changed = hold.deadline_changed.notified();
                let deadline = hold.deadline();
                tokio::select! {
                    biased;
                    _ = hold.lost.cancelled() => break,
                    // An extend moved the deadline (maybe earlier): re-read it.
                    _ = changed => {}
                    _ = hold.stop.cancelled() => {
                        // Released or dropped before it was lost: never completes (the deadline
                        // is no longer renewed, so waiting for it would report a false loss).
                        if !hold.lost.is_cancelled() {
                            std::future::pending::<()>().await;
                        }
                        break;
                    }
                    _ = tokio::time::sleep_until(deadline) => {
                        if Instant::now() >= hold.deadline() {
                            hold.mark_lost(hold.expiry_reason(Instant::now()));
                            break;
                        }
                    }
                }
            }
            hold.lost_reason
                .get()
                .copied()
                .unwrap_or(LostReason::Deadline)
        }
    }

    /// A token cancelled when the lease is lost (the same event as [`LockGuard::lost`]; fired by
    /// the watchdog task, which also runs with the watchdog turned off to watch the deadline).
    pub fn lost_token(&self) -> CancellationToken {
        self.hold.lost.clone()
    }

    /// Sets the lease to `ttl` from now, if this owner still holds the lock; later renewals by
    /// the watchdog use `ttl` too. Gives [`LockError::Lost`] when another owner has it now, or
    /// when the lease's own deadline passes before the backend answers (the call then returns at
    /// that deadline, whatever the server does).
    pub async fn extend(&self, ttl: Duration) -> Result<(), LockError> {
        if ttl.is_zero() {
            return Err(LockError::Config("extend needs a positive ttl".into()));
        }
        if ttl > crate::Lock::MAX_DURATION {
            return Err(LockError::Config(format!(
                "lock `{}`: extend({ttl:?}) is above the cap of {:?}",
                self.hold.name,
                crate::Lock::MAX_DURATION
            )));
        }
        crate::lock::require_runtime("extend", &self.hold.name)?;
        if !self.hold.is_valid() {
            return Err(self.lost_error());
        }
        let epoch = self.hold.begin_extend(ttl);
        let sent = Instant::now();
        let mut call = self
            .hold
            .backend
            .extend(&self.hold.name, &self.hold.owner, ttl);
        let Some(r) = until_lost(&self.hold, &mut call).await else {
            return Err(self.lost_error());
        };
        match r? {
            Extended::Extended => {
                // Only the newest extend applies (an older one answered late changes nothing).
                if self.hold.confirm(sent, ttl, true, epoch) {
                    // The next renewal and the deadline event follow the new lease.
                    let lease = ttl.saturating_sub(self.hold.backend.lease_margin(ttl));
                    watchdog::rescheduled(&self.hold, sent + lease / 3);
                }
                Ok(())
            }
            Extended::Lost => {
                self.hold.mark_lost(LostReason::NotOwner);
                Err(self.lost_error())
            }
        }
    }

    /// Runs `fut` inside this hold's lock context: a nested acquisition of the same name on the
    /// same backend re-enters instead of waiting for itself, and [`crate::fencing_token`] returns
    /// this hold's token.
    pub async fn scope<F: Future>(&self, fut: F) -> F::Output {
        context::scope(Frame::new(self.hold.clone()), fut).await
    }

    /// The hold this guard shares with its watchdog (for [`crate::RwLock`]'s downgrade).
    pub(crate) fn hold(&self) -> &Arc<Hold> {
        &self.hold
    }

    /// True for the outermost guard of its hold (not a re-entry).
    pub(crate) fn is_outer(&self) -> bool {
        self.outer
    }

    /// Ends the guard without a release call: its watchdog stops and its drop sends nothing.
    /// For a hold the server has already turned into another (a downgrade).
    pub(crate) fn forget(mut self) {
        self.finish();
    }

    /// Marks the guard given back and stops its watchdog (outermost guard only); returns how long
    /// `hold_at_least` still keeps the lock taken. Shared by `release` and `Drop`.
    fn finish(&mut self) -> Option<Duration> {
        self.done = true;
        if self.outer {
            self.hold.stop.cancel();
            watchdog::stop(&self.hold);
            self.hold.metric.end(self.hold.acquired_at);
        }
        self.keep_until
            .map(|t| t.saturating_duration_since(Instant::now()))
            .filter(|d| !d.is_zero())
    }

    /// Gives the lock back and waits for the backend to confirm. With `hold_at_least`, a release
    /// before that time keeps the lock taken until then.
    ///
    /// A guard that is no longer valid (lost, or past its deadline) returns [`LockError::Lost`]
    /// at once, and a release the backend does not confirm by the lease's deadline returns
    /// [`LockError::Lost`] at that deadline: in both cases the give-back goes on in the
    /// background (owner-checked, bounded, logged when it fails), so the caller never waits on a
    /// server that does not answer. Gives [`LockError::NotOwner`] when the backend says another
    /// owner holds the lock now; nothing is deleted then.
    pub async fn release(mut self) -> Result<(), LockError> {
        let valid = self.hold.is_valid();
        let keep = self.finish();
        let mut call = PendingRelease::new(self.hold.clone(), keep, self.outer);
        if !valid {
            // `call` goes to the background when dropped here.
            return Err(self.lost_error());
        }
        // Outside a runtime `call` is given back by the give-back's helper thread when dropped.
        crate::lock::require_runtime("release", &self.hold.name)?;
        // Timings only when someone listens: a clock read is a measurable part of a pair.
        let started = tracing::enabled!(tracing::Level::DEBUG).then(Instant::now);
        let Some(r) = until_lost(&self.hold, call.future()).await else {
            return Err(self.lost_error());
        };
        call.done();
        if let Err(e) = &r
            && self.outer
        {
            // No answer from the server (a transport error, a timeout): the release may or may
            // not have run. Releasing every hold is owner-checked and idempotent, so it is sent
            // again in the background until the server confirms, as a dropped guard's is.
            tracing::debug!(key = %self.hold.name, error = %e, "dlock: release failed; giving the lock back in the background");
            let h = &self.hold;
            GiveBack::all(h.backend.clone(), &h.name, h.owner.clone(), h.ttl())
                .keep(keep)
                .spawn();
        }
        if let Some(started) = started {
            tracing::debug!(
                key = %self.hold.name,
                token = self.hold.token,
                held_ms = started.saturating_duration_since(self.hold.acquired_at).as_millis() as u64,
                release_us = started.elapsed().as_micros() as u64,
                "dlock: released"
            );
        }
        match r? {
            Released::Freed | Released::Decremented(_) => Ok(()),
            Released::NotOwner => Err(LockError::NotOwner {
                key: self.hold.name.clone(),
            }),
        }
    }
}

/// Awaits `fut` while `hold` is valid: `None` once the hold is lost or its deadline passes first
/// (the deadline is re-read, as renewals move it). `fut` is left unfinished then.
async fn until_lost<F: Future + Unpin>(hold: &Hold, fut: &mut F) -> Option<F::Output> {
    // A call that is ready at once (the in-memory backend) needs no timer: no timer entry on
    // that path, and it works outside a tokio runtime.
    if let std::task::Poll::Ready(r) = poll_once(fut).await {
        return Some(r);
    }
    loop {
        let deadline = hold.deadline();
        tokio::select! {
            biased;
            r = &mut *fut => return Some(r),
            _ = hold.lost.cancelled() => return None,
            _ = tokio::time::sleep_until(deadline) => {
                let now = Instant::now();
                if now >= hold.deadline() {
                    hold.mark_lost(hold.expiry_reason(now));
                    return None;
                }
            }
        }
    }
}

/// Polls `fut` once.
pub(crate) async fn poll_once<F: Future + Unpin>(fut: &mut F) -> std::task::Poll<F::Output> {
    std::future::poll_fn(|cx| std::task::Poll::Ready(std::pin::Pin::new(&mut *fut).poll(cx))).await
}

/// A release call in flight. Dropped before its reply was read (the caller stopped waiting: a
/// deadline, a cancelled future), it finishes in the background ([`GiveBack`]).
struct PendingRelease {
    hold: Arc<Hold>,
    call: Option<Call>,
    keep: Option<Duration>,
    all: bool,
}

impl PendingRelease {
    fn new(hold: Arc<Hold>, keep: Option<Duration>, all: bool) -> Self {
        let h = hold.clone();
        let polled = Arc::new(AtomicBool::new(false));
        let p = polled.clone();
        let fut: ReleaseFuture = Box::pin(async move {
            p.store(true, Ordering::Release);
            h.backend.release(&h.name, &h.owner, keep, all).await
        });
        PendingRelease {
            hold,
            call: Some(Call { fut, polled }),
            keep,
            all,
        }
    }

    fn future(&mut self) -> &mut ReleaseFuture {
        &mut self.call.as_mut().expect("release future taken").fut
    }

    /// The reply was read: nothing left to do on drop.
    fn done(&mut self) {
        self.call = None;
    }
}

impl Drop for PendingRelease {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            let h = &self.hold;
            GiveBack::finish(
                h.backend.clone(),
                &h.name,
                h.owner.clone(),
                h.ttl(),
                call,
                self.keep,
                self.all,
            )
            .spawn();
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let keep = self.finish();
        // Dropped unfinished, the pending call goes to the background.
        drop(PendingRelease::new(self.hold.clone(), keep, self.outer));
    }
}
