//! `ringllm bench`: prefill (ppN) and decode (tgN) tokens/s at several thread counts, like
//! llama-bench, next to the memory-bandwidth roofline measured in the same run.

use crate::cli::BenchArgs;
use crate::engine::{default_threads, open_gguf};
use anyhow::{bail, Result};
use ringllm_kernels::pool::ThreadPool;
use ringllm_node::{KvType, LoadOptions, Model, Runner};
use serde::Serialize;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

#[derive(Serialize)]
struct Row {
    test: String,
    threads: usize,
    tokens_per_s: f64,
    stddev: f64,
    /// Decode only: % of the roofline (bandwidth ÷ weight bytes per token).
    roofline_pct: Option<f64>,
}

pub fn bench(args: BenchArgs) -> Result<ExitCode> {
    if args.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    let file = open_gguf(&args.model)?;
    let model = Arc::new(Model::load(file, &LoadOptions::default())?);
    let threads = if args.threads.is_empty() {
        let all = default_threads();
        if all > 1 {
            vec![1, all]
        } else {
            vec![1]
        }
    } else {
        args.threads.clone()
    };
    let bytes_per_token = model.weight_bytes_per_token();
    let vocab = model.hp.vocab;
    let max_p = args.prompt.iter().copied().max().unwrap_or(1).max(1);
    let max_g = args.gen.iter().copied().max().unwrap_or(1);
    let ctx = (max_p + max_g + 1).max(64);
    eprintln!(
        "model {} | {} | {:.1} MiB read per token | isa {}",
        args.model.display(),
        model.hp.arch.name(),
        bytes_per_token as f64 / 1048576.0,
        ringllm_kernels::isa().name()
    );
    let mut rows = Vec::new();
    for &t in &threads {
        let t = t.max(1);
        let bw = measure_bandwidth(t, bytes_per_token);
        let roof = bw / bytes_per_token as f64;
        eprintln!(
            "threads {t}: memory read bandwidth {:.2} GB/s -> decode roofline {roof:.1} tok/s",
            bw / 1e9
        );
        let mut runner = Runner::new(Arc::clone(&model), t, max_p.min(512), ctx);
        let mut logits = vec![0f32; vocab];
        let mut x = Vec::new();
        // Token ids spread over the vocabulary, skipping the first few (special) ids.
        let tok = |i: usize| (100 + (i * 7919) % (vocab.saturating_sub(100)).max(1)) as u32;
        // Warm-up: touch every weight once.
        {
            let mut kv = runner.new_cache(ctx, KvType::F32);
            runner.step(&[tok(0)], &mut kv, &mut x, &mut logits)?;
        }
        for &p in &args.prompt {
            let prompt: Vec<u32> = (0..p).map(tok).collect();
            let mut samples = Vec::new();
            for _ in 0..args.repeat {
                let mut kv = runner.new_cache(ctx, KvType::F32);
                let t0 = Instant::now();
                for chunk in prompt.chunks(runner.max_batch()) {
                    runner.step(chunk, &mut kv, &mut x, &mut logits)?;
                }
                samples.push(p as f64 / t0.elapsed().as_secs_f64());
            }
            let (mean, sd) = stats(&samples);
            rows.push(Row {
                test: format!("pp{p}"),
                threads: t,
                tokens_per_s: mean,
                stddev: sd,
                roofline_pct: None,
            });
        }
        for &g in &args.gen {
            let mut samples = Vec::new();
            for _ in 0..args.repeat {
                let mut kv = runner.new_cache(ctx, KvType::F32);
                let t0 = Instant::now();
                for i in 0..g {
                    runner.step(&[tok(i)], &mut kv, &mut x, &mut logits)?;
                }
                samples.push(g as f64 / t0.elapsed().as_secs_f64());
            }
            let (mean, sd) = stats(&samples);
            rows.push(Row {
                test: format!("tg{g}"),
                threads: t,
                tokens_per_s: mean,
                stddev: sd,
                roofline_pct: Some(100.0 * mean / roof),
            });
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("| test   | threads |          t/s | roofline |");
        println!("| ------ | ------: | -----------: | -------: |");
        for r in &rows {
            let roof = r
                .roofline_pct
                .map_or(String::from("-"), |p| format!("{p:.0}%"));
            println!(
                "| {:<6} | {:>7} | {:>6.2} ± {:<4.2} | {:>8} |",
                r.test, r.threads, r.tokens_per_s, r.stddev, roof
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn stats(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = if v.len() > 1 {
        v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

/// Read bandwidth (bytes/s) of `threads` threads streaming a buffer as large as the weights
/// one decoded token reads (so caches help it exactly as much as they help decode), at least
/// 64 MiB; best of several passes.
fn measure_bandwidth(threads: usize, bytes: usize) -> f64 {
    let buf: Vec<u8> = (0..bytes.max(64 << 20)).map(|i| i as u8).collect();
    let pool = ThreadPool::new(threads);
    ringllm_kernels::bandwidth::read_bandwidth(&pool, &buf, 8)
}
