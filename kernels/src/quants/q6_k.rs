//! Q6_K block format (scalar reference), byte-compatible with ggml's `block_q6_K`.
//!
//! Block of 256 values, 210 bytes: `ql[128] | qh[64] | scales[16] (i8) | f16 d`.
//! Sixteen sub-blocks of 16 values, `x = d * scales[e / 16] * (q - 32)` with q in 0..64.
//! Each half of 128 values (h) uses `ql[64 h .. 64 h + 64]` and `qh[32 h .. 32 h + 32]`: for
//! value `128 h + 32 k + l` (k in 0..4, l in 0..32) the low four bits are the low (k = 0, 1)
//! or high (k = 2, 3) nibble of `ql[64 h + 32 (k % 2) + l]`, the top two bits are bits
//! `2k, 2k+1` of `qh[32 h + l]`.

use crate::quants::q8_k::{
    self, blocks, check_dequantize, check_dot, check_quantize, f16_at, nearest_int,
};
use crate::types::{GgmlType, QK_K};
use half::f16;

/// Activation format for dot products against Q6_K weights.
pub const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_K;

/// Bytes per block.
pub const BLOCK_BYTES: usize = 210;
/// Offset of `qh` in a block.
pub(crate) const QH: usize = 128;
/// Offset of the i8 scales in a block.
pub(crate) const SCALES: usize = 192;
/// Offset of `d` in a block.
pub(crate) const D: usize = 208;

/// The 6-bit level (0..64) of value `e` of a block.
#[inline]
fn level(b: &[u8], e: usize) -> u8 {
    let (h, k, l) = (e / 128, (e % 128) / 32, e % 32);
    let byte = b[64 * h + 32 * (k % 2) + l];
    let low = if k < 2 { byte & 0xf } else { byte >> 4 };
    let high = (b[QH + 32 * h + l] >> (2 * k)) & 3;
    low | (high << 4)
}

#[inline]
fn scale(b: &[u8], j: usize) -> i8 {
    b[SCALES + j] as i8
}

/// The largest magnitude of a sub-block and the signed value holding it (the first, on a
/// tie; NaN never counts), where `fit_symmetric` starts.
pub(crate) fn sym_start(x: &[f32]) -> (f32, f32) {
    let mut amax = 0f32;
    let mut max = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

/// Fits the sixteen 16-value sub-blocks of a block with `fit_symmetric` (grid `-nmax..nmax`):
/// writes the levels (`+ nmax`) into `l`, returns the scales.
pub(crate) type FitSym16 = fn(x: &[f32], nmax: i32, l: &mut [u8; QK_K]) -> [f32; 16];

/// `FitSym16` by `fit_symmetric`, sub-block by sub-block: the reference.
pub(crate) fn fit_sym16_reference(x: &[f32], nmax: i32, l: &mut [u8; QK_K]) -> [f32; 16] {
    std::array::from_fn(|j| {
        fit_symmetric(&x[16 * j..16 * j + 16], nmax, &mut l[16 * j..16 * j + 16])
    })
}

/// Fits `x ≈ scale * l` with integer `l` in `-nmax..nmax`, weighting each value by `x²` (the
/// search of ggml's `make_qx_quants`): the value of largest magnitude maps to `-nmax` (the
/// end with room), then 18 nearby grids are tried and the least-squares scale of the best
/// kept. Writes `l + nmax` into `q` and returns the scale (negative when that value is
/// positive).
pub(crate) fn fit_symmetric(x: &[f32], nmax: i32, q: &mut [u8]) -> f32 {
    let (amax, max) = sym_start(x);
    if amax < 1e-15 {
        q.fill(nmax as u8);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        let (mut slx, mut sll) = (0f32, 0f32);
        for &v in x {
            let l = level(iscale, v) as f32;
            let w = v * v;
            slx += w * v * l;
            sll += w * l * l;
        }
        (slx, sll)
    };
    let mut best_iscale = -(nmax as f32) / max;
    let (slx, sll) = sums(best_iscale);
    let mut scale = if sll > 0.0 { slx / sll } else { 0.0 };
    let mut best = scale * slx;
    for k in (-9..=9).filter(|k| *k != 0) {
        let iscale = -(nmax as f32 + 0.1 * k as f32) / max;
        let (slx, sll) = sums(iscale);
        if sll > 0.0 && slx * slx > best * sll {
            scale = slx / sll;
            best = scale * slx;
            best_iscale = iscale;
        }
    }
    for (o, &v) in q.iter_mut().zip(x) {
        *o = (level(best_iscale, v) + nmax) as u8;
    }
    scale
}

pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_dequantize(src, BLOCK_BYTES, dst);
    for (b, y) in blocks::<BLOCK_BYTES>(src, nb)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b, D);
        for j in 0..16 {
            let ds = d * f32::from(scale(b, j));
            for (e, v) in (16 * j..16 * j + 16).zip(&mut y[16 * j..16 * j + 16]) {
                *v = ds * (i32::from(level(b, e)) - 32) as f32;
            }
        }
    }
}

pub fn quantize(src: &[f32], dst: &mut [u8]) {
    quantize_with(src, dst, fit_sym16_reference);
}

/// `quantize` with the scale search `fit` (the reference's or a SIMD one giving its bits).
pub(crate) fn quantize_with(src: &[f32], dst: &mut [u8], fit: FitSym16) {
    let nb = check_quantize(src, dst, BLOCK_BYTES);
    for (x, b) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
        .take(nb)
    {
        let mut l = [0u8; QK_K];
        let scales = fit(x, 32, &mut l);
        let mut max_scale = 0f32;
        for s in &scales {
            if s.abs() > max_scale.abs() {
                max_scale = *s;
            }
        }
        b.fill(0);
        if max_scale.abs() < 1e-15 {
            continue;
        }
        let iscale = -128.0 / max_scale;
        let d = f16::from_f32(1.0 / iscale);
        let df = d.to_f32();
        for (j, s) in scales.iter().enumerate() {
            let sc = nearest_int(iscale * s).clamp(-128, 127);
            b[SCALES + j] = sc as i8 as u8;
            let dd = df * sc as f32;
            for i in 16 * j..16 * j + 16 {
                l[i] = if dd == 0.0 {
                    32
                } else {
                    (nearest_int(x[i] / dd).clamp(-32, 31) + 32) as u8
                };
            }
        }
        b[D..D + 2].copy_from_slice(&d.to_le_bytes());
        for h in 0..2 {
            for i in 0..32 {
                let q = |k: usize| l[128 * h + 32 * k + i];
                b[64 * h + i] = (q(0) & 0xf) | ((q(2) & 0xf) << 4);
                b[64 * h + 32 + i] = (q(1) & 0xf) | ((q(3) & 0xf) << 4);
                b[QH + 32 * h + i] =
                    (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
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
        let mut sumi = 0i32;
        for j in 0..16 {
            let s: i32 = (16 * j..16 * j + 16)
                .map(|e| (i32::from(level(b, e)) - 32) * q8_k::q_of(ab, e))
                .sum();
            sumi += i32::from(scale(b, j)) * s;
        }
        sum += q8_k::d_of(ab) * f16_at(b, D) * sumi as f32;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quants::q4_k::tests::{dot_error, gaussian, rel_rmse};

    /// Packs levels (0..64) into ql/qh by hand, independently of `level`.
    fn pack(levels: &[u8; QK_K], b: &mut [u8]) {
        for (e, &q) in levels.iter().enumerate() {
            let (h, k, l) = (e / 128, (e % 128) / 32, e % 32);
            b[64 * h + 32 * (k % 2) + l] |= (q & 0xf) << (4 * (k / 2));
            b[QH + 32 * h + l] |= (q >> 4) << (2 * k);
        }
    }

    #[test]
    fn unit_scales_decode_to_levels_minus_32() {
        let mut levels = [0u8; QK_K];
        for (e, q) in levels.iter_mut().enumerate() {
            *q = ((e * 29 + e / 128) % 64) as u8;
        }
        let mut b = vec![0u8; BLOCK_BYTES];
        pack(&levels, &mut b);
        b[SCALES..SCALES + 16].fill(1);
        b[D..D + 2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        let mut y = vec![0f32; QK_K];
        dequantize(&b, &mut y);
        for (e, v) in y.iter().enumerate() {
            assert_eq!(*v, f32::from(levels[e]) - 32.0, "element {e}");
        }
        // Signed scales, a fractional d.
        for j in 0..16 {
            b[SCALES + j] = j_scale(16 * j) as u8;
        }
        b[D..D + 2].copy_from_slice(&f16::from_f32(0.125).to_le_bytes());
        dequantize(&b, &mut y);
        for (e, v) in y.iter().enumerate() {
            let sc = f32::from(j_scale(e));
            assert_eq!(
                *v,
                0.125 * sc * (f32::from(levels[e]) - 32.0),
                "element {e}"
            );
        }
        fn j_scale(e: usize) -> i8 {
            ((e / 16 * 17) as i32 - 128) as i8
        }
    }

    #[test]
    fn zero_input_decodes_to_zero() {
        let mut q = vec![0xffu8; 2 * BLOCK_BYTES];
        quantize(&[0f32; 2 * QK_K], &mut q);
        assert!(q.iter().all(|&v| v == 0));
        let mut y = vec![1f32; 2 * QK_K];
        dequantize(&q, &mut y);
        assert!(y.iter().all(|v| *v == 0.0));
        let mut x = vec![0f32; 2 * QK_K];
        x[17] = 0.5; // one value in a zero block
        quantize(&x, &mut q);
        dequantize(&q, &mut y);
        assert!(y.iter().all(|v| v.is_finite()));
        assert!((y[17] - 0.5).abs() < 1e-3, "{}", y[17]);
        assert!(y.iter().enumerate().all(|(i, v)| i == 17 || *v == 0.0));
    }

    #[test]
    fn roundtrip_and_dot_errors_are_small() {
        let n = 8 * QK_K;
        let x = gaussian(25, n);
        let mut q = vec![0u8; 8 * BLOCK_BYTES];
        quantize(&x, &mut q);
        let mut y = vec![0f32; n];
        dequantize(&q, &mut y);
        let rmse = rel_rmse(&x, &y);
        assert!(rmse < 0.025, "rmse {rmse}");
        let a = gaussian(26, n);
        let e = dot_error(n, &q, &a, dequantize, vec_dot);
        assert!(e < 1e-2, "dot error {e}");
    }
}
