//! Q8_K block format (scalar reference): the activation format of every K-quant dot product.
//!
//! Block of 256 values, 292 bytes, as ggml's `block_q8_K`:
//! `f32 d | i8 qs[256] | i16 bsums[16]`, with `x ≈ d * q` and `bsums[j]` the sum of
//! `qs[16 j .. 16 j + 16]` (lets the weight formats apply their per-sub-block offsets
//! without touching the activations again).
//!
//! Helpers shared by the other K-quant files (block views, rounding) live here too.

use crate::types::{GgmlType, QK_K};
use half::f16;

/// Activation format for dot products against Q8_K "weights" (Q8_K · Q8_K).
pub const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_K;

/// Bytes per block.
pub const BLOCK_BYTES: usize = 292;
/// Offset of `qs` in a block.
pub(crate) const QS: usize = 4;
/// Offset of `bsums` in a block.
pub(crate) const BSUMS: usize = QS + QK_K;

/// `s` seen as `nb` blocks of `B` bytes. Panics when `s` is shorter than `nb * B`.
pub(crate) fn blocks<const B: usize>(s: &[u8], nb: usize) -> &[[u8; B]] {
    let need = nb.saturating_mul(B);
    assert!(
        s.len() >= need,
        "{} bytes hold fewer than {nb} blocks of {B}",
        s.len()
    );
    // SAFETY: `s` holds at least `nb * B` initialized bytes (checked above) that stay borrowed
    // for the returned lifetime; `[u8; B]` has alignment 1 and no invalid bit patterns.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<[u8; B]>(), nb) }
}

/// Number of K-blocks in `n` elements; panics unless `n` is a whole number of them.
pub(crate) fn k_blocks(n: usize) -> usize {
    assert!(
        n.is_multiple_of(QK_K),
        "{n} elements is not a whole number of {QK_K}-element blocks"
    );
    n / QK_K
}

/// Checks the slices of a K-quant `vec_dot` (weights in blocks of `wb` bytes, activations
/// in Q8_K) and returns the number of blocks.
pub(crate) fn check_dot(n: usize, w: &[u8], wb: usize, a: &[u8]) -> usize {
    let nb = k_blocks(n);
    assert!(w.len() >= nb * wb, "weight row too short for {n} elements");
    assert!(
        a.len() >= nb * BLOCK_BYTES,
        "Q8_K activation row too short for {n} elements"
    );
    nb
}

/// Checks the slices of a K-quant `vec_dot_multi` and returns the number of blocks.
pub(crate) fn check_dot_multi(
    n: usize,
    w: &[u8],
    wb: usize,
    a: &[u8],
    a_stride: usize,
    rows: usize,
) -> usize {
    let nb = k_blocks(n);
    assert!(w.len() >= nb * wb, "weight row too short for {n} elements");
    if rows > 0 {
        let need = (rows - 1)
            .checked_mul(a_stride)
            .and_then(|s| s.checked_add(nb * BLOCK_BYTES));
        assert!(
            need.is_some_and(|need| a.len() >= need),
            "{rows} Q8_K activation rows of stride {a_stride} do not fit in {} bytes",
            a.len()
        );
    }
    nb
}

/// Checks the slices of a whole-block dequantize and returns the number of blocks.
pub(crate) fn check_dequantize(src: &[u8], block_bytes: usize, dst: &[f32]) -> usize {
    let nb = k_blocks(dst.len());
    assert!(
        src.len() >= nb * block_bytes,
        "source too short for {} elements",
        dst.len()
    );
    nb
}

/// Checks the slices of a whole-block quantize and returns the number of blocks.
pub(crate) fn check_quantize(src: &[f32], dst: &[u8], block_bytes: usize) -> usize {
    let nb = k_blocks(src.len());
    assert!(
        dst.len() >= nb * block_bytes,
        "destination too short for {} elements",
        src.len()
    );
    nb
}

pub(crate) use super::common::nearest_int;

/// Little-endian f16 at `b[off..off + 2]`, widened.
#[inline]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_le_bytes([b[off], b[off + 1]]).to_f32()
}

/// The scale `d` of a Q8_K block.
#[inline]
pub(crate) fn d_of(b: &[u8; BLOCK_BYTES]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Quant `i` of a Q8_K block.
#[inline]
pub(crate) fn q_of(b: &[u8; BLOCK_BYTES], i: usize) -> i32 {
    i32::from(b[QS + i] as i8)
}

/// `bsums[j]` of a Q8_K block.
#[inline]
pub(crate) fn bsum_of(b: &[u8; BLOCK_BYTES], j: usize) -> i32 {
    i32::from(i16::from_le_bytes([b[BSUMS + 2 * j], b[BSUMS + 2 * j + 1]]))
}

pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_dequantize(src, BLOCK_BYTES, dst);
    for (b, y) in blocks::<BLOCK_BYTES>(src, nb)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = d_of(b);
        for (i, v) in y.iter_mut().enumerate() {
            *v = d * q_of(b, i) as f32;
        }
    }
}

/// Quantizes one block as ggml's `quantize_row_q8_K_ref`: the value of largest magnitude
/// (the first one on ties) maps to -128, `iscale = -128 / max`, round half to even, clamp to
/// 127 (the opposite extreme would give +128). An all-zero block is all zero bytes.
pub(crate) fn quantize_block(x: &[f32], b: &mut [u8; BLOCK_BYTES]) {
    let mut amax = 0f32;
    let mut max = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        b.fill(0);
        return;
    }
    let iscale = -128.0 / max;
    for (i, &v) in x.iter().enumerate() {
        b[QS + i] = nearest_int(iscale * v).min(127) as i8 as u8;
    }
    for j in 0..QK_K / 16 {
        let s: i32 = (0..16).map(|l| q_of(b, 16 * j + l)).sum();
        b[BSUMS + 2 * j..BSUMS + 2 * j + 2].copy_from_slice(&(s as i16).to_le_bytes());
    }
    b[..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
}

pub fn quantize(src: &[f32], dst: &mut [u8]) {
    let nb = check_quantize(src, dst, BLOCK_BYTES);
    for (x, b) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
        .take(nb)
    {
        let mut blk = [0u8; BLOCK_BYTES];
        quantize_block(x, &mut blk);
        b.copy_from_slice(&blk);
    }
}

/// Q8_K · Q8_K (not used by models; present so the table is total).
pub fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, w, BLOCK_BYTES, a);
    let wbs = blocks::<BLOCK_BYTES>(w, nb);
    let abs = blocks::<BLOCK_BYTES>(a, nb);
    let mut sum = 0f32;
    for (wb, ab) in wbs.iter().zip(abs) {
        let sumi: i32 = (0..QK_K).map(|i| q_of(wb, i) * q_of(ab, i)).sum();
        sum += d_of(wb) * d_of(ab) * sumi as f32;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quant(x: &[f32]) -> Vec<u8> {
        let mut q = vec![0u8; x.len() / QK_K * BLOCK_BYTES];
        quantize(x, &mut q);
        q
    }

    #[test]
    fn largest_magnitude_maps_to_minus_128() {
        let mut x = vec![0f32; QK_K];
        for (i, v) in x.iter_mut().enumerate() {
            *v = (i as f32 - 100.0) / 50.0; // 3.1 at the end, -2.0 at the start
        }
        let q = quant(&x);
        let b = &blocks::<BLOCK_BYTES>(&q, 1)[0];
        assert_eq!(q_of(b, QK_K - 1), -128);
        assert_eq!(q_of(b, 100), 0);
        let d = d_of(b);
        assert!((d - (-3.1 / 128.0)).abs() < 1e-7, "{d}");
        for j in 0..16 {
            let s: i32 = (0..16).map(|l| q_of(b, 16 * j + l)).sum();
            assert_eq!(bsum_of(b, j), s);
        }
        // +3.1 first, -3.1 last: the first wins and the opposite extreme (+128) clamps.
        let mut y = vec![0.25f32; QK_K];
        y[0] = 3.1;
        y[QK_K - 1] = -3.1;
        let q = quant(&y);
        let b = &blocks::<BLOCK_BYTES>(&q, 1)[0];
        assert_eq!(q_of(b, 0), -128);
        assert_eq!(q_of(b, QK_K - 1), 127);
    }

    #[test]
    fn zero_block_is_zero_bytes() {
        let q = quant(&[0f32; 2 * QK_K]);
        assert!(q.iter().all(|&b| b == 0));
        let mut y = vec![1f32; 2 * QK_K];
        dequantize(&q, &mut y);
        assert!(y.iter().all(|v| *v == 0.0));
        assert_eq!(vec_dot(2 * QK_K, &q, &q), 0.0);
    }

    #[test]
    fn ties_round_to_even() {
        let mut x = vec![0f32; QK_K];
        x[0] = -128.0; // iscale = 1
        x[1] = 2.5;
        x[2] = 3.5;
        x[3] = -2.5;
        let q = quant(&x);
        let b = &blocks::<BLOCK_BYTES>(&q, 1)[0];
        assert_eq!((q_of(b, 1), q_of(b, 2), q_of(b, 3)), (2, 4, -2));
        assert_eq!(d_of(b), 1.0);
    }

    #[test]
    fn self_dot_matches_dequantized() {
        let x: Vec<f32> = (0..2 * QK_K)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        let q = quant(&x);
        let mut y = vec![0f32; x.len()];
        dequantize(&q, &mut y);
        let want: f32 = y.iter().map(|v| v * v).sum();
        let got = vec_dot(x.len(), &q, &q);
        assert!((got - want).abs() <= 1e-5 * want, "{got} vs {want}");
    }
}
