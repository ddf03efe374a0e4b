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
