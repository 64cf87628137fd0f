//! The OpenAI-compatible HTTP API in front of a `Backend`: `/v1/chat/completions`,
//! `/v1/completions` (both with server-sent-event streaming), `/v1/models`, `/health` and a
//! Prometheus `/metrics`. Requests are parsed and checked here (`openai`), rendered with the
//! chat template, tokenized, and handed to the backend; its events become JSON objects or SSE
//! chunks. Errors have OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
//! Beside it, Ollama's API (`ollama`: `/api/chat`, `/api/generate`, … with NDJSON streaming
//! and `{"error": "…"}` errors) on the same path to the backend, Anthropic's Messages API
//! (`anthropic`: `/v1/messages` with named SSE events and Anthropic-shaped errors), and a chat
//! page at `/` (`page`). A request naming another model than the one served gets the served one (with a
//! log line), as llama-server does.
//!
//! A client that goes away cancels its request: every submitted request is owned by a
//! `CancelOnDrop` that the response (or the stream) holds until the backend's last event.
//!
//! `conn` bounds the connections (a cap, a header-read timeout); a request body must arrive
//! within `body_timeout`. Web pages of other origins may call the API only when an API key
//! is set (any origin) or their origin was named (`--cors ORIGIN`); a request whose `Origin`
//! is not allowed is refused with a 403 before anything runs. A server without an API key
//! answers only to its own host names (its address, localhost, `--allow-host NAME`), so a
//! page whose DNS name is pointed at it (DNS rebinding) cannot read it.

mod access;
mod anthropic;
mod cluster;
mod conn;
mod error;
mod generate;
mod metrics;
mod ollama;
mod openai;
mod page;
#[cfg(test)]
mod tests;
mod tools;

use super::Backend;
use anyhow::{Context, Result};
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use openai::{Kind, Params};
use serde_json::json;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

pub use conn::raise_open_files;
pub use ollama::ModelCard;

use error::{error_for, reject_large, shutting_down, ApiError, JsonBody};
use generate::{
    collect, constraint, generate, stopped, submit, tokenize, CancelOnDrop, Collected, Prompt,
};

/// How to serve.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// When set, every endpoint but `/health` wants `Authorization: Bearer KEY` (or
    /// Anthropic's `x-api-key: KEY`).
    pub api_key: Option<String>,
    /// Origins whose web pages may call the API (`*`: any). Empty: any origin when an API key
    /// is set, none otherwise.
    pub cors: Vec<String>,
    /// Host names (`Host`) a server without an API key answers to besides its own address
    /// and, on loopback, `localhost` (`*`: any).
    pub allow_hosts: Vec<String>,
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
            allow_hosts: Vec::new(),
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
    api_key: Option<access::ApiKey>,
    cors: Cors,
    /// The `Host` names answered without an API key.
    hosts: access::Hosts,
    body_timeout: Duration,
    /// Set on SIGTERM/SIGINT: `/health` turns 503, new requests are refused.
    draining: AtomicBool,
    /// Unix time the server started (`created` of the model).
    started: u64,
    model: ModelCard,
    /// Other model names requests gave (warned about once each, up to `NAMES_WARNED`).
    other_names: std::sync::Mutex<Vec<String>>,
    /// The nodes' last answers for `GET /v1/cluster`.
    cluster_status: Arc<cluster::StatusCache>,
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

/// Checks `--allow-host` names, so a mistake fails before the model loads.
pub fn check_allow_hosts(names: &[String]) -> Result<()> {
    access::Hosts::new(std::net::Ipv4Addr::LOCALHOST.into(), names).map(drop)
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
/// embedding. Without an API key it answers the host names of a loopback listener (and
/// `opts.allow_hosts`).
#[cfg_attr(not(test), allow(dead_code))]
pub fn router(backend: Arc<dyn Backend>, opts: &ServeOptions) -> Result<Router> {
    let loopback = std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
    Ok(app(state(backend, opts, loopback)?))
}

/// Serves on `listener` until `shutdown` completes, then drains as `serve` does.
pub async fn run(
    listener: TcpListener,
    backend: Arc<dyn Backend>,
    opts: ServeOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let bound = listener
        .local_addr()
        .context("cannot read the listener's address")?
        .ip();
    let state = state(backend, &opts, bound)?;
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

/// `bound`: the address listened on (the names of a server without a key follow from it).
fn state(
    backend: Arc<dyn Backend>,
    opts: &ServeOptions,
    bound: std::net::IpAddr,
) -> Result<Shared> {
    let api_key = opts
        .api_key
        .as_deref()
        .filter(|k| !k.is_empty())
        .map(access::ApiKey::new);
    Ok(Arc::new(AppState {
        backend,
        cors: Cors::new(&opts.cors, api_key.is_some())?,
        hosts: access::Hosts::new(bound, &opts.allow_hosts)?,
        api_key,
        body_timeout: opts.body_timeout,
        draining: AtomicBool::new(false),
        started: openai::unix_now(),
        model: opts.model.clone(),
        other_names: std::sync::Mutex::new(Vec::new()),
        cluster_status: Arc::default(),
    }))
}

fn app(state: Shared) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/cluster", get(cluster::cluster))
        .route("/metrics", get(metrics::metrics))
        .merge(ollama::routes())
        .merge(anthropic::routes())
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            access::auth,
        ))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            access::allowed_origin,
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
        .with_state(Arc::clone(&state));
    use tower_http::cors::{AllowOrigin, CorsLayer};
    let origins = match cors {
        Cors::Off => None,
        Cors::Any => Some(AllowOrigin::any()),
        Cors::Origins(list) => Some(AllowOrigin::list(list)),
    };
    let app = match origins {
        None => app,
        Some(origins) => app.layer(
            CorsLayer::new()
                .allow_origin(origins)
                .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
                .allow_headers([
                    header::AUTHORIZATION,
                    header::CONTENT_TYPE,
                    header::HeaderName::from_static("x-api-key"),
                    header::HeaderName::from_static("anthropic-version"),
                    header::HeaderName::from_static("anthropic-beta"),
                    header::HeaderName::from_static("anthropic-dangerous-direct-browser-access"),
                ])
                .expose_headers([
                    header::RETRY_AFTER,
                    header::HeaderName::from_static("request-id"),
                ])
                .max_age(Duration::from_secs(3600)),
        ),
    };
    // Outermost: a request for a name this server does not answer to gets nothing else.
    app.layer(middleware::from_fn_with_state(state, access::allowed_host))
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
    let mut params = check(&s, &body, Kind::Chat)?;
    let plan = tools::ToolPlan::new(
        &s,
        tools::openai_tools(body.tools.as_ref())?,
        tools::openai_choice(body.tool_choice.as_ref())?,
        // One call per reply unless asked: llama.cpp's server default too; a small model
        // allowed more repeats its call until max_tokens.
        body.parallel_tool_calls.unwrap_or(false),
        "tools",
    )?;
    let mut messages = openai::chat_messages(body.messages)?;
    if let Some(plan) = &plan {
        if let Some(g) = plan.grammar()? {
            if params.grammar.is_some() {
                return Err(ApiError::invalid(
                    "`response_format` cannot be combined with `tools` (unless `tool_choice` \
                     is \"none\")",
                )
                .param("response_format"));
            }
            params.grammar = Some(g);
        }
        let (m, tools_var) = plan.prepare(&s, &messages)?;
        messages = m;
        params.vars.tools = tools_var;
    }
    let reads = plan.filter(tools::ToolPlan::reads_calls).map(|p| p.format);
    let prompt = tokenize(&s, Prompt::Chat(messages, params.vars.clone())).await?;
    generate(&s, params, prompt, reads).await
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
    if body.tools.as_ref().is_some_and(|t| !t.is_null()) {
        return Err(
            ApiError::invalid("`tools` are for /v1/chat/completions, not /v1/completions")
                .param("tools"),
        );
    }
    let prompt = tokenize(&s, prompt).await?;
    generate(&s, params, prompt, None).await
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
