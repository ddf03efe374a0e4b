//! The runtime of the `dlock` distributed-lock toolkit: what `#[distributed_lock]` expands to,
//! and the manual API beside it.
//!
//! Applications depend on the `dlock` facade crate, which re-exports everything here (its front
//! page has the getting-started guide); the examples below use `dlock::` paths for that reason.
//!
//! * [`Lock`] builds an acquisition; [`LockGuard`] is a held lock with its fencing token, its
//!   lost-lease signal and a watchdog that renews the lease. [`fencing_token`] is the token of
//!   the lock the current call chain holds, and [`in_current_scope`] carries it into a spawned
//!   task.
//! * [`init`], [`init_named`], [`init_from_env`] and [`register`] fill the process-global
//!   registry of backends; [`RedisBackend`] and [`MemoryBackend`] are always built in, the other
//!   engines behind cargo features.
//! * [`mod@backend`] is for those who write a backend of their own: the [`Backend`] trait's
//!   types, the local wait queues, and how a lock name maps to Redis keys.
//! * [`admin`] is the operator's view (list, show, force-release, watch), which the `dlock` CLI
//!   is built on.
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]
#![doc(test(attr(deny(warnings))))]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod admin;
pub mod backend;
mod context;
mod election;
mod error;
mod give_back;
mod guard;
mod holder;
mod key;
mod lock;
mod metrics;
mod policy;
mod primitive;
mod redact;
mod registry;
mod rwlock;
mod scripts;
mod semaphore;
#[cfg(test)]
mod test_capture;
mod wait;
mod watchdog;
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub mod web;

#[doc(hidden)]
pub mod private;

pub use backend::Backend;
#[cfg(feature = "cluster")]
#[cfg_attr(docsrs, doc(cfg(feature = "cluster")))]
pub use backend::cluster::{ClusterBackend, ClusterBackendBuilder};
#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub use backend::etcd::{EtcdBackend, EtcdBackendBuilder};
pub use backend::memory::MemoryBackend;
pub use backend::redis::{RedisBackend, RedisBackendBuilder};
pub use backend::redlock::{RedlockBackend, RedlockBuilder, init_redlock};
#[cfg(feature = "sentinel")]
#[cfg_attr(docsrs, doc(cfg(feature = "sentinel")))]
pub use backend::sentinel::{SentinelBackend, SentinelBuilder, init_sentinel};
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use backend::sql::mysql::{MysqlBackend, MysqlBackendBuilder, mysql_schema_sql};
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use backend::sql::pg_advisory::advisory_key as postgres_advisory_key;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use backend::sql::postgres::{
    PostgresBackend, PostgresBackendBuilder, PostgresWaitStats, postgres_functions_sql,
    postgres_schema_sql,
};
#[cfg(feature = "zookeeper")]
#[cfg_attr(docsrs, doc(cfg(feature = "zookeeper")))]
pub use backend::zookeeper::{ZookeeperBackend, ZookeeperBackendBuilder};
pub use context::{fencing_token, in_current_scope};
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use deadpool_postgres;
pub use election::{
    DEFAULT_ELECTION_TTL, DEFAULT_OBSERVE_EVERY, ELECTION_PREFIX, Election, Leader, Observer, Term,
};
pub use error::{LockError, LostReason};
#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub use etcd_client;
pub use guard::LockGuard;
pub use holder::{HOLDER_NAME_ENV, HolderId, MAX_NAME_CHARS, holder_identity, set_holder_name};
pub use key::MAX_KEY_LEN;
pub use lock::{DEFAULT_TTL, Lock};
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use mysql_async;
pub use policy::{
    OnBusy, OnLost, Policy, define_policy, load_policies, load_policies_str, policy,
    policy_env_var, policy_names,
};
#[cfg(feature = "cluster")]
#[cfg_attr(docsrs, doc(cfg(feature = "cluster")))]
pub use registry::init_cluster;
pub use registry::{
    DEFAULT_BACKEND, URL_ENV, backend, init, init_from_env, init_named, register, register_arc,
};
pub use rwlock::{ReadGuard, RwLock, WriteGuard};
pub use semaphore::{Semaphore, SemaphoreGuard};
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use tokio_postgres;
pub use tokio_util::sync::CancellationToken;
