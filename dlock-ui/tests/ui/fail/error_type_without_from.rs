use dlock::distributed_lock;

#[derive(Debug)]
struct MyError;

#[distributed_lock(key = "k")]
async fn f() -> Result<(), MyError> {
    Ok(())
}

fn main() {}
