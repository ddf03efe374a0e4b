//! PostgreSQL advisory-lock mode: `pg_try_advisory_lock` on one dedicated session per backend.
//!
//! The lock lives exactly as long as the session: no ttl on the server, nothing to expire, and a
//! lost session (killed, server restart) frees every lock of this backend at once; the holders
//! then hear `lost()` at their next renewal (`extend` checks that the session that took the lock
//! is still the live one).
//!
//! Keys: [`advisory_key`] (64-bit FNV-1a of the table name, a NUL byte and the lock name, as a
//! signed `bigint`): the table is the namespace, so backends on different tables (other
//! applications, parallel tests) do not share keys. Two names with the same key exclude each
//! other (a spurious busy, never two holders of one name); with n names in use the chance of any
//! collision is about n²/2⁶⁵.
//!
//! Waiting: with the waiters' FIFO on (the default), waiting processes queue in the table
//! mode's `<table>_waiters` (a busy try of a process whose callers wait inserts its row, a grant
//! deletes it) and a release that frees the lock notifies the oldest live queued process only,
//! on its own channel (the table's channel when nobody is queued), so one release wakes one
//! waiter; without it a release NOTIFYs the table's channel, one waiter per process. A lock
//! freed by a dying session sends no NOTIFY, and a notified process can be paused: while a name
//! has local waiters, the backend reads every 500 ms (`RECHECK`) whether its lock is held by
//! any session (`pg_locks`, no try) and wakes the first local waiter of a name found free at two
//! checks in a row. A busy answer reports no remaining time: a session lock has no known end.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use super::postgres::{Connector, Me};
use tokio_postgres::types::Type;

use super::bounded;
use crate::LockError;
use crate::backend::{Acquired, Extended, Released};
use tokio_util::sync::CancellationToken;

type DynError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// How often the backend re-checks the names its callers wait for: an advisory lock has no
/// lease, and one freed by a dying session sends no NOTIFY.
pub(crate) const RECHECK: Duration = Duration::from_millis(500);

/// Whom a release that frees a lock wakes.
#[derive(Debug, Clone)]
pub(crate) enum Wake {
    /// Every process (one local waiter each): a NOTIFY on the table's channel (the FIFO is off).
    Table,
    /// The oldest live process queued for the name (the table's channel when none is), and the
    /// releasing process queues at the back under this identity when its own callers wait.
    Fifo(Option<std::sync::Arc<Me>>),
}

/// `pg_locks`' condition (on the row `l`) for the session advisory lock of the bigint key
/// `key` (an SQL expression) in the current database, granted to any session: a bigint key is
/// shown as classid = its high 32 bits, objid = its low 32 bits, objsubid = 1.
fn held_where(l: &str, key: &str) -> String {
    format!(
        "{l}.locktype = 'advisory' AND {l}.granted AND {l}.objsubid = 1 \
         AND {l}.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         AND {l}.classid = ((({key}) >> 32) & 4294967295)::oid \
         AND {l}.objid = (({key}) & 4294967295)::oid"
    )
}

/// The statements of the waiters' FIFO in advisory mode (on the table mode's `<table>_waiters`;
/// see docs/postgres.md).
#[derive(Debug)]
struct QueueSql {
    /// The try of a process whose callers wait: `$1` key, `$2` name, `$3`..`$5` its channel,
    /// pid and start; a busy answer queues it (keeping its place), a grant takes it out.
    try_q: String,
    /// The unlock: `$1` name, `$2` key, `$3`..`$5` the releasing process's channel, pid and
    /// start when callers of its own wait for the name (NULLs otherwise: they queue at the
    /// back). When the unlock freed the lock, the oldest live queued process is notified on its
    /// own channel (the table's channel when none is), and dead listeners' rows are deleted.
    release_q: String,
    /// A process leaves the queue: `$1` name, `$2` its channel, `$3` pass: when the lock is
    /// free, wake the next process in line; `$4` key.
    leave: String,
    /// Which of the keys `$1` (bigint[]) no session holds: their 1-based positions.
    free: String,
    /// The listener's heartbeat (see `postgres::beat_statement`).
    beat: String,
}

impl QueueSql {
    fn new(table: &str, channel: &str) -> QueueSql {
        let mint = super::postgres::mint(
            table,
            "0",
            "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
        );
        let try_q = format!(
            "WITH t AS MATERIALIZED (SELECT pg_try_advisory_lock($1) AS got), \
             g AS MATERIALIZED (SELECT CASE WHEN t.got THEN {mint} END AS tok FROM t), \
             enq AS ( \
               INSERT INTO {table}_waiters (name, channel, pid, started_us, since, beat) \
               SELECT $2, $3::text, $4::integer, $5::bigint, clock_timestamp(), clock_timestamp() \
               FROM t WHERE NOT t.got \
               ON CONFLICT (name, channel) DO NOTHING), \
             deq AS ( \
               DELETE FROM {table}_waiters w USING t \
               WHERE t.got AND w.name = $2 AND w.channel = $3::text) \
             SELECT (SELECT g.tok FROM g)"
        );
        // `pick_head` reads the queue of `$1` when the CTE `fr` has a row.
        let head = super::postgres::pick_head(table, "", true);
        let release_q = format!(
            "WITH u AS MATERIALIZED (SELECT pg_advisory_unlock($2) AS freed), \
             fr AS MATERIALIZED (SELECT 1 AS f FROM u WHERE u.freed), \
             enq AS ( \
               INSERT INTO {table}_waiters (name, channel, pid, started_us, since, beat) \
               SELECT $1, $3::text, $4::integer, $5::bigint, clock_timestamp(), clock_timestamp() \
               FROM u WHERE u.freed AND $3::text IS NOT NULL \
               ON CONFLICT (name, channel) DO NOTHING), \
             {head} \
             SELECT u.freed, CASE WHEN u.freed THEN \
                      pg_notify(coalesce((SELECT channel FROM head), '{channel}'), \
                                encode($1, 'hex'))::text END \
             FROM u"
        );
        let no_flush = super::postgres::NO_FLUSH_WAIT;
        let held = held_where("l", "$4::bigint");
        let head = super::postgres::pick_head(table, " AND w.channel <> $2::text", true);
        let leave = format!(
            "WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now, {no_flush} AS sc), \
             d AS (DELETE FROM {table}_waiters WHERE name = $1 AND channel = $2::text), \
             fr AS MATERIALIZED ( \
               SELECT 1 AS f FROM c WHERE $3::boolean \
                 AND NOT EXISTS (SELECT 1 FROM pg_locks l WHERE {held})), \
             {head} \
             SELECT pg_notify(coalesce((SELECT channel FROM head), '{channel}'), \
                              encode($1, 'hex'))::text \
             FROM fr"
        );
        let held = held_where("l", "n.k");
        let free = format!(
            "WITH l AS MATERIALIZED (SELECT * FROM pg_locks WHERE locktype = 'advisory') \
             SELECT n.i FROM unnest($1::bigint[]) WITH ORDINALITY AS n(k, i) \
             WHERE NOT EXISTS (SELECT 1 FROM l WHERE {held})"
        );
        QueueSql {
            try_q,
            release_q,
            leave,
            free,
            beat: super::postgres::beat_statement(table, true),
        }
    }
}

/// The advisory-lock key of lock `name` in the backend whose table is `table`: 64-bit FNV-1a
/// (offset basis 0xcbf29ce484222325, prime 0x100000001b3) of the table name's bytes, one NUL
/// byte, and the name's UTF-8 bytes, reinterpreted as a signed 64-bit integer. The table name
/// is the one given to the builder (default `dlock_locks`), as written there.
pub fn advisory_key(table: &str, name: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in table
        .as_bytes()
        .iter()
        .chain([0u8].iter())
        .chain(name.as_bytes())
    {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h as i64
}

struct Session {
    client: tokio_postgres::Client,
    generation: u64,
    /// The session's `application_name`: the holder identity it was opened (or last set) with
    /// (see `holder.rs`); the admin names an advisory lock's holder by it.
    app_name: String,
    /// Cancelled when the session ends (dropped by this process, or its connection closed):
    /// every lock on it is gone on the server at that moment (sql.md #4a).
    lost: CancellationToken,
}

/// A hold of this process, or a try in flight for it.
#[derive(Debug)]
struct Held {
    owner: String,
    /// Holds (0: kept by `hold_at_least`, or being given back).
    count: u32,
    token: u64,
    generation: u64,
    /// `pg_try_advisory_lock` for `owner` was (or was about to be) sent on the session of
    /// `generation` and its answer not read: the session may hold the lock for nobody. Marked
    /// before the statement is sent, so the give-back of `owner` (ordered behind the try on the
    /// one session) finds it and unlocks, and a later try of the name does so first.
    pending: bool,
    /// The session's [`Session::lost`].
    lost: CancellationToken,
    /// Its release (no keep) is giving it back.
    releasing: bool,
}

/// A current-thread runtime on a thread of its own: the session's connection driver, the
/// give-backs and the `hold_at_least` timers run there, so none of them dies with a caller's
/// runtime (a `#[tokio::test]`'s, or the runtime-shutdown helper's temporary one) while the
/// session, and the locks on it, live on. Stopped when the backend is dropped.
struct OwnRuntime {
    handle: tokio::runtime::Handle,
    stop: tokio_util::sync::CancellationToken,
}

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl OwnRuntime {
    fn start() -> Result<OwnRuntime, LockError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| LockError::Config(format!("advisory mode's runtime: {e}")))?;
        let handle = rt.handle().clone();
        let stop = tokio_util::sync::CancellationToken::new();
        let s = stop.clone();
        std::thread::Builder::new()
            .name("dlock-pg-advisory".into())
            .spawn(move || rt.block_on(s.cancelled()))
            .map_err(|e| LockError::Config(format!("advisory mode's thread: {e}")))?;
        Ok(OwnRuntime { handle, stop })
    }
}

/// The dedicated session and what this process holds on it.
pub(crate) struct Advisory {
    cfg: tokio_postgres::Config,
    connector: Connector,
    session: tokio::sync::Mutex<Option<Session>>,
    held: Mutex<HashMap<String, Held>>,
    next_generation: std::sync::atomic::AtomicU64,
    table: String,
    channel: String,
    op_timeout: Duration,
    connect_timeout: Duration,
    rt: OwnRuntime,
    /// Holds given back lately, per (name, owner), with when: a release of the owner sent again
    /// (its first answer was lost to its caller) is answered `Freed`, not `NotOwner`.
    released: Mutex<HashMap<(String, String), std::time::Instant>>,
    queue: QueueSql,
}

impl std::fmt::Debug for Advisory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Advisory").finish_non_exhaustive()
    }
}

impl Advisory {
    pub(crate) fn new(
        cfg: tokio_postgres::Config,
        connector: Connector,
        table: &str,
        channel: String,
        op_timeout: Duration,
        connect_timeout: Duration,
    ) -> Result<Advisory, LockError> {
        Ok(Advisory {
            cfg,
            connector,
            session: tokio::sync::Mutex::new(None),
            held: Mutex::new(HashMap::new()),
            next_generation: std::sync::atomic::AtomicU64::new(1),
            table: table.to_string(),
            op_timeout,
            connect_timeout,
            rt: OwnRuntime::start()?,
            released: Mutex::new(HashMap::new()),
            queue: QueueSql::new(table, &channel),
            channel,
        })
    }

    /// The leave statement of `name` for the process whose channel is `channel` (`pass`: wake
    /// the next process in line when the lock is free), on the dedicated session: a try of this
    /// process whose caller went away may still be running there, and its insert of the
    /// process's row must not come after the deletion (one session runs its statements in the
    /// order they were sent; on a pooled connection the leave could overtake it and leave the
    /// row behind until a release finds its heartbeat stale).
    pub(crate) async fn leave(
        &self,
        name: &str,
        channel: &str,
        pass: bool,
    ) -> Result<(), LockError> {
        let key = advisory_key(&self.table, name);
        let guard = self.live_session(name).await?;
        let client = &guard.as_ref().expect("live session").client;
        bounded(
            name,
            "the leave statement",
            self.op_timeout,
            client.query_typed(
                &self.queue.leave,
                &[
                    (&name.as_bytes(), Type::BYTEA),
                    (&channel, Type::TEXT),
                    (&pass, Type::BOOL),
                    (&key, Type::INT8),
                ],
            ),
        )
        .await
        .map(drop)
    }

    /// The listener's heartbeat in this mode.
    pub(crate) fn beat_sql(&self) -> &str {
        &self.queue.beat
    }

    /// Which of `keys` no session holds (see [`QueueSql::free`]).
    pub(crate) fn free_sql(&self) -> &str {
        &self.queue.free
    }

    /// The key of `name` (see [`advisory_key`]).
    pub(crate) fn key(&self, name: &str) -> i64 {
        advisory_key(&self.table, name)
    }

    /// Whether a try of `owner` for `name` is answered from this process's own holds (held by
    /// another caller here, a re-entry, or its own try still pending) rather than by a fresh
    /// `pg_try_advisory_lock`: such a try does not queue the process (the release here queues
    /// it when its callers still wait).
    pub(crate) fn answered_here(&self, name: &str, owner: &str) -> bool {
        self.held_live(name)
            .get(name)
            .is_some_and(|h| h.owner == owner || !h.pending)
    }

    /// Whether the release of `owner` (`all`: every hold, `keep`: `hold_at_least` keeps it)
    /// would give the lock back now: its callers that still wait then queue behind the others.
    pub(crate) fn release_frees(&self, name: &str, owner: &str, all: bool, keep: bool) -> bool {
        !keep
            && self
                .held()
                .get(name)
                .is_some_and(|h| h.owner == owner && !h.pending && (h.count == 1 || all))
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn released(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), std::time::Instant>> {
        self.released.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes that `owner`'s hold of `name` was given back (kept 10 minutes; owner ids are
    /// never reused).
    fn remember_released(&self, name: &str, owner: &str) {
        let mut r = self.released();
        if r.len() >= 1024 {
            r.retain(|_, at| at.elapsed() < Duration::from_secs(600));
        }
        r.insert(
            (name.to_string(), owner.to_string()),
            std::time::Instant::now(),
        );
    }

    /// Opens the session and refuses a transaction-mode pooler (see [`Advisory::pooler_check`]).
    async fn open(&self, key: &str) -> Result<Session, LockError> {
        let app_name = crate::holder::application_name();
        let (client, driver) = self.connect(key, &app_name).await?;
        self.pooler_check(key, &client).await?;
        let generation = self
            .next_generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let lost = CancellationToken::new();
        let l = lost.clone();
        // The connection's end (the server ended the session, the network broke, the client
        // was dropped) is the end of every lock on it: the holders hear it at once.
        self.rt.handle.spawn(async move {
            let _ = driver.await;
            l.cancel();
        });
        Ok(Session {
            client,
            generation,
            app_name,
            lost,
        })
    }

    /// Fires when the hold of `owner` on `name` is gone with its session (see [`Session::lost`]).
    pub(crate) fn lost_signal(&self, name: &str, owner: &str) -> Option<CancellationToken> {
        self.held()
            .get(name)
            .filter(|h| h.owner == owner && !h.pending && h.count > 0)
            .map(|h| h.lost.clone())
    }

    /// Connects one session whose driver runs on the backend's own runtime.
    async fn connect(
        &self,
        key: &str,
        app_name: &str,
    ) -> Result<(tokio_postgres::Client, tokio::task::JoinHandle<()>), LockError> {
        let (connector, mut cfg) = (self.connector.clone(), self.cfg.clone());
        cfg.application_name(app_name);
        let task = self
            .rt
            .handle
            .spawn(async move { connector.connect(&cfg, None).await });
        bounded(
            key,
            "the advisory session's connect",
            self.connect_timeout,
            async { task.await.map_err(DynError::from)?.map_err(DynError::from) },
        )
        .await
    }

    /// Two signs that statements on one client connection do not share one server session, as
    /// behind a transaction-mode pooler (PgBouncer): two `pg_backend_pid()` calls that disagree;
    /// or a probe advisory lock taken by `client` that a second connection of ours can take too
    /// (a pooler that hands its idle server session to the next client, as PgBouncer does by
    /// default, shares the lock with it). Either refuses advisory mode with a `Config` error.
    async fn pooler_check(
        &self,
        key: &str,
        client: &tokio_postgres::Client,
    ) -> Result<(), LockError> {
        // The simple query protocol throughout: one message per statement and no named
        // statement, which a transaction-mode pooler could look up in another server session
        // ("prepared statement sN does not exist") before this check could name the pooler.
        let pid = || async {
            bounded(key, "pg_backend_pid()", self.op_timeout, async {
                first_value(client.simple_query("SELECT pg_backend_pid()").await?)?
                    .parse::<i32>()
                    .map_err(DynError::from)
            })
            .await
        };
        let a = pid().await?;
        let b = pid().await?;
        let refuse = |why: String| {
            LockError::Config(format!(
                "PostgreSQL advisory-lock mode refused: {why}, so a transaction-mode pooler \
                 (e.g. PgBouncer) is in between and session advisory locks would be shared with \
                 other clients; connect directly to PostgreSQL (or through a session-mode pool) or \
                 use the lock-table mode"
            ))
        };
        if a != b {
            return Err(refuse(format!(
                "two statements on one connection ran in server processes {a} and {b}"
            )));
        }
        // The probe: a random key, taken on `client`, then tried from a second connection.
        let probe = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(a as u64);
            h.finish() as i64
        };
        let took = bounded(key, "the pooler probe", self.op_timeout, async {
            Ok::<_, DynError>(
                first_value(
                    client
                        .simple_query(&format!("SELECT pg_try_advisory_lock({probe})"))
                        .await?,
                )? == "t",
            )
        })
        .await?;
        if !took {
            // Our random key is held elsewhere (vanishingly rare): nothing to conclude.
            return Ok(());
        }
        let (second, _) = self.connect(key, "dlock pooler check").await?;
        let shared = bounded(key, "the pooler probe", self.op_timeout, async {
            let r = first_value(
                second
                    .simple_query(&format!("SELECT pg_try_advisory_lock({probe})"))
                    .await?,
            )? == "t";
            if r {
                second
                    .simple_query(&format!("SELECT pg_advisory_unlock({probe})"))
                    .await?;
            }
            Ok::<_, DynError>(r)
        })
        .await?;
        drop(second);
        {
            let _ = bounded(key, "the pooler probe", self.op_timeout, async {
                Ok::<_, DynError>(
                    client
                        .simple_query(&format!("SELECT pg_advisory_unlock({probe})"))
                        .await?,
                )
            })
            .await;
        }
        if shared {
            return Err(refuse(
                "a probe advisory lock taken on the session was free for a second connection"
                    .to_string(),
            ));
        }
        Ok(())
    }

    /// Opens the session at start-up (so a pooler in between is refused by `connect`).
    pub(crate) async fn start(&self) -> Result<(), LockError> {
        let session = self.open("").await?;
        *self.session.lock().await = Some(session);
        Ok(())
    }

    /// The session's mutex, waited for at most `op_timeout` (sql.md #10: every call of the
    /// backend goes through this one session, and a queue of slow calls, each bounded by
    /// `op_timeout` on its own, made a call wait for all of them). A call that could not get
    /// it sent nothing: a [`LockError::Backend`] with nothing to give back.
    async fn lock_session(
        &self,
        key: &str,
    ) -> Result<tokio::sync::MutexGuard<'_, Option<Session>>, LockError> {
        bounded(
            key,
            "the advisory session (busy with other calls)",
            self.op_timeout,
            async { Ok::<_, DynError>(self.session.lock().await) },
        )
        .await
    }

    /// The live session (opening a new one when it was lost), with the mutex held.
    async fn live_session<'s>(
        &'s self,
        key: &str,
    ) -> Result<tokio::sync::MutexGuard<'s, Option<Session>>, LockError> {
        let mut guard = self.lock_session(key).await?;
        if guard.as_ref().is_none_or(|s| s.client.is_closed()) {
            self.drop_session(&mut guard);
            *guard = Some(self.open(key).await?);
        }
        Ok(guard)
    }

    /// Drops the session (its server session ends, and every lock on it with it) and forgets
    /// the holds of it.
    fn drop_session(&self, guard: &mut Option<Session>) {
        if let Some(s) = guard.take() {
            s.lost.cancel();
            self.held().retain(|_, h| h.generation != s.generation);
        }
    }

    /// The entries of this process for `name`, without one whose session has ended (the lock
    /// went with it).
    fn held_live(&self, name: &str) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
        let mut held = self.held();
        if held.get(name).is_some_and(|h| h.lost.is_cancelled()) {
            held.remove(name);
        }
        held
    }

    /// One try of `owner` for `name`; `me`: the identity under which this process queues for
    /// the name (its callers wait for it, the FIFO is on): a busy answer queues the process,
    /// a grant takes it out of the queue, in the same statement.
    pub(crate) async fn try_acquire(
        &self,
        name: &str,
        owner: &str,
        me: Option<&Me>,
    ) -> Result<Acquired, LockError> {
        let mine = {
            let held = self.held_live(name);
            match held.get(name) {
                // Another owner's hold; a pending entry is an abandoned try (see below).
                Some(h) if h.owner != owner && !h.pending => {
                    return Ok(Acquired::Busy { remaining: None });
                }
                Some(h) if h.owner == owner && !h.pending && h.count > 0 => Some(h.generation),
                Some(h) if h.owner == owner => return Ok(Acquired::Busy { remaining: None }),
                _ => None,
            }
        };
        if let Some(generation) = mine {
            // A re-entry: only while the session that took the lock is alive (one round trip,
            // as the table mode's re-entry is); else the hold is gone and this is a fresh try.
            if self.session_alive(name, generation).await? {
                let mut held = self.held();
                if let Some(h) = held.get_mut(name)
                    && h.owner == owner
                    && h.generation == generation
                    && !h.pending
                {
                    h.count += 1;
                    return Ok(Acquired::Granted {
                        token: h.token,
                        count: h.count,
                    });
                }
            } else {
                self.held()
                    .retain(|n, h| !(n == name && h.generation == generation));
            }
        }
        let key = advisory_key(&self.table, name);
        let mut guard = self.live_session(name).await?;
        let (generation, lost) = {
            let s = guard.as_ref().expect("live session");
            (s.generation, s.lost.clone())
        };
        // The session mutex is held from here to the bookkeeping of the answer, so a pending
        // entry met here is a try whose caller went away: its lock (if it was granted) is given
        // back first, on the session, behind it.
        let abandoned = {
            let mut held = self.held();
            match held.get(name) {
                Some(h) if h.generation != generation => {
                    held.remove(name);
                    false
                }
                Some(h) if h.pending => true,
                Some(_) => return Ok(Acquired::Busy { remaining: None }),
                None => false,
            }
        };
        if abandoned {
            let r = {
                let client = &guard.as_ref().expect("live session").client;
                bounded(
                    name,
                    "pg_advisory_unlock",
                    self.op_timeout,
                    client.query_typed("SELECT pg_advisory_unlock($1)", &[(&key, Type::INT8)]),
                )
                .await
            };
            if let Err(e) = r {
                self.drop_session(&mut guard);
                return Err(e);
            }
            self.held().remove(name);
        }
        self.held().insert(
            name.to_string(),
            Held {
                owner: owner.to_string(),
                count: 0,
                token: 0,
                generation,
                pending: true,
                lost,
                releasing: false,
            },
        );
        // The token rule's floor (see `mint`): the sequence, moved forward to the server's
        // clock in µs when it is behind.
        let sql = match me {
            Some(_) => self.queue.try_q.clone(),
            None => format!(
                "SELECT CASE WHEN pg_try_advisory_lock($1) THEN {} END",
                super::postgres::mint(
                    &self.table,
                    "0",
                    "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
                )
            ),
        };
        // A holder name set since the session opened renames the session in the same
        // statement (no round trip added).
        let app_name = crate::holder::application_name();
        let rename = guard.as_ref().expect("live session").app_name != app_name;
        let app = app_name.as_str();
        let name_b = name.as_bytes();
        let mut params: Vec<(&(dyn tokio_postgres::types::ToSql + Sync), Type)> =
            vec![(&key, Type::INT8)];
        if let Some(m) = me {
            params.extend([
                (
                    &name_b as &(dyn tokio_postgres::types::ToSql + Sync),
                    Type::BYTEA,
                ),
                (&m.channel, Type::TEXT),
                (&m.pid, Type::INT4),
                (&m.started_us, Type::INT8),
            ]);
        }
        let sql = if rename {
            params.push((&app, Type::TEXT));
            format!(
                "{sql}, set_config('application_name', ${}, false)",
                params.len()
            )
        } else {
            sql
        };
        let r = {
            let client = &guard.as_ref().expect("live session").client;
            tokio::time::timeout(self.op_timeout, client.query_typed(&sql, &params)).await
        };
        if rename
            && matches!(r, Ok(Ok(_)))
            && let Some(s) = guard.as_mut()
        {
            s.app_name = app_name;
        }
        let forget = |this: &Self| {
            let mut held = this.held();
            if held
                .get(name)
                .is_some_and(|h| h.owner == owner && h.generation == generation)
            {
                held.remove(name);
            }
        };
        match r {
            Ok(Ok(rows)) => {
                let token = rows.first().and_then(|r| r.get::<_, Option<i64>>(0));
                let Some(token) = token else {
                    forget(self);
                    return Ok(Acquired::Busy { remaining: None });
                };
                if let Some(h) = self.held().get_mut(name) {
                    h.pending = false;
                    h.count = 1;
                    h.token = token as u64;
                }
                Ok(Acquired::Granted {
                    token: token as u64,
                    count: 1,
                })
            }
            Ok(Err(e))
                if e.as_db_error().is_some()
                    && !guard.as_ref().expect("live").client.is_closed() =>
            {
                // A SQL error (say nextval refused): the statement's transaction is rolled
                // back, but a session lock taken in it is not; unlock it (an unlock of a lock
                // not held only warns) and keep the session and the other holds on it.
                let client = &guard.as_ref().expect("live session").client;
                let u = bounded(
                    name,
                    "pg_advisory_unlock",
                    self.op_timeout,
                    client.query_typed("SELECT pg_advisory_unlock($1)", &[(&key, Type::INT8)]),
                )
                .await;
                if u.is_err() {
                    self.drop_session(&mut guard);
                } else {
                    forget(self);
                }
                Err(LockError::backend(name, e))
            }
            Ok(Err(e)) => {
                self.drop_session(&mut guard);
                Err(LockError::backend(name, e))
            }
            Err(_) => {
                // No answer: the session's state is unknown; it is ended (with every lock on
                // it) rather than trusted.
                self.drop_session(&mut guard);
                Err(LockError::backend(
                    name,
                    super::SqlTimeout {
                        what: "pg_try_advisory_lock",
                        after: self.op_timeout,
                    },
                ))
            }
        }
    }

    /// Gives back the lock of `owner` taken on the session of `generation` (`wake`: whom a
    /// release that frees it wakes), on the backend's own runtime, and forgets the hold once
    /// that is confirmed: the unlock answered, or the session that held it is gone (ended, which
    /// frees it). Returns whether the session held it.
    fn give_back(
        self: &std::sync::Arc<Self>,
        name: &str,
        owner: &str,
        generation: u64,
        wake: Wake,
    ) -> tokio::task::JoinHandle<Result<bool, LockError>> {
        let (me, name, owner) = (self.clone(), name.to_string(), owner.to_string());
        self.rt.handle.spawn(async move {
            let forget = || {
                let mut held = me.held();
                if held
                    .get(&name)
                    .is_some_and(|h| h.owner == owner && h.generation == generation)
                {
                    let hold = held.remove(&name).is_some_and(|h| !h.pending);
                    drop(held);
                    if hold {
                        me.remember_released(&name, &owner);
                    }
                }
            };
            let mut guard = me.session.lock().await;
            let live = guard
                .as_ref()
                .is_some_and(|s| s.generation == generation && !s.client.is_closed());
            if !live {
                // The session that held it is gone, and the lock with it.
                me.drop_session_if_closed(&mut guard);
                forget();
                return Ok(false);
            }
            let key = advisory_key(&me.table, &name);
            // The name travels as bytea: text cannot carry a NUL byte, a valid lock name can.
            let name_b = name.as_bytes();
            let plain = format!(
                "SELECT pg_advisory_unlock($1), pg_notify('{}', encode($2, 'hex'))::text",
                me.channel
            );
            let plain_params: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 2] =
                [(&key, Type::INT8), (&name_b, Type::BYTEA)];
            let r = match &wake {
                Wake::Table => None,
                Wake::Fifo(queue_as) => {
                    let (ch, pid, started) = match queue_as {
                        Some(m) => (Some(m.channel.as_str()), Some(m.pid), Some(m.started_us)),
                        None => (None, None, None),
                    };
                    let client = &guard.as_ref().expect("live session").client;
                    let r = tokio::time::timeout(
                        me.op_timeout,
                        client.query_typed(
                            &me.queue.release_q,
                            &[
                                (&name_b, Type::BYTEA),
                                (&key, Type::INT8),
                                (&ch, Type::TEXT),
                                (&pid, Type::INT4),
                                (&started, Type::INT8),
                            ],
                        ),
                    )
                    .await;
                    match r {
                        Ok(Ok(rows)) => Some(Ok(rows)),
                        // A SQL error (the waiters table changed under us): the plain unlock
                        // below, on the same session (an unlock the failed statement did is not
                        // rolled back; the plain one then answers false).
                        Ok(Err(e)) if e.as_db_error().is_some() && !client.is_closed() => {
                            tracing::debug!(key = %name, error = %e, "dlock: advisory release through the waiters' queue failed; unlocking without it");
                            None
                        }
                        Ok(Err(e)) => Some(Err(LockError::backend(&name, e))),
                        Err(_) => Some(Err(LockError::backend(
                            &name,
                            super::SqlTimeout {
                                what: "pg_advisory_unlock",
                                after: me.op_timeout,
                            },
                        ))),
                    }
                }
            };
            let r = match r {
                Some(r) => r,
                None => {
                    let client = &guard.as_ref().expect("live session").client;
                    bounded(
                        &name,
                        "pg_advisory_unlock",
                        me.op_timeout,
                        client.query_typed(&plain, &plain_params),
                    )
                    .await
                }
            };
            match r {
                Ok(rows) => {
                    forget();
                    Ok(rows.first().and_then(|r| r.get::<_, Option<bool>>(0)) == Some(true))
                }
                Err(e) => {
                    // Unanswered: the session is ended instead (which frees the lock on the
                    // server), so the hold is never left behind.
                    tracing::debug!(key = %name, error = %e, "dlock: advisory unlock failed; ending the session");
                    me.drop_session(&mut guard);
                    Ok(true)
                }
            }
        })
    }

    fn drop_session_if_closed(&self, guard: &mut Option<Session>) {
        if guard.as_ref().is_some_and(|s| s.client.is_closed()) {
            self.drop_session(guard);
        }
    }

    pub(crate) async fn release(
        self: &std::sync::Arc<Self>,
        name: &str,
        owner: &str,
        keep_for: Option<Duration>,
        all: bool,
        wake: Wake,
    ) -> Result<Released, LockError> {
        let keep = keep_for.filter(|k| !k.is_zero());
        // A give-back other than this release's own (a pending try's, or after `keep`) does
        // not queue this process's waiters.
        let other = match &wake {
            Wake::Table => Wake::Table,
            Wake::Fifo(_) => Wake::Fifo(None),
        };
        // (generation, whether it is a pending try's)
        let (generation, pending) = {
            let mut held = self.held_live(name);
            let mine = held.get_mut(name).filter(|h| h.owner == owner);
            let Some(h) = mine else {
                drop(held);
                // Given back already (a release sent again after its answer was lost)?
                let key = (name.to_string(), owner.to_string());
                return Ok(if self.released().contains_key(&key) {
                    Released::Freed
                } else {
                    Released::NotOwner
                });
            };
            if h.pending {
                (h.generation, true)
            } else if h.count == 0 && !h.releasing {
                // Kept by hold_at_least: this release was answered already.
                return Ok(Released::Freed);
            } else if h.count == 0 {
                // Being given back (an earlier call of this release went unanswered): wait
                // for it, behind it.
                (h.generation, false)
            } else {
                h.count = if all { 0 } else { h.count - 1 };
                if h.count > 0 {
                    return Ok(Released::Decremented(h.count));
                }
                h.releasing = keep.is_none();
                (h.generation, false)
            }
        };
        if pending {
            // The give-back of a try whose answer was not read: unlock whatever it took,
            // behind it on the session.
            let took = self
                .give_back(name, owner, generation, other)
                .await
                .map_err(|e| LockError::backend(name, e))??;
            return Ok(if took {
                Released::Freed
            } else {
                Released::NotOwner
            });
        }
        match keep {
            None => {
                self.give_back(name, owner, generation, wake)
                    .await
                    .map_err(|e| LockError::backend(name, e))??;
            }
            Some(keep) => {
                // hold_at_least: keep the session lock for the remainder, then give it back
                // (on the backend's own runtime, which outlives the caller's).
                let (me, name, owner) = (self.clone(), name.to_string(), owner.to_string());
                self.rt.handle.spawn(async move {
                    tokio::time::sleep(keep).await;
                    let still = me.held().get(&name).is_some_and(|h| {
                        h.owner == owner && h.generation == generation && h.count == 0 && !h.pending
                    });
                    if still {
                        let _ = me.give_back(&name, &owner, generation, other).await;
                    }
                });
            }
        }
        Ok(Released::Freed)
    }

    /// The session that took the lock must still be the live one: one round trip proves it.
    pub(crate) async fn extend(&self, name: &str, owner: &str) -> Result<Extended, LockError> {
        let generation = {
            let held = self.held_live(name);
            match held.get(name) {
                Some(h) if h.owner == owner && h.count > 0 && !h.pending => h.generation,
                _ => return Ok(Extended::Lost),
            }
        };
        if self.session_alive(name, generation).await? {
            Ok(Extended::Extended)
        } else {
            self.held()
                .retain(|n, h| !(n == name && h.generation == generation));
            Ok(Extended::Lost)
        }
    }

    /// Whether the session of `generation` is still the live one and answers (one round trip).
    /// A session found dead is dropped; an error that leaves its state unknown is returned.
    async fn session_alive(&self, name: &str, generation: u64) -> Result<bool, LockError> {
        let mut guard = self.lock_session(name).await?;
        let Some(s) = guard.as_ref() else {
            return Ok(false);
        };
        if s.generation != generation || s.client.is_closed() {
            self.drop_session_if_closed(&mut guard);
            return Ok(false);
        }
        match bounded(
            name,
            "the advisory session check",
            self.op_timeout,
            s.client.simple_query("SELECT 1"),
        )
        .await
        {
            Ok(_) => Ok(true),
            Err(e) => {
                if s.client.is_closed() {
                    self.drop_session(&mut guard);
                    return Ok(false);
                }
                Err(e)
            }
        }
    }
}

/// The first column of the first row of a simple-protocol reply.
fn first_value(msgs: Vec<tokio_postgres::SimpleQueryMessage>) -> Result<String, DynError> {
    msgs.into_iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
            _ => None,
        })
        .ok_or_else(|| DynError::from("no row in the reply"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advisory_keys_are_fnv1a_64() {
        // Reference values of 64-bit FNV-1a.
        // Reference value: FNV-1a of the single byte 0x00 (empty table, empty name).
        assert_eq!(advisory_key("", ""), 0xaf63bd4c8601b7dfu64 as i64);
        assert_ne!(advisory_key("t", "order:1"), advisory_key("t", "order:2"));
        // The table is the namespace, and the NUL separator keeps (table, name) pairs apart.
        assert_ne!(advisory_key("t1", "x"), advisory_key("t2", "x"));
        assert_ne!(advisory_key("ab", "c"), advisory_key("a", "bc"));
    }
}
