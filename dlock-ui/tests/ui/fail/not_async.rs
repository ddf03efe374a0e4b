use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "k")]
fn f() -> Result<(), LockError> {
    Ok(())
}

fn main() {
    // The function is still emitted: this call compiles, only the macro error shows.
    let _ = f();
}
