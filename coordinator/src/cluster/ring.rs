//! The coordinator's side of the ring: connects to every node, authenticates, gathers
//! capabilities and measures links, plans the split, assigns slices, then moves hidden states
//! around the ring for the engine. Failure of any node or link surfaces as an error naming it
//! within `HEARTBEAT_TIMEOUT`.

use crate::cluster::planner::{
    self, headroom, CoordinatorInput, HeadPlace, ModelCost, Plan, StageInput,
};
use crate::cluster::streaming::{self, StreamingPlan};
use anyhow::{anyhow, bail, Context, Result};
use ringllm_model::gguf::GgufFile;
use ringllm_model::slice::model_identity;
use ringllm_model::{sys, KvCache, KvType, LoadOptions, Model};
use ringllm_protocol::activations;
use ringllm_protocol::control::{
    Assignment, Capabilities, Control, Input, ModelIdentity, NextHop, Ready, Stats,
};
use ringllm_protocol::control_conn::{self, control_of};
use ringllm_protocol::dial::{self, BoxLink, LinkRole};
use ringllm_protocol::frame::{with_round, COORDINATOR_MAX_PAYLOAD, FLAG_MORE};
use ringllm_protocol::{
    ClusterKey, Dtype, FrameHeader, FrameKind, LinkCounters, Role, TransportKind,
};

mod send;
pub use send::{Sent, SlicePreview, TransferCut};

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Connecting and authenticating one link. Generous: on a lossy LAN a lost SYN costs 1 s, two
/// cost 3 s, and a handshake segment lost after a retransmitted SYN waits out a 3 s RTO; an
/// absent host still fails at once ("connection refused") when its address answers.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(500);
/// How long a failed data link waits for the node's control connection to give the cause.
const CAUSE_WAIT: Duration = Duration::from_secs(1);
/// A node silent for this long is declared lost.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(3);
/// Loading a slice may take a while (page-in from disk).
pub const READY_TIMEOUT: Duration = Duration::from_secs(300);

/// What every stage's runner and KV caches are sized for.
#[derive(Clone, Copy, Debug)]
pub struct Sizing {
    /// Context positions per KV cache.
    pub ctx: usize,
    /// The largest batch (prefill chunk; with serving, chunk + slots).
    pub max_batch: usize,
    pub kv: KvType,
    /// KV caches per stage: serving's `--parallel`, else 1.
    pub slots: usize,
}

/// One stage of the ring as configured: a node at an address, or the coordinator itself.
#[derive(Clone, Debug)]
pub struct StageSpec {
    pub name: String,
    /// `None`: the stage runs inside the coordinator.
    pub address: Option<String>,
    pub layers: Option<Range<usize>>,
    pub memory: Option<u64>,
    pub threads: Option<usize>,
    /// The transport the cluster file (or `--transport`) says this node's links use; checked
    /// against what the node reports. `None`: whatever the node was started with.
    pub transport: Option<TransportKind>,
}

impl StageSpec {
    /// How messages name the stage: "'name' (address)", or the address alone for a node
    /// known only by it.
    pub fn label(&self) -> String {
        match self.address.as_deref() {
            Some(a) if a == self.name => a.to_string(),
            Some(a) => format!("'{}' ({a})", self.name),
            None => format!("'{}' (local)", self.name),
        }
    }
}

/// Everything needed to build a ring.
#[derive(Clone, Debug)]
pub struct RingSpec {
    pub key: ClusterKey,
    pub stages: Vec<StageSpec>,
    pub coordinator_memory: Option<u64>,
    pub activations: Dtype,
    /// Send nodes that lack the model their slices (`up --no-send` turns it off).
    pub send_slices: bool,
    /// Have the nodes discard what their caches hold of their slices first, so every slice
    /// is sent in full (`bench --cold`).
    pub discard_cached_slices: bool,
    /// How long to wait for a node lost mid-transfer to come back (`up --wait`) before
    /// giving up; the transfer resumes where it stopped.
    pub wait: Duration,
    /// Streaming layers from disk when the model does not fit the ring's memory.
    pub stream: StreamPolicy,
    /// Predictive layer skip on every node (`up --skip`): the predictor file's bytes, the
    /// probability a skip needs, the most layers skipped in a row.
    pub skip: Option<(Arc<Vec<u8>>, f32, usize)>,
}

/// When and how the ring streams layers from disk (`up --stream`, `--rounds`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamPolicy {
    /// `--stream off`: never (a model that does not fit is refused).
    pub off: bool,
    /// Which layouts to consider when streaming; anything but `Auto` streams even a model
    /// that fits.
    pub choice: streaming::Choice,
}

type Outgoing = (FrameHeader, Vec<u8>);

enum Event {
    /// A data frame on a control connection (a protocol violation).
    Frame {
        node: usize,
        h: FrameHeader,
    },
    Control {
        node: usize,
        msg: Control,
    },
    Lost {
        node: usize,
        why: String,
    },
}

struct RemoteNode {
    name: String,
    address: String,
    /// Control messages to the node.
    out: mpsc::Sender<Outgoing>,
    /// Bulk data to the node (slices): written when no control message waits.
    data: mpsc::Sender<Outgoing>,
    caps: Capabilities,
    /// What the cluster file declared for this node's links.
    declared: Option<TransportKind>,
    rtt_s: f64,
    /// Milliseconds since `Ring::t0` at which the node was last heard from.
    last_seen: Arc<AtomicU64>,
    counters: Arc<LinkCounters>,
}

/// A stage of the planned ring.
#[derive(Clone, Debug)]
pub enum Stage {
    Local {
        layers: Range<usize>,
    },
    /// Consecutive remote nodes `first..=last` (indices into the ring's nodes).
    Segment {
        first: usize,
        last: usize,
    },
}

/// The coordinator's data links of one segment: where its input goes, and where its output
/// comes from (`None`: the same link).
struct SegmentLinks {
    input: BoxLink,
    output: Option<BoxLink>,
}

/// One sequence's share of a batch on the wire: one frame per part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    /// Sequence id (the KV slot on every node).
    pub seq: u64,
    /// Position of its first token.
    pub pos: usize,
    /// Tokens (rows of hidden state) it carries.
    pub n_tokens: usize,
}

pub struct Ring {
    rt: tokio::runtime::Runtime,
    nodes: Vec<RemoteNode>,
    /// One per `Stage::Segment`, in order.
    links: Vec<SegmentLinks>,
    events: mpsc::UnboundedReceiver<Event>,
    t0: Instant,
    pub plan: Plan,
    pub stages: Vec<Stage>,
    pub head_on_node: bool,
    pub session: u64,
    /// Every node's `Ready`, in node order.
    pub ready: Vec<Ready>,
    /// The slices sent before the assignments (nodes that needed nothing are not listed).
    pub sent: Vec<Sent>,
    vocab: usize,
    /// How hidden states travel on this ring's data links.
    pub activations: Dtype,
    logits_buf: Vec<f32>,
    /// Coordinator's own link counters (bytes it sent and received per node).
    scratch: Vec<u8>,
    /// The streaming layout, when the model does not fit the ring's memory.
    pub streaming: Option<StreamingPlan>,
    /// Times a token goes round the ring (several with a multi-round streaming layout).
    pub rounds: usize,
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
    let layer_weight_bytes: Vec<u64> = m.layers.iter().map(|l| l.weight_bytes() as u64).collect();
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
            layer_kv_bytes,
            head_bytes: head + 4 * hp.d_model as u64,
            embedding_bytes: embd,
            tied_head: tied,
            hidden_bytes,
            logits_bytes_f16: 2 * hp.vocab as u64,
            slots: 1,
        },
        hp,
    ))
}

impl Ring {
    /// Connects to every node of `spec`, measures, plans. With `assign`, also loads the
    /// slices and starts the ring; without, returns after planning (`ringllm plan`).
    pub fn connect(
        spec: &RingSpec,
        model_path: &Path,
        file: &Arc<GgufFile>,
        sizing: &Sizing,
        coordinator_threads: usize,
    ) -> Result<Ring> {
        let Sizing {
            ctx,
            max_batch,
            kv,
            slots,
        } = *sizing;
        // The control plane (heartbeats, errors) runs on one worker thread; the data plane
        // (hidden states) uses blocking links on the caller's thread.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .context("starting the I/O runtime")?;
        let t0 = Instant::now();
        let (ev_tx, events) = mpsc::unbounded_channel();
        let remote: Vec<&StageSpec> = spec.stages.iter().filter(|s| s.address.is_some()).collect();
        // Connect to every node at once.
        let links = rt.block_on(async {
            let mut tasks = Vec::new();
            for s in &remote {
                let addr = s.address.clone().unwrap_or_default();
                let key = spec.key.clone();
                tasks.push(tokio::spawn(async move {
                    control_conn::connect(
                        &addr,
                        &key,
                        Role::Coordinator,
                        "coordinator",
                        CONNECT_TIMEOUT,
                        COORDINATOR_MAX_PAYLOAD,
                    )
                    .await
                }));
            }
            let mut out = Vec::new();
            for (t, s) in tasks.into_iter().zip(&remote) {
                let who = format!("node {}", s.label());
                let link = t
                    .await
                    .map_err(|e| anyhow!("{who}: {e}"))?
                    .map_err(|e| anyhow!("cannot connect to {who}: {e}"))?;
                out.push(link);
            }
            Ok::<_, anyhow::Error>(out)
        })?;
        let mut nodes = Vec::new();
        for (i, (link, s)) in links.into_iter().zip(&remote).enumerate() {
            let last_seen = Arc::new(AtomicU64::new(t0.elapsed().as_millis() as u64));
            let counters = Arc::clone(&link.counters);
            let ringllm_protocol::Link { mut tx, mut rx, .. } = link;
            let (qtx, mut qrx) = mpsc::channel::<Outgoing>(256);
            let (dtx, mut drx) = mpsc::channel::<Outgoing>(send::QUEUE);
            let ev = ev_tx.clone();
            let name = s.name.clone();
            let _g = rt.enter();
            tokio::spawn(async move {
                loop {
                    // Control messages first; slice data when none waits.
                    let next = tokio::select! {
                        biased;
                        m = qrx.recv() => m,
                        d = drx.recv() => d,
                    };
                    let Some((h, p)) = next else { break };
                    if let Err(e) = tx.send(&h, &p).await {
                        let _ = ev.send(Event::Lost {
                            node: i,
                            why: format!("sending failed: {e}"),
                        });
                        break;
                    }
                }
            });
            let ev = ev_tx.clone();
            let seen = Arc::clone(&last_seen);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    match rx.recv(&mut buf).await {
                        Ok(h) => {
                            seen.store(t0.elapsed().as_millis() as u64, Ordering::Relaxed);
                            let e = if h.kind == FrameKind::Control {
                                match control_of(&h, &buf) {
                                    Ok(Control::Heartbeat { reply: true, nonce }) => {
                                        Event::Control {
                                            node: i,
                                            msg: Control::Heartbeat { nonce, reply: true },
                                        }
                                    }
                                    // The node is going away and says why; the
                                    // connection closes next.
                                    Ok(Control::Shutdown { reason }) => Event::Lost {
                                        node: i,
                                        why: format!("is shutting down ({reason})"),
                                    },
                                    Ok(msg) => Event::Control { node: i, msg },
                                    Err(e) => Event::Lost {
                                        node: i,
                                        why: format!("sent a malformed message: {e}"),
                                    },
                                }
                            } else {
                                Event::Frame { node: i, h }
                            };
                            if ev.send(e).is_err() {
                                break;
                            }
                        }
                        Err(e) => {
                            let why = if e.is_closed() {
                                "closed the connection (process stopped?)".to_string()
                            } else {
                                e.to_string()
                            };
                            let _ = ev.send(Event::Lost { node: i, why });
                            break;
                        }
                    }
                }
            });
            nodes.push(RemoteNode {
                name,
                address: s.address.clone().unwrap_or_default(),
                out: qtx,
                data: dtx,
                caps: Capabilities {
                    node_name: String::new(),
                    version: String::new(),
                    memory_total: 0,
                    memory_available: 0,
                    threads: 0,
                    cpu_features: Vec::new(),
                    isa: String::new(),
                    matvec_bytes_per_s: 0.0,
                    models: Vec::new(),
                    transport: TransportKind::Tcp,
                    disk_read_bytes_per_s: 0.0,
                    backend: String::new(),
                },
                declared: s.transport,
                rtt_s: 0.0,
                last_seen,
                counters,
            });
        }
        let mut ring = Ring {
            rt,
            nodes,
            links: Vec::new(),
            events,
            t0,
            plan: Plan::empty(),
            stages: Vec::new(),
            head_on_node: false,
            session: 0,
            ready: Vec::new(),
            sent: Vec::new(),
            vocab: 0,
            activations: Dtype::F32,
            logits_buf: Vec::new(),
            scratch: Vec::new(),
            streaming: None,
            rounds: 1,
        };
        // Capabilities arrive first on every connection.
        let mut have = vec![false; ring.nodes.len()];
        while have.iter().any(|h| !h) {
            let pending: Vec<usize> = (0..have.len()).filter(|&i| !have[i]).collect();
            let (i, msg) = ring.next_control(Duration::from_secs(10), "capabilities", &pending)?;
            match msg {
                Control::Capabilities(c) => {
                    // A node known only by its address (`--node`) goes by its own name.
                    let n = &mut ring.nodes[i];
                    if n.name == n.address && !c.node_name.is_empty() {
                        n.name = c.node_name.clone();
                    }
                    if let Some(want) = ring.nodes[i].declared {
                        if want != c.transport {
                            bail!(
                                "{}: the cluster says its links use {want}, but the node was \
                                 started with --transport {} (restart it with --transport \
                                 {want}, or change the cluster file)",
                                ring.who(i),
                                c.transport
                            );
                        }
                    }
                    ring.nodes[i].caps = c;
                    have[i] = true;
                }
                Control::Error(e) => bail!("{}: {}", ring.who(i), e.message),
                other => bail!(
                    "{}: expected capabilities, got {}",
                    ring.who(i),
                    other.name()
                ),
            }
        }
        // The coordinator dials each node's transport: kmod needs the module here too.
        if let Some(i) =
            (0..ring.nodes.len()).find(|&i| ring.nodes[i].caps.transport == TransportKind::Kmod)
        {
            if let Err(e) = ringllm_protocol::kmod::probe() {
                bail!(
                    "{} uses --transport kmod, so the coordinator's machine needs the module                      too: {e}",
                    ring.who(i)
                );
            }
        }
        // Link round trips: best of a few heartbeats.
        for i in 0..ring.nodes.len() {
            let mut best = f64::MAX;
            for k in 0..5u64 {
                let t = Instant::now();
                ring.send_control(
                    i,
                    &Control::Heartbeat {
                        nonce: k,
                        reply: false,
                    },
                )?;
                loop {
                    let (j, msg) = ring.next_control(CONNECT_TIMEOUT, "a heartbeat reply", &[i])?;
                    if j == i
                        && msg
                            == (Control::Heartbeat {
                                nonce: k,
                                reply: true,
                            })
                    {
                        break;
                    }
                }
                best = best.min(t.elapsed().as_secs_f64());
            }
            ring.nodes[i].rtt_s = best;
        }
        // Plan.
        let (mut cost, hp) = model_cost(file, ctx, max_batch, kv, spec.activations)?;
        cost.slots = slots.max(1);
        ring.vocab = hp.vocab;
        let avail = ringllm_model::limits::available_memory().unwrap_or(0);
        let coord_budget = spec
            .coordinator_memory
            .unwrap_or(avail.saturating_sub(headroom(avail)));
        let scratch = |threads: usize| {
            ringllm_model::Runner::scratch_bytes(&hp, threads.max(1), max_batch, ctx)
        };
        // Calibration: the probe's speed against this model's real layers and head, measured
        // here; every node's probe speed is scaled by the same factor.
        let (coord_probe, layer_speed, head_speed) = calibration(file, coordinator_threads)?;
        let factor = (layer_speed / coord_probe.max(1.0)).clamp(0.01, 10.0);
        tracing::info!(
            probe_gbs = coord_probe / 1e9,
            layer_gbs = layer_speed / 1e9,
            head_gbs = head_speed / 1e9,
            "planner calibration"
        );
        let coord_speed = layer_speed;
        let coord_fixed = cost.embedding_bytes + if cost.tied_head { 0 } else { cost.head_bytes };
        let mut inputs = Vec::new();
        let mut ni = 0;
        for s in &spec.stages {
            match &s.address {
                None => inputs.push(StageInput {
                    name: s.name.clone(),
                    address: "local".into(),
                    local: true,
                    memory_budget: s.memory.unwrap_or(coord_budget.saturating_sub(coord_fixed)),
                    scratch_bytes: scratch(coordinator_threads),
                    bytes_per_s: coord_speed,
                    link_rtt_s: 0.0,
                    pinned: s.layers.clone(),
                }),
                Some(a) => {
                    let n = &ring.nodes[ni];
                    // The node's budget (--memory, MemAvailable, cgroup) less headroom, or
                    // the cluster file's cap on layers + KV when smaller.
                    let avail = n.caps.memory_available;
                    let budget = avail.saturating_sub(headroom(avail));
                    let budget = s.memory.map_or(budget, |m| m.min(budget));
                    // The node runs with the cluster file's threads, else its own.
                    let threads = s.threads.unwrap_or(n.caps.threads as usize);
                    inputs.push(StageInput {
                        name: n.name.clone(),
                        address: a.clone(),
                        local: false,
                        memory_budget: budget,
                        scratch_bytes: scratch(threads),
                        bytes_per_s: n.caps.matvec_bytes_per_s * factor,
                        link_rtt_s: n.rtt_s,
                        pinned: s.layers.clone(),
                    });
                    ni += 1;
                }
            }
        }
        let coord_in = CoordinatorInput {
            memory_budget: coord_budget,
            bytes_per_s: head_speed,
        };
        let fitted = if spec.stream.choice == streaming::Choice::Auto {
            Some(planner::plan(&cost, &coord_in, &inputs))
        } else {
            None
        };
        let (plan, fit_error) = match fitted {
            Some(Ok(p)) => (p, None),
            Some(Err(e))
                if spec.stream.off
                    || !matches!(e, planner::PlanError::DoesNotFit { .. })
                    || inputs.iter().any(|s| s.local || s.pinned.is_some()) =>
            {
                return Err(anyhow!("{e}"));
            }
            other => {
                let fit_error = other.and_then(|r| r.err());
                if inputs.iter().any(|s| s.local || s.pinned.is_some()) {
                    bail!(
                        "layers are streamed only over a ring of nodes without pinned layers \
                         or a local stage"
                    );
                }
                let disk: Vec<f64> = ring
                    .nodes
                    .iter()
                    .map(|n| n.caps.disk_read_bytes_per_s)
                    .collect();
                let sp = match streaming::plan(&cost, &coord_in, &inputs, &disk, spec.stream.choice)
                {
                    Ok(sp) => sp,
                    // What does not fit, as the plain planner says it, then why streaming
                    // does not help either.
                    Err(e) => match &fit_error {
                        Some(f) => bail!("{f}\n{e}"),
                        None => bail!("{e}"),
                    },
                };
                let p = sp.to_plan(&inputs, cost.slots);
                ring.streaming = Some(sp);
                (p, fit_error)
            }
        };
        if let Some(f) = fit_error {
            tracing::info!("{f}: streaming layers from disk instead");
        }
        ring.rounds = ring.streaming.as_ref().map_or(1, |s| s.chosen().rounds);
        // Stages: local ranges and segments of consecutive remote nodes.
        let mut stages = Vec::new();
        let mut ni = 0;
        for (s, p) in spec.stages.iter().zip(&plan.stages) {
            if p.layers.is_empty() {
                if s.address.is_some() {
                    ni += 1;
                }
                continue;
            }
            match &s.address {
                None => stages.push(Stage::Local {
                    layers: p.layers.clone(),
                }),
                Some(_) => {
                    match stages.last_mut() {
                        Some(Stage::Segment { last, .. }) if *last + 1 == ni => *last = ni,
                        _ => stages.push(Stage::Segment {
                            first: ni,
                            last: ni,
                        }),
                    }
                    ni += 1;
                }
            }
        }
        ring.head_on_node = matches!(plan.head, HeadPlace::LastNode);
        ring.plan = plan;
        ring.stages = stages;
        let _ = model_path;
        Ok(ring)
    }

    /// Sends the nodes that lack the model their slices (unless `spec.send_slices` is off),
    /// loads every node's slice and waits until all are ready.
    #[allow(clippy::too_many_arguments)]
    pub fn assign(
        &mut self,
        spec: &RingSpec,
        file: &Arc<GgufFile>,
        identity: &ModelIdentity,
        ctx: usize,
        max_batch: usize,
        kv: KvType,
        slots: usize,
    ) -> Result<()> {
        if spec.send_slices {
            self.sent = self.send_slices(spec, identity, file)?;
        }
        self.session =
            (self.t0.elapsed().as_nanos() as u64) ^ ((std::process::id() as u64) << 40) ^ 0x5eed;
        self.activations = spec.activations;
        // Per remote node: its layers, input and next hop, from the plan in stage order.
        let remote_plans: Vec<(usize, &planner::StagePlan)> = spec
            .stages
            .iter()
            .zip(&self.plan.stages)
            .filter(|(s, _)| s.address.is_some())
            .map(|(_, p)| p)
            .enumerate()
            .collect();
        let mut assigned = Vec::new();
        for seg in &self.stages {
            let Stage::Segment { first, last } = *seg else {
                continue;
            };
            for (i, &(_, p)) in remote_plans.iter().enumerate().take(last + 1).skip(first) {
                let next_hop = if i == last {
                    NextHop::Coordinator
                } else {
                    NextHop::Node {
                        name: self.nodes[i + 1].name.clone(),
                        address: self.nodes[i + 1].address.clone(),
                        transport: self.nodes[i + 1].caps.transport,
                    }
                };
                let a = Assignment {
                    session: self.session,
                    model: identity.clone(),
                    layer_start: p.layers.start as u32,
                    layer_end: p.layers.end as u32,
                    head: p.holds_head,
                    input: if i == first {
                        Input::Coordinator
                    } else {
                        Input::Upstream
                    },
                    next_hop,
                    activations: spec.activations,
                    kv_ctx: ctx as u32,
                    kv_type: kv,
                    max_batch: max_batch as u32,
                    threads: spec
                        .stages
                        .iter()
                        .filter(|s| s.address.is_some())
                        .nth(i)
                        .and_then(|s| s.threads)
                        .unwrap_or(0) as u32,
                    kv_slots: slots.max(1) as u32,
                    layout: {
                        let mut l = self
                            .streaming
                            .as_ref()
                            .map(|sp| sp.layout(i))
                            .unwrap_or_default();
                        if let Some((bytes, confidence, max_skip)) = &spec.skip {
                            l.skip_predictor = bytes.to_vec();
                            l.skip_confidence_ppm = (confidence * 1e6) as u32;
                            l.skip_max = *max_skip as u32;
                        }
                        l
                    },
                };
                assigned.push(i);
                self.send_control(i, &Control::Assign(a))?;
            }
        }
        // Assign the last nodes first? Nodes connect to their next hop while loading; the next
        // hop waits for its own assignment (TAKEOVER_WAIT), so any order works.
        // Cleared when dropped too: an error must not leave the spinner on screen.
        let bar =
            indicatif::ProgressBar::new_spinner().with_finish(indicatif::ProgressFinish::AndClear);
        bar.set_message(format!("loading slices on {} node(s)", assigned.len()));
        bar.enable_steady_tick(Duration::from_millis(120));
        let mut ready: Vec<Option<Ready>> = vec![None; self.nodes.len()];
        let deadline = Instant::now() + READY_TIMEOUT;
        while assigned.iter().any(|&i| ready[i].is_none()) {
            let left = deadline.saturating_duration_since(Instant::now());
            let pending: Vec<usize> = assigned
                .iter()
                .copied()
                .filter(|&i| ready[i].is_none())
                .collect();
            let (i, msg) = self.next_control(left, "the nodes to load their slices", &pending)?;
            match msg {
                Control::Ready(r) if r.session == self.session => {
                    bar.suspend(|| {
                        eprintln!(
                        "  {:<12} {:<22} layers {:>2}-{:<2} weights {:>7.1} MiB  kv {:>6.1} MiB  rss {:>7.1} MiB  load {} ms",
                        self.nodes[i].name,
                        self.nodes[i].address,
                        r.layer_start,
                        r.layer_end.saturating_sub(1),
                        r.weight_bytes as f64 / 1048576.0,
                        r.kv_bytes as f64 / 1048576.0,
                        r.rss_bytes as f64 / 1048576.0,
                        r.load_ms
                        )
                    });
                    ready[i] = Some(r);
                }
                Control::Error(e) => {
                    bar.finish_and_clear();
                    bail!("{}: {}", self.who(i), e.message)
                }
                _ => {}
            }
        }
        bar.finish_and_clear();
        self.ready = ready.into_iter().flatten().collect();
        // Data links: into each segment's first node, out of its last.
        let mut links = Vec::new();
        for seg in &self.stages {
            let Stage::Segment { first, last } = *seg else {
                continue;
            };
            let connect = |i: usize, role: LinkRole| {
                let n = &self.nodes[i];
                let dial = dial::DialSpec {
                    kind: n.caps.transport,
                    addr: &n.address,
                    name: "coordinator",
                    timeout: CONNECT_TIMEOUT,
                    max_payload: COORDINATOR_MAX_PAYLOAD,
                    ring_session: self.session,
                    role,
                };
                self.rt
                    .block_on(dial::connect_data_link(&dial, &spec.key))
                    .map_err(|e| anyhow!("{}: data link: {e}", self.who(i)))
            };
            let input = if first == last {
                connect(first, LinkRole::InputOutput)?
            } else {
                connect(first, LinkRole::Input)?
            };
            let output = if first == last {
                None
            } else {
                Some(connect(last, LinkRole::Output)?)
            };
            links.push(SegmentLinks { input, output });
        }
        let kinds: Vec<String> = links
            .iter()
            .flat_map(|l| std::iter::once(&l.input).chain(l.output.as_ref()))
            .map(|l| l.transport().to_string())
            .collect();
        eprintln!("  data links: {}", kinds.join(", "));
        self.links = links;
        // Every node answered its assignment; the time spent connecting data links (seconds,
        // when SYNs are lost) was our silence, not theirs: count from now.
        let now = self.t0.elapsed().as_millis() as u64;
        for n in &self.nodes {
            n.last_seen.store(now, Ordering::Relaxed);
        }
        // Heartbeats from now on.
        let _g = self.rt.enter();
        for n in &self.nodes {
            let out = n.out.clone();
            tokio::spawn(async move {
                let mut nonce = 1000u64;
                loop {
                    tokio::time::sleep(HEARTBEAT_INTERVAL).await;
                    nonce += 1;
                    let Ok(f) = (Control::Heartbeat {
                        nonce,
                        reply: false,
                    })
                    .to_frame() else {
                        break;
                    };
                    if out.send(f).await.is_err() {
                        break;
                    }
                }
            });
        }
        Ok(())
    }

    pub fn who(&self, i: usize) -> String {
        match self.nodes.get(i) {
            Some(n) if n.name == n.address => format!("node at {}", n.address),
            Some(n) => format!("node '{}' ({})", n.name, n.address),
            None => format!("node #{i}"),
        }
    }

    pub fn node_names(&self) -> Vec<(String, String)> {
        self.nodes
            .iter()
            .map(|n| (n.name.clone(), n.address.clone()))
            .collect()
    }

    pub fn rtts(&self) -> Vec<f64> {
        self.nodes.iter().map(|n| n.rtt_s).collect()
    }

    pub fn capabilities(&self) -> Vec<Capabilities> {
        self.nodes.iter().map(|n| n.caps.clone()).collect()
    }

    /// Bytes and frames the coordinator sent to / received from each node.
    pub fn link_counters(&self) -> Vec<(u64, u64, u64, u64)> {
        let mut out: Vec<(u64, u64, u64, u64)> =
            self.nodes.iter().map(|n| n.counters.snapshot()).collect();
        let mut seg = 0;
        for st in &self.stages {
            let Stage::Segment { first, last } = *st else {
                continue;
            };
            let l = &self.links[seg];
            let add = |o: &mut (u64, u64, u64, u64), c: (u64, u64, u64, u64)| {
                o.0 += c.0;
                o.1 += c.1;
                o.2 += c.2;
                o.3 += c.3;
            };
            add(&mut out[first], l.input.counters().snapshot());
            if let Some(o) = &l.output {
                add(&mut out[last], o.counters().snapshot());
            }
            seg += 1;
        }
        out
    }

    fn send_control(&self, i: usize, msg: &Control) -> Result<()> {
        let f = msg.to_frame()?;
        self.nodes[i]
            .out
            .try_send(f)
            .map_err(|_| anyhow!("{}: the link is gone", self.who(i)))
    }

    /// The next control message from any node, failing on a lost node or after `timeout`;
    /// a timeout names the nodes in `from` (those not yet heard from).
    fn next_control(
        &mut self,
        timeout: Duration,
        what: &str,
        from: &[usize],
    ) -> Result<(usize, Control)> {
        let deadline = Instant::now() + timeout;
        let what = if from.is_empty() {
            what.to_string()
        } else {
            let names: Vec<String> = from.iter().map(|&i| self.who(i)).collect();
            format!(
                "{what} from {} ({:.0} s)",
                names.join(", "),
                timeout.as_secs_f64()
            )
        };
        let what = what.as_str();
        match self.next_event(deadline, what)? {
            Event::Control { node, msg } => Ok((node, msg)),
            Event::Frame { node, h, .. } => bail!(
                "{}: unexpected {:?} frame while waiting for {what}",
                self.who(node),
                h.kind
            ),
            Event::Lost { node, why } => bail!("{} {why}", self.who(node)),
        }
    }

    /// The next event within `wait` (`None`: none came), without watching heartbeats.
    fn poll_event(&mut self, wait: Duration) -> Result<Option<Event>> {
        let events = &mut self.events;
        self.rt.block_on(async {
            match tokio::time::timeout(wait, events.recv()).await {
                Ok(Some(e)) => Ok(Some(e)),
                Ok(None) => bail!("every link is closed"),
                Err(_) => Ok(None),
            }
        })
    }

    /// The next event, watching heartbeats meanwhile.
    fn next_event(&mut self, deadline: Instant, what: &str) -> Result<Event> {
        let t0 = self.t0;
        let nodes: Vec<(String, Arc<AtomicU64>)> = self
            .nodes
            .iter()
            .map(|n| {
                (
                    format!("node '{}' ({})", n.name, n.address),
                    Arc::clone(&n.last_seen),
                )
            })
            .collect();
        let check_heartbeats = !self.ready.is_empty();
        let events = &mut self.events;
        self.rt.block_on(async {
            loop {
                let now = Instant::now();
                if now >= deadline {
                    bail!("timed out waiting for {what}");
                }
                let slice = (deadline - now).min(Duration::from_millis(250));
                match tokio::time::timeout(slice, events.recv()).await {
                    Ok(Some(e)) => return Ok(e),
                    Ok(None) => bail!("every link is closed"),
                    Err(_) => {}
                }
                if check_heartbeats {
                    let now_ms = t0.elapsed().as_millis() as u64;
                    for (who, seen) in &nodes {
                        let silent = now_ms.saturating_sub(seen.load(Ordering::Relaxed));
                        if silent > HEARTBEAT_TIMEOUT.as_millis() as u64 {
                            bail!(
                                "{who} stopped answering: nothing heard for {:.1} s (link cut, machine down or process frozen)",
                                silent as f64 / 1000.0
                            );
                        }
                    }
                }
            }
        })
    }

    /// Runs one chunk through the ring: `x` holds `n` embedded rows of `d`; on return it holds
    /// the last stage's hidden states, or (head on a node) `logits` holds the last token's
    /// logits. `local` runs the coordinator's own layers when its stage comes.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        seq: u64,
        pos: usize,
        x: &mut [f32],
        n: usize,
        d: usize,
        logits: &mut [f32],
        local: &mut dyn FnMut(&mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let mut l = std::mem::take(&mut self.logits_buf);
        let r = self.forward_multi(
            &[Part {
                seq,
                pos,
                n_tokens: n,
            }],
            x,
            d,
            &mut l,
            local,
        );
        if r.is_ok() && self.head_on_node {
            let v = self.vocab;
            logits[..v].copy_from_slice(&l[..v]);
        }
        self.logits_buf = l;
        r
    }

    /// Runs a batch of sequences through the ring as one pass per stage: `parts[i]` is one
    /// sequence's tokens, and `x` holds their embedded rows in order. On return
    /// `x` holds the last stage's hidden states, or (head on a node) `logits` holds each
    /// part's last-token logits, in order.
    pub fn forward_multi(
        &mut self,
        parts: &[Part],
        x: &mut [f32],
        d: usize,
        logits: &mut Vec<f32>,
        local: &mut dyn FnMut(&mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let n: usize = parts.iter().map(|p| p.n_tokens).sum();
        let stages = self.stages.clone();
        // A multi-round ring: the token goes round `rounds` times, relayed here between rounds
        // (a round trip more per round, small against the disk reads such a ring waits for).
        for round in 0..self.rounds.max(1) {
            let mut seg = 0usize;
            for st in &stages {
                match st {
                    Stage::Local { .. } => local(&mut x[..n * d])?,
                    Stage::Segment { first, last } => {
                        self.send_segment(seg, *first, parts, x, d, round)?;
                        self.recv_segment(seg, *last, parts, x, d, logits)?;
                        seg += 1;
                    }
                }
            }
        }
        Ok(())
    }

    /// True when the ring is one run of nodes (no local layers): then a batch can be sent
    /// with `send_batch` and its result taken later with `recv_batch`, and several batches
    /// can be in the ring at once.
    pub fn pipelinable(&self) -> bool {
        self.rounds <= 1 && matches!(self.stages.as_slice(), [Stage::Segment { .. }])
    }

    /// Sends a batch into a pipelinable ring.
    pub fn send_batch(&mut self, parts: &[Part], x: &[f32], d: usize) -> Result<()> {
        match self.stages.first() {
            Some(&Stage::Segment { first, .. }) if self.stages.len() == 1 => {
                self.send_segment(0, first, parts, x, d, 0)
            }
            _ => bail!("this ring has local layers: batches cannot be pipelined"),
        }
    }

    /// Takes the result of the oldest batch sent with `send_batch`.
    pub fn recv_batch(
        &mut self,
        parts: &[Part],
        x: &mut [f32],
        d: usize,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        match self.stages.first() {
            Some(&Stage::Segment { last, .. }) if self.stages.len() == 1 => {
                self.recv_segment(0, last, parts, x, d, logits)
            }
            _ => bail!("this ring has local layers: batches cannot be pipelined"),
        }
    }

    /// Writes one frame per part into segment `seg` (all but the last flagged MORE).
    fn send_segment(
        &mut self,
        seg: usize,
        first: usize,
        parts: &[Part],
        x: &[f32],
        d: usize,
        round: usize,
    ) -> Result<()> {
        let who_first = self.who(first);
        let mut payload = std::mem::take(&mut self.scratch);
        let mut row = 0;
        for (
            k,
            &Part {
                seq,
                pos,
                n_tokens: m,
            },
        ) in parts.iter().enumerate()
        {
            activations::encode(self.activations, &x[row * d..(row + m) * d], &mut payload)?;
            row += m;
            let flags = with_round(if k + 1 < parts.len() { FLAG_MORE } else { 0 }, round);
            let h = FrameHeader::new(
                FrameKind::Hidden,
                self.activations,
                seq,
                pos as u32,
                m as u32,
                flags,
                &payload,
            )?;
            let links = self
                .links
                .get_mut(seg)
                .ok_or_else(|| anyhow!("no data link for segment {seg}"))?;
            if let Err(e) = links.input.send(&h, &payload) {
                self.cause_within(CAUSE_WAIT)?;
                bail!("{who_first}: sending the hidden state failed: {e}");
            }
        }
        self.scratch = payload;
        Ok(())
    }

    /// Reads segment `seg`'s output for `parts` into `x` (or `logits`).
    fn recv_segment(
        &mut self,
        seg: usize,
        last: usize,
        parts: &[Part],
        x: &mut [f32],
        d: usize,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let who_last = self.who(last);
        let mut payload = std::mem::take(&mut self.scratch);
        let mut row = 0;
        for (
            k,
            &Part {
                seq,
                pos,
                n_tokens: m,
            },
        ) in parts.iter().enumerate()
        {
            let h = loop {
                let links = self
                    .links
                    .get_mut(seg)
                    .ok_or_else(|| anyhow!("no data link for segment {seg}"))?;
                let out = links.output.as_mut().unwrap_or(&mut links.input);
                match out.recv_timeout(&mut payload, DATA_POLL) {
                    Ok(Some(h)) => break h,
                    Ok(None) => self.check_health()?,
                    Err(e) => {
                        // A closed data link usually means the node died or is shutting
                        // down: its control connection says which, if it says anything.
                        self.cause_within(CAUSE_WAIT)?;
                        let why = if e.is_closed() {
                            "closed the data link (process stopped?)".to_string()
                        } else {
                            e.to_string()
                        };
                        bail!("{who_last} {why}");
                    }
                }
            };
            if h.seq != seq || h.pos as usize != pos {
                bail!(
                    "{who_last}: output for sequence {} position {}, expected {seq} at {pos}",
                    h.seq,
                    h.pos
                );
            }
            match h.kind {
                FrameKind::Hidden => {
                    activations::decode(h.dtype, &payload, &mut x[row * d..(row + m) * d])
                        .with_context(|| who_last.clone())?;
                }
                FrameKind::Logits => {
                    let v = self.vocab;
                    if payload.len() != v * 2 {
                        bail!(
                            "{who_last}: logits frame of {} bytes, expected {}",
                            payload.len(),
                            v * 2
                        );
                    }
                    logits.resize((k + 1) * v, 0.0);
                    for (o, c) in logits[k * v..(k + 1) * v]
                        .iter_mut()
                        .zip(payload.chunks_exact(2))
                    {
                        *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
                    }
                }
                FrameKind::Control | FrameKind::Slice => {
                    bail!("{who_last}: {:?} frame on a data link", h.kind)
                }
            }
            row += m;
        }
        self.scratch = payload;
        Ok(())
    }

    /// After a data link failed: waits up to `wait` for a node's control connection to say
    /// why (a node shutting down says so before its links close), failing with that cause.
    fn cause_within(&mut self, wait: Duration) -> Result<()> {
        let deadline = Instant::now() + wait;
        loop {
            self.check_health()?;
            let now = Instant::now();
            if now >= deadline {
                return Ok(());
            }
            match self.poll_event(deadline - now)? {
                Some(Event::Lost { node, why }) => bail!("{} {why}", self.who(node)),
                Some(Event::Control {
                    node,
                    msg: Control::Error(e),
                }) => {
                    // A node's report that its neighbour went away: the neighbour's own
                    // word, if it comes, is the cause.
                    let first = format!("{}: {}", self.who(node), e.message);
                    let rest = deadline.saturating_duration_since(Instant::now());
                    if let Some(Event::Lost { node, why }) = self.poll_event(rest)? {
                        bail!("{} {why}", self.who(node));
                    }
                    bail!("{first}");
                }
                Some(_) => {}
                None => return Ok(()),
            }
        }
    }

    /// Fails if any node was lost, reported an error, or went silent. A lost node is named
    /// before the errors others report about it.
    pub fn check_health(&mut self) -> Result<()> {
        let mut error = None;
        loop {
            match self.events.try_recv() {
                Ok(Event::Lost { node, why }) => bail!("{} {why}", self.who(node)),
                Ok(Event::Control {
                    node,
                    msg: Control::Error(e),
                }) => {
                    error.get_or_insert_with(|| format!("{}: {}", self.who(node), e.message));
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        if let Some(e) = error {
            bail!("{e}");
        }
        let now_ms = self.t0.elapsed().as_millis() as u64;
        for (i, n) in self.nodes.iter().enumerate() {
            let silent = now_ms.saturating_sub(n.last_seen.load(Ordering::Relaxed));
            if silent > HEARTBEAT_TIMEOUT.as_millis() as u64 {
                bail!(
                    "{} stopped answering: nothing heard for {:.1} s (link cut, machine down or process frozen)",
                    self.who(i),
                    silent as f64 / 1000.0
                );
            }
        }
        Ok(())
    }

    /// Every node's counters.
    pub fn stats(&mut self) -> Result<Vec<Stats>> {
        for i in 0..self.nodes.len() {
            self.send_control(i, &Control::GetStats)?;
        }
        let mut out: Vec<Option<Stats>> = vec![None; self.nodes.len()];
        while out.iter().any(|s| s.is_none()) {
            let pending: Vec<usize> = (0..out.len()).filter(|&i| out[i].is_none()).collect();
            let (i, msg) =
                self.next_control(Duration::from_secs(5), "node statistics", &pending)?;
            if let Control::Stats(s) = msg {
                out[i] = Some(s);
            }
        }
        Ok(out.into_iter().flatten().collect())
    }

    /// Tells every node the session is over and closes the links.
    pub fn shutdown(self, reason: &str) {
        for i in 0..self.nodes.len() {
            let _ = self.send_control(
                i,
                &Control::Shutdown {
                    reason: reason.to_string(),
                },
            );
        }
        // Give the writer tasks a moment to flush.
        self.rt.block_on(async {
            tokio::time::sleep(Duration::from_millis(50)).await;
        });
        self.rt.shutdown_timeout(Duration::from_millis(200));
    }
}

/// How long a wait for a node's output blocks before the control connections are looked at:
/// a node that died mid-pass (and the answer to resume) is noticed through them within this.
const DATA_POLL: Duration = Duration::from_millis(50);

/// The coordinator's probe speed and its speed on `file`'s layers and head
/// ([`calibrate`]), measured once per model file and thread count in this process: a ring
/// re-planned after a lost node reuses them (this CPU has not changed, and measuring took a
/// few hundred milliseconds of the pause a resumed request sees).
fn calibration(file: &Arc<GgufFile>, threads: usize) -> Result<(f64, f64, f64)> {
    type Measured = (std::sync::Weak<GgufFile>, usize, (f64, f64, f64));
    static DONE: std::sync::Mutex<Vec<Measured>> = std::sync::Mutex::new(Vec::new());
    let same =
        |(f, t, _): &Measured| *t == threads && std::sync::Weak::ptr_eq(f, &Arc::downgrade(file));
    if let Ok(mut done) = DONE.lock() {
        done.retain(|(f, _, _)| f.strong_count() > 0);
        if let Some((_, _, speeds)) = done.iter().find(|m| same(m)) {
            return Ok(*speeds);
        }
    }
    let probe = sys::matvec_speed(threads, Duration::from_millis(150));
    let (layer, head) = calibrate(file, threads)?;
    if let Ok(mut done) = DONE.lock() {
        done.push((Arc::downgrade(file), threads, (probe, layer, head)));
    }
    Ok((probe, layer, head))
}

/// Decode speed of this model's real layers and output head on this machine, in weight bytes
/// per second: a few layers and the head run on one token at a time for a short while.
fn calibrate(file: &Arc<GgufFile>, threads: usize) -> Result<(f64, f64)> {
    let hp = Model::load(
        Arc::clone(file),
        &LoadOptions {
            layers: Some(0..0),
            embedding: false,
            head: false,
            repack: false,
            stream: None,
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
            repack: false,
            stream: None,
        },
    )?);
    let layer_bytes: usize = model.layers.iter().map(|l| l.weight_bytes()).sum();
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
    Ok((
        layer_bytes as f64 * runs / t_layers.max(1e-9),
        head_bytes as f64 * runs / t_head.max(1e-9),
    ))
}

/// Identity of the coordinator's model file, as nodes check it.
pub fn identity_of(path: &Path, file: &GgufFile) -> ModelIdentity {
    model_identity(path, file)
}
