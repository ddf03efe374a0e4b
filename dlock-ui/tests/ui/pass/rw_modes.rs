use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "catalog:{id}", mode = "read", wait = "1s")]
async fn show(id: u64) -> Result<u64, LockError> {
    Ok(id)
}

#[distributed_lock(key = "catalog:{id}", mode = "write", ttl = "10s")]
async fn edit(id: u64) -> Result<u64, LockError> {
    Ok(dlock::fencing_token().unwrap_or(0) + id)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    assert_eq!(show(1).await.unwrap(), 1);
    assert!(edit(1).await.unwrap() > 1);
}
