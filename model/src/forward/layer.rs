//! One layer on the CPU: the layer's recipe (`arch::recipe`) walked step by step over the
//! batch's rows, each step a call of a multi-threaded kernel. Consecutive per-row steps on
//! `q`, `k` and `v` (biases, QK-norm, RoPE) are one pass over the rows, unless an observer
//! asks to see every step.

use super::attention::{attend, Seg};
use super::ple::per_layer_input;
use super::{Observed, Observer, Runner, Scratch};
use crate::arch::recipe::Buf;
use crate::arch::{FfnAct, Hparams, RopeTable, Step};
use crate::error::ModelError;
use crate::model::{Layer, Model};
use crate::stream::LayerGuard;
use ringllm_kernels::matmul::{matmul, matmul_many, MatJob};
use ringllm_kernels::ops;
use ringllm_kernels::pool::SharedMut;
use ringllm_kernels::ThreadPool;

impl Runner {
    /// One layer on the batch. `skip_rows[r]`: row `r` skips this layer, so its key and
    /// value are not stored (its slot is marked as holding nothing; the caller restores its
    /// residual row). A streamed layer's weights are read from `buf`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer(
        &mut self,
        m: &Model,
        il: usize,
        l: &Layer,
        buf: Option<&LayerGuard<'_>>,
        x: &mut [f32],
        n: usize,
        segs: &mut [Seg<'_>],
        skip_rows: Option<&[bool]>,
        mut observer: Option<&mut (dyn Observer + '_)>,
    ) -> Result<(), ModelError> {
        let hp = &m.hp;
        let (d, qd, kvd, ff) = (
            hp.d_model,
            hp.q_dim_of(il),
            hp.kv_dim_of(il),
            hp.d_ff_of(il),
        );
        let eps = hp.rms_eps;
        let s = &mut self.scratch;
        let pool = &self.pool;
        let each_step = observer.as_ref().is_some_and(|o| o.wants_steps());
        let steps = &l.recipe.steps;
        let mut i = 0;
        while i < steps.len() {
            let step = steps[i];
            let mut next = i + 1;
            match step {
                Step::AttnNorm => norm_rows(pool, x, &l.attn_norm, eps, &mut s.xn[..n * d]),
                Step::QkvProj | Step::QkvFused | Step::QkProj | Step::QProj => {
                    project(pool, m, l, buf, step, s, n, (d, qd, kvd))
                }
                Step::QkvBias
                | Step::QkNorm
                | Step::Rope(_)
                | Step::VFromK
                | Step::QNorm
                | Step::VNorm
                | Step::RopeQ(_) => {
                    if !each_step {
                        while next < steps.len() && steps[next].per_row_qkv() {
                            next += 1;
                        }
                    }
                    qkv_rows(pool, hp, il, l, &steps[i..next], s, n);
                }
                Step::Attention {
                    scale,
                    softcap,
                    sinks,
                } => attend(
                    pool,
                    hp,
                    il,
                    (scale, softcap, l.attn_sinks.as_deref().filter(|_| sinks)),
                    true,
                    s,
                    self.scores_stride,
                    segs,
                    n,
                    skip_rows,
                ),
                Step::SharedAttention { scale, .. } => attend(
                    pool,
                    hp,
                    il,
                    (scale, None, None),
                    false,
                    s,
                    self.scores_stride,
                    segs,
                    n,
                    skip_rows,
                ),
                Step::PerLayerInput => per_layer_input(pool, m, il, l, buf, x, n, s),
                Step::OutScale => {
                    if let Some(k) = l.out_scale {
                        for v in x[..n * d].iter_mut() {
                            *v *= k;
                        }
                    }
                }
                Step::AttnOut => matmul(
                    pool,
                    &m.matrix_in(&l.wo, buf),
                    &s.att[..n * qd],
                    n,
                    &mut s.o[..n * d],
                    &mut s.acts,
                ),
                Step::AttnResidual { post_norm } => {
                    let w = if post_norm {
                        l.post_attn_norm.as_deref()
                    } else {
                        None
                    };
                    add_rows(pool, d, x, &mut s.o[..n * d], w, eps);
                }
                Step::FfnNorm | Step::PostAttnFfnNorm => {
                    norm_rows(pool, x, &l.ffn_norm, eps, &mut s.xn[..n * d])
                }
                Step::GateUp | Step::GateUpFused => matmul_many(
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
                    &s.xn[..n * d],
                    n,
                    &mut s.acts,
                ),
                Step::Glu(act) => {
                    glu_parallel(pool, &mut s.gate[..n * ff], &s.up[..n * ff], glu_fn(act))
                }
                Step::FfnDown => matmul(
                    pool,
                    &m.matrix_in(&l.down, buf),
                    &s.gate[..n * ff],
                    n,
                    &mut s.o[..n * d],
                    &mut s.acts,
                ),
                Step::Router { .. } => super::moe::router(pool, m, il, l, buf, x, s, n),
                Step::Experts { act, .. } => super::moe::experts(pool, m, il, l, buf, act, s, n)?,
                Step::AttnOutBias => add_bias_rows(&mut s.o[..n * d], l.bo.as_deref()),
                Step::FfnResidual { post_norm } => {
                    let w = if post_norm {
                        l.post_ffw_norm.as_deref()
                    } else {
                        None
                    };
                    add_rows(pool, d, x, &mut s.o[..n * d], w, eps);
                }
            }
            if each_step {
                if let Some(obs) = observer.as_deref_mut() {
                    for &b in step.outputs() {
                        let width = b.width(hp, il);
                        let rows = match b {
                            Buf::X => &x[..n * width],
                            _ => &s.buf(b)[..n * width],
                        };
                        obs.step(&Observed {
                            layer: il,
                            step: step.name(),
                            buf: b.name(),
                            rows,
                            width,
                        });
                    }
                }
            }
            i = next;
        }
        Ok(())
    }
}

impl Scratch {
    /// A scratch buffer by name (`Buf::X`, the residual stream, is the caller's).
    fn buf(&self, b: Buf) -> &[f32] {
        match b {
            Buf::Xn => &self.xn,
            Buf::Q => &self.q,
            Buf::K => &self.k,
            Buf::V => &self.v,
            Buf::Att => &self.att,
            Buf::O => &self.o,
            Buf::Gate => &self.gate,
            Buf::Up => &self.up,
            Buf::Ple => &self.ple,
            Buf::X => &[],
        }
    }
}

/// A run of per-row steps on `q`, `k` and `v` (biases, QK-norm, RoPE), in order, in one
/// pass over the rows (rows split among the threads for a batch).
fn qkv_rows(
    pool: &ThreadPool,
    hp: &Hparams,
    il: usize,
    l: &Layer,
    steps: &[Step],
    s: &mut Scratch,
    n: usize,
) {
    let (qd, kvd, hd, eps) = (
        hp.q_dim_of(il),
        hp.kv_dim_of(il),
        hp.head_dim_of(il),
        hp.rms_eps,
    );
    let (half_local, half_global) = (hp.rope_dim_local / 2, hp.rope_dim / 2);
    let (local, global) = (
        &s.rope_local[..n * half_local],
        &s.rope_global[..n * half_global],
    );
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
            for step in steps {
                match step {
                    Step::QkvBias => {
                        for (buf, bias) in [(&mut *q, &l.bq), (&mut *k, &l.bk), (&mut *v, &l.bv)] {
                            if let Some(b) = bias {
                                ops::add_inplace(buf, b);
                            }
                        }
                    }
                    Step::QkNorm => {
                        if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                            ops::rms_norm_rows_inplace(q, qn, eps);
                            ops::rms_norm_rows_inplace(k, kn, eps);
                        }
                    }
                    Step::Rope(table) | Step::RopeQ(table) => {
                        let (rope, half) = match table {
                            RopeTable::Local => (local, half_local),
                            RopeTable::Global => (global, half_global),
                        };
                        let cs = &rope[t * half..(t + 1) * half];
                        let ks = if matches!(step, Step::Rope(_)) {
                            &mut k[..]
                        } else {
                            &mut []
                        };
                        for head in q.chunks_exact_mut(hd).chain(ks.chunks_exact_mut(hd)) {
                            ops::rope_apply(head, cs, hp.rope_style);
                        }
                    }
                    Step::VFromK => v.copy_from_slice(k),
                    Step::QNorm => {
                        if let Some(qn) = &l.q_norm {
                            ops::rms_norm_rows_inplace(q, qn, eps);
                        }
                    }
                    Step::VNorm => {
                        for head in v.chunks_exact_mut(hd) {
                            rms_norm_plain(head, eps);
                        }
                    }
                    // `layer` hands this function per-row steps only.
                    _ => debug_assert!(step.per_row_qkv(), "{} is not a per-row step", step.name()),
                }
            }
        }
    });
}

/// The projections of `QkvProj` (q, k, v), `QkProj` (q, k) or `QProj` (q) in one pass over
/// `xn`; the loader read K and V exactly when the step names them.
#[allow(clippy::too_many_arguments)]
fn project(
    pool: &ThreadPool,
    m: &Model,
    l: &Layer,
    buf: Option<&LayerGuard<'_>>,
    step: Step,
    s: &mut Scratch,
    n: usize,
    (d, qd, kvd): (usize, usize, usize),
) {
    let mut jobs = vec![MatJob {
        w: m.matrix_in(&l.wq, buf),
        out: &mut s.q[..n * qd],
    }];
    let (k, v) = (&mut s.k[..n * kvd], &mut s.v[..n * kvd]);
    if step != Step::QProj {
        if let Some(wk) = &l.wk {
            jobs.push(MatJob {
                w: m.matrix_in(wk, buf),
                out: k,
            });
        }
    }
    if matches!(step, Step::QkvProj | Step::QkvFused) {
        if let Some(wv) = &l.wv {
            jobs.push(MatJob {
                w: m.matrix_in(wv, buf),
                out: v,
            });
        }
    }
    matmul_many(pool, &mut jobs, &s.xn[..n * d], n, &mut s.acts)
}

/// The row function of a GLU activation: `gate = act(gate) · up`.
pub(super) fn glu_fn(act: FfnAct) -> fn(&mut [f32], &[f32]) {
    match act {
        FfnAct::Silu => ops::glu_silu,
        FfnAct::GeluTanh => ops::glu_gelu_tanh,
        FfnAct::SwigluOai => super::moe::swiglu_oai,
    }
}

/// `rows += bias` for every `bias.len()`-wide row (nothing without a bias).
fn add_bias_rows(rows: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in rows.chunks_exact_mut(b.len()) {
            ops::add_inplace(row, b);
        }
    }
}

/// RMSNorm of one head in place, without a weight (Gemma 4's V-norm).
fn rms_norm_plain(x: &mut [f32], eps: f32) {
    let ss: f32 = x.iter().map(|v| v * v).sum::<f32>() / x.len().max(1) as f32;
    let scale = 1.0 / (ss + eps).sqrt();
    for v in x.iter_mut() {
        *v *= scale;
    }
}

/// Rows per chunk of the row-wise passes (below this many rows a batch stays on the calling
/// thread: one token's norm or RoPE is far shorter than waking a thread).
pub(super) const ROWS_PER_CHUNK: usize = 16;

/// RMSNorm of every `w.len()`-wide row of `x` into `out`, rows split among the threads.
pub(super) fn norm_rows(pool: &ThreadPool, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
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
pub(super) fn add_rows(
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
pub(super) fn glu_parallel(
    pool: &ThreadPool,
    gate: &mut [f32],
    up: &[f32],
    glu: fn(&mut [f32], &[f32]),
) {
    const CHUNK: usize = 4096;
    let g = SharedMut::new(gate);
    pool.for_ranges(g.len(), CHUNK, &|range| {
        // SAFETY: each range is handed to one thread; ranges are disjoint.
        let part = unsafe { g.slice(range.clone()) };
        glu(part, &up[range]);
    });
}
