//! What each Hugging Face model class becomes in GGUF: the architecture name, the
//! hyper-parameters as `{arch}.…` metadata, and every tensor's GGUF name, expected shape and
//! transform — the tables llama.cpp's converter and `gguf-py` tensor mapping describe,
//! written here as data.
//!
//! Transforms:
//! - Llama-family Q and K rows are permuted so that the interleaved ("normal") RoPE applies
//!   in the GGUF layout: Hugging Face rotates the halves of each head (NeoX order); within a
//!   head, GGUF row `2i + t` is Hugging Face row `t·hd/2 + i`.
//! - Gemma 2 and 3 store RMSNorm weights as `w` and compute `x·(1 + w)`; GGUF stores `1 + w`.
//! - Phi-3's fused `qkv_proj` and `gate_up_proj` stay fused (`attn_qkv`, `ffn_up` of twice the
//!   feed-forward width), as in llama.cpp's files.

use super::config::HfConfig;
use super::ConvertError;
use ringllm_model::arch::gemma3;
use ringllm_model::arch::{MetaKey, TensorKind};
use ringllm_model::gguf::Value;

/// The model classes we convert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfArch {
    Llama,
    Qwen2,
    Qwen3,
    Gemma2,
    Gemma3,
    Phi3,
    Mistral3,
}

/// `architectures[0]` values and what they are.
const CLASSES: &[(&str, HfArch)] = &[
    ("LlamaForCausalLM", HfArch::Llama),
    ("MistralForCausalLM", HfArch::Llama),
    ("Qwen2ForCausalLM", HfArch::Qwen2),
    ("Qwen3ForCausalLM", HfArch::Qwen3),
    ("Gemma2ForCausalLM", HfArch::Gemma2),
    ("Gemma3ForCausalLM", HfArch::Gemma3),
    ("Gemma3ForConditionalGeneration", HfArch::Gemma3),
    ("Phi3ForCausalLM", HfArch::Phi3),
    ("Mistral3ForConditionalGeneration", HfArch::Mistral3),
];

impl HfArch {
    pub fn from_class(class: &str) -> Option<HfArch> {
        CLASSES.iter().find(|c| c.0 == class).map(|c| c.1)
    }

    pub fn classes() -> Vec<&'static str> {
        CLASSES.iter().map(|c| c.0).collect()
    }

    /// `general.architecture`.
    pub fn gguf_name(self) -> &'static str {
        match self {
            HfArch::Llama => "llama",
            HfArch::Qwen2 => "qwen2",
            HfArch::Qwen3 => "qwen3",
            HfArch::Gemma2 => "gemma2",
            HfArch::Gemma3 => "gemma3",
            HfArch::Phi3 => "phi3",
            HfArch::Mistral3 => "mistral3",
        }
    }

    pub fn is_gemma(self) -> bool {
        matches!(self, HfArch::Gemma2 | HfArch::Gemma3)
    }

    /// Q/K rows permuted for interleaved RoPE (the Llama family).
    fn permutes_qk(self) -> bool {
        matches!(self, HfArch::Llama | HfArch::Mistral3)
    }
}

/// The sizes tensor shapes are made of.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub n_layer: u32,
    pub d: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    pub ff: u32,
}

impl Dims {
    pub fn read(cfg: &HfConfig) -> Result<Dims, ConvertError> {
        let d = cfg.u32("hidden_size")?;
        let n_head = cfg.u32("num_attention_heads")?;
        let n_head_kv = cfg.opt_u32("num_key_value_heads")?.unwrap_or(n_head);
        if n_head == 0 || n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(cfg.error(
                "num_key_value_heads",
                format!("{n_head_kv} does not divide num_attention_heads {n_head}"),
            ));
        }
        let head_dim = match cfg.opt_u32("head_dim")? {
            Some(h) => h,
            None => d / n_head,
        };
        let dims = Dims {
            n_layer: cfg.u32("num_hidden_layers")?,
            d,
            n_head,
            n_head_kv,
            head_dim,
            ff: cfg.u32("intermediate_size")?,
        };
        for (key, v) in [
            ("num_hidden_layers", dims.n_layer),
            ("hidden_size", d),
            ("head_dim", head_dim),
            ("intermediate_size", dims.ff),
        ] {
            if v == 0 || v > 1 << 20 {
                return Err(cfg.error(key, format!("{v} is out of range (1 to 2^20)")));
            }
        }
        if n_head.checked_mul(head_dim).is_none_or(|q| q > 1 << 20) || n_head > 4096 {
            return Err(cfg.error(
                "num_attention_heads",
                format!("{n_head} heads of {head_dim}"),
            ));
        }
        Ok(dims)
    }

    fn get(&self, s: Size, vocab: u32) -> u64 {
        let (q, kv) = (self.n_head * self.head_dim, self.n_head_kv * self.head_dim);
        u64::from(match s {
            Size::D => self.d,
            Size::Q => q,
            Size::Kv => kv,
            Size::Qkv => q + 2 * kv,
            Size::Ff => self.ff,
            Size::Ff2 => 2 * self.ff,
            Size::HeadDim => self.head_dim,
            Size::Vocab => vocab,
        })
    }
}

#[derive(Clone, Copy, Debug)]
enum Size {
    D,
    Q,
    Kv,
    Qkv,
    Ff,
    Ff2,
    HeadDim,
    Vocab,
}

/// A tensor's transform on the way to GGUF.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Xf {
    None,
    /// Rows permuted for interleaved RoPE, in heads of `rows / n_head` rows.
    Permute {
        n_head: u32,
    },
    /// `1 + w` (Gemma's norms).
    AddOne,
}

/// One tensor of the Hugging Face model and where it goes.
struct Spec {
    /// Name without `model.` / `model.layers.{i}.`.
    hf: &'static str,
    /// The GGUF tensor it becomes: its name ([`TensorKind::gguf_name`]) and the kind the
    /// weight mixes decide by.
    kind: TensorKind,
    /// Hugging Face shape: `[n]` or `[rows, row_len]`.
    shape: &'static [Size],
    xf: XfRule,
    required: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum XfRule {
    None,
    PermuteQ,
    PermuteK,
    AddOne,
}

/// A required tensor without transform.
const fn t(hf: &'static str, kind: TensorKind, shape: &'static [Size]) -> Spec {
    Spec {
        hf,
        kind,
        shape,
        xf: XfRule::None,
        required: true,
    }
}

impl Spec {
    const fn xf(self, xf: XfRule) -> Spec {
        Spec { xf, ..self }
    }

    const fn optional(self, optional: bool) -> Spec {
        Spec {
            required: !optional,
            ..self
        }
    }
}

use Size::{Ff, Ff2, HeadDim, Kv, Qkv, Vocab, D, Q};
use TensorKind as K;

/// The tensors of one layer.
fn layer_specs(a: HfArch) -> Vec<Spec> {
    let shift = if a.is_gemma() {
        XfRule::AddOne
    } else {
        XfRule::None
    };
    let norm = |hf, kind| t(hf, kind, &[D]).xf(shift);
    let mut v = vec![norm("input_layernorm.weight", K::AttnNorm)];
    v.extend(attention_specs(a));
    if a.is_gemma() {
        v.push(norm("post_attention_layernorm.weight", K::PostAttnNorm));
        v.push(norm("pre_feedforward_layernorm.weight", K::FfnNorm));
        v.push(norm("post_feedforward_layernorm.weight", K::PostFfwNorm));
    } else {
        v.push(norm("post_attention_layernorm.weight", K::FfnNorm));
    }
    if a == HfArch::Phi3 {
        v.push(t("mlp.gate_up_proj.weight", K::FfnGateUp, &[Ff2, D]));
    } else {
        v.push(t("mlp.gate_proj.weight", K::FfnGate, &[Ff, D]));
        v.push(t("mlp.up_proj.weight", K::FfnUp, &[Ff, D]));
    }
    v.push(t("mlp.down_proj.weight", K::FfnDown, &[D, Ff]));
    v
}

/// The attention block's projections, biases and QK-norms.
fn attention_specs(a: HfArch) -> Vec<Spec> {
    let (pq, pk) = if a.permutes_qk() {
        (XfRule::PermuteQ, XfRule::PermuteK)
    } else {
        (XfRule::None, XfRule::None)
    };
    let mut v = Vec::new();
    if a == HfArch::Phi3 {
        v.push(t("self_attn.qkv_proj.weight", K::AttnQkv, &[Qkv, D]));
    } else {
        v.push(t("self_attn.q_proj.weight", K::AttnQ, &[Q, D]).xf(pq));
        v.push(t("self_attn.k_proj.weight", K::AttnK, &[Kv, D]).xf(pk));
        v.push(t("self_attn.v_proj.weight", K::AttnV, &[Kv, D]));
    }
    // Qwen 2 always has Q/K/V biases; Llama-family files may (attention_bias).
    if matches!(a, HfArch::Qwen2 | HfArch::Llama | HfArch::Mistral3) {
        let opt = a != HfArch::Qwen2;
        v.push(
            t("self_attn.q_proj.bias", K::AttnQBias, &[Q])
                .xf(pq)
                .optional(opt),
        );
        v.push(
            t("self_attn.k_proj.bias", K::AttnKBias, &[Kv])
                .xf(pk)
                .optional(opt),
        );
        v.push(t("self_attn.v_proj.bias", K::AttnVBias, &[Kv]).optional(opt));
    }
    if matches!(a, HfArch::Qwen3 | HfArch::Gemma3) {
        let xf = if a.is_gemma() {
            XfRule::AddOne
        } else {
            XfRule::None
        };
        v.push(t("self_attn.q_norm.weight", K::AttnQNorm, &[HeadDim]).xf(xf));
        v.push(t("self_attn.k_norm.weight", K::AttnKNorm, &[HeadDim]).xf(xf));
    }
    v.push(t("self_attn.o_proj.weight", K::AttnOutput, &[D, Q]));
    v
}

/// One GGUF tensor to write.
#[derive(Clone, Debug)]
pub struct Planned {
    pub gguf: String,
    /// The Hugging Face tensor it is made from (its full name in the checkpoint), or values.
    pub src: Source,
    /// GGUF dims (`dims[0]` the row length).
    pub dims: Vec<u64>,
    pub kind: TensorKind,
    pub layer: Option<u32>,
    pub xf: Xf,
    /// Rows of the source to take (a prefix; Gemma's embedding drops padding rows).
    pub rows: u64,
}

#[derive(Clone, Debug)]
pub enum Source {
    Hf(String),
    Values(Vec<f32>),
}

/// Checkpoint tensor names that are not the language model (vision towers, projectors,
/// audio) and are skipped.
const NOT_TEXT: &[&str] = &[
    "vision_tower.",
    "vision_model.",
    "multi_modal_projector.",
    "audio_tower.",
    "embed_vision.",
    "embed_audio.",
];

/// Prefixes in front of the language model's own names, longest first.
const TEXT_PREFIXES: &[&str] = &[
    "model.language_model.",
    "language_model.model.",
    "language_model.",
    "model.",
];

/// The name without its language-model prefix (`layers.3.mlp.up_proj.weight`,
/// `embed_tokens.weight`, `lm_head.weight`), or `None` for a tensor that is not the language
/// model's.
pub fn text_name(name: &str) -> Option<&str> {
    let bare = name.strip_prefix("model.").unwrap_or(name);
    if NOT_TEXT.iter().any(|p| bare.starts_with(p)) || name.ends_with(".rotary_emb.inv_freq") {
        return None;
    }
    for p in TEXT_PREFIXES {
        if let Some(rest) = name.strip_prefix(p) {
            return Some(rest);
        }
    }
    Some(name)
}

/// The plan: every GGUF tensor in file order, each from a checkpoint tensor (looked up by
/// its bare name in `names`: bare → full), with its expected shape checked by the caller.
pub struct Plan {
    pub tensors: Vec<Planned>,
    /// Expected Hugging Face shape of each `Source::Hf`, by full name.
    pub shapes: Vec<(String, Vec<u64>)>,
    pub tied: bool,
}

/// Builds the plan. `find` maps a bare name to the checkpoint's full name; `vocab_rows` is
/// the embedding's row count in the checkpoint; `n_tokens` the vocabulary's size (Gemma
/// drops embedding rows past it).
pub fn plan(
    a: HfArch,
    cfg: &HfConfig,
    dims: &Dims,
    find: &dyn Fn(&str) -> Option<String>,
    vocab_rows: u64,
    n_tokens: u64,
) -> Result<Plan, ConvertError> {
    let mut out = Vec::new();
    let mut shapes = Vec::new();
    let vocab = u32::try_from(vocab_rows)
        .ok()
        .filter(|v| *v > 0 && *v <= 1 << 24)
        .ok_or_else(|| cfg.error("vocab_size", format!("{vocab_rows} embedding rows")))?;
    let mut add =
        |sp: &Spec, layer: Option<u32>, out: &mut Vec<Planned>| -> Result<(), ConvertError> {
            let bare = match layer {
                Some(il) => format!("layers.{il}.{}", sp.hf),
                None => sp.hf.to_string(),
            };
            let Some(full) = find(&bare) else {
                if sp.required {
                    return Err(ConvertError::MissingTensor {
                        tensor: format!("model.{bare}"),
                        arch: a.gguf_name(),
                    });
                }
                return Ok(());
            };
            let hf_shape: Vec<u64> = sp.shape.iter().map(|&s| dims.get(s, vocab)).collect();
            shapes.push((full.clone(), hf_shape.clone()));
            let gguf = sp.kind.gguf_name(layer.map(|il| il as usize));
            let xf = match sp.xf {
                XfRule::None => Xf::None,
                XfRule::AddOne => Xf::AddOne,
                XfRule::PermuteQ => Xf::Permute {
                    n_head: dims.n_head,
                },
                XfRule::PermuteK => Xf::Permute {
                    n_head: dims.n_head_kv,
                },
            };
            let mut rows = hf_shape[0];
            // Gemma: embedding rows past the tokenizer's vocabulary are padding (llama.cpp drops
            // them too).
            if sp.kind == K::TokenEmbd && a.is_gemma() && n_tokens < rows {
                rows = n_tokens;
            }
            let mut gdims: Vec<u64> = hf_shape.iter().rev().copied().collect();
            if let Some(last) = gdims.last_mut() {
                *last = if hf_shape.len() == 1 { *last } else { rows };
            }
            out.push(Planned {
                gguf,
                src: Source::Hf(full),
                dims: gdims,
                kind: sp.kind,
                layer,
                xf,
                rows,
            });
            Ok(())
        };

    add(
        &t("embed_tokens.weight", K::TokenEmbd, &[Vocab, D]),
        None,
        &mut out,
    )?;
    if let Some(f) = rope_freqs(cfg, dims)? {
        out.push(Planned {
            gguf: K::RopeFreqs.gguf_name(None),
            dims: vec![f.len() as u64],
            rows: f.len() as u64,
            src: Source::Values(f),
            kind: K::RopeFreqs,
            layer: None,
            xf: Xf::None,
        });
    }
    if a == HfArch::Phi3 {
        if let Some((long, short, _)) = phi3_longrope(cfg, dims)? {
            for (kind, f) in [(K::RopeFactorsLong, long), (K::RopeFactorsShort, short)] {
                out.push(Planned {
                    gguf: kind.gguf_name(None),
                    dims: vec![f.len() as u64],
                    rows: f.len() as u64,
                    src: Source::Values(f),
                    kind,
                    layer: None,
                    xf: Xf::None,
                });
            }
        }
    }
    let layer = layer_specs(a);
    for il in 0..dims.n_layer {
        for sp in &layer {
            add(sp, Some(il), &mut out)?;
        }
    }
    let norm_xf = if a.is_gemma() {
        XfRule::AddOne
    } else {
        XfRule::None
    };
    add(
        &t("norm.weight", K::OutputNorm, &[D]).xf(norm_xf),
        None,
        &mut out,
    )?;
    let tie_key = cfg.opt_bool("tie_word_embeddings")?;
    // Gemma always ties (llama.cpp skips a stray lm_head); the others tie when the config
    // says so or the checkpoint has no head.
    let tied = a.is_gemma() || tie_key == Some(true) || find("lm_head.weight").is_none();
    if !tied {
        add(&t("lm_head.weight", K::Output, &[Vocab, D]), None, &mut out)?;
    }
    Ok(Plan {
        tensors: out,
        shapes,
        tied,
    })
}

/// Tensors of the checkpoint the plan does not use but that are known not to matter.
pub fn ignorable(a: HfArch, bare: &str, tied: bool) -> bool {
    bare == "lm_head.weight" && (tied || a.is_gemma())
}

type JsonMap = serde_json::Map<String, serde_json::Value>;

/// The RoPE settings: `rope_theta` and `rope_scaling`, or newer configs' `rope_parameters`.
fn rope_params(cfg: &HfConfig) -> Result<(Option<f32>, Option<JsonMap>), ConvertError> {
    let mut theta = cfg.opt_f32("rope_theta")?;
    let mut scaling = cfg.opt_object("rope_scaling")?.cloned();
    if let Some(p) = cfg.opt_object("rope_parameters")? {
        // Per-layer-type parameters (`full_attention`, `sliding_attention`): the global ones.
        let p = p
            .get("full_attention")
            .and_then(serde_json::Value::as_object)
            .unwrap_or(p);
        if theta.is_none() {
            theta = p
                .get("rope_theta")
                .and_then(serde_json::Value::as_f64)
                .map(|x| x as f32);
        }
        if scaling.is_none()
            && p.get("rope_type").and_then(serde_json::Value::as_str) != Some("default")
        {
            scaling = Some(p.clone());
        }
    }
    Ok((theta, scaling))
}

fn scaling_type(s: &JsonMap) -> Option<&str> {
    s.get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(serde_json::Value::as_str)
}

fn num(s: &JsonMap, key: &str) -> Option<f32> {
    s.get(key)
        .and_then(serde_json::Value::as_f64)
        .map(|x| x as f32)
}

/// LongRoPE's long and short factors and its attention factor.
type LongRope = (Vec<f32>, Vec<f32>, f32);

/// Phi-3's LongRoPE (`rope_scaling` of type longrope with `long_factor` and `short_factor`):
/// the two lists of per-frequency divisors and the attention factor
/// √(1 + ln(ctx / orig) / ln(orig)) (1 when the context is not extended).
fn phi3_longrope(cfg: &HfConfig, dims: &Dims) -> Result<Option<LongRope>, ConvertError> {
    let (_, scaling) = rope_params(cfg)?;
    let Some(s) = scaling else { return Ok(None) };
    if !matches!(scaling_type(&s), Some("longrope" | "su")) {
        return Ok(None);
    }
    let rot = cfg.opt_f32("partial_rotary_factor")?.unwrap_or(1.0);
    let half = (((rot * dims.d as f32) as u32) / dims.n_head / 2) as usize;
    let list = |key: &str| -> Result<Vec<f32>, ConvertError> {
        let full = format!("rope_scaling.{key}");
        let v: Vec<f32> = s
            .get(key)
            .and_then(serde_json::Value::as_array)
            .and_then(|a| a.iter().map(|x| x.as_f64().map(|f| f as f32)).collect())
            .ok_or_else(|| cfg.error(&full, "missing or not a list of numbers"))?;
        if v.len() != half {
            return Err(cfg.error(
                &full,
                format!("{} factors; the rotated half-head has {half}", v.len()),
            ));
        }
        Ok(v)
    };
    let (long, short) = (list("long_factor")?, list("short_factor")?);
    let orig = cfg
        .opt_u32("original_max_position_embeddings")?
        .ok_or_else(|| {
            cfg.error(
                "original_max_position_embeddings",
                "missing (LongRoPE needs it)",
            )
        })?;
    let ctx = cfg.opt_u32("max_position_embeddings")?.unwrap_or(orig);
    let scale = f64::from(ctx) / f64::from(orig.max(2));
    let attn = if scale > 1.0 {
        (1.0 + scale.ln() / f64::from(orig.max(2)).ln()).sqrt() as f32
    } else {
        1.0
    };
    Ok(Some((long, short, attn)))
}

/// Llama 3.1's `rope_freqs.weight`, when `rope_scaling` is of type llama3.
fn rope_freqs(cfg: &HfConfig, dims: &Dims) -> Result<Option<Vec<f32>>, ConvertError> {
    let (theta, scaling) = rope_params(cfg)?;
    let Some(s) = scaling else { return Ok(None) };
    if scaling_type(&s) != Some("llama3") {
        return Ok(None);
    }
    let r = ringllm_model::synth::Llama3Rope {
        factor: num(&s, "factor").unwrap_or(8.0),
        low_freq_factor: num(&s, "low_freq_factor").unwrap_or(1.0),
        high_freq_factor: num(&s, "high_freq_factor").unwrap_or(4.0),
        original_ctx: num(&s, "original_max_position_embeddings").unwrap_or(8192.0) as u32,
    };
    Ok(Some(ringllm_model::synth::llama3_rope_freqs(
        &r,
        theta.unwrap_or(10_000.0),
        dims.head_dim,
    )))
}

/// The `{arch}.…` metadata.
pub fn metadata(
    a: HfArch,
    cfg: &HfConfig,
    dims: &Dims,
    vocab: u32,
) -> Result<Vec<(String, Value)>, ConvertError> {
    let arch = a.gguf_name();
    let mut kv: Vec<(String, Value)> = Vec::new();
    let mut put = |k: MetaKey, v: Value| kv.push((k.of(arch), v));
    let ctx = cfg
        .opt_u32("max_position_embeddings")?
        .unwrap_or(if a.is_gemma() { 8192 } else { 4096 });
    put(MetaKey::ContextLength, Value::U32(ctx));
    put(MetaKey::EmbeddingLength, Value::U32(dims.d));
    put(MetaKey::BlockCount, Value::U32(dims.n_layer));
    put(MetaKey::FeedForwardLength, Value::U32(dims.ff));
    put(MetaKey::HeadCount, Value::U32(dims.n_head));
    put(MetaKey::HeadCountKv, Value::U32(dims.n_head_kv));
    put(MetaKey::KeyLength, Value::U32(dims.head_dim));
    put(MetaKey::ValueLength, Value::U32(dims.head_dim));
    let eps = cfg.opt_f32("rms_norm_eps")?.unwrap_or(1e-6);
    put(MetaKey::RmsEpsilon, Value::F32(eps));
    let (theta, scaling) = rope_params(cfg)?;
    let default_theta = if a == HfArch::Gemma3 {
        1_000_000.0
    } else {
        10_000.0
    };
    put(
        MetaKey::RopeFreqBase,
        Value::F32(theta.unwrap_or(default_theta)),
    );
    if let Some(s) = &scaling {
        match scaling_type(s) {
            Some("llama3") if matches!(a, HfArch::Llama | HfArch::Mistral3) => {} // rope_freqs.weight
            Some("linear") => {
                let f =
                    num(s, "factor").ok_or_else(|| cfg.error("rope_scaling.factor", "missing"))?;
                put(MetaKey::RopeScalingType, Value::Str("linear".into()));
                put(MetaKey::RopeScalingFactor, Value::F32(f));
            }
            Some("yarn") => {
                let f =
                    num(s, "factor").ok_or_else(|| cfg.error("rope_scaling.factor", "missing"))?;
                let orig = num(s, "original_max_position_embeddings").ok_or_else(|| {
                    cfg.error("rope_scaling.original_max_position_embeddings", "missing")
                })?;
                put(MetaKey::RopeScalingType, Value::Str("yarn".into()));
                put(MetaKey::RopeScalingFactor, Value::F32(f));
                put(MetaKey::RopeScalingOrigCtx, Value::U32(orig as u32));
            }
            // Phi-3's LongRoPE: factor tensors and an attention factor (`phi3_longrope`).
            Some("longrope" | "su") if a == HfArch::Phi3 => {}
            Some("default") | None => {}
            Some(other) => {
                return Err(cfg.error(
                    "rope_scaling",
                    format!(
                        "RoPE scaling type '{other}' is not one we convert (linear, llama3, yarn)"
                    ),
                ))
            }
        }
    }
    match a {
        HfArch::Llama | HfArch::Mistral3 => {
            put(MetaKey::VocabSize, Value::U32(vocab));
            put(MetaKey::RopeDimensionCount, Value::U32(dims.head_dim));
            if let Some(w) = cfg.opt_u32("sliding_window")? {
                put(MetaKey::SlidingWindow, Value::U32(w));
            }
        }
        HfArch::Qwen2 | HfArch::Qwen3 => {}
        HfArch::Gemma2 => {
            let w = cfg.u32("sliding_window")?;
            put(MetaKey::SlidingWindow, Value::U32(w));
            put(
                MetaKey::AttnLogitSoftcapping,
                Value::F32(cfg.opt_f32("attn_logit_softcapping")?.unwrap_or(50.0)),
            );
            put(
                MetaKey::FinalLogitSoftcapping,
                Value::F32(cfg.opt_f32("final_logit_softcapping")?.unwrap_or(30.0)),
            );
        }
        HfArch::Gemma3 => {
            gemma3_sliding(cfg, dims)?;
            if let Some(w) = cfg.opt_u32("sliding_window")? {
                if cfg.opt_u32("sliding_window_pattern")? != Some(1) {
                    put(MetaKey::SlidingWindow, Value::U32(w));
                }
            }
            if let Some(c) = cfg.opt_f32("final_logit_softcapping")? {
                put(MetaKey::FinalLogitSoftcapping, Value::F32(c));
            }
        }
        HfArch::Phi3 => {
            if let Some((_, _, attn)) = phi3_longrope(cfg, dims)? {
                put(MetaKey::RopeScalingAttnFactor, Value::F32(attn));
            }
            let rot = cfg.opt_f32("partial_rotary_factor")?.unwrap_or(1.0);
            let rope_dims = ((rot * dims.d as f32) as u32) / dims.n_head;
            put(MetaKey::RopeDimensionCount, Value::U32(rope_dims));
            put(
                MetaKey::RopeScalingOrigCtx,
                Value::U32(
                    cfg.opt_u32("original_max_position_embeddings")?
                        .unwrap_or(ctx),
                ),
            );
            put(
                MetaKey::SlidingWindow,
                Value::U32(cfg.opt_u32("sliding_window")?.unwrap_or(0)),
            );
        }
    }
    Ok(kv)
}

/// Gemma 3 GGUF files carry no layer pattern: readers assume every 6th layer global. Refuse
/// a checkpoint whose `layer_types` / `sliding_window_pattern` say otherwise.
fn gemma3_sliding(cfg: &HfConfig, dims: &Dims) -> Result<(), ConvertError> {
    // GGUF readers fix these too: the local layers' RoPE base, and the query scale
    // 1/√head_dim (1/√(d / n_head) for the 62-layer 27B).
    if let Some(b) = cfg.opt_f32("rope_local_base_freq")? {
        if b != gemma3::LOCAL_ROPE_BASE {
            return Err(cfg.error(
                "rope_local_base_freq",
                format!("{b}: Gemma 3 GGUF files assume {}", gemma3::LOCAL_ROPE_BASE),
            ));
        }
    }
    if let Some(q) = cfg.opt_f32("query_pre_attn_scalar")? {
        let want = if dims.n_layer as usize == gemma3::GEMMA3_27B_LAYERS {
            dims.d / dims.n_head
        } else {
            dims.head_dim
        };
        if q != want as f32 {
            return Err(cfg.error(
                "query_pre_attn_scalar",
                format!("{q}: Gemma 3 GGUF files assume {want} for this size"),
            ));
        }
    }
    if let Some(p) = cfg.opt_u32("sliding_window_pattern")? {
        if p as usize != gemma3::DEFAULT_SLIDING_PATTERN && p != 1 {
            return Err(cfg.error(
                "sliding_window_pattern",
                format!("{p}: Gemma 3 GGUF files assume 6 (five local layers, then a global one)"),
            ));
        }
    }
    if let Some(types) = cfg.opt_str_list("layer_types")? {
        for (il, t) in types.iter().enumerate().take(dims.n_layer as usize) {
            let global = (il + 1) % gemma3::DEFAULT_SLIDING_PATTERN == 0;
            let want = if global {
                "full_attention"
            } else {
                "sliding_attention"
            };
            if *t != want {
                return Err(cfg.error(
                    "layer_types",
                    format!("layer {il} is '{t}'; Gemma 3 GGUF files assume '{want}' (every 6th layer global)"),
                ));
            }
        }
    }
    Ok(())
}
