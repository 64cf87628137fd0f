//! `ringllm plan`: how a cluster would split a model and how fast it would decode, from the
//! nodes' measured speed and memory, without loading the model.

use crate::cli::PlanArgs;
use anyhow::Result;
use ringllm::cluster::planner::format_bytes;
use ringllm::cluster::ring::{Sizing, SlicePreview};
use ringllm::cluster::{self, Ring};
use ringllm::engine::{default_threads, open_gguf};
use ringllm_model::limits;
use std::process::ExitCode;

pub fn plan(args: PlanArgs) -> Result<ExitCode> {
    let s = cluster::setup(&cluster::Source::from(&args.source))?;
    let file = open_gguf(&s.model)?;
    let ctx = args.source.ctx.or(s.ctx).unwrap_or(4096).max(1);
    let kv = s.kv.unwrap_or_default();
    let threads = s.threads.unwrap_or_else(default_threads).max(1);
    // As `up` plans: one conversation with batches of 512, or with --parallel N as
    // `up --serve --parallel N` does (N KV caches, batches of prefill chunk + N).
    let (slots, max_batch) = match args.parallel {
        Some(n) => {
            limits::check("--parallel", n, limits::MAX_SLOTS)?;
            (n, args.prefill_chunk.max(1).saturating_add(n))
        }
        None => (1, 512),
    };
    let sizing = Sizing {
        ctx,
        max_batch,
        kv,
        slots,
    };
    let mut ring = Ring::connect(&s.spec, &s.model, &file, &sizing, threads)?;
    // What `up` would send the nodes that lack the model, and how long over each link.
    let identity = cluster::ring::identity_of(&s.model, &file);
    let slices = ring.preview_slices(&s.spec, &identity, &file)?;
    let eta = |p: &SlicePreview| p.to_send as f64 / p.link_bytes_per_s.max(1.0);
    if args.json {
        let caps = ring.capabilities();
        let rtts = ring.rtts();
        let nodes: Vec<serde_json::Value> = ring
            .node_names()
            .iter()
            .zip(caps.iter().zip(&rtts))
            .map(|((name, addr), (c, rtt))| {
                serde_json::json!({
                    "name": name, "address": addr,
                    "memory_available": c.memory_available,
                    "threads": c.threads,
                    "matvec_bytes_per_s": c.matvec_bytes_per_s,
                    "disk_read_bytes_per_s": c.disk_read_bytes_per_s,
                    "backend": c.backend,
                    "rtt_ms": rtt * 1e3,
                })
            })
            .collect();
        let slices: Vec<serde_json::Value> = slices
            .iter()
            .map(|p| {
                serde_json::json!({
                    "node": p.node, "layers": [p.layers.start, p.layers.end], "head": p.head,
                    "size": p.size, "to_send": p.to_send,
                    "link_bytes_per_s": p.link_bytes_per_s,
                    "seconds": if p.to_send == 0 { 0.0 } else { eta(p) },
                })
            })
            .collect();
        let stages: Vec<serde_json::Value> = ring
            .plan
            .stages
            .iter()
            .map(|p| {
                serde_json::json!({
                    "name": p.name, "address": p.address, "local": p.local,
                    "layers": [p.layers.start, p.layers.end],
                    "weight_bytes": p.weight_bytes, "kv_bytes": p.kv_bytes,
                    "scratch_bytes": p.scratch_bytes, "memory_budget": p.memory_budget,
                    "compute_ms": p.compute_s * 1e3, "holds_head": p.holds_head,
                })
            })
            .collect();
        outln!(
            "{}",
            serde_json::json!({
                "nodes": nodes,
                "stages": stages,
                "slices": slices,
                "slots": ring.plan.slots,
                "ctx": ctx,
                "max_batch": max_batch,
                "predicted_tokens_per_s": ring.plan.predicted_tokens_per_s,
                "streaming": ring.streaming,
            })
        );
    } else {
        for ((name, addr), (c, rtt)) in ring
            .node_names()
            .iter()
            .zip(ring.capabilities().iter().zip(ring.rtts()))
        {
            outln!(
                "node {name} ({addr}): {} threads, memory budget {}, matvec {:.1} GB/s, disk {:.0} MB/s, rtt {:.3} ms, isa {}, backend {}",
                c.threads,
                format_bytes(c.memory_available),
                c.matvec_bytes_per_s / 1e9,
                c.disk_read_bytes_per_s / 1e6,
                rtt * 1e3,
                c.isa,
                c.backend
            );
        }
        match &ring.streaming {
            Some(sp) => out!("{sp}"),
            None => out!("{}", ring.plan),
        }
        for p in &slices {
            let what = format!(
                "layers {}-{}{}",
                p.layers.start,
                p.layers.end.saturating_sub(1),
                if p.head { " and head" } else { "" }
            );
            if p.to_send == 0 {
                outln!(
                    "slice for {}: {what}, {} — in its cache, nothing to send",
                    p.node,
                    format_bytes(p.size)
                );
            } else {
                outln!(
                    "slice for {}: {what}, {} — {} to send at {:.0} MB/s (measured): ~{:.0} s",
                    p.node,
                    format_bytes(p.size),
                    format_bytes(p.to_send),
                    p.link_bytes_per_s / 1e6,
                    eta(p).ceil()
                );
            }
        }
        if let Some(slowest) = slices
            .iter()
            .filter(|p| p.to_send > 0)
            .map(eta)
            .reduce(f64::max)
        {
            outln!(
                "sending takes ~{:.0} s (every node is fed at once)",
                slowest.ceil()
            );
        }
    }
    ring.shutdown("plan only");
    Ok(ExitCode::SUCCESS)
}
