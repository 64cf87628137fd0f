//! Q4_K decode over repacked panels (`crate::repack`, `KPANEL` = 16 rows) with `sdot`: four
//! rows in the lanes of each of four registers. A 64-byte run of a group holds four nibble
//! bytes of each of the 16 rows, so one `sdot` against four activations broadcast to every
//! lane adds four products to each of four rows. The sub-block sums are exact integers,
//! scaled per lane by that row's 6-bit scale; the scales and mins of the 16 rows come from
//! the transposed scale bytes together. The float steps per block are the reference's, lane
//! by lane: every row gets `vec_dot`'s bits, as on x86.
//!
//! Only where `sdot` keeps the four products of a lane in that lane (the dotprod and i8mm
//! levels); the baseline NEON level keeps the row kernels.

use super::{f16x4, Dot, Sdot};
use crate::quants::q8_k::{self as q8, QS};
use crate::repack::kpanel::{D, DMIN, GROUP, QS as PQS, SCALES};
use crate::repack::KPANEL;
use core::arch::aarch64::*;

const AB: usize = q8::BLOCK_BYTES;

pub(super) fn dot_panels(n: usize, w: &[u8], a: &[u8], out: &mut [f32]) {
    let nb = crate::repack::kpanel::check_shapes(n, w, a, out);
    let a = q8::blocks::<AB>(a, nb);
    debug_assert!(Sdot::available());
    for (p, o) in out.chunks_exact_mut(KPANEL).enumerate() {
        let panel = &w[p * nb * GROUP..(p + 1) * nb * GROUP];
        // SAFETY: installed by `specialize_dotprod` only where the CPU has FEAT_DotProd.
        let v = unsafe { dot_panel(panel, a) };
        o.copy_from_slice(&v);
    }
}

/// 16 bytes of `b` from `at`.
#[inline]
#[target_feature(enable = "neon")]
fn ld(b: &[u8], at: usize) -> uint8x16_t {
    let s = &b[at..at + 16];
    // SAFETY: `s` holds the 16 bytes read.
    unsafe { vld1q_u8(s.as_ptr()) }
}

/// Four f16 of `b` from `at`, as f32.
#[inline]
#[target_feature(enable = "neon")]
fn f16s(b: &[u8], at: usize) -> float32x4_t {
    let s: [u8; 8] = std::array::from_fn(|i| b[at + i]);
    f16x4(u64::from_le_bytes(s))
}

/// The four activation bytes at `at` of a Q8_K block, in every 32-bit lane.
#[inline]
#[target_feature(enable = "neon")]
fn act4(ab: &[u8; AB], at: usize) -> int8x16_t {
    let v = i32::from_le_bytes([ab[at], ab[at + 1], ab[at + 2], ab[at + 3]]);
    vreinterpretq_s8_s32(vdupq_n_s32(v))
}

/// Lanes `4k..4k + 4` of 16 bytes, widened to i32.
#[inline]
#[target_feature(enable = "neon")]
fn quad(v: uint8x16_t, k: usize) -> int32x4_t {
    let h = if k < 2 {
        vmovl_u8(vget_low_u8(v))
    } else {
        vmovl_high_u8(v)
    };
    let w = if k % 2 == 0 {
        vmovl_u16(vget_low_u16(h))
    } else {
        vmovl_high_u16(h)
    };
    vreinterpretq_s32_u32(w)
}

/// One panel (`a.len()` groups in `panel`) against the activation row.
#[target_feature(enable = "neon,dotprod")]
unsafe fn dot_panel(panel: &[u8], a: &[[u8; AB]]) -> [f32; KPANEL] {
    assert!(panel.len() >= a.len() * GROUP);
    let low4 = vdupq_n_u8(0x0f);
    let low6 = vdupq_n_u8(63);
    let top2 = vdupq_n_u8(0xc0);
    let mut sum = [vdupq_n_f32(0.0); 4];
    for (i, ab) in a.iter().enumerate() {
        let g = &panel[i * GROUP..(i + 1) * GROUP];
        let s: [uint8x16_t; 12] = std::array::from_fn(|k| ld(g, SCALES + KPANEL * k));
        // ggml's `get_scale_min_k4` for 16 rows: bits 6-7 of a byte moved to bits 4-5.
        let top = |v: uint8x16_t| vshrq_n_u8::<2>(vandq_u8(v, top2));
        let mut sc = [vdupq_n_u8(0); 8];
        let mut m = [vdupq_n_u8(0); 8];
        for j in 0..4 {
            sc[j] = vandq_u8(s[j], low6);
            m[j] = vandq_u8(s[j + 4], low6);
            sc[j + 4] = vorrq_u8(vandq_u8(s[j + 8], low4), top(s[j]));
            m[j + 4] = vorrq_u8(vshrq_n_u8::<4>(s[j + 8]), top(s[j + 4]));
        }
        let mut si = [vdupq_n_s32(0); 4];
        for q in 0..4 {
            let mut lo = [vdupq_n_s32(0); 4];
            let mut hi = [vdupq_n_s32(0); 4];
            for c in 0..8 {
                let al = act4(ab, QS + 64 * q + 4 * c);
                let ah = act4(ab, QS + 64 * q + 32 + 4 * c);
                for k in 0..4 {
                    let run = ld(g, PQS + 64 * (8 * q + c) + 16 * k);
                    let ql = vreinterpretq_s8_u8(vandq_u8(run, low4));
                    let qh = vreinterpretq_s8_u8(vshrq_n_u8::<4>(run));
                    // SAFETY: this function has FEAT_DotProd.
                    unsafe {
                        lo[k] = Sdot::dot(lo[k], ql, al);
                        hi[k] = Sdot::dot(hi[k], qh, ah);
                    }
                }
            }
            for k in 0..4 {
                si[k] = vmlaq_s32(si[k], lo[k], quad(sc[2 * q], k));
                si[k] = vmlaq_s32(si[k], hi[k], quad(sc[2 * q + 1], k));
            }
        }
        let bs: [i32; 8] =
            std::array::from_fn(|j| q8::bsum_of(ab, 2 * j) + q8::bsum_of(ab, 2 * j + 1));
        let ad = vdupq_n_f32(q8::d_of(ab));
        for k in 0..4 {
            let mut sm = vdupq_n_s32(0);
            for j in 0..8 {
                sm = vmlaq_n_s32(sm, quad(m[j], k), bs[j]);
            }
            let d = f16s(g, D + 8 * k);
            let dmin = f16s(g, DMIN + 8 * k);
            let t = vsubq_f32(
                vmulq_f32(vmulq_f32(ad, d), vcvtq_f32_s32(si[k])),
                vmulq_f32(vmulq_f32(ad, dmin), vcvtq_f32_s32(sm)),
            );
            sum[k] = vaddq_f32(sum[k], t);
        }
    }
    let mut out = [0f32; KPANEL];
    for k in 0..4 {
        // SAFETY: `out` holds 16 f32; lanes 4k..4k + 4.
        unsafe { vst1q_f32(out.as_mut_ptr().add(4 * k), sum[k]) };
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn panels_give_the_reference_bits() {
        if !super::super::available_dotprod() {
            eprintln!("SKIPPED neon q4_k_panel: no dotprod here");
            return;
        }
        crate::repack::kpanel::check_dot_panels(super::dot_panels, "neon+dotprod");
    }
}
