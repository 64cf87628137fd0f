//! gpt-oss's tokenizer as its GGUF files have it: o200k_harmony's layout (byte-level BPE
//! pieces, then the harmony special tokens from id `vocab - 1090`, which is 199998 at the real
//! size of 201088), the o200k pre-tokenizer (`tokenizer.ggml.pre = "gpt-4o"`), BOS
//! `<|startoftext|>` not added, EOS `<|return|>`, padding `<|endoftext|>`, and gpt-oss's chat
//! template. The BPE pieces are our generated ones (see [`super::vocab`]), headed by pieces
//! that only form where the o200k expression keeps text together, so tokenizer tests can tell
//! its cuts from other pre-tokenizers'.

use super::vocab::{bpe_vocabulary_with, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL};
use crate::gguf::{Array, GgufWriter, Value};

/// Ids from the first special token to the end of o200k_harmony (201088 - 199998).
pub const HARMONY_TAIL: u32 = 1090;

/// o200k_harmony's named special tokens by offset from `<|startoftext|>` (199998); the other
/// offsets are `<|reserved_N|>` with N the real id.
pub const HARMONY_NAMED: &[(u32, &str)] = &[
    (0, "<|startoftext|>"),
    (1, "<|endoftext|>"),
    (4, "<|return|>"),
    (5, "<|constrain|>"),
    (7, "<|channel|>"),
    (8, "<|start|>"),
    (9, "<|end|>"),
    (10, "<|message|>"),
    (14, "<|call|>"),
    (20, "<|endofprompt|>"),
];

/// The real id of the first special token.
const REAL_FIRST_SPECIAL: u32 = 199_998;

/// gpt-oss's chat template (model data: see tests/fixtures/templates/README.md).
pub const GPT_OSS_TEMPLATE: &str =
    include_str!("../../../tests/fixtures/templates/openai-gpt-oss-120b.jinja");

/// Texts whose pieces the o200k expression keeps whole and other pre-tokenizers cut (or the
/// other way round): case runs, contractions, digit runs, `/` before a newline, non-ASCII
/// cased letters, CJK and emoji. Their merges come first.
const PROBES: &[&str] = &[
    "HTTPServer",
    " HTTPServer",
    "camelCase",
    "don't",
    " don't",
    " they'll",
    " I'm",
    "'s",
    "123",
    "1234",
    "2026",
    "/\n",
    ".\n\n",
    " {\n",
    "\n\n",
    "    ",
    "ÉCOLE",
    " École",
    " naïve",
    " Привет",
    "ПРИВЕТ",
    " Straße",
    "日本語",
    "中文",
    "👍",
    "🦀",
    "<|",
    "|>",
];

/// The harmony special token at offset `i` from the first one.
fn special(i: u32) -> String {
    HARMONY_NAMED.iter().find(|(at, _)| *at == i).map_or_else(
        || format!("<|reserved_{}|>", REAL_FIRST_SPECIAL + i),
        |(_, t)| (*t).to_string(),
    )
}

/// Adds a gpt-oss tokenizer of `vocab` ids (at least [`HARMONY_TAIL`] + 768) to `w`.
pub fn add_tokenizer(w: &mut GgufWriter, vocab: u32) {
    let regular = vocab - HARMONY_TAIL;
    let (mut tokens, merges) = bpe_vocabulary_with(regular as usize, PROBES);
    let mut types = vec![TOKEN_TYPE_NORMAL; tokens.len()];
    for i in 0..HARMONY_TAIL {
        tokens.push(special(i));
        types.push(TOKEN_TYPE_CONTROL);
    }
    w.add("tokenizer.ggml.model", Value::Str("gpt2".into()));
    w.add("tokenizer.ggml.pre", Value::Str("gpt-4o".into()));
    w.add("tokenizer.ggml.tokens", Value::Array(Array::Str(tokens)));
    w.add("tokenizer.ggml.token_type", Value::Array(Array::I32(types)));
    w.add("tokenizer.ggml.merges", Value::Array(Array::Str(merges)));
    // <|startoftext|>, <|return|> and <|endoftext|> (see HARMONY_NAMED).
    w.add("tokenizer.ggml.bos_token_id", Value::U32(regular));
    w.add("tokenizer.ggml.eos_token_id", Value::U32(regular + 4));
    w.add("tokenizer.ggml.padding_token_id", Value::U32(regular + 1));
    w.add(
        "tokenizer.chat_template",
        Value::Str(GPT_OSS_TEMPLATE.into()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specials_sit_at_o200k_harmony_ids() {
        let real = |id: u32| special(id - REAL_FIRST_SPECIAL);
        assert_eq!(real(199_998), "<|startoftext|>");
        assert_eq!(real(199_999), "<|endoftext|>");
        assert_eq!(real(200_000), "<|reserved_200000|>");
        assert_eq!(real(200_002), "<|return|>");
        assert_eq!(real(200_003), "<|constrain|>");
        assert_eq!(real(200_005), "<|channel|>");
        assert_eq!(real(200_006), "<|start|>");
        assert_eq!(real(200_007), "<|end|>");
        assert_eq!(real(200_008), "<|message|>");
        assert_eq!(real(200_012), "<|call|>");
        assert_eq!(real(200_018), "<|endofprompt|>");
        assert_eq!(real(201_087), "<|reserved_201087|>");
        assert_eq!(REAL_FIRST_SPECIAL + HARMONY_TAIL, 201_088);
    }
}
