//! Semaphores, read-write locks and leader records on ZooKeeper: each primitive's directory,
//! its grant rule, the read-write downgrade and the epoch-guarded record. The nodes, their
//! creation (protected mode), the grant's token, the predecessor watches and the reaper are the
//! lock's (`super`).
//!
//! Layout beside the lock `<root>/<escaped name>` (a `%` followed by a letter never appears in
//! an escaped name, so no lock directory can be mistaken for one of these):
//!
//! * `<root>/<escaped name>%sem`: a semaphore, one ephemeral sequential node per acquisition,
//!   `_c_<guid>-<max>-<permits>-sem-<sequence>`; the directory's data is the last token.
//! * `<root>/<escaped name>%rw`: a read-write lock, `_c_<guid>-read-<sequence>` and
//!   `_c_<guid>-write-<sequence>`; the directory's data is the last token (either side).
//! * `<root>/<escaped name>%leader`: the leader record of the election whose lock is `name`, a
//!   persistent node whose data is `<epoch> <value>`.

use std::sync::Arc;

use zookeeper_client as zk;

use super::{
    Decision, Hold, HoldKey, Inner, Prim, any_seq, be, escape, is_no_node, is_zk, last_token,
    node_data, root_acls, sem_shape, seq_after,
};
use crate::LockError;
use crate::backend::Record;

/// Attempts at a record write whose node's version moved on (another writer between the read
/// and the write).
const RECORD_TRIES: usize = 8;

impl Inner {
    /// The directory of `prim`'s nodes for `name`.
    pub(super) fn dir_of(&self, prim: Prim, name: &str) -> String {
        let base = format!("{}/{}", self.cfg.root, escape(name));
        match prim {
            Prim::Lock => base,
            Prim::Sem => format!("{base}%sem"),
            Prim::Read | Prim::Write => format!("{base}%rw"),
        }
    }

    /// The rule of `key`'s primitive, on the directory's `children` (which hold `mine`, of
    /// sequence `my_seq`):
    ///
    /// * lock: granted when no node is older; else wait for the next older one.
    /// * semaphore (FIFO): the oldest node's `max` is the name's (another `max` is refused);
    ///   granted when the permits of every node up to this one fit in it. Else wait: for the
    ///   next older node when that one waits too (its grant rewrites its node, which wakes this
    ///   one), or, as the first waiter, for any change of the listing (a holder leaving).
    /// * write: as the lock (every older node, reader or writer, must go).
    /// * read: granted when no older write node is a writer (held or waiting: writer
    ///   preference, a reader that comes after a waiting writer queues behind it); a write node
    ///   whose holder downgraded (its node rewritten once) counts as a reader. Else wait for the
    ///   youngest older writer.
    pub(super) async fn decide(
        &self,
        key: &HoldKey,
        c: &zk::Client,
        dir: &str,
        children: &[String],
        mine: &str,
        my_seq: i64,
    ) -> Result<Decision, LockError> {
        let mut older: Vec<(i64, &String)> = children
            .iter()
            .filter(|ch| ch.as_str() != mine)
            .filter_map(|ch| Some((any_seq(ch)?, ch)))
            .filter(|(s, _)| *s < my_seq)
            .collect();
        older.sort();
        match key.prim {
            Prim::Lock | Prim::Write => Ok(match older.last() {
                None => Decision::Grant,
                Some((_, p)) => Decision::WaitNode((*p).clone()),
            }),
            Prim::Sem => {
                let Some((my_max, my_permits)) = sem_shape(mine) else {
                    return Err(be(&key.name, "a semaphore node without its shape"));
                };
                // Every node of the same `max`, oldest first.
                let mut nodes: Vec<(i64, &String, u32, u32)> = children
                    .iter()
                    .filter_map(|ch| {
                        let (m, p) = sem_shape(ch)?;
                        Some((any_seq(ch)?, ch, m, p))
                    })
                    .collect();
                nodes.sort();
                let stored = nodes.first().map_or(my_max, |n| n.2);
                if stored != my_max {
                    return Ok(Decision::Refuse(LockError::SemaphoreMax {
                        key: key.name.clone(),
                        asked: my_max,
                        stored,
                    }));
                }
                let mut sum = 0u64;
                let mut pred: Option<(&String, u64)> = None;
                for (s, ch, m, p) in &nodes {
                    if *m != stored || *s > my_seq {
                        continue;
                    }
                    if *s < my_seq {
                        sum += u64::from(*p);
                        pred = Some((ch, sum));
                    }
                }
                if sum + u64::from(my_permits) <= u64::from(stored) {
                    return Ok(Decision::Grant);
                }
                Ok(match pred {
                    // The next older node waits too: its grant (or its leaving) wakes this one.
                    Some((p, upto)) if upto > u64::from(stored) => Decision::WaitNode(p.clone()),
                    _ => Decision::WaitListing,
                })
            }
            Prim::Read => {
                for (_, ch) in older.iter().rev() {
                    if seq_after(ch, "-write-").is_none() {
                        continue;
                    }
                    // A write node rewritten once is a downgraded (read) hold.
                    let st = self
                        .bounded(&key.name, c.check_stat(&format!("{dir}/{ch}")))
                        .await?;
                    match st {
                        Some(st) if st.version >= 1 => continue,
                        Some(_) => return Ok(Decision::WaitNode((*ch).clone())),
                        None => continue,
                    }
                }
                Ok(Decision::Grant)
            }
        }
    }

    /// Turns `owner`'s write hold of `name` into a read hold on the server in one `multi`: its
    /// node is rewritten once (from then on it counts as a reader: see [`Inner::decide`]; it
    /// keeps its place, so every writer queued behind it still waits for it) and a new token
    /// is stored in the directory. `None` when the write hold is gone.
    pub(super) async fn rw_downgrade(
        self: &Arc<Self>,
        name: &str,
        owner: &str,
    ) -> Result<Option<u64>, LockError> {
        let wkey = HoldKey::new(Prim::Write, name, owner);
        let Some(h) = self.holds().get(&wkey).cloned() else {
            return Ok(None);
        };
        let sess = self.session().clone();
        if !h.held || h.releasing.is_some() || sess.id != h.session || sess.ended() {
            return Ok(None);
        }
        let c = sess.client;
        let dir = self.dir_of(Prim::Write, name);
        let mine = h.path.rsplit('/').next().unwrap_or("").to_string();
        let (mut data, mut stat) = self.bounded(name, c.get_data(&dir)).await?;
        for _ in 0..super::SHARED_TOKEN_CAS_TRIES {
            let last = last_token(&data).map_or(0, |(t, _)| t);
            let token = last.saturating_add(1).max(h.token.saturating_add(1));
            let mut w = c.new_multi_writer();
            w.add_set_data(&h.path, &node_data(owner), Some(0))
                .map_err(|e| be(name, e))?;
            w.add_set_data(
                &dir,
                format!("{token} {mine}").as_bytes(),
                Some(stat.version),
            )
            .map_err(|e| be(name, e))?;
            match tokio::time::timeout(self.cfg.request_timeout, w.commit()).await {
                Ok(Ok(_)) => {
                    let mut holds = self.holds();
                    let Some(mut h) = holds.remove(&wkey) else {
                        // Released meanwhile (a dropped future's give-back): the node is
                        // being deleted.
                        return Ok(None);
                    };
                    h.count = 1;
                    h.token = token;
                    holds.insert(HoldKey::new(Prim::Read, name, owner), h);
                    drop(holds);
                    // Readers queued behind the node were woken by its rewrite (their watch);
                    // a local reader without a node of its own tries now.
                    self.wake_one_nodeless(Prim::Read, name);
                    return Ok(Some(token));
                }
                Ok(Err(zk::MultiWriteError::OperationFailed {
                    index: 0,
                    source: zk::Error::NoNode,
                })) => {
                    // Confirmed gone (deleted behind its back, or its session ended).
                    self.holds().remove(&wkey);
                    return Ok(None);
                }
                Ok(Err(zk::MultiWriteError::OperationFailed {
                    index: 0,
                    source: zk::Error::BadVersion,
                })) => {
                    return Err(be(name, "the ZooKeeper write node was already downgraded"));
                }
                Ok(Err(zk::MultiWriteError::OperationFailed {
                    index: 1,
                    source: zk::Error::BadVersion,
                })) => (data, stat) = self.bounded(name, c.get_data(&dir)).await?,
                Ok(Err(e)) => return Err(be(name, e)),
                Err(_) => {
                    return Err(be(
                        name,
                        "ZooKeeper request timed out (downgrading the write hold)",
                    ));
                }
            }
        }
        Err(be(
            name,
            "the ZooKeeper read-write lock's token kept changing under this downgrade",
        ))
    }

    /// The record node of the lock `name`.
    fn record_path(&self, name: &str) -> String {
        format!("{}/{}%leader", self.cfg.root, escape(name))
    }

    /// Writes `value` under `epoch` unless the stored epoch is larger: read, compare, then a
    /// write conditioned on the version read (or a create when there is none); a write beaten
    /// by another (`BadVersion`, `NodeExists`) is decided again on a fresh read. A write whose
    /// outcome is unknown is not sent again (an error).
    pub(super) async fn put_record(
        &self,
        name: &str,
        epoch: u64,
        value: &str,
    ) -> Result<bool, LockError> {
        let c = self.live_client().await?;
        let path = self.record_path(name);
        let data = format!("{epoch} {value}");
        for _ in 0..RECORD_TRIES {
            match self.bounded(name, c.get_data(&path)).await {
                Ok((cur, stat)) => {
                    if parse_record(&cur).is_some_and(|r| r.epoch > epoch) {
                        return Ok(false);
                    }
                    match self
                        .bounded(name, c.set_data(&path, data.as_bytes(), Some(stat.version)))
                        .await
                    {
                        Ok(_) => return Ok(true),
                        Err(e) if is_zk(&e, &zk::Error::BadVersion) || is_no_node(&e) => {}
                        Err(e) => return Err(e),
                    }
                }
                Err(e) if is_no_node(&e) => {
                    let opts = zk::CreateMode::Persistent.with_acls(self.cfg.node_acls());
                    match self
                        .bounded(name, c.create(&path, data.as_bytes(), &opts))
                        .await
                    {
                        Ok(_) => return Ok(true),
                        Err(e) if is_zk(&e, &zk::Error::NodeExists) => {}
                        Err(e) if is_no_node(&e) => {
                            // The root is missing: made as the lock makes it.
                            let root = zk::CreateMode::Persistent.with_acls(root_acls(&self.cfg));
                            match self.bounded(name, c.mkdir(&self.cfg.root, &root)).await {
                                Ok(()) => {}
                                Err(e) if is_zk(&e, &zk::Error::NodeExists) => {}
                                Err(e) => return Err(e),
                            }
                        }
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(be(
            name,
            "the ZooKeeper leader record kept changing under this write",
        ))
    }

    /// Reads the record of the lock `name` (after a `sync`, so a record written through
    /// another server is seen).
    pub(super) async fn get_record(&self, name: &str) -> Result<Option<Record>, LockError> {
        let c = self.live_client().await?;
        let path = self.record_path(name);
        let (synced, got) = tokio::join!(
            self.bounded(name, c.sync(&path)),
            self.bounded(name, c.get_data(&path))
        );
        match synced {
            Ok(()) => {}
            Err(e) if is_no_node(&e) => {}
            Err(e) => return Err(e),
        }
        match got {
            Ok((data, _)) => parse_record(&data)
                .map(Some)
                .ok_or_else(|| be(name, "the ZooKeeper leader record is not `<epoch> <value>`")),
            Err(e) if is_no_node(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The holds of `prim` this backend knows for `name` (for tests).
    #[allow(dead_code)]
    pub(super) fn holds_of(&self, prim: Prim, name: &str) -> Vec<Hold> {
        self.holds()
            .iter()
            .filter(|(k, _)| k.prim == prim && k.name == name)
            .map(|(_, h)| h.clone())
            .collect()
    }
}

/// `<epoch> <value>`.
fn parse_record(data: &[u8]) -> Option<Record> {
    let s = std::str::from_utf8(data).ok()?;
    let (e, v) = s.split_once(' ')?;
    Some(Record {
        epoch: e.parse().ok()?,
        value: v.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::super::{any_seq, sem_shape};

    #[test]
    fn semaphore_nodes_carry_their_max_and_permits() {
        assert_eq!(sem_shape("_c_0a1b-5-2-sem-0000000007"), Some((5, 2)));
        assert_eq!(sem_shape("_c_0a1b-5-2-sem--2147483648"), Some((5, 2)));
        assert_eq!(sem_shape("_c_0a1b-lock-0000000007"), None);
        assert_eq!(any_seq("_c_0a1b-5-2-sem-0000000007"), Some(7));
        assert_eq!(any_seq("_c_0a1b-read-0000000009"), Some(9));
        assert_eq!(any_seq("_c_0a1b-write-0000000010"), Some(10));
    }
}
