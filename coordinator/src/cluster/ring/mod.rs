//! The coordinator's side of the ring: connects to every node, authenticates, gathers
//! capabilities and measures links, plans the split, assigns slices, then moves hidden states
//! around the ring for the engine. Failure of any node or link surfaces as an error naming it
//! within `HEARTBEAT_TIMEOUT`.
//!
//! By phase: [`connect`](Ring::connect) (capabilities, round trips, the plan), `assign`
//! (slices sent, layers loaded, data links), `step` (a pass through the ring), `events`
//! (what the nodes say, heartbeats, the end), `send` (slice transfer), and `cost` (what the
//! planner is told about the model and this machine).

use crate::cluster::planner::Plan;
use crate::cluster::streaming::{self, StreamingPlan};
use anyhow::Result;
use ringllm_model::gguf::GgufFile;
use ringllm_model::slice::model_identity;
use ringllm_model::KvType;
use ringllm_protocol::control::{Capabilities, Control, ModelIdentity, Ready};
use ringllm_protocol::dial::BoxLink;
use ringllm_protocol::{ClusterKey, Dtype, FrameHeader, LinkCounters, TransportKind};

mod assign;
mod connect;
mod cost;
mod events;
mod send;
mod step;
pub use cost::{model_cost, Calibration, ModelSpeed};
pub use send::{Sent, SlicePreview, TransferCut};

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::AtomicU64;
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
    /// When the node was last asked for a handshake for being silent (`check_frozen`).
    probed_at: Option<Instant>,
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

/// Frames and bytes the coordinator exchanged with one node, since the ring started: a
/// snapshot of its links' counters. Two snapshots subtract to what went by in between.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Frames the coordinator sent to the node.
    pub frames_sent: u64,
    /// Bytes the coordinator sent to the node.
    pub bytes_sent: u64,
    /// Frames the coordinator received from the node.
    pub frames_received: u64,
    /// Bytes the coordinator received from the node.
    pub bytes_received: u64,
}

impl LinkStats {
    /// A snapshot of `c`.
    pub fn of(c: &LinkCounters) -> LinkStats {
        let (frames_sent, bytes_sent, frames_received, bytes_received) = c.snapshot();
        LinkStats {
            frames_sent,
            bytes_sent,
            frames_received,
            bytes_received,
        }
    }
}

/// What went by between two snapshots (`later - earlier`); a counter that went back (not
/// snapshots of the same links, in that order) counts 0.
impl std::ops::Sub for LinkStats {
    type Output = LinkStats;
    fn sub(self, earlier: LinkStats) -> LinkStats {
        LinkStats {
            frames_sent: self.frames_sent.saturating_sub(earlier.frames_sent),
            bytes_sent: self.bytes_sent.saturating_sub(earlier.bytes_sent),
            frames_received: self.frames_received.saturating_sub(earlier.frames_received),
            bytes_received: self.bytes_received.saturating_sub(earlier.bytes_received),
        }
    }
}

impl std::ops::AddAssign for LinkStats {
    fn add_assign(&mut self, o: LinkStats) {
        self.frames_sent += o.frames_sent;
        self.bytes_sent += o.bytes_sent;
        self.frames_received += o.frames_received;
        self.bytes_received += o.bytes_received;
    }
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
    /// The cluster key: silent nodes are asked for a handshake with it.
    key: ClusterKey,
}

impl Ring {
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

    /// Bytes and frames the coordinator sent to / received from each node (its control
    /// connection and any data link to it).
    pub fn link_counters(&self) -> Vec<LinkStats> {
        let mut out: Vec<LinkStats> = self
            .nodes
            .iter()
            .map(|n| LinkStats::of(&n.counters))
            .collect();
        let mut seg = 0;
        for st in &self.stages {
            let Stage::Segment { first, last } = *st else {
                continue;
            };
            let l = &self.links[seg];
            out[first] += LinkStats::of(&l.input.counters());
            if let Some(o) = &l.output {
                out[last] += LinkStats::of(&o.counters());
            }
            seg += 1;
        }
        out
    }

    pub(super) fn send_control(&self, i: usize, msg: &Control) -> Result<()> {
        let f = msg.to_frame()?;
        self.nodes[i]
            .out
            .try_send(f)
            .map_err(|_| self.fault(i, format!("{}: the link is gone", self.who(i))))
    }
}

/// Identity of the coordinator's model file, as nodes check it.
pub fn identity_of(path: &Path, file: &GgufFile) -> ModelIdentity {
    model_identity(path, file)
}
