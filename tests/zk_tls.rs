//! ZooKeeper over TLS (features `zookeeper` + `tls`, issue 10 builders): private ZooKeeper 3.8
//! servers whose only client port is Netty's `secureClientPort` (no plain-text port), with a
//! CA and server certificate generated per run (rcgen).
//!
//! * The right CA (`tls_ca_pem`, or `zks://...?tls_ca=<file>`) locks, keeps its session past the
//!   session timeout, and hands the lock to a waiter of another session on release; the admin
//!   reads the same `zks://` URL. A plain-text client on the TLS port is a typed error.
//! * A wrong CA, or the Mozilla roots, is a typed `LockError::Backend` within the request
//!   timeout; a bad PEM is `LockError::Config` at once; no key text in `Debug` or errors.
//! * `ssl.clientAuth=need`: no client certificate, or one from another CA, is a typed error
//!   within the bound; the client CA's certificate (builder or URL) locks.
#![cfg(all(feature = "zookeeper", feature = "tls"))]

mod common;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::tls::{leaf, new_ca};
use common::zookeeper::{SESSION, ZkProc, ZkTls};
use dlock::{Lock, LockError, ZookeeperBackend, ZookeeperBackendBuilder};

/// Request (and connect) timeout of the backends built here.
const BOUND: Duration = Duration::from_secs(3);
/// The default request timeout (backends from a URL).
const URL_BOUND: Duration = Duration::from_secs(5);

/// A TLS-only server with a certificate for 127.0.0.1 and localhost from a new CA; the CA's PEM.
async fn tls_server(client_ca_pem: Option<String>) -> (ZkProc, Vec<u8>) {
    let ca = new_ca("dlock zk test CA");
    let (cert_pem, key_pem) = leaf(&ca, &["localhost", "127.0.0.1"], "dlock zk test server");
    let tls = ZkTls {
        cert_pem,
        key_pem,
        client_ca_pem,
    };
    let server = tokio::task::spawn_blocking(move || ZkProc::start_tls(tls))
        .await
        .unwrap();
    (server, ca.pem().into_bytes())
}

fn builder(hosts: &str) -> ZookeeperBackendBuilder {
    ZookeeperBackend::builder(hosts)
        .session_timeout(SESSION)
        .request_timeout(BOUND)
}

/// `fut` must end within the bounds plus slack (never hang); returns its output and duration.
async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> (T, Duration) {
    let t = Instant::now();
    let out = tokio::time::timeout(URL_BOUND + Duration::from_secs(10), fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: hangs"));
    (out, t.elapsed())
}

/// `r` is a typed `LockError::Backend` that came within `bound` (the request timeout) plus slack.
fn assert_refused<T>(who: &str, bound: Duration, (r, took): (Result<T, LockError>, Duration)) {
    let Err(e) = r else {
        panic!("{who}: connected")
    };
    eprintln!("{who}: {e} (after {took:?})");
    assert!(
        matches!(e, LockError::Backend { .. }),
        "{who}: expected LockError::Backend, got {e:?}"
    );
    assert!(
        took < bound + Duration::from_secs(2),
        "{who}: refused only after {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_right_ca_locks_hands_over_and_admin_reads_over_the_tls_port_only() {
    let (server, ca_pem) = tls_server(None).await;
    let port = server.port();
    // No plain-text port: the four-letter words (plain text) get no answer on the TLS port.
    assert_ne!(
        common::zookeeper::four_letter(port, "ruok").as_deref(),
        Some("imok"),
        "the TLS port answers plain text"
    );
    let (a, _) = bounded(
        "TLS by IP",
        builder(&server.hosts()).tls_ca_pem(&ca_pem).build(),
    )
    .await;
    let a = a.expect("TLS by IP with the right CA");
    // By name, through the URL form: `zks://` with the CA file as `tls_ca`.
    let ca_file = server.dir().join("client-ca.pem");
    std::fs::write(&ca_file, &ca_pem).unwrap();
    let url = format!("zks://localhost:{port}?tls_ca={}", ca_file.display());
    let (b, _) = bounded("zks:// URL", ZookeeperBackend::connect(&url)).await;
    let b = b.expect("zks:// by name with tls_ca");

    // Past the session timeout: the session lives on over TLS (pings), the hold stays.
    common::hold_past_then_hand_over(
        Arc::new(a.clone()),
        Arc::new(b.clone()),
        "zk-tls",
        Duration::from_secs(30),
        SESSION + Duration::from_secs(1),
        Duration::from_secs(2),
        |g| async {
            // The operator's view through the same URL.
            let (adm, _) = bounded("admin over zks://", dlock::admin::connect(&url)).await;
            let adm = adm.expect("admin over zks://");
            assert!(adm.target().starts_with("zks://"), "{}", adm.target());
            let info = adm
                .show("zk-tls")
                .await
                .expect("admin show over TLS")
                .expect("held");
            assert_eq!(info.token, Some(g.fencing_token()));
            assert_eq!(info.waiters, Some(1), "{info:?}");
            g
        },
    )
    .await;

    // Plain text on the TLS port: a typed error within the bound (the URL form too).
    assert_refused(
        "plain text on the TLS port",
        BOUND,
        bounded("plain text", builder(&server.hosts()).build()).await,
    );
    let plain = format!("zk://127.0.0.1:{port}");
    assert_refused(
        "zk:// on the TLS port",
        URL_BOUND,
        bounded("zk://", ZookeeperBackend::connect(&plain)).await,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_wrong_ca_or_public_roots_or_bad_pem_are_typed_errors_never_hangs() {
    let (server, ca_pem) = tls_server(None).await;
    let other_ca = new_ca("some other CA").pem().into_bytes();
    assert_refused(
        "wrong CA",
        BOUND,
        bounded(
            "wrong CA",
            builder(&server.hosts()).tls_ca_pem(&other_ca).build(),
        )
        .await,
    );
    assert_refused(
        "Mozilla roots only",
        BOUND,
        bounded("no CA", builder(&server.hosts()).tls(true).build()).await,
    );
    assert_refused(
        "zks:// without tls_ca",
        URL_BOUND,
        bounded("zks://", ZookeeperBackend::connect(&server.url())).await,
    );
    let (adm, took) = bounded("admin, wrong CA", dlock::admin::connect(&server.url())).await;
    let e = adm.expect_err("admin with the Mozilla roots");
    eprintln!("admin, wrong CA: {e} (after {took:?})");
    assert_eq!(e.kind, dlock::admin::AdminErrorKind::Connect, "{e}");

    // Bad PEMs: `LockError::Config` at once, naming the part, never quoting it.
    let secret_key =
        "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWtleS1tYXRlcmlhbA==\n-----END PRIVATE KEY-----\n";
    let (cert, key) = leaf(&new_ca("client CA"), &["client"], "client");
    let (_, other_key) = leaf(&new_ca("client CA 2"), &["client"], "client");
    for (who, b) in [
        (
            "CA without a certificate",
            builder(&server.hosts()).tls_ca_pem(b"not a certificate"),
        ),
        (
            "client key that is not PEM",
            builder(&server.hosts())
                .tls_ca_pem(&ca_pem)
                .tls_identity_pem(cert.as_bytes(), b"no key here"),
        ),
        (
            "client key that is no key",
            builder(&server.hosts())
                .tls_ca_pem(&ca_pem)
                .tls_identity_pem(cert.as_bytes(), secret_key.as_bytes()),
        ),
        (
            "client key of another certificate",
            builder(&server.hosts())
                .tls_ca_pem(&ca_pem)
                .tls_identity_pem(cert.as_bytes(), other_key.as_bytes()),
        ),
        (
            "client certificate that is not PEM",
            builder(&server.hosts())
                .tls_ca_pem(&ca_pem)
                .tls_identity_pem(b"garbage", key.as_bytes()),
        ),
    ] {
        let shown = format!("{b:?}");
        assert!(
            !shown.contains("PRIVATE KEY") && !shown.contains("c2VjcmV0"),
            "{who}: key in Debug: {shown}"
        );
        let (r, took) = bounded(who, b.build()).await;
        let e = r.expect_err(who);
        eprintln!("{who}: {e}");
        assert!(matches!(e, LockError::Config(_)), "{who}: {e:?}");
        assert!(took < Duration::from_secs(1), "{who}: after {took:?}");
        let msg = e.to_string();
        assert!(
            !msg.contains("c2VjcmV0") && !msg.contains("PRIVATE KEY") && !msg.contains("garbage"),
            "{who}: PEM content in the error: {msg}"
        );
    }
    // URL mistakes: `LockError::Config` before any connection.
    let port = server.port();
    for (who, url) in [
        (
            "tls_ca on a zk:// URL",
            format!("zk://127.0.0.1:{port}?tls_ca=/nonexistent/ca.pem"),
        ),
        (
            "unreadable tls_ca",
            format!("zks://127.0.0.1:{port}?tls_ca=/nonexistent/ca.pem"),
        ),
        (
            "tls_cert without tls_key",
            format!("zks://127.0.0.1:{port}?tls_cert=/nonexistent/c.pem"),
        ),
        (
            "unknown parameter",
            format!("zks://u:hunter2@127.0.0.1:{port}?tls_verify=no"),
        ),
    ] {
        let (r, _) = bounded(who, ZookeeperBackend::connect(&url)).await;
        let e = r.expect_err(who);
        eprintln!("{who}: {e}");
        assert!(matches!(e, LockError::Config(_)), "{who}: {e:?}");
        assert!(!e.to_string().contains("hunter2"), "{who}: password: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_required_client_certificate_from_the_client_ca_locks_none_or_foreign_refused() {
    let client_ca = new_ca("dlock zk client CA");
    let (server, ca_pem) = tls_server(Some(client_ca.pem())).await;
    let with_identity = |id: Option<&(String, String)>| {
        let b = builder(&server.hosts()).tls_ca_pem(&ca_pem);
        match id {
            Some((c, k)) => b.tls_identity_pem(c.as_bytes(), k.as_bytes()),
            None => b,
        }
    };
    // The server may check the client's address against its certificate: name it.
    let mine = leaf(&client_ca, &["localhost", "127.0.0.1"], "dlock-client");
    let foreign = leaf(
        &new_ca("some other client CA"),
        &["localhost", "127.0.0.1"],
        "intruder",
    );
    assert_refused(
        "no client certificate",
        BOUND,
        bounded("no identity", with_identity(None).build()).await,
    );
    assert_refused(
        "a client certificate from another CA",
        BOUND,
        bounded("foreign identity", with_identity(Some(&foreign)).build()).await,
    );
    let (good, _) = bounded("mTLS", with_identity(Some(&mine)).build()).await;
    let good = good.expect("mTLS with a certificate from the client CA");
    let g = Lock::new("zk-mtls")
        .with_backend(Arc::new(good))
        .acquire()
        .await
        .expect("lock over mTLS");
    assert!(g.fencing_token() > 0);
    // The URL form: `tls_cert` and `tls_key` files.
    let dir = server.dir();
    let files = [
        ("ca.pem", String::from_utf8(ca_pem.clone()).unwrap()),
        ("client.pem", mine.0.clone()),
        ("client.key", mine.1.clone()),
    ];
    for (name, pem) in &files {
        std::fs::write(dir.join(name), pem).unwrap();
    }
    let url = format!(
        "zks://127.0.0.1:{}?tls_ca={}&tls_cert={}&tls_key={}",
        server.port(),
        dir.join("ca.pem").display(),
        dir.join("client.pem").display(),
        dir.join("client.key").display()
    );
    let (by_url, _) = bounded("mTLS URL", ZookeeperBackend::connect(&url)).await;
    let by_url = by_url.expect("mTLS through tls_cert / tls_key");
    let busy = Lock::new("zk-mtls")
        .with_backend(Arc::new(by_url))
        .acquire()
        .await;
    assert!(
        matches!(busy, Err(LockError::Busy { .. })),
        "the second session sees the hold: {busy:?}"
    );
    g.release().await.unwrap();
}
