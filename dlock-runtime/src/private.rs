//! Items only the `#[distributed_lock]` expansion calls. Not public API: no semver promise.
#![allow(missing_docs, unreachable_pub)]

use std::fmt::{Display, Write as _};
use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

pub use crate::policy::{OnBusy, OnLost};
use crate::{Lock, LockError, Policy};

/// The attribute's options, as a `static` per annotated function. `None` means "not written in
/// the attribute": the policy and the defaults decide.
#[derive(Debug)]
pub struct LockSpec {
    pub fn_name: &'static str,
    /// The `lock` label of the metrics; empty: the function's name.
    pub metric_name: &'static str,
    pub ttl: Option<Duration>,
    pub wait: Option<Duration>,
    pub backend: Option<&'static str>,
    pub watchdog: Option<bool>,
    pub on_busy: Option<OnBusy>,
    pub hold_at_least: Option<Duration>,
    pub on_lost: Option<OnLost>,
    /// `fair = true`: waiters in arrival order (`Lock::fair`).
    pub fair: Option<bool>,
    pub policy: Option<&'static str>,
    /// `semaphore = max, permits = n`: `(max, n)`; the call runs under `n` permits of the
    /// semaphore `key` instead of the lock.
    pub semaphore: Option<(u32, u32)>,
    /// `mode = "read"` / `"write"`: a side of an `RwLock` instead of a `Lock`.
    pub mode: Option<RwMode>,
    pub resolved: OnceLock<Resolved>,
}

/// The attribute's `mode`: which side of a read-write lock the body runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RwMode {
    Read,
    Write,
}

/// The settings in force for one annotated function, resolved at its first call.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub ttl: Duration,
    pub wait: Duration,
    pub backend: String,
    pub watchdog: bool,
    pub on_busy: OnBusy,
    pub hold_at_least: Option<Duration>,
    pub on_lost: OnLost,
    pub fair: bool,
}

impl LockSpec {
    /// A spec with nothing set (what [`LockSpec::new`] starts from). A fresh `OnceLock` per use
    /// is what a `const` gives, which is the point here.
    #[allow(clippy::declare_interior_mutable_const)]
    pub const EMPTY: LockSpec = LockSpec {
        fn_name: "",
        metric_name: "",
        ttl: None,
        wait: None,
        backend: None,
        watchdog: None,
        on_busy: None,
        hold_at_least: None,
        on_lost: None,
        fair: None,
        mode: None,
        policy: None,
        semaphore: None,
        resolved: OnceLock::new(),
    };

    /// The expansion's starting point: `LockSpec::new("fn").ttl(..).wait(..)`, evaluated at compile
    /// time. (Struct-update syntax on [`LockSpec::EMPTY`] cannot be used in a `static`: the
    /// unused rest of `EMPTY`, which holds a `OnceLock`, would be dropped at compile time.)
    pub const fn new(fn_name: &'static str) -> Self {
        let mut s = Self::EMPTY;
        s.fn_name = fn_name;
        s
    }

    pub const fn metric_name(mut self, name: &'static str) -> Self {
        self.metric_name = name;
        self
    }

    /// The `lock` label of the metrics: `metric_name`, else the function's name.
    pub fn metric_label(&self) -> &'static str {
        if self.metric_name.is_empty() {
            self.fn_name
        } else {
            self.metric_name
        }
    }

    pub const fn ttl(mut self, d: Duration) -> Self {
        self.ttl = Some(d);
        self
    }

    pub const fn wait(mut self, d: Duration) -> Self {
        self.wait = Some(d);
        self
    }

    pub const fn backend(mut self, name: &'static str) -> Self {
        self.backend = Some(name);
        self
    }

    pub const fn watchdog(mut self, on: bool) -> Self {
        self.watchdog = Some(on);
        self
    }

    pub const fn on_busy(mut self, v: OnBusy) -> Self {
        self.on_busy = Some(v);
        self
    }

    pub const fn hold_at_least(mut self, d: Duration) -> Self {
        self.hold_at_least = Some(d);
        self
    }

    pub const fn on_lost(mut self, v: OnLost) -> Self {
        self.on_lost = Some(v);
        self
    }

    pub const fn policy(mut self, name: &'static str) -> Self {
        self.policy = Some(name);
        self
    }

    pub const fn semaphore(mut self, max: u32, permits: u32) -> Self {
        self.semaphore = Some((max, permits));
        self
    }

    pub const fn fair(mut self, on: bool) -> Self {
        self.fair = Some(on);
        self
    }

    pub const fn mode(mut self, m: RwMode) -> Self {
        self.mode = Some(m);
        self
    }

    fn attribute_layer(&self) -> Policy {
        let mut p = Policy::new();
        p.ttl = self.ttl;
        p.wait = self.wait;
        p.backend = self.backend.map(str::to_string);
        p.watchdog = self.watchdog;
        p.on_busy = self.on_busy;
        p.hold_at_least = self.hold_at_least;
        p.on_lost = self.on_lost;
        p.fair = self.fair;
        p
    }

    /// The settings in force: attribute > policy (all its layers) > defaults. Cached after the
    /// first success.
    pub fn resolve(&self) -> Result<&Resolved, LockError> {
        if let Some(r) = self.resolved.get() {
            return Ok(r);
        }
        let mut p = self.attribute_layer();
        if let Some(name) = self.policy {
            p = p.or(&crate::policy::policy(name)?);
        }
        let r = Resolved {
            ttl: p.ttl.unwrap_or(crate::DEFAULT_TTL),
            wait: p.wait.unwrap_or(Duration::ZERO),
            backend: p
                .backend
                .unwrap_or_else(|| crate::DEFAULT_BACKEND.to_string()),
            watchdog: p.watchdog.unwrap_or(true),
            on_busy: p.on_busy.unwrap_or(OnBusy::Error),
            hold_at_least: p.hold_at_least,
            on_lost: p.on_lost.unwrap_or(OnLost::Cancel),
            fair: p.fair.unwrap_or(false),
        };
        if r.ttl.is_zero() {
            return Err(LockError::Config(format!(
                "`{}`: the resolved ttl is zero",
                self.fn_name
            )));
        }
        Ok(self.resolved.get_or_init(|| r))
    }
}

/// Acquires the lock `key` as `spec` says, runs `body` inside the lock context, and awaits the
/// release before returning. Busy, timed-out, lost (with `on_lost = cancel`) and backend errors
/// come back as `Err`; a failed release after the body ran is logged, not returned, since the
/// body's effects already happened.
pub async fn run_locked<F: Future>(
    spec: &'static LockSpec,
    key: String,
    body: F,
) -> Result<F::Output, LockError> {
    // A configuration failure (unknown policy, bad environment value) is counted as the
    // unknown-backend and invalid-name failures are: a `skip` job that never runs shows up.
    let r = spec.resolve().map_err(|e| {
        let backend = spec.backend.unwrap_or(crate::DEFAULT_BACKEND);
        crate::metrics::setup_error(
            &crate::metrics::Labels::new(backend, spec.metric_label()),
            e,
        )
    })?;
    let guard = match (spec.semaphore, spec.mode) {
        (None, None) => {
            let mut lock = Lock::new(key)
                .ttl(r.ttl)
                .wait(r.wait)
                .watchdog(r.watchdog)
                .fair(r.fair)
                .backend(r.backend.clone())
                .metric_name(spec.metric_label());
            if let Some(h) = r.hold_at_least {
                lock = lock.hold_at_least(h);
            }
            lock.acquire().await?
        }
        (Some(_), _) | (None, Some(_)) if r.fair => {
            // Only a policy can bring it here: the attribute refuses it at compile time.
            return Err(LockError::Config(format!(
                "`{}`: `fair` is for locks, not a semaphore or a read-write lock, but its policy sets it",
                spec.fn_name
            )));
        }
        (Some((max, permits)), _) => {
            if r.hold_at_least.is_some() {
                // Only a policy can bring it here: the attribute refuses it at compile time.
                return Err(LockError::Config(format!(
                    "`{}`: hold_at_least is not supported with a semaphore",
                    spec.fn_name
                )));
            }
            crate::Semaphore::new(key, max)
                .permits(permits)
                .ttl(r.ttl)
                .wait(r.wait)
                .watchdog(r.watchdog)
                .backend(r.backend.clone())
                .metric_name(spec.metric_label())
                .acquire()
                .await?
                .into_lock_guard()
        }
        (None, Some(mode)) => {
            if r.hold_at_least.is_some() {
                // The attribute refuses it at compile time; a policy may still set it.
                return Err(LockError::Config(format!(
                    "`{}`: a read-write lock (`mode`) has no `hold_at_least`, but its policy sets one",
                    spec.fn_name
                )));
            }
            let rw = crate::RwLock::new(key)
                .ttl(r.ttl)
                .wait(r.wait)
                .watchdog(r.watchdog)
                .backend(r.backend.clone())
                .metric_name(spec.metric_label());
            match mode {
                RwMode::Read => rw.read().await?.into_inner(),
                RwMode::Write => rw.write().await?.into_inner(),
            }
        }
    };
    let out = match r.on_lost {
        OnLost::Continue => Ok(guard.scope(body).await),
        _ => {
            let lost = guard.lost_token();
            tokio::select! {
                biased;
                out = guard.scope(body) => Ok(out),
                _ = lost.cancelled() => Err(LockError::Lost {
                    key: guard.key().to_string(),
                    reason: guard.lost_reason().unwrap_or(crate::LostReason::Deadline),
                }),
            }
        }
    };
    // Every release error names its lock, so the key need not be copied on the hot path.
    if let Err(e) = guard.release().await
        && out.is_ok()
    {
        tracing::warn!(function = spec.fn_name, key = e.key().unwrap_or_default(), error = %e, "dlock: release after the body failed");
    }
    out
}

/// For `on_busy = "skip"`: the value returned instead of running the body (`()` or `None`).
/// A busy or timed-out lock is a `debug` event; any other error is an `error` event, since the
/// return type has no room for it.
pub fn skipped<T: Default>(spec: &'static LockSpec, err: LockError) -> T {
    if err.is_contended() {
        tracing::debug!(function = spec.fn_name, error = %err, "dlock: lock busy; skipped");
    } else {
        tracing::error!(function = spec.fn_name, error = %err, "dlock: lock not taken; skipped");
    }
    T::default()
}

/// For a function whose attribute names a `policy` but no `on_busy`: what a failed acquisition
/// returns, decided by the return type. `Result<T, E>` gives the error back (whatever the
/// policy's `on_busy`, since a `Result` can carry it); `()` and `Option<T>` skip, logging as
/// [`skipped`] does, and log an `error` event when the policy asked for `on_busy = "error"`,
/// since those return types have no room for the error.
#[diagnostic::on_unimplemented(
    message = "with a `policy` and no `on_busy`, the return type decides what a failed acquisition returns, so it must be `Result<_, E>` with `E: From<dlock::LockError>`, `()` or `Option<T>`, not `{Self}`",
    label = "not a `Result<_, E>`, `()` or `Option<T>`"
)]
pub trait BusyReturn: Sized {
    fn busy_return(spec: &'static LockSpec, err: LockError) -> Self;
}

impl BusyReturn for () {
    fn busy_return(spec: &'static LockSpec, err: LockError) -> Self {
        skip_by_policy(spec, err)
    }
}

impl<T> BusyReturn for Option<T> {
    fn busy_return(spec: &'static LockSpec, err: LockError) -> Self {
        skip_by_policy::<()>(spec, err);
        None
    }
}

impl<T, E: From<LockError>> BusyReturn for Result<T, E> {
    fn busy_return(_spec: &'static LockSpec, err: LockError) -> Self {
        Err(E::from(err))
    }
}

fn skip_by_policy<T: Default>(spec: &'static LockSpec, err: LockError) -> T {
    let wants_error = spec
        .resolved
        .get()
        .is_some_and(|r| r.on_busy == OnBusy::Error);
    if wants_error && err.is_contended() {
        tracing::error!(
            function = spec.fn_name,
            error = %err,
            "dlock: lock busy; skipped, although the policy says on_busy = \"error\" (the function's return type cannot carry the error)"
        );
        return T::default();
    }
    skipped(spec, err)
}

/// For `on_busy = "error"`: the function's return type, which carries a failed acquisition's
/// error. Only `Result<T, E>` with `E: From<LockError>` does, an alias of one included; any other
/// type is refused at the function's return type with the message below (the attribute itself
/// refuses `()` and `Option<T>`, which it can tell apart without the type checker).
#[diagnostic::on_unimplemented(
    message = "on_busy = \"error\" gives the busy `dlock::LockError` back through the return type, so the function must return `Result<_, E>` with `E: From<dlock::LockError>`, not `{Self}`",
    label = "not a `Result<_, E>` with `E: From<dlock::LockError>`",
    note = "for a function returning `()` or `Option<T>`, write on_busy = \"skip\""
)]
pub trait BusyError: Sized {
    fn busy_error(err: LockError) -> Self;
}

impl<T, E: From<LockError>> BusyError for Result<T, E> {
    fn busy_error(err: LockError) -> Self {
        Err(E::from(err))
    }
}

/// For `on_busy = "error"`: the error, converted into the function's error type.
pub fn busy_error<R: BusyError>(err: LockError) -> R {
    R::busy_error(err)
}

/// See [`BusyReturn`].
pub fn busy_return<R: BusyReturn>(spec: &'static LockSpec, err: LockError) -> R {
    R::busy_return(spec, err)
}

/// Builds a lock name from a key template. Literal parts are copied; interpolated values are
/// formatted with `Display` and escaped: `\`, `:` and every character of `special` (the first
/// characters of the literals that follow placeholders) get a `\` before them, so values cannot
/// forge another key, of this template or of another: a value never adds an unescaped `:`, so
/// templates whose `:`-separated literal segments differ never render the same key. A value with
/// none of those characters renders unchanged.
#[derive(Debug, Default)]
pub struct KeyBuf(String);

impl KeyBuf {
    pub fn with_capacity(n: usize) -> Self {
        KeyBuf(String::with_capacity(n))
    }

    pub fn lit(&mut self, s: &str) {
        self.0.push_str(s);
    }

    pub fn value<T: Display + ?Sized>(&mut self, v: &T, special: &str) {
        let start = self.0.len();
        let _ = write!(self.0, "{v}");
        let escaped = |c: char| c == '\\' || c == ':' || special.contains(c);
        let needs = self.0[start..].chars().any(escaped);
        if needs {
            let raw = self.0.split_off(start);
            for c in raw.chars() {
                if escaped(c) {
                    self.0.push('\\');
                }
                self.0.push(c);
            }
        }
    }

    pub fn finish(self) -> String {
        self.0
    }
}

/// The characters a value escapes (besides `\\`) when `next_literal` follows its placeholder
/// (empty at the end of a template): `:`, the separator every value escapes, and the first
/// character of that literal. The macro computes
/// the same set at compile time (`template::special_after`); `path_key` and `header_key` use
/// this function.
pub fn key_special(next_literal: &str) -> String {
    dlock_template::special(next_literal)
}

/// Compile-time check helpers: the expansion calls these with `quote_spanned!` at the user's
/// types so that a missing bound is reported there.
pub fn assert_display<T: Display + ?Sized>(_: &T) {}

#[cfg(test)]
mod tests {
    use super::KeyBuf;

    fn render(a: &str, b: &str) -> String {
        let mut k = KeyBuf::default();
        k.lit("a:");
        k.value(&a, ":");
        k.lit(":");
        k.value(&b, "");
        k.finish()
    }

    #[test]
    fn values_cannot_forge_another_key() {
        assert_ne!(render("1:2", "3"), render("1", "2:3"));
        assert_eq!(render("1", "2"), "a:1:2");
        assert_ne!(render("1\\", ":2"), render("1\\:", "2"));
    }
}

/// The static settings of one `#[leader]` function.
#[derive(Debug)]
pub struct LeaderSpec {
    /// The function's name (the metrics' `lock` label).
    pub fn_name: &'static str,
    ttl: Option<Duration>,
    wait: Option<Duration>,
    backend: Option<&'static str>,
    value: &'static str,
}

impl LeaderSpec {
    /// Defaults: the election's.
    pub const fn new(fn_name: &'static str) -> Self {
        LeaderSpec {
            fn_name,
            ttl: None,
            wait: None,
            backend: None,
            value: "",
        }
    }
    /// `ttl = ".."`.
    pub const fn ttl(mut self, d: Duration) -> Self {
        self.ttl = Some(d);
        self
    }
    /// `wait = ".."`.
    pub const fn wait(mut self, d: Duration) -> Self {
        self.wait = Some(d);
        self
    }
    /// `backend = ".."`.
    pub const fn backend(mut self, name: &'static str) -> Self {
        self.backend = Some(name);
        self
    }
    /// `value = ".."`.
    pub const fn value(mut self, v: &'static str) -> Self {
        self.value = v;
        self
    }
}

/// What a `#[leader]` function runs: campaigns for `name`, runs `body` in the term's scope
/// while it lives (dropped once the term is lost: `Err(Lost)`), then resigns.
pub async fn run_leader<F: Future>(
    spec: &'static LeaderSpec,
    name: String,
    body: F,
) -> Result<F::Output, LockError> {
    let mut e = crate::Election::new(name)
        .value(spec.value)
        .metric_name(spec.fn_name);
    if let Some(t) = spec.ttl {
        e = e.ttl(t);
    }
    if let Some(w) = spec.wait {
        e = e.wait(w);
    }
    if let Some(b) = spec.backend {
        e = e.backend(b);
    }
    let term = e.campaign().await?;
    let lost = term.lost();
    let out = tokio::select! {
        biased;
        reason = lost => Err(LockError::Lost { key: e.lock_name().to_string(), reason }),
        out = term.scope(body) => Ok(out),
    };
    if out.is_ok()
        && let Err(err) = term.resign().await
    {
        tracing::warn!(function = spec.fn_name, error = %err, "dlock: resign after the leader's body failed");
    }
    out
}
