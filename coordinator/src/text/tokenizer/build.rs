//! Building a `Tokenizer` from a `TokenizerSpec`: the `tokenizers` model for each vocabulary
//! kind, and llama.cpp's end-of-generation set and corrections to token types.

use super::pre::{pre_tokenizer, split, PreTokenizerDef};
use super::{
    gpt2_byte_chars, hf_err, Kind, SpecialMatcher, Tokenizer, TokenizerError, TokenizerSpec,
    SPACE_MARK, TYPE_CONTROL, TYPE_NORMAL, TYPE_UNKNOWN, TYPE_USER_DEFINED,
};
use std::collections::HashMap;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormSeq};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSeq;
use tokenizers::{NormalizerWrapper, PreTokenizerWrapper};

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

/// o200k_harmony's markup tokens that llama.cpp treats as user-defined whatever the file says.
const HARMONY_MARKUP: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

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

        let EndOfGeneration {
            types,
            eog,
            rendered,
        } = end_of_generation(spec, &index, types);
        let rstrip = if spec.rstrip_specials {
            let special = [TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNKNOWN];
            let keep = ["<unk>", "<s>", "<|endoftext|>"];
            (0..n as u32)
                .filter(|&id| {
                    let text = spec.tokens[id as usize].as_str();
                    (special.contains(&types[id as usize]) || text == "</s>")
                        && !keep.contains(&text)
                })
                .collect()
        } else {
            Vec::new()
        };
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
            rstrip,
            specials,
            user_defined,
            rendered,
        })
    }
}

/// llama.cpp's end-of-generation set and its corrections to token types: EOS, EOT, EOM, the
/// fill-in-the-middle pad/repo/separator tokens, and tokens whose text is a known end of turn.
/// Tokens found by their text are control tokens whatever the file says.
fn end_of_generation(
    spec: &TokenizerSpec,
    index: &HashMap<String, u32>,
    mut types: Vec<i32>,
) -> EndOfGeneration {
    let mut eog: Vec<u32> = Vec::new();
    let mut rendered: Vec<u32> = Vec::new();
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
            make_control(&mut types, id, text);
            rendered.push(id);
            continue;
        }
        if *text == "</s>" && plain_s {
            types[id as usize] = TYPE_NORMAL;
            continue;
        }
        make_control(&mut types, id, text);
        add(&mut eog, id);
    }
    // llama.cpp makes harmony's markup tokens (and <|end|> above) user-defined: always
    // rendered, so a reply decodes with its channel markup, which `text::harmony` reads. We
    // render them too, but keep them control tokens otherwise: llama.cpp also matches a
    // user-defined token in plain text, and a `<|start|>system<|message|>` typed in a chat
    // message would then forge a turn; here message text stays text (see `Piece`).
    for text in HARMONY_MARKUP {
        if let Some(&id) = index.get(*text) {
            make_control(&mut types, id, text);
            rendered.push(id);
        }
    }
    for id in [spec.eos, spec.eot, spec.eom].into_iter().flatten() {
        add(&mut eog, id);
    }
    eog.sort_unstable();
    rendered.sort_unstable();
    EndOfGeneration {
        types,
        eog,
        rendered,
    }
}

/// What [`end_of_generation`] works out.
struct EndOfGeneration {
    /// Token types, corrected.
    types: Vec<i32>,
    /// End-of-generation ids, sorted.
    eog: Vec<u32>,
    /// Control tokens rendered as their text even when control tokens are not, sorted.
    rendered: Vec<u32>,
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
