//! Sending nodes the slices they lack, before their assignments.
//!
//! A node that has no copy of the model (by identity) is offered its slice (`SliceOffer`:
//! every piece with its hash); it answers with the pieces it lacks (`SliceNeed`: none when
//! its cache has the slice and every hash matches), and those go out as `Slice` frames on
//! its control connection, from a feeder thread per node (all nodes at once), behind any
//! control message. The node reports progress (`SliceProgress`) and, at the end, any piece
//! that did not match its hash, which is sent again (up to `MAX_ROUNDS` times).
//!
//! A node lost mid-way (or silent for `STALL`) ends the attempt with `TransferCut`: `up`
//! waits for the node and starts again, and the node, which kept what arrived, asks only
//! for the rest.

use super::{Event, Outgoing, Ring};
use crate::cluster::RingSpec;
use crate::progress::{self, Progress};
use anyhow::{anyhow, bail, Result};
use ringllm_model::gguf::GgufFile;
use ringllm_model::slice::SliceSource;
use ringllm_protocol::control::{Control, ModelIdentity, SliceNeed, SliceProgress};
use ringllm_protocol::frame::SLICE_PROBE;
use ringllm_protocol::{Dtype, FrameHeader, FrameKind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Bytes per `Slice` frame.
pub const CHUNK: usize = 1 << 20;
/// Frames queued per node ahead of its socket (the coordinator holds at most this many
/// chunks per node in memory).
pub const QUEUE: usize = 4;
/// A node that reports no progress for this long mid-transfer is taken for cut off.
pub const STALL: Duration = Duration::from_secs(10);
/// Times a piece may arrive corrupted before the transfer gives up.
pub const MAX_ROUNDS: usize = 3;
/// Bytes sent to measure a link's speed (`ringllm plan`).
const PROBE_BYTES: usize = 16 << 20;

/// A slice transfer ended early because its node was lost or went silent: worth waiting for
/// the node and trying again (it keeps what arrived).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TransferCut(pub String);

/// A node's slice: which node (index in the ring's nodes) and how it is laid out.
pub struct SliceJob {
    pub node: usize,
    pub source: Arc<SliceSource>,
}

/// What `plan` shows for a node that would be sent its slice.
#[derive(Clone, Debug)]
pub struct SlicePreview {
    pub node: String,
    pub layers: std::ops::Range<usize>,
    pub head: bool,
    /// Bytes of the slice file.
    pub size: u64,
    /// Bytes the node lacks.
    pub to_send: u64,
    /// Measured speed of the link to the node, bytes per second.
    pub link_bytes_per_s: f64,
}

/// What a transfer did, per node that needed anything.
#[derive(Clone, Debug)]
pub struct Sent {
    pub node: String,
    pub bytes: u64,
    pub pieces: usize,
    pub secs: f64,
    /// Pieces sent again after failing their hash.
    pub resent: usize,
}

fn frame(seq: u64, chunk: &[u8]) -> Result<Outgoing> {
    let h = FrameHeader::new(FrameKind::Slice, Dtype::Bytes, seq, 0, 0, 0, chunk)?;
    Ok((h, chunk.to_vec()))
}

/// Sends `pieces` of `job` down `data`, chunk by chunk, from a thread of its own (reading
/// the model's pages there, not on the runtime); stops early when `stop` is set or the
/// connection is gone.
fn spawn_feeder(
    file: Arc<GgufFile>,
    source: Arc<SliceSource>,
    pieces: Vec<u32>,
    data: mpsc::Sender<Outgoing>,
    stop: Arc<AtomicBool>,
) -> Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("slice-feeder".into())
        .spawn(move || {
            for i in pieces {
                let bytes = source.bytes(&file, i as usize);
                for chunk in bytes.chunks(CHUNK) {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let Ok(f) = frame(i as u64, chunk) else {
                        return;
                    };
                    if data.blocking_send(f).is_err() {
                        return;
                    }
                }
            }
        })
        .map_err(|e| anyhow!("cannot start a slice feeder thread: {e}"))
}

/// One slice transfer under way.
struct Active {
    /// Index into the jobs.
    job: usize,
    bar: Box<dyn Progress>,
    stop: Arc<AtomicBool>,
    feeder: Option<std::thread::JoinHandle<()>>,
    /// Bytes received in earlier rounds (progress restarts at 0 each round).
    base: u64,
    last: Instant,
    round: usize,
    started: Instant,
    pieces: usize,
    resent: usize,
}

fn bytes_of(source: &SliceSource, pieces: &[u32]) -> u64 {
    pieces
        .iter()
        .filter_map(|&i| source.pieces.get(i as usize))
        .map(|p| p.len)
        .sum()
}

impl Ring {
    /// The slices of the planned nodes that lack the model (by identity).
    pub fn slice_jobs(
        &self,
        spec: &RingSpec,
        identity: &ModelIdentity,
        file: &GgufFile,
    ) -> Result<Vec<SliceJob>> {
        let remote = spec
            .stages
            .iter()
            .zip(&self.plan.stages)
            .filter(|(s, _)| s.address.is_some())
            .map(|(_, p)| p);
        let mut jobs = Vec::new();
        for (i, p) in remote.enumerate() {
            if p.layers.is_empty() || self.nodes[i].caps.models.contains(identity) {
                continue;
            }
            let source = SliceSource::build(file, identity.clone(), p.layers.clone(), p.holds_head)
                .map_err(|e| anyhow!("laying out the slice for {}: {e}", self.who(i)))?;
            jobs.push(SliceJob {
                node: i,
                source: Arc::new(source),
            });
        }
        Ok(jobs)
    }

    /// Offers every job's node its slice and collects what each lacks.
    fn offer_slices(
        &mut self,
        jobs: &[SliceJob],
        file: &GgufFile,
        dry_run: bool,
        discard: bool,
    ) -> Result<Vec<SliceNeed>> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut size = 0u64;
        for j in jobs {
            let offer = j.source.offer(file, threads, dry_run, discard);
            size = size.max(offer.size);
            self.send_control(j.node, &Control::SliceOffer(offer))?;
        }
        // A node hashes what its cache holds of the slice before it answers.
        let deadline = Instant::now() + Duration::from_secs(60) + Duration::from_secs(size >> 26);
        let mut needs: Vec<Option<SliceNeed>> = vec![None; jobs.len()];
        while needs.iter().any(|n| n.is_none()) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let late: Vec<String> = jobs
                    .iter()
                    .zip(&needs)
                    .filter(|(_, n)| n.is_none())
                    .map(|(j, _)| self.who(j.node))
                    .collect();
                bail!(
                    "timed out waiting for {} to check their slice caches",
                    late.join(", ")
                );
            }
            let Some(ev) = self.poll_event(left)? else {
                continue;
            };
            match ev {
                Event::Control {
                    node,
                    msg: Control::SliceNeed(n),
                } => {
                    if let Some(k) = jobs
                        .iter()
                        .position(|j| j.node == node && j.source.key == n.key)
                    {
                        if let Some(&bad) = n
                            .pieces
                            .iter()
                            .find(|&&p| p as usize >= jobs[k].source.pieces.len())
                        {
                            bail!(
                                "{} asked for piece {bad}, which the slice lacks",
                                self.who(node)
                            );
                        }
                        needs[k] = Some(n);
                    }
                }
                Event::Control {
                    node,
                    msg: Control::Error(e),
                } => bail!("{}: {}", self.who(node), e.message),
                Event::Control { .. } => {}
                Event::Frame { node, h } => {
                    bail!("{}: unexpected {:?} frame", self.who(node), h.kind)
                }
                Event::Lost { node, why } => {
                    return Err(TransferCut(format!("{} {why}", self.who(node))).into())
                }
            }
        }
        Ok(needs.into_iter().flatten().collect())
    }

    /// Sends every node that lacks the model its slice (or the pieces of it its cache lacks),
    /// all at once, showing progress; returns what was sent.
    pub fn send_slices(
        &mut self,
        spec: &RingSpec,
        identity: &ModelIdentity,
        file: &Arc<GgufFile>,
    ) -> Result<Vec<Sent>> {
        let jobs = self.slice_jobs(spec, identity, file)?;
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let needs = self.offer_slices(&jobs, file, false, spec.discard_cached_slices)?;
        let mut active = self.start_transfers(&jobs, &needs, file)?;
        let result = self.follow_transfers(&jobs, &mut active, file);
        for a in &mut active {
            a.stop.store(true, Ordering::Relaxed);
            a.bar.finish();
            if let Some(f) = a.feeder.take() {
                // A feeder blocked on a full queue ends when the connection goes (on error) or
                // as soon as its queue drains (it has nothing left to send otherwise).
                if result.is_ok() {
                    let _ = f.join();
                }
            }
        }
        result
    }

    /// Starts a feeder and a progress bar for every job whose node lacks anything, saying
    /// which nodes have their slice cached or resume a transfer.
    fn start_transfers(
        &self,
        jobs: &[SliceJob],
        needs: &[SliceNeed],
        file: &Arc<GgufFile>,
    ) -> Result<Vec<Active>> {
        let mut active: Vec<Active> = Vec::new();
        for (k, (job, need)) in jobs.iter().zip(needs).enumerate() {
            let name = self.nodes[job.node].name.clone();
            let s = &job.source;
            let total = bytes_of(s, &need.pieces);
            if need.pieces.is_empty() {
                notice!(
                    "  {name}: slice of layers {}-{} cached ({:.1} MiB, every piece checked)",
                    s.key.layer_start,
                    s.key.layer_end.saturating_sub(1),
                    s.size as f64 / 1048576.0
                );
                continue;
            }
            if need.have_bytes > 0 {
                notice!(
                    "  {name}: resuming: {:.1} MiB of the slice cached and checked, {:.1} MiB \
                     ({} piece(s)) to send",
                    need.have_bytes as f64 / 1048576.0,
                    total as f64 / 1048576.0,
                    need.pieces.len()
                );
            }
            let bar = progress::task(progress::Kind::Bytes);
            bar.start(&name, Some(total));
            let stop = Arc::new(AtomicBool::new(false));
            let data = self.nodes[job.node].data.clone();
            let feeder = spawn_feeder(
                Arc::clone(file),
                Arc::clone(s),
                need.pieces.clone(),
                data,
                Arc::clone(&stop),
            )?;
            active.push(Active {
                job: k,
                bar,
                stop,
                feeder: Some(feeder),
                base: 0,
                last: Instant::now(),
                round: 1,
                started: Instant::now(),
                pieces: need.pieces.len(),
                resent: 0,
            });
        }
        Ok(active)
    }

    /// Follows the nodes' progress reports until every transfer in `active` is done; fails
    /// on a node lost or silent for `STALL` (with `TransferCut`), or on a node's error.
    fn follow_transfers(
        &mut self,
        jobs: &[SliceJob],
        active: &mut [Active],
        file: &Arc<GgufFile>,
    ) -> Result<Vec<Sent>> {
        let mut sent = Vec::new();
        let mut done = vec![false; active.len()];
        while done.iter().any(|d| !d) {
            let now = Instant::now();
            for (a, d) in active.iter().zip(&done) {
                if !d && now - a.last > STALL {
                    return Err(TransferCut(format!(
                        "{}: slice transfer stalled (no progress for {} s; link down?)",
                        self.who(jobs[a.job].node),
                        STALL.as_secs()
                    ))
                    .into());
                }
            }
            let Some(ev) = self.poll_event(Duration::from_millis(250))? else {
                continue;
            };
            let (node, msg) = match ev {
                Event::Control { node, msg } => (node, msg),
                Event::Frame { node, h } => {
                    bail!("{}: unexpected {:?} frame", self.who(node), h.kind)
                }
                Event::Lost { node, why } => {
                    return Err(TransferCut(format!(
                        "{} {why} during its slice transfer",
                        self.who(node)
                    ))
                    .into())
                }
            };
            let Some(ai) = active.iter().position(|a| jobs[a.job].node == node) else {
                if let Control::Error(e) = msg {
                    bail!("{}: {}", self.who(node), e.message);
                }
                continue;
            };
            let a = &mut active[ai];
            let job = &jobs[a.job];
            match msg {
                Control::SliceProgress(p) if p.key == job.source.key => {
                    if let Some(s) = self.on_progress(a, job, &p, file)? {
                        done[ai] = true;
                        sent.push(s);
                    }
                }
                Control::Error(e) => bail!("{}: {}", self.who(node), e.message),
                _ => {}
            }
        }
        Ok(sent)
    }

    /// Takes a progress report on transfer `a`: at its end, what was sent, or the corrupted
    /// pieces sent again (`None` until the transfer is done).
    fn on_progress(
        &self,
        a: &mut Active,
        job: &SliceJob,
        p: &SliceProgress,
        file: &Arc<GgufFile>,
    ) -> Result<Option<Sent>> {
        let node = job.node;
        a.last = Instant::now();
        a.bar.set_position(a.base + p.received);
        if !p.done {
            return Ok(None);
        }
        if p.bad.is_empty() {
            a.bar.finish();
            let secs = a.started.elapsed().as_secs_f64();
            let bytes = a.base + p.received;
            notice!(
                "  {}: sent layers {}-{} ({:.1} MiB in {secs:.1} s, {:.1} MB/s)",
                self.nodes[node].name,
                job.source.key.layer_start,
                job.source.key.layer_end.saturating_sub(1),
                bytes as f64 / 1048576.0,
                bytes as f64 / secs.max(1e-9) / 1e6
            );
            return Ok(Some(Sent {
                node: self.nodes[node].name.clone(),
                bytes,
                pieces: a.pieces,
                secs,
                resent: a.resent,
            }));
        }
        if a.round >= MAX_ROUNDS {
            let names: Vec<&str> = p
                .bad
                .iter()
                .filter_map(|&i| job.source.pieces.get(i as usize))
                .map(|p| p.name.as_str())
                .collect();
            bail!(
                "{}: {} arrived corrupted {MAX_ROUNDS} times (a disk or memory \
                 fault on the node?)",
                self.who(node),
                names.join(", ")
            );
        }
        if let Some(&bad) = p
            .bad
            .iter()
            .find(|&&i| i as usize >= job.source.pieces.len())
        {
            bail!(
                "{} reported piece {bad}, which the slice lacks",
                self.who(node)
            );
        }
        a.round += 1;
        a.resent += p.bad.len();
        a.base += p.received;
        let more = bytes_of(&job.source, &p.bad);
        a.bar.inc_length(more);
        notice!(warn: "  {}: {} piece(s) failed their hash on arrival; sending them again",
            self.nodes[node].name,
            p.bad.len()
        );
        if let Some(f) = a.feeder.take() {
            let _ = f.join();
        }
        a.feeder = Some(spawn_feeder(
            Arc::clone(file),
            Arc::clone(&job.source),
            p.bad.clone(),
            self.nodes[node].data.clone(),
            Arc::clone(&a.stop),
        )?);
        Ok(None)
    }

    /// What `send_slices` would send (nothing is written on the nodes), with each link's
    /// speed measured.
    pub fn preview_slices(
        &mut self,
        spec: &RingSpec,
        identity: &ModelIdentity,
        file: &GgufFile,
    ) -> Result<Vec<SlicePreview>> {
        let jobs = self.slice_jobs(spec, identity, file)?;
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let needs = self.offer_slices(&jobs, file, true, false)?;
        let mut out = Vec::new();
        for (j, n) in jobs.iter().zip(needs) {
            let rate = if n.pieces.is_empty() {
                0.0
            } else {
                self.probe_link(j.node)?
            };
            out.push(SlicePreview {
                node: self.nodes[j.node].name.clone(),
                layers: j.source.key.layer_start as usize..j.source.key.layer_end as usize,
                head: j.source.key.head,
                size: j.source.size,
                to_send: bytes_of(&j.source, &n.pieces),
                link_bytes_per_s: rate,
            });
        }
        Ok(out)
    }

    /// Measures the speed of the connection to node `i`: `PROBE_BYTES` of probe frames, then
    /// a heartbeat behind them; the time to its answer, less a round trip.
    fn probe_link(&mut self, i: usize) -> Result<f64> {
        let chunk = vec![0u8; CHUNK];
        let data = self.nodes[i].data.clone();
        let t = Instant::now();
        let nonce = 0x9e0b_e000 + i as u64;
        let rt_handle = self.rt.handle().clone();
        let frames = (0..PROBE_BYTES / CHUNK)
            .map(|_| frame(SLICE_PROBE, &chunk))
            .chain(std::iter::once(
                Control::Heartbeat {
                    nonce,
                    reply: false,
                }
                .to_frame()
                .map_err(Into::into),
            ))
            .collect::<Result<Vec<_>>>()?;
        rt_handle
            .block_on(async {
                for f in frames {
                    data.send(f).await?;
                }
                Ok::<_, mpsc::error::SendError<Outgoing>>(())
            })
            .map_err(|_| anyhow!("{}: the link is gone", self.who(i)))?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("{}: no answer to the link probe in 60 s", self.who(i));
            }
            match self.poll_event(left)? {
                Some(Event::Control {
                    node,
                    msg:
                        Control::Heartbeat {
                            nonce: n,
                            reply: true,
                        },
                }) if node == i && n == nonce => break,
                Some(Event::Lost { node, why }) => {
                    return Err(self.fault(node, format!("{} {why}", self.who(node))))
                }
                _ => {}
            }
        }
        let secs = (t.elapsed().as_secs_f64() - self.nodes[i].rtt_s).max(1e-6);
        Ok(PROBE_BYTES as f64 / secs)
    }
}
