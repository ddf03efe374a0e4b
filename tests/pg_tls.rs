//! TLS to PostgreSQL (feature `postgres-tls`): a private `postgres` with `ssl = on` and a server
//! certificate signed by a CA generated per run (rcgen).
//!
//! * The right CA (`tls_root_cert`, or `sslrootcert=` in the URL) with `sslmode=require` /
//!   `verify-full`: acquire, release and a waiter woken by NOTIFY, every connection of the
//!   backend (pool, listener, advisory session) encrypted (`pg_stat_ssl`).
//! * A wrong CA is a typed `LockError` at connect, never a plain-text fallback or a hang.
#![cfg(feature = "postgres-tls")]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::TempDir;
use common::sql::PgProc;
use common::tls::{leaf, new_ca};
use dlock::{Backend, Lock, PostgresBackend};

/// A TLS PostgreSQL and the PEM of its CA.
fn tls_server() -> (PgProc, String) {
    let ca = new_ca("dlock test CA");
    let (cert, key) = leaf(&ca, &["localhost", "127.0.0.1"], "dlock test postgres");
    let srv = PgProc::start_tls(&cert, &key);
    (srv, ca.pem())
}

/// Number of this server's client sessions that are not encrypted.
async fn plain_sessions(url: &str, ca: &str) -> i64 {
    let b = PostgresBackend::builder(url)
        .tls_root_cert(ca.as_bytes().to_vec())
        .create_schema(false)
        .connect()
        .await
        .unwrap();
    let c = b.pool().get().await.unwrap();
    c.query_one(
        "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
         WHERE a.backend_type = 'client backend' AND NOT s.ssl",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_right_ca_connects_encrypted_and_a_wrong_one_is_refused() {
    let (srv, ca) = tokio::task::spawn_blocking(tls_server).await.unwrap();
    let base = srv.url();
    let require = format!("{base}?sslmode=require");
    let holder: Arc<dyn Backend> = Arc::new(
        PostgresBackend::builder(&require)
            .tls_root_cert(ca.as_bytes().to_vec())
            .connect()
            .await
            .expect("TLS with the right CA"),
    );
    // sslrootcert in the URL, verify-full: the same CA from a file.
    let dir = TempDir::new("pgtls");
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca).unwrap();
    let verify = format!(
        "{base}?sslmode=verify-full&sslrootcert={}",
        ca_file.display()
    );
    let waiter_b: Arc<dyn Backend> = Arc::new(
        PostgresBackend::builder(&verify)
            .connect()
            .await
            .expect("TLS with sslrootcert"),
    );
    let adv = PostgresBackend::builder(&require)
        .tls_root_cert(ca.as_bytes().to_vec())
        .advisory(true)
        .connect()
        .await
        .expect("advisory session over TLS");
    let g = Lock::new("tls")
        .with_backend(holder.clone())
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let w = tokio::spawn(async move {
        Lock::new("tls")
            .with_backend(waiter_b)
            .wait(Duration::from_secs(10))
            .acquire()
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    g.release().await.unwrap();
    let g2 = w.await.unwrap().expect("the waiter, woken over TLS");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    g2.release().await.unwrap();
    let a = Lock::new("tls-adv")
        .with_backend(Arc::new(adv))
        .acquire()
        .await
        .unwrap();
    // Every session the backends opened (pools, listeners, advisory) is encrypted.
    assert_eq!(plain_sessions(&require, &ca).await, 0);
    a.release().await.unwrap();

    // A CA that did not sign the server's certificate: a typed error, no plain fallback.
    let other = new_ca("another CA").pem();
    let t = Instant::now();
    let e = PostgresBackend::builder(&require)
        .tls_root_cert(other.into_bytes())
        .connect()
        .await
        .expect_err("connected with a CA that did not sign the server certificate");
    assert!(
        e.is_backend() || matches!(e, dlock::LockError::Config(_)),
        "{e:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

/// The admin (`dlock::admin::connect`) takes the same TLS parameters as the backend's URL, plus
/// `dlock_table`: it reads the lock over an encrypted session, and a CA that did not sign the
/// server is a connection error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_connects_with_the_urls_tls_parameters() {
    use dlock::admin::{self, AdminErrorKind};
    let (srv, ca) = tokio::task::spawn_blocking(tls_server).await.unwrap();
    let base = srv.url();
    let dir = TempDir::new("pgtls-admin");
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca).unwrap();
    let verify = format!(
        "{base}?sslmode=verify-full&sslrootcert={}",
        ca_file.display()
    );
    let b: Arc<dyn Backend> = Arc::new(
        PostgresBackend::builder(&verify)
            .table("tls_admin_locks")
            .connect()
            .await
            .expect("backend over TLS"),
    );
    let g = Lock::new("tls-admin")
        .with_backend(b)
        .acquire()
        .await
        .unwrap();
    let a = admin::connect(&format!("{verify}&dlock_table=tls_admin_locks"))
        .await
        .expect("admin over TLS");
    let info = a.show("tls-admin").await.unwrap().expect("held");
    assert_eq!(info.token, Some(g.fencing_token()));
    // The admin's own session is encrypted.
    let c = PostgresBackend::builder(&verify)
        .create_schema(false)
        .connect()
        .await
        .unwrap();
    let plain: i64 = c
        .pool()
        .get()
        .await
        .unwrap()
        .query_one(
            "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.application_name = 'dlock-admin' AND NOT s.ssl",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(plain, 0);
    // Another CA: refused, typed as a connection failure.
    let other_file = dir.path().join("other.pem");
    std::fs::write(&other_file, new_ca("another CA").pem()).unwrap();
    let e = admin::connect(&format!(
        "{base}?sslmode=verify-full&sslrootcert={}&dlock_table=tls_admin_locks",
        other_file.display()
    ))
    .await
    .expect_err("a CA that did not sign the server");
    assert_eq!(e.kind, AdminErrorKind::Connect, "{e}");
    g.release().await.unwrap();
}
