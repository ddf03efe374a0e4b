//! The `axum` feature over real HTTP on loopback: `LockLayer` on axum routes and on a plain tower
//! service, `IntoResponse for LockError`, `Retry-After`, and a client that disconnects mid-request.
#![cfg(feature = "axum")]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Extension, Path};
use axum::http::{Request, Response, StatusCode};
use axum::routing::{get, post};
use axum::{Router, ServiceExt};
use dlock::web::{FencingToken, LockLayer, RetryAfter, header_key, path_key};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::Layer;

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

async fn request(addr: SocketAddr, method: &str, path: &str, headers: &str) -> Reply {
    let fut = async {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Content-Length: 0\r\nConnection: close\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.unwrap();
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP reply: {head:?}"));
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        Reply {
            status,
            headers,
            body: body.to_string(),
        }
    };
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .expect("request hung")
}

async fn serve(app: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// Tracks how many handlers run at once, overall maximum included.
#[derive(Default)]
struct Gauge {
    now: AtomicUsize,
    max: AtomicUsize,
}

impl Gauge {
    async fn hold_for(&self, d: Duration) {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(n, Ordering::SeqCst);
        tokio::time::sleep(d).await;
        self.now.fetch_sub(1, Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn same_key_requests_never_overlap_different_keys_do() {
    let gauge = Arc::new(Gauge::default());
    let g = gauge.clone();
    let app = Router::new()
        .route(
            "/items/{id}",
            post(move |Path(id): Path<String>| {
                let g = g.clone();
                async move {
                    g.hold_for(Duration::from_millis(50)).await;
                    id
                }
            }),
        )
        .route_layer(
            LockLayer::new(path_key("/items/{id}", "web-item:{id}").unwrap())
                .wait(Duration::from_secs(10)),
        );
    let addr = serve(app).await;

    // Eight requests for one item: all served (they wait), one at a time.
    let replies = join_all(
        (0..8).map(move |_| async move { request(addr, "POST", "/items/same", "").await }),
    )
    .await;
    assert!(replies.iter().all(|r| r.status == 200), "{replies:?}");
    assert_eq!(gauge.max.load(Ordering::SeqCst), 1, "same key overlapped");

    // Eight requests for eight items: they run at the same time.
    gauge.max.store(0, Ordering::SeqCst);
    let replies = join_all(
        (0..8)
            .map(move |i| async move { request(addr, "POST", &format!("/items/k{i}"), "").await }),
    )
    .await;
    assert!(replies.iter().all(|r| r.status == 200), "{replies:?}");
    assert!(
        gauge.max.load(Ordering::SeqCst) >= 2,
        "different keys did not run concurrently"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_key_answers_409_with_retry_after_and_423_when_configured() {
    let handler = || async { "done" };
    let app = Router::new()
        .route("/a/{id}", post(handler))
        .route_layer(LockLayer::new(
            path_key("/a/{id}", "web-busy:{id}").unwrap(),
        ))
        .merge(
            Router::new().route("/b/{id}", post(handler)).route_layer(
                LockLayer::new(path_key("/b/{id}", "web-busy:{id}").unwrap())
                    .busy_status(StatusCode::LOCKED)
                    .retry_after(RetryAfter::Lease),
            ),
        );
    let addr = serve(app).await;
    assert_eq!(request(addr, "POST", "/a/1", "").await.status, 200);

    let held = dlock::Lock::new("web-busy:1")
        .ttl(Duration::from_millis(2500))
        .watchdog(false)
        .acquire()
        .await
        .unwrap();
    let busy = request(addr, "POST", "/a/1", "").await;
    assert_eq!(busy.status, 409, "{busy:?}");
    // By default the holder's 2.5 s lease is capped at 1 s: a client can act on that.
    assert_eq!(busy.header("retry-after"), Some("1"), "{busy:?}");
    let locked = request(addr, "POST", "/b/1", "").await;
    assert_eq!(locked.status, 423, "{locked:?}");
    // `RetryAfter::Lease`: 2.5 s remaining (a little less by now), rounded up to 3 whole seconds.
    assert_eq!(locked.header("retry-after"), Some("3"), "{locked:?}");
    // Another key is not affected.
    assert_eq!(request(addr, "POST", "/a/2", "").await.status, 200);
    held.release().await.unwrap();
    assert_eq!(request(addr, "POST", "/a/1", "").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_request_releases_the_lock() {
    let started = Arc::new(tokio::sync::Notify::new());
    let dropped = Arc::new(AtomicBool::new(false));
    let (s, d) = (started.clone(), dropped.clone());
    struct SetOnDrop(Arc<AtomicBool>);
    impl Drop for SetOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let app = Router::new()
        .route(
            "/slow/{id}",
            post(move || {
                let (s, d) = (s.clone(), d.clone());
                async move {
                    let _flag = SetOnDrop(d);
                    s.notify_one();
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    "never"
                }
            }),
        )
        .route_layer(
            LockLayer::new(path_key("/slow/{id}", "web-slow:{id}").unwrap())
                .ttl(Duration::from_secs(60)),
        );
    let addr = serve(app).await;

    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"POST /slow/1 HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), started.notified())
        .await
        .expect("handler did not start");
    // The lock is held while the request runs...
    let busy = dlock::Lock::new("web-slow:1").acquire().await.unwrap_err();
    assert!(busy.is_contended(), "{busy}");
    // ...and the client goes away.
    drop(s);
    // The 60 s lease frees long before it runs out: the response future was dropped.
    let g = dlock::Lock::new("web-slow:1")
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("lock not released after the client disconnected");
    assert!(dropped.load(Ordering::SeqCst), "handler future not dropped");
    g.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_token_is_in_extensions_and_in_scope() {
    let app = Router::new()
        .route(
            "/t/{id}",
            get(
                |Extension(FencingToken(t)): Extension<FencingToken>| async move {
                    format!("{t} {}", dlock::fencing_token().unwrap_or(0))
                },
            ),
        )
        .route_layer(LockLayer::new(
            path_key("/t/{id}", "web-token:{id}").unwrap(),
        ));
    let addr = serve(app).await;
    let r1 = request(addr, "GET", "/t/1", "").await;
    assert_eq!(r1.status, 200, "{r1:?}");
    let (ext, scoped) = r1.body.split_once(' ').unwrap();
    assert_eq!(ext, scoped);
    let t1: u64 = ext.parse().unwrap();
    assert!(t1 > 0);
    let r2 = request(addr, "GET", "/t/1", "").await;
    let t2: u64 = r2.body.split_once(' ').unwrap().0.parse().unwrap();
    assert!(t2 > t1, "tokens must increase: {t1} then {t2}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_tower_service_with_header_key_and_closure_key() {
    let inner = tower::service_fn(|req: Request<Body>| async move {
        let token = req.extensions().get::<FencingToken>().map(|t| t.0);
        Ok::<_, Infallible>(Response::new(Body::from(format!("{token:?}"))))
    });
    let svc = LockLayer::new(header_key("x-tenant", "web-tenant:").unwrap()).layer(inner);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, svc.into_make_service())
            .await
            .unwrap()
    });
    let ok = request(addr, "GET", "/", "x-tenant: acme\r\n").await;
    assert_eq!(ok.status, 200, "{ok:?}");
    assert!(ok.body.starts_with("Some("), "{ok:?}");
    // No header, no key: 400 that says why, the inner service is not called.
    let no_key = request(addr, "GET", "/", "").await;
    assert_eq!(no_key.status, 400, "{no_key:?}");
    assert_eq!(
        no_key.header("x-dlock-error"),
        Some("no-lock-key"),
        "{no_key:?}"
    );
    let held = dlock::Lock::new("web-tenant:acme").acquire().await.unwrap();
    assert_eq!(
        request(addr, "GET", "/", "x-tenant: acme\r\n").await.status,
        409
    );
    held.release().await.unwrap();

    // A closure as the key extractor.
    let inner = tower::service_fn(|_req: Request<Body>| async move {
        Ok::<_, Infallible>(Response::new(Body::from("ok")))
    });
    let by_query = |req: &Request<Body>| req.uri().query().map(|q| format!("web-q:{q}"));
    let svc = LockLayer::new(by_query).layer(inner);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, svc.into_make_service())
            .await
            .unwrap()
    });
    let held = dlock::Lock::new("web-q:x").acquire().await.unwrap();
    assert_eq!(request(addr, "GET", "/?x", "").await.status, 409);
    assert_eq!(request(addr, "GET", "/?y", "").await.status, 200);
    held.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_error_is_an_axum_response_without_internals() {
    #[dlock::distributed_lock(key = "web-handler:{id}", ttl = "20s")]
    async fn handler(Path(id): Path<u64>) -> Result<String, dlock::LockError> {
        Ok(format!("{id}"))
    }
    async fn broken() -> Result<String, dlock::LockError> {
        let _guard = dlock::Lock::new("web-broken")
            .backend("no-such-backend")
            .acquire()
            .await?;
        Ok(String::new())
    }
    let app = Router::new()
        .route("/h/{id}", post(handler))
        .route("/broken", post(broken));
    let addr = serve(app).await;
    assert_eq!(request(addr, "POST", "/h/1", "").await.status, 200);
    let held = dlock::Lock::new("web-handler:1")
        .ttl(Duration::from_secs(20))
        .acquire()
        .await
        .unwrap();
    let busy = request(addr, "POST", "/h/1", "").await;
    assert_eq!(busy.status, 409, "{busy:?}");
    let retry: u64 = busy.header("retry-after").unwrap().parse().unwrap();
    assert_eq!(
        retry, 1,
        "Retry-After {retry}: the 20 s lease capped at 1 s by default"
    );
    assert!(!busy.body.contains("web-handler"), "key leaked: {busy:?}");
    held.release().await.unwrap();

    let broken = request(addr, "POST", "/broken", "").await;
    assert_eq!(broken.status, 500, "{broken:?}");
    assert!(!broken.body.contains("no-such-backend"), "{broken:?}");

    // A backend that does not answer: 503, and neither the URL nor the password is shown.
    let down = dlock::RedisBackend::builder("redis://u:hunter2@127.0.0.1:1")
        .connection_timeout(Duration::from_millis(200))
        .reconnect_retries(0)
        .build()
        .unwrap();
    dlock::register("web-down", down);
    let app = Router::new()
        .route("/d/{id}", post(|| async { "up" }))
        .route_layer(
            LockLayer::new(path_key("/d/{id}", "web-down:{id}").unwrap()).backend("web-down"),
        );
    let addr = serve(app).await;
    let down = request(addr, "POST", "/d/1", "").await;
    assert_eq!(down.status, 503, "{down:?}");
    assert!(down.header("retry-after").is_none(), "{down:?}");
    assert!(
        !down.body.contains("hunter2") && !down.body.contains("127.0.0.1"),
        "{down:?}"
    );
}

async fn join_all<F>(futs: impl Iterator<Item = F>) -> Vec<Reply>
where
    F: std::future::Future<Output = Reply> + Send + 'static,
{
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

/// The memory backend with two faults to choose: renewals that always find another owner (the
/// lease is lost at the first renewal), and releases that answer only after `release_delay` (a
/// stalled server).
#[derive(Debug, Default)]
struct Faulty {
    inner: dlock::MemoryBackend,
    lose_on_renewal: bool,
    release_delay: Duration,
}

impl dlock::Backend for Faulty {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> dlock::backend::BoxFuture<'a, Result<dlock::backend::Acquired, dlock::LockError>> {
        self.inner.try_acquire(name, owner, ttl)
    }
    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> dlock::backend::BoxFuture<'a, Result<dlock::backend::Released, dlock::LockError>> {
        Box::pin(async move {
            tokio::time::sleep(self.release_delay).await;
            self.inner.release(name, owner, keep_for, all).await
        })
    }
    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> dlock::backend::BoxFuture<'a, Result<dlock::backend::Extended, dlock::LockError>> {
        if self.lose_on_renewal {
            return Box::pin(async { Ok(dlock::backend::Extended::Lost) });
        }
        self.inner.extend(name, owner, ttl)
    }
    fn watch<'a>(
        &'a self,
        name: &'a str,
    ) -> dlock::backend::BoxFuture<'a, Result<dlock::backend::Watch, dlock::LockError>> {
        self.inner.watch(name)
    }
    fn has_waiters(&self, name: &str) -> bool {
        self.inner.has_waiters(name)
    }
}

/// Review (surfaces, nits): the layer awaited the release before returning a response it had
/// already computed, so a stalled backend delayed every successful response by the release's
/// bound. The response now goes out at once and the guard gives the lock back in the background.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_release_does_not_delay_the_response() {
    dlock::register(
        "web-slow-release",
        Faulty {
            release_delay: Duration::from_secs(5),
            ..Faulty::default()
        },
    );
    let app = Router::new()
        .route("/s/{id}", post(|| async { "done" }))
        .route_layer(
            LockLayer::new(path_key("/s/{id}", "web-slow:{id}").unwrap())
                .backend("web-slow-release")
                .ttl(Duration::from_secs(30)),
        );
    let addr = serve(app).await;
    let t = std::time::Instant::now();
    let r = request(addr, "POST", "/s/1", "").await;
    let took = t.elapsed();
    assert_eq!(r.status, 200, "{r:?}");
    assert!(
        took < Duration::from_secs(2),
        "the response waited {took:?} for a release that takes 5 s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_lost_mid_request_answers_503_and_drops_the_handler() {
    dlock::register(
        "web-loses",
        Faulty {
            lose_on_renewal: true,
            ..Faulty::default()
        },
    );
    let dropped = Arc::new(AtomicBool::new(false));
    let d = dropped.clone();
    struct SetOnDrop(Arc<AtomicBool>);
    impl Drop for SetOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let app = Router::new()
        .route(
            "/l/{id}",
            post(move || {
                let d = d.clone();
                async move {
                    let _flag = SetOnDrop(d);
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    "never"
                }
            }),
        )
        .route_layer(
            LockLayer::new(path_key("/l/{id}", "web-lost:{id}").unwrap())
                .backend("web-loses")
                .ttl(Duration::from_millis(300)),
        );
    let addr = serve(app).await;
    let r = request(addr, "POST", "/l/1", "").await;
    assert_eq!(r.status, 503, "{r:?}");
    assert!(!r.body.contains("web-lost"), "{r:?}");
    assert!(
        dropped.load(Ordering::SeqCst),
        "handler future still running"
    );
}
