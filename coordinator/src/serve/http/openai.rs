//! OpenAI's wire format: request bodies and their checks, response objects, SSE chunks.

use super::tools::{openai_call, Piece, ReplyReader};
use super::{ApiError, CancelOnDrop, Collected};
use crate::serve::{Finish, GenEvent, ResumeStats, Sampling, TokenLogprob};
use crate::text::grammar::GrammarSpec;
use crate::text::harmony::{ChannelParser, Split};
use crate::text::template::{Message, TemplateVars};
use crate::text::tools::ToolFormat;
use axum::body::Bytes;
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;

/// Most stop strings per request.
const MAX_STOP: usize = 16;
/// Most alternatives per token: 20 for chat (`top_logprobs`), 5 for the legacy `logprobs`.
const MAX_TOP_LOGPROBS_CHAT: u64 = 20;
const MAX_LOGPROBS_COMPLETION: u64 = 5;

/// The body of both generation endpoints; unknown fields are ignored (front ends send many).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct Body {
    pub model: Option<String>,
    /// Chat only.
    pub messages: Option<Vec<InMessage>>,
    /// Completions only: a string, an array of one string, or token ids.
    pub prompt: Option<Value>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<u64>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// llama.cpp's name for `repetition_penalty`.
    pub repeat_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub seed: Option<serde_json::Number>,
    pub stop: Option<Value>,
    pub n: Option<u64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Chat: a bool; completions: an integer (how many alternatives).
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<u64>,
    /// Completions only: special-token texts in the prompt (`<|im_start|>`) become control
    /// tokens; by default the prompt is plain text (llama.cpp's name).
    pub parse_special: Option<bool>,
    /// Chat: how hard a reasoning model thinks, "low", "medium" or "high" (gpt-oss's chat
    /// template reads it; others ignore it).
    pub reasoning_effort: Option<String>,
    /// Structured output: `{"type": "text" | "json_object" | "json_schema", ...}`, and ours,
    /// `{"type": "regex", "regex": ...}` and `{"type": "lark", "lark": ...}`.
    pub response_format: Option<Value>,
    /// llama.cpp's shorthand for `response_format: {type: json_schema}`: the schema itself.
    pub json_schema: Option<Value>,
    /// Chat: functions the model may call, and whether/which it must.
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Fields of OpenAI's (or llama.cpp's) that this server does not do: refused by name
    /// ([`UNSUPPORTED`]), never ignored.
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// Request fields this server refuses by name, with why or what to send instead. Fields not
/// listed and not read are ignored: front ends send many that change nothing (`user`,
/// `metadata`, `service_tier`).
pub(super) const UNSUPPORTED: &[(&str, &str)] = &[
    (
        "functions",
        "the legacy `functions` are not supported: send them as `tools`",
    ),
    (
        "function_call",
        "the legacy `function_call` is not supported: use `tool_choice`",
    ),
    ("logit_bias", "`logit_bias` is not supported"),
    ("audio", "audio output is not supported"),
    ("modalities", "only text output is supported (`modalities`)"),
    (
        "prediction",
        "predicted outputs (`prediction`) are not supported",
    ),
    (
        "web_search_options",
        "web search (`web_search_options`) is not supported",
    ),
    (
        "grammar",
        "GBNF grammars (`grammar`) are not supported: send a Lark grammar as \
         `response_format: {\"type\": \"lark\", \"lark\": ...}`",
    ),
    ("store", "stored completions (`store`) are not supported"),
];

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub(super) struct InMessage {
    pub role: String,
    /// A string, an array of `{type: "text", text}` parts, or null.
    #[serde(default)]
    pub content: Option<Value>,
    /// An assistant message's calls: `[{id, type: "function", function: {name, arguments}}]`.
    #[serde(default)]
    pub tool_calls: Option<Value>,
    /// A `tool` message: the call it answers, and (older clients) the function's name.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Chat,
    Completion,
}

impl Kind {
    pub fn prompt_param(self) -> &'static str {
        match self {
            Kind::Chat => "messages",
            Kind::Completion => "prompt",
        }
    }
}

/// A request's checked settings.
#[derive(Debug)]
pub(super) struct Params {
    pub kind: Kind,
    /// `None`: as many as the context leaves.
    pub max_tokens: Option<u64>,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    pub logprobs: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    /// The chat template's variables (`reasoning_effort`).
    pub vars: TemplateVars,
    /// The grammar the output must follow, and the request field that asked for it (named in
    /// the 400 when it does not compile).
    pub grammar: Option<(GrammarSpec, &'static str)>,
}

pub(super) fn bad(param: &'static str, message: String) -> ApiError {
    ApiError::invalid(message).param(param)
}

/// `v` (or `default`) when within `lo..=hi`.
pub(super) fn within(
    v: Option<f32>,
    param: &'static str,
    lo: f32,
    hi: f32,
    default: f32,
) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if (lo..=hi).contains(&x) => Ok(x),
        Some(x) => Err(bad(
            param,
            format!("`{param}` must be between {lo} and {hi}, not {x}"),
        )),
    }
}

/// Refuses the fields of [`UNSUPPORTED`] a request sets (`null`, `false` and empty values
/// ask for nothing and pass; so does `modalities: ["text"]`).
fn refuse_unsupported(b: &Body) -> Result<(), ApiError> {
    for (name, why) in UNSUPPORTED {
        let asks = match b.other.get(*name) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Array(a)) if *name == "modalities" => {
                a.iter().any(|m| m.as_str() != Some("text"))
            }
            Some(Value::Array(a)) => !a.is_empty(),
            Some(Value::Object(o)) => !o.is_empty(),
            Some(Value::String(s)) => !s.is_empty(),
            Some(_) => true,
        };
        if asks {
            return Err(bad(name, (*why).to_string()));
        }
    }
    Ok(())
}

/// `response_format` (or llama.cpp's `json_schema`) as a grammar; `None` for plain text.
pub(super) fn response_format(b: &Body) -> Result<Option<(GrammarSpec, &'static str)>, ApiError> {
    if let Some(schema) = b.json_schema.as_ref().filter(|v| !v.is_null()) {
        if b.response_format.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(bad(
                "json_schema",
                "send either `response_format` or `json_schema`, not both".into(),
            ));
        }
        return Ok(Some((
            GrammarSpec::JsonSchema(schema.clone()),
            "json_schema",
        )));
    }
    let p = "response_format";
    let Some(rf) = b.response_format.as_ref().filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let field = |name: &str| rf.get(name).filter(|v| !v.is_null());
    let text = |name: &str| -> Result<String, ApiError> {
        field(name)
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| bad(p, format!("`response_format.{name}` must be a string")))
    };
    let spec = match rf.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(None),
        Some("json_object") => GrammarSpec::JsonObject,
        Some("json_schema") => {
            let js = field("json_schema")
                .ok_or_else(|| bad(p, "`response_format.json_schema` is missing".into()))?;
            match js.get("schema").filter(|v| !v.is_null()) {
                Some(schema) => GrammarSpec::JsonSchema(schema.clone()),
                None => {
                    return Err(bad(
                        p,
                        "`response_format.json_schema.schema` is missing".into(),
                    ))
                }
            }
        }
        Some("regex") => GrammarSpec::Regex(text("regex")?),
        Some("lark") => GrammarSpec::Lark(text("lark")?),
        Some(other) => {
            return Err(bad(
                p,
                format!(
                    "`response_format.type` {other:?} is not supported (text, json_object, \
                     json_schema, regex, lark)"
                ),
            ))
        }
        None => return Err(bad(p, "`response_format.type` is missing".into())),
    };
    Ok(Some((spec, p)))
}

impl Params {
    pub fn from_body(b: &Body, kind: Kind) -> Result<Params, ApiError> {
        refuse_unsupported(b)?;
        if let Some(n) = b.n.filter(|&n| n != 1) {
            return Err(bad("n", format!("only n = 1 is supported, not {n}")));
        }
        if kind == Kind::Chat && b.parse_special == Some(true) {
            return Err(bad(
                "parse_special",
                "`parse_special` is for /v1/completions: chat message contents are always text"
                    .into(),
            ));
        }
        if kind == Kind::Completion {
            if b.echo == Some(true) {
                return Err(bad("echo", "`echo` is not supported".into()));
            }
            if b.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
                return Err(bad("suffix", "`suffix` is not supported".into()));
            }
            if let Some(n) = b.best_of.filter(|&n| n > 1) {
                return Err(bad(
                    "best_of",
                    format!("only best_of = 1 is supported, not {n}"),
                ));
            }
        }
        let (max_param, max_tokens) = match b.max_completion_tokens {
            Some(m) => ("max_completion_tokens", Some(m)),
            None => ("max_tokens", b.max_tokens),
        };
        if max_tokens == Some(0) {
            return Err(bad(max_param, format!("`{max_param}` must be at least 1")));
        }
        let (rep_param, rep) = match b.repetition_penalty {
            Some(r) => ("repetition_penalty", Some(r)),
            None => ("repeat_penalty", b.repeat_penalty),
        };
        let seed = match &b.seed {
            None => None,
            Some(n) => Some(
                n.as_u64()
                    .or_else(|| n.as_i64().map(|i| i as u64))
                    .ok_or_else(|| bad("seed", format!("`seed` must be an integer, not {n}")))?,
            ),
        };
        let sampling = Sampling {
            temperature: within(b.temperature, "temperature", 0.0, 2.0, 1.0)?,
            top_p: within(b.top_p, "top_p", 0.0, 1.0, 1.0)?,
            // vLLM and others send -1 for "off".
            top_k: b.top_k.map_or(0, |k| k.max(0) as usize),
            min_p: within(b.min_p, "min_p", 0.0, 1.0, 0.0)?,
            repetition_penalty: match rep {
                Some(r) if !(r > 0.0 && r <= 10.0) => {
                    return Err(bad(
                        rep_param,
                        format!("`{rep_param}` must be in (0, 10], not {r}"),
                    ))
                }
                r => r.unwrap_or(1.0),
            },
            frequency_penalty: within(b.frequency_penalty, "frequency_penalty", -2.0, 2.0, 0.0)?,
            presence_penalty: within(b.presence_penalty, "presence_penalty", -2.0, 2.0, 0.0)?,
            seed,
        };
        let stream = b.stream.unwrap_or(false);
        let reasoning_effort = match b.reasoning_effort.as_deref() {
            None => None,
            Some(e @ ("low" | "medium" | "high")) => Some(e.to_string()),
            Some(other) => {
                return Err(bad(
                    "reasoning_effort",
                    format!("`reasoning_effort` must be low, medium or high, not {other:?}"),
                ))
            }
        };
        Ok(Params {
            kind,
            max_tokens,
            sampling,
            stop: stop_strings(b.stop.as_ref())?,
            logprobs: logprobs(b, kind)?,
            stream,
            include_usage: stream
                && b.stream_options.as_ref().and_then(|o| o.include_usage) == Some(true),
            vars: TemplateVars {
                reasoning_effort,
                ..TemplateVars::default()
            },
            grammar: response_format(b)?,
        })
    }
}

pub(super) fn stop_strings(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let all = match v {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| i.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                bad(
                    "stop",
                    "`stop` must be a string or an array of strings".into(),
                )
            })?,
        Some(_) => {
            return Err(bad(
                "stop",
                "`stop` must be a string or an array of strings".into(),
            ))
        }
    };
    if all.len() > MAX_STOP {
        return Err(bad(
            "stop",
            format!("at most {MAX_STOP} stop strings, not {}", all.len()),
        ));
    }
    Ok(all.into_iter().filter(|s| !s.is_empty()).collect())
}

fn logprobs(b: &Body, kind: Kind) -> Result<Option<usize>, ApiError> {
    if let Some(k) = b.top_logprobs.filter(|&k| k > MAX_TOP_LOGPROBS_CHAT) {
        return Err(bad(
            "top_logprobs",
            format!("`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS_CHAT}, not {k}"),
        ));
    }
    match (kind, &b.logprobs) {
        (_, None | Some(Value::Null) | Some(Value::Bool(false))) => Ok(None),
        (Kind::Chat, Some(Value::Bool(true))) => Ok(Some(b.top_logprobs.unwrap_or(0) as usize)),
        (Kind::Chat, Some(_)) => Err(bad("logprobs", "`logprobs` must be true or false".into())),
        (Kind::Completion, Some(Value::Bool(true))) => Ok(Some(0)),
        (Kind::Completion, Some(v)) => match v.as_u64() {
            Some(k) if k <= MAX_LOGPROBS_COMPLETION => Ok(Some(k as usize)),
            _ => Err(bad(
                "logprobs",
                format!("`logprobs` must be an integer between 0 and {MAX_LOGPROBS_COMPLETION}, not {v}"),
            )),
        },
    }
}

/// The conversation for the template: roles checked, content parts joined.
pub(super) fn chat_messages(messages: Option<Vec<InMessage>>) -> Result<Vec<Message>, ApiError> {
    let messages = messages.ok_or_else(|| bad("messages", "`messages` is missing".into()))?;
    if messages.is_empty() {
        return Err(bad("messages", "`messages` is empty".into()));
    }
    messages
        .into_iter()
        .map(|m| {
            let role = match m.role.as_str() {
                "system" | "user" | "assistant" | "tool" => m.role,
                // OpenAI's newer name for the system prompt.
                "developer" => "system".into(),
                other => {
                    return Err(bad(
                        "messages",
                        format!("role `{other}` is not supported (system, user, assistant, tool)"),
                    ))
                }
            };
            let tool_calls = super::tools::openai_calls(m.tool_calls.as_ref())?;
            if !tool_calls.is_empty() && role != "assistant" {
                return Err(bad(
                    "messages",
                    format!("a `{role}` message cannot have `tool_calls`"),
                ));
            }
            let content = match m.content {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s,
                Some(Value::Array(parts)) => {
                    let texts = parts
                        .iter()
                        .map(|p| match p.get("type").and_then(Value::as_str) {
                            Some("text") => {
                                p.get("text").and_then(Value::as_str).ok_or_else(|| {
                                    bad("messages", "a text part has no `text` string".into())
                                })
                            }
                            Some(t) => Err(bad(
                                "messages",
                                format!(
                                    "content parts of type `{t}` are not supported (only text)"
                                ),
                            )),
                            None => Err(bad("messages", "a content part has no `type`".into())),
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    texts.join("\n")
                }
                Some(_) => {
                    return Err(bad(
                        "messages",
                        "`content` must be a string or an array of text parts".into(),
                    ))
                }
            };
            let mut msg = Message::new(role, content);
            msg.tool_calls = tool_calls;
            if msg.role == "tool" {
                msg.tool_call_id = m.tool_call_id;
                msg.name = m.name;
            }
            Ok(msg)
        })
        .collect()
}

pub(super) enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

/// `/v1/completions`' prompt: a string, `[string]`, `[id, …]` or `[[id, …]]`.
pub(super) fn completion_prompt(v: Option<Value>) -> Result<PromptInput, ApiError> {
    let wrong = || {
        bad(
            "prompt",
            "`prompt` must be a string, an array of one string, or an array of token ids".into(),
        )
    };
    let ids = |items: &[Value]| -> Option<Vec<u32>> {
        items
            .iter()
            .map(|i| i.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect()
    };
    match v {
        None | Some(Value::Null) => Err(bad("prompt", "`prompt` is missing".into())),
        Some(Value::String(s)) => Ok(PromptInput::Text(s)),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => Err(bad("prompt", "`prompt` is empty".into())),
            [Value::String(s)] => Ok(PromptInput::Text(s.clone())),
            [Value::Array(inner)] => ids(inner).map(PromptInput::Tokens).ok_or_else(wrong),
            [Value::String(_) | Value::Array(_), ..] => Err(bad(
                "prompt",
                format!(
                    "only one prompt per request is supported, not {}",
                    items.len()
                ),
            )),
            _ => ids(&items).map(PromptInput::Tokens).ok_or_else(wrong),
        },
        Some(_) => Err(wrong()),
    }
}

pub(crate) struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    pub resume: ResumeStats,
}

impl Usage {
    /// OpenAI's usage object; a request resumed after a node loss also has `resumed` (times)
    /// and `resume_ms` (the pause, summed).
    fn json(&self) -> Value {
        let mut v = json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        });
        if self.resume.resumed > 0 {
            v["resumed"] = json!(self.resume.resumed);
            v["resume_ms"] = json!((self.resume.resume_ms * 10.0).round() / 10.0);
        }
        v
    }
}

pub(super) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// OpenAI has no "cancelled": a request cut short by a shutdown reads as truncated.
fn finish_reason(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "stop",
        Finish::Length | Finish::Cancelled => "length",
    }
}

/// Builds the response objects of one request.
pub(super) struct Reply {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    include_usage: bool,
    /// The reply is harmony (gpt-oss): its analysis channel goes to `reasoning_content`, its
    /// final channel to `content` (see [`crate::text::harmony`]).
    harmony: bool,
    /// The reply is read for tool calls in this format.
    tools: Option<ToolFormat>,
    /// A streamed reply made calls: it finishes with `tool_calls`.
    called: bool,
}

impl Reply {
    pub fn new(p: &Params, model: String) -> Reply {
        let prefix = match p.kind {
            Kind::Chat => "chatcmpl-",
            Kind::Completion => "cmpl-",
        };
        Reply {
            kind: p.kind,
            id: format!("{prefix}{:032x}", rand::random::<u128>()),
            created: unix_now(),
            model,
            logprobs: p.logprobs.is_some(),
            include_usage: p.include_usage,
            harmony: false,
            tools: None,
            called: false,
        }
    }

    /// Reads tool calls out of the reply in `format` (a chat request with tools).
    pub fn tools(mut self, format: Option<ToolFormat>) -> Reply {
        self.tools = format.filter(|_| self.kind == Kind::Chat);
        self
    }

    /// Splits a chat reply into reasoning and answer when `yes` (a harmony model's chat).
    pub fn harmony(mut self, yes: bool) -> Reply {
        self.harmony = yes && self.kind == Kind::Chat;
        self
    }

    fn object(&self, streamed: bool) -> &'static str {
        match (self.kind, streamed) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    /// `logprobs` of a choice for these tokens (with their text offsets).
    fn logprobs_json(&self, items: &[(TokenLogprob, usize)]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.kind {
            Kind::Chat => {
                let content: Vec<Value> = items
                    .iter()
                    .map(|(lp, _)| {
                        json!({
                            "token": lp.token,
                            "logprob": lp.logprob,
                            "bytes": lp.bytes,
                            "top_logprobs": lp.top,
                        })
                    })
                    .collect();
                json!({ "content": content })
            }
            Kind::Completion => {
                let top: Vec<Value> = items
                    .iter()
                    .map(|(lp, _)| {
                        let m: serde_json::Map<String, Value> = lp
                            .top
                            .iter()
                            .map(|t| (t.token.clone(), json!(t.logprob)))
                            .collect();
                        Value::Object(m)
                    })
                    .collect();
                json!({
                    "tokens": items.iter().map(|(lp, _)| &lp.token).collect::<Vec<_>>(),
                    "token_logprobs": items.iter().map(|(lp, _)| lp.logprob).collect::<Vec<_>>(),
                    "top_logprobs": top,
                    "text_offset": items.iter().map(|(_, o)| *o).collect::<Vec<_>>(),
                })
            }
        }
    }

    /// The non-streamed response.
    pub fn whole(&self, c: &Collected) -> Value {
        let mut choice = json!({
            "index": 0,
            "logprobs": self.logprobs_json(&c.logprobs),
            "finish_reason": finish_reason(c.finish),
        });
        match self.kind {
            Kind::Chat => {
                let (split, calls) = ReplyReader::whole(self.tools, self.harmony, &c.text);
                // With calls and no text, `content` is null (as OpenAI answers).
                let content = if calls.is_empty() || !split.content.is_empty() {
                    json!(split.content)
                } else {
                    Value::Null
                };
                let mut message = json!({"role": "assistant", "content": content});
                if !calls.is_empty() {
                    message["tool_calls"] = calls.iter().map(|c| openai_call(c, None)).collect();
                    if c.finish == Finish::Stop {
                        choice["finish_reason"] = json!("tool_calls");
                    }
                }
                if !split.reasoning.is_empty() {
                    message["reasoning_content"] = json!(split.reasoning);
                }
                choice["message"] = message;
            }
            Kind::Completion => choice["text"] = json!(c.text),
        }
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": c.usage.json(),
        })
    }

    /// One streamed chunk: `text` (chat: the delta's content), optionally the role, the
    /// tokens' log-probabilities, and the finish reason.
    fn chunk(
        &self,
        text: Option<&str>,
        role: bool,
        logprobs: Value,
        finish: Option<Finish>,
    ) -> Value {
        self.chunk_with(text, None, role, logprobs, finish)
    }

    /// [`Reply::chunk`] with the delta's `reasoning_content` (chat).
    fn chunk_with(
        &self,
        text: Option<&str>,
        reasoning: Option<&str>,
        role: bool,
        logprobs: Value,
        finish: Option<Finish>,
    ) -> Value {
        let mut choice = json!({
            "index": 0,
            "logprobs": logprobs,
            "finish_reason": finish.map(|f| match f {
                Finish::Stop if self.called => "tool_calls",
                f => finish_reason(f),
            }),
        });
        match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                if let Some(r) = reasoning {
                    delta.insert("reasoning_content".into(), json!(r));
                }
                choice["delta"] = Value::Object(delta);
            }
            Kind::Completion => choice["text"] = json!(text.unwrap_or("")),
        }
        self.envelope(json!([choice]), Value::Null)
    }

    fn envelope(&self, choices: Value, usage: Value) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if self.include_usage {
            v["usage"] = usage;
        }
        v
    }
}

fn event(v: &Value) -> String {
    format!("data: {v}\n\n")
}

const DONE: &str = "data: [DONE]\n\n";

/// Turns a request's events into SSE text; owns the cancel guard, so dropping the stream
/// (the client went away) cancels the request.
struct Streamer {
    reply: Reply,
    /// An event received before the stream started (the HTTP layer waits for the first).
    first: Option<GenEvent>,
    rx: tokio::sync::mpsc::UnboundedReceiver<GenEvent>,
    guard: CancelOnDrop,
    started: bool,
    ended: bool,
    /// Characters sent so far (the legacy `text_offset`).
    chars: usize,
    /// A harmony reply's channel parser.
    parser: Option<ChannelParser>,
    /// A reply read for tool calls: its calls come out as `tool_calls` deltas (the reader
    /// also splits a harmony reply's text; `parser` is then unused).
    reader: Option<ReplyReader>,
    /// Calls sent so far (each delta's `index`).
    calls: usize,
}

impl Streamer {
    /// The events for text of a reply read for tool calls (`last`: the end of the reply).
    fn tool_events(&mut self, text: &str, logprobs: Value, last: bool) -> String {
        let Some(reader) = self.reader.as_mut() else {
            return String::new();
        };
        let pieces = reader.push(text, last);
        let mut out = String::new();
        let mut lp = logprobs;
        for piece in pieces {
            match piece {
                Piece::Text(split) => {
                    out += &event(&self.delta(&split, std::mem::take(&mut lp), None));
                }
                Piece::Call(call) => {
                    let index = self.calls;
                    self.calls += 1;
                    self.reply.called = true;
                    let mut choice = json!({
                        "index": 0,
                        "logprobs": std::mem::take(&mut lp),
                        "finish_reason": null,
                        "delta": {"tool_calls": [openai_call(&call, Some(index))]},
                    });
                    if index == 0 {
                        choice["delta"]["content"] = Value::Null;
                    }
                    out += &event(&self.reply.envelope(json!([choice]), Value::Null));
                }
            }
        }
        if !lp.is_null() {
            out += &event(&self.reply.chunk(Some(""), false, lp, None));
        }
        out
    }

    async fn next(&mut self) -> Option<String> {
        if self.ended {
            return None;
        }
        if !self.started {
            self.started = true;
            if self.reply.kind == Kind::Chat {
                return Some(event(&self.reply.chunk(Some(""), true, Value::Null, None)));
            }
        }
        loop {
            let next = match self.first.take() {
                Some(e) => Some(e),
                None => self.rx.recv().await,
            };
            match next {
                Some(GenEvent::Token { text, logprob, .. }) => {
                    if text.is_empty() && logprob.is_none() {
                        continue;
                    }
                    let lp = match logprob {
                        Some(lp) => self.reply.logprobs_json(&[(lp, self.chars)]),
                        None => Value::Null,
                    };
                    self.chars += text.chars().count();
                    if self.reader.is_some() {
                        let out = self.tool_events(&text, lp, false);
                        if out.is_empty() {
                            continue; // text that may begin a call, or a call not yet whole
                        }
                        return Some(out);
                    }
                    let Some(parser) = self.parser.as_mut() else {
                        return Some(event(&self.reply.chunk(Some(&text), false, lp, None)));
                    };
                    let split = parser.push(&text);
                    if split.is_empty() && lp.is_null() {
                        continue; // markup, or text that may begin markup
                    }
                    return Some(event(&self.delta(&split, lp, None)));
                }
                Some(GenEvent::Done {
                    finish,
                    text,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                    resume,
                    ..
                }) => {
                    self.guard.disarm();
                    self.ended = true;
                    let mut out = String::new();
                    match self.parser.as_mut() {
                        _ if self.reader.is_some() => {
                            out += &self.tool_events(&text, Value::Null, true);
                        }
                        Some(parser) => {
                            let split = parser.push_last(&text);
                            if !split.is_empty() {
                                out += &event(&self.delta(&split, Value::Null, None));
                            }
                        }
                        None if !text.is_empty() => {
                            out += &event(&self.reply.chunk(Some(&text), false, Value::Null, None));
                        }
                        None => {}
                    }
                    out += &event(&self.reply.chunk(None, false, Value::Null, Some(finish)));
                    if self.reply.include_usage {
                        let usage = Usage {
                            prompt_tokens,
                            completion_tokens,
                            cached_tokens,
                            resume,
                        };
                        out += &event(&self.reply.envelope(json!([]), usage.json()));
                    }
                    out += DONE;
                    return Some(out);
                }
                Some(GenEvent::Error { message, .. }) => return Some(self.fail(message)),
                None => {
                    return Some(
                        self.fail("the engine stopped before finishing the request".into()),
                    )
                }
            }
        }
    }

    fn fail(&mut self, message: String) -> String {
        self.guard.disarm();
        self.ended = true;
        event(&ApiError::server(message).body()) + DONE
    }

    /// A chunk of a harmony reply: each non-empty part of `split` in its field.
    fn delta(&self, split: &Split, logprobs: Value, finish: Option<Finish>) -> Value {
        let some = |s: &str| (!s.is_empty()).then(|| s.to_string());
        self.reply.chunk_with(
            some(&split.content).as_deref(),
            some(&split.reasoning).as_deref(),
            false,
            logprobs,
            finish,
        )
    }
}

/// The SSE body of a streamed request.
pub(super) fn sse(
    reply: Reply,
    first: Option<GenEvent>,
    rx: tokio::sync::mpsc::UnboundedReceiver<GenEvent>,
    guard: CancelOnDrop,
) -> impl futures_util::Stream<Item = Result<Bytes, Infallible>> + Send + 'static {
    let reader = reply
        .tools
        .map(|f| ReplyReader::new(Some(f), reply.harmony));
    let parser = (reply.harmony && reader.is_none()).then(ChannelParser::new);
    let s = Streamer {
        reply,
        first,
        rx,
        guard,
        started: false,
        ended: false,
        chars: 0,
        parser,
        reader,
        calls: 0,
    };
    futures_util::stream::unfold(s, |mut s| async move {
        let text = s.next().await?;
        Some((Ok(Bytes::from(text)), s))
    })
}
