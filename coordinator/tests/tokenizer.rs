//! Tokenizer behaviour on the real models' vocabularies: decoding inverts encoding, streaming
//! never splits a UTF-8 character, and an unknown pre-tokenizer is refused by name. (Token ids
//! themselves are checked against llama.cpp in tests/python/test_llamacpp.py.)

use ringllm::tokenizer::{StreamDecoder, Tokenizer, TokenizerError, TokenizerSpec};
use ringllm_node::gguf::GgufFile;
use std::path::PathBuf;

fn spec(name: &str) -> TokenizerSpec {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models")
        .join(name);
    let file = GgufFile::open(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-models)", path.display()));
    TokenizerSpec::from_gguf(file.metadata()).expect("tokenizer metadata")
}

const TEXTS: &[&str] = &[
    "Hello world",
    "emoji 👍🏽 family 👨‍👩‍👧 crab 🦀",
    "中文分词测试 日本語 한국어",
    "café naïve Straße Καλημέρα Привет",
    "  spaces\tand\ttabs\n\nnewlines  ",
    "fn main() { let x = 1_000; }",
];

#[test]
fn decode_inverts_encode_and_streaming_keeps_characters_whole() {
    for name in [
        "gemma-3-270m-q4_k_m.gguf",
        "smollm2-135m-instruct-q4_1.gguf",
    ] {
        let tok = Tokenizer::new(&spec(name)).expect("tokenizer");
        for text in TEXTS {
            let ids = tok.encode(text, false).expect("encode");
            assert_eq!(tok.decode(&ids), *text, "{name}: round trip of {text:?}");
            let mut dec = StreamDecoder::new();
            let mut streamed = String::new();
            for &id in &ids {
                let chunk = dec.push(&tok, id);
                assert!(
                    !chunk.contains('\u{FFFD}'),
                    "{name}: a character was split in {text:?}"
                );
                streamed.push_str(&chunk);
            }
            streamed.push_str(&dec.finish());
            assert_eq!(streamed, *text, "{name}: streamed text of {text:?}");
        }
    }
}

#[test]
fn byte_tokens_of_one_character_wait_for_each_other() {
    // Byte-fallback tokens spell a character over several tokens: nothing may be emitted until
    // the character is whole.
    let tok = Tokenizer::new(&spec("gemma-3-270m-q4_k_m.gguf")).expect("tokenizer");
    let ids: Vec<u32> = "🦀"
        .as_bytes()
        .iter()
        .map(|b| {
            tok.piece_to_id(&format!("<0x{b:02X}>"))
                .expect("byte token")
        })
        .collect();
    let mut dec = StreamDecoder::new();
    for &id in &ids[..ids.len() - 1] {
        assert_eq!(dec.push(&tok, id), "");
    }
    assert_eq!(dec.push(&tok, ids[ids.len() - 1]), "🦀");
}

#[test]
fn unknown_pre_tokenizer_is_refused_by_name() {
    let mut s = spec("smollm2-135m-instruct-q4_1.gguf");
    s.pre = Some("mystery-bpe".into());
    match Tokenizer::new(&s) {
        Err(e @ TokenizerError::UnknownPreTokenizer { .. }) => {
            assert!(e.to_string().contains("mystery-bpe"), "{e}")
        }
        other => panic!("expected an unknown pre-tokenizer error, got {other:?}"),
    }
}

#[test]
fn end_of_generation_ids_come_from_metadata_and_chat_tokens() {
    let tok = Tokenizer::new(&spec("smollm2-135m-instruct-q4_1.gguf")).expect("tokenizer");
    let im_end = tok.piece_to_id("<|im_end|>").expect("<|im_end|>");
    assert!(tok.eog_ids().contains(&im_end));
    assert!(!tok.add_bos_default());
    let g = Tokenizer::new(&spec("gemma-3-270m-q4_k_m.gguf")).expect("tokenizer");
    let eot = g.piece_to_id("<end_of_turn>").expect("<end_of_turn>");
    assert!(g.eog_ids().contains(&eot) && g.eog_ids().contains(&1));
    assert!(g.add_bos_default());
}
