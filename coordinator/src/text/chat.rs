//! The chat REPL's rules that do not touch a terminal or a model: its `/` commands, which
//! turns to drop when the conversation outgrows the context, and the template of a model's
//! family when its file has none.

use super::template::Message;
use ringllm_model::arch::Arch;

/// One line typed at the chat prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// A message for the model (`//text` sends `/text`).
    Message(String),
    /// A blank line.
    Nothing,
    /// `/help` or `/?`.
    Help,
    /// `/clear`: forget the conversation (the system prompt stays).
    Clear,
    /// `/system TEXT` sets the system prompt and starts over; `/system` alone shows it.
    System(Option<String>),
    /// `/bye` (`/exit`, `/quit`): leave.
    Bye,
    /// A `/word` that is none of the above.
    Unknown(String),
}

/// What `/help` prints.
pub const HELP: &str = "\
commands:
  /help          this list
  /clear         forget the conversation (the system prompt stays)
  /system TEXT   set the system prompt and start over (/system alone shows it)
  /bye           leave (also /exit, /quit, Ctrl-D)
  //text         send a message that starts with '/'
Ctrl-C stops a reply; a second Ctrl-C at the prompt leaves.";

/// Reads one line typed at the chat prompt.
pub fn parse_input(line: &str) -> Input {
    let line = line.trim_end_matches(['\r', '\n']);
    if line.trim().is_empty() {
        return Input::Nothing;
    }
    let Some(rest) = line.trim_start().strip_prefix('/') else {
        return Input::Message(line.to_string());
    };
    if rest.starts_with('/') {
        return Input::Message(rest.to_string());
    }
    let (word, arg) = match rest.split_once(char::is_whitespace) {
        Some((w, a)) => (w, a.trim()),
        None => (rest, ""),
    };
    match word {
        "help" | "?" => Input::Help,
        "clear" => Input::Clear,
        "system" => Input::System((!arg.is_empty()).then(|| arg.to_string())),
        "bye" | "exit" | "quit" => Input::Bye,
        _ => Input::Unknown(format!("/{word}")),
    }
}

/// Tokens to keep free for the reply when fitting the prompt into a context of `ctx`: `-n`
/// when given, else a quarter of the context; never more than half of it, at least one.
pub fn reply_reserve(ctx: usize, n_predict: i64) -> usize {
    let want = if n_predict >= 0 {
        usize::try_from(n_predict).unwrap_or(usize::MAX)
    } else {
        ctx / 4
    };
    want.min(ctx / 2).max(1)
}

/// What [`fit_context`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fit {
    /// Prompt tokens of what is kept.
    pub tokens: usize,
    /// Turns dropped from the front of the conversation (a user message and the replies that
    /// followed it).
    pub turns_dropped: usize,
    /// Messages dropped.
    pub messages_dropped: usize,
}

/// The conversation does not fit even with only its last message (and the system prompt).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the message needs {tokens} prompt tokens with the system prompt, and only {budget} fit \
     (the context less room for the reply); shorten it or raise --ctx"
)]
pub struct DoesNotFit {
    pub tokens: usize,
    pub budget: usize,
}

/// Drops the oldest turns of `messages` (never a leading system message, never the last
/// message) until `count(messages)` — the prompt tokens of the rendered conversation — is at
/// most `budget`. A turn is a user message with the messages up to the next user message, so
/// what is kept still starts with a user turn. `count` errors pass through.
pub fn fit_context<E>(
    messages: &mut Vec<Message>,
    budget: usize,
    count: &mut dyn FnMut(&[Message]) -> Result<usize, E>,
) -> Result<Result<Fit, DoesNotFit>, E> {
    let start = usize::from(messages.first().is_some_and(|m| m.role == "system"));
    let mut fit = Fit {
        tokens: count(messages)?,
        turns_dropped: 0,
        messages_dropped: 0,
    };
    while fit.tokens > budget {
        // The oldest turn: its first message, then up to (not including) the next user one.
        let last = messages.len().saturating_sub(1);
        if start >= last {
            return Ok(Err(DoesNotFit {
                tokens: fit.tokens,
                budget,
            }));
        }
        let mut end = start + 1;
        while end < last && messages[end].role != "user" {
            end += 1;
        }
        messages.drain(start..end);
        fit.turns_dropped += 1;
        fit.messages_dropped += end - start;
        fit.tokens = count(messages)?;
    }
    Ok(Ok(fit))
}

/// The built-in template of `arch`'s family for a model file without one, if its vocabulary
/// has the family's markup tokens: Gemma 2 and 3 → `gemma`, Qwen2, Qwen3 and Qwen3-MoE → `chatml`, Llama → `llama3` (a
/// Llama 3 vocabulary) or `chatml` (one with `<|im_start|>`, as SmolLM's), gpt-oss →
/// `harmony`. `None`: no family
/// template fits (Llama 2, Mistral: pick one with --template).
pub fn family_template(arch: Arch, tokens: &[String]) -> Option<&'static str> {
    let has = |t: &str| tokens.iter().any(|x| x == t);
    let chatml = has("<|im_start|>") && has("<|im_end|>");
    match arch {
        Arch::Gemma3 | Arch::Gemma2 => {
            (has("<start_of_turn>") && has("<end_of_turn>")).then_some("gemma")
        }
        Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => chatml.then_some("chatml"),
        Arch::Llama | Arch::Mistral3 if has("<|start_header_id|>") && has("<|eot_id|>") => {
            Some("llama3")
        }
        Arch::Llama | Arch::Mistral3 => chatml.then_some("chatml"),
        // Gemma 4 files carry their own template (`<|turn>` markup); no built-in one.
        Arch::Gemma4 => None,
        Arch::Phi3 => (has("<|user|>") && has("<|assistant|>") && has("<|end|>")).then_some("phi3"),
        // gpt-oss files carry their own template; the built-in one renders the same text for
        // conversations without tools.
        Arch::GptOss => {
            (has("<|start|>") && has("<|message|>") && has("<|channel|>") && has("<|end|>"))
                .then_some("harmony")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::template::{builtin, ChatTemplate};

    fn m(role: &str, content: &str) -> Message {
        Message::new(role, content)
    }

    fn contents(ms: &[Message]) -> Vec<&str> {
        ms.iter().map(|m| m.content.as_str()).collect()
    }

    #[test]
    fn commands_are_parsed() {
        assert_eq!(parse_input("hello"), Input::Message("hello".into()));
        assert_eq!(parse_input("  \n"), Input::Nothing);
        assert_eq!(parse_input("/help"), Input::Help);
        assert_eq!(parse_input("/?"), Input::Help);
        assert_eq!(parse_input("/clear"), Input::Clear);
        assert_eq!(parse_input("/bye"), Input::Bye);
        assert_eq!(parse_input(" /quit "), Input::Bye);
        assert_eq!(
            parse_input("/system  You are terse.  "),
            Input::System(Some("You are terse.".into()))
        );
        assert_eq!(parse_input("/system"), Input::System(None));
        assert_eq!(parse_input("/sys x"), Input::Unknown("/sys".into()));
        assert_eq!(
            parse_input("//etc/hosts?"),
            Input::Message("/etc/hosts?".into())
        );
    }

    #[test]
    fn reserve_is_bounded() {
        assert_eq!(reply_reserve(100, 16), 16);
        assert_eq!(reply_reserve(100, 500), 50);
        assert_eq!(reply_reserve(100, -1), 25);
        assert_eq!(reply_reserve(1, 0), 1);
    }

    /// One token per character of content and 3 per message of markup.
    fn chars(ms: &[Message]) -> Result<usize, ()> {
        Ok(ms.iter().map(|m| m.content.len() + 3).sum())
    }

    #[test]
    fn oldest_turns_go_first_and_the_system_prompt_stays() {
        let mut ms = vec![
            m("system", "sys"),
            m("user", "u1"),
            m("assistant", "a1"),
            m("user", "u2"),
            m("assistant", "a2"),
            m("user", "u3"),
        ];
        // 6 + 5 * 5 = 31 tokens; 26 fit once the first turn (10) is gone.
        let fit = fit_context(&mut ms, 26, &mut chars).unwrap().unwrap();
        assert_eq!(contents(&ms), ["sys", "u2", "a2", "u3"]);
        assert_eq!(
            fit,
            Fit {
                tokens: 21,
                turns_dropped: 1,
                messages_dropped: 2
            }
        );
        // Down to the last message.
        let fit = fit_context(&mut ms, 11, &mut chars).unwrap().unwrap();
        assert_eq!(contents(&ms), ["sys", "u3"]);
        assert_eq!((fit.tokens, fit.turns_dropped), (11, 1));
        // Nothing more can go.
        let e = fit_context(&mut ms, 10, &mut chars).unwrap().unwrap_err();
        assert_eq!(
            e,
            DoesNotFit {
                tokens: 11,
                budget: 10
            }
        );
        assert_eq!(contents(&ms), ["sys", "u3"]);
    }

    #[test]
    fn without_a_system_prompt_and_when_it_fits() {
        let mut ms = vec![m("user", "u1"), m("assistant", "a1"), m("user", "u2")];
        let fit = fit_context(&mut ms, 100, &mut chars).unwrap().unwrap();
        assert_eq!((fit.turns_dropped, fit.messages_dropped), (0, 0));
        assert_eq!(ms.len(), 3);
        fit_context(&mut ms, 5, &mut chars).unwrap().unwrap();
        assert_eq!(contents(&ms), ["u2"]);
        // A turn whose reply was never stored (a failed reply) goes alone.
        let mut ms = vec![
            m("user", "u1"),
            m("user", "u2"),
            m("assistant", "a2"),
            m("user", "u3"),
        ];
        fit_context(&mut ms, 15, &mut chars).unwrap().unwrap();
        assert_eq!(contents(&ms), ["u2", "a2", "u3"]);
    }

    #[test]
    fn counting_errors_pass_through() {
        let mut ms = vec![m("user", "u1")];
        let r = fit_context(&mut ms, 1, &mut |_| Err::<usize, _>("broken"));
        assert_eq!(r, Err("broken"));
    }

    #[test]
    fn fitting_a_real_rendering() {
        // ChatML rendered, counted in characters: the kept conversation renders alone.
        let t = ChatTemplate::new(builtin("chatml").unwrap(), "", "").unwrap();
        let mut count = |ms: &[Message]| t.render(ms, true).map(|s| s.len());
        let mut ms = vec![m("system", "S"), m("user", "first question")];
        ms.push(m("assistant", "first answer"));
        ms.push(m("user", "second"));
        let full = count(&ms).unwrap();
        let fit = fit_context(&mut ms, full - 1, &mut count).unwrap().unwrap();
        assert_eq!(contents(&ms), ["S", "second"]);
        assert_eq!(
            t.render(&ms, true).unwrap(),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nsecond<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        assert_eq!(fit.tokens, t.render(&ms, true).unwrap().len());
    }

    #[test]
    fn family_templates_need_their_markup_in_the_vocabulary() {
        let v = |ts: &[&str]| ts.iter().map(|t| t.to_string()).collect::<Vec<_>>();
        let gemma = v(&["<bos>", "<start_of_turn>", "<end_of_turn>"]);
        let chatml = v(&["<|im_start|>", "<|im_end|>"]);
        let llama3 = v(&["<|begin_of_text|>", "<|start_header_id|>", "<|eot_id|>"]);
        assert_eq!(family_template(Arch::Gemma3, &gemma), Some("gemma"));
        assert_eq!(family_template(Arch::Gemma3, &chatml), None);
        assert_eq!(family_template(Arch::Qwen2, &chatml), Some("chatml"));
        assert_eq!(family_template(Arch::Qwen2, &gemma), None);
        assert_eq!(family_template(Arch::Llama, &llama3), Some("llama3"));
        assert_eq!(family_template(Arch::Llama, &chatml), Some("chatml"));
        assert_eq!(family_template(Arch::Llama, &v(&["<s>", "[INST]"])), None);
        let phi3 = v(&["<s>", "<|user|>", "<|assistant|>", "<|end|>"]);
        assert_eq!(family_template(Arch::Phi3, &phi3), Some("phi3"));
        assert_eq!(family_template(Arch::Phi3, &chatml), None);
        let harmony = v(&["<|start|>", "<|channel|>", "<|message|>", "<|end|>"]);
        assert_eq!(family_template(Arch::GptOss, &harmony), Some("harmony"));
        assert_eq!(family_template(Arch::GptOss, &chatml), None);
        for name in ["gemma", "chatml", "llama3", "phi3", "harmony"] {
            assert!(builtin(name).is_some(), "{name} is a built-in template");
        }
    }
}
