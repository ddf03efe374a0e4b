//! The PostgreSQL lock-table backend: one row per held lock, expiry by `clock_timestamp()`,
//! fencing tokens from a sequence, waiting by `LISTEN`/`NOTIFY`.
//!
//! See [`PostgresBackend`].

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::sync::watch as tokio_watch;
use tokio::task::JoinHandle;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{AsyncMessage, NoTls, Row};
use tokio_util::sync::CancellationToken;

use super::pg_advisory::{Advisory, RECHECK, Wake};
use super::{DEFAULT_TABLE, bounded, check_table, micros, redact_url};
use crate::LockError;
use crate::backend::{Acquired, Backend, BoxFuture, Extended, Released, RwSide, Watch};
use crate::wait::WaitQueues;

mod prims;

type DynError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// How the backend's own connections are made: plain, or TLS through rustls (feature
/// `postgres-tls`; the URL's `sslmode` then decides whether TLS is tried, preferred or required).
#[derive(Clone)]
pub(crate) enum Connector {
    Plain,
    #[cfg(feature = "postgres-tls")]
    Rustls(tokio_postgres_rustls::MakeRustlsConnect),
}

/// Called for each notification a connection receives.
pub(crate) type OnNotify = Box<dyn FnMut(&tokio_postgres::Notification) + Send>;

impl Connector {
    /// Connects one session and spawns the task that drives it (handing notifications to `on`).
    pub(crate) async fn connect(
        &self,
        cfg: &tokio_postgres::Config,
        on: Option<OnNotify>,
    ) -> Result<(tokio_postgres::Client, JoinHandle<()>), tokio_postgres::Error> {
        match self {
            Connector::Plain => {
                let (c, conn) = cfg.connect(NoTls).await?;
                Ok((c, drive(conn, on)))
            }
            #[cfg(feature = "postgres-tls")]
            Connector::Rustls(t) => {
                let (c, conn) = cfg.connect(t.clone()).await?;
                Ok((c, drive(conn, on)))
            }
        }
    }
}

fn drive<S, T>(
    mut conn: tokio_postgres::Connection<S, T>,
    mut on: Option<OnNotify>,
) -> JoinHandle<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        while let Some(r) = std::future::poll_fn(|cx| conn.poll_message(cx)).await {
            match r {
                Ok(AsyncMessage::Notification(n)) => {
                    if let Some(f) = on.as_mut() {
                        f(&n)
                    }
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
    })
}

/// The DDL of the lock table `table` (with its fencing sequence `<table>_fence` and its queue of
/// waiting processes `<table>_waiters`), as the backend
/// runs it on first use. Teams that manage migrations themselves apply this and may revoke
/// `CREATE` from the application's role; the statements are idempotent (`IF NOT EXISTS`).
///
/// ```text
/// CREATE SEQUENCE IF NOT EXISTS dlock_locks_fence;
/// CREATE TABLE IF NOT EXISTS dlock_locks (
///     name       bytea       PRIMARY KEY,  -- the lock name (UTF-8 bytes; NUL allowed)
///     owner      text        NOT NULL,     -- the holder's owner id
///     count      integer     NOT NULL,     -- re-entrant hold count (0 = kept by hold_at_least)
///     fence      bigint      NOT NULL,     -- fencing token of the hold, from the sequence
///     expires_at timestamptz NOT NULL,     -- end of the lease, by the database clock
///     holder     text                      -- who holds it: name@host:pid (NULL: an older version)
/// );
/// -- The queue of waiting processes (one row per process and name; see "PostgreSQL waiting" in
/// -- docs/postgres.md). Unlogged: a row costs no WAL flush, and a server crash, which ends every
/// -- listener anyway, empties it.
/// CREATE UNLOGGED TABLE IF NOT EXISTS dlock_locks_waiters (
///     name       bytea       NOT NULL,     -- the lock name waited for
///     channel    text        NOT NULL,     -- the NOTIFY channel of the waiting process
///     pid        integer     NOT NULL,     -- its listening session (pg_backend_pid())
///     started_us bigint      NOT NULL,     -- that session's backend_start, µs since 1970
///     since      timestamptz NOT NULL,     -- when it queued (the FIFO order)
///     beat       timestamptz,              -- its last heartbeat (NULL: an older version's row)
///     PRIMARY KEY (name, channel)
/// );
/// -- Tables of older versions gain the heartbeat and holder columns (DO blocks: ALTER TABLE only
/// -- when one is missing, so no exclusive lock is taken at every connect):
/// ALTER TABLE dlock_locks_waiters ADD COLUMN beat timestamptz;
/// ALTER TABLE dlock_locks ADD COLUMN holder text;
/// -- Leader records, semaphores and read-write locks (both modes; see docs/postgres.md):
/// CREATE TABLE IF NOT EXISTS dlock_locks_records (
///     name bytea PRIMARY KEY, epoch bigint NOT NULL, value text NOT NULL);
/// CREATE TABLE IF NOT EXISTS dlock_locks_sem (    -- per semaphore: its max, its token counter
///     name bytea PRIMARY KEY, max integer NOT NULL, fence bigint NOT NULL);
/// CREATE TABLE IF NOT EXISTS dlock_locks_permits ( -- a row per grant (side 'p')
///     name bytea NOT NULL, owner text NOT NULL, side text NOT NULL, count integer NOT NULL,
///     fence bigint NOT NULL, expires_at timestamptz NOT NULL, PRIMARY KEY (name, owner, side));
/// CREATE TABLE IF NOT EXISTS dlock_locks_rw (      -- per read-write lock: its token counter
///     name bytea PRIMARY KEY, fence bigint NOT NULL);
/// CREATE TABLE IF NOT EXISTS dlock_locks_rw_holds ( -- side 'r', 'w' or 'q' (writer waiting)
///     name bytea NOT NULL, owner text NOT NULL, side text NOT NULL, count integer NOT NULL,
///     fence bigint NOT NULL, expires_at timestamptz NOT NULL, PRIMARY KEY (name, owner, side));
/// ```
pub fn postgres_schema_sql(table: &str) -> Result<String, LockError> {
    check_table(table)?;
    Ok(format!(
        "CREATE SEQUENCE IF NOT EXISTS {table}_fence;\n\
         CREATE TABLE IF NOT EXISTS {table} (\n    \
             name bytea PRIMARY KEY,\n    \
             owner text NOT NULL,\n    \
             count integer NOT NULL,\n    \
             fence bigint NOT NULL,\n    \
             expires_at timestamptz NOT NULL,\n    \
             holder text\n\
         );\n\
         CREATE UNLOGGED TABLE IF NOT EXISTS {table}_waiters (\n    \
             name bytea NOT NULL,\n    \
             channel text NOT NULL,\n    \
             pid integer NOT NULL,\n    \
             started_us bigint NOT NULL,\n    \
             since timestamptz NOT NULL,\n    \
             beat timestamptz,\n    \
             PRIMARY KEY (name, channel)\n\
         );\n\
         DO $dlock$ BEGIN \
           IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = '{table}_waiters'::regclass \
                          AND attname = 'beat' AND NOT attisdropped) THEN \
             ALTER TABLE {table}_waiters ADD COLUMN beat timestamptz; \
           END IF; \
           IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = '{table}'::regclass \
                          AND attname = 'holder' AND NOT attisdropped) THEN \
             ALTER TABLE {table} ADD COLUMN holder text; \
           END IF; \
         END $dlock$;\n{}",
        prims::schema_sql(table)
    ))
}

/// The statements of one table, built once.
#[derive(Debug)]
struct Sql {
    acquire: String,
    /// `acquire` that also stores the holder identity (`$4`; v5), for a table with the column.
    acquire_holder: String,
    /// Whether the table has the `holder` column.
    holder_exists: String,
    release: String,
    /// Whether `$2`'s release of `$1` was applied (its own row at count 0).
    released_by: String,
    extend: String,
    sweep: String,
    schema: String,
    /// Whether the waiters table exists (the FIFO needs it).
    waiters_exist: String,
    channel: String,
    /// The waiters' FIFO forms (v2) of acquire and release, and the leave statement.
    fifo: Fifo,
    /// The `server_functions` form: the function DDL, the query that tells whether they
    /// exist, and the calls that replace `acquire`, `release` and `extend`.
    functions: Functions,
}

#[derive(Debug)]
struct Functions {
    ddl: String,
    /// Whether the v1 functions exist.
    exist: String,
    /// Whether the v1 and v2 functions exist.
    exist_fifo: String,
    acquire: String,
    /// `acquire` that also stores the holder identity (`$4`; v5).
    acquire_holder: String,
    release: String,
    extend: String,
    fifo: Fifo,
}

/// The waiters' FIFO forms (v2), as statements or as calls of the server functions.
#[derive(Debug)]
struct Fifo {
    acquire: String,
    /// `acquire` that also stores the holder identity (`$7`; v5).
    acquire_holder: String,
    /// The release of a process with waiters of its own for the name (they queue).
    release: String,
    /// The release of a process without (statements only; the function does both).
    release_light: String,
    /// The deletion of dead listeners' rows that `release_light` reported.
    cleanup: String,
    leave: String,
    /// The listener's heartbeat (statements only; see [`beat_statement`]).
    beat: String,
}

/// The `NOTIFY` channel of the lock table `table`: `dlock_<table>` (a `.` becomes `_`),
/// lower-cased. A release (and an admin's force-release) notifies the hex of the lock name.
pub(crate) fn channel_of(table: &str) -> String {
    format!("dlock_{}", table.replace('.', "_")).to_ascii_lowercase()
}

/// For a durable grant or renewal's own transaction: `synchronous_commit` at least `on`, so its
/// commit waits for the WAL flush even where the role, the database or a caller's pool turned it
/// `off` (or `local`) by default (sql.md #7); `remote_write`, `on` and `remote_apply` are kept.
const FLUSH_WAIT: &str = "set_config('synchronous_commit', \
     CASE WHEN current_setting('synchronous_commit') IN ('off', 'local') THEN 'on' \
          ELSE current_setting('synchronous_commit') END, true)";

/// `set_config('synchronous_commit', 'off', true)`: for the statement's own (implicit)
/// transaction only, its commit does not wait for the WAL flush.
pub(crate) const NO_FLUSH_WAIT: &str = "set_config('synchronous_commit', 'off', true)";

/// `c.now` (a `timestamptz`) as µs since the Unix epoch, for the CTE `c` (`t.now` inside it).
const US_OF_NOW: &str = "(extract(epoch FROM t.now) * 1000000)::bigint";

/// The token of a grant (the token rule, README "Fencing tokens"): the larger of the next
/// number of the sequence `<table>_fence`, `floor` (the name's last token + 1) and the server's
/// clock `us` (µs since the Unix epoch, as Redis and MySQL mint theirs). When the clock won, the
/// sequence is moved forward to the token (where the role may, `UPDATE` on the sequence), so it
/// stays above every token handed out and a name whose row was deleted does not depend on the
/// clock alone. Evaluated only when a grant mints (a busy answer does not reach it).
pub(crate) fn mint(table: &str, floor: &str, us: &str) -> String {
    format!(
        "(SELECT CASE WHEN t.tok > t.v AND has_sequence_privilege('{table}_fence', 'UPDATE') \
                      THEN setval('{table}_fence', t.tok) ELSE t.tok END \
          FROM (SELECT s.v, GREATEST(s.v, {floor}, {us}) AS tok \
                FROM (SELECT nextval('{table}_fence') AS v) s) t)"
    )
}

/// The acquire and extend statements of `table`; `durable`: their commits wait for the WAL
/// flush (the default).
///
/// `v4`: this version's statements (the token floor of [`mint`]; queued rows carry a heartbeat);
/// without it, the bodies of the older functions, kept as they were for processes of older
/// versions.
///
/// `holder` (with `v4`; the v5 functions): a grant also stores the holder identity, `$4` (`$7`
/// in the FIFO form), in the `holder` column.
fn grant_statements(
    table: &str,
    durable: bool,
    fifo: bool,
    v4: bool,
    holder: bool,
) -> (String, String) {
    {
        // The FIFO form (v2): `$4` is the caller's channel (NULL: not queued), `$5`/`$6` its
        // listener's pid and start. A busy answer queues the process (keeping its place when it
        // is queued already); a grant takes it out of the queue.
        let (beat_col, beat_val) = if v4 { (", beat", ", c.now") } else { ("", "") };
        let queue = if fifo {
            format!(
                ", enq AS ( \
                   INSERT INTO {table}_waiters (name, channel, pid, started_us, since{beat_col}) \
                   SELECT $1, $4::text, $5::integer, $6::bigint, c.now{beat_val} FROM c \
                   WHERE $4::text IS NOT NULL \
                     AND NOT EXISTS (SELECT 1 FROM upd) AND NOT EXISTS (SELECT 1 FROM ins) \
                   ON CONFLICT (name, channel) DO NOTHING), \
                 deq AS ( \
                   DELETE FROM {table}_waiters w \
                   WHERE $4::text IS NOT NULL AND w.name = $1 AND w.channel = $4::text \
                     AND (EXISTS (SELECT 1 FROM upd) OR EXISTS (SELECT 1 FROM ins)))"
            )
        } else {
            String::new()
        };
        // Added to the `c` CTE of a statement whose commit need not wait for the disk.
        let grant_sc = if durable && v4 {
            format!(", {FLUSH_WAIT} AS sc")
        } else if durable {
            String::new()
        } else {
            format!(", {NO_FLUSH_WAIT} AS sc")
        };
        // A busy answer commits without waiting for the disk (the set_config in its branch):
        // it changed nothing, but a contender whose snapshot saw the row free and that reached
        // it just after another's grant committed has locked the row's new version for its
        // recheck (EvalPlanQual), which writes a lock record; with a durable commit every such
        // contender held the row through a WAL flush of its own, one after another, and the
        // holder's release queued behind them (measured: release call p50 25 ms under 16
        // contenders against a 6 ms commit). Grants stay durable.
        //
        // One statement, one reading of clock_timestamp() (the CTE `c`). The UPDATE takes over
        // a free or expired row, or re-enters; a busy row fails its WHERE and is neither locked
        // nor written (no WAL, no commit flush per busy contender, unlike ON CONFLICT DO UPDATE,
        // which locks the row before its WHERE). A takeover mints its token with nextval()
        // under the row lock, so tokens follow the grant order. The INSERT covers a name without
        // a row; ON CONFLICT DO NOTHING settles a race between two first users.
        let (c, mint_upd, mint_ins) = if v4 {
            (
                format!(
                    "c AS MATERIALIZED (SELECT t.now, {US_OF_NOW} AS us{grant_sc} \
                     FROM (SELECT clock_timestamp() AS now) t)"
                ),
                mint(table, "l.fence + 1", "c.us"),
                mint(table, "0", "c.us"),
            )
        } else {
            (
                format!("c AS MATERIALIZED (SELECT clock_timestamp() AS now{grant_sc})"),
                format!("nextval('{table}_fence')"),
                format!("nextval('{table}_fence')"),
            )
        };
        // The busy answer's remaining lease, read from the statement's snapshot. A row expired
        // there was granted to another under our feet (we waited for its row lock, and the
        // recheck failed): its new lease is not in the snapshot, so no remaining is told (the
        // caller assumes a ttl) rather than 0, which sent `wait = 0` callers straight back
        // (sql.md #9).
        let remaining = if v4 {
            "CASE WHEN l.expires_at > c.now \
                  THEN (extract(epoch FROM l.expires_at - c.now) * 1000000)::bigint END"
        } else {
            "GREATEST(0, (extract(epoch FROM l.expires_at - c.now) * 1000000)::bigint)"
        };
        let (holder_set, holder_col, holder_val) = if holder {
            let p = if fifo { "$7" } else { "$4" };
            (
                format!("holder = {p}::text, "),
                ", holder",
                format!(", {p}::text"),
            )
        } else {
            (String::new(), "", String::new())
        };
        let acquire = format!(
            "WITH {c}, \
             upd AS ( \
               UPDATE {table} l SET \
                 count = CASE WHEN l.owner = $2 AND l.expires_at > c.now THEN l.count + 1 ELSE 1 END, \
                 fence = CASE WHEN l.owner = $2 AND l.expires_at > c.now \
                              THEN l.fence ELSE {mint_upd} END, \
                 expires_at = CASE WHEN l.owner = $2 AND l.expires_at > c.now \
                                   THEN GREATEST(l.expires_at, c.now + $3 * interval '1 microsecond') \
                                   ELSE c.now + $3 * interval '1 microsecond' END, \
                 {holder_set}owner = $2 \
               FROM c \
               WHERE l.name = $1 AND (l.owner = $2 OR l.expires_at <= c.now) \
               RETURNING l.fence, l.count), \
             ins AS ( \
               INSERT INTO {table} (name, owner, count, fence, expires_at{holder_col}) \
               SELECT $1, $2, 1, {mint_ins}, c.now + $3 * interval '1 microsecond'{holder_val} FROM c \
               WHERE NOT EXISTS (SELECT 1 FROM upd) \
                 AND NOT EXISTS (SELECT 1 FROM {table} WHERE name = $1) \
               ON CONFLICT (name) DO NOTHING \
               RETURNING fence, count){queue} \
             SELECT fence, count, NULL::bigint, NULL FROM upd \
             UNION ALL SELECT fence, count, NULL::bigint, NULL FROM ins \
             UNION ALL \
             SELECT NULL, NULL, {remaining}, {NO_FLUSH_WAIT} \
               FROM {table} l, c \
               WHERE l.name = $1 AND NOT EXISTS (SELECT 1 FROM upd) AND NOT EXISTS (SELECT 1 FROM ins)"
        );
        let extend = extend_statement(table, &grant_sc, true);
        (acquire, extend)
    }
}

/// The extend statement: `grant_sc` as in [`grant_statements`]; `held_only`: a row the owner
/// released (count 0: freed, or kept by `hold_at_least`) is not extended (sql.md #5: a renewal
/// sent before the release but run after it re-held the row for a whole ttl). Without it, the
/// body of the `extend_v1` functions, kept as they were for processes of older versions.
fn extend_statement(table: &str, grant_sc: &str, held_only: bool) -> String {
    let held = if held_only { " AND l.count > 0" } else { "" };
    format!(
        "WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now{grant_sc}) \
         UPDATE {table} l SET expires_at = c.now + $3 * interval '1 microsecond' FROM c \
         WHERE l.name = $1 AND l.owner = $2{held} AND l.expires_at > c.now RETURNING 1"
    )
}

/// Whether the waiter row `w` belongs to a listening session that is still alive: a session
/// with its pid and start time (a row of another role's session whose start we may not read
/// counts as alive).
///
/// `v4`: besides, its heartbeat (`beat`, renewed every second by the listener while it is
/// queued) is at most [`BEAT_GRACE`] old, so a process that is alive for the server but does
/// nothing (paused, its host cut off, a reused pid we may not read) stops heading the queue
/// (sql.md #3). A row without a beat (queued by an older version) is judged by its session only.
pub(crate) fn alive(w: &str, v4: bool) -> String {
    let beat = if v4 {
        format!(
            " AND ({w}.beat IS NULL OR {w}.beat > clock_timestamp() - interval '{} milliseconds')",
            BEAT_GRACE.as_millis()
        )
    } else {
        String::new()
    };
    format!(
        "(EXISTS (SELECT 1 FROM pg_stat_get_activity({w}.pid) a \
                 WHERE a.backend_start IS NULL \
                    OR (extract(epoch FROM a.backend_start) * 1000000)::bigint = {w}.started_us){beat})"
    )
}

/// How often a listener renews the heartbeat of its process's queued rows.
const BEAT_EVERY: Duration = Duration::from_secs(1);
/// A queued row whose heartbeat is older than this is skipped (and deleted) by the next release
/// or leave of its name.
const BEAT_GRACE: Duration = Duration::from_secs(5);
/// A name free for this long while this process waits for it in the queue is tried at the next
/// heartbeat: the process the release woke is not acting (sql.md #3).
const STALL_AFTER: Duration = Duration::from_millis(500);

/// The CTEs that pick the process to wake for a name freed when the CTE `fr` has a row: the
/// oldest queued one (other than `$exclude`) whose listener is alive (`head`); the rows of dead
/// listeners met on the way are deleted (`dead`).
pub(crate) fn pick_head(table: &str, exclude: &str, v4: bool) -> String {
    let alive = alive("w", v4);
    format!(
        "live AS MATERIALIZED ( \
           SELECT w.channel, w.since, {alive} AS alive FROM {table}_waiters w, fr \
           WHERE w.name = $1{exclude}), \
         dead AS ( \
           DELETE FROM {table}_waiters w USING live \
           WHERE w.name = $1 AND w.channel = live.channel AND NOT live.alive), \
         head AS (SELECT channel FROM live WHERE alive ORDER BY since, channel LIMIT 1)"
    )
}

/// The heartbeat of a process's queued rows, sent by its listener every [`BEAT_EVERY`] while it
/// may be queued: `$1` the names, `$2` its channel. Returns each name with whether its row was
/// there (renewed) and whether the name has been free for [`STALL_AFTER`] at least (the process
/// the release woke is not acting: this one tries instead).
///
/// `advisory`: advisory-lock mode, where a name has no row to tell how long it has been free;
/// the third column is `false` there, and the mode's re-check (`Advisory::free_sql`) wakes a
/// waiter of a name it found free at two checks in a row instead.
pub(crate) fn beat_statement(table: &str, advisory: bool) -> String {
    if advisory {
        return format!(
            "WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now, {NO_FLUSH_WAIT} AS sc), \
             b AS (UPDATE {table}_waiters w SET beat = c.now FROM c \
                   WHERE w.name = ANY($1::bytea[]) AND w.channel = $2::text RETURNING w.name) \
             SELECT n.name, EXISTS (SELECT 1 FROM b WHERE b.name = n.name), false \
             FROM unnest($1::bytea[]) AS n(name), c"
        );
    }
    format!(
        "WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now, {NO_FLUSH_WAIT} AS sc), \
         b AS (UPDATE {table}_waiters w SET beat = c.now FROM c \
               WHERE w.name = ANY($1::bytea[]) AND w.channel = $2::text RETURNING w.name) \
         SELECT n.name, EXISTS (SELECT 1 FROM b WHERE b.name = n.name), \
                NOT EXISTS (SELECT 1 FROM {table} l WHERE l.name = n.name \
                            AND l.expires_at > c.now - interval '{} milliseconds') \
         FROM unnest($1::bytea[]) AS n(name), c",
        STALL_AFTER.as_millis()
    )
}

/// The statement by which a process leaves the queue of a name (v2): `$1` name, `$2` its
/// channel, `$3` pass: when the name is free, wake the next process in line (or every process,
/// on the release channel, when none is queued), as a release would have.
fn leave_statement(table: &str, channel: &str, v4: bool) -> String {
    let head = pick_head(table, " AND w.channel <> $2::text", v4);
    format!(
        "WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now, {NO_FLUSH_WAIT} AS sc), \
         d AS (DELETE FROM {table}_waiters WHERE name = $1 AND channel = $2::text), \
         fr AS MATERIALIZED ( \
           SELECT 1 AS f FROM c WHERE $3::boolean AND NOT EXISTS ( \
             SELECT 1 FROM {table} l WHERE l.name = $1 AND l.expires_at > c.now)), \
         {head} \
         SELECT pg_notify(coalesce((SELECT channel FROM head), '{channel}'), encode($1, 'hex'))::text \
         FROM fr"
    )
}

/// The start of every release statement: one reading of `clock_timestamp()` (the CTE `c`) and
/// the owner-checked decrement or free (the CTE `upd`, returning the holds left).
fn release_update(table: &str) -> String {
    format!(
        "WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now, {NO_FLUSH_WAIT} AS sc), \
         upd AS ( \
           UPDATE {table} l SET \
             count = CASE WHEN l.count = 1 OR $3 THEN 0 ELSE l.count - 1 END, \
             expires_at = CASE WHEN l.count = 1 OR $3 \
                               THEN c.now + coalesce($4::bigint, 0) * interval '1 microsecond' \
                               ELSE l.expires_at END \
           FROM c \
           WHERE l.name = $1 AND l.owner = $2 AND l.count > 0 AND l.expires_at > c.now \
           RETURNING l.count AS remaining)"
    )
}

/// The v2 release of a process without waiters of its own for the name (`$1`..`$4` as v1): the
/// v1 statement, but a freeing release notifies the oldest queued process whose listener is
/// alive (or the table's channel when none is), and a third column tells whether rows of dead
/// listeners were met (deleted separately). The queue is only read, one index probe when it is
/// empty: the uncontended release costs what v1 costs.
fn release_light_statement(table: &str, channel: &str, v4: bool) -> String {
    let upd = release_update(table);
    let (alive, dead) = (alive("q", v4), alive("d", v4));
    format!(
        "{upd} \
         SELECT remaining, \
                CASE WHEN remaining = 0 AND $4::bigint IS NULL THEN pg_notify(coalesce( \
                  (SELECT q.channel FROM {table}_waiters q WHERE q.name = $1 AND {alive} \
                   ORDER BY q.since, q.channel LIMIT 1), '{channel}'), encode($1, 'hex'))::text END, \
                CASE WHEN remaining = 0 AND $4::bigint IS NULL THEN EXISTS ( \
                  SELECT 1 FROM {table}_waiters d WHERE d.name = $1 AND NOT {dead}) \
                ELSE false END \
         FROM upd"
    )
}

/// Deletes the queue rows of `$1` whose listening session is gone.
fn cleanup_statement(table: &str, v4: bool) -> String {
    let alive = alive("d", v4);
    format!("DELETE FROM {table}_waiters d WHERE d.name = $1 AND NOT {alive}")
}

/// The body of `<table>_release_v2`: the light release (one statement, as v1), then, only when
/// needed, the deletion of dead listeners' rows and the queueing of the releasing process's own
/// waiters (`$5`..`$7`) at the back.
fn release_function_v2(table: &str, channel: &str, v4: bool) -> String {
    let light = release_light_statement(table, channel, v4);
    let cleanup = cleanup_statement(table, v4);
    let (beat_col, beat_val) = if v4 {
        (", beat", ", clock_timestamp()")
    } else {
        ("", "")
    };
    format!(
        "DECLARE v_rem integer; v_n text; v_dead boolean; \
         BEGIN \
           {light} INTO v_rem, v_n, v_dead; \
           IF NOT FOUND THEN RETURN; END IF; \
           IF v_dead THEN {cleanup}; END IF; \
           IF v_rem = 0 AND $5 IS NOT NULL THEN \
             INSERT INTO {table}_waiters (name, channel, pid, started_us, since{beat_col}) \
             VALUES ($1, $5, $6, $7, clock_timestamp(){beat_val}) ON CONFLICT (name, channel) DO NOTHING; \
           END IF; \
           r_remaining := v_rem; r_notified := v_n; RETURN NEXT; \
         END"
    )
}

/// The release statement of `table`, notifying on `channel`; `fifo` (v2): `$5`/`$6`/`$7` are
/// the releasing process's channel, pid and start when it has waiters of its own for the name
/// (NULL otherwise), which then queue behind the others; a freeing release wakes the oldest
/// live queued process on its own channel, or every process on `channel` when none is queued.
fn release_statement(table: &str, channel: &str, fifo: bool) -> String {
    let upd = release_update(table);
    if fifo {
        let head = pick_head(table, "", true);
        return format!(
            "{upd}, \
             fr AS MATERIALIZED (SELECT 1 AS f FROM upd WHERE remaining = 0 AND $4::bigint IS NULL), \
             enq AS ( \
               INSERT INTO {table}_waiters (name, channel, pid, started_us, since, beat) \
               SELECT $1, $5::text, $6::integer, $7::bigint, c.now, c.now FROM c, upd \
               WHERE $5::text IS NOT NULL AND upd.remaining = 0 \
               ON CONFLICT (name, channel) DO NOTHING), \
             {head} \
             SELECT remaining, CASE WHEN remaining = 0 AND $4::bigint IS NULL \
                                    THEN pg_notify(coalesce((SELECT channel FROM head), '{channel}'), \
                                                   encode($1, 'hex'))::text END \
             FROM upd"
        );
    }
    {
        // Freed rows are kept (count 0, expires_at = release time) rather than deleted: a
        // takeover then mints its token with nextval() under the row lock, so tokens follow the
        // grant order even when a statement that took its number earlier is overtaken.
        //
        // The release commits without waiting for its WAL flush (`synchronous_commit` off for
        // this one transaction; `set_config(.., true)` lasts until its commit, which reads it).
        // That takes one disk flush off every hand-off (the waiter's grant is the other), and
        // costs nothing in safety: a release that a server crash forgets leaves the row held
        // until its lease ends (as a crashed holder does), and any grant that follows it is
        // committed durably, which flushes the WAL up to and including this release first.
        let release = format!(
            "{upd} \
             SELECT remaining, CASE WHEN remaining = 0 AND $4::bigint IS NULL \
                                    THEN pg_notify('{channel}', encode($1, 'hex'))::text END \
             FROM upd"
        );
        release
    }
}

/// Version of the server functions' bodies, part of their names: a release that changes a body
/// changes the names, so processes of two versions never replace each other's functions. v1:
/// every release wakes every process (one local waiter each); v2 (the waiters' FIFO): the
/// acquire and release functions take the caller's channel and a release wakes the next queued
/// process only, plus `<table>_leave_v2`. v1 stays defined, for older processes.
const FUNCTIONS_VERSION: u32 = 1;
const FIFO_VERSION: u32 = 2;
/// v3: the extend functions do not extend a row the owner released (`count > 0`, sql.md #5).
const EXTEND_VERSION: u32 = 3;
/// v4: grants mint their token with the floor of [`mint`] (`<table>_acquire_v4`,
/// `<table>_acquire_nf_v4`, and the FIFO forms `<table>_acquire_q_v4`, `<table>_acquire_q_nf_v4`),
/// a busy answer tells no remaining lease from a stale snapshot, durable grants and renewals
/// (`<table>_extend_v4`, `<table>_extend_nf_v4`) raise `synchronous_commit` to at least `on`,
/// and the FIFO judges a queued process by its heartbeat too (`<table>_release_q_v4`,
/// `<table>_leave_v4`).
const TOKEN_VERSION: u32 = 4;
/// v5: the v4 grants that also store the holder identity in the table's `holder` column
/// (`<table>_acquire_v5`, `<table>_acquire_nf_v5`, `<table>_acquire_q_v5`,
/// `<table>_acquire_q_nf_v5`); called only where the table has the column.
const HOLDER_VERSION: u32 = 5;

/// The DDL of the PL/pgSQL functions `server_functions` calls (see
/// [`PostgresBackendBuilder::server_functions`]): `<table>_acquire_v1`, `<table>_acquire_nf_v1`
/// (no flush wait, for `synchronous_commit(false)`), `<table>_release_v1`, `<table>_extend_v1`
/// and `<table>_extend_nf_v1`, `_v3` (kept for older processes; this version calls the `_v4`
/// forms: `<table>_acquire_v4`, `<table>_extend_v4` and their `_nf` forms), each wrapping the
/// statement
/// the backend otherwise sends, and the
/// waiters' FIFO forms `<table>_acquire_v2`, `<table>_acquire_nf_v2`, `<table>_release_v2` and
/// `<table>_leave_v2` (which need the `<table>_waiters` table of [`postgres_schema_sql`]). Teams
/// that manage migrations apply it after [`postgres_schema_sql`]; idempotent (`CREATE OR
/// REPLACE`).
pub fn postgres_functions_sql(table: &str) -> Result<String, LockError> {
    check_table(table)?;
    Ok(functions(table, true).ddl)
}

/// The server functions of `table`, and the calls a backend sends: the `_nf` forms when its
/// grants do not wait for the flush (`durable` false).
fn functions(table: &str, durable: bool) -> Functions {
    let channel = channel_of(table);
    let v = FUNCTIONS_VERSION;
    let v2 = FIFO_VERSION;
    let (acquire_d1, extend_d) = grant_statements(table, true, false, false, false);
    let (acquire_nf1, extend_nf) = grant_statements(table, false, false, false, false);
    let (acquire_d, extend_d4) = grant_statements(table, true, false, true, false);
    let (acquire_nf, extend_nf4) = grant_statements(table, false, false, true, false);
    let v4 = TOKEN_VERSION;
    // The v1 extend functions as they were (older processes call them); this version calls
    // the v3 ones, which do not extend a released row.
    let nf_sc = format!(", {NO_FLUSH_WAIT} AS sc");
    let (extend_d1, extend_nf1) = (
        extend_statement(table, "", false),
        extend_statement(table, &nf_sc, false),
    );
    let v3 = EXTEND_VERSION;
    let release = release_statement(table, &channel, false);
    let (acquire_d2, _) = grant_statements(table, true, true, false, false);
    let (acquire_nf2, _) = grant_statements(table, false, true, false, false);
    let release2 = release_function_v2(table, &channel, false);
    let leave2 = leave_statement(table, &channel, false);
    let (acquire_d4, _) = grant_statements(table, true, true, true, false);
    let (acquire_nf4, _) = grant_statements(table, false, true, true, false);
    // v5: the v4 grants that also store the holder identity.
    let (acquire_d5, _) = grant_statements(table, true, false, true, true);
    let (acquire_nf5, _) = grant_statements(table, false, false, true, true);
    let (acquire_q_d5, _) = grant_statements(table, true, true, true, true);
    let (acquire_q_nf5, _) = grant_statements(table, false, true, true, true);
    let v5 = HOLDER_VERSION;
    let grant_args_h = "bytea, text, bigint, text";
    let grant_args2_h = "bytea, text, bigint, text, integer, bigint, text";
    let release4 = release_function_v2(table, &channel, true);
    let leave4 = leave_statement(table, &channel, true);
    // Result columns are named r_*, unlike any table column, so no name in the bodies is
    // ambiguous between a column and an output parameter.
    let grant_args = "bytea, text, bigint";
    let grant_args2 = "bytea, text, bigint, text, integer, bigint";
    let acquire_ret = "r_fence bigint, r_count integer, r_remaining_us bigint, r_sc text";
    let release_ret = "r_remaining integer, r_notified text";
    let release_args2 = "bytea, text, boolean, bigint, text, integer, bigint";
    // Older versions' functions first (kept as they were, for their processes), then this
    // version's.
    let defs: [(&str, u32, &str, &str, &str); 23] = [
        ("acquire", v, grant_args, acquire_ret, &acquire_d1),
        ("acquire_nf", v, grant_args, acquire_ret, &acquire_nf1),
        (
            "release",
            v,
            "bytea, text, boolean, bigint",
            release_ret,
            &release,
        ),
        ("extend", v, grant_args, "r_one integer", &extend_d1),
        ("extend_nf", v, grant_args, "r_one integer", &extend_nf1),
        ("extend", v3, grant_args, "r_one integer", &extend_d),
        ("extend_nf", v3, grant_args, "r_one integer", &extend_nf),
        ("acquire", v2, grant_args2, acquire_ret, &acquire_d2),
        ("acquire_nf", v2, grant_args2, acquire_ret, &acquire_nf2),
        (
            "release",
            v2,
            "bytea, text, boolean, bigint, text, integer, bigint",
            release_ret,
            &release2,
        ),
        (
            "leave",
            v2,
            "bytea, text, boolean",
            "r_notified text",
            &leave2,
        ),
        ("acquire", v4, grant_args, acquire_ret, &acquire_d),
        ("acquire_nf", v4, grant_args, acquire_ret, &acquire_nf),
        ("extend", v4, grant_args, "r_one integer", &extend_d4),
        ("extend_nf", v4, grant_args, "r_one integer", &extend_nf4),
        ("acquire_q", v4, grant_args2, acquire_ret, &acquire_d4),
        ("acquire_q_nf", v4, grant_args2, acquire_ret, &acquire_nf4),
        ("release_q", v4, release_args2, release_ret, &release4),
        (
            "leave",
            v4,
            "bytea, text, boolean",
            "r_notified text",
            &leave4,
        ),
        ("acquire", v5, grant_args_h, acquire_ret, &acquire_d5),
        ("acquire_nf", v5, grant_args_h, acquire_ret, &acquire_nf5),
        ("acquire_q", v5, grant_args2_h, acquire_ret, &acquire_q_d5),
        (
            "acquire_q_nf",
            v5,
            grant_args2_h,
            acquire_ret,
            &acquire_q_nf5,
        ),
    ];
    let ddl = defs
        .iter()
        .map(|(name, ver, args, ret, body)| {
            // A body that is not one statement is a whole PL/pgSQL block already.
            let block = if body.starts_with("DECLARE") {
                body.to_string()
            } else {
                format!("BEGIN RETURN QUERY {body}; END")
            };
            format!(
                "CREATE OR REPLACE FUNCTION {table}_{name}_v{ver}({args}) RETURNS TABLE ({ret}) \
                 LANGUAGE plpgsql AS $dlock$ {block} $dlock$;\n"
            )
        })
        .collect();
    let exist_of = |want: &dyn Fn(u32) -> bool| {
        let e = defs
            .iter()
            .filter(|(_, ver, _, _, _)| want(*ver))
            .map(|(name, ver, args, _, _)| {
                format!("to_regprocedure('{table}_{name}_v{ver}({args})') IS NOT NULL")
            })
            .collect::<Vec<_>>()
            .join(" AND ");
        format!("SELECT {e}")
    };
    let nf = if durable { "" } else { "_nf" };
    Functions {
        ddl,
        exist: exist_of(&|ver| ver == v || ver == v4 || ver == v5),
        exist_fifo: exist_of(&|_| true),
        acquire: format!("SELECT * FROM {table}_acquire{nf}_v{v4}($1, $2, $3)"),
        acquire_holder: format!("SELECT * FROM {table}_acquire{nf}_v{v5}($1, $2, $3, $4)"),
        release: format!("SELECT * FROM {table}_release_v{v}($1, $2, $3, $4)"),
        extend: format!("SELECT * FROM {table}_extend{nf}_v{v4}($1, $2, $3)"),
        fifo: Fifo {
            acquire: format!("SELECT * FROM {table}_acquire_q{nf}_v{v4}($1, $2, $3, $4, $5, $6)"),
            acquire_holder: format!(
                "SELECT * FROM {table}_acquire_q{nf}_v{v5}($1, $2, $3, $4, $5, $6, $7)"
            ),
            release: format!("SELECT * FROM {table}_release_q_v{v4}($1, $2, $3, $4, $5, $6, $7)"),
            release_light: String::new(),
            cleanup: String::new(),
            leave: format!("SELECT * FROM {table}_leave_v{v4}($1, $2, $3)"),
            beat: String::new(),
        },
    }
}

impl Sql {
    /// `durable`: grants and renewals wait for their commit's WAL flush (the default).
    fn new(table: &str, durable: bool) -> Result<Sql, LockError> {
        let schema = postgres_schema_sql(table)?;
        let channel = channel_of(table);
        let (acquire, extend) = grant_statements(table, durable, false, true, false);
        let release = release_statement(table, &channel, false);
        let fifo = Fifo {
            acquire: grant_statements(table, durable, true, true, false).0,
            acquire_holder: grant_statements(table, durable, true, true, true).0,
            release: release_statement(table, &channel, true),
            release_light: release_light_statement(table, &channel, true),
            cleanup: cleanup_statement(table, true),
            leave: leave_statement(table, &channel, true),
            beat: beat_statement(table, false),
        };
        let functions = functions(table, durable);
        // Rows idle this long can be deleted: a statement that took a sequence number before the
        // deletion is long dead (statement_timeout), so tokens still follow the grant order.
        let sweep = format!(
            "DELETE FROM {table} WHERE expires_at < clock_timestamp() - interval '5 minutes'"
        );
        Ok(Sql {
            acquire,
            acquire_holder: grant_statements(table, durable, false, true, true).0,
            holder_exists: format!(
                "SELECT EXISTS (SELECT 1 FROM pg_attribute \
                 WHERE attrelid = to_regclass('{table}') AND attname = 'holder' \
                   AND NOT attisdropped)"
            ),
            release,
            released_by: format!("SELECT owner = $2 AND count = 0 FROM {table} WHERE name = $1"),
            extend,
            sweep,
            schema,
            // With its heartbeat column (a table of an older version has none: no FIFO).
            waiters_exist: format!(
                "SELECT EXISTS (SELECT 1 FROM pg_attribute \
                 WHERE attrelid = to_regclass('{table}_waiters') AND attname = 'beat' \
                   AND NOT attisdropped)"
            ),
            channel,
            fifo,
            functions,
        })
    }
}

/// Settings of a [`PostgresBackend`]; build one with [`PostgresBackend::builder`] or
/// [`PostgresBackend::builder_with_pool`].
#[derive(Clone)]
pub struct PostgresBackendBuilder {
    url: Option<String>,
    pool: Option<Pool>,
    listen_config: Option<tokio_postgres::Config>,
    table: String,
    pool_size: usize,
    op_timeout: Duration,
    connect_timeout: Duration,
    statement_timeout: Duration,
    create_schema: bool,
    advisory: bool,
    synchronous_commit: bool,
    prepared_statements: bool,
    server_functions: Option<bool>,
    fifo_wakeups: bool,
    tls_roots: Vec<Vec<u8>>,
}

impl fmt::Debug for PostgresBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresBackendBuilder")
            .field("url", &self.url.as_deref().map(redact_url))
            .field("own_pool", &self.pool.is_none())
            .field("table", &self.table)
            .field("pool_size", &self.pool_size)
            .field("op_timeout", &self.op_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("create_schema", &self.create_schema)
            .field("advisory", &self.advisory)
            .field("synchronous_commit", &self.synchronous_commit)
            .field("prepared_statements", &self.prepared_statements)
            .field("server_functions", &self.server_functions)
            .field("fifo_wakeups", &self.fifo_wakeups)
            .finish_non_exhaustive()
    }
}

impl PostgresBackendBuilder {
    fn defaults() -> Self {
        PostgresBackendBuilder {
            url: None,
            pool: None,
            listen_config: None,
            table: DEFAULT_TABLE.to_string(),
            pool_size: 8,
            op_timeout: Duration::from_secs(3),
            connect_timeout: Duration::from_secs(2),
            statement_timeout: Duration::from_secs(2),
            create_schema: true,
            advisory: false,
            synchronous_commit: true,
            prepared_statements: false,
            server_functions: None,
            fifo_wakeups: true,
            tls_roots: Vec::new(),
        }
    }

    /// Advisory-lock mode: locks are `pg_try_advisory_lock` on one dedicated session of this
    /// backend instead of rows (see [`crate::postgres_advisory_key`] for the key and its collision
    /// story). A lock dies with the session; holders hear `lost()` at their next renewal.
    /// Refused with [`LockError::Config`] behind a transaction-mode pooler (detected at connect
    /// by two `pg_backend_pid()` calls that disagree). The table's sequence still mints the
    /// fencing tokens, `NOTIFY` still wakes waiters, and waiting processes queue in the
    /// waiters' FIFO as in the lock-table mode (see [`PostgresBackendBuilder::fifo_wakeups`]).
    /// Needs the connection settings (a URL, or [`PostgresBackendBuilder::listen_config`] with
    /// a caller's pool).
    pub fn advisory(mut self, on: bool) -> Self {
        self.advisory = on;
        self
    }

    /// Whether grants and renewals wait for their commit's WAL flush (default true). Releases
    /// never wait for it: a release that a server crash forgets only leaves the row held until
    /// its lease ends, and the grant that follows it flushes it. With `false`, a hand-off costs
    /// no disk flush at all (a few hundred µs instead of one `fsync`), but a server **crash**
    /// (not a client crash or a lost connection) can forget the grants and renewals of its last
    /// moments (up to `3 × wal_writer_delay`, 600 ms by default): another owner can then be
    /// granted while the forgotten holder's guard is valid until its next renewal (it hears
    /// `lost()` then, S4), and a forgotten grant's fencing token can be handed out again. The
    /// trade Redis makes with `appendfsync everysec`; leave it on where tokens must never repeat.
    pub fn synchronous_commit(mut self, on: bool) -> Self {
        self.synchronous_commit = on;
        self
    }

    /// Whether the acquire, release and extend statements are prepared once per connection
    /// (named statements, cached by deadpool-postgres) instead of sent unnamed and planned at
    /// every call (default false). Planning the acquire statement costs the server about 0.3 ms
    /// of CPU, which every contender woken by a release pays: with 16 contenders on 2 cores this
    /// was most of a hand-off (see BENCHMARKS.md: p50 about halved). **Only directly to
    /// PostgreSQL or behind a session-mode pooler**: behind a transaction-mode pooler (PgBouncer
    /// before 1.21, or without `max_prepared_statements`) a named statement can be looked up in
    /// another server session, where it may be missing or be another client's statement of the
    /// same name; the default (unnamed statements) works behind any pooler.
    pub fn prepared_statements(mut self, on: bool) -> Self {
        self.prepared_statements = on;
        self
    }

    /// Whether the acquire, release and extend statements run inside PL/pgSQL functions of the
    /// table's schema ([`postgres_functions_sql`]) instead of being sent whole. PL/pgSQL plans
    /// a function's statements once per server session and keeps the plans, so the planning
    /// that [`PostgresBackendBuilder::prepared_statements`] saves is saved here too, and this
    /// works **behind any pooler**: a call is an unnamed
    /// `SELECT * FROM <table>_acquire_v1($1, $2, $3)`, valid in whatever server session runs it. The
    /// statements and their guarantees are the same.
    ///
    /// * Not called (the default): the functions are used when they exist or can be created
    ///   at connect (with the table, unless `create_schema(false)`); otherwise the statements
    ///   are sent whole, with an `info` event saying so.
    /// * `true`: required; connect fails with [`LockError::Config`] when they are missing and
    ///   cannot be created (apply [`postgres_functions_sql`] in your migrations).
    /// * `false`: never; the statements are sent whole.
    pub fn server_functions(mut self, on: bool) -> Self {
        self.server_functions = Some(on);
        self
    }

    /// Whether waiting processes queue in the table `<table>_waiters` so that a release wakes
    /// only the process that has waited longest (default true; see "PostgreSQL waiting" in
    /// docs/postgres.md), in both modes. Off, or when the waiters table is missing
    /// (`create_schema(false)` with an older schema), or when the listener cannot keep one
    /// server session (a transaction-mode pooler), every release wakes one waiter in every
    /// process (the v1 behaviour).
    pub fn fifo_wakeups(mut self, on: bool) -> Self {
        self.fifo_wakeups = on;
        self
    }

    /// Trusts the CA certificate(s) in `pem` for TLS connections, besides the system's trust
    /// store (feature `postgres-tls`). TLS itself is asked for by the URL: `sslmode=require`
    /// (or `verify-ca` / `verify-full`: with rustls the server's certificate and name are always
    /// verified), and `sslrootcert=/path/ca.pem` adds a CA file as this method does. Without
    /// `sslmode=require|verify-*` (libpq's default `prefer`) the connection is plain text.
    #[cfg(feature = "postgres-tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres-tls")))]
    pub fn tls_root_cert(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_roots.push(pem.into());
        self
    }

    /// The lock table: `table` or `schema.table` (default `dlock_locks`). Its fencing sequence
    /// is `<table>_fence`; its release channel `dlock_<table>`.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Connections in the backend's own pool (default 8; the listening connection is extra).
    pub fn pool_size(mut self, n: usize) -> Self {
        self.pool_size = n.max(1);
        self
    }

    /// Client-side bound of every call (pool checkout + statement), after which the call fails
    /// with [`LockError::Backend`] (default 3 s).
    pub fn op_timeout(mut self, t: Duration) -> Self {
        self.op_timeout = t;
        self
    }

    /// How long one connection attempt may take (default 2 s).
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t;
        self
    }

    /// Server-side `statement_timeout` of the backend's own connections (default 2 s; not
    /// applied to a pool passed in by the caller).
    pub fn statement_timeout(mut self, t: Duration) -> Self {
        self.statement_timeout = t;
        self
    }

    /// Whether to create the table and sequence when missing (default true). Turn it off when
    /// migrations apply [`postgres_schema_sql`] and the role may not create tables.
    pub fn create_schema(mut self, on: bool) -> Self {
        self.create_schema = on;
        self
    }

    /// For a backend on a caller's pool: the connection settings of the one extra connection
    /// that `LISTEN`s for releases. Without it, waiters wake when the holder's lease ends.
    pub fn listen_config(mut self, cfg: tokio_postgres::Config) -> Self {
        self.listen_config = Some(cfg);
        self
    }

    /// The URL's libpq TLS parameters that tokio-postgres does not parse: `sslmode=verify-ca` /
    /// `verify-full` become `require` (rustls always verifies), `sslrootcert=path` is taken out
    /// and returned.
    fn tls_params(url: &str) -> (String, Option<String>) {
        let Some((base, query)) = url.split_once('?') else {
            return (url.to_string(), None);
        };
        let mut root = None;
        let mut kept = Vec::new();
        for kv in query.split('&') {
            match kv.split_once('=') {
                Some(("sslmode", "verify-ca" | "verify-full")) => kept.push("sslmode=require"),
                Some(("sslrootcert", path)) => root = Some(path.to_string()),
                _ => kept.push(kv),
            }
        }
        let url = if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        (url, root)
    }

    /// The connector for the backend's own connections.
    pub(crate) fn connector(&self, cfg: &tokio_postgres::Config) -> Result<Connector, LockError> {
        let url = self.url.as_deref().unwrap_or_default();
        let (_, root_file) = Self::tls_params(url);
        #[cfg(feature = "postgres-tls")]
        {
            // TLS only when asked for: `prefer` (the default) would try it and fail where the
            // server's certificate is not trusted (Debian's snakeoil), where libpq's `prefer`
            // does not verify. So `prefer` and `disable` connect in plain text.
            if cfg.get_ssl_mode() != tokio_postgres::config::SslMode::Require {
                return Ok(Connector::Plain);
            }
            let mut roots = rustls::RootCertStore::empty();
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            let mut pems = self.tls_roots.clone();
            if let Some(path) = root_file {
                pems.push(std::fs::read(&path).map_err(|e| {
                    LockError::Config(format!("PostgreSQL sslrootcert {path}: {e}"))
                })?);
            }
            for pem in &pems {
                use rustls::pki_types::{CertificateDer, pem::PemObject};
                for c in CertificateDer::pem_slice_iter(pem) {
                    let c = c.map_err(|e| {
                        LockError::Config(format!("PostgreSQL TLS root certificate: {e}"))
                    })?;
                    roots.add(c).map_err(|e| {
                        LockError::Config(format!("PostgreSQL TLS root certificate: {e}"))
                    })?;
                }
            }
            let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .map_err(|e| LockError::Config(format!("PostgreSQL TLS: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
            Ok(Connector::Rustls(
                tokio_postgres_rustls::MakeRustlsConnect::new(tls),
            ))
        }
        #[cfg(not(feature = "postgres-tls"))]
        {
            if cfg.get_ssl_mode() == tokio_postgres::config::SslMode::Require
                || root_file.is_some()
                || !self.tls_roots.is_empty()
            {
                return Err(LockError::Config(
                    "PostgreSQL TLS (sslmode=require) needs dlock's `postgres-tls` feature".into(),
                ));
            }
            Ok(Connector::Plain)
        }
    }

    pub(crate) fn pg_config(&self) -> Result<tokio_postgres::Config, LockError> {
        let (url, _) = Self::tls_params(self.url.as_deref().unwrap_or_default());
        let url = url.as_str();
        let mut cfg: tokio_postgres::Config = url.parse().map_err(|e| {
            LockError::Config(format!("invalid PostgreSQL URL {}: {e}", redact_url(url)))
        })?;
        if cfg.get_connect_timeout().is_none() {
            cfg.connect_timeout(self.connect_timeout);
        }
        let st = format!(
            "-c statement_timeout={}",
            self.statement_timeout.as_millis().max(1)
        );
        // The server ends a session whose client died or is cut off (sql.md #4b) within about
        // 25 s: keepalive probes after 10 s of silence, every 5 s, 3 unanswered
        // ones end it (25 s); data it sent that stays unacknowledged for 20 s ends it too
        // (tcp_user_timeout, PostgreSQL 12+). Without these the server's defaults
        // (tcp_keepalives_idle 7200 s here) kept an advisory session's locks for up to ~2 h.
        // Options of the URL come after, so they win.
        let ka = "-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 \
                  -c tcp_keepalives_count=3 -c tcp_user_timeout=20000";
        let options = match cfg.get_options() {
            Some(o) if !o.is_empty() => format!("{ka} {o} {st}"),
            _ => format!("{ka} {st}"),
        };
        cfg.options(options);
        // The same on this side: a dead server or a cut-off path is noticed by the client
        // within the same bound (unless the URL sets its own).
        let url_has = |k: &str| url.contains(k);
        if !url_has("keepalives") {
            cfg.keepalives(true)
                .keepalives_idle(Duration::from_secs(10))
                .keepalives_interval(Duration::from_secs(5))
                .keepalives_retries(3);
        }
        if !url_has("tcp_user_timeout") {
            cfg.tcp_user_timeout(Duration::from_secs(20));
        }
        cfg.application_name("dlock");
        Ok(cfg)
    }

    /// Checks the settings, connects, and creates the table when missing (unless turned off),
    /// so a wrong address, password or table fails here.
    ///
    /// A URL may name the table and the mode as the CLI's does: `?dlock_table=<table>` and
    /// `?dlock_mode=table|advisory` (taken out before the driver sees the URL).
    pub async fn connect(mut self) -> Result<PostgresBackend, LockError> {
        if let Some(url) = self.url.take() {
            let p = super::split_dlock_params(&url)
                .map_err(|e| LockError::Config(format!("PostgreSQL URL: {e}")))?;
            self.table = super::table_from_url(&self.table, p.table)?;
            match p.mode.as_deref() {
                None | Some("table") if !self.advisory => {}
                None | Some("advisory") => self.advisory = true,
                Some("table") => {
                    return Err(LockError::Config(
                        "the URL's dlock_mode=table and the builder's advisory(true) disagree; keep one"
                            .into(),
                    ));
                }
                Some(m) => {
                    return Err(LockError::Config(format!(
                        "dlock_mode={m}: PostgreSQL modes are `table` and `advisory`"
                    )));
                }
            }
            self.url = Some(p.url);
        }
        check_table(&self.table)?;
        let sql = Sql::new(&self.table, self.synchronous_commit)?;
        let connector = match (&self.url, &self.listen_config) {
            (Some(_), _) => self.connector(&self.pg_config()?)?,
            // A caller's pool: its connections are the caller's; the listening connection
            // follows `listen_config`'s sslmode only with the feature's system roots.
            (None, Some(cfg)) => self.connector(cfg)?,
            (None, None) => Connector::Plain,
        };
        let (pool, listen_config, url) = match self.pool.clone() {
            Some(pool) => (
                pool,
                self.listen_config.clone(),
                "<caller's pool>".to_string(),
            ),
            None => {
                let cfg = self.pg_config()?;
                let mgr_config = ManagerConfig {
                    recycling_method: RecyclingMethod::Fast,
                };
                let mgr = match &connector {
                    Connector::Plain => Manager::from_config(cfg.clone(), NoTls, mgr_config),
                    #[cfg(feature = "postgres-tls")]
                    Connector::Rustls(t) => {
                        Manager::from_config(cfg.clone(), t.clone(), mgr_config)
                    }
                };
                let pool = Pool::builder(mgr)
                    .max_size(self.pool_size)
                    .runtime(Runtime::Tokio1)
                    .wait_timeout(Some(self.op_timeout))
                    .create_timeout(Some(self.connect_timeout))
                    .recycle_timeout(Some(self.op_timeout))
                    .build()
                    .map_err(|e| LockError::Config(format!("PostgreSQL pool: {e}")))?;
                (
                    pool,
                    Some(cfg),
                    redact_url(self.url.as_deref().unwrap_or_default()),
                )
            }
        };
        let advisory = if self.advisory {
            let Some(cfg) = listen_config.clone() else {
                return Err(LockError::Config(
                    "PostgreSQL advisory-lock mode needs connection settings: a URL, or listen_config with a caller's pool".into(),
                ));
            };
            let a = Advisory::new(
                cfg,
                connector.clone(),
                &self.table,
                sql.channel.clone(),
                self.op_timeout,
                self.connect_timeout,
            )?;
            // Opens the session now: a pooler in between is refused here.
            a.start().await?;
            Some(Arc::new(a))
        } else {
            None
        };
        let cancel = CancellationToken::new();
        let (ready_tx, ready_rx) = tokio_watch::channel(false);
        let backend = PostgresBackend {
            inner: Arc::new_cyclic(|weak: &std::sync::Weak<Inner>| Inner {
                waiters: {
                    let weak = weak.clone();
                    WaitQueues::with_on_empty_woken(Box::new(move |name: &str, woken: bool| {
                        if let Some(inner) = weak.upgrade() {
                            PostgresBackend { inner }.queue_emptied(name, woken);
                        }
                    }))
                },
                queueing: Arc::default(),
                pool,
                listen_config,
                sql,
                url,
                table: self.table.clone(),
                op_timeout: self.op_timeout,
                connect_timeout: self.connect_timeout,
                listener: Mutex::new(None),
                connector,
                rechecker: Mutex::new(None),
                advisory,
                ready_tx: Arc::new(ready_tx),
                ready_rx,
                cancel,
                releases: std::sync::atomic::AtomicU64::new(0),
                prepared: self.prepared_statements,
                functions: std::sync::atomic::AtomicBool::new(false),
                holder: std::sync::atomic::AtomicBool::new(false),
                tries: Mutex::default(),
                unconfirmed: super::Unconfirmed::default(),
                statement_timeout: self.statement_timeout,
                prims: prims::Prims::new(&self.table),
            }),
        };
        if self.create_schema {
            backend.create_schema().await?;
        } else {
            backend.ping().await?;
        }
        backend.warn_if_spelled_otherwise().await;
        if !self.advisory {
            let holder = backend.holder_column_exists().await?;
            if !holder {
                tracing::info!(
                    table = %self.table,
                    "dlock: PostgreSQL lock table without the holder column; holders are not named (apply dlock::postgres_schema_sql to add it)"
                );
            }
            backend
                .inner
                .holder
                .store(holder, std::sync::atomic::Ordering::Relaxed);
        }
        let mut fifo = self.fifo_wakeups
            && backend.inner.listen_config.is_some()
            && backend.waiters_table_exists().await?;
        if !self.advisory && self.server_functions != Some(false) {
            let mut r = backend.ensure_functions(self.create_schema, fifo).await;
            if r.is_err() && fifo {
                // The v1 functions alone (migrations of an older version): keep them, without
                // the FIFO, rather than plan every statement.
                if backend.ensure_functions(false, false).await.is_ok() {
                    tracing::info!(
                        table = %self.table,
                        "dlock: PostgreSQL server functions of the waiters' FIFO (v2) missing; every release wakes every process (apply dlock::postgres_functions_sql for the FIFO)"
                    );
                    fifo = false;
                    r = Ok(());
                }
            }
            match r {
                Ok(()) => backend
                    .inner
                    .functions
                    .store(true, std::sync::atomic::Ordering::Relaxed),
                Err(e) if self.server_functions == Some(true) => return Err(e),
                Err(e) => tracing::info!(
                    table = %self.table,
                    error = %e,
                    "dlock: PostgreSQL server functions unavailable; sending the statements whole (planned at every call)"
                ),
            }
        }
        backend
            .inner
            .queueing
            .fifo
            .store(fifo, std::sync::atomic::Ordering::Relaxed);
        Ok(backend)
    }
}

/// Locks in a PostgreSQL table, shared by every process that uses the same database and table.
///
/// Cheap to clone.
///
/// * **Rows**: one per lock name (see [`postgres_schema_sql`]); a release keeps its row as free
///   (count 0) so the next grant mints its token under the row lock; rows free for more than
///   five minutes are swept now and then (every 256th release of a backend), and an
///   expired row is taken over by the next acquire, so no cleaner is needed for correctness.
/// * **Clock**: expiry is decided by `clock_timestamp()` inside each statement; the client's
///   wall clock is never read. The holder's own monotonic deadline (the guard) still applies.
/// * **One round trip** per acquire (one statement: `UPDATE … WHERE <free, expired or mine>
///   RETURNING`, else `INSERT … ON CONFLICT DO NOTHING RETURNING`),
///   release (owner-checked decrement, or free + `pg_notify` at zero) and extend; each is one
///   autocommit statement on a pooled connection, never inside the caller's transaction.
/// * **Fencing tokens** come from the sequence `<table>_fence`, so they strictly increase per
///   name across releases, expiries and rows deleted behind the backend's back.
/// * **Bounded**: every call (pool checkout + statement) is bounded by `op_timeout`
///   client-side and `statement_timeout` server-side; overruns are [`LockError::Backend`].
/// * **Waiting**: one extra connection per backend `LISTEN`s on `dlock_<table>`; a release's
///   `NOTIFY` wakes one local waiter of that name. While the listener is down, waiters fall back
///   to the holder's remaining lease as their timer; when it reconnects every waiter retries.
#[derive(Clone)]
pub struct PostgresBackend {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    listen_config: Option<tokio_postgres::Config>,
    sql: Sql,
    url: String,
    table: String,
    op_timeout: Duration,
    connect_timeout: Duration,
    waiters: Arc<WaitQueues>,
    /// The waiters' FIFO: this process's place in the database's queues.
    queueing: Arc<Queueing>,
    listener: Mutex<Option<JoinHandle<()>>>,
    connector: Connector,
    rechecker: Mutex<Option<JoinHandle<()>>>,
    advisory: Option<Arc<Advisory>>,
    ready_tx: Arc<tokio_watch::Sender<bool>>,
    ready_rx: tokio_watch::Receiver<bool>,
    cancel: CancellationToken,
    releases: std::sync::atomic::AtomicU64,
    /// Named statements prepared once per connection (see `prepared_statements`).
    prepared: bool,
    /// Calls of the server functions instead of the statements (see `server_functions`); set
    /// once at connect.
    functions: std::sync::atomic::AtomicBool,
    /// Grants store the holder identity (the table has the `holder` column; see
    /// [`HOLDER_VERSION`]).
    holder: std::sync::atomic::AtomicBool,
    /// Acquire statements whose reply has not been read (yet), per (name, owner): the give-back
    /// of such an owner is ordered behind its try (see [`TrySlot`]).
    tries: Mutex<std::collections::HashMap<(String, String), Arc<TrySlot>>>,
    /// Releases whose answer was not read (see [`super::Unconfirmed`]).
    unconfirmed: super::Unconfirmed,
    /// How long the server lets one statement run (its `statement_timeout`; for a caller's pool,
    /// the builder's value is assumed).
    statement_timeout: Duration,
    /// Leader records, semaphores and read-write locks: their statements and waiter queues.
    prims: prims::Prims,
}

/// An acquire statement of one owner, from just before it is sent until its reply is read. A
/// try whose reply is never read (its future dropped, an `op_timeout`, a broken connection) may
/// still be running on the server, and a grant that is committing is invisible to another
/// session: a give-back on another pooled connection would answer `NotOwner` and the grant
/// would then commit for nobody (sql.md #1). So the abandoned try's connection is kept here,
/// out of the pool, and the give-back of that owner is sent on it: one connection runs its
/// statements in order, so the release runs after the try whatever it did.
struct TrySlot {
    state: Mutex<TryState>,
    /// `true` once the try is no longer in flight (answered or abandoned).
    settled: tokio_watch::Sender<bool>,
}

enum TryState {
    InFlight,
    /// The reply was not read. `conn`: the connection the statement was sent on (`None`: it was
    /// never sent, the try was dropped while waiting for a connection); `at`: when.
    Abandoned {
        conn: Option<Box<deadpool_postgres::Object>>,
        at: std::time::Instant,
    },
}

/// How long an abandoned try's connection is kept out of the pool for its owner's give-back
/// (the core sends that at once; it takes the connection out of the slot).
const ABANDONED_TRY_KEPT: Duration = Duration::from_secs(10);

/// Drop guard of an acquire statement in flight (see [`TrySlot`]).
struct TryGuard<'a> {
    inner: &'a Arc<Inner>,
    key: (String, String),
    slot: Arc<TrySlot>,
    conn: Option<deadpool_postgres::Object>,
    answered: bool,
}

impl Drop for TryGuard<'_> {
    fn drop(&mut self) {
        if self.answered {
            let mut m = locked(&self.inner.tries);
            if m.get(&self.key).is_some_and(|s| Arc::ptr_eq(s, &self.slot)) {
                m.remove(&self.key);
            }
        } else {
            let conn = self.conn.take().map(Box::new);
            let kept = conn.is_some();
            *locked(&self.slot.state) = TryState::Abandoned {
                conn,
                at: std::time::Instant::now(),
            };
            // The connection is kept out of the pool for the give-back, but not for ever: a
            // try whose owner is never given back (a re-entry, which the core does not give
            // back; no runtime left) would take a pooled connection for good.
            let (slot, key) = (self.slot.clone(), self.key.clone());
            let free = move |inner: Option<Arc<Inner>>| {
                if let TryState::Abandoned { conn, .. } = &mut *locked(&slot.state) {
                    drop(conn.take());
                }
                if let Some(inner) = inner {
                    let mut m = locked(&inner.tries);
                    if m.get(&key).is_some_and(|s| Arc::ptr_eq(s, &slot)) {
                        m.remove(&key);
                    }
                }
            };
            match tokio::runtime::Handle::try_current() {
                Ok(rt) if kept => {
                    let weak = Arc::downgrade(self.inner);
                    rt.spawn(async move {
                        tokio::time::sleep(ABANDONED_TRY_KEPT).await;
                        free(weak.upgrade());
                    });
                }
                Ok(_) => {}
                Err(_) => free(Some(self.inner.clone())),
            }
        }
        self.slot.settled.send_replace(true);
    }
}

/// After a try that may have queued this process (see [`PostgresBackend::queue_as`]): a grant
/// took it out of the queue; and when the local waiters that made it queue all left while it ran
/// (it was another caller's first try, or it was dropped unread at a deadline), nobody here would
/// delete its row or forget the name, so it leaves now (a waiter that registers next queues
/// again, after the leave; a row committed after the leave is deleted by a release once its
/// heartbeat is stale).
struct QueuedTry<'a> {
    b: &'a PostgresBackend,
    name: &'a str,
    me: &'a Arc<Me>,
    granted: bool,
}

impl Drop for QueuedTry<'_> {
    fn drop(&mut self) {
        if !self.granted && self.b.inner.waiters.has_waiters(self.name) {
            return;
        }
        let mine = {
            let mut mq = locked(&self.b.inner.queueing.maybe_queued);
            mq.get(self.name).is_some_and(|x| Arc::ptr_eq(x, self.me))
                && mq.remove(self.name).is_some()
        };
        if mine && !self.granted {
            self.b.spawn_leave(self.name, self.me.clone(), true, false);
        }
    }
}

/// The identity of a listening session, by which this process queues: its own channel
/// `dlock_w<pid>_<start µs>`, its pid and its start (so a reused pid is not taken for it).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Me {
    pub(crate) channel: String,
    pub(crate) pid: i32,
    pub(crate) started_us: i64,
}

/// The waiters' FIFO state of one backend (shared with its listener).
#[derive(Debug, Default)]
struct Queueing {
    /// Whether the FIFO is on (decided at connect).
    fifo: std::sync::atomic::AtomicBool,
    /// The listening session while it listens on its own channel.
    me: Mutex<Option<Arc<Me>>>,
    /// Names this process may have a row for, with the identity it queued under.
    maybe_queued: Mutex<std::collections::HashMap<String, Arc<Me>>>,
    /// Leave statements under way, per name (a new queueing for the name waits for its end, so
    /// the deletion cannot overtake the new row).
    leaving: Mutex<std::collections::HashMap<String, tokio_watch::Receiver<bool>>>,
    acquire_statements: std::sync::atomic::AtomicU64,
    queue_wakeups: std::sync::atomic::AtomicU64,
    broadcast_wakeups: std::sync::atomic::AtomicU64,
    passed_on: std::sync::atomic::AtomicU64,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Counters of one [`PostgresBackend`]'s waiting (see [`PostgresBackend::wait_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PostgresWaitStats {
    /// Acquire statements (or function calls) sent, in lock-table mode.
    pub acquire_statements: u64,
    /// Notifications heard on this process's own channel (its turn in a waiters' queue).
    pub queue_wakeups: u64,
    /// Notifications heard on the table's release channel (every process hears those).
    pub broadcast_wakeups: u64,
    /// Turns passed on to the next process in line (a notification for a name no local caller
    /// waits for any more, or a waiter that left with an unused wake-up).
    pub passed_on: u64,
    /// Names this process may have a row for in the waiters' queue now.
    pub queued_names: usize,
    /// Leave statements under way now.
    pub leaving: usize,
    /// Acquire statements whose reply was not read, kept for their give-back, now.
    pub tries_in_flight: usize,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.cancel.cancel();
        if let Some(h) = self
            .listener
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            h.abort();
        }
        if let Some(h) = self
            .rechecker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            h.abort();
        }
    }
}

impl fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresBackend")
            .field("url", &self.inner.url)
            .field("table", &self.inner.table)
            .finish_non_exhaustive()
    }
}

impl PostgresBackend {
    /// Settings for a backend with its own pool, from a `postgres://` or `postgresql://` URL
    /// (libpq key=value strings work too).
    pub fn builder(url: &str) -> PostgresBackendBuilder {
        PostgresBackendBuilder {
            url: Some(url.to_string()),
            ..PostgresBackendBuilder::defaults()
        }
    }

    /// Settings for a backend on the caller's existing deadpool-postgres pool. Add
    /// [`PostgresBackendBuilder::listen_config`] for `LISTEN`/`NOTIFY` wake-ups.
    pub fn builder_with_pool(pool: Pool) -> PostgresBackendBuilder {
        PostgresBackendBuilder {
            pool: Some(pool),
            ..PostgresBackendBuilder::defaults()
        }
    }

    /// Connects with default settings (see [`PostgresBackendBuilder::connect`]).
    pub async fn connect(url: &str) -> Result<PostgresBackend, LockError> {
        Self::builder(url).connect().await
    }

    /// The URL without its password (or `<caller's pool>`).
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// The lock table.
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    /// Whether calls go through the server functions (see
    /// [`PostgresBackendBuilder::server_functions`]).
    pub fn uses_server_functions(&self) -> bool {
        self.inner
            .functions
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The pool the backend runs its statements on.
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// Number of callers waiting in this process.
    pub fn waiter_count(&self) -> usize {
        self.inner.waiters.waiter_count()
    }

    async fn ping(&self) -> Result<(), LockError> {
        let pool = &self.inner.pool;
        bounded("", "a ping", self.inner.op_timeout, async {
            let c = pool.get().await?;
            c.simple_query("SELECT 1").await?;
            Ok::<_, DynError>(())
        })
        .await
    }

    /// Creates the sequence and table when missing. Two processes creating them at once can
    /// collide on the catalog's unique index; the loser retries.
    async fn create_schema(&self) -> Result<(), LockError> {
        let mut last = None;
        for _ in 0..3 {
            let pool = &self.inner.pool;
            let ddl = &self.inner.sql.schema;
            match bounded("", "the schema DDL", self.inner.op_timeout, async {
                let c = pool.get().await?;
                c.batch_execute(ddl).await?;
                Ok::<_, DynError>(())
            })
            .await
            {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(last.unwrap_or_else(|| LockError::Config("schema creation failed".into())))
    }

    /// `server_functions`: creates the functions when missing (`create`), or checks that they
    /// exist. Checked first, so processes that start together rarely replace the functions at
    /// the same moment; a collision of two creations is retried.
    /// `fifo`: the v2 functions (the waiters' FIFO) are needed too.
    async fn ensure_functions(&self, create: bool, fifo: bool) -> Result<(), LockError> {
        let f = &self.inner.sql.functions;
        let exist_sql = if fifo { &f.exist_fifo } else { &f.exist };
        let pool = &self.inner.pool;
        let mut last = None;
        for attempt in 0..3u64 {
            let r = bounded("", "the server functions", self.inner.op_timeout, async {
                let c = pool.get().await?;
                let rows = c.simple_query(exist_sql).await?;
                let exist = rows.iter().any(|m| {
                    matches!(m, tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("t"))
                });
                if !exist && create {
                    c.batch_execute(&f.ddl).await?;
                }
                Ok::<_, DynError>(exist || create)
            })
            .await;
            match r {
                Ok(true) => return Ok(()),
                Ok(false) => {
                    return Err(LockError::Config(format!(
                        "PostgreSQL server_functions: the functions of table {} are missing and create_schema is off; apply dlock::postgres_functions_sql({:?})",
                        self.inner.table, self.inner.table
                    )));
                }
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(20 + 30 * attempt)).await;
        }
        Err(last.unwrap_or_else(|| LockError::Config("server function creation failed".into())))
    }

    /// Warns when the configured table name is not the table's canonical spelling (`relname`
    /// in `public`, else `schema.relname`): the advisory key space and the release channel
    /// follow the configured string, so processes that spell one table differently do not
    /// exclude each other in advisory mode and do not hear each other's releases (sql.md #11;
    /// see docs/postgres.md, advisory-lock mode). Best effort: a failed check says nothing.
    async fn warn_if_spelled_otherwise(&self) {
        let pool = &self.inner.pool;
        let table = self.inner.table.clone();
        let r = bounded("", "the table name check", self.inner.op_timeout, async {
            let c = pool.get().await?;
            let rows = c
                .query_typed(
                    "SELECT CASE WHEN n.nspname = 'public' THEN c.relname \
                                 ELSE n.nspname || '.' || c.relname END \
                     FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                     WHERE c.oid = to_regclass($1)",
                    &[(&table.as_str(), Type::TEXT)],
                )
                .await?;
            Ok::<_, DynError>(rows.first().and_then(|r| r.try_get::<_, String>(0).ok()))
        })
        .await;
        if let Ok(Some(canonical)) = r
            && canonical != self.inner.table
        {
            tracing::warn!(
                table = %self.inner.table,
                canonical = %canonical,
                "dlock: PostgreSQL table named otherwise than its canonical spelling; every process must spell it the same way (advisory keys and release channels follow the configured name)"
            );
        }
    }

    /// Whether the lock table has the `holder` column (a table of an older version migrated by
    /// hand may not).
    async fn holder_column_exists(&self) -> Result<bool, LockError> {
        self.query_is_true(&self.inner.sql.holder_exists, "the holder column check")
            .await
    }

    /// Whether the table of the waiters' FIFO exists.
    async fn waiters_table_exists(&self) -> Result<bool, LockError> {
        self.query_is_true(&self.inner.sql.waiters_exist, "the waiters table check")
            .await
    }

    /// Runs a one-value boolean query (simple protocol), bounded by the operation timeout.
    async fn query_is_true(&self, sql: &str, what: &'static str) -> Result<bool, LockError> {
        let pool = &self.inner.pool;
        bounded("", what, self.inner.op_timeout, async {
            let c = pool.get().await?;
            let rows = c.simple_query(sql).await?;
            Ok::<_, DynError>(rows.iter().any(|m| {
                matches!(m, tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("t"))
            }))
        })
        .await
    }

    /// Counters of this backend's waiting: acquire statements sent, wake-ups heard on its own
    /// channel (its turn in a waiters' queue) and on the release channel, turns passed on.
    pub fn wait_stats(&self) -> PostgresWaitStats {
        use std::sync::atomic::Ordering::Relaxed;
        let q = &self.inner.queueing;
        PostgresWaitStats {
            acquire_statements: q.acquire_statements.load(Relaxed),
            queue_wakeups: q.queue_wakeups.load(Relaxed),
            broadcast_wakeups: q.broadcast_wakeups.load(Relaxed),
            passed_on: q.passed_on.load(Relaxed),
            queued_names: locked(&q.maybe_queued).len(),
            leaving: locked(&q.leaving).len(),
            tries_in_flight: locked(&self.inner.tries).len(),
        }
    }

    /// The channel on which this process hears its turn in the waiters' FIFO
    /// (`dlock_w<listener pid>_<listener start, µs>`), while its listener listens on it; `None`
    /// when the FIFO is off (see [`PostgresBackendBuilder::fifo_wakeups`]) or not listening.
    pub fn fifo_channel(&self) -> Option<String> {
        locked(&self.inner.queueing.me)
            .as_ref()
            .map(|m| m.channel.clone())
    }

    /// The identity to queue under for `name`, when the FIFO is on, the listener listens on its
    /// own channel and callers of this process wait for `name`.
    fn queue_as(&self, name: &str) -> Option<Arc<Me>> {
        let q = &self.inner.queueing;
        if !q.fifo.load(std::sync::atomic::Ordering::Relaxed)
            || !self.inner.waiters.has_waiters(name)
        {
            return None;
        }
        locked(&q.me).clone()
    }

    /// Before a statement that may queue this process for `name`: waits (bounded) for a leave
    /// statement of the name still under way, and notes that a row may exist.
    async fn before_queueing(&self, name: &str, me: &Arc<Me>) {
        let q = &self.inner.queueing;
        let pending = locked(&q.leaving).get(name).cloned();
        if let Some(mut rx) = pending {
            let _ = tokio::time::timeout(self.inner.op_timeout, rx.wait_for(|d| *d)).await;
        }
        locked(&q.maybe_queued).insert(name.to_string(), me.clone());
    }

    /// The last local waiter of `name` left (a grant, a time-out, a cancelled wait): the row
    /// of this process, if it may have one, is deleted, and a wake-up it left unused is passed
    /// on to the next process in line, in the background.
    fn queue_emptied(&self, name: &str, woken: bool) {
        let q = &self.inner.queueing;
        if !q.fifo.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let queued = locked(&q.maybe_queued).remove(name);
        let me = match queued {
            Some(m) => m,
            None if woken => match locked(&q.me).clone() {
                Some(m) => m,
                None => return,
            },
            None => return,
        };
        // Always passed on when the name is free (sql.md #13): a waiter that consumed its
        // wake-up and was then cancelled or timed out before its retry became a grant leaves
        // `woken` false, and its turn was lost until the others' timers fired. The statement
        // notifies only when the name is free: at most one extra wake-up.
        self.spawn_leave(name, me, true, woken);
    }

    /// Deletes, in the background, the queue rows of `name` whose listeners are gone (a light
    /// release met some).
    fn spawn_cleanup(&self, name: &str) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let b = self.clone();
        let name = name.to_string();
        rt.spawn(async move {
            let r = b
                .query(
                    &name,
                    "the queue clean-up",
                    &b.inner.sql.fifo.cleanup,
                    &[(&name.as_bytes(), Type::BYTEA)],
                )
                .await;
            if let Err(e) = r {
                tracing::debug!(key = %name, error = %e, "dlock: PostgreSQL clean-up of the waiters' queue failed");
            }
        });
    }

    /// Runs the leave statement of `name` for the identity `me` in the background; `pass`: wake
    /// the next process in line when the name is free; `unused`: this process leaves with a
    /// wake-up it did not use (counted in [`PostgresWaitStats::passed_on`]).
    fn spawn_leave(&self, name: &str, me: Arc<Me>, pass: bool, unused: bool) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let q = &self.inner.queueing;
        if unused {
            q.passed_on
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let (tx, rx) = tokio_watch::channel(false);
        locked(&q.leaving).insert(name.to_string(), rx.clone());
        let b = self.clone();
        let name = name.to_string();
        rt.spawn(async move {
            let r = if let Some(a) = &b.inner.advisory {
                // Advisory mode: on the dedicated session, behind any try of this process
                // still running there; the name's lock is free when no session holds its key.
                a.leave(&name, &me.channel, pass).await
            } else {
                let sql = if b.uses_server_functions() {
                    &b.inner.sql.functions.fifo.leave
                } else {
                    &b.inner.sql.fifo.leave
                };
                b.query(
                    &name,
                    "the leave statement",
                    sql,
                    &[
                        (&name.as_bytes(), Type::BYTEA),
                        (&me.channel.as_str(), Type::TEXT),
                        (&pass, Type::BOOL),
                    ],
                )
                .await
                .map(drop)
            };
            if let Err(e) = r {
                tracing::debug!(key = %name, error = %e, "dlock: PostgreSQL leave of the waiters' queue failed");
            }
            let _ = tx.send(true);
            let mut map = locked(&b.inner.queueing.leaving);
            if map.get(&name).is_some_and(|r| r.same_channel(&rx)) {
                map.remove(&name);
            }
        });
    }

    /// The acquire, release or extend SQL to send: the statement, or its function's call.
    fn sql_for(&self, which: fn(&Sql) -> &String, call: fn(&Functions) -> &String) -> &str {
        if self
            .inner
            .functions
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            call(&self.inner.sql.functions)
        } else {
            which(&self.inner.sql)
        }
    }

    async fn query(
        &self,
        name: &str,
        what: &'static str,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, LockError> {
        let pool = &self.inner.pool;
        let prepared = self.inner.prepared;
        bounded(name, what, self.inner.op_timeout, async {
            let c = pool.get().await?;
            run_on(&c, prepared, sql, params).await
        })
        .await
    }

    /// An acquire statement of `owner`, tracked until its reply is read (see [`TrySlot`]).
    async fn query_try(
        &self,
        name: &str,
        owner: &str,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, LockError> {
        let key = (name.to_string(), owner.to_string());
        let slot = Arc::new(TrySlot {
            state: Mutex::new(TryState::InFlight),
            settled: tokio_watch::Sender::new(false),
        });
        {
            let mut m = locked(&self.inner.tries);
            if m.len() >= 1024 {
                // Abandoned tries nobody gave back (no runtime was left for the give-back): the
                // statement is long over; forget them.
                m.retain(|_, s| {
                    !matches!(&*locked(&s.state),
                        TryState::Abandoned { at, .. } if at.elapsed() > Duration::from_secs(60))
                });
            }
            m.insert(key.clone(), slot.clone());
        }
        let mut g = TryGuard {
            inner: &self.inner,
            key,
            slot,
            conn: None,
            answered: false,
        };
        let pool = &self.inner.pool;
        let prepared = self.inner.prepared;
        let r = bounded(
            name,
            "the acquire statement",
            self.inner.op_timeout,
            async {
                let c = g.conn.insert(pool.get().await?);
                run_on(c, prepared, sql, params).await
            },
        )
        .await;
        if r.is_ok() {
            g.answered = true;
        }
        r
    }

    /// Before the release of `owner`: when a try of that owner is in flight, waits (bounded)
    /// until it is answered or abandoned. Returns the abandoned try's connection, and until when
    /// a `NotOwner` answer cannot be trusted (the try's connection broke, so its statement may
    /// still commit in a session we cannot order behind: the server's `statement_timeout` ends
    /// it by then).
    async fn settle_try(
        &self,
        name: &str,
        owner: &str,
    ) -> (
        Option<Arc<TrySlot>>,
        Option<deadpool_postgres::Object>,
        Option<std::time::Instant>,
    ) {
        let key = (name.to_string(), owner.to_string());
        let Some(slot) = locked(&self.inner.tries).get(&key).cloned() else {
            return (None, None, None);
        };
        let mut rx = slot.settled.subscribe();
        let _ = tokio::time::timeout(self.inner.op_timeout, rx.wait_for(|d| *d)).await;
        let margin = self.inner.statement_timeout + Duration::from_secs(1);
        let (conn, unsure) = match &mut *locked(&slot.state) {
            TryState::InFlight => (None, Some(std::time::Instant::now() + margin)),
            TryState::Abandoned { conn, at } => match conn.take() {
                Some(c) if !c.is_closed() => (Some(*c), None),
                Some(_) => (None, Some(*at + margin)),
                None => (None, None),
            },
        };
        (Some(slot), conn, unsure)
    }

    /// The give-back of `owner` was answered: its try needs no more tracking.
    fn try_settled(&self, name: &str, owner: &str, slot: &Arc<TrySlot>) {
        let key = (name.to_string(), owner.to_string());
        let mut m = locked(&self.inner.tries);
        if m.get(&key).is_some_and(|s| Arc::ptr_eq(s, slot)) {
            m.remove(&key);
        }
    }

    /// A release found nothing of `owner` held. When an earlier release of that owner went
    /// unanswered, the row tells whether it was applied: the owner's own row at count 0 (or no
    /// row: swept) is its release, `Freed`; otherwise `NotOwner`.
    async fn nothing_released(&self, name: &str, owner: &str) -> Result<Released, LockError> {
        if !self.inner.unconfirmed.contains(name, owner) {
            return Ok(Released::NotOwner);
        }
        let rows = self
            .query(
                name,
                "the release check",
                &self.inner.sql.released_by,
                &[(&name.as_bytes(), Type::BYTEA), (&owner, Type::TEXT)],
            )
            .await?;
        let released = rows
            .first()
            .is_none_or(|r| r.try_get::<_, bool>(0).unwrap_or(false));
        Ok(if released {
            Released::Freed
        } else {
            Released::NotOwner
        })
    }

    /// Every 256th freeing release, deletes rows idle for five minutes, in the background.
    fn maybe_sweep(&self) {
        let n = self
            .inner
            .releases
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n % 256 != 255 {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            let pool = &me.inner.pool;
            let sql = &me.inner.sql.sweep;
            let r = bounded("", "the sweep", me.inner.op_timeout, async {
                let c = pool.get().await?;
                // Simple query protocol: `execute(&str)` would prepare a named statement, which
                // a transaction-mode pooler can look up in another server session.
                Ok::<_, DynError>(c.batch_execute(sql).await?)
            })
            .await;
            if let Err(e) = r {
                tracing::debug!(error = %e, "dlock: PostgreSQL sweep of idle rows failed");
            }
        });
    }

    /// Advisory mode: a lock freed by a dying session sends no NOTIFY, and a process a release
    /// notified may be paused, so while there are local waiters one task reads every `RECHECK`
    /// (500 ms) which of their names no session holds (`pg_locks`, on the pool: no try, nothing
    /// taken) and wakes the first waiter of a name found free at two checks in a row (a hand-off
    /// under way leaves a name free for a moment only). A check that fails wakes the first
    /// waiter of every name instead, as every check did before. It runs until the backend is
    /// dropped (or its runtime shuts down: the next `watch` restarts it).
    fn ensure_rechecking(&self) {
        let mut slot = self
            .inner
            .rechecker
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if slot.as_ref().is_some_and(|h| !h.is_finished()) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let inner = Arc::downgrade(&self.inner);
        let cancel = self.inner.cancel.clone();
        *slot = Some(rt.spawn(async move {
            let mut free_before = std::collections::HashSet::<String>::new();
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(RECHECK) => {}
                }
                let Some(inner) = inner.upgrade() else { return };
                let b = PostgresBackend { inner };
                let names = b.inner.waiters.names();
                if names.is_empty() {
                    free_before.clear();
                    continue;
                }
                match b.free_names(&names).await {
                    Some(free) => {
                        for n in &free {
                            if free_before.contains(n) {
                                b.inner.waiters.wake_one_unless_pending(n);
                            }
                        }
                        free_before = free;
                    }
                    None => {
                        free_before.clear();
                        b.inner.waiters.wake_first_of_each();
                    }
                }
            }
        }));
    }

    /// Advisory mode: which of `names` no session holds now; `None` when the check failed.
    async fn free_names(&self, names: &[String]) -> Option<std::collections::HashSet<String>> {
        let a = self.inner.advisory.as_ref()?;
        let keys: Vec<i64> = names.iter().map(|n| a.key(n)).collect();
        let rows = self
            .query(
                "",
                "the advisory re-check",
                a.free_sql(),
                &[(&keys, Type::INT8_ARRAY)],
            )
            .await
            .map_err(|e| tracing::debug!(error = %e, "dlock: advisory re-check failed"))
            .ok()?;
        let mut free = std::collections::HashSet::new();
        for r in rows {
            let i: i64 = r.try_get(0).ok()?;
            free.insert(names.get(usize::try_from(i).ok()?.checked_sub(1)?)?.clone());
        }
        Some(free)
    }

    /// Starts the listener when it is not running; true when it is listening (waits up to the
    /// connect timeout for a fresh one).
    async fn ensure_listening(&self) -> bool {
        let Some(cfg) = self.inner.listen_config.clone() else {
            return false;
        };
        {
            let mut slot = self
                .inner
                .listener
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if slot.as_ref().is_none_or(|h| h.is_finished()) {
                let Ok(rt) = tokio::runtime::Handle::try_current() else {
                    return false;
                };
                let _ = self.inner.ready_tx.send(false);
                *slot = Some(rt.spawn(listen_loop(
                    cfg,
                    self.inner.connector.clone(),
                    self.inner.sql.channel.clone(),
                    Arc::downgrade(&self.inner.waiters),
                    self.inner.queueing.clone(),
                    Arc::downgrade(&self.inner),
                    self.inner.ready_tx.clone(),
                    self.inner.cancel.clone(),
                    self.inner.op_timeout,
                    self.inner.connect_timeout,
                )));
            }
        }
        let mut rx = self.inner.ready_rx.clone();
        matches!(
            tokio::time::timeout(self.inner.connect_timeout, rx.wait_for(|r| *r)).await,
            Ok(Ok(_))
        )
    }
}

/// Runs `sql` on the connection `c`: unnamed, or prepared once per connection (`prepared`).
async fn run_on(
    c: &deadpool_postgres::Object,
    prepared: bool,
    sql: &str,
    params: &[(&(dyn ToSql + Sync), Type)],
) -> Result<Vec<Row>, DynError> {
    if !prepared {
        return Ok(c.query_typed(sql, params).await?);
    }
    // Parsed and planned once per connection (a generic plan after PostgreSQL's first custom
    // ones), then one Bind/Execute per call.
    let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
    let st = c.prepare_typed_cached(sql, &types).await?;
    let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
    Ok(c.query(&st, &values).await?)
}

pub(crate) fn hex_name(payload: &str) -> Option<String> {
    let b = payload.as_bytes();
    if !b.len().is_multiple_of(2) {
        return None;
    }
    let nib = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let bytes: Option<Vec<u8>> = b
        .chunks(2)
        .map(|p| Some(nib(p[0])? << 4 | nib(p[1])?))
        .collect();
    String::from_utf8(bytes?).ok()
}

/// The listening connection: connect, `LISTEN`, turn each notification into one local wake-up,
/// check the connection every few seconds, reconnect with back-off. Every (re)connect and every
/// loss wakes all waiters, as releases may have been missed in between.
///
/// With the waiters' FIFO on, it also `LISTEN`s on a channel of its own session
/// (`dlock_w<pid>_<start>`), on which a release wakes this process when it is first in line; a
/// notification there for a name no local caller waits for is passed on to the next process.
#[allow(clippy::too_many_arguments)]
async fn listen_loop(
    cfg: tokio_postgres::Config,
    connector: Connector,
    channel: String,
    waiters: std::sync::Weak<WaitQueues>,
    queueing: Arc<Queueing>,
    inner: std::sync::Weak<Inner>,
    ready: Arc<tokio_watch::Sender<bool>>,
    cancel: CancellationToken,
    op_timeout: Duration,
    connect_timeout: Duration,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let mut backoff = Duration::from_millis(100);
    loop {
        if cancel.is_cancelled() || waiters.strong_count() == 0 {
            return;
        }
        let w = waiters.clone();
        let chan = channel.clone();
        let own: Arc<std::sync::OnceLock<Arc<Me>>> = Arc::default();
        let (own_n, q_n, inner_n) = (own.clone(), queueing.clone(), inner.clone());
        let on: OnNotify = Box::new(move |n: &tokio_postgres::Notification| {
            // A semaphore's or read-write lock's wake-up (never a lock name's hex).
            if n.channel() == chan
                && let Some(inner) = inner_n.upgrade()
                && inner.prims.heard(n.payload())
            {
                return;
            }
            let Some(name) = hex_name(n.payload()) else {
                return;
            };
            if n.channel() == chan {
                q_n.broadcast_wakeups.fetch_add(1, Relaxed);
                if let Some(w) = w.upgrade() {
                    w.wake_one(&name);
                }
            } else if let Some(me) = own_n.get().filter(|m| m.channel == n.channel()) {
                q_n.queue_wakeups.fetch_add(1, Relaxed);
                let Some(w) = w.upgrade() else { return };
                // A caller here is woken; or one already woken retries after this release
                // anyway; or nobody here waits for the name any more: the turn goes on.
                if !w.wake_one(&name)
                    && !w.has_waiters(&name)
                    && let Some(inner) = inner_n.upgrade()
                {
                    locked(&q_n.maybe_queued).remove(&name);
                    PostgresBackend { inner }.spawn_leave(&name, me.clone(), true, true);
                }
            }
        });
        if let Ok(Ok((client, mut driver))) =
            tokio::time::timeout(connect_timeout, connector.connect(&cfg, Some(on))).await
        {
            let listen = format!("LISTEN \"{channel}\"");
            if let Ok(Ok(())) =
                tokio::time::timeout(op_timeout, client.batch_execute(&listen)).await
            {
                if queueing.fifo.load(Relaxed)
                    && let Some(me) = listen_own(&client, &inner, op_timeout).await
                {
                    let me = Arc::new(me);
                    let _ = own.set(me.clone());
                    *locked(&queueing.me) = Some(me);
                }
                backoff = Duration::from_millis(100);
                let _ = ready.send(true);
                if let Some(w) = waiters.upgrade() {
                    w.wake_all();
                }
                if let Some(i) = inner.upgrade() {
                    i.prims.wake_all();
                }
                let beat_sql = inner.upgrade().map(|i| match &i.advisory {
                    Some(a) => a.beat_sql().to_string(),
                    None => i.sql.fifo.beat.clone(),
                });
                let mut missing = std::collections::HashSet::new();
                loop {
                    tokio::select! {
                        _ = &mut driver => break,
                        _ = cancel.cancelled() => { driver.abort(); return; }
                        _ = tokio::time::sleep(BEAT_EVERY) => {
                            // The heartbeat of this process's queued rows doubles as the
                            // connection's liveness check.
                            let alive = match (own.get(), &beat_sql) {
                                (Some(me), Some(sql)) if queueing.fifo.load(Relaxed) => {
                                    beat(&client, sql, me, &queueing, &waiters, &mut missing, op_timeout).await
                                }
                                _ => matches!(
                                    tokio::time::timeout(op_timeout, client.simple_query("SELECT 1")).await,
                                    Ok(Ok(_))
                                ),
                            };
                            if !alive {
                                break;
                            }
                        }
                    }
                }
            }
            driver.abort();
            *locked(&queueing.me) = None;
            let _ = ready.send(false);
            if let Some(w) = waiters.upgrade() {
                w.wake_all();
            }
            if let Some(i) = inner.upgrade() {
                i.prims.wake_all();
            }
            tracing::warn!(channel = %channel, "dlock: PostgreSQL listening connection lost; reconnecting");
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// The listener's heartbeat (see [`beat_statement`]): renews the beat of the rows this process
/// may have queued, and wakes a local waiter of a name that has been free for [`STALL_AFTER`]
/// (the process a release woke is not acting) or whose row is gone two beats in a row (a release
/// took it for a dead listener's: the next try queues it again). `false`: the connection failed.
async fn beat(
    client: &tokio_postgres::Client,
    sql: &str,
    me: &Me,
    queueing: &Queueing,
    waiters: &std::sync::Weak<WaitQueues>,
    missing: &mut std::collections::HashSet<String>,
    op_timeout: Duration,
) -> bool {
    let names: Vec<String> = locked(&queueing.maybe_queued)
        .iter()
        .filter(|(_, m)| m.channel == me.channel)
        .map(|(n, _)| n.clone())
        .collect();
    if names.is_empty() {
        missing.clear();
        return matches!(
            tokio::time::timeout(op_timeout, client.simple_query("SELECT 1")).await,
            Ok(Ok(_))
        );
    }
    let bytes: Vec<&[u8]> = names.iter().map(|n| n.as_bytes()).collect();
    let rows = match tokio::time::timeout(
        op_timeout,
        client.query_typed(
            sql,
            &[
                (&bytes, Type::BYTEA_ARRAY),
                (&me.channel.as_str(), Type::TEXT),
            ],
        ),
    )
    .await
    {
        Ok(Ok(rows)) => rows,
        Ok(Err(e)) if e.as_db_error().is_some() => {
            // A SQL error (the waiters table changed under us): the connection is fine.
            tracing::debug!(error = %e, "dlock: PostgreSQL heartbeat of the waiters' queue failed");
            return true;
        }
        _ => return false,
    };
    let Some(w) = waiters.upgrade() else {
        return true;
    };
    let mut now_missing = std::collections::HashSet::new();
    for r in rows {
        let (Ok(name), Ok(renewed), Ok(free)) = (
            r.try_get::<_, Vec<u8>>(0),
            r.try_get::<_, bool>(1),
            r.try_get::<_, bool>(2),
        ) else {
            continue;
        };
        let Ok(name) = String::from_utf8(name) else {
            continue;
        };
        if free || (!renewed && missing.contains(&name)) {
            w.wake_one(&name);
        } else if !renewed {
            now_missing.insert(name);
        }
    }
    *missing = now_missing;
    true
}

/// Whether a session advisory lock taken on `client` can be taken from a connection of `pool`
/// too (so both run in one server session); `None` when the probe fails.
async fn shares_session(
    client: &tokio_postgres::Client,
    pool: &Pool,
    seed: u64,
    op_timeout: Duration,
) -> Option<bool> {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(seed);
    let key = h.finish() as i64;
    let first = |msgs: Vec<tokio_postgres::SimpleQueryMessage>| {
        msgs.into_iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(|v| v == "t"),
            _ => None,
        })
    };
    let lock = format!("SELECT pg_try_advisory_lock({key})");
    let unlock = format!("SELECT pg_advisory_unlock({key})");
    let took = first(
        tokio::time::timeout(op_timeout, client.simple_query(&lock))
            .await
            .ok()?
            .ok()?,
    )?;
    if !took {
        // The random key is held elsewhere (vanishingly rare): nothing to conclude.
        return Some(false);
    }
    let shared = async {
        let c = tokio::time::timeout(op_timeout, pool.get())
            .await
            .ok()?
            .ok()?;
        let r = first(
            tokio::time::timeout(op_timeout, c.simple_query(&lock))
                .await
                .ok()?
                .ok()?,
        )?;
        if r {
            let _ = tokio::time::timeout(op_timeout, c.simple_query(&unlock)).await;
        }
        Some(r)
    }
    .await;
    let _ = tokio::time::timeout(op_timeout, client.simple_query(&unlock)).await;
    shared
}

/// The listening session's own channel: its pid and start, read twice, and `LISTEN` on it.
/// `None` when any of it fails, or behind a transaction-mode pooler, whose server sessions are
/// not the client's (notifications for the channel could reach another client): two readings
/// that disagree, or a probe advisory lock taken by the listener that a pooled connection of
/// the backend can take too (the pooler handed it the listener's idle server session, as
/// PgBouncer does by default; the check of advisory mode).
async fn listen_own(
    client: &tokio_postgres::Client,
    inner: &std::sync::Weak<Inner>,
    op_timeout: Duration,
) -> Option<Me> {
    let ident = || async {
        let rows = tokio::time::timeout(
            op_timeout,
            client.simple_query(
                "SELECT pg_backend_pid(), (extract(epoch FROM backend_start) * 1000000)::bigint \
                 FROM pg_stat_get_activity(pg_backend_pid())",
            ),
        )
        .await
        .ok()?
        .ok()?;
        rows.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some((
                r.get(0)?.parse::<i32>().ok()?,
                r.get(1)?.parse::<i64>().ok()?,
            )),
            _ => None,
        })
    };
    let a = ident().await?;
    let b = ident().await?;
    let shared = a != b || {
        let pool = inner.upgrade()?.pool.clone();
        // A probe that fails (a busy pool) concludes nothing: the FIFO stays on.
        shares_session(client, &pool, a.0 as u64 ^ a.1 as u64, op_timeout)
            .await
            .unwrap_or(false)
    };
    if shared {
        tracing::info!(
            "dlock: the PostgreSQL listener's server session is shared (a transaction-mode pooler); waiters' FIFO off"
        );
        return None;
    }
    let me = Me {
        channel: format!("dlock_w{}_{}", a.0, a.1),
        pid: a.0,
        started_us: a.1,
    };
    let listen = format!("LISTEN \"{}\"", me.channel);
    matches!(
        tokio::time::timeout(op_timeout, client.batch_execute(&listen)).await,
        Ok(Ok(()))
    )
    .then_some(me)
}

impl Backend for PostgresBackend {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(async move {
            if let Some(a) = &self.inner.advisory {
                // Queued, as in the lock-table mode, only when callers here wait for the name.
                let me = if a.answered_here(name, owner) {
                    None
                } else {
                    self.queue_as(name)
                };
                let Some(m) = me else {
                    return a.try_acquire(name, owner, None).await;
                };
                self.before_queueing(name, &m).await;
                let mut after = QueuedTry {
                    b: self,
                    name,
                    me: &m,
                    granted: false,
                };
                let r = a.try_acquire(name, owner, Some(&m)).await;
                after.granted = matches!(r, Ok(Acquired::Granted { .. }));
                return r;
            }
            let ttl_us = micros(ttl);
            let q = &self.inner.queueing;
            q.acquire_statements
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // Queued (v2) only when callers here wait for the name: a first try, a try with no
            // wait, an uncontended acquire send the v1 statement, which never writes the queue.
            let me = self.queue_as(name);
            // The holder identity, stored by the grant where the table has the column.
            let holder = self
                .inner
                .holder
                .load(std::sync::atomic::Ordering::Relaxed)
                .then(crate::holder::holder_text);
            let holder_ref = holder.as_deref();
            let rows = match &me {
                None if holder.is_some() => {
                    self.query_try(
                        name,
                        owner,
                        self.sql_for(|s| &s.acquire_holder, |f| &f.acquire_holder),
                        &[
                            (&name.as_bytes(), Type::BYTEA),
                            (&owner, Type::TEXT),
                            (&ttl_us, Type::INT8),
                            (&holder_ref, Type::TEXT),
                        ],
                    )
                    .await?
                }
                None => {
                    self.query_try(
                        name,
                        owner,
                        self.sql_for(|s| &s.acquire, |f| &f.acquire),
                        &[
                            (&name.as_bytes(), Type::BYTEA),
                            (&owner, Type::TEXT),
                            (&ttl_us, Type::INT8),
                        ],
                    )
                    .await?
                }
                Some(m) => {
                    self.before_queueing(name, m).await;
                    // Checked however the try ends (answered, failed, or dropped unread).
                    let mut after = QueuedTry {
                        b: self,
                        name,
                        me: m,
                        granted: false,
                    };
                    let rows = if holder.is_some() {
                        self.query_try(
                            name,
                            owner,
                            self.sql_for(|s| &s.fifo.acquire_holder, |f| &f.fifo.acquire_holder),
                            &[
                                (&name.as_bytes(), Type::BYTEA),
                                (&owner, Type::TEXT),
                                (&ttl_us, Type::INT8),
                                (&m.channel.as_str(), Type::TEXT),
                                (&m.pid, Type::INT4),
                                (&m.started_us, Type::INT8),
                                (&holder_ref, Type::TEXT),
                            ],
                        )
                        .await?
                    } else {
                        self.query_try(
                            name,
                            owner,
                            self.sql_for(|s| &s.fifo.acquire, |f| &f.fifo.acquire),
                            &[
                                (&name.as_bytes(), Type::BYTEA),
                                (&owner, Type::TEXT),
                                (&ttl_us, Type::INT8),
                                (&m.channel.as_str(), Type::TEXT),
                                (&m.pid, Type::INT4),
                                (&m.started_us, Type::INT8),
                            ],
                        )
                        .await?
                    };
                    // A grant took this process out of the queue.
                    after.granted = rows
                        .first()
                        .is_some_and(|r| r.try_get::<_, Option<i64>>(0).ok().flatten().is_some());
                    drop(after);
                    rows
                }
            };
            let Some(row) = rows.first() else {
                // The conflicting row was committed after this statement's snapshot: held.
                return Ok(Acquired::Busy { remaining: None });
            };
            let fence: Option<i64> = row.try_get(0).map_err(|e| LockError::backend(name, e))?;
            let count: Option<i32> = row.try_get(1).map_err(|e| LockError::backend(name, e))?;
            let rem: Option<i64> = row.try_get(2).map_err(|e| LockError::backend(name, e))?;
            Ok(match (fence, count) {
                (Some(f), Some(c)) => Acquired::Granted {
                    token: f as u64,
                    count: c.max(1) as u32,
                },
                _ => Acquired::Busy {
                    remaining: rem.map(|us| Duration::from_micros(us.max(0) as u64)),
                },
            })
        })
    }

    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        Box::pin(async move {
            if let Some(a) = &self.inner.advisory {
                let fifo = self
                    .inner
                    .queueing
                    .fifo
                    .load(std::sync::atomic::Ordering::Relaxed);
                if !fifo {
                    return a.release(name, owner, keep_for, all, Wake::Table).await;
                }
                // A release that frees the lock while callers here wait for it queues this
                // process behind the others, as in the lock-table mode.
                let keep = keep_for.is_some_and(|k| !k.is_zero());
                let me = if a.release_frees(name, owner, all, keep) {
                    self.queue_as(name)
                } else {
                    None
                };
                if let Some(m) = &me {
                    self.before_queueing(name, m).await;
                }
                let _after = me.as_ref().map(|m| QueuedTry {
                    b: self,
                    name,
                    me: m,
                    granted: false,
                });
                return a
                    .release(name, owner, keep_for, all, Wake::Fifo(me.clone()))
                    .await;
            }
            super::release_until_confirmed(self, name, owner, keep_for, all).await
        })
    }

    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(async move {
            if let Some(a) = &self.inner.advisory {
                return a.extend(name, owner).await;
            }
            let ttl_us = micros(ttl);
            let rows = self
                .query(
                    name,
                    "the extend statement",
                    self.sql_for(|s| &s.extend, |f| &f.extend),
                    &[
                        (&name.as_bytes(), Type::BYTEA),
                        (&owner, Type::TEXT),
                        (&ttl_us, Type::INT8),
                    ],
                )
                .await?;
            Ok(if rows.is_empty() {
                Extended::Lost
            } else {
                Extended::Extended
            })
        })
    }

    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(async move {
            let mut w = self.inner.waiters.register(name);
            if self.inner.advisory.is_some() {
                self.ensure_rechecking();
            }
            if !self.ensure_listening().await {
                w.set_fallback_only();
            }
            Ok(w)
        })
    }

    fn has_waiters(&self, name: &str) -> bool {
        self.inner.waiters.has_waiters(name)
    }

    /// Advisory mode: a session lock lives as long as the backend's dedicated session.
    fn lease_expires_by_ttl(&self) -> bool {
        self.inner.advisory.is_none()
    }

    /// Advisory mode: the session that holds the lock ended (the server ended it, the
    /// connection broke, or this process dropped it after a call that went unanswered), which
    /// freed every lock on it at that moment.
    fn lost_signal(&self, name: &str, owner: &str) -> Option<BoxFuture<'static, ()>> {
        let t = self.inner.advisory.as_ref()?.lost_signal(name, owner)?;
        Some(Box::pin(async move { t.cancelled_owned().await }))
    }

    // Semaphores, read-write locks and leader records (both modes): `postgres/prims.rs`.
    fn try_acquire_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        max: u32,
        permits: u32,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(self.permits_try(name, owner, max, permits, ttl))
    }

    fn release_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        Box::pin(self.permits_release(name, owner))
    }

    fn extend_permits<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(self.permits_extend(name, owner, ttl))
    }

    fn watch_permits<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(self.permits_watch(name))
    }

    fn has_permit_waiters(&self, name: &str) -> bool {
        self.inner.prims.sem_waiters.has_waiters(name)
    }

    fn supports_rw(&self) -> bool {
        true
    }

    fn rw_try_acquire<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(self.rw_try(side, name, owner, ttl))
    }

    fn rw_release<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        Box::pin(self.rw_release_call(side, name, owner, all))
    }

    fn rw_extend<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(self.rw_extend_call(side, name, owner, ttl))
    }

    fn rw_downgrade<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<u64>, LockError>> {
        Box::pin(self.rw_downgrade_call(name, owner, ttl))
    }

    fn rw_watch<'a>(
        &'a self,
        side: RwSide,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(self.rw_watch_call(side, name))
    }

    fn rw_has_waiters(&self, side: RwSide, name: &str) -> bool {
        self.rw_waiting(side, name)
    }

    fn put_record<'a>(
        &'a self,
        name: &'a str,
        epoch: u64,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(self.pg_put_record(name, epoch, value))
    }

    fn get_record<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<crate::backend::Record>, LockError>> {
        Box::pin(self.pg_get_record(name))
    }
}

impl super::ReleaseOnce for PostgresBackend {
    fn unconfirmed(&self) -> &super::Unconfirmed {
        &self.inner.unconfirmed
    }

    /// One release statement (table mode; see [`super::release_until_confirmed`]).
    fn release_once<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        Box::pin(async move {
            let keep: Option<i64> = keep_for.filter(|k| !k.is_zero()).map(micros);
            // A try of this owner whose reply was not read: the release goes behind it.
            let (slot, mut conn, unsure) = self.settle_try(name, owner).await;
            let fifo = self
                .inner
                .queueing
                .fifo
                .load(std::sync::atomic::Ordering::Relaxed);
            // The v2 release wakes the next queued process; callers of this process that wait
            // for the name queue behind the others.
            let me = if fifo { self.queue_as(name) } else { None };
            if let Some(m) = &me {
                self.before_queueing(name, m).await;
            }
            // The waiters this release queued for may all leave while it runs (a background
            // give-back runs after them): then nobody here would forget the name.
            let _after = me.as_ref().map(|m| QueuedTry {
                b: self,
                name,
                me: m,
                granted: false,
            });
            let (ch, pid, started) = match &me {
                Some(m) => (Some(m.channel.as_str()), Some(m.pid), Some(m.started_us)),
                None => (None, None, None),
            };
            let name_b = name.as_bytes();
            let base: [(&(dyn ToSql + Sync), Type); 4] = [
                (&name_b, Type::BYTEA),
                (&owner, Type::TEXT),
                (&all, Type::BOOL),
                (&keep, Type::INT8),
            ];
            let light = fifo && me.is_none() && !self.uses_server_functions();
            let (sql, params): (&str, Vec<(&(dyn ToSql + Sync), Type)>) = if !fifo {
                (self.sql_for(|s| &s.release, |f| &f.release), base.to_vec())
            } else if light {
                (&self.inner.sql.fifo.release_light, base.to_vec())
            } else {
                let mut p = base.to_vec();
                p.extend([
                    (&ch as &(dyn ToSql + Sync), Type::TEXT),
                    (&pid, Type::INT4),
                    (&started, Type::INT8),
                ]);
                (self.sql_for(|s| &s.fifo.release, |f| &f.fifo.release), p)
            };
            let rows = loop {
                let r = match &conn {
                    // On the abandoned try's own connection: after it, whatever it did.
                    Some(c) => {
                        bounded(
                            name,
                            "the release statement",
                            self.inner.op_timeout,
                            run_on(c, self.inner.prepared, sql, &params),
                        )
                        .await
                    }
                    None => {
                        self.query(name, "the release statement", sql, &params)
                            .await
                    }
                };
                let rows = match r {
                    Ok(rows) => rows,
                    Err(e) => {
                        // Unanswered: a retry goes on the same connection, while it lives.
                        if let (Some(s), Some(c)) = (&slot, conn.take())
                            && !c.is_closed()
                        {
                            let mut st = locked(&s.state);
                            if let TryState::Abandoned {
                                conn: slot_conn, ..
                            } = &mut *st
                            {
                                *slot_conn = Some(Box::new(c));
                            }
                        }
                        return Err(e);
                    }
                };
                // The try's connection broke: its grant may still be committing in a session
                // this release cannot be ordered behind. Until the server has surely ended that
                // statement, nothing found is not proof of nothing granted.
                if rows.is_empty()
                    && let Some(until) = unsure
                    && std::time::Instant::now() < until
                {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                break rows;
            };
            drop(conn);
            if let Some(s) = &slot {
                self.try_settled(name, owner, s);
            }
            if light
                && rows
                    .first()
                    .is_some_and(|r| r.try_get::<_, Option<bool>>(2).ok().flatten() == Some(true))
            {
                self.spawn_cleanup(name);
            }
            let Some(row) = rows.first() else {
                return self.nothing_released(name, owner).await;
            };
            let left: i32 = row.try_get(0).map_err(|e| LockError::backend(name, e))?;
            if left == 0 {
                self.maybe_sweep();
            }
            Ok(if left > 0 {
                Released::Decremented(left as u32)
            } else {
                Released::Freed
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_payloads_decode_to_names() {
        assert_eq!(hex_name("6162").as_deref(), Some("ab"));
        assert_eq!(hex_name("00ff"), None);
        assert_eq!(hex_name("0").as_deref(), None);
        assert_eq!(hex_name("6e756c0062").as_deref(), Some("nul\0b"));
    }

    #[test]
    fn schema_names_the_table_and_sequence() {
        let s = postgres_schema_sql("app.locks").unwrap();
        assert!(s.contains("CREATE TABLE IF NOT EXISTS app.locks"));
        assert!(s.contains("CREATE SEQUENCE IF NOT EXISTS app.locks_fence"));
        assert!(postgres_schema_sql("x; drop").is_err());
    }
}
