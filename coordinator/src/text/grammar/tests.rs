//! Grammars over a real vocabulary (SmolLM2's): random walks through the masks give only
//! outputs that parse and keep the schema, control tokens are never allowed by text, the end
//! of generation only where the grammar is complete, and what llguidance cannot take is an
//! error naming it.

use super::*;
use crate::text::tokenizer::{Tokenizer, TokenizerSpec};
use rand::{Rng, SeedableRng};
use std::sync::OnceLock;

fn smollm2() -> &'static (Arc<Tokenizer>, Grammars) {
    static V: OnceLock<(Arc<Tokenizer>, Grammars)> = OnceLock::new();
    V.get_or_init(|| {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../models/smollm2-135m-instruct-q4_1.gguf");
        let file = ringllm_model::gguf::GgufFile::open(&path)
            .unwrap_or_else(|e| panic!("{} (scripts/fetch-models): {e}", path.display()));
        let spec = TokenizerSpec::from_gguf(file.metadata()).expect("tokenizer metadata");
        let tok = Arc::new(Tokenizer::new(&spec).expect("tokenizer"));
        let g = Grammars::new(&tok, tok.vocab_size()).expect("grammars");
        (tok, g)
    })
}

/// Generates under `spec`'s masks with random logits (seeded): the allowed token with the
/// highest random logit each step, ending at the first end-of-generation token. Returns the
/// text and whether it ended there (not at `max` tokens).
fn walk(spec: &GrammarSpec, seed: u64, max: usize) -> (String, bool) {
    let (tok, g) = smollm2();
    let mut c = g.compile(spec).expect("compiles");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut ids = Vec::new();
    let eog = tok.eog_ids();
    let mut token = None;
    for _ in 0..max {
        c.advance(token).expect("advance");
        let mut logits: Vec<f32> = (0..tok.vocab_size()).map(|_| rng.random::<f32>()).collect();
        // Favour ending so walks finish: a grammar that is complete takes EOS.
        for &e in &eog {
            logits[e as usize] += 0.5;
        }
        assert!(c.apply(&mut logits), "the mask allows something");
        let (id, _) = logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &l)| if l > b.1 { (i, l) } else { b },
            );
        let id = id as u32;
        if eog.contains(&id) {
            return (tok.decode(&ids), true);
        }
        assert!(
            !tok.is_control(id),
            "a control token allowed by the grammar: {id}"
        );
        ids.push(id);
        token = Some(id);
    }
    (tok.decode(&ids), false)
}

fn schema() -> Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}
        },
        "required": ["city", "unit", "days"],
        "additionalProperties": false
    })
}

#[test]
fn random_walks_under_a_schema_give_valid_json() {
    let spec = GrammarSpec::JsonSchema(schema());
    for seed in 0..20 {
        let (text, ended) = walk(&spec, seed, 200);
        assert!(ended, "seed {seed}: did not end: {text:?}");
        let v: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("seed {seed}: not JSON ({e}): {text:?}"));
        let o = v.as_object().expect("an object");
        assert!(o
            .keys()
            .all(|k| ["city", "unit", "days", "tags"].contains(&k.as_str())));
        let city = o["city"].as_str().expect("city is a string");
        assert!(city.chars().count() <= 12, "{city:?}");
        assert!(["celsius", "fahrenheit"].contains(&o["unit"].as_str().expect("unit")));
        let days = o["days"].as_i64().expect("days is an integer");
        assert!((1..=14).contains(&days), "days {days}");
        if let Some(tags) = o.get("tags") {
            let tags = tags.as_array().expect("tags is an array");
            assert!(tags.len() <= 3 && tags.iter().all(Value::is_boolean));
        }
        // Compact separators: no free whitespace outside strings.
        assert!(!text.contains("\n"), "{text:?}");
    }
}

#[test]
fn any_json_object_and_a_regex() {
    for seed in 0..5 {
        let (text, ended) = walk(&GrammarSpec::JsonObject, seed, 60);
        if ended {
            let v: Value = serde_json::from_str(&text).expect("JSON");
            assert!(v.is_object(), "{text:?}");
        } else {
            assert!(text.starts_with('{'), "{text:?}");
        }
    }
    let rx = GrammarSpec::Regex("(yes|no), [0-9]{2}".into());
    for seed in 0..10 {
        let (text, ended) = walk(&rx, seed, 20);
        assert!(ended, "{text:?}");
        let (word, num) = text.split_once(", ").expect("the separator");
        assert!(word == "yes" || word == "no", "{text:?}");
        assert!(
            num.len() == 2 && num.bytes().all(|b| b.is_ascii_digit()),
            "{text:?}"
        );
    }
}

#[test]
fn end_of_generation_only_when_complete_and_control_tokens_never() {
    let (tok, g) = smollm2();
    let mut c = g
        .compile(&GrammarSpec::Regex("ab?".into()))
        .expect("compiles");
    c.advance(None).expect("first mask");
    let im_end = tok.piece_to_id("<|im_end|>").expect("<|im_end|>");
    let im_start = tok.piece_to_id("<|im_start|>").expect("<|im_start|>");
    let mut logits = vec![0.0f32; tok.vocab_size()];
    assert!(c.apply(&mut logits));
    assert_eq!(
        logits[im_end as usize],
        f32::NEG_INFINITY,
        "nothing written yet"
    );
    assert_eq!(logits[im_start as usize], f32::NEG_INFINITY);
    let a = tok.encode_text("a", false).expect("encode");
    assert_eq!(a.len(), 1);
    assert_eq!(logits[a[0] as usize], 0.0, "`a` is allowed");
    c.advance(Some(a[0])).expect("take `a`");
    let mut logits = vec![0.0f32; tok.vocab_size()];
    assert!(c.apply(&mut logits));
    assert_eq!(logits[im_end as usize], 0.0, "complete: the end is allowed");
    assert_eq!(logits[im_start as usize], f32::NEG_INFINITY);
    // A token the mask forbids is refused by name, never taken silently.
    let z = tok.encode_text("z", false).expect("encode")[0];
    let e = c.advance(Some(z)).expect_err("`z` is outside the grammar");
    assert!(e.contains("refused token"), "{e}");
}

#[test]
fn what_llguidance_cannot_take_is_named() {
    let (_, g) = smollm2();
    let bad = [
        (
            serde_json::json!({"oneOf": [
                {"type": "object", "properties": {"a": {"type": "string"}}},
                {"type": "object", "properties": {"b": {"type": "string"}}}
            ]}),
            "oneOf",
        ),
        (
            serde_json::json!({"type": "object", "if": {"required": ["a"]}, "then": {}}),
            "if",
        ),
        (serde_json::json!({"type": "strnig"}), "strnig"),
        (serde_json::json!({"$ref": "#/$defs/missing"}), "missing"),
    ];
    for (schema, word) in bad {
        let e = g
            .compile(&GrammarSpec::JsonSchema(schema.clone()))
            .map(|_| ())
            .expect_err(&format!("{schema} refused"));
        assert!(e.contains(word), "{schema}: {e}");
    }
    let e = g
        .compile(&GrammarSpec::Lark("start: foo".into()))
        .expect_err("an undefined rule");
    assert!(e.contains("foo"), "{e}");
    assert!(g.compile(&GrammarSpec::Regex("(".into())).is_err());
}
