//! An assignment, by phase: the previous session ends; the assignment is checked (activations,
//! file name, sizes); the model file (or a checked slice) is opened; the stage is loaded off
//! the runtime (`stage`: windows, streamed tier, runner and KV); the link to the next hop is
//! dialled; the compute thread starts and the session is registered.

use super::slices;
use super::stage::{load_stage, Loaded, StageLoad};
use super::state::{Node, Outgoing, SessionHandle};
use super::worker::{Attached, SessionStats, Worker};
use super::{AssignError, HANDSHAKE_TIMEOUT, MAX_PAYLOAD};
use ringllm_model::gguf::GgufFile;
use ringllm_model::slice::model_identity;
use ringllm_model::{limits, sys};
use ringllm_protocol::control::{Assignment, NextHop, Ready, SliceKey, StageStatus};
use ringllm_protocol::dial::{self, BoxLink};
use ringllm_protocol::Dtype;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::{info, warn};

/// The sizes an assignment asks for, with this node's defaults filled in, each within its
/// limit.
#[derive(Clone, Copy)]
struct Sizing {
    threads: usize,
    ctx: usize,
    max_batch: usize,
    slots: usize,
}

impl Sizing {
    /// A coordinator's settings are checked again here: a wrong one must not abort the node.
    fn of(node: &Node, a: &Assignment) -> Result<Sizing, AssignError> {
        let threads = if a.threads == 0 {
            node.opts.threads
        } else {
            a.threads as usize
        }
        .max(1);
        let (ctx, max_batch) = (a.kv_ctx.max(1) as usize, a.max_batch.max(1) as usize);
        let slots = a.kv_slots.max(1) as usize;
        let limit = |source| AssignError::Limit {
            node: node.opts.name.clone(),
            source,
        };
        limits::check("threads", threads, limits::MAX_THREADS).map_err(limit)?;
        limits::check("batch size", max_batch, limits::MAX_BATCH).map_err(limit)?;
        limits::check("context size", ctx, limits::MAX_CTX).map_err(limit)?;
        limits::check("KV slots", slots, limits::MAX_SLOTS).map_err(limit)?;
        Ok(Sizing {
            threads,
            ctx,
            max_batch,
            slots,
        })
    }
}

/// Takes assignment `a` for control connection `conn_id`: replaces its previous session,
/// loads the stage, links it to its next hop and starts its compute thread, which reports to
/// `coord_out`. `checked`: the slices this coordinator sent or offered, checked.
pub(super) async fn assign(
    node: &Arc<Node>,
    a: Assignment,
    conn_id: u64,
    coord_out: mpsc::Sender<Outgoing>,
    checked: &[(SliceKey, PathBuf)],
) -> Result<Ready, AssignError> {
    let t0 = Instant::now();
    end_previous_session(node).await;
    check(&node.opts.name, &a)?;
    let file = open_model(node, &a, checked).await?;
    slow_disk_for_tests().await;
    let sizing = Sizing::of(node, &a)?;
    let loaded = load(node, &a, file, &sizing).await?;
    let next = dial_next_hop(node, &a).await?;
    let (weight_bytes, kv_bytes) = (loaded.weight_bytes, loaded.kv_bytes);
    let session = start_worker(node, &a, conn_id, coord_out, loaded, next, &sizing)?;
    let ready = Ready {
        session: a.session,
        layer_start: a.layer_start,
        layer_end: a.layer_end,
        weight_bytes,
        kv_bytes,
        rss_bytes: sys::rss_bytes(),
        load_ms: t0.elapsed().as_millis() as u64,
    };
    info!(
        session = a.session,
        layers = ?(a.layer_start..a.layer_end),
        weights_mib = weight_bytes >> 20,
        kv_mib = kv_bytes >> 20,
        rss_mib = ready.rss_bytes >> 20,
        "assignment loaded"
    );
    node.lock().session = Some(session);
    node.changed.notify_waiters();
    Ok(ready)
}

/// `RINGLLM_NODE_LOAD_DELAY_MS`: stands for a slice loading from a cold or slow disk, for
/// the tests of nodes that become ready seconds apart (the coordinator must keep every node's
/// control link alive meanwhile). Unset, nothing waits.
async fn slow_disk_for_tests() {
    let ms = std::env::var("RINGLLM_NODE_LOAD_DELAY_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(ms) = ms {
        warn!("RINGLLM_NODE_LOAD_DELAY_MS: loading waits {ms} ms (a test's slow disk)");
        tokio::time::sleep(Duration::from_millis(ms.min(600_000))).await;
    }
}

/// Ends this connection's previous session (a new assignment replaces it) and waits for its
/// compute thread, which frees its slice (resident tier, layer buffers) when it ends: a
/// capped node must not hold both.
async fn end_previous_session(node: &Node) {
    node.lock().session = None;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline
        && node
            .compute
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|t| !t.is_finished())
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What an assignment must be before anything is opened: activations a stage can carry, and
/// a model file name with no path in it.
fn check(name: &str, a: &Assignment) -> Result<(), AssignError> {
    if a.activations == Dtype::Bytes {
        return Err(AssignError::Activations {
            node: name.to_string(),
        });
    }
    let fname = &a.model.file_name;
    if fname.is_empty() || fname.contains('/') || fname.contains('\\') || fname.starts_with('.') {
        return Err(AssignError::FileName {
            node: name.to_string(),
            file: fname.clone(),
        });
    }
    Ok(())
}

/// The assignment's model: the file mapped for the last assignment if it is the same, the
/// model file in the models directory (checked against the assignment's identity), or, with
/// no such file, a checked slice.
async fn open_model(
    node: &Node,
    a: &Assignment,
    checked: &[(SliceKey, PathBuf)],
) -> Result<Arc<GgufFile>, AssignError> {
    let name = node.opts.name.clone();
    let path = node.opts.models_dir.join(&a.model.file_name);
    let cached = node
        .lock()
        .cache
        .as_ref()
        .filter(|(id, _)| *id == a.model)
        .map(|(_, f)| Arc::clone(f));
    if let Some(f) = cached {
        return Ok(f);
    }
    if !path.exists() {
        return open_slice(node, a, checked).await;
    }
    let p = path.clone();
    let f = tokio::task::spawn_blocking(move || GgufFile::open_lean(&p))
        .await?
        .map_err(|e| AssignError::Unreadable {
            node: name.clone(),
            path: path.clone(),
            source: Box::new(e),
        })?;
    let f = Arc::new(f);
    let id = model_identity(&path, &f);
    if id != a.model {
        return Err(AssignError::NotTheModel {
            node: name,
            path,
            size: id.size,
            want_size: a.model.size,
            hash: id.header_hash,
            want_hash: a.model.header_hash,
        });
    }
    node.lock().cache = Some((id, Arc::clone(&f)));
    Ok(f)
}

/// No model file: a slice the coordinator sent (or offered and found here), else one in the
/// cache checked against the offer stored with it.
async fn open_slice(
    node: &Node,
    a: &Assignment,
    checked: &[(SliceKey, PathBuf)],
) -> Result<Arc<GgufFile>, AssignError> {
    let name = node.opts.name.clone();
    let key = SliceKey {
        model: a.model.clone(),
        layer_start: a.layer_start,
        layer_end: a.layer_end,
        head: a.head,
    };
    let found = match checked.iter().find(|(k, _)| *k == key) {
        Some((_, p)) => Some(p.clone()),
        None => {
            let (cache, k) = (node.opts.cache_dir.clone(), key.clone());
            tokio::task::spawn_blocking(move || slices::cached(&cache, &k)).await?
        }
    };
    let Some(slice) = found else {
        return Err(AssignError::NoModelFile {
            node: name,
            file: a.model.file_name.clone(),
            dir: node.opts.models_dir.clone(),
            cache: node.opts.cache_dir.clone(),
        });
    };
    info!(
        "layers {}-{}: using the slice {}",
        a.layer_start,
        a.layer_end,
        slice.display()
    );
    let p = slice.clone();
    let f = tokio::task::spawn_blocking(move || GgufFile::open_lean(&p))
        .await?
        .map_err(|e| AssignError::Unreadable {
            node: name.clone(),
            path: slice,
            source: Box::new(e),
        })?;
    Ok(Arc::new(f))
}

/// Loads the stage off the runtime (mapping, prefaulting and repacking take a while).
async fn load(
    node: &Node,
    a: &Assignment,
    file: Arc<GgufFile>,
    sizing: &Sizing,
) -> Result<Loaded, AssignError> {
    let n2 = node.opts.name.clone();
    let range = a.layer_start as usize..a.layer_end as usize;
    let head = a.head;
    let kv_type = a.kv_type;
    let cap = node.opts.memory;
    let repack = node.opts.repack && node.opts.backend == ringllm_model::BackendChoice::Cpu;
    let backend = node.opts.backend;
    let settings = node.opts.stream;
    let layout = a.layout.clone();
    let model_hash = a.model.header_hash;
    let Sizing {
        threads,
        ctx,
        max_batch,
        slots,
    } = *sizing;
    tokio::task::spawn_blocking(move || {
        load_stage(&StageLoad {
            node: &n2,
            file,
            range,
            layout: &layout,
            head,
            repack,
            backend,
            cap,
            settings,
            threads,
            max_batch,
            ctx,
            kv_type,
            slots,
            model_hash,
        })
    })
    .await?
}

/// The link to the next node, if the output does not go back to the coordinator.
async fn dial_next_hop(node: &Node, a: &Assignment) -> Result<Option<BoxLink>, AssignError> {
    let NextHop::Node {
        name: next,
        address,
        transport,
    } = &a.next_hop
    else {
        return Ok(None);
    };
    let link = dial::connect_data_link(
        &dial::DialSpec {
            kind: *transport,
            addr: address,
            name: &node.opts.name,
            timeout: HANDSHAKE_TIMEOUT,
            max_payload: MAX_PAYLOAD,
            ring_session: a.session,
            role: dial::LinkRole::Input,
        },
        &node.opts.key,
    )
    .await
    .map_err(|source| AssignError::NextHop {
        node: node.opts.name.clone(),
        next: next.clone(),
        address: address.clone(),
        source,
    })?;
    Ok(Some(link))
}

/// Starts the stage's compute thread (its runner, one KV cache per window and slot, made on
/// first use) and returns the session that owns it.
fn start_worker(
    node: &Node,
    a: &Assignment,
    conn_id: u64,
    coord_out: mpsc::Sender<Outgoing>,
    loaded: Loaded,
    next: Option<BoxLink>,
    sizing: &Sizing,
) -> Result<SessionHandle, AssignError> {
    let info = StageStatus {
        session: a.session,
        model: a.model.file_name.clone(),
        layer_start: a.layer_start,
        layer_end: a.layer_end,
        head: a.head,
        windows: a.layout.windows.clone(),
        streamed_layers: loaded
            .streamer
            .as_ref()
            .map_or(0, |s| s.layers().len() as u32),
        weight_bytes: loaded.weight_bytes,
        kv_bytes: loaded.kv_bytes,
    };
    let next_name = match &a.next_hop {
        NextHop::Coordinator => "the coordinator".to_string(),
        NextHop::Node {
            name,
            address,
            transport,
        } => format!("next hop '{name}' ({address}, {transport})"),
    };
    let closers = Arc::new(Mutex::new(Vec::new()));
    if let Some(l) = &next {
        if let Ok(c) = l.closer() {
            closers.lock().unwrap_or_else(|e| e.into_inner()).push(c);
        }
    }
    let stats = Arc::new(SessionStats::default());
    let stop = Arc::new(AtomicBool::new(false));
    let step = Arc::new(Mutex::new(()));
    let release = Arc::new(Mutex::new(Vec::new()));
    let (attach_tx, attach_rx) = std::sync::mpsc::channel::<Attached>();
    let Loaded {
        runner,
        windows,
        streamer,
        ..
    } = loaded;
    let worker = Worker {
        name: node.opts.name.clone(),
        caches: windows
            .iter()
            .map(|_| (0..sizing.slots).map(|_| None).collect())
            .collect(),
        runner,
        windows,
        kv_ctx: sizing.ctx,
        kv_type: a.kv_type,
        head: a.head,
        activations: a.activations,
        coord: coord_out,
        stats: Arc::clone(&stats),
        next,
        next_name,
        output_to_coordinator: a.next_hop == NextHop::Coordinator,
        stop: Arc::clone(&stop),
        closers: Arc::clone(&closers),
        release: Arc::clone(&release),
        step: Arc::clone(&step),
    };
    let thread = std::thread::Builder::new()
        .name(format!("compute-{}", a.session))
        .spawn(move || {
            worker.run(attach_rx);
            // The session's scratch, caches and weights are gone: what the allocator kept of
            // them goes back to the system, so the node at rest holds what it uses.
            ringllm_model::sys::release_free_memory();
        })
        .map_err(AssignError::Thread)?;
    node.add_compute_thread(thread);
    Ok(SessionHandle {
        id: a.session,
        conn_id,
        attach: attach_tx,
        stats,
        stop,
        closers,
        release,
        slots: sizing.slots,
        streamer,
        step,
        info,
    })
}
