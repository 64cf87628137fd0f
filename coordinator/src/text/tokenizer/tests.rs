//! The tokenizer on the real models' metadata and on small hand-built vocabularies.

use super::pre::{split, PRE_TOKENIZERS};
use super::*;

fn spec(model: &str, tokens: &[&str], types: &[i32]) -> TokenizerSpec {
    TokenizerSpec {
        model: model.into(),
        tokens: tokens.iter().map(|t| t.to_string()).collect(),
        token_types: Some(types.to_vec()),
        ..TokenizerSpec::default()
    }
}

/// A tiny SentencePiece vocabulary: bytes, control tokens and a few scored pieces.
fn spm(add_space_prefix: Option<bool>) -> Tokenizer {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![TYPE_UNKNOWN, TYPE_CONTROL, TYPE_CONTROL];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(TYPE_BYTE);
    }
    let normal = [
        "▁", "a", "b", "c", "h", "i", "▁h", "▁hi", "hi", "ab", "abc", "bc", "é",
    ];
    for t in normal {
        tokens.push(t.into());
        types.push(TYPE_NORMAL);
    }
    tokens.push("<|im_end|>".into());
    types.push(TYPE_NORMAL); // an end-of-turn text that the file forgot to mark control
    let n = tokens.len();
    // Score = -id: earlier pieces win, as in converted SentencePiece models.
    let scores = (0..n).map(|i| -(i as f32)).collect();
    let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let mut s = spec("llama", &refs, &types);
    s.scores = Some(scores);
    s.bos = Some(1);
    s.eos = Some(2);
    s.unk = Some(0);
    s.add_space_prefix = add_space_prefix;
    Tokenizer::new(&s).expect("tokenizer")
}

#[test]
fn spm_prefix_space_is_added_and_removed() {
    let t = spm(None);
    let ids = t.encode("hi hi", true).expect("encode");
    let hi = t.piece_to_id("▁hi").expect("▁hi");
    assert_eq!(ids, vec![1, hi, hi]);
    assert_eq!(t.decode(&ids), "hi hi");
    assert_eq!(t.decode(&ids[1..]), "hi hi");
    // A continuation keeps its space.
    let mut d = StreamDecoder::new();
    let s: String = ids.iter().map(|&i| d.push(&t, i)).collect();
    assert_eq!(s, " hi hi");
    let mut d = StreamDecoder::at_text_start();
    let s: String = ids.iter().map(|&i| d.push(&t, i)).collect();
    assert_eq!(s, "hi hi");
    assert!(t.add_bos_default());
}

#[test]
fn spm_without_prefix_space() {
    let t = spm(Some(false));
    let ids = t.encode("hi", false).expect("encode");
    assert_eq!(ids, vec![t.piece_to_id("hi").expect("hi")]);
    assert_eq!(t.decode(&ids), "hi");
}

#[test]
fn spm_merges_by_score_and_falls_back_to_bytes() {
    let t = spm(Some(false));
    // "abc" (score of id) is a piece; so are "ab" and "bc".
    let abc = t.piece_to_id("abc").expect("abc");
    assert_eq!(t.encode("abc", false).expect("encode"), vec![abc]);
    // 'z' is not in the vocabulary: its byte token.
    assert_eq!(
        t.encode("z", false).expect("encode"),
        vec![t.piece_to_id("<0x7A>").expect("byte")]
    );
    // 'ж' (two bytes) becomes two byte tokens, which decode back to the character.
    let ids = t.encode("ж", false).expect("encode");
    assert_eq!(ids.len(), 2);
    assert_eq!(t.decode(&ids), "ж");
}

#[test]
fn special_tokens_parse_and_render_only_when_asked() {
    let t = spm(Some(false));
    let ids = t.encode("hi</s>hi", false).expect("encode");
    let hi = t.piece_to_id("hi").expect("hi");
    assert_eq!(ids, vec![hi, 2, hi]);
    assert_eq!(t.decode(&ids), "hihi");
    assert_eq!(t.decode_with(&ids, true), "hi</s>hi");
    let mut d = StreamDecoder::new().render_special(true);
    let s: String = ids.iter().map(|&i| d.push(&t, i)).collect();
    assert_eq!(s, "hi</s>hi");
    // The unknown token is matched too (llama.cpp's parse_special).
    assert_eq!(t.encode("<unk>", false).expect("encode"), vec![0]);
}

#[test]
fn end_of_turn_texts_are_end_of_generation_and_control() {
    let t = spm(None);
    let im_end = t.piece_to_id("<|im_end|>").expect("<|im_end|>");
    assert!(t.eog_ids().contains(&2));
    assert!(t.eog_ids().contains(&im_end));
    assert!(t.is_control(im_end));
    assert_eq!(t.decode(&[im_end]), "");
}

#[test]
fn stream_decoder_matches_lossy_decoding_of_invalid_bytes() {
    let t = spm(Some(false));
    let byte = |b: u8| t.piece_to_id(&format!("<0x{b:02X}>")).expect("byte");
    // é = C3 A9; a lone continuation byte, an invalid byte, then a truncated character.
    let ids = [
        byte(0xC3),
        byte(0xA9),
        byte(0xA9),
        byte(0xFF),
        t.piece_to_id("a").expect("a"),
        byte(0xE4),
        byte(0xB8),
    ];
    let whole = t.decode(&ids);
    assert_eq!(whole, "é\u{FFFD}\u{FFFD}a\u{FFFD}");
    let mut d = StreamDecoder::new();
    let mut chunks: Vec<String> = ids.iter().map(|&i| d.push(&t, i)).collect();
    assert_eq!(chunks[0], "");
    assert_eq!(chunks[1], "é");
    chunks.push(d.finish());
    assert_eq!(chunks.concat(), whole);
}

#[test]
fn byte_level_alphabet_round_trips_every_byte() {
    let chars = gpt2_byte_chars();
    let mut seen = std::collections::HashSet::new();
    for (b, c) in chars.iter().enumerate() {
        assert!(seen.insert(*c), "{c:?} twice");
        if (0x21..=0x7E).contains(&b) {
            assert_eq!(*c as usize, b);
        }
    }
    assert_eq!(chars[usize::from(b' ')], 'Ġ');
    assert_eq!(chars[usize::from(b'\n')], 'Ċ');
}

#[test]
fn unknown_pre_tokenizer_and_model_are_refused_by_name() {
    let mut s = spec("gpt2", &["a", "b", "ab"], &[1, 1, 1]);
    s.merges = Some(vec!["a b".into()]);
    s.pre = Some("no-such-pre".into());
    let e = Tokenizer::new(&s).expect_err("unknown pre");
    assert!(matches!(&e, TokenizerError::UnknownPreTokenizer { name } if name == "no-such-pre"));
    assert!(e.to_string().contains("no-such-pre") && e.to_string().contains("llama-bpe"));
    s.pre = Some("gpt-2".into());
    let t = Tokenizer::new(&s).expect("gpt-2");
    assert_eq!(t.encode("ab", false).expect("encode"), vec![2]);
    assert!(!t.add_bos_default());
    s.model = "rwkv".into();
    assert!(matches!(
        Tokenizer::new(&s),
        Err(TokenizerError::UnsupportedModel(m)) if m == "rwkv"
    ));
}

#[test]
fn every_pre_tokenizer_compiles() {
    for def in PRE_TOKENIZERS {
        for re in def.splits {
            split(re).unwrap_or_else(|e| panic!("{:?}: {re}: {e}", def.names));
        }
    }
    let names = pre_tokenizer_names();
    let unique: std::collections::HashSet<_> = names.iter().collect();
    assert_eq!(unique.len(), names.len(), "a name is listed twice");
}

#[test]
fn bad_metadata_is_an_error_not_a_panic() {
    let mut s = spec("llama", &["a"], &[1, 1]);
    assert!(matches!(
        Tokenizer::new(&s),
        Err(TokenizerError::Invalid(_))
    ));
    s.token_types = Some(vec![1]);
    assert!(Tokenizer::new(&s).is_err(), "no scores");
    s.scores = Some(vec![0.0]);
    s.bos = Some(7);
    assert!(Tokenizer::new(&s).is_err(), "bos outside the vocabulary");
    let mut b = spec("gpt2", &["a"], &[1]);
    b.pre = Some("gpt-2".into());
    b.merges = Some(vec!["nospace".into()]);
    assert!(Tokenizer::new(&b).is_err(), "malformed merge");
    assert!(Tokenizer::new(&TokenizerSpec::default()).is_err());
}
