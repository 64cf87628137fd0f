//! `ringllm nodes`: lists the ringllm nodes heard on the LAN by mDNS (`node --advertise`),
//! marking with `--key` which are of that key's cluster (those that answered its handshake).
//! Every text in the table came from the LAN and is escaped (`discovery::Found`).

use crate::cli::NodesArgs;
use anyhow::Result;
use ringllm::cluster::discovery;
use ringllm_protocol::ClusterKey;
use std::process::ExitCode;

pub fn nodes(args: NodesArgs) -> Result<ExitCode> {
    let key = args.key.as_deref().map(ClusterKey::load).transpose()?;
    let b = discovery::browse(key.as_ref(), args.wait, &args.mdns.mdns_interfaces)?;
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&b.found)?);
        return Ok(ExitCode::SUCCESS);
    }
    if b.found.is_empty() {
        eprintln!(
            "no ringllm node answered on mDNS within {:.1} s",
            args.wait.as_secs_f64()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let mut rows = vec![[
        "NAME",
        "ADDRESS",
        "CLUSTER",
        "THREADS",
        "MEMORY",
        "BACKEND",
        "TRANSPORT",
        "VERSION",
    ]
    .map(String::from)];
    for f in &b.found {
        // With a key, "ours" only for a node that answered it (anyone can claim the hash).
        let cluster = match (f.same_cluster, f.answered) {
            (Some(true), Some(false)) => format!("{} (claimed, no answer)", f.cluster),
            (Some(true), _) => format!("{} (ours)", f.cluster),
            (Some(false), _) => format!("{} (other)", f.cluster),
            (None, _) => f.cluster.clone(),
        };
        let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        rows.push([
            f.name.clone(),
            f.address.clone(),
            cluster,
            f.threads.map_or_else(|| "-".into(), |t| t.to_string()),
            f.memory_budget
                .map_or_else(|| "-".into(), |m| format!("{} MiB", m >> 20)),
            opt(&f.backend),
            opt(&f.transport),
            opt(&f.version),
        ]);
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        outln!("{}", line.join("  ").trim_end());
    }
    Ok(ExitCode::SUCCESS)
}
