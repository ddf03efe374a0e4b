//! Named lock policies: settings that ops teams change without touching code. The sources
//! (code, TOML file, environment) and their precedence are documented on [`Policy`], the public
//! face of this private module.

use std::collections::HashMap;
use std::sync::{LazyLock, RwLock};
use std::time::Duration;

use crate::LockError;

/// What a `#[distributed_lock]` function does when the lock is taken by someone else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnBusy {
    /// Return the busy / timed-out [`LockError`] (converted with `Into`).
    Error,
    /// Do not run the body; return `()` or `None`.
    Skip,
}

/// What a `#[distributed_lock]` function does when the lease is lost while its body runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnLost {
    /// Drop the body future at its next `.await` and return [`LockError::Lost`].
    Cancel,
    /// Let the body finish.
    Continue,
}

/// A named set of lock settings; every field is optional.
///
/// Policies are how ops teams change lock settings without touching code.
///
/// A policy names any of `ttl`, `wait`, `backend`, `watchdog`, `on_busy`, `hold_at_least`,
/// `on_lost` and `fair`. `#[distributed_lock(key = "...", policy = "payments")]` takes its settings from the
/// policy; options written in the attribute win over it.
///
/// # Where policies come from
///
/// * **Code**: [`define_policy`]`("payments", policy)`.
/// * **A TOML file** loaded at start-up with [`load_policies`] (or a string with
///   [`load_policies_str`]); durations are humantime strings:
///
///   ```toml
///   [policy.payments]
///   ttl = "10s"
///   wait = "2s"
///   backend = "default"
///   watchdog = true
///   on_busy = "skip"          # or "error"
///   hold_at_least = "1m"
///   on_lost = "cancel"        # or "continue"
///   fair = true               # waiters in arrival order (`Lock::fair`)
///   ```
///
/// * **Environment variables** `DLOCK_POLICY_<NAME>_<FIELD>`, read when a policy is looked up:
///   `<NAME>` is the policy name uppercased with every character other than `A-Z`/`0-9` turned
///   into `_`, `<FIELD>` one of `TTL`, `WAIT`, `BACKEND`, `WATCHDOG`, `ON_BUSY`,
///   `HOLD_AT_LEAST`, `ON_LOST`, `FAIR`. Example: `DLOCK_POLICY_PAYMENTS_TTL=5s`,
///   `DLOCK_POLICY_NIGHTLY_REPORT_ON_BUSY=skip` for the policy `nightly-report`. Values are
///   written as in the file (`true`/`false` for `WATCHDOG` and `FAIR`); an empty value counts as unset.
///   A policy that only the environment
///   names exists too.
///
/// # Precedence
///
/// Highest first, field by field:
///
/// **attribute > environment > policy file > policy defined in code > built-in defaults**
///
/// (defaults: ttl 30 s, wait 0, backend `"default"`, watchdog on, on_busy error, no
/// hold_at_least, on_lost cancel, not fair). Loading a second file replaces the fields it names.
///
/// A `#[distributed_lock]` function resolves its settings once, at its first call, and keeps
/// them: define and load policies at start-up, before the first locked call. A policy name
/// that no layer defines makes that call fail with [`LockError::UnknownPolicy`], which lists
/// the known names; a malformed environment value fails it with [`LockError::Config`].
///
/// `on_busy` from a policy applies to functions whose attribute does not set it, as far as the
/// return type allows: a `Result` always carries the busy error, a function returning `()` or
/// `Option<T>` always skips.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Policy {
    /// Lease length.
    pub ttl: Option<Duration>,
    /// How long to wait for a busy lock.
    pub wait: Option<Duration>,
    /// Registered backend name.
    pub backend: Option<String>,
    /// Whether the watchdog renews the lease.
    pub watchdog: Option<bool>,
    /// What to do when the lock is busy.
    pub on_busy: Option<OnBusy>,
    /// Minimum time the lock stays taken after acquisition.
    pub hold_at_least: Option<Duration>,
    /// What to do when the lease is lost.
    pub on_lost: Option<OnLost>,
    /// Whether waiters are served in arrival order ([`crate::Lock::fair`]).
    pub fair: Option<bool>,
}

impl Policy {
    /// An empty policy (every setting from the layers below it).
    pub fn new() -> Self {
        Self::default()
    }

    /// Fills every field this policy leaves unset from `lower`.
    pub fn or(mut self, lower: &Policy) -> Policy {
        self.ttl = self.ttl.or(lower.ttl);
        self.wait = self.wait.or(lower.wait);
        self.backend = self.backend.or_else(|| lower.backend.clone());
        self.watchdog = self.watchdog.or(lower.watchdog);
        self.on_busy = self.on_busy.or(lower.on_busy);
        self.hold_at_least = self.hold_at_least.or(lower.hold_at_least);
        self.on_lost = self.on_lost.or(lower.on_lost);
        self.fair = self.fair.or(lower.fair);
        self
    }
}

static POLICIES: LazyLock<RwLock<HashMap<String, Policy>>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));

/// Policies loaded from TOML (a layer above those defined in code).
static FILE_POLICIES: LazyLock<RwLock<HashMap<String, Policy>>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));

const FIELDS: [&str; 8] = [
    "ttl",
    "wait",
    "backend",
    "watchdog",
    "on_busy",
    "hold_at_least",
    "on_lost",
    "fair",
];

/// Warns when `name` and another known policy map to the same `DLOCK_POLICY_<NAME>_*`
/// variables (`pay-ments`, `pay.ments`, `pay_ments` all give `PAY_MENTS`): one variable would
/// silently override both.
fn warn_shared_env_names(name: &str) {
    let mine = policy_env_var(name, "");
    let mut others: Vec<String> = POLICIES
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .keys()
        .chain(
            FILE_POLICIES
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .keys(),
        )
        .filter(|n| n.as_str() != name && policy_env_var(n, "") == mine)
        .cloned()
        .collect();
    others.sort();
    others.dedup();
    for other in others {
        tracing::warn!(
            policy = name,
            other = %other,
            "dlock: policies `{name}` and `{other}` share the environment variables {mine}*: \
             an override there applies to both; rename one (letters and digits decide the name)"
        );
    }
}

/// Defines (or replaces) the policy `name` in code.
pub fn define_policy(name: &str, policy: Policy) {
    warn_shared_env_names(name);
    POLICIES
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(name.to_string(), policy);
}

/// Loads policies from a TOML file (format in the [`Policy`] docs). Fields it names replace
/// those of earlier loads; the whole file is checked before anything is applied.
pub fn load_policies(path: impl AsRef<std::path::Path>) -> Result<(), LockError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|e| {
        LockError::Config(format!(
            "cannot read the policy file {}: {e}",
            path.display()
        ))
    })?;
    load_policies_str(&text).map_err(|e| match e {
        LockError::Config(m) => LockError::Config(format!("{}: {m}", path.display())),
        e => e,
    })
}

/// Loads policies from TOML text (format in the [`Policy`] docs).
pub fn load_policies_str(text: &str) -> Result<(), LockError> {
    let table: toml::Table = text
        .parse()
        .map_err(|e| LockError::Config(format!("policy file: {e}")))?;
    let mut parsed = Vec::new();
    for (top, value) in &table {
        if top != "policy" {
            return Err(LockError::Config(format!(
                "policy file: unknown top-level key `{top}`; write policies as `[policy.<name>]`"
            )));
        }
        let toml::Value::Table(policies) = value else {
            return Err(LockError::Config(
                "policy file: `policy` must be a table of `[policy.<name>]` sections".into(),
            ));
        };
        for (name, body) in policies {
            let toml::Value::Table(fields) = body else {
                return Err(LockError::Config(format!(
                    "policy file: `policy.{name}` must be a table"
                )));
            };
            let mut p = Policy::new();
            for (field, v) in fields {
                let text = match v {
                    toml::Value::String(s) => s.clone(),
                    toml::Value::Boolean(b) => b.to_string(),
                    other => {
                        return Err(LockError::Config(format!(
                            "policy file: `policy.{name}.{field}` must be a string or a boolean, not {}",
                            other.type_str()
                        )));
                    }
                };
                set_field(&mut p, field, &text).map_err(|m| {
                    LockError::Config(format!("policy file: `policy.{name}.{field}`: {m}"))
                })?;
            }
            parsed.push((name.clone(), p));
        }
    }
    for (name, _) in &parsed {
        warn_shared_env_names(name);
    }
    let mut map = FILE_POLICIES.write().unwrap_or_else(|e| e.into_inner());
    for (name, p) in parsed {
        let merged = match map.get(&name) {
            Some(old) => p.or(old),
            None => p,
        };
        map.insert(name, merged);
    }
    Ok(())
}

/// The environment variable for `field` of the policy `name` (see the [`Policy`] docs).
pub fn policy_env_var(name: &str, field: &str) -> String {
    let mangle = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_uppercase()
                } else {
                    '_'
                }
            })
            .collect()
    };
    format!("DLOCK_POLICY_{}_{}", mangle(name), mangle(field))
}

/// The `DLOCK_POLICY_<NAME>_*` variables of `name` that name no field (a typo such as
/// `…_TLL` or `…_TIMEOUT`), leaving out those that are another known policy's field variable
/// (`pay` and `pay_ments` share a prefix).
fn unknown_env_vars(name: &str) -> Vec<(String, String)> {
    let prefix = policy_env_var(name, "");
    let known = |var: &str| {
        let names = POLICIES
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .chain(
                FILE_POLICIES
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .keys(),
            )
            .cloned()
            .collect::<Vec<_>>();
        std::iter::once(name.to_string())
            .chain(names)
            .any(|n| FIELDS.iter().any(|f| policy_env_var(&n, f) == var))
    };
    let mut out: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter_map(|k| {
            let field = k.strip_prefix(&prefix)?.to_string();
            (!known(&k)).then_some((k, field))
        })
        .collect();
    out.sort();
    out
}

/// Warns once per variable about [`unknown_env_vars`]: the TOML layer refuses an unknown
/// field, the environment layer cannot (it only reads names), so it says so instead.
fn warn_unknown_env_vars(name: &str) {
    static WARNED: LazyLock<std::sync::Mutex<std::collections::HashSet<String>>> =
        LazyLock::new(Default::default);
    for (var, field) in unknown_env_vars(name) {
        let first = WARNED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(var.clone());
        if first {
            tracing::warn!(
                policy = name,
                variable = %var,
                field = %field,
                "dlock: {var} is ignored: `{field}` is no field of policy `{name}` (fields: {})",
                FIELDS.join(", ")
            );
        }
    }
}

/// The environment layer of `name`: `None` when no variable for it is set.
fn env_layer(name: &str) -> Result<Option<Policy>, LockError> {
    warn_unknown_env_vars(name);
    let mut p = Policy::new();
    let mut any = false;
    for field in FIELDS {
        let var = policy_env_var(name, field);
        let Some(value) = std::env::var_os(&var) else {
            continue;
        };
        let value = value
            .into_string()
            .map_err(|_| LockError::Config(format!("{var} is not valid UTF-8")))?;
        if value.trim().is_empty() {
            // `VAR=` (common in container manifests that template values in) means "not set":
            // it failed every call of the policy's functions with a config error before.
            continue;
        }
        set_field(&mut p, field, value.trim())
            .map_err(|m| LockError::Config(format!("{var}={value:?}: {m}")))?;
        any = true;
    }
    Ok(any.then_some(p))
}

fn set_field(p: &mut Policy, field: &str, v: &str) -> Result<(), String> {
    let dur = |v: &str| {
        humantime::parse_duration(v)
            .map_err(|e| format!("not a duration ({e}); write e.g. \"30s\""))
    };
    match field {
        "ttl" => {
            let d = dur(v)?;
            if d.is_zero() {
                return Err("the ttl must be longer than zero".into());
            }
            p.ttl = Some(d);
        }
        "wait" => p.wait = Some(dur(v)?),
        "hold_at_least" => p.hold_at_least = Some(dur(v)?),
        "backend" => {
            if v.is_empty() {
                return Err("the backend name must not be empty".into());
            }
            p.backend = Some(v.to_string());
        }
        "watchdog" => {
            p.watchdog = Some(match v {
                "true" => true,
                "false" => false,
                _ => return Err(format!("expected true or false, not {v:?}")),
            });
        }
        "fair" => {
            p.fair = Some(match v {
                "true" => true,
                "false" => false,
                _ => return Err(format!("expected true or false, not {v:?}")),
            });
        }
        "on_busy" => {
            p.on_busy = Some(match v {
                "error" => OnBusy::Error,
                "skip" => OnBusy::Skip,
                _ => return Err(format!("expected \"error\" or \"skip\", not {v:?}")),
            });
        }
        "on_lost" => {
            p.on_lost = Some(match v {
                "cancel" => OnLost::Cancel,
                "continue" => OnLost::Continue,
                _ => return Err(format!("expected \"cancel\" or \"continue\", not {v:?}")),
            });
        }
        other => {
            return Err(format!(
                "unknown field `{other}`; expected one of: {}",
                FIELDS.join(", ")
            ));
        }
    }
    Ok(())
}

/// The policy `name` with every layer applied (environment > file > code), or
/// [`LockError::UnknownPolicy`] when no layer defines it.
pub fn policy(name: &str) -> Result<Policy, LockError> {
    let env = env_layer(name)?;
    let file = FILE_POLICIES
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(name)
        .cloned();
    let code = POLICIES
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(name)
        .cloned();
    if env.is_none() && file.is_none() && code.is_none() {
        let mut known: Vec<String> = policy_names();
        known.sort();
        return Err(LockError::UnknownPolicy {
            name: name.to_string(),
            known,
        });
    }
    let empty = Policy::new();
    Ok(env
        .unwrap_or_default()
        .or(file.as_ref().unwrap_or(&empty))
        .or(code.as_ref().unwrap_or(&empty)))
}

/// The names of the policies defined in code or loaded from files, sorted (names only the
/// environment defines are not listed).
pub fn policy_names() -> Vec<String> {
    let mut names: Vec<String> = POLICIES
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .keys()
        .cloned()
        .collect();
    names.extend(
        FILE_POLICIES
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned(),
    );
    names.sort();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_names() {
        assert_eq!(
            policy_env_var("payments", "ttl"),
            "DLOCK_POLICY_PAYMENTS_TTL"
        );
        assert_eq!(
            policy_env_var("nightly-report.v2", "on_busy"),
            "DLOCK_POLICY_NIGHTLY_REPORT_V2_ON_BUSY"
        );
    }

    /// A misspelt field variable (`…_TLL`, `…_TIMEOUT`) was ignored without a word; it is now
    /// a warning naming the variable and the unknown field. Another policy's variable sharing
    /// the prefix (`unit-typo` vs `unit-typo_x`) is not reported.
    #[test]
    fn a_misspelt_policy_variable_is_warned_about() {
        crate::test_capture::install();
        define_policy("unit-typo", Policy::new());
        define_policy("unit-typo_x", Policy::new());
        // SAFETY: test-only variables no other test reads.
        unsafe {
            std::env::set_var("DLOCK_POLICY_UNIT_TYPO_TLL", "5s");
            std::env::set_var("DLOCK_POLICY_UNIT_TYPO_TIMEOUT", "2s");
            std::env::set_var("DLOCK_POLICY_UNIT_TYPO_WAIT", "1s");
            std::env::set_var("DLOCK_POLICY_UNIT_TYPO_X_TTL", "3s");
        }
        let p = policy("unit-typo").unwrap();
        assert_eq!(p.wait, Some(Duration::from_secs(1)));
        let warned = crate::test_capture::containing("DLOCK_POLICY_UNIT_TYPO_");
        for (var, field) in [
            ("DLOCK_POLICY_UNIT_TYPO_TLL", "TLL"),
            ("DLOCK_POLICY_UNIT_TYPO_TIMEOUT", "TIMEOUT"),
        ] {
            assert!(
                warned.iter().any(|w| w.starts_with("WARN")
                    && w.contains(var)
                    && w.contains(&format!("`{field}`"))),
                "no warning for {var}: {warned:#?}"
            );
        }
        assert!(
            warned
                .iter()
                .all(|w| !w.contains("_WAIT") && !w.contains("_X_TTL")),
            "{warned:#?}"
        );
        // Once per variable.
        let _ = policy("unit-typo").unwrap();
        let again = crate::test_capture::containing("DLOCK_POLICY_UNIT_TYPO_TLL is ignored");
        assert_eq!(again.len(), 1, "{again:#?}");
    }

    /// An empty variable (`DLOCK_POLICY_X_TTL=`) is not set: the layers below decide. It made
    /// every call fail with a config error before (review m9).
    #[test]
    fn an_empty_policy_variable_counts_as_unset() {
        let mut code = Policy::new();
        code.ttl = Some(Duration::from_secs(7));
        define_policy("unit-empty", code);
        // SAFETY: test-only variables no other test reads.
        unsafe {
            std::env::set_var("DLOCK_POLICY_UNIT_EMPTY_TTL", "");
            std::env::set_var("DLOCK_POLICY_UNIT_EMPTY_WAIT", "  ");
        }
        let p = policy("unit-empty").expect("an empty variable is no error");
        assert_eq!(p.ttl, Some(Duration::from_secs(7)));
        assert_eq!(p.wait, None);
    }

    /// `pay-ments` and `pay.ments` both read `DLOCK_POLICY_PAY_MENTS_*`: one variable silently
    /// overrode both. Defining the second (in code or in a file) now warns, naming both.
    #[test]
    fn policies_sharing_environment_variables_are_warned_about() {
        crate::test_capture::install();
        define_policy("unit-pay-ments", Policy::new());
        define_policy("unit.pay.ments", Policy::new());
        load_policies_str("[policy.\"unit_pay_ments\"]\nttl = \"1s\"\n").unwrap();
        let w = crate::test_capture::containing("DLOCK_POLICY_UNIT_PAY_MENTS_");
        assert!(
            w.iter().any(|l| l.starts_with("WARN")
                && l.contains("`unit.pay.ments`")
                && l.contains("`unit-pay-ments`")),
            "{w:#?}"
        );
        assert!(
            w.iter().any(|l| l.contains("`unit_pay_ments`")),
            "the file's policy too: {w:#?}"
        );
        // A policy alone is not reported.
        define_policy("unit-alone-policy", Policy::new());
        assert!(crate::test_capture::containing("UNIT_ALONE_POLICY").is_empty());
    }

    #[test]
    fn file_layers_over_code() {
        let mut code = Policy::new();
        code.ttl = Some(Duration::from_secs(1));
        code.wait = Some(Duration::from_secs(1));
        define_policy("unit-file-over-code", code);
        load_policies_str("[policy.unit-file-over-code]\nttl = \"10s\"\non_busy = \"skip\"\n")
            .unwrap();
        let p = policy("unit-file-over-code").unwrap();
        assert_eq!(p.ttl, Some(Duration::from_secs(10)));
        assert_eq!(p.wait, Some(Duration::from_secs(1)));
        assert_eq!(p.on_busy, Some(OnBusy::Skip));
    }

    #[test]
    fn bad_files_are_config_errors() {
        for bad in [
            "[policy.x]\nttl = \"soon\"",
            "[policy.x]\nttl = \"0s\"",
            "[policy.x]\nfoo = \"1s\"",
            "[policy.x]\nttl = 5",
            "[policies.x]\nttl = \"1s\"",
            "not toml [",
        ] {
            let e = load_policies_str(bad).unwrap_err();
            assert!(matches!(e, LockError::Config(_)), "{bad}: {e}");
        }
        assert!(matches!(
            policy("unit-never-defined"),
            Err(LockError::UnknownPolicy { .. })
        ));
    }
}
