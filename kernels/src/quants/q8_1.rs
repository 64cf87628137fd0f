//! Q8_1: Q8_0 plus `s = d·Σq` per block; the activation format for Q4_1 and Q5_1 dot products
//! (the sum carries the weights' offset term).

use super::common::{check_blocks, check_dot, f16_at, put_f16, round_away};
use crate::types::GgmlType;

pub const QK: usize = 32;
pub const BLOCK: usize = 36;
pub const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_1;

pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_blocks(src.len(), dst.len(), QK, BLOCK);
    for i in 0..nb {
        let b = &src[i * BLOCK..(i + 1) * BLOCK];
        let d = f16_at(b, 0);
        for (j, y) in dst[i * QK..(i + 1) * QK].iter_mut().enumerate() {
            *y = d * (b[4 + j] as i8) as f32;
        }
    }
}

pub fn quantize_block(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (j, v) in x.iter().enumerate() {
        let q = round_away(v * id) as i8;
        b[4 + j] = q as u8;
        sum += q as i32;
    }
    put_f16(b, 0, d);
    put_f16(b, 2, sum as f32 * d);
}

pub fn quantize(src: &[f32], dst: &mut [u8]) {
    let nb = check_blocks(dst.len(), src.len(), QK, BLOCK);
    for i in 0..nb {
        quantize_block(&src[i * QK..(i + 1) * QK], &mut dst[i * BLOCK..(i + 1) * BLOCK]);
    }
}

/// Q8_1 · Q8_1 (not used by models; defined so every type has a dot product).
pub fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, QK, w, BLOCK, a, BLOCK);
    let mut sum = 0f32;
    for i in 0..nb {
        let (bw, ba) = (&w[i * BLOCK..], &a[i * BLOCK..]);
        let mut s = 0i32;
        for j in 0..QK {
            s += (bw[4 + j] as i8 as i32) * (ba[4 + j] as i8 as i32);
        }
        sum += f16_at(bw, 0) * f16_at(ba, 0) * s as f32;
    }
    sum
}
