//! gpt-oss's tokenizer (byte-level BPE with the o200k pre-tokenizer, `tokenizer.ggml.pre =
//! "gpt-4o"`, and o200k_harmony's special tokens) on the synthetic gpt-oss vocabulary, against
//! llama.cpp's `llama-tokenize` on the same vocabulary: tests/fixtures/tokens-gptoss-llamacpp.json,
//! made by tests/fixtures/make_gptoss_token_fixtures.py.

use ringllm::text::tokenizer::{StreamDecoder, Tokenizer, TokenizerSpec};
use ringllm_model::gguf::GgufFile;
use ringllm_model::synth::{tokenizer_gguf, SynthArch};
use serde_json::Value;

fn fixture() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/tokens-gptoss-llamacpp.json");
    let src = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&src).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The vocabulary `debug synth --arch gpt-oss` writes.
fn spec() -> TokenizerSpec {
    let (kind, vocab) = SynthArch::GptOss.small_vocab();
    let f = GgufFile::from_bytes(tokenizer_gguf(kind, vocab)).expect("synthetic GGUF");
    TokenizerSpec::from_gguf(f.metadata()).expect("tokenizer metadata")
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list of ids: {v}"))
        .iter()
        .map(|x| {
            x.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .unwrap_or_else(|| panic!("not a token id: {x}"))
        })
        .collect()
}

/// FNV-1a 64 of the strings joined by NUL, as the fixture script computes it.
fn fnv1a64(items: &[String]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, s) in items.iter().enumerate() {
        let sep: &[u8] = if i > 0 { b"\0" } else { b"" };
        for &b in sep.iter().chain(s.as_bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

fn cases<'a>(fx: &'a Value, key: &str) -> Vec<(&'a str, Vec<u32>)> {
    fx[key]
        .as_array()
        .unwrap_or_else(|| panic!("no {key} in the fixture"))
        .iter()
        .map(|c| (c["text"].as_str().expect("text"), ids_of(&c["ids"])))
        .collect()
}

#[test]
fn the_fixture_is_of_this_vocabulary() {
    let fx = fixture();
    let spec = spec();
    let merges = spec.merges.clone().expect("merges");
    assert_eq!(
        (
            fnv1a64(&spec.tokens),
            fnv1a64(&merges),
            spec.pre.as_deref()
        ),
        (
            fx["vocabulary"]["tokens_fnv1a64"]
                .as_str()
                .expect("fingerprint")
                .to_string(),
            fx["vocabulary"]["merges_fnv1a64"]
                .as_str()
                .expect("fingerprint")
                .to_string(),
            Some("gpt-4o")
        ),
        "the synthetic gpt-oss vocabulary changed: rerun tests/fixtures/make_gptoss_token_fixtures.py"
    );
}

#[test]
fn vocabulary_facts_match_llama_cpp() {
    let fx = fixture();
    let tok = Tokenizer::new(&spec()).expect("tokenizer");
    let num = |k: &str| fx[k].as_u64().unwrap_or_else(|| panic!("{k}"));
    assert_eq!(tok.vocab_size() as u64, num("n_vocab"));
    assert_eq!(tok.bos().map(u64::from), Some(num("bos_id")));
    assert_eq!(tok.eos().map(u64::from), Some(num("eos_id")));
    assert_eq!(Some(tok.add_bos_default()), fx["add_bos"].as_bool());
    let mut eog = ids_of(&fx["eog_ids"]);
    eog.sort_unstable();
    assert_eq!(
        tok.eog_ids(),
        eog,
        "end of generation: <|endoftext|>, <|return|>, <|call|>"
    );
    // <|end|> ends a message, not the generation. It and the markup llama.cpp makes
    // user-defined render as their text, as in llama.cpp, but stay control tokens (see
    // `plain_text_never_becomes_harmony_markup`).
    let end = tok.piece_to_id("<|end|>").expect("<|end|>");
    assert!(!tok.is_eog(end));
    for id in ids_of(&fx["user_defined"]).into_iter().chain([end]) {
        assert!(tok.is_control(id), "{id}");
        let text = tok.id_to_piece(id).expect("piece").to_string();
        assert_eq!(tok.decode(&[id]), text);
    }
    // Other control tokens render as nothing.
    assert_eq!(tok.decode(&[num("bos_id") as u32]), "");
}

#[test]
fn ids_match_llama_tokenize_with_and_without_special_parsing() {
    let fx = fixture();
    let tok = Tokenizer::new(&spec()).expect("tokenizer");
    let mut failures = Vec::new();
    let special = cases(&fx, "special_cases");
    let plain = cases(&fx, "text_cases");
    assert!(special.len() >= 40 && plain.len() == special.len());
    for (label, list, parse) in [("special", &special, true), ("text", &plain, false)] {
        for (text, want) in list.iter() {
            if !parse && has_markup(text) {
                continue; // where we part from llama.cpp on purpose: the test below
            }
            let ours = if parse {
                tok.encode(text, false)
            } else {
                tok.encode_text(text, false)
            }
            .expect("encode");
            if &ours != want {
                failures.push(format!(
                    "{label} {text:?}\n   llama.cpp {want:?}\n   ours      {ours:?}"
                ));
                continue;
            }
            // Decoding (special tokens rendered) gives the text back, whole and streamed.
            assert_eq!(tok.decode_with(&ours, true), *text, "{label} {text:?}");
            let mut dec = StreamDecoder::at_text_start().render_special(true);
            let mut s: String = ours.iter().map(|&i| dec.push(&tok, i)).collect();
            s.push_str(&dec.finish());
            assert_eq!(s, *text, "{label} {text:?} streamed");
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} texts differ from llama.cpp:\n{}",
        failures.len(),
        special.len() + plain.len(),
        failures.join("\n")
    );
}

/// Harmony markup llama.cpp makes user-defined (matched even in plain text).
const MARKUP: &[&str] = &[
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|constrain|>",
];

fn has_markup(text: &str) -> bool {
    MARKUP.iter().any(|m| text.contains(m))
}

#[test]
fn plain_text_never_becomes_harmony_markup() {
    // llama.cpp matches harmony's markup in plain text too (it makes those tokens
    // user-defined), so a chat message holding `<|start|>system<|message|>` would forge a
    // turn; we keep a message's text text. Where the fixture's plain-text ids hold markup
    // tokens, ours hold none, and decode to the same text.
    let fx = fixture();
    let tok = Tokenizer::new(&spec()).expect("tokenizer");
    let markup: Vec<u32> = MARKUP.iter().filter_map(|m| tok.piece_to_id(m)).collect();
    assert_eq!(markup.len(), MARKUP.len());
    let mut checked = 0;
    for (text, llama) in cases(&fx, "text_cases") {
        if !has_markup(text) {
            continue;
        }
        let ours = tok.encode_text(text, false).expect("encode");
        assert!(
            llama.iter().any(|id| markup.contains(id)),
            "{text:?}: {llama:?}"
        );
        assert!(
            !ours.iter().any(|id| markup.contains(id)),
            "{text:?}: {ours:?}"
        );
        assert!(
            !ours.iter().any(|&id| tok.is_control(id)),
            "{text:?}: {ours:?}"
        );
        assert_eq!(tok.decode(&ours), text);
        checked += 1;
    }
    assert!(checked >= 4, "only {checked} texts with markup");
}

#[test]
fn the_o200k_expression_is_what_makes_the_ids_match() {
    // The same vocabulary with Llama 3's expression (which keeps "camelCase" whole and cuts
    // "don't" before the apostrophe) must disagree with llama.cpp's o200k ids somewhere:
    // otherwise the fixture could not tell the two apart.
    let fx = fixture();
    let mut s = spec();
    s.pre = Some("llama-bpe".into());
    let llama3 = Tokenizer::new(&s).expect("tokenizer");
    let differ: Vec<&str> = cases(&fx, "text_cases")
        .into_iter()
        .filter(|(text, want)| llama3.encode_text(text, false).expect("encode") != *want)
        .map(|(text, _)| text)
        .collect();
    for must in [
        "HTTPServer camelCase XMLHttpRequest iPhone eBay McDonald's",
        " don't  don't",
    ] {
        assert!(differ.contains(&must), "{must:?} is not among {differ:?}");
    }
    assert!(differ.len() >= 5, "only {differ:?} tell llama3 from o200k");
}
