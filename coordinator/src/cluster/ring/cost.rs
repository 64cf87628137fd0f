//! What the planner is told about the model and this machine: the model's sizes from its
//! tensor table ([`model_cost`]), and how fast this machine runs the model's real layers and
//! head against the generic matrix × vector probe every node reports ([`calibration`]).

use crate::cluster::planner::ModelCost;
use anyhow::{anyhow, Result};
use ringllm_model::gguf::GgufFile;
use ringllm_model::{sys, KvCache, KvType, LoadOptions, Model};
use ringllm_protocol::Dtype;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// A mixture of experts's experts as the planner prices streaming them: `None` for a dense
/// model.
fn expert_cost(file: &Arc<GgufFile>, m: &Model) -> Option<crate::cluster::planner::ExpertCost> {
    use ringllm_model::stream::ExpertLayout;
    let moe = m.hp.moe?;
    let all: Vec<usize> = (0..m.hp.n_layer).collect();
    let layout = ExpertLayout::new(file, &all).ok()?;
    Some(crate::cluster::planner::ExpertCost {
        layer_expert_bytes: m
            .layers
            .iter()
            .map(|l| (l.gate.bytes() + l.up.bytes() + l.down.bytes()) as u64)
            .collect(),
        n_expert: moe.n_expert,
        n_used: moe.n_used,
        slot_bytes: layout.slot_bytes() as u64,
        min_slots: ExpertLayout::min_slots(),
    })
}

/// Sizes the planner needs, from the model's tensor table.
pub fn model_cost(
    file: &Arc<GgufFile>,
    ctx: usize,
    max_batch: usize,
    kv: KvType,
    act: Dtype,
) -> Result<(ModelCost, ringllm_model::Hparams)> {
    let m = Model::load(Arc::clone(file), &LoadOptions::default())?;
    let hp = m.hp.clone();
    if hp.ple_dim > 0 {
        return Err(anyhow!(
            "this {} model's layers take per-layer embedding inputs made from the token \
             embedding, which stays on the coordinator: it runs in one process (`run`, \
             `serve`), not over a ring",
            hp.arch.name()
        ));
    }
    let layer_weight_bytes: Vec<u64> = m.layers.iter().map(|l| l.weight_bytes() as u64).collect();
    let layer_active_bytes: Vec<u64> = m
        .layers
        .iter()
        .map(|l| l.active_bytes(&hp) as u64)
        .collect();
    let layer_kv_bytes = (0..hp.n_layer)
        .map(|il| KvCache::bytes_for(&hp, il..il + 1, ctx, max_batch, kv) as u64)
        .collect();
    let embd = m.tok_embd.as_ref().map_or(0, |w| w.bytes() as u64);
    let head = m.output.as_ref().map_or(0, |w| w.bytes() as u64);
    let tied = match (&m.tok_embd, &m.output) {
        (Some(a), Some(b)) => a.name == b.name,
        _ => false,
    };
    let hidden_bytes = act.bytes_for(hp.d_model).ok_or_else(|| {
        anyhow!(
            "activation type {} does not fit d = {}",
            act.name(),
            hp.d_model
        )
    })? as u64;
    Ok((
        ModelCost {
            n_layer: hp.n_layer,
            layer_weight_bytes,
            layer_active_bytes,
            layer_kv_bytes,
            head_bytes: head + 4 * hp.d_model as u64,
            embedding_bytes: embd,
            tied_head: tied,
            hidden_bytes,
            logits_bytes_f16: 2 * hp.vocab as u64,
            slots: 1,
            kv_source: (0..hp.n_layer).map(|il| hp.kv_source(il)).collect(),
            experts: expert_cost(file, &m),
        },
        hp,
    ))
}

/// Decode speed of a model's real layers and output head on this machine, weight bytes per
/// second, measured by running a few of them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelSpeed {
    pub layer_bytes_per_s: f64,
    pub head_bytes_per_s: f64,
}

/// The coordinator's speeds: the generic probe every node also reports, and the model's own
/// layers and head, measured once per model file and thread count.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Calibration {
    /// The matrix × vector probe (`sys::matvec_speed`), bytes per second.
    pub probe_bytes_per_s: f64,
    /// This model's layers and head.
    pub model: ModelSpeed,
}

/// The coordinator's probe speed and its speed on `file`'s layers and head
/// ([`calibrate`]), measured once per model file and thread count in this process: a ring
/// re-planned after a lost node reuses them (this CPU has not changed, and measuring took a
/// few hundred milliseconds of the pause a resumed request sees).
pub(super) fn calibration(file: &Arc<GgufFile>, threads: usize) -> Result<Calibration> {
    struct Measured {
        file: Weak<GgufFile>,
        threads: usize,
        speeds: Calibration,
    }
    static DONE: Mutex<Vec<Measured>> = Mutex::new(Vec::new());
    let same = |m: &Measured| m.threads == threads && Weak::ptr_eq(&m.file, &Arc::downgrade(file));
    if let Ok(mut done) = DONE.lock() {
        done.retain(|m| m.file.strong_count() > 0);
        if let Some(m) = done.iter().find(|m| same(m)) {
            return Ok(m.speeds);
        }
    }
    let probe = sys::matvec_speed(threads, Duration::from_millis(150));
    let model = calibrate(file, threads)?;
    let speeds = Calibration {
        probe_bytes_per_s: probe,
        model,
    };
    if let Ok(mut done) = DONE.lock() {
        done.push(Measured {
            file: Arc::downgrade(file),
            threads,
            speeds,
        });
    }
    Ok(speeds)
}

/// Decode speed of this model's real layers and output head on this machine, in weight bytes
/// per second: a few layers and the head run on one token at a time for a short while.
fn calibrate(file: &Arc<GgufFile>, threads: usize) -> Result<ModelSpeed> {
    let hp = Model::load(
        Arc::clone(file),
        &LoadOptions {
            layers: Some(0..0),
            embedding: false,
            head: false,
            repack: false,
            stream: None,
            experts: None,
        },
    )?
    .hp;
    let k = hp.n_layer.min(4);
    let model = Arc::new(Model::load(
        Arc::clone(file),
        &LoadOptions {
            layers: Some(0..k),
            embedding: true,
            head: true,
            // The layout the nodes run (panels where this CPU has them): calibrated on the
            // file's layout, the planner underestimated Q4_K decode by 17%.
            repack: true,
            stream: None,
            experts: None,
        },
    )?);
    // Every page in before the clock starts: a mixture of experts touches new experts with
    // every token for a while, and faulting them in from the page cache made its layers look
    // ten times slower than they run.
    model.prefault();
    // Bytes a decoded token reads (a mixture of experts: its picked experts only).
    let layer_bytes: usize = model.layers.iter().map(|l| l.active_bytes(&model.hp)).sum();
    let head_bytes = model.output.as_ref().map_or(0, |w| w.bytes());
    let d = hp.d_model;
    let mut runner = ringllm_model::Runner::new(Arc::clone(&model), threads, 1, 64);
    let mut kv = runner.new_cache(64, KvType::F32);
    let mut x = vec![0f32; d];
    let mut logits = vec![0f32; hp.vocab];
    let (mut t_layers, mut t_head, mut n) = (0f64, 0f64, 0usize);
    let start = Instant::now();
    while n < 3 || (start.elapsed() < Duration::from_millis(300) && n < 60) {
        if kv.len + 1 >= 64 {
            kv.truncate(0);
        }
        runner.embed(&[(n % 100 + 10) as u32], &mut x)?;
        let t = Instant::now();
        runner.layers(&mut x, 1, &mut kv, None)?;
        let t1 = Instant::now();
        runner.final_norm(&mut x, 1)?;
        runner.logits(&x, 1, &mut logits)?;
        if n > 0 {
            // the first pass pages the weights in
            t_layers += (t1 - t).as_secs_f64();
            t_head += t1.elapsed().as_secs_f64();
        }
        n += 1;
    }
    let runs = (n - 1).max(1) as f64;
    Ok(ModelSpeed {
        layer_bytes_per_s: layer_bytes as f64 * runs / t_layers.max(1e-9),
        head_bytes_per_s: head_bytes as f64 * runs / t_head.max(1e-9),
    })
}
