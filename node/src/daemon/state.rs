//! What a node holds: its options and capabilities, the coordinator slot, the running
//! session, the mapped model file and the sampled rates.

use super::refusals::Refusals;
use super::worker::{Attached, SessionStats};
use super::NodeOptions;
use ringllm_model::gguf::GgufFile;
use ringllm_model::stream::Streamer;
use ringllm_protocol::control::{Capabilities, ModelIdentity, StageStatus};
use ringllm_protocol::{FrameHeader, LinkCloser};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::{watch, Notify};

/// A frame queued for a control connection's writer.
pub(super) type Outgoing = (FrameHeader, Vec<u8>);

/// The node's side of a running assignment; dropping it ends the session (its compute thread
/// sees `stop`, or its links close under it).
pub(super) struct SessionHandle {
    /// The ring session the coordinator named.
    pub(super) id: u64,
    /// The control connection that made the assignment.
    pub(super) conn_id: u64,
    /// Hands the compute thread its data links as they attach.
    pub(super) attach: std::sync::mpsc::Sender<Attached>,
    pub(super) stats: Arc<SessionStats>,
    pub(super) stop: Arc<AtomicBool>,
    /// Closers of the session's data links: dropping the session unblocks its thread.
    pub(super) closers: Arc<Mutex<Vec<LinkCloser>>>,
    /// Sequences the coordinator released since the last batch (their caches are cleared
    /// before the next one); each below `slots` and listed once, so at most `slots` long.
    pub(super) release: Arc<Mutex<Vec<u64>>>,
    /// The sequences the stage keeps caches for (the assignment's KV slots).
    pub(super) slots: usize,
    /// The session's streamed layers, for their counters.
    pub(super) streamer: Option<Arc<Streamer>>,
    /// Held by the compute thread through each step (from a batch's first frame to its last
    /// result sent): shutdown takes it before closing the links, so a step under way is
    /// finished and no half-sent frame is left on a link.
    pub(super) step: Arc<Mutex<()>>,
    /// What the stage runs, for status queries.
    pub(super) info: StageStatus,
}

impl Drop for SessionHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for c in self
            .closers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            c.close();
        }
    }
}

#[derive(Default)]
pub(super) struct State {
    /// The coordinator being served.
    pub(super) coordinator: Option<Holder>,
    pub(super) session: Option<SessionHandle>,
    /// The last model file opened, kept mapped for the next assignment.
    pub(super) cache: Option<(ModelIdentity, Arc<GgufFile>)>,
    /// Coordinators waiting for the coordinator slot: while one waits, the holder may not
    /// stay silent before its session for longer than `COORDINATOR_SILENCE`.
    pub(super) waiting: usize,
}

/// Who holds a node's coordinator slot.
pub(super) struct Holder {
    pub(super) conn_id: u64,
    /// "coordinator 'name' (address)".
    pub(super) who: String,
    /// The name from its handshake and its address, for status queries.
    pub(super) name: String,
    pub(super) address: String,
    pub(super) since: Instant,
}

/// Counters of the current session sampled about once a second, and the rates between the
/// last two samples (status queries report them).
#[derive(Default)]
pub(super) struct Rates {
    pub(super) last: Option<(Instant, u64, [u64; 3])>,
    pub(super) per_s: [f64; 3],
}

pub(super) struct Node {
    pub(super) opts: NodeOptions,
    /// The address this node listens on, for messages.
    pub(super) addr: SocketAddr,
    pub(super) caps: Capabilities,
    pub(super) state: Mutex<State>,
    pub(super) changed: Notify,
    pub(super) next_conn: AtomicU64,
    /// Becomes `true` once, when the daemon shuts down.
    pub(super) stopping: watch::Sender<bool>,
    /// Compute threads started, joined at shutdown (finished ones are dropped as new ones
    /// start).
    pub(super) compute: Mutex<Vec<std::thread::JoinHandle<()>>>,
    pub(super) started: Instant,
    /// Bytes in, bytes out and tokens per second lately.
    pub(super) rates: Mutex<Rates>,
    /// Refused connections of this interval, logged a few in full and the rest counted.
    pub(super) refusals: Refusals,
}

impl Node {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind; keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resolves once the daemon is shutting down.
    pub(super) async fn stopped(&self) {
        let mut rx = self.stopping.subscribe();
        // The sender lives in `self`: `wait_for` cannot fail while we are borrowed.
        let _ = rx.wait_for(|stop| *stop).await;
    }

    /// Runs `fut` unless the daemon shuts down first (then `None`; `fut` is dropped).
    pub(super) async fn until_stopped<T>(&self, fut: impl Future<Output = T>) -> Option<T> {
        tokio::select! {
            r = fut => Some(r),
            _ = self.stopped() => None,
        }
    }

    pub(super) fn add_compute_thread(&self, t: std::thread::JoinHandle<()>) {
        let mut threads = self.compute.lock().unwrap_or_else(|e| e.into_inner());
        threads.retain(|t| !t.is_finished());
        threads.push(t);
    }
}
