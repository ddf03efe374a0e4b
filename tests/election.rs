//! The election suite (issue 22), written once and run on every engine by `both_backends!`
//! (`on_redis::x`, `on_memory::x`, `on_postgres::x`, ...): one leader at a time with
//! epoch-fenced writes, a leader that stops renewing cancelled at its deadline and replaced
//! within its ttl but not before that deadline, `resign` handing over at once, a stale leader's `proclaim` refused,
//! observers seeing every change of leader in order, and `run`'s `.once()`.
//!
//! Candidates are separate clients of the store (`Env::another_backend`: own connections or
//! sessions, as separate processes would have; in memory the one backend).

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Env;
use common::counting::CountTries;
use dlock::{Election, LockError, LostReason};

both_backends!(
    one_leader_at_a_time_and_epoch_fenced_writes_never_interleave,
    a_leader_that_stops_renewing_is_cancelled_then_replaced_within_its_ttl,
    resign_hands_over_at_once,
    a_stale_leaders_proclaim_is_refused_and_loses_its_term,
    observers_see_every_change_of_leader_in_order,
    once_returns_after_a_lost_term_and_without_it_run_campaigns_again,
    a_record_above_every_new_epoch_ends_the_campaign_with_an_error_not_a_loop,
);

/// A resource that refuses a write with an epoch below the highest it has seen, and logs the
/// writes it accepted.
#[derive(Default)]
struct FencedStore {
    state: Mutex<Fenced>,
}

/// The highest epoch seen, the accepted writes (epoch, sequence number), the refused count.
#[derive(Default)]
struct Fenced(u64, Vec<(u64, u32)>, usize);

impl FencedStore {
    /// `Ok` when accepted; `Err` with the highest epoch seen when refused.
    fn write(&self, epoch: u64, seq: u32) -> Result<(), u64> {
        let mut s = self.state.lock().unwrap();
        if epoch < s.0 {
            s.2 += 1;
            return Err(s.0);
        }
        s.0 = epoch;
        s.1.push((epoch, seq));
        Ok(())
    }
}

/// Three candidates, each on its own client, each leading once for ten writes to a fenced store
/// (with pauses between them, so a second leader would interleave): at most one body runs at a
/// time, every write is accepted, each term's writes are contiguous and in order, and the
/// epochs strictly increase from term to term.
async fn one_leader_at_a_time_and_epoch_fenced_writes_never_interleave(env: Env) {
    let name = "fenced-writes";
    let store = Arc::new(FencedStore::default());
    let active = Arc::new(AtomicUsize::new(0));
    let max_active = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for c in 0..3u32 {
        let backend = env.another_backend().await;
        let (store, active, max_active) = (store.clone(), active.clone(), max_active.clone());
        tasks.push(tokio::spawn(async move {
            let election = Election::new(name)
                .ttl(Duration::from_secs(5))
                .value(format!("candidate-{c}"))
                .with_backend(backend)
                .once();
            election
                .run(|term| {
                    let (store, active, max_active) =
                        (store.clone(), active.clone(), max_active.clone());
                    async move {
                        let now = active.fetch_add(1, Ordering::SeqCst) + 1;
                        max_active.fetch_max(now, Ordering::SeqCst);
                        for seq in 0..10 {
                            store
                                .write(term.epoch(), seq)
                                .expect("a current leader's write");
                            tokio::time::sleep(Duration::from_millis(3)).await;
                        }
                        active.fetch_sub(1, Ordering::SeqCst);
                        let epoch = term.epoch();
                        term.resign().await.expect("resign");
                        epoch
                    }
                })
                .await
                .expect("one term")
        }));
    }
    let mut epochs = Vec::new();
    for t in tasks {
        epochs.push(
            tokio::time::timeout(Duration::from_secs(30), t)
                .await
                .expect("every candidate led within 30 s")
                .unwrap(),
        );
    }
    assert_eq!(
        max_active.load(Ordering::SeqCst),
        1,
        "two bodies ran at once"
    );
    let s = store.state.lock().unwrap();
    assert_eq!(s.2, 0, "writes refused: {}", s.2);
    assert_eq!(s.1.len(), 30);
    // Contiguous per epoch, in order, epochs strictly increasing.
    for (i, chunk) in s.1.chunks(10).enumerate() {
        let e = chunk[0].0;
        assert!(
            chunk.iter().enumerate().all(|(k, w)| *w == (e, k as u32)),
            "term {i}'s writes interleaved: {chunk:?}"
        );
        if i > 0 {
            assert!(e > s.1[i * 10 - 1].0, "epochs not increasing: {:?}", s.1);
        }
    }
    epochs.sort();
    epochs.dedup();
    assert_eq!(epochs.len(), 3, "three distinct terms");
}

/// A leads with a 1 s ttl, then stops renewing (its renewals go unanswered: a paused or
/// partitioned leader whose store stays up). A's `run` future is dropped once its own deadline
/// passes (not before: no false loss; and within a bound that only catches a hang), and B,
/// waiting, wins within the bound with a larger epoch, never before A's deadline (its lease
/// ends on the store no earlier). A's `run` (`.once()`) returns `Lost`.
///
/// Both are judged against A's deadline, not against each other: A's body is dropped when its
/// task next runs after the deadline's timer fires, and B's win is seen when B's task runs after
/// the store's grant. On the memory engine the lease ends microseconds after A's deadline, so
/// which of the two tasks a loaded scheduler runs first says nothing about the library (the
/// old `B won after A's body was dropped` failed that way); across processes no lock can order
/// them, which is what the epoch is for.
async fn a_leader_that_stops_renewing_is_cancelled_then_replaced_within_its_ttl(env: Env) {
    let name = "stalled-leader";
    let ttl = Duration::from_secs(1);
    let a_backend = CountTries::new(env.another_backend().await);
    let a = Election::new(name)
        .ttl(ttl)
        .with_backend(a_backend.clone())
        .once();
    let (a_epoch_tx, a_epoch_rx) = tokio::sync::oneshot::channel();
    let cancelled_at = Arc::new(Mutex::new(None::<Instant>));
    // A's deadline as its body sees it: `now + remaining()`, `now` read first, so a sample is
    // never later than the true deadline; the latest sample is A's last known deadline.
    let a_deadline = Arc::new(Mutex::new(None::<Instant>));
    struct OnDrop(Arc<Mutex<Option<Instant>>>);
    impl Drop for OnDrop {
        fn drop(&mut self) {
            *self.0.lock().unwrap() = Some(Instant::now());
        }
    }
    let c = cancelled_at.clone();
    let d = a_deadline.clone();
    let a_run = tokio::spawn(async move {
        let mut tx = Some(a_epoch_tx);
        a.run(move |term| {
            let marker = OnDrop(c.clone());
            let d = d.clone();
            let _ = tx.take().map(|tx| tx.send(term.epoch()));
            async move {
                let _marker = marker;
                loop {
                    let now = Instant::now();
                    let rem = term.remaining();
                    if !rem.is_zero() {
                        let mut d = d.lock().unwrap();
                        *d = (*d).max(Some(now + rem));
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        })
        .await
    });
    let a_epoch = a_epoch_rx.await.expect("A leads");
    let b_backend = env.another_backend().await;
    let b = tokio::spawn(async move {
        let term = Election::new(name)
            .ttl(Duration::from_secs(5))
            .with_backend(b_backend)
            .campaign()
            .await
            .expect("B leads");
        (Instant::now(), term)
    });
    // Let A renew once (ttl/3), then stop its renewals.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!b.is_finished(), "B must wait while A renews");
    a_backend.stall_extends();
    let stalled = Instant::now();
    let a_out = tokio::time::timeout(Duration::from_secs(5), a_run)
        .await
        .expect("A's run returned")
        .unwrap();
    assert!(
        matches!(
            a_out,
            Err(LockError::Lost {
                reason: LostReason::Deadline,
                ..
            })
        ),
        "{a_out:?}"
    );
    let cancelled = cancelled_at.lock().unwrap().expect("A's body was dropped");
    let a_deadline = a_deadline.lock().unwrap().expect("A's body saw its lease");
    assert!(
        cancelled >= a_deadline,
        "A's body was dropped {:?} before its deadline",
        a_deadline.duration_since(cancelled)
    );
    // A's deadline is at most one ttl after its last confirmed renewal, which came before the
    // stall.
    assert!(
        cancelled.duration_since(stalled) <= ttl + Duration::from_millis(300),
        "A's body ran {:?} past the stall",
        cancelled.duration_since(stalled)
    );
    let (b_won, b_term) = tokio::time::timeout(Duration::from_secs(10), b)
        .await
        .expect("B won within 10 s of the stall")
        .unwrap();
    // B's grant came before B saw it; A's lease on the store ended no earlier than A's deadline.
    assert!(
        b_won >= a_deadline,
        "B led {:?} before A's deadline",
        a_deadline.duration_since(b_won)
    );
    // Redis family, memory, lock tables: the lease's ttl; session engines: A's deadline, then
    // the runtime's give-back. Generous: it catches a hang or a wait for a whole session.
    let bound = ttl + Duration::from_secs(3);
    assert!(
        b_won.duration_since(stalled) <= bound,
        "B won {:?} after the stall (bound {bound:?})",
        b_won.duration_since(stalled)
    );
    assert!(b_term.epoch() > a_epoch);
    b_term.resign().await.unwrap();
}

/// A leads with a 30 s ttl; B waits. A resigns: B leads well within a second, not a lease later.
async fn resign_hands_over_at_once(env: Env) {
    let name = "resign";
    let a = Election::new(name)
        .ttl(Duration::from_secs(30))
        .with_backend(env.another_backend().await)
        .campaign()
        .await
        .unwrap();
    let b_backend = env.another_backend().await;
    let b = tokio::spawn(async move {
        let t = Election::new(name)
            .ttl(Duration::from_secs(30))
            .with_backend(b_backend)
            .campaign()
            .await
            .unwrap();
        (Instant::now(), t)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!b.is_finished(), "B must wait while A leads");
    let a_epoch = a.epoch();
    let resigned = Instant::now();
    a.resign().await.unwrap();
    let (won, t) = tokio::time::timeout(Duration::from_secs(10), b)
        .await
        .expect("B leads after the resign")
        .unwrap();
    assert!(
        won.duration_since(resigned) < Duration::from_secs(2),
        "hand-over took {:?}",
        won.duration_since(resigned)
    );
    assert!(t.epoch() > a_epoch);
    t.resign().await.unwrap();
}

/// A leads; its lock is deleted behind its back and B wins and writes its record. A's proclaim
/// is refused (its epoch is older), A's term is lost, and the record keeps B's value.
async fn a_stale_leaders_proclaim_is_refused_and_loses_its_term(env: Env) {
    let name = "stale-proclaim";
    let a = Election::new(name)
        .ttl(Duration::from_secs(30))
        .value("a")
        .with_backend(env.another_backend().await)
        .campaign()
        .await
        .unwrap();
    assert!(a.has_records());
    a.proclaim("a2")
        .await
        .expect("the current leader proclaims");
    env.force_delete(&format!("election:{name}")).await;
    let b = Election::new(name)
        .ttl(Duration::from_secs(30))
        .value("b")
        .with_backend(env.another_backend().await)
        .wait(Duration::from_secs(10))
        .campaign()
        .await
        .unwrap();
    assert!(b.epoch() > a.epoch());
    let lost = a.lost_token();
    let e = a.proclaim("stale").await.unwrap_err();
    assert!(
        matches!(
            e,
            LockError::Lost { .. } // refused by the record, or A's guard already knew
        ),
        "{e:?}"
    );
    assert!(lost.is_cancelled(), "A's term is lost");
    let r = env
        .backend()
        .get_record(&format!("election:{name}"))
        .await
        .unwrap()
        .expect("a record");
    assert_eq!((r.epoch, r.value.as_str()), (b.epoch(), "b"));
    b.resign().await.unwrap();
}

/// An observer reading every 20 ms sees, in order: A's value, A's new value, B's, C's; epochs
/// never go back. (Each state lasts far longer than a read.)
async fn observers_see_every_change_of_leader_in_order(env: Env) {
    let name = "observed";
    let observer_election = Election::new(name)
        .with_backend(env.another_backend().await)
        .observe_every(Duration::from_millis(20));
    let mut obs = observer_election.observe();
    let collected = Arc::new(Mutex::new(Vec::new()));
    let done = Arc::new(AtomicBool::new(false));
    let (c, d) = (collected.clone(), done.clone());
    let reader = tokio::spawn(async move {
        while let Some(item) = obs.next().await {
            let l = item.expect("no read error");
            c.lock().unwrap().push((l.value.clone(), l.epoch));
            if l.value == "c" {
                d.store(true, Ordering::SeqCst);
                return;
            }
        }
    });
    let mut expected = Vec::new();
    for v in ["a", "b", "c"] {
        let t = Election::new(name)
            .ttl(Duration::from_secs(10))
            .value(v)
            .with_backend(env.another_backend().await)
            .wait(Duration::from_secs(10))
            .campaign()
            .await
            .unwrap();
        expected.push((v.to_string(), t.epoch()));
        tokio::time::sleep(Duration::from_millis(200)).await;
        if v == "a" {
            t.proclaim("a-moved").await.unwrap();
            expected.push(("a-moved".to_string(), t.epoch()));
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if v == "c" {
            assert!(
                common::eventually(Duration::from_secs(5), || {
                    let d = done.clone();
                    async move { d.load(Ordering::SeqCst) }
                })
                .await
            );
        }
        t.resign().await.unwrap();
    }
    tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .expect("the reader saw C")
        .unwrap();
    assert_eq!(*collected.lock().unwrap(), expected);
}

/// `.once()`: a term lost (its lock deleted behind it) makes `run` return `Lost`, with the body
/// dropped. Without it: `run` campaigns again and the body runs in a second term with a larger
/// epoch, whose output `run` returns.
async fn once_returns_after_a_lost_term_and_without_it_run_campaigns_again(env: Env) {
    let lock_name = "election:rerun";
    for once in [true, false] {
        let mut e = Election::new("rerun")
            .ttl(Duration::from_secs(2))
            .with_backend(env.another_backend().await);
        if once {
            e = e.once();
        }
        let epochs = Arc::new(Mutex::new(Vec::new()));
        let ep = epochs.clone();
        let run = tokio::spawn(async move {
            e.run(move |term| {
                let ep = ep.clone();
                async move {
                    let n = {
                        let mut v = ep.lock().unwrap();
                        v.push(term.epoch());
                        v.len()
                    };
                    if n == 1 {
                        std::future::pending::<()>().await;
                    }
                    // Second term: the epoch, seen through the lock context.
                    term.scope(async { dlock::fencing_token() }).await
                }
            })
            .await
        });
        assert!(
            common::eventually(Duration::from_secs(5), || {
                let ep = epochs.clone();
                async move { !ep.lock().unwrap().is_empty() }
            })
            .await
        );
        env.force_delete(lock_name).await;
        let out = tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("run returned")
            .unwrap();
        let epochs = epochs.lock().unwrap().clone();
        if once {
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
            assert_eq!(epochs.len(), 1);
        } else {
            assert_eq!(epochs.len(), 2, "a second term");
            assert!(epochs[1] > epochs[0]);
            assert_eq!(out.unwrap(), Some(epochs[1]));
        }
        // The last term ended with its body (or its loss): the name is free again.
        let env = &env;
        assert!(
            common::eventually(Duration::from_secs(5), || async move {
                !env.is_locked(lock_name).await
            })
            .await,
            "the term's lock was given back"
        );
    }
}

/// A leader record whose epoch is above anything the engine now mints (its tokens went back, or
/// the record came from elsewhere) refuses every fresh grant: the campaign gives up after a few
/// with a `Backend` error instead of looping for ever, and leaves the name free.
async fn a_record_above_every_new_epoch_ends_the_campaign_with_an_error_not_a_loop(env: Env) {
    let lock_name = "election:future";
    // Year ~2223 in µs: above every token minted now, exact in Lua's doubles.
    let future = 8_000_000_000_000_000u64;
    assert!(
        env.backend()
            .put_record(lock_name, future, "x")
            .await
            .unwrap()
    );
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        Election::new("future")
            .with_backend(env.another_backend().await)
            .campaign(),
    )
    .await
    .expect("the campaign ended");
    assert!(matches!(r, Err(LockError::Backend { .. })), "{r:?}");
    let env = &env;
    assert!(
        common::eventually(Duration::from_secs(5), || async move {
            !env.is_locked(lock_name).await
        })
        .await,
        "the refused grants were given back"
    );
}
