//! The one URL redactor: every engine, the registry, `Debug`, errors, logs and the CLI print a
//! connection URL only through [`redact_url`].
//!
//! The URL is parsed with the `url` crate (WHATWG rules, as most drivers read it). Then:
//! * a URL that does not parse, or that has no `scheme://` (a forgotten scheme, such as
//!   `ops:s3cret@host:6379`, parses as a scheme `ops` and an opaque path), prints only
//!   `<scheme>://<unparsable>`, or [`UNPARSABLE`] when there is no scheme at all. Nothing after
//!   the scheme is echoed: a base64 password with a raw `/` makes the rest unparsable, and
//!   guessing where the password ends is how passwords leaked before;
//! * the password of the userinfo becomes `***` (the user name is kept);
//! * every query parameter whose name (percent-decoded, case-insensitive) names a secret
//!   (see [`is_secret_param`]) keeps its name and gets the value `***`; a fragment becomes `***`.

/// What is printed for a URL without a recognisable `scheme://`.
pub(crate) const UNPARSABLE: &str = "<unparsable url>";

/// What replaces a secret.
const MASK: &str = "***";

/// Whether a query parameter named `name` (already percent-decoded) carries a secret:
/// `pass`, `pwd`, `auth`, or any name containing `password`, `passwd`, `secret`, `token`,
/// `apikey`, `api_key`, `api-key` or `credential`, ignoring case.
pub(crate) fn is_secret_param(name: &str) -> bool {
    let n = name.trim().to_ascii_lowercase();
    matches!(n.as_str(), "pass" | "pwd" | "auth" | "authorization")
        || [
            "password",
            "passwd",
            "secret",
            "token",
            "apikey",
            "api_key",
            "api-key",
            "credential",
        ]
        .iter()
        .any(|s| n.contains(s))
}

/// The scheme of `url` when it starts with `scheme://` and the scheme is well formed
/// (a letter, then letters, digits, `+`, `-`, `.`).
fn scheme_of(url: &str) -> Option<&str> {
    let (scheme, _) = url.split_once("://")?;
    let mut chars = scheme.chars();
    let first = chars.next()?;
    (first.is_ascii_alphabetic()
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
    .then_some(scheme)
}

/// `url` with every secret replaced by `***` (see the module documentation).
pub(crate) fn redact_url(url: &str) -> String {
    let url = url.trim();
    let Some(scheme) = scheme_of(url) else {
        return UNPARSABLE.to_string();
    };
    let unparsable = || format!("{scheme}://<unparsable>");
    let Ok(mut parsed) = url::Url::parse(url) else {
        return unparsable();
    };
    if parsed.cannot_be_a_base() {
        return unparsable();
    }
    if parsed.password().is_some() && parsed.set_password(Some(MASK)).is_err() {
        return unparsable();
    }
    if let Some(q) = parsed.query() {
        let q = redact_query(q);
        parsed.set_query(Some(&q));
    }
    if parsed.fragment().is_some_and(|f| !f.is_empty()) {
        // `rediss://…#insecure` is a flag, not a secret: keep the known flag.
        if parsed.fragment() != Some("insecure") {
            parsed.set_fragment(Some(MASK));
        }
    }
    parsed.to_string()
}

/// A raw query string with the value of every secret parameter replaced by `***`.
fn redact_query(q: &str) -> String {
    q.split('&')
        .map(|pair| {
            let (k, _) = pair.split_once('=').unwrap_or((pair, ""));
            if is_secret_param(&form_decode(k)) {
                format!("{k}={MASK}")
            } else {
                pair.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// A query key decoded as a form would be (`+` is a space, `%XX` a byte).
fn form_decode(s: &str) -> String {
    percent_decode(&s.replace('+', " "))
}

/// `%XX` decoded (invalid escapes kept as written; invalid UTF-8 replaced).
pub(crate) fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && let Some(h) = s.get(i + 1..i + 3)
            && let Ok(v) = u8::from_str_radix(h, 16)
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Every secret `url` carries, as written and percent-decoded: the userinfo password and the
/// values of secret query parameters. For scrubbing driver messages (a second line of defence:
/// [`redact_url`] is the first). Works on the raw text, so an unparsable URL still gives its
/// userinfo password when one can be found.
pub(crate) fn secrets_of(url: &str) -> Vec<String> {
    let mut raw = Vec::new();
    // The userinfo ends at the last `@` before the query (a raw `/` may be in the password);
    // without `scheme://` (a forgotten scheme) it starts at the beginning.
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let before_query = rest.split(['?', '#']).next().unwrap_or("");
    if let Some((auth, _)) = before_query.rsplit_once('@')
        && let Some((_, pw)) = auth.split_once(':')
    {
        raw.push(pw.to_string());
    }
    if let Some((_, q)) = url.split_once('?') {
        let q = q.split('#').next().unwrap_or("");
        for pair in q.split('&') {
            if let Some((k, v)) = pair.split_once('=')
                && is_secret_param(&form_decode(k))
            {
                raw.push(v.to_string());
                raw.push(form_decode(v));
            }
        }
    }
    if let Some((_, f)) = url.split_once('#')
        && f != "insecure"
    {
        raw.push(f.to_string());
    }
    let mut out: Vec<String> = Vec::new();
    for s in raw {
        let d = percent_decode(&s);
        for v in [s, d] {
            if !v.is_empty() && !out.contains(&v) {
                out.push(v);
            }
        }
    }
    // Longest first, so that a secret containing another is replaced whole.
    out.sort_by_key(|s| std::cmp::Reverse(s.len()));
    out
}

/// Every URL form a driver accepts (or an easy typo of one), with the secrets it carries: no
/// output may contain any of them (used by the tests of every surface that prints a URL).
/// `text` with every secret of `url` (see [`secrets_of`]) replaced by `***`: for engines that
/// build their own display of a URL (ZooKeeper's and etcd's host lists, which the `url` crate
/// cannot parse) and for driver messages.
#[cfg_attr(
    not(any(
        feature = "postgres",
        feature = "mysql",
        feature = "zookeeper",
        feature = "etcd"
    )),
    allow(dead_code)
)]
pub(crate) fn scrub(text: &str, url: &str) -> String {
    let mut text = text.to_string();
    for s in secrets_of(url) {
        if text.contains(&s) {
            text = text.replace(&s, MASK);
        }
    }
    text
}

#[cfg(test)]
pub(crate) const TABLE: &[(&str, &[&str])] = &[
    ("redis://user:s3cret@127.0.0.1:1/2", &["s3cret"]),
    ("redis://:s3cret@127.0.0.1:1", &["s3cret"]),
    (
        "rediss://u:s3c@ret@127.0.0.1:1/0",
        &["s3c@ret", "s3c%40ret"],
    ),
    ("rediss://u:s3cret@127.0.0.1:1/0#insecure", &["s3cret"]),
    (
        "redis://:Zm9v/YmFy+@127.0.0.1:1",
        &["Zm9v/YmFy+", "Zm9v", "YmFy"],
    ),
    (
        "redis://:Zm9v%2FYmFy%2B@127.0.0.1:1",
        &["Zm9v%2FYmFy", "Zm9v/YmFy"],
    ),
    (
        "unix:///nonexistent/dlock-redis.sock?db=0&pass=s3cret",
        &["s3cret"],
    ),
    (
        "unix:///nonexistent/dlock-redis.sock?user=ops&PASS=s3cret",
        &["s3cret"],
    ),
    (
        "redis+unix:///nonexistent/dlock-redis.sock?user=ops&pass=s3cret",
        &["s3cret"],
    ),
    (
        "redis+unix:///nonexistent/dlock-redis.sock?pa%73s=s3cret",
        &["s3cret"],
    ),
    (
        "redis://127.0.0.1:1/0?password=s3cret&protocol=resp3",
        &["s3cret"],
    ),
    ("redis://127.0.0.1:1/0#s3cret", &["s3cret"]),
    ("ops:s3cret@127.0.0.1:1", &["s3cret"]),
    ("s3cret@127.0.0.1", &["s3cret"]),
    (
        "postgres://app@127.0.0.1:1/app?sslmode=require&password=s3cret",
        &["s3cret"],
    ),
    (
        "postgres://127.0.0.1:1/app?user=app&password=s3cret",
        &["s3cret"],
    ),
    ("postgresql://app:s3cret@127.0.0.1:1/app", &["s3cret"]),
    (
        "postgresql://app@127.0.0.1:1/app?Password=s3cr%65t",
        &["s3cr%65t", "s3cret"],
    ),
    (
        "postgres://app@127.0.0.1:1/app?sslpassword=s3cret&sslkey=/k.pem",
        &["s3cret"],
    ),
    (
        "postgres://app:s3cret@127.0.0.1:1,127.0.0.1:2/app",
        &["s3cret"],
    ),
    ("mysql://root:s3cret@127.0.0.1:1/test", &["s3cret"]),
    ("mysql://root@127.0.0.1:1/test?password=s3cret", &["s3cret"]),
    (
        "mysql://root:s3cr%2Fet@127.0.0.1:1/test",
        &["s3cr%2Fet", "s3cr/et"],
    ),
    ("zk://ops:s3cret@127.0.0.1:1,127.0.0.1:2/app", &["s3cret"]),
    (
        "zks://ops:s3cret@127.0.0.1:1/app?tls_ca=/ca.pem",
        &["s3cret"],
    ),
    ("zk://ops:s3/cret@127.0.0.1:1", &["s3/cret", "s3"]),
    ("etcd://ops:s3cret@127.0.0.1:1,127.0.0.1:2", &["s3cret"]),
    ("etcds://ops:s3cret@127.0.0.1:1", &["s3cret"]),
    ("etcd://127.0.0.1:1?token=s3cret", &["s3cret"]),
    (
        "redis://127.0.0.1:1?secret=s3cret&api_key=k3y&pwd=p4ss",
        &["s3cret", "k3y", "p4ss"],
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_secret_survives_redaction() {
        for (url, secrets) in TABLE {
            let shown = redact_url(url);
            for s in *secrets {
                assert!(!shown.contains(s), "{url} -> {shown} still shows {s}");
            }
        }
    }

    #[test]
    fn everything_but_the_secrets_is_kept() {
        for (url, shown) in [
            (
                "redis://user:s3cret@127.0.0.1:6379/2",
                "redis://user:***@127.0.0.1:6379/2",
            ),
            ("redis://:s3cret@localhost", "redis://:***@localhost"),
            ("redis://127.0.0.1/0", "redis://127.0.0.1/0"),
            ("rediss://u:p@w@h:1/0", "rediss://u:***@h:1/0"),
            (
                "rediss://u:p@h:1/0#insecure",
                "rediss://u:***@h:1/0#insecure",
            ),
            (
                "unix:///run/redis.sock?db=0&pass=s3cret",
                "unix:///run/redis.sock?db=0&pass=***",
            ),
            (
                "postgres://app@db/app?sslmode=require&password=s3cret",
                "postgres://app@db/app?sslmode=require&password=***",
            ),
            (
                "postgres://u:secret@h:5432/db",
                "postgres://u:***@h:5432/db",
            ),
            ("mysql://root@h/test", "mysql://root@h/test"),
            ("postgres://h/db", "postgres://h/db"),
            ("redis://:Zm9v/YmFy+@10.0.0.5:6379", "redis://<unparsable>"),
            ("ops:s3cret@10.0.0.5:6379", UNPARSABLE),
            ("", UNPARSABLE),
            ("1x://a:b@c", UNPARSABLE),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }

    #[test]
    fn secrets_are_found_for_scrubbing() {
        // A message that quotes the URL whole (as a driver might) is clean once scrubbed.
        for (url, secrets) in TABLE {
            if !url.contains(':') || url.starts_with("s3cret@") {
                continue; // no password field: `s3cret@host` names a user
            }
            let mut msg = format!("cannot connect to {url}");
            for s in secrets_of(url) {
                msg = msg.replace(&s, "***");
            }
            for s in *secrets {
                assert!(!msg.contains(s), "{url}: {msg} still shows {s}");
            }
        }
        assert!(secrets_of("postgres://u@h/db").is_empty());
        assert!(secrets_of("postgres://h/db?x=a:b@c").is_empty());
        assert_eq!(
            secrets_of("postgres://u:s%40cret@h/db"),
            vec!["s%40cret".to_string(), "s@cret".to_string()]
        );
    }
}

/// Every surface that prints a URL, fed every URL of [`TABLE`]: `init` errors, `Debug` of the
/// builders and backends reachable without a server, the admin's connection errors, and every
/// tracing event emitted meanwhile (on any thread: a process-wide capturing subscriber).
#[cfg(test)]
mod surfaces {
    use super::TABLE;
    use std::time::Duration;

    use crate::test_capture::{EVENTS, install};

    /// The outputs of every surface for `url` (each labelled).
    async fn outputs(url: &'static str) -> Vec<String> {
        let mut out = Vec::new();
        let t = Duration::from_secs(15);
        let bounded = |r: Result<String, tokio::time::error::Elapsed>| r.unwrap_or_default();
        out.push(bounded(
            tokio::time::timeout(t, async {
                match crate::init_named("redact-test", url).await {
                    Ok(()) => "init ok".to_string(),
                    Err(e) => format!("init: {e} / {e:?}"),
                }
            })
            .await,
        ));
        out.push(format!("{:?}", crate::RedisBackend::builder(url)));
        match crate::RedisBackend::builder(url).build() {
            Ok(b) => out.push(format!("{b:?} {}", b.url())),
            Err(e) => out.push(format!("build: {e}")),
        }
        out.push(format!(
            "{:?}",
            crate::RedlockBackend::builder([url, url, url])
        ));
        out.push(bounded(
            tokio::time::timeout(t, async {
                match crate::init_redlock("redact-test", [url, url, url]).await {
                    Ok(()) => "redlock ok".to_string(),
                    Err(e) => format!("redlock: {e} / {e:?}"),
                }
            })
            .await,
        ));
        #[cfg(feature = "sentinel")]
        {
            out.push(format!("{:?}", crate::SentinelBackend::builder("m", [url])));
            out.push(bounded(
                tokio::time::timeout(t, async {
                    match crate::SentinelBackend::connect("m", [url]).await {
                        Ok(b) => format!("{b:?}"),
                        Err(e) => format!("sentinel: {e} / {e:?}"),
                    }
                })
                .await,
            ));
            out.push(bounded(
                tokio::time::timeout(t, async {
                    match crate::admin::SentinelAdmin::connect("m", [url], None, 0).await {
                        Ok(_) => "sentinel admin ok".to_string(),
                        Err(e) => format!("sentinel admin: {e} / {e:?}"),
                    }
                })
                .await,
            ));
        }
        #[cfg(feature = "cluster")]
        {
            out.push(format!("{:?}", crate::ClusterBackend::builder([url])));
            out.push(bounded(
                tokio::time::timeout(t, async {
                    match crate::init_cluster("redact-test", [url]).await {
                        Ok(()) => "cluster ok".to_string(),
                        Err(e) => format!("cluster: {e} / {e:?}"),
                    }
                })
                .await,
            ));
            out.push(bounded(
                tokio::time::timeout(t, async {
                    match crate::admin::ClusterAdmin::connect([url]).await {
                        Ok(_) => "cluster admin ok".to_string(),
                        Err(e) => format!("cluster admin: {e} / {e:?}"),
                    }
                })
                .await,
            ));
        }
        #[cfg(feature = "postgres")]
        out.push(format!("{:?}", crate::PostgresBackend::builder(url)));
        #[cfg(feature = "mysql")]
        out.push(format!("{:?}", crate::MysqlBackend::builder(url)));
        out.push(bounded(
            tokio::time::timeout(t, async {
                match crate::admin::connect(url).await {
                    Ok(a) => format!("admin ok {}", a.target()),
                    Err(e) => format!("admin: {e} / {e:?}"),
                }
            })
            .await,
        ));
        out.push(bounded(
            tokio::time::timeout(t, async {
                match crate::admin::RedlockAdmin::connect([url, url, url]).await {
                    Ok(_) => "redlock admin ok".to_string(),
                    Err(e) => format!("redlock admin: {e} / {e:?}"),
                }
            })
            .await,
        ));
        out
    }

    #[test]
    fn no_surface_prints_a_secret_of_any_url_form() {
        install();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let all = rt.block_on(futures_util::future::join_all(
            TABLE.iter().map(|(url, _)| outputs(url)),
        ));
        // Background tasks (reconnects, reapers) get a moment to log too.
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(300)).await });
        let events = EVENTS.lock().unwrap_or_else(|e| e.into_inner()).join("\n");
        let mut leaks = Vec::new();
        for ((url, secrets), outs) in TABLE.iter().zip(&all) {
            for s in *secrets {
                for o in outs {
                    if o.contains(s) {
                        leaks.push(format!("{url}: {s} in {o}"));
                    }
                }
                for e in events.lines() {
                    if e.contains(s) {
                        leaks.push(format!("{url}: {s} in event {e}"));
                    }
                }
            }
        }
        assert!(
            leaks.is_empty(),
            "{} leaks:\n{}",
            leaks.len(),
            leaks.join("\n")
        );
    }

    /// A redis-server on a unix socket only, with a password; killed on drop.
    struct Server(std::process::Child, std::path::PathBuf);

    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
            let _ = std::fs::remove_dir_all(&self.1);
        }
    }

    /// A successful `init` logs the URL at INFO ("backend registered"): with the password in
    /// the query of a `unix://` / `redis+unix://` URL, or in the userinfo, the event shows none.
    #[test]
    fn a_registration_event_shows_no_password() {
        install();
        let dir = std::env::temp_dir().join(format!("dlock-redact-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("r.sock");
        let child = match std::process::Command::new("redis-server")
            .args(["--port", "0", "--save", "", "--appendonly", "no"])
            .arg("--unixsocket")
            .arg(&sock)
            .args(["--requirepass", "Unix-Pw-9f"])
            .arg("--dir")
            .arg(&dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
        {
            Ok(c) => c,
            Err(e) => panic!("redis-server is needed for this test: {e}"),
        };
        let _server = Server(child, dir);
        let t0 = std::time::Instant::now();
        while !sock.exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let sock = sock.display();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        for url in [
            format!("unix://{sock}?pass=Unix-Pw-9f"),
            format!("redis+unix://{sock}?db=1&pass=Unix-Pw-9f"),
        ] {
            rt.block_on(async {
                crate::init_named("redact-registered", &url)
                    .await
                    .unwrap_or_else(|e| panic!("{url}: {e}"));
                let b = crate::backend("redact-registered").unwrap();
                let debug = format!("{b:?}");
                assert!(!debug.contains("Unix-Pw-9f"), "{debug}");
                let a = crate::admin::connect(&url).await.unwrap();
                assert!(!a.target().contains("Unix-Pw-9f"), "{}", a.target());
            });
        }
        let events = EVENTS.lock().unwrap_or_else(|e| e.into_inner()).join("\n");
        assert!(
            events.contains("redact-registered") && events.contains("registered"),
            "no registration event captured:\n{events}"
        );
        let leaks: Vec<&str> = events
            .lines()
            .filter(|e| e.contains("Unix-Pw-9f"))
            .collect();
        assert!(leaks.is_empty(), "{leaks:#?}");
    }
}
