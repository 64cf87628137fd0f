//! Qwen2 (GGUF arch `qwen2`): the Llama block with biases on the Q, K and V projections and
//! NeoX (half-split) RoPE.

use super::Hparams;
use crate::error::ModelError;
use crate::gguf::Metadata;
use ringllm_kernels::ops::RopeStyle;

/// Qwen2's rules: NeoX RoPE, Q/K/V biases.
pub(super) fn apply(hp: &mut Hparams, _md: &Metadata) -> Result<(), ModelError> {
    hp.rope_style = RopeStyle::Neox;
    hp.qkv_bias = true;
    Ok(())
}
