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
