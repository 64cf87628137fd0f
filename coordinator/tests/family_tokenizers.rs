//! The tokenizers of issue 28's families as their GGUF files name them, on the vocabularies
//! `debug synth` generates for them: Qwen3 files say `tokenizer.ggml.pre = qwen2`.

use ringllm::text::tokenizer::{Tokenizer, TokenizerSpec};
use ringllm_model::gguf::GgufFile;
use ringllm_model::synth::{shape, tokenizer_gguf, VocabKind};

fn tokenizer(kind: VocabKind, vocab: u32) -> Tokenizer {
    let f = GgufFile::from_bytes(tokenizer_gguf(kind, vocab)).expect("a GGUF");
    let spec = TokenizerSpec::from_gguf(f.metadata()).expect("tokenizer metadata");
    Tokenizer::new(&spec).expect("builds")
}

#[test]
fn qwen3_vocabulary_ends_turns_and_keeps_its_markup_whole() {
    let s = shape("qwen3-8b").expect("shape");
    let tok = tokenizer(s.vocab_kind, s.vocab);
    assert_eq!(tok.vocab_size(), 151_936);
    let im_start = tok.piece_to_id("<|im_start|>").expect("<|im_start|>");
    let im_end = tok.piece_to_id("<|im_end|>").expect("<|im_end|>");
    let think = tok.piece_to_id("<think>").expect("<think>");
    // The ids Qwen3's own vocabulary gives them.
    assert_eq!((im_start, im_end, think), (151_644, 151_645, 151_667));
    // No BOS; `<|im_end|>` (EOS) ends generation, as does `<|endoftext|>`.
    assert!(!tok.add_bos_default());
    assert!(tok.is_eog(im_end), "{:?}", tok.eog_ids());
    // A template's markup is one token each; `<think>` (user-defined) is one token even in
    // plain text, `<|im_start|>` (control) is only characters there.
    let ids = tok
        .encode("<|im_start|>user\nHi<|im_end|>\n<think>\n", false)
        .expect("encodes");
    assert_eq!(ids[0], im_start);
    assert!(ids.contains(&im_end) && ids.contains(&think), "{ids:?}");
    let text = tok
        .encode_text("<|im_start|> and <think>", false)
        .expect("encodes");
    assert!(
        !text.contains(&im_start) && text.contains(&think),
        "{text:?}"
    );
    for t in [
        "Hello world, the model said 12345.",
        "  Ünïcödé 日本語 🙂\n\n",
    ] {
        assert_eq!(tok.decode(&tok.encode_text(t, false).expect("encodes")), t);
    }
    // Qwen's digits are one token each.
    let digits = tok.encode_text("12345", false).expect("encodes");
    assert_eq!(digits.len(), 5, "{digits:?}");
}
