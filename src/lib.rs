//! # dlock: distributed locks for async Rust
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock::LockError> {
//! #[dlock::distributed_lock(key = "order:{order_id}", ttl = "30s", wait = "5s")]
//! async fn pay(order_id: u64) -> Result<u64, dlock::LockError> {
//!     // Runs under the lock; the fencing token goes with every write.
//!     Ok(dlock::fencing_token().unwrap())
//! }
//! pay(42).await?;
//! # Ok(()) }
//! ```
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]
#![doc(test(attr(deny(warnings))))]

pub use dlock_runtime::*;

#[doc(inline)]
pub use dlock_macros::{distributed_lock, key};

/// Not public API: what the `#[distributed_lock]` expansion calls. No semver promise.
#[doc(hidden)]
pub mod __private {
    pub use core;
    pub use dlock_runtime::private::*;
    pub use std::time::Duration;
}
