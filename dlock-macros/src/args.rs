//! The attribute's arguments: `key = "...", ttl = "30s", ...`.

use std::time::Duration;

use proc_macro2::{Span, TokenStream};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Expr, ExprLit, Lit, LitStr, Meta, Token};

use crate::duration;
use crate::errors::Errors;

/// Every option the attribute takes, in the order the docs list them.
pub(crate) const OPTIONS: &[&str] = &[
    "key",
    "ttl",
    "wait",
    "backend",
    "watchdog",
    "fair",
    "on_busy",
    "hold_at_least",
    "on_lost",
    "policy",
    "mode",
    "metric_name",
    "semaphore",
    "permits",
    "crate",
];

/// Every option `#[leader]` takes.
pub(crate) const LEADER_OPTIONS: &[&str] = &["name", "ttl", "wait", "backend", "value", "crate"];

/// Names people reach for for `#[leader]`, and what they are called there.
const LEADER_RENAMES: &[(&str, &str)] = &[
    ("key", "name"),
    ("election", "name"),
    ("lease", "ttl"),
    ("lease_duration", "ttl"),
    ("timeout", "wait"),
    ("identity", "value"),
];

/// Which attribute is parsed: its options and its "did you mean" table.
#[derive(Clone, Copy)]
pub(crate) struct Flavor {
    pub(crate) options: &'static [&'static str],
    renames: &'static [(&'static str, &'static str)],
}

/// `#[distributed_lock]`.
pub(crate) const LOCK: Flavor = Flavor {
    options: OPTIONS,
    renames: RENAMES,
};

/// `#[leader]`.
pub(crate) const LEADER: Flavor = Flavor {
    options: LEADER_OPTIONS,
    renames: LEADER_RENAMES,
};

/// Names people reach for from other lock libraries, and what they are called here.
const RENAMES: &[(&str, &str)] = &[
    ("name", "key"),
    ("lease", "ttl"),
    ("lease_time", "ttl"),
    ("expire", "ttl"),
    ("timeout", "wait"),
    ("wait_time", "wait"),
    ("lock_at_least_for", "hold_at_least"),
    ("lock_at_most_for", "ttl"),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnBusy {
    Error,
    Skip,
}

/// `mode = "read"` / `"write"`: a side of a `dlock::RwLock` instead of a lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RwMode {
    Read,
    Write,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnLost {
    Cancel,
    Continue,
}

/// The parsed arguments. Each option keeps the span of its value for later checks.
#[derive(Default)]
pub(crate) struct LockArgs {
    pub(crate) key: Option<LitStr>,
    pub(crate) ttl: Option<Duration>,
    pub(crate) wait: Option<Duration>,
    pub(crate) backend: Option<String>,
    pub(crate) watchdog: Option<bool>,
    /// `fair = true`: waiters in arrival order (`Lock::fair`); with its value's span.
    pub(crate) fair: Option<(bool, Span)>,
    pub(crate) on_busy: Option<(OnBusy, Span)>,
    pub(crate) hold_at_least: Option<Duration>,
    pub(crate) on_lost: Option<OnLost>,
    pub(crate) policy: Option<String>,
    pub(crate) mode: Option<(RwMode, Span)>,
    pub(crate) metric_name: Option<String>,
    /// `semaphore = max`: the function runs under permits of a semaphore of `max` permits
    /// instead of a lock.
    pub(crate) semaphore: Option<(u32, Span)>,
    /// `permits = n`: the permits one call takes (with `semaphore`; default 1).
    pub(crate) permits: Option<(u32, Span)>,
    pub(crate) hold_at_least_span: Option<Span>,
    pub(crate) crate_path: Option<syn::Path>,
    /// `#[leader]`'s `value`.
    pub(crate) value: Option<String>,
}

/// Parses the attribute arguments, collecting every mistake into `errors`.
pub(crate) fn parse(args: TokenStream, errors: &mut Errors) -> LockArgs {
    parse_as(LOCK, args, errors)
}

/// [`parse`] for the attribute `flavor`.
pub(crate) fn parse_as(flavor: Flavor, args: TokenStream, errors: &mut Errors) -> LockArgs {
    let mut out = LockArgs::default();
    let metas = match Punctuated::<Meta, Token![,]>::parse_terminated.parse2(args) {
        Ok(m) => m,
        Err(e) => {
            errors.push(e);
            return out;
        }
    };
    let mut seen: Vec<String> = Vec::new();
    for meta in metas {
        let name = match meta.path().get_ident() {
            Some(id) => id.to_string(),
            None => {
                // `crate` is a keyword: `Path::get_ident` still sees it as an ident.
                let p = meta.path();
                if p.segments.len() == 1 {
                    p.segments[0].ident.to_string()
                } else {
                    errors.push_spanned(p.span(), unknown_message(flavor, &path_text(p)));
                    continue;
                }
            }
        };
        if !flavor.options.contains(&name.as_str()) {
            errors.push_spanned(meta.path().span(), unknown_message(flavor, &name));
            continue;
        }
        let nv = match &meta {
            Meta::NameValue(nv) => nv,
            _ => {
                errors.push_spanned(
                    meta.span(),
                    format!("expected `{name} = ...`, {}", example(&name)),
                );
                continue;
            }
        };
        if seen.contains(&name) {
            errors.push_spanned(
                meta.path().span(),
                format!("duplicate option `{name}`: each option may be given once"),
            );
            continue;
        }
        seen.push(name.clone());
        if let Err(e) = set(&mut out, &name, &nv.value) {
            errors.push(e);
        }
        if name == "hold_at_least" {
            out.hold_at_least_span = Some(nv.value.span());
        }
    }
    match (out.semaphore, out.permits) {
        (None, Some((_, span))) => errors.push_spanned(
            span,
            "`permits` is the number of permits one call takes of a semaphore: it needs `semaphore = <max permits>`, e.g. `semaphore = 4, permits = 2`",
        ),
        (Some((max, _)), Some((n, span))) if n > max => errors.push_spanned(
            span,
            format!("`permits = {n}` is more than the semaphore's {max} permits (`semaphore = {max}`)"),
        ),
        _ => {}
    }
    if let (Some(_), Some(span)) = (out.semaphore, out.hold_at_least_span) {
        errors.push_spanned(
            span,
            "`hold_at_least` is not supported with `semaphore`: permits are given back when the call returns",
        );
    }
    if let Some((true, span)) = out.fair
        && (out.semaphore.is_some() || out.mode.is_some())
    {
        errors.push_spanned(
            span,
            "`fair` is for locks: a semaphore (`semaphore`) or a read-write lock (`mode`) has no fair queue",
        );
    }
    if let (Some(_), Some((_, span))) = (out.semaphore, out.mode) {
        errors.push_spanned(
            span,
            "`mode` (a side of a read-write lock) and `semaphore` cannot be combined: choose one primitive",
        );
    }
    out
}

/// A positive `u32` integer literal.
fn positive_int(name: &str, value: &Expr) -> syn::Result<(u32, Span)> {
    match value {
        Expr::Lit(ExprLit {
            lit: Lit::Int(i), ..
        }) => match i.base10_parse::<u32>() {
            Ok(0) => Err(syn::Error::new(
                i.span(),
                format!("`{name}` must be at least 1"),
            )),
            Ok(n) => Ok((n, i.span())),
            Err(_) => Err(syn::Error::new(
                i.span(),
                format!("`{name}` takes an integer from 1 to {}", u32::MAX),
            )),
        },
        _ => Err(syn::Error::new(
            value.span(),
            format!("`{name}` takes an integer literal, {}", example(name)),
        )),
    }
}

fn set(out: &mut LockArgs, name: &str, value: &Expr) -> syn::Result<()> {
    match name {
        "key" | "name" => {
            let s = lit_str(name, value)?;
            if s.value().is_empty() {
                return Err(syn::Error::new(
                    s.span(),
                    format!("`{name}` must not be empty"),
                ));
            }
            out.key = Some(s);
        }
        "value" => out.value = Some(lit_str(name, value)?.value()),
        "ttl" => out.ttl = Some(duration::parse_capped(&lit_str(name, value)?, name, true)?),
        "wait" => out.wait = Some(duration::parse(&lit_str(name, value)?, name, false)?),
        "hold_at_least" => {
            out.hold_at_least = Some(duration::parse_capped(&lit_str(name, value)?, name, false)?);
        }
        "backend" => out.backend = Some(non_empty(name, &lit_str(name, value)?)?),
        "policy" => out.policy = Some(non_empty(name, &lit_str(name, value)?)?),
        "metric_name" => out.metric_name = Some(non_empty(name, &lit_str(name, value)?)?),
        "semaphore" => out.semaphore = Some(positive_int(name, value)?),
        "permits" => out.permits = Some(positive_int(name, value)?),
        "watchdog" => match value {
            Expr::Lit(ExprLit {
                lit: Lit::Bool(b), ..
            }) => out.watchdog = Some(b.value),
            _ => {
                return Err(syn::Error::new(
                    value.span(),
                    "`watchdog` takes `true` or `false`",
                ));
            }
        },
        "fair" => match value {
            Expr::Lit(ExprLit {
                lit: Lit::Bool(b), ..
            }) => out.fair = Some((b.value, b.span())),
            _ => {
                return Err(syn::Error::new(
                    value.span(),
                    "`fair` takes `true` or `false`",
                ));
            }
        },
        "on_busy" => {
            let s = lit_str(name, value)?;
            let v = match s.value().as_str() {
                "error" => OnBusy::Error,
                "skip" => OnBusy::Skip,
                other => {
                    return Err(syn::Error::new(
                        s.span(),
                        format!("`on_busy` takes \"error\" or \"skip\", not {other:?}"),
                    ));
                }
            };
            out.on_busy = Some((v, s.span()));
        }
        "on_lost" => {
            let s = lit_str(name, value)?;
            out.on_lost = Some(match s.value().as_str() {
                "cancel" => OnLost::Cancel,
                "continue" => OnLost::Continue,
                other => {
                    return Err(syn::Error::new(
                        s.span(),
                        format!("`on_lost` takes \"cancel\" or \"continue\", not {other:?}"),
                    ));
                }
            });
        }
        "mode" => {
            let s = lit_str(name, value)?;
            let v = match s.value().as_str() {
                "read" => RwMode::Read,
                "write" => RwMode::Write,
                other => {
                    return Err(syn::Error::new(
                        s.span(),
                        format!(
                            "`mode` takes \"read\" or \"write\" (a side of a read-write lock), not {other:?}"
                        ),
                    ));
                }
            };
            out.mode = Some((v, s.span()));
        }
        "crate" => {
            let s = lit_str(name, value)?;
            out.crate_path = Some(s.parse::<syn::Path>().map_err(|_| {
                syn::Error::new(
                    s.span(),
                    format!(
                        "`crate` takes a path such as \"::dlock\", not {:?}",
                        s.value()
                    ),
                )
            })?);
        }
        _ => unreachable!("checked against OPTIONS"),
    }
    Ok(())
}

fn lit_str(name: &str, value: &Expr) -> syn::Result<LitStr> {
    match value {
        Expr::Lit(ExprLit {
            lit: Lit::Str(s), ..
        }) => Ok(s.clone()),
        _ => Err(syn::Error::new(
            value.span(),
            format!("`{name}` takes a string literal, {}", example(name)),
        )),
    }
}

fn non_empty(name: &str, s: &LitStr) -> syn::Result<String> {
    let v = s.value();
    if v.is_empty() {
        return Err(syn::Error::new(
            s.span(),
            format!("`{name}` must not be empty"),
        ));
    }
    Ok(v)
}

fn example(name: &str) -> &'static str {
    match name {
        "key" => "e.g. `key = \"order:{order_id}\"`",
        "name" => "e.g. `name = \"scheduler\"`",
        "value" => "e.g. `value = \"10.0.0.7:8080\"`",
        "ttl" => "e.g. `ttl = \"30s\"`",
        "wait" => "e.g. `wait = \"5s\"`",
        "hold_at_least" => "e.g. `hold_at_least = \"1m\"`",
        "backend" => "e.g. `backend = \"default\"`",
        "watchdog" => "e.g. `watchdog = false`",
        "fair" => "e.g. `fair = true`",
        "on_busy" => "e.g. `on_busy = \"skip\"`",
        "on_lost" => "e.g. `on_lost = \"continue\"`",
        "policy" => "e.g. `policy = \"payments\"`",
        "mode" => "e.g. `mode = \"read\"`",
        "metric_name" => "e.g. `metric_name = \"reports_run\"`",
        "semaphore" => "e.g. `semaphore = 4` (at most 4 permits held at once)",
        "permits" => "e.g. `permits = 2` (with `semaphore`)",
        _ => "e.g. `crate = \"::dlock\"`",
    }
}

fn path_text(p: &syn::Path) -> String {
    p.segments
        .iter()
        .map(|s| s.ident.to_string())
        .collect::<Vec<_>>()
        .join("::")
}

fn unknown_message(flavor: Flavor, name: &str) -> String {
    let list = flavor
        .options
        .iter()
        .map(|o| format!("`{o}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let mut msg = format!("unknown option `{name}`; expected one of: {list}");
    if let Some(hint) = suggestion_in(flavor, name) {
        msg.push_str(&format!("\n\nhelp: did you mean `{hint}`?"));
    }
    msg
}

/// The option a misspelt or foreign name most likely meant.
#[cfg(test)]
pub(crate) fn suggestion(name: &str) -> Option<&'static str> {
    suggestion_in(LOCK, name)
}

/// [`suggestion`] among the options of `flavor`.
fn suggestion_in(flavor: Flavor, name: &str) -> Option<&'static str> {
    let lower = name.to_ascii_lowercase();
    if let Some((_, to)) = flavor.renames.iter().find(|(from, _)| *from == lower) {
        return Some(to);
    }
    flavor
        .options
        .iter()
        .map(|o| (edit_distance(&lower, o), *o))
        .filter(|(d, o)| *d <= 2.max(o.len() / 3) && *d < o.len())
        .min_by_key(|(d, _)| *d)
        .map(|(_, o)| o)
}

/// The candidate a misspelt name most likely meant: one at a small edit distance, or the only
/// one that starts with it (`order` for `order_id`).
pub(crate) fn closest<'a>(name: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let near = candidates
        .iter()
        .map(|c| (edit_distance(name, c), *c))
        .filter(|(d, c)| *d <= 2.max(c.len() / 3) && *d < c.len())
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c);
    near.or_else(|| {
        let mut starts = candidates.iter().filter(|c| c.starts_with(name));
        match (starts.next(), starts.next()) {
            (Some(c), None) if !name.is_empty() => Some(*c),
            _ => None,
        }
    })
}

/// Levenshtein distance over chars.
pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    #[test]
    fn suggestions() {
        assert_eq!(suggestion("tll"), Some("ttl"));
        assert_eq!(suggestion("on_bussy"), Some("on_busy"));
        assert_eq!(suggestion("holdatleast"), Some("hold_at_least"));
        assert_eq!(suggestion("timeout"), Some("wait"));
        assert_eq!(suggestion("zzzzzzz"), None);
    }

    #[test]
    fn parses_every_option() {
        let mut errors = Errors::default();
        let a = parse(
            quote!(
                key = "k:{x}",
                ttl = "10s",
                wait = "1s",
                backend = "b",
                watchdog = false,
                on_busy = "skip",
                hold_at_least = "2s",
                on_lost = "continue",
                policy = "p",
                crate = "::dlock"
            ),
            &mut errors,
        );
        assert!(errors.is_empty());
        let s = parse(quote!(key = "k", semaphore = 4, permits = 2), &mut errors);
        assert!(errors.is_empty());
        assert_eq!(s.semaphore.map(|s| s.0), Some(4));
        assert_eq!(s.permits.map(|s| s.0), Some(2));
        assert_eq!(a.key.unwrap().value(), "k:{x}");
        assert_eq!(a.ttl.unwrap().as_secs(), 10);
        assert_eq!(a.on_busy.unwrap().0, OnBusy::Skip);
        assert_eq!(a.on_lost, Some(OnLost::Continue));
        assert_eq!(a.watchdog, Some(false));
    }

    #[test]
    fn collects_several_errors() {
        let mut errors = Errors::default();
        parse(
            quote!(key = "k", tll = "1s", ttl = "0s", key = "j"),
            &mut errors,
        );
        let text = errors.to_compile_errors().to_string();
        assert!(text.contains("did you mean `ttl`"), "{text}");
        assert!(text.contains("longer than zero"), "{text}");
        assert!(text.contains("duplicate option `key`"), "{text}");
    }

    #[test]
    fn semaphore_options_are_checked() {
        for (args, needle) in [
            (quote!(key = "k", permits = 2), "needs `semaphore"),
            (
                quote!(key = "k", semaphore = 2, permits = 3),
                "more than the semaphore's 2",
            ),
            (quote!(key = "k", semaphore = 0), "at least 1"),
            (quote!(key = "k", semaphore = "4"), "integer literal"),
            (
                quote!(key = "k", semaphore = 4, hold_at_least = "1s"),
                "not supported with `semaphore`",
            ),
            (
                quote!(key = "k", semaphore = 4, mode = "read"),
                "cannot be combined",
            ),
            (
                quote!(key = "k", fair = "yes"),
                "`fair` takes `true` or `false`",
            ),
            (
                quote!(key = "k", semaphore = 4, fair = true),
                "`fair` is for locks",
            ),
        ] {
            let mut errors = Errors::default();
            parse(args, &mut errors);
            let text = errors.to_compile_errors().to_string();
            assert!(text.contains(needle), "{needle}: {text}");
        }
    }
}
