use std::sync::Arc;

use dlock::{LockError, distributed_lock};

struct Account {
    id: u32,
    balance: u64,
}

impl Account {
    #[distributed_lock(key = "acct:{self.id}")]
    async fn by_ref(&self) -> Result<u64, LockError> {
        Ok(self.balance)
    }

    #[distributed_lock(key = "acct:{self.id}")]
    async fn by_mut(&mut self, n: u64) -> Result<u64, LockError> {
        self.balance += n;
        Ok(self.balance)
    }

    #[distributed_lock(key = "acct:{self.id}")]
    async fn by_arc(self: Arc<Self>) -> Result<u32, LockError> {
        Ok(self.id)
    }

    #[distributed_lock(key = "acct:{self.id}")]
    async fn by_value(self) -> Result<u64, LockError> {
        Ok(self.balance)
    }

    #[distributed_lock(key = "acct:{id}")]
    async fn assoc(id: u32) -> Result<Self, LockError> {
        Ok(Self { id, balance: 0 })
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut a = Account::assoc(1).await.unwrap();
    a.by_mut(2).await.unwrap();
    assert_eq!(a.by_ref().await.unwrap(), 2);
    let a = Arc::new(a);
    assert_eq!(a.clone().by_arc().await.unwrap(), 1);
    let a = Arc::try_unwrap(a).ok().unwrap();
    assert_eq!(a.by_value().await.unwrap(), 2);
}
