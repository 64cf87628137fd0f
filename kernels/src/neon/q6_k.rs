//! Q6_K × Q8_K (NEON): 6-bit values rebuilt from `ql`/`qh` and made signed (−32), one exact
//! i32 vector per 16-value sub-block scaled by its i8 scale.

use super::q8_k::{aq, KQuant};
use super::{f16_at, Dot};
use crate::quants::q6_k::{BLOCK_BYTES, D as WD, QH, SCALES};
use core::arch::aarch64::*;

pub(super) struct Q6K;

impl KQuant for Q6K {
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
        let (m4, m3, m32) = (vdupq_n_u8(0x0f), vdupq_n_u8(3), vdupq_n_s8(32));
        let mut sc = [0i8; 16];
        // SAFETY: the 16 scales lie inside the block (caller).
        unsafe { core::ptr::copy_nonoverlapping(w.add(SCALES).cast::<i8>(), sc.as_mut_ptr(), 16) };
        let mut acc = [zero; R];
        for h in 0..2 {
            // SAFETY: ql[64h..64h + 64] and qh[32h..32h + 32] lie inside the block (caller).
            let (ql, qh) = unsafe {
                let l = w.add(64 * h);
                let q = w.add(QH + 32 * h);
                (
                    [
                        vld1q_u8(l),
                        vld1q_u8(l.add(16)),
                        vld1q_u8(l.add(32)),
                        vld1q_u8(l.add(48)),
                    ],
                    [vld1q_u8(q), vld1q_u8(q.add(16))],
                )
            };
            for k in 0..4 {
                for v in 0..2 {
                    // Values 128h + 32k + 16v .. + 16: sub-block 8h + 2k + v.
                    let byte = ql[2 * (k % 2) + v];
                    let low = if k < 2 {
                        vandq_u8(byte, m4)
                    } else {
                        vshrq_n_u8::<4>(byte)
                    };
                    let high = match k {
                        0 => vandq_u8(qh[v], m3),
                        1 => vandq_u8(vshrq_n_u8::<2>(qh[v]), m3),
                        2 => vandq_u8(vshrq_n_u8::<4>(qh[v]), m3),
                        _ => vshrq_n_u8::<6>(qh[v]),
                    };
                    let q = vsubq_s8(
                        vreinterpretq_s8_u8(vorrq_u8(low, vshlq_n_u8::<4>(high))),
                        m32,
                    );
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
    fn q6_k_matches_reference() {
        super::super::tests::check_kquant(crate::GgmlType::Q6_K);
    }
}
