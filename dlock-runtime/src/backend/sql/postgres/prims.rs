//! PostgreSQL leader records, semaphores and read-write locks (both modes: the advisory mode's
//! locks are session locks, but these live in tables of their own beside the lock table).
//!
//! | table | rows |
//! |---|---|
//! | `<table>_records` | one leader record per lock name: `(name, epoch, value)` |
//! | `<table>_sem` | one row per semaphore name: its `max` and its token counter `fence` |
//! | `<table>_permits` | one row per owner's grant: `(name, owner, side 'p', count = permits, fence, expires_at)` |
//! | `<table>_rw` | one row per read-write lock name: its token counter `fence` |
//! | `<table>_rw_holds` | one row per hold: side `r` (reader), `w` (writer) or `q` (a writer's "writer waiting" marker) |
//!
//! Every semaphore or read-write call is one transaction on one connection: it first locks the
//! name's row (`INSERT .. ON CONFLICT DO UPDATE` for a try, `SELECT .. FOR UPDATE` otherwise),
//! then reads the live holds in a statement whose snapshot comes after that lock (READ
//! COMMITTED takes one per statement), so two transactions never both see room; expired holds
//! are deleted there, by `clock_timestamp()` (the server's clock only). The decision is made in
//! Rust from what was read (the rules of `memory/rw.rs` and `memory/semaphore.rs`), its writes
//! and `pg_notify` follow in the same transaction, and a call that changed nothing rolls back.
//! A token is `max(fence + 1, server clock in µs)` of the name's row, which is never deleted, so
//! it is larger than every earlier token of the name (both sides of a read-write lock share it).
//!
//! Waking: on the lock table's channel, payloads that are not a lock name's hex:
//! `s<k>:<hex name>` (a release freed k permits: wake k local permit waiters), `r:<hex name>`
//! (wake every local reader), `w:<hex name>[:<hex owner>]` (wake one local writer, the marker's
//! owner when named).
//!
//! Calls whose outcome is unknown: a try is tracked as a lock's is ([`super::TrySlot`], under a
//! key of its own), so its owner's give-back runs on the same connection, behind it; a release
//! of every hold is an owner-checked delete (idempotent), re-sent in the background with
//! back-off until answered.

use super::*;

/// The waiter queues of the semaphores and read-write locks, apart from the locks'.
pub(super) struct Prims {
    pub(super) sem_waiters: Arc<WaitQueues>,
    pub(super) readers: Arc<WaitQueues>,
    pub(super) writers: Arc<WaitQueues>,
    sql: PrimSql,
}

impl Prims {
    pub(super) fn new(table: &str) -> Prims {
        Prims {
            sem_waiters: WaitQueues::new(),
            readers: WaitQueues::new(),
            writers: WaitQueues::new(),
            sql: PrimSql::new(table),
        }
    }

    /// After the listener (re)connected or was lost: releases may have been missed.
    pub(super) fn wake_all(&self) {
        self.sem_waiters.wake_all();
        self.readers.wake_all();
        self.writers.wake_all();
    }

    /// A notification on the table's channel that is one of ours; false when it is not (a
    /// lock's).
    pub(super) fn heard(&self, payload: &str) -> bool {
        let Some((head, rest)) = payload.split_once(':') else {
            return false;
        };
        if let Some(k) = head.strip_prefix('s') {
            let Some(name) = hex_name(rest) else {
                return true;
            };
            let k: u32 = k.parse().unwrap_or(1).max(1);
            for _ in 0..k {
                if !self.sem_waiters.wake_one(&name) {
                    break;
                }
            }
            return true;
        }
        match head {
            "r" => {
                if let Some(name) = hex_name(rest) {
                    while self.readers.wake_one(&name) {}
                }
                true
            }
            "w" => {
                let (n, o) = match rest.split_once(':') {
                    Some((n, o)) => (n, hex_name(o)),
                    None => (rest, None),
                };
                if let Some(name) = hex_name(n) {
                    match o {
                        Some(owner) => self.writers.wake_owner(&name, &owner),
                        None => self.writers.wake_one(&name),
                    };
                }
                true
            }
            _ => false,
        }
    }
}

/// The tables of one family (semaphores or read-write locks).
struct Family {
    /// What the tries key their [`super::TrySlot`] under (never a lock's name).
    prefix: &'static str,
    /// Locks (creating when missing) the name's row: `$1` name (`$2` max, semaphores).
    /// Returns `max`, `fence`, the server clock in µs.
    lock_create: String,
    /// Locks the name's row when it exists: `$1` name.
    lock: String,
    /// The live holds of `$1` (deleting the expired ones): owner, side, count, fence, µs left.
    load: String,
    /// `$1`..`$7`: name, owner, side, count, fence, ttl µs, keep a longer lease.
    upsert: String,
    /// `$1`..`$3`: name, owner, side.
    delete: String,
    /// `$1` name, `$2` max, `$3` fence.
    set: String,
    /// Whether `lock_create` takes the max.
    has_max: bool,
}

struct PrimSql {
    put_record: String,
    get_record: String,
    sem: Family,
    rw: Family,
    /// `$1` payload, on the table's channel.
    notify: String,
}

const CLOCK_US: &str = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint";

impl PrimSql {
    fn new(table: &str) -> PrimSql {
        let channel = channel_of(table);
        let load = |h: &str| {
            format!(
                "WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now), \
                 gone AS (DELETE FROM {h} g USING c WHERE g.name = $1 AND g.expires_at <= c.now) \
                 SELECT h.owner, h.side, h.count, h.fence, \
                        GREATEST(0, (extract(epoch FROM h.expires_at - c.now) * 1000000)::bigint) \
                 FROM {h} h, c WHERE h.name = $1 AND h.expires_at > c.now"
            )
        };
        let upsert = |h: &str| {
            format!(
                "INSERT INTO {h} AS h (name, owner, side, count, fence, expires_at) \
                 VALUES ($1, $2, $3, $4, $5, clock_timestamp() + $6 * interval '1 microsecond') \
                 ON CONFLICT (name, owner, side) DO UPDATE SET count = EXCLUDED.count, \
                   fence = EXCLUDED.fence, \
                   expires_at = CASE WHEN $7 THEN GREATEST(h.expires_at, EXCLUDED.expires_at) \
                                     ELSE EXCLUDED.expires_at END"
            )
        };
        let delete =
            |h: &str| format!("DELETE FROM {h} WHERE name = $1 AND owner = $2 AND side = $3");
        PrimSql {
            put_record: format!(
                "INSERT INTO {table}_records AS r (name, epoch, value) VALUES ($1, $2, $3) \
                 ON CONFLICT (name) DO UPDATE SET epoch = EXCLUDED.epoch, value = EXCLUDED.value \
                 WHERE r.epoch <= EXCLUDED.epoch RETURNING 1"
            ),
            get_record: format!("SELECT epoch, value FROM {table}_records WHERE name = $1"),
            sem: Family {
                prefix: "\u{0}sem\u{0}",
                lock_create: format!(
                    "INSERT INTO {table}_sem AS s (name, max, fence) VALUES ($1, $2, 0) \
                     ON CONFLICT (name) DO UPDATE SET max = s.max \
                     RETURNING s.max, s.fence, {CLOCK_US}"
                ),
                lock: format!(
                    "SELECT max, fence, {CLOCK_US} FROM {table}_sem WHERE name = $1 FOR UPDATE"
                ),
                load: load(&format!("{table}_permits")),
                upsert: upsert(&format!("{table}_permits")),
                delete: delete(&format!("{table}_permits")),
                set: format!("UPDATE {table}_sem SET max = $2, fence = $3 WHERE name = $1"),
                has_max: true,
            },
            rw: Family {
                prefix: "\u{0}rw\u{0}",
                lock_create: format!(
                    "INSERT INTO {table}_rw AS r (name, fence) VALUES ($1, 0) \
                     ON CONFLICT (name) DO UPDATE SET fence = r.fence \
                     RETURNING 0, r.fence, {CLOCK_US}"
                ),
                lock: format!(
                    "SELECT 0, fence, {CLOCK_US} FROM {table}_rw WHERE name = $1 FOR UPDATE"
                ),
                load: load(&format!("{table}_rw_holds")),
                upsert: upsert(&format!("{table}_rw_holds")),
                delete: delete(&format!("{table}_rw_holds")),
                set: format!("UPDATE {table}_rw SET fence = $3 WHERE name = $1 AND $2 >= 0"),
                has_max: false,
            },
            notify: format!("SELECT pg_notify('{channel}', $1)::text"),
        }
    }
}

/// The DDL of the records, semaphore and read-write tables of `table` (part of
/// [`super::postgres_schema_sql`]).
pub(super) fn schema_sql(table: &str) -> String {
    let holds = |h: &str| {
        format!(
            "CREATE TABLE IF NOT EXISTS {h} (\n    \
                 name bytea NOT NULL,\n    \
                 owner text NOT NULL,\n    \
                 side text NOT NULL,\n    \
                 count integer NOT NULL,\n    \
                 fence bigint NOT NULL,\n    \
                 expires_at timestamptz NOT NULL,\n    \
                 PRIMARY KEY (name, owner, side)\n\
             );\n"
        )
    };
    format!(
        "CREATE TABLE IF NOT EXISTS {table}_records (\n    \
             name bytea PRIMARY KEY,\n    \
             epoch bigint NOT NULL,\n    \
             value text NOT NULL\n\
         );\n\
         CREATE TABLE IF NOT EXISTS {table}_sem (\n    \
             name bytea PRIMARY KEY,\n    \
             max integer NOT NULL,\n    \
             fence bigint NOT NULL\n\
         );\n\
         {}\
         CREATE TABLE IF NOT EXISTS {table}_rw (\n    \
             name bytea PRIMARY KEY,\n    \
             fence bigint NOT NULL\n\
         );\n\
         {}",
        holds(&format!("{table}_permits")),
        holds(&format!("{table}_rw_holds")),
    )
}

/// One live hold, as read under the name's row lock.
#[derive(Debug, Clone)]
struct Hold {
    owner: String,
    side: String,
    count: i32,
    fence: i64,
    rem_us: i64,
}

/// What a call read: the name row's max and counter, the server clock (µs), the live holds.
#[derive(Debug, Clone)]
struct State {
    max: i32,
    fence: i64,
    us: i64,
    holds: Vec<Hold>,
}

impl State {
    fn find(&self, owner: &str, side: &str) -> Option<&Hold> {
        self.holds
            .iter()
            .find(|h| h.owner == owner && h.side == side)
    }

    fn side(&self, side: &str) -> impl Iterator<Item = &Hold> {
        self.holds.iter().filter(move |h| h.side == side)
    }

    /// The token of a new grant.
    fn mint(&self) -> i64 {
        self.fence.saturating_add(1).max(self.us)
    }
}

/// A write of a call, run in its transaction after the read.
#[derive(Debug, PartialEq, Eq)]
enum Op {
    Upsert {
        owner: String,
        side: &'static str,
        count: i32,
        fence: i64,
        ttl_us: i64,
        keep_longer: bool,
    },
    Delete {
        owner: String,
        side: &'static str,
    },
    /// The name row's max and counter.
    Set {
        max: i32,
        fence: i64,
    },
    Notify(String),
}

fn us(d: i64) -> Duration {
    Duration::from_micros(d.max(0) as u64)
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

fn wake_readers(name: &str) -> Op {
    Op::Notify(format!("r:{}", hex(name)))
}

fn wake_writer(name: &str, owner: Option<&str>) -> Op {
    Op::Notify(match owner {
        Some(o) => format!("w:{}:{}", hex(name), hex(o)),
        None => format!("w:{}", hex(name)),
    })
}

type Decided<T> = Result<(Vec<Op>, T), LockError>;

// --- The decisions (pure; the rules of the memory backend's semaphores and rw locks). ---

fn sem_acquire(
    st: &State,
    name: &str,
    owner: &str,
    max: i32,
    permits: i32,
    ttl_us: i64,
) -> Decided<Acquired> {
    if !st.holds.is_empty() && st.max != max {
        return Err(LockError::SemaphoreMax {
            key: name.to_string(),
            asked: max as u32,
            stored: st.max.max(0) as u32,
        });
    }
    if st.holds.iter().any(|h| h.owner == owner) {
        return Err(LockError::backend(
            name,
            "this owner id already holds permits of the semaphore",
        ));
    }
    let used: i64 = st.holds.iter().map(|h| i64::from(h.count)).sum();
    if used + i64::from(permits) > i64::from(max) {
        let first = st.holds.iter().map(|h| h.rem_us).min();
        return Ok((
            Vec::new(),
            Acquired::Busy {
                remaining: first.map(us),
            },
        ));
    }
    let token = st.mint();
    Ok((
        vec![
            Op::Set { max, fence: token },
            Op::Upsert {
                owner: owner.to_string(),
                side: "p",
                count: permits,
                fence: token,
                ttl_us,
                keep_longer: false,
            },
        ],
        Acquired::Granted {
            token: token as u64,
            count: 1,
        },
    ))
}

fn sem_release(st: Option<&State>, name: &str, owner: &str) -> Decided<Released> {
    let Some(h) = st.and_then(|s| s.find(owner, "p")) else {
        return Ok((Vec::new(), Released::NotOwner));
    };
    Ok((
        vec![
            Op::Delete {
                owner: owner.to_string(),
                side: "p",
            },
            Op::Notify(format!("s{}:{}", h.count.max(1), hex(name))),
        ],
        Released::Freed,
    ))
}

fn renew(st: Option<&State>, owner: &str, side: &'static str, ttl_us: i64) -> Decided<Extended> {
    let Some(h) = st.and_then(|s| s.find(owner, side)) else {
        return Ok((Vec::new(), Extended::Lost));
    };
    Ok((
        vec![Op::Upsert {
            owner: owner.to_string(),
            side,
            count: h.count,
            fence: h.fence,
            ttl_us,
            keep_longer: false,
        }],
        Extended::Extended,
    ))
}

fn rw_acquire(st: &State, side: RwSide, owner: &str, ttl_us: i64) -> Decided<Acquired> {
    let writer = st.side("w").next();
    let marker = st.side("q").next();
    let reenter = |h: &Hold, s: &'static str| {
        let count = h.count.saturating_add(1);
        Ok((
            vec![Op::Upsert {
                owner: owner.to_string(),
                side: s,
                count,
                fence: h.fence,
                ttl_us,
                keep_longer: true,
            }],
            Acquired::Granted {
                token: h.fence as u64,
                count: count as u32,
            },
        ))
    };
    let grant = |s: &'static str, mut ops: Vec<Op>| {
        let token = st.mint();
        ops.push(Op::Set {
            max: 0,
            fence: token,
        });
        ops.push(Op::Upsert {
            owner: owner.to_string(),
            side: s,
            count: 1,
            fence: token,
            ttl_us,
            keep_longer: false,
        });
        Ok((
            ops,
            Acquired::Granted {
                token: token as u64,
                count: 1,
            },
        ))
    };
    let busy = |ops: Vec<Op>, rem: Option<Duration>| Ok((ops, Acquired::Busy { remaining: rem }));
    match side {
        RwSide::Read => {
            if let Some(w) = writer {
                return busy(Vec::new(), Some(us(w.rem_us)));
            }
            if let Some(h) = st.find(owner, "r") {
                return reenter(h, "r");
            }
            if let Some(q) = marker
                && q.owner != owner
            {
                return busy(Vec::new(), Some(us(q.rem_us)));
            }
            grant("r", Vec::new())
        }
        RwSide::Write => {
            if let Some(w) = writer
                && w.owner == owner
            {
                return reenter(w, "w");
            }
            let mine = marker.is_none_or(|q| q.owner == owner);
            let end = st
                .holds
                .iter()
                .filter(|h| h.side == "w" || h.side == "r")
                .map(|h| h.rem_us)
                .max();
            if let Some(end) = end {
                let mut ops = Vec::new();
                if mine {
                    ops.push(Op::Upsert {
                        owner: owner.to_string(),
                        side: "q",
                        count: 0,
                        fence: 0,
                        ttl_us,
                        keep_longer: false,
                    });
                }
                // Retry before the marker's lease ends, to renew it.
                let rem = end.min(ttl_us / 2).max(1000);
                return busy(ops, Some(us(rem)));
            }
            if !mine {
                return busy(Vec::new(), marker.map(|q| us(q.rem_us)));
            }
            let mut ops = Vec::new();
            if marker.is_some() {
                ops.push(Op::Delete {
                    owner: owner.to_string(),
                    side: "q",
                });
            }
            grant("w", ops)
        }
    }
}

fn rw_release(
    st: Option<&State>,
    side: RwSide,
    name: &str,
    owner: &str,
    all: bool,
) -> Decided<Released> {
    let Some(st) = st else {
        return Ok((Vec::new(), Released::NotOwner));
    };
    let marker = st.side("q").next().map(|q| q.owner.as_str());
    let s = match side {
        RwSide::Read => "r",
        RwSide::Write => "w",
    };
    let Some(h) = st.find(owner, s) else {
        if side == RwSide::Write && all && marker == Some(owner) {
            // A writer that stopped waiting: readers may go on, and the next writer may take
            // its place.
            return Ok((
                vec![
                    Op::Delete {
                        owner: owner.to_string(),
                        side: "q",
                    },
                    wake_readers(name),
                    wake_writer(name, None),
                ],
                Released::NotOwner,
            ));
        }
        return Ok((Vec::new(), Released::NotOwner));
    };
    if !all && h.count > 1 {
        let count = h.count - 1;
        return Ok((
            vec![Op::Upsert {
                owner: owner.to_string(),
                side: if s == "r" { "r" } else { "w" },
                count,
                fence: h.fence,
                ttl_us: h.rem_us.max(1),
                keep_longer: true,
            }],
            Released::Decremented(count as u32),
        ));
    }
    let mut ops = vec![Op::Delete {
        owner: owner.to_string(),
        side: if s == "r" { "r" } else { "w" },
    }];
    match side {
        RwSide::Read => {
            if st.side("r").all(|r| r.owner == owner) {
                ops.push(wake_writer(name, marker));
            }
        }
        RwSide::Write => match marker {
            Some(q) => ops.push(wake_writer(name, Some(q))),
            None => {
                ops.push(wake_readers(name));
                ops.push(wake_writer(name, None));
            }
        },
    }
    // The owner's own marker goes with a release of every hold.
    if all && side == RwSide::Write && marker == Some(owner) {
        ops.push(Op::Delete {
            owner: owner.to_string(),
            side: "q",
        });
    }
    Ok((ops, Released::Freed))
}

fn rw_downgrade(st: Option<&State>, name: &str, owner: &str, ttl_us: i64) -> Decided<Option<u64>> {
    let Some(st) = st else {
        return Ok((Vec::new(), None));
    };
    if st.find(owner, "w").is_none() {
        return Ok((Vec::new(), None));
    }
    let token = st.mint();
    let mut ops = vec![
        Op::Delete {
            owner: owner.to_string(),
            side: "w",
        },
        Op::Set {
            max: 0,
            fence: token,
        },
        Op::Upsert {
            owner: owner.to_string(),
            side: "r",
            count: 1,
            fence: token,
            ttl_us,
            keep_longer: false,
        },
    ];
    if st.side("q").next().is_none() {
        ops.push(wake_readers(name));
    }
    Ok((ops, Some(token as u64)))
}

fn side_str(side: RwSide) -> &'static str {
    match side {
        RwSide::Read => "r",
        RwSide::Write => "w",
    }
}

/// The result of one transaction: outer `Err` when the database failed (or did not answer),
/// inner when the call was refused.
type TxResult<T> = Result<Result<T, LockError>, DynError>;

impl PostgresBackend {
    fn prims(&self) -> &Prims {
        &self.inner.prims
    }

    /// One call's transaction on `c`: lock the name's row, read its live holds, decide, write,
    /// commit (or roll back when nothing is written).
    async fn tx_on<T>(
        &self,
        c: &mut deadpool_postgres::Object,
        fam: &Family,
        name: &str,
        create: Option<i32>,
        decide: impl FnOnce(Option<&State>) -> Decided<T>,
    ) -> TxResult<T> {
        let tx = c.transaction().await?;
        let name_b = name.as_bytes();
        let lock = async {
            match create {
                Some(max) if fam.has_max => {
                    tx.query_typed(
                        &fam.lock_create,
                        &[(&name_b, Type::BYTEA), (&max, Type::INT4)],
                    )
                    .await
                }
                Some(_) => {
                    tx.query_typed(&fam.lock_create, &[(&name_b, Type::BYTEA)])
                        .await
                }
                None => tx.query_typed(&fam.lock, &[(&name_b, Type::BYTEA)]).await,
            }
        };
        // Pipelined: the read is sent right behind the lock (one round trip); the server runs
        // it after the lock is granted, with a snapshot of its own taken then.
        let load_params: [(&(dyn ToSql + Sync), Type); 1] = [(&name_b, Type::BYTEA)];
        let load = tx.query_typed(&fam.load, &load_params);
        let (row, rows) = futures_util::future::try_join(lock, load).await?;
        let state = match row.first() {
            None => None,
            Some(r) => {
                let max: i32 = r.try_get(0)?;
                let fence: i64 = r.try_get(1)?;
                let us: i64 = r.try_get(2)?;
                let mut holds = Vec::with_capacity(rows.len());
                for r in rows {
                    holds.push(Hold {
                        owner: r.try_get(0)?,
                        side: r.try_get(1)?,
                        count: r.try_get(2)?,
                        fence: r.try_get(3)?,
                        rem_us: r.try_get(4)?,
                    });
                }
                Some(State {
                    max,
                    fence,
                    us,
                    holds,
                })
            }
        };
        let (ops, out) = match decide(state.as_ref()) {
            Ok(d) => d,
            Err(e) => {
                tx.rollback().await?;
                return Ok(Err(e));
            }
        };
        if ops.is_empty() {
            tx.rollback().await?;
            return Ok(Ok(out));
        }
        // The writes, pipelined (sent in this order, one round trip).
        let writes = ops.iter().map(|op| {
            let tx = &tx;
            async move {
                match op {
                    Op::Upsert {
                        owner,
                        side,
                        count,
                        fence,
                        ttl_us,
                        keep_longer,
                    } => {
                        tx.query_typed(
                            &fam.upsert,
                            &[
                                (&name_b, Type::BYTEA),
                                (owner, Type::TEXT),
                                (side, Type::TEXT),
                                (count, Type::INT4),
                                (fence, Type::INT8),
                                (ttl_us, Type::INT8),
                                (keep_longer, Type::BOOL),
                            ],
                        )
                        .await
                    }
                    Op::Delete { owner, side } => {
                        tx.query_typed(
                            &fam.delete,
                            &[
                                (&name_b, Type::BYTEA),
                                (owner, Type::TEXT),
                                (side, Type::TEXT),
                            ],
                        )
                        .await
                    }
                    Op::Set { max, fence } => {
                        tx.query_typed(
                            &fam.set,
                            &[
                                (&name_b, Type::BYTEA),
                                (max, Type::INT4),
                                (fence, Type::INT8),
                            ],
                        )
                        .await
                    }
                    Op::Notify(p) => {
                        tx.query_typed(&self.prims().sql.notify, &[(p, Type::TEXT)])
                            .await
                    }
                }
            }
        });
        futures_util::future::try_join_all(writes).await?;
        tx.commit().await?;
        Ok(Ok(out))
    }

    /// A try of `owner`: tracked until its reply is read, so that the owner's give-back runs
    /// behind it on its connection (see [`super::TrySlot`]).
    async fn tx_try<T>(
        &self,
        fam: &Family,
        name: &str,
        owner: &str,
        create: i32,
        decide: impl FnOnce(Option<&State>) -> Decided<T>,
    ) -> Result<T, LockError> {
        let key = (format!("{}{name}", fam.prefix), owner.to_string());
        let slot = Arc::new(TrySlot {
            state: Mutex::new(TryState::InFlight),
            settled: tokio_watch::Sender::new(false),
        });
        locked(&self.inner.tries).insert(key.clone(), slot.clone());
        let mut g = TryGuard {
            inner: &self.inner,
            key,
            slot,
            conn: None,
            answered: false,
        };
        let pool = &self.inner.pool;
        let r = bounded(name, "the try transaction", self.inner.op_timeout, async {
            let c = g.conn.insert(pool.get().await?);
            self.tx_on(c, fam, name, Some(create), decide).await
        })
        .await;
        if r.is_ok() {
            g.answered = true;
        }
        r?
    }

    /// A call on a pooled connection.
    async fn tx_pool<T>(
        &self,
        fam: &Family,
        name: &str,
        what: &'static str,
        decide: impl FnOnce(Option<&State>) -> Decided<T>,
    ) -> Result<T, LockError> {
        let pool = &self.inner.pool;
        bounded(name, what, self.inner.op_timeout, async {
            let mut c = pool.get().await?;
            self.tx_on(&mut c, fam, name, None, decide).await
        })
        .await?
    }

    /// A give-back of `owner`: behind its unanswered try (on that try's connection), and, when
    /// the try's connection broke, a "nothing held" answer is not trusted until the server has
    /// surely ended that try (its `statement_timeout`).
    async fn tx_give_back<T: Clone + PartialEq>(
        &self,
        fam: &Family,
        name: &str,
        owner: &str,
        nothing: T,
        decide: impl Fn(Option<&State>) -> Decided<T>,
    ) -> Result<T, LockError> {
        let key_name = format!("{}{name}", fam.prefix);
        let (slot, mut conn, unsure) = self.settle_try(&key_name, owner).await;
        let out = loop {
            let r = match conn.as_mut() {
                Some(c) => {
                    bounded(
                        name,
                        "the release transaction",
                        self.inner.op_timeout,
                        self.tx_on(c, fam, name, None, &decide),
                    )
                    .await
                }
                None => {
                    let pool = &self.inner.pool;
                    bounded(
                        name,
                        "the release transaction",
                        self.inner.op_timeout,
                        async {
                            let mut c = pool.get().await?;
                            self.tx_on(&mut c, fam, name, None, &decide).await
                        },
                    )
                    .await
                }
            };
            let out = match r {
                Ok(o) => o?,
                Err(e) => {
                    // Unanswered: a retry goes on the same connection, while it lives.
                    if let (Some(s), Some(c)) = (&slot, conn.take())
                        && !c.is_closed()
                        && let TryState::Abandoned {
                            conn: slot_conn, ..
                        } = &mut *locked(&s.state)
                    {
                        *slot_conn = Some(Box::new(c));
                    }
                    return Err(e);
                }
            };
            if out == nothing
                && let Some(until) = unsure
                && std::time::Instant::now() < until
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            break out;
        };
        drop(conn);
        if let Some(s) = &slot {
            self.try_settled(&key_name, owner, s);
        }
        Ok(out)
    }

    /// A give-back of every hold whose answer was not read: re-sent in the background (it is an
    /// owner-checked delete, idempotent) with back-off until answered, for at most a minute
    /// (past it the leases free the holds).
    fn resend_give_back(&self, name: &str, owner: &str, rw: Option<RwSide>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (b, name, owner) = (self.clone(), name.to_string(), owner.to_string());
        rt.spawn(async move {
            let end = tokio::time::Instant::now() + Duration::from_secs(60);
            let mut backoff = Duration::from_millis(100);
            loop {
                tokio::time::sleep(backoff).await;
                let r = match rw {
                    None => b.permits_give_back(&name, &owner).await.map(|_| ()),
                    Some(side) => b.rw_give_back(side, &name, &owner, true).await.map(|_| ()),
                };
                match r {
                    Ok(()) => return,
                    Err(e) if tokio::time::Instant::now() + backoff >= end => {
                        tracing::warn!(key = %name, error = %e, "dlock: a give-back still unanswered after 60 s; its lease frees it");
                        return;
                    }
                    Err(_) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        });
    }

    // --- Leader records. ---

    pub(super) async fn pg_put_record(
        &self,
        name: &str,
        epoch: u64,
        value: &str,
    ) -> Result<bool, LockError> {
        let epoch = i64::try_from(epoch).map_err(|_| {
            LockError::Config(format!(
                "`{name}`: epoch {epoch} is above what PostgreSQL's bigint keeps"
            ))
        })?;
        let rows = self
            .query(
                name,
                "the record write",
                &self.prims().sql.put_record,
                &[
                    (&name.as_bytes(), Type::BYTEA),
                    (&epoch, Type::INT8),
                    (&value, Type::TEXT),
                ],
            )
            .await?;
        Ok(!rows.is_empty())
    }

    pub(super) async fn pg_get_record(
        &self,
        name: &str,
    ) -> Result<Option<crate::backend::Record>, LockError> {
        let rows = self
            .query(
                name,
                "the record read",
                &self.prims().sql.get_record,
                &[(&name.as_bytes(), Type::BYTEA)],
            )
            .await?;
        let Some(r) = rows.first() else {
            return Ok(None);
        };
        let epoch: i64 = r.try_get(0).map_err(|e| LockError::backend(name, e))?;
        let value: String = r.try_get(1).map_err(|e| LockError::backend(name, e))?;
        Ok(Some(crate::backend::Record {
            epoch: epoch.max(0) as u64,
            value,
        }))
    }

    // --- Semaphores. ---

    pub(super) async fn permits_try(
        &self,
        name: &str,
        owner: &str,
        max: u32,
        permits: u32,
        ttl: Duration,
    ) -> Result<Acquired, LockError> {
        let (Ok(max), Ok(permits)) = (i32::try_from(max), i32::try_from(permits)) else {
            return Err(LockError::Config(format!(
                "`{name}`: a semaphore's max is at most {} on PostgreSQL",
                i32::MAX
            )));
        };
        let ttl_us = micros(ttl);
        self.tx_try(&self.prims().sql.sem, name, owner, max, |st| match st {
            Some(st) => sem_acquire(st, name, owner, max, permits, ttl_us),
            None => Err(LockError::backend(name, "the semaphore row was not locked")),
        })
        .await
    }

    async fn permits_give_back(&self, name: &str, owner: &str) -> Result<Released, LockError> {
        self.tx_give_back(
            &self.prims().sql.sem,
            name,
            owner,
            Released::NotOwner,
            |st| sem_release(st, name, owner),
        )
        .await
    }

    pub(super) async fn permits_release(
        &self,
        name: &str,
        owner: &str,
    ) -> Result<Released, LockError> {
        let r = self.permits_give_back(name, owner).await;
        if matches!(r, Err(LockError::Backend { .. })) {
            self.resend_give_back(name, owner, None);
        }
        r
    }

    pub(super) async fn permits_extend(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Extended, LockError> {
        let ttl_us = micros(ttl);
        self.tx_pool(
            &self.prims().sql.sem,
            name,
            "the extend transaction",
            |st| renew(st, owner, "p", ttl_us),
        )
        .await
    }

    pub(super) async fn permits_watch(&self, name: &str) -> Result<Watch, LockError> {
        let mut w = self.prims().sem_waiters.register(name);
        if !self.ensure_listening().await {
            w.set_fallback_only();
        }
        Ok(w)
    }

    // --- Read-write locks. ---

    pub(super) async fn rw_try(
        &self,
        side: RwSide,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Acquired, LockError> {
        let ttl_us = micros(ttl);
        // No wake-up of this process's waiting readers on a read grant: a reader never queues
        // behind local waiters without trying (`rwlock.rs`'s read adapter), so none sleeps
        // while the read side is open.
        self.tx_try(&self.prims().sql.rw, name, owner, 0, |st| match st {
            Some(st) => rw_acquire(st, side, owner, ttl_us),
            None => Err(LockError::backend(
                name,
                "the read-write row was not locked",
            )),
        })
        .await
    }

    async fn rw_give_back(
        &self,
        side: RwSide,
        name: &str,
        owner: &str,
        all: bool,
    ) -> Result<Released, LockError> {
        self.tx_give_back(
            &self.prims().sql.rw,
            name,
            owner,
            Released::NotOwner,
            |st| rw_release(st, side, name, owner, all),
        )
        .await
    }

    pub(super) async fn rw_release_call(
        &self,
        side: RwSide,
        name: &str,
        owner: &str,
        all: bool,
    ) -> Result<Released, LockError> {
        let r = self.rw_give_back(side, name, owner, all).await;
        // Only a release of every hold is idempotent (a decrement re-sent could decrement twice).
        if all && matches!(r, Err(LockError::Backend { .. })) {
            self.resend_give_back(name, owner, Some(side));
        }
        r
    }

    pub(super) async fn rw_extend_call(
        &self,
        side: RwSide,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Extended, LockError> {
        let ttl_us = micros(ttl);
        self.tx_pool(&self.prims().sql.rw, name, "the extend transaction", |st| {
            renew(st, owner, side_str(side), ttl_us)
        })
        .await
    }

    pub(super) async fn rw_downgrade_call(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Option<u64>, LockError> {
        let ttl_us = micros(ttl);
        self.tx_pool(
            &self.prims().sql.rw,
            name,
            "the downgrade transaction",
            |st| rw_downgrade(st, name, owner, ttl_us),
        )
        .await
    }

    pub(super) async fn rw_watch_call(&self, side: RwSide, name: &str) -> Result<Watch, LockError> {
        let q = match side {
            RwSide::Read => &self.prims().readers,
            RwSide::Write => &self.prims().writers,
        };
        let mut w = q.register(name);
        if !self.ensure_listening().await {
            w.set_fallback_only();
        }
        Ok(w)
    }

    pub(super) fn rw_waiting(&self, side: RwSide, name: &str) -> bool {
        match side {
            RwSide::Read => self.prims().readers.has_waiters(name),
            RwSide::Write => self.prims().writers.has_waiters(name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(holds: &[(&str, &str, i32, i64, i64)]) -> State {
        State {
            max: 3,
            fence: 10,
            us: 5,
            holds: holds
                .iter()
                .map(|(o, s, c, f, r)| Hold {
                    owner: o.to_string(),
                    side: s.to_string(),
                    count: *c,
                    fence: *f,
                    rem_us: *r,
                })
                .collect(),
        }
    }

    #[test]
    fn permits_count_refuse_another_max_and_mint_above_the_counter() {
        let s = st(&[("a", "p", 2, 9, 1000)]);
        let (ops, r) = sem_acquire(&s, "x", "b", 3, 1, 50).unwrap();
        assert_eq!(
            r,
            Acquired::Granted {
                token: 11,
                count: 1
            }
        );
        assert_eq!(ops.len(), 2);
        let (ops, r) = sem_acquire(&s, "x", "b", 3, 2, 50).unwrap();
        assert!(ops.is_empty());
        assert_eq!(
            r,
            Acquired::Busy {
                remaining: Some(Duration::from_micros(1000))
            }
        );
        assert!(matches!(
            sem_acquire(&s, "x", "b", 4, 1, 50),
            Err(LockError::SemaphoreMax {
                asked: 4,
                stored: 3,
                ..
            })
        ));
        // No live holder: the grant sets the max.
        assert!(matches!(
            sem_acquire(&st(&[]), "x", "b", 4, 4, 50),
            Ok((_, Acquired::Granted { .. }))
        ));
        let (ops, r) = sem_release(Some(&s), "x", "a").unwrap();
        assert_eq!(r, Released::Freed);
        assert!(ops.contains(&Op::Notify("s2:78".into())));
        assert_eq!(
            sem_release(Some(&s), "x", "b").unwrap().1,
            Released::NotOwner
        );
    }

    #[test]
    fn rw_rules_follow_the_memory_backend() {
        // A reader holds: another reader goes in, a writer waits and sets its marker.
        let s = st(&[("r1", "r", 1, 9, 1000)]);
        assert!(matches!(
            rw_acquire(&s, RwSide::Read, "r2", 50).unwrap().1,
            Acquired::Granted { token: 11, .. }
        ));
        let (ops, r) = rw_acquire(&s, RwSide::Write, "w", 50).unwrap();
        assert!(matches!(r, Acquired::Busy { .. }));
        assert!(matches!(&ops[..], [Op::Upsert { side: "q", .. }]));
        // The marker keeps new readers out, not the marker's owner's own re-entry.
        let s = st(&[("r1", "r", 1, 9, 1000), ("w", "q", 0, 0, 900)]);
        assert!(matches!(
            rw_acquire(&s, RwSide::Read, "r2", 50).unwrap().1,
            Acquired::Busy { .. }
        ));
        assert!(matches!(
            rw_acquire(&s, RwSide::Read, "r1", 50).unwrap().1,
            Acquired::Granted { token: 9, count: 2 }
        ));
        // The last reader's release wakes the marked writer.
        let (ops, _) = rw_release(Some(&s), RwSide::Read, "x", "r1", true).unwrap();
        assert!(ops.contains(&Op::Notify(format!("w:78:{}", hex("w")))));
        // A writer that stops waiting clears its marker and wakes readers.
        let (ops, r) = rw_release(Some(&s), RwSide::Write, "x", "w", true).unwrap();
        assert_eq!(r, Released::NotOwner);
        assert!(ops.contains(&Op::Notify("r:78".into())));
        // Downgrade: a new token, a read hold.
        let s = st(&[("w", "w", 1, 9, 1000)]);
        let (_, t) = rw_downgrade(Some(&s), "x", "w", 50).unwrap();
        assert_eq!(t, Some(11));
        assert_eq!(rw_downgrade(Some(&s), "x", "v", 50).unwrap().1, None);
    }
}
