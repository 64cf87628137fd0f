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
        let max = x
            .iter()
            .fold(0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_block_and_quantize_bytes() {
        // Element j holds q = j, i.e. x = j − 16: low nibbles j & 15, the fifth bit set for
        // elements 16..32.
        let mut b = [0u8; BLOCK];
        put_f16(&mut b, 0, 1.0);
        b[2..6].copy_from_slice(&0xffff_0000u32.to_le_bytes());
        for j in 0..16 {
            b[6 + j] = j as u8 | ((j as u8) << 4);
        }
        let mut y = [0f32; 32];
        dequantize(&b, &mut y);
        for (j, v) in y.iter().enumerate() {
            assert_eq!(*v, j as f32 - 16.0);
        }
        // The first value of largest magnitude is −16, so d = 1 and the bytes come back.
        let mut c = [0u8; BLOCK];
        quantize(&y, &mut c);
        assert_eq!(c, b);
    }

    #[test]
    fn zero_block_quantizes_without_nan() {
        let mut b = [0xffu8; BLOCK];
        quantize(&[0.0; 32], &mut b);
        // d = 0 / −16 = −0.0, stored as f16 0x8000 (as ggml does); the inverse scale is 0.
        assert_eq!(&b[..2], &[0x00, 0x80]);
        let mut y = [1f32; 32];
        dequantize(&b, &mut y);
        assert!(y.iter().all(|v| *v == 0.0));
    }

    #[test]
    fn vec_dot_equals_float_dot_on_exact_inputs() {
        let ab = q8_0_block::BLOCK;
        let mut w = vec![0u8; 2 * BLOCK];
        let mut a = vec![0u8; 2 * ab];
        for (i, (dw, da)) in [(0.5f32, 0.25f32), (-2.0, 0.125)].into_iter().enumerate() {
            let bw = &mut w[i * BLOCK..(i + 1) * BLOCK];
            put_f16(bw, 0, dw);
            bw[2..6].copy_from_slice(&(0x9e37_79b9u32 >> i).to_le_bytes());
            for j in 0..16 {
                bw[6 + j] = ((j * 5 + i) % 16) as u8 | ((((j * 3 + 7 * i) % 16) as u8) << 4);
            }
            let ba = &mut a[i * ab..(i + 1) * ab];
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
