//! The error accumulator every pass writes into (serde's `Ctxt`, without the panic).

use proc_macro2::TokenStream;

/// Collects `syn::Error`s so that every mistake is reported in one compilation.
#[derive(Default)]
pub(crate) struct Errors(Option<syn::Error>);

impl Errors {
    pub(crate) fn push(&mut self, e: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }

    pub(crate) fn push_spanned(&mut self, span: proc_macro2::Span, msg: impl std::fmt::Display) {
        self.push(syn::Error::new(span, msg));
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    /// The `compile_error!` invocations for everything collected (empty when nothing was).
    pub(crate) fn to_compile_errors(&self) -> TokenStream {
        self.0
            .as_ref()
            .map(syn::Error::to_compile_error)
            .unwrap_or_default()
    }
}
