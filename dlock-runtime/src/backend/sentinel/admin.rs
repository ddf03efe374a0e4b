//! [`Admin`] for a Sentinel-managed master: every sentinel is asked for the master
//! (`SENTINEL MASTER`) and the answer with the highest config-epoch wins, as in the backend,
//! then it is a [`RedisAdmin`] on that master.

use crate::admin::{
    Admin, AdminError, ForceReleased, Listing, LockInfo, LockKind, RedisAdmin, Watching,
};
use crate::backend::BoxFuture;
use crate::backend::redis::redact_url;

/// The operator's view of the master a Sentinel group names.
#[derive(Debug, Clone)]
#[cfg_attr(docsrs, doc(cfg(feature = "sentinel")))]
pub struct SentinelAdmin {
    master_name: String,
    master: RedisAdmin,
}

impl SentinelAdmin {
    /// Asks the sentinels at `sentinel_urls` (all at once; the highest config-epoch wins) for the master `master_name` and connects
    /// to it with `master_auth` (`(user, password)`; the sentinels' URLs carry their own
    /// credentials) and database `db`.
    pub async fn connect<I, S>(
        master_name: &str,
        sentinel_urls: I,
        master_auth: Option<(Option<&str>, &str)>,
        db: i64,
    ) -> Result<SentinelAdmin, AdminError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        // Every sentinel at once, and the answer with the highest config-epoch: a sentinel that
        // missed a failover still names the old master (the backend's own rule).
        let mut errs = Vec::new();
        let mut asks = Vec::new();
        for url in sentinel_urls {
            let url = url.as_ref();
            let shown = redact_url(url);
            match redis::Client::open(url) {
                Ok(c) => asks.push((shown, c)),
                Err(e) => errs.push(format!("sentinel {shown}: {e}")),
            }
        }
        let answers = futures_util::future::join_all(
            asks.iter()
                .map(|(_, c)| super::ask_sentinel(c, master_name)),
        )
        .await;
        let mut best: Option<super::Named> = None;
        for ((shown, _), a) in asks.iter().zip(answers) {
            match a {
                Ok(n) if best.as_ref().is_none_or(|b| n.epoch > b.epoch) => best = Some(n),
                Ok(_) => {}
                Err(e) => errs.push(format!("sentinel {shown}: {e}")),
            }
        }
        let addr = best.map(|n| n.addr);
        let Some((host, port)) = addr else {
            return Err(AdminError::connect(format!(
                "no sentinel named the master {master_name:?}: {}",
                if errs.is_empty() {
                    "no sentinel URL given".to_string()
                } else {
                    errs.join("; ")
                }
            )));
        };
        let auth = match master_auth {
            Some((Some(u), p)) => format!("{u}:{p}@"),
            Some((None, p)) => format!(":{p}@"),
            None => String::new(),
        };
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        let master = RedisAdmin::connect(&format!("redis://{auth}{host}:{port}/{db}")).await?;
        Ok(SentinelAdmin {
            master_name: master_name.to_string(),
            master,
        })
    }
}

impl Admin for SentinelAdmin {
    fn engine(&self) -> &'static str {
        "redis-sentinel"
    }

    fn target(&self) -> String {
        format!(
            "master {:?} at {} (named by the sentinels)",
            self.master_name,
            self.master.target()
        )
    }

    fn list<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Listing, AdminError>> {
        self.master.list(prefix)
    }

    fn show<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<LockInfo>, AdminError>> {
        self.master.show(name)
    }

    fn force_release<'a>(
        &'a self,
        name: &'a str,
        expected: Option<&'a LockInfo>,
    ) -> BoxFuture<'a, Result<ForceReleased, AdminError>> {
        self.master.force_release(name, expected)
    }

    fn watch<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Watching, AdminError>> {
        self.master.watch(prefix)
    }

    fn kinds(&self) -> &'static [LockKind] {
        self.master.kinds()
    }

    fn show_kind<'a>(
        &'a self,
        name: &'a str,
        kind: LockKind,
    ) -> BoxFuture<'a, Result<Option<LockInfo>, AdminError>> {
        self.master.show_kind(name, kind)
    }

    fn evict<'a>(
        &'a self,
        name: &'a str,
        kind: LockKind,
        owner: &'a str,
        expected: Option<&'a LockInfo>,
    ) -> BoxFuture<'a, Result<ForceReleased, AdminError>> {
        self.master.evict(name, kind, owner, expected)
    }
}
