//! Procedural macros of the `dlock` toolkit: `#[distributed_lock]`. Use them through the `dlock`
//! crate, which the expansion calls into (`::dlock::__private`).
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]

mod args;
mod duration;
mod errors;
mod expand;
mod item;
mod template;

use proc_macro::TokenStream;

/// Runs an async function while holding a distributed lock (docs: `dlock::distributed_lock`).
#[proc_macro_attribute]
pub fn distributed_lock(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::expand(args.into(), item.into()).into()
}
