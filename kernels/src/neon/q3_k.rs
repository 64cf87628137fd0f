//! Q3_K × Q8_K (NEON): the 3-bit levels rebuilt from `qs` and `hmask` and made signed (−4),
//! one exact i32 vector per 16-value sub-block scaled by its signed 6-bit scale.

use super::q2_k::crumb;
use super::q8_k::{aq, KQuant};
use super::{f16_at, Dot};
use crate::quants::q3_k::{scales, BLOCK_BYTES, D as WD, HMASK, QS as WQS};
use core::arch::aarch64::*;

pub(super) struct Q3K;

impl KQuant for Q3K {
    const WB: usize = BLOCK_BYTES;
    const MIN: bool = false;

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn header(w: *const u8) -> (f32, f32) {
        // SAFETY: d lies inside the block (caller).
        unsafe { (f16_at(w.add(WD)), 0.0) }
    }

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn block<D: Dot, const R: usize>(w: *const u8, a: [*const u8; R]) -> [(i32, i32); R] {
        let zero = vdupq_n_s32(0);
        // SAFETY: a whole block at `w` (caller).
        let sc = scales(unsafe { core::slice::from_raw_parts(w, BLOCK_BYTES) });
        // SAFETY: hmask lies inside the block (caller).
        let hm = unsafe { [vld1q_u8(w.add(HMASK)), vld1q_u8(w.add(HMASK + 16))] };
        let four = vdupq_n_s8(4);
        let mut acc = [zero; R];
        for h in 0..2 {
            // SAFETY: qs[32h..32h + 32] lies inside the block (caller).
            let bits = unsafe {
                let p = w.add(WQS + 32 * h);
                [vld1q_u8(p), vld1q_u8(p.add(16))]
            };
            for k in 0..4 {
                let bit = vdupq_n_u8(1 << (4 * h + k));
                for v in 0..2 {
                    // q − 4: minus 4 where the third bit is clear.
                    let clear = vreinterpretq_s8_u8(vceqzq_u8(vandq_u8(hm[v], bit)));
                    let q = vsubq_s8(crumb(bits[v], k), vandq_s8(clear, four));
                    let j = 8 * h + 2 * k + v;
                    for (acc, &ar) in acc.iter_mut().zip(&a) {
                        // SAFETY: a whole activation block (caller); the CPU has D's features.
                        let p = unsafe { D::dot(zero, q, aq(ar, 16 * j)) };
                        *acc = vmlaq_n_s32(*acc, p, i32::from(sc[j]));
                    }
                }
            }
        }
        core::array::from_fn(|r| (vaddvq_s32(acc[r]), 0))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn q3_k_matches_reference() {
        super::super::tests::check_kquant(crate::GgmlType::Q3_K);
    }
}
