//! IQ4_XS block format (scalar reference), byte-compatible with ggml's `block_iq4_xs`.
//!
//! Block of 256 values, 136 bytes: `f16 d | u16 scales_h | u8 scales_l[4] | u8 qs[128]`.
//! Eight sub-blocks of 32 each have a 6-bit scale `ls` (low four bits in nibble `ib % 2` of
//! `scales_l[ib / 2]`, high two bits at bits `2 ib` of `scales_h`); `x = d·(ls − 32)·KVALUES[q]`
//! with IQ4_NL's codebook. Sub-block `ib`'s indices are `qs[16 ib .. 16 ib + 16]`, packed as an
//! IQ4_NL block's (low nibbles elements 0..16, high nibbles 16..32). Dotted with Q8_K; the
//! dot is an exact integer per block times one float scale product.

use super::iq4_nl::{best_scale, nearest_index, pack_nibbles, weights, KVALUES};
use crate::quants::q8_k::{
    self, blocks, check_dequantize, check_dot, check_quantize, f16_at, nearest_int,
};
use crate::types::{GgmlType, QK_K};
use half::f16;

/// Activation format for dot products against IQ4_XS weights.
pub const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_K;

/// Bytes per block.
pub const BLOCK_BYTES: usize = 136;
/// Offset of `scales_h`.
pub const SCALES_H: usize = 2;
/// Offset of `scales_l`.
pub const SCALES_L: usize = 4;
/// Offset of `qs`.
pub const QS: usize = 8;

/// The eight sub-block scales `ls − 32` (each in −32..=31) of a block.
#[inline]
pub fn scales(b: &[u8]) -> [i32; 8] {
    let h = u16::from_le_bytes([b[SCALES_H], b[SCALES_H + 1]]);
    core::array::from_fn(|ib| {
        let lo = (b[SCALES_L + ib / 2] >> (4 * (ib % 2))) & 0xf;
        let hi = ((h >> (2 * ib)) & 3) as u8;
        i32::from(lo | (hi << 4)) - 32
    })
}

/// Packs eight scales (each in −32..=31) into `scales_h` and `scales_l`.
fn put_scales(b: &mut [u8], ls: &[i32; 8]) {
    let mut h = 0u16;
    let mut l = [0u8; 4];
    for (ib, &s) in ls.iter().enumerate() {
        let u = (s + 32) as u8; // 0..=63
        l[ib / 2] |= (u & 0xf) << (4 * (ib % 2));
        h |= u16::from(u >> 4) << (2 * ib);
    }
    b[SCALES_H..SCALES_H + 2].copy_from_slice(&h.to_le_bytes());
    b[SCALES_L..SCALES_L + 4].copy_from_slice(&l);
}

pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_dequantize(src, BLOCK_BYTES, dst);
    for (b, y) in blocks::<BLOCK_BYTES>(src, nb)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b, 0);
        let ls = scales(b);
        for ib in 0..8 {
            let dl = d * ls[ib] as f32;
            let qs = &b[QS + 16 * ib..QS + 16 * ib + 16];
            let y = &mut y[32 * ib..32 * ib + 32];
            for j in 0..16 {
                y[j] = dl * f32::from(KVALUES[usize::from(qs[j] & 0xf)]);
                y[j + 16] = dl * f32::from(KVALUES[usize::from(qs[j] >> 4)]);
            }
        }
    }
}

/// Quantizes one block: the best IQ4_NL-style scale of each sub-block, then `d` maps the
/// sub-block scale of largest magnitude to −32 (`d = −max/32`), each sub-block scale is
/// rounded to a multiple `ls` of `d` in −32..=31, and the indices are re-chosen against the
/// scale as stored (`f16(d)·ls`).
fn quantize_block(x: &[f32], b: &mut [u8]) {
    let mut w = [0f32; QK_K];
    weights(x, &mut w);
    let sub: [f32; 8] =
        core::array::from_fn(|ib| best_scale(&x[32 * ib..32 * ib + 32], &w[32 * ib..32 * ib + 32]));
    let (mut amax, mut max) = (0f32, 0f32);
    for &s in &sub {
        if s.abs() > amax {
            amax = s.abs();
            max = s;
        }
    }
    b[..BLOCK_BYTES].fill(0);
    let d = f16::from_f32(-max / 32.0);
    let df = d.to_f32();
    if df == 0.0 || !df.is_finite() {
        // All (near) zero: d = 0, every value decodes to zero.
        put_scales(b, &[0; 8]);
        return;
    }
    b[0..2].copy_from_slice(&d.to_le_bytes());
    let id = 1.0 / df;
    let mut ls = [0i32; 8];
    let mut l = [0u8; 32];
    for ib in 0..8 {
        ls[ib] = nearest_int(id * sub[ib]).clamp(-32, 31);
        let dl = df * ls[ib] as f32;
        let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
        for (q, &v) in l.iter_mut().zip(&x[32 * ib..32 * ib + 32]) {
            *q = if dl != 0.0 { nearest_index(idl * v) } else { 0 };
        }
        pack_nibbles(&l, &mut b[QS + 16 * ib..QS + 16 * ib + 16]);
    }
    put_scales(b, &ls);
}

pub fn quantize(src: &[f32], dst: &mut [u8]) {
    let nb = check_quantize(src, dst, BLOCK_BYTES);
    for (x, b) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
        .take(nb)
    {
        quantize_block(x, b);
    }
}

/// The exact integer sum of one block against one Q8_K block:
/// `Σ_ib (ls_ib − 32) · Σ_j KVALUES[q_j]·a_j`. |sum| ≤ 256 · 127 · 128 · 32 < 2^31.
pub fn block_sum(b: &[u8; BLOCK_BYTES], a: &[u8; q8_k::BLOCK_BYTES]) -> i32 {
    let ls = scales(b);
    let mut sumi = 0i32;
    for ib in 0..8 {
        let mut s = 0i32;
        for j in 0..16 {
            let q = b[QS + 16 * ib + j];
            s += i32::from(KVALUES[usize::from(q & 0xf)]) * q8_k::q_of(a, 32 * ib + j);
            s += i32::from(KVALUES[usize::from(q >> 4)]) * q8_k::q_of(a, 32 * ib + 16 + j);
        }
        sumi += ls[ib] * s;
    }
    sumi
}

/// Σ over blocks of `ad · d · sumi`, in block order (every SIMD level does exactly this after
/// forming `sumi` exactly, so all agree bit for bit).
pub fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, w, BLOCK_BYTES, a);
    let wbs = blocks::<BLOCK_BYTES>(w, nb);
    let abs = blocks::<{ q8_k::BLOCK_BYTES }>(a, nb);
    let mut sum = 0f32;
    for (b, ab) in wbs.iter().zip(abs) {
        let ad = q8_k::d_of(ab);
        sum += ad * f16_at(b, 0) * block_sum(b, ab) as f32;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_roundtrip_through_the_packing() {
        let ls = [-32, 31, 0, -1, 17, -17, 5, 30];
        let mut b = [0u8; BLOCK_BYTES];
        put_scales(&mut b, &ls);
        assert_eq!(scales(&b), ls);
        // ggml's layout by hand: ls + 32 = [0, 63, 32, 31, 49, 15, 37, 62].
        assert_eq!(&b[SCALES_L..SCALES_L + 4], &[0xf0, 0xf0, 0xf1, 0xe5]);
        let h = u16::from_le_bytes([b[2], b[3]]);
        let want: u16 = [0u16, 3, 2, 1, 3, 0, 2, 3]
            .iter()
            .enumerate()
            .map(|(i, &v)| v << (2 * i))
            .sum();
        assert_eq!(h, want);
    }

    #[test]
    fn known_block() {
        let mut b = [0u8; BLOCK_BYTES];
        b[0..2].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        let ls = [1, -2, 3, -4, 5, -6, 7, -32];
        put_scales(&mut b, &ls);
        for (k, q) in b[QS..].iter_mut().enumerate() {
            *q = (k % 16) as u8 | (((k * 3) % 16) as u8) << 4;
        }
        let mut y = vec![0f32; QK_K];
        dequantize(&b, &mut y);
        for ib in 0..8 {
            for j in 0..16 {
                let k = 16 * ib + j;
                let dl = 0.25 * ls[ib] as f32;
                assert_eq!(y[32 * ib + j], dl * f32::from(KVALUES[k % 16]));
                assert_eq!(y[32 * ib + 16 + j], dl * f32::from(KVALUES[(k * 3) % 16]));
            }
        }
    }

    #[test]
    fn zero_block_quantizes_to_zero() {
        let mut b = vec![0xffu8; BLOCK_BYTES];
        quantize(&[0.0; QK_K], &mut b);
        let mut y = vec![1f32; QK_K];
        dequantize(&b, &mut y);
        assert!(y.iter().all(|v| *v == 0.0));
    }

    #[test]
    fn vec_dot_equals_float_dot_of_dequantized_rows() {
        // Power-of-two scales, small sub-block scales and small activations: every partial sum
        // of the float dot of the dequantized rows is exact, so it equals the integer dot.
        let mut w = vec![0u8; 2 * BLOCK_BYTES];
        let mut a = vec![0u8; 2 * q8_k::BLOCK_BYTES];
        for i in 0..2 {
            let b = &mut w[i * BLOCK_BYTES..(i + 1) * BLOCK_BYTES];
            let d = if i == 0 { 0.5f32 } else { -0.125 };
            b[0..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
            put_scales(b, &core::array::from_fn(|k| (k as i32 + i as i32) % 7 - 3));
            for (k, q) in b[QS..].iter_mut().enumerate() {
                *q = ((k * 5 + i) % 256) as u8;
            }
            let blk = &mut a[i * q8_k::BLOCK_BYTES..(i + 1) * q8_k::BLOCK_BYTES];
            blk[..4].copy_from_slice(&0.25f32.to_le_bytes());
            for k in 0..QK_K {
                blk[q8_k::QS + k] = (((k * 37 + 11 * i) % 33) as i8 - 16) as u8;
            }
        }
        let (mut wf, mut af) = (vec![0f32; 2 * QK_K], vec![0f32; 2 * QK_K]);
        dequantize(&w, &mut wf);
        q8_k::dequantize(&a, &mut af);
        let want: f32 = wf.iter().zip(&af).map(|(x, y)| x * y).sum();
        assert_eq!(vec_dot(2 * QK_K, &w, &a), want);
        assert_ne!(want, 0.0);
    }
}
