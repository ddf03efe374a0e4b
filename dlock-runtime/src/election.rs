//! Leader election on any engine: a term is a held lock, its epoch the lock's fencing token.
//!
//! An [`Election`] named `N` campaigns for the lock [`ELECTION_PREFIX`]`N` (`election:N`) with
//! an unbounded wait, so it inherits everything the lock does on that engine: one holder at a
//! time while the store keeps its state, FIFO hand-over and one wake-up per release where the
//! engine has them (Redis family, ZooKeeper, etcd), the watchdog, the loss signal. A won
//! campaign is a [`Term`]; its [`Term::epoch`] is the grant's fencing token (strictly
//! increasing per name on that engine, so a resource can refuse a stale leader's writes), and a
//! term is either alive or lost: there is no `is_leader()` flag that could be read after the
//! fact.
//!
//! The leader's value (an address followers route to) lives in a record beside the lock, written
//! with the term's epoch and refused for an older one ([`crate::backend::Backend::put_record`]),
//! so a stale leader's [`Term::proclaim`] cannot overwrite a newer leader's value; followers
//! read it with [`Election::observe`].

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backend::{Backend, Record};
use crate::{Lock, LockError, LockGuard, LostReason};

/// The prefix of an election's lock name: the election `scheduler` campaigns for the lock
/// `election:scheduler` (and `dlock list election:` lists the terms). Keep your own lock names
/// out of this prefix.
pub const ELECTION_PREFIX: &str = "election:";

/// The default term lease: 15 s (renewed every 5 s while the term lives). A leader that stops
/// renewing (a killed or paused process) is replaced at most this long after its last renewal
/// on the engines whose lease is the ttl (see the README's failover bounds per engine).
pub const DEFAULT_ELECTION_TTL: Duration = Duration::from_secs(15);

/// Fresh grants refused by the leader record in a row before a campaign gives up (see
/// [`Election::campaign`]).
const STALE_GRANTS_IN_A_ROW: u32 = 3;

/// The default pause between two reads of [`Election::observe`]: 200 ms.
pub const DEFAULT_OBSERVE_EVERY: Duration = Duration::from_millis(200);

/// An election: a name, this candidate's value, and how to campaign.
///
/// ```
/// # use dlock_runtime as dlock;
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock::LockError> {
/// use std::time::Duration;
/// dlock::init("memory://").await?;
/// let election = dlock::Election::new("scheduler")
///     .ttl(Duration::from_secs(15))
///     .value("10.0.0.7:8080")
///     .once();
/// let epoch = election
///     .run(|term| async move {
///         // Runs while this process leads; dropped at once when the term is lost.
///         term.epoch() // send it with every write, and let the resource refuse older ones
///     })
///     .await?;
/// assert!(epoch > 0);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Election {
    name: String,
    lock: Lock,
    value: String,
    once: bool,
    observe_every: Duration,
}

impl fmt::Debug for Election {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Election")
            .field("name", &self.name)
            .field("lock", &self.lock)
            .field("value", &self.value)
            .field("once", &self.once)
            .finish()
    }
}

impl Election {
    /// The election `name`: its terms are holds of the lock `election:{name}`
    /// ([`ELECTION_PREFIX`]). A ttl of 15 s, an empty value, the backend `"default"`, and
    /// [`Election::run`] campaigns again after a lost term.
    pub fn new(name: impl Into<String>) -> Election {
        let name = name.into();
        let lock = Lock::new(format!("{ELECTION_PREFIX}{name}"))
            .ttl(DEFAULT_ELECTION_TTL)
            .wait(Duration::MAX)
            .metric_name("election");
        Election {
            name,
            lock,
            value: String::new(),
            once: false,
            observe_every: DEFAULT_OBSERVE_EVERY,
        }
    }

    /// The term's lease (default 15 s), renewed every ttl/3 while the term lives.
    pub fn ttl(mut self, ttl: Duration) -> Election {
        self.lock = self.lock.ttl(ttl);
        self
    }

    /// The value this candidate proclaims when it wins (an address, an id), which
    /// [`Election::observe`] shows to followers. Anyone who can read the store reads it.
    pub fn value(mut self, value: impl Into<String>) -> Election {
        self.value = value.into();
        self
    }

    /// How long a campaign waits for the term (default: for ever). A campaign that runs out
    /// returns [`LockError::TimedOut`].
    pub fn wait(mut self, wait: Duration) -> Election {
        self.lock = self.lock.wait(wait);
        self
    }

    /// The registered backend to use (default `"default"`).
    pub fn backend(mut self, name: impl Into<Cow<'static, str>>) -> Election {
        self.lock = self.lock.backend(name);
        self
    }

    /// A backend to use directly, without the registry.
    pub fn with_backend(mut self, backend: Arc<dyn Backend>) -> Election {
        self.lock = self.lock.with_backend(backend);
        self
    }

    /// [`Election::run`] returns after one term instead of campaigning again after a loss.
    pub fn once(mut self) -> Election {
        self.once = true;
        self
    }

    /// The pause between two reads of the leader record in [`Election::observe`] (default
    /// 200 ms).
    pub fn observe_every(mut self, every: Duration) -> Election {
        self.observe_every = every;
        self
    }

    /// The `lock` label of the terms' metrics (feature `metrics`; default `"election"`).
    pub fn metric_name(mut self, name: impl Into<Cow<'static, str>>) -> Election {
        self.lock = self.lock.metric_name(name);
        self
    }

    /// The election's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The lock a term holds: `election:{name}`.
    pub fn lock_name(&self) -> &str {
        self.lock.name()
    }

    /// Campaigns until this candidate leads (or the [`Election::wait`] runs out): a term.
    ///
    /// Candidates queue as the lock's waiters do: FIFO with one wake-up per hand-over where the
    /// engine has it. On winning, the term writes this candidate's value to the leader record
    /// under its epoch; if a later term already wrote there, this grant is stale (a later one
    /// exists), and the campaign gives it back and goes on; three such grants in a row are a
    /// [`LockError::Backend`] (the engine's tokens went back below the record's epoch, which a
    /// campaign cannot fix).
    pub async fn campaign(&self) -> Result<Term, LockError> {
        let mut refused = 0u32;
        // Candidates are served in arrival order where the engine can queue them (a fair
        // lock): a leader that resigns and campaigns again at once goes behind the candidates
        // already waiting instead of winning the free name back before the woken one tries.
        let fair = self.lock.resolve_backend()?.supports_fair();
        let lock = self.lock.clone().fair(fair);
        loop {
            let guard = lock.acquire().await?;
            let epoch = guard.fencing_token();
            let backend = guard.backend().clone();
            let records = match write_record(&backend, self.lock.name(), epoch, &self.value).await {
                Ok(true) => true,
                Ok(false) => {
                    refused += 1;
                    if refused >= STALE_GRANTS_IN_A_ROW {
                        // Not a race any more: the record's epoch is above what this engine now
                        // mints (its tokens went back: a clock stepped back after the name's
                        // `last` was lost, or a record written through another engine).
                        guard.mark_lost(LostReason::NotOwner);
                        drop(guard);
                        return Err(LockError::backend(
                            self.lock.name(),
                            format!(
                                "the leader record of election `{}` holds an epoch above {refused} fresh grants' in a row; \
                                 this engine's tokens went back (see the token rule), or the record came from elsewhere: \
                                 delete the record to go on",
                                self.name
                            ),
                        ));
                    }
                    tracing::warn!(
                        election = %self.name,
                        epoch,
                        "dlock: a later term wrote the leader record before this one; the grant is stale, campaigning again"
                    );
                    guard.mark_lost(LostReason::NotOwner);
                    drop(guard);
                    continue;
                }
                Err(RecordError::Unsupported) => false,
                Err(RecordError::Failed(e)) => {
                    // The term is the lock: it stands without the record, which followers read
                    // only to route. The next proclaim writes it again.
                    tracing::warn!(
                        election = %self.name,
                        epoch,
                        error = %e,
                        "dlock: the leader record was not written; the term goes on"
                    );
                    true
                }
            };
            tracing::info!(election = %self.name, epoch, "dlock: leading");
            return Ok(Term {
                guard,
                election: self.name.clone(),
                value: Mutex::new(self.value.clone()),
                since: SystemTime::now(),
                records,
            });
        }
    }

    /// Campaigns, then runs `body(term)` while this process leads. The moment the term is lost
    /// the body's future is dropped (cancelled at its next `.await`, with the [`Term`] it owns,
    /// whose lock is given back), and the election campaigns again, unless [`Election::once`]
    /// was set: then it returns [`LockError::Lost`].
    ///
    /// When the body returns, its output is returned and the term ends (the `Term` is dropped
    /// with the body, which gives the lock back; call [`Term::resign`] in the body to await the
    /// hand-over). A body meant to lead for the life of the process loops.
    pub async fn run<F, Fut>(&self, mut body: F) -> Result<Fut::Output, LockError>
    where
        F: FnMut(Term) -> Fut,
        Fut: Future,
    {
        loop {
            let term = self.campaign().await?;
            let lost = term.lost();
            let epoch = term.epoch();
            let fut = body(term);
            tokio::select! {
                biased;
                reason = lost => {
                    tracing::warn!(election = %self.name, epoch, %reason, "dlock: term lost; the leader's work was cancelled");
                    if self.once {
                        return Err(LockError::Lost { key: self.lock.name().to_string(), reason });
                    }
                }
                out = fut => return Ok(out),
            }
        }
    }

    /// The current leader as followers see it: a stream of [`Leader`]s, one each time the
    /// leader record changes (a new term, or a new value proclaimed), read every
    /// [`Election::observe_every`]. Epochs never go back along the stream. A change is seen at
    /// most `observe_every` plus one read after it was written, so every term longer than that
    /// is seen, in order; a term that begins and ends between two reads is not seen. The record is not deleted when a term ends: the
    /// last leader is shown until the next one writes (`dlock leader NAME` shows the lease).
    ///
    /// A backend error is an `Err` item and the stream goes on reading; on a backend without
    /// leader records the one item is that `Config` error. Reading stops when the [`Observer`]
    /// is dropped. Outside a tokio runtime the one item is a `Config` error.
    pub fn observe(&self) -> Observer {
        let (tx, rx) = mpsc::channel(16);
        let stop = CancellationToken::new();
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            // No runtime to read on: the one item says so (never a panic).
            let _ = tx.try_send(Err(LockError::Config(format!(
                "election `{}`: observe() was called outside a tokio runtime",
                self.name
            ))));
            return Observer { rx, stop };
        };
        let lock = self.lock.clone();
        let every = self.observe_every.max(Duration::from_millis(1));
        let ttl = self.lock_ttl();
        let s = stop.clone();
        let task = async move {
            let backend = match lock.resolve_backend() {
                Ok(b) => b,
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            };
            let mut last: Option<Record> = None;
            loop {
                // Bounded: a read that gets no answer within a lease is an error item.
                let read = tokio::time::timeout(ttl, backend.get_record(lock.name())).await;
                let item = match read {
                    Ok(Ok(Some(r))) => {
                        let newer = last.as_ref().is_none_or(|l| {
                            r.epoch > l.epoch || (r.epoch == l.epoch && r.value != l.value)
                        });
                        if newer {
                            last = Some(r.clone());
                            Some(Ok(Leader {
                                value: r.value,
                                epoch: r.epoch,
                                since: SystemTime::now(),
                            }))
                        } else {
                            None
                        }
                    }
                    Ok(Ok(None)) => None,
                    Ok(Err(e)) => {
                        let end = matches!(e, LockError::Config(_));
                        if tx.send(Err(e)).await.is_err() || end {
                            return;
                        }
                        None
                    }
                    Err(_) => Some(Err(LockError::backend(
                        lock.name(),
                        format!("no reply to a leader record read within {ttl:?}"),
                    ))),
                };
                if let Some(item) = item
                    && tx.send(item).await.is_err()
                {
                    return;
                }
                tokio::time::sleep(every).await;
            }
        };
        rt.spawn(async move {
            tokio::select! {
                _ = s.cancelled() => {}
                _ = task => {}
            }
        });
        Observer { rx, stop }
    }

    fn lock_ttl(&self) -> Duration {
        self.lock.ttl_value()
    }
}

enum RecordError {
    Unsupported,
    Failed(LockError),
}

/// Writes the record, bounded by a generous 5 s.
async fn write_record(
    backend: &Arc<dyn Backend>,
    name: &str,
    epoch: u64,
    value: &str,
) -> Result<bool, RecordError> {
    match tokio::time::timeout(
        Duration::from_secs(5),
        backend.put_record(name, epoch, value),
    )
    .await
    {
        Ok(Ok(w)) => Ok(w),
        Ok(Err(LockError::Config(_))) => Err(RecordError::Unsupported),
        Ok(Err(e)) => Err(RecordError::Failed(e)),
        Err(_) => Err(RecordError::Failed(LockError::backend(
            name,
            "no reply to the leader record write within 5s",
        ))),
    }
}

/// One term of leadership: alive until lost, resigned or dropped (which gives it back in the
/// background, as a dropped [`LockGuard`] does).
///
/// There is no `is_leader()`: a check can be stale by the time it is acted on. Send
/// [`Term::epoch`] with every write and let the resource refuse an older epoch, and let
/// [`Election::run`] (or [`Term::lost`]) stop the work when the term ends.
#[must_use = "the term ends when it is dropped; bind it to a variable"]
pub struct Term {
    guard: LockGuard,
    election: String,
    value: Mutex<String>,
    since: SystemTime,
    records: bool,
}

impl fmt::Debug for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Term")
            .field("election", &self.election)
            .field("epoch", &self.epoch())
            .field("value", &self.value())
            .field("remaining", &self.guard.remaining())
            .finish()
    }
}

impl Term {
    /// The fencing epoch of this term: the lock's fencing token, strictly increasing across the
    /// terms of this election on this engine. Send it with every write.
    pub fn epoch(&self) -> u64 {
        self.guard.fencing_token()
    }

    /// The election's name.
    pub fn election(&self) -> &str {
        &self.election
    }

    /// The value last proclaimed by this term.
    pub fn value(&self) -> String {
        self.value.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// When this term began (this process's wall clock).
    pub fn since(&self) -> SystemTime {
        self.since
    }

    /// Time left on the term's own lease deadline (zero once lost).
    pub fn remaining(&self) -> Duration {
        self.guard.remaining()
    }

    /// Completes when the term is lost (its lease deadline passed, the store gave the lock to
    /// another, `max_hold`, a session's end); never for a term resigned first.
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        self.guard.lost()
    }

    /// A token cancelled when the term is lost.
    pub fn lost_token(&self) -> CancellationToken {
        self.guard.lost_token()
    }

    /// Writes `value` as the leader's value, fenced by this term's epoch: refused once a later
    /// term has written its own (the term is then lost: [`LockError::Lost`], and `lost()`
    /// fires), and by a term that knows itself lost. On a backend without leader records it is a
    /// [`LockError::Config`] error.
    pub async fn proclaim(&self, value: impl Into<String>) -> Result<(), LockError> {
        let value = value.into();
        self.guard.ensure_valid()?;
        let name = self.guard.key();
        let backend = self.guard.backend().clone();
        let call = backend.put_record(name, self.epoch(), &value);
        let written = match tokio::time::timeout(self.guard.remaining(), call).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(self.guard.ensure_valid().err().unwrap_or_else(|| {
                    LockError::backend(name, "no reply to the leader record write within the lease")
                }));
            }
        };
        if !written {
            self.guard.mark_lost(LostReason::NotOwner);
            return Err(LockError::Lost {
                key: name.to_string(),
                reason: LostReason::NotOwner,
            });
        }
        *self.value.lock().unwrap_or_else(|e| e.into_inner()) = value;
        Ok(())
    }

    /// Runs `fut` inside this term's lock context: [`crate::fencing_token`] returns the epoch
    /// there.
    pub async fn scope<F: Future>(&self, fut: F) -> F::Output {
        self.guard.scope(fut).await
    }

    /// Ends the term and waits for the store to confirm: the next candidate in line is woken at
    /// once. A term already lost returns [`LockError::Lost`].
    pub async fn resign(self) -> Result<(), LockError> {
        tracing::info!(election = %self.election, epoch = self.epoch(), "dlock: resigning");
        self.guard.release().await
    }

    /// Whether the backend keeps leader records (so [`Term::proclaim`] and
    /// [`Election::observe`] work on it).
    pub fn has_records(&self) -> bool {
        self.records
    }
}

/// The leader as an [`Observer`] saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leader {
    /// The value the leader proclaimed.
    pub value: String,
    /// Its term's epoch.
    pub epoch: u64,
    /// When this observer first read this leader (and value).
    pub since: SystemTime,
}

/// The stream of [`Election::observe`]: [`Observer::next`], or `futures::Stream`.
#[derive(Debug)]
pub struct Observer {
    rx: mpsc::Receiver<Result<Leader, LockError>>,
    stop: CancellationToken,
}

impl Observer {
    /// The next change of leader (or a backend error); `None` once reading stopped.
    pub async fn next(&mut self) -> Option<Result<Leader, LockError>> {
        self.rx.recv().await
    }
}

impl futures_util::Stream for Observer {
    type Item = Result<Leader, LockError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
