use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "acct:{self.id}")]
async fn f(id: u64) -> Result<u64, LockError> {
    Ok(id)
}

fn main() {}
