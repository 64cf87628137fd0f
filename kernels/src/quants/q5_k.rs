//! Q5_K block format (scalar reference), byte-compatible with ggml's `block_q5_K`.
//!
//! Block of 256 values, 176 bytes: `f16 d | f16 dmin | scales[12] | qh[32] | qs[128]`.
//! As Q4_K (same scale packing, same nibble order) plus a fifth bit per value: for the
//! 64-value group g, bit 2g of `qh[i]` belongs to value `64 g + i` (low nibble) and bit
//! 2g+1 to value `64 g + 32 + i` (high nibble). `x = d * sc * q - dmin * m`, q in 0..32.

use crate::quants::q4_k::{
    mins_dot_bsums, pack_scales, quantize_levels, scale_bytes, unpack_scales, SCALES,
};
use crate::quants::q8_k::{self, blocks, check_dequantize, check_dot, check_quantize, f16_at};
use crate::types::{GgmlType, QK_K};

/// Activation format for dot products against Q5_K weights.
pub const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_K;

/// Bytes per block.
pub const BLOCK_BYTES: usize = 176;
/// Offset of `qh` in a block.
const QH: usize = 16;
/// Offset of `qs` in a block.
const QS: usize = 48;

/// The 5-bit level of value `e` (0..256) of a block.
#[inline]
fn level(b: &[u8], e: usize) -> u8 {
    let (g, half, i) = (e / 64, (e / 32) % 2, e % 32);
    let nib = if half == 0 {
        b[QS + 32 * g + i] & 0xf
    } else {
        b[QS + 32 * g + i] >> 4
    };
    let hbit = (b[QH + i] >> (2 * g + half)) & 1;
    nib | (hbit << 4)
}

pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_dequantize(src, BLOCK_BYTES, dst);
    for (b, y) in blocks::<BLOCK_BYTES>(src, nb)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b, 0);
        let dmin = f16_at(b, 2);
        let (sc, m) = unpack_scales(&scale_bytes(b));
        for j in 0..8 {
            let (dj, mj) = (d * f32::from(sc[j]), dmin * f32::from(m[j]));
            for (e, v) in (32 * j..32 * j + 32).zip(&mut y[32 * j..32 * j + 32]) {
                *v = dj * f32::from(level(b, e)) - mj;
            }
        }
    }
}

pub fn quantize(src: &[f32], dst: &mut [u8]) {
    quantize_with(src, dst, super::q4_k::fit8_reference);
}

/// `quantize` with the scale search `fit8` (the reference's or a SIMD one giving its bits).
pub(crate) fn quantize_with(src: &[f32], dst: &mut [u8], fit8: super::q4_k::Fit8) {
    let nb = check_quantize(src, dst, BLOCK_BYTES);
    for (x, b) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
        .take(nb)
    {
        let mut l = [0u8; QK_K];
        let (d, dmin, sc, m) = quantize_levels(x, 31, &mut l, fit8);
        b[0..2].copy_from_slice(&d.to_le_bytes());
        b[2..4].copy_from_slice(&dmin.to_le_bytes());
        b[SCALES..SCALES + 12].copy_from_slice(&pack_scales(&sc, &m));
        b[QH..QH + 32].fill(0);
        for g in 0..4 {
            for i in 0..32 {
                let (l1, l2) = (l[64 * g + i], l[64 * g + 32 + i]);
                b[QS + 32 * g + i] = (l1 & 0xf) | ((l2 & 0xf) << 4);
                b[QH + i] |= ((l1 >> 4) << (2 * g)) | ((l2 >> 4) << (2 * g + 1));
            }
        }
    }
}

pub fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, w, BLOCK_BYTES, a);
    let wbs = blocks::<BLOCK_BYTES>(w, nb);
    let abs = blocks::<{ q8_k::BLOCK_BYTES }>(a, nb);
    let mut sum = 0f32;
    for (b, ab) in wbs.iter().zip(abs) {
        let (sc, m) = unpack_scales(&scale_bytes(b));
        let mut sumi = 0i32;
        for (j, &scale) in sc.iter().enumerate().take(8) {
            let s: i32 = (32 * j..32 * j + 32)
                .map(|e| i32::from(level(b, e)) * q8_k::q_of(ab, e))
                .sum();
            sumi += i32::from(scale) * s;
        }
        let summ = mins_dot_bsums(&m, ab);
        let ad = q8_k::d_of(ab);
        sum += ad * f16_at(b, 0) * sumi as f32 - ad * f16_at(b, 2) * summ as f32;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quants::q4_k::tests::{dot_error, gaussian, rel_rmse};
    use half::f16;

    #[test]
    fn hand_built_block_decodes() {
        let sc = [1, 2, 3, 4, 40, 50, 60, 63];
        let m = [0, 5, 17, 33, 1, 47, 63, 20];
        let mut b = vec![0u8; BLOCK_BYTES];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        b[SCALES..SCALES + 12].copy_from_slice(&pack_scales(&sc, &m));
        let lv = |e: usize| ((e * 13 + e / 64) % 32) as u8;
        // Pack by hand, independently of `level`.
        for e in 0..QK_K {
            let (g, half, i) = (e / 64, (e / 32) % 2, e % 32);
            b[QS + 32 * g + i] |= (lv(e) & 0xf) << (4 * half);
            b[QH + i] |= (lv(e) >> 4) << (2 * g + half);
        }
        let mut y = vec![0f32; QK_K];
        dequantize(&b, &mut y);
        for (e, v) in y.iter().enumerate() {
            let j = e / 32;
            let want = 0.5 * f32::from(sc[j]) * f32::from(lv(e)) - 0.25 * f32::from(m[j]);
            assert_eq!(*v, want, "element {e}");
        }
    }

    #[test]
    fn zero_input_decodes_to_zero() {
        let mut q = vec![0xffu8; 2 * BLOCK_BYTES];
        quantize(&[0f32; 2 * QK_K], &mut q);
        let mut y = vec![1f32; 2 * QK_K];
        dequantize(&q, &mut y);
        assert!(y.iter().all(|v| *v == 0.0));
    }

    #[test]
    fn roundtrip_and_dot_errors_are_small() {
        let n = 8 * QK_K;
        let x = gaussian(15, n);
        let mut q = vec![0u8; 8 * BLOCK_BYTES];
        quantize(&x, &mut q);
        let mut y = vec![0f32; n];
        dequantize(&q, &mut y);
        let rmse = rel_rmse(&x, &y);
        assert!(rmse < 0.05, "rmse {rmse}");
        let a = gaussian(16, n);
        let e = dot_error(n, &q, &a, dequantize, vec_dot);
        assert!(e < 1e-2, "dot error {e}");
    }
}
