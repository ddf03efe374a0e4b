//! [`Admin`] for the database engines: [`PostgresAdmin`] (the lock table, or advisory-lock mode
//! with [`PgMode::Advisory`]) and [`MysqlAdmin`] (MySQL / MariaDB lock table).
//!
//! **Addressing.** The lock table is not part of the backends' URLs, so the admin takes two
//! parameters of its own in the URL's query, and strips them before the driver sees the URL:
//! `dlock_table=<table>` (`table` or `schema.table`, default `dlock_locks`) and, for
//! PostgreSQL, `dlock_mode=table|advisory` (default `table`). Every other parameter (TLS:
//! `sslmode`, `sslrootcert`; `require_ssl`, `ssl_ca`, ...) means what it means to the backend.
//! `postgres://u:pw@db/app?sslmode=require&dlock_table=jobs_locks` is the admin of a
//! `PostgresBackend::builder("postgres://u:pw@db/app?sslmode=require").table("jobs_locks")`.
//! [`PostgresAdmin::connect_with`] / [`MysqlAdmin::connect_with`] take the table (and mode) as
//! arguments instead.
//!
//! **Lock tables.** `list` and `show` read the rows whose lease has not ended by the database's
//! clock (a row kept by `hold_at_least` after its release shows with 0 holds); a row whose name
//! is not UTF-8, or whose count or fence is negative or NULL, is not a dlock lock and is counted
//! in [`Listing::skipped`]. The token is the `fence` column, the holder's fencing token. A
//! force-release frees the row as the backend's release does (count 0, lease ended now; the row
//! is kept so the next grant mints its token under the row lock), only while its fence is still
//! the one read; on PostgreSQL it then `NOTIFY`s the release channel the backends `LISTEN` on
//! (one waiter per process wakes), on MySQL the waiters' pollers see the free row within their
//! 100–250 ms. The evicted holder's next renewal finds the row no longer its own and its
//! `lost()` fires. Waiters are not visible in a table (`waiters: None`).
//!
//! **Advisory mode** keeps no names on the server: an advisory lock is a 64-bit hash of (table,
//! name) held by one session, and its token lives only in the holder's process. So `list` is
//! unsupported, and `show NAME` computes the key and reports the session holding it (owner
//! `pg-session:<pid>@<backend start>`, no token, no lease). A session's advisory lock can only
//! be given back by that session: force-release terminates the holding session
//! (`pg_terminate_backend`, PostgreSQL 14 or later) and `NOTIFY`s the release channel, but only
//! when that session holds no other advisory lock — otherwise it is refused
//! ([`crate::admin::AdminErrorKind::Unsupported`], naming the session), as it would free every lock of that
//! process's backend. Without a token, the hold a force-release expects is compared by
//! session: a lock given back and taken again by the same process in between is not told apart.
//! `watch` sees releases only (the `NOTIFY`s); a lock freed by a session that ends sends none.
//!
//! Every call is bounded by [`crate::admin::CALL_TIMEOUT`]; errors are typed (connection vs
//! server) and never contain the URL's password.

use std::sync::Arc;
use std::time::Duration;

use super::{DEFAULT_TABLE, check_table};
use crate::admin::{
    Admin, AdminError, ForceReleased, Holder, Listing, LockInfo, Seen, Snapshot, Watching, bounded,
    spawn_poll_watch, still_held,
};
// Used by the PostgreSQL admin only (its NOTIFY-driven watch and advisory-lock force release).
#[cfg(feature = "postgres")]
use crate::admin::{LockEvent, same_hold};
use crate::backend::BoxFuture;

/// How often a watch reads the lock table.
pub(crate) const WATCH_POLL: Duration = Duration::from_millis(250);

// ---------------------------------------------------------------------------------------------
// URL parameters, messages
// ---------------------------------------------------------------------------------------------

/// A URL with the admin's own parameters taken out.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct AdminUrl {
    /// The URL for the driver.
    pub(crate) url: String,
    /// `dlock_table`, or the default table.
    pub(crate) table: String,
    /// `dlock_mode`, when given.
    pub(crate) mode: Option<String>,
}

/// Takes `dlock_table` and `dlock_mode` out of the URL's query; any other `dlock_` parameter is
/// an error (a typo would otherwise reach the driver, or be silently ignored).
pub(crate) fn split_admin_params(url: &str) -> Result<AdminUrl, AdminError> {
    let p = super::split_dlock_params(url).map_err(AdminError::unsupported)?;
    let table = p.table.unwrap_or_else(|| DEFAULT_TABLE.to_string());
    check_table(&table).map_err(|e| AdminError::unsupported(e.to_string()))?;
    Ok(AdminUrl {
        url: p.url,
        table,
        mode: p.mode,
    })
}

/// Messages with any occurrence of the URL's password replaced by `***` (the drivers do not
/// print it; this is the second line of defence).
#[derive(Clone, Default)]
struct Scrub(Vec<String>);

impl Scrub {
    fn of(url: &str) -> Scrub {
        Scrub(crate::redact::secrets_of(url))
    }

    fn clean(&self, msg: String) -> String {
        let mut msg = msg;
        for s in &self.0 {
            if msg.contains(s.as_str()) {
                msg = msg.replace(s.as_str(), "***");
            }
        }
        msg
    }

    fn err(&self, mut e: AdminError) -> AdminError {
        e.message = self.clean(e.message);
        e
    }
}

/// A server error while checking the lock table, with a hint on how to name the table.
fn table_hint(mut e: AdminError) -> AdminError {
    if e.kind == crate::admin::AdminErrorKind::Server {
        e.message.push_str(
            " (name the backend's lock table with the URL parameter dlock_table=<table>; \
             default dlock_locks)",
        );
    }
    e
}

/// `e` and its sources, joined with `: `.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = c.source();
    }
    s
}

// ---------------------------------------------------------------------------------------------
// Rows of a lock table, and what a watch makes of them
// ---------------------------------------------------------------------------------------------

/// One row of a lock table, as read.
#[derive(Debug, Clone)]
struct TableRow {
    /// The lock name; `None` when not UTF-8 or empty.
    name: Option<String>,
    owner: Option<String>,
    count: Option<i64>,
    fence: Option<u64>,
    /// The lease has not ended (database clock).
    live: bool,
    remaining_us: i64,
    expires_at: String,
    /// The holder identity (`name@host:pid`) the grant stored; `None` for a row of an older
    /// version or a table without the `holder` column.
    holder: Option<String>,
}

impl TableRow {
    /// The lock name, when this row is a dlock lock.
    fn lock_name(&self) -> Option<&str> {
        let ok = self.owner.is_some() && self.count.is_some_and(|c| c >= 0) && self.fence.is_some();
        self.name.as_deref().filter(|_| ok)
    }

    /// The lock `name` from its row (`None`: no live row), or a server error when the row is
    /// not a dlock lock.
    fn read_as(
        row: Option<TableRow>,
        name: &str,
        table: &str,
        details: Vec<(String, String)>,
    ) -> Result<Option<LockInfo>, AdminError> {
        let Some(r) = row else {
            return Ok(None);
        };
        if r.lock_name() != Some(name) {
            return Err(AdminError::server(format!(
                "the row of `{name}` in {table} is not a dlock lock (NULL or negative count or \
                 fence)"
            )));
        }
        Ok(Some(r.info(name, details)))
    }

    fn info(&self, name: &str, details: Vec<(String, String)>) -> LockInfo {
        let mut info = LockInfo::new(name);
        info.holders = vec![
            Holder::new(
                self.owner.clone().unwrap_or_default(),
                u32::try_from(self.count.unwrap_or(0)).unwrap_or(u32::MAX),
            )
            .with_identity_text(self.holder.as_deref()),
        ];
        info.remaining = Some(Duration::from_micros(self.remaining_us.max(0) as u64));
        info.token = self.fence;
        info.waiters = None;
        info.waiters_are = "not visible in a lock table";
        info.details = details;
        info.details.push((
            "row".into(),
            format!(
                "count={} fence={} expires_at={} (UTC)",
                self.count.unwrap_or(0),
                self.fence.unwrap_or(0),
                self.expires_at
            ),
        ));
        info
    }
}

/// The rows under `prefix` as a watch snapshot (rows that are not dlock locks left out).
fn seen_of(rows: &[TableRow], prefix: &str) -> Snapshot {
    let at = tokio::time::Instant::now();
    rows.iter()
        .filter_map(|r| {
            let name = r.lock_name()?;
            if !name.starts_with(prefix) {
                return None;
            }
            Some((
                name.to_string(),
                Seen {
                    token: r.fence?,
                    holds: r.count?,
                    live: r.live,
                    ends: at + Duration::from_micros(r.remaining_us.max(0) as u64),
                    owner: r.owner.clone(),
                },
            ))
        })
        .collect()
}

/// A listing of the live dlock rows, and the number of rows that are not dlock locks.
fn listing(rows: &[TableRow], details: impl Fn() -> Vec<(String, String)>) -> Listing {
    let mut locks = Vec::new();
    let mut skipped = 0;
    for r in rows {
        match r.lock_name() {
            Some(n) if r.live => locks.push(r.info(n, details())),
            Some(_) => {}
            None => skipped += 1,
        }
    }
    Listing::new(locks, skipped)
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL
// ---------------------------------------------------------------------------------------------

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use pg::{PgMode, PostgresAdmin};

#[cfg(feature = "postgres")]
mod pg {
    use std::sync::Mutex;

    use tokio_postgres::types::{ToSql, Type};
    use tokio_postgres::{Client, Row};

    use super::super::pg_advisory::advisory_key;
    use super::super::postgres::{Connector, OnNotify, channel_of, hex_name};
    use super::*;
    use crate::backend::sql::postgres::PostgresBackend;

    /// Which kind of PostgreSQL backend the admin looks at.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    #[non_exhaustive]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub enum PgMode {
        /// The lock table (`PostgresBackend`'s default).
        #[default]
        Table,
        /// Advisory-lock mode (`PostgresBackendBuilder::advisory(true)`).
        Advisory,
    }

    /// The operator's view of a PostgreSQL lock table, or of advisory-lock mode (see the module
    /// docs of `dlock::admin` and this type's constructors for what each mode can show).
    #[derive(Clone)]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub struct PostgresAdmin {
        inner: Arc<Inner>,
    }

    struct Inner {
        cfg: tokio_postgres::Config,
        connector: Connector,
        client: Mutex<Option<Arc<Client>>>,
        shown: String,
        scrub: Scrub,
        table: String,
        mode: PgMode,
        channel: String,
    }

    impl std::fmt::Debug for PostgresAdmin {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("PostgresAdmin")
                .field("url", &self.inner.shown)
                .field("table", &self.inner.table)
                .field("mode", &self.inner.mode)
                .finish_non_exhaustive()
        }
    }

    /// Maps a driver error: the server's own errors are [`AdminErrorKind::Server`], everything
    /// else (I/O, closed, TLS, time-outs) [`AdminErrorKind::Connect`].
    fn map(what: &str, e: &tokio_postgres::Error) -> AdminError {
        let msg = format!("{what}: {}", chain(e));
        if e.as_db_error().is_some() {
            AdminError::server(msg)
        } else {
            AdminError::connect(msg)
        }
    }

    impl PostgresAdmin {
        /// Connects to the database at `url` (`postgres://` or `postgresql://`, TLS parameters
        /// as the backend takes them with the `postgres-tls` feature) and checks the connection
        /// (and, in table mode, the table). `dlock_table=<table>` and `dlock_mode=table|advisory`
        /// in the URL's query name the lock table (default `dlock_locks`) and the mode
        /// (default `table`); they are taken out before connecting.
        pub async fn connect(url: &str) -> Result<PostgresAdmin, AdminError> {
            let u = split_admin_params(url)?;
            let mode = match u.mode.as_deref() {
                None | Some("table") => PgMode::Table,
                Some("advisory") => PgMode::Advisory,
                Some(m) => {
                    return Err(AdminError::unsupported(format!(
                        "dlock_mode={m}: PostgreSQL modes are `table` and `advisory`"
                    )));
                }
            };
            Self::open(&u.url, &u.table, mode).await
        }

        /// Connects to the database at `url` for the backend on `table` in `mode`; `dlock_table`
        /// and `dlock_mode` in the URL, if any, are taken out and ignored.
        pub async fn connect_with(
            url: &str,
            table: &str,
            mode: PgMode,
        ) -> Result<PostgresAdmin, AdminError> {
            let u = split_admin_params(url)?;
            check_table(table).map_err(|e| AdminError::unsupported(e.to_string()))?;
            Self::open(&u.url, table, mode).await
        }

        async fn open(url: &str, table: &str, mode: PgMode) -> Result<PostgresAdmin, AdminError> {
            let scrub = Scrub::of(url);
            let shown = super::super::redact_url(url);
            let config_err = |e: crate::LockError| {
                scrub.err(AdminError::unsupported(format!("cannot use {shown}: {e}")))
            };
            // The backend's own settings: TLS parameters, connect timeout, and a server-side
            // statement_timeout below the admin's call bound.
            let builder = PostgresBackend::builder(url).statement_timeout(Duration::from_secs(4));
            let mut cfg = builder.pg_config().map_err(config_err)?;
            let connector = builder.connector(&cfg).map_err(config_err)?;
            cfg.application_name("dlock-admin");
            let admin = PostgresAdmin {
                inner: Arc::new(Inner {
                    cfg,
                    connector,
                    client: Mutex::new(None),
                    shown,
                    scrub,
                    table: table.to_string(),
                    mode,
                    channel: channel_of(table),
                }),
            };
            // Every failure to connect (refused, DNS, TLS, authentication) is a connection
            // failure; a missing table is the server's answer.
            admin
                .client()
                .await
                .map_err(|e| AdminError::connect(e.message))?;
            let check = match mode {
                PgMode::Table => format!("SELECT 1 FROM {table} LIMIT 0"),
                PgMode::Advisory => "SELECT 1".to_string(),
            };
            admin
                .query(&format!("checking the lock table {table}"), &check, &[])
                .await
                .map_err(table_hint)?;
            Ok(admin)
        }

        /// The lock table (advisory mode: the table whose name keys the locks).
        pub fn table(&self) -> &str {
            &self.inner.table
        }

        /// The mode.
        pub fn mode(&self) -> PgMode {
            self.inner.mode
        }

        /// The connection, opened again when it was lost.
        async fn client(&self) -> Result<Arc<Client>, AdminError> {
            if let Some(c) = self
                .inner
                .client
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .filter(|c| !c.is_closed())
            {
                return Ok(c.clone());
            }
            let what = format!("connecting to {}", self.inner.shown);
            let (client, _driver) = bounded(&what, async {
                self.inner
                    .connector
                    .connect(&self.inner.cfg, None)
                    .await
                    .map_err(|e| AdminError::connect(format!("{what}: {}", chain(&e))))
            })
            .await
            .map_err(|e| self.inner.scrub.err(e))?;
            let client = Arc::new(client);
            *self.inner.client.lock().unwrap_or_else(|e| e.into_inner()) = Some(client.clone());
            Ok(client)
        }

        async fn query(
            &self,
            what: &str,
            sql: &str,
            params: &[(&(dyn ToSql + Sync), Type)],
        ) -> Result<Vec<Row>, AdminError> {
            let what = format!("{what} on {}", self.inner.shown);
            bounded(&what, async {
                let c = self.client().await?;
                c.query_typed(sql, params).await.map_err(|e| map(&what, &e))
            })
            .await
            .map_err(|e| self.inner.scrub.err(e))
        }

        fn details(&self) -> Vec<(String, String)> {
            vec![
                ("server".into(), self.inner.shown.clone()),
                ("table".into(), self.inner.table.clone()),
                ("release channel".into(), self.inner.channel.clone()),
            ]
        }

        fn table_row(r: &Row) -> TableRow {
            let name: Option<Vec<u8>> = r.try_get(0).ok().flatten();
            TableRow {
                name: name
                    .and_then(|b| String::from_utf8(b).ok())
                    .filter(|n| !n.is_empty()),
                owner: r.try_get(1).ok().flatten(),
                count: r.try_get::<_, Option<i32>>(2).ok().flatten().map(i64::from),
                fence: r
                    .try_get::<_, Option<i64>>(3)
                    .ok()
                    .flatten()
                    .and_then(|f| u64::try_from(f).ok()),
                live: r
                    .try_get::<_, Option<bool>>(4)
                    .ok()
                    .flatten()
                    .unwrap_or(false),
                remaining_us: r.try_get::<_, Option<i64>>(5).ok().flatten().unwrap_or(0),
                expires_at: r
                    .try_get::<_, Option<String>>(6)
                    .ok()
                    .flatten()
                    .unwrap_or_default(),
                holder: r.try_get::<_, Option<String>>(7).ok().flatten(),
            }
        }

        /// The rows of names starting with `prefix` (every row, held or not), by name.
        async fn rows(&self, prefix: &str) -> Result<Vec<TableRow>, AdminError> {
            let sql = format!(
                "SELECT l.name, l.owner, l.count, l.fence, l.expires_at > c.now, \
                   GREATEST(0, (extract(epoch FROM l.expires_at - c.now) * 1000000)::bigint), \
                   to_char(l.expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US'), \
                   to_jsonb(l) ->> 'holder' \
                 FROM {} l, (SELECT clock_timestamp() AS now) c \
                 WHERE substr(l.name, 1, $2) = $1 ORDER BY l.name",
                self.inner.table
            );
            let len = i32::try_from(prefix.len()).unwrap_or(i32::MAX);
            let rows = self
                .query(
                    &format!("reading the lock table {}", self.inner.table),
                    &sql,
                    &[(&prefix.as_bytes(), Type::BYTEA), (&len, Type::INT4)],
                )
                .await?;
            Ok(rows.iter().map(Self::table_row).collect())
        }

        /// One lock of the table; `None` when its row is missing or its lease has ended.
        async fn read(&self, name: &str) -> Result<Option<LockInfo>, AdminError> {
            let sql = format!(
                "SELECT l.name, l.owner, l.count, l.fence, l.expires_at > c.now, \
                   GREATEST(0, (extract(epoch FROM l.expires_at - c.now) * 1000000)::bigint), \
                   to_char(l.expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US'), \
                   to_jsonb(l) ->> 'holder' \
                 FROM {} l, (SELECT clock_timestamp() AS now) c \
                 WHERE l.name = $1 AND l.expires_at > c.now",
                self.inner.table
            );
            let rows = self
                .query(
                    &format!("reading lock `{name}`"),
                    &sql,
                    &[(&name.as_bytes(), Type::BYTEA)],
                )
                .await?;
            TableRow::read_as(
                rows.first().map(Self::table_row),
                name,
                &self.inner.table,
                self.details(),
            )
        }

        async fn force(
            &self,
            name: &str,
            expected: Option<&LockInfo>,
        ) -> Result<ForceReleased, AdminError> {
            let now = match still_held(self.read(name).await?, expected) {
                Ok(now) => now,
                Err(done) => return Ok(done),
            };
            let token = now.token.and_then(|t| i64::try_from(t).ok()).unwrap_or(-1);
            // Freed as the backend's release frees it, only while the fence is the one read,
            // and announced on the channel the backends LISTEN on (at commit).
            let sql = format!(
                "WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now), \
                 upd AS (UPDATE {t} l SET count = 0, expires_at = c.now FROM c \
                         WHERE l.name = $1 AND l.fence = $2 AND l.expires_at > c.now RETURNING 1) \
                 SELECT pg_notify('{ch}', encode($1, 'hex'))::text FROM upd",
                t = self.inner.table,
                ch = self.inner.channel
            );
            let rows = self
                .query(
                    &format!("force-releasing `{name}`"),
                    &sql,
                    &[(&name.as_bytes(), Type::BYTEA), (&token, Type::INT8)],
                )
                .await?;
            if rows.is_empty() {
                return Ok(match self.read(name).await? {
                    None => ForceReleased::NotHeld,
                    Some(_) => ForceReleased::Changed,
                });
            }
            Ok(ForceReleased::Released {
                was: Box::new(now),
                woke: None,
            })
        }

        /// A second connection that `LISTEN`s on the release channel; names announced go to
        /// the returned receiver. The handle finishes when the connection is lost.
        async fn listen(
            &self,
        ) -> Result<
            (
                Client,
                tokio::task::JoinHandle<()>,
                tokio::sync::mpsc::UnboundedReceiver<String>,
            ),
            AdminError,
        > {
            let (ntx, nrx) = tokio::sync::mpsc::unbounded_channel();
            let chan = self.inner.channel.clone();
            let on: OnNotify = Box::new(move |n: &tokio_postgres::Notification| {
                if n.channel() == chan
                    && let Some(name) = hex_name(n.payload())
                {
                    let _ = ntx.send(name);
                }
            });
            let what = format!("listening on {}", self.inner.shown);
            let (client, driver) = bounded(&what, async {
                self.inner
                    .connector
                    .connect(&self.inner.cfg, Some(on))
                    .await
                    .map_err(|e| AdminError::connect(format!("{what}: {}", chain(&e))))
            })
            .await
            .map_err(|e| self.inner.scrub.err(e))?;
            let listen = format!("LISTEN \"{}\"", self.inner.channel);
            bounded(&what, async {
                client
                    .batch_execute(&listen)
                    .await
                    .map_err(|e| map(&what, &e))
            })
            .await
            .map_err(|e| self.inner.scrub.err(e))?;
            Ok((client, driver, nrx))
        }

        async fn start_watch(&self, prefix: &str) -> Result<Watching, AdminError> {
            let (client, driver, nrx) = self.listen().await?;
            let lost = AdminError::connect(format!(
                "{}: the listening connection was lost",
                self.inner.shown
            ));
            if self.inner.mode == PgMode::Advisory {
                let (tx, rx) = tokio::sync::mpsc::channel(1024);
                let prefix = prefix.to_string();
                let mut nrx = nrx;
                let mut driver = driver;
                tokio::spawn(async move {
                    let _client = client;
                    loop {
                        tokio::select! {
                            _ = tx.closed() => return,
                            _ = &mut driver => {
                                let _ = tx.send(Err(lost)).await;
                                return;
                            }
                            n = nrx.recv() => {
                                let Some(name) = n else { return };
                                if name.starts_with(&prefix)
                                    && tx.send(Ok(LockEvent::Released { name })).await.is_err()
                                {
                                    return;
                                }
                            }
                        }
                    }
                });
                return Ok(Watching {
                    events: rx,
                    sees: "releases only (NOTIFY on the release channel): advisory locks keep \
                           no names on the server, so acquisitions, and locks freed by a \
                           session that ends, are not visible; nor is a release while processes \
                           wait in the waiters' FIFO (it notifies the first of them only)"
                        .into(),
                    sees_acquisitions: false,
                });
            }
            let before = seen_of(&self.rows(prefix).await?, prefix);
            let me = self.clone();
            // The listening connection lasts as long as its client: the read closure owns it,
            // and the watch task owns the closure.
            let read = move |p: String| {
                let _listening = &client;
                let me = me.clone();
                async move { me.rows(&p).await.map(|r| seen_of(&r, &p)) }
            };
            let events = spawn_poll_watch(
                prefix.to_string(),
                before,
                WATCH_POLL,
                read,
                Some(nrx),
                Some((driver, lost)),
            );
            Ok(Watching {
                events,
                sees: format!(
                    "acquisitions, releases and expiries: releases as announced (LISTEN {}), \
                     the table read every {} ms (a hand-over between two reads shows as its \
                     last grant)",
                    self.inner.channel,
                    WATCH_POLL.as_millis()
                ),
                sees_acquisitions: true,
            })
        }

        // ---- advisory mode ----

        /// `pg_locks`' condition for the session-level advisory lock of `name` (a bigint key is
        /// classid = high 32 bits, objid = low 32 bits, objsubid = 1).
        fn advisory_where(&self, name: &str) -> String {
            let k = advisory_key(&self.inner.table, name) as u64;
            format!(
                "l.locktype = 'advisory' AND l.granted AND l.pid IS NOT NULL AND l.database = \
                 (SELECT oid FROM pg_database WHERE datname = current_database()) \
                 AND l.classid = '{}'::oid AND l.objid = '{}'::oid AND l.objsubid = 1",
                k >> 32,
                k & 0xffff_ffff
            )
        }

        /// The session holding `name`'s advisory lock: (info, pid, backend start in µs, number
        /// of advisory locks that session holds).
        async fn read_advisory(
            &self,
            name: &str,
        ) -> Result<Option<(LockInfo, i32, Option<i64>, i64)>, AdminError> {
            let sql = format!(
                "SELECT l.pid, a.application_name, host(a.client_addr), a.client_port, \
                   a.backend_start::text, (extract(epoch FROM a.backend_start) * 1000000)::bigint, \
                   a.state, (SELECT count(*) FROM pg_locks o WHERE o.pid = l.pid \
                             AND o.locktype = 'advisory' AND o.granted) \
                 FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
                 WHERE {} ORDER BY l.pid",
                self.advisory_where(name)
            );
            let rows = self
                .query(&format!("reading advisory lock `{name}`"), &sql, &[])
                .await?;
            let Some(r) = rows.first() else {
                return Ok(None);
            };
            let bad = |e: tokio_postgres::Error| {
                AdminError::server(format!("reading advisory lock `{name}`: {}", chain(&e)))
            };
            let pid: i32 = r.try_get(0).map_err(bad)?;
            let app: Option<String> = r.try_get(1).map_err(bad)?;
            let host: Option<String> = r.try_get(2).map_err(bad)?;
            let port: Option<i32> = r.try_get(3).map_err(bad)?;
            let start: Option<String> = r.try_get(4).map_err(bad)?;
            let start_us: Option<i64> = r.try_get(5).map_err(bad)?;
            let state: Option<String> = r.try_get(6).map_err(bad)?;
            let n: i64 = r.try_get(7).map_err(bad)?;
            let key = advisory_key(&self.inner.table, name);
            let mut info = LockInfo::new(name);
            // The backend names its advisory session `dlock name@host:pid` (see holder.rs).
            info.holders = vec![
                Holder::new(
                    match start_us {
                        Some(s) => format!("pg-session:{pid}@{s}"),
                        None => format!("pg-session:{pid}"),
                    },
                    1,
                )
                .with_identity_text(
                    app.as_deref()
                        .and_then(|a| a.strip_prefix(crate::holder::APPLICATION_NAME_PREFIX)),
                ),
            ];
            info.waiters_are = "not visible in advisory mode";
            let unknown = || "(not visible to this role)".to_string();
            info.details = vec![
                ("server".into(), self.inner.shown.clone()),
                ("mode".into(), "advisory locks".into()),
                ("key namespace (table)".into(), self.inner.table.clone()),
                (
                    "advisory key".into(),
                    format!("{key} ({:#018x})", key as u64),
                ),
                ("session pid".into(), pid.to_string()),
                ("application_name".into(), app.unwrap_or_else(unknown)),
                (
                    "client".into(),
                    match (host, port) {
                        (Some(h), Some(p)) => format!("{h}:{p}"),
                        (Some(h), None) => h,
                        _ => unknown(),
                    },
                ),
                ("session started".into(), start.unwrap_or_else(unknown)),
                ("session state".into(), state.unwrap_or_else(unknown)),
                ("advisory locks of this session".into(), n.to_string()),
                ("release channel".into(), self.inner.channel.clone()),
            ];
            if rows.len() > 1 {
                info.details.push((
                    "other sessions holding the key".into(),
                    (rows.len() - 1).to_string(),
                ));
            }
            Ok(Some((info, pid, start_us, n)))
        }

        async fn force_advisory(
            &self,
            name: &str,
            expected: Option<&LockInfo>,
        ) -> Result<ForceReleased, AdminError> {
            let Some((now, pid, start_us, n)) = self.read_advisory(name).await? else {
                return Ok(ForceReleased::NotHeld);
            };
            if let Some(exp) = expected
                && !same_hold(exp, &now)
            {
                return Ok(ForceReleased::Changed);
            }
            if n > 1 {
                return Err(AdminError::refused(format!(
                    "`{name}` is an advisory lock of PostgreSQL session {pid}, which holds {n} \
                     advisory locks; only that session can give one back, so freeing this one \
                     means ending the session, which would free the other {} as well (every \
                     lock of that process's backend). Not done. To do it anyway: SELECT \
                     pg_terminate_backend({pid});",
                    n - 1
                )));
            }
            // Ends the session only if it is still the same one holding this lock and nothing
            // else (waits up to 3 s for it to be gone, so the lock is free when this returns).
            let start = start_us.map_or("NULL".to_string(), |s| s.to_string());
            let sql = format!(
                "SELECT pg_terminate_backend(l.pid, 3000) \
                 FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
                 WHERE {} AND l.pid = {pid} \
                   AND (extract(epoch FROM a.backend_start) * 1000000)::bigint \
                       IS NOT DISTINCT FROM {start} \
                   AND (SELECT count(*) FROM pg_locks o WHERE o.pid = l.pid \
                        AND o.locktype = 'advisory' AND o.granted) = 1",
                self.advisory_where(name)
            );
            let rows = self
                .query(&format!("terminating session {pid} of `{name}`"), &sql, &[])
                .await?;
            match rows.first().map(|r| r.try_get::<_, bool>(0)) {
                None => {
                    return Ok(match self.read_advisory(name).await? {
                        None => ForceReleased::NotHeld,
                        Some(_) => ForceReleased::Changed,
                    });
                }
                Some(Ok(true)) => {}
                Some(Ok(false)) => {
                    return Err(AdminError::server(format!(
                        "session {pid} holding `{name}` did not end within 3 s"
                    )));
                }
                Some(Err(e)) => {
                    return Err(AdminError::server(format!(
                        "terminating session {pid}: {}",
                        chain(&e)
                    )));
                }
            }
            // Wake waiters at once, as the backend's release does (else they re-check every
            // 500 ms).
            let sql = format!(
                "SELECT pg_notify('{}', encode($1, 'hex'))::text",
                self.inner.channel
            );
            self.query(
                &format!("announcing the release of `{name}`"),
                &sql,
                &[(&name.as_bytes(), Type::BYTEA)],
            )
            .await?;
            Ok(ForceReleased::Released {
                was: Box::new(now),
                woke: None,
            })
        }
    }

    impl Admin for PostgresAdmin {
        fn engine(&self) -> &'static str {
            match self.inner.mode {
                PgMode::Table => "postgres",
                PgMode::Advisory => "postgres-advisory",
            }
        }

        fn target(&self) -> String {
            format!(
                "{} (table {}{})",
                self.inner.shown,
                self.inner.table,
                match self.inner.mode {
                    PgMode::Table => "",
                    PgMode::Advisory => ", advisory locks",
                }
            )
        }

        fn list<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Listing, AdminError>> {
            Box::pin(async move {
                match self.inner.mode {
                    PgMode::Table => {
                        let rows = self.rows(prefix).await?;
                        Ok(listing(&rows, || self.details()))
                    }
                    PgMode::Advisory => Err(AdminError::unsupported(
                        "PostgreSQL advisory-lock mode cannot list locks: the server keeps only \
                         a 64-bit hash of (table, name) per lock, not the name; `show NAME` \
                         looks one lock up by its key",
                    )),
                }
            })
        }

        fn show<'a>(
            &'a self,
            name: &'a str,
        ) -> BoxFuture<'a, Result<Option<LockInfo>, AdminError>> {
            Box::pin(async move {
                match self.inner.mode {
                    PgMode::Table => self.read(name).await,
                    PgMode::Advisory => Ok(self.read_advisory(name).await?.map(|r| r.0)),
                }
            })
        }

        fn force_release<'a>(
            &'a self,
            name: &'a str,
            expected: Option<&'a LockInfo>,
        ) -> BoxFuture<'a, Result<ForceReleased, AdminError>> {
            Box::pin(async move {
                match self.inner.mode {
                    PgMode::Table => self.force(name, expected).await,
                    PgMode::Advisory => self.force_advisory(name, expected).await,
                }
            })
        }

        fn watch<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Watching, AdminError>> {
            Box::pin(self.start_watch(prefix))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// MySQL / MariaDB
// ---------------------------------------------------------------------------------------------

#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use my::MysqlAdmin;

#[cfg(feature = "mysql")]
mod my {
    use mysql_async::prelude::{FromValue, Queryable};
    use mysql_async::{Pool, PoolConstraints, PoolOpts, Row};

    use super::super::mysql::hex;
    use super::*;
    use crate::backend::sql::mysql::MysqlBackend;

    /// The operator's view of a MySQL / MariaDB lock table.
    #[derive(Clone)]
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
    pub struct MysqlAdmin {
        inner: Arc<Inner>,
    }

    struct Inner {
        pool: Pool,
        shown: String,
        scrub: Scrub,
        table: String,
        /// Whether the table has the `holder` column (a table of an older version has not).
        holder_col: std::sync::atomic::AtomicBool,
    }

    impl std::fmt::Debug for MysqlAdmin {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("MysqlAdmin")
                .field("url", &self.inner.shown)
                .field("table", &self.inner.table)
                .finish_non_exhaustive()
        }
    }

    fn map(what: &str, e: &mysql_async::Error) -> AdminError {
        let msg = format!("{what}: {}", chain(e));
        match e {
            mysql_async::Error::Server(_) => AdminError::server(msg),
            mysql_async::Error::Url(_) => AdminError::unsupported(msg),
            _ => AdminError::connect(msg),
        }
    }

    fn col<T: FromValue>(r: &Row, i: usize) -> Option<T> {
        r.get_opt::<Option<T>, usize>(i)
            .and_then(|v| v.ok())
            .flatten()
    }

    impl MysqlAdmin {
        /// Connects to the database at `url` (`mysql://`, TLS parameters as the backend takes
        /// them with the `mysql-tls` feature) and checks the table. `dlock_table=<table>` in the
        /// URL's query names the lock table (default `dlock_locks`); it is taken out before
        /// connecting.
        pub async fn connect(url: &str) -> Result<MysqlAdmin, AdminError> {
            let u = split_admin_params(url)?;
            match u.mode.as_deref() {
                None | Some("table") => {}
                Some(m) => {
                    return Err(AdminError::unsupported(format!(
                        "dlock_mode={m}: the MySQL backend has only the lock table"
                    )));
                }
            }
            Self::open(&u.url, &u.table).await
        }

        /// Connects to the database at `url` for the backend on `table`; `dlock_table` in the
        /// URL, if any, is taken out and ignored.
        pub async fn connect_with(url: &str, table: &str) -> Result<MysqlAdmin, AdminError> {
            let u = split_admin_params(url)?;
            check_table(table).map_err(|e| AdminError::unsupported(e.to_string()))?;
            Self::open(&u.url, table).await
        }

        async fn open(url: &str, table: &str) -> Result<MysqlAdmin, AdminError> {
            let scrub = Scrub::of(url);
            let (opts, _tls, shown) = MysqlBackend::builder(url).url_opts().map_err(|e| {
                scrub.err(AdminError::unsupported(format!(
                    "cannot use {}: {e}",
                    super::super::redact_url(url)
                )))
            })?;
            let constraints = PoolConstraints::new(0, 2).ok_or_else(|| {
                AdminError::unsupported("invalid pool constraints (internal)".to_string())
            })?;
            let opts = opts
                .init(vec![
                    "SET SESSION innodb_lock_wait_timeout = 2".to_string(),
                    "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED".to_string(),
                    "SET SESSION autocommit = 1".to_string(),
                ])
                .pool_opts(PoolOpts::new().with_constraints(constraints));
            let admin = MysqlAdmin {
                inner: Arc::new(Inner {
                    pool: Pool::new(opts),
                    shown,
                    scrub,
                    table: table.to_string(),
                    holder_col: std::sync::atomic::AtomicBool::new(false),
                }),
            };
            admin
                .rows_of("connecting", "SELECT 1")
                .await
                .map_err(|e| AdminError::connect(e.message))?;
            admin
                .rows_of(
                    &format!("checking the lock table {table}"),
                    &format!("SELECT 1 FROM {table} LIMIT 0"),
                )
                .await
                .map_err(table_hint)?;
            let has_holder = admin
                .rows_of(
                    "checking the holder column",
                    &format!("SELECT holder FROM {table} LIMIT 0"),
                )
                .await
                .is_ok();
            admin
                .inner
                .holder_col
                .store(has_holder, std::sync::atomic::Ordering::Relaxed);
            Ok(admin)
        }

        /// The lock table.
        pub fn table(&self) -> &str {
            &self.inner.table
        }

        async fn rows_of(&self, what: &str, sql: &str) -> Result<Vec<Row>, AdminError> {
            let what = format!("{what} on {}", self.inner.shown);
            bounded(&what, async {
                let mut c = self
                    .inner
                    .pool
                    .get_conn()
                    .await
                    .map_err(|e| map(&what, &e))?;
                c.query::<Row, _>(sql).await.map_err(|e| map(&what, &e))
            })
            .await
            .map_err(|e| self.inner.scrub.err(e))
        }

        async fn exec(&self, what: &str, sql: &str) -> Result<u64, AdminError> {
            let what = format!("{what} on {}", self.inner.shown);
            bounded(&what, async {
                let mut c = self
                    .inner
                    .pool
                    .get_conn()
                    .await
                    .map_err(|e| map(&what, &e))?;
                c.query_drop(sql).await.map_err(|e| map(&what, &e))?;
                Ok(c.affected_rows())
            })
            .await
            .map_err(|e| self.inner.scrub.err(e))
        }

        fn details(&self) -> Vec<(String, String)> {
            vec![
                ("server".into(), self.inner.shown.clone()),
                ("table".into(), self.inner.table.clone()),
            ]
        }

        fn select(&self, cond: &str) -> String {
            format!(
                "SELECT name, owner, count, fence, expires_at > UTC_TIMESTAMP(6), \
                   GREATEST(0, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at)), \
                   DATE_FORMAT(expires_at, '%Y-%m-%d %H:%i:%s.%f'), {} \
                 FROM {} WHERE {cond} ORDER BY name",
                if self
                    .inner
                    .holder_col
                    .load(std::sync::atomic::Ordering::Relaxed)
                {
                    "holder"
                } else {
                    "NULL"
                },
                self.inner.table
            )
        }

        fn table_row(r: &Row) -> TableRow {
            TableRow {
                name: col::<Vec<u8>>(r, 0)
                    .and_then(|b| String::from_utf8(b).ok())
                    .filter(|n| !n.is_empty()),
                owner: col::<Vec<u8>>(r, 1).and_then(|b| String::from_utf8(b).ok()),
                count: col::<i64>(r, 2),
                fence: col::<u64>(r, 3),
                live: col::<i64>(r, 4).is_some_and(|v| v == 1),
                remaining_us: col::<i64>(r, 5).unwrap_or(0),
                expires_at: col::<Vec<u8>>(r, 6)
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .unwrap_or_default(),
                holder: col::<Vec<u8>>(r, 7).and_then(|b| String::from_utf8(b).ok()),
            }
        }

        async fn rows(&self, prefix: &str) -> Result<Vec<TableRow>, AdminError> {
            let cond = if prefix.is_empty() {
                "TRUE".to_string()
            } else {
                let mut h = String::new();
                hex(&mut h, prefix.as_bytes());
                format!("LEFT(name, {}) = {h}", prefix.len())
            };
            let rows = self
                .rows_of(
                    &format!("reading the lock table {}", self.inner.table),
                    &self.select(&cond),
                )
                .await?;
            Ok(rows.iter().map(Self::table_row).collect())
        }

        async fn read(&self, name: &str) -> Result<Option<LockInfo>, AdminError> {
            let mut h = String::new();
            hex(&mut h, name.as_bytes());
            let rows = self
                .rows_of(
                    &format!("reading lock `{name}`"),
                    &self.select(&format!("name = {h} AND expires_at > UTC_TIMESTAMP(6)")),
                )
                .await?;
            TableRow::read_as(
                rows.first().map(Self::table_row),
                name,
                &self.inner.table,
                self.details(),
            )
        }

        async fn force(
            &self,
            name: &str,
            expected: Option<&LockInfo>,
        ) -> Result<ForceReleased, AdminError> {
            let now = match still_held(self.read(name).await?, expected) {
                Ok(now) => now,
                Err(done) => return Ok(done),
            };
            let mut h = String::new();
            hex(&mut h, name.as_bytes());
            // Freed as the backend's release frees it, only while the fence is the one read;
            // the waiters' pollers see the free row.
            let sql = format!(
                "UPDATE {} SET count = 0, expires_at = UTC_TIMESTAMP(6) \
                 WHERE name = {h} AND fence = {} AND expires_at > UTC_TIMESTAMP(6)",
                self.inner.table,
                now.token.unwrap_or(0)
            );
            let n = self
                .exec(&format!("force-releasing `{name}`"), &sql)
                .await?;
            if n == 0 {
                return Ok(match self.read(name).await? {
                    None => ForceReleased::NotHeld,
                    Some(_) => ForceReleased::Changed,
                });
            }
            Ok(ForceReleased::Released {
                was: Box::new(now),
                woke: None,
            })
        }

        async fn start_watch(&self, prefix: &str) -> Result<Watching, AdminError> {
            let before = seen_of(&self.rows(prefix).await?, prefix);
            let me = self.clone();
            let read = move |p: String| {
                let me = me.clone();
                async move { me.rows(&p).await.map(|r| seen_of(&r, &p)) }
            };
            let events = spawn_poll_watch(prefix.to_string(), before, WATCH_POLL, read, None, None);
            Ok(Watching {
                events,
                sees: format!(
                    "acquisitions, releases and expiries, by reading the table every {} ms (a \
                     lock taken and given back between two reads shows once both happened; \
                     several hand-overs between two reads show as the last grant)",
                    WATCH_POLL.as_millis()
                ),
                sees_acquisitions: true,
            })
        }
    }

    impl Admin for MysqlAdmin {
        fn engine(&self) -> &'static str {
            "mysql"
        }

        fn target(&self) -> String {
            format!("{} (table {})", self.inner.shown, self.inner.table)
        }

        fn list<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Listing, AdminError>> {
            Box::pin(async move {
                let rows = self.rows(prefix).await?;
                Ok(listing(&rows, || self.details()))
            })
        }

        fn show<'a>(
            &'a self,
            name: &'a str,
        ) -> BoxFuture<'a, Result<Option<LockInfo>, AdminError>> {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hint once had a run of spaces in it (a literal broken across lines).
    #[test]
    fn the_table_hint_reads_as_one_sentence() {
        let e = table_hint(AdminError::server("relation does not exist"));
        assert!(
            e.message
                .contains("dlock_table=<table>; default dlock_locks)"),
            "{}",
            e.message
        );
        assert!(!e.message.contains("  "), "{}", e.message);
    }

    #[test]
    fn admin_parameters_are_taken_out_of_the_url() {
        let u = split_admin_params(
            "postgres://u:pw@h/db?sslmode=require&dlock_table=app.locks&dlock_mode=Advisory",
        )
        .unwrap();
        assert_eq!(u.url, "postgres://u:pw@h/db?sslmode=require");
        assert_eq!(u.table, "app.locks");
        assert_eq!(u.mode.as_deref(), Some("advisory"));
        let u = split_admin_params("mysql://root@h/test").unwrap();
        assert_eq!(u.url, "mysql://root@h/test");
        assert_eq!(u.table, "dlock_locks");
        assert_eq!(u.mode, None);
        let u = split_admin_params("mysql://root@h/test?dlock_table=t1").unwrap();
        assert_eq!(u.url, "mysql://root@h/test");
        assert_eq!(u.table, "t1");
        for bad in [
            "postgres://h/db?dlock_table=x;drop",
            "postgres://h/db?dlock_tabel=x",
            "postgres://h/db?dlock_table=",
        ] {
            let e = split_admin_params(bad).unwrap_err();
            assert_eq!(e.kind, crate::admin::AdminErrorKind::Unsupported, "{bad}");
        }
    }

    #[test]
    fn passwords_are_scrubbed_from_messages() {
        let s = Scrub::of("postgres://u:s%40cret@h/db");
        assert_eq!(
            s.clean("failed for s%40cret and s@cret".into()),
            "failed for *** and ***"
        );
        assert!(Scrub::of("postgres://u@h/db").0.is_empty());
        assert!(Scrub::of("postgres://h/db?x=a:b@c").0.is_empty());
    }
}
