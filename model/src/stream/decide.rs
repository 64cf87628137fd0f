//! Whether and how a process streams: the layers that do not fit its budget ([`decide`]),
//! or a mixture of experts's experts ([`decide_experts`]), from the measured read rate and
//! compute speed.

use super::{
    choose_depth, layer_span, measure_read_rate, plan_tiers, predict, ExpertLayout, ExpertStore,
    Streamer, TierPlan, ALIGN, MAX_DEPTH,
};
use crate::gguf::GgufFile;
use std::sync::Arc;
use std::time::Duration;

/// Whether a model streams layers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StreamMode {
    /// Only when the layers do not fit the budget: what fits stays resident.
    #[default]
    Auto,
    /// Every layer streamed, however much memory there is (the naive baseline).
    All,
    /// Never: the layers are mapped, and the kernel pages them when memory is short.
    Off,
    /// A mixture of experts's experts read from disk as the router picks them, whatever the
    /// memory (the rest resident); other models as `Auto`.
    Experts,
}

impl std::str::FromStr for StreamMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(StreamMode::Auto),
            "all" => Ok(StreamMode::All),
            "off" => Ok(StreamMode::Off),
            "experts" => Ok(StreamMode::Experts),
            _ => Err(format!(
                "'{s}' is not a stream mode (auto, all, experts or off)"
            )),
        }
    }
}

/// How a process streams (`--stream`, `--prefetch`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamSettings {
    pub mode: StreamMode,
    /// Layers read ahead (`None`: chosen from the measured read rate and compute speed).
    pub prefetch: Option<usize>,
    /// Expert buffers of a mixture of experts whose experts stream (`None`: as many as the
    /// budget holds).
    pub expert_slots: Option<usize>,
    /// Do not predict the next layer's experts (read each only once the router picks it).
    pub no_expert_predict: bool,
}

/// Bytes a read-rate probe reads.
const PROBE_BYTES: usize = 256 << 20;
/// Read rate assumed for a file held in memory.
const MEMORY_READ_RATE: f64 = 10e9;

/// What [`decide`] chose, for logs and `plan`.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub tiers: TierPlan,
    pub read_bytes_per_s: f64,
    pub compute_bytes_per_s: f64,
    /// The timing model's seconds per token for this node alone.
    pub predicted_s: f64,
}

/// The streamer for `layers` (in execution order) of `file` when their weights do not fit
/// `budget` (the bytes left for them once everything else is counted), as `settings` say:
/// `None` when nothing streams. The first layers that fit stay resident; the read-ahead
/// depth is `settings.prefetch`, or the one the timing model finds fastest from this
/// machine's measured read rate (of `file`, page cache bypassed) and matrix × vector speed.
pub fn decide(
    file: &Arc<GgufFile>,
    layers: &[usize],
    budget: Option<u64>,
    settings: &StreamSettings,
    threads: usize,
    idle_s: f64,
) -> Result<Option<(Arc<Streamer>, Decision)>, String> {
    if settings.mode == StreamMode::Off || layers.is_empty() {
        return Ok(None);
    }
    let mut sized = Vec::with_capacity(layers.len());
    for &il in layers {
        let span = layer_span(file, il).ok_or_else(|| format!("layer {il} has no tensors"))?;
        sized.push((il, span.range.len() as u64));
    }
    let total: u64 = sized.iter().map(|l| l.1).sum();
    let budget = match (settings.mode, budget) {
        (StreamMode::All, _) => 0,
        (_, Some(b)) if total > b => b,
        _ => return Ok(None),
    };
    let first = layer_span(file, layers[0]).map_or(0, |s| s.range.start as u64);
    let read = match file.path() {
        Some(p) => measure_read_rate(p, first, PROBE_BYTES)
            .map_err(|e| format!("measuring the read rate of {}: {e}", p.display()))?,
        None => MEMORY_READ_RATE,
    };
    let compute = crate::sys::matvec_speed(threads, Duration::from_millis(120));
    let plan = if settings.mode == StreamMode::All {
        let depth = settings.prefetch.unwrap_or(2).clamp(1, MAX_DEPTH);
        let largest = sized.iter().map(|l| l.1).max().unwrap_or(0);
        Some(TierPlan {
            streamed: layers.to_vec(),
            depth,
            resident_bytes: 0,
            pool_bytes: (largest + 2 * ALIGN as u64) * (depth as u64 + 1),
            streamed_bytes: total,
        })
        .map(|tp| {
            let s = predict(&sized, &tp, compute, read, idle_s);
            (tp, s)
        })
    } else {
        match settings.prefetch {
            Some(d) => plan_tiers(&sized, budget, d.clamp(1, MAX_DEPTH)).map(|tp| {
                let s = predict(&sized, &tp, compute, read, idle_s);
                (tp, s)
            }),
            None => choose_depth(&sized, budget, compute, read, idle_s),
        }
    };
    let Some((tiers, predicted_s)) = plan else {
        let largest = sized.iter().map(|l| l.1).max().unwrap_or(0);
        return Err(format!(
            "the layers need {} MiB and {} MiB is left for them: not even two layer buffers \
             of {} MiB fit to stream them",
            total >> 20,
            budget >> 20,
            largest >> 20
        ));
    };
    let streamer = Streamer::new(file, &tiers.streamed, tiers.depth)
        .map_err(|e| format!("starting the layer streamer: {e}"))?;
    tracing::info!(
        resident_layers = layers.len() - tiers.streamed.len(),
        streamed_layers = tiers.streamed.len(),
        resident_mib = tiers.resident_bytes >> 20,
        streamed_mib_per_token = tiers.streamed_bytes >> 20,
        depth = tiers.depth,
        read_mb_s = read / 1e6,
        matvec_gb_s = compute / 1e9,
        predicted_tok_s = 1.0 / predicted_s,
        "layers do not fit the budget: streaming the rest"
    );
    Ok(Some((
        Arc::new(streamer),
        Decision {
            tiers,
            read_bytes_per_s: read,
            compute_bytes_per_s: compute,
            predicted_s,
        },
    )))
}

/// What [`decide_experts`] chose, for logs, `run` and `bench`.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertDecision {
    /// Bytes of the layers without their experts (tier A), and of every expert.
    pub resident_bytes: u64,
    pub expert_bytes: u64,
    pub slots: usize,
    pub experts: usize,
    pub pool_bytes: u64,
    pub read_bytes_per_s: f64,
    /// Expected bytes read per decoded token with a router that picks uniformly (the worst
    /// case for a cache) and the time it takes at the read rate.
    pub uniform_bytes_per_token: f64,
    pub predicted_s: f64,
}

/// The expert store for `layers` of `file` when they hold a mixture of experts that does not
/// fit `budget` (the bytes left for the layers' weights), or when `settings` ask for
/// experts streamed: `None` when the experts stay resident (or the model has none). The
/// layers without their experts must fit the budget with at least
/// [`ExpertLayout::min_slots`] expert buffers; every further buffer the budget holds caches
/// experts.
pub fn decide_experts(
    file: &Arc<GgufFile>,
    layers: &[usize],
    budget: Option<u64>,
    settings: &StreamSettings,
    threads: usize,
) -> Result<Option<(Arc<ExpertStore>, ExpertDecision)>, String> {
    if matches!(settings.mode, StreamMode::Off | StreamMode::All) || layers.is_empty() {
        return Ok(None);
    }
    let Ok(layout) = ExpertLayout::new(file, layers) else {
        return Ok(None);
    };
    let mut total = 0u64;
    for &il in layers {
        total += layer_span(file, il).map_or(0, |s| s.range.len() as u64);
    }
    let experts_bytes = layout.expert_bytes();
    let resident = total.saturating_sub(experts_bytes);
    let slot = layout.slot_bytes() as u64;
    let n_experts = layout.experts();
    let slots = match (settings.mode, settings.expert_slots, budget) {
        (_, Some(n), _) => n,
        (StreamMode::Experts, None, None) => (n_experts / 8).max(ExpertLayout::min_slots()),
        (_, None, Some(b)) if total > b || settings.mode == StreamMode::Experts => {
            if resident + slot * ExpertLayout::min_slots() as u64 > b {
                return Err(format!(
                    "the layers without their experts need {} MiB and {} MiB is left for them: \
                     not even {} expert buffers of {} MiB fit beside them",
                    resident >> 20,
                    b >> 20,
                    ExpertLayout::min_slots(),
                    slot >> 20
                ));
            }
            ((b - resident) / slot) as usize
        }
        _ => return Ok(None),
    };
    let slots = slots.clamp(
        ExpertLayout::min_slots(),
        n_experts.max(ExpertLayout::min_slots()),
    );
    let first = layers
        .iter()
        .find_map(|&il| layer_span(file, il))
        .map_or(0, |s| s.range.start as u64);
    let read = match file.path() {
        Some(p) => measure_read_rate(p, first, PROBE_BYTES)
            .map_err(|e| format!("measuring the read rate of {}: {e}", p.display()))?,
        None => MEMORY_READ_RATE,
    };
    let moe_layers = layers.iter().filter(|&&il| layout.has(il)).count();
    let md = file.metadata();
    let used = md
        .str("general.architecture")
        .ok()
        .and_then(|a| md.u64(&format!("{a}.expert_used_count")).ok())
        .map_or(1.0, |k| k as f64);
    let miss = (1.0 - slots as f64 / n_experts.max(1) as f64).max(0.0);
    let uniform = moe_layers as f64 * used * layout.bytes_per_expert() * miss;
    let compute = crate::sys::matvec_speed(threads, Duration::from_millis(120));
    let active = resident as f64 + moe_layers as f64 * used * layout.bytes_per_expert();
    let predicted_s = (active / compute).max(uniform / read);
    let store = ExpertStore::new(file, layout, slots, !settings.no_expert_predict)
        .map_err(|e| format!("starting the expert store: {e}"))?;
    tracing::info!(
        resident_mib = resident >> 20,
        experts_mib = experts_bytes >> 20,
        slots,
        experts = n_experts,
        read_mb_s = read / 1e6,
        "experts stream from disk"
    );
    Ok(Some((
        Arc::new(store),
        ExpertDecision {
            resident_bytes: resident,
            expert_bytes: experts_bytes,
            slots,
            experts: n_experts,
            pool_bytes: slots as u64 * slot,
            read_bytes_per_s: read,
            uniform_bytes_per_token: uniform,
            predicted_s,
        },
    )))
}
