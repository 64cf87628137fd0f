//! Ollama's API beside the OpenAI one, for the tools that speak only Ollama (Open WebUI's
//! Ollama mode, Home Assistant, the `ollama` client libraries): `GET /api/tags`,
//! `POST /api/show`, `POST /api/chat`, `POST /api/generate`, `GET /api/version`,
//! `GET /api/ps`. Requests go through the same checks, template, tokenizer and backend as
//! `/v1/chat/completions`; answers stream as NDJSON (one JSON object a line; Ollama's default)
//! or come whole with `"stream": false`. Errors are `{"error": "…"}` with the status the
//! OpenAI endpoints would give.
//!
//! Sampling follows Ollama's `options` and its defaults (temperature 0.8, top_k 40, top_p 0.9,
//! repeat_penalty 1.1 over the last 64 tokens); options about the hardware or the context
//! (`num_ctx`, `num_gpu`, `num_thread`, …) are the server's business and are ignored.

use super::openai::{self, bad, within, Kind, Params};
use super::{
    constraint, served_model, shutting_down, stopped, submit, tokenize, ApiError, CancelOnDrop,
    JsonBody, Prompt, Shared,
};
use crate::serve::{Finish, GenEvent, Sampling};
use crate::text::grammar::GrammarSpec;
use crate::text::harmony::{is_harmony, ChannelParser, Split};
use crate::text::template::{Message, TemplateVars};
use crate::text::tools::ToolChoice;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

mod answer;

use answer::{answer, Reply, What};

pub(super) fn routes() -> Router<Shared> {
    Router::new()
        .route("/api/tags", get(tags))
        .route("/api/show", post(show))
        .route("/api/chat", post(chat))
        .route("/api/generate", post(generate))
        .route("/api/version", get(version))
        .route("/api/ps", get(ps))
}

/// What Ollama's listings say about the model file.
#[derive(Clone, Debug, Default)]
pub struct ModelCard {
    /// `general.architecture` (Ollama's `family`).
    pub architecture: String,
    /// Weights in the file, all tensors together.
    pub parameters: u64,
    /// The type holding most of the weights' bytes (`Q4_K`, `F16`, …).
    pub quantization: String,
    /// File size in bytes.
    pub size: u64,
    /// The file's modification time.
    pub modified: Option<SystemTime>,
    /// A digest of the GGUF header (tensor table and metadata), as hex.
    pub digest: String,
    /// The context the model was trained with.
    pub context_length: u64,
}

impl ModelCard {
    /// Reads the card of the GGUF at `path`; what cannot be read is left empty (with a
    /// warning): the listings are informative, serving does not depend on them.
    pub fn read(path: &Path) -> ModelCard {
        let mut card = ModelCard::default();
        match std::fs::metadata(path) {
            Ok(m) => {
                card.size = m.len();
                card.modified = m.modified().ok();
            }
            Err(e) => tracing::warn!("cannot stat {}: {e}", path.display()),
        }
        let file = match ringllm_model::gguf::GgufFile::open_lean(path) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!("cannot read {} for /api/show: {e}", path.display());
                return card;
            }
        };
        let meta = file.metadata();
        card.architecture = meta
            .opt_str("general.architecture")
            .ok()
            .flatten()
            .unwrap_or("")
            .to_string();
        let key = format!("{}.context_length", card.architecture);
        card.context_length = meta
            .opt_u64(&key)
            .ok()
            .flatten()
            .or_else(|| meta.opt_u32(&key).ok().flatten().map(u64::from))
            .unwrap_or(0);
        card.parameters = file
            .tensors()
            .iter()
            .map(|t| t.n_elements())
            .fold(0u64, u64::saturating_add);
        let mut bytes: Vec<(&'static str, u64)> = Vec::new();
        for t in file.tensors().iter().filter(|t| t.dims.len() >= 2) {
            let name = t.ty.name();
            match bytes.iter_mut().find(|(n, _)| *n == name) {
                Some((_, b)) => *b = b.saturating_add(t.size),
                None => bytes.push((name, t.size)),
            }
        }
        card.quantization = bytes
            .iter()
            .max_by_key(|(_, b)| *b)
            .map_or_else(String::new, |(n, _)| (*n).to_string());
        card.digest = format!("{:016x}", file.header_hash());
        card
    }

    /// `"134.52M"`, `"8.0B"`: Ollama's `parameter_size`.
    fn parameter_size(&self) -> String {
        let n = self.parameters as f64;
        if n >= 1e9 {
            format!("{:.1}B", n / 1e9)
        } else if n >= 1e6 {
            format!("{:.2}M", n / 1e6)
        } else {
            format!("{:.2}K", n / 1e3)
        }
    }

    fn details(&self) -> Value {
        let families: Vec<&str> = if self.architecture.is_empty() {
            Vec::new()
        } else {
            vec![self.architecture.as_str()]
        };
        json!({
            "parent_model": "",
            "format": "gguf",
            "family": self.architecture,
            "families": families,
            "parameter_size": self.parameter_size(),
            "quantization_level": self.quantization,
        })
    }
}

/// An error in Ollama's shape: `{"error": "…"}` (with `Retry-After` and
/// `WWW-Authenticate` as the OpenAI errors have them).
pub(super) struct OllamaError(pub ApiError);

impl From<ApiError> for OllamaError {
    fn from(e: ApiError) -> OllamaError {
        OllamaError(e)
    }
}

impl IntoResponse for OllamaError {
    fn into_response(self) -> Response {
        let e = self.0;
        let mut r = (e.status, Json(json!({ "error": e.message }))).into_response();
        if let Some(s) = e.retry_after_s {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s.max(1)));
        }
        if e.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

/// A JSON body whose failures are Ollama-shaped errors.
struct OllamaJson<T>(T);

impl<T: serde::de::DeserializeOwned> FromRequest<Shared> for OllamaJson<T> {
    type Rejection = OllamaError;

    async fn from_request(req: Request, state: &Shared) -> Result<Self, OllamaError> {
        match JsonBody::<T>::from_request(req, state).await {
            Ok(JsonBody(t)) => Ok(OllamaJson(t)),
            Err(e) => Err(OllamaError(e)),
        }
    }
}

/// `options` of `/api/chat` and `/api/generate`: the sampling ones; every other option is
/// ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Options {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    repeat_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    seed: Option<i64>,
    /// -1: until the context ends; -2: fill the context (the same here).
    num_predict: Option<i64>,
    stop: Option<Value>,
}

/// Ollama's defaults where `options` says nothing.
const DEFAULT_TEMPERATURE: f32 = 0.8;
const DEFAULT_TOP_K: usize = 40;
const DEFAULT_TOP_P: f32 = 0.9;
const DEFAULT_REPEAT_PENALTY: f32 = 1.1;

impl Options {
    /// The request's `options`: a JSON object (or nothing). serde would read an array into
    /// this struct field by field, in order, so `[0.5]` would set the temperature: anything
    /// but an object is refused by name.
    fn from_json(v: Option<Value>) -> Result<Options, ApiError> {
        let kind = match &v {
            None | Some(Value::Null) => return Ok(Options::default()),
            Some(Value::Object(_)) => "",
            Some(Value::Array(_)) => "an array",
            Some(Value::String(_)) => "a string",
            Some(Value::Number(_)) => "a number",
            Some(Value::Bool(_)) => "a boolean",
        };
        if !kind.is_empty() {
            return Err(bad(
                "options",
                format!(
                    "`options` must be a JSON object of named options, such as \
                     {{\"temperature\": 0.7, \"num_predict\": 64}}, not {kind}"
                ),
            ));
        }
        serde_json::from_value(v.unwrap_or_default())
            .map_err(|e| bad("options", format!("`options` is not valid: {e}")))
    }

    fn params(&self, kind: Kind, stream: bool) -> Result<Params, ApiError> {
        let max_tokens = match self.num_predict {
            None | Some(-1) | Some(-2) => None,
            Some(n) if n >= 1 => Some(n as u64),
            Some(n) => {
                return Err(bad(
                    "options.num_predict",
                    format!("`options.num_predict` must be at least 1, or -1 (no limit), not {n}"),
                ))
            }
        };
        let sampling = Sampling {
            temperature: within(
                self.temperature,
                "options.temperature",
                0.0,
                2.0,
                DEFAULT_TEMPERATURE,
            )?,
            top_p: within(self.top_p, "options.top_p", 0.0, 1.0, DEFAULT_TOP_P)?,
            top_k: self.top_k.map_or(DEFAULT_TOP_K, |k| k.max(0) as usize),
            min_p: within(self.min_p, "options.min_p", 0.0, 1.0, 0.0)?,
            repetition_penalty: match self.repeat_penalty {
                None => DEFAULT_REPEAT_PENALTY,
                Some(r) if r > 0.0 && r <= 10.0 => r,
                Some(r) => {
                    return Err(bad(
                        "options.repeat_penalty",
                        format!("`options.repeat_penalty` must be in (0, 10], not {r}"),
                    ))
                }
            },
            frequency_penalty: within(
                self.frequency_penalty,
                "options.frequency_penalty",
                -2.0,
                2.0,
                0.0,
            )?,
            presence_penalty: within(
                self.presence_penalty,
                "options.presence_penalty",
                -2.0,
                2.0,
                0.0,
            )?,
            // Ollama: a negative seed is a random one.
            seed: self.seed.and_then(|s| u64::try_from(s).ok()),
        };
        Ok(Params {
            kind,
            max_tokens,
            sampling,
            stop: openai::stop_strings(self.stop.as_ref())?,
            logprobs: None,
            stream,
            include_usage: false,
            vars: TemplateVars::default(),
            grammar: None,
        })
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ChatBody {
    model: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    stream: Option<bool>,
    format: Option<Value>,
    options: Option<Value>,
    keep_alive: Option<Value>,
    tools: Option<Vec<Value>>,
    think: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct ChatMessage {
    role: String,
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    images: Option<Vec<Value>>,
    #[serde(default)]
    tool_calls: Option<Vec<Value>>,
    /// A `tool` message: the function it answers.
    #[serde(default)]
    tool_name: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct GenerateBody {
    model: Option<String>,
    prompt: Option<String>,
    suffix: Option<String>,
    system: Option<String>,
    template: Option<String>,
    context: Option<Vec<Value>>,
    raw: Option<bool>,
    stream: Option<bool>,
    format: Option<Value>,
    options: Option<Value>,
    images: Option<Vec<Value>>,
    keep_alive: Option<Value>,
    think: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ShowBody {
    model: Option<String>,
    /// The older name of `model`.
    name: Option<String>,
}

/// What `think` asks: whether the reasoning is shown (`thinking`), and how hard the model
/// thinks (Ollama's levels for gpt-oss: `"low"`, `"medium"`, `"high"`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Think {
    show: bool,
    effort: Option<String>,
}

/// `think` for a harmony model (gpt-oss), which always reasons: shown unless `false`.
fn harmony_think(think: Option<&Value>) -> Result<Think, ApiError> {
    let level = |e: &str| Think {
        show: true,
        effort: Some(e.to_string()),
    };
    match think {
        None | Some(Value::Null) | Some(Value::Bool(true)) => Ok(Think {
            show: true,
            effort: None,
        }),
        Some(Value::String(s)) if s.is_empty() => Ok(Think {
            show: true,
            effort: None,
        }),
        Some(Value::Bool(false)) => Ok(Think::default()),
        Some(Value::String(s)) if matches!(s.as_str(), "low" | "medium" | "high") => Ok(level(s)),
        Some(other) => Err(bad(
            "think",
            format!("`think` must be true, false, \"low\", \"medium\" or \"high\", not {other}"),
        )),
    }
}

/// Refuses what this server cannot do, by name, instead of ignoring it; what `think` asks of
/// a harmony model (others cannot think).
fn supported(
    format: Option<&Value>,
    think: Option<&Value>,
    harmony: bool,
) -> Result<Think, ApiError> {
    unsupported(format, if harmony { None } else { think })?;
    if harmony {
        harmony_think(think)
    } else {
        Ok(Think::default())
    }
}

/// Ollama's `format`: `"json"` (any JSON value, an object as Ollama's models give) or a
/// JSON schema; the grammar the output follows.
fn format_grammar(format: Option<&Value>) -> Result<Option<(GrammarSpec, &'static str)>, ApiError> {
    match format {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) if s == "json" => Ok(Some((GrammarSpec::JsonObject, "format"))),
        Some(schema @ Value::Object(_)) => {
            Ok(Some((GrammarSpec::JsonSchema(schema.clone()), "format")))
        }
        Some(other) => Err(bad(
            "format",
            format!("`format` must be \"json\" or a JSON schema object, not {other}"),
        )),
    }
}

/// Refuses what this server cannot do, by name, instead of ignoring it.
fn unsupported(format: Option<&Value>, think: Option<&Value>) -> Result<(), ApiError> {
    format_grammar(format)?;
    match think {
        None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(()),
        Some(Value::String(s)) if s.is_empty() => Ok(()),
        Some(_) => Err(bad(
            "think",
            "the model does not support thinking (`think`)".into(),
        )),
    }
}

fn has_items(v: &Option<Vec<Value>>) -> bool {
    v.as_ref().is_some_and(|v| !v.is_empty())
}

/// A `keep_alive` of 0 asks Ollama to unload the model; here the model stays loaded.
fn unloads(keep_alive: Option<&Value>) -> bool {
    match keep_alive {
        Some(Value::Number(n)) => n.as_f64() == Some(0.0),
        Some(Value::String(s)) => matches!(s.trim(), "0" | "0s" | "0m" | "0h"),
        _ => false,
    }
}

/// The answer to a request without messages or prompt: Ollama loads (or unloads) the model
/// and says so; this server's model is always loaded.
fn load_reply(model: &str, what: What, keep_alive: Option<&Value>) -> Response {
    let mut v = json!({
        "model": model,
        "created_at": rfc3339(SystemTime::now()),
        "done_reason": if unloads(keep_alive) { "unload" } else { "load" },
        "done": true,
    });
    match what {
        What::Chat => v["message"] = json!({"role": "assistant", "content": ""}),
        What::Generate => v["response"] = json!(""),
    }
    Json(v).into_response()
}

async fn chat(
    State(s): State<Shared>,
    OllamaJson(body): OllamaJson<ChatBody>,
) -> Result<Response, OllamaError> {
    let t0 = Instant::now();
    if s.draining.load(Ordering::SeqCst) {
        return Err(shutting_down().into());
    }
    let model = served_model(&s, body.model.as_deref());
    let harmony = is_harmony(s.backend.tokenizer());
    let think = supported(body.format.as_ref(), body.think.as_ref(), harmony)?;
    let tools = body.tools.map(Value::Array);
    let plan = super::tools::ToolPlan::new(
        &s,
        super::tools::openai_tools(tools.as_ref())?,
        ToolChoice::Auto,
        false,
        "tools",
    )?;
    let messages = body.messages.unwrap_or_default();
    if messages.is_empty() {
        return Ok(load_reply(&model, What::Chat, body.keep_alive.as_ref()));
    }
    let messages = messages
        .into_iter()
        .map(|m| {
            if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool") {
                return Err(bad(
                    "messages",
                    format!(
                        "role `{}` is not supported (system, user, assistant, tool)",
                        m.role
                    ),
                ));
            }
            if has_items(&m.images) {
                return Err(bad(
                    "messages",
                    "images are not supported: the model reads text only".into(),
                ));
            }
            let calls = m.tool_calls.map(Value::Array);
            let mut msg = Message::new(m.role, m.content.unwrap_or_default());
            msg.tool_calls = super::tools::openai_calls(calls.as_ref())?;
            if msg.role == "tool" {
                msg.name = m.tool_name;
            }
            Ok(msg)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let stream = body.stream.unwrap_or(true);
    let mut p = Options::from_json(body.options)?.params(Kind::Chat, stream)?;
    p.grammar = format_grammar(body.format.as_ref())?;
    let mut vars = TemplateVars {
        reasoning_effort: think.effort.clone(),
        ..TemplateVars::default()
    };
    let mut messages = messages;
    if let Some(plan) = &plan {
        if p.grammar.is_some() {
            return Err(bad("format", "`format` cannot be combined with `tools`".into()).into());
        }
        p.grammar = plan.grammar()?;
        let (m, tools_var) = plan.prepare(&s, &messages)?;
        messages = m;
        vars.tools = tools_var;
    }
    let prompt = tokenize(&s, Prompt::Chat(messages, vars)).await?;
    let reply = Reply {
        what: What::Chat,
        model,
        harmony: harmony.then_some(think),
        tools: plan.map(|p| p.format),
    };
    answer(&s, p, prompt, reply, t0).await
}

async fn generate(
    State(s): State<Shared>,
    OllamaJson(body): OllamaJson<GenerateBody>,
) -> Result<Response, OllamaError> {
    let t0 = Instant::now();
    if s.draining.load(Ordering::SeqCst) {
        return Err(shutting_down().into());
    }
    let model = served_model(&s, body.model.as_deref());
    let harmony = is_harmony(s.backend.tokenizer());
    let think = supported(body.format.as_ref(), body.think.as_ref(), harmony)?;
    if has_items(&body.images) {
        return Err(bad(
            "images",
            "images are not supported: the model reads text only".into(),
        )
        .into());
    }
    if body.suffix.as_deref().is_some_and(|x| !x.is_empty()) {
        return Err(bad(
            "suffix",
            "`suffix` (fill-in-the-middle) is not supported".into(),
        )
        .into());
    }
    if body.template.as_deref().is_some_and(|x| !x.is_empty()) {
        return Err(bad(
            "template",
            "a per-request `template` is not supported: the model's chat template is used \
             (or send `raw: true` with a prompt in the model's format)"
                .into(),
        )
        .into());
    }
    if has_items(&body.context) {
        return Err(bad(
            "context",
            "`context` is not supported: send the conversation to /api/chat".into(),
        )
        .into());
    }
    let text = body.prompt.unwrap_or_default();
    if text.is_empty() {
        return Ok(load_reply(&model, What::Generate, body.keep_alive.as_ref()));
    }
    let stream = body.stream.unwrap_or(true);
    let mut p = Options::from_json(body.options)?.params(Kind::Completion, stream)?;
    p.grammar = format_grammar(body.format.as_ref())?;
    // Raw: the client wrote the model's format itself, so its special-token texts are
    // control tokens. Otherwise the prompt is one user turn in the chat template (with
    // `system`), or plain text when the model has none.
    let prompt = if body.raw == Some(true) {
        Prompt::Text {
            text,
            special: true,
        }
    } else if s.backend.template().is_some() {
        let mut messages = Vec::new();
        if let Some(system) = body.system.filter(|x| !x.is_empty()) {
            messages.push(Message::new("system", system));
        }
        messages.push(Message::new("user", text));
        let vars = TemplateVars {
            reasoning_effort: think.effort.clone(),
            ..TemplateVars::default()
        };
        Prompt::Chat(messages, vars)
    } else {
        Prompt::Text {
            text,
            special: false,
        }
    };
    // A raw prompt's reply is shown as the model wrote it.
    let templated = matches!(prompt, Prompt::Chat(..));
    let prompt = tokenize(&s, prompt).await?;
    let reply = Reply {
        what: What::Generate,
        model,
        harmony: (harmony && templated).then_some(think),
        tools: None,
    };
    answer(&s, p, prompt, reply, t0).await
}

/// The served model as `/api/tags` and `/api/ps` list it.
fn listed(s: &Shared) -> Value {
    let name = format!("{}:latest", s.backend.model_id());
    let card = &s.model;
    json!({
        "name": name,
        "model": name,
        "modified_at": rfc3339(card.modified.unwrap_or(UNIX_EPOCH + std::time::Duration::from_secs(s.started))),
        "size": card.size,
        "digest": card.digest,
        "details": card.details(),
    })
}

async fn tags(State(s): State<Shared>) -> Json<Value> {
    Json(json!({ "models": [listed(&s)] }))
}

async fn ps(State(s): State<Shared>) -> Json<Value> {
    let mut m = listed(&s);
    m["size_vram"] = json!(0);
    m["context_length"] = json!(s.backend.ctx());
    Json(json!({ "models": [m] }))
}

async fn version() -> Json<Value> {
    Json(json!({ "version": env!("CARGO_PKG_VERSION") }))
}

async fn show(
    State(s): State<Shared>,
    OllamaJson(body): OllamaJson<ShowBody>,
) -> Result<Response, OllamaError> {
    let requested = body.model.or(body.name);
    served_model(&s, requested.as_deref());
    let card = &s.model;
    let template = s
        .backend
        .template()
        .map_or_else(String::new, |t| t.source().to_string());
    let arch = &card.architecture;
    let mut info = serde_json::Map::new();
    info.insert("general.architecture".into(), json!(arch));
    info.insert("general.parameter_count".into(), json!(card.parameters));
    if !arch.is_empty() {
        info.insert(format!("{arch}.context_length"), json!(card.context_length));
    }
    let modelfile = format!(
        "# served by ringllm\nFROM {}\nPARAMETER num_ctx {}\n",
        s.backend.model_id(),
        s.backend.ctx()
    );
    Ok(Json(json!({
        "license": "",
        "modelfile": modelfile,
        "parameters": format!("num_ctx {}", s.backend.ctx()),
        "template": template,
        "details": card.details(),
        "model_info": Value::Object(info),
        // Tools need a chat template to render them (Home Assistant and Open WebUI read this).
        "capabilities": if s.backend.template().is_some() {
            json!(["completion", "tools"])
        } else {
            json!(["completion"])
        },
        "modified_at": rfc3339(card.modified.unwrap_or(UNIX_EPOCH)),
    }))
    .into_response())
}

/// `2026-11-26T07:03:04.123456789Z`.
fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_nanos()
    )
}

#[cfg(test)]
mod tests {
    use super::rfc3339;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000000Z");
        let t = UNIX_EPOCH + Duration::new(951_782_400, 5);
        assert_eq!(rfc3339(t), "2000-02-29T00:00:00.000000005Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_795_647_723);
        assert_eq!(rfc3339(t), "2026-11-25T23:02:03.000000000Z");
    }
}
