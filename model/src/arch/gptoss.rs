//! gpt-oss (GGUF arch `gpt-oss`, llama.cpp's OPENAI_MOE: gpt-oss-20b and -120b).
//!
//! Over the Llama block:
//! - Q, K, V and the output projection have biases;
//! - every query head has a learned *sink* logit that joins each softmax of the head and
//!   takes no value (so a head may attend to nothing);
//! - even layers attend over a sliding window (`attention.sliding_window`, 128), odd layers
//!   over the whole context, both with the same RoPE: NeoX, YaRN-scaled
//!   (`rope.scaling.type` = `yarn`, factor 32 over an original context of 4096);
//! - the feed-forward's pre-norm is stored as `post_attention_norm`;
//! - the feed-forward is a mixture of experts whose router has a bias and picks the k largest
//!   logits, weighting them by a softmax over those k; each expert's gate, up and down have
//!   biases and the GLU is the clamped SwiGLU (`FfnAct::SwigluOai`).

use super::{FfnAct, Gating, Hparams, MetaKey, Yarn};
use crate::error::ModelError;
use crate::gguf::Metadata;
use ringllm_kernels::ops::RopeStyle;

/// YaRN's correction dimensions' betas (llama.cpp's defaults, which gpt-oss files use).
const BETA_FAST: f32 = 32.0;
const BETA_SLOW: f32 = 1.0;

pub(super) fn apply(hp: &mut Hparams, md: &Metadata) -> Result<(), ModelError> {
    let a = hp.arch.name();
    let bad = |why: String| {
        Err(ModelError::BadHparams {
            arch: "gpt-oss",
            why,
        })
    };
    hp.rope_style = RopeStyle::Neox;
    hp.qkv_bias = true;
    hp.attn_out_bias = true;
    hp.attn_sinks = true;
    hp.ffn_norm_post_attn = true;
    hp.ffn_act = FfnAct::SwigluOai;
    match hp.moe.as_mut() {
        Some(m) if m.n_used > super::MAX_PICKED => {
            return bad(format!(
                "{} experts per token (at most {})",
                m.n_used,
                super::MAX_PICKED
            ))
        }
        Some(m) => {
            m.gating = Gating::SoftmaxPicked;
            m.norm_weights = false;
            m.biases = true;
        }
        None => return bad(format!("{} is missing or 0", MetaKey::ExpertCount.of(a))),
    }
    let window = md
        .opt_u32(&MetaKey::SlidingWindow.of(a))?
        .map_or(0, |v| v as usize);
    if window == 0 {
        return bad(format!("{} is missing or 0", MetaKey::SlidingWindow.of(a)));
    }
    hp.sliding_window = window;
    hp.sliding = (0..hp.n_layer).map(|il| il % 2 == 0).collect();
    hp.rope_base_local = md
        .opt_f32(&MetaKey::RopeFreqBaseSwa.of(a))?
        .unwrap_or(hp.rope_base);
    match md.opt_str(&MetaKey::RopeScalingType.of(a))? {
        None | Some("none") => {}
        Some("yarn") => {
            let factor = md
                .opt_f32(&MetaKey::RopeScalingFactor.of(a))?
                .unwrap_or(1.0);
            let orig = md
                .opt_u32(&MetaKey::RopeScalingOrigCtx.of(a))?
                .map_or(hp.ctx_train, |v| v as usize);
            if !(factor.is_finite() && factor >= 1.0) || orig == 0 {
                return bad(format!(
                    "YaRN factor {factor} over an original context of {orig}"
                ));
            }
            if factor > 1.0 {
                let y = Yarn {
                    factor,
                    orig_ctx: orig,
                    beta_fast: BETA_FAST,
                    beta_slow: BETA_SLOW,
                };
                // ggml multiplies cos and sin by YaRN's magnitude and the file's factor.
                let attn = md
                    .opt_f32(&MetaKey::RopeScalingAttnFactor.of(a))?
                    .unwrap_or(1.0);
                hp.rope_attn_factor = y.mscale() * attn;
                hp.yarn = Some(y);
            }
        }
        Some(other) => return bad(format!("RoPE scaling {other:?} (gpt-oss files use yarn)")),
    }
    Ok(())
}
