//! G6 (RELIABILITY.md §4.2, §7 G6): `rediss://` against a loopback `redis-server --tls-port`
//! with a CA and server certificate generated per run (rcgen), feature `tls` only
//! (`cargo test --all-features`).
//!
//! * The right CA (`RedisBackendBuilder::tls_root_cert`) works: acquire/release, and a waiter is
//!   handed the lock promptly on release (pub/sub over TLS too), by IP and by `localhost`.
//! * A wrong CA, or none (system store), is a typed `LockError`, never a panic or a hang.
//! * `#insecure` gives exactly one `warn` event; the connect is then either working or a typed
//!   error (redis-rs only honours `#insecure` with its `tls-rustls-insecure` feature).
//!
//! The server keeps a plain loopback port too: the harness uses it to see the server is up.
#![cfg(feature = "tls")]

mod common;

use std::fmt::Write as _;
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::RedisProc;
use common::tls::{ServerCerts, new_ca};
use dlock::{Backend, Lock, LockError, RedisBackend};

/// A TLS redis-server and the PEM of the CA that signed its certificate.
struct TlsServer {
    server: RedisProc,
    tls_port: u16,
    ca_pem: Vec<u8>,
    _certs: ServerCerts,
}

impl TlsServer {
    fn start() -> TlsServer {
        let certs = ServerCerts::new();
        let tls_port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut args = vec!["--tls-port".to_string(), tls_port.to_string()];
        args.extend(certs.redis_args());
        let server = RedisProc::start_with(&args.iter().map(String::as_str).collect::<Vec<_>>());
        TlsServer {
            server,
            tls_port,
            ca_pem: certs.ca_pem.clone(),
            _certs: certs,
        }
    }

    fn url(&self, host: &str) -> String {
        format!("rediss://{host}:{}", self.tls_port)
    }
}

async fn start() -> TlsServer {
    tokio::task::spawn_blocking(TlsServer::start)
        .await
        .expect("start a TLS redis-server")
}

async fn connect_with(url: &str, ca: Option<&[u8]>) -> Result<RedisBackend, LockError> {
    let mut b = RedisBackend::builder(url).connection_timeout(Duration::from_secs(2));
    if let Some(pem) = ca {
        b = b.tls_root_cert(pem.to_vec());
    }
    tokio::time::timeout(Duration::from_secs(10), b.connect())
        .await
        .expect("a TLS connect hangs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn right_ca_locks_and_hands_off_over_tls() {
    let tls = start().await;
    for host in ["127.0.0.1", "localhost"] {
        let url = tls.url(host);
        let a: Arc<dyn Backend> = Arc::new(
            connect_with(&url, Some(&tls.ca_pem))
                .await
                .unwrap_or_else(|e| panic!("{url} with the right CA: {e}")),
        );
        let b: Arc<dyn Backend> = Arc::new(connect_with(&url, Some(&tls.ca_pem)).await.unwrap());
        let name = format!("tls-{host}");
        let g = Lock::new(name.clone())
            .with_backend(a.clone())
            .ttl(Duration::from_secs(10))
            .acquire()
            .await
            .unwrap();
        assert!(g.fencing_token() > 0);
        let busy = Lock::new(name.clone())
            .with_backend(b.clone())
            .acquire()
            .await
            .unwrap_err();
        assert!(matches!(busy, LockError::Busy { .. }), "{busy:?}");
        let waiter = {
            let l = Lock::new(name.clone())
                .with_backend(b.clone())
                .wait(Duration::from_secs(5));
            tokio::spawn(async move {
                let r = l.acquire().await;
                (Instant::now(), r)
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiter.is_finished(), "the waiter got a held lock");
        let released = Instant::now();
        g.release().await.unwrap();
        let (at, r) = waiter.await.unwrap();
        let g2 = r.expect("the waiter acquires after the release");
        let handoff = at - released;
        assert!(
            handoff < Duration::from_millis(500),
            "hand-off over TLS took {handoff:?} (missed pub/sub wake-up?)"
        );
        g2.release().await.unwrap();
    }
    // The same server's plain port is not what answered: the keys are there either way, but
    // the TLS port refuses plain RESP.
    let plain = format!("redis://127.0.0.1:{}", tls.tls_port);
    let e = connect_with(&plain, None).await.unwrap_err();
    assert!(e.is_backend(), "{e:?}");
    drop(tls.server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_or_missing_ca_is_a_typed_error() {
    let tls = start().await;
    let other = new_ca("some other CA").pem().into_bytes();
    for (what, ca) in [
        ("a wrong CA", Some(other.as_slice())),
        ("the system store", None),
    ] {
        let t0 = Instant::now();
        let r = connect_with(&tls.url("127.0.0.1"), ca).await;
        let e = match r {
            Ok(_) => panic!("connected to a server signed by a private CA with {what}"),
            Err(e) => e,
        };
        assert!(
            matches!(e, LockError::Backend { .. } | LockError::Config(_)),
            "{what}: untyped error {e:?}"
        );
        let msg = e.to_string().to_lowercase();
        assert!(
            msg.contains("certificate") || msg.contains("unknownissuer") || msg.contains("tls"),
            "{what}: the error does not say the certificate was refused: {e}"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{what}: {:?}",
            t0.elapsed()
        );
    }
    // A lazily built backend fails the same way at the first acquire.
    let lazy = RedisBackend::builder(tls.url("127.0.0.1"))
        .tls_root_cert(other)
        .build()
        .unwrap();
    let e = Lock::new("x")
        .with_backend(Arc::new(lazy))
        .acquire()
        .await
        .unwrap_err();
    assert!(e.is_backend(), "{e:?}");
}

/// Every WARN event: target and fields.
#[derive(Clone, Default)]
struct Warns(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warns {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if *event.metadata().level() != tracing::Level::WARN {
            return;
        }
        struct V(String);
        impl tracing::field::Visit for V {
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                let _ = write!(self.0, "{}={:?} ", f.name(), v);
            }
        }
        let mut v = V(format!("{}: ", event.metadata().target()));
        event.record(&mut v);
        self.0.lock().unwrap().push(v.0);
    }
}

#[test]
fn insecure_fragment_gives_exactly_one_warning() {
    use tracing_subscriber::layer::SubscriberExt;
    let tls = TlsServer::start();
    let warns = Warns::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(warns.clone()));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let outcome = rt.block_on(async {
        // Control: the right CA and no fragment warn about nothing.
        let ok = connect_with(&tls.url("127.0.0.1"), Some(&tls.ca_pem)).await;
        assert!(ok.is_ok(), "{ok:?}");
        assert!(
            warns.0.lock().unwrap().is_empty(),
            "{:?}",
            warns.0.lock().unwrap()
        );
        let url = format!("{}/#insecure", tls.url("127.0.0.1"));
        match connect_with(&url, None).await {
            Ok(b) => {
                let g = Lock::new("insecure")
                    .with_backend(Arc::new(b))
                    .acquire()
                    .await
                    .expect("an insecure connection that connected also locks");
                g.release().await.unwrap();
                "connected".to_string()
            }
            Err(e) => {
                assert!(
                    matches!(e, LockError::Backend { .. } | LockError::Config(_)),
                    "untyped: {e:?}"
                );
                format!("typed error: {e}")
            }
        }
    });
    let seen = warns.0.lock().unwrap().clone();
    eprintln!("#insecure: {outcome}; warnings {seen:?}");
    assert_eq!(seen.len(), 1, "expected exactly one warning: {seen:?}");
    assert!(seen[0].contains("#insecure"), "{seen:?}");
}
