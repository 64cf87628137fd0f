//! Tokenizers built from GGUF metadata with HF `tokenizers`, following llama.cpp's conventions
//! (llama.cpp is the reference the GGUF files are made for; the tests check our ids against it
//! and against transformers):
//!
//! - `tokenizer.ggml.model = "llama"` (SentencePiece: Llama 2, Gemma 1-3): llama.cpp merges the
//!   adjacent pair whose merged piece has the highest score, over and over. That is a BPE whose
//!   merges are every split of every piece into two pieces, ranked by the merged piece's score;
//!   characters missing from the vocabulary fall back to `<0xNN>` byte tokens. Spaces become `▁`,
//!   and `▁` is put in front of every stretch of text when `add_space_prefix` (default true;
//!   Gemma 3 says false).
//! - `"gpt2"` (byte-level BPE: SmolLM, Llama 3, Qwen 2, ...): the GGUF's merges, after the
//!   pre-tokenizer `tokenizer.ggml.pre` names, from a table of the names llama.cpp knows. A name
//!   not in the table is refused, never guessed.
//! - `"gemma4"`: BPE over `▁`-escaped UTF-8 with the GGUF's merges and byte fallback.
//!
//! Text is split at special tokens before the model sees it, as llama.cpp's partition does:
//! user-defined tokens are matched whole everywhere, control and unknown tokens only in text
//! that may hold them ([`Piece::special`]: a template's markup, a raw prompt; llama.cpp's
//! `parse_special = true`). In plain text ([`Piece::text`]: a chat message) `<|im_start|>` is
//! just characters, and no merge ever yields a control token. Decoding renders control and
//! unknown tokens as nothing unless asked, except harmony's markup (`<|start|>`,
//! `<|channel|>`, `<|message|>`, `<|end|>`, `<|constrain|>`), which always renders as in
//! llama.cpp; llama.cpp also matches it in plain text, where we keep it characters.

mod build;
mod pre;
mod stream;

use ringllm_model::gguf::{GgufError, Metadata};
use std::collections::HashMap;

pub use pre::pre_tokenizer_names;
pub use stream::StreamDecoder;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// `tokenizer.ggml.model` names a model we do not build.
    #[error("unsupported tokenizer model '{0}' (tokenizer.ggml.model; supported: llama (SentencePiece), gpt2 (byte-level BPE), gemma4)")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer not in our table.
    #[error("unknown pre-tokenizer '{name}' (tokenizer.ggml.pre); known: {}", pre_tokenizer_names().join(", "))]
    UnknownPreTokenizer { name: String },
    #[error("tokenizer metadata: {0}")]
    Invalid(String),
    #[error("tokenizer: {0}")]
    Hf(String),
}

/// Token types of `tokenizer.ggml.token_type`.
const TYPE_NORMAL: i32 = 1;
const TYPE_UNKNOWN: i32 = 2;
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;
// 5 is UNUSED: rendered as nothing, like any type we do not know.
const TYPE_BYTE: i32 = 6;

const SPACE_MARK: char = '\u{2581}';

/// Everything the tokenizer needs, read from GGUF metadata.
#[derive(Clone, Debug, Default)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: "llama" (SentencePiece), "gpt2" (byte-level BPE) or "gemma4".
    pub model: String,
    /// `tokenizer.ggml.pre`.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub scores: Option<Vec<f32>>,
    pub token_types: Option<Vec<i32>>,
    pub merges: Option<Vec<String>>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// `tokenizer.ggml.eot_token_id`.
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
    pub chat_template: Option<String>,
    /// Fill-in-the-middle pad, repository and file-separator tokens
    /// (`tokenizer.ggml.fim_{pad,rep,sep}_token_id`): they end generation.
    pub fim_pad: Option<u32>,
    pub fim_rep: Option<u32>,
    pub fim_sep: Option<u32>,
    /// Whitespace right after a special token is dropped (llama.cpp's RSTRIP attribute): set
    /// for Phi-3 files, which llama.cpp recognises by `general.name` (Hugging Face's Phi-3
    /// `tokenizer.json` marks those added tokens `rstrip`), on every control, user-defined
    /// and unknown token and `</s>`, but not `<unk>`, `<s>` and `<|endoftext|>`.
    pub rstrip_specials: bool,
}

impl TokenizerSpec {
    pub fn from_gguf(md: &Metadata) -> Result<TokenizerSpec, TokenizerError> {
        md.require(&["tokenizer.ggml.model", "tokenizer.ggml.tokens"])?;
        Ok(TokenizerSpec {
            model: md.str("tokenizer.ggml.model")?.to_string(),
            pre: md.opt_str("tokenizer.ggml.pre")?.map(str::to_string),
            tokens: md.str_array("tokenizer.ggml.tokens")?.to_vec(),
            scores: md.opt_f32_array("tokenizer.ggml.scores")?,
            token_types: md.opt_i32_array("tokenizer.ggml.token_type")?,
            merges: md
                .opt_str_array("tokenizer.ggml.merges")?
                .map(|m| m.to_vec()),
            bos: md.opt_u32("tokenizer.ggml.bos_token_id")?,
            eos: md.opt_u32("tokenizer.ggml.eos_token_id")?,
            eot: md.opt_u32("tokenizer.ggml.eot_token_id")?,
            eom: md.opt_u32("tokenizer.ggml.eom_token_id")?,
            unk: md.opt_u32("tokenizer.ggml.unknown_token_id")?,
            pad: md.opt_u32("tokenizer.ggml.padding_token_id")?,
            add_bos: md.opt_bool("tokenizer.ggml.add_bos_token")?,
            add_eos: md.opt_bool("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: md.opt_bool("tokenizer.ggml.add_space_prefix")?,
            chat_template: md.opt_str("tokenizer.chat_template")?.map(str::to_string),
            fim_pad: md.opt_u32("tokenizer.ggml.fim_pad_token_id")?,
            fim_rep: md.opt_u32("tokenizer.ggml.fim_rep_token_id")?,
            fim_sep: md.opt_u32("tokenizer.ggml.fim_sep_token_id")?,
            rstrip_specials: md.opt_str("general.name")?.is_some_and(|n| {
                let n = n.to_lowercase();
                n.contains("phi-3") || n.contains("phi3")
            }),
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// SentencePiece: pieces spell spaces `▁`, byte tokens `<0xNN>`.
    Spm,
    /// Byte-level BPE: pieces spell bytes in GPT-2's printable alphabet.
    Bpe,
    /// BPE over `▁`-escaped UTF-8 with byte tokens (Gemma 4).
    BpeSpm,
}

pub struct Tokenizer {
    hf: tokenizers::Tokenizer,
    kind: Kind,
    pieces: Vec<String>,
    /// Token types, with llama.cpp's corrections (end-of-turn texts are control tokens).
    types: Vec<i32>,
    index: HashMap<String, u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eog: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    /// SentencePiece with `add_space_prefix`: decoding a whole text drops the space encoding
    /// put in front.
    strip_prefix_space: bool,
    /// Byte-level BPE: byte of each character of GPT-2's alphabet (indexed by code point).
    byte_of_char: Vec<Option<u8>>,
    /// Control, unknown and user-defined tokens, found in text that may hold special tokens.
    specials: SpecialMatcher,
    /// User-defined tokens only, found in plain text.
    user_defined: SpecialMatcher,
    /// Tokens after which whitespace is dropped (`TokenizerSpec::rstrip_specials`), sorted.
    rstrip: Vec<u32>,
    /// Control tokens that render as their text all the same (harmony's markup), sorted.
    rendered: Vec<u32>,
}

/// A stretch of a prompt, and whether control-token texts in it become control tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece<'a> {
    pub text: &'a str,
    /// `<|im_start|>` in `text` is that control token (a template's markup, a raw prompt the
    /// user asked to have parsed); otherwise it is characters like any others.
    pub special: bool,
}

impl<'a> Piece<'a> {
    /// Text whose special-token texts are the tokens.
    pub fn special(text: &'a str) -> Piece<'a> {
        Piece {
            text,
            special: true,
        }
    }

    /// Plain text: no control token comes out of it.
    pub fn text(text: &'a str) -> Piece<'a> {
        Piece {
            text,
            special: false,
        }
    }
}

/// Finds token texts in a string, leftmost first and the longest at a place (as the
/// `tokenizers` added vocabulary does), bucketed by first two bytes.
#[derive(Default)]
struct SpecialMatcher {
    /// (text, id), by first two bytes of the text (one-byte texts: key `[b, 0]` in `short`),
    /// longest first within a bucket.
    buckets: HashMap<[u8; 2], Vec<(String, u32)>>,
    short: HashMap<u8, u32>,
}

impl SpecialMatcher {
    fn new(tokens: impl Iterator<Item = (String, u32)>) -> SpecialMatcher {
        let mut m = SpecialMatcher::default();
        for (text, id) in tokens {
            match text.as_bytes() {
                [] => {}
                [b] => {
                    m.short.insert(*b, id);
                }
                [a, b, ..] => m.buckets.entry([*a, *b]).or_default().push((text, id)),
            }
        }
        for b in m.buckets.values_mut() {
            b.sort_by(|x, y| y.0.len().cmp(&x.0.len()).then(x.1.cmp(&y.1)));
        }
        m
    }

    /// The first token text in `s` at or after byte `from`: (start, end, id).
    fn find(&self, s: &str, from: usize) -> Option<(usize, usize, u32)> {
        if self.buckets.is_empty() && self.short.is_empty() {
            return None;
        }
        let bytes = s.as_bytes();
        for at in from..bytes.len() {
            if !s.is_char_boundary(at) {
                continue;
            }
            if let Some(key) = bytes.get(at..at + 2) {
                if let Some(cands) = self.buckets.get(&[key[0], key[1]]) {
                    let rest = &s[at..];
                    if let Some((t, id)) = cands.iter().find(|(t, _)| rest.starts_with(t.as_str()))
                    {
                        return Some((at, at + t.len(), *id));
                    }
                }
            }
            if let Some(&id) = self.short.get(&bytes[at]) {
                return Some((at, at + 1, id));
            }
        }
        None
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tokenizer({:?}, {} tokens)",
            self.kind,
            self.pieces.len()
        )
    }
}

fn hf_err(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Hf(e.to_string())
}

/// GPT-2's byte → printable character mapping: printable Latin-1 bytes stand for themselves,
/// the other 68 bytes for U+0100.. in byte order.
fn gpt2_byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let cp = if printable {
            u32::from(b)
        } else {
            next += 1;
            next - 1
        };
        out[usize::from(b)] = char::from_u32(cp).unwrap_or('\0');
    }
    out
}

/// `<0xNN>` → NN.
fn byte_token_value(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl Tokenizer {
    /// Token ids of `text` (special tokens written in the text become their ids), with BOS
    /// first when `add_bos`.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, TokenizerError> {
        self.encode_pieces(&[Piece::special(text)], add_bos)
    }

    /// Token ids of plain `text`: special-token texts in it are characters (llama.cpp's
    /// `parse_special = false`), with BOS first when `add_bos`.
    pub fn encode_text(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, TokenizerError> {
        self.encode_pieces(&[Piece::text(text)], add_bos)
    }

    /// Token ids of a prompt made of pieces, with BOS first when `add_bos`. The text between
    /// two special tokens is tokenized as one stretch whichever pieces it comes from, so
    /// cutting a text into pieces changes nothing but which special tokens are found.
    pub fn encode_pieces(
        &self,
        pieces: &[Piece<'_>],
        add_bos: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        if add_bos {
            if let Some(b) = self.bos {
                ids.push(b);
            }
        }
        let mut stretch = String::new();
        // After a token whose following whitespace is dropped, into the next pieces too (the
        // prompt is one text to llama.cpp).
        let mut strip = false;
        let skip_space = |text: &str, from: usize, strip: &mut bool| -> usize {
            if !*strip {
                return from;
            }
            let rest = &text[from..];
            let kept = rest.trim_start_matches([' ', '\t', '\n', '\x0B', '\x0C', '\r']);
            *strip = kept.is_empty();
            from + rest.len() - kept.len()
        };
        for p in pieces {
            let matcher = if p.special {
                &self.specials
            } else {
                &self.user_defined
            };
            let mut at = skip_space(p.text, 0, &mut strip);
            while let Some((start, end, id)) = matcher.find(p.text, at) {
                stretch.push_str(&p.text[at..start]);
                self.encode_stretch(&mut stretch, &mut ids)?;
                ids.push(id);
                strip = self.rstrip.binary_search(&id).is_ok();
                at = skip_space(p.text, end, &mut strip);
            }
            stretch.push_str(&p.text[at..]);
            if at < p.text.len() {
                strip = false;
            }
        }
        self.encode_stretch(&mut stretch, &mut ids)?;
        Ok(ids)
    }

    /// Appends the ids of text without special tokens, and empties it.
    fn encode_stretch(&self, text: &mut String, ids: &mut Vec<u32>) -> Result<(), TokenizerError> {
        if text.is_empty() {
            return Ok(());
        }
        let enc = self.hf.encode_fast(text.as_str(), false).map_err(hf_err)?;
        ids.extend_from_slice(enc.get_ids());
        text.clear();
        Ok(())
    }

    /// Byte ranges of control-token texts in `text` (what [`Piece::special`] would make
    /// control tokens and [`Piece::text`] keeps as characters).
    pub fn control_spans(&self, text: &str) -> Vec<std::ops::Range<usize>> {
        let mut out = Vec::new();
        let mut at = 0;
        while let Some((start, end, id)) = self.specials.find(text, at) {
            if self.types.get(id as usize) != Some(&TYPE_USER_DEFINED) {
                out.push(start..end);
            }
            at = end;
        }
        out
    }

    /// The name of the vocabulary's kind, as `tokenizer.ggml.model` spells it, with what it is.
    pub fn kind_name(&self) -> &'static str {
        match self.kind {
            Kind::Spm => "llama (SentencePiece)",
            Kind::Bpe => "gpt2 (byte-level BPE)",
            Kind::BpeSpm => "gemma4 (BPE over SentencePiece-style text)",
        }
    }

    /// Whether prompts start with BOS: `tokenizer.ggml.add_bos_token`, else true for
    /// SentencePiece vocabularies and Llama 3-style byte-level ones (as llama.cpp).
    pub fn add_bos_default(&self) -> bool {
        self.add_bos
    }

    /// Whether encoded prompts end with EOS (`tokenizer.ggml.add_eos_token`, default false).
    pub fn add_eos_default(&self) -> bool {
        self.add_eos
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Control and unknown tokens: never made from plain text, and rendered as nothing unless
    /// asked (harmony's markup excepted, see the module).
    pub fn is_control(&self, id: u32) -> bool {
        matches!(
            self.types.get(id as usize),
            Some(&TYPE_CONTROL) | Some(&TYPE_UNKNOWN)
        )
    }

    /// The raw bytes a token stands for; control and unknown tokens stand for nothing.
    pub fn token_piece_bytes(&self, id: u32) -> Vec<u8> {
        self.token_bytes(id, false)
    }

    /// The raw bytes a token stands for; control and unknown tokens are their text when
    /// `render_special`, else nothing.
    pub fn token_bytes(&self, id: u32, render_special: bool) -> Vec<u8> {
        let mut out = Vec::new();
        self.append_token_bytes(id, render_special, &mut out);
        out
    }

    fn append_token_bytes(&self, id: u32, render_special: bool, out: &mut Vec<u8>) {
        let (Some(piece), Some(&ty)) = (self.pieces.get(id as usize), self.types.get(id as usize))
        else {
            return;
        };
        match ty {
            TYPE_CONTROL | TYPE_UNKNOWN
                if render_special || self.rendered.binary_search(&id).is_ok() =>
            {
                out.extend_from_slice(piece.as_bytes())
            }
            TYPE_USER_DEFINED => out.extend_from_slice(piece.as_bytes()),
            TYPE_BYTE => match byte_token_value(piece) {
                Some(b) => out.push(b),
                None => out.extend_from_slice(piece.as_bytes()),
            },
            TYPE_NORMAL => match self.kind {
                Kind::Spm | Kind::BpeSpm => {
                    for c in piece.chars() {
                        let c = if c == SPACE_MARK { ' ' } else { c };
                        let mut buf = [0u8; 4];
                        out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                    }
                }
                Kind::Bpe => {
                    for c in piece.chars() {
                        match self.byte_of_char.get(c as usize).copied().flatten() {
                            Some(b) => out.push(b),
                            None => {
                                let mut buf = [0u8; 4];
                                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                            }
                        }
                    }
                }
            },
            // Control and unknown tokens (unless asked), unused ones (5) and types we do not
            // know render as nothing, as in llama.cpp.
            _ => {}
        }
    }

    /// The text of `ids` as a whole text: invalid UTF-8 becomes U+FFFD, control tokens render as
    /// nothing, and for SentencePiece with `add_space_prefix` the space encoding put in front is
    /// dropped (so `decode(encode(t)) == t`).
    pub fn decode(&self, ids: &[u32]) -> String {
        self.decode_with(ids, false)
    }

    /// [`Tokenizer::decode`], with control tokens as their text when `render_special`.
    pub fn decode_with(&self, ids: &[u32], render_special: bool) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        let mut strip = self.strip_prefix_space;
        for &id in ids {
            let start = bytes.len();
            self.append_token_bytes(id, render_special, &mut bytes);
            if strip && bytes.len() > start {
                if bytes[start] == b' ' {
                    bytes.remove(start);
                }
                strip = false;
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Every end-of-generation id (sorted): EOS, EOT, EOM, fill-in-the-middle pad/repo/separator
    /// and the end-of-turn tokens of known chat formats present in the vocabulary — llama.cpp's
    /// set.
    pub fn eog_ids(&self) -> Vec<u32> {
        self.eog.clone()
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    pub fn id_to_piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    pub fn piece_to_id(&self, s: &str) -> Option<u32> {
        self.index.get(s).copied()
    }
}

#[cfg(test)]
mod tests;
