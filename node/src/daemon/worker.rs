//! The compute thread of one assignment: it waits for the data links its stage needs, then
//! reads a batch of frames (up to the first without `FLAG_MORE`), runs the slice's layers on
//! it as one pass (and the head, on the last stage), and writes the results to its output
//! link, all on this thread with blocking links. Errors go to the coordinator as `Error`
//! messages; the thread ends when its session is dropped (`stop`, links closed) or its input
//! link ends.

use super::{error_frame, Outgoing, StageError};
use ringllm_model::{KvCache, KvType, Runner};
use ringllm_protocol::activations;
use ringllm_protocol::control::ErrorCode;
use ringllm_protocol::dial::BoxLink;
use ringllm_protocol::frame::{round_of, FLAG_ALL_TOKENS, FLAG_MORE};
use ringllm_protocol::{Dtype, FrameHeader, FrameKind, LinkCloser};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

/// How long a closed input link waits for the session to end before it is reported.
const CLOSE_GRACE: Duration = Duration::from_millis(500);

/// A data link handed to a session's compute thread.
pub(super) struct Attached {
    pub(super) link: BoxLink,
    /// Frames for this stage arrive on it.
    pub(super) input: bool,
    /// This stage's results leave on it.
    pub(super) output: bool,
    /// Who opened it (the coordinator or the previous node), for messages.
    pub(super) from: String,
}

/// A session's counters, updated by its compute thread and read for `GetStats`.
#[derive(Default)]
pub(super) struct SessionStats {
    pub(super) frames_in: AtomicU64,
    pub(super) frames_out: AtomicU64,
    pub(super) bytes_in: AtomicU64,
    pub(super) bytes_out: AtomicU64,
    pub(super) tokens: AtomicU64,
    pub(super) compute_us: AtomicU64,
    pub(super) busy_us: AtomicU64,
}

/// The compute thread of one assignment: reads its input link, runs its layers, writes its
/// output link, all on this thread.
pub(super) struct Worker {
    pub(super) name: String,
    /// The runner (its scratch and threads), set to the window of each batch's round.
    pub(super) runner: Runner,
    /// The stage's windows: one, or one per round of a multi-round ring.
    pub(super) windows: Vec<Arc<ringllm_model::Model>>,
    /// Per window, one cache per sequence slot, made on first use.
    pub(super) caches: Vec<Vec<Option<KvCache>>>,
    pub(super) kv_ctx: usize,
    pub(super) kv_type: KvType,
    pub(super) head: bool,
    /// How this stage's hidden-state output travels.
    pub(super) activations: Dtype,
    /// The coordinator's control connection, for `Error` reports.
    pub(super) coord: mpsc::Sender<Outgoing>,
    pub(super) stats: Arc<SessionStats>,
    /// The link to the next node, opened by the assignment (`None`: results go back to the
    /// coordinator on a link it opens).
    pub(super) next: Option<BoxLink>,
    /// Where results go, for messages.
    pub(super) next_name: String,
    /// Wait for an output link from the coordinator before serving.
    pub(super) output_to_coordinator: bool,
    /// Set when the session is dropped.
    pub(super) stop: Arc<AtomicBool>,
    /// Where each attached link's closer goes, so dropping the session unblocks this thread.
    pub(super) closers: Arc<Mutex<Vec<LinkCloser>>>,
    /// Sequences released by the coordinator, cleared before the next batch.
    pub(super) release: Arc<Mutex<Vec<u64>>>,
    /// Held through each step; shutdown takes it before closing the links.
    pub(super) step: Arc<Mutex<()>>,
}

/// The input link, and the output link when it is a different one.
struct Io {
    input: BoxLink,
    input_from: String,
    output: Option<BoxLink>,
}

impl Worker {
    /// Whether the session is stopped now or within `grace`.
    fn stopping_within(&self, grace: Duration) -> bool {
        let deadline = Instant::now() + grace;
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn report(&self, code: ErrorCode, seq: Option<u64>, msg: String) {
        warn!("{msg}");
        if let Some(f) = error_frame(code, seq, msg) {
            let _ = self.coord.blocking_send(f);
        }
    }

    /// Waits for the data links this stage needs.
    fn links(&mut self, attach: &std::sync::mpsc::Receiver<Attached>) -> Option<Io> {
        let mut input: Option<(BoxLink, String)> = None;
        let mut output = self.next.take();
        let mut same = false;
        let want_output = self.output_to_coordinator;
        loop {
            if input.is_some() && (same || output.is_some() || !want_output) {
                break;
            }
            if self.stop.load(Ordering::SeqCst) {
                return None;
            }
            let a = match attach.recv_timeout(Duration::from_millis(100)) {
                Ok(a) => a,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                Err(_) => return None,
            };
            if let Ok(c) = a.link.closer() {
                self.closers
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(c);
            }
            if self.stop.load(Ordering::SeqCst) {
                return None;
            }
            match (a.input, a.output) {
                (true, true) => {
                    same = true;
                    input = Some((a.link, a.from));
                }
                (true, false) => input = Some((a.link, a.from)),
                (false, true) => output = Some(a.link),
                (false, false) => {}
            }
        }
        let (input, input_from) = input?;
        Some(Io {
            input,
            input_from,
            output: if same { None } else { output },
        })
    }

    pub(super) fn run(mut self, attach: std::sync::mpsc::Receiver<Attached>) {
        let Some(mut io) = self.links(&attach) else {
            return;
        };
        debug!("node '{}': data links ready", self.name);
        let mut x: Vec<f32> = Vec::new();
        let step = Arc::clone(&self.step);
        let mut not_started = 0u64;
        'serve: loop {
            // A batch: frames up to the first without FLAG_MORE.
            let mut batch: Vec<(FrameHeader, Vec<u8>)> = Vec::new();
            // Held from the batch's first frame to its last result sent.
            let mut in_step = None;
            loop {
                let mut buf = Vec::new();
                let h = match io.input.recv(&mut buf) {
                    Ok(h) => h,
                    Err(e) => {
                        // At the end of a session the upstream node may close its link a
                        // moment before this node hears the coordinator's goodbye: not a fault
                        // worth a warning.
                        let ending = self.stop.load(Ordering::SeqCst)
                            || e.is_closed() && self.stopping_within(CLOSE_GRACE);
                        if !ending {
                            let why = if e.is_closed() {
                                "closed".to_string()
                            } else {
                                e.to_string()
                            };
                            self.report(
                                ErrorCode::NextHopUnreachable,
                                None,
                                format!(
                                    "node '{}': input link from '{}' {why}",
                                    self.name, io.input_from
                                ),
                            );
                        }
                        break 'serve;
                    }
                };
                if h.kind == FrameKind::Control {
                    continue; // the control connection carries control
                }
                self.stats.frames_in.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .bytes_in
                    .fetch_add(h.len as u64 + 40, Ordering::Relaxed);
                if in_step.is_none() {
                    in_step = Some(step.lock().unwrap_or_else(|e| e.into_inner()));
                    // Shutdown came between this frame and the step: it is not started (the
                    // links close once this thread lets the step go).
                    if self.stop.load(Ordering::SeqCst) {
                        debug!(
                            "node '{}': stopping; a step that arrived is not run",
                            self.name
                        );
                        not_started += 1;
                        break 'serve;
                    }
                }
                let more = h.flags & FLAG_MORE != 0;
                batch.push((h, buf));
                if !more || batch.len() >= self.caches[0].len() {
                    break;
                }
            }
            let t0 = Instant::now();
            let released: Vec<u64> =
                std::mem::take(&mut *self.release.lock().unwrap_or_else(|e| e.into_inner()));
            for seq in released {
                for w in self.caches.iter_mut() {
                    if let Some(Some(c)) = w.get_mut(seq as usize) {
                        c.truncate(0);
                    }
                }
            }
            match self.process(&batch, &mut x) {
                Ok(outs) => {
                    let out = match io.output.as_mut() {
                        Some(o) => o,
                        None => &mut io.input,
                    };
                    for (oh, payload) in &outs {
                        if let Err(e) = out.send(oh, payload) {
                            if !self.stop.load(Ordering::SeqCst) {
                                self.report(
                                    ErrorCode::NextHopUnreachable,
                                    Some(oh.seq),
                                    format!(
                                        "node '{}' cannot send to {}: {e}",
                                        self.name, self.next_name
                                    ),
                                );
                            }
                            break 'serve;
                        }
                        self.stats.frames_out.fetch_add(1, Ordering::Relaxed);
                        self.stats
                            .bytes_out
                            .fetch_add(payload.len() as u64 + 40, Ordering::Relaxed);
                    }
                    self.stats
                        .busy_us
                        .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                    drop(in_step);
                }
                Err(e) => {
                    let seq = batch.first().map(|b| b.0.seq);
                    let msg = format!("node '{}': {e}", self.name);
                    self.report(ErrorCode::Compute, seq, msg)
                }
            }
        }
        info!(
            "node '{}': compute ends: {} frames in, {} frames out, {not_started} not started \
             (arrived as the node stopped)",
            self.name,
            self.stats.frames_in.load(Ordering::Relaxed),
            self.stats.frames_out.load(Ordering::Relaxed)
        );
        // What the transports saw: retransmissions, refused seals, fast paths taken.
        let links = [Some(&io.input), io.output.as_ref(), self.next.as_ref()];
        for l in links.into_iter().flatten() {
            let c = l.counters();
            let (fo, bo, fi, bi) = c.snapshot();
            let events: Vec<String> = c.events().iter().map(|(n, v)| format!("{n}={v}")).collect();
            info!(
                "node '{}': {} link: {fo} frames / {bo} bytes out, {fi} frames / {bi} bytes in {}",
                self.name,
                l.transport(),
                events.join(" ")
            );
        }
        debug!("compute thread of node '{}' ends", self.name);
    }
    /// Runs a batch of frames (one per sequence) through this stage's layers as one pass.
    fn process(
        &mut self,
        batch: &[(FrameHeader, Vec<u8>)],
        x: &mut Vec<f32>,
    ) -> Result<Vec<Outgoing>, StageError> {
        let round = batch.first().map_or(0, |(h, _)| round_of(h.flags));
        let windows = self.windows.len();
        if round >= windows || batch.iter().any(|(h, _)| round_of(h.flags) != round) {
            return Err(StageError::BadRound { round, windows });
        }
        let last_window = round + 1 == windows;
        if !Arc::ptr_eq(&self.runner.model, &self.windows[round]) {
            self.runner.model = Arc::clone(&self.windows[round]);
        }
        let runner = &mut self.runner;
        let caches = &mut self.caches[round];
        let d = runner.model.hp.d_model;
        let n: usize = batch.iter().map(|(h, _)| h.n_tokens as usize).sum();
        if n > runner.max_batch() {
            return Err(StageError::BatchTooLarge {
                n,
                max: runner.max_batch(),
            });
        }
        let mut seen = vec![false; caches.len()];
        for (h, _) in batch {
            let want = h.dtype.bytes_for(d);
            if h.kind != FrameKind::Hidden || want != Some(h.bytes_per_token()) {
                return Err(StageError::NotHidden {
                    kind: h.kind,
                    dtype: h.dtype,
                    bytes_per_token: h.bytes_per_token(),
                    want,
                    d,
                });
            }
            let slot = h.seq as usize;
            if slot >= caches.len() {
                return Err(StageError::SlotOutOfRange {
                    seq: h.seq,
                    slots: caches.len(),
                });
            }
            if std::mem::replace(&mut seen[slot], true) {
                return Err(StageError::DuplicateSequence { seq: h.seq });
            }
            let (ctx, ty) = (self.kv_ctx, self.kv_type);
            let cache = caches[slot].get_or_insert_with(|| runner.new_cache(ctx, ty));
            let pos = h.pos as usize;
            if pos < cache.len {
                if !cache.can_truncate_to(pos) {
                    return Err(StageError::CannotRewind { seq: h.seq, pos });
                }
                cache.truncate(pos);
            } else if pos > cache.len {
                return Err(StageError::PositionGap {
                    seq: h.seq,
                    pos,
                    held: cache.len,
                });
            }
        }
        x.resize(n * d, 0.0);
        let mut row = 0;
        for (h, payload) in batch {
            let k = h.n_tokens as usize;
            activations::decode(h.dtype, payload, &mut x[row * d..(row + k) * d])?;
            row += k;
        }
        let t = Instant::now();
        {
            let mut taken: Vec<(usize, KvCache)> = Vec::with_capacity(batch.len());
            for (h, _) in batch {
                let slot = h.seq as usize;
                let c = caches[slot]
                    .take()
                    .ok_or(StageError::NoCache { seq: h.seq })?;
                taken.push((slot, c));
            }
            let mut parts: Vec<(&mut KvCache, usize)> = taken
                .iter_mut()
                .zip(batch)
                .map(|((_, c), (h, _))| (c, h.n_tokens as usize))
                .collect();
            let r = runner.layers_multi(&mut x[..n * d], &mut parts, None);
            drop(parts);
            for (slot, c) in taken {
                caches[slot] = Some(c);
            }
            r?;
        }
        let mut outs = Vec::with_capacity(batch.len());
        let mut row = 0;
        for (h, _) in batch {
            let k = h.n_tokens as usize;
            let xs = &mut x[row * d..(row + k) * d];
            row += k;
            let mut bytes = Vec::new();
            let (kind, dtype, n_out) = if self.head && last_window {
                let rows = if h.flags & FLAG_ALL_TOKENS != 0 {
                    0..k
                } else {
                    k - 1..k
                };
                let vocab = runner.model.hp.vocab;
                let xr = &mut xs[rows.start * d..rows.end * d];
                runner.final_norm(xr, rows.len())?;
                let mut logits = vec![0f32; rows.len() * vocab];
                runner.logits(xr, rows.len(), &mut logits)?;
                bytes.reserve(logits.len() * 2);
                for v in &logits {
                    bytes.extend_from_slice(&half::f16::from_f32(*v).to_le_bytes());
                }
                (FrameKind::Logits, Dtype::F16, rows.len())
            } else {
                activations::encode(self.activations, xs, &mut bytes)?;
                (FrameKind::Hidden, self.activations, k)
            };
            let oh = FrameHeader::new(kind, dtype, h.seq, h.pos, n_out as u32, h.flags, &bytes)?;
            outs.push((oh, bytes));
        }
        self.stats
            .compute_us
            .fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
        self.stats.tokens.fetch_add(n as u64, Ordering::Relaxed);
        Ok(outs)
    }
}
