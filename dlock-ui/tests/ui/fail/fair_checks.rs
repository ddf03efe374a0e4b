use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "k", fair = "yes")]
async fn not_a_bool() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "k", semaphore = 4, fair = true)]
async fn on_a_semaphore() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "k", mode = "read", fair = true)]
async fn on_a_rw_lock() -> Result<(), LockError> {
    Ok(())
}

fn main() {}
