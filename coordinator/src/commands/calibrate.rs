//! `ringllm calibrate`: trains the predictor of predictive layer skip (`--skip auto`) with
//! `ringllm_model::skip::train` (which says how), and reports how it went.
//!
//! The text is cut into chunks of `--ctx` tokens as `perplexity` does; the last chunk is held
//! out to choose the threshold.

use crate::cli::CalibrateArgs;
use anyhow::{bail, Context, Result};
use ringllm::engine::{Engine, ModelOptions};
use ringllm::progress::Progress;
use ringllm::skip::default_predictor_path;
use ringllm_model::skip::train::{self, Progress as TrainProgress, TrainOptions, CANDIDATES};
use ringllm_model::skip::{self, SkipModelId};
use std::process::ExitCode;

pub fn calibrate(args: CalibrateArgs) -> Result<ExitCode> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let mut margs = args.model.clone();
    let ctx = margs.ctx.unwrap_or(512);
    margs.ctx = Some(ctx);
    let output = args
        .output
        .clone()
        .unwrap_or_else(|| default_predictor_path(&margs.model));
    let mut engine = Engine::load(&ModelOptions::from(&margs))?;
    let hp = engine.runner.model.hp.clone();
    let (nl, d) = (hp.n_layer, hp.d_model);
    if args.rank == 0 || args.rank > d.min(256) {
        bail!("--rank {} must be between 1 and {}", args.rank, d.min(256));
    }
    if nl < 2 {
        bail!("the model has {nl} layer(s): nothing to skip");
    }
    let add_bos = engine.tokenizer.add_bos_default();
    let tokens = engine.tokenizer.encode(&text, add_bos)?;
    let mut n_chunks = tokens.len() / ctx;
    if let Some(c) = args.chunks {
        n_chunks = n_chunks.min(c);
    }
    if n_chunks < 2 {
        bail!(
            "{} has {} tokens; calibration needs at least 2 chunks of --ctx {ctx} ({} tokens): \
             some to train on and one held out (lower --ctx or give a longer text)",
            args.file.display(),
            tokens.len(),
            2 * ctx
        );
    }
    // Every chunk starts with BOS where the model adds one, as `perplexity` scores them.
    let bos = if add_bos {
        engine.tokenizer.bos()
    } else {
        None
    };
    let chunks: Vec<Vec<u32>> = tokens
        .chunks_exact(ctx)
        .take(n_chunks)
        .map(|c| {
            let mut c = c.to_vec();
            if let Some(b) = bos {
                c[0] = b;
            }
            c
        })
        .collect();
    let (held_out, train) = chunks
        .split_last()
        .context("calibration needs at least 2 chunks")?;
    let train: Vec<&[u32]> = train.iter().map(Vec::as_slice).collect();
    let decision = train::decision_layer(nl);
    eprintln!(
        "calibrate: {} tokens, {} chunk(s) of {ctx} to train on, 1 held out | {nl} layers, \
         decision layer {decision}, rank {}",
        tokens.len(),
        train.len(),
        args.rank
    );
    let bar = super::progress::Bar::default();
    bar.start(
        "calibrate",
        Some((train.len() + CANDIDATES.len() + 1) as u64),
    );
    bar.message("hidden states");
    let mut on_progress = |p: TrainProgress<'_>| match p {
        TrainProgress::Recorded { .. } => bar.advance(1),
        TrainProgress::Baseline => bar.message("held-out perplexity without skipping"),
        TrainProgress::Trying { k } => {
            bar.message(&format!("threshold {}/{}", k + 1, CANDIDATES.len()))
        }
        TrainProgress::Tried {
            threshold: t,
            base_ppl,
            within_budget,
            ..
        } => {
            bar.line(&format!(
                "  τ = {:.4} ({:>2.0}% labelled skippable after layer {decision}): held-out \
                 PPL {:.4} ({:+.2}%), {:.1}% of layer evaluations skipped{}",
                t.tau,
                t.labelled * 100.0,
                t.ppl,
                100.0 * (t.ppl / base_ppl - 1.0),
                100.0 * t.stats.skip_fraction(),
                if within_budget {
                    ""
                } else {
                    "  -> over the budget"
                }
            ));
            if within_budget {
                bar.advance(1);
            }
        }
        TrainProgress::Pairs => bar.message("training every (decision, layer) pair"),
    };
    let id = SkipModelId::of(&engine.runner.model);
    let cal = train::calibrate(
        &mut engine.runner,
        &mut engine.kv,
        id,
        &train,
        held_out,
        &TrainOptions {
            rank: args.rank,
            budget_pct: args.budget,
        },
        &mut on_progress,
    )?;
    bar.finish();
    cal.predictor.save(&output)?;

    // Summary.
    let tau = cal.chosen.tau;
    let conf = skip::DEFAULT_CONFIDENCE;
    eprintln!(
        "per layer, over {} training tokens: mean cosine(input, output), share with cosine >= \
         τ = {tau:.4}, share the predictor at layer {decision} skips (p >= {conf})",
        cal.train_tokens
    );
    eprintln!("  layer  mean cos  >= τ     predicted");
    for (j, l) in cal.layers.iter().enumerate() {
        eprintln!(
            "  {j:>5}  {:>8.4}  {:>5.1}%  {:>8.1}%",
            l.mean_cos,
            100.0 * l.labelled,
            100.0 * l.predicted
        );
    }
    if cal.never_skips() {
        eprintln!(
            "warning: even the strictest threshold cost more than {}% perplexity on the held-out \
             chunk: this predictor never skips",
            args.budget
        );
    }
    eprintln!(
        "held-out chunk: PPL {:.4} without skipping, {:.4} with ({:+.2}%), {:.1}% of layer \
         evaluations skipped (max-skip {}, confidence {conf})",
        cal.base_ppl,
        cal.chosen.ppl,
        100.0 * (cal.chosen.ppl / cal.base_ppl - 1.0),
        100.0 * cal.chosen.stats.skip_fraction(),
        skip::DEFAULT_MAX_SKIP
    );
    outln!("wrote {}", output.display());
    Ok(ExitCode::SUCCESS)
}
