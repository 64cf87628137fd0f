//! The sockets a node serves on, `serve` (start-up probe, accept loop) and shutdown.

use super::connection::connection;
use super::data::quic_accept_loop;
use super::refusals::{self, Refusals};
use super::state::{Node, Rates, State};
use super::status::{probe, sample_rates};
use super::{DaemonError, NodeOptions, SHUTDOWN_WAIT, STEP_WAIT};
use ringllm_protocol::{QuicServer, TransportKind};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;
use tracing::{info, warn};

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
    let caps = probe(&opts).await?;
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
        refusals: Refusals::default(),
    });
    let mut tasks = JoinSet::new();
    tasks.spawn(sample_rates(Arc::clone(&node)));
    let n = Arc::clone(&node);
    tasks.spawn(async move { refusals::summarize(&n.refusals, n.stopped()).await });
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
    shut_down(&node, tasks).await;
    Ok(())
}

/// Stops the daemon once it no longer accepts: tells every connection task, waits for them
/// (a step under way finishes first), ends a session left behind and joins the compute
/// threads.
async fn shut_down(node: &Node, mut tasks: JoinSet<()>) {
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
    join_compute_threads(node).await;
    info!("node '{}' stopped", node.opts.name);
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
