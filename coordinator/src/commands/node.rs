//! `ringllm node`: the worker daemon of a ring, serving a slice of a model to a coordinator.
//! This command binds `--listen`, runs the transport's start-up checks (refusing now rather
//! than at the first data link), and serves until Ctrl-C or SIGTERM; then it tells its
//! coordinator, finishes the step under way, closes its links and exits 0.

use crate::cli::NodeArgs;
use anyhow::{anyhow, Result};
use ringllm::cluster::discovery;
use ringllm::engine::default_threads;
use ringllm_node::daemon::{self, Listener, NodeOptions};
use ringllm_protocol::ident::NodeIdentity;
use ringllm_protocol::{sock, ClusterKey, TransportKind};
use std::process::ExitCode;
use std::time::Duration;
use tracing::{info, warn};

pub fn node(args: NodeArgs) -> Result<ExitCode> {
    let key = ClusterKey::load(&args.key)?;
    let key = match &args.node_key {
        Some(path) => with_node_key(key, path, args.name.as_deref())?,
        None => key,
    };
    let certified = key.identity().map(|id| id.name().to_string());
    let name = args.name.clone().or(certified).unwrap_or_else(|| {
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "node".into());
        let port = args.listen.rsplit(':').next().unwrap_or("");
        format!("{host}:{port}")
    });
    let opts = NodeOptions {
        key,
        name: name.clone(),
        threads: args.threads.unwrap_or_else(default_threads).max(1),
        models_dir: args.models.clone(),
        cache_dir: args.cache_dir(),
        transport: args.transport,
        memory: args.memory,
        repack: !args.layout.no_repack,
        stream: args.layout.stream.settings(),
        backend: args.layout.backend,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| anyhow!("cannot start the I/O runtime: {e}"))?;
    let served = rt.block_on(async move {
        let listener = bind(&args.listen, &opts).await?;
        let addr = listener.local_addr()?;
        eprintln!(
            "ringllm node '{}' listening on {addr} (cluster {}, data links over {}, slice cache {})",
            opts.name,
            opts.key.id_hex(),
            opts.transport,
            opts.cache_dir.display()
        );
        // Withdrawn (a goodbye on the LAN) when the daemon stops.
        let _advertised = if args.advertise {
            Some(advertise(&opts, addr, &args.mdns.mdns_interfaces)?)
        } else {
            None
        };
        // The daemon's messages name their causes already: keep them as they are.
        daemon::serve(listener, opts, shutdown_signal())
            .await
            .map_err(|e| anyhow!("{e}"))
    });
    // Blocking work still under way (a model being mapped) is not waited for long.
    rt.shutdown_timeout(Duration::from_secs(1));
    served?;
    eprintln!("ringllm node '{name}' stopped cleanly: links closed, exiting");
    Ok(ExitCode::SUCCESS)
}

/// `--node-key`: the node key, checked against the cluster key and `--name`.
fn with_node_key(
    key: ClusterKey,
    path: &std::path::Path,
    name: Option<&str>,
) -> Result<ClusterKey> {
    let id = NodeIdentity::load(path, &key)?;
    if let Some(n) = name.filter(|n| *n != id.name()) {
        return Err(anyhow!(
            "--name {n:?} differs from the name {:?} the node key {} certifies (leave --name out)",
            id.name(),
            path.display()
        ));
    }
    if key.is_revoked(id.name()) {
        return Err(anyhow!(
            "node {:?} is revoked (listed beside the cluster key): it may not join",
            id.name()
        ));
    }
    info!(
        "node key {}: {:?}, serial {:016x}",
        path.display(),
        id.name(),
        id.cert.serial
    );
    Ok(key.with_identity(id))
}

/// `--advertise`: announces the node by mDNS with what a coordinator needs to choose it.
fn advertise(
    opts: &NodeOptions,
    addr: std::net::SocketAddr,
    interfaces: &[String],
) -> Result<discovery::Advertised> {
    let (_, avail) = ringllm_model::sys::memory();
    let a = discovery::Advert {
        name: opts.name.clone(),
        listen: addr,
        threads: opts.threads as u32,
        memory_budget: ringllm_model::limits::budget(opts.memory).unwrap_or(avail),
        backend: ringllm_kernels::isa().name().to_string(),
        transport: opts.transport.to_string(),
        version: env!("CARGO_PKG_VERSION").to_string(),
    };
    let adv = discovery::advertise(&a, &opts.key, interfaces)?;
    eprintln!(
        "advertising '{}' on mDNS ({}, cluster hash {})",
        opts.name,
        discovery::SERVICE_TYPE,
        opts.key.discovery_hash()
    );
    Ok(adv)
}

/// Binds `--listen` and checks the transport can run here.
async fn bind(listen: &str, opts: &NodeOptions) -> Result<Listener> {
    let addr: std::net::SocketAddr = tokio::net::lookup_host(listen)
        .await
        .map_err(|e| anyhow!("--listen {listen}: {e}"))?
        .next()
        .ok_or_else(|| anyhow!("--listen {listen}: no address"))?;
    let tcp = sock::listen_tcp(addr).map_err(|e| anyhow!("cannot listen on {addr}: {e}"))?;
    let addr = tcp.local_addr()?;
    match opts.transport {
        TransportKind::Tcp | TransportKind::Quic => {}
        #[cfg(target_os = "linux")]
        TransportKind::Uring => {
            let s = ringllm_protocol::uring::probe().map_err(|e| {
                anyhow!(
                    "--transport uring: io_uring is not usable here: {e} (choose --transport \
                     tcp, udp or quic)"
                )
            })?;
            info!(send_zc = s.send_zc, "io_uring available");
        }
        #[cfg(not(target_os = "linux"))]
        TransportKind::Uring => {
            return Err(anyhow!(
                "--transport uring: {}",
                ringllm_protocol::dial::uring_unavailable()
            ));
        }
        TransportKind::Udp => {
            // Each reliable UDP link binds the UDP port of the listener's number.
            sock::bind_udp_reuse(addr)
                .map_err(|e| anyhow!("--transport udp: cannot bind UDP {addr}: {e}"))?;
        }
        TransportKind::Kmod => {
            // No silent fallback: without the module there is no kmod transport.
            ringllm_protocol::kmod::probe().map_err(|e| anyhow!("--transport kmod: {e}"))?;
            sock::bind_udp_reuse(addr)
                .map_err(|e| anyhow!("--transport kmod: cannot bind UDP {addr}: {e}"))?;
        }
    }
    // With QUIC, this binds the QUIC endpoint on the UDP port of the listener's number.
    Listener::new(tcp, opts).map_err(|e| anyhow!("--transport {}: {e}", opts.transport))
}

/// Resolves at Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            warn!("cannot watch for Ctrl-C: {e}");
            std::future::pending::<()>().await
        }
    };
    #[cfg(unix)]
    let term = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                warn!("cannot watch for SIGTERM: {e}");
                std::future::pending::<()>().await
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    let why = tokio::select! {
        _ = ctrl_c => "Ctrl-C (SIGINT)",
        _ = term => "SIGTERM",
    };
    // Always shown (as the listening line is): a service's log says why it stopped.
    eprintln!("ringllm node: {why}: finishing the step under way, closing links");
    info!("{why}: shutting down");
}
