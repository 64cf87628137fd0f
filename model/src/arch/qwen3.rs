//! Qwen3 (GGUF arch `qwen3`): the Llama block with an RMSNorm over every head of Q and K
//! before RoPE (QK-norm), no Q/K/V biases, NeoX (half-split) RoPE. The small sizes (0.6B to
//! 4B) tie the output head to the embedding: their files have no `output.weight`. The head
//! size is `attention.key_length` (128 at every size, not `d_model / n_head`).

use super::Hparams;
use crate::error::ModelError;
use crate::gguf::Metadata;
use ringllm_kernels::ops::RopeStyle;

/// Qwen3's rules: NeoX RoPE, QK-norm.
pub(super) fn apply(hp: &mut Hparams, _md: &Metadata) -> Result<(), ModelError> {
    hp.rope_style = RopeStyle::Neox;
    hp.qk_norm = true;
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::arch::{Arch, Hparams, TensorKind};
    use crate::gguf::GgufFile;
    use crate::synth::{synth_model, SynthArch, SynthSpec};
    use ringllm_kernels::ops::RopeStyle;
    use ringllm_kernels::GgmlType;

    #[test]
    fn qwen3_layer_is_llama_with_qk_norm_and_neox_rope() {
        let spec = SynthSpec::new(SynthArch::Qwen3, GgmlType::F32, 1);
        let f = GgufFile::from_bytes(synth_model(&spec).unwrap()).unwrap();
        let arch = Arch::from_name("qwen3").unwrap();
        let hp = Hparams::from_metadata(arch, f.metadata(), spec.vocab as usize).unwrap();
        assert_eq!(hp.rope_style, RopeStyle::Neox);
        assert_eq!(hp.head_dim, spec.head_dim as usize);
        assert_eq!(hp.query_scale, 1.0 / (spec.head_dim as f32).sqrt());
        assert!(hp.sliding.iter().all(|s| !s) && hp.final_logit_softcap.is_none());
        let r = hp.recipe(0);
        assert_eq!(
            r.describe(),
            "attn_norm → qkv → qk_norm → rope → attention → attn_out → attn_residual → \
             ffn_norm → gate_up → glu → ffn_down → ffn_residual"
        );
        assert!(r.needs(TensorKind::AttnKNorm) && !r.needs(TensorKind::AttnQBias));
        assert!(!r.needs(TensorKind::PostAttnNorm));
    }
}
