//! Predictive layer skip in the forward pass, on synthetic models: a predictor that never
//! reaches its confidence changes no bit; a skipped layer passes its input through; the KV
//! slots of skipped tokens are left out of attention whatever they hold; the plan reaches the
//! hook before the layers run; `max_skip` bounds a run of skips.

use ringllm_kernels::GgmlType;
use ringllm_model::gguf::GgufFile;
use ringllm_model::skip::{Predictor, SkipModelId, SkipPolicy};
use ringllm_model::synth::{synth_model, SynthArch, SynthSpec};
use ringllm_model::{KvCache, KvType, LoadOptions, Model, Runner};
use std::sync::{Arc, Mutex};

const N_LAYER: u32 = 4;

fn model(arch: SynthArch) -> Arc<Model> {
    let spec = SynthSpec {
        n_layer: N_LAYER,
        ..SynthSpec::new(arch, GgmlType::F32, 7)
    };
    let bytes = synth_model(&spec).expect("synth");
    let file = GgufFile::from_bytes(bytes).expect("read back");
    Arc::new(Model::load(Arc::new(file), &LoadOptions::default()).expect("load"))
}

fn id(m: &Model) -> SkipModelId {
    SkipModelId::new(&m.hp, m.file().header_hash())
}

/// A policy whose predictor answers sigmoid(bias) for every pair, deciding at `decision`.
fn constant(m: &Model, decision: usize, bias: f32) -> SkipPolicy {
    SkipPolicy::new(Arc::new(Predictor::constant(id(m), 8, decision, bias)))
}

/// A policy that skips exactly where `f(position, layer)` says (deciding before layer 0).
fn forced(m: &Model, max_skip: usize, f: fn(usize, usize) -> bool) -> SkipPolicy {
    SkipPolicy {
        max_skip,
        force: Some(Arc::new(f)),
        ..constant(m, 0, -30.0)
    }
}

fn tokens(n: usize, vocab: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|i| (3 + (i * 37 + salt * 101) % (vocab - 3)) as u32)
        .collect()
}

/// Logits of every token fed in batches of `batch` into `cache`, and the residual stream
/// after every layer (per batch: `[layer][rows × d]`).
fn feed(
    r: &mut Runner,
    cache: &mut KvCache,
    toks: &[u32],
    batch: usize,
) -> (Vec<f32>, Vec<Vec<Vec<f32>>>) {
    let m = Arc::clone(&r.model);
    let (d, vocab) = (m.hp.d_model, m.hp.vocab);
    let mut logits = Vec::new();
    let mut states = Vec::new();
    for chunk in toks.chunks(batch) {
        let n = chunk.len();
        let mut x = vec![0f32; n * d];
        r.embed(chunk, &mut x).expect("embed");
        let mut seen = vec![x.clone()];
        let mut obs = |_il: usize, s: &[f32]| seen.push(s.to_vec());
        r.layers(&mut x, n, cache, Some(&mut obs)).expect("layers");
        states.push(seen);
        r.final_norm(&mut x, n).expect("norm");
        let mut l = vec![0f32; n * vocab];
        r.logits(&x, n, &mut l).expect("logits");
        logits.extend(l);
    }
    (logits, states)
}

fn runner(m: &Arc<Model>, policy: Option<SkipPolicy>) -> (Runner, KvCache) {
    let mut r = Runner::new(Arc::clone(m), 2, 16, 64);
    r.set_skip(policy).expect("predictor fits");
    let c = r.new_cache(64, KvType::F32);
    (r, c)
}

#[test]
fn a_predictor_never_confident_changes_no_bit() {
    for arch in [SynthArch::Llama, SynthArch::Gemma3] {
        let m = model(arch);
        let toks = tokens(12, m.hp.vocab, 0);
        for batch in [12, 1, 5] {
            let (mut a, mut ca) = runner(&m, None);
            let (la, _) = feed(&mut a, &mut ca, &toks, batch);
            // sigmoid(2) ≈ 0.88: below the confidence, above 0.5 (every layer "doubted").
            for bias in [-30.0, 2.0] {
                let (mut b, mut cb) = runner(&m, Some(constant(&m, 1, bias)));
                let (lb, _) = feed(&mut b, &mut cb, &toks, batch);
                assert_eq!(la, lb, "{arch:?} batch {batch} bias {bias}");
                let s = b.skip_stats();
                assert_eq!(s.skipped, 0);
                assert_eq!(s.evaluations, (12 * N_LAYER) as u64);
                // Layers 1..4 after the decision point, for every token but position 0.
                let doubted = if bias > 0.0 {
                    11 * (N_LAYER as u64 - 1)
                } else {
                    0
                };
                assert_eq!(s.doubted, doubted, "{arch:?} bias {bias}");
            }
        }
    }
}

#[test]
fn a_skipped_layer_passes_its_input_through() {
    let m = model(SynthArch::Llama);
    let d = m.hp.d_model;
    let toks = tokens(6, m.hp.vocab, 1);
    // Position 3 skips layers 1 and 2; everything else runs.
    let f: fn(usize, usize) -> bool = |p, l| p == 3 && (l == 1 || l == 2);
    let (mut plain, mut cp) = runner(&m, None);
    let (_, ref_states) = feed(&mut plain, &mut cp, &toks, 6);
    let (mut r, mut c) = runner(&m, Some(forced(&m, 5, f)));
    let (_, states) = feed(&mut r, &mut c, &toks, 6);
    let (st, rf) = (&states[0], &ref_states[0]);
    let row = |s: &Vec<f32>, t: usize| s[t * d..(t + 1) * d].to_vec();
    // states[k]: entering layer k (k = 0: the embedding), leaving layer k - 1.
    assert_eq!(row(&st[2], 3), row(&st[1], 3), "layer 1 output != input");
    assert_eq!(row(&st[3], 3), row(&st[1], 3), "layer 2 output != input");
    assert_ne!(row(&st[4], 3), row(&st[3], 3), "layer 3 should run");
    // Rows before the skipping token cannot see it: identical to the plain run.
    for t in 0..3 {
        for k in 0..=N_LAYER as usize {
            assert_eq!(row(&st[k], t), row(&rf[k], t), "row {t} after layer {k}");
        }
    }
    // Rows after it do see the difference (the test can tell).
    assert_ne!(row(&st[4], 4), row(&rf[4], 4));
    let s = r.skip_stats();
    assert_eq!((s.skipped, s.layers_not_run), (2, 0));
}

/// Position 2 skips every layer.
fn skip_pos2(p: usize, _l: usize) -> bool {
    p == 2
}

#[test]
fn skipped_kv_slots_are_ignored_whatever_they_hold() {
    for arch in [SynthArch::Llama, SynthArch::Gemma3] {
        let m = model(arch);
        let vocab = m.hp.vocab;
        let toks = tokens(6, vocab, 2);
        let mut other = toks.clone();
        other[2] = (other[2] + 17) % vocab as u32; // a different skipped token
        let (mut r, mut c) = runner(&m, Some(forced(&m, 8, skip_pos2)));
        let (fresh, _) = feed(&mut r, &mut c, &toks, 6);
        // The same cache again, its slots holding a whole other sequence's keys and values
        // (run without skipping), then truncated and reused.
        let (mut r2, mut c2) = runner(&m, None);
        feed(&mut r2, &mut c2, &tokens(6, vocab, 9), 6);
        c2.truncate(0);
        r2.set_skip(Some(forced(&m, 8, skip_pos2))).expect("set");
        let (stale, _) = feed(&mut r2, &mut c2, &other, 6);
        let after = |l: &[f32]| l[3 * vocab..].to_vec();
        assert_eq!(
            after(&fresh),
            after(&stale),
            "{arch:?}: positions after the skipped one depend on its slot"
        );
        // One token at a time: the skipped token's layers do not run at all.
        let (mut r3, mut c3) = runner(&m, Some(forced(&m, 8, skip_pos2)));
        let (decode, _) = feed(&mut r3, &mut c3, &toks, 1);
        let scale = fresh.iter().fold(0f32, |a, v| a.max(v.abs()));
        let err = decode
            .iter()
            .zip(&fresh)
            .fold(0f32, |a, (x, y)| a.max((x - y).abs()))
            / scale;
        assert!(err < 1e-5, "{arch:?}: decode vs batch relative error {err}");
        let s = r3.skip_stats();
        assert_eq!(s.layers_not_run, N_LAYER as u64);
        let per_layer = m.layers[0].weight_bytes() as u64;
        assert_eq!(s.bytes_not_read, per_layer * N_LAYER as u64);
        // The skipped token's own output is its embedding through the final norm and head,
        // computed here by hand.
        let d = m.hp.d_model;
        let mut e = vec![0f32; d];
        r3.embed(&toks[2..3], &mut e).expect("embed");
        r3.final_norm(&mut e, 1).expect("norm");
        let mut want = vec![0f32; vocab];
        r3.logits(&e, 1, &mut want).expect("logits");
        assert_eq!(&fresh[2 * vocab..3 * vocab], &want[..], "{arch:?}");
        // And the skip is not a no-op: without it, later positions differ.
        let (mut r4, mut c4) = runner(&m, None);
        let (plain, _) = feed(&mut r4, &mut c4, &toks, 6);
        assert_ne!(after(&plain), after(&fresh));
    }
}

#[test]
fn the_plan_reaches_the_hook_before_the_layers_run_and_max_skip_holds() {
    let m = model(SynthArch::Llama);
    let toks = tokens(4, m.hp.vocab, 3);
    let always: fn(usize, usize) -> bool = |_, _| true;
    let (mut r, mut c) = runner(&m, Some(forced(&m, 2, always)));
    let seen: Arc<Mutex<Vec<Vec<bool>>>> = Arc::default();
    let log = Arc::clone(&seen);
    r.set_on_skip_plan(Some(Box::new(move |first, plan| {
        assert_eq!(first, 0);
        log.lock().expect("lock").push(plan.to_vec());
    })));
    let (_, states) = feed(&mut r, &mut c, &toks, 1);
    let plans = seen.lock().expect("lock").clone();
    // Position 0 never skips; the others skip 2 layers, run one, skip the next.
    assert_eq!(plans.len(), 4);
    assert_eq!(plans[0], vec![false; 4]);
    for p in &plans[1..] {
        assert_eq!(p, &vec![true, true, false, true]);
    }
    assert_eq!(r.skip_plan(), &[true, true, false, true]);
    for st in &states[1..] {
        assert_eq!(st[1], st[0]);
        assert_eq!(st[2], st[0]);
        assert_ne!(st[3], st[2]);
        assert_eq!(st[4], st[3]);
    }
    assert_eq!(r.skip_stats().skipped, 9);
    // A slice that starts later decides at its own first layer: here, before layer 2.
    let file = Arc::new(GgufFile::from_bytes(m.file().bytes().to_vec()).expect("bytes"));
    let opts = LoadOptions {
        layers: Some(2..4),
        embedding: false,
        head: false,
        repack: false,
        stream: None,
        experts: None,
    };
    let tail = Arc::new(Model::load(file, &opts).expect("slice"));
    let mut r = Runner::new(Arc::clone(&tail), 1, 4, 16);
    r.set_skip(Some(SkipPolicy {
        max_skip: 8,
        force: Some(Arc::new(always)),
        ..SkipPolicy::new(Arc::new(Predictor::constant(id(&m), 8, 0, -30.0)))
    }))
    .expect("fits");
    let mut c = r.new_cache(16, KvType::F32);
    let d = m.hp.d_model;
    let mut x: Vec<f32> = (0..2 * d).map(|i| (i as f32 * 0.01).sin()).collect();
    let x0 = x.clone();
    r.layers(&mut x, 2, &mut c, None).expect("layers");
    assert_eq!(r.skip_plan(), &[false, false], "position 0 runs");
    assert_eq!(
        &x[d..],
        &x0[d..],
        "position 1 skipped both layers of the slice"
    );
    assert_ne!(&x[..d], &x0[..d]);
}

#[test]
fn a_predictor_for_another_shape_is_refused() {
    let m = model(SynthArch::Llama);
    let mut other = id(&m);
    other.n_layer += 1;
    let mut r = Runner::new(Arc::clone(&m), 1, 4, 16);
    let e = r
        .set_skip(Some(SkipPolicy::new(Arc::new(Predictor::constant(
            other, 8, 1, 0.0,
        )))))
        .expect_err("wrong shape")
        .to_string();
    assert!(e.contains("5 layers") && e.contains("4 of width"), "{e}");
}
