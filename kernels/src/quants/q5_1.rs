//! Q5_1: blocks of 32 as f16 scale d, f16 minimum m, 32 high bits and 16 bytes of low
//! nibbles; x = d·(q | h<<4) + m.

use super::common::{check_blocks, check_dot, f16_at, put_f16};
use crate::types::GgmlType;

pub const QK: usize = 32;
pub const BLOCK: usize = 24;
pub const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_1;

#[inline]
fn values(b: &[u8]) -> [i32; 32] {
    let h = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let mut q = [0i32; 32];
    for j in 0..16 {
        q[j] = ((b[8 + j] & 0xf) as u32 | (((h >> j) & 1) << 4)) as i32;
        q[j + 16] = ((b[8 + j] >> 4) as u32 | (((h >> (j + 16)) & 1) << 4)) as i32;
    }
    q
}

pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_blocks(src.len(), dst.len(), QK, BLOCK);
    for i in 0..nb {
        let b = &src[i * BLOCK..(i + 1) * BLOCK];
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        for (y, q) in dst[i * QK..(i + 1) * QK].iter_mut().zip(values(b)) {
            *y = d * q as f32 + m;
        }
    }
}

pub fn quantize(src: &[f32], dst: &mut [u8]) {
    let nb = check_blocks(dst.len(), src.len(), QK, BLOCK);
    for i in 0..nb {
        let x = &src[i * QK..(i + 1) * QK];
        let b = &mut dst[i * BLOCK..(i + 1) * BLOCK];
        let min = x.iter().copied().fold(f32::INFINITY, f32::min);
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        put_f16(b, 2, min);
        let mut h = 0u32;
        for j in 0..16 {
            let q0 = (((x[j] - min) * id + 0.5) as u8).min(31) as u32;
            let q1 = (((x[j + 16] - min) * id + 0.5) as u8).min(31) as u32;
            b[8 + j] = ((q0 & 0xf) | ((q1 & 0xf) << 4)) as u8;
            h |= ((q0 & 0x10) >> 4) << j;
            h |= ((q1 & 0x10) >> 4) << (j + 16);
        }
        b[4..8].copy_from_slice(&h.to_le_bytes());
    }
}

pub fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let ab = super::q8_1::BLOCK;
    let nb = check_dot(n, QK, w, BLOCK, a, ab);
    let mut sum = 0f32;
    for i in 0..nb {
        let (bw, ba) = (&w[i * BLOCK..], &a[i * ab..]);
        let q = values(bw);
        let mut s = 0i32;
        for j in 0..QK {
            s += q[j] * (ba[4 + j] as i8 as i32);
        }
        sum += f16_at(bw, 0) * f16_at(ba, 0) * s as f32 + f16_at(bw, 2) * f16_at(ba, 2);
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_block_and_quantize_bytes() {
        // q = 31 − j, d = 0.5, m = −3: x = 0.5·(31 − j) − 3, from 12.5 down to −3.
        let mut b = [0u8; BLOCK];
        put_f16(&mut b, 0, 0.5);
        put_f16(&mut b, 2, -3.0);
        b[4..8].copy_from_slice(&0x0000_ffffu32.to_le_bytes());
        for j in 0..16 {
            let (lo, hi) = ((31 - j) & 15, (15 - j) & 15);
            b[8 + j] = lo as u8 | ((hi as u8) << 4);
        }
        let mut y = [0f32; 32];
        dequantize(&b, &mut y);
        for (j, v) in y.iter().enumerate() {
            assert_eq!(*v, 0.5 * (31 - j) as f32 - 3.0);
        }
        // min −3, max 12.5: d = 15.5 / 31 = 0.5 exactly, so the bytes come back.
        let mut c = [0u8; BLOCK];
        quantize(&y, &mut c);
        assert_eq!(c, b);
    }

    #[test]
    fn constant_and_zero_blocks_quantize_without_nan() {
        for c in [0.0f32, -2.5] {
            let mut b = [0xffu8; BLOCK];
            quantize(&[c; 32], &mut b);
            let mut y = [f32::NAN; 32];
            dequantize(&b, &mut y);
            assert!(y.iter().all(|v| *v == c));
        }
    }

    #[test]
    fn vec_dot_equals_float_dot_on_exact_inputs() {
        let ab = q8_1_block::BLOCK;
        let mut w = vec![0u8; 2 * BLOCK];
        let mut a = vec![0u8; 2 * ab];
        for (i, (dw, mw, da)) in [(0.5f32, -1.5f32, 0.25f32), (2.0, 0.75, 0.125)]
            .into_iter()
            .enumerate()
        {
            let bw = &mut w[i * BLOCK..(i + 1) * BLOCK];
            put_f16(bw, 0, dw);
            put_f16(bw, 2, mw);
            bw[4..8].copy_from_slice(&(0x9e37_79b9u32 >> i).to_le_bytes());
            for j in 0..16 {
                bw[8 + j] = ((j * 5 + i) % 16) as u8 | ((((j * 3 + 7 * i) % 16) as u8) << 4);
            }
            let ba = &mut a[i * ab..(i + 1) * ab];
            let mut sum = 0i32;
            for j in 0..32 {
                let q = (j as i32 * 37 + i as i32 * 11) % 255 - 127;
                ba[4 + j] = q as i8 as u8;
                sum += q;
            }
            put_f16(ba, 0, da);
            put_f16(ba, 2, da * sum as f32);
            assert_eq!(
                f16_at(ba, 2),
                da * sum as f32,
                "s must be exact for this test"
            );
        }
        let (mut wf, mut af) = (vec![0f32; 64], vec![0f32; 64]);
        dequantize(&w, &mut wf);
        q8_1_block::dequantize(&a, &mut af);
        let want: f32 = wf.iter().zip(&af).map(|(x, y)| x * y).sum();
        assert_eq!(vec_dot(64, &w, &a), want);
    }

    use crate::quants::q8_1 as q8_1_block;
}
