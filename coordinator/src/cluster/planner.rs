//! Layer planner: which stage of the ring runs which layers. Pure arithmetic, no I/O.
//!
//! # Model of a decoded token
//!
//! Decoding reads every weight once per token, so a stage's time per token is the bytes of
//! weights it holds divided by the weight-read speed measured on that machine
//! ([`StageInput::bytes_per_s`]). A token goes coordinator → stage 0 → … → last stage →
//! coordinator, so the predicted time per token is the sum of
//!
//! - every stage's compute time (the last stage's includes the output head when it holds it);
//! - the coordinator's head time, `head_bytes / CoordinatorInput::bytes_per_s`, when the head is
//!   on the coordinator (reading one embedding row is left out: it is a few KiB);
//! - the link latency, [`Plan::link_s`]: half a round trip per hop — coordinator → first stage,
//!   stage → next stage (the mean of the two stages' half round trips), last stage →
//!   coordinator. A local stage runs inside the coordinator, so a hop to or from it costs the
//!   other end's half round trip (0 between the coordinator and the local stage);
//! - the wire time, [`Plan::transfer_s`], at an **assumed 1 Gbit/s (125e6 bytes/s)**
//!   ([`ASSUMED_LINK_BYTES_PER_S`]): one hidden state (`hidden_bytes`) per network hop, except
//!   that when the last stage holds the head it sends the f16 logits (`logits_bytes_f16`) back
//!   to the coordinator instead.
//!
//! # Where the head goes
//!
//! The coordinator always holds the token embedding, and the output head too when embedding +
//! head fit in its budget (counted once when they are one tied tensor). Otherwise the head goes
//! to the last stage ([`HeadPlace::LastNode`]), whose memory and compute then include it. The
//! coordinator's budget does not include the local stage's: the local stage has its own
//! [`StageInput::memory_budget`], and a caller with one budget for the whole coordinator process
//! splits it between the two.
//!
//! # What a stage holds
//!
//! A stage's memory is its layers' weights, their KV caches at the context for every slot
//! ([`ModelCost::slots`]: serving's `--parallel` keeps one cache per sequence), the runner's
//! scratch for the largest batch ([`StageInput::scratch_bytes`], whatever its layers) and the
//! output head when it holds it. Each must fit the stage's budget, which the caller gives with
//! the headroom already taken off.
//!
//! # How layers are split
//!
//! Every stage gets one contiguous range of at least one layer, in stage order. Pinned stages
//! keep their pins. The free layers are shared by the other stages so that their times per
//! token are balanced — layer counts in proportion to speed — within each stage's memory: a
//! stage at its cap keeps what fits and the rest goes to the others, again in proportion to
//! speed (water-filling). Exactly: among all splits into contiguous ranges that fit, the planner
//! takes the one minimising `Σ time_i² · speed_i` (`= Σ weight_bytes_i² / speed_i`). Without caps
//! the continuous minimum is `weight_bytes_i ∝ speed_i`; with caps it is water-filling; and as a
//! search over cut points (a dynamic program over stages × layers) it also handles layers of
//! different sizes exactly. Ties go to the split with the earliest cuts, so the output is
//! deterministic.
//!
//! Balanced times are what a pipeline of several requests wants, and every stage the user listed
//! gets work; a single request alone would finish sooner with everything on the fastest machine
//! that could hold it.
//!
//! A speed that is 0, negative, NaN or infinite is taken as [`MIN_BYTES_PER_S`] (1 byte/s):
//! such a stage gets as few layers as the constraints allow and the prediction says it is slow.
//! A round trip that is negative or not finite is taken as 0.

use std::fmt;
use std::ops::Range;

/// Link speed the plan assumes for wire time: 1 Gbit/s.
pub const ASSUMED_LINK_BYTES_PER_S: f64 = 125e6;
/// Stand-in for a speed that is 0, negative or not a finite number.
pub const MIN_BYTES_PER_S: f64 = 1.0;
/// Memory kept free on a machine beyond weights, KV and scratch: at most this, …
pub const HEADROOM: u64 = 256 << 20;
/// … at least this (a node's own overhead: runtime, threads, frame buffers, allocator slack) …
pub const MIN_HEADROOM: u64 = 48 << 20;

/// … and otherwise an eighth of what the machine reports: a node capped at 512 MiB (cgroup or
/// `node --memory`) keeps 64 MiB, one with 8 GiB free keeps 256 MiB.
pub fn headroom(available: u64) -> u64 {
    (available / 8).clamp(MIN_HEADROOM, HEADROOM)
}

/// Sizes of the model, in bytes, at the configured context.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelCost {
    pub n_layer: usize,
    /// Per layer: bytes of weights (what the layer's stage holds).
    pub layer_weight_bytes: Vec<u64>,
    /// Per layer: bytes of weights one decoded token reads, where it differs from
    /// `layer_weight_bytes` (a mixture of experts reads only the picked experts); empty: the
    /// same.
    pub layer_active_bytes: Vec<u64>,
    /// Per layer: one KV cache's bytes at the configured context.
    pub layer_kv_bytes: Vec<u64>,
    /// KV caches every stage keeps: serving's `--parallel`, else 1 (0 is taken as 1).
    pub slots: usize,
    /// Output head + final norm weights (read per token by whoever computes the logits).
    pub head_bytes: u64,
    /// Token embedding (held by the coordinator; one row read per token).
    pub embedding_bytes: u64,
    /// Head and embedding are one tensor (then its memory is counted once).
    pub tied_head: bool,
    /// One token's hidden state on the wire.
    pub hidden_bytes: u64,
    /// `vocab × 2`: what a stage holding the head sends back per token.
    pub logits_bytes_f16: u64,
    /// Per layer: the earlier layer whose KV cache it reads (Gemma 4's shared-KV layers),
    /// which must be in the same stage; empty: every layer has its own.
    pub kv_source: Vec<Option<usize>>,
    /// A mixture of experts's experts, which a node short of memory streams from disk.
    pub experts: Option<ExpertCost>,
}

/// The experts of a mixture of experts, for a plan that streams them.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertCost {
    /// Per layer: bytes of its experts (part of `layer_weight_bytes`).
    pub layer_expert_bytes: Vec<u64>,
    /// Experts per layer and picked per token.
    pub n_expert: usize,
    pub n_used: usize,
    /// One expert buffer of a node's cache, and the fewest buffers a node works with.
    pub slot_bytes: u64,
    pub min_slots: usize,
}

impl ModelCost {
    /// What the coordinator holds when the head is there: embedding and head (one tensor
    /// when tied).
    pub fn coordinator_need(&self) -> u64 {
        if self.tied_head {
            self.embedding_bytes.max(self.head_bytes)
        } else {
            self.embedding_bytes.saturating_add(self.head_bytes)
        }
    }
}

/// One stage of the ring, in ring order.
#[derive(Debug, Clone, PartialEq)]
pub struct StageInput {
    pub name: String,
    /// For display; "local" for the local stage.
    pub address: String,
    /// Runs inside the coordinator process.
    pub local: bool,
    /// Bytes available for weights + KV + scratch (headroom already taken off).
    pub memory_budget: u64,
    /// The runner's scratch buffers for the largest batch on that machine (its threads):
    /// held whatever layers the stage gets.
    pub scratch_bytes: u64,
    /// Measured weight-read speed of a quantized matvec on that machine.
    pub bytes_per_s: f64,
    /// Measured round trip coordinator ↔ stage, seconds (0 for the local stage).
    pub link_rtt_s: f64,
    /// Manual split, if the cluster file pins one.
    pub pinned: Option<Range<usize>>,
}

/// The coordinator's own resources.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CoordinatorInput {
    /// Bytes for the embedding and (if it fits) the head; see the module docs.
    pub memory_budget: u64,
    /// Weight-read speed of the coordinator (for the head).
    pub bytes_per_s: f64,
}

/// Who computes the logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum HeadPlace {
    Coordinator,
    LastNode,
}

/// What one stage runs.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StagePlan {
    pub name: String,
    pub address: String,
    pub local: bool,
    pub layers: Range<usize>,
    /// Weights of the layers, plus the head's when `holds_head`.
    pub weight_bytes: u64,
    /// KV caches of the layers, all slots.
    pub kv_bytes: u64,
    pub scratch_bytes: u64,
    pub memory_budget: u64,
    /// Predicted time per token, seconds (with the head's when `holds_head`).
    pub compute_s: f64,
    pub holds_head: bool,
}

/// A split of the model over the ring and what it should cost per token.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Plan {
    /// One per input stage, same order, each with at least one layer.
    pub stages: Vec<StagePlan>,
    /// KV caches per stage ([`ModelCost::slots`]).
    pub slots: usize,
    pub head: HeadPlace,
    /// Head time per token on the coordinator (0 with [`HeadPlace::LastNode`]).
    pub coordinator_s: f64,
    /// Sum of the one-way link latencies around the ring per token.
    pub link_s: f64,
    /// Wire time per token at [`ASSUMED_LINK_BYTES_PER_S`]: hidden states, and the f16 logits
    /// when the last stage holds the head.
    pub transfer_s: f64,
    /// Stage compute + `coordinator_s` + `link_s` + `transfer_s`.
    pub predicted_s_per_token: f64,
    pub predicted_tokens_per_s: f64,
}

impl Plan {
    /// A plan with no stages and nothing predicted: a placeholder until the ring is planned.
    pub fn empty() -> Plan {
        Plan {
            stages: Vec::new(),
            slots: 1,
            head: HeadPlace::Coordinator,
            coordinator_s: 0.0,
            link_s: 0.0,
            transfer_s: 0.0,
            predicted_s_per_token: 0.0,
            predicted_tokens_per_s: 0.0,
        }
    }
}

/// Why no plan can be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// The model (or a pinned slice, or the coordinator's part) needs more memory than there is.
    #[error("{}", does_not_fit(*.needed, *.available, .detail))]
    DoesNotFit {
        needed: u64,
        available: u64,
        detail: String,
    },
    /// Pinned ranges out of order, overlapping, outside the model or leaving layers to no one.
    #[error("the layers pinned in the cluster file do not work: {detail}")]
    BadPin { detail: String },
    /// The inputs cannot describe a ring: no stages, more stages than layers, or sizes that
    /// disagree with `n_layer`.
    #[error("cannot plan: {detail}")]
    BadInput { detail: String },
}

fn does_not_fit(needed: u64, available: u64, detail: &str) -> String {
    if needed > available {
        format!(
            "the model does not fit: it needs {} but there are {} — {} short. {detail}",
            format_bytes(needed),
            format_bytes(available),
            format_bytes(needed - available)
        )
    } else {
        format!(
            "the model does not fit: {detail} (needs {} in all, {} available)",
            format_bytes(needed),
            format_bytes(available)
        )
    }
}

/// Bytes in binary units: "1.50 GiB", "312.4 MiB", "12.0 KiB", "512 B".
pub fn format_bytes(b: u64) -> String {
    const KIB: f64 = 1024.0;
    let x = b as f64;
    if x >= KIB.powi(4) {
        format!("{:.2} TiB", x / KIB.powi(4))
    } else if x >= KIB.powi(3) {
        format!("{:.2} GiB", x / KIB.powi(3))
    } else if x >= KIB.powi(2) {
        format!("{:.1} MiB", x / KIB.powi(2))
    } else if x >= KIB {
        format!("{:.1} KiB", x / KIB)
    } else {
        format!("{b} B")
    }
}

/// Inclusive `first-last`, the cluster file's syntax.
pub fn format_layers(r: &Range<usize>) -> String {
    if r.is_empty() {
        "-".to_string()
    } else {
        format!("{}-{}", r.start, r.end - 1)
    }
}

fn speed(s: f64) -> f64 {
    if s.is_finite() && s > 0.0 {
        s.max(MIN_BYTES_PER_S)
    } else {
        MIN_BYTES_PER_S
    }
}

fn rtt(s: f64) -> f64 {
    if s.is_finite() && s > 0.0 {
        s
    } else {
        0.0
    }
}

/// Prefix sums: `p[i]` is the sum of `v[..i]`.
fn prefix(v: &[u64]) -> Vec<u64> {
    let mut p = Vec::with_capacity(v.len() + 1);
    let mut sum = 0u64;
    p.push(0);
    for &x in v {
        sum = sum.saturating_add(x);
        p.push(sum);
    }
    p
}

/// Per boundary `e` in `0..=n_layer`: true when no layer from `e` on reads the KV cache of a
/// layer before `e` (the earliest source read from `e` on, a suffix minimum, is not before it).
fn cuts(model: &ModelCost) -> Vec<bool> {
    let n = model.n_layer;
    let mut cut = vec![true; n + 1];
    let mut earliest = usize::MAX;
    for e in (0..n).rev() {
        if let Some(src) = model.kv_source.get(e).copied().flatten() {
            earliest = earliest.min(src);
        }
        cut[e] = earliest >= e;
    }
    cut
}

/// Splits the model over the stages; see the module docs.
pub fn plan(
    model: &ModelCost,
    coord: &CoordinatorInput,
    stages: &[StageInput],
) -> Result<Plan, PlanError> {
    check_input(model, stages)?;
    check_pins(model.n_layer, stages)?;
    let head = head_place(model, coord)?;
    let sz = Sizes::new(model, stages, head);
    check_budgets(&sz)?;
    let ranges = best_split(&sz).ok_or_else(|| no_split(&sz))?;
    let stage_plans: Vec<StagePlan> = stages
        .iter()
        .zip(ranges)
        .enumerate()
        .map(|(i, (s, r))| StagePlan {
            name: s.name.clone(),
            address: s.address.clone(),
            local: s.local,
            weight_bytes: sz.weights(&r).saturating_add(sz.head_mem(i)),
            kv_bytes: sz.kv(&r),
            scratch_bytes: s.scratch_bytes,
            memory_budget: s.memory_budget,
            compute_s: sz.compute(i, &r),
            holds_head: sz.head_on(i),
            layers: r,
        })
        .collect();
    Ok(predict(model, coord, stages, head, stage_plans))
}

/// The head: on the coordinator when embedding + head fit there, else on the last node (the
/// coordinator keeps the embedding, which must fit).
fn head_place(model: &ModelCost, coord: &CoordinatorInput) -> Result<HeadPlace, PlanError> {
    let coord_need = model.coordinator_need();
    if coord_need <= coord.memory_budget {
        Ok(HeadPlace::Coordinator)
    } else if model.embedding_bytes <= coord.memory_budget {
        Ok(HeadPlace::LastNode)
    } else {
        Err(PlanError::DoesNotFit {
            needed: model.embedding_bytes,
            available: coord.memory_budget,
            detail: format!(
                "The coordinator holds the token embedding ({}) but its budget is {}; give it more \
                 memory ([coordinator] memory in the cluster file).",
                format_bytes(model.embedding_bytes),
                format_bytes(coord.memory_budget)
            ),
        })
    }
}

/// What stage `i` would hold and how long it would compute, for any range of layers.
struct Sizes<'a> {
    model: &'a ModelCost,
    stages: &'a [StageInput],
    head: HeadPlace,
    /// Prefix sums of the layers' weights, of the weights a token reads, and of KV bytes.
    pw: Vec<u64>,
    pa: Vec<u64>,
    pkv: Vec<u64>,
    slots: usize,
    /// `cut[e]`: a stage may start or end before layer `e` (no layer from `e` on reads the KV
    /// cache of a layer before it), for `e` in `0..=n_layer`.
    cut: Vec<bool>,
}

impl<'a> Sizes<'a> {
    fn new(model: &'a ModelCost, stages: &'a [StageInput], head: HeadPlace) -> Sizes<'a> {
        Sizes {
            model,
            stages,
            head,
            pw: prefix(&model.layer_weight_bytes),
            pa: if model.layer_active_bytes.len() == model.layer_weight_bytes.len() {
                prefix(&model.layer_active_bytes)
            } else {
                prefix(&model.layer_weight_bytes)
            },
            pkv: prefix(&model.layer_kv_bytes),
            slots: model.slots.max(1),
            cut: cuts(model),
        }
    }

    fn head_on(&self, i: usize) -> bool {
        self.head == HeadPlace::LastNode && i == self.stages.len() - 1
    }

    fn head_mem(&self, i: usize) -> u64 {
        if self.head_on(i) {
            self.model.head_bytes
        } else {
            0
        }
    }

    /// True when a stage may start or end before layer `e`.
    fn cut_ok(&self, e: usize) -> bool {
        self.cut.get(e).copied().unwrap_or(true)
    }

    fn weights(&self, r: &Range<usize>) -> u64 {
        self.pw[r.end] - self.pw[r.start]
    }

    fn kv(&self, r: &Range<usize>) -> u64 {
        (self.pkv[r.end] - self.pkv[r.start]).saturating_mul(self.slots as u64)
    }

    /// Weights + KV for every slot + scratch (+ the head on the last stage when it holds it).
    fn memory(&self, i: usize, r: &Range<usize>) -> u64 {
        self.weights(r)
            .saturating_add(self.kv(r))
            .saturating_add(self.stages[i].scratch_bytes)
            .saturating_add(self.head_mem(i))
    }

    /// What [`Sizes::memory`] adds up, for messages.
    fn parts(&self, i: usize, r: &Range<usize>) -> String {
        let slots = self.slots;
        let slot_note = if slots > 1 {
            format!(" for {slots} slots")
        } else {
            String::new()
        };
        format!(
            "weights {} + KV{slot_note} {} + scratch {}",
            format_bytes(self.weights(r).saturating_add(self.head_mem(i))),
            format_bytes(self.kv(r)),
            format_bytes(self.stages[i].scratch_bytes)
        )
    }

    /// Bytes of weights a decoded token reads in the layers `r`.
    fn active(&self, r: &Range<usize>) -> u64 {
        self.pa[r.end] - self.pa[r.start]
    }

    fn compute(&self, i: usize, r: &Range<usize>) -> f64 {
        self.active(r).saturating_add(self.head_mem(i)) as f64 / speed(self.stages[i].bytes_per_s)
    }
}

/// Up-front memory checks with a message about one stage: its pinned layers, or its smallest
/// layer, must fit its budget.
fn check_budgets(sz: &Sizes) -> Result<(), PlanError> {
    let n = sz.model.n_layer;
    for (i, s) in sz.stages.iter().enumerate() {
        let head_note = if sz.head_on(i) {
            format!(
                " (plus the output head, {}, as the coordinator has no room for it)",
                format_bytes(sz.model.head_bytes)
            )
        } else {
            String::new()
        };
        if let Some(pin) = &s.pinned {
            let need = sz.memory(i, pin);
            if need > s.memory_budget {
                return Err(PlanError::DoesNotFit {
                    needed: need,
                    available: s.memory_budget,
                    detail: format!(
                        "Stage \"{}\" is pinned to layers {}, which{head_note} need {} ({}) \
                         but its budget is {}; pin fewer layers to it or raise its memory.",
                        s.name,
                        format_layers(pin),
                        format_bytes(need),
                        sz.parts(i, pin),
                        format_bytes(s.memory_budget)
                    ),
                });
            }
        } else {
            let (smallest, l) = (0..n)
                .map(|l| (sz.memory(i, &(l..l + 1)), l))
                .min()
                .unwrap_or((0, 0));
            if smallest > s.memory_budget {
                return Err(PlanError::DoesNotFit {
                    needed: smallest,
                    available: s.memory_budget,
                    detail: format!(
                        "Stage \"{}\" cannot hold even one layer{head_note}: the smallest needs {} \
                         ({}) and its budget is {}; raise its memory, lower the context or \
                         slots, or remove it from the ring.",
                        s.name,
                        format_bytes(smallest),
                        sz.parts(i, &(l..l + 1)),
                        format_bytes(s.memory_budget)
                    ),
                });
            }
        }
    }
    Ok(())
}

/// The split of consecutive ranges, one per stage, that fits every budget and keeps the
/// pins with the least Σ time²·speed; `None` when none fits.
fn best_split(sz: &Sizes) -> Option<Vec<Range<usize>>> {
    let n = sz.model.n_layer;
    let stages = sz.stages;
    let k = stages.len();
    let last = k - 1;
    // best[i][e]: the least Σ time²·speed over stages 0..=i covering layers 0..e, stage i ending
    // at e; from[i][e]: where stage i starts in that split.
    let mut best = vec![vec![f64::INFINITY; n + 1]; k];
    let mut from = vec![vec![0usize; n + 1]; k];
    for i in 0..k {
        let s = speed(stages[i].bytes_per_s);
        // Stage i ends after at least i+1 layers and leaves one for each later stage.
        for e in (i + 1)..=(n - (last - i)) {
            let starts = match &stages[i].pinned {
                Some(pin) if pin.end != e => continue,
                Some(pin) => pin.start..pin.start + 1,
                None if i == 0 => 0..1,
                None => i..e,
            };
            for b in starts {
                let before = if i == 0 {
                    if b == 0 {
                        0.0
                    } else {
                        f64::INFINITY
                    }
                } else {
                    best[i - 1][b]
                };
                if !before.is_finite() {
                    continue;
                }
                let r = b..e;
                if sz.memory(i, &r) > stages[i].memory_budget || !sz.cut_ok(b) || !sz.cut_ok(e) {
                    continue;
                }
                let t = sz.compute(i, &r);
                let total = before + t * t * s;
                if total < best[i][e] {
                    best[i][e] = total;
                    from[i][e] = b;
                }
            }
        }
    }
    if !best[last][n].is_finite() {
        return None;
    }
    let mut ranges = vec![0..0; k];
    let mut e = n;
    for i in (0..k).rev() {
        let b = from[i][e];
        ranges[i] = b..e;
        e = b;
    }
    Some(ranges)
}

/// The plan of `stage_plans` with its predicted time per token: compute, the head on the
/// coordinator, link latency and transfer.
fn predict(
    model: &ModelCost,
    coord: &CoordinatorInput,
    stages: &[StageInput],
    head: HeadPlace,
    stage_plans: Vec<StagePlan>,
) -> Plan {
    let last = stages.len() - 1;
    let coordinator_s = match head {
        HeadPlace::Coordinator => model.head_bytes as f64 / speed(coord.bytes_per_s),
        HeadPlace::LastNode => 0.0,
    };
    // Hops: coordinator → 0, i → i+1, last → coordinator. One-way latency of a stage's link is
    // half its round trip; a local stage is the coordinator itself.
    let half = |i: usize| {
        if stages[i].local {
            0.0
        } else {
            rtt(stages[i].link_rtt_s) / 2.0
        }
    };
    let mut link_s = half(0) + half(last);
    let mut network_hops = usize::from(!stages[0].local);
    for i in 0..last {
        let (a, b) = (&stages[i], &stages[i + 1]);
        link_s += match (a.local, b.local) {
            (true, true) => 0.0,
            (true, false) => half(i + 1),
            (false, true) => half(i),
            (false, false) => (half(i) + half(i + 1)) / 2.0,
        };
        network_hops += usize::from(!(a.local && b.local));
    }
    let mut transfer_bytes = model.hidden_bytes as f64 * network_hops as f64;
    if !stages[last].local {
        transfer_bytes += match head {
            HeadPlace::Coordinator => model.hidden_bytes as f64,
            HeadPlace::LastNode => model.logits_bytes_f16 as f64,
        };
    }
    let transfer_s = transfer_bytes / ASSUMED_LINK_BYTES_PER_S;
    let compute_s: f64 = stage_plans.iter().map(|s| s.compute_s).sum();
    let predicted_s_per_token = compute_s + coordinator_s + link_s + transfer_s;
    let predicted_tokens_per_s = if predicted_s_per_token > 0.0 {
        1.0 / predicted_s_per_token
    } else {
        f64::INFINITY
    };
    Plan {
        stages: stage_plans,
        slots: model.slots.max(1),
        head,
        coordinator_s,
        link_s,
        transfer_s,
        predicted_s_per_token,
        predicted_tokens_per_s,
    }
}

fn check_input(model: &ModelCost, stages: &[StageInput]) -> Result<(), PlanError> {
    let n = model.n_layer;
    let bad = |detail: String| Err(PlanError::BadInput { detail });
    if n == 0 {
        return bad("the model has no layers".to_string());
    }
    let active = model.layer_active_bytes.len();
    if model.layer_weight_bytes.len() != n
        || model.layer_kv_bytes.len() != n
        || (active != 0 && active != n)
    {
        return bad(format!(
            "the model has {n} layers but sizes for {} (weights), {} (weights read per token) \
             and {} (KV)",
            model.layer_weight_bytes.len(),
            active,
            model.layer_kv_bytes.len()
        ));
    }
    if stages.is_empty() {
        return bad(
            "the ring has no stages; list at least one [[node]] in the cluster file".to_string(),
        );
    }
    if stages.len() > n {
        return bad(format!(
            "the ring has {} stages but the model has only {n} layers, and every stage needs at \
             least one; remove {} node(s)",
            stages.len(),
            stages.len() - n
        ));
    }
    Ok(())
}

/// Pins in stage order, inside the model, non-overlapping, and leaving at least one layer for
/// each unpinned stage around them (so all pinned ⇒ they cover `0..n` exactly).
fn check_pins(n: usize, stages: &[StageInput]) -> Result<(), PlanError> {
    let bad = |detail: String| Err(PlanError::BadPin { detail });
    let mut prev: Option<&StageInput> = None;
    let mut next_free = 0usize; // first layer after the previous pin
    let mut free = 0usize; // unpinned stages since the previous pin
    for s in stages {
        let Some(pin) = &s.pinned else {
            free += 1;
            continue;
        };
        let after = prev.map_or_else(
            || "the start of the ring".to_string(),
            |p| {
                format!(
                    "stage \"{}\" (layers {})",
                    p.name,
                    p.pinned.as_ref().map_or_else(String::new, format_layers)
                )
            },
        );
        if pin.is_empty() {
            return bad(format!("stage \"{}\" is pinned to no layers", s.name));
        }
        if pin.end > n {
            return bad(format!(
                "stage \"{}\" is pinned to layers {} but the model has {n} layers (0-{})",
                s.name,
                format_layers(pin),
                n - 1
            ));
        }
        if pin.start < next_free {
            return bad(format!(
                "stage \"{}\" is pinned to layers {}, which overlap or come before {after}; pins \
                 must follow ring order without overlapping",
                s.name,
                format_layers(pin)
            ));
        }
        let gap = pin.start - next_free;
        if gap < free || (free == 0 && gap > 0) {
            return bad(format!(
                "stage \"{}\" is pinned to layers {}, leaving {gap} layer(s) after {after} for {free} \
                 unpinned stage(s) in between; each stage needs at least one layer and every \
                 layer a stage",
                s.name,
                format_layers(pin)
            ));
        }
        prev = Some(s);
        next_free = pin.end;
        free = 0;
    }
    if prev.is_some() {
        let gap = n - next_free;
        if gap < free || (free == 0 && gap > 0) {
            let p = prev.map_or("", |p| p.name.as_str());
            return bad(format!(
                "the pins end at layer {} (stage \"{p}\") but the model has {n} layers (0-{}), \
                 leaving {gap} layer(s) for {free} unpinned stage(s) after it; extend the last pin \
                 to {} or add a stage without a pin",
                next_free.saturating_sub(1),
                n - 1,
                n - 1
            ));
        }
    }
    Ok(())
}

/// The error when no split fits: totals, and what each stage could hold.
fn no_split(sz: &Sizes) -> PlanError {
    let (model, stages, head) = (sz.model, sz.stages, sz.head);
    let memory = |i: usize, r: &Range<usize>| sz.memory(i, r);
    let parts = |i: usize, r: &Range<usize>| sz.parts(i, r);
    let n = model.n_layer;
    // All layers on the last stage: with the head exactly when the last stage holds it.
    let needed = memory(stages.len() - 1, &(0..n));
    let available = stages
        .iter()
        .fold(0u64, |a, s| a.saturating_add(s.memory_budget));
    // The most consecutive layers (from the start) each stage could hold, as a rough picture.
    let each: Vec<String> = stages
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let fit = (1..=n)
                .take_while(|&c| memory(i, &(0..c)) <= s.memory_budget)
                .count();
            let pin_note = if s.pinned.is_some() { ", pinned" } else { "" };
            // What one more layer would need there.
            let more = if fit < n {
                format!(
                    "; {} layers need {} ({})",
                    fit + 1,
                    format_bytes(memory(i, &(0..fit + 1))),
                    parts(i, &(0..fit + 1))
                )
            } else {
                String::new()
            };
            format!(
                "\"{}\" budget {} (about {fit} layers{pin_note}{more})",
                s.name,
                format_bytes(s.memory_budget)
            )
        })
        .collect();
    let head_note = if head == HeadPlace::LastNode {
        format!(
            " The last stage also holds the output head ({}).",
            format_bytes(model.head_bytes)
        )
    } else {
        String::new()
    };
    let slots = model.slots.max(1);
    let (slot_note, fewer) = if slots > 1 {
        (format!(" for {slots} slots"), ", fewer --parallel slots")
    } else {
        (String::new(), "")
    };
    let detail = if needed > available {
        format!(
            "All {n} layers with their KV cache{slot_note} need more than the stages' budgets add \
             up to: {}.{head_note} Add a node, raise memory caps, or use a smaller context{fewer} \
             or kv = \"f16\".",
            each.join(", ")
        )
    } else {
        format!(
            "The budgets add up, but the layers cannot be cut into consecutive ranges that fit \
             each stage (every stage needs at least one whole layer, pins stay put{}): \
             {}.{head_note} Raise the memory of the full stages or change the pins.",
            if model.kv_source.iter().any(Option::is_some) {
                ", a shared-KV layer stays with the layer whose cache it reads"
            } else {
                ""
            },
            each.join(", ")
        )
    };
    PlanError::DoesNotFit {
        needed,
        available,
        detail,
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| format!("{:.1}", b as f64 / (1024.0 * 1024.0));
        let header = [
            "stage",
            "address",
            "layers",
            "weights MiB",
            "KV MiB",
            "scratch MiB",
            "budget MiB",
            "ms/token",
        ];
        let rows: Vec<[String; 8]> = self
            .stages
            .iter()
            .map(|s| {
                let name = if s.holds_head {
                    format!("{} (+head)", s.name)
                } else {
                    s.name.clone()
                };
                [
                    name,
                    s.address.clone(),
                    format_layers(&s.layers),
                    mib(s.weight_bytes),
                    mib(s.kv_bytes),
                    mib(s.scratch_bytes),
                    mib(s.memory_budget),
                    format!("{:.2}", s.compute_s * 1e3),
                ]
            })
            .collect();
        let mut width = header.map(str::len);
        for r in &rows {
            for (w, c) in width.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let line = |f: &mut fmt::Formatter<'_>, cells: [&str; 8]| -> fmt::Result {
            // Text columns left-aligned, numbers right-aligned.
            for (j, c) in cells.iter().enumerate() {
                let sep = if j == 0 { "" } else { "  " };
                if j < 3 {
                    write!(f, "{sep}{c:<w$}", w = width[j])?;
                } else {
                    write!(f, "{sep}{c:>w$}", w = width[j])?;
                }
            }
            writeln!(f)
        };
        line(f, header)?;
        for r in &rows {
            line(f, [&r[0], &r[1], &r[2], &r[3], &r[4], &r[5], &r[6], &r[7]])?;
        }
        if self.slots > 1 {
            writeln!(f, "KV: {} slots per stage (--parallel)", self.slots)?;
        }
        match self.head {
            HeadPlace::Coordinator => writeln!(
                f,
                "head: on the coordinator, {:.2} ms/token",
                self.coordinator_s * 1e3
            )?,
            HeadPlace::LastNode => {
                let (name, local) = self
                    .stages
                    .last()
                    .map_or(("", false), |s| (s.name.as_str(), s.local));
                let back = if local {
                    ""
                } else {
                    "; its logits come back as f16"
                };
                writeln!(
                    f,
                    "head: on the last stage \"{name}\" (no room in the coordinator's budget){back}"
                )?
            }
        }
        writeln!(
            f,
            "links: {:.2} ms/token latency + {:.3} ms/token on the wire (assuming 1 Gbit/s)",
            self.link_s * 1e3,
            self.transfer_s * 1e3
        )?;
        writeln!(
            f,
            "predicted: {:.2} ms/token, {:.1} tokens/s",
            self.predicted_s_per_token * 1e3,
            self.predicted_tokens_per_s
        )
    }
}

#[cfg(test)]
mod tests;
