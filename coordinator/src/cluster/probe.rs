//! "Is this node there?" answered by the node itself: the authenticated handshake (as a
//! `Role::Monitor`, which never claims the node) completed within a deadline. A TCP connect
//! is not enough: the kernel of a frozen process (SIGSTOP, a closed laptop lid, a paused VM)
//! still accepts connections, and so does any program squatting on a lost node's port; only
//! a live node holding the cluster key finishes the handshake.

use ringllm_protocol::control_conn;
use ringllm_protocol::frame::COORDINATOR_MAX_PAYLOAD;
use ringllm_protocol::untrusted::escape;
use ringllm_protocol::{ClusterKey, Role};
use std::time::Duration;

/// The deadline of a probe that leaves a node out of a (re-)built ring when missed. A live
/// node answers in milliseconds (a few round trips); a lost SYN on a lossy link costs 1 s
/// and only leaves the node out until it is tried again.
pub const PROBE_DEADLINE: Duration = Duration::from_millis(1500);

/// The deadline of a probe repeated anyway (waiting for nodes to come up or back).
pub const QUICK_PROBE_DEADLINE: Duration = Duration::from_secs(1);

/// The deadline of a probe of a node that missed a heartbeat reply on a running ring: a
/// frozen node is noticed within this (plus the silence) rather than after the whole
/// heartbeat timeout. A live node answers in milliseconds; one that misses both a heartbeat
/// and this deadline is left out and taken back once it answers again.
pub const SUSPECT_PROBE_DEADLINE: Duration = Duration::from_millis(500);

/// Whether the node at `addr` finishes the handshake with `key` within `deadline`, as `me`;
/// `Ok`: the name the node gave (escaped: it came from the network). `Err` says why not
/// (refused, timed out, wrong key or version). Discovery asks this of every service that
/// claims the cluster; the ring asks it of nodes it is about to use or take back.
pub async fn handshake(
    addr: &str,
    key: &ClusterKey,
    me: &str,
    deadline: Duration,
) -> Result<String, String> {
    let link = control_conn::connect(
        addr,
        key,
        Role::Monitor,
        me,
        deadline,
        COORDINATOR_MAX_PAYLOAD,
    )
    .await
    .map_err(|e| e.to_string())?;
    Ok(escape(&link.session.peer.name).into_owned())
}

/// [`handshake`] with every address at once, on the caller's runtime; the answers in the
/// order of `addrs`.
pub async fn handshake_each(
    addrs: &[String],
    key: &ClusterKey,
    deadline: Duration,
) -> Vec<Result<(), String>> {
    let tasks: Vec<_> = addrs
        .iter()
        .map(|a| {
            let (a, key) = (a.clone(), key.clone());
            tokio::spawn(async move {
                handshake(&a, &key, "coordinator probe", deadline)
                    .await
                    .map(drop)
            })
        })
        .collect();
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(
            t.await
                .unwrap_or_else(|e| Err(format!("the probe failed: {e}"))),
        );
    }
    out
}

/// [`handshake`] with every address at once, on a runtime of its own (callers are plain
/// threads); the answers in the order of `addrs`.
pub fn handshake_all(
    addrs: &[String],
    key: &ClusterKey,
    deadline: Duration,
) -> Vec<Result<(), String>> {
    if addrs.is_empty() {
        return Vec::new();
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let why = format!("cannot start the probe's runtime: {e}");
            return addrs.iter().map(|_| Err(why.clone())).collect();
        }
    };
    rt.block_on(handshake_each(addrs, key, deadline))
}

/// A failure pinned on one node of a ring being built or running: a rebuild leaves that node
/// out (and tries it again later) rather than failing. Its text is the whole message.
#[derive(Debug)]
pub struct NodeFault {
    /// The node's address, as the ring spec has it.
    pub address: String,
    pub message: String,
    /// True when the node was just seen to miss the handshake: the next build need not
    /// probe it again before leaving it out.
    pub no_handshake: bool,
}

impl std::fmt::Display for NodeFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for NodeFault {}

/// An error naming the node at `address` as the cause.
pub fn fault(address: &str, message: String) -> anyhow::Error {
    anyhow::Error::new(NodeFault {
        address: address.to_string(),
        message,
        no_handshake: false,
    })
}

/// The address of the node `e` is pinned on, if any, and whether it just missed the handshake.
pub fn fault_of(e: &anyhow::Error) -> Option<(&str, bool)> {
    e.chain()
        .find_map(|c| c.downcast_ref::<NodeFault>())
        .map(|f| (f.address.as_str(), f.no_handshake))
}
