//! Anthropic's tool use ⇄ the engine's tool types: `tools` and `tool_choice` of a request
//! ([`tool_request`]), `tool_use` and `tool_result` blocks of the history ([`tool_history`]),
//! and the calls of an answer as `tool_use` blocks ([`tool_reply`], and
//! [`super::Events::call`] for streams).
//!
//! Until branch `tools` (`crate::text::tools`: the formats, the prompt, the parser) lands, the
//! types below stand in for its `Tool`, `ToolCall` and `ToolChoice`, and requests with tools are
//! still refused (in `anthropic.rs`): this is the mapping, tested, waiting for its other half.

// REPLACE: these three types with `use crate::text::tools::{Tool, ToolCall, ToolChoice};` once
// branch `tools` is on main (same fields and variants).
#![cfg_attr(not(test), allow(dead_code))]

use crate::serve::http::ApiError;
use serde_json::{json, Map, Value};

/// A function the model may call (stands in for `crate::text::tools::Tool`).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// JSON schema of the arguments object.
    pub parameters: Value,
}

/// A call (stands in for `crate::text::tools::ToolCall`).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: Value,
}

/// Which calls the model may or must make (stands in for `crate::text::tools::ToolChoice`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum ToolChoice {
    #[default]
    Auto,
    None,
    Required,
    Named(String),
}

/// A request's tools.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ToolRequest {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// `false`: at most one call (`disable_parallel_tool_use`).
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
        let name = match t.get("name").and_then(Value::as_str) {
            Some(n) if valid_name(n) => n.to_string(),
            _ => {
                return Err(invalid(format!(
                    "{at}: `name` must be 1 to {MAX_NAME} letters, digits, `_` or `-`"
                )))
            }
        };
        if out.iter().any(|o| o.name == name) {
            return Err(invalid(format!(
                "{at}: the tool name `{name}` is declared twice"
            )));
        }
        let description = match t.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(d)) => Some(d.clone()),
            Some(_) => return Err(invalid(format!("{at}: `description` must be a string"))),
        };
        let schema = t
            .get("input_schema")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid(format!("{at}: `input_schema` must be a JSON schema object")))?;
        if schema.get("type").and_then(Value::as_str) != Some("object") {
            return Err(invalid(format!(
                "{at}: `input_schema` must describe an object (`\"type\": \"object\"`)"
            )));
        }
        out.push(Tool {
            name,
            description,
            parameters: Value::Object(schema.clone()),
        });
    }
    let (choice, parallel) = tool_choice(choice, &out)?;
    if out.is_empty() {
        return match choice {
            ToolChoice::Auto | ToolChoice::None => Ok(None),
            _ => Err(invalid("`tool_choice` `any` or `tool` needs `tools`")),
        };
    }
    Ok(Some(ToolRequest {
        tools: out,
        choice,
        parallel,
    }))
}

/// `tool_choice`: `{type: auto|any|tool|none, name (tool), disable_parallel_tool_use}`.
fn tool_choice(v: Option<&Value>, tools: &[Tool]) -> Result<(ToolChoice, bool), ApiError> {
    let wrong = || {
        invalid(
            "`tool_choice` must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \
             \"tool\", \"name\": …} or {\"type\": \"none\"}",
        )
    };
    let Some(v) = v else {
        return Ok((ToolChoice::Auto, true));
    };
    let c: &Map<String, Value> = v.as_object().ok_or_else(wrong)?;
    super::only(
        c,
        &["type", "name", "disable_parallel_tool_use"],
        "tool_choice",
    )?;
    let parallel = match c.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => true,
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
            if !tools.is_empty() && !tools.iter().any(|t| t.name == name) {
                return Err(invalid(format!(
                    "`tool_choice` names `{name}`, which is not in `tools`"
                )));
            }
            ToolChoice::Named(name.to_string())
        }
        _ => return Err(wrong()),
    };
    Ok((choice, parallel))
}

/// One message of a conversation with tools, for the template (stands in for the template
/// `Message` with `tool_calls`, `tool_call_id` and `name`).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ToolMessage {
    pub role: &'static str,
    pub content: String,
    /// An assistant turn's calls.
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` message: the call it answers, and that call's function.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

/// What a failed tool said, for the model (Anthropic's `is_error` has no place in a template).
fn result_text(content: &str, is_error: bool) -> String {
    if is_error {
        format!("Error: {content}")
    } else {
        content.to_string()
    }
}

/// The turns as messages with tools: an assistant turn's `tool_use` blocks become its calls
/// (its text blocks its content), a user turn's `tool_result` blocks become `tool` messages
/// (in order, before the turn's text), named after the call they answer. A result for a call
/// the history does not have is a 400.
pub(crate) fn tool_history(turns: &[super::Turn]) -> Result<Vec<ToolMessage>, ApiError> {
    use super::Block;
    let mut out: Vec<ToolMessage> = Vec::new();
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
                    out.push(ToolMessage {
                        role: "tool",
                        content: result_text(content, *is_error),
                        tool_calls: Vec::new(),
                        tool_call_id: Some(tool_use_id.clone()),
                        name: Some(name),
                    });
                }
            }
        }
        if texts.is_empty() && turn_calls.is_empty() && !t.assistant {
            continue; // a user turn of tool results only
        }
        out.push(ToolMessage {
            role: if t.assistant { "assistant" } else { "user" },
            content: texts.join("\n"),
            tool_calls: turn_calls,
            tool_call_id: None,
            name: None,
        });
    }
    Ok(out)
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
