//! Q5_0: blocks of 32 as an f16 scale, 32 high bits `qh` and 16 bytes of low nibbles;
//! x = d·((q | h<<4) − 16).

use super::common::{check_blocks, check_dot, f16_at, put_f16};
use crate::types::GgmlType;

pub const QK: usize = 32;
pub const BLOCK: usize = 22;
pub const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_0;

#[inline]
fn qh(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[2], b[3], b[4], b[5]])
}

/// The 32 unsigned 5-bit values of a block.
#[inline]
fn values(b: &[u8]) -> [i32; 32] {
    let h = qh(b);
    let mut q = [0i32; 32];
    for j in 0..16 {
        q[j] = ((b[6 + j] & 0xf) as u32 | (((h >> j) & 1) << 4)) as i32;
        q[j + 16] = ((b[6 + j] >> 4) as u32 | (((h >> (j + 16)) & 1) << 4)) as i32;
    }
    q
}

pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_blocks(src.len(), dst.len(), QK, BLOCK);
    for i in 0..nb {
        let b = &src[i * BLOCK..(i + 1) * BLOCK];
        let d = f16_at(b, 0);
        for (y, q) in dst[i * QK..(i + 1) * QK].iter_mut().zip(values(b)) {
            *y = d * (q - 16) as f32;
        }
    }
}

pub fn quantize(src: &[f32], dst: &mut [u8]) {
    let nb = check_blocks(dst.len(), src.len(), QK, BLOCK);
    for i in 0..nb {
        let x = &src[i * QK..(i + 1) * QK];
        let b = &mut dst[i * BLOCK..(i + 1) * BLOCK];
        let max = x.iter().fold(0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        let mut h = 0u32;
        for j in 0..16 {
            let q0 = ((x[j] * id + 16.5) as i8).min(31) as u32;
            let q1 = ((x[j + 16] * id + 16.5) as i8).min(31) as u32;
            b[6 + j] = ((q0 & 0xf) | ((q1 & 0xf) << 4)) as u8;
            h |= ((q0 & 0x10) >> 4) << j;
            h |= ((q1 & 0x10) >> 4) << (j + 16);
        }
        b[2..6].copy_from_slice(&h.to_le_bytes());
    }
}

pub fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let ab = super::q8_0::BLOCK;
    let nb = check_dot(n, QK, w, BLOCK, a, ab);
    let mut sum = 0f32;
    for i in 0..nb {
        let (bw, ba) = (&w[i * BLOCK..], &a[i * ab..]);
        let q = values(bw);
        let mut s = 0i32;
        for j in 0..QK {
            s += (q[j] - 16) * (ba[2 + j] as i8 as i32);
        }
        sum += f16_at(bw, 0) * f16_at(ba, 0) * s as f32;
    }
    sum
}
