//! The database engines' part of the test environment: each `Env::postgres()` gets its own lock
//! table (and fencing sequence) in the machine's PostgreSQL (`DLOCK_PG_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`), dropped again when the environment is dropped, so
//! tests running at the same time never see each other's rows. A server that does not answer
//! fails the test with a message naming `scripts/test`, which installs and starts one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The engine-specific state of an [`super::Env`] on a database.
#[derive(Debug)]
pub struct DbEnv {
    pub url: String,
    pub table: String,
}

/// A table name unique to this process and call.
pub fn unique_table(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "dlock_t_{tag}_{}_{}_{nanos}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// `url` with one more query parameter (`k=v`, or several joined by `&`).
#[allow(dead_code)]
pub fn with_param(url: &str, kv: &str) -> String {
    if url.contains('?') {
        format!("{url}&{kv}")
    } else {
        format!("{url}?{kv}")
    }
}

#[cfg(feature = "postgres")]
pub use pg::*;

#[cfg(feature = "postgres")]
mod pg {
    use super::*;
    use dlock::tokio_postgres;

    /// The shared test PostgreSQL.
    pub fn pg_url() -> String {
        std::env::var("DLOCK_PG_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string())
    }

    /// An admin connection to `url` on the current runtime.
    pub async fn pg_admin(url: &str) -> tokio_postgres::Client {
        let (client, conn) = tokio::time::timeout(
            Duration::from_secs(5),
            tokio_postgres::connect(url, tokio_postgres::NoTls),
        )
        .await
        .unwrap_or_else(|_| panic!("PostgreSQL at {url} did not answer within 5 s"))
        .unwrap_or_else(|e| {
            panic!(
                "cannot connect to PostgreSQL at {url}: {e}. The tests need a PostgreSQL with \
                 trust auth and a database `test`: run scripts/test (it installs and starts one)."
            )
        });
        tokio::spawn(conn);
        client
    }

    /// A backend on `url` and `table`.
    pub async fn pg_backend(url: &str, table: &str) -> dlock::PostgresBackend {
        dlock::PostgresBackend::builder(url)
            .table(table)
            .connect()
            .await
            .unwrap_or_else(|e| panic!("PostgresBackend on {url} table {table}: {e}"))
    }

    /// A backend in advisory-lock mode on `url`, keyed (and minting tokens) by `table`.
    pub async fn pg_advisory_backend(url: &str, table: &str) -> dlock::PostgresBackend {
        dlock::PostgresBackend::builder(url)
            .table(table)
            .advisory(true)
            .connect()
            .await
            .unwrap_or_else(|e| panic!("advisory PostgresBackend on {url} table {table}: {e}"))
    }

    /// `pg_locks`' condition for the session-level advisory lock of `name` in `table`'s key
    /// space (a bigint key is classid = high 32 bits, objid = low 32 bits, objsubid = 1).
    fn advisory_where(table: &str, name: &str) -> String {
        let k = dlock::postgres_advisory_key(table, name) as u64;
        format!(
            "locktype = 'advisory' AND granted AND database = \
             (SELECT oid FROM pg_database WHERE datname = current_database()) \
             AND classid = '{}'::oid AND objid = '{}'::oid AND objsubid = 1",
            k >> 32,
            k & 0xffff_ffff
        )
    }

    impl DbEnv {
        /// Terminates the session that holds `name`'s advisory lock and waits until it is gone;
        /// returns how many sessions were terminated.
        pub async fn pg_advisory_kill(&self, name: &str) -> u64 {
            let c = pg_admin(&self.url).await;
            let rows = c
                .query(
                    &format!(
                        "SELECT pg_terminate_backend(pid, 5000) FROM pg_locks WHERE {}",
                        advisory_where(&self.table, name)
                    ),
                    &[],
                )
                .await
                .expect("pg_terminate_backend");
            rows.iter().filter(|r| r.get::<_, bool>(0)).count() as u64
        }

        pub async fn pg_advisory_is_locked(&self, name: &str) -> bool {
            let c = pg_admin(&self.url).await;
            let rows = c
                .query(
                    &format!(
                        "SELECT 1 FROM pg_locks WHERE {}",
                        advisory_where(&self.table, name)
                    ),
                    &[],
                )
                .await
                .expect("SELECT pg_locks");
            !rows.is_empty()
        }

        pub async fn pg_delete(&self, name: &str) -> u64 {
            let c = pg_admin(&self.url).await;
            c.execute(
                &format!("DELETE FROM {} WHERE name = $1", self.table),
                &[&name.as_bytes()],
            )
            .await
            .expect("DELETE")
        }

        pub async fn pg_is_locked(&self, name: &str) -> bool {
            let c = pg_admin(&self.url).await;
            let rows = c
                .query(
                    &format!(
                        "SELECT 1 FROM {} WHERE name = $1 AND expires_at > clock_timestamp()",
                        self.table
                    ),
                    &[&name.as_bytes()],
                )
                .await
                .expect("SELECT");
            !rows.is_empty()
        }

        pub async fn pg_live_rows(&self) -> i64 {
            let c = pg_admin(&self.url).await;
            c.query_one(
                &format!(
                    "SELECT count(*) FROM {} WHERE expires_at > clock_timestamp()",
                    self.table
                ),
                &[],
            )
            .await
            .expect("SELECT count")
            .get(0)
        }
    }

    impl Drop for DbEnv {
        fn drop(&mut self) {
            #[cfg(feature = "mysql")]
            if self.url.starts_with("mysql") {
                self.my_drop();
                return;
            }
            let (url, table) = (self.url.clone(), self.table.clone());
            // A runtime of its own on a thread of its own: Drop may run inside the test's runtime.
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .ok()?;
                rt.block_on(async {
                    let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                        .await
                        .ok()?;
                    tokio::spawn(conn);
                    let _ = tokio::time::timeout(
                        Duration::from_secs(5),
                        c.batch_execute(&format!(
                            "DROP TABLE IF EXISTS {table}; DROP SEQUENCE IF EXISTS {table}_fence; \
                             DROP TABLE IF EXISTS {table}_waiters; \
                             DROP TABLE IF EXISTS {table}_records, {table}_sem, {table}_permits, \
                             {table}_rw, {table}_rw_holds; \
                             DROP FUNCTION IF EXISTS {table}_acquire_v1, {table}_acquire_nf_v1, \
                             {table}_release_v1, {table}_extend_v1, {table}_extend_nf_v1, \
                             {table}_acquire_v2, {table}_acquire_nf_v2, {table}_release_v2, \
                             {table}_leave_v2, {table}_extend_v3, {table}_extend_nf_v3, \
                             {table}_acquire_v4, {table}_acquire_nf_v4, {table}_acquire_q_v4, \
                             {table}_acquire_q_nf_v4, {table}_release_q_v4, {table}_leave_v4, \
                             {table}_extend_v4, {table}_extend_nf_v4, {table}_acquire_v5, \
                             {table}_acquire_nf_v5, {table}_acquire_q_v5, {table}_acquire_q_nf_v5, \
                             {table}_sc_f;"
                        )),
                    )
                    .await;
                    Some(())
                })
            })
            .join();
        }
    }
}

#[cfg(feature = "mysql")]
pub use my::*;

#[cfg(feature = "mysql")]
mod my {
    use super::*;
    use dlock::mysql_async::{self, prelude::Queryable};

    /// The shared test MariaDB / MySQL.
    pub fn my_url() -> String {
        std::env::var("DLOCK_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_string())
    }

    /// An admin connection to `url`.
    pub async fn my_admin(url: &str) -> mysql_async::Conn {
        let opts = mysql_async::Opts::from_url(url).expect("mysql url");
        tokio::time::timeout(Duration::from_secs(5), mysql_async::Conn::new(opts))
            .await
            .unwrap_or_else(|_| panic!("MySQL at {url} did not answer within 5 s"))
            .unwrap_or_else(|e| {
                panic!(
                    "cannot connect to MySQL/MariaDB at {url}: {e}. The tests need one with root \
                     and no password and a database `test`: run scripts/test (it installs and starts one)."
                )
            })
    }

    /// A backend on `url` and `table`.
    pub async fn my_backend(url: &str, table: &str) -> dlock::MysqlBackend {
        dlock::MysqlBackend::builder(url)
            .table(table)
            .connect()
            .await
            .unwrap_or_else(|e| panic!("MysqlBackend on {url} table {table}: {e}"))
    }

    fn hex(name: &str) -> String {
        name.bytes().map(|b| format!("{b:02x}")).collect()
    }

    impl DbEnv {
        pub async fn my_delete(&self, name: &str) -> u64 {
            let mut c = my_admin(&self.url).await;
            c.query_drop(format!(
                "DELETE FROM {} WHERE name = X'{}' AND expires_at > UTC_TIMESTAMP(6)",
                self.table,
                hex(name)
            ))
            .await
            .expect("DELETE");
            c.affected_rows()
        }

        pub async fn my_is_locked(&self, name: &str) -> bool {
            let mut c = my_admin(&self.url).await;
            let n: Option<i64> = c
                .query_first(format!(
                    "SELECT COUNT(*) FROM {} WHERE name = X'{}' AND expires_at > UTC_TIMESTAMP(6)",
                    self.table,
                    hex(name)
                ))
                .await
                .expect("SELECT");
            n.unwrap_or(0) > 0
        }

        pub async fn my_live_rows(&self) -> i64 {
            let mut c = my_admin(&self.url).await;
            let n: Option<i64> = c
                .query_first(format!(
                    "SELECT COUNT(*) FROM {} WHERE expires_at > UTC_TIMESTAMP(6)",
                    self.table
                ))
                .await
                .expect("SELECT");
            n.unwrap_or(0)
        }

        pub fn my_drop(&self) {
            let (url, table) = (self.url.clone(), self.table.clone());
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .ok()?;
                rt.block_on(async {
                    let opts = mysql_async::Opts::from_url(&url).ok()?;
                    let mut c = mysql_async::Conn::new(opts).await.ok()?;
                    let _ = tokio::time::timeout(
                        Duration::from_secs(5),
                        c.query_drop(format!("DROP TABLE IF EXISTS {table}, {table}_records")),
                    )
                    .await;
                    let _ = c.disconnect().await;
                    Some(())
                })
            })
            .join();
        }
    }
}

#[cfg(not(feature = "postgres"))]
impl Drop for DbEnv {
    fn drop(&mut self) {
        #[cfg(feature = "mysql")]
        if self.url.starts_with("mysql") {
            self.my_drop();
        }
    }
}

impl super::Env {
    /// How soon after a release in another client a waiter must hold the lock: 200 ms where
    /// releases are pushed (Redis pub/sub, PostgreSQL NOTIFY, the memory queue); on MySQL, which
    /// polls every 100–250 ms, the poll cap plus the same 200 ms of slack.
    pub fn handoff_budget(&self) -> Duration {
        #[cfg(feature = "mysql")]
        if self.kind == super::Kind::Mysql {
            return Duration::from_millis(450);
        }
        // ZooKeeper: delete, watch event, then a children read on a JVM server; 340 ms was seen
        // in a clean-clone CI run on 2 cores (still ~100x below the 30 s lease the test rules out).
        #[cfg(feature = "zookeeper")]
        if self.kind == super::Kind::Zookeeper {
            return Duration::from_millis(450);
        }
        Duration::from_millis(200)
    }
}

// ---------------------------------------------------------------------------------------------
// A private PostgreSQL server (initdb + postgres in a temp dir, on a free loopback port)
// ---------------------------------------------------------------------------------------------

#[cfg(feature = "postgres")]
#[allow(unused_imports)]
pub use pgproc::{PgBouncer, PgProc, pgbouncer_bin};

#[cfg(feature = "postgres")]
mod pgproc {
    use std::path::PathBuf;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    use super::super::{TempDir, free_port_pub, spawn_child};
    use std::os::unix::process::CommandExt;

    /// A private PostgreSQL cluster run as the `postgres` user (initdb refuses root). Killed on
    /// drop; `pause`/`resume` stop and continue the postmaster and all its backends.
    #[derive(Debug)]
    pub struct PgProc {
        dir: TempDir,
        bin: PathBuf,
        port: u16,
        uid: u32,
        gid: u32,
        child: Option<Child>,
    }

    fn pg_bin() -> PathBuf {
        let mut v: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .unwrap_or_else(|e| {
                panic!("no /usr/lib/postgresql ({e}): run scripts/test, which installs Debian's postgresql")
            })
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|p| p.join("initdb").exists())
            .collect();
        v.sort_by_key(|p| {
            p.parent()
                .and_then(|p| p.file_name())
                .and_then(|n| n.to_str())
                .and_then(|n| n.parse::<u32>().ok())
                .unwrap_or(0)
        });
        v.pop().expect("an initdb under /usr/lib/postgresql/*/bin")
    }

    fn postgres_user() -> (u32, u32) {
        let name = std::ffi::CString::new("postgres").unwrap();
        // SAFETY: getpwnam with a valid C string; the result is read at once.
        let pw = unsafe { libc::getpwnam(name.as_ptr()) };
        assert!(
            !pw.is_null(),
            "no `postgres` user: install Debian's postgresql"
        );
        // SAFETY: non-null passwd entry.
        unsafe { ((*pw).pw_uid, (*pw).pw_gid) }
    }

    fn chown(p: &std::path::Path, uid: u32, gid: u32) {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: chown(2) on a path we created.
        let r = unsafe { libc::chown(c.as_ptr(), uid, gid) };
        assert_eq!(r, 0, "chown {}", p.display());
    }

    impl PgProc {
        pub fn start() -> PgProc {
            Self::start_with_tls(None)
        }

        /// A private server with `ssl = on` and the given server certificate and key (PEM),
        /// as `server.crt` / `server.key` in its data directory.
        pub fn start_tls(cert_pem: &str, key_pem: &str) -> PgProc {
            Self::start_with_tls(Some((cert_pem, key_pem)))
        }

        fn start_with_tls(tls: Option<(&str, &str)>) -> PgProc {
            let (uid, gid) = postgres_user();
            let dir = TempDir::new("pg");
            chown(dir.path(), uid, gid);
            let bin = pg_bin();
            let data = dir.path().join("data");
            let out = Command::new(bin.join("initdb"))
                .arg("-D")
                .arg(&data)
                .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
                .uid(uid)
                .gid(gid)
                .stdin(Stdio::null())
                .output()
                .expect("run initdb");
            assert!(
                out.status.success(),
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            if let Some((cert, key)) = tls {
                use std::io::Write as _;
                use std::os::unix::fs::PermissionsExt;
                let (c, k) = (data.join("server.crt"), data.join("server.key"));
                std::fs::write(&c, cert).expect("write server.crt");
                std::fs::write(&k, key).expect("write server.key");
                // PostgreSQL refuses a key readable by others.
                std::fs::set_permissions(&k, std::fs::Permissions::from_mode(0o600)).unwrap();
                chown(&c, uid, gid);
                chown(&k, uid, gid);
                let mut conf = std::fs::OpenOptions::new()
                    .append(true)
                    .open(data.join("postgresql.conf"))
                    .expect("postgresql.conf");
                writeln!(conf, "ssl = on").unwrap();
            }
            let mut p = PgProc {
                dir,
                bin,
                port: 0,
                uid,
                gid,
                child: None,
            };
            let mut last = String::new();
            for _ in 0..5 {
                p.port = free_port_pub();
                match p.spawn_and_wait() {
                    Ok(()) => return p,
                    Err(e) => last = e,
                }
            }
            panic!("private postgres did not start: {last}");
        }

        fn spawn_and_wait(&mut self) -> Result<(), String> {
            let log = self.dir.path().join("pg.log");
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .map_err(|e| e.to_string())?;
            chown(&log, self.uid, self.gid);
            let mut cmd = Command::new(self.bin.join("postgres"));
            cmd.arg("-D")
                .arg(self.dir.path().join("data"))
                .args(["-p", &self.port.to_string()])
                .args(["-c", "listen_addresses=127.0.0.1"])
                .arg("-c")
                .arg(format!(
                    "unix_socket_directories={}",
                    self.dir.path().display()
                ))
                .args(["-c", "fsync=off", "-c", "max_connections=50"])
                .uid(self.uid)
                .gid(self.gid)
                .stdin(Stdio::null())
                .stdout(f.try_clone().map_err(|e| e.to_string())?)
                .stderr(f);
            let mut child = spawn_child(cmd).map_err(|e| format!("spawn postgres: {e}"))?;
            let start = Instant::now();
            loop {
                if let Ok(Some(st)) = child.try_wait() {
                    return Err(format!(
                        "postgres exited {st}: {}",
                        std::fs::read_to_string(&log).unwrap_or_default()
                    ));
                }
                if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
                    && Command::new(self.bin.join("pg_isready"))
                        .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-q"])
                        .status()
                        .is_ok_and(|s| s.success())
                {
                    self.child = Some(child);
                    return Ok(());
                }
                if start.elapsed() > Duration::from_secs(20) {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err("postgres did not accept connections within 20 s".into());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }

        pub fn url(&self) -> String {
            format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
        }

        fn pids(&self) -> Vec<i32> {
            let Some(c) = &self.child else { return vec![] };
            let pm = c.id() as i32;
            let mut v = vec![pm];
            if let Ok(rd) = std::fs::read_dir("/proc") {
                for e in rd.flatten() {
                    let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                        continue;
                    };
                    let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
                    // pid (comm) state ppid ...
                    let ppid = stat
                        .rsplit_once(") ")
                        .and_then(|(_, r)| r.split_whitespace().nth(1))
                        .and_then(|s| s.parse::<i32>().ok());
                    if ppid == Some(pm) {
                        v.push(pid);
                    }
                }
            }
            v
        }

        /// SIGSTOP the postmaster and every backend: the server stops answering.
        pub fn pause(&self) {
            for pid in self.pids() {
                // SAFETY: kill(2) on processes of our private cluster.
                unsafe { libc::kill(pid, libc::SIGSTOP) };
            }
        }

        /// SIGCONT after [`PgProc::pause`].
        pub fn resume(&self) {
            for pid in self.pids().into_iter().rev() {
                // SAFETY: as above.
                unsafe { libc::kill(pid, libc::SIGCONT) };
            }
        }

        /// Immediate shutdown (SIGQUIT to the postmaster, which ends its backends), then reap.
        pub fn stop(&mut self) {
            if let Some(mut c) = self.child.take() {
                // SAFETY: kill(2) on our child.
                unsafe { libc::kill(c.id() as i32, libc::SIGQUIT) };
                let start = Instant::now();
                while c.try_wait().ok().flatten().is_none() {
                    if start.elapsed() > Duration::from_secs(10) {
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }

        /// Starts the server again on the same port and data directory.
        pub fn start_again(&mut self) {
            let start = Instant::now();
            loop {
                match self.spawn_and_wait() {
                    Ok(()) => return,
                    Err(e) if start.elapsed() > Duration::from_secs(20) => {
                        panic!("restart of the private postgres failed: {e}")
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(200)),
                }
            }
        }
    }

    impl Drop for PgProc {
        fn drop(&mut self) {
            self.resume();
            self.stop();
        }
    }

    /// A private PgBouncer (Debian's `pgbouncer`, run as `postgres`: it refuses root) in a temp
    /// dir on a free loopback port, in front of the PostgreSQL at `127.0.0.1:upstream_port`,
    /// with `pool_mode` as given, trust auth for `postgres`, server connections handed out
    /// round-robin (two in transaction mode). Killed on drop.
    #[derive(Debug)]
    pub struct PgBouncer {
        _dir: TempDir,
        port: u16,
        child: Child,
    }

    /// Where Debian installs pgbouncer (scripts/test installs the package when missing).
    pub fn pgbouncer_bin() -> Option<PathBuf> {
        ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
    }

    impl PgBouncer {
        pub fn start(upstream_port: u16, pool_mode: &str) -> PgBouncer {
            let bin = pgbouncer_bin()
                .expect("no pgbouncer: run scripts/test, which installs Debian's pgbouncer");
            let (uid, gid) = postgres_user();
            let dir = TempDir::new("pgbouncer");
            chown(dir.path(), uid, gid);
            let users = dir.path().join("users.txt");
            std::fs::write(&users, "\"postgres\" \"\"\n").expect("write users.txt");
            chown(&users, uid, gid);
            let mut last = String::new();
            for _ in 0..5 {
                let port = free_port_pub();
                let ini = dir.path().join("pgbouncer.ini");
                let log = dir.path().join("pgbouncer.log");
                std::fs::write(
                    &ini,
                    format!(
                        "[databases]\n* = host=127.0.0.1 port={upstream_port}\n\
                         [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n\
                         unix_socket_dir =\nauth_type = trust\nauth_file = {}\n\
                         pool_mode = {pool_mode}\ndefault_pool_size = {size}\nmin_pool_size = 2\n\
                         server_round_robin = 1\n\
                         ignore_startup_parameters = extra_float_digits,options,application_name\n\
                         logfile = {}\n",
                        users.display(),
                        log.display(),
                        // Transaction mode: two server sessions shared by every client. Session
                        // mode pins one per client, so it needs one per connection of ours.
                        size = if pool_mode == "transaction" { 2 } else { 20 },
                    ),
                )
                .expect("write pgbouncer.ini");
                chown(&ini, uid, gid);
                let mut cmd = Command::new(&bin);
                cmd.arg(&ini)
                    .uid(uid)
                    .gid(gid)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null());
                let mut child = spawn_child(cmd).expect("spawn pgbouncer");
                let start = Instant::now();
                loop {
                    if let Ok(Some(st)) = child.try_wait() {
                        last = format!(
                            "pgbouncer exited {st}: {}",
                            std::fs::read_to_string(&log).unwrap_or_default()
                        );
                        break;
                    }
                    if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                        return PgBouncer {
                            _dir: dir,
                            port,
                            child,
                        };
                    }
                    if start.elapsed() > Duration::from_secs(10) {
                        let _ = child.kill();
                        let _ = child.wait();
                        last = "pgbouncer did not listen within 10 s".into();
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            panic!("private pgbouncer did not start: {last}");
        }

        /// A URL for database `db` through the pooler.
        pub fn url(&self, db: &str) -> String {
            format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
        }
    }

    impl Drop for PgBouncer {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl super::Env {
    /// Deletes the lock's row when there is a live one (no assertion).
    pub async fn force_delete_if_present(&self, name: &str) {
        if self.is_locked(name).await {
            self.force_delete(name).await;
        }
    }
}

impl super::Env {
    /// A hang bound for a long run of acquisitions: `base` where an acquire + release costs one
    /// or two round trips; twice that on MySQL, where each of its autocommit statements is a
    /// durable InnoDB commit (`innodb_flush_log_at_trx_commit = 1` on the shared server) and
    /// cross-client hand-offs wait for a poll, and on Redlock (three servers a call).
    pub fn run_bound(&self, base: Duration) -> Duration {
        #[cfg(feature = "mysql")]
        if self.kind == super::Kind::Mysql {
            return base * 2;
        }
        // Redlock: every try and release is a round trip to three servers, and under the full
        // suite's load (cluster, ZooKeeper and etcd servers starting beside it) one run of the
        // 2,016-acquisition exclusion test took 66 s where it takes 5 s alone.
        if self.kind == super::Kind::Redlock {
            return base * 2;
        }
        base
    }
}

// ---------------------------------------------------------------------------------------------
// A private MariaDB server (mariadb-install-db + mariadbd in a temp dir, on a free port)
// ---------------------------------------------------------------------------------------------

#[cfg(feature = "mysql")]
#[allow(unused_imports)]
pub use myproc::MyProc;

#[cfg(feature = "mysql")]
mod myproc {
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    use super::super::{TempDir, free_port_pub, spawn_child};

    /// A private `mariadbd` (grant tables skipped: any user, no password) on a free loopback
    /// port. Killed on drop.
    #[derive(Debug)]
    pub struct MyProc {
        dir: TempDir,
        port: u16,
        child: Option<Child>,
        tls: bool,
    }

    impl MyProc {
        pub fn start() -> MyProc {
            Self::start_with_tls(None)
        }

        /// A private server with TLS on: the given server certificate and key (PEM) as
        /// `server.crt` / `server.key` in its directory (`--ssl-cert`, `--ssl-key`).
        pub fn start_tls(cert_pem: &str, key_pem: &str) -> MyProc {
            Self::start_with_tls(Some((cert_pem, key_pem)))
        }

        fn start_with_tls(tls: Option<(&str, &str)>) -> MyProc {
            let dir = TempDir::new("maria");
            let data = dir.path().join("data");
            // A temp dir of its own: installs running at once collided on /tmp's temporary
            // tables ("Could not remove temporary table ... Unknown table").
            let tmp = dir.path().join("tmp");
            std::fs::create_dir_all(&tmp).expect("mariadb tmpdir");
            let out = Command::new("mariadb-install-db")
                .arg("--no-defaults")
                .arg(format!("--datadir={}", data.display()))
                .arg(format!("--tmpdir={}", tmp.display()))
                .args([
                    "--user=root",
                    "--skip-test-db",
                    "--auth-root-authentication-method=normal",
                ])
                .stdin(Stdio::null())
                .output()
                .unwrap_or_else(|e| {
                    panic!("mariadb-install-db: {e}; run scripts/test (it installs mariadb-server)")
                });
            assert!(
                out.status.success(),
                "mariadb-install-db failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            if let Some((cert, key)) = tls {
                std::fs::write(dir.path().join("server.crt"), cert).expect("write server.crt");
                std::fs::write(dir.path().join("server.key"), key).expect("write server.key");
            }
            let mut p = MyProc {
                dir,
                port: 0,
                child: None,
                tls: tls.is_some(),
            };
            let mut last = String::new();
            for _ in 0..5 {
                p.port = free_port_pub();
                match p.spawn_and_wait() {
                    Ok(()) => return p,
                    Err(e) => last = e,
                }
            }
            panic!("private mariadbd did not start: {last}");
        }

        fn spawn_and_wait(&mut self) -> Result<(), String> {
            let log = self.dir.path().join("maria.log");
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .map_err(|e| e.to_string())?;
            let mut cmd = Command::new("mariadbd");
            cmd.arg("--no-defaults")
                .arg(format!(
                    "--datadir={}",
                    self.dir.path().join("data").display()
                ))
                .arg(format!(
                    "--socket={}",
                    self.dir.path().join("sock").display()
                ))
                .arg(format!(
                    "--tmpdir={}",
                    self.dir.path().join("tmp").display()
                ))
                .arg(format!("--port={}", self.port))
                .args([
                    "--bind-address=127.0.0.1",
                    "--user=root",
                    "--skip-grant-tables",
                    "--skip-log-bin",
                    "--innodb-flush-log-at-trx-commit=2",
                    "--innodb-buffer-pool-size=32M",
                ])
                .arg(format!(
                    "--pid-file={}",
                    self.dir.path().join("pid").display()
                ));
            if self.tls {
                cmd.arg(format!(
                    "--ssl-cert={}",
                    self.dir.path().join("server.crt").display()
                ))
                .arg(format!(
                    "--ssl-key={}",
                    self.dir.path().join("server.key").display()
                ));
            }
            cmd.stdin(Stdio::null())
                .stdout(f.try_clone().map_err(|e| e.to_string())?)
                .stderr(f);
            let mut child = spawn_child(cmd).map_err(|e| format!("spawn mariadbd: {e}"))?;
            let start = Instant::now();
            loop {
                if let Ok(Some(st)) = child.try_wait() {
                    return Err(format!(
                        "mariadbd exited {st}: {}",
                        std::fs::read_to_string(&log).unwrap_or_default()
                    ));
                }
                if Command::new("mariadb-admin")
                    .args(["-h", "127.0.0.1", "-P", &self.port.to_string(), "-uroot"])
                    .args(["--connect-timeout=1", "ping"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
                {
                    let ok = Command::new("mariadb")
                        .args(["-h", "127.0.0.1", "-P", &self.port.to_string(), "-uroot"])
                        .args(["-e", "CREATE DATABASE IF NOT EXISTS test"])
                        .status()
                        .is_ok_and(|s| s.success());
                    if !ok {
                        return Err("CREATE DATABASE test failed".into());
                    }
                    self.child = Some(child);
                    return Ok(());
                }
                if start.elapsed() > Duration::from_secs(30) {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err("mariadbd did not answer within 30 s".into());
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }

        pub fn url(&self) -> String {
            format!("mysql://root@127.0.0.1:{}/test", self.port)
        }

        fn pid(&self) -> i32 {
            self.child.as_ref().expect("running").id() as i32
        }

        pub fn pause(&self) {
            // SAFETY: kill(2) on our child.
            unsafe { libc::kill(self.pid(), libc::SIGSTOP) };
        }

        pub fn resume(&self) {
            if self.child.is_some() {
                // SAFETY: as above.
                unsafe { libc::kill(self.pid(), libc::SIGCONT) };
            }
        }

        /// SIGKILL (a crash) and reap.
        pub fn kill(&mut self) {
            if let Some(mut c) = self.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }

        /// Starts again on the same port and data directory (InnoDB crash recovery).
        pub fn start_again(&mut self) {
            let start = Instant::now();
            loop {
                match self.spawn_and_wait() {
                    Ok(()) => return,
                    Err(e) if start.elapsed() > Duration::from_secs(30) => {
                        panic!("restart of the private mariadbd failed: {e}")
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(200)),
                }
            }
        }
    }

    impl Drop for MyProc {
        fn drop(&mut self) {
            self.resume();
            self.kill();
        }
    }
}
