//! Tokenizers built from GGUF metadata with HF `tokenizers`: SentencePiece-style vocabularies
//! (`tokenizer.ggml.model = "llama"`: scores + byte fallback, as Gemma and Llama 2) become a
//! BPE whose merges are ranked by the merged piece's score — the greedy highest-score bigram
//! merge llama.cpp performs — and byte-level BPE vocabularies (`gpt2`) get the pre-tokenizer
//! their `tokenizer.ggml.pre` names, from a table of known ones. An unknown pre-tokenizer is
//! refused by name.

use ringllm_node::gguf::{GgufError, Metadata};
use std::collections::HashMap;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormSeq};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSeq;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// `tokenizer.ggml.model` names a model we do not build.
    #[error("unsupported tokenizer model '{0}' (supported: llama (SentencePiece), gpt2 (byte-level BPE))")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer not in our table.
    #[error("unknown pre-tokenizer '{name}' (known: {})", KNOWN_PRE.join(", "))]
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
const TYPE_UNUSED: i32 = 5;
const TYPE_BYTE: i32 = 6;

const GPT2_RE: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3_RE: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_RE: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const KNOWN_PRE: &[&str] = &[
    "gpt2",
    "smollm",
    "starcoder",
    "llama3",
    "llama-bpe",
    "qwen2",
];

/// Texts of control tokens that end a turn in the chat formats we know.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end|>",
    "<|eom_id|>",
    "</s>",
];

/// Everything the tokenizer needs, read from GGUF metadata.
#[derive(Clone, Debug, Default)]
pub struct TokenizerSpec {
    pub model: String,
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub scores: Option<Vec<f32>>,
    pub token_types: Option<Vec<i32>>,
    pub merges: Option<Vec<String>>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
    pub chat_template: Option<String>,
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
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Spm,
    Bpe,
}

pub struct Tokenizer {
    hf: tokenizers::Tokenizer,
    kind: Kind,
    spec_tokens: Vec<String>,
    types: Vec<i32>,
    index: HashMap<String, u32>,
    bos: Option<u32>,
    eog: Vec<u32>,
    add_bos: bool,
    /// Byte-level BPE: unicode char → byte.
    byte_decoder: HashMap<char, u8>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tokenizer({:?}, {} tokens)",
            self.kind,
            self.spec_tokens.len()
        )
    }
}

fn hf_err(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Hf(e.to_string())
}

/// GPT-2's byte → printable unicode mapping.
fn bytes_to_unicode() -> Vec<(u8, char)> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    bs.into_iter()
        .zip(cs)
        .filter_map(|(b, c)| char::from_u32(c).map(|c| (b as u8, c)))
        .collect()
}

impl Tokenizer {
    pub fn new(spec: &TokenizerSpec) -> Result<Tokenizer, TokenizerError> {
        let n = spec.tokens.len();
        if n == 0 {
            return Err(TokenizerError::Invalid(
                "tokenizer.ggml.tokens is empty".into(),
            ));
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
            ("unknown", spec.unk),
        ] {
            if let Some(id) = id {
                if id as usize >= n {
                    return Err(TokenizerError::Invalid(format!(
                        "tokenizer.ggml.{key}_token_id {id} is outside the vocabulary of {n}"
                    )));
                }
            }
        }
        let mut index = HashMap::with_capacity(n);
        for (i, t) in spec.tokens.iter().enumerate() {
            index.entry(t.clone()).or_insert(i as u32);
        }
        let kind = match spec.model.as_str() {
            "llama" => Kind::Spm,
            "gpt2" => Kind::Bpe,
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };
        let mut hf = match kind {
            Kind::Spm => build_spm(spec, &types, &index)?,
            Kind::Bpe => build_bpe(spec, &index)?,
        };
        // Control and user-defined tokens are matched whole in the text (llama.cpp's
        // parse_special), before the model sees it.
        let added: Vec<AddedToken> = spec
            .tokens
            .iter()
            .zip(&types)
            .filter(|(t, ty)| (**ty == TYPE_CONTROL || **ty == TYPE_USER_DEFINED) && !t.is_empty())
            .map(|(t, ty)| {
                let mut a = AddedToken::from(t.clone(), *ty == TYPE_CONTROL);
                a.normalized = false;
                a
            })
            .collect();
        hf.add_special_tokens(&added);
        let mut eog: Vec<u32> = [spec.eos, spec.eot, spec.eom]
            .into_iter()
            .flatten()
            .collect();
        for text in EOG_TEXTS {
            if let Some(&id) = index.get(*text) {
                if types[id as usize] == TYPE_CONTROL && !eog.contains(&id) {
                    eog.push(id);
                }
            }
        }
        let add_bos = spec.add_bos.unwrap_or(kind == Kind::Spm) && spec.bos.is_some();
        Ok(Tokenizer {
            hf,
            kind,
            spec_tokens: spec.tokens.clone(),
            types,
            index,
            bos: spec.bos,
            eog,
            add_bos,
            byte_decoder: bytes_to_unicode()
                .into_iter()
                .map(|(b, c)| (c, b))
                .collect(),
        })
    }

    /// Token ids of `text` (special tokens in the text become their ids), with BOS first when
    /// `add_bos`.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, TokenizerError> {
        let enc = self.hf.encode_fast(text, false).map_err(hf_err)?;
        let mut ids = Vec::with_capacity(enc.get_ids().len() + 1);
        if add_bos {
            if let Some(b) = self.bos {
                ids.push(b);
            }
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Whether prompts start with BOS (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos_default(&self) -> bool {
        self.add_bos
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The raw bytes a token stands for; control tokens stand for nothing.
    pub fn token_piece_bytes(&self, id: u32) -> Vec<u8> {
        let Some(piece) = self.spec_tokens.get(id as usize) else {
            return Vec::new();
        };
        let ty = self.types[id as usize];
        if ty == TYPE_CONTROL || ty == TYPE_UNUSED || ty == TYPE_UNKNOWN && self.kind == Kind::Spm {
            return Vec::new();
        }
        match self.kind {
            Kind::Spm => {
                if ty == TYPE_BYTE {
                    if let Some(b) = piece
                        .strip_prefix("<0x")
                        .and_then(|s| s.strip_suffix('>'))
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                    {
                        return vec![b];
                    }
                }
                piece.replace('\u{2581}', " ").into_bytes()
            }
            Kind::Bpe => {
                if ty == TYPE_USER_DEFINED {
                    return piece.as_bytes().to_vec();
                }
                piece
                    .chars()
                    .map(|c| self.byte_decoder.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or_else(|| piece.as_bytes().to_vec())
            }
        }
    }

    /// The text of `ids` (invalid UTF-8 becomes U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| self.token_piece_bytes(id))
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Every end-of-generation id.
    pub fn eog_ids(&self) -> Vec<u32> {
        self.eog.clone()
    }

    pub fn vocab_size(&self) -> usize {
        self.spec_tokens.len()
    }

    pub fn id_to_piece(&self, id: u32) -> Option<&str> {
        self.spec_tokens.get(id as usize).map(String::as_str)
    }

    pub fn piece_to_id(&self, s: &str) -> Option<u32> {
        self.index.get(s).copied()
    }
}

fn build_spm(
    spec: &TokenizerSpec,
    types: &[i32],
    index: &HashMap<String, u32>,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let n = spec.tokens.len();
    let scores = match &spec.scores {
        Some(s) if s.len() == n => s.clone(),
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
    // Merges: every way to split a normal piece into two pieces of the vocabulary, ranked by
    // the merged piece's score (higher first; ties by id, as the vocabulary is ordered).
    let mergeable = |id: u32| {
        let t = types[id as usize];
        t == TYPE_NORMAL || t == TYPE_USER_DEFINED || t == TYPE_UNKNOWN
    };
    let mut merges: Vec<(f32, u32, usize, String, String)> = Vec::new();
    for (id, piece) in spec.tokens.iter().enumerate() {
        if !mergeable(id as u32) {
            continue;
        }
        for (k, _) in piece.char_indices().skip(1) {
            let (a, b) = piece.split_at(k);
            if let (Some(&ia), Some(&ib)) = (index.get(a), index.get(b)) {
                if mergeable(ia) && mergeable(ib) {
                    merges.push((scores[id], id as u32, k, a.to_string(), b.to_string()));
                }
            }
        }
    }
    merges.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
    let merges: Vec<(String, String)> = merges.into_iter().map(|m| (m.3, m.4)).collect();
    let vocab: Vocab = index.iter().map(|(k, v)| (k.clone(), *v)).collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true);
    if let Some(unk) = spec.unk.and_then(|u| spec.tokens.get(u as usize)) {
        builder = builder.unk_token(unk.clone()).fuse_unk(true);
    }
    let bpe = builder.build().map_err(hf_err)?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    let mut norms: Vec<NormalizerWrapper> = Vec::new();
    if spec.add_space_prefix.unwrap_or(true) {
        norms.push(Prepend::new("\u{2581}".into()).into());
    }
    norms.push(Replace::new(" ", "\u{2581}").map_err(hf_err)?.into());
    tok.with_normalizer(Some(NormSeq::new(norms)));
    Ok(tok)
}

fn build_bpe(
    spec: &TokenizerSpec,
    index: &HashMap<String, u32>,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let merges_src = spec.merges.as_ref().ok_or_else(|| {
        TokenizerError::Invalid("byte-level BPE vocabulary without tokenizer.ggml.merges".into())
    })?;
    let mut merges = Vec::with_capacity(merges_src.len());
    for (i, m) in merges_src.iter().enumerate() {
        let (a, b) = m.split_once(' ').ok_or_else(|| {
            TokenizerError::Invalid(format!("tokenizer.ggml.merges[{i}] '{m}' is not 'a b'"))
        })?;
        merges.push((a.to_string(), b.to_string()));
    }
    let pre = spec.pre.clone().unwrap_or_else(|| "gpt2".into());
    let split = |re: &str| -> Result<PreTokenizerWrapper, TokenizerError> {
        Ok(Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(hf_err)?
        .into())
    };
    let pre_tok: Vec<PreTokenizerWrapper> = match pre.as_str() {
        "gpt2" => vec![ByteLevel::new(false, false, true).into()],
        "smollm" | "starcoder" => vec![split(r"\p{N}")?, ByteLevel::new(false, false, true).into()],
        "llama3" | "llama-bpe" => vec![
            split(LLAMA3_RE)?,
            ByteLevel::new(false, false, false).into(),
        ],
        "qwen2" => vec![split(QWEN2_RE)?, ByteLevel::new(false, false, false).into()],
        _ => return Err(TokenizerError::UnknownPreTokenizer { name: pre }),
    };
    let _ = GPT2_RE; // the regex ByteLevel applies itself with use_regex = true
    let bpe = BPE::builder()
        .vocab_and_merges(
            index
                .iter()
                .map(|(k, v)| (k.clone(), *v))
                .collect::<Vocab>(),
            merges,
        )
        .ignore_merges(pre == "llama3" || pre == "llama-bpe")
        .build()
        .map_err(hf_err)?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(PreSeq::new(pre_tok)));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(tok)
}

/// Turns a stream of token ids into text, never splitting a UTF-8 character: bytes of an
/// incomplete character wait for the next token.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Text completed by token `id` of `tok` (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.pending.extend(tok.token_piece_bytes(id));
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) => match e.error_len() {
                // Invalid bytes (not just incomplete): emit them as U+FFFD now.
                Some(_) => {
                    let s = String::from_utf8_lossy(&self.pending).into_owned();
                    self.pending.clear();
                    return s;
                }
                None => e.valid_up_to(),
            },
        };
        let out: Vec<u8> = self.pending.drain(..valid).collect();
        String::from_utf8(out).unwrap_or_default()
    }

    /// Whatever is left (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}
