//! The Redis scripts on their own, run by raw EVAL against a private `redis-server`: argument
//! validation happens before any write, and a `hold_at_least` remainder (count 0) cannot be
//! extended (issue 7, deliverable 6).

mod common;

use common::RedisProc;

const ACQUIRE: &str = include_str!("../dlock-runtime/src/scripts/acquire.lua");
const RELEASE: &str = include_str!("../dlock-runtime/src/scripts/release.lua");
const EXTEND: &str = include_str!("../dlock-runtime/src/scripts/extend.lua");

fn exists(con: &mut redis::Connection, key: &str) -> bool {
    redis::cmd("EXISTS").arg(key).query::<i64>(con).unwrap() == 1
}

#[test]
fn acquire_rejects_bad_ttls_before_writing_anything() {
    let srv = RedisProc::start();
    let mut con = srv.admin();
    for (ttl, fttl) in [
        ("0", "1000"),
        ("-5", "1000"),
        ("1.5", "1000"),
        ("abc", "1000"),
        ("18446744073709551615", "1000"),
        ("1000", "0"),
        ("1000", "18446744073709551615"),
        // Only canonical digits reach PEXPIRE (a pattern check, not `tonumber`, which would
        // take these and leave PEXPIRE to fail after the hash was written).
        ("1e3", "1000"),
        (" 1000", "1000"),
        ("0x10", "1000"),
        ("0100", "1000"),
        ("100000000000000", "1000"),
        // The fence ttl is refused by SET itself, before anything is written.
        ("1000", "-5"),
        ("1000", "1.5"),
        ("1000", "abc"),
    ] {
        let r: redis::RedisResult<redis::Value> = redis::Script::new(ACQUIRE)
            .key("dlock:{v}")
            .key("dlock:{v}:fence")
            .arg("o1")
            .arg(ttl)
            .arg(fttl)
            .invoke(&mut con);
        assert!(
            r.is_err(),
            "ttl {ttl} / fence ttl {fttl} must be refused, got {r:?}"
        );
        assert!(
            !exists(&mut con, "dlock:{v}"),
            "lock hash written for ttl {ttl}"
        );
        assert!(
            !exists(&mut con, "dlock:{v}:fence"),
            "fence key written for ttl {ttl}"
        );
    }
}

#[test]
fn release_and_extend_reject_bad_arguments_before_writing_anything() {
    let srv = RedisProc::start();
    let mut con = srv.admin();
    // A first acquisition answers its token (a bulk string of digits).
    let r: String = redis::Script::new(ACQUIRE)
        .key("dlock:{v}")
        .key("dlock:{v}:fence")
        .arg("o1")
        .arg(60_000)
        .arg(120_000)
        .invoke(&mut con)
        .unwrap();
    assert!(r.parse::<u64>().is_ok_and(|t| t > 0), "not a grant: {r:?}");
    for bad in ["-1", "x", "2.5", "18446744073709551615"] {
        let r: redis::RedisResult<i64> = redis::Script::new(RELEASE)
            .key("dlock:{v}")
            .arg("o1")
            .arg(bad)
            .arg("dlock:{v}:rel")
            .arg(1)
            .invoke(&mut con);
        assert!(
            r.is_err(),
            "release keep-for {bad} must be refused, got {r:?}"
        );
        let r: redis::RedisResult<i64> = redis::Script::new(EXTEND)
            .key("dlock:{v}")
            .arg("o1")
            .arg(bad)
            .invoke(&mut con);
        assert!(r.is_err(), "extend ttl {bad} must be refused, got {r:?}");
        let held: Option<i64> = redis::cmd("HGET")
            .arg("dlock:{v}")
            .arg("o1")
            .query(&mut con)
            .unwrap();
        assert_eq!(
            held,
            Some(1),
            "the hold changed after a refused call with {bad}"
        );
        let pttl: i64 = redis::cmd("PTTL").arg("dlock:{v}").query(&mut con).unwrap();
        assert!(
            pttl > 50_000,
            "the lease changed after a refused call with {bad}: {pttl}"
        );
    }
}

#[test]
fn a_hold_at_least_remainder_cannot_be_extended() {
    let srv = RedisProc::start();
    let mut con = srv.admin();
    // A first acquisition answers its token (a bulk string of digits).
    let r: String = redis::Script::new(ACQUIRE)
        .key("dlock:{h}")
        .key("dlock:{h}:fence")
        .arg("o1")
        .arg(60_000)
        .arg(120_000)
        .invoke(&mut con)
        .unwrap();
    assert!(r.parse::<u64>().is_ok_and(|t| t > 0), "not a grant: {r:?}");
    // Released with a keep-for: the owner field stays at 0 until the remainder runs out.
    let left: i64 = redis::Script::new(RELEASE)
        .key("dlock:{h}")
        .arg("o1")
        .arg(5_000)
        .arg("dlock:{h}:rel")
        .arg(1)
        .invoke(&mut con)
        .unwrap();
    assert_eq!(left, 0);
    let ok: i64 = redis::Script::new(EXTEND)
        .key("dlock:{h}")
        .arg("o1")
        .arg(60_000)
        .invoke(&mut con)
        .unwrap();
    assert_eq!(ok, 0, "a released hold (count 0) was extended");
    let pttl: i64 = redis::cmd("PTTL").arg("dlock:{h}").query(&mut con).unwrap();
    assert!(pttl <= 5_000, "the remainder's expiry moved: {pttl} ms");
}

/// The acquire script's three reply shapes, as the backends parse them (`scripts::acquire_reply`):
/// a first acquisition answers its token alone (a bulk string of digits, the value also stored
/// in the fence key and the hash's `:fence`), a re-entry `[token, count]`, a busy lock the
/// holder's remaining lease in ms as an integer.
#[test]
fn acquire_replies_a_token_then_token_and_count_then_the_remaining_lease() {
    use redis::Value;
    let srv = RedisProc::start();
    let mut con = srv.admin();
    let mut acquire = |owner: &str| -> Value {
        redis::Script::new(ACQUIRE)
            .key("dlock:{r}")
            .key("dlock:{r}:fence")
            .arg(owner)
            .arg(60_000)
            .arg(120_000)
            .invoke(&mut con)
            .unwrap()
    };
    let first = acquire("o1");
    let Value::BulkString(t) = &first else {
        panic!("a first acquisition must answer a bulk string, got {first:?}");
    };
    let token = String::from_utf8(t.clone()).unwrap();
    assert!(
        token.len() == 16 && token.bytes().all(|b| b.is_ascii_digit()),
        "the token is microseconds since the epoch: {token:?}"
    );
    let again = acquire("o1");
    assert_eq!(
        again,
        Value::Array(vec![Value::BulkString(t.clone()), Value::Int(2)]),
        "a re-entry answers [token, count]"
    );
    let busy = acquire("o2");
    let Value::Int(pttl) = busy else {
        panic!("a busy lock must answer an integer, got {busy:?}");
    };
    assert!(
        (50_000..=60_000).contains(&pttl),
        "busy answers the remaining lease: {pttl}"
    );
    let fence: String = redis::cmd("GET")
        .arg("dlock:{r}:fence")
        .query(&mut con)
        .unwrap();
    let in_hash: String = redis::cmd("HGET")
        .arg("dlock:{r}")
        .arg(":fence")
        .query(&mut con)
        .unwrap();
    assert_eq!(
        (fence.as_str(), in_hash.as_str()),
        (token.as_str(), token.as_str())
    );
    let held: Option<String> = redis::cmd("HGET")
        .arg("dlock:{r}")
        .arg("o2")
        .query(&mut con)
        .unwrap();
    assert_eq!(held, None, "a busy try must not add its owner");
}
