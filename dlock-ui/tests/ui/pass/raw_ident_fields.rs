// A field or parameter whose name is a keyword, written raw or plain in the template.
use dlock::{LockError, distributed_lock};

struct Doc {
    r#type: u32,
}

#[distributed_lock(key = "doc:{d.r#type}")]
async fn by_field(d: Doc) -> Result<u32, LockError> {
    Ok(d.r#type)
}

#[distributed_lock(key = "doc:{d.type}")]
async fn by_plain_field(d: Doc) -> Result<u32, LockError> {
    Ok(d.r#type)
}

#[distributed_lock(key = "t:{r#type}")]
async fn by_param(r#type: u32) -> Result<u32, LockError> {
    Ok(r#type)
}

fn main() {
    let _ = (by_field, by_plain_field, by_param);
    let r#type = 7u32;
    let d = Doc { r#type: 8 };
    assert_eq!(dlock::key!("t:{r#type}:{d.r#type}"), "t:7:8");
    assert_eq!(dlock::key!("t:{type}:{d.type}"), "t:7:8");
}
