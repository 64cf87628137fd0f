//! The scheduler with a real model: batching equals solo runs, fair prefill, slots and queue.

use super::prefill::{plan_prefill, PrefillCand};
use super::*;
use crate::serve::{Finish, GenEvent, Sampling};
use crate::text::tokenizer::TokenizerSpec;
use ringllm_model::gguf::GgufFile;
use ringllm_model::synth::{synth_model, SynthArch, SynthSpec};
use ringllm_model::{KvType, LoadOptions, Model, Runner};
use std::sync::mpsc::Receiver;

fn backend(arch: SynthArch, slots: usize, queue: usize) -> Arc<SchedBackend> {
    backend_over(arch, slots, queue, 0, |s| Box::new(s))
}

/// A scheduler over the synthetic model, its `LocalStepper` wrapped by `wrap`.
fn backend_over(
    arch: SynthArch,
    slots: usize,
    queue: usize,
    resume_retries: usize,
    wrap: impl FnOnce(LocalStepper) -> Box<dyn Stepper>,
) -> Arc<SchedBackend> {
    let bytes = synth_model(&SynthSpec::new(arch, ringllm_kernels::GgmlType::Q8_0, 7)).unwrap();
    let file = Arc::new(GgufFile::from_bytes(bytes).unwrap());
    let spec = TokenizerSpec::from_gguf(file.metadata()).unwrap();
    let tok = Arc::new(Tokenizer::new(&spec).unwrap());
    let model = Arc::new(Model::load(file, &LoadOptions::default()).unwrap());
    let runner = Runner::new(model, 2, 16 + slots, 128);
    let stepper = LocalStepper::new(runner, slots, 128, KvType::F32);
    SchedBackend::start(
        wrap(stepper),
        tok,
        None,
        "synth".into(),
        true,
        SchedulerOptions {
            queue,
            prefill_chunk: 16,
            ctx: 128,
            resume_retries,
        },
    )
    .unwrap()
}

fn greedy() -> Sampling {
    Sampling {
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        seed: Some(1),
    }
}

fn submit(
    b: &SchedBackend,
    prompt: Vec<u32>,
    max_tokens: usize,
) -> tokio::sync::mpsc::UnboundedReceiver<GenEvent> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    b.submit(GenRequest {
        prompt,
        max_tokens,
        sampling: greedy(),
        stop: Vec::new(),
        logprobs: Some(2),
        events: tx,
        cancel: Arc::new(AtomicBool::new(false)),
        constraint: None,
    })
    .unwrap();
    rx
}

/// Token ids and the finish of one request.
fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<GenEvent>) -> (Vec<u32>, Finish, usize) {
    let mut ids = Vec::new();
    loop {
        match rx.blocking_recv() {
            Some(GenEvent::Token { id, logprob, .. }) => {
                let lp = logprob.unwrap();
                assert!(lp.logprob <= 0.0 && lp.top.len() == 2);
                assert!(
                    (lp.top[0].logprob - lp.logprob).abs() < 1e-6,
                    "greedy takes the best"
                );
                ids.push(id)
            }
            Some(GenEvent::Done {
                finish,
                cached_tokens,
                ..
            }) => return (ids, finish, cached_tokens),
            Some(GenEvent::Error { message, .. }) => panic!("{message}"),
            None => panic!("events ended without Done"),
        }
    }
}

fn prompts() -> Vec<Vec<u32>> {
    (0..6)
        .map(|k| {
            (0..(3 + 7 * k))
                .map(|i| (5 + (i * 31 + k * 17) % 400) as u32)
                .collect()
        })
        .collect()
}

/// Requests decoded together (and prefilled in chunks between decodes) give exactly the
/// tokens each gives alone.
#[test]
fn batched_sequences_equal_each_alone() {
    for arch in [SynthArch::Llama, SynthArch::Gemma3] {
        let b = backend(arch, 4, 16);
        let alone: Vec<_> = prompts()
            .into_iter()
            .map(|p| collect(submit(&b, p, 20)).0)
            .collect();
        let rxs: Vec<_> = prompts().into_iter().map(|p| submit(&b, p, 20)).collect();
        let together: Vec<_> = rxs.into_iter().map(|r| collect(r).0).collect();
        assert_eq!(together, alone, "{arch:?}");
        assert!(alone.iter().all(|t| t.len() == 20));
        let m = b.metrics();
        assert_eq!(m.slots_busy, 0);
        assert_eq!(m.queue_depth, 0);
        assert_eq!(m.requests_total, 12);
        b.shutdown();
    }
}

#[test]
fn a_conversation_that_comes_back_reuses_its_prefix() {
    let b = backend(SynthArch::Llama, 2, 4);
    let p: Vec<u32> = (0..20).map(|i| 10 + i).collect();
    let (first, _, cached0) = collect(submit(&b, p.clone(), 5));
    assert_eq!(cached0, 0);
    let mut longer = p.clone();
    longer.extend(&first);
    longer.extend([7, 8, 9]);
    let (_, _, cached) = collect(submit(&b, longer, 5));
    assert_eq!(
        cached,
        p.len() + first.len() - 1,
        "the cached prefix is reused"
    );
    b.shutdown();
}

#[test]
fn full_queue_and_cancel_and_shutdown() {
    let b = backend(SynthArch::Llama, 1, 1);
    let long: Vec<u32> = (0..10).map(|i| 20 + i).collect();
    let r1 = submit(&b, long.clone(), 100);
    let r2 = submit(&b, long.clone(), 100);
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let third = b.submit(GenRequest {
        prompt: long.clone(),
        max_tokens: 4,
        sampling: greedy(),
        stop: Vec::new(),
        logprobs: None,
        events: tx,
        cancel: Arc::new(AtomicBool::new(false)),
        constraint: None,
    });
    assert!(matches!(third, Err(SubmitError::QueueFull { .. })));
    // The client of the first goes away: its slot frees and the second runs.
    drop(r1);
    let (ids, finish, _) = collect(r2);
    assert_eq!((ids.len(), finish), (100, Finish::Length));
    let r3 = submit(&b, long, 1000);
    b.shutdown();
    let mut rx = r3;
    let mut done = None;
    while let Some(e) = rx.blocking_recv() {
        if let GenEvent::Done { finish, .. } = e {
            done = Some(finish);
        }
    }
    assert!(matches!(
        done,
        Some(Finish::Cancelled) | Some(Finish::Length)
    ));
    assert!(matches!(
        b.submit(GenRequest {
            prompt: vec![1, 2],
            max_tokens: 1,
            sampling: greedy(),
            stop: Vec::new(),
            logprobs: None,
            events: tokio::sync::mpsc::unbounded_channel().0,
            cancel: Arc::new(AtomicBool::new(false)),
            constraint: None,
        }),
        Err(SubmitError::ShuttingDown)
    ));
}

/// A stand-in engine: every step's feeds, as (slot, tokens), go to the test; a gated one
/// waits for the test's go-ahead before finishing each step; steps `fail` picks fail.
struct Scripted {
    slots: usize,
    vocab: usize,
    token: u32,
    lens: Vec<usize>,
    log: std::sync::mpsc::Sender<Vec<(usize, usize)>>,
    gate: Option<Receiver<()>>,
    fail: fn(usize) -> bool,
    steps: usize,
    retry: Option<u64>,
}

impl Stepper for Scripted {
    fn step(&mut self, feeds: &[Feed], logits: &mut Vec<f32>) -> Result<()> {
        self.steps += 1;
        let fed = feeds.iter().map(|f| (f.slot, f.tokens.len())).collect();
        let _ = self.log.send(fed);
        if let Some(g) = &self.gate {
            let _ = g.recv();
        }
        if (self.fail)(self.steps) {
            anyhow::bail!("node 'n2' (10.0.0.2:7701) stopped answering");
        }
        logits.clear();
        for f in feeds {
            self.lens[f.slot] += f.tokens.len();
            if f.want_logits {
                let mut row = vec![0.0; self.vocab];
                row[self.token as usize] = 1.0;
                logits.extend_from_slice(&row);
            }
        }
        Ok(())
    }

    fn len(&self, slot: usize) -> usize {
        self.lens[slot]
    }

    fn truncate(&mut self, slot: usize, len: usize) -> bool {
        if len > self.lens[slot] {
            return false;
        }
        self.lens[slot] = len;
        true
    }

    fn vocab(&self) -> usize {
        self.vocab
    }

    fn slots(&self) -> usize {
        self.slots
    }

    fn max_batch(&self) -> usize {
        16 + self.slots
    }

    fn retry_after_s(&self) -> Option<u64> {
        self.retry
    }
}

/// The backend, the feeds of every step, and the go-ahead sender.
type ScriptedRun = (
    Arc<SchedBackend>,
    Receiver<Vec<(usize, usize)>>,
    std::sync::mpsc::Sender<()>,
);

/// A scheduler over `Scripted` (2 slots, chunks of 16); `gated`: each step waits for the
/// go-ahead.
fn scripted(
    gated: bool,
    fail: fn(usize) -> bool,
    retry: Option<u64>,
    resume_retries: usize,
) -> ScriptedRun {
    let bytes = synth_model(&SynthSpec::new(
        SynthArch::Llama,
        ringllm_kernels::GgmlType::Q8_0,
        7,
    ))
    .unwrap();
    let file = Arc::new(GgufFile::from_bytes(bytes).unwrap());
    let spec = TokenizerSpec::from_gguf(file.metadata()).unwrap();
    let tok = Arc::new(Tokenizer::new(&spec).unwrap());
    let eog = tok.eog_ids();
    let token = (3..).find(|t| !eog.contains(t)).unwrap();
    let (log, steps) = std::sync::mpsc::channel();
    let (go, gate) = std::sync::mpsc::channel();
    let stepper = Scripted {
        slots: 2,
        vocab: tok.vocab_size(),
        token,
        lens: vec![0; 2],
        log,
        gate: gated.then_some(gate),
        fail,
        steps: 0,
        retry,
    };
    let b = SchedBackend::start(
        Box::new(stepper),
        tok,
        None,
        "scripted".into(),
        false,
        SchedulerOptions {
            queue: 4,
            prefill_chunk: 16,
            ctx: 512,
            resume_retries,
        },
    )
    .unwrap();
    (b, steps, go)
}

fn never(_: usize) -> bool {
    false
}

fn run(n: usize, first: u32) -> Vec<u32> {
    (first..first + n as u32).collect()
}

fn pc(slot: usize, pending: usize, last_fed: Option<u64>, admitted: u64) -> PrefillCand {
    PrefillCand {
        slot,
        pending,
        last_fed,
        admitted,
    }
}

#[test]
fn the_prefill_planner_takes_short_prompts_whole_and_never_skips_one_twice() {
    // A long prompt under way (fed in step 4) and a short one just admitted: step 5 is the
    // short one alone; the long one does not wait a second step.
    let long = pc(0, 500, Some(4), 1);
    let short = pc(1, 3, None, 2);
    assert_eq!(plan_prefill(&[long, short], 16, 8, 5), vec![(1, 3)]);
    let long = pc(0, 500, Some(4), 1);
    let another = pc(2, 3, None, 3);
    assert_eq!(plan_prefill(&[long, another], 16, 8, 6), vec![(0, 16)]);
    // Short prompts that fit ride together; a partial chunk only comes first.
    let cands = [pc(0, 5, None, 1), pc(1, 40, None, 2), pc(2, 6, None, 3)];
    assert_eq!(plan_prefill(&cands, 16, 8, 1), vec![(0, 5), (2, 6)]);
    assert_eq!(plan_prefill(&cands[1..2], 16, 8, 1), vec![(1, 16)]);
    // Two long prompts alternate.
    let (a, b) = (pc(0, 100, Some(1), 1), pc(1, 100, Some(2), 2));
    assert_eq!(plan_prefill(&[a, b], 16, 8, 3), vec![(0, 16)]);
    let (a, b) = (pc(0, 84, Some(3), 1), pc(1, 100, Some(2), 2));
    assert_eq!(plan_prefill(&[a, b], 16, 8, 4), vec![(1, 16)]);
    // Room for one sequence: one prompt.
    assert_eq!(plan_prefill(&cands, 16, 1, 1), vec![(0, 5)]);
    assert!(plan_prefill(&cands, 0, 8, 1).is_empty());
}

#[test]
fn a_short_prompt_is_fed_in_the_step_after_it_arrives_while_a_long_one_prefills() {
    let (b, steps, go) = scripted(true, never, None, 0);
    let long = submit(&b, run(100, 10), 1);
    let first = steps.recv().unwrap();
    assert_eq!(first.len(), 1);
    let (long_slot, n) = first[0];
    assert_eq!(n, 16, "the long prompt's first chunk");
    // Arrives while that chunk runs.
    let short = submit(&b, run(3, 200), 1);
    go.send(()).unwrap();
    let second = steps.recv().unwrap();
    assert_eq!(second.len(), 1, "{second:?}: the short prompt alone");
    assert_ne!(second[0].0, long_slot);
    assert_eq!(second[0].1, 3, "the short prompt, whole");
    go.send(()).unwrap();
    assert_eq!(
        steps.recv().unwrap(),
        vec![(long_slot, 16)],
        "the long one resumes"
    );
    drop(go);
    let (ids, finish, _) = collect(short);
    assert_eq!((ids.len(), finish), (1, Finish::Length));
    let (ids, _, _) = collect(long);
    assert_eq!(ids.len(), 1);
    // The long prompt was fed in chunks of 16, then its last 4 tokens.
    let rest: Vec<usize> = steps.try_iter().flatten().map(|(_, n)| n).collect();
    assert_eq!(rest, vec![16, 16, 16, 16, 4]);
    b.shutdown();
}

fn first_step_fails(step: usize) -> bool {
    step == 1
}

fn second_step_fails(step: usize) -> bool {
    step == 2
}

fn every_step_fails(_: usize) -> bool {
    true
}

/// The first `Error` of a request, or its tokens when it ends well.
fn outcome(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<GenEvent>,
) -> Result<usize, (String, Option<u64>)> {
    let mut n = 0;
    loop {
        match rx.blocking_recv() {
            Some(GenEvent::Token { .. }) => n += 1,
            Some(GenEvent::Done { .. }) => return Ok(n),
            Some(GenEvent::Error {
                message,
                retry_after_s,
            }) => return Err((message, retry_after_s)),
            None => panic!("events ended without Done"),
        }
    }
}

#[test]
fn a_failed_request_is_resumed_with_its_prompt_and_tokens_replayed() {
    // The ring fails once before the first token, then works: the request is served.
    let (b, steps, _go) = scripted(false, first_step_fails, Some(5), 1);
    assert_eq!(outcome(submit(&b, run(3, 10), 2)), Ok(2));
    let fed: Vec<_> = steps.try_iter().map(|s| s[0].1).collect();
    assert_eq!(
        fed,
        vec![3, 3, 1],
        "the prompt fed again whole after the failure"
    );
    assert_eq!(b.metrics().requests_total, 1);
    b.shutdown();
    // It keeps failing: the failure after the last retry is the answer, with a retry time.
    let (b, steps, _go) = scripted(false, every_step_fails, Some(5), 1);
    let (message, retry) = outcome(submit(&b, run(3, 10), 2)).unwrap_err();
    assert!(message.contains("'n2'"), "{message}");
    assert!(message.contains("resumed 1 time"), "{message}");
    assert_eq!(retry, Some(5));
    assert_eq!(steps.try_iter().count(), 2, "one retry");
    assert_eq!(b.metrics().requests_failed, 1);
    assert_eq!(b.metrics().slots_busy, 0);
    b.shutdown();
    // A failure after the first token: the prompt (3) and that token are fed again in one
    // prefill, then decoding goes on; every token is sent once.
    let (b, steps, _go) = scripted(false, second_step_fails, Some(5), 1);
    let mut rx = submit(&b, run(3, 10), 4);
    let mut tokens = 0;
    let resume = loop {
        match rx.blocking_recv() {
            Some(GenEvent::Token { .. }) => tokens += 1,
            Some(GenEvent::Done { resume, .. }) => break resume,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(tokens, 4);
    assert_eq!(resume.resumed, 1);
    assert!(resume.resume_ms >= 0.0);
    let fed: Vec<_> = steps.try_iter().map(|s| s[0].1).collect();
    assert_eq!(fed, vec![3, 1, 4, 1, 1]);
    b.shutdown();
    // With no retries it fails.
    let (b, steps, _go) = scripted(false, second_step_fails, Some(5), 0);
    let (_, retry) = outcome(submit(&b, run(3, 10), 4)).unwrap_err();
    assert_eq!(retry, Some(5));
    assert_eq!(steps.try_iter().count(), 2);
    b.shutdown();
    // One machine: an engine failure is an error at once, with no retry time.
    let (b, steps, _go) = scripted(false, first_step_fails, None, 2);
    assert_eq!(outcome(submit(&b, run(3, 10), 2)).unwrap_err().1, None);
    assert_eq!(steps.try_iter().count(), 1);
    b.shutdown();
}

/// The real model behind a stepper whose steps in `fail_at` fail before running and lose
/// every slot's cache, as a ring losing a node does.
struct Failing {
    inner: LocalStepper,
    fail_at: &'static [usize],
    steps: usize,
}

impl Stepper for Failing {
    fn step(&mut self, feeds: &[Feed], logits: &mut Vec<f32>) -> Result<()> {
        self.steps += 1;
        if self.fail_at.contains(&self.steps) {
            for i in 0..self.inner.slots() {
                self.inner.truncate(i, 0);
            }
            anyhow::bail!("node 'n2' lost");
        }
        self.inner.step(feeds, logits)
    }
    fn len(&self, slot: usize) -> usize {
        self.inner.len(slot)
    }
    fn truncate(&mut self, slot: usize, len: usize) -> bool {
        self.inner.truncate(slot, len)
    }
    fn vocab(&self) -> usize {
        self.inner.vocab()
    }
    fn slots(&self) -> usize {
        self.inner.slots()
    }
    fn max_batch(&self) -> usize {
        self.inner.max_batch()
    }
    fn retry_after_s(&self) -> Option<u64> {
        Some(1)
    }
}

/// Ids and resume counts of requests with their sampling, run together.
fn ids_of(b: &SchedBackend, reqs: &[(Vec<u32>, Sampling)]) -> Vec<(Vec<u32>, u32)> {
    let rxs: Vec<_> = reqs
        .iter()
        .map(|(p, s)| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            b.submit(GenRequest {
                prompt: p.clone(),
                max_tokens: 24,
                sampling: s.clone(),
                stop: Vec::new(),
                logprobs: None,
                events: tx,
                cancel: Arc::new(AtomicBool::new(false)),
                constraint: None,
            })
            .unwrap();
            rx
        })
        .collect();
    rxs.into_iter()
        .map(|mut rx| {
            let mut ids = Vec::new();
            loop {
                match rx.blocking_recv() {
                    Some(GenEvent::Token { id, .. }) => ids.push(id),
                    Some(GenEvent::Done { resume, .. }) => return (ids, resume.resumed),
                    other => panic!("{other:?}"),
                }
            }
        })
        .collect()
}

/// Two failures mid-answer (greedy and seeded sampling in one batch): the resumed requests
/// give exactly the tokens of the uninterrupted run; the sampler's random state goes on.
#[test]
fn resumed_requests_equal_the_uninterrupted_run_greedy_and_seeded() {
    let seeded = Sampling {
        temperature: 0.9,
        seed: Some(42),
        ..greedy()
    };
    let reqs = [
        (prompts()[1].clone(), greedy()),
        (prompts()[2].clone(), seeded),
    ];
    let plain = backend(SynthArch::Llama, 2, 4);
    let want = ids_of(&plain, &reqs);
    plain.shutdown();
    assert!(
        want.iter().all(|(ids, r)| ids.len() >= 12 && *r == 0),
        "{want:?}"
    );
    let failing = backend_over(SynthArch::Llama, 2, 4, 2, |s| {
        Box::new(Failing {
            inner: s,
            fail_at: &[6, 11],
            steps: 0,
        })
    });
    let got = ids_of(&failing, &reqs);
    failing.shutdown();
    for ((g, resumed), (w, _)) in got.iter().zip(&want) {
        assert_eq!(g, w);
        assert_eq!(*resumed, 2);
    }
}
