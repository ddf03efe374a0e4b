use dlock::{LockError, distributed_lock};

// Every mistake is reported in one go.
#[distributed_lock(key = "o:{nope}", ttl = "0s", on_busy = "maybe", retry = 3)]
async fn f(id: u64) -> Result<u64, LockError> {
    Ok(id)
}

fn main() {}
