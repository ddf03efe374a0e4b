use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "k", ttl = "10s", ttl = "20s")]
async fn f() -> Result<(), LockError> {
    Ok(())
}

fn main() {}
