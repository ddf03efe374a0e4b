//! Named backends in a process-global registry.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, RwLock};

use crate::backend::memory::MemoryBackend;
use crate::backend::redis::RedisBackend;
use crate::{Backend, LockError};

/// The name used when none is given.
pub const DEFAULT_BACKEND: &str = "default";

static REGISTRY: LazyLock<RwLock<HashMap<String, Arc<dyn Backend>>>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));

/// Connects to Redis and registers it as the backend `"default"`.
///
/// The URL is `redis://[user[:password]@]host[:port][/db]` (or `rediss://` with the `tls`
/// feature). The connection is checked here, so a wrong address or password fails now.
pub async fn init(url: &str) -> Result<(), LockError> {
    init_named(DEFAULT_BACKEND, url).await
}

/// The environment variable that names the store for the library, the examples and the CLI.
pub const URL_ENV: &str = "DLOCK_URL";

/// Connects to the store that `DLOCK_URL` names (any URL [`init_named`] accepts, or
/// `memory://` for the in-process backend) and registers it as `"default"`. A `Config` error when
/// the variable is unset or empty, so a service that must share its locks never runs on
/// process-local ones by mistake.
///
/// While `DLOCK_URL` is set, the in-process fallback is off: a lock taken on `"default"` before
/// this (or [`init`]) ran is a `Config` error, not a lock local to this process.
pub async fn init_from_env() -> Result<(), LockError> {
    match url_from_env() {
        Some(url) => init(&url).await,
        None => Err(LockError::Config(format!(
            "{URL_ENV} is not set: set it to the lock store's URL (redis://, postgres://, zk://, \
             etcd://, ... or memory:// for locks local to this process)"
        ))),
    }
}

/// `DLOCK_URL`, trimmed, when it is set and not empty.
fn url_from_env() -> Option<String> {
    std::env::var(URL_ENV)
        .ok()
        .map(|u| u.trim().to_string())
        .filter(|u| !u.is_empty())
}

/// Connects to Redis and registers it under `name` (replacing what was there); with the
/// `zookeeper` feature, a `zk://host:port[,host:port...][/chroot]` URL connects to ZooKeeper
/// (`zks://` over TLS, with the `tls` feature too: see `ZookeeperBackend::connect`);
/// with the `etcd` feature, an `etcd://host:port[,host:port...]` URL connects to etcd.
pub async fn init_named(name: &str, url: &str) -> Result<(), LockError> {
    // Database engines by URL scheme (backend/sql/); everything else is Redis.
    let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    match scheme.as_deref() {
        #[cfg(feature = "postgres")]
        Some("postgres" | "postgresql") => {
            let b = crate::backend::sql::postgres::PostgresBackend::connect(url).await?;
            tracing::info!(backend = name, url = %b.url(), "dlock: PostgreSQL backend registered");
            register(name, b);
            return Ok(());
        }
        #[cfg(feature = "mysql")]
        Some("mysql") => {
            let b = crate::backend::sql::mysql::MysqlBackend::connect(url).await?;
            tracing::info!(backend = name, url = %b.url(), "dlock: MySQL backend registered");
            register(name, b);
            return Ok(());
        }
        #[allow(unreachable_patterns)]
        Some(s @ ("postgres" | "postgresql" | "mysql")) => {
            return Err(LockError::Config(format!(
                "`{s}://` URLs need dlock's `{}` feature",
                if s == "mysql" { "mysql" } else { "postgres" }
            )));
        }
        Some("memory") => {
            tracing::info!(
                backend = name,
                "dlock: in-memory backend registered (locks are local to this process)"
            );
            register(name, MemoryBackend::new());
            return Ok(());
        }
        _ => {}
    }
    if let Some(e) = missing_feature(scheme.as_deref()) {
        return Err(LockError::Config(e));
    }
    #[cfg(feature = "zookeeper")]
    if url.starts_with("zk://") || url.starts_with("zks://") {
        register(name, crate::ZookeeperBackend::connect(url).await?);
        return Ok(());
    }
    #[cfg(feature = "etcd")]
    if url.starts_with("etcd://") {
        register(name, crate::EtcdBackend::connect(url).await?);
        return Ok(());
    }
    let backend = RedisBackend::connect(url).await?;
    tracing::info!(backend = name, url = %backend.url(), "dlock: Redis backend registered");
    register(name, backend);
    Ok(())
}

/// The error for a URL scheme whose engine (or TLS) this build left out, naming the cargo
/// feature that turns it on; `None` when this build serves the scheme.
fn missing_feature(scheme: Option<&str>) -> Option<String> {
    let scheme = scheme?;
    let feature = match scheme {
        "zk" if !cfg!(feature = "zookeeper") => "zookeeper",
        "zks" if !cfg!(feature = "zookeeper") => "zookeeper` and `tls",
        "zks" | "rediss" if !cfg!(feature = "tls") => "tls",
        "etcd" if !cfg!(feature = "etcd") => "etcd",
        _ => return None,
    };
    Some(format!(
        "`{scheme}://` URLs need dlock's `{feature}` feature (this build was made without it): \
         add it to dlock's features in Cargo.toml"
    ))
}

/// Registers a backend built by hand under `name` (replacing what was there).
pub fn register(name: &str, backend: impl Backend) {
    register_arc(name, Arc::new(backend));
}

/// Registers a shared backend under `name` (replacing what was there).
pub fn register_arc(name: &str, backend: Arc<dyn Backend>) {
    REGISTRY
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(name.to_string(), backend);
}

/// The backend registered under `name`. With nothing registered as `"default"`, the in-memory
/// backend is installed there on first use (one `warn` event says so), unless `DLOCK_URL` is
/// set: then the first use is a `Config` error that says to call [`init_from_env`].
pub fn backend(name: &str) -> Result<Arc<dyn Backend>, LockError> {
    if let Some(b) = REGISTRY.read().unwrap_or_else(|e| e.into_inner()).get(name) {
        return Ok(b.clone());
    }
    let mut map = REGISTRY.write().unwrap_or_else(|e| e.into_inner());
    if let Some(b) = map.get(name) {
        return Ok(b.clone());
    }
    if name == DEFAULT_BACKEND {
        if url_from_env().is_some() {
            // The deployment names a shared store: locks local to this process would exclude
            // nothing across replicas. Refuse instead of falling back.
            return Err(LockError::Config(format!(
                "{URL_ENV} is set but no backend was initialised before this lock: call \
                 `dlock::init_from_env().await` (or `dlock::init`) at start-up, before the first lock"
            )));
        }
        tracing::warn!(
            "dlock: no backend configured; using the in-memory backend as \"default\": locks are \
             local to this process and exclude nothing across replicas (call dlock::init or \
             dlock::init_from_env with {URL_ENV} set at start-up)"
        );
        let b: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
        map.insert(name.to_string(), b.clone());
        return Ok(b);
    }
    let mut known: Vec<String> = map.keys().cloned().collect();
    known.sort();
    Err(LockError::UnknownBackend {
        name: name.to_string(),
        known,
    })
}

#[cfg(feature = "cluster")]
#[cfg_attr(docsrs, doc(cfg(feature = "cluster")))]
/// Connects to a Redis Cluster through its seed nodes and registers it under `name`
/// (replacing what was there). `urls` is any iterable of URL strings:
/// `&["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]` or a `Vec<String>`. Knobs (timeouts,
/// ACL user, TLS root) are on [`crate::ClusterBackend::builder`]; register the result with
/// [`crate::register`].
pub async fn init_cluster<I, S>(name: &str, urls: I) -> Result<(), LockError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let backend = crate::backend::cluster::ClusterBackend::connect(urls).await?;
    tracing::info!(backend = name, seeds = %backend.seeds(), "dlock: Redis Cluster backend registered");
    register(name, backend);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::missing_feature;

    #[test]
    fn a_url_whose_engine_is_not_built_names_the_feature() {
        assert_eq!(missing_feature(Some("redis")), None);
        assert_eq!(missing_feature(None), None);
        let zk = missing_feature(Some("zk"));
        assert_eq!(zk.is_some(), !cfg!(feature = "zookeeper"), "{zk:?}");
        if let Some(m) = zk {
            assert!(m.contains("`zookeeper` feature"), "{m}");
        }
        let tls = missing_feature(Some("rediss"));
        assert_eq!(tls.is_some(), !cfg!(feature = "tls"), "{tls:?}");
        if let Some(m) = tls {
            assert!(m.contains("`tls` feature"), "{m}");
        }
        let etcd = missing_feature(Some("etcd"));
        assert_eq!(etcd.is_some(), !cfg!(feature = "etcd"), "{etcd:?}");
    }
}
