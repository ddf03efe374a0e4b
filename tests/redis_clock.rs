//! Wall-clock steps on the Redis server (RELIABILITY.md §7 F3, issue 7 deliverable 3): a private
//! redis-server runs with a small `LD_PRELOAD` clock shim (`tests/common/clockstep.c`, compiled
//! here with `cc`) whose `CLOCK_REALTIME` / `gettimeofday` / `time` (which Redis uses for key
//! expiry and `TIME`) are shifted by an offset the test rewrites while the server runs.
//!
//! Debian's libfaketime (0.9.10) cannot do this: under it redis-server aborts at start
//! ("unexpected recursive calls to clock_gettime()", with every combination of
//! `DONT_FAKE_MONOTONIC`, `FAKETIME_DONT_FAKE_MONOTONIC`, `FAKETIME_NO_CACHE`,
//! `FAKETIME_FORCE_MONOTONIC_FIX`, a timestamp file and libfaketimeMT): jemalloc, linked into
//! redis-server, reads the clock while libfaketime initialises, and that initialisation
//! allocates. The shim allocates nothing and calls the kernel directly.

mod common;

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{RedisProc, TempDir};
use dlock::{Backend, Lock, LostReason, RedisBackend};

struct Clocked {
    server: RedisProc,
    offset_file: PathBuf,
    _dir: TempDir,
}

impl Clocked {
    fn start() -> Clocked {
        let dir = TempDir::new("clockstep");
        let lib = dir.path().join("libclockstep.so");
        let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/common/clockstep.c");
        let out = std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&lib)
            .arg(src)
            .output()
            .expect("run cc (a C compiler is needed to build the clock shim)");
        assert!(
            out.status.success(),
            "cc {src}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let offset_file = dir.path().join("offset");
        std::fs::write(&offset_file, 0i64.to_ne_bytes()).unwrap();
        let envs = [
            ("LD_PRELOAD", lib.display().to_string()),
            ("DLOCK_CLOCK_OFFSET_FILE", offset_file.display().to_string()),
        ]
        .map(|(k, v)| (k.to_string(), v));
        let server = RedisProc::start_with_env(&[], &envs);
        Clocked {
            server,
            offset_file,
            _dir: dir,
        }
    }

    /// Sets the server clock's offset from real time (seconds, may be negative), in place (the
    /// server maps the file).
    fn set_offset(&self, secs: i64) {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&self.offset_file)
            .unwrap();
        f.write_all_at(&(secs * 1_000_000_000).to_ne_bytes(), 0)
            .unwrap();
    }

    fn server_time_us(&self) -> i64 {
        let (s, us): (i64, i64) = redis::cmd("TIME").query(&mut self.server.admin()).unwrap();
        s * 1_000_000 + us
    }

    async fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(RedisBackend::connect(&self.server.url()).await.unwrap())
    }
}

fn real_time_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

/// The fault is real: stepping the offset file moves the server's `TIME`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clock_shim_steps_the_server_clock() {
    let c = tokio::task::spawn_blocking(Clocked::start).await.unwrap();
    let d0 = c.server_time_us() - real_time_us();
    assert!(
        d0.abs() < 2_000_000,
        "server clock off by {d0} µs before the step"
    );
    c.set_offset(3600);
    let d1 = c.server_time_us() - real_time_us();
    assert!(
        (d1 - 3_600_000_000).abs() < 2_000_000,
        "server clock off by {d1} µs after a +1 h step"
    );
    c.set_offset(-3600);
    let d2 = c.server_time_us() - real_time_us();
    assert!(
        (d2 + 3_600_000_000).abs() < 2_000_000,
        "server clock off by {d2} µs after a -1 h step"
    );
}

/// F3: a forward step of the server clock past the lease expires it early; a contender can take
/// the lock, and the stale holder's `lost()` fires at its next renewal (≤ ttl/3 + a round trip
/// after the step), long before its own deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_step_expires_the_lease_early_and_the_holder_learns_at_its_next_renewal() {
    let c = tokio::task::spawn_blocking(Clocked::start).await.unwrap();
    let a_backend = c.backend().await;
    let ttl = Duration::from_secs(3);
    let a = Lock::new("clock-fwd")
        .with_backend(a_backend)
        .ttl(ttl)
        .acquire()
        .await
        .unwrap();
    let lost = a.lost();
    c.set_offset(2 * ttl.as_secs() as i64);
    let stepped = Instant::now();
    // The key is expired on the server's clock: another client gets it at once.
    let b = Lock::new("clock-fwd")
        .with_backend(c.backend().await)
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .expect("after a forward step past the lease, the lock is free on the server");
    assert!(b.fencing_token() > a.fencing_token());
    let reason = tokio::time::timeout(ttl / 3 + Duration::from_millis(500), lost)
        .await
        .expect("the stale holder's lost() did not fire by its next renewal + RTT");
    assert!(
        stepped.elapsed() <= ttl / 3 + Duration::from_millis(500),
        "{:?}",
        stepped.elapsed()
    );
    assert_ne!(
        reason,
        LostReason::Deadline,
        "lost by the local deadline, not by the renewal"
    );
    assert!(!a.is_valid());
    drop(a);
    b.release().await.unwrap();
}

/// S3 under a backward step: tokens keep increasing (`max(last + 1, TIME µs)`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backward_step_tokens_still_strictly_increase() {
    let c = tokio::task::spawn_blocking(Clocked::start).await.unwrap();
    let backend = c.backend().await;
    let mut last = 0u64;
    for (round, offset) in [0i64, -3600, -7200, 0, -1].into_iter().enumerate() {
        c.set_offset(offset);
        for i in 0..5 {
            let g = Lock::new("clock-back")
                .with_backend(backend.clone())
                .acquire()
                .await
                .unwrap();
            let t = g.fencing_token();
            assert!(
                t > last,
                "round {round} (offset {offset} s) try {i}: token {t} after {last}"
            );
            last = t;
            g.release().await.unwrap();
        }
    }
}
