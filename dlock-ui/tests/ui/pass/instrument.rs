use dlock::{LockError, distributed_lock};

#[tracing::instrument]
#[distributed_lock(key = "t:{id}")]
async fn above(id: u32) -> Result<u32, LockError> {
    Ok(id)
}

#[distributed_lock(key = "t:{id}")]
#[tracing::instrument(err, skip(payload))]
async fn below(id: u32, payload: Vec<u8>) -> Result<usize, LockError> {
    Ok(payload.len() + id as usize)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    assert_eq!(above(1).await.unwrap(), 1);
    assert_eq!(below(1, vec![0]).await.unwrap(), 2);
}
