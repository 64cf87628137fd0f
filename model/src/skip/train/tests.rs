//! Training on a tiny synthetic model: the threshold search keeps to the budget, and what it
//! reports matches what the model does.

use super::*;
use crate::gguf::GgufFile;
use crate::kv::KvType;
use crate::synth::{synth_model, SynthArch, SynthSpec};
use crate::{LoadOptions, Model};
use ringllm_kernels::GgmlType;

const CTX: usize = 24;

fn setup() -> (Runner, KvCache, Vec<Vec<u32>>) {
    let spec = SynthSpec {
        n_layer: 4,
        ..SynthSpec::new(SynthArch::Llama, GgmlType::F32, 11)
    };
    let file = GgufFile::from_bytes(synth_model(&spec).expect("synth")).expect("read back");
    let model = Arc::new(Model::load(Arc::new(file), &LoadOptions::default()).expect("load"));
    let vocab = model.hp.vocab;
    let runner = Runner::new(model, 2, 8, CTX);
    let kv = runner.new_cache(CTX, KvType::F32);
    // Three chunks (two to train on, one held out) of tokens spread over the vocabulary.
    let chunks = (0..3)
        .map(|c| {
            (0..CTX)
                .map(|i| (3 + (i * 37 + c * 101) % (vocab - 3)) as u32)
                .collect()
        })
        .collect();
    (runner, kv, chunks)
}

fn train(budget_pct: f64) -> (Calibration, Vec<String>, f64, Runner) {
    let (mut runner, mut kv, chunks) = setup();
    let id = SkipModelId::of(&runner.model);
    let train: Vec<&[u32]> = chunks[..2].iter().map(Vec::as_slice).collect();
    let mut seen = Vec::new();
    let cal = calibrate(
        &mut runner,
        &mut kv,
        id,
        &train,
        &chunks[2],
        &TrainOptions {
            rank: 8,
            budget_pct,
        },
        &mut |p| {
            seen.push(match p {
                Progress::Recorded { done, of } => format!("recorded {done}/{of}"),
                Progress::Baseline => "baseline".into(),
                Progress::Trying { k } => format!("trying {k}"),
                Progress::Tried {
                    k,
                    threshold,
                    base_ppl,
                    within_budget,
                } => {
                    assert_eq!(
                        within_budget,
                        threshold.ppl <= base_ppl * (1.0 + budget_pct / 100.0)
                    );
                    format!("tried {k} {within_budget}")
                }
                Progress::Pairs => "pairs".into(),
            })
        },
    )
    .expect("calibrate");
    // The held-out perplexity without skipping, scored on its own.
    let mut nll = ChunkNll::default();
    score_chunk(&mut runner, &mut kv, &chunks[2], &mut nll).expect("score");
    (cal, seen, nll.ppl(), runner)
}

#[test]
fn an_unreachable_budget_gives_a_predictor_that_never_skips() {
    // A budget of -100%: no perplexity is low enough, so the strictest candidate already
    // fails and nothing is ever labelled skippable.
    let (cal, seen, ppl, _) = train(-100.0);
    assert_eq!(
        seen,
        [
            "recorded 1/2",
            "recorded 2/2",
            "baseline",
            "trying 0",
            "tried 0 false",
            "pairs"
        ]
    );
    assert!(cal.never_skips());
    assert_eq!(cal.chosen.ppl, cal.base_ppl);
    assert_eq!(
        cal.base_ppl, ppl,
        "the baseline is the unskipped held-out perplexity"
    );
    assert_eq!(cal.decision, 1, "a third of the way down 4 layers");
    assert_eq!(cal.layers.len(), 4);
    // Position 0 of each chunk is not trained on.
    assert_eq!(cal.train_tokens, 2 * (CTX - 1));
    for l in &cal.layers {
        assert_eq!((l.labelled, l.predicted), (0.0, 0.0), "{l:?}");
        assert!(l.mean_cos > -1.0 && l.mean_cos <= 1.0, "{l:?}");
    }
}

#[test]
fn a_loose_budget_takes_the_loosest_threshold_and_the_predictor_fits_the_model() {
    let (cal, seen, ppl, mut runner) = train(1e9);
    // Every candidate is tried and kept.
    let tried: Vec<&String> = seen.iter().filter(|s| s.starts_with("tried")).collect();
    assert_eq!(tried.len(), CANDIDATES.len());
    assert!(tried.iter().all(|s| s.ends_with("true")), "{seen:?}");
    assert!(!cal.never_skips());
    assert_eq!(cal.chosen.labelled, CANDIDATES[CANDIDATES.len() - 1]);
    assert_eq!(cal.base_ppl, ppl);
    // τ is the cosine above which that share of the (token, layer ≥ decision) pairs falls:
    // at least that share of them is labelled skippable.
    let after = &cal.layers[cal.decision..];
    let share = after.iter().map(|l| l.labelled).sum::<f64>() / after.len() as f64;
    assert!(
        share >= cal.chosen.labelled,
        "{share} < {}",
        cal.chosen.labelled
    );
    assert!(cal.predictor.taus.iter().all(|t| *t == cal.chosen.tau));
    // The predictor survives its file format and the runner takes it.
    let back = Predictor::from_bytes(&cal.predictor.to_bytes()).expect("round trip");
    assert_eq!(back.taus, cal.predictor.taus);
    runner
        .set_skip(Some(SkipPolicy::new(Arc::new(back))))
        .expect("the predictor fits the model it was trained for");
}
