//! The OpenAI-compatible HTTP API in front of a `Backend`: `/v1/chat/completions`,
//! `/v1/completions` (both with server-sent-event streaming), `/v1/models`, `/health` and a
//! Prometheus `/metrics`. Requests are parsed and checked here (`openai`), rendered with the
//! chat template, tokenized, and handed to the backend; its events become JSON objects or SSE
//! chunks. Errors have OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
//! Beside it, Ollama's API (`ollama`: `/api/chat`, `/api/generate`, … with NDJSON streaming
//! and `{"error": "…"}` errors) on the same path to the backend, and a chat page at `/`
//! (`page`). A request naming another model than the one served gets the served one (with a
//! log line), as llama-server does.
//!
//! A client that goes away cancels its request: every submitted request is owned by a
//! `CancelOnDrop` that the response (or the stream) holds until the backend's last event.
//!
//! `conn` bounds the connections (a cap, a header-read timeout); a request body must arrive
//! within `body_timeout`. Web pages of other origins may call the API only when an API key
//! is set (any origin) or their origin was named (`--cors ORIGIN`); a request whose `Origin`
//! is not allowed is refused with a 403 before anything runs.

mod cluster;
mod conn;
mod ollama;
mod openai;
mod page;
#[cfg(test)]
mod tests;

use super::{Backend, GenEvent, GenRequest, Metrics, SubmitError};
use crate::text::tokenizer::Piece;
use anyhow::{Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, FromRequest, Path, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use openai::{Kind, Params};
use serde_json::json;
use std::fmt::Write as _;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

pub use conn::raise_open_files;
pub use ollama::ModelCard;

/// How to serve.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// When set, every endpoint but `/health` wants `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Origins whose web pages may call the API (`*`: any). Empty: any origin when an API key
    /// is set, none otherwise.
    pub cors: Vec<String>,
    /// Longest wait for a request head (from the connection, or between requests).
    pub header_timeout: Duration,
    /// Longest wait for a request body.
    pub body_timeout: Duration,
    /// Most connections open at once (lowered to fit the open-file limit).
    pub max_connections: usize,
    /// What Ollama's `/api/tags` and `/api/show` say about the model file.
    pub model: ModelCard,
}

impl Default for ServeOptions {
    fn default() -> ServeOptions {
        ServeOptions {
            api_key: None,
            cors: Vec::new(),
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_connections: 512,
            model: ModelCard::default(),
        }
    }
}

/// Which web origins may call the API.
#[derive(Clone, Debug, PartialEq)]
enum Cors {
    /// None: no CORS headers, and requests carrying an `Origin` are refused.
    Off,
    Any,
    Origins(Vec<HeaderValue>),
}

impl Cors {
    fn new(origins: &[String], keyed: bool) -> Result<Cors> {
        if origins.iter().any(|o| o == "*") {
            return Ok(Cors::Any);
        }
        if origins.is_empty() {
            return Ok(if keyed { Cors::Any } else { Cors::Off });
        }
        let list = origins
            .iter()
            .map(|o| {
                HeaderValue::from_str(o.trim_end_matches('/'))
                    .with_context(|| format!("--cors {o:?} is not a valid origin"))
            })
            .collect::<Result<_>>()?;
        Ok(Cors::Origins(list))
    }

    fn allows(&self, origin: &HeaderValue) -> bool {
        match self {
            Cors::Off => false,
            Cors::Any => true,
            Cors::Origins(list) => list.contains(origin),
        }
    }
}

/// Largest request body.
const BODY_LIMIT: usize = 4 << 20;
/// How long open responses may take to finish after a shutdown signal.
const DRAIN: Duration = Duration::from_secs(10);

/// What every handler sees.
struct AppState {
    backend: Arc<dyn Backend>,
    api_key: Option<String>,
    cors: Cors,
    body_timeout: Duration,
    /// Set on SIGTERM/SIGINT: `/health` turns 503, new requests are refused.
    draining: AtomicBool,
    /// Unix time the server started (`created` of the model).
    started: u64,
    model: ModelCard,
    /// Other model names requests gave (warned about once each, up to `NAMES_WARNED`).
    other_names: std::sync::Mutex<Vec<String>>,
}

/// How many distinct unknown model names get a warning (later ones a debug line).
const NAMES_WARNED: usize = 32;

type Shared = Arc<AppState>;

/// Binds `addr` (before anything slow, so a taken port fails at once).
pub fn bind(addr: &str) -> Result<std::net::TcpListener> {
    let listener =
        std::net::TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    listener
        .set_nonblocking(true)
        .context("cannot make the listener non-blocking")?;
    Ok(listener)
}

/// Serves on `listener` (from `bind`) until SIGTERM or SIGINT; then stops accepting, shuts
/// the backend down (its open streams end with a finish reason and `[DONE]`), waits up to
/// 10 s for open responses and returns. Runs its own two-worker tokio runtime.
pub fn serve(
    listener: std::net::TcpListener,
    backend: Arc<dyn Backend>,
    opts: ServeOptions,
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("ringllm-http")
        .enable_all()
        .build()
        .context("cannot start the HTTP runtime")?;
    let result = rt.block_on(async {
        let listener = TcpListener::from_std(listener).context("cannot use the listener")?;
        run(listener, backend, opts, shutdown_signal()).await
    });
    rt.shutdown_timeout(Duration::from_secs(1));
    result
}

/// The router alone (no listener, no connection limits, no shutdown handling): for tests and
/// embedding.
#[cfg_attr(not(test), allow(dead_code))]
pub fn router(backend: Arc<dyn Backend>, opts: &ServeOptions) -> Result<Router> {
    Ok(app(state(backend, opts)?))
}

/// Serves on `listener` until `shutdown` completes, then drains as `serve` does.
pub async fn run(
    listener: TcpListener,
    backend: Arc<dyn Backend>,
    opts: ServeOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let state = state(backend, &opts)?;
    let app = app(Arc::clone(&state));
    let limits = conn::Limits {
        max_connections: opts.max_connections.max(1),
        header_timeout: opts.header_timeout,
    }
    .fit(conn::raise_open_files());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut server = tokio::spawn(conn::serve(listener, app, limits, async {
        let _ = stop_rx.await;
    }));
    tokio::select! {
        r = &mut server => {
            r.context("the HTTP server panicked")?;
            anyhow::bail!("the HTTP server stopped");
        }
        () = shutdown => {}
    }
    tracing::info!("shutting down: no new connections, ending open requests");
    state.draining.store(true, Ordering::SeqCst);
    let _ = stop_tx.send(());
    let backend = Arc::clone(&state.backend);
    tokio::task::spawn_blocking(move || backend.shutdown())
        .await
        .context("the backend's shutdown panicked")?;
    match tokio::time::timeout(DRAIN, &mut server).await {
        Ok(r) => r.context("the HTTP server panicked"),
        Err(_) => {
            tracing::warn!(
                "open responses did not finish within {} s; closing them",
                DRAIN.as_secs()
            );
            server.abort();
            Ok(())
        }
    }
}

/// SIGINT or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
                return;
            }
            Err(e) => tracing::warn!("cannot watch SIGTERM ({e}); only Ctrl-C stops the server"),
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

fn state(backend: Arc<dyn Backend>, opts: &ServeOptions) -> Result<Shared> {
    let api_key = opts.api_key.clone().filter(|k| !k.is_empty());
    Ok(Arc::new(AppState {
        backend,
        cors: Cors::new(&opts.cors, api_key.is_some())?,
        api_key,
        body_timeout: opts.body_timeout,
        draining: AtomicBool::new(false),
        started: openai::unix_now(),
        model: opts.model.clone(),
        other_names: std::sync::Mutex::new(Vec::new()),
    }))
}

fn app(state: Shared) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/cluster", get(cluster::cluster))
        .route("/metrics", get(metrics))
        .merge(ollama::routes())
        .route_layer(middleware::from_fn_with_state(Arc::clone(&state), auth))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            allowed_origin,
        ));
    let cors = state.cors.clone();
    let app = Router::new()
        .route("/health", get(health))
        .merge(page::routes())
        .merge(api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(middleware::from_fn(reject_large))
        .with_state(state);
    use tower_http::cors::{AllowOrigin, CorsLayer};
    let origins = match cors {
        Cors::Off => return app,
        Cors::Any => AllowOrigin::any(),
        Cors::Origins(list) => AllowOrigin::list(list),
    };
    app.layer(
        CorsLayer::new()
            .allow_origin(origins)
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE])
            .expose_headers([header::RETRY_AFTER])
            .max_age(Duration::from_secs(3600)),
    )
}

/// An OpenAI-style error response.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<&'static str>,
    code: Option<&'static str>,
    retry_after_s: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
            retry_after_s: None,
        }
    }

    /// 400: the request itself is wrong.
    fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 500: the engine failed.
    fn server(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The backend's error event: a 503 with `Retry-After` when the engine says retrying
    /// may work (the ring is down or being rebuilt), else a 500.
    fn engine(message: String, retry_after_s: Option<u64>) -> ApiError {
        match retry_after_s {
            Some(s) => ApiError {
                retry_after_s: Some(s),
                ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
                    .code("engine_unavailable")
            },
            None => ApiError::server(message),
        }
    }

    fn param(mut self, param: &'static str) -> ApiError {
        self.param = Some(param);
        self
    }

    fn code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// The `{"error": …}` object (also sent as an SSE chunk when a stream fails).
    fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after_s {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s.max(1)));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> ApiError {
        match e {
            SubmitError::QueueFull { retry_after_s } => ApiError {
                retry_after_s: Some(retry_after_s),
                ..ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    "every slot is busy and the queue is full; retry later",
                )
                .code("queue_full")
            },
            SubmitError::ShuttingDown => shutting_down(),
            SubmitError::Invalid(m) => ApiError::invalid(m),
        }
    }
}

fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "the server is shutting down",
    )
    .code("shutting_down")
}

/// A JSON request body whose every failure (not JSON, wrong types, too large) is an
/// OpenAI-style error instead of axum's plain-text rejection. The Content-Type is not
/// checked: curl users often leave it out.
/// A body that does not arrive within `body_timeout` is a 408.
struct JsonBody<T>(T);

impl<T: serde::de::DeserializeOwned> FromRequest<Shared> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &Shared) -> Result<Self, ApiError> {
        let limit = state.body_timeout;
        let read = tokio::time::timeout(limit, Bytes::from_request(req, state));
        let bytes = read.await.map_err(|_| {
            ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request body did not arrive within {} s",
                    limit.as_secs_f64()
                ),
            )
            .code("body_timeout")
        })?;
        let bytes = bytes.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                too_large()
            } else {
                ApiError::new(r.status(), "invalid_request_error", r.body_text())
            }
        })?;
        serde_json::from_slice(&bytes)
            .map(JsonBody)
            .map_err(|e| ApiError::invalid(format!("the request body is not valid: {e}")))
    }
}

/// A JSON 413 at once when Content-Length is over the limit (a body without a length is
/// cut off by `DefaultBodyLimit` while it is read).
async fn reject_large(req: Request, next: Next) -> Response {
    let length = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if length.is_some_and(|n| n > BODY_LIMIT as u64) {
        return error_for(req.uri().path(), too_large());
    }
    next.run(req).await
}

fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        format!("the request body is larger than {} MiB", BODY_LIMIT >> 20),
    )
    .code("request_too_large")
}

/// `Authorization: Bearer KEY` on everything but `/health` when a key is set.
async fn auth(State(s): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, k)| k.trim());
        let ok = given.is_some_and(|g| same_secret(g.as_bytes(), key.as_bytes()));
        if !ok {
            let message = if given.is_some() {
                "incorrect API key"
            } else {
                "an API key is needed: send `Authorization: Bearer KEY`"
            };
            let e = ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
                .code("invalid_api_key");
            return error_for(req.uri().path(), e);
        }
    }
    next.run(req).await
}

/// Refuses a request from a web page whose origin may not call the API (browsers send
/// `Origin` on cross-origin requests; other clients do not send it).
async fn allowed_origin(State(s): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(origin) = req.headers().get(header::ORIGIN) {
        if !s.cors.allows(origin) && !same_origin(origin, req.headers().get(header::HOST)) {
            let origin = String::from_utf8_lossy(origin.as_bytes()).into_owned();
            let e = ApiError::new(
                StatusCode::FORBIDDEN,
                "invalid_request_error",
                format!(
                    "web pages from {origin} may not call this server: start it with \
                     --cors {origin} (or with an --api-key, which lets any origin in)"
                ),
            )
            .code("origin_not_allowed");
            return error_for(req.uri().path(), e);
        }
    }
    next.run(req).await
}

/// Whether a request comes from this server's own page (the chat page at `/`): its origin is
/// `http(s)://` + the `Host` it was sent to, and that host cannot be rebound by someone
/// else's DNS (an IP address, `localhost`, a name without dots, or a name under the
/// private-use `.local` (mDNS), `.home.arpa` or `.internal`). A
/// public DNS name could point at this server after a page of it loaded (DNS rebinding), so
/// such names need `--cors` or an API key as any other origin does.
fn same_origin(origin: &HeaderValue, host: Option<&HeaderValue>) -> bool {
    let (Ok(origin), Some(Ok(host))) = (origin.to_str(), host.map(HeaderValue::to_str)) else {
        return false;
    };
    let rest = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    if !rest.is_some_and(|r| r.eq_ignore_ascii_case(host)) {
        return false;
    }
    if host.starts_with('[') {
        return true; // an IPv6 literal
    }
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
    .to_ascii_lowercase();
    name.parse::<std::net::IpAddr>().is_ok()
        || name == "localhost"
        || name.ends_with(".localhost")
        || [".local", ".home.arpa", ".internal"]
            .iter()
            .any(|tld| name.ends_with(tld))
        || (!name.is_empty() && !name.contains('.'))
}

/// An error in the shape its API uses: Ollama's `{"error": "…"}` under `/api/`, else
/// OpenAI's.
fn error_for(path: &str, e: ApiError) -> Response {
    if path.starts_with("/api/") {
        ollama::OllamaError(e).into_response()
    } else {
        e.into_response()
    }
}

/// Compares without stopping at the first difference.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `{"status": "ok"}`; over a ring also its nodes, and any missing (`"degraded"` when it
/// runs without some); 503 with `Retry-After` while the ring is down or the server drains.
async fn health(State(s): State<Shared>) -> Response {
    if s.draining.load(Ordering::SeqCst) {
        let body = json!({"status": "shutting_down"});
        return (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    }
    let h = s.backend.health();
    let status = match (h.ready, h.missing.is_empty()) {
        (false, _) => "unavailable",
        (true, false) => "degraded",
        (true, true) => "ok",
    };
    let mut body = json!({ "status": status });
    if !h.nodes.is_empty() || !h.missing.is_empty() {
        body["nodes"] = json!(h.nodes);
        body["missing"] = json!(h.missing);
    }
    if let Some(e) = &h.error {
        body["error"] = json!(e);
    }
    if h.ready {
        return Json(body).into_response();
    }
    let mut r = (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(HEALTH_RETRY_AFTER_S));
    r
}

/// `Retry-After` of a 503 from `/health`.
const HEALTH_RETRY_AFTER_S: u64 = 5;

async fn not_found(req: Request) -> Response {
    let e = ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("no such endpoint: {} {}", req.method(), req.uri().path()),
    )
    .code("not_found");
    error_for(req.uri().path(), e)
}

async fn method_not_allowed(req: Request) -> Response {
    let e = ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
    .code("method_not_allowed");
    error_for(req.uri().path(), e)
}

fn model_object(s: &AppState) -> serde_json::Value {
    json!({
        "id": s.backend.model_id(),
        "object": "model",
        "created": s.started,
        "owned_by": "ringllm",
    })
}

async fn models(State(s): State<Shared>) -> Json<serde_json::Value> {
    Json(json!({"object": "list", "data": [model_object(&s)]}))
}

async fn model(State(s): State<Shared>, Path(id): Path<String>) -> Result<Response, ApiError> {
    if id != s.backend.model_id() {
        return Err(unknown_model(&s, &id));
    }
    Ok(Json(model_object(&s)).into_response())
}

fn unknown_model(s: &AppState, id: &str) -> ApiError {
    ApiError::invalid(format!(
        "the model `{id}` does not exist: this server serves `{}`",
        s.backend.model_id()
    ))
    .param("model")
    .code("model_not_found")
}

async fn chat_completions(
    State(s): State<Shared>,
    JsonBody(body): JsonBody<openai::Body>,
) -> Result<Response, ApiError> {
    let params = check(&s, &body, Kind::Chat)?;
    let messages = openai::chat_messages(body.messages)?;
    let prompt = tokenize(&s, Prompt::Chat(messages)).await?;
    generate(&s, params, prompt).await
}

async fn completions(
    State(s): State<Shared>,
    JsonBody(body): JsonBody<openai::Body>,
) -> Result<Response, ApiError> {
    let params = check(&s, &body, Kind::Completion)?;
    let special = body.parse_special.unwrap_or(false);
    let prompt = match openai::completion_prompt(body.prompt)? {
        openai::PromptInput::Text(text) => Prompt::Text { text, special },
        openai::PromptInput::Tokens(t) => Prompt::Tokens(t),
    };
    let prompt = tokenize(&s, prompt).await?;
    generate(&s, params, prompt).await
}

/// The checks both endpoints share: not draining, the right model, valid parameters.
fn check(s: &AppState, body: &openai::Body, kind: Kind) -> Result<Params, ApiError> {
    if s.draining.load(Ordering::SeqCst) {
        return Err(shutting_down());
    }
    served_model(s, body.model.as_deref());
    Params::from_body(body, kind)
}

/// The model a request asked for, mapped onto the one served: a name that is absent, empty,
/// the served id or the id with an Ollama tag (`id:latest`) is the served model; any other
/// name gets the served model too, with a warning the first time a name is seen (as
/// llama-server does). Returns the name to echo in responses: the request's own when it
/// named the served model, else the id.
fn served_model(s: &AppState, requested: Option<&str>) -> String {
    let id = s.backend.model_id();
    match requested {
        None | Some("") => id,
        Some(m) if m == id || m.split_once(':').is_some_and(|(name, _)| name == id) => m.into(),
        Some(m) => {
            let mut seen = s.other_names.lock().unwrap_or_else(|e| e.into_inner());
            if seen.len() < NAMES_WARNED && !seen.iter().any(|n| n == m) {
                seen.push(m.to_string());
                tracing::warn!(
                    "requests name the model {m:?}; answering with {id:?}, the one served"
                );
            } else {
                tracing::debug!("a request names the model {m:?}; answering with {id:?}");
            }
            id
        }
    }
}

enum Prompt {
    Chat(Vec<crate::text::template::Message>),
    /// A raw prompt; `special`: its special-token texts are control tokens (`parse_special`).
    Text {
        text: String,
        special: bool,
    },
    Tokens(Vec<u32>),
}

/// Renders and tokenizes off the async workers (a long prompt takes milliseconds).
async fn tokenize(s: &Shared, prompt: Prompt) -> Result<Vec<u32>, ApiError> {
    let s = Arc::clone(s);
    let ids = tokio::task::spawn_blocking(move || -> Result<Vec<u32>, ApiError> {
        let b = &s.backend;
        let tok = b.tokenizer();
        let encode = |pieces: &[Piece<'_>], bos: bool| {
            tok.encode_pieces(pieces, bos)
                .map_err(|e| ApiError::server(format!("cannot tokenize the prompt: {e}")))
        };
        match prompt {
            Prompt::Chat(messages) => {
                let Some(t) = b.template() else {
                    return Err(ApiError::invalid(format!(
                        "the model `{}` has no chat template: use /v1/completions, or start \
                         the server with --template NAME (built-in: {})",
                        b.model_id(),
                        crate::text::template::builtin_names().join(", ")
                    ))
                    .param("messages")
                    .code("no_chat_template"));
                };
                // Message contents are text: only the template's markup yields control tokens.
                let r = t
                    .render_pieces(&messages, true, &|c| tok.control_spans(c))
                    .map_err(|e| ApiError::invalid(e.to_string()).param("messages"))?;
                // Templates write BOS themselves.
                encode(&r.pieces(), false)
            }
            Prompt::Text { text, special } => {
                let piece = if special {
                    Piece::special(&text)
                } else {
                    Piece::text(&text)
                };
                encode(&[piece], b.add_bos())
            }
            Prompt::Tokens(ids) => {
                let vocab = tok.vocab_size();
                if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                    return Err(ApiError::invalid(format!(
                        "token id {bad} is outside the vocabulary (0..{vocab})"
                    ))
                    .param("prompt"));
                }
                Ok(ids)
            }
        }
    })
    .await
    .map_err(|e| ApiError::server(format!("tokenizing failed: {e}")))??;
    if ids.is_empty() {
        return Err(ApiError::invalid("the prompt is empty").param("prompt"));
    }
    Ok(ids)
}

/// Sets the request's cancel flag when dropped before `disarm`: the client went away.
pub(crate) struct CancelOnDrop {
    flag: Arc<AtomicBool>,
    armed: bool,
}

impl CancelOnDrop {
    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.flag.store(true, Ordering::SeqCst);
        }
    }
}

/// A request handed to the backend: its events, and the guard that cancels it when dropped.
struct Submitted {
    rx: tokio::sync::mpsc::UnboundedReceiver<GenEvent>,
    guard: CancelOnDrop,
}

impl Submitted {
    /// The first event of a streamed request: the status waits for it, so a request that
    /// fails before its first token gets a real error status, not a 200 with an error inside.
    async fn first(&mut self) -> Result<GenEvent, ApiError> {
        match self.rx.recv().await {
            Some(GenEvent::Error {
                message,
                retry_after_s,
            }) => {
                self.guard.disarm();
                Err(ApiError::engine(message, retry_after_s))
            }
            None => {
                self.guard.disarm();
                Err(stopped())
            }
            Some(e) => Ok(e),
        }
    }
}

/// Checks the prompt against the context and submits it.
fn submit(s: &AppState, p: &Params, prompt: Vec<u32>) -> Result<Submitted, ApiError> {
    let ctx = s.backend.ctx();
    if prompt.len() >= ctx {
        return Err(ApiError::invalid(format!(
            "this model's context holds {ctx} tokens, but the prompt has {} tokens \
             (and at least one must be left to generate)",
            prompt.len()
        ))
        .param(p.kind.prompt_param())
        .code("context_length_exceeded"));
    }
    let room = ctx - prompt.len();
    let max_tokens = p.max_tokens.map_or(room, |m| m.min(room as u64) as usize);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let req = GenRequest {
        prompt,
        max_tokens,
        sampling: p.sampling.clone(),
        stop: p.stop.clone(),
        logprobs: p.logprobs,
        events: tx,
        cancel: Arc::clone(&cancel),
    };
    s.backend.submit(req)?;
    Ok(Submitted {
        rx,
        guard: CancelOnDrop {
            flag: cancel,
            armed: true,
        },
    })
}

/// Submits and answers in OpenAI's shape (whole or streamed).
async fn generate(s: &AppState, p: Params, prompt: Vec<u32>) -> Result<Response, ApiError> {
    let mut sub = submit(s, &p, prompt)?;
    let reply = openai::Reply::new(&p, s.backend.model_id());
    if p.stream {
        let first = sub.first().await?;
        let body = Body::from_stream(openai::sse(reply, Some(first), sub.rx, sub.guard));
        let headers = [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::HeaderName::from_static("x-accel-buffering"), "no"),
        ];
        return Ok((headers, body).into_response());
    }
    let done = collect(sub.rx, sub.guard).await?;
    Ok(Json(reply.whole(&done)).into_response())
}

/// A finished request, gathered from its events.
pub(crate) struct Collected {
    pub text: String,
    /// Each token's log-probabilities with the character offset of its text.
    pub logprobs: Vec<(super::TokenLogprob, usize)>,
    pub finish: super::Finish,
    pub usage: openai::Usage,
    /// When the first token arrived (Ollama's `prompt_eval_duration` ends there).
    pub first_token: Option<std::time::Instant>,
}

/// Waits for the end of a non-streamed request. Dropping this future (the client went away)
/// drops `guard`, which cancels the request.
async fn collect(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<GenEvent>,
    mut guard: CancelOnDrop,
) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut chars = 0;
    let mut logprobs = Vec::new();
    let mut first_token = None;
    loop {
        match rx.recv().await {
            Some(GenEvent::Token {
                text: t, logprob, ..
            }) => {
                first_token.get_or_insert_with(std::time::Instant::now);
                if let Some(lp) = logprob {
                    logprobs.push((lp, chars));
                }
                chars += t.chars().count();
                text.push_str(&t);
            }
            Some(GenEvent::Done {
                finish,
                text: t,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                resume,
            }) => {
                guard.disarm();
                text.push_str(&t);
                return Ok(Collected {
                    text,
                    logprobs,
                    finish,
                    usage: openai::Usage {
                        prompt_tokens,
                        completion_tokens,
                        cached_tokens,
                        resume,
                    },
                    first_token,
                });
            }
            Some(GenEvent::Error {
                message,
                retry_after_s,
            }) => {
                guard.disarm();
                return Err(ApiError::engine(message, retry_after_s));
            }
            None => {
                guard.disarm();
                return Err(stopped());
            }
        }
    }
}

fn stopped() -> ApiError {
    ApiError::server("the engine stopped before finishing the request")
}

async fn metrics(State(s): State<Shared>) -> Response {
    let b = Arc::clone(&s.backend);
    let m = match tokio::task::spawn_blocking(move || b.metrics()).await {
        Ok(m) => m,
        Err(e) => return ApiError::server(format!("metrics failed: {e}")).into_response(),
    };
    let content_type = "text/plain; version=0.0.4; charset=utf-8";
    ([(header::CONTENT_TYPE, content_type)], prometheus_text(&m)).into_response()
}

/// The Prometheus text exposition of `m`.
fn prometheus_text(m: &Metrics) -> String {
    let mut out = String::new();
    let mut one = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        let _ = writeln!(out, "{name} {}", prom_value(value));
    };
    let counters = [
        (
            "ringllm_requests_total",
            "Generation requests accepted.",
            m.requests_total,
        ),
        (
            "ringllm_requests_failed_total",
            "Generation requests that ended in an error.",
            m.requests_failed,
        ),
        (
            "ringllm_prompt_tokens_total",
            "Prompt tokens of accepted requests.",
            m.prompt_tokens_total,
        ),
        (
            "ringllm_completion_tokens_total",
            "Tokens generated.",
            m.completion_tokens_total,
        ),
    ];
    for (name, help, v) in counters {
        one(name, "counter", help, v as f64);
    }
    let gauges = [
        (
            "ringllm_queue_depth",
            "Requests waiting for a slot.",
            m.queue_depth as f64,
        ),
        (
            "ringllm_slots_total",
            "Sequences that can run at once.",
            m.slots_total as f64,
        ),
        (
            "ringllm_slots_busy",
            "Slots running a sequence.",
            m.slots_busy as f64,
        ),
        (
            "ringllm_decode_tokens_per_second",
            "Tokens generated per second over the last few seconds, all sequences together.",
            m.decode_tokens_per_s,
        ),
    ];
    for (name, help, v) in gauges {
        one(name, "gauge", help, v);
    }
    let name = "ringllm_node_latency_ms";
    let _ = writeln!(
        out,
        "# HELP {name} Mean milliseconds per hop of the last frames, per node.\n# TYPE {name} gauge"
    );
    for (node, ms) in &m.node_latency_ms {
        let _ = writeln!(
            out,
            "{name}{{node=\"{}\"}} {}",
            prom_label(node),
            prom_value(*ms)
        );
    }
    out
}

fn prom_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        v.to_string()
    }
}

fn prom_label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
