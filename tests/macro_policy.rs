//! `policy = "name"`: code, TOML file and environment layers, their precedence, and the error for
//! an unknown name. One test function, because it sets environment variables.

use std::sync::Arc;
use std::time::Duration;

use dlock::{Lock, LockError, MemoryBackend, OnBusy, Policy, distributed_lock};

/// The holder's remaining lease as another caller sees it: shows the ttl the fn ran with.
async fn lease_seen_from_outside(key: &str) -> Duration {
    let e = Lock::new(key).backend("mp").acquire().await.unwrap_err();
    e.retry_after()
        .expect("the memory backend reports the remaining lease")
}

macro_rules! observe_ttl {
    ($f:ident, $key:literal) => {{
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
        let call = tokio::spawn(async move { $f(started_tx, rx).await });
        started_rx.await.unwrap();
        let seen = lease_seen_from_outside($key).await;
        tx.send(()).unwrap();
        call.await.unwrap().unwrap();
        seen
    }};
}

type Gate = (
    tokio::sync::oneshot::Sender<()>,
    tokio::sync::oneshot::Receiver<()>,
);

async fn wait_gate((started, rx): Gate) {
    started.send(()).unwrap();
    rx.await.unwrap();
}

#[distributed_lock(key = "code", policy = "p-code")]
async fn from_code(
    s: tokio::sync::oneshot::Sender<()>,
    r: tokio::sync::oneshot::Receiver<()>,
) -> Result<(), LockError> {
    wait_gate((s, r)).await;
    Ok(())
}

#[distributed_lock(key = "file", policy = "p-file")]
async fn from_file(
    s: tokio::sync::oneshot::Sender<()>,
    r: tokio::sync::oneshot::Receiver<()>,
) -> Result<(), LockError> {
    wait_gate((s, r)).await;
    Ok(())
}

#[distributed_lock(key = "env", policy = "p-env")]
async fn from_env(
    s: tokio::sync::oneshot::Sender<()>,
    r: tokio::sync::oneshot::Receiver<()>,
) -> Result<(), LockError> {
    wait_gate((s, r)).await;
    Ok(())
}

#[distributed_lock(key = "attr", policy = "p-env", ttl = "3s")]
async fn attribute_wins(
    s: tokio::sync::oneshot::Sender<()>,
    r: tokio::sync::oneshot::Receiver<()>,
) -> Result<(), LockError> {
    wait_gate((s, r)).await;
    Ok(())
}

#[distributed_lock(key = "env-only", policy = "p-env-only")]
async fn env_only(
    s: tokio::sync::oneshot::Sender<()>,
    r: tokio::sync::oneshot::Receiver<()>,
) -> Result<(), LockError> {
    wait_gate((s, r)).await;
    Ok(())
}

#[distributed_lock(key = "skip", policy = "p-skip")]
async fn skip_by_policy() -> Option<u8> {
    Some(1)
}

#[distributed_lock(key = "skip", policy = "p-skip")]
async fn result_under_skip_policy() -> Result<u8, LockError> {
    Ok(1)
}

#[distributed_lock(key = "x", policy = "p-nobody-defined")]
async fn unknown_policy() -> Result<(), LockError> {
    Ok(())
}

#[tokio::test]
async fn policies_from_code_file_and_env_with_precedence() {
    // Before anything else runs: the only test in this binary sets the environment.
    // SAFETY: no other thread of this test binary reads the environment at this point.
    unsafe {
        std::env::set_var("DLOCK_POLICY_P_ENV_TTL", "11s");
        std::env::set_var("DLOCK_POLICY_P_ENV_ONLY_TTL", "13s");
        std::env::set_var("DLOCK_POLICY_P_ENV_ONLY_BACKEND", "mp");
        std::env::set_var("DLOCK_POLICY_P_ENV_ONLY_WATCHDOG", "false");
    }
    dlock::register_arc("mp", Arc::new(MemoryBackend::new()));

    let mut code = Policy::new();
    code.ttl = Some(Duration::from_secs(7));
    code.backend = Some("mp".into());
    code.watchdog = Some(false);
    for name in ["p-code", "p-file", "p-env"] {
        dlock::define_policy(name, code.clone());
    }
    let dir = std::env::temp_dir().join(format!("dlock-macro-policy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("policies.toml");
    std::fs::write(
        &file,
        "[policy.p-file]\nttl = \"9s\"\n\n[policy.p-env]\nttl = \"9s\"\n\n\
         [policy.p-skip]\nbackend = \"mp\"\non_busy = \"skip\"\n",
    )
    .unwrap();
    dlock::load_policies(&file).unwrap();
    std::fs::remove_dir_all(&dir).ok();

    let within = |d: Duration, secs: u64| {
        d <= Duration::from_secs(secs) && d > Duration::from_secs(secs - 1)
    };
    let code_ttl = observe_ttl!(from_code, "code");
    assert!(within(code_ttl, 7), "code layer: {code_ttl:?}");
    let file_ttl = observe_ttl!(from_file, "file");
    assert!(within(file_ttl, 9), "file over code: {file_ttl:?}");
    let env_ttl = observe_ttl!(from_env, "env");
    assert!(within(env_ttl, 11), "env over file: {env_ttl:?}");
    let attr_ttl = observe_ttl!(attribute_wins, "attr");
    assert!(within(attr_ttl, 3), "attribute over env: {attr_ttl:?}");
    let env_only_ttl = observe_ttl!(env_only, "env-only");
    assert!(
        within(env_only_ttl, 13),
        "a policy only the environment names: {env_only_ttl:?}"
    );

    // on_busy from the policy, as far as the return type allows.
    assert_eq!(skip_by_policy().await, Some(1));
    let g = Lock::new("skip").backend("mp").acquire().await.unwrap();
    assert_eq!(skip_by_policy().await, None);
    let e = result_under_skip_policy().await.unwrap_err();
    assert!(e.is_contended(), "a Result carries the busy error: {e:?}");
    g.release().await.unwrap();

    // An unknown name is a configuration error at first use, listing the known names.
    match unknown_policy().await {
        Err(LockError::UnknownPolicy { name, known }) => {
            assert_eq!(name, "p-nobody-defined");
            for k in ["p-code", "p-env", "p-file", "p-skip"] {
                assert!(known.iter().any(|n| n == k), "{known:?}");
            }
        }
        other => panic!("{other:?}"),
    }
    let msg = unknown_policy().await.unwrap_err().to_string();
    assert!(
        msg.contains("p-nobody-defined") && msg.contains("p-code"),
        "{msg}"
    );

    assert_eq!(dlock::policy("p-skip").unwrap().on_busy, Some(OnBusy::Skip));
}
