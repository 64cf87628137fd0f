//! The node daemon (`ringllm node`): authenticates every connection, takes an assignment
//! from one coordinator at a time, maps only its slice of the model, and runs its layers on
//! every frame that reaches it, forwarding the result to its next hop.
//!
//! `serve` takes its sockets (a `Listener`) and a shutdown future from the caller, so the
//! command binds `--listen` and turns Ctrl-C or SIGTERM into the future, and tests run many
//! nodes in one process on `127.0.0.1:0` and stop them without a signal.
//!
//! Tasks and threads:
//! - the tokio runtime runs the accept loop, one task per connection, and one writer task
//!   per control connection (fed by a channel, so compute never waits on a socket);
//! - one compute thread per assignment (`worker`) owns the `Runner` and the KV caches, and
//!   reads, runs and writes its data links itself (blocking links, no runtime in the hot
//!   path).
//!
//! Connections by role (from the handshake): the coordinator's control connection (control
//! messages only: data travels on data links), and data links (`Role::Upstream`) from the
//! previous stage or the coordinator, over TCP, io_uring, reliable UDP (anchored on a TCP
//! connection to this listener) or QUIC (on the UDP port of the listener's number).
//!
//! On shutdown the node stops accepting, tells a connected coordinator (`Shutdown`), ends the
//! session (its compute thread sees its links close), waits for the connection tasks and the
//! compute threads, and returns.
//!
//! The module is cut by phase: `listener` (the sockets, `serve`, shutdown), `connection`
//! (accept, handshake, the coordinator slot, the writer), `control` (one handler per control
//! message), `assign` and `stage` (an assignment: check, link, runner and KV, streamed tier),
//! `data` (data links), `status` (status and stats), `state` (what the node holds),
//! `worker` (the compute thread), `slices` (the slice cache), `refusals` (refused
//! connections, logged so that a flood costs a few lines) and `error`.

mod assign;
mod connection;
mod control;
mod data;
mod error;
mod listener;
mod refusals;
pub mod slices;
mod stage;
mod state;
mod status;
mod worker;

pub use error::{AssignError, DaemonError, StageError};
pub use listener::{serve, Listener};
pub use status::MONITOR_SILENCE;

use connection::error_frame;
use ringllm_model::stream::StreamSettings;
use ringllm_protocol::{ClusterKey, TransportKind};
use state::Outgoing;
use std::path::PathBuf;
use std::time::Duration;

/// How long an accepted connection may take to authenticate (each connection has its own task,
/// so a stalled client holds nobody else up; lost segments on a lossy link cost 1-3 s each).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a new coordinator waits for the previous one's connection to go away (shorter
/// than the coordinator's own wait for capabilities, so a refusal reaches it as a message
/// naming the holder rather than as its timeout).
pub const TAKEOVER_WAIT: Duration = Duration::from_secs(7);
/// Longest silence from a coordinator with a running session (it sends a heartbeat every
/// 0.5 s): past it the coordinator is taken for stopped (a frozen process, a pulled cable,
/// a stall mid-frame) and its slot and session are freed for the next one.
pub const COORDINATOR_SILENCE: Duration = Duration::from_secs(5);
/// Longest silence from a coordinator before its session starts (it plans meanwhile).
pub const COORDINATOR_SETUP_SILENCE: Duration = Duration::from_secs(60);
/// Largest data payload a node accepts (defined, with why, in `ringllm_protocol::frame`).
pub use ringllm_protocol::frame::NODE_MAX_PAYLOAD as MAX_PAYLOAD;
/// How long shutdown waits for connection tasks, then for compute threads, before giving up
/// on them (a hang guard: both end within milliseconds once their links close).
pub const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);
/// How long shutdown waits for the step under way to finish before closing the links under
/// it (a long prefill on a big slice; a decode step takes milliseconds).
pub const STEP_WAIT: Duration = Duration::from_secs(30);

/// What a node is: its cluster, name, compute threads, models and data-link transport.
pub struct NodeOptions {
    /// The cluster key every connection must prove.
    pub key: ClusterKey,
    /// Shown to coordinators and in every message this node sends.
    pub name: String,
    /// Worker threads for compute (an assignment may ask for fewer).
    pub threads: usize,
    /// Where the model files assignments name are looked up (by file name only).
    pub models_dir: PathBuf,
    /// Where slices the coordinator sends are kept (`slices`).
    pub cache_dir: PathBuf,
    /// The transport this node takes its data links on.
    pub transport: TransportKind,
    /// `--memory`: the most this node may use; its budget is the smaller of this and what the
    /// machine and its cgroup leave ([`ringllm_model::limits::budget`]). `None`: no cap of
    /// its own.
    pub memory: Option<u64>,
    /// Repack weights into panels at load where the kernels read them
    /// ([`ringllm_model::LoadOptions::repack`]); `--no-repack` turns it off for this node.
    pub repack: bool,
    /// `--stream`, `--prefetch`: layers streamed from disk when they do not fit.
    pub stream: StreamSettings,
    /// `--backend`: what runs the layers of an assignment.
    pub backend: ringllm_model::BackendChoice,
}
