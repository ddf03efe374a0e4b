use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "k", permits = 2)]
async fn permits_without_semaphore() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "k", semaphore = 2, permits = 3)]
async fn more_permits_than_the_semaphore() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "k", semaphore = 0)]
async fn zero_permits() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "k", semaphore = "4")]
async fn not_an_integer() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "k", semaphore = 4, hold_at_least = "1s")]
async fn hold_at_least_with_a_semaphore() -> Result<(), LockError> {
    Ok(())
}

fn main() {}
