//! ACL users and passwords (RELIABILITY.md G5): waiting without pub/sub permission, a user that
//! may not run the lock's commands, a wrong password that never leaks.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::RedisProc;
use dlock::{Backend, Lock, LockError, RedisBackend};

const PASSWORD: &str = "Corr3ct-Horse-pw";

/// Runs `ACL SETUSER name rules...`, dropping `+client|setinfo` on servers older than 7.2
/// (which do not know that subcommand).
fn set_user(admin: &mut redis::Connection, name: &str, rules: &[&str]) {
    let run = |admin: &mut redis::Connection, rules: &[&str]| -> redis::RedisResult<()> {
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg(name)
            .arg(rules)
            .query(admin)
    };
    if let Err(e) = run(admin, rules) {
        let without: Vec<&str> = rules
            .iter()
            .copied()
            .filter(|r| *r != "+client|setinfo")
            .collect();
        assert!(without.len() < rules.len(), "ACL SETUSER {name}: {e}");
        run(admin, &without).unwrap_or_else(|e| panic!("ACL SETUSER {name}: {e}"));
    }
}

/// The rules from the brief: key pattern, no channels, only script, ping, hello, pub/sub and
/// client-name commands.
fn base_rules(password: &str) -> Vec<String> {
    [
        "on",
        &format!(">{password}"),
        "~dlock:*",
        "resetchannels",
        "-@all",
        "+evalsha",
        "+eval",
        "+script|load",
        "+ping",
        "+hello",
        "+subscribe",
        "+unsubscribe",
        "+publish",
        "+client|setinfo",
        "+client|setname",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The commands the lock scripts run (ACLs apply to commands called from Lua).
const SCRIPT_COMMANDS: &[&str] = &[
    "+exists", "+time", "+get", "+set", "+hset", "+pexpire", "+hexists", "+hincrby", "+pttl",
    "+hget", "+del",
];

async fn backend_as(server: &RedisProc, user: &str) -> Arc<dyn Backend> {
    let b = RedisBackend::connect(&server.url_with_auth(user, PASSWORD))
        .await
        .unwrap_or_else(|e| panic!("connect as {user}: {e}"));
    Arc::new(b)
}

/// G5: a user that may run the scripts but has no channel permission. SUBSCRIBE is refused, so
/// waiting falls back to the holder's remaining lease; the waiter gets the lock within about a
/// ttl of the release, never hangs; and the release itself succeeds (its PUBLISH is refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_without_channel_permission_waits_by_lease_timer_and_never_hangs() {
    let server = tokio::task::spawn_blocking(RedisProc::start).await.unwrap();
    let mut rules = base_rules(PASSWORD);
    rules.extend(SCRIPT_COMMANDS.iter().map(|s| s.to_string()));
    let rules: Vec<&str> = rules.iter().map(String::as_str).collect();
    set_user(&mut server.admin(), "nochan", &rules);

    let holder_b = backend_as(&server, "nochan").await;
    let waiter_b = backend_as(&server, "nochan").await;
    let ttl = Duration::from_secs(1);
    for round in 0..2 {
        let name = format!("acl-{round}");
        let holder = Lock::new(name.clone())
            .with_backend(holder_b.clone())
            .ttl(ttl)
            .acquire()
            .await
            .expect("the limited user acquires");
        let l = Lock::new(name.clone())
            .with_backend(waiter_b.clone())
            .ttl(ttl)
            .wait(Duration::from_secs(10));
        let waiter = tokio::spawn(async move {
            let r = l.acquire().await;
            (Instant::now(), r)
        });
        // Hold across a few renewals and lease-end wake-ups of the waiter.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(!waiter.is_finished(), "waiter got a held lock");
        let released = Instant::now();
        let r = holder.release().await;
        let (at, got) = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("waiter hangs without pub/sub")
            .unwrap();
        let g = got.expect("waiter acquires after the release (lease-timer fallback)");
        assert!(
            at.saturating_duration_since(released) < ttl + Duration::from_millis(500),
            "waiter got it {:?} after the release",
            at.saturating_duration_since(released)
        );
        g.release().await.expect("release by the limited user");
        r.expect("release by a user without channel permission");
    }
}

/// Issue 7: a refused SUBSCRIBE is asked again after a back-off. The user first lacks channel
/// permission (waiters use the lease timer); once an operator grants `&dlock:*`, a waiter that
/// starts after the back-off (1 s) is woken by the release's pub/sub message, long before the
/// holder's 30 s lease would end, without re-initialising the backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_subscribe_is_retried_after_a_back_off() {
    let server = tokio::task::spawn_blocking(RedisProc::start).await.unwrap();
    let mut rules = base_rules(PASSWORD);
    rules.extend(SCRIPT_COMMANDS.iter().map(|s| s.to_string()));
    let rules: Vec<&str> = rules.iter().map(String::as_str).collect();
    set_user(&mut server.admin(), "latechan", &rules);
    let b = backend_as(&server, "latechan").await;
    let direct: Arc<dyn Backend> = Arc::new(RedisBackend::connect(&server.url()).await.unwrap());

    // Refused: this wait can only end by its own deadline (the holder keeps a 30 s lease).
    let holder = Lock::new("late-0")
        .with_backend(direct.clone())
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let r = Lock::new("late-0")
        .with_backend(b.clone())
        .wait(Duration::from_millis(300))
        .acquire()
        .await;
    assert!(r.is_err(), "got a held lock");
    holder.release().await.unwrap();

    set_user(&mut server.admin(), "latechan", &["&dlock:*"]);
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let holder = Lock::new("late-1")
        .with_backend(direct.clone())
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let l = Lock::new("late-1")
        .with_backend(b.clone())
        .wait(Duration::from_secs(10));
    let waiter = tokio::spawn(async move {
        let r = l.acquire().await;
        (Instant::now(), r)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiter.is_finished(), "waiter got a held lock");
    let released = Instant::now();
    holder.release().await.unwrap();
    let (at, r) = tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .expect("waiter returns")
        .unwrap();
    let g = r.expect("the waiter acquires after the release");
    assert!(
        at.saturating_duration_since(released) < Duration::from_secs(2),
        "woken {:?} after the release: SUBSCRIBE was not asked again",
        at.saturating_duration_since(released)
    );
    g.release().await.unwrap();
}

/// The brief's literal ACL user may not run the commands inside the scripts: every call fails
/// with a clear, typed error (a permission error from the server), quickly, for try and wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_without_script_command_permission_gets_a_clear_error_never_hangs() {
    let server = tokio::task::spawn_blocking(RedisProc::start).await.unwrap();
    let rules = base_rules(PASSWORD);
    let rules: Vec<&str> = rules.iter().map(String::as_str).collect();
    set_user(&mut server.admin(), "limited", &rules);
    let b = backend_as(&server, "limited").await;
    for wait in [Duration::ZERO, Duration::from_secs(1)] {
        let t0 = Instant::now();
        let e = tokio::time::timeout(
            Duration::from_secs(5),
            Lock::new("denied")
                .with_backend(b.clone())
                .wait(wait)
                .acquire(),
        )
        .await
        .expect("acquire hangs")
        .unwrap_err();
        assert!(e.is_backend(), "wait {wait:?}: {e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("denied")
                && (msg.contains("can't run")
                    || msg.contains("permission")
                    || msg.contains("NOPERM")),
            "unclear error: {msg}"
        );
        assert!(t0.elapsed() < wait + Duration::from_secs(2));
    }
}

/// G5: a wrong password gives a typed error; neither the wrong nor the right password appears
/// in any error's Display or Debug, the backend's Debug, or the captured tracing output.
#[test]
fn wrong_password_is_a_typed_error_and_no_password_leaks() {
    let server = RedisProc::start();
    let rules = base_rules(PASSWORD);
    let rules: Vec<&str> = rules.iter().map(String::as_str).collect();
    set_user(&mut server.admin(), "someone", &rules);

    let logs = Arc::new(Mutex::new(Vec::<u8>::new()));
    let sink = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || LogSink(sink.clone()))
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let wrong = "Wr0ng-Secret-pw";
    let mut seen = Vec::new();
    rt.block_on(async {
        let e = RedisBackend::connect(&server.url_with_auth("someone", wrong))
            .await
            .unwrap_err();
        assert!(
            matches!(e, LockError::Backend { .. } | LockError::Config(_)),
            "untyped: {e:?}"
        );
        seen.push(format!("{e} / {e:?}"));
        let e = dlock::init_named("acl-wrong", &server.url_with_auth("someone", wrong))
            .await
            .unwrap_err();
        seen.push(format!("{e} / {e:?}"));
        let e = dlock::backend("acl-wrong").unwrap_err();
        assert!(matches!(e, LockError::UnknownBackend { .. }), "{e:?}");

        // The right password works, and is not printed either.
        let ok = RedisBackend::connect(&server.url_with_auth("someone", PASSWORD))
            .await
            .expect("right password");
        seen.push(format!("{ok:?} {}", ok.url()));
        let lazy = RedisBackend::builder(server.url_with_auth("someone", wrong));
        seen.push(format!("{lazy:?}"));
        let lazy = lazy.build().unwrap();
        seen.push(format!("{lazy:?}"));
        let e = Lock::new("x")
            .with_backend(Arc::new(lazy))
            .acquire()
            .await
            .unwrap_err();
        seen.push(format!("{e} / {e:?}"));
    });
    drop(rt);
    seen.push(String::from_utf8_lossy(&logs.lock().unwrap()).into_owned());
    for s in &seen {
        assert!(!s.contains(wrong), "the wrong password leaked: {s}");
        assert!(!s.contains(PASSWORD), "the password leaked: {s}");
    }
    assert!(
        seen[0].to_lowercase().contains("wrongpass") || seen[0].contains("auth"),
        "the error does not say the credentials were refused: {}",
        seen[0]
    );
}

struct LogSink(Arc<Mutex<Vec<u8>>>);

impl Write for LogSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
