//! Token ids against independent oracles, on the real models' GGUF metadata:
//!
//! - tests/fixtures/tokens-transformers.json: HF transformers' own tokenizer built from each GGUF
//!   (tests/python/make_token_fixtures.py), with llama.cpp's ids recorded where llama.cpp
//!   disagrees with transformers — we follow llama.cpp there;
//! - tests/fixtures/tokens-llamacpp.json: llama.cpp's `llama-tokenize`;
//! - when present, llama.cpp's own tokenizer tests (the `ggml-vocab-*.gguf` vocabularies with
//!   `.inp`/`.out` files in a llama.cpp checkout's models/ folder, found through
//!   $RINGLLM_LLAMACPP_VOCABS or ~/.cache/ringllm/llama.cpp/models).
//!
//! And for every text: decoding inverts encoding, and streaming the ids one by one gives the
//! same text in chunks that never split a character.

use ringllm::text::tokenizer::{StreamDecoder, Tokenizer, TokenizerError, TokenizerSpec};
use ringllm_model::gguf::GgufFile;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn spec_of(path: &Path) -> TokenizerSpec {
    let file = GgufFile::open(path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (the test models are missing? run scripts/fetch-models)",
            path.display()
        )
    });
    TokenizerSpec::from_gguf(file.metadata())
        .unwrap_or_else(|e| panic!("{}: tokenizer metadata: {e}", path.display()))
}

fn model(name: &str) -> (TokenizerSpec, Tokenizer) {
    let spec = spec_of(&root().join("models").join(name));
    let tok = Tokenizer::new(&spec).unwrap_or_else(|e| panic!("{name}: {e}"));
    (spec, tok)
}

fn fixture(name: &str) -> Value {
    let path = root().join("tests/fixtures").join(name);
    let src = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&src).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
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

/// The text decoding gives back: SentencePiece cannot tell a written `▁` from a space.
fn expected_text(spec: &TokenizerSpec, text: &str) -> String {
    if spec.model == "llama" || spec.model == "gemma4" {
        text.replace('\u{2581}', " ")
    } else {
        text.to_string()
    }
}

/// Decoding, whole and streamed, gives `want` back; no chunk splits a character.
fn check_decoding(label: &str, tok: &Tokenizer, ids: &[u32], want: &str) {
    let whole = tok.decode_with(ids, true);
    assert_eq!(whole, want, "{label}: decode");
    let mut dec = StreamDecoder::at_text_start().render_special(true);
    let mut streamed = String::new();
    for (i, &id) in ids.iter().enumerate() {
        let chunk = dec.push(tok, id);
        assert!(
            !chunk.contains('\u{FFFD}') || want.contains('\u{FFFD}'),
            "{label}: token {i} ({id}) split a character: {chunk:?}"
        );
        streamed.push_str(&chunk);
        assert!(
            want.starts_with(&streamed),
            "{label}: after token {i} the stream is {streamed:?}, not a prefix of the text"
        );
    }
    streamed.push_str(&dec.finish());
    assert_eq!(streamed, whole, "{label}: streamed text");
}

const MODELS: &[&str] = &[
    "gemma-3-270m-q4_k_m.gguf",
    "smollm2-135m-instruct-q4_1.gguf",
];

#[test]
fn ids_match_transformers_or_llamacpp_where_they_disagree() {
    let fx = fixture("tokens-transformers.json");
    for name in MODELS {
        let (spec, tok) = model(name);
        let m = &fx[*name];
        let cases = m["cases"]
            .as_array()
            .unwrap_or_else(|| panic!("{name}: no cases in the fixture"));
        assert!(cases.len() >= 40, "{name}: only {} cases", cases.len());
        // Texts where llama.cpp disagrees with transformers: we follow llama.cpp.
        let differs: &[Value] = match m.get("llamacpp_differs").and_then(Value::as_array) {
            Some(d) => d,
            None => &[],
        };
        let mut failures = Vec::new();
        for case in cases.iter().chain(differs) {
            let text = case["text"].as_str().expect("text");
            let want = ids_of(case.get("llamacpp_ids").unwrap_or(&case["ids"]));
            let ours = tok.encode(text, false).expect("encode");
            if ours != want {
                failures.push(format!("{text:?}\n   want {want:?}\n   ours {ours:?}"));
            }
            check_decoding(
                &format!("{name} {text:?}"),
                &tok,
                &ours,
                &expected_text(&spec, text),
            );
        }
        assert!(
            failures.is_empty(),
            "{name}: {} of {} texts differ:\n{}",
            failures.len(),
            cases.len() + differs.len(),
            failures.join("\n")
        );
        // BOS: transformers adds exactly what we add by default.
        let bos = ids_of(&m["bos_prefix"]);
        assert_eq!(tok.add_bos_default(), !bos.is_empty(), "{name}: add_bos");
        let with = tok.encode("Hello", tok.add_bos_default()).expect("encode");
        assert_eq!(with[..bos.len()], bos[..], "{name}: BOS prefix");
        eprintln!(
            "{name}: {} texts as transformers, {} as llama.cpp where it disagrees",
            cases.len(),
            differs.len()
        );
    }
}

#[test]
fn ids_and_vocabulary_facts_match_llama_tokenize() {
    let fx = fixture("tokens-llamacpp.json");
    for name in MODELS {
        let (spec, tok) = model(name);
        let m = &fx[*name];
        // Older fixtures put BOS in front of every case and said so in "bos_prefix".
        let bos = match m.get("bos_prefix") {
            Some(v) => ids_of(v),
            None => Vec::new(),
        };
        if let Some(add_bos) = m.get("add_bos").and_then(Value::as_bool) {
            assert_eq!(tok.add_bos_default(), add_bos, "{name}: add_bos");
        }
        if let Some(id) = m.get("bos_id").and_then(Value::as_u64) {
            assert_eq!(tok.bos().map(u64::from), Some(id), "{name}: BOS");
        }
        if let Some(v) = m.get("eog_ids") {
            let mut want = ids_of(v);
            want.sort_unstable();
            assert_eq!(tok.eog_ids(), want, "{name}: end-of-generation ids");
        }
        if let Some(n) = m.get("n_vocab").and_then(Value::as_u64) {
            assert_eq!(tok.vocab_size() as u64, n, "{name}: vocabulary size");
        }
        let cases = m["cases"].as_array().expect("cases");
        assert!(!cases.is_empty());
        for case in cases {
            let text = case["text"].as_str().expect("text");
            let want = ids_of(&case["ids"]);
            let ours = tok.encode(text, !bos.is_empty()).expect("encode");
            assert_eq!(ours, want, "{name}: {text:?}");
            check_decoding(
                &format!("{name} {text:?}"),
                &tok,
                &ours[bos.len()..],
                &expected_text(&spec, text),
            );
        }
    }
}

#[test]
fn streaming_a_continuation_keeps_every_piece() {
    // Generated tokens continue a prompt: StreamDecoder::new() never drops a leading space.
    for name in MODELS {
        let (_, tok) = model(name);
        let ids = tok.encode(" world, 世界 👋", false).expect("encode");
        let mut dec = StreamDecoder::new();
        let mut s: String = ids.iter().map(|&i| dec.push(&tok, i)).collect();
        s.push_str(&dec.finish());
        assert_eq!(s, " world, 世界 👋", "{name}");
    }
}

#[test]
fn byte_tokens_of_one_character_wait_for_each_other() {
    let (_, tok) = model("gemma-3-270m-q4_k_m.gguf");
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
    // Cut short: the incomplete character becomes one U+FFFD, as decode() makes it.
    let mut dec = StreamDecoder::new();
    let mut s: String = ids[..2].iter().map(|&i| dec.push(&tok, i)).collect();
    s.push_str(&dec.finish());
    assert_eq!(s, tok.decode(&ids[..2]));
    assert_eq!(s, "\u{FFFD}");
}

#[test]
fn special_tokens_and_end_of_generation() {
    let (_, s) = model("smollm2-135m-instruct-q4_1.gguf");
    let start = s.piece_to_id("<|im_start|>").expect("<|im_start|>");
    let end = s.piece_to_id("<|im_end|>").expect("<|im_end|>");
    let ids = s
        .encode("<|im_start|>user\nHi<|im_end|>", false)
        .expect("encode");
    assert_eq!(ids.first(), Some(&start));
    assert_eq!(ids.last(), Some(&end));
    assert_eq!(s.decode(&ids), "user\nHi");
    assert!(s.eog_ids().contains(&end));
    assert!(!s.eog_ids().contains(&start));
    assert!(!s.add_bos_default());

    let (_, g) = model("gemma-3-270m-q4_k_m.gguf");
    let eot = g.piece_to_id("<end_of_turn>").expect("<end_of_turn>");
    assert!(g.eog_ids().contains(&eot) && g.eog_ids().contains(&1));
    assert!(g.add_bos_default());
    assert_eq!(g.bos(), Some(2));
    assert_eq!(g.id_to_piece(eot), Some("<end_of_turn>"));
    assert_eq!(g.vocab_size(), 262_144);
    assert_eq!(g.decode_with(&[eot], true), "<end_of_turn>");
    assert_eq!(g.decode(&[eot]), "");
}

#[test]
fn unknown_pre_tokenizer_is_refused_by_name() {
    let (mut spec, _) = model("smollm2-135m-instruct-q4_1.gguf");
    spec.pre = Some("mystery-bpe".into());
    match Tokenizer::new(&spec) {
        Err(e @ TokenizerError::UnknownPreTokenizer { .. }) => {
            assert!(e.to_string().contains("mystery-bpe"), "{e}")
        }
        other => panic!("expected an unknown pre-tokenizer error, got {other:?}"),
    }
}

/// llama.cpp's tokenizer tests: `ggml-vocab-NAME.gguf.inp` holds texts separated by
/// `__ggml_vocab_test__` lines, `.out` one line of ids per text.
#[test]
#[ignore = "needs llama.cpp's vocabulary test files (RINGLLM_LLAMACPP_VOCABS); run with --ignored"]
fn llamacpp_vocabulary_tests_when_available() {
    let dir = match std::env::var_os("RINGLLM_LLAMACPP_VOCABS") {
        Some(d) => PathBuf::from(d),
        None => match std::env::var_os("HOME") {
            Some(h) => PathBuf::from(h).join(".cache/ringllm/llama.cpp/models"),
            None => return,
        },
    };
    let Ok(entries) = std::fs::read_dir(&dir) else {
        eprintln!(
            "skipped: no llama.cpp vocabularies at {} (set RINGLLM_LLAMACPP_VOCABS)",
            dir.display()
        );
        return;
    };
    let mut inputs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".gguf.inp"))
        .collect();
    inputs.sort();
    let (mut passed, mut skipped) = (Vec::new(), Vec::new());
    for inp in inputs {
        let base = inp.to_string_lossy().trim_end_matches(".inp").to_string();
        let gguf = PathBuf::from(&base);
        let out = PathBuf::from(format!("{base}.out"));
        let (Ok(texts), Ok(expected)) =
            (std::fs::read_to_string(&inp), std::fs::read_to_string(&out))
        else {
            continue;
        };
        if !gguf.exists() {
            continue;
        }
        let label = gguf
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        let spec = spec_of(&gguf);
        let tok = match Tokenizer::new(&spec) {
            Ok(t) => t,
            Err(e @ TokenizerError::UnsupportedModel(_))
            | Err(e @ TokenizerError::UnknownPreTokenizer { .. }) => {
                skipped.push(format!("{label} ({e})"));
                continue;
            }
            Err(e) => panic!("{label}: {e}"),
        };
        // Every text is followed by a separator line.
        let mut texts: Vec<&str> = texts.split("\n__ggml_vocab_test__\n").collect();
        if texts.last() == Some(&"") {
            texts.pop();
        }
        let lines: Vec<&str> = expected.lines().collect();
        assert!(
            lines.len() >= texts.len(),
            "{label}: fewer outputs than inputs"
        );
        for (text, line) in texts.iter().zip(&lines) {
            let want: Vec<u32> = line
                .split_whitespace()
                .map(|x| {
                    x.parse()
                        .unwrap_or_else(|_| panic!("{label}: bad id {x:?}"))
                })
                .collect();
            let ours = tok.encode(text, false).expect("encode");
            assert_eq!(ours, want, "{label}: {text:?}");
            // Byte-level vocabularies give every text back; SentencePiece ones spell a run of
            // spaces at the very start after the prefix space, which decoding keeps.
            check_decoding(
                &format!("{label} {text:?}"),
                &tok,
                &ours,
                &expected_text(&spec, text),
            );
        }
        passed.push(label);
    }
    eprintln!(
        "llama.cpp vocabulary tests passed: {}; skipped: {}",
        passed.join(", "),
        skipped.join("; ")
    );
}
