use std::fmt::Display;

use dlock::{LockError, distributed_lock};

/// Docs, attributes and visibility stay as written.
#[distributed_lock(key = "gen:{id}")]
#[must_use = "it is a future"]
pub async fn generic<'a, T, K: Display>(id: K, items: &'a [T]) -> Result<&'a T, LockError>
where
    T: Sync,
{
    Ok(&items[0])
}

#[distributed_lock(key = "c:{N}")]
async fn with_const<const N: usize>(arr: [u8; N]) -> Result<usize, LockError> {
    Ok(arr.len())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    assert_eq!(*generic(1, &[5, 6]).await.unwrap(), 5);
    assert_eq!(with_const([0; 3]).await.unwrap(), 3);
}
