//! Q3_K block format (scalar reference), byte-compatible with ggml's `block_q3_K`.
//!
//! Block of 256 values, 110 bytes: `hmask[32] | qs[64] | scales[12] | f16 d`.
//! Sixteen sub-blocks of 16 values, `x = d·(s − 32)·(q − 4)` with q in 0..8 and the 6-bit
//! scale s. Value `e = 128 h + 32 k + i` (h in 0..2, k in 0..4, i in 0..32) has its low two
//! bits at bits `2k, 2k+1` of `qs[32 h + i]` (as Q2_K) and its third bit at bit `e / 32` of
//! `hmask[i]`. Scale j's low four bits are the low (j < 8) or high (j ≥ 8) nibble of
//! `scales[j % 8]`, its top two bits are bits `2 (j / 4)`, `2 (j / 4) + 1` of
//! `scales[8 + j % 4]`.
//!
//! The dot product is exact in integers per block (`Σ (s − 32)·Σ (q − 4)·a`), then scaled
//! once: `ad·d·sumi`.

use crate::quants::q2_k::pack_levels;
use crate::quants::q8_k::{
    self, blocks, check_dequantize, check_dot, check_quantize, f16_at, nearest_int,
};
use crate::types::{GgmlType, QK_K};
use half::f16;

/// Activation format for dot products against Q3_K weights.
pub const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_K;

/// Bytes per block.
pub const BLOCK_BYTES: usize = 110;
/// Offset of `hmask` (the third bits).
pub(crate) const HMASK: usize = 0;
/// Offset of `qs` (the low two bits).
pub(crate) const QS: usize = 32;
/// Offset of the packed 6-bit scales.
pub(crate) const SCALES: usize = 96;
/// Offset of `d`.
pub(crate) const D: usize = 108;

/// The sixteen 6-bit scales (0..64, before the −32) of a block, one per byte: four
/// little-endian words, word w holding scales `4w .. 4w + 4`.
#[inline]
pub(crate) fn unpack_scales_words(s: &[u8; 12]) -> [u32; 4] {
    let a = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let b = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let c = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    [
        (a & LOW4) | ((c & LOW2) << 4),
        (b & LOW4) | (((c >> 2) & LOW2) << 4),
        ((a >> 4) & LOW4) | (((c >> 4) & LOW2) << 4),
        ((b >> 4) & LOW4) | (((c >> 6) & LOW2) << 4),
    ]
}

/// The sixteen signed scales `s − 32` of a block.
#[inline]
pub(crate) fn scales(b: &[u8]) -> [i8; 16] {
    let mut s = [0u8; 12];
    s.copy_from_slice(&b[SCALES..SCALES + 12]);
    let w = unpack_scales_words(&s);
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        *o = ((w[j / 4] >> (8 * (j % 4))) & 63) as i8 - 32;
    }
    out
}

/// Packs sixteen 6-bit scales (each < 64, the +32 already added) as `scales` reads them.
pub(crate) fn pack_scales(sc: &[u8; 16]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for (j, &v) in sc.iter().enumerate() {
        s[j % 8] |= (v & 0xf) << (4 * (j / 8));
        s[8 + j % 4] |= ((v >> 4) & 3) << (2 * (j / 4));
    }
    s
}

/// The level `q − 4` (−4..4) of value `e` of a block.
#[inline]
pub(crate) fn level(b: &[u8], e: usize) -> i32 {
    let (h, k, i) = (e / 128, (e % 128) / 32, e % 32);
    let low = (b[QS + 32 * h + i] >> (2 * k)) & 3;
    let high = (b[HMASK + i] >> (e / 32)) & 1;
    i32::from(low | (high << 2)) - 4
}

pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_dequantize(src, BLOCK_BYTES, dst);
    for (b, y) in blocks::<BLOCK_BYTES>(src, nb)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b, D);
        let sc = scales(b);
        for (j, &s) in sc.iter().enumerate() {
            let dl = d * f32::from(s);
            for (e, v) in (16 * j..16 * j + 16).zip(&mut y[16 * j..16 * j + 16]) {
                *v = dl * level(b, e) as f32;
            }
        }
    }
}

/// Reference quantizer: per sub-block of 16, the `x²`-weighted symmetric fit `x ≈ scale·l`
/// with l in −4..4 (Q6_K's grid search); the 16 scales to 6 bits against f16 `d` (the largest
/// magnitude maps to −32); then every level re-fitted to the rounded scales.
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    quantize_with(src, dst, super::q6_k::fit_sym16_reference);
}

/// `quantize` with the scale search `fit` (the reference's or a SIMD one giving its bits).
pub(crate) fn quantize_with(src: &[f32], dst: &mut [u8], fit: super::q6_k::FitSym16) {
    let nb = check_quantize(src, dst, BLOCK_BYTES);
    for (x, b) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
        .take(nb)
    {
        let mut l = [4u8; QK_K];
        let fitted = fit(x, 4, &mut l);
        let mut max_scale = 0f32;
        for s in &fitted {
            if s.abs() > max_scale.abs() {
                max_scale = *s;
            }
        }
        let mut sc = [32u8; 16];
        let mut d = f16::ZERO;
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for (o, s) in sc.iter_mut().zip(&fitted) {
                *o = (nearest_int(iscale * s).clamp(-32, 31) + 32) as u8;
            }
            d = f16::from_f32(1.0 / iscale);
        }
        let df = d.to_f32();
        for ((ls, xs), &s) in l.chunks_exact_mut(16).zip(x.chunks_exact(16)).zip(&sc) {
            let dl = df * (i32::from(s) - 32) as f32;
            if dl == 0.0 {
                continue;
            }
            for (o, &v) in ls.iter_mut().zip(xs) {
                *o = (nearest_int(v / dl).clamp(-4, 3) + 4) as u8;
            }
        }
        b[HMASK..HMASK + 32].fill(0);
        let mut low = [0u8; QK_K];
        for (e, &q) in l.iter().enumerate() {
            b[HMASK + e % 32] |= (q >> 2) << (e / 32);
            low[e] = q & 3;
        }
        pack_levels(&low, &mut b[QS..QS + 64]);
        b[SCALES..SCALES + 12].copy_from_slice(&pack_scales(&sc));
        b[D..D + 2].copy_from_slice(&d.to_le_bytes());
    }
}

pub fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, w, BLOCK_BYTES, a);
    let wbs = blocks::<BLOCK_BYTES>(w, nb);
    let abs = blocks::<{ q8_k::BLOCK_BYTES }>(a, nb);
    let mut sum = 0f32;
    for (b, ab) in wbs.iter().zip(abs) {
        let sc = scales(b);
        let mut sumi = 0i32;
        for (j, &s) in sc.iter().enumerate() {
            let p: i32 = (16 * j..16 * j + 16)
                .map(|e| level(b, e) * q8_k::q_of(ab, e))
                .sum();
            sumi += i32::from(s) * p;
        }
        sum += q8_k::d_of(ab) * f16_at(b, D) * sumi as f32;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quants::q4_k::tests::{dot_error, gaussian, rel_rmse};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// ggml's scale layout written out per index, to cross-check the word unpacking.
    fn scale_by_index(j: usize, s: &[u8; 12]) -> u8 {
        let low = if j < 8 { s[j] & 0xf } else { s[j - 8] >> 4 };
        low | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)
    }

    #[test]
    fn scale_unpacking_matches_the_layout() {
        let mut rng = StdRng::seed_from_u64(11);
        for _ in 0..1000 {
            let s: [u8; 12] = rng.random();
            let mut b = vec![0u8; BLOCK_BYTES];
            b[SCALES..SCALES + 12].copy_from_slice(&s);
            let got = scales(&b);
            for (j, &g) in got.iter().enumerate() {
                assert_eq!(g, scale_by_index(j, &s) as i8 - 32, "j={j} {s:?}");
            }
            let sc: [u8; 16] = rng.random::<[u8; 16]>().map(|v| v & 63);
            let packed = pack_scales(&sc);
            for (j, &v) in sc.iter().enumerate() {
                assert_eq!(scale_by_index(j, &packed), v);
            }
        }
    }

    #[test]
    fn hand_built_block_decodes() {
        let sc = |j: usize| ((j * 11 + 5) % 64) as u8;
        let lv = |e: usize| ((e * 5 + e / 64) % 8) as u8;
        let mut b = vec![0u8; BLOCK_BYTES];
        let mut s = [0u8; 12];
        for j in 0..16 {
            s[if j < 8 { j } else { j - 8 }] |= (sc(j) & 0xf) << if j < 8 { 0 } else { 4 };
            s[8 + j % 4] |= (sc(j) >> 4) << (2 * (j / 4));
        }
        b[SCALES..SCALES + 12].copy_from_slice(&s);
        for e in 0..QK_K {
            b[QS + 32 * (e / 128) + e % 32] |= (lv(e) & 3) << (2 * ((e % 128) / 32));
            b[HMASK + e % 32] |= (lv(e) >> 2) << (e / 32);
        }
        b[D..D + 2].copy_from_slice(&f16::from_f32(0.125).to_le_bytes());
        let mut y = vec![0f32; QK_K];
        dequantize(&b, &mut y);
        for (e, v) in y.iter().enumerate() {
            let want = 0.125 * (f32::from(sc(e / 16)) - 32.0) * (f32::from(lv(e)) - 4.0);
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
        let mut x = vec![0f32; 2 * QK_K];
        x[40] = -0.75; // one value in a zero block
        quantize(&x, &mut q);
        dequantize(&q, &mut y);
        assert!((y[40] + 0.75).abs() < 1e-3, "{}", y[40]);
        assert!(y.iter().enumerate().all(|(i, v)| i == 40 || *v == 0.0));
    }

    #[test]
    fn roundtrip_and_dot_errors_are_small() {
        let n = 8 * QK_K;
        let x = gaussian(45, n);
        let mut q = vec![0u8; 8 * BLOCK_BYTES];
        quantize(&x, &mut q);
        let mut y = vec![0f32; n];
        dequantize(&q, &mut y);
        // llama.cpp's `quantize_row_q3_K_ref` gives 0.149 on N(0, 1) data.
        let rmse = rel_rmse(&x, &y);
        eprintln!("Q3_K roundtrip rmse {rmse}");
        assert!(rmse < 0.17, "rmse {rmse}");
        let a = gaussian(46, n);
        let e = dot_error(n, &q, &a, dequantize, vec_dot);
        assert!(e < 1e-2, "dot error {e}");
    }
}
