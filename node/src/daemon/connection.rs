//! One accepted connection: the handshake, then by role; the coordinator's control
//! connection (the coordinator slot, its writer, its end at shutdown).

use super::control::control_loop;
use super::data::data_conn;
use super::state::{Holder, Node, Outgoing};
use super::status::monitor_conn;
use super::{
    COORDINATOR_SILENCE, HANDSHAKE_TIMEOUT, MAX_PAYLOAD, SHUTDOWN_WAIT, STEP_WAIT, TAKEOVER_WAIT,
};
use ringllm_protocol::control::{Control, ErrorCode, ErrorMsg};
use ringllm_protocol::control_conn;
use ringllm_protocol::untrusted::escape;
use ringllm_protocol::{Link, Role};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

/// One accepted TCP connection: authenticates it, then serves it by role.
pub(super) async fn connection(
    node: Arc<Node>,
    mut stream: tokio::net::TcpStream,
    peer: SocketAddr,
) {
    let handshake = control_conn::accept_stream(
        &mut stream,
        &node.opts.key,
        &node.opts.name,
        HANDSHAKE_TIMEOUT,
    );
    let session = match node.until_stopped(handshake).await {
        None => return,
        Some(Ok(s)) => s,
        // Connected and closed without a byte: a reachability probe (`up` waiting for its
        // nodes, a monitor), not a fault worth a warning after every run.
        Some(Err(e)) if e.is_closed() => {
            debug!("connection from {peer} closed before its handshake");
            return;
        }
        // Anyone can cause these, as fast as they can connect: a few are logged in full,
        // the rest counted (`refusals`).
        Some(Err(e)) => {
            node.refusals.refused(Some(peer.ip()), || {
                format!("refused connection from {peer}: {e}")
            });
            return;
        }
    };
    let conn_id = node.next_conn.fetch_add(1, Ordering::Relaxed);
    match session.peer.role {
        Role::Coordinator => {
            let link = control_conn::link_from(stream, session, peer.to_string(), MAX_PAYLOAD);
            coordinator_conn(node, link, conn_id).await
        }
        Role::Upstream => {
            let link = data_conn(Arc::clone(&node), stream, session, peer);
            let _ = node.until_stopped(link).await;
        }
        Role::Monitor => {
            let link = control_conn::link_from(stream, session, peer.to_string(), MAX_PAYLOAD);
            let _ = node.until_stopped(monitor_conn(&node, link)).await;
        }
        Role::Node => {
            warn!("refused connection from {peer}: a node answering, not connecting")
        }
    }
}

/// An `Error` message, framed (`None` if it cannot be encoded).
pub(super) fn error_frame(code: ErrorCode, seq: Option<u64>, message: String) -> Option<Outgoing> {
    Control::Error(ErrorMsg { code, seq, message })
        .to_frame()
        .ok()
}

/// Spawns a task that writes every queued frame to `tx`; returns the queue, and the task,
/// which ends once every sender of the queue is gone and the queue is written.
fn spawn_writer(
    mut tx: Box<dyn ringllm_protocol::FrameSender>,
    what: String,
    on_error: Option<(mpsc::Sender<Outgoing>, String)>,
) -> (mpsc::Sender<Outgoing>, tokio::task::JoinHandle<()>) {
    let (qtx, mut qrx) = mpsc::channel::<Outgoing>(256);
    let task = tokio::spawn(async move {
        while let Some((h, p)) = qrx.recv().await {
            if let Err(e) = tx.send(&h, &p).await {
                warn!("{what}: send failed: {e}");
                if let Some((coord, msg)) = &on_error {
                    if let Some(f) = error_frame(
                        ErrorCode::NextHopUnreachable,
                        Some(h.seq),
                        format!("{msg}: {e}"),
                    ) {
                        let _ = coord.send(f).await;
                    }
                }
                break;
            }
        }
    });
    (qtx, task)
}

/// Queues `msg` for the writer (a message that cannot be encoded is logged and dropped).
pub(super) async fn queue_control(q: &mpsc::Sender<Outgoing>, msg: Control) {
    match msg.to_frame() {
        Ok(f) => {
            let _ = q.send(f).await;
        }
        Err(e) => warn!("cannot encode {}: {e}", msg.name()),
    }
}

/// The coordinator's control connection: claims the coordinator slot, sends the node's
/// capabilities, serves control messages until the coordinator leaves or the daemon shuts
/// down, and ends the session.
async fn coordinator_conn(node: Arc<Node>, link: Link, conn_id: u64) {
    let who = format!(
        "coordinator '{}' ({})",
        escape(&link.session.peer.name),
        link.peer_addr
    );
    let named = (link.session.peer.name.clone(), link.peer_addr.clone());
    let Link { tx, mut rx, .. } = link;
    let (out, writer) = spawn_writer(tx, who.clone(), None);
    // `None`: shutting down; `Some(None)`: refused as busy (and told so).
    if let Some(Some(slot)) = node
        .until_stopped(claim_slot(&node, conn_id, &who, named, &out))
        .await
    {
        queue_control(&out, Control::Capabilities(node.caps.clone())).await;
        let served = control_loop(&node, &who, &mut rx, &out, conn_id);
        if node.until_stopped(served).await.is_none() {
            info!("{who}: shutting down");
            let reason = format!("node '{}' is shutting down", node.opts.name);
            queue_control(&out, Control::Shutdown { reason }).await;
            end_between_steps(&node, &who, conn_id, slot).await;
        } else {
            // Ends the session: its compute thread, which holds a sender of `out`, stops.
            drop(slot);
        }
    }
    drop(out);
    // Everything queued (a refusal, the shutdown notice) is written before the connection
    // closes.
    if tokio::time::timeout(SHUTDOWN_WAIT, writer).await.is_err() {
        warn!("{who}: the last messages were not written within {SHUTDOWN_WAIT:?}");
    }
}

/// At shutdown, once the coordinator has heard why: lets the step under way finish, then
/// ends the session (dropping `slot`), so its links close between steps.
async fn end_between_steps(node: &Node, who: &str, conn_id: u64, slot: SlotGuard) {
    let step =
        node.lock().session.as_ref().and_then(|s| {
            (s.conn_id == conn_id).then(|| (Arc::clone(&s.step), Arc::clone(&s.stop)))
        });
    let Some((step, stop)) = step else {
        drop(slot);
        return;
    };
    let name = node.opts.name.clone();
    let ended = tokio::task::spawn_blocking(move || {
        // No new step starts once `stop` is set.
        stop.store(true, Ordering::SeqCst);
        let held = lock_within(&step, STEP_WAIT);
        if held.is_none() {
            warn!(
                "node '{name}': the step under way did not finish within \
                 {STEP_WAIT:?}; closing its links anyway"
            );
        }
        // Ends the session (its links close) while no step runs.
        drop(slot);
        drop(held);
    })
    .await;
    if let Err(e) = ended {
        warn!("{who}: ending the session failed: {e}");
    }
    info!("{who}: links closed between steps");
}

/// Takes `m` within `wait` (polling: shutdown only), or `None`.
fn lock_within(m: &Mutex<()>, wait: Duration) -> Option<std::sync::MutexGuard<'_, ()>> {
    let deadline = Instant::now() + wait;
    loop {
        match m.try_lock() {
            Ok(g) => return Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => {}
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Takes the coordinator slot for connection `conn_id`: one coordinator at a time, so wait
/// (up to `TAKEOVER_WAIT`) for the previous connection to go away. `None`: still busy, and
/// the coordinator was told.
async fn claim_slot(
    node: &Arc<Node>,
    conn_id: u64,
    who: &str,
    (name, address): (String, String),
    out: &mpsc::Sender<Outgoing>,
) -> Option<SlotGuard> {
    let deadline = Instant::now() + TAKEOVER_WAIT;
    let mut waiting: Option<Waiting> = None;
    loop {
        let notified = node.changed.notified();
        let busy = {
            let mut st = node.lock();
            match &st.coordinator {
                None => {
                    st.coordinator = Some(Holder {
                        conn_id,
                        who: who.to_string(),
                        name: name.clone(),
                        address: address.clone(),
                        since: Instant::now(),
                    });
                    None
                }
                Some(h) => Some(format!(
                    "{}, busy for {:.0} s",
                    h.who,
                    h.since.elapsed().as_secs_f64()
                )),
            }
        };
        let Some(busy) = busy else {
            drop(waiting);
            info!("serving {who}");
            return Some(SlotGuard {
                node: Arc::clone(node),
                conn_id,
            });
        };
        if Instant::now() >= deadline {
            warn!("refused {who}: still serving {busy}");
            if let Some(f) = error_frame(
                ErrorCode::Busy,
                None,
                format!(
                    "node '{}' ({}) is serving {busy}; stop that coordinator first (a \
                     coordinator silent for {} s is dropped)",
                    node.opts.name,
                    node.addr,
                    COORDINATOR_SILENCE.as_secs()
                ),
            ) {
                let _ = out.send(f).await;
            }
            return None;
        }
        if waiting.is_none() {
            waiting = Some(Waiting::new(node));
        }
        tokio::select! {
            _ = notified => {}
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
}

/// A coordinator waiting for the slot, counted in `State::waiting` while it lives (also when
/// its task is dropped at shutdown).
struct Waiting {
    node: Arc<Node>,
}

impl Waiting {
    fn new(node: &Arc<Node>) -> Waiting {
        node.lock().waiting += 1;
        Waiting {
            node: Arc::clone(node),
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut st = self.node.lock();
        st.waiting = st.waiting.saturating_sub(1);
    }
}

/// Frees the coordinator slot (and its session) when the connection task ends.
struct SlotGuard {
    node: Arc<Node>,
    conn_id: u64,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let mut st = self.node.lock();
        if st
            .coordinator
            .as_ref()
            .is_some_and(|c| c.conn_id == self.conn_id)
        {
            st.coordinator = None;
        }
        if st
            .session
            .as_ref()
            .is_some_and(|s| s.conn_id == self.conn_id)
        {
            st.session = None; // its compute thread ends as its links close
        }
        drop(st);
        self.node.changed.notify_waiters();
    }
}
