//! [`Admin`] for one Redis server (also the building block of the Redlock, Sentinel and Cluster
//! admins): reads the lock hashes `dlock:{E}` through [`redis_keys`], force-releases with an
//! owner-checked script that publishes one wake-up, and watches the release channels plus, when
//! the server has them on, keyspace notifications.
//!
//! Semaphores (`dlock:sem:{E}` hash + `dlock:sem:{E}:z` leases, see `semaphore.rs`) and
//! read-write locks (`dlock:{E}:rw` state + `dlock:{E}:rw:r` readers, see `scripts/rw.lua`) are
//! listed and shown too, every lease judged by the server's `TIME` read in the same pipeline
//! (entries whose lease ended but that no script has purged yet are not shown). One holder of
//! either is evicted by the very script its owner's full release runs, with its owner id, so
//! permits come back and waiters are woken exactly as on a release. `watch` does not report
//! them.

use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;

use super::redact_url;
use std::sync::LazyLock;

use crate::admin::{
    Admin, AdminError, ForceReleased, Holder, HolderRole, Listing, LockEvent, LockInfo, LockKind,
    RwMode, RwState, SemaphoreState, Watching, bounded, same_holder, still_held,
};
use crate::backend::BoxFuture;
use crate::backend::redis::semaphore::sem_keys;
use crate::key::{self, redis_keys};

/// The semaphore release script, as the owner's release runs it.
static SEM_RELEASE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("semaphore_release.lua")));
/// The same on a Redis Cluster master (sharded wake-ups, as the cluster backend sends it).
static SEM_RELEASE_SHARDED: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(&sharded(include_str!("semaphore_release.lua"))));
/// The read-write script, as the owner's release runs it.
static RW: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../../scripts/rw.lua")));
static RW_SHARDED: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(&sharded(include_str!("../../scripts/rw.lua"))));

/// `src` with its wake-ups sent by `SPUBLISH` (the cluster backend's substitution).
fn sharded(src: &str) -> String {
    src.replace("redis.pcall('PUBLISH', ", "redis.pcall('SPUBLISH', ")
}

/// The server's clock in ms from a `TIME` reply.
fn time_ms(t: &[String]) -> Option<i64> {
    let s: i64 = t.first()?.parse().ok()?;
    let us: i64 = t.get(1)?.parse().ok()?;
    Some(s * 1000 + us / 1000)
}

/// The time left from `now` to `end` (server ms).
fn left(end: f64, now: i64) -> Duration {
    Duration::from_millis((end - now as f64).max(0.0) as u64)
}

/// The keys of the read-write lock `name`: state hash, readers zset, fence, readers' and
/// writers' channels (as `backend/redis/rw.rs` builds them).
fn rw_keys(name: &str) -> [String; 5] {
    let lock = key::lock_key(name);
    [
        key::suffixed(&lock, key::RW_SUFFIX),
        key::suffixed(&lock, key::RW_READERS_SUFFIX),
        key::suffixed(&lock, key::RW_FENCE_SUFFIX),
        key::suffixed(&lock, key::RW_READERS_CHANNEL_SUFFIX),
        key::suffixed(&lock, key::RW_WRITERS_SUFFIX),
    ]
}

/// The operator's view of one Redis server (or one node of a Redlock set, or the master of a
/// Sentinel group).
#[derive(Debug, Clone)]
pub struct RedisAdmin {
    client: redis::Client,
    conn: MultiplexedConnection,
    shown: String,
    db: i64,
    /// A Redis Cluster master: release channels are sharded (`SPUBLISH`, `PUBSUB SHARDNUMSUB`).
    sharded: bool,
}

/// Maps a redis-rs error: connection-level ones are [`AdminError::connect`]. redis-rs's messages
/// do not contain the password.
fn map(what: &str, e: redis::RedisError) -> AdminError {
    if e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(
            e.kind(),
            redis::ErrorKind::AuthenticationFailed | redis::ErrorKind::InvalidClientConfig
        )
    {
        AdminError::connect(format!("{what}: {e}"))
    } else {
        AdminError::server(format!("{what}: {e}"))
    }
}

async fn call<T>(
    what: &str,
    fut: impl Future<Output = redis::RedisResult<T>>,
) -> Result<T, AdminError> {
    bounded(what, async { fut.await.map_err(|e| map(what, e)) }).await
}

/// The lock name of a lock key `dlock:{E}`, or `None` for any other key (the fence key, a
/// foreign key under `dlock:`, an escape the library never writes).
pub(crate) fn name_of_key(key: &str) -> Option<String> {
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
    (!out.is_empty() && redis_keys(&out).lock == key).then_some(out)
}

/// The name of the key `key` of a `kind`: a lock's `dlock:{E}`, a semaphore's hash
/// `dlock:sem:{E}`, a read-write lock's state `dlock:{E}:rw`; `None` for any other key.
pub(crate) fn name_of_kind_key(k: &str, kind: LockKind) -> Option<String> {
    match kind {
        LockKind::Semaphore => {
            let rest = k.strip_prefix("dlock:sem:")?;
            let n = name_of_key(&format!("dlock:{rest}"))?;
            (sem_keys(&n).hash == k).then_some(n)
        }
        LockKind::RwLock => name_of_key(k.strip_suffix(key::RW_SUFFIX)?),
        _ => name_of_key(k),
    }
}

/// A SCAN `MATCH` pattern for the main keys of `kind` (see [`name_of_kind_key`]) of names
/// starting with `prefix`: the prefix escaped as the key rule escapes it, with glob characters
/// quoted.
fn scan_pattern_of(prefix: &str, kind: LockKind) -> String {
    let key = redis_keys(prefix).lock; // dlock:{<escaped prefix>}
    let inner = &key["dlock:{".len()..key.len() - 1];
    let mut p = String::from(match kind {
        LockKind::Semaphore => "dlock:sem:{",
        _ => "dlock:{",
    });
    for c in inner.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            p.push('\\');
        }
        p.push(c);
    }
    p.push_str("*}");
    if kind == LockKind::RwLock {
        p.push_str(key::RW_SUFFIX);
    }
    p
}

/// Deletes the lock if its current token (or, without one, owner) is the expected one, and
/// publishes one wake-up. Returns -1 when the lock is gone, -2 when the hold changed, else the
/// number of subscribers the wake-up reached.
const UNLOCK_LUA: &str = r#"
local fields = redis.call('HGETALL', KEYS[1])
if #fields == 0 then return -1 end
if ARGV[2] ~= '' and redis.call('HGET', KEYS[1], ':fence') ~= ARGV[2] then return -2 end
if ARGV[3] ~= '' and redis.call('HEXISTS', KEYS[1], ARGV[3]) == 0 then return -2 end
redis.call('DEL', KEYS[1])
local n = redis.pcall(ARGV[4], ARGV[1], '1')
if type(n) ~= 'number' then return 0 end
return n
"#;

/// See [`RedisAdmin::fill_identities`]; `con` routes every key (a server, or a cluster
/// connection).
pub(crate) async fn fill_identities(
    con: &mut impl redis::aio::ConnectionLike,
    holders: &mut [Holder],
) {
    let mut processes: Vec<&str> = holders
        .iter()
        .map(|h| crate::holder::process_of(&h.owner))
        .collect();
    processes.sort_unstable();
    processes.dedup();
    if processes.is_empty() {
        return;
    }
    let mut pipe = redis::pipe();
    for p in &processes {
        pipe.get(crate::key::holder_key(p));
    }
    let Ok(Ok(values)) = tokio::time::timeout(
        crate::admin::CALL_TIMEOUT,
        pipe.query_async::<Vec<Option<String>>>(con),
    )
    .await
    else {
        return;
    };
    let found: Vec<(String, Option<String>)> = processes
        .iter()
        .map(|p| p.to_string())
        .zip(values)
        .collect();
    for h in holders.iter_mut() {
        let p = crate::holder::process_of(&h.owner);
        let stored = found
            .iter()
            .find(|(q, _)| q == p)
            .and_then(|(_, v)| v.as_deref());
        h.identity = stored.and_then(crate::holder::HolderId::parse);
    }
}

/// HGETALL, PTTL, PUBSUB NUMSUB.
type LockReply = (Vec<(String, String)>, i64, Vec<(String, i64)>);

impl RedisAdmin {
    /// Connects to the server at `url` (`redis://[user[:password]@]host[:port][/db]`,
    /// `rediss://` with the `tls` feature, `unix://`). The connection is checked here.
    pub async fn connect(url: &str) -> Result<RedisAdmin, AdminError> {
        let shown = redact_url(url);
        let client = redis::Client::open(url).map_err(|e| {
            AdminError::unsupported(format!(
                "cannot use {shown}: {}",
                e.detail().unwrap_or("invalid Redis URL")
            ))
        })?;
        let db = client.get_connection_info().redis_settings().db();
        let conn = call(
            &format!("connecting to {shown}"),
            client.get_multiplexed_async_connection(),
        )
        .await
        // Every failure to connect (refused, DNS, TLS, AUTH) is a connection failure.
        .map_err(|e| AdminError::connect(e.message))?;
        Ok(RedisAdmin {
            client,
            conn,
            shown,
            db,
            sharded: false,
        })
    }

    /// This server as a Redis Cluster master (sharded release channels).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn sharded(mut self) -> RedisAdmin {
        self.sharded = true;
        self
    }

    /// A connection to this server, for engine-specific commands.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn conn(&self) -> MultiplexedConnection {
        self.conn.clone()
    }

    /// Reads one lock; `Ok(None)` when it is not held. A key of another type is an error.
    pub(crate) async fn read(&self, name: &str) -> Result<Option<LockInfo>, AdminError> {
        let keys = redis_keys(name);
        let mut conn = self.conn.clone();
        let (fields, pttl, numsub): LockReply = call(
            &format!("reading lock `{name}` on {}", self.shown),
            redis::pipe()
                .hgetall(&keys.lock)
                .pttl(&keys.lock)
                .cmd("PUBSUB")
                .arg(if self.sharded {
                    "SHARDNUMSUB"
                } else {
                    "NUMSUB"
                })
                .arg(&keys.channel)
                .query_async(&mut conn),
        )
        .await?;
        if fields.is_empty() || pttl == -2 {
            return Ok(None);
        }
        let mut info = LockInfo::new(name);
        for (f, v) in fields {
            if f == ":fence" {
                info.token = v.parse().ok();
            } else {
                info.holders.push(Holder::new(f, v.parse().unwrap_or(0)));
            }
        }
        info.holders.sort_by(|a, b| a.owner.cmp(&b.owner));
        if !self.sharded {
            // A cluster master may not serve the identity keys' slots: the cluster admin reads
            // them through its cluster connection.
            self.fill_identities(&mut info.holders).await;
        }
        info.remaining = (pttl >= 0).then(|| Duration::from_millis(pttl as u64));
        info.waiters = numsub.first().map(|(_, n)| (*n).max(0) as u64);
        info.waiters_are = "processes subscribed to the release channel";
        info.details = vec![
            ("server".into(), self.shown.clone()),
            ("lock key".into(), keys.lock),
            ("fence key".into(), keys.fence),
            (
                if self.sharded {
                    "release channel (sharded)"
                } else {
                    "release channel"
                }
                .into(),
                keys.channel,
            ),
        ];
        Ok(Some(info))
    }

    /// Reads the name `name` held as `kind`; `Ok(None)` when it is not held as that.
    pub(crate) async fn read_kind(
        &self,
        name: &str,
        kind: LockKind,
    ) -> Result<Option<LockInfo>, AdminError> {
        let mut info = match kind {
            LockKind::Semaphore => self.read_sem(name).await?,
            LockKind::RwLock => self.read_rw(name).await?,
            _ => return self.read(name).await,
        };
        // A cluster master may not serve the identity keys' slots: the cluster admin reads
        // them through its own routing.
        if let Some(i) = info.as_mut()
            && !self.sharded
        {
            self.fill_identities(&mut i.holders).await;
            if let Some(w) = i.rw.as_mut().and_then(|rw| rw.waiting_writer.as_mut()) {
                self.fill_identities(std::slice::from_mut(w)).await;
            }
        }
        Ok(info)
    }

    /// The PUBSUB command counting a channel's subscribers on this server.
    fn numsub(&self) -> &'static str {
        if self.sharded {
            "SHARDNUMSUB"
        } else {
            "NUMSUB"
        }
    }

    /// Reads one semaphore: its live holders (lease not ended by the server's `TIME`), each with
    /// its permits, token and lease left, the max, and the processes waiting on its channel.
    async fn read_sem(&self, name: &str) -> Result<Option<LockInfo>, AdminError> {
        let k = sem_keys(name);
        let mut conn = self.conn.clone();
        type SemReply = (
            Vec<String>,
            Vec<(String, String)>,
            Vec<(String, f64)>,
            Vec<(String, i64)>,
        );
        let (time, fields, leases, numsub): SemReply = call(
            &format!("reading semaphore `{name}` on {}", self.shown),
            redis::pipe()
                .cmd("TIME")
                .hgetall(&k.hash)
                .zrange_withscores(&k.leases, 0, -1)
                .cmd("PUBSUB")
                .arg(self.numsub())
                .arg(&k.channel)
                .query_async(&mut conn),
        )
        .await?;
        let now = time_ms(&time)
            .ok_or_else(|| AdminError::server(format!("unreadable TIME reply {time:?}")))?;
        let field = |f: &str| fields.iter().find(|(n, _)| n == f).map(|(_, v)| v.as_str());
        let mut info = LockInfo::new(name);
        info.kind = LockKind::Semaphore;
        let mut used = 0u32;
        let mut longest: Option<Duration> = None;
        for (owner, end) in &leases {
            if *end <= now as f64 {
                continue; // ended; purged by the next script call
            }
            let Some(permits) = field(owner).and_then(|v| v.parse::<u32>().ok()) else {
                continue;
            };
            used = used.saturating_add(permits);
            let mut h = Holder::new(owner.clone(), 1);
            h.role = HolderRole::Permits(permits);
            h.token = field(&format!(":t:{owner}")).and_then(|v| v.parse().ok());
            h.remaining = Some(left(*end, now));
            longest = longest.max(h.remaining);
            info.holders.push(h);
        }
        if info.holders.is_empty() {
            return Ok(None);
        }
        let max = field(":max")
            .and_then(|v| v.parse::<u32>().ok())
            .ok_or_else(|| AdminError::server(format!("semaphore `{name}` has no readable max")))?;
        info.holders.sort_by(|a, b| a.owner.cmp(&b.owner));
        info.semaphore = Some(SemaphoreState { max, used });
        info.remaining = longest;
        info.waiters = numsub.first().map(|(_, n)| (*n).max(0) as u64);
        info.waiters_are = "processes subscribed to the semaphore's channel";
        info.details = vec![
            ("server".into(), self.shown.clone()),
            ("holders key".into(), k.hash),
            ("leases key".into(), k.leases),
            ("fence key".into(), k.fence),
            (
                if self.sharded {
                    "release channel (sharded)"
                } else {
                    "release channel"
                }
                .into(),
                k.channel,
            ),
        ];
        Ok(Some(info))
    }

    /// Reads one read-write lock: its live writer or readers (leases by the server's `TIME`),
    /// each with its hold count, token and lease left, and the waiting writer's marker.
    async fn read_rw(&self, name: &str) -> Result<Option<LockInfo>, AdminError> {
        let [state, readers, fence, rd, wr] = rw_keys(name);
        let mut conn = self.conn.clone();
        type RwReply = (
            Vec<String>,
            Vec<(String, String)>,
            Vec<(String, f64)>,
            Vec<(String, i64)>,
        );
        let (time, fields, leases, numsub): RwReply = call(
            &format!("reading read-write lock `{name}` on {}", self.shown),
            redis::pipe()
                .cmd("TIME")
                .hgetall(&state)
                .zrange_withscores(&readers, 0, -1)
                .cmd("PUBSUB")
                .arg(self.numsub())
                .arg(&rd)
                .arg(&wr)
                .query_async(&mut conn),
        )
        .await?;
        let now = time_ms(&time)
            .ok_or_else(|| AdminError::server(format!("unreadable TIME reply {time:?}")))?;
        let field = |f: &str| fields.iter().find(|(n, _)| n == f).map(|(_, v)| v.as_str());
        let num = |f: &str| field(f).and_then(|v| v.parse::<f64>().ok());
        let mut info = LockInfo::new(name);
        info.kind = LockKind::RwLock;
        let mut longest: Option<Duration> = None;
        let mut mode = RwMode::Free;
        if let (Some(w), Some(wx)) = (field("w"), num("wx"))
            && wx > now as f64
        {
            let mut h = Holder::new(w, field("wn").and_then(|v| v.parse().ok()).unwrap_or(1));
            h.role = HolderRole::Writer;
            h.token = field("wt").and_then(|v| v.parse().ok());
            h.remaining = Some(left(wx, now));
            longest = longest.max(h.remaining);
            info.token = h.token;
            info.holders.push(h);
            mode = RwMode::Write;
        }
        let mut rs = Vec::new();
        for (owner, end) in &leases {
            if *end <= now as f64 {
                continue;
            }
            let Some(c) = field(&format!("c:{owner}")).and_then(|v| v.parse::<u32>().ok()) else {
                continue;
            };
            let mut h = Holder::new(owner.clone(), c);
            h.role = HolderRole::Reader;
            h.token = field(&format!("t:{owner}")).and_then(|v| v.parse().ok());
            h.remaining = Some(left(*end, now));
            longest = longest.max(h.remaining);
            rs.push(h);
        }
        rs.sort_by(|a, b| a.owner.cmp(&b.owner));
        if !rs.is_empty() && mode == RwMode::Free {
            mode = RwMode::Read;
        }
        info.holders.extend(rs);
        let waiting_writer = match (field("q"), num("qx")) {
            (Some(q), Some(qx)) if qx > now as f64 => {
                let mut h = Holder::new(q, 0);
                h.role = HolderRole::Writer;
                h.remaining = Some(left(qx, now));
                longest = longest.max(h.remaining);
                Some(h)
            }
            _ => None,
        };
        if info.holders.is_empty() && waiting_writer.is_none() {
            return Ok(None);
        }
        info.rw = Some(RwState {
            mode,
            waiting_writer,
        });
        info.remaining = longest;
        info.waiters = Some(numsub.iter().map(|(_, n)| (*n).max(0) as u64).sum());
        info.waiters_are = "subscriptions to the readers' and writers' channels";
        let (rd_label, wr_label) = if self.sharded {
            ("readers' channel (sharded)", "writers' channel (sharded)")
        } else {
            ("readers' channel", "writers' channel")
        };
        info.details = vec![
            ("server".into(), self.shown.clone()),
            ("state key".into(), state),
            ("readers key".into(), readers),
            ("fence key".into(), fence),
            (rd_label.into(), rd),
            (wr_label.into(), wr),
        ];
        Ok(Some(info))
    }

    /// [`Admin::evict`]: the owner's own full release (the semaphore release script, or the
    /// read-write script's `rr`/`rw` with every hold), after checking that the owner's hold is
    /// still the one `expected` shows. An owner id is one acquisition's (a semaphore grant, a
    /// read or write guard; a downgrade keeps it but moves it to the read side, which the
    /// script's side check refuses), so the script's owner check is the hold check.
    pub(crate) async fn evict_holder(
        &self,
        name: &str,
        kind: LockKind,
        owner: &str,
        expected: Option<&LockInfo>,
    ) -> Result<ForceReleased, AdminError> {
        if !matches!(kind, LockKind::Semaphore | LockKind::RwLock) {
            return Err(AdminError::unsupported(
                "a plain lock has one owner: force-release the lock (no --owner)",
            ));
        }
        let Some(now) = self.read_kind(name, kind).await? else {
            return Ok(ForceReleased::NotHeld);
        };
        let Some(cur) = now.holder(owner).cloned() else {
            return Ok(ForceReleased::NotHeld);
        };
        if let Some(exp) = expected {
            match exp.holder(owner) {
                Some(e) if same_holder(e, &cur) => {}
                _ => return Ok(ForceReleased::Changed),
            }
        }
        let mut conn = self.conn.clone();
        let what = format!("evicting {owner} from {kind} `{name}` on {}", self.shown);
        let r: i64 = if kind == LockKind::Semaphore {
            let k = sem_keys(name);
            let script = if self.sharded {
                &*SEM_RELEASE_SHARDED
            } else {
                &*SEM_RELEASE
            };
            call(
                &what,
                script
                    .key(&k.hash)
                    .key(&k.leases)
                    .arg(owner)
                    .arg(&k.channel)
                    .invoke_async(&mut conn),
            )
            .await?
        } else {
            let [state, readers, fence, rd, wr] = rw_keys(name);
            let op = if cur.role == HolderRole::Writer {
                "rw"
            } else {
                "rr"
            };
            let script = if self.sharded { &*RW_SHARDED } else { &*RW };
            call(
                &what,
                script
                    .key(&state)
                    .key(&readers)
                    .key(&fence)
                    .arg(op)
                    .arg(owner)
                    .arg("1")
                    .arg("1")
                    .arg(&rd)
                    .arg(&wr)
                    .invoke_async(&mut conn),
            )
            .await?
        };
        Ok(if r < 0 {
            // Released (or its lease ended) between the read and the script.
            ForceReleased::NotHeld
        } else {
            ForceReleased::Released {
                was: Box::new(now),
                woke: None,
            }
        })
    }

    /// Fills each holder's identity from its process's identity key `dlock:holder:<process>`
    /// (one pipelined `GET` per distinct process). Best effort: a holder whose key is missing
    /// (an older version, expired) or unreadable (an ACL without `GET`) keeps `None`.
    pub(crate) async fn fill_identities(&self, holders: &mut [Holder]) {
        fill_identities(&mut self.conn.clone(), holders).await;
    }

    /// The names of the lock keys for names starting with `prefix`, and the number of keys in
    /// the lock namespace that are not dlock locks.
    pub(crate) async fn scan(&self, prefix: &str) -> Result<(Vec<String>, usize), AdminError> {
        self.scan_kind(prefix, LockKind::Lock).await
    }

    /// [`RedisAdmin::scan`] for the main keys of `kind`.
    pub(crate) async fn scan_kind(
        &self,
        prefix: &str,
        kind: LockKind,
    ) -> Result<(Vec<String>, usize), AdminError> {
        let mut conn = self.conn.clone();
        let pattern = scan_pattern_of(prefix, kind);
        let mut names = Vec::new();
        let mut skipped = 0usize;
        let mut cursor: u64 = 0;
        // Bounded: SCAN visits every key once per full pass; stop after a generous number of
        // rounds even if a server kept returning cursors (it never should).
        for _ in 0..1_000_000 {
            let (next, keys): (u64, Vec<String>) = call(
                &format!("scanning keys on {}", self.shown),
                redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(1000)
                    .query_async(&mut conn),
            )
            .await?;
            for k in keys {
                match name_of_kind_key(&k, kind) {
                    Some(n) if n.starts_with(prefix) => names.push(n),
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
        Ok((names, skipped))
    }

    pub(crate) async fn force(
        &self,
        name: &str,
        expected: Option<&LockInfo>,
    ) -> Result<ForceReleased, AdminError> {
        let now = match still_held(self.read(name).await?, expected) {
            Ok(now) => now,
            Err(done) => return Ok(done),
        };
        let keys = redis_keys(name);
        // The script re-checks what was read, so a hand-over in between is not deleted.
        let token = now.token.map(|t| t.to_string()).unwrap_or_default();
        let owner = match (now.token, now.holders.as_slice()) {
            (None, [one]) => one.owner.clone(),
            _ => String::new(),
        };
        let mut conn = self.conn.clone();
        let r: i64 = call(
            &format!("unlocking `{name}` on {}", self.shown),
            redis::Script::new(UNLOCK_LUA)
                .key(&keys.lock)
                .arg(&keys.channel)
                .arg(&token)
                .arg(&owner)
                .arg(if self.sharded { "SPUBLISH" } else { "PUBLISH" })
                .invoke_async(&mut conn),
        )
        .await?;
        Ok(match r {
            -1 => ForceReleased::NotHeld,
            -2 => ForceReleased::Changed,
            n => ForceReleased::Released {
                was: Box::new(now),
                woke: Some(n.max(0) as u64),
            },
        })
    }

    /// Whether the server sends keyspace notifications for hash writes and expiries.
    async fn keyspace_on(&self) -> bool {
        let mut conn = self.conn.clone();
        let flags: Vec<String> = call(
            "CONFIG GET notify-keyspace-events",
            redis::cmd("CONFIG")
                .arg("GET")
                .arg("notify-keyspace-events")
                .query_async(&mut conn),
        )
        .await
        .unwrap_or_default();
        let f = flags.get(1).cloned().unwrap_or_default();
        f.contains('K') && (f.contains('A') || (f.contains('h') && f.contains('x')))
    }

    pub(crate) async fn start_watch(&self, prefix: &str) -> Result<Watching, AdminError> {
        let keyspace = self.keyspace_on().await;
        let mut pubsub = call(
            &format!("subscribing on {}", self.shown),
            self.client.get_async_pubsub(),
        )
        .await?;
        call("PSUBSCRIBE", pubsub.psubscribe("dlock:{*}:rel")).await?;
        let ks_prefix = format!("__keyspace@{}__:", self.db);
        if keyspace {
            call(
                "PSUBSCRIBE",
                pubsub.psubscribe(format!("{ks_prefix}dlock:{{*}}")),
            )
            .await?;
        }
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        let prefix = prefix.to_string();
        let reader = self.clone();
        tokio::spawn(async move {
            let mut stream = pubsub.into_on_message();
            // Names released with `hold_at_least` whose kept key has not expired yet.
            let mut kept = std::collections::HashSet::<String>::new();
            loop {
                let msg = tokio::select! {
                    m = stream.next() => m,
                    _ = tx.closed() => return,
                };
                let Some(msg) = msg else {
                    let _ = tx
                        .send(Err(AdminError::connect(format!(
                            "{}: the server closed the subscription",
                            reader.shown
                        ))))
                        .await;
                    return;
                };
                let channel = msg.get_channel_name().to_string();
                let (key, event) = if let Some(k) = channel.strip_prefix(&ks_prefix) {
                    let ev: String = msg.get_payload().unwrap_or_default();
                    (k.to_string(), ev)
                } else if let Some(k) = channel.strip_suffix(":rel") {
                    // `t` is a queued waiter's try (the waiters' queue's stall-timer stop), not
                    // a release; a release publishes `1` or `w<process id>`.
                    let payload: String = msg.get_payload().unwrap_or_default();
                    if payload == "t" {
                        continue;
                    }
                    (k.to_string(), "release".to_string())
                } else {
                    continue;
                };
                let Some(name) = name_of_key(&key) else {
                    continue;
                };
                if !name.starts_with(&prefix) {
                    continue;
                }
                let ev = match event.as_str() {
                    // The acquire script's HSET of a new hash; re-entries are HINCRBY.
                    "hset" => {
                        let now = reader.read(&name).await.ok().flatten();
                        let owner = now.as_ref().and_then(|i| {
                            i.holders
                                .iter()
                                .find(|h| h.holds > 0)
                                .map(|h| h.owner.clone())
                        });
                        if owner.is_none() && now.as_ref().is_some_and(|i| !i.holders.is_empty()) {
                            // A release with `hold_at_least`: the script set the holder's count
                            // to 0 and keeps the key until the minimum; its expiry is not a
                            // crashed holder's.
                            kept.insert(name.clone());
                            LockEvent::Released { name }
                        } else {
                            kept.remove(&name);
                            LockEvent::Acquired {
                                owner,
                                token: now.and_then(|i| i.token),
                                name,
                            }
                        }
                    }
                    "hincrby" => LockEvent::Other {
                        name,
                        what: "hold count changed (re-entry or inner release)".into(),
                    },
                    "release" => LockEvent::Released { name },
                    // A cluster's release channels are sharded and cannot be subscribed by
                    // pattern: the release script's DEL stands for the release.
                    "del" if reader.sharded => LockEvent::Released { name },
                    "expired" if kept.remove(&name) => LockEvent::Other {
                        name,
                        what: "kept lease ended (hold_at_least after a release)".into(),
                    },
                    "expired" => LockEvent::Expired { name },
                    // DEL: the release message follows; PEXPIRE: renewals.
                    _ => continue,
                };
                if tx.send(Ok(ev)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Watching {
            events: rx,
            sees: if keyspace {
                "acquisitions, releases and expiries (keyspace notifications)".into()
            } else {
                "releases only (release channels); enable keyspace notifications \
                 (notify-keyspace-events Khx) to see acquisitions and expiries too"
                    .into()
            },
            sees_acquisitions: keyspace,
        })
    }
}

impl Admin for RedisAdmin {
    fn engine(&self) -> &'static str {
        "redis"
    }

    fn target(&self) -> String {
        self.shown.clone()
    }

    fn list<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Listing, AdminError>> {
        Box::pin(async move {
            let mut locks = Vec::new();
            let mut skipped = 0;
            for kind in LockKind::ALL {
                let (names, k) = self.scan_kind(prefix, kind).await?;
                skipped += k;
                for n in &names {
                    match self.read_kind(n, kind).await {
                        Ok(Some(i)) => locks.push(i),
                        Ok(None) => {} // released meanwhile
                        // A key of another type under a lock's name: not a dlock lock.
                        Err(e) if e.kind == crate::admin::AdminErrorKind::Server => skipped += 1,
                        Err(e) => return Err(e),
                    }
                }
            }
            Ok(Listing::new(locks, skipped))
        })
    }

    fn kinds(&self) -> &'static [LockKind] {
        &LockKind::ALL
    }

    fn show_kind<'a>(
        &'a self,
        name: &'a str,
        kind: LockKind,
    ) -> BoxFuture<'a, Result<Option<LockInfo>, AdminError>> {
        Box::pin(self.read_kind(name, kind))
    }

    fn evict<'a>(
        &'a self,
        name: &'a str,
        kind: LockKind,
        owner: &'a str,
        expected: Option<&'a LockInfo>,
    ) -> BoxFuture<'a, Result<ForceReleased, AdminError>> {
        Box::pin(self.evict_holder(name, kind, owner, expected))
    }

    fn show<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<LockInfo>, AdminError>> {
        Box::pin(self.read(name))
    }

    fn force_release<'a>(
        &'a self,
        name: &'a str,
        expected: Option<&'a LockInfo>,
    ) -> BoxFuture<'a, Result<ForceReleased, AdminError>> {
        Box::pin(self.force(name, expected))
    }

    fn watch<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Watching, AdminError>> {
        Box::pin(self.start_watch(prefix))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_names_round_trip_and_foreign_keys_are_rejected() {
        for n in [
            "order:42",
            "a}b",
            "{x}",
            "back\\slash",
            "a:fence",
            "é",
            "a*b?",
        ] {
            assert_eq!(name_of_key(&redis_keys(n).lock).as_deref(), Some(n));
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
    fn scan_patterns_quote_glob_characters() {
        let scan_pattern = |p| scan_pattern_of(p, LockKind::Lock);
        assert_eq!(scan_pattern(""), "dlock:{*}");
        assert_eq!(scan_pattern("order:"), "dlock:{order:*}");
        assert_eq!(scan_pattern("a*b"), "dlock:{a\\*b*}");
        assert_eq!(scan_pattern("x{y"), "dlock:{x\\\\(y*}");
        assert_eq!(
            scan_pattern_of("a*", LockKind::Semaphore),
            "dlock:sem:{a\\**}"
        );
        assert_eq!(scan_pattern_of("a", LockKind::RwLock), "dlock:{a*}:rw");
    }

    #[test]
    fn semaphore_and_rw_key_names_round_trip() {
        for n in ["exports", "a}b", "x:rw", "sem:{y}"] {
            let sem = crate::backend::redis::semaphore::sem_keys(n).hash;
            assert_eq!(
                name_of_kind_key(&sem, LockKind::Semaphore).as_deref(),
                Some(n)
            );
            let rw = rw_keys(n)[0].clone();
            assert_eq!(name_of_kind_key(&rw, LockKind::RwLock).as_deref(), Some(n));
            // Never taken for one another, or for a lock.
            assert_eq!(name_of_kind_key(&sem, LockKind::Lock), None);
            assert_eq!(name_of_kind_key(&rw, LockKind::Lock), None);
            assert_eq!(name_of_kind_key(&rw, LockKind::Semaphore), None);
            assert_eq!(
                name_of_kind_key(&redis_keys(n).lock, LockKind::RwLock),
                None
            );
        }
        for k in [
            "dlock:sem:{a}:z",
            "dlock:sem:{a}:fence",
            "dlock:{a}:rw:r",
            "dlock:sem:x",
        ] {
            assert_eq!(name_of_kind_key(k, LockKind::Semaphore), None, "{k}");
            assert_eq!(name_of_kind_key(k, LockKind::RwLock), None, "{k}");
        }
    }
}
