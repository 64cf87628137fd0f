//! Building a ring: connect to every node at once, gather their capabilities, measure the
//! round trip of each link, then plan the split (or a streaming layout) and cut the stages
//! into local ranges and segments of consecutive nodes.

use super::cost::{calibration, model_cost};
use super::{
    Event, Outgoing, RemoteNode, Ring, RingSpec, Sizing, Stage, StageSpec, CONNECT_TIMEOUT,
};
use crate::cluster::planner::{
    self, headroom, CoordinatorInput, HeadPlace, ModelCost, Plan, StageInput,
};
use crate::cluster::probe::fault;
use crate::cluster::streaming;
use anyhow::{anyhow, bail, Context, Result};
use ringllm_model::gguf::GgufFile;
use ringllm_protocol::control::{Capabilities, Control};
use ringllm_protocol::control_conn::{self, control_of};
use ringllm_protocol::frame::COORDINATOR_MAX_PAYLOAD;
use ringllm_protocol::{Dtype, FrameHeader, FrameKind, Link, Role, TransportKind};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Heartbeats sent to each node to measure its round trip (the best counts).
const RTT_PROBES: u64 = 5;

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
        let links = dial_nodes(&rt, spec, &remote)?;
        let nodes = links
            .into_iter()
            .zip(&remote)
            .enumerate()
            .map(|(i, (link, s))| start_node(&rt, t0, &ev_tx, i, link, s))
            .collect();
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
            key: spec.key.clone(),
        };
        ring.gather_capabilities()?;
        ring.check_kmod()?;
        ring.measure_rtts()?;
        ring.plan_stages(spec, file, sizing, coordinator_threads)?;
        let _ = model_path;
        Ok(ring)
    }

    /// Waits for every node's capabilities (the first message on every connection), checking
    /// each node's transport against what the cluster declared.
    fn gather_capabilities(&mut self) -> Result<()> {
        let mut have = vec![false; self.nodes.len()];
        while have.iter().any(|h| !h) {
            let pending: Vec<usize> = (0..have.len()).filter(|&i| !have[i]).collect();
            let (i, msg) = self.next_control(Duration::from_secs(10), "capabilities", &pending)?;
            match msg {
                Control::Capabilities(c) => {
                    // A node known only by its address (`--node`) goes by its own name
                    // (escaped: it is shown in tables and log lines).
                    let n = &mut self.nodes[i];
                    if n.name == n.address && !c.node_name.is_empty() {
                        n.name = ringllm_protocol::untrusted::escape(&c.node_name).into_owned();
                    }
                    self.nodes[i].caps = c;
                    have[i] = true;
                }
                Control::Error(e) => {
                    return Err(self.fault(i, format!("{}: {}", self.who(i), e.message)))
                }
                other => {
                    return Err(self.fault(
                        i,
                        format!(
                            "{}: expected capabilities, got {}",
                            self.who(i),
                            other.name()
                        ),
                    ))
                }
            }
        }
        // Every node started with another transport than the cluster declares, named in the
        // cluster's order once all have answered (not whichever answered first).
        let wrong: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| {
                let n = &self.nodes[i];
                n.declared.is_some_and(|want| want != n.caps.transport)
            })
            .collect();
        let lines: Vec<String> = wrong
            .iter()
            .filter_map(|&i| {
                let want = self.nodes[i].declared?;
                Some(format!(
                    "{}: the cluster says its links use {want}, but the node was started with \
                     --transport {} (restart it with --transport {want}, or change the cluster \
                     file)",
                    self.who(i),
                    self.nodes[i].caps.transport
                ))
            })
            .collect();
        match wrong.first() {
            Some(&first) => Err(self.fault(first, lines.join("\n"))),
            None => Ok(()),
        }
    }

    /// The coordinator dials each node's transport: kmod needs the module here too.
    fn check_kmod(&self) -> Result<()> {
        if let Some(i) =
            (0..self.nodes.len()).find(|&i| self.nodes[i].caps.transport == TransportKind::Kmod)
        {
            if let Err(e) = ringllm_protocol::kmod::probe() {
                bail!(
                    "{} uses --transport kmod, so the coordinator's machine needs the module                      too: {e}",
                    self.who(i)
                );
            }
        }
        Ok(())
    }

    /// Link round trips: best of a few heartbeats.
    fn measure_rtts(&mut self) -> Result<()> {
        for i in 0..self.nodes.len() {
            let mut best = f64::MAX;
            for k in 0..RTT_PROBES {
                let t = Instant::now();
                self.send_control(
                    i,
                    &Control::Heartbeat {
                        nonce: k,
                        reply: false,
                    },
                )?;
                loop {
                    let (j, msg) = self.next_control(CONNECT_TIMEOUT, "a heartbeat reply", &[i])?;
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
            self.nodes[i].rtt_s = best;
        }
        Ok(())
    }

    /// Plans the split over what was measured (or a streaming layout when the model does not
    /// fit), and cuts it into stages.
    fn plan_stages(
        &mut self,
        spec: &RingSpec,
        file: &Arc<GgufFile>,
        sizing: &Sizing,
        coordinator_threads: usize,
    ) -> Result<()> {
        let (mut cost, hp) = model_cost(
            file,
            sizing.ctx,
            sizing.max_batch,
            sizing.kv,
            spec.activations,
        )?;
        cost.slots = sizing.slots.max(1);
        self.vocab = hp.vocab;
        let scratch = |threads: usize| {
            ringllm_model::Runner::scratch_bytes(&hp, threads.max(1), sizing.max_batch, sizing.ctx)
        };
        let (coord_in, inputs) =
            self.planner_inputs(spec, file, &cost, &scratch, coordinator_threads)?;
        let plan = self.choose_plan(spec, &cost, &coord_in, &inputs)?;
        self.rounds = self.streaming.as_ref().map_or(1, |s| s.chosen().rounds);
        self.head_on_node = matches!(plan.head, HeadPlace::LastNode);
        self.stages = segments(spec, &plan);
        self.plan = plan;
        Ok(())
    }

    /// What the planner is told about the coordinator and every stage: memory budgets, and
    /// speeds calibrated against this model's real layers.
    fn planner_inputs(
        &self,
        spec: &RingSpec,
        file: &Arc<GgufFile>,
        cost: &ModelCost,
        scratch: &dyn Fn(usize) -> u64,
        coordinator_threads: usize,
    ) -> Result<(CoordinatorInput, Vec<StageInput>)> {
        let avail = ringllm_model::limits::available_memory().unwrap_or(0);
        let coord_budget = spec
            .coordinator_memory
            .unwrap_or(avail.saturating_sub(headroom(avail)));
        // Calibration: the probe's speed against this model's real layers and head, measured
        // here; a node's probe speed is scaled by the ratio measured here at its own thread
        // counts (below).
        let cal = calibration(file, coordinator_threads)?;
        tracing::info!(
            probe_gbs = cal.probe_bytes_per_s / 1e9,
            layer_gbs = cal.model.layer_bytes_per_s / 1e9,
            head_gbs = cal.model.head_bytes_per_s / 1e9,
            "planner calibration"
        );
        let coord_speed = cal.model.layer_bytes_per_s;
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
                    let n = &self.nodes[ni];
                    // The node's budget (--memory, MemAvailable, cgroup) less headroom, or
                    // the cluster file's cap on layers + KV when smaller.
                    let avail = n.caps.memory_available;
                    let budget = avail.saturating_sub(headroom(avail));
                    let budget = s.memory.map_or(budget, |m| m.min(budget));
                    // The node runs with the cluster file's threads, else its own.
                    let threads = s.threads.unwrap_or(n.caps.threads as usize);
                    let factor = node_factor(file, n.caps.threads as usize, threads)?;
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
            bytes_per_s: cal.model.head_bytes_per_s,
        };
        Ok((coord_in, inputs))
    }

    /// The plain split when the model fits; else (and when `--rounds` asks) a streaming
    /// layout, kept in `self.streaming`.
    fn choose_plan(
        &mut self,
        spec: &RingSpec,
        cost: &ModelCost,
        coord_in: &CoordinatorInput,
        inputs: &[StageInput],
    ) -> Result<Plan> {
        let fitted = if spec.stream.choice == streaming::Choice::Auto {
            Some(planner::plan(cost, coord_in, inputs))
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
                let disk: Vec<f64> = self
                    .nodes
                    .iter()
                    .map(|n| n.caps.disk_read_bytes_per_s)
                    .collect();
                let sp = match streaming::plan(cost, coord_in, inputs, &disk, spec.stream.choice) {
                    Ok(sp) => sp,
                    // What does not fit, as the plain planner says it, then why streaming
                    // does not help either.
                    Err(e) => match &fit_error {
                        Some(f) => bail!("{f}\n{e}"),
                        None => bail!("{e}"),
                    },
                };
                let p = sp.to_plan(inputs, cost.slots);
                self.streaming = Some(sp);
                (p, fit_error)
            }
        };
        if let Some(f) = fit_error {
            tracing::info!("{f}: streaming layers from disk instead");
        }
        Ok(plan)
    }
}

/// Connects and authenticates the control connection of every node in `remote`, all at once.
fn dial_nodes(
    rt: &tokio::runtime::Runtime,
    spec: &RingSpec,
    remote: &[&StageSpec],
) -> Result<Vec<Link>> {
    rt.block_on(async {
        let mut tasks = Vec::new();
        for s in remote {
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
        for (t, s) in tasks.into_iter().zip(remote) {
            let who = format!("node {}", s.label());
            let addr = s.address.as_deref().unwrap_or_default();
            let link = t
                .await
                .map_err(|e| anyhow!("{who}: {e}"))?
                .map_err(|e| fault(addr, format!("cannot connect to {who}: {e}")))?;
            out.push(link);
        }
        Ok::<_, anyhow::Error>(out)
    })
}

/// Starts node `i`'s writer (control messages first, slice data when none waits) and reader
/// (every frame becomes an [`Event`]) on the runtime.
fn start_node(
    rt: &tokio::runtime::Runtime,
    t0: Instant,
    ev_tx: &mpsc::UnboundedSender<Event>,
    i: usize,
    link: Link,
    s: &StageSpec,
) -> RemoteNode {
    let last_seen = Arc::new(AtomicU64::new(t0.elapsed().as_millis() as u64));
    let counters = Arc::clone(&link.counters);
    let Link { mut tx, mut rx, .. } = link;
    let (qtx, mut qrx) = mpsc::channel::<Outgoing>(256);
    let (dtx, mut drx) = mpsc::channel::<Outgoing>(super::send::QUEUE);
    let ev = ev_tx.clone();
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
                    if ev.send(event_of(i, h, &buf)).is_err() {
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
    RemoteNode {
        name: s.name.clone(),
        address: s.address.clone().unwrap_or_default(),
        out: qtx,
        data: dtx,
        caps: no_capabilities(),
        declared: s.transport,
        rtt_s: 0.0,
        last_seen,
        counters,
        probed_at: None,
    }
}

/// What a frame from node `i`'s control connection means.
fn event_of(i: usize, h: FrameHeader, buf: &[u8]) -> Event {
    if h.kind != FrameKind::Control {
        return Event::Frame { node: i, h };
    }
    match control_of(&h, buf) {
        Ok(Control::Heartbeat { reply: true, nonce }) => Event::Control {
            node: i,
            msg: Control::Heartbeat { nonce, reply: true },
        },
        // The node is going away and says why; the connection closes next.
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
}

/// A node's capabilities before it sent them.
fn no_capabilities() -> Capabilities {
    Capabilities {
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
    }
}

/// The stages of `plan`: local ranges and segments of consecutive remote nodes (a node
/// given no layers is left out).
fn segments(spec: &RingSpec, plan: &Plan) -> Vec<Stage> {
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
    stages
}

/// What a node's probe speed (measured with `probe_threads`) is multiplied by to estimate its
/// speed on this model's layers with `run_threads`: this machine's layer speed at
/// `run_threads` over its probe speed at `probe_threads`, each at most this machine's cores.
/// One factor for every node, taken at the coordinator's thread count, was wrong by the
/// scaling of the two speeds: the probe's matrix stays in cache and scales with threads, the
/// layers stream from memory and scale less. A 1-thread node scaled by the 2-thread ratio was
/// predicted at 0.57x its measured speed (qwen3-14b over three nodes, issue 28).
fn node_factor(file: &Arc<GgufFile>, probe_threads: usize, run_threads: usize) -> Result<f64> {
    let here = std::thread::available_parallelism().map_or(1, |n| n.get());
    let at = |t: usize| t.clamp(1, here);
    let probe = calibration(file, at(probe_threads))?.probe_bytes_per_s;
    let layers = calibration(file, at(run_threads))?.model.layer_bytes_per_s;
    Ok((layers / probe.max(1.0)).clamp(0.01, 10.0))
}
