//! Grammars that force a well-formed call: Lark for llguidance, the arguments of each
//! function an inline `%json` schema.

use super::{Tool, ToolChoice, ToolFormat};
use serde_json::{json, Map, Value};
use std::fmt::Write as _;

/// JSON written inside a forced call: no free blanks (a small model must not wander into
/// endless whitespace), Python's separators (what the templates showed the model).
fn compact() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// `text` as a Lark string literal (Lark strings are JSON strings).
fn lit(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_else(|_| "\"\"".to_string())
}

/// `text` matched literally in a Lark regular expression.
fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(2 * text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~/".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A function name we can put in a grammar and a harmony header: OpenAI's rule (letters,
/// digits, `_`, `-`, at most 64) plus `.`.
fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "function name {name:?} must be 1 to 64 letters, digits, '_', '-' or '.'"
        ))
    }
}

/// The schema the arguments of `tool` must match, as a `%json` body: its `parameters`, an
/// object schema (`type` is added when missing), written compactly.
fn args_schema(tool: &Tool) -> Result<String, String> {
    let mut schema = match &tool.parameters {
        Value::Object(m) => m.clone(),
        Value::Null | Value::Bool(true) => Map::new(),
        _ => {
            return Err(format!(
                "parameters of function {} must be a JSON schema object",
                tool.name
            ))
        }
    };
    let is_object = match schema.get("type") {
        None => true,
        Some(Value::String(t)) => t == "object",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "object"),
        Some(_) => false,
    };
    if !is_object {
        return Err(format!(
            "parameters of function {} must describe an object (\"type\": \"object\")",
            tool.name
        ));
    }
    schema.insert("type".into(), json!("object"));
    schema.insert("x-guidance".into(), compact());
    serde_json::to_string(&Value::Object(schema)).map_err(|e| e.to_string())
}

/// The functions a call may name under `choice`.
fn chosen<'a>(tools: &'a [Tool], choice: &ToolChoice) -> Result<Vec<&'a Tool>, String> {
    let chosen: Vec<&Tool> = match choice {
        ToolChoice::None => return Err("tool_choice none forces no call".into()),
        ToolChoice::Named(n) => vec![tools
            .iter()
            .find(|t| t.name == *n)
            .ok_or_else(|| format!("tool_choice names function {n:?}, which is not in tools"))?],
        ToolChoice::Auto | ToolChoice::Required => tools.iter().collect(),
    };
    if chosen.is_empty() {
        return Err("no tools to call".into());
    }
    Ok(chosen)
}

/// A Lark grammar (llguidance's dialect) whose every sentence is a well-formed call in
/// `format`: the name one of the chosen functions (all of `tools`, or the one
/// [`ToolChoice::Named`] names), the arguments valid under that function's `parameters`
/// schema (one alternative per function). One call, or with `parallel` one or more (harmony
/// makes one call per reply, so `parallel` changes nothing there).
///
/// With [`ToolChoice::Auto`] the reply may instead be text: any text without the format's
/// call marker, then optionally the calls (Hermes, Mistral, Gemma); text not starting with
/// `{` nor holding `<|python_tag|>`, or the calls (Llama 3); a final-channel message or the
/// call, after optional reasoning (harmony). So a call, if the model makes one, is well
/// formed. [`ToolChoice::None`] is an error: decode without a grammar.
///
/// The grammar ends where the call does: the end of turn (`<|im_end|>`, harmony's `<|call|>`)
/// is the stop token the caller allows once the grammar accepts. Markers are plain text except
/// harmony's, which are special tokens (`<|channel|>`, `<|constrain|>`, `<|message|>`,
/// `<|end|>`, `<|start|>`), so the harmony grammar compiles only against a vocabulary that has
/// them. Mistral's `[TOOL_CALLS]` is written as text; in a vocabulary where it is a special
/// token, replace the literal `"[TOOL_CALLS]"` with `<[ID]>` (its token id).
///
/// Errors (a message for a 400): no tools, `none`, a named function not among the tools, a
/// name unfit for the syntax, parameters that do not describe an object. Schemas llguidance
/// cannot compile fail when the grammar is compiled.
pub fn call_grammar(
    format: ToolFormat,
    tools: &[Tool],
    choice: &ToolChoice,
    parallel: bool,
) -> Result<String, String> {
    let chosen = chosen(tools, choice)?;
    // The marker opening a call, the text after it, the arguments' key, the closing text,
    // the separator of parallel calls.
    let (marker, after, key, close, sep) = match format {
        ToolFormat::Hermes => ("<tool_call>", "\n", "arguments", "\n</tool_call>", "\n"),
        ToolFormat::Gemma => ("```tool_call", "\n", "arguments", "\n```", "\n"),
        ToolFormat::Llama3 => ("", "", "parameters", "", "\n"),
        ToolFormat::Mistral => ("", "", "arguments", "", ", "),
        ToolFormat::Harmony => ("", "", "", "", ""),
    };
    let mut g = String::new();
    let more = if parallel && format != ToolFormat::Harmony {
        format!("({} call)*", lit(sep))
    } else {
        String::new()
    };
    let calls = match format {
        ToolFormat::Mistral => format!("\"[TOOL_CALLS][\" call {more} \"]\""),
        ToolFormat::Harmony => "analysis? call".to_string(),
        _ => format!("call {more}"),
    };
    // Text before a call ends at the call's marker: a lexeme that stops there (a plain
    // regular expression would run on through the marker and fail).
    let lead = |marker: &str| format!("lead[stop={}]: /(.|\\n)*/", lit(marker));
    let _ = match (format, *choice == ToolChoice::Auto) {
        (_, false) => writeln!(g, "start: {calls}"),
        (ToolFormat::Harmony, true) => writeln!(
            g,
            "start: analysis? (final | call)\n\
             final: <|channel|> \"final\" <|message|> ANALYSIS"
        ),
        // Llama 3 writes a call as the whole reply: text is anything else.
        (ToolFormat::Llama3, true) => writeln!(
            g,
            "start: TEXT | {calls}\n\
             TEXT: /(.|\\n)*/ & ~/\\s*\\{{(.|\\n)*/ & ~/(.|\\n)*<\\|python_tag\\|>(.|\\n)*/"
        ),
        (ToolFormat::Mistral, true) => writeln!(
            g,
            "start: TEXT | lead \"[\" call {more} \"]\"\n{}\n\
             TEXT: /(.|\\n)*/ & ~/(.|\\n)*\\[TOOL_CALLS\\](.|\\n)*/",
            lead("[TOOL_CALLS]")
        ),
        (_, true) => writeln!(
            g,
            "start: TEXT | lead body {more}\n{}\n\
             TEXT: /(.|\\n)*/ & ~/(.|\\n)*{}(.|\\n)*/\n\
             body: {}",
            lead(marker),
            regex_escape(marker),
            (0..chosen.len())
                .map(|i| format!("body_{i}"))
                .collect::<Vec<_>>()
                .join(" | ")
        ),
    };
    if format == ToolFormat::Harmony {
        let _ = writeln!(
            g,
            "analysis: <|channel|> \"analysis\" <|message|> ANALYSIS <|end|> <|start|> \"assistant\"\n\
             ANALYSIS: /(.|\\n)*/"
        );
    }
    let alternatives: Vec<String> = (0..chosen.len()).map(|i| format!("call_{i}")).collect();
    let _ = writeln!(g, "call: {}", alternatives.join(" | "));
    for (i, tool) in chosen.iter().enumerate() {
        check_name(&tool.name)?;
        let schema = args_schema(tool)?;
        let _ = if format == ToolFormat::Harmony {
            writeln!(
                g,
                "call_{i}: <|channel|> {} <|constrain|> \"json\" <|message|> %json {schema}",
                lit(&format!("commentary to=functions.{} ", tool.name))
            )
        } else {
            let head = format!("{after}{{\"name\": {}, \"{key}\": ", lit(&tool.name));
            let call = match marker {
                "" => format!("call_{i}: body_{i}"),
                m => format!("call_{i}: {} body_{i}", lit(m)),
            };
            writeln!(
                g,
                "{call}\nbody_{i}: {} %json {schema} {}",
                lit(&head),
                lit(&format!("}}{close}"))
            )
        };
    }
    Ok(g)
}
