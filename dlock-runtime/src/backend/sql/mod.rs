//! Database lock tables: the parts the PostgreSQL and MySQL/MariaDB engines share (table-name
//! checks, bounded calls, typed errors).
//!
//! Both engines keep one row per held lock, keyed by the lock name, and judge expiry by the
//! database's clock only (`clock_timestamp()` / `UTC_TIMESTAMP(6)`): the client's wall clock is
//! never read. Every statement runs in its own autocommit transaction on a pooled connection of
//! the backend, never in the caller's transaction.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::LockError;

#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod admin;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod pg_advisory;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;

/// The default lock table.
pub(crate) const DEFAULT_TABLE: &str = "dlock_locks";

/// A database URL with dlock's own query parameters taken out: `dlock_table=<table>` and
/// `dlock_mode=table|advisory`. The library, the backends' builders and the CLI read the same
/// URL, so one string names one lock table everywhere.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct DlockParams {
    /// The URL for the driver, without the `dlock_` parameters.
    pub(crate) url: String,
    /// `dlock_table`, when given.
    pub(crate) table: Option<String>,
    /// `dlock_mode`, lower-cased, when given.
    pub(crate) mode: Option<String>,
}

/// Splits `dlock_table` and `dlock_mode` out of `url`'s query. Any other `dlock_` parameter is an
/// error naming the two it knows (a typo would otherwise reach the driver, which rejects it as
/// "invalid connection string", or be ignored). Other parameters are kept in their order.
pub(crate) fn split_dlock_params(url: &str) -> Result<DlockParams, String> {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let mut table = None;
    let mut mode = None;
    let mut kept = Vec::new();
    for kv in query.into_iter().flat_map(|q| q.split('&')) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        match k {
            "dlock_table" => table = Some(v.to_string()),
            "dlock_mode" => mode = Some(v.to_ascii_lowercase()),
            k if k.starts_with("dlock_") => {
                return Err(format!(
                    "unknown URL parameter `{k}` (dlock knows dlock_table and dlock_mode)"
                ));
            }
            "" => {}
            _ => kept.push(kv),
        }
    }
    let url = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok(DlockParams { url, table, mode })
}

/// The table a builder ends up with: the URL's `dlock_table` when the builder's `table(..)` was
/// left at the default or names the same table; two different names are a `Config` error.
pub(crate) fn table_from_url(
    builder_table: &str,
    url_table: Option<String>,
) -> Result<String, LockError> {
    match url_table {
        None => Ok(builder_table.to_string()),
        Some(t) if builder_table == DEFAULT_TABLE || builder_table == t => Ok(t),
        Some(t) => Err(LockError::Config(format!(
            "the lock table is named twice: `{builder_table}` by the builder's table(..) and \
             `{t}` by the URL's dlock_table; keep one"
        ))),
    }
}

/// A call to the database that did not answer within the backend's operation timeout.
#[derive(Debug)]
pub(crate) struct SqlTimeout {
    pub(crate) what: &'static str,
    pub(crate) after: Duration,
}

impl fmt::Display for SqlTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the database did not answer {} within {:?}",
            self.what, self.after
        )
    }
}

impl std::error::Error for SqlTimeout {}

/// Runs `fut` for at most `limit`; a timeout becomes a [`LockError::Backend`] for `key`.
pub(crate) async fn bounded<T, E>(
    key: &str,
    what: &'static str,
    limit: Duration,
    fut: impl Future<Output = Result<T, E>>,
) -> Result<T, LockError>
where
    E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
{
    match tokio::time::timeout(limit, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(LockError::backend(key, e)),
        Err(_) => Err(LockError::backend(key, SqlTimeout { what, after: limit })),
    }
}

/// Releases (of every hold: `all`) whose answer was not read, per (name, owner): sent, then
/// an error, a timeout or a dropped future. The release may have been applied or not. Until an
/// answer comes, the backend re-sends it in the background (see [`release_until_confirmed`]),
/// and a release of such an owner that finds nothing of it held reports `Freed` when the row
/// shows that owner's release applied (its own count 0, or the row gone), never `NotOwner` for
/// a release of its own whose answer was lost.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[derive(Debug, Default)]
pub(crate) struct Unconfirmed(
    std::sync::Mutex<std::collections::HashMap<(String, String), Resend>>,
);

/// The state of an unanswered release: re-sent in the background, or answered there (kept a
/// while, so that the caller's own retry is answered as the release it was).
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[derive(Debug)]
struct Resend {
    running: bool,
    ended: Option<std::time::Instant>,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl Unconfirmed {
    fn set(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<(String, String), Resend>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a release of `owner` on `name` went unanswered to its caller.
    pub(crate) fn contains(&self, name: &str, owner: &str) -> bool {
        self.set()
            .contains_key(&(name.to_string(), owner.to_string()))
    }
}

/// A database backend's single release (one statement, no retry of its own).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) trait ReleaseOnce: Clone + Send + Sync + 'static {
    fn unconfirmed(&self) -> &Unconfirmed;
    fn release_once<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> crate::backend::BoxFuture<'a, Result<crate::backend::Released, LockError>>;
}

/// How long the background re-sending of an unanswered release goes on (back-off 100 ms to
/// 2 s): past it, the lease (the holder's ttl) frees the row by itself.
#[cfg(any(feature = "postgres", feature = "mysql"))]
const RESEND_RELEASE_FOR: Duration = Duration::from_secs(60);

/// `release_once`, and when its answer is not read (an error, a timeout, the future dropped)
/// and it released every hold (`all`: re-sending a decrement could decrement twice), the
/// release is re-sent in the background, with back-off, until it is answered (rule 3 of
/// "Calls whose outcome is unknown").
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn release_until_confirmed<B: ReleaseOnce>(
    b: &B,
    name: &str,
    owner: &str,
    keep_for: Option<Duration>,
    all: bool,
) -> Result<crate::backend::Released, LockError> {
    struct Armed<'a, B: ReleaseOnce> {
        b: &'a B,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        armed: bool,
    }
    impl<B: ReleaseOnce> Drop for Armed<'_, B> {
        fn drop(&mut self) {
            if self.armed {
                resend_in_background(self.b, self.name, self.owner, self.keep_for);
            }
        }
    }
    let mut g = Armed {
        b,
        name,
        owner,
        keep_for,
        armed: all,
    };
    let r = b.release_once(name, owner, keep_for, all).await;
    if r.is_ok() {
        g.armed = false;
        b.unconfirmed()
            .set()
            .remove(&(name.to_string(), owner.to_string()));
    }
    r
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
fn resend_in_background<B: ReleaseOnce>(
    b: &B,
    name: &str,
    owner: &str,
    keep_for: Option<Duration>,
) {
    let key = (name.to_string(), owner.to_string());
    {
        let mut set = b.unconfirmed().set();
        // Answered long ago: forget them (owner ids are never reused).
        set.retain(|_, r| {
            r.ended
                .is_none_or(|t| t.elapsed() < Duration::from_secs(600))
        });
        let r = set.entry(key.clone()).or_insert(Resend {
            running: false,
            ended: None,
        });
        if r.running {
            return; // re-sent already
        }
        r.running = true;
        r.ended = None;
    }
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        // No runtime: the lease frees the row by itself.
        b.unconfirmed().set().remove(&key);
        return;
    };
    let b = b.clone();
    rt.spawn(async move {
        let end = tokio::time::Instant::now() + RESEND_RELEASE_FOR;
        let mut backoff = Duration::from_millis(100);
        loop {
            tokio::time::sleep(backoff).await;
            if !b.unconfirmed().set().contains_key(&key) {
                return; // the caller's own release was answered meanwhile
            }
            match b.release_once(&key.0, &key.1, keep_for, true).await {
                Ok(_) => break,
                Err(e) if tokio::time::Instant::now() + backoff >= end => {
                    tracing::warn!(key = %key.0, error = %e, "dlock: a release still unanswered after {RESEND_RELEASE_FOR:?}; its lease frees the lock");
                    break;
                }
                Err(e) => {
                    tracing::debug!(key = %key.0, error = %e, "dlock: re-sending an unanswered release");
                }
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
        if let Some(r) = b.unconfirmed().set().get_mut(&key) {
            r.running = false;
            r.ended = Some(std::time::Instant::now());
        }
    });
}

/// Checks a table name: `table` or `schema.table`, each part `[A-Za-z_][A-Za-z0-9_]*`, at most
/// 48 bytes each (so derived names such as `<table>_fence` stay within identifier limits).
pub(crate) fn check_table(table: &str) -> Result<(), LockError> {
    let parts: Vec<&str> = table.split('.').collect();
    let ok = parts.len() <= 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.len() <= 48
                && p.bytes()
                    .next()
                    .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
                && p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        });
    if ok {
        Ok(())
    } else {
        Err(LockError::Config(format!(
            "invalid lock table name {table:?}: use `table` or `schema.table`, letters, digits and `_`, at most 48 bytes per part"
        )))
    }
}

/// A ttl in whole microseconds for the database, at least 1.
pub(crate) fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX).max(1)
}

/// The URL with every secret replaced by `***` (see `crate::redact`).
pub(crate) fn redact_url(url: &str) -> String {
    crate::redact::redact_url(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_checked() {
        for ok in ["dlock_locks", "s.t", "_x1"] {
            assert!(check_table(ok).is_ok(), "{ok}");
        }
        for bad in ["", "1x", "a.b.c", "a;drop", "a b", "t\"", &"x".repeat(49)] {
            assert!(check_table(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(redact_url("mysql://root@h/test"), "mysql://root@h/test");
        assert_eq!(redact_url("postgres://h/db"), "postgres://h/db");
    }
}
