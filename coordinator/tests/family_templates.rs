//! The chat templates of the model families of issue 28, as their GGUF files carry them
//! (`tests/fixtures/templates/`, model data copied from llama.cpp's `models/templates/`),
//! rendered through our minijinja environment. The expected texts are what Hugging Face's
//! `apply_chat_template` (Jinja2 with `trim_blocks` and `lstrip_blocks`) renders from each
//! template, worked out from the template by hand: each test says which construct it checks.

use ringllm::text::template::{ChatTemplate, Message};

fn fixture(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/templates")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

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

fn qwen3() -> ChatTemplate {
    ChatTemplate::new(
        &fixture("Qwen-Qwen3-0.6B.jinja"),
        "<|endoftext|>",
        "<|im_end|>",
    )
    .expect("Qwen3's template compiles")
}

#[test]
fn qwen3_renders_a_conversation() {
    // `namespace`, the reversed slice `messages[::-1]`, `loop.index0`, `str.startswith` and
    // `str.endswith` (the search for the last real user query), `is defined` on a missing
    // `reasoning_content` and `tool_calls`.
    assert_eq!(
        qwen3().render(&conv(), true).expect("renders"),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
}

#[test]
fn qwen3_keeps_the_thinking_of_the_last_turn_only() {
    // `str.split`, `[-1]`, `lstrip`/`rstrip`/`strip` with an argument: the reasoning of a
    // reply after the last user query is rewritten as `<think>\n…\n</think>\n\n`; that of an
    // earlier reply is dropped.
    let reply = m("assistant", "<think>\nhmm\n</think>\n\nHello!");
    let last = [m("user", "Hi"), reply.clone()];
    assert_eq!(
        qwen3().render(&last, false).expect("renders"),
        "<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\n<think>\nhmm\n</think>\n\nHello!<|im_end|>\n"
    );
    let earlier = [m("user", "Hi"), reply, m("user", "Bye")];
    assert_eq!(
        qwen3().render(&earlier, true).expect("renders"),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n\
         <|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    );
    // A user message that is a tool response is not the last query.
    let tool = [
        m("user", "Hi"),
        m("assistant", "<think>\na\n</think>\n\nCalling."),
        m("user", "<tool_response>\n42\n</tool_response>"),
    ];
    assert_eq!(
        qwen3().render(&tool, false).expect("renders"),
        "<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\n<think>\na\n</think>\n\nCalling.<|im_end|>\n\
         <|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
    );
}

#[test]
fn gemma2_renders_turns_and_refuses_a_system_role() {
    let t = ChatTemplate::new(&fixture("google-gemma-2-2b-it.jinja"), "<bos>", "<eos>")
        .expect("Gemma 2's template compiles");
    // `| trim` binds to the content before `+`; the assistant is called `model`.
    assert_eq!(
        t.render(&conv()[1..], true).expect("renders"),
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n\
         <start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n"
    );
    assert_eq!(
        t.render(&[m("user", "  padded \n")], false)
            .expect("renders"),
        "<bos><start_of_turn>user\npadded<end_of_turn>\n"
    );
    // raise_exception: a clear error naming the template's own message.
    let e = t.render(&conv(), true).expect_err("no system role");
    assert!(e.to_string().contains("System role not supported"), "{e}");
    let e = t
        .render(&[m("user", "a"), m("user", "b")], true)
        .expect_err("roles must alternate");
    assert!(e.to_string().contains("must alternate"), "{e}");
}

fn mistral3() -> ChatTemplate {
    ChatTemplate::new(
        &fixture("Mistral-Small-3.2-24B-Instruct-2506.jinja"),
        "<s>",
        "</s>",
    )
    .expect("Mistral Small 3.2's template compiles")
}

#[test]
fn mistral_small_3_renders_a_conversation() {
    // `messages[1:]`, `selectattr("role", "equalto", "user") | list`, `dict.get`, comparing a
    // message with `user_messages[-1]`, `is string`, `namespace` counters; the template adds
    // no generation prompt of its own (the reply follows `[/INST]`).
    assert_eq!(
        mistral3().render(&conv(), true).expect("renders"),
        "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Hi[/INST]Hello!</s>[INST]2+2?[/INST]"
    );
}

#[test]
fn mistral_small_3_dates_its_default_system_prompt() {
    // Without a system message: the default one, dated by `strftime_now("%Y-%m-%d")`.
    let out = mistral3().render(&conv()[1..2], true).expect("renders");
    let prefix = "<s>[SYSTEM_PROMPT]You are Mistral Small 3, a Large Language Model (LLM) created \
                  by Mistral AI";
    assert!(out.starts_with(prefix), "{out}");
    assert!(out.ends_with("[/SYSTEM_PROMPT][INST]Hi[/INST]"), "{out}");
    let at = out.find("The current date is ").expect("dated") + "The current date is ".len();
    let date = &out[at..at + 10];
    let b = date.as_bytes();
    assert!(
        b.iter().enumerate().all(|(i, c)| if i == 4 || i == 7 {
            *c == b'-'
        } else {
            c.is_ascii_digit()
        }) && date > "2024-01-01",
        "{date}"
    );
    // Roles that do not alternate are refused by the template itself.
    let e = mistral3()
        .render(&[m("user", "a"), m("user", "b")], true)
        .expect_err("roles must alternate");
    assert!(e.to_string().contains("must alternate"), "{e}");
}
