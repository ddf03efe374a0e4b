//! The `dlock` binary end to end against a private `redis-server` (free loopback port, temp dir,
//! killed on drop) and a separate process holding a lock (this test binary re-executed in child
//! mode), following the harness pattern of the workspace's `tests/common/mod.rs`.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

type SpawnReq = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Children are forked by one long-lived thread, so `PR_SET_PDEATHSIG` kills them exactly when
/// the test process dies (it fires when the forking *thread* exits).
fn spawn_child(mut cmd: Command) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnReq>>> = OnceLock::new();
    let tx = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnReq>();
        std::thread::spawn(move || {
            for (mut cmd, reply) in rx {
                let _ = reply.send(cmd.spawn());
            }
        });
        Mutex::new(tx)
    });
    // SAFETY: only async-signal-safe calls (prctl, getppid) between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() == 1 {
                return Err(std::io::Error::other("parent exited"));
            }
            Ok(())
        });
    }
    let (rtx, rrx) = mpsc::channel();
    tx.lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((cmd, rtx))
        .unwrap();
    rrx.recv().unwrap()
}

/// A child process killed and reaped on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Redis {
    port: u16,
    dir: PathBuf,
    _proc: Proc,
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Redis {
    fn start(extra: &[&str]) -> Redis {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("dlock-cli-test-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(&dir)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        let child = match spawn_child(cmd) {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "redis-server is not installed: run scripts/test (it installs Debian's redis-server)"
            ),
            Err(e) => panic!("cannot spawn redis-server: {e}"),
        };
        let r = Redis {
            port,
            dir,
            _proc: Proc(child),
        };
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        r
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

/// Runs `dlock` with `args`, `DLOCK_URL=url`, and `stdin`; bounded to 20 s.
fn dlock(url: &str, args: &[&str], stdin: &str) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dlock"));
    cmd.args(args)
        .env("DLOCK_URL", url)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = spawn_child(cmd).unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("dlock {args:?} hung");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

const CHILD_ENV: &str = "DLOCK_CLI_TEST_CHILD";

/// Child entry point: holds `cli:held` (ttl 3 s, renewed every second) in its own process,
/// prints its token, then prints how it lost the lock. Runs only when re-executed by a test.
#[test]
#[ignore = "child-process entry point, run by list_show_unlock_against_a_holding_process"]
fn holder_process() {
    let url = std::env::var(CHILD_ENV).expect("run by the parent test only");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        dlock_runtime::init(&url).await.unwrap();
        let g = dlock_runtime::Lock::new("cli:held")
            .ttl(Duration::from_secs(3))
            .acquire()
            .await
            .unwrap();
        println!("CHILD: token {} owner {}", g.fencing_token(), g.owner());
        let reason = tokio::time::timeout(Duration::from_secs(30), g.lost())
            .await
            .expect("lost() did not fire within 30 s");
        println!("CHILD: lost {reason}");
    });
}

#[test]
fn list_show_unlock_against_a_holding_process() {
    let redis = Redis::start(&[]);
    let url = redis.url();

    // Nothing held yet.
    let o = dlock(&url, &["list"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("no locks held"),
        "{}",
        text(&o)
    );
    let o = dlock(&url, &["show", "cli:held"], "");
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));

    // A holder in another process.
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "holder_process",
        "--exact",
        "--include-ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ENV, &url)
    // The holder's name, with a control character the stored identity must not carry.
    .env("DLOCK_HOLDER_NAME", "cli-holder\u{7}")
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    let mut child = Proc(spawn_child(cmd).unwrap());
    let (tx, rx) = mpsc::channel();
    let out = child.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(at) = l.find("CHILD: ") {
                let _ = tx.send(l[at + 7..].to_string());
            }
        }
    });
    let first = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("holder did not start");
    let mut words = first.split_whitespace();
    assert_eq!(words.next(), Some("token"));
    let token = words.next().unwrap().to_string();
    assert_eq!(words.next(), Some("owner"));
    let owner = words.next().unwrap().to_string();

    // A foreign key under the prefix does not break the listing.
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut c = client.get_connection().unwrap();
    redis::cmd("SET")
        .arg("dlock:{weird}")
        .arg("x")
        .exec(&mut c)
        .unwrap();
    redis::cmd("SET")
        .arg("dlock:{bad\\q}")
        .arg("x")
        .exec(&mut c)
        .unwrap();

    let o = dlock(&url, &["list", "cli:*"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let row = out
        .lines()
        .find(|l| l.starts_with("cli:held"))
        .unwrap_or_else(|| panic!("{}", text(&o)));
    assert!(row.contains(&owner) && row.contains(&token), "{row}");
    assert!(!out.contains("weird"), "{}", text(&o));
    // Who holds it (issue 20): the child's name, host and pid.
    let child_pid = child.0.id();
    let host = dlock_runtime::holder_identity().host;
    let holder = format!("cli-holder@{host}:{child_pid}");
    assert!(row.contains(&holder), "{holder} not in {row}");
    let o = dlock(&url, &["show", "cli:held"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains(&format!("holder         {holder}")),
        "{}",
        text(&o)
    );

    let o = dlock(&url, &["list", "--json"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let held = v
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "cli:held")
        .unwrap();
    assert_eq!(held["fencing_token"].to_string(), token);
    assert_eq!(held["holds"], 1);
    assert_eq!(held["owners"][0]["owner"], owner.as_str());
    assert_eq!(held["owners"][0]["holder"]["name"], "cli-holder");
    assert_eq!(held["owners"][0]["holder"]["pid"], child_pid);
    let rem = held["remaining_ms"].as_i64().unwrap();
    assert!(rem > 0 && rem <= 3000, "{rem}");
    // The unexpected string key is skipped, not shown, and named on stderr.
    assert!(v.as_array().unwrap().iter().all(|l| l["name"] != "weird"));

    let o = dlock(&url, &["show", "cli:held", "--json"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["fencing_token"].to_string(), token);

    // Unlock without confirmation: refused, nothing done.
    let o = dlock(&url, &["unlock", "cli:held"], "");
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    let o = dlock(&url, &["unlock", "cli:held"], "n\n");
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert_eq!(
        dlock(&url, &["show", "cli:held"], "").status.code(),
        Some(0)
    );

    // A waiter in this process (wait 30 s), seen by `show` as one waiting process.
    let (wtx, wrx) = mpsc::channel::<Instant>();
    let wurl = url.clone();
    let waiter = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            dlock_runtime::init_named("cli-waiter", &wurl)
                .await
                .unwrap();
            let g = dlock_runtime::Lock::new("cli:held")
                .backend("cli-waiter")
                .wait(Duration::from_secs(30))
                .acquire()
                .await
                .unwrap();
            let _ = wtx.send(Instant::now());
            g.release().await.unwrap();
        });
    });
    let start = Instant::now();
    loop {
        let o = dlock(&url, &["show", "cli:held", "--json"], "");
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        if v["waiters"] == 1 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "waiter never seen: {v}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // Confirmed on stdin: released, and the holder hears it at its next renewal (ttl/3 = 1 s).
    let t0 = Instant::now();
    let o = dlock(&url, &["unlock", "cli:held"], "y\n");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.contains("released lock `cli:held`"), "{}", text(&o));
    assert!(out.contains("woke 1 waiting process"), "{}", text(&o));
    // The wake-up, not the lease timer (the holder's lease had 2 s or more left), hands it over.
    let got = wrx
        .recv_timeout(Duration::from_secs(10))
        .expect("waiter not woken");
    assert!(
        got.duration_since(t0) < Duration::from_millis(1500),
        "waiter took {:?} after the unlock",
        got.duration_since(t0)
    );
    waiter.join().unwrap();
    let lost = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("holder's lost() did not fire");
    assert!(lost.starts_with("lost"), "{lost}");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "lost() took {:?}",
        t0.elapsed()
    );
    assert_eq!(
        dlock(&url, &["show", "cli:held"], "").status.code(),
        Some(3)
    );
    // Unlocking a free lock: not found.
    assert_eq!(
        dlock(&url, &["unlock", "cli:held", "--yes"], "")
            .status
            .code(),
        Some(3)
    );
}

#[test]
fn exit_codes_for_bad_urls_and_no_password_in_output() {
    // Nothing listens on this port: connection failed.
    let port = free_port();
    let url = format!("redis://admin:s3cr3t-pw@127.0.0.1:{port}/0");
    let o = dlock(&url, &["list"], "");
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    assert!(!text(&o).contains("s3cr3t-pw"), "{}", text(&o));

    // A scheme that is no dlock backend: not supported.
    let o = dlock("memcached://u:s3cr3t-pw@127.0.0.1/db", &["list"], "");
    assert_eq!(o.status.code(), Some(6), "{}", text(&o));
    assert!(text(&o).contains("not a dlock backend URL"), "{}", text(&o));
    assert!(!text(&o).contains("s3cr3t-pw"), "{}", text(&o));

    // Garbage: no panic, a clear message, exit 6.
    let o = dlock("not a url", &["list"], "");
    assert_eq!(o.status.code(), Some(6), "{}", text(&o));
    assert!(!text(&o).contains("panicked"), "{}", text(&o));

    // A wrong password against a server that requires one: connection failed, not shown.
    let redis = Redis::start(&["--requirepass", "right-pw"]);
    let o = dlock(
        &format!("redis://:wrong-pw@127.0.0.1:{}", redis.port),
        &["list"],
        "",
    );
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    assert!(!text(&o).contains("wrong-pw"), "{}", text(&o));
    // --help never shows the environment's URL.
    let o = dlock("redis://:env-secret@127.0.0.1:1", &["--help"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(!text(&o).contains("env-secret"), "{}", text(&o));
}

/// The default build is light (issue 20): `--help` says which engines this binary has and which
/// Cargo feature adds each of the others.
#[test]
fn help_names_the_engines_built_in_and_the_features_that_add_the_others() {
    let o = dlock("redis://127.0.0.1:1", &["--help"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let help = String::from_utf8_lossy(&o.stdout).into_owned();
    let line = |prefix: &str| {
        help.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no `{prefix}` line in:\n{help}"))
            .to_string()
    };
    let (built, not_built) = (line("Built with: "), line("Not built: "));
    for (feature, on) in [
        ("sentinel", cfg!(feature = "sentinel")),
        ("cluster", cfg!(feature = "cluster")),
        ("tls", cfg!(feature = "tls")),
        ("postgres", cfg!(feature = "postgres")),
        ("mysql", cfg!(feature = "mysql")),
        ("zookeeper", cfg!(feature = "zookeeper")),
        ("etcd", cfg!(feature = "etcd")),
    ] {
        let tag = format!("{feature} (");
        assert_eq!(built.contains(&tag), on, "{feature}:\n{help}");
        assert_eq!(not_built.contains(&tag), !on, "{feature}:\n{help}");
    }
    assert!(
        help.contains("cargo install --path dlock-cli --features") && help.contains("`full`"),
        "{help}"
    );
}

#[test]
fn watch_shows_acquisitions_and_releases_until_interrupted() {
    let redis = Redis::start(&["--notify-keyspace-events", "Kghx"]);
    let url = redis.url();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dlock"));
    cmd.args(["watch", "w:*"])
        .env("DLOCK_URL", &url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut p = Proc(spawn_child(cmd).unwrap());
    let (tx, rx) = mpsc::channel();
    let out = p.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let banner = rx.recv_timeout(Duration::from_secs(10)).expect("no banner");
    assert!(banner.starts_with("watching acquisitions"), "{banner}");

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        dlock_runtime::init_named("cli-watch", &url).await.unwrap();
        let g = dlock_runtime::Lock::new("w:1")
            .backend("cli-watch")
            .acquire()
            .await
            .unwrap();
        let other = dlock_runtime::Lock::new("x:1")
            .backend("cli-watch")
            .acquire()
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        g.release().await.unwrap();
        other.release().await.unwrap();
    });
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !lines.iter().any(|l: &String| l.contains("released")) && Instant::now() < deadline {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
            lines.push(l);
        }
    }
    assert!(
        lines.iter().any(|l| l.contains("w:1  acquired")),
        "{lines:?}"
    );
    assert!(
        lines.iter().any(|l| l.contains("w:1  released")),
        "{lines:?}"
    );
    assert!(lines.iter().all(|l| !l.contains("x:1")), "{lines:?}");

    // Ctrl-C ends it with exit 0.
    // SAFETY: kill(2) on our own child, not yet reaped.
    assert_eq!(
        unsafe { libc::kill(p.0.id() as libc::pid_t, libc::SIGINT) },
        0
    );
    let start = Instant::now();
    let status = loop {
        if let Some(s) = p.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "watch did not stop on SIGINT"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0));
}

/// Redlock: `--redlock` with one `--url` per node shows the lock every node holds, with the
/// quorum in `show`, and `unlock` releases it on every node (the holder hears it).
#[test]
fn redlock_nodes_listed_shown_and_unlocked() {
    let nodes: Vec<Redis> = (0..3).map(|_| Redis::start(&[])).collect();
    let urls: Vec<String> = nodes.iter().map(|n| n.url()).collect();
    let mut args: Vec<&str> = vec!["--redlock"];
    for u in &urls {
        args.extend(["--url", u.as_str()]);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let backend = std::sync::Arc::new(
        rt.block_on(
            dlock_runtime::RedlockBackend::builder(&urls)
                .restart_delay(Duration::ZERO)
                .connect(),
        )
        .unwrap(),
    );
    let g = rt
        .block_on(
            dlock_runtime::Lock::new("rl:held")
                .with_backend(backend.clone())
                .ttl(Duration::from_secs(3))
                .acquire(),
        )
        .unwrap();
    let run = |extra: &[&str], stdin: &str| {
        let mut a = args.clone();
        a.extend(extra);
        dlock(&urls[0], &a, stdin)
    };
    let o = run(&["list", "--json"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let held = &v.as_array().unwrap()[0];
    assert_eq!(held["name"], "rl:held");
    assert!(held["fencing_token"].as_u64().unwrap() >= g.fencing_token());
    let o = run(&["show", "rl:held"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("holds 3 of 3 nodes"),
        "{}",
        text(&o)
    );
    let o = run(&["unlock", "rl:held", "--yes"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), g.lost())
            .await
            .expect("the holder hears the unlock")
    });
    assert_eq!(run(&["show", "rl:held"], "").status.code(), Some(3));
    // Several URLs without saying what they are: a usage error, exit 6.
    let o = dlock(
        &urls[0],
        &["--url", &urls[0], "--url", &urls[1], "list"],
        "",
    );
    assert_eq!(o.status.code(), Some(6), "{}", text(&o));
}

/// The database engines through their URLs (the machine's PostgreSQL and MariaDB, a table of
/// this test's own, named by the admin's `dlock_table` parameter): `list --json` shows the
/// holder's token, `unlock --yes` evicts it (its `lost()` fires at its next renewal) and `show`
/// then answers "not held".
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn sql_engine_round_trip(
    rt: &tokio::runtime::Runtime,
    url: &str,
    backend: std::sync::Arc<dyn dlock_runtime::Backend>,
    table: &str,
) {
    // The backend's connections live on `rt`, which runs while the CLI runs (multi-thread), so
    // the holder keeps renewing.
    let g = rt
        .block_on(
            dlock_runtime::Lock::new("cli:sql")
                .with_backend(backend)
                .ttl(Duration::from_secs(3))
                .acquire(),
        )
        .unwrap();
    let admin_url = format!(
        "{url}{}dlock_table={table}",
        if url.contains('?') { "&" } else { "?" }
    );
    let o = dlock(&admin_url, &["list", "cli:*", "--json"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let held = &v.as_array().unwrap()[0];
    assert_eq!(held["name"], "cli:sql");
    assert_eq!(held["fencing_token"].as_u64(), Some(g.fencing_token()));
    let o = dlock(&admin_url, &["unlock", "cli:sql", "--yes"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), g.lost())
            .await
            .expect("the evicted holder hears it")
    });
    assert_eq!(
        dlock(&admin_url, &["show", "cli:sql"], "").status.code(),
        Some(3)
    );
    // Scripts get JSON on stdout for a lock that is not held too (it printed nothing).
    let o = dlock(&admin_url, &["show", "cli:sql", "--json"], "");
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        "null",
        "{}",
        text(&o)
    );
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_lock_table_list_unlock_show() {
    let url = std::env::var("DLOCK_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string());
    let table = format!("dlock_t_cli_pg_{}", std::process::id());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let b = rt
        .block_on(
            dlock_runtime::PostgresBackend::builder(&url)
                .table(&table)
                .connect(),
        )
        .expect("the machine's PostgreSQL (scripts/test starts one)");
    sql_engine_round_trip(&rt, &url, std::sync::Arc::new(b), &table);
    rt.block_on(async {
        let (c, conn) =
            dlock_runtime::tokio_postgres::connect(&url, dlock_runtime::tokio_postgres::NoTls)
                .await
                .unwrap();
        tokio::spawn(conn);
        c.batch_execute(&format!(
            "DROP TABLE {table}; DROP SEQUENCE IF EXISTS {table}_fence; \
             DROP TABLE IF EXISTS {table}_waiters; \
             DROP FUNCTION IF EXISTS {table}_acquire_v1, {table}_acquire_nf_v1, \
             {table}_release_v1, {table}_extend_v1, {table}_extend_nf_v1, \
             {table}_acquire_v2, {table}_acquire_nf_v2, {table}_release_v2, {table}_leave_v2"
        ))
        .await
        .unwrap();
    });
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_lock_table_list_unlock_show() {
    use dlock_runtime::mysql_async::prelude::Queryable;
    let url = std::env::var("DLOCK_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_string());
    let table = format!("dlock_t_cli_my_{}", std::process::id());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let b = rt
        .block_on(
            dlock_runtime::MysqlBackend::builder(&url)
                .table(&table)
                .connect(),
        )
        .expect("the machine's MariaDB (scripts/test starts one)");
    sql_engine_round_trip(&rt, &url, std::sync::Arc::new(b), &table);
    rt.block_on(async {
        let opts = dlock_runtime::mysql_async::Opts::from_url(&url).unwrap();
        let mut c = dlock_runtime::mysql_async::Conn::new(opts).await.unwrap();
        c.query_drop(format!("DROP TABLE {table}")).await.unwrap();
    });
}

/// ZooKeeper and etcd URLs are dispatched to their engines: with nothing listening, each is a
/// connection failure (exit 5) within the call bound, and the URL's password is never printed.
#[cfg(all(feature = "zookeeper", feature = "etcd"))]
#[test]
fn zookeeper_and_etcd_urls_reach_their_engines() {
    for scheme in ["zk", "etcd"] {
        let url = format!("{scheme}://ops:s3cr3t-pw@127.0.0.1:{}", free_port());
        let t0 = Instant::now();
        let o = dlock(&url, &["list"], "");
        assert_eq!(o.status.code(), Some(5), "{scheme}: {}", text(&o));
        assert!(!text(&o).contains("s3cr3t-pw"), "{}", text(&o));
        assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
    }
}

/// `dlock unlock NAME --yes | head -1` once panicked (exit 101) while printing the holder's
/// details to a closed stdout, before sending the unlock: the lock stayed held. A closed stdout is
/// not a panic, and with `--yes` the unlock is sent before anything is printed.
#[test]
fn a_closed_stdout_is_no_panic_and_unlock_still_unlocks() {
    let redis = Redis::start(&[]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let backend = std::sync::Arc::new(
        rt.block_on(dlock_runtime::RedisBackend::connect(&redis.url()))
            .unwrap(),
    );
    let g = rt
        .block_on(
            dlock_runtime::Lock::new("cli:pipe")
                .with_backend(backend)
                .ttl(Duration::from_secs(300))
                .acquire(),
        )
        .unwrap();
    // Runs `dlock` with its stdout a pipe whose reader is already gone.
    let closed_stdout = |args: &[&str]| {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dlock"));
        cmd.args(args)
            .env("DLOCK_URL", redis.url())
            .stdin(Stdio::null())
            .stdout(writer)
            .stderr(Stdio::piped());
        let child = spawn_child(cmd).unwrap();
        let o = child.wait_with_output().unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    for args in [&["list"][..], &["show", "cli:pipe"], &["list", "--json"]] {
        let (code, stderr) = closed_stdout(args);
        assert_eq!(code, Some(0), "dlock {args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "dlock {args:?}: {stderr}");
    }
    let (code, stderr) = closed_stdout(&["unlock", "cli:pipe", "--yes"]);
    assert_eq!(code, Some(0), "unlock: {stderr}");
    let o = dlock(&redis.url(), &["show", "cli:pipe"], "");
    assert_eq!(
        o.status.code(),
        Some(3),
        "the lock is still held: {}",
        text(&o)
    );
    drop(g);
}

/// `dlock watch ...` for a moment, then SIGINT: everything it printed (stdout and stderr).
fn watch_briefly(args: &[&str]) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dlock"));
    cmd.args(args)
        .env_remove("DLOCK_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut p = Proc(spawn_child(cmd).unwrap());
    let start = Instant::now();
    while p.0.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_millis(1500) {
        std::thread::sleep(Duration::from_millis(20));
    }
    if p.0.try_wait().unwrap().is_none() {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(p.0.id() as libc::pid_t, libc::SIGINT) };
    }
    let start = Instant::now();
    while p.0.try_wait().unwrap().is_none() {
        assert!(start.elapsed() < Duration::from_secs(10), "watch hung");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut s = String::new();
    use std::io::Read;
    p.0.stdout.take().unwrap().read_to_string(&mut s).unwrap();
    p.0.stderr.take().unwrap().read_to_string(&mut s).unwrap();
    s
}

/// Every subcommand, human and JSON, against a server reached with the password in the query
/// (`unix://…?pass=`, `redis+unix://…?pass=`, as redis-rs reads it) or the userinfo: the
/// `server` detail, `unlock`'s "on <target>" and `watch`'s header print the URL, never the
/// password. Failed before the shared redactor (the query was printed as written).
#[test]
fn no_subcommand_prints_a_query_password_of_a_working_server() {
    const PW: &str = "Q-s3cret-pw";
    let sock = std::env::temp_dir().join(format!("dlock-cli-{}.sock", std::process::id()));
    let redis = Redis::start(&[
        "--unixsocket",
        sock.to_str().unwrap(),
        "--requirepass",
        PW,
        "--notify-keyspace-events",
        "Kghx",
    ]);
    let sock = sock.display();
    let urls = [
        format!("unix://{sock}?pass={PW}"),
        format!("redis+unix://{sock}?db=0&pass={PW}"),
        format!("redis://:{PW}@127.0.0.1:{}/0", redis.port),
    ];
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for url in &urls {
        let _g = rt.block_on(async {
            dlock_runtime::init_named("cli-secret", url).await.unwrap();
            dlock_runtime::Lock::new("sec:1")
                .backend("cli-secret")
                .ttl(Duration::from_secs(30))
                .acquire()
                .await
                .unwrap()
        });
        for args in [
            &["list"][..],
            &["list", "--json"],
            &["show", "sec:1"],
            &["show", "sec:1", "--json"],
        ] {
            let o = dlock(url, args, "");
            assert_eq!(o.status.code(), Some(0), "{url} {args:?}: {}", text(&o));
            assert!(text(&o).contains("sec:1"), "{args:?}: {}", text(&o));
            assert!(!text(&o).contains(PW), "{args:?}: {}", text(&o));
        }
        let w = watch_briefly(&["--url", url, "watch", "sec:*"]);
        assert!(w.contains("watching"), "{w}");
        assert!(!w.contains(PW), "{w}");
        let o = dlock(url, &["unlock", "sec:1", "--yes"], "");
        assert_eq!(o.status.code(), Some(0), "{url}: {}", text(&o));
        assert!(!text(&o).contains(PW), "{}", text(&o));
    }
}

/// Every URL form a driver accepts (or an easy typo of one), with its secret, and nothing
/// listening: every subcommand fails, and no output shows the secret (each failed before the
/// shared redactor for at least one form: the raw `/` base64 password and the forgotten scheme
/// were echoed whole, the query passwords as written).
#[test]
fn no_subcommand_prints_a_secret_of_any_url_form_on_failure() {
    let p = free_port();
    let forms: Vec<(Vec<String>, &str)> = vec![
        (
            vec![format!("redis://:Zm9v/YmFy+@127.0.0.1:{p}")],
            "Zm9v/YmFy",
        ),
        (vec![format!("redis://:Zm9v%2FYmFy@127.0.0.1:{p}")], "Zm9v"),
        (vec![format!("ops:s3cr3t-pw@127.0.0.1:{p}")], "s3cr3t-pw"),
        (
            vec!["unix:///nonexistent/r.sock?pass=s3cr3t-pw".into()],
            "s3cr3t-pw",
        ),
        (
            vec!["redis+unix:///nonexistent/r.sock?PASS=s3cr3t-pw".into()],
            "s3cr3t-pw",
        ),
        (
            vec![format!("rediss://u:s3cr3t-pw@127.0.0.1:{p}/0")],
            "s3cr3t-pw",
        ),
        (
            vec![format!(
                "postgres://app@127.0.0.1:{p}/app?password=s3cr3t-pw"
            )],
            "s3cr3t-pw",
        ),
        (
            vec![format!("postgresql://app:s3cr3t-pw@127.0.0.1:{p}/app")],
            "s3cr3t-pw",
        ),
        (
            vec![format!("mysql://root@127.0.0.1:{p}/t?password=s3cr3t-pw")],
            "s3cr3t-pw",
        ),
        (vec![format!("zk://ops:s3cr/3t-pw@127.0.0.1:{p}")], "3t-pw"),
        (
            vec![format!("etcd://127.0.0.1:{p}?token=s3cr3t-pw")],
            "s3cr3t-pw",
        ),
        (
            vec![format!("etcds://ops:s3cr3t-pw@127.0.0.1:{p}")],
            "s3cr3t-pw",
        ),
    ];
    let mut runs: Vec<(Vec<String>, &str, Vec<String>)> = Vec::new();
    for (urls, secret) in &forms {
        for extra in [
            &[][..],
            &["--redlock"],
            &["--cluster"],
            &["--sentinel", "m"],
        ] {
            let mut urls = urls.clone();
            if !extra.is_empty() {
                urls.push(format!("redis://127.0.0.1:{p}"));
            }
            runs.push((urls, secret, extra.iter().map(|s| s.to_string()).collect()));
        }
    }
    for (urls, secret, extra) in runs {
        let mut base: Vec<String> = urls
            .iter()
            .flat_map(|u| ["--url".into(), u.clone()])
            .collect();
        base.extend(extra);
        for args in [
            &["list"][..],
            &["list", "--json"],
            &["show", "x"],
            &["show", "x", "--json"],
            &["unlock", "x", "--yes"],
        ] {
            let mut all = base.clone();
            all.extend(args.iter().map(|s| s.to_string()));
            let all: Vec<&str> = all.iter().map(String::as_str).collect();
            let o = dlock("redis://127.0.0.1:1", &all, "");
            assert_ne!(o.status.code(), Some(0), "{all:?}: {}", text(&o));
            assert!(!text(&o).contains(secret), "{all:?}: {}", text(&o));
        }
        let mut all: Vec<&str> = base.iter().map(String::as_str).collect();
        all.push("watch");
        let w = watch_briefly(&all);
        assert!(!w.contains(secret), "{all:?}: {w}");
    }
}

/// Lock names come from end users (`key = "user:{name}"`): control characters in a name (ESC,
/// CR, LF) reached the operator's terminal raw in `list`, `show`, `watch`, `unlock` and the
/// error lines, where they can hide or forge rows. Every text output now escapes them; JSON
/// escapes them by itself.
#[test]
fn control_characters_in_lock_names_never_reach_the_terminal_raw() {
    const EVIL: &str = "evil\u{1b}[2K\rok\nforged\u{9b}row";
    let redis = Redis::start(&["--notify-keyspace-events", "Kghx"]);
    let url = redis.url();
    let raw = |o: &str| o.contains(['\u{1b}', '\r', '\u{9b}']);
    let w_url = url.clone();
    let watcher = std::thread::spawn(move || watch_briefly(&["--url", &w_url, "watch"]));
    std::thread::sleep(Duration::from_millis(500));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let g = rt.block_on(async {
        dlock_runtime::init_named("cli-evil", &url).await.unwrap();
        dlock_runtime::Lock::new(EVIL)
            .backend("cli-evil")
            .ttl(Duration::from_secs(30))
            .acquire()
            .await
            .unwrap()
    });
    let w = watcher.join().unwrap();
    assert!(w.contains("evil"), "the watch saw nothing: {w:?}");
    assert!(!raw(&w), "watch: {w:?}");
    for args in [
        &["list"][..],
        &["show", EVIL],
        &["show", &format!("{EVIL}-not-held")],
        &["unlock", EVIL],
    ] {
        let o = dlock(&url, args, "n\n");
        let t = text(&o);
        assert!(t.contains("evil"), "{args:?}: {t:?}");
        assert!(!raw(&t), "{args:?}: {t:?}");
        // No line was forged: the name stays on one line.
        assert!(
            !t.lines().any(|l| l.starts_with("forged")),
            "{args:?}: {t:?}"
        );
    }
    let o = dlock(&url, &["list", "--json"], "");
    assert!(!raw(&text(&o)), "{:?}", text(&o));
    let o = dlock(&url, &["unlock", EVIL, "--yes"], "");
    assert_eq!(o.status.code(), Some(0), "{:?}", text(&o));
    assert!(!raw(&text(&o)), "{:?}", text(&o));
    drop(g);
}

/// `dlock leader NAME`: with no term held, exit 3 and "none"; while a term (taken in this test
/// process) is held, the leader's owner, its epoch (the term's token), a remaining lease and the
/// value it proclaimed; `--json` carries the same epoch and value.
#[test]
fn leader_shows_the_term_epoch_remaining_and_value() {
    let redis = Redis::start(&[]);
    let url = redis.url();
    let o = dlock(&url, &["leader", "cli-elect"], "");
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("none"),
        "{}",
        text(&o)
    );

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let term = rt.block_on(async {
        dlock_runtime::init_named("cli-test", &url).await.unwrap();
        let term = dlock_runtime::Election::new("cli-elect")
            .ttl(Duration::from_secs(20))
            .value("10.0.0.7:8080")
            .backend("cli-test")
            .campaign()
            .await
            .unwrap();
        term.proclaim("10.0.0.8:9090").await.unwrap();
        term
    });
    let epoch = term.epoch().to_string();
    let o = dlock(&url, &["leader", "cli-elect"], "");
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        out.contains(&format!("epoch          {epoch}")),
        "{}",
        text(&o)
    );
    assert!(out.contains("value          10.0.0.8:9090"), "{}", text(&o));
    assert!(out.contains("remaining      "), "{}", text(&o));
    assert!(out.contains("lock election:cli-elect"), "{}", text(&o));
    let o = dlock(&url, &["leader", "cli-elect", "--json"], "");
    let v: serde_json::Value =
        serde_json::from_slice(&o.stdout).unwrap_or_else(|_| panic!("{}", text(&o)));
    assert_eq!(v["record"]["value"], "10.0.0.8:9090", "{v}");
    assert_eq!(v["record"]["epoch"].to_string(), epoch, "{v}");
    assert_eq!(v["term"]["fencing_token"].to_string(), epoch, "{v}");
    rt.block_on(term.resign()).unwrap();
}

/// A multi-thread runtime whose tasks (the holders' watchdogs) run while the CLI runs.
fn holders_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// `dlock show NAME --json` parsed (with `extra` arguments).
fn show_json(url: &str, name: &str, extra: &[&str]) -> serde_json::Value {
    let mut a = vec!["show", name, "--json"];
    a.extend(extra);
    let o = dlock(url, &a, "");
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o)))
}

/// Polls `show NAME --json` until `ok` holds (10 s bound).
fn show_until(
    url: &str,
    name: &str,
    extra: &[&str],
    what: &str,
    ok: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let v = show_json(url, name, extra);
        if ok(&v) {
            return v;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{what} never seen: {v}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The JSON entry of `owner` in a `show --json` value.
fn owner_entry<'a>(v: &'a serde_json::Value, owner: &str) -> &'a serde_json::Value {
    v["owners"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["owner"] == owner)
        .unwrap_or_else(|| panic!("{owner} not in {v}"))
}

/// Issue 21: a semaphore with two holders (2 + 1 of 3 permits) is listed and shown with its
/// max, each holder's permits, token and lease, the free permits and its waiter; `unlock
/// --owner` evicts exactly one holder: its 2 permits come back and the waiter asking for 2 is
/// woken and gets them, while the other holder keeps its permit. A name held as a lock and as a
/// semaphore needs `--kind`; a semaphore unlocked without `--owner`, or with an owner that holds
/// nothing, is refused.
#[test]
fn semaphore_holders_listed_shown_and_one_evicted() {
    let redis = Redis::start(&[]);
    let url = redis.url();
    let rt = holders_runtime();
    let sem = |n: u32| {
        dlock_runtime::Semaphore::new("cli:sem", 3)
            .backend("cli-sem")
            .permits(n)
            .ttl(Duration::from_secs(20))
    };
    let (g1, g2, lock) = rt.block_on(async {
        dlock_runtime::init_named("cli-sem", &url).await.unwrap();
        let g1 = sem(2).acquire().await.unwrap();
        let g2 = sem(1).acquire().await.unwrap();
        // A plain lock of the same name: another thing, listed beside it.
        let lock = dlock_runtime::Lock::new("cli:sem")
            .backend("cli-sem")
            .ttl(Duration::from_secs(20))
            .acquire()
            .await
            .unwrap();
        (g1, g2, lock)
    });

    let o = dlock(&url, &["list", "--json"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let all = v.as_array().unwrap();
    assert_eq!(all.len(), 2, "{v}");
    assert_eq!(all[0]["kind"], "lock");
    let s = &all[1];
    assert_eq!(s["name"], "cli:sem");
    assert_eq!(s["kind"], "semaphore");
    assert_eq!(s["semaphore"]["max"], 3);
    assert_eq!(s["semaphore"]["used"], 3);
    assert_eq!(s["semaphore"]["free"], 0);
    assert_eq!(s["owners"].as_array().unwrap().len(), 2, "{s}");
    for g in [&g1, &g2] {
        let e = owner_entry(s, g.owner());
        assert_eq!(e["role"], "permits");
        assert_eq!(e["permits"], g.permits());
        assert_eq!(e["token"].as_u64(), Some(g.fencing_token()), "{e}");
        let rem = e["remaining_ms"].as_u64().unwrap();
        assert!(rem > 0 && rem <= 20_000, "{rem}");
    }
    // --kind filters.
    let o = dlock(&url, &["list", "--kind", "sem", "--json"], "");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 1, "{v}");
    // The table: the kind and used/max.
    let o = dlock(&url, &["list"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let row = out
        .lines()
        .find(|l| l.contains("semaphore"))
        .unwrap_or_else(|| panic!("{}", text(&o)));
    assert!(row.contains("3/3"), "{row}");
    assert!(row.contains(&format!("{} (2)", g1.owner())), "{row}");
    assert!(row.contains(&g1.fencing_token().to_string()), "{row}");

    // The name is held as two kinds: `show` without --kind is a usage error.
    let o = dlock(&url, &["show", "cli:sem"], "");
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("--kind"), "{}", text(&o));
    rt.block_on(lock.release()).unwrap();
    let o = dlock(&url, &["show", "cli:sem"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.contains("semaphore      cli:sem"), "{out}");
    assert!(out.contains("permits        3 of 3 held, 0 free"), "{out}");
    assert!(
        out.contains(&format!(
            "owner          {} (2 permits, token {}",
            g1.owner(),
            g1.fencing_token()
        )),
        "{out}"
    );

    // A waiter for 2 permits (wait 30 s), seen as one waiting process.
    let (wtx, wrx) = mpsc::channel::<(Instant, String, u64)>();
    let waiter = rt.spawn(async move {
        let g = dlock_runtime::Semaphore::new("cli:sem", 3)
            .backend("cli-sem")
            .permits(2)
            .ttl(Duration::from_secs(20))
            .wait(Duration::from_secs(30))
            .acquire()
            .await
            .unwrap();
        let _ = wtx.send((Instant::now(), g.owner().to_string(), g.fencing_token()));
        g
    });
    show_until(&url, "cli:sem", &[], "the waiter", |v| v["waiters"] == 1);

    // Refusals: no --owner (usage), an owner that holds nothing (not found), no confirmation.
    let o = dlock(&url, &["unlock", "cli:sem", "--yes"], "");
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let o = dlock(
        &url,
        &["unlock", "cli:sem", "--owner", "nobody", "--yes"],
        "",
    );
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    let o = dlock(&url, &["unlock", "cli:sem", "--owner", g1.owner()], "n\n");
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert_eq!(show_json(&url, "cli:sem", &[])["semaphore"]["used"], 3);

    let t0 = Instant::now();
    let o = dlock(&url, &["unlock", "cli:sem", "--owner", g1.owner()], "y\n");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        text(&o).contains(&format!("evicted {} from semaphore `cli:sem`", g1.owner())),
        "{}",
        text(&o)
    );
    // The 2 freed permits wake the waiter (the holders' leases have 20 s: no lease ran out).
    let (got, w_owner, w_token) = wrx
        .recv_timeout(Duration::from_secs(10))
        .expect("waiter not woken");
    assert!(
        got.duration_since(t0) < Duration::from_secs(5),
        "waiter took {:?} after the eviction",
        got.duration_since(t0)
    );
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(15), g1.lost())
            .await
            .expect("the evicted holder hears it")
    });
    assert!(g2.is_valid());
    let v = show_json(&url, "cli:sem", &[]);
    assert_eq!(v["semaphore"]["used"], 3, "{v}");
    assert_eq!(v["owners"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(owner_entry(&v, g2.owner())["permits"], 1);
    assert_eq!(owner_entry(&v, &w_owner)["permits"], 2);
    assert_eq!(owner_entry(&v, &w_owner)["token"].as_u64(), Some(w_token));
    assert!(
        v["owners"]
            .as_array()
            .unwrap()
            .iter()
            .all(|o| o["owner"] != g1.owner())
    );
    let w = rt.block_on(waiter).unwrap();
    rt.block_on(async {
        w.release().await.unwrap();
        g2.release().await.unwrap();
    });
    let o = dlock(&url, &["show", "cli:sem"], "");
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
}

/// Spawns `dlock args` with its stdin open; returns it once its stdout shows `prompt`, with what
/// it printed so far.
fn dlock_until_prompt(url: &str, args: &[&str], prompt: &str) -> (Proc, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dlock"));
    cmd.args(args)
        .env("DLOCK_URL", url)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = Proc(spawn_child(cmd).unwrap());
    let mut out = child.0.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = std::io::Read::read(&mut out, &mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                return;
            }
        }
    });
    let mut seen = Vec::new();
    let start = Instant::now();
    while !String::from_utf8_lossy(&seen).contains(prompt) {
        let left = Duration::from_secs(20).saturating_sub(start.elapsed());
        match rx.recv_timeout(left) {
            Ok(b) => seen.extend(b),
            Err(_) => panic!(
                "no prompt from dlock {args:?}: {}",
                String::from_utf8_lossy(&seen)
            ),
        }
    }
    // The rest of stdout is drained by the thread (and dropped).
    (child, String::from_utf8_lossy(&seen).into_owned())
}

/// Issue 21: a read-write lock with two readers and a waiting writer is listed and shown with
/// its mode, each reader's hold, token and lease, and the waiting writer's marker; `unlock
/// --owner` evicts one reader (the other keeps its hold, the writer keeps waiting), then the
/// other, which hands the lock to the writer; the write-held lock is shown with its writer. An
/// eviction confirmed after the holder changed (the writer downgraded to a reader while the
/// prompt waited) is refused and leaves the hold alone.
#[test]
fn rwlock_readers_waiting_writer_and_writer_shown_and_evicted() {
    let redis = Redis::start(&[]);
    let url = redis.url();
    let rt = holders_runtime();
    let rw = || {
        dlock_runtime::RwLock::new("cli:rw")
            .backend("cli-rw")
            .ttl(Duration::from_secs(20))
    };
    let (r1, r2) = rt.block_on(async {
        dlock_runtime::init_named("cli-rw", &url).await.unwrap();
        (rw().read().await.unwrap(), rw().read().await.unwrap())
    });
    let (wtx, wrx) = mpsc::channel::<(Instant, String, u64)>();
    let writer = rt.spawn(async move {
        let g = dlock_runtime::RwLock::new("cli:rw")
            .backend("cli-rw")
            .ttl(Duration::from_secs(20))
            .wait(Duration::from_secs(30))
            .write()
            .await
            .unwrap();
        let _ = wtx.send((Instant::now(), g.owner().to_string(), g.fencing_token()));
        g
    });
    let v = show_until(&url, "cli:rw", &[], "the waiting writer", |v| {
        v["rwlock"]["waiting_writer"]["owner"].is_string()
    });
    assert_eq!(v["kind"], "rwlock");
    assert_eq!(v["rwlock"]["mode"], "read");
    assert_eq!(v["rwlock"]["readers"], 2);
    assert_eq!(v["rwlock"]["writer"], serde_json::Value::Null);
    let w_owner = v["rwlock"]["waiting_writer"]["owner"]
        .as_str()
        .unwrap()
        .to_string();
    let rem = v["rwlock"]["waiting_writer"]["remaining_ms"]
        .as_u64()
        .unwrap();
    assert!(rem > 0 && rem <= 20_000, "{rem}");
    for g in [&r1, &r2] {
        let e = owner_entry(&v, g.owner());
        assert_eq!(e["role"], "read");
        assert_eq!(e["holds"], 1);
        assert_eq!(e["token"].as_u64(), Some(g.fencing_token()), "{e}");
        let rem = e["remaining_ms"].as_u64().unwrap();
        assert!(rem > 0 && rem <= 20_000, "{rem}");
    }
    let o = dlock(&url, &["list", "cli:*"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let row = out
        .lines()
        .find(|l| l.starts_with("cli:rw"))
        .unwrap_or_else(|| panic!("{}", text(&o)));
    assert!(row.contains("rwlock"), "{row}");
    assert!(row.contains("read 2, writer waiting"), "{row}");
    let o = dlock(&url, &["show", "cli:rw"], "");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.contains("mode           read (2 readers)"), "{out}");
    assert!(
        out.contains(&format!(
            "reader         {} (1 hold, token {}",
            r1.owner(),
            r1.fencing_token()
        )),
        "{out}"
    );
    assert!(
        out.contains(&format!("writer waiting {w_owner} (marker lease")),
        "{out}"
    );

    // Evict one reader: the other keeps its hold and the writer still waits.
    let o = dlock(
        &url,
        &[
            "unlock",
            "cli:rw",
            "--kind",
            "rw",
            "--owner",
            r1.owner(),
            "--yes",
        ],
        "",
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(15), r1.lost())
            .await
            .expect("the evicted reader hears it")
    });
    let v = show_json(&url, "cli:rw", &[]);
    assert_eq!(v["rwlock"]["readers"], 1, "{v}");
    assert_eq!(owner_entry(&v, r2.owner())["role"], "read");
    assert_eq!(v["rwlock"]["waiting_writer"]["owner"], w_owner.as_str());
    assert!(wrx.try_recv().is_err(), "the writer got in beside a reader");

    // Evict the last reader: the writer is woken and granted.
    let t0 = Instant::now();
    let o = dlock(
        &url,
        &["unlock", "cli:rw", "--owner", r2.owner(), "--yes"],
        "",
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let (got, owner, token) = wrx
        .recv_timeout(Duration::from_secs(10))
        .expect("writer not granted");
    assert!(
        got.duration_since(t0) < Duration::from_secs(5),
        "writer took {:?}",
        got.duration_since(t0)
    );
    assert_eq!(owner, w_owner);
    let w = rt.block_on(writer).unwrap();

    // Write-held: the writer, its token; no readers, no one waiting.
    let v = show_json(&url, "cli:rw", &[]);
    assert_eq!(v["rwlock"]["mode"], "write", "{v}");
    assert_eq!(v["rwlock"]["writer"], w_owner.as_str());
    assert_eq!(v["rwlock"]["readers"], 0);
    assert_eq!(v["rwlock"]["waiting_writer"], serde_json::Value::Null);
    assert_eq!(v["fencing_token"].as_u64(), Some(token));
    assert_eq!(owner_entry(&v, &w_owner)["role"], "write");
    let o = dlock(&url, &["show", "cli:rw"], "");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.contains("mode           write"), "{out}");
    assert!(
        out.contains(&format!("writer         {w_owner} (1 hold, token {token}")),
        "{out}"
    );
    let o = dlock(&url, &["list"], "");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let row = out.lines().find(|l| l.starts_with("cli:rw")).unwrap();
    assert!(row.contains(&format!("{w_owner} (write)")), "{row}");

    // Shown as the writer, confirmed after it downgraded (same owner, now a reader): refused.
    let (mut child, shown) =
        dlock_until_prompt(&url, &["unlock", "cli:rw", "--owner", &w_owner], "[y/N]");
    assert!(shown.contains("its write hold"), "{shown}");
    let r = rt.block_on(w.downgrade()).unwrap();
    child.0.stdin.take().unwrap().write_all(b"y\n").unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "unlock hung");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(status.code(), Some(4));
    assert!(r.is_valid());
    let v = show_json(&url, "cli:rw", &[]);
    assert_eq!(v["rwlock"]["mode"], "read", "{v}");
    assert_eq!(owner_entry(&v, &w_owner)["role"], "read");
    rt.block_on(r.release()).unwrap();
    assert_eq!(dlock(&url, &["show", "cli:rw"], "").status.code(), Some(3));
}

/// An engine whose admin reads plain locks only (here Redlock) still lists its locks, says so
/// on stderr, and answers a semaphore or read-write question with exit 6.
#[test]
fn engines_without_semaphore_admin_answer_unsupported() {
    let nodes = [Redis::start(&[]), Redis::start(&[])];
    let (url, url2) = (nodes[0].url(), nodes[1].url());
    let base = ["--redlock", "--url", url.as_str(), "--url", url2.as_str()];
    let run = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend(extra);
        dlock(&url, &a, "")
    };
    let o = run(&["list"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("plain locks only"), "{}", text(&o));
    for args in [
        &["show", "x", "--kind", "semaphore"][..],
        &["list", "--kind", "rwlock"],
        &["unlock", "x", "--kind", "sem", "--owner", "o", "--yes"],
    ] {
        let o = run(args);
        assert_eq!(o.status.code(), Some(6), "{args:?}: {}", text(&o));
        assert!(text(&o).contains("does not read"), "{}", text(&o));
    }
}
