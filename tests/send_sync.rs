//! Compile-time checks: the guard, the builder, the errors and the futures users hold across
//! `.await` or hand to `tokio::spawn` are `Send` (and `Sync` where shared). A regression fails
//! to compile.

use std::sync::Arc;
use std::time::Duration;

use dlock::{Backend, Lock, LockError, LockGuard, MemoryBackend, RedisBackend};

fn send_sync<T: Send + Sync>() {}
fn send_static<T: Send + 'static>(_: &T) {}
fn send<T: Send>(_: &T) {}

#[test]
fn public_types_are_send_and_sync() {
    send_sync::<LockGuard>();
    send_sync::<Lock>();
    send_sync::<LockError>();
    send_sync::<MemoryBackend>();
    send_sync::<RedisBackend>();
    send_sync::<Arc<dyn Backend>>();
    send_sync::<dlock::CancellationToken>();
}

#[test]
fn futures_are_send_and_spawnable() {
    let lock = Lock::new("x").ttl(Duration::from_secs(1));
    // The acquire future borrows the builder; it is Send.
    let fut = lock.acquire();
    send(&fut);
    drop(fut);
    // An owned acquire, as users spawn it, is Send + 'static.
    let owned = async move { lock.acquire().await };
    send_static(&owned);
    drop(owned);
    // Futures over a guard: release, extend, lost, scope.
    let with_guard = async {
        let g = Lock::new("y").acquire().await?;
        let lost = g.lost();
        send_static(&lost);
        g.extend(Duration::from_secs(1)).await?;
        g.scope(async { dlock::fencing_token() }).await;
        g.release().await
    };
    send(&with_guard);
    drop(with_guard);
    let init = dlock::init("redis://127.0.0.1:1");
    send_static(&init);
    drop(init);
}

#[test]
fn rwlock_types_and_futures_are_send() {
    send_sync::<dlock::RwLock>();
    send_sync::<dlock::ReadGuard>();
    send_sync::<dlock::WriteGuard>();
    let rw = dlock::RwLock::new("rw").ttl(Duration::from_secs(1));
    let owned = async move {
        let r = rw.read().await?;
        r.release().await?;
        let w = rw.write().await?;
        let r = w.downgrade().await?;
        r.release().await
    };
    send_static(&owned);
    drop(owned);
}
