//! Q5_K × Q8_K (NEON): as Q4_K, with the fifth bit of each value taken from `qh` (two bits per
//! 64-value group, shifted down as the groups go).

use super::q4_k::scales_mins;
use super::q8_k::{aq, mins_dot_bsums, KQuant};
use super::{f16_at, Dot};
use crate::quants::q5_k::BLOCK_BYTES;
use core::arch::aarch64::*;

/// Offset of `qh` in a Q5_K block.
const WQH: usize = 16;
/// Offset of `qs` in a Q5_K block.
const WQS: usize = 48;

pub(super) struct Q5K;

impl KQuant for Q5K {
    const WB: usize = BLOCK_BYTES;
    const MIN: bool = true;

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn header(w: *const u8) -> (f32, f32) {
        // SAFETY: d and dmin are the block's first four bytes (caller).
        unsafe { (f16_at(w), f16_at(w.add(2))) }
    }

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn block<D: Dot, const R: usize>(w: *const u8, a: [*const u8; R]) -> [(i32, i32); R] {
        // SAFETY: a whole block at `w` (caller).
        let (sc, m) = unsafe { scales_mins(w) };
        let zero = vdupq_n_s32(0);
        let (m4, one, two) = (vdupq_n_u8(0x0f), vdupq_n_u8(1), vdupq_n_u8(2));
        // SAFETY: qh lies inside the block (caller).
        let mut qh = unsafe { [vld1q_u8(w.add(WQH)), vld1q_u8(w.add(WQH + 16))] };
        let mut acc = [zero; R];
        for g in 0..4 {
            // SAFETY: the 32 bytes of group g lie inside the block's qs (caller).
            let bits = unsafe {
                let p = w.add(WQS + 32 * g);
                [vld1q_u8(p), vld1q_u8(p.add(16))]
            };
            // Values below 32: the same as signed bytes.
            let lo: [int8x16_t; 2] = core::array::from_fn(|k| {
                let h = vshlq_n_u8::<4>(vandq_u8(qh[k], one));
                vreinterpretq_s8_u8(vorrq_u8(vandq_u8(bits[k], m4), h))
            });
            let hi: [int8x16_t; 2] = core::array::from_fn(|k| {
                let h = vshlq_n_u8::<3>(vandq_u8(qh[k], two));
                vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(bits[k]), h))
            });
            qh = qh.map(|v| vshrq_n_u8::<2>(v));
            for (acc, &ar) in acc.iter_mut().zip(&a) {
                // SAFETY: whole activation blocks (caller); the CPU has D's features (caller).
                unsafe {
                    let pl = D::dot(
                        D::dot(zero, lo[0], aq(ar, 64 * g)),
                        lo[1],
                        aq(ar, 64 * g + 16),
                    );
                    let ph = D::dot(
                        D::dot(zero, hi[0], aq(ar, 64 * g + 32)),
                        hi[1],
                        aq(ar, 64 * g + 48),
                    );
                    *acc = vmlaq_n_s32(*acc, pl, i32::from(sc[2 * g]));
                    *acc = vmlaq_n_s32(*acc, ph, i32::from(sc[2 * g + 1]));
                }
            }
        }
        // SAFETY: whole activation blocks (caller).
        core::array::from_fn(|r| (vaddvq_s32(acc[r]), unsafe { mins_dot_bsums(m, a[r]) }))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn q5_k_matches_reference() {
        super::super::tests::check_kquant(crate::GgmlType::Q5_K);
    }
}
