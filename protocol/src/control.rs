//! Control messages: a closed set, serialized with serde + bincode (standard configuration,
//! little-endian varints) into the payload of a `Control` frame, at most `MAX_CONTROL_LEN`
//! bytes. Decoding is bounded by the same limit, so a hostile length inside a message cannot
//! make the receiver allocate more. Variant order is part of the wire format: append new
//! variants at the end and never reorder (the tests pin every discriminant).

use crate::error::ProtocolError;
use crate::frame::{Dtype, FrameHeader, FrameKind, MAX_CONTROL_LEN};
use crate::transport::TransportKind;
use serde::{Deserialize, Serialize};

/// Identity of a model file: its size and a hash of its header and tensor table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelIdentity {
    /// File name (no directories): what a node looks for in its models directory.
    pub file_name: String,
    pub size: u64,
    pub header_hash: u64,
}

/// What a node reports right after the handshake.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Capabilities {
    pub node_name: String,
    pub version: String,
    pub memory_total: u64,
    pub memory_available: u64,
    pub threads: u32,
    /// CPU features the kernels use (e.g. "avx2", "fma").
    pub cpu_features: Vec<String>,
    /// Kernel set in use ("avx2", "scalar").
    pub isa: String,
    /// Measured weight-read speed of a quantized matrix × vector, bytes of weights per second.
    pub matvec_bytes_per_s: f64,
    /// Model files found in the node's models directory.
    pub models: Vec<ModelIdentity>,
    /// The transport this node takes its data links on (`--transport`).
    pub transport: TransportKind,
    /// Measured sequential read rate of the node's model or slice files with the page cache
    /// bypassed, bytes per second (0: not measured), for plans that stream layers.
    pub disk_read_bytes_per_s: f64,
    /// What runs the layers this node is assigned: `"cpu"`, or `"gpu: <adapter> (…)"`. With a
    /// GPU, `matvec_bytes_per_s` is the GPU's measured speed.
    pub backend: String,
}

/// Where a stage's input comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Input {
    /// Frames arrive on the coordinator's connection.
    Coordinator,
    /// Frames arrive from the previous node, which connects to us.
    Upstream,
}

/// Where a stage sends its output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NextHop {
    /// Back on the coordinator's connection.
    Coordinator,
    /// To another node, which we connect to.
    Node {
        name: String,
        address: String,
        /// The next node's transport.
        transport: TransportKind,
    },
}

/// Element type of a KV cache. On the wire as its variant index (pinned by the tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum KvType {
    /// 4 bytes per element, exact.
    #[default]
    F32,
    /// 2 bytes per element: half the memory, rounding like llama.cpp's `-ctk f16`.
    F16,
}

impl KvType {
    pub const ALL: [KvType; 2] = [KvType::F32, KvType::F16];

    /// `"f32"` or `"f16"` (any case); `None` for anything else.
    pub fn from_name(s: &str) -> Option<KvType> {
        KvType::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s.trim()))
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
        }
    }
}

impl std::fmt::Display for KvType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvType {
    type Err = crate::error::NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KvType::from_name(s).ok_or_else(|| crate::error::NameError::KvType(s.to_string()))
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    /// Distinguishes this ring from earlier ones (a new coordinator, a re-plan).
    pub session: u64,
    pub model: ModelIdentity,
    /// Layers `start..end` of the model.
    pub layer_start: u32,
    pub layer_end: u32,
    /// Compute the final norm and output head and send logits (f16) instead of hidden states.
    pub head: bool,
    pub input: Input,
    pub next_hop: NextHop,
    /// Dtype of hidden states on the wire.
    pub activations: Dtype,
    /// KV cache: context positions, element type, largest batch per frame.
    pub kv_ctx: u32,
    pub kv_type: KvType,
    pub max_batch: u32,
    /// Worker threads for this stage (0: the node's own default).
    pub threads: u32,
    /// Sequences this stage keeps a KV cache for at once; frames carry sequence ids below it.
    pub kv_slots: u32,
    /// Several windows and streamed layers, for models larger than the cluster's memory.
    pub layout: StageLayout,
}

/// How a stage holds its layers when they do not all fit its memory.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageLayout {
    /// A multi-round ring: the stage's windows `(start, end)` in order, one per round (a
    /// frame's round, [`crate::frame::round_of`], says which one runs). Empty: one window,
    /// `layer_start..layer_end`, which then spans all of them.
    pub windows: Vec<(u32, u32)>,
    /// Layers read from disk each token instead of staying resident, in the order they run.
    pub streamed: Vec<u32>,
    /// Layers read ahead when streaming (0: the node picks).
    pub prefetch: u32,
    /// Stream every layer (the naive baseline, `--stream all`).
    pub stream_all: bool,
    /// Predictive layer skip (`up --skip`): the predictor file's bytes (empty: off), the
    /// probability a skip needs in millionths, and the most layers skipped in a row.
    pub skip_predictor: Vec<u8>,
    pub skip_confidence_ppm: u32,
    pub skip_max: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ready {
    pub session: u64,
    pub layer_start: u32,
    pub layer_end: u32,
    pub weight_bytes: u64,
    pub kv_bytes: u64,
    /// Resident set size of the node process once the slice is loaded.
    pub rss_bytes: u64,
    pub load_ms: u64,
}

/// Counters of one node since its assignment.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub session: u64,
    pub frames_in: u64,
    pub frames_out: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub tokens: u64,
    /// Time spent computing layers.
    pub compute_us: u64,
    /// Time from a frame's arrival to its output being queued (compute + queueing).
    pub busy_us: u64,
    pub rss_bytes: u64,
    /// Streamed layers: bytes read from disk, time the compute waited for them, layers
    /// passed over unread.
    pub stream_bytes_read: u64,
    pub stream_stall_us: u64,
    pub stream_layers_skipped: u64,
}

/// Which slice of which model: the layers `layer_start..layer_end`, and the final norm and
/// output head when `head`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SliceKey {
    pub model: ModelIdentity,
    pub layer_start: u32,
    pub layer_end: u32,
    pub head: bool,
}

/// One piece of a slice file: `len` bytes at `offset`, and their BLAKE3 hash. Piece 0 is the
/// GGUF header; every other piece is one tensor's data. The gaps between pieces (alignment
/// padding) are zeros.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// What the piece holds ("header" or a tensor name), for messages.
    pub name: String,
    pub offset: u64,
    pub len: u64,
    pub hash: [u8; 32],
}

/// The coordinator offers a node the slice it is about to assign: a GGUF file of `size`
/// bytes holding only the slice's tensors (and the metadata), described piece by piece.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SliceOffer {
    pub key: SliceKey,
    pub size: u64,
    pub pieces: Vec<Piece>,
    /// Only say what would be needed (`ringllm plan`): no file is touched.
    pub dry_run: bool,
    /// Discard what the cache holds of this slice first (`bench --cold`).
    pub discard: bool,
}

/// What a node lacks of an offered slice: the pieces to send, in order (empty: it has the
/// slice, every piece checked against the offer's hashes).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SliceNeed {
    pub key: SliceKey,
    pub pieces: Vec<u32>,
    /// Bytes of the slice already on the node's disk and checked.
    pub have_bytes: u64,
}

/// A node's account of a slice transfer: sent as pieces arrive (at most a few times a
/// second), and once with `done` when every needed piece has arrived. `bad` lists pieces
/// whose bytes did not match their hash (the coordinator sends them again).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SliceProgress {
    pub key: SliceKey,
    /// Bytes of the needed pieces received so far.
    pub received: u64,
    pub done: bool,
    pub bad: Vec<u32>,
}

/// The coordinator holding a node, as the node saw it at its handshake.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    /// The name the coordinator gave in its handshake.
    pub name: String,
    /// Its address as the node sees it (`ip:port`).
    pub address: String,
    /// How long it has held the node, in milliseconds.
    pub held_ms: u64,
}

/// The stage a node runs for its coordinator.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageStatus {
    pub session: u64,
    /// Model file name.
    pub model: String,
    /// Layers `layer_start..layer_end` (with several rounds, the span of its windows).
    pub layer_start: u32,
    pub layer_end: u32,
    /// The stage computes the output head.
    pub head: bool,
    /// Several rounds: each round's window `(start, end)`; empty for one window.
    pub windows: Vec<(u32, u32)>,
    /// How many of its layers are read from disk every token.
    pub streamed_layers: u32,
    pub weight_bytes: u64,
    pub kv_bytes: u64,
}

/// A node's answer to `GetStatus`: what it is, who holds it, what it runs, how busy it is.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    pub node_name: String,
    pub version: String,
    /// The address it listens on (as bound: `0.0.0.0:7701` when it listens everywhere).
    pub listen: String,
    pub transport: TransportKind,
    pub threads: u32,
    pub isa: String,
    pub memory_total: u64,
    /// What the planner may use (`--memory`, MemAvailable and the cgroup's limit at start).
    pub memory_budget: u64,
    /// Measured weight-read speed of a quantized matrix × vector, bytes per second.
    pub matvec_bytes_per_s: f64,
    pub disk_read_bytes_per_s: f64,
    pub uptime_ms: u64,
    pub coordinator: Option<Holder>,
    pub stage: Option<StageStatus>,
    /// Counters of the current session (zeros without one), and the process's RSS.
    pub stats: Stats,
    /// Rates over the last second or so.
    pub bytes_in_per_s: f64,
    pub bytes_out_per_s: f64,
    pub tokens_per_s: f64,
}

/// Error codes (stable numbers for machines; the message is for people).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    BadRequest,
    ModelMissing,
    ModelMismatch,
    OutOfMemory,
    NextHopUnreachable,
    Busy,
    Compute,
    Internal,
    /// The node's slice cache cannot take the slice (disk full, unwritable directory).
    CacheFull,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorMsg {
    pub code: ErrorCode,
    /// Sequence the error concerns, if any.
    pub seq: Option<u64>,
    pub message: String,
}

/// The control messages. Do not reorder: the variant index is on the wire.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Control {
    Capabilities(Capabilities),
    Assign(Assignment),
    Ready(Ready),
    /// Liveness probe; the receiver answers with `reply = true` and the same nonce.
    Heartbeat {
        nonce: u64,
        reply: bool,
    },
    Stats(Stats),
    /// Forget a sequence's KV cache.
    ReleaseSequence {
        seq: u64,
    },
    Error(ErrorMsg),
    Shutdown {
        reason: String,
    },
    /// Ask for `Stats`.
    GetStats,
    /// First message on a data link (from the coordinator, or from a node to its next hop):
    /// which ring it belongs to, and whether it carries the receiver's input, its output
    /// (back to the coordinator), or both.
    Attach {
        session: u64,
        from: String,
        input: bool,
        output: bool,
        /// The transport the sender will use: on a TCP connection, `Udp` asks for a reliable
        /// UDP link from the sender's UDP port `udp_port`; this connection stays open as its
        /// anchor (its end is the link's end).
        transport: TransportKind,
        udp_port: u16,
    },
    SliceOffer(SliceOffer),
    SliceNeed(SliceNeed),
    SliceProgress(SliceProgress),
    /// Ask a node how it is doing (`ringllm status`; on a `Role::Monitor` connection, which
    /// any key holder may open while a coordinator holds the node).
    GetStatus,
    /// A node's answer to `GetStatus`.
    Status(Box<NodeStatus>),
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<{ MAX_CONTROL_LEN as usize }>()
}

impl Control {
    pub fn encode(&self) -> Result<Vec<u8>, ProtocolError> {
        let v = bincode::serde::encode_to_vec(self, config())
            .map_err(|e| ProtocolError::Control(format!("cannot encode: {e}")))?;
        if v.len() > MAX_CONTROL_LEN as usize {
            return Err(ProtocolError::TooLarge {
                what: "control message",
                len: v.len() as u64,
                max: MAX_CONTROL_LEN as u64,
            });
        }
        Ok(v)
    }

    pub fn decode(bytes: &[u8]) -> Result<Control, ProtocolError> {
        if bytes.len() > MAX_CONTROL_LEN as usize {
            return Err(ProtocolError::TooLarge {
                what: "control message",
                len: bytes.len() as u64,
                max: MAX_CONTROL_LEN as u64,
            });
        }
        let (msg, used): (Control, usize) = bincode::serde::decode_from_slice(bytes, config())
            .map_err(|e| ProtocolError::Control(e.to_string()))?;
        if used != bytes.len() {
            return Err(ProtocolError::Control(format!(
                "{} trailing bytes after the message",
                bytes.len() - used
            )));
        }
        Ok(msg)
    }

    /// The message as a frame: header and payload.
    pub fn to_frame(&self) -> Result<(FrameHeader, Vec<u8>), ProtocolError> {
        let payload = self.encode()?;
        let h = FrameHeader::new(FrameKind::Control, Dtype::Bytes, 0, 0, 0, 0, &payload)?;
        Ok((h, payload))
    }

    /// Short name for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Control::Capabilities(_) => "capabilities",
            Control::Assign(_) => "assign",
            Control::Ready(_) => "ready",
            Control::Heartbeat { .. } => "heartbeat",
            Control::Stats(_) => "stats",
            Control::ReleaseSequence { .. } => "release-sequence",
            Control::Error(_) => "error",
            Control::Shutdown { .. } => "shutdown",
            Control::GetStats => "get-stats",
            Control::Attach { .. } => "attach",
            Control::SliceOffer(_) => "slice-offer",
            Control::SliceNeed(_) => "slice-need",
            Control::SliceProgress(_) => "slice-progress",
            Control::GetStatus => "get-status",
            Control::Status(_) => "status",
        }
    }
}
