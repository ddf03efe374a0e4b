//! A backend written outside the crate, from the public API alone (`Backend`, `WaitQueues`,
//! `Watch`), registered by name and driven by `Lock` and the macro like the built-in ones.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock::backend::{Acquired, BoxFuture, Extended, Released, WaitQueues, Watch};
use dlock::{Backend, LockError, distributed_lock};

/// A deliberately small store: one map, owner-checked, re-entrant, with tokens and wake-ups.
#[derive(Debug)]
struct ToyStore {
    locks: Mutex<HashMap<String, (String, u32, u64, Instant)>>,
    tokens: AtomicU64,
    waiters: Arc<WaitQueues>,
}

impl ToyStore {
    fn new() -> Self {
        ToyStore {
            locks: Mutex::new(HashMap::new()),
            tokens: AtomicU64::new(0),
            waiters: WaitQueues::new(),
        }
    }
}

impl Backend for ToyStore {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        let now = Instant::now();
        let mut map = self.locks.lock().unwrap();
        let r = match map.get_mut(name) {
            Some((o, count, token, until)) if *until > now => {
                if o == owner {
                    *count += 1;
                    Acquired::Granted {
                        token: *token,
                        count: *count,
                    }
                } else {
                    Acquired::Busy {
                        remaining: Some(*until - now),
                    }
                }
            }
            _ => {
                let token = self.tokens.fetch_add(1, Ordering::SeqCst) + 1;
                map.insert(name.to_string(), (owner.to_string(), 1, token, now + ttl));
                Acquired::Granted { token, count: 1 }
            }
        };
        Box::pin(async move { Ok(r) })
    }

    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        _keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        let mut map = self.locks.lock().unwrap();
        let r = match map.get_mut(name) {
            Some((o, count, _, until)) if o == owner && *until > Instant::now() => {
                *count = if all { 0 } else { *count - 1 };
                if *count == 0 {
                    map.remove(name);
                    self.waiters.wake_one(name);
                    Released::Freed
                } else {
                    Released::Decremented(*count)
                }
            }
            _ => Released::NotOwner,
        };
        Box::pin(async move { Ok(r) })
    }

    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        let now = Instant::now();
        let r = match self.locks.lock().unwrap().get_mut(name) {
            Some((o, _, _, until)) if o == owner && *until > now => {
                *until = now + ttl;
                Extended::Extended
            }
            _ => Extended::Lost,
        };
        Box::pin(async move { Ok(r) })
    }

    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        let w = self.waiters.register(name);
        Box::pin(async move { Ok(w) })
    }

    fn has_waiters(&self, name: &str) -> bool {
        self.waiters.has_waiters(name)
    }
}

static COUNTER: AtomicU64 = AtomicU64::new(0);
static INSIDE: AtomicUsize = AtomicUsize::new(0);
static OVERLAPS: AtomicUsize = AtomicUsize::new(0);

#[distributed_lock(key = "toy:{id}", backend = "toy", wait = "10s")]
async fn bump(id: u32) -> Result<u64, LockError> {
    if INSIDE.fetch_add(1, Ordering::SeqCst) != 0 {
        OVERLAPS.fetch_add(1, Ordering::SeqCst);
    }
    let read = COUNTER.load(Ordering::SeqCst);
    tokio::task::yield_now().await;
    COUNTER.store(read + 1, Ordering::SeqCst);
    INSIDE.fetch_sub(1, Ordering::SeqCst);
    Ok(dlock::fencing_token().unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_written_backend_serves_the_macro_with_exclusion_and_waiting() {
    dlock::register("toy", ToyStore::new());
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            tokio::spawn(async {
                let mut tokens = Vec::new();
                for _ in 0..50 {
                    tokens.push(bump(7).await.unwrap());
                }
                tokens
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    assert_eq!(COUNTER.load(Ordering::SeqCst), 800, "lost updates");
    assert_eq!(
        OVERLAPS.load(Ordering::SeqCst),
        0,
        "two bodies inside at once"
    );
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 800, "a fencing token was handed out twice");
    let b = dlock::backend("toy").unwrap();
    let g = dlock::Lock::new("toy:7")
        .backend("toy")
        .acquire()
        .await
        .unwrap();
    assert!(!b.has_waiters("toy:7"));
    g.release().await.unwrap();
}

/// Delays the reply of the first `late` tries by `delay` after the real try ran, as a process
/// paused while the reply is in flight would see it.
#[derive(Debug)]
struct LateReplies {
    inner: dlock::MemoryBackend,
    late: AtomicUsize,
    delay: Duration,
    tries: AtomicUsize,
}

impl Backend for LateReplies {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(async move {
            self.tries.fetch_add(1, Ordering::SeqCst);
            let r = self.inner.try_acquire(name, owner, ttl).await;
            let late = self
                .late
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if late {
                tokio::time::sleep(self.delay).await;
            }
            r
        })
    }
    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        self.inner.release(name, owner, keep_for, all)
    }
    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        self.inner.extend(name, owner, ttl)
    }
    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        self.inner.watch(name)
    }
    fn has_waiters(&self, name: &str) -> bool {
        self.inner.has_waiters(name)
    }
}

/// A grant whose reply arrives after its own lease ran out is not handed out as a guard that is
/// born lost (in the torture run such a grant showed up as a token-order inversion): with
/// `wait = 0` the call fails (no usable answer within the lease: a backend error, not contention)
/// and the grant is given back; with a wait it tries again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_arrives_after_its_lease_is_given_back() {
    let ttl = Duration::from_millis(200);
    let b: Arc<dyn Backend> = Arc::new(LateReplies {
        inner: dlock::MemoryBackend::new(),
        late: AtomicUsize::new(1),
        delay: Duration::from_millis(300),
        tries: AtomicUsize::new(0),
    });
    let lock = dlock::Lock::new("late").ttl(ttl).with_backend(b.clone());
    let e = lock.acquire().await.unwrap_err();
    assert!(matches!(e, LockError::Backend { .. }), "{e:?}");

    // With a wait, the late grant is dropped and a fresh try succeeds with a valid guard.
    let late2 = Arc::new(LateReplies {
        inner: dlock::MemoryBackend::new(),
        late: AtomicUsize::new(1),
        delay: Duration::from_millis(300),
        tries: AtomicUsize::new(0),
    });
    let g = dlock::Lock::new("late")
        .ttl(ttl)
        .wait(Duration::from_secs(2))
        .with_backend(late2.clone())
        .acquire()
        .await
        .unwrap();
    assert!(g.is_valid(), "a guard was handed out already lost");
    // Only the late grant is given back: the next try's lease counts from its own send time.
    assert_eq!(
        late2.tries.load(Ordering::SeqCst),
        2,
        "a fresh grant was judged late too"
    );
    g.release().await.unwrap();

    // The first backend's late grant was given back (not left to expire with a stale owner):
    // another owner gets the name although it was granted to the first call 300 ms ago with a
    // 200 ms ttl, and a long-ttl holder can now keep it.
    let g = dlock::Lock::new("late")
        .ttl(Duration::from_secs(30))
        .with_backend(b)
        .acquire()
        .await
        .unwrap();
    assert!(g.is_valid());
    g.release().await.unwrap();
}
