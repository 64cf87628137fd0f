//! What every node of a cluster is doing (`ringllm status`, `GET /v1/cluster`): each node is
//! asked over a `Role::Monitor` connection (authenticated by the cluster key like any other,
//! but it never claims the node, so it works while a coordinator holds the ring) and answers
//! with its `NodeStatus`. The JSON here is a stable interface, documented in docs/cluster.md
//! ("Status"): add fields, never rename or remove them.

use ringllm_protocol::control::{Control, NodeStatus};
use ringllm_protocol::control_conn::{self, control_of};
use ringllm_protocol::untrusted::escape;
use ringllm_protocol::{ClusterKey, Role, TransportError};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// Longest wait for one node (connect, handshake and answer).
pub const STATUS_TIMEOUT: Duration = Duration::from_secs(3);
/// Largest frame a status answer may be (a `NodeStatus` is a few hundred bytes).
const MAX_STATUS_PAYLOAD: u32 = 64 << 10;

/// One node's line of the cluster status. Sizes in bytes, rates per second, times in
/// milliseconds unless the name says otherwise.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeReport {
    /// The address asked (`host:port`).
    pub address: String,
    /// The node's name (`node --name`); the address when it did not answer.
    pub name: String,
    /// `serving` (a coordinator holds it and it runs a stage), `held` (a coordinator holds it,
    /// no stage loaded yet), `idle` (no coordinator), `unreachable` (no answer), `error`
    /// (it answered but refused or misbehaved: another key, an older version).
    pub health: String,
    /// Why it is `unreachable` or `error`.
    pub error: Option<String>,
    pub version: Option<String>,
    /// Data-link transport (`tcp`, `udp`, `quic`, `uring`, `kmod`).
    pub transport: Option<String>,
    pub threads: Option<u32>,
    /// Kernel level in use (`avx512`, `avx2`, `neon+dotprod`, ...).
    pub isa: Option<String>,
    /// Layers of its stage, inclusive as cluster files write them (`"0-14"`); with several
    /// rounds, one range per round joined by commas.
    pub layers: Option<String>,
    /// Its stage computes the output head.
    pub head: bool,
    pub model: Option<String>,
    pub memory_total: Option<u64>,
    /// What the planner may use on it.
    pub memory_budget: Option<u64>,
    /// Resident set of the node process.
    pub memory_used: Option<u64>,
    /// Weights and KV cache of its stage.
    pub weight_bytes: Option<u64>,
    pub kv_bytes: Option<u64>,
    /// Measured matrix × vector weight-read speed.
    pub matvec_bytes_per_s: Option<f64>,
    /// Tokens through its stage per second, lately.
    pub tokens_per_s: Option<f64>,
    /// Round trip of the status request from the machine that asked.
    pub rtt_ms: Option<f64>,
    /// The coordinator holding it (`name`, `address`, `held_s`), if any.
    pub coordinator: Option<CoordinatorRef>,
    /// Data-link bytes per second lately, and in total this session.
    pub bytes_in_per_s: Option<f64>,
    pub bytes_out_per_s: Option<f64>,
    pub bytes_in: Option<u64>,
    pub bytes_out: Option<u64>,
    pub tokens: Option<u64>,
    pub uptime_s: Option<f64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CoordinatorRef {
    pub name: String,
    pub address: String,
    pub held_s: f64,
}

/// The coordinator's own line in `GET /v1/cluster` (absent when `ringllm status` asked the
/// nodes directly).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CoordinatorReport {
    /// The served model's id.
    pub model: String,
    /// As `/health`: `ok`, `degraded` or `unavailable`.
    pub status: String,
    /// The ring's nodes in use and the cluster's nodes not in it, as "name (address)".
    pub ring: Vec<String>,
    pub missing: Vec<String>,
}

/// The whole answer: `ringllm status --json` prints it, `GET /v1/cluster` returns it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterReport {
    pub coordinator: Option<CoordinatorReport>,
    pub nodes: Vec<NodeReport>,
}

/// What a serving coordinator knows of its cluster: the key and every node it was given.
#[derive(Clone, Debug)]
pub struct ClusterView {
    pub key: ClusterKey,
    /// (label, address) of every remote stage, in ring order.
    pub nodes: Vec<(String, String)>,
}

/// Asks one node for its status.
pub async fn query(address: &str, key: &ClusterKey, me: &str) -> NodeReport {
    match tokio::time::timeout(STATUS_TIMEOUT, ask(address, key, me)).await {
        Ok(Ok((s, rtt))) => report(address, &s, rtt),
        Ok(Err(e)) => failed(address, &e),
        Err(_) => NodeReport {
            address: address.to_string(),
            name: address.to_string(),
            health: "unreachable".into(),
            error: Some(format!(
                "no answer within {} s",
                STATUS_TIMEOUT.as_secs_f64()
            )),
            ..NodeReport::default()
        },
    }
}

/// Asks every node at once; reports in the order given.
pub async fn query_all(addresses: &[String], key: &ClusterKey, me: &str) -> Vec<NodeReport> {
    let mut set = tokio::task::JoinSet::new();
    for (i, a) in addresses.iter().enumerate() {
        let (a, key, me) = (a.clone(), key.clone(), me.to_string());
        set.spawn(async move { (i, query(&a, &key, &me).await) });
    }
    let mut out: Vec<Option<NodeReport>> = vec![None; addresses.len()];
    while let Some(r) = set.join_next().await {
        if let Ok((i, rep)) = r {
            out[i] = Some(rep);
        }
    }
    out.into_iter()
        .zip(addresses)
        .map(|(r, a)| {
            r.unwrap_or_else(|| NodeReport {
                address: a.clone(),
                name: a.clone(),
                health: "error".into(),
                error: Some("the query task failed".into()),
                ..NodeReport::default()
            })
        })
        .collect()
}

async fn ask(
    address: &str,
    key: &ClusterKey,
    me: &str,
) -> Result<(NodeStatus, Duration), TransportError> {
    let mut link = control_conn::connect(
        address,
        key,
        Role::Monitor,
        me,
        STATUS_TIMEOUT,
        MAX_STATUS_PAYLOAD,
    )
    .await?;
    let t0 = Instant::now();
    control_conn::send_control(link.tx.as_mut(), &Control::GetStatus).await?;
    let mut buf = Vec::new();
    let h = link.rx.recv(&mut buf).await?;
    let rtt = t0.elapsed();
    match control_of(&h, &buf)? {
        Control::Status(s) => Ok((*s, rtt)),
        Control::Error(e) => Err(TransportError::Io(std::io::Error::other(format!(
            "the node refused: {}",
            e.message
        )))),
        other => Err(TransportError::Io(std::io::Error::other(format!(
            "the node answered {} instead of its status",
            other.name()
        )))),
    }
}

fn failed(address: &str, e: &TransportError) -> NodeReport {
    let unreachable = matches!(e, TransportError::Io(io) if matches!(
        io.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::HostUnreachable
            | std::io::ErrorKind::NetworkUnreachable
            | std::io::ErrorKind::TimedOut
    )) || matches!(e, TransportError::Timeout(..));
    NodeReport {
        address: address.to_string(),
        name: address.to_string(),
        health: if unreachable { "unreachable" } else { "error" }.into(),
        error: Some(e.to_string()),
        ..NodeReport::default()
    }
}

/// Layers as cluster files write them: `"0-14"`, or one range per round.
fn layers_text(s: &ringllm_protocol::control::StageStatus) -> String {
    let r = |a: u32, b: u32| format!("{}-{}", a, b.saturating_sub(1));
    if s.windows.is_empty() {
        r(s.layer_start, s.layer_end)
    } else {
        s.windows
            .iter()
            .map(|&(a, b)| r(a, b))
            .collect::<Vec<_>>()
            .join(",")
    }
}

fn report(address: &str, s: &NodeStatus, rtt: Duration) -> NodeReport {
    let health = match (&s.coordinator, &s.stage) {
        (Some(_), Some(_)) => "serving",
        (Some(_), None) => "held",
        (None, _) => "idle",
    };
    NodeReport {
        address: address.to_string(),
        // Names the nodes chose, shown on terminals: escaped (`untrusted::escape`).
        name: escape(&s.node_name).into_owned(),
        health: health.into(),
        error: None,
        version: Some(s.version.clone()),
        transport: Some(s.transport.to_string()),
        threads: Some(s.threads),
        isa: Some(s.isa.clone()),
        layers: s.stage.as_ref().map(layers_text),
        head: s.stage.as_ref().is_some_and(|t| t.head),
        model: s.stage.as_ref().map(|t| t.model.clone()),
        memory_total: Some(s.memory_total),
        memory_budget: Some(s.memory_budget),
        memory_used: Some(s.stats.rss_bytes),
        weight_bytes: s.stage.as_ref().map(|t| t.weight_bytes),
        kv_bytes: s.stage.as_ref().map(|t| t.kv_bytes),
        matvec_bytes_per_s: Some(s.matvec_bytes_per_s),
        tokens_per_s: Some(s.tokens_per_s),
        rtt_ms: Some(rtt.as_secs_f64() * 1e3),
        coordinator: s.coordinator.as_ref().map(|c| CoordinatorRef {
            name: escape(&c.name).into_owned(),
            address: escape(&c.address).into_owned(),
            held_s: c.held_ms as f64 / 1e3,
        }),
        bytes_in_per_s: Some(s.bytes_in_per_s),
        bytes_out_per_s: Some(s.bytes_out_per_s),
        bytes_in: Some(s.stats.bytes_in),
        bytes_out: Some(s.stats.bytes_out),
        tokens: Some(s.stats.tokens),
        uptime_s: Some(s.uptime_ms as f64 / 1e3),
    }
}

/// The name this machine gives itself when asking: `status@HOSTNAME`.
pub fn asker_name(what: &str) -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    if host.is_empty() {
        what.to_string()
    } else {
        format!("{what}@{host}")
    }
}

fn size(b: Option<u64>) -> String {
    match b {
        None => "-".into(),
        Some(b) if b >= 1 << 30 => format!("{:.1}G", b as f64 / (1u64 << 30) as f64),
        Some(b) => format!("{}M", b >> 20),
    }
}

fn rate(b: Option<f64>) -> String {
    match b {
        None => "-".into(),
        Some(r) if r >= 1e6 => format!("{:.1}MB/s", r / 1e6),
        Some(r) if r >= 1e3 => format!("{:.1}kB/s", r / 1e3),
        Some(r) => format!("{r:.0}B/s"),
    }
}

/// The report as a table for people.
pub fn table(r: &ClusterReport) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    if let Some(c) = &r.coordinator {
        let _ = writeln!(
            out,
            "coordinator: {} serving {}{}",
            c.status,
            c.model,
            if c.missing.is_empty() {
                String::new()
            } else {
                format!(" (missing: {})", c.missing.join(", "))
            }
        );
    }
    let head = [
        "NAME",
        "ADDRESS",
        "HEALTH",
        "TRANSPORT",
        "LAYERS",
        "MEM USED/BUDGET",
        "SPEED",
        "RTT",
        "IN",
        "OUT",
        "COORDINATOR",
    ];
    let mut rows: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
    for n in &r.nodes {
        let layers = match &n.layers {
            Some(l) if n.head => format!("{l}+head"),
            Some(l) => l.clone(),
            None => "-".into(),
        };
        rows.push(vec![
            n.name.clone(),
            n.address.clone(),
            n.health.clone(),
            n.transport.clone().unwrap_or_else(|| "-".into()),
            layers,
            format!("{}/{}", size(n.memory_used), size(n.memory_budget)),
            n.matvec_bytes_per_s
                .map_or_else(|| "-".into(), |s| format!("{:.1}GB/s", s / 1e9)),
            n.rtt_ms.map_or_else(|| "-".into(), |t| format!("{t:.2}ms")),
            rate(n.bytes_in_per_s),
            rate(n.bytes_out_per_s),
            n.coordinator.as_ref().map_or_else(
                || "-".into(),
                |c| format!("{} ({}, {:.0}s)", c.name, c.address, c.held_s),
            ),
        ]);
    }
    let widths: Vec<usize> = (0..head.len())
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    for row in &rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    for n in &r.nodes {
        if let Some(e) = &n.error {
            let _ = writeln!(out, "{} ({}): {e}", n.name, n.address);
        }
    }
    out
}
