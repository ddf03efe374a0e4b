//! What [`crate::Semaphore`] and [`crate::RwLock`] share: the options every hold of theirs
//! passes to the [`Lock`] that carries it (one builder, [`primitive_options!`]), the lookup of
//! their backend, and the process-wide cache of their adapters ([`shared_adapter`]).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::backend::Backend;
use crate::{Lock, LockError, registry};

/// Where a primitive's backend comes from.
#[derive(Clone)]
pub(crate) enum BackendRef {
    Named(Cow<'static, str>),
    Direct(Arc<dyn Backend>),
}

/// The lock options of a primitive's holds.
#[derive(Clone)]
pub(crate) struct Options {
    pub(crate) ttl: Duration,
    pub(crate) wait: Duration,
    pub(crate) watchdog: bool,
    pub(crate) max_hold: Option<Duration>,
    pub(crate) backend: BackendRef,
    pub(crate) metric_name: Cow<'static, str>,
}

impl Default for Options {
    /// A 30 s ttl, no waiting, the watchdog on, no `max_hold`, the backend `"default"`.
    fn default() -> Self {
        Options {
            ttl: crate::DEFAULT_TTL,
            wait: Duration::ZERO,
            watchdog: true,
            max_hold: None,
            backend: BackendRef::Named(Cow::Borrowed(registry::DEFAULT_BACKEND)),
            metric_name: Cow::Borrowed(crate::metrics::DEFAULT_METRIC_NAME),
        }
    }
}

impl fmt::Debug for Options {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let backend: &dyn fmt::Debug = match &self.backend {
            BackendRef::Named(n) => n,
            BackendRef::Direct(b) => b,
        };
        f.debug_struct("Options")
            .field("ttl", &self.ttl)
            .field("wait", &self.wait)
            .field("watchdog", &self.watchdog)
            .field("max_hold", &self.max_hold)
            .field("backend", backend)
            .finish()
    }
}

impl Options {
    /// The engine: the registered backend of that name, or the one given directly.
    pub(crate) fn resolve(&self) -> Result<Arc<dyn Backend>, LockError> {
        match &self.backend {
            BackendRef::Named(n) => registry::backend(n),
            BackendRef::Direct(b) => Ok(b.clone()),
        }
    }

    /// The lock that carries a hold of `name` through `adapter` (the primitive's view of the
    /// engine), with these options.
    pub(crate) fn lock(&self, name: &str, adapter: Arc<dyn Backend>) -> Lock {
        let mut l = Lock::new(name.to_string())
            .ttl(self.ttl)
            .wait(self.wait)
            .watchdog(self.watchdog)
            .metric_name(self.metric_name.clone())
            .with_backend(adapter);
        if let Some(m) = self.max_hold {
            l = l.max_hold(m);
        }
        l
    }

    /// The metric labels of a hold made outside [`Options::lock`] (a downgrade's read hold).
    pub(crate) fn metric_labels(&self) -> crate::metrics::Labels {
        let backend = match &self.backend {
            BackendRef::Named(n) => n.as_ref(),
            BackendRef::Direct(_) => "direct",
        };
        crate::metrics::Labels::new(backend, &self.metric_name)
    }
}

/// The builder methods every primitive with an `opts: Options` field has, documented once.
macro_rules! primitive_options {
    ($what:literal) => {
        #[doc = concat!("The lease of each ", $what, " (default 30 s), renewed every ttl/3 by the watchdog.")]
        pub fn ttl(mut self, ttl: ::std::time::Duration) -> Self {
            self.opts.ttl = ttl;
            self
        }

        /// How long an acquisition waits (default zero: one try, then
        /// [`LockError::Busy`](crate::LockError::Busy)).
        pub fn wait(mut self, wait: ::std::time::Duration) -> Self {
            self.opts.wait = wait;
            self
        }

        #[doc = concat!("Whether the watchdog renews the lease of each ", $what, " while its guard lives (default true).")]
        pub fn watchdog(mut self, on: bool) -> Self {
            self.opts.watchdog = on;
            self
        }

        /// Caps how long the watchdog keeps renewing (see [`Lock::max_hold`](crate::Lock::max_hold)).
        pub fn max_hold(mut self, max: ::std::time::Duration) -> Self {
            self.opts.max_hold = Some(max);
            self
        }

        /// The registered backend to use (default `"default"`).
        pub fn backend(mut self, name: impl Into<::std::borrow::Cow<'static, str>>) -> Self {
            self.opts.backend = crate::primitive::BackendRef::Named(name.into());
            self
        }

        /// A backend to use directly, without the registry.
        pub fn with_backend(mut self, backend: ::std::sync::Arc<dyn crate::Backend>) -> Self {
            self.opts.backend = crate::primitive::BackendRef::Direct(backend);
            self
        }

        /// The `lock` label of the metrics (feature `metrics`; see
        /// [`Lock::metric_name`](crate::Lock::metric_name)).
        pub fn metric_name(mut self, name: impl Into<::std::borrow::Cow<'static, str>>) -> Self {
            self.opts.metric_name = name.into();
            self
        }
    };
}
pub(crate) use primitive_options;

/// A process-wide cache of adapters: `cache[key]` while anything still holds it (a guard, a
/// give-back, a waiting acquisition), else a new one from `make`, so that the runtime's
/// per-backend bookkeeping (re-entry in a call chain, the wait for this process's own
/// give-backs) finds the same adapter again. `key` starts with the engine's
/// [`backend_id`](crate::guard::backend_id); an adapter keeps its engine alive, so an id whose
/// adapter is gone may be reused by a new engine: such entries are dropped before a new one is
/// made.
pub(crate) fn shared_adapter<K, A>(
    cache: &Mutex<Option<HashMap<K, Weak<A>>>>,
    key: K,
    make: impl FnOnce() -> Arc<A>,
) -> Arc<A>
where
    K: Hash + Eq,
    A: ?Sized,
{
    let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
    let map = map.get_or_insert_with(HashMap::new);
    if let Some(a) = map.get(&key).and_then(Weak::upgrade) {
        return a;
    }
    map.retain(|_, w| w.strong_count() > 0);
    let a = make();
    map.insert(key, Arc::downgrade(&a));
    a
}
