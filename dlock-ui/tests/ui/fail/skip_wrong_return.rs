use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "job", on_busy = "skip")]
async fn nightly() -> Result<u32, LockError> {
    Ok(1)
}

fn main() {}
