//! The ring from the coordinator's side: cluster files (`file`, with messages from
//! `diagnostics`), the layer planner (`planner`), and the connection to the nodes that moves
//! hidden states around the ring (`ring`). `setup` turns a cluster file or command-line flags
//! into the `RingSpec` a ring is built from.

mod diagnostics;
pub mod discovery;
pub mod file;
pub mod planner;
pub mod probe;
pub mod ring;
pub mod status;
pub mod streaming;

pub use file::{load, parse_str, ClusterConfig, StageConfig};
pub use ring::{Ring, RingSpec, StageSpec, StreamPolicy};

use anyhow::{anyhow, bail, Result};
use ringllm_protocol::control::KvType;
use ringllm_protocol::{ClusterKey, TransportKind};
use std::path::{Path, PathBuf};

/// Where a ring is described: a cluster file, or a model, a key and node addresses. Fields
/// given here override the file's.
#[derive(Clone, Debug, Default)]
pub struct Source {
    /// Cluster file (TOML).
    pub cluster: Option<PathBuf>,
    /// GGUF model file.
    pub model: Option<PathBuf>,
    /// Cluster key file.
    pub key: Option<PathBuf>,
    /// Node addresses (`HOST:PORT`) in ring order, without a cluster file.
    pub nodes: Vec<String>,
    /// Transport of every data link.
    pub transport: Option<TransportKind>,
    /// Hidden states on the wire (`--activations`; overrides the file's).
    pub activations: Option<file::Activations>,
    /// Streaming layers when the model does not fit (`--rounds`).
    pub stream: StreamPolicy,
    /// Find the nodes by mDNS (`--discover`; a cluster file's `discover = true` also does).
    pub discover: bool,
    /// How long to listen (`--discover-wait`; default: the file's, else 3 s).
    pub discover_wait: Option<std::time::Duration>,
    /// Interfaces mDNS may use (`--mdns-interface`; empty: all).
    pub mdns_interfaces: Vec<String>,
}

/// How long `up` waits for nodes that do not answer yet (`--wait`).
pub const DEFAULT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The model, key and stages of a ring, from a cluster file or from flags.
pub struct Setup {
    pub model: PathBuf,
    pub spec: RingSpec,
    pub ctx: Option<usize>,
    pub kv: Option<KvType>,
    pub threads: Option<usize>,
}

/// The setup a cluster file describes.
pub fn setup_file(path: &Path) -> Result<Setup> {
    setup(&Source {
        cluster: Some(path.to_path_buf()),
        ..Source::default()
    })
}

/// The setup a cluster file or flags describe.
pub fn setup(src: &Source) -> Result<Setup> {
    let (cluster, model, key, nodes) = (&src.cluster, &src.model, &src.key, &src.nodes);
    match cluster {
        Some(path) => {
            if !nodes.is_empty() {
                bail!("give either a cluster file or --node flags, not both");
            }
            let cfg: ClusterConfig = file::load(path)?;
            let key_path = key.clone().unwrap_or_else(|| cfg.key_file.clone());
            let key = ClusterKey::load(&key_path)?;
            let activations = src.activations.unwrap_or(cfg.activations).dtype();
            let mut stages: Vec<StageSpec> = cfg
                .stages
                .iter()
                .map(|s| StageSpec {
                    name: s.name.clone(),
                    address: if s.local { None } else { s.address.clone() },
                    layers: s.layers.clone(),
                    memory: s.memory,
                    threads: s.threads,
                    transport: src.transport.or(s.transport).or(cfg.transport),
                })
                .collect();
            if src.discover || cfg.discover {
                let wait = src.discover_wait.or(cfg.discover_wait);
                add_discovered(
                    &mut stages,
                    &key,
                    wait,
                    src,
                    src.transport.or(cfg.transport),
                )?;
            }
            Ok(Setup {
                model: model.clone().unwrap_or(cfg.model.clone()),
                spec: RingSpec {
                    key,
                    stages,
                    coordinator_memory: cfg.memory,
                    activations,
                    send_slices: true,
                    discard_cached_slices: false,
                    stream: src.stream,
                    skip: None,
                    wait: DEFAULT_WAIT,
                },
                ctx: cfg.ctx,
                kv: Some(cfg.kv),
                threads: cfg.threads,
            })
        }
        None => {
            let model = model.clone().ok_or_else(|| {
                anyhow!("give a cluster file, or -m MODEL --key FILE --node HOST:PORT...")
            })?;
            let key = key.as_ref().ok_or_else(|| {
                anyhow!("--key FILE is needed with --node (the cluster key file)")
            })?;
            if nodes.is_empty() && !src.discover {
                bail!("give a cluster file, at least one --node HOST:PORT, or --discover");
            }
            let key = ClusterKey::load(key)?;
            let mut stages = Vec::new();
            for n in nodes {
                if !n.contains(':') {
                    bail!("--node {n}: write it as HOST:PORT, e.g. {n}:7701");
                }
                stages.push(StageSpec {
                    // Called by its address until it answers, then by the name it gives
                    // itself (`node --name`; see Ring::connect), so both ends say the same.
                    name: n.clone(),
                    address: Some(n.clone()),
                    layers: None,
                    memory: None,
                    threads: None,
                    transport: src.transport,
                });
            }
            if src.discover {
                add_discovered(&mut stages, &key, src.discover_wait, src, src.transport)?;
            }
            Ok(Setup {
                model,
                spec: RingSpec {
                    key,
                    stages,
                    coordinator_memory: None,
                    activations: src.activations.unwrap_or_default().dtype(),
                    send_slices: true,
                    discard_cached_slices: false,
                    stream: src.stream,
                    skip: None,
                    wait: DEFAULT_WAIT,
                },
                ctx: None,
                kv: None,
                threads: None,
            })
        }
    }
}

/// Browses mDNS for the nodes of `key`'s cluster and appends those not listed already (by
/// address), in name order, as if they had been listed.
fn add_discovered(
    stages: &mut Vec<StageSpec>,
    key: &ClusterKey,
    wait: Option<std::time::Duration>,
    src: &Source,
    transport: Option<TransportKind>,
) -> Result<()> {
    let wait = wait.unwrap_or(discovery::DEFAULT_WAIT);
    for f in discovery::discover_nodes(key, wait, &src.mdns_interfaces)? {
        if stages
            .iter()
            .any(|s| s.address.as_deref() == Some(f.address.as_str()))
        {
            continue;
        }
        // A name taken by a listed node keeps the node apart by its address.
        let name = if stages.iter().any(|s| s.name == f.name) {
            format!("{} ({})", f.name, f.address)
        } else {
            f.name.clone()
        };
        stages.push(StageSpec {
            name,
            address: Some(f.address.clone()),
            layers: None,
            memory: None,
            threads: None,
            transport,
        });
    }
    Ok(())
}

/// Waits up to `wait` for every node of `spec` to answer the handshake (machines of a home
/// lab boot in any order; a frozen node or another program on its port does not count),
/// saying once (a notice) which ones it waits for. Returns the nodes still not answering
/// then, as "name (address)".
pub fn wait_for_nodes(spec: &RingSpec, wait: std::time::Duration) -> Vec<String> {
    let deadline = std::time::Instant::now() + wait;
    let mut said = false;
    let remote: Vec<&StageSpec> = spec.stages.iter().filter(|s| s.address.is_some()).collect();
    let addrs: Vec<String> = remote.iter().filter_map(|s| s.address.clone()).collect();
    loop {
        let answers = probe::handshake_all(&addrs, &spec.key, probe::QUICK_PROBE_DEADLINE);
        let missing: Vec<String> = remote
            .iter()
            .zip(&answers)
            .filter(|(_, a)| a.is_err())
            .map(|(s, _)| s.label())
            .collect();
        if missing.is_empty() || std::time::Instant::now() >= deadline {
            return missing;
        }
        if !said {
            notice!(
                "waiting up to {:.0} s for {} to answer",
                wait.as_secs_f64(),
                missing.join(", ")
            );
            said = true;
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
}
