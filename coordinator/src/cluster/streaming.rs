//! Plans for a model larger than the ring's memory: every node keeps what fits resident and
//! streams the rest of its layers from disk each token ([`ringllm_model::stream`]). The layers
//! can be laid out in one window per node (**stream in place**, one round per token) or in `k`
//! windows per node (**k rounds**: the token goes round the ring k times, node i running its
//! window r in round r), so that each node reads its next window while the others compute.
//! The **naive** layout, every node streaming its whole slice each token, is predicted too, for
//! comparison.
//!
//! Each alternative is priced with the ring's timing model ([`simulate`]): per node, the
//! streamer's own model of its reader ([`stream::ReadAhead`]: the node's measured disk rate
//! filling `depth + 1` layer buffers in run order); per layer, compute at the node's measured
//! matvec speed; per hop, half the round trip plus the hidden state at the assumed link speed.
//! The fastest is chosen; `plan` lists all.
//!
//! Layers are shared between the nodes in proportion to their memory for layers (what is left
//! of the budget after scratch, KV and the head), then cut into windows round by round. Within
//! a node, the first layers it runs are the resident ones ([`stream::plan_tiers`]).

use super::planner::{
    format_bytes, CoordinatorInput, HeadPlace, ModelCost, Plan, PlanError, StageInput, StagePlan,
    ASSUMED_LINK_BYTES_PER_S,
};
use ringllm_model::stream::{self, ReadAhead, SimLayer};
use std::ops::Range;

/// The most rounds considered.
pub const MAX_ROUNDS: usize = 4;
/// Read rate assumed for a node that did not measure one (bytes/s).
pub const ASSUMED_DISK_BYTES_PER_S: f64 = 500e6;

/// One node of the ring's timing model: its reader.
#[derive(Clone, Debug, PartialEq)]
pub struct SimNode {
    /// Sequential read rate, bytes per second.
    pub read_bytes_per_s: f64,
    /// Layers read ahead (the pool holds `depth + 1` layers).
    pub depth: usize,
}

/// A token's path: `(node, layers run there)` in ring order, one hop of `hop_s` between
/// visits (and from the last back to the first), plus `fixed_s` per token elsewhere
/// (embedding, head, sampling).
#[derive(Clone, Debug, PartialEq)]
pub struct SimRing {
    pub nodes: Vec<SimNode>,
    pub visits: Vec<(usize, Vec<SimLayer>)>,
    pub hop_s: f64,
    pub fixed_s: f64,
}

/// Seconds per decoded token in steady state, one token in flight: each node's reader is the
/// streamer's timing model ([`ReadAhead`]), cycling over its streamed layers in the order the
/// token's visits run them; a visit to a node not in `nodes` is left out.
pub fn simulate(ring: &SimRing) -> f64 {
    let mut readers: Vec<ReadAhead> = ring
        .nodes
        .iter()
        .map(|n| ReadAhead::new(n.read_bytes_per_s, n.depth))
        .collect();
    stream::steady_state(|mut t| {
        for (node, layers) in &ring.visits {
            let Some(reader) = readers.get_mut(*node) else {
                continue;
            };
            t += ring.hop_s;
            for l in layers {
                t = reader.run(t, l);
            }
        }
        t + (ring.hop_s + ring.fixed_s)
    })
}

/// Which layouts to consider.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Choice {
    /// The fastest of stream in place and 2..=MAX_ROUNDS rounds.
    #[default]
    Auto,
    /// Exactly this many rounds (1: stream in place).
    Rounds(usize),
    /// Every node streams its whole slice (the baseline).
    Naive,
}

/// One stage of a streaming layout.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct StreamStage {
    pub name: String,
    /// Its windows, one per round.
    pub windows: Vec<Range<usize>>,
    /// Layers streamed, in run order.
    pub streamed: Vec<usize>,
    pub resident_bytes: u64,
    pub pool_bytes: u64,
    /// Bytes read from disk per token.
    pub streamed_bytes: u64,
    pub kv_bytes: u64,
    pub memory_budget: u64,
    pub holds_head: bool,
    pub disk_bytes_per_s: f64,
}

/// One way of running the model.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Alternative {
    /// "stream in place", "2 rounds", "naive".
    pub name: String,
    pub rounds: usize,
    pub naive: bool,
    /// Layers read ahead on every node.
    pub depth: usize,
    pub stages: Vec<StreamStage>,
    pub predicted_s_per_token: f64,
    pub predicted_tokens_per_s: f64,
}

/// Every alternative priced, and the one chosen.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct StreamingPlan {
    pub alternatives: Vec<Alternative>,
    pub chosen: usize,
    pub head: HeadPlace,
}

impl StreamingPlan {
    pub fn chosen(&self) -> &Alternative {
        &self.alternatives[self.chosen]
    }

    /// The chosen layout as a [`Plan`] (each stage's layers: the span of its windows; its
    /// weights: the resident ones), for what reads a plan.
    pub fn to_plan(&self, stages: &[StageInput], slots: usize) -> Plan {
        let c = self.chosen();
        let plans = c
            .stages
            .iter()
            .zip(stages)
            .map(|(st, inp)| StagePlan {
                name: st.name.clone(),
                address: inp.address.clone(),
                local: false,
                layers: st.windows.first().map_or(0, |w| w.start)
                    ..st.windows.last().map_or(0, |w| w.end),
                weight_bytes: st.resident_bytes,
                kv_bytes: st.kv_bytes,
                scratch_bytes: inp.scratch_bytes,
                memory_budget: inp.memory_budget,
                compute_s: 0.0,
                holds_head: st.holds_head,
            })
            .collect();
        Plan {
            stages: plans,
            slots,
            head: self.head,
            coordinator_s: 0.0,
            link_s: 0.0,
            transfer_s: 0.0,
            predicted_s_per_token: c.predicted_s_per_token,
            predicted_tokens_per_s: c.predicted_tokens_per_s,
        }
    }

    /// What stage `i` is told: its windows (several rounds), streamed layers and read-ahead.
    pub fn layout(&self, i: usize) -> ringllm_protocol::control::StageLayout {
        let c = self.chosen();
        let Some(st) = c.stages.get(i) else {
            return Default::default();
        };
        ringllm_protocol::control::StageLayout {
            windows: if c.rounds > 1 {
                st.windows
                    .iter()
                    .map(|w| (w.start as u32, w.end as u32))
                    .collect()
            } else {
                Vec::new()
            },
            streamed: st.streamed.iter().map(|&l| l as u32).collect(),
            prefetch: c.depth as u32,
            stream_all: c.naive,
            ..Default::default()
        }
    }
}

fn positive(x: f64, fallback: f64) -> f64 {
    if x.is_finite() && x > 0.0 {
        x
    } else {
        fallback
    }
}

/// Plans a streaming layout over `stages` (all remote: a ring with local layers is not
/// streamed) with `disk` read rates (bytes/s, one per stage; 0: unknown).
pub fn plan(
    model: &ModelCost,
    coord: &CoordinatorInput,
    stages: &[StageInput],
    disk: &[f64],
    choice: Choice,
) -> Result<StreamingPlan, PlanError> {
    let n = model.n_layer;
    let s_count = stages.len();
    if s_count == 0 || n == 0 {
        return Err(PlanError::BadInput {
            detail: "no stages or no layers to stream".into(),
        });
    }
    if stages.iter().any(|s| s.local) {
        return Err(PlanError::BadInput {
            detail: "layers are streamed only on nodes: remove the local stage from the ring"
                .into(),
        });
    }
    let coord_need = model.coordinator_need();
    let head = if coord_need <= coord.memory_budget {
        HeadPlace::Coordinator
    } else {
        HeadPlace::LastNode
    };
    // A mixture of experts streams its experts, not its layers (the nodes do so whenever
    // their layout lists streamed layers): that one layout, and the naive one to compare.
    if model.experts.is_some() && choice != Choice::Naive {
        return plan_experts(model, coord, stages, disk, head);
    }
    let rounds: Vec<(usize, bool)> = match choice {
        Choice::Auto => (1..=MAX_ROUNDS)
            .map(|k| (k, false))
            .chain([(1, true)])
            .collect(),
        Choice::Rounds(k) => vec![(k.max(1), false), (1, true)],
        Choice::Naive => vec![(1, true)],
    };
    let mut alternatives = Vec::new();
    let mut why_not = Vec::new();
    for (k, naive) in rounds {
        if k * s_count > n {
            why_not.push(format!("{k} rounds need {} layers", k * s_count));
            continue;
        }
        let mut best: Option<Alternative> = None;
        for depth in 1..=4 {
            match price(model, coord, stages, disk, head, k, naive, depth) {
                Ok(a) => {
                    if best
                        .as_ref()
                        .is_none_or(|b| a.predicted_s_per_token < b.predicted_s_per_token * 0.999)
                    {
                        best = Some(a);
                    }
                }
                // The smallest pool (depth 1) says why a layout cannot be streamed at all.
                Err(e) if depth == 1 => why_not.push(e),
                Err(_) => {}
            }
        }
        if let Some(b) = best {
            alternatives.push(b);
        }
    }
    let chosen = alternatives
        .iter()
        .enumerate()
        .filter(|(_, a)| match choice {
            Choice::Naive => a.naive,
            Choice::Rounds(k) => !a.naive && a.rounds == k.max(1),
            Choice::Auto => !a.naive,
        })
        .min_by(|a, b| {
            a.1.predicted_s_per_token
                .total_cmp(&b.1.predicted_s_per_token)
        })
        .map(|(i, _)| i);
    let Some(chosen) = chosen else {
        why_not.sort();
        why_not.dedup();
        return Err(PlanError::DoesNotFit {
            needed: model.layer_weight_bytes.iter().sum(),
            available: stages.iter().map(|s| s.memory_budget).sum(),
            detail: format!(
                "even streaming layers from disk does not fit: {}",
                why_not.join("; ")
            ),
        });
    };
    Ok(StreamingPlan {
        alternatives,
        chosen,
        head,
    })
}

/// A mixture of experts over `stages` whose experts do not fit: each node keeps its layers
/// without their experts resident and caches what its budget holds of the experts; the naive
/// layout (every layer streamed whole) beside it for comparison.
fn plan_experts(
    model: &ModelCost,
    coord: &CoordinatorInput,
    stages: &[StageInput],
    disk: &[f64],
    head: HeadPlace,
) -> Result<StreamingPlan, PlanError> {
    let mut alternatives = Vec::new();
    let chosen = match price_experts(model, coord, stages, disk, head) {
        Ok(a) => a,
        Err(why) => {
            return Err(PlanError::DoesNotFit {
                needed: model.layer_weight_bytes.iter().sum(),
                available: stages.iter().map(|s| s.memory_budget).sum(),
                detail: format!("even streaming the experts from disk does not fit: {why}"),
            })
        }
    };
    alternatives.push(chosen);
    if let Ok(naive) = price(model, coord, stages, disk, head, 1, true, 1) {
        alternatives.push(naive);
    }
    Ok(StreamingPlan {
        alternatives,
        chosen: 0,
        head,
    })
}

/// Prices experts streamed in place: layers shared in proportion to the room left once
/// their non-expert weights are resident; per node, a cache of what the rest holds, and per
/// token the picked experts it misses (a router picking uniformly, the worst case) read at
/// its disk rate, not overlapped with the compute (the reads wait for the router).
fn price_experts(
    model: &ModelCost,
    coord: &CoordinatorInput,
    stages: &[StageInput],
    disk: &[f64],
    head: HeadPlace,
) -> Result<Alternative, String> {
    let Some(ex) = &model.experts else {
        return Err("the model has no experts".into());
    };
    let mut alt = price(model, coord, stages, disk, head, 1, true, 1)
        .or_else(|_| price_lenient(model, coord, stages, disk, head))?;
    let speed = |i: usize| positive(stages[i].bytes_per_s, 1.0);
    let slots = model.slots.max(1) as u64;
    let mut total_s = 0.0;
    for (i, st) in alt.stages.iter_mut().enumerate() {
        let layers: Vec<usize> = st.windows.iter().flat_map(|w| w.clone()).collect();
        let experts: u64 = layers.iter().map(|&l| ex.layer_expert_bytes[l]).sum();
        let all: u64 = layers.iter().map(|&l| model.layer_weight_bytes[l]).sum();
        let resident = all - experts;
        let kv: u64 = layers.iter().map(|&l| model.layer_kv_bytes[l]).sum::<u64>() * slots;
        let head_mem = if st.holds_head { model.head_bytes } else { 0 };
        let room = st
            .memory_budget
            .saturating_sub(stages[i].scratch_bytes)
            .saturating_sub(head_mem)
            .saturating_sub(kv);
        let min_pool = ex.slot_bytes * ex.min_slots as u64;
        if resident + min_pool > room {
            return Err(format!(
                "stage \"{}\" has {} for layers, less than their {} without experts and {} \
                 expert buffers",
                st.name,
                format_bytes(room),
                format_bytes(resident),
                ex.min_slots
            ));
        }
        let n_experts = (layers.len() * ex.n_expert) as u64;
        let cached = ((room - resident) / ex.slot_bytes.max(1)).min(n_experts);
        let miss = 1.0 - cached as f64 / n_experts.max(1) as f64;
        let per_expert = experts as f64 / n_experts.max(1) as f64;
        let read = layers.len() as f64 * ex.n_used as f64 * per_expert * miss;
        let active: u64 = layers
            .iter()
            .map(|&l| {
                model
                    .layer_active_bytes
                    .get(l)
                    .copied()
                    .unwrap_or(model.layer_weight_bytes[l])
            })
            .sum();
        total_s += active as f64 / speed(i) + read / st.disk_bytes_per_s;
        st.streamed = layers;
        st.resident_bytes = resident;
        st.pool_bytes = cached * ex.slot_bytes;
        st.streamed_bytes = read as u64;
        st.kv_bytes = kv;
    }
    let hop = model.hidden_bytes as f64 / super::planner::ASSUMED_LINK_BYTES_PER_S;
    let head_s = head_seconds(model, coord, head);
    let s = total_s + (stages.len() + 1) as f64 * hop + head_s;
    alt.name = "experts streamed in place".into();
    alt.naive = false;
    alt.depth = 0;
    alt.predicted_s_per_token = s;
    alt.predicted_tokens_per_s = 1.0 / s.max(1e-12);
    Ok(alt)
}

/// [`price`]'s layer shares when its naive pools do not fit: the same windows with no tiers.
fn price_lenient(
    model: &ModelCost,
    coord: &CoordinatorInput,
    stages: &[StageInput],
    disk: &[f64],
    head: HeadPlace,
) -> Result<Alternative, String> {
    // A pretend budget large enough for the naive pools: only the windows are used.
    let big: Vec<StageInput> = stages
        .iter()
        .map(|s| StageInput {
            memory_budget: s.memory_budget.saturating_mul(1024),
            ..s.clone()
        })
        .collect();
    let mut a = price(model, coord, &big, disk, head, 1, true, 1)?;
    for (st, s) in a.stages.iter_mut().zip(stages) {
        st.memory_budget = s.memory_budget;
    }
    Ok(a)
}

/// Prices one layout: `k` rounds (or naive), `depth` layers read ahead.
#[allow(clippy::too_many_arguments)]
fn price(
    model: &ModelCost,
    coord: &CoordinatorInput,
    stages: &[StageInput],
    disk: &[f64],
    head: HeadPlace,
    k: usize,
    naive: bool,
    depth: usize,
) -> Result<Alternative, String> {
    let n = model.n_layer;
    let sc = stages.len();
    let slots = model.slots.max(1) as u64;
    let last = sc - 1;
    let head_mem = |i: usize| {
        if head == HeadPlace::LastNode && i == last {
            model.head_bytes
        } else {
            0
        }
    };
    // Memory for layers and their KV per stage.
    let room: Vec<u64> = stages
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.memory_budget
                .saturating_sub(s.scratch_bytes)
                .saturating_sub(head_mem(i))
        })
        .collect();
    let total_room: u64 = room.iter().sum::<u64>().max(1);
    // Layers per stage in proportion to room, at least k each.
    let mut share = vec![0usize; sc];
    let mut acc = 0f64;
    let mut given = 0usize;
    for i in 0..sc {
        acc += room[i] as f64 / total_room as f64 * n as f64;
        let upto = if i == last { n } else { acc.round() as usize };
        let left_for_rest = (sc - 1 - i) * k;
        let want = upto
            .saturating_sub(given)
            .max(k)
            .min(n - given - left_for_rest);
        share[i] = want;
        given += want;
    }
    // Window sizes: stage i's share cut into k nearly equal windows.
    let windows_of = |i: usize| -> Vec<usize> {
        (0..k)
            .map(|r| share[i] * (r + 1) / k - share[i] * r / k)
            .collect()
    };
    let sizes: Vec<Vec<usize>> = (0..sc).map(windows_of).collect();
    let mut out: Vec<StreamStage> = stages
        .iter()
        .enumerate()
        .map(|(i, s)| StreamStage {
            name: s.name.clone(),
            windows: Vec::new(),
            streamed: Vec::new(),
            resident_bytes: 0,
            pool_bytes: 0,
            streamed_bytes: 0,
            kv_bytes: 0,
            memory_budget: s.memory_budget,
            holds_head: head_mem(i) > 0,
            disk_bytes_per_s: positive(
                disk.get(i).copied().unwrap_or(0.0),
                ASSUMED_DISK_BYTES_PER_S,
            ),
        })
        .collect();
    let mut at = 0usize;
    for r in 0..k {
        for (st, size) in out.iter_mut().zip(&sizes) {
            st.windows.push(at..at + size[r]);
            at += size[r];
        }
    }
    debug_assert_eq!(at, n);
    // Tiers per stage.
    for (i, st) in out.iter_mut().enumerate() {
        let layers: Vec<(usize, u64)> = st
            .windows
            .iter()
            .flat_map(|w| w.clone())
            .map(|l| (l, model.layer_weight_bytes[l]))
            .collect();
        st.kv_bytes = layers
            .iter()
            .map(|&(l, _)| model.layer_kv_bytes[l])
            .sum::<u64>()
            * slots;
        let budget = room[i].saturating_sub(st.kv_bytes);
        let tp = if naive {
            let largest = layers.iter().map(|l| l.1).max().unwrap_or(0);
            let pool = (largest + 8192) * (depth as u64 + 1);
            if pool > budget {
                return Err(format!(
                    "stage \"{}\" has {} for layers, less than {} read-ahead buffers",
                    st.name,
                    format_bytes(budget),
                    depth + 1
                ));
            }
            stream::TierPlan {
                streamed: layers.iter().map(|l| l.0).collect(),
                depth,
                resident_bytes: 0,
                pool_bytes: pool,
                streamed_bytes: layers.iter().map(|l| l.1).sum(),
            }
        } else {
            stream::plan_tiers(&layers, budget, depth).ok_or_else(|| {
                format!(
                    "stage \"{}\" has {} for layers, less than {} read-ahead buffers",
                    st.name,
                    format_bytes(budget),
                    depth + 1
                )
            })?
        };
        st.streamed = tp.streamed;
        st.resident_bytes = tp.resident_bytes;
        st.pool_bytes = tp.pool_bytes;
        st.streamed_bytes = tp.streamed_bytes;
    }
    let ring = sim_ring(model, coord, stages, &out, head, k, depth);
    let s = simulate(&ring);
    Ok(Alternative {
        name: if naive {
            "naive (every layer streamed)".into()
        } else if k == 1 {
            "stream in place".into()
        } else {
            format!("{k} rounds")
        },
        rounds: k,
        naive,
        depth,
        stages: out,
        predicted_s_per_token: s,
        predicted_tokens_per_s: 1.0 / s.max(1e-12),
    })
}

/// The head's compute per token where the coordinator holds it (0 on the last node: its
/// time is counted with that node's layers).
fn head_seconds(model: &ModelCost, coord: &CoordinatorInput, head: HeadPlace) -> f64 {
    if head == HeadPlace::Coordinator {
        model.head_bytes as f64 / positive(coord.bytes_per_s, 1.0)
    } else {
        0.0
    }
}

/// The timing model of a layout.
fn sim_ring(
    model: &ModelCost,
    coord: &CoordinatorInput,
    stages: &[StageInput],
    layout: &[StreamStage],
    head: HeadPlace,
    k: usize,
    depth: usize,
) -> SimRing {
    let speed = |i: usize| positive(stages[i].bytes_per_s, 1.0);
    let nodes = layout
        .iter()
        .map(|st| SimNode {
            read_bytes_per_s: st.disk_bytes_per_s,
            depth,
        })
        .collect();
    let mut visits = Vec::new();
    for r in 0..k {
        for (i, st) in layout.iter().enumerate() {
            let mut ls: Vec<SimLayer> = st.windows[r]
                .clone()
                .map(|l| {
                    let b = model.layer_weight_bytes[l];
                    SimLayer {
                        compute_s: b as f64 / speed(i),
                        streamed_bytes: st.streamed.contains(&l).then_some(b),
                    }
                })
                .collect();
            if st.holds_head && r + 1 == k {
                ls.push(SimLayer {
                    compute_s: model.head_bytes as f64 / speed(i),
                    streamed_bytes: None,
                });
            }
            visits.push((i, ls));
        }
    }
    let mean_rtt = stages
        .iter()
        .map(|s| positive(s.link_rtt_s, 0.0))
        .sum::<f64>()
        / stages.len().max(1) as f64;
    let hop_s = mean_rtt / 2.0 + model.hidden_bytes as f64 / ASSUMED_LINK_BYTES_PER_S;
    let head_s = head_seconds(model, coord, head);
    SimRing {
        nodes,
        visits,
        hop_s,
        // The coordinator relays between rounds: one more hop per extra round.
        fixed_s: head_s + (k - 1) as f64 * hop_s,
    }
}

impl std::fmt::Display for StreamingPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / 1048576.0;
        writeln!(
            f,
            "the model does not fit the ring's memory: layers are streamed from disk"
        )?;
        writeln!(
            f,
            "{:<30} {:>6} {:>6} {:>12} {:>10}",
            "layout", "rounds", "depth", "MiB read/tok", "pred tok/s"
        )?;
        for (i, a) in self.alternatives.iter().enumerate() {
            let read: u64 = a.stages.iter().map(|s| s.streamed_bytes).sum();
            writeln!(
                f,
                "{:<30} {:>6} {:>6} {:>12.1} {:>10.3}{}",
                a.name,
                a.rounds,
                a.depth,
                mib(read),
                a.predicted_tokens_per_s,
                if i == self.chosen { "  <- chosen" } else { "" }
            )?;
        }
        let c = self.chosen();
        for s in &c.stages {
            let windows: Vec<String> = s
                .windows
                .iter()
                .map(|w| format!("{}-{}", w.start, w.end.saturating_sub(1)))
                .collect();
            writeln!(
                f,
                "  {:<12} windows {:<18} resident {:>8.1} MiB  pool {:>7.1} MiB  streamed {:>3} layers ({:>7.1} MiB/token)  kv {:>6.1} MiB  budget {:>8.1} MiB  disk {:>6.0} MB/s{}",
                s.name,
                windows.join(","),
                mib(s.resident_bytes),
                mib(s.pool_bytes),
                s.streamed.len(),
                mib(s.streamed_bytes),
                mib(s.kv_bytes),
                mib(s.memory_budget),
                s.disk_bytes_per_s / 1e6,
                if s.holds_head { " (+head)" } else { "" }
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
