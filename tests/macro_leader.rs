//! `#[dlock::leader]` at run time (the attribute has no per-engine code: it is `Election` on the
//! registered backend; the election suite, `tests/election.rs`, covers the engines): calls of
//! one election lead one at a time with increasing epochs, and a lost term drops the body and
//! returns `Lost`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use dlock::{LockError, LostReason, MemoryBackend};

static ACTIVE: AtomicUsize = AtomicUsize::new(0);
static MAX_ACTIVE: AtomicUsize = AtomicUsize::new(0);

#[dlock::leader(name = "job:{job}", ttl = "2s", backend = "macro-leader")]
async fn lead(job: &str) -> Result<u64, LockError> {
    let now = ACTIVE.fetch_add(1, Ordering::SeqCst) + 1;
    MAX_ACTIVE.fetch_max(now, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(30)).await;
    ACTIVE.fetch_sub(1, Ordering::SeqCst);
    Ok(dlock::fencing_token().expect("the term's epoch"))
}

static DROPPED: AtomicBool = AtomicBool::new(false);

#[dlock::leader(name = "forever", ttl = "600ms", backend = "macro-leader")]
async fn lead_forever() -> Result<(), LockError> {
    struct Marker;
    impl Drop for Marker {
        fn drop(&mut self) {
            DROPPED.store(true, Ordering::SeqCst);
        }
    }
    let _m = Marker;
    std::future::pending::<()>().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_calls_lead_one_at_a_time_and_a_lost_term_cancels_the_body() {
    let mem = Arc::new(MemoryBackend::new());
    dlock::register_arc("macro-leader", mem.clone());

    // Four concurrent calls: each campaigns, leads alone, resigns.
    let calls: Vec<_> = (0..4).map(|_| tokio::spawn(lead("nightly"))).collect();
    let mut epochs = Vec::new();
    for c in calls {
        epochs.push(c.await.unwrap().expect("led"));
    }
    assert_eq!(
        MAX_ACTIVE.load(Ordering::SeqCst),
        1,
        "two bodies led at once"
    );
    epochs.sort();
    epochs.dedup();
    assert_eq!(epochs.len(), 4, "four terms, four epochs");

    // The term is taken from under the body: the body is dropped and the call returns Lost.
    let call = tokio::spawn(lead_forever());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        mem.force_delete("election:forever"),
        "the term's lock was held"
    );
    let out = tokio::time::timeout(Duration::from_secs(3), call)
        .await
        .expect("the call returned once the term was lost")
        .unwrap();
    assert!(
        matches!(
            out,
            Err(LockError::Lost {
                reason: LostReason::NotOwner,
                ..
            })
        ),
        "{out:?}"
    );
    assert!(DROPPED.load(Ordering::SeqCst), "the body was dropped");
}
