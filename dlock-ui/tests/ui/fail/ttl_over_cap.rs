use dlock::{LockError, distributed_lock};

// Longer than the 365-day cap: refused here, not at every call at run time.
#[distributed_lock(key = "k", ttl = "400d")]
async fn f() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "k2", hold_at_least = "366d")]
async fn g() -> Result<(), LockError> {
    Ok(())
}

fn main() {}
