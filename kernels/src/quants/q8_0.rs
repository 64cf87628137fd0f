//! Q8_0: blocks of 32 as an f16 scale and 32 signed bytes; x = d·q. Also the activation
//! format for Q4_0, Q5_0 and Q8_0 dot products.

use super::common::{check_blocks, check_dot, f16_at, put_f16, round_away};
use crate::types::GgmlType;

pub const QK: usize = 32;
pub const BLOCK: usize = 34;
pub const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_0;

pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_blocks(src.len(), dst.len(), QK, BLOCK);
    for i in 0..nb {
        let b = &src[i * BLOCK..(i + 1) * BLOCK];
        let d = f16_at(b, 0);
        for (j, y) in dst[i * QK..(i + 1) * QK].iter_mut().enumerate() {
            *y = d * (b[2 + j] as i8) as f32;
        }
    }
}

/// Quantizes one block of 32: scale amax/127, round half away from zero.
pub fn quantize_block(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(b, 0, d);
    for (j, v) in x.iter().enumerate() {
        b[2 + j] = round_away(v * id) as i8 as u8;
    }
}

pub fn quantize(src: &[f32], dst: &mut [u8]) {
    let nb = check_blocks(dst.len(), src.len(), QK, BLOCK);
    for i in 0..nb {
        quantize_block(
            &src[i * QK..(i + 1) * QK],
            &mut dst[i * BLOCK..(i + 1) * BLOCK],
        );
    }
}

pub fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, QK, w, BLOCK, a, BLOCK);
    let mut sum = 0f32;
    for i in 0..nb {
        let (bw, ba) = (&w[i * BLOCK..], &a[i * BLOCK..]);
        let mut s = 0i32;
        for j in 0..QK {
            s += (bw[2 + j] as i8 as i32) * (ba[2 + j] as i8 as i32);
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
        put_f16(&mut b, 0, 0.5);
        for j in 0..32 {
            b[2 + j] = (j as i8 - 16) as u8;
        }
        let mut y = [0f32; 32];
        dequantize(&b, &mut y);
        for (j, v) in y.iter().enumerate() {
            assert_eq!(*v, 0.5 * (j as f32 - 16.0));
        }
    }

    #[test]
    fn zero_block_has_zero_scale() {
        let mut b = [0xffu8; BLOCK];
        quantize(&[0.0; 32], &mut b);
        let mut y = [1f32; 32];
        dequantize(&b, &mut y);
        assert!(y.iter().all(|v| *v == 0.0));
    }

    #[test]
    fn quantize_rounds_half_away_from_zero() {
        // amax 127 gives d = 1 and id = 1: ties at ±k.5 go away from zero (C `roundf`).
        let mut x = [0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -2.5;
        x[3] = 0.5;
        x[4] = -0.5;
        x[5] = 0.49999997;
        x[6] = -126.5;
        let mut b = [0u8; BLOCK];
        quantize(&x, &mut b);
        assert_eq!(&b[..2], &[0x00, 0x3c]); // f16 1.0
        let q: Vec<i8> = b[2..9].iter().map(|&v| v as i8).collect();
        assert_eq!(q, [127, 3, -3, 1, -1, 0, -127]);
    }

    #[test]
    fn vec_dot_equals_float_dot_on_exact_inputs() {
        let mut w = vec![0u8; 2 * BLOCK];
        let mut a = vec![0u8; 2 * BLOCK];
        for (i, (dw, da)) in [(0.5f32, 0.25f32), (-2.0, 0.125)].into_iter().enumerate() {
            let (bw, ba) = (
                &mut w[i * BLOCK..(i + 1) * BLOCK],
                &mut a[i * BLOCK..(i + 1) * BLOCK],
            );
            put_f16(bw, 0, dw);
            put_f16(ba, 0, da);
            for j in 0..32 {
                bw[2 + j] = ((j as i32 * 53 + i as i32 * 5) % 256 - 128) as i8 as u8;
                ba[2 + j] = ((j as i32 * 37 + i as i32 * 11) % 255 - 127) as i8 as u8;
            }
        }
        let (mut wf, mut af) = (vec![0f32; 64], vec![0f32; 64]);
        dequantize(&w, &mut wf);
        dequantize(&a, &mut af);
        let want: f32 = wf.iter().zip(&af).map(|(x, y)| x * y).sum();
        assert_eq!(vec_dot(64, &w, &a), want);
    }
}
