//! HTTP integration (feature `axum`): [`LockError`] as an axum response, and a tower
//! [`LockLayer`] that takes a lock around any service, per request.
//!
//! # Status codes
//!
//! | error | status | body / headers |
//! |---|---|---|
//! | [`LockError::Busy`], [`LockError::TimedOut`] | `409 Conflict` (or what [`set_busy_status`] / [`LockLayer::busy_status`] chose: `423 Locked`, `503`) | `Retry-After`: by default the holder's remaining lease capped at 1 s ([`RetryAfter`]; [`set_retry_after`] / [`LockLayer::retry_after`]) |
//! | [`LockError::Lost`], [`LockError::NotOwner`], [`LockError::Backend`] | `503 Service Unavailable` | no internals; the error is logged as a `warn` event |
//! | [`LockError::InvalidKey`] | `400 Bad Request` | |
//! | the layer's extractor found no key | `400 Bad Request` | `x-dlock-error: no-lock-key`; the first one per layer is logged as a `warn` event |
//! | [`LockError::Config`], [`LockError::UnknownBackend`], [`LockError::UnknownPolicy`], [`LockError::Unsupported`], [`LockError::SemaphoreMax`], [`LockError::UpgradeRefused`] | `500` | logged as an `error` event |
//!
//! # The layer
//!
//! ```
//! # use std::time::Duration;
//! # use dlock_runtime as dlock;
//! use dlock::web::{LockLayer, path_key};
//! let layer = LockLayer::new(path_key("/orders/{id}/pay", "order:{id}").unwrap())
//!     .ttl(Duration::from_secs(10))
//!     .wait(Duration::from_millis(200));
//! // axum: Router::new().route("/orders/{id}/pay", post(pay)).route_layer(layer)
//! # let _ = layer;
//! ```
//!
//! Per request the layer extracts the key (a request without one answers `400`), acquires,
//! puts the [`FencingToken`] in the request's extensions, runs the inner service inside the
//! guard's scope (so [`crate::fencing_token`] and re-entrant nested locks work there), and
//! releases when the inner service's response future completes. The response body is passed
//! through untouched (it is streamed after the lock is released). If the client goes away, the
//! server drops the response future, and with it the guard, which releases in the background.
//! If the lease is lost while the inner service runs, its future is dropped and the reply is `503`.

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use http::{Request, Response, StatusCode};

use crate::backend::BoxFuture;
use crate::lock::{DEFAULT_TTL, Lock};
use crate::{LockError, registry};

static BUSY_STATUS: AtomicU16 = AtomicU16::new(409);

/// What a busy or timed-out answer puts in `Retry-After`.
///
/// The holder's remaining lease is when the lock frees at the latest, which for a 30 s lease
/// around a handler that takes milliseconds tells a client to wait 30 s for nothing; the default
/// is [`RetryAfter::AtMost`] one second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryAfter {
    /// The holder's remaining lease, in whole seconds rounded up (omitted when unknown).
    Lease,
    /// The holder's remaining lease, but at most this long (whole seconds rounded up, at least
    /// 1); this long when the backend did not report the lease. The default is one second.
    AtMost(Duration),
    /// No `Retry-After` header.
    Omit,
}

impl Default for RetryAfter {
    fn default() -> Self {
        RetryAfter::AtMost(Duration::from_secs(1))
    }
}

impl RetryAfter {
    /// The header's value for an error whose holder's lease has `remaining` left (if known).
    pub fn seconds(self, remaining: Option<Duration>) -> Option<u64> {
        match self {
            RetryAfter::Lease => remaining.map(retry_after_secs),
            RetryAfter::AtMost(cap) => {
                Some(retry_after_secs(remaining.map_or(cap, |r| r.min(cap))))
            }
            RetryAfter::Omit => None,
        }
    }
}

static RETRY_AFTER_SETTING: std::sync::RwLock<Option<RetryAfter>> = std::sync::RwLock::new(None);

/// Sets what [`LockError`]'s `IntoResponse` puts in `Retry-After` (default
/// [`RetryAfter::AtMost`] one second). Process-wide; a [`LockLayer`] has its own setting.
pub fn set_retry_after(r: RetryAfter) {
    *RETRY_AFTER_SETTING
        .write()
        .unwrap_or_else(|e| e.into_inner()) = Some(r);
}

/// The setting [`set_retry_after`] chose.
pub fn retry_after() -> RetryAfter {
    RETRY_AFTER_SETTING
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .unwrap_or_default()
}

/// Sets the status that [`LockError`]'s `IntoResponse` gives busy and timed-out errors
/// (default `409 Conflict`; `423 Locked` and `503 Service Unavailable` are the usual choices).
/// Process-wide; a [`LockLayer`] has its own setting.
pub fn set_busy_status(status: StatusCode) {
    BUSY_STATUS.store(status.as_u16(), Ordering::Relaxed);
}

/// The status [`set_busy_status`] chose.
pub fn busy_status() -> StatusCode {
    StatusCode::from_u16(BUSY_STATUS.load(Ordering::Relaxed)).unwrap_or(StatusCode::CONFLICT)
}

/// `Retry-After` for a remaining lease: whole seconds, rounded up, at least 1.
pub fn retry_after_secs(remaining: Duration) -> u64 {
    (remaining.as_millis().div_ceil(1000) as u64).max(1)
}

/// The status for an error, with `busy` for busy and timed-out errors.
pub fn status_for(e: &LockError, busy: StatusCode) -> StatusCode {
    match e {
        LockError::Busy { .. } | LockError::TimedOut { .. } => busy,
        LockError::InvalidKey { .. } => StatusCode::BAD_REQUEST,
        LockError::Config(_)
        | LockError::UnknownBackend { .. }
        | LockError::UnknownPolicy { .. }
        | LockError::Unsupported { .. }
        | LockError::SemaphoreMax { .. }
        | LockError::UpgradeRefused { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// Builds the response for `e` with an empty body (of any body type with a `Default`): the
/// status of [`status_for`], and `Retry-After` for a contended lock as the process-wide
/// [`retry_after`] setting says. Server-side errors are logged here, never put in the response.
pub fn error_response<B: Default>(e: &LockError, busy: StatusCode) -> Response<B> {
    error_response_with(e, busy, retry_after())
}

/// [`error_response`] with its own `Retry-After` setting.
pub fn error_response_with<B: Default>(
    e: &LockError,
    busy: StatusCode,
    retry: RetryAfter,
) -> Response<B> {
    let status = status_for(e, busy);
    if status.is_server_error() && !e.is_contended() {
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!(error = %e, "dlock: lock not usable; answering {status}");
        } else {
            tracing::warn!(error = %e, "dlock: lock failed; answering {status}");
        }
    }
    let mut res = Response::new(B::default());
    *res.status_mut() = status;
    if e.is_contended()
        && let Some(secs) = retry.seconds(e.retry_after())
    {
        res.headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    res
}

fn short_text(status: StatusCode) -> &'static str {
    match status {
        StatusCode::BAD_REQUEST => "invalid lock name\n",
        StatusCode::CONFLICT | StatusCode::LOCKED => "the resource is locked; retry later\n",
        StatusCode::INTERNAL_SERVER_ERROR => "internal server error\n",
        _ => "service unavailable; retry later\n",
    }
}

impl axum_core::response::IntoResponse for LockError {
    /// See the [module documentation](crate::web) for the mapping. The body is a short fixed
    /// text; the error's details (backend messages, lock names) go to the log only.
    fn into_response(self) -> axum_core::response::Response {
        let (parts, ()) = error_response::<()>(&self, busy_status()).into_parts();
        let body = axum_core::body::Body::from(short_text(parts.status));
        let mut res = Response::from_parts(parts, body);
        res.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        res
    }
}

/// The fencing token of the lock a [`LockLayer`] took, in the request's extensions.
/// In axum: `Extension(FencingToken(token)): Extension<FencingToken>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FencingToken(pub u64);

/// Takes the lock name from a request; `None` answers `400 Bad Request`.
///
/// Implemented for closures `Fn(&Request<B>) -> Option<String>` and by [`header_key`] and
/// [`path_key`].
pub trait KeyExtractor<B>: Clone + Send + Sync + 'static {
    /// The lock name for `req`.
    fn extract(&self, req: &Request<B>) -> Option<String>;
}

impl<B, F> KeyExtractor<B> for F
where
    F: Fn(&Request<B>) -> Option<String> + Clone + Send + Sync + 'static,
{
    fn extract(&self, req: &Request<B>) -> Option<String> {
        self(req)
    }
}

/// A key from a request header: `prefix` followed by the header's value, escaped as the
/// attribute escapes a trailing value (a `\` is doubled), so `header_key("x-tenant", "tenant:")`
/// and `key = "tenant:{t}"` name the same lock for one tenant (a missing or non-visible-ASCII
/// header gives no key; of repeated headers the first is used). Built by [`header_key`].
#[derive(Debug, Clone)]
pub struct HeaderKey {
    name: HeaderName,
    prefix: Arc<str>,
}

/// A key extractor for the header `name` (e.g. `"x-tenant-id"`), prefixed by `prefix`
/// (e.g. `"tenant:"`). Fails with [`LockError::Config`] for an invalid header name.
pub fn header_key(name: &str, prefix: &str) -> Result<HeaderKey, LockError> {
    let name = HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| LockError::Config(format!("invalid header name {name:?}")))?;
    Ok(HeaderKey {
        name,
        prefix: prefix.into(),
    })
}

impl<B> KeyExtractor<B> for HeaderKey {
    fn extract(&self, req: &Request<B>) -> Option<String> {
        let v = req.headers().get(&self.name)?.to_str().ok()?;
        if v.is_empty() {
            return None;
        }
        // Escaped as the attribute escapes a trailing value (`\` doubled), so that
        // `header_key("x-tenant", "tenant:")` and `key = "tenant:{t}"` name the same lock.
        let mut k = crate::private::KeyBuf::with_capacity(self.prefix.len() + v.len());
        k.lit(&self.prefix);
        k.value(v, &crate::private::key_special(""));
        Some(k.finish())
    }
}

#[derive(Debug, Clone)]
enum Seg {
    Lit(String),
    Param(String),
    /// `{*name}`: the rest of the path.
    Rest(String),
}

#[derive(Debug, Clone)]
enum Part {
    Lit(String),
    /// A placeholder and the characters escaped in its value (see the macro's key templates).
    Param(usize, String),
}

/// A key from path parameters: the request path is matched against a route pattern in axum's
/// syntax (`/orders/{id}`, `{*rest}` for the rest of the path) and a key template (`order:{id}`)
/// is filled with the captured segments, escaped as the attribute escapes its values (so that
/// values cannot forge another key). A path that does not match gives no key. Built by
/// [`path_key`].
#[derive(Debug, Clone)]
pub struct PathKey {
    route: Arc<[Seg]>,
    template: Arc<[Part]>,
}

/// A key extractor matching `route` (e.g. `"/orders/{id}/pay"`) and rendering `template`
/// (e.g. `"order:{id}"`). Fails with [`LockError::Config`] when the template names a parameter
/// the route lacks, or a brace is unclosed. `{{` and `}}` are literal braces in the template.
pub fn path_key(route: &str, template: &str) -> Result<PathKey, LockError> {
    let bad = |m: &str| LockError::Config(format!("path_key({route:?}, {template:?}): {m}"));
    let mut segs = Vec::new();
    let parts: Vec<&str> = route.trim_start_matches('/').split('/').collect();
    for (i, s) in parts.iter().enumerate() {
        if let Some(inner) = s.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
            if let Some(rest) = inner.strip_prefix('*') {
                if i + 1 != parts.len() {
                    return Err(bad("`{*name}` must be the last segment"));
                }
                segs.push(Seg::Rest(rest.to_string()));
            } else {
                segs.push(Seg::Param(inner.to_string()));
            }
        } else if s.contains(['{', '}']) {
            return Err(bad("a route parameter must be a whole segment"));
        } else {
            segs.push(Seg::Lit((*s).to_string()));
        }
    }
    let index_of = |name: &str| {
        segs.iter()
            .position(|s| matches!(s, Seg::Param(n) | Seg::Rest(n) if n == name))
    };
    // The template, by the attribute's own parser: the same literals, braces, trimming and
    // refused shapes (`{a}{b}`, a `\\` right after a placeholder).
    let tpl = dlock_template::parse(template).map_err(|errs| bad(&errs.join("; ")))?;
    let mut out: Vec<Part> = Vec::with_capacity(tpl.segments.len());
    for (i, seg) in tpl.segments.iter().enumerate() {
        match seg {
            dlock_template::Segment::Lit(l) => out.push(Part::Lit(l.clone())),
            dlock_template::Segment::Value(path) => {
                let name = path.join(".");
                if path.len() != 1 {
                    return Err(bad(&format!(
                        "`{{{name}}}`: a path_key placeholder names a route parameter, not a field path"
                    )));
                }
                let idx = index_of(&name)
                    .ok_or_else(|| bad(&format!("the route has no parameter `{name}`")))?;
                out.push(Part::Param(idx, tpl.special_after(i)));
            }
        }
    }
    Ok(PathKey {
        route: segs.into(),
        template: out.into(),
    })
}

impl PathKey {
    fn captures<'a>(&self, path: &'a str) -> Option<Vec<&'a str>> {
        let mut caps = vec![""; self.route.len()];
        let mut rest = path.trim_start_matches('/');
        for (i, seg) in self.route.iter().enumerate() {
            if let Seg::Rest(_) = seg {
                caps[i] = rest;
                return Some(caps);
            }
            let (this, tail) = match rest.split_once('/') {
                Some((a, b)) => (a, Some(b)),
                None => (rest, None),
            };
            match seg {
                Seg::Lit(l) if l != this => return None,
                Seg::Param(_) if this.is_empty() => return None,
                _ => caps[i] = this,
            }
            match tail {
                Some(t) => rest = t,
                None if i + 1 == self.route.len() => return Some(caps),
                None => {
                    // Only a trailing `{*rest}` may match an empty remainder.
                    return match self.route.get(i + 1) {
                        Some(Seg::Rest(_)) if i + 2 == self.route.len() => Some(caps),
                        _ => None,
                    };
                }
            }
        }
        rest.is_empty().then_some(caps)
    }

    /// The key for a request path (as sent: percent-encoded), if it matches the route.
    ///
    /// The route is matched on the path as sent and each capture is then percent-decoded, as
    /// axum's `Path` does, so the key names what the handler sees: `/accounts/%31` is account 1
    /// (and `%2F` in a capture, or in `{*rest}`, is a `/`). A capture that is not UTF-8 once
    /// decoded, which axum rejects too, gives no key.
    pub fn key_for_path(&self, path: &str) -> Option<String> {
        let caps = self.captures(path)?;
        let mut key = crate::private::KeyBuf::default();
        for p in self.template.iter() {
            match p {
                Part::Lit(l) => key.lit(l),
                Part::Param(i, special) => {
                    let value = percent_encoding::percent_decode_str(caps[*i])
                        .decode_utf8()
                        .ok()?;
                    key.value(&value, special)
                }
            }
        }
        Some(key.finish())
    }
}

impl<B> KeyExtractor<B> for PathKey {
    fn extract(&self, req: &Request<B>) -> Option<String> {
        self.key_for_path(req.uri().path())
    }
}

#[derive(Debug, Clone)]
struct LayerConfig {
    ttl: Duration,
    wait: Duration,
    backend: Cow<'static, str>,
    busy_status: StatusCode,
    retry_after: RetryAfter,
    metric_name: Cow<'static, str>,
    /// Set once a request without a key was logged at `warn` (later ones at `debug`).
    warned_no_key: Arc<std::sync::atomic::AtomicBool>,
}

/// A tower layer that runs each request under a distributed lock named by a [`KeyExtractor`].
///
/// Options: [`ttl`](Self::ttl) (default 30 s, renewed by the watchdog while the inner service
/// runs), [`wait`](Self::wait) (default 0: fail fast), [`backend`](Self::backend) (default
/// `"default"`), [`busy_status`](Self::busy_status) (default 409). See the
/// [module documentation](crate::web).
#[derive(Debug, Clone)]
pub struct LockLayer<K> {
    key: K,
    cfg: Arc<LayerConfig>,
}

impl<K> LockLayer<K> {
    /// A layer locking on the key `key` extracts.
    pub fn new(key: K) -> Self {
        LockLayer {
            key,
            cfg: Arc::new(LayerConfig {
                ttl: DEFAULT_TTL,
                wait: Duration::ZERO,
                backend: Cow::Borrowed(registry::DEFAULT_BACKEND),
                busy_status: StatusCode::CONFLICT,
                retry_after: RetryAfter::default(),
                metric_name: Cow::Borrowed("http_layer"),
                warned_no_key: Arc::default(),
            }),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut LayerConfig)) -> Self {
        f(Arc::make_mut(&mut self.cfg));
        self
    }

    /// The lease per request (default 30 s).
    pub fn ttl(self, ttl: Duration) -> Self {
        self.with(|c| c.ttl = ttl)
    }

    /// How long a request waits for a busy lock (default zero).
    pub fn wait(self, wait: Duration) -> Self {
        self.with(|c| c.wait = wait)
    }

    /// The registered backend to use (default `"default"`).
    pub fn backend(self, name: impl Into<Cow<'static, str>>) -> Self {
        let name = name.into();
        self.with(|c| c.backend = name)
    }

    /// The status for a busy or timed-out lock (default `409 Conflict`).
    pub fn busy_status(self, status: StatusCode) -> Self {
        self.with(|c| c.busy_status = status)
    }

    /// What busy and timed-out answers put in `Retry-After` (default [`RetryAfter::AtMost`] one
    /// second; [`RetryAfter::Lease`] for the holder's remaining lease).
    pub fn retry_after(self, r: RetryAfter) -> Self {
        self.with(|c| c.retry_after = r)
    }

    /// The `lock` label of this layer's metrics (feature `metrics`; default `"http_layer"`).
    /// Give it the route or key template, never a rendered key.
    pub fn metric_name(self, name: impl Into<Cow<'static, str>>) -> Self {
        let name = name.into();
        self.with(|c| c.metric_name = name)
    }
}

impl<S, K: Clone> tower_layer::Layer<S> for LockLayer<K> {
    type Service = LockService<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        LockService {
            inner,
            key: self.key.clone(),
            cfg: self.cfg.clone(),
        }
    }
}

/// The service [`LockLayer`] wraps around an inner service.
#[derive(Debug, Clone)]
pub struct LockService<S, K> {
    inner: S,
    key: K,
    cfg: Arc<LayerConfig>,
}

impl<S, K, B, RB> tower_service::Service<Request<B>> for LockService<S, K>
where
    S: tower_service::Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    K: KeyExtractor<B>,
    B: Send + 'static,
    RB: Default + Send + 'static,
{
    type Response = Response<RB>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Response<RB>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        // The service that was polled ready handles this request; the clone waits for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let key = self.key.extract(&req);
        let cfg = self.cfg.clone();
        Box::pin(async move {
            let Some(key) = key else {
                // Most often a layer whose pattern does not match the route it wraps (a layer
                // added with `layer` instead of `route_layer`, or a pattern with a typo): say so
                // once loudly, then quietly (a client can send such requests at will).
                let path = req.uri().path();
                if !cfg.warned_no_key.swap(true, Ordering::Relaxed) {
                    tracing::warn!(path = ?path, "dlock: LockLayer found no lock key in the request; answering 400 (does the layer's pattern match this route? add it with `route_layer`, not `layer`)");
                } else {
                    tracing::debug!(path = ?path, "dlock: LockLayer found no lock key in the request; answering 400");
                }
                let mut res = Response::new(RB::default());
                *res.status_mut() = StatusCode::BAD_REQUEST;
                res.headers_mut().insert(
                    HeaderName::from_static("x-dlock-error"),
                    HeaderValue::from_static("no-lock-key"),
                );
                return Ok(res);
            };
            let lock = Lock::new(key)
                .ttl(cfg.ttl)
                .wait(cfg.wait)
                .backend(cfg.backend.clone())
                .metric_name(cfg.metric_name.clone());
            let guard = match lock.acquire().await {
                Ok(g) => g,
                Err(e) => return Ok(error_response_with(&e, cfg.busy_status, cfg.retry_after)),
            };
            req.extensions_mut()
                .insert(FencingToken(guard.fencing_token()));
            let lost = guard.lost_token();
            let out = guard
                .scope(async {
                    tokio::select! {
                        biased;
                        r = inner.call(req) => Some(r),
                        _ = lost.cancelled() => None,
                    }
                })
                .await;
            let out = match out {
                Some(r) => r,
                None => {
                    let e = LockError::Lost {
                        key: guard.key().to_string(),
                        reason: guard.lost_reason().unwrap_or(crate::LostReason::Deadline),
                    };
                    Ok(error_response_with(&e, cfg.busy_status, cfg.retry_after))
                }
            };
            // Given back in the background (retried until the server confirms), not awaited:
            // the response is ready, and a stalled backend must not delay it by the release's
            // bound. A next request on this key in this process waits for the give-back first.
            drop(guard);
            out
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_key_matches_and_escapes() {
        let k = path_key("/orders/{id}/pay", "order:{id}").unwrap();
        assert_eq!(
            k.key_for_path("/orders/42/pay").as_deref(),
            Some("order:42")
        );
        assert_eq!(k.key_for_path("/orders/42/refund"), None);
        assert_eq!(k.key_for_path("/orders//pay"), None);
        assert_eq!(k.key_for_path("/orders/42"), None);
        let k = path_key("/t/{a}/{b}", "x:{a}:{b}").unwrap();
        assert_ne!(k.key_for_path("/t/1:2/3"), k.key_for_path("/t/1/2:3"));
        let k = path_key("/files/{*rest}", "file:{rest}").unwrap();
        assert_eq!(k.key_for_path("/files/a/b").as_deref(), Some("file:a/b"));
        // Captures are decoded as axum's `Path` decodes them: one account, one lock.
        assert_eq!(k.key_for_path("/files/a%2Fb").as_deref(), Some("file:a/b"));
        let k = path_key("/accounts/{id}/settle", "account:{id}").unwrap();
        assert_eq!(
            k.key_for_path("/accounts/%31/settle"),
            k.key_for_path("/accounts/1/settle")
        );
        assert_eq!(
            k.key_for_path("/accounts/caf%C3%A9/settle").as_deref(),
            Some("account:café")
        );
        assert_eq!(k.key_for_path("/accounts/%FF/settle"), None, "not UTF-8");
        assert!(path_key("/a/{id}", "x:{nope}").is_err());
        assert!(path_key("/a/{id}", "x:{id").is_err());
    }

    /// The two template shapes the attribute rejects as ambiguous are rejected here too:
    /// `k:{a}{b}` gave `k:123` for both `/t/1/23` and `/t/12/3`, and `k:{a}\{b}` gave the same
    /// key for `/t/1/\2` and `/t/1\/2`. `{ a }` is trimmed as the attribute trims it.
    #[test]
    fn path_key_rejects_the_templates_the_attribute_rejects() {
        let e = path_key("/t/{a}/{b}", "k:{a}{b}").unwrap_err().to_string();
        assert!(e.contains("ambiguous"), "{e}");
        let e = path_key("/t/{a}/{b}", r"k:{a}\{b}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("ambiguous"), "{e}");
        // Still fine: a separator between them, a `\` elsewhere, braces escaped.
        assert!(path_key("/t/{a}/{b}", "k:{a}:{b}").is_ok());
        assert!(path_key("/t/{a}/{b}", r"k\:{a}:{b}").is_ok());
        assert!(path_key("/t/{a}", "k:{a}{{x}}").is_ok());
        let k = path_key("/t/{a}", "k:{ a }").unwrap();
        assert_eq!(k.key_for_path("/t/1").as_deref(), Some("k:1"));
    }

    /// `header_key` escapes its value as the attribute escapes a trailing value: before, a
    /// tenant `a\b` was `tenant:a\b` through the layer but `tenant:a\\b` through
    /// `key = "tenant:{t}"`, two different locks for one tenant.
    #[test]
    fn header_key_names_the_lock_the_attribute_names() {
        let hk = header_key("x-tenant", "tenant:").unwrap();
        for v in [r"a\b", "acme", r"x\\:y", "a:b"] {
            let req = Request::builder().header("x-tenant", v).body(()).unwrap();
            let mut k = crate::private::KeyBuf::default();
            k.lit("tenant:");
            k.value(&v, "");
            assert_eq!(
                KeyExtractor::<()>::extract(&hk, &req),
                Some(k.finish()),
                "{v}"
            );
        }
    }

    #[test]
    fn retry_after_settings() {
        let lease = Some(Duration::from_millis(19_500));
        assert_eq!(RetryAfter::default().seconds(lease), Some(1));
        assert_eq!(RetryAfter::default().seconds(None), Some(1));
        assert_eq!(RetryAfter::Lease.seconds(lease), Some(20));
        assert_eq!(RetryAfter::Lease.seconds(None), None);
        assert_eq!(
            RetryAfter::AtMost(Duration::from_secs(5)).seconds(Some(Duration::from_millis(200))),
            Some(1)
        );
        assert_eq!(
            RetryAfter::AtMost(Duration::from_secs(5)).seconds(lease),
            Some(5)
        );
        assert_eq!(RetryAfter::Omit.seconds(lease), None);
    }

    #[test]
    fn retry_after_rounds_up() {
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1000)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
    }
}
