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

use super::pg_advisory::{Advisory, RECHECK};
use super::{DEFAULT_TABLE, bounded, check_table, micros, redact_url};
use crate::LockError;
use crate::backend::{Acquired, Backend, BoxFuture, Extended, Released, Watch};
use crate::wait::WaitQueues;

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

/// The DDL of the lock table `table` (and its fencing sequence `<table>_fence`), as the backend
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
///     expires_at timestamptz NOT NULL      -- end of the lease, by the database clock
/// );
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
             expires_at timestamptz NOT NULL\n\
         );\n"
    ))
}

/// The statements of one table, built once.
#[derive(Debug)]
struct Sql {
    acquire: String,
    release: String,
    extend: String,
    sweep: String,
    schema: String,
    channel: String,
    /// The `server_functions` form: the function DDL, the query that tells whether they
    /// exist, and the calls that replace `acquire`, `release` and `extend`.
    functions: Functions,
}

#[derive(Debug)]
struct Functions {
    ddl: String,
    exist: String,
    acquire: String,
    release: String,
    extend: String,
}

/// The `NOTIFY` channel of the lock table `table`: `dlock_<table>` (a `.` becomes `_`),
/// lower-cased. A release (and an admin's force-release) notifies the hex of the lock name.
pub(crate) fn channel_of(table: &str) -> String {
    format!("dlock_{}", table.replace('.', "_")).to_ascii_lowercase()
}

/// `set_config('synchronous_commit', 'off', true)`: for the statement's own (implicit)
/// transaction only, its commit does not wait for the WAL flush.
const NO_FLUSH_WAIT: &str = "set_config('synchronous_commit', 'off', true)";

/// The acquire and extend statements of `table`; `durable`: their commits wait for the WAL
/// flush (the default).
fn grant_statements(table: &str, durable: bool) -> (String, String) {
    {
        // Added to the `c` CTE of a statement whose commit need not wait for the disk.
        let grant_sc = if durable {
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
        let acquire = format!(
            "WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now{grant_sc}), \
             upd AS ( \
               UPDATE {table} l SET \
                 count = CASE WHEN l.owner = $2 AND l.expires_at > c.now THEN l.count + 1 ELSE 1 END, \
                 fence = CASE WHEN l.owner = $2 AND l.expires_at > c.now \
                              THEN l.fence ELSE nextval('{table}_fence') END, \
                 expires_at = CASE WHEN l.owner = $2 AND l.expires_at > c.now \
                                   THEN GREATEST(l.expires_at, c.now + $3 * interval '1 microsecond') \
                                   ELSE c.now + $3 * interval '1 microsecond' END, \
                 owner = $2 \
               FROM c \
               WHERE l.name = $1 AND (l.owner = $2 OR l.expires_at <= c.now) \
               RETURNING l.fence, l.count), \
             ins AS ( \
               INSERT INTO {table} (name, owner, count, fence, expires_at) \
               SELECT $1, $2, 1, nextval('{table}_fence'), c.now + $3 * interval '1 microsecond' FROM c \
               WHERE NOT EXISTS (SELECT 1 FROM upd) \
                 AND NOT EXISTS (SELECT 1 FROM {table} WHERE name = $1) \
               ON CONFLICT (name) DO NOTHING \
               RETURNING fence, count) \
             SELECT fence, count, NULL::bigint, NULL FROM upd \
             UNION ALL SELECT fence, count, NULL::bigint, NULL FROM ins \
             UNION ALL \
             SELECT NULL, NULL, GREATEST(0, (extract(epoch FROM l.expires_at - c.now) * 1000000)::bigint), \
                    {NO_FLUSH_WAIT} \
               FROM {table} l, c \
               WHERE l.name = $1 AND NOT EXISTS (SELECT 1 FROM upd) AND NOT EXISTS (SELECT 1 FROM ins)"
        );
        let extend = format!(
            "WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now{grant_sc}) \
             UPDATE {table} l SET expires_at = c.now + $3 * interval '1 microsecond' FROM c \
             WHERE l.name = $1 AND l.owner = $2 AND l.expires_at > c.now RETURNING 1"
        );
        (acquire, extend)
    }
}

/// The release statement of `table`, notifying on `channel`.
fn release_statement(table: &str, channel: &str) -> String {
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
            "WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now, {NO_FLUSH_WAIT} AS sc), \
             upd AS ( \
               UPDATE {table} l SET \
                 count = CASE WHEN l.count = 1 OR $3 THEN 0 ELSE l.count - 1 END, \
                 expires_at = CASE WHEN l.count = 1 OR $3 \
                                   THEN c.now + coalesce($4::bigint, 0) * interval '1 microsecond' \
                                   ELSE l.expires_at END \
               FROM c \
               WHERE l.name = $1 AND l.owner = $2 AND l.count > 0 AND l.expires_at > c.now \
               RETURNING l.count AS remaining) \
             SELECT remaining, CASE WHEN remaining = 0 AND $4::bigint IS NULL \
                                    THEN pg_notify('{channel}', encode($1, 'hex'))::text END \
             FROM upd"
        );
        release
    }
}

/// Version of the server functions' bodies, part of their names: a release that changes a body
/// changes the names, so processes of two versions never replace each other's functions.
const FUNCTIONS_VERSION: u32 = 1;

/// The DDL of the PL/pgSQL functions `server_functions` calls (see
/// [`PostgresBackendBuilder::server_functions`]): `<table>_acquire_v1`, `<table>_acquire_nf_v1`
/// (no flush wait, for `synchronous_commit(false)`), `<table>_release_v1`, `<table>_extend_v1`
/// and `<table>_extend_nf_v1`, each wrapping the statement the backend otherwise sends. Teams
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
    let (acquire_d, extend_d) = grant_statements(table, true);
    let (acquire_nf, extend_nf) = grant_statements(table, false);
    let release = release_statement(table, &channel);
    // Result columns are named r_*, unlike any table column, so no name in the bodies is
    // ambiguous between a column and an output parameter.
    let grant_args = "bytea, text, bigint";
    let acquire_ret = "r_fence bigint, r_count integer, r_remaining_us bigint, r_sc text";
    let defs: [(&str, &str, &str, &str); 5] = [
        ("acquire", grant_args, acquire_ret, &acquire_d),
        ("acquire_nf", grant_args, acquire_ret, &acquire_nf),
        (
            "release",
            "bytea, text, boolean, bigint",
            "r_remaining integer, r_notified text",
            &release,
        ),
        ("extend", grant_args, "r_one integer", &extend_d),
        ("extend_nf", grant_args, "r_one integer", &extend_nf),
    ];
    let ddl = defs
        .iter()
        .map(|(name, args, ret, body)| {
            format!(
                "CREATE OR REPLACE FUNCTION {table}_{name}_v{v}({args}) RETURNS TABLE ({ret}) \
                 LANGUAGE plpgsql AS $dlock$ BEGIN RETURN QUERY {body}; END $dlock$;\n"
            )
        })
        .collect();
    let exist = defs
        .iter()
        .map(|(name, args, _, _)| {
            format!("to_regprocedure('{table}_{name}_v{v}({args})') IS NOT NULL")
        })
        .collect::<Vec<_>>()
        .join(" AND ");
    let nf = if durable { "" } else { "_nf" };
    Functions {
        ddl,
        exist: format!("SELECT {exist}"),
        acquire: format!("SELECT * FROM {table}_acquire{nf}_v{v}($1, $2, $3)"),
        release: format!("SELECT * FROM {table}_release_v{v}($1, $2, $3, $4)"),
        extend: format!("SELECT * FROM {table}_extend{nf}_v{v}($1, $2, $3)"),
    }
}

impl Sql {
    /// `durable`: grants and renewals wait for their commit's WAL flush (the default).
    fn new(table: &str, durable: bool) -> Result<Sql, LockError> {
        let schema = postgres_schema_sql(table)?;
        let channel = channel_of(table);
        let (acquire, extend) = grant_statements(table, durable);
        let release = release_statement(table, &channel);
        let functions = functions(table, durable);
        // Rows idle this long can be deleted: a statement that took a sequence number before the
        // deletion is long dead (statement_timeout), so tokens still follow the grant order.
        let sweep = format!(
            "DELETE FROM {table} WHERE expires_at < clock_timestamp() - interval '5 minutes'"
        );
        Ok(Sql {
            acquire,
            release,
            extend,
            sweep,
            schema,
            channel,
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
            tls_roots: Vec::new(),
        }
    }

    /// Advisory-lock mode: locks are `pg_try_advisory_lock` on one dedicated session of this
    /// backend instead of rows (see [`crate::postgres_advisory_key`] for the key and its collision
    /// story). A lock dies with the session; holders hear `lost()` at their next renewal.
    /// Refused with [`LockError::Config`] behind a transaction-mode pooler (detected at connect
    /// by two `pg_backend_pid()` calls that disagree). The table's sequence still mints the
    /// fencing tokens and `NOTIFY` still wakes waiters. Needs the connection settings (a URL, or
    /// [`PostgresBackendBuilder::listen_config`] with a caller's pool).
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

    /// Trusts the CA certificate(s) in `pem` for TLS connections, besides the system's trust
    /// store (feature `postgres-tls`). TLS itself is asked for by the URL: `sslmode=require`
    /// (or `verify-ca` / `verify-full`: with rustls the server's certificate and name are always
    /// verified), and `sslrootcert=/path/ca.pem` adds a CA file as this method does. Without
    /// `sslmode=require|verify-*` (libpq's default `prefer`) the connection is plain text.
    #[cfg(feature = "postgres-tls")]
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
        let options = match cfg.get_options() {
            Some(o) if !o.is_empty() => format!("{o} {st}"),
            _ => st,
        };
        cfg.options(options);
        cfg.application_name("dlock");
        Ok(cfg)
    }

    /// Checks the settings, connects, and creates the table when missing (unless turned off),
    /// so a wrong address, password or table fails here.
    pub async fn connect(self) -> Result<PostgresBackend, LockError> {
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
            );
            // Opens the session now: a pooler in between is refused here.
            a.start().await?;
            Some(Arc::new(a))
        } else {
            None
        };
        let cancel = CancellationToken::new();
        let (ready_tx, ready_rx) = tokio_watch::channel(false);
        let backend = PostgresBackend {
            inner: Arc::new(Inner {
                pool,
                listen_config,
                sql,
                url,
                table: self.table.clone(),
                op_timeout: self.op_timeout,
                connect_timeout: self.connect_timeout,
                waiters: WaitQueues::new(),
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
            }),
        };
        if self.create_schema {
            backend.create_schema().await?;
        } else {
            backend.ping().await?;
        }
        if !self.advisory && self.server_functions != Some(false) {
            match backend.ensure_functions(self.create_schema).await {
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
    async fn ensure_functions(&self, create: bool) -> Result<(), LockError> {
        let f = &self.inner.sql.functions;
        let pool = &self.inner.pool;
        let mut last = None;
        for attempt in 0..3u64 {
            let r = bounded("", "the server functions", self.inner.op_timeout, async {
                let c = pool.get().await?;
                let rows = c.simple_query(&f.exist).await?;
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
            if !prepared {
                return Ok::<_, DynError>(c.query_typed(sql, params).await?);
            }
            // Parsed and planned once per connection (a generic plan after PostgreSQL's first
            // custom ones), then one Bind/Execute per call.
            let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
            let st = c.prepare_typed_cached(sql, &types).await?;
            let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
            Ok(c.query(&st, &values).await?)
        })
        .await
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

    /// Advisory mode: a lock freed by a dying session sends no NOTIFY, so while there are local
    /// waiters one task wakes the first waiter of each name every `RECHECK` (500 ms). It runs
    /// until the backend is dropped (or its runtime shuts down: the next `watch` restarts it).
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
        let waiters = Arc::downgrade(&self.inner.waiters);
        let cancel = self.inner.cancel.clone();
        *slot = Some(rt.spawn(async move {
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(RECHECK) => {}
                }
                let Some(w) = waiters.upgrade() else { return };
                w.wake_first_of_each();
            }
        }));
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
#[allow(clippy::too_many_arguments)]
async fn listen_loop(
    cfg: tokio_postgres::Config,
    connector: Connector,
    channel: String,
    waiters: std::sync::Weak<WaitQueues>,
    ready: Arc<tokio_watch::Sender<bool>>,
    cancel: CancellationToken,
    op_timeout: Duration,
    connect_timeout: Duration,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        if cancel.is_cancelled() || waiters.strong_count() == 0 {
            return;
        }
        let w = waiters.clone();
        let chan = channel.clone();
        let on: OnNotify = Box::new(move |n: &tokio_postgres::Notification| {
            if n.channel() == chan
                && let Some(name) = hex_name(n.payload())
                && let Some(w) = w.upgrade()
            {
                w.wake_one(&name);
            }
        });
        if let Ok(Ok((client, mut driver))) =
            tokio::time::timeout(connect_timeout, connector.connect(&cfg, Some(on))).await
        {
            let listen = format!("LISTEN \"{channel}\"");
            if let Ok(Ok(())) =
                tokio::time::timeout(op_timeout, client.batch_execute(&listen)).await
            {
                backoff = Duration::from_millis(100);
                let _ = ready.send(true);
                if let Some(w) = waiters.upgrade() {
                    w.wake_all();
                }
                loop {
                    tokio::select! {
                        _ = &mut driver => break,
                        _ = cancel.cancelled() => { driver.abort(); return; }
                        _ = tokio::time::sleep(Duration::from_secs(2)) => {
                            let alive = matches!(
                                tokio::time::timeout(op_timeout, client.simple_query("SELECT 1")).await,
                                Ok(Ok(_))
                            );
                            if !alive {
                                break;
                            }
                        }
                    }
                }
            }
            driver.abort();
            let _ = ready.send(false);
            if let Some(w) = waiters.upgrade() {
                w.wake_all();
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

impl Backend for PostgresBackend {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(async move {
            if let Some(a) = &self.inner.advisory {
                return a.try_acquire(name, owner).await;
            }
            let ttl_us = micros(ttl);
            let rows = self
                .query(
                    name,
                    "the acquire statement",
                    self.sql_for(|s| &s.acquire, |f| &f.acquire),
                    &[
                        (&name.as_bytes(), Type::BYTEA),
                        (&owner, Type::TEXT),
                        (&ttl_us, Type::INT8),
                    ],
                )
                .await?;
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
                return a.release(name, owner, keep_for, all).await;
            }
            let keep: Option<i64> = keep_for.filter(|k| !k.is_zero()).map(micros);
            let rows = self
                .query(
                    name,
                    "the release statement",
                    self.sql_for(|s| &s.release, |f| &f.release),
                    &[
                        (&name.as_bytes(), Type::BYTEA),
                        (&owner, Type::TEXT),
                        (&all, Type::BOOL),
                        (&keep, Type::INT8),
                    ],
                )
                .await?;
            let Some(row) = rows.first() else {
                return Ok(Released::NotOwner);
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
