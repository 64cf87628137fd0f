//! Gemma 4's structure on the tiny synthetic model (`debug synth --arch gemma4`): the
//! hyper-parameters and per-layer recipes read from its metadata and tensors, the cache each
//! layer holds, and the splits that cannot run (a shared-KV layer apart from its source, layers
//! with per-layer embedding inputs apart from the token embedding). The forward pass itself
//! is checked against the NumPy reference in tests/python/test_forward.py.

use ringllm_kernels::GgmlType;
use ringllm_model::gguf::GgufFile;
use ringllm_model::synth::{synth_model, SynthArch, SynthSpec};
use ringllm_model::{KvCache, KvType, LoadOptions, Model, ModelError, Runner};
use std::sync::Arc;

fn file() -> Arc<GgufFile> {
    let bytes = synth_model(&SynthSpec::new(SynthArch::Gemma4, GgmlType::F32, 11)).expect("synth");
    Arc::new(GgufFile::from_bytes(bytes).expect("read back"))
}

fn load(layers: std::ops::Range<usize>, embedding: bool) -> Result<Model, ModelError> {
    Model::load(
        file(),
        &LoadOptions {
            layers: Some(layers),
            embedding,
            head: true,
            ..LoadOptions::default()
        },
    )
}

#[test]
fn hyper_parameters_and_recipes_follow_the_metadata() {
    let m = load(0..6, true).expect("load");
    let hp = &m.hp;
    assert_eq!(hp.sliding, [true, true, false, true, true, false]);
    assert_eq!(hp.sliding_window, 8);
    let heads: Vec<usize> = (0..6).map(|il| hp.head_dim_of(il)).collect();
    assert_eq!(heads, [32, 32, 64, 32, 32, 64]);
    let kv: Vec<usize> = (0..6).map(|il| hp.kv_dim_of(il)).collect();
    assert_eq!(kv, [64, 64, 64, 64, 64, 64]); // 2 heads of 32, 1 of 64
    let ff: Vec<usize> = (0..6).map(|il| hp.d_ff_of(il)).collect();
    assert_eq!(ff, [256, 256, 256, 512, 512, 512]);
    let src: Vec<Option<usize>> = (0..6).map(|il| hp.kv_source(il)).collect();
    assert_eq!(src, [None, None, None, Some(1), Some(1), Some(2)]);
    assert_eq!((hp.rope_dim, hp.rope_dim_local), (64, 32));
    assert_eq!(hp.query_scale, 1.0);
    assert_eq!(hp.ple_dim, 32);
    assert_eq!(hp.final_logit_softcap, Some(30.0));
    assert!(!hp.uniform_layers());
    let describe: Vec<String> = m.layers.iter().map(|l| l.recipe.describe()).collect();
    let tail = "attn_out → attn_residual → ffn_norm → gate_up → glu → ffn_down → ffn_residual → \
                per_layer_input → out_scale";
    assert_eq!(
        describe[0],
        format!("attn_norm → qkv → qk_norm → v_norm → rope → attention → {tail}")
    );
    // Layer 2 has no attn_v: a load-time rule makes its V its K.
    assert_eq!(
        describe[2],
        format!("attn_norm → qk_proj → v_from_k → qk_norm → v_norm → rope → attention → {tail}")
    );
    for d in &describe[3..6] {
        assert_eq!(
            *d,
            format!("attn_norm → q_proj → q_norm → rope_q → shared_attention → {tail}")
        );
    }
    assert!(m.layers[2].wv.is_none() && m.layers[2].wk.is_some());
    assert!(m.layers[5].wk.is_none() && m.layers[5].wv.is_none());
    assert!(m.layers.iter().all(|l| l.out_scale.is_some()));
    assert!(m.ple.is_some());
    // Proportional RoPE: the full layers' factors leave 3/4 of their pairs unrotated.
    let f = m.rope_freqs.as_ref().expect("rope_freqs");
    assert_eq!(f.len(), 32);
    assert_eq!(f.iter().filter(|&&v| v == 1.0).count(), 8);
}

#[test]
fn shared_layers_hold_no_cache_and_sliding_layers_their_window() {
    let m = load(0..6, true).expect("load");
    let (ctx, batch) = (128, 4);
    let per_layer: Vec<usize> = (0..6)
        .map(|il| KvCache::bytes_for(&m.hp, il..il + 1, ctx, batch, KvType::F32))
        .collect();
    let ring = 8 + batch - 1;
    assert_eq!(
        per_layer,
        [
            2 * ring * 64 * 4,
            2 * ring * 64 * 4,
            2 * ctx * 64 * 4,
            0,
            0,
            0
        ]
    );
    let r = Runner::new(Arc::new(m), 1, batch, ctx);
    let cache = r.new_cache(ctx, KvType::F32);
    assert_eq!(cache.bytes(), per_layer.iter().sum::<usize>());
}

#[test]
fn a_split_between_a_shared_layer_and_its_source_is_refused() {
    // Layers 3, 4 and 5 read the caches of layers 1, 1 and 2.
    let err = load(3..6, true).expect_err("sources elsewhere");
    assert!(
        err.to_string()
            .contains("layer 3 reads the KV cache of layer 1"),
        "{err}"
    );
    let err = load(2..6, true).expect_err("layer 3's source elsewhere");
    assert!(
        err.to_string()
            .contains("layer 3 reads the KV cache of layer 1"),
        "{err}"
    );
    let err = load(4..6, true).expect_err("layer 4's source elsewhere");
    assert!(
        err.to_string()
            .contains("layer 4 reads the KV cache of layer 1"),
        "{err}"
    );
    load(1..6, true).expect("every source inside");
    load(0..1, true).expect("no shared layer");
}

#[test]
fn per_layer_embedding_inputs_need_the_token_embedding_in_the_slice() {
    let err = load(0..6, false).expect_err("no embedding");
    assert!(err.to_string().contains("per-layer embedding"), "{err}");
    // Running layers without embedding their tokens first is an error, not stale inputs.
    let m = Arc::new(load(0..6, true).expect("load"));
    let mut r = Runner::new(Arc::clone(&m), 1, 4, 16);
    let mut cache = r.new_cache(16, KvType::F32);
    let d = m.hp.d_model;
    let mut x = vec![0f32; 2 * d];
    r.embed(&[5, 6], &mut x).expect("embed");
    r.layers(&mut x[..d], 1, &mut cache, None)
        .expect("first row");
    r.layers(&mut x[d..], 1, &mut cache, None)
        .expect("second row");
    let err = r
        .layers(&mut x[..d], 1, &mut cache, None)
        .expect_err("nothing embedded");
    assert!(err.to_string().contains("embed the tokens"), "{err}");
}
