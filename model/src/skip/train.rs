//! Training the predictor of predictive layer skip (`ringllm calibrate`, `--skip auto`).
//!
//! The caller cuts a text into chunks of equal length (as `perplexity` does) and holds the
//! last one out. Over the others, every layer `j`'s input and output states are recorded per
//! token: the cosine `cos(h_in_j, h_out_j)` (how little the layer changes the token's
//! residual stream) and the features of `h_in_j` (RMS-normalised, projected on the leading
//! principal directions of the first chunk's states, whitened: see [`super::features`]).
//!
//! A layer counts as skippable for a token when its cosine is at least τ. τ is chosen on the
//! held-out chunk: candidates from strict to loose (the cosines above which 2%, 5%, 10%, …
//! of the (token, layer) pairs after the decision layer fall), and for each the predictors of
//! the decision layer are trained and the held-out perplexity measured with the real skipping
//! forward pass; the loosest τ whose perplexity stays within the budget of the unskipped one
//! wins. Then a logistic regression is trained for every pair `(e, j)`, `e ≤ j` (any decision
//! point: a node of a ring decides at the first layer of its window).
//!
//! The decision layer of a whole model is a third of the way down: the first layers change
//! the states the most (low cosines, rarely skippable) and their input carries little of
//! what the later layers will do, while a later point leaves fewer layers to skip.

use super::{Predictor, SkipModelId, SkipPolicy, SkipStats};
use crate::error::ModelError;
use crate::forward::Runner;
use crate::kv::KvCache;
use std::sync::Arc;

/// Fractions of the (token, layer ≥ decision) pairs labelled skippable, tried in turn.
pub const CANDIDATES: [f64; 14] = [
    0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95,
];
/// Weight decay of the logistic regressions (features have unit variance).
const L2: f64 = 1.0;
/// Rows of hidden states the principal directions are computed from, at most.
const PCA_ROWS: usize = 6144;
/// Rows of logits computed at once when scoring (bounds memory: rows × vocab floats).
const LOGIT_ROWS: usize = 16;
/// The threshold of a predictor that never skips: no cosine reaches it.
const NEVER: f32 = 1.5;

/// What to train.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// Features per token (the projection's rank), 1 to min(d, 256).
    pub rank: usize,
    /// Most perplexity increase on the held-out chunk the chosen threshold may cost, in %.
    pub budget_pct: f64,
}

/// One threshold tried, or the one chosen.
#[derive(Clone, Debug)]
pub struct Threshold {
    /// The cosine a layer's output must keep with its input to count as skippable.
    pub tau: f32,
    /// The share of (token, layer ≥ decision) training pairs labelled skippable at `tau`.
    pub labelled: f64,
    /// The held-out perplexity with the decision layer's predictors at `tau`.
    pub ppl: f64,
    /// What the skipping forward pass skipped on the held-out chunk.
    pub stats: SkipStats,
}

/// Per layer, over the training tokens.
#[derive(Clone, Copy, Debug)]
pub struct LayerSummary {
    /// Mean cosine of the layer's input and output.
    pub mean_cos: f64,
    /// Share of tokens whose cosine is at least the chosen τ.
    pub labelled: f64,
    /// Share of tokens the predictor at the decision layer skips (probability at least
    /// [`super::DEFAULT_CONFIDENCE`]); 0 before the decision layer.
    pub predicted: f64,
}

/// A trained predictor and how it was chosen.
#[derive(Clone, Debug)]
pub struct Calibration {
    pub predictor: Predictor,
    pub decision: usize,
    /// Held-out perplexity without skipping.
    pub base_ppl: f64,
    /// The threshold chosen (`tau` above 1 when even the strictest candidate cost more than
    /// the budget: the predictor never skips).
    pub chosen: Threshold,
    /// Tokens trained on (per layer).
    pub train_tokens: usize,
    pub layers: Vec<LayerSummary>,
}

impl Calibration {
    /// True when no candidate stayed within the budget: the predictor never skips.
    pub fn never_skips(&self) -> bool {
        self.chosen.tau > 1.0
    }
}

/// How far the training is, for a progress display.
#[derive(Debug)]
pub enum Progress<'a> {
    /// Training chunk `done` of `of` recorded.
    Recorded { done: usize, of: usize },
    /// Scoring the held-out chunk without skipping.
    Baseline,
    /// Candidate threshold `k` (from 0) of [`CANDIDATES`] is being tried.
    Trying { k: usize },
    /// Candidate `k` tried: its result, the held-out perplexity without skipping, and
    /// whether it stayed within the budget (the first that does not ends the search).
    Tried {
        k: usize,
        threshold: &'a Threshold,
        base_ppl: f64,
        within_budget: bool,
    },
    /// Training every (decision, layer) pair at the chosen threshold.
    Pairs,
}

/// The decision layer of a whole model of `n_layer` layers: a third of the way down.
pub fn decision_layer(n_layer: usize) -> usize {
    ((n_layer as f64 / 3.0).round() as usize).clamp(1, n_layer.saturating_sub(1).max(1))
}

/// Trains a predictor for `runner`'s model (`id` is its identity) on `train` chunks, choosing
/// the threshold on `held_out` (a chunk of the same length). Each chunk is scored from an
/// empty `kv`, as given (BOS already in place where the model adds one). `progress` hears how
/// far it is. The runner's skip policy is left off.
pub fn calibrate(
    runner: &mut Runner,
    kv: &mut KvCache,
    id: SkipModelId,
    train: &[&[u32]],
    held_out: &[u32],
    opts: &TrainOptions,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Calibration, ModelError> {
    let hp = runner.model.hp.clone();
    let (nl, d) = (hp.n_layer, hp.d_model);
    let bad = |why: String| Err(ModelError::SkipPredictor { why });
    if opts.rank == 0 || opts.rank > d.min(256) {
        return bad(format!(
            "rank {} must be between 1 and {}",
            opts.rank,
            d.min(256)
        ));
    }
    if nl < 2 {
        return bad(format!("the model has {nl} layer(s): nothing to skip"));
    }
    if train.is_empty() || held_out.len() < 2 {
        return bad("calibration needs at least one training chunk and a held-out one".into());
    }
    let decision = decision_layer(nl);

    // 1. The states and cosines of every training token and layer.
    let mut data = Data {
        d,
        rank: opts.rank,
        cos: vec![Vec::new(); nl],
        feats: vec![Vec::new(); nl],
        states: vec![Vec::new(); nl],
        mean: Vec::new(),
        proj: Vec::new(),
    };
    for (c, chunk) in train.iter().enumerate() {
        kv.truncate(0);
        run_chunk(runner, kv, chunk, &mut |il, pos, inp, out| {
            data.record(il, pos, inp, out)
        })?;
        if c == 0 {
            data.fit_projection();
        }
        progress(Progress::Recorded {
            done: c + 1,
            of: train.len(),
        });
    }

    // 2. τ: the loosest candidate whose held-out perplexity stays within the budget.
    progress(Progress::Baseline);
    let (base_ppl, _) = held_out_ppl(runner, kv, held_out, None)?;
    let limit = base_ppl * (1.0 + opts.budget_pct / 100.0);
    let mut pooled: Vec<f32> = data.cos[decision..].iter().flatten().copied().collect();
    pooled.sort_by(|a, b| b.total_cmp(a));
    let threads = runner.threads();
    let blank = |tau: f32| {
        let mut p = Predictor::constant(id.clone(), opts.rank, decision, -20.0);
        p.taus = vec![tau; nl];
        p.mean = data.mean.clone();
        p.proj = data.proj.clone();
        p
    };
    let mut chosen = Threshold {
        tau: NEVER,
        labelled: 0.0,
        ppl: base_ppl,
        stats: SkipStats::default(),
    };
    for (k, q) in CANDIDATES.iter().enumerate() {
        let at = ((pooled.len() as f64 * q) as usize).min(pooled.len().saturating_sub(1));
        let Some(&tau) = pooled.get(at) else { break };
        progress(Progress::Trying { k });
        let pairs: Vec<(usize, usize)> = (decision..nl).map(|j| (decision, j)).collect();
        let mut p = blank(tau);
        for ((e, j), w) in pairs.iter().zip(train_pairs(&data, &pairs, tau, threads)) {
            p.pair_mut(*e, *j).copy_from_slice(&w);
        }
        let (ppl, stats) = held_out_ppl(runner, kv, held_out, Some(SkipPolicy::new(Arc::new(p))))?;
        let tried = Threshold {
            tau,
            labelled: *q,
            ppl,
            stats,
        };
        let within_budget = ppl <= limit;
        progress(Progress::Tried {
            k,
            threshold: &tried,
            base_ppl,
            within_budget,
        });
        if !within_budget {
            break;
        }
        chosen = tried;
    }
    let tau = chosen.tau;

    // 3. Every pair (e, j) at that τ.
    progress(Progress::Pairs);
    let pairs: Vec<(usize, usize)> = (0..nl).flat_map(|e| (e..nl).map(move |j| (e, j))).collect();
    let mut predictor = blank(tau);
    for ((e, j), w) in pairs.iter().zip(train_pairs(&data, &pairs, tau, threads)) {
        predictor.pair_mut(*e, *j).copy_from_slice(&w);
    }

    // Summary.
    let n_train = data.cos[0].len();
    let conf = super::DEFAULT_CONFIDENCE;
    let layers = (0..nl)
        .map(|j| {
            let c = &data.cos[j];
            let mean_cos = c.iter().map(|v| *v as f64).sum::<f64>() / c.len().max(1) as f64;
            let labelled = c.iter().filter(|v| **v >= tau).count() as f64 / c.len().max(1) as f64;
            let predicted = if j >= decision {
                let f = &data.feats[decision];
                (0..n_train)
                    .filter(|&t| {
                        predictor.prob(&f[t * opts.rank..(t + 1) * opts.rank], decision, j) >= conf
                    })
                    .count() as f64
                    / n_train.max(1) as f64
            } else {
                0.0
            };
            LayerSummary {
                mean_cos,
                labelled,
                predicted,
            }
        })
        .collect();
    Ok(Calibration {
        predictor,
        decision,
        base_ppl,
        chosen,
        train_tokens: n_train,
        layers,
    })
}

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
            self.cos[il].push(super::cosine(a, b));
            if self.has_projection() {
                super::features(a, &self.mean, &self.proj, rank, &mut f);
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
                super::rms_normalise(row, &mut norm);
                pooled.extend_from_slice(&norm);
            }
        }
        let (mean, proj) = super::pca(&pooled, d, self.rank, 0x5EED);
        self.mean = mean;
        self.proj = proj;
        let mut f = vec![0f32; self.rank];
        for il in 0..self.states.len() {
            let states = std::mem::take(&mut self.states[il]);
            for row in states.chunks_exact(d) {
                super::features(row, &self.mean, &self.proj, self.rank, &mut f);
                self.feats[il].extend_from_slice(&f);
            }
        }
    }
}

/// `(layer, position of the first row, input rows, output rows)`.
type LayerRecorder<'a> = dyn FnMut(usize, usize, &[f32], &[f32]) + 'a;

/// Runs `chunk` into `kv` (empty), calling `f(layer, position of the first row, input rows,
/// output rows)` after each layer of each batch.
fn run_chunk(
    runner: &mut Runner,
    kv: &mut KvCache,
    chunk: &[u32],
    f: &mut LayerRecorder<'_>,
) -> Result<(), ModelError> {
    let d = runner.model.hp.d_model;
    let batch = runner.max_batch();
    let mut x = vec![0f32; batch * d];
    let mut prev = vec![0f32; batch * d];
    for (k, part) in chunk.chunks(batch).enumerate() {
        let n = part.len();
        runner.embed(part, &mut x[..n * d])?;
        prev[..n * d].copy_from_slice(&x[..n * d]);
        let mut obs = |il: usize, cur: &[f32]| {
            f(il, k * batch, &prev[..n * d], cur);
            prev[..n * d].copy_from_slice(cur);
        };
        runner.layers(&mut x[..n * d], n, kv, Some(&mut obs))?;
    }
    Ok(())
}

/// Negative log-likelihoods of the tokens of chunks scored as llama.cpp's perplexity tool
/// does (see [`score_chunk`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ChunkNll {
    /// Sum of the negative log-likelihoods.
    pub sum: f64,
    /// Sum of their squares.
    pub sum_sq: f64,
    /// Tokens scored.
    pub count: usize,
}

impl ChunkNll {
    /// The perplexity so far.
    pub fn ppl(&self) -> f64 {
        (self.sum / self.count as f64).exp()
    }

    /// The standard error of the perplexity.
    pub fn ppl_error(&self) -> f64 {
        let n = self.count as f64;
        let mean = self.sum / n;
        let var = self.sum_sq / n - mean * mean;
        if var > 0.0 && self.count > 1 {
            (var / (n - 1.0)).sqrt() * mean.exp()
        } else {
            0.0
        }
    }
}

/// Scores `chunk` as llama.cpp's perplexity tool does, adding to `out`: the chunk is run
/// from an empty `kv` and only its second half is scored (positions `len/2 .. len-1` predict
/// the tokens after them).
pub fn score_chunk(
    runner: &mut Runner,
    kv: &mut KvCache,
    chunk: &[u32],
    out: &mut ChunkNll,
) -> Result<(), ModelError> {
    let ctx = chunk.len();
    let d = runner.model.hp.d_model;
    let vocab = runner.model.hp.vocab;
    let first = ctx / 2;
    let batch = runner.max_batch();
    let mut x = vec![0f32; batch * d];
    let mut logits = vec![0f32; LOGIT_ROWS * vocab];
    kv.truncate(0);
    for (bi, part) in chunk.chunks(batch).enumerate() {
        let n = part.len();
        let start = bi * batch;
        let xs = &mut x[..n * d];
        runner.embed(part, xs)?;
        runner.layers(xs, n, kv, None)?;
        runner.final_norm(xs, n)?;
        // Positions first..ctx-2 predict tokens first+1..ctx-1.
        let lo = first.max(start);
        let hi = ctx.saturating_sub(1).min(start + n);
        let mut p = lo;
        while p < hi {
            let rows = (hi - p).min(LOGIT_ROWS);
            let src = &xs[(p - start) * d..(p - start + rows) * d];
            runner.logits(src, rows, &mut logits[..rows * vocab])?;
            for r in 0..rows {
                let row = &logits[r * vocab..(r + 1) * vocab];
                let target = chunk[p + r + 1] as usize;
                let v = -log_softmax_at(row, target);
                out.sum += v;
                out.sum_sq += v * v;
                out.count += 1;
            }
            p += rows;
        }
    }
    Ok(())
}

fn log_softmax_at(row: &[f32], i: usize) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|v| (*v as f64 - max).exp()).sum();
    row[i] as f64 - max - sum.ln()
}

/// Perplexity of the held-out chunk with `policy` (`None`: no skipping), and the skip
/// counters of that pass.
fn held_out_ppl(
    runner: &mut Runner,
    kv: &mut KvCache,
    held_out: &[u32],
    policy: Option<SkipPolicy>,
) -> Result<(f64, SkipStats), ModelError> {
    runner.set_skip(policy)?;
    runner.reset_skip_stats();
    let mut nll = ChunkNll::default();
    let scored = score_chunk(runner, kv, held_out, &mut nll);
    let stats = runner.skip_stats();
    runner.set_skip(None)?;
    scored?;
    Ok((nll.ppl(), stats))
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
                    *o = super::train_pair(&data.feats[*e], &labels[*j], data.rank, L2);
                }
            });
        }
    });
    out
}

#[cfg(test)]
mod tests;
