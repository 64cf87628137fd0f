//! The forward pass over a model's loaded layers: embedding, repeating blocks, output head.
//! One `Runner` per thread of control; it owns the thread pool and every scratch buffer, so
//! the per-token loop allocates nothing.

use crate::arch::FfnAct;
use crate::backend::{Batch, LayerBackend};
use crate::error::ModelError;
use crate::kv::{KvBuf, KvCache, KvElem, LayerKv};
use crate::model::{Layer, Model};
use crate::skip::{cosine, SkipPolicy, SkipStats};
use crate::stream::LayerGuard;
use ringllm_kernels::matmul::{matmul, matmul_many, ActBuffer, MatJob};
use ringllm_kernels::ops;
use ringllm_kernels::pool::{Chunks, SharedMut};
use ringllm_kernels::ThreadPool;
use std::sync::Arc;

/// Called after each layer with (layer index, residual stream `[n × d]`).
pub type LayerObserver<'a> = &'a mut dyn FnMut(usize, &[f32]);

/// Scratch for one batch of up to `max_batch` tokens.
struct Scratch {
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// Attention scores, `ATT_HEADS` rows of `scores_stride` per thread.
    scores: Vec<f32>,
    /// RoPE (cos, sin) per token of the batch, for local (sliding-window) and global layers:
    /// filled once per batch, not per layer.
    rope_local: Vec<(f32, f32)>,
    rope_global: Vec<(f32, f32)>,
    /// The position of each row of the batch.
    pos: Vec<usize>,
    acts: ActBuffer,
}

pub struct Runner {
    pub model: Arc<Model>,
    pool: ThreadPool,
    max_batch: usize,
    scores_stride: usize,
    scratch: Scratch,
    /// Inverse RoPE frequencies for local and global layers.
    inv_freq_local: Vec<f32>,
    inv_freq_global: Vec<f32>,
    /// Predictive layer skip (`set_skip`); `None`: every layer runs for every token.
    skip: Option<SkipPolicy>,
    skip_state: SkipState,
    on_skip_plan: Option<SkipPlanHook>,
    /// The backend running the layers and the head when it is not the CPU
    /// ([`crate::backend`]); the embedding and the final norm stay on the CPU.
    backend: Option<Box<dyn LayerBackend>>,
}

/// Called at the decision point with the plan of the batch (`Runner::set_on_skip_plan`).
pub type SkipPlanHook = Box<dyn FnMut(usize, &[bool]) + Send>;

/// What the forward pass decided for one (token, layer).
const RUN: u8 = 0;
const SKIP: u8 = 1;
/// Run, though the predictor leaned to skipping (0.5 ≤ p < confidence): its real cosine is
/// measured and logged.
const DOUBT: u8 = 2;

/// The skip decisions of the current batch and the buffers they need.
#[derive(Default)]
struct SkipState {
    /// Index within the slice of the layer before which decisions are made.
    decide_at: Option<usize>,
    /// Per layer of the slice: every token of the batch skips it (decided at `decide_at`).
    plan: Vec<bool>,
    /// `n × layers of the slice`: RUN, SKIP or DOUBT.
    rows: Vec<u8>,
    /// Decisions exist for the current batch.
    active: bool,
    /// This layer's decision per row of the batch (SKIP rows are restored after it).
    row_skip: Vec<bool>,
    feats: Vec<f32>,
    /// Residual rows saved before a layer some rows skip or doubt.
    saved: Vec<f32>,
    stats: SkipStats,
}

impl Runner {
    /// Bytes `Runner::new` allocates for its scratch buffers (an upper bound; saturating, so
    /// absurd settings give a huge number rather than an overflow). `limits::check_runner`
    /// compares it with the memory available before a runner is built.
    pub fn scratch_bytes(
        hp: &crate::arch::Hparams,
        threads: usize,
        max_batch: usize,
        max_ctx: usize,
    ) -> u64 {
        let mb = max_batch.max(1) as u64;
        let widest = hp.d_model.max(hp.q_dim()).max(hp.d_ff) as u64;
        let per_token = (2 * hp.d_model + 2 * hp.q_dim() + 2 * hp.kv_dim() + 2 * hp.d_ff) as u64
            * 4
            + (hp.rope_dim / 2) as u64 * 16
            + 8
            // Quantized activations: at most 4 bytes per value whatever the block format.
            + widest * 4;
        mb.saturating_mul(per_token).saturating_add(
            (threads.max(1) as u64).saturating_mul(ATT_HEADS as u64 * max_ctx.max(1) as u64 * 4),
        )
    }

    /// A runner for `model` with `threads` threads, batches up to `max_batch` tokens and
    /// contexts up to `max_ctx` positions. Settings from a user or a peer go through
    /// `limits::check_runner` first: this allocates what they ask for.
    pub fn new(model: Arc<Model>, threads: usize, max_batch: usize, max_ctx: usize) -> Runner {
        let hp = &model.hp;
        let mb = max_batch.max(1);
        let pool = ThreadPool::new(threads);
        let mut acts = ActBuffer::new();
        acts.reserve(hp.d_model.max(hp.q_dim()).max(hp.d_ff), mb);
        let scores_stride = max_ctx.max(1);
        let scratch = Scratch {
            xn: vec![0.0; mb * hp.d_model],
            q: vec![0.0; mb * hp.q_dim()],
            k: vec![0.0; mb * hp.kv_dim()],
            v: vec![0.0; mb * hp.kv_dim()],
            att: vec![0.0; mb * hp.q_dim()],
            o: vec![0.0; mb * hp.d_model],
            gate: vec![0.0; mb * hp.d_ff],
            up: vec![0.0; mb * hp.d_ff],
            scores: vec![0.0; pool.n_threads() * ATT_HEADS * scores_stride],
            rope_local: vec![(0.0, 0.0); mb * (hp.rope_dim / 2)],
            rope_global: vec![(0.0, 0.0); mb * (hp.rope_dim / 2)],
            pos: vec![0; mb],
            acts,
        };
        let mut inv_freq_local = ops::rope_inv_freq(hp.rope_base_local, hp.rope_dim);
        let mut inv_freq_global = ops::rope_inv_freq(hp.rope_base, hp.rope_dim);
        if let Some(f) = &model.rope_freqs {
            for (v, d) in inv_freq_global
                .iter_mut()
                .chain(inv_freq_local.iter_mut())
                .zip(f.iter().cycle())
            {
                *v /= d;
            }
        }
        for v in inv_freq_global.iter_mut() {
            *v /= hp.rope_scale;
        }
        Runner {
            model,
            pool,
            max_batch: mb,
            scores_stride,
            scratch,
            inv_freq_local,
            inv_freq_global,
            skip: None,
            skip_state: SkipState::default(),
            on_skip_plan: None,
            backend: None,
        }
    }

    /// Runs the layers and the head on `backend` from now on (`None`: the CPU). Caches made
    /// before belong to the old backend and are refused by the new one. Refused with
    /// predictive layer skip on, or with layers streamed from disk: neither runs off the CPU.
    pub fn set_backend(
        &mut self,
        backend: Option<Box<dyn LayerBackend>>,
    ) -> Result<(), ModelError> {
        if backend.is_some() {
            if self.skip.is_some() {
                return Err(ModelError::Backend(
                    "predictive layer skip runs on the CPU backend only".into(),
                ));
            }
            if self.model.streamer.is_some() {
                return Err(ModelError::Backend(
                    "layers streamed from disk run on the CPU backend only".into(),
                ));
            }
        }
        self.backend = backend;
        Ok(())
    }

    /// "cpu", or the backend's description ("gpu: <adapter>").
    pub fn backend_name(&self) -> String {
        match &self.backend {
            None => "cpu".into(),
            Some(b) => b.describe(),
        }
    }

    /// True when the layers run on the CPU.
    pub fn on_cpu(&self) -> bool {
        self.backend.is_none()
    }

    /// Turns predictive layer skip on (`Some`) or off. The decision point is the first layer
    /// of this runner's slice when that is not layer 0 (a node of a ring sees only the state
    /// entering its window), else the predictor's decision layer. Refuses a predictor made
    /// for a model of another shape.
    pub fn set_skip(&mut self, policy: Option<SkipPolicy>) -> Result<(), ModelError> {
        let st = &mut self.skip_state;
        st.decide_at = None;
        st.active = false;
        let Some(pol) = policy else {
            self.skip = None;
            return Ok(());
        };
        if self.backend.is_some() {
            return Err(ModelError::SkipPredictor {
                why: "predictive layer skip runs on the CPU backend only".into(),
            });
        }
        let hp = &self.model.hp;
        let pm = &pol.predictor.model;
        if pm.n_layer != hp.n_layer || pm.d_model != hp.d_model {
            return Err(ModelError::SkipPredictor {
                why: format!(
                    "made for {} layers of width {}, this model has {} of width {}",
                    pm.n_layer, pm.d_model, hp.n_layer, hp.d_model
                ),
            });
        }
        let range = self.model.layer_range.clone();
        let e = if range.start > 0 {
            range.start
        } else {
            pol.predictor.decision_layer
        };
        st.decide_at = (e < range.end).then(|| e - range.start);
        let nl = range.len();
        st.plan = vec![false; nl];
        st.rows = vec![RUN; self.max_batch * nl];
        st.row_skip = vec![false; self.max_batch];
        st.feats = vec![0.0; pol.predictor.rank];
        st.saved = vec![0.0; self.max_batch * hp.d_model];
        self.skip = Some(pol);
        Ok(())
    }

    /// The skip policy in use.
    pub fn skip_policy(&self) -> Option<&SkipPolicy> {
        self.skip.as_ref()
    }

    /// Counters of skipping since the runner was made or `reset_skip_stats`.
    pub fn skip_stats(&self) -> SkipStats {
        self.skip_state.stats
    }

    pub fn reset_skip_stats(&mut self) {
        self.skip_state.stats = SkipStats::default();
    }

    /// The plan of the current batch: `plan[k]` is true when every token of the batch skips
    /// layer `layer_range.start + k`, so that layer is not run (its weights not read). Set at
    /// the decision point, before any layer it covers runs; all false before the decision
    /// point, without skip, or for layers nobody skips.
    pub fn skip_plan(&self) -> &[bool] {
        &self.skip_state.plan
    }

    /// Calls `hook(first, plan)` at each batch's decision point, before the layers of the
    /// plan run: `plan[k]` is true when layer `first + k` will not run at all for this batch
    /// (see `skip_plan`). For a streaming reader: layers it need not fetch.
    pub fn set_on_skip_plan(&mut self, hook: Option<SkipPlanHook>) {
        self.on_skip_plan = hook;
    }

    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    pub fn threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// A KV cache for this runner's layers.
    pub fn new_cache(&self, ctx: usize, ty: crate::kv::KvType) -> KvCache {
        let make = if self.backend.is_some() {
            KvCache::new_device
        } else {
            KvCache::new
        };
        make(
            &self.model.hp,
            self.model.layer_range.clone(),
            ctx.min(self.scores_stride),
            self.max_batch,
            ty,
        )
    }

    /// Embeds `tokens` into `x` (`[n × d]`), scaled as the architecture asks.
    pub fn embed(&self, tokens: &[u32], x: &mut [f32]) -> Result<(), ModelError> {
        let m = &*self.model;
        let d = m.hp.d_model;
        let w = m
            .tok_embd
            .as_ref()
            .ok_or_else(|| self.not_in_slice("token embedding"))?;
        for (i, &t) in tokens.iter().enumerate() {
            if t as usize >= m.hp.vocab {
                return Err(ModelError::BadToken {
                    id: t,
                    vocab: m.hp.vocab,
                });
            }
            let row = &mut x[i * d..(i + 1) * d];
            m.matrix(w).dequantize_row(t as usize, row);
            if let Some(s) = m.hp.embd_scale {
                for v in row.iter_mut() {
                    *v *= s;
                }
            }
        }
        Ok(())
    }

    /// Runs this runner's layers on `n` tokens at positions `kv.len..kv.len + n`, in place on
    /// the residual stream `x` (`[n × d]`), and advances the cache.
    pub fn layers(
        &mut self,
        x: &mut [f32],
        n: usize,
        kv: &mut KvCache,
        observer: Option<LayerObserver<'_>>,
    ) -> Result<(), ModelError> {
        self.layers_multi(x, &mut [(kv, n)], observer)
    }

    /// Runs this runner's layers on several sequences at once: `parts[i]` is a sequence's
    /// cache and how many of its tokens `x` holds, in order (rows of `x` follow `parts`). The
    /// matrix products see every row together; attention, RoPE and the KV writes are per
    /// sequence. Every cache advances by its token count.
    pub fn layers_multi(
        &mut self,
        x: &mut [f32],
        parts: &mut [(&mut KvCache, usize)],
        mut observer: Option<LayerObserver<'_>>,
    ) -> Result<(), ModelError> {
        let n: usize = parts.iter().map(|p| p.1).sum();
        for (kv, k) in parts.iter() {
            if kv.len + k > kv.ctx {
                return Err(ModelError::ContextFull {
                    pos: kv.len,
                    n: *k,
                    ctx: kv.ctx,
                });
            }
            if kv.layers.len() != self.model.layers.len() {
                return Err(ModelError::CacheMismatch {
                    cache: kv.layers.len(),
                    slice: self.model.layers.len(),
                });
            }
            if kv.device_only != self.backend.is_some() {
                return Err(ModelError::Backend(format!(
                    "a KV cache made for the {} backend used on {}",
                    if kv.device_only { "GPU" } else { "CPU" },
                    self.backend_name()
                )));
            }
        }
        if n > self.max_batch {
            return Err(ModelError::BatchTooLarge {
                n,
                max: self.max_batch,
            });
        }
        if n == 0 {
            return Ok(());
        }
        let model = Arc::clone(&self.model);
        let d = model.hp.d_model;
        self.rope_tables(parts, n);
        if let Some(be) = self.backend.as_mut() {
            let half = model.hp.rope_dim / 2;
            let s = &self.scratch;
            let batch = Batch {
                pos: &s.pos[..n],
                rope_local: &s.rope_local[..n * half],
                rope_global: &s.rope_global[..n * half],
            };
            be.layers(&model, &mut x[..n * d], parts, &batch, observer)?;
            for (kv, k) in parts.iter_mut() {
                kv.len += *k;
            }
            return Ok(());
        }
        if self.skip.is_some() {
            self.skip_state.active = false;
            self.skip_state.plan.fill(false);
        }
        for (i, layer) in model.layers.iter().enumerate() {
            let il = model.layer_range.start + i;
            if self.skip.is_some() && self.skip_state.decide_at == Some(i) {
                self.plan_skips(&x[..n * d], n, i);
                if let Some(st) = &model.streamer {
                    for (k, _) in self.skip_state.plan.iter().enumerate().filter(|p| *p.1) {
                        st.skip(model.layer_range.start + k);
                    }
                }
            }
            let mut segs: Vec<Seg> = Vec::with_capacity(parts.len());
            let mut row = 0;
            for (kv, k) in parts.iter_mut() {
                let pos = kv.len;
                segs.push(Seg {
                    row,
                    n: *k,
                    pos,
                    kv: &mut kv.layers[i],
                });
                row += *k;
            }
            // A layer every row of the batch skips is not run: its streamed bytes are not
            // needed (the streamer was told at the decision point, before it read them).
            let not_run = self.skip_state.active && self.skip_state.plan[i];
            let streamed = match &model.streamer {
                Some(st) if st.streams(il) && !not_run => {
                    Some(st.acquire(il).map_err(|e| ModelError::Stream {
                        layer: il,
                        why: e.to_string(),
                    })?)
                }
                _ => None,
            };
            if self.skip_state.active {
                self.layer_with_skips(
                    &model,
                    il,
                    i,
                    layer,
                    streamed.as_ref(),
                    &mut x[..n * d],
                    n,
                    &mut segs,
                );
            } else {
                if self.skip.is_some() {
                    self.skip_state.stats.evaluations += n as u64;
                }
                self.layer(
                    &model,
                    il,
                    layer,
                    streamed.as_ref(),
                    &mut x[..n * d],
                    n,
                    &mut segs,
                    None,
                );
            }
            drop(streamed);
            if let Some(obs) = observer.as_mut() {
                obs(il, &x[..n * d]);
            }
        }
        for (kv, k) in parts.iter_mut() {
            kv.len += *k;
        }
        Ok(())
    }

    /// The decisions for layers `i..` of the slice (state `x` entering layer `i`), per row:
    /// skip where P(skip) ≥ confidence, at most `max_skip` layers in a row, never at position
    /// 0; then the batch's plan and its hook.
    fn plan_skips(&mut self, x: &[f32], n: usize, i: usize) {
        let Some(pol) = self.skip.as_ref() else {
            return;
        };
        let m = &self.model;
        let (d, nl, start) = (m.hp.d_model, m.layers.len(), m.layer_range.start);
        let st = &mut self.skip_state;
        let pred = &pol.predictor;
        for r in 0..n {
            let rows = &mut st.rows[r * nl..(r + 1) * nl];
            rows.fill(RUN);
            // A sequence's first token is the attention sink every later token leans on (its
            // state barely changes, yet masking its keys hurts every later token): it always
            // runs every layer.
            if self.scratch.pos[r] == 0 {
                continue;
            }
            if pol.force.is_none() {
                pred.features(&x[r * d..(r + 1) * d], &mut st.feats);
            }
            let mut run = 0;
            for (j, cell) in rows.iter_mut().enumerate().skip(i) {
                let p = match &pol.force {
                    Some(f) => f32::from(u8::from(f(self.scratch.pos[r], start + j))),
                    None => pred.prob(&st.feats, start + i, start + j),
                };
                if p >= pol.confidence && run < pol.max_skip {
                    *cell = SKIP;
                    run += 1;
                } else {
                    run = 0;
                    if p >= 0.5 && p < pol.confidence {
                        *cell = DOUBT;
                    }
                }
            }
        }
        for (j, all) in st.plan.iter_mut().enumerate() {
            *all = j >= i && (0..n).all(|r| st.rows[r * nl + j] == SKIP);
        }
        st.active = true;
        if let Some(hook) = self.on_skip_plan.as_mut() {
            hook(start, &st.plan);
        }
    }

    /// Layer `il` (index `i` of the slice) with this batch's decisions: not run at all when
    /// every row skips it (their KV slots marked as holding nothing); else run, with the
    /// skipping rows' slots marked before attention and their residual rows restored after.
    #[allow(clippy::too_many_arguments)]
    fn layer_with_skips(
        &mut self,
        m: &Model,
        il: usize,
        i: usize,
        l: &Layer,
        buf: Option<&LayerGuard<'_>>,
        x: &mut [f32],
        n: usize,
        segs: &mut [Seg<'_>],
    ) {
        let d = m.hp.d_model;
        let nl = m.layers.len();
        let st = &mut self.skip_state;
        st.stats.evaluations += n as u64;
        let cell = |r: usize| st.rows[r * nl + i];
        let skipped = (0..n).filter(|&r| cell(r) == SKIP).count();
        st.stats.skipped += skipped as u64;
        st.stats.skipped_weight_bytes += (skipped * l.weight_bytes()) as u64;
        if st.plan[i] {
            for seg in segs.iter_mut() {
                for t in 0..seg.n {
                    let slot = seg.kv.slot(seg.pos + t);
                    seg.kv.mark_skipped(slot);
                }
            }
            st.stats.layers_not_run += 1;
            st.stats.bytes_not_read += l.weight_bytes() as u64;
            return;
        }
        for r in (0..n).filter(|&r| cell(r) != RUN) {
            st.saved[r * d..(r + 1) * d].copy_from_slice(&x[r * d..(r + 1) * d]);
        }
        let mut row_skip = std::mem::take(&mut st.row_skip);
        for (r, s) in row_skip[..n].iter_mut().enumerate() {
            *s = cell(r) == SKIP;
        }
        self.layer(
            m,
            il,
            l,
            buf,
            x,
            n,
            segs,
            (skipped > 0).then_some(&row_skip[..n]),
        );
        let st = &mut self.skip_state;
        st.row_skip = row_skip;
        for r in (0..n).filter(|&r| st.rows[r * nl + i] != RUN) {
            let before = &st.saved[r * d..(r + 1) * d];
            if st.rows[r * nl + i] == SKIP {
                x[r * d..(r + 1) * d].copy_from_slice(before);
            } else {
                st.stats.doubted += 1;
                let c = cosine(before, &x[r * d..(r + 1) * d]);
                tracing::debug!(
                    layer = il,
                    pos = self.scratch.pos[r],
                    cos = c,
                    "layer run although the skip predictor leaned to skipping it"
                );
            }
        }
    }

    /// The RoPE (cos, sin) of every row of the batch, for each kind of layer this slice has.
    fn rope_tables(&mut self, parts: &[(&mut KvCache, usize)], n: usize) {
        let m = &self.model;
        let half = m.hp.rope_dim / 2;
        let s = &mut self.scratch;
        let mut row = 0;
        for (kv, k) in parts {
            for t in 0..*k {
                s.pos[row] = kv.len + t;
                row += 1;
            }
        }
        let kinds = [
            (true, &self.inv_freq_local, &mut s.rope_local),
            (false, &self.inv_freq_global, &mut s.rope_global),
        ];
        for (sliding, inv, table) in kinds {
            if !m.layer_range.clone().any(|il| m.hp.sliding[il] == sliding) {
                continue;
            }
            let table = SharedMut::new(&mut table[..n * half]);
            let pos = &s.pos[..n];
            self.pool.for_ranges(n, ROWS_PER_CHUNK, &|rows| {
                for t in rows {
                    // SAFETY: row t's entries are written by this call alone.
                    let cs = unsafe { table.slice(t * half..(t + 1) * half) };
                    ops::rope_cos_sin(pos[t], inv, cs);
                }
            });
        }
    }

    /// One layer on the batch. `skip_rows[r]`: row `r` skips this layer, so its key and
    /// value are not stored (its slot is marked as holding nothing; the caller restores its
    /// residual row). A streamed layer's weights are read from `buf`.
    #[allow(clippy::too_many_arguments)]
    fn layer(
        &mut self,
        m: &Model,
        il: usize,
        l: &Layer,
        buf: Option<&LayerGuard<'_>>,
        x: &mut [f32],
        n: usize,
        segs: &mut [Seg<'_>],
        skip_rows: Option<&[bool]>,
    ) {
        let hp = &m.hp;
        let (d, qd, kvd, hd, ff) = (hp.d_model, hp.q_dim(), hp.kv_dim(), hp.head_dim, hp.d_ff);
        let eps = hp.rms_eps;
        let s = &mut self.scratch;
        let pool = &self.pool;

        // Attention block.
        norm_rows(pool, x, &l.attn_norm, eps, &mut s.xn[..n * d]);
        let xn = &s.xn[..n * d];
        matmul_many(
            pool,
            &mut [
                MatJob {
                    w: m.matrix_in(&l.wq, buf),
                    out: &mut s.q[..n * qd],
                },
                MatJob {
                    w: m.matrix_in(&l.wk, buf),
                    out: &mut s.k[..n * kvd],
                },
                MatJob {
                    w: m.matrix_in(&l.wv, buf),
                    out: &mut s.v[..n * kvd],
                },
            ],
            xn,
            n,
            &mut s.acts,
        );
        // Per row: biases, QK-norm, RoPE (rows split among the threads for a batch).
        let half = hp.rope_dim / 2;
        let rope = if hp.sliding[il] {
            &s.rope_local[..n * half]
        } else {
            &s.rope_global[..n * half]
        };
        let (qs, ks, vs) = (
            SharedMut::new(&mut s.q[..n * qd]),
            SharedMut::new(&mut s.k[..n * kvd]),
            SharedMut::new(&mut s.v[..n * kvd]),
        );
        pool.for_ranges(n, ROWS_PER_CHUNK, &|rows| {
            for t in rows {
                // SAFETY: row t of q, k and v is touched by this call alone.
                let (q, k, v) = unsafe {
                    (
                        qs.slice(t * qd..(t + 1) * qd),
                        ks.slice(t * kvd..(t + 1) * kvd),
                        vs.slice(t * kvd..(t + 1) * kvd),
                    )
                };
                for (buf, bias) in [(&mut *q, &l.bq), (&mut *k, &l.bk), (&mut *v, &l.bv)] {
                    if let Some(b) = bias {
                        ops::add_inplace(buf, b);
                    }
                }
                if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                    ops::rms_norm_rows_inplace(q, qn, eps);
                    ops::rms_norm_rows_inplace(k, kn, eps);
                }
                let cs = &rope[t * half..(t + 1) * half];
                for head in q.chunks_exact_mut(hd).chain(k.chunks_exact_mut(hd)) {
                    ops::rope_apply(head, cs, hp.rope_style);
                }
            }
        });
        for seg in segs.iter_mut() {
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
            group: hp.n_head / hp.n_head_kv,
            head_dim: hd,
            qd,
            kvd,
            scale: hp.query_scale,
            scores_stride: self.scores_stride,
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
        matmul(
            pool,
            &m.matrix_in(&l.wo, buf),
            &s.att[..n * qd],
            n,
            &mut s.o[..n * d],
            &mut s.acts,
        );
        add_rows(
            pool,
            d,
            x,
            &mut s.o[..n * d],
            l.post_attn_norm.as_deref(),
            eps,
        );

        // Feed-forward block.
        norm_rows(pool, x, &l.ffn_norm, eps, &mut s.xn[..n * d]);
        let xn = &s.xn[..n * d];
        matmul_many(
            pool,
            &mut [
                MatJob {
                    w: m.matrix_in(&l.gate, buf),
                    out: &mut s.gate[..n * ff],
                },
                MatJob {
                    w: m.matrix_in(&l.up, buf),
                    out: &mut s.up[..n * ff],
                },
            ],
            xn,
            n,
            &mut s.acts,
        );
        let act: fn(&mut [f32], &[f32]) = match hp.ffn_act {
            FfnAct::Silu => ops::glu_silu,
            FfnAct::GeluTanh => ops::glu_gelu_tanh,
        };
        glu_parallel(pool, &mut s.gate[..n * ff], &s.up[..n * ff], act);
        matmul(
            pool,
            &m.matrix_in(&l.down, buf),
            &s.gate[..n * ff],
            n,
            &mut s.o[..n * d],
            &mut s.acts,
        );
        add_rows(
            pool,
            d,
            x,
            &mut s.o[..n * d],
            l.post_ffw_norm.as_deref(),
            eps,
        );
    }

    fn not_in_slice(&self, what: &'static str) -> ModelError {
        ModelError::NotInSlice {
            what,
            layers: self.model.layer_range.clone(),
        }
    }

    /// Final norm of `n` rows of `x`, in place.
    pub fn final_norm(&self, x: &mut [f32], n: usize) -> Result<(), ModelError> {
        let m = &*self.model;
        let d = m.hp.d_model;
        let w = m
            .output_norm
            .as_ref()
            .ok_or_else(|| self.not_in_slice("output norm"))?;
        ops::rms_norm_rows_inplace(&mut x[..n * d], w, m.hp.rms_eps);
        Ok(())
    }

    /// Logits `[n × vocab]` of `n` already-normed rows.
    pub fn logits(&mut self, xn: &[f32], n: usize, out: &mut [f32]) -> Result<(), ModelError> {
        let m = Arc::clone(&self.model);
        let w = m
            .output
            .as_ref()
            .ok_or_else(|| self.not_in_slice("output head"))?;
        let d = m.hp.d_model;
        let vocab = m.hp.vocab;
        if n * d > xn.len() {
            return Err(ModelError::BufferTooSmall {
                what: "logits input rows",
                len: xn.len(),
                need: n * d,
            });
        }
        if n * vocab > out.len() {
            return Err(ModelError::BufferTooSmall {
                what: "logits output",
                len: out.len(),
                need: n * vocab,
            });
        }
        if let Some(be) = self.backend.as_mut() {
            return be.logits(&m, &xn[..n * d], n, &mut out[..n * vocab]);
        }
        self.scratch.acts.reserve(d, n);
        matmul(
            &self.pool,
            &m.matrix(w),
            &xn[..n * d],
            n,
            &mut out[..n * vocab],
            &mut self.scratch.acts,
        );
        if let Some(cap) = m.hp.final_logit_softcap {
            for v in out[..n * vocab].iter_mut() {
                *v = cap * (*v / cap).tanh();
            }
        }
        Ok(())
    }

    /// Embedding, every loaded layer, final norm and logits of the last token: a whole step
    /// of a single-process model. `logits` gets `vocab` values.
    pub fn step(
        &mut self,
        tokens: &[u32],
        kv: &mut KvCache,
        x: &mut Vec<f32>,
        logits: &mut [f32],
    ) -> Result<(), ModelError> {
        let d = self.model.hp.d_model;
        let n = tokens.len();
        if x.len() < n * d {
            x.resize(n * d, 0.0);
        }
        self.embed(tokens, &mut x[..n * d])?;
        self.layers(&mut x[..n * d], n, kv, None)?;
        let last = &mut x[(n - 1) * d..n * d];
        self.final_norm(last, 1)?;
        self.logits(&x[(n - 1) * d..n * d], 1, logits)
    }
}

/// Rows per chunk of the row-wise passes (below this many rows a batch stays on the calling
/// thread: one token's norm or RoPE is far shorter than waking a thread).
const ROWS_PER_CHUNK: usize = 16;

/// RMSNorm of every `w.len()`-wide row of `x` into `out`, rows split among the threads.
fn norm_rows(pool: &ThreadPool, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    let o = SharedMut::new(out);
    pool.for_ranges(x.len() / d, ROWS_PER_CHUNK, &|rows| {
        // SAFETY: these rows of `out` are written by this call alone.
        let out = unsafe { o.slice(rows.start * d..rows.end * d) };
        ops::rms_norm_rows(&x[rows.start * d..rows.end * d], w, eps, out);
    });
}

/// The residual add `x += norm(y)` (`y` normed in place when the layer has a sandwich norm
/// `w`), row by row, rows split among the threads.
fn add_rows(
    pool: &ThreadPool,
    d: usize,
    x: &mut [f32],
    y: &mut [f32],
    w: Option<&[f32]>,
    eps: f32,
) {
    let n = y.len() / d.max(1);
    let (xs, ys) = (SharedMut::new(x), SharedMut::new(y));
    pool.for_ranges(n, ROWS_PER_CHUNK, &|rows| {
        // SAFETY: these rows of `x` and `y` are touched by this call alone.
        let (x, y) = unsafe {
            (
                xs.slice(rows.start * d..rows.end * d),
                ys.slice(rows.start * d..rows.end * d),
            )
        };
        if let Some(w) = w {
            ops::rms_norm_rows_inplace(y, w, eps);
        }
        ops::add_inplace(x, y);
    });
}

/// `gate = act(gate) * up`, split across the pool (GELU's tanh is not cheap at prefill sizes).
fn glu_parallel(pool: &ThreadPool, gate: &mut [f32], up: &[f32], glu: fn(&mut [f32], &[f32])) {
    const CHUNK: usize = 4096;
    let g = SharedMut::new(gate);
    pool.for_ranges(g.len(), CHUNK, &|range| {
        // SAFETY: each range is handed to one thread; ranges are disjoint.
        let part = unsafe { g.slice(range.clone()) };
        glu(part, &up[range]);
    });
}

/// One sequence's rows within a multi-sequence batch, and its cache for the current layer.
struct Seg<'a> {
    row: usize,
    n: usize,
    pos: usize,
    kv: &'a mut LayerKv,
}

/// The attention shape shared by every sequence of a batch.
struct AttnShape {
    n_head: usize,
    group: usize,
    head_dim: usize,
    qd: usize,
    kvd: usize,
    scale: f32,
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
const ATT_HEADS: usize = 4;

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
                        let row = &mut scores[g * stride..g * stride + len];
                        if live == 0 {
                            row.fill(0.0);
                            continue;
                        }
                        ops::softmax_fast(row);
                        for (j, p) in (vis.start..vis.end).enumerate() {
                            if kv.is_skipped(kv.slot(p)) {
                                row[j] = 0.0;
                            }
                        }
                    }
                } else {
                    for g in 0..nq {
                        ops::softmax_fast(&mut scores[g * stride..g * stride + len]);
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
