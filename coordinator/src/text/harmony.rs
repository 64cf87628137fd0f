//! OpenAI's harmony format (gpt-oss) on the way out: a reply is a sequence of messages, each
//! `<|channel|>NAME<|message|>TEXT` ended by `<|end|>` (another `<|start|>assistant` follows)
//! or by `<|return|>`/`<|call|>` (which end the generation). The `analysis` channel is the
//! model's reasoning, `final` the answer.
//!
//! [`ChannelParser`] splits the generated text into reasoning and answer as it streams. It
//! reads the decoded text rather than token ids: the markup tokens render as their text
//! (`<|start|>`, `<|channel|>`, `<|message|>`, `<|constrain|>` and, in a harmony vocabulary,
//! `<|end|>`, as llama.cpp renders them), and the serving layer's stop-string
//! look-ahead may move text from one token's event to a later one, so only the text is in
//! order. Text arrives in chunks cut anywhere, also inside a markup token: a chunk's tail that
//! may begin markup is held until the next chunk tells. No markup text reaches either output.

use super::tokenizer::Tokenizer;

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const END: &str = "<|end|>";
const CONSTRAIN: &str = "<|constrain|>";
const RETURN: &str = "<|return|>";
const CALL: &str = "<|call|>";
const MARKUP: [&str; 7] = [START, CHANNEL, MESSAGE, END, CONSTRAIN, RETURN, CALL];

/// Whether a model speaks harmony: its vocabulary has harmony's markup and ending tokens
/// (o200k_harmony, gpt-oss's). Only then is the reply split into reasoning and answer.
pub fn is_harmony(tok: &Tokenizer) -> bool {
    [START, CHANNEL, MESSAGE, END, RETURN]
        .iter()
        .all(|t| tok.piece_to_id(t).is_some())
}

/// Text of a reply, split.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Split {
    /// The analysis channel, and messages addressed to a tool (`to=…`): not the answer.
    pub reasoning: String,
    /// The final channel and the commentary channel's preambles to the user.
    pub content: String,
}

impl Split {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty()
    }

    fn append(&mut self, other: Split) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Between `<|start|>` (or the prompt's `<|start|>assistant`) and `<|message|>`: the role,
    /// the channel and any recipient or constraint. Not shown.
    Header,
    /// A message's text, to reasoning (true) or to the answer.
    Body { reasoning: bool },
    /// After `<|end|>`: only `<|start|>` is expected.
    Between,
    /// After `<|return|>` or `<|call|>`: the reply is over.
    Over,
}

/// Splits a harmony reply into reasoning and answer, chunk by chunk (see the module).
#[derive(Clone, Debug)]
pub struct ChannelParser {
    state: State,
    /// Text not yet placed: at most a tail that may begin a markup token.
    pending: String,
    /// The current header's text (role, channel, recipient).
    header: String,
    /// Whether any message began; a reply without markup at all is shown as the answer.
    seen_message: bool,
    /// The text before the first message, markup left out (for a reply without any).
    unformatted: String,
}

impl Default for ChannelParser {
    fn default() -> ChannelParser {
        ChannelParser::new()
    }
}

impl ChannelParser {
    /// A parser for a reply generated after the prompt's `<|start|>assistant`.
    pub fn new() -> ChannelParser {
        ChannelParser {
            state: State::Header,
            pending: String::new(),
            header: String::new(),
            seen_message: false,
            unformatted: String::new(),
        }
    }

    /// The text `chunk` adds to reasoning and answer (possibly nothing yet).
    pub fn push(&mut self, chunk: &str) -> Split {
        self.pending.push_str(chunk);
        let mut out = Split::default();
        loop {
            match next_markup(&self.pending) {
                Found::Markup(at, m) => {
                    let text: String = self.pending.drain(..at + m.len()).collect();
                    self.text(&text[..at], &mut out);
                    self.markup(m);
                }
                Found::Partial(at) => {
                    let text: String = self.pending.drain(..at).collect();
                    self.text(&text, &mut out);
                    return out;
                }
            }
        }
    }

    /// The rest at the end of the reply: a held tail that never became markup is text.
    pub fn finish(&mut self) -> Split {
        let rest = std::mem::take(&mut self.pending);
        let mut out = Split::default();
        self.text(&rest, &mut out);
        if !self.seen_message {
            // The model did not use the format: what it wrote is the answer.
            out.content.push_str(&std::mem::take(&mut self.unformatted));
        }
        out
    }

    /// [`ChannelParser::push`] of the reply's last text, then [`ChannelParser::finish`].
    pub fn push_last(&mut self, chunk: &str) -> Split {
        let mut out = self.push(chunk);
        out.append(self.finish());
        out
    }

    /// A whole reply, split.
    pub fn split(text: &str) -> Split {
        ChannelParser::new().push_last(text)
    }

    fn text(&mut self, text: &str, out: &mut Split) {
        if text.is_empty() {
            return;
        }
        if !self.seen_message {
            self.unformatted.push_str(text);
        }
        match self.state {
            State::Header => self.header.push_str(text),
            State::Body { reasoning: true } => out.reasoning.push_str(text),
            State::Body { reasoning: false } => out.content.push_str(text),
            // Text outside any message is not the model's to show.
            State::Between | State::Over => {}
        }
    }

    fn markup(&mut self, m: &'static str) {
        self.state = match (self.state, m) {
            (State::Over, _) => State::Over,
            (_, RETURN | CALL) => State::Over,
            (_, START) => {
                self.header.clear();
                State::Header
            }
            (State::Header, MESSAGE) => {
                self.seen_message = true;
                let reasoning = header_is_reasoning(&self.header);
                self.header.clear();
                State::Body { reasoning }
            }
            // `<|channel|>` and `<|constrain|>` are part of a header; the header keeps their
            // place as a space so that "analysis" and a recipient stay apart.
            (State::Header, _) => {
                self.header.push(' ');
                State::Header
            }
            (State::Body { .. }, END) => State::Between,
            // Markup out of place (a header inside a message): the message goes on.
            (s, _) => s,
        };
    }
}

/// Whether a message with this header (`assistant<|channel|>analysis`, `assistant to=functions.f
/// <|channel|>commentary <|constrain|>json`) is reasoning rather than the answer: the analysis
/// channel, and anything addressed to a recipient. The final channel, the commentary channel's
/// preambles and a message without a channel are the answer.
fn header_is_reasoning(header: &str) -> bool {
    let mut words = header.split_whitespace();
    let addressed = header.split_whitespace().any(|w| w.starts_with("to="));
    let channel = words.find(|w| matches!(*w, "analysis" | "final" | "commentary"));
    addressed || channel == Some("analysis")
}

enum Found {
    /// A whole markup token at this byte offset.
    Markup(usize, &'static str),
    /// No markup; text from this offset on may begin one (the end when nothing may).
    Partial(usize),
}

/// The first markup token in `s`, or where a possible one begins at its end.
fn next_markup(s: &str) -> Found {
    let mut from = 0;
    while let Some(i) = s[from..].find('<') {
        let at = from + i;
        let rest = &s[at..];
        if let Some(m) = MARKUP.iter().find(|m| rest.starts_with(**m)) {
            return Found::Markup(at, m);
        }
        if MARKUP.iter().any(|m| m.starts_with(rest)) {
            return Found::Partial(at);
        }
        from = at + 1;
    }
    Found::Partial(s.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPLY: &str = "<|channel|>analysis<|message|>User greets. Answer <b>kindly</b>.<|end|>\
                         <|start|>assistant<|channel|>final<|message|>Hello! 2 < 3 and <|x|>.";

    fn want() -> Split {
        Split {
            reasoning: "User greets. Answer <b>kindly</b>.".into(),
            content: "Hello! 2 < 3 and <|x|>.".into(),
        }
    }

    /// Streams `chunks` through a parser; the pieces concatenated.
    fn stream(chunks: &[&str]) -> Split {
        let mut p = ChannelParser::new();
        let mut out = Split::default();
        for c in chunks {
            out.append(p.push(c));
        }
        out.append(p.finish());
        out
    }

    #[test]
    fn a_whole_reply_splits_into_reasoning_and_answer() {
        assert_eq!(ChannelParser::split(REPLY), want());
    }

    #[test]
    fn every_cut_into_two_chunks_gives_the_same_split() {
        for (at, _) in REPLY.char_indices() {
            let got = stream(&[&REPLY[..at], &REPLY[at..]]);
            assert_eq!(got, want(), "cut at byte {at}: {:?}", &REPLY[..at]);
        }
    }

    #[test]
    fn every_cut_into_three_chunks_gives_the_same_split() {
        let cuts: Vec<usize> = REPLY.char_indices().map(|(i, _)| i).collect();
        for (n, &a) in cuts.iter().enumerate() {
            for &b in &cuts[n..] {
                let got = stream(&[&REPLY[..a], &REPLY[a..b], &REPLY[b..]]);
                assert_eq!(got, want(), "cuts at {a} and {b}");
            }
        }
    }

    #[test]
    fn character_by_character_never_shows_markup_and_streams_early() {
        let mut p = ChannelParser::new();
        let mut out = Split::default();
        let mut first_content_at = None;
        for (i, c) in REPLY.char_indices() {
            let s = p.push(&c.to_string());
            for piece in [&s.reasoning, &s.content] {
                assert!(
                    !MARKUP.iter().any(|m| piece.contains(m)),
                    "markup out at {i}: {piece:?}"
                );
            }
            if !s.content.is_empty() && first_content_at.is_none() {
                first_content_at = Some(i);
            }
            out.append(s);
        }
        out.append(p.finish());
        assert_eq!(out, want());
        // "Hello" comes out with its own characters, not at the end.
        let hello = REPLY.find("Hello").unwrap();
        assert_eq!(first_content_at, Some(hello));
    }

    #[test]
    fn a_held_tail_that_is_no_markup_is_released() {
        // "<|en" may begin <|end|>: held, then released as text when "x" shows it is not.
        let mut p = ChannelParser::new();
        assert!(p.push("<|channel|>final<|message|>a<|en").content == "a");
        assert_eq!(p.push("x").content, "<|enx");
        // At the end of the reply, a held tail is text too.
        assert_eq!(p.push(" <|ret").content, " ");
        assert_eq!(p.finish().content, "<|ret");
    }

    #[test]
    fn generation_ends_at_return_or_call_and_tool_calls_are_not_the_answer() {
        let call = "<|channel|>analysis<|message|>Need weather.<|end|>\
                    <|start|>assistant to=functions.get_weather<|channel|>commentary \
                    <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>ignored";
        assert_eq!(
            ChannelParser::split(call),
            Split {
                reasoning: "Need weather.{\"city\":\"Paris\"}".into(),
                content: String::new(),
            }
        );
        let ret = "<|channel|>final<|message|>Done.<|return|>after";
        assert_eq!(ChannelParser::split(ret).content, "Done.");
        // A commentary preamble is for the user.
        let pre = "<|channel|>commentary<|message|>Let me check.<|end|>";
        assert_eq!(ChannelParser::split(pre).content, "Let me check.");
    }

    #[test]
    fn a_reply_without_the_format_is_the_answer() {
        assert_eq!(
            ChannelParser::split("just text, no channels"),
            Split {
                reasoning: String::new(),
                content: "just text, no channels".into(),
            }
        );
        // Cut short inside the reasoning: only reasoning, no answer.
        let cut = ChannelParser::split("<|channel|>analysis<|message|>Thinking about");
        assert_eq!(cut.reasoning, "Thinking about");
        assert_eq!(cut.content, "");
        // Cut short inside a header: nothing to show.
        assert!(
            ChannelParser::split("<|channel|>analysis<|message|>x<|end|><|start|>assis")
                .content
                .is_empty()
        );
    }

    #[test]
    fn several_messages_and_multibyte_text() {
        let text = "<|channel|>analysis<|message|>日本<|end|><|start|>assistant<|channel|>analysis\
                    <|message|>🦀<|end|><|start|>assistant<|channel|>final<|message|>Ünï<|end|>";
        let cuts: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        for &a in &cuts {
            let got = stream(&[&text[..a], &text[a..]]);
            assert_eq!(
                got,
                Split {
                    reasoning: "日本🦀".into(),
                    content: "Ünï".into()
                },
                "cut at {a}"
            );
        }
    }
}
