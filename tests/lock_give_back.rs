//! Calls whose outcome is unknown leave no orphan (issue 17; ARCHITECTURE.md, "Calls whose
//! outcome is unknown"), on every engine: acquire, extend and release futures dropped at every
//! step of their flight, and a waiter whose runtime shuts down mid-wait. Each check ends the
//! same way: with a lease far longer than the test (30 s), another client gets the name within
//! a give-back (seconds), and the store shows no holder once it let go.

mod common;

use std::time::{Duration, Instant};

use common::{Env, Kind};
use dlock::Lock;

both_backends!(
    acquires_dropped_at_every_step_leave_no_orphan,
    extends_and_releases_dropped_at_every_step_leave_no_orphan,
    a_waiter_whose_runtime_shuts_down_leaves_nothing_queued,
);

/// Far longer than any check here: an orphan would block the name for the rest of the test.
const LONG_TTL: Duration = Duration::from_secs(30);
/// How soon the name must be free again after the last dropped call: the background give-back's
/// back-off (50 ms to 1 s) a few times over, far below `LONG_TTL`.
const GIVE_BACK_WITHIN: Duration = Duration::from_secs(5);

/// Runs `fut` as a task and aborts it `after` (timed on a thread, to the tens of microseconds
/// that tokio's millisecond timers cannot give): the future is dropped at whichever await it has
/// reached. `None` when it was cut off.
async fn cut_off<T: Send + 'static>(
    after: Duration,
    fut: impl std::future::Future<Output = T> + Send + 'static,
) -> Option<T> {
    let task = tokio::spawn(fut);
    let abort = task.abort_handle();
    tokio::task::spawn_blocking(move || {
        std::thread::sleep(after);
        abort.abort();
    })
    .await
    .expect("the aborting thread");
    task.await.ok()
}

/// Steps at which a call is cut off: from 0 to twice `one_call` (an uncontended acquire's time
/// on this engine), in 100 steps, so that every await of the call's flight is hit (RELIABILITY.md
/// J2: 200 cancellations per engine, 100 acquires and 100 extend + release pairs).
fn steps(one_call: Duration) -> impl Iterator<Item = Duration> {
    (0..=100u32).map(move |i| one_call * i / 50)
}

/// How long an uncontended acquire + release takes here (the fastest of five).
async fn one_call(env: &Env, name: &str) -> Duration {
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        let g = env.lock(name).ttl(LONG_TTL).acquire().await.unwrap();
        best = best.min(t0.elapsed());
        g.release().await.unwrap();
    }
    best
}

/// Another client takes `name` within [`GIVE_BACK_WITHIN`] and, once it released, the store
/// shows no holder, nor does the operator's view (`dlock show`).
async fn no_orphan(env: &Env, name: &str, what: &str) {
    let other = env.another_backend().await;
    let t0 = Instant::now();
    let g = Lock::new(name)
        .with_backend(other)
        .ttl(LONG_TTL)
        .wait(GIVE_BACK_WITHIN)
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("{what}: the name is still held by an orphan: {e:?}"));
    let took = t0.elapsed();
    g.release().await.unwrap();
    assert!(
        common::eventually(Duration::from_secs(2), || async {
            !env.is_locked(name).await
        })
        .await,
        "{what}: the store still shows a holder after the last release"
    );
    if env.kind != Kind::Memory {
        let shown = env.admin().await.show(name).await.expect("admin show");
        assert_eq!(shown, None, "{what}: `dlock show` still lists a holder");
    }
    assert!(took < GIVE_BACK_WITHIN, "{what}: free only after {took:?}");
}

/// An acquire cut off at each step of its flight (nobody else holds the name, so each try is a
/// grant on its way): the drop guard gives back every grant whose reply was not read.
async fn acquires_dropped_at_every_step_leave_no_orphan(env: Env) {
    let name = "dropped-acquires";
    let (mut cut, mut finished) = (0, 0);
    for d in steps(one_call(&env, name).await) {
        let lock = env.lock(name).ttl(LONG_TTL).wait(GIVE_BACK_WITHIN);
        match cut_off(d, async move { lock.acquire().await }).await {
            // Finished within the step: give it back as usual.
            Some(Ok(g)) => {
                finished += 1;
                g.release().await.unwrap();
            }
            Some(Err(e)) => panic!("acquire cut off after {d:?}: {e:?}"),
            None => cut += 1,
        }
    }
    // In memory an acquire completes within its first poll: there is nothing to cut off.
    if env.kind != Kind::Memory {
        assert!(cut > 0, "no acquire was cut off ({finished} finished)");
    }
    no_orphan(&env, name, "dropped acquires").await;
}

/// A held lock whose `extend`, then whose `release`, is cut off at each step: a dropped release
/// finishes in the background, and a dropped extend leaves the hold to its guard.
async fn extends_and_releases_dropped_at_every_step_leave_no_orphan(env: Env) {
    let name = "dropped-releases";
    for d in steps(one_call(&env, name).await) {
        let g = env
            .lock(name)
            .ttl(LONG_TTL)
            .wait(GIVE_BACK_WITHIN)
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("acquire before step {d:?}: {e:?}"));
        cut_off(d, async move {
            let _ = g.extend(LONG_TTL).await;
            let _ = g.release().await;
        })
        .await;
    }
    no_orphan(&env, name, "dropped extends and releases").await;
}

/// A waiter's runtime is shut down while it waits (its queued node or key, on the engines that
/// queue contenders, must go with it): once the holder releases, another client gets the name.
async fn a_waiter_whose_runtime_shuts_down_leaves_nothing_queued(env: Env) {
    let name = "runtime-gone";
    let holder = env.lock(name).ttl(LONG_TTL).acquire().await.unwrap();
    let lock = Lock::new(name)
        .with_backend(env.backend())
        .ttl(LONG_TTL)
        .wait(Duration::from_secs(60));
    // A runtime of its own on a thread of its own: a runtime cannot be dropped on another's
    // worker thread.
    let waited = tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let waiter = rt.spawn(async move { lock.acquire().await.map(|g| g.fencing_token()) });
        // Long enough for its try to be answered busy and its subscription (or queued contender)
        // to reach the server.
        rt.block_on(tokio::time::sleep(Duration::from_millis(700)));
        let waiting = !waiter.is_finished();
        // Cancels the waiter mid-wait.
        drop(rt);
        waiting
    })
    .await
    .expect("the waiter's thread");
    assert!(
        waited,
        "the waiter was still waiting when its runtime shut down"
    );
    holder.release().await.unwrap();
    no_orphan(&env, name, "a waiter's runtime shut down").await;
}
