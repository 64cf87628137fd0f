//! The layer, described once: an ordered list of named steps computed from the
//! hyper-parameters when a model loads. The CPU forward pass (`forward::layer`) and the GPU
//! backend (`gpu.rs`) both walk this list; the loader reads the tensors the steps name, and
//! nothing else. A step a backend does not implement is refused when the backend opens
//! (`ModelError::UnsupportedStep`), never skipped.
//!
//! Steps work on named buffers of the batch ([`Buf`]): the residual stream `x` and scratch
//! rows (`xn`, `q`, `k`, `v`, `att`, `o`, `gate`, `up`). An observer sees each step's outputs
//! as `(layer, step name, buffer, rows)`, so a divergence between two backends, or between a
//! backend and the NumPy reference, is named down to the step.

use super::{FfnAct, Hparams, TensorKind};

/// Which RoPE table a layer reads: sliding-window layers and global layers may have
/// different bases and scales (`Hparams::rope_for_layer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeTable {
    Local,
    Global,
}

/// One step of a layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Step {
    /// `xn = rms_norm(x) · attn_norm`.
    AttnNorm,
    /// `q, k, v = xn · Wq, Wk, Wv`.
    QkvProj,
    /// `q, k, v += bq, bk, bv` (Qwen2).
    QkvBias,
    /// RMSNorm of every head of `q` and `k` (Gemma 3).
    QkNorm,
    /// Rotary position embedding of `q` and `k` from the layer's table.
    Rope(RopeTable),
    /// Stores the rows' `k` and `v` in the cache, then causal attention of `q` over the
    /// cache (the window of a sliding-window layer is the cache's own) into `att`, queries
    /// scaled by `scale`; with `softcap` `c`, each scaled score `s` is soft-capped to
    /// `c · tanh(s / c)` before the softmax (Gemma 2).
    /// With `sinks`, each head's learned sink logit (`attn_sinks`) joins its softmax and
    /// takes no value (gpt-oss).
    Attention {
        scale: f32,
        softcap: Option<f32>,
        sinks: bool,
    },
    /// `o = att · Wo`.
    AttnOut,
    /// `x += o`, `o` first normed by `post_attention_norm` when `post_norm` (Gemma's
    /// sandwich).
    AttnResidual { post_norm: bool },
    /// `xn = rms_norm(x) · ffn_norm`.
    FfnNorm,
    /// `gate, up = xn · Wgate, Wup`.
    GateUp,
    /// `gate = act(gate) · up`.
    Glu(FfnAct),
    /// `o = gate · Wdown`.
    FfnDown,
    /// `x += o`, `o` first normed by `post_ffw_norm` when `post_norm`.
    FfnResidual { post_norm: bool },
    /// `q = xn · Wq` only: a shared-KV layer computes no K or V (Gemma 4).
    QProj,
    /// `q, k = xn · Wq, Wk`: a layer without a V projection (Gemma 4 31B full attention).
    QkProj,
    /// `v = k`, before any norm or RoPE (the layer's V is its K projection).
    VFromK,
    /// RMSNorm of every head of `q` (a shared-KV layer's QK-norm).
    QNorm,
    /// RMSNorm of every head of `v`, without a weight (Gemma 4).
    VNorm,
    /// RoPE of `q` only, from the layer's table (a shared-KV layer).
    RopeQ(RopeTable),
    /// Causal attention of `q` over the cache of the earlier layer `source` (Gemma 4's
    /// shared-KV layers): stores nothing.
    SharedAttention { scale: f32, source: usize },
    /// `x += rms_norm(Wproj · (gelu(Wgate · x) ⊙ ple[layer])) · post_norm`: the layer's
    /// per-layer embedding input (Gemma 4 E2B/E4B; `ple` computed with the embedding).
    PerLayerInput,
    /// `x *= layer_output_scale` (Gemma 4).
    OutScale,
    /// `q, k, v = xn · Wqkv` from one fused matrix (Phi-3). The loader splits its rows into
    /// the three views `QkvProj` reads, so both backends run it as `QkvProj`: the same
    /// kernels, no copy. Named `qkv` like it (it writes the same buffers).
    QkvFused,
    /// `gate, up = xn · Wgate_up` from one fused matrix (Phi-3's `ffn_up`, rows `[gate | up]`),
    /// split into two views at load and run as `GateUp`; named `gate_up` like it.
    GateUpFused,
    /// The mixture-of-experts router: `p = softmax(xn · Wrouter)` per row, the `k` largest
    /// picked (ties to the lower expert index), their weights `p / Σp` when the model
    /// renormalizes, times its weight scale. Writes the picks, which no buffer shows.
    /// With `bias`, the router's bias is added to its logits first (gpt-oss). How the picks
    /// are weighted is the model's `MoeParams::gating`.
    Router { bias: bool },
    /// `o = Σ_j w_j · Wdown[e_j] · (act(Wgate[e_j] · xn) ⊙ Wup[e_j] · xn)` over each row's
    /// picked experts, summed in increasing expert index (so a row's sum is the same in any
    /// batch); with `bias`, each expert's gate, up and down biases are added after its
    /// products (gpt-oss).
    Experts { act: FfnAct, bias: bool },
    /// `o += bo`, the attention output projection's bias (gpt-oss).
    AttnOutBias,
    /// `xn = rms_norm(x) · post_attention_norm`: the feed-forward's pre-norm under gpt-oss's
    /// name; named `ffn_norm` like it.
    PostAttnFfnNorm,
}

/// The buffers of a batch a step reads or writes, `[n × width]` each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buf {
    /// The residual stream.
    X,
    Xn,
    Q,
    K,
    V,
    Att,
    O,
    Gate,
    Up,
    /// A layer's gated per-layer embedding input (Gemma 4).
    Ple,
}

impl Buf {
    pub fn name(self) -> &'static str {
        match self {
            Buf::X => "x",
            Buf::Xn => "xn",
            Buf::Q => "q",
            Buf::K => "k",
            Buf::V => "v",
            Buf::Att => "att",
            Buf::O => "o",
            Buf::Gate => "gate",
            Buf::Up => "up",
            Buf::Ple => "ple",
        }
    }

    /// Values per row in layer `il`.
    pub fn width(self, hp: &Hparams, il: usize) -> usize {
        match self {
            Buf::X | Buf::Xn | Buf::O => hp.d_model,
            Buf::Q | Buf::Att => hp.q_dim_of(il),
            Buf::K | Buf::V => hp.kv_dim_of(il),
            Buf::Gate | Buf::Up => hp.d_ff_of(il),
            Buf::Ple => hp.ple_dim,
        }
    }
}

impl Step {
    /// The step's name in dumps, logs and errors.
    pub fn name(self) -> &'static str {
        match self {
            Step::AttnNorm => "attn_norm",
            Step::QkvProj => "qkv",
            Step::QkvBias => "qkv_bias",
            Step::QkNorm => "qk_norm",
            Step::Rope(_) => "rope",
            Step::Attention { .. } => "attention",
            Step::AttnOut => "attn_out",
            Step::AttnResidual { .. } => "attn_residual",
            Step::FfnNorm => "ffn_norm",
            Step::GateUp => "gate_up",
            Step::Glu(_) => "glu",
            Step::FfnDown => "ffn_down",
            Step::FfnResidual { .. } => "ffn_residual",
            Step::QProj => "q_proj",
            Step::QkProj => "qk_proj",
            Step::VFromK => "v_from_k",
            Step::QNorm => "q_norm",
            Step::VNorm => "v_norm",
            Step::RopeQ(_) => "rope_q",
            Step::SharedAttention { .. } => "shared_attention",
            Step::PerLayerInput => "per_layer_input",
            Step::OutScale => "out_scale",
            Step::QkvFused => "qkv",
            Step::GateUpFused => "gate_up",
            Step::Router { .. } => "router",
            Step::Experts { .. } => "experts",
            Step::AttnOutBias => "attn_out_bias",
            Step::PostAttnFfnNorm => "ffn_norm",
        }
    }

    /// The tensors of the layer this step reads.
    pub fn tensors(self) -> &'static [TensorKind] {
        use TensorKind as T;
        match self {
            Step::AttnNorm => &[T::AttnNorm],
            Step::QkvProj => &[T::AttnQ, T::AttnK, T::AttnV],
            Step::QkvBias => &[T::AttnQBias, T::AttnKBias, T::AttnVBias],
            Step::QkNorm => &[T::AttnQNorm, T::AttnKNorm],
            Step::Attention { sinks: true, .. } => &[T::AttnSinks],
            Step::Rope(_) | Step::Attention { .. } | Step::Glu(_) => &[],
            Step::AttnOut => &[T::AttnOutput],
            Step::AttnResidual { post_norm } => {
                if post_norm {
                    &[T::PostAttnNorm]
                } else {
                    &[]
                }
            }
            Step::FfnNorm => &[T::FfnNorm],
            Step::GateUp => &[T::FfnGate, T::FfnUp],
            Step::FfnDown => &[T::FfnDown],
            Step::FfnResidual { post_norm } => {
                if post_norm {
                    &[T::PostFfwNorm]
                } else {
                    &[]
                }
            }
            Step::QProj => &[T::AttnQ],
            Step::QkProj => &[T::AttnQ, T::AttnK],
            Step::QNorm => &[T::AttnQNorm],
            Step::VFromK | Step::VNorm | Step::RopeQ(_) | Step::SharedAttention { .. } => &[],
            Step::PerLayerInput => &[T::PerLayerInpGate, T::PerLayerProj, T::PerLayerPostNorm],
            Step::OutScale => &[T::LayerOutScale],
            Step::QkvFused => &[T::AttnQkv],
            Step::GateUpFused => &[T::FfnGateUp],
            Step::Router { bias: false } => &[T::FfnGateInp],
            Step::Router { bias: true } => &[T::FfnGateInp, T::FfnGateInpBias],
            Step::Experts { bias: false, .. } => &[T::FfnGateExps, T::FfnUpExps, T::FfnDownExps],
            Step::Experts { bias: true, .. } => &[
                T::FfnGateExps,
                T::FfnUpExps,
                T::FfnDownExps,
                T::FfnGateExpsBias,
                T::FfnUpExpsBias,
                T::FfnDownExpsBias,
            ],
            Step::AttnOutBias => &[T::AttnOutBias],
            Step::PostAttnFfnNorm => &[T::PostAttnNorm],
        }
    }

    /// The buffers the step writes (what an observer is shown after it).
    pub fn outputs(self) -> &'static [Buf] {
        match self {
            Step::AttnNorm | Step::FfnNorm | Step::PostAttnFfnNorm => &[Buf::Xn],
            Step::QkvProj | Step::QkvBias | Step::QkvFused => &[Buf::Q, Buf::K, Buf::V],
            Step::QkNorm | Step::Rope(_) => &[Buf::Q, Buf::K],
            Step::Attention { .. } => &[Buf::Att],
            Step::AttnOut | Step::FfnDown | Step::Experts { .. } | Step::AttnOutBias => &[Buf::O],
            Step::Router { .. } => &[],
            Step::AttnResidual { .. } | Step::FfnResidual { .. } => &[Buf::X],
            Step::GateUp | Step::GateUpFused => &[Buf::Gate, Buf::Up],
            Step::Glu(_) => &[Buf::Gate],
            Step::QProj | Step::QNorm | Step::RopeQ(_) => &[Buf::Q],
            Step::QkProj => &[Buf::Q, Buf::K],
            Step::VFromK | Step::VNorm => &[Buf::V],
            Step::SharedAttention { .. } => &[Buf::Att],
            Step::PerLayerInput | Step::OutScale => &[Buf::X],
        }
    }

    /// A step that works on each row of `q`, `k` and `v` alone: a run of these is one pass
    /// over the rows on the CPU.
    pub fn per_row_qkv(self) -> bool {
        matches!(
            self,
            Step::QkvBias
                | Step::QkNorm
                | Step::Rope(_)
                | Step::VFromK
                | Step::QNorm
                | Step::VNorm
                | Step::RopeQ(_)
        )
    }
}

/// The steps of one layer, in order.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerRecipe {
    pub steps: Vec<Step>,
}

impl LayerRecipe {
    /// Every tensor the layer's steps read, in step order.
    pub fn tensors(&self) -> Vec<TensorKind> {
        self.steps
            .iter()
            .flat_map(|s| s.tensors())
            .copied()
            .collect()
    }

    /// True when some step reads tensor `kind`.
    pub fn needs(&self, kind: TensorKind) -> bool {
        self.steps.iter().any(|s| s.tensors().contains(&kind))
    }

    /// The steps' names, for logs and errors: `attn_norm → qkv → …`.
    pub fn describe(&self) -> String {
        let names: Vec<&str> = self.steps.iter().map(|s| s.name()).collect();
        names.join(" → ")
    }
}

/// The recipe of layer `il` of a model with hyper-parameters `hp` (the flags the
/// architecture's file set).
pub(super) fn build(hp: &Hparams, il: usize) -> LayerRecipe {
    let shape = hp.layer_shape(il);
    // A shared-KV layer computes only its queries, and reads another layer's cache.
    let shared = shape.kv_source.is_some();
    let mut steps = vec![Step::AttnNorm];
    if shared {
        steps.push(Step::QProj);
    } else if shape.v_from_k {
        steps.extend([Step::QkProj, Step::VFromK]);
    } else if hp.fused_proj {
        steps.push(Step::QkvFused);
    } else {
        steps.push(Step::QkvProj);
    }
    if hp.qkv_bias {
        steps.push(Step::QkvBias);
    }
    if hp.qk_norm {
        steps.push(if shared { Step::QNorm } else { Step::QkNorm });
    }
    if hp.v_norm && !shared {
        steps.push(Step::VNorm);
    }
    if hp.rope_dim_of(il) > 0 {
        let sliding = hp.sliding.get(il).copied().unwrap_or(false);
        let table = if sliding {
            RopeTable::Local
        } else {
            RopeTable::Global
        };
        steps.push(if shared {
            Step::RopeQ(table)
        } else {
            Step::Rope(table)
        });
    }
    let scale = hp.query_scale;
    steps.push(match shape.kv_source {
        Some(source) => Step::SharedAttention { scale, source },
        None => Step::Attention {
            scale,
            softcap: hp.attn_logit_softcap,
            sinks: hp.attn_sinks,
        },
    });
    steps.push(Step::AttnOut);
    if hp.attn_out_bias {
        steps.push(Step::AttnOutBias);
    }
    steps.extend([
        Step::AttnResidual {
            post_norm: hp.sandwich_norms,
        },
        if hp.ffn_norm_post_attn {
            Step::PostAttnFfnNorm
        } else {
            Step::FfnNorm
        },
    ]);
    if let Some(m) = hp.moe {
        steps.extend([
            Step::Router { bias: m.biases },
            Step::Experts {
                act: hp.ffn_act,
                bias: m.biases,
            },
        ]);
    } else {
        steps.extend([
            if hp.fused_proj {
                Step::GateUpFused
            } else {
                Step::GateUp
            },
            Step::Glu(hp.ffn_act),
            Step::FfnDown,
        ]);
    }
    steps.push(Step::FfnResidual {
        post_norm: hp.sandwich_norms,
    });
    if hp.ple_dim > 0 {
        steps.push(Step::PerLayerInput);
    }
    if hp.out_scale {
        steps.push(Step::OutScale);
    }
    LayerRecipe { steps }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::Arch;
    use ringllm_kernels::ops::RopeStyle;

    fn hp(arch: Arch) -> Hparams {
        Hparams {
            arch,
            n_layer: 6,
            d_model: 64,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 16,
            d_ff: 128,
            vocab: 100,
            ctx_train: 128,
            rms_eps: 1e-6,
            rope_style: RopeStyle::Interleaved,
            rope_dim: 16,
            rope_base: 10000.0,
            rope_base_local: 10000.0,
            rope_scale: 1.0,
            sliding_window: 0,
            sliding: vec![false; 6],
            embd_scale: None,
            query_scale: 0.25,
            ffn_act: FfnAct::Silu,
            qk_norm: false,
            sandwich_norms: false,
            qkv_bias: false,
            final_logit_softcap: None,
            layer_shapes: Vec::new(),
            rope_dim_local: 16,
            rope_freqs_global_only: false,
            ple_dim: 0,
            v_norm: false,
            out_scale: false,
            fused_proj: false,
            rope_orig_ctx: 128,
            rope_attn_factor: 1.0,
            attn_logit_softcap: None,
            v_proj_optional: false,
            moe: None,
            attn_sinks: false,
            attn_out_bias: false,
            ffn_norm_post_attn: false,
            yarn: None,
        }
    }

    #[test]
    fn llama_layer_is_the_plain_pre_norm_block() {
        let r = build(&hp(Arch::Llama), 0);
        assert_eq!(
            r.describe(),
            "attn_norm → qkv → rope → attention → attn_out → attn_residual → ffn_norm → \
             gate_up → glu → ffn_down → ffn_residual"
        );
        assert_eq!(
            r.tensors(),
            vec![
                TensorKind::AttnNorm,
                TensorKind::AttnQ,
                TensorKind::AttnK,
                TensorKind::AttnV,
                TensorKind::AttnOutput,
                TensorKind::FfnNorm,
                TensorKind::FfnGate,
                TensorKind::FfnUp,
                TensorKind::FfnDown,
            ]
        );
        assert!(!r.needs(TensorKind::PostAttnNorm));
    }

    #[test]
    fn flags_add_their_steps_and_tensors() {
        let mut h = hp(Arch::Gemma3);
        h.qk_norm = true;
        h.sandwich_norms = true;
        h.qkv_bias = true;
        h.ffn_act = FfnAct::GeluTanh;
        h.sliding = vec![true, true, true, true, true, false];
        let local = build(&h, 0);
        let global = build(&h, 5);
        assert!(local.steps.contains(&Step::Rope(RopeTable::Local)));
        assert!(global.steps.contains(&Step::Rope(RopeTable::Global)));
        assert!(local.steps.contains(&Step::Glu(FfnAct::GeluTanh)));
        for k in [
            TensorKind::AttnQBias,
            TensorKind::AttnQNorm,
            TensorKind::AttnKNorm,
            TensorKind::PostAttnNorm,
            TensorKind::PostFfwNorm,
        ] {
            assert!(local.needs(k), "{k:?}");
        }
        // Biases come before QK-norm, which comes before RoPE.
        let at = |s: Step| local.steps.iter().position(|x| *x == s);
        assert!(at(Step::QkvBias) < at(Step::QkNorm));
        assert!(at(Step::QkNorm) < at(Step::Rope(RopeTable::Local)));
    }

    #[test]
    fn fused_projections_read_the_fused_tensors() {
        let mut h = hp(Arch::Phi3);
        h.fused_proj = true;
        let r = build(&h, 0);
        assert_eq!(
            r.describe(),
            "attn_norm → qkv → rope → attention → attn_out → attn_residual → ffn_norm → \
             gate_up → glu → ffn_down → ffn_residual"
        );
        assert_eq!(r.steps[1], Step::QkvFused);
        assert!(r.steps.contains(&Step::GateUpFused));
        assert_eq!(
            r.tensors(),
            vec![
                TensorKind::AttnNorm,
                TensorKind::AttnQkv,
                TensorKind::AttnOutput,
                TensorKind::FfnNorm,
                TensorKind::FfnGateUp,
                TensorKind::FfnDown,
            ]
        );
        for k in [TensorKind::AttnQ, TensorKind::FfnGate, TensorKind::FfnUp] {
            assert!(!r.needs(k), "{k:?}");
        }
        assert_eq!(Step::QkvFused.outputs(), Step::QkvProj.outputs());
        assert_eq!(Step::GateUpFused.outputs(), Step::GateUp.outputs());
    }

    #[test]
    fn a_mixture_of_experts_replaces_the_dense_feed_forward() {
        let mut h = hp(Arch::Qwen3Moe);
        h.moe = Some(crate::arch::MoeParams {
            n_expert: 8,
            n_used: 2,
            d_ff_exp: 32,
            norm_weights: true,
            weights_scale: 1.0,
            gating: crate::arch::Gating::Softmax,
            biases: false,
        });
        let r = build(&h, 0);
        assert_eq!(
            r.describe(),
            "attn_norm → qkv → rope → attention → attn_out → attn_residual → ffn_norm → \
             router → experts → ffn_residual"
        );
        for k in [
            TensorKind::FfnGateInp,
            TensorKind::FfnGateExps,
            TensorKind::FfnUpExps,
            TensorKind::FfnDownExps,
        ] {
            assert!(r.needs(k), "{k:?}");
        }
        for k in [TensorKind::FfnGate, TensorKind::FfnUp, TensorKind::FfnDown] {
            assert!(!r.needs(k), "{k:?}");
        }
    }

    #[test]
    fn no_rope_step_without_rotary_dimensions() {
        let mut h = hp(Arch::Llama);
        h.rope_dim = 0;
        assert!(!build(&h, 0)
            .steps
            .iter()
            .any(|s| matches!(s, Step::Rope(_))));
    }
}
