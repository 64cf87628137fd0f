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
        let max = x.iter().fold(0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
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
}
