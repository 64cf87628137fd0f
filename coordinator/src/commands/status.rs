//! `ringllm status`: what every node of a cluster is doing, asked of the nodes directly (a
//! status connection, which works while a coordinator holds them) or of a serving
//! coordinator (`--url`: its `GET /v1/cluster`). Table or `--json`; `--watch` repeats.

use crate::cli::StatusArgs;
use anyhow::{anyhow, bail, Context, Result};
use ringllm::cluster::{self, discovery, status};
use ringllm_protocol::ClusterKey;
use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;
use std::time::Duration;

/// Largest `/v1/cluster` answer read.
const MAX_BODY: usize = 8 << 20;

enum Target {
    Nodes {
        key: ClusterKey,
        addrs: Vec<String>,
    },
    Url {
        addr: String,
        api_key: Option<String>,
    },
}

pub fn status(args: StatusArgs) -> Result<ExitCode> {
    let target = target(&args)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| anyhow!("cannot start the I/O runtime: {e}"))?;
    let watch = match args.watch {
        None => None,
        Some(s) if (0.2..=3600.0).contains(&s) => Some(Duration::from_secs_f64(s)),
        Some(s) => bail!("--watch {s}: give seconds from 0.2 to 3600"),
    };
    let tty = std::io::stdout().is_terminal();
    loop {
        let report = match &target {
            Target::Nodes { key, addrs } => status::ClusterReport {
                coordinator: None,
                nodes: rt.block_on(status::query_all(addrs, key, &status::asker_name("status"))),
            },
            Target::Url { addr, api_key } => get_cluster(addr, api_key.as_deref())?,
        };
        let text = if args.json {
            format!("{}\n", serde_json::to_string_pretty(&report)?)
        } else {
            status::table(&report)
        };
        if watch.is_some() && tty {
            // Clear the screen and go home.
            out!("\x1b[2J\x1b[H");
        }
        out!("{text}");
        let _ = std::io::stdout().flush();
        match watch {
            Some(every) => std::thread::sleep(every),
            None => return Ok(ExitCode::SUCCESS),
        }
    }
}

fn target(args: &StatusArgs) -> Result<Target> {
    if let Some(url) = &args.url {
        if args.cluster.is_some() || !args.nodes.is_empty() || args.discover {
            bail!("give either --url or the nodes (a cluster file, --nodes, --discover), not both");
        }
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| anyhow!("--url takes http://HOST:PORT, not '{url}'"))?;
        let addr = rest
            .trim_end_matches('/')
            .trim_end_matches("/v1/cluster")
            .trim_end_matches("/v1")
            .to_string();
        if addr.is_empty() || addr.contains('/') {
            bail!("--url takes http://HOST:PORT, not '{url}'");
        }
        return Ok(Target::Url {
            addr,
            api_key: args.api_key.clone(),
        });
    }
    let mut addrs: Vec<String> = Vec::new();
    let mut key_path = args.key.clone();
    let mut discover = args.discover;
    let mut wait = args.discover_wait;
    if let Some(path) = &args.cluster {
        let cfg = cluster::load(path)?;
        key_path = key_path.or(Some(cfg.key_file.clone()));
        addrs.extend(cfg.stages.iter().filter_map(|s| s.address.clone()));
        discover |= cfg.discover;
        wait = wait.or(cfg.discover_wait);
    }
    for n in &args.nodes {
        if !n.contains(':') {
            bail!("--nodes {n}: write it as HOST:PORT, e.g. {n}:7701");
        }
        addrs.push(n.clone());
    }
    let key_path = key_path.ok_or_else(|| {
        anyhow!("--key FILE is needed to ask the nodes (or a cluster file, or --url)")
    })?;
    let key = ClusterKey::load(&key_path)?;
    if discover {
        let found = discovery::discover_nodes(
            &key,
            wait.unwrap_or(discovery::DEFAULT_WAIT),
            &args.mdns.mdns_interfaces,
        )?;
        for f in found {
            if !addrs.contains(&f.address) {
                addrs.push(f.address);
            }
        }
    }
    if addrs.is_empty() {
        bail!("no nodes to ask: give a cluster file, --nodes HOST:PORT,..., --discover or --url");
    }
    Ok(Target::Nodes { key, addrs })
}

/// `GET /v1/cluster` of a serving coordinator.
fn get_cluster(addr: &str, api_key: Option<&str>) -> Result<status::ClusterReport> {
    let timeout = status::STATUS_TIMEOUT * 3;
    let sock: std::net::SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .with_context(|| format!("--url: cannot resolve {addr}"))?
        .next()
        .ok_or_else(|| anyhow!("--url: {addr} has no address"))?;
    let mut s = std::net::TcpStream::connect_timeout(&sock, timeout)
        .with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let auth = api_key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    write!(
        s,
        "GET /v1/cluster HTTP/1.1\r\nHost: {addr}\r\n{auth}Accept: application/json\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.take(MAX_BODY as u64 + 1)
        .read_to_end(&mut raw)
        .with_context(|| format!("reading the answer of {addr}"))?;
    if raw.len() > MAX_BODY {
        bail!("{addr}: the answer is larger than {} MiB", MAX_BODY >> 20);
    }
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("{addr}: not an HTTP answer"))?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut body = raw[split + 4..].to_vec();
    let status_line = head.lines().next().unwrap_or("");
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    if chunked {
        body = dechunk(&body).ok_or_else(|| anyhow!("{addr}: a broken chunked answer"))?;
    }
    if !status_line.contains(" 200 ") {
        bail!(
            "{addr}/v1/cluster answered {}: {}",
            status_line.trim(),
            String::from_utf8_lossy(&body).trim()
        );
    }
    serde_json::from_slice(&body)
        .with_context(|| format!("{addr}/v1/cluster: not a cluster report"))
}

fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&b[..eol]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        b = &b[eol + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(..size)?);
        b = b.get(size + 2..)?;
    }
}
