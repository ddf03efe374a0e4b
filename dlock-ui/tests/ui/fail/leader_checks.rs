use dlock::LockError;

// Not async.
#[dlock::leader(name = "a")]
fn not_async() -> Result<(), LockError> {
    Ok(())
}

// A distributed_lock option, and a misspelt one.
#[dlock::leader(key = "b", tll = "10s")]
async fn wrong_options() -> Result<(), LockError> {
    Ok(())
}

// No name.
#[dlock::leader(ttl = "10s")]
async fn no_name() -> Result<(), LockError> {
    Ok(())
}

// A placeholder that names no parameter, and a zero ttl.
#[dlock::leader(name = "shard:{shrd}", ttl = "0s")]
async fn bad_template(shard: u32) -> Result<(), LockError> {
    let _ = shard;
    Ok(())
}

// A return type that cannot carry the lost term.
#[dlock::leader(name = "c")]
async fn unit() {}

fn main() {}
