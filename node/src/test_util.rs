//! An in-process node harness for tests: nodes served by
//! [`daemon::serve`] on `127.0.0.1:0` in the test's own process, over real sockets, and
//! stopped through their shutdown future, no signal and no `kill`.
//!
//! - [`TestNode::start`] serves one node on the caller's tokio runtime (async tests);
//! - [`spawn_nodes`] serves several on a runtime of their own thread, for tests that drive
//!   them from blocking code (the coordinator's library).
//!
//! Every wait here is a hang guard only ([`GUARD`]): no test depends on its length.

use crate::daemon::{self, DaemonError, Listener, NodeOptions};
use ringllm_protocol::{ClusterKey, TransportKind};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// Hang guard for starting and stopping nodes: far beyond what either takes.
pub const GUARD: Duration = Duration::from_secs(60);

/// A test node's options: named `name`, in cluster `key`, with one compute thread, its models
/// in `models_dir` and its slice cache in `models_dir/slice-cache`, data links over TCP, no
/// memory cap of its own, weights repacked, nothing streamed, on the CPU. Change any field
/// with struct update syntax.
pub fn options(name: &str, key: ClusterKey, models_dir: &Path) -> NodeOptions {
    NodeOptions {
        key,
        name: name.to_string(),
        threads: 1,
        models_dir: models_dir.to_path_buf(),
        cache_dir: models_dir.join("slice-cache"),
        transport: TransportKind::Tcp,
        memory: None,
        repack: true,
        stream: Default::default(),
        backend: ringllm_model::BackendChoice::Cpu,
    }
}

/// A node serving on the runtime that started it.
pub struct TestNode {
    /// The address it serves on (`127.0.0.1`, a port of its own).
    pub addr: SocketAddr,
    stop: oneshot::Sender<()>,
    served: JoinHandle<Result<(), DaemonError>>,
}

impl TestNode {
    /// Binds `127.0.0.1:0` and starts [`daemon::serve`] with `opts` on the current tokio
    /// runtime; the node accepts connections as soon as this returns. Panics if the listener
    /// cannot be made (a test set-up failure).
    pub async fn start(opts: NodeOptions) -> TestNode {
        let tcp = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let listener = Listener::new(tcp, &opts).expect("a listener");
        let addr = listener.local_addr().expect("the listener's address");
        let (stop, stopped) = oneshot::channel::<()>();
        let served = tokio::spawn(daemon::serve(listener, opts, async {
            let _ = stopped.await;
        }));
        TestNode { addr, stop, served }
    }

    /// Resolves the node's shutdown future and waits for `serve` to return; its result.
    /// Panics if `serve` panicked or did not return within [`GUARD`].
    pub async fn stop(self) -> Result<(), DaemonError> {
        let _ = self.stop.send(());
        tokio::time::timeout(GUARD, self.served)
            .await
            .expect("serve did not return after shutdown")
            .expect("serve panicked")
    }
}

/// Nodes serving on a runtime of their own thread until [`Nodes::stop`].
pub struct Nodes {
    /// Their addresses, in the order of the options they were started with.
    pub addrs: Vec<SocketAddr>,
    stop: watch::Sender<bool>,
    thread: std::thread::JoinHandle<Vec<Result<(), DaemonError>>>,
}

/// Starts one node per entry of `nodes` on a new thread with a tokio runtime of its own (two
/// workers), and returns once every one accepts connections. Panics if they do not start
/// within [`GUARD`].
pub fn spawn_nodes(nodes: Vec<NodeOptions>) -> Nodes {
    let (stop, mut stopped) = watch::channel(false);
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime for the nodes");
        rt.block_on(async move {
            let mut started = Vec::new();
            for opts in nodes {
                started.push(TestNode::start(opts).await);
            }
            let _ = tx.send(started.iter().map(|n| n.addr).collect::<Vec<_>>());
            let _ = stopped.wait_for(|s| *s).await;
            // Every node hears the shutdown at once; then each is waited for.
            let stopping: Vec<_> = started
                .into_iter()
                .map(|n| tokio::spawn(n.stop()))
                .collect();
            let mut out = Vec::new();
            for s in stopping {
                out.push(s.await.expect("stopping a node panicked"));
            }
            out
        })
    });
    let addrs = rx.recv_timeout(GUARD).expect("the nodes did not start");
    Nodes {
        addrs,
        stop,
        thread,
    }
}

/// One node on a thread of its own: [`spawn_nodes`] with one entry.
pub fn spawn_node(opts: NodeOptions) -> Nodes {
    spawn_nodes(vec![opts])
}

impl Nodes {
    /// Stops every node and waits for them and their thread; each `serve`'s result, in the
    /// order they were started. Panics if their thread panicked.
    pub fn stop(self) -> Vec<Result<(), DaemonError>> {
        self.stop.send_replace(true);
        self.thread.join().expect("the nodes' thread panicked")
    }
}
