//! Q2_K block format (scalar reference), byte-compatible with ggml's `block_q2_K`.
//!
//! Block of 256 values, 84 bytes: `scales[16] | qs[64] | f16 d | f16 dmin`.
//! Sixteen sub-blocks of 16 values; byte `scales[j]` holds the 4-bit scale of sub-block j in
//! its low nibble and the 4-bit min in its high nibble: `x = d·sc·q − dmin·m`, q in 0..4.
//! Value `e = 128 h + 32 k + i` (h in 0..2, k in 0..4, i in 0..32) is bits `2k, 2k+1` of
//! `qs[32 h + i]`.
//!
//! The dot product is exact in integers per block (`Σ sc·Σ q·a` and `Σ m·bsums`), then
//! scaled as Q4_K's: `ad·d·sumi − ad·dmin·summ`.

use crate::quants::q4_k::fit_scale_min;
use crate::quants::q8_k::{
    self, blocks, check_dequantize, check_dot, check_quantize, f16_at, nearest_int,
};
use crate::types::{GgmlType, QK_K};
use half::f16;

/// Activation format for dot products against Q2_K weights.
pub const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_K;

/// Bytes per block.
pub const BLOCK_BYTES: usize = 84;
/// Offset of the packed scale/min bytes.
pub(crate) const SCALES: usize = 0;
/// Offset of `qs` in a block.
pub(crate) const QS: usize = 16;
/// Offset of `d` (then `dmin`) in a block.
pub(crate) const D: usize = 80;

/// The 2-bit level (0..4) of value `e` of a block.
#[inline]
pub(crate) fn level(b: &[u8], e: usize) -> u8 {
    let (h, k, i) = (e / 128, (e % 128) / 32, e % 32);
    (b[QS + 32 * h + i] >> (2 * k)) & 3
}

/// Packs 256 levels (each < 4) into the 64 `qs` bytes, as `level` reads them.
pub(crate) fn pack_levels(l: &[u8; QK_K], qs: &mut [u8]) {
    for h in 0..2 {
        for i in 0..32 {
            let q = |k: usize| (l[128 * h + 32 * k + i] & 3) << (2 * k);
            qs[32 * h + i] = q(0) | q(1) | q(2) | q(3);
        }
    }
}

/// Quantizes 16 non-negative sub-block scales (or mins) to 4 bits against one f16 factor:
/// returns the factor (already f16) and the 4-bit values.
fn quantize_4bit(v: &[f32; 16]) -> (f16, [u8; 16]) {
    let max = v.iter().fold(0f32, |m, &x| m.max(x));
    if max <= 0.0 {
        return (f16::ZERO, [0; 16]);
    }
    let inv = 15.0 / max;
    (
        f16::from_f32(max / 15.0),
        v.map(|x| nearest_int(inv * x).clamp(0, 15) as u8),
    )
}

pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_dequantize(src, BLOCK_BYTES, dst);
    for (b, y) in blocks::<BLOCK_BYTES>(src, nb)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b, D);
        let dmin = f16_at(b, D + 2);
        for j in 0..16 {
            let s = b[SCALES + j];
            let (dl, ml) = (d * f32::from(s & 0xf), dmin * f32::from(s >> 4));
            for (e, v) in (16 * j..16 * j + 16).zip(&mut y[16 * j..16 * j + 16]) {
                *v = dl * f32::from(level(b, e)) - ml;
            }
        }
    }
}

/// Reference quantizer: per sub-block of 16, the `|x|`-weighted least-squares fit of
/// `x ≈ scale·q − min` (q in 0..4, Q4_K's grid search); the 16 scales and 16 mins to 4 bits
/// against f16 `d` and `dmin`; then every level re-fitted to the rounded scales.
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    let nb = check_quantize(src, dst, BLOCK_BYTES);
    for (x, b) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
        .take(nb)
    {
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; 16];
        let mut mins = [0f32; 16];
        let mut w = [0f32; 16];
        for j in 0..16 {
            let xs = &x[16 * j..16 * j + 16];
            for (wt, v) in w.iter_mut().zip(xs) {
                *wt = v.abs();
            }
            (scales[j], mins[j]) =
                fit_scale_min(xs, &w, 3, -0.5, 0.1, 15, &mut l[16 * j..16 * j + 16]);
        }
        let (d, sc) = quantize_4bit(&scales);
        let (dmin, m) = quantize_4bit(&mins);
        let (df, dminf) = (d.to_f32(), dmin.to_f32());
        for j in 0..16 {
            let dd = df * f32::from(sc[j]);
            if dd == 0.0 {
                continue;
            }
            let dm = dminf * f32::from(m[j]);
            for i in 16 * j..16 * j + 16 {
                l[i] = nearest_int((x[i] + dm) / dd).clamp(0, 3) as u8;
            }
        }
        for j in 0..16 {
            b[SCALES + j] = sc[j] | (m[j] << 4);
        }
        pack_levels(&l, &mut b[QS..QS + 64]);
        b[D..D + 2].copy_from_slice(&d.to_le_bytes());
        b[D + 2..D + 4].copy_from_slice(&dmin.to_le_bytes());
    }
}

pub fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, w, BLOCK_BYTES, a);
    let wbs = blocks::<BLOCK_BYTES>(w, nb);
    let abs = blocks::<{ q8_k::BLOCK_BYTES }>(a, nb);
    let mut sum = 0f32;
    for (b, ab) in wbs.iter().zip(abs) {
        let (mut sumi, mut summ) = (0i32, 0i32);
        for j in 0..16 {
            let s = b[SCALES + j];
            let p: i32 = (16 * j..16 * j + 16)
                .map(|e| i32::from(level(b, e)) * q8_k::q_of(ab, e))
                .sum();
            sumi += i32::from(s & 0xf) * p;
            summ += i32::from(s >> 4) * q8_k::bsum_of(ab, j);
        }
        let ad = q8_k::d_of(ab);
        sum += ad * f16_at(b, D) * sumi as f32 - ad * f16_at(b, D + 2) * summ as f32;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quants::q4_k::tests::{dot_error, gaussian, rel_rmse};

    #[test]
    fn hand_built_block_decodes() {
        let mut b = vec![0u8; BLOCK_BYTES];
        b[D..D + 2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[D + 2..D + 4].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        let sc = |j: usize| ((j * 7 + 3) % 16) as u8;
        let m = |j: usize| ((j * 5 + 1) % 16) as u8;
        for j in 0..16 {
            b[SCALES + j] = sc(j) | (m(j) << 4);
        }
        let lv = |e: usize| ((e * 3 + e / 64) % 4) as u8;
        // Packed by hand from the layout in the header, independently of `pack_levels`.
        for e in 0..QK_K {
            b[QS + 32 * (e / 128) + e % 32] |= lv(e) << (2 * ((e % 128) / 32));
        }
        let mut y = vec![0f32; QK_K];
        dequantize(&b, &mut y);
        for (e, v) in y.iter().enumerate() {
            let j = e / 16;
            let want = 0.5 * f32::from(sc(j)) * f32::from(lv(e)) - 0.25 * f32::from(m(j));
            assert_eq!(*v, want, "element {e}");
        }
    }

    #[test]
    fn zero_and_constant_inputs_decode_without_nan() {
        for x in [
            vec![0f32; 2 * QK_K],
            vec![-1.5f32; 2 * QK_K],
            vec![2.0f32; 2 * QK_K],
        ] {
            let mut q = vec![0xffu8; 2 * BLOCK_BYTES];
            quantize(&x, &mut q);
            let mut y = vec![0f32; x.len()];
            dequantize(&q, &mut y);
            for (a, b) in x.iter().zip(&y) {
                assert!(
                    b.is_finite() && (a - b).abs() <= 0.05 * a.abs().max(1e-3),
                    "{a} -> {b}"
                );
            }
        }
    }

    #[test]
    fn roundtrip_and_dot_errors_are_small() {
        let n = 8 * QK_K;
        let x = gaussian(35, n);
        let mut q = vec![0u8; 8 * BLOCK_BYTES];
        quantize(&x, &mut q);
        let mut y = vec![0f32; n];
        dequantize(&q, &mut y);
        // 2 bits plus a min: llama.cpp's `quantize_row_q2_K_ref` gives 0.296 on N(0, 1) data
        // (Q3_K 0.149, Q4_K 0.071).
        let rmse = rel_rmse(&x, &y);
        eprintln!("Q2_K roundtrip rmse {rmse}");
        assert!(rmse < 0.33, "rmse {rmse}");
        let a = gaussian(36, n);
        let e = dot_error(n, &q, &a, dequantize, vec_dot);
        assert!(e < 1e-2, "dot error {e}");
    }
}
