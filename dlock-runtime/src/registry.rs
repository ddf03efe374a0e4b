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

/// Connects to Redis and registers it under `name` (replacing what was there).
pub async fn init_named(name: &str, url: &str) -> Result<(), LockError> {
    let backend = RedisBackend::connect(url).await?;
    tracing::info!(backend = name, url = %backend.url(), "dlock: Redis backend registered");
    register(name, backend);
    Ok(())
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
/// backend is installed there on first use (one `info` event says so).
pub fn backend(name: &str) -> Result<Arc<dyn Backend>, LockError> {
    if let Some(b) = REGISTRY.read().unwrap_or_else(|e| e.into_inner()).get(name) {
        return Ok(b.clone());
    }
    let mut map = REGISTRY.write().unwrap_or_else(|e| e.into_inner());
    if let Some(b) = map.get(name) {
        return Ok(b.clone());
    }
    if name == DEFAULT_BACKEND {
        tracing::info!(
            "dlock: no backend configured; using the in-memory backend as \"default\" (locks are local to this process)"
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
