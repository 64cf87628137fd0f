//! Anthropic's answers: the message object of a whole reply, and the event sequence of a
//! streamed one (`message_start`, `ping`, per block `content_block_start`, deltas and
//! `content_block_stop`, then `message_delta` with the stop reason and `message_stop`; an
//! `error` event when the engine fails mid-stream). [`Events`] is a plain state machine from
//! text to event text; [`sse`] drives it from a request's events.
//!
//! A reply read for tool calls (a request with tools, `tool_choice` not `none`) is split by
//! the model's format (`text::tools`): its text outside calls is a `text` block, each call a
//! `tool_use` block after it; a streamed call is sent when complete, as one
//! `input_json_delta` holding its whole input. It stops for `tool_use` when it made calls
//! and the model ended it.

use super::error_object;
use super::tools::{anthropic_call, tool_reply, tool_use_block};
use crate::serve::http::tools::{Piece, ReplyReader};
use crate::serve::http::{stopped, ApiError, CancelOnDrop, Collected};
use crate::serve::{Finish, GenEvent};
use crate::text::tools::{ToolCall, ToolFormat};
use axum::body::Bytes;
use serde_json::{json, Value};
use std::convert::Infallible;

/// Why the answer ended, in Anthropic's words. A request cut short by the context's end
/// (fewer tokens than `max_tokens`) is `model_context_window_exceeded`; one cut short by a
/// shutdown reads as `max_tokens`, as OpenAI's `length` does.
pub(crate) fn stop_reason(
    finish: Finish,
    stop_sequence: Option<&str>,
    output_tokens: usize,
    max_tokens: u64,
) -> &'static str {
    match finish {
        Finish::Stop if stop_sequence.is_some() => "stop_sequence",
        Finish::Stop => "end_turn",
        Finish::Length if (output_tokens as u64) < max_tokens => "model_context_window_exceeded",
        Finish::Length | Finish::Cancelled => "max_tokens",
    }
}

/// The usage object: `input_tokens` + `cache_read_input_tokens` is the prompt.
fn usage(prompt_tokens: usize, cached_tokens: usize, output_tokens: usize) -> Value {
    json!({
        "input_tokens": prompt_tokens.saturating_sub(cached_tokens),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    })
}

/// What one reply says about itself.
pub(crate) struct Reply {
    id: String,
    model: String,
    /// The request's `max_tokens`.
    max_tokens: u64,
    /// A harmony model's reply: only its final channel is the answer.
    harmony: bool,
    /// The reply is read for tool calls in this format.
    tools: Option<ToolFormat>,
}

impl Reply {
    pub fn new(model: String, max_tokens: u64, harmony: bool) -> Reply {
        Reply {
            id: format!("msg_{:024x}", rand::random::<u128>() >> 32),
            model,
            max_tokens,
            harmony,
            tools: None,
        }
    }

    /// Reads tool calls out of the reply in `format` (a request with tools).
    pub fn tools(mut self, format: Option<ToolFormat>) -> Reply {
        self.tools = format;
        self
    }

    /// The stop reason; `called`: the reply made tool calls.
    fn stop_reason(
        &self,
        finish: Finish,
        stop_sequence: Option<&str>,
        output_tokens: usize,
        called: bool,
    ) -> &'static str {
        match finish {
            Finish::Stop if called => "tool_use",
            _ => stop_reason(finish, stop_sequence, output_tokens, self.max_tokens),
        }
    }

    /// The message object with this content, stop reason and usage.
    fn message(&self, content: Value, stop: Value, stop_sequence: Value, usage: Value) -> Value {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": stop_sequence,
            "usage": usage,
        })
    }

    /// The non-streamed answer.
    pub fn whole(&self, c: &Collected) -> Value {
        // A harmony reply's answer is its final channel (the reasoning is not shown).
        let (split, calls) = ReplyReader::whole(self.tools, self.harmony, &c.text);
        let calls: Vec<ToolCall> = calls.into_iter().map(anthropic_call).collect();
        let (content, called) = tool_reply(&split.content, &calls);
        let u = &c.usage;
        let reason = self.stop_reason(
            c.finish,
            c.stop_sequence.as_deref(),
            u.completion_tokens,
            called,
        );
        self.message(
            content,
            json!(reason),
            json!(c.stop_sequence),
            usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens),
        )
    }
}

/// One server-sent event with its name.
fn event(name: &str, data: &Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

/// The kind of the block being streamed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Open {
    Text,
}

/// A streamed reply's events, from its text. Blocks open when their first content arrives,
/// so an empty answer has none.
pub(crate) struct Events {
    reply: Reply,
    prompt_tokens: usize,
    /// The block being streamed and its index.
    open: Option<(usize, Open)>,
    /// Blocks started so far.
    blocks: usize,
    /// The reply's text and calls (a harmony reply's final channel is the answer).
    reader: ReplyReader,
    /// Whether a call was sent (the stop reason is then `tool_use`).
    called: bool,
}

impl Events {
    pub fn new(reply: Reply, prompt_tokens: usize) -> Events {
        Events {
            reader: ReplyReader::new(reply.tools, reply.harmony),
            called: false,
            reply,
            prompt_tokens,
            open: None,
            blocks: 0,
        }
    }

    /// `message_start` (the message without content; the whole prompt as `input_tokens`)
    /// and a `ping`.
    pub fn start(&self) -> String {
        let message = self.reply.message(
            json!([]),
            Value::Null,
            Value::Null,
            usage(self.prompt_tokens, 0, 0),
        );
        event(
            "message_start",
            &json!({"type": "message_start", "message": message}),
        ) + &event("ping", &json!({"type": "ping"}))
    }

    /// Generated text (before the tool-call and harmony splits).
    pub fn text(&mut self, text: &str) -> String {
        self.generated(text, false)
    }

    /// Generated text: through the tool-call stream (if any), its text through the harmony
    /// parser (if any) into text deltas, its calls into `tool_use` blocks. `last`: the end of
    /// the reply, where held text is released.
    fn generated(&mut self, text: &str, last: bool) -> String {
        let mut out = String::new();
        for piece in self.reader.push(text, last) {
            match piece {
                Piece::Text(split) => out += &self.answer_text(&split.content),
                Piece::Call(call) => out += &self.call(&anthropic_call(call)),
            }
        }
        out
    }

    /// Answer text: a delta, opening a text block first if none is open.
    fn answer_text(&mut self, text: &str) -> String {
        if text.is_empty() {
            return String::new();
        }
        let mut out = String::new();
        let index = match self.open {
            Some((i, Open::Text)) => i,
            None => {
                let i = self.blocks;
                self.blocks += 1;
                self.open = Some((i, Open::Text));
                out += &event(
                    "content_block_start",
                    &json!({
                        "type": "content_block_start",
                        "index": i,
                        "content_block": {"type": "text", "text": ""},
                    }),
                );
                i
            }
        };
        out + &event(
            "content_block_delta",
            &json!({
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "text_delta", "text": text},
            }),
        )
    }

    /// A call: a `tool_use` block (its input empty at the start, as Anthropic streams it)
    /// whose one `input_json_delta` is the whole input, closed at once.
    pub fn call(&mut self, call: &ToolCall) -> String {
        self.called = true;
        let mut out = self.close();
        let i = self.blocks;
        self.blocks += 1;
        let mut start = tool_use_block(call);
        start["input"] = json!({});
        out += &event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": i, "content_block": start}),
        );
        out += &event(
            "content_block_delta",
            &json!({
                "type": "content_block_delta",
                "index": i,
                "delta": {"type": "input_json_delta", "partial_json": call.arguments.to_string()},
            }),
        );
        out + &event(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": i}),
        )
    }

    /// `content_block_stop` of the open block, if any.
    fn close(&mut self) -> String {
        match self.open.take() {
            Some((i, _)) => event(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": i}),
            ),
            None => String::new(),
        }
    }

    /// The end: the last text, the open block's stop, `message_delta`, `message_stop`.
    pub fn end(
        &mut self,
        last_text: &str,
        finish: Finish,
        stop_sequence: Option<&str>,
        output_tokens: usize,
        cached_tokens: usize,
    ) -> String {
        let mut out = self.generated(last_text, true);
        out += &self.close();
        let reason = self
            .reply
            .stop_reason(finish, stop_sequence, output_tokens, self.called);
        out += &event(
            "message_delta",
            &json!({
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                "usage": usage(self.prompt_tokens, cached_tokens, output_tokens),
            }),
        );
        out + &event("message_stop", &json!({"type": "message_stop"}))
    }

    /// An `error` event (the stream ends with it).
    pub fn error(&mut self, e: &ApiError) -> String {
        event("error", &json!({"type": "error", "error": error_object(e)}))
    }
}

/// Turns a request's events into SSE text; owns the cancel guard, so dropping the stream
/// (the client went away) cancels the request.
struct Streamer {
    events: Events,
    first: Option<GenEvent>,
    rx: tokio::sync::mpsc::UnboundedReceiver<GenEvent>,
    guard: CancelOnDrop,
    started: bool,
    ended: bool,
}

impl Streamer {
    async fn next(&mut self) -> Option<String> {
        if self.ended {
            return None;
        }
        if !self.started {
            self.started = true;
            return Some(self.events.start());
        }
        loop {
            let next = match self.first.take() {
                Some(e) => Some(e),
                None => self.rx.recv().await,
            };
            match next {
                Some(GenEvent::Token { text, .. }) => {
                    let out = self.events.text(&text);
                    if !out.is_empty() {
                        return Some(out);
                    }
                }
                Some(GenEvent::Done {
                    finish,
                    text,
                    completion_tokens,
                    cached_tokens,
                    stop_sequence,
                    ..
                }) => {
                    self.guard.disarm();
                    self.ended = true;
                    return Some(self.events.end(
                        &text,
                        finish,
                        stop_sequence.as_deref(),
                        completion_tokens,
                        cached_tokens,
                    ));
                }
                Some(GenEvent::Error {
                    message,
                    retry_after_s,
                }) => return Some(self.fail(&ApiError::engine(message, retry_after_s))),
                None => return Some(self.fail(&stopped())),
            }
        }
    }

    fn fail(&mut self, e: &ApiError) -> String {
        self.guard.disarm();
        self.ended = true;
        self.events.error(e)
    }
}

/// The SSE body of a streamed request; `first`: its first event, already received.
pub(crate) fn sse(
    events: Events,
    first: GenEvent,
    rx: tokio::sync::mpsc::UnboundedReceiver<GenEvent>,
    guard: CancelOnDrop,
) -> impl futures_util::Stream<Item = Result<Bytes, Infallible>> + Send + 'static {
    let s = Streamer {
        events,
        first: Some(first),
        rx,
        guard,
        started: false,
        ended: false,
    };
    futures_util::stream::unfold(s, |mut s| async move {
        let text = s.next().await?;
        Some((Ok(Bytes::from(text)), s))
    })
}
