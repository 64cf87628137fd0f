//! The coordinator's control messages: `control_loop` receives and dispatches, and each
//! message has its handler on [`Served`].

use super::assign::assign;
use super::connection::{error_frame, queue_control};
use super::slices;
use super::state::{Node, Outgoing};
use super::status::node_stats;
use super::{COORDINATOR_SETUP_SILENCE, COORDINATOR_SILENCE};
use ringllm_protocol::control::{Assignment, Control, ErrorCode, ErrorMsg, SliceKey, SliceOffer};
use ringllm_protocol::control_conn::control_of;
use ringllm_protocol::frame::SLICE_PROBE;
use ringllm_protocol::{FrameHeader, FrameKind, FrameReceiver, TransportError};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

/// How often a coordinator's silence is held against the limit of the moment (which drops
/// to `COORDINATOR_SILENCE` when another coordinator comes to wait for the node).
const WAITING_POLL: Duration = Duration::from_millis(200);

/// Whether the control loop goes on after a message.
enum Flow {
    Go,
    Stop,
}

/// A coordinator's control connection while it holds the coordinator slot.
struct Served<'a> {
    node: &'a Arc<Node>,
    /// "coordinator 'name' (address)", for messages.
    who: &'a str,
    /// The connection's writer queue.
    out: &'a mpsc::Sender<Outgoing>,
    conn_id: u64,
    /// A slice arriving from this coordinator.
    receiving: Option<slices::Receiving>,
    /// The slices it sent (or offered and found here) checked, ready for its assignment.
    checked: Vec<(SliceKey, PathBuf)>,
}

/// Answers the coordinator's control messages until it closes the connection, ends the
/// session or sends something unreadable.
pub(super) async fn control_loop(
    node: &Arc<Node>,
    who: &str,
    rx: &mut Box<dyn FrameReceiver>,
    out: &mpsc::Sender<Outgoing>,
    conn_id: u64,
) {
    let mut served = Served {
        node,
        who,
        out,
        conn_id,
        receiving: None,
        checked: Vec::new(),
    };
    let mut buf = Vec::new();
    loop {
        let Some(h) = served.receive(rx, &mut buf).await else {
            break;
        };
        let flow = match h.kind {
            FrameKind::Control => served.on_control(&h, &buf).await,
            // A link-speed probe (`ringllm plan`): read and dropped.
            FrameKind::Slice if h.seq == SLICE_PROBE => Flow::Go,
            FrameKind::Slice => served.on_slice_data(h.seq, &buf).await,
            FrameKind::Hidden | FrameKind::Logits => served.on_data_frame(h.seq).await,
        };
        if let Flow::Stop = flow {
            break;
        }
    }
    if let Some(r) = served.receiving.filter(|r| r.expecting()) {
        r.log_cut();
    }
}

impl Served<'_> {
    /// Sends an `Error` message straight to the writer.
    async fn send_error(&self, code: ErrorCode, seq: Option<u64>, message: String) {
        if let Some(f) = error_frame(code, seq, message) {
            let _ = self.out.send(f).await;
        }
    }

    /// The next frame, or `None` once the coordinator has closed the connection, gone silent
    /// for too long or broken it (it is told why when it can be).
    ///
    /// Too long is `COORDINATOR_SILENCE` in a session, mid-transfer, or before its session
    /// while another coordinator waits for the node (what the waiting one is told); before
    /// its session and unopposed, a coordinator may plan for `COORDINATOR_SETUP_SILENCE`.
    async fn receive(
        &self,
        rx: &mut Box<dyn FrameReceiver>,
        buf: &mut Vec<u8>,
    ) -> Option<FrameHeader> {
        let in_session = self
            .node
            .lock()
            .session
            .as_ref()
            .is_some_and(|s| s.conn_id == self.conn_id);
        // Mid-transfer the coordinator sends without pause: silence means it is gone.
        let expecting = self.receiving.as_ref().is_some_and(|r| r.expecting());
        let since = Instant::now();
        let recv = rx.recv(buf);
        tokio::pin!(recv);
        let received = loop {
            let wanted = self.node.lock().waiting > 0;
            let limit = if in_session || expecting || wanted {
                COORDINATOR_SILENCE
            } else {
                COORDINATOR_SETUP_SILENCE
            };
            let left = limit.saturating_sub(since.elapsed());
            if left.is_zero() {
                self.drop_silent(limit, wanted && !in_session && !expecting)
                    .await;
                return None;
            }
            // The same read is polled on (a frame half read is not lost); the limit is
            // looked at again now and then, as coordinators come to wait.
            tokio::select! {
                r = &mut recv => break r,
                _ = tokio::time::sleep(left.min(WAITING_POLL)) => {}
            }
        };
        match received {
            Ok(h) => Some(h),
            Err(TransportError::Closed) => {
                info!("{} closed the connection", self.who);
                None
            }
            Err(e) => {
                warn!("{}: {e}; closing", self.who);
                self.send_error(ErrorCode::BadRequest, None, e.to_string())
                    .await;
                None
            }
        }
    }

    /// Tells a coordinator silent for `limit` that it is dropped (`wanted`: before its
    /// session, because another coordinator waits for the node).
    async fn drop_silent(&self, limit: Duration, wanted: bool) {
        let (who, secs) = (self.who, limit.as_secs());
        let why = if wanted {
            " while another coordinator waited for the node"
        } else {
            ""
        };
        warn!(
            "{who}: nothing heard for {secs} s{why} (process stopped, link cut or a stalled \
             frame); dropping it so another coordinator can take the node"
        );
        let m = format!(
            "node '{}' heard nothing from this coordinator for {secs} s{why} and dropped it",
            self.node.opts.name
        );
        self.send_error(ErrorCode::BadRequest, None, m).await;
    }

    /// A control message: decoded, then handed to its handler.
    async fn on_control(&mut self, h: &FrameHeader, buf: &[u8]) -> Flow {
        let msg = match control_of(h, buf) {
            Ok(m) => m,
            Err(e) => {
                warn!("{}: {e}", self.who);
                self.send_error(ErrorCode::BadRequest, None, e.to_string())
                    .await;
                return Flow::Go;
            }
        };
        debug!("{}: {}", self.who, msg.name());
        match msg {
            Control::Assign(a) => self.on_assign(a).await,
            Control::Heartbeat {
                nonce,
                reply: false,
            } => self.on_heartbeat(nonce).await,
            Control::Heartbeat { reply: true, .. } => {}
            Control::GetStats => self.on_get_stats().await,
            Control::ReleaseSequence { seq } => self.on_release_sequence(seq).await,
            Control::Shutdown { reason } => return self.on_shutdown(&reason),
            Control::SliceOffer(offer) => self.on_slice_offer(offer).await,
            other => self.on_unexpected(&other).await,
        }
        Flow::Go
    }

    /// `Assign`: loads the stage and answers `Ready`, or why not.
    async fn on_assign(&mut self, a: Assignment) {
        let reply = match assign(self.node, a, self.conn_id, self.out.clone(), &self.checked).await
        {
            Ok(r) => Control::Ready(r),
            Err(e) => {
                warn!("assignment failed: {e}");
                Control::Error(ErrorMsg {
                    code: e.code(),
                    seq: None,
                    message: e.to_string(),
                })
            }
        };
        queue_control(self.out, reply).await;
    }

    /// A heartbeat asking for a reply.
    async fn on_heartbeat(&self, nonce: u64) {
        queue_control(self.out, Control::Heartbeat { nonce, reply: true }).await;
    }

    /// `GetStats`: the session's counters.
    async fn on_get_stats(&self) {
        let stats = node_stats(self.node);
        queue_control(self.out, Control::Stats(stats)).await;
    }

    /// `ReleaseSequence`: the sequence's caches are cleared before the session's next batch.
    /// A sequence beyond the session's slots has no cache, and is refused rather than listed
    /// (a coordinator repeating releases between batches must not grow the list without end).
    async fn on_release_sequence(&self, seq: u64) {
        let beyond = {
            let st = self.node.lock();
            let Some(s) = st.session.as_ref().filter(|s| s.conn_id == self.conn_id) else {
                return;
            };
            if seq < s.slots as u64 {
                let mut release = s.release.lock().unwrap_or_else(|e| e.into_inner());
                if !release.contains(&seq) {
                    release.push(seq);
                }
                None
            } else {
                Some(s.slots)
            }
        };
        if let Some(slots) = beyond {
            let m = format!(
                "node '{}': release of sequence {seq}, beyond the {slots} slots assigned",
                self.node.opts.name
            );
            warn!("{}: {m}", self.who);
            self.send_error(ErrorCode::BadRequest, Some(seq), m).await;
        }
    }

    /// `Shutdown` from the coordinator: the session ends with the loop.
    fn on_shutdown(&self, reason: &str) -> Flow {
        info!("{} ended the session: {reason}", self.who);
        Flow::Stop
    }

    /// `SliceOffer`: answers which pieces this node needs (none when its cache holds them).
    async fn on_slice_offer(&mut self, offer: SliceOffer) {
        // A new offer replaces a transfer in progress (its `.part` stays).
        self.receiving = None;
        let (name, cache) = (
            self.node.opts.name.clone(),
            self.node.opts.cache_dir.clone(),
        );
        let key = offer.key.clone();
        let prepared =
            tokio::task::spawn_blocking(move || slices::prepare(&name, &cache, offer)).await;
        let reply = match prepared {
            Ok(Ok(p)) => {
                if let Some(path) = p.ready {
                    self.check_in(key, path);
                }
                self.receiving = p.receiving;
                Control::SliceNeed(p.need)
            }
            Ok(Err(e)) => {
                warn!("{}: {e}", self.who);
                Control::Error(ErrorMsg {
                    code: slice_error_code(&e),
                    seq: None,
                    message: e.to_string(),
                })
            }
            Err(e) => Control::Error(ErrorMsg {
                code: ErrorCode::Internal,
                seq: None,
                message: format!("node '{}': {e}", self.node.opts.name),
            }),
        };
        queue_control(self.out, reply).await;
    }

    /// A message a coordinator does not send.
    async fn on_unexpected(&self, other: &Control) {
        let m = format!("unexpected {} message from a coordinator", other.name());
        warn!("{}: {m}", self.who);
        let reply = Control::Error(ErrorMsg {
            code: ErrorCode::BadRequest,
            seq: None,
            message: m,
        });
        queue_control(self.out, reply).await;
    }

    /// A piece of the slice being received.
    async fn on_slice_data(&mut self, seq: u64, buf: &[u8]) -> Flow {
        let Some(r) = self.receiving.as_mut() else {
            let m = format!(
                "node '{}' got slice data without an offer",
                self.node.opts.name
            );
            warn!("{}: {m}", self.who);
            self.send_error(ErrorCode::BadRequest, None, m).await;
            return Flow::Stop;
        };
        match r.on_frame(seq, buf) {
            Ok(slices::Step::More(None)) => {}
            Ok(slices::Step::More(Some(p))) => {
                queue_control(self.out, Control::SliceProgress(p)).await
            }
            Ok(slices::Step::Done { progress, path }) => {
                if let Some(path) = path {
                    let key = r.key().clone();
                    self.check_in(key, path);
                    self.receiving = None;
                }
                queue_control(self.out, Control::SliceProgress(progress)).await;
            }
            Err(e) => {
                warn!("{}: {e}", self.who);
                self.receiving = None;
                self.send_error(slice_error_code(&e), None, e.to_string())
                    .await;
            }
        }
        Flow::Go
    }

    /// A data frame on the control connection: refused (data travels on data links).
    async fn on_data_frame(&self, seq: u64) -> Flow {
        let m = format!(
            "node '{}' got a data frame on the control connection (data travels on its own link)",
            self.node.opts.name
        );
        warn!("{}: {m}", self.who);
        self.send_error(ErrorCode::BadRequest, Some(seq), m).await;
        Flow::Go
    }

    /// Records a checked slice for this coordinator's assignments (replacing one of the same
    /// key).
    fn check_in(&mut self, key: SliceKey, path: PathBuf) {
        self.checked.retain(|(k, _)| *k != key);
        self.checked.push((key, path));
    }
}

/// How a slice error is reported to the coordinator.
fn slice_error_code(e: &slices::SliceError) -> ErrorCode {
    match e {
        slices::SliceError::BadOffer { .. } => ErrorCode::BadRequest,
        _ => ErrorCode::CacheFull,
    }
}
