//! Layers streamed from disk: when a slice is larger than its node's memory budget, the layers
//! that do not fit stay on disk (tier B) and are read each token, ahead of the compute, into a
//! bounded pool of layer buffers; the rest (tier A) is resident.
//!
//! # How
//!
//! One I/O thread reads the streamed layers in the order the forward pass runs them, cycling
//! from the last back to the first (the next token's), into `depth + 1` buffers: `depth` layers
//! ahead while one is computed. Each layer is one contiguous span of the file (the GGUF
//! writer puts a block's tensors together), read with `O_DIRECT` in large requests, so the
//! page cache neither grows nor hides the disk: the read rate is the disk's, and the memory
//! used is the pool's, whatever the cgroup's page-cache accounting. Where `O_DIRECT` is refused
//! (tmpfs, some overlay filesystems) the file is read through the page cache and each span is
//! dropped from it after the read (`POSIX_FADV_DONTNEED`).
//!
//! The compute side asks for a layer with [`Streamer::acquire`], which blocks until its buffer
//! is filled (that wait is the stall time), and gives the buffer back by dropping the guard.
//! Layers the caller will not run this pass ([`Streamer::skip`]) are not read; a buffer read
//! for a layer that was passed over is recycled. A request out of the expected order restarts
//! the read-ahead at that layer: slower, never wrong.
//!
//! A streamed layer's weights are read from the buffer exactly as from the mapped file, so the
//! output is bit-identical to the resident run.

use crate::gguf::GgufFile;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

mod decide;
pub mod experts;
mod timing;
pub use decide::{decide, decide_experts, Decision, ExpertDecision, StreamMode, StreamSettings};
pub use experts::{ExpertGuard, ExpertLayout, ExpertStats, ExpertStore};
pub use timing::{
    choose_depth, node_s_per_token, plan_tiers, predict, steady_state, ReadAhead, SimLayer,
    TierPlan,
};

/// Alignment of `O_DIRECT` offsets, lengths and buffers (the largest logical block size in
/// use; a multiple of every smaller one).
const ALIGN: usize = 4096;
/// Bytes per read request: large requests keep several device requests in flight.
const READ_CHUNK: usize = 32 << 20;
/// The most layers read ahead.
pub const MAX_DEPTH: usize = 16;

/// The bytes of one layer in the file: every `blk.N.*` tensor lies inside `range`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerSpan {
    pub layer: usize,
    pub range: Range<usize>,
}

/// The span of layer `il`'s tensors in `file` (`None` if it has none).
pub fn layer_span(file: &GgufFile, il: usize) -> Option<LayerSpan> {
    let prefix = format!("blk.{il}.");
    let mut lo = usize::MAX;
    let mut hi = 0usize;
    for t in file
        .tensors()
        .iter()
        .filter(|t| t.name.starts_with(&prefix))
    {
        let start = t.offset as usize;
        lo = lo.min(start);
        hi = hi.max(start + t.size as usize);
    }
    (hi > lo).then_some(LayerSpan {
        layer: il,
        range: lo..hi,
    })
}

/// Bytes of the output head a stage holding it keeps resident: `output.weight`, or the tied
/// embedding.
pub fn head_bytes(file: &GgufFile) -> u64 {
    ["output.weight", "token_embd.weight"]
        .iter()
        .find_map(|n| file.tensor(n))
        .map_or(0, |t| t.size)
}

/// Counters of a streamer since it started (tier B: what was read from disk).
#[derive(Debug, Default)]
pub struct StreamCounters {
    /// Bytes read from the file (aligned spans).
    pub bytes_read: AtomicU64,
    /// Layers read.
    pub layers_read: AtomicU64,
    /// Time spent reading, microseconds (the I/O thread's).
    pub read_us: AtomicU64,
    /// Time the compute waited for a layer still being read, microseconds.
    pub stall_us: AtomicU64,
    /// Layers passed over without reading them ([`Streamer::skip`]).
    pub layers_skipped: AtomicU64,
    /// Bytes those layers would have read.
    pub bytes_skipped: AtomicU64,
    /// Read-aheads restarted by a request out of order.
    pub restarts: AtomicU64,
}

/// A snapshot of [`StreamCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StreamStats {
    pub bytes_read: u64,
    pub layers_read: u64,
    pub read_s: f64,
    pub stall_s: f64,
    pub layers_skipped: u64,
    pub bytes_skipped: u64,
    pub restarts: u64,
}

impl StreamCounters {
    pub fn snapshot(&self) -> StreamStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StreamStats {
            bytes_read: g(&self.bytes_read),
            layers_read: g(&self.layers_read),
            read_s: g(&self.read_us) as f64 * 1e-6,
            stall_s: g(&self.stall_us) as f64 * 1e-6,
            layers_skipped: g(&self.layers_skipped),
            bytes_skipped: g(&self.bytes_skipped),
            restarts: g(&self.restarts),
        }
    }
}

/// A heap buffer aligned for `O_DIRECT`.
struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain owned memory; access is synchronised by the streamer's lock
// (one writer while Loading, readers only while InUse).
unsafe impl Send for AlignedBuf {}
// SAFETY: as for Send: shared access follows the slot states.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    fn new(len: usize) -> std::io::Result<AlignedBuf> {
        let len = len.max(ALIGN).next_multiple_of(ALIGN);
        let layout = std::alloc::Layout::from_size_align(len, ALIGN)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(p).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::OutOfMemory,
                format!("cannot allocate a layer buffer of {len} bytes"),
            )
        })?;
        Ok(AlignedBuf { ptr, len })
    }

    /// SAFETY: the caller has the slot in a state where nobody writes it.
    unsafe fn slice(&self, len: usize) -> &[u8] {
        // SAFETY: `ptr` holds `self.len` initialised (zeroed at allocation) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), len.min(self.len)) }
    }

    /// SAFETY: the caller has the slot in a state where nobody else reads or writes it.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut(&self, len: usize) -> &mut [u8] {
        // SAFETY: as in `slice`; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), len.min(self.len)) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe {
            std::alloc::dealloc(
                self.ptr.as_ptr(),
                std::alloc::Layout::from_size_align_unchecked(self.len, ALIGN),
            )
        }
    }
}

/// Where the streamed bytes come from.
enum Source {
    /// The file opened with `O_DIRECT`.
    Direct(File),
    /// The file through the page cache, each span dropped from it after reading.
    Buffered(File),
    /// A file held in memory (tests, `GgufFile::from_bytes`).
    Memory(Arc<GgufFile>),
}

impl Source {
    fn open(file: &Arc<GgufFile>) -> Source {
        let Some(path) = file.path() else {
            return Source::Memory(Arc::clone(file));
        };
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(f) => Source::Direct(f),
            Err(e) => {
                tracing::info!(path = %path.display(), error = %e, "O_DIRECT refused; streaming through the page cache");
                match File::open(path) {
                    Ok(f) => Source::Buffered(f),
                    Err(_) => Source::Memory(Arc::clone(file)),
                }
            }
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Source::Direct(_) => "O_DIRECT",
            Source::Buffered(_) => "page cache",
            Source::Memory(_) => "memory",
        }
    }

    /// Reads `range` of the file into `dst` (which starts at `range.start` aligned down);
    /// returns the offset of `range.start` inside `dst`.
    fn read(&mut self, range: &Range<usize>, dst: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Source::Memory(f) => {
                let src = f.bytes().get(range.clone()).ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "layer span beyond the file",
                    )
                })?;
                dst[..src.len()].copy_from_slice(src);
                Ok(0)
            }
            Source::Direct(f) | Source::Buffered(f) => {
                let start = range.start / ALIGN * ALIGN;
                let end = range.end.next_multiple_of(ALIGN);
                let want = end - start;
                let need = range.end - start;
                let mut done = 0usize;
                while done < want {
                    let n = READ_CHUNK.min(want - done);
                    match f.read_at(&mut dst[done..done + n], (start + done) as u64) {
                        Ok(0) => break,
                        // A read that ends off a block boundary has met the end of the file.
                        Ok(k) if k % ALIGN != 0 => {
                            done += k;
                            break;
                        }
                        Ok(k) => done += k,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
                if done < need {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!(
                            "layer span {}..{} ends past the end of the file",
                            range.start, range.end
                        ),
                    ));
                }
                if let Source::Buffered(f) = self {
                    use std::os::fd::AsRawFd;
                    // SAFETY: plain syscall on an fd we own; advice only.
                    unsafe {
                        libc::posix_fadvise(
                            f.as_raw_fd(),
                            start as i64,
                            want as i64,
                            libc::POSIX_FADV_DONTNEED,
                        );
                    }
                }
                Ok(range.start - start)
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Free,
    /// Being read for `order` position `seq`; `cancelled`: freed when the read ends.
    Loading {
        seq: u64,
        cancelled: bool,
    },
    Ready {
        seq: u64,
    },
    InUse {
        seq: u64,
    },
}

struct Slot {
    buf: AlignedBuf,
    state: SlotState,
    /// Offset of the layer's first byte inside `buf`, and the layer's length.
    at: usize,
    len: usize,
}

struct State {
    slots: Vec<Slot>,
    /// The next `order` position to read (monotonic; `order[next % len]`).
    next: u64,
    /// The position the compute last took (the read-ahead is bounded relative to it).
    taken: u64,
    /// Layers (indices into `order`) not to read on their next turn.
    skip: Vec<bool>,
    stop: bool,
    /// The last read error, reported to the next `acquire`.
    error: Option<String>,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    counters: StreamCounters,
    /// Streamed layers in execution order.
    order: Vec<LayerSpan>,
    depth: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn index_of(&self, layer: usize) -> Option<usize> {
        self.order.iter().position(|s| s.layer == layer)
    }
}

/// The streamed tier of a node: see the module docs.
pub struct Streamer {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
    source: &'static str,
}

impl std::fmt::Debug for Streamer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streamer")
            .field(
                "layers",
                &self
                    .shared
                    .order
                    .iter()
                    .map(|s| s.layer)
                    .collect::<Vec<_>>(),
            )
            .field("depth", &self.shared.depth)
            .field("source", &self.source)
            .finish()
    }
}

/// A streamed layer's bytes, held until dropped.
pub struct LayerGuard<'a> {
    shared: &'a Shared,
    slot: usize,
    data: &'a [u8],
    /// Where the layer's span starts in the file: a tensor at file offset `o` is at
    /// `o - file_start` in `data`.
    pub file_start: usize,
}

impl std::ops::Deref for LayerGuard<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.data
    }
}

impl Drop for LayerGuard<'_> {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.slots[self.slot].state = SlotState::Free;
        drop(st);
        self.shared.cv.notify_all();
    }
}

impl Streamer {
    /// Streams `layers` (in execution order) of `file`, `depth` layers ahead (1..=16).
    pub fn new(file: &Arc<GgufFile>, layers: &[usize], depth: usize) -> std::io::Result<Streamer> {
        let depth = depth.clamp(1, MAX_DEPTH);
        let mut order = Vec::with_capacity(layers.len());
        for &il in layers {
            let span = layer_span(file, il).ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("layer {il} has no tensors in the file to stream"),
                )
            })?;
            order.push(span);
        }
        let largest = order
            .iter()
            .map(|s| s.range.len() + 2 * ALIGN)
            .max()
            .unwrap_or(ALIGN);
        let mut slots = Vec::with_capacity(depth + 1);
        for _ in 0..depth + 1 {
            slots.push(Slot {
                buf: AlignedBuf::new(largest)?,
                state: SlotState::Free,
                at: 0,
                len: 0,
            });
        }
        let n = order.len();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                slots,
                next: 0,
                taken: 0,
                skip: vec![false; n],
                stop: false,
                error: None,
            }),
            cv: Condvar::new(),
            counters: StreamCounters::default(),
            order,
            depth,
        });
        let mut source = Source::open(file);
        let name = source.name();
        let s2 = Arc::clone(&shared);
        let thread = if n > 0 {
            Some(
                std::thread::Builder::new()
                    .name("layer-stream".into())
                    .spawn(move || io_thread(&s2, &mut source))?,
            )
        } else {
            None
        };
        tracing::info!(
            layers = n,
            depth,
            buffer_bytes = largest * (depth + 1),
            source = name,
            "streaming layers from disk"
        );
        Ok(Streamer {
            shared,
            thread,
            source: name,
        })
    }

    /// Whether layer `il` is streamed.
    pub fn streams(&self, il: usize) -> bool {
        self.shared.index_of(il).is_some()
    }

    /// The streamed layers, in execution order.
    pub fn layers(&self) -> Vec<usize> {
        self.shared.order.iter().map(|s| s.layer).collect()
    }

    /// Layers read ahead.
    pub fn depth(&self) -> usize {
        self.shared.depth
    }

    /// Bytes of the buffer pool.
    pub fn pool_bytes(&self) -> usize {
        self.shared
            .lock()
            .slots
            .iter()
            .map(|s| s.buf.len)
            .sum::<usize>()
    }

    /// Bytes of the streamed layers (read once per token when none is skipped).
    pub fn streamed_bytes(&self) -> usize {
        self.shared.order.iter().map(|s| s.range.len()).sum()
    }

    pub fn stats(&self) -> StreamStats {
        self.shared.counters.snapshot()
    }

    /// The sequential read rate of this streamer's layers, bytes per second: every streamed
    /// span read once, in run order, the way the I/O thread reads them (`O_DIRECT`, 32 MiB
    /// requests), into a buffer of its own. What a token's reads are bounded by.
    pub fn measure_read_rate(&self, file: &Arc<GgufFile>) -> std::io::Result<f64> {
        let mut source = Source::open(file);
        let largest = self
            .shared
            .order
            .iter()
            .map(|s| s.range.len() + 2 * ALIGN)
            .max()
            .unwrap_or(ALIGN);
        let buf = AlignedBuf::new(largest)?;
        let t0 = Instant::now();
        let mut bytes = 0usize;
        for span in &self.shared.order {
            // SAFETY: the buffer is ours alone.
            let dst = unsafe { buf.slice_mut(buf.len) };
            source.read(&span.range, dst)?;
            bytes += span.range.len();
        }
        Ok(bytes as f64 / t0.elapsed().as_secs_f64().max(1e-9))
    }

    /// Layer `il` will not run this pass: it is not read (if its read has not started).
    pub fn skip(&self, il: usize) {
        let Some(i) = self.shared.index_of(il) else {
            return;
        };
        let n = self.shared.order.len() as u64;
        let mut st = self.shared.lock();
        // Already read (or being read) for this pass: nothing left to save.
        let held = st.slots.iter().any(|s| match s.state {
            SlotState::Loading {
                seq,
                cancelled: false,
            }
            | SlotState::Ready { seq } => seq % n == i as u64 && seq >= st.taken,
            _ => false,
        });
        if !held {
            st.skip[i] = true;
        }
    }

    /// Layer `il`'s bytes, waiting for its read (the wait counts as stall time).
    pub fn acquire(&self, il: usize) -> std::io::Result<LayerGuard<'_>> {
        let sh = &*self.shared;
        let idx = sh.index_of(il).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("layer {il} is not streamed"),
            )
        })?;
        let n = sh.order.len() as u64;
        let t0 = Instant::now();
        let mut st = sh.lock();
        // A skip flag set for this layer no longer applies: it is wanted now.
        st.skip[idx] = false;
        let mut waited = false;
        loop {
            if let Some(e) = st.error.take() {
                return Err(std::io::Error::other(e));
            }
            // The slot holding (or reading) the first occurrence of this layer at or after
            // the position last taken.
            let found = st
                .slots
                .iter()
                .enumerate()
                .filter_map(|(k, s)| match s.state {
                    SlotState::Loading {
                        seq,
                        cancelled: false,
                    }
                    | SlotState::Ready { seq }
                        if seq % n == idx as u64 && seq >= st.taken =>
                    {
                        Some((k, seq))
                    }
                    _ => None,
                })
                .min_by_key(|&(_, seq)| seq);
            match found {
                Some((k, seq)) => {
                    if let SlotState::Ready { .. } = st.slots[k].state {
                        // Layers read ahead of this one but passed over are recycled.
                        for s in st.slots.iter_mut() {
                            match s.state {
                                SlotState::Ready { seq: q } if q < seq => s.state = SlotState::Free,
                                SlotState::Loading {
                                    seq: q,
                                    ref mut cancelled,
                                } if q < seq => *cancelled = true,
                                _ => {}
                            }
                        }
                        st.slots[k].state = SlotState::InUse { seq };
                        st.taken = seq + 1;
                        let (at, len) = (st.slots[k].at, st.slots[k].len);
                        let buf: *const AlignedBuf = &st.slots[k].buf;
                        drop(st);
                        sh.cv.notify_all();
                        if waited {
                            sh.counters
                                .stall_us
                                .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                        }
                        // SAFETY: the slot is InUse: the I/O thread does not write it until
                        // the guard frees it, and the slots are never moved (the Vec is not
                        // resized after construction).
                        let data =
                            unsafe { (*buf).slice(at + len).get(at..at + len).unwrap_or(&[]) };
                        return Ok(LayerGuard {
                            shared: sh,
                            slot: k,
                            data,
                            file_start: sh.order[idx].range.start,
                        });
                    }
                }
                None => {
                    // Not read nor being read. Its next turn at or after the position last
                    // taken: the reader's very next read (wait for it, recycling buffers of
                    // layers passed over), or elsewhere (restart the read-ahead there).
                    let base = st.taken;
                    let mut p = base - base % n + idx as u64;
                    if p < base {
                        p += n;
                    }
                    if p == st.next {
                        let mut freed = false;
                        for s in st.slots.iter_mut() {
                            if let SlotState::Ready { seq } = s.state {
                                if seq < p {
                                    s.state = SlotState::Free;
                                    freed = true;
                                }
                            }
                        }
                        if freed {
                            sh.cv.notify_all();
                        }
                        waited = true;
                        st = sh.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                        continue;
                    }
                    for s in st.slots.iter_mut() {
                        match s.state {
                            SlotState::Ready { .. } => s.state = SlotState::Free,
                            SlotState::Loading {
                                ref mut cancelled, ..
                            } => *cancelled = true,
                            _ => {}
                        }
                    }
                    st.next = p;
                    st.taken = p;
                    sh.counters.restarts.fetch_add(1, Ordering::Relaxed);
                    sh.cv.notify_all();
                }
            }
            waited = true;
            st = sh.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Drop for Streamer {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn io_thread(sh: &Shared, source: &mut Source) {
    let n = sh.order.len() as u64;
    loop {
        let mut st = sh.lock();
        // Wait for a free buffer and room ahead of the compute.
        let (k, seq) = loop {
            if st.stop {
                return;
            }
            // The pool bounds the read-ahead: `depth` layers while one is computed, one
            // more while the compute waits for the rest of the ring.
            match st.slots.iter().position(|s| s.state == SlotState::Free) {
                Some(k) => {
                    let seq = st.next;
                    let idx = (seq % n) as usize;
                    st.next += 1;
                    if st.skip[idx] {
                        st.skip[idx] = false;
                        sh.counters.layers_skipped.fetch_add(1, Ordering::Relaxed);
                        sh.counters
                            .bytes_skipped
                            .fetch_add(sh.order[idx].range.len() as u64, Ordering::Relaxed);
                        // A skipped layer counts as taken: the read-ahead moves past it.
                        if st.taken == seq {
                            st.taken = seq + 1;
                        }
                        continue;
                    }
                    break (k, seq);
                }
                _ => st = sh.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
            }
        };
        st.slots[k].state = SlotState::Loading {
            seq,
            cancelled: false,
        };
        let span = sh.order[(seq % n) as usize].range.clone();
        let buf: *const AlignedBuf = &st.slots[k].buf;
        drop(st);
        let t0 = Instant::now();
        // SAFETY: the slot is Loading: only this thread touches its buffer until it is marked
        // Ready or Free below (the Vec of slots is never resized after construction).
        let dst = unsafe { (*buf).slice_mut((*buf).len) };
        let r = source.read(&span, dst);
        let us = t0.elapsed().as_micros() as u64;
        let mut st = sh.lock();
        match r {
            Ok(at) => {
                sh.counters.read_us.fetch_add(us, Ordering::Relaxed);
                sh.counters
                    .bytes_read
                    .fetch_add(span.len() as u64, Ordering::Relaxed);
                sh.counters.layers_read.fetch_add(1, Ordering::Relaxed);
                let s = &mut st.slots[k];
                s.at = at;
                s.len = span.len();
                s.state = match s.state {
                    SlotState::Loading {
                        cancelled: true, ..
                    } => SlotState::Free,
                    _ => SlotState::Ready { seq },
                };
            }
            Err(e) => {
                st.slots[k].state = SlotState::Free;
                st.error = Some(format!(
                    "reading layer {} ({} bytes at offset {}) failed: {e}",
                    sh.order[(seq % n) as usize].layer,
                    span.len(),
                    span.start
                ));
                // Back off: the next acquire reports it and restarts.
                st.next = seq;
                drop(st);
                sh.cv.notify_all();
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        }
        drop(st);
        sh.cv.notify_all();
    }
}

/// The sequential read rate of `path` with `O_DIRECT` (the page cache bypassed, as the
/// streamer reads), bytes per second, over at most `bytes` from `offset`.
pub fn measure_read_rate(
    path: &std::path::Path,
    offset: u64,
    bytes: usize,
) -> std::io::Result<f64> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
    let buf = AlignedBuf::new(READ_CHUNK)?;
    let mut at = offset / ALIGN as u64 * ALIGN as u64;
    let mut done = 0usize;
    let t0 = Instant::now();
    while done < bytes {
        // SAFETY: the buffer is ours alone.
        let dst = unsafe { buf.slice_mut(buf.len) };
        let k = f.read_at(dst, at)?;
        if k == 0 {
            break;
        }
        done += k;
        at += k as u64;
        if k % ALIGN != 0 {
            break;
        }
    }
    let s = t0.elapsed().as_secs_f64();
    if done == 0 || s <= 0.0 {
        return Err(std::io::Error::other("nothing read"));
    }
    Ok(done as f64 / s)
}
