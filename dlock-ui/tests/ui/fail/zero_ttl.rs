use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "k", ttl = "0s")]
async fn f() -> Result<(), LockError> {
    Ok(())
}

fn main() {}
