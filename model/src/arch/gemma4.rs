//! Gemma 4, the dense sizes (GGUF arch `gemma4`: E2B, E4B, 31B). Over Gemma 3 it brings:
//!
//! - the sliding-window layers as an array (`attention.sliding_window_pattern`, one bool per
//!   layer), with a head size (`attention.key_length_swa`), RoPE dimensions
//!   (`rope.dimension_count_swa`) and RoPE base (`rope.freq_base_swa`) of their own; KV head
//!   counts and feed-forward widths may be per-layer arrays (read generically);
//! - proportional RoPE on the full-attention layers: `rope_freqs` divides their frequencies
//!   only (its huge divisors leave the unrotated dimensions still);
//! - shared-KV layers: the last `attention.shared_kv_layers` layers compute no K or V and
//!   read the cache of the last earlier layer of the same kind that has its own;
//! - V RMS-normed per head without a weight, and V taken from K where a layer has no V
//!   projection (a load-time rule, [`super::Hparams::set_v_from_k`]);
//! - attention scale 1 (Q and K are normed, no `1/√head_dim`);
//! - per-layer embeddings (E2B, E4B: `embedding_length_per_layer_input` > 0), a gated input
//!   added to the residual after each layer's feed-forward;
//! - each layer's output multiplied by its scalar `layer_output_scale`;
//! - final logit soft-capping (read generically).

use super::{FfnAct, Hparams, LayerShape, MetaKey};
use crate::error::ModelError;
use crate::gguf::Metadata;
use ringllm_kernels::ops::RopeStyle;

/// Gemma 4 scales queries by 1: its Q and K are RMS-normed per head instead.
pub const ATTENTION_SCALE: f32 = 1.0;

/// RoPE base of the sliding-window layers when the file does not say (`rope.freq_base_swa`).
pub const LOCAL_ROPE_BASE: f32 = 10_000.0;

/// Gemma 4's rules over the generic hyper-parameters.
pub(super) fn apply(hp: &mut Hparams, md: &Metadata) -> Result<(), ModelError> {
    let a = hp.arch.name();
    let k = |key: MetaKey| key.of(a);
    let bad = |why: String| ModelError::BadHparams { arch: a, why };
    md.require(&[
        &k(MetaKey::SlidingWindow),
        &k(MetaKey::SlidingWindowPattern),
    ])?;
    hp.rope_style = RopeStyle::Neox;
    hp.embd_scale = Some((hp.d_model as f32).sqrt());
    hp.ffn_act = FfnAct::GeluTanh;
    hp.qk_norm = true;
    hp.sandwich_norms = true;
    hp.v_norm = true;
    hp.v_proj_optional = true;
    hp.out_scale = true;
    hp.query_scale = ATTENTION_SCALE;
    hp.rope_freqs_global_only = true;
    hp.rope_base_local = md
        .opt_f32(&k(MetaKey::RopeFreqBaseSwa))?
        .unwrap_or(LOCAL_ROPE_BASE);
    hp.sliding_window = md.u32(&k(MetaKey::SlidingWindow))? as usize;
    let pattern = md.bool_array(&k(MetaKey::SlidingWindowPattern))?;
    if pattern.len() != hp.n_layer {
        return Err(bad(format!(
            "{} has {} values for {} layers",
            k(MetaKey::SlidingWindowPattern),
            pattern.len(),
            hp.n_layer
        )));
    }
    if hp.sliding_window == 0 && pattern.iter().any(|&s| s) {
        return Err(bad("sliding-window layers with a window of 0".into()));
    }
    hp.sliding = pattern;

    // Head sizes: the full-attention layers' is `key_length`, the sliding ones' their own;
    // K and V heads are the same size (llama.cpp refuses otherwise).
    let head_full = hp.head_dim;
    let head_swa = md
        .opt_u32(&k(MetaKey::KeyLengthSwa))?
        .map_or(head_full, |v| v as usize);
    let value_full = md
        .opt_u32(&k(MetaKey::ValueLength))?
        .map_or(head_full, |v| v as usize);
    let value_swa = md
        .opt_u32(&k(MetaKey::ValueLengthSwa))?
        .map_or(head_swa, |v| v as usize);
    if value_full != head_full || value_swa != head_swa {
        return Err(bad(format!(
            "key and value heads differ in size ({head_full}/{value_full}, sliding \
             {head_swa}/{value_swa})"
        )));
    }
    hp.rope_dim_local = md
        .opt_u32(&k(MetaKey::RopeDimensionCountSwa))?
        .map_or(hp.rope_dim, |v| v as usize);

    let shared = md
        .opt_u32(&k(MetaKey::SharedKvLayers))?
        .map_or(0, |v| v as usize);
    if shared >= hp.n_layer && shared > 0 {
        return Err(bad(format!(
            "{shared} shared-KV layers of {} (the first layer must have its own)",
            hp.n_layer
        )));
    }
    let first_shared = hp.n_layer - shared;
    hp.ple_dim = md
        .opt_u32(&k(MetaKey::EmbeddingLengthPerLayer))?
        .map_or(0, |v| v as usize);

    let mut shapes = Vec::with_capacity(hp.n_layer);
    for il in 0..hp.n_layer {
        let base = hp.layer_shape(il);
        let sliding = hp.sliding[il];
        let kv_source = if il >= first_shared {
            // The last layer before the shared ones of the same kind.
            let src = (0..first_shared).rev().find(|&j| hp.sliding[j] == sliding);
            Some(src.ok_or_else(|| {
                bad(format!(
                    "shared-KV layer {il} has no earlier {} layer to read",
                    if sliding {
                        "sliding-window"
                    } else {
                        "full-attention"
                    }
                ))
            })?)
        } else {
            None
        };
        shapes.push(LayerShape {
            head_dim: if sliding { head_swa } else { head_full },
            kv_source,
            ..base
        });
    }
    hp.layer_shapes = shapes;
    Ok(())
}
