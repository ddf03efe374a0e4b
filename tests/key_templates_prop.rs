//! Issue 23, item 2: keys that cannot be forged *across* templates.
//!
//! Escaping is injective within one template (the macro's unit tests and `private.rs` show it).
//! Keys of different templates share one namespace, though, so the property that matters is:
//! a rendered key determines its template and its values, i.e. no values of one template
//! render the key of another. Checked here with an exact inverse: `parse(t, key)` finds the
//! values `v` with `render(t, v) == key` if there are any (the rendering is deterministic, so the
//! inverse is too), and for every pair of distinct templates and generated values of one,
//! `parse(other, key)` must find nothing.
//!
//! `render` is what the attribute's expansion does (`KeyBuf::lit` for literals,
//! `KeyBuf::value(v, special)` for values, `special` from the macro's `special_after`), the
//! `header_key` prefix form is `prefix{value}`, and a `path_key` `{*rest}` capture is a trailing
//! value; with the `axum` feature the two web extractors are also run for real.
//!
//! Templates in the set put each placeholder in its own `:`-separated segment (the README's
//! advice); `a{x}` against `ab{x}` is outside the property (no separator marks where the
//! literal ends).

use dlock::__private::KeyBuf;
use proptest::prelude::*;

#[derive(Debug, Clone, Copy)]
enum Seg {
    Lit(&'static str),
    Val,
}

use Seg::{Lit, Val};

/// The templates: the attribute examples of the README and the issue, the header form and a
/// `{*rest}` capture.
const TEMPLATES: &[&[Seg]] = &[
    &[Lit("user:"), Val],                      // key = "user:{name}"
    &[Lit("user:"), Val, Lit(":wallet")],      // key = "user:{name}:wallet"
    &[Lit("tenant:"), Val],                    // header_key("x-tenant", "tenant:")
    &[Lit("tenant:"), Val, Lit(":doc:"), Val], // key = "tenant:{tenant.id}:doc:{doc_id}"
    &[Lit("order:"), Val],                     // key = "order:{order_id}"
    &[Lit("order:"), Val, Lit(":"), Val],      // key = "order:{a}:{b}"
    &[Lit("file:"), Val],                      // path_key("/files/{*rest}", "file:{rest}")
    &[Lit("file:"), Val, Lit(":meta")],        // key = "file:{path}:meta"
];

/// The characters a value escapes at segment `i`, as the runtime renders it.
fn special(t: &[Seg], i: usize) -> String {
    dlock::__private::key_special(match t.get(i + 1) {
        Some(Lit(l)) => l,
        _ => "",
    })
}

fn render(t: &[Seg], vals: &[String]) -> String {
    let mut k = KeyBuf::default();
    let mut v = vals.iter();
    for (i, s) in t.iter().enumerate() {
        match s {
            Lit(l) => k.lit(l),
            Val => k.value(v.next().unwrap(), &special(t, i)),
        }
    }
    k.finish()
}

/// The values `v` with `render(t, v) == key`, if any.
fn parse(t: &[Seg], key: &str) -> Option<Vec<String>> {
    let mut rest = key;
    let mut out = Vec::new();
    for (i, s) in t.iter().enumerate() {
        match s {
            Lit(l) => rest = rest.strip_prefix(l)?,
            Val => {
                let sp = special(t, i);
                let end = match t.get(i + 1) {
                    Some(Lit(l)) => l.chars().next(),
                    _ => None,
                };
                let mut v = String::new();
                let mut chars = rest.char_indices();
                let mut stop = rest.len();
                while let Some((at, c)) = chars.next() {
                    if c == '\\' {
                        let (_, e) = chars.next()?;
                        if e != '\\' && !sp.contains(e) {
                            return None; // never rendered
                        }
                        v.push(e);
                    } else if Some(c) == end {
                        stop = at;
                        break;
                    } else if sp.contains(c) {
                        return None; // rendered escaped, never raw
                    } else {
                        v.push(c);
                    }
                }
                rest = &rest[stop..];
                out.push(v);
            }
        }
    }
    rest.is_empty().then_some(out)
}

fn values(n: usize) -> impl Strategy<Value = Vec<String>> {
    // Separators and the escape character are what matters; a few letters for the rest.
    prop::collection::vec("[a-c:\\\\/]{0,6}|bob|bob:wallet|acme:doc:7", n)
}

fn cfg(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn arity(t: &[Seg]) -> usize {
    t.iter().filter(|s| matches!(s, Val)).count()
}

#[test]
fn the_inverse_is_exact_within_each_template() {
    proptest!(cfg(256), |(i in 0..TEMPLATES.len(), vals in values(2))| {
        let t = TEMPLATES[i];
        let vals = vals[..arity(t)].to_vec();
        let key = render(t, &vals);
        prop_assert_eq!(parse(t, &key), Some(vals), "{}", key);
    });
}

/// The property of issue 23: no value of one template renders another template's key.
/// Before every value escaped `:`, `user:{name}` with `bob:wallet` and `user:{name}:wallet` with
/// `bob` both rendered `user:bob:wallet` (and proptest's minimal case: `tenant:{t}:doc:{d}` with
/// two empty values rendered `tenant::doc:`, which `tenant:{t}` rendered from `:doc:`).
#[test]
fn no_template_renders_the_key_of_another() {
    proptest!(cfg(512), |(
        i in 0..TEMPLATES.len(),
        j in 0..TEMPLATES.len(),
        vals in values(2),
    )| {
        prop_assume!(i != j);
        let t = TEMPLATES[j];
        let key = render(t, &vals[..arity(t)]);
        let forged = parse(TEMPLATES[i], &key);
        prop_assert!(
            forged.is_none(),
            "{} renders {:?} from {:?}, which template {:?} also renders from {:?}",
            j, key, &vals[..arity(t)], TEMPLATES[i], forged
        );
    });
    // The two examples of the issue, by name.
    let a = render(TEMPLATES[0], &["bob:wallet".into()]);
    let b = render(TEMPLATES[1], &["bob".into()]);
    assert_ne!(a, b);
    let h = render(TEMPLATES[2], &["acme:doc:7".into()]);
    let d = render(TEMPLATES[3], &["acme".into(), "7".into()]);
    assert_ne!(h, d);
}

/// `order_id = 42` still renders `order:42`, and a plain value renders unchanged anywhere.
#[test]
fn plain_values_render_unchanged() {
    assert_eq!(render(TEMPLATES[4], &["42".into()]), "order:42");
    assert_eq!(render(TEMPLATES[1], &["bob".into()]), "user:bob:wallet");
    assert_eq!(
        render(TEMPLATES[3], &["acme".into(), "7".into()]),
        "tenant:acme:doc:7"
    );
}

/// The web extractors render as the templates above.
#[cfg(feature = "axum")]
#[test]
fn the_web_extractors_render_as_the_templates() {
    use dlock::web::{KeyExtractor, header_key, path_key};
    let hk = header_key("x-tenant", "tenant:").unwrap();
    let pk = path_key("/files/{*rest}", "file:{rest}").unwrap();
    for v in ["acme", "acme:doc:7", r"a\b", "a:b\\:c"] {
        let req = axum::http::Request::builder()
            .header("x-tenant", v)
            .body(())
            .unwrap();
        assert_eq!(
            KeyExtractor::<()>::extract(&hk, &req),
            Some(render(TEMPLATES[2], &[v.to_string()])),
            "{v}"
        );
        let path = format!("/files/{}", v.replace('\\', "%5C"));
        let req = axum::http::Request::builder().uri(path).body(()).unwrap();
        assert_eq!(
            KeyExtractor::<()>::extract(&pk, &req),
            Some(render(TEMPLATES[6], &[v.to_string()])),
            "{v}"
        );
    }
}
