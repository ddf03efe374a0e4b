//! G1 (RELIABILITY.md §4.1, §7 G1): the lock-name → Redis-key rule under generated input.
//!
//! Names are drawn from `{ } ( ) : \ \0 * ? [ ] \n`, ASCII, a few multi-byte characters and any
//! `char`, 1–1,024 bytes, plus near-miss pairs (one name and the same name with one tricky
//! character inserted), which is where an escaping rule breaks. Asserted:
//!
//! * `dlock::backend::redis_keys` is injective and the lock, fence and channel keys of all names are
//!   pairwise disjoint. Shown two ways: a strict parser in this file maps every key back to
//!   exactly one (role, name), so no two (role, name) pairs can share a key; and the six keys of
//!   each generated pair are compared directly.
//! * The Redis Cluster hash tag of each key (first `{`, then the first `}` after it, non-empty;
//!   computed here, not by the runtime) is exactly the escaped name, so user braces never move
//!   it, and the three keys of one name share a slot (CRC16-XMODEM written here).
//! * The client-side slot equals `CLUSTER KEYSLOT` of a loopback `--cluster-enabled yes`
//!   redis-server, for the raw tag-rule examples of §4.1 and a few hundred generated names (one
//!   pipelined batch); KEYSLOT needs no slots assigned.

mod common;

use std::collections::HashMap;

use common::{RedisProc, TempDir};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

// ---------------------------------------------------------------------------------------------
// The reference: CRC16 and the cluster tag rule, written independently of the runtime
// ---------------------------------------------------------------------------------------------

/// CRC16-XMODEM (poly 0x1021, init 0, no reflection, no final xor), as in the Cluster spec.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The part of a key that Redis Cluster hashes: between the first `{` and the first `}` after
/// it when that is non-empty, else the whole key.
fn hash_tag(key: &[u8]) -> &[u8] {
    if let Some(open) = key.iter().position(|&b| b == b'{')
        && let Some(len) = key[open + 1..].iter().position(|&b| b == b'}')
        && len > 0
    {
        return &key[open + 1..open + 1 + len];
    }
    key
}

fn key_slot(key: &[u8]) -> u16 {
    crc16(hash_tag(key)) % 16384
}

/// The documented escaping (`\` → `\\`, `{` → `\(`, `}` → `\)`), written again here.
fn escape(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '{' => out.push_str("\\("),
            '}' => out.push_str("\\)"),
            c => out.push(c),
        }
    }
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Role {
    Lock,
    Fence,
    Channel,
}

/// Strict inverse of the key rule: which (role, name) a string is the key of, if any. Because
/// this is a function, two different (role, name) pairs whose keys it maps back correctly can
/// never share a key.
fn parse_key(key: &str) -> Option<(Role, String)> {
    let rest = key.strip_prefix("dlock:{")?;
    let close = rest.find('}')?;
    let (tag, suffix) = (&rest[..close], &rest[close + 1..]);
    let role = match suffix {
        "" => Role::Lock,
        ":fence" => Role::Fence,
        ":rel" => Role::Channel,
        _ => return None,
    };
    let mut name = String::new();
    let mut chars = tag.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                '\\' => name.push('\\'),
                '(' => name.push('{'),
                ')' => name.push('}'),
                _ => return None,
            },
            '{' | '}' => return None,
            c => name.push(c),
        }
    }
    (!name.is_empty()).then_some((role, name))
}

fn keys_of(name: &str) -> [(Role, String); 3] {
    let k = dlock::backend::redis_keys(name);
    [
        (Role::Lock, k.lock),
        (Role::Fence, k.fence),
        (Role::Channel, k.channel),
    ]
}

/// Every single-name property; returns the three keys.
fn check_one(name: &str) -> Result<[(Role, String); 3], TestCaseError> {
    let keys = keys_of(name);
    let expected_tag = escape(name);
    prop_assert!(
        !expected_tag.contains('}'),
        "escaped name {:?} contains a closing brace",
        expected_tag
    );
    let mut slots = Vec::new();
    for (role, key) in &keys {
        // Injective and role-disjoint: the key parses back to exactly this (role, name).
        prop_assert_eq!(
            parse_key(key),
            Some((*role, name.to_string())),
            "key {:?} of {:?}",
            key,
            name
        );
        // The tag is exactly the escaped name: a `}` or `{` typed by the user cannot end it
        // early or move it.
        let tag = hash_tag(key.as_bytes());
        prop_assert_eq!(tag, expected_tag.as_bytes(), "tag of {:?}", key);
        prop_assert!(!tag.is_empty());
        slots.push(key_slot(key.as_bytes()));
    }
    prop_assert!(
        slots.iter().all(|s| *s == slots[0]),
        "keys of {name:?} span slots {slots:?}"
    );
    prop_assert_eq!(slots[0], crc16(expected_tag.as_bytes()) % 16384);
    Ok(keys)
}

// ---------------------------------------------------------------------------------------------
// Generators
// ---------------------------------------------------------------------------------------------

const TRICKY: &[char] = &[
    '{', '}', '(', ')', ':', '\\', '\0', '*', '?', '[', ']', '\n',
];

fn name_char() -> impl Strategy<Value = char> {
    prop_oneof![
        5 => prop::sample::select(TRICKY),
        3 => prop::char::range('a', 'e'),
        1 => prop::sample::select(&['é', 'ß', 'Ω', '日', '🦀', '\u{200b}', '\u{fffd}'][..]),
        1 => any::<char>(),
    ]
}

/// Truncates to at most 1,024 bytes at a char boundary (the runtime's limit).
fn fit(chars: Vec<char>) -> String {
    let mut s = String::new();
    for c in chars {
        if s.len() + c.len_utf8() > dlock::MAX_KEY_LEN {
            break;
        }
        s.push(c);
    }
    s
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        12 => prop::collection::vec(name_char(), 1..24),
        1 => prop::collection::vec(name_char(), 200..1100),
    ]
    .prop_map(fit)
}

/// A name and a near miss: the same name with one tricky character inserted somewhere, or with
/// `fence`/`rel` suffix text appended (the §4.1 `x:fence` collision of naive concatenation).
fn near_pair() -> impl Strategy<Value = (String, String)> {
    (
        name(),
        any::<prop::sample::Index>(),
        prop::sample::select(
            &[
                "{", "}", "\\", "\\)", "\\(", "}:fence", "}:rel", ":fence", "}{",
            ][..],
        ),
    )
        .prop_map(|(a, at, ins)| {
            let chars: Vec<char> = a.chars().collect();
            let i = at.index(chars.len() + 1);
            let mut b: Vec<char> = chars[..i].to_vec();
            b.extend(ins.chars());
            b.extend_from_slice(&chars[i..]);
            (a, fit(b))
        })
}

// ---------------------------------------------------------------------------------------------
// Pure properties (~5,000 cases)
// ---------------------------------------------------------------------------------------------

#[test]
fn crc16_matches_the_cluster_spec_check_values() {
    // From the Redis Cluster specification (CRC16 appendix): "123456789" -> 0x31C3.
    assert_eq!(crc16(b"123456789"), 0x31C3);
    // Tag rule examples of the spec and RELIABILITY.md §4.1.
    assert_eq!(hash_tag(b"{user1000}.following"), b"user1000");
    assert_eq!(hash_tag(b"foo{}{bar}"), b"foo{}{bar}");
    assert_eq!(hash_tag(b"foo{{bar}}zap"), b"{bar");
    assert_eq!(hash_tag(b"foo{bar}{zap}"), b"bar");
}

proptest! {
    #![proptest_config(Config { cases: 5_000, failure_persistence: None, ..Config::default() })]

    /// Injective, pairwise disjoint across roles and names, one slot per name, tag = escaped
    /// name, for a near-miss pair and an unrelated third name.
    #[test]
    fn keys_are_injective_disjoint_and_share_one_slot((a, b) in near_pair(), c in name()) {
        let mut seen: HashMap<String, (Role, String)> = HashMap::new();
        for n in [&a, &b, &c] {
            for (role, key) in check_one(n)? {
                if let Some(prev) = seen.insert(key.clone(), (role, n.clone())) {
                    // Only the same (role, name) may map to the same key.
                    prop_assert_eq!(&prev, &(role, n.clone()), "collision on key {:?}", key);
                }
            }
        }
        if a != b {
            prop_assert!(
                dlock::backend::redis_keys(&a).lock != dlock::backend::redis_keys(&b).lock,
                "{:?} and {:?} share a lock key", a, b
            );
        }
    }
}

/// The naive rule (`dlock:` + name, `dlock:` + name + `:fence`) fails the same check: this
/// shows the property can fail, on §4.1's own example.
#[test]
fn the_check_catches_naive_concatenation() {
    let naive = |n: &str| (format!("dlock:{n}"), format!("dlock:{n}:fence"));
    assert_eq!(naive("x:fence").0, naive("x").1);
    // And a name with a `}` would end a naive `dlock:{…}` tag early.
    let naive_tagged = format!("dlock:{{{}}}", "a}b");
    assert_eq!(hash_tag(naive_tagged.as_bytes()), b"a");
    // The real rule keeps the whole (escaped) name as the tag.
    assert_eq!(
        hash_tag(dlock::backend::redis_keys("a}b").lock.as_bytes()),
        b"a\\)b".as_slice()
    );
}

// ---------------------------------------------------------------------------------------------
// Client-side slots against CLUSTER KEYSLOT (a few hundred names, one pipelined batch)
// ---------------------------------------------------------------------------------------------

#[test]
fn client_side_slots_equal_cluster_keyslot() {
    let dir = TempDir::new("keyslot");
    let nodes = dir.path().join("nodes.conf");
    let server = RedisProc::start_with(&[
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        nodes.to_str().expect("utf-8 temp path"),
    ]);
    let mut con = server.admin();

    // Raw keys first: validates this file's tag rule and CRC against the server itself.
    let mut keys: Vec<Vec<u8>> = [
        "foo{}{bar}",
        "foo{{bar}}zap",
        "{user1000}.following",
        "foo{bar}{zap}",
        "no-tag",
        "{}",
        "a{b",
        "}{x}",
    ]
    .iter()
    .map(|k| k.as_bytes().to_vec())
    .collect();
    let mut owners: Vec<Option<String>> = vec![None; keys.len()];

    // Generated names, deterministic seed: 100 pairs plus 100 singles = 300 names, 900 keys.
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let mut names = Vec::new();
    for _ in 0..100 {
        let (a, b) = near_pair().new_tree(&mut runner).unwrap().current();
        names.push(a);
        names.push(b);
        names.push(name().new_tree(&mut runner).unwrap().current());
    }
    for n in &names {
        for (_, k) in keys_of(n) {
            keys.push(k.into_bytes());
            owners.push(Some(n.clone()));
        }
    }

    let mut pipe = redis::pipe();
    for k in &keys {
        pipe.cmd("CLUSTER").arg("KEYSLOT").arg(k.as_slice());
    }
    let server_slots: Vec<u16> = pipe.query(&mut con).expect("pipelined CLUSTER KEYSLOT");
    assert_eq!(server_slots.len(), keys.len());

    let mut mismatches = Vec::new();
    for ((k, owner), srv) in keys.iter().zip(&owners).zip(&server_slots) {
        let ours = key_slot(k);
        if ours != *srv {
            mismatches.push(format!(
                "{:?} (name {owner:?}): client {ours}, server {srv}",
                String::from_utf8_lossy(k)
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} slots differ:\n{}",
        mismatches.len(),
        keys.len(),
        mismatches.join("\n")
    );
    // The three keys of each name share the server's slot too.
    for (i, n) in names.iter().enumerate() {
        let base = 8 + i * 3;
        let s = &server_slots[base..base + 3];
        assert!(s[0] == s[1] && s[1] == s[2], "keys of {n:?} in slots {s:?}");
    }
}
