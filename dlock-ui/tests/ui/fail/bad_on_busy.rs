use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "k", on_busy = "wait")]
async fn f() -> Result<(), LockError> {
    Ok(())
}

fn main() {}
