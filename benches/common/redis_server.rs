//! A private `redis-server` for the benches: a free loopback port, a temp directory, no
//! persistence, killed at exit (also via `PR_SET_PDEATHSIG` when the bench itself is killed).
//! Included by the benches with `#[path = "common/redis_server.rs"] mod redis_server;`.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The server binary: `$REDIS_SERVER`, else `redis-server` on the `PATH`.
pub(crate) fn binary() -> String {
    std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into())
}

pub(crate) struct Server {
    child: Child,
    pub(crate) port: u16,
    dir: PathBuf,
}

impl Server {
    /// Starts a server with `extra` arguments, waiting (at most 10 s) until it answers `PING`.
    /// `tag` names its directory (`dlock-<tag>-<pid>-<port>` in the temp dir).
    pub(crate) fn start(tag: &str, extra: &[&str]) -> Server {
        let bin = binary();
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("no free loopback port")
            .port();
        let dir = std::env::temp_dir().join(format!("dlock-{tag}-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("cannot create the server's directory");
        let mut cmd = Command::new(&bin);
        cmd.args(["--port", &port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--daemonize", "no"])
            .args(["--loglevel", "warning"])
            .arg("--dir")
            .arg(&dir)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe. The server dies with this process even when
            // it is killed before Drop runs.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().unwrap_or_else(|e| {
            panic!("cannot start `{bin}` ({e}); install redis-server or set REDIS_SERVER")
        });
        let server = Server { child, port, dir };
        let client = redis::Client::open(server.url()).unwrap();
        let started = Instant::now();
        loop {
            if let Ok(mut c) = client.get_connection()
                && redis::cmd("PING").query::<String>(&mut c).is_ok()
            {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "redis-server on port {port} did not come up"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The server's version (`redis-server --version`'s `v=`), or `unknown`.
    pub(crate) fn version() -> String {
        Command::new(binary())
            .arg("--version")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| {
                s.split_whitespace()
                    .find_map(|w| w.strip_prefix("v=").map(str::to_string))
            })
            .unwrap_or_else(|| "unknown".into())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
