//! What the small `phi3` model (`debug synth --arch phi3`) has beyond the generic writer:
//! LongRoPE (its two factor tensors, the original context and the attention factor), Phi-3's
//! chat markup tokens and its published chat template.
//!
//! The numbers are chosen so that every Phi-3 path runs on short test prompts: the original
//! context (16) is below the 20-token prompts of the llama.cpp fixtures, so llama.cpp (whose
//! context is 256) and a runner sized to the prompt both pick the long factors, and a prompt
//! of at most 16 tokens in a 16-position context picks the short ones; the window (32) is
//! past those prompts (llama.cpp runs Phi-3 without its window) and within the 40-token prompts
//! of our own tests against the reference.

use super::{add_spm_tokenizer, vocabulary, SynthSpec, TOKEN_TYPE_CONTROL};
use crate::arch::MetaKey;
use crate::gguf::{GgufWriter, Value};

/// Sliding window of every layer.
pub(super) const WINDOW: u32 = 32;

/// `rope.scaling.original_context_length`: the context LongRoPE's short factors are for.
pub const ORIG_CTX: u32 = 16;

/// Phi-3's chat template as the model publishes it (tests/fixtures/templates/README.md).
pub const CHAT_TEMPLATE: &str =
    include_str!("../../../tests/fixtures/templates/microsoft-Phi-3.5-mini-instruct.jinja");

/// Phi-3's added tokens that its template and generation use, written as control tokens (as
/// llama.cpp's converter marks `special` added tokens) in the last ids of the vocabulary.
pub const SPECIALS: &[&str] = &[
    "<|endoftext|>",
    "<|assistant|>",
    "<|system|>",
    "<|end|>",
    "<|user|>",
];

/// The long and short LongRoPE divisors for `half` frequency pairs: short ones near 1, long
/// ones growing towards the low frequencies as the published 128k factors do.
pub fn rope_factors(half: u32) -> (Vec<f32>, Vec<f32>) {
    let x = |i: u32| i as f32 / half.max(1) as f32;
    let long = (0..half).map(|i| 1.0 + 15.0 * x(i) * x(i)).collect();
    let short = (0..half).map(|i| 1.0 + 0.1 * x(i)).collect();
    (long, short)
}

/// LongRoPE's attention factor for a context `ctx` trained from `orig`, as llama.cpp's
/// converter computes it from a Hugging Face config: `√(1 + ln(ctx/orig) / ln(orig))`.
pub fn attn_factor(ctx: u32, orig: u32) -> f32 {
    let scale = f64::from(ctx) / f64::from(orig);
    if scale <= 1.0 {
        return 1.0;
    }
    (1.0 + scale.ln() / f64::from(orig).ln()).sqrt() as f32
}

/// Phi-3's tokenizer: the small models' SentencePiece vocabulary with [`SPECIALS`] in its
/// last ids, no BOS added to a prompt (Phi-3's `tokenizer_config.json`: its template writes
/// no `<s>`), the `default` pre-tokenizer name llama.cpp's converter writes, the LongRoPE keys
/// and the chat template.
pub(super) fn add_tokenizer(w: &mut GgufWriter, s: &SynthSpec) {
    let mut vocab = vocabulary(s.vocab as usize);
    let n = vocab.len();
    for (slot, text) in vocab[n.saturating_sub(SPECIALS.len())..]
        .iter_mut()
        .zip(SPECIALS)
    {
        *slot = (text.to_string(), 0.0, TOKEN_TYPE_CONTROL);
    }
    add_spm_tokenizer(w, &vocab, false);
    w.add("tokenizer.ggml.pre", Value::Str("default".into()));
    let a = s.arch.name();
    let orig = ORIG_CTX.min(s.ctx);
    w.add(&MetaKey::RopeScalingOrigCtx.of(a), Value::U32(orig));
    w.add(
        &MetaKey::RopeScalingAttnFactor.of(a),
        Value::F32(attn_factor(s.ctx, orig)),
    );
    w.add(
        "tokenizer.chat_template",
        Value::Str(CHAT_TEMPLATE.to_string()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;
    use crate::synth::{synth_model, SynthArch};
    use crate::{Model, TensorKind};
    use ringllm_kernels::GgmlType;
    use std::sync::Arc;

    #[test]
    fn the_small_phi3_has_its_real_structure_and_loads() {
        let spec = SynthSpec::new(SynthArch::Phi3, GgmlType::Q8_0, 4);
        let bytes = synth_model(&spec).unwrap();
        let f = Arc::new(GgufFile::from_bytes(bytes).unwrap());
        assert_eq!(f.tensors().len(), spec.n_tensors());
        let (d, ff) = (u64::from(spec.d_model), u64::from(spec.d_ff));
        let qkv = u64::from((spec.n_head + 2 * spec.n_head_kv) * spec.head_dim);
        let dims = |n: &str| f.tensor(n).unwrap_or_else(|| panic!("no {n}")).dims.clone();
        assert_eq!(dims("blk.1.attn_qkv.weight"), [d, qkv]);
        assert_eq!(dims("blk.1.ffn_up.weight"), [d, 2 * ff]);
        assert!(f.tensor("blk.0.attn_q.weight").is_none());
        assert!(f.tensor("blk.0.ffn_gate.weight").is_none());
        let half = u64::from(spec.head_dim / 2);
        assert_eq!(dims("rope_factors_long.weight"), [half]);
        let md = f.metadata();
        assert_eq!(md.str("tokenizer.chat_template").unwrap(), CHAT_TEMPLATE);
        let toks = md.str_array("tokenizer.ggml.tokens").unwrap();
        assert_eq!(toks[toks.len() - 1], "<|user|>");

        let m = Model::load(Arc::clone(&f), &Default::default()).unwrap();
        let hp = &m.hp;
        assert!(hp.fused_proj && hp.sliding.iter().all(|s| *s));
        assert_eq!(hp.sliding_window, WINDOW as usize);
        assert_eq!(hp.rope_orig_ctx, ORIG_CTX as usize);
        // ln(256 / 16) / ln(16) = 1.
        assert!((hp.rope_attn_factor - 2f32.sqrt()).abs() < 1e-6);
        let (long, short) = m.rope_factors.as_ref().unwrap();
        assert_eq!((long.len(), short.len()), (half as usize, half as usize));
        assert!(long[half as usize - 1] > 10.0 && short[0] == 1.0);
        // The views cover the fused matrices' rows in order, without a gap.
        let l = &m.layers[1];
        let (q, kv) = (hp.q_dim(), hp.kv_dim());
        let (wk, wv) = (l.wk.as_ref().unwrap(), l.wv.as_ref().unwrap());
        assert_eq!((l.wq.n_out, wk.n_out, wv.n_out), (q, kv, kv));
        assert_eq!((l.gate.n_out, l.up.n_out), (hp.d_ff, hp.d_ff));
        let fused = f
            .tensor(&TensorKind::AttnQkv.gguf_name(Some(1)))
            .unwrap()
            .size as usize;
        assert_eq!(l.wq.bytes() + wk.bytes() + wv.bytes(), fused);
        let rows = |w: &crate::model::Weight| m.matrix(w).data.as_ptr() as usize;
        assert_eq!(rows(wk), rows(&l.wq) + l.wq.bytes());
        assert_eq!(rows(wv), rows(wk) + wk.bytes());
        assert_eq!(rows(&l.up), rows(&l.gate) + l.gate.bytes());
    }

    #[test]
    fn attention_factor_is_the_converters() {
        // Phi-3-mini-128k: 131072 from 4096, √(1 + ln 32 / ln 4096) = √(17/12).
        assert!((attn_factor(131_072, 4096) - (17.0f32 / 12.0).sqrt()).abs() < 1e-6);
        assert_eq!(attn_factor(4096, 4096), 1.0);
    }
}
