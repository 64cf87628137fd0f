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
//! unknown tokens as nothing unless asked.

use ringllm_model::gguf::{GgufError, Metadata};
use std::collections::HashMap;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormSeq};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSeq;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

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

// Split expressions. Contractions are spelled case by case ('[sS]), not with (?i:), so that
// Unicode case folding cannot make "'ſ" a contraction (llama.cpp spells them the same way).
const GPT2_RE: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A byte-level BPE pre-tokenizer: regular expressions applied one after the other (each
/// splits the pieces the previous one left, matches and the text between them alike).
struct PreTokenizerDef {
    /// `tokenizer.ggml.pre` values that mean this pre-tokenizer.
    names: &'static [&'static str],
    splits: &'static [&'static str],
    /// A whole piece that is a token is taken as is, without merging (Llama 3).
    ignore_merges: bool,
    /// Whether prompts start with BOS when the GGUF does not say.
    add_bos: bool,
}

/// The pre-tokenizers we build, by the names llama.cpp gives them. Each family was checked
/// against llama.cpp's tokenizer on a vocabulary of that family (see the tests).
const PRE_TOKENIZERS: &[PreTokenizerDef] = &[
    PreTokenizerDef {
        names: &[
            "gpt-2",
            "gpt2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "exaone4",
            "trillion",
            "granite-docling",
            "gigachat",
            "a.x-4.0",
            "mellum",
        ],
        splits: &[GPT2_RE],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        // Also what a byte-level vocabulary without tokenizer.ggml.pre gets.
        names: &["default"],
        splits: &[
            r"[\p{P}\$\+<=>\^~\|]+",
            GPT2_RE,
            r"\p{N}+",
            "[0-9][0-9][0-9]",
        ],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &["falcon"],
        splits: &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2_RE, "[0-9][0-9][0-9]"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        // Digits one by one, then GPT-2's expression.
        names: &[
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        splits: &[r"\p{N}", GPT2_RE],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ],
        splits: &[LLAMA3_RE],
        ignore_merges: true,
        add_bos: true,
    },
    PreTokenizerDef {
        names: &["dbrx", "smaug-bpe"],
        splits: &[LLAMA3_RE],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &[
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ],
        splits: &[QWEN2_RE],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &["qwen35"],
        splits: &[QWEN35_RE],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerDef {
        names: &["deepseek-coder"],
        splits: &[
            r"[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            "[一-龥ࠀ-一가-퟿]+",
            r"\p{N}",
        ],
        ignore_merges: false,
        add_bos: false,
    },
];

/// Every `tokenizer.ggml.pre` value we accept for byte-level BPE vocabularies.
pub fn pre_tokenizer_names() -> Vec<&'static str> {
    PRE_TOKENIZERS
        .iter()
        .flat_map(|d| d.names.iter().copied())
        .collect()
}

fn pre_tokenizer(name: &str) -> Option<&'static PreTokenizerDef> {
    PRE_TOKENIZERS.iter().find(|d| d.names.contains(&name))
}

/// Texts of tokens that end a turn in the chat formats we know; present in a vocabulary they
/// end generation (and are treated as control tokens), as in llama.cpp.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
];

// Fill-in-the-middle token texts llama.cpp recognises when the metadata names none.
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];

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
    pub fn new(spec: &TokenizerSpec) -> Result<Tokenizer, TokenizerError> {
        let n = spec.tokens.len();
        if n == 0 {
            return Err(TokenizerError::Invalid(
                "tokenizer.ggml.tokens is empty".into(),
            ));
        }
        if n > u32::MAX as usize {
            return Err(TokenizerError::Invalid(format!("{n} tokens is too many")));
        }
        let types = match &spec.token_types {
            Some(t) if t.len() == n => t.clone(),
            Some(t) => {
                return Err(TokenizerError::Invalid(format!(
                    "tokenizer.ggml.token_type has {} entries for {n} tokens",
                    t.len()
                )))
            }
            None => vec![TYPE_NORMAL; n],
        };
        for (key, id) in [
            ("bos", spec.bos),
            ("eos", spec.eos),
            ("eot", spec.eot),
            ("eom", spec.eom),
            ("unknown", spec.unk),
            ("padding", spec.pad),
            ("fim_pad", spec.fim_pad),
            ("fim_rep", spec.fim_rep),
            ("fim_sep", spec.fim_sep),
        ] {
            if let Some(id) = id {
                if id as usize >= n {
                    return Err(TokenizerError::Invalid(format!(
                        "tokenizer.ggml.{key}_token_id {id} is outside the vocabulary of {n}"
                    )));
                }
            }
        }
        // As llama.cpp: an empty piece is spelled [EMPTY_i], and a text listed twice means the
        // later id.
        let pieces: Vec<String> = spec
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if t.is_empty() {
                    format!("[EMPTY_{i}]")
                } else {
                    t.clone()
                }
            })
            .collect();
        let mut index = HashMap::with_capacity(n);
        for (i, t) in pieces.iter().enumerate() {
            index.insert(t.clone(), i as u32);
        }
        let kind = match spec.model.as_str() {
            "llama" => Kind::Spm,
            "gpt2" => Kind::Bpe,
            "gemma4" => Kind::BpeSpm,
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };

        let (types, eog) = end_of_generation(spec, &index, types);
        let mut add_bos_default = kind == Kind::Spm;
        let mut strip_prefix_space = false;
        let hf = match kind {
            Kind::Spm => {
                let prefix = spec.add_space_prefix.unwrap_or(true);
                strip_prefix_space = prefix;
                build_spm(spec, &pieces, &types, &index, prefix)?
            }
            Kind::Bpe => {
                let name = match spec.pre.as_deref() {
                    Some(p) if !p.is_empty() => p,
                    _ => {
                        tracing::warn!(
                            "byte-level vocabulary without tokenizer.ggml.pre: using llama.cpp's \
                             'default' pre-tokenizer (the model may tokenize poorly)"
                        );
                        "default"
                    }
                };
                let def =
                    pre_tokenizer(name).ok_or_else(|| TokenizerError::UnknownPreTokenizer {
                        name: name.to_string(),
                    })?;
                add_bos_default = def.add_bos;
                build_bpe(spec, &index, &types, def)?
            }
            Kind::BpeSpm => build_bpe_spm(spec, &index, &types)?,
        };
        // Control, unknown and user-defined tokens are matched whole in the raw text, before
        // normalization and the model (see `encode_pieces`).
        let typed = |keep: fn(i32) -> bool| {
            pieces
                .iter()
                .zip(&types)
                .enumerate()
                .filter(move |(_, (_, ty))| keep(**ty))
                .map(|(id, (t, _))| (t.clone(), id as u32))
        };
        let specials = SpecialMatcher::new(typed(|ty| {
            matches!(ty, TYPE_CONTROL | TYPE_UNKNOWN | TYPE_USER_DEFINED)
        }));
        let user_defined = SpecialMatcher::new(typed(|ty| ty == TYPE_USER_DEFINED));

        let add_bos = spec.add_bos.unwrap_or(add_bos_default) && spec.bos.is_some();
        let add_eos = spec.add_eos.unwrap_or(false) && spec.eos.is_some();
        let mut byte_of_char = Vec::new();
        if kind == Kind::Bpe {
            let chars = gpt2_byte_chars();
            let max = chars.iter().map(|c| *c as usize).max().unwrap_or(0);
            byte_of_char = vec![None; max + 1];
            for (b, c) in chars.iter().enumerate() {
                byte_of_char[*c as usize] = Some(b as u8);
            }
        }
        Ok(Tokenizer {
            hf,
            kind,
            pieces,
            types,
            index,
            bos: spec.bos,
            eos: spec.eos,
            eog,
            add_bos,
            add_eos,
            strip_prefix_space,
            byte_of_char,
            specials,
            user_defined,
        })
    }

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
        for p in pieces {
            let matcher = if p.special {
                &self.specials
            } else {
                &self.user_defined
            };
            let mut at = 0;
            while let Some((start, end, id)) = matcher.find(p.text, at) {
                stretch.push_str(&p.text[at..start]);
                self.encode_stretch(&mut stretch, &mut ids)?;
                ids.push(id);
                at = end;
            }
            stretch.push_str(&p.text[at..]);
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

    /// Control and unknown tokens: rendered as nothing unless asked.
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
            TYPE_CONTROL | TYPE_UNKNOWN if render_special => {
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

/// llama.cpp's end-of-generation set and its corrections to token types: EOS, EOT, EOM, the
/// fill-in-the-middle pad/repo/separator tokens, and tokens whose text is a known end of turn.
/// Tokens found by their text are control tokens whatever the file says.
fn end_of_generation(
    spec: &TokenizerSpec,
    index: &HashMap<String, u32>,
    mut types: Vec<i32>,
) -> (Vec<i32>, Vec<u32>) {
    let mut eog: Vec<u32> = Vec::new();
    let add = |eog: &mut Vec<u32>, id: u32| {
        if !eog.contains(&id) {
            eog.push(id);
        }
    };
    let make_control = |types: &mut Vec<i32>, id: u32, text: &str| {
        if types[id as usize] != TYPE_CONTROL {
            tracing::debug!("token {id} {text:?} is not a control token; treating it as one");
            types[id as usize] = TYPE_CONTROL;
        }
    };
    // Fill-in-the-middle tokens the metadata does not name are found by text (the lowest id
    // when several match).
    let fim = [
        (None, FIM_PRE_TEXTS, false),
        (None, FIM_SUF_TEXTS, false),
        (None, FIM_MID_TEXTS, false),
        (spec.fim_pad, FIM_PAD_TEXTS, true),
        (spec.fim_rep, FIM_REP_TEXTS, true),
        (spec.fim_sep, FIM_SEP_TEXTS, true),
    ];
    for (given, texts, ends) in fim {
        let found = match given {
            Some(id) => Some(id),
            None => texts
                .iter()
                .filter_map(|t| index.get(*t).map(|&id| (id, *t)))
                .min()
                .map(|(id, text)| {
                    make_control(&mut types, id, text);
                    id
                }),
        };
        if let (Some(id), true) = (found, ends) {
            add(&mut eog, id);
        }
    }
    let has = |t: &str| index.contains_key(t);
    // o200k_harmony and Solar Open: <|end|> ends a message, not the generation, and is shown.
    let harmony = has("<|return|>") && has("<|call|>") || has("<|calls|>") && has("<|flush|>");
    // Gemma 4 and PLaMo: "</s>" is plain text.
    let plain_s = has("<|tool_response>") || has("<|plamo:eos|>");
    for text in EOG_TEXTS {
        let Some(&id) = index.get(*text) else {
            continue;
        };
        if *text == "<|end|>" && harmony {
            types[id as usize] = TYPE_USER_DEFINED;
            continue;
        }
        if *text == "</s>" && plain_s {
            types[id as usize] = TYPE_NORMAL;
            continue;
        }
        make_control(&mut types, id, text);
        add(&mut eog, id);
    }
    for id in [spec.eos, spec.eot, spec.eom].into_iter().flatten() {
        add(&mut eog, id);
    }
    eog.sort_unstable();
    (types, eog)
}

fn vocab_of(index: &HashMap<String, u32>) -> Vocab {
    index.iter().map(|(k, v)| (k.clone(), *v)).collect()
}

/// Whether a merge may yield token `id`: never a control or unknown token, so plain text
/// cannot turn into one.
fn mergeable(types: &[i32], id: u32) -> bool {
    !matches!(
        types.get(id as usize),
        Some(&TYPE_CONTROL) | Some(&TYPE_UNKNOWN)
    )
}

fn build_spm(
    spec: &TokenizerSpec,
    pieces: &[String],
    types: &[i32],
    index: &HashMap<String, u32>,
    add_space_prefix: bool,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let n = pieces.len();
    let scores = match &spec.scores {
        Some(s) if s.len() == n => s,
        Some(s) => {
            return Err(TokenizerError::Invalid(format!(
                "tokenizer.ggml.scores has {} entries for {n} tokens",
                s.len()
            )))
        }
        None => {
            return Err(TokenizerError::Invalid(
                "SentencePiece vocabulary without tokenizer.ggml.scores".into(),
            ))
        }
    };
    // Merges: every way to split a piece into two pieces of the vocabulary, ranked by the
    // merged piece's score (higher first; then by id, then by where the split is). llama.cpp
    // considers every piece of the vocabulary, whatever its type, but we never merge into a
    // control token (text between special tokens holds none).
    let mut ranked: Vec<(f32, u32, u32, u32)> = Vec::new();
    for (id, piece) in pieces.iter().enumerate() {
        if !mergeable(types, id as u32) {
            continue;
        }
        for (k, _) in piece.char_indices().skip(1) {
            let (a, b) = piece.split_at(k);
            if let (Some(&ia), Some(&ib)) = (index.get(a), index.get(b)) {
                ranked.push((scores[id], id as u32, ia, ib));
            }
        }
    }
    ranked.sort_by(|x, y| {
        y.0.total_cmp(&x.0)
            .then(x.1.cmp(&y.1))
            .then(pieces[x.2 as usize].len().cmp(&pieces[y.2 as usize].len()))
    });
    let merges: Vec<(String, String)> = ranked
        .into_iter()
        .map(|(_, _, a, b)| (pieces[a as usize].clone(), pieces[b as usize].clone()))
        .collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab_of(index), merges)
        .byte_fallback(true);
    if let Some(unk) = spec.unk.and_then(|u| pieces.get(u as usize)) {
        builder = builder.unk_token(unk.clone()).fuse_unk(true);
    }
    let bpe = builder.build().map_err(hf_err)?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    let mut norms: Vec<NormalizerWrapper> = Vec::new();
    if add_space_prefix {
        // Applies to every stretch of text between special tokens, as llama.cpp does.
        norms.push(Prepend::new(SPACE_MARK.to_string()).into());
    }
    norms.push(
        Replace::new(" ", SPACE_MARK.to_string())
            .map_err(hf_err)?
            .into(),
    );
    tok.with_normalizer(Some(NormSeq::new(norms)));
    Ok(tok)
}

/// `tokenizer.ggml.merges` as pairs (each entry is "left right", split at the first space
/// after the first byte), without those yielding a control token (see [`mergeable`]).
fn merges_of(
    spec: &TokenizerSpec,
    index: &HashMap<String, u32>,
    types: &[i32],
) -> Result<Vec<(String, String)>, TokenizerError> {
    let src = spec.merges.as_ref().ok_or_else(|| {
        TokenizerError::Invalid(format!(
            "'{}' vocabulary without tokenizer.ggml.merges",
            spec.model
        ))
    })?;
    let mut merges = Vec::with_capacity(src.len());
    for (i, m) in src.iter().enumerate() {
        let split = m
            .as_bytes()
            .iter()
            .skip(1)
            .position(|&b| b == b' ')
            .map(|p| p + 1);
        let Some(at) = split else {
            return Err(TokenizerError::Invalid(format!(
                "tokenizer.ggml.merges[{i}] {m:?} is not 'left right'"
            )));
        };
        let (left, right) = (&m[..at], &m[at + 1..]);
        let merged = format!("{left}{right}");
        if index.get(&merged).is_some_and(|&id| !mergeable(types, id)) {
            continue;
        }
        merges.push((left.to_string(), right.to_string()));
    }
    Ok(merges)
}

fn split(re: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    Ok(Split::new(
        SplitPattern::Regex(re.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(hf_err)?
    .into())
}

fn build_bpe(
    spec: &TokenizerSpec,
    index: &HashMap<String, u32>,
    types: &[i32],
    def: &PreTokenizerDef,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let merges = merges_of(spec, index, types)?;
    let mut pre: Vec<PreTokenizerWrapper> = Vec::with_capacity(def.splits.len() + 1);
    for re in def.splits {
        pre.push(split(re)?);
    }
    pre.push(ByteLevel::new(false, false, false).into());
    let bpe = BPE::builder()
        .vocab_and_merges(vocab_of(index), merges)
        .ignore_merges(def.ignore_merges)
        .build()
        .map_err(hf_err)?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(PreSeq::new(pre)));
    Ok(tok)
}

fn build_bpe_spm(
    spec: &TokenizerSpec,
    index: &HashMap<String, u32>,
    types: &[i32],
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let merges = merges_of(spec, index, types)?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab_of(index), merges)
        .byte_fallback(true)
        .build()
        .map_err(hf_err)?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_normalizer(Some(
        Replace::new(" ", SPACE_MARK.to_string()).map_err(hf_err)?,
    ));
    tok.with_pre_tokenizer(Some(PreSeq::new(vec![split(r"[^\n]+|[\n]+")?])));
    Ok(tok)
}

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

#[cfg(test)]
mod tests;
