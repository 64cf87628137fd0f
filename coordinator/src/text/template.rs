//! Chat templates: the model's `tokenizer.chat_template` (Jinja, rendered the way transformers'
//! `apply_chat_template` renders it) through minijinja, or a built-in one by name.
//!
//! transformers compatibility: `trim_blocks` and `lstrip_blocks`, Python string/list/dict
//! methods (`.strip()`, `.startswith()`, `.items()`, ...), `raise_exception(msg)`,
//! `strftime_now(format)`, a `tojson` filter that writes JSON the way Python's `json.dumps`
//! does (`", "` and `": "` separators, no HTML escaping, `indent`, `sort_keys`,
//! `ensure_ascii`), and the variables `messages`, `add_generation_prompt`, `bos_token` and
//! `eos_token`.
//!
//! A message's content is text, never markup: [`ChatTemplate::render_pieces`] tells which
//! stretches of the rendered prompt came from contents, so that `<|im_start|>system` typed
//! by a user stays characters and only the template's own markup becomes control tokens.

use crate::text::tokenizer::Piece;
use crate::text::tools::ToolCall;
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;
use std::fmt::Write as _;
use std::ops::Range;

/// One message of a conversation, as the template sees it.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant message's tool calls, shown to the template the way Hugging Face
    /// templates read them: `[{"id", "type": "function", "function": {"name", "arguments"}}]`
    /// with `arguments` an object.
    #[serde(
        skip_serializing_if = "Vec::is_empty",
        serialize_with = "crate::text::tools::serialize_calls_for_template"
    )]
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` message's answer to this call id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A `tool` message's function name (some templates print it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    /// A message of `role` with `content` and nothing else.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            ..Message::default()
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("chat template does not compile: {0}")]
    Compile(String),
    #[error("chat template failed to render: {0}")]
    Render(String),
    /// A message holds special-token text (`<|im_end|>`) that the template cuts or rewrites,
    /// so which part of the prompt is the message's cannot be told.
    #[error(
        "a message contains special-token text ({0}) that the chat template rewrites; \
         remove it from the message"
    )]
    Unmarkable(String),
}

/// Marks put around message content while rendering (Unicode noncharacters, "for internal
/// use"); they are removed from the messages first.
const OPEN: char = '\u{FDD0}';
const CLOSE: char = '\u{FDD1}';

/// A rendered prompt and which byte ranges of it came from message contents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    /// Ranges of `text` from message contents, in order, not overlapping.
    pub content: Vec<Range<usize>>,
}

impl Rendered {
    /// The prompt as pieces for [`crate::text::tokenizer::Tokenizer::encode_pieces`]: the
    /// template's markup may hold special tokens, message contents are plain text.
    pub fn pieces(&self) -> Vec<Piece<'_>> {
        let mut out = Vec::with_capacity(2 * self.content.len() + 1);
        let mut at = 0;
        for r in &self.content {
            out.push(Piece::special(&self.text[at..r.start]));
            out.push(Piece::text(&self.text[r.clone()]));
            at = r.end;
        }
        out.push(Piece::special(&self.text[at..]));
        out
    }
}

/// `text` with its non-blank middle between `OPEN` and `CLOSE` (blank ends stay outside, so
/// `trim` in a template trims the same characters as without the marks).
fn mark_whole(text: &str) -> String {
    let core = text.trim();
    if core.is_empty() {
        return text.to_string();
    }
    let lead = text.len() - text.trim_start().len();
    let end = lead + core.len();
    format!("{}{OPEN}{core}{CLOSE}{}", &text[..lead], &text[end..])
}

/// `text` with each of `spans` between `OPEN` and `CLOSE`.
fn mark_spans(text: &str, spans: &[Range<usize>]) -> String {
    let mut out = String::with_capacity(text.len() + 6 * spans.len());
    let mut at = 0;
    for r in spans {
        out.push_str(&text[at..r.start]);
        out.push(OPEN);
        out.push_str(&text[r.clone()]);
        out.push(CLOSE);
        at = r.end;
    }
    out.push_str(&text[at..]);
    out
}

/// The marks taken out of a rendering: the text and the ranges they enclosed; `None` when
/// they do not pair up.
fn unmark(marked: &str) -> Option<Rendered> {
    let mut text = String::with_capacity(marked.len());
    let mut content = Vec::new();
    let mut open: Option<usize> = None;
    for c in marked.chars() {
        match (c, open) {
            (OPEN, None) => open = Some(text.len()),
            (CLOSE, Some(start)) => {
                if start < text.len() {
                    content.push(start..text.len());
                }
                open = None;
            }
            (OPEN | CLOSE, _) => return None,
            (c, _) => text.push(c),
        }
    }
    open.is_none().then_some(Rendered { text, content })
}

/// ChatML (Qwen, SmolLM, ...).
const CHATML: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Gemma: turns of `user` and `model`; a system prompt opens the first user turn.
const GEMMA: &str = "{{ bos_token }}\
{% if messages and messages[0]['role'] == 'system' %}\
{% set prefix = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}\
{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}\
{% for message in turns %}\
{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}\
{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') }}\
{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}";

/// Llama 3: a header per message, content trimmed, `<|eot_id|>` after each.
const LLAMA3: &str = "{{ bos_token }}\
{% for message in messages %}\
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/// Phi-3: `<|role|>` headers, `<|end|>` after each message, an empty system prompt dropped.
const PHI3: &str = "{% for message in messages %}\
{% if message['role'] in ['user', 'assistant'] or (message['role'] == 'system' and message['content']) %}\
{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}\
{% endif %}{% endfor %}\
{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}";

/// OpenAI's harmony format (gpt-oss), as gpt-oss's own template renders a conversation without
/// tools: a system message with the date and `Reasoning: low|medium|high` (the
/// `reasoning_effort` variable, medium when not given), a leading system or developer message
/// as the developer's instructions, earlier replies in the final channel (their reasoning is
/// not shown again), and `<|start|>assistant` to let the model pick its channel. A reply last
/// in a conversation without the generation prompt ends in `<|return|>`, as in training.
const HARMONY: &str = "<|start|>system<|message|>\
You are ChatGPT, a large language model trained by OpenAI.\n\
Knowledge cutoff: 2024-06\n\
Current date: {{ strftime_now('%Y-%m-%d') }}\n\n\
Reasoning: {{ reasoning_effort if reasoning_effort is defined else 'medium' }}\n\n\
# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>\
{% if messages and messages[0]['role'] in ['system', 'developer'] %}\
{% if messages[0]['content'] %}\
{{ '<|start|>developer<|message|># Instructions\n\n' + messages[0]['content'] + '\n\n<|end|>' }}\
{% endif %}{% set turns = messages[1:] %}\
{% else %}{% set turns = messages %}{% endif %}\
{% for message in turns %}\
{% if message['role'] == 'user' %}\
{{ '<|start|>user<|message|>' + message['content'] + '<|end|>' }}\
{% elif message['role'] == 'assistant' %}\
{% if '<|channel|>analysis<|message|>' in message['content'] or '<|channel|>final<|message|>' in message['content'] %}\
{{ raise_exception('an assistant message holds harmony channel markup; pass only its final text') }}\
{% endif %}\
{{ '<|start|>assistant<|channel|>final<|message|>' + message['content'] }}\
{{ '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}\
{% elif message['role'] == 'tool' %}\
{{ raise_exception('a tool message needs an assistant tool call before it, and the harmony template has no tools') }}\
{% endif %}\
{% endfor %}\
{% if add_generation_prompt %}<|start|>assistant{% endif %}";

const BUILTINS: &[(&str, &str)] = &[
    ("chatml", CHATML),
    ("gemma", GEMMA),
    ("llama3", LLAMA3),
    ("phi3", PHI3),
    ("harmony", HARMONY),
];

/// Variables a chat template may read beside the messages; each one not given is undefined
/// in the template (so `is defined` tells), as when transformers is not passed it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TemplateVars {
    /// gpt-oss's `reasoning_effort`: "low", "medium" or "high".
    pub reasoning_effort: Option<String>,
    /// The tools the model may call, OpenAI-shaped as Hugging Face templates read them:
    /// `[{"type": "function", "function": {"name", "description", "parameters"}}]`.
    pub tools: Option<serde_json::Value>,
}

/// Names of the built-in templates.
pub fn builtin_names() -> Vec<&'static str> {
    BUILTINS.iter().map(|(n, _)| *n).collect()
}

/// The source of built-in template `name`.
pub fn builtin(name: &str) -> Option<&'static str> {
    BUILTINS.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// A compiled chat template with its special-token variables.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChatTemplate(bos {:?}, eos {:?})", self.bos, self.eos)
    }
}

impl ChatTemplate {
    /// Compiles `source` once; `bos_token` and `eos_token` are the texts the template sees.
    pub fn new(
        source: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<ChatTemplate, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| TemplateError::Compile(describe(&e)))?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos: bos_token.to_string(),
            eos: eos_token.to_string(),
        })
    }

    /// `strftime_now` gives the time `unix_secs` (UTC) instead of the current one, so that a
    /// rendering can be compared with another made on another day.
    pub fn pin_time(&mut self, unix_secs: i64) {
        self.env
            .add_function("strftime_now", move |format: String| {
                strftime(&format, unix_secs)
            });
    }

    /// The template's Jinja source (what Ollama's `/api/show` reports).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The prompt for `messages`, ending with the assistant's header when
    /// `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        self.render_with(messages, add_generation_prompt, &TemplateVars::default())
    }

    /// [`ChatTemplate::render`] with more variables for the template.
    pub fn render_with(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        vars: &TemplateVars,
    ) -> Result<String, TemplateError> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| TemplateError::Render(describe(&e)))?;
        let mut ctx = std::collections::BTreeMap::new();
        ctx.insert("messages", Value::from_serialize(messages));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        ctx.insert("bos_token", Value::from(self.bos.as_str()));
        ctx.insert("eos_token", Value::from(self.eos.as_str()));
        if let Some(effort) = &vars.reasoning_effort {
            ctx.insert("reasoning_effort", Value::from(effort.as_str()));
        }
        if let Some(tools) = &vars.tools {
            ctx.insert("tools", Value::from_serialize(tools));
        }
        t.render(ctx)
            .map_err(|e| TemplateError::Render(describe(&e)))
    }

    /// [`ChatTemplate::render`], telling which ranges of the prompt came from message
    /// contents. `control_spans` finds the special-token texts of the vocabulary in a text.
    ///
    /// Each content's non-blank middle is rendered between two marks, and the marks must come
    /// out paired with the rest of the text as without them. A template that cuts a content
    /// (`content.split('</think>')`) breaks that; then only the special-token texts inside
    /// contents are marked, and if the template cuts even those the messages are refused. The
    /// noncharacters U+FDD0 and U+FDD1 are removed from contents.
    pub fn render_pieces(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        control_spans: &dyn Fn(&str) -> Vec<Range<usize>>,
    ) -> Result<Rendered, TemplateError> {
        self.render_pieces_with(
            messages,
            add_generation_prompt,
            &TemplateVars::default(),
            control_spans,
        )
    }

    /// [`ChatTemplate::render_pieces`] with more variables for the template.
    pub fn render_pieces_with(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        vars: &TemplateVars,
        control_spans: &dyn Fn(&str) -> Vec<Range<usize>>,
    ) -> Result<Rendered, TemplateError> {
        let clean: Vec<Message> = messages
            .iter()
            .map(|m| Message {
                content: m.content.replace([OPEN, CLOSE], ""),
                ..m.clone()
            })
            .collect();
        let plain = self.render_with(&clean, add_generation_prompt, vars)?;
        let with = |mark: &dyn Fn(&str) -> String| -> Result<Option<Rendered>, TemplateError> {
            let marked: Vec<Message> = clean
                .iter()
                .map(|m| Message {
                    content: mark(&m.content),
                    ..m.clone()
                })
                .collect();
            let r = unmark(&self.render_with(&marked, add_generation_prompt, vars)?);
            Ok(r.filter(|r| r.text == plain))
        };
        let first = clean.iter().find_map(|m| {
            control_spans(&m.content)
                .first()
                .map(|r| m.content[r.clone()].to_string())
        });
        let Some(first) = first else {
            // No content holds a special-token text: nothing to keep apart.
            return Ok(with(&mark_whole)?.unwrap_or(Rendered {
                text: plain,
                content: Vec::new(),
            }));
        };
        let r = match with(&mark_whole)? {
            Some(r) => Some(r),
            None => with(&|c| mark_spans(c, &control_spans(c)))?,
        };
        // A safety net for templates that lose the marks (`tojson(ensure_ascii=true)` escapes
        // them): outside the contents there may be no more special-token texts than the
        // template writes when the contents hold none.
        if let Some(r) = r {
            // Each special-token text becomes a space (removing it could join two halves).
            let stripped: Vec<Message> = clean
                .iter()
                .map(|m| {
                    let mut content = m.content.clone();
                    for span in control_spans(&m.content).iter().rev() {
                        content.replace_range(span.clone(), " ");
                    }
                    Message {
                        content,
                        ..m.clone()
                    }
                })
                .collect();
            let own =
                control_spans(&self.render_with(&stripped, add_generation_prompt, vars)?).len();
            let outside: usize = r
                .pieces()
                .iter()
                .filter(|p| p.special)
                .map(|p| control_spans(p.text).len())
                .sum();
            if outside <= own {
                return Ok(r);
            }
        }
        Err(TemplateError::Unmarkable(first))
    }
}

/// minijinja's message, with the line and the causes.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    if let Some(line) = e.line() {
        if !s.contains("line") {
            let _ = write!(s, " (line {line})");
        }
    }
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let _ = write!(s, ": {c}");
        cause = c.source();
    }
    s
}

fn raise_exception(msg: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// Python's `json.dumps(value, ensure_ascii=False)` as transformers' `tojson` filter calls it.
/// `v` as the templates' `tojson` writes it with no arguments (Python's `json.dumps` with
/// `ensure_ascii=False`): for text the engine writes in a template's own style.
pub fn tojson_text(v: &serde_json::Value) -> String {
    let mut out = String::new();
    let opts = JsonOpts {
        indent: None,
        sort_keys: false,
        ensure_ascii: false,
    };
    match write_json(&mut out, &Value::from_serialize(v), &opts, 0) {
        Ok(()) => out,
        // Nested beyond the writer's depth limit: serde_json's compact text.
        Err(_) => v.to_string(),
    }
}

fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v)?),
    };
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    let opts = JsonOpts {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    write_json(&mut out, value, &opts, 0)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    indent: Option<usize>,
    sort_keys: bool,
    ensure_ascii: bool,
}

fn write_json_str(out: &mut String, s: &str, ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ascii && (c as u32) > 0x7E) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn newline(out: &mut String, opts: &JsonOpts, depth: usize) {
    if let Some(n) = opts.indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * depth));
    }
}

fn write_json(out: &mut String, v: &Value, opts: &JsonOpts, depth: usize) -> Result<(), Error> {
    if depth > 64 {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    let item_sep = if opts.indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            let s = v.to_string();
            out.push_str(match s.as_str() {
                "inf" => "Infinity",
                "-inf" => "-Infinity",
                "NaN" | "nan" => "NaN",
                other => other,
            });
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or(""), opts.ensure_ascii),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if opts.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, opts, depth + 1);
                match k.as_str() {
                    Some(s) => write_json_str(out, s, opts.ensure_ascii),
                    None => write_json_str(out, &k.to_string(), opts.ensure_ascii),
                }
                out.push_str(": ");
                write_json(out, &v.get_item(k)?, opts, depth + 1)?;
            }
            newline(out, opts, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, opts, depth + 1);
                write_json(out, item, opts, depth + 1)?;
            }
            newline(out, opts, depth);
            out.push(']');
        }
        _ => write_json_str(out, &v.to_string(), opts.ensure_ascii),
    }
    Ok(())
}

/// transformers' `strftime_now(format)`: the current UTC time, for the common directives.
fn strftime_now(format: String) -> Result<String, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&format, secs)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Year, month (1-12) and day (1-31) of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn is_leap(y: i64) -> bool {
    y % 4 == 0 && (y % 100 != 0 || y % 400 == 0)
}

fn strftime(format: &str, unix_secs: i64) -> Result<String, Error> {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let before: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = before[month as usize - 1] + day + u32::from(month > 2 && is_leap(year));
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    let month_name = MONTHS[month as usize - 1];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let _ = match d {
            'd' => write!(out, "{day:02}"),
            'm' => write!(out, "{month:02}"),
            'Y' => write!(out, "{year}"),
            'y' => write!(out, "{:02}", year.rem_euclid(100)),
            'b' => write!(out, "{}", &month_name[..3]),
            'B' => write!(out, "{month_name}"),
            'a' => write!(out, "{}", &WEEKDAYS[weekday][..3]),
            'A' => write!(out, "{}", WEEKDAYS[weekday]),
            'H' => write!(out, "{h:02}"),
            'M' => write!(out, "{m:02}"),
            'S' => write!(out, "{s:02}"),
            'j' => write!(out, "{yday:03}"),
            '%' => write!(out, "%"),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported directive %{other}"),
                ))
            }
        };
    }
    Ok(out)
}

#[cfg(test)]
mod phi3_tests;

#[cfg(test)]
mod tests;
