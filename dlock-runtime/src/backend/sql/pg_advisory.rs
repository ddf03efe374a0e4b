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
use tokio_util::sync::CancellationToken;

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
            channel,
            op_timeout,
            connect_timeout,
            rt: OwnRuntime::start()?,
            released: Mutex::new(HashMap::new()),
        })
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

    pub(crate) async fn try_acquire(&self, name: &str, owner: &str) -> Result<Acquired, LockError> {
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
        let sql = format!(
            "SELECT CASE WHEN pg_try_advisory_lock($1) THEN {} END",
            super::postgres::mint(
                &self.table,
                "0",
                "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
            )
        );
        // A holder name set since the session opened renames the session in the same
        // statement (no round trip added).
        let app_name = crate::holder::application_name();
        let rename = guard.as_ref().expect("live session").app_name != app_name;
        let sql = if rename {
            format!("{sql}, set_config('application_name', $2, false)")
        } else {
            sql
        };
        let r = {
            let client = &guard.as_ref().expect("live session").client;
            let app = app_name.as_str();
            let params: &[(&(dyn tokio_postgres::types::ToSql + Sync), Type)] = if rename {
                &[(&key, Type::INT8), (&app, Type::TEXT)]
            } else {
                &[(&key, Type::INT8)]
            };
            tokio::time::timeout(self.op_timeout, client.query_typed(&sql, params)).await
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

    /// Gives back the lock of `owner` taken on the session of `generation` (`notify`: wake
    /// waiters), on the backend's own runtime, and forgets the hold once that is confirmed: the
    /// unlock answered, or the session that held it is gone (ended, which frees it). Returns
    /// whether the session held it.
    fn give_back(
        self: &std::sync::Arc<Self>,
        name: &str,
        owner: &str,
        generation: u64,
        notify: bool,
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
            let sql = if notify {
                format!(
                    "SELECT pg_advisory_unlock($1), pg_notify('{}', encode($2, 'hex'))::text",
                    me.channel
                )
            } else {
                "SELECT pg_advisory_unlock($1), length($2)".to_string()
            };
            let r = {
                let client = &guard.as_ref().expect("live session").client;
                bounded(
                    &name,
                    "pg_advisory_unlock",
                    me.op_timeout,
                    client.query_typed(
                        &sql,
                        &[(&key, Type::INT8), (&name.as_bytes(), Type::BYTEA)],
                    ),
                )
                .await
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
    ) -> Result<Released, LockError> {
        let keep = keep_for.filter(|k| !k.is_zero());
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
                .give_back(name, owner, generation, true)
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
                self.give_back(name, owner, generation, true)
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
                        let _ = me.give_back(&name, &owner, generation, true).await;
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
