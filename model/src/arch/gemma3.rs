//! Gemma 3 (GGUF arch `gemma3`): embeddings scaled by √d, QK-norm, sandwich norms (a norm
//! after attention and after the feed-forward as well as before), GeGLU with tanh GELU,
//! NeoX RoPE, and sliding-window layers with a RoPE base of their own, every
//! `sliding_window_pattern`-th layer global.

use super::{FfnAct, Hparams, MetaKey};
use crate::error::ModelError;
use crate::gguf::Metadata;
use ringllm_kernels::ops::RopeStyle;

/// RoPE base of the sliding-window (local) layers.
pub const LOCAL_ROPE_BASE: f32 = 10_000.0;

/// Every this-many-th layer is global when the file does not say
/// (`attention.sliding_window_pattern`): five local layers, then a global one.
pub const DEFAULT_SLIDING_PATTERN: usize = 6;

/// Layer count of Gemma 3 27B, the one size that scales queries by `1/√(d_model / n_head)`
/// rather than by `1/√head_dim` (its head size is not `d_model / n_head`).
pub const GEMMA3_27B_LAYERS: usize = 62;

/// Gemma 3's rules over the generic hyper-parameters.
pub(super) fn apply(hp: &mut Hparams, md: &Metadata) -> Result<(), ModelError> {
    let a = hp.arch.name();
    hp.rope_style = RopeStyle::Neox;
    hp.embd_scale = Some((hp.d_model as f32).sqrt());
    hp.ffn_act = FfnAct::GeluTanh;
    hp.qk_norm = true;
    hp.sandwich_norms = true;
    hp.rope_base_local = LOCAL_ROPE_BASE;
    hp.sliding_window = md
        .opt_u32(&MetaKey::SlidingWindow.of(a))?
        .map_or(0, |v| v as usize);
    let pattern = md
        .opt_u32(&MetaKey::SlidingWindowPattern.of(a))?
        .map_or(DEFAULT_SLIDING_PATTERN, |v| v as usize)
        .max(1);
    if hp.sliding_window > 0 {
        hp.sliding = (0..hp.n_layer).map(|il| (il + 1) % pattern != 0).collect();
    }
    if hp.n_layer == GEMMA3_27B_LAYERS && hp.n_head > 0 {
        hp.query_scale = 1.0 / ((hp.d_model / hp.n_head) as f32).sqrt();
    }
    Ok(())
}
