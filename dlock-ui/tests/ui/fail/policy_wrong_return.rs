use dlock::distributed_lock;

// With a policy and no on_busy the return type decides; a `u32` can neither carry the error nor
// be skipped.
#[distributed_lock(key = "job", policy = "jobs")]
async fn count() -> u32 {
    1
}

fn main() {}
