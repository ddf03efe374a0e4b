use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "order:order_id}")]
async fn f(order_id: u64) -> Result<u64, LockError> {
    Ok(order_id)
}

fn main() {}
