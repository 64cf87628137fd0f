//! F32, F16 and BF16 weight rows (NEON): dot products with f32 activations, and dequantize.
//!
//! Dot products keep four accumulators per activation row (16 elements per step), then a
//! scalar tail; the multi-row and single forms run the same operations per row, so they agree
//! bit for bit.

use super::f16x8;
use crate::dispatch::TypeKernels;
use crate::quants::common::last_row;
use crate::quants::float;
use core::arch::aarch64::*;
use half::{bf16, f16};

/// A float weight format, 16 elements at a time.
pub(super) trait FloatFormat: 'static {
    /// Bytes per element.
    const WIDTH: usize;
    /// The scalar reference dequantize (for the tail of `dequantize`).
    const REFERENCE: fn(&[u8], &mut [f32]);

    /// The 16 elements at `p`, widened exactly.
    ///
    /// # Safety
    /// `p` points to `16 * WIDTH` readable bytes.
    unsafe fn load16(p: *const u8) -> [float32x4_t; 4];

    /// One element (the scalar tail).
    fn one(b: &[u8]) -> f32;
}

pub(super) struct F32;
pub(super) struct F16;
pub(super) struct BF16;

impl FloatFormat for F32 {
    const WIDTH: usize = 4;
    const REFERENCE: fn(&[u8], &mut [f32]) = float::dequantize_f32;

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load16(p: *const u8) -> [float32x4_t; 4] {
        // SAFETY: 64 readable bytes at p (caller); `vld1q` has no alignment requirement.
        unsafe { [0, 16, 32, 48].map(|o| vld1q_f32(p.add(o).cast())) }
    }

    fn one(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl FloatFormat for F16 {
    const WIDTH: usize = 2;
    const REFERENCE: fn(&[u8], &mut [f32]) = float::dequantize_f16;

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load16(p: *const u8) -> [float32x4_t; 4] {
        // SAFETY: 32 readable bytes at p (caller).
        let ([a, b], [c, d]) = unsafe { (f16x8(p), f16x8(p.add(16))) };
        [a, b, c, d]
    }

    fn one(b: &[u8]) -> f32 {
        f16::from_le_bytes([b[0], b[1]]).to_f32()
    }
}

impl FloatFormat for BF16 {
    const WIDTH: usize = 2;
    const REFERENCE: fn(&[u8], &mut [f32]) = float::dequantize_bf16;

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load16(p: *const u8) -> [float32x4_t; 4] {
        // SAFETY: 32 readable bytes at p (caller).
        let (x, y) = unsafe { (vld1q_u16(p.cast()), vld1q_u16(p.add(16).cast())) };
        // A bf16 is the top half of an f32.
        let wide = |v: uint16x8_t| {
            [
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(v))),
                vreinterpretq_f32_u32(vshll_high_n_u16::<16>(v)),
            ]
        };
        let ([a, b], [c, d]) = (wide(x), wide(y));
        [a, b, c, d]
    }

    fn one(b: &[u8]) -> f32 {
        bf16::from_le_bytes([b[0], b[1]]).to_f32()
    }
}

/// Dots of the `n`-element weight row `w` with `R` f32 rows (`a[r]`).
///
/// # Safety
/// Every row holds `n` elements.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn dot_rows<F: FloatFormat, const R: usize>(
    n: usize,
    w: *const u8,
    a: [*const u8; R],
) -> [f32; R] {
    let mut acc = [[vdupq_n_f32(0.0); 4]; R];
    let mut j = 0;
    while j + 16 <= n {
        // SAFETY: elements j..j + 16 lie inside every row (caller).
        let x = unsafe { F::load16(w.add(j * F::WIDTH)) };
        for (acc, ar) in acc.iter_mut().zip(a) {
            // SAFETY: as above.
            let y = unsafe { F32::load16(ar.add(4 * j)) };
            for k in 0..4 {
                acc[k] = vfmaq_f32(acc[k], x[k], y[k]);
            }
        }
        j += 16;
    }
    let mut out = [0f32; R];
    for ((o, acc), ar) in out.iter_mut().zip(&acc).zip(a) {
        let mut s = vaddvq_f32(vaddq_f32(
            vaddq_f32(acc[0], acc[1]),
            vaddq_f32(acc[2], acc[3]),
        ));
        for t in j..n {
            // SAFETY: element t lies inside both rows (caller).
            let (wt, at) = unsafe {
                (
                    core::slice::from_raw_parts(w.add(t * F::WIDTH), F::WIDTH),
                    core::slice::from_raw_parts(ar.add(4 * t), 4),
                )
            };
            s += F::one(wt) * F32::one(at);
        }
        *o = s;
    }
    out
}

fn check(n: usize, w: &[u8], width: usize, a: &[u8]) {
    assert!(
        w.len() / width >= n && a.len() / 4 >= n,
        "dot of {n} elements: rows too short ({} and {} bytes)",
        w.len(),
        a.len()
    );
}

pub(super) fn vec_dot<F: FloatFormat>(n: usize, w: &[u8], a: &[u8]) -> f32 {
    check(n, w, F::WIDTH, a);
    // SAFETY: both rows hold `n` elements (checked above).
    let [v] = unsafe { dot_rows::<F, 1>(n, w.as_ptr(), [a.as_ptr()]) };
    v
}

pub(super) fn vec_dot_multi<F: FloatFormat>(
    n: usize,
    w: &[u8],
    a: &[u8],
    stride: usize,
    out: &mut [f32],
) {
    let Some(start) = last_row("vec_dot_multi", out.len(), stride, a.len()) else {
        return;
    };
    check(n, w, F::WIDTH, &a[start..]);
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let mut r = 0;
    while out.len() - r >= 4 {
        let rows: [*const u8; 4] = core::array::from_fn(|k| ap.wrapping_add((r + k) * stride));
        // SAFETY: every row holds `n` elements (the last was checked above).
        let v = unsafe { dot_rows::<F, 4>(n, wp, rows) };
        out[r..r + 4].copy_from_slice(&v);
        r += 4;
    }
    while r < out.len() {
        // SAFETY: as above.
        let [v] = unsafe { dot_rows::<F, 1>(n, wp, [ap.wrapping_add(r * stride)]) };
        out[r] = v;
        r += 1;
    }
}

/// Widens whole rows of 16, then the reference for the tail: exact, so bit-identical.
pub(super) fn dequantize<F: FloatFormat>(src: &[u8], dst: &mut [f32]) {
    let n = dst.len();
    assert!(
        src.len() / F::WIDTH >= n,
        "dequantize: source too short for {n} elements"
    );
    let body = n - n % 16;
    for (j, y) in dst[..body].chunks_exact_mut(16).enumerate() {
        // SAFETY: elements 16j..16j + 16 lie inside `src` (checked above).
        let x = unsafe { F::load16(src.as_ptr().add(16 * j * F::WIDTH)) };
        for (k, v) in x.into_iter().enumerate() {
            // SAFETY: `y` holds 16 floats.
            unsafe { vst1q_f32(y.as_mut_ptr().add(4 * k), v) };
        }
    }
    (F::REFERENCE)(&src[body * F::WIDTH..], &mut dst[body..]);
}

pub(super) fn entry<F: FloatFormat>(entry: &mut TypeKernels) {
    entry.dequantize = dequantize::<F>;
    entry.vec_dot = vec_dot::<F>;
    entry.vec_dot_multi = Some(vec_dot_multi::<F>);
}
