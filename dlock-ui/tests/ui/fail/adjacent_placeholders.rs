use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "pair:{a}{b}")]
async fn f(a: u32, b: u32) -> Result<u32, LockError> {
    Ok(a + b)
}

fn main() {}
