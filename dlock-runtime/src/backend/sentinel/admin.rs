//! [`Admin`] for a Sentinel-managed master: the sentinels are asked for the master's address
//! (`SENTINEL get-master-addr-by-name`), then it is a [`RedisAdmin`] on that master.

use std::time::Duration;

use crate::admin::{Admin, AdminError, ForceReleased, Listing, LockInfo, RedisAdmin, Watching};
use crate::backend::BoxFuture;
use crate::backend::redis::redact_url;

/// The operator's view of the master a Sentinel group names.
#[derive(Debug, Clone)]
pub struct SentinelAdmin {
    master_name: String,
    master: RedisAdmin,
}

impl SentinelAdmin {
    /// Asks the sentinels at `sentinel_urls` (in order) for the master `master_name` and connects
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
        let mut errs = Vec::new();
        let mut addr = None;
        for url in sentinel_urls {
            let url = url.as_ref();
            let shown = redact_url(url);
            let r = tokio::time::timeout(Duration::from_secs(2), async {
                let client = redis::Client::open(url)?;
                let mut con = client.get_multiplexed_async_connection().await?;
                redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(master_name)
                    .query_async::<Option<(String, u16)>>(&mut con)
                    .await
            })
            .await;
            match r {
                Ok(Ok(Some(a))) => {
                    addr = Some(a);
                    break;
                }
                Ok(Ok(None)) => errs.push(format!(
                    "sentinel {shown} does not know a master named {master_name:?}"
                )),
                Ok(Err(e)) => errs.push(format!("sentinel {shown}: {e}")),
                Err(_) => errs.push(format!("sentinel {shown}: no answer within 2 s")),
            }
        }
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
}
