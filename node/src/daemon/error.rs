//! Errors of the node daemon: starting it, taking an assignment, and running a stage on the
//! frames that reach it. Assignment and stage errors travel to the coordinator as the text of
//! an `Error` message, so each names the node, and the file, sequence or hop involved.

use ringllm_model::gguf::GgufError;
use ringllm_model::ModelError;
use ringllm_protocol::control::ErrorCode;
use ringllm_protocol::{Dtype, FrameKind, ProtocolError, TransportError, TransportKind};
use std::net::SocketAddr;
use std::path::PathBuf;

/// Why the daemon could not start serving.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The QUIC endpoint for QUIC data links could not be bound on the UDP port of the
    /// listener's number (taken by another process, or no TLS configuration from the key).
    #[error("cannot serve QUIC on UDP {addr}: {source}")]
    Quic {
        addr: SocketAddr,
        #[source]
        source: TransportError,
    },
    /// The node takes data links over QUIC but its listener was made without a QUIC endpoint
    /// (`Listener::new` with another transport).
    #[error(
        "node '{node}' takes data links over {transport}, but its listener has no QUIC endpoint"
    )]
    NoQuicEndpoint {
        node: String,
        transport: TransportKind,
    },
    /// The TCP listener's own address cannot be read.
    #[error("cannot read the listening address: {0}")]
    LocalAddr(#[source] std::io::Error),
    /// The start-up probe (matrix-vector speed, models directory) panicked or was cancelled.
    #[error("start-up probe failed: {0}")]
    Probe(#[source] tokio::task::JoinError),
    /// `--backend gpu` and no GPU opens (or this build has none).
    #[error("{0}")]
    Backend(String),
}

/// Why an assignment was refused. `code` gives the wire code the coordinator sees.
#[derive(Debug, thiserror::Error)]
pub enum AssignError {
    /// Activations asked in a format that is not a hidden-state format (`bytes`).
    #[error("node '{node}': activations must be f32, f16, bf16 or q8")]
    Activations { node: String },
    /// A model file name that is empty, hidden, or not a plain name (a path).
    #[error("node '{node}': invalid model file name '{file}'")]
    FileName { node: String, file: String },
    /// The models directory holds no file of that name, and the slice cache no checked
    /// slice of it.
    #[error(
        "node '{node}' has no model file {file} in {} and no checked slice of it in {} (let \
         the coordinator send it: `up` without --no-send; or copy the file there, or start \
         the node with --models DIR)",
        dir.display(),
        cache.display()
    )]
    NoModelFile {
        node: String,
        file: String,
        dir: PathBuf,
        cache: PathBuf,
    },
    /// The model file is there but cannot be read as GGUF.
    #[error("node '{node}': cannot read {}: {source}", path.display())]
    Unreadable {
        node: String,
        path: PathBuf,
        #[source]
        source: Box<GgufError>,
    },
    /// A file of that name, but not the coordinator's (size or header hash differ).
    #[error(
        "node '{node}': {} is not the coordinator's model (size {size} vs {want_size}, header \
         hash {hash:016x} vs {want_hash:016x}); copy the same file to every machine",
        path.display()
    )]
    NotTheModel {
        node: String,
        path: PathBuf,
        size: u64,
        want_size: u64,
        hash: u64,
        want_hash: u64,
    },
    /// Layers (the stage's, or one of its windows) empty or past the model's last layer:
    /// refused before anything is sized by them.
    #[error(
        "node '{node}': layers {start}..{end} are not a range of the model's {n_layer} layers \
         (0..{n_layer}, not empty)"
    )]
    LayerRange {
        node: String,
        start: usize,
        end: usize,
        n_layer: usize,
    },
    /// The slice cannot be loaded (layers outside the model, a tensor missing or malformed).
    #[error("node '{node}': {source}")]
    Load {
        node: String,
        #[source]
        source: ModelError,
    },
    /// A setting of the assignment (threads, batch, context, slots) beyond its limit, or
    /// scratch and KV caches beyond the memory available: refused before allocation.
    #[error("node '{node}': {source}")]
    Limit {
        node: String,
        #[source]
        source: ringllm_model::limits::LimitError,
    },
    /// The link to the next node of the ring could not be opened.
    #[error("node '{node}' cannot reach its next hop '{next}' at {address}: {source}")]
    NextHop {
        node: String,
        next: String,
        address: String,
        #[source]
        source: TransportError,
    },
    /// The stage's windows or streamed layers do not make sense, or cannot be streamed in
    /// this node's memory.
    #[error("node '{node}': {why}")]
    Layout { node: String, why: String },
    /// A loading task panicked or was cancelled.
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
    /// The operating system refused a thread for the compute loop.
    #[error("cannot start compute thread: {0}")]
    Thread(#[source] std::io::Error),
}

impl AssignError {
    /// The wire code of this refusal.
    pub fn code(&self) -> ErrorCode {
        match self {
            AssignError::Activations { .. }
            | AssignError::FileName { .. }
            | AssignError::LayerRange { .. }
            | AssignError::Load { .. }
            | AssignError::Layout { .. } => ErrorCode::BadRequest,
            AssignError::NoModelFile { .. } | AssignError::Unreadable { .. } => {
                ErrorCode::ModelMissing
            }
            AssignError::NotTheModel { .. } => ErrorCode::ModelMismatch,
            AssignError::Limit { source, .. } => match source {
                ringllm_model::limits::LimitError::Memory { .. } => ErrorCode::OutOfMemory,
                _ => ErrorCode::BadRequest,
            },
            AssignError::NextHop { .. } => ErrorCode::NextHopUnreachable,
            AssignError::Task(_) | AssignError::Thread(_) => ErrorCode::Internal,
        }
    }
}

/// Why a batch of frames could not be run through a stage. The compute thread reports it to
/// the coordinator prefixed with the node's name.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// More tokens in one batch than the assignment's `max_batch`.
    #[error("a batch of {n} tokens exceeds the limit {max}")]
    BatchTooLarge { n: usize, max: usize },
    /// A frame that is not hidden states of this model's width in its declared format.
    #[error(
        "{kind:?} frame of {bytes_per_token} bytes per token in {}, expected hidden states of \
         {} bytes per token ({} × d = {d})",
        dtype.name(),
        want.map_or("no whole".to_string(), |w| w.to_string()),
        dtype.name()
    )]
    NotHidden {
        kind: FrameKind,
        dtype: Dtype,
        bytes_per_token: usize,
        /// Bytes per token of `d` values in `dtype` (`None`: `d` is no whole number of blocks).
        want: Option<usize>,
        d: usize,
    },
    /// A sequence number beyond the slots the assignment made room for.
    #[error("sequence {seq} is beyond the {slots} slots assigned")]
    SlotOutOfRange { seq: u64, slots: usize },
    /// The same sequence twice in one batch.
    #[error("sequence {seq} twice in one batch")]
    DuplicateSequence { seq: u64 },
    /// A rewind a sliding-window cache cannot make (the positions are gone).
    #[error("cannot rewind sequence {seq} to position {pos} (sliding-window cache)")]
    CannotRewind { seq: u64, pos: usize },
    /// A frame past the end of its sequence's cache: positions in between were never seen.
    #[error("frame at position {pos} but the cache holds {held} positions of sequence {seq}")]
    PositionGap { seq: u64, pos: usize, held: usize },
    /// A sequence's cache vanished between the checks and the pass (a bug, not a peer's fault).
    #[error("no cache for sequence {seq}")]
    NoCache { seq: u64 },
    /// A frame for a round this stage has no window for, or a batch mixing rounds.
    #[error(
        "frame for round {round}, but this stage has {windows} window(s) (or a batch mixes rounds)"
    )]
    BadRound { round: usize, windows: usize },
    /// Activations that do not decode or encode, or a frame too large for its header.
    #[error(transparent)]
    Wire(#[from] ProtocolError),
    /// The forward pass refused the batch (context full, buffers...).
    #[error(transparent)]
    Model(#[from] ModelError),
}
