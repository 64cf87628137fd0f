//! Text in and out of the model: the tokenizer built from GGUF metadata, chat templates, and
//! the sampler chain that picks each next token.

pub mod sampler;
pub mod template;
pub mod tokenizer;

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
