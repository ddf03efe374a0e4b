//! The holder identity: who holds a lock, in words an operator can act on (host, pid and a name
//! the application chooses), stored beside the opaque owner id on every engine and shown by
//! `dlock list` / `dlock show` ([`crate::admin::Holder::identity`]).
//!
//! One identity per process: [`set_holder_name`] (or `DLOCK_HOLDER_NAME`, else the binary's
//! name), the host name and the pid. It is written as `name@host:pid` (e.g.
//! `billing-worker@web-3:4242`), short (the name is capped at [`MAX_NAME_CHARS`] characters, the
//! host at 64) and without control characters. Anyone who can read the lock store reads it:
//! never put a secret in the name.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// The environment variable read (once, at the first lock) for the holder name when
/// [`set_holder_name`] was not called.
pub const HOLDER_NAME_ENV: &str = "DLOCK_HOLDER_NAME";

/// The longest holder name kept, in characters (a longer one is cut).
pub const MAX_NAME_CHARS: usize = 48;

/// The longest host name kept, in characters.
const MAX_HOST_CHARS: usize = 64;

/// Who holds a lock: the application's name for the process, its host and its pid.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct HolderId {
    /// The name the application chose ([`set_holder_name`], `DLOCK_HOLDER_NAME`), else the
    /// binary's name.
    pub name: String,
    /// The host name (`gethostname`).
    pub host: String,
    /// The process id.
    pub pid: u32,
}

impl HolderId {
    /// An identity from its parts, cleaned as every stored identity is (control characters
    /// removed, lengths capped; the host keeps only letters, digits, `.`, `-` and `_`).
    pub fn new(name: &str, host: &str, pid: u32) -> HolderId {
        HolderId {
            name: clean_name(name),
            host: clean_host(host),
            pid,
        }
    }

    /// Parses the stored form `name@host:pid`; `None` for anything else (a foreign or
    /// truncated value).
    pub fn parse(s: &str) -> Option<HolderId> {
        let (rest, pid) = s.rsplit_once(':')?;
        let pid = pid.parse().ok()?;
        let (name, host) = rest.rsplit_once('@')?;
        (!host.is_empty()).then(|| HolderId {
            name: name.to_string(),
            host: host.to_string(),
            pid,
        })
    }
}

impl fmt::Display for HolderId {
    /// `name@host:pid`, the stored form.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}:{}", self.name, self.host, self.pid)
    }
}

/// The name without control characters (and without leading or trailing spaces), at most
/// [`MAX_NAME_CHARS`] characters.
fn clean_name(name: &str) -> String {
    name.chars()
        .filter(|c| !c.is_control())
        .collect::<String>()
        .trim()
        .chars()
        .take(MAX_NAME_CHARS)
        .collect()
}

/// The host name with every character other than ASCII letters, digits, `.`, `-` and `_` as
/// `_` (so `@` and `:` never occur in it), at most 64 characters.
fn clean_host(host: &str) -> String {
    host.chars()
        .filter(|c| !c.is_control())
        .take(MAX_HOST_CHARS)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The name set by [`set_holder_name`].
static NAME: RwLock<Option<String>> = RwLock::new(None);

/// Bumped by [`set_holder_name`]: backends that wrote the identity once per process write it
/// again (see [`Registration`]).
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Sets the holder name this process shows beside its locks (`dlock list`, `dlock show`, the
/// admin API), e.g. `dlock::set_holder_name("billing-worker")`; call it before the first lock.
/// Control characters are removed and the name is cut to [`MAX_NAME_CHARS`] characters; an
/// empty name goes back to the default (`DLOCK_HOLDER_NAME`, else the binary's name). Anyone
/// who can read the lock store sees it: never put a secret in it.
///
/// Holds taken before the call keep the identity they were taken with on the lock tables,
/// ZooKeeper and etcd; on Redis the process's identity key is rewritten at the next call.
pub fn set_holder_name(name: impl Into<String>) {
    let name = clean_name(&name.into());
    let name = (!name.is_empty()).then_some(name);
    let mut set = NAME.write().unwrap_or_else(|e| e.into_inner());
    if *set != name {
        *set = name;
        GENERATION.fetch_add(1, Ordering::Relaxed);
    }
}

/// This process's holder identity, as the backends store it.
pub fn holder_identity() -> HolderId {
    let set = NAME.read().unwrap_or_else(|e| e.into_inner()).clone();
    let name = set
        .or_else(|| {
            static FROM_ENV: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
            FROM_ENV
                .get_or_init(|| {
                    std::env::var(HOLDER_NAME_ENV)
                        .ok()
                        .map(|n| clean_name(&n))
                        .filter(|n| !n.is_empty())
                })
                .clone()
        })
        .unwrap_or_else(binary_name);
    HolderId {
        name,
        host: host_name(),
        pid: std::process::id(),
    }
}

/// [`holder_identity`] in its stored form, `name@host:pid`; computed again only after
/// [`set_holder_name`] or in a forked child (a new pid), so a backend may call it per grant.
pub(crate) fn holder_text() -> Arc<str> {
    static CACHE: RwLock<Option<(u64, u32, Arc<str>)>> = RwLock::new(None);
    let generation = GENERATION.load(Ordering::Relaxed);
    let pid = std::process::id();
    if let Some((g, p, t)) = CACHE.read().unwrap_or_else(|e| e.into_inner()).as_ref()
        && *g == generation
        && *p == pid
    {
        return t.clone();
    }
    let t: Arc<str> = holder_identity().to_string().into();
    *CACHE.write().unwrap_or_else(|e| e.into_inner()) = Some((generation, pid, t.clone()));
    t
}

/// The prefix of [`application_name`].
pub(crate) const APPLICATION_NAME_PREFIX: &str = "dlock ";

/// `dlock name@host:pid` for PostgreSQL's `application_name` (what `pg_stat_activity` shows,
/// and how the admin names an advisory lock's holder): printable ASCII only (others as `?`,
/// which PostgreSQL would otherwise escape) and at most 63 bytes (the server's limit), the name
/// cut to fit.
pub(crate) fn application_name() -> String {
    let id = holder_identity_cached();
    let ascii = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if c.is_ascii() && !c.is_ascii_control() {
                    c
                } else {
                    '?'
                }
            })
            .collect()
    };
    let tail = format!("@{}:{}", ascii(&id.host), id.pid);
    let room = 63usize.saturating_sub(APPLICATION_NAME_PREFIX.len() + tail.len());
    let name: String = ascii(&id.name).chars().take(room).collect();
    let mut s = format!("{APPLICATION_NAME_PREFIX}{name}{tail}");
    s.truncate(63);
    s
}

/// [`holder_identity`] from the cache of [`holder_text`].
fn holder_identity_cached() -> HolderId {
    HolderId::parse(&holder_text()).unwrap_or_else(holder_identity)
}

/// The binary's file name without extension (`"dlock"` when unknown).
fn binary_name() -> String {
    let exe = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .or_else(|| {
            std::env::args_os().next().and_then(|a| {
                std::path::Path::new(&a)
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
            })
        })
        .map(|n| clean_name(&n))
        .unwrap_or_default();
    if exe.is_empty() { "dlock".into() } else { exe }
}

/// The host name (`gethostname`), cleaned; read once.
fn host_name() -> String {
    static HOST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HOST.get_or_init(|| {
        let raw = raw_host_name().unwrap_or_default();
        let h = clean_host(&raw);
        if h.is_empty() { "unknown".into() } else { h }
    })
    .clone()
}

#[cfg(unix)]
fn raw_host_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at most that many bytes.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

#[cfg(not(unix))]
fn raw_host_name() -> Option<String> {
    std::env::var("COMPUTERNAME").ok()
}

/// The owner-id prefix of `owner` (the per-process random part before the `:`): the key under
/// which engines that store the identity once per process (Redis) find it.
pub(crate) fn process_of(owner: &str) -> &str {
    owner.split_once(':').map_or(owner, |(p, _)| p)
}

/// When a backend that stores the identity once per process (Redis: a key with a long expiry)
/// must write it again: at the first call, after [`Registration::REFRESH`], after
/// [`set_holder_name`], and for a new owner prefix (a forked child). Checking costs two atomic
/// loads and a clock read; a write is due at most once per refresh period per backend.
#[derive(Debug)]
pub(crate) struct Registration {
    base: std::time::Instant,
    /// Milliseconds since `base` at which the next write is due (0: now).
    due_ms: AtomicU64,
    /// The [`GENERATION`] the last write had.
    generation: AtomicU64,
    /// The owner prefix the last write was for.
    prefix: RwLock<Option<Arc<str>>>,
}

impl Default for Registration {
    fn default() -> Self {
        Registration {
            base: std::time::Instant::now(),
            due_ms: AtomicU64::new(0),
            generation: AtomicU64::new(u64::MAX),
            prefix: RwLock::new(None),
        }
    }
}

impl Registration {
    /// How long the stored identity lives (Redis `EX`).
    pub(crate) const TTL: std::time::Duration = std::time::Duration::from_secs(3600);
    /// How often it is written again while the process takes or renews locks.
    pub(crate) const REFRESH: std::time::Duration = std::time::Duration::from_secs(1200);

    /// Whether the identity of `owner`'s process must be written now; when it is, the next
    /// write is scheduled as if this one succeeded (a failed write is tried again after
    /// [`Registration::RETRY`], by [`Registration::failed`]).
    pub(crate) fn due(&self, owner: &str) -> bool {
        let now = self.base.elapsed().as_millis() as u64;
        let generation = GENERATION.load(Ordering::Relaxed);
        let prefix = process_of(owner);
        if now < self.due_ms.load(Ordering::Relaxed)
            && self.generation.load(Ordering::Relaxed) == generation
            && self
                .prefix
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .as_deref()
                == Some(prefix)
        {
            return false;
        }
        let mut p = self.prefix.write().unwrap_or_else(|e| e.into_inner());
        // Another caller may have claimed it in between.
        if now < self.due_ms.load(Ordering::Relaxed)
            && self.generation.load(Ordering::Relaxed) == generation
            && p.as_deref() == Some(prefix)
        {
            return false;
        }
        *p = Some(prefix.into());
        self.generation.store(generation, Ordering::Relaxed);
        self.due_ms
            .store(now + Self::REFRESH.as_millis() as u64, Ordering::Relaxed);
        true
    }

    /// A write that [`Registration::due`] asked for failed: try again after 10 s.
    pub(crate) fn failed(&self) {
        let now = self.base.elapsed().as_millis() as u64;
        self.due_ms.store(now + 10_000, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_stripped_and_lengths_capped() {
        let id = HolderId::new("  bill\u{1b}[31ming\n-worker\u{7}  ", "web 3\n@x:y", 42);
        assert_eq!(id.name, "bill[31ming-worker");
        assert_eq!(id.host, "web_3_x_y");
        assert_eq!(id.to_string(), "bill[31ming-worker@web_3_x_y:42");
        assert_eq!(HolderId::parse(&id.to_string()), Some(id));
        let long = "n".repeat(500);
        assert_eq!(HolderId::new(&long, &long, 1).name.len(), MAX_NAME_CHARS);
        assert_eq!(HolderId::new(&long, &long, 1).host.len(), 64);
    }

    #[test]
    fn parse_takes_the_last_at_and_colon() {
        let id = HolderId::parse("a@b:c@host-1.example:4242").unwrap();
        assert_eq!(
            (id.name.as_str(), id.host.as_str(), id.pid),
            ("a@b:c", "host-1.example", 4242)
        );
        assert_eq!(HolderId::parse("no-pid@host"), None);
        assert_eq!(HolderId::parse("nohost:12"), None);
        assert_eq!(HolderId::parse("x@:12"), None);
    }

    #[test]
    fn application_name_fits_postgres() {
        let a = application_name();
        assert!(
            a.starts_with(APPLICATION_NAME_PREFIX) && a.len() <= 63,
            "{a}"
        );
        assert!(a.bytes().all(|b| (0x20..0x7f).contains(&b)), "{a}");
        let id = HolderId::parse(&a[APPLICATION_NAME_PREFIX.len()..]).unwrap();
        assert_eq!(id.pid, std::process::id());
    }

    #[test]
    fn the_identity_has_this_process_and_host() {
        let id = holder_identity();
        assert_eq!(id.pid, std::process::id());
        assert!(!id.host.is_empty());
        assert!(!id.name.is_empty());
    }

    #[test]
    fn registration_is_due_once_per_period_and_per_prefix() {
        let r = Registration::default();
        assert!(r.due("aaaa:1"));
        assert!(!r.due("aaaa:2"));
        assert!(r.due("bbbb:3"), "a new process prefix (fork) writes again");
        assert!(!r.due("bbbb:4"));
        r.failed();
        assert!(!r.due("bbbb:5"), "a failed write waits before the next");
    }
}
