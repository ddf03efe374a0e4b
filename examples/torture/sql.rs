//! Engines `postgres`, `pg-advisory` (feature `postgres`) and `mysql` (feature `mysql`) of the
//! torture: a private server on a free loopback port, as `PgProc` and `MyProc` in
//! `tests/common/sql.rs` start them (PostgreSQL: initdb and postgres as the `postgres` user,
//! trust auth, fsync off; MariaDB: mariadb-install-db, grant tables skipped).
//!
//! Faults (besides the coordinator's worker kill / stop): `terminate_sessions` (every worker
//! session ended by the server: `pg_terminate_backend`, MariaDB's `KILL`), the server stopped
//! (SIGSTOP) for 30–80 % of the ttl, and a server restart (PostgreSQL: immediate shutdown;
//! MariaDB: SIGKILL and crash recovery) after 0.5–1.5 s down.
//!
//! Clock offsets (`--clock-offsets-ms A,B,..`): the server starts with its wall clock at entry 0
//! (the `LD_PRELOAD` shim `tests/common/clockstep.c`, which `clock_timestamp()` and
//! `UTC_TIMESTAMP(6)` read through libc), and each restart moves it to the next entry (cycling),
//! so the database clock steps forward or back across a restart while `last` survives on disk.
//! A restart whose step is forward (`*_restart_clock_fwd`) ends leases early on the server's
//! clock (rows granted before it expire that much sooner: S1 excludes wall-clock steps), so it is
//! logged as a state-loss window (lease violations inside it are counted apart); a backward step
//! (`*_restart_clock_back`) only makes leases look longer. Token order is checked everywhere.

use super::*;

/// Runs `cmd`, returns its stdout when it succeeded.
fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The server's wall clock across restarts: the offsets to cycle through and the shim.
struct Clock {
    offsets_ms: Vec<i64>,
    /// Index of the offset the running server has.
    at: usize,
    /// Restarts so far: each gets an offset file of its own, so a running server's mapping is
    /// never rewritten.
    n: usize,
}

impl Clock {
    fn new(offsets_ms: Vec<i64>) -> Clock {
        Clock {
            offsets_ms,
            at: 0,
            n: 0,
        }
    }

    fn on(&self) -> bool {
        self.offsets_ms.iter().any(|&o| o != 0)
    }

    fn now_ms(&self) -> i64 {
        self.offsets_ms.get(self.at).copied().unwrap_or(0)
    }

    /// Moves to the next offset; returns `(old, new)`.
    fn step(&mut self) -> (i64, i64) {
        let old = self.now_ms();
        if !self.offsets_ms.is_empty() {
            self.at = (self.at + 1) % self.offsets_ms.len();
        }
        (old, self.now_ms())
    }

    /// The environment that runs a server process at the current offset (none when off).
    fn env(&mut self, dir: &Path) -> io::Result<Vec<(String, String)>> {
        if !self.on() {
            return Ok(Vec::new());
        }
        let lib = clock_shim(dir)?;
        self.n += 1;
        let file = dir.join(format!("clock-offset-{}", self.n));
        std::fs::write(&file, (self.now_ms() * 1_000_000).to_ne_bytes())?;
        Ok(vec![
            ("LD_PRELOAD".into(), lib.display().to_string()),
            ("DLOCK_CLOCK_OFFSET_FILE".into(), file.display().to_string()),
        ])
    }
}

/// The host's wall clock, ms since the epoch (to report the server's measured offset).
fn host_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// The restart fault's kind and whether it is a state-loss window, from the clock step.
fn restart_kind(engine: &'static str, (old, new): (i64, i64)) -> (&'static str, bool) {
    match (engine, new.cmp(&old)) {
        ("pg", std::cmp::Ordering::Greater) => ("pg_restart_clock_fwd", true),
        ("pg", std::cmp::Ordering::Less) => ("pg_restart_clock_back", false),
        ("pg", _) => ("pg_restart", false),
        (_, std::cmp::Ordering::Greater) => ("mysql_restart_clock_fwd", true),
        (_, std::cmp::Ordering::Less) => ("mysql_restart_clock_back", false),
        _ => ("mysql_restart", false),
    }
}

/// Which of the two server faults, and for how long: `(stop, how long)`.
fn server_fault(rng: &mut Rng, ttl: Duration) -> (bool, Duration) {
    let ttl_ms = ttl.as_millis() as u64;
    if rng.range(0, 2) == 0 {
        (
            true,
            Duration::from_millis(rng.range(ttl_ms * 3 / 10, ttl_ms * 8 / 10 + 1)),
        )
    } else {
        (false, Duration::from_millis(rng.range(500, 1501)))
    }
}

#[cfg(feature = "postgres")]
pub(crate) use pg::PgServer;

#[cfg(feature = "postgres")]
mod pg {
    use super::*;

    /// A private PostgreSQL cluster run as the `postgres` user (initdb refuses root).
    pub(crate) struct PgServer {
        dir: PathBuf,
        bin: PathBuf,
        port: u16,
        uid: u32,
        gid: u32,
        child: Option<Child>,
        clock: Clock,
    }

    fn pg_bin() -> io::Result<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")?
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
        v.pop()
            .ok_or_else(|| io::Error::other("no initdb under /usr/lib/postgresql/*/bin"))
    }

    fn postgres_user() -> io::Result<(u32, u32)> {
        let name = std::ffi::CString::new("postgres").expect("no NUL");
        // SAFETY: getpwnam with a valid C string; the result is read at once.
        let pw = unsafe { libc::getpwnam(name.as_ptr()) };
        if pw.is_null() {
            return Err(io::Error::other(
                "no `postgres` user: install Debian's postgresql",
            ));
        }
        // SAFETY: non-null passwd entry.
        Ok(unsafe { ((*pw).pw_uid, (*pw).pw_gid) })
    }

    fn chown(p: &Path, uid: u32, gid: u32) -> io::Result<()> {
        std::os::unix::fs::chown(p, Some(uid), Some(gid))
    }

    impl PgServer {
        pub(crate) fn start(dir: &Path, offsets_ms: Vec<i64>) -> io::Result<PgServer> {
            let (uid, gid) = postgres_user()?;
            let dir = dir.join("pg");
            std::fs::create_dir_all(&dir)?;
            chown(&dir, uid, gid)?;
            let bin = pg_bin()?;
            let data = dir.join("data");
            let out = Command::new(bin.join("initdb"))
                .arg("-D")
                .arg(&data)
                .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
                .uid(uid)
                .gid(gid)
                .stdin(Stdio::null())
                .output()?;
            if !out.status.success() {
                return Err(io::Error::other(format!(
                    "initdb failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                )));
            }
            let mut p = PgServer {
                dir,
                bin,
                port: 0,
                uid,
                gid,
                child: None,
                clock: Clock::new(offsets_ms),
            };
            let mut last = None;
            for _ in 0..5 {
                p.port = free_port()?;
                match p.spawn_and_wait() {
                    Ok(()) => {
                        p.report_clock();
                        return Ok(p);
                    }
                    Err(e) => last = Some(e),
                }
            }
            Err(last.unwrap_or_else(|| io::Error::other("postgres did not start")))
        }

        fn spawn_and_wait(&mut self) -> io::Result<()> {
            let log = self.dir.join("pg.log");
            let f = OpenOptions::new().create(true).append(true).open(&log)?;
            chown(&log, self.uid, self.gid)?;
            let mut cmd = Command::new(self.bin.join("postgres"));
            cmd.arg("-D")
                .arg(self.dir.join("data"))
                .args(["-p", &self.port.to_string()])
                .args(["-c", "listen_addresses=127.0.0.1"])
                .arg("-c")
                .arg(format!("unix_socket_directories={}", self.dir.display()))
                .args(["-c", "fsync=off", "-c", "max_connections=100"])
                .envs(self.clock.env(&self.dir)?)
                .uid(self.uid)
                .gid(self.gid)
                .stdin(Stdio::null())
                .stdout(f.try_clone()?)
                .stderr(f);
            let mut child = spawn_tied(&mut cmd)?;
            let start = mono();
            loop {
                if let Ok(Some(st)) = child.try_wait() {
                    return Err(io::Error::other(format!("postgres exited {st}")));
                }
                if TcpStream::connect(("127.0.0.1", self.port)).is_ok()
                    && Command::new(self.bin.join("pg_isready"))
                        .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-q"])
                        .status()
                        .is_ok_and(|s| s.success())
                {
                    self.child = Some(child);
                    return Ok(());
                }
                if mono() - start > 20_000_000_000 {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(io::Error::other(
                        "postgres did not accept connections within 20 s",
                    ));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }

        /// The postmaster and its children (backends and helpers).
        fn pids(&self) -> Vec<u32> {
            let Some(c) = &self.child else {
                return vec![];
            };
            let pm = c.id();
            let mut v = vec![pm];
            if let Ok(rd) = std::fs::read_dir("/proc") {
                for e in rd.flatten() {
                    let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                        continue;
                    };
                    let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
                    let ppid = stat
                        .rsplit_once(") ")
                        .and_then(|(_, r)| r.split_whitespace().nth(1))
                        .and_then(|s| s.parse::<u32>().ok());
                    if ppid == Some(pm) {
                        v.push(pid);
                    }
                }
            }
            v
        }

        /// Immediate shutdown (SIGQUIT to the postmaster), then reap.
        fn stop(&mut self) {
            if let Some(mut c) = self.child.take() {
                signal(c.id(), libc::SIGQUIT);
                let start = mono();
                while c.try_wait().ok().flatten().is_none() {
                    if mono() - start > 10_000_000_000 {
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }

        fn start_again(&mut self) -> io::Result<()> {
            let start = mono();
            loop {
                match self.spawn_and_wait() {
                    Ok(()) => return Ok(()),
                    Err(e) if mono() - start > 20_000_000_000 => return Err(e),
                    Err(_) => std::thread::sleep(Duration::from_millis(200)),
                }
            }
        }

        /// Prints the server clock's measured offset from the host's (when offsets are on).
        fn report_clock(&self) {
            if !self.clock.on() {
                return;
            }
            let server = self
                .psql("SELECT (extract(epoch from clock_timestamp()) * 1000)::bigint")
                .and_then(|v| v.trim().parse::<i64>().ok());
            eprintln!(
                "torture: postgres clock offset {} ms (asked {} ms)",
                server.map_or("?".into(), |v| (v - host_ms()).to_string()),
                self.clock.now_ms()
            );
        }

        fn psql(&self, sql: &str) -> Option<String> {
            output(
                Command::new(self.bin.join("psql"))
                    .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                    .args(["-U", "postgres", "-d", "postgres", "-XAtq", "-c", sql]),
            )
        }
    }

    impl Drop for PgServer {
        fn drop(&mut self) {
            for pid in self.pids() {
                signal(pid, libc::SIGCONT);
            }
            self.stop();
        }
    }

    impl Store for PgServer {
        fn url(&self) -> String {
            format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
        }

        fn fault(&mut self, rng: &mut Rng, ttl: Duration) -> io::Result<(&'static str, u64, bool)> {
            let t = mono();
            if rng.range(0, 3) == 0 {
                // Every client session but this one: the workers' pooled connections and
                // their LISTEN connections.
                let _ = self.psql(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                     WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
                );
                return Ok(("terminate_sessions", t, false));
            }
            let (stop, dur) = server_fault(rng, ttl);
            let t = mono();
            if stop {
                let pids = self.pids();
                for &pid in &pids {
                    signal(pid, libc::SIGSTOP);
                }
                std::thread::sleep(dur);
                for &pid in pids.iter().rev() {
                    signal(pid, libc::SIGCONT);
                }
                Ok(("pg_stop_server", t, false))
            } else {
                self.stop();
                let step = self.clock.step();
                std::thread::sleep(dur);
                self.start_again()?;
                self.report_clock();
                let (kind, state_loss) = restart_kind("pg", step);
                Ok((kind, t, state_loss))
            }
        }
    }
}

#[cfg(feature = "mysql")]
pub(crate) use my::MyServer;

#[cfg(feature = "mysql")]
mod my {
    use super::*;

    /// A private `mariadbd` (grant tables skipped) on a free loopback port.
    pub(crate) struct MyServer {
        dir: PathBuf,
        port: u16,
        child: Option<Child>,
        clock: Clock,
    }

    impl MyServer {
        pub(crate) fn start(dir: &Path, offsets_ms: Vec<i64>) -> io::Result<MyServer> {
            let dir = dir.join("maria");
            let tmp = dir.join("tmp");
            std::fs::create_dir_all(&tmp)?;
            let out = Command::new("mariadb-install-db")
                .arg("--no-defaults")
                .arg(format!("--datadir={}", dir.join("data").display()))
                .arg(format!("--tmpdir={}", tmp.display()))
                .args([
                    "--user=root",
                    "--skip-test-db",
                    "--auth-root-authentication-method=normal",
                ])
                .stdin(Stdio::null())
                .output()?;
            if !out.status.success() {
                return Err(io::Error::other(format!(
                    "mariadb-install-db failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                )));
            }
            let mut p = MyServer {
                dir,
                port: 0,
                child: None,
                clock: Clock::new(offsets_ms),
            };
            let mut last = None;
            for _ in 0..5 {
                p.port = free_port()?;
                match p.spawn_and_wait() {
                    Ok(()) => {
                        p.report_clock();
                        return Ok(p);
                    }
                    Err(e) => last = Some(e),
                }
            }
            Err(last.unwrap_or_else(|| io::Error::other("mariadbd did not start")))
        }

        fn client(&self) -> Command {
            let mut c = Command::new("mariadb");
            c.args(["-h", "127.0.0.1", "-P", &self.port.to_string(), "-uroot"]);
            c
        }

        fn spawn_and_wait(&mut self) -> io::Result<()> {
            let f = OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.dir.join("maria.log"))?;
            let mut cmd = Command::new("mariadbd");
            cmd.arg("--no-defaults")
                .arg(format!("--datadir={}", self.dir.join("data").display()))
                .arg(format!("--socket={}", self.dir.join("sock").display()))
                .arg(format!("--tmpdir={}", self.dir.join("tmp").display()))
                .arg(format!("--port={}", self.port))
                .args([
                    "--bind-address=127.0.0.1",
                    "--user=root",
                    "--skip-grant-tables",
                    "--skip-log-bin",
                    "--innodb-flush-log-at-trx-commit=2",
                    "--innodb-buffer-pool-size=32M",
                    "--max-connections=200",
                ])
                .arg(format!("--pid-file={}", self.dir.join("pid").display()))
                .envs(self.clock.env(&self.dir)?)
                .stdin(Stdio::null())
                .stdout(f.try_clone()?)
                .stderr(f);
            let mut child = spawn_tied(&mut cmd)?;
            let start = mono();
            loop {
                if let Ok(Some(st)) = child.try_wait() {
                    return Err(io::Error::other(format!("mariadbd exited {st}")));
                }
                if output(
                    self.client()
                        .args(["-e", "CREATE DATABASE IF NOT EXISTS test"]),
                )
                .is_some()
                {
                    self.child = Some(child);
                    return Ok(());
                }
                if mono() - start > 30_000_000_000 {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(io::Error::other("mariadbd did not answer within 30 s"));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }

        /// Prints the server clock's measured offset from the host's (when offsets are on).
        fn report_clock(&self) {
            if !self.clock.on() {
                return;
            }
            let server = output(self.client().args([
                "-N",
                "-e",
                "SELECT FLOOR(UNIX_TIMESTAMP(NOW(6)) * 1000)",
            ]))
            .and_then(|v| v.trim().parse::<i64>().ok());
            eprintln!(
                "torture: mariadb clock offset {} ms (asked {} ms)",
                server.map_or("?".into(), |v| (v - host_ms()).to_string()),
                self.clock.now_ms()
            );
        }

        fn kill(&mut self) {
            if let Some(mut c) = self.child.take() {
                signal(c.id(), libc::SIGCONT);
                let _ = c.kill();
                let _ = c.wait();
            }
        }

        fn start_again(&mut self) -> io::Result<()> {
            let start = mono();
            loop {
                match self.spawn_and_wait() {
                    Ok(()) => return Ok(()),
                    Err(e) if mono() - start > 30_000_000_000 => return Err(e),
                    Err(_) => std::thread::sleep(Duration::from_millis(200)),
                }
            }
        }
    }

    impl Drop for MyServer {
        fn drop(&mut self) {
            self.kill();
        }
    }

    impl Store for MyServer {
        fn url(&self) -> String {
            format!("mysql://root@127.0.0.1:{}/test", self.port)
        }

        fn fault(&mut self, rng: &mut Rng, ttl: Duration) -> io::Result<(&'static str, u64, bool)> {
            let t = mono();
            if rng.range(0, 3) == 0 {
                // Every client connection but this one.
                let ids = output(self.client().args([
                    "-N",
                    "-e",
                    "SELECT id FROM information_schema.processlist \
                     WHERE id <> CONNECTION_ID() AND command NOT IN ('Daemon', 'Binlog Dump')",
                ]))
                .unwrap_or_default();
                let kills: String = ids
                    .split_whitespace()
                    .filter(|i| i.parse::<u64>().is_ok())
                    .map(|i| format!("KILL {i};"))
                    .collect();
                if !kills.is_empty() {
                    let _ = output(self.client().args(["-f", "-e", &kills]));
                }
                return Ok(("terminate_sessions", t, false));
            }
            let (stop, dur) = server_fault(rng, ttl);
            let t = mono();
            if stop {
                if let Some(c) = &self.child {
                    let pid = c.id();
                    signal(pid, libc::SIGSTOP);
                    std::thread::sleep(dur);
                    signal(pid, libc::SIGCONT);
                }
                Ok(("mysql_stop_server", t, false))
            } else {
                self.kill();
                let step = self.clock.step();
                std::thread::sleep(dur);
                self.start_again()?;
                self.report_clock();
                let (kind, state_loss) = restart_kind("mysql", step);
                Ok((kind, t, state_loss))
            }
        }
    }
}
