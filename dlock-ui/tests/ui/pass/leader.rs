// #[dlock::leader]: a template name, every option, a Result with a From<LockError> error, and
// the epoch through dlock::fencing_token() inside the body.
use dlock::LockError;

#[derive(Debug)]
struct AppError;

impl From<LockError> for AppError {
    fn from(_: LockError) -> Self {
        AppError
    }
}

#[dlock::leader(name = "shard:{shard}", ttl = "2s", wait = "1s", backend = "default", value = "10.0.0.7:8080")]
async fn lead(shard: u32) -> Result<u64, AppError> {
    Ok(dlock::fencing_token().expect("leading"))
}

#[dlock::leader(name = "scheduler")]
async fn simple() -> Result<(), LockError> {
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    dlock::init("memory://").await.unwrap();
    let epoch = lead(3).await.unwrap();
    assert!(epoch > 0);
    simple().await.unwrap();
    let again = lead(3).await.unwrap();
    assert!(again > epoch, "a later term has a larger epoch");
}
