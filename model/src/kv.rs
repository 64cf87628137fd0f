//! Per-sequence KV cache. Global layers keep the whole context; sliding-window layers keep a
//! ring of `window + max_batch - 1` positions, enough for every query of a batch to see its
//! whole window. Stored as f32 or f16.

use crate::arch::Hparams;
use half::f16;

/// Element type of the cache: a wire type, defined with the control messages.
pub use ringllm_protocol::control::KvType;

/// `KvCache::can_truncate_to` for the whole model without a cache at hand (the coordinator
/// of a ring decides for every node's layers).
pub fn can_truncate(hp: &Hparams, ctx: usize, max_batch: usize, len: usize, target: usize) -> bool {
    target == 0
        || target >= len
        || (0..hp.n_layer).all(|il| {
            if !(hp.sliding[il] && hp.sliding_window > 0) {
                return true;
            }
            let w = hp.sliding_window;
            let cap = (w + max_batch.max(1) - 1).min(ctx);
            (target + 1).saturating_sub(w) >= len.saturating_sub(cap)
        })
}

/// The ring size and window of layer `il`'s cache: the whole context for a global layer,
/// `window + max_batch - 1` positions for a sliding-window one, nothing for a shared-KV layer
/// (it reads its source layer's).
fn ring_of(hp: &Hparams, il: usize, ctx: usize, max_batch: usize) -> (usize, Option<usize>) {
    if hp.kv_source(il).is_some() {
        (0, None)
    } else if hp.sliding[il] && hp.sliding_window > 0 {
        (
            (hp.sliding_window + max_batch.max(1) - 1).min(ctx),
            Some(hp.sliding_window),
        )
    } else {
        (ctx, None)
    }
}

/// One stored K or V row type.
pub trait KvElem: Copy + Send + Sync + 'static {
    fn load(self) -> f32;
    fn store(v: f32) -> Self;

    /// `Σ q[i]·k[i]`.
    fn dot(q: &[f32], k: &[Self]) -> f32 {
        let mut acc = [0f32; 8];
        let (qc, kc) = (q.chunks_exact(8), k.chunks_exact(8));
        let (qr, kr) = (qc.remainder(), kc.remainder());
        for (a, b) in qc.zip(kc) {
            for j in 0..8 {
                acc[j] += a[j] * b[j].load();
            }
        }
        let tail: f32 = qr.iter().zip(kr).map(|(a, b)| a * b.load()).sum();
        acc.iter().sum::<f32>() + tail
    }

    /// `out[i] += w·v[i]`.
    fn axpy(w: f32, v: &[Self], out: &mut [f32]) {
        for (o, x) in out.iter_mut().zip(v) {
            *o += w * x.load();
        }
    }

    /// `scores[g * s_stride + j] = scale · q_g·k_j` for `n_q` queries (back to back in `q`, `hd`
    /// each) against `n_k` keys `k_stride` apart.
    #[allow(clippy::too_many_arguments)]
    fn qk(
        q: &[f32],
        n_q: usize,
        hd: usize,
        k: &[Self],
        k_stride: usize,
        n_k: usize,
        scale: f32,
        scores: &mut [f32],
        s_stride: usize,
    ) {
        for g in 0..n_q {
            for j in 0..n_k {
                scores[g * s_stride + j] = Self::dot(
                    &q[g * hd..(g + 1) * hd],
                    &k[j * k_stride..j * k_stride + hd],
                ) * scale;
            }
        }
    }

    /// `out[g * hd + d] += Σ_j p[g * p_stride + j] · v[j * v_stride + d]` for `n_q` output rows.
    #[allow(clippy::too_many_arguments)]
    fn pv(
        p: &[f32],
        p_stride: usize,
        n_q: usize,
        v: &[Self],
        v_stride: usize,
        n_k: usize,
        hd: usize,
        out: &mut [f32],
    ) {
        for g in 0..n_q {
            for j in 0..n_k {
                Self::axpy(
                    p[g * p_stride + j],
                    &v[j * v_stride..j * v_stride + hd],
                    &mut out[g * hd..(g + 1) * hd],
                );
            }
        }
    }
}

impl KvElem for f32 {
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        v
    }
    fn dot(q: &[f32], k: &[f32]) -> f32 {
        ringllm_kernels::ops::dot_fast(q, k)
    }
    fn axpy(w: f32, v: &[f32], out: &mut [f32]) {
        ringllm_kernels::ops::axpy_fast(w, v, out)
    }
    fn qk(
        q: &[f32],
        n_q: usize,
        hd: usize,
        k: &[f32],
        k_stride: usize,
        n_k: usize,
        scale: f32,
        scores: &mut [f32],
        s_stride: usize,
    ) {
        ringllm_kernels::ops::qk_scores(q, n_q, hd, k, k_stride, n_k, scale, scores, s_stride)
    }
    fn pv(
        p: &[f32],
        p_stride: usize,
        n_q: usize,
        v: &[f32],
        v_stride: usize,
        n_k: usize,
        hd: usize,
        out: &mut [f32],
    ) {
        ringllm_kernels::ops::pv_accumulate(p, p_stride, n_q, v, v_stride, n_k, hd, out)
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        f16::from_f32(v)
    }
}

#[derive(Debug)]
pub enum KvBuf {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

#[derive(Debug)]
pub struct LayerKv {
    /// Positions held (ring size); 0 for a shared-KV layer, which reads another layer's.
    pub cap: usize,
    /// First position a query may see: `pos + 1 - window` (sliding) or 0.
    pub window: Option<usize>,
    /// Values per stored K (and V) row: the layer's KV heads times its head size.
    pub kv_dim: usize,
    pub k: KvBuf,
    pub v: KvBuf,
    /// Per slot: the token there skipped this layer (predictive layer skip), so the slot
    /// holds no key or value of it and attention leaves it out. Empty until a first skip;
    /// `any_skipped` says whether to look at all, so a cache without skips costs nothing.
    skipped: Vec<bool>,
    any_skipped: bool,
}

impl LayerKv {
    pub fn slot(&self, pos: usize) -> usize {
        pos % self.cap
    }

    /// Marks `slot` as holding no key or value (its token skipped this layer).
    pub fn mark_skipped(&mut self, slot: usize) {
        if self.skipped.len() != self.cap {
            self.skipped = vec![false; self.cap];
        }
        self.skipped[slot] = true;
        self.any_skipped = true;
    }

    /// Marks `slot` as written (a key and value stored there).
    #[inline]
    pub fn mark_written(&mut self, slot: usize) {
        if self.any_skipped {
            self.skipped[slot] = false;
        }
    }

    /// True when some slot may be marked skipped (attention must then check `is_skipped`).
    #[inline]
    pub fn any_skipped(&self) -> bool {
        self.any_skipped
    }

    /// True when `slot` holds no key or value (its token skipped this layer).
    #[inline]
    pub fn is_skipped(&self, slot: usize) -> bool {
        self.any_skipped && self.skipped[slot]
    }

    /// Forgets every skip mark.
    pub fn clear_skipped(&mut self) {
        if self.any_skipped {
            self.skipped.fill(false);
            self.any_skipped = false;
        }
    }

    /// Positions visible to a query at `pos`.
    pub fn visible(&self, pos: usize) -> std::ops::Range<usize> {
        let lo = match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        lo..pos + 1
    }
}

/// The cache of one sequence over a range of layers.
#[derive(Debug)]
pub struct KvCache {
    pub layers: Vec<LayerKv>,
    /// Maximum positions in the sequence.
    pub ctx: usize,
    pub ty: KvType,
    /// Positions filled so far.
    pub len: usize,
    /// Made for a runner on another backend (a GPU): the host buffers are empty and the keys
    /// and values live in `device`, allocated by the backend on first use.
    pub device_only: bool,
    pub device: Option<Box<dyn crate::backend::DeviceKv>>,
}

impl KvCache {
    /// A cache for `layers` of a model with `hp`, `ctx` positions, batches up to `max_batch`.
    pub fn new(
        hp: &Hparams,
        layers: std::ops::Range<usize>,
        ctx: usize,
        max_batch: usize,
        ty: KvType,
    ) -> KvCache {
        let layers = layers
            .map(|il| {
                let (cap, window) = ring_of(hp, il, ctx, max_batch);
                let n = cap * hp.kv_dim_of(il);
                let buf = || match ty {
                    KvType::F32 => KvBuf::F32(vec![0.0; n]),
                    KvType::F16 => KvBuf::F16(vec![f16::ZERO; n]),
                };
                LayerKv {
                    cap,
                    window,
                    kv_dim: hp.kv_dim_of(il),
                    k: buf(),
                    v: buf(),
                    skipped: Vec::new(),
                    any_skipped: false,
                }
            })
            .collect();
        KvCache {
            layers,
            ctx,
            ty,
            len: 0,
            device_only: false,
            device: None,
        }
    }

    /// A cache whose keys and values a backend keeps on its device: the same ring sizes and
    /// windows, no host buffers.
    pub fn new_device(
        hp: &Hparams,
        layers: std::ops::Range<usize>,
        ctx: usize,
        max_batch: usize,
        ty: KvType,
    ) -> KvCache {
        let mut c = KvCache::new(hp, 0..0, ctx, max_batch, ty);
        c.layers = layers
            .map(|il| {
                let (cap, window) = ring_of(hp, il, ctx, max_batch);
                LayerKv {
                    cap,
                    window,
                    kv_dim: hp.kv_dim_of(il),
                    k: KvBuf::F32(Vec::new()),
                    v: KvBuf::F32(Vec::new()),
                    skipped: Vec::new(),
                    any_skipped: false,
                }
            })
            .collect();
        c.device_only = true;
        c
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| 2 * l.cap * l.kv_dim * self.ty.size())
            .sum()
    }

    /// Bytes a cache would take, without allocating it.
    pub fn bytes_for(
        hp: &Hparams,
        layers: std::ops::Range<usize>,
        ctx: usize,
        max_batch: usize,
        ty: KvType,
    ) -> usize {
        layers
            .map(|il| 2 * ring_of(hp, il, ctx, max_batch).0 * hp.kv_dim_of(il) * ty.size())
            .sum()
    }

    /// Forgets everything after `len` positions (positions are rewritten on reuse).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        // Emptied: no slot a query can see is marked any more (a partial truncation keeps
        // the marks, each rewritten with its position on reuse).
        if self.len == 0 {
            for l in self.layers.iter_mut() {
                l.clear_skipped();
            }
        }
    }

    /// True when truncating to `len` keeps every position the next query can see: a
    /// sliding-window ring may already have overwritten older positions.
    pub fn can_truncate_to(&self, len: usize) -> bool {
        len == 0
            || len >= self.len
            || self.layers.iter().all(|l| match l.window {
                None => true,
                Some(w) => (len + 1).saturating_sub(w) >= self.len.saturating_sub(l.cap),
            })
    }
}
