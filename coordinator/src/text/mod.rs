//! Text in and out of the model: the tokenizer built from GGUF metadata, chat templates, and
//! the sampler chain that picks each next token.

pub mod chat;
pub mod grammar;
pub mod harmony;
pub mod sampler;
pub mod template;
pub mod tokenizer;
pub mod tools;

use anyhow::{anyhow, Context, Result};
use std::path::Path;
use template::{builtin, ChatTemplate};
use tokenizer::{Tokenizer, TokenizerSpec};

/// The chat template to use: the built-in one `name` asks for, else the model's own; `None`
/// when neither exists. `model` names the file in messages.
pub fn resolve_template(
    name: Option<&str>,
    spec: &TokenizerSpec,
    tokenizer: &Tokenizer,
    model: &Path,
) -> Result<Option<ChatTemplate>> {
    let source = match (name, &spec.chat_template) {
        (Some(name), _) => builtin(name)
            .ok_or_else(|| {
                anyhow!(
                    "unknown template '{name}' (built-in: {})",
                    template::builtin_names().join(", ")
                )
            })?
            .to_string(),
        (None, Some(t)) => t.clone(),
        (None, None) => return Ok(None),
    };
    let bos = tokenizer
        .bos()
        .and_then(|id| tokenizer.id_to_piece(id))
        .unwrap_or("")
        .to_string();
    let eos = spec
        .eos
        .and_then(|id| tokenizer.id_to_piece(id))
        .unwrap_or("")
        .to_string();
    let t = ChatTemplate::new(&source, &bos, &eos)
        .with_context(|| format!("chat template of {}", model.display()))?;
    Ok(Some(t))
}

/// The chat template for `--chat`: as [`resolve_template`], and when neither `name` nor the
/// file gives one, the built-in template of `arch`'s family ([`chat::family_template`]) with
/// a note saying so. `None`: no template at all.
pub fn resolve_chat_template(
    name: Option<&str>,
    spec: &TokenizerSpec,
    tokenizer: &Tokenizer,
    model: &Path,
    arch: ringllm_model::Arch,
) -> Result<Option<(ChatTemplate, Option<String>)>> {
    if name.is_some() || spec.chat_template.is_some() {
        return Ok(resolve_template(name, spec, tokenizer, model)?.map(|t| (t, None)));
    }
    let Some(family) = chat::family_template(arch, &spec.tokens) else {
        return Ok(None);
    };
    let note = format!(
        "{} has no chat template; using the built-in '{family}' template of the {} family \
         (--template NAME picks another)",
        model.display(),
        arch.name()
    );
    Ok(resolve_template(Some(family), spec, tokenizer, model)?.map(|t| (t, Some(note))))
}
