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

mod error;
pub mod slices;
mod worker;

pub use error::{AssignError, DaemonError, StageError};
use worker::{Attached, SessionStats, Worker};

use ringllm_model::gguf::GgufFile;
use ringllm_model::model::{LoadOptions, Model};
use ringllm_model::slice::model_identity;
use ringllm_model::stream::{StreamMode, StreamSettings, Streamer};
use ringllm_model::{limits, sys};
use ringllm_model::{KvCache, KvType, Runner};
use ringllm_protocol::control::{
    Assignment, Capabilities, Control, ErrorCode, ErrorMsg, Holder as StatusHolder, ModelIdentity,
    NextHop, NodeStatus, Ready, SliceKey, StageLayout, StageStatus, Stats,
};
use ringllm_protocol::control_conn::{self, control_of};
use ringllm_protocol::dial::{self, AttachInfo, BoxLink};
use ringllm_protocol::frame::SLICE_PROBE;
use ringllm_protocol::QuicServer;
use ringllm_protocol::{
    ClusterKey, Dtype, FrameHeader, FrameKind, Link, LinkCloser, Role, TransportError,
    TransportKind,
};
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

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
    /// machine and its cgroup leave ([`limits::budget`]). `None`: no cap of its own.
    pub memory: Option<u64>,
    /// Repack weights into panels at load where the kernels read them
    /// ([`ringllm_model::LoadOptions::repack`]); `--no-repack` turns it off for this node.
    pub repack: bool,
    /// `--stream`, `--prefetch`: layers streamed from disk when they do not fit.
    pub stream: StreamSettings,
    /// `--backend`: what runs the layers of an assignment.
    pub backend: ringllm_model::BackendChoice,
}

type Outgoing = (FrameHeader, Vec<u8>);

/// The node's side of a running assignment; dropping it ends the session (its compute thread
/// sees `stop`, or its links close under it).
struct SessionHandle {
    /// The ring session the coordinator named.
    id: u64,
    /// The control connection that made the assignment.
    conn_id: u64,
    /// Hands the compute thread its data links as they attach.
    attach: std::sync::mpsc::Sender<Attached>,
    stats: Arc<SessionStats>,
    stop: Arc<AtomicBool>,
    /// Closers of the session's data links: dropping the session unblocks its thread.
    closers: Arc<Mutex<Vec<LinkCloser>>>,
    /// Sequences the coordinator released since the last batch (their caches are cleared
    /// before the next one).
    release: Arc<Mutex<Vec<u64>>>,
    /// The session's streamed layers, for their counters.
    streamer: Option<Arc<Streamer>>,
    /// Held by the compute thread through each step (from a batch's first frame to its last
    /// result sent): shutdown takes it before closing the links, so a step under way is
    /// finished and no half-sent frame is left on a link.
    step: Arc<Mutex<()>>,
    /// What the stage runs, for status queries.
    info: StageStatus,
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
struct State {
    /// The coordinator being served.
    coordinator: Option<Holder>,
    session: Option<SessionHandle>,
    /// The last model file opened, kept mapped for the next assignment.
    cache: Option<(ModelIdentity, Arc<GgufFile>)>,
}

/// Who holds a node's coordinator slot.
struct Holder {
    conn_id: u64,
    /// "coordinator 'name' (address)".
    who: String,
    /// The name from its handshake and its address, for status queries.
    name: String,
    address: String,
    since: Instant,
}

/// Counters of the current session sampled about once a second, and the rates between the
/// last two samples (status queries report them).
#[derive(Default)]
struct Rates {
    last: Option<(Instant, u64, [u64; 3])>,
    per_s: [f64; 3],
}

struct Node {
    opts: NodeOptions,
    /// The address this node listens on, for messages.
    addr: SocketAddr,
    caps: Capabilities,
    state: Mutex<State>,
    changed: Notify,
    next_conn: AtomicU64,
    /// Becomes `true` once, when the daemon shuts down.
    stopping: watch::Sender<bool>,
    /// Compute threads started, joined at shutdown (finished ones are dropped as new ones
    /// start).
    compute: Mutex<Vec<std::thread::JoinHandle<()>>>,
    started: Instant,
    /// Bytes in, bytes out and tokens per second lately.
    rates: Mutex<Rates>,
}

impl Node {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind; keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resolves once the daemon is shutting down.
    async fn stopped(&self) {
        let mut rx = self.stopping.subscribe();
        // The sender lives in `self`: `wait_for` cannot fail while we are borrowed.
        let _ = rx.wait_for(|stop| *stop).await;
    }

    /// Runs `fut` unless the daemon shuts down first (then `None`; `fut` is dropped).
    async fn until_stopped<T>(&self, fut: impl Future<Output = T>) -> Option<T> {
        tokio::select! {
            r = fut => Some(r),
            _ = self.stopped() => None,
        }
    }

    fn add_compute_thread(&self, t: std::thread::JoinHandle<()>) {
        let mut threads = self.compute.lock().unwrap_or_else(|e| e.into_inner());
        threads.retain(|t| !t.is_finished());
        threads.push(t);
    }
}

/// The sockets a node serves on: a TCP listener (handshakes, the coordinator's control
/// connection, TCP and io_uring data links, the anchors of reliable UDP links, whose
/// datagrams use the UDP port of the same number) and, when data links travel over QUIC, a
/// QUIC endpoint on the UDP port of the listener's number.
pub struct Listener {
    tcp: TcpListener,
    quic: Option<QuicServer>,
}

impl Listener {
    /// Takes a bound TCP listener; for `--transport quic`, binds the QUIC endpoint on the UDP
    /// port of its number (so a listener bound to port 0 gets one port for both). Call it
    /// inside a tokio runtime.
    pub fn new(tcp: TcpListener, opts: &NodeOptions) -> Result<Listener, DaemonError> {
        let quic = match opts.transport {
            TransportKind::Quic => {
                let addr = tcp.local_addr().map_err(DaemonError::LocalAddr)?;
                Some(
                    QuicServer::bind(addr, &opts.key, &opts.name)
                        .map_err(|source| DaemonError::Quic { addr, source })?,
                )
            }
            TransportKind::Tcp
            | TransportKind::Udp
            | TransportKind::Uring
            | TransportKind::Kmod => None,
        };
        Ok(Listener { tcp, quic })
    }

    /// The TCP address the node serves on.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.local_addr()
    }
}

/// The read rate of the largest model or slice file under `dirs` (page cache bypassed), for
/// the planner's streaming plans; 0 when there is none or it cannot be read.
fn disk_read_rate(dirs: &[&Path]) -> f64 {
    let mut best: Option<(u64, PathBuf)> = None;
    let mut visit = |p: PathBuf| {
        if let Ok(m) = std::fs::metadata(&p) {
            if m.is_file() && best.as_ref().is_none_or(|b| m.len() > b.0) {
                best = Some((m.len(), p));
            }
        }
    };
    for d in dirs {
        let Ok(rd) = std::fs::read_dir(d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                // Slices live one level down.
                for e2 in std::fs::read_dir(&p).into_iter().flatten().flatten() {
                    visit(e2.path());
                }
            } else {
                visit(p);
            }
        }
    }
    let Some((len, path)) = best else {
        return 0.0;
    };
    // From a quarter in (the start is the header, likely cached anyway); 256 MiB, so that a
    // throttled or bursty device shows its sustained rate.
    ringllm_model::stream::measure_read_rate(&path, len / 4, 256 << 20)
        .or_else(|_| ringllm_model::stream::measure_read_rate(&path, 0, 256 << 20))
        .unwrap_or(0.0)
}

fn scan_models(dir: &Path) -> Vec<ModelIdentity> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        warn!(dir = %dir.display(), "models directory is not readable");
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let p = e.path();
        if p.extension().and_then(|s| s.to_str()) != Some("gguf") {
            continue;
        }
        match GgufFile::open_lean(&p) {
            Ok(f) => out.push(model_identity(&p, &f)),
            Err(err) => warn!(file = %p.display(), "skipping unreadable model: {err}"),
        }
    }
    out.sort_by(|a, b| a.file_name.cmp(&b.file_name));
    out
}

/// Serves on `listener` until `shutdown` resolves, then stops accepting, tells a connected
/// coordinator, ends the session, waits for the connection tasks and compute threads, and
/// returns. Fails only at start-up (a listener without the QUIC endpoint its transport needs,
/// a failed start-up probe); a peer's error is logged (and answered) and the node serves on.
pub async fn serve(
    listener: Listener,
    opts: NodeOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), DaemonError> {
    let addr = listener.local_addr().map_err(DaemonError::LocalAddr)?;
    let Listener { tcp, quic } = listener;
    if opts.transport == TransportKind::Quic && quic.is_none() {
        return Err(DaemonError::NoQuicEndpoint {
            node: opts.name,
            transport: opts.transport,
        });
    }
    let threads = opts.threads.max(1);
    let dir = opts.models_dir.clone();
    let cache = opts.cache_dir.clone();
    let (speed, models, disk) = tokio::task::spawn_blocking(move || {
        (
            sys::matvec_speed(threads, Duration::from_millis(200)),
            scan_models(&dir),
            disk_read_rate(&[&dir, &cache]),
        )
    })
    .await
    .map_err(DaemonError::Probe)?;
    // A GPU backend is opened once now: a node asked for one that has none refuses to start,
    // and the planner gets the GPU's measured speed instead of the CPU's.
    let choice = opts.backend;
    let gpu = tokio::task::spawn_blocking(move || ringllm_model::backend::probe(choice))
        .await
        .map_err(DaemonError::Probe)?
        .map_err(|e| DaemonError::Backend(e.to_string()))?;
    let (backend, speed) = match gpu {
        Some((name, gpu_speed)) => (name, gpu_speed),
        None => ("cpu".to_string(), speed),
    };
    let (total, avail) = sys::memory();
    // What the planner may use here: --memory, MemAvailable and the cgroup limits, whichever
    // is smallest.
    let budget = limits::budget(opts.memory).unwrap_or(avail);
    let caps = Capabilities {
        node_name: opts.name.clone(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        memory_total: total,
        memory_available: budget,
        threads: threads as u32,
        cpu_features: sys::cpu_features(),
        isa: ringllm_kernels::isa().name().to_string(),
        matvec_bytes_per_s: speed,
        models,
        transport: opts.transport,
        disk_read_bytes_per_s: disk,
        backend,
    };
    info!(
        backend = %caps.backend,
        speed_gbs = speed / 1e9,
        models = caps.models.len(),
        budget_mib = budget >> 20,
        "node ready"
    );
    let node = Arc::new(Node {
        opts,
        addr,
        caps,
        state: Mutex::new(State::default()),
        changed: Notify::new(),
        next_conn: AtomicU64::new(1),
        stopping: watch::Sender::new(false),
        compute: Mutex::new(Vec::new()),
        started: Instant::now(),
        rates: Mutex::new(Rates::default()),
    });
    let mut tasks = JoinSet::new();
    tasks.spawn(sample_rates(Arc::clone(&node)));
    if let Some(q) = quic {
        tasks.spawn(quic_accept_loop(Arc::clone(&node), q));
    }
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            biased;
            _ = &mut shutdown => break,
            accepted = tcp.accept() => match accepted {
                Ok((stream, peer)) => {
                    tasks.spawn(connection(Arc::clone(&node), stream, peer));
                }
                Err(e) => {
                    warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            // Reap finished connection tasks as they end.
            Some(_) = tasks.join_next() => {}
        }
    }
    drop(tcp);
    info!("node '{}' shutting down", node.opts.name);
    node.stopping.send_replace(true);
    node.changed.notify_waiters();
    let drained = tokio::time::timeout(STEP_WAIT + SHUTDOWN_WAIT, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        warn!(
            "{} connection task(s) still running after {:?}; abandoning them",
            tasks.len(),
            STEP_WAIT + SHUTDOWN_WAIT
        );
        tasks.abort_all();
    }
    // Every connection has ended its session; a session left by an aborted task ends here.
    let left = node.lock().session.take();
    drop(left);
    join_compute_threads(&node).await;
    info!("node '{}' stopped", node.opts.name);
    Ok(())
}

/// Waits (up to `SHUTDOWN_WAIT`) for the compute threads, which end once their session's
/// links are closed, and joins them.
async fn join_compute_threads(node: &Node) {
    let threads = std::mem::take(&mut *node.compute.lock().unwrap_or_else(|e| e.into_inner()));
    let deadline = Instant::now() + SHUTDOWN_WAIT;
    while threads.iter().any(|t| !t.is_finished()) {
        if Instant::now() >= deadline {
            warn!("a compute thread is still running after {SHUTDOWN_WAIT:?}; not waiting for it");
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for t in threads {
        if t.join().is_err() {
            warn!("a compute thread had panicked");
        }
    }
}

/// One accepted TCP connection: authenticates it, then serves it by role.
async fn connection(node: Arc<Node>, mut stream: tokio::net::TcpStream, peer: SocketAddr) {
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
        Some(Err(e)) => {
            warn!("refused connection from {peer}: {e}");
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

/// Longest silence on a status connection before the node closes it (`status --watch`
/// asks every few seconds).
pub const MONITOR_SILENCE: Duration = Duration::from_secs(120);

/// A status connection (`Role::Monitor`): answers `GetStatus` (and heartbeats) until the
/// peer closes it, goes silent or sends anything else. It never touches the coordinator slot.
async fn monitor_conn(node: &Arc<Node>, link: Link) {
    let who = format!("monitor '{}' ({})", link.session.peer.name, link.peer_addr);
    debug!("{who}: connected");
    let Link { mut tx, mut rx, .. } = link;
    let mut buf = Vec::new();
    loop {
        let h = match tokio::time::timeout(MONITOR_SILENCE, rx.recv(&mut buf)).await {
            Err(_) => {
                debug!("{who}: silent for {} s; closing", MONITOR_SILENCE.as_secs());
                return;
            }
            Ok(Err(TransportError::Closed)) => return,
            Ok(Err(e)) => {
                warn!("{who}: {e}; closing");
                return;
            }
            Ok(Ok(h)) => h,
        };
        let reply = match control_of(&h, &buf) {
            Ok(Control::GetStatus) => Control::Status(Box::new(node_status(node))),
            Ok(Control::Heartbeat {
                nonce,
                reply: false,
            }) => Control::Heartbeat { nonce, reply: true },
            Ok(other) => {
                let m = format!(
                    "a status connection takes get-status only, not {}",
                    other.name()
                );
                warn!("{who}: {m}");
                Control::Error(ErrorMsg {
                    code: ErrorCode::BadRequest,
                    seq: None,
                    message: m,
                })
            }
            Err(e) => {
                warn!("{who}: {e}");
                Control::Error(ErrorMsg {
                    code: ErrorCode::BadRequest,
                    seq: None,
                    message: e.to_string(),
                })
            }
        };
        let bad = matches!(reply, Control::Error(_));
        if let Err(e) = control_conn::send_control(tx.as_mut(), &reply).await {
            debug!("{who}: {e}");
            return;
        }
        if bad {
            return;
        }
    }
}

/// Samples the session's counters every second into `node.rates`.
async fn sample_rates(node: Arc<Node>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = node.stopped() => return,
        }
        let now = Instant::now();
        let sample = {
            let st = node.lock();
            st.session.as_ref().map(|s| {
                let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
                (
                    s.id,
                    [
                        g(&s.stats.bytes_in),
                        g(&s.stats.bytes_out),
                        g(&s.stats.tokens),
                    ],
                )
            })
        };
        let mut r = node.rates.lock().unwrap_or_else(|e| e.into_inner());
        match sample {
            None => *r = Rates::default(),
            Some((id, counts)) => {
                r.per_s = match r.last {
                    Some((t, last_id, last)) if last_id == id => {
                        let dt = now.duration_since(t).as_secs_f64().max(1e-3);
                        std::array::from_fn(|i| counts[i].saturating_sub(last[i]) as f64 / dt)
                    }
                    _ => [0.0; 3],
                };
                r.last = Some((now, id, counts));
            }
        }
    }
}

/// The node's answer to a status query.
fn node_status(node: &Node) -> NodeStatus {
    let stats = node_stats(node);
    let (coordinator, stage) = {
        let st = node.lock();
        (
            st.coordinator.as_ref().map(|h| StatusHolder {
                name: h.name.clone(),
                address: h.address.clone(),
                held_ms: h.since.elapsed().as_millis() as u64,
            }),
            st.session.as_ref().map(|s| s.info.clone()),
        )
    };
    let per_s = node.rates.lock().unwrap_or_else(|e| e.into_inner()).per_s;
    let c = &node.caps;
    NodeStatus {
        node_name: node.opts.name.clone(),
        version: c.version.clone(),
        listen: node.addr.to_string(),
        transport: c.transport,
        threads: c.threads,
        isa: c.isa.clone(),
        memory_total: c.memory_total,
        memory_budget: c.memory_available,
        matvec_bytes_per_s: c.matvec_bytes_per_s,
        disk_read_bytes_per_s: c.disk_read_bytes_per_s,
        uptime_ms: node.started.elapsed().as_millis() as u64,
        coordinator,
        stage,
        stats,
        bytes_in_per_s: per_s[0],
        bytes_out_per_s: per_s[1],
        tokens_per_s: per_s[2],
    }
}

fn error_frame(code: ErrorCode, seq: Option<u64>, message: String) -> Option<Outgoing> {
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

async fn queue_control(q: &mpsc::Sender<Outgoing>, msg: Control) {
    match msg.to_frame() {
        Ok(f) => {
            let _ = q.send(f).await;
        }
        Err(e) => warn!("cannot encode {}: {e}", msg.name()),
    }
}

async fn coordinator_conn(node: Arc<Node>, link: Link, conn_id: u64) {
    let who = format!(
        "coordinator '{}' ({})",
        link.session.peer.name, link.peer_addr
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
            // The coordinator hears why first; then the step under way finishes, and the
            // session's links close between steps.
            let step = node.lock().session.as_ref().and_then(|s| {
                (s.conn_id == conn_id).then(|| (Arc::clone(&s.step), Arc::clone(&s.stop)))
            });
            if let Some((step, stop)) = step {
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
            } else {
                drop(slot);
            }
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
        tokio::select! {
            _ = notified => {}
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
}

/// Answers the coordinator's control messages until it closes the connection, ends the
/// session or sends something unreadable.
async fn control_loop(
    node: &Arc<Node>,
    who: &str,
    rx: &mut Box<dyn ringllm_protocol::FrameReceiver>,
    out: &mpsc::Sender<Outgoing>,
    conn_id: u64,
) {
    let mut buf = Vec::new();
    // A slice arriving from this coordinator, and the slices it sent (or offered and found
    // here) checked, ready for its assignment.
    let mut receiving: Option<slices::Receiving> = None;
    let mut checked: Vec<(SliceKey, PathBuf)> = Vec::new();
    loop {
        let in_session = node
            .lock()
            .session
            .as_ref()
            .is_some_and(|s| s.conn_id == conn_id);
        // Mid-transfer the coordinator sends without pause: silence means it is gone.
        let expecting = receiving.as_ref().is_some_and(|r| r.expecting());
        let limit = if in_session || expecting {
            COORDINATOR_SILENCE
        } else {
            COORDINATOR_SETUP_SILENCE
        };
        let Ok(received) = tokio::time::timeout(limit, rx.recv(&mut buf)).await else {
            warn!(
                "{who}: nothing heard for {} s (process stopped, link cut or a stalled \
                 frame); dropping it so another coordinator can take the node",
                limit.as_secs()
            );
            let m = format!(
                "node '{}' heard nothing from this coordinator for {} s and dropped it",
                node.opts.name,
                limit.as_secs()
            );
            if let Some(f) = error_frame(ErrorCode::BadRequest, None, m) {
                let _ = out.send(f).await;
            }
            break;
        };
        let h = match received {
            Ok(h) => h,
            Err(TransportError::Closed) => {
                info!("{who} closed the connection");
                break;
            }
            Err(e) => {
                warn!("{who}: {e}; closing");
                if let Some(f) = error_frame(ErrorCode::BadRequest, None, e.to_string()) {
                    let _ = out.send(f).await;
                }
                break;
            }
        };
        match h.kind {
            FrameKind::Control => {
                let msg = match control_of(&h, &buf) {
                    Ok(m) => m,
                    Err(e) => {
                        warn!("{who}: {e}");
                        if let Some(f) = error_frame(ErrorCode::BadRequest, None, e.to_string()) {
                            let _ = out.send(f).await;
                        }
                        continue;
                    }
                };
                debug!("{who}: {}", msg.name());
                match msg {
                    Control::Assign(a) => {
                        let reply = match assign(node, a, conn_id, out.clone(), &checked).await {
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
                        queue_control(out, reply).await;
                    }
                    Control::Heartbeat {
                        nonce,
                        reply: false,
                    } => {
                        queue_control(out, Control::Heartbeat { nonce, reply: true }).await;
                    }
                    Control::Heartbeat { reply: true, .. } => {}
                    Control::GetStats => {
                        let stats = node_stats(node);
                        queue_control(out, Control::Stats(stats)).await;
                    }
                    Control::ReleaseSequence { seq } => {
                        let st = node.lock();
                        if let Some(s) = st.session.as_ref().filter(|s| s.conn_id == conn_id) {
                            s.release
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push(seq);
                        }
                    }
                    Control::Shutdown { reason } => {
                        info!("{who} ended the session: {reason}");
                        break;
                    }
                    Control::SliceOffer(offer) => {
                        // A new offer replaces a transfer in progress (its `.part` stays).
                        receiving = None;
                        let (name, cache) = (node.opts.name.clone(), node.opts.cache_dir.clone());
                        let key = offer.key.clone();
                        let prepared = tokio::task::spawn_blocking(move || {
                            slices::prepare(&name, &cache, offer)
                        })
                        .await;
                        let reply = match prepared {
                            Ok(Ok(p)) => {
                                if let Some(path) = p.ready {
                                    checked.retain(|(k, _)| *k != key);
                                    checked.push((key, path));
                                }
                                receiving = p.receiving;
                                Control::SliceNeed(p.need)
                            }
                            Ok(Err(e)) => {
                                warn!("{who}: {e}");
                                let code = match e {
                                    slices::SliceError::BadOffer { .. } => ErrorCode::BadRequest,
                                    _ => ErrorCode::CacheFull,
                                };
                                Control::Error(ErrorMsg {
                                    code,
                                    seq: None,
                                    message: e.to_string(),
                                })
                            }
                            Err(e) => Control::Error(ErrorMsg {
                                code: ErrorCode::Internal,
                                seq: None,
                                message: format!("node '{}': {e}", node.opts.name),
                            }),
                        };
                        queue_control(out, reply).await;
                    }
                    other => {
                        let m = format!("unexpected {} message from a coordinator", other.name());
                        warn!("{who}: {m}");
                        queue_control(
                            out,
                            Control::Error(ErrorMsg {
                                code: ErrorCode::BadRequest,
                                seq: None,
                                message: m,
                            }),
                        )
                        .await;
                    }
                }
            }
            // A link-speed probe (`ringllm plan`): read and dropped.
            FrameKind::Slice if h.seq == SLICE_PROBE => {}
            FrameKind::Slice => {
                let Some(r) = receiving.as_mut() else {
                    let m = format!("node '{}' got slice data without an offer", node.opts.name);
                    warn!("{who}: {m}");
                    if let Some(f) = error_frame(ErrorCode::BadRequest, None, m) {
                        let _ = out.send(f).await;
                    }
                    break;
                };
                match r.on_frame(h.seq, &buf) {
                    Ok(slices::Step::More(None)) => {}
                    Ok(slices::Step::More(Some(p))) => {
                        queue_control(out, Control::SliceProgress(p)).await
                    }
                    Ok(slices::Step::Done { progress, path }) => {
                        if let Some(path) = path {
                            let key = r.key().clone();
                            checked.retain(|(k, _)| *k != key);
                            checked.push((key, path));
                            receiving = None;
                        }
                        queue_control(out, Control::SliceProgress(progress)).await;
                    }
                    Err(e) => {
                        warn!("{who}: {e}");
                        receiving = None;
                        let code = match e {
                            slices::SliceError::BadOffer { .. } => ErrorCode::BadRequest,
                            _ => ErrorCode::CacheFull,
                        };
                        if let Some(f) = error_frame(code, None, e.to_string()) {
                            let _ = out.send(f).await;
                        }
                    }
                }
            }
            FrameKind::Hidden | FrameKind::Logits => {
                let m = format!(
                    "node '{}' got a data frame on the control connection (data travels on its own link)",
                    node.opts.name
                );
                warn!("{who}: {m}");
                if let Some(f) = error_frame(ErrorCode::BadRequest, Some(h.seq), m) {
                    let _ = out.send(f).await;
                }
            }
        }
    }
    if let Some(r) = receiving.filter(|r| r.expecting()) {
        r.log_cut();
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

fn node_stats(node: &Node) -> Stats {
    let st = node.lock();
    let mut out = Stats {
        rss_bytes: sys::rss_bytes(),
        ..Stats::default()
    };
    if let Some(s) = st.session.as_ref() {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        out.session = s.id;
        out.frames_in = g(&s.stats.frames_in);
        out.frames_out = g(&s.stats.frames_out);
        out.bytes_in = g(&s.stats.bytes_in);
        out.bytes_out = g(&s.stats.bytes_out);
        out.tokens = g(&s.stats.tokens);
        out.compute_us = g(&s.stats.compute_us);
        out.busy_us = g(&s.stats.busy_us);
        if let Some(st) = &s.streamer {
            let c = st.stats();
            out.stream_bytes_read = c.bytes_read;
            out.stream_stall_us = (c.stall_s * 1e6) as u64;
            out.stream_layers_skipped = c.layers_skipped;
        }
    }
    out
}

async fn assign(
    node: &Arc<Node>,
    a: Assignment,
    conn_id: u64,
    coord_out: mpsc::Sender<Outgoing>,
    checked: &[(SliceKey, PathBuf)],
) -> Result<Ready, AssignError> {
    let t0 = Instant::now();
    let name = node.opts.name.clone();
    // A new assignment replaces this connection's previous one.
    node.lock().session = None;
    // The previous session's compute thread frees its slice (resident tier, layer buffers)
    // when it ends: wait for that before loading another, or a capped node holds both.
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline
        && node
            .compute
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|t| !t.is_finished())
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if a.activations == Dtype::Bytes {
        return Err(AssignError::Activations { node: name });
    }
    let kv_type = a.kv_type;
    let fname = a.model.file_name.clone();
    if fname.is_empty() || fname.contains('/') || fname.contains('\\') || fname.starts_with('.') {
        return Err(AssignError::FileName {
            node: name,
            file: fname,
        });
    }
    let path = node.opts.models_dir.join(&fname);
    let cached = node
        .lock()
        .cache
        .as_ref()
        .filter(|(id, _)| *id == a.model)
        .map(|(_, f)| Arc::clone(f));
    let file = match cached {
        Some(f) => f,
        None if !path.exists() => {
            // No model file: a slice the coordinator sent (or offered and found here), else
            // one in the cache checked against the offer stored with it.
            let key = SliceKey {
                model: a.model.clone(),
                layer_start: a.layer_start,
                layer_end: a.layer_end,
                head: a.head,
            };
            let found = match checked.iter().find(|(k, _)| *k == key) {
                Some((_, p)) => Some(p.clone()),
                None => {
                    let (cache, k) = (node.opts.cache_dir.clone(), key.clone());
                    tokio::task::spawn_blocking(move || slices::cached(&cache, &k)).await?
                }
            };
            let Some(slice) = found else {
                return Err(AssignError::NoModelFile {
                    node: name,
                    file: fname,
                    dir: node.opts.models_dir.clone(),
                    cache: node.opts.cache_dir.clone(),
                });
            };
            info!(
                "layers {}-{}: using the slice {}",
                a.layer_start,
                a.layer_end,
                slice.display()
            );
            let p = slice.clone();
            let f = tokio::task::spawn_blocking(move || GgufFile::open_lean(&p))
                .await?
                .map_err(|e| AssignError::Unreadable {
                    node: name.clone(),
                    path: slice,
                    source: Box::new(e),
                })?;
            Arc::new(f)
        }
        None => {
            let p = path.clone();
            let f = tokio::task::spawn_blocking(move || GgufFile::open_lean(&p))
                .await?
                .map_err(|e| AssignError::Unreadable {
                    node: name.clone(),
                    path: path.clone(),
                    source: Box::new(e),
                })?;
            let f = Arc::new(f);
            let id = model_identity(&path, &f);
            if id != a.model {
                return Err(AssignError::NotTheModel {
                    node: name,
                    path,
                    size: id.size,
                    want_size: a.model.size,
                    hash: id.header_hash,
                    want_hash: a.model.header_hash,
                });
            }
            node.lock().cache = Some((id, Arc::clone(&f)));
            f
        }
    };
    let range = a.layer_start as usize..a.layer_end as usize;
    let head = a.head;
    let threads = if a.threads == 0 {
        node.opts.threads
    } else {
        a.threads as usize
    }
    .max(1);
    let (ctx, max_batch) = (a.kv_ctx.max(1) as usize, a.max_batch.max(1) as usize);
    let slots = a.kv_slots.max(1) as usize;
    // A coordinator's settings are checked again here: a wrong one must not abort the node.
    let limit = |source| AssignError::Limit {
        node: name.clone(),
        source,
    };
    limits::check("threads", threads, limits::MAX_THREADS).map_err(limit)?;
    limits::check("batch size", max_batch, limits::MAX_BATCH).map_err(limit)?;
    limits::check("context size", ctx, limits::MAX_CTX).map_err(limit)?;
    limits::check("KV slots", slots, limits::MAX_SLOTS).map_err(limit)?;
    let n2 = name.clone();
    let cap = node.opts.memory;
    let repack = node.opts.repack && node.opts.backend == ringllm_model::BackendChoice::Cpu;
    let backend = node.opts.backend;
    let settings = node.opts.stream;
    let layout = a.layout.clone();
    let model_hash = a.model.header_hash;
    let loaded = tokio::task::spawn_blocking(move || {
        load_stage(&StageLoad {
            node: &n2,
            file,
            range,
            layout: &layout,
            head,
            repack,
            backend,
            cap,
            settings,
            threads,
            max_batch,
            ctx,
            kv_type,
            slots,
            model_hash,
        })
    })
    .await??;
    let (runner, windows, streamer, weight_bytes, kv_bytes) = loaded;
    let info = StageStatus {
        session: a.session,
        model: a.model.file_name.clone(),
        layer_start: a.layer_start,
        layer_end: a.layer_end,
        head: a.head,
        windows: a.layout.windows.clone(),
        streamed_layers: streamer.as_ref().map_or(0, |s| s.layers().len() as u32),
        weight_bytes,
        kv_bytes,
    };
    let stats = Arc::new(SessionStats::default());
    // The link to the next node, if the output does not go back to the coordinator.
    let next = match &a.next_hop {
        NextHop::Coordinator => None,
        NextHop::Node {
            name: next,
            address,
            transport,
        } => Some(
            dial::connect_data_link(
                &dial::DialSpec {
                    kind: *transport,
                    addr: address,
                    name: &name,
                    timeout: HANDSHAKE_TIMEOUT,
                    max_payload: MAX_PAYLOAD,
                    ring_session: a.session,
                    role: dial::LinkRole::Input,
                },
                &node.opts.key,
            )
            .await
            .map_err(|source| AssignError::NextHop {
                node: name.clone(),
                next: next.clone(),
                address: address.clone(),
                source,
            })?,
        ),
    };
    let next_name = match &a.next_hop {
        NextHop::Coordinator => "the coordinator".to_string(),
        NextHop::Node {
            name,
            address,
            transport,
        } => format!("next hop '{name}' ({address}, {transport})"),
    };
    let closers = Arc::new(Mutex::new(Vec::new()));
    if let Some(l) = &next {
        if let Ok(c) = l.closer() {
            closers.lock().unwrap_or_else(|e| e.into_inner()).push(c);
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let step = Arc::new(Mutex::new(()));
    let release = Arc::new(Mutex::new(Vec::new()));
    let (attach_tx, attach_rx) = std::sync::mpsc::channel::<Attached>();
    let worker = Worker {
        name: name.clone(),
        caches: windows
            .iter()
            .map(|_| (0..slots).map(|_| None).collect())
            .collect(),
        runner,
        windows,
        kv_ctx: ctx,
        kv_type,
        head,
        activations: a.activations,
        coord: coord_out.clone(),
        stats: Arc::clone(&stats),
        next,
        next_name,
        output_to_coordinator: a.next_hop == NextHop::Coordinator,
        stop: Arc::clone(&stop),
        closers: Arc::clone(&closers),
        release: Arc::clone(&release),
        step: Arc::clone(&step),
    };
    let thread = std::thread::Builder::new()
        .name(format!("compute-{}", a.session))
        .spawn(move || worker.run(attach_rx))
        .map_err(AssignError::Thread)?;
    node.add_compute_thread(thread);
    let ready = Ready {
        session: a.session,
        layer_start: a.layer_start,
        layer_end: a.layer_end,
        weight_bytes,
        kv_bytes,
        rss_bytes: sys::rss_bytes(),
        load_ms: t0.elapsed().as_millis() as u64,
    };
    info!(
        session = a.session,
        layers = ?(a.layer_start..a.layer_end),
        weights_mib = weight_bytes >> 20,
        kv_mib = kv_bytes >> 20,
        rss_mib = ready.rss_bytes >> 20,
        "assignment loaded"
    );
    node.lock().session = Some(SessionHandle {
        id: a.session,
        conn_id,
        attach: attach_tx,
        stats,
        stop,
        closers,
        release,
        streamer,
        step,
        info,
    });
    node.changed.notify_waiters();
    Ok(ready)
}

/// What [`load_stage`] needs.
struct StageLoad<'a> {
    node: &'a str,
    file: Arc<GgufFile>,
    /// Every layer of the stage (its windows' span when it has several).
    range: std::ops::Range<usize>,
    layout: &'a StageLayout,
    head: bool,
    repack: bool,
    backend: ringllm_model::BackendChoice,
    cap: Option<u64>,
    settings: StreamSettings,
    threads: usize,
    max_batch: usize,
    ctx: usize,
    kv_type: KvType,
    slots: usize,
    /// The whole model's header hash (the assignment's model identity).
    model_hash: u64,
}

type Loaded = (Runner, Vec<Arc<Model>>, Option<Arc<Streamer>>, u64, u64);

/// Loads a stage: one runner per window (one window unless the ring has several rounds),
/// the head on the last; the layers the coordinator listed (or, without a list, those that do
/// not fit this node's budget) streamed from disk by one streamer shared by the windows.
fn load_stage(s: &StageLoad<'_>) -> Result<Loaded, AssignError> {
    let node = s.node.to_string();
    let load_err = |source| AssignError::Load {
        node: node.clone(),
        source,
    };
    let limit = |source| AssignError::Limit {
        node: node.clone(),
        source,
    };
    let n_layer = s.range.end;
    if !s.layout.windows.is_empty() {
        let (first, last) = (
            s.layout.windows[0].0,
            s.layout.windows[s.layout.windows.len() - 1].1,
        );
        if first as usize != s.range.start || last as usize != s.range.end {
            return Err(AssignError::Layout {
                node,
                why: format!(
                    "windows {:?} do not span layers {}..{}",
                    s.layout.windows, s.range.start, s.range.end
                ),
            });
        }
    }
    let windows: Vec<std::ops::Range<usize>> = if s.layout.windows.is_empty() {
        vec![s.range.clone()]
    } else {
        s.layout
            .windows
            .iter()
            .map(|&(a, b)| a as usize..b as usize)
            .collect()
    };
    // Windows in order, inside the stage's span, none empty.
    let mut at = s.range.start;
    for w in &windows {
        if w.start < at || w.end <= w.start || w.end > n_layer {
            return Err(AssignError::Layout {
                node,
                why: format!(
                    "window {}..{} is empty, out of order or outside layers {}..{}",
                    w.start, w.end, s.range.start, s.range.end
                ),
            });
        }
        at = w.end;
    }
    let all: Vec<usize> = windows.iter().flat_map(|w| w.clone()).collect();
    for &l in &s.layout.streamed {
        if !all.contains(&(l as usize)) {
            return Err(AssignError::Layout {
                node,
                why: format!("streamed layer {l} is not one of the stage's"),
            });
        }
    }
    let hp = Model::load(
        Arc::clone(&s.file),
        &LoadOptions {
            layers: Some(0..0),
            embedding: false,
            head: false,
            ..LoadOptions::default()
        },
    )
    .map_err(load_err)?
    .hp;
    // One runner (its scratch) for every window, and each window's KV caches.
    let (what, runner_need) = {
        let (what, mut need) = limits::runner_memory(
            &hp,
            windows[0].clone(),
            s.threads,
            s.max_batch,
            s.ctx,
            s.kv_type,
            s.slots,
        );
        for w in &windows[1..] {
            let kv = KvCache::bytes_for(&hp, w.clone(), s.ctx, s.max_batch, s.kv_type) as u64;
            need = need.saturating_add(kv.saturating_mul(s.slots as u64));
        }
        (what, need)
    };
    // Scratch and KV first: streaming layers cannot make room for them.
    limits::check("threads", s.threads, limits::MAX_THREADS).map_err(limit)?;
    limits::check_memory_within(s.cap, what, runner_need).map_err(limit)?;
    // The streamed tier: as the coordinator planned it, or what this node's budget leaves.
    let settings = StreamSettings {
        mode: if s.layout.stream_all {
            StreamMode::All
        } else {
            s.settings.mode
        },
        prefetch: match s.layout.prefetch {
            0 => s.settings.prefetch,
            p => s.settings.prefetch.or(Some(p as usize)),
        },
    };
    let streamer = if !s.layout.streamed.is_empty() && settings.mode != StreamMode::All {
        let depth = settings
            .prefetch
            .unwrap_or(2)
            .clamp(1, ringllm_model::stream::MAX_DEPTH);
        let mut order: Vec<usize> = s.layout.streamed.iter().map(|&l| l as usize).collect();
        // The coordinator planned from what this node reported; if the budget has shrunk
        // since, stream more (the last resident layers first) rather than overrun it.
        if let Some(b) = limits::budget(s.cap) {
            // Each layer's span once (finding one scans the tensor table).
            let sizes: Vec<(usize, u64)> = all
                .iter()
                .map(|&l| {
                    let b =
                        ringllm_model::stream::layer_span(&s.file, l).map_or(0, |x| x.range.len());
                    (l, b as u64)
                })
                .collect();
            let bytes = |l: usize| sizes.iter().find(|x| x.0 == l).map_or(0, |x| x.1);
            let largest = order.iter().map(|&l| bytes(l)).max().unwrap_or(0);
            let pool = (largest + 8192) * (depth as u64 + 1);
            let mut resident: Vec<usize> =
                all.iter().copied().filter(|l| !order.contains(l)).collect();
            let need =
                |res: &[usize]| res.iter().map(|&l| bytes(l)).sum::<u64>() + pool + STREAM_HEADROOM;
            let room = b.saturating_sub(runner_need);
            let before = resident.len();
            while need(&resident) > room {
                let Some(l) = resident.pop() else { break };
                order.push(l);
            }
            if resident.len() < before {
                order.sort_by_key(|l| all.iter().position(|a| a == l));
                tracing::warn!(
                    moved = before - resident.len(),
                    budget_mib = b >> 20,
                    "the planned resident layers do not fit this node's budget now: streaming more of them"
                );
            }
        }
        let st = Streamer::new(&s.file, &order, depth).map_err(|e| AssignError::Layout {
            node: node.clone(),
            why: format!("cannot stream layers {order:?}: {e}"),
        })?;
        Some(Arc::new(st))
    } else {
        let head_bytes = if s.head {
            ringllm_model::stream::head_bytes(&s.file)
        } else {
            0
        };
        // Without a streaming layout the coordinator's plan fitted the slice in this node's
        // budget: it is trusted (the node's own view counts the slice file's pages it has just
        // checked as used). Only `--stream all` streams here on its own.
        let budget = if settings.mode == StreamMode::All {
            limits::budget(s.cap).map(|b| {
                b.saturating_sub(runner_need)
                    .saturating_sub(head_bytes)
                    .saturating_sub(STREAM_HEADROOM)
            })
        } else {
            None
        };
        ringllm_model::stream::decide(&s.file, &all, budget, &settings, s.threads, 0.0)
            .map_err(|why| AssignError::Layout {
                node: node.clone(),
                why,
            })?
            .map(|(st, _)| st)
    };
    let mut models = Vec::with_capacity(windows.len());
    let mut weights = 0u64;
    let mut kv_bytes = 0u64;
    for (i, w) in windows.iter().enumerate() {
        let last = i + 1 == windows.len();
        let model = Model::load(
            Arc::clone(&s.file),
            &LoadOptions {
                layers: Some(w.clone()),
                embedding: false,
                head: s.head && last,
                repack: s.repack,
                stream: streamer.clone(),
            },
        )
        .map_err(load_err)?;
        kv_bytes += KvCache::bytes_for(&model.hp, w.clone(), s.ctx, s.max_batch, s.kv_type) as u64
            * s.slots as u64;
        weights += model.prefault() as u64;
        models.push(Arc::new(model));
    }
    let mut runner = Runner::new(Arc::clone(&models[0]), s.threads, s.max_batch, s.ctx);
    if s.backend != ringllm_model::BackendChoice::Cpu {
        let why = |w: String| AssignError::Layout {
            node: node.clone(),
            why: format!("backend {:?}: {w}", s.backend),
        };
        if models.len() > 1 {
            return Err(why("a multi-round ring runs on the CPU backend only".into()));
        }
        let b = ringllm_model::backend::open(s.backend, &models[0], s.max_batch)
            .map_err(|e| why(e.to_string()))?;
        runner.set_backend(b).map_err(|e| why(e.to_string()))?;
        info!(backend = %runner.backend_name(), "stage runs on");
    }
    if !s.layout.skip_predictor.is_empty() {
        let why = |w: String| AssignError::Layout {
            node: node.clone(),
            why: format!("layer skip: {w}"),
        };
        if models.len() > 1 {
            return Err(why("not available on a multi-round ring".into()));
        }
        let p =
            ringllm_model::skip::Predictor::from_bytes(&s.layout.skip_predictor).map_err(why)?;
        let want = ringllm_model::skip::SkipModelId::new(&hp, s.model_hash);
        if p.model != want {
            return Err(why(format!(
                "the predictor was made for {}, this ring runs {want}",
                p.model
            )));
        }
        let policy = ringllm_model::skip::SkipPolicy {
            confidence: (s.layout.skip_confidence_ppm as f32 / 1e6).clamp(0.5, 1.0),
            max_skip: s.layout.skip_max as usize,
            ..ringllm_model::skip::SkipPolicy::new(Arc::new(p))
        };
        runner
            .set_skip(Some(policy))
            .map_err(|e| why(e.to_string()))?;
        info!(
            confidence = s.layout.skip_confidence_ppm as f64 / 1e6,
            max_skip = s.layout.skip_max,
            "layer skip on: the coordinator's predictor decides at this stage's first layer"
        );
    }
    Ok((runner, models, streamer, weights, kv_bytes))
}

/// Memory a streaming node keeps free beyond its tiers (runtime, frame buffers).
const STREAM_HEADROOM: u64 = 48 << 20;

/// A data link: reads its `Attach` and hands it to the session's compute thread.
async fn data_conn(
    node: Arc<Node>,
    stream: tokio::net::TcpStream,
    hs: ringllm_protocol::handshake::Session,
    peer: std::net::SocketAddr,
) {
    let who = format!("data link from '{}' ({peer})", hs.peer.name);
    let uring = node.opts.transport == TransportKind::Uring;
    attach_link(node, who, move || {
        let stream = stream.into_std()?;
        dial::accept_tcp_data(stream, &hs, MAX_PAYLOAD, HANDSHAKE_TIMEOUT, uring)
    })
    .await
}

/// Data links arriving over QUIC, until the daemon shuts down (then the endpoint closes, and
/// every QUIC link with it).
async fn quic_accept_loop(node: Arc<Node>, server: QuicServer) {
    loop {
        let accepted = node
            .until_stopped(server.accept(HANDSHAKE_TIMEOUT, MAX_PAYLOAD))
            .await;
        let (link, hs, peer) = match accepted {
            None => {
                server.close_all();
                return;
            }
            Some(None) => return,
            Some(Some(Ok(x))) => x,
            Some(Some(Err(e))) => {
                warn!("refused QUIC connection: {e}");
                continue;
            }
        };
        if hs.peer.role != Role::Upstream {
            warn!(
                "refused QUIC connection from '{}' ({peer}): only data links use QUIC; the \
                 control connection is TCP",
                hs.peer.name
            );
            continue;
        }
        let who = format!("data link from '{}' ({peer})", hs.peer.name);
        let n = Arc::clone(&node);
        tokio::spawn(async move {
            let attach = attach_link(Arc::clone(&n), who, move || {
                dial::accept_quic_data(link, HANDSHAKE_TIMEOUT)
            });
            n.until_stopped(attach).await
        });
    }
}

/// Finishes a data link (blocking, off the runtime) and hands it to its session.
async fn attach_link(
    node: Arc<Node>,
    who: String,
    open: impl FnOnce() -> Result<(BoxLink, AttachInfo), TransportError> + Send + 'static,
) {
    let (link, info) = match tokio::task::spawn_blocking(open).await {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => {
            warn!("{who}: {e}");
            return;
        }
        Err(e) => {
            warn!("{who}: {e}");
            return;
        }
    };
    let who = format!("{who} over {}", link.transport());
    let AttachInfo {
        session,
        from,
        role,
        ..
    } = info;
    let (input, output) = (role.input(), role.output());
    let mut link = Some(link);
    // The assignment may still be loading here: wait a little for it.
    let deadline = Instant::now() + TAKEOVER_WAIT;
    loop {
        let notified = node.changed.notified();
        let sent = {
            let st = node.lock();
            match (st.session.as_ref().filter(|s| s.id == session), link.take()) {
                (Some(s), Some(link)) => {
                    let _ = s.attach.send(Attached {
                        link,
                        input,
                        output,
                        from: from.clone(),
                    });
                    true
                }
                (_, l) => {
                    link = l;
                    false
                }
            }
        };
        if sent {
            info!("{who} attached to session {session} (input {input}, output {output})");
            return;
        }
        if Instant::now() >= deadline {
            warn!("{who}: no session {session} here");
            return;
        }
        tokio::select! {
            _ = notified => {}
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
}
