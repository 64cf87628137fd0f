//! Gemma 4's chat template (the one its GGUF files and our synthetic gemma4 models carry,
//! `tests/fixtures/templates/google-gemma-4-31B-it.jinja`) rendered through our minijinja
//! environment. The expected texts are what Hugging Face's `apply_chat_template` (Jinja2 with
//! `trim_blocks` and `lstrip_blocks`) renders from it, worked out from the template by hand.

use ringllm::text::template::{ChatTemplate, Message};
use ringllm_model::synth::gemma4::CHAT_TEMPLATE;

fn m(role: &str, content: &str) -> Message {
    Message::new(role, content)
}

fn gemma4() -> ChatTemplate {
    ChatTemplate::new(CHAT_TEMPLATE, "<bos>", "<eos>").expect("Gemma 4's template compiles")
}

#[test]
fn gemma4_renders_a_conversation() {
    // The system turn opens the prompt; `assistant` becomes `model`; contents are trimmed
    // (`| trim`), a model reply goes through `strip_thinking` (`split`, `in`, macros with
    // namespaces); the generation prompt opens a model turn with an empty thought channel.
    let conv = [
        m("system", "Be brief."),
        m("user", " Hi "),
        m("assistant", "Hello!"),
        m("user", "2+2?"),
    ];
    assert_eq!(
        gemma4().render(&conv, true).expect("renders"),
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n\
         <|turn>model\nHello!<turn|>\n<|turn>user\n2+2?<turn|>\n\
         <|turn>model\n<|channel>thought\n<channel|>"
    );
}

#[test]
fn gemma4_drops_the_thinking_of_earlier_replies() {
    let conv = [
        m("user", "Hi"),
        m("assistant", "<|channel>thought\nhmm<channel|>Hello!"),
        m("user", "Bye"),
    ];
    assert_eq!(
        gemma4().render(&conv, false).expect("renders"),
        "<bos><|turn>user\nHi<turn|>\n<|turn>model\nHello!<turn|>\n<|turn>user\nBye<turn|>\n"
    );
}
