//! `#[distributed_lock]` on methods (`&self`, `&mut self`, `self: Arc<Self>`, `{self.field}`),
//! generic fns, `impl Trait` arguments and returns, async fns in trait impls, and stacked with
//! `#[tracing::instrument]` in either order.

use std::fmt::Display;
use std::sync::Arc;

use dlock::{Lock, LockError, MemoryBackend, distributed_lock};

struct Account {
    id: u32,
    balance: u64,
}

impl Account {
    /// Doc comments and attributes stay on the method.
    #[distributed_lock(key = "acct:{self.id}", backend = "mm")]
    #[inline]
    pub async fn balance(&self) -> Result<u64, LockError> {
        Ok(self.balance)
    }

    #[distributed_lock(key = "acct:{self.id}", backend = "mm")]
    async fn deposit(&mut self, amount: u64) -> Result<u64, LockError> {
        if amount == 0 {
            return Err(LockError::Config("nothing to deposit".into()));
        }
        self.balance += amount;
        Ok(self.balance)
    }

    #[distributed_lock(key = "acct:{self.id}", backend = "mm")]
    async fn shared(self: Arc<Self>) -> Result<u32, LockError> {
        Ok(self.id)
    }

    #[distributed_lock(key = "acct:{self.id}:{other}", backend = "mm")]
    async fn with_self_and_arg(&self, other: u32) -> Result<u32, LockError> {
        Ok(self.id + other)
    }
}

#[distributed_lock(key = "gen:{id}", backend = "mm")]
async fn generic<T, U: Display>(id: U, value: T) -> Result<T, LockError>
where
    T: Send + 'static,
{
    Ok(value)
}

#[distributed_lock(key = "impl:{id}", backend = "mm")]
async fn impl_trait(
    id: impl Display + Send,
    items: impl IntoIterator<Item = u32>,
) -> Result<impl Display, LockError> {
    let sum: u32 = items.into_iter().sum();
    Ok(format!("{id}={sum}"))
}

#[distributed_lock(key = "q:{id}", backend = "mm")]
async fn question_mark(
    id: u32,
    input: &str,
) -> Result<u32, Box<dyn std::error::Error + Send + Sync>> {
    let n: u32 = input.parse()?;
    Ok(n + id)
}

trait Store {
    async fn put(&self, key: u32) -> Result<u32, LockError>;
}

struct Db;

impl Store for Db {
    #[distributed_lock(key = "db:{key}", backend = "mm")]
    async fn put(&self, key: u32) -> Result<u32, LockError> {
        Ok(key)
    }
}

#[tracing::instrument]
#[distributed_lock(key = "traced:{id}", backend = "mm")]
async fn traced_above(id: u32) -> Result<u32, LockError> {
    tracing::info!("inside");
    Ok(id)
}

#[distributed_lock(key = "traced:{id}", backend = "mm")]
#[tracing::instrument(err)]
async fn traced_below(id: u32) -> Result<u32, LockError> {
    Ok(id)
}

#[tokio::test]
async fn methods_generics_traits_and_instrument() {
    dlock::register_arc("mm", Arc::new(MemoryBackend::new()));
    let mut acct = Account { id: 9, balance: 10 };
    assert_eq!(acct.balance().await.unwrap(), 10);
    assert_eq!(acct.deposit(5).await.unwrap(), 15);
    assert!(matches!(acct.deposit(0).await, Err(LockError::Config(_))));

    // `{self.id}` renders into the key: hold it by hand and the method is busy.
    let g = Lock::new("acct:9").backend("mm").acquire().await.unwrap();
    assert_eq!(acct.balance().await.unwrap_err().key(), Some("acct:9"));
    assert_eq!(acct.with_self_and_arg(1).await.unwrap(), 10);
    g.release().await.unwrap();

    let acct = Arc::new(acct);
    assert_eq!(acct.clone().shared().await.unwrap(), 9);

    assert_eq!(generic("a", vec![1u8]).await.unwrap(), vec![1u8]);
    assert_eq!(impl_trait("x", [1, 2, 3]).await.unwrap().to_string(), "x=6");
    assert_eq!(question_mark(1, "41").await.unwrap(), 42);
    assert!(question_mark(1, "nope").await.is_err());
    assert_eq!(Db.put(3).await.unwrap(), 3);
    assert_eq!(traced_above(4).await.unwrap(), 4);
    assert_eq!(traced_below(5).await.unwrap(), 5);
}

#[tokio::test]
async fn annotated_futures_are_send() {
    fn assert_send<T: Send>(_: &T) {}
    dlock::register_arc("mm", Arc::new(MemoryBackend::new()));
    let acct = Account { id: 1, balance: 0 };
    let f = acct.balance();
    assert_send(&f);
    let h = tokio::spawn(async move { Db.put(1).await });
    assert_eq!(h.await.unwrap().unwrap(), 1);
    f.await.unwrap();
}
