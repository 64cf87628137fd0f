//! Tool calling: the table of tool-call formats, one [`ToolFormat`] per family of chat
//! templates, and for each format how tools are described in the prompt ([`prepare`]), the
//! grammar that forces a well-formed call ([`call_grammar`]), and how calls are read back out
//! of the model's reply, whole ([`parse`]) or as it streams ([`ToolStream`]).
//!
//! A new architecture adds a variant to [`ToolFormat`] and a row to each `match` on it: its
//! markers ([`ToolFormat::detect`]), its call syntax ([`format_calls`], `grammar.rs`) and its
//! span scanner (`scan.rs`). Nothing here touches a tokenizer: markers are text, as the
//! reply's decoded text shows them.

mod grammar;
mod json;
mod parse;
mod prompt;
mod scan;
mod stream;

#[cfg(test)]
mod tests;

pub use grammar::call_grammar;
pub use parse::{parse, Parsed};
pub use prompt::{format_calls, openai_tools, prepare, template_handles_tools};
pub use stream::{StreamItem, ToolStream};

use rand::Rng as _;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::{json, Value};

/// A function the model may call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON schema of the arguments object; `{"type": "object"}` when absent.
    #[serde(default = "object_schema")]
    pub parameters: Value,
}

fn object_schema() -> Value {
    json!({"type": "object"})
}

/// A call the model made: `arguments` is always a JSON object.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: Value,
}

impl ToolCall {
    /// A call of `name` with a fresh id.
    pub fn new(name: impl Into<String>, arguments: Value) -> ToolCall {
        ToolCall {
            id: new_call_id(),
            name: name.into(),
            arguments,
        }
    }
}

/// Which calls the model may or must make (OpenAI's `tool_choice`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// Text or calls, as the model likes.
    #[default]
    Auto,
    /// No call now: text only.
    None,
    /// At least one call of a declared function.
    Required,
    /// A call of this function.
    Named(String),
}

/// `call_` and 24 random letters and digits, as OpenAI's call ids look.
pub fn new_call_id() -> String {
    let tail: String = rand::rng()
        .sample_iter(rand::distr::Alphanumeric)
        .take(24)
        .map(char::from)
        .collect();
    format!("call_{tail}")
}

/// A message's calls as Hugging Face chat templates read them:
/// `[{"id", "type": "function", "function": {"name", "arguments": <object>}}]`.
pub fn serialize_calls_for_template<S: Serializer>(
    calls: &[ToolCall],
    s: S,
) -> Result<S::Ok, S::Error> {
    let v: Vec<Value> = calls
        .iter()
        .map(|c| {
            json!({
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            })
        })
        .collect();
    v.serialize(s)
}

/// The tool-call syntax of a family of models (see each variant); the table each
/// architecture adds to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ToolFormat {
    /// Hermes / Qwen 2.5 / Qwen 3 / SmolLM (ChatML): `<tool_call>\n{"name": …, "arguments":
    /// {…}}\n</tool_call>`, one block per call; results come back as
    /// `<tool_response>\n…\n</tool_response>`.
    Hermes,
    /// Llama 3.1+: a bare `{"name": …, "parameters": {…}}`, optionally after
    /// `<|python_tag|>`; results in messages of role `ipython`.
    Llama3,
    /// Mistral: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`, and the newer
    /// `[TOOL_CALLS]name[ARGS]{…}` (one per call); results as
    /// `[TOOL_RESULTS]…[/TOOL_RESULTS]`.
    Mistral,
    /// gpt-oss harmony: a message `<|channel|>commentary to=functions.NAME
    /// <|constrain|>json<|message|>{…}<|call|>`; results come back as messages from
    /// `functions.NAME`. One call per reply (`<|call|>` ends the generation).
    Harmony,
    /// Gemma 2/3 have no native tool syntax (Google documents prompt-based calling with
    /// fenced blocks), so we use the same idea: a fenced block
    /// ```` ```tool_call\n{"name": …, "arguments": {…}}\n``` ````, and results as
    /// ```` ```tool_output\n…\n``` ````. A fence is what these models already write well.
    Gemma,
}

impl ToolFormat {
    /// Every format, for tests and listings.
    pub const ALL: [ToolFormat; 5] = [
        ToolFormat::Hermes,
        ToolFormat::Llama3,
        ToolFormat::Mistral,
        ToolFormat::Harmony,
        ToolFormat::Gemma,
    ];

    /// The format of a model: by markers in its chat template first, then by its GGUF
    /// architecture name (`general.architecture`), Hermes when nothing tells.
    pub fn detect(template_source: Option<&str>, arch: &str) -> ToolFormat {
        if let Some(src) = template_source {
            /// Template markers, first match wins: a tool syntax beats a turn syntax.
            const MARKERS: &[(&str, ToolFormat)] = &[
                ("<|channel|>", ToolFormat::Harmony),
                ("to=functions", ToolFormat::Harmony),
                ("<tool_call>", ToolFormat::Hermes),
                ("[TOOL_CALLS]", ToolFormat::Mistral),
                ("<|python_tag|>", ToolFormat::Llama3),
                ("ipython", ToolFormat::Llama3),
                ("<|im_start|>", ToolFormat::Hermes),
                ("<|start_header_id|>", ToolFormat::Llama3),
                ("<start_of_turn>", ToolFormat::Gemma),
                ("[INST]", ToolFormat::Mistral),
            ];
            if let Some((_, f)) = MARKERS.iter().find(|(m, _)| src.contains(m)) {
                return *f;
            }
        }
        match arch {
            a if a.starts_with("gemma") => ToolFormat::Gemma,
            "gpt-oss" => ToolFormat::Harmony,
            "mistral" | "mistral3" => ToolFormat::Mistral,
            "llama" => ToolFormat::Llama3,
            _ => ToolFormat::Hermes,
        }
    }

    /// The format's name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3 => "llama3",
            ToolFormat::Mistral => "mistral",
            ToolFormat::Harmony => "harmony",
            ToolFormat::Gemma => "gemma",
        }
    }
}
