//! Phi-3's published chat template (tests/fixtures/templates) through minijinja, and through
//! the tokenizer of the small `phi3` model that carries it: the rendered prompt is the text
//! Phi-3 was trained on, its markup comes out as control tokens and message contents as text.

use super::{builtin, ChatTemplate, Message};
use crate::text::tokenizer::{Tokenizer, TokenizerSpec};
use crate::text::{resolve_chat_template, resolve_template};
use ringllm_kernels::GgmlType;
use ringllm_model::gguf::GgufFile;
use ringllm_model::synth::{synth_model, SynthArch, SynthSpec};
use std::path::Path;

const PHI3: &str =
    include_str!("../../../../tests/fixtures/templates/microsoft-Phi-3.5-mini-instruct.jinja");

fn m(role: &str, content: &str) -> Message {
    Message::new(role, content)
}

fn conv() -> Vec<Message> {
    vec![
        m("system", "Be brief."),
        m("user", "Hi"),
        m("assistant", "Hello!"),
        m("user", "2+2?"),
    ]
}

const EXPECTED: &str = "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n\
                        <|assistant|>\nHello!<|end|>\n<|user|>\n2+2?<|end|>\n<|assistant|>\n";

#[test]
fn the_published_template_renders_phi3s_prompt() {
    let t = ChatTemplate::new(PHI3, "<s>", "<|endoftext|>").expect("compiles");
    assert_eq!(t.render(&conv(), true).expect("renders"), EXPECTED);
    // No generation prompt: the end-of-text token closes the conversation; an empty system
    // prompt is left out.
    let short = [m("system", ""), m("user", "Hi")];
    assert_eq!(
        t.render(&short, false).expect("renders"),
        "<|user|>\nHi<|end|>\n<|endoftext|>"
    );
    // The built-in family template (for files without one) gives the same prompt.
    let family = ChatTemplate::new(builtin("phi3").expect("built in"), "<s>", "</s>").unwrap();
    assert_eq!(family.render(&conv(), true).unwrap(), EXPECTED);
    assert_eq!(
        family.render(&short, true).unwrap(),
        "<|user|>\nHi<|end|>\n<|assistant|>\n"
    );
}

fn small_phi3() -> (TokenizerSpec, Tokenizer) {
    let bytes = synth_model(&SynthSpec::new(SynthArch::Phi3, GgmlType::F32, 1)).expect("synth");
    let f = GgufFile::from_bytes(bytes).expect("reads back");
    let spec = TokenizerSpec::from_gguf(f.metadata()).expect("tokenizer metadata");
    let tok = Tokenizer::new(&spec).expect("tokenizer");
    (spec, tok)
}

#[test]
fn the_small_phi3_carries_it_and_its_markup_is_control_tokens() {
    let (spec, tok) = small_phi3();
    assert_eq!(spec.chat_template.as_deref(), Some(PHI3));
    let path = Path::new("phi3.gguf");
    let (t, note) = resolve_chat_template(None, &spec, &tok, path, ringllm_model::Arch::Phi3)
        .expect("resolves")
        .expect("has a template");
    assert!(note.is_none(), "the file's own template is used");
    let user = "I typed <|end|> myself";
    let r = t
        .render_pieces(&[m("user", user)], true, &|s| tok.control_spans(s))
        .expect("renders");
    assert_eq!(r.text, format!("<|user|>\n{user}<|end|>\n<|assistant|>\n"));
    let ids = tok.encode_pieces(&r.pieces(), false).expect("encodes");
    let id = |s: &str| tok.piece_to_id(s).expect(s);
    let (user_id, end, asst) = (id("<|user|>"), id("<|end|>"), id("<|assistant|>"));
    assert_eq!(ids[0], user_id);
    let controls: Vec<u32> = ids.iter().copied().filter(|&x| tok.is_control(x)).collect();
    assert_eq!(controls, [user_id, end, asst]);
    assert_eq!(ids.iter().filter(|&&x| x == end).count(), 1);
    assert!(tok.is_control(end) && tok.is_eog(end));
    assert!(tok.is_eog(id("<|endoftext|>")));
    // An unknown built-in name is refused by name.
    assert!(resolve_template(Some("phi-3"), &spec, &tok, path).is_err());
}

#[test]
fn whitespace_after_phi3s_special_tokens_is_dropped_as_llamacpp_does() {
    let (mut spec, tok) = small_phi3();
    assert!(
        spec.rstrip_specials,
        "a phi3 file (by general.name, as llama.cpp tells)"
    );
    let id = |s: &str| tok.piece_to_id(s).expect(s);
    let prompt = "<|user|>\nHi<|end|>\n<|assistant|>\n";
    let ids = tok.encode(prompt, false).expect("encodes");
    let hi = tok.encode_text("Hi", false).expect("encodes");
    let want: Vec<u32> = [id("<|user|>")]
        .into_iter()
        .chain(hi.iter().copied())
        .chain([id("<|end|>"), id("<|assistant|>")])
        .collect();
    assert_eq!(ids, want);
    // Across pieces: the content's leading blanks go too (the prompt is one text); not after
    // <|endoftext|>, and not without the rule.
    let pieces = [
        crate::text::tokenizer::Piece::special("<|user|>\n"),
        crate::text::tokenizer::Piece::text("  Hi"),
    ];
    assert_eq!(
        tok.encode_pieces(&pieces, false).unwrap(),
        want[..1 + hi.len()]
    );
    let eot = tok.encode("<|endoftext|>\n", false).unwrap();
    assert!(eot.len() > 1, "{eot:?}");
    spec.rstrip_specials = false;
    let plain = Tokenizer::new(&spec).unwrap();
    assert!(plain.encode(prompt, false).unwrap().len() > want.len());
}
