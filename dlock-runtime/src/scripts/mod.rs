//! The Lua scripts of the Redis backend, one per file, built once.
//!
//! Each `.lua` file starts with a header naming its KEYS, ARGV and return values. Names and
//! owners travel only as KEYS/ARGV; no script text is ever built from input.

use std::sync::LazyLock;

use redis::Script;

/// Take or re-enter a lock; mints the fencing token.
pub(crate) static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("acquire.lua")));
/// Owner-checked release with a wake-up on the release channel.
pub(crate) static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("release.lua")));
/// Owner-checked lease extension.
pub(crate) static EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("extend.lua")));
/// Leaves a name's waiters' queue, passing on a wake-up the process cannot use.
pub(crate) static WAKE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("wake.lua")));
/// Raises a name's fence to a given token (Redlock's write-back of the token it granted).
pub(crate) static FENCE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("fence.lua")));
/// Writes an election's leader record unless a later epoch wrote one.
pub(crate) static RECORD: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("record.lua")));

/// A fair lock's try (`Lock::fair`): arrival order, a heartbeat per queued owner.
pub(crate) static FAIR_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("fair_acquire.lua")));
/// A fair lock's release (also a queued owner's leave).
pub(crate) static FAIR_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("fair_release.lua")));

/// Every operation of a read-write lock (`RwLock`) on one name.
pub(crate) static RW: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("rw.lua")));

/// An `EVALSHA` of `script` with room for `args` (keys and arguments, after the key count)
/// totalling about `bytes`: one buffer sized once, instead of redis-rs's `ScriptInvocation`,
/// which copies every argument twice (its own list, then the command) and grows the command's
/// buffer as it goes. Send it with [`run`].
pub(crate) fn evalsha(script: &Script, nkeys: usize, args: usize, bytes: usize) -> redis::Cmd {
    let hash = script.get_hash();
    let mut cmd = redis::Cmd::with_capacity(3 + args, 7 + hash.len() + 1 + bytes);
    cmd.arg("EVALSHA").arg(hash).arg(nkeys);
    cmd
}

/// Sends an [`evalsha`] command; a `NOSCRIPT` answer (a server whose script cache was emptied
/// by a restart or `SCRIPT FLUSH`) loads `script` and sends the command again, as redis-rs's
/// `ScriptInvocation::invoke_async` does.
pub(crate) async fn run<T: redis::FromRedisValue>(
    script: &Script,
    cmd: &redis::Cmd,
    con: &mut impl redis::aio::ConnectionLike,
) -> redis::RedisResult<T> {
    match cmd.query_async(con).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.load_async(con).await?;
            cmd.query_async(con).await
        }
        r => r,
    }
}

/// The release script's reply (see the header of `release.lua`): -1 not the owner, 0 freed, a
/// positive count of holds left.
pub(crate) fn release_reply(r: i64) -> crate::backend::Released {
    use crate::backend::Released;
    match r {
        n if n < 0 => Released::NotOwner,
        0 => Released::Freed,
        n => Released::Decremented(n.min(u32::MAX as i64) as u32),
    }
}

/// The extend script's reply: 1 extended, anything else lost.
pub(crate) fn extend_reply(r: i64) -> crate::backend::Extended {
    if r == 1 {
        crate::backend::Extended::Extended
    } else {
        crate::backend::Extended::Lost
    }
}

/// The acquire script's reply (see the header of `acquire.lua`): a bulk string token for a
/// first acquisition, `[token, count]` for a re-entry, an integer (the remaining lease in ms,
/// -1 without expiry) when another owner holds the lock. `None` for anything else.
pub(crate) fn acquire_reply(v: &redis::Value) -> Option<crate::backend::Acquired> {
    use crate::backend::Acquired;
    use redis::Value;
    match v {
        Value::BulkString(b) => Some(Acquired::Granted {
            token: digits(b)?,
            count: 1,
        }),
        Value::Int(pttl) => Some(Acquired::Busy {
            remaining: (*pttl >= 0).then(|| std::time::Duration::from_millis(*pttl as u64)),
        }),
        Value::Array(a) => match a.as_slice() {
            [t, Value::Int(count)] => Some(Acquired::Granted {
                token: match t {
                    Value::BulkString(b) => digits(b)?,
                    Value::Int(n) => u64::try_from(*n).ok()?,
                    _ => return None,
                },
                count: (*count).clamp(0, u32::MAX as i64) as u32,
            }),
            _ => None,
        },
        _ => None,
    }
}

/// A decimal token: ASCII digits only, no sign, fits in a u64.
fn digits(b: &[u8]) -> Option<u64> {
    if b.is_empty() || b.len() > 20 {
        return None;
    }
    b.iter().try_fold(0u64, |n, &c| {
        c.is_ascii_digit()
            .then_some(())
            .and_then(|_| n.checked_mul(10)?.checked_add(u64::from(c - b'0')))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Acquired;
    use redis::Value;
    use std::time::Duration;

    #[test]
    fn acquire_replies_parse_by_type() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        assert!(matches!(
            acquire_reply(&bulk("1732377600000001")),
            Some(Acquired::Granted {
                token: 1732377600000001,
                count: 1
            })
        ));
        assert!(matches!(
            acquire_reply(&Value::Array(vec![bulk("42"), Value::Int(3)])),
            Some(Acquired::Granted {
                token: 42,
                count: 3
            })
        ));
        assert!(matches!(
            acquire_reply(&Value::Int(1500)),
            Some(Acquired::Busy { remaining: Some(d) }) if d == Duration::from_millis(1500)
        ));
        assert!(matches!(
            acquire_reply(&Value::Int(-1)),
            Some(Acquired::Busy { remaining: None })
        ));
        for bad in [
            bulk(""),
            bulk("-1"),
            bulk("12a"),
            bulk("99999999999999999999999"),
            Value::Nil,
            Value::Array(vec![Value::Int(1)]),
        ] {
            assert!(acquire_reply(&bad).is_none(), "{bad:?} accepted");
        }
    }
}
