//! Anthropic's tool use ⇄ the engine's tool types (`crate::text::tools`): `tools` and
//! `tool_choice` of a request ([`tool_request`]), `tool_use` and `tool_result` blocks of the
//! history ([`tool_history`]), and the calls of an answer as `tool_use` blocks
//! ([`tool_reply`], and [`super::Events`] for streams). `serve::http::tools::ToolPlan` does the
//! rest, as for the other APIs: the model's format, the prompt, the grammar.
//!
//! Parallel calls: Anthropic lets the model make several calls at once unless
//! `disable_parallel_tool_use` is true. Here one call per reply is the default, as on the
//! OpenAI endpoint (and llama.cpp's server): a small model allowed more repeats its call until
//! `max_tokens`. Several calls at once are allowed only when the client says so,
//! `disable_parallel_tool_use: false`; `true` keeps its meaning (one call).

use crate::serve::http::tools::{check, tool_from};
use crate::serve::http::ApiError;
use crate::text::template::Message;
use crate::text::tools::{Tool, ToolCall, ToolChoice};
use serde_json::{json, Map, Value};

/// A request's tools.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ToolRequest {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// Several calls in one reply (see the module: only when the client asks).
    pub parallel: bool,
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::invalid(message)
}

/// Longest tool name (Anthropic's rule: `^[a-zA-Z0-9_-]{1,64}$`).
const MAX_NAME: usize = 64;

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// `tools` and `tool_choice`, checked; `None` when the request has no tools (then
/// `tool_choice` may only be `auto` or `none`). Client tools only: a server tool (`bash_…`,
/// `web_search_…`, `text_editor_…`, any typed tool but `custom`) is a 400 naming its type.
pub(crate) fn tool_request(
    tools: Option<&Value>,
    choice: Option<&Value>,
) -> Result<Option<ToolRequest>, ApiError> {
    let list = match tools {
        None => &[][..],
        Some(Value::Array(list)) => list.as_slice(),
        Some(_) => return Err(invalid("`tools` must be an array")),
    };
    let mut out: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let at = format!("tools[{i}]");
        let t = t
            .as_object()
            .ok_or_else(|| invalid(format!("{at}: a tool must be an object")))?;
        match t.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(kind) => {
                return Err(invalid(format!(
                    "{at}: server tools (`{kind}`) are not available here: declare client tools \
                     with `name`, `description` and `input_schema`"
                )))
            }
        }
        super::only(
            t,
            &[
                "type",
                "name",
                "description",
                "input_schema",
                "cache_control",
            ],
            &at,
        )?;
        if !t
            .get("name")
            .and_then(Value::as_str)
            .is_some_and(valid_name)
        {
            return Err(invalid(format!(
                "{at}: `name` must be 1 to {MAX_NAME} letters, digits, `_` or `-`"
            )));
        }
        if !matches!(
            t.get("description"),
            None | Some(Value::Null | Value::String(_))
        ) {
            return Err(invalid(format!("{at}: `description` must be a string")));
        }
        let schema = t
            .get("input_schema")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid(format!("{at}: `input_schema` must be a JSON schema object")))?;
        if schema.get("type").and_then(Value::as_str) != Some("object") {
            return Err(invalid(format!(
                "{at}: `input_schema` must describe an object (`\"type\": \"object\"`)"
            )));
        }
        // `{name, description, input_schema}`: the engine's tool, as the other APIs read it.
        out.push(tool_from(
            &Value::Object(t.clone()),
            "input_schema",
            i,
            "tools",
        )?);
    }
    let (choice, parallel) = tool_choice(choice)?;
    // What every API checks (names declared once, a named tool among them, ...).
    check(&out, &choice, "tools")?;
    if out.is_empty() {
        return Ok(None);
    }
    Ok(Some(ToolRequest {
        tools: out,
        choice,
        parallel,
    }))
}

/// `tool_choice`: `{type: auto|any|tool|none, name (tool), disable_parallel_tool_use}`.
fn tool_choice(v: Option<&Value>) -> Result<(ToolChoice, bool), ApiError> {
    let wrong = || {
        invalid(
            "`tool_choice` must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \
             \"tool\", \"name\": …} or {\"type\": \"none\"}",
        )
    };
    let Some(v) = v else {
        return Ok((ToolChoice::Auto, false));
    };
    let c: &Map<String, Value> = v.as_object().ok_or_else(wrong)?;
    super::only(
        c,
        &["type", "name", "disable_parallel_tool_use"],
        "tool_choice",
    )?;
    // Several calls only when asked for (see the module).
    let parallel = match c.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(d)) => !d,
        Some(_) => {
            return Err(invalid(
                "`tool_choice.disable_parallel_tool_use` must be true or false",
            ))
        }
    };
    let choice = match c.get("type").and_then(Value::as_str) {
        Some("auto") => ToolChoice::Auto,
        Some("any") => ToolChoice::Required,
        Some("none") => ToolChoice::None,
        Some("tool") => {
            let name = c.get("name").and_then(Value::as_str).ok_or_else(wrong)?;
            ToolChoice::Named(name.to_string())
        }
        _ => return Err(wrong()),
    };
    Ok((choice, parallel))
}

/// What a failed tool said, for the model (Anthropic's `is_error` has no place in a template).
fn result_text(content: &str, is_error: bool) -> String {
    if is_error {
        format!("Error: {content}")
    } else {
        content.to_string()
    }
}

/// Whether any turn holds a `tool_use` or `tool_result` block.
pub(crate) fn has_tool_blocks(turns: &[super::Turn]) -> bool {
    use super::Block;
    turns.iter().any(|t| {
        t.blocks
            .iter()
            .any(|b| matches!(b, Block::ToolUse { .. } | Block::ToolResult { .. }))
    })
}

/// The turns as template messages: an assistant turn's `tool_use` blocks become its
/// `tool_calls` (its text blocks its content), a user turn's `tool_result` blocks become
/// `tool` messages (in order, before the turn's text) answering `tool_call_id` and named
/// after the call's function. A result for a call the history does not have is a 400.
pub(crate) fn tool_history(turns: &[super::Turn]) -> Result<Vec<Message>, ApiError> {
    use super::Block;
    let mut out: Vec<Message> = Vec::new();
    let mut calls: Vec<(String, String)> = Vec::new(); // (id, name) seen so far
    for t in turns {
        let mut texts = Vec::new();
        let mut turn_calls = Vec::new();
        for b in &t.blocks {
            match b {
                Block::Text(s) => texts.push(s.as_str()),
                Block::ToolUse { id, name, input } => {
                    calls.push((id.clone(), name.clone()));
                    turn_calls.push(ToolCall {
                        id: id.clone(),
                        name: name.clone(),
                        arguments: input.clone(),
                    });
                }
                Block::ToolResult {
                    tool_use_id,
                    content,
                    is_error,
                } => {
                    let name = calls
                        .iter()
                        .find(|(id, _)| id == tool_use_id)
                        .map(|(_, n)| n.clone())
                        .ok_or_else(|| {
                            invalid(format!(
                                "a `tool_result` answers `{tool_use_id}`, which no earlier \
                                 `tool_use` block has"
                            ))
                        })?;
                    out.push(Message {
                        tool_call_id: Some(tool_use_id.clone()),
                        name: Some(name),
                        ..Message::new("tool", result_text(content, *is_error))
                    });
                }
            }
        }
        if texts.is_empty() && turn_calls.is_empty() && !t.assistant {
            continue; // a user turn of tool results only
        }
        out.push(Message {
            tool_calls: turn_calls,
            ..Message::new(
                if t.assistant { "assistant" } else { "user" },
                texts.join("\n"),
            )
        });
    }
    Ok(out)
}

/// A call id in Anthropic's style: our `call_X…` ids become `toolu_X…` (the same random
/// tail); anything else gets a fresh one.
pub(crate) fn tool_use_id(id: &str) -> String {
    match id.strip_prefix("call_") {
        Some(tail) if !tail.is_empty() => format!("toolu_{tail}"),
        _ => tool_use_id(&crate::text::tools::new_call_id()),
    }
}

/// A call the model made, with an Anthropic-style id.
pub(crate) fn anthropic_call(call: ToolCall) -> ToolCall {
    ToolCall {
        id: tool_use_id(&call.id),
        ..call
    }
}

/// A `tool_use` block of a call.
pub(crate) fn tool_use_block(call: &ToolCall) -> Value {
    json!({"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments})
}

/// The content of an answer with calls: its text (when any) then a `tool_use` block a call;
/// and whether it ends for tool use (`stop_reason` `tool_use`).
pub(crate) fn tool_reply(text: &str, calls: &[ToolCall]) -> (Value, bool) {
    let mut content = Vec::new();
    if !text.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    content.extend(calls.iter().map(tool_use_block));
    (Value::Array(content), !calls.is_empty())
}
