use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "k", watchdog = "yes")]
async fn f() -> Result<(), LockError> {
    Ok(())
}

fn main() {}
