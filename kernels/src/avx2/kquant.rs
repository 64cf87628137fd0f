//! The Q4_K/Q5_K weight quantizers' scale search (`quants::q4_k::fit_scale_min`, ggml's
//! `make_qkx2_quants`) for a block's eight sub-blocks at once, one sub-block per f32 lane.
//!
//! Each lane does the reference's arithmetic in the reference's order: the same multiplies
//! and adds (no FMA), its sums taken element by element, its comparisons with the same
//! NaN behaviour, and rounding by `cvtps2dq` (round half to even, as `nearest_int`, for every
//! value the search can produce; NaN becomes 0 either way). So the levels, scales and mins,
//! and the bytes `ringllm convert` writes, are the reference's on every machine; the lanes
//! only do eight searches in the time of one.

use crate::quants::q4_k::{lanes8, Lanes8};
use crate::types::QK_K;
use std::arch::x86_64::*;

pub(super) fn quantize_q4_k(src: &[f32], dst: &mut [u8]) {
    crate::quants::q4_k::quantize_with(src, dst, fit8);
}

pub(super) fn quantize_q5_k(src: &[f32], dst: &mut [u8]) {
    crate::quants::q5_k::quantize_with(src, dst, fit8);
}

/// `Fit8` with the eight searches in the lanes of AVX2 registers.
fn fit8(
    x: &[f32],
    w: &[f32; QK_K],
    nmax: u8,
    rmin: f32,
    nstep: u32,
    l: &mut [u8; QK_K],
) -> ([f32; 8], [f32; 8]) {
    debug_assert!(super::available());
    // SAFETY: installed by `specialize` only after `available()` found AVX2, FMA and F16C.
    unsafe { fit8_avx2(&x[..QK_K], w, nmax, rmin, nstep, l) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn fit8_avx2(
    x: &[f32],
    w: &[f32; QK_K],
    nmax: u8,
    rmin: f32,
    nstep: u32,
    l: &mut [u8; QK_K],
) -> ([f32; 8], [f32; 8]) {
    const RDELTA: f32 = 0.1;
    // The transposed sub-blocks and each lane's start (the reference's, lane by lane).
    let Lanes8 {
        xt,
        wt,
        start,
        degenerate,
    } = lanes8(x, w);
    let load = |v: &[f32; 8]| {
        // SAFETY: eight floats.
        unsafe { _mm256_loadu_ps(v.as_ptr()) }
    };
    let xv: [__m256; 32] = std::array::from_fn(|i| load(&xt[i]));
    let wv: [__m256; 32] = std::array::from_fn(|i| load(&wt[i]));
    let (lo, hi, sum_w, sum_x) = (
        load(&start[0]),
        load(&start[1]),
        load(&start[2]),
        load(&start[3]),
    );
    let nmaxf = _mm256_set1_ps(f32::from(nmax));
    let top = _mm256_set1_epi32(i32::from(nmax));
    let zero_i = _mm256_setzero_si256();
    let zero = _mm256_setzero_ps();
    let range = _mm256_sub_ps(hi, lo);

    // nearest_int(iscale * (v - lo)).clamp(0, nmax), as floats.
    let grid = |iscale: __m256, out: &mut [__m256; 32]| {
        for (o, &v) in out.iter_mut().zip(&xv) {
            let q = _mm256_cvtps_epi32(_mm256_mul_ps(iscale, _mm256_sub_ps(v, lo)));
            *o = _mm256_cvtepi32_ps(_mm256_min_epi32(_mm256_max_epi32(q, zero_i), top));
        }
    };
    // Σ wt · e · e with e = scale · l + offset − v, element by element.
    let error = |scale: __m256, offset: __m256, ls: &[__m256; 32]| {
        let mut acc = zero;
        for ((&v, &wt), &l) in xv.iter().zip(&wv).zip(ls) {
            let e = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(scale, l), offset), v);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(wt, e), e));
        }
        acc
    };

    let mut best_scale = _mm256_div_ps(range, nmaxf);
    let mut best_offset = lo;
    let mut q = [zero; 32];
    grid(_mm256_div_ps(nmaxf, range), &mut q);
    let mut best = error(best_scale, best_offset, &q);
    let mut cand = [zero; 32];
    for k in 0..=nstep {
        let num = _mm256_set1_ps(rmin + RDELTA * k as f32 + f32::from(nmax));
        grid(_mm256_div_ps(num, range), &mut cand);
        let (mut sl, mut sll, mut sxl) = (zero, zero, zero);
        for ((&v, &wt), &l) in xv.iter().zip(&wv).zip(cand.iter()) {
            let wl = _mm256_mul_ps(wt, l);
            sl = _mm256_add_ps(sl, wl);
            sll = _mm256_add_ps(sll, _mm256_mul_ps(wl, l));
            sxl = _mm256_add_ps(sxl, _mm256_mul_ps(wl, v));
        }
        let det = _mm256_sub_ps(_mm256_mul_ps(sum_w, sll), _mm256_mul_ps(sl, sl));
        // The reference skips a candidate when `det <= 0` (not when det is NaN).
        let live = _mm256_cmp_ps::<_CMP_NLE_UQ>(det, zero);
        let mut scale = _mm256_div_ps(
            _mm256_sub_ps(_mm256_mul_ps(sum_w, sxl), _mm256_mul_ps(sum_x, sl)),
            det,
        );
        let mut offset = _mm256_div_ps(
            _mm256_sub_ps(_mm256_mul_ps(sll, sum_x), _mm256_mul_ps(sl, sxl)),
            det,
        );
        let positive = _mm256_cmp_ps::<_CMP_GT_OQ>(offset, zero);
        offset = _mm256_blendv_ps(offset, zero, positive);
        scale = _mm256_blendv_ps(scale, _mm256_div_ps(sxl, sll), positive);
        let e = error(scale, offset, &cand);
        let take = _mm256_and_ps(live, _mm256_cmp_ps::<_CMP_LT_OQ>(e, best));
        for (qi, &ci) in q.iter_mut().zip(&cand) {
            *qi = _mm256_blendv_ps(*qi, ci, take);
        }
        best = _mm256_blendv_ps(best, e, take);
        best_scale = _mm256_blendv_ps(best_scale, scale, take);
        best_offset = _mm256_blendv_ps(best_offset, offset, take);
    }

    let mut scales = [0f32; 8];
    let mut neg_offsets = [0f32; 8];
    // SAFETY: eight floats each.
    unsafe {
        _mm256_storeu_ps(scales.as_mut_ptr(), best_scale);
        _mm256_storeu_ps(neg_offsets.as_mut_ptr(), best_offset);
    }
    let mut mins = neg_offsets.map(|o| -o);
    for (i, qi) in q.iter().enumerate() {
        let mut v = [0f32; 8];
        // SAFETY: eight floats.
        unsafe { _mm256_storeu_ps(v.as_mut_ptr(), *qi) };
        for (j, &vj) in v.iter().enumerate() {
            l[32 * j + i] = vj as u8;
        }
    }
    for (j, d) in degenerate.iter().enumerate() {
        if let Some((s, m)) = *d {
            scales[j] = s;
            mins[j] = m;
            l[32 * j..32 * j + 32].fill(0);
        }
    }
    (scales, mins)
}

pub(super) fn quantize_q6_k(src: &[f32], dst: &mut [u8]) {
    crate::quants::q6_k::quantize_with(src, dst, fit_sym16);
}

pub(super) fn quantize_q3_k(src: &[f32], dst: &mut [u8]) {
    crate::quants::q3_k::quantize_with(src, dst, fit_sym16);
}

/// `FitSym16` (`quants::q6_k::fit_symmetric` on each 16-value sub-block), eight sub-blocks
/// to a register.
fn fit_sym16(x: &[f32], nmax: i32, l: &mut [u8; QK_K]) -> [f32; 16] {
    debug_assert!(super::available());
    let mut out = [0f32; 16];
    for half in 0..2 {
        let xs = &x[128 * half..128 * half + 128];
        // SAFETY: installed by `specialize` only after `available()` found AVX2, FMA and F16C.
        let (sc, lv) = unsafe { fit_sym8(xs, nmax) };
        out[8 * half..8 * half + 8].copy_from_slice(&sc);
        l[128 * half..128 * half + 128].copy_from_slice(&lv);
    }
    out
}

/// Eight sub-blocks of 16 (`x[16 j..16 j + 16]` in lane j), each lane the reference's steps.
#[target_feature(enable = "avx2,fma,f16c")]
fn fit_sym8(x: &[f32], nmax: i32) -> ([f32; 8], [u8; 128]) {
    use crate::quants::q6_k::sym_start;
    let mut xt = [[0f32; 8]; 16];
    let mut max = [1f32; 8];
    let mut flat = [false; 8];
    for j in 0..8 {
        for i in 0..16 {
            xt[i][j] = x[16 * j + i];
        }
        let (amax, m) = sym_start(&x[16 * j..16 * j + 16]);
        if amax < 1e-15 {
            flat[j] = true;
        } else {
            max[j] = m;
        }
    }
    let load = |v: &[f32; 8]| {
        // SAFETY: eight floats.
        unsafe { _mm256_loadu_ps(v.as_ptr()) }
    };
    let xv: [__m256; 16] = std::array::from_fn(|i| load(&xt[i]));
    let maxv = load(&max);
    let zero = _mm256_setzero_ps();
    let (lo, hi) = (_mm256_set1_epi32(-nmax), _mm256_set1_epi32(nmax - 1));
    // nearest_int(iscale · v).clamp(-nmax, nmax - 1); NaN rounds to 0 as in `nearest_int`.
    let level = |iscale: __m256, v: __m256| {
        let p = _mm256_mul_ps(iscale, v);
        let p = _mm256_and_ps(p, _mm256_cmp_ps::<_CMP_ORD_Q>(p, p));
        _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(p), lo), hi)
    };
    let sums = |iscale: __m256| {
        let (mut slx, mut sll) = (zero, zero);
        for &v in &xv {
            let l = _mm256_cvtepi32_ps(level(iscale, v));
            let w = _mm256_mul_ps(v, v);
            slx = _mm256_add_ps(slx, _mm256_mul_ps(_mm256_mul_ps(w, v), l));
            sll = _mm256_add_ps(sll, _mm256_mul_ps(_mm256_mul_ps(w, l), l));
        }
        (slx, sll)
    };
    let mut best_iscale = _mm256_div_ps(_mm256_set1_ps(-(nmax as f32)), maxv);
    let (slx, sll) = sums(best_iscale);
    let pos = _mm256_cmp_ps::<_CMP_GT_OQ>(sll, zero);
    let mut scale = _mm256_and_ps(_mm256_div_ps(slx, sll), pos);
    let mut best = _mm256_mul_ps(scale, slx);
    for k in (-9..=9).filter(|k| *k != 0) {
        let iscale = _mm256_div_ps(_mm256_set1_ps(-(nmax as f32 + 0.1 * k as f32)), maxv);
        let (slx, sll) = sums(iscale);
        let take = _mm256_and_ps(
            _mm256_cmp_ps::<_CMP_GT_OQ>(sll, zero),
            _mm256_cmp_ps::<_CMP_GT_OQ>(_mm256_mul_ps(slx, slx), _mm256_mul_ps(best, sll)),
        );
        let s = _mm256_div_ps(slx, sll);
        scale = _mm256_blendv_ps(scale, s, take);
        best = _mm256_blendv_ps(best, _mm256_mul_ps(s, slx), take);
        best_iscale = _mm256_blendv_ps(best_iscale, iscale, take);
    }
    let mut scales = [0f32; 8];
    // SAFETY: eight floats.
    unsafe { _mm256_storeu_ps(scales.as_mut_ptr(), scale) };
    let mut levels = [0u8; 128];
    let top = _mm256_set1_epi32(nmax);
    for (i, &v) in xv.iter().enumerate() {
        let q = _mm256_add_epi32(level(best_iscale, v), top);
        let mut t = [0i32; 8];
        // SAFETY: eight i32.
        unsafe { _mm256_storeu_si256(t.as_mut_ptr().cast(), q) };
        for (j, &tj) in t.iter().enumerate() {
            levels[16 * j + i] = tj as u8;
        }
    }
    for j in 0..8 {
        if flat[j] {
            scales[j] = 0.0;
            levels[16 * j..16 * j + 16].fill(nmax as u8);
        }
    }
    (scales, levels)
}

#[cfg(test)]
mod tests {
    #[test]
    fn quantizers_give_the_reference_bytes() {
        if !super::super::available() {
            return;
        }
        crate::quants::tests::check_kquant_quantizers([
            super::quantize_q4_k,
            super::quantize_q5_k,
            super::quantize_q6_k,
            super::quantize_q3_k,
        ]);
    }
}
