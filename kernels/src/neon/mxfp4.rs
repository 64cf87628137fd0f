//! MXFP4 (NEON, every level): a block's 4-bit codes unpacked as Q4_0's nibbles and mapped
//! through the doubled E2M1 table with one `tbl` per 16, multiplied with the Q8_0 activations
//! by widening multiplies (|w| ≤ 12), summed exactly to one integer per block, and scaled and
//! accumulated block by block in the reference's order: the scalar reference's bits.

use super::q8_0::nibbles;
use crate::quants::common::{check_dot, f16_at};
use crate::quants::mxfp4::{self, scale_half, KVALUES};
use crate::quants::q8_0;
use core::arch::aarch64::*;

#[target_feature(enable = "neon")]
fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, mxfp4::QK, w, mxfp4::BLOCK, a, q8_0::BLOCK);
    // SAFETY: `KVALUES` is 16 readable bytes.
    let t = unsafe { vld1q_s8(KVALUES.as_ptr()) };
    let mut sum = 0f32;
    for i in 0..nb {
        let bw = &w[i * mxfp4::BLOCK..(i + 1) * mxfp4::BLOCK];
        let ba = &a[i * q8_0::BLOCK..(i + 1) * q8_0::BLOCK];
        // SAFETY: 16 code bytes follow the scale byte; 32 quants follow the f16 scale.
        let s = unsafe {
            let [lo, hi] = nibbles(bw.as_ptr().add(1));
            let v = [vqtbl1q_s8(t, lo), vqtbl1q_s8(t, hi)];
            let y = [
                vld1q_s8(ba.as_ptr().add(2).cast()),
                vld1q_s8(ba.as_ptr().add(18).cast()),
            ];
            let mut acc = vdupq_n_s32(0);
            for k in 0..2 {
                acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(v[k]), vget_low_s8(y[k])));
                acc = vpadalq_s16(acc, vmull_high_s8(v[k], y[k]));
            }
            vaddvq_s32(acc)
        };
        sum += f16_at(ba, 0) * scale_half(bw[0]) * s as f32;
    }
    sum
}

/// `vec_dot` of the NEON tables.
pub(super) fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    // SAFETY: NEON is part of every aarch64 CPU this crate's NEON tables run on.
    unsafe { dot(n, w, a) }
}

#[cfg(test)]
mod tests {
    #[test]
    fn vec_dot_is_the_references_bits() {
        crate::quants::mxfp4::check_vec_dot(super::vec_dot);
    }
}
