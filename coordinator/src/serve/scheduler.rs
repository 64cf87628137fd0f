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

mod local;
mod masks;
mod prefill;
mod sample;
mod step;

use super::{Backend, GenRequest, Health, Metrics, SubmitError};
use crate::text::template::ChatTemplate;
use crate::text::tokenizer::Tokenizer;
use anyhow::Result;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

pub use local::{embed_feeds, head_logits, layers_for_feeds, LocalStepper};
use step::Scheduler;

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
    /// Constrained decoding: masks computed, nanoseconds computing them, nanoseconds
    /// sampling waited for them.
    grammar_masks: AtomicU64,
    grammar_mask_ns: AtomicU64,
    grammar_wait_ns: AtomicU64,
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
    /// Rows of the model's logits (the grammar's vocabulary).
    vocab: usize,
    /// The grammar compiler, built by the first constrained request.
    grammars: std::sync::OnceLock<Result<crate::text::grammar::Grammars, String>>,
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
        let vocab = stepper.vocab();
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
            vocab,
            grammars: std::sync::OnceLock::new(),
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

    fn grammars(&self) -> Result<&crate::text::grammar::Grammars, String> {
        self.grammars
            .get_or_init(|| {
                crate::text::grammar::Grammars::new(&self.tokenizer, self.vocab)
                    .map_err(|e| format!("cannot build the grammar vocabulary: {e:#}"))
            })
            .as_ref()
            .map_err(Clone::clone)
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
            grammar_masks_total: g(&s.grammar_masks),
            grammar_mask_seconds_total: g(&s.grammar_mask_ns) as f64 / 1e9,
            grammar_wait_seconds_total: g(&s.grammar_wait_ns) as f64 / 1e9,
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

#[cfg(test)]
mod tests;
