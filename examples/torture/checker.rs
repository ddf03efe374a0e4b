//! The torture checker (RELIABILITY.md §6.5): merges the JSON-lines logs of every worker process
//! with the nemesis' fault log and the resource server's final state, and reports acquisitions,
//! lost updates, overlapping holds (classified), lease-invariant violations, token-order
//! violations, slow recoveries and orphans (the name held by nobody for longer than the
//! give-back bound while workers wanted it).
//!
//! Shared by `examples/torture.rs` (the CLI) and `tests/torture.rs` (the short run and the
//! checker's self-tests) through `#[path]`.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::Path;

use serde_json::Value;

/// One operation on the resource server inside a hold.
#[derive(Debug, Clone, Default)]
pub(crate) struct Op {
    /// `fread`, `fwrite` (fenced read / write), `uread`, `uwrite` (unfenced).
    pub(crate) kind: String,
    pub(crate) fenced: bool,
    pub(crate) accepted: bool,
    /// Monotonic ns when the command was sent and when its reply arrived ([`NO_REPLY`] for an
    /// unfenced write logged as sent whose reply was never seen).
    pub(crate) t: u64,
    pub(crate) t_done: u64,
}

/// `t_done` of a write that was sent and never answered: the worker's body was cancelled (its
/// lease was lost) or its process died while the command was on its way. The server may have
/// applied it at any later moment.
pub(crate) const NO_REPLY: u64 = u64::MAX;

impl Op {
    fn is_write(&self) -> bool {
        self.kind.ends_with("write")
    }

    fn unanswered(&self) -> bool {
        self.t_done == NO_REPLY
    }
}

/// One acquisition, rebuilt from the events of one task.
#[derive(Debug, Clone, Default)]
pub(crate) struct Hold {
    /// `<log file stem>/<task>/<seq>`.
    pub(crate) id: String,
    pub(crate) pid: u32,
    pub(crate) token: u64,
    pub(crate) t_send: u64,
    pub(crate) t_ok: u64,
    /// `(sample time, local deadline at that time)`, in time order.
    pub(crate) deadlines: Vec<(u64, u64)>,
    pub(crate) t_lost: Option<u64>,
    pub(crate) lost_reason: Option<String>,
    pub(crate) ops: Vec<Op>,
    pub(crate) t_rel_send: Option<u64>,
    pub(crate) t_rel_done: Option<u64>,
    pub(crate) rel: Option<String>,
    /// Set when the process was SIGKILLed while this hold was open.
    pub(crate) t_killed: Option<u64>,
    /// The grant was logged without a deadline: its guard had no lease left when its caller
    /// looked (see `deadline_of` in harness.rs).
    pub(crate) no_lease_at_ok: bool,
    /// The semaphore and read-write workloads: `sem` (a permit), `r` or `w`; empty for a lock.
    pub(crate) side: String,
    /// A read hold that a downgrade of this task's write hold turned into.
    pub(crate) downgrade: bool,
}

impl Hold {
    /// True when the caller got this grant only after its own deadline had passed: the process
    /// was stopped (SIGSTOP) between the server's grant and the caller seeing it. Its guard is
    /// invalid from the start (`lost()` fires at once), so it never held a valid lease; the
    /// lease and token-order checks skip it, the overlap checks still judge its writes.
    pub(crate) fn stale_on_arrival(&self) -> bool {
        self.no_lease_at_ok
            || self
                .deadlines
                .iter()
                .filter(|(t, _)| *t <= self.t_ok)
                .map(|&(_, d)| d)
                .max()
                .is_some_and(|d| d <= self.t_ok)
    }

    /// End of the believed-held interval: `min(release sent, lost, killed)`, or `run_end`.
    pub(crate) fn end(&self, run_end: u64) -> u64 {
        [self.t_rel_send, self.t_lost, self.t_killed]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(run_end)
    }
}

/// A fault window, as the nemesis logged it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Fault {
    pub(crate) kind: String,
    pub(crate) t_start: u64,
    pub(crate) t_end: u64,
    pub(crate) pid: Option<u32>,
    /// The lock server lost its state (restart without persistence).
    pub(crate) state_loss: bool,
}

/// Fault kinds that hit worker processes (or their sessions) while the lock service stayed up:
/// a stretch with no holder after one of them is judged against the give-back bound like any
/// other. Every other kind (a server or node killed, paused, partitioned, failed over) is a
/// store-fault window, and the give-back bound only starts counting at its end.
pub(crate) const WORKER_FAULTS: &[&str] = &["kill_holder", "stop_holder", "terminate_sessions"];

impl Fault {
    pub(crate) fn is_store_fault(&self) -> bool {
        !WORKER_FAULTS.contains(&self.kind.as_str())
    }
}

/// One orphan: from `t_start` (the last believed hold ended, or a store fault ended) to `t_end`
/// (the next grant, or the end of the contention), no worker held the name.
#[derive(Debug, Clone)]
pub(crate) struct Orphan {
    pub(crate) t_start: u64,
    pub(crate) t_end: u64,
    /// `t_end - t_start`: longer than the bound.
    pub(crate) len_ns: u64,
    /// The hold whose end began the stretch, and how it ended (`ok`, `not_owner`, `err`,
    /// `lost`, `killed`).
    pub(crate) after: String,
    pub(crate) after_end: String,
    /// The grant that ended it (`None`: nobody got the name before the workers stopped asking).
    pub(crate) next: Option<String>,
}

/// The default give-back bound beyond the ttl: the slow-recovery figure's 2 s.
pub(crate) const GIVE_BACK_SLACK_NS: u64 = 2_000_000_000;

/// Final state of the resource server.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Resource {
    /// Fenced counter, and how many fenced writes the server applied (its own append log).
    pub(crate) f_counter: u64,
    pub(crate) f_applied: u64,
    /// Fenced writes the server accepted with a token below one it had accepted before (from
    /// its log of accepted tokens): a stale writer got through the fence. Must be 0.
    pub(crate) f_stale_accepted: u64,
    /// Unfenced counter and applied unfenced writes.
    pub(crate) u_counter: u64,
    pub(crate) u_applied: u64,
}

/// How an overlap of two believed-held intervals was caught.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OverlapClass {
    /// (a) the stale holder wrote nothing that landed in the newer hold: its lost signal (or
    /// validity check) stopped it, or it had finished its writes.
    Lost,
    /// (b) the stale holder's fenced operation was refused by the store.
    Fenced,
    /// (c) the stale holder's unfenced write landed inside the newer hold, unnoticed.
    UnnoticedUnfenced,
    /// (c) the stale holder's fenced operation was accepted after the newer holder had shown its
    /// token to the store: the fence itself failed.
    UnnoticedFenced,
}

/// One overlap: `stale` (granted first) still believed it held when `newer` was granted.
#[derive(Debug, Clone)]
pub(crate) struct Overlap {
    pub(crate) stale: String,
    pub(crate) newer: String,
    pub(crate) stale_token: u64,
    pub(crate) newer_token: u64,
    /// Length of the intersection, ns.
    pub(crate) overlap_ns: u64,
    pub(crate) class: OverlapClass,
    /// The newer grant came inside a state-loss window of the lock server.
    pub(crate) during_state_loss: bool,
}

/// The checker's findings.
#[derive(Debug, Clone, Default)]
pub(crate) struct Report {
    pub(crate) processes: usize,
    pub(crate) acquisitions: usize,
    pub(crate) acquire_errors: usize,
    pub(crate) panics: usize,
    pub(crate) faults: Vec<Fault>,
    pub(crate) resource: Resource,
    /// Applied writes minus the final counter: each lost update overwrote one increment.
    pub(crate) lost_updates_fenced: i64,
    pub(crate) lost_updates_unfenced: i64,
    pub(crate) fence_refusals: usize,
    pub(crate) lost_events: usize,
    pub(crate) overlaps: Vec<Overlap>,
    /// Grants confirmed before a still-unreleased previous holder's own deadline.
    pub(crate) lease_violations: usize,
    pub(crate) lease_violations_in_state_loss: usize,
    /// Non-increasing tokens in grant order, and repeated tokens.
    pub(crate) token_order_violations: usize,
    pub(crate) token_duplicates: usize,
    /// Grants the caller saw only after their own deadline (see [`Hold::stale_on_arrival`]).
    pub(crate) stale_on_arrival: usize,
    /// Faults after which no acquisition came within ttl + 2 s (while the run went on).
    pub(crate) slow_recoveries: usize,
    /// Orphans: stretches longer than [`Report::orphan_bound_ns`] in which no worker believed it
    /// held the name and no grant came, outside store-fault windows (see [`find_orphans`]).
    pub(crate) orphans: Vec<Orphan>,
    /// The give-back bound the orphans were judged against, ns.
    pub(crate) orphan_bound_ns: u64,
    /// The longest stretch judged by the orphan check (orphan or not), ns: the margin.
    pub(crate) longest_unheld_ns: u64,
    /// Release outcomes.
    pub(crate) releases_ok: usize,
    pub(crate) releases_not_owner: usize,
    pub(crate) releases_err: usize,
    pub(crate) first_ok: u64,
    pub(crate) last_ok: u64,
    /// `lock`, `semaphore` or `rw` (empty: old logs, a lock).
    pub(crate) workload: String,
    pub(crate) sem_max: u64,
    /// Semaphore: grants confirmed while `max` other holds were valid by their own deadlines.
    /// Read-write: a write grant beside any valid hold, or a read grant beside a valid write.
    /// Outside and inside state-loss windows.
    pub(crate) prim_violations: usize,
    pub(crate) prim_violations_in_state_loss: usize,
    /// The first violations, described.
    pub(crate) prim_examples: Vec<String>,
    /// The most holds valid at once at a grant (the grant included), and the most believed held
    /// at once (by `end()`, lease or not: a stopped holder counts until it resumes).
    pub(crate) max_valid: usize,
    pub(crate) max_believed: usize,
    /// Read-write: read grants that shared the lock with another valid read hold; downgrades.
    pub(crate) shared_reads: usize,
    pub(crate) downgrades: usize,
    /// Read-write: write grants, the longest a granted writer waited, writers whose wait ran
    /// out, and those of them whose wait overlapped no fault window (+ ttl + 2 s): starved.
    pub(crate) writes: usize,
    pub(crate) writer_wait_max_ns: u64,
    pub(crate) writer_timeouts: usize,
    pub(crate) writers_starved: usize,
    /// Read-write: read acquisitions whose wait ran out (reported, not judged: writer
    /// preference bounds writers' waits, not readers').
    pub(crate) reader_timeouts: usize,
    /// After the run: all permits (the write side) free within ttl + 2 s; `None`: not checked.
    pub(crate) returned: Option<bool>,
}

impl Report {
    pub(crate) fn count(&self, class: OverlapClass) -> usize {
        self.overlaps.iter().filter(|o| o.class == class).count()
    }

    /// Overlaps that neither the lost signal nor the fence caught.
    pub(crate) fn unnoticed(&self) -> usize {
        self.count(OverlapClass::UnnoticedFenced) + self.count(OverlapClass::UnnoticedUnfenced)
    }

    /// Distinct holds that were still believed held when a later grant came.
    pub(crate) fn stale_holds(&self) -> usize {
        self.overlaps
            .iter()
            .map(|o| &o.stale)
            .collect::<HashSet<_>>()
            .len()
    }

    /// True when the safety checks pass ([`Report::fenced_safety_ok`]) and no name was orphaned:
    /// the run's verdict.
    pub(crate) fn verdict_ok(&self) -> bool {
        self.fenced_safety_ok()
            && self.orphans.is_empty()
            && self.returned != Some(false)
            && self.writers_starved == 0
    }

    pub(crate) fn faults_of(&self, kind: &str) -> usize {
        self.faults.iter().filter(|f| f.kind == kind).count()
    }

    /// True when nothing a correct lock under this nemesis must prevent happened: no unnoticed
    /// overlap among fenced operations, no lost fenced update, no token violation, no lease
    /// violation outside state-loss windows, no panic.
    pub(crate) fn fenced_safety_ok(&self) -> bool {
        self.count(OverlapClass::UnnoticedFenced) == 0
            && self.lost_updates_fenced == 0
            && self.resource.f_stale_accepted == 0
            && self.token_order_violations == 0
            && self.token_duplicates == 0
            && self.lease_violations == 0
            && self.prim_violations == 0
            && self.panics == 0
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.last_ok.saturating_sub(self.first_ok) as f64 / 1e9;
        writeln!(
            f,
            "acquisitions          {} over {:.1} s ({:.0}/s), {} worker processes, {} acquire errors",
            self.acquisitions,
            secs,
            self.acquisitions as f64 / secs.max(1e-9),
            self.processes,
            self.acquire_errors
        )?;
        let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
        for x in &self.faults {
            *kinds.entry(x.kind.as_str()).or_default() += 1;
        }
        writeln!(f, "faults                {} {:?}", self.faults.len(), kinds)?;
        writeln!(
            f,
            "resource              fenced {} (applied {}), unfenced {} (applied {})",
            self.resource.f_counter,
            self.resource.f_applied,
            self.resource.u_counter,
            self.resource.u_applied
        )?;
        writeln!(
            f,
            "lost updates          fenced {}, unfenced {}",
            self.lost_updates_fenced, self.lost_updates_unfenced
        )?;
        writeln!(
            f,
            "stale writes accepted {} (fenced writes the server took with a token below an earlier one's)",
            self.resource.f_stale_accepted
        )?;
        writeln!(
            f,
            "overlapping pairs     {}: (a) lost/no stale write {}, (b) fence refused {}, (c) unnoticed unfenced {}, (c) unnoticed fenced {}",
            self.overlaps.len(),
            self.count(OverlapClass::Lost),
            self.count(OverlapClass::Fenced),
            self.count(OverlapClass::UnnoticedUnfenced),
            self.count(OverlapClass::UnnoticedFenced)
        )?;
        let in_loss = self.overlaps.iter().filter(|o| o.during_state_loss).count();
        writeln!(
            f,
            "  (pairs; {} distinct stale holds; {in_loss} pairs granted in state-loss windows)",
            self.stale_holds()
        )?;
        writeln!(
            f,
            "lease invariant       {} violations outside state-loss windows, {} inside (allowed)",
            self.lease_violations, self.lease_violations_in_state_loss
        )?;
        writeln!(
            f,
            "tokens                {} order violations, {} duplicates",
            self.token_order_violations, self.token_duplicates
        )?;
        writeln!(
            f,
            "stale on arrival      {} (grants seen after their own deadline: a process stopped \
             mid-acquire; outside the lease and token-order checks, writes still checked)",
            self.stale_on_arrival
        )?;
        writeln!(
            f,
            "signals               {} lost events, {} fence refusals",
            self.lost_events, self.fence_refusals
        )?;
        writeln!(
            f,
            "releases              ok {}, not_owner {}, err {}",
            self.releases_ok, self.releases_not_owner, self.releases_err
        )?;
        writeln!(
            f,
            "slow recoveries       {} (no grant within ttl + 2 s of a fault's end)",
            self.slow_recoveries
        )?;
        writeln!(
            f,
            "orphans               {} (held by nobody > {:.1} s outside store faults; longest stretch held by nobody {:.2} s)",
            self.orphans.len(),
            self.orphan_bound_ns as f64 / 1e9,
            self.longest_unheld_ns as f64 / 1e9
        )?;
        if self.workload == "semaphore" || self.workload == "rw" {
            writeln!(
                f,
                "workload              {}{}",
                self.workload,
                if self.workload == "semaphore" {
                    format!(" (max {})", self.sem_max)
                } else {
                    String::new()
                }
            )?;
            writeln!(
                f,
                "limit violations      {} outside state-loss windows, {} inside (allowed); most valid at a grant {}, most believed held {}",
                self.prim_violations,
                self.prim_violations_in_state_loss,
                self.max_valid,
                self.max_believed
            )?;
            if self.workload == "rw" {
                writeln!(
                    f,
                    "read-write            {} writes, {} downgrades, {} reads granted beside another reader; longest writer wait {:.2} s, {} writer timeouts, {} starved (no fault near); {} reader timeouts (not judged)",
                    self.writes,
                    self.downgrades,
                    self.shared_reads,
                    self.writer_wait_max_ns as f64 / 1e9,
                    self.writer_timeouts,
                    self.writers_starved,
                    self.reader_timeouts
                )?;
            }
            writeln!(
                f,
                "returned after run    {}",
                match self.returned {
                    Some(true) => "all",
                    Some(false) => "NO",
                    None => "not checked",
                }
            )?;
        }
        write!(f, "panics                {}", self.panics)
    }
}

fn u(v: &Value, k: &str) -> Option<u64> {
    v.get(k).and_then(Value::as_u64)
}

/// Everything the checker reads, parsed.
#[derive(Debug, Default)]
pub(crate) struct Input {
    pub(crate) holds: Vec<Hold>,
    pub(crate) faults: Vec<Fault>,
    pub(crate) resource: Resource,
    pub(crate) processes: usize,
    pub(crate) acquire_errors: usize,
    pub(crate) panics: usize,
    pub(crate) lost_events: usize,
    pub(crate) run_end: u64,
    /// When the workers stopped asking for the lock (0: unknown, e.g. old logs): the orphan
    /// check also judges the stretch from the last hold's end to it.
    pub(crate) t_stop: u64,
    /// The engine's stated give-back bound, ns (0: the default, ttl + 2 s); the orphan check
    /// uses the larger of it and ttl + 2 s.
    pub(crate) give_back_ns: u64,
    /// `lock`, `semaphore`, `rw` (from `resource.json`; empty: a lock).
    pub(crate) workload: String,
    pub(crate) sem_max: u64,
    /// The workers' `wait`, ns.
    pub(crate) wait_ns: u64,
    /// Everything free after the run (see [`Report::returned`]).
    pub(crate) returned: Option<bool>,
    /// Writers whose wait ran out: `(t_send, t_err)`.
    pub(crate) writer_timeouts: Vec<(u64, u64)>,
    /// Read acquisitions whose wait ran out.
    pub(crate) reader_timeouts: usize,
}

/// Reads a run directory: `w*.jsonl` (workers), `faults.jsonl`, `resource.json`.
pub(crate) fn load(dir: &Path) -> std::io::Result<Input> {
    let mut input = Input::default();
    let mut faults_text = String::new();
    let mut names: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut worker_logs = Vec::new();
    for name in names {
        let text = std::fs::read_to_string(dir.join(&name))?;
        if name == "faults.jsonl" {
            faults_text = text;
        } else if name == "resource.json" {
            let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            input.resource = Resource {
                f_counter: u(&v, "f_counter").unwrap_or(0),
                f_applied: u(&v, "f_applied").unwrap_or(0),
                f_stale_accepted: u(&v, "f_stale_accepted").unwrap_or(0),
                u_counter: u(&v, "u_counter").unwrap_or(0),
                u_applied: u(&v, "u_applied").unwrap_or(0),
            };
            input.run_end = u(&v, "t_end").unwrap_or(0);
            input.t_stop = u(&v, "t_stop").unwrap_or(0);
            input.give_back_ns = u(&v, "give_back_ns").unwrap_or(0);
            input.workload = v
                .get("workload")
                .and_then(Value::as_str)
                .unwrap_or("lock")
                .to_string();
            input.sem_max = u(&v, "sem_max").unwrap_or(0);
            input.wait_ns = u(&v, "wait_ns").unwrap_or(0);
            input.returned = v.get("returned").and_then(Value::as_bool);
        } else if name.starts_with('w') && name.ends_with(".jsonl") {
            worker_logs.push((name.trim_end_matches(".jsonl").to_string(), text));
        }
    }
    for line in faults_text.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        input.faults.push(Fault {
            kind: v
                .get("kind")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string(),
            t_start: u(&v, "t_start").unwrap_or(0),
            t_end: u(&v, "t_end").unwrap_or(0),
            pid: u(&v, "pid").map(|p| p as u32),
            state_loss: v
                .get("state_loss")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        });
    }
    let events: Vec<(String, String)> = worker_logs;
    let parsed = parse_worker_logs(&events, &mut input);
    input.holds = parsed;
    // A SIGKILLed process ends every hold it had open at the kill.
    for h in &mut input.holds {
        if h.t_rel_send.is_none() {
            h.t_killed = input
                .faults
                .iter()
                .filter(|f| f.kind == "kill_holder" && f.pid == Some(h.pid) && f.t_start >= h.t_ok)
                .map(|f| f.t_start)
                .min();
        }
    }
    Ok(input)
}

/// Rebuilds holds from `(file stem, text)` worker logs; counts errors, panics and lost events.
pub(crate) fn parse_worker_logs(logs: &[(String, String)], input: &mut Input) -> Vec<Hold> {
    let mut holds: BTreeMap<String, Hold> = BTreeMap::new();
    for (stem, text) in logs {
        input.processes += 1;
        let mut pid = 0u32;
        for line in text.lines() {
            // A SIGKILL can cut the last line short.
            let Ok(v) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            let ev = v.get("ev").and_then(Value::as_str).unwrap_or("");
            match ev {
                "hello" => pid = u(&v, "pid").unwrap_or(0) as u32,
                "err" => {
                    input.acquire_errors += 1;
                    let timed_out = v.get("timed_out").and_then(Value::as_bool) == Some(true);
                    if v.get("side").and_then(Value::as_str) == Some("r") && timed_out {
                        input.reader_timeouts += 1;
                    }
                    if v.get("side").and_then(Value::as_str) == Some("w") && timed_out {
                        input
                            .writer_timeouts
                            .push((u(&v, "t_send").unwrap_or(0), u(&v, "t").unwrap_or(0)));
                    }
                }
                "panic" => input.panics += 1,
                _ => {}
            }
            let (Some(task), Some(seq)) = (u(&v, "task"), u(&v, "seq")) else {
                continue;
            };
            let id = format!("{stem}/{task}/{seq}");
            let h = holds.entry(id.clone()).or_insert_with(|| Hold {
                id,
                pid,
                ..Hold::default()
            });
            if let Some(dl) = u(&v, "dl") {
                let t = u(&v, "t")
                    .or(u(&v, "t_ok"))
                    .or(u(&v, "t_send"))
                    .unwrap_or(0);
                h.deadlines.push((t, dl));
            }
            match ev {
                "acq" => {
                    h.token = u(&v, "token").unwrap_or(0);
                    h.t_send = u(&v, "t_send").unwrap_or(0);
                    h.t_ok = u(&v, "t_ok").unwrap_or(0);
                    h.no_lease_at_ok = v.get("dl").is_some_and(Value::is_null);
                    h.side = v
                        .get("side")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    h.downgrade = v.get("downgrade").and_then(Value::as_bool) == Some(true);
                }
                "op" | "sent" => {
                    let op = Op {
                        kind: v.get("kind").and_then(Value::as_str).unwrap_or("").into(),
                        fenced: v.get("fenced").and_then(Value::as_bool).unwrap_or(false),
                        // A write only sent may have been applied: judged as accepted.
                        accepted: ev == "sent"
                            || v.get("accepted").and_then(Value::as_bool).unwrap_or(false),
                        t: u(&v, "t").unwrap_or(0),
                        t_done: if ev == "sent" {
                            NO_REPLY
                        } else {
                            u(&v, "t_done").unwrap_or(0)
                        },
                    };
                    // The reply of a write logged as sent replaces its "sent" entry.
                    match h
                        .ops
                        .iter_mut()
                        .find(|o| o.unanswered() && o.kind == op.kind && o.t == op.t)
                    {
                        Some(sent) if ev == "op" => *sent = op,
                        _ => h.ops.push(op),
                    }
                }
                "lost" | "invalid" => {
                    if ev == "lost" {
                        input.lost_events += 1;
                    }
                    let t = u(&v, "t").unwrap_or(0);
                    if h.t_lost.is_none_or(|l| t < l) {
                        h.t_lost = Some(t);
                        h.lost_reason = v.get("reason").and_then(Value::as_str).map(String::from);
                    }
                }
                "rel" => {
                    h.t_rel_send = u(&v, "t_send");
                    h.t_rel_done = u(&v, "t_done");
                    h.rel = v.get("rel").and_then(Value::as_str).map(String::from);
                }
                _ => {}
            }
        }
    }
    holds.into_values().filter(|h| h.t_ok > 0).collect()
}

/// Analyses parsed input. `ttl_ns` is the lease length the workers used.
pub(crate) fn analyse(mut input: Input, ttl_ns: u64) -> Report {
    let holds = &mut input.holds;
    holds.sort_by_key(|h| (h.t_ok, h.token));
    let run_end = input
        .run_end
        .max(holds.iter().map(|h| h.t_ok).max().unwrap_or(0));
    let loss_windows: Vec<(u64, u64)> = input
        .faults
        .iter()
        .filter(|f| f.state_loss)
        .map(|f| (f.t_start, f.t_end + ttl_ns))
        .collect();
    let in_loss = |t: u64| loss_windows.iter().any(|&(a, b)| a <= t && t <= b);

    let mut r = Report {
        processes: input.processes,
        acquisitions: holds.len(),
        acquire_errors: input.acquire_errors,
        panics: input.panics,
        resource: input.resource,
        lost_events: input.lost_events,
        first_ok: holds.first().map_or(0, |h| h.t_ok),
        last_ok: holds.last().map_or(0, |h| h.t_ok),
        ..Report::default()
    };
    r.lost_updates_fenced = input.resource.f_applied as i64 - input.resource.f_counter as i64;
    r.lost_updates_unfenced = input.resource.u_applied as i64 - input.resource.u_counter as i64;
    r.fence_refusals = holds
        .iter()
        .flat_map(|h| &h.ops)
        .filter(|o| o.fenced && !o.accepted)
        .count();
    for h in holds.iter() {
        match h.rel.as_deref() {
            Some("ok" | "downgraded") => r.releases_ok += 1,
            Some("not_owner") => r.releases_not_owner += 1,
            Some(_) => r.releases_err += 1,
            None => {}
        }
    }

    // Tokens: unique, and increasing in grant order where that order is known: a grant whose
    // request was sent after another grant was confirmed came after it on the server, so its
    // token must be larger. Two requests in flight at once have no known order (a reply can be
    // delayed past a later grant's, e.g. one granted just before a restart). A grant seen only
    // after its own deadline has no place in the order (its confirmation is the caller's
    // resume).
    let mut seen = HashSet::new();
    for h in holds.iter() {
        if !seen.insert(h.token) {
            r.token_duplicates += 1;
        }
        if h.stale_on_arrival() {
            r.stale_on_arrival += 1;
        }
    }
    let ordered: Vec<&Hold> = holds.iter().filter(|h| !h.stale_on_arrival()).collect();
    let mut by_send = ordered.clone();
    by_send.sort_by_key(|h| h.t_send);
    // `ordered` is in confirmation order; walk it up to each request's send time.
    let (mut i, mut max_before) = (0usize, None::<u64>);
    for h in by_send {
        while i < ordered.len() && ordered[i].t_ok < h.t_send {
            max_before = max_before.max(Some(ordered[i].token));
            i += 1;
        }
        if max_before.is_some_and(|m| m >= h.token) {
            r.token_order_violations += 1;
        }
    }

    let primitive = input.workload == "semaphore" || input.workload == "rw";
    if primitive {
        r.workload = input.workload.clone();
        r.sem_max = input.sem_max;
        r.returned = input.returned;
        r.reader_timeouts = input.reader_timeouts;
        analyse_primitive(
            holds,
            &input.faults,
            &input.writer_timeouts,
            &mut r,
            run_end,
            ttl_ns,
            &in_loss,
        );
    }
    // Overlaps and the lease invariant: for each hold A, every later grant B before A's end.
    // (A lock's: the semaphore and read-write workloads have their own, above.)
    for (i, a) in holds.iter().enumerate().filter(|_| !primitive) {
        let a_end = a.end(run_end);
        for b in holds[i + 1..].iter() {
            if b.t_ok >= a_end {
                break;
            }
            let during_state_loss = in_loss(b.t_ok);
            // Lease invariant: B confirmed before A's last deadline A knew of at that time.
            let a_deadline = a
                .deadlines
                .iter()
                .filter(|(t, _)| *t <= b.t_ok)
                .map(|&(_, d)| d)
                .max();
            if a_deadline.is_some_and(|d| b.t_ok < d) && !b.stale_on_arrival() {
                if during_state_loss {
                    r.lease_violations_in_state_loss += 1;
                } else {
                    r.lease_violations += 1;
                }
            }
            // Whose writes to judge: normally A's after B's grant; when B arrived stale (its
            // deadline had passed when its caller saw it), B is the stale holder and A the
            // valid one, so B's writes during A's hold are judged.
            let (stale, newer, newer_end) = if b.stale_on_arrival() {
                (b, a, a_end)
            } else {
                (a, b, b.end(run_end))
            };
            // The newer holder showed its token to the fenced store once its first fenced op
            // completed.
            let b_registered = newer
                .ops
                .iter()
                .filter(|o| o.fenced)
                .map(|o| o.t_done)
                .min();
            let late: Vec<&Op> = stale
                .ops
                .iter()
                .filter(|o| o.t_done > b.t_ok && o.t < newer_end)
                .collect();
            // An accepted unfenced write is applied somewhere between its send and its reply,
            // so one answered after B's grant was confirmed (every op in `late` was) may have
            // landed inside B's hold, and so may one never answered. A holder stopped between
            // its validity check and its write sends it on resuming, after its lease ran out:
            // the short nemesis runs met one never answered (its body cancelled on resuming)
            // that undid 138 of the successors' increments, and one answered 2.8 s after it was
            // logged as sent that undid 156. Both are the unfenced-write risk fencing closes
            // (RELIABILITY.md FM1), and every unfenced lost update must be explained by one.
            let class = if late.iter().any(|o| !o.fenced && o.is_write() && o.accepted) {
                OverlapClass::UnnoticedUnfenced
            } else if late
                .iter()
                .any(|o| o.fenced && o.accepted && b_registered.is_some_and(|t| o.t > t))
            {
                OverlapClass::UnnoticedFenced
            } else if late.iter().any(|o| o.fenced && !o.accepted) {
                OverlapClass::Fenced
            } else {
                OverlapClass::Lost
            };
            r.overlaps.push(Overlap {
                stale: stale.id.clone(),
                newer: newer.id.clone(),
                stale_token: stale.token,
                newer_token: newer.token,
                overlap_ns: a_end.min(b.end(run_end)) - b.t_ok,
                class,
                during_state_loss,
            });
        }
    }

    // Recovery: a grant within ttl + 2 s after each fault ends, if the run went on that long.
    let grace = ttl_ns + 2_000_000_000;
    for f in &input.faults {
        if f.t_end + grace > r.last_ok {
            continue;
        }
        let next = holds.iter().map(|h| h.t_ok).find(|&t| t >= f.t_end);
        if next.is_none_or(|t| t > f.t_end + grace) {
            r.slow_recoveries += 1;
        }
    }
    r.orphan_bound_ns = (ttl_ns + GIVE_BACK_SLACK_NS).max(input.give_back_ns);
    (r.orphans, r.longest_unheld_ns) = find_orphans(
        holds,
        &input.faults,
        run_end,
        input.t_stop,
        r.orphan_bound_ns,
    );
    r.faults = input.faults;
    r
}

/// The orphan check. Every task asks for the lock again as soon as its hold or its failed
/// acquire ends, so from the first grant until the workers stop asking the name is always
/// wanted. Walk the grants in time order keeping `cover`, the latest end of any believed hold
/// granted so far: a grant after `cover` ends a stretch in which nobody believed they held the
/// name. That stretch is an orphan when it lasts longer than `bound` after the later of
/// `cover` and the end of every store fault that overlaps it (a server down, paused or
/// partitioned, a failover: the lock service could not grant; the slow-recovery figure judges
/// those). So it is the slow-recovery figure's grace (`ttl + 2 s`) applied to every hold's end,
/// not only to a fault's end: a holder killed or stopped leaves the name free after its lease
/// (`ttl`), a release frees it at once, and waiters learn of it within the 2 s. A name still
/// held on the server by a process that believes it gave it back, or held by a session nobody
/// uses, shows as such a stretch. The stretch from the last hold's end to `t_stop` is judged
/// too when `t_stop` is known. Returns the orphans and the longest stretch judged.
pub(crate) fn find_orphans(
    holds: &[Hold],
    faults: &[Fault],
    run_end: u64,
    t_stop: u64,
    bound: u64,
) -> (Vec<Orphan>, u64) {
    let mut by_ok: Vec<&Hold> = holds.iter().collect();
    by_ok.sort_by_key(|h| h.t_ok);
    let mut out = Vec::new();
    let mut longest = 0u64;
    let mut cover: Option<(u64, &Hold)> = None;
    let mut judge =
        |from: u64, to: u64, after: &Hold, next: Option<&Hold>, out: &mut Vec<Orphan>| {
            if to <= from {
                return;
            }
            // The bound starts after the last store fault that overlaps the stretch.
            let start = faults
                .iter()
                .filter(|f| f.is_store_fault() && f.t_start < to && f.t_end > from)
                .map(|f| f.t_end)
                .fold(from, u64::max);
            longest = longest.max(to.saturating_sub(start));
            if to > start && to - start > bound {
                let after_end = if after.t_killed == Some(after.end(run_end)) {
                    "killed".to_string()
                } else if after
                    .t_lost
                    .is_some_and(|l| after.t_rel_send.is_none_or(|r| l < r))
                {
                    "lost".to_string()
                } else {
                    after.rel.clone().unwrap_or_else(|| "open".into())
                };
                out.push(Orphan {
                    t_start: start,
                    t_end: to,
                    len_ns: to - start,
                    after: after.id.clone(),
                    after_end,
                    next: next.map(|h| h.id.clone()),
                });
            }
        };
    for h in by_ok {
        if let Some((c, prev)) = cover
            && h.t_ok > c
        {
            judge(c, h.t_ok, prev, Some(h), &mut out);
        }
        let e = h.end(run_end);
        if cover.is_none_or(|(c, _)| e > c) {
            cover = Some((e, h));
        }
    }
    if let Some((c, prev)) = cover
        && t_stop > 0
    {
        judge(c, t_stop, prev, None, &mut out);
    }
    (out, longest)
}

/// Loads and analyses a run directory.
pub(crate) fn check_dir(dir: &Path, ttl_ns: u64) -> std::io::Result<Report> {
    Ok(analyse(load(dir)?, ttl_ns))
}

/// The semaphore and read-write checks. Walks the grants in confirmation order keeping the holds
/// still believed held; at each grant `b` (not stale on arrival), the holds valid at `b.t_ok` are
/// those whose own last known deadline lies after it (as the lock's lease invariant): both
/// they and `b` were live on the server at that instant. A semaphore grant beside `max` of them,
/// a write grant beside any of them, a read grant beside a valid write, is a violation (counted
/// apart inside state-loss windows). Writer starvation: a writer's wait that ran out while no
/// fault window (extended by ttl + 2 s) overlapped it.
pub(crate) fn analyse_primitive(
    holds: &[Hold],
    faults: &[Fault],
    writer_timeouts: &[(u64, u64)],
    r: &mut Report,
    run_end: u64,
    ttl_ns: u64,
    in_loss: &dyn Fn(u64) -> bool,
) {
    let sem = r.workload == "semaphore";
    let valid_at = |a: &Hold, t: u64| {
        !a.stale_on_arrival()
            && a.deadlines
                .iter()
                .filter(|(s, _)| *s <= t)
                .map(|&(_, d)| d)
                .max()
                .is_some_and(|d| t < d)
    };
    let mut active: Vec<&Hold> = Vec::new();
    for b in holds {
        active.retain(|a| a.end(run_end) > b.t_ok);
        if b.side == "w" {
            r.writes += 1;
            r.writer_wait_max_ns = r.writer_wait_max_ns.max(b.t_ok.saturating_sub(b.t_send));
        }
        if b.downgrade {
            r.downgrades += 1;
        }
        if !b.stale_on_arrival() {
            let valid: Vec<&Hold> = active
                .iter()
                .copied()
                .filter(|a| valid_at(a, b.t_ok))
                .collect();
            r.max_valid = r.max_valid.max(valid.len() + 1);
            if b.side == "r" && valid.iter().any(|a| a.side == "r") {
                r.shared_reads += 1;
            }
            let bad: Option<String> = if sem {
                (valid.len() as u64 >= r.sem_max).then(|| {
                    format!(
                        "{} (token {}) granted while {} permits of max {} were valid: {:?}",
                        b.id,
                        b.token,
                        valid.len(),
                        r.sem_max,
                        valid.iter().map(|a| a.id.as_str()).collect::<Vec<_>>()
                    )
                })
            } else {
                let clash: Vec<&Hold> = valid
                    .iter()
                    .copied()
                    .filter(|a| b.side == "w" || a.side == "w")
                    .collect();
                (!clash.is_empty()).then(|| {
                    format!(
                        "{} ({}, token {}) granted beside valid {:?}",
                        b.id,
                        b.side,
                        b.token,
                        clash
                            .iter()
                            .map(|a| format!("{} ({})", a.id, a.side))
                            .collect::<Vec<_>>()
                    )
                })
            };
            if let Some(what) = bad {
                if in_loss(b.t_ok) {
                    r.prim_violations_in_state_loss += 1;
                } else {
                    r.prim_violations += 1;
                    if r.prim_examples.len() < 20 {
                        r.prim_examples.push(format!("violation: {what}"));
                    }
                }
            }
        }
        active.push(b);
        r.max_believed = r.max_believed.max(active.len());
    }
    let grace = ttl_ns + GIVE_BACK_SLACK_NS;
    r.writer_timeouts = writer_timeouts.len();
    r.writers_starved = writer_timeouts
        .iter()
        .filter(|&&(from, to)| {
            !faults
                .iter()
                .any(|f| f.t_start < to && f.t_end + grace > from)
        })
        .count();
}
