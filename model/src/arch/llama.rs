//! Llama (GGUF arch `llama`, also `mistral`): Llama 2/3, SmolLM, Mistral 7B.
//!
//! The plain pre-norm block: RMSNorm → Q/K/V → interleaved RoPE → attention → output
//! projection → residual; RMSNorm → SwiGLU feed-forward → residual. These are the defaults
//! `Hparams::from_metadata` starts from, so Llama adds no rules of its own.

use super::Hparams;
use crate::error::ModelError;
use crate::gguf::Metadata;

/// Llama's rules: none beyond the generic keys.
pub(super) fn apply(_hp: &mut Hparams, _md: &Metadata) -> Result<(), ModelError> {
    Ok(())
}
