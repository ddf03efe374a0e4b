use std::fmt::Display;

use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "it:{id}")]
async fn args(id: impl Display, it: impl IntoIterator<Item = u8>) -> Result<u32, LockError> {
    Ok(it.into_iter().map(u32::from).sum())
}

#[distributed_lock(key = "it:{id}")]
async fn ret(id: u8) -> Result<impl Display, LockError> {
    Ok(id)
}

#[distributed_lock(key = "it:{id}", on_busy = "skip")]
async fn opt(id: u8) -> Option<impl Display> {
    Some(id)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    assert_eq!(args("a", [1, 2]).await.unwrap(), 3);
    assert_eq!(ret(4).await.unwrap().to_string(), "4");
    assert_eq!(opt(5).await.unwrap().to_string(), "5");
}
