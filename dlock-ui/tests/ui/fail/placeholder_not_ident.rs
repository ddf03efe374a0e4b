use dlock::{LockError, distributed_lock};

struct Doc {
    b: u32,
}

// `²` is alphanumeric but not an identifier character (this panicked the macro).
#[distributed_lock(key = "doc:{d.b²}")]
async fn f(d: Doc) -> Result<u32, LockError> {
    Ok(d.b)
}

fn main() {}
