//! The tokenizers `debug synth --shape` generates build with our tokenizer and round-trip
//! text: byte-level BPE with Llama 3's and Qwen 2's pre-tokenizers and SentencePiece with
//! byte fallback, at the real vocabulary sizes.

use ringllm::text::tokenizer::{Tokenizer, TokenizerSpec};
use ringllm_model::gguf::GgufFile;
use ringllm_model::synth::{shape, tokenizer_gguf, VocabKind};

const TEXTS: &[&str] = &[
    "Hello world, the model said it would make the water people.",
    "  leading spaces\tand tabs\nnew lines\r\n and 12345 digits 3.14",
    "Ünïcödé — 日本語のテキスト 🙂 and emoji 👍🏽",
    "<|begin_of_text|> is only text here; so is <|im_end|> and <s>",
    "",
];

fn tokenizer(kind: VocabKind, vocab: u32) -> Tokenizer {
    let f = GgufFile::from_bytes(tokenizer_gguf(kind, vocab)).unwrap();
    let spec = TokenizerSpec::from_gguf(f.metadata()).unwrap();
    assert_eq!(spec.tokens.len(), vocab as usize);
    Tokenizer::new(&spec).unwrap()
}

fn round_trip(kind: VocabKind, vocab: u32) -> Tokenizer {
    let tok = tokenizer(kind, vocab);
    for text in TEXTS {
        let ids = tok.encode_text(text, false).unwrap();
        assert!(ids.iter().all(|&i| i < vocab), "{kind:?}: id out of range");
        assert_eq!(tok.decode(&ids), *text, "{kind:?} vocab {vocab}: {ids:?}");
    }
    tok
}

#[test]
fn real_size_vocabularies_round_trip() {
    for name in ["llama3-8b", "qwen2-7b", "gemma3-1b", "gpt-oss-20b"] {
        let s = shape(name).unwrap();
        let tok = round_trip(s.vocab_kind, s.vocab);
        // Common words are single tokens (pieces were generated for them).
        let ids = tok.encode_text("the model", false).unwrap();
        assert!(ids.len() <= 3, "{name}: 'the model' took {ids:?}");
    }
}

#[test]
fn small_vocabularies_round_trip_and_keep_their_specials() {
    round_trip(VocabKind::Llama3, 2048);
    round_trip(VocabKind::Qwen2, 1200);
    round_trip(VocabKind::Spm, 400);
    let tok = tokenizer(VocabKind::Llama3, 2048);
    // BOS first (Llama 3 adds it), and the special text is one control token in a raw prompt.
    let ids = tok.encode("<|eot_id|>Hi", true).unwrap();
    assert_eq!(ids[0], 2048 - 256);
    assert_eq!(ids[1], 2048 - 256 + 9);
}

#[test]
fn gpt_oss_vocabulary_has_o200k_harmony_ids() {
    let s = shape("gpt-oss-20b").unwrap();
    assert_eq!(s.vocab_kind, VocabKind::Harmony);
    let tok = tokenizer(s.vocab_kind, s.vocab);
    for (text, id) in [
        ("<|startoftext|>", 199_998),
        ("<|endoftext|>", 199_999),
        ("<|return|>", 200_002),
        ("<|constrain|>", 200_003),
        ("<|channel|>", 200_005),
        ("<|start|>", 200_006),
        ("<|end|>", 200_007),
        ("<|message|>", 200_008),
        ("<|call|>", 200_012),
        ("<|endofprompt|>", 200_018),
    ] {
        assert_eq!(tok.piece_to_id(text), Some(id), "{text}");
    }
    assert_eq!(tok.bos(), Some(199_998));
    assert_eq!(tok.eos(), Some(200_002));
    assert_eq!(tok.eog_ids(), [199_999, 200_002, 200_012]);
    assert!(!tok.add_bos_default());
    let ids = tok
        .encode("<|start|>user<|message|>Hi<|end|>", false)
        .unwrap();
    assert_eq!((ids[0], ids[ids.len() - 1]), (200_006, 200_007));
}
