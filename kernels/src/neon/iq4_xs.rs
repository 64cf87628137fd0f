//! IQ4_XS × Q8_K (NEON): per 32-element sub-block the indices are unpacked as nibbles and
//! mapped through the codebook with `tbl`, dotted with the activations into one exact i32
//! vector (`Dot`: |w| ≤ 127 and |a| ≤ 128, so no i16 pair overflows at the plain level) and
//! scaled by the sub-block scale; the K-quant loop applies the reference's float steps.

use super::iq4_nl::codebook;
use super::q8_k::{aq, KQuant};
use super::{f16_at, Dot};
use crate::quants::iq4_xs::{scales, BLOCK_BYTES, QS, SCALES_H};
use core::arch::aarch64::*;

pub(super) struct Iq4Xs;

impl KQuant for Iq4Xs {
    const WB: usize = BLOCK_BYTES;
    const MIN: bool = false;

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn header(w: *const u8) -> (f32, f32) {
        // SAFETY: d is the block's first two bytes (caller).
        unsafe { (f16_at(w), 0.0) }
    }

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn block<D: Dot, const R: usize>(w: *const u8, a: [*const u8; R]) -> [(i32, i32); R] {
        let mut hdr = [0u8; QS];
        // SAFETY: the scale bytes lie inside the block (caller).
        unsafe { core::ptr::copy_nonoverlapping(w, hdr.as_mut_ptr(), QS) };
        debug_assert_eq!(SCALES_H, 2);
        let ls = scales(&hdr);
        let t = codebook();
        let m4 = vdupq_n_u8(0x0f);
        let zero = vdupq_n_s32(0);
        let mut acc = [zero; R];
        for (ib, &l) in ls.iter().enumerate() {
            // SAFETY: the 16 index bytes of sub-block ib lie inside the block (caller).
            let raw = unsafe { vld1q_u8(w.add(QS + 16 * ib)) };
            let lo = vqtbl1q_s8(t, vandq_u8(raw, m4));
            let hi = vqtbl1q_s8(t, vshrq_n_u8::<4>(raw));
            for (acc, &ar) in acc.iter_mut().zip(&a) {
                // SAFETY: whole activation blocks (caller); the CPU has D's features (caller).
                unsafe {
                    let p = D::dot(D::dot(zero, lo, aq(ar, 32 * ib)), hi, aq(ar, 32 * ib + 16));
                    *acc = vmlaq_n_s32(*acc, p, l);
                }
            }
        }
        core::array::from_fn(|r| (vaddvq_s32(acc[r]), 0))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn iq4_xs_matches_reference() {
        super::super::tests::check_kquant(crate::GgmlType::IQ4_XS);
    }
}
