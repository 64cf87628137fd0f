//! `ringllm perplexity`: scores a text as llama.cpp's perplexity tool does, so the figures
//! compare: the text is tokenized once and cut into consecutive chunks of `--ctx` tokens; the
//! first token of each chunk becomes BOS where the model adds one; only the second half of
//! each chunk is scored.

use crate::cli::PerplexityArgs;
use anyhow::{bail, Context, Result};
use ringllm::engine::Engine;
use ringllm_model::skip::train::{score_chunk, ChunkNll};
use std::io::Write;
use std::process::ExitCode;

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
    outln!(
        "Final estimate: PPL = {:.4} +/- {:.5}",
        res.ppl(),
        res.ppl_error()
    );
    Ok(ExitCode::SUCCESS)
}

/// Scores `n_chunks` chunks (`nll.ppl()` is the perplexity, `nll.ppl_error()` its standard
/// error), calling `progress` with the running figure after each chunk.
pub fn score(
    engine: &mut Engine,
    tokens: &[u32],
    ctx: usize,
    n_chunks: usize,
    add_bos: bool,
    mut progress: impl FnMut(usize, f64),
) -> Result<ChunkNll> {
    let mut nll = ChunkNll::default();
    for c in 0..n_chunks {
        let mut chunk = tokens[c * ctx..(c + 1) * ctx].to_vec();
        if add_bos {
            if let Some(b) = engine.tokenizer.bos() {
                chunk[0] = b;
            }
        }
        engine.reset();
        score_chunk(&mut engine.runner, &mut engine.kv, &chunk, &mut nll)?;
        progress(c, nll.ppl());
    }
    Ok(nll)
}
