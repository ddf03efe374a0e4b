//! `DLOCK_URL` (issue 20, friction 1): a forgotten `init` must not silently keep locks inside one
//! process when the deployment names a shared store. One test in its own binary: it changes this
//! process's environment.

use std::time::Duration;

use dlock::{Lock, LockError};

#[tokio::test(flavor = "current_thread")]
async fn dlock_url_turns_the_in_memory_fallback_off_and_init_from_env_reads_it() {
    // SAFETY: the only test of this binary; nothing else reads the environment concurrently.
    unsafe { std::env::remove_var(dlock::URL_ENV) };
    match dlock::init_from_env().await {
        Err(LockError::Config(m)) => assert!(m.contains("DLOCK_URL is not set"), "{m}"),
        other => panic!("init_from_env without DLOCK_URL: {other:?}"),
    }

    // A deployment that names a store but forgot to call init: the first lock is an error that
    // says what to call, not a lock local to this process.
    unsafe { std::env::set_var(dlock::URL_ENV, "redis://127.0.0.1:1/0") };
    let lock = Lock::new("env:first").ttl(Duration::from_secs(5));
    match lock.acquire().await {
        Err(LockError::Config(m)) => assert!(m.contains("init_from_env"), "{m}"),
        other => panic!("a lock before init with DLOCK_URL set: {other:?}"),
    }

    // `memory://` names the in-process backend on purpose; init_from_env registers it.
    unsafe { std::env::set_var(dlock::URL_ENV, "memory://") };
    dlock::init_from_env()
        .await
        .expect("init_from_env(memory://)");
    let g = lock.acquire().await.expect("a lock after init_from_env");
    assert!(
        matches!(
            Lock::new("env:first").acquire().await,
            Err(LockError::Busy { .. })
        ),
        "the registered in-memory backend does not exclude a second owner"
    );
    g.release().await.unwrap();
}
