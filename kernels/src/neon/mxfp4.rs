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
    use crate::quants::{mxfp4, q8_0};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn vec_dot_is_the_references_bits() {
        let mut rng = StdRng::seed_from_u64(3);
        for nb in [1usize, 2, 7, 64] {
            let n = nb * 32;
            let mut w = vec![0u8; nb * mxfp4::BLOCK];
            rng.fill(&mut w[..]);
            for (i, b) in w.chunks_exact_mut(mxfp4::BLOCK).enumerate() {
                b[0] = [0u8, 1, 2, 100, 127, 140, 254, 255][i % 8];
            }
            let x: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
            let mut a = vec![0u8; nb * q8_0::BLOCK];
            q8_0::quantize(&x, &mut a);
            let want = mxfp4::vec_dot(n, &w, &a);
            let got = super::vec_dot(n, &w, &a);
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{nb} blocks: {got} vs {want}"
            );
        }
    }
}
