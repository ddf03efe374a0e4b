//! Holds no code: the compile-time tests of `#[distributed_lock]` live in `tests/ui.rs`.
