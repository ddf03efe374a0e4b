//! The task-local lock context: who the owner of this call chain is, and which locks it holds.
//!
//! A guarded scope ([`crate::LockGuard::scope`], or the body of a `#[distributed_lock]` function)
//! runs with a frame naming its owner id and its hold. A nested acquisition of the same name on
//! the same backend inside that scope re-enters (hold count + 1) instead of deadlocking. A
//! `tokio::spawn`ed task does not inherit task-locals, so it is a different owner.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::guard::Hold;

tokio::task_local! {
    static FRAME: Arc<Frame>;
}

#[derive(Debug)]
pub(crate) struct Frame {
    pub(crate) hold: Arc<Hold>,
    parent: Option<Arc<Frame>>,
}

impl Frame {
    pub(crate) fn new(hold: Arc<Hold>) -> Arc<Frame> {
        Arc::new(Frame {
            hold,
            parent: current(),
        })
    }

    /// The hold of `name` on the backend `backend_id` in this chain, innermost first.
    pub(crate) fn find(self: &Arc<Self>, backend_id: usize, name: &str) -> Option<Arc<Hold>> {
        let mut f = Some(self);
        while let Some(frame) = f {
            if frame.hold.backend_id() == backend_id && frame.hold.name == name {
                return Some(frame.hold.clone());
            }
            f = frame.parent.as_ref();
        }
        None
    }
}

/// The innermost frame of the current task, if it runs inside a guarded scope.
pub(crate) fn current() -> Option<Arc<Frame>> {
    FRAME.try_with(|f| f.clone()).ok()
}

/// Runs `fut` with `frame` as the current task's innermost frame.
pub(crate) async fn scope<F: std::future::Future>(frame: Arc<Frame>, fut: F) -> F::Output {
    FRAME.scope(frame, fut).await
}

/// The fencing token of the innermost lock held by the current call chain, or `None` outside a
/// guarded scope (a `#[distributed_lock]` body, or [`crate::LockGuard::scope`]).
///
/// Pass it with every write to a resource that can check it: the resource refuses a write whose
/// token is lower than the highest it has seen, which closes the gap a lease cannot close.
pub fn fencing_token() -> Option<u64> {
    FRAME.try_with(|f| f.hold.token).ok()
}

/// Wraps `fut` to run in the current call chain's lock context, for a task it spawns: a
/// `tokio::spawn`ed task does not inherit task-locals, so inside it [`fencing_token`] is `None`
/// and a nested acquisition is a new owner. `tokio::spawn(dlock::in_current_scope(async { .. }))`
/// carries the token and re-entry into the task. A carried hold stays checked: once the outer
/// guard is released or lost, a nested acquisition there fails instead of re-entering.
pub fn in_current_scope<F: std::future::Future>(
    fut: F,
) -> impl std::future::Future<Output = F::Output> {
    let frame = current();
    async move {
        match frame {
            Some(f) => FRAME.scope(f, fut).await,
            None => fut.await,
        }
    }
}

/// 128 random bits for this process (drawn again in a child after `fork()`).
fn random_process_id() -> u128 {
    let mut buf = [0u8; 16];
    if getrandom::fill(&mut buf).is_ok() {
        return u128::from_le_bytes(buf);
    }
    // No OS randomness: mix the time, the pid and std's randomly seeded hasher.
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(d.as_nanos());
    }
    let a = h.finish();
    h.write_u64(a);
    ((a as u128) << 64) | h.finish() as u128
}

static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// Bumped in the child of every `fork()` (a `pthread_atfork` handler, registered with the first
/// prefix): a child must not reuse its parent's owner prefix, or both would own each other's
/// locks.
static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);

#[cfg(unix)]
extern "C" fn forked_child() {
    // Async-signal-safe: one atomic add.
    FORK_GENERATION.fetch_add(1, Ordering::Relaxed);
}

/// The owner prefix and the fork generation it was made in.
static OWNER_PREFIX: std::sync::Mutex<Option<(u64, Arc<str>)>> = std::sync::Mutex::new(None);

thread_local! {
    static PREFIX_CACHE: std::cell::RefCell<Option<(u64, Arc<str>)>> =
        const { std::cell::RefCell::new(None) };
}

fn owner_prefix() -> Arc<str> {
    let generation = FORK_GENERATION.load(Ordering::Relaxed);
    if let Some(p) = PREFIX_CACHE.with(|c| {
        c.borrow()
            .as_ref()
            .filter(|(g, _)| *g == generation)
            .map(|(_, p)| p.clone())
    }) {
        return p;
    }
    let mut global = OWNER_PREFIX.lock().unwrap_or_else(|e| e.into_inner());
    let p = match global.as_ref().filter(|(g, _)| *g == generation) {
        Some((_, p)) => p.clone(),
        None => {
            #[cfg(unix)]
            if global.is_none() {
                static REGISTER: std::sync::Once = std::sync::Once::new();
                REGISTER.call_once(|| {
                    // SAFETY: registers a plain `extern "C"` handler that only does an atomic add.
                    unsafe {
                        libc::pthread_atfork(None, None, Some(forked_child));
                    }
                });
            }
            let p: Arc<str> = format!("{:032x}:", random_process_id()).into();
            *global = Some((generation, p.clone()));
            p
        }
    };
    drop(global);
    PREFIX_CACHE.with(|c| *c.borrow_mut() = Some((generation, p.clone())));
    p
}

/// A fresh owner id: 128 random bits for this process (new ones after a `fork()`), then a
/// counter.
pub(crate) fn new_owner() -> Arc<str> {
    use std::fmt::Write as _;
    let prefix = owner_prefix();
    let n = NEXT_OWNER.fetch_add(1, Ordering::Relaxed);
    let mut s = String::with_capacity(prefix.len() + 20);
    s.push_str(&prefix);
    let _ = write!(s, "{n}");
    s.into()
}

#[cfg(test)]
mod tests {
    #[test]
    fn owners_are_unique_and_carry_the_process_id() {
        let a = super::new_owner();
        let b = super::new_owner();
        assert_ne!(a, b);
        assert_eq!(a.split(':').next(), b.split(':').next());
        assert_eq!(a.split(':').next().unwrap().len(), 32);
    }
}
