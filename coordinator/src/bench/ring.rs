//! `ringllm bench ring CLUSTER`: a ring next to the single process, measured in turns in one
//! run: prefill and decode speed, the ring's overhead per hop, compute per node, bytes per
//! token on every link, and the time from start to the first token (with `--cold`, every
//! slice sent in full).

use super::model::{markdown_table, stats, SpeedArgs};
use anyhow::Result;
use clap::Args;
use ringllm::cluster::RingSpec;
use ringllm::engine::{Engine, ModelOptions};
use serde::Serialize;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

/// `ringllm bench ring`.
#[derive(Args, Debug, Clone)]
pub struct RingBenchArgs {
    /// Cluster file (TOML).
    pub cluster: PathBuf,
    /// GGUF model file (overrides the cluster file's `model`).
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub speed: SpeedArgs,
    /// A cold start. The nodes discard their cached slices first, so each is sent in full;
    /// the report gives the time from start to the first token (ring and single process) and
    /// what was sent, how fast.
    #[arg(long)]
    pub cold: bool,
    /// The single process measured first and dropped before the ring loads, instead of the
    /// two in turns: for a model this machine cannot hold twice (the nodes on it hold the
    /// other copy). Fairer in memory, less so against a CPU whose speed drifts.
    #[arg(long)]
    pub apart: bool,
}

#[derive(Serialize, Default, Clone)]
struct Speeds {
    rows: Vec<SpeedRow>,
}

/// One measure: its name (ppN, tgN), mean tokens/s and their standard deviation. In JSON, an
/// array `[test, mean, stddev]` (scripts/bench-cluster-netns reads it so).
#[derive(Clone)]
struct SpeedRow {
    test: String,
    mean: f64,
    stddev: f64,
}

impl Serialize for SpeedRow {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        (&self.test, self.mean, self.stddev).serialize(s)
    }
}

/// Prefill and decode speed of an engine (single process or ring), `repeat` times each.
fn measure(engine: &mut Engine, args: &SpeedArgs) -> Result<Speeds> {
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
        let (mean, stddev) = stats(&samples);
        out.rows.push(SpeedRow {
            test: format!("pp{p}"),
            mean,
            stddev,
        });
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
        let (mean, stddev) = stats(&samples);
        out.rows.push(SpeedRow {
            test: format!("tg{g}"),
            mean,
            stddev,
        });
    }
    Ok(out)
}

/// Mean and spread over repetitions measured one at a time.
fn merge(runs: &[Speeds]) -> Speeds {
    let mut out = Speeds::default();
    if let Some(first) = runs.first() {
        for (k, row) in first.rows.iter().enumerate() {
            let v: Vec<f64> = runs.iter().map(|r| r.rows[k].mean).collect();
            let (mean, stddev) = stats(&v);
            out.rows.push(SpeedRow {
                test: row.test.clone(),
                mean,
                stddev,
            });
        }
    }
    out
}

/// A figure of one test or node: in JSON, an array `[name, value]`.
struct Figure {
    name: String,
    value: f64,
}

impl Serialize for Figure {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        (&self.name, self.value).serialize(s)
    }
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
    ratio: Vec<Figure>,
    /// Heartbeat round trip coordinator↔node, ms.
    rtt_ms: Vec<Figure>,
    /// Per decoded token: ring time minus the single process's time, over the hops.
    overhead_ms_per_token: f64,
    per_hop_ms: f64,
    /// Per decoded token: compute time on each node, ms.
    node_compute_ms: Vec<Figure>,
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

/// `ringllm bench ring CLUSTER`: see the module.
pub fn bench_ring(a: &RingBenchArgs) -> Result<ExitCode> {
    let args = &a.speed;
    args.check()?;
    let s = ringllm::cluster::setup_file(&a.cluster)?;
    let (max_p, max_g) = args.longest();
    let threads = args
        .threads
        .first()
        .copied()
        .or(s.threads)
        .unwrap_or(1)
        .max(1);
    let margs = ModelOptions {
        model: a.model.clone().unwrap_or(s.model.clone()),
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
    let mut spec = s.spec.clone();
    spec.discard_cached_slices = a.cold;
    let once = SpeedArgs {
        repeat: 1,
        ..args.clone()
    };
    let (mut single, mut ring_plain) = (Vec::new(), Vec::new());
    let (mut e, start) = if a.apart {
        let (mut one, single_first) = first_token_single(&margs)?;
        for _ in 0..args.repeat {
            single.push(measure(&mut one, &once)?);
        }
        drop(one);
        let (mut e, mut start) = first_token_ring(&margs, spec, a.cold)?;
        start.single_first_token_s = single_first;
        for _ in 0..args.repeat {
            ring_plain.push(measure(&mut e, &once)?);
        }
        (e, start)
    } else {
        let (mut one, single_first) = first_token_single(&margs)?;
        let (mut e, mut start) = first_token_ring(&margs, spec, a.cold)?;
        start.single_first_token_s = single_first;
        for _ in 0..args.repeat {
            single.push(measure(&mut one, &once)?);
            ring_plain.push(measure(&mut e, &once)?);
        }
        (e, start)
    };
    let (single, ring_plain) = (merge(&single), merge(&ring_plain));
    let counted = counted_pass(&mut e, max_g.max(1))?;
    e.close();
    let n_nodes = counted.names.len();
    let tg = |s: &Speeds| {
        s.rows
            .iter()
            .find(|r| r.test.starts_with("tg"))
            .map_or(0.0, |r| r.mean)
    };
    // Overhead from the interleaved means (the counted pass below only feeds the byte counts).
    let overhead = 1.0 / tg(&ring_plain).max(1e-9) - 1.0 / tg(&single).max(1e-9);
    let ratio = single
        .rows
        .iter()
        .zip(&ring_plain.rows)
        .map(|(a, b)| Figure {
            name: a.test.clone(),
            value: b.mean / a.mean,
        })
        .collect();
    let report = ClusterReport {
        single,
        ring: ring_plain,
        ratio,
        rtt_ms: counted
            .names
            .iter()
            .zip(&counted.rtts)
            .map(|(n, r)| Figure {
                name: n.0.clone(),
                value: r * 1e3,
            })
            .collect(),
        overhead_ms_per_token: overhead * 1e3,
        per_hop_ms: overhead * 1e3 / (n_nodes + 1) as f64,
        node_compute_ms: counted.node_compute_ms,
        links: counted.links,
        predicted_tokens_per_s: counted.predicted,
        counted_pass_tokens_per_s: 1.0 / counted.seconds_per_token.max(1e-9),
        start,
        isa: ringllm_kernels::isa().name(),
        machine: ringllm_model::sys::machine_summary(),
    };
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report, n_nodes);
    }
    Ok(ExitCode::SUCCESS)
}

/// Time to the first token of the single process (it loads and runs one token), and the engine.
fn first_token_single(margs: &ModelOptions) -> Result<(Engine, f64)> {
    let t = Instant::now();
    let mut one = Engine::load(margs)?;
    one.feed(&[100])?;
    Ok((one, t.elapsed().as_secs_f64()))
}

/// The ring's time to the first token: it connects, plans, sends the slices the nodes lack (all
/// of them with `cold`), loads them and runs one token. The engine, the time and what was sent
/// (the report's single-process time is left 0 for the caller to fill).
fn first_token_ring(
    margs: &ModelOptions,
    spec: RingSpec,
    cold: bool,
) -> Result<(Engine, StartReport)> {
    let t = Instant::now();
    let mut e = Engine::load_ring(margs, spec)?;
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
        cold,
        single_first_token_s: 0.0,
        ring_first_token_s: ring_first,
        sent_bytes: sent.iter().map(|s| s.bytes).sum(),
        sent,
    };
    Ok((e, start))
}

/// What a decode pass with the ring's counters read before and after found.
struct CountedPass {
    /// The nodes, in ring order.
    names: Vec<(String, String)>,
    /// Heartbeat round trip to each node, seconds.
    rtts: Vec<f64>,
    predicted: f64,
    seconds_per_token: f64,
    links: Vec<LinkRow>,
    node_compute_ms: Vec<Figure>,
}

/// A separate decode pass of `g` tokens on the ring `e` with counters read before and after:
/// bytes per token on every link and compute per node.
fn counted_pass(e: &mut Engine, g: usize) -> Result<CountedPass> {
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
    let node_compute_ms: Vec<Figure> = (0..n_nodes)
        .map(|i| Figure {
            name: names[i].0.clone(),
            value: (after[i].compute_us - before[i].compute_us) as f64 / 1e3 / g as f64,
        })
        .collect();
    Ok(CountedPass {
        names,
        rtts,
        predicted,
        seconds_per_token: ring_s,
        links,
        node_compute_ms,
    })
}

/// The report as text: the speed table, then start, overhead, compute, links.
fn print_report(report: &ClusterReport, n_nodes: usize) {
    let cells = report
        .single
        .rows
        .iter()
        .zip(&report.ring.rows)
        .zip(&report.ratio)
        .map(|((a, b), r)| {
            vec![
                a.test.clone(),
                format!("{:.2} ± {:.2}", a.mean, a.stddev),
                format!("{:.2} ± {:.2}", b.mean, b.stddev),
                format!("{:.3}x", r.value),
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
    for f in &report.node_compute_ms {
        outln!("  {}: compute {:.3} ms/token", f.name, f.value);
    }
    for f in &report.rtt_ms {
        outln!(
            "  link to {}: heartbeat round trip {:.3} ms",
            f.name,
            f.value
        );
    }
    for l in &report.links {
        outln!(
            "  {:<28} {:>8.1} bytes/token (one frame: {:.0})",
            l.link,
            l.bytes_per_token,
            l.frame_bytes_per_token
        );
    }
}
