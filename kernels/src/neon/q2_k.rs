//! Q2_K × Q8_K (NEON): the 2-bit levels as signed bytes against the activations, one exact
//! i32 vector per 16-value sub-block scaled by its 4-bit scale; the mins through the
//! activations' `bsums`.

use super::q8_k::{aq, KQuant, ABSUMS};
use super::{f16_at, Dot};
use crate::quants::q2_k::{BLOCK_BYTES, D as WD, QS as WQS, SCALES};
use core::arch::aarch64::*;

pub(super) struct Q2K;

/// Bits `2k, 2k + 1` of every byte of `v`, as bytes 0..4 (`k` is a constant after inlining
/// into the unrolled loops).
#[inline]
#[target_feature(enable = "neon")]
pub(super) fn crumb(v: uint8x16_t, k: usize) -> int8x16_t {
    let s = match k {
        0 => v,
        1 => vshrq_n_u8::<2>(v),
        2 => vshrq_n_u8::<4>(v),
        _ => vshrq_n_u8::<6>(v),
    };
    vreinterpretq_s8_u8(vandq_u8(s, vdupq_n_u8(3)))
}

impl KQuant for Q2K {
    const WB: usize = BLOCK_BYTES;
    const MIN: bool = true;

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn header(w: *const u8) -> (f32, f32) {
        // SAFETY: d and dmin are the block's last four bytes (caller).
        unsafe { (f16_at(w.add(WD)), f16_at(w.add(WD + 2))) }
    }

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn block<D: Dot, const R: usize>(w: *const u8, a: [*const u8; R]) -> [(i32, i32); R] {
        let zero = vdupq_n_s32(0);
        let mut sc = [0u8; 16];
        // SAFETY: the 16 scale bytes lie inside the block (caller).
        unsafe { core::ptr::copy_nonoverlapping(w.add(SCALES), sc.as_mut_ptr(), 16) };
        // SAFETY: as above.
        let mins = vshrq_n_u8::<4>(unsafe { vld1q_u8(w.add(SCALES)) });
        let mins = [
            vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(mins))),
            vreinterpretq_s16_u16(vmovl_high_u8(mins)),
        ];
        let mut acc = [zero; R];
        for h in 0..2 {
            // SAFETY: qs[32h..32h + 32] lies inside the block (caller).
            let bits = unsafe {
                let p = w.add(WQS + 32 * h);
                [vld1q_u8(p), vld1q_u8(p.add(16))]
            };
            for k in 0..4 {
                for (v, &b) in bits.iter().enumerate() {
                    // Values 128h + 32k + 16v .. + 16: sub-block 8h + 2k + v.
                    let q = crumb(b, k);
                    let j = 8 * h + 2 * k + v;
                    for (acc, &ar) in acc.iter_mut().zip(&a) {
                        // SAFETY: a whole activation block (caller); the CPU has D's features.
                        let p = unsafe { D::dot(zero, q, aq(ar, 16 * j)) };
                        *acc = vmlaq_n_s32(*acc, p, i32::from(sc[j] & 0xf));
                    }
                }
            }
        }
        core::array::from_fn(|r| {
            // SAFETY: the 16 i16 sums lie inside the activation block (caller).
            let (b0, b1) = unsafe {
                (
                    vld1q_s16(a[r].add(ABSUMS).cast()),
                    vld1q_s16(a[r].add(ABSUMS + 16).cast()),
                )
            };
            // |m · bsum| ≤ 15 · 16 · 128: exact in i32.
            let p = vmull_s16(vget_low_s16(b0), vget_low_s16(mins[0]));
            let p = vmlal_high_s16(p, b0, mins[0]);
            let p = vmlal_s16(p, vget_low_s16(b1), vget_low_s16(mins[1]));
            let p = vmlal_high_s16(p, b1, mins[1]);
            (vaddvq_s32(acc[r]), vaddvq_s32(p))
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn q2_k_matches_reference() {
        super::super::tests::check_kquant(crate::GgmlType::Q2_K);
    }
}
