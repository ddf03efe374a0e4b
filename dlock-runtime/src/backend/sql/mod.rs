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
