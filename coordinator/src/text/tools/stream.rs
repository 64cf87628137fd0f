//! Reading calls out of a reply as it streams: text is released as soon as it cannot be the
//! start of a call, a call as soon as it is complete.

use super::scan::{find_start, read_span, scan_call, Scan, Span, Start};
use super::{ToolCall, ToolFormat};

/// One thing the stream gives out, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamItem {
    /// Text of the answer (outside calls).
    Content(String),
    /// A complete call; its index is its place among the calls.
    Call(ToolCall),
}

/// Splits a reply into text and calls, chunk by chunk.
///
/// Text that may begin a call marker is held until the next chunk tells (as a stop-string
/// matcher holds a possible stop string); once a call starts nothing is released until it is
/// complete. Blanks are held until text follows them, so blanks around calls and at both ends
/// of the reply never come out: the text released is the reply's text outside calls, trimmed,
/// exactly [`super::parse`]'s `content`, however the reply is cut.
#[derive(Clone, Debug)]
pub struct ToolStream {
    format: ToolFormat,
    /// Text not yet placed.
    pending: String,
    /// Blanks after the last released text, released when more text follows.
    blanks: String,
    /// Whether any text was released (blanks before it are dropped).
    started: bool,
    /// Whether the last thing placed was a call (Llama 3: a JSON object may follow).
    after_call: bool,
    /// Spans that looked like calls but were not valid ones.
    invalid: Vec<String>,
}

impl ToolStream {
    pub fn new(format: ToolFormat) -> ToolStream {
        ToolStream {
            format,
            pending: String::new(),
            blanks: String::new(),
            started: false,
            after_call: false,
            invalid: Vec::new(),
        }
    }

    /// The items `chunk` completes.
    pub fn push(&mut self, chunk: &str) -> Vec<StreamItem> {
        self.pending.push_str(chunk);
        let mut out = Vec::new();
        self.drain(false, &mut out);
        out
    }

    /// The end of the reply: held text is released, and an unterminated last call is read
    /// if its JSON is complete (else it is text, reported as invalid).
    pub fn finish(&mut self) -> Vec<StreamItem> {
        let mut out = Vec::new();
        self.drain(true, &mut out);
        self.blanks.clear();
        out
    }

    /// Spans so far that looked like calls but were not valid ones (they came out as text).
    pub fn invalid(&self) -> &[String] {
        &self.invalid
    }

    fn drain(&mut self, at_end: bool, out: &mut Vec<StreamItem>) {
        loop {
            let bare_json = !self.started || self.after_call;
            let at = match find_start(self.format, &self.pending, bare_json) {
                Start::None => {
                    let rest = std::mem::take(&mut self.pending);
                    self.text(&rest, out);
                    return;
                }
                Start::Maybe(at) if !at_end => {
                    let head: String = self.pending.drain(..at).collect();
                    self.text(&head, out);
                    return;
                }
                Start::Maybe(_) => {
                    let rest = std::mem::take(&mut self.pending);
                    self.text(&rest, out);
                    return;
                }
                Start::At(at) => at,
            };
            let head: String = self.pending.drain(..at).collect();
            self.text(&head, out);
            let len = match scan_call(self.format, &self.pending) {
                Scan::Complete(len) => len,
                Scan::Incomplete if at_end => self.pending.len(),
                Scan::Incomplete => return,
            };
            if len == 0 {
                // Cannot happen (a span holds its marker); never loop forever on it.
                let rest = std::mem::take(&mut self.pending);
                self.text(&rest, out);
                return;
            }
            let span: String = self.pending.drain(..len).collect();
            match read_span(self.format, &span) {
                Span::Calls(calls) => {
                    for (name, arguments) in calls {
                        out.push(StreamItem::Call(ToolCall::new(name, arguments)));
                    }
                    self.after_call = true;
                }
                Span::Invalid => {
                    self.invalid.push(span.clone());
                    self.text(&span, out);
                }
                Span::Text => self.text(&span, out),
            }
        }
    }

    /// Releases `text`, holding its trailing blanks (see the type).
    fn text(&mut self, text: &str, out: &mut Vec<StreamItem>) {
        let end = text.trim_end().len();
        let start = if self.started {
            0
        } else {
            text.len() - text.trim_start().len()
        };
        if start >= end {
            if self.started {
                self.blanks.push_str(text);
            }
            return;
        }
        let mut piece = std::mem::take(&mut self.blanks);
        piece.push_str(&text[start..end]);
        self.blanks.push_str(&text[end..]);
        self.started = true;
        self.after_call = false;
        match out.last_mut() {
            Some(StreamItem::Content(c)) => c.push_str(&piece),
            _ => out.push(StreamItem::Content(piece)),
        }
    }
}
