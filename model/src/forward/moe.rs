//! A mixture-of-experts feed-forward on the CPU (`Step::Router`, `Step::Experts`).
//!
//! The router picks each row's experts; the batch's rows are then grouped by expert (a
//! counting sort), and each expert that has rows runs as one batched product over them:
//! gather the rows of `xn`, gate and up in one pass of the pool, the GLU, down, and each
//! result added into its row of `o` with the row's routing weight. Decode is the same with
//! one row per picked expert, so only the picked experts' weights are read. The experts are
//! visited in increasing index whatever the batch, and the matrix kernels give a row the same
//! bits in any batch, so a row's output does not depend on the rows it was batched with (the
//! ring and the single process agree bit for bit, prefill and decode too).

use super::layer::glu_parallel;
use super::Scratch;
use crate::arch::{FfnAct, Gating, MoeParams};
use crate::error::ModelError;
use crate::model::{Layer, Model};
use crate::stream::LayerGuard;
use ringllm_kernels::matmul::{matmul, matmul_many, MatJob};
use ringllm_kernels::ops;
use ringllm_kernels::ThreadPool;

/// The most rows of a batch whose next layer's experts are predicted (decode, a few
/// streams): a prefill batch uses nearly every expert anyway, read in order on demand.
const PREDICT_ROWS: usize = 4;

/// The smallest sum of picked probabilities a renormalization divides by (llama.cpp clamps
/// the sum at the smallest normal f16 the same way).
const MIN_WEIGHT_SUM: f32 = 6.103_515_6e-5;

/// The scratch of the mixture-of-experts steps, sized for `max_batch` rows.
#[derive(Default)]
pub(super) struct MoeScratch {
    /// Router logits, then probabilities: `[n × n_expert]`.
    probs: Vec<f32>,
    /// Each row's picks `(expert, weight)`, `[n × n_used]`, in the order picked.
    picks: Vec<(u32, f32)>,
    /// Rows per expert, then the start of each expert's run in `order`: `n_expert + 1`.
    starts: Vec<usize>,
    /// The next free slot of each expert's run while `order` is filled.
    cursor: Vec<usize>,
    /// `(row, weight)` grouped by expert.
    order: Vec<(u32, f32)>,
    /// One expert's gathered input rows `[rows × d]`, its gate and up `[rows × d_ff_exp]`,
    /// its output `[rows × d]`.
    x: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    out: Vec<f32>,
    /// The experts the batch uses, increasing (experts read from disk).
    used: Vec<u32>,
    /// The next layer's router input and logits for the rows a prediction looks at, and the
    /// experts it names.
    pred_x: Vec<f32>,
    pred_p: Vec<f32>,
    pred_picks: Vec<(u32, f32)>,
    predicted: Vec<u32>,
    /// Benchmarks only: picks replaced by a hash of (layer, position), uniform over the
    /// experts ([`crate::Runner::set_uniform_routing`]).
    pub(super) uniform: bool,
}

impl MoeScratch {
    pub(super) fn new(m: Option<MoeParams>, d: usize, max_batch: usize) -> MoeScratch {
        let Some(m) = m else {
            return MoeScratch::default();
        };
        MoeScratch {
            probs: vec![0.0; max_batch * m.n_expert],
            picks: vec![(0, 0.0); max_batch * m.n_used],
            starts: vec![0; m.n_expert + 1],
            cursor: vec![0; m.n_expert + 1],
            order: vec![(0, 0.0); max_batch * m.n_used],
            x: vec![0.0; max_batch * d],
            gate: vec![0.0; max_batch * m.d_ff_exp],
            up: vec![0.0; max_batch * m.d_ff_exp],
            out: vec![0.0; max_batch * d],
            used: Vec::with_capacity(m.n_expert),
            pred_x: vec![0.0; PREDICT_ROWS * d],
            pred_p: vec![0.0; PREDICT_ROWS * m.n_expert],
            pred_picks: vec![(0, 0.0); m.n_used],
            predicted: Vec::with_capacity(m.n_expert),
            uniform: false,
        }
    }

    /// Bytes `new` allocates per row of the batch.
    pub(super) fn bytes_per_row(m: Option<MoeParams>, d: usize) -> u64 {
        m.map_or(0, |m| {
            (4 * m.n_expert + 16 * m.n_used + 8 * d + 8 * m.d_ff_exp) as u64
                + 16
                + (PREDICT_ROWS * 4 * (d + m.n_expert) + 8 * m.n_expert) as u64
        })
    }
}

/// Picks `k` experts from the router probabilities `p` (largest first, ties to the lower
/// index) and their weights into `picks`: the probabilities, renormalized to sum to one when
/// the model says so, times its weight scale.
pub fn route(p: &[f32], m: &MoeParams, picks: &mut [(u32, f32)]) {
    let k = m.n_used;
    for j in 0..k {
        // The best expert not yet picked: k is small (2 to 8), a scan per pick is enough.
        let mut best: Option<usize> = None;
        for (e, &v) in p.iter().enumerate() {
            if picks[..j].iter().any(|&(q, _)| q as usize == e) {
                continue;
            }
            if best.is_none_or(|b| v > p[b]) {
                best = Some(e);
            }
        }
        let e = best.unwrap_or(0);
        picks[j] = (e as u32, p[e]);
    }
    if m.norm_weights {
        let sum: f32 = picks[..k].iter().map(|&(_, w)| w).sum();
        let inv = sum.max(MIN_WEIGHT_SUM);
        for pk in picks[..k].iter_mut() {
            pk.1 /= inv;
        }
    }
    if m.weights_scale != 1.0 {
        for pk in picks[..k].iter_mut() {
            pk.1 *= m.weights_scale;
        }
    }
}

/// `Step::Router`: the picks of each of the `n` rows of `xn`. When the layer's experts are
/// read from disk, the store is told which ones the batch needs, and what the next layer
/// will probably need (from the residual `x`).
#[allow(clippy::too_many_arguments)]
pub(super) fn router(
    pool: &ThreadPool,
    m: &Model,
    il: usize,
    l: &Layer,
    buf: Option<&LayerGuard<'_>>,
    x: &[f32],
    s: &mut Scratch,
    n: usize,
) {
    let (Some(moe), Some(w)) = (m.hp.moe, &l.router) else {
        return;
    };
    let (d, ne, k) = (m.hp.d_model, moe.n_expert, moe.n_used);
    let ms = &mut s.moe;
    matmul(
        pool,
        &m.matrix_in(w, buf),
        &s.xn[..n * d],
        n,
        &mut ms.probs[..n * ne],
        &mut s.acts,
    );
    for r in 0..n {
        let p = &mut ms.probs[r * ne..(r + 1) * ne];
        if let Some(b) = &l.router_bias {
            ops::add_inplace(p, b);
        }
        let picks = &mut ms.picks[r * k..(r + 1) * k];
        match moe.gating {
            Gating::Softmax => {
                ops::softmax(p);
                route(p, &moe, picks);
            }
            Gating::SoftmaxPicked => {
                // The k largest logits, then a softmax over those k.
                route(p, &moe, picks);
                let mut w = [0f32; MAX_PICKED_SOFTMAX];
                let kk = k.min(MAX_PICKED_SOFTMAX);
                for (wj, pk) in w.iter_mut().zip(picks.iter()) {
                    *wj = pk.1;
                }
                ops::softmax(&mut w[..kk]);
                for (pk, &wj) in picks.iter_mut().zip(&w[..kk]) {
                    pk.1 = wj;
                }
            }
        }
    }
    if ms.uniform {
        for r in 0..n {
            uniform_picks(il, s.pos[r], ne, &mut ms.picks[r * k..(r + 1) * k]);
        }
    }
    if let Some(store) = m.experts.as_ref().filter(|st| st.streams(il)) {
        ms.used.clear();
        ms.starts.iter_mut().for_each(|c| *c = 0);
        for &(e, _) in &ms.picks[..n * k] {
            ms.starts[e as usize] = 1;
        }
        ms.used
            .extend((0..ne as u32).filter(|&e| ms.starts[e as usize] != 0));
        store.want(il, &ms.used);
        if store.predicts() && n <= PREDICT_ROWS {
            predict_next(pool, m, il, x, s, n, store);
        }
    }
}

/// `k` distinct experts of `ne` from a hash of (layer, position), weights `1/k`: a router
/// that picks uniformly, the worst case of an expert cache (random weights' routers pick a
/// few experts far more than others).
fn uniform_picks(il: usize, pos: usize, ne: usize, picks: &mut [(u32, f32)]) {
    let k = picks.len();
    let mut h = (il as u64) << 32 ^ pos as u64 ^ 0x9E37_79B9_7F4A_7C15;
    let mut j = 0;
    while j < k {
        h ^= h >> 33;
        h = h.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
        h ^= h >> 29;
        let e = (h % ne as u64) as u32;
        if !picks[..j].iter().any(|p| p.0 == e) {
            picks[j] = (e, 1.0 / k as f32);
            j += 1;
        }
    }
}

/// Names to the store the experts layer `il + 1` will probably pick: its router applied to
/// the residual `x` of layer `il` (after attention) normed with layer `il + 1`'s feed-forward
/// norm, the union over the rows of each row's top k.
fn predict_next(
    pool: &ThreadPool,
    m: &Model,
    il: usize,
    x: &[f32],
    s: &mut Scratch,
    n: usize,
    store: &crate::stream::ExpertStore,
) {
    let next = il + 1;
    if !store.streams(next) || !m.layer_range.contains(&next) {
        return;
    }
    let l = &m.layers[next - m.layer_range.start];
    let (Some(moe), Some(w)) = (m.hp.moe, &l.router) else {
        return;
    };
    let (d, ne, k) = (m.hp.d_model, moe.n_expert, moe.n_used);
    let ms = &mut s.moe;
    ops::rms_norm_rows(
        &x[..n * d],
        &l.ffn_norm,
        m.hp.rms_eps,
        &mut ms.pred_x[..n * d],
    );
    matmul(
        pool,
        &m.matrix(w),
        &ms.pred_x[..n * d],
        n,
        &mut ms.pred_p[..n * ne],
        &mut s.acts,
    );
    ms.predicted.clear();
    for r in 0..n {
        let p = &mut ms.pred_p[r * ne..(r + 1) * ne];
        if let Some(b) = &l.router_bias {
            ops::add_inplace(p, b);
        }
        // The top k of the logits are the top k of any softmax of them.
        route(p, &moe, &mut ms.pred_picks[..k]);
        for &(e, _) in &ms.pred_picks[..k] {
            if !ms.predicted.contains(&e) {
                ms.predicted.push(e);
            }
        }
    }
    ms.predicted.sort_unstable();
    store.predict(next, &ms.predicted);
}

use crate::arch::MAX_PICKED as MAX_PICKED_SOFTMAX;

/// gpt-oss's clamped SwiGLU over a row: `g = min(gate, 7)`, `u = clamp(up, −7, 7)`,
/// `gate ← g · σ(1.702 g) · (u + 1)` (ggml's `swiglu_oai` with its alpha and limit).
pub(super) fn swiglu_oai(gate: &mut [f32], up: &[f32]) {
    const ALPHA: f32 = 1.702;
    const LIMIT: f32 = 7.0;
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = g.min(LIMIT);
        let y = u.clamp(-LIMIT, LIMIT);
        *g = x / (1.0 + (ALPHA * -x).exp()) * (y + 1.0);
    }
}

/// `Step::Experts`: `o` of the `n` rows from their picks (`router` ran first). Experts read
/// from disk are taken from the store one at a time, in the same order.
#[allow(clippy::too_many_arguments)]
pub(super) fn experts(
    pool: &ThreadPool,
    m: &Model,
    il: usize,
    l: &Layer,
    buf: Option<&LayerGuard<'_>>,
    act: FfnAct,
    s: &mut Scratch,
    n: usize,
) -> Result<(), ModelError> {
    let Some(moe) = m.hp.moe else { return Ok(()) };
    let store = m.experts.as_ref().filter(|_| l.gate.experts_streamed);
    let (d, ne, k, ff) = (m.hp.d_model, moe.n_expert, moe.n_used, moe.d_ff_exp);
    let ms = &mut s.moe;
    // Group the rows by expert: count, prefix sums, place (rows stay in increasing order
    // within an expert).
    ms.starts.iter_mut().for_each(|c| *c = 0);
    for &(e, _) in &ms.picks[..n * k] {
        ms.starts[e as usize + 1] += 1;
    }
    for e in 0..ne {
        ms.starts[e + 1] += ms.starts[e];
    }
    ms.cursor.copy_from_slice(&ms.starts);
    for r in 0..n {
        for &(e, w) in &ms.picks[r * k..(r + 1) * k] {
            let slot = &mut ms.cursor[e as usize];
            ms.order[*slot] = (r as u32, w);
            *slot += 1;
        }
    }
    let glu = super::layer::glu_fn(act);
    let bias = l.expert_bias.as_ref();
    let o = &mut s.o[..n * d];
    o.iter_mut().for_each(|v| *v = 0.0);
    for e in 0..ne {
        let run = ms.starts[e]..ms.starts[e + 1];
        let c = run.len();
        if c == 0 {
            continue;
        }
        for (i, &(r, _)) in ms.order[run.clone()].iter().enumerate() {
            let r = r as usize;
            ms.x[i * d..(i + 1) * d].copy_from_slice(&s.xn[r * d..(r + 1) * d]);
        }
        let guard = match store {
            Some(st) => Some(st.acquire(il, e).map_err(|err| ModelError::Stream {
                layer: il,
                why: err.to_string(),
            })?),
            None => None,
        };
        let view = |w, rows, part| match &guard {
            Some(g) => m.streamed_expert(w, rows, g, part),
            None => m.expert(w, e, rows, buf),
        };
        matmul_many(
            pool,
            &mut [
                MatJob {
                    w: view(&l.gate, ff, 0),
                    out: &mut ms.gate[..c * ff],
                },
                MatJob {
                    w: view(&l.up, ff, 1),
                    out: &mut ms.up[..c * ff],
                },
            ],
            &ms.x[..c * d],
            c,
            &mut s.acts,
        );
        if let Some(b) = bias {
            for (rows, bias) in [(&mut ms.gate, &b.gate), (&mut ms.up, &b.up)] {
                for row in rows[..c * ff].chunks_exact_mut(ff) {
                    ops::add_inplace(row, &bias[e * ff..(e + 1) * ff]);
                }
            }
        }
        glu_parallel(pool, &mut ms.gate[..c * ff], &ms.up[..c * ff], glu);
        matmul(
            pool,
            &view(&l.down, d, 2),
            &ms.gate[..c * ff],
            c,
            &mut ms.out[..c * d],
            &mut s.acts,
        );
        if let Some(b) = bias {
            for row in ms.out[..c * d].chunks_exact_mut(d) {
                ops::add_inplace(row, &b.down[e * d..(e + 1) * d]);
            }
        }
        for (i, &(r, w)) in ms.order[run].iter().enumerate() {
            let r = r as usize;
            for (dst, &y) in o[r * d..(r + 1) * d]
                .iter_mut()
                .zip(&ms.out[i * d..(i + 1) * d])
            {
                *dst += w * y;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(n_expert: usize, n_used: usize, norm: bool, scale: f32) -> MoeParams {
        MoeParams {
            n_expert,
            n_used,
            d_ff_exp: 16,
            norm_weights: norm,
            weights_scale: scale,
            gating: Gating::Softmax,
            biases: false,
        }
    }

    #[test]
    fn swiglu_oai_is_ggmls_formula_in_float64() {
        let gate: Vec<f32> = (-40..40).map(|i| i as f32 * 0.25).collect();
        let up: Vec<f32> = (-40..40).map(|i| (i as f32 * 0.37).sin() * 9.0).collect();
        let mut got = gate.clone();
        swiglu_oai(&mut got, &up);
        for ((&g, &u), &o) in gate.iter().zip(&up).zip(&got) {
            let x = (g as f64).min(7.0);
            let y = (u as f64).clamp(-7.0, 7.0);
            let want = x / (1.0 + (-1.702 * x).exp()) * (y + 1.0);
            assert!(
                (o as f64 - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{g} {u}: {o} vs {want}"
            );
        }
    }

    /// The picks against a float64 sort of the same probabilities.
    #[test]
    fn route_picks_the_largest_and_renormalizes_as_float64_does() {
        let mut seed = 7u64;
        for case in 0..200 {
            let ne = 2 + case % 30;
            let k = 1 + case % ne.min(8);
            let mut p: Vec<f32> = (0..ne)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((seed >> 33) as f32 / (1u64 << 31) as f32) * 8.0 - 4.0
                })
                .collect();
            ops::softmax(&mut p);
            let m = params(ne, k, case % 2 == 0, if case % 3 == 0 { 2.5 } else { 1.0 });
            let mut picks = vec![(0u32, 0f32); k];
            route(&p, &m, &mut picks);
            let mut idx: Vec<usize> = (0..ne).collect();
            idx.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap().then(a.cmp(&b)));
            let want: Vec<usize> = idx[..k].to_vec();
            let got: Vec<usize> = picks.iter().map(|&(e, _)| e as usize).collect();
            assert_eq!(got, want, "case {case}");
            let sum: f64 = want.iter().map(|&e| p[e] as f64).sum();
            for (&(e, w), &i) in picks.iter().zip(&want) {
                let mut x = p[i] as f64;
                if m.norm_weights {
                    x /= sum;
                }
                x *= m.weights_scale as f64;
                assert!(
                    (w as f64 - x).abs() <= 1e-6 * x.abs().max(1e-3),
                    "case {case} e {e}"
                );
            }
        }
    }

    #[test]
    fn ties_go_to_the_lower_expert() {
        let p = [0.1, 0.3, 0.3, 0.3];
        let mut picks = [(9u32, 0f32); 2];
        route(&p, &params(4, 2, true, 1.0), &mut picks);
        assert_eq!([picks[0].0, picks[1].0], [1, 2]);
        assert_eq!(picks[0].1, 0.5);
    }
}
