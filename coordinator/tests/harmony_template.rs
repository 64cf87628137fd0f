//! The harmony chat format (gpt-oss) against Jinja2: tests/fixtures/harmony-template-jinja2.json
//! holds gpt-oss's own template (tests/fixtures/templates/openai-gpt-oss-120b.jinja) rendered by
//! Jinja2 the way transformers renders it, for a set of conversations, with the date pinned
//! (tests/fixtures/make_harmony_template_fixtures.py). Both our built-in `harmony` template and
//! our minijinja rendering of the file's template must give the same text byte for byte.

use ringllm::text::template::{builtin, ChatTemplate, Message, TemplateVars};
use serde_json::Value;

fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn fixture() -> Value {
    let path = root().join("tests/fixtures/harmony-template-jinja2.json");
    let src = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&src).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

struct Case {
    name: String,
    messages: Vec<Message>,
    add_generation_prompt: bool,
    vars: TemplateVars,
    text: String,
}

fn cases(fx: &Value) -> Vec<Case> {
    let list = fx["cases"].as_array().expect("cases");
    list.iter()
        .map(|c| Case {
            name: c["name"].as_str().expect("name").to_string(),
            messages: c["messages"]
                .as_array()
                .expect("messages")
                .iter()
                .map(|m| {
                    Message::new(
                        m["role"].as_str().expect("role").to_string(),
                        m["content"].as_str().expect("content").to_string(),
                    )
                })
                .collect(),
            add_generation_prompt: c["add_generation_prompt"].as_bool().expect("flag"),
            vars: TemplateVars {
                reasoning_effort: c
                    .get("reasoning_effort")
                    .and_then(Value::as_str)
                    .map(str::to_string),
                ..TemplateVars::default()
            },
            text: c["text"].as_str().expect("text").to_string(),
        })
        .collect()
}

fn pinned(source: &str, fx: &Value) -> ChatTemplate {
    let mut t = ChatTemplate::new(source, "<|startoftext|>", "<|return|>").expect("compiles");
    t.pin_time(fx["date_unix"].as_i64().expect("date_unix"));
    t
}

fn check(label: &str, t: &ChatTemplate, fx: &Value) {
    let cases = cases(fx);
    assert!(cases.len() >= 10, "only {} conversations", cases.len());
    for c in &cases {
        let ours = t
            .render_with(&c.messages, c.add_generation_prompt, &c.vars)
            .unwrap_or_else(|e| panic!("{label}: {}: {e}", c.name));
        assert_eq!(ours, c.text, "{label}: {}", c.name);
        // Telling contents apart changes nothing in the text.
        let pieces = t
            .render_pieces_with(&c.messages, c.add_generation_prompt, &c.vars, &|_| {
                Vec::new()
            })
            .unwrap_or_else(|e| panic!("{label}: {}: {e}", c.name));
        assert_eq!(pieces.text, c.text, "{label}: {} (pieces)", c.name);
    }
}

#[test]
fn builtin_harmony_template_renders_as_gpt_oss_template_in_jinja2() {
    let fx = fixture();
    check(
        "built-in harmony",
        &pinned(builtin("harmony").expect("harmony"), &fx),
        &fx,
    );
}

#[test]
fn gpt_oss_template_from_the_file_renders_as_in_jinja2() {
    let fx = fixture();
    let path = root().join(fx["template"].as_str().expect("template"));
    let source =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    check("gpt-oss's template", &pinned(&source, &fx), &fx);
}

#[test]
fn effort_and_date_reach_the_system_message() {
    let fx = fixture();
    let t = pinned(builtin("harmony").expect("harmony"), &fx);
    let user = [Message::new("user", "Hi")];
    let high = TemplateVars {
        reasoning_effort: Some("high".into()),
        ..TemplateVars::default()
    };
    let text = t.render_with(&user, true, &high).expect("renders");
    assert!(text.contains("\nReasoning: high\n"), "{text}");
    assert!(text.contains("Current date: 2026-03-09\n"), "{text}");
    let text = t.render(&user, true).expect("renders");
    assert!(text.contains("\nReasoning: medium\n"), "{text}");
    // Channel markup in a reply is refused, as gpt-oss's template refuses it.
    let bad = [
        Message::new("user", "Hi"),
        Message::new("assistant", "<|channel|>final<|message|>x"),
    ];
    assert!(t.render(&bad, true).is_err());
}
