//! Durations written as humantime strings ("30s", "500ms", "1m 30s"), parsed at compile time.

use std::time::Duration;

use syn::LitStr;

/// Parses `lit` as a humantime duration; `positive` rejects zero. Errors land on the literal.
pub(crate) fn parse(lit: &LitStr, option: &str, positive: bool) -> syn::Result<Duration> {
    let text = lit.value();
    let d = humantime::parse_duration(text.trim()).map_err(|e| {
        syn::Error::new(
            lit.span(),
            format!(
                "`{option}`: {text:?} is not a duration ({e}); write e.g. \"30s\", \"500ms\" or \"1m 30s\""
            ),
        )
    })?;
    if positive && d.is_zero() {
        return Err(syn::Error::new(
            lit.span(),
            format!("`{option}` must be longer than zero"),
        ));
    }
    Ok(d)
}

/// [`parse`], and refuses more than [`dlock_template::MAX_DURATION`] (365 days), which the runtime
/// would refuse at every call (for `ttl` and `hold_at_least`; a `wait` that long waits for ever).
pub(crate) fn parse_capped(lit: &LitStr, option: &str, positive: bool) -> syn::Result<Duration> {
    let d = parse(lit, option, positive)?;
    if d > dlock_template::MAX_DURATION {
        return Err(syn::Error::new(
            lit.span(),
            format!(
                "`{option}`: {:?} is longer than the cap of 365 days",
                lit.value()
            ),
        ));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::{parse, parse_capped};

    fn lit(s: &str) -> syn::LitStr {
        syn::LitStr::new(s, proc_macro2::Span::call_site())
    }

    #[test]
    fn humantime_forms() {
        assert_eq!(parse(&lit("30s"), "ttl", true).unwrap().as_secs(), 30);
        assert_eq!(parse(&lit("500ms"), "ttl", true).unwrap().as_millis(), 500);
        assert_eq!(parse(&lit("1m 30s"), "ttl", true).unwrap().as_secs(), 90);
        assert!(parse(&lit("0s"), "ttl", true).is_err());
        assert!(parse(&lit("0s"), "wait", false).unwrap().is_zero());
        assert!(parse(&lit("soon"), "ttl", true).is_err());
        assert_eq!(
            parse_capped(&lit("365d"), "ttl", true).unwrap().as_secs(),
            365 * 86_400
        );
        assert!(parse_capped(&lit("366d"), "ttl", true).is_err());
        assert!(parse_capped(&lit("400d"), "hold_at_least", false).is_err());
    }
}
