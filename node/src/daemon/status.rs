//! Status and statistics: the start-up probe (speed, models, disk, budget), the sampled
//! rates, the answers to `GetStatus` and `GetStats`, and status connections.

use super::state::{Node, Rates};
use super::{DaemonError, NodeOptions};
use ringllm_model::gguf::GgufFile;
use ringllm_model::slice::model_identity;
use ringllm_model::{limits, sys};
use ringllm_protocol::control::{
    Capabilities, Control, ErrorCode, ErrorMsg, Holder as StatusHolder, ModelIdentity, NodeStatus,
    Stats,
};
use ringllm_protocol::control_conn::{self, control_of};
use ringllm_protocol::{Link, TransportError};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

/// What this node offers, measured once at start-up: its matrix-vector speed (or its GPU's),
/// the models it holds, its disk's read rate and its memory budget. Fails when the backend
/// asked for is not there, or a probe task fails.
pub(super) async fn probe(opts: &NodeOptions) -> Result<Capabilities, DaemonError> {
    let threads = opts.threads.max(1);
    let dir = opts.models_dir.clone();
    let cache = opts.cache_dir.clone();
    let (speed, models, disk) = tokio::task::spawn_blocking(move || {
        (
            sys::matvec_speed(threads, Duration::from_millis(200)),
            scan_models(&dir),
            disk_read_rate(&[&dir, &cache]),
        )
    })
    .await
    .map_err(DaemonError::Probe)?;
    // A GPU backend is opened once now: a node asked for one that has none refuses to start,
    // and the planner gets the GPU's measured speed instead of the CPU's.
    let choice = opts.backend;
    let gpu = tokio::task::spawn_blocking(move || ringllm_model::backend::probe(choice))
        .await
        .map_err(DaemonError::Probe)?
        .map_err(|e| DaemonError::Backend(e.to_string()))?;
    let (backend, speed) = match gpu {
        Some((name, gpu_speed)) => (name, gpu_speed),
        None => ("cpu".to_string(), speed),
    };
    // Memory a finished session's scratch left in the allocator counts as room.
    sys::release_free_memory();
    let (total, avail) = sys::memory();
    // What the planner may use here: --memory, MemAvailable and the cgroup limits, whichever
    // is smallest.
    let budget = limits::budget(opts.memory).unwrap_or(avail);
    let caps = Capabilities {
        node_name: opts.name.clone(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        memory_total: total,
        memory_available: budget,
        threads: threads as u32,
        cpu_features: sys::cpu_features(),
        isa: ringllm_kernels::isa().name().to_string(),
        matvec_bytes_per_s: speed,
        models,
        transport: opts.transport,
        disk_read_bytes_per_s: disk,
        backend,
    };
    info!(
        backend = %caps.backend,
        speed_gbs = speed / 1e9,
        models = caps.models.len(),
        budget_mib = budget >> 20,
        "node ready"
    );
    Ok(caps)
}

/// The read rate of the largest model or slice file under `dirs` (page cache bypassed), for
/// the planner's streaming plans; 0 when there is none or it cannot be read.
fn disk_read_rate(dirs: &[&Path]) -> f64 {
    let mut best: Option<(u64, PathBuf)> = None;
    let mut visit = |p: PathBuf| {
        if let Ok(m) = std::fs::metadata(&p) {
            if m.is_file() && best.as_ref().is_none_or(|b| m.len() > b.0) {
                best = Some((m.len(), p));
            }
        }
    };
    for d in dirs {
        let Ok(rd) = std::fs::read_dir(d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                // Slices live one level down.
                for e2 in std::fs::read_dir(&p).into_iter().flatten().flatten() {
                    visit(e2.path());
                }
            } else {
                visit(p);
            }
        }
    }
    let Some((len, path)) = best else {
        return 0.0;
    };
    // From a quarter in (the start is the header, likely cached anyway); 256 MiB, so that a
    // throttled or bursty device shows its sustained rate.
    ringllm_model::stream::measure_read_rate(&path, len / 4, 256 << 20)
        .or_else(|_| ringllm_model::stream::measure_read_rate(&path, 0, 256 << 20))
        .unwrap_or(0.0)
}

/// The models (`*.gguf`) in `dir`, by file name.
fn scan_models(dir: &Path) -> Vec<ModelIdentity> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        warn!(dir = %dir.display(), "models directory is not readable");
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let p = e.path();
        if p.extension().and_then(|s| s.to_str()) != Some("gguf") {
            continue;
        }
        match GgufFile::open_lean(&p) {
            Ok(f) => out.push(model_identity(&p, &f)),
            Err(err) => warn!(file = %p.display(), "skipping unreadable model: {err}"),
        }
    }
    out.sort_by(|a, b| a.file_name.cmp(&b.file_name));
    out
}

/// Longest silence on a status connection before the node closes it (`status --watch`
/// asks every few seconds).
pub const MONITOR_SILENCE: Duration = Duration::from_secs(120);

/// A status connection (`Role::Monitor`): answers `GetStatus` (and heartbeats) until the
/// peer closes it, goes silent or sends anything else. It never touches the coordinator slot.
pub(super) async fn monitor_conn(node: &Arc<Node>, link: Link) {
    let who = format!(
        "monitor '{}' ({})",
        ringllm_protocol::untrusted::escape(&link.session.peer.name),
        link.peer_addr
    );
    debug!("{who}: connected");
    let Link { mut tx, mut rx, .. } = link;
    let mut buf = Vec::new();
    loop {
        let h = match tokio::time::timeout(MONITOR_SILENCE, rx.recv(&mut buf)).await {
            Err(_) => {
                debug!("{who}: silent for {} s; closing", MONITOR_SILENCE.as_secs());
                return;
            }
            Ok(Err(TransportError::Closed)) => return,
            Ok(Err(e)) => {
                warn!("{who}: {e}; closing");
                return;
            }
            Ok(Ok(h)) => h,
        };
        let reply = match control_of(&h, &buf) {
            Ok(Control::GetStatus) => Control::Status(Box::new(node_status(node))),
            Ok(Control::Heartbeat {
                nonce,
                reply: false,
            }) => Control::Heartbeat { nonce, reply: true },
            Ok(other) => {
                let m = format!(
                    "a status connection takes get-status only, not {}",
                    other.name()
                );
                warn!("{who}: {m}");
                Control::Error(ErrorMsg {
                    code: ErrorCode::BadRequest,
                    seq: None,
                    message: m,
                })
            }
            Err(e) => {
                warn!("{who}: {e}");
                Control::Error(ErrorMsg {
                    code: ErrorCode::BadRequest,
                    seq: None,
                    message: e.to_string(),
                })
            }
        };
        let bad = matches!(reply, Control::Error(_));
        if let Err(e) = control_conn::send_control(tx.as_mut(), &reply).await {
            debug!("{who}: {e}");
            return;
        }
        if bad {
            return;
        }
    }
}

/// Samples the session's counters every second into `node.rates`.
pub(super) async fn sample_rates(node: Arc<Node>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = node.stopped() => return,
        }
        let now = Instant::now();
        let sample = {
            let st = node.lock();
            st.session.as_ref().map(|s| {
                let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
                (
                    s.id,
                    [
                        g(&s.stats.bytes_in),
                        g(&s.stats.bytes_out),
                        g(&s.stats.tokens),
                    ],
                )
            })
        };
        let mut r = node.rates.lock().unwrap_or_else(|e| e.into_inner());
        match sample {
            None => *r = Rates::default(),
            Some((id, counts)) => {
                r.per_s = match r.last {
                    Some((t, last_id, last)) if last_id == id => {
                        let dt = now.duration_since(t).as_secs_f64().max(1e-3);
                        std::array::from_fn(|i| counts[i].saturating_sub(last[i]) as f64 / dt)
                    }
                    _ => [0.0; 3],
                };
                r.last = Some((now, id, counts));
            }
        }
    }
}

/// The node's answer to a status query.
fn node_status(node: &Node) -> NodeStatus {
    let stats = node_stats(node);
    let (coordinator, stage) = {
        let st = node.lock();
        (
            st.coordinator.as_ref().map(|h| StatusHolder {
                name: h.name.clone(),
                address: h.address.clone(),
                held_ms: h.since.elapsed().as_millis() as u64,
            }),
            st.session.as_ref().map(|s| s.info.clone()),
        )
    };
    let per_s = node.rates.lock().unwrap_or_else(|e| e.into_inner()).per_s;
    let c = &node.caps;
    NodeStatus {
        node_name: node.opts.name.clone(),
        version: c.version.clone(),
        listen: node.addr.to_string(),
        transport: c.transport,
        threads: c.threads,
        isa: c.isa.clone(),
        memory_total: c.memory_total,
        memory_budget: c.memory_available,
        matvec_bytes_per_s: c.matvec_bytes_per_s,
        disk_read_bytes_per_s: c.disk_read_bytes_per_s,
        uptime_ms: node.started.elapsed().as_millis() as u64,
        coordinator,
        stage,
        stats,
        bytes_in_per_s: per_s[0],
        bytes_out_per_s: per_s[1],
        tokens_per_s: per_s[2],
    }
}

/// The counters of the current session (`GetStats`).
pub(super) fn node_stats(node: &Node) -> Stats {
    let st = node.lock();
    let mut out = Stats {
        rss_bytes: sys::rss_bytes(),
        ..Stats::default()
    };
    if let Some(s) = st.session.as_ref() {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        out.session = s.id;
        out.frames_in = g(&s.stats.frames_in);
        out.frames_out = g(&s.stats.frames_out);
        out.bytes_in = g(&s.stats.bytes_in);
        out.bytes_out = g(&s.stats.bytes_out);
        out.tokens = g(&s.stats.tokens);
        out.compute_us = g(&s.stats.compute_us);
        out.busy_us = g(&s.stats.busy_us);
        if let Some(st) = &s.streamer {
            let c = st.stats();
            out.stream_bytes_read = c.bytes_read;
            out.stream_stall_us = (c.stall_s * 1e6) as u64;
            out.stream_layers_skipped = c.layers_skipped;
        }
    }
    out
}
