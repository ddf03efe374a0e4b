use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "k", mode = "shared")]
async fn f() -> Result<(), LockError> {
    Ok(())
}

fn main() {}
