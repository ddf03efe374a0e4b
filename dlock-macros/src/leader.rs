//! `#[leader]`: the body runs while this process leads an election, cancelled on loss.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};

use crate::args;
use crate::errors::Errors;
use crate::expand::{
    Shape, common_setters, name_code, private_path, require_async, shape, with_errors, wrap,
};
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

fn build(args: &args::LockArgs, func: &MaybeItemFn, errors: &mut Errors) -> TokenStream {
    let sig = &func.sig;
    require_async(
        sig,
        "leader needs an async fn: the body runs while this process leads, across its `.await`s; add `async`",
        errors,
    );
    let p = private_path(args);
    let name_code = name_code(
        args,
        func,
        &p,
        errors,
        "missing `name`: name the election, e.g. `#[dlock::leader(name = \"scheduler\")]`",
    );
    if shape(&sig.output) != Shape::Other {
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
    let mut setters = common_setters(args, &p);
    if let Some(v) = &args.value {
        setters.push(quote!(.value(#v)));
    }
    let on_err = {
        let p = item::respan(p.clone(), ret_span);
        quote_spanned! {ret_span=> #p::busy_error(__dlock_e) }
    };
    let spec =
        quote!(static __DLOCK_LEADER: #p::LeaderSpec = #p::LeaderSpec::new(#fn_name) #(#setters)*;);
    let run = quote!(#p::run_leader);
    wrap(
        func,
        &p,
        spec,
        name_code,
        (run, quote!(__DLOCK_LEADER)),
        on_err,
    )
}
