//! The torture program (RELIABILITY.md §6 and §7 H): K worker processes × T tasks take one lock
//! in a loop against a private redis-server while a nemesis kills, pauses and restarts things;
//! a checker merges the per-worker logs and reports overlaps, token-order and lease-invariant
//! violations and lost updates.
//!
//! ```text
//! cargo run --release --example torture                    # default: 4 × 16, 100 s, nemesis on
//! cargo run --release --example torture -- --no-nemesis    # exclusion without faults
//! cargo run --release --example torture -- --workers 4 --tasks 4 --secs 40   # the CI size
//! cargo run --release --example torture -- --mode noexclude --no-nemesis --secs 5  # broken lock
//! cargo run --release --example torture -- --check DIR --ttl-ms 1000   # re-check old logs
//! cargo run --release --example torture -- --duration 10m              # the 10-minute run
//! cargo run --release --example torture -- --engine redlock --secs 60  # Redlock over 3 nodes
//! cargo run --release --features sentinel --example torture -- --engine sentinel --secs 60
//! cargo run --release --features etcd --example torture -- --engine etcd --secs 60
//! cargo run --release --features postgres --example torture -- --engine postgres --secs 60
//! cargo run --release --features postgres --example torture -- --engine pg-advisory --secs 60
//! cargo run --release --features mysql --example torture -- --engine mysql --secs 60
//! cargo run --release --features cluster --example torture -- --engine cluster --secs 60
//! cargo run --release --example torture -- --mode noreturn --no-nemesis --secs 10  # orphans
//! cargo run --release --example torture -- --workload semaphore --sem-max 3 --secs 120
//! cargo run --release --example torture -- --workload rw --secs 120
//! cargo run --release --example torture -- --workload election --secs 120   # leader election
//! ```
//!
//! Workloads (`--workload`, issue 21): `lock` (default), `semaphore` (every task takes one
//! permit of a `--sem-max`-permit semaphore, default 3) and `rw` (a quarter of the tasks write,
//! running the lock's fenced and unfenced body, and half of their holds downgrade; the rest read),
//! on the engines with those primitives (`redis`, `sentinel`, `cluster`), nemesis as for the lock.
//! Their checker judges every grant against the holds whose lease was still valid by their own
//! deadlines at its confirmation: more than `max` permits, or a write beside any other hold, or a
//! read beside a write, is a violation (outside state-loss windows); tokens strictly increase in
//! grant order (one sequence per semaphore, one per read-write lock); after the workers exit,
//! all `max` permits (the write side) must be free within ttl + 2 s; a writer whose wait ran out
//! with no fault window overlapping its wait is a starved writer.
//!
//! Engines (`--engine`): `redis` (default; one server behind the fault proxy: kill, stop,
//! restart, pause, sleep, proxy delay, blackhole, and hold: a partition whose held bytes are
//! delivered 0–1 s after the heal, as TCP retransmission does), `redlock` (three independent nodes; faults:
//! worker kill/stop, restart or kill a node, pause or sleep a node, restart a majority at once),
//! `sentinel` (master, replica, three sentinels; feature `sentinel`; faults: worker kill/stop,
//! `SENTINEL FAILOVER`, kill the master, pause or sleep the master), `etcd` (a private 3-member
//! cluster from `/usr/bin/etcd`; feature `etcd`; faults: worker kill/stop, kill the leader or a
//! follower, SIGSTOP the leader or a follower, kill two members), `postgres` and `pg-advisory`
//! (a private PostgreSQL, table and advisory-lock mode; feature `postgres`), `mysql` (a private
//! MariaDB; feature `mysql`) (SQL faults: worker kill/stop, every worker session ended by the
//! server (`pg_terminate_backend`, `KILL`), the server stopped for less than the ttl, a server
//! restart), and `cluster` (three masters with a replica each; feature `cluster`; faults: worker
//! kill/stop, `CLUSTER FAILOVER` on the lock master's replica, kill that master past the node
//! timeout or restart it at once). Every run checks for orphans: every task asks again at
//! once, so a stretch longer than ttl + 2 s (or `--give-back-ms`) in which nobody held the name,
//! outside the windows of the lock service's own faults, is a verdict failure.
//!
//! Options: `--workers K`, `--tasks T`, `--secs S` (time contending, after a 3 s start-up
//! allowance), `--no-nemesis`, `--ttl-ms`, `--wait-ms`, `--body-us` (the random pause in the
//! body), `--mode dlock|noexclude|norenew|noreturn` (the latter three are deliberately broken
//! locks for the checker's self-test; `noreturn` never gives a hold back, so the name is
//! orphaned), `--give-back-ms` (the engine's stated give-back bound; the orphan check allows the
//! larger of it and ttl + 2 s), `--clock-offsets-ms A,B,..` (per-server wall-clock offsets in
//! ms; the checker's token-order count must stay 0: Redis, Redlock, Sentinel and Cluster: lock
//! server `i` (Sentinel: master, replica; Cluster: six nodes) runs with its wall clock off by
//! entry `i % len` ms, through the `LD_PRELOAD` shim `tests/common/clockstep.c`, built with
//! `cc`, across its restarts; `--zookeeper`: member `i` at entry `i % len`, by the same shim;
//! `postgres`, `pg-advisory`, `mysql`: the one server starts at entry 0 and each restart fault
//! moves it to the next entry, a forward step being logged as a state-loss window (leases end
//! early on the server's clock); `etcd`: its Go binary reads the clock without libc, and its
//! token floor is the client's clock, so worker process `i` runs at entry `i % len` instead),
//! `--min-replicas N` (Sentinel: the workers' backends run `WAIT N 200` after each grant,
//! `SentinelBuilder::min_replicas`), `--dir` (logs; default a fresh directory under the temp dir), `--seed`, `--quiet`. It starts its own two redis-servers (`redis-server` must be on `PATH`) on free
//! 127.0.0.1 ports and never touches any other Redis. Exit status 1 when the checker finds an
//! unnoticed overlap among fenced operations, a lost fenced update, a token or lease violation,
//! an orphan (the name held by nobody for longer than the give-back bound while workers wanted
//! it, outside windows where the lock service was down), or a panic.
//!
//! `--zookeeper` (build with `--features zookeeper`): the lock lives on a private 3-server
//! ZooKeeper ensemble (Debian's jars) instead of Redis; each worker's session timeout is the ttl;
//! the nemesis kills or pauses (past the session timeout) holder processes and kills a follower,
//! the leader or two members (the majority), restarting them after 1.5–3 s.
//!
//! `--workload election` (issue 22): one candidate per worker process runs `Election::run` on
//! the chosen engine; each term does 2 to 7 epoch-fenced read-modify-writes of the fenced counter,
//! then resigns, and a lost term's body is dropped by `run`. Terms are logged as holds (the epoch
//! is the token), so every check above applies to them, and the resource server's log of accepted
//! fenced writes proves that no write with a stale epoch was accepted (`stale writes accepted`).
//!
//! A worker is this same binary re-executed with `DLOCK_TORTURE_WORKER=1`.

#[path = "torture/checker.rs"]
mod checker;
#[path = "torture/harness.rs"]
mod harness;

use std::path::PathBuf;

fn main() {
    if std::env::var_os(harness::WORKER_ENV).is_some() {
        harness::worker_main();
    }
    let mut args = std::env::args().skip(1);
    let dir = std::env::temp_dir().join(format!("dlock-torture-{}", std::process::id()));
    let mut cfg = harness::RunCfg::new(dir);
    cfg.tasks = 16;
    cfg.secs = 100.0;
    cfg.verbose = true;
    let mut check_only: Option<PathBuf> = None;
    while let Some(a) = args.next() {
        let mut val = || {
            args.next()
                .unwrap_or_else(|| usage(&format!("{a} needs a value")))
        };
        match a.as_str() {
            "--workers" => cfg.workers = num(&val()),
            "--tasks" => cfg.tasks = num(&val()),
            "--secs" => cfg.secs = val().parse().unwrap_or_else(|_| usage("--secs")),
            "--no-nemesis" => cfg.nemesis = false,
            "--ttl-ms" => cfg.ttl_ms = num(&val()) as u64,
            "--wait-ms" => cfg.wait_ms = num(&val()) as u64,
            "--body-us" => cfg.body_us = num(&val()) as u64,
            "--mode" => {
                cfg.mode = harness::Mode::parse(&val()).unwrap_or_else(|| usage("--mode"));
                if cfg.mode == harness::Mode::NoRenew {
                    cfg.ttl_ms = 20;
                    cfg.body_us = 30_000;
                }
            }
            "--workload" => {
                cfg.workload =
                    harness::Workload::parse(&val()).unwrap_or_else(|| usage("--workload"))
            }
            "--sem-max" => cfg.sem_max = num(&val()) as u32,
            "--engine" => {
                cfg.engine = harness::Engine::parse(&val()).unwrap_or_else(|| usage("--engine"))
            }
            "--duration" => {
                let v = val();
                cfg.secs = parse_duration(&v).unwrap_or_else(|| usage(&format!("--duration {v}")))
            }
            "--dir" => cfg.dir = PathBuf::from(val()),
            "--seed" => cfg.seed = num(&val()) as u64,
            "--quiet" => cfg.verbose = false,
            "--zookeeper" => cfg.zookeeper = true,
            "--give-back-ms" => cfg.give_back_ms = num(&val()) as u64,
            "--min-replicas" => cfg.min_replicas = num(&val()),
            "--clock-offsets-ms" => {
                cfg.clock_offsets_ms = val()
                    .split(',')
                    .map(|v| {
                        v.trim()
                            .parse()
                            .unwrap_or_else(|_| usage("--clock-offsets-ms"))
                    })
                    .collect()
            }
            "--check" => check_only = Some(PathBuf::from(val())),
            "-h" | "--help" => usage(""),
            other => usage(&format!("unknown argument {other}")),
        }
    }
    if matches!(
        cfg.workload,
        harness::Workload::Semaphore | harness::Workload::Rw
    ) && (cfg.zookeeper || !harness::engine_supported(cfg.engine))
    {
        usage("--workload semaphore|rw runs on --engine redis, sentinel or cluster");
    }
    let report = match check_only {
        Some(dir) => {
            let mut input = checker::load(&dir).unwrap_or_else(|e| {
                eprintln!("torture: cannot read {}: {e}", dir.display());
                std::process::exit(2)
            });
            if cfg.give_back_ms > 0 {
                input.give_back_ns = cfg.give_back_ms * 1_000_000;
            }
            checker::analyse(input, cfg.ttl_ms * 1_000_000)
        }
        None => {
            let exe = std::env::current_exe().expect("current_exe");
            let cmd = harness::WorkerCmd {
                exe,
                args: Vec::new(),
            };
            let r = harness::run(&cfg, &cmd).unwrap_or_else(|e| {
                eprintln!("torture: run failed: {e}");
                std::process::exit(2)
            });
            println!(
                "run: {} × {} tasks, workload {}, mode {}, engine {}, nemesis {}, {:.1} s wall, {} crashed, {} hung workers; logs in {}",
                cfg.workers,
                cfg.tasks,
                cfg.workload.as_str(),
                cfg.mode.as_str(),
                if cfg.zookeeper {
                    "zookeeper"
                } else {
                    cfg.engine.as_str()
                },
                cfg.nemesis,
                r.elapsed.as_secs_f64(),
                r.crashed,
                r.hung,
                cfg.dir.display()
            );
            r.report
        }
    };
    println!("{report}");
    for o in report.overlaps.iter().take(10) {
        println!(
            "  overlap {:?}{}: {} (token {}) still held when {} (token {}) was granted, for {:.1} ms",
            o.class,
            if o.during_state_loss {
                " [state loss]"
            } else {
                ""
            },
            o.stale,
            o.stale_token,
            o.newer,
            o.newer_token,
            o.overlap_ns as f64 / 1e6
        );
    }
    for v in report.prim_examples.iter().take(10) {
        println!("  {v}");
    }
    for o in report.orphans.iter().take(10) {
        println!(
            "  orphan: nobody held the name for {:.1} s after {} ended ({}){}",
            o.len_ns as f64 / 1e9,
            o.after,
            o.after_end,
            match &o.next {
                Some(n) => format!(", until {n} was granted"),
                None => ", until the workers stopped asking".into(),
            }
        );
    }
    if !report.verdict_ok() {
        println!("VERDICT: violations found");
        std::process::exit(1);
    }
    println!("VERDICT: ok");
}

/// `600`, `600s`, `10m`, `1h`.
fn parse_duration(s: &str) -> Option<f64> {
    let (n, mult) = match s.strip_suffix('h') {
        Some(n) => (n, 3600.0),
        None => match s.strip_suffix('m') {
            Some(n) => (n, 60.0),
            None => (s.strip_suffix('s').unwrap_or(s), 1.0),
        },
    };
    n.parse::<f64>().ok().filter(|v| *v > 0.0).map(|v| v * mult)
}

fn num(s: &str) -> usize {
    s.parse()
        .unwrap_or_else(|_| usage(&format!("not a number: {s}")))
}

fn usage(msg: &str) -> ! {
    if !msg.is_empty() {
        eprintln!("torture: {msg}");
    }
    eprintln!(
        "usage: torture [--engine redis|redlock|sentinel|etcd|postgres|pg-advisory|mysql|cluster] [--workload lock|semaphore|rw|election] [--sem-max N] [--workers K] [--tasks T] [--secs S | --duration 10m] [--no-nemesis] [--ttl-ms MS] [--wait-ms MS] \
         [--body-us US] [--mode dlock|noexclude|norenew|noreturn] [--give-back-ms MS] [--clock-offsets-ms A,B,..] [--min-replicas N] [--zookeeper] [--dir DIR] [--seed N] [--quiet] [--check DIR]"
    );
    std::process::exit(2)
}
