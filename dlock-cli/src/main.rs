//! `dlock`: the operator's view of the locks on a backend.
//!
//! ```text
//! dlock [--url URL] list [PATTERN] [--json]   held locks: owner, holds, remaining lease, token, waiters
//! dlock [--url URL] show NAME [--json]        one lock in detail
//! dlock [--url URL] unlock NAME [--yes]       force-release, wake one waiter per waiting process
//! dlock [--url URL] watch [PATTERN]           live acquisitions and releases until Ctrl-C
//! ```
//!
//! The URL comes from `--url` or `DLOCK_URL` (default `redis://127.0.0.1:6379`). Exit codes:
//! 0 done, 1 unexpected server error, 2 usage, 3 not found, 4 refused (confirmation not given,
//! or the holder changed), 5 connection failed (refused, timed out, authentication), 6 this
//! backend or URL is not supported. The password of a URL is never printed.

use std::collections::BTreeMap;
use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use serde_json::json;

/// Every call to the server is bounded by this.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Parser, Debug)]
#[command(
    name = "dlock",
    version,
    about = "Inspect and operate dlock locks on a backend"
)]
struct Cli {
    /// Backend URL, `redis://[user[:password]@]host[:port][/db]`. The password is never printed.
    #[arg(
        long,
        env = "DLOCK_URL",
        default_value = "redis://127.0.0.1:6379",
        hide_env_values = true,
        global = true
    )]
    url: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Held locks whose name matches PATTERN (a shell glob, default `*`).
    List {
        /// Glob over lock names, e.g. `order:*`.
        pattern: Option<String>,
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One lock in detail (exit 3 if it is not held).
    Show {
        /// The lock name, as given to `Lock::new` or rendered from the attribute's key.
        name: String,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Force-release a lock and wake one waiter in each waiting process. The evicted holder's
    /// `lost()` fires at its next renewal (within ttl/3).
    Unlock {
        /// The lock name.
        name: String,
        /// Do not ask for confirmation.
        #[arg(long, short = 'y')]
        yes: bool,
    },
    /// Live acquisitions and releases of locks matching PATTERN, until Ctrl-C.
    Watch {
        /// Glob over lock names, e.g. `order:*`.
        pattern: Option<String>,
    },
}

/// An error with its exit code.
#[derive(Debug)]
enum CliError {
    Server(String),
    NotFound(String),
    Refused(String),
    Connect(String),
    Unsupported(String),
}

impl CliError {
    fn code(&self) -> u8 {
        match self {
            CliError::Server(_) => 1,
            CliError::NotFound(_) => 3,
            CliError::Refused(_) => 4,
            CliError::Connect(_) => 5,
            CliError::Unsupported(_) => 6,
        }
    }

    fn message(&self) -> &str {
        match self {
            CliError::Server(m)
            | CliError::NotFound(m)
            | CliError::Refused(m)
            | CliError::Connect(m)
            | CliError::Unsupported(m) => m,
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
            eprintln!("dlock: {}", e.message());
            ExitCode::from(e.code())
        }
    }
}

/// A checked backend URL and its printable form.
struct Target {
    url: String,
    shown: String,
    db: i64,
}

/// The URL with its password replaced by `***`, for output.
fn redact(u: &url::Url) -> String {
    let mut u = u.clone();
    if u.password().is_some() {
        let _ = u.set_password(Some("***"));
    }
    u.to_string()
}

fn parse_target(raw: &str) -> Result<Target, CliError> {
    let u = url::Url::parse(raw).map_err(|e| {
        CliError::Unsupported(format!(
            "cannot parse the URL ({e}); expected redis://[user[:password]@]host[:port][/db]"
        ))
    })?;
    let shown = redact(&u);
    match u.scheme() {
        "redis" | "rediss" | "redis+unix" | "unix" => {}
        other => {
            return Err(CliError::Unsupported(format!(
                "`{other}://` URLs: not supported for this backend yet (the dlock CLI speaks \
                 Redis only: redis://, rediss://, unix://); URL: {shown}"
            )));
        }
    }
    let db = u.path().trim_start_matches('/').parse::<i64>().unwrap_or(0);
    Ok(Target {
        url: raw.to_string(),
        shown,
        db,
    })
}

async fn bounded<T, F>(what: &str, fut: F) -> Result<T, CliError>
where
    F: std::future::Future<Output = redis::RedisResult<T>>,
{
    match tokio::time::timeout(CALL_TIMEOUT, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() => {
            Err(CliError::Connect(format!("{what}: connection failed: {e}")))
        }
        Ok(Err(e)) => Err(CliError::Server(format!("{what}: {e}"))),
        Err(_) => Err(CliError::Connect(format!(
            "{what}: no reply within {CALL_TIMEOUT:?}"
        ))),
    }
}

async fn connect(t: &Target) -> Result<(redis::Client, MultiplexedConnection), CliError> {
    let client = redis::Client::open(t.url.as_str()).map_err(|e| {
        CliError::Unsupported(format!(
            "cannot use {}: {}",
            t.shown,
            e.detail().unwrap_or("invalid URL")
        ))
    })?;
    let conn =
        match tokio::time::timeout(CALL_TIMEOUT, client.get_multiplexed_async_connection()).await {
            Ok(Ok(c)) => c,
            // Every failure to connect (refused, DNS, TLS, AUTH) is a connection failure; redis-rs's
            // messages do not contain the password.
            Ok(Err(e)) => {
                return Err(CliError::Connect(format!(
                    "cannot connect to {}: {e}",
                    t.shown
                )));
            }
            Err(_) => {
                return Err(CliError::Connect(format!(
                    "cannot connect to {}: no answer within {CALL_TIMEOUT:?}",
                    t.shown
                )));
            }
        };
    Ok((client, conn))
}

/// The lock name of a Redis lock key `dlock:{E}`, or `None` for any other key (the fence key,
/// a foreign key under `dlock:`, an escape the library never writes).
fn name_of_key(key: &str) -> Option<String> {
    let e = key.strip_prefix("dlock:{")?.strip_suffix('}')?;
    if e.contains('}') {
        return None;
    }
    let mut out = String::with_capacity(e.len());
    let mut chars = e.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next()? {
                '\\' => out.push('\\'),
                '(' => out.push('{'),
                ')' => out.push('}'),
                _ => return None,
            }
        } else if c == '{' {
            return None;
        } else {
            out.push(c);
        }
    }
    (!out.is_empty() && dlock_runtime::redis_keys(&out).lock == key).then_some(out)
}

/// What the CLI sees of one lock.
#[derive(Debug)]
struct LockInfo {
    name: String,
    key: String,
    /// Owner id -> hold count (0: released, kept taken by `hold_at_least`).
    owners: BTreeMap<String, i64>,
    /// Remaining lease in ms (`None`: the key has no expiry, which dlock never leaves).
    ttl_ms: Option<i64>,
    token: Option<u64>,
    /// Connections subscribed to the release channel: one per process with waiters.
    waiters: i64,
}

impl LockInfo {
    fn to_json(&self) -> serde_json::Value {
        json!({
            "name": self.name,
            "key": self.key,
            "owners": self.owners.iter().map(|(o, c)| json!({"owner": o, "holds": c})).collect::<Vec<_>>(),
            "holds": self.owners.values().sum::<i64>(),
            "remaining_ms": self.ttl_ms,
            "fencing_token": self.token,
            "waiting_processes": self.waiters,
        })
    }

    fn owner_text(&self) -> String {
        if self.owners.is_empty() {
            return "-".into();
        }
        self.owners
            .iter()
            .map(|(o, c)| {
                if *c == 0 {
                    format!("{o} (released, kept)")
                } else {
                    o.clone()
                }
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

fn fmt_ms(ms: Option<i64>) -> String {
    match ms {
        None => "no expiry".into(),
        Some(ms) if ms >= 10_000 => format!("{:.0}s", ms as f64 / 1000.0),
        Some(ms) => format!("{:.1}s", ms as f64 / 1000.0),
    }
}

/// HGETALL, PTTL, GET fence, PUBSUB NUMSUB.
type LockReply = (
    Vec<(String, String)>,
    i64,
    Option<String>,
    Vec<(String, i64)>,
);

/// Reads one lock; `Ok(None)` when it is not held. A key of another type is an error.
async fn read_lock(
    conn: &mut MultiplexedConnection,
    name: &str,
) -> Result<Option<LockInfo>, CliError> {
    let keys = dlock_runtime::redis_keys(name);
    let (fields, pttl, fence, numsub): LockReply = bounded(
        &format!("reading lock `{name}`"),
        redis::pipe()
            .hgetall(&keys.lock)
            .pttl(&keys.lock)
            .get(&keys.fence)
            .cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&keys.channel)
            .query_async(conn),
    )
    .await?;
    if fields.is_empty() || pttl == -2 {
        return Ok(None);
    }
    let mut owners = BTreeMap::new();
    let mut token = None;
    for (f, v) in fields {
        if f == ":fence" {
            token = v.parse().ok();
        } else {
            owners.insert(f, v.parse().unwrap_or(0));
        }
    }
    // The token lives in the hash's `:fence` field; the fence key holds the last one handed out.
    if token.is_none() {
        token = fence.and_then(|f| f.parse().ok());
    }
    Ok(Some(LockInfo {
        name: name.to_string(),
        key: keys.lock,
        owners,
        ttl_ms: (pttl >= 0).then_some(pttl),
        token,
        waiters: numsub.first().map_or(0, |(_, n)| *n),
    }))
}

fn pattern(p: Option<&str>) -> Result<glob::Pattern, CliError> {
    glob::Pattern::new(p.unwrap_or("*"))
        .map_err(|e| CliError::Refused(format!("invalid PATTERN: {e}")))
}

async fn list(
    conn: &mut MultiplexedConnection,
    pat: Option<&str>,
    as_json: bool,
) -> Result<(), CliError> {
    let pat = pattern(pat)?;
    let mut names = Vec::new();
    let mut cursor: u64 = 0;
    let mut skipped = 0usize;
    loop {
        let (next, keys): (u64, Vec<String>) = bounded(
            "scanning keys",
            redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg("dlock:{*}")
                .arg("COUNT")
                .arg(1000)
                .query_async(conn),
        )
        .await?;
        for k in keys {
            match name_of_key(&k) {
                Some(n) if pat.matches(&n) => names.push(n),
                Some(_) => {}
                None => skipped += 1,
            }
        }
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    names.sort();
    names.dedup();
    let mut infos = Vec::new();
    for n in &names {
        match read_lock(conn, n).await {
            Ok(Some(i)) => infos.push(i),
            Ok(None) => {} // released meanwhile
            Err(CliError::Server(m)) => {
                skipped += 1;
                eprintln!("dlock: skipped an unexpected key: {m}");
            }
            Err(e) => return Err(e),
        }
    }
    if skipped > 0 {
        eprintln!("dlock: {skipped} key(s) under `dlock:{{` are not dlock locks; not shown");
    }
    if as_json {
        let v: Vec<_> = infos.iter().map(LockInfo::to_json).collect();
        println!("{}", serde_json::Value::Array(v));
        return Ok(());
    }
    if infos.is_empty() {
        println!("no locks held");
        return Ok(());
    }
    let rows: Vec<[String; 6]> = infos
        .iter()
        .map(|i| {
            [
                i.name.clone(),
                i.owner_text(),
                i.owners.values().sum::<i64>().to_string(),
                fmt_ms(i.ttl_ms),
                i.token.map_or("-".into(), |t| t.to_string()),
                i.waiters.to_string(),
            ]
        })
        .collect();
    let head = ["NAME", "OWNER", "HOLDS", "REMAINING", "TOKEN", "WAITING"];
    let mut w = head.map(str::len);
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cols: [&str; 6]| {
        cols.iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<width$}", width = w[i]))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    println!("{}", line(head));
    for r in &rows {
        println!(
            "{}",
            line([&r[0], &r[1], &r[2], &r[3], &r[4], &r[5]].map(|s| s.as_str()))
        );
    }
    Ok(())
}

fn print_detail(i: &LockInfo) {
    let keys = dlock_runtime::redis_keys(&i.name);
    println!("lock           {}", i.name);
    for (o, c) in &i.owners {
        if *c == 0 {
            println!("owner          {o} (released; kept taken by hold_at_least)");
        } else {
            println!(
                "owner          {o} ({c} hold{})",
                if *c == 1 { "" } else { "s" }
            );
        }
    }
    println!("remaining      {}", fmt_ms(i.ttl_ms));
    println!(
        "fencing token  {}",
        i.token.map_or("-".into(), |t| t.to_string())
    );
    println!(
        "waiting        {} process(es) subscribed to the release channel",
        i.waiters
    );
    println!(
        "redis keys     {} (hash), {} (fence), {} (channel)",
        keys.lock, keys.fence, keys.channel
    );
}

async fn show(conn: &mut MultiplexedConnection, name: &str, as_json: bool) -> Result<(), CliError> {
    let i = read_lock(conn, name)
        .await?
        .ok_or_else(|| CliError::NotFound(format!("lock `{name}` is not held")))?;
    if as_json {
        println!("{}", i.to_json());
    } else {
        print_detail(&i);
    }
    Ok(())
}

/// Deletes the lock if its owners are still the ones shown, and publishes one wake-up.
/// Returns -1 when the lock is gone, -2 when the owner changed, else the number of subscribers
/// the wake-up reached.
const UNLOCK_LUA: &str = r#"
local fields = redis.call('HGETALL', KEYS[1])
if #fields == 0 then return -1 end
if ARGV[2] ~= '' and redis.call('HEXISTS', KEYS[1], ARGV[2]) == 0 then return -2 end
redis.call('DEL', KEYS[1])
local n = redis.pcall('PUBLISH', ARGV[1], '1')
if type(n) ~= 'number' then return 0 end
return n
"#;

async fn unlock(conn: &mut MultiplexedConnection, name: &str, yes: bool) -> Result<(), CliError> {
    let i = read_lock(conn, name)
        .await?
        .ok_or_else(|| CliError::NotFound(format!("lock `{name}` is not held; nothing to do")))?;
    print_detail(&i);
    if !yes {
        print!("force-release lock `{name}`? the holder loses it at its next renewal [y/N] ");
        let _ = std::io::stdout().flush();
        let mut answer = String::new();
        let stdin = std::io::stdin();
        let interactive = stdin.is_terminal();
        let read = stdin.lock().read_line(&mut answer).unwrap_or(0);
        if read == 0 {
            println!();
            return Err(CliError::Refused(if interactive {
                "not confirmed; nothing done".into()
            } else {
                "not confirmed (no answer on stdin; pass --yes in scripts); nothing done".into()
            }));
        }
        if !matches!(answer.trim(), "y" | "Y" | "yes" | "YES") {
            return Err(CliError::Refused("not confirmed; nothing done".into()));
        }
    }
    let keys = dlock_runtime::redis_keys(name);
    let owner = if i.owners.len() == 1 {
        i.owners.keys().next().cloned().unwrap_or_default()
    } else {
        String::new()
    };
    let r: i64 = bounded(
        &format!("unlocking `{name}`"),
        redis::Script::new(UNLOCK_LUA)
            .key(&keys.lock)
            .arg(&keys.channel)
            .arg(&owner)
            .invoke_async(conn),
    )
    .await?;
    match r {
        -1 => Err(CliError::NotFound(format!(
            "lock `{name}` was released before the unlock; nothing done"
        ))),
        -2 => Err(CliError::Refused(format!(
            "lock `{name}` changed hands since it was shown; nothing done (run again)"
        ))),
        n => {
            println!(
                "released lock `{name}` (was held by {}, fencing token {}); deleted {}",
                i.owner_text(),
                i.token.map_or("-".into(), |t| t.to_string()),
                keys.lock
            );
            println!(
                "published one wake-up on {} ({n} waiting process(es) reached; each wakes one waiter)",
                keys.channel
            );
            println!(
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

async fn watch(
    client: &redis::Client,
    conn: &mut MultiplexedConnection,
    db: i64,
    pat: Option<&str>,
) -> Result<(), CliError> {
    let pat = pattern(pat)?;
    // Keyspace notifications show acquisitions and expiries too; without them only releases
    // (the release channels) are visible. The CLI does not change the server's configuration.
    let notify: Option<(String, String)> = bounded(
        "CONFIG GET",
        redis::cmd("CONFIG")
            .arg("GET")
            .arg("notify-keyspace-events")
            .query_async::<Vec<String>>(conn),
    )
    .await
    .ok()
    .and_then(|v| v.get(1).cloned().map(|f| ("notify".into(), f)));
    let flags = notify.map(|(_, f)| f).unwrap_or_default();
    let keyspace = flags.contains('K')
        && (flags.contains('A')
            || (flags.contains('h') && flags.contains('g') && flags.contains('x')));
    let mut pubsub = bounded("subscribing", client.get_async_pubsub()).await?;
    bounded("subscribing", pubsub.psubscribe("dlock:{*}:rel")).await?;
    let ks_prefix = format!("__keyspace@{db}__:");
    if keyspace {
        bounded(
            "subscribing",
            pubsub.psubscribe(format!("{ks_prefix}dlock:{{*}}")),
        )
        .await?;
        println!(
            "watching acquisitions, releases and expiries (keyspace notifications); Ctrl-C to stop"
        );
    } else {
        println!(
            "watching releases (release channels); enable keyspace notifications \
             (notify-keyspace-events Kghx) to see acquisitions and expiries too; Ctrl-C to stop"
        );
    }
    let _ = std::io::stdout().flush();
    let mut stream = pubsub.into_on_message();
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        let msg = tokio::select! {
            _ = &mut ctrl_c => return Ok(()),
            m = stream.next() => m,
        };
        let Some(msg) = msg else {
            return Err(CliError::Connect(
                "the server closed the subscription".into(),
            ));
        };
        let channel = msg.get_channel_name().to_string();
        let (key, event) = if let Some(k) = channel.strip_prefix(&ks_prefix) {
            let ev: String = msg.get_payload().unwrap_or_default();
            (k.to_string(), ev)
        } else if let Some(k) = channel.strip_suffix(":rel") {
            (k.to_string(), "release".to_string())
        } else {
            continue;
        };
        let Some(name) = name_of_key(&key) else {
            continue;
        };
        if !pat.matches(&name) {
            continue;
        }
        let what = match event.as_str() {
            "hset" => {
                let detail = match read_lock(conn, &name).await {
                    Ok(Some(i)) => format!(
                        " by {} token {} lease {}",
                        i.owner_text(),
                        i.token.map_or("-".into(), |t| t.to_string()),
                        fmt_ms(i.ttl_ms)
                    ),
                    _ => String::new(),
                };
                format!("acquired{detail}")
            }
            "hincrby" => "hold count changed (re-entry or inner release)".into(),
            "release" => "released (one waiter woken)".into(),
            "del" => continue, // the release message follows
            "expired" => "expired (lease ran out without release)".into(),
            "pexpire" | "expire" => continue, // renewals
            other => other.to_string(),
        };
        println!("{}  {name}  {what}", now_text());
        let _ = std::io::stdout().flush();
    }
}

async fn run(cli: Cli) -> Result<(), CliError> {
    let t = parse_target(&cli.url)?;
    let (client, mut conn) = connect(&t).await?;
    match &cli.cmd {
        Cmd::List { pattern, json } => list(&mut conn, pattern.as_deref(), *json).await,
        Cmd::Show { name, json } => show(&mut conn, name, *json).await,
        Cmd::Unlock { name, yes } => unlock(&mut conn, name, *yes).await,
        Cmd::Watch { pattern } => watch(&client, &mut conn, t.db, pattern.as_deref()).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_names_round_trip_and_foreign_keys_are_rejected() {
        for n in ["order:42", "a}b", "{x}", "back\\slash", "a:fence", "é"] {
            assert_eq!(
                name_of_key(&dlock_runtime::redis_keys(n).lock).as_deref(),
                Some(n)
            );
        }
        for k in [
            "dlock:{order:42}:fence",
            "dlock:{a}b}",
            "dlock:{}",
            "other",
            "dlock:{a\\x}",
            "dlock:{a{b}",
        ] {
            assert_eq!(name_of_key(k), None, "{k}");
        }
    }

    #[test]
    fn urls_are_redacted_and_other_engines_refused() {
        let t = parse_target("redis://user:secret@127.0.0.1:6390/3")
            .ok()
            .unwrap();
        assert!(!t.shown.contains("secret"));
        assert_eq!(t.db, 3);
        let e = parse_target("postgres://u:secret@localhost/db")
            .err()
            .unwrap();
        assert_eq!(e.code(), 6);
        assert!(e.message().contains("not supported for this backend yet"));
        assert!(!e.message().contains("secret"));
        let e = parse_target("::nonsense::").err().unwrap();
        assert_eq!(e.code(), 6);
    }
}
