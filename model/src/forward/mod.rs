//! The forward pass over a model's loaded layers: embedding, repeating blocks, output head.
//! One `Runner` per thread of control; it owns the thread pool and every scratch buffer, so
//! the per-token loop allocates nothing.
//!
//! - `mod.rs` (here): the runner, the batch loop over layers, embedding, final norm, head.
//! - `layer.rs`: one layer on the CPU, walking the layer's recipe (`arch::recipe`) step by
//!   step; the GPU backend (`crate::gpu`) walks the same recipe.
//! - `attention.rs`: the KV store and causal attention over the cache.
//! - `skip.rs`: predictive layer skip (decisions, plans, the rows that skip a layer).

mod attention;
mod layer;
mod moe;
mod ple;
mod skip;

use crate::backend::{Batch, LayerBackend};
use crate::error::ModelError;
use crate::kv::KvCache;
use crate::model::Model;
use crate::skip::SkipPolicy;
use attention::{Seg, ATT_HEADS};
use layer::ROWS_PER_CHUNK;
use ringllm_kernels::matmul::{matmul, ActBuffer};
use ringllm_kernels::ops;
use ringllm_kernels::pool::SharedMut;
use ringllm_kernels::ThreadPool;
pub use skip::SkipPlanHook;
use skip::SkipState;
use std::sync::Arc;

/// What an observer is shown after one step of one layer: the rows of one of the step's
/// output buffers (`[n × width]`).
#[derive(Clone, Copy, Debug)]
pub struct Observed<'a> {
    /// The model's layer index.
    pub layer: usize,
    /// The step's name (`arch::Step::name`).
    pub step: &'static str,
    /// The buffer's name (`arch::recipe::Buf::name`): `x` is the residual stream.
    pub buf: &'static str,
    pub rows: &'a [f32],
    pub width: usize,
}

/// Watches a forward pass: each layer's output and, when it asks, every step's outputs.
/// Any `FnMut(layer, residual rows)` closure is an observer of layer outputs.
pub trait Observer {
    /// Called after each layer with (layer index, residual stream `[n × d]`).
    fn layer(&mut self, layer: usize, x: &[f32]);
    /// True to be shown every step's outputs too (`step`). On the GPU that reads each one
    /// back: for checks, not for speed.
    fn wants_steps(&self) -> bool {
        false
    }
    /// Called after each step of each layer, once per output buffer, when `wants_steps`.
    fn step(&mut self, _seen: &Observed<'_>) {}
}

impl<F: FnMut(usize, &[f32])> Observer for F {
    fn layer(&mut self, layer: usize, x: &[f32]) {
        self(layer, x)
    }
}

/// An observer of every step's outputs (layer outputs are the `ffn_residual` step's `x`).
pub struct StepObserver<F: FnMut(&Observed<'_>)>(pub F);

impl<F: FnMut(&Observed<'_>)> Observer for StepObserver<F> {
    fn layer(&mut self, _layer: usize, _x: &[f32]) {}
    fn wants_steps(&self) -> bool {
        true
    }
    fn step(&mut self, seen: &Observed<'_>) {
        (self.0)(seen)
    }
}

/// The observer a forward pass is given, if any.
pub type LayerObserver<'a> = &'a mut dyn Observer;

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
    /// Gemma 4: the batch's per-layer embedding inputs, `[n × n_layer × ple]` (copied in
    /// from `Runner::ple_inputs` for a `layers` call), and one layer's gated input.
    ple_in: Vec<f32>,
    ple: Vec<f32>,
    /// Attention scores, `ATT_HEADS` rows of `scores_stride` per thread.
    scores: Vec<f32>,
    /// RoPE (cos, sin) per token of the batch, for local (sliding-window) and global layers:
    /// filled once per batch, not per layer.
    rope_local: Vec<(f32, f32)>,
    rope_global: Vec<(f32, f32)>,
    /// The position of each row of the batch.
    pos: Vec<usize>,
    acts: ActBuffer,
    /// A mixture-of-experts layer's routing and per-expert buffers.
    moe: moe::MoeScratch,
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
    /// Gemma 4: the per-layer embedding inputs `embed` made for the next `layers` call.
    ple_inputs: std::sync::Mutex<ple::PleInputs>,
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
        let (qd, kvd, ff) = (hp.max_q_dim(), hp.max_kv_dim(), hp.max_d_ff());
        let widest = hp.d_model.max(qd).max(ff).max(hp.n_layer * hp.ple_dim) as u64;
        let ple = (hp.n_layer + 1) * hp.ple_dim;
        let per_token = (2 * hp.d_model + 2 * qd + 2 * kvd + 2 * ff + ple) as u64 * 4
            + ((hp.rope_dim + hp.rope_dim_local) / 2) as u64 * 8
            + 8
            // Quantized activations: at most 4 bytes per value whatever the block format.
            + widest * 4
            + moe::MoeScratch::bytes_per_row(hp.moe, hp.d_model);
        mb.saturating_mul(per_token).saturating_add(
            (threads.max(1) as u64)
                .saturating_mul(ATT_HEADS as u64 * (max_ctx.max(1) as u64 + 1) * 4),
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
        let (qd, kvd, ff) = (hp.max_q_dim(), hp.max_kv_dim(), hp.max_d_ff());
        acts.reserve(hp.d_model.max(qd).max(ff).max(hp.ple_dim), mb);
        // One more than the context: a layer with attention sinks puts its head's sink logit
        // after the scores.
        let scores_stride = max_ctx.max(1) + 1;
        let ple_in = if model.ple.is_some() {
            mb * hp.n_layer * hp.ple_dim
        } else {
            0
        };
        let scratch = Scratch {
            xn: vec![0.0; mb * hp.d_model],
            q: vec![0.0; mb * qd],
            k: vec![0.0; mb * kvd],
            v: vec![0.0; mb * kvd],
            att: vec![0.0; mb * qd],
            o: vec![0.0; mb * hp.d_model],
            gate: vec![0.0; mb * ff],
            up: vec![0.0; mb * ff],
            ple_in: vec![0.0; ple_in],
            ple: vec![0.0; mb * hp.ple_dim],
            scores: vec![0.0; pool.n_threads() * ATT_HEADS * scores_stride],
            rope_local: vec![(0.0, 0.0); mb * (hp.rope_dim_local / 2)],
            rope_global: vec![(0.0, 0.0); mb * (hp.rope_dim / 2)],
            pos: vec![0; mb],
            acts,
            moe: moe::MoeScratch::new(hp.moe, hp.d_model, mb),
        };
        let mut inv_freq_local = ops::rope_inv_freq(hp.rope_base_local, hp.rope_dim_local);
        let mut inv_freq_global = ops::rope_inv_freq(hp.rope_base, hp.rope_dim);
        if let Some(f) = &model.rope_freqs {
            // Llama 3 divides every layer's frequencies; Gemma 4 its global layers' only.
            let local: &mut [f32] = if hp.rope_freqs_global_only {
                &mut []
            } else {
                &mut inv_freq_local
            };
            for (v, d) in inv_freq_global
                .iter_mut()
                .chain(local.iter_mut())
                .zip(f.iter().cycle())
            {
                *v /= d;
            }
        }
        if let Some((long, short)) = &model.rope_factors {
            // LongRoPE: the long factors for a context past the original one, as llama.cpp
            // chooses (by the context the runner is built for, not by position).
            let f = if max_ctx > hp.rope_orig_ctx {
                long
            } else {
                short
            };
            for inv in [&mut inv_freq_global, &mut inv_freq_local] {
                for (v, d) in inv.iter_mut().zip(f) {
                    *v /= d;
                }
            }
        }
        for v in inv_freq_global.iter_mut() {
            *v /= hp.rope_scale;
        }
        if let Some(y) = &hp.yarn {
            // YaRN: each frequency blended between its interpolated and original value.
            for (inv, base, dims) in [
                (&mut inv_freq_global, hp.rope_base, hp.rope_dim),
                (&mut inv_freq_local, hp.rope_base_local, hp.rope_dim_local),
            ] {
                for (v, k) in inv.iter_mut().zip(y.freq_multipliers(base, dims)) {
                    *v *= k;
                }
            }
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
            ple_inputs: std::sync::Mutex::new(ple::PleInputs::new(ple_in)),
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
            if self.model.streamer.is_some() || self.model.experts.is_some() {
                return Err(ModelError::Backend(
                    "layers or experts streamed from disk run on the CPU backend only".into(),
                ));
            }
        }
        self.backend = backend;
        Ok(())
    }

    /// Benchmarks of an expert cache only: every mixture-of-experts layer picks its experts
    /// uniformly at random (a hash of layer and position) instead of by its router, the
    /// worst case of a cache. The outputs are then meaningless.
    pub fn set_uniform_routing(&mut self, on: bool) {
        self.scratch.moe.uniform = on;
    }

    /// `"cpu"`, or the backend's description (`"gpu: <adapter>"`).
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
            ctx.min(self.scores_stride - 1),
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
        self.per_layer_inputs(tokens, x)
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
            let (half, half_local) = (model.hp.rope_dim / 2, model.hp.rope_dim_local / 2);
            let s = &self.scratch;
            let batch = Batch {
                pos: &s.pos[..n],
                rope_local: &s.rope_local[..n * half_local],
                rope_global: &s.rope_global[..n * half],
            };
            be.layers(&model, &mut x[..n * d], parts, &batch, observer)?;
            for (kv, k) in parts.iter_mut() {
                kv.len += *k;
            }
            return Ok(());
        }
        if model.hp.ple_dim > 0 && !model.layers.is_empty() {
            self.take_per_layer_inputs(n)?;
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
            // A shared-KV layer attends over its source layer's cache (in this slice: the
            // loader refuses a split between them).
            let at = model
                .hp
                .kv_source(il)
                .map_or(i, |src| src - model.layer_range.start);
            let mut segs: Vec<Seg> = Vec::with_capacity(parts.len());
            let mut row = 0;
            for (kv, k) in parts.iter_mut() {
                let pos = kv.len;
                segs.push(Seg {
                    row,
                    n: *k,
                    pos,
                    kv: &mut kv.layers[at],
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
                    observer.as_deref_mut(),
                )?;
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
                    observer.as_deref_mut(),
                )?;
            }
            drop(streamed);
            if let Some(obs) = observer.as_mut() {
                obs.layer(il, &x[..n * d]);
            }
        }
        for (kv, k) in parts.iter_mut() {
            kv.len += *k;
        }
        Ok(())
    }

    /// The RoPE (cos, sin) of every row of the batch, for each kind of layer this slice has.
    fn rope_tables(&mut self, parts: &[(&mut KvCache, usize)], n: usize) {
        let m = &self.model;
        let attn_factor = m.hp.rope_attn_factor;
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
            let half = inv.len();
            let table = SharedMut::new(&mut table[..n * half]);
            let pos = &s.pos[..n];
            self.pool.for_ranges(n, ROWS_PER_CHUNK, &|rows| {
                for t in rows {
                    // SAFETY: row t's entries are written by this call alone.
                    let cs = unsafe { table.slice(t * half..(t + 1) * half) };
                    ops::rope_cos_sin(pos[t], inv, cs);
                    if attn_factor != 1.0 {
                        // LongRoPE's attention factor scales the rotated queries and keys.
                        for (c, s) in cs.iter_mut() {
                            *c *= attn_factor;
                            *s *= attn_factor;
                        }
                    }
                }
            });
        }
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
