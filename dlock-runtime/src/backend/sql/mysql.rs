//! The MySQL / MariaDB lock-table backend: one row per lock name, expiry by `UTC_TIMESTAMP(6)`,
//! statements that take only one row's record lock, waiting by one poller per name and process.
//!
//! See [`MysqlBackend`].

use std::collections::HashMap;
use std::fmt;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Opts, OptsBuilder, Pool, PoolConstraints, PoolOpts, Row};
use tokio::task::JoinHandle;

use super::{DEFAULT_TABLE, bounded, check_table, micros, redact_url};
use crate::LockError;
use crate::backend::{Acquired, Backend, BoxFuture, Extended, Released, Watch};
use crate::wait::WaitQueues;

type DynError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Shortest and longest pause of a waiting poller (jittered between them, and never past the
/// holder's remaining lease).
const POLL_MIN: Duration = Duration::from_millis(100);
const POLL_MAX: Duration = Duration::from_millis(250);

/// The DDL of the lock table `table`, as the backend runs it on first use (idempotent).
///
/// ```text
/// CREATE TABLE IF NOT EXISTS dlock_locks (
///     name       VARBINARY(1024) NOT NULL PRIMARY KEY, -- the lock name (UTF-8 bytes)
///     owner      VARBINARY(255)  NOT NULL,             -- the holder's owner id (exact bytes)
///     count      INT             NOT NULL,             -- hold count; 0 = free or kept
///     fence      BIGINT UNSIGNED NOT NULL,             -- fencing token of the last grant
///     expires_at DATETIME(6)     NOT NULL,             -- end of the lease, UTC, database clock
///     holder     VARCHAR(255) CHARACTER SET utf8mb4 NULL -- who holds it: name@host:pid
/// ) ENGINE = InnoDB;
/// -- A table of an older version gains the holder column at connect (when it is missing):
/// ALTER TABLE dlock_locks ADD COLUMN holder VARCHAR(255) CHARACTER SET utf8mb4 NULL;
/// -- Leader records (dlock::Election::proclaim / observe), one per lock name:
/// CREATE TABLE IF NOT EXISTS dlock_locks_records (
///     name  VARBINARY(1024) NOT NULL PRIMARY KEY, -- the lock name
///     epoch BIGINT UNSIGNED NOT NULL,             -- the term that wrote it
///     value LONGBLOB        NOT NULL              -- the value (UTF-8)
/// ) ENGINE = InnoDB;
/// ```
///
/// Rows are kept after release (count 0, `expires_at` = release time) so that a hot name needs
/// one statement per acquire; rows free or expired for longer than the backend's `sweep_after`
/// (default 5 minutes) are deleted now and then (see [`MysqlBackendBuilder::sweep_after`]).
pub fn mysql_schema_sql(table: &str) -> Result<String, LockError> {
    check_table(table)?;
    Ok(format!(
        "CREATE TABLE IF NOT EXISTS {table} (\n    \
             name VARBINARY(1024) NOT NULL PRIMARY KEY,\n    \
             owner VARBINARY(255) NOT NULL,\n    \
             count INT NOT NULL,\n    \
             fence BIGINT UNSIGNED NOT NULL,\n    \
             expires_at DATETIME(6) NOT NULL,\n    \
             holder VARCHAR(255) CHARACTER SET utf8mb4 NULL\n\
         ) ENGINE = InnoDB;\n\
         CREATE TABLE IF NOT EXISTS {table}_records (\n    \
             name VARBINARY(1024) NOT NULL PRIMARY KEY,\n    \
             epoch BIGINT UNSIGNED NOT NULL,\n    \
             value LONGBLOB NOT NULL\n\
         ) ENGINE = InnoDB;\n"
    ))
}

pub(crate) fn hex(out: &mut String, bytes: &[u8]) {
    out.push_str("X'");
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out.push('\'');
}

/// Settings of a [`MysqlBackend`]; build one with [`MysqlBackend::builder`] or
/// [`MysqlBackend::builder_with_pool`].
#[derive(Clone)]
pub struct MysqlBackendBuilder {
    url: Option<String>,
    pool: Option<Pool>,
    table: String,
    pool_size: usize,
    op_timeout: Duration,
    lock_wait_timeout_s: u32,
    create_schema: bool,
    sweep_after: Duration,
    require_tls: bool,
    tls_roots: Vec<Vec<u8>>,
}

impl fmt::Debug for MysqlBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlBackendBuilder")
            .field("url", &self.url.as_deref().map(redact_url))
            .field("own_pool", &self.pool.is_none())
            .field("table", &self.table)
            .field("pool_size", &self.pool_size)
            .field("op_timeout", &self.op_timeout)
            .field("create_schema", &self.create_schema)
            .field("require_tls", &self.require_tls)
            .field("tls_roots", &self.tls_roots.len())
            .finish_non_exhaustive()
    }
}

impl MysqlBackendBuilder {
    fn defaults() -> Self {
        MysqlBackendBuilder {
            url: None,
            pool: None,
            table: DEFAULT_TABLE.to_string(),
            pool_size: 8,
            op_timeout: Duration::from_secs(3),
            lock_wait_timeout_s: 2,
            create_schema: true,
            sweep_after: Duration::from_secs(300),
            require_tls: false,
            tls_roots: Vec::new(),
        }
    }

    /// Requires TLS on every connection of the backend's own pool (feature `mysql-tls`), as the
    /// URL parameter `require_ssl=true` does: the server's certificate is verified against the
    /// built-in Mozilla roots plus [`MysqlBackendBuilder::tls_root_cert`] / `ssl_ca`, and its name
    /// against the URL's host. A server without TLS, or a certificate that does not verify, is a
    /// [`LockError`] at connect, never a plain-text fallback. There is no "prefer" mode: without
    /// this, `require_ssl=true`, `ssl_ca` or a root certificate, connections are plain text.
    #[cfg(feature = "mysql-tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql-tls")))]
    pub fn require_tls(mut self, on: bool) -> Self {
        self.require_tls = on;
        self
    }

    /// Trusts the CA certificate(s) in `pem` for the server's certificate, besides the built-in
    /// roots (feature `mysql-tls`); implies [`MysqlBackendBuilder::require_tls`]. The URL
    /// parameter `ssl_ca=/path/ca.pem` adds a CA file the same way, and `built_in_roots=false`
    /// trusts only the given ones. (The driver's `verify_ca=false` turns the certificate check
    /// off: encrypted, but not authenticated. Its `verify_identity=false` does not skip the
    /// name check with the rustls version in use: the driver matches an error text that
    /// rustls no longer produces.)
    #[cfg(feature = "mysql-tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql-tls")))]
    pub fn tls_root_cert(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_roots.push(pem.into());
        self
    }

    /// Takes the backend's own `ssl_ca=<path>` parameter out of a `mysql://` URL (mysql_async
    /// refuses parameters it does not know); returns the URL without it and the path.
    fn split_ssl_ca(url: &str) -> (String, Option<String>) {
        let Some((base, query)) = url.split_once('?') else {
            return (url.to_string(), None);
        };
        let mut ca = None;
        let mut kept = Vec::new();
        for kv in query.split('&') {
            match kv.split_once('=') {
                Some(("ssl_ca", path)) => ca = Some(path.to_string()),
                _ => kept.push(kv),
            }
        }
        let url = if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        (url, ca)
    }

    /// Whether any TLS setting asks for TLS.
    fn tls_asked(&self, opts: Option<&Opts>, ca_file: Option<&str>) -> bool {
        self.require_tls
            || !self.tls_roots.is_empty()
            || ca_file.is_some()
            || opts.is_some_and(|o| o.ssl_opts().is_some())
    }

    /// The TLS options of the backend's own connections: `None` for plain text.
    fn tls_opts(
        &self,
        opts: &Opts,
        ca_file: Option<String>,
    ) -> Result<Option<mysql_async::SslOpts>, LockError> {
        if !self.tls_asked(Some(opts), ca_file.as_deref()) {
            return Ok(None);
        }
        #[cfg(not(feature = "mysql-tls"))]
        {
            // Without a TLS feature the driver panics when asked for TLS.
            let _ = ca_file;
            Err(LockError::Config(
                "MySQL TLS (require_ssl=true, ssl_ca) needs dlock's `mysql-tls` feature".into(),
            ))
        }
        #[cfg(feature = "mysql-tls")]
        {
            use rustls::pki_types::{CertificateDer, pem::PemObject};
            let mut pems = self.tls_roots.clone();
            if let Some(path) = ca_file {
                pems.push(
                    std::fs::read(&path)
                        .map_err(|e| LockError::Config(format!("MySQL ssl_ca {path}: {e}")))?,
                );
            }
            let base = opts.ssl_opts().cloned().unwrap_or_default();
            let mut roots = base.root_certs().to_vec();
            for pem in pems {
                // Checked here so that a bad file is a Config error, not a failure per connect.
                let mut n = 0;
                for c in CertificateDer::pem_slice_iter(&pem) {
                    c.map_err(|e| LockError::Config(format!("MySQL TLS root certificate: {e}")))?;
                    n += 1;
                }
                if n == 0 {
                    return Err(LockError::Config(
                        "MySQL TLS root certificate: no PEM certificate in it".into(),
                    ));
                }
                roots.push(pem.into());
            }
            // mysql_async builds its rustls config from the process-default crypto provider.
            crate::backend::ensure_crypto_provider();
            Ok(Some(base.with_root_certs(roots)))
        }
    }

    /// The lock table: `table` or `database.table` (default `dlock_locks`).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Most connections in the backend's own pool (default 8).
    pub fn pool_size(mut self, n: usize) -> Self {
        self.pool_size = n.max(1);
        self
    }

    /// Client-side bound of every call (pool checkout + statements), after which the call fails
    /// with [`LockError::Backend`] (default 3 s). Server-side, `innodb_lock_wait_timeout` is 2 s
    /// on the backend's own connections.
    pub fn op_timeout(mut self, t: Duration) -> Self {
        self.op_timeout = t;
        self
    }

    /// Rows free or expired for longer than this are deleted in the background, every 256th
    /// freeing release of this backend (default 5 minutes). Safe for the fencing tokens as long
    /// as the database clock does not step back by more than this: a name's next token is at
    /// least the database time in µs, which by then is past any token of the deleted row.
    pub fn sweep_after(mut self, d: Duration) -> Self {
        self.sweep_after = d;
        self
    }

    /// Whether to create the table when missing (default true).
    pub fn create_schema(mut self, on: bool) -> Self {
        self.create_schema = on;
        self
    }

    /// The connection options of the URL with the TLS settings applied (TLS parameters taken
    /// out, roots loaded), whether TLS is on, and the URL without its password.
    pub(crate) fn url_opts(&self) -> Result<(OptsBuilder, bool, String), LockError> {
        let (url, ca_file) = Self::split_ssl_ca(self.url.as_deref().unwrap_or_default());
        let opts = Opts::from_url(&url).map_err(|e| {
            LockError::Config(format!("invalid MySQL URL {}: {e}", redact_url(&url)))
        })?;
        let ssl = self.tls_opts(&opts, ca_file)?;
        let tls = ssl.is_some();
        let mut opts = OptsBuilder::from_opts(opts);
        if tls {
            // Stay on TCP: the driver would otherwise move a connection to a server on
            // this host onto its Unix socket, where it does not use TLS.
            opts = opts.prefer_socket(false).ssl_opts(ssl);
        }
        Ok((opts, tls, redact_url(&url)))
    }

    /// Checks the settings, connects and creates the table when missing.
    ///
    /// A URL may name the table as the CLI's does: `?dlock_table=<table>` (taken out before the
    /// driver sees the URL; `dlock_mode=table` is accepted, the only MySQL mode).
    pub async fn connect(mut self) -> Result<MysqlBackend, LockError> {
        if let Some(url) = self.url.take() {
            let p = super::split_dlock_params(&url)
                .map_err(|e| LockError::Config(format!("MySQL URL: {e}")))?;
            self.table = super::table_from_url(&self.table, p.table)?;
            match p.mode.as_deref() {
                None | Some("table") => {}
                Some(m) => {
                    return Err(LockError::Config(format!(
                        "dlock_mode={m}: MySQL has one mode, `table`"
                    )));
                }
            }
            self.url = Some(p.url);
        }
        check_table(&self.table)?;
        let mut tls = false;
        let (pools, url) = match self.pool.clone() {
            Some(p) => {
                if self.tls_asked(None, None) {
                    return Err(LockError::Config(
                        "MySQL TLS settings of the builder apply to the backend's own pool: with \
                         a caller's pool, set TLS on the pool's Opts (OptsBuilder::ssl_opts)"
                            .into(),
                    ));
                }
                (Pools::Caller(p), "<caller's pool>".to_string())
            }
            None => {
                let (opts, with_tls, url) = self.url_opts()?;
                tls = with_tls;
                let constraints = PoolConstraints::new(0, self.pool_size)
                    .ok_or_else(|| LockError::Config("invalid MySQL pool size".into()))?;
                let opts = opts
                    .client_found_rows(true)
                    .init(vec![
                        format!(
                            "SET SESSION innodb_lock_wait_timeout = {}",
                            self.lock_wait_timeout_s
                        ),
                        "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED".to_string(),
                        "SET SESSION autocommit = 1".to_string(),
                    ])
                    .pool_opts(
                        PoolOpts::new()
                            .with_constraints(constraints)
                            .with_reset_connection(false),
                    );
                (
                    Pools::Own {
                        opts: opts.into(),
                        by_runtime: Mutex::new(Vec::new()),
                    },
                    url,
                )
            }
        };
        let backend = MysqlBackend {
            inner: Arc::new(Inner {
                pools,
                url,
                table: self.table.clone(),
                op_timeout: self.op_timeout,
                waiters: WaitQueues::new(),
                pollers: Mutex::new(HashMap::new()),
                releases: std::sync::atomic::AtomicU64::new(0),
                sweep_after_us: micros(self.sweep_after),
                unconfirmed: super::Unconfirmed::default(),
                holder: std::sync::atomic::AtomicBool::new(false),
            }),
        };
        let ddl = if self.create_schema {
            mysql_schema_sql(&self.table)?
        } else {
            format!("SELECT 1 FROM {} LIMIT 0", self.table)
        };
        let mut last = None;
        for _ in 0..3 {
            match backend.exec("", "the schema DDL", ddl.clone()).await {
                Ok(()) => {
                    backend.holder_column(self.create_schema).await;
                    return Ok(backend);
                }
                Err(e) if tls && no_server_tls(&e) => {
                    return Err(LockError::backend(
                        "",
                        NoServerTls {
                            url: backend.inner.url.clone(),
                            source: e,
                        },
                    ));
                }
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(last.unwrap_or_else(|| LockError::Config("schema creation failed".into())))
    }
}

/// Locks in a MySQL or MariaDB table (InnoDB), shared by every process using the same table.
///
/// Cheap to clone.
///
/// * **Clock**: expiry is decided by `UTC_TIMESTAMP(6)` in each statement; the client's clock is
///   never read.
/// * **No deadlocks**: acquire is one round trip of three autocommit statements: an `UPDATE` by
///   primary key (take over an expired row or re-enter), an `INSERT IGNORE` (first use of a
///   name) and a `SELECT` of the row. Each takes at most one row's record lock and never
///   upgrades a shared lock to an exclusive one, so contenders queue instead of deadlocking
///   (no `INSERT … ON DUPLICATE KEY UPDATE`, whose S→X upgrade deadlocks under contention).
///   A deadlock or lock-wait error would still be retried twice inside the call.
/// * **Fencing tokens**: `GREATEST(last token of the row + 1, database time in µs)`, so they
///   increase per name across releases and expiries, and across a row deleted behind the
///   backend's back as long as the database clock moves forward (as on Redis).
/// * **Rows** stay after release (count 0) and are swept once free or expired for
///   `sweep_after` (every 256th freeing release runs one bounded `DELETE` in the background);
///   an expired row of a crashed holder is taken over by the next acquire before that.
/// * **TLS** (feature `mysql-tls`, rustls): `require_ssl=true` in the URL or
///   `MysqlBackendBuilder::require_tls`; the server's certificate is verified (built-in roots,
///   `ssl_ca=/path` or `MysqlBackendBuilder::tls_root_cert`); no plain-text fallback.
/// * **Waiting** polls: one poller per name and process, in front of the local wait queue, reads
///   the row every 100–250 ms (jittered, never past the holder's remaining lease) and wakes one
///   local waiter when the lock is free. A release in this process wakes a local waiter at once.
#[derive(Clone)]
pub struct MysqlBackend {
    inner: Arc<Inner>,
}

/// The connections: the caller's pool as given, or pools of the backend's own, one per live
/// tokio runtime. A mysql_async pool runs a task on the runtime that created it and is
/// disconnected when that runtime shuts down, so a backend registered once and used from many
/// runtimes (`#[tokio::test]`s) makes a pool for each on first use, and forgets the pools of
/// runtimes that are gone.
enum Pools {
    Caller(Pool),
    Own {
        opts: Opts,
        /// (runtime, its pool, a task on that runtime that finishes when it shuts down)
        by_runtime: Mutex<Vec<(tokio::runtime::Id, Pool, JoinHandle<()>)>>,
    },
}

impl Pools {
    fn here(&self) -> Result<Pool, LockError> {
        let (opts, by_runtime) = match self {
            Pools::Caller(p) => return Ok(p.clone()),
            Pools::Own { opts, by_runtime } => (opts, by_runtime),
        };
        let rt = tokio::runtime::Handle::try_current().map_err(|_| {
            LockError::Config("dlock's MySQL backend must be used inside a tokio runtime".into())
        })?;
        let id = rt.id();
        let mut v = by_runtime.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, p, _)) = v.iter().find(|(r, _, _)| *r == id) {
            return Ok(p.clone());
        }
        v.retain(|(_, _, alive)| !alive.is_finished());
        let pool = Pool::new(opts.clone());
        let alive = rt.spawn(std::future::pending::<()>());
        v.push((id, pool.clone(), alive));
        Ok(pool)
    }
}

impl Drop for Pools {
    fn drop(&mut self) {
        if let Pools::Own { by_runtime, .. } = self {
            for (_, _, alive) in by_runtime
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .drain(..)
            {
                alive.abort();
            }
        }
    }
}

struct Inner {
    pools: Pools,
    url: String,
    table: String,
    op_timeout: Duration,
    waiters: Arc<WaitQueues>,
    pollers: Mutex<HashMap<String, JoinHandle<()>>>,
    releases: std::sync::atomic::AtomicU64,
    sweep_after_us: i64,
    /// Releases whose answer was not read (see [`super::Unconfirmed`]).
    unconfirmed: super::Unconfirmed,
    /// Grants store the holder identity (the table has the `holder` column).
    holder: std::sync::atomic::AtomicBool,
}

impl fmt::Debug for MysqlBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlBackend")
            .field("url", &self.inner.url)
            .field("table", &self.inner.table)
            .finish_non_exhaustive()
    }
}

/// TLS was required but the server does not offer it (MySQL/MariaDB without `ssl_cert`).
#[derive(Debug)]
struct NoServerTls {
    url: String,
    source: LockError,
}

impl fmt::Display for NoServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "TLS is required but the MySQL server at {} does not offer it (its have_ssl is not \
             YES); no plain-text fallback",
            self.url
        )
    }
}

impl std::error::Error for NoServerTls {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// Whether `e` is the driver's "server does not have the SSL capability".
fn no_server_tls(e: &LockError) -> bool {
    matches!(
        e,
        LockError::Backend { source, .. }
            if matches!(
                source.downcast_ref::<mysql_async::Error>(),
                Some(mysql_async::Error::Driver(
                    mysql_async::DriverError::NoClientSslFlagFromServer
                ))
            )
    )
}

/// Retries a call that failed with a deadlock (1213) or lock-wait timeout (1205); neither can
/// have changed anything (InnoDB rolled the statement back).
fn retryable(e: &LockError) -> bool {
    if let LockError::Backend { source, .. } = e
        && let Some(mysql_async::Error::Server(s)) = source.downcast_ref::<mysql_async::Error>()
    {
        return s.code == 1213 || s.code == 1205;
    }
    false
}

impl MysqlBackend {
    /// Settings for a backend with its own pool, from a `mysql://` URL (MariaDB too).
    pub fn builder(url: &str) -> MysqlBackendBuilder {
        MysqlBackendBuilder {
            url: Some(url.to_string()),
            ..MysqlBackendBuilder::defaults()
        }
    }

    /// Settings for a backend on the caller's mysql_async pool (its connections must be in
    /// autocommit mode; `client_found_rows` is not needed).
    pub fn builder_with_pool(pool: Pool) -> MysqlBackendBuilder {
        MysqlBackendBuilder {
            pool: Some(pool),
            ..MysqlBackendBuilder::defaults()
        }
    }

    /// Connects with default settings.
    pub async fn connect(url: &str) -> Result<MysqlBackend, LockError> {
        Self::builder(url).connect().await
    }

    /// The URL without its password.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// The lock table.
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    /// Number of callers waiting in this process.
    pub fn waiter_count(&self) -> usize {
        self.inner.waiters.waiter_count()
    }

    /// Number of names this process polls for now (one poller per name with local waiters).
    pub fn poller_count(&self) -> usize {
        self.inner
            .pollers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|h| !h.is_finished())
            .count()
    }

    /// The pool the backend runs its statements on.
    ///
    /// With the backend's own pools, the one of the current tokio runtime (created on first use).
    pub fn pool(&self) -> Result<Pool, LockError> {
        self.inner.pools.here()
    }

    async fn exec(&self, key: &str, what: &'static str, sql: String) -> Result<(), LockError> {
        let pool = self.inner.pools.here()?;
        bounded(key, what, self.inner.op_timeout, async {
            let mut c = pool.get_conn().await?;
            c.query_drop(sql).await?;
            Ok::<_, DynError>(())
        })
        .await
    }

    /// Finds whether the table has the `holder` column; adds it to a table of an older version
    /// when `create` (`create_schema`). Best effort: without it, holders are not named.
    async fn holder_column(&self, create: bool) {
        let t = &self.inner.table;
        let check = format!("SELECT holder FROM {t} LIMIT 0");
        let mut has = self
            .exec("", "the holder column check", check.clone())
            .await
            .is_ok();
        if !has && create {
            // Two processes adding it at once: the second one's "duplicate column" is fine.
            let _ = self
                .exec(
                    "",
                    "adding the holder column",
                    format!(
                        "ALTER TABLE {t} ADD COLUMN holder VARCHAR(255) CHARACTER SET utf8mb4 NULL"
                    ),
                )
                .await;
            has = self
                .exec("", "the holder column check", check)
                .await
                .is_ok();
        }
        if !has {
            tracing::info!(
                table = %t,
                "dlock: MySQL lock table without the holder column; holders are not named (add it: see dlock::mysql_schema_sql)"
            );
        }
        self.inner
            .holder
            .store(has, std::sync::atomic::Ordering::Relaxed);
    }

    /// Runs a multi-statement text query and returns the rows of its last result set.
    async fn last_rows(
        inner: &Inner,
        key: &str,
        what: &'static str,
        sql: &str,
    ) -> Result<Vec<Row>, LockError> {
        let pool = inner.pools.here()?;
        let mut attempt = 0;
        loop {
            let r = bounded(key, what, inner.op_timeout, async {
                let mut c = pool.get_conn().await?;
                let mut res = c.query_iter(sql).await?;
                let mut rows: Vec<Row> = Vec::new();
                while !res.is_empty() {
                    let set: Vec<Row> = res.collect().await?;
                    if !set.is_empty() {
                        rows = set;
                    }
                }
                Ok::<_, DynError>(rows)
            })
            .await;
            match r {
                Err(e) if attempt < 2 && retryable(&e) => attempt += 1,
                r => return r,
            }
        }
    }

    /// Every 256th freeing release, deletes (in the background, at most 1,000 per run) rows
    /// free or expired for longer than `sweep_after`, so rows of names no longer used do not
    /// accumulate. The DELETE runs under READ COMMITTED whatever the pool's isolation (a
    /// caller's pool is usually at MySQL's REPEATABLE READ, under which the scan kept a lock on
    /// every row it read, live ones included, until it ended: renewals and releases of unrelated
    /// names waited for it; sql.md #8), so it locks only the rows it deletes; in key order (safe
    /// for statement-based binlogs). A deadlock or lock-wait error only skips this run.
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
            // `SET TRANSACTION` (no SESSION): for the next transaction only, the DELETE's.
            let sql = format!(
                "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; \
                 DELETE FROM {} WHERE expires_at < UTC_TIMESTAMP(6) - INTERVAL {} MICROSECOND \
                 ORDER BY name LIMIT 1000",
                me.inner.table, me.inner.sweep_after_us
            );
            if let Err(e) = me.exec("", "the sweep", sql).await {
                tracing::debug!(error = %e, "dlock: MySQL sweep of idle rows failed");
            }
        });
    }

    fn ensure_poller(&self, name: &str) {
        let mut map = self.inner.pollers.lock().unwrap_or_else(|e| e.into_inner());
        if map.get(name).is_some_and(|h| !h.is_finished()) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let h = rt.spawn(poll_loop(Arc::downgrade(&self.inner), name.to_string()));
        map.insert(name.to_string(), h);
    }
}

fn jitter() -> Duration {
    let r = getrandom::u64().unwrap_or(0);
    POLL_MIN + Duration::from_micros(r % (POLL_MAX - POLL_MIN).as_micros() as u64)
}

/// One name's poller: while the name has local waiters, read the holder's remaining lease and
/// wake one waiter when the lock is free.
async fn poll_loop(inner: Weak<Inner>, name: String) {
    let mut sql =
        String::from("SELECT TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) FROM ");
    loop {
        let Some(inner) = inner.upgrade() else { return };
        {
            let mut map = inner.pollers.lock().unwrap_or_else(|e| e.into_inner());
            if !inner.waiters.has_waiters(&name) {
                map.remove(&name);
                return;
            }
        }
        if sql.ends_with("FROM ") {
            sql.push_str(&inner.table);
            sql.push_str(" WHERE name = ");
            hex(&mut sql, name.as_bytes());
        }
        let mut pause = jitter();
        if let Ok(rows) = MysqlBackend::last_rows(&inner, &name, "the wait poll", &sql).await {
            let rem = rows
                .first()
                .and_then(|r| r.get::<Option<i64>, _>(0).flatten());
            match rem {
                // Held (or kept by hold_at_least): look again, but not after the lease ends.
                Some(rem) if rem > 0 => pause = pause.min(Duration::from_micros(rem as u64)),
                // Free, expired or gone: the next local waiter tries.
                _ => {
                    inner.waiters.wake_one(&name);
                }
            }
        }
        drop(inner);
        tokio::time::sleep(pause).await;
    }
}

impl super::ReleaseOnce for MysqlBackend {
    fn unconfirmed(&self) -> &super::Unconfirmed {
        &self.inner.unconfirmed
    }

    /// One release (see [`super::release_until_confirmed`]).
    fn release_once<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> BoxFuture<'a, Result<Released, LockError>> {
        Box::pin(async move {
            let t = &self.inner.table;
            let (mut n, mut o) = (String::new(), String::new());
            hex(&mut n, name.as_bytes());
            hex(&mut o, owner.as_bytes());
            let keep = keep_for.filter(|k| !k.is_zero());
            let end = match keep {
                Some(k) => format!("UTC_TIMESTAMP(6) + INTERVAL {} MICROSECOND", micros(k)),
                None => "UTC_TIMESTAMP(6)".to_string(),
            };
            // Both assignments read the row's old `count` (expires_at is assigned first), so the
            // statement means the same under MySQL's left-to-right assignment and MariaDB's
            // SIMULTANEOUS_ASSIGNMENT sql_mode (sql.md #6: with `expires_at = IF(count = 0, ..)`
            // after `count`, MariaDB read the old count, never 0, and a release never ended the
            // lease: every hand-off waited a ttl).
            //
            // The holds left are read with the owner checked (sql.md #14): the SELECT runs after
            // the UPDATE's commit, and another owner may have taken the freed row in between;
            // its count is not ours (NULL: freed).
            let sql = format!(
                "UPDATE {t} SET \
                   expires_at = IF({all} OR count <= 1, {end}, expires_at), \
                   count = IF({all} OR count <= 1, 0, count - 1) \
                 WHERE name = {n} AND owner = {o} AND count > 0 AND expires_at > UTC_TIMESTAMP(6); \
                 SELECT ROW_COUNT(), (SELECT count FROM {t} WHERE name = {n} AND owner = {o}), \
                   (SELECT owner = {o} AND count = 0 FROM {t} WHERE name = {n})",
                all = if all { "TRUE" } else { "FALSE" }
            );
            let rows = Self::last_rows(&self.inner, name, "the release statements", &sql).await?;
            let (changed, left) = rows
                .first()
                .map(|r| {
                    (
                        r.get::<i64, _>(0).unwrap_or(0),
                        r.get::<Option<i64>, _>(1).flatten().unwrap_or(0),
                    )
                })
                .unwrap_or((0, 0));
            if changed == 0 {
                // Nothing of the owner held. After a release of it whose answer was lost, the
                // row tells whether that one was applied: the owner's row at count 0, or no row
                // (swept); it is then reported as the release it was, not NotOwner.
                let released_by_owner = rows
                    .first()
                    .map(|r| r.get::<Option<i64>, _>(2).flatten())
                    .unwrap_or(None)
                    .is_none_or(|v| v == 1);
                if released_by_owner && self.inner.unconfirmed.contains(name, owner) {
                    return Ok(Released::Freed);
                }
                return Ok(Released::NotOwner);
            }
            if left > 0 {
                return Ok(Released::Decremented(left as u32));
            }
            if keep.is_none() {
                self.inner.waiters.wake_one(name);
            }
            self.maybe_sweep();
            Ok(Released::Freed)
        })
    }
}

impl Backend for MysqlBackend {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Acquired, LockError>> {
        Box::pin(async move {
            let t = &self.inner.table;
            let ttl = micros(ttl);
            let (mut n, mut o) = (String::new(), String::new());
            hex(&mut n, name.as_bytes());
            hex(&mut o, owner.as_bytes());
            // MySQL assigns left to right with the new values: count, fence and expires_at read
            // the old owner and expires_at; owner is set last.
            // The holder identity, stored by a grant where the table has the column.
            let (holder_set, holder_col, holder_val) =
                if self.inner.holder.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut h = String::from("CONVERT(");
                    hex(&mut h, crate::holder::holder_text().as_bytes());
                    h.push_str(" USING utf8mb4)");
                    (format!("holder = {h}, "), ", holder", format!(", {h}"))
                } else {
                    (String::new(), "", String::new())
                };
            let live = format!("(owner = {o} AND expires_at > UTC_TIMESTAMP(6))");
            let now_us = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";
            let sql = format!(
                "UPDATE {t} SET \
                   count = IF({live}, count + 1, 1), \
                   fence = IF({live}, fence, GREATEST(fence + 1, {now_us})), \
                   expires_at = IF({live}, GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL {ttl} MICROSECOND), \
                                   UTC_TIMESTAMP(6) + INTERVAL {ttl} MICROSECOND), \
                   {holder_set}owner = {o} \
                 WHERE name = {n} AND (owner = {o} OR expires_at <= UTC_TIMESTAMP(6)); \
                 INSERT IGNORE INTO {t} (name, owner, count, fence, expires_at{holder_col}) \
                   VALUES ({n}, {o}, 1, {now_us}, UTC_TIMESTAMP(6) + INTERVAL {ttl} MICROSECOND{holder_val}); \
                 SELECT owner = {o} AND expires_at > UTC_TIMESTAMP(6), fence, count, \
                   TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) \
                 FROM {t} WHERE name = {n}"
            );
            let rows = Self::last_rows(&self.inner, name, "the acquire statements", &sql).await?;
            let Some(r) = rows.first() else {
                // Deleted between the statements: report busy; the caller retries.
                return Ok(Acquired::Busy { remaining: None });
            };
            let mine: Option<i64> = r.get(0);
            let fence: Option<u64> = r.get(1);
            let count: Option<i64> = r.get(2);
            let rem: Option<Option<i64>> = r.get(3);
            Ok(match (mine, fence, count) {
                (Some(1), Some(f), Some(c)) => Acquired::Granted {
                    token: f,
                    count: c.max(1) as u32,
                },
                _ => Acquired::Busy {
                    remaining: rem
                        .flatten()
                        .map(|us| Duration::from_micros(us.max(0) as u64)),
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
        Box::pin(super::release_until_confirmed(
            self, name, owner, keep_for, all,
        ))
    }

    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Extended, LockError>> {
        Box::pin(async move {
            let t = &self.inner.table;
            let (mut n, mut o) = (String::new(), String::new());
            hex(&mut n, name.as_bytes());
            hex(&mut o, owner.as_bytes());
            // `count > 0`: a row the owner released (freed, or kept by hold_at_least) is not
            // re-held by a renewal that was sent before the release (sql.md #5).
            let sql = format!(
                "UPDATE {t} SET expires_at = UTC_TIMESTAMP(6) + INTERVAL {} MICROSECOND \
                 WHERE name = {n} AND owner = {o} AND count > 0 \
                   AND expires_at > UTC_TIMESTAMP(6); \
                 SELECT ROW_COUNT()",
                micros(ttl)
            );
            let rows = Self::last_rows(&self.inner, name, "the extend statement", &sql).await?;
            let changed = rows.first().and_then(|r| r.get::<i64, _>(0)).unwrap_or(0);
            Ok(if changed > 0 {
                Extended::Extended
            } else {
                Extended::Lost
            })
        })
    }

    fn watch<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(async move {
            let w = self.inner.waiters.register(name);
            self.ensure_poller(name);
            Ok(w)
        })
    }

    fn has_waiters(&self, name: &str) -> bool {
        self.inner.waiters.has_waiters(name)
    }

    /// The epoch-guarded write: three autocommit statements, none of which upgrades a shared
    /// row lock (no `ON DUPLICATE KEY UPDATE`, see the type's docs): an `INSERT IGNORE` for a
    /// first record, an `UPDATE` only where the stored epoch is not larger, and a read of what
    /// is stored. Written when the stored record is this one. Idempotent, so the retries of a
    /// deadlock or lock-wait error inside the call are safe.
    fn put_record<'a>(
        &'a self,
        name: &'a str,
        epoch: u64,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let t = &self.inner.table;
            let (mut n, mut v) = (String::new(), String::new());
            hex(&mut n, name.as_bytes());
            hex(&mut v, value.as_bytes());
            let sql = format!(
                "INSERT IGNORE INTO {t}_records (name, epoch, value) VALUES ({n}, {epoch}, {v}); \
                 UPDATE {t}_records SET value = {v}, epoch = {epoch} \
                   WHERE name = {n} AND epoch <= {epoch}; \
                 SELECT epoch = {epoch} AND value = {v} FROM {t}_records WHERE name = {n}"
            );
            let rows = Self::last_rows(&self.inner, name, "the record write", &sql).await?;
            Ok(rows
                .first()
                .and_then(|r| r.get::<Option<i64>, _>(0))
                .flatten()
                == Some(1))
        })
    }

    fn get_record<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<crate::backend::Record>, LockError>> {
        Box::pin(async move {
            let t = &self.inner.table;
            let mut n = String::new();
            hex(&mut n, name.as_bytes());
            let sql = format!("SELECT epoch, value FROM {t}_records WHERE name = {n}");
            let rows = Self::last_rows(&self.inner, name, "the record read", &sql).await?;
            let Some(r) = rows.first() else {
                return Ok(None);
            };
            let epoch: Option<u64> = r.get(0);
            let value: Option<Vec<u8>> = r.get(1);
            let (Some(epoch), Some(value)) = (epoch, value) else {
                return Err(LockError::backend(name, "an unreadable leader record"));
            };
            let value = String::from_utf8(value)
                .map_err(|_| LockError::backend(name, "a leader record that is not UTF-8"))?;
            Ok(Some(crate::backend::Record { epoch, value }))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_sent_as_hex_literals() {
        let mut s = String::new();
        hex(&mut s, b"a'\0");
        assert_eq!(s, "X'612700'");
        assert!(mysql_schema_sql("t; drop").is_err());
    }

    #[test]
    fn ssl_ca_is_taken_out_of_the_url() {
        let split = MysqlBackendBuilder::split_ssl_ca;
        assert_eq!(
            split("mysql://h/db?require_ssl=true&ssl_ca=/x/ca.pem&verify_ca=true"),
            (
                "mysql://h/db?require_ssl=true&verify_ca=true".to_string(),
                Some("/x/ca.pem".to_string())
            )
        );
        assert_eq!(
            split("mysql://h/db?ssl_ca=/ca.pem"),
            ("mysql://h/db".to_string(), Some("/ca.pem".to_string()))
        );
        assert_eq!(split("mysql://h/db"), ("mysql://h/db".to_string(), None));
    }

    #[cfg(not(feature = "mysql-tls"))]
    #[tokio::test]
    async fn tls_without_the_feature_is_a_config_error() {
        for url in [
            "mysql://root@127.0.0.1:1/test?require_ssl=true",
            "mysql://root@127.0.0.1:1/test?ssl_ca=/nonexistent.pem",
        ] {
            let e = MysqlBackend::connect(url).await.unwrap_err();
            assert!(
                matches!(&e, LockError::Config(m) if m.contains("mysql-tls")),
                "{e:?}"
            );
        }
    }

    #[test]
    fn poll_pauses_stay_in_their_band() {
        for _ in 0..1000 {
            let j = jitter();
            assert!((POLL_MIN..POLL_MAX).contains(&j), "{j:?}");
        }
    }
}
