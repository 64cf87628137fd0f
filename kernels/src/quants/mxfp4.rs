//! MXFP4 (OCP microscaling FP4; gpt-oss's expert weights): blocks of 32 as one E8M0 scale byte
//! (a power of two, `2^(e − 127)`) and 16 bytes of 4-bit E2M1 codes (low nibbles are elements
//! 0..16, high nibbles 16..32, as Q4_0). A code is a sign bit and a magnitude among 0, 0.5, 1,
//! 1.5, 2, 3, 4, 6. As ggml does, the codes are read as twice their value (`KVALUES`, small
//! integers) and the scale as half of it (`scale_half`), so a block dots with Q8_0 in integers
//! and one float product: `x = scale_half(e) · KVALUES[q]`.

use super::common::{check_blocks, check_dot, f16_at};
use crate::types::GgmlType;

pub const QK: usize = 32;
pub const BLOCK: usize = 17;
pub const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_0;

/// Twice the E2M1 value of each code (part of the file format): codes 8..16 are the negatives
/// of 0..8 (code 8, a negative zero, is 0).
pub const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half the E8M0 scale `e`: `2^(e − 128)`, built from its bits (exact; `e` 0 and 1 are the
/// float subnormals 2^-128 and 2^-127).
#[inline]
pub fn scale_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000u32 << e)
    } else {
        f32::from_bits(u32::from(e - 1) << 23)
    }
}

/// The code whose value times `d` is nearest `x` (the first such code on a tie, so a zero is
/// code 0, never the negative zero).
#[inline]
fn nearest_code(x: f32, d: f32) -> u8 {
    let mut best = 0usize;
    let mut err = (f32::from(KVALUES[0]) * d - x).abs();
    for (i, &k) in KVALUES.iter().enumerate().skip(1) {
        let e = (f32::from(k) * d - x).abs();
        if e < err {
            best = i;
            err = e;
        }
    }
    best as u8
}

pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_blocks(src.len(), dst.len(), QK, BLOCK);
    for i in 0..nb {
        let b = &src[i * BLOCK..(i + 1) * BLOCK];
        let d = scale_half(b[0]);
        let y = &mut dst[i * QK..(i + 1) * QK];
        for j in 0..16 {
            y[j] = d * f32::from(KVALUES[usize::from(b[1 + j] & 0xf)]);
            y[j + 16] = d * f32::from(KVALUES[usize::from(b[1 + j] >> 4)]);
        }
    }
}

/// The scale puts the block's largest magnitude among the top codes (its exponent less 2, as
/// llama.cpp's reference quantizer chooses it); every element is then the nearest code. A
/// block of zeros (or NaNs) gets scale byte 0.
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    let nb = check_blocks(dst.len(), src.len(), QK, BLOCK);
    for i in 0..nb {
        let x = &src[i * QK..(i + 1) * QK];
        let b = &mut dst[i * BLOCK..(i + 1) * BLOCK];
        let amax = x
            .iter()
            .fold(0f32, |m, v| if v.abs() > m { v.abs() } else { m });
        let e = if amax > 0.0 && amax.is_finite() {
            (amax.log2().floor() - 2.0 + 127.0).clamp(0.0, 254.0) as u8
        } else {
            0
        };
        let d = scale_half(e);
        b[0] = e;
        for j in 0..16 {
            b[1 + j] = nearest_code(x[j], d) | nearest_code(x[j + 16], d) << 4;
        }
    }
}

/// The exact integer dot of one block's 16 code bytes with 32 Q8_0 quants.
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
        let s = block_sum(&bw[1..], &ba[2..]);
        sum += f16_at(ba, 0) * scale_half(bw[0]) * s as f32;
    }
    sum
}

/// A SIMD `vec_dot` against the reference on every scale byte kind (0, the subnormal halves,
/// huge) and random codes: bit for bit.
#[cfg(test)]
pub(crate) fn check_vec_dot(ours: fn(usize, &[u8], &[u8]) -> f32) {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    let mut rng = StdRng::seed_from_u64(3);
    for nb in [1usize, 2, 7, 64] {
        let n = nb * QK;
        let mut w = vec![0u8; nb * BLOCK];
        rng.fill(&mut w[..]);
        for (i, b) in w.chunks_exact_mut(BLOCK).enumerate() {
            b[0] = [0u8, 1, 2, 100, 127, 140, 254, 255][i % 8];
        }
        let x: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
        let mut a = vec![0u8; nb * super::q8_0::BLOCK];
        super::q8_0::quantize(&x, &mut a);
        let (want, got) = (vec_dot(n, &w, &a), ours(n, &w, &a));
        assert_eq!(
            got.to_bits(),
            want.to_bits(),
            "{nb} blocks: {got} vs {want}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quants::common::put_f16;
    use crate::quants::q8_0 as q8;

    #[test]
    fn scale_half_is_two_to_the_e_minus_128() {
        for e in 0..=255u8 {
            assert_eq!(
                f64::from(scale_half(e)),
                2f64.powi(i32::from(e) - 128),
                "e {e}"
            );
        }
    }

    #[test]
    fn known_block() {
        let mut b = [0u8; BLOCK];
        b[0] = 127 + 3; // scale 8: values 4 · KVALUES
        for j in 0..16 {
            b[1 + j] = j as u8 | ((15 - j as u8) << 4);
        }
        let mut y = [0f32; 32];
        dequantize(&b, &mut y);
        for j in 0..16 {
            assert_eq!(y[j], 4.0 * f32::from(KVALUES[j]));
            assert_eq!(y[j + 16], 4.0 * f32::from(KVALUES[15 - j]));
        }
    }

    #[test]
    fn e2m1_values_roundtrip_exactly_and_others_go_to_the_nearest() {
        // Every E2M1 value at scale 2^-3, the block's max 6 · 2^-3 (exponent 2^-1 - 2 = 2^-3).
        let mut x: Vec<f32> = (0..32)
            .map(|j| f32::from(KVALUES[(j * 7) % 16]) / 2.0 / 8.0)
            .collect();
        x[5] = 0.75; // = 6 · 2^-3: the block's largest
        let mut b = [0u8; BLOCK];
        quantize(&x, &mut b);
        let mut y = [0f32; 32];
        dequantize(&b, &mut y);
        assert_eq!(&y[..], &x[..]);
        // 0.3 at scale 2^-3 · (0.5 steps): codes hold 0.25 and 0.375; 0.3 is nearer 0.25.
        x[0] = 0.3;
        quantize(&x, &mut b);
        dequantize(&b, &mut y);
        assert_eq!(y[0], 0.25);
    }

    #[test]
    fn zero_and_nan_blocks_have_scale_byte_zero() {
        for v in [0.0f32, f32::NAN] {
            let mut b = [0xffu8; BLOCK];
            quantize(&[v; 32], &mut b);
            assert_eq!(b[0], 0);
        }
    }

    #[test]
    fn vec_dot_equals_float_dot_on_exact_inputs() {
        let mut w = vec![0u8; 2 * BLOCK];
        let mut a = vec![0u8; 2 * q8::BLOCK];
        for (i, (e, da)) in [(130u8, 0.25f32), (120, 0.125)].into_iter().enumerate() {
            let bw = &mut w[i * BLOCK..(i + 1) * BLOCK];
            bw[0] = e;
            for j in 0..16 {
                bw[1 + j] = ((j * 5 + i) % 16) as u8 | ((((j * 3 + 7 * i) % 16) as u8) << 4);
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
