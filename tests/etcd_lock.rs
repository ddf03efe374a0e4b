//! etcd-specific properties (feature `etcd`): no herd and arrival-order hand-off, a crashed
//! holder process freed when its lease ends, a minority and a majority of a 3-member cluster
//! killed, and a holder process paused (SIGSTOP) past its lease. The shared suites
//! (`on_etcd::*` in lock_behaviour / wait_behaviour) cover the common contract.
//!
//! Cross-process tests re-execute this test binary (`child_process_entry` in child mode), with
//! the endpoints in `DLOCK_ETCD`.
#![cfg(feature = "etcd")]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::etcd::{EtcdCluster, admin, etcd_backend};
use common::{child_mode, child_say, spawn_self};
use dlock::{Lock, LockError};

const CHILD_ENTRY: &str = "child_process_entry";

/// Not a test of its own: the entry point of child processes started by the tests below.
#[test]
#[ignore = "child-process entry point; the tests below run it in their children"]
fn child_process_entry() {
    let mode = child_mode().expect("a child entry point runs only in a child process");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let eps: Vec<String> = std::env::var("DLOCK_ETCD")
            .expect("DLOCK_ETCD")
            .split(',')
            .map(str::to_string)
            .collect();
        let b = dlock::EtcdBackend::builder(&eps)
            .request_timeout(Duration::from_secs(1))
            .build()
            .await
            .unwrap();
        if mode == "tokens" {
            // Takes and releases `fence` three times; says each token and its own wall clock.
            let b = Arc::new(b);
            for _ in 0..3 {
                let g = Lock::new("fence")
                    .with_backend(b.clone())
                    .wait(Duration::from_secs(10))
                    .acquire()
                    .await
                    .unwrap();
                let (t, at) = (g.fencing_token(), now_micros());
                g.release().await.unwrap();
                child_say(format!("token {t} at {at}"));
            }
            return;
        }
        // Takes `crash` (ttl 2 s, watchdog on) and says so; then, in mode "hold-report-lost",
        // reports when its lost signal fires (measured from its own clock).
        let g = Lock::new("crash")
            .with_backend(Arc::new(b))
            .ttl(Duration::from_secs(2))
            .acquire()
            .await
            .unwrap();
        child_say(format!("acquired {}", g.fencing_token()));
        match mode.as_str() {
            "hold" => std::future::pending::<()>().await,
            "hold-report-lost" => {
                let reason = g.lost().await;
                child_say(format!("lost {reason:?}"));
                std::future::pending::<()>().await
            }
            other => panic!("unknown child mode {other}"),
        }
    });
}

async fn start(n: usize) -> EtcdCluster {
    tokio::task::spawn_blocking(move || EtcdCluster::start(n))
        .await
        .expect("start etcd")
}

/// 16 contenders, each on its own backend (its own lease and connection, as 16 processes would
/// have), queue on one name in a known order. Every release produces exactly one
/// predecessor-watch notification in total (no herd), the lock goes to the contenders in
/// arrival order, and an acquisition costs a bounded number of requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_contenders_one_notification_per_release_in_arrival_order() {
    let cluster = start(1).await;
    let holder_b = etcd_backend(&cluster).await;
    let holder = Lock::new("herd")
        .with_backend(Arc::new(holder_b))
        .acquire()
        .await
        .unwrap();
    let first_token = holder.fencing_token();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut backends = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..16 {
        let b = etcd_backend(&cluster).await;
        backends.push(b.clone());
        let order = order.clone();
        let lock = Lock::new("herd")
            .with_backend(Arc::new(b))
            .wait(Duration::from_secs(60));
        tasks.push(tokio::spawn(async move {
            let g = lock.acquire().await.expect("contender acquires");
            order.lock().unwrap().push((i, g.fencing_token()));
            // Hold briefly so the count per release can be checked between releases.
            tokio::time::sleep(Duration::from_millis(50)).await;
            g.release().await.unwrap();
        }));
        // Arrival order: each contender's key exists before the next starts.
        let settled = common::eventually(Duration::from_secs(5), || {
            let b = backends.last().unwrap().clone();
            // A first try (create + delete: nobody waited yet), then create + watch.
            async move { b.requests() >= 4 && b.waiter_count() == 1 }
        })
        .await;
        assert!(settled, "contender {i} did not queue");
    }
    let total =
        |bs: &[dlock::EtcdBackend]| -> u64 { bs.iter().map(|b| b.watch_notifications()).sum() };
    assert_eq!(total(&backends), 0, "notifications before any release");
    // A contender counts as queued once it waits with its key created, but its queueing can
    // end with one more read after that: the predecessor's, when the store moved between the
    // create and the watch (another backend's lease put). Under load that read landed after the
    // count below began (the last contender showed 4 requests after the release, about 1 run in
    // 8). So the count starts once no request has been sent for 200 ms.
    let sum = |bs: &[dlock::EtcdBackend]| -> u64 { bs.iter().map(|b| b.requests()).sum() };
    let mut last = sum(&backends);
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = sum(&backends);
        if now == last {
            break;
        }
        last = now;
    }
    let before: Vec<u64> = backends.iter().map(|b| b.requests()).collect();
    let requests_before: u64 = before.iter().sum();
    holder.release().await.unwrap();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("contenders finish")
            .unwrap();
    }
    let order = order.lock().unwrap().clone();
    let ids: Vec<usize> = order.iter().map(|(i, _)| *i).collect();
    assert_eq!(ids, (0..16).collect::<Vec<_>>(), "hand-off order");
    let mut last = first_token;
    for (i, t) in &order {
        assert!(*t > last, "contender {i}'s token {t} after {last}");
        last = *t;
    }
    // 16 releases before the last contender's (holder + 15 contenders), each waking only its
    // successor: 16 notifications, not 16 + 15 + ... as with a watch on the whole name.
    assert_eq!(total(&backends), 16, "one notification per release");
    for (i, b) in backends.iter().enumerate() {
        assert_eq!(
            b.watch_notifications(),
            1,
            "contender {i} was notified once"
        );
    }
    // After the holder's release: per contender one re-check, one fence write (the grant's
    // token, issue 18's token rule) and one delete (no polling).
    let after: u64 = backends.iter().map(|b| b.requests()).sum::<u64>() - requests_before;
    let per: Vec<u64> = backends
        .iter()
        .zip(&before)
        .map(|(b, n)| b.requests() - n)
        .collect();
    assert!(
        after <= 16 * 3,
        "{after} requests for 16 hand-offs (expected 3 per contender): {per:?}, before {before:?}"
    );
    assert!(common::etcd::keys_under_root(&cluster).await.is_empty());
}

/// The lease id of the holder key of `name` and its remaining ttl on the server.
async fn holder_lease(cluster: &EtcdCluster, b: &dlock::EtcdBackend, name: &str) -> (i64, i64) {
    let mut c = admin(cluster).await;
    let r = c
        .get(
            b.lock_prefix(name),
            Some(dlock::etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    let lease = r.kvs().first().expect("holder key").lease();
    let ttl = c.lease_time_to_live(lease, None).await.unwrap().ttl();
    (lease, ttl)
}

/// A holder process killed with SIGKILL (ttl 2 s, watchdog on) leaves its key until its lease
/// ends: a waiter gets it about the remaining lease after the kill, not at once, with a larger
/// token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_holder_process_is_freed_when_its_lease_ends() {
    let cluster = start(1).await;
    let b = etcd_backend(&cluster).await;
    let mut child = spawn_self(
        CHILD_ENTRY,
        "hold",
        &[("DLOCK_ETCD", cluster.endpoints().join(","))],
    );
    let line = tokio::task::block_in_place(|| child.expect_line(Duration::from_secs(30)));
    let child_token: u64 = line
        .strip_prefix("acquired ")
        .unwrap_or_else(|| panic!("unexpected child line {line:?}"))
        .parse()
        .unwrap();
    // Let the keep-alives run a few times.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let e = Lock::new("crash")
        .with_backend(Arc::new(b.clone()))
        .acquire()
        .await
        .unwrap_err();
    assert!(e.is_contended(), "held by the child: {e:?}");
    child.kill();
    let killed = Instant::now();
    let (_, left) = holder_lease(&cluster, &b, "crash").await;
    assert!(left >= 1, "lease at the kill had {left} s left");
    let g = Lock::new("crash")
        .with_backend(Arc::new(b.clone()))
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("waiter gets the dead holder's lock");
    let at = killed.elapsed();
    // The server reports whole seconds (rounded down) and checks expiry every 500 ms.
    assert!(
        at + Duration::from_millis(1100) >= Duration::from_secs(left as u64),
        "waiter got the lock {at:?} after the kill, lease left was {left} s"
    );
    assert!(
        at >= Duration::from_millis(300),
        "freed {at:?} after the kill: before the lease ended"
    );
    assert!(
        at < Duration::from_secs(left as u64 + 2),
        "waiter got it only {at:?} after the kill (lease left {left} s)"
    );
    assert!(g.fencing_token() > child_token);
    g.release().await.unwrap();
}

/// Kill one member of three (the leader, so an election happens too): a holder with the
/// watchdog on is never told lost, and other clients keep taking and releasing locks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_minority_keeps_locks_working_and_nobody_lost() {
    let mut cluster = start(3).await;
    let a = etcd_backend(&cluster).await;
    let b = etcd_backend(&cluster).await;
    let holder = Lock::new("held")
        .with_backend(Arc::new(a.clone()))
        .ttl(Duration::from_secs(5))
        .acquire()
        .await
        .unwrap();
    let leader = cluster.leader().await.expect("a leader");
    cluster.members[leader].kill();
    let killed = Instant::now();
    let mut last = 0;
    let mut n = 0;
    while killed.elapsed() < Duration::from_secs(6) && n < 200 {
        let g = Lock::new("other")
            .with_backend(Arc::new(b.clone()))
            .ttl(Duration::from_secs(5))
            .wait(Duration::from_secs(5))
            .acquire()
            .await
            .expect("acquire with two of three members up");
        assert!(g.fencing_token() > last);
        last = g.fencing_token();
        g.release().await.unwrap();
        n += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(n >= 5, "only {n} acquisitions in 6 s");
    assert!(
        holder.is_valid() && holder.lost_reason().is_none(),
        "the holder was told lost: {:?}",
        holder.lost_reason()
    );
    let e = Lock::new("held")
        .with_backend(Arc::new(b.clone()))
        .acquire()
        .await
        .unwrap_err();
    assert!(e.is_contended(), "the holder's key is still there: {e:?}");
    holder.release().await.unwrap();
    let g = Lock::new("held")
        .with_backend(Arc::new(b))
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .unwrap();
    g.release().await.unwrap();
}

/// Kill two members of three: an acquisition fails with a typed error within its wait, and a
/// holder (ttl 2 s) hears `lost()` by its deadline (ttl after its last confirmed renewal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_majority_fails_acquires_within_the_wait_and_holders_are_lost_by_their_deadline()
{
    let mut cluster = start(3).await;
    let a = etcd_backend(&cluster).await;
    let b = etcd_backend(&cluster).await;
    let ttl = Duration::from_secs(2);
    let holder = Lock::new("held")
        .with_backend(Arc::new(a))
        .ttl(ttl)
        .acquire()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.members[0].kill();
    cluster.members[1].kill();
    let killed = Instant::now();
    let wait = Duration::from_secs(2);
    let t0 = Instant::now();
    let r = Lock::new("other")
        .with_backend(Arc::new(b))
        .ttl(ttl)
        .wait(wait)
        .acquire()
        .await;
    let took = t0.elapsed();
    match &r {
        Err(LockError::TimedOut { .. } | LockError::Backend { .. }) => {}
        other => panic!("expected a typed timeout or backend error, got {other:?}"),
    }
    assert!(
        took < wait + Duration::from_millis(1500),
        "the failed acquire took {took:?} (wait {wait:?})"
    );
    let lost = tokio::time::timeout(ttl + Duration::from_secs(2), holder.lost()).await;
    assert!(
        lost.is_ok(),
        "holder not told lost within its ttl after the kill"
    );
    assert!(
        killed.elapsed() <= ttl + Duration::from_millis(1500),
        "lost fired {:?} after the kill (ttl {ttl:?})",
        killed.elapsed()
    );
    assert!(!holder.is_valid());
}

/// A holder process (ttl 2 s) is paused with SIGSTOP for 5 s: its lease ends on the server, a
/// waiter gets the lock with a larger token, and after SIGCONT the stale holder's `lost()` fires
/// (its own deadline passed while it was stopped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstopped_holder_past_its_lease_is_superseded_and_hears_lost() {
    let cluster = start(1).await;
    let b = etcd_backend(&cluster).await;
    let child = spawn_self(
        CHILD_ENTRY,
        "hold-report-lost",
        &[("DLOCK_ETCD", cluster.endpoints().join(","))],
    );
    let line = tokio::task::block_in_place(|| child.expect_line(Duration::from_secs(30)));
    let child_token: u64 = line
        .strip_prefix("acquired ")
        .unwrap_or_else(|| panic!("unexpected child line {line:?}"))
        .parse()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = child.pid() as libc::pid_t;
    // SAFETY: kill(2) on our own, unreaped child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let waiter = Lock::new("crash")
        .with_backend(Arc::new(b))
        .wait(Duration::from_secs(10))
        .acquire()
        .await;
    let g = waiter.expect("the waiter gets the lock once the paused holder's lease ended");
    assert!(g.fencing_token() > child_token);
    tokio::time::sleep(Duration::from_secs(1)).await;
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let resumed = Instant::now();
    let line = tokio::task::block_in_place(|| child.expect_line(Duration::from_secs(5)));
    assert!(line.starts_with("lost "), "child said {line:?}");
    assert!(
        resumed.elapsed() < Duration::from_secs(2),
        "lost heard {:?} after SIGCONT",
        resumed.elapsed()
    );
    g.release().await.unwrap();
}

/// One `EtcdBackend` built on runtime A, used from A and from runtime B on another thread (ttl
/// 2 s everywhere; A first takes a 2-s lease, kept alive from A): the count is exact, and after
/// A shuts down every call of B is answered and B's hold survives three ttls (the lease is not
/// kept alive by a task of A). See `common::runtimes`.
#[test]
fn one_backend_two_runtimes_exact_count_and_no_hang_after_one_shuts_down() {
    let cluster = EtcdCluster::single();
    common::runtimes::one_backend_two_runtimes(
        async { Arc::new(etcd_backend(&cluster).await) as Arc<dyn dlock::Backend> },
        Some(Duration::from_secs(2)),
        Duration::from_secs(6),
    );
}

const ROOT_PASSWORD: &str = "r00t-Pw";
const LOCKER_PASSWORD: &str = "l0cker-Pw";

/// Turns on etcd's authentication through the gRPC Auth API: `root` (with the root role), a
/// least-privilege user `locker` whose role may read and write the `/dlock/` prefix only, and a
/// user `outsider` whose role covers `/other/` only.
async fn enable_auth(cluster: &EtcdCluster) {
    use dlock::etcd_client::Permission;
    let mut c = admin(cluster).await;
    c.user_add("root", ROOT_PASSWORD, None).await.unwrap();
    c.user_grant_role("root", "root").await.unwrap();
    for (user, role, prefix) in [
        ("locker", "dlock-rw", "/dlock/"),
        ("outsider", "other-rw", "/other/"),
    ] {
        c.role_add(role).await.unwrap();
        c.role_grant_permission(role, Permission::read_write(prefix).with_prefix())
            .await
            .unwrap();
        c.user_add(user, LOCKER_PASSWORD, None).await.unwrap();
        c.user_grant_role(user, role).await.unwrap();
    }
    c.auth_enable().await.unwrap();
}

async fn build_as(
    cluster: &EtcdCluster,
    user: Option<(&str, &str)>,
) -> Result<dlock::EtcdBackend, LockError> {
    let mut b = dlock::EtcdBackend::builder(&cluster.endpoints())
        .request_timeout(common::etcd::REQUEST_TIMEOUT)
        .connect_timeout(common::etcd::REQUEST_TIMEOUT);
    if let Some((u, p)) = user {
        b = b.user(u, p);
    }
    b.build().await
}

/// User and password auth (issue 10, builders): with authentication enabled on a private etcd,
/// a least-privilege user (read/write on `/dlock/` only) takes, contends for and releases locks,
/// by the builder and by an `etcd://user:password@` URL. A wrong password, no credentials, and a
/// user without permission on the prefix each get a typed `LockError::Backend` (an etcd gRPC
/// status) quickly, with no password in the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_password_auth_works_and_wrong_or_missing_credentials_are_typed_errors() {
    let cluster = start(1).await;
    enable_auth(&cluster).await;
    let good = build_as(&cluster, Some(("locker", LOCKER_PASSWORD)))
        .await
        .expect("the locker user connects");
    let by_url = dlock::EtcdBackend::connect(&format!(
        "etcd://locker:{LOCKER_PASSWORD}@{}",
        cluster.endpoints().join(",")
    ))
    .await
    .expect("connect by URL with credentials");
    let g = Lock::new("auth")
        .with_backend(Arc::new(good.clone()))
        .ttl(Duration::from_secs(2))
        .acquire()
        .await
        .expect("the locker user takes the lock");
    let e = Lock::new("auth")
        .with_backend(Arc::new(by_url.clone()))
        .acquire()
        .await
        .unwrap_err();
    assert!(e.is_contended(), "the URL backend sees it held: {e:?}");
    let waiter = {
        let b = by_url.clone();
        tokio::spawn(async move {
            Lock::new("auth")
                .with_backend(Arc::new(b))
                .wait(Duration::from_secs(10))
                .acquire()
                .await
        })
    };
    // Held past its 2-s lease: the keep-alives and the watchdog work under auth.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        g.is_valid() && g.lost_reason().is_none(),
        "{:?}",
        g.lost_reason()
    );
    let token = g.fencing_token();
    g.release().await.unwrap();
    let g2 = waiter
        .await
        .unwrap()
        .expect("the waiter (watching under auth) gets it");
    assert!(g2.fencing_token() > token);
    g2.release().await.unwrap();

    // etcd 3.4 answers INVALID_ARGUMENT ("authentication failed", "user name is empty") and
    // PERMISSION_DENIED.
    for (who, user, code) in [
        (
            "wrong password",
            Some(("locker", "not-the-password")),
            tonic_code::INVALID_ARGUMENT,
        ),
        ("no credentials", None, tonic_code::INVALID_ARGUMENT),
        (
            "user without the prefix",
            Some(("outsider", LOCKER_PASSWORD)),
            tonic_code::PERMISSION_DENIED,
        ),
    ] {
        let t = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(10), async {
            let b = build_as(&cluster, user).await?;
            // Connected (not expected): then the first lock must fail.
            Lock::new("auth")
                .with_backend(Arc::new(b))
                .acquire()
                .await
                .map(drop)
        })
        .await
        .unwrap_or_else(|_| panic!("{who}: hung"));
        let e = r.expect_err(who);
        eprintln!("{who}: {e}");
        let LockError::Backend { source, .. } = &e else {
            panic!("{who}: expected LockError::Backend, got {e:?}");
        };
        let status = match source.downcast_ref::<dlock::etcd_client::Error>() {
            Some(dlock::etcd_client::Error::GRpcStatus(s)) => s.clone(),
            other => panic!("{who}: expected an etcd gRPC status, got {other:?} ({e})"),
        };
        assert_eq!(i32::from(status.code()), code, "{who}: {status:?}");
        assert!(
            !e.to_string().contains("not-the-password") && !e.to_string().contains(LOCKER_PASSWORD),
            "{who}: the password leaks: {e}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{who}: refused only after {:?}",
            t.elapsed()
        );
    }
}

/// gRPC status codes used above (tonic is not a direct dependency of the tests).
mod tonic_code {
    pub(crate) const INVALID_ARGUMENT: i32 = 3;
    pub(crate) const PERMISSION_DENIED: i32 = 7;
}

/// TLS (feature `tls`, issue 10 builders): a private etcd serving `https://` with a certificate
/// from a throwaway CA (rcgen). The builder's `tls_ca_pem` with that CA works (lock, contention,
/// a waiter woken over a TLS watch, keep-alives past the lease); a wrong CA, and a plaintext
/// client on the TLS port, get a typed `LockError::Backend` within the connect timeout (no panic,
/// no hang).
#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_the_right_ca_locks_and_a_wrong_ca_or_plaintext_is_a_typed_error() {
    use common::tls::new_ca;
    use rcgen::{CertificateParams, DnType, KeyPair};
    let dir = common::TempDir::new("etcd-tls");
    let ca = new_ca("dlock etcd test CA");
    let mut leaf = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    leaf.distinguished_name
        .push(DnType::CommonName, "dlock etcd test server");
    let leaf_key = KeyPair::generate().unwrap();
    let leaf_cert = leaf.signed_by(&leaf_key, &ca).unwrap();
    let tls = common::etcd::EtcdTls {
        port: common::free_port_pub(),
        cert: dir.path().join("server.crt"),
        key: dir.path().join("server.key"),
        client_ca: None,
    };
    std::fs::write(&tls.cert, leaf_cert.pem()).unwrap();
    std::fs::write(&tls.key, leaf_key.serialize_pem()).unwrap();
    let tls_port = tls.port;
    let _cluster = tokio::task::spawn_blocking(move || EtcdCluster::single_tls(tls))
        .await
        .unwrap();
    let build = |ep: String, ca_pem: Option<Vec<u8>>| async move {
        let mut b = dlock::EtcdBackend::builder(&[ep])
            .request_timeout(common::etcd::REQUEST_TIMEOUT)
            .connect_timeout(common::etcd::REQUEST_TIMEOUT);
        if let Some(pem) = ca_pem {
            b = b.tls_ca_pem(&pem);
        }
        tokio::time::timeout(Duration::from_secs(10), b.build())
            .await
            .expect("a TLS connect hangs")
    };
    let ca_pem = ca.pem().into_bytes();
    let https = format!("https://127.0.0.1:{tls_port}");
    let a = build(https.clone(), Some(ca_pem.clone()))
        .await
        .expect("TLS with the right CA");
    // host:port with TLS options means https too.
    let b = build(format!("localhost:{tls_port}"), Some(ca_pem.clone()))
        .await
        .expect("TLS by name with the right CA");
    // Past the lease (renewed over TLS), then handed to the waiter on the other client.
    common::hold_past_then_hand_over(
        Arc::new(a.clone()),
        Arc::new(b.clone()),
        "tls",
        Duration::from_secs(2),
        Duration::from_secs(3),
        Duration::from_secs(1),
        |g| async { g },
    )
    .await;

    let other_ca = new_ca("some other CA");
    for (who, ep, pem) in [
        ("wrong CA", https.clone(), Some(other_ca.pem().into_bytes())),
        (
            "plaintext on the TLS port",
            format!("127.0.0.1:{tls_port}"),
            None,
        ),
    ] {
        let t = Instant::now();
        let e = build(ep, pem).await.expect_err(who);
        eprintln!("{who}: {e}");
        assert!(
            matches!(e, LockError::Backend { .. }),
            "{who}: expected LockError::Backend, got {e:?}"
        );
        assert!(
            t.elapsed() < common::etcd::REQUEST_TIMEOUT + Duration::from_secs(2),
            "{who}: refused only after {:?}",
            t.elapsed()
        );
    }
}

/// Client certificates (feature `tls`): an etcd that requires one (`--client-cert-auth`, signed
/// by a client CA). The builder's `tls_identity_pem` with a certificate from that CA locks; no
/// client certificate, or one from another CA, is a typed `LockError::Backend` within the
/// connect timeout.
#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_client_certificate_required_right_one_locks_none_or_foreign_is_a_typed_error() {
    use common::tls::{leaf, new_ca};
    let dir = common::TempDir::new("etcd-mtls");
    let server_ca = new_ca("dlock etcd server CA");
    let client_ca = new_ca("dlock etcd client CA");
    let (cert, key) = leaf(&server_ca, &["localhost", "127.0.0.1"], "etcd server");
    let tls = common::etcd::EtcdTls {
        port: common::free_port_pub(),
        cert: dir.path().join("server.crt"),
        key: dir.path().join("server.key"),
        client_ca: Some(dir.path().join("client-ca.crt")),
    };
    std::fs::write(&tls.cert, cert).unwrap();
    std::fs::write(&tls.key, key).unwrap();
    std::fs::write(tls.client_ca.as_ref().unwrap(), client_ca.pem()).unwrap();
    let https = format!("https://127.0.0.1:{}", tls.port);
    let _cluster = tokio::task::spawn_blocking(move || EtcdCluster::single_tls(tls))
        .await
        .unwrap();
    let ca_pem = server_ca.pem().into_bytes();
    let build = |identity: Option<(String, String)>| {
        let (https, ca_pem) = (https.clone(), ca_pem.clone());
        async move {
            let mut b = dlock::EtcdBackend::builder(&[https])
                .request_timeout(common::etcd::REQUEST_TIMEOUT)
                .connect_timeout(common::etcd::REQUEST_TIMEOUT)
                .tls_ca_pem(&ca_pem);
            if let Some((c, k)) = identity {
                b = b.tls_identity_pem(c.as_bytes(), k.as_bytes());
            }
            tokio::time::timeout(Duration::from_secs(10), b.build())
                .await
                .expect("an mTLS connect hangs")
        }
    };
    let good = build(Some(leaf(&client_ca, &["dlock-client"], "dlock-client")))
        .await
        .expect("connect with a client certificate from the client CA");
    let g = Lock::new("mtls")
        .with_backend(Arc::new(good))
        .acquire()
        .await
        .expect("lock over mTLS");
    assert!(g.fencing_token() > 0);
    g.release().await.unwrap();
    let foreign_ca = new_ca("some other client CA");
    for (who, identity) in [
        ("no client certificate", None),
        (
            "a client certificate from another CA",
            Some(leaf(&foreign_ca, &["intruder"], "intruder")),
        ),
    ] {
        let t = Instant::now();
        let e = build(identity).await.expect_err(who);
        eprintln!("{who}: {e}");
        assert!(
            matches!(e, LockError::Backend { .. }),
            "{who}: expected LockError::Backend, got {e:?}"
        );
        assert!(
            t.elapsed() < common::etcd::REQUEST_TIMEOUT + Duration::from_secs(2),
            "{who}: refused only after {:?}",
            t.elapsed()
        );
    }
}

/// Two tasks of one runtime share one `EtcdBackend` and take turns on one name (25 locked
/// non-atomic increments each, default ttl 30 s, wait 5 s). A task that arrives while the other
/// waits queues locally without a key of its own; a release must wake it (before the fix it
/// slept until the holder's ttl, so the wait ran out). The count is exact, nobody times out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tasks_sharing_a_backend_take_turns_without_stalling() {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    let cluster = start(1).await;
    let backend: Arc<dyn dlock::Backend> = Arc::new(etcd_backend(&cluster).await);
    let counter = Arc::new(AtomicU64::new(0));
    let mut ts = Vec::new();
    for _ in 0..2 {
        let (b, c) = (backend.clone(), counter.clone());
        ts.push(tokio::spawn(async move {
            for _ in 0..25 {
                let g = Lock::new("turns")
                    .with_backend(b.clone())
                    .wait(Duration::from_secs(5))
                    .acquire()
                    .await
                    .expect("acquire within 5 s");
                let v = c.load(Relaxed);
                tokio::time::sleep(Duration::from_millis(1)).await;
                c.store(v + 1, Relaxed);
                g.release().await.unwrap();
            }
        }));
    }
    for t in ts {
        t.await.unwrap();
    }
    assert_eq!(counter.load(Relaxed), 50, "lost updates");
}

/// Waits for the first watch event for which `want` is true; returns every event seen up to it.
async fn events_until(
    w: &mut dlock::admin::Watching,
    limit: Duration,
    want: impl Fn(&dlock::admin::LockEvent) -> bool,
) -> Vec<dlock::admin::LockEvent> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut seen = Vec::new();
    loop {
        match tokio::time::timeout_at(deadline, w.events.recv()).await {
            Ok(Some(Ok(e))) => {
                let done = want(&e);
                seen.push(e);
                if done {
                    return seen;
                }
            }
            Ok(Some(Err(e))) => panic!("watch failed: {e}; events {seen:?}"),
            Ok(None) => panic!("watch ended; events {seen:?}"),
            Err(_) => panic!("the awaited event did not come within {limit:?}; events {seen:?}"),
        }
    }
}

/// The operator's view (issue 11) of an etcd lock held by another process: `show` reports the
/// owner id stored in the key, the holder's token and the time left on its lease (kept alive by
/// the holder). When the holder process is SIGKILLed, its key goes with its lease, and the
/// admin's watch reports that as `Expired`, not as a release; a release by a live holder is a
/// `Released`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_shows_the_lease_left_and_its_watch_tells_an_expiry_from_a_release() {
    use dlock::admin::LockEvent;
    let cluster = start(1).await;
    let admin = dlock::admin::connect(&cluster.url()).await.expect("admin");
    assert_eq!(admin.engine(), "etcd");
    let mut w = admin.watch("crash").await.expect("watch");
    assert!(w.sees_acquisitions);
    let mut child = spawn_self(
        CHILD_ENTRY,
        "hold",
        &[("DLOCK_ETCD", cluster.endpoints().join(","))],
    );
    let line = tokio::task::block_in_place(|| child.expect_line(Duration::from_secs(30)));
    let child_token: u64 = line
        .strip_prefix("acquired ")
        .unwrap_or_else(|| panic!("unexpected child line {line:?}"))
        .parse()
        .unwrap();
    let seen = events_until(&mut w, Duration::from_secs(10), |e| {
        matches!(e, LockEvent::Acquired { .. })
    })
    .await;
    assert!(
        matches!(seen.last(), Some(LockEvent::Acquired { name, token: Some(t), owner: Some(_) })
            if name == "crash" && *t == child_token),
        "{seen:?}"
    );
    let info = admin
        .show("crash")
        .await
        .unwrap()
        .expect("held by the child");
    assert_eq!(info.token, Some(child_token));
    assert_eq!(info.waiters, Some(0));
    let left = info.remaining.expect("the lease's time left");
    assert!(left <= Duration::from_secs(2), "{left:?} on a 2-s lease");

    child.kill();
    let seen = events_until(&mut w, Duration::from_secs(10), |e| {
        !matches!(e, LockEvent::Other { .. })
    })
    .await;
    assert_eq!(
        seen.last(),
        Some(&LockEvent::Expired {
            name: "crash".into()
        }),
        "the lease end is an expiry: {seen:?}"
    );

    let b = etcd_backend(&cluster).await;
    let g = Lock::new("crash")
        .with_backend(Arc::new(b))
        .acquire()
        .await
        .unwrap();
    let token = g.fencing_token();
    g.release().await.unwrap();
    let seen = events_until(&mut w, Duration::from_secs(10), |e| {
        matches!(e, LockEvent::Released { .. } | LockEvent::Expired { .. })
    })
    .await;
    assert!(
        seen.iter()
            .any(|e| matches!(e, LockEvent::Acquired { token: Some(t), .. } if *t == token)),
        "{seen:?}"
    );
    assert_eq!(
        seen.last(),
        Some(&LockEvent::Released {
            name: "crash".into()
        }),
        "a release is not an expiry: {seen:?}"
    );
}

/// A holder whose key the operator force-releases hears `lost()` (NotOwner) at its next renewal
/// (a third of its ttl), not at its deadline; a contender queued behind it is handed the lock at
/// once, and the evicted holder's give-back deletes nothing of the new holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_released_holder_hears_lost_at_its_next_renewal_and_the_queued_contender_takes_over()
{
    use dlock::admin::ForceReleased;
    let cluster = start(1).await;
    let a: Arc<dyn dlock::Backend> = Arc::new(etcd_backend(&cluster).await);
    let b: Arc<dyn dlock::Backend> = Arc::new(etcd_backend(&cluster).await);
    let admin = dlock::admin::connect(&cluster.url()).await.expect("admin");
    let ttl = Duration::from_secs(3);
    let holder = Lock::new("evict")
        .with_backend(a)
        .ttl(ttl)
        .acquire()
        .await
        .unwrap();
    let lost = holder.lost();
    let waiter = tokio::spawn(async move {
        Lock::new("evict")
            .with_backend(b)
            .wait(Duration::from_secs(30))
            .acquire()
            .await
    });
    let queued = common::eventually(Duration::from_secs(10), || async {
        admin
            .show("evict")
            .await
            .unwrap()
            .is_some_and(|i| i.waiters == Some(1))
    })
    .await;
    assert!(queued, "the contender never showed up queued");
    let info = admin.show("evict").await.unwrap().expect("held");
    assert_eq!(info.holders[0].owner, holder.owner(), "{info:?}");
    assert_eq!(info.token, Some(holder.fencing_token()));

    let t0 = Instant::now();
    let r = admin.force_release("evict", Some(&info)).await.unwrap();
    assert!(
        matches!(&r, ForceReleased::Released { woke: Some(1), .. }),
        "{r:?}"
    );
    let g2 = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the queued contender was not handed the lock")
        .unwrap()
        .expect("the queued contender acquires");
    assert!(g2.fencing_token() > holder.fencing_token());
    let reason = tokio::time::timeout(ttl / 3 + Duration::from_millis(1500), lost)
        .await
        .expect("the evicted holder did not hear lost() at its next renewal");
    assert_eq!(reason, dlock::LostReason::NotOwner);
    assert!(t0.elapsed() < ttl, "lost after {:?}", t0.elapsed());
    let _ = holder.release().await;
    let now = admin
        .show("evict")
        .await
        .unwrap()
        .expect("held by the contender");
    assert_eq!(now.token, Some(g2.fencing_token()));
    assert_eq!(now.holders[0].owner, g2.owner());
    // A second force-release with the old view is refused: the hold changed hands.
    assert_eq!(
        admin.force_release("evict", Some(&info)).await.unwrap(),
        ForceReleased::Changed
    );
    g2.release().await.unwrap();
}

/// `etcd://user:password@` for the admin (issue 11), with authentication on: the
/// least-privilege user reads and unlocks; a wrong password is a connection error, a user
/// without rights on the prefix a server error, an unreachable endpoint a connection error
/// within the bound. No target, `Debug` output or error message contains a password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_over_an_auth_url_reads_and_unlocks_and_never_shows_the_password() {
    use dlock::admin::{AdminErrorKind, ForceReleased};
    let cluster = start(1).await;
    enable_auth(&cluster).await;
    let holder = build_as(&cluster, Some(("locker", LOCKER_PASSWORD)))
        .await
        .unwrap();
    // A 3-s ttl: the holder checks its key every second.
    let g = Lock::new("auth-adm")
        .with_backend(Arc::new(holder))
        .ttl(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap();
    let eps = cluster.endpoints().join(",");
    let admin = dlock::admin::connect(&format!("etcd://locker:{LOCKER_PASSWORD}@{eps}"))
        .await
        .expect("admin as the locker user");
    assert_eq!(admin.target(), format!("etcd://locker@{eps}"));
    assert!(!format!("{admin:?}").contains(LOCKER_PASSWORD));
    let listing = admin.list("auth-").await.expect("list as locker");
    assert_eq!(listing.locks.len(), 1, "{listing:?}");
    let info = &listing.locks[0];
    assert_eq!(info.token, Some(g.fencing_token()));
    assert!(!format!("{info:?}").contains(LOCKER_PASSWORD));

    let e = dlock::admin::connect(&format!("etcd://locker:Wr0ng-Pw@{eps}"))
        .await
        .unwrap_err();
    assert_eq!(e.kind, AdminErrorKind::Connect, "{e}");
    assert!(!e.message.contains("Wr0ng-Pw"), "{e}");
    // `outsider` has the same password, and no rights on /dlock/.
    let e = dlock::admin::connect(&format!("etcd://outsider:{LOCKER_PASSWORD}@{eps}"))
        .await
        .unwrap_err();
    assert_eq!(e.kind, AdminErrorKind::Server, "{e}");
    assert!(e.message.contains("permission denied"), "{e}");
    assert!(!e.message.contains(LOCKER_PASSWORD), "{e}");
    let closed = common::free_port();
    let t = Instant::now();
    let e = dlock::admin::connect(&format!(
        "etcd://locker:{LOCKER_PASSWORD}@127.0.0.1:{closed}"
    ))
    .await
    .unwrap_err();
    assert_eq!(e.kind, AdminErrorKind::Connect, "{e}");
    assert!(!e.message.contains(LOCKER_PASSWORD), "{e}");
    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());

    let r = admin.force_release("auth-adm", Some(info)).await.unwrap();
    assert!(matches!(r, ForceReleased::Released { .. }), "{r:?}");
    let reason = tokio::time::timeout(Duration::from_secs(5), g.lost())
        .await
        .expect("the evicted holder hears lost()");
    assert_eq!(reason, dlock::LostReason::NotOwner);
    assert_eq!(admin.show("auth-adm").await.unwrap(), None);
}

/// Keys under the lock prefix that are not contender keys (`/dlock/<not an escaped name>/..`,
/// `/dlock/<name>` without a contender part, deeper keys) are counted in the admin's `skipped`,
/// never listed; the backend's own cancel markers are neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_list_counts_foreign_keys_as_skipped() {
    let cluster = start(1).await;
    let b = etcd_backend(&cluster).await;
    let g = Lock::new("skip:1")
        .with_backend(Arc::new(b.clone()))
        .acquire()
        .await
        .unwrap();
    let mut c = admin(&cluster).await;
    for k in [
        "/dlock/skip:raw/x".to_string(),
        "/dlock/skip%3A2".to_string(),
        format!("{}a/b", b.lock_prefix("skip:1")),
        "/dlock/.cancelled/skip%3A3/00-00".to_string(),
        "/dlock/other:raw/x".to_string(),
    ] {
        c.put(k, "x", None).await.unwrap();
    }
    let admin = dlock::admin::connect(&cluster.url()).await.unwrap();
    let all = admin.list("").await.unwrap();
    assert_eq!(all.locks.len(), 1, "{all:?}");
    assert_eq!(all.locks[0].name, "skip:1");
    assert_eq!(all.locks[0].token, Some(g.fencing_token()));
    assert_eq!(all.skipped, 4, "{all:?}");
    let some = admin.list("skip").await.unwrap();
    assert_eq!(
        some.skipped, 3,
        "only the foreign keys under the prefix: {some:?}"
    );
    g.release().await.unwrap();
}

/// A backend with a 1-s request timeout (the review's setting for the fault tests) on these
/// endpoints.
async fn backend_1s(endpoints: &[String]) -> dlock::EtcdBackend {
    dlock::EtcdBackend::builder(endpoints)
        .request_timeout(Duration::from_secs(1))
        .build()
        .await
        .expect("connect to the private etcd")
}

/// Pauses the leader and one follower of a 3-member cluster and waits until the remaining
/// follower knows it has no leader (it then refuses requests with "no leader" instead of
/// forwarding them to the paused leader, which would apply them once resumed). Returns the
/// remaining member's index.
async fn pause_a_majority(cluster: &mut EtcdCluster) -> usize {
    let leader = cluster.leader().await.expect("a leader");
    let stay = (0..3).find(|&i| i != leader).unwrap();
    for i in (0..3).filter(|&i| i != stay) {
        cluster.members[i].pause();
    }
    let port = cluster.members[stay].client_port();
    let lost = common::eventually(Duration::from_secs(10), || async move {
        !tokio::task::spawn_blocking(move || common::etcd::healthy(port))
            .await
            .unwrap()
    })
    .await;
    assert!(lost, "the remaining member still reports a leader");
    stay
}

/// Issue 17, C1. A release whose delete cannot be confirmed (the leader and another member
/// paused: no quorum, the remaining member answers "no leader") reports a backend error, never
/// `NotOwner`, and the key is not forgotten: the backend keeps retrying the delete in the
/// background, so once the members are back a second backend gets the name within a few
/// seconds, while another hold ("keep") keeps the shared lease alive. Before the fix the key
/// stayed on that lease for as long as "keep" was held (the second backend timed out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_delete_is_not_confirmed_is_an_error_and_retried_until_the_key_is_gone() {
    let mut cluster = start(3).await;
    let leader = cluster.leader().await.expect("a leader");
    let stay = (0..3).find(|&i| i != leader).unwrap();
    // Only the member that stays up: nothing is queued at a paused one.
    let b = backend_1s(&[cluster.members[stay].endpoint()]).await;
    let b2 = backend_1s(&cluster.endpoints()).await;
    let ttl = Duration::from_secs(10);
    let keep = Lock::new("keep")
        .with_backend(Arc::new(b.clone()))
        .ttl(ttl)
        .acquire()
        .await
        .unwrap();
    let victim = Lock::new("victim")
        .with_backend(Arc::new(b.clone()))
        .ttl(ttl)
        .acquire()
        .await
        .unwrap();
    assert_eq!(pause_a_majority(&mut cluster).await, stay);
    let r = victim.release().await;
    match &r {
        Err(LockError::Backend { .. }) => {}
        other => panic!("a release without quorum must be a backend error, got {other:?}"),
    }
    for i in (0..3).filter(|&i| i != stay) {
        cluster.members[i].resume();
    }
    let resumed = Instant::now();
    let g = Lock::new("victim")
        .with_backend(Arc::new(b2.clone()))
        .ttl(ttl)
        .wait(Duration::from_secs(8))
        .acquire()
        .await
        .unwrap_or_else(|e| {
            panic!("the victim's key was not deleted after the members came back: {e:?}")
        });
    let freed = resumed.elapsed();
    eprintln!("victim acquired by the second backend {freed:?} after the members resumed");
    assert!(freed < Duration::from_secs(8), "{freed:?}");
    assert!(keep.is_valid(), "keep was held all along (its lease alive)");
    g.release().await.unwrap();
    // Right after the election a release may still time out (a busy box): never NotOwner.
    if let Err(e) = keep.release().await {
        assert!(matches!(e, LockError::Backend { .. }), "{e:?}");
        eprintln!("keep's release: {e}");
    }
}

/// Issue 17, m3. A try whose reply is lost after the server created its key (the proxy drops
/// replies), then a give-up while the server cannot be reached (the proxy drops everything):
/// the cancel-marker transaction fails, the release is an error (not `NotOwner`), and the
/// backend retries the cancel until it is answered, so the created key does not stay queued on
/// the shared lease (kept alive by "keep"). Before the fix the failed marker transaction was
/// given up at once and the key was forgotten: a second backend timed out on the name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_of_a_lost_create_that_fails_is_retried_until_the_key_is_gone() {
    use common::proxy::{Mode, Proxy};
    use dlock::Backend as _;
    let cluster = start(1).await;
    let proxy = Proxy::start(cluster.members[0].client_port());
    let b = backend_1s(&[format!("127.0.0.1:{}", proxy.port())]).await;
    let b2 = backend_1s(&cluster.endpoints()).await;
    let ttl = Duration::from_secs(10);
    let keep = Lock::new("keep")
        .with_backend(Arc::new(b.clone()))
        .ttl(ttl)
        .acquire()
        .await
        .unwrap();
    proxy.set_mode(Mode::DropReplies);
    let owner = "m3-owner-1";
    let t = tokio::time::timeout(
        Duration::from_millis(500),
        b.try_acquire("victim", owner, ttl),
    )
    .await;
    assert!(t.is_err(), "the reply was dropped: {t:?}");
    let mut c = admin(&cluster).await;
    let created = c
        .get(
            b.lock_prefix("victim"),
            Some(dlock::etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    assert_eq!(created.kvs().len(), 1, "the create was applied");
    proxy.set_mode(Mode::Blackhole);
    let r = b.release("victim", owner, None, true).await;
    assert!(
        matches!(r, Err(LockError::Backend { .. })),
        "a give-up the server did not answer must be an error: {r:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.set_mode(Mode::Pass);
    let g = Lock::new("victim")
        .with_backend(Arc::new(b2.clone()))
        .ttl(ttl)
        .wait(Duration::from_secs(6))
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("the lost create's key was left behind: {e:?}"));
    eprintln!("the lost create's name acquired by the second backend");
    assert!(keep.is_valid(), "keep was held all along (its lease alive)");
    g.release().await.unwrap();
    let _ = keep.release().await;
}

/// Issue 17, m7. An operator revokes the lease under a hold (ttl 9 s: the watchdog renews
/// every 3 s, the background keep-alive runs every 3 s): the guard hears `lost()` at once,
/// through the lease's sentinel watch, not at the next renewal. Before the fix it fired only at
/// the next renewal (about 3 s after the grant).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_revoked_from_outside_fires_lost_at_once() {
    let cluster = start(1).await;
    let b = etcd_backend(&cluster).await;
    let g = Lock::new("revoked")
        .with_backend(Arc::new(b.clone()))
        .ttl(Duration::from_secs(9))
        .acquire()
        .await
        .unwrap();
    // The sentinel watch is set up in the background right after the lease's grant.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (lease, _) = holder_lease(&cluster, &b, "revoked").await;
    let mut c = admin(&cluster).await;
    c.lease_revoke(lease).await.unwrap();
    let revoked = Instant::now();
    let reason = tokio::time::timeout(Duration::from_secs(6), g.lost())
        .await
        .expect("lost() after the revoke");
    let took = revoked.elapsed();
    eprintln!("lost() fired {took:?} after the revoke");
    assert_eq!(reason, dlock::LostReason::NotOwner);
    assert!(
        took < Duration::from_millis(1000),
        "lost() fired {took:?} after the revoke (the next renewal is up to 3 s away)"
    );
    assert!(!g.is_valid());
    // The next acquire of this backend gets a new lease at once.
    let g2 = Lock::new("revoked")
        .with_backend(Arc::new(b.clone()))
        .acquire()
        .await
        .unwrap();
    g2.release().await.unwrap();
}

/// Issue 17, M1/M5 (backend side). A release polled once on a current-thread runtime that is
/// then shut down (the future dropped unfinished) still deletes the key: its work runs on the
/// backend's driver thread, not on the caller's runtime. A second backend gets the name at once.
/// Five rounds: before the fix the delete request sometimes escaped before the drop.
#[test]
fn a_release_cut_off_by_its_runtime_shutting_down_still_deletes_the_key() {
    use dlock::Backend as _;
    let cluster = EtcdCluster::single();
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (b, b2) =
        main.block_on(async { (etcd_backend(&cluster).await, etcd_backend(&cluster).await) });
    for round in 0..5 {
        let name = format!("cut-{round}");
        let owner = format!("cut-owner-{round}");
        main.block_on(async {
            let r = b
                .try_acquire(&name, &owner, Duration::from_secs(10))
                .await
                .unwrap();
            assert!(
                matches!(r, dlock::backend::Acquired::Granted { .. }),
                "{r:?}"
            );
        });
        let (bb, n, o) = (b.clone(), name.clone(), owner.clone());
        std::thread::spawn(move || {
            let ra = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            ra.block_on(async {
                let mut f = bb.release(&n, &o, None, true);
                std::future::poll_fn(|cx| {
                    let _ = f.as_mut().poll(cx);
                    std::task::Poll::Ready(())
                })
                .await;
            });
            drop(ra);
        })
        .join()
        .unwrap();
        main.block_on(async {
            let t = Instant::now();
            let g = Lock::new(&name)
                .with_backend(Arc::new(b2.clone()))
                .wait(Duration::from_secs(5))
                .acquire()
                .await
                .unwrap_or_else(|e| {
                    panic!("round {round}: the cut-off release left the key: {e:?}")
                });
            assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
            g.release().await.unwrap();
        });
    }
}

/// Issue 17, M2. A key put under an existing shared lease does not renew it: the lease may end
/// a third of its ttl before `grant + ttl`. Holder A (through a proxy) keeps a 6-s lease with
/// "pin" (watchdog off: only the background keep-alive renews it, every 2 s), takes "x" just
/// before a background renewal is due (the lease's last renewal 1.9 s old), then the proxy
/// drops everything. When B (direct) gets "x" after the lease ended on the server, A's guard
/// must already be invalid: its deadline must not outlive the lease. Before the fix A's guard
/// was still valid for about 1.9 s after B's grant (two valid holders).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_guard_deadline_never_outlives_the_shared_lease_on_the_server() {
    use common::proxy::{Mode, Proxy};
    let cluster = start(1).await;
    let proxy = Proxy::start(cluster.members[0].client_port());
    // Request timeout 2 s: the background keep-alive (every 2 s, each bounded by 2 s) then
    // finds the lease unconfirmed only at about grant + 8 s.
    let a = dlock::EtcdBackend::builder(&[format!("127.0.0.1:{}", proxy.port())])
        .request_timeout(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    let b = backend_1s(&cluster.endpoints()).await;
    let ttl = Duration::from_secs(6);
    let _pin = Lock::new("pin")
        .with_backend(Arc::new(a.clone()))
        .ttl(ttl)
        .watchdog(false)
        .acquire()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1900)).await;
    let g = Lock::new("x")
        .with_backend(Arc::new(a.clone()))
        .ttl(ttl)
        .acquire()
        .await
        .unwrap();
    proxy.set_mode(Mode::Blackhole);
    let acquired = Instant::now();
    let gb = Lock::new("x")
        .with_backend(Arc::new(b.clone()))
        .ttl(ttl)
        .wait(Duration::from_secs(15))
        .acquire()
        .await
        .expect("B gets x once A's lease ended");
    let tb = acquired.elapsed();
    eprintln!("B got x {tb:?} after A's grant; A valid: {}", g.is_valid());
    assert!(
        !g.is_valid(),
        "A's guard is still valid when B got the lock {tb:?} after A's grant (two holders)"
    );
    assert!(gb.fencing_token() > g.fencing_token());
    gb.release().await.unwrap();
    proxy.set_mode(Mode::Pass);
}

fn now_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// Takes and releases `name` once; its token, checked against the client's clock around it
/// (the floor: at least the client's µs when the try was sent).
async fn grant_once(b: &Arc<dlock::EtcdBackend>, name: &str) -> u64 {
    let before = now_micros();
    let g = Lock::new(name)
        .with_backend(b.clone())
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    let t = g.fencing_token();
    g.release().await.unwrap();
    assert!(
        t >= before,
        "token {t} below the client's µs {before} at the try (the token floor)"
    );
    t
}

/// Issue 18's token rule on etcd: a grant's token is `max(last + 1, client µs)`, `last` kept on
/// the server in the name's fence key. Tokens are at least the client's µs (so a fenced
/// resource moved from Redis or MySQL, whose tokens are server µs, keeps accepting writes;
/// before the fix they were create revisions, a few hundred), strictly increasing across
/// holders, hand-offs to a queued contender (the fence written after the re-check), and a
/// restart of the whole (single-member) cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_at_least_client_micros_and_increase_across_holders_handoffs_and_a_restart() {
    let mut cluster = start(1).await;
    let b = Arc::new(etcd_backend(&cluster).await);
    let b2 = Arc::new(etcd_backend(&cluster).await);
    let mut last = 0;
    for i in 0..5 {
        let t = grant_once(if i % 2 == 0 { &b } else { &b2 }, "fence").await;
        assert!(t > last, "grant {i}: token {t} after {last}");
        last = t;
    }
    // An uncontended grant writes its fence in the create's own transaction: acquire + release
    // is still two requests (the create and the delete).
    let before = b.requests();
    let t = grant_once(&b, "fence").await;
    assert!(t > last, "token {t} after {last}");
    last = t;
    assert_eq!(
        b.requests() - before,
        2,
        "requests for an uncontended acquire + release"
    );
    // A hand-off: a contender on another backend queues, then gets the name on the release.
    let holder = Lock::new("fence")
        .with_backend(b.clone())
        .acquire()
        .await
        .unwrap();
    assert!(holder.fencing_token() > last);
    last = holder.fencing_token();
    let waiter = {
        let b2 = b2.clone();
        tokio::spawn(async move {
            let g = Lock::new("fence")
                .with_backend(b2)
                .wait(Duration::from_secs(10))
                .acquire()
                .await
                .unwrap();
            let t = g.fencing_token();
            g.release().await.unwrap();
            t
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    holder.release().await.unwrap();
    let t = waiter.await.unwrap();
    assert!(t > last, "hand-off: token {t} after {last}");
    last = t;
    // The whole cluster restarts (its data dir kept): the fence key survives.
    drop((b, b2));
    let cluster = tokio::task::spawn_blocking(move || {
        cluster.restart(0);
        cluster
    })
    .await
    .unwrap();
    let b = Arc::new(etcd_backend(&cluster).await);
    let t = grant_once(&b, "fence").await;
    assert!(t > last, "after the restart: token {t} after {last}");
}

/// A client whose wall clock is an hour behind (libfaketime in a child process) gets tokens
/// larger than the ones granted before it by a client with the right clock (its floor is
/// lower, so `last + 1` decides), and the next grant by the right clock is larger again. A
/// token taken from the client's clock alone would go back an hour here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_an_hour_behind_still_gets_larger_tokens_than_earlier_grants() {
    let lib = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
    assert!(
        std::path::Path::new(lib).exists(),
        "{lib} missing: run scripts/test (it installs Debian's libfaketime)"
    );
    let cluster = start(1).await;
    let b = Arc::new(etcd_backend(&cluster).await);
    let mut last = grant_once(&b, "fence").await;
    let mut child = spawn_self(
        CHILD_ENTRY,
        "tokens",
        &[
            ("DLOCK_ETCD", cluster.endpoints().join(",")),
            ("LD_PRELOAD", lib.to_string()),
            ("FAKETIME", "-1h".to_string()),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_string()),
        ],
    );
    for i in 0..3 {
        let line = tokio::task::block_in_place(|| child.expect_line(Duration::from_secs(30)));
        let (t, at) = line
            .strip_prefix("token ")
            .and_then(|l| l.split_once(" at "))
            .unwrap_or_else(|| panic!("unexpected child line {line:?}"));
        let (t, at): (u64, u64) = (t.parse().unwrap(), at.parse().unwrap());
        assert!(
            now_micros() - at > 3_000_000_000,
            "the child's clock is not behind (libfaketime not in effect): {at}"
        );
        assert!(t > last, "child grant {i}: token {t} after {last}");
        last = t;
    }
    child.kill();
    let t = grant_once(&b, "fence").await;
    assert!(t > last, "after the child: token {t} after {last}");
}
