//! The real-size shapes `ringllm debug synth --shape` writes, and which weight type each
//! matrix gets: a single type for all, or llama.cpp's Q4_K_M mix.

use super::SynthArch;
use crate::arch::TensorKind;
use ringllm_kernels::GgmlType;

/// Llama 3.1 "llama3" RoPE scaling: long wavelengths divided by `factor`, short ones kept,
/// a smooth ramp between (the published `rope_scaling` of the Llama 3.1/3.2 configs). In GGUF
/// it is the `rope_freqs.weight` tensor of per-frequency divisors.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Rope {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_ctx: u32,
}

/// The generated tokenizer's family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VocabKind {
    /// Byte-level BPE with Llama 3's pre-tokenizer (`llama-bpe`); the last 256 ids are
    /// Llama 3's special tokens.
    Llama3,
    /// Byte-level BPE with Qwen 2's pre-tokenizer; 3 specials then `[PAD…]` tokens fill the
    /// last 421 ids, as in Qwen 2's 152064-entry vocabulary.
    Qwen2,
    /// SentencePiece (`llama`) with byte fallback, as Gemma 3 uses.
    Spm,
    /// Byte-level BPE with Qwen 2's pre-tokenizer (`qwen2`, as Qwen3 files say) and Qwen3's
    /// 26 added tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, ... `<think>`,
    /// `</think>`) then `[PAD…]` tokens: the last 293 ids, as in Qwen3's 151936-entry
    /// vocabulary. Carries Qwen3's chat template.
    Qwen3,
    /// SentencePiece with byte fallback and Gemma's ids for its specials (`<pad>` 0, `<eos>` 1,
    /// `<bos>` 2, `<unk>` 3, `<mask>`, `<start_of_turn>`, `<end_of_turn>`): Gemma 2's
    /// tokenizer, carrying Gemma 2's chat template.
    Gemma,
    /// Byte-level BPE with Mistral's Tekken pre-tokenizer (`tekken`) and its 1000 control
    /// tokens first (`<unk>`, `<s>`, `</s>`, `[INST]`, `[/INST]`, ... `[SYSTEM_PROMPT]`, then
    /// `<SPECIAL_n>`), as Mistral Small 3's 131072-entry vocabulary; carries Mistral Small
    /// 3.2's chat template.
    Tekken,
    /// Byte-level BPE with the o200k pre-tokenizer (`gpt-4o`) and o200k_harmony's special
    /// tokens (`<|startoftext|>`, `<|endoftext|>`, `<|return|>`, `<|channel|>`, `<|start|>`,
    /// `<|end|>`, `<|message|>`, `<|call|>`, ... then `<|reserved_N|>`) in the last 1090 ids,
    /// as gpt-oss's 201088-entry vocabulary; carries gpt-oss's chat template.
    Harmony,
}

impl VocabKind {
    /// Ids at the end of the vocabulary that are not BPE merges.
    pub(crate) fn tail(self) -> u32 {
        match self {
            VocabKind::Llama3 => 256,
            VocabKind::Qwen2 => 421,
            VocabKind::Spm => 0,
            VocabKind::Qwen3 => 293,
            VocabKind::Gemma | VocabKind::Tekken => 0,
            VocabKind::Harmony => super::harmony::HARMONY_TAIL,
        }
    }

    /// The smallest vocabulary `--vocab` may ask for.
    pub fn min_vocab(self) -> u32 {
        match self {
            VocabKind::Spm => super::N_FIXED_TOKENS + 64,
            VocabKind::Gemma => super::N_FIXED_TOKENS + 64 + GEMMA_SPECIALS.len() as u32 - 3,
            VocabKind::Tekken => TEKKEN_CONTROL + 256 + 512,
            _ => self.tail() + 256 + 512,
        }
    }
}

/// Gemma's special tokens at ids 0.. (as in its tokenizer.model), each a control token but
/// `<unk>`.
pub const GEMMA_SPECIALS: &[&str] = &[
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<start_of_turn>",
    "<end_of_turn>",
];

/// Control tokens at the start of a Tekken vocabulary.
pub const TEKKEN_CONTROL: u32 = 1000;

/// Hyper-parameters of a real model.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    /// `--shape` name.
    pub name: &'static str,
    /// The published model whose config.json these values come from.
    pub source: &'static str,
    pub arch: SynthArch,
    pub n_layer: u32,
    pub d_model: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    pub d_ff: u32,
    pub vocab: u32,
    /// `context_length` (max_position_embeddings).
    pub ctx: u32,
    pub rope_base: f32,
    pub rope_scaling: Option<Llama3Rope>,
    pub rms_eps: f32,
    /// Gemma 3: window of the local layers; every `sliding_window_pattern`-th layer is global
    /// (llama.cpp's fixed 5:1 pattern, which readers assume when the GGUF does not say).
    pub sliding_window: u32,
    pub sliding_window_pattern: u32,
    /// No `output.weight`: the head is the embedding.
    pub tied: bool,
    pub vocab_kind: VocabKind,
}

const LLAMA31_ROPE: Llama3Rope = Llama3Rope {
    factor: 8.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_ctx: 8192,
};

/// Every shape. The numbers are those of each source model's config.json (hidden_size,
/// intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
/// vocab_size, max_position_embeddings, rope_theta, rope_scaling, rms_norm_eps,
/// sliding_window, tie_word_embeddings), which is also what llama.cpp's converter puts in GGUF.
pub const SHAPES: &[Shape] = &[
    // Not a published model: a Llama-3-like miniature for fast tests (untied, llama3 RoPE,
    // row lengths whole K-quant blocks so the Q4_K_M mix applies as on the big shapes).
    Shape {
        name: "tiny",
        source: "none (Llama 3 layout in miniature)",
        arch: SynthArch::Llama,
        n_layer: 2,
        d_model: 256,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 64,
        d_ff: 768,
        vocab: 2048,
        ctx: 4096,
        rope_base: 500_000.0,
        rope_scaling: Some(LLAMA31_ROPE),
        rms_eps: 1e-5,
        sliding_window: 0,
        sliding_window_pattern: 0,
        tied: false,
        vocab_kind: VocabKind::Llama3,
    },
    // meta-llama/Llama-3.2-1B
    Shape {
        name: "llama3-1b",
        source: "meta-llama/Llama-3.2-1B",
        arch: SynthArch::Llama,
        n_layer: 16,
        d_model: 2048,
        n_head: 32,
        n_head_kv: 8,
        head_dim: 64,
        d_ff: 8192,
        vocab: 128_256,
        ctx: 131_072,
        rope_base: 500_000.0,
        rope_scaling: Some(Llama3Rope {
            factor: 32.0,
            ..LLAMA31_ROPE
        }),
        rms_eps: 1e-5,
        sliding_window: 0,
        sliding_window_pattern: 0,
        tied: true,
        vocab_kind: VocabKind::Llama3,
    },
    // meta-llama/Llama-3.1-8B
    Shape {
        name: "llama3-8b",
        source: "meta-llama/Llama-3.1-8B",
        arch: SynthArch::Llama,
        n_layer: 32,
        d_model: 4096,
        n_head: 32,
        n_head_kv: 8,
        head_dim: 128,
        d_ff: 14_336,
        vocab: 128_256,
        ctx: 131_072,
        rope_base: 500_000.0,
        rope_scaling: Some(LLAMA31_ROPE),
        rms_eps: 1e-5,
        sliding_window: 0,
        sliding_window_pattern: 0,
        tied: false,
        vocab_kind: VocabKind::Llama3,
    },
    // google/gemma-3-1b-pt (query_pre_attn_scalar 256 = head_dim, rope_local_base_freq 10000,
    // no rope scaling, no final logit soft-capping).
    Shape {
        name: "gemma3-1b",
        source: "google/gemma-3-1b-pt",
        arch: SynthArch::Gemma3,
        n_layer: 26,
        d_model: 1152,
        n_head: 4,
        n_head_kv: 1,
        head_dim: 256,
        d_ff: 6912,
        vocab: 262_144,
        ctx: 32_768,
        rope_base: 1_000_000.0,
        rope_scaling: None,
        rms_eps: 1e-6,
        sliding_window: 512,
        sliding_window_pattern: 6,
        tied: true,
        vocab_kind: VocabKind::Spm,
    },
    // Qwen/Qwen2-7B-Instruct (Q/K/V biases; use_sliding_window false).
    Shape {
        name: "qwen2-7b",
        source: "Qwen/Qwen2-7B-Instruct",
        arch: SynthArch::Qwen2,
        n_layer: 28,
        d_model: 3584,
        n_head: 28,
        n_head_kv: 4,
        head_dim: 128,
        d_ff: 18_944,
        vocab: 152_064,
        ctx: 32_768,
        rope_base: 1_000_000.0,
        rope_scaling: None,
        rms_eps: 1e-6,
        sliding_window: 0,
        sliding_window_pattern: 0,
        tied: false,
        vocab_kind: VocabKind::Qwen2,
    },
    // Qwen/Qwen3-0.6B (QK-norm, no biases, head_dim 128 ≠ d/n_head, tied head).
    Shape {
        name: "qwen3-0.6b",
        source: "Qwen/Qwen3-0.6B",
        arch: SynthArch::Qwen3,
        n_layer: 28,
        d_model: 1024,
        n_head: 16,
        n_head_kv: 8,
        head_dim: 128,
        d_ff: 3072,
        vocab: 151_936,
        ctx: 40_960,
        rope_base: 1_000_000.0,
        rope_scaling: None,
        rms_eps: 1e-6,
        sliding_window: 0,
        sliding_window_pattern: 0,
        tied: true,
        vocab_kind: VocabKind::Qwen3,
    },
    // Qwen/Qwen3-8B
    Shape {
        name: "qwen3-8b",
        source: "Qwen/Qwen3-8B",
        arch: SynthArch::Qwen3,
        n_layer: 36,
        d_model: 4096,
        n_head: 32,
        n_head_kv: 8,
        head_dim: 128,
        d_ff: 12_288,
        vocab: 151_936,
        ctx: 40_960,
        rope_base: 1_000_000.0,
        rope_scaling: None,
        rms_eps: 1e-6,
        sliding_window: 0,
        sliding_window_pattern: 0,
        tied: false,
        vocab_kind: VocabKind::Qwen3,
    },
    // Qwen/Qwen3-14B
    Shape {
        name: "qwen3-14b",
        source: "Qwen/Qwen3-14B",
        arch: SynthArch::Qwen3,
        n_layer: 40,
        d_model: 5120,
        n_head: 40,
        n_head_kv: 8,
        head_dim: 128,
        d_ff: 17_408,
        vocab: 151_936,
        ctx: 40_960,
        rope_base: 1_000_000.0,
        rope_scaling: None,
        rms_eps: 1e-6,
        sliding_window: 0,
        sliding_window_pattern: 0,
        tied: false,
        vocab_kind: VocabKind::Qwen3,
    },
    // Qwen/Qwen3-32B (64 query heads of 128: q is 8192 wide, more than d_model).
    Shape {
        name: "qwen3-32b",
        source: "Qwen/Qwen3-32B",
        arch: SynthArch::Qwen3,
        n_layer: 64,
        d_model: 5120,
        n_head: 64,
        n_head_kv: 8,
        head_dim: 128,
        d_ff: 25_600,
        vocab: 151_936,
        ctx: 40_960,
        rope_base: 1_000_000.0,
        rope_scaling: None,
        rms_eps: 1e-6,
        sliding_window: 0,
        sliding_window_pattern: 0,
        tied: false,
        vocab_kind: VocabKind::Qwen3,
    },
    // Not a published model: Gemma 4's layout in miniature (`synth::gemma4`), 6 layers
    // `S S F S S F`, the last three sharing the KV caches of layers 1 and 2, no per-layer
    // embeddings: a ring can split it.
    Shape {
        name: "gemma4-tiny",
        source: "none (Gemma 4 layout in miniature)",
        arch: SynthArch::Gemma4,
        n_layer: 6,
        d_model: 256,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 32,
        d_ff: 512,
        vocab: 2048,
        ctx: 4096,
        rope_base: 1_000_000.0,
        rope_scaling: None,
        rms_eps: 1e-6,
        sliding_window: 8,
        sliding_window_pattern: 3,
        tied: true,
        vocab_kind: VocabKind::Spm,
    },
    // google/gemma-4-E2B-it (text model; rope_theta 1e6 global, 1e4 sliding). The Gemma 4
    // structure beyond these fields (full-attention heads of 512, shared-KV layers,
    // per-layer embeddings...) is in `synth::gemma4`. The vocabulary is our SentencePiece
    // stand-in: real Gemma 4 files carry a `gemma4` BPE one.
    Shape {
        name: "gemma4-e2b",
        source: "google/gemma-4-E2B-it",
        arch: SynthArch::Gemma4,
        n_layer: 35,
        d_model: 1536,
        n_head: 8,
        n_head_kv: 1,
        head_dim: 256,
        d_ff: 6144,
        vocab: 262_144,
        ctx: 131_072,
        rope_base: 1_000_000.0,
        rope_scaling: None,
        rms_eps: 1e-6,
        sliding_window: 512,
        sliding_window_pattern: 5,
        tied: true,
        vocab_kind: VocabKind::Spm,
    },
    // google/gemma-4-E4B-it (best knowledge of d_ff 10240 and 2 KV heads).
    Shape {
        name: "gemma4-e4b",
        source: "google/gemma-4-E4B-it",
        arch: SynthArch::Gemma4,
        n_layer: 42,
        d_model: 2560,
        n_head: 8,
        n_head_kv: 2,
        head_dim: 256,
        d_ff: 10_240,
        vocab: 262_144,
        ctx: 131_072,
        rope_base: 1_000_000.0,
        rope_scaling: None,
        rms_eps: 1e-6,
        sliding_window: 512,
        sliding_window_pattern: 6,
        tied: true,
        vocab_kind: VocabKind::Spm,
    },
    // google/gemma-4-31B-it (best knowledge of d 5376, 32 heads, 16 sliding KV heads,
    // d_ff 21504, window 1024, context 262144).
    Shape {
        name: "gemma4-31b",
        source: "google/gemma-4-31B-it",
        arch: SynthArch::Gemma4,
        n_layer: 60,
        d_model: 5376,
        n_head: 32,
        n_head_kv: 16,
        head_dim: 256,
        d_ff: 21_504,
        vocab: 262_144,
        ctx: 262_144,
        rope_base: 1_000_000.0,
        rope_scaling: None,
        rms_eps: 1e-6,
        sliding_window: 1024,
        sliding_window_pattern: 6,
        tied: true,
        vocab_kind: VocabKind::Spm,
    },
    // microsoft/Phi-3-mini-4k-instruct (fused Q/K/V and gate/up; sliding_window 2047 on
    // every layer; no rope_scaling, so no LongRoPE factors; the 128k model has the same
    // dimensions with LongRoPE).
    Shape {
        name: "phi3-mini",
        source: "microsoft/Phi-3-mini-4k-instruct",
        arch: SynthArch::Phi3,
        n_layer: 32,
        d_model: 3072,
        n_head: 32,
        n_head_kv: 32,
        head_dim: 96,
        d_ff: 8192,
        vocab: 32_064,
        ctx: 4096,
        rope_base: 10_000.0,
        rope_scaling: None,
        rms_eps: 1e-5,
        sliding_window: 2047,
        sliding_window_pattern: 0,
        tied: false,
        vocab_kind: VocabKind::Spm,
    },
    // google/gemma-2-9b-it (query_pre_attn_scalar 256 = head_dim, attn_logit_softcapping 50,
    // final_logit_softcapping 30, sliding_window 4096 on every other layer, tied head).
    Shape {
        name: "gemma2-9b",
        source: "google/gemma-2-9b-it",
        arch: SynthArch::Gemma2,
        n_layer: 42,
        d_model: 3584,
        n_head: 16,
        n_head_kv: 8,
        head_dim: 256,
        d_ff: 14_336,
        vocab: 256_000,
        ctx: 8192,
        rope_base: 10_000.0,
        rope_scaling: None,
        rms_eps: 1e-6,
        sliding_window: 4096,
        sliding_window_pattern: 2,
        tied: true,
        vocab_kind: VocabKind::Gemma,
    },
    // mistralai/Mistral-Small-3.2-24B-Instruct-2506, its text model (Mistral Small 3.1 has the
    // same; 3 "2501" differs in rope_theta 1e8 and 32768 positions): no sliding window.
    Shape {
        name: "mistral-small-3",
        source: "mistralai/Mistral-Small-3.2-24B-Instruct-2506",
        arch: SynthArch::Mistral3,
        n_layer: 40,
        d_model: 5120,
        n_head: 32,
        n_head_kv: 8,
        head_dim: 128,
        d_ff: 32_768,
        vocab: 131_072,
        ctx: 131_072,
        rope_base: 1_000_000_000.0,
        rope_scaling: None,
        rms_eps: 1e-5,
        sliding_window: 0,
        sliding_window_pattern: 0,
        tied: false,
        vocab_kind: VocabKind::Tekken,
    },
    // Qwen/Qwen3-30B-A3B: 128 experts of width 768 (moe_intermediate_size), 8 per token;
    // `d_ff` is its config's intermediate_size, which the file carries but no layer uses.
    Shape {
        name: "qwen3-30b-a3b",
        source: "Qwen/Qwen3-30B-A3B",
        arch: SynthArch::Qwen3Moe,
        n_layer: 48,
        d_model: 2048,
        n_head: 32,
        n_head_kv: 4,
        head_dim: 128,
        d_ff: 6144,
        vocab: 151_936,
        ctx: 40_960,
        rope_base: 1_000_000.0,
        rope_scaling: None,
        rms_eps: 1e-6,
        sliding_window: 0,
        sliding_window_pattern: 0,
        tied: false,
        vocab_kind: VocabKind::Qwen3,
    },
    // openai/gpt-oss-20b: 32 experts of width 2880, 4 per token; 64 query heads of 64 (4096
    // wide against d 2880); even layers a 128-token window; YaRN 32 over 4096 (written with the
    // architecture's keys). Its o200k_harmony vocabulary's size and special ids, with our
    // synthetic BPE pieces.
    Shape {
        name: "gpt-oss-20b",
        source: "openai/gpt-oss-20b",
        arch: SynthArch::GptOss,
        n_layer: 24,
        d_model: 2880,
        n_head: 64,
        n_head_kv: 8,
        head_dim: 64,
        d_ff: 2880,
        vocab: 201_088,
        ctx: 131_072,
        rope_base: 150_000.0,
        rope_scaling: None,
        rms_eps: 1e-5,
        sliding_window: 128,
        sliding_window_pattern: 2,
        tied: false,
        vocab_kind: VocabKind::Harmony,
    },
    // openai/gpt-oss-120b: gpt-oss-20b's layer with 128 experts (4 per token) over 36 layers.
    Shape {
        name: "gpt-oss-120b",
        source: "openai/gpt-oss-120b",
        arch: SynthArch::GptOss,
        n_layer: 36,
        d_model: 2880,
        n_head: 64,
        n_head_kv: 8,
        head_dim: 64,
        d_ff: 2880,
        vocab: 201_088,
        ctx: 131_072,
        rope_base: 150_000.0,
        rope_scaling: None,
        rms_eps: 1e-5,
        sliding_window: 128,
        sliding_window_pattern: 2,
        tied: false,
        vocab_kind: VocabKind::Qwen3,
    },
    // mistralai/Mixtral-8x7B-v0.1: a `llama` file whose feed-forward is 8 experts of width
    // 14336, 2 per token; Llama 2's 32000-piece SentencePiece vocabulary.
    Shape {
        name: "mixtral-8x7b",
        source: "mistralai/Mixtral-8x7B-v0.1",
        arch: SynthArch::Mixtral,
        n_layer: 32,
        d_model: 4096,
        n_head: 32,
        n_head_kv: 8,
        head_dim: 128,
        d_ff: 14_336,
        vocab: 32_000,
        ctx: 32_768,
        rope_base: 1_000_000.0,
        rope_scaling: None,
        rms_eps: 1e-5,
        sliding_window: 0,
        sliding_window_pattern: 0,
        tied: false,
        vocab_kind: VocabKind::Spm,
    },
];

/// The mixture-of-experts shapes' experts: (shape, experts, used per token, expert width).
const EXPERTS: &[(&str, u32, u32, u32)] = &[
    ("qwen3-30b-a3b", 128, 8, 768),
    ("gpt-oss-20b", 32, 4, 2880),
    ("gpt-oss-120b", 128, 4, 2880),
    ("mixtral-8x7b", 8, 2, 14_336),
];

/// The shape called `name`.
pub fn shape(name: &str) -> Option<&'static Shape> {
    SHAPES.iter().find(|s| s.name == name)
}

/// Every shape name, for messages.
pub fn shape_names() -> Vec<&'static str> {
    SHAPES.iter().map(|s| s.name).collect()
}

impl Shape {
    /// (experts, experts used per token, one expert's width) of a mixture-of-experts shape.
    pub fn experts(&self) -> Option<(u32, u32, u32)> {
        EXPERTS
            .iter()
            .find(|e| e.0 == self.name)
            .map(|&(_, n, used, ff)| (n, used, ff))
    }

    /// Llama 3 RoPE divisors for each of the `head_dim / 2` rotated frequency pairs.
    pub fn rope_freqs(&self) -> Option<Vec<f32>> {
        let r = self.rope_scaling?;
        Some(llama3_rope_freqs(&r, self.rope_base, self.head_dim))
    }
}

/// Llama 3 RoPE divisors for each of the `head_dim / 2` rotated frequency pairs of a model
/// with RoPE base `rope_base` (the `rope_freqs.weight` tensor; `ringllm convert` writes it
/// from a config's `rope_scaling` too).
pub fn llama3_rope_freqs(r: &Llama3Rope, rope_base: f32, head_dim: u32) -> Vec<f32> {
    let dim = f64::from(head_dim);
    let low_wavelen = f64::from(r.original_ctx) / f64::from(r.low_freq_factor);
    let high_wavelen = f64::from(r.original_ctx) / f64::from(r.high_freq_factor);
    (0..head_dim / 2)
        .map(|i| {
            let freq = f64::from(rope_base).powf(-2.0 * f64::from(i) / dim);
            let wavelen = std::f64::consts::TAU / freq;
            let f = f64::from(r.factor);
            let div = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                f
            } else {
                let smooth = (f64::from(r.original_ctx) / wavelen - f64::from(r.low_freq_factor))
                    / f64::from(r.high_freq_factor - r.low_freq_factor);
                1.0 / ((1.0 - smooth) / f + smooth)
            };
            div as f32
        })
        .collect()
}

/// Weight types of the matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightMix {
    /// Every matrix in one type (with llama.cpp's fallback where rows are not whole blocks).
    Single(GgmlType),
    /// llama.cpp's `Q4_K_M`: Q4_K, with Q6_K for the output head (the embedding when tied)
    /// and for `attn_v` and `ffn_down` in the layers `use_more_bits` picks (the first and last
    /// eighth and every third between), Q5_K for a fused `attn_qkv`; rows that are not whole 256-blocks fall back to
    /// Q5_0 (for Q4_K) or Q8_0 (for Q6_K), as llama.cpp's `llama_tensor_get_type` does.
    Q4KM,
    /// llama.cpp's `Q2_K` (`LLAMA_FTYPE_MOSTLY_Q2_K`): Q2_K, with Q6_K for the output head
    /// (the embedding when tied), Q3_K for `attn_output` and `ffn_down`, and for `attn_v`
    /// Q4_K when four or more query heads share a KV head, else Q3_K. (llama.cpp's extra rules
    /// for 70B, Falcon and expert models do not apply to our shapes.)
    Q2K,
    /// llama.cpp's `Q3_K_M` (`LLAMA_FTYPE_MOSTLY_Q3_K_M`): Q3_K, with Q6_K for the head,
    /// Q4_K for `attn_output`, `attn_v` Q5_K in the first two layers and Q4_K after, and
    /// `ffn_down` Q5_K in the first sixteenth of the layers and Q4_K after. Rows that are not
    /// whole 256-blocks fall back to Q4_0 (for Q2_K and Q3_K) as in llama.cpp.
    Q3KM,
    /// llama.cpp's `IQ4_XS` (without an importance matrix): IQ4_XS, with Q6_K for the output
    /// head (the embedding when tied), Q5_K for `attn_v` when four or more query heads share a
    /// KV head, and Q5_K for `ffn_down` in the first eighth of the layers; rows that are not
    /// whole 256-blocks fall back to IQ4_NL (for IQ4_XS), Q5_1 (Q5_K) or Q8_0 (Q6_K).
    Iq4Xs,
    /// llama.cpp's `MXFP4_MOE` (gpt-oss's files): the experts in MXFP4, every other matrix
    /// in Q8_0.
    Mxfp4Moe,
}

impl WeightMix {
    /// `q4_k_m`, `q3_k_m`, `q2_k` (llama.cpp's presets: `q2_k` is its mix, as
    /// `llama-quantize` names it) or a single type's name (`q8_0`, `Q4_K`, `q3_k`, `f16`...).
    pub fn from_name(name: &str) -> Option<WeightMix> {
        if name.eq_ignore_ascii_case("q4_k_m") {
            return Some(WeightMix::Q4KM);
        }
        if name.eq_ignore_ascii_case("q3_k_m") {
            return Some(WeightMix::Q3KM);
        }
        if name.eq_ignore_ascii_case("q2_k") {
            return Some(WeightMix::Q2K);
        }
        if name.eq_ignore_ascii_case("iq4_xs") {
            return Some(WeightMix::Iq4Xs);
        }
        if name.eq_ignore_ascii_case("mxfp4_moe") {
            return Some(WeightMix::Mxfp4Moe);
        }
        GgmlType::from_name(name)
            .filter(|t| !matches!(t, GgmlType::Q8_1 | GgmlType::Q8_K))
            .map(WeightMix::Single)
    }

    pub fn name(self) -> String {
        match self {
            WeightMix::Single(t) => t.to_string(),
            WeightMix::Q4KM => "Q4_K_M".to_string(),
            WeightMix::Q2K => "Q2_K".to_string(),
            WeightMix::Q3KM => "Q3_K_M".to_string(),
            WeightMix::Iq4Xs => "IQ4_XS".to_string(),
            WeightMix::Mxfp4Moe => "MXFP4_MOE".to_string(),
        }
    }

    /// llama.cpp's `general.file_type` (`llama_ftype`) of this mix, when it has one.
    pub fn file_type(self) -> Option<u32> {
        Some(match self {
            WeightMix::Q4KM => 15,
            WeightMix::Q2K => 10,
            WeightMix::Q3KM => 12,
            WeightMix::Iq4Xs => 30,
            WeightMix::Mxfp4Moe => 38,
            WeightMix::Single(t) => match t {
                GgmlType::F32 => 0,
                GgmlType::F16 => 1,
                GgmlType::Q4_0 => 2,
                GgmlType::Q4_1 => 3,
                GgmlType::Q8_0 => 7,
                GgmlType::Q5_0 => 8,
                GgmlType::Q5_1 => 9,
                GgmlType::Q4_K => 14,
                GgmlType::Q5_K => 16,
                GgmlType::Q6_K => 18,
                GgmlType::BF16 => 32,
                GgmlType::Q2_K => 10,
                // llama.cpp's name for mostly-Q3_K is Q3_K_S.
                GgmlType::Q3_K => 11,
                GgmlType::IQ4_NL => 25,
                GgmlType::IQ4_XS => 30,
                GgmlType::MXFP4 => 38,
                GgmlType::Q8_1 | GgmlType::Q8_K => return None,
            },
        })
    }

    /// [`WeightMix::matrix_type`] in a model of `n_expert` experts (0: dense): llama.cpp gives
    /// an 8-expert model (Mixtral) Q8_0 attention K and V in every mix, and Q5_K attention
    /// output in the K-quant mixes.
    #[allow(clippy::too_many_arguments)]
    pub fn matrix_type_in(
        self,
        kind: TensorKind,
        il: u32,
        n_layer: u32,
        row_len: u32,
        tied: bool,
        n_gqa: u32,
        n_expert: u32,
    ) -> GgmlType {
        let quant_mix = matches!(
            self,
            WeightMix::Q4KM | WeightMix::Q3KM | WeightMix::Q2K | WeightMix::Iq4Xs
        );
        if n_expert == 8 && quant_mix {
            match kind {
                TensorKind::AttnK | TensorKind::AttnV => return fallback(GgmlType::Q8_0, row_len),
                TensorKind::AttnOutput => return fallback(GgmlType::Q5_K, row_len),
                _ => {}
            }
        }
        self.matrix_type(kind, il, n_layer, row_len, tied, n_gqa)
    }

    /// The type of matrix `kind` of layer `il` (of `n_layer`) whose rows hold `row_len`
    /// values; `tied`: the embedding is also the output head; `n_gqa`: query heads per KV
    /// head.
    pub fn matrix_type(
        self,
        kind: TensorKind,
        il: u32,
        n_layer: u32,
        row_len: u32,
        tied: bool,
        n_gqa: u32,
    ) -> GgmlType {
        let head = kind == TensorKind::Output || (tied && kind == TensorKind::TokenEmbd);
        let expert = matches!(
            kind,
            TensorKind::FfnGateExps | TensorKind::FfnUpExps | TensorKind::FfnDownExps
        );
        // The presets' rules for an expert matrix are those of its dense counterpart.
        let kind = match kind {
            TensorKind::FfnGateExps => TensorKind::FfnGate,
            TensorKind::FfnUpExps => TensorKind::FfnUp,
            TensorKind::FfnDownExps => TensorKind::FfnDown,
            k => k,
        };
        let want = match self {
            WeightMix::Mxfp4Moe if expert => GgmlType::MXFP4,
            WeightMix::Mxfp4Moe => GgmlType::Q8_0,
            WeightMix::Single(t) => t,
            WeightMix::Q4KM => {
                let more = matches!(kind, TensorKind::AttnV | TensorKind::FfnDown)
                    && use_more_bits(il, n_layer);
                if head || more {
                    GgmlType::Q6_K
                } else if kind == TensorKind::AttnQkv {
                    // llama.cpp gives a fused Q/K/V matrix Q5_K in Q4_K_M.
                    GgmlType::Q5_K
                } else {
                    GgmlType::Q4_K
                }
            }
            WeightMix::Q2K => match kind {
                _ if head => GgmlType::Q6_K,
                TensorKind::AttnV if n_gqa >= 4 => GgmlType::Q4_K,
                TensorKind::AttnV | TensorKind::AttnOutput | TensorKind::FfnDown => GgmlType::Q3_K,
                _ => GgmlType::Q2_K,
            },
            WeightMix::Q3KM => match kind {
                _ if head => GgmlType::Q6_K,
                TensorKind::AttnV if il < 2 => GgmlType::Q5_K,
                TensorKind::FfnDown if il < n_layer / 16 => GgmlType::Q5_K,
                TensorKind::AttnV | TensorKind::AttnOutput | TensorKind::FfnDown => GgmlType::Q4_K,
                _ => GgmlType::Q3_K,
            },
            WeightMix::Iq4Xs => {
                let v = kind == TensorKind::AttnV && n_gqa >= 4;
                let down = kind == TensorKind::FfnDown && il < n_layer / 8;
                if head {
                    GgmlType::Q6_K
                } else if v || down {
                    GgmlType::Q5_K
                } else {
                    GgmlType::IQ4_XS
                }
            }
        };
        fallback(want, row_len)
    }
}

/// llama.cpp's choice of the layers whose `attn_v` / `ffn_down` get more bits.
pub fn use_more_bits(il: u32, n_layer: u32) -> bool {
    let (i, n) = (i64::from(il), i64::from(n_layer));
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// `want`, or llama.cpp's replacement when `row_len` is not a whole number of its blocks.
fn fallback(want: GgmlType, row_len: u32) -> GgmlType {
    let fits = |t: GgmlType| (row_len as usize).is_multiple_of(t.block_size());
    if fits(want) {
        return want;
    }
    let next = match want {
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::Q4_0,
        GgmlType::IQ4_XS => GgmlType::IQ4_NL,
        _ => GgmlType::F16,
    };
    if fits(next) {
        next
    } else {
        GgmlType::F16
    }
}
