//! How a reply shows while it streams: a harmony model's (gpt-oss's) reasoning apart from its
//! answer, any other model's text as it comes.

use ringllm::text::harmony::ChannelParser;
use std::io::{IsTerminal, Write};

/// Dim and back to normal (SGR 2 and 0).
const DIM: &str = "\x1b[2m";
const NORMAL: &str = "\x1b[0m";

/// Shows a reply as it streams. A harmony reply's reasoning is dimmed on a terminal, and goes
/// to stderr when stdout is not one (so that stdout holds only the answers); a line break
/// parts it from the answer.
pub(super) struct ReplyView {
    parser: Option<ChannelParser>,
    /// stdout is a terminal: reasoning dimmed there.
    terminal: bool,
    /// Reasoning was shown and the answer has not begun.
    reasoning_open: bool,
    /// A harmony reply's answer so far (its final channel).
    answer: String,
}

impl ReplyView {
    pub(super) fn new(harmony: bool) -> ReplyView {
        ReplyView {
            parser: harmony.then(ChannelParser::new),
            terminal: std::io::stdout().is_terminal(),
            reasoning_open: false,
            answer: String::new(),
        }
    }

    /// Shows `text`; `false` when stdout's reader went away.
    pub(super) fn show(&mut self, text: &str) -> bool {
        match self.parser.as_mut() {
            None => crate::out::stream(text),
            Some(p) => {
                let split = p.push(text);
                self.shown(&split.reasoning, &split.content)
            }
        }
    }

    /// The end of the reply: what the parser held, and the terminal back to normal.
    pub(super) fn end(&mut self) -> bool {
        let Some(p) = self.parser.as_mut() else {
            return true;
        };
        let rest = p.finish();
        let ok = self.shown(&rest.reasoning, &rest.content);
        if self.reasoning_open && self.terminal {
            return crate::out::stream(NORMAL) && ok;
        }
        ok
    }

    /// A harmony model's reply as the conversation keeps it: its answer alone (the template
    /// renders earlier replies in the final channel, without their reasoning). `None` for
    /// other models: their reply is the generated text.
    pub(super) fn answer(&self) -> Option<&str> {
        self.parser.is_some().then_some(self.answer.as_str())
    }

    fn shown(&mut self, reasoning: &str, content: &str) -> bool {
        let mut ok = true;
        if !reasoning.is_empty() {
            let opening = !self.reasoning_open;
            self.reasoning_open = true;
            ok &= self.reasoning(if opening && self.terminal { DIM } else { "" }, reasoning);
        }
        if !content.is_empty() {
            if self.reasoning_open {
                self.reasoning_open = false;
                ok &= self.reasoning("", if self.terminal { "\x1b[0m\n" } else { "\n" });
            }
            self.answer.push_str(content);
            ok &= crate::out::stream(content);
        }
        ok
    }

    /// Reasoning text (after `prefix`): on stdout when it is a terminal, else on stderr.
    fn reasoning(&self, prefix: &str, text: &str) -> bool {
        if self.terminal {
            return crate::out::stream(&format!("{prefix}{text}"));
        }
        let mut e = std::io::stderr().lock();
        // A failed write to stderr loses a note, not the answer: the reply goes on.
        let _ = e.write_all(text.as_bytes()).and_then(|()| e.flush());
        true
    }
}
