//! NEON versions of the f32 row ops with a vector `exp` (GLU activations, softmax) and of
//! `axpy`. The same method as the AVX2 ones, 4 lanes wide.

use core::arch::aarch64::*;

/// `e^x` in 4 lanes: `x = n·ln2 + r` with `|r| ≤ ln2/2` (ln2 split in two so `n·ln2` is
/// exact), a degree-6 Taylor polynomial for `e^r` and `2^n` put in the exponent. Inputs are
/// clamped to [-87.3, 88] (results about 1e-38 and 1.6e38 there, instead of 0 and inf: both
/// act as such in the uses here).
#[inline]
#[target_feature(enable = "neon")]
pub(crate) fn exp(x: float32x4_t) -> float32x4_t {
    let x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.3)), vdupq_n_f32(88.0));
    let n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(std::f32::consts::LOG2_E)));
    // ln2 = 0.693359375 (exact in 10 bits) − 2.12194440e-4.
    let r = vfmsq_f32(x, n, vdupq_n_f32(0.693_359_4));
    let r = vfmsq_f32(r, n, vdupq_n_f32(-2.121_944_4e-4));
    let mut p = vdupq_n_f32(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5] {
        p = vfmaq_f32(vdupq_n_f32(c), p, r);
    }
    let r2 = vmulq_f32(r, r);
    let e = vaddq_f32(vfmaq_f32(r, p, r2), vdupq_n_f32(1.0));
    // 2^n: n + 127 in the exponent field; the clamp keeps n in -126..=127.
    let pow2 = vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(
        vcvtq_s32_f32(n),
        vdupq_n_s32(127),
    )));
    vmulq_f32(e, pow2)
}

/// `gate[i] = act(gate[i]) * up[i]`, `act(x) = x / (1 + e^(−k(x)))`: SiLU when `k(x) = x`,
/// GELU's tanh form when `k(x) = 2·√(2/π)·(x + 0.044715·x³)`.
pub fn glu<const GELU: bool>(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    let mut i = 0;
    while n - i >= 4 {
        // SAFETY: elements i..i + 4 lie inside both slices; NEON is part of every aarch64 CPU.
        unsafe { glu4::<GELU>(gate.as_mut_ptr().add(i), up.as_ptr().add(i)) };
        i += 4;
    }
    if i < n {
        // The tail through the same vector code, from a padded copy.
        let mut g = [0f32; 4];
        let mut u = [0f32; 4];
        g[..n - i].copy_from_slice(&gate[i..n]);
        u[..n - i].copy_from_slice(&up[i..n]);
        // SAFETY: 4 floats in each buffer; NEON as above.
        unsafe { glu4::<GELU>(g.as_mut_ptr(), u.as_ptr()) };
        gate[i..n].copy_from_slice(&g[..n - i]);
    }
}

/// # Safety
/// `gate` and `up` point to 4 floats each.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn glu4<const GELU: bool>(gate: *mut f32, up: *const f32) {
    // SAFETY: 4 floats at each pointer (caller).
    let (x, u) = unsafe { (vld1q_f32(gate), vld1q_f32(up)) };
    let k = if GELU {
        let x3 = vmulq_f32(vmulq_f32(x, x), x);
        let y = vfmaq_f32(x, vdupq_n_f32(0.044_715), x3);
        vmulq_f32(vdupq_n_f32(-2.0 * 0.797_884_6), y)
    } else {
        vnegq_f32(x)
    };
    let a = vdivq_f32(x, vaddq_f32(vdupq_n_f32(1.0), exp(k)));
    // SAFETY: as above.
    unsafe { vst1q_f32(gate, vmulq_f32(a, u)) };
}

/// In-place softmax of one row (as `ops::softmax`, with the vector `exp`).
pub fn softmax(x: &mut [f32]) {
    // SAFETY: NEON is part of every aarch64 CPU.
    unsafe { softmax_neon(x) }
}

#[target_feature(enable = "neon")]
fn softmax_neon(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let m = vdupq_n_f32(max);
    let mut sum = vdupq_n_f32(0.0);
    let mut chunks = x.chunks_exact_mut(4);
    for c in &mut chunks {
        // SAFETY: `c` holds 4 floats.
        unsafe {
            let e = exp(vsubq_f32(vld1q_f32(c.as_ptr()), m));
            vst1q_f32(c.as_mut_ptr(), e);
            sum = vaddq_f32(sum, e);
        }
    }
    let mut total = vaddvq_f32(sum);
    for v in chunks.into_remainder() {
        *v = (*v - max).exp();
        total += *v;
    }
    let inv = 1.0 / total;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `y += alpha * x`.
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    // SAFETY: NEON is part of every aarch64 CPU.
    unsafe { axpy_neon(alpha, x, y) }
}

#[target_feature(enable = "neon")]
fn axpy_neon(alpha: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let a = vdupq_n_f32(alpha);
    let mut i = 0;
    while n - i >= 4 {
        // SAFETY: i + 4 <= n, inside both slices.
        unsafe {
            let xv = vld1q_f32(x.as_ptr().add(i));
            let yv = vld1q_f32(y.as_ptr().add(i));
            vst1q_f32(y.as_mut_ptr().add(i), vfmaq_f32(yv, a, xv));
        }
        i += 4;
    }
    for j in i..n {
        y[j] += alpha * x[j];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_within_3e7_of_f64() {
        let mut x = -87.0f32;
        while x < 88.0 {
            // SAFETY: NEON is part of every aarch64 CPU.
            let got = unsafe { vgetq_lane_f32::<0>(exp(vdupq_n_f32(x))) };
            let want = f64::from(x).exp();
            let rel = ((f64::from(got) - want) / want).abs();
            assert!(rel < 3e-7, "exp({x}) = {got}, want {want} ({rel})");
            x += 0.0137;
        }
    }

    #[test]
    fn glu_and_softmax_match_the_scalar_ops() {
        let x: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.37).collect();
        let up: Vec<f32> = (0..37).map(|i| 1.0 + i as f32 * 0.01).collect();
        for gelu in [false, true] {
            let mut want = x.clone();
            let act = if gelu {
                crate::ops::gelu_tanh
            } else {
                crate::ops::silu
            };
            crate::ops::glu(&mut want, &up, act);
            let mut got = x.clone();
            if gelu {
                glu::<true>(&mut got, &up);
            } else {
                glu::<false>(&mut got, &up);
            }
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                    "gelu={gelu}: {g} vs {w}"
                );
            }
        }
        let mut want = x.clone();
        crate::ops::softmax(&mut want);
        let mut got = x.clone();
        softmax(&mut got);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6, "softmax: {g} vs {w}");
        }
        let mut want: Vec<f32> = up.clone();
        crate::ops::axpy(0.3, &x, &mut want);
        let mut got = up.clone();
        axpy(0.3, &x, &mut got);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "axpy: {g} vs {w}");
        }
    }
}
