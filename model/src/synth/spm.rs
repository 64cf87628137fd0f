//! The small models' SentencePiece vocabulary (specials, byte tokens, words and made-up
//! pieces) and its tokenizer metadata; `vocab.rs` builds the BPE kinds from the same words.

use crate::gguf::{Array, GgufWriter, Value};
use std::collections::HashSet;

/// Specials plus byte tokens.
pub(super) const N_FIXED_TOKENS: u32 = 3 + 256;

/// SentencePiece word-boundary marker.
pub(super) const SPACE: &str = "\u{2581}";

pub(super) const TOKEN_TYPE_NORMAL: i32 = 1;
pub(super) const TOKEN_TYPE_UNKNOWN: i32 = 2;
pub(super) const TOKEN_TYPE_CONTROL: i32 = 3;
pub(super) const TOKEN_TYPE_BYTE: i32 = 6;

pub(super) const WORDS: &[&str] = &[
    "the", "a", "and", "of", "to", "in", "is", "it", "that", "was", "for", "on", "are", "with",
    "as", "he", "she", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "not",
    "but", "what", "all", "were", "we", "when", "your", "can", "said", "there", "use", "an",
    "each", "which", "do", "how", "their", "if", "will", "up", "other", "about", "out", "many",
    "then", "them", "so", "some", "her", "would", "make", "like", "him", "into", "time", "has",
    "look", "two", "more", "write", "go", "see", "number", "no", "way", "could", "people", "my",
    "than", "first", "water", "been", "call", "who", "its", "now", "find", "long", "down", "day",
    "did", "get", "come", "made", "may", "part", "hello", "world", "model", "token",
];

pub(super) const SUFFIXES: &[&str] = &[
    "ing", "ed", "er", "es", "ly", "tion", "s", "al", "ent", "ness", "ment", "able", "est", "ous",
    "ive", "ful", "less", "th", "on", "an", "in", "at", "re", "st", "or",
];

/// The vocabulary: (text, score, token type).
pub(super) fn vocabulary(n: usize) -> Vec<(String, f32, i32)> {
    let mut v: Vec<(String, f32, i32)> = Vec::with_capacity(n);
    v.push(("<unk>".into(), 0.0, TOKEN_TYPE_UNKNOWN));
    v.push(("<s>".into(), 0.0, TOKEN_TYPE_CONTROL));
    v.push(("</s>".into(), 0.0, TOKEN_TYPE_CONTROL));
    for b in 0..=255u8 {
        v.push((format!("<0x{b:02X}>"), 0.0, TOKEN_TYPE_BYTE));
    }
    let mut seen: HashSet<String> = v.iter().map(|t| t.0.clone()).collect();
    let letters: Vec<String> = ('a'..='z').map(String::from).collect();
    let mut pieces = Vec::new();
    pieces.push(SPACE.to_string());
    pieces.extend(letters.iter().map(|l| format!("{SPACE}{l}")));
    pieces.extend(WORDS.iter().map(|w| format!("{SPACE}{w}")));
    pieces.extend(SUFFIXES.iter().map(|s| s.to_string()));
    pieces.extend(letters.iter().cloned());
    pieces.extend(WORDS.iter().map(|w| w.to_string()));
    // Then as many made-up pieces as needed: letter pairs and triples, with and without ▁.
    let mut made_up = (0u64..).map(|i| {
        let mut s = String::new();
        let mut x = i;
        loop {
            s.push(char::from(b'a' + (x % 26) as u8));
            x /= 26;
            if x == 0 {
                break;
            }
        }
        s
    });
    let mut idx = 0usize;
    while v.len() < n {
        let piece = match pieces.get(idx) {
            Some(p) => p.clone(),
            None => {
                let g = made_up.next().unwrap_or_default();
                if idx.is_multiple_of(2) {
                    format!("{SPACE}{g}")
                } else {
                    g
                }
            }
        };
        idx += 1;
        if seen.insert(piece.clone()) {
            let rank = v.len() as f32 - N_FIXED_TOKENS as f32;
            v.push((piece, -rank, TOKEN_TYPE_NORMAL));
        }
    }
    v.truncate(n);
    v
}

/// The small models' SentencePiece tokenizer (`vocabulary`); `add_bos`: the file asks for
/// BOS in front of a prompt.
pub(super) fn add_spm_tokenizer(w: &mut GgufWriter, vocab: &[(String, f32, i32)], add_bos: bool) {
    w.add("tokenizer.ggml.model", Value::Str("llama".into()));
    w.add(
        "tokenizer.ggml.tokens",
        Value::Array(Array::Str(vocab.iter().map(|t| t.0.clone()).collect())),
    );
    w.add(
        "tokenizer.ggml.scores",
        Value::Array(Array::F32(vocab.iter().map(|t| t.1).collect())),
    );
    w.add(
        "tokenizer.ggml.token_type",
        Value::Array(Array::I32(vocab.iter().map(|t| t.2).collect())),
    );
    w.add("tokenizer.ggml.bos_token_id", Value::U32(1));
    w.add("tokenizer.ggml.eos_token_id", Value::U32(2));
    w.add("tokenizer.ggml.unknown_token_id", Value::U32(0));
    w.add("tokenizer.ggml.add_bos_token", Value::Bool(add_bos));
    w.add("tokenizer.ggml.add_eos_token", Value::Bool(false));
}
