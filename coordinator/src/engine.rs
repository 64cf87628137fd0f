//! The engine: model, tokenizer, one sequence's KV cache, and the generation loop shared by
//! `run`, chat and the ring coordinator (`Engine::load_ring`: the nodes run the layers, this
//! process embeds, runs any local layers and the head).

use crate::cluster::ring::{Ring, RingSpec, Stage, TransferCut};
use crate::text::sampler::{Sampler, StopStrings};
use crate::text::tokenizer::{StreamDecoder, Tokenizer, TokenizerSpec};
use anyhow::{anyhow, bail, Context, Result};
use ringllm_model::gguf::{GgufError, GgufFile};
use ringllm_model::{limits, KvCache, KvType, LoadOptions, Model, Runner};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What to load and how: the whole model in this process, or the coordinator's part of a ring.
#[derive(Clone, Debug)]
pub struct ModelOptions {
    /// GGUF model file.
    pub model: PathBuf,
    /// Worker threads (`None`: physical cores).
    pub threads: Option<usize>,
    /// Context size in tokens (`None`: the model's, capped at 4096).
    pub ctx: Option<usize>,
    /// Tokens per prefill batch.
    pub batch: usize,
    /// KV cache element type.
    pub kv: KvType,
    /// Repack weights into panels at load where the kernels read them (`LoadOptions::repack`).
    pub repack: bool,
    /// `--memory`: the most this process may use (with what the machine and its cgroup
    /// leave, [`limits::budget`]); layers beyond it are streamed from disk.
    pub memory: Option<u64>,
    pub stream: ringllm_model::stream::StreamSettings,
    /// What runs the layers held here (`--backend`).
    pub backend: ringllm_model::BackendChoice,
}

/// The context size: `asked` (`--ctx`), else the model's trained context capped at 4096. A
/// size beyond the trained context is allowed (its memory is checked elsewhere) with a
/// warning: positions past what the model saw in training give worse output.
pub fn context_size(asked: Option<usize>, ctx_train: usize) -> usize {
    match asked {
        Some(c) if ctx_train > 0 && c > ctx_train => {
            notice!(
                warn: "warning: --ctx {c} is more than the {ctx_train} tokens this model was trained \
                 on; output past {ctx_train} tokens is likely to degrade"
            );
            c
        }
        Some(c) => c,
        None => ctx_train.min(4096),
    }
    .max(1)
}

/// Puts `runner`'s layers and head on the backend `choice` asks for (`--backend`).
pub fn set_backend(runner: &mut Runner, choice: ringllm_model::BackendChoice) -> Result<()> {
    let b = ringllm_model::backend::open(choice, &runner.model, runner.max_batch())?;
    runner.set_backend(b)?;
    Ok(())
}

/// Worker threads when none are asked for: one per physical core.
pub fn default_threads() -> usize {
    num_cpus::get_physical().max(1)
}

pub struct Engine {
    pub runner: Runner,
    pub kv: KvCache,
    pub tokenizer: Tokenizer,
    pub spec: TokenizerSpec,
    /// Tokens whose keys and values the cache holds, in order.
    pub history: Vec<u32>,
    x: Vec<f32>,
    logits: Vec<f32>,
    pub ctx: usize,
    pub load_seconds: f64,
    /// Ring mode: the nodes run the layers; this process holds the embedding, the output head
    /// (unless the plan put it on the last node) and any `local` layers.
    pub ring: Option<RingMode>,
    /// When set, `generate` appends the logits every token was sampled from, one row of
    /// `vocab` per token (the hidden `--step-logits-out`, for cross-machine comparisons).
    pub step_logits: Option<Vec<f32>>,
    /// Ring mode: how many times one generation is resumed on a rebuilt ring after a node
    /// is lost (`up --resume-retries`); 0 in one process.
    pub resume_retries: usize,
}

pub struct RingMode {
    pub spec: RingSpec,
    pub args: ModelOptions,
    pub file: Arc<GgufFile>,
    /// `None` after a failure, until `recover` rebuilds the ring.
    pub ring: Option<Ring>,
    pub hp: ringllm_model::Hparams,
    /// Addresses of nodes just seen to miss the handshake (a frozen node noticed mid-step):
    /// the next build leaves them out without probing them again.
    pub skip: Vec<String>,
}

/// Opens a GGUF file with a message that names the file.
pub fn open_gguf(path: &std::path::Path) -> Result<Arc<GgufFile>> {
    if !path.exists() {
        bail!(
            "model file {} does not exist (run scripts/fetch-models for the test models)",
            path.display()
        );
    }
    let file = GgufFile::open(path).map_err(|e| match e {
        // These name the path already.
        GgufError::Io { .. } | GgufError::NotRegularFile { .. } => anyhow::Error::new(e),
        e => anyhow::Error::new(e).context(format!("cannot read {}", path.display())),
    })?;
    Ok(Arc::new(file))
}

/// The whole model for one process, its layers streamed from disk when they do not fit the
/// memory budget (`--memory`, the machine, the cgroup): what is left for the layers is the
/// budget less a headroom, the runner's scratch and KV cache, and the output head (held in
/// owned memory when streaming; the embedding stays mapped, one row read per token).
pub fn load_whole(file: &Arc<GgufFile>, args: &ModelOptions, threads: usize) -> Result<Model> {
    use ringllm_model::stream;
    let probe = Model::load(
        Arc::clone(file),
        &LoadOptions {
            layers: Some(0..0),
            embedding: false,
            head: false,
            ..LoadOptions::default()
        },
    )?;
    let hp = probe.hp.clone();
    drop(probe);
    let ctx = context_size_quiet(args.ctx, hp.ctx_train);
    let layers: Vec<usize> = (0..hp.n_layer).collect();
    // Settings and the runner's own memory first: streaming layers cannot make room for them.
    limits::check("threads", threads, limits::MAX_THREADS)?;
    limits::check("batch size", args.batch.max(1), limits::MAX_BATCH)?;
    limits::check("context size", ctx, limits::MAX_CTX)?;
    let (what, need) = limits::runner_memory(
        &hp,
        0..hp.n_layer,
        threads,
        args.batch.max(1),
        ctx,
        args.kv,
        1,
    );
    limits::check_memory_within(args.memory, what.clone(), need)?;
    let runner = need;
    let mut why = String::new();
    let budget = limits::budget(args.memory).map(|avail| {
        let head = stream::head_bytes(file);
        let room = crate::cluster::planner::headroom(avail);
        why = format!(
            "of the {} MiB budget, {} MiB is headroom, {} MiB the output head and {what}",
            avail >> 20,
            room >> 20,
            head >> 20
        );
        avail
            .saturating_sub(room)
            .saturating_sub(runner)
            .saturating_sub(head)
    });
    let experts = stream::decide_experts(file, &layers, budget, &args.stream, threads)
        .map_err(|e| anyhow!("{}: {e} ({why})", args.model.display()))?;
    if let Some((st, d)) = &experts {
        notice!(
            "streaming the experts from disk ({}): {} of {} experts cached in {} MiB, {} MiB of the \
             rest resident; read {:.0} MB/s; a uniform router would read {:.0} MiB per token",
            st.source(),
            d.slots.min(d.experts),
            d.experts,
            d.pool_bytes >> 20,
            d.resident_bytes >> 20,
            d.read_bytes_per_s / 1e6,
            d.uniform_bytes_per_token / 1048576.0
        );
    }
    let streamer = if experts.is_some() {
        None
    } else {
        stream::decide(file, &layers, budget, &args.stream, threads, 0.0)
            .map_err(|e| anyhow!("{}: {e} ({why})", args.model.display()))?
    };
    if let Some((_, d)) = &streamer {
        notice!(
            "streaming {} of {} layers from disk ({} MiB per token, {} read ahead; {} MiB resident); read {:.0} MB/s, predicted {:.2} tok/s",
            d.tiers.streamed.len(),
            hp.n_layer,
            d.tiers.streamed_bytes >> 20,
            d.tiers.depth,
            d.tiers.resident_bytes >> 20,
            d.read_bytes_per_s / 1e6,
            1.0 / d.predicted_s
        );
    }
    Ok(Model::load(
        Arc::clone(file),
        &LoadOptions {
            repack: args.repack && args.backend == ringllm_model::BackendChoice::Cpu,
            stream: streamer.map(|s| s.0),
            experts: experts.map(|s| s.0),
            ..LoadOptions::default()
        },
    )?)
}

/// [`context_size`] without its warning (printed once, by the caller's own call).
fn context_size_quiet(asked: Option<usize>, ctx_train: usize) -> usize {
    match asked {
        Some(c) => c,
        None => ctx_train.min(4096),
    }
    .max(1)
}

impl Engine {
    pub fn load(args: &ModelOptions) -> Result<Engine> {
        let t0 = Instant::now();
        let file = open_gguf(&args.model)?;
        let spec = TokenizerSpec::from_gguf(file.metadata())
            .with_context(|| format!("tokenizer of {}", args.model.display()))?;
        let tokenizer = Tokenizer::new(&spec)
            .with_context(|| format!("tokenizer of {}", args.model.display()))?;
        let threads = args.threads.unwrap_or_else(default_threads).max(1);
        let model = load_whole(&file, args, threads)
            .with_context(|| format!("cannot load {}", args.model.display()))?;
        let ctx = context_size(args.ctx, model.hp.ctx_train);
        let kv_type = args.kv;
        if args.batch == 0 {
            bail!("--batch must be at least 1");
        }
        limits::check_runner(
            &model.hp,
            model.layer_range.clone(),
            threads,
            args.batch,
            ctx,
            kv_type,
            1,
        )?;
        let vocab = model.hp.vocab;
        let d = model.hp.d_model;
        let mut runner = Runner::new(Arc::new(model), threads, args.batch, ctx);
        set_backend(&mut runner, args.backend)?;
        let kv = runner.new_cache(ctx, kv_type);
        tracing::info!(
            backend = %runner.backend_name(),
            threads,
            ctx,
            isa = ringllm_kernels::isa().name(),
            kv_bytes = kv.bytes(),
            "model loaded"
        );
        Ok(Engine {
            runner,
            kv,
            tokenizer,
            spec,
            history: Vec::new(),
            x: vec![0.0; args.batch * d],
            logits: vec![0.0; vocab],
            ctx,
            load_seconds: t0.elapsed().as_secs_f64(),
            ring: None,
            step_logits: None,
            resume_retries: 0,
        })
    }

    /// The coordinator of a ring: connects to the nodes, plans, assigns, and keeps the
    /// embedding, head and local layers here.
    pub fn load_ring(args: &ModelOptions, spec: RingSpec) -> Result<Engine> {
        let t0 = Instant::now();
        let file = open_gguf(&args.model)?;
        let spec_tok = TokenizerSpec::from_gguf(file.metadata())
            .with_context(|| format!("tokenizer of {}", args.model.display()))?;
        let tokenizer = Tokenizer::new(&spec_tok)
            .with_context(|| format!("tokenizer of {}", args.model.display()))?;
        let full = Model::load(Arc::clone(&file), &LoadOptions::default())
            .with_context(|| format!("cannot load {}", args.model.display()))?;
        let hp = full.hp.clone();
        drop(full);
        let ctx = context_size(args.ctx, hp.ctx_train);
        if args.batch == 0 {
            bail!("--batch must be at least 1");
        }
        let mut mode = RingMode {
            spec,
            args: ModelOptions {
                ctx: Some(ctx),
                ..args.clone()
            },
            file,
            ring: None,
            hp,
            skip: Vec::new(),
        };
        let (runner, kv) = mode.build(false, 1)?;
        let vocab = mode.hp.vocab;
        let d = mode.hp.d_model;
        Ok(Engine {
            runner,
            kv,
            tokenizer,
            spec: spec_tok,
            history: Vec::new(),
            x: vec![0.0; args.batch * d],
            logits: vec![0.0; vocab],
            ctx,
            load_seconds: t0.elapsed().as_secs_f64(),
            ring: Some(mode),
            step_logits: None,
            resume_retries: 0,
        })
    }

    /// After a ring failure: connect again to the nodes still reachable, re-plan, reload.
    pub fn recover(&mut self) -> Result<()> {
        let Some(mode) = self.ring.as_mut() else {
            return Ok(());
        };
        if let Some(old) = mode.ring.take() {
            old.shutdown("recovering");
        }
        let (runner, kv) = mode.build(true, 1)?;
        self.runner = runner;
        self.kv = kv;
        self.history.clear();
        Ok(())
    }

    /// The ring, when this engine coordinates one and it is up.
    pub fn ring_mut(&mut self) -> Option<&mut Ring> {
        self.ring.as_mut().and_then(|m| m.ring.as_mut())
    }

    /// The logits of the last token fed.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Ends a ring session cleanly (nodes free their slices at once).
    pub fn close(&mut self) {
        if let Some(m) = self.ring.as_mut() {
            if let Some(r) = m.ring.take() {
                r.shutdown("done");
            }
        }
    }

    /// True when a ring is configured but currently down.
    pub fn ring_down(&self) -> bool {
        self.ring.as_ref().is_some_and(|m| m.ring.is_none())
    }

    /// Forgets the sequence.
    pub fn reset(&mut self) {
        self.kv.truncate(0);
        self.history.clear();
    }

    /// Keeps the longest prefix of the cached tokens shared with `tokens` (at least one token
    /// is always recomputed so there are logits to sample from), returning the tokens still to
    /// feed.
    pub fn reuse_prefix<'a>(&mut self, tokens: &'a [u32]) -> &'a [u32] {
        let common = self
            .history
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count()
            .min(tokens.len().saturating_sub(1));
        let ok = match &self.ring {
            Some(m) => ringllm_model::kv::can_truncate(
                &m.hp,
                self.ctx,
                self.runner.max_batch(),
                self.kv.len,
                common,
            ),
            None => self.kv.can_truncate_to(common),
        };
        if !ok {
            self.reset();
            return tokens;
        }
        self.kv.truncate(common);
        self.history.truncate(common);
        &tokens[common..]
    }

    /// Feeds `tokens` (in batches) and returns the logits after the last one.
    pub fn feed(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        if tokens.is_empty() {
            bail!("nothing to feed");
        }
        for chunk in tokens.chunks(self.runner.max_batch()) {
            if self.ring.is_some() {
                if let Err(e) = self.ring_step(chunk) {
                    // The ring's state is unknown now: drop it; `recover` rebuilds it.
                    if let Some(m) = self.ring.as_mut() {
                        m.note_failure(&e);
                        if let Some(r) = m.ring.take() {
                            r.shutdown("failure");
                        }
                    }
                    return Err(e);
                }
            } else {
                self.runner
                    .step(chunk, &mut self.kv, &mut self.x, &mut self.logits)?;
            }
            self.history.extend_from_slice(chunk);
        }
        Ok(&self.logits)
    }

    fn ring_step(&mut self, chunk: &[u32]) -> Result<()> {
        let mode = self.ring.as_mut().ok_or_else(|| anyhow!("not a ring"))?;
        let ring = mode.ring.as_mut().ok_or_else(|| {
            anyhow!("the ring is down (a node was lost); it is rebuilt before the next request")
        })?;
        let n = chunk.len();
        let d = mode.hp.d_model;
        let pos = self.kv.len;
        if pos + n > self.ctx {
            bail!("the context of {} tokens is full", self.ctx);
        }
        if self.x.len() < n * d {
            self.x.resize(n * d, 0.0);
        }
        self.runner.embed(chunk, &mut self.x[..n * d])?;
        let (runner, kv) = (&mut self.runner, &mut self.kv);
        let mut local = |x: &mut [f32]| -> Result<()> {
            runner.layers(x, n, kv, None)?;
            Ok(())
        };
        ring.forward(
            0,
            pos,
            &mut self.x[..n * d],
            n,
            d,
            &mut self.logits,
            &mut local,
        )?;
        self.kv.len = pos + n;
        if !ring.head_on_node {
            let last = &mut self.x[(n - 1) * d..n * d];
            self.runner.final_norm(last, 1)?;
            self.runner
                .logits(&self.x[(n - 1) * d..n * d], 1, &mut self.logits)?;
        }
        Ok(())
    }

    pub fn vocab(&self) -> usize {
        self.logits.len()
    }
}

impl RingMode {
    /// Connects, plans, assigns; returns the coordinator's runner and cache for its part.
    /// With `slots` sequences per node (serving) or 1 (one conversation).
    pub fn build(&mut self, probe: bool, slots: usize) -> Result<(Runner, KvCache)> {
        let args = &self.args;
        let ctx = args.ctx.unwrap_or(4096);
        let kv_type = args.kv;
        let threads = args.threads.unwrap_or_else(default_threads).max(1);
        // The nodes check their assignments too; refusing here names the flag before any
        // node is contacted.
        limits::check("threads", threads, limits::MAX_THREADS)?;
        limits::check("batch size", args.batch, limits::MAX_BATCH)?;
        limits::check("context size", ctx, limits::MAX_CTX)?;
        limits::check("KV slots", slots, limits::MAX_SLOTS)?;
        let mut spec = self.spec.clone();
        if probe {
            self.leave_out_silent(&mut spec)?;
        }
        self.skip.clear();
        // Every node plans for `slots` KV caches (serving) and the largest batch.
        let sizing = crate::cluster::ring::Sizing {
            ctx,
            max_batch: args.batch,
            kv: kv_type,
            slots,
        };
        // A rebuild never fails because one candidate failed: a failure pinned on one node
        // (or on nodes that no longer answer the handshake) leaves it out, and the ring is
        // built over the others; the node is tried again later.
        let ring = loop {
            match self.connect_and_assign(&spec, &sizing, threads) {
                Ok(r) => break r,
                Err(e) if probe => self.leave_out_failed(&mut spec, e)?,
                Err(e) => return Err(e),
            }
        };
        let args = &self.args;
        let local = ring
            .stages
            .iter()
            .find_map(|s| match s {
                Stage::Local { layers } => Some(layers.clone()),
                _ => None,
            })
            .unwrap_or(0..0);
        let model = Model::load(
            Arc::clone(&self.file),
            &LoadOptions {
                layers: Some(local),
                embedding: true,
                head: !ring.head_on_node,
                repack: self.args.repack && self.args.backend == ringllm_model::BackendChoice::Cpu,
                stream: None,
                experts: None,
            },
        )?;
        limits::check_runner(
            &model.hp,
            model.layer_range.clone(),
            threads,
            args.batch,
            ctx,
            kv_type,
            slots,
        )?;
        let mut runner = Runner::new(Arc::new(model), threads, args.batch, ctx);
        if !runner.model.layers.is_empty() || runner.model.output.is_some() {
            set_backend(&mut runner, self.args.backend)?;
        }
        let kv = runner.new_cache(ctx, kv_type);
        self.ring = Some(ring);
        Ok((runner, kv))
    }

    /// Records what a ring failure says about its nodes: one that just missed the handshake
    /// is left out of the next build without another probe.
    pub fn note_failure(&mut self, e: &anyhow::Error) {
        if let Some((address, true)) = crate::cluster::probe::fault_of(e) {
            if !self.skip.iter().any(|s| s == address) {
                self.skip.push(address.to_string());
            }
        }
    }

    /// Leaves out of `spec` the nodes that do not finish the handshake within
    /// `PROBE_DEADLINE` (all probed at once; a frozen process's kernel still takes a TCP
    /// connection, its daemon never answers), and those in `self.skip`. Fails only when a
    /// node that holds pinned layers is missing, or none is left.
    fn leave_out_silent(&self, spec: &mut RingSpec) -> Result<()> {
        use crate::cluster::probe;
        let addrs: Vec<String> = spec
            .stages
            .iter()
            .filter_map(|s| s.address.clone())
            .filter(|a| !self.skip.contains(a))
            .collect();
        let answers = probe::handshake_all(&addrs, &spec.key, probe::PROBE_DEADLINE);
        let answered = |a: &str| addrs.iter().zip(&answers).any(|(x, r)| x == a && r.is_ok());
        let mut lost = Vec::new();
        for s in &spec.stages {
            let Some(a) = s.address.as_deref() else {
                continue;
            };
            if answered(a) {
                continue;
            }
            let why = addrs
                .iter()
                .zip(&answers)
                .find_map(|(x, r)| (x == a).then(|| r.clone().err()).flatten())
                .unwrap_or_else(|| "missed the handshake just now".into());
            tracing::info!(node = %s.label(), "left out of the ring: {why}");
            lost.push((s.label(), s.layers.is_some()));
        }
        if lost.is_empty() {
            return Ok(());
        }
        let names: Vec<String> = lost.iter().map(|(n, _)| n.clone()).collect();
        let left = spec.stages.len() - lost.len();
        if lost.iter().any(|(_, pinned)| *pinned) || left == 0 {
            bail!("node(s) {} do not answer", names.join(", "));
        }
        notice!(
            warn: "warning: node(s) {} do not answer; planning over the others",
            names.join(", ")
        );
        spec.stages
            .retain(|s| s.address.as_deref().is_none_or(&answered));
        Ok(())
    }

    /// After a failed build: leaves out the node the failure is pinned on, else every node
    /// that no longer answers the handshake; fails with `e` when that leaves out nothing
    /// (or a node with pinned layers, or every node).
    fn leave_out_failed(&mut self, spec: &mut RingSpec, e: anyhow::Error) -> Result<()> {
        let before = spec.stages.len();
        if let Some((address, _)) = crate::cluster::probe::fault_of(&e) {
            let address = address.to_string();
            let pinned = spec
                .stages
                .iter()
                .any(|s| s.address.as_deref() == Some(address.as_str()) && s.layers.is_some());
            let remote = spec.stages.iter().filter(|s| s.address.is_some()).count();
            if pinned || remote <= 1 {
                return Err(e);
            }
            spec.stages
                .retain(|s| s.address.as_deref() != Some(address.as_str()));
            if spec.stages.len() < before {
                notice!(warn: "warning: {e:#}; building the ring without {address}");
                return Ok(());
            }
        }
        let mut probed = spec.clone();
        if self.leave_out_silent(&mut probed).is_err() || probed.stages.len() == before {
            return Err(e);
        }
        notice!(warn: "warning: {e:#}; building the ring over the nodes that answer");
        *spec = probed;
        Ok(())
    }

    /// Connects to the nodes of `spec`, plans and assigns. A node lost while its slice is
    /// sent is waited for (`up --wait`) and the ring started again; it kept what arrived
    /// and is sent the rest.
    fn connect_and_assign(
        &mut self,
        spec: &RingSpec,
        sizing: &crate::cluster::ring::Sizing,
        threads: usize,
    ) -> Result<Ring> {
        let args = &self.args;
        let identity = crate::cluster::ring::identity_of(&args.model, &self.file);
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut ring = Ring::connect(spec, &args.model, &self.file, sizing, threads)?;
            // Nodes known only by their address now go by the names they gave (messages,
            // /health).
            for (name, address) in ring.node_names() {
                for s in self.spec.stages.iter_mut() {
                    if s.name == address && s.address.as_deref() == Some(address.as_str()) {
                        s.name = name.clone();
                    }
                }
            }
            if attempt == 1 {
                match &ring.streaming {
                    Some(sp) => eprint!("{sp}"),
                    None => eprint!("{}", ring.plan),
                }
            }
            match ring.assign(spec, &self.file, &identity, sizing) {
                Ok(()) => return Ok(ring),
                Err(e) if e.is::<TransferCut>() && attempt < MAX_TRANSFER_ATTEMPTS => {
                    ring.shutdown("slice transfer cut");
                    notice!(
                        warn: "warning: {e}; waiting up to {:.0} s for the node, then resuming",
                        spec.wait.as_secs_f64()
                    );
                    // The node drops the dead connection after its own silence limit.
                    std::thread::sleep(Duration::from_secs(1));
                    let missing = crate::cluster::wait_for_nodes(spec, spec.wait);
                    if !missing.is_empty() {
                        bail!("{e}; {} did not come back", missing.join(", "));
                    }
                }
                Err(e) => {
                    ring.shutdown("failure");
                    return Err(e);
                }
            }
        }
    }
}

/// Times `up` starts over after a slice transfer is cut (each time resuming it).
pub const MAX_TRANSFER_ATTEMPTS: usize = 5;

/// Why generation stopped (OpenAI's `finish_reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `-n` tokens generated, or the context is full.
    Length,
    /// Interrupted by the user.
    Cancelled,
}

#[derive(Debug, Serialize)]
pub struct Generation {
    pub prompt_token_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    /// What ran the layers held in this process: `"cpu"` or `"gpu: <adapter> (…)"`.
    pub backend: String,
    #[serde(skip)]
    pub context_full: bool,
    #[serde(skip)]
    pub prefill_tokens: usize,
    /// Times a lost node made the generation resume on a rebuilt ring (`up --resume-retries`).
    pub resumed: u32,
    /// Milliseconds from the last token before each failure (or the failure, in the prompt)
    /// to the logits of the next (the failure noticed, the ring rebuilt, the prompt and the
    /// tokens so far replayed), summed.
    pub resume_ms: f64,
}

/// After a ring failure (`failure`) in the middle of a generation: while retries are left
/// (`Engine::resume_retries`), rebuilds the ring over the nodes still there and feeds it
/// `context` — the prompt and every token generated so far — so the logits of the next
/// token are exactly those the lost ring would have given. The caller's sampler and stop
/// state go on untouched, and nothing already written is written again. Returns the failure
/// when out of retries or when no ring can be built.
fn resume(
    engine: &mut Engine,
    context: &[u32],
    failure: anyhow::Error,
    since: Instant,
    out: &mut Generation,
) -> Result<()> {
    let mut failure = failure;
    loop {
        if engine.ring.is_none() || out.resumed as usize >= engine.resume_retries {
            return Err(failure);
        }
        out.resumed += 1;
        tracing::warn!("the ring failed mid-generation: {failure:#}");
        notice!(
            "\n[the ring failed: {failure:#}; rebuilding the ring over the nodes still there \
             and replaying {} tokens (resume {} of {})]",
            context.len(),
            out.resumed,
            engine.resume_retries
        );
        let r = engine
            .recover()
            .and_then(|()| engine.feed(context).map(|_| ()));
        match r {
            Ok(()) => {
                let ms = since.elapsed().as_secs_f64() * 1e3;
                out.resume_ms += ms;
                notice!("[resumed after {ms:.0} ms]");
                return Ok(());
            }
            Err(e) => failure = e,
        }
    }
}

/// Generates a continuation of `prompt` (already tokenized), streaming text to `on_text`.
/// `n_predict < 0` means no limit but the context.
pub fn generate(
    engine: &mut Engine,
    prompt: &[u32],
    n_predict: i64,
    sampler: &mut Sampler,
    stops: &[String],
    cancel: &AtomicBool,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generation> {
    if prompt.is_empty() {
        bail!("the prompt is empty (no tokens to start from)");
    }
    if prompt.len() >= engine.ctx {
        bail!(
            "the prompt has {} tokens, which does not fit the context of {} (raise --ctx)",
            prompt.len(),
            engine.ctx
        );
    }
    let eog = engine.tokenizer.eog_ids();
    let mut stop = StopStrings::new(stops.to_vec());
    let mut decoder = StreamDecoder::new();
    let mut out = Generation {
        prompt_token_ids: prompt.to_vec(),
        token_ids: Vec::new(),
        text: String::new(),
        finish_reason: FinishReason::Length,
        prefill_tokens_per_s: 0.0,
        decode_tokens_per_s: 0.0,
        backend: engine.runner.backend_name(),
        context_full: false,
        prefill_tokens: 0,
        resumed: 0,
        resume_ms: 0.0,
    };
    let t0 = Instant::now();
    let todo = engine.reuse_prefix(prompt);
    out.prefill_tokens = todo.len();
    if let Err(e) = engine.feed(todo) {
        resume(engine, prompt, e, Instant::now(), &mut out)?;
    }
    let prefill = t0.elapsed().as_secs_f64();
    out.prefill_tokens_per_s = todo.len() as f64 / prefill.max(1e-9);
    let mut history: Vec<u32> = prompt.to_vec();
    let t1 = Instant::now();
    let mut decoded = 0usize;
    let emit = |text: &str, out: &mut Generation, on_text: &mut dyn FnMut(&str)| {
        out.text.push_str(text);
        on_text(text);
    };
    let limit_reached = |n: usize| n_predict >= 0 && n as i64 >= n_predict;
    loop {
        if cancel.load(Ordering::Relaxed) {
            out.finish_reason = FinishReason::Cancelled;
            break;
        }
        if limit_reached(out.token_ids.len()) {
            out.finish_reason = FinishReason::Length;
            break;
        }
        // The next token would sit at position kv.len: there must be room for it.
        if engine.kv.len >= engine.ctx {
            out.finish_reason = FinishReason::Length;
            out.context_full = true;
            break;
        }
        if let Some(rows) = engine.step_logits.as_mut() {
            rows.extend_from_slice(&engine.logits);
        }
        let tok = sampler.sample(&engine.logits, &history);
        if eog.contains(&tok) {
            out.finish_reason = FinishReason::Stop;
            break;
        }
        out.token_ids.push(tok);
        history.push(tok);
        let last_token = Instant::now();
        let piece = decoder.push(&engine.tokenizer, tok);
        let (safe, matched) = stop.push(&piece);
        emit(&safe, &mut out, on_text);
        if matched {
            out.finish_reason = FinishReason::Stop;
            break;
        }
        if limit_reached(out.token_ids.len()) {
            continue; // the check above ends the loop without feeding a token never used
        }
        if let Err(e) = engine.feed(&[tok]) {
            resume(engine, &history, e, last_token, &mut out)?;
        }
        decoded += 1;
    }
    if out.finish_reason != FinishReason::Stop || stop.is_empty() {
        let rest = decoder.finish();
        let (safe, _) = stop.push(&rest);
        emit(&safe, &mut out, on_text);
        if out.finish_reason != FinishReason::Stop {
            let tail = stop.flush();
            emit(&tail, &mut out, on_text);
        }
    }
    let decode = t1.elapsed().as_secs_f64();
    out.decode_tokens_per_s = if decoded > 0 {
        decoded as f64 / decode.max(1e-9)
    } else {
        0.0
    };
    Ok(out)
}
