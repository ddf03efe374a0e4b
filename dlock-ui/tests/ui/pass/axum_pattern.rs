use dlock::{LockError, distributed_lock};

struct Path<T>(T);
struct State<T>(T);
struct Ctx {
    tenant: &'static str,
}
struct Body {
    user: User,
}
struct User {
    id: u64,
}

#[distributed_lock(key = "{tenant}:order:{order_id}:{body.user.id}")]
async fn handler(
    Path(order_id): Path<u64>,
    State(Ctx { tenant }): State<Ctx>,
    body: Body,
) -> Result<String, LockError> {
    Ok(format!("{tenant}/{order_id}/{}", body.user.id))
}

#[distributed_lock(key = "pair:{a}/{b}")]
async fn tuple((a, b): (u8, u8), _unused: ()) -> Result<u8, LockError> {
    Ok(a + b)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let r = handler(Path(7), State(Ctx { tenant: "t" }), Body { user: User { id: 3 } }).await;
    assert_eq!(r.unwrap(), "t/7/3");
    assert_eq!(tuple((1, 2), ()).await.unwrap(), 3);
}
