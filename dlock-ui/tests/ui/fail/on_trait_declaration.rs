use dlock::{LockError, distributed_lock};

trait Store {
    #[distributed_lock(key = "k")]
    async fn put(&self) -> Result<(), LockError>;
}

fn main() {}
