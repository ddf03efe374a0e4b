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
//! Waiting: a release NOTIFYs like the table mode; a lock freed by a dying session does not, so
//! while a name has local waiters the first of them re-checks every 500 ms (`RECHECK`). A busy
//! answer reports no remaining time: a session lock has no known end.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use super::postgres::Connector;
use tokio_postgres::types::Type;

use super::bounded;
use crate::LockError;
use crate::backend::{Acquired, Extended, Released};

type DynError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// How often the first local waiter of a name re-checks: an advisory lock has no lease, and
/// one freed by a dying session sends no NOTIFY.
pub(crate) const RECHECK: Duration = Duration::from_millis(500);

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
}

#[derive(Debug)]
struct Held {
    owner: String,
    count: u32,
    token: u64,
    generation: u64,
}

/// The dedicated session and what this process holds on it.
pub(crate) struct Advisory {
    cfg: tokio_postgres::Config,
    connector: Connector,
    session: tokio::sync::Mutex<Option<Session>>,
    held: Mutex<HashMap<String, Held>>,
    next_generation: std::sync::atomic::AtomicU64,
    table: String,
    fence_seq: String,
    channel: String,
    op_timeout: Duration,
    connect_timeout: Duration,
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
    ) -> Advisory {
        Advisory {
            cfg,
            connector,
            session: tokio::sync::Mutex::new(None),
            held: Mutex::new(HashMap::new()),
            next_generation: std::sync::atomic::AtomicU64::new(1),
            table: table.to_string(),
            fence_seq: format!("{table}_fence"),
            channel,
            op_timeout,
            connect_timeout,
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens the session and refuses a transaction-mode pooler (see [`Advisory::pooler_check`]).
    pub(crate) async fn open(&self, key: &str) -> Result<(tokio_postgres::Client, u64), LockError> {
        let client = self.connect(key).await?;
        self.pooler_check(key, &client).await?;
        let generation = self
            .next_generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok((client, generation))
    }

    async fn connect(&self, key: &str) -> Result<tokio_postgres::Client, LockError> {
        let (client, _driver) = bounded(
            key,
            "the advisory session's connect",
            self.connect_timeout,
            self.connector.connect(&self.cfg, None),
        )
        .await?;
        Ok(client)
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
        let second = self.connect(key).await?;
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
        let (client, generation) = self.open("").await?;
        *self.session.lock().await = Some(Session { client, generation });
        Ok(())
    }

    /// Runs `f` on the live session (opening a new one when it was lost); returns the session's
    /// generation with the result.
    async fn with_session<T>(
        &self,
        key: &str,
        what: &'static str,
        sql: &str,
        params: &[(&(dyn tokio_postgres::types::ToSql + Sync), Type)],
        map: impl FnOnce(Vec<tokio_postgres::Row>) -> Result<T, DynError>,
    ) -> Result<(T, u64), LockError> {
        let mut guard = self.session.lock().await;
        if guard.as_ref().is_none_or(|s| s.client.is_closed()) {
            let (client, generation) = self.open(key).await?;
            // Locks of the old session are gone with it.
            self.held().retain(|_, h| h.generation == generation);
            *guard = Some(Session { client, generation });
        }
        let s = guard.as_ref().expect("session set above");
        let generation = s.generation;
        let rows = bounded(
            key,
            what,
            self.op_timeout,
            s.client.query_typed(sql, params),
        )
        .await;
        let rows = match rows {
            Ok(r) => r,
            Err(e) => {
                // A timed-out or failed session cannot be trusted to still hold anything.
                *guard = None;
                return Err(e);
            }
        };
        drop(guard);
        let t = map(rows).map_err(|e| LockError::backend(key, e))?;
        Ok((t, generation))
    }

    fn live_generation(&self) -> Option<u64> {
        self.session.try_lock().ok().and_then(|g| {
            g.as_ref()
                .filter(|s| !s.client.is_closed())
                .map(|s| s.generation)
        })
    }

    pub(crate) async fn try_acquire(&self, name: &str, owner: &str) -> Result<Acquired, LockError> {
        let mine = {
            let held = self.held();
            match held.get(name) {
                Some(h) if h.owner != owner => return Ok(Acquired::Busy { remaining: None }),
                Some(h) => Some(h.generation),
                None => None,
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
        let sql = format!(
            "SELECT CASE WHEN pg_try_advisory_lock($1) THEN nextval('{}') END",
            self.fence_seq
        );
        let (token, generation) = self
            .with_session(
                name,
                "pg_try_advisory_lock",
                &sql,
                &[(&key, Type::INT8)],
                |rows| Ok(rows.first().and_then(|r| r.get::<_, Option<i64>>(0))),
            )
            .await?;
        let Some(token) = token else {
            return Ok(Acquired::Busy { remaining: None });
        };
        let raced = {
            let mut held = self.held();
            if held.contains_key(name) {
                true
            } else {
                held.insert(
                    name.to_string(),
                    Held {
                        owner: owner.to_string(),
                        count: 1,
                        token: token as u64,
                        generation,
                    },
                );
                false
            }
        };
        if raced {
            // Another owner of this process won the same name meanwhile: give ours back.
            let _ = self.unlock(name, false).await;
            return Ok(Acquired::Busy { remaining: None });
        }
        Ok(Acquired::Granted {
            token: token as u64,
            count: 1,
        })
    }

    async fn unlock(&self, name: &str, notify: bool) -> Result<(), LockError> {
        let key = advisory_key(&self.table, name);
        // The name travels as bytea: text cannot carry a NUL byte, a valid lock name can.
        let sql = if notify {
            format!(
                "SELECT pg_advisory_unlock($1), pg_notify('{}', encode($2, 'hex'))::text",
                self.channel
            )
        } else {
            "SELECT pg_advisory_unlock($1), length($2)".to_string()
        };
        self.with_session(
            name,
            "pg_advisory_unlock",
            &sql,
            &[(&key, Type::INT8), (&name.as_bytes(), Type::BYTEA)],
            |_| Ok(()),
        )
        .await
        .map(|_| ())
    }

    pub(crate) async fn release(
        self: &std::sync::Arc<Self>,
        name: &str,
        owner: &str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> Result<Released, LockError> {
        let live = self.live_generation();
        {
            let mut held = self.held();
            let Some(h) = held.get_mut(name) else {
                return Ok(Released::NotOwner);
            };
            if h.owner != owner || live.is_some_and(|g| g != h.generation) {
                return Ok(Released::NotOwner);
            }
            h.count = if all { 0 } else { h.count.saturating_sub(1) };
            if h.count > 0 {
                return Ok(Released::Decremented(h.count));
            }
            if keep_for.is_none_or(|k| k.is_zero()) {
                held.remove(name);
            }
        }
        match keep_for.filter(|k| !k.is_zero()) {
            None => self.unlock(name, true).await?,
            Some(keep) => {
                // hold_at_least: keep the session lock for the remainder, then give it back.
                let me = self.clone();
                let name = name.to_string();
                tokio::spawn(async move {
                    tokio::time::sleep(keep).await;
                    let still = me.held().get(&name).is_some_and(|h| h.count == 0);
                    if still {
                        me.held().remove(&name);
                        let _ = me.unlock(&name, true).await;
                    }
                });
            }
        }
        Ok(Released::Freed)
    }

    /// The session that took the lock must still be the live one: one round trip proves it.
    pub(crate) async fn extend(&self, name: &str, owner: &str) -> Result<Extended, LockError> {
        let generation = {
            let held = self.held();
            match held.get(name) {
                Some(h) if h.owner == owner && h.count > 0 => h.generation,
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
        let mut guard = self.session.lock().await;
        let Some(s) = guard.as_ref() else {
            return Ok(false);
        };
        if s.generation != generation || s.client.is_closed() {
            if s.client.is_closed() {
                *guard = None;
            }
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
                    *guard = None;
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
