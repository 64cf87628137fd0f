//! Phi-3 and Phi-3.5 mini / medium (GGUF arch `phi3`).
//!
//! The pre-norm Llama block with three differences:
//! - Q, K and V are one matrix (`attn_qkv`, rows `[q | k | v]`) and gate and up are one
//!   matrix (`ffn_up`, `2 · feed_forward_length` rows, `[gate | up]`): the loader splits their
//!   rows into views (`model.rs`), so the products run on the same kernels as a Llama layer's;
//! - NeoX RoPE, with LongRoPE on the 128k models: per-frequency divisors
//!   `rope_factors_long` / `rope_factors_short` (global tensors, chosen by the runner's
//!   context against `rope.scaling.original_context_length`), and cos and sin multiplied by
//!   `rope.scaling.attn_factor`;
//! - a sliding window on every layer when `attention.sliding_window` is set below the
//!   training context (Phi-3-mini-4k: 2047). llama.cpp turns Phi's window off (its PR 13676);
//!   we follow the published model (Hugging Face's `Phi3Attention` masks by it), which gives
//!   the same results as llama.cpp on contexts within the window.

use super::{Hparams, MetaKey};
use crate::error::ModelError;
use crate::gguf::Metadata;
use ringllm_kernels::ops::RopeStyle;

/// Phi-3's rules over the generic hyper-parameters.
pub(super) fn apply(hp: &mut Hparams, md: &Metadata) -> Result<(), ModelError> {
    let a = hp.arch.name();
    hp.rope_style = RopeStyle::Neox;
    hp.fused_proj = true;
    if let Some(orig) = md.opt_u32(&MetaKey::RopeScalingOrigCtx.of(a))? {
        hp.rope_orig_ctx = orig as usize;
    }
    if let Some(f) = md.opt_f32(&MetaKey::RopeScalingAttnFactor.of(a))? {
        hp.rope_attn_factor = f;
    }
    let window = md
        .opt_u32(&MetaKey::SlidingWindow.of(a))?
        .map_or(0, |v| v as usize);
    // A window as long as the training context (Phi-3.5: 262144) masks nothing.
    if window > 0 && window < hp.ctx_train {
        hp.sliding_window = window;
        hp.sliding = vec![true; hp.n_layer];
        // Every layer is a window layer, with the model's one RoPE.
        hp.rope_base_local = hp.rope_base;
    }
    Ok(())
}
