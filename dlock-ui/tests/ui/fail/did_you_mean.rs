use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "k", tll = "10s")]
async fn f() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "k", timeout = "10s")]
async fn g() -> Result<(), LockError> {
    Ok(())
}

fn main() {}
