//! Reading the calls out of a whole reply.

use super::stream::{StreamItem, ToolStream};
use super::{ToolCall, ToolFormat};

/// A reply split into text and calls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    /// The text outside calls, trimmed.
    pub content: String,
    /// The calls, in order; each one's arguments are a JSON object.
    pub calls: Vec<ToolCall>,
    /// Spans that looked like calls but were not valid ones (bad JSON, no name, arguments
    /// not an object): they stay in `content` and are listed here.
    pub invalid: Vec<String>,
}

/// The calls in `text`, a whole reply in `format`. Lenient about what models get wrong
/// (blanks, a missing closing tag at the end or before the next call, `arguments` as a JSON
/// string holding the object, Llama's `parameters` for `arguments` and the other way round);
/// strict about what comes out (a name, and arguments that are an object).
pub fn parse(format: ToolFormat, text: &str) -> Parsed {
    let mut s = ToolStream::new(format);
    let mut items = s.push(text);
    items.extend(s.finish());
    let mut out = Parsed::default();
    for item in items {
        match item {
            StreamItem::Content(c) => out.content.push_str(&c),
            StreamItem::Call(c) => out.calls.push(c),
        }
    }
    out.invalid = s.invalid().to_vec();
    out
}
