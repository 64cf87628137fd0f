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
        quantize_block(
            &src[i * QK..(i + 1) * QK],
            &mut dst[i * BLOCK..(i + 1) * BLOCK],
        );
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_matches_hand_computed_bytes() {
        // amax 127: d = 1; q = round(x) (ties away from zero); s = d·Σq.
        let mut x = [0f32; 32];
        x[0] = -127.0;
        x[1] = 2.5;
        x[2] = -3.5;
        x[31] = 10.25;
        let mut b = [0u8; BLOCK];
        quantize(&x, &mut b);
        assert_eq!(&b[..2], &[0x00, 0x3c]); // f16 1.0
        assert_eq!(f16_at(&b, 2), (-127 + 3 - 4 + 10) as f32);
        assert_eq!(
            [b[4] as i8, b[5] as i8, b[6] as i8, b[35] as i8],
            [-127, 3, -4, 10]
        );
        let mut y = [0f32; 32];
        dequantize(&b, &mut y);
        assert_eq!(&y[..3], &[-127.0, 3.0, -4.0]);
    }

    #[test]
    fn zero_block_quantizes_without_nan() {
        let mut b = [0xffu8; BLOCK];
        quantize(&[0.0; 32], &mut b);
        assert!(b.iter().all(|&v| v == 0));
    }

    #[test]
    fn vec_dot_equals_float_dot_on_exact_inputs() {
        // Hand-built blocks with d = 0.25 and 0.125: every product and partial sum is exact.
        let mut q = vec![0u8; 2 * BLOCK];
        for (i, d) in [0.25f32, 0.125].into_iter().enumerate() {
            let b = &mut q[i * BLOCK..(i + 1) * BLOCK];
            let mut sum = 0i32;
            for j in 0..32 {
                let v = (j as i32 * 37 + i as i32 * 11) % 255 - 127;
                b[4 + j] = v as i8 as u8;
                sum += v;
            }
            put_f16(b, 0, d);
            put_f16(b, 2, d * sum as f32);
        }
        let mut y = vec![0f32; 64];
        dequantize(&q, &mut y);
        let want: f32 = y.iter().map(|v| v * v).sum();
        assert_eq!(vec_dot(64, &q, &q), want);
    }
}
