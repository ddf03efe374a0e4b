//! An axum 0.8 app whose handler locks per order with `#[distributed_lock]`: a second request
//! for an order that is being processed answers `409 Conflict` with `Retry-After` (the
//! holder's remaining lease, in whole seconds). The handler returns `dlock::LockError` itself:
//! with the `axum` feature it is an axum response (see `dlock::web`).
//!
//! ```text
//! cargo run -p dlock-examples --features axum --example axum_handler            # self-demo: 200, 409, then exits
//! cargo run -p dlock-examples --features axum --example axum_handler -- serve   # serve on 127.0.0.1:3000
//! DLOCK_URL=redis://127.0.0.1:6379 cargo run -p dlock-examples --features axum --example axum_handler
//! ```
//!
//! With nothing configured the locks live in this process (the in-memory backend); with
//! `DLOCK_URL` set they are shared by every instance of the app through Redis.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::Path;
use axum::routing::post;
use dlock::{LockError, distributed_lock};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Pays an order. Two requests for the same order never run this body at the same time, in
/// this process or (with Redis) in any other instance.
#[distributed_lock(key = "order:{order_id}", ttl = "10s")]
pub async fn pay(Path(order_id): Path<u64>) -> Result<String, LockError> {
    // Stand-in for the real work (a payment call, a database transaction).
    tokio::time::sleep(Duration::from_millis(20)).await;
    let token = dlock::fencing_token().unwrap_or_default();
    Ok(format!("order {order_id} paid (fencing token {token})\n"))
}

/// The app's routes.
pub fn app() -> Router {
    Router::new().route("/orders/{order_id}/pay", post(pay))
}

/// Serves `app()` on `listener` in a background task; returns the bound address.
pub fn spawn_server(listener: TcpListener) -> std::io::Result<SocketAddr> {
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app()).await {
            eprintln!("server stopped: {e}");
        }
    });
    Ok(addr)
}

/// A reply as the hand-written client below reads it.
#[derive(Debug)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// Header names (lowercased) and values.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: String,
}

impl Reply {
    /// The first header named `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `POST path` over a fresh HTTP/1.1 connection (no client library needed for a demo).
pub async fn post_request(addr: SocketAddr, path: &str) -> std::io::Result<Reply> {
    let mut s = TcpStream::connect(addr).await?;
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP reply: {head:?}")))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok(Reply {
        status,
        headers,
        body: body.to_string(),
    })
}

#[allow(dead_code)] // the test includes this file and has its own entry point
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
        println!(
            "serving on http://127.0.0.1:3000 ; try: curl -i -X POST http://127.0.0.1:3000/orders/42/pay"
        );
        axum::serve(listener, app()).await?;
        return Ok(());
    }

    let addr = spawn_server(TcpListener::bind("127.0.0.1:0").await?)?;
    println!("listening on {addr}");
    let free = post_request(addr, "/orders/7/pay").await?;
    println!("order 7, free:  {} {}", free.status, free.body.trim());

    // Another worker is processing order 7: hold its lock by hand, as that worker would.
    let held = dlock::Lock::new("order:7")
        .ttl(Duration::from_secs(5))
        .acquire()
        .await?;
    let busy = post_request(addr, "/orders/7/pay").await?;
    println!(
        "order 7, busy:  {} Retry-After: {} ({})",
        busy.status,
        busy.header("retry-after").unwrap_or("-"),
        busy.body.trim()
    );
    let other = post_request(addr, "/orders/8/pay").await?;
    println!("order 8, free:  {} {}", other.status, other.body.trim());
    held.release().await?;
    Ok(())
}
