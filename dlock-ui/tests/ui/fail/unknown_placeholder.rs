use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "order:{order}")]
async fn f(order_id: u64, user: &str) -> Result<(), LockError> {
    let _ = (order_id, user);
    Ok(())
}

fn main() {}
