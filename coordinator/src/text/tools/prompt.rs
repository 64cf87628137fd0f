//! Tools into the prompt: passed to a chat template that renders them itself, or described
//! in a system prompt we write, with the conversation's earlier calls and results rewritten
//! into the format's text, for templates that know nothing of tools (SmolLM2's ChatML).

use super::json::py_json;
use super::{Tool, ToolCall, ToolChoice, ToolFormat};
use crate::text::template::Message;
use serde_json::{json, Value};
use std::collections::HashMap;

/// `tools` as Hugging Face templates read them (OpenAI's shape):
/// `[{"type": "function", "function": {"name", "description", "parameters"}}]`, the
/// description left out when there is none.
pub fn openai_tools(tools: &[Tool]) -> Value {
    Value::Array(
        tools
            .iter()
            .map(|t| json!({"type": "function", "function": t}))
            .collect(),
    )
}

/// `{"name": NAME, KEY: ARGS}` with the name first, as the templates write calls.
fn call_json(name: &str, key: &str, args: &Value) -> String {
    format!(
        "{{\"name\": {}, \"{key}\": {}}}",
        py_json(&Value::String(name.to_string())),
        py_json(args)
    )
}

/// `calls` written in `format`'s syntax, as the model would write them.
pub fn format_calls(format: ToolFormat, calls: &[ToolCall]) -> String {
    let each = |f: &dyn Fn(&ToolCall) -> String, sep: &str| {
        calls.iter().map(f).collect::<Vec<_>>().join(sep)
    };
    match format {
        ToolFormat::Hermes => each(
            &|c| {
                format!(
                    "<tool_call>\n{}\n</tool_call>",
                    call_json(&c.name, "arguments", &c.arguments)
                )
            },
            "\n",
        ),
        ToolFormat::Llama3 => each(&|c| call_json(&c.name, "parameters", &c.arguments), "\n"),
        ToolFormat::Mistral => format!(
            "[TOOL_CALLS][{}]",
            each(&|c| call_json(&c.name, "arguments", &c.arguments), ", ")
        ),
        ToolFormat::Harmony => each(
            &|c| {
                format!(
                    "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>",
                    c.name,
                    py_json(&c.arguments)
                )
            },
            "<|start|>assistant",
        ),
        ToolFormat::Gemma => each(
            &|c| {
                format!(
                    "```tool_call\n{}\n```",
                    call_json(&c.name, "arguments", &c.arguments)
                )
            },
            "\n",
        ),
    }
}

/// How to call, in `format`, for the system prompt we write.
fn how_to_call(format: ToolFormat) -> &'static str {
    match format {
        ToolFormat::Hermes => {
            "To call a function, write a JSON object with its name and arguments between \
             <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function name>, \
             \"arguments\": <arguments as a JSON object>}\n</tool_call>\nWrite one such block \
             per call. Results come back between <tool_response></tool_response> tags."
        }
        ToolFormat::Llama3 => {
            "To call a function, answer with nothing but a JSON object of the form \
             {\"name\": <function name>, \"parameters\": <arguments as a JSON object>}. \
             Results come back in messages from ipython."
        }
        ToolFormat::Mistral => {
            "To call functions, answer with [TOOL_CALLS] and a JSON list of calls: \
             [TOOL_CALLS][{\"name\": <function name>, \"arguments\": <arguments as a JSON \
             object>}]. Results come back between [TOOL_RESULTS][/TOOL_RESULTS]."
        }
        ToolFormat::Harmony => {
            "To call a function, send a message in the commentary channel addressed to it: \
             <|channel|>commentary to=functions.<function name> <|constrain|>json<|message|>\
             <arguments as a JSON object><|call|>"
        }
        ToolFormat::Gemma => {
            "To call a function, write a JSON object with its name and arguments in a fenced \
             block:\n```tool_call\n{\"name\": <function name>, \"arguments\": <arguments as a \
             JSON object>}\n```\nWrite one such block per call. Results come back in \
             ```tool_output``` blocks."
        }
    }
}

/// The system prompt describing `tools` and how to call them in `format`.
fn tools_prompt(format: ToolFormat, tools: &[Tool], choice: &ToolChoice) -> String {
    let mut s = String::from(
        "You can call functions to help with the user's request. The functions, with the \
         JSON schema of each one's arguments:\n<tools>\n",
    );
    for t in tools {
        s.push_str(&py_json(&json!(t)));
        s.push('\n');
    }
    s.push_str("</tools>\n\n");
    s.push_str(how_to_call(format));
    s.push_str("\n\n");
    s.push_str(&match choice {
        ToolChoice::Required => "Call at least one of the functions now.".to_string(),
        ToolChoice::Named(n) => format!("Call the function {n} now."),
        ToolChoice::Auto | ToolChoice::None => {
            "Call a function only when it helps; otherwise answer in plain text.".to_string()
        }
    });
    s
}

/// How `format` brings a tool's result back, in a template without tools: the message's
/// role and its text (`name`: the function's name when known).
fn result_message(format: ToolFormat, content: &str, name: Option<&str>) -> (&'static str, String) {
    match format {
        ToolFormat::Hermes => (
            "user",
            format!("<tool_response>\n{content}\n</tool_response>"),
        ),
        ToolFormat::Gemma => ("user", format!("```tool_output\n{content}\n```")),
        ToolFormat::Mistral => ("user", format!("[TOOL_RESULTS]{content}[/TOOL_RESULTS]")),
        ToolFormat::Llama3 => ("ipython", content.to_string()),
        ToolFormat::Harmony => (
            "user",
            format!(
                "Result of functions.{}:\n{content}",
                name.unwrap_or("unknown")
            ),
        ),
    }
}

/// Whether a chat template reads the `tools` variable: the word `tools` in a Jinja tag or
/// expression, outside string literals (a message like "this template has no tools" does
/// not count).
pub fn template_handles_tools(source: &str) -> bool {
    let mut rest = source;
    while let Some(open) = rest.find('{') {
        let after = &rest[open..];
        let close = if after.starts_with("{%") {
            "%}"
        } else if after.starts_with("{{") {
            "}}"
        } else {
            rest = &rest[open + 1..];
            continue;
        };
        let Some(end) = after[2..].find(close) else {
            return false;
        };
        if code_mentions(&after[2..2 + end], "tools") {
            return true;
        }
        rest = &after[2 + end + close.len()..];
    }
    false
}

/// Whether `word` is a whole word of Jinja `code`, outside its string literals.
fn code_mentions(code: &str, word: &str) -> bool {
    let mut quote: Option<char> = None;
    let mut escaped = false;
    let mut ident = String::new();
    for c in code.chars().chain(std::iter::once(' ')) {
        if let Some(q) = quote {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, c) if c == q => quote = None,
                _ => {}
            }
            continue;
        }
        if c.is_alphanumeric() || c == '_' {
            ident.push(c);
            continue;
        }
        if ident == word {
            return true;
        }
        ident.clear();
        if c == '\'' || c == '"' {
            quote = Some(c);
        }
    }
    false
}

/// The messages and the template's `tools` variable for a conversation with `tools`.
///
/// A template that handles tools itself ([`template_handles_tools`]) gets them as the
/// `tools` variable ([`openai_tools`]) and the messages unchanged: calls stay in
/// `tool_calls`, results in `tool` messages, as the template expects.
///
/// Any other template (SmolLM2's ChatML) gets a system prompt we write, listing the tools'
/// schemas and saying how to call them in `format` (merged after an existing first system
/// message), and a history in plain text: an assistant's calls written into its content in
/// `format`'s syntax ([`format_calls`]), `tool` results as the format brings them back
/// (Hermes: a `user` turn of `<tool_response>` blocks, consecutive results in one turn;
/// Gemma: ```` ```tool_output ```` blocks likewise; Mistral: `[TOOL_RESULTS]` in a `user`
/// turn; Llama 3: role `ipython`; harmony: a `user` turn naming the function).
///
/// With [`ToolChoice::None`] the tools are not described at all (no variable, no system
/// prompt): a small model shown tools calls them, and the caller said it must not now. The
/// history is still rewritten, so earlier calls and results read right.
pub fn prepare(
    format: ToolFormat,
    template_source: &str,
    messages: &[Message],
    tools: &[Tool],
    choice: &ToolChoice,
) -> (Vec<Message>, Option<Value>) {
    let describe = !tools.is_empty() && *choice != ToolChoice::None;
    if template_handles_tools(template_source) {
        return (messages.to_vec(), describe.then(|| openai_tools(tools)));
    }
    let mut names: HashMap<&str, &str> = HashMap::new();
    let mut out: Vec<Message> = Vec::with_capacity(messages.len() + 1);
    let mut last_was_result = false;
    for m in messages {
        if m.role == "tool" {
            let name = m.name.as_deref().or_else(|| {
                m.tool_call_id
                    .as_deref()
                    .and_then(|id| names.get(id).copied())
            });
            let (role, text) = result_message(format, &m.content, name);
            let merge = last_was_result && role == "user";
            match out.last_mut() {
                Some(prev) if merge => {
                    prev.content.push('\n');
                    prev.content.push_str(&text);
                }
                _ => out.push(Message::new(role, text)),
            }
            last_was_result = true;
            continue;
        }
        last_was_result = false;
        for c in &m.tool_calls {
            names.insert(&c.id, &c.name);
        }
        let mut plain = Message::new(m.role.clone(), m.content.clone());
        if !m.tool_calls.is_empty() {
            let calls = format_calls(format, &m.tool_calls);
            plain.content = match m.content.trim() {
                "" => calls,
                text => format!("{text}\n{calls}"),
            };
        }
        out.push(plain);
    }
    if describe {
        let prompt = tools_prompt(format, tools, choice);
        match out.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{prompt}", first.content.trim_end());
            }
            _ => out.insert(0, Message::new("system", prompt)),
        }
    }
    (out, None)
}
