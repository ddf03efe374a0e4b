//! Compile-time behaviour of `#[distributed_lock]`: `tests/ui/pass/*.rs` must build and run,
//! `tests/ui/fail/*.rs` must fail with exactly the checked-in `.stderr`.
//!
//! Stable only: rustc's wording and spans drift between channels. After a deliberate change to
//! a message, regenerate with `TRYBUILD=overwrite cargo test -p dlock-ui --test ui` and review the diff.

#[rustversion::attr(not(stable), ignore)]
#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
