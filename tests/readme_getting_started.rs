//! The README's "Getting started" program is the one the crate docs compile as a doctest
//! (`src/lib.rs`, `cargo test --doc`), so the first screen a new user copies compiles.

/// The first code block fenced with `open` after `from` in `text`.
fn block_after<'a>(text: &'a str, from: &str, open: &str) -> &'a str {
    let at = text.find(from).unwrap_or_else(|| panic!("no {from:?}"));
    let rest = &text[at..];
    let start = rest
        .find(open)
        .unwrap_or_else(|| panic!("no {open:?} after {from:?}"))
        + open.len();
    let len = rest[start..].find("\n```").expect("an unclosed code block");
    &rest[start..start + len]
}

#[test]
fn readme_getting_started_is_the_crate_docs_doctest() {
    let readme = include_str!("../README.md");
    let docs: String = include_str!("../src/lib.rs")
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .map(|l| l.strip_prefix(' ').unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    let in_readme = block_after(readme, "## Getting started", "```rust\n");
    let in_docs = block_after(&docs, "## Getting started", "```no_run\n");
    assert!(
        in_readme.contains("#[dlock::distributed_lock("),
        "{in_readme}"
    );
    assert_eq!(
        in_readme, in_docs,
        "the README's getting-started program differs from the doctest in src/lib.rs"
    );
    for line in [
        "dlock = \"0.1\"",
        "features = [\"macros\", \"rt-multi-thread\"]",
    ] {
        assert!(
            readme.contains(line),
            "the README's Cargo.toml lines lack {line}"
        );
        assert!(
            docs.contains(line),
            "the crate docs' Cargo.toml lines lack {line}"
        );
    }
}
