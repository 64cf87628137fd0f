//! `ringllm up`, `ringllm plan`, `ringllm node` and `ringllm keygen`: the ring's commands.

use crate::cli::{ClusterSource, KeygenArgs, ModelArgs, NodeArgs, PlanArgs, UpArgs};
use crate::cluster::{self, ClusterConfig};
use crate::engine::{default_threads, open_gguf, Engine};
use crate::ring::{Ring, RingSpec, StageSpec};
use anyhow::{anyhow, bail, Context, Result};
use ringllm_node::KvType;
use ringllm_protocol::{ClusterKey, Dtype};
use std::path::PathBuf;
use std::process::ExitCode;

/// The model, key and stages of a ring, from a cluster file or from flags.
pub struct Setup {
    pub model: PathBuf,
    pub spec: RingSpec,
    pub ctx: Option<usize>,
    pub kv: Option<String>,
    pub threads: Option<usize>,
}

/// The setup a cluster file describes.
pub fn setup_cluster(path: &std::path::Path) -> Result<Setup> {
    setup(&ClusterSource {
        cluster: Some(path.to_path_buf()),
        model: None,
        key: None,
        nodes: Vec::new(),
        ctx: None,
        transport: None,
        activations: None,
    })
}

fn activations_flag(a: &str) -> Result<Dtype> {
    match Dtype::from_name(&a.trim().to_ascii_lowercase()) {
        Some(d) => Ok(d),
        None => bail!("--activations {a}: write f32, f16, bf16 or q8"),
    }
}

fn setup(src: &ClusterSource) -> Result<Setup> {
    let (cluster, model, key, nodes) = (&src.cluster, &src.model, &src.key, &src.nodes);
    match cluster {
        Some(path) => {
            if !nodes.is_empty() {
                bail!("give either a cluster file or --node flags, not both");
            }
            let cfg: ClusterConfig = cluster::load(path)?;
            let key_path = key.clone().unwrap_or_else(|| cfg.key_file.clone());
            let key = ClusterKey::load(&key_path)?;
            let activations = match &src.activations {
                Some(a) => activations_flag(a)?,
                None => Dtype::from_name(&cfg.activations).ok_or_else(|| {
                    anyhow!(
                        "{}: activations '{}' unknown",
                        path.display(),
                        cfg.activations
                    )
                })?,
            };
            let stages = cfg
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
            Ok(Setup {
                model: model.clone().unwrap_or(cfg.model.clone()),
                spec: RingSpec {
                    key,
                    stages,
                    coordinator_memory: cfg.memory,
                    activations,
                },
                ctx: cfg.ctx,
                kv: Some(cfg.kv.clone()),
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
            if nodes.is_empty() {
                bail!("give a cluster file, or at least one --node HOST:PORT");
            }
            let key = ClusterKey::load(key)?;
            let mut stages = Vec::new();
            for (i, n) in nodes.iter().enumerate() {
                if !n.contains(':') {
                    bail!("--node {n}: write it as HOST:PORT, e.g. {n}:7701");
                }
                stages.push(StageSpec {
                    name: format!("node{}", i + 1),
                    address: Some(n.clone()),
                    layers: None,
                    memory: None,
                    threads: None,
                    transport: src.transport,
                });
            }
            Ok(Setup {
                model,
                spec: RingSpec {
                    key,
                    stages,
                    coordinator_memory: None,
                    activations: match &src.activations {
                        Some(a) => activations_flag(a)?,
                        None => Dtype::from_name(cluster::DEFAULT_ACTIVATIONS)
                            .ok_or_else(|| anyhow!("bad default activation type"))?,
                    },
                },
                ctx: None,
                kv: None,
                threads: None,
            })
        }
    }
}

pub fn up(args: UpArgs) -> Result<ExitCode> {
    let s = setup(&args.source)?;
    let model = ModelArgs {
        model: s.model.clone(),
        threads: args.threads.or(s.threads),
        ctx: args.source.ctx.or(s.ctx),
        batch: args.batch,
        kv: args
            .kv
            .clone()
            .or(s.kv.clone())
            .unwrap_or_else(|| "f32".into()),
    };
    if args.gen.serve.serve.is_some() {
        return crate::serve::serve_ring(&model, s.spec.clone(), &args.gen);
    }
    let spec = s.spec.clone();
    let m2 = model.clone();
    crate::run::session(
        &move || Engine::load_ring(&m2, spec.clone()),
        &model,
        &args.sampling,
        &args.gen,
    )
}

pub fn plan(args: PlanArgs) -> Result<ExitCode> {
    let s = setup(&args.source)?;
    let file = open_gguf(&s.model)?;
    let ctx = args.source.ctx.or(s.ctx).unwrap_or(4096).max(1);
    let kv = KvType::from_name(s.kv.as_deref().unwrap_or("f32"))
        .ok_or_else(|| anyhow!("kv must be f32 or f16"))?;
    let threads = s.threads.unwrap_or_else(default_threads).max(1);
    let ring = Ring::connect(&s.spec, &s.model, &file, ctx, 512, kv, threads)?;
    if args.json {
        let caps = ring.capabilities();
        let rtts = ring.rtts();
        let nodes: Vec<serde_json::Value> = ring
            .node_names()
            .iter()
            .zip(caps.iter().zip(&rtts))
            .map(|((name, addr), (c, rtt))| {
                serde_json::json!({
                    "name": name, "address": addr,
                    "memory_available": c.memory_available,
                    "threads": c.threads,
                    "matvec_bytes_per_s": c.matvec_bytes_per_s,
                    "rtt_ms": rtt * 1e3,
                })
            })
            .collect();
        let stages: Vec<serde_json::Value> = ring
            .plan
            .stages
            .iter()
            .map(|p| {
                serde_json::json!({
                    "name": p.name, "address": p.address, "local": p.local,
                    "layers": [p.layers.start, p.layers.end],
                    "weight_bytes": p.weight_bytes, "kv_bytes": p.kv_bytes,
                    "compute_ms": p.compute_s * 1e3, "holds_head": p.holds_head,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "nodes": nodes,
                "stages": stages,
                "predicted_tokens_per_s": ring.plan.predicted_tokens_per_s,
            })
        );
    } else {
        for ((name, addr), (c, rtt)) in ring
            .node_names()
            .iter()
            .zip(ring.capabilities().iter().zip(ring.rtts()))
        {
            println!(
                "node {name} ({addr}): {} threads, {:.1} GiB available, matvec {:.1} GB/s, rtt {:.3} ms, isa {}",
                c.threads,
                c.memory_available as f64 / (1u64 << 30) as f64,
                c.matvec_bytes_per_s / 1e9,
                rtt * 1e3,
                c.isa
            );
        }
        print!("{}", ring.plan);
    }
    ring.shutdown("plan only");
    Ok(ExitCode::SUCCESS)
}

pub fn node(args: NodeArgs) -> Result<ExitCode> {
    let key = ClusterKey::load(&args.key)?;
    let name = args.name.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "node".into());
        let port = args.listen.rsplit(':').next().unwrap_or("");
        format!("{host}:{port}")
    });
    ringllm_node::daemon::serve(ringllm_node::daemon::NodeOptions {
        listen: args.listen.clone(),
        key,
        name,
        threads: args.threads.unwrap_or_else(default_threads).max(1),
        models_dir: args.models.clone(),
        transport: args.transport,
    })
    .map_err(|e| anyhow!(e))?;
    Ok(ExitCode::SUCCESS)
}

pub fn keygen(args: KeygenArgs) -> Result<ExitCode> {
    if args.file.exists() && !args.force {
        bail!(
            "{} exists; use --force to replace it (every node then needs the new key)",
            args.file.display()
        );
    }
    let text = ClusterKey::generate_text()?;
    write_private(&args.file, text.as_bytes())
        .with_context(|| format!("writing {}", args.file.display()))?;
    let key = ClusterKey::from_bytes(text.as_bytes())?;
    eprintln!(
        "wrote a new cluster key to {} (cluster id {}); copy it to every machine of the ring",
        args.file.display(),
        key.id_hex()
    );
    Ok(ExitCode::SUCCESS)
}

fn write_private(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)?;
        f.write_all(bytes)
    }
    #[cfg(not(unix))]
    {
        std::fs::write(path, bytes)
    }
}
