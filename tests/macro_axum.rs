//! The `axum_handler` example over real HTTP on loopback: a free order answers 200, an order
//! whose lock is held answers 409 with `Retry-After`: the holder's remaining lease capped at 1 s
//! by default (a handler that takes milliseconds frees the lock long before a 20 s lease ends).

#[allow(dead_code, unreachable_pub)]
#[path = "../dlock-examples/examples/axum_handler.rs"]
mod example;

use std::time::Duration;

use tokio::net::TcpListener;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_order_answers_409_with_retry_after() {
    let addr = example::spawn_server(TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap();

    let ok = example::post_request(addr, "/orders/1001/pay")
        .await
        .unwrap();
    assert_eq!(ok.status, 200, "{ok:?}");
    assert!(ok.body.starts_with("order 1001 paid"), "{ok:?}");

    // Someone else is working on order 1001 with a 20 s lease.
    let held = dlock::Lock::new("order:1001")
        .ttl(Duration::from_secs(20))
        .watchdog(false)
        .acquire()
        .await
        .unwrap();
    let busy = example::post_request(addr, "/orders/1001/pay")
        .await
        .unwrap();
    assert_eq!(busy.status, 409, "{busy:?}");
    let retry: u64 = busy
        .header("retry-after")
        .expect("Retry-After header")
        .parse()
        .unwrap();
    assert_eq!(
        retry, 1,
        "Retry-After {retry}: the default caps the 20 s lease at 1 s"
    );

    // Other orders are not affected, and the order is free again after the release.
    assert_eq!(
        example::post_request(addr, "/orders/1002/pay")
            .await
            .unwrap()
            .status,
        200
    );
    held.release().await.unwrap();
    assert_eq!(
        example::post_request(addr, "/orders/1001/pay")
            .await
            .unwrap()
            .status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_for_one_order_never_overlap() {
    let addr = example::spawn_server(TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap();
    let replies =
        futures_join_all((0..8).map(|_| example::post_request(addr, "/orders/2001/pay"))).await;
    let ok = replies.iter().filter(|r| r.status == 200).count();
    let conflict = replies.iter().filter(|r| r.status == 409).count();
    assert!(ok >= 1, "{replies:?}");
    assert_eq!(ok + conflict, 8, "{replies:?}");
}

async fn futures_join_all<F>(futs: impl Iterator<Item = F>) -> Vec<example::Reply>
where
    F: std::future::Future<Output = std::io::Result<example::Reply>> + Send + 'static,
{
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap().unwrap());
    }
    out
}
