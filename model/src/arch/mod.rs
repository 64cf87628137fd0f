//! Architectures as data: the tensor kinds a layer is built from, their GGUF names and
//! classes, the hyper-parameters read from metadata, and the layer recipe computed from
//! them ([`recipe`]). One file per architecture (`llama.rs`, `qwen2.rs`, `gemma3.rs`) holds
//! its metadata rules and named sizes; the forward passes walk the recipe and never compare
//! architecture names.

mod gemma3;
mod llama;
mod qwen2;
mod qwen3;
pub mod recipe;

use crate::error::ModelError;
use crate::gguf::Metadata;
use ringllm_kernels::ops::RopeStyle;

pub use recipe::{LayerRecipe, RopeTable, Step};

/// Architectures we run. Each has a file of its own in this folder (`llama.rs`, `qwen2.rs`,
/// `gemma3.rs`) holding its metadata rules, its named sizes and the layer flags its recipe
/// ([`recipe`]) is computed from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3, SmolLM, Mistral (GGUF arch `llama`).
    Llama,
    /// Qwen2: Llama layout with Q/K/V biases and NeoX RoPE.
    Qwen2,
    /// Gemma 3: sandwich norms, QK-norm, GeGLU, sliding-window layers, scaled embeddings.
    Gemma3,
    /// Qwen3: Llama layout with QK-norm and NeoX RoPE, no biases.
    Qwen3,
}

impl Arch {
    /// The architecture named by `general.architecture`.
    pub fn from_name(name: &str) -> Option<Arch> {
        match name {
            "llama" | "mistral" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "gemma3" => Some(Arch::Gemma3),
            "qwen3" => Some(Arch::Qwen3),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen3 => "qwen3",
        }
    }

    pub const SUPPORTED: &'static [&'static str] =
        &["llama", "mistral", "qwen2", "gemma3", "qwen3"];

    /// This architecture's rules over the generic hyper-parameters read from `md`.
    fn apply(self, hp: &mut Hparams, md: &Metadata) -> Result<(), ModelError> {
        match self {
            Arch::Llama => llama::apply(hp, md),
            Arch::Qwen2 => qwen2::apply(hp, md),
            Arch::Gemma3 => gemma3::apply(hp, md),
            Arch::Qwen3 => qwen3::apply(hp, md),
        }
    }
}

/// The architecture-prefixed metadata keys we read or write (`{arch}.{suffix}`), each named
/// once: the reader (`Hparams::from_metadata`) and the writers (`synth`) share these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetaKey {
    ContextLength,
    EmbeddingLength,
    BlockCount,
    FeedForwardLength,
    VocabSize,
    HeadCount,
    HeadCountKv,
    KeyLength,
    ValueLength,
    RmsEpsilon,
    SlidingWindow,
    SlidingWindowPattern,
    RopeDimensionCount,
    RopeFreqBase,
    RopeScalingType,
    RopeScalingFactor,
    FinalLogitSoftcapping,
}

impl MetaKey {
    /// The key without its architecture prefix.
    pub fn suffix(self) -> &'static str {
        match self {
            MetaKey::ContextLength => "context_length",
            MetaKey::EmbeddingLength => "embedding_length",
            MetaKey::BlockCount => "block_count",
            MetaKey::FeedForwardLength => "feed_forward_length",
            MetaKey::VocabSize => "vocab_size",
            MetaKey::HeadCount => "attention.head_count",
            MetaKey::HeadCountKv => "attention.head_count_kv",
            MetaKey::KeyLength => "attention.key_length",
            MetaKey::ValueLength => "attention.value_length",
            MetaKey::RmsEpsilon => "attention.layer_norm_rms_epsilon",
            MetaKey::SlidingWindow => "attention.sliding_window",
            MetaKey::SlidingWindowPattern => "attention.sliding_window_pattern",
            MetaKey::RopeDimensionCount => "rope.dimension_count",
            MetaKey::RopeFreqBase => "rope.freq_base",
            MetaKey::RopeScalingType => "rope.scaling.type",
            MetaKey::RopeScalingFactor => "rope.scaling.factor",
            MetaKey::FinalLogitSoftcapping => "final_logit_softcapping",
        }
    }

    /// The full key for architecture `arch` (its GGUF name, e.g. `gemma3`).
    pub fn of(self, arch: &str) -> String {
        format!("{arch}.{}", self.suffix())
    }
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
    /// The generic keys are read here; the architecture's own rules (its file in this
    /// folder) then set its flags and read its own keys.
    pub fn from_metadata(arch: Arch, md: &Metadata, vocab: usize) -> Result<Hparams, ModelError> {
        let a = arch.name();
        let k = |key: MetaKey| key.of(a);
        md.require(&[
            &k(MetaKey::EmbeddingLength),
            &k(MetaKey::BlockCount),
            &k(MetaKey::FeedForwardLength),
            &k(MetaKey::HeadCount),
            &k(MetaKey::RmsEpsilon),
        ])?;
        let d_model = md.u32(&k(MetaKey::EmbeddingLength))? as usize;
        let n_layer = md.u32(&k(MetaKey::BlockCount))? as usize;
        let d_ff = md.u32(&k(MetaKey::FeedForwardLength))? as usize;
        let n_head = md.u32(&k(MetaKey::HeadCount))? as usize;
        let n_head_kv = md
            .opt_u32(&k(MetaKey::HeadCountKv))?
            .map_or(n_head, |v| v as usize);
        let head_dim = match md.opt_u32(&k(MetaKey::KeyLength))? {
            Some(v) => v as usize,
            None if n_head > 0 => d_model / n_head,
            None => 0,
        };
        let rope_dim = md
            .opt_u32(&k(MetaKey::RopeDimensionCount))?
            .map_or(head_dim, |v| v as usize);
        let rope_base = md.opt_f32(&k(MetaKey::RopeFreqBase))?.unwrap_or(10000.0);
        let rope_scale = match (
            md.opt_str(&k(MetaKey::RopeScalingType))?,
            md.opt_f32(&k(MetaKey::RopeScalingFactor))?,
        ) {
            (Some("linear"), Some(f)) if f > 0.0 => f,
            _ => 1.0,
        };
        let ctx_train = md
            .opt_u32(&k(MetaKey::ContextLength))?
            .map_or(4096, |v| v as usize);
        let rms_eps = md.f32(&k(MetaKey::RmsEpsilon))?;
        let final_logit_softcap = md.opt_f32(&k(MetaKey::FinalLogitSoftcapping))?;

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
        arch.apply(&mut hp, md)?;
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

    /// The recipe of layer `il`: the steps both forward passes walk, in order.
    pub fn recipe(&self, il: usize) -> LayerRecipe {
        recipe::build(self, il)
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
