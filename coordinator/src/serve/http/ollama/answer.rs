//! An Ollama answer: the request submitted, its events turned into NDJSON lines (streamed)
//! or one object, with Ollama's counts and durations.

use super::*;
use crate::serve::http::tools::{Piece, ReplyReader};
use crate::text::tools::{ToolCall, ToolFormat};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum What {
    Chat,
    Generate,
}

/// When a request arrived, was handed to the backend, and saw its first token.
#[derive(Clone, Copy)]
pub(super) struct Timing {
    arrived: Instant,
    submitted: Instant,
    first_token: Option<Instant>,
}

pub(super) fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Builds the objects of one answer.
pub(super) struct Reply {
    pub(super) what: What,
    pub(super) model: String,
    /// A harmony reply (gpt-oss): split into `thinking` and the answer, with what `think`
    /// asked (see [`crate::text::harmony`]).
    pub(super) harmony: Option<Think>,
    /// The answer is read for tool calls in this format (a chat with `tools`).
    pub(super) tools: Option<ToolFormat>,
}

/// A call as Ollama gives it: `{"function": {"name", "arguments": <object>}}`.
fn ollama_call(c: &ToolCall) -> Value {
    json!({"function": {"name": c.name, "arguments": c.arguments}})
}

impl Reply {
    /// A piece of the answer (streamed), or the whole text (`done` objects).
    fn object(&self, text: &str, done: bool) -> Value {
        self.object_with(text, "", done)
    }

    /// [`Reply::object`] with reasoning, in `thinking` when there is any and it is shown.
    fn object_with(&self, text: &str, thinking: &str, done: bool) -> Value {
        let mut v = json!({
            "model": self.model,
            "created_at": rfc3339(SystemTime::now()),
        });
        let thinking = (!thinking.is_empty() && self.shows_thinking()).then_some(thinking);
        match self.what {
            What::Chat => {
                v["message"] = json!({"role": "assistant", "content": text});
                if let Some(t) = thinking {
                    v["message"]["thinking"] = json!(t);
                }
            }
            What::Generate => {
                v["response"] = json!(text);
                if let Some(t) = thinking {
                    v["thinking"] = json!(t);
                }
            }
        }
        v["done"] = json!(done);
        v
    }

    fn shows_thinking(&self) -> bool {
        self.harmony.as_ref().is_some_and(|t| t.show)
    }

    /// A piece of a harmony reply as a streamed line; `None` when it shows nothing.
    fn piece(&self, split: &Split) -> Option<Value> {
        let shown =
            !split.content.is_empty() || (!split.reasoning.is_empty() && self.shows_thinking());
        shown.then(|| self.object_with(&split.content, &split.reasoning, false))
    }

    /// The last object: the reason and Ollama's counts and durations (nanoseconds).
    fn done(
        &self,
        text: &str,
        thinking: &str,
        finish: Finish,
        timing: &Timing,
        prompt_tokens: usize,
        completion_tokens: usize,
    ) -> Value {
        let now = Instant::now();
        let first = timing.first_token.unwrap_or(now);
        let mut v = self.object_with(text, thinking, true);
        v["done_reason"] = json!(done_reason(finish));
        v["total_duration"] = json!(nanos(now - timing.arrived));
        v["load_duration"] = json!(0);
        v["prompt_eval_count"] = json!(prompt_tokens);
        v["prompt_eval_duration"] = json!(nanos(first.saturating_duration_since(timing.submitted)));
        v["eval_count"] = json!(completion_tokens);
        v["eval_duration"] = json!(nanos(now.saturating_duration_since(first)));
        v
    }
}

/// Ollama has no "cancelled": an answer cut short by a shutdown reads as truncated.
pub(super) fn done_reason(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "stop",
        Finish::Length | Finish::Cancelled => "length",
    }
}

/// Submits and answers: NDJSON lines, or one object.
pub(super) async fn answer(
    s: &Shared,
    p: Params,
    prompt: Vec<u32>,
    reply: Reply,
    arrived: Instant,
) -> Result<Response, OllamaError> {
    let constraint = constraint(s, &p).await?;
    let mut sub = submit(s, &p, prompt, constraint)?;
    let mut timing = Timing {
        arrived,
        submitted: Instant::now(),
        first_token: None,
    };
    if p.stream {
        let first = sub.first().await?;
        if matches!(first, GenEvent::Token { .. }) {
            timing.first_token = Some(Instant::now());
        }
        let reader = reply
            .tools
            .map(|f| ReplyReader::new(Some(f), reply.harmony.is_some()));
        let lines = Lines {
            parser: (reply.harmony.is_some() && reader.is_none()).then(ChannelParser::new),
            reply,
            timing,
            first: Some(first),
            rx: sub.rx,
            guard: sub.guard,
            ended: false,
            reader,
        };
        let body = Body::from_stream(futures_util::stream::unfold(lines, |mut l| async move {
            let text = l.next().await?;
            Some((Ok::<_, Infallible>(Bytes::from(text)), l))
        }));
        let headers = [
            (header::CONTENT_TYPE, "application/x-ndjson"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::HeaderName::from_static("x-accel-buffering"), "no"),
        ];
        return Ok((headers, body).into_response());
    }
    let done = super::super::collect(sub.rx, sub.guard).await?;
    timing.first_token = done.first_token;
    let (split, calls) = ReplyReader::whole(reply.tools, reply.harmony.is_some(), &done.text);
    let mut v = reply.done(
        &split.content,
        &split.reasoning,
        done.finish,
        &timing,
        done.usage.prompt_tokens,
        done.usage.completion_tokens,
    );
    if !calls.is_empty() {
        v["message"]["tool_calls"] = calls.iter().map(ollama_call).collect();
    }
    Ok(Json(v).into_response())
}

/// Turns a request's events into NDJSON lines; owns the cancel guard, so dropping the stream
/// (the client went away) cancels the request.
pub(super) struct Lines {
    reply: Reply,
    /// A harmony reply's channel parser.
    parser: Option<ChannelParser>,
    timing: Timing,
    first: Option<GenEvent>,
    rx: tokio::sync::mpsc::UnboundedReceiver<GenEvent>,
    guard: CancelOnDrop,
    ended: bool,
    /// An answer read for tool calls: each call comes out as a line of its own.
    reader: Option<ReplyReader>,
}

pub(super) fn line(v: &Value) -> String {
    format!("{v}\n")
}

impl Lines {
    /// The lines for text of an answer read for tool calls (`last`: its end).
    fn tool_lines(&mut self, text: &str, last: bool) -> String {
        let Some(reader) = self.reader.as_mut() else {
            return String::new();
        };
        let mut out = String::new();
        for piece in reader.push(text, last) {
            match piece {
                Piece::Text(split) => {
                    if let Some(v) = self.reply.piece(&split) {
                        out += &line(&v);
                    }
                }
                Piece::Call(call) => {
                    let mut v = self.reply.object("", false);
                    v["message"]["tool_calls"] = json!([ollama_call(&call)]);
                    out += &line(&v);
                }
            }
        }
        out
    }

    async fn next(&mut self) -> Option<String> {
        if self.ended {
            return None;
        }
        loop {
            let next = match self.first.take() {
                Some(e) => Some(e),
                None => self.rx.recv().await,
            };
            match next {
                Some(GenEvent::Token { text, .. }) => {
                    self.timing.first_token.get_or_insert_with(Instant::now);
                    if text.is_empty() {
                        continue;
                    }
                    if self.reader.is_some() {
                        let out = self.tool_lines(&text, false);
                        if out.is_empty() {
                            continue;
                        }
                        return Some(out);
                    }
                    let Some(parser) = self.parser.as_mut() else {
                        return Some(line(&self.reply.object(&text, false)));
                    };
                    match self.reply.piece(&parser.push(&text)) {
                        Some(v) => return Some(line(&v)),
                        None => continue,
                    }
                }
                Some(GenEvent::Done {
                    finish,
                    text,
                    prompt_tokens,
                    completion_tokens,
                    ..
                }) => {
                    self.guard.disarm();
                    self.ended = true;
                    let mut out = String::new();
                    match self.parser.as_mut() {
                        _ if self.reader.is_some() => out += &self.tool_lines(&text, true),
                        Some(parser) => {
                            let split = parser.push_last(&text);
                            if let Some(v) = self.reply.piece(&split) {
                                out += &line(&v);
                            }
                        }
                        None if !text.is_empty() => out += &line(&self.reply.object(&text, false)),
                        None => {}
                    }
                    out += &line(&self.reply.done(
                        "",
                        "",
                        finish,
                        &self.timing,
                        prompt_tokens,
                        completion_tokens,
                    ));
                    return Some(out);
                }
                Some(GenEvent::Error { message, .. }) => return Some(self.fail(message)),
                None => return Some(self.fail(stopped().message)),
            }
        }
    }

    fn fail(&mut self, message: String) -> String {
        self.guard.disarm();
        self.ended = true;
        line(&json!({ "error": message }))
    }
}
