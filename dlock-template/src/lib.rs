//! The key template scanner of the dlock toolkit: `"order:{order_id}"`, `{a.b.c}`,
//! `{self.field}`, `{{` and `}}`. One parser for the `#[distributed_lock]` attribute, the `key!`
//! macro (both at compile time) and the web layer's `path_key` (at run time), so the three
//! accept the same templates and escape values alike. Not public API of `dlock`: no semver
//! promise.

/// The longest `ttl`, `max_hold` or `hold_at_least` dlock accepts: 365 days. `Lock` refuses a
/// longer one at run time and the attribute at compile time, both with this one constant, so no
/// deadline arithmetic can overflow and no backend gets an out-of-range expiry.
pub const MAX_DURATION: std::time::Duration = std::time::Duration::from_secs(365 * 24 * 3600);

/// One piece of a key template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Text copied as is (with `{{` / `}}` already turned into `{` / `}`).
    Lit(String),
    /// `{root.field.sub}`: `path[0]` is a parameter, a pattern binding or `self`.
    Value(Vec<String>),
}

/// A scanned template: its segments, and for each placeholder the characters its value must
/// escape (the first character of the literal right after it).
#[derive(Debug)]
pub struct Template {
    /// The literals and placeholders, in order.
    pub segments: Vec<Segment>,
}

impl Template {
    /// For the placeholder at `segments[i]`: the characters its value escapes besides `\\`,
    /// namely `:` (every value escapes it) and the first character of the literal that follows it
    /// (none at the end of the template).
    pub fn special_after(&self, i: usize) -> String {
        match self.segments.get(i + 1) {
            Some(Segment::Lit(s)) => special(s),
            _ => special(""),
        }
    }
}

/// The characters a value escapes besides `\\` when `next_literal` follows its placeholder
/// (empty at the end of a template): `:`, the separator every value escapes, so a value can
/// never name another template's lock, and the first character of that literal, so it can
/// never name another lock of its own template.
pub fn special(next_literal: &str) -> String {
    let mut s = String::from(":");
    if let Some(c) = next_literal.chars().next().filter(|&c| c != ':') {
        s.push(c);
    }
    s
}

/// Scans `text`; every problem found is returned, not only the first.
pub fn parse(text: &str) -> Result<Template, Vec<String>> {
    let mut errors = Vec::new();
    let mut segments: Vec<Segment> = Vec::new();
    let mut lit = String::new();
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        match c {
            '{' if chars.peek().map(|&(_, c)| c) == Some('{') => {
                chars.next();
                lit.push('{');
            }
            '}' if chars.peek().map(|&(_, c)| c) == Some('}') => {
                chars.next();
                lit.push('}');
            }
            '}' => errors.push(format!(
                "unmatched `}}` at byte {i} of the key template; write `}}}}` for a literal `}}`"
            )),
            '{' => {
                let mut inner = String::new();
                let mut closed = false;
                for (_, c) in chars.by_ref() {
                    if c == '}' {
                        closed = true;
                        break;
                    }
                    inner.push(c);
                }
                if !closed {
                    errors.push(format!(
                        "unclosed `{{` at byte {i} of the key template; close it with `}}`, or write `{{{{` for a literal `{{`"
                    ));
                    break;
                }
                match placeholder(&inner) {
                    Ok(path) => {
                        if !lit.is_empty() {
                            segments.push(Segment::Lit(std::mem::take(&mut lit)));
                        }
                        if let Some(Segment::Value(prev)) = segments.last() {
                            errors.push(format!(
                                "`{{{}}}{{{}}}`: two placeholders with nothing between them make keys ambiguous; put a separator between them, e.g. `{{{}}}:{{{}}}`",
                                prev.join("."),
                                inner.trim(),
                                prev.join("."),
                                inner.trim()
                            ));
                        }
                        segments.push(Segment::Value(path));
                    }
                    Err(e) => errors.push(e),
                }
            }
            c => {
                if c == '\\' && lit.is_empty() && matches!(segments.last(), Some(Segment::Value(_)))
                {
                    errors.push(
                        "a `\\` right after a placeholder makes keys ambiguous (values escape with `\\`); use another separator"
                            .to_string(),
                    );
                }
                lit.push(c);
            }
        }
    }
    if !lit.is_empty() {
        segments.push(Segment::Lit(lit));
    }
    if errors.is_empty() {
        Ok(Template { segments })
    } else {
        Err(errors)
    }
}

/// `name`, `name.field.sub`, `self.field` or `name.0`.
fn placeholder(inner: &str) -> Result<Vec<String>, String> {
    let trimmed = inner.trim();
    if trimmed.is_empty() {
        return Err(
            "empty placeholder `{}` in the key template; name a parameter, e.g. `{order_id}`"
                .to_string(),
        );
    }
    let parts: Vec<String> = trimmed.split('.').map(|s| s.trim().to_string()).collect();
    for (n, part) in parts.iter().enumerate() {
        let ok = if n == 0 {
            is_ident(part)
        } else {
            is_ident(part) || (!part.is_empty() && part.chars().all(|c| c.is_ascii_digit()))
        };
        if !ok {
            return Err(format!(
                "`{{{trimmed}}}` is not a placeholder: write a parameter name or a field path such as `{{order.id}}` (format specs and expressions are not supported)"
            ));
        }
    }
    if parts.len() == 1 && parts[0] == "self" {
        return Err("`{self}` needs a field: write e.g. `{self.id}`".to_string());
    }
    Ok(parts)
}

fn is_ident(s: &str) -> bool {
    // A raw identifier (`r#type`) names a field whose name is a keyword.
    let s = s.strip_prefix("r#").unwrap_or(s);
    let mut cs = s.chars();
    match cs.next() {
        Some(c) if c == '_' || c.is_alphabetic() => {}
        _ => return false,
    }
    s != "_" && cs.all(|c| c == '_' || c.is_alphanumeric())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(p: &[&str]) -> Segment {
        Segment::Value(p.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn segments() {
        let t = parse("a:{x}:{y.z}").unwrap();
        assert_eq!(
            t.segments,
            vec![
                Segment::Lit("a:".into()),
                v(&["x"]),
                Segment::Lit(":".into()),
                v(&["y", "z"])
            ]
        );
        assert_eq!(t.special_after(1), ":");
        assert_eq!(t.special_after(3), ":");
        assert_eq!(parse("a:{x}-{y}").unwrap().special_after(1), ":-");
        let t = parse("{{lit}}-{self.id}").unwrap();
        assert_eq!(
            t.segments,
            vec![Segment::Lit("{lit}-".into()), v(&["self", "id"])]
        );
        let t = parse("{t.0}").unwrap();
        assert_eq!(t.segments, vec![v(&["t", "0"])]);
    }

    #[test]
    fn mistakes() {
        assert!(parse("a:{x").unwrap_err()[0].contains("unclosed"));
        assert!(parse("a:}x").unwrap_err()[0].contains("unmatched"));
        assert!(parse("{a}{b}").unwrap_err()[0].contains("ambiguous"));
        assert!(parse("{}").unwrap_err()[0].contains("empty"));
        assert!(parse("{x:?}").unwrap_err()[0].contains("not a placeholder"));
        assert!(parse("{a}\\{b}").unwrap_err()[0].contains("`\\`"));
        assert_eq!(parse("{}:{a}{b}").unwrap_err().len(), 2);
    }
}
