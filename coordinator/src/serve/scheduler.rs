//! The batching scheduler: one thread owns the model (or the ring) and a fixed number of KV
//! slots. Every step it takes the decode token of every running sequence plus prompt tokens
//! of sequences still prefilling (at most one partial chunk, see `plan_prefill`, so a long
//! prompt never stalls the others), runs them as one batch (one matrix × matrix pass over the
//! weights), computes the logits of every sequence that needs a token in one batched head
//! product, samples each with its own sampler, and streams text back. Requests wait first
//! come, first served in a bounded queue; a finished sequence keeps its slot's cache so a
//! conversation that comes back with its history reuses the prefix. When the engine fails
//! (a ring losing a node) every running request is resumed on the rebuilt ring: its prompt
//! and the tokens already generated are fed again as a prefill, and sampling goes on from
//! where it stopped (the sampler's state is kept), so the client sees a pause, not an error,
//! and nothing already sent is sent again. `SchedulerOptions::resume_retries` bounds how many
//! failures one request goes through; after that it gets an error.

use super::{
    Backend, Finish, GenEvent, GenRequest, Health, Metrics, SubmitError, TokenLogprob, TopLogprob,
};
use crate::text::sampler::{Sampler, SamplerParams, StopStrings};
use crate::text::template::ChatTemplate;
use crate::text::tokenizer::{StreamDecoder, Tokenizer};
use anyhow::Result;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Tokens fed for one sequence in one step.
pub struct Feed<'a> {
    pub slot: usize,
    pub tokens: &'a [u32],
    /// Whether the logits after the last of these tokens are wanted.
    pub want_logits: bool,
}

/// What runs the model: the whole model in this process, or a ring.
pub trait Stepper: Send {
    /// Runs `feeds` at each slot's current length (advancing it) and writes, for each feed
    /// that wants logits, in order, `vocab` logits into `logits`.
    fn step(&mut self, feeds: &[Feed], logits: &mut Vec<f32>) -> Result<()>;
    /// Positions a slot's cache holds.
    fn len(&self, slot: usize) -> usize;
    /// Shortens a slot's cache; false when it cannot (a sliding window already moved on).
    fn truncate(&mut self, slot: usize, len: usize) -> bool;
    fn vocab(&self) -> usize;
    fn slots(&self) -> usize;
    /// Most tokens one step may carry.
    fn max_batch(&self) -> usize;
    /// Per-node latency for /metrics (empty on one machine).
    fn node_latency_ms(&self) -> Vec<(String, f64)> {
        Vec::new()
    }
    /// How many batches may be in flight at once (a ring pipelines: while one node works on
    /// one batch, the next works on another). 1: only `step` is used.
    fn depth(&self) -> usize {
        1
    }
    /// Starts a batch (depth > 1 only); its logits come from `collect`, oldest first.
    fn submit(&mut self, feeds: &[Feed]) -> Result<()> {
        let _ = feeds;
        anyhow::bail!("this stepper does not pipeline")
    }
    fn collect(&mut self, logits: &mut Vec<f32>) -> Result<()> {
        let _ = logits;
        anyhow::bail!("this stepper does not pipeline")
    }
    /// Forgets batches in flight after a failure.
    fn abort(&mut self) {}
    /// A ring's key and nodes, for `GET /v1/cluster` (`None` on one machine).
    fn cluster(&self) -> Option<crate::cluster::status::ClusterView> {
        None
    }
    /// Whether the engine can serve (`None`: always; one machine).
    fn health(&self) -> Option<Health> {
        None
    }
    /// Called about once a second while no sequence runs: a ring checks its nodes and rebuilds
    /// itself when one was lost. True when every slot's cache was emptied meanwhile.
    fn idle(&mut self) -> bool {
        false
    }
    /// `Some(seconds)` when a failed step is worth retrying after that long (a ring that
    /// lost a node is rebuilt over the others); `None`: a failure is an engine error.
    fn retry_after_s(&self) -> Option<u64> {
        None
    }
}

/// The output head over the last row of every part that wants logits: `parts` gives each
/// part's row count and whether it wants logits, in the order of `x`'s rows; the logits land
/// in `logits`, one `vocab` row per wanting part.
pub fn head_logits(
    runner: &mut ringllm_model::Runner,
    x: &[f32],
    parts: impl Iterator<Item = (usize, bool)>,
    rows: &mut Vec<f32>,
    logits: &mut Vec<f32>,
) -> Result<()> {
    let d = runner.model.hp.d_model;
    let vocab = runner.model.hp.vocab;
    rows.clear();
    let mut row = 0;
    for (n, want) in parts {
        row += n;
        if want {
            rows.extend_from_slice(&x[(row - 1) * d..row * d]);
        }
    }
    let k = rows.len() / d;
    if k > 0 {
        runner.final_norm(rows, k)?;
        logits.resize(k * vocab, 0.0);
        runner.logits(rows, k, logits)?;
    }
    Ok(())
}

/// Embeds every feed's tokens, in order, into `x` (resized to the rows); returns the rows.
pub fn embed_feeds(
    runner: &ringllm_model::Runner,
    feeds: &[Feed],
    x: &mut Vec<f32>,
) -> Result<usize> {
    let d = runner.model.hp.d_model;
    let n: usize = feeds.iter().map(|f| f.tokens.len()).sum();
    x.resize(n * d, 0.0);
    let flat: Vec<u32> = feeds
        .iter()
        .flat_map(|f| f.tokens.iter().copied())
        .collect();
    runner.embed(&flat, &mut x[..n * d])?;
    Ok(n)
}

/// Runs `runner`'s layers over the feeds' rows of `x`, each with its slot's cache from
/// `caches` (slots in one step are distinct).
pub fn layers_for_feeds(
    runner: &mut ringllm_model::Runner,
    caches: &mut [ringllm_model::KvCache],
    feeds: &[Feed],
    x: &mut [f32],
) -> Result<()> {
    let mut refs: Vec<Option<&mut ringllm_model::KvCache>> = caches.iter_mut().map(Some).collect();
    let mut parts = Vec::with_capacity(feeds.len());
    for f in feeds {
        let c = refs
            .get_mut(f.slot)
            .and_then(|c| c.take())
            .ok_or_else(|| anyhow::anyhow!("slot {} twice in one step", f.slot))?;
        parts.push((c, f.tokens.len()));
    }
    runner.layers_multi(x, &mut parts, None)?;
    Ok(())
}

/// The whole model in this process.
pub struct LocalStepper {
    runner: ringllm_model::Runner,
    caches: Vec<ringllm_model::KvCache>,
    x: Vec<f32>,
    rows: Vec<f32>,
}

impl LocalStepper {
    pub fn new(
        runner: ringllm_model::Runner,
        slots: usize,
        ctx: usize,
        kv: ringllm_model::KvType,
    ) -> LocalStepper {
        let caches = (0..slots.max(1))
            .map(|_| runner.new_cache(ctx, kv))
            .collect();
        LocalStepper {
            runner,
            caches,
            x: Vec::new(),
            rows: Vec::new(),
        }
    }
}

impl Stepper for LocalStepper {
    fn step(&mut self, feeds: &[Feed], logits: &mut Vec<f32>) -> Result<()> {
        let d = self.runner.model.hp.d_model;
        let n = embed_feeds(&self.runner, feeds, &mut self.x)?;
        layers_for_feeds(
            &mut self.runner,
            &mut self.caches,
            feeds,
            &mut self.x[..n * d],
        )?;
        // The last row of every feed that wants logits, normed, in one head product.
        head_logits(
            &mut self.runner,
            &self.x[..n * d],
            feeds.iter().map(|f| (f.tokens.len(), f.want_logits)),
            &mut self.rows,
            logits,
        )?;
        Ok(())
    }

    fn len(&self, slot: usize) -> usize {
        self.caches.get(slot).map_or(0, |c| c.len)
    }

    fn truncate(&mut self, slot: usize, len: usize) -> bool {
        match self.caches.get_mut(slot) {
            Some(c) if c.can_truncate_to(len) => {
                c.truncate(len);
                true
            }
            _ => false,
        }
    }

    fn vocab(&self) -> usize {
        self.runner.model.hp.vocab
    }

    fn slots(&self) -> usize {
        self.caches.len()
    }

    fn max_batch(&self) -> usize {
        self.runner.max_batch()
    }
}

pub struct SchedulerOptions {
    /// Requests waiting for a slot before new ones get 429.
    pub queue: usize,
    /// Most prompt tokens fed in one step (one sequence's chunk).
    pub prefill_chunk: usize,
    pub ctx: usize,
    /// How many engine failures one request is resumed after (each time replaying its
    /// prompt and generated tokens on the rebuilt engine); the next one fails it. Only for
    /// steppers whose failures are worth retrying (`Stepper::retry_after_s`).
    pub resume_retries: usize,
}

/// The default of `up --resume-retries`.
pub const DEFAULT_RESUME_RETRIES: usize = 2;

/// Counters shared with the HTTP side.
#[derive(Default)]
struct Shared {
    accepting: AtomicBool,
    queued: AtomicU64,
    busy: AtomicU64,
    requests: AtomicU64,
    failed: AtomicU64,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    /// Decode tokens/s × 1000, over the last window.
    rate_milli: AtomicU64,
    node_latency: Mutex<Vec<(String, f64)>>,
    /// The stepper's last health report (`None`: one machine, always ready).
    health: Mutex<Option<Health>>,
}

enum Msg {
    Submit(Box<GenRequest>),
    Shutdown,
}

/// A `Backend` over a scheduler thread.
pub struct SchedBackend {
    tx: Mutex<Sender<Msg>>,
    shared: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    tokenizer: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    model_id: String,
    add_bos: bool,
    ctx: usize,
    slots: usize,
    queue: usize,
    cluster: Option<crate::cluster::status::ClusterView>,
}

impl SchedBackend {
    pub fn start(
        stepper: Box<dyn Stepper>,
        tokenizer: Arc<Tokenizer>,
        template: Option<ChatTemplate>,
        model_id: String,
        add_bos: bool,
        opts: SchedulerOptions,
    ) -> Result<Arc<SchedBackend>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared::default());
        shared.accepting.store(true, Ordering::SeqCst);
        let slots = stepper.slots();
        let ctx = opts.ctx;
        let queue = opts.queue;
        let cluster = stepper.cluster();
        let mut sched = Scheduler::new(stepper, Arc::clone(&tokenizer), Arc::clone(&shared), opts);
        sched.publish_health();
        let thread = std::thread::Builder::new()
            .name("scheduler".into())
            .spawn(move || sched.run(rx))?;
        Ok(Arc::new(SchedBackend {
            tx: Mutex::new(tx),
            shared,
            thread: Mutex::new(Some(thread)),
            tokenizer,
            template,
            model_id,
            add_bos,
            ctx,
            slots,
            queue,
            cluster,
        }))
    }
}

impl Backend for SchedBackend {
    fn cluster(&self) -> Option<crate::cluster::status::ClusterView> {
        self.cluster.clone()
    }

    fn submit(&self, req: GenRequest) -> Result<(), SubmitError> {
        if !self.shared.accepting.load(Ordering::SeqCst) {
            return Err(SubmitError::ShuttingDown);
        }
        if req.prompt.is_empty() {
            return Err(SubmitError::Invalid("the prompt is empty".into()));
        }
        if req.prompt.len() >= self.ctx {
            return Err(SubmitError::Invalid(format!(
                "the prompt has {} tokens; the context holds {}",
                req.prompt.len(),
                self.ctx
            )));
        }
        // Waiting beyond the free slots is capped.
        let waiting = self.shared.queued.load(Ordering::SeqCst);
        let busy = self.shared.busy.load(Ordering::SeqCst);
        if busy + waiting >= (self.slots + self.queue) as u64 {
            return Err(SubmitError::QueueFull { retry_after_s: 1 });
        }
        self.shared.queued.fetch_add(1, Ordering::SeqCst);
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        tx.send(Msg::Submit(Box::new(req))).map_err(|_| {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            SubmitError::ShuttingDown
        })
    }

    fn model_id(&self) -> String {
        self.model_id.clone()
    }

    fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    fn template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    fn add_bos(&self) -> bool {
        self.add_bos
    }

    fn ctx(&self) -> usize {
        self.ctx
    }

    fn metrics(&self) -> Metrics {
        let s = &self.shared;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Metrics {
            requests_total: g(&s.requests),
            requests_failed: g(&s.failed),
            prompt_tokens_total: g(&s.prompt_tokens),
            completion_tokens_total: g(&s.completion_tokens),
            queue_depth: g(&s.queued),
            slots_total: self.slots as u64,
            slots_busy: g(&s.busy),
            decode_tokens_per_s: g(&s.rate_milli) as f64 / 1000.0,
            node_latency_ms: s.node_latency.lock().map(|v| v.clone()).unwrap_or_default(),
        }
    }

    fn health(&self) -> Health {
        self.shared
            .health
            .lock()
            .ok()
            .and_then(|h| h.clone())
            .unwrap_or_else(Health::ready)
    }

    fn shutdown(&self) {
        self.shared.accepting.store(false, Ordering::SeqCst);
        let _ = self
            .tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(Msg::Shutdown);
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// A running sequence.
struct Active {
    req: Box<GenRequest>,
    /// Tokens still to feed (prompt rest, or the last sampled token).
    pending: Vec<u32>,
    sampler: Sampler,
    stop: StopStrings,
    decoder: StreamDecoder,
    /// Prompt and generated tokens (for penalties).
    history: Vec<u32>,
    generated: usize,
    counts: std::collections::HashMap<u32, u32>,
    cached: usize,
    /// Part of a batch in flight (pipelined ring).
    in_flight: bool,
    /// Engine failures this request was resumed after, and the time spent resuming.
    resume: super::ResumeStats,
    /// Since when the request waits to be resumed, until its next token: its last token
    /// before the failure (else the failure).
    paused: Option<Instant>,
    /// When its last token was sampled.
    last_token: Option<Instant>,
    /// The step that last carried some of its prompt (`None`: its prefill has not started).
    last_fed: Option<u64>,
}

/// A request waiting for a slot.
struct Waiting {
    req: Box<GenRequest>,
}

struct Slot {
    /// Tokens whose keys and values the slot's cache holds (for prefix reuse).
    tokens: Vec<u32>,
    active: Option<Active>,
    last_used: u64,
}

struct Scheduler {
    stepper: Box<dyn Stepper>,
    tokenizer: Arc<Tokenizer>,
    shared: Arc<Shared>,
    opts: SchedulerOptions,
    slots: Vec<Slot>,
    queue: VecDeque<Waiting>,
    eog: Vec<u32>,
    logits: Vec<f32>,
    clock: u64,
    /// (time, tokens) of recent decode steps for the rate.
    recent: VecDeque<(Instant, usize)>,
    /// Batches in flight, oldest first: (slot, tokens fed) each.
    inflight: VecDeque<Vec<(usize, usize)>>,
    /// Batches formed so far (the prefill planner's clock).
    steps: u64,
    /// When the stepper's `idle` last ran.
    last_idle: Instant,
    /// Whether the health last published says ready.
    ready_published: bool,
}

impl Scheduler {
    fn new(
        stepper: Box<dyn Stepper>,
        tokenizer: Arc<Tokenizer>,
        shared: Arc<Shared>,
        opts: SchedulerOptions,
    ) -> Scheduler {
        let slots = (0..stepper.slots())
            .map(|_| Slot {
                tokens: Vec::new(),
                active: None,
                last_used: 0,
            })
            .collect();
        let eog = tokenizer.eog_ids();
        Scheduler {
            stepper,
            tokenizer,
            shared,
            opts,
            slots,
            queue: VecDeque::new(),
            eog,
            logits: Vec::new(),
            clock: 0,
            recent: VecDeque::new(),
            inflight: VecDeque::new(),
            steps: 0,
            last_idle: Instant::now(),
            ready_published: false,
        }
    }

    fn run(mut self, rx: Receiver<Msg>) {
        loop {
            // Take new requests: wait when idle, else just look.
            let idle = self.slots.iter().all(|s| s.active.is_none()) && self.queue.is_empty();
            let first = if idle {
                match rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(m) => Some(m),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            } else {
                rx.try_recv().ok()
            };
            let mut msgs: Vec<Msg> = first.into_iter().collect();
            while let Ok(m) = rx.try_recv() {
                msgs.push(m);
            }
            for m in msgs {
                match m {
                    Msg::Submit(req) => self.queue.push_back(Waiting { req }),
                    Msg::Shutdown => {
                        self.shutdown();
                        return;
                    }
                }
            }
            if idle && self.queue.is_empty() && self.last_idle.elapsed() >= IDLE_CHECK {
                self.last_idle = Instant::now();
                if self.stepper.idle() {
                    for s in &mut self.slots {
                        s.tokens.clear();
                    }
                }
                self.publish_health();
            }
            self.admit();
            self.reap_cancelled();
            match self.step() {
                Ok(()) if !self.ready_published => self.publish_health(),
                Ok(()) => {}
                Err(e) => self.failed(&e),
            }
        }
    }

    fn publish_health(&mut self) {
        let h = self.stepper.health();
        self.ready_published = h.as_ref().is_none_or(|h| h.ready);
        if let Ok(mut shared) = self.shared.health.lock() {
            *shared = h;
        }
    }

    /// The engine failed (e.g. a node was lost). Every running request is resumed: its
    /// slot's cache is gone (the ring is rebuilt on the next step), so what it holds — the
    /// prompt and the tokens generated so far — is fed again as a prefill, after which
    /// sampling goes on with the same sampler (its random state untouched: no token was
    /// sampled from the failed step). A request that already went through
    /// `resume_retries` failures gets an error instead; so do all when the engine's failures
    /// are not worth retrying (one machine).
    fn failed(&mut self, e: &anyhow::Error) {
        let message = format!("{e:#}");
        tracing::warn!("step failed: {message}");
        self.inflight.clear();
        self.stepper.abort();
        let retry_after_s = self.stepper.retry_after_s();
        let now = Instant::now();
        let (mut resumed, mut failed) = (0usize, 0usize);
        for i in 0..self.slots.len() {
            self.slots[i].tokens.clear();
            self.stepper.truncate(i, 0);
            let Some(a) = self.slots[i].active.as_mut() else {
                continue;
            };
            if retry_after_s.is_some() && (a.resume.resumed as usize) < self.opts.resume_retries {
                a.resume.resumed += 1;
                a.pending = a.history.clone();
                a.in_flight = false;
                a.last_fed = None;
                a.paused.get_or_insert(a.last_token.unwrap_or(now));
                resumed += 1;
                continue;
            }
            let Some(a) = self.slots[i].active.take() else {
                continue;
            };
            failed += 1;
            self.shared.busy.fetch_sub(1, Ordering::SeqCst);
            self.shared.failed.fetch_add(1, Ordering::Relaxed);
            let message = if a.resume.resumed > 0 {
                format!(
                    "{message} (the request was resumed {} time(s) already; --resume-retries {})",
                    a.resume.resumed, self.opts.resume_retries
                )
            } else {
                message.clone()
            };
            let _ = a.req.events.send(GenEvent::Error {
                message,
                retry_after_s,
            });
        }
        if resumed > 0 {
            tracing::warn!(resumed, failed, "resuming requests after an engine failure");
            notice!(
                "[resuming {resumed} request(s) on the rebuilt ring (prompt and generated tokens \
                 replayed){}]",
                if failed > 0 {
                    format!("; {failed} out of retries failed")
                } else {
                    String::new()
                }
            );
        }
        self.publish_health();
    }

    fn shutdown(&mut self) {
        while let Some(Waiting { req: r }) = self.queue.pop_front() {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            let _ = r.events.send(GenEvent::Done {
                finish: Finish::Cancelled,
                text: String::new(),
                prompt_tokens: r.prompt.len(),
                completion_tokens: 0,
                cached_tokens: 0,
                resume: Default::default(),
            });
        }
        for i in 0..self.slots.len() {
            self.finish(i, Finish::Cancelled);
        }
    }

    /// Gives waiting requests free slots, preferring the slot whose cache shares the longest
    /// prefix with the prompt.
    fn admit(&mut self) {
        while let Some(Waiting { req, .. }) = self.queue.front() {
            let free: Vec<usize> = (0..self.slots.len())
                .filter(|&i| self.slots[i].active.is_none())
                .collect();
            if free.is_empty() {
                break;
            }
            let prompt = &req.prompt;
            let common = |i: usize| {
                self.slots[i]
                    .tokens
                    .iter()
                    .zip(prompt)
                    .take_while(|(a, b)| a == b)
                    .count()
                    .min(prompt.len() - 1)
            };
            let best = free
                .iter()
                .copied()
                .max_by_key(|&i| (common(i), u64::MAX - self.slots[i].last_used))
                .unwrap_or(free[0]);
            let mut keep = common(best);
            if !self.stepper.truncate(best, keep) {
                keep = 0;
                self.stepper.truncate(best, 0);
            }
            let Some(Waiting { req }) = self.queue.pop_front() else {
                break;
            };
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            self.shared.busy.fetch_add(1, Ordering::SeqCst);
            self.shared.requests.fetch_add(1, Ordering::Relaxed);
            self.shared
                .prompt_tokens
                .fetch_add(req.prompt.len() as u64, Ordering::Relaxed);
            let s = &req.sampling;
            let seed = s.seed.unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64)
            });
            let sampler = Sampler::new(&SamplerParams {
                temperature: s.temperature,
                top_k: s.top_k,
                top_p: s.top_p,
                min_p: s.min_p,
                repeat_penalty: s.repetition_penalty,
                repeat_last_n: 64,
                seed,
            });
            let slot = &mut self.slots[best];
            slot.tokens.truncate(keep);
            self.clock += 1;
            slot.last_used = self.clock;
            slot.active = Some(Active {
                pending: req.prompt[keep..].to_vec(),
                sampler,
                stop: StopStrings::new(req.stop.clone()),
                decoder: StreamDecoder::new(),
                history: req.prompt.clone(),
                generated: 0,
                counts: Default::default(),
                cached: keep,
                in_flight: false,
                resume: Default::default(),
                paused: None,
                last_token: None,
                last_fed: None,
                req,
            });
        }
    }

    fn reap_cancelled(&mut self) {
        for i in 0..self.slots.len() {
            let gone = self.slots[i].active.as_ref().is_some_and(|a| {
                !a.in_flight && (a.req.cancel.load(Ordering::Relaxed) || a.req.events.is_closed())
            });
            if gone {
                self.finish(i, Finish::Cancelled);
            }
        }
    }

    /// Ends slot `i`'s sequence with `finish`, releasing held-back text.
    fn finish(&mut self, i: usize, finish: Finish) {
        let Some(mut a) = self.slots[i].active.take() else {
            return;
        };
        let mut text = String::new();
        if finish != Finish::Stop || a.stop.is_empty() {
            let rest = a.decoder.finish();
            let (safe, _) = a.stop.push(&rest);
            text.push_str(&safe);
            if finish != Finish::Stop {
                text.push_str(&a.stop.flush());
            }
        }
        self.shared.busy.fetch_sub(1, Ordering::SeqCst);
        self.shared
            .completion_tokens
            .fetch_add(a.generated as u64, Ordering::Relaxed);
        let _ = a.req.events.send(GenEvent::Done {
            finish,
            text,
            prompt_tokens: a.req.prompt.len(),
            completion_tokens: a.generated,
            cached_tokens: a.cached,
            resume: a.resume,
        });
    }

    /// A batch of runnable sequences (not in flight): one decode token each, then prompt
    /// tokens as `plan_prefill` picks them; at most `cap` sequences. Empty when nothing can
    /// run.
    fn form_group(&mut self, cap: usize) -> Vec<(usize, usize)> {
        let max_batch = self.stepper.max_batch();
        let mut plan: Vec<(usize, usize)> = Vec::new(); // (slot, tokens to feed)
        let mut total = 0;
        for (i, s) in self.slots.iter().enumerate() {
            if let Some(a) = &s.active {
                if !a.in_flight && a.pending.len() == 1 && total < max_batch && plan.len() < cap {
                    plan.push((i, 1));
                    total += 1;
                }
            }
        }
        self.steps += 1;
        let budget = self.opts.prefill_chunk.min(max_batch.saturating_sub(total));
        let room = cap.max(1).saturating_sub(plan.len());
        if budget > 0 && room > 0 {
            let waiting: Vec<PrefillCand> = (0..self.slots.len())
                .filter_map(|i| {
                    let a = self.slots[i].active.as_ref()?;
                    (!a.in_flight && a.pending.len() > 1).then_some(PrefillCand {
                        slot: i,
                        pending: a.pending.len(),
                        last_fed: a.last_fed,
                        admitted: self.slots[i].last_used,
                    })
                })
                .collect();
            for (i, n) in plan_prefill(&waiting, budget, room, self.steps) {
                if let Some(a) = self.slots[i].active.as_mut() {
                    a.last_fed = Some(self.steps);
                }
                plan.push((i, n));
            }
        }
        plan
    }

    fn feeds<'a>(slots: &'a [Slot], plan: &[(usize, usize)]) -> Vec<Feed<'a>> {
        plan.iter()
            .map(|&(i, n)| {
                let a = slots[i].active.as_ref();
                Feed {
                    slot: i,
                    tokens: a.map_or(&[][..], |a| &a.pending[..n]),
                    want_logits: a.is_some_and(|a| a.pending.len() == n),
                }
            })
            .collect()
    }

    /// One round: a synchronous step, or (pipelined) keep the ring full and complete the
    /// oldest batch.
    fn step(&mut self) -> Result<()> {
        let depth = self.stepper.depth();
        if depth <= 1 {
            let plan = self.form_group(usize::MAX);
            if plan.is_empty() {
                return Ok(());
            }
            let mut logits = std::mem::take(&mut self.logits);
            let feeds = Self::feeds(&self.slots, &plan);
            let r = self.stepper.step(&feeds, &mut logits);
            drop(feeds);
            r?;
            self.complete(&plan, &mut logits);
            self.logits = logits;
            return Ok(());
        }
        // Spread the runnable sequences over `depth` batches.
        let active = self.slots.iter().filter(|s| s.active.is_some()).count();
        let cap = active.div_ceil(depth).max(1);
        while self.inflight.len() < depth {
            let plan = self.form_group(cap);
            if plan.is_empty() {
                break;
            }
            let feeds = Self::feeds(&self.slots, &plan);
            let r = self.stepper.submit(&feeds);
            drop(feeds);
            r?;
            for &(i, _) in &plan {
                if let Some(a) = self.slots[i].active.as_mut() {
                    a.in_flight = true;
                }
            }
            self.inflight.push_back(plan);
        }
        let Some(plan) = self.inflight.pop_front() else {
            return Ok(());
        };
        let mut logits = std::mem::take(&mut self.logits);
        self.stepper.collect(&mut logits)?;
        for &(i, _) in &plan {
            if let Some(a) = self.slots[i].active.as_mut() {
                a.in_flight = false;
            }
        }
        self.complete(&plan, &mut logits);
        self.logits = logits;
        Ok(())
    }

    /// After a batch: advance every sequence, sample those that got logits, finish any done.
    fn complete(&mut self, plan: &[(usize, usize)], logits: &mut [f32]) {
        let ctx = self.opts.ctx;
        let t0 = Instant::now();
        let vocab = self.stepper.vocab();
        let mut row = 0;
        let mut decoded = 0;
        for &(i, n) in plan {
            let len = self.stepper.len(i);
            let slot = &mut self.slots[i];
            let Some(a) = slot.active.as_mut() else {
                continue;
            };
            let fed: Vec<u32> = a.pending.drain(..n).collect();
            slot.tokens.extend_from_slice(&fed);
            if !a.pending.is_empty() {
                continue; // more prompt to feed
            }
            let lrow = &mut logits[row * vocab..(row + 1) * vocab];
            row += 1;
            decoded += 1;
            if a.req.cancel.load(Ordering::Relaxed) || a.req.events.is_closed() {
                self.finish(i, Finish::Cancelled);
                continue;
            }
            if let Some(t) = a.paused.take() {
                let ms = t.elapsed().as_secs_f64() * 1e3;
                a.resume.resume_ms += ms;
                tracing::info!(
                    replayed = len,
                    ms,
                    "request resumed: {} generated token(s) replayed",
                    a.generated
                );
                notice!(
                    "[resumed a request after {ms:.0} ms: {len} tokens replayed ({} generated)]",
                    a.generated
                );
            }
            a.last_token = Some(Instant::now());
            let reason = sample_one(a, lrow, &self.tokenizer, &self.eog, len, ctx);
            if let Some(f) = reason {
                self.finish(i, f);
            }
        }
        // Decode rate over the last 5 s.
        let now = Instant::now();
        self.recent.push_back((now, decoded));
        while self
            .recent
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > Duration::from_secs(5))
        {
            self.recent.pop_front();
        }
        if let Some((t, _)) = self.recent.front() {
            let span = now
                .duration_since(*t)
                .as_secs_f64()
                .max(now.duration_since(t0).as_secs_f64());
            let toks: usize = self.recent.iter().map(|r| r.1).sum();
            self.shared.rate_milli.store(
                (1000.0 * toks as f64 / span.max(1e-3)) as u64,
                Ordering::Relaxed,
            );
        }
        if let Ok(mut v) = self.shared.node_latency.lock() {
            *v = self.stepper.node_latency_ms();
        }
    }
}

/// How often an idle scheduler lets the stepper check its engine (a ring its nodes).
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// A sequence with prompt left to feed, as `plan_prefill` sees it.
#[derive(Clone, Copy, Debug)]
struct PrefillCand {
    slot: usize,
    /// Prompt tokens still to feed (more than one: the last is fed as a decode token).
    pending: usize,
    /// The step that last carried some of its prompt (`None`: not started).
    last_fed: Option<u64>,
    /// Admission order.
    admitted: u64,
}

/// Which prompts step number `step` carries, within `budget` tokens and `room` sequences:
/// (slot, tokens), in order. Fair to prompts short and long:
/// - a prefill under way never waits two steps in a row: one the previous step left out goes
///   first (least recently fed first);
/// - otherwise prompts not started yet go first, oldest first, then the others;
/// - a prompt is taken whole when it fits what is left of the budget; a partial chunk only
///   as the step's first prefill. So a short prompt arriving while a long one prefills is fed
///   whole in the next step, without a long chunk beside it, and the long one resumes in the
///   step after.
fn plan_prefill(
    cands: &[PrefillCand],
    budget: usize,
    room: usize,
    step: u64,
) -> Vec<(usize, usize)> {
    let previous = step.saturating_sub(1);
    // Rank: 0 = under way and left out of the previous step, 1 = not started, 2 = under way.
    let rank = |c: &PrefillCand| match c.last_fed {
        Some(f) if f < previous => (0, f, c.admitted),
        None => (1, 0, c.admitted),
        Some(f) => (2, f, c.admitted),
    };
    let mut order: Vec<&PrefillCand> = cands.iter().collect();
    order.sort_by_key(|c| rank(c));
    let mut plan = Vec::new();
    let mut left = budget;
    for c in order {
        if left == 0 || plan.len() >= room {
            break;
        }
        if c.pending <= left {
            plan.push((c.slot, c.pending));
            left -= c.pending;
        } else if plan.is_empty() {
            plan.push((c.slot, left));
            break;
        }
    }
    plan
}

/// Samples the next token of `a` from `logits` (modified in place by penalties), streams it,
/// and returns why the sequence ends, if it does.
fn sample_one(
    a: &mut Active,
    logits: &mut [f32],
    tok: &Tokenizer,
    eog: &[u32],
    cache_len: usize,
    ctx: usize,
) -> Option<Finish> {
    let logprob_info = a.req.logprobs.map(|k| log_softmax_top(logits, k));
    let s = &a.req.sampling;
    if s.frequency_penalty != 0.0 || s.presence_penalty != 0.0 {
        for (&t, &c) in &a.counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= s.frequency_penalty * c as f32 + s.presence_penalty;
            }
        }
    }
    let id = a.sampler.sample(logits, &a.history);
    if eog.contains(&id) {
        return Some(Finish::Stop);
    }
    // The chosen token's raw logit: undo the penalty subtracted above.
    let raw_chosen =
        logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |l| match a.counts.get(&id) {
                Some(&c) => l + s.frequency_penalty * c as f32 + s.presence_penalty,
                None => *l,
            });
    a.generated += 1;
    a.history.push(id);
    *a.counts.entry(id).or_insert(0) += 1;
    let piece = a.decoder.push(tok, id);
    let (text, matched) = a.stop.push(&piece);
    let logprob = logprob_info.map(|(lse, top)| {
        let bytes = tok.token_bytes(id, false);
        TokenLogprob {
            token: String::from_utf8_lossy(&bytes).into_owned(),
            logprob: raw_chosen - lse,
            bytes,
            top: top
                .into_iter()
                .map(|(t, l)| {
                    let b = tok.token_bytes(t, false);
                    TopLogprob {
                        token: String::from_utf8_lossy(&b).into_owned(),
                        logprob: l,
                        bytes: b,
                    }
                })
                .collect(),
        }
    });
    let _ = a.req.events.send(GenEvent::Token { id, text, logprob });
    if matched {
        return Some(Finish::Stop);
    }
    if a.generated >= a.req.max_tokens || cache_len + 1 >= ctx {
        return Some(Finish::Length);
    }
    a.pending.push(id);
    None
}

/// The raw logits' log-sum-exp and the top `k` ids with their log-probabilities (before any
/// penalty or temperature: the model's own distribution).
fn log_softmax_top(logits: &[f32], k: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum: f64 = logits.iter().map(|&v| ((v - max) as f64).exp()).sum();
    let lse = max + sum.ln() as f32;
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .partial_cmp(&logits[*a as usize])
            .unwrap_or(std::cmp::Ordering::Equal)
    };
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(logits.len());
    if k > 0 {
        idx.select_nth_unstable_by(k - 1, by_logit);
        idx.truncate(k);
        idx.sort_by(by_logit);
    } else {
        idx.clear();
    }
    let top = idx
        .into_iter()
        .map(|i| (i, logits[i as usize] - lse))
        .collect();
    (lse, top)
}

#[cfg(test)]
mod tests;
