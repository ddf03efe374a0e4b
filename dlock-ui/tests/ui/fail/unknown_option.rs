use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "k", retries = 3)]
async fn f() -> Result<(), LockError> {
    Ok(())
}

fn main() {}
