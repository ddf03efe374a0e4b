use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "k", mode = "read", hold_at_least = "1s")]
async fn f() -> Result<(), LockError> {
    Ok(())
}

fn main() {}
