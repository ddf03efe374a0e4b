//! Builds the new function: the signature untouched, the body glue calling `__private`.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, format_ident, quote, quote_spanned};
use syn::visit_mut::VisitMut;
use syn::{ReturnType, Type};

use crate::args::{self, LockArgs, OnBusy, OnLost, RwMode};
use crate::errors::Errors;
use crate::item::{self, MaybeItemFn};
use crate::template::{self, Segment};

/// The macro: `args` are the attribute's arguments, `item` the annotated function.
pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut errors = Errors::default();
    let args = args::parse(args, &mut errors);
    let func = match syn::parse2::<MaybeItemFn>(item.clone()) {
        Ok(f) => f,
        Err(e) => {
            errors.push(e);
            return with_errors(item, &errors);
        }
    };
    let out = build(&args, &func, &mut errors);
    if !errors.is_empty() {
        // Keep the function as written so that callers still compile and only our errors show.
        return with_errors(item, &errors);
    }
    if std::env::var_os("DLOCK_MACROS_DEBUG").is_some_and(|v| v == "1") {
        eprintln!(
            "#[distributed_lock] on `{}` expands to:\n{out}",
            func.sig.ident
        );
    }
    out
}

pub(crate) fn with_errors(mut item: TokenStream, errors: &Errors) -> TokenStream {
    item.extend(errors.to_compile_errors());
    item
}

/// What a busy (or otherwise failed) acquisition turns into.
enum BusyMapping {
    /// `Err(From::from(e))`: the return type is `Result<T, E: From<LockError>>`.
    Error,
    /// `()` or `None`.
    Skip,
    /// Attribute silent, policy named: decided at run time by the return type and the policy.
    ByReturnType,
}

/// What a return type can carry: nothing (`()`), a skipped call (`Option<T>`), or an error.
#[derive(PartialEq, Eq)]
pub(crate) enum Shape {
    Unit,
    Option,
    Other,
}

pub(crate) fn shape(output: &ReturnType) -> Shape {
    let ReturnType::Type(_, ty) = output else {
        return Shape::Unit;
    };
    let mut ty = &**ty;
    loop {
        match ty {
            Type::Paren(p) => ty = &p.elem,
            Type::Group(g) => ty = &g.elem,
            _ => break,
        }
    }
    match ty {
        Type::Tuple(t) if t.elems.is_empty() => Shape::Unit,
        Type::Path(p)
            if p.qself.is_none()
                && p.path.segments.last().is_some_and(|s| {
                    s.ident == "Option"
                        && matches!(s.arguments, syn::PathArguments::AngleBracketed(_))
                }) =>
        {
            Shape::Option
        }
        _ => Shape::Other,
    }
}

fn build(args: &LockArgs, func: &MaybeItemFn, errors: &mut Errors) -> TokenStream {
    let sig = &func.sig;
    require_async(
        sig,
        "distributed_lock needs an async fn: the lock is held across the body's `.await`s; add `async`",
        errors,
    );
    let p = private_path(args);

    // The key.
    let key_code = name_code(
        args,
        func,
        &p,
        errors,
        "missing `key`: name the lock, e.g. `#[distributed_lock(key = \"order:{order_id}\")]`",
    );

    // A read-write lock has no `hold_at_least` (a read hold kept after its body would hold
    // writers back for nothing).
    if let (Some((_, span)), Some(_)) = (args.mode, args.hold_at_least) {
        errors.push_spanned(
            span,
            "`mode` takes a side of a read-write lock, which has no `hold_at_least`; remove one of them",
        );
    }

    // The busy mapping, checked against the return type.
    let shape = shape(&sig.output);
    let ret_span = item::return_span(sig);
    let mapping = match (args.on_busy, &args.policy) {
        (Some((OnBusy::Skip, _)), _) => {
            if shape == Shape::Other {
                errors.push(item::return_error(
                    sig,
                    "on_busy = \"skip\" returns without running the body when the lock is busy, so the function must return `()` or `Option<T>` (the skipped call gives `()` or `None`); use on_busy = \"error\" to get the error in a `Result`",
                ));
            }
            BusyMapping::Skip
        }
        (None, Some(_)) => BusyMapping::ByReturnType,
        (Some((OnBusy::Error, _)), _) | (None, None) => {
            if shape != Shape::Other {
                let what = if args.on_busy.is_some() {
                    "on_busy = \"error\""
                } else {
                    "on_busy = \"error\" (the default)"
                };
                errors.push(item::return_error(
                    sig,
                    format!(
                        "{what} gives the busy `dlock::LockError` back through the return type, so the function must return `Result<T, E>` with `E: From<dlock::LockError>`; for a function returning `()` or `Option<T>`, write on_busy = \"skip\""
                    ),
                ));
            }
            BusyMapping::Error
        }
    };
    if !errors.is_empty() {
        return TokenStream::new();
    }

    // The static spec, built by const fns at compile time.
    let mut setters = common_setters(args, &p);
    if let Some(d) = args.hold_at_least {
        let v = duration(&p, d);
        setters.push(quote!(.hold_at_least(#v)));
    }
    if let Some(w) = args.watchdog {
        setters.push(quote!(.watchdog(#w)));
    }
    if let Some((f, _)) = args.fair {
        setters.push(quote!(.fair(#f)));
    }
    if let Some((b, _)) = args.on_busy {
        let v = match b {
            OnBusy::Error => quote!(Error),
            OnBusy::Skip => quote!(Skip),
        };
        setters.push(quote!(.on_busy(#p::OnBusy::#v)));
    }
    if let Some(l) = args.on_lost {
        let v = match l {
            OnLost::Cancel => quote!(Cancel),
            OnLost::Continue => quote!(Continue),
        };
        setters.push(quote!(.on_lost(#p::OnLost::#v)));
    }
    if let Some(name) = &args.policy {
        setters.push(quote!(.policy(#name)));
    }
    if let Some(name) = &args.metric_name {
        setters.push(quote!(.metric_name(#name)));
    }
    if let Some((max, _)) = args.semaphore {
        let n = args.permits.map_or(1, |(n, _)| n);
        setters.push(quote!(.semaphore(#max, #n)));
    }
    if let Some((m, _)) = args.mode {
        let v = match m {
            RwMode::Read => quote!(Read),
            RwMode::Write => quote!(Write),
        };
        setters.push(quote!(.mode(#p::RwMode::#v)));
    }

    let err = format_ident!("__dlock_e");
    let fn_name = syn::ext::IdentExt::unraw(&sig.ident).to_string();
    let on_err = match mapping {
        // Spanned (path included) at the return type, so that a missing
        // `E: From<LockError>` is reported there.
        BusyMapping::Error => {
            let p = item::respan(p.clone(), ret_span);
            quote_spanned! {ret_span=> #p::busy_error(#err) }
        }
        BusyMapping::Skip => quote!(#p::skipped(&__DLOCK_SPEC, #err)),
        BusyMapping::ByReturnType => {
            let p = item::respan(p.clone(), ret_span);
            quote_spanned! {ret_span=> #p::busy_return(&__DLOCK_SPEC, #err) }
        }
    };

    let spec =
        quote!(static __DLOCK_SPEC: #p::LockSpec = #p::LockSpec::new(#fn_name) #(#setters)*;);
    let run = quote!(#p::run_locked);
    wrap(
        func,
        &p,
        spec,
        key_code,
        (run, quote!(__DLOCK_SPEC)),
        on_err,
    )
}

/// Refuses a function that is not `async` with `message` on its `fn` token.
pub(crate) fn require_async(sig: &syn::Signature, message: &str, errors: &mut Errors) {
    if sig.asyncness.is_none() {
        errors.push_spanned(sig.fn_token.span, message);
    }
}

/// `<crate>::__private`: `::dlock` unless the attribute's `crate = "..."` names another path.
pub(crate) fn private_path(args: &LockArgs) -> TokenStream {
    let krate = args
        .crate_path
        .clone()
        .unwrap_or_else(|| syn::parse_quote!(::dlock));
    quote!(#krate::__private)
}

/// The code that renders the attribute's name template (`key`, or `name` for `#[leader]`);
/// `missing` is the error when there is none.
pub(crate) fn name_code(
    args: &LockArgs,
    func: &MaybeItemFn,
    p: &TokenStream,
    errors: &mut Errors,
    missing: &str,
) -> TokenStream {
    match &args.key {
        None => {
            errors.push_spanned(Span::call_site(), missing);
            TokenStream::new()
        }
        Some(lit) => key_code(lit, func, p, errors),
    }
}

/// A `Duration` known at compile time, as a const expression.
pub(crate) fn duration(p: &TokenStream, d: std::time::Duration) -> TokenStream {
    let (s, n) = (d.as_secs(), d.subsec_nanos());
    quote!(#p::Duration::new(#s, #n))
}

/// The spec setters every attribute shares: `ttl`, `wait` and `backend`.
pub(crate) fn common_setters(args: &LockArgs, p: &TokenStream) -> Vec<TokenStream> {
    let mut setters = Vec::new();
    if let Some(d) = args.ttl {
        let v = duration(p, d);
        setters.push(quote!(.ttl(#v)));
    }
    if let Some(d) = args.wait {
        let v = duration(p, d);
        setters.push(quote!(.wait(#v)));
    }
    if let Some(b) = &args.backend {
        setters.push(quote!(.backend(#b)));
    }
    setters
}

/// The new function: the signature untouched; the body declares `spec` (the static item named
/// `run.1`), binds the rendered name to `__dlock_key`, runs the original body by
/// `run.0(&spec, __dlock_key, body)` and maps its `Err(__dlock_e)` with `on_err`.
///
/// The body starts with a fake return edge that makes `?`, `.into()` and early `return` in the
/// body infer as they did in the original fn (tracing's technique), with `impl Trait` erased
/// to `_`.
pub(crate) fn wrap(
    func: &MaybeItemFn,
    p: &TokenStream,
    spec: TokenStream,
    name_code: TokenStream,
    run: (TokenStream, TokenStream),
    on_err: TokenStream,
) -> TokenStream {
    let (runner, spec_name) = run;
    let ret_span = item::return_span(&func.sig);
    let ret_ty = match &func.sig.output {
        ReturnType::Default => quote!(()),
        ReturnType::Type(_, ty) => {
            let mut ty = (**ty).clone();
            ImplTraitEraser.visit_type_mut(&mut ty);
            ty.into_token_stream()
        }
    };
    let fake_return = quote_spanned! {ret_span=>
        #[allow(
            unknown_lints,
            unreachable_code,
            clippy::diverging_sub_expression,
            clippy::empty_loop,
            clippy::let_unit_value,
            clippy::let_with_type_underscore,
            clippy::needless_return,
            clippy::unreachable
        )]
        if false {
            let __dlock_fake_return: #ret_ty = loop {};
            return __dlock_fake_return;
        }
    };
    let MaybeItemFn {
        outer_attrs,
        inner_attrs,
        vis,
        sig,
        body,
    } = func;
    quote! {
        #(#outer_attrs)*
        #vis #sig {
            #(#inner_attrs)*
            #spec
            let __dlock_key = #name_code;
            match #runner(&#spec_name, __dlock_key, async move {
                #fake_return
                #body
            })
            .await
            {
                #p::core::result::Result::Ok(__dlock_v) => __dlock_v,
                #[allow(clippy::useless_conversion)]
                #p::core::result::Result::Err(__dlock_e) => #on_err,
            }
        }
    }
}

/// Parses a key template literal with the shared scanner, then checks that every name in a
/// placeholder is a Rust identifier, a keyword (`{d.type}` reads the field `r#type`) or a raw
/// identifier (the scanner only knows letters and digits: `{a.b²}` passed it and made
/// `Ident::new` panic).
fn parse_template(lit: &syn::LitStr) -> Result<template::Template, Vec<String>> {
    let tpl = template::parse(&lit.value())?;
    let mut errors = Vec::new();
    for seg in &tpl.segments {
        let Segment::Value(path) = seg else { continue };
        for (n, part) in path.iter().enumerate() {
            let index = n > 0 && part.chars().all(|c| c.is_ascii_digit());
            if index || (n == 0 && part == "self") || try_ident(part).is_some() {
                continue;
            }
            errors.push(format!(
                "`{{{}}}`: `{part}` is not a Rust identifier",
                path.join(".")
            ));
        }
    }
    if errors.is_empty() {
        Ok(tpl)
    } else {
        Err(errors)
    }
}

/// `name` as an identifier: as written, or raw when it is a keyword (`type` -> `r#type`).
fn try_ident(name: &str) -> Option<syn::Ident> {
    syn::parse_str::<syn::Ident>(name)
        .or_else(|_| syn::parse_str::<syn::Ident>(&format!("r#{name}")))
        .ok()
}

/// An identifier for a placeholder name `parse_template` accepted, spanned at `span`.
fn ident(name: &str, span: Span) -> syn::Ident {
    let mut id =
        try_ident(name).unwrap_or_else(|| syn::Ident::new("__dlock_invalid_placeholder", span));
    id.set_span(span);
    id
}

/// The block that renders the key template (see the crate docs for the escaping rule).
pub(crate) fn key_code(
    lit: &syn::LitStr,
    func: &MaybeItemFn,
    p: &TokenStream,
    errors: &mut Errors,
) -> TokenStream {
    let tpl = match parse_template(lit) {
        Ok(t) => t,
        Err(msgs) => {
            for m in msgs {
                errors.push_spanned(lit.span(), m);
            }
            return TokenStream::new();
        }
    };
    let bindings = item::bindings(&func.sig);
    let mut stmts = Vec::new();
    let mut cap = 0usize;
    for (i, seg) in tpl.segments.iter().enumerate() {
        match seg {
            Segment::Lit(s) => {
                cap += s.len();
                stmts.push(quote!(__dlock_k.lit(#s);));
            }
            Segment::Value(path) => {
                cap += 8;
                let root = &path[0];
                let unraw = root.strip_prefix("r#").unwrap_or(root);
                let Some(b) = bindings.iter().find(|b| b.name == unraw) else {
                    let msg = if root == "self" {
                        format!(
                            "`{{{}}}`: `{}` has no `self` receiver",
                            path.join("."),
                            func.sig.ident
                        )
                    } else {
                        let names: Vec<&str> = bindings
                            .iter()
                            .filter(|b| b.name != "self")
                            .map(|b| b.name.as_str())
                            .collect();
                        let known = if names.is_empty() {
                            "it has none".to_string()
                        } else {
                            format!("it has: {}", names.join(", "))
                        };
                        let mut msg = format!(
                            "`{{{}}}` in the key is neither a parameter of `{}` nor a binding in its parameter patterns ({known})",
                            path.join("."),
                            func.sig.ident
                        );
                        if let Some(hint) = crate::args::closest(&path[0], &names) {
                            let mut fixed = vec![hint.to_string()];
                            fixed.extend(path[1..].iter().cloned());
                            msg.push_str(&format!(
                                "\n\nhelp: did you mean `{{{}}}`?",
                                fixed.join(".")
                            ));
                        }
                        msg
                    };
                    errors.push_spanned(lit.span(), msg);
                    continue;
                };
                let span = b.span;
                let mut expr = b.tokens.clone();
                push_fields(&mut expr, &path[1..], span);
                let special = tpl.special_after(i);
                // Spanned at the parameter, so a value without `Display` is reported there.
                stmts.push(quote_spanned!(span=> __dlock_k.value(&#expr, #special);));
            }
        }
    }
    quote! {{
        let mut __dlock_k = #p::KeyBuf::with_capacity(#cap);
        #(#stmts)*
        __dlock_k.finish()
    }}
}

/// Appends `.field` / `.0` accesses for a placeholder's field path, spanned at `span`.
fn push_fields(expr: &mut TokenStream, fields: &[String], span: Span) {
    for field in fields {
        if field.chars().all(|c| c.is_ascii_digit()) {
            let idx = syn::Index {
                index: field.parse().unwrap_or(0),
                span,
            };
            expr.extend(quote_spanned!(span=> .#idx));
        } else {
            let id = ident(field, span);
            expr.extend(quote_spanned!(span=> .#id));
        }
    }
}

/// `key!("order:{order_id}:{user.id}")`: the attribute's key rendering over the variables in
/// scope (a `String`), for the manual API. `key!(crate = my_dlock, "...")` names the facade.
pub(crate) fn key_macro(input: TokenStream) -> TokenStream {
    let parsed = syn::parse::Parser::parse2(
        |s: syn::parse::ParseStream<'_>| {
            let mut krate: syn::Path = syn::parse_quote!(::dlock);
            if s.peek(syn::Token![crate]) {
                s.parse::<syn::Token![crate]>()?;
                s.parse::<syn::Token![=]>()?;
                krate = s.parse()?;
                s.parse::<syn::Token![,]>()?;
            }
            let lit: syn::LitStr = s.parse()?;
            let _ = s.parse::<Option<syn::Token![,]>>()?;
            Ok((krate, lit))
        },
        input,
    );
    let (krate, lit) = match parsed {
        Ok(v) => v,
        Err(e) => return e.to_compile_error(),
    };
    let p = quote!(#krate::__private);
    let tpl = match parse_template(&lit) {
        Ok(t) => t,
        Err(msgs) => {
            let mut errors = Errors::default();
            for m in msgs {
                errors.push_spanned(lit.span(), m);
            }
            return errors.to_compile_errors();
        }
    };
    let span = lit.span();
    let mut stmts = Vec::new();
    let mut cap = 0usize;
    for (i, seg) in tpl.segments.iter().enumerate() {
        match seg {
            Segment::Lit(s) => {
                cap += s.len();
                stmts.push(quote!(__dlock_k.lit(#s);));
            }
            Segment::Value(path) => {
                cap += 8;
                let mut expr = if path[0] == "self" {
                    quote_spanned!(span=> self)
                } else {
                    let id = ident(&path[0], span);
                    quote_spanned!(span=> #id)
                };
                push_fields(&mut expr, &path[1..], span);
                let special = tpl.special_after(i);
                stmts.push(quote_spanned!(span=> __dlock_k.value(&#expr, #special);));
            }
        }
    }
    quote! {{
        let mut __dlock_k = #p::KeyBuf::with_capacity(#cap);
        #(#stmts)*
        __dlock_k.finish()
    }}
}

/// Replaces `impl Trait` with `_` in the fake return edge's type.
pub(crate) struct ImplTraitEraser;

impl VisitMut for ImplTraitEraser {
    fn visit_type_mut(&mut self, t: &mut Type) {
        if let Type::ImplTrait(it) = t {
            *t = Type::Infer(syn::TypeInfer {
                underscore_token: syn::Token![_](syn::spanned::Spanned::span(it)),
            });
        } else {
            syn::visit_mut::visit_type_mut(self, t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::expand;
    use quote::quote;

    fn errors_of(args: proc_macro2::TokenStream, item: proc_macro2::TokenStream) -> String {
        expand(args, item).to_string()
    }

    #[test]
    fn non_async_is_an_error_and_the_fn_is_kept() {
        let out = errors_of(
            quote!(key = "k"),
            quote!(
                fn f() -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert!(out.contains("distributed_lock needs an async fn"), "{out}");
        assert!(out.contains("fn f"), "{out}");
    }

    #[test]
    fn unknown_placeholder() {
        let out = errors_of(
            quote!(key = "k:{nope}"),
            quote!(
                async fn f(id: u64) -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert!(out.contains("neither a parameter"), "{out}");
        assert!(out.contains("it has: id"), "{out}");
        assert!(!out.contains("did you mean"), "{out}");
        let out = errors_of(
            quote!(key = "k:{ordr_id}:{user.nme}"),
            quote!(
                async fn f(order_id: u64, user: U) -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert!(out.contains("did you mean `{order_id}`"), "{out}");
        let out = errors_of(
            quote!(key = "k:{order}"),
            quote!(
                async fn f(order_id: u64, user: U) -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert!(out.contains("did you mean `{order_id}`"), "{out}");
    }

    #[test]
    fn expands_to_run_locked() {
        let out = errors_of(
            quote!(key = "order:{id}", ttl = "10s", crate = "my_dlock"),
            quote!(
                async fn f(id: u64) -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert!(out.contains("my_dlock :: __private :: run_locked"), "{out}");
        assert!(!out.contains("compile_error"), "{out}");
    }

    #[test]
    fn pattern_bindings_are_found() {
        let out = errors_of(
            quote!(key = "order:{order_id}:{a}"),
            quote!(
                async fn f(Path(order_id): Path<u64>, S { a, .. }: S) -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert!(!out.contains("compile_error"), "{out}");
    }
}
