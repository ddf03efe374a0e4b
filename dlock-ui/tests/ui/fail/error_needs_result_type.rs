use dlock::distributed_lock;

// on_busy = "error" gives the busy error back through the return type: a `u32` has no room for it.
#[distributed_lock(key = "job", on_busy = "error")]
async fn count() -> u32 {
    1
}

// The default on_busy is "error" too.
#[distributed_lock(key = "job")]
async fn name() -> String {
    String::new()
}

fn main() {}
