//! Q4_K × Q8_K (NEON): nibbles as signed bytes against the activations, one exact i32 vector
//! per 32-element sub-block scaled by its 6-bit scale; the minima through the activations'
//! `bsums`.

use super::q8_k::{aq, mins_dot_bsums, KQuant};
use super::{f16_at, Dot};
use crate::quants::q4_k::{unpack_scales_words, BLOCK_BYTES, SCALES};
use core::arch::aarch64::*;

/// Offset of `qs` in a Q4_K block.
const WQS: usize = 16;

pub(super) struct Q4K;

/// The eight scales and the eight minima of the Q4_K/Q5_K block at `w`, one per byte.
///
/// # Safety
/// `w` points to a whole Q4_K or Q5_K block.
#[inline]
#[target_feature(enable = "neon")]
pub(super) unsafe fn scales_mins(w: *const u8) -> ([u8; 8], u64) {
    let mut s = [0u8; 12];
    // SAFETY: the 12 scale bytes lie inside the block (caller).
    unsafe { core::ptr::copy_nonoverlapping(w.add(SCALES), s.as_mut_ptr(), 12) };
    let (sc, m) = unpack_scales_words(&s);
    let sc = u64::from(sc[0]) | (u64::from(sc[1]) << 32);
    let m = u64::from(m[0]) | (u64::from(m[1]) << 32);
    (sc.to_le_bytes(), m)
}

impl KQuant for Q4K {
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
        let m4 = vdupq_n_u8(0x0f);
        let mut acc = [zero; R];
        for g in 0..4 {
            // SAFETY: the 32 bytes of group g lie inside the block's qs (caller).
            let bits = unsafe {
                let p = w.add(WQS + 32 * g);
                [vld1q_u8(p), vld1q_u8(p.add(16))]
            };
            // Nibbles are below 128: the same as signed bytes.
            let lo = bits.map(|b| vreinterpretq_s8_u8(vandq_u8(b, m4)));
            let hi = bits.map(|b| vreinterpretq_s8_u8(vshrq_n_u8::<4>(b)));
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
    fn q4_k_matches_reference() {
        super::super::tests::check_kquant(crate::GgmlType::Q4_K);
    }
}
