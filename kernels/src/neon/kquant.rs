//! The K-quant weight quantizers' scale searches on NEON: `avx2/kquant.rs`'s eight-lane
//! searches (Q4_K/Q5_K's `make_qkx2_quants`, Q6_K/Q3_K's symmetric search) with each 8-lane
//! value held as two 4-lane registers.
//!
//! Each lane does the reference's arithmetic in the reference's order: the same multiplies
//! and adds (no fused multiply-add), its sums taken element by element, its comparisons with
//! the same NaN behaviour, rounding by `fcvtns` (round half to even, as `nearest_int`; NaN
//! becomes 0 as there). So the bytes `ringllm convert` writes on an ARM machine are the
//! reference's, and the x86 ones.

use crate::quants::q4_k::{lanes8, Lanes8};
use crate::types::QK_K;
use core::arch::aarch64::*;

/// Eight f32 lanes.
#[derive(Clone, Copy)]
struct F8([float32x4_t; 2]);
/// Eight i32 lanes.
#[derive(Clone, Copy)]
struct I8([int32x4_t; 2]);
/// Eight lane masks.
#[derive(Clone, Copy)]
struct M8([uint32x4_t; 2]);

macro_rules! lanewise {
    ($name:ident($($a:ident: $t:ty),*) -> $r:ident = $f:ident) => {
        #[inline]
        #[target_feature(enable = "neon")]
        fn $name($($a: $t),*) -> $r {
            $r([0, 1].map(|h| $f($($a.0[h]),*)))
        }
    };
}
lanewise!(add(a: F8, b: F8) -> F8 = vaddq_f32);
lanewise!(sub(a: F8, b: F8) -> F8 = vsubq_f32);
lanewise!(mul(a: F8, b: F8) -> F8 = vmulq_f32);
lanewise!(div(a: F8, b: F8) -> F8 = vdivq_f32);
lanewise!(round(a: F8) -> I8 = vcvtnq_s32_f32);
lanewise!(to_f(a: I8) -> F8 = vcvtq_f32_s32);
lanewise!(min_i(a: I8, b: I8) -> I8 = vminq_s32);
lanewise!(max_i(a: I8, b: I8) -> I8 = vmaxq_s32);
lanewise!(add_i(a: I8, b: I8) -> I8 = vaddq_s32);
lanewise!(gt(a: F8, b: F8) -> M8 = vcgtq_f32);
lanewise!(lt(a: F8, b: F8) -> M8 = vcltq_f32);
lanewise!(le(a: F8, b: F8) -> M8 = vcleq_f32);
lanewise!(eq(a: F8, b: F8) -> M8 = vceqq_f32);
lanewise!(and_m(a: M8, b: M8) -> M8 = vandq_u32);
lanewise!(not(a: M8) -> M8 = vmvnq_u32);

/// `b` where `m` is set, else `a` (`blendv(a, b, m)`).
#[inline]
#[target_feature(enable = "neon")]
fn blend(a: F8, b: F8, m: M8) -> F8 {
    F8([0, 1].map(|h| vbslq_f32(m.0[h], b.0[h], a.0[h])))
}

/// `a` where `m` is set, else 0.
#[inline]
#[target_feature(enable = "neon")]
fn keep(a: F8, m: M8) -> F8 {
    F8([0, 1].map(|h| vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(a.0[h]), m.0[h]))))
}

#[inline]
#[target_feature(enable = "neon")]
fn splat(v: f32) -> F8 {
    F8([vdupq_n_f32(v); 2])
}

#[inline]
#[target_feature(enable = "neon")]
fn splat_i(v: i32) -> I8 {
    I8([vdupq_n_s32(v); 2])
}

#[inline]
#[target_feature(enable = "neon")]
fn load(v: &[f32; 8]) -> F8 {
    // SAFETY: eight floats.
    F8([0, 1].map(|h| unsafe { vld1q_f32(v.as_ptr().add(4 * h)) }))
}

#[inline]
#[target_feature(enable = "neon")]
fn store(v: F8) -> [f32; 8] {
    let mut out = [0f32; 8];
    for h in 0..2 {
        // SAFETY: eight floats; lanes 4h..4h + 4.
        unsafe { vst1q_f32(out.as_mut_ptr().add(4 * h), v.0[h]) };
    }
    out
}

#[inline]
#[target_feature(enable = "neon")]
fn store_i(v: I8) -> [i32; 8] {
    let mut out = [0i32; 8];
    for h in 0..2 {
        // SAFETY: eight i32; lanes 4h..4h + 4.
        unsafe { vst1q_s32(out.as_mut_ptr().add(4 * h), v.0[h]) };
    }
    out
}

pub(super) fn quantize_q4_k(src: &[f32], dst: &mut [u8]) {
    crate::quants::q4_k::quantize_with(src, dst, fit8);
}

pub(super) fn quantize_q5_k(src: &[f32], dst: &mut [u8]) {
    crate::quants::q5_k::quantize_with(src, dst, fit8);
}

/// `Fit8` with the eight searches in the lanes of NEON register pairs.
fn fit8(
    x: &[f32],
    w: &[f32; QK_K],
    nmax: u8,
    rmin: f32,
    nstep: u32,
    l: &mut [u8; QK_K],
) -> ([f32; 8], [f32; 8]) {
    // SAFETY: NEON is part of every AArch64 CPU.
    unsafe { fit8_neon(&x[..QK_K], w, nmax, rmin, nstep, l) }
}

#[target_feature(enable = "neon")]
fn fit8_neon(
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
    let xv: [F8; 32] = std::array::from_fn(|i| load(&xt[i]));
    let wv: [F8; 32] = std::array::from_fn(|i| load(&wt[i]));
    let (lo, hi, sum_w, sum_x) = (
        load(&start[0]),
        load(&start[1]),
        load(&start[2]),
        load(&start[3]),
    );
    let nmaxf = splat(f32::from(nmax));
    let top = splat_i(i32::from(nmax));
    let zero_i = splat_i(0);
    let zero = splat(0.0);
    let range = sub(hi, lo);

    // nearest_int(iscale * (v - lo)).clamp(0, nmax), as floats.
    let grid = |iscale: F8, out: &mut [F8; 32]| {
        for (o, &v) in out.iter_mut().zip(&xv) {
            let q = round(mul(iscale, sub(v, lo)));
            *o = to_f(min_i(max_i(q, zero_i), top));
        }
    };
    // Σ wt · e · e with e = scale · l + offset − v, element by element.
    let error = |scale: F8, offset: F8, ls: &[F8; 32]| {
        let mut acc = zero;
        for ((&v, &wt), &l) in xv.iter().zip(&wv).zip(ls) {
            let e = sub(add(mul(scale, l), offset), v);
            acc = add(acc, mul(mul(wt, e), e));
        }
        acc
    };

    let mut best_scale = div(range, nmaxf);
    let mut best_offset = lo;
    let mut q = [zero; 32];
    grid(div(nmaxf, range), &mut q);
    let mut best = error(best_scale, best_offset, &q);
    let mut cand = [zero; 32];
    for k in 0..=nstep {
        let num = splat(rmin + RDELTA * k as f32 + f32::from(nmax));
        grid(div(num, range), &mut cand);
        let (mut sl, mut sll, mut sxl) = (zero, zero, zero);
        for ((&v, &wt), &l) in xv.iter().zip(&wv).zip(cand.iter()) {
            let wl = mul(wt, l);
            sl = add(sl, wl);
            sll = add(sll, mul(wl, l));
            sxl = add(sxl, mul(wl, v));
        }
        let det = sub(mul(sum_w, sll), mul(sl, sl));
        // The reference skips a candidate when `det <= 0` (not when det is NaN).
        let live = not(le(det, zero));
        let mut scale = div(sub(mul(sum_w, sxl), mul(sum_x, sl)), det);
        let mut offset = div(sub(mul(sll, sum_x), mul(sl, sxl)), det);
        let positive = gt(offset, zero);
        offset = blend(offset, zero, positive);
        scale = blend(scale, div(sxl, sll), positive);
        let e = error(scale, offset, &cand);
        let take = and_m(live, lt(e, best));
        for (qi, &ci) in q.iter_mut().zip(&cand) {
            *qi = blend(*qi, ci, take);
        }
        best = blend(best, e, take);
        best_scale = blend(best_scale, scale, take);
        best_offset = blend(best_offset, offset, take);
    }

    let mut scales = store(best_scale);
    let mut mins = store(best_offset).map(|o| -o);
    for (i, qi) in q.iter().enumerate() {
        for (j, &vj) in store(*qi).iter().enumerate() {
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
/// to a register pair.
fn fit_sym16(x: &[f32], nmax: i32, l: &mut [u8; QK_K]) -> [f32; 16] {
    let mut out = [0f32; 16];
    for half in 0..2 {
        let xs = &x[128 * half..128 * half + 128];
        // SAFETY: NEON is part of every AArch64 CPU.
        let (sc, lv) = unsafe { fit_sym8(xs, nmax) };
        out[8 * half..8 * half + 8].copy_from_slice(&sc);
        l[128 * half..128 * half + 128].copy_from_slice(&lv);
    }
    out
}

/// Eight sub-blocks of 16 (`x[16 j..16 j + 16]` in lane j), each lane the reference's steps.
#[target_feature(enable = "neon")]
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
    let xv: [F8; 16] = std::array::from_fn(|i| load(&xt[i]));
    let maxv = load(&max);
    let zero = splat(0.0);
    let (lo, hi) = (splat_i(-nmax), splat_i(nmax - 1));
    // nearest_int(iscale · v).clamp(-nmax, nmax - 1); NaN rounds to 0 as in `nearest_int`.
    let level = |iscale: F8, v: F8| {
        let p = mul(iscale, v);
        let p = keep(p, eq(p, p));
        min_i(max_i(round(p), lo), hi)
    };
    let sums = |iscale: F8| {
        let (mut slx, mut sll) = (zero, zero);
        for &v in &xv {
            let l = to_f(level(iscale, v));
            let w = mul(v, v);
            slx = add(slx, mul(mul(w, v), l));
            sll = add(sll, mul(mul(w, l), l));
        }
        (slx, sll)
    };
    let mut best_iscale = div(splat(-(nmax as f32)), maxv);
    let (slx, sll) = sums(best_iscale);
    let pos = gt(sll, zero);
    let mut scale = keep(div(slx, sll), pos);
    let mut best = mul(scale, slx);
    for k in (-9..=9).filter(|k| *k != 0) {
        let iscale = div(splat(-(nmax as f32 + 0.1 * k as f32)), maxv);
        let (slx, sll) = sums(iscale);
        let take = and_m(gt(sll, zero), gt(mul(slx, slx), mul(best, sll)));
        let s = div(slx, sll);
        scale = blend(scale, s, take);
        best = blend(best, mul(s, slx), take);
        best_iscale = blend(best_iscale, iscale, take);
    }
    let mut scales = store(scale);
    let mut levels = [0u8; 128];
    let top = splat_i(nmax);
    for (i, &v) in xv.iter().enumerate() {
        let t = store_i(add_i(level(best_iscale, v), top));
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
        crate::quants::tests::check_kquant_quantizers([
            super::quantize_q4_k,
            super::quantize_q5_k,
            super::quantize_q6_k,
            super::quantize_q3_k,
        ]);
    }
}
