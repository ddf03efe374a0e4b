use dlock::{LockError, distributed_lock};

trait Store {
    async fn put(&self, key: u32) -> Result<u32, LockError>;
    fn get(&self, key: u32) -> impl std::future::Future<Output = Option<u32>> + Send;
}

struct Db;

impl Store for Db {
    #[distributed_lock(key = "db:{key}")]
    async fn put(&self, key: u32) -> Result<u32, LockError> {
        Ok(key)
    }

    #[distributed_lock(key = "db:{key}", on_busy = "skip")]
    async fn get(&self, key: u32) -> Option<u32> {
        Some(key)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    assert_eq!(Db.put(1).await.unwrap(), 1);
    assert_eq!(Db.get(2).await, Some(2));
}
