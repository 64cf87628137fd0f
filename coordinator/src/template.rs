//! Chat templates: the model's `tokenizer.chat_template` (Jinja, as transformers renders it)
//! through minijinja, or a built-in one by name.

use minijinja::{Environment, ErrorKind};
use serde::Serialize;

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("chat template does not compile: {0}")]
    Compile(String),
    #[error("chat template failed to render: {0}")]
    Render(String),
}

const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const GEMMA: &str = "{{ bos_token }}{% set first = true %}{% set system = '' %}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}{% set messages = messages[1:] %}{% endif %}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' }}{% if loop.first %}{{ system }}{% endif %}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}";

const LLAMA3: &str = "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/// Names of the built-in templates.
pub fn builtin_names() -> Vec<&'static str> {
    vec!["chatml", "gemma", "llama3"]
}

/// The source of built-in template `name`.
pub fn builtin(name: &str) -> Option<&'static str> {
    match name {
        "chatml" => Some(CHATML),
        "gemma" => Some(GEMMA),
        "llama3" => Some(LLAMA3),
        _ => None,
    }
}

/// A compiled chat template with its special-token variables.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

impl ChatTemplate {
    pub fn new(
        source: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<ChatTemplate, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos: bos_token.to_string(),
            eos: eos_token.to_string(),
        })
    }

    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| TemplateError::Render(e.to_string()))?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| TemplateError::Render(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv() -> Vec<Message> {
        let m = |r: &str, c: &str| Message {
            role: r.into(),
            content: c.into(),
        };
        vec![
            m("system", "Be brief."),
            m("user", "Hi"),
            m("assistant", "Hello!"),
            m("user", "2+2?"),
        ]
    }

    #[test]
    fn chatml() {
        let t = ChatTemplate::new(builtin("chatml").unwrap_or_default(), "", "").expect("compiles");
        let s = t.render(&conv(), true).expect("renders");
        assert_eq!(
            s,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn gemma_folds_the_system_prompt_into_the_first_turn() {
        let t = ChatTemplate::new(builtin("gemma").unwrap_or_default(), "<bos>", "<eos>")
            .expect("compiles");
        let s = t.render(&conv(), true).expect("renders");
        assert_eq!(
            s,
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n"
        );
    }

    #[test]
    fn llama3() {
        let t = ChatTemplate::new(
            builtin("llama3").unwrap_or_default(),
            "<|begin_of_text|>",
            "",
        )
        .expect("compiles");
        let s = t.render(&conv()[1..2], true).expect("renders");
        assert_eq!(
            s,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn raise_exception_is_an_error_not_a_panic() {
        let t =
            ChatTemplate::new("{{ raise_exception('no system role') }}", "", "").expect("compiles");
        let e = t.render(&conv(), false).expect_err("raises");
        assert!(e.to_string().contains("no system role"), "{e}");
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
    }

    #[test]
    fn python_string_methods_work() {
        let t = ChatTemplate::new("{{ messages[0]['content'].strip().upper() }}", "", "")
            .expect("compiles");
        let m = vec![Message {
            role: "user".into(),
            content: "  hi ".into(),
        }];
        assert_eq!(t.render(&m, false).expect("renders"), "HI");
    }
}
