//! Streaming decode: token ids to text without splitting a UTF-8 character.

use super::Tokenizer;

/// Turns a stream of token ids into text, never splitting a UTF-8 character: bytes of an
/// incomplete character wait for the next token, and invalid bytes become U+FFFD exactly as
/// [`Tokenizer::decode`] makes them, so the chunks concatenate to the decoded text.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    /// Drop the space SentencePiece's `add_space_prefix` put in front of the first piece.
    strip_prefix_space: bool,
    render_special: bool,
}

impl StreamDecoder {
    /// A decoder for tokens that continue a text (generated after a prompt): every piece is
    /// kept whole. Concatenated, its chunks equal `decode` of the ids except that a leading
    /// prefix space is kept.
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// A decoder for tokens that start a text: its chunks concatenate to exactly
    /// [`Tokenizer::decode`] of the ids.
    pub fn at_text_start() -> StreamDecoder {
        StreamDecoder {
            strip_prefix_space: true,
            ..StreamDecoder::default()
        }
    }

    /// Render control tokens as their text (as [`Tokenizer::decode_with`] with true).
    pub fn render_special(mut self, yes: bool) -> StreamDecoder {
        self.render_special = yes;
        self
    }

    /// Text completed by token `id` of `tok` (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        let mut out = String::new();
        self.push_into(tok, id, &mut out);
        out
    }

    /// [`StreamDecoder::push`], appending to `out` (no allocation once `out` has room).
    pub fn push_into(&mut self, tok: &Tokenizer, id: u32, out: &mut String) {
        let start = self.pending.len();
        tok.append_token_bytes(id, self.render_special, &mut self.pending);
        if self.strip_prefix_space && self.pending.len() > start {
            if tok.strip_prefix_space && self.pending[start] == b' ' {
                self.pending.remove(start);
            }
            self.strip_prefix_space = false;
        }
        let mut done = 0;
        loop {
            match std::str::from_utf8(&self.pending[done..]) {
                Ok(s) => {
                    out.push_str(s);
                    done = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = done + e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[done..valid]).unwrap_or(""));
                    match e.error_len() {
                        // Invalid bytes: U+FFFD now, as from_utf8_lossy does.
                        Some(len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            done = valid + len;
                        }
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            done = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..done);
    }

    /// Whatever is left (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}
