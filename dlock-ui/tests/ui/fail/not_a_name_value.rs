use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "k", watchdog)]
async fn f() -> Result<(), LockError> {
    Ok(())
}

fn main() {}
