use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "exports:{region}", semaphore = 4, permits = 2, ttl = "30s", wait = "1s")]
async fn export(region: &str) -> Result<Option<u64>, LockError> {
    Ok(dlock::fencing_token())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    dlock::register("default", dlock::MemoryBackend::new());
    assert!(export("eu").await.unwrap().is_some());
}
