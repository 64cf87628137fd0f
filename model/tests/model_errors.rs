//! What a slice refuses, and that each refusal names its own cause: a part the slice did not
//! load, a layer range outside the model, a cache or batch that does not fit the runner.

use ringllm_kernels::GgmlType;
use ringllm_model::gguf::GgufFile;
use ringllm_model::synth::{synth_model, SynthArch, SynthSpec};
use ringllm_model::{KvType, LoadOptions, Model, ModelError, Runner};
use std::sync::Arc;

fn file() -> Arc<GgufFile> {
    let bytes = synth_model(&SynthSpec::new(SynthArch::Llama, GgmlType::F32, 3)).expect("synth");
    Arc::new(GgufFile::from_bytes(bytes).expect("read back"))
}

fn slice(layers: std::ops::Range<usize>, embedding: bool, head: bool) -> Arc<Model> {
    let opts = LoadOptions {
        layers: Some(layers),
        embedding,
        head,
        repack: false,
        stream: None,
        experts: None,
    };
    Arc::new(Model::load(file(), &opts).expect("load the slice"))
}

#[test]
fn a_part_the_slice_did_not_load_is_named_not_called_a_bad_hyper_parameter() {
    let m = slice(0..1, false, false);
    let d = m.hp.d_model;
    let r = Runner::new(Arc::clone(&m), 1, 4, 16);
    let mut x = vec![0f32; d];
    let e = r
        .embed(&[1], &mut x)
        .expect_err("no embedding in this slice");
    assert!(
        matches!(e, ModelError::NotInSlice { what: "token embedding", ref layers } if *layers == (0..1)),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "this model slice (layers 0..1) holds no token embedding"
    );
    let e = r.final_norm(&mut x, 1).expect_err("no output norm");
    assert!(
        matches!(
            e,
            ModelError::NotInSlice {
                what: "output norm",
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn a_layer_range_outside_the_model_names_the_range() {
    let n_layer = slice(0..1, false, false).hp.n_layer;
    let opts = LoadOptions {
        layers: Some(0..n_layer + 1),
        embedding: false,
        head: false,
        repack: false,
        stream: None,
        experts: None,
    };
    let e = Model::load(file(), &opts).expect_err("one layer too many");
    assert!(
        matches!(e, ModelError::LayerRange { start: 0, end, n_layer: n } if end == n_layer + 1 && n == n_layer),
        "{e:?}"
    );
}

#[test]
fn a_cache_of_other_layers_and_an_oversized_batch_are_refused_by_cause() {
    let whole = slice(0..2, false, false);
    let one = slice(0..1, false, false);
    let d = whole.hp.d_model;
    let mut r = Runner::new(Arc::clone(&one), 1, 2, 16);
    let mut foreign = Runner::new(whole, 1, 2, 16).new_cache(16, KvType::F32);
    let mut x = vec![0f32; 3 * d];
    let e = r
        .layers(&mut x[..d], 1, &mut foreign, None)
        .expect_err("a cache made for two layers");
    assert!(
        matches!(e, ModelError::CacheMismatch { cache: 2, slice: 1 }),
        "{e:?}"
    );
    let mut own = r.new_cache(16, KvType::F32);
    let e = r
        .layers(&mut x, 3, &mut own, None)
        .expect_err("3 tokens for a runner of 2");
    assert!(
        matches!(e, ModelError::BatchTooLarge { n: 3, max: 2 }),
        "{e:?}"
    );
}

#[test]
fn logits_into_a_short_buffer_say_which_buffer() {
    let m = slice(0..1, false, true);
    let d = m.hp.d_model;
    let mut r = Runner::new(Arc::clone(&m), 1, 2, 16);
    let x = vec![0f32; d];
    let mut out = vec![0f32; m.hp.vocab - 1];
    let e = r.logits(&x, 1, &mut out).expect_err("one value short");
    assert!(
        matches!(
            e,
            ModelError::BufferTooSmall {
                what: "logits output",
                ..
            }
        ),
        "{e:?}"
    );
}
