//! Gemma 4 synthetic models: the tiny `--arch gemma4` model and the real-size `gemma4-*`
//! shapes share one description of the structure (`Gemma4Model`): which layers are
//! sliding-window, their head sizes and KV heads, the shared-KV layers, the layers without a
//! V projection, the per-layer embeddings, the metadata keys and the tensor list.
//!
//! The models carry Gemma 4's chat template (the template of google/gemma-4-31B-it as
//! llama.cpp's `models/templates` holds it, in `tests/fixtures/templates/`).

use super::shape::Shape;
use crate::arch::{MetaKey, TensorKind};
use crate::gguf::{Array, GgufWriter, Value};

/// Gemma 4's chat template (Jinja), written as `tokenizer.chat_template`.
pub const CHAT_TEMPLATE: &str =
    include_str!("../../../tests/fixtures/templates/google-gemma-4-31B-it.jinja");

/// The markup tokens of the chat template, added to the tiny model's vocabulary as control
/// tokens (the real vocabulary has them; `<turn|>` ends a turn).
pub const MARKUP_TOKENS: &[&str] = &[
    "<|turn>",
    "<turn|>",
    "<|channel>",
    "<channel|>",
    "<|think|>",
    "<|tool>",
    "<tool|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    "<|\"|>",
    "<|image|>",
    "<|audio|>",
    "<|video|>",
];

/// Gemma 4's structure beyond the fields every shape has (those give the sliding-window
/// layers' head size and KV heads and the base feed-forward width).
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma4Dims {
    /// Head size of the full-attention layers (`global_head_dim`).
    pub head_dim_full: u32,
    /// KV heads of the full-attention layers (`num_global_key_value_heads`).
    pub n_head_kv_full: u32,
    /// Every `period`-th layer (counting from 1) is full attention, the others
    /// sliding-window (the `layer_types` of the published configs).
    pub period: u32,
    /// The last this-many layers read an earlier layer's KV cache (`num_kv_shared_layers`).
    pub shared_kv_layers: u32,
    /// Per-layer embedding width (`hidden_size_per_layer_input`); 0: none.
    pub ple_dim: u32,
    /// The shared-KV layers' feed-forward is twice as wide (`use_double_wide_mlp`).
    pub double_wide: bool,
    /// The full-attention layers have no V projection: V is K (`attention_k_eq_v`).
    pub v_from_k_full: bool,
    /// RoPE base of the sliding-window layers.
    pub rope_base_swa: f32,
    /// Share of a full-attention head's dimensions that rotate (`partial_rotary_factor`).
    pub partial_rotary_full: f32,
    pub final_logit_softcap: f32,
}

/// The tiny `--arch gemma4` model's structure: 6 layers `S S F S S F`, the last three sharing
/// the KV caches of layers 1 (sliding) and 2 (full) — the last layer with its own cache full,
/// the one before it sliding, as in the published models (llama.cpp assumes it); layer 2 has
/// no V projection; per-layer embeddings of 32; the shared layers' feed-forward doubled.
pub const TINY: Gemma4Dims = Gemma4Dims {
    head_dim_full: 64,
    n_head_kv_full: 1,
    period: 3,
    shared_kv_layers: 3,
    ple_dim: 32,
    double_wide: true,
    v_from_k_full: true,
    rope_base_swa: 10_000.0,
    partial_rotary_full: 0.25,
    final_logit_softcap: 30.0,
};

/// The real sizes, by shape name. Values are those of the published config.json files as I
/// know them (google/gemma-4-E2B-it, -E4B-it, -31B-it); where I am least sure it says so.
const SHAPE_DIMS: &[(&str, Gemma4Dims)] = &[
    // Not a published model: Gemma 4's layout in miniature without per-layer embeddings (so a
    // ring can split it), with shared-KV layers and a full layer whose V is its K.
    (
        "gemma4-tiny",
        Gemma4Dims {
            head_dim_full: 64,
            n_head_kv_full: 1,
            period: 3,
            shared_kv_layers: 3,
            ple_dim: 0,
            double_wide: true,
            v_from_k_full: true,
            rope_base_swa: 10_000.0,
            partial_rotary_full: 0.25,
            final_logit_softcap: 30.0,
        },
    ),
    (
        "gemma4-e2b",
        Gemma4Dims {
            head_dim_full: 512,
            n_head_kv_full: 1,
            // layer_types: four sliding, one full (layers 4, 9, ... 34 full).
            period: 5,
            shared_kv_layers: 20,
            ple_dim: 256,
            double_wide: true,
            v_from_k_full: false,
            rope_base_swa: 10_000.0,
            partial_rotary_full: 0.25,
            final_logit_softcap: 30.0,
        },
    ),
    (
        "gemma4-e4b",
        Gemma4Dims {
            head_dim_full: 512,
            // Best knowledge: num_global_key_value_heads unset (= num_key_value_heads).
            n_head_kv_full: 2,
            period: 6,
            // Best knowledge: 18 shared-KV layers, no double-wide MLP.
            shared_kv_layers: 18,
            ple_dim: 256,
            double_wide: false,
            v_from_k_full: false,
            rope_base_swa: 10_000.0,
            partial_rotary_full: 0.25,
            final_logit_softcap: 30.0,
        },
    ),
    (
        "gemma4-31b",
        Gemma4Dims {
            head_dim_full: 512,
            // Best knowledge: 4 global KV heads, K = V on the full-attention layers.
            n_head_kv_full: 4,
            period: 6,
            shared_kv_layers: 0,
            ple_dim: 0,
            double_wide: false,
            v_from_k_full: true,
            rope_base_swa: 10_000.0,
            partial_rotary_full: 0.25,
            final_logit_softcap: 30.0,
        },
    ),
];

/// Gemma 4 extras of shape `name`.
pub fn shape_dims(name: &str) -> Option<&'static Gemma4Dims> {
    SHAPE_DIMS.iter().find(|(n, _)| *n == name).map(|(_, d)| d)
}

/// How a tensor's values are made.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum G4Fill {
    /// N(0, 1/row_len) values in the matrix type.
    Matrix,
    /// 1 + 0.1·N(0, 1), F32.
    Norm,
    /// (1 + 0.1·N(0, 1))·scale, F32: Gemma 4's Q and K norms, scaled by `head_dim^-¼` each so
    /// that with attention scale 1 the random model's scores have unit spread (its softmax
    /// would otherwise be nearly one-hot, as no trained model's is).
    ScaledNorm(f32),
    /// These values, F32.
    Values(Vec<f32>),
}

/// One tensor of a Gemma 4 model: dims in GGML order (`[row_len, rows]` for a matrix).
#[derive(Clone, Debug)]
pub(crate) struct G4Tensor {
    pub kind: TensorKind,
    pub layer: Option<u32>,
    pub dims: Vec<u32>,
    pub fill: G4Fill,
}

/// A whole Gemma 4 model: the common fields (sliding-window layers' head size and KV heads,
/// base feed-forward width) and the extras.
#[derive(Clone, Debug)]
pub(crate) struct Gemma4Model {
    pub n_layer: u32,
    pub d_model: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    pub d_ff: u32,
    pub vocab: u32,
    pub sliding_window: u32,
    pub dims: Gemma4Dims,
}

impl Gemma4Model {
    /// The model of a real-size shape (possibly cut to fewer layers: the shared-KV layers
    /// shrink in proportion, and vanish when the layers left before them would not hold
    /// both kinds of layer).
    pub(crate) fn of_shape(s: &Shape) -> Option<Gemma4Model> {
        let mut dims = shape_dims(s.name)?.clone();
        let full_layers = super::shape::shape(s.name).map_or(s.n_layer, |b| b.n_layer);
        if s.n_layer != full_layers {
            let shared = u64::from(dims.shared_kv_layers) * u64::from(s.n_layer)
                / u64::from(full_layers.max(1));
            dims.shared_kv_layers = shared as u32;
            if s.n_layer - dims.shared_kv_layers < dims.period {
                dims.shared_kv_layers = 0;
            }
        }
        Some(Gemma4Model {
            n_layer: s.n_layer,
            d_model: s.d_model,
            n_head: s.n_head,
            n_head_kv: s.n_head_kv,
            head_dim: s.head_dim,
            d_ff: s.d_ff,
            vocab: s.vocab,
            sliding_window: s.sliding_window,
            dims,
        })
    }

    pub(crate) fn sliding(&self, il: u32) -> bool {
        !(il + 1).is_multiple_of(self.dims.period.max(1))
    }

    fn first_shared(&self) -> u32 {
        self.n_layer.saturating_sub(self.dims.shared_kv_layers)
    }

    fn head_dim_of(&self, il: u32) -> u32 {
        if self.sliding(il) {
            self.head_dim
        } else {
            self.dims.head_dim_full
        }
    }

    fn kv_heads_of(&self, il: u32) -> u32 {
        if self.sliding(il) {
            self.n_head_kv
        } else {
            self.dims.n_head_kv_full
        }
    }

    fn d_ff_of(&self, il: u32) -> u32 {
        if self.dims.double_wide && il >= self.first_shared() {
            2 * self.d_ff
        } else {
            self.d_ff
        }
    }

    /// `rope_freqs`: 1 for the rotated pairs of a full-attention head, 1e30 (no rotation)
    /// for the rest, as llama.cpp's converter writes Gemma 4's proportional RoPE.
    pub(crate) fn rope_freqs(&self) -> Vec<f32> {
        let pairs = self.dims.head_dim_full / 2;
        let rotated = (self.dims.head_dim_full as f32 * self.dims.partial_rotary_full / 2.0) as u32;
        (0..pairs)
            .map(|i| if i < rotated { 1.0 } else { 1e30 })
            .collect()
    }

    /// Gemma 4's keys beyond `add_arch_meta`'s (which wrote the sliding layers' head size
    /// as `key_length`; replaced here by the full-attention one, as llama.cpp's converter
    /// writes it).
    pub(crate) fn add_meta(&self, w: &mut GgufWriter) {
        let k = |key: MetaKey| key.of("gemma4");
        let g = &self.dims;
        let per_layer = |f: &dyn Fn(u32) -> u32| -> Vec<u32> { (0..self.n_layer).map(f).collect() };
        if g.double_wide && g.shared_kv_layers > 0 {
            let ff = per_layer(&|il| self.d_ff_of(il));
            w.add(&k(MetaKey::FeedForwardLength), Value::Array(Array::U32(ff)));
        }
        if g.n_head_kv_full != self.n_head_kv {
            let kv = per_layer(&|il| self.kv_heads_of(il));
            w.add(&k(MetaKey::HeadCountKv), Value::Array(Array::U32(kv)));
        }
        w.add(&k(MetaKey::KeyLength), Value::U32(g.head_dim_full));
        w.add(&k(MetaKey::ValueLength), Value::U32(g.head_dim_full));
        w.add(&k(MetaKey::KeyLengthSwa), Value::U32(self.head_dim));
        w.add(&k(MetaKey::ValueLengthSwa), Value::U32(self.head_dim));
        w.add(&k(MetaKey::RopeDimensionCount), Value::U32(g.head_dim_full));
        w.add(
            &k(MetaKey::RopeDimensionCountSwa),
            Value::U32(self.head_dim),
        );
        w.add(&k(MetaKey::RopeFreqBaseSwa), Value::F32(g.rope_base_swa));
        w.add(&k(MetaKey::SlidingWindow), Value::U32(self.sliding_window));
        let pattern = (0..self.n_layer).map(|il| self.sliding(il)).collect();
        w.add(
            &k(MetaKey::SlidingWindowPattern),
            Value::Array(Array::Bool(pattern)),
        );
        w.add(&k(MetaKey::SharedKvLayers), Value::U32(g.shared_kv_layers));
        w.add(&k(MetaKey::EmbeddingLengthPerLayer), Value::U32(g.ple_dim));
        w.add(
            &k(MetaKey::FinalLogitSoftcapping),
            Value::F32(g.final_logit_softcap),
        );
        w.add("tokenizer.chat_template", Value::Str(CHAT_TEMPLATE.into()));
    }

    /// Every tensor, in file order: embeddings, RoPE factors, layers, final norm (the head
    /// is the embedding).
    pub(crate) fn tensors(&self) -> Vec<G4Tensor> {
        let (d, g) = (self.d_model, &self.dims);
        let mut out = Vec::new();
        let mut t = |kind, layer: Option<u32>, dims: Vec<u32>, fill| {
            out.push(G4Tensor {
                kind,
                layer,
                dims,
                fill,
            })
        };
        t(
            TensorKind::TokenEmbd,
            None,
            vec![d, self.vocab],
            G4Fill::Matrix,
        );
        if g.ple_dim > 0 {
            let w = self.n_layer * g.ple_dim;
            t(
                TensorKind::PerLayerTokenEmbd,
                None,
                vec![w, self.vocab],
                G4Fill::Matrix,
            );
            t(
                TensorKind::PerLayerModelProj,
                None,
                vec![d, w],
                G4Fill::Matrix,
            );
            t(
                TensorKind::PerLayerProjNorm,
                None,
                vec![g.ple_dim],
                G4Fill::Norm,
            );
        }
        t(
            TensorKind::RopeFreqs,
            None,
            vec![g.head_dim_full / 2],
            G4Fill::Values(self.rope_freqs()),
        );
        for il in 0..self.n_layer {
            let l = Some(il);
            let (hd, ff) = (self.head_dim_of(il), self.d_ff_of(il));
            let (q, kv) = (self.n_head * hd, self.kv_heads_of(il) * hd);
            let owns_kv = il < self.first_shared();
            let qk_norm = G4Fill::ScaledNorm((hd as f32).powf(-0.25));
            t(TensorKind::AttnNorm, l, vec![d], G4Fill::Norm);
            t(TensorKind::AttnQ, l, vec![d, q], G4Fill::Matrix);
            if owns_kv {
                t(TensorKind::AttnK, l, vec![d, kv], G4Fill::Matrix);
                if !g.v_from_k_full || self.sliding(il) {
                    t(TensorKind::AttnV, l, vec![d, kv], G4Fill::Matrix);
                }
                t(TensorKind::AttnKNorm, l, vec![hd], qk_norm.clone());
            }
            t(TensorKind::AttnQNorm, l, vec![hd], qk_norm);
            t(TensorKind::AttnOutput, l, vec![q, d], G4Fill::Matrix);
            t(TensorKind::PostAttnNorm, l, vec![d], G4Fill::Norm);
            t(TensorKind::FfnNorm, l, vec![d], G4Fill::Norm);
            t(TensorKind::FfnGate, l, vec![d, ff], G4Fill::Matrix);
            t(TensorKind::FfnUp, l, vec![d, ff], G4Fill::Matrix);
            t(TensorKind::FfnDown, l, vec![ff, d], G4Fill::Matrix);
            t(TensorKind::PostFfwNorm, l, vec![d], G4Fill::Norm);
            if g.ple_dim > 0 {
                t(
                    TensorKind::PerLayerInpGate,
                    l,
                    vec![d, g.ple_dim],
                    G4Fill::Matrix,
                );
                t(
                    TensorKind::PerLayerProj,
                    l,
                    vec![g.ple_dim, d],
                    G4Fill::Matrix,
                );
                t(TensorKind::PerLayerPostNorm, l, vec![d], G4Fill::Norm);
            }
            t(TensorKind::LayerOutScale, l, vec![1], G4Fill::Norm);
        }
        t(TensorKind::OutputNorm, None, vec![d], G4Fill::Norm);
        out
    }
}
