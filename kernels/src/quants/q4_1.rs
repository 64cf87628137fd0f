//! Q4_1: blocks of 32 as f16 scale d, f16 minimum m and 16 bytes of nibbles; x = d·q + m.

use super::common::{check_blocks, check_dot, f16_at, put_f16};
use crate::types::GgmlType;

pub const QK: usize = 32;
pub const BLOCK: usize = 20;
pub const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_1;

pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_blocks(src.len(), dst.len(), QK, BLOCK);
    for i in 0..nb {
        let b = &src[i * BLOCK..(i + 1) * BLOCK];
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        let y = &mut dst[i * QK..(i + 1) * QK];
        for j in 0..16 {
            y[j] = d * (b[4 + j] & 0xf) as f32 + m;
            y[j + 16] = d * (b[4 + j] >> 4) as f32 + m;
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
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        put_f16(b, 2, min);
        for j in 0..16 {
            let q0 = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
            let q1 = (((x[j + 16] - min) * id + 0.5) as i8).min(15) as u8;
            b[4 + j] = q0 | (q1 << 4);
        }
    }
}

pub fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let ab = super::q8_1::BLOCK;
    let nb = check_dot(n, QK, w, BLOCK, a, ab);
    let mut sum = 0f32;
    for i in 0..nb {
        let (bw, ba) = (&w[i * BLOCK..], &a[i * ab..]);
        let mut s = 0i32;
        for j in 0..16 {
            s += (bw[4 + j] & 0xf) as i32 * (ba[4 + j] as i8 as i32);
            s += (bw[4 + j] >> 4) as i32 * (ba[4 + j + 16] as i8 as i32);
        }
        sum += f16_at(bw, 0) * f16_at(ba, 0) * s as f32 + f16_at(bw, 2) * f16_at(ba, 2);
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    /// x = 0.25·q + 1 with q = (7j) mod 16 (covers 0 and 15): min 1, max 4.75, d = 0.25.
    fn levels() -> [f32; 32] {
        let mut x = [0f32; 32];
        for (j, v) in x.iter_mut().enumerate() {
            *v = 0.25 * ((7 * j) % 16) as f32 + 1.0;
        }
        x
    }

    #[test]
    fn known_block_and_quantize_bytes() {
        let mut b = [0u8; BLOCK];
        quantize(&levels(), &mut b);
        assert_eq!(&b[..4], &[0x00, 0x34, 0x00, 0x3c]); // f16 0.25, f16 1.0
        for j in 0..16 {
            let (lo, hi) = ((7 * j) % 16, (7 * (j + 16)) % 16);
            assert_eq!(b[4 + j], lo as u8 | ((hi as u8) << 4), "byte {j}");
        }
        let mut y = [0f32; 32];
        dequantize(&b, &mut y);
        assert_eq!(y, levels());
    }

    #[test]
    fn constant_and_zero_blocks_quantize_without_nan() {
        for c in [0.0f32, 3.0] {
            let mut b = [0xffu8; BLOCK];
            quantize(&[c; 32], &mut b);
            assert_eq!(&b[..2], &[0, 0], "d of a constant block");
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
            for j in 0..16 {
                bw[4 + j] = ((j * 5 + i) % 16) as u8 | ((((j * 3 + 7 * i) % 16) as u8) << 4);
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
