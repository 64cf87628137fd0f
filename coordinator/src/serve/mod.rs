//! Serving: an OpenAI-compatible HTTP API (`http`) in front of a batching scheduler
//! (`scheduler`) that keeps many sequences in flight. The two meet at `Backend`.

pub mod http;
pub mod ring_step;
pub mod scheduler;

use crate::cluster::ring::RingSpec;
use crate::engine::ModelOptions;
use crate::text::template::ChatTemplate;
use crate::text::tokenizer::Tokenizer;
use serde::Serialize;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// Sampling settings of one request (OpenAI names; the scheduler maps them to its sampler).
#[derive(Clone, Debug)]
pub struct Sampling {
    /// 0 = greedy.
    pub temperature: f32,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 0 = off.
    pub min_p: f32,
    /// 1 = off (llama.cpp-style multiplicative penalty over the last 64 tokens).
    pub repetition_penalty: f32,
    /// OpenAI's additive penalties over the generated tokens; 0 = off.
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub seed: Option<u64>,
}

/// One generation request, already tokenized.
pub struct GenRequest {
    pub prompt: Vec<u32>,
    /// Upper bound on generated tokens (the scheduler also stops at the context's end).
    pub max_tokens: usize,
    pub sampling: Sampling,
    /// Stop strings: never part of the output; matched across streamed pieces.
    pub stop: Vec<String>,
    /// `None`: no log-probabilities; `Some(k)`: the chosen token's and the top `k` (0..=20).
    pub logprobs: Option<usize>,
    /// Where the scheduler sends this request's events (tokens, then exactly one `Done` or
    /// `Error`).
    pub events: tokio::sync::mpsc::UnboundedSender<GenEvent>,
    /// Set by the HTTP layer when the client goes away: the scheduler stops the sequence and
    /// frees its slot.
    pub cancel: Arc<AtomicBool>,
    /// A grammar the output must follow (compiled by [`Backend::grammars`]); its masks are
    /// computed while the forward pass runs.
    pub constraint: Option<Box<crate::text::grammar::Constraint>>,
}

#[derive(Clone, Debug, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Clone, Debug)]
pub struct TokenLogprob {
    /// The chosen token's text (its own piece, not the released text).
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top: Vec<TopLogprob>,
}

#[derive(Clone, Debug, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    Stop,
    Length,
    /// The client went away or the server is shutting down.
    Cancelled,
}

#[derive(Clone, Debug)]
pub enum GenEvent {
    /// One generated token. `text` is what may be shown now: stop-string look-ahead may hold
    /// text back (empty `text`) and release it with a later token, and incomplete UTF-8 is
    /// held until complete.
    Token {
        /// The token id (the HTTP layer shows text; tests and tools read ids).
        #[allow(dead_code)]
        id: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// The end. `text` is any held-back text released at the end.
    Done {
        finish: Finish,
        text: String,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Prompt tokens whose KV came from an earlier request (prefix reuse).
        cached_tokens: usize,
        /// Whether (and how long) the request was carried over engine failures.
        resume: ResumeStats,
        /// The stop string that ended the text (`finish` is `Stop`), if one did; `None` when
        /// the model ended its turn itself.
        stop_sequence: Option<String>,
    },
    Error {
        message: String,
        /// `Some(seconds)`: the engine cannot serve for now (a ring lost its nodes) and the
        /// client may try again after this long (HTTP 503 with `Retry-After`); `None`: the
        /// engine failed (HTTP 500).
        retry_after_s: Option<u64>,
    },
}

/// How a request went through engine failures (a ring losing a node mid-answer): shown in
/// the response's `usage` as `resumed` and `resume_ms` when `resumed` > 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ResumeStats {
    /// Times the request was resumed on a rebuilt engine.
    pub resumed: u32,
    /// Milliseconds between the request's last token before each failure (or the failure,
    /// before its first token) and its next token, summed: the pause the client saw (noticing
    /// the failure, rebuilding the ring, replaying the prompt and the tokens so far), one
    /// ordinary token time of it not extra.
    pub resume_ms: f64,
}

/// Whether the engine can serve, for `/health`.
#[derive(Clone, Debug, Serialize)]
pub struct Health {
    /// False while requests cannot be served (the ring is down): `/health` answers 503.
    pub ready: bool,
    /// The ring's nodes in use, as "name (address)"; empty on one machine.
    pub nodes: Vec<String>,
    /// Nodes of the cluster that are not in the ring (lost, or not answering).
    pub missing: Vec<String>,
    /// Why the ring is down or runs without some nodes.
    pub error: Option<String>,
}

impl Health {
    /// One machine, or a ring with every node.
    pub fn ready() -> Health {
        Health {
            ready: true,
            nodes: Vec::new(),
            missing: Vec::new(),
            error: None,
        }
    }
}

/// Why a request was not queued.
#[derive(Clone, Debug)]
pub enum SubmitError {
    /// Every slot is busy and the queue is full.
    QueueFull {
        retry_after_s: u64,
    },
    ShuttingDown,
    /// The request cannot be served at all (message for a 400).
    Invalid(String),
}

/// Counters for `/metrics`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Metrics {
    pub requests_total: u64,
    pub requests_failed: u64,
    pub prompt_tokens_total: u64,
    pub completion_tokens_total: u64,
    pub queue_depth: u64,
    pub slots_total: u64,
    pub slots_busy: u64,
    /// Decode tokens per second over the last few seconds, all sequences together.
    pub decode_tokens_per_s: f64,
    /// (node name, mean ms per hop of the last frames); empty on one machine.
    pub node_latency_ms: Vec<(String, f64)>,
    /// Token masks computed for constrained requests, the seconds spent computing them (on
    /// the mask thread, beside the forward pass), and the seconds sampling waited for a mask
    /// not ready when the step's logits were (the part a grammar added to step time).
    pub grammar_masks_total: u64,
    pub grammar_mask_seconds_total: f64,
    pub grammar_wait_seconds_total: f64,
}

/// What the HTTP layer needs from an engine.
pub trait Backend: Send + Sync + 'static {
    /// Queues a request; its events arrive on `req.events`.
    fn submit(&self, req: GenRequest) -> Result<(), SubmitError>;
    /// The model's id in `/v1/models` (the file name without `.gguf`).
    fn model_id(&self) -> String;
    fn tokenizer(&self) -> &Tokenizer;
    /// The chat template, if the model has one (or `--template` gave one).
    fn template(&self) -> Option<&ChatTemplate>;
    /// Whether raw prompts (`/v1/completions`) get BOS.
    fn add_bos(&self) -> bool;
    /// Context size: prompt + max_tokens beyond it is trimmed to it, a prompt that does not
    /// fit is a 400.
    fn ctx(&self) -> usize;
    fn metrics(&self) -> Metrics;
    /// Whether requests can be served now (a ring: which nodes are in it, which are missing).
    fn health(&self) -> Health {
        Health::ready()
    }
    /// A ring's key and nodes, for `GET /v1/cluster` (`None` on one machine).
    fn cluster(&self) -> Option<crate::cluster::status::ClusterView> {
        None
    }
    /// The model's grammar compiler for constrained requests (built on first use).
    fn grammars(&self) -> Result<&crate::text::grammar::Grammars, String> {
        Err("constrained decoding is not available on this server".into())
    }
    /// Stop taking requests; cancel or finish what runs, then return.
    fn shutdown(&self);
}

/// How to serve: where, how many sequences at once, and who may ask.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// `HOST:PORT` to listen on.
    pub addr: String,
    /// Sequences decoded at once (KV slots).
    pub parallel: usize,
    /// Requests that may wait for a slot before new ones get 429.
    pub queue: usize,
    /// Most prompt tokens fed in one step.
    pub prefill_chunk: usize,
    /// Required `Authorization: Bearer` key, if any.
    pub api_key: Option<String>,
    /// Built-in chat template to use instead of the model's.
    pub template: Option<String>,
    /// Web origins allowed to call the API (`--cors`; see `http::ServeOptions::cors`).
    pub cors: Vec<String>,
    /// Host names answered without an API key besides the bound address (`--allow-host`;
    /// see `http::ServeOptions::allow_hosts`).
    pub allow_hosts: Vec<String>,
    /// Longest wait for a request head.
    pub header_timeout: std::time::Duration,
    /// Longest wait for a request body.
    pub body_timeout: std::time::Duration,
    /// Most connections open at once.
    pub max_connections: usize,
    /// Engine failures (a ring losing a node) one request is resumed after (`up
    /// --resume-retries`); one machine never resumes.
    pub resume_retries: usize,
}

/// Binds the serve address first (a taken port fails before the model loads) and warns when
/// it is reachable beyond this machine without an API key.
fn bind(cfg: &ServeConfig) -> anyhow::Result<std::net::TcpListener> {
    http::check_allow_hosts(&cfg.allow_hosts)?;
    let listener = http::bind(&cfg.addr)?;
    let public = listener.local_addr().is_ok_and(|a| !a.ip().is_loopback());
    if public && cfg.api_key.as_deref().is_none_or(str::is_empty) {
        notice!(
            warn: "warning: serving on {} without --api-key: anyone who can reach this port can use \
             the model; set --api-key KEY (or RINGLLM_API_KEY), or listen on 127.0.0.1",
            cfg.addr
        );
    }
    Ok(listener)
}

/// `ringllm run -m MODEL --serve ADDR`: the whole model in this process behind the API.
pub fn serve_local(margs: &ModelOptions, cfg: &ServeConfig) -> anyhow::Result<()> {
    use anyhow::Context;
    let listener = bind(cfg)?;
    let file = crate::engine::open_gguf(&margs.model)?;
    let spec = crate::text::tokenizer::TokenizerSpec::from_gguf(file.metadata())
        .with_context(|| format!("tokenizer of {}", margs.model.display()))?;
    let tokenizer = Arc::new(Tokenizer::new(&spec)?);
    let template =
        crate::text::resolve_template(cfg.template.as_deref(), &spec, &tokenizer, &margs.model)?;
    let model = ringllm_model::Model::load(
        file,
        &ringllm_model::LoadOptions {
            repack: margs.repack && margs.backend == ringllm_model::BackendChoice::Cpu,
            ..ringllm_model::LoadOptions::default()
        },
    )
    .with_context(|| format!("cannot load {}", margs.model.display()))?;
    let ctx = crate::engine::context_size(margs.ctx, model.hp.ctx_train).max(2);
    let kv = margs.kv;
    let threads = margs
        .threads
        .unwrap_or_else(crate::engine::default_threads)
        .max(1);
    let s = cfg;
    if s.parallel == 0 || s.prefill_chunk == 0 {
        anyhow::bail!("--parallel and --prefill-chunk must be at least 1");
    }
    ringllm_model::limits::check_runner(
        &model.hp,
        model.layer_range.clone(),
        threads,
        s.prefill_chunk.saturating_add(s.parallel),
        ctx,
        kv,
        s.parallel,
    )?;
    let mut runner = ringllm_model::Runner::new(
        Arc::new(model),
        threads,
        s.prefill_chunk.saturating_add(s.parallel),
        ctx,
    );
    crate::engine::set_backend(&mut runner, margs.backend)?;
    let stepper = scheduler::LocalStepper::new(runner, s.parallel, ctx, kv);
    let what = format!(
        "{} ({} slots, context {ctx}, {threads} threads)",
        margs.model.display(),
        s.parallel
    );
    start_and_serve(
        Box::new(stepper),
        tokenizer,
        template,
        &margs.model,
        ctx,
        cfg,
        listener,
        &what,
    )
}

/// Starts the scheduler over `stepper` and serves the API on `listener` until SIGTERM; says
/// so (with `what` is served) once it does.
#[allow(clippy::too_many_arguments)]
fn start_and_serve(
    stepper: Box<dyn scheduler::Stepper>,
    tokenizer: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    model: &std::path::Path,
    ctx: usize,
    cfg: &ServeConfig,
    listener: std::net::TcpListener,
    what: &str,
) -> anyhow::Result<()> {
    let s = cfg;
    let backend = scheduler::SchedBackend::start(
        stepper,
        Arc::clone(&tokenizer),
        template,
        model_id(model),
        tokenizer.add_bos_default(),
        scheduler::SchedulerOptions {
            queue: s.queue,
            prefill_chunk: s.prefill_chunk,
            ctx,
            resume_retries: s.resume_retries,
        },
    )?;
    let opts = http::ServeOptions {
        api_key: s.api_key.clone(),
        cors: s.cors.clone(),
        allow_hosts: s.allow_hosts.clone(),
        header_timeout: s.header_timeout,
        body_timeout: s.body_timeout,
        max_connections: s.max_connections,
        model: http::ModelCard::read(model),
    };
    let at = listener
        .local_addr()
        .map_or_else(|_| s.addr.clone(), |a| a.to_string());
    notice!("serving {what} on http://{at}/v1 (Ollama's API on /api, a chat page on /)");
    http::serve(listener, backend, opts)?;
    Ok(())
}

/// The id `/v1/models` lists: the file name without `.gguf`.
pub fn model_id(path: &std::path::Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

/// `ringllm up … --serve ADDR`: the ring behind the API.
pub fn serve_ring(margs: &ModelOptions, spec: RingSpec, cfg: &ServeConfig) -> anyhow::Result<()> {
    use anyhow::Context;
    let s = cfg;
    if s.parallel == 0 || s.prefill_chunk == 0 {
        anyhow::bail!("--parallel and --prefill-chunk must be at least 1");
    }
    let listener = bind(cfg)?;
    let file = crate::engine::open_gguf(&margs.model)?;
    let tspec = crate::text::tokenizer::TokenizerSpec::from_gguf(file.metadata())
        .with_context(|| format!("tokenizer of {}", margs.model.display()))?;
    let tokenizer = Arc::new(Tokenizer::new(&tspec)?);
    let template =
        crate::text::resolve_template(cfg.template.as_deref(), &tspec, &tokenizer, &margs.model)?;
    let hp = ringllm_model::Model::load(
        Arc::clone(&file),
        &ringllm_model::LoadOptions {
            layers: Some(0..0),
            embedding: false,
            head: false,
            repack: false,
            stream: None,
            experts: None,
        },
    )?
    .hp;
    let ctx = crate::engine::context_size(margs.ctx, hp.ctx_train).max(2);
    let args = ModelOptions {
        ctx: Some(ctx),
        batch: s.prefill_chunk.saturating_add(s.parallel),
        ..margs.clone()
    };
    let mode = crate::engine::RingMode {
        spec,
        args,
        file,
        ring: None,
        hp,
        skip: Vec::new(),
    };
    let stepper = ring_step::RingStepper::new(mode, s.parallel)?;
    let what = format!(
        "{} over the ring ({} slots, context {ctx})",
        margs.model.display(),
        s.parallel
    );
    start_and_serve(
        Box::new(stepper),
        tokenizer,
        template,
        &margs.model,
        ctx,
        cfg,
        listener,
        &what,
    )
}
