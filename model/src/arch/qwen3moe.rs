//! Qwen3-MoE (GGUF arch `qwen3moe`: Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 block
//! (QK-norm, NeoX RoPE, no biases, head size from `attention.key_length`) whose feed-forward
//! is a mixture of experts: a softmax router over `expert_count` experts, the
//! `expert_used_count` most probable per token, their probabilities renormalized to sum to
//! one, each a SwiGLU of width `expert_feed_forward_length`. No shared expert.

use super::Hparams;
use crate::error::ModelError;
use crate::gguf::Metadata;

/// Qwen3's attention rules; the experts are required.
pub(super) fn apply(hp: &mut Hparams, md: &Metadata) -> Result<(), ModelError> {
    super::qwen3::apply(hp, md)?;
    if hp.moe.is_none() {
        return Err(ModelError::BadHparams {
            arch: hp.arch.name(),
            why: format!(
                "{} is missing or 0: a qwen3moe file has experts",
                super::MetaKey::ExpertCount.of(hp.arch.name())
            ),
        });
    }
    Ok(())
}
