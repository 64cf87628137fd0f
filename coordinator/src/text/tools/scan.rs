//! Finding calls in a reply's text, per format: where one may start ([`find_start`]), where
//! it ends ([`scan_call`]) and what it says ([`read_span`]).
//!
//! Every decision depends only on the text seen so far and never changes when more text comes
//! (a call's end is where its JSON closes, not where a closing tag is first seen, since a tag
//! may be inside a JSON string), so cutting the reply into chunks anywhere gives the same
//! calls as reading it whole. The streaming parser holds a call's text until its end is known.

use super::json::{call_from_value, json_end};
use super::ToolFormat;
use serde_json::{json, Value};

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const GEMMA_OPEN: &str = "```tool_call";
const GEMMA_CLOSE: &str = "```";
const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
const MISTRAL_CALL_ID: &str = "[CALL_ID]";
const PYTHON_TAG: &str = "<|python_tag|>";
const HARMONY_START: &str = "<|start|>";
const HARMONY_CHANNEL: &str = "<|channel|>";
const HARMONY_MESSAGE: &str = "<|message|>";
const HARMONY_CALL: &str = "<|call|>";
const HARMONY_END: &str = "<|end|>";
const HARMONY_RECIPIENT: &str = "to=functions.";

/// Texts that open a call (or, for harmony, a message header that may address a function).
fn markers(format: ToolFormat) -> &'static [&'static str] {
    match format {
        ToolFormat::Hermes => &[HERMES_OPEN],
        ToolFormat::Gemma => &[GEMMA_OPEN],
        ToolFormat::Mistral => &[MISTRAL_CALLS],
        ToolFormat::Llama3 => &[PYTHON_TAG],
        ToolFormat::Harmony => &[HARMONY_START, HARMONY_CHANNEL],
    }
}

/// Where a call may start in a text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// A call (or a harmony header) starts at this byte.
    At(usize),
    /// The text from this byte to its end may be the start of a marker.
    Maybe(usize),
    /// No call starts in this text, nor at its end.
    None,
}

/// The first place in `text` where a call may start. `bare_json`: a JSON object at the
/// text's start (after blanks) is a call too (Llama 3 writes calls as the whole reply).
pub fn find_start(format: ToolFormat, text: &str, bare_json: bool) -> Start {
    if format == ToolFormat::Llama3 && bare_json {
        let at = blank_len(text);
        if text[at..].starts_with('{') {
            return Start::At(at);
        }
    }
    let full = markers(format).iter().filter_map(|m| text.find(m)).min();
    if let Some(at) = full {
        return Start::At(at);
    }
    let longest = markers(format).iter().map(|m| m.len()).max().unwrap_or(0);
    let from = text.len().saturating_sub(longest.saturating_sub(1));
    (from..text.len())
        .filter(|&i| text.is_char_boundary(i))
        .find(|&i| markers(format).iter().any(|m| m.starts_with(&text[i..])))
        .map_or(Start::None, Start::Maybe)
}

/// Where a call that starts a text ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scan {
    /// Its end is not in the text yet.
    Incomplete,
    /// It ends at this byte.
    Complete(usize),
}

fn blank_len(s: &str) -> usize {
    s.len() - s.trim_start().len()
}

/// The end of the JSON starting at `at` (after blanks) in `text`; `Err(Incomplete)` when the
/// text ends first, `Ok(None)` when no JSON starts there.
fn json_at(text: &str, at: usize) -> Result<Option<usize>, Scan> {
    let at = at + blank_len(&text[at..]);
    let rest = &text[at..];
    if rest.is_empty() {
        return Err(Scan::Incomplete);
    }
    if !rest.starts_with(['{', '[']) {
        return Ok(None);
    }
    json_end(rest).map(|e| Some(at + e)).ok_or(Scan::Incomplete)
}

/// After a call's JSON ending at `after`: the end of the optional closing text (one of
/// `closes`, blanks before it allowed); the call ends with its JSON when something else
/// follows.
fn close_after(text: &str, after: usize, closes: &[&str]) -> Scan {
    let at = after + blank_len(&text[after..]);
    let tail = &text[at..];
    if let Some(c) = closes.iter().find(|c| tail.starts_with(*c)) {
        return Scan::Complete(at + c.len());
    }
    if closes.iter().any(|c| c.starts_with(tail)) {
        return Scan::Incomplete;
    }
    Scan::Complete(after)
}

/// The end of the first of `closes` in `text` from `from`.
fn first_close(text: &str, from: usize, closes: &[&str]) -> Scan {
    closes
        .iter()
        .filter_map(|c| text[from..].find(c).map(|i| from + i + c.len()))
        .min()
        .map_or(Scan::Incomplete, Scan::Complete)
}

/// A block `open JSON close`: ends after its close, or with its JSON when no close follows;
/// a block whose body is not JSON ends at its first close.
fn scan_tagged(text: &str, open: &str, close: &str) -> Scan {
    match json_at(text, open.len()) {
        Err(s) => s,
        Ok(Some(after)) => close_after(text, after, &[close]),
        Ok(None) => first_close(text, open.len(), &[close]),
    }
}

/// Where the call that starts `text` ends (`text` starts where [`find_start`] said).
pub fn scan_call(format: ToolFormat, text: &str) -> Scan {
    match format {
        ToolFormat::Hermes => scan_tagged(text, HERMES_OPEN, HERMES_CLOSE),
        ToolFormat::Gemma => scan_tagged(text, GEMMA_OPEN, GEMMA_CLOSE),
        ToolFormat::Llama3 => {
            let at = if text.starts_with(PYTHON_TAG) {
                PYTHON_TAG.len()
            } else {
                0
            };
            match json_at(text, at) {
                Err(s) => s,
                Ok(Some(end)) => Scan::Complete(end),
                // Built-in tools' Python syntax (`brave_search.call(...)`): to the line's end.
                Ok(None) => first_close(text, at, &["\n"]),
            }
        }
        ToolFormat::Mistral => scan_mistral(text),
        ToolFormat::Harmony => scan_harmony(text),
    }
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')
}

/// `[TOOL_CALLS][…]` or `[TOOL_CALLS]name[CALL_ID]id[ARGS]{…}` (the id optional). Anything
/// else ends the span where it stops looking like a call.
fn scan_mistral(text: &str) -> Scan {
    let at = MISTRAL_CALLS.len();
    match json_at(text, at) {
        Err(s) => return s,
        Ok(Some(end)) => return Scan::Complete(end),
        Ok(None) => {}
    }
    let at = at + blank_len(&text[at..]);
    let name_end = at
        + text[at..]
            .find(|c: char| !is_name_char(c))
            .unwrap_or(text.len() - at);
    let mut at = name_end;
    if text[at..].starts_with(MISTRAL_CALL_ID) {
        at += MISTRAL_CALL_ID.len();
        at += text[at..]
            .find(|c: char| !c.is_ascii_alphanumeric())
            .unwrap_or(text.len() - at);
    }
    let rest = &text[at..];
    if rest.starts_with(MISTRAL_ARGS) {
        return match json_at(text, at + MISTRAL_ARGS.len()) {
            Err(s) => s,
            Ok(Some(end)) => Scan::Complete(end),
            Ok(None) => Scan::Complete(at + MISTRAL_ARGS.len()),
        };
    }
    if MISTRAL_ARGS.starts_with(rest) || MISTRAL_CALL_ID.starts_with(rest) {
        return Scan::Incomplete;
    }
    Scan::Complete(at.max(MISTRAL_CALLS.len()))
}

/// A harmony message header from `<|start|>` or `<|channel|>` to `<|message|>`: a call when it
/// names a recipient `functions.NAME`, then ending after its JSON body and `<|call|>`;
/// otherwise just the header, which stays text.
fn scan_harmony(text: &str) -> Scan {
    let Some(m) = text.find(HARMONY_MESSAGE) else {
        return Scan::Incomplete;
    };
    let body = m + HARMONY_MESSAGE.len();
    if !text[..m].contains(HARMONY_RECIPIENT) {
        return Scan::Complete(body);
    }
    let closes = [HARMONY_CALL, HARMONY_END];
    match json_at(text, body) {
        Err(s) => s,
        Ok(Some(after)) => close_after(text, after, &closes),
        Ok(None) => first_close(text, body, &closes),
    }
}

/// What a span holds.
#[derive(Clone, Debug, PartialEq)]
pub enum Span {
    /// Calls (name, arguments object), in order.
    Calls(Vec<(String, Value)>),
    /// Looked like a call but is not a valid one: kept as text, reported.
    Invalid,
    /// Not a call after all (a harmony header to no function, a Llama 3 reply that is JSON
    /// but no call): text.
    Text,
}

/// Calls from a JSON value: one call object, or an array of them.
fn calls_from(v: &Value) -> Span {
    let items: Vec<&Value> = match v {
        Value::Array(a) if !a.is_empty() => a.iter().collect(),
        v => vec![v],
    };
    items
        .into_iter()
        .map(call_from_value)
        .collect::<Option<Vec<_>>>()
        .map_or(Span::Invalid, Span::Calls)
}

/// The JSON value right after `at` (blanks skipped) in `text`.
fn json_value(text: &str, at: usize) -> Option<Value> {
    let rest = text[at..].trim_start();
    let end = json_end(rest)?;
    serde_json::from_str(&rest[..end]).ok()
}

/// What the span `text` (as [`scan_call`] delimited it, or the unterminated rest of a reply)
/// holds.
pub fn read_span(format: ToolFormat, text: &str) -> Span {
    match format {
        ToolFormat::Hermes => read_tagged(text, HERMES_OPEN),
        ToolFormat::Gemma => read_tagged(text, GEMMA_OPEN),
        ToolFormat::Llama3 => match text.strip_prefix(PYTHON_TAG) {
            Some(rest) => json_value(rest, 0).map_or(Span::Invalid, |v| calls_from(&v)),
            None => match json_value(text, 0).map(|v| calls_from(&v)) {
                Some(Span::Calls(c)) => Span::Calls(c),
                _ => Span::Text,
            },
        },
        ToolFormat::Mistral => read_mistral(text),
        ToolFormat::Harmony => read_harmony(text),
    }
}

fn read_tagged(text: &str, open: &str) -> Span {
    let body = text.get(open.len()..).unwrap_or("");
    json_value(body, 0).map_or(Span::Invalid, |v| calls_from(&v))
}

fn read_mistral(text: &str) -> Span {
    let rest = text.get(MISTRAL_CALLS.len()..).unwrap_or("").trim_start();
    if rest.starts_with(['[', '{']) {
        return json_value(rest, 0).map_or(Span::Invalid, |v| calls_from(&v));
    }
    let name_end = rest.find(|c: char| !is_name_char(c)).unwrap_or(rest.len());
    let Some(args_at) = rest.find(MISTRAL_ARGS) else {
        return Span::Invalid;
    };
    match json_value(rest, args_at + MISTRAL_ARGS.len()) {
        Some(args) => calls_from(&json!({"name": &rest[..name_end], "arguments": args})),
        None => Span::Invalid,
    }
}

fn read_harmony(text: &str) -> Span {
    let Some(m) = text.find(HARMONY_MESSAGE) else {
        return Span::Text;
    };
    let header = &text[..m];
    let Some(r) = header.find(HARMONY_RECIPIENT) else {
        return Span::Text;
    };
    let name_at = r + HARMONY_RECIPIENT.len();
    let name_len = header[name_at..]
        .find(|c: char| !is_name_char(c))
        .unwrap_or(header.len() - name_at);
    let name = &header[name_at..name_at + name_len];
    match json_value(text, m + HARMONY_MESSAGE.len()) {
        Some(args @ Value::Object(_)) => calls_from(&json!({"name": name, "arguments": args})),
        _ => Span::Invalid,
    }
}
