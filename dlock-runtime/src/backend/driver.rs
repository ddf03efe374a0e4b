//! A backend's own single-threaded tokio runtime on a thread of its own (etcd, ZooKeeper).
//!
//! The etcd client (a tonic channel) and the ZooKeeper client (its session task) run their I/O as
//! tasks of the runtime that created them and die with it; a lease keep-alive, a session-state
//! watcher or a predecessor watch spawned on a caller's runtime would die with it too. A backend
//! is shared (the registry hands out one `Arc<dyn Backend>` to every runtime of the process,
//! `#[tokio::test]`s make one runtime per test), so the client and every task the backend spawns
//! live on this driver instead, and a caller's runtime shutting down takes none of them along.
//! Requests themselves are still awaited by the caller. The thread ends when the backend (its
//! `Driver`) is dropped.

use std::sync::Mutex;

use crate::LockError;

pub(crate) struct Driver {
    pub(crate) handle: tokio::runtime::Handle,
    stop: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver").finish_non_exhaustive()
    }
}

impl Driver {
    /// Starts the thread (named `name`) and its runtime.
    pub(crate) fn start(name: &str) -> Result<Driver, LockError> {
        let be = |e: std::io::Error| LockError::Backend {
            key: String::new(),
            source: e.into(),
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(be)?;
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                // Runs the spawned tasks until the backend is dropped; the runtime is dropped
                // on this thread, outside any async context.
                let _ = rt.block_on(stopped);
            })
            .map_err(be)?;
        Ok(Driver {
            handle,
            stop: Mutex::new(Some(stop)),
        })
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = stop.send(());
        }
    }
}
