//! Lock names: validation and the fixed rule that maps a name to Redis keys.
//!
//! See [`redis_keys`] for the naming rule.

use crate::LockError;

/// The longest lock name accepted, in bytes.
pub const MAX_KEY_LEN: usize = 1024;

/// Checks a lock name: not empty and at most [`MAX_KEY_LEN`] bytes.
pub(crate) fn validate(name: &str) -> Result<(), LockError> {
    if name.is_empty() {
        return Err(LockError::InvalidKey {
            key: String::new(),
            reason: "a lock name must not be empty",
        });
    }
    if name.len() > MAX_KEY_LEN {
        let mut cut = 64;
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        return Err(LockError::InvalidKey {
            key: format!("{}…", &name[..cut]),
            reason: "a lock name must be at most 1024 bytes",
        });
    }
    Ok(())
}

fn escape_into(out: &mut String, name: &str) {
    // Most names have nothing to escape: copy them whole.
    if !name.bytes().any(|b| matches!(b, b'\\' | b'{' | b'}')) {
        out.push_str(name);
        return;
    }
    for c in name.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '{' => out.push_str("\\("),
            '}' => out.push_str("\\)"),
            c => out.push(c),
        }
    }
}

/// The lock key `dlock:{E}` of `name` (see [`redis_keys`]).
pub(crate) fn lock_key(name: &str) -> String {
    let mut lock = String::with_capacity(name.len() + 8);
    lock.push_str("dlock:{");
    escape_into(&mut lock, name);
    lock.push('}');
    lock
}

/// The key `dlock:holder:<process>` where a process stores its holder identity
/// (`name@host:pid`, see `holder.rs`) for the owner ids with that process prefix. Never of the
/// form `dlock:{..}`, so never a lock's key.
pub(crate) fn holder_key(process: &str) -> String {
    format!("dlock:holder:{process}")
}

/// `lock` followed by `suffix` (`:fence`, `:rel`).
pub(crate) fn suffixed(lock: &str, suffix: &str) -> String {
    let mut s = String::with_capacity(lock.len() + suffix.len());
    s.push_str(lock);
    s.push_str(suffix);
    s
}

/// Suffix of the fence key after the lock key.
pub(crate) const FENCE_SUFFIX: &str = ":fence";
/// Suffix of the release channel after the lock key.
pub(crate) const CHANNEL_SUFFIX: &str = ":rel";
/// Suffix of an election's leader record after the lock key (a hash: epoch, value).
pub(crate) const RECORD_SUFFIX: &str = ":leader";
/// Suffix of the waiters' queue after the lock key (a zset: waiting process id -> expiry, and the
/// turn record `~<id>` -> -(server ms of its wake-up), see release.lua).
pub(crate) const QUEUE_SUFFIX: &str = ":q";
/// Suffix of a fair lock's queue after the lock key (a zset: owner id -> arrival number, see
/// `scripts/fair_acquire.lua`).
pub(crate) const FAIR_QUEUE_SUFFIX: &str = ":fq";
/// Suffix of a fair lock's heartbeats after the lock key (a hash: queued owner id -> heartbeat
/// deadline, server ms).
pub(crate) const FAIR_HEARTBEAT_SUFFIX: &str = ":fh";

/// Suffix of a read-write lock's state hash after the lock key (see `scripts/rw.lua`).
pub(crate) const RW_SUFFIX: &str = ":rw";
/// Suffix of a read-write lock's readers zset (owner -> lease end).
pub(crate) const RW_READERS_SUFFIX: &str = ":rw:r";
/// Suffix of a read-write lock's fence key.
pub(crate) const RW_FENCE_SUFFIX: &str = ":rw:fence";
/// Suffix of a read-write lock's readers' wake-up channel.
pub(crate) const RW_READERS_CHANNEL_SUFFIX: &str = ":rw:rd";
/// Suffix of a read-write lock's writers' wake-up channel.
pub(crate) const RW_WRITERS_SUFFIX: &str = ":rw:wr";

/// The Redis names of one lock, built by the rule of [`redis_keys`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisKeys {
    /// The lock hash: `dlock:{E}`.
    pub lock: String,
    /// The fencing counter: `dlock:{E}:fence`.
    pub fence: String,
    /// The release channel: `dlock:{E}:rel`.
    pub channel: String,
}

/// Maps a lock name to its Redis lock key, fence key and release channel.
///
/// # The naming rule
///
/// A lock name `N` is escaped as `E = escape(N)`: `\` becomes `\\`, `{` becomes `\(` and `}`
/// becomes `\)`; every other character stays as it is. Then
///
/// | role | Redis key / channel | example for `order:42` |
/// |---|---|---|
/// | lock (hash `owner -> hold count`, plus field `:fence`) | `dlock:{E}` | `dlock:{order:42}` |
/// | fencing counter (string, kept past release) | `dlock:{E}:fence` | `dlock:{order:42}:fence` |
/// | release channel (pub/sub) | `dlock:{E}:rel` | `dlock:{order:42}:rel` |
/// | waiters' queue (zset `process id -> expiry` and the last turn `~id -> -woken at`, while processes wait) | `dlock:{E}:q` | `dlock:{order:42}:q` |
///
/// `E` never contains `}`, so the Redis Cluster hash tag is exactly `E`: all four names of one lock
/// live in one slot, user input cannot move the slot, and the escaping is injective, so no name's
/// keys collide with another name's keys of any role.
///
///
/// ```
/// # use dlock_runtime as dlock;
/// let keys = dlock::backend::redis_keys("order:42");
/// assert_eq!(keys.lock, "dlock:{order:42}");
/// assert_eq!(keys.fence, "dlock:{order:42}:fence");
/// assert_eq!(keys.channel, "dlock:{order:42}:rel");
/// assert_eq!(dlock::backend::redis_keys("a}b").lock, "dlock:{a\\)b}");
/// ```
pub fn redis_keys(name: &str) -> RedisKeys {
    let lock = lock_key(name);
    let fence = suffixed(&lock, FENCE_SUFFIX);
    let channel = suffixed(&lock, CHANNEL_SUFFIX);
    RedisKeys {
        lock,
        fence,
        channel,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_render_unchanged() {
        assert_eq!(redis_keys("order:42").lock, "dlock:{order:42}");
    }

    #[test]
    fn escaping_is_injective_on_tricky_names() {
        let names = [
            "a", "a}", "a\\)", "a\\", "a{", "a\\(", "}", "{", "\\", "a:fence", "a}:fence", "a:rel",
            "x}{y", "x\\}{y", "",
        ];
        let mut all = std::collections::HashSet::new();
        for n in names {
            let k = redis_keys(n);
            for s in [k.lock, k.fence, k.channel] {
                assert!(all.insert(s.clone()), "collision on {s} from {n:?}");
                // The hash tag is the escaped name: the first `}` closes our own `{`.
                let open = s.find('{').unwrap();
                let close = open + s[open..].find('}').unwrap();
                let tag = &s[open + 1..close];
                assert!(!tag.contains('}'));
            }
        }
    }

    #[test]
    fn validation_limits() {
        assert!(validate("").is_err());
        assert!(validate(&"x".repeat(1024)).is_ok());
        let e = validate(&"é".repeat(600)).unwrap_err();
        assert!(matches!(e, LockError::InvalidKey { .. }));
    }
}
