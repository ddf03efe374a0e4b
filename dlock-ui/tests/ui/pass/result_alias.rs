use dlock::{LockError, distributed_lock};

#[derive(Debug)]
struct AppError(LockError);

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError(e)
    }
}

/// An alias of a `Result` is a `Result`: on_busy = "error" (the default) accepts it.
type AppResult<T> = Result<T, AppError>;

#[distributed_lock(key = "alias:{id}")]
async fn by_alias(id: u64) -> AppResult<u64> {
    Ok(id)
}

/// A busy lock comes back through the alias's error type.
#[distributed_lock(key = "alias-held")]
async fn busy() -> AppResult<()> {
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    assert_eq!(by_alias(7).await.unwrap(), 7);
    let _held = dlock::Lock::new("alias-held").acquire().await.unwrap();
    let AppError(e) = busy().await.unwrap_err();
    assert!(e.is_contended(), "{e:?}");
}
