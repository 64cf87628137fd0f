//! Q4_0: blocks of 32 as an f16 scale and 16 bytes of nibbles (low nibbles are elements
//! 0..16, high nibbles 16..32); x = d·(q − 8).

use super::common::{check_blocks, check_dot, f16_at, put_f16};
use crate::types::GgmlType;

pub const QK: usize = 32;
pub const BLOCK: usize = 18;
pub const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_0;

pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_blocks(src.len(), dst.len(), QK, BLOCK);
    for i in 0..nb {
        let b = &src[i * BLOCK..(i + 1) * BLOCK];
        let d = f16_at(b, 0);
        let y = &mut dst[i * QK..(i + 1) * QK];
        for j in 0..16 {
            y[j] = d * ((b[2 + j] & 0xf) as i32 - 8) as f32;
            y[j + 16] = d * ((b[2 + j] >> 4) as i32 - 8) as f32;
        }
    }
}

pub fn quantize(src: &[f32], dst: &mut [u8]) {
    let nb = check_blocks(dst.len(), src.len(), QK, BLOCK);
    for i in 0..nb {
        let x = &src[i * QK..(i + 1) * QK];
        let b = &mut dst[i * BLOCK..(i + 1) * BLOCK];
        // The value of largest magnitude, with its sign, maps to -8.
        let max = x
            .iter()
            .fold(0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        for j in 0..16 {
            let q0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
            let q1 = ((x[j + 16] * id + 8.5) as i8).min(15) as u8;
            b[2 + j] = q0 | (q1 << 4);
        }
    }
}

pub fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, QK, w, BLOCK, a, super::q8_0::BLOCK);
    let mut sum = 0f32;
    for i in 0..nb {
        let bw = &w[i * BLOCK..];
        let ba = &a[i * super::q8_0::BLOCK..];
        let mut s = 0i32;
        for j in 0..16 {
            s += ((bw[2 + j] & 0xf) as i32 - 8) * (ba[2 + j] as i8 as i32);
            s += ((bw[2 + j] >> 4) as i32 - 8) * (ba[2 + j + 16] as i8 as i32);
        }
        sum += f16_at(bw, 0) * f16_at(ba, 0) * s as f32;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_block() {
        let mut b = [0u8; BLOCK];
        put_f16(&mut b, 0, 1.0);
        for j in 0..16 {
            b[2 + j] = j as u8 | ((15 - j as u8) << 4);
        }
        let mut y = [0f32; 32];
        dequantize(&b, &mut y);
        for j in 0..16 {
            assert_eq!(y[j], j as f32 - 8.0);
            assert_eq!(y[j + 16], 7.0 - j as f32);
        }
    }

    /// Elements j − 8 then 7 − j: the first value of largest magnitude is −8, so d = 1.
    fn ramp() -> [f32; 32] {
        let mut x = [0f32; 32];
        for j in 0..16 {
            x[j] = j as f32 - 8.0;
            x[j + 16] = 7.0 - j as f32;
        }
        x
    }

    #[test]
    fn quantize_matches_hand_computed_bytes() {
        let mut b = [0u8; BLOCK];
        quantize(&ramp(), &mut b);
        assert_eq!(&b[..2], &[0x00, 0x3c]); // f16 1.0
        for j in 0..16 {
            assert_eq!(b[2 + j], j as u8 | ((15 - j as u8) << 4), "byte {j}");
        }
        // Negated, the signed maximum is +8: d = −1 and the nibbles are unchanged.
        let neg: Vec<f32> = ramp().iter().map(|v| -v).collect();
        let mut c = [0u8; BLOCK];
        quantize(&neg, &mut c);
        assert_eq!(&c[..2], &[0x00, 0xbc]); // f16 −1.0
        assert_eq!(&c[2..], &b[2..]);
        let mut y = [0f32; 32];
        dequantize(&c, &mut y);
        assert_eq!(&y[..], &neg[..]);
    }

    #[test]
    fn zero_block_quantizes_without_nan() {
        let mut b = [0xffu8; BLOCK];
        quantize(&[0.0; 32], &mut b);
        // d = 0 / −8 = −0.0, stored as f16 0x8000 (as ggml does); the inverse scale is 0.
        assert_eq!(&b[..2], &[0x00, 0x80]);
        assert!(b[2..].iter().all(|&q| q == 0x88));
        let mut y = [1f32; 32];
        dequantize(&b, &mut y);
        assert!(y.iter().all(|v| *v == 0.0));
    }

    #[test]
    fn vec_dot_equals_float_dot_on_exact_inputs() {
        // Two blocks, d = 0.5 and −2; activations d = 0.25 and 0.125: every product and
        // partial sum is exact in f32.
        let mut w = vec![0u8; 2 * BLOCK];
        let mut a = vec![0u8; 2 * q8_0_block::BLOCK];
        for (i, (dw, da)) in [(0.5f32, 0.25f32), (-2.0, 0.125)].into_iter().enumerate() {
            let bw = &mut w[i * BLOCK..(i + 1) * BLOCK];
            put_f16(bw, 0, dw);
            for j in 0..16 {
                bw[2 + j] = ((j * 5 + i) % 16) as u8 | ((((j * 3 + 7 * i) % 16) as u8) << 4);
            }
            let ba = &mut a[i * q8_0_block::BLOCK..(i + 1) * q8_0_block::BLOCK];
            put_f16(ba, 0, da);
            for j in 0..32 {
                ba[2 + j] = ((j as i32 * 37 + i as i32 * 11) % 255 - 127) as i8 as u8;
            }
        }
        let (mut wf, mut af) = (vec![0f32; 64], vec![0f32; 64]);
        dequantize(&w, &mut wf);
        q8_0_block::dequantize(&a, &mut af);
        let want: f32 = wf.iter().zip(&af).map(|(x, y)| x * y).sum();
        assert_eq!(vec_dot(64, &w, &a), want);
    }

    use crate::quants::q8_0 as q8_0_block;
}
