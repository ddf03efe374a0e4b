//! [`Admin`] for ZooKeeper: reads the lock parents under the root (`/dlock`) and their
//! contender nodes (`_c_<guid>-lock-<sequence>`, data = owner id and, after a newline, the holder identity; the lowest sequence holds),
//! force-releases by deleting the holder's node (its successor's predecessor watch fires), and
//! watches with one persistent recursive watch on the root (ZooKeeper >= 3.6).
//!
//! The admin's own session runs on the caller's runtime; every request is bounded by
//! [`CALL_TIMEOUT`](crate::admin::CALL_TIMEOUT).

use std::collections::BTreeMap;
use std::time::Duration;

use zookeeper_client as zk;

use super::{DEFAULT_ROOT, escape, last_token, open_client, parse_url, prepare, seq_of};
use crate::admin::{
    Admin, AdminError, CALL_TIMEOUT, ForceReleased, Holder, Listing, LockEvent, LockInfo, Watching,
    bounded, still_held, without_secret,
};
use crate::backend::BoxFuture;

/// The operator's view of a ZooKeeper ensemble's dlock nodes.
#[derive(Clone)]
#[cfg_attr(docsrs, doc(cfg(feature = "zookeeper")))]
pub struct ZookeeperAdmin {
    client: zk::Client,
    /// `zk[s]://[user@]hosts[/chroot]`: never the password.
    shown: String,
    root: String,
    /// Only to scrub messages; never shown.
    secret: Option<String>,
}

impl std::fmt::Debug for ZookeeperAdmin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZookeeperAdmin")
            .field("target", &self.shown)
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

/// Connection-level failures are [`AdminError::connect`]; `Unimplemented` (an old server) is
/// [`AdminError::unsupported`]; the rest are server answers.
fn map(what: &str, e: zk::Error, secret: Option<&str>) -> AdminError {
    let msg = without_secret(format!("{what}: {e}"), secret);
    match e {
        zk::Error::ConnectionLoss
        | zk::Error::SessionExpired
        | zk::Error::Timeout
        | zk::Error::ClientClosed
        | zk::Error::NoHosts
        | zk::Error::AuthFailed
        | zk::Error::SessionMoved => AdminError::connect(msg),
        zk::Error::Unimplemented => AdminError::unsupported(msg),
        _ => AdminError::server(msg),
    }
}

/// The lock name of an escaped lock parent, or `None` for a child of the root that the backend
/// never writes (it must escape back to itself).
pub(crate) fn unescape(escaped: &str) -> Option<String> {
    crate::admin::unescape_segment(escaped, escape)
}

/// The contender nodes of one lock parent: sequence -> child name, and the children that are
/// not contender nodes.
/// A child of the root that is a semaphore's, a read-write lock's or a leader record's node
/// (`<escaped name>%sem`, `%rw`, `%leader`; see `zookeeper/prims.rs`).
fn is_other_primitive(child: &str) -> bool {
    ["%sem", "%rw", "%leader"].iter().any(|sfx| {
        child
            .strip_suffix(sfx)
            .is_some_and(|stem| unescape(stem).is_some())
    })
}

fn contenders(children: Vec<String>) -> (BTreeMap<i64, String>, usize) {
    let mut nodes = BTreeMap::new();
    let mut foreign = 0;
    for ch in children {
        match seq_of(&ch) {
            Some(s) => {
                nodes.insert(s, ch);
            }
            None => foreign += 1,
        }
    }
    (nodes, foreign)
}

/// The fencing token the lock parent's data records for the holder node `child` (see
/// `last_token`); `None` while its grant has not stored it yet.
fn token_of(parent_data: &[u8], child: &str) -> Option<u64> {
    last_token(parent_data).and_then(|(t, node)| (node == child).then_some(t))
}

/// The owner id stored in a node (empty for nodes of dlock versions that stored none): the
/// data up to its first newline (after it, the holder identity; see [`holder_of`]).
fn owner_of(data: &[u8], session: i64) -> String {
    match std::str::from_utf8(data).map(|s| s.split_once('\n').map_or(s, |(o, _)| o)) {
        Ok(s) if !s.is_empty() => s.to_string(),
        _ => format!("(not stored; session 0x{session:x})"),
    }
}

/// The holder identity stored in a node after the owner id and a newline (`None` for nodes of
/// older versions).
fn holder_of(data: &[u8]) -> Option<&str> {
    std::str::from_utf8(data)
        .ok()?
        .split_once('\n')
        .map(|(_, h)| h)
}

impl ZookeeperAdmin {
    /// Connects to `zk://[user:password@]host:port[,host:port...][/chroot]`, or `zks://...`
    /// over TLS with its `tls_ca` / `tls_cert` / `tls_key` parameters (as
    /// `ZookeeperBackend::connect` parses it; `user:password` is the digest identity the
    /// backend's nodes are created with). The session is checked here.
    pub async fn connect(url: &str) -> Result<ZookeeperAdmin, AdminError> {
        let unusable = |e: crate::LockError| {
            AdminError::unsupported(format!("cannot use this ZooKeeper URL: {e}"))
        };
        let u = parse_url(url).map_err(unusable)?;
        let (userinfo, hosts) = (u.userinfo.clone(), u.hosts);
        // A raw `/` in the password leaves it in `hosts`: scrub the display as a whole.
        let shown = crate::redact::scrub(&u.shown(), url);
        let secret = userinfo.as_ref().map(|(_, p)| p.clone());
        let mut connector = zk::Client::connector();
        connector
            .session_timeout(Duration::from_secs(10))
            .connection_timeout(CALL_TIMEOUT);
        if let Some((user, password)) = userinfo {
            connector.auth(
                "digest".to_string(),
                format!("{user}:{password}").into_bytes(),
            );
        }
        let secure = prepare(&mut connector, u.tls.as_ref()).map_err(unusable)?;
        let what = format!("connecting to {shown}");
        let client = bounded(&what, async {
            open_client(&mut connector, hosts, secure)
                .await
                .map_err(|e| {
                    let msg = without_secret(format!("{what}: {e}"), secret.as_deref());
                    match e {
                        // A malformed host list or chroot.
                        zk::Error::BadArguments(_) => AdminError::unsupported(msg),
                        // Every other failure to open a session is a connection failure.
                        _ => AdminError::connect(msg),
                    }
                })
        })
        .await?;
        Ok(ZookeeperAdmin {
            client,
            shown,
            root: DEFAULT_ROOT.to_string(),
            secret,
        })
    }

    /// Reads locks under another root than `/dlock` (`ZookeeperBackendBuilder::root`).
    pub fn with_root(mut self, root: &str) -> Self {
        self.root = root.trim_end_matches('/').to_string();
        self
    }

    fn secret(&self) -> Option<&str> {
        self.secret.as_deref()
    }

    async fn call<T>(
        &self,
        what: impl FnOnce() -> String,
        fut: impl Future<Output = Result<T, zk::Error>>,
    ) -> Result<T, AdminError> {
        match tokio::time::timeout(CALL_TIMEOUT, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(map(&what(), e, self.secret())),
            Err(_) => Err(AdminError::connect(format!(
                "{}: no answer from {} within {CALL_TIMEOUT:?}",
                what(),
                self.shown
            ))),
        }
    }

    /// Children of `path`; `None` when it does not exist.
    async fn children(&self, path: &str) -> Result<Option<Vec<String>>, AdminError> {
        match tokio::time::timeout(CALL_TIMEOUT, self.client.list_children(path)).await {
            Ok(Ok(ch)) => Ok(Some(ch)),
            Ok(Err(zk::Error::NoNode)) => Ok(None),
            Ok(Err(e)) => Err(map(
                &format!("listing {path} on {}", self.shown),
                e,
                self.secret(),
            )),
            Err(_) => Err(AdminError::connect(format!(
                "listing {path}: no answer from {} within {CALL_TIMEOUT:?}",
                self.shown
            ))),
        }
    }

    /// Data and stat of a node; `None` when it does not exist.
    async fn node(&self, path: &str) -> Result<Option<(Vec<u8>, zk::Stat)>, AdminError> {
        match tokio::time::timeout(CALL_TIMEOUT, self.client.get_data(path)).await {
            Ok(Ok(v)) => Ok(Some(v)),
            Ok(Err(zk::Error::NoNode)) => Ok(None),
            Ok(Err(e)) => Err(map(
                &format!("reading {path} on {}", self.shown),
                e,
                self.secret(),
            )),
            Err(_) => Err(AdminError::connect(format!(
                "reading {path}: no answer from {} within {CALL_TIMEOUT:?}",
                self.shown
            ))),
        }
    }

    fn dir_of(&self, name: &str) -> String {
        format!("{}/{}", self.root, escape(name))
    }

    /// Reads one lock; also returns the number of foreign children of its parent.
    async fn read(&self, name: &str) -> Result<(Option<LockInfo>, usize), AdminError> {
        let dir = self.dir_of(name);
        // The holder may leave between the listing and the read of its node: look again (a
        // few times; each look is bounded).
        for attempt in 0..5 {
            let Some(children) = self.children(&dir).await? else {
                return Ok((None, 0));
            };
            let (nodes, foreign) = contenders(children);
            let Some((_, first)) = nodes.first_key_value() else {
                return Ok((None, foreign));
            };
            let path = format!("{dir}/{first}");
            let Some((data, stat)) = self.node(&path).await? else {
                continue;
            };
            // The token is stored in the parent by the grant, one round trip after the node
            // became the lowest: a grant caught in between is read again a moment later.
            let token = match self.node(&dir).await? {
                Some((pdata, _)) => token_of(&pdata, first),
                None => continue,
            };
            if token.is_none() && attempt < 4 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            let mut info = LockInfo::new(name);
            info.holders = vec![
                Holder::new(owner_of(&data, stat.ephemeral_owner), 1)
                    .with_identity_text(holder_of(&data)),
            ];
            info.token = token;
            info.waiters = Some(nodes.len() as u64 - 1);
            info.waiters_are = "queued contenders";
            info.details = vec![
                ("server".into(), self.shown.clone()),
                ("holder node".into(), path),
                (
                    "session".into(),
                    format!(
                        "0x{:x} (the lease: the node goes with it)",
                        stat.ephemeral_owner
                    ),
                ),
                ("lock parent".into(), dir.clone()),
                ("created (ms since epoch)".into(), stat.ctime.to_string()),
            ];
            return Ok((Some(info), foreign));
        }
        Err(AdminError::server(format!(
            "reading lock `{name}` on {}: its holder kept changing",
            self.shown
        )))
    }

    async fn force(
        &self,
        name: &str,
        expected: Option<&LockInfo>,
    ) -> Result<ForceReleased, AdminError> {
        let now = match still_held(self.read(name).await?.0, expected) {
            Ok(now) => now,
            Err(done) => return Ok(done),
        };
        // The node's path names exactly this hold (a random guid and a sequence): deleting it
        // cannot delete a later holder's node.
        let path = now
            .details
            .iter()
            .find(|(k, _)| k == "holder node")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        match tokio::time::timeout(CALL_TIMEOUT, self.client.delete(&path, None)).await {
            Ok(Ok(())) => {
                let woke = Some(u64::from(now.waiters.unwrap_or(0) > 0));
                Ok(ForceReleased::Released {
                    was: Box::new(now),
                    woke,
                })
            }
            // Gone meanwhile: the holder released (or its session ended).
            Ok(Err(zk::Error::NoNode)) => match self.read(name).await? {
                (Some(_), _) => Ok(ForceReleased::Changed),
                (None, _) => Ok(ForceReleased::NotHeld),
            },
            Ok(Err(e)) => Err(map(
                &format!("deleting {path} on {}", self.shown),
                e,
                self.secret(),
            )),
            Err(_) => Err(AdminError::connect(format!(
                "deleting {path}: no answer from {} within {CALL_TIMEOUT:?}",
                self.shown
            ))),
        }
    }

    async fn listing(&self, prefix: &str) -> Result<Listing, AdminError> {
        let Some(dirs) = self.children(&self.root).await? else {
            return Ok(Listing::new(Vec::new(), 0));
        };
        let mut locks = Vec::new();
        let mut skipped = 0;
        // A foreign child counts when it falls under the prefix as the backend escapes it.
        let escaped_prefix = escape(prefix);
        for d in dirs {
            let Some(name) = unescape(&d) else {
                // The directories of semaphores, read-write locks and leader records are the
                // backend's own, not foreign nodes (they are not locks).
                skipped += usize::from(d.starts_with(&escaped_prefix) && !is_other_primitive(&d));
                continue;
            };
            if !name.starts_with(prefix) {
                continue;
            }
            let (info, foreign) = self.read(&name).await?;
            skipped += foreign;
            locks.extend(info);
        }
        Ok(Listing::new(locks, skipped))
    }

    /// The contender nodes of every lock under `prefix`: name -> sequence -> node.
    async fn snapshot(&self, prefix: &str) -> Result<BTreeMap<String, Queue>, AdminError> {
        let mut out = BTreeMap::new();
        let Some(dirs) = self.children(&self.root).await? else {
            return Ok(out);
        };
        for d in dirs {
            let Some(name) = unescape(&d) else { continue };
            if !name.starts_with(prefix) {
                continue;
            }
            let dir = format!("{}/{d}", self.root);
            let Some(children) = self.children(&dir).await? else {
                continue;
            };
            let (nodes, _) = contenders(children);
            if nodes.is_empty() {
                continue;
            }
            let mut q = Queue {
                dir,
                nodes: nodes
                    .into_iter()
                    .map(|(s, child)| (s, Node { child, hold: None }))
                    .collect(),
            };
            // The current holder counts as announced (its release is reported).
            q.resolve_holder(self, true).await;
            out.insert(name, q);
        }
        Ok(out)
    }

    async fn start_watch(&self, prefix: &str) -> Result<Watching, AdminError> {
        // Registered before the snapshot, so nothing between the two is missed (an event for a
        // node the snapshot already has changes nothing).
        let what = || format!("watching {} on {}", self.root, self.shown);
        let mut watcher = self
            .call(
                what,
                self.client
                    .watch(&self.root, zk::AddWatchMode::PersistentRecursive),
            )
            .await?;
        let mut state = self.snapshot(prefix).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        let me = self.clone();
        let prefix = prefix.to_string();
        tokio::spawn(async move {
            let mut disconnected = false;
            loop {
                let ev = tokio::select! {
                    ev = watcher.changed() => ev,
                    _ = tx.closed() => return,
                };
                let mut out = Vec::new();
                match ev.event_type {
                    zk::EventType::Session => match ev.session_state {
                        zk::SessionState::Disconnected => disconnected = true,
                        zk::SessionState::SyncConnected if disconnected => {
                            disconnected = false;
                            // zookeeper-client 0.9.3 does not register persistent watches
                            // again after a reconnection (its `resend_watches` sends only the
                            // one-shot kinds): add it again (the old watcher, dropped after,
                            // then removes nothing on the server).
                            let again = me
                                .call(
                                    || format!("watching {} on {} again", me.root, me.shown),
                                    me.client
                                        .watch(&me.root, zk::AddWatchMode::PersistentRecursive),
                                )
                                .await;
                            match again {
                                Ok(w) => watcher = w,
                                Err(e) => {
                                    let _ = tx.send(Err(e)).await;
                                    return;
                                }
                            }
                            // Events during the disconnection may be lost anyway
                            // (ZOOKEEPER-4698): read everything again and report what changed.
                            match me.snapshot(&prefix).await {
                                Ok(fresh) => {
                                    out = diff(&state, &fresh);
                                    state = fresh;
                                }
                                Err(e) => {
                                    let _ = tx.send(Err(e)).await;
                                    return;
                                }
                            }
                        }
                        s if s.is_terminated() => {
                            // No call to `changed` after a terminal state (it would panic).
                            let _ = tx
                                .send(Err(AdminError::connect(format!(
                                    "{}: the admin's ZooKeeper session ended ({s:?})",
                                    me.shown
                                ))))
                                .await;
                            return;
                        }
                        _ => {}
                    },
                    zk::EventType::NodeCreated
                    | zk::EventType::NodeDeleted
                    | zk::EventType::NodeDataChanged => {
                        out = me.apply(&mut state, &prefix, &ev).await;
                    }
                    _ => {}
                }
                for e in out {
                    if tx.send(Ok(e)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Watching {
            events: rx,
            sees: format!(
                "acquisitions (owner and token), releases, contenders queueing and leaving (a \
                 persistent recursive watch on {}); a node deleted because its session ended \
                 is reported as a release: ZooKeeper's notification does not say why a node \
                 went",
                self.root
            ),
            sees_acquisitions: true,
        })
    }

    /// Applies one node event to the watch state; returns the events to report.
    async fn apply(
        &self,
        state: &mut BTreeMap<String, Queue>,
        prefix: &str,
        ev: &zk::WatchedEvent,
    ) -> Vec<LockEvent> {
        let Some(rest) = ev
            .path
            .strip_prefix(&self.root)
            .and_then(|r| r.strip_prefix('/'))
        else {
            return Vec::new();
        };
        // Only contender nodes (`<dir>/<child>`), and the lock parents' data (the token a
        // grant stores: its holder is reported then).
        let Some((d, child)) = rest.split_once('/') else {
            if ev.event_type != zk::EventType::NodeDataChanged {
                return Vec::new();
            }
            let Some(name) = unescape(rest).filter(|n| n.starts_with(prefix)) else {
                return Vec::new();
            };
            let Some(q) = state.get_mut(&name) else {
                return Vec::new();
            };
            return q
                .resolve_holder(self, false)
                .await
                .map(|(o, t)| LockEvent::Acquired {
                    name,
                    owner: Some(o),
                    token: Some(t),
                })
                .into_iter()
                .collect();
        };
        if ev.event_type == zk::EventType::NodeDataChanged {
            return Vec::new();
        }
        let (Some(name), Some(seq)) = (unescape(d), seq_of(child)) else {
            return Vec::new();
        };
        if !name.starts_with(prefix) || child.contains('/') {
            return Vec::new();
        }
        let mut out = Vec::new();
        match ev.event_type {
            zk::EventType::NodeCreated => {
                let q = state.entry(name.clone()).or_insert_with(|| Queue {
                    dir: format!("{}/{d}", self.root),
                    nodes: BTreeMap::new(),
                });
                if q.nodes.contains_key(&seq) {
                    return out;
                }
                q.nodes.insert(
                    seq,
                    Node {
                        child: child.to_string(),
                        hold: None,
                    },
                );
                if q.nodes.first_key_value().map(|(s, _)| *s) == Some(seq) {
                    out.extend(q.resolve_holder(self, false).await.map(|(o, t)| {
                        LockEvent::Acquired {
                            name: name.clone(),
                            owner: Some(o),
                            token: Some(t),
                        }
                    }));
                } else {
                    out.push(LockEvent::Other {
                        name,
                        what: "a contender queued".into(),
                    });
                }
            }
            zk::EventType::NodeDeleted => {
                let Some(q) = state.get_mut(&name) else {
                    return out;
                };
                let was_holder = q.nodes.first_key_value().map(|(s, _)| *s) == Some(seq);
                let Some(node) = q.nodes.remove(&seq) else {
                    return out;
                };
                if !was_holder {
                    out.push(LockEvent::Other {
                        name,
                        what: "a queued contender left".into(),
                    });
                    return out;
                }
                if node.hold.is_some() {
                    out.push(LockEvent::Released { name: name.clone() });
                }
                if q.nodes.is_empty() {
                    state.remove(&name);
                } else if let Some((o, t)) = q.resolve_holder(self, false).await {
                    out.push(LockEvent::Acquired {
                        name,
                        owner: Some(o),
                        token: Some(t),
                    });
                }
            }
            _ => {}
        }
        out
    }
}

/// What the watch knows of one lock's queue.
#[derive(Debug, Clone)]
struct Queue {
    dir: String,
    nodes: BTreeMap<i64, Node>,
}

#[derive(Debug, Clone)]
struct Node {
    child: String,
    /// `(owner, token)` once read as the holder (then its release is reported).
    hold: Option<(String, u64)>,
}

impl Queue {
    /// Reads the lowest node (the holder) when not read yet and records its owner and token.
    /// Returns them when read now, unless `quiet` (the snapshot: holders from before the watch
    /// are not reported as acquisitions, but their releases are). A node found gone stays
    /// unread: its delete event follows, reports no release, and reads the next holder. A
    /// holder whose grant has not stored its token in the parent yet stays unread too: the
    /// parent's data change follows and reads it then.
    async fn resolve_holder(
        &mut self,
        admin: &ZookeeperAdmin,
        quiet: bool,
    ) -> Option<(String, u64)> {
        let (seq, node) = self.nodes.first_key_value()?;
        if node.hold.is_some() {
            return None;
        }
        let (seq, path) = (*seq, format!("{}/{}", self.dir, node.child));
        let token = match admin.node(&self.dir).await {
            Ok(Some((pdata, _))) => token_of(&pdata, &node.child)?,
            _ => return None,
        };
        match admin.node(&path).await {
            Ok(Some((data, stat))) => {
                let hold = (owner_of(&data, stat.ephemeral_owner), token);
                if let Some(n) = self.nodes.get_mut(&seq) {
                    n.hold = Some(hold.clone());
                }
                (!quiet).then_some(hold)
            }
            // Gone already, or unreadable: its hold is not reported.
            _ => None,
        }
    }
}

/// The events that turn `old` into `new` (after a reconnection whose events may be lost).
fn diff(old: &BTreeMap<String, Queue>, new: &BTreeMap<String, Queue>) -> Vec<LockEvent> {
    let holder = |q: &Queue| {
        q.nodes
            .first_key_value()
            .and_then(|(_, n)| n.hold.clone().map(|h| (n.child.clone(), h)))
    };
    let mut out = Vec::new();
    let names: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    for name in names {
        let before = old.get(name).and_then(holder);
        let after = new.get(name).and_then(holder);
        if before.as_ref().map(|b| &b.0) == after.as_ref().map(|a| &a.0) {
            continue;
        }
        if before.is_some() {
            out.push(LockEvent::Released { name: name.clone() });
        }
        if let Some((_, (owner, token))) = after {
            out.push(LockEvent::Acquired {
                name: name.clone(),
                owner: Some(owner),
                token: Some(token),
            });
        }
    }
    out
}

impl Admin for ZookeeperAdmin {
    fn engine(&self) -> &'static str {
        "zookeeper"
    }

    fn target(&self) -> String {
        self.shown.clone()
    }

    fn list<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Listing, AdminError>> {
        Box::pin(self.listing(prefix))
    }

    fn show<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<LockInfo>, AdminError>> {
        Box::pin(async move { Ok(self.read(name).await?.0) })
    }

    fn force_release<'a>(
        &'a self,
        name: &'a str,
        expected: Option<&'a LockInfo>,
    ) -> BoxFuture<'a, Result<ForceReleased, AdminError>> {
        Box::pin(bounded_total(self.force(name, expected)))
    }

    fn watch<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Watching, AdminError>> {
        Box::pin(self.start_watch(prefix))
    }
}

/// A force-release is a few requests, each bounded; the whole is too (a read, a delete, and
/// after a lost race one more read).
async fn bounded_total<T>(
    fut: impl Future<Output = Result<T, AdminError>>,
) -> Result<T, AdminError> {
    match tokio::time::timeout(CALL_TIMEOUT * 4, fut).await {
        Ok(r) => r,
        Err(_) => Err(AdminError::connect(format!(
            "force-release: no answer within {:?}",
            CALL_TIMEOUT * 4
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_parents_round_trip_and_foreign_children_are_rejected() {
        for n in ["order:42", "a/b", ".x", "a.b", "é", "a%b", "a b"] {
            assert_eq!(unescape(&escape(n)).as_deref(), Some(n), "{n}");
        }
        for d in ["", "%2", "%zz", "a:b", ".x", "%61", "%FF", "a%3a"] {
            assert_eq!(unescape(d), None, "{d}");
        }
    }

    #[test]
    fn contender_nodes_are_ordered_by_sequence() {
        let (nodes, foreign) = contenders(vec![
            "_c_b-lock-0000000010".into(),
            "_c_a-lock-0000000002".into(),
            "foreign".into(),
        ]);
        assert_eq!(foreign, 1);
        assert_eq!(
            nodes.values().cloned().collect::<Vec<_>>(),
            ["_c_a-lock-0000000002", "_c_b-lock-0000000010"]
        );
    }

    /// Review m5: a parent's sequence counter is a signed 32-bit int, printed `%010d`; after
    /// 2^31 creates it wraps to `-2147483648`. A node created after the wrap is later than
    /// every node created before it, so it must sort after them (before, it sorted first and
    /// was granted while the holder still held). The backend's grant uses the same `seq_of`.
    #[test]
    fn a_wrapped_negative_sequence_sorts_after_every_positive_one() {
        let (nodes, _) = contenders(vec![
            "_c_c-lock--2147483647".into(),
            "_c_b-lock--2147483648".into(),
            "_c_a-lock-2147483647".into(),
            "_c_h-lock-2147483600".into(),
        ]);
        assert_eq!(
            nodes.values().cloned().collect::<Vec<_>>(),
            [
                "_c_h-lock-2147483600",
                "_c_a-lock-2147483647",
                "_c_b-lock--2147483648",
                "_c_c-lock--2147483647",
            ]
        );
        assert!(seq_of("_c_b-lock--2147483648") > seq_of("_c_a-lock-2147483647"));
        assert!(seq_of("_c_x-lock-0000000001") < seq_of("_c_b-lock--2147483648"));
        // Out of the 32-bit range: not a ZooKeeper sequence.
        assert_eq!(seq_of("_c_x-lock-4294967296"), None);
    }

    #[test]
    fn the_token_a_grant_stored_is_read_back_for_its_node_only() {
        assert_eq!(
            token_of(
                b"1795676489419000 _c_a-lock-0000000003",
                "_c_a-lock-0000000003"
            ),
            Some(1795676489419000)
        );
        assert_eq!(
            token_of(
                b"1795676489419000 _c_a-lock-0000000003",
                "_c_b-lock-0000000004"
            ),
            None
        );
        assert_eq!(token_of(b"", "_c_a-lock-0000000003"), None);
        assert_eq!(token_of(b"garbage", "_c_a-lock-0000000003"), None);
    }
}
