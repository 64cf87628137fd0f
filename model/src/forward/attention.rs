//! Attention on the CPU: the batch's keys and values stored in each sequence's cache, then
//! causal attention of every query over the positions it may see (the whole context, or a
//! sliding window; positions whose token skipped the layer are left out).

use super::Scratch;
use crate::arch::Hparams;
use crate::kv::{KvBuf, KvElem, LayerKv};
use ringllm_kernels::ops;
use ringllm_kernels::pool::{Chunks, SharedMut};
use ringllm_kernels::ThreadPool;

/// The `Attention` step of layer `il`: stores the `n` rows' keys and values (`s.k`, `s.v`)
/// in their sequences' caches when `store` (a row that skips the layer, `skip_rows[r]`, marks
/// its slot as holding nothing instead), then attention of the queries `s.q` into `s.att`,
/// queries scaled by `scale.0`, scores soft-capped by `scale.1` when it is set. A shared-KV layer (`SharedAttention`) stores nothing: its
/// `segs` are its source layer's caches, written by that layer earlier in this pass.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend(
    pool: &ThreadPool,
    hp: &Hparams,
    il: usize,
    (scale, softcap, sinks): (f32, Option<f32>, Option<&[f32]>),
    store: bool,
    s: &mut Scratch,
    scores_stride: usize,
    segs: &mut [Seg<'_>],
    n: usize,
    skip_rows: Option<&[bool]>,
) {
    let (qd, kvd, hd) = (hp.q_dim_of(il), hp.kv_dim_of(il), hp.head_dim_of(il));
    for seg in segs.iter_mut().filter(|_| store) {
        let kv = &mut *seg.kv;
        // Store K and V.
        for t in 0..seg.n {
            let slot = kv.slot(seg.pos + t);
            let r = seg.row + t;
            if skip_rows.is_some_and(|s| s[r]) {
                kv.mark_skipped(slot);
                continue;
            }
            kv.mark_written(slot);
            let (ks, vs) = (&s.k[r * kvd..(r + 1) * kvd], &s.v[r * kvd..(r + 1) * kvd]);
            match (&mut kv.k, &mut kv.v) {
                (KvBuf::F32(kb), KvBuf::F32(vb)) => {
                    kb[slot * kvd..(slot + 1) * kvd].copy_from_slice(ks);
                    vb[slot * kvd..(slot + 1) * kvd].copy_from_slice(vs);
                }
                (KvBuf::F16(kb), KvBuf::F16(vb)) => {
                    for (dst, src) in kb[slot * kvd..(slot + 1) * kvd].iter_mut().zip(ks) {
                        *dst = half::f16::from_f32(*src);
                    }
                    for (dst, src) in vb[slot * kvd..(slot + 1) * kvd].iter_mut().zip(vs) {
                        *dst = half::f16::from_f32(*src);
                    }
                }
                _ => unreachable!("K and V buffers share one type"),
            }
        }
    }
    // One pass of the pool over every sequence's (token, KV head, block of heads): with
    // several sequences decoding, a pass each was a thread wake-up per sequence per layer.
    let shape = AttnShape {
        n_head: hp.n_head,
        group: hp.n_head / hp.layer_shape(il).n_head_kv,
        head_dim: hd,
        qd,
        kvd,
        scale,
        softcap,
        sinks,
        scores_stride,
    };
    let (q, att) = (&s.q[..n * qd], &mut s.att[..n * qd]);
    let f32s: Option<Vec<SegKv<f32>>> = segs
        .iter()
        .map(|g| match (&g.kv.k, &g.kv.v) {
            (KvBuf::F32(k), KvBuf::F32(v)) => Some(SegKv::new(g, k, v)),
            _ => None,
        })
        .collect();
    let f16s = || -> Option<Vec<SegKv<half::f16>>> {
        segs.iter()
            .map(|g| match (&g.kv.k, &g.kv.v) {
                (KvBuf::F16(k), KvBuf::F16(v)) => Some(SegKv::new(g, k, v)),
                _ => None,
            })
            .collect()
    };
    match f32s.ok_or_else(f16s) {
        Ok(all) => attention(pool, &shape, &all, q, att, &mut s.scores),
        Err(Some(all)) => attention(pool, &shape, &all, q, att, &mut s.scores),
        // Caches of both types in one batch: a pass per sequence.
        Err(None) => {
            for g in segs.iter() {
                match (&g.kv.k, &g.kv.v) {
                    (KvBuf::F32(k), KvBuf::F32(v)) => {
                        let one = [SegKv::new(g, &k[..], &v[..])];
                        attention(pool, &shape, &one, q, att, &mut s.scores)
                    }
                    (KvBuf::F16(k), KvBuf::F16(v)) => {
                        let one = [SegKv::new(g, &k[..], &v[..])];
                        attention(pool, &shape, &one, q, att, &mut s.scores)
                    }
                    _ => unreachable!("K and V buffers share one type"),
                }
            }
        }
    }
}

/// One sequence's rows within a multi-sequence batch, and its cache for the current layer.
pub(super) struct Seg<'a> {
    pub(super) row: usize,
    pub(super) n: usize,
    pub(super) pos: usize,
    pub(super) kv: &'a mut LayerKv,
}

/// The attention shape shared by every sequence of a batch.
struct AttnShape<'a> {
    n_head: usize,
    group: usize,
    head_dim: usize,
    qd: usize,
    kvd: usize,
    scale: f32,
    softcap: Option<f32>,
    /// One sink logit per query head (gpt-oss): it joins the head's softmax as one more
    /// score, whose probability is dropped (the score buffers have room for it).
    sinks: Option<&'a [f32]>,
    scores_stride: usize,
}

/// One sequence of a batch for attention: its rows (`row..row + n`, at positions
/// `pos..pos + n`) and its cache for the current layer.
struct SegKv<'a, E> {
    row: usize,
    n: usize,
    pos: usize,
    kv: &'a LayerKv,
    k: &'a [E],
    v: &'a [E],
}

impl<'a, E> SegKv<'a, E> {
    fn new(g: &'a Seg<'_>, k: &'a [E], v: &'a [E]) -> SegKv<'a, E> {
        SegKv {
            row: g.row,
            n: g.n,
            pos: g.pos,
            kv: &*g.kv,
            k,
            v,
        }
    }
}

/// Query heads of one KV head a work item takes together: they share every key and value
/// row, so each is loaded once for up to this many heads (`scores` holds this many rows of
/// `scores_stride` per thread).
pub(super) const ATT_HEADS: usize = 4;

/// Row `g` of the scores (`len` of them), and the sink logit of its head (`h0 + g`) after
/// them when the layer has sinks: the slice to normalize.
fn row_with_sink<'s>(
    scores: &'s mut [f32],
    g: usize,
    stride: usize,
    len: usize,
    sinks: Option<&[f32]>,
    h0: usize,
) -> &'s mut [f32] {
    match sinks {
        Some(sk) => {
            scores[g * stride + len] = sk[h0 + g];
            &mut scores[g * stride..g * stride + len + 1]
        }
        None => &mut scores[g * stride..g * stride + len],
    }
}

/// Causal attention of `n` queries (positions `pos..pos+n`) over the cache, one work item per
/// (token, KV head, block of up to `ATT_HEADS` of its query heads).
fn attention<E: KvElem>(
    pool: &ThreadPool,
    a: &AttnShape,
    segs: &[SegKv<E>],
    q: &[f32],
    att: &mut [f32],
    scores: &mut [f32],
) {
    let n_kv = a.n_head / a.group;
    let blocks = a.group.div_ceil(ATT_HEADS);
    let per_token = n_kv * blocks;
    let total: usize = segs.iter().map(|g| g.n * per_token).sum();
    let items = Chunks::new(total, 1);
    let out = SharedMut::new(att);
    let sc = SharedMut::new(scores);
    let (hd, stride) = (a.head_dim, a.scores_stride);
    pool.run(&|tid| {
        // SAFETY: each thread uses only its own rows of the score buffer.
        let scores = unsafe { sc.slice(tid * ATT_HEADS * stride..(tid + 1) * ATT_HEADS * stride) };
        while let Some(r) = items.next_range() {
            for item in r {
                // The sequence holding this item, then (token, KV head, block) within it.
                let (mut g, mut item) = (0, item);
                while item >= segs[g].n * per_token {
                    item -= segs[g].n * per_token;
                    g += 1;
                }
                let seg = &segs[g];
                let t = item / per_token;
                let (kvh, b) = ((item / blocks) % n_kv, item % blocks);
                let h0 = kvh * a.group + b * ATT_HEADS;
                let nq = ATT_HEADS.min(a.group - b * ATT_HEADS);
                let row = seg.row + t;
                let qh = &q[row * a.qd + h0 * hd..row * a.qd + (h0 + nq) * hd];
                let kv = seg.kv;
                let vis = kv.visible(seg.pos + t);
                let len = vis.len();
                // The visible positions as runs of consecutive ring slots (two at most).
                let runs = || {
                    let mut p = vis.start;
                    std::iter::from_fn(move || {
                        (p < vis.end).then(|| {
                            let s = kv.slot(p);
                            let run = (vis.end - p).min(kv.cap - s);
                            let j = p - vis.start;
                            p += run;
                            (j, s * a.kvd + kvh * hd, run)
                        })
                    })
                };
                // The weights stream this sequence's keys and values out of cache between
                // steps, in rows `kvd` apart: ask for all of them at once.
                for (_, base, run) in runs() {
                    for p in 0..run {
                        let at = base + p * a.kvd;
                        ops::prefetch(&seg.k[at..at + hd]);
                        ops::prefetch(&seg.v[at..at + hd]);
                    }
                }
                for (j, base, run) in runs() {
                    let k = &seg.k[base..base + (run - 1) * a.kvd + hd];
                    E::qk(qh, nq, hd, k, a.kvd, run, a.scale, &mut scores[j..], stride);
                }
                if let Some(c) = a.softcap {
                    for g in 0..nq {
                        for s in &mut scores[g * stride..g * stride + len] {
                            *s = c * (*s / c).tanh();
                        }
                    }
                }
                if kv.any_skipped() {
                    // Positions whose token skipped this layer hold no key: left out exactly
                    // (weight 0), and a query that sees none at all gets a zero output.
                    let mut live = 0;
                    for (j, p) in (vis.start..vis.end).enumerate() {
                        if kv.is_skipped(kv.slot(p)) {
                            for g in 0..nq {
                                scores[g * stride + j] = f32::NEG_INFINITY;
                            }
                        } else {
                            live += 1;
                        }
                    }
                    for g in 0..nq {
                        if live == 0 {
                            scores[g * stride..g * stride + len].fill(0.0);
                            continue;
                        }
                        ops::softmax_fast(row_with_sink(scores, g, stride, len, a.sinks, h0));
                        let row = &mut scores[g * stride..g * stride + len];
                        for (j, p) in (vis.start..vis.end).enumerate() {
                            if kv.is_skipped(kv.slot(p)) {
                                row[j] = 0.0;
                            }
                        }
                    }
                } else {
                    for g in 0..nq {
                        ops::softmax_fast(row_with_sink(scores, g, stride, len, a.sinks, h0));
                    }
                }
                // SAFETY: the output rows of (row, heads h0..h0 + nq) belong to this item.
                let o = unsafe { out.slice(row * a.qd + h0 * hd..row * a.qd + (h0 + nq) * hd) };
                o.fill(0.0);
                for (j, base, run) in runs() {
                    let v = &seg.v[base..base + (run - 1) * a.kvd + hd];
                    E::pv(&scores[j..], stride, nq, v, a.kvd, run, hd, o);
                }
            }
        }
    });
}
