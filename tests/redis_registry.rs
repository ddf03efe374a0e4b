//! The process-global registry: a Redis backend registered once (from a runtime that is gone
//! before any test runs) and used by name from many `#[tokio::test]` functions, each on its own
//! runtime; unknown names; the in-memory default.

mod common;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::RedisProc;
use dlock::{Lock, LockError};

const NAME: &str = "registry-redis";

/// The shared server, and the backend `NAME` registered from a throwaway runtime on its own
/// thread, which has shut down before any test uses the backend.
fn registered() -> &'static RedisProc {
    static SERVER: OnceLock<RedisProc> = OnceLock::new();
    static INIT: OnceLock<()> = OnceLock::new();
    let server = SERVER.get_or_init(RedisProc::start);
    INIT.get_or_init(|| {
        let url = server.url();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                dlock::init_named(NAME, &url).await.expect("init_named");
                // Use it here too, so this runtime has connections that die with it.
                let g = Lock::new("warm-up").backend(NAME).acquire().await.unwrap();
                g.release().await.unwrap();
            });
        })
        .join()
        .expect("registration thread");
    });
    server
}

/// Acquire, contend, wait and hand off by name on the current runtime.
async fn exercise(tag: &str) {
    registered();
    let name = format!("reg-{tag}");
    let g = Lock::new(name.clone())
        .backend(NAME)
        .ttl(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("{tag}: acquire by name: {e}"));
    let e = Lock::new(name.clone())
        .backend(NAME)
        .acquire()
        .await
        .unwrap_err();
    assert!(e.is_contended(), "{tag}: {e:?}");
    let l = Lock::new(name.clone())
        .backend(NAME)
        .wait(Duration::from_secs(10));
    let waiter = tokio::spawn(async move {
        let r = l.acquire().await;
        (Instant::now(), r)
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let released = Instant::now();
    g.release().await.unwrap();
    let (at, r) = waiter.await.unwrap();
    let g = r.unwrap_or_else(|e| panic!("{tag}: waiter: {e}"));
    assert!(
        at.saturating_duration_since(released) < Duration::from_millis(200),
        "{tag}: hand-off took {:?}",
        at.saturating_duration_since(released)
    );
    g.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_backend_works_from_a_multi_thread_test_runtime() {
    exercise("mt").await;
}

#[tokio::test]
async fn registered_backend_works_from_a_current_thread_test_runtime() {
    exercise("ct").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_backend_works_from_another_multi_thread_test_runtime() {
    exercise("mt2").await;
}

/// Runtime after runtime in one thread: each one's connections die with it and the next gets
/// new ones.
#[test]
fn registered_backend_survives_runtime_after_runtime() {
    registered();
    for i in 0..4 {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(exercise(&format!("seq-{i}")));
        drop(rt);
    }
}

/// A holder in one runtime, a waiter in another (two threads): the release in one runtime wakes
/// the waiter of the other promptly, and they exclude each other.
#[test]
fn holder_and_waiter_in_different_runtimes_hand_off_promptly() {
    registered();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let g = Lock::new("cross-rt")
                .backend(NAME)
                .ttl(Duration::from_secs(30))
                .acquire()
                .await
                .unwrap();
            tx.send(()).unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
            let released = Instant::now();
            g.release().await.unwrap();
            released
        })
    });
    rx.recv().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (at, r) = rt.block_on(async {
        let r = Lock::new("cross-rt")
            .backend(NAME)
            .wait(Duration::from_secs(10))
            .acquire()
            .await;
        (Instant::now(), r)
    });
    let released = holder.join().unwrap();
    let g = r.expect("waiter in the other runtime acquires");
    assert!(at >= released, "waiter got the lock before the release");
    assert!(
        at - released < Duration::from_millis(200),
        "cross-runtime hand-off took {:?}",
        at - released
    );
    rt.block_on(g.release()).unwrap();
}

#[tokio::test]
async fn unknown_backend_name_is_a_typed_error() {
    let e = dlock::backend("nope").unwrap_err();
    let LockError::UnknownBackend { name, .. } = &e else {
        panic!("expected UnknownBackend, got {e:?}");
    };
    assert_eq!(name, "nope");
    assert!(e.to_string().contains("nope"));
    let e = Lock::new("x").backend("nope").acquire().await.unwrap_err();
    assert!(matches!(e, LockError::UnknownBackend { .. }), "{e:?}");
}

/// With nothing configured, "default" is the in-memory backend: locking works without a server.
#[tokio::test]
async fn default_backend_without_configuration_is_in_memory() {
    let g = Lock::new("default-mem")
        .acquire()
        .await
        .expect("in-memory default");
    let e = Lock::new("default-mem").acquire().await.unwrap_err();
    assert!(e.is_contended());
    g.release().await.unwrap();
    assert!(dlock::backend(dlock::DEFAULT_BACKEND).is_ok());
}
