//! Architectures as data: the tensor kinds a layer is built from, their GGUF names and
//! classes, and the hyper-parameters and per-architecture hooks read from metadata.
//! The forward pass reads these flags; it never compares architecture names.

use crate::error::ModelError;
use crate::gguf::Metadata;
use ringllm_kernels::ops::RopeStyle;

/// Architectures we run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3, SmolLM, Mistral (GGUF arch `llama`).
    Llama,
    /// Qwen2: Llama layout with Q/K/V biases and NeoX RoPE.
    Qwen2,
    Gemma3,
}

impl Arch {
    /// The architecture named by `general.architecture`.
    pub fn from_name(name: &str) -> Option<Arch> {
        match name {
            "llama" | "mistral" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "gemma3" => Some(Arch::Gemma3),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma3 => "gemma3",
        }
    }

    pub const SUPPORTED: &'static [&'static str] = &["llama", "mistral", "qwen2", "gemma3"];
}

/// Where a tensor sits in the model: the planner reasons about these, not names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerClass {
    /// Before the first layer (token embedding).
    Input,
    /// Inside one of the repeating blocks.
    Repeating,
    /// After the last layer (final norm, output head).
    Output,
}

/// Every tensor kind any supported architecture uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorKind {
    TokenEmbd,
    OutputNorm,
    Output,
    RopeFreqs,
    AttnNorm,
    AttnQ,
    AttnK,
    AttnV,
    AttnQBias,
    AttnKBias,
    AttnVBias,
    AttnOutput,
    AttnQNorm,
    AttnKNorm,
    PostAttnNorm,
    FfnNorm,
    FfnGate,
    FfnUp,
    FfnDown,
    PostFfwNorm,
}

impl TensorKind {
    fn stem(self) -> &'static str {
        match self {
            TensorKind::TokenEmbd => "token_embd",
            TensorKind::OutputNorm => "output_norm",
            TensorKind::Output => "output",
            TensorKind::RopeFreqs => "rope_freqs",
            TensorKind::AttnNorm => "attn_norm",
            TensorKind::AttnQ | TensorKind::AttnQBias => "attn_q",
            TensorKind::AttnK | TensorKind::AttnKBias => "attn_k",
            TensorKind::AttnV | TensorKind::AttnVBias => "attn_v",
            TensorKind::AttnOutput => "attn_output",
            TensorKind::AttnQNorm => "attn_q_norm",
            TensorKind::AttnKNorm => "attn_k_norm",
            TensorKind::PostAttnNorm => "post_attention_norm",
            TensorKind::FfnNorm => "ffn_norm",
            TensorKind::FfnGate => "ffn_gate",
            TensorKind::FfnUp => "ffn_up",
            TensorKind::FfnDown => "ffn_down",
            TensorKind::PostFfwNorm => "post_ffw_norm",
        }
    }

    pub fn class(self) -> LayerClass {
        match self {
            TensorKind::TokenEmbd => LayerClass::Input,
            TensorKind::OutputNorm | TensorKind::Output => LayerClass::Output,
            // Shared by all layers; loaded wherever layers are.
            TensorKind::RopeFreqs => LayerClass::Repeating,
            _ => LayerClass::Repeating,
        }
    }

    fn is_bias(self) -> bool {
        matches!(
            self,
            TensorKind::AttnQBias | TensorKind::AttnKBias | TensorKind::AttnVBias
        )
    }

    /// The GGUF tensor name, e.g. `blk.3.attn_norm.weight`.
    pub fn gguf_name(self, layer: Option<usize>) -> String {
        let suffix = if self.is_bias() { "bias" } else { "weight" };
        match (self.class(), layer) {
            (LayerClass::Repeating, Some(il)) if self != TensorKind::RopeFreqs => {
                format!("blk.{il}.{}.{suffix}", self.stem())
            }
            _ => format!("{}.{suffix}", self.stem()),
        }
    }
}

/// Feed-forward activation of the gated unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnAct {
    /// SwiGLU (Llama).
    Silu,
    /// GeGLU with tanh GELU (Gemma).
    GeluTanh,
}

/// Hyper-parameters and per-architecture hooks, all read from metadata.
#[derive(Clone, Debug)]
pub struct Hparams {
    pub arch: Arch,
    pub n_layer: usize,
    pub d_model: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub d_ff: usize,
    pub vocab: usize,
    pub ctx_train: usize,
    pub rms_eps: f32,
    pub rope_style: RopeStyle,
    pub rope_dim: usize,
    /// RoPE base of global (full-attention) layers.
    pub rope_base: f32,
    /// RoPE base of sliding-window layers.
    pub rope_base_local: f32,
    /// Linear RoPE scaling of global layers (positions divided by this).
    pub rope_scale: f32,
    /// Sliding-window size, for the layers where `sliding[il]`.
    pub sliding_window: usize,
    pub sliding: Vec<bool>,
    /// Multiply embeddings by this (Gemma: √d).
    pub embd_scale: Option<f32>,
    /// Query pre-attention scale.
    pub query_scale: f32,
    pub ffn_act: FfnAct,
    /// RMSNorm per head on Q and K (Gemma 3).
    pub qk_norm: bool,
    /// Norms after attention and after the FFN as well as before (Gemma's sandwich).
    pub sandwich_norms: bool,
    /// Q/K/V projections have biases (Qwen2).
    pub qkv_bias: bool,
    /// Final logit soft-capping (absent in Gemma 3 and Llama).
    pub final_logit_softcap: Option<f32>,
}

impl Hparams {
    /// Reads the hyper-parameters of `arch` from `md`; `vocab` comes from the embedding.
    pub fn from_metadata(arch: Arch, md: &Metadata, vocab: usize) -> Result<Hparams, ModelError> {
        let a = arch.name();
        let k = |s: &str| format!("{a}.{s}");
        md.require(&[
            &k("embedding_length"),
            &k("block_count"),
            &k("feed_forward_length"),
            &k("attention.head_count"),
            &k("attention.layer_norm_rms_epsilon"),
        ])?;
        let d_model = md.u32(&k("embedding_length"))? as usize;
        let n_layer = md.u32(&k("block_count"))? as usize;
        let d_ff = md.u32(&k("feed_forward_length"))? as usize;
        let n_head = md.u32(&k("attention.head_count"))? as usize;
        let n_head_kv = md
            .opt_u32(&k("attention.head_count_kv"))?
            .map_or(n_head, |v| v as usize);
        let head_dim = match md.opt_u32(&k("attention.key_length"))? {
            Some(v) => v as usize,
            None if n_head > 0 => d_model / n_head,
            None => 0,
        };
        let rope_dim = md
            .opt_u32(&k("rope.dimension_count"))?
            .map_or(head_dim, |v| v as usize);
        let rope_base = md.opt_f32(&k("rope.freq_base"))?.unwrap_or(10000.0);
        let rope_scale = match (
            md.opt_str(&k("rope.scaling.type"))?,
            md.opt_f32(&k("rope.scaling.factor"))?,
        ) {
            (Some("linear"), Some(f)) if f > 0.0 => f,
            _ => 1.0,
        };
        let ctx_train = md
            .opt_u32(&k("context_length"))?
            .map_or(4096, |v| v as usize);
        let rms_eps = md.f32(&k("attention.layer_norm_rms_epsilon"))?;
        let final_logit_softcap = md.opt_f32(&k("final_logit_softcapping"))?;

        let mut hp = Hparams {
            arch,
            n_layer,
            d_model,
            n_head,
            n_head_kv,
            head_dim,
            d_ff,
            vocab,
            ctx_train,
            rms_eps,
            rope_style: RopeStyle::Interleaved,
            rope_dim,
            rope_base,
            rope_base_local: rope_base,
            rope_scale,
            sliding_window: 0,
            sliding: vec![false; n_layer],
            embd_scale: None,
            query_scale: 1.0 / (head_dim as f32).sqrt(),
            ffn_act: FfnAct::Silu,
            qk_norm: false,
            sandwich_norms: false,
            qkv_bias: false,
            final_logit_softcap,
        };
        match arch {
            Arch::Llama => {}
            Arch::Qwen2 => {
                hp.rope_style = RopeStyle::Neox;
                hp.qkv_bias = true;
            }
            Arch::Gemma3 => {
                hp.rope_style = RopeStyle::Neox;
                hp.embd_scale = Some((d_model as f32).sqrt());
                hp.ffn_act = FfnAct::GeluTanh;
                hp.qk_norm = true;
                hp.sandwich_norms = true;
                // Local layers use base 10000; every sixth layer is global (5:1 pattern).
                hp.rope_base_local = 10000.0;
                hp.sliding_window = md
                    .opt_u32(&k("attention.sliding_window"))?
                    .map_or(0, |v| v as usize);
                let pattern = md
                    .opt_u32(&k("attention.sliding_window_pattern"))?
                    .map_or(6, |v| v as usize)
                    .max(1);
                if hp.sliding_window > 0 {
                    hp.sliding = (0..n_layer).map(|il| (il + 1) % pattern != 0).collect();
                }
                // Gemma 3 27B scales queries by 1/sqrt(d_model / n_head); the others by head_dim.
                if n_layer == 62 && n_head > 0 {
                    hp.query_scale = 1.0 / ((d_model / n_head) as f32).sqrt();
                }
            }
        }
        hp.validate()?;
        Ok(hp)
    }

    fn validate(&self) -> Result<(), ModelError> {
        let bad = |why: String| {
            Err(ModelError::BadHparams {
                arch: self.arch.name(),
                why,
            })
        };
        if self.n_layer == 0 || self.d_model == 0 || self.n_head == 0 || self.head_dim == 0 {
            return bad(format!(
                "zero-sized model (layers {}, d {}, heads {}, head_dim {})",
                self.n_layer, self.d_model, self.n_head, self.head_dim
            ));
        }
        if self.n_head_kv == 0 || !self.n_head.is_multiple_of(self.n_head_kv) {
            return bad(format!(
                "head_count {} is not a multiple of head_count_kv {}",
                self.n_head, self.n_head_kv
            ));
        }
        if self.rope_dim > self.head_dim || !self.rope_dim.is_multiple_of(2) {
            return bad(format!(
                "rope.dimension_count {} must be even and at most the head size {}",
                self.rope_dim, self.head_dim
            ));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return bad(format!("bad layer_norm_rms_epsilon {}", self.rms_eps));
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// The RoPE base and position scale of layer `il`.
    pub fn rope_for_layer(&self, il: usize) -> (f32, f32) {
        if self.sliding[il] {
            (self.rope_base_local, 1.0)
        } else {
            (self.rope_base, self.rope_scale)
        }
    }

    /// The tensors a layer of this architecture needs, and whether each is required.
    pub fn layer_tensors(&self) -> Vec<(TensorKind, bool)> {
        let mut v = vec![
            (TensorKind::AttnNorm, true),
            (TensorKind::AttnQ, true),
            (TensorKind::AttnK, true),
            (TensorKind::AttnV, true),
            (TensorKind::AttnOutput, true),
            (TensorKind::FfnNorm, true),
            (TensorKind::FfnGate, true),
            (TensorKind::FfnUp, true),
            (TensorKind::FfnDown, true),
        ];
        if self.qkv_bias {
            v.extend([
                (TensorKind::AttnQBias, true),
                (TensorKind::AttnKBias, true),
                (TensorKind::AttnVBias, true),
            ]);
        }
        if self.qk_norm {
            v.extend([(TensorKind::AttnQNorm, true), (TensorKind::AttnKNorm, true)]);
        }
        if self.sandwich_norms {
            v.extend([
                (TensorKind::PostAttnNorm, true),
                (TensorKind::PostFfwNorm, true),
            ]);
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_names_follow_gguf_conventions() {
        assert_eq!(
            TensorKind::AttnNorm.gguf_name(Some(3)),
            "blk.3.attn_norm.weight"
        );
        assert_eq!(
            TensorKind::AttnQBias.gguf_name(Some(0)),
            "blk.0.attn_q.bias"
        );
        assert_eq!(
            TensorKind::PostFfwNorm.gguf_name(Some(17)),
            "blk.17.post_ffw_norm.weight"
        );
        assert_eq!(TensorKind::TokenEmbd.gguf_name(None), "token_embd.weight");
        assert_eq!(TensorKind::Output.gguf_name(Some(2)), "output.weight");
        assert_eq!(
            TensorKind::RopeFreqs.gguf_name(Some(2)),
            "rope_freqs.weight"
        );
        assert_eq!(TensorKind::TokenEmbd.class(), LayerClass::Input);
        assert_eq!(TensorKind::OutputNorm.class(), LayerClass::Output);
        assert_eq!(TensorKind::FfnUp.class(), LayerClass::Repeating);
    }

    #[test]
    fn arch_names() {
        assert_eq!(Arch::from_name("gemma3"), Some(Arch::Gemma3));
        assert_eq!(Arch::from_name("mistral"), Some(Arch::Llama));
        assert_eq!(Arch::from_name("gpt-neox"), None);
    }
}
