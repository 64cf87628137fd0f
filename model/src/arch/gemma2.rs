//! Gemma 2 (GGUF arch `gemma2`): embeddings scaled by √d, sandwich norms (a norm after
//! attention and after the feed-forward as well as before), GeGLU with tanh GELU, NeoX RoPE
//! with one base for every layer, sliding-window and global layers alternating (layer `il` is
//! local when `il % pattern < pattern - 1`, a pattern of 2 unless the file says: even layers
//! local), attention logit soft-capping (scores `c · tanh(s / c)` before the softmax) and
//! final logit soft-capping. No QK-norm (Gemma 3 replaced the attention soft-cap by it).

use super::{FfnAct, Hparams, MetaKey};
use crate::error::ModelError;
use crate::gguf::Metadata;
use ringllm_kernels::ops::RopeStyle;

/// The window of the local layers when the file does not say (every Gemma 2 size: 4096).
pub const DEFAULT_SLIDING_WINDOW: usize = 4096;

/// Every this-many-th layer is global when the file does not say: local, global, local...
pub const DEFAULT_SLIDING_PATTERN: usize = 2;

/// `attn_logit_softcapping` and `final_logit_softcapping` of every Gemma 2 size (HF config),
/// what llama.cpp assumes when a file lacks the keys.
pub const DEFAULT_ATTN_SOFTCAP: f32 = 50.0;
pub const DEFAULT_FINAL_SOFTCAP: f32 = 30.0;

/// Layer count of Gemma 2 27B, the one size that scales queries by `1/√(d_model / n_head)`
/// (its `query_pre_attn_scalar`, 144) rather than by `1/√head_dim`.
pub const GEMMA2_27B_LAYERS: usize = 46;

/// Gemma 2's rules over the generic hyper-parameters.
pub(super) fn apply(hp: &mut Hparams, md: &Metadata) -> Result<(), ModelError> {
    let a = hp.arch.name();
    hp.rope_style = RopeStyle::Neox;
    hp.embd_scale = Some((hp.d_model as f32).sqrt());
    hp.ffn_act = FfnAct::GeluTanh;
    hp.sandwich_norms = true;
    hp.rope_base_local = hp.rope_base;
    hp.sliding_window = md
        .opt_u32(&MetaKey::SlidingWindow.of(a))?
        .map_or(DEFAULT_SLIDING_WINDOW, |v| v as usize);
    let pattern = md
        .opt_u32(&MetaKey::SlidingWindowPattern.of(a))?
        .map_or(DEFAULT_SLIDING_PATTERN, |v| v as usize);
    if hp.sliding_window > 0 {
        hp.sliding = (0..hp.n_layer)
            .map(|il| pattern == 0 || il % pattern < pattern - 1)
            .collect();
    }
    hp.attn_logit_softcap = Some(
        md.opt_f32(&MetaKey::AttnLogitSoftcapping.of(a))?
            .unwrap_or(DEFAULT_ATTN_SOFTCAP),
    );
    hp.final_logit_softcap = Some(hp.final_logit_softcap.unwrap_or(DEFAULT_FINAL_SOFTCAP));
    if hp.n_layer == GEMMA2_27B_LAYERS && hp.n_head > 0 {
        hp.query_scale = 1.0 / ((hp.d_model / hp.n_head) as f32).sqrt();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::arch::{Arch, FfnAct, Hparams, Step, TensorKind};
    use crate::gguf::GgufFile;
    use crate::kv::{KvCache, KvType};
    use crate::synth::{synth_model, SynthArch, SynthSpec, SMALL_SOFTCAPS};
    use ringllm_kernels::GgmlType;

    fn hparams(spec: &SynthSpec) -> Hparams {
        let f = GgufFile::from_bytes(synth_model(spec).unwrap()).unwrap();
        Hparams::from_metadata(Arch::Gemma2, f.metadata(), spec.vocab as usize).unwrap()
    }

    #[test]
    fn gemma2_alternates_local_and_global_layers_with_soft_caps() {
        let mut spec = SynthSpec::new(SynthArch::Gemma2, GgmlType::F32, 1);
        spec.n_layer = 4;
        let hp = hparams(&spec);
        assert_eq!(hp.sliding, [true, false, true, false]);
        assert_eq!(hp.sliding_window, spec.sliding_window as usize);
        assert_eq!(hp.rope_for_layer(0), hp.rope_for_layer(1));
        assert_eq!(hp.attn_logit_softcap, Some(SMALL_SOFTCAPS.0));
        assert_eq!(hp.final_logit_softcap, Some(SMALL_SOFTCAPS.1));
        assert_eq!(hp.embd_scale, Some((spec.d_model as f32).sqrt()));
        let r = hp.recipe(0);
        assert_eq!(
            r.describe(),
            "attn_norm → qkv → rope → attention → attn_out → attn_residual → ffn_norm → \
             gate_up → glu → ffn_down → ffn_residual"
        );
        assert!(r.steps.contains(&Step::Attention {
            scale: 1.0 / (spec.head_dim as f32).sqrt(),
            softcap: Some(SMALL_SOFTCAPS.0),
            sinks: false,
        }));
        assert!(r.steps.contains(&Step::Glu(FfnAct::GeluTanh)));
        assert!(r.needs(TensorKind::PostFfwNorm) && !r.needs(TensorKind::AttnQNorm));
    }

    #[test]
    fn sliding_layers_hold_only_their_window_of_kv() {
        // What the planner and `info` count per layer (`KvCache::bytes_for`): a local layer
        // holds its window (plus a batch), a global one the whole context.
        let hp = hparams(&SynthSpec::new(SynthArch::Gemma2, GgmlType::F32, 1));
        let (ctx, mb, w) = (256, 4, hp.sliding_window);
        let row = 2 * hp.kv_dim() * 2; // K and V, f16
        assert_eq!(
            KvCache::bytes_for(&hp, 0..1, ctx, mb, KvType::F16),
            (w + mb - 1) * row
        );
        assert_eq!(
            KvCache::bytes_for(&hp, 1..2, ctx, mb, KvType::F16),
            ctx * row
        );
        let cache = KvCache::new(&hp, 0..2, ctx, mb, KvType::F16);
        assert_eq!(cache.layers[0].cap, w + mb - 1);
        assert_eq!(cache.layers[1].cap, ctx);
    }
}
