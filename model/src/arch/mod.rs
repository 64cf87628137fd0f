//! Architectures as data: the tensor kinds a layer is built from, their GGUF names and
//! classes, the hyper-parameters read from metadata, and the layer recipe computed from
//! them ([`recipe`]). One file per architecture (`llama.rs`, `qwen2.rs`, `gemma3.rs`) holds
//! its metadata rules and named sizes; the forward passes walk the recipe and never compare
//! architecture names.

mod gemma2;
pub mod gemma3;
mod gemma4;
mod gptoss;
mod llama;
mod mistral3;
mod phi3;
mod qwen2;
mod qwen3;
mod qwen3moe;
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
    /// Gemma 4 (dense): Gemma 3's layout plus per-layer head sizes, shared-KV layers, V-norm,
    /// proportional RoPE, per-layer embeddings and a layer output scale.
    Gemma4,
    /// Phi-3 / Phi-3.5 mini: fused QKV and gate/up matrices, NeoX RoPE with LongRoPE factors.
    Phi3,
    /// Gemma 2: sandwich norms, GeGLU, alternating sliding-window layers, attention and
    /// final logit soft-capping, scaled embeddings.
    Gemma2,
    /// Mistral 3 (Mistral Small 3.x): the Llama block under its own name.
    Mistral3,
    /// Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): the Qwen3 block with a mixture-of-experts
    /// feed-forward (softmax router, top-k, weights renormalized).
    Qwen3Moe,
    /// gpt-oss (OpenAI's open-weight MoE): biases everywhere, attention sinks, alternating
    /// sliding-window and full layers, YaRN RoPE, a softmax over the picked experts' logits,
    /// clamped SwiGLU experts.
    GptOss,
}

impl Arch {
    /// The architecture named by `general.architecture`.
    pub fn from_name(name: &str) -> Option<Arch> {
        match name {
            "llama" | "mistral" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "gemma3" => Some(Arch::Gemma3),
            "qwen3" => Some(Arch::Qwen3),
            "gemma4" => Some(Arch::Gemma4),
            "phi3" => Some(Arch::Phi3),
            "gemma2" => Some(Arch::Gemma2),
            "mistral3" => Some(Arch::Mistral3),
            "qwen3moe" => Some(Arch::Qwen3Moe),
            "gpt-oss" => Some(Arch::GptOss),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma4 => "gemma4",
            Arch::Phi3 => "phi3",
            Arch::Gemma2 => "gemma2",
            Arch::Mistral3 => "mistral3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::GptOss => "gpt-oss",
        }
    }

    pub const SUPPORTED: &'static [&'static str] = &[
        "llama", "mistral", "qwen2", "gemma3", "qwen3", "gemma4", "phi3", "gemma2", "mistral3",
        "qwen3moe", "gpt-oss",
    ];

    /// This architecture's rules over the generic hyper-parameters read from `md`.
    fn apply(self, hp: &mut Hparams, md: &Metadata) -> Result<(), ModelError> {
        match self {
            Arch::Llama => llama::apply(hp, md),
            Arch::Qwen2 => qwen2::apply(hp, md),
            Arch::Gemma3 => gemma3::apply(hp, md),
            Arch::Qwen3 => qwen3::apply(hp, md),
            Arch::Gemma4 => gemma4::apply(hp, md),
            Arch::Phi3 => phi3::apply(hp, md),
            Arch::Gemma2 => gemma2::apply(hp, md),
            Arch::Mistral3 => mistral3::apply(hp, md),
            Arch::Qwen3Moe => qwen3moe::apply(hp, md),
            Arch::GptOss => gptoss::apply(hp, md),
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
    KeyLengthSwa,
    ValueLengthSwa,
    RopeDimensionCountSwa,
    RopeFreqBaseSwa,
    SharedKvLayers,
    EmbeddingLengthPerLayer,
    /// The context the model was trained at before its RoPE was scaled (LongRoPE, YaRN).
    RopeScalingOrigCtx,
    /// Multiplier of RoPE's cos and sin (LongRoPE's attention factor).
    RopeScalingAttnFactor,
    AttnLogitSoftcapping,
    AttnTemperatureScale,
    /// Experts per mixture-of-experts layer.
    ExpertCount,
    /// Experts the router picks per token.
    ExpertUsedCount,
    /// One expert's feed-forward width.
    ExpertFeedForwardLength,
    /// Multiplier of the routing weights (0 or 1: none).
    ExpertWeightsScale,
    /// The picked experts' weights renormalized to sum to 1.
    ExpertWeightsNorm,
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
            MetaKey::KeyLengthSwa => "attention.key_length_swa",
            MetaKey::ValueLengthSwa => "attention.value_length_swa",
            MetaKey::RopeDimensionCountSwa => "rope.dimension_count_swa",
            MetaKey::RopeFreqBaseSwa => "rope.freq_base_swa",
            MetaKey::SharedKvLayers => "attention.shared_kv_layers",
            MetaKey::EmbeddingLengthPerLayer => "embedding_length_per_layer_input",
            MetaKey::RopeScalingOrigCtx => "rope.scaling.original_context_length",
            MetaKey::RopeScalingAttnFactor => "rope.scaling.attn_factor",
            MetaKey::AttnLogitSoftcapping => "attn_logit_softcapping",
            MetaKey::AttnTemperatureScale => "attention.temperature_scale",
            MetaKey::ExpertCount => "expert_count",
            MetaKey::ExpertUsedCount => "expert_used_count",
            MetaKey::ExpertFeedForwardLength => "expert_feed_forward_length",
            MetaKey::ExpertWeightsScale => "expert_weights_scale",
            MetaKey::ExpertWeightsNorm => "expert_weights_norm",
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
    /// Gemma 4 per-layer embeddings: `[n_layer·ple, vocab]`, one row per token.
    PerLayerTokenEmbd,
    /// Gemma 4: the embedding projected to every layer's per-layer input, `[d, n_layer·ple]`.
    PerLayerModelProj,
    /// Gemma 4: RMSNorm of each layer's projected input, `[ple]`.
    PerLayerProjNorm,
    /// Gemma 4: a layer's gate from the residual to its per-layer input width, `[d, ple]`.
    PerLayerInpGate,
    /// Gemma 4: a layer's projection of the gated per-layer input back to `d`, `[ple, d]`.
    PerLayerProj,
    /// Gemma 4: RMSNorm of that projection, `[d]`.
    PerLayerPostNorm,
    /// Gemma 4: the scalar a layer's output is multiplied by, `[1]`.
    LayerOutScale,
    /// Q, K and V projections in one matrix, rows `[q | k | v]` (Phi-3).
    AttnQkv,
    /// Gate and up projections in one matrix, rows `[gate | up]` (Phi-3). Its GGUF name is
    /// `ffn_up`, as llama.cpp writes it; the recipe says which of the two a layer reads.
    FfnGateUp,
    /// LongRoPE frequency divisors for contexts past the original one (Phi-3 128k).
    RopeFactorsLong,
    /// LongRoPE frequency divisors for contexts within the original one.
    RopeFactorsShort,
    /// The router of a mixture-of-experts layer: one row per expert, `[d, n_expert]`.
    FfnGateInp,
    /// Every expert's gate projection stacked, `[d, ff_exp, n_expert]`.
    FfnGateExps,
    /// Every expert's up projection stacked, `[d, ff_exp, n_expert]`.
    FfnUpExps,
    /// Every expert's down projection stacked, `[ff_exp, d, n_expert]`.
    FfnDownExps,
    /// The attention output projection's bias, `[d]` (gpt-oss).
    AttnOutBias,
    /// One learned logit per query head that joins every softmax of the head and takes no
    /// value (gpt-oss's attention sinks), `[n_head]`.
    AttnSinks,
    /// The router's bias, `[n_expert]`.
    FfnGateInpBias,
    /// Every expert's gate, up and down biases stacked, `[ff_exp, n_expert]` (down:
    /// `[d, n_expert]`).
    FfnGateExpsBias,
    FfnUpExpsBias,
    FfnDownExpsBias,
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
            TensorKind::PerLayerTokenEmbd => "per_layer_token_embd",
            TensorKind::PerLayerModelProj => "per_layer_model_proj",
            TensorKind::PerLayerProjNorm => "per_layer_proj_norm",
            TensorKind::PerLayerInpGate => "inp_gate",
            TensorKind::PerLayerProj => "proj",
            TensorKind::PerLayerPostNorm => "post_norm",
            TensorKind::LayerOutScale => "layer_output_scale",
            TensorKind::AttnQkv => "attn_qkv",
            TensorKind::FfnGateUp => "ffn_up",
            TensorKind::RopeFactorsLong => "rope_factors_long",
            TensorKind::RopeFactorsShort => "rope_factors_short",
            TensorKind::FfnGateInp => "ffn_gate_inp",
            TensorKind::FfnGateExps => "ffn_gate_exps",
            TensorKind::FfnUpExps => "ffn_up_exps",
            TensorKind::FfnDownExps => "ffn_down_exps",
            TensorKind::AttnOutBias => "attn_output",
            TensorKind::AttnSinks => "attn_sinks",
            TensorKind::FfnGateInpBias => "ffn_gate_inp",
            TensorKind::FfnGateExpsBias => "ffn_gate_exps",
            TensorKind::FfnUpExpsBias => "ffn_up_exps",
            TensorKind::FfnDownExpsBias => "ffn_down_exps",
        }
    }

    pub fn class(self) -> LayerClass {
        match self {
            TensorKind::TokenEmbd
            | TensorKind::PerLayerTokenEmbd
            | TensorKind::PerLayerModelProj
            | TensorKind::PerLayerProjNorm => LayerClass::Input,
            TensorKind::OutputNorm | TensorKind::Output => LayerClass::Output,
            // Shared by all layers; loaded wherever layers are.
            TensorKind::RopeFreqs => LayerClass::Repeating,
            _ => LayerClass::Repeating,
        }
    }

    /// Shared by every layer, named without a layer index (`rope_freqs.weight`).
    fn is_global(self) -> bool {
        matches!(
            self,
            TensorKind::RopeFreqs | TensorKind::RopeFactorsLong | TensorKind::RopeFactorsShort
        )
    }

    fn is_bias(self) -> bool {
        matches!(
            self,
            TensorKind::AttnQBias
                | TensorKind::AttnKBias
                | TensorKind::AttnVBias
                | TensorKind::AttnOutBias
                | TensorKind::FfnGateInpBias
                | TensorKind::FfnGateExpsBias
                | TensorKind::FfnUpExpsBias
                | TensorKind::FfnDownExpsBias
        )
    }

    /// The GGUF tensor name, e.g. `blk.3.attn_norm.weight`.
    pub fn gguf_name(self, layer: Option<usize>) -> String {
        let suffix = if self.is_bias() { "bias" } else { "weight" };
        match (self.class(), layer) {
            (LayerClass::Repeating, Some(il)) if !self.is_global() => {
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
    /// gpt-oss's clamped SwiGLU: `g = min(gate, 7)`, `u = clamp(up, −7, 7)`,
    /// `g · σ(1.702 g) · (u + 1)`.
    SwigluOai,
}

/// The most layers a model may declare (every per-layer table is sized from it).
pub const MAX_LAYERS: usize = 4096;

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
    /// Per-layer shapes where layers differ (head sizes and KV heads of sliding-window
    /// layers, per-layer feed-forward widths, shared-KV layers, V from K); empty: every layer
    /// has the shape above ([`Hparams::layer_shape`]).
    pub layer_shapes: Vec<LayerShape>,
    /// RoPE dimensions of the sliding-window layers (the global layers' is `rope_dim`).
    pub rope_dim_local: usize,
    /// `rope_freqs` divides the global layers' frequencies only (Gemma 4's proportional
    /// RoPE); otherwise every layer's (Llama 3).
    pub rope_freqs_global_only: bool,
    /// Width of each layer's per-layer embedding input (Gemma 4 E2B/E4B); 0: none.
    pub ple_dim: usize,
    /// V RMS-normed per head, without a weight (Gemma 4).
    pub v_norm: bool,
    /// Each layer's output multiplied by its scalar `layer_output_scale` (Gemma 4).
    pub out_scale: bool,
    /// Q/K/V in one matrix and gate/up in one matrix (Phi-3): the loader reads the fused
    /// tensors and splits their rows into views.
    pub fused_proj: bool,
    /// LongRoPE: the context the model was trained at before its RoPE was scaled; a runner
    /// for a longer context reads `rope_factors_long`, otherwise `rope_factors_short`.
    pub rope_orig_ctx: usize,
    /// Multiplier of RoPE's cos and sin, so of queries and keys (LongRoPE's attention factor).
    pub rope_attn_factor: f32,
    /// Attention logit soft-capping: scaled scores `s` become `c · tanh(s / c)` before the
    /// softmax (Gemma 2).
    pub attn_logit_softcap: Option<f32>,
    /// A layer may lack its V projection, V then being its K (Gemma 4): the loader sets
    /// [`LayerShape::v_from_k`] from the tensors present.
    pub v_proj_optional: bool,
    /// The feed-forward is a mixture of experts (`{arch}.expert_count` > 0).
    pub moe: Option<MoeParams>,
    /// Attention sinks: a learned logit per query head in every softmax (gpt-oss).
    pub attn_sinks: bool,
    /// The attention output projection has a bias (gpt-oss).
    pub attn_out_bias: bool,
    /// The feed-forward's pre-norm is the file's `post_attention_norm` (gpt-oss's naming).
    pub ffn_norm_post_attn: bool,
    /// YaRN RoPE (`rope.scaling.type` = `yarn`): frequencies blended between interpolated
    /// and original, cos and sin scaled ([`Yarn`]).
    pub yarn: Option<Yarn>,
}

/// YaRN's parameters as ggml applies them: frequency `i` (of `n_rot / 2`) becomes
/// `f_i · ((1 − r_i) / factor + r_i)`, `r_i` a ramp from 1 (dimensions below the `beta_fast`
/// correction dimension: extrapolated) to 0 (above `beta_slow`'s: interpolated), and cos and
/// sin are multiplied by `1 + 0.1 · ln(factor)` (times the attention factor).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f32,
    pub orig_ctx: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

impl Yarn {
    /// The per-frequency multipliers of `n_rot / 2` frequencies of base `base`.
    pub fn freq_multipliers(&self, base: f32, n_rot: usize) -> Vec<f32> {
        // The dimension whose wavelength fits `rot` times in the original context.
        let corr_dim = |rot: f32| {
            n_rot as f32 * (self.orig_ctx as f32 / (rot * 2.0 * std::f32::consts::PI)).ln()
                / (2.0 * base.ln())
        };
        let low = corr_dim(self.beta_fast).floor().max(0.0);
        let high = corr_dim(self.beta_slow).ceil().min(n_rot as f32 - 1.0);
        (0..n_rot / 2)
            .map(|i| {
                let y = (i as f32 - low) / (high - low).max(0.001);
                let ramp = 1.0 - y.clamp(0.0, 1.0);
                (1.0 - ramp) / self.factor + ramp
            })
            .collect()
    }

    /// The multiplier of cos and sin.
    pub fn mscale(&self) -> f32 {
        1.0 + 0.1 * (self.factor).ln()
    }
}

/// How a mixture-of-experts feed-forward routes a token (llama.cpp's `build_moe_ffn` with a
/// softmax gate).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeParams {
    /// Experts per layer.
    pub n_expert: usize,
    /// Experts each token goes through (top-k of the router's softmax).
    pub n_used: usize,
    /// Feed-forward width of one expert.
    pub d_ff_exp: usize,
    /// The k picked probabilities divided by their sum (Qwen3-MoE, Mixtral).
    pub norm_weights: bool,
    /// How the router's logits become the picked experts' weights.
    pub gating: Gating,
    /// The router and every expert have biases (gpt-oss).
    pub biases: bool,
    /// Multiplier of the routing weights (1: none).
    pub weights_scale: f32,
}

/// How a router's logits become weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over all experts, the k most probable picked (their probabilities the weights).
    Softmax,
    /// The k largest logits picked, their weights a softmax over those k only (gpt-oss).
    SoftmaxPicked,
}

/// The most experts a token may pick where their weights are a softmax over the picks
/// ([`Gating::SoftmaxPicked`]).
pub const MAX_PICKED: usize = 64;

/// The most experts a layer may declare (the router's row count).
pub const MAX_EXPERTS: usize = 1024;

impl MoeParams {
    /// Reads the expert keys of `arch`: `None` when the file has no experts.
    fn from_metadata(
        md: &Metadata,
        arch: &'static str,
        d_ff: usize,
    ) -> Result<Option<MoeParams>, ModelError> {
        let k = |key: MetaKey| key.of(arch);
        let n_expert = md.opt_u32(&k(MetaKey::ExpertCount))?.unwrap_or(0) as usize;
        if n_expert == 0 {
            return Ok(None);
        }
        let bad = |why: String| Err(ModelError::BadHparams { arch, why });
        let n_used = md.opt_u32(&k(MetaKey::ExpertUsedCount))?.unwrap_or(0) as usize;
        if n_expert > MAX_EXPERTS || n_used == 0 || n_used > n_expert {
            return bad(format!(
                "{} {n_expert} and {} {n_used}: need 1 <= used <= count <= {MAX_EXPERTS}",
                k(MetaKey::ExpertCount),
                k(MetaKey::ExpertUsedCount)
            ));
        }
        // llama.cpp's default when the width is not given: the dense width shared by k.
        let d_ff_exp = match md.opt_u32(&k(MetaKey::ExpertFeedForwardLength))? {
            Some(v) => v as usize,
            None => d_ff / n_used,
        };
        if d_ff_exp == 0 {
            return bad(format!("{} is 0", k(MetaKey::ExpertFeedForwardLength)));
        }
        Ok(Some(MoeParams {
            n_expert,
            n_used,
            d_ff_exp,
            // Qwen3-MoE and Mixtral always renormalize and never scale: llama.cpp reads neither
            // `expert_weights_norm` nor `expert_weights_scale` for them (a file carrying the
            // keys runs the same there). An architecture that uses them reads them in its file.
            norm_weights: true,
            weights_scale: 1.0,
            gating: Gating::Softmax,
            biases: false,
        }))
    }
}

/// One layer's shape where it may differ from the model's scalar hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerShape {
    pub head_dim: usize,
    pub n_head_kv: usize,
    pub d_ff: usize,
    /// The earlier layer whose KV cache this layer reads; it computes and stores no K or V
    /// of its own (Gemma 4's shared-KV layers).
    pub kv_source: Option<usize>,
    /// The layer has no V projection: V is its K projection (Gemma 4 31B's full-attention
    /// layers); a load-time rule, from the tensors present ([`Hparams::set_v_from_k`]).
    pub v_from_k: bool,
}

/// A per-layer key's first value, and all of them when it is an array.
type ScalarOrPerLayer = (usize, Option<Vec<usize>>);

/// A per-layer key (`feed_forward_length`, `attention.head_count_kv`) that llama.cpp reads as a
/// number or an array of one value per layer: the first value, and the array when it is one.
fn scalar_or_per_layer(
    md: &Metadata,
    key: &str,
    n_layer: usize,
    arch: &'static str,
) -> Result<Option<ScalarOrPerLayer>, ModelError> {
    match md.get(key) {
        None => Ok(None),
        Some(crate::gguf::Value::Array(_)) => {
            let v = md.u32_array(key)?;
            if v.len() != n_layer {
                return Err(ModelError::BadHparams {
                    arch,
                    why: format!("{key} has {} values for {n_layer} layers", v.len()),
                });
            }
            let v: Vec<usize> = v.into_iter().map(|x| x as usize).collect();
            Ok(Some((v[0], Some(v))))
        }
        Some(_) => Ok(Some((md.u32(key)? as usize, None))),
    }
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
        if n_layer > MAX_LAYERS {
            return Err(ModelError::BadHparams {
                arch: a,
                why: format!("{n_layer} layers (at most {MAX_LAYERS})"),
            });
        }
        let (d_ff, ff_per_layer) =
            scalar_or_per_layer(md, &k(MetaKey::FeedForwardLength), n_layer, a)?
                .unwrap_or((0, None));
        let n_head = md.u32(&k(MetaKey::HeadCount))? as usize;
        let (n_head_kv, kv_per_layer) =
            scalar_or_per_layer(md, &k(MetaKey::HeadCountKv), n_layer, a)?
                .unwrap_or((n_head, None));
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
            layer_shapes: Vec::new(),
            rope_dim_local: rope_dim,
            rope_freqs_global_only: false,
            ple_dim: 0,
            v_norm: false,
            out_scale: false,
            fused_proj: false,
            rope_orig_ctx: ctx_train,
            rope_attn_factor: 1.0,
            attn_logit_softcap: None,
            v_proj_optional: false,
            moe: MoeParams::from_metadata(md, a, d_ff)?,
            attn_sinks: false,
            attn_out_bias: false,
            ffn_norm_post_attn: false,
            yarn: None,
        };
        if ff_per_layer.is_some() || kv_per_layer.is_some() {
            let base = hp.layer_shape(0);
            hp.layer_shapes = (0..n_layer)
                .map(|il| LayerShape {
                    d_ff: ff_per_layer.as_ref().map_or(d_ff, |v| v[il]),
                    n_head_kv: kv_per_layer.as_ref().map_or(n_head_kv, |v| v[il]),
                    ..base
                })
                .collect();
        }
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
        if !(self.rope_attn_factor.is_finite() && self.rope_attn_factor > 0.0) {
            return bad(format!(
                "rope.scaling.attn_factor {} must be a positive number",
                self.rope_attn_factor
            ));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return bad(format!("bad layer_norm_rms_epsilon {}", self.rms_eps));
        }
        if !self.layer_shapes.is_empty() && self.layer_shapes.len() != self.n_layer {
            return bad(format!(
                "{} per-layer shapes for {} layers",
                self.layer_shapes.len(),
                self.n_layer
            ));
        }
        for il in 0..self.n_layer {
            let s = self.layer_shape(il);
            if s.head_dim == 0 || s.d_ff == 0 || s.n_head_kv == 0 {
                return bad(format!("layer {il}: zero-sized shape {s:?}"));
            }
            if !self.n_head.is_multiple_of(s.n_head_kv) {
                return bad(format!(
                    "layer {il}: head_count {} is not a multiple of its {} KV heads",
                    self.n_head, s.n_head_kv
                ));
            }
            let rd = self.rope_dim_of(il);
            if rd > s.head_dim || !rd.is_multiple_of(2) {
                return bad(format!(
                    "layer {il}: {rd} RoPE dimensions must be even and at most its head size {}",
                    s.head_dim
                ));
            }
            if let Some(src) = s.kv_source {
                let t = self.layer_shape(src);
                if src >= il
                    || t.kv_source.is_some()
                    || self.sliding[src] != self.sliding[il]
                    || (t.head_dim, t.n_head_kv) != (s.head_dim, s.n_head_kv)
                {
                    return bad(format!(
                        "layer {il} cannot share the KV cache of layer {src} (an earlier layer \
                         of the same kind and shape that has its own)"
                    ));
                }
            }
        }
        for (what, cap) in [
            ("final_logit_softcapping", self.final_logit_softcap),
            ("attn_logit_softcapping", self.attn_logit_softcap),
        ] {
            if cap.is_some_and(|c| !(c.is_finite() && c > 0.0)) {
                return bad(format!("{what} {cap:?} is not a positive number"));
            }
        }
        Ok(())
    }

    /// Layer `il`'s shape (the scalar hyper-parameters when layers do not differ).
    pub fn layer_shape(&self, il: usize) -> LayerShape {
        self.layer_shapes
            .get(il)
            .copied()
            .unwrap_or_else(|| self.layer_shape_default())
    }

    /// True when every layer has the scalar shape (what the GPU backend runs).
    pub fn uniform_layers(&self) -> bool {
        (0..self.n_layer).all(|il| self.layer_shape(il) == self.layer_shape_default())
            && self.rope_dim_local == self.rope_dim
    }

    fn layer_shape_default(&self) -> LayerShape {
        LayerShape {
            head_dim: self.head_dim,
            n_head_kv: self.n_head_kv,
            d_ff: self.d_ff,
            kv_source: None,
            v_from_k: false,
        }
    }

    pub fn head_dim_of(&self, il: usize) -> usize {
        self.layer_shape(il).head_dim
    }

    pub fn q_dim_of(&self, il: usize) -> usize {
        self.n_head * self.layer_shape(il).head_dim
    }

    pub fn kv_dim_of(&self, il: usize) -> usize {
        let s = self.layer_shape(il);
        s.n_head_kv * s.head_dim
    }

    pub fn d_ff_of(&self, il: usize) -> usize {
        self.layer_shape(il).d_ff
    }

    /// The earlier layer whose KV cache layer `il` reads, when it has none of its own.
    pub fn kv_source(&self, il: usize) -> Option<usize> {
        self.layer_shape(il).kv_source
    }

    /// RoPE dimensions of layer `il`.
    pub fn rope_dim_of(&self, il: usize) -> usize {
        if self.sliding.get(il).copied().unwrap_or(false) {
            self.rope_dim_local
        } else {
            self.rope_dim
        }
    }

    /// The widest `q` row over the layers (scratch sizes).
    pub fn max_q_dim(&self) -> usize {
        (0..self.n_layer)
            .map(|il| self.q_dim_of(il))
            .fold(self.q_dim(), usize::max)
    }

    /// The widest `k`/`v` row over the layers.
    pub fn max_kv_dim(&self) -> usize {
        (0..self.n_layer)
            .map(|il| self.kv_dim_of(il))
            .fold(self.kv_dim(), usize::max)
    }

    /// The widest feed-forward over the layers.
    pub fn max_d_ff(&self) -> usize {
        (0..self.n_layer)
            .map(|il| self.d_ff_of(il))
            .fold(self.d_ff, usize::max)
    }

    /// The load-time rule for architectures whose V projection is optional (Gemma 4): layer
    /// `il` has none, so its V is its K.
    pub fn set_v_from_k(&mut self, il: usize) {
        if self.layer_shapes.is_empty() {
            self.layer_shapes = (0..self.n_layer)
                .map(|_| self.layer_shape_default())
                .collect();
        }
        if let Some(s) = self.layer_shapes.get_mut(il) {
            s.v_from_k = true;
        }
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
        assert_eq!(
            TensorKind::AttnQkv.gguf_name(Some(4)),
            "blk.4.attn_qkv.weight"
        );
        assert_eq!(
            TensorKind::FfnGateUp.gguf_name(Some(4)),
            TensorKind::FfnUp.gguf_name(Some(4))
        );
        assert_eq!(
            TensorKind::RopeFactorsLong.gguf_name(Some(1)),
            "rope_factors_long.weight"
        );
        assert_eq!(
            TensorKind::RopeFactorsShort.gguf_name(None),
            "rope_factors_short.weight"
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
        assert_eq!(Arch::from_name("phi3"), Some(Arch::Phi3));
        assert_eq!(Arch::Phi3.name(), "phi3");
    }
}
