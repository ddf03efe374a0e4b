//! `dlock::web::LockLayer` on an axum route: every request to `/accounts/{id}/settle` runs under
//! the lock `account:{id}`, the handler reads the fencing token from the request's extensions,
//! and a request for an account that is being settled waits up to 200 ms, then answers
//! `423 Locked` with `Retry-After`.
//!
//! ```text
//! cargo run -p dlock-examples --features axum --example axum_layer            # self-demo, then exits
//! cargo run -p dlock-examples --features axum --example axum_layer -- serve   # serve on 127.0.0.1:3000
//! DLOCK_URL=redis://127.0.0.1:6379 cargo run -p dlock-examples --features axum --example axum_layer
//! ```

use std::time::Duration;

use axum::Router;
use axum::extract::{Extension, Path};
use axum::http::StatusCode;
use axum::routing::post;
use dlock::web::{FencingToken, LockLayer, path_key};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

async fn settle(
    Path(id): Path<u64>,
    Extension(FencingToken(token)): Extension<FencingToken>,
) -> String {
    // Stand-in for the real work; a write to a store would carry `token`.
    tokio::time::sleep(Duration::from_millis(300)).await;
    format!("account {id} settled (fencing token {token})\n")
}

fn app() -> Result<Router, dlock::LockError> {
    const ROUTE: &str = "/accounts/{id}/settle";
    let layer = LockLayer::new(path_key(ROUTE, "account:{id}")?)
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_millis(200))
        .busy_status(StatusCode::LOCKED)
        .metric_name(ROUTE);
    Ok(Router::new().route(ROUTE, post(settle)).route_layer(layer))
}

async fn post_status(addr: std::net::SocketAddr, path: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr).await?;
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).await?;
    let status = raw.lines().next().unwrap_or_default().to_string();
    let retry = raw
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("retry-after"))
        .map(|l| format!(", {l}"))
        .unwrap_or_default();
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.trim())
        .unwrap_or_default();
    Ok(format!("{status}{retry}  {body}"))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os(dlock::URL_ENV).is_some() {
        dlock::init_from_env().await?;
        println!("backend: the store DLOCK_URL names");
    } else {
        dlock::init("memory://").await?;
        println!("backend: in-memory (set DLOCK_URL, e.g. redis://127.0.0.1:6379, to share locks)");
    }
    if std::env::args().nth(1).as_deref() == Some("serve") {
        let listener = TcpListener::bind("127.0.0.1:3000").await?;
        println!("try: curl -i -X POST http://127.0.0.1:3000/accounts/1/settle");
        axum::serve(listener, app()?).await?;
        return Ok(());
    }
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = app()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    // Two requests for account 1 at once (the second waits 200 ms, then gives up), one for 2.
    let (a, b, c) = tokio::join!(
        post_status(addr, "/accounts/1/settle"),
        async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            post_status(addr, "/accounts/1/settle").await
        },
        post_status(addr, "/accounts/2/settle"),
    );
    println!("account 1, first:  {}", a?);
    println!("account 1, second: {}", b?);
    println!("account 2:         {}", c?);
    Ok(())
}
