mod renamed {
    pub use ::dlock as lockkit;
}

use dlock::{LockError, distributed_lock};

#[distributed_lock(
    key = "all:{id}",
    ttl = "1m 30s",
    wait = "500ms",
    backend = "default",
    watchdog = true,
    fair = true,
    on_busy = "error",
    hold_at_least = "1ms",
    on_lost = "continue",
)]
async fn all_options(id: u8) -> Result<u8, LockError> {
    Ok(id)
}

#[renamed::lockkit::distributed_lock(key = "renamed", crate = "renamed::lockkit")]
async fn through_renamed() -> Result<(), renamed::lockkit::LockError> {
    Ok(())
}

#[distributed_lock(key = "type:{type}")]
async fn raw_ident(r#type: u8) -> Result<u8, LockError> {
    Ok(r#type)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    assert_eq!(all_options(1).await.unwrap(), 1);
    through_renamed().await.unwrap();
    assert_eq!(raw_ident(2).await.unwrap(), 2);
}
