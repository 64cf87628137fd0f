//! `ringllm bench model`: prefill (ppN) and decode (tgN) tokens/s at several thread counts,
//! like llama-bench, next to the memory-bandwidth roofline measured in the same run.

use crate::cli::{parse_memory, SkipArgs, StreamArgs};
use anyhow::{bail, Result};
use clap::Args;
use ringllm::engine::{default_threads, open_gguf};
use ringllm_kernels::pool::ThreadPool;
use ringllm_model::{KvType, Runner};
use serde::Serialize;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

/// What to measure and how often: `bench model` and `bench ring`.
#[derive(Args, Debug, Clone)]
pub struct SpeedArgs {
    /// Prompt lengths to measure prefill at.
    #[arg(short = 'p', long, value_delimiter = ',', default_values_t = vec![64usize, 512])]
    pub prompt: Vec<usize>,
    /// Tokens to generate for the decode measure.
    #[arg(short = 'n', long, value_delimiter = ',', default_values_t = vec![64usize])]
    pub gen: Vec<usize>,
    /// Thread counts (default: 1 and all physical cores; `bench ring`: the first, per
    /// process, default the cluster file's, else 1).
    #[arg(short = 't', long, value_delimiter = ',')]
    pub threads: Vec<usize>,
    /// Repetitions of each measure.
    #[arg(short = 'r', long, default_value_t = 5)]
    pub repeat: usize,
    /// Print results as JSON.
    #[arg(long)]
    pub json: bool,
    /// Measure the weights in the file's layout (as `run --no-repack`; `bench ring`: the
    /// single process and the coordinator's part).
    #[arg(long)]
    pub no_repack: bool,
    /// The most memory this process may use, e.g. "2GiB": layers beyond it are streamed.
    #[arg(long, value_parser = parse_memory)]
    pub memory: Option<u64>,
    #[command(flatten)]
    pub stream: StreamArgs,
}

impl SpeedArgs {
    /// Fails on settings that measure nothing.
    pub fn check(&self) -> Result<()> {
        if self.repeat == 0 {
            bail!("--repeat must be at least 1");
        }
        Ok(())
    }

    /// The longest prompt and the longest generation measured (at least 1 each).
    pub fn longest(&self) -> (usize, usize) {
        (
            self.prompt.iter().copied().max().unwrap_or(1).max(1),
            self.gen.iter().copied().max().unwrap_or(1),
        )
    }
}

/// `ringllm bench model`.
#[derive(Args, Debug, Clone)]
pub struct ModelBenchArgs {
    /// GGUF model file.
    #[arg(short, long)]
    pub model: PathBuf,
    #[command(flatten)]
    pub speed: SpeedArgs,
    /// What runs the layers and the head: cpu, gpu (reports the adapter; its roofline is the
    /// GPU's measured matrix × vector bandwidth) or auto.
    #[arg(long, default_value = "cpu")]
    pub backend: ringllm_model::BackendChoice,
    #[command(flatten)]
    pub skip: SkipArgs,
    /// A mixture of experts picks its experts uniformly at random instead of by its routers
    /// (the worst case of an expert cache; random weights' routers favour a few experts).
    /// Speed only: the outputs are meaningless.
    #[arg(long)]
    pub uniform_routing: bool,
}

#[derive(Serialize)]
struct Row {
    test: String,
    threads: usize,
    tokens_per_s: f64,
    stddev: f64,
    /// Decode only: % of the roofline (bandwidth ÷ weight bytes per token).
    roofline_pct: Option<f64>,
    /// Decode only: the roofline itself, tokens/s (measured read bandwidth ÷ weight bytes
    /// per token).
    roofline_tokens_per_s: Option<f64>,
    /// The kernel set (or the GPU adapter) and the machine the figure came from.
    isa: String,
    machine: String,
    /// Decode with streamed layers: what the streamed tier cost.
    #[serde(skip_serializing_if = "Option::is_none")]
    streaming: Option<StreamRow>,
}

/// Decode with layers streamed from disk, per token: bytes read, time stalled on I/O, and the
/// bound `max(compute, streamed bytes ÷ read rate)` with the read rate measured on the file
/// with the page cache bypassed.
#[derive(serde::Serialize, Clone, Copy)]
struct StreamRow {
    resident_mib: f64,
    streamed_mib_per_token: f64,
    stall_ms_per_token: f64,
    compute_ms_per_token: f64,
    read_mb_per_s: f64,
    io_ms_per_token: f64,
    bound_tokens_per_s: f64,
    pct_of_bound: f64,
    /// Experts streamed: the share of used experts found in the cache, and of those used
    /// where a prediction was made, the share it named.
    expert_hit_pct: Option<f64>,
    expert_prediction_pct: Option<f64>,
}

/// `ringllm bench model -m MODEL`: ppN and tgN at each thread count.
pub fn bench_model(a: &ModelBenchArgs) -> Result<ExitCode> {
    let args = &a.speed;
    args.check()?;
    let model_path = a.model.clone();
    let file = open_gguf(&model_path)?;
    let threads = thread_counts(args);
    let (max_p, max_g) = args.longest();
    let model = Arc::new(ringllm::engine::load_whole(
        &file,
        &ringllm::engine::ModelOptions {
            model: model_path.clone(),
            threads: threads.iter().copied().max(),
            ctx: Some((max_p + max_g + 1).max(64)),
            batch: max_p,
            kv: KvType::F32,
            repack: !args.no_repack,
            memory: args.memory,
            stream: args.stream.settings(),
            backend: a.backend,
        },
        threads.iter().copied().max().unwrap_or(1),
    )?);
    let bytes_per_token = model.weight_bytes_per_token();
    let ctx = (max_p + max_g + 1).max(64);
    eprintln!(
        "model {} | {} | {:.1} MiB read per token ({:.1} MiB repacked into panels) | isa {} | {}",
        model_path.display(),
        model.hp.arch.name(),
        bytes_per_token as f64 / 1048576.0,
        model.packed_bytes() as f64 / 1048576.0,
        ringllm_kernels::isa().name(),
        ringllm_model::sys::machine_summary()
    );
    // Off the CPU: the adapter's name, and its measured matrix × vector bandwidth as the
    // roofline (host threads only embed and sample: one thread).
    let gpu = ringllm_model::backend::probe(a.backend)?;
    let threads = if gpu.is_some() { vec![1] } else { threads };
    let isa = match &gpu {
        Some((name, speed)) => {
            eprintln!(
                "backend {name}: measured matvec bandwidth {:.2} GB/s (Q4_0 4096 × 4096)",
                speed / 1e9
            );
            name.clone()
        }
        None => ringllm_kernels::isa().name().to_string(),
    };
    let bench = Bench {
        a,
        model: &model,
        gpu_bandwidth: gpu.map(|(_, speed)| speed),
        isa,
        bytes_per_token,
        max_p,
        ctx,
    };
    let mut rows = Vec::new();
    for &t in &threads {
        rows.extend(bench.at_threads(t.max(1))?);
    }
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print_table(&rows);
    }
    Ok(ExitCode::SUCCESS)
}

/// `-t`, else 1 and all physical cores (just 1 on one core).
fn thread_counts(args: &SpeedArgs) -> Vec<usize> {
    if args.threads.is_empty() {
        let all = default_threads();
        if all > 1 {
            vec![1, all]
        } else {
            vec![1]
        }
    } else {
        args.threads.clone()
    }
}

/// The loaded model and what the measures at every thread count share.
struct Bench<'a> {
    a: &'a ModelBenchArgs,
    model: &'a Arc<ringllm_model::Model>,
    /// Off the CPU: the adapter's measured matrix × vector bandwidth, bytes/s.
    gpu_bandwidth: Option<f64>,
    isa: String,
    bytes_per_token: usize,
    max_p: usize,
    ctx: usize,
}

/// The buffers one runner's steps write into.
struct Scratch {
    logits: Vec<f32>,
    x: Vec<f32>,
}

impl Bench<'_> {
    /// Token `i` of a measure: ids spread over the vocabulary, skipping the first few
    /// (special) ids.
    fn tok(&self, i: usize) -> u32 {
        let vocab = self.model.hp.vocab;
        (100 + (i * 7919) % (vocab.saturating_sub(100)).max(1)) as u32
    }

    /// The roofline, then every prefill and decode measure, at `t` threads.
    fn at_threads(&self, t: usize) -> Result<Vec<Row>> {
        let model = self.model;
        // A model that streams does not fit the memory: probe with 64 MiB (beyond any cache).
        let probe = if model.streamer.is_some() || model.experts.is_some() {
            64 << 20
        } else {
            self.bytes_per_token
        };
        let bw = match self.gpu_bandwidth {
            Some(speed) => speed,
            None => measure_bandwidth(t, probe),
        };
        let roof = bw / self.bytes_per_token as f64;
        eprintln!(
            "threads {t}: read bandwidth {:.2} GB/s -> decode roofline {roof:.1} tok/s",
            bw / 1e9
        );
        let mut runner = Runner::new(Arc::clone(model), t, self.max_p.min(512), self.ctx);
        runner.set_uniform_routing(self.a.uniform_routing);
        ringllm::engine::set_backend(&mut runner, self.a.backend)?;
        ringllm::skip::apply(
            &mut runner,
            &ringllm::skip::SkipOptions::from(&self.a.skip),
            &self.a.model,
        )?;
        let mut s = Scratch {
            logits: vec![0f32; model.hp.vocab],
            x: Vec::new(),
        };
        // Warm-up: touch every weight once.
        {
            let mut kv = runner.new_cache(self.ctx, KvType::F32);
            runner.step(&[self.tok(0)], &mut kv, &mut s.x, &mut s.logits)?;
        }
        let mut rows = Vec::new();
        for &p in &self.a.speed.prompt {
            rows.push(self.prefill(&mut runner, &mut s, t, p)?);
        }
        for &g in &self.a.speed.gen {
            rows.push(self.decode(&mut runner, &mut s, t, g, roof)?);
        }
        Ok(rows)
    }

    /// ppP: prefill of `p` tokens, in batches as large as the runner takes.
    fn prefill(&self, runner: &mut Runner, s: &mut Scratch, t: usize, p: usize) -> Result<Row> {
        let prompt: Vec<u32> = (0..p).map(|i| self.tok(i)).collect();
        let mut samples = Vec::new();
        for _ in 0..self.a.speed.repeat {
            let mut kv = runner.new_cache(self.ctx, KvType::F32);
            let t0 = Instant::now();
            for chunk in prompt.chunks(runner.max_batch()) {
                runner.step(chunk, &mut kv, &mut s.x, &mut s.logits)?;
            }
            samples.push(p as f64 / t0.elapsed().as_secs_f64());
        }
        let (mean, sd) = stats(&samples);
        Ok(Row {
            test: format!("pp{p}"),
            threads: t,
            tokens_per_s: mean,
            stddev: sd,
            roofline_pct: None,
            roofline_tokens_per_s: None,
            isa: self.isa.clone(),
            machine: ringllm_model::sys::machine_summary(),
            streaming: None,
        })
    }

    /// tgG: `g` tokens decoded one at a time, against the roofline `roof` (tokens/s); what
    /// streaming and layer skipping did on the way.
    fn decode(
        &self,
        runner: &mut Runner,
        s: &mut Scratch,
        t: usize,
        g: usize,
        roof: f64,
    ) -> Result<Row> {
        let model = self.model;
        let repeat = self.a.speed.repeat;
        let mut samples = Vec::new();
        let s0 = model.streamer.as_ref().map(|s| s.stats());
        let e0 = model.experts.as_ref().map(|s| s.stats());
        runner.reset_skip_stats();
        for _ in 0..repeat {
            let mut kv = runner.new_cache(self.ctx, KvType::F32);
            let t0 = Instant::now();
            for i in 0..g {
                runner.step(&[self.tok(i)], &mut kv, &mut s.x, &mut s.logits)?;
            }
            samples.push(g as f64 / t0.elapsed().as_secs_f64());
        }
        let (mean, sd) = stats(&samples);
        let streaming = match (&model.streamer, s0, &model.experts, e0) {
            (Some(st), Some(s0), _, _) => Some(stream_row(model, st, &s0, g * repeat, mean)?),
            (_, _, Some(st), Some(e0)) => Some(expert_row(model, st, &e0, g * repeat, mean)?),
            _ => None,
        };
        if runner.skip_policy().is_some() {
            let s = runner.skip_stats();
            eprintln!(
                "threads {t}: {} (decode tg{g}: {:.2} MiB of weights per token not read)",
                crate::commands::run::skip_line(&s),
                s.bytes_not_read as f64 / 1048576.0 / (g * repeat) as f64
            );
        }
        Ok(Row {
            test: format!("tg{g}"),
            threads: t,
            tokens_per_s: mean,
            stddev: sd,
            roofline_pct: Some(100.0 * mean / roof),
            roofline_tokens_per_s: Some(roof),
            isa: self.isa.clone(),
            machine: ringllm_model::sys::machine_summary(),
            streaming,
        })
    }
}

/// The rows as a Markdown table, then a line per decode measure that streamed layers.
fn print_table(rows: &[Row]) {
    let cells = rows
        .iter()
        .map(|r| {
            vec![
                r.test.clone(),
                r.threads.to_string(),
                format!("{:.2} ± {:.2}", r.tokens_per_s, r.stddev),
                r.roofline_pct
                    .map_or(String::from("-"), |p| format!("{p:.0}%")),
            ]
        })
        .collect();
    out!(
        "{}",
        markdown_table(&["test", "threads", "t/s", "roofline"], cells)
    );
    for r in rows {
        if let Some(s) = &r.streaming {
            outln!(
                "{} threads {}: streamed {:.1} MiB/token ({:.1} MiB resident), stalled {:.1} ms/token; \
                 compute {:.1} ms, I/O {:.1} ms at {:.0} MB/s (page cache bypassed) -> bound {:.2} tok/s, \
                 decode at {:.0}% of it",
                r.test,
                r.threads,
                s.streamed_mib_per_token,
                s.resident_mib,
                s.stall_ms_per_token,
                s.compute_ms_per_token,
                s.io_ms_per_token,
                s.read_mb_per_s,
                s.bound_tokens_per_s,
                s.pct_of_bound
            );
            if let Some(hit) = s.expert_hit_pct {
                outln!(
                    "{} threads {}: experts found in the cache {hit:.1}%, next layer's experts predicted {}",
                    r.test,
                    r.threads,
                    s.expert_prediction_pct
                        .map_or("-".to_string(), |p| format!("{p:.1}% right"))
                );
            }
        }
    }
}

/// What the streamed tier cost over `tokens` decoded tokens since `s0`, against its bound.
fn stream_row(
    model: &ringllm_model::Model,
    st: &ringllm_model::stream::Streamer,
    s0: &ringllm_model::stream::StreamStats,
    tokens: usize,
    tokens_per_s: f64,
) -> Result<StreamRow> {
    let s1 = st.stats();
    let n = tokens.max(1) as f64;
    let bytes = (s1.bytes_read - s0.bytes_read) as f64 / n;
    let stall = (s1.stall_s - s0.stall_s) / n;
    let rate = st.measure_read_rate(model.file_arc())?;
    let resident: usize = model
        .layers
        .iter()
        .enumerate()
        .filter(|(i, _)| !st.streams(model.layer_range.start + i))
        .map(|(_, l)| l.weight_bytes())
        .sum();
    Ok(bound_row(resident, bytes, stall, rate, tokens_per_s))
}

/// A decode measure against its bound `max(compute, bytes ÷ rate)`: `bytes` read and `stall`
/// seconds waited per token at `tokens_per_s`, compute being the rest of a token's time.
fn bound_row(resident: usize, bytes: f64, stall: f64, rate: f64, tokens_per_s: f64) -> StreamRow {
    let t = 1.0 / tokens_per_s.max(1e-12);
    let compute = (t - stall).max(0.0);
    let io = bytes / rate;
    let bound = 1.0 / compute.max(io).max(1e-12);
    StreamRow {
        resident_mib: resident as f64 / 1048576.0,
        streamed_mib_per_token: bytes / 1048576.0,
        stall_ms_per_token: stall * 1e3,
        compute_ms_per_token: compute * 1e3,
        read_mb_per_s: rate / 1e6,
        io_ms_per_token: io * 1e3,
        bound_tokens_per_s: bound,
        pct_of_bound: 100.0 * tokens_per_s / bound,
        expert_hit_pct: None,
        expert_prediction_pct: None,
    }
}

/// What the streamed experts cost over `tokens` decoded tokens since `e0`, against the bound
/// `max(compute, bytes read ÷ read rate)`, the read rate measured on the file with the page
/// cache bypassed (large sequential requests: the expert reads, a few MiB each, four in
/// flight, may get less).
fn expert_row(
    model: &ringllm_model::Model,
    st: &ringllm_model::stream::ExpertStore,
    e0: &ringllm_model::stream::ExpertStats,
    tokens: usize,
    tokens_per_s: f64,
) -> Result<StreamRow> {
    let s = st.stats().since(e0);
    let n = tokens.max(1) as f64;
    let path = model
        .file()
        .path()
        .ok_or_else(|| anyhow::anyhow!("the model is not a file"))?;
    let rate = ringllm_model::stream::measure_read_rate(path, 0, 256 << 20)?;
    let resident: usize = model
        .layers
        .iter()
        .map(|l| {
            l.weight_bytes()
                - [&l.gate, &l.up, &l.down]
                    .iter()
                    .filter(|w| w.experts_streamed)
                    .map(|w| w.bytes())
                    .sum::<usize>()
        })
        .sum::<usize>()
        + st.pool_bytes();
    let bytes = s.bytes_read as f64 / n;
    Ok(StreamRow {
        expert_hit_pct: Some(100.0 * s.hit_rate()),
        expert_prediction_pct: (s.used_with_prediction > 0)
            .then(|| 100.0 * s.prediction_accuracy()),
        ..bound_row(resident, bytes, s.stall_s / n, rate, tokens_per_s)
    })
}

/// A Markdown table whose columns are as wide as their widest cell: the first column
/// left-aligned, the others (numbers) right-aligned; every line ends with a newline.
pub(super) fn markdown_table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = String>| -> String {
        let mut s = String::from("|");
        for (j, c) in cells.enumerate() {
            let pad = " ".repeat(width[j].saturating_sub(c.chars().count()));
            if j == 0 {
                s.push_str(&format!(" {c}{pad} |"));
            } else {
                s.push_str(&format!(" {pad}{c} |"));
            }
        }
        s.push('\n');
        s
    };
    let mut out = line(&mut header.iter().map(|h| h.to_string()));
    out.push_str(&line(&mut width.iter().enumerate().map(|(j, &w)| {
        if j == 0 {
            "-".repeat(w)
        } else {
            format!("{}:", "-".repeat(w.saturating_sub(1)))
        }
    })));
    for r in rows {
        out.push_str(&line(&mut r.into_iter()));
    }
    out
}

pub(super) fn stats(v: &[f64]) -> (f64, f64) {
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
    // Well beyond any cache, and not the whole of a model larger than the memory.
    let buf: Vec<u8> = (0..bytes.clamp(64 << 20, 512 << 20))
        .map(|i| i as u8)
        .collect();
    let pool = ThreadPool::new(threads);
    ringllm_kernels::bandwidth::read_bandwidth(&pool, &buf, 8)
}
