//! [`Admin`] for a Redis Cluster: the masters are read from `CLUSTER SLOTS` on a seed, one
//! [`RedisAdmin`] per master (sharded release channels). `list` scans every master; `show` and
//! `unlock` go to the master that owns the lock's slot (looked up with `CLUSTER KEYSLOT` and the
//! slot map of this call). `watch` uses keyspace notifications when every master sends them
//! (the release channels are sharded and cannot be subscribed by pattern), else lists every
//! 500 ms.

use std::time::Duration;

use crate::admin::{
    Admin, AdminError, ForceReleased, Listing, LockInfo, LockKind, RedisAdmin, Watching, bounded,
    poll_watch,
};
use crate::backend::BoxFuture;
use crate::backend::redis::redact_url;
use crate::key::redis_keys;

/// How often `watch` lists the locks when keyspace notifications are off.
const POLL_EVERY: Duration = Duration::from_millis(500);

/// The operator's view of a Redis Cluster.
#[derive(Debug, Clone)]
#[cfg_attr(docsrs, doc(cfg(feature = "cluster")))]
pub struct ClusterAdmin {
    seeds: String,
    /// (first slot, last slot, index into `masters`).
    slots: Vec<(u16, u16, usize)>,
    masters: Vec<(String, RedisAdmin)>,
}

/// `url` with its `host:port` replaced (scheme, credentials, db and parameters kept).
fn with_addr(url: &str, host: &str, port: u16) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("redis", url));
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let userinfo = authority.rfind('@').map(|i| &authority[..=i]).unwrap_or("");
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    format!("{scheme}://{userinfo}{host}:{port}{tail}")
}

type SlotsReply = Vec<(u16, u16, (String, u16))>;

/// Reads the slot ranges and their masters from `CLUSTER SLOTS` (replica entries ignored).
async fn read_slots(seed: &RedisAdmin) -> Result<SlotsReply, AdminError> {
    let mut conn = seed.conn();
    let raw: Vec<redis::Value> = bounded("CLUSTER SLOTS", async {
        redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut conn)
            .await
            .map_err(|e| AdminError::server(format!("CLUSTER SLOTS: {e}")))
    })
    .await?;
    let mut out = Vec::new();
    for entry in raw {
        let redis::Value::Array(parts) = entry else {
            continue;
        };
        let (Some(a), Some(b), Some(master)) = (parts.first(), parts.get(1), parts.get(2)) else {
            continue;
        };
        let (Ok(a), Ok(b)) = (
            redis::from_redis_value_ref::<u16>(a),
            redis::from_redis_value_ref::<u16>(b),
        ) else {
            continue;
        };
        let redis::Value::Array(m) = master else {
            continue;
        };
        let (Some(h), Some(p)) = (m.first(), m.get(1)) else {
            continue;
        };
        let (Ok(h), Ok(p)) = (
            redis::from_redis_value_ref::<String>(h),
            redis::from_redis_value_ref::<u16>(p),
        ) else {
            continue;
        };
        out.push((a, b, (h, p)));
    }
    if out.is_empty() {
        return Err(AdminError::server(
            "CLUSTER SLOTS returned no slot ranges (is this a cluster node, and is the cluster up?)",
        ));
    }
    Ok(out)
}

impl ClusterAdmin {
    /// Connects through the first reachable seed (`redis://` URLs as for
    /// [`crate::ClusterBackend::connect`]) and then to every master it names, with the seed's
    /// scheme and credentials.
    pub async fn connect<I, S>(seeds: I) -> Result<ClusterAdmin, AdminError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let seeds: Vec<String> = seeds.into_iter().map(|s| s.as_ref().to_string()).collect();
        let shown: Vec<String> = seeds.iter().map(|s| redact_url(s)).collect();
        let mut last_err = AdminError::unsupported("no seed URL given");
        for seed in &seeds {
            let admin = match RedisAdmin::connect(seed).await {
                Ok(a) => a,
                Err(e) => {
                    last_err = e;
                    continue;
                }
            };
            let ranges = match read_slots(&admin).await {
                Ok(r) => r,
                Err(e) => {
                    last_err = e;
                    continue;
                }
            };
            let mut masters: Vec<(String, RedisAdmin)> = Vec::new();
            let mut slots = Vec::new();
            for (a, b, (host, port)) in ranges {
                let addr = format!("{host}:{port}");
                let idx = match masters.iter().position(|(m, _)| *m == addr) {
                    Some(i) => i,
                    None => {
                        let url = with_addr(seed, &host, port);
                        let m = RedisAdmin::connect(&url).await?.sharded();
                        masters.push((addr, m));
                        masters.len() - 1
                    }
                };
                slots.push((a, b, idx));
            }
            return Ok(ClusterAdmin {
                seeds: shown.join(","),
                slots,
                masters,
            });
        }
        Err(last_err)
    }

    /// The master owning `name`'s slot now.
    async fn owner(&self, name: &str) -> Result<&RedisAdmin, AdminError> {
        self.master_of_key(name, &redis_keys(name).lock).await
    }

    /// Fills the holders' identities from their processes' identity keys, each read on the
    /// master of its own slot (best effort, as `RedisAdmin::fill_identities`).
    async fn fill_identities(&self, mut info: LockInfo) -> LockInfo {
        let name = info.name.clone();
        let waiting = info.rw.as_mut().and_then(|rw| rw.waiting_writer.as_mut());
        for h in info.holders.iter_mut().chain(waiting) {
            let key = crate::key::holder_key(crate::holder::process_of(&h.owner));
            if let Ok(m) = self.master_of_key(&name, &key).await {
                m.fill_identities(std::slice::from_mut(h)).await;
            }
        }
        info
    }

    /// The master owning `key`'s slot now (`name`: the lock it is read for, for errors).
    async fn master_of_key(&self, name: &str, key: &str) -> Result<&RedisAdmin, AdminError> {
        let mut conn = self.masters[0].1.conn();
        let slot: u16 = bounded("CLUSTER KEYSLOT", async {
            redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(key)
                .query_async(&mut conn)
                .await
                .map_err(|e| AdminError::server(format!("CLUSTER KEYSLOT: {e}")))
        })
        .await?;
        self.slots
            .iter()
            .find(|(a, b, _)| (*a..=*b).contains(&slot))
            .map(|(_, _, i)| &self.masters[*i].1)
            .ok_or_else(|| {
                AdminError::server(format!(
                    "slot {slot} of lock `{name}` has no master (cluster not fully covered)"
                ))
            })
    }
}

impl Admin for ClusterAdmin {
    fn engine(&self) -> &'static str {
        "redis-cluster"
    }

    fn target(&self) -> String {
        let masters: Vec<&str> = self.masters.iter().map(|(a, _)| a.as_str()).collect();
        format!(
            "redis cluster (seeds {}; masters {})",
            self.seeds,
            masters.join(", ")
        )
    }

    fn list<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Listing, AdminError>> {
        Box::pin(async move {
            let mut locks = Vec::new();
            let mut skipped = 0;
            for (_, m) in &self.masters {
                for kind in LockKind::ALL {
                    let (names, k) = m.scan_kind(prefix, kind).await?;
                    skipped += k;
                    for n in names {
                        if let Some(i) = m.read_kind(&n, kind).await? {
                            locks.push(self.fill_identities(i).await);
                        }
                    }
                }
            }
            Ok(Listing::new(locks, skipped))
        })
    }

    fn show<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<LockInfo>, AdminError>> {
        Box::pin(async move {
            match self.owner(name).await?.read(name).await? {
                Some(i) => Ok(Some(self.fill_identities(i).await)),
                None => Ok(None),
            }
        })
    }

    fn force_release<'a>(
        &'a self,
        name: &'a str,
        expected: Option<&'a LockInfo>,
    ) -> BoxFuture<'a, Result<ForceReleased, AdminError>> {
        Box::pin(async move {
            match self.owner(name).await?.force(name, expected).await? {
                ForceReleased::Released { was, woke } => Ok(ForceReleased::Released {
                    was: Box::new(self.fill_identities(*was).await),
                    woke,
                }),
                other => Ok(other),
            }
        })
    }

    fn kinds(&self) -> &'static [LockKind] {
        &LockKind::ALL
    }

    fn show_kind<'a>(
        &'a self,
        name: &'a str,
        kind: LockKind,
    ) -> BoxFuture<'a, Result<Option<LockInfo>, AdminError>> {
        Box::pin(async move {
            // A semaphore's and a read-write lock's keys carry the lock's hash tag: one slot.
            match self.owner(name).await?.read_kind(name, kind).await? {
                Some(i) => Ok(Some(self.fill_identities(i).await)),
                None => Ok(None),
            }
        })
    }

    fn evict<'a>(
        &'a self,
        name: &'a str,
        kind: LockKind,
        owner: &'a str,
        expected: Option<&'a LockInfo>,
    ) -> BoxFuture<'a, Result<ForceReleased, AdminError>> {
        Box::pin(async move {
            match self
                .owner(name)
                .await?
                .evict_holder(name, kind, owner, expected)
                .await?
            {
                ForceReleased::Released { was, woke } => Ok(ForceReleased::Released {
                    was: Box::new(self.fill_identities(*was).await),
                    woke,
                }),
                other => Ok(other),
            }
        })
    }

    fn watch<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Watching, AdminError>> {
        Box::pin(async move {
            let mut streams = Vec::new();
            for (_, m) in &self.masters {
                let w = m.start_watch(prefix).await?;
                if !w.sees_acquisitions {
                    // No keyspace notifications on this master: fall back to listing.
                    return poll_watch(self.clone(), prefix, POLL_EVERY).await;
                }
                streams.push(w.events);
            }
            let (tx, rx) = tokio::sync::mpsc::channel(1024);
            for mut s in streams {
                let tx = tx.clone();
                tokio::spawn(async move {
                    loop {
                        let ev = tokio::select! {
                            e = s.recv() => e,
                            _ = tx.closed() => return,
                        };
                        let Some(ev) = ev else { return };
                        if tx.send(ev).await.is_err() {
                            return;
                        }
                    }
                });
            }
            Ok(Watching {
                events: rx,
                sees: "acquisitions, releases and expiries (keyspace notifications of every \
                       master)"
                    .into(),
                sees_acquisitions: true,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::with_addr;

    #[test]
    fn master_urls_keep_scheme_credentials_and_db() {
        assert_eq!(
            with_addr("rediss://u:p@seed:7000/0?x=1", "10.0.0.2", 7001),
            "rediss://u:p@10.0.0.2:7001/0?x=1"
        );
        assert_eq!(
            with_addr("redis://127.0.0.1:7000", "127.0.0.1", 7002),
            "redis://127.0.0.1:7002"
        );
        assert_eq!(with_addr("redis://h:1", "::1", 7), "redis://[::1]:7");
    }
}
