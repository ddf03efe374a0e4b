//! Procedural macros of the `dlock` toolkit (see the `dlock` crate).

use proc_macro::TokenStream;

/// Placeholder until the macro lands: passes the item through unchanged.
#[proc_macro_attribute]
pub fn distributed_lock(_args: TokenStream, item: TokenStream) -> TokenStream {
    item
}
