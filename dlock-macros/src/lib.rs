//! Procedural macros of the `dlock` toolkit: `#[distributed_lock]` and `#[leader]`. Use them through the `dlock`
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
mod leader;
use dlock_template as template;

use proc_macro::TokenStream;

/// Runs an `async fn` while holding a distributed lock.
///
/// ```ignore
/// use dlock::{distributed_lock, LockError};
///
/// #[distributed_lock(key = "order:{order_id}", ttl = "30s", wait = "5s")]
/// async fn pay(order_id: u64, amount: u64) -> Result<u64, LockError> {
///     // Runs under the lock; `dlock::fencing_token()` is this hold's token.
///     Ok(amount)
/// }
/// ```
///
/// The body runs between acquire and release; the guard covers the whole body, early `return`s
/// and `?` included. The release is awaited before the function returns, so a call made right
/// after finds the lock free (unless `hold_at_least` keeps it). Only a call whose future is
/// dropped mid-way leaves the release to the guard's background task. The signature is kept as
/// written: attributes, docs, visibility, generics, `where` clauses, `&self` / `&mut self` /
/// `self: Arc<Self>` receivers, `impl Trait` arguments and returns, async fns in trait impls,
/// and `#[tracing::instrument]` above or below.
///
/// # Options
///
/// | option | value | default |
/// |---|---|---|
/// | `key` | template (below); required | — |
/// | `ttl` | humantime duration (`"30s"`, `"500ms"`, `"1m 30s"`), not zero | `"30s"` |
/// | `wait` | how long to wait for a busy lock | `"0s"`: fail fast |
/// | `backend` | a registered backend name (`dlock::init`, `dlock::register`) | `"default"` |
/// | `watchdog` | `true` / `false`: renew the lease every ttl/3 while the body runs | `true` |
/// | `fair` | `true` / `false`: waiters served in arrival order across processes (`dlock::Lock::fair`; memory, Redis, Sentinel, Cluster, ZooKeeper, etcd; not with `semaphore` or `mode`) | `false` |
/// | `on_busy` | `"error"` / `"skip"` | `"error"` |
/// | `hold_at_least` | keep the lock this long after acquiring it, even when the body ends sooner | none |
/// | `mode` | `"read"` / `"write"`: run under that side of a `dlock::RwLock` named `key` instead of a lock (many readers or one writer; no `hold_at_least`; `"write"` inside a `"read"` body of the same key fails with `LockError::UpgradeRefused`) | a lock |
/// | `on_lost` | `"cancel"` / `"continue"` | `"cancel"` |
/// | `policy` | a named policy (`dlock::define_policy`, `dlock::load_policies`, env) | none |
/// | `semaphore` | integer ≥ 1: run under permits of the semaphore `key` of this many permits (`dlock::Semaphore`) instead of the lock; no `hold_at_least` | none: a lock |
/// | `permits` | integer from 1 to `semaphore`: the permits one call takes | `1` |
/// | `crate` | path of the `dlock` crate, for renamed dependencies (`crate = "my_dlock"`) | `"::dlock"` |
///
/// Durations are parsed at compile time; an unparsable value or a zero `ttl` is a compile error
/// on the literal. Options written in the attribute win over the policy; see `dlock`'s policy
/// docs for the layers (attribute > environment > policy file > code > defaults). Settings are
/// resolved once, at the function's first call.
///
/// * `on_busy = "error"`: a busy or timed-out lock (and any other acquire error) is returned
///   converted with `From`, so the return type must be `Result<T, E>` with
///   `E: From<dlock::LockError>` (an alias of one too); any other return type is a compile error
///   at the return type that says so.
/// * `on_busy = "skip"`: the body does not run and the function returns `()` or `None`; the
///   return type must be `()` or `Option<T>`. A busy lock is a `debug` event, any other error an
///   `error` event.
/// * With `policy` and no `on_busy` in the attribute, the return type decides: a `Result`
///   carries the error, `()` / `Option<T>` skip.
/// * `on_lost = "cancel"`: when the lease is lost while the body runs (the watchdog finds another
///   owner, or the lease ran out), the body future is dropped and the function returns
///   `Err(LockError::Lost { .. })` converted as above (a skip function returns `()`/`None`).
///   `"continue"` lets the body finish.
///
/// # Key templates
///
/// `{name}` is a parameter, a binding of a destructuring pattern (`Path(order_id): Path<u64>`)
/// or a const generic; `{name.field.sub}` (or `{pair.0}`) a field path; `{self.field}` a field of
/// the receiver. Values are formatted with `Display` (a missing `Display` is reported at the
/// parameter). `{{` and `}}` are literal braces.
///
/// **Escaping rule.** Each interpolated value gets a `\` before every `\` it contains and before
/// every occurrence of the first character of the literal text that follows the placeholder
/// (nothing else). With `"a:{x}:{y}"`, `x = "1:2"` renders `a:1\:2:3` while `x = "1", y = "2:3"`
/// renders `a:1:2:3`: two different locks. A value without those characters renders unchanged,
/// so `order_id = 42` with `"order:{order_id}"` and `dlock::Lock::new("order:42")` name the same
/// lock. To keep rendering unambiguous, two placeholders need literal text between them
/// (`"{a}{b}"` is a compile error) and that text must not start with `\`.
///
/// # Compile errors
///
/// A non-async fn, an unknown option (listing the valid ones, with a "did you mean"), a
/// duplicate option, a missing `key`, a placeholder that names no parameter or binding, an
/// unclosed `{` or unmatched `}`, a bad duration, a bad `on_busy` / `on_lost` value, and a return
/// type that does not fit `on_busy`: each is reported at the offending token, all at once, and
/// the function is still emitted so that its callers keep compiling.
///
/// ```ignore
/// #[dlock::distributed_lock(key = "job", on_busy = "skip")]
/// async fn job() -> Result<(), dlock::LockError> { Ok(()) }
/// // error: on_busy = "skip" returns without running the body when the lock is busy, so the
/// //        function must return `()` or `Option<T>` ...
/// ```
///
/// The full list, with the exact messages, is the UI suite: `tests/ui/fail/*.rs` and their
/// `.stderr` files in the repository.
///
/// Set `DLOCK_MACROS_DEBUG=1` while building to print each expansion to stderr.
#[proc_macro_attribute]
pub fn distributed_lock(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::expand(args.into(), item.into()).into()
}

/// Renders a lock name from a key template exactly as `#[distributed_lock(key = "...")]` does,
/// over the variables in scope: `dlock::key!("order:{order_id}:{user.id}")` is a `String`.
/// Values are formatted with `Display` and escaped by the attribute's rule (`\`, `:` and the
/// first character of the literal after the placeholder get a `\`), so
/// `Lock::new(dlock::key!("order:{id}"))` names the same lock as the attribute with that key.
/// The template is checked at compile time with the attribute's messages.
///
/// ```ignore
/// let order_id = 42;
/// assert_eq!(dlock::key!("order:{order_id}"), "order:42");
/// ```
#[proc_macro]
pub fn key(input: TokenStream) -> TokenStream {
    expand::key_macro(input.into()).into()
}

/// Runs an `async fn` only while this process leads the election `name`, on any engine:
/// every call campaigns (waiting its turn, FIFO where the engine has it), runs the body once
/// leading, and gives the term back when the body returns. When the term is lost (its lease ran
/// out, the store gave it to another candidate) the body is dropped at its next `.await` and the
/// function returns `Err(LockError::Lost { .. })` converted with `From`; call it in a loop to
/// campaign again. Inside the body `dlock::fencing_token()` is the term's epoch (strictly
/// increasing across terms): send it with every write.
///
/// ```ignore
/// #[dlock::leader(name = "scheduler", ttl = "15s", value = "10.0.0.7:8080")]
/// async fn schedule() -> Result<(), dlock::LockError> {
///     let epoch = dlock::fencing_token().expect("leading");
///     loop { tick(epoch).await; }
/// }
/// ```
///
/// | option | value | default |
/// |---|---|---|
/// | `name` | the election's name: a template as `distributed_lock`'s `key` (`"shard:{id}"`); required | — |
/// | `ttl` | the term's lease, renewed every ttl/3; a leader that stops renewing is replaced after it | `"15s"` |
/// | `wait` | how long to campaign before `LockError::TimedOut` | for ever |
/// | `backend` | a registered backend name | `"default"` |
/// | `value` | the value followers read with `dlock::Election::observe` (an address) | `""` |
/// | `crate` | path of the `dlock` crate | `"::dlock"` |
///
/// The compile-time checks are `distributed_lock`'s: a non-async fn, an unknown or duplicate
/// option (with a "did you mean"), a missing `name`, a placeholder that names no parameter, a bad
/// duration, and a return type that cannot carry the error (it must be `Result<T, E>` with
/// `E: From<dlock::LockError>`) are compile errors at the offending token. The election is the
/// one `dlock::Election::new(name)` campaigns in.
#[proc_macro_attribute]
pub fn leader(args: TokenStream, item: TokenStream) -> TokenStream {
    leader::expand(args.into(), item.into()).into()
}
