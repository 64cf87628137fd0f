//! The small synthetic models: their tensors, metadata and tokenizers.

use super::spm::{SPACE, TOKEN_TYPE_BYTE, TOKEN_TYPE_NORMAL};
use super::*;
use crate::gguf::GgufFile;
use std::collections::HashSet;

fn check(spec: &SynthSpec) {
    let bytes = synth_model(spec).unwrap();
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    assert_eq!(f.tensors().len(), spec.n_tensors());
    let md = f.metadata();
    let a = spec.arch.name();
    assert_eq!(md.str("general.architecture").unwrap(), a);
    assert_eq!(md.u32(&format!("{a}.block_count")).unwrap(), spec.n_layer);
    assert_eq!(
        md.u32(&format!("{a}.attention.key_length")).unwrap(),
        spec.head_dim
    );
    let toks = md.str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(toks.len(), spec.vocab as usize);
    assert_eq!(toks.iter().collect::<HashSet<_>>().len(), toks.len());
    match spec.arch.small_vocab().0 {
        VocabKind::Spm => check_spm(md, toks),
        VocabKind::Gemma => check_gemma(md, toks),
        _ => check_bpe(spec, md, toks),
    }

    let (d, v) = (u64::from(spec.d_model), u64::from(spec.vocab));
    let t = |n: &str| f.tensor(n).unwrap_or_else(|| panic!("missing {n}"));
    assert_eq!(t("token_embd.weight").dims, [d, v]);
    assert_eq!(t("token_embd.weight").ty, spec.weight_type);
    assert_eq!(t("output_norm.weight").dims, [d]);
    assert_eq!(f.tensor("output.weight").is_some(), !spec.is_tied());
    let last = spec.n_layer - 1;
    let qd = u64::from(spec.n_head * spec.head_dim);
    let kvd = u64::from(spec.n_head_kv * spec.head_dim);
    let ff = u64::from(spec.d_ff);
    assert_eq!(t(&format!("blk.{last}.attn_q.weight")).dims, [d, qd]);
    assert_eq!(t(&format!("blk.{last}.attn_k.weight")).dims, [d, kvd]);
    assert_eq!(t(&format!("blk.{last}.attn_v.weight")).dims, [d, kvd]);
    assert_eq!(t(&format!("blk.{last}.attn_output.weight")).dims, [qd, d]);
    assert_eq!(t(&format!("blk.{last}.ffn_gate.weight")).dims, [d, ff]);
    assert_eq!(t(&format!("blk.{last}.ffn_down.weight")).dims, [ff, d]);
    let norm = t(&format!("blk.{last}.attn_norm.weight"));
    assert_eq!(norm.ty, GgmlType::F32);
    let vals: Vec<f32> = f
        .tensor_data(norm)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mean = vals.iter().sum::<f32>() / vals.len() as f32;
    assert!((mean - 1.0).abs() < 0.05, "norm mean {mean}");
    if spec.arch.has_qk_norm() {
        let hd = u64::from(spec.head_dim);
        assert_eq!(t(&format!("blk.{last}.attn_k_norm.weight")).dims, [hd]);
    }
    if spec.arch == SynthArch::Gemma2 {
        assert_eq!(t(&format!("blk.{last}.post_ffw_norm.weight")).dims, [d]);
        assert!(f
            .tensor(&format!("blk.{last}.attn_q_norm.weight"))
            .is_none());
        let k = |s: &str| format!("gemma2.{s}");
        assert_eq!(
            md.u32(&k("attention.sliding_window")).unwrap(),
            spec.sliding_window
        );
        assert_eq!(md.f32(&k("attn_logit_softcapping")).unwrap(), 2.0);
        assert_eq!(md.f32(&k("final_logit_softcapping")).unwrap(), 6.0);
    } else if spec.arch == SynthArch::Qwen3 {
        assert_eq!(md.f32("qwen3.rope.freq_base").unwrap(), 1e6);
        assert!(f
            .tensor(&format!("blk.{last}.post_ffw_norm.weight"))
            .is_none());
        assert!(f.tensor(&format!("blk.{last}.attn_q.bias")).is_none());
    } else if spec.arch == SynthArch::Gemma3 {
        let hd = u64::from(spec.head_dim);
        assert_eq!(t(&format!("blk.{last}.attn_q_norm.weight")).dims, [hd]);
        assert_eq!(t(&format!("blk.{last}.post_ffw_norm.weight")).dims, [d]);
        assert_eq!(
            md.u32("gemma3.attention.sliding_window").unwrap(),
            spec.sliding_window
        );
        assert_eq!(md.f32("gemma3.rope.freq_base").unwrap(), 1e6);
    } else if spec.arch == SynthArch::Qwen2 {
        let bias = t(&format!("blk.{last}.attn_k.bias"));
        assert_eq!(
            (bias.dims.as_slice(), bias.ty),
            ([kvd].as_slice(), GgmlType::F32)
        );
        assert_eq!(t(&format!("blk.{last}.attn_q.bias")).dims, [qd]);
    } else {
        assert_eq!(md.u32("llama.vocab_size").unwrap(), spec.vocab);
        assert_eq!(md.u32("llama.rope.dimension_count").unwrap(), spec.head_dim);
    }
    // Deterministic per seed, different across seeds.
    assert_eq!(synth_model(spec).unwrap(), bytes);
    let mut other = spec.clone();
    other.seed ^= 1;
    assert_ne!(synth_model(&other).unwrap(), bytes);
}

fn check_spm(md: &crate::gguf::Metadata, toks: &[String]) {
    assert_eq!(toks[1], "<s>");
    assert_eq!(toks[3], "<0x00>");
    assert_eq!(toks[258], "<0xFF>");
    assert_eq!(toks[259], SPACE);
    let types = md.i32_array("tokenizer.ggml.token_type").unwrap();
    assert_eq!(types[100], TOKEN_TYPE_BYTE);
    assert_eq!(types[300], TOKEN_TYPE_NORMAL);
    let scores = md.f32_array("tokenizer.ggml.scores").unwrap();
    assert!(scores[260] > scores[261]);
    assert!(md.bool("tokenizer.ggml.add_bos_token").unwrap());
}

/// Gemma's SentencePiece vocabulary: its specials at Gemma's ids, then the bytes and
/// pieces, and Gemma 2's chat template.
fn check_gemma(md: &crate::gguf::Metadata, toks: &[String]) {
    assert_eq!(md.str("tokenizer.ggml.model").unwrap(), "llama");
    assert_eq!(&toks[..3], ["<pad>", "<eos>", "<bos>"]);
    assert_eq!(toks[6], "<end_of_turn>");
    assert_eq!(toks[7], "<0x00>");
    assert_eq!(toks[7 + 256], SPACE);
    assert_eq!(md.u32("tokenizer.ggml.bos_token_id").unwrap(), 2);
    assert_eq!(md.u32("tokenizer.ggml.eos_token_id").unwrap(), 1);
    let types = md.i32_array("tokenizer.ggml.token_type").unwrap();
    assert_eq!(types[..7], [3, 3, 3, 2, 3, 3, 3]);
    assert_eq!(types[7], TOKEN_TYPE_BYTE);
    assert!(!md.bool("tokenizer.ggml.add_space_prefix").unwrap());
    let template = md.str("tokenizer.chat_template").unwrap();
    assert!(template.contains("<start_of_turn>model"));
}

/// A byte-level BPE vocabulary with the family's added tokens where its files have them,
/// and the family's chat template.
fn check_bpe(spec: &SynthSpec, md: &crate::gguf::Metadata, toks: &[String]) {
    assert_eq!(md.str("tokenizer.ggml.model").unwrap(), "gpt2");
    let kind = spec.arch.small_vocab().0;
    let regular = (spec.vocab - kind.tail()) as usize;
    let merges = md.str_array("tokenizer.ggml.merges").unwrap();
    assert_eq!(merges.len(), regular - 256);
    let template = md.str("tokenizer.chat_template").unwrap();
    if spec.arch == SynthArch::Qwen3 {
        assert_eq!(md.str("tokenizer.ggml.pre").unwrap(), "qwen2");
        assert_eq!(toks[regular], "<|endoftext|>");
        assert_eq!(toks[regular + 2], "<|im_end|>");
        assert_eq!(toks[regular + 25], "</think>");
        let eos = md.u32("tokenizer.ggml.eos_token_id").unwrap() as usize;
        assert_eq!(toks[eos], "<|im_end|>");
        assert!(!md.bool("tokenizer.ggml.add_bos_token").unwrap());
        assert!(template.contains("<|im_start|>assistant"));
    }
}

#[test]
fn qwen3_reads_back_with_expected_tensors() {
    let spec = SynthSpec::new(SynthArch::Qwen3, GgmlType::Q8_0, 4);
    assert_eq!(spec.n_tensors(), 3 + 11 * 2);
    check(&spec);
    let mut small = spec.clone();
    small.vocab = 1000;
    assert!(synth_model(&small)
        .unwrap_err()
        .to_string()
        .contains("smaller than 1061"));
}

#[test]
fn gemma2_reads_back_with_expected_tensors() {
    let spec = SynthSpec::new(SynthArch::Gemma2, GgmlType::Q8_0, 4);
    assert_eq!(spec.n_tensors(), 2 + 11 * 2);
    check(&spec);
}

#[test]
fn llama_reads_back_with_expected_tensors() {
    let spec = SynthSpec::new(SynthArch::Llama, GgmlType::F32, 7);
    assert_eq!(spec.n_tensors(), 3 + 9 * 2);
    check(&spec);
    let mut tied = SynthSpec::new(SynthArch::Llama, GgmlType::F16, 8);
    tied.tied_embeddings = true;
    tied.n_layer = 3;
    tied.vocab = 1000;
    check(&tied);
}

#[test]
fn gemma3_reads_back_with_expected_tensors() {
    let spec = SynthSpec::new(SynthArch::Gemma3, GgmlType::BF16, 9);
    assert_eq!(spec.n_tensors(), 2 + 13 * 2);
    check(&spec);
}

#[test]
fn qwen2_reads_back_with_its_biases() {
    let spec = SynthSpec::new(SynthArch::Qwen2, GgmlType::Q8_0, 10);
    assert_eq!(spec.n_tensors(), 3 + 12 * 2);
    check(&spec);
    assert_eq!(SynthArch::from_name("qwen2"), Some(SynthArch::Qwen2));
    assert_eq!(SynthArch::from_name("gpt2"), None);
}

#[test]
fn matrix_values_have_the_requested_scale() {
    let spec = SynthSpec::new(SynthArch::Llama, GgmlType::F32, 1);
    let f = GgufFile::from_bytes(synth_model(&spec).unwrap()).unwrap();
    let t = f.tensor("blk.0.ffn_up.weight").unwrap();
    let vals: Vec<f32> = f
        .tensor_data(t)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let var = vals.iter().map(|x| x * x).sum::<f32>() / vals.len() as f32;
    let want = 1.0 / spec.d_model as f32;
    assert!(
        (var / want - 1.0).abs() < 0.05,
        "variance {var}, want {want}"
    );
}

#[test]
fn bad_specs_are_refused() {
    let mut s = SynthSpec::new(SynthArch::Llama, GgmlType::F32, 0);
    s.vocab = 100;
    assert!(synth_model(&s)
        .unwrap_err()
        .to_string()
        .contains("vocab 100"));
    let mut s = SynthSpec::new(SynthArch::Llama, GgmlType::F32, 0);
    s.n_head_kv = 3;
    assert!(synth_model(&s).is_err());
    let s = SynthSpec::new(SynthArch::Llama, GgmlType::Q8_K, 0);
    assert!(synth_model(&s).is_err());
}

#[test]
fn matrix_type_falls_back_when_rows_are_not_whole_blocks() {
    assert_eq!(matrix_type(GgmlType::Q4_K, 256), GgmlType::Q4_K);
    assert_eq!(matrix_type(GgmlType::Q4_K, 640), GgmlType::Q8_0);
    assert_eq!(matrix_type(GgmlType::Q4_K, 100), GgmlType::F32);
}
