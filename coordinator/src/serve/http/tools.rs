//! Tool calling on the HTTP APIs, shared by OpenAI's, Ollama's and Anthropic's shapes: the
//! request's tools in our terms ([`ToolPlan`]), the prompt they make with the model's own
//! format (`text::tools`), the grammar that forces a call when the client requires one, and
//! the calls read back out of the reply.
//!
//! The format is the model's (`ToolFormat::detect` on its chat template); with
//! `tool_choice` `required` or a named function the grammar forces a well-formed call of a
//! declared function whose arguments keep its schema; with `auto` the model writes text or
//! calls freely and the calls are parsed out (a span that looks like a call but is not valid
//! stays text, as the client would see it).

use super::{ApiError, AppState};
use crate::text::grammar::GrammarSpec;
use crate::text::harmony::{ChannelParser, Split};
use crate::text::template::Message;
use crate::text::tools::{self, StreamItem, Tool, ToolCall, ToolChoice, ToolFormat, ToolStream};
use serde_json::{json, Value};

/// Most tools one request may declare.
const MAX_TOOLS: usize = 128;

/// A request's tools, in our terms.
#[derive(Clone, Debug)]
pub(crate) struct ToolPlan {
    pub format: ToolFormat,
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    pub parallel: bool,
}

fn bad(param: &'static str, message: String) -> ApiError {
    ApiError::invalid(message).param(param)
}

/// The model's tool-call format.
pub(crate) fn model_format(s: &AppState) -> ToolFormat {
    let source = s.backend.template().map(|t| t.source());
    if crate::text::harmony::is_harmony(s.backend.tokenizer()) {
        return ToolFormat::Harmony;
    }
    ToolFormat::detect(source, "")
}

impl ToolPlan {
    /// From the shapes of a request: `tools` as a list of `Tool`s already read, the choice,
    /// and whether several calls may come at once ([`check`]ed). `None` when there are no
    /// tools.
    pub(crate) fn new(
        s: &AppState,
        tools: Vec<Tool>,
        choice: ToolChoice,
        parallel: bool,
        param: &'static str,
    ) -> Result<Option<ToolPlan>, ApiError> {
        check(&tools, &choice, param)?;
        if tools.is_empty() {
            return Ok(None);
        }
        Ok(Some(ToolPlan {
            format: model_format(s),
            tools,
            choice,
            parallel,
        }))
    }

    /// The grammar of the reply: with `required` or a named function exactly the call(s);
    /// with `auto` free text, or text and then well-formed calls (the grammar takes over at
    /// the call marker, so a small model's calls are valid too); none with `none`. The caller
    /// compiles it (a schema llguidance cannot take is then a 400 naming it).
    pub(crate) fn grammar(&self) -> Result<Option<(GrammarSpec, &'static str)>, ApiError> {
        if self.choice == ToolChoice::None {
            return Ok(None);
        }
        tools::call_grammar(self.format, &self.tools, &self.choice, self.parallel)
            .map(|g| Some((GrammarSpec::Lark(g), "tools")))
            .map_err(|e| bad("tools", e))
    }

    /// The messages and the template's `tools` variable.
    ///
    /// A template that reads `tools` renders the tools' schemas and the history's call
    /// arguments as markup, where special-token text would become control tokens (only message
    /// contents are kept text): such text there is refused, so a client cannot forge a turn
    /// through a tool's description or a call's arguments.
    pub(crate) fn prepare(
        &self,
        s: &AppState,
        messages: &[Message],
    ) -> Result<(Vec<Message>, Option<Value>), ApiError> {
        let tok = s.backend.tokenizer();
        let forged = |text: &str| !tok.control_spans(text).is_empty();
        for t in &self.tools {
            let text = serde_json::to_string(t).unwrap_or_default();
            if forged(&text) {
                return Err(bad(
                    "tools",
                    format!("tool `{}` holds special-token text", t.name),
                ));
            }
        }
        for m in messages {
            for c in &m.tool_calls {
                if forged(&c.name) || forged(&c.arguments.to_string()) {
                    return Err(bad(
                        "messages",
                        format!("the call of `{}` holds special-token text", c.name),
                    ));
                }
            }
        }
        let source = s.backend.template().map_or("", |t| t.source());
        Ok(tools::prepare(
            self.format,
            source,
            messages,
            &self.tools,
            &self.choice,
        ))
    }

    /// Whether the reply is read for calls (not with `none`).
    pub(crate) fn reads_calls(&self) -> bool {
        self.choice != ToolChoice::None
    }
}

/// What every API checks of a request's tools, whatever its shape: at most [`MAX_TOOLS`],
/// names of 1 to 64 characters declared once, parameters that are a JSON schema object, a
/// named choice among them, and tools for a choice that requires a call.
pub(crate) fn check(
    tools: &[Tool],
    choice: &ToolChoice,
    param: &'static str,
) -> Result<(), ApiError> {
    if tools.is_empty() {
        return match choice {
            ToolChoice::Auto | ToolChoice::None => Ok(()),
            _ => Err(bad(
                param,
                "`tool_choice` requires a call, which needs `tools`".into(),
            )),
        };
    }
    if tools.len() > MAX_TOOLS {
        return Err(bad(
            param,
            format!("at most {MAX_TOOLS} tools per request, not {}", tools.len()),
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for t in tools {
        if t.name.is_empty() || t.name.len() > 64 {
            return Err(bad(
                param,
                format!("tool name {:?} must be 1 to 64 characters", t.name),
            ));
        }
        if !seen.insert(t.name.as_str()) {
            return Err(bad(param, format!("tool `{}` is declared twice", t.name)));
        }
        if !t.parameters.is_object() {
            return Err(bad(
                param,
                format!(
                    "the parameters of tool `{}` must be a JSON schema object",
                    t.name
                ),
            ));
        }
    }
    if let ToolChoice::Named(n) = choice {
        if !tools.iter().any(|t| &t.name == n) {
            return Err(bad(
                "tool_choice",
                format!("tool_choice names `{n}`, which is not among the tools"),
            ));
        }
    }
    Ok(())
}

/// OpenAI's `tools`: `[{"type": "function", "function": {name, description, parameters}}]`.
pub(crate) fn openai_tools(v: Option<&Value>) -> Result<Vec<Tool>, ApiError> {
    let items = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(bad("tools", "`tools` must be an array".into())),
    };
    items
        .iter()
        .enumerate()
        .map(|(i, t)| {
            match t.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(other) => {
                    return Err(bad(
                        "tools",
                        format!("tools[{i}]: type `{other}` is not supported (function)"),
                    ))
                }
                None => return Err(bad("tools", format!("tools[{i}] has no `type`"))),
            }
            let f = t
                .get("function")
                .ok_or_else(|| bad("tools", format!("tools[{i}] has no `function`")))?;
            tool_from(f, "parameters", i, "tools")
        })
        .collect()
}

/// A tool from `{name, description, <schema key>}`.
pub(crate) fn tool_from(
    f: &Value,
    schema_key: &str,
    i: usize,
    param: &'static str,
) -> Result<Tool, ApiError> {
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(param, format!("{param}[{i}] has no `name` string")))?;
    let description = f
        .get("description")
        .and_then(Value::as_str)
        .map(str::to_string);
    let parameters = match f.get(schema_key) {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p) => p.clone(),
    };
    Ok(Tool {
        name: name.to_string(),
        description,
        parameters,
    })
}

/// OpenAI's `tool_choice`: `"auto"`, `"none"`, `"required"` or
/// `{"type": "function", "function": {"name": ...}}`.
pub(crate) fn openai_choice(v: Option<&Value>) -> Result<ToolChoice, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            other => Err(bad(
                "tool_choice",
                format!("`tool_choice` {other:?} is not one of auto, none, required"),
            )),
        },
        Some(o) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match (o.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(n)) => Ok(ToolChoice::Named(n.to_string())),
                _ => Err(bad(
                    "tool_choice",
                    "`tool_choice` must be auto, none, required or {\"type\": \"function\", \
                     \"function\": {\"name\": ...}}"
                        .into(),
                )),
            }
        }
    }
}

/// A call's arguments from the wire: an object, or a string holding one (OpenAI sends them
/// as a JSON string).
pub(crate) fn arguments(v: Option<&Value>, param: &'static str) -> Result<Value, ApiError> {
    let parsed = match v {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) if s.trim().is_empty() => json!({}),
        Some(Value::String(s)) => serde_json::from_str(s).map_err(|e| {
            bad(
                param,
                format!("a tool call's arguments are not valid JSON: {e}"),
            )
        })?,
        Some(o) => o.clone(),
    };
    if !parsed.is_object() {
        return Err(bad(
            param,
            "a tool call's arguments must be a JSON object".into(),
        ));
    }
    Ok(parsed)
}

/// An assistant message's `tool_calls` in OpenAI's shape, read.
pub(crate) fn openai_calls(v: Option<&Value>) -> Result<Vec<ToolCall>, ApiError> {
    let items = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(bad("messages", "`tool_calls` must be an array".into())),
    };
    items
        .iter()
        .map(|c| {
            let f = c
                .get("function")
                .ok_or_else(|| bad("messages", "a tool call has no `function`".into()))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("messages", "a tool call has no function `name`".into()))?;
            let id = c
                .get("id")
                .and_then(Value::as_str)
                .map_or_else(tools::new_call_id, str::to_string);
            Ok(ToolCall {
                id,
                name: name.to_string(),
                arguments: arguments(f.get("arguments"), "messages")?,
            })
        })
        .collect()
}

/// A call in OpenAI's shape (arguments as a JSON string), with its index for stream deltas.
pub(crate) fn openai_call(c: &ToolCall, index: Option<usize>) -> Value {
    let mut v = json!({
        "id": c.id,
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments.to_string()},
    });
    if let Some(i) = index {
        v["index"] = json!(i);
    }
    v
}

/// What a reply's text holds, in order: answer text (split into reasoning and answer for a
/// harmony model) and tool calls.
#[derive(Debug)]
pub(crate) enum Piece {
    Text(Split),
    Call(ToolCall),
}

/// Reads a reply as it streams, for every API: the tool-call stream first (when the request
/// has tools: calls come out whole, text around them as it is safe), then a harmony model's
/// channel split of the text. `last` marks the reply's end, where held text is released.
pub(crate) struct ReplyReader {
    tools: Option<ToolStream>,
    channels: Option<ChannelParser>,
}

impl ReplyReader {
    pub(crate) fn new(tools: Option<ToolFormat>, harmony: bool) -> ReplyReader {
        ReplyReader {
            tools: tools.map(ToolStream::new),
            channels: harmony.then(ChannelParser::new),
        }
    }

    /// The pieces `text` completes (empty text pieces left out).
    pub(crate) fn push(&mut self, text: &str, last: bool) -> Vec<Piece> {
        let items = match self.tools.as_mut() {
            Some(ts) => {
                let mut items = ts.push(text);
                if last {
                    items.extend(ts.finish());
                }
                items
            }
            None => vec![StreamItem::Content(text.to_string())],
        };
        let mut out = Vec::with_capacity(items.len() + 1);
        let text_piece = |split: Split, out: &mut Vec<Piece>| {
            if !split.is_empty() {
                out.push(Piece::Text(split));
            }
        };
        for item in items {
            match item {
                StreamItem::Content(c) => {
                    let split = match self.channels.as_mut() {
                        Some(p) => p.push(&c),
                        None => Split {
                            reasoning: String::new(),
                            content: c,
                        },
                    };
                    text_piece(split, &mut out);
                }
                StreamItem::Call(call) => out.push(Piece::Call(call)),
            }
        }
        if last {
            if let Some(p) = self.channels.as_mut() {
                text_piece(p.finish(), &mut out);
            }
        }
        out
    }

    /// A whole reply: its text (split as above) and its calls.
    pub(crate) fn whole(
        tools: Option<ToolFormat>,
        harmony: bool,
        text: &str,
    ) -> (Split, Vec<ToolCall>) {
        let (text, calls) = match tools {
            Some(f) => {
                let parsed = tools::parse(f, text);
                (parsed.content, parsed.calls)
            }
            None => (text.to_string(), Vec::new()),
        };
        let split = if harmony {
            ChannelParser::split(&text)
        } else {
            Split {
                reasoning: String::new(),
                content: text,
            }
        };
        (split, calls)
    }
}
