use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "k", ttl = "ten seconds")]
async fn f() -> Result<(), LockError> {
    Ok(())
}

fn main() {}
