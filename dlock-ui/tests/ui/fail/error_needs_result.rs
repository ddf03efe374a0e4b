use dlock::distributed_lock;

// on_busy defaults to "error", which needs a Result to put the error in.
#[distributed_lock(key = "job")]
async fn nightly() {}

fn main() {}
