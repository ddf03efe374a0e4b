//! # dlock: distributed locks for async Rust
//!
//! Annotate an async function and it runs under a lock shared by every copy of your service:
//! on Redis (one server, Sentinel, Cluster or Redlock), PostgreSQL, MySQL/MariaDB, ZooKeeper,
//! etcd, or in memory. Every grant carries a **fencing token**, a **watchdog** renews the lease
//! while the body runs, and a holder hears when it lost the lease.
//!
//! ## Getting started
//!
//! `Cargo.toml`:
//!
//! ```toml
//! [dependencies]
//! dlock = "0.1"   # engines other than Redis and memory: features, see the table below
//! tokio = { version = "1", features = ["macros", "rt-multi-thread"] }
//! ```
//!
//! Start a Redis and run your program with its URL:
//!
//! ```sh
//! redis-server --port 6379 --save "" --appendonly no &
//! DLOCK_URL=redis://127.0.0.1:6379 cargo run
//! ```
//!
//! `src/main.rs`:
//!
//! ```no_run
//! use dlock::LockError;
//!
//! // One lock per order, shared by every process that uses the same Redis.
//! #[dlock::distributed_lock(
//!     key = "order:{order_id}", // the lock's name, built from the argument
//!     ttl = "30s",              // the lease; the watchdog renews it every 10 s while the body runs
//!     wait = "5s",              // wait up to 5 s for the holder, then Err(LockError::TimedOut)
//! )]
//! async fn pay(order_id: u64) -> Result<(), LockError> {
//!     // Runs under the lock. Send the fencing token with every write, so that the resource
//!     // can refuse a holder that lost its lease (see the guarantees below).
//!     let token = dlock::fencing_token().expect("inside a locked body");
//!     println!("paying order {order_id} under fencing token {token}");
//!     Ok(())
//! } // the lock is released here, before pay returns
//!
//! #[tokio::main]
//! async fn main() -> Result<(), LockError> {
//!     dlock::init_from_env().await?; // the backend named by DLOCK_URL ("default")
//!     pay(42).await
//! }
//! ```
//!
//! Without any `init` the first lock falls back to an in-process backend (with a `warn`
//! event), which excludes nothing across processes; with `DLOCK_URL` set that fallback is off.
//! `memory://` names the in-process backend explicitly, as the runnable examples here do.
//!
//! ## What a lease lock can and cannot promise
//!
//! * While the store keeps its state and no holder pauses past its lease, at most one guard of
//!   a name is valid at a time; release and extend are owner-checked; every call is bounded.
//! * A lease cannot promise exclusion on its own: a holder paused past its lease (GC, SIGSTOP),
//!   a delayed write, a failover or a clock jump can let two holders' writes overlap.
//! * The holder learns it: [`LockGuard::lost`] fires, and an annotated body is cancelled
//!   (`on_lost = "cancel"`) with [`LockError::Lost`].
//! * **Fencing tokens close the gap**: a name's tokens strictly increase in grant order on
//!   every engine; send [`fencing_token`] with each write and have the resource refuse a token
//!   lower than the highest it has seen (`UPDATE .. WHERE fence <= $token`).
//! * Per engine, what its lease can and cannot promise is in the repository's `docs/` pages
//!   (`docs/redis.md`, `docs/redlock.md`, `docs/sentinel.md`, `docs/cluster.md`,
//!   `docs/postgres.md`, `docs/mysql.md`, `docs/zookeeper.md`, `docs/etcd.md`).
//!
//! ## Spawned tasks: carry the lock context with [`in_current_scope`]
//!
//! The lock context (the [`fencing_token`], and re-entry into the held lock) belongs to the
//! body's call chain, which is one task. A `tokio::spawn`ed task does not inherit it:
//! **`dlock::fencing_token()` is `None` there**, and a nested lock there is a new owner. Spawn
//! `dlock::in_current_scope(fut)` to carry it:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock::LockError> {
//! dlock::init("memory://").await?;
//!
//! #[dlock::distributed_lock(key = "report:{day}")]
//! async fn build_report(day: u32) -> Result<(Option<u64>, Option<u64>), dlock::LockError> {
//!     assert!(dlock::fencing_token().is_some()); // in the body: this lock's token
//!     // A plain spawn does not inherit the lock context:
//!     let plain = tokio::spawn(async { dlock::fencing_token() });
//!     // in_current_scope carries it (and re-entry) into the task:
//!     let carried = tokio::spawn(dlock::in_current_scope(async { dlock::fencing_token() }));
//!     Ok((plain.await.expect("task ran"), carried.await.expect("task ran")))
//! }
//!
//! let (plain, carried) = build_report(1).await?;
//! assert_eq!(plain, None);
//! assert!(carried.is_some());
//! # Ok(()) }
//! ```
//!
//! A carried hold stays checked: once the outer guard is released or lost, a nested
//! acquisition in the task fails instead of re-entering.
//!
//! ## The manual API
//!
//! [`Lock`] builds an acquisition; the [`LockGuard`] it returns has the token, the lost-lease
//! signal, `extend`, `scope` and `release`:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock::LockError> {
//! use std::time::Duration;
//!
//! dlock::init("memory://").await?; // e.g. "redis://127.0.0.1:6379" in production
//! let id = 42;
//! let guard = dlock::Lock::new(dlock::key!("order:{id}")) // "order:42", escaped as the attribute does
//!     .ttl(Duration::from_secs(30))
//!     .wait(Duration::from_secs(5))
//!     .acquire()
//!     .await?;
//! let token = guard.fencing_token(); // goes with every write
//! assert!(token > 0);
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! ## Leader election
//!
//! [`Election`] elects one leader per name on any engine: a term is a hold of the lock
//! `election:{name}`, its [`Term::epoch`] the grant's fencing token. [`Election::run`] runs a
//! future while this process leads and drops it the moment the term is lost;
//! `#[dlock::leader(name = "..", ttl = "15s")]` does the same for one function (the repository's
//! `docs/election.md` has the failover bound of each engine).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock::LockError> {
//! dlock::init("memory://").await?;
//!
//! #[dlock::leader(name = "scheduler", ttl = "15s", value = "10.0.0.7:8080")]
//! async fn schedule() -> Result<u64, dlock::LockError> {
//!     Ok(dlock::fencing_token().expect("leading")) // the term's epoch
//! }
//!
//! let first = schedule().await?; // campaigns, leads, resigns when the body returns
//! let term = dlock::Election::new("scheduler").campaign().await?;
//! assert!(term.epoch() > first); // epochs strictly increase across terms
//! term.resign().await?;
//! # Ok(()) }
//! ```
//!
//! ## Cargo features
//!
//! Redis (one server, and Redlock over several) and the in-memory backend are always built in.
//!
//! | feature | adds |
//! |---|---|
//! | `tls` | `rediss://` for Redis and Cluster; with `etcd`, `https://` endpoints; with `zookeeper`, `zks://` URLs |
//! | `sentinel` | `init_sentinel`, `SentinelBackend`: the master found through Redis Sentinel, failovers followed |
//! | `cluster` | `init_cluster`, `ClusterBackend`: Redis Cluster, sharded pub/sub waiting |
//! | `postgres` | `postgres://` URLs: a lock table (or advisory locks), `LISTEN`/`NOTIFY` waiting |
//! | `postgres-tls` | TLS for PostgreSQL (rustls; `sslmode=require`/`verify-*`) |
//! | `mysql` | `mysql://` URLs: a MySQL / MariaDB lock table |
//! | `mysql-tls` | TLS for MySQL / MariaDB (rustls; `require_ssl=true`, `ssl_ca`) |
//! | `zookeeper` | `zk://` URLs: ephemeral sequential znodes, the session as the lease |
//! | `etcd` | `etcd://` URLs: keys under a lease, create-revision order (needs `protoc` to build) |
//! | `axum` | `web`: `IntoResponse for LockError` and the tower `LockLayer` |
//! | `metrics` | counters, histograms and a gauge through the `metrics` facade |
//!
//! Items that need a feature carry an "Available on crate feature" mark on docs.rs.
//!
//! ## Modules
//!
//! * [`admin`]: the operator's view of the locks (list, show, force-release, watch), on which
//!   the `dlock` CLI is built.
//! * [`mod@backend`]: for those who write a backend of their own (the [`Backend`] trait's
//!   types, the local wait queues, the Redis key naming); applications do not need it.
//! * `web` (feature `axum`): the HTTP integration.
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]
#![doc(test(attr(deny(warnings))))]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use dlock_runtime::*;

// The feature-gated items, re-exported by name (the glob above has them too) so that their
// "Available on crate feature" marks show on this crate's own pages.
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use dlock_runtime::web;
#[cfg(feature = "cluster")]
#[cfg_attr(docsrs, doc(cfg(feature = "cluster")))]
pub use dlock_runtime::{ClusterBackend, ClusterBackendBuilder, init_cluster};
#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub use dlock_runtime::{EtcdBackend, EtcdBackendBuilder, etcd_client};
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use dlock_runtime::{MysqlBackend, MysqlBackendBuilder, mysql_async, mysql_schema_sql};
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use dlock_runtime::{
    PostgresBackend, PostgresBackendBuilder, PostgresWaitStats, deadpool_postgres,
    postgres_advisory_key, postgres_functions_sql, postgres_schema_sql, tokio_postgres,
};
#[cfg(feature = "sentinel")]
#[cfg_attr(docsrs, doc(cfg(feature = "sentinel")))]
pub use dlock_runtime::{SentinelBackend, SentinelBuilder, init_sentinel};
#[cfg(feature = "zookeeper")]
#[cfg_attr(docsrs, doc(cfg(feature = "zookeeper")))]
pub use dlock_runtime::{ZookeeperBackend, ZookeeperBackendBuilder};

#[doc(inline)]
pub use dlock_macros::{distributed_lock, key, leader};

/// Not public API: what the `#[distributed_lock]` expansion calls. No semver promise.
#[doc(hidden)]
pub mod __private {
    pub use core;
    pub use dlock_runtime::private::*;
    pub use std::time::Duration;
}
