//! `ringllm bench`: prefill (ppN) and decode (tgN) tokens/s at several thread counts, like
//! llama-bench, next to the memory-bandwidth roofline measured in the same run.

use crate::cli::BenchArgs;
use anyhow::Result;
use ringllm::engine::{default_threads, open_gguf, Engine, ModelOptions};
use ringllm_kernels::pool::ThreadPool;
use ringllm_model::{KvType, Runner};
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
}

/// `ringllm bench -m MODEL`: ppN and tgN at each thread count.
pub fn bench_model(args: &BenchArgs) -> Result<ExitCode> {
    let model_path = args
        .model
        .clone()
        .ok_or_else(|| anyhow::anyhow!("give -m MODEL or --cluster FILE"))?;
    let file = open_gguf(&model_path)?;
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
    let max_p = args.prompt.iter().copied().max().unwrap_or(1).max(1);
    let max_g = args.gen.iter().copied().max().unwrap_or(1);
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
            backend: args.backend,
        },
        threads.iter().copied().max().unwrap_or(1),
    )?);
    let bytes_per_token = model.weight_bytes_per_token();
    let vocab = model.hp.vocab;
    let max_p = args.prompt.iter().copied().max().unwrap_or(1).max(1);
    let max_g = args.gen.iter().copied().max().unwrap_or(1);
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
    let gpu = ringllm_model::backend::probe(args.backend)?;
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
    let mut rows = Vec::new();
    for &t in &threads {
        let t = t.max(1);
        // A model that streams does not fit the memory: probe with 64 MiB (beyond any cache).
        let probe = if model.streamer.is_some() {
            64 << 20
        } else {
            bytes_per_token
        };
        let bw = match &gpu {
            Some((_, speed)) => *speed,
            None => measure_bandwidth(t, probe),
        };
        let roof = bw / bytes_per_token as f64;
        eprintln!(
            "threads {t}: read bandwidth {:.2} GB/s -> decode roofline {roof:.1} tok/s",
            bw / 1e9
        );
        let mut runner = Runner::new(Arc::clone(&model), t, max_p.min(512), ctx);
        ringllm::engine::set_backend(&mut runner, args.backend)?;
        ringllm::skip::apply(
            &mut runner,
            &ringllm::skip::SkipOptions::from(&args.skip),
            &model_path,
        )?;
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
                roofline_tokens_per_s: None,
                isa: isa.clone(),
                machine: ringllm_model::sys::machine_summary(),
                streaming: None,
            });
        }
        for &g in &args.gen {
            let mut samples = Vec::new();
            let s0 = model.streamer.as_ref().map(|s| s.stats());
            runner.reset_skip_stats();
            for _ in 0..args.repeat {
                let mut kv = runner.new_cache(ctx, KvType::F32);
                let t0 = Instant::now();
                for i in 0..g {
                    runner.step(&[tok(i)], &mut kv, &mut x, &mut logits)?;
                }
                samples.push(g as f64 / t0.elapsed().as_secs_f64());
            }
            let (mean, sd) = stats(&samples);
            let streaming = match (&model.streamer, s0) {
                (Some(st), Some(s0)) => Some(stream_row(&model, st, &s0, g * args.repeat, mean)?),
                _ => None,
            };
            if runner.skip_policy().is_some() {
                let s = runner.skip_stats();
                eprintln!(
                    "threads {t}: {} (decode tg{g}: {:.2} MiB of weights per token not read)",
                    crate::commands::run::skip_line(&s),
                    s.bytes_not_read as f64 / 1048576.0 / (g * args.repeat) as f64
                );
            }
            rows.push(Row {
                test: format!("tg{g}"),
                threads: t,
                tokens_per_s: mean,
                stddev: sd,
                roofline_pct: Some(100.0 * mean / roof),
                roofline_tokens_per_s: Some(roof),
                isa: isa.clone(),
                machine: ringllm_model::sys::machine_summary(),
                streaming,
            });
        }
    }
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
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
        for r in &rows {
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
            }
        }
    }
    Ok(ExitCode::SUCCESS)
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
    let t = 1.0 / tokens_per_s.max(1e-12);
    let rate = st.measure_read_rate(model.file_arc())?;
    let compute = (t - stall).max(0.0);
    let io = bytes / rate;
    let bound = 1.0 / compute.max(io).max(1e-12);
    let resident: usize = model
        .layers
        .iter()
        .enumerate()
        .filter(|(i, _)| !st.streams(model.layer_range.start + i))
        .map(|(_, l)| l.weight_bytes())
        .sum();
    Ok(StreamRow {
        resident_mib: resident as f64 / 1048576.0,
        streamed_mib_per_token: bytes / 1048576.0,
        stall_ms_per_token: stall * 1e3,
        compute_ms_per_token: compute * 1e3,
        read_mb_per_s: rate / 1e6,
        io_ms_per_token: io * 1e3,
        bound_tokens_per_s: bound,
        pct_of_bound: 100.0 * tokens_per_s / bound,
    })
}

/// A Markdown table whose columns are as wide as their widest cell: the first column
/// left-aligned, the others (numbers) right-aligned; every line ends with a newline.
fn markdown_table(header: &[&str], rows: Vec<Vec<String>>) -> String {
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
    // Well beyond any cache, and not the whole of a model larger than the memory.
    let buf: Vec<u8> = (0..bytes.clamp(64 << 20, 512 << 20))
        .map(|i| i as u8)
        .collect();
    let pool = ThreadPool::new(threads);
    ringllm_kernels::bandwidth::read_bandwidth(&pool, &buf, 8)
}

#[derive(Serialize, Default, Clone)]
struct Speeds {
    /// (test, mean tokens/s, stddev)
    rows: Vec<(String, f64, f64)>,
}

/// Prefill and decode speed of an engine (single process or ring), `repeat` times each.
fn measure(engine: &mut Engine, args: &BenchArgs) -> Result<Speeds> {
    let vocab = engine.vocab();
    let tok = |i: usize| (100 + (i * 7919) % (vocab.saturating_sub(100)).max(1)) as u32;
    engine.reset();
    engine.feed(&[tok(0)])?; // warm-up: every weight touched once
    let mut out = Speeds::default();
    for &p in &args.prompt {
        let prompt: Vec<u32> = (0..p).map(tok).collect();
        let mut samples = Vec::new();
        for _ in 0..args.repeat {
            engine.reset();
            let t0 = Instant::now();
            engine.feed(&prompt)?;
            samples.push(p as f64 / t0.elapsed().as_secs_f64());
        }
        let (m, sd) = stats(&samples);
        out.rows.push((format!("pp{p}"), m, sd));
    }
    for &g in &args.gen {
        let mut samples = Vec::new();
        for _ in 0..args.repeat {
            engine.reset();
            engine.feed(&[tok(1)])?;
            let t0 = Instant::now();
            for i in 0..g {
                engine.feed(&[tok(i + 2)])?;
            }
            samples.push(g as f64 / t0.elapsed().as_secs_f64());
        }
        let (m, sd) = stats(&samples);
        out.rows.push((format!("tg{g}"), m, sd));
    }
    Ok(out)
}

/// Mean and spread over repetitions measured one at a time.
fn merge(runs: &[Speeds]) -> Speeds {
    let mut out = Speeds::default();
    if let Some(first) = runs.first() {
        for (k, row) in first.rows.iter().enumerate() {
            let v: Vec<f64> = runs.iter().map(|r| r.rows[k].1).collect();
            let (m, sd) = stats(&v);
            out.rows.push((row.0.clone(), m, sd));
        }
    }
    out
}

#[derive(Serialize)]
struct LinkRow {
    link: String,
    bytes_per_token: f64,
    frame_bytes_per_token: f64,
}

#[derive(Serialize)]
struct ClusterReport {
    single: Speeds,
    ring: Speeds,
    ratio: Vec<(String, f64)>,
    /// Heartbeat round trip coordinator↔node, ms.
    rtt_ms: Vec<(String, f64)>,
    /// Per decoded token: ring time minus the single process's time, over the hops.
    overhead_ms_per_token: f64,
    per_hop_ms: f64,
    /// Per decoded token: compute time on each node, ms.
    node_compute_ms: Vec<(String, f64)>,
    links: Vec<LinkRow>,
    predicted_tokens_per_s: f64,
    /// Decode speed of the pass whose bytes were counted.
    counted_pass_tokens_per_s: f64,
    /// From start (loading, connecting, planning, sending slices) to the first token's logits.
    start: StartReport,
    /// The coordinator's kernel set and machine.
    isa: &'static str,
    machine: String,
}

#[derive(Serialize)]
struct SentRow {
    node: String,
    bytes: u64,
    seconds: f64,
    bytes_per_s: f64,
}

#[derive(Serialize)]
struct StartReport {
    /// The nodes were asked to discard their cached slices first (`--cold`).
    cold: bool,
    single_first_token_s: f64,
    ring_first_token_s: f64,
    /// Slices sent before the ring started (nodes fed at once).
    sent: Vec<SentRow>,
    sent_bytes: u64,
}

pub fn bench_cluster(args: &BenchArgs, path: &std::path::Path) -> Result<ExitCode> {
    let s = ringllm::cluster::setup_file(path)?;
    let max_p = args.prompt.iter().copied().max().unwrap_or(1).max(1);
    let max_g = args.gen.iter().copied().max().unwrap_or(1);
    let threads = args
        .threads
        .first()
        .copied()
        .or(s.threads)
        .unwrap_or(1)
        .max(1);
    let margs = ModelOptions {
        model: args.model.clone().unwrap_or(s.model.clone()),
        threads: Some(threads),
        ctx: Some(max_p + max_g + 8),
        batch: 512,
        kv: s.kv.unwrap_or_default(),
        repack: !args.no_repack,
        memory: args.memory,
        stream: args.stream.settings(),
        backend: ringllm_model::BackendChoice::Cpu,
    };
    eprintln!(
        "single process and a ring of {} stage(s), {threads} thread(s) per process, measured in turns \
         | isa {} | {}",
        s.spec.stages.len(),
        ringllm_kernels::isa().name(),
        ringllm_model::sys::machine_summary()
    );
    // Time to the first token: the single process loads and runs one token; the ring
    // connects, plans, sends the slices the nodes lack (all of them with --cold), loads them
    // and runs one token.
    let t = Instant::now();
    let mut one = Engine::load(&margs)?;
    one.feed(&[100])?;
    let single_first = t.elapsed().as_secs_f64();
    let mut spec = s.spec.clone();
    spec.discard_cached_slices = args.cold;
    let t = Instant::now();
    let mut e = Engine::load_ring(&margs, spec)?;
    e.feed(&[100])?;
    let ring_first = t.elapsed().as_secs_f64();
    let sent: Vec<SentRow> = e
        .ring_mut()
        .map(|r| r.sent.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|s| SentRow {
            node: s.node,
            bytes: s.bytes,
            seconds: s.secs,
            bytes_per_s: s.bytes as f64 / s.secs.max(1e-9),
        })
        .collect();
    let start = StartReport {
        cold: args.cold,
        single_first_token_s: single_first,
        ring_first_token_s: ring_first,
        sent_bytes: sent.iter().map(|s| s.bytes).sum(),
        sent,
    };
    let (mut single, mut ring_plain) = (Vec::new(), Vec::new());
    let once = BenchArgs {
        repeat: 1,
        ..args.clone()
    };
    for _ in 0..args.repeat {
        single.push(measure(&mut one, &once)?);
        ring_plain.push(measure(&mut e, &once)?);
    }
    drop(one);
    let (single, ring_plain) = (merge(&single), merge(&ring_plain));
    // A separate decode pass with counters read before and after.
    let g = max_g.max(1);
    let ring = e
        .ring_mut()
        .ok_or_else(|| anyhow::anyhow!("the ring is down"))?;
    let names = ring.node_names();
    let rtts = ring.rtts();
    let predicted = ring.plan.predicted_tokens_per_s;
    e.reset();
    let vocab = e.vocab();
    e.feed(&[100])?;
    let ring = e
        .ring_mut()
        .ok_or_else(|| anyhow::anyhow!("the ring is down"))?;
    let before = ring.stats()?;
    let links_before = ring.link_counters();
    let t0 = Instant::now();
    for i in 0..g {
        e.feed(&[(200 + i % (vocab - 200)) as u32])?;
    }
    let ring_s = t0.elapsed().as_secs_f64() / g as f64;
    let ring = e
        .ring_mut()
        .ok_or_else(|| anyhow::anyhow!("the ring is down"))?;
    let after = ring.stats()?;
    let links_after = ring.link_counters();
    let n_nodes = names.len();
    let mut links = Vec::new();
    let d_bytes = 4.0 * e.runner.model.hp.d_model as f64;
    // Coordinator → first node: what the coordinator sent on its link to node 0.
    if let (Some(a), Some(b)) = (links_after.first(), links_before.first()) {
        links.push(LinkRow {
            link: format!("coordinator → {}", names[0].0),
            bytes_per_token: (*a - *b).bytes_sent as f64 / g as f64,
            frame_bytes_per_token: d_bytes + ringllm_protocol::HEADER_LEN as f64,
        });
    }
    for i in 0..n_nodes {
        let next = if i + 1 < n_nodes {
            names[i + 1].0.clone()
        } else {
            "coordinator".into()
        };
        links.push(LinkRow {
            link: format!("{} → {next}", names[i].0),
            bytes_per_token: (after[i].bytes_out - before[i].bytes_out) as f64 / g as f64,
            frame_bytes_per_token: d_bytes + ringllm_protocol::HEADER_LEN as f64,
        });
    }
    let node_compute_ms: Vec<(String, f64)> = (0..n_nodes)
        .map(|i| {
            (
                names[i].0.clone(),
                (after[i].compute_us - before[i].compute_us) as f64 / 1e3 / g as f64,
            )
        })
        .collect();
    e.close();
    let tg = |s: &Speeds| {
        s.rows
            .iter()
            .find(|r| r.0.starts_with("tg"))
            .map_or(0.0, |r| r.1)
    };
    // Overhead from the interleaved means (the counted pass below only feeds the byte counts).
    let overhead = 1.0 / tg(&ring_plain).max(1e-9) - 1.0 / tg(&single).max(1e-9);
    let ratio = single
        .rows
        .iter()
        .zip(&ring_plain.rows)
        .map(|(a, b)| (a.0.clone(), b.1 / a.1))
        .collect();
    let report = ClusterReport {
        single,
        ring: ring_plain,
        ratio,
        rtt_ms: names
            .iter()
            .zip(&rtts)
            .map(|(n, r)| (n.0.clone(), r * 1e3))
            .collect(),
        overhead_ms_per_token: overhead * 1e3,
        per_hop_ms: overhead * 1e3 / (n_nodes + 1) as f64,
        node_compute_ms,
        links,
        predicted_tokens_per_s: predicted,
        counted_pass_tokens_per_s: 1.0 / ring_s.max(1e-9),
        start,
        isa: ringllm_kernels::isa().name(),
        machine: ringllm_model::sys::machine_summary(),
    };
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(ExitCode::SUCCESS);
    }
    let cells = report
        .single
        .rows
        .iter()
        .zip(&report.ring.rows)
        .zip(&report.ratio)
        .map(|((a, b), r)| {
            vec![
                a.0.clone(),
                format!("{:.2} ± {:.2}", a.1, a.2),
                format!("{:.2} ± {:.2}", b.1, b.2),
                format!("{:.3}x", r.1),
            ]
        })
        .collect();
    out!(
        "{}",
        markdown_table(&["test", "single t/s", "ring t/s", "ring/single"], cells)
    );
    outln!(
        "predicted by the planner: {:.1} tokens/s",
        report.predicted_tokens_per_s
    );
    let st = &report.start;
    outln!(
        "start to first token{}: ring {:.2} s, single process {:.2} s",
        if st.cold {
            " (cold: node caches discarded)"
        } else {
            ""
        },
        st.ring_first_token_s,
        st.single_first_token_s
    );
    for s in &st.sent {
        outln!(
            "  sent {}: {:.1} MiB in {:.2} s ({:.1} MB/s)",
            s.node,
            s.bytes as f64 / 1048576.0,
            s.seconds,
            s.bytes_per_s / 1e6
        );
    }
    outln!(
        "decode overhead of the ring: {:.3} ms/token over {} hops = {:.3} ms per hop",
        report.overhead_ms_per_token,
        n_nodes + 1,
        report.per_hop_ms
    );
    for (n, ms) in &report.node_compute_ms {
        outln!("  {n}: compute {ms:.3} ms/token");
    }
    for (n, ms) in &report.rtt_ms {
        outln!("  link to {n}: heartbeat round trip {ms:.3} ms");
    }
    for l in &report.links {
        outln!(
            "  {:<28} {:>8.1} bytes/token (one frame: {:.0})",
            l.link,
            l.bytes_per_token,
            l.frame_bytes_per_token
        );
    }
    Ok(ExitCode::SUCCESS)
}
