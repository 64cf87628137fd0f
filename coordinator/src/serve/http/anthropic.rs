//! Anthropic's Messages API, so clients written for it (the `anthropic` SDKs, coding agents)
//! can use a ringllm server: `POST /v1/messages` (whole, or streamed as server-sent events
//! with `event:` lines) and `POST /v1/messages/count_tokens`. Requests go through the same
//! template, tokenizer and backend as `/v1/chat/completions`; errors have Anthropic's shape,
//! `{"type": "error", "error": {"type", "message"}, "request_id"}`, and every answer carries a
//! `request-id` header.
//!
//! The key may come as `x-api-key: KEY` as well as `Authorization: Bearer KEY` (see
//! `access`); `anthropic-version` may be absent or any `YYYY-MM-DD` (there is one version of
//! this API here); `anthropic-beta` is ignored (agents send it on every request, and no beta
//! feature changes what a request without the fields below means).
//!
//! This API is strict where ours are lenient: a top-level field not in [`FIELDS`] is a 400
//! naming it, and so is a field we know but cannot honour. Field by field:
//! - supported: `model`, `max_tokens` (required, ≥ 1), `messages`, `system`,
//!   `stop_sequences`, `stream`, `temperature` (0..1, default 1), `top_p`, `top_k`;
//! - accepted and ignored: `metadata` (only a user id), `cache_control` (top level, on
//!   blocks and tools: prefix reuse here is automatic), `service_tier` `auto` or
//!   `standard_only` (there is one tier), `speed` `standard`, `thinking` `{"type":
//!   "disabled"}`, and any of the others when null;
//! - refused: `thinking` enabled or adaptive, `service_tier` or `speed` of other values,
//!   `container`, `mcp_servers`, `context_management`, `output_config` (structured output),
//!   `inference_geo`, `diagnostics`, `citations` on a text block;
//! - `tools` (client tools: `name`, `description`, `input_schema`) and `tool_choice` (`auto`,
//!   `any`, `tool` with a `name`, `none`; `disable_parallel_tool_use`), mapped in `tools`
//!   onto the engine's tool types and planned as for the other APIs (`http::tools`): the
//!   model's own format renders them, `any` and `tool` force a well-formed call by grammar,
//!   and the reply's calls come back as `tool_use` blocks with `stop_reason` `tool_use`. One
//!   call per reply unless `disable_parallel_tool_use` is `false` (see `tools`).
//!
//! Messages: `user` and `assistant` turns whose content is a string or blocks of `text`,
//! `tool_use` (assistant) and `tool_result` (user), the last two only in a request with
//! `tools` (as Anthropic wants); any other block type (`image`, `document`, `thinking`,
//! server tools) is a 400 naming it. Consecutive turns of one role are
//! joined into one, as Anthropic does. A conversation ending with an assistant turn is a
//! prefill: the answer continues from its text (written after the template's generation
//! prompt), and the reply holds only the continuation. A harmony model (gpt-oss) answers with
//! its final channel only, as Claude does without thinking; it takes no prefill.
//!
//! `usage` follows Anthropic's arithmetic: `input_tokens` + `cache_read_input_tokens` is the
//! prompt, the second being the tokens whose KV came from an earlier request (prefix reuse);
//! `cache_creation_input_tokens` is 0. A stream's `message_start` counts the whole prompt as
//! `input_tokens` (the reuse is known only at the end); its `message_delta` has the split.

mod reply;
pub(super) mod tools;

use super::openai::{Kind, Params};
use super::tools::ToolPlan;
use super::{
    constraint, served_model, shutting_down, submit, tokenize, ApiError, JsonBody, Prompt, Shared,
};
use crate::serve::Sampling;
use crate::text::harmony::is_harmony;
use crate::text::template::{Message, TemplateVars};
use axum::body::Body;
use axum::extract::{FromRequest, Request as HttpRequest, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use std::sync::atomic::Ordering;

#[cfg(test)]
pub(super) use reply::stop_reason;
pub(super) use reply::{Events, Reply};

pub(super) fn routes() -> Router<Shared> {
    Router::new()
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .layer(middleware::map_response(with_request_id))
}

/// Whether `path` belongs to this API (its errors take Anthropic's shape).
pub(super) fn owns(path: &str) -> bool {
    path == "/v1/messages" || path.starts_with("/v1/messages/")
}

/// Every top-level field this API knows; any other is a 400 naming it.
pub(super) const FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "metadata",
    "tools",
    "tool_choice",
    "cache_control",
    "service_tier",
    "speed",
    "thinking",
    "container",
    "mcp_servers",
    "context_management",
    "output_config",
    "inference_geo",
    "diagnostics",
];

/// Fields we know and refuse whenever they are set (not null).
const REFUSED: &[(&str, &str)] = &[
    (
        "container",
        "code-execution containers are not available here",
    ),
    ("mcp_servers", "this server does not connect to MCP servers"),
    (
        "context_management",
        "the context is not edited by this server",
    ),
    (
        "output_config",
        "structured output (`output_config`) is not supported yet",
    ),
    ("inference_geo", "this server runs where it runs"),
    ("diagnostics", "prompt-cache diagnostics are not available"),
];

/// Most stop sequences per request.
const MAX_STOP_SEQUENCES: usize = 16;

/// The `request-id` header.
const REQUEST_ID: HeaderName = HeaderName::from_static("request-id");

fn request_id() -> HeaderValue {
    let id = format!("req_{:024x}", rand::random::<u128>() >> 32);
    HeaderValue::from_str(&id).unwrap_or(HeaderValue::from_static("req_0"))
}

/// Gives every answer of this API a `request-id` (errors made elsewhere have theirs).
async fn with_request_id(mut r: Response) -> Response {
    if !r.headers().contains_key(REQUEST_ID) {
        r.headers_mut().insert(REQUEST_ID, request_id());
    }
    r
}

/// An error in Anthropic's shape.
pub(super) struct AnthropicError(pub ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> AnthropicError {
        AnthropicError(e)
    }
}

/// Anthropic's name for an error of this status.
pub(super) fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        500.. => "api_error",
        _ => "invalid_request_error",
    }
}

/// The `error` object of an error answer or of a stream's `error` event.
pub(super) fn error_object(e: &ApiError) -> Value {
    json!({"type": error_type(e.status), "message": e.message})
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        let e = self.0;
        let id = request_id();
        let body = json!({
            "type": "error",
            "error": error_object(&e),
            "request_id": id.to_str().unwrap_or_default(),
        });
        let mut r = (e.status, Json(body)).into_response();
        if let Some(s) = e.retry_after_s {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s.max(1)));
        }
        r.headers_mut().insert(REQUEST_ID, id);
        r
    }
}

/// A JSON object body whose failures are Anthropic-shaped errors.
struct AnthropicJson(Map<String, Value>);

impl FromRequest<Shared> for AnthropicJson {
    type Rejection = AnthropicError;

    async fn from_request(req: HttpRequest, state: &Shared) -> Result<Self, AnthropicError> {
        match JsonBody::<Value>::from_request(req, state).await {
            Ok(JsonBody(Value::Object(m))) => Ok(AnthropicJson(m)),
            Ok(JsonBody(_)) => Err(invalid("the request body must be a JSON object").into()),
            Err(e) => Err(AnthropicError(e)),
        }
    }
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::invalid(message)
}

/// `anthropic-version`: absent, or a date.
fn check_headers(h: &HeaderMap) -> Result<(), ApiError> {
    let Some(v) = h.get("anthropic-version") else {
        return Ok(());
    };
    let ok = v.to_str().ok().is_some_and(|v| {
        let b = v.as_bytes();
        b.len() == 10
            && b.iter().enumerate().all(|(i, c)| match i {
                4 | 7 => *c == b'-',
                _ => c.is_ascii_digit(),
            })
    });
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "the `anthropic-version` header must be a date like 2023-06-01, not {:?}",
            String::from_utf8_lossy(v.as_bytes())
        )))
    }
}

/// Which endpoint a body is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Endpoint {
    Create,
    CountTokens,
}

/// A checked request.
#[derive(Debug)]
pub(super) struct MessagesRequest {
    pub model: Option<String>,
    /// `None` only for count_tokens.
    pub max_tokens: Option<u64>,
    /// For the template: the system prompt first, then the turns.
    pub messages: Vec<Message>,
    /// The text of a final assistant turn, which the answer continues.
    pub prefill: Option<String>,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    pub stream: bool,
    /// `tools` and `tool_choice`; `None` without tools.
    pub tools: Option<tools::ToolRequest>,
}

/// `m[key]` unless absent or null.
fn field<'a>(m: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    m.get(key).filter(|v| !v.is_null())
}

fn number(m: &Map<String, Value>, key: &str, lo: f32, hi: f32) -> Result<Option<f32>, ApiError> {
    match field(m, key) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if (lo as f64..=hi as f64).contains(&x) => Ok(Some(x as f32)),
            _ => Err(invalid(format!(
                "`{key}` must be a number between {lo} and {hi}, not {v}"
            ))),
        },
    }
}

/// Refuses keys of `obj` (at `at`) outside `known`.
fn only(obj: &Map<String, Value>, known: &[&str], at: &str) -> Result<(), ApiError> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        None => Ok(()),
        Some(k) => Err(invalid(format!("{at}: unknown field `{k}`"))),
    }
}

impl MessagesRequest {
    /// Checks a body of `/v1/messages` (or of count_tokens, where `max_tokens` may be left
    /// out).
    pub fn parse(m: &Map<String, Value>, endpoint: Endpoint) -> Result<MessagesRequest, ApiError> {
        let unknown: Vec<&str> = m
            .keys()
            .map(String::as_str)
            .filter(|k| !FIELDS.contains(k))
            .collect();
        if !unknown.is_empty() {
            return Err(invalid(format!(
                "unknown field{} {}: this server does not support {}",
                if unknown.len() > 1 { "s" } else { "" },
                unknown
                    .iter()
                    .map(|k| format!("`{k}`"))
                    .collect::<Vec<_>>()
                    .join(", "),
                if unknown.len() > 1 { "them" } else { "it" },
            )));
        }
        for (key, why) in REFUSED {
            if field(m, key).is_some() {
                return Err(invalid(format!("`{key}` is not supported: {why}")));
            }
        }
        refuse_unless(m, "service_tier", &["auto", "standard_only"])?;
        refuse_unless(m, "speed", &["standard"])?;
        if let Some(t) = field(m, "thinking") {
            if t.get("type").and_then(Value::as_str) != Some("disabled") {
                return Err(invalid(
                    "`thinking` is not supported: only {\"type\": \"disabled\"}",
                ));
            }
        }
        let model = match field(m, "model") {
            None => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(v) => return Err(invalid(format!("`model` must be a string, not {v}"))),
        };
        if model.is_none() {
            return Err(invalid("`model` is required"));
        }
        let max_tokens = match (field(m, "max_tokens"), endpoint) {
            (None, Endpoint::CountTokens) => None,
            (None, Endpoint::Create) => return Err(invalid("`max_tokens` is required")),
            (Some(v), _) => match v.as_u64() {
                Some(n) if n >= 1 => Some(n),
                _ => {
                    return Err(invalid(format!(
                        "`max_tokens` must be an integer of at least 1, not {v}"
                    )))
                }
            },
        };
        let stream = match field(m, "stream") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(invalid(format!("`stream` must be true or false, not {v}"))),
        };
        let top_k = match field(m, "top_k") {
            None => 0,
            Some(v) => v
                .as_u64()
                .map(|k| k.min(u32::MAX as u64) as usize)
                .ok_or_else(|| {
                    invalid(format!("`top_k` must be a non-negative integer, not {v}"))
                })?,
        };
        let sampling = Sampling {
            temperature: number(m, "temperature", 0.0, 1.0)?.unwrap_or(1.0),
            top_p: number(m, "top_p", 0.0, 1.0)?.unwrap_or(1.0),
            top_k,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: None,
        };
        let metadata = field(m, "metadata");
        if metadata.is_some_and(|v| !v.is_object()) {
            return Err(invalid("`metadata` must be an object"));
        }
        let tools = tools::tool_request(field(m, "tools"), field(m, "tool_choice"))?;
        let mut messages = Vec::new();
        if let Some(system) = field(m, "system") {
            let text = system_text(system)?;
            if !text.is_empty() {
                messages.push(Message::new("system", text));
            }
        }
        let (turns, prefill) = turns(field(m, "messages"), tools.is_some())?;
        messages.extend(turns);
        Ok(MessagesRequest {
            model,
            max_tokens,
            messages,
            prefill,
            sampling,
            stop: stop_sequences(field(m, "stop_sequences"))?,
            stream,
            tools,
        })
    }

    /// Our request settings (`Params` is what `submit` takes).
    fn params(&self) -> Params {
        Params {
            kind: Kind::Chat,
            max_tokens: self.max_tokens,
            sampling: self.sampling.clone(),
            stop: self.stop.clone(),
            logprobs: None,
            stream: self.stream,
            include_usage: false,
            vars: TemplateVars::default(),
            grammar: None,
        }
    }
}

/// Refuses `key` set to anything but one of `allowed` strings.
fn refuse_unless(m: &Map<String, Value>, key: &str, allowed: &[&str]) -> Result<(), ApiError> {
    match field(m, key) {
        None => Ok(()),
        Some(Value::String(s)) if allowed.contains(&s.as_str()) => Ok(()),
        Some(v) => Err(invalid(format!(
            "`{key}` {v} is not supported: only {}",
            allowed
                .iter()
                .map(|a| format!("{a:?}"))
                .collect::<Vec<_>>()
                .join(" or ")
        ))),
    }
}

fn stop_sequences(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let wrong = || invalid("`stop_sequences` must be an array of non-empty strings");
    let Some(v) = v else {
        return Ok(Vec::new());
    };
    let items = v.as_array().ok_or_else(wrong)?;
    if items.len() > MAX_STOP_SEQUENCES {
        return Err(invalid(format!(
            "at most {MAX_STOP_SEQUENCES} `stop_sequences`, not {}",
            items.len()
        )));
    }
    items
        .iter()
        .map(|i| match i.as_str() {
            Some(s) if !s.is_empty() => Ok(s.to_string()),
            _ => Err(wrong()),
        })
        .collect()
}

/// `system`: a string or text blocks.
fn system_text(v: &Value) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut texts = Vec::new();
            for (i, b) in blocks.iter().enumerate() {
                match block(b, &format!("system[{i}]"))? {
                    Block::Text(t) => texts.push(t),
                    other => {
                        return Err(invalid(format!(
                            "system[{i}]: a `{}` block cannot be part of the system prompt \
                             (only text)",
                            other.kind()
                        )))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(invalid(
            "`system` must be a string or an array of text blocks",
        )),
    }
}

/// One content block of a message.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Block {
    Text(String),
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
    ToolResult {
        tool_use_id: String,
        /// The result's text (its text blocks joined).
        content: String,
        is_error: bool,
    },
}

impl Block {
    fn kind(&self) -> &'static str {
        match self {
            Block::Text(_) => "text",
            Block::ToolUse { .. } => "tool_use",
            Block::ToolResult { .. } => "tool_result",
        }
    }
}

fn string_at(b: &Map<String, Value>, key: &str, at: &str) -> Result<String, ApiError> {
    match b.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(invalid(format!("{at}: `{key}` must be a string"))),
    }
}

/// A content block at `at` (`messages[2].content[0]`), checked.
fn block(v: &Value, at: &str) -> Result<Block, ApiError> {
    let b = v
        .as_object()
        .ok_or_else(|| invalid(format!("{at}: a content block must be an object")))?;
    let kind = b
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(format!("{at}: a content block needs a `type`")))?;
    match kind {
        "text" => {
            only(b, &["type", "text", "cache_control", "citations"], at)?;
            let cited = b
                .get("citations")
                .is_some_and(|c| !c.is_null() && c.as_array().is_none_or(|a| !a.is_empty()));
            if cited {
                return Err(invalid(format!(
                    "{at}: `citations` are not supported (there are no documents to cite)"
                )));
            }
            Ok(Block::Text(string_at(b, "text", at)?))
        }
        "tool_use" => {
            only(b, &["type", "id", "name", "input", "cache_control"], at)?;
            let input = b.get("input").cloned().unwrap_or(Value::Null);
            if !input.is_object() {
                return Err(invalid(format!("{at}: `input` must be an object")));
            }
            Ok(Block::ToolUse {
                id: string_at(b, "id", at)?,
                name: string_at(b, "name", at)?,
                input,
            })
        }
        "tool_result" => {
            only(
                b,
                &[
                    "type",
                    "tool_use_id",
                    "content",
                    "is_error",
                    "cache_control",
                ],
                at,
            )?;
            let content = match b.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut texts = Vec::new();
                    for (i, p) in parts.iter().enumerate() {
                        match block(p, &format!("{at}.content[{i}]"))? {
                            Block::Text(t) => texts.push(t),
                            other => {
                                return Err(invalid(format!(
                                    "{at}.content[{i}]: a tool result holds text, not `{}`",
                                    other.kind()
                                )))
                            }
                        }
                    }
                    texts.join("\n")
                }
                Some(_) => {
                    return Err(invalid(format!(
                        "{at}: `content` must be a string or an array of text blocks"
                    )))
                }
            };
            let is_error = match b.get("is_error") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(e)) => *e,
                Some(v) => {
                    return Err(invalid(format!("{at}: `is_error` must be a bool, not {v}")))
                }
            };
            Ok(Block::ToolResult {
                tool_use_id: string_at(b, "tool_use_id", at)?,
                content,
                is_error,
            })
        }
        other => Err(invalid(format!(
            "{at}: content blocks of type `{other}` are not supported (text, tool_use, \
             tool_result)"
        ))),
    }
}

/// One turn: its role and blocks.
#[derive(Debug, PartialEq)]
pub(super) struct Turn {
    pub assistant: bool,
    pub blocks: Vec<Block>,
}

/// `messages`, checked and with consecutive turns of one role joined.
pub(super) fn parse_turns(v: Option<&Value>) -> Result<Vec<Turn>, ApiError> {
    let items = match v {
        None => return Err(invalid("`messages` is required")),
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(invalid("`messages` is empty"))
        }
        Some(Value::Array(items)) => items,
        Some(_) => return Err(invalid("`messages` must be an array")),
    };
    let mut turns: Vec<Turn> = Vec::new();
    for (i, msg) in items.iter().enumerate() {
        let at = format!("messages[{i}]");
        let obj = msg
            .as_object()
            .ok_or_else(|| invalid(format!("{at}: a message must be an object")))?;
        only(obj, &["role", "content"], &at)?;
        let assistant = match obj.get("role").and_then(Value::as_str) {
            Some("user") => false,
            Some("assistant") => true,
            Some(other) => {
                return Err(invalid(format!(
                    "{at}: role `{other}` is not supported (user, assistant; the system \
                     prompt is the top-level `system`)"
                )))
            }
            None => return Err(invalid(format!("{at}: `role` is required"))),
        };
        let blocks = match obj.get("content") {
            Some(Value::String(s)) => vec![Block::Text(s.clone())],
            Some(Value::Array(parts)) => parts
                .iter()
                .enumerate()
                .map(|(j, p)| block(p, &format!("{at}.content[{j}]")))
                .collect::<Result<Vec<_>, _>>()?,
            _ => {
                return Err(invalid(format!(
                    "{at}: `content` must be a string or an array of content blocks"
                )))
            }
        };
        for (j, b) in blocks.iter().enumerate() {
            let misplaced = match b {
                Block::ToolUse { .. } => !assistant,
                Block::ToolResult { .. } => assistant,
                Block::Text(_) => false,
            };
            if misplaced {
                return Err(invalid(format!(
                    "{at}.content[{j}]: `{}` blocks belong in {} turns",
                    b.kind(),
                    if assistant { "user" } else { "assistant" }
                )));
            }
        }
        match turns.last_mut() {
            Some(last) if last.assistant == assistant => last.blocks.extend(blocks),
            _ => turns.push(Turn { assistant, blocks }),
        }
    }
    Ok(turns)
}

/// The turns as template messages (with their calls and results: `tools::tool_history`),
/// and the prefill (a final assistant turn's text). `with_tools`: the request declares tools;
/// without, `tool_use` and `tool_result` blocks are a 400.
fn turns(v: Option<&Value>, with_tools: bool) -> Result<(Vec<Message>, Option<String>), ApiError> {
    let mut turns = parse_turns(v)?;
    if !with_tools && tools::has_tool_blocks(&turns) {
        return Err(invalid(
            "`tool_use` and `tool_result` blocks need `tools`: declare the tools the \
             conversation uses",
        ));
    }
    let prefill = match turns.last() {
        Some(t) if t.assistant => {
            let last = turns.pop().map(|t| t.blocks).unwrap_or_default();
            let mut text = String::new();
            for b in last {
                match b {
                    Block::Text(t) => text.push_str(&t),
                    other => {
                        return Err(invalid(format!(
                            "the last message is the start of the answer (a prefill) and can \
                             hold only text, not `{}`",
                            other.kind()
                        )))
                    }
                }
            }
            Some(text)
        }
        _ => None,
    };
    Ok((tools::tool_history(&turns)?, prefill))
}

/// The checks both endpoints share; the request and the model name to answer with.
fn check(
    s: &Shared,
    headers: &HeaderMap,
    body: &Map<String, Value>,
    endpoint: Endpoint,
) -> Result<(MessagesRequest, String), ApiError> {
    if s.draining.load(Ordering::SeqCst) {
        return Err(shutting_down());
    }
    check_headers(headers)?;
    let req = MessagesRequest::parse(body, endpoint)?;
    let model = served_model(s, req.model.as_deref());
    Ok((req, model))
}

/// The request's tools planned for this model; `None` without tools.
fn plan(s: &Shared, req: &MessagesRequest) -> Result<Option<ToolPlan>, ApiError> {
    match &req.tools {
        None => Ok(None),
        Some(t) => ToolPlan::new(s, t.tools.clone(), t.choice.clone(), t.parallel, "tools"),
    }
}

/// The prompt of a checked request, with its tools (described as the model's format wants,
/// and the history's calls and results written in it).
async fn prompt(
    s: &Shared,
    req: &MessagesRequest,
    plan: Option<&ToolPlan>,
) -> Result<Vec<u32>, ApiError> {
    let mut messages = req.messages.clone();
    let mut vars = TemplateVars::default();
    if let Some(plan) = plan {
        let (m, tools_var) = plan.prepare(s, &messages)?;
        messages = m;
        vars.tools = tools_var;
    }
    let p = match &req.prefill {
        Some(text) if !text.is_empty() => {
            if is_harmony(s.backend.tokenizer()) {
                return Err(invalid(
                    "this model (harmony) takes no prefill: end `messages` with a user turn",
                ));
            }
            Prompt::Prefilled(messages, vars, text.clone())
        }
        _ => Prompt::Chat(messages, vars),
    };
    tokenize(s, p).await
}

async fn messages(
    State(s): State<Shared>,
    headers: HeaderMap,
    AnthropicJson(body): AnthropicJson,
) -> Result<Response, AnthropicError> {
    let (req, model) = check(&s, &headers, &body, Endpoint::Create)?;
    let plan = plan(&s, &req)?;
    let mut params = req.params();
    if let Some(plan) = &plan {
        // With `any` or `tool` the grammar forces the call; `constraint` compiles it.
        params.grammar = plan.grammar()?;
    }
    let ids = prompt(&s, &req, plan.as_ref()).await?;
    let prompt_tokens = ids.len();
    let constraint = constraint(&s, &params).await?;
    let mut sub = submit(&s, &params, ids, constraint)?;
    let reads = plan.filter(ToolPlan::reads_calls).map(|p| p.format);
    let reply = Reply::new(
        model,
        params.max_tokens.unwrap_or(u64::MAX),
        is_harmony(s.backend.tokenizer()),
    )
    .tools(reads);
    if req.stream {
        let first = sub.first().await?;
        let events = Events::new(reply, prompt_tokens);
        let body = Body::from_stream(reply::sse(events, first, sub.rx, sub.guard));
        let headers = [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::HeaderName::from_static("x-accel-buffering"), "no"),
        ];
        return Ok((headers, body).into_response());
    }
    let done = super::collect(sub.rx, sub.guard).await?;
    Ok(Json(reply.whole(&done)).into_response())
}

async fn count_tokens(
    State(s): State<Shared>,
    headers: HeaderMap,
    AnthropicJson(body): AnthropicJson,
) -> Result<Response, AnthropicError> {
    let (req, _) = check(&s, &headers, &body, Endpoint::CountTokens)?;
    // The tools' part of the prompt counts too.
    let plan = plan(&s, &req)?;
    let ids = prompt(&s, &req, plan.as_ref()).await?;
    Ok(Json(json!({ "input_tokens": ids.len() })).into_response())
}
