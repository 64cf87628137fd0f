//! Generated tokenizers of any vocabulary size for the real-size shapes: byte-level BPE
//! (`gpt2`, with Llama 3's or Qwen 2's pre-tokenizer) or SentencePiece with byte fallback.
//!
//! The BPE vocabulary is GPT-2's 256 byte characters, then merges that spell common English
//! words letter by letter (with and without a leading space), then every letter string
//! breadth-first (`Ġa`..`Ġz`, `a`..`z`, then each of those with one more letter...) until the
//! vocabulary is full; every merge joins two tokens already present, so each added token is
//! reachable and every text encodes (bytes at worst) and decodes back.

use super::shape::VocabKind;
use super::{vocabulary, SUFFIXES, WORDS};
use crate::gguf::{Array, GgufWriter, Value};
use std::collections::HashSet;

pub(crate) const TOKEN_TYPE_NORMAL: i32 = 1;
const TOKEN_TYPE_UNKNOWN: i32 = 2;
pub(crate) const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_UNUSED: i32 = 5;

/// GPT-2's byte → printable character mapping: printable Latin-1 bytes stand for themselves,
/// the other 68 bytes for U+0100.. in byte order.
pub(crate) fn byte_chars() -> [char; 256] {
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

/// `n` BPE tokens (the 256 bytes first) and the merges that build tokens 256.., in rank order.
pub(crate) fn bpe_vocabulary(n: usize) -> (Vec<String>, Vec<String>) {
    bpe_vocabulary_with(n, &[])
}

/// [`bpe_vocabulary`] whose first merges spell each of `first` (any UTF-8, byte by byte from
/// the left), so a tokenizer test can tell where a pre-tokenizer cuts: a piece that spans a
/// cut can never be one token.
pub(crate) fn bpe_vocabulary_with(n: usize, first: &[&str]) -> (Vec<String>, Vec<String>) {
    let chars = byte_chars();
    let space = chars[usize::from(b' ')].to_string();
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let mut seen: HashSet<String> = tokens.iter().cloned().collect();
    let mut merges = Vec::with_capacity(n.saturating_sub(256));
    let mut add = |left: &str, right: &str, tokens: &mut Vec<String>| {
        if tokens.len() >= n {
            return;
        }
        let joined = format!("{left}{right}");
        if seen.insert(joined.clone()) {
            tokens.push(joined);
            merges.push(format!("{left} {right}"));
        }
    };
    for w in first {
        let mut cur = String::new();
        for (i, b) in w.bytes().enumerate() {
            let c = chars[usize::from(b)].to_string();
            if i > 0 {
                add(&cur, &c, &mut tokens);
            }
            cur.push_str(&c);
        }
    }
    // Words, letter by letter: "Ġ t", "Ġt h", "Ġth e"...
    for w in WORDS.iter().chain(SUFFIXES) {
        for prefix in [space.as_str(), ""] {
            let mut cur = String::new();
            for (i, c) in w.chars().enumerate() {
                let c = c.to_string();
                if i == 0 && prefix.is_empty() {
                    cur = c;
                    continue;
                }
                let left = if i == 0 { prefix.to_string() } else { cur };
                add(&left, &c, &mut tokens);
                cur = format!("{left}{c}");
            }
        }
    }
    // Then letter strings breadth-first.
    let letters: Vec<String> = ('a'..='z').map(String::from).collect();
    let mut level: Vec<String> = std::iter::once(space.clone())
        .chain(letters.iter().cloned())
        .collect();
    while tokens.len() < n {
        let mut next = Vec::with_capacity(level.len() * letters.len());
        for t in &level {
            for c in &letters {
                add(t, c, &mut tokens);
                next.push(format!("{t}{c}"));
            }
            if tokens.len() >= n {
                break;
            }
        }
        level = next;
    }
    (tokens, merges)
}

/// Llama 3.1's special tokens, in id order from `<|begin_of_text|>`.
fn llama3_special(i: u32) -> String {
    match i {
        0 => "<|begin_of_text|>".into(),
        1 => "<|end_of_text|>".into(),
        4 => "<|finetune_right_pad_id|>".into(),
        6 => "<|start_header_id|>".into(),
        7 => "<|end_header_id|>".into(),
        8 => "<|eom_id|>".into(),
        9 => "<|eot_id|>".into(),
        10 => "<|python_tag|>".into(),
        2 | 3 => format!("<|reserved_special_token_{}|>", i - 2),
        5 => "<|reserved_special_token_2|>".into(),
        _ => format!("<|reserved_special_token_{}|>", i - 8),
    }
}

/// Adds the tokenizer of `kind` with `vocab` tokens to `w`.
pub fn add_tokenizer(w: &mut GgufWriter, kind: VocabKind, vocab: u32) {
    let n = vocab as usize;
    match kind {
        VocabKind::Spm => {
            let v = vocabulary(n);
            w.add("tokenizer.ggml.model", Value::Str("llama".into()));
            w.add(
                "tokenizer.ggml.tokens",
                Value::Array(Array::Str(v.iter().map(|t| t.0.clone()).collect())),
            );
            w.add(
                "tokenizer.ggml.scores",
                Value::Array(Array::F32(v.iter().map(|t| t.1).collect())),
            );
            w.add(
                "tokenizer.ggml.token_type",
                Value::Array(Array::I32(v.iter().map(|t| t.2).collect())),
            );
            w.add("tokenizer.ggml.bos_token_id", Value::U32(1));
            w.add("tokenizer.ggml.eos_token_id", Value::U32(2));
            w.add("tokenizer.ggml.unknown_token_id", Value::U32(0));
            w.add("tokenizer.ggml.add_bos_token", Value::Bool(true));
            w.add("tokenizer.ggml.add_eos_token", Value::Bool(false));
            w.add("tokenizer.ggml.add_space_prefix", Value::Bool(false));
        }
        VocabKind::Qwen3 => add_qwen3(w, vocab),
        VocabKind::Gemma => add_gemma(w, vocab),
        VocabKind::Tekken => add_tekken(w, vocab),
        VocabKind::Harmony => super::harmony::add_tokenizer(w, vocab),
        VocabKind::Llama3 | VocabKind::Qwen2 => {
            let regular = vocab - kind.tail();
            let (mut tokens, merges) = bpe_vocabulary(regular as usize);
            let mut types = vec![TOKEN_TYPE_NORMAL; tokens.len()];
            let (pre, bos, eos, add_bos) = match kind {
                VocabKind::Llama3 => {
                    for i in 0..kind.tail() {
                        tokens.push(llama3_special(i));
                        types.push(TOKEN_TYPE_CONTROL);
                    }
                    // Base model: end of text ends generation; <|eot_id|> as in Llama 3.1.
                    w.add("tokenizer.ggml.eot_token_id", Value::U32(regular + 9));
                    ("llama-bpe", regular, regular + 1, true)
                }
                _ => {
                    for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] {
                        tokens.push(t.to_string());
                        types.push(TOKEN_TYPE_CONTROL);
                    }
                    while tokens.len() < n {
                        tokens.push(format!("[PAD{}]", tokens.len()));
                        types.push(TOKEN_TYPE_UNUSED);
                    }
                    w.add("tokenizer.ggml.padding_token_id", Value::U32(regular));
                    ("qwen2", regular, regular + 2, false)
                }
            };
            w.add("tokenizer.ggml.model", Value::Str("gpt2".into()));
            w.add("tokenizer.ggml.pre", Value::Str(pre.into()));
            w.add("tokenizer.ggml.tokens", Value::Array(Array::Str(tokens)));
            w.add("tokenizer.ggml.token_type", Value::Array(Array::I32(types)));
            w.add("tokenizer.ggml.merges", Value::Array(Array::Str(merges)));
            w.add("tokenizer.ggml.bos_token_id", Value::U32(bos));
            w.add("tokenizer.ggml.eos_token_id", Value::U32(eos));
            w.add("tokenizer.ggml.add_bos_token", Value::Bool(add_bos));
        }
    }
}

/// Qwen3's added tokens in id order from `<|endoftext|>` (151643 in the real vocabulary), and
/// whether each is a control token (`special` in its tokenizer_config.json; the others are
/// user-defined: matched whole in any text).
pub(crate) const QWEN3_ADDED: &[(&str, bool)] = &[
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<|object_ref_start|>", true),
    ("<|object_ref_end|>", true),
    ("<|box_start|>", true),
    ("<|box_end|>", true),
    ("<|quad_start|>", true),
    ("<|quad_end|>", true),
    ("<|vision_start|>", true),
    ("<|vision_end|>", true),
    ("<|vision_pad|>", true),
    ("<|image_pad|>", true),
    ("<|video_pad|>", true),
    ("<tool_call>", false),
    ("</tool_call>", false),
    ("<|fim_prefix|>", false),
    ("<|fim_middle|>", false),
    ("<|fim_suffix|>", false),
    ("<|fim_pad|>", false),
    ("<|repo_name|>", false),
    ("<|file_sep|>", false),
    ("<tool_response>", false),
    ("</tool_response>", false),
    ("<think>", false),
    ("</think>", false),
];

/// Qwen3's chat template (model data: see tests/fixtures/templates/README.md).
pub const QWEN3_TEMPLATE: &str =
    include_str!("../../../tests/fixtures/templates/Qwen-Qwen3-0.6B.jinja");

const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Tekken's named control tokens, ids 0.. (the rest up to 1000 are `<SPECIAL_n>`).
pub(crate) const TEKKEN_NAMED: &[&str] = &[
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
];

/// Mistral Small 3.2's chat template (model data: see tests/fixtures/templates/README.md).
pub const MISTRAL3_TEMPLATE: &str =
    include_str!("../../../tests/fixtures/templates/Mistral-Small-3.2-24B-Instruct-2506.jinja");

/// A Tekken tokenizer of `vocab` ids as Mistral Small 3's GGUF files have it: byte-level BPE
/// with the `tekken` pre-tokenizer after 1000 control tokens, BOS `<s>` added, EOS `</s>`, and
/// Mistral Small 3.2's chat template.
fn add_tekken(w: &mut GgufWriter, vocab: u32) {
    let control = super::shape::TEKKEN_CONTROL as usize;
    let mut tokens: Vec<String> = (0..control)
        .map(|i| {
            TEKKEN_NAMED
                .get(i)
                .map_or_else(|| format!("<SPECIAL_{i}>"), |t| t.to_string())
        })
        .collect();
    let mut types = vec![TOKEN_TYPE_CONTROL; control];
    types[0] = TOKEN_TYPE_UNKNOWN;
    let (bpe, merges) = bpe_vocabulary(vocab as usize - control);
    types.extend(std::iter::repeat_n(TOKEN_TYPE_NORMAL, bpe.len()));
    tokens.extend(bpe);
    w.add("tokenizer.ggml.model", Value::Str("gpt2".into()));
    w.add("tokenizer.ggml.pre", Value::Str("tekken".into()));
    w.add("tokenizer.ggml.tokens", Value::Array(Array::Str(tokens)));
    w.add("tokenizer.ggml.token_type", Value::Array(Array::I32(types)));
    w.add("tokenizer.ggml.merges", Value::Array(Array::Str(merges)));
    w.add("tokenizer.ggml.bos_token_id", Value::U32(1));
    w.add("tokenizer.ggml.eos_token_id", Value::U32(2));
    w.add("tokenizer.ggml.unknown_token_id", Value::U32(0));
    w.add("tokenizer.ggml.padding_token_id", Value::U32(11));
    w.add("tokenizer.ggml.add_bos_token", Value::Bool(true));
    w.add("tokenizer.ggml.add_eos_token", Value::Bool(false));
    w.add(
        "tokenizer.chat_template",
        Value::Str(MISTRAL3_TEMPLATE.into()),
    );
}

/// Gemma 2's chat template (model data: see tests/fixtures/templates/README.md).
pub const GEMMA2_TEMPLATE: &str =
    include_str!("../../../tests/fixtures/templates/google-gemma-2-2b-it.jinja");

/// A Gemma tokenizer of `vocab` ids as Gemma 2's GGUF files have it: SentencePiece with byte
/// fallback, Gemma's specials at their ids (`<bos>` 2 added, `<eos>` 1, `<end_of_turn>`
/// ending a turn), no space prefix, and Gemma 2's chat template.
fn add_gemma(w: &mut GgufWriter, vocab: u32) {
    let specials = super::shape::GEMMA_SPECIALS;
    // The small models' pieces without their own three specials (<unk>, <s>, </s>).
    let rest = vocabulary(vocab as usize + 3 - specials.len());
    let mut tokens: Vec<String> = specials.iter().map(|t| t.to_string()).collect();
    let mut scores = vec![0.0f32; specials.len()];
    let mut types: Vec<i32> = specials
        .iter()
        .map(|t| {
            if *t == "<unk>" {
                TOKEN_TYPE_UNKNOWN
            } else {
                TOKEN_TYPE_CONTROL
            }
        })
        .collect();
    for (t, s, ty) in rest.into_iter().skip(3) {
        tokens.push(t);
        scores.push(s);
        types.push(ty);
    }
    w.add("tokenizer.ggml.model", Value::Str("llama".into()));
    w.add("tokenizer.ggml.pre", Value::Str("default".into()));
    w.add("tokenizer.ggml.tokens", Value::Array(Array::Str(tokens)));
    w.add("tokenizer.ggml.scores", Value::Array(Array::F32(scores)));
    w.add("tokenizer.ggml.token_type", Value::Array(Array::I32(types)));
    w.add("tokenizer.ggml.bos_token_id", Value::U32(2));
    w.add("tokenizer.ggml.eos_token_id", Value::U32(1));
    w.add("tokenizer.ggml.unknown_token_id", Value::U32(3));
    w.add("tokenizer.ggml.padding_token_id", Value::U32(0));
    w.add("tokenizer.ggml.add_bos_token", Value::Bool(true));
    w.add("tokenizer.ggml.add_eos_token", Value::Bool(false));
    w.add("tokenizer.ggml.add_space_prefix", Value::Bool(false));
    w.add(
        "tokenizer.chat_template",
        Value::Str(GEMMA2_TEMPLATE.into()),
    );
}

/// A Qwen3 tokenizer of `vocab` ids as Qwen3's GGUF files have it: byte-level BPE with the
/// `qwen2` pre-tokenizer, its added tokens, BOS `<|endoftext|>` not added, EOS `<|im_end|>`
/// (the instruct models' end of turn), and its chat template.
fn add_qwen3(w: &mut GgufWriter, vocab: u32) {
    let n = vocab as usize;
    let regular = vocab - VocabKind::Qwen3.tail();
    let (mut tokens, merges) = bpe_vocabulary(regular as usize);
    let mut types = vec![TOKEN_TYPE_NORMAL; tokens.len()];
    for (t, control) in QWEN3_ADDED {
        tokens.push((*t).to_string());
        types.push(if *control {
            TOKEN_TYPE_CONTROL
        } else {
            TOKEN_TYPE_USER_DEFINED
        });
    }
    while tokens.len() < n {
        tokens.push(format!("[PAD{}]", tokens.len()));
        types.push(TOKEN_TYPE_UNUSED);
    }
    w.add("tokenizer.ggml.model", Value::Str("gpt2".into()));
    w.add("tokenizer.ggml.pre", Value::Str("qwen2".into()));
    w.add("tokenizer.ggml.tokens", Value::Array(Array::Str(tokens)));
    w.add("tokenizer.ggml.token_type", Value::Array(Array::I32(types)));
    w.add("tokenizer.ggml.merges", Value::Array(Array::Str(merges)));
    w.add("tokenizer.ggml.eos_token_id", Value::U32(regular + 2));
    w.add("tokenizer.ggml.padding_token_id", Value::U32(regular));
    w.add("tokenizer.ggml.bos_token_id", Value::U32(regular));
    w.add("tokenizer.ggml.add_bos_token", Value::Bool(false));
    w.add("tokenizer.chat_template", Value::Str(QWEN3_TEMPLATE.into()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bpe_vocabulary_is_unique_and_every_merge_joins_present_tokens() {
        let (tokens, merges) = bpe_vocabulary(20_000);
        assert_eq!(tokens.len(), 20_000);
        assert_eq!(merges.len(), 20_000 - 256);
        let set: HashSet<&String> = tokens.iter().collect();
        assert_eq!(set.len(), tokens.len());
        for (i, m) in merges.iter().enumerate() {
            let (l, r) = m.split_once(' ').unwrap();
            let at = |s: &str| tokens.iter().position(|t| t == s);
            let (li, ri) = (at(l).unwrap(), at(r).unwrap());
            assert!(
                li < 256 + i && ri < 256 + i,
                "merge {i} '{m}' uses a later token"
            );
            assert_eq!(tokens[256 + i], format!("{l}{r}"));
            if i > 2000 {
                break; // the position scan is quadratic; the first merges cover every rule
            }
        }
        assert!(tokens.contains(&"Ġhello".to_string()));
        assert_eq!(tokens[usize::from(b'a')], "a");
        assert_eq!(tokens[usize::from(b' ')], "Ġ");
    }

    #[test]
    fn llama3_specials_sit_where_llama3_has_them() {
        assert_eq!(llama3_special(0), "<|begin_of_text|>");
        assert_eq!(llama3_special(9), "<|eot_id|>");
        assert_eq!(llama3_special(11), "<|reserved_special_token_3|>");
        assert_eq!(llama3_special(255), "<|reserved_special_token_247|>");
        let all: HashSet<String> = (0..256).map(llama3_special).collect();
        assert_eq!(all.len(), 256);
    }
}
