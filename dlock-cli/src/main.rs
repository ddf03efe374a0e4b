//! `dlock`: the operator's view of the locks on a backend.
//!
//! ```text
//! dlock [--url URL]... list [PATTERN] [--kind K] [--json]   held locks, semaphores and read-write locks:
//!                                                 holder (name@host:pid), owner, holds, remaining lease, token, waiters
//! dlock [--url URL]... show NAME [--kind K] [--json]        one in detail (semaphore: max, permits per holder;
//!                                                 read-write lock: mode, readers, writer, waiting writer)
//! dlock [--url URL]... unlock NAME [--yes]                  force-release a lock, wake one waiter
//! dlock [--url URL]... unlock NAME --owner O [--yes]        evict one holder of a semaphore or read-write lock
//! dlock [--url URL]... watch [PATTERN]           live acquisitions and releases of locks until Ctrl-C
//! dlock [--url URL]... leader NAME [--json]      an election's leader: holder, epoch, remaining lease, value
//! ```
//!
//! The URL comes from `--url` or `DLOCK_URL` (default `redis://127.0.0.1:6379`): every form the
//! library's registry accepts (`redis://`, `rediss://`, `unix://`, and with this binary's features
//! `postgres://`, `mysql://`, `zk://`, `zks://` (with `tls`), `etcd://`). Several `--url`s with
//! `--redlock` are the nodes of a Redlock set; with `--cluster` the seeds of a Redis Cluster; with
//! `--sentinel MASTER` the sentinels of a master (its credentials from `DLOCK_MASTER_USER` /
//! `DLOCK_MASTER_PASSWORD`). Exit codes: 0 done, 1 unexpected server error, 2 usage (also: a name
//! held as several kinds without `--kind`, a semaphore or read-write lock unlocked without
//! `--owner`), 3 not found, 4 refused (confirmation not given, or the holder changed), 5
//! connection failed (refused, timed out, authentication), 6 this backend or URL is not supported
//! (also: semaphores and read-write locks on an engine whose admin does not read them). No
//! password is ever printed.

use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;

/// Prints a line on stdout. A closed stdout (`| head -1`: the reader left) is not an error and
/// never a panic: the command's action does not depend on its output, and output nobody reads is
/// dropped.
/// One line on stdout, with control characters escaped (see [`safe`]).
macro_rules! out {
    () => {{
        let _ = writeln!(std::io::stdout());
    }};
    ($($t:tt)*) => {{
        let _ = writeln!(std::io::stdout(), "{}", safe(&format!($($t)*)));
    }};
}

/// `s` with every control character (C0, DEL, C1) and every bidirectional override escaped as
/// `\u{..}` (`\n`, `\r`, `\t` as such): lock names and owners come from end users and Redis
/// keys may hold any byte, so ESC, CR, LF or OSC sequences must not reach the operator's
/// terminal raw (they could hide or forge rows, or write the clipboard). `--json` output is
/// escaped by JSON itself.
fn safe(s: &str) -> std::borrow::Cow<'_, str> {
    let bad =
        |c: char| c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
    if !s.chars().any(bad) {
        return s.into();
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if bad(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out.into()
}

use std::time::Duration;

use clap::{Parser, Subcommand};
use dlock_runtime::admin::{
    self, Admin, AdminError, AdminErrorKind, ForceReleased, Holder, HolderRole, LockEvent,
    LockInfo, LockKind,
};
use serde_json::json;

#[derive(Parser, Debug)]
#[command(
    name = "dlock",
    version,
    about = "Inspect and operate dlock locks on a backend",
    after_help = engines_help()
)]
struct Cli {
    /// Backend URL: redis://[user[:password]@]host[:port][/db], rediss://, unix://, postgres://,
    /// mysql://, zk://, zks://, etcd:// (as the library's registry). Repeat for --redlock,
    /// --cluster, --sentinel. The password is never printed.
    #[arg(
        long,
        env = "DLOCK_URL",
        default_value = "redis://127.0.0.1:6379",
        hide_env_values = true,
        global = true
    )]
    url: Vec<String>,
    /// The URLs are the nodes of a Redlock set.
    #[arg(long, global = true, conflicts_with_all = ["cluster", "sentinel"])]
    redlock: bool,
    /// The URLs are seeds of a Redis Cluster (feature `cluster`).
    #[arg(long, global = true, conflicts_with = "sentinel")]
    cluster: bool,
    /// The URLs are Redis Sentinels; MASTER is the master's name (feature `sentinel`). The
    /// master's credentials come from DLOCK_MASTER_USER / DLOCK_MASTER_PASSWORD.
    #[arg(long, global = true, value_name = "MASTER")]
    sentinel: Option<String>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Held locks, semaphores and read-write locks whose name matches PATTERN (a shell glob,
    /// default `*`). Engines whose admin reads plain locks only list those (a note on stderr).
    List {
        /// Glob over names, e.g. `order:*`.
        pattern: Option<String>,
        /// Only this kind: lock, semaphore (sem), rwlock (rw).
        #[arg(long, value_parser = parse_kind)]
        kind: Option<LockKind>,
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One lock, semaphore or read-write lock in detail (exit 3 if it is not held; with
    /// --json, `null` on stdout; exit 2 if the name is held as several kinds and --kind is not
    /// given).
    Show {
        /// The name, as given to `Lock::new`, `Semaphore::new`, `RwLock::new` or rendered from
        /// the attribute's key.
        name: String,
        /// Which kind: lock, semaphore (sem), rwlock (rw). Default: the one held.
        #[arg(long, value_parser = parse_kind)]
        kind: Option<LockKind>,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Force-release a lock (only if it is still the hold shown) and wake one waiter; or, with
    /// --owner, evict one holder of a semaphore (its permits come back and waiters are woken
    /// for them) or of a read-write lock (a reader, or the writer), only if that holder's grant
    /// is still the one shown, as its own release would. The evicted holder's `lost()` fires at
    /// its next renewal (within a third of its ttl) or, on ZooKeeper and etcd, when it sees its
    /// node or key deleted.
    Unlock {
        /// The name.
        name: String,
        /// Which kind: lock, semaphore (sem), rwlock (rw). Default: the one held.
        #[arg(long, value_parser = parse_kind)]
        kind: Option<LockKind>,
        /// The owner id of the semaphore or read-write lock holder to evict (from `show`).
        #[arg(long)]
        owner: Option<String>,
        /// Do not ask for confirmation.
        #[arg(long, short = 'y')]
        yes: bool,
    },
    /// Live acquisitions and releases of locks matching PATTERN, until Ctrl-C (plain locks only:
    /// semaphores and read-write locks are not watched; list or show them).
    Watch {
        /// Glob over lock names, e.g. `order:*`.
        pattern: Option<String>,
    },
    /// The current leader of the election NAME (`dlock::Election::new(NAME)`): its holder, epoch
    /// (the term's fencing token), remaining lease, and the value it proclaimed (exit 3 when no
    /// term is held).
    Leader {
        /// The election's name (its term is the lock `election:NAME`).
        name: String,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// The `--help` footer: the engines this binary was built with, and the Cargo features of
/// `dlock-cli` that add the others (see its Cargo.toml).
fn engines_help() -> String {
    let engines = [
        ("sentinel", cfg!(feature = "sentinel"), "--sentinel"),
        ("cluster", cfg!(feature = "cluster"), "--cluster"),
        ("tls", cfg!(feature = "tls"), "rediss://, zks://"),
        ("postgres", cfg!(feature = "postgres"), "postgres://"),
        ("mysql", cfg!(feature = "mysql"), "mysql://"),
        ("zookeeper", cfg!(feature = "zookeeper"), "zk://"),
        ("etcd", cfg!(feature = "etcd"), "etcd://, needs protoc"),
    ];
    let list = |built: bool| {
        let v: Vec<String> = engines
            .iter()
            .filter(|e| e.1 == built)
            .map(|e| format!("{} ({})", e.0, e.2))
            .collect();
        if v.is_empty() {
            "none".into()
        } else {
            v.join(", ")
        }
    };
    format!(
        "Engines: Redis (redis://, unix://) and Redlock (--redlock) always.\n\
         Built with: {}.\n\
         Not built: {}.\n\
         More engines: cargo install --path dlock-cli --features <FEATURE,...> (`full`: all).",
        list(true),
        list(false)
    )
}

/// A `--kind` value.
fn parse_kind(s: &str) -> Result<LockKind, String> {
    LockKind::parse(s)
        .ok_or_else(|| format!("`{s}`: expected lock, semaphore (sem) or rwlock (rw)"))
}

/// An error with its exit code.
#[derive(Debug)]
enum CliError {
    Admin(AdminError),
    NotFound(String),
    Refused(String),
    Usage(String),
}

impl From<AdminError> for CliError {
    fn from(e: AdminError) -> Self {
        CliError::Admin(e)
    }
}

impl CliError {
    fn code(&self) -> u8 {
        match self {
            CliError::Admin(e) => match e.kind {
                AdminErrorKind::Connect => 5,
                AdminErrorKind::Unsupported => 6,
                AdminErrorKind::Refused => 4,
                _ => 1,
            },
            CliError::NotFound(_) => 3,
            CliError::Refused(_) => 4,
            CliError::Usage(_) => 2,
        }
    }

    fn message(&self) -> &str {
        match self {
            CliError::Admin(e) => &e.message,
            CliError::NotFound(m) | CliError::Refused(m) | CliError::Usage(m) => m,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dlock: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dlock: {}", safe(e.message()));
            ExitCode::from(e.code())
        }
    }
}

/// Connects the admin the options name.
async fn connect(cli: &Cli) -> Result<Box<dyn Admin>, CliError> {
    if let Some(master) = &cli.sentinel {
        return sentinel(master, &cli.url).await;
    }
    if cli.cluster {
        return cluster(&cli.url).await;
    }
    if cli.redlock {
        return Ok(Box::new(admin::RedlockAdmin::connect(&cli.url).await?));
    }
    match cli.url.as_slice() {
        [one] => Ok(admin::connect(one).await?),
        _ => Err(CliError::Admin(AdminError::unsupported(
            "several --url values need --redlock, --cluster or --sentinel MASTER to say what they are",
        ))),
    }
}

#[cfg(feature = "cluster")]
async fn cluster(urls: &[String]) -> Result<Box<dyn Admin>, CliError> {
    Ok(Box::new(admin::ClusterAdmin::connect(urls).await?))
}

#[cfg(not(feature = "cluster"))]
async fn cluster(_: &[String]) -> Result<Box<dyn Admin>, CliError> {
    Err(CliError::Admin(AdminError::unsupported(
        "--cluster needs the CLI's `cluster` feature",
    )))
}

#[cfg(feature = "sentinel")]
async fn sentinel(master: &str, urls: &[String]) -> Result<Box<dyn Admin>, CliError> {
    let user = std::env::var("DLOCK_MASTER_USER").ok();
    let password = std::env::var("DLOCK_MASTER_PASSWORD").ok();
    let auth = password.as_deref().map(|p| (user.as_deref(), p));
    Ok(Box::new(
        admin::SentinelAdmin::connect(master, urls, auth, 0).await?,
    ))
}

#[cfg(not(feature = "sentinel"))]
async fn sentinel(_: &str, _: &[String]) -> Result<Box<dyn Admin>, CliError> {
    Err(CliError::Admin(AdminError::unsupported(
        "--sentinel needs the CLI's `sentinel` feature",
    )))
}

/// What a kind is called in sentences.
fn kind_words(k: LockKind) -> &'static str {
    match k {
        LockKind::Semaphore => "semaphore",
        LockKind::RwLock => "read-write lock",
        _ => "lock",
    }
}

/// One owner in the list's OWNER column: the lock's owner, a semaphore holder's permits, a
/// read-write holder's side.
fn owner_cell(h: &Holder) -> String {
    match h.role {
        HolderRole::Permits(n) => format!("{} ({n})", h.owner),
        HolderRole::Reader => format!("{} (read)", h.owner),
        HolderRole::Writer => format!("{} (write)", h.owner),
        _ if h.holds == 0 => format!("{} (released, kept)", h.owner),
        _ => h.owner.clone(),
    }
}

fn owner_text(i: &LockInfo) -> String {
    if i.holders.is_empty() {
        return "-".into();
    }
    i.holders
        .iter()
        .map(owner_cell)
        .collect::<Vec<_>>()
        .join(",")
}

/// Who holds the lock: `name@host:pid` of each owner whose store keeps it, `-` otherwise.
fn holder_text(i: &LockInfo) -> String {
    let ids: Vec<String> = i
        .holders
        .iter()
        .map(|h| h.identity.as_ref().map_or("-".into(), |id| id.to_string()))
        .collect();
    if ids.is_empty() {
        "-".into()
    } else {
        ids.join(",")
    }
}

/// The HOLDS column: a lock's hold count, a semaphore's `used/max` permits, a read-write lock's
/// mode (and a waiting writer).
fn holds_text(i: &LockInfo) -> String {
    if let Some(s) = &i.semaphore {
        return format!("{}/{}", s.used, s.max);
    }
    if let Some(rw) = &i.rw {
        let readers = i
            .holders
            .iter()
            .filter(|h| h.role == HolderRole::Reader)
            .count();
        let mut t = match rw.mode {
            admin::RwMode::Read => format!("read {readers}"),
            m => m.as_str().to_string(),
        };
        if rw.waiting_writer.is_some() {
            t.push_str(", writer waiting");
        }
        return t;
    }
    i.holds().to_string()
}

/// The TOKEN column: the lock's (or writer's) token, else each holder's.
fn token_text(i: &LockInfo) -> String {
    if let Some(t) = i.token {
        return t.to_string();
    }
    let t: Vec<String> = i
        .holders
        .iter()
        .filter_map(|h| h.token.map(|t| t.to_string()))
        .collect();
    if t.is_empty() {
        "-".into()
    } else {
        t.join(",")
    }
}

fn fmt_left(d: Option<Duration>) -> String {
    match d {
        None => "-".into(),
        Some(d) if d >= Duration::from_secs(10) => format!("{:.0}s", d.as_secs_f64()),
        Some(d) => format!("{:.1}s", d.as_secs_f64()),
    }
}

fn holder_json(h: &Holder) -> serde_json::Value {
    let mut v = json!({
        "owner": h.owner,
        "holds": h.holds,
        "holder": h.identity.as_ref().map(|id| json!({"name": id.name, "host": id.host, "pid": id.pid})),
    });
    if h.role != HolderRole::Lock {
        v["role"] = json!(h.role.as_str());
        v["token"] = json!(h.token);
        v["remaining_ms"] = json!(h.remaining.map(|d| d.as_millis() as u64));
    }
    if let HolderRole::Permits(n) = h.role {
        v["permits"] = json!(n);
    }
    v
}

fn to_json(i: &LockInfo) -> serde_json::Value {
    let mut v = json!({
        "name": i.name,
        "kind": i.kind.as_str(),
        "owners": i.holders.iter().map(holder_json).collect::<Vec<_>>(),
        "holds": i.holds(),
        "remaining_ms": i.remaining.map(|d| d.as_millis() as u64),
        "fencing_token": i.token,
        "waiters": i.waiters,
        "waiters_are": i.waiters_are,
        "details": i.details.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
    });
    if let Some(s) = &i.semaphore {
        v["semaphore"] = json!({"max": s.max, "used": s.used, "free": s.free()});
    }
    if let Some(rw) = &i.rw {
        v["rwlock"] = json!({
            "mode": rw.mode.as_str(),
            "readers": i.holders.iter().filter(|h| h.role == HolderRole::Reader).count(),
            "writer": i.holders.iter().find(|h| h.role == HolderRole::Writer).map(|h| h.owner.clone()),
            "waiting_writer": rw.waiting_writer.as_ref().map(|w| json!({
                "owner": w.owner,
                "remaining_ms": w.remaining.map(|d| d.as_millis() as u64),
                "holder": w.identity.as_ref().map(|id| json!({"name": id.name, "host": id.host, "pid": id.pid})),
            })),
        });
    }
    v
}

fn pattern(p: Option<&str>) -> Result<glob::Pattern, CliError> {
    glob::Pattern::new(p.unwrap_or("*"))
        .map_err(|e| CliError::Refused(format!("invalid PATTERN: {e}")))
}

/// The engine's admin must read `kind` (an [`AdminErrorKind::Unsupported`] error otherwise).
fn check_kind(admin: &dyn Admin, kind: LockKind) -> Result<(), CliError> {
    if admin.kinds().contains(&kind) {
        Ok(())
    } else {
        Err(admin::unsupported_kind(admin.engine(), kind).into())
    }
}

async fn list(
    admin: &dyn Admin,
    pat: Option<&str>,
    kind: Option<LockKind>,
    as_json: bool,
) -> Result<(), CliError> {
    let glob = pattern(pat)?;
    if let Some(k) = kind {
        check_kind(admin, k)?;
    }
    let prefix = admin::glob_prefix(pat.unwrap_or("*"));
    let listing = admin.list(prefix).await?;
    let infos: Vec<&LockInfo> = listing
        .locks
        .iter()
        .filter(|i| glob.matches(&i.name) && kind.is_none_or(|k| k == i.kind))
        .collect();
    if listing.skipped > 0 {
        eprintln!(
            "dlock: {} entr{} in the lock namespace are not dlock locks; not shown",
            listing.skipped,
            if listing.skipped == 1 { "y" } else { "ies" }
        );
    }
    if kind.is_none() && admin.kinds().len() < LockKind::ALL.len() {
        eprintln!(
            "dlock: the {} admin lists plain locks only (no semaphores or read-write locks)",
            admin.engine()
        );
    }
    if as_json {
        let v: Vec<_> = infos.iter().map(|i| to_json(i)).collect();
        out!("{}", serde_json::Value::Array(v));
        return Ok(());
    }
    if infos.is_empty() {
        out!("no locks held");
        return Ok(());
    }
    let rows: Vec<[String; 8]> = infos
        .iter()
        .map(|i| {
            [
                safe(&i.name).into_owned(),
                i.kind.as_str().to_string(),
                safe(&holder_text(i)).into_owned(),
                safe(&owner_text(i)).into_owned(),
                holds_text(i),
                fmt_left(i.remaining),
                token_text(i),
                i.waiters.map_or("-".into(), |w| w.to_string()),
            ]
        })
        .collect();
    let head = [
        "NAME",
        "KIND",
        "HOLDER",
        "OWNER",
        "HOLDS",
        "REMAINING",
        "TOKEN",
        "WAITING",
    ];
    let mut w = head.map(str::len);
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cols: [&str; 8]| {
        cols.iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<width$}", width = w[i]))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    out!("{}", line(head));
    for r in &rows {
        out!("{}", line(std::array::from_fn(|k| r[k].as_str())));
    }
    Ok(())
}

fn print_identity(h: &Holder) {
    match &h.identity {
        Some(id) => out!(
            "holder         {} (host {}, pid {}, name {})",
            id,
            id.host,
            id.pid,
            id.name
        ),
        None => out!("holder         - (not stored for this owner)"),
    }
}

fn print_detail(i: &LockInfo) {
    match i.kind {
        LockKind::Semaphore => out!("semaphore      {}", i.name),
        LockKind::RwLock => out!("rwlock         {}", i.name),
        _ => out!("lock           {}", i.name),
    }
    if let Some(s) = &i.semaphore {
        out!(
            "permits        {} of {} held, {} free",
            s.used,
            s.max,
            s.free()
        );
    }
    if let Some(rw) = &i.rw {
        let readers = i
            .holders
            .iter()
            .filter(|h| h.role == HolderRole::Reader)
            .count();
        match rw.mode {
            admin::RwMode::Read => out!(
                "mode           read ({readers} reader{})",
                if readers == 1 { "" } else { "s" }
            ),
            m => out!("mode           {}", m.as_str()),
        }
    }
    for h in &i.holders {
        let token = h.token.map_or("-".into(), |t| t.to_string());
        let lease = fmt_left(h.remaining);
        let holds = format!("{} hold{}", h.holds, if h.holds == 1 { "" } else { "s" });
        match h.role {
            HolderRole::Permits(n) => out!(
                "owner          {} ({n} permit{}, token {token}, lease {lease})",
                h.owner,
                if n == 1 { "" } else { "s" }
            ),
            HolderRole::Reader => out!(
                "reader         {} ({holds}, token {token}, lease {lease})",
                h.owner
            ),
            HolderRole::Writer => out!(
                "writer         {} ({holds}, token {token}, lease {lease})",
                h.owner
            ),
            _ if h.holds == 0 => out!(
                "owner          {} (released; kept taken by hold_at_least)",
                h.owner
            ),
            _ => out!("owner          {} ({holds})", h.owner),
        }
        print_identity(h);
    }
    if let Some(rw) = &i.rw {
        match &rw.waiting_writer {
            Some(w) => {
                out!(
                    "writer waiting {} (marker lease {}; new readers wait)",
                    w.owner,
                    fmt_left(w.remaining)
                );
                print_identity(w);
            }
            None => out!("writer waiting -"),
        }
    }
    let remaining = match (i.kind, i.remaining) {
        (_, None) => "- (no per-lock expiry: the lease is the holder's session)".into(),
        (LockKind::Lock, r) => fmt_left(r),
        (_, r) => format!("{} (the longest lease)", fmt_left(r)),
    };
    out!("remaining      {remaining}");
    // A semaphore's and a read-write lock's tokens are their holders' (above).
    if i.kind == LockKind::Lock {
        out!(
            "fencing token  {}",
            i.token.map_or("-".into(), |t| t.to_string())
        );
    }
    match i.waiters {
        Some(w) => out!("waiting        {w} {}", i.waiters_are),
        None => out!("waiting        - (not visible on this backend)"),
    }
    for (k, v) in &i.details {
        out!("{k:<14} {v}");
    }
}

/// The name held as `kind`, or as the one kind it is held as; `Ok(None)` when not held.
async fn resolve(
    admin: &dyn Admin,
    name: &str,
    kind: Option<LockKind>,
) -> Result<Option<LockInfo>, CliError> {
    if let Some(k) = kind {
        check_kind(admin, k)?;
        return Ok(admin.show_kind(name, k).await?);
    }
    let mut held = Vec::new();
    for k in admin.kinds() {
        if let Some(i) = admin.show_kind(name, *k).await? {
            held.push(i);
        }
    }
    if held.len() > 1 {
        let kinds: Vec<&str> = held.iter().map(|i| i.kind.as_str()).collect();
        return Err(CliError::Usage(format!(
            "`{name}` is held as {}: say which with --kind",
            kinds.join(" and as ")
        )));
    }
    Ok(held.pop())
}

async fn show(
    admin: &dyn Admin,
    name: &str,
    kind: Option<LockKind>,
    as_json: bool,
) -> Result<(), CliError> {
    let Some(i) = resolve(admin, name, kind).await? else {
        if as_json {
            // Scripts get a JSON value on stdout either way (exit 3 still says "not held").
            out!("null");
        }
        return Err(CliError::NotFound(format!(
            "{} `{name}` is not held",
            kind.map_or("lock", kind_words)
        )));
    };
    if as_json {
        out!("{}", to_json(&i));
    } else {
        print_detail(&i);
    }
    Ok(())
}

/// Asks on stdin; `Err(Refused)` unless the answer is yes.
fn confirm(question: &str) -> Result<(), CliError> {
    let _ = write!(std::io::stdout(), "{} [y/N] ", safe(question));
    let _ = std::io::stdout().flush();
    let mut answer = String::new();
    let stdin = std::io::stdin();
    let interactive = stdin.is_terminal();
    let read = stdin.lock().read_line(&mut answer).unwrap_or(0);
    if read == 0 {
        out!();
        return Err(CliError::Refused(if interactive {
            "not confirmed; nothing done".into()
        } else {
            "not confirmed (no answer on stdin; pass --yes in scripts); nothing done".into()
        }));
    }
    if !matches!(answer.trim(), "y" | "Y" | "yes" | "YES") {
        return Err(CliError::Refused("not confirmed; nothing done".into()));
    }
    Ok(())
}

async fn unlock(
    admin: &dyn Admin,
    name: &str,
    kind: Option<LockKind>,
    owner: Option<&str>,
    yes: bool,
) -> Result<(), CliError> {
    let i = resolve(admin, name, kind).await?.ok_or_else(|| {
        CliError::NotFound(format!(
            "{} `{name}` is not held; nothing to do",
            kind.map_or("lock", kind_words)
        ))
    })?;
    match (i.kind, owner) {
        (LockKind::Lock, None) => {}
        (LockKind::Lock, Some(_)) => {
            return Err(CliError::Usage(format!(
                "lock `{name}` has one owner: unlock it without --owner"
            )));
        }
        (k, None) => {
            return Err(CliError::Usage(format!(
                "{} `{name}` has {} holder{}: name the one to evict with --owner OWNER (see \
                 `dlock show`)",
                kind_words(k),
                i.holders.len(),
                if i.holders.len() == 1 { "" } else { "s" }
            )));
        }
        (k, Some(o)) => return evict(admin, &i, k, o, yes).await,
    }
    // With --yes, act first and print after: an output nobody reads must not decide whether the
    // lock is released.
    if !yes {
        print_detail(&i);
        confirm(&format!("force-release lock `{name}`? the holder loses it"))?;
    }
    let released = admin.force_release(name, Some(&i)).await?;
    if yes {
        print_detail(&i);
    }
    match released {
        ForceReleased::NotHeld => Err(CliError::NotFound(format!(
            "lock `{name}` was released before the unlock; nothing done"
        ))),
        ForceReleased::Changed => Err(CliError::Refused(format!(
            "lock `{name}` changed hands since it was shown; nothing done (run again)"
        ))),
        ForceReleased::Released { was, woke } => {
            out!(
                "released lock `{name}` (was held by {}, fencing token {}) on {}",
                owner_text(&was),
                was.token.map_or("-".into(), |t| t.to_string()),
                admin.target()
            );
            match woke {
                Some(n) => out!("woke {n} waiting {}", was.waiters_are),
                None => out!("the next waiter is woken by the backend"),
            }
            out!(
                "the evicted holder's lost() fires at its next renewal (within a third of its ttl)"
            );
            Ok(())
        }
    }
}

/// `unlock NAME --owner OWNER` of a semaphore or read-write lock: evicts that one holder.
async fn evict(
    admin: &dyn Admin,
    i: &LockInfo,
    kind: LockKind,
    owner: &str,
    yes: bool,
) -> Result<(), CliError> {
    let name = &i.name;
    let words = kind_words(kind);
    let Some(h) = i.holder(owner) else {
        return Err(CliError::NotFound(format!(
            "{owner} holds nothing of {words} `{name}`; nothing to do (see `dlock show`)"
        )));
    };
    let what = match h.role {
        HolderRole::Permits(n) => format!("its {n} permit{}", if n == 1 { "" } else { "s" }),
        HolderRole::Writer => "its write hold".into(),
        _ => "its read hold".into(),
    };
    if !yes {
        print_detail(i);
        confirm(&format!(
            "evict {owner} from {words} `{name}`? it loses {what}"
        ))?;
    }
    let r = admin.evict(name, kind, owner, Some(i)).await?;
    if yes {
        print_detail(i);
    }
    match r {
        ForceReleased::NotHeld => Err(CliError::NotFound(format!(
            "{owner} gave back its hold of {words} `{name}` before the unlock; nothing done"
        ))),
        ForceReleased::Changed => Err(CliError::Refused(format!(
            "{owner}'s hold of {words} `{name}` changed since it was shown; nothing done (run \
             again)"
        ))),
        ForceReleased::Released { .. } => {
            out!(
                "evicted {owner} from {words} `{name}` ({what}, token {}) on {}",
                h.token.map_or("-".into(), |t| t.to_string()),
                admin.target()
            );
            match kind {
                LockKind::Semaphore => out!(
                    "the permits came back; waiters are woken for them, as on the owner's release"
                ),
                _ => out!("waiters are woken as on the owner's release"),
            }
            out!(
                "the evicted holder's lost() fires at its next renewal (within a third of its ttl)"
            );
            Ok(())
        }
    }
}

fn now_text() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let s = t.as_secs() % 86_400;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        s / 3600,
        s / 60 % 60,
        s % 60,
        t.subsec_millis()
    )
}

async fn watch(admin: &dyn Admin, pat: Option<&str>) -> Result<(), CliError> {
    let glob = pattern(pat)?;
    let prefix = admin::glob_prefix(pat.unwrap_or("*"));
    let mut w = admin.watch(prefix).await?;
    out!(
        "watching {} on {}{}; Ctrl-C to stop",
        w.sees,
        admin.target(),
        if admin.kinds().len() > 1 {
            " (plain locks: semaphores and read-write locks are not watched)"
        } else {
            ""
        }
    );
    let _ = std::io::stdout().flush();
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        let ev = tokio::select! {
            _ = &mut ctrl_c => return Ok(()),
            e = w.events.recv() => e,
        };
        let ev = match ev {
            Some(Ok(e)) => e,
            Some(Err(e)) => return Err(e.into()),
            None => {
                return Err(CliError::Admin(AdminError::connect(
                    "the watch ended (connection closed)",
                )));
            }
        };
        if !glob.matches(ev.name()) {
            continue;
        }
        let what = match &ev {
            LockEvent::Acquired { owner, token, .. } => {
                let mut s = "acquired".to_string();
                if let Some(o) = owner {
                    s.push_str(&format!(" by {o}"));
                }
                if let Some(t) = token {
                    s.push_str(&format!(" token {t}"));
                }
                s
            }
            LockEvent::Released { .. } => "released (one waiter woken)".into(),
            LockEvent::Expired { .. } => {
                "expired (lease or session ended without a release)".into()
            }
            LockEvent::Other { what, .. } => what.clone(),
            _ => format!("{ev:?}"),
        };
        let mut stdout = std::io::stdout();
        let line = format!("{}  {}  {what}", now_text(), ev.name());
        if writeln!(stdout, "{}", safe(&line))
            .and_then(|()| stdout.flush())
            .is_err()
        {
            // Nobody reads the events any more (`| head`): the watch is over.
            return Ok(());
        }
    }
}

/// The leader record of the lock `lock` (the value a leader proclaimed), read through a backend
/// connected to the one `--url` (the multi-URL modes do not read it: `None`). A backend without
/// records, or a failed read, is `Err` with the reason, shown instead of the value.
async fn leader_record(
    cli: &Cli,
    lock: &str,
) -> Option<Result<Option<dlock_runtime::backend::Record>, String>> {
    if cli.sentinel.is_some() || cli.cluster || cli.redlock {
        return None;
    }
    let [url] = cli.url.as_slice() else {
        return None;
    };
    const NAME: &str = "dlock-cli-leader";
    let read = async {
        dlock_runtime::init_named(NAME, url)
            .await
            .map_err(|e| e.to_string())?;
        let b = dlock_runtime::backend(NAME).map_err(|e| e.to_string())?;
        b.get_record(lock).await.map_err(|e| e.to_string())
    };
    Some(
        match tokio::time::timeout(admin::CALL_TIMEOUT, read).await {
            Ok(r) => r,
            Err(_) => Err(format!("no answer within {:?}", admin::CALL_TIMEOUT)),
        },
    )
}

async fn leader(cli: &Cli, admin: &dyn Admin, name: &str, as_json: bool) -> Result<(), CliError> {
    let lock = format!("{}{name}", dlock_runtime::ELECTION_PREFIX);
    let info = admin.show(&lock).await?;
    let record = leader_record(cli, &lock).await;
    if as_json {
        let value = match &record {
            Some(Ok(Some(r))) => json!({"value": r.value, "epoch": r.epoch}),
            Some(Ok(None)) => json!(null),
            Some(Err(e)) => json!({"error": e}),
            None => json!({"error": "not read with --redlock, --cluster or --sentinel"}),
        };
        out!(
            "{}",
            json!({
                "election": name,
                "lock": lock,
                "term": info.as_ref().map(to_json),
                "record": value,
            })
        );
    } else {
        out!("election       {name} (lock {lock})");
        match &info {
            Some(i) => {
                out!("leader         {}", owner_text(i));
                out!(
                    "epoch          {}",
                    i.token
                        .map_or("- (not stored by this backend)".into(), |t| t.to_string())
                );
                out!(
                    "remaining      {}",
                    match i.remaining {
                        Some(_) => fmt_left(i.remaining),
                        None => "- (no per-lock expiry: the lease is the holder's session)".into(),
                    }
                );
            }
            None => out!("leader         none (no term is held)"),
        }
        match &record {
            Some(Ok(Some(r))) => out!(
                "value          {} (proclaimed by epoch {})",
                r.value,
                r.epoch
            ),
            Some(Ok(None)) => out!("value          - (no leader record written)"),
            Some(Err(e)) => out!("value          - ({e})"),
            None => out!("value          - (not read with --redlock, --cluster or --sentinel)"),
        }
    }
    match info {
        Some(_) => Ok(()),
        None => Err(CliError::NotFound(format!(
            "no leader: the election `{name}` has no term held"
        ))),
    }
}

async fn run(cli: Cli) -> Result<(), CliError> {
    let admin = connect(&cli).await?;
    let admin = admin.as_ref();
    match &cli.cmd {
        Cmd::List {
            pattern,
            kind,
            json,
        } => list(admin, pattern.as_deref(), *kind, *json).await,
        Cmd::Show { name, kind, json } => show(admin, name, *kind, *json).await,
        Cmd::Unlock {
            name,
            kind,
            owner,
            yes,
        } => unlock(admin, name, *kind, owner.as_deref(), *yes).await,
        Cmd::Watch { pattern } => watch(admin, pattern.as_deref()).await,
        Cmd::Leader { name, json } => leader(&cli, admin, name, *json).await,
    }
}
