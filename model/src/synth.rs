//! Tiny random-weight GGUF models with llama.cpp's tensor names and metadata, for tests and
//! benchmarks that must not depend on downloaded files.
//!
//! The tokenizer is a made-up SentencePiece (`tokenizer.ggml.model = "llama"`) vocabulary:
//! `<unk>`, `<s>`, `</s>`, the 256 byte tokens `<0x00>`..`<0xFF>`, then word pieces.
//!
//! Real-size models (`--shape`: the hyper-parameters of Llama 3, Gemma 3, Qwen 2 models, in
//! llama.cpp's Q4_K_M mix or one type) are streamed to a file without building it in memory:
//! `shape` holds the table and the type mix, `vocab` their generated tokenizers, `stream`
//! the writer.

pub mod gemma4;
mod harmony;
mod phi3;
mod shape;
#[cfg(test)]
mod shape_tests;
mod spm;
mod stream;
mod vocab;

use spm::{add_spm_tokenizer, vocabulary, N_FIXED_TOKENS, SUFFIXES, TOKEN_TYPE_CONTROL, WORDS};

pub use shape::{
    llama3_rope_freqs, shape, shape_names, use_more_bits, Llama3Rope, Shape, VocabKind, WeightMix,
    SHAPES,
};
pub use stream::{
    shape_model_bytes, shape_tensors, tokenizer_gguf, write_shape_model, ShapeSpec, SynthError,
};

use crate::arch::{MetaKey, TensorKind};
use crate::gguf::{GgufError, GgufWriter, Value};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use ringllm_kernels::{reference, GgmlType};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthArch {
    Llama,
    Gemma3,
    /// Qwen 2: the Llama layout with Q/K/V biases and NeoX RoPE.
    Qwen2,
    Qwen3,
    /// Gemma 4: the tiny model of `gemma4::TINY`'s structure, and the `gemma4-*` shapes.
    Gemma4,
    /// Phi-3: fused Q/K/V and gate/up matrices, LongRoPE factors, a window on every layer.
    Phi3,
    Gemma2,
    Mistral3,
    /// Qwen3-MoE: Qwen3's attention, a mixture-of-experts feed-forward (`SynthSpec::experts`).
    Qwen3Moe,
    /// Mixtral: a `llama` file whose feed-forward is a mixture of experts (`--arch mixtral`).
    Mixtral,
    /// gpt-oss: biases, attention sinks, alternating windows, YaRN, clamped SwiGLU experts.
    GptOss,
}

impl SynthArch {
    /// The architectures `debug synth --arch` writes small models of.
    pub const SMALL: &'static [SynthArch] = &[
        SynthArch::Llama,
        SynthArch::Gemma3,
        SynthArch::Qwen2,
        SynthArch::Qwen3,
        SynthArch::Gemma4,
        SynthArch::Phi3,
        SynthArch::Gemma2,
        SynthArch::Mistral3,
        SynthArch::Qwen3Moe,
        SynthArch::Mixtral,
        SynthArch::GptOss,
    ];

    /// The architecture of GGUF name `name`, when a small model of it can be written.
    pub fn from_name(name: &str) -> Option<SynthArch> {
        Self::SMALL.iter().copied().find(|a| a.cli_name() == name)
    }

    /// The name `debug synth --arch` takes: the GGUF name, but `mixtral` for a `llama` file
    /// with experts.
    pub fn cli_name(self) -> &'static str {
        match self {
            SynthArch::Mixtral => "mixtral",
            a => a.name(),
        }
    }

    /// The GGUF architecture name (`general.architecture` and the key prefix).
    pub fn name(self) -> &'static str {
        match self {
            SynthArch::Llama => "llama",
            SynthArch::Gemma3 => "gemma3",
            SynthArch::Qwen2 => "qwen2",
            SynthArch::Qwen3 => "qwen3",
            SynthArch::Gemma4 => "gemma4",
            SynthArch::Phi3 => "phi3",
            SynthArch::Gemma2 => "gemma2",
            SynthArch::Mistral3 => "mistral3",
            SynthArch::Qwen3Moe => "qwen3moe",
            SynthArch::Mixtral => "llama",
            SynthArch::GptOss => "gpt-oss",
        }
    }

    /// Layers have norms after attention and after the feed-forward too (Gemma's sandwich).
    pub fn has_sandwich_norms(self) -> bool {
        matches!(self, SynthArch::Gemma3 | SynthArch::Gemma2)
    }

    /// Attention and final logit soft-caps the file states (Gemma 2's, from its config).
    pub fn softcaps(self) -> Option<(f32, f32)> {
        (self == SynthArch::Gemma2).then_some((50.0, 30.0))
    }

    /// Layers have an RMSNorm per head of Q and K (`attn_q_norm`, `attn_k_norm`).
    pub fn has_qk_norm(self) -> bool {
        matches!(
            self,
            SynthArch::Gemma3 | SynthArch::Qwen3 | SynthArch::Qwen3Moe
        )
    }

    /// The tokenizer of the small model (`--arch`): a SentencePiece vocabulary unless the
    /// family's files carry another kind.
    pub fn small_vocab(self) -> (VocabKind, u32) {
        match self {
            SynthArch::Qwen3 | SynthArch::Qwen3Moe => (VocabKind::Qwen3, 1280),
            // The harmony specials take the last 1090 ids, as in the real vocabulary.
            SynthArch::GptOss => (VocabKind::Harmony, 2048),
            SynthArch::Gemma2 => (VocabKind::Gemma, 512),
            SynthArch::Mistral3 => (VocabKind::Tekken, 2048),
            _ => (VocabKind::Spm, 512),
        }
    }
}

/// Shape and content of a synthetic model.
#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub arch: SynthArch,
    /// Type of the 2-D matrices (a matrix whose rows are not a whole number of blocks of it
    /// falls back to Q8_0, or F32 when not even that fits). Norms are always F32.
    pub weight_type: GgmlType,
    pub seed: u64,
    pub n_layer: u32,
    pub d_model: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    pub d_ff: u32,
    /// At least 259 (3 specials and 256 byte tokens).
    pub vocab: u32,
    pub ctx: u32,
    /// Gemma 3 only.
    pub sliding_window: u32,
    /// Llama only: no `output.weight`, the head reuses `token_embd.weight`. Gemma 3 is
    /// always tied.
    pub tied_embeddings: bool,
    /// A mixture-of-experts feed-forward: (experts, experts used per token); each expert's
    /// width is `d_ff`.
    pub experts: Option<(u32, u32)>,
}

impl SynthSpec {
    /// 2 layers, d 256, 4 heads (2 KV) of 64, FFN 512, vocab 512, context 256, window 8;
    /// tied for Gemma 3, untied for Llama.
    pub fn new(arch: SynthArch, weight_type: GgmlType, seed: u64) -> Self {
        if arch == SynthArch::Gemma4 {
            // 6 layers (see `gemma4::TINY`); sliding-window heads of 32, full ones of 64.
            return SynthSpec {
                arch,
                weight_type,
                seed,
                n_layer: 6,
                d_model: 256,
                n_head: 4,
                n_head_kv: 2,
                head_dim: 32,
                d_ff: 256,
                vocab: 512,
                ctx: 256,
                sliding_window: 8,
                tied_embeddings: true,
                experts: None,
            };
        }
        SynthSpec {
            arch,
            weight_type,
            seed,
            n_layer: 2,
            d_model: 256,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 64,
            d_ff: if matches!(
                arch,
                SynthArch::Qwen3Moe | SynthArch::Mixtral | SynthArch::GptOss
            ) {
                256
            } else {
                512
            },
            vocab: arch.small_vocab().1,
            ctx: 256,
            sliding_window: if arch == SynthArch::Phi3 {
                phi3::WINDOW
            } else {
                8
            },
            tied_embeddings: matches!(arch, SynthArch::Gemma3 | SynthArch::Gemma2),
            // 8 experts, 3 per token (an odd k, so the renormalization is not a pair's), each
            // 256 wide: rows of whole K-quant blocks, whole 16-row panels.
            experts: match arch {
                SynthArch::Qwen3Moe => Some((8, 3)),
                // Mixtral's own counts: 8 experts, 2 per token.
                SynthArch::Mixtral => Some((8, 2)),
                // gpt-oss-20b picks 4 of its 32.
                SynthArch::GptOss => Some((8, 4)),
                _ => None,
            },
        }
    }

    /// Whether the model has no `output.weight`.
    pub fn is_tied(&self) -> bool {
        self.tied_embeddings
            || matches!(
                self.arch,
                SynthArch::Gemma3 | SynthArch::Gemma4 | SynthArch::Gemma2
            )
    }

    /// Number of tensors `synth_model` writes.
    pub fn n_tensors(&self) -> usize {
        if self.arch == SynthArch::Gemma4 {
            return self.gemma4().tensors().len();
        }
        let per_layer = match self.arch {
            SynthArch::Llama => 9,
            SynthArch::Gemma3 => 13,
            SynthArch::Qwen2 => 12,
            SynthArch::Qwen3 => 11,
            SynthArch::Gemma4 => 0,
            SynthArch::Phi3 => 6,
            SynthArch::Gemma2 => 11,
            SynthArch::Mistral3 => 9,
            // The router and three stacked expert tensors in place of gate, up and down.
            SynthArch::Qwen3Moe => 12,
            SynthArch::Mixtral => 10,
            // Q/K/V/O and their biases, the sinks, two norms, the router and its bias, the
            // three stacked experts and their biases.
            SynthArch::GptOss => 19,
        };
        // Phi-3's two LongRoPE factor tensors are global.
        let rope = if self.arch == SynthArch::Phi3 { 2 } else { 0 };
        2 + rope + usize::from(!self.is_tied()) + per_layer * self.n_layer as usize
    }

    /// The Gemma 4 structure of this spec (`gemma4::TINY`'s extras).
    fn gemma4(&self) -> gemma4::Gemma4Model {
        gemma4::Gemma4Model {
            n_layer: self.n_layer,
            d_model: self.d_model,
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
            d_ff: self.d_ff,
            vocab: self.vocab,
            sliding_window: self.sliding_window,
            dims: gemma4::TINY,
        }
    }

    fn validate(&self) -> Result<(), GgufError> {
        let bad = |why: String| Err(GgufError::InvalidInput(format!("synthetic model: {why}")));
        let s = self;
        if [
            s.n_layer,
            s.d_model,
            s.n_head,
            s.n_head_kv,
            s.head_dim,
            s.d_ff,
            s.ctx,
        ]
        .contains(&0)
        {
            return bad(format!("zero-sized dimension in {s:?}"));
        }
        if !s.n_head.is_multiple_of(s.n_head_kv) {
            return bad(format!(
                "n_head {} is not a multiple of n_head_kv {}",
                s.n_head, s.n_head_kv
            ));
        }
        if s.vocab < N_FIXED_TOKENS {
            return bad(format!(
                "vocab {} is smaller than the {N_FIXED_TOKENS} special and byte tokens",
                s.vocab
            ));
        }
        let kind = s.arch.small_vocab().0;
        if kind != VocabKind::Spm && s.vocab < kind.min_vocab() {
            return bad(format!(
                "vocab {} is smaller than {} for a {} tokenizer",
                s.vocab,
                kind.min_vocab(),
                s.arch.name()
            ));
        }
        if matches!(s.weight_type, GgmlType::Q8_1 | GgmlType::Q8_K) {
            return bad(format!(
                "{} is an activation format, not a weight format",
                s.weight_type
            ));
        }
        // Keep every tensor small enough that sizes cannot overflow.
        let big = [s.d_model, s.d_ff, s.vocab, s.n_head * s.head_dim]
            .iter()
            .any(|&x| x > 1 << 20);
        if big || s.n_layer > 4096 || s.n_head.checked_mul(s.head_dim).is_none() {
            return bad(format!("dimensions too large for a synthetic model: {s:?}"));
        }
        Ok(())
    }
}

/// The small models' attention and final logit soft-caps (Gemma 2's are 50 and 30): small
/// enough to bend the scores and logits of a small random model (about 4 and 9 at most), so a
/// forward pass that skipped either would not pass the tests.
pub const SMALL_SOFTCAPS: (f32, f32) = (2.0, 6.0);

/// The small mixture-of-experts models' router weights over a plain matrix's (router logits
/// of standard deviation about 4 instead of 1).
const ROUTER_GAIN: f32 = 4.0;

struct Gen {
    rng: StdRng,
}

impl Gen {
    /// A standard normal sample (Box–Muller).
    fn normal(&mut self) -> f32 {
        let u1: f32 = 1.0 - self.rng.random::<f32>(); // (0, 1]
        let u2: f32 = self.rng.random::<f32>();
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }

    fn norm_weights(&mut self, n: u32) -> Vec<u8> {
        let mut out = Vec::with_capacity(n as usize * 4);
        for _ in 0..n {
            out.extend_from_slice(&(1.0 + 0.1 * self.normal()).to_le_bytes());
        }
        out
    }

    /// Bias vectors: 0.1·N(0, 1).
    fn bias_weights(&mut self, n: u32) -> Vec<u8> {
        let mut out = Vec::with_capacity(n as usize * 4);
        for _ in 0..n {
            out.extend_from_slice(&(0.1 * self.normal()).to_le_bytes());
        }
        out
    }

    /// `n_rows` rows of `row_len` values ~ N(0, 1/√row_len), encoded as `ty`.
    fn matrix(&mut self, row_len: u32, n_rows: u32, ty: GgmlType) -> Result<Vec<u8>, GgufError> {
        self.matrix_gain(row_len, n_rows, ty, 1.0)
    }

    /// [`Gen::matrix`] with every value times `gain`.
    fn matrix_gain(
        &mut self,
        row_len: u32,
        n_rows: u32,
        ty: GgmlType,
        gain: f32,
    ) -> Result<Vec<u8>, GgufError> {
        let scale = gain / (row_len as f32).sqrt();
        let n = row_len as usize * n_rows as usize;
        let src: Vec<f32> = (0..n).map(|_| self.normal() * scale).collect();
        let bytes = ty
            .row_bytes(row_len as usize)
            .and_then(|r| r.checked_mul(n_rows as usize))
            .ok_or_else(|| {
                GgufError::InvalidInput(format!("{row_len} x {n_rows} matrix of {ty}"))
            })?;
        let mut dst = vec![0u8; bytes];
        (reference(ty).quantize)(&src, &mut dst);
        Ok(dst)
    }
}

/// The type a `[row_len, _]` matrix is stored in: the requested one when rows are whole
/// blocks of it, else Q8_0, else F32.
fn matrix_type(want: GgmlType, row_len: u32) -> GgmlType {
    [want, GgmlType::Q8_0, GgmlType::F32]
        .into_iter()
        .find(|t| (row_len as usize).is_multiple_of(t.block_size()))
        .unwrap_or(GgmlType::F32)
}

/// The architecture's hyper-parameters as metadata (`{arch}.…` keys): what both synthetic
/// writers (`synth_model` and the real-size shapes of `synth::stream`) write, in one order.
pub(crate) struct ArchMeta {
    pub arch: SynthArch,
    pub ctx: u32,
    pub d_model: u32,
    pub n_layer: u32,
    pub d_ff: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    pub vocab: u32,
    pub sliding_window: u32,
    pub rope_base: f32,
    pub rms_eps: f32,
    /// Attention and final logit soft-caps (Gemma 2).
    pub softcaps: Option<(f32, f32)>,
    /// Experts, experts used per token, one expert's width.
    pub experts: Option<(u32, u32, u32)>,
}

/// Adds `m`'s keys to `w`.
pub(crate) fn add_arch_meta(w: &mut GgufWriter, m: &ArchMeta) {
    let a = m.arch.name();
    let k = |key: MetaKey| key.of(a);
    w.add(&k(MetaKey::ContextLength), Value::U32(m.ctx));
    w.add(&k(MetaKey::EmbeddingLength), Value::U32(m.d_model));
    w.add(&k(MetaKey::BlockCount), Value::U32(m.n_layer));
    w.add(&k(MetaKey::FeedForwardLength), Value::U32(m.d_ff));
    w.add(&k(MetaKey::HeadCount), Value::U32(m.n_head));
    w.add(&k(MetaKey::HeadCountKv), Value::U32(m.n_head_kv));
    w.add(&k(MetaKey::KeyLength), Value::U32(m.head_dim));
    w.add(&k(MetaKey::ValueLength), Value::U32(m.head_dim));
    w.add(&k(MetaKey::RopeFreqBase), Value::F32(m.rope_base));
    w.add(&k(MetaKey::RmsEpsilon), Value::F32(m.rms_eps));
    match m.arch {
        SynthArch::Llama | SynthArch::Mistral3 | SynthArch::Mixtral => {
            w.add(&k(MetaKey::RopeDimensionCount), Value::U32(m.head_dim));
            w.add(&k(MetaKey::VocabSize), Value::U32(m.vocab));
        }
        SynthArch::Gemma3 => {
            w.add(&k(MetaKey::SlidingWindow), Value::U32(m.sliding_window));
        }
        SynthArch::Qwen2 | SynthArch::Qwen3 | SynthArch::Qwen3Moe => {}
        // Its own keys come with the model (`gemma4::Gemma4Model::add_meta`).
        SynthArch::Gemma4 => {}
        SynthArch::Phi3 => {
            w.add(&k(MetaKey::RopeDimensionCount), Value::U32(m.head_dim));
            w.add(&k(MetaKey::SlidingWindow), Value::U32(m.sliding_window));
        }
        SynthArch::Gemma2 => {
            w.add(&k(MetaKey::SlidingWindow), Value::U32(m.sliding_window));
        }
        SynthArch::GptOss => {
            // gpt-oss's own RoPE scaling: YaRN, 32 times an original context of 4096.
            w.add(&k(MetaKey::SlidingWindow), Value::U32(m.sliding_window));
            w.add(&k(MetaKey::RopeScalingType), Value::Str("yarn".into()));
            w.add(&k(MetaKey::RopeScalingFactor), Value::F32(32.0));
            w.add(&k(MetaKey::RopeScalingOrigCtx), Value::U32(4096));
        }
    }
    if let Some((attn, fin)) = m.softcaps {
        w.add(&k(MetaKey::AttnLogitSoftcapping), Value::F32(attn));
        w.add(&k(MetaKey::FinalLogitSoftcapping), Value::F32(fin));
    }
    if let Some((n, used, ff)) = m.experts {
        w.add(&k(MetaKey::ExpertCount), Value::U32(n));
        w.add(&k(MetaKey::ExpertUsedCount), Value::U32(used));
        w.add(&k(MetaKey::ExpertFeedForwardLength), Value::U32(ff));
    }
}

/// The small model's tokenizer (and, for Gemma 4, its own metadata keys).
fn add_small_tokenizer(w: &mut GgufWriter, s: &SynthSpec) {
    match s.arch.small_vocab().0 {
        VocabKind::Spm if s.arch == SynthArch::Phi3 => phi3::add_tokenizer(w, s),
        VocabKind::Spm if s.arch == SynthArch::Gemma4 => {
            // The chat template's markup as control tokens, in place of the last made-up
            // pieces.
            let mut vocab = vocabulary(s.vocab as usize);
            let at = vocab.len() - gemma4::MARKUP_TOKENS.len();
            for (slot, t) in vocab[at..].iter_mut().zip(gemma4::MARKUP_TOKENS) {
                *slot = (t.to_string(), 0.0, TOKEN_TYPE_CONTROL);
            }
            s.gemma4().add_meta(w);
            add_spm_tokenizer(w, &vocab, true);
        }
        VocabKind::Spm => add_spm_tokenizer(w, &vocabulary(s.vocab as usize), true),
        kind => vocab::add_tokenizer(w, kind, s.vocab),
    }
}

/// Writes a random-weight model; the same spec always gives the same bytes.
pub fn synth_model(spec: &SynthSpec) -> Result<Vec<u8>, GgufError> {
    spec.validate()?;
    let s = spec;
    let a = s.arch.name();
    let mut w = GgufWriter::new();

    w.add("general.architecture", Value::Str(a.to_string()));
    w.add(
        "general.name",
        Value::Str(format!("synthetic {a} {} seed {}", s.weight_type, s.seed)),
    );
    w.add("general.quantization_version", Value::U32(2));
    let (rope_base, rms_eps) = match s.arch {
        SynthArch::Llama | SynthArch::Phi3 => (10000.0f32, 1e-5f32),
        SynthArch::Mixtral => (1e6, 1e-5),
        SynthArch::GptOss => (150_000.0, 1e-5),
        SynthArch::Gemma2 => (10000.0, 1e-6),
        SynthArch::Mistral3 => (1e9, 1e-5),
        SynthArch::Gemma3
        | SynthArch::Qwen2
        | SynthArch::Qwen3
        | SynthArch::Gemma4
        | SynthArch::Qwen3Moe => (1e6, 1e-6),
    };
    add_arch_meta(
        &mut w,
        &ArchMeta {
            arch: s.arch,
            ctx: s.ctx,
            d_model: s.d_model,
            n_layer: s.n_layer,
            d_ff: s.d_ff,
            n_head: s.n_head,
            n_head_kv: s.n_head_kv,
            head_dim: s.head_dim,
            vocab: s.vocab,
            sliding_window: s.sliding_window,
            rope_base,
            rms_eps,
            softcaps: s.arch.softcaps().map(|_| SMALL_SOFTCAPS),
            experts: s.experts.map(|(n, used)| (n, used, s.d_ff)),
        },
    );

    add_small_tokenizer(&mut w, s);

    let mut g = Gen {
        rng: StdRng::seed_from_u64(s.seed),
    };
    let d = s.d_model;
    let q = s.n_head * s.head_dim;
    let kv = s.n_head_kv * s.head_dim;
    if s.arch == SynthArch::Gemma4 {
        gemma4_tensors(&mut w, &mut g, s)?;
        return Ok(w.to_bytes());
    }
    // A matrix `[row_len, rows...]` in the spec's type (`None`), or in a given type with its
    // values multiplied by a gain.
    let mut tensor = |w: &mut GgufWriter, name: &str, dims: &[u32], ty: Option<(GgmlType, f32)>| {
        let (ty, gain) = ty.unwrap_or_else(|| (matrix_type(s.weight_type, dims[0]), 1.0));
        let data = g.matrix_gain(dims[0], dims[1..].iter().product(), ty, gain)?;
        let dims: Vec<u64> = dims.iter().map(|&x| x.into()).collect();
        w.add_tensor(name, &dims, ty, data)
    };
    tensor(&mut w, "token_embd.weight", &[d, s.vocab], None)?;
    let mut norms: Vec<(String, u32)> = Vec::new();
    let mut biases: Vec<(String, Vec<u32>, f32)> = Vec::new();
    for il in 0..s.n_layer {
        let b = |n: &str| format!("blk.{il}.{n}.weight");
        if s.arch == SynthArch::Phi3 {
            // Fused, as Phi-3 files hold them: rows [q | k | v] and [gate | up].
            tensor(&mut w, &b("attn_qkv"), &[d, q + 2 * kv], None)?;
            tensor(&mut w, &b("attn_output"), &[q, d], None)?;
            tensor(&mut w, &b("ffn_up"), &[d, 2 * s.d_ff], None)?;
            tensor(&mut w, &b("ffn_down"), &[s.d_ff, d], None)?;
        } else {
            tensor(&mut w, &b("attn_q"), &[d, q], None)?;
            tensor(&mut w, &b("attn_k"), &[d, kv], None)?;
            tensor(&mut w, &b("attn_v"), &[d, kv], None)?;
            tensor(&mut w, &b("attn_output"), &[q, d], None)?;
            // A mixture of experts: its router, F32 as llama.cpp's quantizer leaves it and
            // ROUTER_GAIN times a plain matrix (peaked as a trained router is: a plain one's
            // logits spread a token over its picks nearly evenly), and the experts stacked.
            let (ne, names) = match s.experts {
                Some((ne, _)) => (Some(ne), ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]),
                None => (None, ["ffn_gate", "ffn_up", "ffn_down"]),
            };
            if let Some(ne) = ne {
                let router = Some((GgmlType::F32, ROUTER_GAIN));
                tensor(&mut w, &b("ffn_gate_inp"), &[d, ne], router)?;
            }
            for (name, (row_len, rows)) in
                names
                    .into_iter()
                    .zip([(d, s.d_ff), (d, s.d_ff), (s.d_ff, d)])
            {
                let dims: Vec<u32> = [row_len, rows].into_iter().chain(ne).collect();
                tensor(&mut w, &b(name), &dims, None)?;
            }
        }
        norms.push((b("attn_norm"), d));
        // gpt-oss names its feed-forward's pre-norm `post_attention_norm`.
        let ffn_norm = if s.arch == SynthArch::GptOss {
            "post_attention_norm"
        } else {
            "ffn_norm"
        };
        norms.push((b(ffn_norm), d));
        if s.arch.has_qk_norm() {
            // GGUF stores Gemma's RMSNorm weights as (1 + w), so these are near 1 as well.
            norms.push((b("attn_q_norm"), s.head_dim));
            norms.push((b("attn_k_norm"), s.head_dim));
        }
        if s.arch.has_sandwich_norms() {
            norms.push((b("post_attention_norm"), d));
            norms.push((b("post_ffw_norm"), d));
        }
        biases.extend(layer_biases(s, il));
    }
    if !s.is_tied() {
        tensor(&mut w, "output.weight", &[d, s.vocab], None)?;
    }
    norms.push(("output_norm.weight".to_string(), d));
    for (name, n) in norms {
        let data = g.norm_weights(n);
        w.add_tensor(&name, &[n.into()], GgmlType::F32, data)?;
    }
    for (name, dims, gain) in biases {
        let data: Vec<u8> = g
            .bias_weights(dims.iter().product())
            .chunks_exact(4)
            .flat_map(|c| (f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * gain).to_le_bytes())
            .collect();
        let dims: Vec<u64> = dims.iter().map(|&x| x.into()).collect();
        w.add_tensor(&name, &dims, GgmlType::F32, data)?;
    }
    if s.arch == SynthArch::Phi3 {
        let (long, short) = phi3::rope_factors(s.head_dim / 2);
        for (kind, v) in [
            (TensorKind::RopeFactorsLong, long),
            (TensorKind::RopeFactorsShort, short),
        ] {
            let data = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            w.add_tensor(
                &kind.gguf_name(None),
                &[v.len() as u64],
                GgmlType::F32,
                data,
            )?;
        }
    }
    Ok(w.to_bytes())
}

/// Layer `il`'s bias-like vectors (name, dims, gain over N(0, 0.1)): Qwen2's Q/K/V biases;
/// gpt-oss's Q/K/V/output, router and expert biases and its attention sinks (gain 10: sinks
/// of N(0, 1), strong enough to matter against scores of that size).
fn layer_biases(s: &SynthSpec, il: u32) -> Vec<(String, Vec<u32>, f32)> {
    let (d, q, kv) = (s.d_model, s.n_head * s.head_dim, s.n_head_kv * s.head_dim);
    let bias = |t: &str, dims: &[u32]| (format!("blk.{il}.{t}.bias"), dims.to_vec(), 1.0);
    let mut out = Vec::new();
    if matches!(s.arch, SynthArch::Qwen2 | SynthArch::GptOss) {
        out.extend([
            bias("attn_q", &[q]),
            bias("attn_k", &[kv]),
            bias("attn_v", &[kv]),
        ]);
    }
    if let (SynthArch::GptOss, Some((ne, _))) = (s.arch, s.experts) {
        out.extend([
            bias("attn_output", &[d]),
            bias("ffn_gate_inp", &[ne]),
            bias("ffn_gate_exps", &[s.d_ff, ne]),
            bias("ffn_up_exps", &[s.d_ff, ne]),
            bias("ffn_down_exps", &[d, ne]),
        ]);
        out.push((format!("blk.{il}.attn_sinks.weight"), vec![s.n_head], 10.0));
    }
    out
}

/// The tensors of a small Gemma 4 model (`gemma4::TINY`'s structure).
fn gemma4_tensors(w: &mut GgufWriter, g: &mut Gen, s: &SynthSpec) -> Result<(), GgufError> {
    for t in s.gemma4().tensors() {
        let name = t.kind.gguf_name(t.layer.map(|l| l as usize));
        match t.fill {
            gemma4::G4Fill::Matrix => {
                let ty = matrix_type(s.weight_type, t.dims[0]);
                let data = g.matrix(t.dims[0], t.dims[1], ty)?;
                w.add_tensor(&name, &[t.dims[0].into(), t.dims[1].into()], ty, data)?;
            }
            gemma4::G4Fill::Norm => {
                let data = g.norm_weights(t.dims[0]);
                w.add_tensor(&name, &[t.dims[0].into()], GgmlType::F32, data)?;
            }
            gemma4::G4Fill::ScaledNorm(k) => {
                let data: Vec<u8> = g
                    .norm_weights(t.dims[0])
                    .chunks_exact(4)
                    .flat_map(|c| (f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * k).to_le_bytes())
                    .collect();
                w.add_tensor(&name, &[t.dims[0].into()], GgmlType::F32, data)?;
            }
            gemma4::G4Fill::Values(v) => {
                let data = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                w.add_tensor(&name, &[t.dims[0].into()], GgmlType::F32, data)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
