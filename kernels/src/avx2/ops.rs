//! AVX2 versions of the f32 row ops the attention loop runs for every (query, key) pair.

use core::arch::x86_64::*;

/// `y += alpha * x`.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let a = _mm256_set1_ps(alpha);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n, inside both slices.
        unsafe {
            let xv = _mm256_loadu_ps(x.as_ptr().add(i));
            let yv = _mm256_loadu_ps(y.as_ptr().add(i));
            _mm256_storeu_ps(y.as_mut_ptr().add(i), _mm256_fmadd_ps(a, xv, yv));
        }
        i += 8;
    }
    for j in i..n {
        y[j] += alpha * x[j];
    }
}

/// `e^x` in 8 lanes: `x = n·ln2 + r` with `|r| ≤ ln2/2` (ln2 split in two for an exact
/// product), a degree-6 polynomial for `e^r` (relative error under 2e-7 on that range) and
/// `2^n` put in the exponent. Inputs are clamped to [-87.3, 88]: below, the result is a
/// tiny normal number (about 1e-38) instead of 0; above, e^88 (1.6e38) instead of inf — both
/// act as 0 and overflow in the uses here (`x / (1 + e^-y)`, softmax after subtracting the
/// max).
///
/// Safe to call only from code compiled with AVX2 and FMA (the `unsafe fn`s here).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn exp(x: __m256) -> __m256 {
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.3)),
        _mm256_set1_ps(88.0),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    // ln2 = 0.693359375 (exact in 10 bits) − 2.12194440e-4.
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    // Taylor coefficients 1/k! for k = 6..2, then 1 + r + r²·p(r).
    let mut p = _mm256_set1_ps(1.0 / 720.0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0 / 120.0));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0 / 24.0));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0 / 6.0));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
    let r2 = _mm256_mul_ps(r, r);
    let e = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
    // 2^n: n + 127 in the exponent field; the clamp keeps n in -126..=127.
    let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    )));
    _mm256_mul_ps(e, pow2)
}

/// `gate[i] = act(gate[i]) * up[i]` with `act(x) = x / (1 + e^(−k(x)))`: SiLU when `k(x) = x`,
/// GELU's tanh form when `k(x) = 2·√(2/π)·(x + 0.044715·x³)` (0.5·(1 + tanh y) = 1/(1 + e^(−2y))).
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn glu<const GELU: bool>(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    let one = _mm256_set1_ps(1.0);
    let k = |x: __m256| {
        if GELU {
            let x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
            let y = _mm256_fmadd_ps(_mm256_set1_ps(0.044_715), x3, x);
            _mm256_mul_ps(_mm256_set1_ps(-2.0 * 0.797_884_6), y)
        } else {
            _mm256_sub_ps(_mm256_setzero_ps(), x)
        }
    };
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n, inside both slices.
        unsafe {
            let x = _mm256_loadu_ps(gate.as_ptr().add(i));
            let u = _mm256_loadu_ps(up.as_ptr().add(i));
            let a = _mm256_div_ps(x, _mm256_add_ps(one, exp(k(x))));
            _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(a, u));
        }
        i += 8;
    }
    if i < n {
        // The tail through the same vector code, from a padded copy.
        let mut g = [0f32; 8];
        let mut u = [0f32; 8];
        g[..n - i].copy_from_slice(&gate[i..n]);
        u[..n - i].copy_from_slice(&up[i..n]);
        // SAFETY: 8 floats in each buffer.
        unsafe { glu::<GELU>(&mut g, &u) };
        gate[i..n].copy_from_slice(&g[..n - i]);
    }
}

/// In-place softmax of one row (as `ops::softmax`, with the vector `exp`).
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let n = x.len();
    let m = _mm256_set1_ps(max);
    let mut sum = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n.
        unsafe {
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(x.as_ptr().add(i)), m));
            _mm256_storeu_ps(x.as_mut_ptr().add(i), e);
            sum = _mm256_add_ps(sum, e);
        }
        i += 8;
    }
    let mut lanes = [0f32; 8];
    // SAFETY: 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
    let mut total: f32 = lanes.iter().sum();
    for v in &mut x[i..] {
        *v = (*v - max).exp();
        total += *v;
    }
    let inv = _mm256_set1_ps(1.0 / total);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n.
        unsafe {
            let p = x.as_mut_ptr().add(i);
            _mm256_storeu_ps(p, _mm256_mul_ps(_mm256_loadu_ps(p), inv));
        }
        i += 8;
    }
    let inv = 1.0 / total;
    for v in &mut x[i..] {
        *v *= inv;
    }
}

/// Sum of the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum8(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// `G` queries × `K` keys of `hd` floats: every key chunk loaded once for the `G` queries and
/// every query chunk once for the `K` keys.
///
/// # Safety
/// `q` points to `G` rows of `hd` floats, back to back; `k` to `K` rows `k_stride` apart.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn qk_tile<const G: usize, const K: usize>(
    q: *const f32,
    hd: usize,
    k: *const f32,
    k_stride: usize,
) -> [[f32; K]; G] {
    let mut acc = [[_mm256_setzero_ps(); K]; G];
    let mut d = 0;
    while d + 8 <= hd {
        // SAFETY: d + 8 <= hd inside every row (caller).
        unsafe {
            let mut kv = [_mm256_setzero_ps(); K];
            for (j, v) in kv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(k.add(j * k_stride + d));
            }
            for (g, row) in acc.iter_mut().enumerate() {
                let qv = _mm256_loadu_ps(q.add(g * hd + d));
                for (a, kj) in row.iter_mut().zip(kv) {
                    *a = _mm256_fmadd_ps(qv, kj, *a);
                }
            }
        }
        d += 8;
    }
    let mut out = [[0f32; K]; G];
    for (g, (orow, arow)) in out.iter_mut().zip(&acc).enumerate() {
        for (j, (o, a)) in orow.iter_mut().zip(arow).enumerate() {
            *o = hsum8(*a);
            for t in d..hd {
                // SAFETY: t < hd inside both rows (caller).
                *o += unsafe { *q.add(g * hd + t) * *k.add(j * k_stride + t) };
            }
        }
    }
    out
}

/// AVX2 form of `ops::qk_scores` (same contract; shapes checked by the caller).
///
/// # Safety
/// The shapes `ops::qk_scores` checks hold; the CPU has AVX2 and FMA.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn qk_scores(
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
    let (qp, kp) = (q.as_ptr(), k.as_ptr());
    let mut g0 = 0;
    while g0 < n_q {
        let ng = (n_q - g0).min(4);
        let mut j = 0;
        while j < n_k {
            let nk = if n_k - j >= 4 { 4 } else { 1 };
            // SAFETY: queries g0..g0 + ng and keys j..j + nk exist (caller's shapes).
            unsafe {
                let (qg, kj) = (qp.add(g0 * hd), kp.add(j * k_stride));
                macro_rules! run {
                    ($g:literal, $k:literal) => {{
                        let t = qk_tile::<$g, $k>(qg, hd, kj, k_stride);
                        for (gi, row) in t.iter().enumerate() {
                            for (ji, v) in row.iter().enumerate() {
                                scores[(g0 + gi) * s_stride + j + ji] = v * scale;
                            }
                        }
                    }};
                }
                match (ng, nk) {
                    (4, 4) => run!(4, 4),
                    (3, 4) => run!(3, 4),
                    (2, 4) => run!(2, 4),
                    (1, 4) => run!(1, 4),
                    (4, _) => run!(4, 1),
                    (3, _) => run!(3, 1),
                    (2, _) => run!(2, 1),
                    _ => run!(1, 1),
                }
            }
            j += nk;
        }
        g0 += ng;
    }
}

/// `G` output rows × 32 columns from `d`: `out[g][d..d + 32] += Σ_j p[g][j] · v_j[d..d + 32]`,
/// the 32 × `G` sums in registers across all keys.
///
/// # Safety
/// `p` holds `G` rows `p_stride` apart of `n_k` weights; `v` `n_k` rows `v_stride` apart with
/// 32 floats from `d`; `out` `G` rows of `hd` with 32 floats from `d`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn pv_tile<const G: usize>(
    p: *const f32,
    p_stride: usize,
    v: *const f32,
    v_stride: usize,
    n_k: usize,
    hd: usize,
    d: usize,
    out: *mut f32,
) {
    // SAFETY: every offset stays inside the rows the caller vouches for.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 4]; G];
        for (g, row) in acc.iter_mut().enumerate() {
            for (c, a) in row.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(out.add(g * hd + d + 8 * c));
            }
        }
        for j in 0..n_k {
            let vj = v.add(j * v_stride + d);
            let vv = [
                _mm256_loadu_ps(vj),
                _mm256_loadu_ps(vj.add(8)),
                _mm256_loadu_ps(vj.add(16)),
                _mm256_loadu_ps(vj.add(24)),
            ];
            for (g, row) in acc.iter_mut().enumerate() {
                let w = _mm256_broadcast_ss(&*p.add(g * p_stride + j));
                for (a, x) in row.iter_mut().zip(vv) {
                    *a = _mm256_fmadd_ps(w, x, *a);
                }
            }
        }
        for (g, row) in acc.iter().enumerate() {
            for (c, a) in row.iter().enumerate() {
                _mm256_storeu_ps(out.add(g * hd + d + 8 * c), *a);
            }
        }
    }
}

/// AVX2 form of `ops::pv_accumulate` (same contract; shapes checked by the caller).
///
/// # Safety
/// The shapes `ops::pv_accumulate` checks hold; the CPU has AVX2 and FMA.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn pv_accumulate(
    p: &[f32],
    p_stride: usize,
    n_q: usize,
    v: &[f32],
    v_stride: usize,
    n_k: usize,
    hd: usize,
    out: &mut [f32],
) {
    let (pp, vp, op) = (p.as_ptr(), v.as_ptr(), out.as_mut_ptr());
    let mut g0 = 0;
    while g0 < n_q {
        let ng = (n_q - g0).min(4);
        let mut d = 0;
        while d + 32 <= hd {
            // SAFETY: rows g0..g0 + ng and columns d..d + 32 exist (caller's shapes).
            unsafe {
                let (pg, og) = (pp.add(g0 * p_stride), op.add(g0 * hd));
                match ng {
                    4 => pv_tile::<4>(pg, p_stride, vp, v_stride, n_k, hd, d, og),
                    3 => pv_tile::<3>(pg, p_stride, vp, v_stride, n_k, hd, d, og),
                    2 => pv_tile::<2>(pg, p_stride, vp, v_stride, n_k, hd, d, og),
                    _ => pv_tile::<1>(pg, p_stride, vp, v_stride, n_k, hd, d, og),
                }
            }
            d += 32;
        }
        if d < hd {
            for g in g0..g0 + ng {
                for j in 0..n_k {
                    let w = p[g * p_stride + j];
                    for t in d..hd {
                        out[g * hd + t] += w * v[j * v_stride + t];
                    }
                }
            }
        }
        g0 += ng;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lanes(v: __m256) -> [f32; 8] {
        let mut o = [0f32; 8];
        // SAFETY: 8 floats.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) };
        o
    }

    #[test]
    fn attention_blocks_match_the_plain_loops() {
        if !crate::avx2::available() {
            eprintln!("SKIPPED attention_blocks_match_the_plain_loops: no AVX2");
            return;
        }
        let val = |i: usize| ((i * 37 % 101) as f32 - 50.0) / 25.0;
        // Head sizes with and without a 32-wide tail; 1..6 queries; key counts around 4.
        for hd in [8usize, 40, 64, 72] {
            for n_q in 1..=6 {
                for n_k in [1usize, 3, 4, 5, 9] {
                    let (k_stride, s_stride) = (hd + 3, n_k + 2);
                    let q: Vec<f32> = (0..n_q * hd).map(val).collect();
                    let k: Vec<f32> = (0..n_k * k_stride).map(|i| val(i + 7)).collect();
                    let mut got = vec![f32::NAN; n_q * s_stride];
                    // SAFETY: AVX2 and FMA detected above; shapes as the contract asks.
                    unsafe { qk_scores(&q, n_q, hd, &k, k_stride, n_k, 0.5, &mut got, s_stride) };
                    let mut p = vec![0f32; n_q * s_stride];
                    for g in 0..n_q {
                        for j in 0..n_k {
                            let want: f64 = (0..hd)
                                .map(|t| f64::from(q[g * hd + t]) * f64::from(k[j * k_stride + t]))
                                .sum::<f64>()
                                * 0.5;
                            let g_ = got[g * s_stride + j];
                            assert!((f64::from(g_) - want).abs() < 1e-4, "qk hd={hd} {g},{j}");
                            p[g * s_stride + j] = val(g * 5 + j) / 10.0;
                        }
                    }
                    let out0: Vec<f32> = (0..n_q * hd).map(|i| val(i + 3)).collect();
                    let mut out = out0.clone();
                    // SAFETY: as above.
                    unsafe { pv_accumulate(&p, s_stride, n_q, &k, k_stride, n_k, hd, &mut out) };
                    for g in 0..n_q {
                        for t in 0..hd {
                            let want = f64::from(out0[g * hd + t])
                                + (0..n_k)
                                    .map(|j| {
                                        f64::from(p[g * s_stride + j])
                                            * f64::from(k[j * k_stride + t])
                                    })
                                    .sum::<f64>();
                            let o = out[g * hd + t];
                            assert!((f64::from(o) - want).abs() < 1e-4, "pv hd={hd} {g},{t}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn exp_within_3e7_of_f64() {
        if !crate::avx2::available() {
            eprintln!("SKIPPED exp_within_3e7_of_f64: no AVX2");
            return;
        }
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 87.8 {
            let xs = [
                x,
                x + 0.001,
                x + 0.01,
                x + 0.1,
                -x * 0.5,
                x * 1e-3,
                x * 1e-6,
                0.0,
            ];
            // SAFETY: AVX2 and FMA detected above.
            let got = lanes(unsafe { exp(_mm256_loadu_ps(xs.as_ptr())) });
            for (g, x) in got.iter().zip(xs) {
                let want = f64::from(x).exp();
                let rel = (f64::from(*g) - want).abs() / want;
                worst = worst.max(rel);
            }
            x += 0.037;
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
        // Far outside the clamp: 0-like and huge-but-finite, never NaN.
        let xs = [
            -1e30f32,
            -200.0,
            -88.0,
            89.0,
            200.0,
            1e30,
            f32::MIN,
            f32::MAX,
        ];
        // SAFETY: as above.
        let got = lanes(unsafe { exp(_mm256_loadu_ps(xs.as_ptr())) });
        for (g, x) in got.iter().zip(xs) {
            assert!(g.is_finite() && *g >= 0.0, "exp({x}) = {g}");
            if x < 0.0 {
                assert!(*g < 1e-37, "exp({x}) = {g}");
            } else {
                assert!(*g > 1e38, "exp({x}) = {g}");
            }
        }
    }

    #[test]
    fn glu_and_softmax_match_the_scalar_ops() {
        if !crate::avx2::available() {
            eprintln!("SKIPPED glu_and_softmax_match_the_scalar_ops: no AVX2");
            return;
        }
        // Every length up to 3 vectors and a tail; values across the activations' range.
        for n in [1usize, 7, 8, 9, 23, 64, 77] {
            let x: Vec<f32> = (0..n)
                .map(|i| (i as f32 * 0.73).sin() * 12.0 - 1.0)
                .collect();
            let up: Vec<f32> = (0..n).map(|i| 1.0 + (i as f32 * 0.31).cos()).collect();
            for gelu in [false, true] {
                let mut got = x.clone();
                // SAFETY: AVX2 and FMA detected above.
                unsafe {
                    if gelu {
                        glu::<true>(&mut got, &up)
                    } else {
                        glu::<false>(&mut got, &up)
                    }
                };
                // In f64 (the f32 tanh form loses all digits of 1 + tanh(y) for x < -4).
                let act = |x: f64| {
                    if gelu {
                        let y = 0.797_884_560_802_865_4 * (x + 0.044_715 * x * x * x);
                        0.5 * x * (1.0 + y.tanh())
                    } else {
                        x / (1.0 + (-x).exp())
                    }
                };
                for ((g, x), u) in got.iter().zip(&x).zip(&up) {
                    let want = act(f64::from(*x)) * f64::from(*u);
                    assert!(
                        (f64::from(*g) - want).abs() <= 1e-6 * want.abs().max(1e-4),
                        "gelu={gelu} n={n}: {x} -> {g}, f64 {want}"
                    );
                }
            }
            let mut got = x.clone();
            let mut want = x.clone();
            // SAFETY: as above.
            unsafe { softmax(&mut got) };
            crate::ops::softmax(&mut want);
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-6 * w.max(1e-6),
                    "softmax n={n}: {g} vs {w}"
                );
            }
        }
    }
}
