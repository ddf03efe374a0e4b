//! The one error type of the toolkit.

use std::time::Duration;

/// Why a held lock stopped being valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LostReason {
    /// The guard's own deadline (send time of the last confirmed acquire or renewal plus the ttl)
    /// passed before a renewal was confirmed: a paused server, a partition, a paused process.
    Deadline,
    /// The backend answered that the caller no longer owns the lock (it expired and was taken,
    /// or it was deleted behind the holder's back).
    NotOwner,
    /// The watchdog stopped renewing because the `max_hold` cap was reached.
    MaxHold,
}

impl std::fmt::Display for LostReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LostReason::Deadline => "the lease deadline passed without a confirmed renewal",
            LostReason::NotOwner => "the backend no longer lists this holder as the owner",
            LostReason::MaxHold => "the max_hold cap was reached",
        })
    }
}

/// Everything that can go wrong when taking, keeping or giving back a lock.
///
/// Messages are lowercase and name the lock; accessors give the parts a caller acts on
/// ([`LockError::key`], [`LockError::retry_after`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// The lock is held by another owner and the caller asked not to wait (`wait = 0`).
    #[error("lock `{key}` is busy{}", fmt_retry(*retry_after))]
    Busy {
        /// The lock name.
        key: String,
        /// Time until the holder's lease ends, when the backend reported it.
        retry_after: Option<Duration>,
    },
    /// The lock stayed held by another owner for the whole wait.
    #[error("timed out after {} waiting for lock `{key}`{}", fmt_dur(*waited), fmt_retry(*retry_after))]
    TimedOut {
        /// The lock name.
        key: String,
        /// How long the caller waited.
        waited: Duration,
        /// Time until the holder's lease ends, as last reported.
        retry_after: Option<Duration>,
    },
    /// The lease was lost while the lock was held, or an extend found another owner.
    #[error("lock `{key}` was lost: {reason}")]
    Lost {
        /// The lock name.
        key: String,
        /// Why it was lost.
        reason: LostReason,
    },
    /// A release the backend refused because another owner holds the lock now: nothing was
    /// deleted. (A guard that already knows it is lost returns [`LockError::Lost`] instead.)
    #[error("lock `{key}` is not held by this owner any more; nothing was released")]
    NotOwner {
        /// The lock name.
        key: String,
    },
    /// A call chain that holds a read lock of a [`crate::RwLock`] asked for its write lock.
    /// An upgrade is refused, never waited for (two readers upgrading would wait for each other
    /// for ever): give the read guard back first, then take the write lock. Nothing was sent.
    #[error(
        "lock `{key}`: this call chain holds the read lock and asked for the write lock; an upgrade is refused (release the read guard first)"
    )]
    UpgradeRefused {
        /// The lock name.
        key: String,
    },
    /// No backend is registered under this name.
    #[error("no lock backend named `{name}` is registered (known: {})", known.join(", "))]
    UnknownBackend {
        /// The name asked for.
        name: String,
        /// The names that are registered.
        known: Vec<String>,
    },
    /// No lock policy is defined under this name.
    #[error("no lock policy named `{name}` is defined (known: {})", if known.is_empty() { "none".to_string() } else { known.join(", ") })]
    UnknownPolicy {
        /// The name asked for.
        name: String,
        /// The names that are defined.
        known: Vec<String>,
    },
    /// The lock name cannot be used: empty, or longer than [`crate::MAX_KEY_LEN`] bytes.
    /// Nothing was sent to the backend.
    #[error("invalid lock name {key:?}: {reason}")]
    InvalidKey {
        /// The name (cut to its first 64 bytes when it was too long).
        key: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The configuration is wrong: a malformed URL, an unsupported scheme, a zero ttl, a bad policy
    /// file. Passwords are never part of the message.
    #[error("configuration error: {0}")]
    Config(String),
    /// The backend does not implement this primitive (a semaphore on an engine without
    /// semaphores). Nothing was sent to the server.
    #[error("lock `{key}`: {what} are not supported by this backend")]
    Unsupported {
        /// The lock (or semaphore) name.
        key: String,
        /// What is not supported (`"semaphores"`, `"read-write locks"`).
        what: &'static str,
    },
    /// A semaphore was asked for with a `max` other than the one its live holders were granted
    /// under: two limits on one name are refused, never silently both in force. Nothing was
    /// taken.
    #[error("semaphore `{key}` has max {stored} permits; this caller asked for max {asked}")]
    SemaphoreMax {
        /// The semaphore name.
        key: String,
        /// The caller's `max`.
        asked: u32,
        /// The `max` of the name's live holders.
        stored: u32,
    },
    /// The backend failed: connection refused or dropped, a timeout, no reply, a server error.
    /// Whether the lock was taken is unknown only for an acquire whose reply was lost; that try is
    /// then given back in the background (ARCHITECTURE.md, "Calls whose outcome is unknown").
    #[error("backend error{}: {source}", on_lock(key))]
    Backend {
        /// The lock name (empty for errors not tied to one lock).
        key: String,
        /// The underlying error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

/// ` on lock `key``, or nothing for an error not tied to one lock (`init`, a connection).
fn on_lock(key: &str) -> String {
    if key.is_empty() {
        String::new()
    } else {
        format!(" on lock `{key}`")
    }
}

fn fmt_dur(d: Duration) -> String {
    // humantime prints "1s 500ms"; round to milliseconds first so it stays short.
    humantime::format_duration(Duration::from_millis(d.as_millis() as u64)).to_string()
}

fn fmt_retry(r: Option<Duration>) -> String {
    match r {
        Some(d) => format!(" (holder's lease ends in {})", fmt_dur(d)),
        None => String::new(),
    }
}

impl LockError {
    /// The lock name the error is about, when it is about one.
    pub fn key(&self) -> Option<&str> {
        match self {
            LockError::Busy { key, .. }
            | LockError::TimedOut { key, .. }
            | LockError::Lost { key, .. }
            | LockError::NotOwner { key }
            | LockError::InvalidKey { key, .. }
            | LockError::Unsupported { key, .. }
            | LockError::SemaphoreMax { key, .. }
            | LockError::UpgradeRefused { key } => Some(key),
            LockError::Backend { key, .. } if !key.is_empty() => Some(key),
            _ => None,
        }
    }

    /// For busy and timed-out errors: how long until the holder's lease ends, as the backend
    /// reported it. Suits an HTTP `Retry-After` header.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            LockError::Busy { retry_after, .. } | LockError::TimedOut { retry_after, .. } => {
                *retry_after
            }
            _ => None,
        }
    }

    /// True for [`LockError::Busy`] and [`LockError::TimedOut`]: another owner held the lock.
    pub fn is_contended(&self) -> bool {
        matches!(self, LockError::Busy { .. } | LockError::TimedOut { .. })
    }

    /// True for [`LockError::Lost`].
    pub fn is_lost(&self) -> bool {
        matches!(self, LockError::Lost { .. })
    }

    /// True for [`LockError::Backend`].
    pub fn is_backend(&self) -> bool {
        matches!(self, LockError::Backend { .. })
    }

    pub(crate) fn unsupported(key: &str, what: &'static str) -> Self {
        LockError::Unsupported {
            key: key.to_string(),
            what,
        }
    }

    /// A refusal that no retry can change (an unsupported primitive, a semaphore's `max`
    /// mismatch): a waiting acquisition ends with it at once.
    pub(crate) fn is_definite_refusal(&self) -> bool {
        matches!(
            self,
            LockError::Unsupported { .. } | LockError::SemaphoreMax { .. }
        )
    }

    pub(crate) fn backend(
        key: &str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        LockError::Backend {
            key: key.to_string(),
            source: source.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LockError;

    /// An error not tied to one lock (`init`, a connection) names none: it said "on lock ``".
    #[test]
    fn a_backend_error_names_its_lock_only_when_it_has_one() {
        assert_eq!(
            LockError::backend("", "Connection refused").to_string(),
            "backend error: Connection refused"
        );
        assert_eq!(
            LockError::backend("order:1", "Connection refused").to_string(),
            "backend error on lock `order:1`: Connection refused"
        );
    }
}
