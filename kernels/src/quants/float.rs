//! F32, F16 and BF16 rows (scalar reference). Float weights are dotted with F32 activations.

use half::{bf16, f16};

fn check(n: usize, w: &[u8], width: usize, a: &[u8]) {
    assert!(
        w.len() >= n * width && a.len() >= n * 4,
        "row too short for {n} elements"
    );
}

fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

pub fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

pub fn quantize_f32(src: &[f32], dst: &mut [u8]) {
    for (s, c) in src.iter().zip(dst.chunks_exact_mut(4)) {
        c.copy_from_slice(&s.to_le_bytes());
    }
}

pub fn vec_dot_f32(n: usize, w: &[u8], a: &[u8]) -> f32 {
    check(n, w, 4, a);
    (0..n).map(|i| f32_at(w, i) * f32_at(a, i)).sum()
}

pub fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f16::from_le_bytes([c[0], c[1]]).to_f32();
    }
}

pub fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    for (s, c) in src.iter().zip(dst.chunks_exact_mut(2)) {
        c.copy_from_slice(&f16::from_f32(*s).to_le_bytes());
    }
}

pub fn vec_dot_f16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    check(n, w, 2, a);
    (0..n)
        .map(|i| f16::from_le_bytes([w[2 * i], w[2 * i + 1]]).to_f32() * f32_at(a, i))
        .sum()
}

pub fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = bf16::from_le_bytes([c[0], c[1]]).to_f32();
    }
}

pub fn quantize_bf16(src: &[f32], dst: &mut [u8]) {
    for (s, c) in src.iter().zip(dst.chunks_exact_mut(2)) {
        c.copy_from_slice(&bf16::from_f32(*s).to_le_bytes());
    }
}

pub fn vec_dot_bf16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    check(n, w, 2, a);
    (0..n)
        .map(|i| bf16::from_le_bytes([w[2 * i], w[2 * i + 1]]).to_f32() * f32_at(a, i))
        .sum()
}
