//! F32, F16 and BF16 weight rows (AVX2): dot products with f32 activations and dequantize.
//!
//! Dot products keep two accumulators per activation row (16 elements per step), then one
//! 8-element step, then a scalar tail; tiled and single results are bit-identical.

use super::q8_0::hsum;
use crate::quants::common::last_row;
use crate::quants::float;
use core::arch::x86_64::*;
use half::{bf16, f16};

/// A float weight format: 8 elements at a time, or one for the tail.
pub(super) trait FloatFormat {
    /// Bytes per element.
    const WIDTH: usize;

    /// The 8 elements at `p`, widened.
    ///
    /// # Safety
    /// `p` points to `8 * WIDTH` readable bytes and the CPU has AVX2, FMA and F16C.
    unsafe fn load8(p: *const u8) -> __m256;

    /// The 16 elements at `p`, widened (the AVX-512 level).
    ///
    /// # Safety
    /// `p` points to `16 * WIDTH` readable bytes and the CPU has AVX-512 F and BW.
    unsafe fn load16(p: *const u8) -> __m512;

    /// One element (the scalar tail).
    fn one(b: &[u8]) -> f32;

    /// The scalar reference dequantize (for the tail of `dequantize`).
    const REFERENCE: fn(&[u8], &mut [f32]);
}

pub(super) struct F32;
pub(super) struct F16;
pub(super) struct BF16;

impl FloatFormat for F32 {
    const WIDTH: usize = 4;
    const REFERENCE: fn(&[u8], &mut [f32]) = float::dequantize_f32;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 32 readable bytes at p (caller); `loadu` has no alignment requirement.
        unsafe { _mm256_loadu_ps(p.cast()) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
    unsafe fn load16(p: *const u8) -> __m512 {
        // SAFETY: 64 readable bytes at p (caller).
        unsafe { _mm512_loadu_ps(p.cast()) }
    }

    fn one(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl FloatFormat for F16 {
    const WIDTH: usize = 2;
    const REFERENCE: fn(&[u8], &mut [f32]) = float::dequantize_f16;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 16 readable bytes at p (caller); `loadu` has no alignment requirement.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
    unsafe fn load16(p: *const u8) -> __m512 {
        // SAFETY: 32 readable bytes at p (caller).
        _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) })
    }

    fn one(b: &[u8]) -> f32 {
        f16::from_le_bytes([b[0], b[1]]).to_f32()
    }
}

impl FloatFormat for BF16 {
    const WIDTH: usize = 2;
    const REFERENCE: fn(&[u8], &mut [f32]) = float::dequantize_bf16;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 16 readable bytes at p (caller); `loadu` has no alignment requirement.
        let h = unsafe { _mm_loadu_si128(p.cast()) };
        // A bf16 is the top half of an f32.
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
    unsafe fn load16(p: *const u8) -> __m512 {
        // SAFETY: 32 readable bytes at p (caller).
        let h = unsafe { _mm256_loadu_si256(p.cast()) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    fn one(b: &[u8]) -> f32 {
        bf16::from_le_bytes([b[0], b[1]]).to_f32()
    }
}

/// The scalar dot of elements `js` of the weight row at `w` and the f32 row at `a`: the tail
/// the vector steps leave.
///
/// # Safety
/// Both rows hold every element of `js`.
unsafe fn tail_dot<F: FloatFormat>(js: std::ops::Range<usize>, w: *const u8, a: *const u8) -> f32 {
    let mut tail = 0f32;
    for j in js {
        // SAFETY: element j is inside both rows (caller).
        let (wj, aj) = unsafe {
            let wb = core::slice::from_raw_parts(w.add(j * F::WIDTH), F::WIDTH);
            (F::one(wb), a.cast::<f32>().add(j).read_unaligned())
        };
        tail += wj * aj;
    }
    tail
}

/// Dots of `n` weights at `w` with `R` f32 activation rows, the r-th at `a + r * stride`
/// (bytes). The same operations run for every row whatever `R` is.
///
/// # Safety
/// `w` holds `n` elements, every activation row `n` f32; AVX2, FMA and F16C available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_rows<F: FloatFormat, const R: usize>(
    n: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
) -> [f32; R] {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let mut rows = [a; R];
    for (r, row) in rows.iter_mut().enumerate() {
        *row = a.wrapping_add(r * stride);
    }
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: elements i..i+16 are inside the weight row and every activation row.
        unsafe {
            let w0 = F::load8(w.add(i * F::WIDTH));
            let w1 = F::load8(w.add((i + 8) * F::WIDTH));
            for (s, row) in acc.iter_mut().zip(rows) {
                let x = row.cast::<f32>().add(i);
                s[0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), s[0]);
                s[1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x.add(8)), s[1]);
            }
        }
        i += 16;
    }
    if i + 8 <= n {
        // SAFETY: elements i..i+8 are inside every row.
        unsafe {
            let w0 = F::load8(w.add(i * F::WIDTH));
            for (s, row) in acc.iter_mut().zip(rows) {
                s[0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(row.cast::<f32>().add(i)), s[0]);
            }
        }
        i += 8;
    }
    let mut out = [0f32; R];
    for ((o, s), row) in out.iter_mut().zip(&acc).zip(rows) {
        // SAFETY: elements i..n are inside both rows (caller).
        let tail = unsafe { tail_dot::<F>(i..n, w, row) };
        *o = hsum(_mm256_add_ps(s[0], s[1])) + tail;
    }
    out
}

/// # Safety
/// As `dot_rows`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_one<F: FloatFormat>(n: usize, w: *const u8, a: *const u8) -> f32 {
    // SAFETY: forwarded from the caller.
    let [v] = unsafe { dot_rows::<F, 1>(n, w, a, 0) };
    v
}

/// # Safety
/// As `dot_rows`, for `out.len()` rows.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_multi<F: FloatFormat>(
    n: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: &mut [f32],
) {
    let mut r = 0;
    while r + 4 <= out.len() {
        // SAFETY: rows r..r+4 exist (caller).
        let v = unsafe { dot_rows::<F, 4>(n, w, a.add(r * stride), stride) };
        out[r..r + 4].copy_from_slice(&v);
        r += 4;
    }
    if r + 2 <= out.len() {
        // SAFETY: rows r..r+2 exist (caller).
        let v = unsafe { dot_rows::<F, 2>(n, w, a.add(r * stride), stride) };
        out[r..r + 2].copy_from_slice(&v);
        r += 2;
    }
    if r < out.len() {
        // SAFETY: row r exists (caller).
        let [v] = unsafe { dot_rows::<F, 1>(n, w, a.add(r * stride), stride) };
        out[r] = v;
    }
}

/// # Safety
/// `src` holds `n` elements, `dst` room for `n` floats, where `n` is a multiple of 8; AVX2,
/// FMA and F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_vec<F: FloatFormat>(n: usize, src: *const u8, dst: *mut f32) {
    for i in (0..n).step_by(8) {
        // SAFETY: elements i..i+8 are inside both (caller).
        unsafe { _mm256_storeu_ps(dst.add(i), F::load8(src.add(i * F::WIDTH))) };
    }
}

/// `dot_rows` at the AVX-512 level: two 16-lane accumulators per activation row (32 elements
/// per step), one 16-element step, then the scalar tail. A BF16 or F16 weight is widened to f32
/// exactly, so every product is the f32 one (`vdpbf16ps` would round the activations to bf16).
///
/// # Safety
/// As `dot_rows`, and the CPU has AVX-512 F and BW.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
unsafe fn dot_rows512<F: FloatFormat, const R: usize>(
    n: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
) -> [f32; R] {
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let mut rows = [a; R];
    for (r, row) in rows.iter_mut().enumerate() {
        *row = a.wrapping_add(r * stride);
    }
    let mut i = 0;
    while i + 32 <= n {
        // SAFETY: elements i..i+32 are inside the weight row and every activation row.
        unsafe {
            let w0 = F::load16(w.add(i * F::WIDTH));
            let w1 = F::load16(w.add((i + 16) * F::WIDTH));
            for (s, row) in acc.iter_mut().zip(rows) {
                let x = row.cast::<f32>().add(i);
                s[0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), s[0]);
                s[1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x.add(16)), s[1]);
            }
        }
        i += 32;
    }
    if i + 16 <= n {
        // SAFETY: elements i..i+16 are inside every row.
        unsafe {
            let w0 = F::load16(w.add(i * F::WIDTH));
            for (s, row) in acc.iter_mut().zip(rows) {
                s[0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(row.cast::<f32>().add(i)), s[0]);
            }
        }
        i += 16;
    }
    let mut out = [0f32; R];
    for ((o, s), row) in out.iter_mut().zip(&acc).zip(rows) {
        // SAFETY: elements i..n are inside both rows (caller).
        let tail = unsafe { tail_dot::<F>(i..n, w, row) };
        *o = _mm512_reduce_add_ps(_mm512_add_ps(s[0], s[1])) + tail;
    }
    out
}

/// # Safety
/// As `dot_rows512`, for `out.len()` rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
unsafe fn dot_multi512<F: FloatFormat>(
    n: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: &mut [f32],
) {
    let mut r = 0;
    while r + 4 <= out.len() {
        // SAFETY: rows r..r+4 exist (caller).
        let v = unsafe { dot_rows512::<F, 4>(n, w, a.add(r * stride), stride) };
        out[r..r + 4].copy_from_slice(&v);
        r += 4;
    }
    while r < out.len() {
        // SAFETY: row r exists (caller).
        let [v] = unsafe { dot_rows512::<F, 1>(n, w, a.add(r * stride), stride) };
        out[r] = v;
        r += 1;
    }
}

/// The AVX-512 entry points, installed by `specialize_avx512` only once
/// `gemm512::available()` holds.
pub(super) fn vec_dot512<F: FloatFormat>(n: usize, w: &[u8], a: &[u8]) -> f32 {
    check(n, w, F::WIDTH, a);
    debug_assert!(super::gemm512::available());
    // SAFETY: `check` proved both rows hold `n` elements; the CPU has the features.
    let [v] = unsafe { dot_rows512::<F, 1>(n, w.as_ptr(), a.as_ptr(), 0) };
    v
}

pub(super) fn vec_dot_multi512<F: FloatFormat>(
    n: usize,
    w: &[u8],
    a: &[u8],
    stride: usize,
    out: &mut [f32],
) {
    if !check_multi(n, w, F::WIDTH, a, stride, out.len()) {
        return;
    }
    debug_assert!(super::gemm512::available());
    // SAFETY: the weight row and the last activation row hold `n` elements, hence every row
    // does; the CPU has the features.
    unsafe { dot_multi512::<F>(n, w.as_ptr(), a.as_ptr(), stride, out) }
}

/// `check` for `rows` activation rows `stride` bytes apart: the last (furthest) row is checked,
/// so every row holds `n` elements. False when there are no rows.
fn check_multi(n: usize, w: &[u8], width: usize, a: &[u8], stride: usize, rows: usize) -> bool {
    let Some(start) = last_row("vec_dot_multi", rows, stride, a.len()) else {
        return false;
    };
    check(n, w, width, &a[start..]);
    true
}

fn check(n: usize, w: &[u8], width: usize, a: &[u8]) {
    let need = n.checked_mul(width).zip(n.checked_mul(4));
    assert!(
        need.is_some_and(|(nw, na)| w.len() >= nw && a.len() >= na),
        "row too short for {n} elements"
    );
}

/// Safe entry points, installed by `specialize` only once `available()` holds.
pub(super) fn vec_dot<F: FloatFormat>(n: usize, w: &[u8], a: &[u8]) -> f32 {
    check(n, w, F::WIDTH, a);
    debug_assert!(super::available());
    // SAFETY: `check` proved both rows hold `n` elements; the CPU has the features
    // (installed only after detection).
    unsafe { dot_one::<F>(n, w.as_ptr(), a.as_ptr()) }
}

pub(super) fn vec_dot_multi<F: FloatFormat>(
    n: usize,
    w: &[u8],
    a: &[u8],
    stride: usize,
    out: &mut [f32],
) {
    if !check_multi(n, w, F::WIDTH, a, stride, out.len()) {
        return;
    }
    debug_assert!(super::available());
    // SAFETY: the weight row and the last (furthest) activation row hold `n` elements, hence
    // every row does; the CPU has the features (installed only after detection).
    unsafe { dot_multi::<F>(n, w.as_ptr(), a.as_ptr(), stride, out) }
}

pub(super) fn dequantize<F: FloatFormat>(src: &[u8], dst: &mut [f32]) {
    let n = dst.len().min(src.len() / F::WIDTH);
    let body = n - n % 8;
    debug_assert!(super::available());
    // SAFETY: `src` holds at least `body` elements and `dst` has room for them; the CPU has
    // the features (installed only after detection).
    unsafe { dequantize_vec::<F>(body, src.as_ptr(), dst.as_mut_ptr()) };
    (F::REFERENCE)(&src[body * F::WIDTH..], &mut dst[body..]);
}

/// f32 to f16 with F16C, eight at a time, rounding to nearest even: the reference's bits
/// (`half`, which uses the same instruction where the CPU has it), NaN, infinities and
/// subnormals included. `ringllm convert --type f16` and the f16 KV cache use it.
pub(super) fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    let n = src.len().min(dst.len() / 2);
    let body = n - n % 8;
    debug_assert!(super::available());
    // SAFETY: the CPU has F16C (installed only after detection).
    unsafe { quantize_f16_f16c(&src[..body], &mut dst[..2 * body]) };
    crate::quants::float::quantize_f16(&src[body..n], &mut dst[2 * body..2 * n]);
}

#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_f16_f16c(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(8).zip(dst.chunks_exact_mut(16)) {
        // SAFETY: `x` holds 8 f32 and `y` 16 bytes.
        unsafe {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(x.as_ptr()));
            _mm_storeu_si128(y.as_mut_ptr().cast(), h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GgmlType;

    #[test]
    fn f16_conversion_gives_the_reference_bits() {
        if !super::super::available() {
            return;
        }
        let mut x: Vec<f32> = [
            0.0,
            -0.0,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7fc0_1234),
            f32::INFINITY,
            f32::NEG_INFINITY,
            65504.0,
            65520.0,
            1e9,
            6.0e-8,
            2.9e-8,
            3.0e-8,
            1e-12,
            1.0 + 1.0 / 2048.0,
            1.0 + 3.0 / 2048.0,
            -(1.0 + 1.0 / 2048.0),
        ]
        .to_vec();
        let mut seed = 9u64;
        for _ in 0..10_000 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            x.push(f32::from_bits((seed >> 32) as u32));
        }
        let mut want = vec![0u8; 2 * x.len()];
        let mut got = vec![1u8; 2 * x.len()];
        crate::quants::float::quantize_f16(&x, &mut want);
        quantize_f16(&x, &mut got);
        for (i, (g, w)) in got.chunks(2).zip(want.chunks(2)).enumerate() {
            assert_eq!(g, w, "value {i}: {:e} ({:#x})", x[i], x[i].to_bits());
        }
    }

    /// Every level this CPU has: multi-row and single dots give the same bits, and both are
    /// within 1e-5 of the scalar reference.
    fn check_format<F: FloatFormat>(ty: GgmlType) {
        let r = crate::reference(ty);
        let mut seed = 5u32;
        let mut next = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
        };
        for n in [0usize, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 100] {
            let x: Vec<f32> = (0..n).map(|_| next()).collect();
            let mut w = vec![0u8; n * F::WIDTH];
            (r.quantize)(&x, &mut w);
            let (mut want, mut got) = (vec![0f32; n], vec![1f32; n]);
            (r.dequantize)(&w, &mut want);
            dequantize::<F>(&w, &mut got);
            assert_eq!(got, want, "{ty} dequantize of {n}");
            let stride = 4 * n + 4;
            let rows = 6;
            let mut a = vec![0u8; rows * stride];
            for row in 0..rows {
                let y: Vec<f32> = (0..n).map(|_| next()).collect();
                float::quantize_f32(&y, &mut a[row * stride..row * stride + 4 * n]);
            }
            let wide = super::super::gemm512::available();
            for (level, m) in (1..=rows)
                .map(|m| (false, m))
                .chain((1..=rows).filter(|_| wide).map(|m| (true, m)))
            {
                type Dot = fn(usize, &[u8], &[u8]) -> f32;
                type Multi = fn(usize, &[u8], &[u8], usize, &mut [f32]);
                let (dot, multi): (Dot, Multi) = if level {
                    (vec_dot512::<F>, vec_dot_multi512::<F>)
                } else {
                    (vec_dot::<F>, vec_dot_multi::<F>)
                };
                let mut out = vec![0f32; m];
                multi(n, &w, &a, stride, &mut out);
                for (row, o) in out.iter().enumerate() {
                    let ar = &a[row * stride..];
                    let single = dot(n, &w, ar);
                    assert_eq!(
                        o.to_bits(),
                        single.to_bits(),
                        "{ty}: n {n}, row {row} of {m} (512 bits: {level})"
                    );
                    let want = (r.vec_dot)(n, &w, ar);
                    assert!(
                        (single - want).abs() <= 1e-5 * want.abs().max(1.0),
                        "{ty}: n {n}"
                    );
                }
            }
        }
    }

    #[test]
    fn float_formats_at_odd_lengths() {
        if !super::super::available() {
            return;
        }
        check_format::<F32>(GgmlType::F32);
        check_format::<F16>(GgmlType::F16);
        check_format::<BF16>(GgmlType::BF16);
    }
}
