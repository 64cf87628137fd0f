//! `ringllm calibrate`: trains the predictor of predictive layer skip (`--skip auto`).
//!
//! The text is cut into chunks of `--ctx` tokens as `perplexity` does; the last chunk is held
//! out. Over the others, every layer `j`'s input and output states are recorded per token:
//! the cosine `cos(h_in_j, h_out_j)` (how little the layer changes the token's residual
//! stream) and the features of `h_in_j` (`ringllm_model::skip`: RMS-normalised, projected on
//! the leading principal directions of the first chunk's states, whitened).
//!
//! A layer counts as skippable for a token when its cosine is at least τ. τ is chosen on the
//! held-out chunk: candidates from strict to loose (the cosines above which 2%, 5%, 10%, …
//! of the (token, layer) pairs after the decision layer fall), and for each the predictors of
//! the decision layer are trained and the held-out perplexity measured with the real skipping
//! forward pass; the loosest τ whose perplexity stays within `--budget` % of the unskipped
//! one wins. Then a logistic regression is trained for every pair `(e, j)`, `e ≤ j` (any
//! decision point: a node of a ring decides at the first layer of its window).
//!
//! The decision layer of a whole model is a third of the way down: the first layers change
//! the states the most (low cosines, rarely skippable) and their input carries little of
//! what the later layers will do, while a later point leaves fewer layers to skip.

use crate::cli::CalibrateArgs;
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use ringllm::engine::{Engine, ModelOptions};
use ringllm::skip::{default_predictor_path, model_id};
use ringllm_model::skip::{self, Predictor, SkipPolicy, SkipStats};
use std::process::ExitCode;
use std::sync::Arc;

/// Fractions of the (token, layer ≥ decision) pairs labelled skippable, tried in turn.
const CANDIDATES: [f64; 14] = [
    0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95,
];
/// Weight decay of the logistic regressions (features have unit variance).
const L2: f64 = 1.0;
/// Rows of hidden states the principal directions are computed from, at most.
const PCA_ROWS: usize = 6144;

/// What the calibration pass recorded.
struct Data {
    d: usize,
    rank: usize,
    /// Per layer: the cosine of every training token.
    cos: Vec<Vec<f32>>,
    /// Per layer: the features of the state entering it, `rank` per token.
    feats: Vec<Vec<f32>>,
    /// Per layer: the first chunk's input states, until the projection exists.
    states: Vec<Vec<f32>>,
    mean: Vec<f32>,
    proj: Vec<f32>,
}

impl Data {
    fn has_projection(&self) -> bool {
        !self.proj.is_empty()
    }

    /// Records layer `il`'s input `inp` and output `out` rows, the first at position `pos`.
    /// Position 0 is left out: the forward pass never skips it (the attention sink).
    fn record(&mut self, il: usize, pos: usize, inp: &[f32], out: &[f32]) {
        let (d, rank) = (self.d, self.rank);
        let mut f = vec![0f32; rank];
        let from = usize::from(pos == 0);
        for (a, b) in inp.chunks_exact(d).zip(out.chunks_exact(d)).skip(from) {
            self.cos[il].push(skip::cosine(a, b));
            if self.has_projection() {
                skip::features(a, &self.mean, &self.proj, rank, &mut f);
                self.feats[il].extend_from_slice(&f);
            } else {
                self.states[il].extend_from_slice(a);
            }
        }
    }

    /// The projection from the states kept so far, which then become features.
    fn fit_projection(&mut self) {
        let d = self.d;
        let rows: usize = self.states.iter().map(|s| s.len() / d).sum();
        let step = rows.div_ceil(PCA_ROWS).max(1);
        let mut pooled = Vec::with_capacity((rows / step + 1) * d);
        let mut norm = vec![0f32; d];
        for (k, row) in self
            .states
            .iter()
            .flat_map(|s| s.chunks_exact(d))
            .enumerate()
        {
            if k % step == 0 {
                skip::rms_normalise(row, &mut norm);
                pooled.extend_from_slice(&norm);
            }
        }
        let (mean, proj) = skip::pca(&pooled, d, self.rank, 0x5EED);
        self.mean = mean;
        self.proj = proj;
        let mut f = vec![0f32; self.rank];
        for il in 0..self.states.len() {
            let states = std::mem::take(&mut self.states[il]);
            for row in states.chunks_exact(d) {
                skip::features(row, &self.mean, &self.proj, self.rank, &mut f);
                self.feats[il].extend_from_slice(&f);
            }
        }
    }
}

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
    let train = n_chunks - 1;
    let held_out = &tokens[train * ctx..(train + 1) * ctx];
    let decision = ((nl as f64 / 3.0).round() as usize).clamp(1, nl - 1);
    eprintln!(
        "calibrate: {} tokens, {train} chunk(s) of {ctx} to train on, 1 held out | {nl} layers, \
         decision layer {decision}, rank {}",
        tokens.len(),
        args.rank
    );
    let bar = ProgressBar::new((train + CANDIDATES.len() + 1) as u64).with_style(
        ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_prefix("calibrate");
    bar.set_message("hidden states");

    // 1. The states and cosines of every training token and layer.
    let mut data = Data {
        d,
        rank: args.rank,
        cos: vec![Vec::new(); nl],
        feats: vec![Vec::new(); nl],
        states: vec![Vec::new(); nl],
        mean: Vec::new(),
        proj: Vec::new(),
    };
    for c in 0..train {
        let mut chunk = tokens[c * ctx..(c + 1) * ctx].to_vec();
        if add_bos {
            if let Some(b) = engine.tokenizer.bos() {
                chunk[0] = b;
            }
        }
        engine.reset();
        run_chunk(&mut engine, &chunk, &mut |il, pos, inp, out| {
            data.record(il, pos, inp, out)
        })?;
        if c == 0 {
            data.fit_projection();
        }
        bar.inc(1);
    }

    // 2. τ: the loosest candidate whose held-out perplexity stays within the budget.
    bar.set_message("held-out perplexity without skipping");
    let (base_ppl, _) = held_out_ppl(&mut engine, held_out, ctx, add_bos, None)?;
    let limit = base_ppl * (1.0 + args.budget / 100.0);
    let mut pooled: Vec<f32> = data.cos[decision..].iter().flatten().copied().collect();
    pooled.sort_by(|a, b| b.total_cmp(a));
    let id = model_id(&engine.runner.model);
    let threads = engine.runner.threads();
    let blank = |tau: f32| {
        let mut p = Predictor::constant(id.clone(), args.rank, decision, -20.0);
        p.taus = vec![tau; nl];
        p.mean = data.mean.clone();
        p.proj = data.proj.clone();
        p
    };
    // A τ no cosine reaches: nothing is labelled skippable.
    let mut chosen: (f32, f64, f64, SkipStats) = (1.5, 0.0, base_ppl, SkipStats::default());
    for (k, q) in CANDIDATES.iter().enumerate() {
        let at = ((pooled.len() as f64 * q) as usize).min(pooled.len().saturating_sub(1));
        let tau = pooled[at];
        bar.set_message(format!("threshold {}/{}", k + 1, CANDIDATES.len()));
        let pairs: Vec<(usize, usize)> = (decision..nl).map(|j| (decision, j)).collect();
        let mut p = blank(tau);
        for ((e, j), w) in pairs.iter().zip(train_pairs(&data, &pairs, tau, threads)) {
            p.pair_mut(*e, *j).copy_from_slice(&w);
        }
        let (ppl, stats) = held_out_ppl(
            &mut engine,
            held_out,
            ctx,
            add_bos,
            Some(SkipPolicy::new(Arc::new(p))),
        )?;
        let ok = ppl <= limit;
        say(
            &bar,
            format!(
            "  τ = {tau:.4} ({:>2.0}% labelled skippable after layer {decision}): held-out PPL \
             {ppl:.4} ({:+.2}%), {:.1}% of layer evaluations skipped{}",
            q * 100.0,
            100.0 * (ppl / base_ppl - 1.0),
            100.0 * stats.skip_fraction(),
            if ok { "" } else { "  -> over the budget" }
        ),
        );
        if !ok {
            break;
        }
        chosen = (tau, *q, ppl, stats);
        bar.inc(1);
    }
    let tau = chosen.0;

    // 3. Every pair (e, j) at that τ.
    bar.set_message("training every (decision, layer) pair");
    let pairs: Vec<(usize, usize)> = (0..nl).flat_map(|e| (e..nl).map(move |j| (e, j))).collect();
    let mut predictor = blank(tau);
    for ((e, j), w) in pairs.iter().zip(train_pairs(&data, &pairs, tau, threads)) {
        predictor.pair_mut(*e, *j).copy_from_slice(&w);
    }
    bar.set_position(bar.length().unwrap_or(0));
    bar.finish_and_clear();
    predictor.save(&output)?;

    // Summary.
    let n_train = data.cos[0].len();
    let conf = skip::DEFAULT_CONFIDENCE;
    eprintln!(
        "per layer, over {n_train} training tokens: mean cosine(input, output), share with \
         cosine >= τ = {tau:.4}, share the predictor at layer {decision} skips (p >= {conf})"
    );
    eprintln!("  layer  mean cos  >= τ     predicted");
    for j in 0..nl {
        let c = &data.cos[j];
        let mean = c.iter().map(|v| *v as f64).sum::<f64>() / c.len().max(1) as f64;
        let labelled = c.iter().filter(|v| **v >= tau).count() as f64 / c.len().max(1) as f64;
        let predicted = if j >= decision {
            let f = &data.feats[decision];
            (0..n_train)
                .filter(|&t| {
                    predictor.prob(&f[t * args.rank..(t + 1) * args.rank], decision, j) >= conf
                })
                .count() as f64
                / n_train.max(1) as f64
        } else {
            0.0
        };
        eprintln!(
            "  {j:>5}  {mean:>8.4}  {:>5.1}%  {:>8.1}%",
            100.0 * labelled,
            100.0 * predicted
        );
    }
    if chosen.0 > 1.0 {
        eprintln!(
            "warning: even the strictest threshold cost more than {}% perplexity on the held-out \
             chunk: this predictor never skips",
            args.budget
        );
    }
    eprintln!(
        "held-out chunk: PPL {base_ppl:.4} without skipping, {:.4} with ({:+.2}%), {:.1}% of \
         layer evaluations skipped (max-skip {}, confidence {conf})",
        chosen.2,
        100.0 * (chosen.2 / base_ppl - 1.0),
        100.0 * chosen.3.skip_fraction(),
        skip::DEFAULT_MAX_SKIP
    );
    outln!("wrote {}", output.display());
    Ok(ExitCode::SUCCESS)
}

/// A line on stderr above the progress bar (or alone when the bar is hidden).
fn say(bar: &ProgressBar, line: String) {
    if bar.is_hidden() {
        eprintln!("{line}");
    } else {
        bar.println(line);
    }
}

/// `(layer, position of the first row, input rows, output rows)`.
type LayerRecorder<'a> = dyn FnMut(usize, usize, &[f32], &[f32]) + 'a;

/// Runs `chunk` from an empty cache, calling `f(layer, position of the first row, input
/// rows, output rows)` after each layer of each batch.
fn run_chunk(engine: &mut Engine, chunk: &[u32], f: &mut LayerRecorder<'_>) -> Result<()> {
    let d = engine.runner.model.hp.d_model;
    let batch = engine.runner.max_batch();
    let mut x = vec![0f32; batch * d];
    let mut prev = vec![0f32; batch * d];
    for (k, part) in chunk.chunks(batch).enumerate() {
        let n = part.len();
        engine.runner.embed(part, &mut x[..n * d])?;
        prev[..n * d].copy_from_slice(&x[..n * d]);
        let mut obs = |il: usize, cur: &[f32]| {
            f(il, k * batch, &prev[..n * d], cur);
            prev[..n * d].copy_from_slice(cur);
        };
        engine
            .runner
            .layers(&mut x[..n * d], n, &mut engine.kv, Some(&mut obs))?;
    }
    Ok(())
}

/// Perplexity of the held-out chunk with `policy` (`None`: no skipping), and the skip
/// counters of that pass.
fn held_out_ppl(
    engine: &mut Engine,
    held_out: &[u32],
    ctx: usize,
    add_bos: bool,
    policy: Option<SkipPolicy>,
) -> Result<(f64, SkipStats)> {
    engine.runner.set_skip(policy)?;
    engine.runner.reset_skip_stats();
    let (ppl, _) = super::perplexity::score(engine, held_out, ctx, 1, add_bos, |_, _| {})?;
    let stats = engine.runner.skip_stats();
    engine.runner.set_skip(None)?;
    Ok((ppl, stats))
}

/// Trains the logistic regression of each pair `(e, j)` at threshold `tau`, on `threads`
/// threads; the results in the order of `pairs`.
fn train_pairs(data: &Data, pairs: &[(usize, usize)], tau: f32, threads: usize) -> Vec<Vec<f32>> {
    let nl = data.cos.len();
    let labels: Vec<Vec<bool>> = (0..nl)
        .map(|j| data.cos[j].iter().map(|c| *c >= tau).collect())
        .collect();
    let mut out: Vec<Vec<f32>> = vec![Vec::new(); pairs.len()];
    let per = pairs.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        for (ps, os) in pairs.chunks(per).zip(out.chunks_mut(per)) {
            let labels = &labels;
            s.spawn(move || {
                for ((e, j), o) in ps.iter().zip(os.iter_mut()) {
                    *o = skip::train_pair(&data.feats[*e], &labels[*j], data.rank, L2);
                }
            });
        }
    });
    out
}
