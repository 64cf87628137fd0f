//! IQ4_NL: blocks of 32 as an f16 scale and 16 bytes of 4-bit indices (low nibbles are
//! elements 0..16, high nibbles 16..32, as Q4_0) into a fixed non-linear codebook of 16 signed
//! bytes (`KVALUES`, ggml's `kvalues_iq4nl`): `x = d·KVALUES[q]`. Dotted with Q8_0.
//!
//! The codebook and the scale search are shared with IQ4_XS (`iq4_xs.rs`), which uses the same
//! values in 256-element blocks with 6-bit sub-block scales.

use super::common::{check_blocks, check_dot, f16_at, put_f16};
use crate::types::GgmlType;

pub const QK: usize = 32;
pub const BLOCK: usize = 18;
pub const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_0;

/// The 16 codebook values, ascending (part of the file format).
pub const KVALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Below this magnitude a group is stored as zero (scale 0).
const GROUP_EPS: f32 = 1e-15;

/// Candidate scales tried on each side of `max / KVALUES[0]`.
const TRIES: i32 = 7;

/// Index of the codebook value nearest `v` (the lower one on a tie).
#[inline]
pub fn nearest_index(v: f32) -> u8 {
    // Binary search for the first value above v, then compare with its lower neighbour.
    let (mut lo, mut hi) = (0usize, 16usize);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if f32::from(KVALUES[mid]) <= v {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    match lo {
        0 => 0,
        16 => 15,
        k => {
            let below = v - f32::from(KVALUES[k - 1]);
            let above = f32::from(KVALUES[k]) - v;
            if above < below {
                k as u8
            } else {
                (k - 1) as u8
            }
        }
    }
}

/// The best scale for one group `x` with per-element weights `w`: `d` with `x ≈ d·KVALUES[q]`,
/// `q` the nearest index of `x / d`, minimising `Σ w·(x − d·KVALUES[q])²`. Candidates map the
/// value of largest magnitude to `KVALUES[0] + t` for t in −TRIES..=TRIES (and the plain
/// `max / KVALUES[0]`); for each the indices are chosen, then `d` is the weighted least-squares
/// fit for them. Returns 0 for a group of (near) zeros. Our own search, in the spirit of
/// ggml's `quantize_row_iq4_nl_impl`.
pub fn best_scale(x: &[f32], w: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    // Also refuses NaN (every comparison false).
    if amax.partial_cmp(&GROUP_EPS) != Some(std::cmp::Ordering::Greater) {
        return 0.0;
    }
    // For a trial inverse scale, the least-squares scale and its figure of merit
    // (sumqx² / sumq2: the larger, the smaller the weighted error).
    let fit = |id: f32| -> Option<(f32, f32)> {
        let (mut sqx, mut sq2) = (0f32, 0f32);
        for (&v, &wt) in x.iter().zip(w) {
            let q = f32::from(KVALUES[usize::from(nearest_index(id * v))]);
            sqx += wt * q * v;
            sq2 += wt * q * q;
        }
        (sq2 > 0.0).then(|| (sqx / sq2, sqx * sqx / sq2))
    };
    let mut best = (max / f32::from(KVALUES[0]), f32::NEG_INFINITY);
    if let Some(f) = fit(f32::from(KVALUES[0]) / max) {
        best = f;
    }
    for t in -TRIES..=TRIES {
        if let Some(f) = fit((t as f32 + f32::from(KVALUES[0])) / max) {
            if f.1 > best.1 {
                best = f;
            }
        }
    }
    best.0
}

/// The weights of the least-squares fits: every element counts, the large ones a little more
/// (they carry more of a dot product).
pub fn weights(x: &[f32], w: &mut [f32]) {
    let n = x.len().max(1) as f32;
    let sigma2 = x.iter().map(|v| v * v).sum::<f32>() / n;
    for (wt, &v) in w.iter_mut().zip(x) {
        *wt = sigma2 + v * v;
    }
}

/// Packs 32 indices as Q4_0 does: element j in the low nibble of byte j, element j + 16 in
/// its high nibble.
pub fn pack_nibbles(l: &[u8], out: &mut [u8]) {
    for j in 0..16 {
        out[j] = l[j] | (l[j + 16] << 4);
    }
}

pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_blocks(src.len(), dst.len(), QK, BLOCK);
    for i in 0..nb {
        let b = &src[i * BLOCK..(i + 1) * BLOCK];
        let d = f16_at(b, 0);
        let y = &mut dst[i * QK..(i + 1) * QK];
        for j in 0..16 {
            y[j] = d * f32::from(KVALUES[usize::from(b[2 + j] & 0xf)]);
            y[j + 16] = d * f32::from(KVALUES[usize::from(b[2 + j] >> 4)]);
        }
    }
}

pub fn quantize(src: &[f32], dst: &mut [u8]) {
    let nb = check_blocks(dst.len(), src.len(), QK, BLOCK);
    let mut w = [0f32; QK];
    for i in 0..nb {
        let x = &src[i * QK..(i + 1) * QK];
        let b = &mut dst[i * BLOCK..(i + 1) * BLOCK];
        weights(x, &mut w);
        put_f16(b, 0, best_scale(x, &w));
        // Indices against the scale as stored (rounded to f16).
        let d = f16_at(b, 0);
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut l = [0u8; QK];
        if d != 0.0 {
            for (q, &v) in l.iter_mut().zip(x) {
                *q = nearest_index(id * v);
            }
        }
        pack_nibbles(&l, &mut b[2..]);
    }
}

/// The exact integer dot of one block's 16 index bytes with 32 Q8_0 quants.
#[inline]
pub fn block_sum(qs: &[u8], a: &[u8]) -> i32 {
    let mut s = 0i32;
    for j in 0..16 {
        s += i32::from(KVALUES[usize::from(qs[j] & 0xf)]) * i32::from(a[j] as i8);
        s += i32::from(KVALUES[usize::from(qs[j] >> 4)]) * i32::from(a[j + 16] as i8);
    }
    s
}

pub fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, QK, w, BLOCK, a, super::q8_0::BLOCK);
    let mut sum = 0f32;
    for i in 0..nb {
        let bw = &w[i * BLOCK..(i + 1) * BLOCK];
        let ba = &a[i * super::q8_0::BLOCK..(i + 1) * super::q8_0::BLOCK];
        let s = block_sum(&bw[2..], &ba[2..]);
        sum += f16_at(bw, 0) * f16_at(ba, 0) * s as f32;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quants::q8_0 as q8;

    #[test]
    fn known_block() {
        let mut b = [0u8; BLOCK];
        put_f16(&mut b, 0, 0.5);
        for j in 0..16 {
            b[2 + j] = j as u8 | ((15 - j as u8) << 4);
        }
        let mut y = [0f32; 32];
        dequantize(&b, &mut y);
        for j in 0..16 {
            assert_eq!(y[j], 0.5 * f32::from(KVALUES[j]));
            assert_eq!(y[j + 16], 0.5 * f32::from(KVALUES[15 - j]));
        }
    }

    #[test]
    fn nearest_index_picks_the_closest_value() {
        for (k, &v) in KVALUES.iter().enumerate() {
            assert_eq!(nearest_index(f32::from(v)), k as u8);
        }
        assert_eq!(nearest_index(-1000.0), 0);
        assert_eq!(nearest_index(1000.0), 15);
        assert_eq!(nearest_index(-116.0), 0); // 11 from −127, 12 from −104
        assert_eq!(nearest_index(-115.0), 1); // 12 from −127, 11 from −104
        assert_eq!(nearest_index(-115.5), 0); // tie between −127 and −104: the lower
        assert_eq!(nearest_index(7.0), 8); // 6 from 1, 6 from 13: the lower
        assert_eq!(nearest_index(7.1), 9);
        assert_eq!(nearest_index(0.0), 8);
    }

    #[test]
    fn codebook_values_roundtrip_exactly() {
        // A block holding only codebook values times 2^-4 (scale exactly representable) comes
        // back exactly.
        let x: Vec<f32> = (0..32)
            .map(|j| f32::from(KVALUES[(j * 7) % 16]) / 16.0)
            .collect();
        let mut b = [0u8; BLOCK];
        quantize(&x, &mut b);
        let mut y = [0f32; 32];
        dequantize(&b, &mut y);
        assert_eq!(&y[..], &x[..]);
    }

    #[test]
    fn zero_block_quantizes_to_zero() {
        let mut b = [0xffu8; BLOCK];
        quantize(&[0.0; 32], &mut b);
        assert_eq!(&b[..2], &[0, 0]);
        let mut y = [1f32; 32];
        dequantize(&b, &mut y);
        assert!(y.iter().all(|v| *v == 0.0));
    }

    #[test]
    fn vec_dot_equals_float_dot_on_exact_inputs() {
        // Two blocks, d = 0.5 and −2; activations d = 0.25 and 0.125: every product and partial
        // sum is exact in f32.
        let mut w = vec![0u8; 2 * BLOCK];
        let mut a = vec![0u8; 2 * q8::BLOCK];
        for (i, (dw, da)) in [(0.5f32, 0.25f32), (-2.0, 0.125)].into_iter().enumerate() {
            let bw = &mut w[i * BLOCK..(i + 1) * BLOCK];
            put_f16(bw, 0, dw);
            for j in 0..16 {
                bw[2 + j] = ((j * 5 + i) % 16) as u8 | ((((j * 3 + 7 * i) % 16) as u8) << 4);
            }
            let ba = &mut a[i * q8::BLOCK..(i + 1) * q8::BLOCK];
            put_f16(ba, 0, da);
            for j in 0..32 {
                ba[2 + j] = ((j as i32 * 37 + i as i32 * 11) % 255 - 127) as i8 as u8;
            }
        }
        let (mut wf, mut af) = (vec![0f32; 64], vec![0f32; 64]);
        dequantize(&w, &mut wf);
        q8::dequantize(&a, &mut af);
        let want: f32 = wf.iter().zip(&af).map(|(x, y)| x * y).sum();
        assert_eq!(vec_dot(64, &w, &a), want);
    }
}
