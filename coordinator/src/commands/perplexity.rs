//! `ringllm perplexity`: scores a text as llama.cpp's perplexity tool does, so the figures
//! compare: the text is tokenized once and cut into consecutive chunks of `--ctx` tokens; the
//! first token of each chunk becomes BOS where the model adds one; only the second half of
//! each chunk is scored.

use crate::cli::PerplexityArgs;
use anyhow::{bail, Context, Result};
use ringllm::engine::Engine;
use std::io::Write;
use std::process::ExitCode;

/// Rows of logits computed at once (bounds memory: rows × vocab floats).
const LOGIT_ROWS: usize = 16;

pub fn perplexity(args: PerplexityArgs) -> Result<ExitCode> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let mut margs = args.model.clone();
    let ctx = margs.ctx.unwrap_or(512);
    margs.ctx = Some(ctx);
    let mut engine = Engine::load(&ringllm::engine::ModelOptions::from(&margs))?;
    let skip = ringllm::skip::SkipOptions::from(&args.skip);
    ringllm::skip::apply(&mut engine.runner, &skip, &margs.model)?;
    let add_bos = engine.tokenizer.add_bos_default();
    let tokens = engine.tokenizer.encode(&text, add_bos)?;
    if tokens.len() < 2 * ctx {
        bail!(
            "{} has {} tokens; at least {} (2 × --ctx) are needed",
            args.file.display(),
            tokens.len(),
            2 * ctx
        );
    }
    let mut n_chunks = tokens.len() / ctx;
    if let Some(c) = args.chunks {
        n_chunks = n_chunks.min(c.max(1));
    }
    eprintln!(
        "perplexity: {} tokens, {n_chunks} chunks of {ctx}",
        tokens.len()
    );
    let res = score(&mut engine, &tokens, ctx, n_chunks, add_bos, |i, ppl| {
        eprint!("[{}]{ppl:.4},", i + 1);
        let _ = std::io::stderr().flush();
    })?;
    eprintln!();
    if engine.runner.skip_policy().is_some() {
        let s = engine.runner.skip_stats();
        let tokens = (s.evaluations / engine.runner.model.layers.len().max(1) as u64).max(1);
        outln!(
            "{}; per token {:.3} MiB of layer weights skipped",
            super::run::skip_line(&s),
            s.skipped_weight_bytes as f64 / tokens as f64 / 1048576.0
        );
    }
    outln!("Final estimate: PPL = {:.4} +/- {:.5}", res.0, res.1);
    Ok(ExitCode::SUCCESS)
}

/// Returns (perplexity, its standard error) over `n_chunks` chunks, calling `progress` with
/// the running figure after each chunk.
pub fn score(
    engine: &mut Engine,
    tokens: &[u32],
    ctx: usize,
    n_chunks: usize,
    add_bos: bool,
    mut progress: impl FnMut(usize, f64),
) -> Result<(f64, f64)> {
    let d = engine.runner.model.hp.d_model;
    let vocab = engine.vocab();
    let first = ctx / 2;
    let batch = engine.runner.max_batch();
    let mut x = vec![0f32; batch * d];
    let mut logits = vec![0f32; LOGIT_ROWS * vocab];
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    for c in 0..n_chunks {
        let mut chunk = tokens[c * ctx..(c + 1) * ctx].to_vec();
        if add_bos {
            if let Some(b) = engine.tokenizer.bos() {
                chunk[0] = b;
            }
        }
        engine.reset();
        for (bi, part) in chunk.chunks(batch).enumerate() {
            let n = part.len();
            let start = bi * batch;
            let xs = &mut x[..n * d];
            engine.runner.embed(part, xs)?;
            engine.runner.layers(xs, n, &mut engine.kv, None)?;
            engine.runner.final_norm(xs, n)?;
            // Positions first..ctx-2 predict tokens first+1..ctx-1.
            let lo = first.max(start);
            let hi = (ctx - 1).min(start + n);
            let mut p = lo;
            while p < hi {
                let rows = (hi - p).min(LOGIT_ROWS);
                let src = &xs[(p - start) * d..(p - start + rows) * d];
                engine
                    .runner
                    .logits(src, rows, &mut logits[..rows * vocab])?;
                for r in 0..rows {
                    let row = &logits[r * vocab..(r + 1) * vocab];
                    let target = chunk[p + r + 1] as usize;
                    let v = -log_softmax_at(row, target);
                    nll += v;
                    nll2 += v * v;
                    count += 1;
                }
                p += rows;
            }
        }
        progress(c, (nll / count as f64).exp());
    }
    let mean = nll / count as f64;
    let var = nll2 / count as f64 - mean * mean;
    let err = if var > 0.0 && count > 1 {
        (var / (count as f64 - 1.0)).sqrt() * mean.exp()
    } else {
        0.0
    };
    Ok((mean.exp(), err))
}

fn log_softmax_at(row: &[f32], i: usize) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|v| (*v as f64 - max).exp()).sum();
    row[i] as f64 - max - sum.ln()
}
