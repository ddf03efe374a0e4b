//! Issue 2, item 10: tracing events for acquire, wait, renew, lost and release, with the key and
//! timings. Runs on a current_thread runtime so the watchdog's events reach the thread-local
//! subscriber.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::capture;
use dlock::{Backend, Lock, MemoryBackend};
use tracing::Level;

#[tokio::test(flavor = "current_thread")]
async fn acquire_wait_renew_lost_and_release_are_traced_with_key_and_timings() {
    let (events, _guard) = capture();
    let mem = Arc::new(MemoryBackend::new());
    let b: Arc<dyn Backend> = mem.clone();

    // acquire + renew + release
    let g = Lock::new("traced")
        .ttl(Duration::from_millis(300))
        .with_backend(b.clone())
        .acquire()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(250)).await; // one renewal at ttl/3
    // wait: a second caller waits for the release
    let waiter = {
        let l = Lock::new("traced")
            .ttl(Duration::from_millis(300))
            .wait(Duration::from_secs(5))
            .with_backend(b.clone());
        tokio::spawn(async move { l.acquire().await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    g.release().await.unwrap();
    let w = waiter.await.unwrap().unwrap();
    // lost: the lock is deleted behind the holder's back; the next renewal finds another owner
    let lost = w.lost();
    mem.force_delete("traced");
    tokio::time::timeout(Duration::from_secs(15), lost)
        .await
        .expect("lost() did not fire");

    let acquired = events.at_level_containing(Level::DEBUG, "dlock: acquired");
    assert!(
        acquired
            .iter()
            .any(|e| e.contains("key=traced") && e.contains("token=") && e.contains("waited_us=")),
        "{acquired:?}"
    );
    let waiting = events.at_level_containing(Level::DEBUG, "dlock: waiting for a release");
    assert!(
        waiting
            .iter()
            .any(|e| e.contains("key=traced") && e.contains("retry_after_ms=")),
        "{waiting:?}"
    );
    let renewed = events.at_level_containing(Level::TRACE, "dlock: renewed");
    assert!(
        renewed
            .iter()
            .any(|e| e.contains("key=traced") && e.contains("rtt_us=")),
        "{renewed:?}"
    );
    let released = events.at_level_containing(Level::DEBUG, "dlock: released");
    assert!(
        released
            .iter()
            .any(|e| e.contains("key=traced") && e.contains("held_ms=")),
        "{released:?}"
    );
    let lost = events.warns_containing("dlock: lease lost");
    assert!(
        lost.iter()
            .any(|e| e.contains("key=traced") && e.contains("reason=")),
        "{lost:?}"
    );
}
