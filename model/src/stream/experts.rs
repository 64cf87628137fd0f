//! A mixture of experts's experts streamed from disk: everything else of the layers stays
//! resident (tier A), and each expert is read, when the router picks it, into a cache of
//! expert buffers in the node's budget.
//!
//! # How
//!
//! An expert is three spans of the file: its rows of the stacked `ffn_gate_exps`,
//! `ffn_up_exps` and `ffn_down_exps`. A slot of the cache holds one expert's three spans,
//! read with `O_DIRECT` (as the layer streamer reads) by a few I/O threads, so several reads
//! are in flight and the page cache neither grows nor hides the disk.
//!
//! The forward pass tells the store which experts a layer will run ([`ExpertStore::want`],
//! right after the router) and then takes them one by one, in increasing expert index
//! ([`ExpertStore::acquire`]), computing each while the next ones are read. While layer `l`
//! computes, the caller may also name the experts it predicts layer `l+1` will pick
//! ([`ExpertStore::predict`]); those are read when no demanded expert is waiting. A wrong
//! guess costs a read, never a wrong answer: the forward pass only ever computes the experts
//! the router chose, from the file's bytes.
//!
//! # Which expert leaves the cache
//!
//! A slot in use is never evicted, nor one being read. Otherwise, first one nobody is waiting
//! for (least frequently used, with frequencies halved as uses accumulate so that the cache
//! follows a change of topic; then least recently used), then a predicted one, and last a
//! demanded one of the current layer, the one needed latest first, and only to read one
//! needed sooner. Demanded experts are read in the order they are needed, so the forward pass
//! always progresses, even when a prefill batch needs more experts than the cache holds.

use super::{AlignedBuf, Source, ALIGN};
use crate::gguf::GgufFile;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// The stacked tensors an expert has rows in, in slot order.
const PARTS: [&str; 3] = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"];
/// Reads in flight.
pub const IO_THREADS: usize = 4;
/// Slots beyond the I/O threads' that a cache needs to make progress: the one computed and
/// the one needed next.
const SLACK_SLOTS: usize = 2;

/// Where one layer's experts lie in the file.
#[derive(Clone, Debug)]
struct LayerExperts {
    /// Per part: the stacked tensor's first byte and one expert's bytes.
    parts: [(usize, usize); 3],
    n_expert: usize,
}

impl LayerExperts {
    fn range(&self, part: usize, e: usize) -> Range<usize> {
        let (start, span) = self.parts[part];
        start + e * span..start + (e + 1) * span
    }

    fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.1).sum()
    }
}

/// The experts of layer `il` in `file`: `None` when the layer has no stacked experts.
fn layer_experts(file: &GgufFile, il: usize) -> Result<Option<LayerExperts>, String> {
    let mut parts = [(0usize, 0usize); 3];
    let mut n_expert = None;
    for (p, name) in PARTS.iter().enumerate() {
        let full = format!("blk.{il}.{name}.weight");
        let Some(t) = file.tensor(&full) else {
            return Ok(None);
        };
        let [_, _, ne] = t.dims[..] else {
            return Err(format!("{full} is not 3-D: {:?}", t.dims));
        };
        let ne = ne as usize;
        if ne == 0 || !(t.size as usize).is_multiple_of(ne) {
            return Err(format!(
                "{full}: {} bytes do not split into {ne} experts",
                t.size
            ));
        }
        if n_expert.is_some_and(|n| n != ne) {
            return Err(format!(
                "{full} has {ne} experts, the layer's other parts do not"
            ));
        }
        n_expert = Some(ne);
        parts[p] = (t.offset as usize, t.size as usize / ne);
    }
    Ok(n_expert.map(|n_expert| LayerExperts { parts, n_expert }))
}

/// Bytes a slot needs for a part of `span` bytes read whole aligned blocks at both ends.
fn part_capacity(span: usize) -> usize {
    span.next_multiple_of(ALIGN) + 2 * ALIGN
}

/// The experts of `layers` of `file`, their bytes in the file and a slot's size.
#[derive(Clone, Debug)]
pub struct ExpertLayout {
    layers: Vec<Option<LayerExperts>>,
    /// Each part's offset in a slot.
    part_offsets: [usize; 3],
    slot_bytes: usize,
}

impl ExpertLayout {
    /// The experts of `layers` (global indices) of `file`; an error if none of them has
    /// stacked experts or if a tensor is malformed.
    pub fn new(file: &GgufFile, layers: &[usize]) -> Result<ExpertLayout, String> {
        let top = layers.iter().max().map_or(0, |&l| l + 1);
        let mut all = vec![None; top];
        let mut caps = [0usize; 3];
        for &il in layers {
            if let Some(le) = layer_experts(file, il)? {
                for (c, p) in caps.iter_mut().zip(&le.parts) {
                    *c = (*c).max(part_capacity(p.1));
                }
                all[il] = Some(le);
            }
        }
        if all.iter().all(Option::is_none) {
            return Err("no layer has stacked experts".into());
        }
        let part_offsets = [0, caps[0], caps[0] + caps[1]];
        Ok(ExpertLayout {
            layers: all,
            part_offsets,
            slot_bytes: caps.iter().sum(),
        })
    }

    /// Bytes of one expert buffer.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Whether layer `il`'s experts are in this layout.
    pub fn has(&self, il: usize) -> bool {
        self.layers.get(il).is_some_and(Option::is_some)
    }

    /// Every expert's bytes in the file over the layout's layers.
    pub fn expert_bytes(&self) -> u64 {
        self.layers
            .iter()
            .flatten()
            .map(|l| (l.bytes() * l.n_expert) as u64)
            .sum()
    }

    /// Experts over the layout's layers.
    pub fn experts(&self) -> usize {
        self.layers.iter().flatten().map(|l| l.n_expert).sum()
    }

    /// The bytes of one expert of layer `il` (the mean over the layers when they differ).
    pub fn bytes_per_expert(&self) -> f64 {
        self.expert_bytes() as f64 / self.experts().max(1) as f64
    }

    /// The fewest slots a cache over this layout works with.
    pub fn min_slots() -> usize {
        IO_THREADS + SLACK_SLOTS
    }
}

/// What the store did since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpertStats {
    /// Experts the forward pass ran (one per layer and expert picked by some row).
    pub used: u64,
    /// Of those, in the cache when the router chose them (read for an earlier token).
    pub hits: u64,
    /// Of those, read (or being read) because they were predicted.
    pub prefetched: u64,
    /// Experts read from the file, and their bytes (whole aligned blocks).
    pub reads: u64,
    pub bytes_read: u64,
    /// Of the reads, those a prediction started, and how many of those went unused.
    pub predicted_reads: u64,
    pub wasted_reads: u64,
    /// Experts named by predictions for a layer, and of them those the layer then used; the
    /// experts used by layers that had a prediction.
    pub predicted: u64,
    pub predicted_right: u64,
    pub used_with_prediction: u64,
    /// Seconds the I/O threads spent reading (summed over threads), and the forward pass
    /// waited for an expert.
    pub read_s: f64,
    pub stall_s: f64,
}

impl ExpertStats {
    /// Share of the used experts found in the cache.
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / self.used.max(1) as f64
    }

    /// Share of the experts used (where a prediction was made) that the prediction named.
    pub fn prediction_accuracy(&self) -> f64 {
        self.predicted_right as f64 / self.used_with_prediction.max(1) as f64
    }

    /// The difference `self − earlier`.
    pub fn since(&self, earlier: &ExpertStats) -> ExpertStats {
        ExpertStats {
            used: self.used - earlier.used,
            hits: self.hits - earlier.hits,
            prefetched: self.prefetched - earlier.prefetched,
            reads: self.reads - earlier.reads,
            bytes_read: self.bytes_read - earlier.bytes_read,
            predicted_reads: self.predicted_reads - earlier.predicted_reads,
            wasted_reads: self.wasted_reads - earlier.wasted_reads,
            predicted: self.predicted - earlier.predicted,
            predicted_right: self.predicted_right - earlier.predicted_right,
            used_with_prediction: self.used_with_prediction - earlier.used_with_prediction,
            read_s: self.read_s - earlier.read_s,
            stall_s: self.stall_s - earlier.stall_s,
        }
    }
}

type Key = (u32, u32);

#[derive(Debug)]
enum SlotState {
    Empty,
    Loading,
    Ready,
    Failed(String),
}

struct Slot {
    buf: AlignedBuf,
    key: Option<Key>,
    state: SlotState,
    /// Guards handed out.
    pins: u32,
    /// Uses (halved from time to time) and the tick of the last.
    freq: u32,
    last_use: u64,
    /// Read because of a prediction and not used since.
    by_prediction: bool,
    /// Where each part's bytes start in the buffer (after the aligned read's head).
    starts: [usize; 3],
}

struct State {
    slots: Vec<Slot>,
    map: HashMap<Key, usize>,
    /// The layer being run, its experts in the order they will be taken, and the position of
    /// the next one to be taken.
    layer: Option<u32>,
    need: Vec<u32>,
    cursor: usize,
    /// The layer predicted and its experts.
    pred_layer: Option<u32>,
    pred: Vec<u32>,
    tick: u64,
    stats: ExpertStats,
    shutdown: bool,
}

impl State {
    /// How much a ready, unpinned slot is worth keeping: `(class, rank)`, evicted lowest
    /// first. Class 0 is held by nobody, 1 predicted, 2 demanded by the current layer (rank:
    /// the later it is needed, the lower).
    fn keep(&self, slot: &Slot) -> (u8, u64) {
        let Some((l, e)) = slot.key else {
            return (0, 0);
        };
        if self.layer == Some(l) {
            if let Some(p) = self.need[self.cursor.min(self.need.len())..]
                .iter()
                .position(|&x| x == e)
            {
                return (2, u64::MAX - p as u64);
            }
        }
        if self.pred_layer == Some(l) && self.pred.contains(&e) {
            return (1, u64::from(slot.freq));
        }
        (
            0,
            (u64::from(slot.freq) << 40) | (slot.last_use & ((1 << 40) - 1)),
        )
    }

    /// A slot to read into: an empty one, or the one least worth keeping below `limit`.
    fn victim(&self, limit: (u8, u64)) -> Option<usize> {
        let mut best: Option<(usize, (u8, u64))> = None;
        for (i, s) in self.slots.iter().enumerate() {
            match s.state {
                SlotState::Empty => return Some(i),
                // A failed read nobody is waiting for: read again when needed.
                SlotState::Failed(_) if s.pins == 0 && best.is_none_or(|b| (0, 0) < b.1) => {
                    best = Some((i, (0, 0)));
                }
                SlotState::Ready if s.pins == 0 => {
                    let k = self.keep(s);
                    if k < limit && best.is_none_or(|b| k < b.1) {
                        best = Some((i, k));
                    }
                }
                _ => {}
            }
        }
        best.map(|b| b.0)
    }

    /// The next read: the first demanded expert not in the cache, then the first predicted
    /// one; with the slot to read it into.
    fn next_read(&self) -> Option<(Key, usize, bool)> {
        if let Some(l) = self.layer {
            let from = self.cursor.min(self.need.len());
            if let Some((p, &e)) = self.need[from..]
                .iter()
                .enumerate()
                .find(|(_, e)| !self.map.contains_key(&(l, **e)))
            {
                // Only evict a demanded expert needed later than this one.
                let slot = self.victim((2, u64::MAX - p as u64))?;
                return Some(((l, e), slot, false));
            }
        }
        let l = self.pred_layer?;
        let e = *self
            .pred
            .iter()
            .find(|e| !self.map.contains_key(&(l, **e)))?;
        let slot = self.victim((1, 0))?;
        Some(((l, e), slot, true))
    }

    /// Halves every frequency once the uses since the last halving reach the cache's size.
    fn age(&mut self) {
        self.tick += 1;
        if self.tick.is_multiple_of(4 * self.slots.len() as u64) {
            for s in &mut self.slots {
                s.freq /= 2;
            }
        }
    }
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The expert cache of a node and its I/O threads.
pub struct ExpertStore {
    layout: ExpertLayout,
    /// Whether the forward pass names the next layer's likely experts ahead.
    predict: bool,
    shared: Arc<Shared>,
    threads: Vec<std::thread::JoinHandle<()>>,
    source: &'static str,
}

impl std::fmt::Debug for ExpertStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertStore")
            .field("slots", &self.slots())
            .field("slot_bytes", &self.layout.slot_bytes)
            .field("source", &self.source)
            .finish()
    }
}

/// One expert's bytes, held until dropped.
pub struct ExpertGuard<'a> {
    store: &'a ExpertStore,
    slot: usize,
    parts: [Range<usize>; 3],
    buf: &'a [u8],
}

impl ExpertGuard<'_> {
    /// The expert's rows of part `p` (0 gate, 1 up, 2 down), as the file has them.
    pub fn part(&self, p: usize) -> &[u8] {
        &self.buf[self.parts[p].clone()]
    }
}

impl Drop for ExpertGuard<'_> {
    fn drop(&mut self) {
        let mut st = self.store.shared.lock();
        let s = &mut st.slots[self.slot];
        s.pins = s.pins.saturating_sub(1);
        drop(st);
        self.store.shared.cv.notify_all();
    }
}

impl ExpertStore {
    /// A cache of `slots` expert buffers over `layout`'s experts in `file`, with its I/O
    /// threads started.
    pub fn new(
        file: &Arc<GgufFile>,
        layout: ExpertLayout,
        slots: usize,
        predict: bool,
    ) -> std::io::Result<ExpertStore> {
        if slots < ExpertLayout::min_slots() {
            return Err(std::io::Error::other(format!(
                "an expert cache needs at least {} buffers, not {slots}",
                ExpertLayout::min_slots()
            )));
        }
        let mut v = Vec::with_capacity(slots);
        for _ in 0..slots {
            v.push(Slot {
                buf: AlignedBuf::new(layout.slot_bytes)?,
                key: None,
                state: SlotState::Empty,
                pins: 0,
                freq: 0,
                last_use: 0,
                by_prediction: false,
                starts: [0; 3],
            });
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                slots: v,
                map: HashMap::new(),
                layer: None,
                need: Vec::new(),
                cursor: 0,
                pred_layer: None,
                pred: Vec::new(),
                tick: 0,
                stats: ExpertStats::default(),
                shutdown: false,
            }),
            cv: Condvar::new(),
        });
        let mut threads = Vec::with_capacity(IO_THREADS);
        let mut source = "memory";
        for i in 0..IO_THREADS {
            let src = Source::open(file);
            source = src.name();
            let sh = Arc::clone(&shared);
            let lay = layout.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("ringllm-experts-{i}"))
                    .spawn(move || io_thread(&sh, &lay, src))?,
            );
        }
        Ok(ExpertStore {
            layout,
            predict,
            shared,
            threads,
            source,
        })
    }

    /// Whether the next layer's experts are predicted and read ahead.
    pub fn predicts(&self) -> bool {
        self.predict
    }

    pub fn layout(&self) -> &ExpertLayout {
        &self.layout
    }

    /// Whether layer `il`'s experts are read from here.
    pub fn streams(&self, il: usize) -> bool {
        self.layout.has(il)
    }

    pub fn slots(&self) -> usize {
        self.shared.lock().slots.len()
    }

    /// Bytes of the expert buffers.
    pub fn pool_bytes(&self) -> usize {
        self.slots() * self.layout.slot_bytes
    }

    /// `O_DIRECT`, `page cache` or `memory`.
    pub fn source(&self) -> &'static str {
        self.source
    }

    pub fn stats(&self) -> ExpertStats {
        self.shared.lock().stats
    }

    /// Layer `il` will take `experts` (increasing, no repeats) in that order: the missing
    /// ones are read in that order, ahead of any prediction.
    pub fn want(&self, il: usize, experts: &[u32]) {
        let mut st = self.shared.lock();
        let l = il as u32;
        let predicted = st.pred_layer == Some(l);
        if predicted {
            st.stats.used_with_prediction += experts.len() as u64;
            let right = experts.iter().filter(|e| st.pred.contains(e)).count();
            st.stats.predicted_right += right as u64;
        }
        for &e in experts {
            st.stats.used += 1;
            if let Some(&i) = st.map.get(&(l, e)) {
                if st.slots[i].by_prediction {
                    st.stats.prefetched += 1;
                } else {
                    st.stats.hits += 1;
                }
            }
        }
        st.layer = Some(l);
        st.need.clear();
        st.need.extend_from_slice(experts);
        st.cursor = 0;
        if predicted {
            st.pred_layer = None;
            st.pred.clear();
        }
        drop(st);
        self.shared.cv.notify_all();
    }

    /// Layer `il` will probably take `experts`: read those not in the cache when no
    /// demanded expert waits (a previous prediction is dropped).
    pub fn predict(&self, il: usize, experts: &[u32]) {
        let mut st = self.shared.lock();
        st.pred_layer = Some(il as u32);
        st.pred.clear();
        st.pred.extend_from_slice(experts);
        st.stats.predicted += experts.len() as u64;
        drop(st);
        self.shared.cv.notify_all();
    }

    /// Expert `e` of layer `il`, read first if it is not in the cache; waits for it.
    pub fn acquire(&self, il: usize, e: usize) -> std::io::Result<ExpertGuard<'_>> {
        let key = (il as u32, e as u32);
        let le = self.layout.layers.get(il).and_then(Option::as_ref);
        let Some(le) = le.filter(|le| e < le.n_expert) else {
            return Err(std::io::Error::other(format!(
                "expert {e} of layer {il} is not streamed here"
            )));
        };
        let mut st = self.shared.lock();
        if st.layer == Some(key.0) {
            if let Some(p) = st.need.iter().position(|&x| x == key.1) {
                st.cursor = p;
            }
        } else {
            // Taken without `want`: demanded alone.
            st.layer = Some(key.0);
            st.need = vec![key.1];
            st.cursor = 0;
        }
        let mut waited: Option<Instant> = None;
        loop {
            if let Some(&i) = st.map.get(&key) {
                match &st.slots[i].state {
                    SlotState::Ready => {
                        st.age();
                        let tick = st.tick;
                        let s = &mut st.slots[i];
                        s.pins += 1;
                        s.freq = s.freq.saturating_add(1);
                        s.last_use = tick;
                        s.by_prediction = false;
                        let starts = s.starts;
                        if let Some(t) = waited {
                            st.stats.stall_s += t.elapsed().as_secs_f64();
                        }
                        let parts = std::array::from_fn(|p| {
                            let at = self.layout.part_offsets[p] + starts[p];
                            at..at + le.parts[p].1
                        });
                        // SAFETY: a Ready slot is written by nobody until it is evicted, and
                        // a pinned slot is never evicted; the Vec of slots never reallocates.
                        let buf = unsafe { st.slots[i].buf.slice(self.layout.slot_bytes) };
                        // SAFETY: the buffer outlives the guard (it lives as long as the
                        // store, which the guard borrows).
                        let buf: &[u8] =
                            unsafe { std::slice::from_raw_parts(buf.as_ptr(), buf.len()) };
                        return Ok(ExpertGuard {
                            store: self,
                            slot: i,
                            parts,
                            buf,
                        });
                    }
                    SlotState::Failed(why) => {
                        let why = why.clone();
                        let s = &mut st.slots[i];
                        s.state = SlotState::Empty;
                        s.key = None;
                        st.map.remove(&key);
                        return Err(std::io::Error::other(format!(
                            "reading expert {e} of layer {il}: {why}"
                        )));
                    }
                    SlotState::Loading | SlotState::Empty => {}
                }
            }
            if st.shutdown {
                return Err(std::io::Error::other("the expert store is shut down"));
            }
            waited.get_or_insert_with(Instant::now);
            self.shared.cv.notify_all();
            st = self.shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Drop for ExpertStore {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.cv.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// One I/O thread: takes the next read, reads the expert's three parts into its slot.
fn io_thread(sh: &Shared, layout: &ExpertLayout, mut source: Source) {
    let mut st = sh.lock();
    loop {
        if st.shutdown {
            return;
        }
        let Some((key, slot, predicted)) = st.next_read() else {
            st = sh.cv.wait(st).unwrap_or_else(|p| p.into_inner());
            continue;
        };
        let Some(le) = layout.layers.get(key.0 as usize).and_then(Option::as_ref) else {
            // Not a streamed layer: nothing to read (acquire refuses it).
            st.need.retain(|&e| e != key.1);
            continue;
        };
        if let Some(old) = st.slots[slot].key.take() {
            st.map.remove(&old);
            if st.slots[slot].by_prediction {
                st.stats.wasted_reads += 1;
            }
        }
        let s = &mut st.slots[slot];
        s.key = Some(key);
        s.state = SlotState::Loading;
        s.freq = 1;
        s.by_prediction = predicted;
        st.map.insert(key, slot);
        // SAFETY: a Loading slot is written by this thread alone and read by nobody; the
        // Vec of slots never reallocates.
        let buf = unsafe { st.slots[slot].buf.slice_mut(layout.slot_bytes) };
        // SAFETY: detached from the lock's borrow: the buffer lives as long as the shared
        // state (which this thread holds an Arc of), and the slot stays Loading until below.
        let buf: &mut [u8] = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr(), buf.len()) };
        drop(st);
        let t0 = Instant::now();
        let mut starts = [0usize; 3];
        let mut bytes = 0u64;
        let mut result = Ok(());
        for (p, start) in starts.iter_mut().enumerate() {
            let range = le.range(p, key.1 as usize);
            let off = layout.part_offsets[p];
            let cap = part_capacity(le.parts[p].1);
            match source.read(&range, &mut buf[off..off + cap]) {
                Ok(head) => {
                    *start = head;
                    bytes +=
                        (range.end.next_multiple_of(ALIGN) - range.start / ALIGN * ALIGN) as u64;
                }
                Err(e) => {
                    result = Err(e.to_string());
                    break;
                }
            }
        }
        let dt = t0.elapsed().as_secs_f64();
        st = sh.lock();
        st.stats.read_s += dt;
        let tick = st.tick;
        let s = &mut st.slots[slot];
        s.starts = starts;
        s.last_use = tick;
        match result {
            Ok(()) => {
                s.state = SlotState::Ready;
                st.stats.reads += 1;
                st.stats.bytes_read += bytes;
                if predicted {
                    st.stats.predicted_reads += 1;
                }
            }
            Err(why) => {
                tracing::warn!(layer = key.0, expert = key.1, error = %why, "reading an expert failed");
                s.state = SlotState::Failed(why);
            }
        }
        sh.cv.notify_all();
    }
}
