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
    lost: CancellationToken,
    lost_reason: OnceLock<LostReason>,
    /// Stops the watchdog (release or drop of the outermost guard).
    stop: StopFlag,
    /// The hold's place in its runtime's watchdog, if it has one.
    wd: Option<Slot>,
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
    pub(crate) fn confirm(&self, sent: Instant, ttl: Duration, set: bool) {
        let mut d = self.deadline.lock().unwrap_or_else(|e| e.into_inner());
        let new = sent + ttl;
        if set || new > *d {
            *d = new;
        }
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
            self.lost.cancel();
            self.stop.cancel();
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

    pub(crate) fn is_valid(&self) -> bool {
        !self.lost.is_cancelled() && Instant::now() < self.deadline()
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
        let hold = Arc::new(Hold {
            backend: init.backend,
            name: init.name,
            owner: init.owner,
            token: init.token,
            acquired_at: init.sent,
            hold_until: init.max_hold.map(|m| init.sent + m),
            ttl_ms: AtomicU64::new(init.ttl.as_millis().max(1) as u64),
            deadline: Mutex::new(init.sent + init.ttl),
            lost: CancellationToken::new(),
            lost_reason: OnceLock::new(),
            stop: StopFlag::default(),
            wd: watchdog::slot(init.watchdog, init.sent + init.ttl / 3),
        });
        watchdog::arm(&hold);
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
        if self.hold.lost.is_cancelled() {
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
                let deadline = hold.deadline();
                tokio::select! {
                    biased;
                    _ = hold.lost.cancelled() => break,
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
    /// the watchdog use `ttl` too. Gives [`LockError::Lost`] when another owner has it now.
    pub async fn extend(&self, ttl: Duration) -> Result<(), LockError> {
        if ttl.is_zero() {
            return Err(LockError::Config("extend needs a positive ttl".into()));
        }
        if self.hold.lost.is_cancelled() {
            return Err(self.lost_error());
        }
        let sent = Instant::now();
        match self
            .hold
            .backend
            .extend(&self.hold.name, &self.hold.owner, ttl)
            .await?
        {
            Extended::Extended => {
                self.hold
                    .ttl_ms
                    .store(ttl.as_millis().max(1) as u64, Ordering::Relaxed);
                self.hold.confirm(sent, ttl, true);
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

    /// Marks the guard given back and stops its watchdog (outermost guard only); returns how long
    /// `hold_at_least` still keeps the lock taken. Shared by `release` and `Drop`.
    fn finish(&mut self) -> Option<Duration> {
        self.done = true;
        if self.outer {
            self.hold.stop.cancel();
            watchdog::stop(&self.hold);
        }
        self.keep_until
            .map(|t| t.saturating_duration_since(Instant::now()))
            .filter(|d| !d.is_zero())
    }

    /// Gives the lock back and waits for the backend to confirm. With `hold_at_least`, a release
    /// before that time keeps the lock taken until then. Gives [`LockError::NotOwner`] when the
    /// lease had already ended and someone else may hold the lock; nothing is deleted then.
    pub async fn release(mut self) -> Result<(), LockError> {
        let keep = self.finish();
        // Timings only when someone listens: a clock read is a measurable part of a pair.
        let started = tracing::enabled!(tracing::Level::DEBUG).then(Instant::now);
        let r = self
            .hold
            .backend
            .release(&self.hold.name, &self.hold.owner, keep, self.outer)
            .await;
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

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let keep = self.finish();
        let hold = self.hold.clone();
        let outer = self.outer;
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    if let Err(e) = hold.backend.release(&hold.name, &hold.owner, keep, outer).await {
                        tracing::warn!(key = %hold.name, error = %e, "dlock: background release failed; the lock frees when its lease runs out");
                    }
                });
            }
            Err(_) => tracing::warn!(
                key = %self.hold.name,
                "dlock: guard dropped outside a tokio runtime; the lock frees when its lease runs out"
            ),
        }
    }
}
