//! The forcing grammars compile with llguidance, accept the calls we mean and refuse the
//! rest, byte by byte.

use super::*;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie, TokenId};

/// Harmony's markup, special tokens after the 256 single bytes.
const HARMONY_SPECIALS: [&str; 6] = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|constrain|>",
    "<|end|>",
    "<|call|>",
];

/// A vocabulary of single bytes, plus harmony's markup as special tokens when `harmony`
/// (the last one, `<|call|>`, the end of sequence).
fn env(harmony: bool) -> TokEnv {
    if !harmony {
        return ApproximateTokEnv::single_byte_env();
    }
    let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    for s in HARMONY_SPECIALS {
        let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
        w.extend_from_slice(s.as_bytes());
        words.push(w);
    }
    let info = TokRxInfo {
        vocab_size: words.len() as u32,
        tok_eos: words.len() as u32 - 1,
        tok_bos: None,
        tok_pad: None,
        tok_unk: None,
        tok_end_of_turn: None,
    };
    Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)))
}

/// `text` as tokens of [`env`]: harmony's markup as its special tokens, the rest as bytes.
fn tokens(text: &str, harmony: bool) -> Vec<TokenId> {
    let mut out = Vec::new();
    let mut rest = text;
    'outer: while !rest.is_empty() {
        if harmony {
            for (i, s) in HARMONY_SPECIALS.iter().enumerate() {
                if let Some(r) = rest.strip_prefix(s) {
                    out.push(256 + i as TokenId);
                    rest = r;
                    continue 'outer;
                }
            }
        }
        out.push(TokenId::from(rest.as_bytes()[0]));
        rest = &rest[1..];
    }
    out
}

fn matcher(grammar: &str, harmony: bool) -> Matcher {
    let factory = ParserFactory::new_simple(&env(harmony)).expect("factory");
    let m = Matcher::new(factory.create_parser(TopLevelGrammar::from_lark(grammar.to_string())));
    assert!(!m.is_error(), "{grammar}\n{:?}", m.get_error());
    m
}

/// Whether the grammar takes `text` whole: every token allowed by the mask and consumed,
/// and the grammar accepting at the end.
fn takes(grammar: &str, text: &str, harmony: bool) -> bool {
    let mut m = matcher(grammar, harmony);
    for t in tokens(text, harmony) {
        let allowed = m.compute_mask().map(|mask| mask.is_allowed(t));
        if allowed.ok() != Some(true) || m.consume_token(t).is_err() {
            return false;
        }
    }
    m.is_accepting().unwrap_or(false)
}

fn grammar(format: ToolFormat, choice: &ToolChoice, parallel: bool) -> String {
    call_grammar(format, &[weather(), time()], choice, parallel)
        .unwrap_or_else(|e| panic!("{format:?}: {e}"))
}

/// The text of calls, written as our grammars write them.
fn written(format: ToolFormat, calls: &[(&str, Value)]) -> String {
    let calls: Vec<ToolCall> = calls
        .iter()
        .map(|(n, a)| ToolCall::new(*n, a.clone()))
        .collect();
    let text = format_calls(format, &calls);
    // Harmony's grammar ends at the arguments: `<|call|>` is the stop token.
    text.strip_suffix("<|call|>").unwrap_or(&text).to_string()
}

#[test]
fn every_grammar_compiles_and_takes_a_well_formed_call() {
    let paris = json!({"city": "Paris", "unit": "celsius"});
    for format in ToolFormat::ALL {
        let harmony = format == ToolFormat::Harmony;
        for choice in [
            ToolChoice::Required,
            ToolChoice::Named("get_weather".into()),
        ] {
            for parallel in [false, true] {
                let g = grammar(format, &choice, parallel);
                let one = written(format, &[("get_weather", paris.clone())]);
                assert!(
                    takes(&g, &one, harmony),
                    "{format:?} {choice:?}\n{g}\n{one}"
                );
                // The call parses back.
                let p = parse(format, &one);
                assert_eq!(
                    named(&p.calls),
                    [("get_weather".to_string(), paris.clone())]
                );
            }
        }
    }
}

#[test]
fn parallel_grammars_take_several_calls() {
    let two = [
        ("get_weather", json!({"city": "Oslo"})),
        ("get_time", json!({})),
    ];
    for format in [
        ToolFormat::Hermes,
        ToolFormat::Llama3,
        ToolFormat::Mistral,
        ToolFormat::Gemma,
    ] {
        let text = written(format, &two);
        assert!(
            takes(&grammar(format, &ToolChoice::Required, true), &text, false),
            "{format:?} {text}"
        );
        assert!(
            !takes(&grammar(format, &ToolChoice::Required, false), &text, false),
            "{format:?}"
        );
    }
}

#[test]
fn grammars_refuse_undeclared_functions_and_bad_arguments() {
    for format in ToolFormat::ALL {
        let harmony = format == ToolFormat::Harmony;
        let g = grammar(format, &ToolChoice::Required, true);
        let bad = [
            ("get_wether", json!({"city": "Paris"})),
            ("get_weather", json!({"town": "Paris"})),
            ("get_weather", json!({"city": 3})),
            ("get_weather", json!({"city": "Paris", "unit": "kelvin"})),
            ("get_weather", json!({})),
        ];
        for (name, args) in bad {
            let text = written(format, &[(name, args.clone())]);
            assert!(!takes(&g, &text, harmony), "{format:?} took {text}");
        }
        // Named: the other declared function is refused too.
        let named_g = grammar(format, &ToolChoice::Named("get_weather".into()), false);
        let other = written(format, &[("get_time", json!({}))]);
        assert!(!takes(&named_g, &other, harmony), "{format:?} took {other}");
        // No free blanks inside the JSON.
        let loose = written(format, &[("get_weather", json!({"city": "Paris"}))])
            .replace("{\"city\": ", "{ \"city\": ");
        assert!(!takes(&g, &loose, harmony), "{format:?} took {loose}");
    }
}

#[test]
fn harmony_may_reason_first() {
    let g = grammar(ToolFormat::Harmony, &ToolChoice::Required, false);
    let text = format!(
        "<|channel|>analysis<|message|>The user asks about\nParis.<|end|><|start|>assistant{}",
        written(ToolFormat::Harmony, &[("get_time", json!({}))])
    );
    assert!(takes(&g, &text, true), "{text}");
}

#[test]
fn grammar_errors_name_the_problem() {
    let tools = [weather()];
    let err = |f: ToolFormat, t: &[Tool], c: ToolChoice| {
        call_grammar(f, t, &c, false).expect_err("an error")
    };
    assert!(err(ToolFormat::Hermes, &tools, ToolChoice::None).contains("none"));
    assert!(err(ToolFormat::Hermes, &[], ToolChoice::Required).contains("no tools"));
    assert!(err(ToolFormat::Hermes, &tools, ToolChoice::Named("nope".into())).contains("\"nope\""));
    let odd = Tool {
        name: "a b".into(),
        description: None,
        parameters: json!({}),
    };
    assert!(err(ToolFormat::Hermes, &[odd], ToolChoice::Required).contains("\"a b\""));
    let list = Tool {
        name: "f".into(),
        description: None,
        parameters: json!({"type": "array"}),
    };
    assert!(err(ToolFormat::Hermes, &[list], ToolChoice::Required).contains("object"));
    // A schema without a type gets one: arguments stay an object.
    let untyped = Tool {
        name: "f".into(),
        description: None,
        parameters: json!({"properties": {"x": {"type": "integer"}}}),
    };
    let g = call_grammar(ToolFormat::Hermes, &[untyped], &ToolChoice::Required, false)
        .expect("grammar");
    assert!(takes(
        &g,
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>",
        false
    ));
    assert!(!takes(
        &g,
        "<tool_call>\n{\"name\": \"f\", \"arguments\": 1}\n</tool_call>",
        false
    ));
}

#[test]
fn auto_grammars_take_text_or_well_formed_calls() {
    let call = |f| written(f, &[("get_weather", json!({"city": "Paris"}))]);
    let bad = |f| written(f, &[("get_weather", json!({"town": "Paris"}))]);
    for format in [ToolFormat::Hermes, ToolFormat::Mistral, ToolFormat::Gemma] {
        let g = grammar(format, &ToolChoice::Auto, true);
        assert!(
            takes(&g, "It is sunny.\nAsk me more.", false),
            "{format:?}\n{g}"
        );
        assert!(takes(&g, &call(format), false), "{format:?}");
        assert!(
            takes(&g, &format!("Let me check.\n{}", call(format)), false),
            "{format:?}"
        );
        assert!(!takes(&g, &bad(format), false), "{format:?}");
        assert!(
            !takes(&g, &format!("Well, {}", bad(format)), false),
            "{format:?}"
        );
        // No text after the calls.
        assert!(
            !takes(&g, &format!("{} done", call(format)), false),
            "{format:?}"
        );
    }
    let g = grammar(ToolFormat::Llama3, &ToolChoice::Auto, true);
    assert!(takes(&g, "It is sunny.", false), "{g}");
    assert!(takes(&g, &call(ToolFormat::Llama3), false));
    assert!(!takes(&g, &bad(ToolFormat::Llama3), false));
    assert!(!takes(&g, " {\"x\": 1}", false));
    let g = grammar(ToolFormat::Harmony, &ToolChoice::Auto, false);
    let final_answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.";
    assert!(takes(&g, final_answer, true), "{g}");
    assert!(takes(&g, &call(ToolFormat::Harmony), true));
    assert!(!takes(&g, &bad(ToolFormat::Harmony), true));
}
