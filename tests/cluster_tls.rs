//! Redis Cluster over TLS (features `cluster` + `tls`): a private cluster of 3 masters whose nodes
//! serve TLS with a certificate from a CA generated per run (rcgen), with a TLS cluster bus and
//! TLS replication ([`ClusterSet::start_tls`]).
//!
//! * `rediss://` seeds and the right CA (`ClusterBackendBuilder::tls_root_cert`): locks in slots
//!   of every master, and a waiter behind a 30 s holder is handed the lock promptly on release
//!   (sharded pub/sub over TLS).
//! * A wrong CA, or none (system store), is a typed `LockError` from `connect` or from the first
//!   acquire of a lazily built backend, within a bound; never a panic or a hang.
//!
//! The nodes keep a plain port for the harness (startup, `redis-cli --cluster create`, checks).
//! That TLS is what the backend used is checked on the servers: `CLIENT LIST` on every master
//! must show the backend's connections (the ones that ran the lock scripts, and the one holding
//! the shard subscription) on the TLS port, none of them on the plain one. A TLS port accepts TLS
//! only, so a connection there is a TLS connection.

mod common;

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cluster::ClusterSet;
use common::tls::new_ca;
use dlock::{Backend, ClusterBackend, Lock, LockError};

/// Bound of every call to the backend: far above its own timeouts (op 3 s, connection 2 s), so a
/// hang fails the test instead of stalling it.
const BOUND: Duration = Duration::from_secs(20);

async fn bounded<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .unwrap_or_else(|_| panic!("{what} hangs (> {BOUND:?})"))
}

async fn tls_cluster(replicas: usize) -> Arc<ClusterSet> {
    Arc::new(
        tokio::task::spawn_blocking(move || ClusterSet::start_tls(3, replicas))
            .await
            .expect("start the TLS cluster"),
    )
}

fn builder(seeds: Vec<String>, ca: Option<&[u8]>) -> dlock::ClusterBackendBuilder {
    let b = ClusterBackend::builder(seeds).connection_timeout(Duration::from_secs(2));
    match ca {
        Some(pem) => b.tls_root_cert(pem.to_vec()),
        None => b,
    }
}

async fn connect(seeds: Vec<String>, ca: Option<&[u8]>) -> Result<ClusterBackend, LockError> {
    bounded("a TLS cluster connect", builder(seeds, ca).connect()).await
}

fn ca_of(set: &ClusterSet) -> &[u8] {
    &set.certs.as_ref().expect("a TLS cluster").ca_pem
}

/// One client connection of `CLIENT LIST`.
#[derive(Debug)]
struct ClientConn {
    /// The server port it connected to (`laddr`).
    port: u16,
    flags: String,
    ssub: u32,
    /// The last command it ran.
    cmd: String,
}

/// `CLIENT LIST` of node `i`, asked on its plain port (the asking connection left out).
fn clients_of(set: &ClusterSet, i: usize) -> Vec<ClientConn> {
    let text: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut set.nodes[i].admin())
        .expect("CLIENT LIST");
    text.lines()
        .filter_map(|line| {
            let field = |k: &str| {
                line.split_whitespace()
                    .find_map(|f| f.strip_prefix(k)?.strip_prefix('='))
            };
            Some(ClientConn {
                port: field("laddr")?.rsplit(':').next()?.parse().ok()?,
                flags: field("flags")?.to_string(),
                ssub: field("ssub")?.parse().ok()?,
                cmd: field("cmd")?.to_string(),
            })
        })
        .filter(|c| c.cmd != "client|list")
        .collect()
}

/// Commands only the backend sends (the harness never runs them).
const BACKEND_CMDS: &[&str] = &["evalsha", "eval", "ssubscribe", "sunsubscribe"];

/// On every master: at least one connection that ran a lock script is on the TLS port, and no
/// connection that ran a backend command is on the plain port.
fn assert_backend_used_tls(set: &ClusterSet, masters: &HashSet<usize>) {
    for &m in masters {
        let (plain, tls) = (set.nodes[m].port(), set.tls_ports[m]);
        let clients = clients_of(set, m);
        let backend: Vec<&ClientConn> = clients
            .iter()
            .filter(|c| BACKEND_CMDS.contains(&c.cmd.as_str()))
            .collect();
        assert!(
            backend
                .iter()
                .any(|c| c.port == tls && c.cmd.starts_with("eval")),
            "master {m}: no connection on the TLS port {tls} ran a lock script: {clients:?}"
        );
        assert!(
            backend.iter().all(|c| c.port == tls),
            "master {m}: the backend talked to the plain port {plain}: {clients:?}"
        );
    }
}

/// Names whose lock keys are spread over every master, and the master of each.
fn spread_names(set: &ClusterSet, n: usize) -> Vec<(String, usize)> {
    let names: Vec<(String, usize)> = (0..n)
        .map(|i| {
            let name = format!("tls-slots:{i}");
            let m =
                set.master_of_slot(ClusterSet::slot_of(&dlock::backend::redis_keys(&name).lock));
            (name, m)
        })
        .collect();
    let masters: HashSet<usize> = names.iter().map(|(_, m)| *m).collect();
    assert_eq!(masters.len(), 3, "the names do not cover every master");
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_seeds_with_the_right_ca_lock_on_every_master_and_hand_off_over_tls() {
    // One replica per master: the nodes replicate over TLS too (`tls-replication`).
    let set = tls_cluster(1).await;
    let ca = ca_of(&set);
    let a: Arc<dyn Backend> = Arc::new(
        connect(set.tls_urls("127.0.0.1"), Some(ca))
            .await
            .expect("rediss:// seeds with the right CA"),
    );
    // A second client, seeded by host name: the certificate names `localhost` too.
    let b: Arc<dyn Backend> = Arc::new(
        connect(set.tls_urls("localhost"), Some(ca))
            .await
            .expect("rediss://localhost seeds with the right CA"),
    );
    let names = spread_names(&set, 12);
    let masters: HashSet<usize> = names.iter().map(|(_, m)| *m).collect();

    // Acquire / busy / release / re-acquire on keys of every master.
    for (name, m) in &names {
        let g = bounded(
            "acquire",
            Lock::new(name.as_str())
                .with_backend(a.clone())
                .ttl(Duration::from_secs(10))
                .acquire(),
        )
        .await
        .unwrap_or_else(|e| panic!("acquire {name} over TLS: {e}"));
        assert!(g.fencing_token() > 0);
        let held: i64 = redis::cmd("EXISTS")
            .arg(dlock::backend::redis_keys(name).lock)
            .query(&mut set.nodes[*m].admin())
            .expect("EXISTS");
        assert_eq!(held, 1, "{name}: the lock key is not on its master {m}");
        let busy = bounded(
            "a busy acquire",
            Lock::new(name.as_str()).with_backend(b.clone()).acquire(),
        )
        .await
        .unwrap_err();
        assert!(matches!(busy, LockError::Busy { .. }), "{name}: {busy:?}");
        bounded("release", g.release()).await.unwrap();
        let g = bounded(
            "re-acquire",
            Lock::new(name.as_str()).with_backend(b.clone()).acquire(),
        )
        .await
        .unwrap_or_else(|e| panic!("re-acquire {name} after the release: {e}"));
        bounded("release", g.release()).await.unwrap();
    }

    // Hand-off on one name per master: the holder's 30 s lease would be the fallback timer, so a
    // prompt wake-up can only come from the SPUBLISH of the release over the TLS subscription.
    let mut seen = HashSet::new();
    for (name, m) in names.iter().filter(|(_, m)| seen.insert(*m)) {
        let g = bounded(
            "acquire",
            Lock::new(name.as_str())
                .with_backend(a.clone())
                .ttl(Duration::from_secs(30))
                .acquire(),
        )
        .await
        .unwrap();
        let waiter = {
            let l = Lock::new(name.as_str())
                .with_backend(b.clone())
                .wait(Duration::from_secs(10));
            tokio::spawn(async move {
                let r = l.acquire().await;
                (Instant::now(), r)
            })
        };
        // The waiter's shard subscription is on this master's TLS port.
        let subscribed = common::eventually(Duration::from_secs(5), || async {
            clients_of(&set, *m)
                .iter()
                .any(|c| c.ssub > 0 && c.port == set.tls_ports[*m])
        })
        .await;
        assert!(
            subscribed,
            "{name}: no shard subscription on master {m}'s TLS port: {:?}",
            clients_of(&set, *m)
        );
        assert!(
            clients_of(&set, *m)
                .iter()
                .all(|c| c.ssub == 0 || c.port == set.tls_ports[*m]),
            "{name}: a shard subscription on a plain port: {:?}",
            clients_of(&set, *m)
        );
        assert!(!waiter.is_finished(), "{name}: the waiter got a held lock");
        let released = Instant::now();
        bounded("release", g.release()).await.unwrap();
        let (at, r) = bounded("the waiter", waiter).await.unwrap();
        let g2 = r.unwrap_or_else(|e| panic!("{name}: the waiter acquires after the release: {e}"));
        let handoff = at - released;
        eprintln!("{name} (master {m}): hand-off over TLS in {handoff:?}");
        assert!(
            handoff < Duration::from_millis(500),
            "{name}: hand-off over TLS took {handoff:?} (missed sharded pub/sub wake-up?)"
        );
        bounded("release", g2.release()).await.unwrap();
    }

    assert_backend_used_tls(&set, &masters);
    // Replication runs over TLS as well: each master's replica link is on its TLS port.
    for &m in &masters {
        let replica_links: Vec<ClientConn> = clients_of(&set, m)
            .into_iter()
            .filter(|c| c.flags.contains('S'))
            .collect();
        assert!(
            !replica_links.is_empty() && replica_links.iter().all(|c| c.port == set.tls_ports[m]),
            "master {m}: replica links not (all) on the TLS port: {replica_links:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_or_missing_ca_is_a_typed_error_within_a_bound() {
    let set = tls_cluster(0).await;
    let other = new_ca("some other CA").pem().into_bytes();
    for (what, ca) in [
        ("a wrong CA", Some(other.as_slice())),
        ("the system store", None),
    ] {
        let t0 = Instant::now();
        let e = match connect(set.tls_urls("127.0.0.1"), ca).await {
            Ok(_) => panic!("connected to a cluster signed by a private CA with {what}"),
            Err(e) => e,
        };
        eprintln!("connect with {what}: {:?}: {e}", t0.elapsed());
        assert!(
            matches!(e, LockError::Backend { .. } | LockError::Config(_)),
            "{what}: untyped error {e:?}"
        );
        let msg = e.to_string().to_lowercase();
        assert!(
            msg.contains("certificate") || msg.contains("unknownissuer"),
            "{what}: the error does not say the certificate was refused: {e}"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{what}: the connect failed only after {:?}",
            t0.elapsed()
        );

        // A lazily built backend fails the same way at the first acquire.
        let lazy: Arc<dyn Backend> = Arc::new(
            builder(set.tls_urls("127.0.0.1"), ca)
                .build()
                .expect("build checks the URLs only"),
        );
        let t0 = Instant::now();
        let e = bounded(
            "the first acquire with a refused certificate",
            Lock::new("tls-wrong-ca").with_backend(lazy).acquire(),
        )
        .await
        .expect_err("acquired through a refused certificate");
        eprintln!("first acquire with {what}: {:?}: {e}", t0.elapsed());
        assert!(e.is_backend(), "{what}: {e:?}");
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{what}: the acquire failed only after {:?}",
            t0.elapsed()
        );
    }
    // Control: the same cluster with its own CA works, so the errors above were the certificate.
    let ok = connect(set.tls_urls("127.0.0.1"), Some(ca_of(&set))).await;
    assert!(ok.is_ok(), "the right CA: {ok:?}");
}

/// A CA given with plain `redis://` seeds applies to `rediss://` only, as documented (and as on
/// one node): the backend talks plain text to the plain ports and works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_with_plain_seeds_stays_plain_text() {
    let set = tls_cluster(0).await;
    let b: Arc<dyn Backend> = Arc::new(
        bounded(
            "connect with plain seeds and a CA",
            connect(set.urls(), Some(ca_of(&set))),
        )
        .await
        .expect("plain seeds with a CA did not connect"),
    );
    let g = bounded(
        "an acquire over plain text",
        Lock::new("tls-plain-seeds").with_backend(b).acquire(),
    )
    .await
    .expect("acquire over plain text");
    g.release().await.unwrap();
}
