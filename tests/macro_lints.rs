//! Annotated fns under `#![deny(warnings)]` and `#![deny(clippy::pedantic)]`: the expansion must
//! not add a warning of its own. Checked by `cargo clippy --all-targets -- -D warnings`.
#![deny(warnings)]
#![deny(clippy::pedantic)]

use std::sync::Arc;

use dlock::{LockError, MemoryBackend, distributed_lock};

/// A documented public fn.
///
/// # Errors
/// When the lock is busy.
#[distributed_lock(key = "lint:{id}", ttl = "5s", wait = "100ms", backend = "ml")]
pub async fn with_result(id: u64) -> Result<u64, LockError> {
    Ok(id + 1)
}

#[distributed_lock(
    key = "lint:{id}",
    backend = "ml",
    on_busy = "skip",
    hold_at_least = "1ms"
)]
async fn skip_unit(id: u64) {
    let _ = id;
}

#[distributed_lock(
    key = "lint:{id}",
    backend = "ml",
    on_busy = "skip",
    on_lost = "continue"
)]
async fn skip_option(id: u64) -> Option<u64> {
    Some(id)
}

#[distributed_lock(key = "lint", backend = "ml", watchdog = false)]
async fn early_return(flag: bool) -> Result<&'static str, LockError> {
    if flag {
        return Ok("early");
    }
    Ok("late")
}

#[distributed_lock(key = "lint:{name}", backend = "ml", policy = "lint-policy")]
async fn by_policy(name: &str) -> Option<usize> {
    Some(name.len())
}

struct Svc {
    id: u32,
}

impl Svc {
    #[distributed_lock(key = "svc:{self.id}", backend = "ml")]
    async fn method(&self) -> Result<u32, LockError> {
        Ok(self.id)
    }
}

#[tokio::test]
async fn lint_clean_expansions_run() {
    dlock::register_arc("ml", Arc::new(MemoryBackend::new()));
    dlock::define_policy("lint-policy", dlock::Policy::new());
    assert_eq!(with_result(1).await.unwrap(), 2);
    skip_unit(1).await;
    assert_eq!(skip_option(2).await, Some(2));
    assert_eq!(early_return(true).await.unwrap(), "early");
    assert_eq!(by_policy("ab").await, Some(2));
    assert_eq!(Svc { id: 3 }.method().await.unwrap(), 3);
}
