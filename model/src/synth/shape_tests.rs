//! Tests of the real-size shapes: the table, the Q4_K_M mix, the streamed writer against the
//! in-memory one, and what the loader reads back.

use super::*;
use crate::gguf::GgufFile;
use crate::{LoadOptions, Model};
use ringllm_kernels::GgmlType;
use std::sync::Arc;

fn spec(name: &str, mix: WeightMix) -> ShapeSpec {
    ShapeSpec::new(shape(name).unwrap(), mix, 1)
}

/// The types `spec` gives each tensor, by name.
fn types(spec: &ShapeSpec) -> std::collections::HashMap<String, GgmlType> {
    shape_tensors(spec)
        .into_iter()
        .map(|(n, _, t)| (n, t))
        .collect()
}

fn total_bytes(spec: &ShapeSpec) -> u64 {
    shape_tensors(spec)
        .iter()
        .map(|(_, dims, ty)| {
            dims.iter().product::<u64>() / ty.block_size() as u64 * ty.type_size() as u64
        })
        .sum()
}

/// A shape small enough to build in memory, of `arch`'s layout.
fn small(name: &str, n_layer: u32) -> ShapeSpec {
    let mut s = spec(name, WeightMix::Q4KM);
    let sh = &mut s.shape;
    sh.n_layer = n_layer;
    sh.d_model = 256;
    sh.n_head = 4;
    sh.n_head_kv = if sh.arch == SynthArch::Gemma3 { 1 } else { 2 };
    sh.head_dim = 64;
    sh.d_ff = 512;
    sh.vocab = sh.vocab_kind.min_vocab() + 11;
    sh.sliding_window = sh.sliding_window.min(8);
    s
}

#[test]
fn shape_table_holds_the_published_hyper_parameters() {
    let names: Vec<&str> = SHAPES.iter().map(|s| s.name).collect();
    assert_eq!(
        names[..5],
        ["tiny", "llama3-1b", "llama3-8b", "gemma3-1b", "qwen2-7b"]
    );
    let unique: std::collections::HashSet<&str> = names.iter().copied().collect();
    assert_eq!(unique.len(), names.len(), "{names:?}");
    let l8 = shape("llama3-8b").unwrap();
    assert_eq!(
        (
            l8.n_layer,
            l8.d_model,
            l8.n_head,
            l8.n_head_kv,
            l8.head_dim,
            l8.d_ff,
            l8.vocab
        ),
        (32, 4096, 32, 8, 128, 14336, 128_256)
    );
    assert_eq!(
        (l8.rope_base, l8.rms_eps, l8.tied),
        (500_000.0, 1e-5, false)
    );
    let l1 = shape("llama3-1b").unwrap();
    assert_eq!(
        (
            l1.n_layer,
            l1.d_model,
            l1.n_head,
            l1.n_head_kv,
            l1.d_ff,
            l1.tied
        ),
        (16, 2048, 32, 8, 8192, true)
    );
    assert_eq!(l1.rope_scaling.unwrap().factor, 32.0);
    let g = shape("gemma3-1b").unwrap();
    assert_eq!(
        (
            g.n_layer,
            g.d_model,
            g.n_head,
            g.n_head_kv,
            g.head_dim,
            g.d_ff,
            g.vocab
        ),
        (26, 1152, 4, 1, 256, 6912, 262_144)
    );
    assert_eq!((g.sliding_window, g.sliding_window_pattern), (512, 6));
    let q = shape("qwen2-7b").unwrap();
    assert_eq!(
        (
            q.n_layer,
            q.d_model,
            q.n_head,
            q.n_head_kv,
            q.head_dim,
            q.d_ff,
            q.vocab
        ),
        (28, 3584, 28, 4, 128, 18944, 152_064)
    );
    for name in ["gemma4-tiny", "gemma4-e2b", "gemma4-e4b", "gemma4-31b"] {
        assert!(names.contains(&name), "{name}");
    }
    let e2b = shape("gemma4-e2b").unwrap();
    assert_eq!(
        (
            e2b.n_layer,
            e2b.d_model,
            e2b.n_head,
            e2b.n_head_kv,
            e2b.head_dim,
            e2b.d_ff
        ),
        (35, 1536, 8, 1, 256, 6144)
    );
    let g4 = super::gemma4::shape_dims("gemma4-e2b").unwrap();
    assert_eq!(
        (
            g4.head_dim_full,
            g4.period,
            g4.shared_kv_layers,
            g4.ple_dim,
            g4.double_wide
        ),
        (512, 5, 20, 256, true)
    );
    for name in ["gemma4-e4b", "gemma4-31b"] {
        assert!(super::gemma4::shape_dims(name).is_some(), "{name}");
    }
    for s in SHAPES {
        assert!(s.n_head.is_multiple_of(s.n_head_kv), "{}", s.name);
        assert!(!s.source.is_empty());
        // Gemma and Qwen3 set their head size apart from d_model / n_head.
        if matches!(s.arch, SynthArch::Llama | SynthArch::Qwen2) {
            assert_eq!(s.n_head * s.head_dim, s.d_model, "{}", s.name);
        }
        assert!(s.vocab >= s.vocab_kind.min_vocab());
    }
    assert!(shape("llama3-70b").is_none());
    let p = shape("phi3-mini").unwrap();
    assert_eq!(
        (
            p.n_layer,
            p.d_model,
            p.n_head,
            p.n_head_kv,
            p.head_dim,
            p.d_ff,
            p.vocab,
            p.sliding_window
        ),
        (32, 3072, 32, 32, 96, 8192, 32_064, 2047)
    );
}

#[test]
fn phi3_mini_is_fused_and_its_q4_k_m_mix_is_llamacpps() {
    let s = spec("phi3-mini", WeightMix::Q4KM);
    let t = types(&s);
    assert_eq!(t["blk.0.attn_qkv.weight"], GgmlType::Q5_K);
    assert_eq!(t["blk.5.ffn_up.weight"], GgmlType::Q4_K);
    assert_eq!(t["blk.0.ffn_down.weight"], GgmlType::Q6_K);
    assert!(!t.contains_key("blk.0.attn_q.weight") && !t.contains_key("blk.0.ffn_gate.weight"));
    let dims: std::collections::HashMap<String, Vec<u64>> = shape_tensors(&s)
        .into_iter()
        .map(|(n, d, _)| (n, d))
        .collect();
    assert_eq!(dims["blk.31.attn_qkv.weight"], [3072, 3 * 3072]);
    assert_eq!(dims["blk.31.ffn_up.weight"], [3072, 2 * 8192]);
    // About 2.3 GB as llama.cpp's Phi-3-mini Q4_K_M files are.
    let gb = total_bytes(&s) as f64 / 1e9;
    assert!((2.0..2.6).contains(&gb), "{gb} GB");
    // A cut of it loads: every layer a window layer, its fused matrices split into views.
    let small = small("phi3-mini", 2);
    let m = Model::load(
        Arc::new(GgufFile::from_bytes(shape_model_bytes(&small).unwrap()).unwrap()),
        &LoadOptions::default(),
    )
    .unwrap();
    assert!(m.hp.fused_proj && m.hp.sliding == [true, true]);
    assert_eq!(m.hp.sliding_window, 8);
    assert_eq!(
        m.layers[1].wv.as_ref().map(|w| w.n_out),
        Some(m.hp.kv_dim())
    );
}

#[test]
fn llama3_rope_factors_ramp_from_one_to_the_scaling_factor() {
    let f = shape("llama3-8b").unwrap().rope_freqs().unwrap();
    assert_eq!(f.len(), 64);
    assert_eq!(f[0], 1.0);
    assert_eq!(f[63], 8.0);
    assert!(f.windows(2).all(|w| w[0] <= w[1]));
    assert!(f.iter().any(|&x| x > 1.0 && x < 8.0), "no smooth ramp");
    assert!(shape("qwen2-7b").unwrap().rope_freqs().is_none());
}

#[test]
fn q4_k_m_mix_follows_llama_cpp() {
    // The layers llama.cpp gives more bits, for 32 layers: the first 4, the last 4, and
    // every third from 6.
    let more: Vec<u32> = (0..32).filter(|&i| use_more_bits(i, 32)).collect();
    assert_eq!(
        more,
        [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    );
    let t = types(&spec("llama3-8b", WeightMix::Q4KM));
    assert_eq!(t["token_embd.weight"], GgmlType::Q4_K);
    assert_eq!(t["output.weight"], GgmlType::Q6_K);
    assert_eq!(t["rope_freqs.weight"], GgmlType::F32);
    for il in 0..32 {
        let b = |n: &str| t[&format!("blk.{il}.{n}.weight")];
        let want = if more.contains(&il) {
            GgmlType::Q6_K
        } else {
            GgmlType::Q4_K
        };
        assert_eq!(b("attn_v"), want, "layer {il}");
        assert_eq!(b("ffn_down"), want, "layer {il}");
        for n in ["attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"] {
            assert_eq!(b(n), GgmlType::Q4_K, "layer {il} {n}");
        }
        assert_eq!(b("attn_norm"), GgmlType::F32);
    }
    // Tied: the embedding is the head, Q6_K.
    let t = types(&spec("llama3-1b", WeightMix::Q4KM));
    assert_eq!(t["token_embd.weight"], GgmlType::Q6_K);
    assert!(!t.contains_key("output.weight"));
    // Gemma 3 1B: rows of 1152 are not whole 256-blocks: Q4_K falls back to Q5_0, Q6_K to
    // Q8_0; rows of 1024 (attn_output) and 6912 (ffn_down) keep the K-quants.
    let t = types(&spec("gemma3-1b", WeightMix::Q4KM));
    assert_eq!(t["token_embd.weight"], GgmlType::Q8_0);
    assert_eq!(t["blk.0.attn_q.weight"], GgmlType::Q5_0);
    assert_eq!(t["blk.0.attn_v.weight"], GgmlType::Q8_0);
    assert_eq!(t["blk.4.attn_v.weight"], GgmlType::Q5_0);
    assert_eq!(t["blk.0.attn_output.weight"], GgmlType::Q4_K);
    assert_eq!(t["blk.0.ffn_down.weight"], GgmlType::Q6_K);
    assert_eq!(t["blk.4.ffn_down.weight"], GgmlType::Q4_K);
    assert_eq!(t["blk.0.post_ffw_norm.weight"], GgmlType::F32);
    // Qwen 2: biases in F32.
    let t = types(&spec("qwen2-7b", WeightMix::Q4KM));
    assert_eq!(t["blk.3.attn_k.bias"], GgmlType::F32);
    assert_eq!(t["output.weight"], GgmlType::Q6_K);
    // One type for every matrix, with the same fallback.
    let t = types(&spec("llama3-8b", WeightMix::Single(GgmlType::Q8_0)));
    assert!(t
        .iter()
        .all(|(n, ty)| *ty == GgmlType::Q8_0 || (*ty == GgmlType::F32 && !n.contains("attn_q."))));
    let t = types(&spec("gemma3-1b", WeightMix::Single(GgmlType::Q4_K)));
    assert_eq!(t["blk.0.ffn_up.weight"], GgmlType::Q5_0);
    assert_eq!(WeightMix::from_name("Q4_K_M"), Some(WeightMix::Q4KM));
    assert_eq!(
        WeightMix::from_name("q6_k"),
        Some(WeightMix::Single(GgmlType::Q6_K))
    );
    assert_eq!(WeightMix::from_name("q8_k"), None);
}

#[test]
fn q4_k_m_sizes_match_the_published_files() {
    // llama.cpp's Llama-3.1-8B Q4_K_M is 4.92 GB, Llama-3.2-1B Q4_K_M 0.81 GB, Gemma 3 1B
    // 0.81 GB, Qwen2-7B 4.68 GB (the tensor data; headers add a few MB).
    let gb = |n: &str| total_bytes(&spec(n, WeightMix::Q4KM)) as f64 / 1e9;
    let near = |x: f64, want: f64| (x / want - 1.0).abs() < 0.03;
    assert!(near(gb("llama3-8b"), 4.92), "llama3-8b {}", gb("llama3-8b"));
    assert!(near(gb("llama3-1b"), 0.81), "llama3-1b {}", gb("llama3-1b"));
    assert!(near(gb("gemma3-1b"), 0.81), "gemma3-1b {}", gb("gemma3-1b"));
    assert!(near(gb("qwen2-7b"), 4.68), "qwen2-7b {}", gb("qwen2-7b"));
}

#[test]
fn streamed_file_equals_the_in_memory_one_and_reads_back() {
    for s in [
        spec("tiny", WeightMix::Q4KM),
        spec("tiny", WeightMix::Single(GgmlType::F16)),
        small("gemma3-1b", 7),
        small("qwen2-7b", 2),
        small("llama3-1b", 3),
        small("gemma4-e2b", 10),
        small("gemma4-31b", 6),
    ] {
        let what = format!("{} {}", s.shape.name, s.mix.name());
        let mut streamed = Vec::new();
        let n = write_shape_model(&s, &mut streamed).unwrap();
        assert_eq!(n, streamed.len() as u64, "{what}");
        assert_eq!(streamed, shape_model_bytes(&s).unwrap(), "{what}");

        let f = GgufFile::from_bytes(streamed.clone()).unwrap();
        let planned = shape_tensors(&s);
        assert_eq!(f.tensors().len(), planned.len(), "{what}");
        let mut end = 0;
        for (t, (name, dims, ty)) in f.tensors().iter().zip(&planned) {
            assert_eq!((&t.name, &t.dims, t.ty), (name, dims, *ty), "{what}");
            assert_eq!(f.tensor_data(t).len() as u64, t.size, "{what} {name}");
            assert!(t.offset + t.size <= streamed.len() as u64, "{what} {name}");
            assert!(
                t.offset >= end,
                "{what} {name} overlaps the previous tensor"
            );
            end = t.offset + t.size;
        }
        let m = Model::load(Arc::new(f), &LoadOptions::default()).unwrap();
        assert_eq!(m.hp.n_layer, s.shape.n_layer as usize, "{what}");
        assert_eq!(m.hp.vocab, s.shape.vocab as usize, "{what}");
        assert_eq!(
            m.rope_freqs.is_some(),
            s.shape.rope_scaling.is_some() || s.shape.arch == SynthArch::Gemma4
        );
        if s.shape.name == "gemma4-e2b" {
            // 10 of 35 layers: 5 shared-KV layers (20 of 35 in proportion), the window layers
            // four in five, per-layer embeddings.
            let shared = (0..10).filter(|&il| m.hp.kv_source(il).is_some()).count();
            assert_eq!(shared, 5, "{what}");
            assert_eq!(m.hp.sliding.iter().filter(|&&s| s).count(), 8, "{what}");
            assert_eq!((m.hp.ple_dim, m.hp.head_dim_of(4)), (256, 512), "{what}");
        }
        if s.shape.name == "gemma4-31b" {
            // K = V on the full-attention layers.
            assert!(
                m.layers[5].wv.is_none() && m.layers[0].wv.is_some(),
                "{what}"
            );
        }
        if s.shape.arch == SynthArch::Gemma3 {
            // Readers derive the 5:1 local/global pattern from the window alone.
            let want: Vec<bool> = (0..7).map(|il| (il + 1) % 6 != 0).collect();
            assert_eq!(m.hp.sliding, want);
        }
        assert!(m.hp.qkv_bias == (s.shape.arch == SynthArch::Qwen2));

        // Deterministic per seed, different across seeds.
        let mut again = Vec::new();
        write_shape_model(&s, &mut again).unwrap();
        assert_eq!(again, streamed);
        let mut other = s.clone();
        other.seed ^= 1;
        let mut b = Vec::new();
        write_shape_model(&other, &mut b).unwrap();
        assert_ne!(b, streamed);
    }
}

#[test]
fn matrix_values_are_finite_with_the_requested_scale() {
    let s = spec("tiny", WeightMix::Q4KM);
    let f = GgufFile::from_bytes(shape_model_bytes(&s).unwrap()).unwrap();
    for name in [
        "blk.1.ffn_up.weight",
        "blk.1.ffn_down.weight",
        "output.weight",
    ] {
        let t = f.tensor(name).unwrap();
        let mut v = vec![0f32; t.n_elements() as usize];
        (ringllm_kernels::reference(t.ty).dequantize)(f.tensor_data(t), &mut v);
        assert!(v.iter().all(|x| x.is_finite()), "{name}");
        let var = v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32;
        let want = 1.0 / t.dims[0] as f32;
        assert!(
            (var / want - 1.0).abs() < 0.15,
            "{name}: variance {var}, want {want}"
        );
        // Rows differ (blocks are picked per position, not repeated).
        let row = t.dims[0] as usize;
        assert_ne!(v[..row], v[row..2 * row], "{name}");
    }
}

#[test]
fn bad_shape_requests_are_refused() {
    let mut s = spec("tiny", WeightMix::Q4KM);
    s.shape.n_layer = 0;
    assert!(write_shape_model(&s, Vec::new()).is_err());
    let mut s = spec("llama3-8b", WeightMix::Q4KM);
    s.shape.vocab = 300;
    let e = write_shape_model(&s, Vec::new()).unwrap_err().to_string();
    assert!(e.contains("vocabulary 300"), "{e}");
    let s = spec("tiny", WeightMix::Single(GgmlType::Q8_K));
    assert!(write_shape_model(&s, Vec::new()).is_err());
}

/// Runs `spec`'s model on a few tokens; returns the last position's logits.
fn logits_of(spec: &ShapeSpec, tokens: &[u32]) -> Vec<f32> {
    let f = GgufFile::from_bytes(shape_model_bytes(spec).unwrap()).unwrap();
    let m = Arc::new(Model::load(Arc::new(f), &LoadOptions::default()).unwrap());
    let (d, vocab) = (m.hp.d_model, m.hp.vocab);
    let n = tokens.len();
    let mut r = crate::Runner::new(m, 1, n, n);
    let mut kv = r.new_cache(n, crate::KvType::F32);
    let mut x = vec![0f32; n * d];
    r.embed(tokens, &mut x).unwrap();
    r.layers(&mut x, n, &mut kv, None).unwrap();
    r.final_norm(&mut x, n).unwrap();
    let mut out = vec![0f32; vocab];
    r.logits(&x[(n - 1) * d..], 1, &mut out).unwrap();
    out
}

#[test]
fn activations_stay_sane_through_many_layers() {
    // The scales keep the logits O(1) however deep the model: 40 layers of each layout.
    for name in ["tiny", "gemma3-1b", "qwen2-7b", "gemma4-e2b", "gemma4-31b"] {
        let mut s = if name == "tiny" {
            spec(name, WeightMix::Q4KM)
        } else {
            small(name, 40)
        };
        s.shape.n_layer = 40;
        let l = logits_of(&s, &[5, 77, 300, 12, 200]);
        assert!(l.iter().all(|v| v.is_finite()), "{name}: non-finite logits");
        let rms = (l.iter().map(|v| v * v).sum::<f32>() / l.len() as f32).sqrt();
        assert!((0.3..3.0).contains(&rms), "{name}: logit rms {rms}");
    }
}

#[test]
fn q2_k_and_q3_k_m_mixes_follow_llama_cpp() {
    // Llama 3.1 8B: 32 query heads on 8 KV heads (n_gqa 4), untied.
    let t = types(&spec("llama3-8b", WeightMix::Q2K));
    assert_eq!(t["token_embd.weight"], GgmlType::Q2_K);
    assert_eq!(t["output.weight"], GgmlType::Q6_K);
    for il in 0..32 {
        let b = |n: &str| t[&format!("blk.{il}.{n}.weight")];
        assert_eq!(b("attn_v"), GgmlType::Q4_K, "layer {il}");
        assert_eq!(b("attn_output"), GgmlType::Q3_K, "layer {il}");
        assert_eq!(b("ffn_down"), GgmlType::Q3_K, "layer {il}");
        for n in ["attn_q", "attn_k", "ffn_gate", "ffn_up"] {
            assert_eq!(b(n), GgmlType::Q2_K, "layer {il} {n}");
        }
    }
    // Qwen 2 7B: 28 on 4 (n_gqa 7); Gemma 3 1B: 4 on 1 but rows of 1152 fall back to Q4_0.
    let t = types(&spec("qwen2-7b", WeightMix::Q2K));
    assert_eq!(t["blk.0.attn_v.weight"], GgmlType::Q4_K);
    let t = types(&spec("gemma3-1b", WeightMix::Q2K));
    assert_eq!(t["token_embd.weight"], GgmlType::Q8_0);
    assert_eq!(t["blk.0.attn_q.weight"], GgmlType::Q4_0);
    assert_eq!(t["blk.0.attn_output.weight"], GgmlType::Q3_K);
    assert_eq!(t["blk.0.ffn_down.weight"], GgmlType::Q3_K);

    let t = types(&spec("llama3-8b", WeightMix::Q3KM));
    assert_eq!(t["token_embd.weight"], GgmlType::Q3_K);
    assert_eq!(t["output.weight"], GgmlType::Q6_K);
    for il in 0..32 {
        let b = |n: &str| t[&format!("blk.{il}.{n}.weight")];
        let v = if il < 2 {
            GgmlType::Q5_K
        } else {
            GgmlType::Q4_K
        };
        assert_eq!(b("attn_v"), v, "layer {il}");
        let down = if il < 2 {
            GgmlType::Q5_K
        } else {
            GgmlType::Q4_K
        };
        assert_eq!(b("ffn_down"), down, "layer {il}");
        assert_eq!(b("attn_output"), GgmlType::Q4_K, "layer {il}");
        for n in ["attn_q", "attn_k", "ffn_gate", "ffn_up"] {
            assert_eq!(b(n), GgmlType::Q3_K, "layer {il} {n}");
        }
    }
    // Tied: the embedding is the head.
    let t = types(&spec("llama3-1b", WeightMix::Q3KM));
    assert_eq!(t["token_embd.weight"], GgmlType::Q6_K);
    assert_eq!(t["blk.0.ffn_down.weight"], GgmlType::Q5_K);
    assert_eq!(t["blk.1.ffn_down.weight"], GgmlType::Q4_K);

    assert_eq!(WeightMix::from_name("Q3_K_M"), Some(WeightMix::Q3KM));
    assert_eq!(WeightMix::from_name("q2_k"), Some(WeightMix::Q2K));
    assert_eq!(
        WeightMix::from_name("q3_k"),
        Some(WeightMix::Single(GgmlType::Q3_K))
    );
    assert_eq!(WeightMix::Q2K.file_type(), Some(10));
    assert_eq!(WeightMix::Q3KM.file_type(), Some(12));
    // bartowski's Meta-Llama-3.1-8B-Instruct files: Q3_K_M 4.02 GB, Q2_K 3.18 GB.
    let gb = |mix| total_bytes(&spec("llama3-8b", mix)) as f64 / 1e9;
    let near = |x: f64, want: f64| (x / want - 1.0).abs() < 0.03;
    assert!(near(gb(WeightMix::Q3KM), 4.02), "{}", gb(WeightMix::Q3KM));
    assert!(near(gb(WeightMix::Q2K), 3.18), "{}", gb(WeightMix::Q2K));
}

#[test]
fn iq4_xs_mix_follows_llama_cpp() {
    // Llama 3.1 8B: 32 query heads over 8 KV heads (4 per KV head): attn_v in Q5_K; ffn_down
    // in Q5_K for the first 32 / 8 = 4 layers; the head in Q6_K; the rest IQ4_XS.
    let t = types(&spec("llama3-8b", WeightMix::Iq4Xs));
    assert_eq!(t["token_embd.weight"], GgmlType::IQ4_XS);
    assert_eq!(t["output.weight"], GgmlType::Q6_K);
    for il in 0..32 {
        let b = |n: &str| t[&format!("blk.{il}.{n}.weight")];
        assert_eq!(b("attn_v"), GgmlType::Q5_K, "layer {il}");
        let down = if il < 4 {
            GgmlType::Q5_K
        } else {
            GgmlType::IQ4_XS
        };
        assert_eq!(b("ffn_down"), down, "layer {il}");
        for n in ["attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"] {
            assert_eq!(b(n), GgmlType::IQ4_XS, "layer {il} {n}");
        }
    }
    // Tied head: the embedding is Q6_K.
    let t = types(&spec("llama3-1b", WeightMix::Iq4Xs));
    assert_eq!(t["token_embd.weight"], GgmlType::Q6_K);
    // Gemma 3 1B: 4 query heads over 1 KV head; rows of 1152 fall back to IQ4_NL (IQ4_XS),
    // Q5_1 (Q5_K) and Q8_0 (Q6_K).
    let t = types(&spec("gemma3-1b", WeightMix::Iq4Xs));
    assert_eq!(t["token_embd.weight"], GgmlType::Q8_0);
    assert_eq!(t["blk.0.attn_q.weight"], GgmlType::IQ4_NL);
    assert_eq!(t["blk.5.attn_v.weight"], GgmlType::Q5_1);
    assert_eq!(t["blk.0.attn_output.weight"], GgmlType::IQ4_XS);
    assert_eq!(WeightMix::from_name("IQ4_XS"), Some(WeightMix::Iq4Xs));
    assert_eq!(
        WeightMix::from_name("iq4_nl"),
        Some(WeightMix::Single(GgmlType::IQ4_NL))
    );
    assert_eq!(WeightMix::Iq4Xs.file_type(), Some(30));
}

#[test]
fn qwen3_shapes_hold_the_published_hyper_parameters() {
    // (name, layers, d, heads, kv heads, ffn, tied): Qwen/Qwen3-*'s config.json; every size
    // has head_dim 128, vocab 151936, rope_theta 1e6, rms_norm_eps 1e-6, 40960 positions.
    let want = [
        ("qwen3-0.6b", 28, 1024, 16, 8, 3072, true),
        ("qwen3-8b", 36, 4096, 32, 8, 12_288, false),
        ("qwen3-14b", 40, 5120, 40, 8, 17_408, false),
        ("qwen3-32b", 64, 5120, 64, 8, 25_600, false),
    ];
    for (name, n_layer, d, h, kv, ff, tied) in want {
        let s = shape(name).unwrap();
        assert_eq!(s.arch, SynthArch::Qwen3, "{name}");
        assert_eq!(
            (s.n_layer, s.d_model, s.n_head, s.n_head_kv, s.d_ff, s.tied),
            (n_layer, d, h, kv, ff, tied),
            "{name}"
        );
        assert_eq!(
            (s.head_dim, s.vocab, s.ctx, s.rope_base, s.rms_eps),
            (128, 151_936, 40_960, 1e6, 1e-6),
            "{name}"
        );
        assert_eq!(s.vocab_kind, VocabKind::Qwen3);
    }
}

#[test]
fn gemma2_9b_shape_holds_the_published_hyper_parameters() {
    let s = shape("gemma2-9b").unwrap();
    assert_eq!(s.arch, SynthArch::Gemma2);
    assert_eq!(
        (
            s.n_layer,
            s.d_model,
            s.n_head,
            s.n_head_kv,
            s.head_dim,
            s.d_ff
        ),
        (42, 3584, 16, 8, 256, 14_336)
    );
    assert_eq!(
        (
            s.vocab,
            s.ctx,
            s.rope_base,
            s.rms_eps,
            s.sliding_window,
            s.tied
        ),
        (256_000, 8192, 10_000.0, 1e-6, 4096, true)
    );
    assert_eq!(s.vocab_kind, VocabKind::Gemma);
}

/// The mixture-of-experts shapes added for issue 30: hyper-parameters from the published
/// configs, llama.cpp's 8-expert rule in the Q4_K_M mix (Mixtral's attention K and V in Q8_0,
/// its output in Q5_K).
#[test]
fn moe_shapes_hold_the_published_hyper_parameters_and_mixes() {
    let m = shape("mixtral-8x7b").unwrap();
    assert_eq!(m.arch, SynthArch::Mixtral);
    assert_eq!(
        (
            m.n_layer,
            m.d_model,
            m.n_head,
            m.n_head_kv,
            m.head_dim,
            m.vocab
        ),
        (32, 4096, 32, 8, 128, 32_000)
    );
    assert_eq!(m.experts(), Some((8, 2, 14_336)));
    let g = shape("gpt-oss-120b").unwrap();
    assert_eq!(g.arch, SynthArch::GptOss);
    assert_eq!(
        (g.n_layer, g.d_model, g.n_head, g.head_dim),
        (36, 2880, 64, 64)
    );
    assert_eq!(g.experts(), Some((128, 4, 2880)));
    assert_eq!((g.sliding_window, g.sliding_window_pattern), (128, 2));

    let t = types(&spec("mixtral-8x7b", WeightMix::Q4KM));
    assert_eq!(t["blk.0.attn_k.weight"], GgmlType::Q8_0);
    assert_eq!(t["blk.0.attn_v.weight"], GgmlType::Q8_0);
    assert_eq!(t["blk.0.attn_output.weight"], GgmlType::Q5_K);
    assert_eq!(t["blk.0.attn_q.weight"], GgmlType::Q4_K);
    assert_eq!(t["blk.0.ffn_gate_exps.weight"], GgmlType::Q4_K);
    assert_eq!(t["blk.0.ffn_down_exps.weight"], GgmlType::Q6_K);
    assert_eq!(t["blk.5.ffn_down_exps.weight"], GgmlType::Q4_K);
    // Not for 128 experts: qwen3-30b-a3b keeps the plain rule.
    let q = types(&spec("qwen3-30b-a3b", WeightMix::Q4KM));
    assert_eq!(q["blk.3.attn_k.weight"], GgmlType::Q4_K);
}
