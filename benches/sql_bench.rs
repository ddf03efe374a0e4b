//! `cargo bench --bench sql_bench --features postgres,mysql`: the database backends against
//! floors measured in the same run, on the machine's PostgreSQL (`DLOCK_PG_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`) and MariaDB/MySQL (`DLOCK_MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`), each in a table of its own dropped at the end.
//!
//! * S1 uncontended: 1 task, 1 name, acquire + release pairs through the `Backend` trait,
//!   against a floor of the same number of pairs of single-row round trips on the same pool
//!   (an `INSERT` and a `DELETE` by primary key, sent the way the backend sends its statements:
//!   `query_typed` on PostgreSQL, text queries on MySQL). Interleaved rounds; ratio = lock
//!   pairs/s ÷ floor pairs/s (target ≥ 0.8).
//! * S2 hand-off: 16 workers, each with a backend of its own (as 16 processes would have), on
//!   one name; each acquires (wait 30 s), holds ~1 ms, releases. Hand-off = next grant − previous
//!   release. p50/p99 for PostgreSQL (LISTEN/NOTIFY) and MySQL (polling 100–250 ms).
//!   PostgreSQL runs six builder variants: the default, `synchronous_commit(false)`,
//!   `prepared_statements(true)` with and without it, and `server_functions(true)` with and
//!   without it (`DLOCK_BENCH_PG_VARIANTS=postgres,pg-prep,pg-fn` narrows them), and one durable
//!   single-row commit as the hand-off's floor. `DLOCK_PG_URL` may name a private server (for
//!   example one whose data directory is on tmpfs, to see the hand-off without the disk).
//!
//! `DLOCK_BENCH_ROUNDS` (default 5) rounds of `DLOCK_BENCH_PAIRS` (default 500) pairs for S1.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock::{Backend, Lock};

const TTL: Duration = Duration::from_secs(30);

fn env_num(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn pct(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn table(tag: &str) -> String {
    format!("dlock_bench_{tag}_{}", std::process::id())
}

async fn lock_pairs(b: &dyn Backend, n: usize) -> Duration {
    let t = Instant::now();
    for _ in 0..n {
        let r = b.try_acquire("bench", "owner-1", TTL).await.unwrap();
        assert!(
            matches!(r, dlock::backend::Acquired::Granted { .. }),
            "{r:?}"
        );
        let r = b.release("bench", "owner-1", None, true).await.unwrap();
        assert_eq!(r, dlock::backend::Released::Freed);
    }
    t.elapsed()
}

/// Runs S1 for one engine: `floor(n)` does n insert+delete pairs on the backend's pool.
async fn s1<F, Fut>(engine: &str, b: &dyn Backend, mut floor: F) -> (f64, f64)
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Duration>,
{
    let rounds = env_num("DLOCK_BENCH_ROUNDS", 5);
    let n = env_num("DLOCK_BENCH_PAIRS", 500);
    // Warm-up: connections, statement caches, the first-use row.
    lock_pairs(b, 50).await;
    floor(50).await;
    let (mut lt, mut ft) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..rounds {
        lt += lock_pairs(b, n).await;
        ft += floor(n).await;
    }
    let total = (rounds * n) as f64;
    let (l, f) = (total / lt.as_secs_f64(), total / ft.as_secs_f64());
    println!(
        "S1 {engine:<9} lock pairs/s {l:>8.0}   floor pairs/s {f:>8.0}   ratio {:.2}",
        l / f
    );
    (l, f)
}

/// A backend that counts its acquire attempts (statements sent), for the S2 workers'
/// attempts per hand-off.
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn Backend>,
    tries: Arc<std::sync::atomic::AtomicU64>,
}

impl Backend for Counting {
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> dlock::backend::BoxFuture<'a, Result<dlock::backend::Acquired, dlock::LockError>> {
        self.tries
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.try_acquire(name, owner, ttl)
    }
    fn release<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        keep_for: Option<Duration>,
        all: bool,
    ) -> dlock::backend::BoxFuture<'a, Result<dlock::backend::Released, dlock::LockError>> {
        self.inner.release(name, owner, keep_for, all)
    }
    fn extend<'a>(
        &'a self,
        name: &'a str,
        owner: &'a str,
        ttl: Duration,
    ) -> dlock::backend::BoxFuture<'a, Result<dlock::backend::Extended, dlock::LockError>> {
        self.inner.extend(name, owner, ttl)
    }
    fn watch<'a>(
        &'a self,
        name: &'a str,
    ) -> dlock::backend::BoxFuture<'a, Result<dlock::backend::Watch, dlock::LockError>> {
        self.inner.watch(name)
    }
    fn has_waiters(&self, name: &str) -> bool {
        self.inner.has_waiters(name)
    }
}

/// What S2 measured: hand-off latencies (next grant − previous holder's decision to release),
/// split into the release call (decision → release returned) and release returned → next grant.
struct Handoffs {
    total: Vec<Duration>,
    release: Vec<Duration>,
    wake: Vec<Duration>,
}

/// S2: 16 workers, each on its own backend, on one name; returns sorted hand-off latencies.
async fn s2(backends: Vec<Arc<dyn Backend>>, handoffs: usize, limit: Duration) -> Handoffs {
    // (decision to release, release returned) of the last holder.
    type Last = Option<(Instant, Option<Instant>)>;
    // (hand-off, release returned -> grant when the release returned first)
    type Sample = (Duration, Option<Duration>);
    let last_release: Arc<Mutex<Last>> = Arc::new(Mutex::new(None));
    let samples: Arc<Mutex<Vec<Sample>>> = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for b in backends {
        let (last_release, samples) = (last_release.clone(), samples.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                if samples.lock().unwrap().len() >= handoffs || start.elapsed() > limit {
                    return;
                }
                let Ok(g) = Lock::new("handoff")
                    .with_backend(b.clone())
                    .ttl(TTL)
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
                else {
                    continue;
                };
                let now = Instant::now();
                if let Some((decided, returned)) = last_release.lock().unwrap().take() {
                    samples.lock().unwrap().push((
                        now - decided,
                        returned.map(|r| now.saturating_duration_since(r)),
                    ));
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
                let decided = Instant::now();
                *last_release.lock().unwrap() = Some((decided, None));
                g.release().await.unwrap();
                let returned = Instant::now();
                if let Some((d, r)) = last_release.lock().unwrap().as_mut()
                    && *d == decided
                {
                    *r = Some(returned);
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let v = samples.lock().unwrap().clone();
    let mut total: Vec<Duration> = v.iter().map(|s| s.0).collect();
    // Only the hand-offs whose release returned before the next grant split cleanly.
    let mut release: Vec<Duration> = v
        .iter()
        .filter_map(|s| s.1.map(|w| s.0.saturating_sub(w)))
        .collect();
    let mut wake: Vec<Duration> = v.iter().filter_map(|s| s.1).collect();
    total.sort();
    release.sort();
    wake.sort();
    Handoffs {
        total,
        release,
        wake,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn report(engine: &str, h: &Handoffs) -> (Duration, Duration) {
    let (p50, p99) = (pct(&h.total, 0.5), pct(&h.total, 0.99));
    println!(
        "S2 {engine:<14} hand-offs {:>5}   p50 {:>8.2} ms   p99 {:>8.2} ms   \
         (release call p50 {:.2} p99 {:.2} ms; release returned -> grant p50 {:.2} p99 {:.2} ms, {} split)",
        h.total.len(),
        ms(p50),
        ms(p99),
        ms(pct(&h.release, 0.5)),
        ms(pct(&h.release, 0.99)),
        ms(pct(&h.wake, 0.5)),
        ms(pct(&h.wake, 0.99)),
        h.wake.len(),
    );
    (p50, p99)
}

/// The hand-off's physical floor on PostgreSQL: one durable single-row commit (an `UPDATE` by
/// primary key, autocommit), p50/p99 over 200 sequential ones on the bench's pool.
#[cfg(feature = "postgres")]
async fn commit_floor(pool: &dlock::deadpool_postgres::Pool, t: &str) -> (Duration, Duration) {
    use dlock::tokio_postgres::types::Type;
    let c = pool.get().await.unwrap();
    c.batch_execute(&format!(
        "INSERT INTO {t}_floor (name, owner) VALUES ('\\x6669', 'x') ON CONFLICT DO NOTHING"
    ))
    .await
    .unwrap();
    let upd = format!("UPDATE {t}_floor SET owner = $2 WHERE name = $1");
    let mut v = Vec::new();
    for i in 0..200u32 {
        let name: &[u8] = b"fi";
        let owner = i.to_string();
        let t0 = Instant::now();
        c.query_typed(&upd, &[(&name, Type::BYTEA), (&owner, Type::TEXT)])
            .await
            .unwrap();
        v.push(t0.elapsed());
    }
    v.sort();
    let (p50, p99) = (pct(&v, 0.5), pct(&v, 0.99));
    println!(
        "S2 postgres one durable commit (same run)   p50 {:>8.2} ms   p99 {:>8.2} ms",
        ms(p50),
        ms(p99)
    );
    (p50, p99)
}

fn wanted(engine: &str) -> bool {
    std::env::var("DLOCK_BENCH_ENGINES").map_or(true, |v| v.split(',').any(|e| e == engine))
}

/// `DLOCK_BENCH_PG_VARIANTS=postgres,pg-prep` narrows the PostgreSQL S2 variants.
fn variant_wanted(label: &str) -> bool {
    std::env::var("DLOCK_BENCH_PG_VARIANTS").map_or(true, |v| v.split(',').any(|e| e == label))
}

fn s1_wanted() -> bool {
    std::env::var("DLOCK_BENCH_SKIP_S1").is_err()
}

#[cfg(feature = "postgres")]
async fn postgres() -> Option<(f64, Duration, Duration)> {
    use dlock::PostgresBackend;
    use dlock::tokio_postgres::types::Type;
    let url = std::env::var("DLOCK_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string());
    if !wanted("postgres") {
        return None;
    }
    let t = table("pg");
    let b = PostgresBackend::builder(&url)
        .table(&t)
        .connect()
        .await
        .ok()?;
    let pool = b.pool().clone();
    let c = pool.get().await.unwrap();
    c.batch_execute(&format!(
        "CREATE TABLE IF NOT EXISTS {t}_floor (name bytea PRIMARY KEY, owner text)"
    ))
    .await
    .unwrap();
    drop(c);
    let ins = format!("INSERT INTO {t}_floor (name, owner) VALUES ($1, $2)");
    let del = format!("DELETE FROM {t}_floor WHERE name = $1");
    let (l, f) = if !s1_wanted() {
        (f64::NAN, f64::NAN)
    } else {
        s1("postgres", &b, |n| {
            let (pool, ins, del) = (pool.clone(), ins.clone(), del.clone());
            async move {
                let t0 = Instant::now();
                for _ in 0..n {
                    let name: &[u8] = b"bench";
                    let c = pool.get().await.unwrap();
                    c.query_typed(&ins, &[(&name, Type::BYTEA), (&"owner-1", Type::TEXT)])
                        .await
                        .unwrap();
                    drop(c);
                    let c = pool.get().await.unwrap();
                    c.query_typed(&del, &[(&name, Type::BYTEA)]).await.unwrap();
                }
                t0.elapsed()
            }
        })
        .await
    };
    // S2 per builder variant, in this order: the default; `synchronous_commit(false)` (grants
    // and renewals do not wait for the disk either: an opt-in with a documented cost); and the
    // same two with `prepared_statements(true)` (statements planned once per connection: an
    // opt-in, not behind a transaction-mode pooler) and with `server_functions(true)` (planned
    // once per server session inside PL/pgSQL functions: an opt-in that works behind poolers).
    let mut first = None;
    for (label, sync, prepared, functions) in [
        ("postgres", true, false, false),
        ("pg-nosync", false, false, false),
        ("pg-prep", true, true, false),
        ("pg-prep-nosync", false, true, false),
        ("pg-fn", true, false, true),
        ("pg-fn-nosync", false, false, true),
    ] {
        if !variant_wanted(label) {
            continue;
        }
        let mut bs: Vec<Arc<dyn Backend>> = Vec::new();
        for _ in 0..16 {
            bs.push(Arc::new(
                PostgresBackend::builder(&url)
                    .table(&t)
                    .pool_size(2)
                    .synchronous_commit(sync)
                    .prepared_statements(prepared)
                    .server_functions(functions)
                    .connect()
                    .await
                    .unwrap(),
            ));
        }
        let tries = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let bs: Vec<Arc<dyn Backend>> = bs
            .into_iter()
            .map(|inner| {
                Arc::new(Counting {
                    inner,
                    tries: tries.clone(),
                }) as Arc<dyn Backend>
            })
            .collect();
        let v = s2(bs, 800, Duration::from_secs(60)).await;
        let r = report(label, &v);
        println!(
            "S2 {label:<14} acquire attempts {} = {:.2} per hand-off",
            tries.load(std::sync::atomic::Ordering::Relaxed),
            tries.load(std::sync::atomic::Ordering::Relaxed) as f64 / v.total.len().max(1) as f64
        );
        first.get_or_insert(r);
    }
    let (p50, p99) = first.unwrap_or_default();
    commit_floor(&pool, &t).await;
    let c = pool.get().await.unwrap();
    let _ = c
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {t}; DROP SEQUENCE IF EXISTS {t}_fence; DROP TABLE IF EXISTS {t}_floor; \
             DROP TABLE IF EXISTS {t}_waiters; \
             DROP FUNCTION IF EXISTS {t}_acquire_v1, {t}_acquire_nf_v1, {t}_release_v1, {t}_extend_v1, {t}_extend_nf_v1, \
             {t}_acquire_v2, {t}_acquire_nf_v2, {t}_release_v2, {t}_leave_v2;"
        ))
        .await;
    Some((l / f, p50, p99))
}

#[cfg(feature = "mysql")]
async fn mysql() -> Option<(f64, Duration, Duration)> {
    use dlock::MysqlBackend;
    use dlock::mysql_async::prelude::Queryable;
    let url = std::env::var("DLOCK_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_string());
    if !wanted("mysql") {
        return None;
    }
    let t = table("my");
    let b = MysqlBackend::builder(&url).table(&t).connect().await.ok()?;
    let pool = b.pool().ok()?;
    let mut c = pool.get_conn().await.unwrap();
    c.query_drop(format!(
        "CREATE TABLE IF NOT EXISTS {t}_floor (name VARBINARY(1024) PRIMARY KEY, owner VARBINARY(255)) ENGINE=InnoDB"
    ))
    .await
    .unwrap();
    drop(c);
    // 'bench' and 'owner-1' as hex literals, as the backend sends names and owners.
    let ins =
        format!("INSERT INTO {t}_floor (name, owner) VALUES (X'62656e6368', X'6f776e65722d31')");
    let del = format!("DELETE FROM {t}_floor WHERE name = X'62656e6368'");
    let (l, f) = if !s1_wanted() {
        (f64::NAN, f64::NAN)
    } else {
        s1("mysql", &b, |n| {
            let (pool, ins, del) = (pool.clone(), ins.clone(), del.clone());
            async move {
                let t0 = Instant::now();
                for _ in 0..n {
                    let mut c = pool.get_conn().await.unwrap();
                    c.query_drop(&ins).await.unwrap();
                    drop(c);
                    let mut c = pool.get_conn().await.unwrap();
                    c.query_drop(&del).await.unwrap();
                }
                t0.elapsed()
            }
        })
        .await
    };
    let mut bs: Vec<Arc<dyn Backend>> = Vec::new();
    for _ in 0..16 {
        bs.push(Arc::new(
            MysqlBackend::builder(&url)
                .table(&t)
                .pool_size(2)
                .connect()
                .await
                .unwrap(),
        ));
    }
    let v = s2(bs, 150, Duration::from_secs(60)).await;
    let (p50, p99) = report("mysql", &v);
    let mut c = pool.get_conn().await.unwrap();
    let _ = c
        .query_drop(format!("DROP TABLE IF EXISTS {t}, {t}_floor"))
        .await;
    Some((l / f, p50, p99))
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        #[cfg(feature = "postgres")]
        let pg = postgres().await;
        #[cfg(not(feature = "postgres"))]
        let pg: Option<(f64, Duration, Duration)> = None;
        #[cfg(feature = "mysql")]
        let my = mysql().await;
        #[cfg(not(feature = "mysql"))]
        let my: Option<(f64, Duration, Duration)> = None;
        if pg.is_none() && my.is_none() {
            println!("sql_bench: no database reachable (or features postgres/mysql off); nothing measured");
        }
        if let (Some(pg), Some(my)) = (pg, my) {
            println!(
                "S2 ratio  mysql/postgres   p50 {:.1}x   p99 {:.1}x",
                my.1.as_secs_f64() / pg.1.as_secs_f64().max(1e-9),
                my.2.as_secs_f64() / pg.2.as_secs_f64().max(1e-9)
            );
        }
    });
}
