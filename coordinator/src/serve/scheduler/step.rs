//! The scheduler thread: its slots and their KV bookkeeping (admitting, finishing, prefix
//! reuse), and the step loop that batches, runs and samples.

use super::masks::{Done, Grammar, Masks};
use super::prefill::{plan_prefill, PrefillCand};
use super::sample::sample_one;
use super::{Feed, Msg, SchedulerOptions, Shared, Stepper};
use crate::serve::{Finish, GenEvent, GenRequest};
use crate::text::sampler::{Sampler, SamplerParams, StopStrings};
use crate::text::tokenizer::{StreamDecoder, Tokenizer};
use anyhow::Result;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A running sequence.
pub(super) struct Active {
    pub(super) req: Box<GenRequest>,
    /// Tokens still to feed (prompt rest, or the last sampled token).
    pub(super) pending: Vec<u32>,
    pub(super) sampler: Sampler,
    pub(super) stop: StopStrings,
    pub(super) decoder: StreamDecoder,
    /// Prompt and generated tokens (for penalties).
    pub(super) history: Vec<u32>,
    pub(super) generated: usize,
    pub(super) counts: std::collections::HashMap<u32, u32>,
    pub(super) cached: usize,
    /// Part of a batch in flight (pipelined ring).
    pub(super) in_flight: bool,
    /// Engine failures this request was resumed after, and the time spent resuming.
    pub(super) resume: crate::serve::ResumeStats,
    /// Since when the request waits to be resumed, until its next token: its last token
    /// before the failure (else the failure).
    pub(super) paused: Option<Instant>,
    /// When its last token was sampled.
    pub(super) last_token: Option<Instant>,
    /// The step that last carried some of its prompt (`None`: its prefill has not started).
    pub(super) last_fed: Option<u64>,
    /// The request's number (its grammar's jobs are matched back by it).
    pub(super) seq: u64,
    /// Its grammar, if constrained.
    pub(super) grammar: Grammar,
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

pub(super) struct Scheduler {
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
    /// The grammar thread (constrained requests' masks).
    masks: Masks,
    /// Requests admitted so far (each one's `seq`).
    admitted: u64,
}

impl Scheduler {
    pub(super) fn new(
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
            masks: Masks::default(),
            admitted: 0,
        }
    }

    pub(super) fn run(mut self, rx: Receiver<Msg>) {
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

    pub(super) fn publish_health(&mut self) {
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
                stop_sequence: None,
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
            let Some(Waiting { mut req }) = self.queue.pop_front() else {
                break;
            };
            self.admitted += 1;
            let seq = self.admitted;
            // The first mask is computed while the prompt is prefilled.
            let grammar = match req.constraint.take() {
                Some(c) => self.masks.send(seq, c, None),
                None => Grammar::None,
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
                seq,
                grammar,
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
            stop_sequence: a.stop.matched().map(str::to_string),
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
            if matches!(a.grammar, Grammar::Away) {
                self.await_grammar(i);
            }
            let Some(a) = self.slots[i].active.as_mut() else {
                continue;
            };
            a.last_token = Some(Instant::now());
            match sample_one(a, lrow, &self.tokenizer, &self.eog, len, ctx) {
                Err(message) => self.fail_one(i, message),
                Ok(Some(f)) => self.finish(i, f),
                Ok(None) => {
                    // The grammar takes the token and computes the next mask while the next
                    // step runs.
                    if let Grammar::Here(c) = std::mem::replace(&mut a.grammar, Grammar::None) {
                        a.grammar = self.masks.send(a.seq, c, a.pending.last().copied());
                    }
                }
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

impl Scheduler {
    /// Waits until slot `i`'s grammar is back from the grammar thread, placing the others
    /// that come back first. The time waited is what the grammar added to the step.
    fn await_grammar(&mut self, i: usize) {
        let t0 = Instant::now();
        while self.slots[i]
            .active
            .as_ref()
            .is_some_and(|a| matches!(a.grammar, Grammar::Away))
        {
            match self.masks.recv() {
                Some(d) => self.place(d),
                None => {
                    // The thread is gone: every constraint still out is lost.
                    for s in &mut self.slots {
                        if let Some(a) = s.active.as_mut() {
                            if matches!(a.grammar, Grammar::Away) {
                                a.grammar = Grammar::Failed("the grammar thread stopped".into());
                            }
                        }
                    }
                }
            }
        }
        let waited = t0.elapsed().as_nanos() as u64;
        self.shared
            .grammar_wait_ns
            .fetch_add(waited, Ordering::Relaxed);
    }

    /// A constraint back from the grammar thread, to its sequence (gone: dropped).
    fn place(&mut self, d: Done) {
        self.shared.grammar_masks.fetch_add(1, Ordering::Relaxed);
        self.shared
            .grammar_mask_ns
            .fetch_add((d.seconds * 1e9) as u64, Ordering::Relaxed);
        let Some(a) = self
            .slots
            .iter_mut()
            .filter_map(|s| s.active.as_mut())
            .find(|a| a.seq == d.seq)
        else {
            return;
        };
        a.grammar = match d.result {
            Ok(()) => Grammar::Here(d.c),
            Err(m) => Grammar::Failed(m),
        };
    }

    /// Ends slot `i`'s request with an error (its grammar failed); the others go on.
    fn fail_one(&mut self, i: usize, message: String) {
        let Some(a) = self.slots[i].active.take() else {
            return;
        };
        tracing::warn!("request failed: {message}");
        self.shared.busy.fetch_sub(1, Ordering::SeqCst);
        self.shared.failed.fetch_add(1, Ordering::Relaxed);
        let _ = a.req.events.send(GenEvent::Error {
            message,
            retry_after_s: None,
        });
    }
}

/// How often an idle scheduler lets the stepper check its engine (a ring its nodes).
const IDLE_CHECK: Duration = Duration::from_secs(1);
