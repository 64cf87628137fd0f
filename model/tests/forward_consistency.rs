//! Self-consistency of the forward pass on synthetic models: the same tokens give the same
//! logits whether fed as one batch, in small batches or one at a time, with one thread or
//! several, and with an f16 cache within a small budget. (Correctness against an independent
//! reference lives in tests/python.)

use ringllm_kernels::GgmlType;
use ringllm_model::gguf::GgufFile;
use ringllm_model::synth::{synth_model, SynthArch, SynthSpec};
use ringllm_model::{KvType, LoadOptions, Model, Runner};
use std::sync::Arc;

fn model(arch: SynthArch, ty: GgmlType) -> Arc<Model> {
    let bytes = synth_model(&SynthSpec::new(arch, ty, 42)).expect("synth");
    let file = GgufFile::from_bytes(bytes).expect("read back");
    Arc::new(Model::load(Arc::new(file), &LoadOptions::default()).expect("load"))
}

/// Logits of every position, feeding `tokens` in batches of `batch`.
fn logits_all(
    m: &Arc<Model>,
    tokens: &[u32],
    batch: usize,
    threads: usize,
    kv: KvType,
) -> Vec<f32> {
    let (d, vocab) = (m.hp.d_model, m.hp.vocab);
    let mut r = Runner::new(Arc::clone(m), threads, batch, 64);
    let mut cache = r.new_cache(64, kv);
    let mut out = Vec::new();
    for chunk in tokens.chunks(batch) {
        let n = chunk.len();
        let mut x = vec![0f32; n * d];
        r.embed(chunk, &mut x).expect("embed");
        r.layers(&mut x, n, &mut cache, None).expect("layers");
        r.final_norm(&mut x, n).expect("norm");
        let mut l = vec![0f32; n * vocab];
        r.logits(&x, n, &mut l).expect("logits");
        out.extend(l);
    }
    out
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| (3 + (i * 37) % (vocab - 3)) as u32)
        .collect()
}

#[test]
fn batching_and_threads_do_not_change_logits() {
    for arch in [SynthArch::Llama, SynthArch::Gemma3, SynthArch::Gemma4] {
        let m = model(arch, GgmlType::F32);
        // 20 tokens: longer than the synthetic Gemma's sliding window of 8.
        let toks = tokens(20, m.hp.vocab);
        let whole = logits_all(&m, &toks, 32, 1, KvType::F32);
        for (batch, threads) in [(1, 1), (3, 2), (7, 3), (20, 2)] {
            let other = logits_all(&m, &toks, batch, threads, KvType::F32);
            let e = max_rel(&other, &whole);
            assert!(
                e < 1e-5,
                "{arch:?} batch {batch} threads {threads}: relative error {e}"
            );
        }
    }
}

#[test]
fn f16_cache_stays_close_to_f32() {
    for arch in [SynthArch::Llama, SynthArch::Gemma3, SynthArch::Gemma4] {
        let m = model(arch, GgmlType::F32);
        let toks = tokens(20, m.hp.vocab);
        let a = logits_all(&m, &toks, 5, 2, KvType::F32);
        let b = logits_all(&m, &toks, 5, 2, KvType::F16);
        let e = max_rel(&b, &a);
        assert!(e < 5e-3, "{arch:?}: f16 cache relative error {e}");
        assert!(e > 0.0, "{arch:?}: the f16 cache should round something");
    }
}

#[test]
fn sliding_window_limits_what_a_layer_sees() {
    // The synthetic Gemma has two layers, both local (window 8). Through two windows,
    // position 15 can reach back to position 15 - 7 - 7 = 1, never to position 0.
    let m = model(SynthArch::Gemma3, GgmlType::F32);
    assert!(
        m.hp.sliding.iter().all(|s| *s),
        "synthetic gemma layers should all be local"
    );
    let vocab = m.hp.vocab;
    let a = tokens(16, vocab);
    let mut b = a.clone();
    b[0] = 5; // change the first token only
    assert_ne!(a[0], b[0]);
    let la = logits_all(&m, &a, 16, 1, KvType::F32);
    let lb = logits_all(&m, &b, 16, 1, KvType::F32);
    let last = |l: &[f32]| l[15 * vocab..16 * vocab].to_vec();
    assert_eq!(
        last(&la),
        last(&lb),
        "position 15 saw position 0 through two windows of 8"
    );
    // ...while position 7 does see position 0.
    let at7 = |l: &[f32]| l[7 * vocab..8 * vocab].to_vec();
    assert_ne!(at7(&la), at7(&lb));
}

#[test]
fn context_overflow_is_an_error() {
    let m = model(SynthArch::Llama, GgmlType::F32);
    let mut r = Runner::new(Arc::clone(&m), 1, 8, 8);
    let mut cache = r.new_cache(8, KvType::F32);
    let d = m.hp.d_model;
    let mut x = vec![0f32; 8 * d];
    r.embed(&tokens(8, m.hp.vocab), &mut x).expect("embed");
    r.layers(&mut x, 8, &mut cache, None).expect("fits exactly");
    let mut y = vec![0f32; d];
    r.embed(&[3], &mut y).expect("embed");
    let err = r
        .layers(&mut y, 1, &mut cache, None)
        .expect_err("ninth position");
    assert!(err.to_string().contains("context full"), "{err}");
    let bad = r
        .embed(&[m.hp.vocab as u32], &mut y)
        .expect_err("token past the vocabulary");
    assert!(bad.to_string().contains("outside the vocabulary"), "{bad}");
}

/// Three sequences of different lengths, prefilled together and then decoded together (one
/// token each per step, at different positions), give the logits each gets alone.
#[test]
fn several_sequences_in_one_batch_match_each_alone() {
    for arch in [SynthArch::Llama, SynthArch::Gemma3, SynthArch::Gemma4] {
        for ty in [GgmlType::F32, GgmlType::Q8_0] {
            let m = model(arch, ty);
            let (d, vocab) = (m.hp.d_model, m.hp.vocab);
            let seqs: Vec<Vec<u32>> = [5usize, 11, 3]
                .iter()
                .enumerate()
                .map(|(k, &n)| {
                    (0..n)
                        .map(|i| (3 + (i * 37 + k * 101) % (vocab - 3)) as u32)
                        .collect()
                })
                .collect();
            let steps = 12; // decode steps: past the synthetic Gemma's window of 8
                            // Alone: prompt, then one token at a time (the token fed is fixed, not sampled).
            let alone: Vec<Vec<f32>> = seqs
                .iter()
                .map(|s| {
                    let mut all = s.clone();
                    all.extend((0..steps).map(|i| (7 + i * 13) as u32 % vocab as u32));
                    let l = logits_all(&m, &all, 1, 1, KvType::F32);
                    l[(s.len() - 1) * vocab..].to_vec()
                })
                .collect();
            // Together.
            let mut r = Runner::new(Arc::clone(&m), 2, 32, 64);
            let mut caches: Vec<_> = (0..3).map(|_| r.new_cache(64, KvType::F32)).collect();
            let mut got: Vec<Vec<f32>> = vec![Vec::new(); 3];
            for step in 0..=steps {
                let feed: Vec<Vec<u32>> = if step == 0 {
                    seqs.clone()
                } else {
                    (0..3)
                        .map(|_| vec![(7 + (step - 1) * 13) as u32 % vocab as u32])
                        .collect()
                };
                let n: usize = feed.iter().map(|f| f.len()).sum();
                let flat: Vec<u32> = feed.iter().flatten().copied().collect();
                let mut x = vec![0f32; n * d];
                r.embed(&flat, &mut x).expect("embed");
                {
                    let mut parts: Vec<(&mut ringllm_model::KvCache, usize)> = caches
                        .iter_mut()
                        .zip(&feed)
                        .map(|(c, f)| (c, f.len()))
                        .collect();
                    r.layers_multi(&mut x, &mut parts, None).expect("layers");
                }
                // The last row of each sequence.
                let mut row = 0;
                for (k, f) in feed.iter().enumerate() {
                    row += f.len();
                    let mut last = x[(row - 1) * d..row * d].to_vec();
                    r.final_norm(&mut last, 1).expect("norm");
                    let mut l = vec![0f32; vocab];
                    r.logits(&last, 1, &mut l).expect("logits");
                    got[k].extend(l);
                }
            }
            for k in 0..3 {
                assert_eq!(got[k].len(), alone[k].len());
                // Every row's products and attention are computed as they are alone: equal
                // to the bit.
                let e = max_rel(&got[k], &alone[k]);
                assert!(got[k] == alone[k], "{arch:?} {ty:?} sequence {k}: {e}");
                assert_eq!(caches[k].len, seqs[k].len() + steps);
            }
        }
    }
}

/// Watching every step walks each layer's recipe in order, shows each output buffer at its
/// width, and changes nothing: the per-row steps the CPU fuses into one pass when nobody
/// watches give the same bits one at a time, and the last step's residual stream is the
/// layer's output.
#[test]
fn step_observer_sees_the_recipe_and_changes_nothing() {
    use ringllm_model::forward::{Observed, StepObserver};
    // (Qwen2's biases have synthetic weights at real-size shapes only.)
    for arch in [SynthArch::Llama, SynthArch::Gemma3] {
        let m = model(arch, GgmlType::Q8_0);
        let d = m.hp.d_model;
        let toks = tokens(5, m.hp.vocab);
        let n = toks.len();
        let run = |watch: bool| {
            let mut r = Runner::new(Arc::clone(&m), 2, 8, 16);
            let mut cache = r.new_cache(16, KvType::F32);
            let mut x = vec![0f32; n * d];
            r.embed(&toks, &mut x).expect("embed");
            let mut seen: Vec<(usize, &'static str, &'static str, usize, Vec<f32>)> = Vec::new();
            if watch {
                let mut obs = StepObserver(|o: &Observed<'_>| {
                    assert_eq!(o.rows.len(), n * o.width, "{} {}", o.step, o.buf);
                    seen.push((o.layer, o.step, o.buf, o.width, o.rows.to_vec()));
                });
                r.layers(&mut x, n, &mut cache, Some(&mut obs))
                    .expect("layers");
            } else {
                r.layers(&mut x, n, &mut cache, None).expect("layers");
            }
            (x, seen)
        };
        let (plain, none) = run(false);
        let (watched, seen) = run(true);
        assert!(none.is_empty());
        assert_eq!(
            plain, watched,
            "{arch:?}: watching the steps changed the output"
        );
        for (i, layer) in m.layers.iter().enumerate() {
            let mut want: Vec<(&str, &str)> = Vec::new();
            for s in &layer.recipe.steps {
                for b in s.outputs() {
                    want.push((s.name(), b.name()));
                }
            }
            let got: Vec<(&str, &str)> = seen
                .iter()
                .filter(|e| e.0 == i)
                .map(|e| (e.1, e.2))
                .collect();
            assert_eq!(got, want, "{arch:?} layer {i}");
        }
        let last = seen.last().expect("steps seen");
        assert_eq!((last.1, last.2), ("ffn_residual", "x"));
        assert_eq!(last.4, watched, "{arch:?}: the last step's x is the output");
        if arch == SynthArch::Gemma3 {
            assert!(seen.iter().any(|e| e.1 == "qk_norm"));
        }
    }
}
