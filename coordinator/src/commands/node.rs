//! `ringllm node`: the worker daemon of a ring, serving a slice of a model to a coordinator.

use crate::cli::NodeArgs;
use anyhow::{anyhow, Result};
use ringllm::engine::default_threads;
use ringllm_protocol::ClusterKey;
use std::process::ExitCode;

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
