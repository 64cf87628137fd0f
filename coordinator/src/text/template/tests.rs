//! Tests of the chat templates.

use super::*;

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

fn builtin_template(name: &str, bos: &str, eos: &str) -> ChatTemplate {
    let src = builtin(name).unwrap_or_else(|| panic!("no built-in {name}"));
    ChatTemplate::new(src, bos, eos).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn builtins_are_listed_and_compile() {
    assert_eq!(
        builtin_names(),
        vec!["chatml", "gemma", "llama3", "phi3", "harmony"]
    );
    for name in builtin_names() {
        builtin_template(name, "<s>", "</s>");
    }
    assert!(builtin("nope").is_none());
}

#[test]
fn chatml() {
    let t = builtin_template("chatml", "", "");
    assert_eq!(
        t.render(&conv(), true).expect("renders"),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    assert_eq!(
        t.render(&conv()[1..2], false).expect("renders"),
        "<|im_start|>user\nHi<|im_end|>\n"
    );
}

#[test]
fn gemma_folds_the_system_prompt_into_the_first_turn() {
    let t = builtin_template("gemma", "<bos>", "<eos>");
    assert_eq!(
        t.render(&conv(), true).expect("renders"),
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n\
         <start_of_turn>model\nHello!<end_of_turn>\n\
         <start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n"
    );
    // Without a system prompt, and contents trimmed.
    assert_eq!(
        t.render(&[m("user", "  Hi \n")], true).expect("renders"),
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    );
    assert_eq!(t.render(&[], false).expect("renders"), "<bos>");
}

#[test]
fn llama3() {
    let t = builtin_template("llama3", "<|begin_of_text|>", "<|eot_id|>");
    assert_eq!(
        t.render(&conv()[..2], true).expect("renders"),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

/// SmolLM2's own template, as its GGUF carries it; the expected text is what transformers'
/// `apply_chat_template` renders from that GGUF.
#[test]
fn smollm2_template_from_the_gguf() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/smollm2-135m-instruct-q4_1.gguf");
    let file = ringllm_model::gguf::GgufFile::open(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-models)", path.display()));
    let src = file
        .metadata()
        .opt_str("tokenizer.chat_template")
        .expect("metadata")
        .expect("SmolLM2 has a chat template");
    let t = ChatTemplate::new(src, "<|im_start|>", "<|im_end|>").expect("compiles");
    let two_turns = [
        m("user", "Hi"),
        m("assistant", "Hello! How can I help?"),
        m("user", "What is 2+2?"),
    ];
    assert_eq!(
        t.render(&two_turns, true).expect("renders"),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>\n\
         <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    let mut with_system = vec![m("system", "Be brief.")];
    with_system.extend(two_turns.iter().cloned());
    assert_eq!(
        t.render(&with_system, false).expect("renders"),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello! How can I help?<|im_end|>\n\
         <|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    );
}

/// `<|x|>` texts, as a vocabulary's control tokens would be found.
fn spans(text: &str) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(i) = text[at..].find("<|x|>") {
        out.push(at + i..at + i + 5);
        at += i + 5;
    }
    out
}

fn contents(r: &Rendered) -> Vec<&str> {
    r.content.iter().map(|c| &r.text[c.clone()]).collect()
}

#[test]
fn contents_are_found_in_the_rendering() {
    let t = builtin_template("chatml", "", "");
    let msgs = [m("system", "Be brief."), m("user", "<|x|>system\nHi")];
    let r = t.render_pieces(&msgs, true, &spans).expect("renders");
    assert_eq!(r.text, t.render(&msgs, true).expect("renders"));
    assert_eq!(contents(&r), ["Be brief.", "<|x|>system\nHi"]);
    let p = r.pieces();
    assert_eq!(p[0], Piece::special("<|im_start|>system\n"));
    assert_eq!(p[1], Piece::text("Be brief."));
    assert_eq!(p[3], Piece::text("<|x|>system\nHi"));
    assert_eq!(
        p.last(),
        Some(&Piece::special("<|im_end|>\n<|im_start|>assistant\n"))
    );
    // Trimmed contents (Gemma, Llama 3): the blank ends are outside the marks.
    let g = builtin_template("gemma", "<bos>", "<eos>");
    let r = g
        .render_pieces(&[m("user", "  <|x|> hi \n")], true, &spans)
        .expect("renders");
    assert_eq!(contents(&r), ["<|x|> hi"]);
    // Our marks typed in a message are dropped.
    let r = t
        .render_pieces(&[m("user", "a\u{FDD0}b\u{FDD1}")], false, &spans)
        .expect("renders");
    assert_eq!(r.text, "<|im_start|>user\nab<|im_end|>\n");
    assert_eq!(contents(&r), ["ab"]);
}

#[test]
fn a_template_that_cuts_contents_falls_back_to_marking_special_texts() {
    // Like Qwen 3 with reasoning: only what follows </think> is kept.
    let src = "{% for message in messages %}<|im_start|>{{ message.role }}\n\
               {{ message.content.split('</think>')[-1].lstrip('\n') }}<|im_end|>\n{% endfor %}";
    let t = ChatTemplate::new(src, "", "").expect("compiles");
    let msgs = [m("assistant", "<think>a</think>\nanswer <|x|> more")];
    let r = t.render_pieces(&msgs, false, &spans).expect("renders");
    assert_eq!(
        r.text,
        "<|im_start|>assistant\nanswer <|x|> more<|im_end|>\n"
    );
    assert_eq!(contents(&r), ["<|x|>"]);
    // Without special texts nothing needs marking.
    let plain = [m("assistant", "<think>a</think>\nanswer")];
    let r = t.render_pieces(&plain, false, &spans).expect("renders");
    assert!(r.content.is_empty());
    // A template that cuts the special text itself: refused, naming it.
    let cut = ChatTemplate::new("{{ messages[0].content[:3] }}", "", "").expect("compiles");
    let e = cut
        .render_pieces(&[m("user", "<|x|>")], false, &spans)
        .expect_err("cannot be marked");
    assert!(
        matches!(&e, TemplateError::Unmarkable(t) if t == "<|x|>"),
        "{e}"
    );
    // A template that escapes the marks (JSON with ensure_ascii) while the special text
    // stays: refused too, not parsed.
    let json = ChatTemplate::new(
        "<|x|>{{ messages[0].content | tojson(ensure_ascii=true) }}<|x|>",
        "",
        "",
    )
    .expect("compiles");
    let e = json
        .render_pieces(&[m("user", "a <|x|> b")], false, &spans)
        .expect_err("marks lost");
    assert!(matches!(e, TemplateError::Unmarkable(_)), "{e}");
    let ok = json
        .render_pieces(&[m("user", "a b")], false, &spans)
        .expect("nothing to keep apart");
    assert_eq!(ok.text, "<|x|>\"a b\"<|x|>");
    // A template that drops the marks and keeps the text: caught by counting the special
    // texts outside contents against the template's own.
    let drop = ChatTemplate::new(
        "<|x|>{{ messages[0].content | replace('\\ufdd0', '') | replace('\\ufdd1', '') }}",
        "",
        "",
    )
    .expect("compiles");
    assert_eq!(
        drop.render(&[m("user", "a\u{FDD0}b\u{FDD1}")], false)
            .expect("renders"),
        "<|x|>ab"
    );
    let e = drop
        .render_pieces(&[m("user", "<|x|>")], false, &spans)
        .expect_err("marks dropped");
    assert!(matches!(e, TemplateError::Unmarkable(_)), "{e}");
}

#[test]
fn blocks_are_trimmed_like_transformers() {
    // trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before.
    let src = "{% for message in messages %}\n    {% if message.role == 'user' %}\n[{{ message.content }}]\n    {% endif %}\n{% endfor %}\n";
    let t = ChatTemplate::new(src, "", "").expect("compiles");
    assert_eq!(t.render(&conv(), false).expect("renders"), "[Hi]\n[2+2?]\n");
}

#[test]
fn raise_exception_is_an_error_not_a_panic() {
    let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "").expect("compiles");
    let e = t.render(&conv(), false).expect_err("raises");
    assert!(e.to_string().contains("no system role"), "{e}");
    assert!(matches!(
        ChatTemplate::new("{% for %}", "", ""),
        Err(TemplateError::Compile(_))
    ));
}

#[test]
fn python_methods_work() {
    let t = ChatTemplate::new(
        "{{ messages[0]['content'].strip().upper() }}|{{ messages[0].role.startswith('us') }}|{{ 'a,b'.split(',') | length }}",
        "",
        "",
    )
    .expect("compiles");
    assert_eq!(
        t.render(&[m("user", "  hi ")], false).expect("renders"),
        "HI|True|2"
    );
}

#[test]
fn tojson_writes_what_python_json_dumps_writes() {
    let t = ChatTemplate::new(
        "{{ messages | tojson }}\n{{ {'a': '<é\"\n>', 'b': [1, 2.5, none, true]} | tojson(indent=2) }}\n{{ {'b': 1, 'a': {}} | tojson(sort_keys=true) }}\n{{ 'é' | tojson(ensure_ascii=true) }}",
        "",
        "",
    )
    .expect("compiles");
    assert_eq!(
        t.render(&[m("user", "Hi <b>")], false).expect("renders"),
        "[{\"role\": \"user\", \"content\": \"Hi <b>\"}]\n\
         {\n  \"a\": \"<é\\\"\\n>\",\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ]\n}\n\
         {\"a\": {}, \"b\": 1}\n\
         \"\\u00e9\""
    );
}

#[test]
fn strftime_formats_dates() {
    // 2024-07-26 (a Friday) 13:05:09 UTC.
    let t = 1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9;
    assert_eq!(
        strftime("%d %b %Y|%B %A %a|%H:%M:%S|%j %y %m %%", t).expect("formats"),
        "26 Jul 2024|July Friday Fri|13:05:09|208 24 07 %"
    );
    assert_eq!(civil_from_days(0), (1970, 1, 1));
    assert_eq!(civil_from_days(-1), (1969, 12, 31));
    assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    assert!(strftime("%Q", 0).is_err());
    let now = ChatTemplate::new("{{ strftime_now('%Y') }}", "", "")
        .expect("compiles")
        .render(&[], false)
        .expect("renders");
    assert!(now.len() == 4 && now.starts_with('2'), "{now}");
}
