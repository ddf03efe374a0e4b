//! [`Admin`] over the N independent masters of a Redlock set: one [`RedisAdmin`] per node,
//! combined. A lock is shown when any node holds it; its holder is the owner holding the most
//! nodes, its token the largest of that owner's node tokens (at least the holder's own token:
//! the guard keeps the largest of the grants it counted), its lease the shortest of that owner's
//! node leases. `details` gives every node's state. Force-release deletes the holder's key on
//! every node that still has it (each node checked by owner), which publishes a wake-up there.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use crate::admin::{
    Admin, AdminError, ForceReleased, Holder, Listing, LockEvent, LockInfo, RedisAdmin, Watching,
    bounded, still_held,
};
use crate::backend::BoxFuture;
use futures_util::future::join_all;

/// The operator's view of a Redlock set.
#[derive(Debug)]
pub struct RedlockAdmin {
    /// Every node: its printable address and its admin, or why it could not be reached.
    nodes: Vec<(String, Result<RedisAdmin, AdminError>)>,
}

fn fmt_left(d: Option<Duration>) -> String {
    match d {
        Some(d) => format!("{:.1} s left", d.as_secs_f64()),
        None => "no expiry".into(),
    }
}

impl RedlockAdmin {
    /// Connects to every node (`redis://` URLs as for [`crate::RedlockBackend::connect`]). A node
    /// that cannot be reached is reported in each answer; fewer reachable nodes than a majority
    /// is an error, since nothing said about the locks would then be reliable.
    pub async fn connect<I, S>(urls: I) -> Result<RedlockAdmin, AdminError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let urls: Vec<String> = urls.into_iter().map(|u| u.as_ref().to_string()).collect();
        if urls.len() < 2 {
            return Err(AdminError::unsupported(
                "a Redlock set needs at least two node URLs (give --url once per node)",
            ));
        }
        let conns = urls.iter().map(|u| async move {
            (
                crate::backend::redis::redact_url(u),
                RedisAdmin::connect(u).await,
            )
        });
        let nodes: Vec<_> = join_all(conns).await;
        let up = nodes.iter().filter(|(_, n)| n.is_ok()).count();
        if up <= urls.len() / 2 {
            let down: Vec<String> = nodes
                .iter()
                .filter_map(|(_, n)| n.as_ref().err().map(|e| e.message.clone()))
                .collect();
            return Err(AdminError::connect(format!(
                "only {up} of {} Redlock nodes reachable (a majority is needed): {}",
                urls.len(),
                down.join("; ")
            )));
        }
        Ok(RedlockAdmin { nodes })
    }

    fn up(&self) -> impl Iterator<Item = (&str, &RedisAdmin)> {
        self.nodes
            .iter()
            .filter_map(|(a, n)| n.as_ref().ok().map(|n| (a.as_str(), n)))
    }

    /// Every node's view of `name` (`Err` for an unreachable node).
    async fn per_node(&self, name: &str) -> Vec<(String, Result<Option<LockInfo>, AdminError>)> {
        let reads = self.nodes.iter().map(|(addr, n)| async move {
            match n {
                Ok(n) => (addr.clone(), n.read(name).await),
                Err(e) => (addr.clone(), Err(e.clone())),
            }
        });
        join_all(reads).await
    }

    async fn read(&self, name: &str) -> Result<Option<LockInfo>, AdminError> {
        let views = self.per_node(name).await;
        Ok(combine(name, &views))
    }
}

/// One owner across the nodes: (nodes held, most holds, largest token, shortest lease).
type OwnerView = (usize, u32, Option<u64>, Option<Duration>);

/// One lock from every node's view; `None` when no node holds it.
fn combine(
    name: &str,
    views: &[(String, Result<Option<LockInfo>, AdminError>)],
) -> Option<LockInfo> {
    let mut owners: BTreeMap<&str, OwnerView> = BTreeMap::new();
    let mut waiters: Option<u64> = None;
    let mut details = Vec::new();
    for (addr, v) in views {
        let text = match v {
            Err(e) => format!("unreachable ({})", e.message),
            Ok(None) => "free".into(),
            Ok(Some(i)) => {
                waiters = Some(waiters.unwrap_or(0).max(i.waiters.unwrap_or(0)));
                for h in &i.holders {
                    let e = owners.entry(h.owner.as_str()).or_insert((0, 0, None, None));
                    e.0 += 1;
                    e.1 = e.1.max(h.holds);
                    e.2 = e.2.max(i.token);
                    e.3 = match (e.3, i.remaining) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                }
                let who: Vec<String> = i
                    .holders
                    .iter()
                    .map(|h| format!("{} ({} holds)", h.owner, h.holds))
                    .collect();
                format!(
                    "{}, token {}, {}",
                    who.join(", "),
                    i.token.map_or("-".into(), |t| t.to_string()),
                    fmt_left(i.remaining)
                )
            }
        };
        details.push((format!("node {addr}"), text));
    }
    let (&top, &(nodes_held, _, token, remaining)) = owners
        .iter()
        .max_by_key(|(o, v)| (v.0, std::cmp::Reverse(**o)))?;
    let mut info = LockInfo::new(name);
    info.holders = owners
        .iter()
        .map(|(o, v)| {
            // The identity any node stores for the owner's process (they all store the same).
            let mut h = Holder::new(*o, v.1);
            h.identity = views
                .iter()
                .filter_map(|(_, v)| v.as_ref().ok()?.as_ref())
                .flat_map(|i| &i.holders)
                .find(|n| n.owner == *o && n.identity.is_some())
                .and_then(|n| n.identity.clone());
            h
        })
        .collect();
    // The majority holder first.
    info.holders.sort_by_key(|h| h.owner != top);
    info.token = token;
    info.remaining = remaining;
    info.waiters = waiters;
    info.waiters_are = "processes subscribed to the release channel (most on one node)";
    details.insert(
        0,
        (
            "quorum".into(),
            format!(
                "{top} holds {nodes_held} of {} nodes (a majority is {})",
                views.len(),
                views.len() / 2 + 1
            ),
        ),
    );
    info.details = details;
    Some(info)
}

impl Admin for RedlockAdmin {
    fn engine(&self) -> &'static str {
        "redlock"
    }

    fn target(&self) -> String {
        let addrs: Vec<&str> = self.nodes.iter().map(|(a, _)| a.as_str()).collect();
        format!("redlock[{}]", addrs.join(", "))
    }

    fn list<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Listing, AdminError>> {
        Box::pin(async move {
            let scans = join_all(self.up().map(|(_, n)| n.scan(prefix))).await;
            let mut names = Vec::new();
            let mut skipped = 0;
            for s in scans {
                let (n, k) = s?;
                names.extend(n);
                skipped = skipped.max(k);
            }
            names.sort();
            names.dedup();
            let mut locks = Vec::new();
            for n in &names {
                if let Some(i) = self.read(n).await? {
                    locks.push(i);
                }
            }
            Ok(Listing::new(locks, skipped))
        })
    }

    fn show<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<LockInfo>, AdminError>> {
        Box::pin(self.read(name))
    }

    fn force_release<'a>(
        &'a self,
        name: &'a str,
        expected: Option<&'a LockInfo>,
    ) -> BoxFuture<'a, Result<ForceReleased, AdminError>> {
        Box::pin(async move {
            let views = self.per_node(name).await;
            let now = match still_held(combine(name, &views), expected) {
                Ok(now) => now,
                Err(done) => return Ok(done),
            };
            // Delete the majority holder's key on every node that still has that holder (by
            // owner: each node minted its own token).
            let mut only_owner = LockInfo::new(name);
            only_owner.holders = vec![now.holders[0].clone()];
            let forces = self.up().map(|(addr, n)| {
                let only_owner = &only_owner;
                async move { (addr, n.force(name, Some(only_owner)).await) }
            });
            let mut deleted = 0;
            let mut woke: Option<u64> = None;
            let mut errors = Vec::new();
            for (addr, r) in join_all(forces).await {
                match r {
                    Ok(ForceReleased::Released { woke: w, .. }) => {
                        deleted += 1;
                        woke = Some(woke.unwrap_or(0).max(w.unwrap_or(0)));
                    }
                    Ok(_) => {}
                    Err(e) => errors.push(format!("node {addr}: {}", e.message)),
                }
            }
            if deleted == 0 {
                if let Some(e) = errors.first() {
                    return Err(AdminError::server(e.clone()));
                }
                return Ok(ForceReleased::Changed);
            }
            if !errors.is_empty() {
                tracing::warn!(
                    lock = name,
                    "dlock admin: force-release missed nodes: {}",
                    errors.join("; ")
                );
            }
            Ok(ForceReleased::Released {
                was: Box::new(now),
                woke,
            })
        })
    }

    fn watch<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Watching, AdminError>> {
        Box::pin(async move {
            let mut streams = Vec::new();
            let mut sees_acq = true;
            let mut sees = String::new();
            for (_, n) in self.up() {
                let w = bounded("watching a Redlock node", n.start_watch(prefix)).await?;
                sees_acq &= w.sees_acquisitions;
                sees = w.sees;
                streams.push(w.events);
            }
            let (tx, rx) = tokio::sync::mpsc::channel(1024);
            let merge = MergeState::default();
            let merge = std::sync::Arc::new(std::sync::Mutex::new(merge));
            let needed = streams.len();
            for mut s in streams {
                let tx = tx.clone();
                let merge = merge.clone();
                tokio::spawn(async move {
                    loop {
                        let ev = tokio::select! {
                            e = s.recv() => e,
                            _ = tx.closed() => return,
                        };
                        let Some(mut ev) = ev else { return };
                        // A node's token is not the set's token: leave it out.
                        if let Ok(LockEvent::Acquired { token, .. }) = &mut ev {
                            *token = None;
                        }
                        let forward = match &ev {
                            Ok(e) => merge
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .first_of(e, needed),
                            Err(_) => true,
                        };
                        if forward && tx.send(ev).await.is_err() {
                            return;
                        }
                    }
                });
            }
            Ok(Watching {
                events: rx,
                sees: format!("{sees}; one event per change across the nodes"),
                sees_acquisitions: sees_acq,
            })
        })
    }
}

/// Merges the nodes' event streams into one event per change: an event is forwarded when it is
/// the first of its kind for its name since that name's last different event.
#[derive(Debug, Default)]
struct MergeState {
    last: HashMap<String, (u8, usize, tokio::time::Instant)>,
}

impl MergeState {
    fn first_of(&mut self, e: &LockEvent, nodes: usize) -> bool {
        let kind = match e {
            LockEvent::Acquired { .. } => 0,
            LockEvent::Released { .. } => 1,
            LockEvent::Expired { .. } => 2,
            _ => 3,
        };
        let now = tokio::time::Instant::now();
        let entry = self
            .last
            .entry(e.name().to_string())
            .or_insert((u8::MAX, 0, now));
        // The same event from the other nodes arrives within moments; after all nodes reported
        // it, or a second later, the next one of the kind is a new change.
        if entry.0 == kind && entry.1 < nodes && now - entry.2 < Duration::from_secs(1) {
            entry.1 += 1;
            return false;
        }
        *entry = (kind, 1, now);
        if self.last.len() > 10_000 {
            self.last.clear();
        }
        true
    }
}
