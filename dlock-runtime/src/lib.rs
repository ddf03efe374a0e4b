//! The runtime of the `dlock` distributed-lock toolkit: what `#[distributed_lock]` expands to,
//! and the manual API beside it.
//!
//! Most users depend on the `dlock` facade crate, which re-exports everything here.
//!
//! * [`Lock`] builds an acquisition; [`LockGuard`] is a held lock with its fencing token, its
//!   lost-lease signal and a watchdog that renews the lease.
//! * [`Backend`] is the one trait every store implements; [`RedisBackend`] and [`MemoryBackend`]
//!   are built in. [`init`], [`init_named`] and [`register`] fill the process-global registry.
//! * [`redis_keys`] documents how a lock name maps to Redis keys.
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]
#![doc(test(attr(deny(warnings))))]

mod backend;
mod context;
mod error;
mod guard;
mod key;
mod lock;
mod policy;
mod registry;
mod scripts;
mod wait;
mod watchdog;

#[doc(hidden)]
pub mod private;

pub use backend::memory::MemoryBackend;
pub use backend::redis::{RedisBackend, RedisBackendBuilder};
pub use backend::{Acquired, Backend, BoxFuture, Extended, Released, Watch};
pub use context::fencing_token;
pub use error::{LockError, LostReason};
pub use guard::LockGuard;
pub use key::{MAX_KEY_LEN, RedisKeys, redis_keys};
pub use lock::{DEFAULT_TTL, Lock};
pub use policy::{
    OnBusy, OnLost, Policy, define_policy, load_policies, load_policies_str, policy,
    policy_env_var, policy_names,
};
pub use registry::{DEFAULT_BACKEND, backend, init, init_named, register, register_arc};
pub use tokio_util::sync::CancellationToken;
pub use wait::WaitQueues;
