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
