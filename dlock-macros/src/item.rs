//! The annotated function, with its body kept as tokens (tracing's and tokio's habit): a body
//! that does not parse is left for rustc to report, not turned into a macro error.

use proc_macro2::{Span, TokenStream};
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::{Attribute, FnArg, Ident, Pat, Signature, Token, Visibility, braced};

pub(crate) struct MaybeItemFn {
    pub(crate) outer_attrs: Vec<Attribute>,
    pub(crate) inner_attrs: Vec<Attribute>,
    pub(crate) vis: Visibility,
    pub(crate) sig: Signature,
    pub(crate) body: TokenStream,
}

impl Parse for MaybeItemFn {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let outer_attrs = input.call(Attribute::parse_outer)?;
        let vis: Visibility = input.parse()?;
        let sig: Signature = input.parse()?;
        if input.peek(Token![;]) {
            return Err(syn::Error::new(
                input.span(),
                "distributed_lock needs a function with a body; put it on the impl, not on the trait declaration",
            ));
        }
        let content;
        braced!(content in input);
        let inner_attrs = content.call(Attribute::parse_inner)?;
        let body: TokenStream = content.parse()?;
        Ok(MaybeItemFn {
            outer_attrs,
            inner_attrs,
            vis,
            sig,
            body,
        })
    }
}

/// A name the key template may use: a parameter, a binding inside a parameter pattern, or `self`.
pub(crate) struct Binding {
    /// The name as written in templates (`r#type` is `type`).
    pub(crate) name: String,
    /// The tokens that name it in the body (`self` or the binding's identifier).
    pub(crate) tokens: TokenStream,
    /// Where errors about its value point.
    pub(crate) span: Span,
}

/// Every name the parameters bind, in order, after the const generic parameters.
pub(crate) fn bindings(sig: &Signature) -> Vec<Binding> {
    let mut out = Vec::new();
    for c in sig.generics.const_params() {
        push_ident(&c.ident, &mut out);
    }
    for input in &sig.inputs {
        match input {
            FnArg::Receiver(r) => {
                let self_token = r.self_token;
                out.push(Binding {
                    name: "self".to_string(),
                    tokens: quote::quote!(#self_token),
                    span: self_token.span(),
                });
            }
            FnArg::Typed(t) => collect(&t.pat, &mut out),
        }
    }
    out
}

fn push_ident(id: &Ident, out: &mut Vec<Binding>) {
    out.push(Binding {
        name: id.unraw().to_string(),
        tokens: quote::quote!(#id),
        span: id.span(),
    });
}

fn collect(pat: &Pat, out: &mut Vec<Binding>) {
    match pat {
        Pat::Ident(p) => {
            push_ident(&p.ident, out);
            if let Some((_, sub)) = &p.subpat {
                collect(sub, out);
            }
        }
        Pat::Reference(p) => collect(&p.pat, out),
        Pat::Paren(p) => collect(&p.pat, out),
        Pat::Type(p) => collect(&p.pat, out),
        Pat::Tuple(p) => p.elems.iter().for_each(|p| collect(p, out)),
        Pat::TupleStruct(p) => p.elems.iter().for_each(|p| collect(p, out)),
        Pat::Slice(p) => p.elems.iter().for_each(|p| collect(p, out)),
        Pat::Struct(p) => p.fields.iter().for_each(|f| collect(&f.pat, out)),
        // Or-patterns are refutable, so not valid parameters; the rest bind nothing.
        _ => {}
    }
}

/// Span to blame for return-type problems: the type's first token, or the fn name when there is
/// no return type.
pub(crate) fn return_span(sig: &Signature) -> Span {
    match &sig.output {
        syn::ReturnType::Type(_, ty) => ty.span(),
        syn::ReturnType::Default => sig.ident.span(),
    }
}

/// An error covering the whole return type (or the fn name when there is none).
pub(crate) fn return_error(sig: &Signature, msg: impl std::fmt::Display) -> syn::Error {
    match &sig.output {
        syn::ReturnType::Type(_, ty) => syn::Error::new_spanned(ty, msg),
        syn::ReturnType::Default => syn::Error::new(sig.ident.span(), msg),
    }
}

/// `tokens` with every span set to `span`, so that rustc reports errors in them there.
pub(crate) fn respan(tokens: TokenStream, span: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut tt| {
            if let proc_macro2::TokenTree::Group(g) = &tt {
                let mut ng = proc_macro2::Group::new(g.delimiter(), respan(g.stream(), span));
                ng.set_span(span);
                tt = proc_macro2::TokenTree::Group(ng);
            } else {
                tt.set_span(span);
            }
            tt
        })
        .collect()
}
