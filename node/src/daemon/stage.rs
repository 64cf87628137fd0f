//! Loading a stage, off the runtime: its windows checked against its layers; the runner's
//! scratch and KV caches checked against the budget; the streamed tier (as the coordinator
//! planned it, or what the budget leaves); the windows' models, runner, backend and layer
//! skip.

use super::AssignError;
use ringllm_model::gguf::GgufFile;
use ringllm_model::stream::{ExpertStore, StreamMode, StreamSettings, Streamer};
use ringllm_model::{limits, KvCache, KvType, Runner};
use ringllm_model::{Hparams, LoadOptions, Model, ModelError};
use ringllm_protocol::control::StageLayout;
use std::ops::Range;
use std::sync::Arc;
use tracing::info;

/// Memory a streaming node keeps free beyond its tiers (runtime, frame buffers).
const STREAM_HEADROOM: u64 = 48 << 20;

/// What [`load_stage`] needs.
pub(super) struct StageLoad<'a> {
    pub(super) node: &'a str,
    pub(super) file: Arc<GgufFile>,
    /// Every layer of the stage (its windows' span when it has several).
    pub(super) range: Range<usize>,
    pub(super) layout: &'a StageLayout,
    pub(super) head: bool,
    pub(super) repack: bool,
    pub(super) backend: ringllm_model::BackendChoice,
    pub(super) cap: Option<u64>,
    pub(super) settings: StreamSettings,
    pub(super) threads: usize,
    pub(super) max_batch: usize,
    pub(super) ctx: usize,
    pub(super) kv_type: KvType,
    pub(super) slots: usize,
    /// The whole model's header hash (the assignment's model identity).
    pub(super) model_hash: u64,
}

/// A loaded stage.
pub(super) struct Loaded {
    pub(super) runner: Runner,
    /// One model per window, the head on the last.
    pub(super) windows: Vec<Arc<Model>>,
    /// The streamed tier, shared by the windows.
    pub(super) streamer: Option<Arc<Streamer>>,
    /// Resident weights, prefaulted.
    pub(super) weight_bytes: u64,
    /// Every window's KV caches, every slot.
    pub(super) kv_bytes: u64,
}

/// Loads a stage: one runner per window (one window unless the ring has several rounds),
/// the head on the last; the layers the coordinator listed (or, without a list, those that do
/// not fit this node's budget) streamed from disk by one streamer shared by the windows.
pub(super) fn load_stage(s: &StageLoad<'_>) -> Result<Loaded, AssignError> {
    let hp = Model::load(
        Arc::clone(&s.file),
        &LoadOptions {
            layers: Some(0..0),
            embedding: false,
            head: false,
            ..LoadOptions::default()
        },
    )
    .map_err(|source| s.load_error(source))?
    .hp;
    // Every layer number the coordinator sent is checked against the model before anything
    // is sized by it (a list of every layer in 0..2^32 is 34 GB).
    check_range(s, hp.n_layer)?;
    let windows = check_windows(s)?;
    let all: Vec<usize> = windows.iter().flat_map(|w| w.clone()).collect();
    check_streamed(s, &all)?;
    // One runner (its scratch) for every window, and each window's KV caches.
    let (what, runner_need) = runner_memory(s, &hp, &windows);
    // Scratch and KV first: streaming layers cannot make room for them.
    let limit = |source| AssignError::Limit {
        node: s.node.to_string(),
        source,
    };
    limits::check("threads", s.threads, limits::MAX_THREADS).map_err(limit)?;
    // A session that ended a moment ago may not have given its memory back yet (its compute
    // thread does, as it ends): what the allocator holds unused goes back before the check.
    ringllm_model::sys::release_free_memory();
    limits::check_memory_within(s.cap, what, runner_need).map_err(limit)?;
    let experts = expert_tier(s, &all, runner_need)?;
    let streamer = if experts.is_some() {
        None
    } else {
        streamed_tier(s, &all, runner_need)?
    };
    let mut loaded = load_windows(s, &windows, streamer, experts)?;
    set_backend(s, &mut loaded)?;
    set_skip(s, &hp, &mut loaded)?;
    Ok(loaded)
}

impl StageLoad<'_> {
    fn layout_error(&self, why: String) -> AssignError {
        AssignError::Layout {
            node: self.node.to_string(),
            why,
        }
    }

    fn load_error(&self, source: ModelError) -> AssignError {
        AssignError::Load {
            node: self.node.to_string(),
            source,
        }
    }
}

/// The stage's layers inside the model's `n_layer` layers (and not empty), and its windows'
/// bounds too (`check_windows` then checks their order inside the stage).
fn check_range(s: &StageLoad<'_>, n_layer: usize) -> Result<(), AssignError> {
    let bad = if s.range.start >= s.range.end || s.range.end > n_layer {
        Some((s.range.start, s.range.end))
    } else {
        s.layout
            .windows
            .iter()
            .map(|&(a, b)| (a as usize, b as usize))
            .find(|&(a, b)| a > n_layer || b > n_layer)
    };
    match bad {
        Some((start, end)) => Err(AssignError::LayerRange {
            node: s.node.to_string(),
            start,
            end,
            n_layer,
        }),
        None if s.layout.windows.len() > n_layer => Err(s.layout_error(format!(
            "{} windows for a model of {n_layer} layers",
            s.layout.windows.len()
        ))),
        None => Ok(()),
    }
}

/// The streamed layers: each one of the stage's `all`, none twice.
fn check_streamed(s: &StageLoad<'_>, all: &[usize]) -> Result<(), AssignError> {
    let mut seen = vec![false; all.len()];
    for &l in &s.layout.streamed {
        let Some(i) = all.iter().position(|&a| a == l as usize) else {
            return Err(s.layout_error(format!("streamed layer {l} is not one of the stage's")));
        };
        if std::mem::replace(&mut seen[i], true) {
            return Err(s.layout_error(format!("streamed layer {l} is listed twice")));
        }
    }
    Ok(())
}

/// The stage's windows (its span when the layout lists none): in order, inside the stage's
/// span, none empty, and spanning it.
fn check_windows(s: &StageLoad<'_>) -> Result<Vec<Range<usize>>, AssignError> {
    let n_layer = s.range.end;
    if let (Some(first), Some(last)) = (s.layout.windows.first(), s.layout.windows.last()) {
        if first.0 as usize != s.range.start || last.1 as usize != s.range.end {
            return Err(s.layout_error(format!(
                "windows {:?} do not span layers {}..{}",
                s.layout.windows, s.range.start, s.range.end
            )));
        }
    }
    let windows: Vec<Range<usize>> = if s.layout.windows.is_empty() {
        vec![s.range.clone()]
    } else {
        s.layout
            .windows
            .iter()
            .map(|&(a, b)| a as usize..b as usize)
            .collect()
    };
    let mut at = s.range.start;
    for w in &windows {
        if w.start < at || w.end <= w.start || w.end > n_layer {
            return Err(s.layout_error(format!(
                "window {}..{} is empty, out of order or outside layers {}..{}",
                w.start, w.end, s.range.start, s.range.end
            )));
        }
        at = w.end;
    }
    Ok(windows)
}

/// What the runner's scratch and every window's KV caches take: what it is, and its bytes.
fn runner_memory(s: &StageLoad<'_>, hp: &Hparams, windows: &[Range<usize>]) -> (String, u64) {
    let (what, mut need) = limits::runner_memory(
        hp,
        windows[0].clone(),
        s.threads,
        s.max_batch,
        s.ctx,
        s.kv_type,
        s.slots,
    );
    for w in &windows[1..] {
        let kv = KvCache::bytes_for(hp, w.clone(), s.ctx, s.max_batch, s.kv_type) as u64;
        need = need.saturating_add(kv.saturating_mul(s.slots as u64));
    }
    (what, need)
}

/// A mixture of experts's experts read from disk as the router picks them: when the
/// coordinator planned streamed layers for this stage (its layers do not fit this node), when
/// the node was started with `--stream experts`, or when this node's budget has shrunk below
/// the layers since the coordinator planned. Everything but the experts stays resident.
fn expert_tier(
    s: &StageLoad<'_>,
    all: &[usize],
    runner_need: u64,
) -> Result<Option<Arc<ExpertStore>>, AssignError> {
    if s.layout.stream_all || s.settings.mode == StreamMode::All {
        return Ok(None);
    }
    let head_bytes = if s.head {
        ringllm_model::stream::head_bytes(&s.file)
    } else {
        0
    };
    let budget = limits::budget(s.cap).map(|b| {
        b.saturating_sub(runner_need)
            .saturating_sub(head_bytes)
            .saturating_sub(STREAM_HEADROOM)
    });
    let mode = if s.layout.streamed.is_empty() {
        s.settings.mode
    } else {
        StreamMode::Experts
    };
    let settings = StreamSettings { mode, ..s.settings };
    Ok(
        ringllm_model::stream::decide_experts(&s.file, all, budget, &settings, s.threads)
            .map_err(|why| s.layout_error(why))?
            .map(|(st, d)| {
                tracing::info!(
                    slots = d.slots,
                    experts = d.experts,
                    resident_mib = d.resident_bytes >> 20,
                    "this stage's experts stream from disk"
                );
                st
            }),
    )
}

/// The streamed tier: as the coordinator planned it, or what this node's budget leaves once
/// the runner has `runner_need`. `all`: the stage's layers.
fn streamed_tier(
    s: &StageLoad<'_>,
    all: &[usize],
    runner_need: u64,
) -> Result<Option<Arc<Streamer>>, AssignError> {
    let settings = StreamSettings {
        mode: if s.layout.stream_all {
            StreamMode::All
        } else {
            s.settings.mode
        },
        prefetch: match s.layout.prefetch {
            0 => s.settings.prefetch,
            p => s.settings.prefetch.or(Some(p as usize)),
        },
        ..s.settings
    };
    if !s.layout.streamed.is_empty() && settings.mode != StreamMode::All {
        let depth = settings
            .prefetch
            .unwrap_or(2)
            .clamp(1, ringllm_model::stream::MAX_DEPTH);
        let order = planned_order(s, all, runner_need, depth);
        let st = Streamer::new(&s.file, &order, depth)
            .map_err(|e| s.layout_error(format!("cannot stream layers {order:?}: {e}")))?;
        return Ok(Some(Arc::new(st)));
    }
    let head_bytes = if s.head {
        ringllm_model::stream::head_bytes(&s.file)
    } else {
        0
    };
    // Without a streaming layout the coordinator's plan fitted the slice in this node's
    // budget: it is trusted (the node's own view counts the slice file's pages it has just
    // checked as used). Only `--stream all` streams here on its own.
    let budget = if settings.mode == StreamMode::All {
        limits::budget(s.cap).map(|b| {
            b.saturating_sub(runner_need)
                .saturating_sub(head_bytes)
                .saturating_sub(STREAM_HEADROOM)
        })
    } else {
        None
    };
    Ok(
        ringllm_model::stream::decide(&s.file, all, budget, &settings, s.threads, 0.0)
            .map_err(|why| s.layout_error(why))?
            .map(|(st, _)| st),
    )
}

/// The layers to stream, in the stage's order: those the coordinator listed, and more (the
/// last resident layers first) if this node's budget has shrunk since it planned.
fn planned_order(s: &StageLoad<'_>, all: &[usize], runner_need: u64, depth: usize) -> Vec<usize> {
    let mut order: Vec<usize> = s.layout.streamed.iter().map(|&l| l as usize).collect();
    let Some(b) = limits::budget(s.cap) else {
        return order;
    };
    // Each layer's span once (finding one scans the tensor table).
    let sizes: Vec<(usize, u64)> = all
        .iter()
        .map(|&l| {
            let b = ringllm_model::stream::layer_span(&s.file, l).map_or(0, |x| x.range.len());
            (l, b as u64)
        })
        .collect();
    let bytes = |l: usize| sizes.iter().find(|x| x.0 == l).map_or(0, |x| x.1);
    let largest = order.iter().map(|&l| bytes(l)).max().unwrap_or(0);
    let pool = (largest + 8192) * (depth as u64 + 1);
    let mut resident: Vec<usize> = all.iter().copied().filter(|l| !order.contains(l)).collect();
    let need = |res: &[usize]| res.iter().map(|&l| bytes(l)).sum::<u64>() + pool + STREAM_HEADROOM;
    let room = b.saturating_sub(runner_need);
    let before = resident.len();
    while need(&resident) > room {
        let Some(l) = resident.pop() else { break };
        order.push(l);
    }
    if resident.len() < before {
        order.sort_by_key(|l| all.iter().position(|a| a == l));
        tracing::warn!(
            moved = before - resident.len(),
            budget_mib = b >> 20,
            "the planned resident layers do not fit this node's budget now: streaming more of them"
        );
    }
    order
}

/// Each window's model (prefaulted; the head on the last), the runner on the first, and the
/// bytes of the resident weights and of every KV cache.
fn load_windows(
    s: &StageLoad<'_>,
    windows: &[Range<usize>],
    streamer: Option<Arc<Streamer>>,
    experts: Option<Arc<ExpertStore>>,
) -> Result<Loaded, AssignError> {
    let mut models = Vec::with_capacity(windows.len());
    let mut weights = 0u64;
    let mut kv_bytes = 0u64;
    for (i, w) in windows.iter().enumerate() {
        let last = i + 1 == windows.len();
        let model = Model::load(
            Arc::clone(&s.file),
            &LoadOptions {
                layers: Some(w.clone()),
                embedding: false,
                head: s.head && last,
                repack: s.repack,
                stream: streamer.clone(),
                experts: experts.clone(),
            },
        )
        .map_err(|source| s.load_error(source))?;
        kv_bytes += KvCache::bytes_for(&model.hp, w.clone(), s.ctx, s.max_batch, s.kv_type) as u64
            * s.slots as u64;
        weights += model.prefault() as u64;
        models.push(Arc::new(model));
    }
    let runner = Runner::new(Arc::clone(&models[0]), s.threads, s.max_batch, s.ctx);
    Ok(Loaded {
        runner,
        windows: models,
        streamer,
        weight_bytes: weights,
        kv_bytes,
    })
}

/// Puts the runner on the backend the node was started with (the CPU needs nothing).
fn set_backend(s: &StageLoad<'_>, loaded: &mut Loaded) -> Result<(), AssignError> {
    if s.backend == ringllm_model::BackendChoice::Cpu {
        return Ok(());
    }
    let why = |w: String| s.layout_error(format!("backend {:?}: {w}", s.backend));
    if loaded.windows.len() > 1 {
        return Err(why("a multi-round ring runs on the CPU backend only".into()));
    }
    let b = ringllm_model::backend::open(s.backend, &loaded.windows[0], s.max_batch)
        .map_err(|e| why(e.to_string()))?;
    loaded
        .runner
        .set_backend(b)
        .map_err(|e| why(e.to_string()))?;
    info!(backend = %loaded.runner.backend_name(), "stage runs on");
    Ok(())
}

/// Turns layer skip on when the layout carries the coordinator's predictor (made for this
/// model).
fn set_skip(s: &StageLoad<'_>, hp: &Hparams, loaded: &mut Loaded) -> Result<(), AssignError> {
    if s.layout.skip_predictor.is_empty() {
        return Ok(());
    }
    let why = |w: String| s.layout_error(format!("layer skip: {w}"));
    if loaded.windows.len() > 1 {
        return Err(why("not available on a multi-round ring".into()));
    }
    let p = ringllm_model::skip::Predictor::from_bytes(&s.layout.skip_predictor).map_err(why)?;
    let want = ringllm_model::skip::SkipModelId::new(hp, s.model_hash);
    if p.model != want {
        return Err(why(format!(
            "the predictor was made for {}, this ring runs {want}",
            p.model
        )));
    }
    let policy = ringllm_model::skip::SkipPolicy {
        confidence: (s.layout.skip_confidence_ppm as f32 / 1e6).clamp(0.5, 1.0),
        max_skip: s.layout.skip_max as usize,
        ..ringllm_model::skip::SkipPolicy::new(Arc::new(p))
    };
    loaded
        .runner
        .set_skip(Some(policy))
        .map_err(|e| why(e.to_string()))?;
    info!(
        confidence = s.layout.skip_confidence_ppm as f64 / 1e6,
        max_skip = s.layout.skip_max,
        "layer skip on: the coordinator's predictor decides at this stage's first layer"
    );
    Ok(())
}
