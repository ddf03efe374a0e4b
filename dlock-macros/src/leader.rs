//! `#[leader]`: the body runs while this process leads an election, cancelled on loss.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::visit_mut::VisitMut;
use syn::{ReturnType, Type};

use crate::args;
use crate::errors::Errors;
use crate::expand::{ImplTraitEraser, key_code, with_errors};
use crate::item::{self, MaybeItemFn};

/// The macro: `args` are the attribute's arguments, `item` the annotated function.
pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut errors = Errors::default();
    let args = args::parse_as(args::LEADER, args, &mut errors);
    let func = match syn::parse2::<MaybeItemFn>(item.clone()) {
        Ok(f) => f,
        Err(e) => {
            errors.push(e);
            return with_errors(item, &errors);
        }
    };
    let out = build(&args, &func, &mut errors);
    if !errors.is_empty() {
        return with_errors(item, &errors);
    }
    if std::env::var_os("DLOCK_MACROS_DEBUG").is_some_and(|v| v == "1") {
        eprintln!("#[leader] on `{}` expands to:\n{out}", func.sig.ident);
    }
    out
}

/// Whether the return type is `()` or `Option<T>` (which cannot carry the error).
fn cannot_carry_error(output: &ReturnType) -> bool {
    let ReturnType::Type(_, ty) = output else {
        return true;
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
        Type::Tuple(t) => t.elems.is_empty(),
        Type::Path(p) => {
            p.qself.is_none() && p.path.segments.last().is_some_and(|s| s.ident == "Option")
        }
        _ => false,
    }
}

fn build(args: &args::LockArgs, func: &MaybeItemFn, errors: &mut Errors) -> TokenStream {
    let sig = &func.sig;
    if sig.asyncness.is_none() {
        errors.push_spanned(
            sig.fn_token.span,
            "leader needs an async fn: the body runs while this process leads, across its `.await`s; add `async`",
        );
    }
    let krate = args
        .crate_path
        .clone()
        .unwrap_or_else(|| syn::parse_quote!(::dlock));
    let p = quote!(#krate::__private);
    let name_code = match &args.key {
        None => {
            errors.push_spanned(
                Span::call_site(),
                "missing `name`: name the election, e.g. `#[dlock::leader(name = \"scheduler\")]`",
            );
            TokenStream::new()
        }
        Some(lit) => key_code(lit, func, &p, errors),
    };
    if cannot_carry_error(&sig.output) {
        errors.push(item::return_error(
            sig,
            "leader gives a lost term (or a failed campaign) back as a `dlock::LockError` through the return type, so the function must return `Result<T, E>` with `E: From<dlock::LockError>`",
        ));
    }
    if !errors.is_empty() {
        return TokenStream::new();
    }
    let ret_span = item::return_span(sig);
    let fn_name = syn::ext::IdentExt::unraw(&sig.ident).to_string();
    let dur = |d: std::time::Duration| {
        let (s, n) = (d.as_secs(), d.subsec_nanos());
        quote!(#p::Duration::new(#s, #n))
    };
    let mut setters = Vec::new();
    if let Some(d) = args.ttl {
        let v = dur(d);
        setters.push(quote!(.ttl(#v)));
    }
    if let Some(d) = args.wait {
        let v = dur(d);
        setters.push(quote!(.wait(#v)));
    }
    if let Some(b) = &args.backend {
        setters.push(quote!(.backend(#b)));
    }
    if let Some(v) = &args.value {
        setters.push(quote!(.value(#v)));
    }
    let ret_ty = match &sig.output {
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
    let on_err = {
        let p = item::respan(p.clone(), ret_span);
        quote_spanned! {ret_span=> #p::busy_error(__dlock_e) }
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
            static __DLOCK_LEADER: #p::LeaderSpec = #p::LeaderSpec::new(#fn_name) #(#setters)*;
            let __dlock_name = #name_code;
            match #p::run_leader(&__DLOCK_LEADER, __dlock_name, async move {
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
