//! Q8_0 and Q8_1 (AVX2): dot products, dequantize and the activation quantizers that run on
//! every token. Also the machinery shared by every 32-element ("legacy") block format: a
//! format describes how to unpack one block into 32 bytes of quants (`Legacy`), and the
//! generic loops here do the rest.
//!
//! Dot products follow ggml: the 32 products of a block are summed as integers
//! (`maddubs` + `madd`), converted to f32 and accumulated with one FMA per block by the block's
//! scale product. Signed weights use the sign trick (`|w|` times `sign(a, w)`), which requires
//! activations in -127..=127: our quantizers never produce -128.

use crate::quants::common::{check_blocks, check_dot, last_row};
use crate::quants::{q8_0, q8_1};
use core::arch::x86_64::*;

/// Elements per block of every legacy format.
pub(super) const QK: usize = 32;

/// How far ahead (in bytes) the decode kernels (and the GEMM when it streams) ask for weight
/// rows. Measured on a Zen 5 EPYC (Gemma 3 270M, 1 thread): 4 KiB ahead 74 tok/s, 34 KiB 87,
/// 70 KiB 82; the head's 680-byte rows end long before that, so the hint runs ahead into the
/// rows that follow.
pub(super) const PREFETCH_BYTES: usize = 32 << 10;

/// One 32-element weight block format, dotted with Q8_0 or Q8_1 activations.
pub(super) trait Legacy {
    /// Bytes per weight block. The f16 scale `d` is always at offset 0.
    const BLOCK: usize;
    /// Bytes per activation block (34 for Q8_0, 36 for Q8_1).
    const ABLOCK: usize;
    /// Offset of the 32 activation quants in an activation block.
    const AQS: usize;
    /// True when `unpack` yields signed values and x = d·q; false when it yields unsigned
    /// values with an f16 minimum `m` at offset 2 (x = d·q + m, dotted with Q8_1, whose sum
    /// `s` at offset 2 carries the m term).
    const SIGNED: bool;

    /// The 32 quants of the block at `p`, element j in byte j.
    ///
    /// # Safety
    /// `p` points to `BLOCK` readable bytes and the CPU has AVX2.
    unsafe fn unpack(p: *const u8) -> __m256i;
}

/// `v` as f16 bits, rounded to nearest even (as `half::f16::from_f32`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn to_f16_bits(v: f32) -> u16 {
    let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(v));
    _mm_extract_epi16::<0>(h) as u16
}

/// Sum of the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// 32 bytes of nibbles from 16 bytes at `p`: low nibbles in bytes 0..16, high in 16..32.
///
/// # Safety
/// `p` points to 16 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes; `loadu` has no alignment requirement.
    let raw = unsafe { _mm_loadu_si128(p.cast()) };
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(raw), raw);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

/// Byte j is 0xff when bit j of the little-endian u32 at `p` is set, else 0.
///
/// # Safety
/// `p` points to 4 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn bits_to_bytes(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 4 readable bytes; `read_unaligned` has no alignment
    // requirement.
    let bits = u32::from_le(unsafe { p.cast::<u32>().read_unaligned() });
    // Every 128-bit lane holds the four bytes of `bits`; byte j takes byte j / 8 of them.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        ),
    );
    // Byte j then keeps only bit j % 8.
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit)
}

/// Scale products of a weight block and an activation block from their headers, with one
/// conversion: lane 0 = dw·da, lane 1 = mw·sa (unsigned formats; 0 otherwise). Building the
/// vector from a GPR also avoids the false dependency a lone `vpinsrw` + `vcvtph2ps` puts on
/// whatever register holds the accumulators.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales(hw: u64, ha: u64) -> __m128 {
    let v = _mm_cvtph_ps(_mm_cvtsi64_si128((hw | ha << 32) as i64));
    _mm_mul_ps(v, _mm_movehl_ps(v, v))
}

/// The dot-product loops of the legacy formats, instantiated once per instruction-set level
/// (`$feat`): they differ only in `$int_dot`, the integer sum of a block's 32 u8 × i8
/// products in eight i32 lanes. Every level sums exactly (no saturation: |w| ≤ 128 and
/// |a| ≤ 127), so every level gives the same bits, and within a level the single, multi, rows
/// and tile forms agree bit for bit.
macro_rules! legacy_dots {
    ($feat:literal, $avail:path, $int_dot:path) => {
        #[allow(unused_imports)]
        use super::*;

        /// The integer dot product of one block, as 8 f32 partial sums. `ax` is `|qx|` for signed
        /// formats (unused otherwise).
        #[inline]
        #[target_feature(enable = $feat)]
        fn block_dot<B: Legacy>(qx: __m256i, ax: __m256i, qy: __m256i) -> __m256 {
            let sums = if B::SIGNED {
                $int_dot(ax, _mm256_sign_epi8(qy, qx))
            } else {
                $int_dot(qx, qy)
            };
            _mm256_cvtepi32_ps(sums)
        }

        /// The f16 header of a block as raw bits: the scale `d` (signed formats) or `d | m << 16`
        /// (Q4_1/Q5_1 weights; `d | s << 16` for Q8_1 activations).
        ///
        /// # Safety
        /// `p` points to 4 readable bytes (every block is longer).
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn header<const PAIR: bool>(p: *const u8) -> u64 {
            // SAFETY: 4 readable bytes at `p` (caller); `read_unaligned` has no alignment requirement.
            unsafe {
                if PAIR {
                    u64::from(u32::from_le(p.cast::<u32>().read_unaligned()))
                } else {
                    u64::from(u16::from_le(p.cast::<u16>().read_unaligned()))
                }
            }
        }

        /// Running sums of one activation row: two vector accumulators (even and odd blocks, for
        /// instruction-level parallelism) and, in lane 1 of `off`, the m·s terms of unsigned formats.
        #[derive(Clone, Copy)]
        struct Acc {
            v: [__m256; 2],
            off: __m128,
        }

        /// Adds block `i` of the weight row (`qx`, `ax`, header `hw`) times the block of the
        /// activation row at `arow` to `acc.v[PAR]`.
        ///
        /// # Safety
        /// `arow` points to at least `(i + 1) * B::ABLOCK` readable bytes.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn step<B: Legacy, const PAR: usize>(
            acc: &mut Acc,
            arow: *const u8,
            i: usize,
            qx: __m256i,
            ax: __m256i,
            hw: u64,
        ) {
            // SAFETY: block `i` lies inside the row (caller); offsets stay inside the block.
            let (qy, ha) = unsafe {
                let ba = arow.add(i * B::ABLOCK);
                (
                    _mm256_loadu_si256(ba.add(B::AQS).cast()),
                    if B::SIGNED {
                        header::<false>(ba)
                    } else {
                        header::<true>(ba)
                    },
                )
            };
            let q = block_dot::<B>(qx, ax, qy);
            let d = scales(hw, ha);
            acc.v[PAR] = _mm256_fmadd_ps(_mm256_broadcastss_ps(d), q, acc.v[PAR]);
            if !B::SIGNED {
                acc.off = _mm_add_ps(acc.off, d);
            }
        }

        /// Unpacks weight block `i`: quants, their absolute values (signed formats), header.
        ///
        /// # Safety
        /// `w` points to at least `(i + 1) * B::BLOCK` readable bytes.
        #[inline]
        #[target_feature(enable = $feat)]
        pub(in crate::avx2) unsafe fn weight_block<B: Legacy>(
            w: *const u8,
            i: usize,
        ) -> (__m256i, __m256i, u64) {
            // SAFETY: block `i` lies inside the row (caller).
            unsafe {
                let bw = w.add(i * B::BLOCK);
                let qx = B::unpack(bw);
                let ax = if B::SIGNED { _mm256_abs_epi8(qx) } else { qx };
                let hw = if B::SIGNED {
                    header::<false>(bw)
                } else {
                    header::<true>(bw)
                };
                (qx, ax, hw)
            }
        }

        /// Dots of one weight row (`nb` blocks at `w`) with `R` activation rows, the r-th at
        /// `a + r * stride`. Every row sees exactly the same sequence of operations whatever `R` is,
        /// so tiled and single results are bit-identical.
        ///
        /// # Safety
        /// `w` holds `nb` weight blocks; each activation row holds `nb` activation blocks; AVX2,
        /// FMA and F16C are available.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn dot_rows<B: Legacy, const R: usize>(
            nb: usize,
            w: *const u8,
            a: *const u8,
            stride: usize,
        ) -> [f32; R] {
            let zero = Acc {
                v: [_mm256_setzero_ps(); 2],
                off: _mm_setzero_ps(),
            };
            let mut acc = [zero; R];
            let mut rows = [a; R];
            for (r, row) in rows.iter_mut().enumerate() {
                *row = a.wrapping_add(r * stride);
            }
            let mut i = 0;
            while i + 1 < nb {
                // SAFETY: i + 1 < nb, so blocks i and i + 1 lie inside every row (caller).
                unsafe {
                    let (qx, ax, hw) = weight_block::<B>(w, i);
                    for (s, row) in acc.iter_mut().zip(rows) {
                        step::<B, 0>(s, row, i, qx, ax, hw);
                    }
                    let (qx, ax, hw) = weight_block::<B>(w, i + 1);
                    for (s, row) in acc.iter_mut().zip(rows) {
                        step::<B, 1>(s, row, i + 1, qx, ax, hw);
                    }
                }
                i += 2;
            }
            if i < nb {
                // SAFETY: i < nb (caller).
                unsafe {
                    let (qx, ax, hw) = weight_block::<B>(w, i);
                    for (s, row) in acc.iter_mut().zip(rows) {
                        step::<B, 0>(s, row, i, qx, ax, hw);
                    }
                }
            }
            let mut out = [0f32; R];
            for (o, s) in out.iter_mut().zip(&acc) {
                *o = hsum(_mm256_add_ps(s.v[0], s.v[1]));
                if !B::SIGNED {
                    *o += _mm_cvtss_f32(_mm_movehdup_ps(s.off));
                }
            }
            out
        }

        /// Dots of `R` weight rows (the r-th at `w + r * w_stride`) with one activation row at `a`.
        /// Each row sees the same operations as in `dot_rows`, so results are bit-identical.
        ///
        /// # Safety
        /// Every weight row holds `nb` blocks; the activation row holds `nb` activation blocks; AVX2,
        /// FMA and F16C are available.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn dot_wrows<B: Legacy, const R: usize>(
            nb: usize,
            w: *const u8,
            w_stride: usize,
            a: *const u8,
        ) -> [f32; R] {
            let zero = Acc {
                v: [_mm256_setzero_ps(); 2],
                off: _mm_setzero_ps(),
            };
            let mut acc = [zero; R];
            let mut rows = [w; R];
            for (r, row) in rows.iter_mut().enumerate() {
                *row = w.wrapping_add(r * w_stride);
            }
            let mut i = 0;
            while i + 1 < nb {
                // SAFETY: i + 1 < nb, so blocks i and i + 1 lie inside every row (caller).
                unsafe {
                    for (s, row) in acc.iter_mut().zip(rows) {
                        // A hint only: prefetching past the end of a row is harmless.
                        _mm_prefetch::<_MM_HINT_T0>(
                            row.wrapping_add(i * B::BLOCK + PREFETCH_BYTES).cast(),
                        );
                        let (qx, ax, hw) = weight_block::<B>(row, i);
                        step::<B, 0>(s, a, i, qx, ax, hw);
                    }
                    for (s, row) in acc.iter_mut().zip(rows) {
                        let (qx, ax, hw) = weight_block::<B>(row, i + 1);
                        step::<B, 1>(s, a, i + 1, qx, ax, hw);
                    }
                }
                i += 2;
            }
            if i < nb {
                // SAFETY: i < nb (caller).
                unsafe {
                    for (s, row) in acc.iter_mut().zip(rows) {
                        let (qx, ax, hw) = weight_block::<B>(row, i);
                        step::<B, 0>(s, a, i, qx, ax, hw);
                    }
                }
            }
            let mut out = [0f32; R];
            for (o, s) in out.iter_mut().zip(&acc) {
                *o = hsum(_mm256_add_ps(s.v[0], s.v[1]));
                if !B::SIGNED {
                    *o += _mm_cvtss_f32(_mm_movehdup_ps(s.off));
                }
            }
            out
        }

        /// Dots of `W` weight rows (`w_stride` apart) with `R` activation rows (`a_stride` apart):
        /// `[r][o]`. Every weight block is unpacked once for the `R` activation rows. Each pair sees
        /// the same operations as in `dot_rows`/`dot_wrows`, so results are bit-identical to them.
        ///
        /// # Safety
        /// As `dot_wrows` for every weight row and `dot_rows` for every activation row.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn dot_tile<B: Legacy, const W: usize, const R: usize>(
            nb: usize,
            w: *const u8,
            w_stride: usize,
            a: *const u8,
            a_stride: usize,
        ) -> [[f32; W]; R] {
            let zero = Acc {
                v: [_mm256_setzero_ps(); 2],
                off: _mm_setzero_ps(),
            };
            let mut acc = [[zero; W]; R];
            let mut wrows = [w; W];
            for (o, row) in wrows.iter_mut().enumerate() {
                *row = w.wrapping_add(o * w_stride);
            }
            let mut arows = [a; R];
            for (r, row) in arows.iter_mut().enumerate() {
                *row = a.wrapping_add(r * a_stride);
            }
            let mut i = 0;
            while i + 1 < nb {
                // SAFETY: i + 1 < nb, so blocks i and i + 1 lie inside every row (caller).
                unsafe {
                    for (o, wrow) in wrows.iter().enumerate() {
                        // A hint only: prefetching past the end of a row is harmless.
                        _mm_prefetch::<_MM_HINT_T0>(
                            wrow.wrapping_add(i * B::BLOCK + PREFETCH_BYTES).cast(),
                        );
                        let (qx, ax, hw) = weight_block::<B>(*wrow, i);
                        for (r, arow) in arows.iter().enumerate() {
                            step::<B, 0>(&mut acc[r][o], *arow, i, qx, ax, hw);
                        }
                    }
                    for (o, wrow) in wrows.iter().enumerate() {
                        let (qx, ax, hw) = weight_block::<B>(*wrow, i + 1);
                        for (r, arow) in arows.iter().enumerate() {
                            step::<B, 1>(&mut acc[r][o], *arow, i + 1, qx, ax, hw);
                        }
                    }
                }
                i += 2;
            }
            if i < nb {
                // SAFETY: i < nb (caller).
                unsafe {
                    for (o, wrow) in wrows.iter().enumerate() {
                        let (qx, ax, hw) = weight_block::<B>(*wrow, i);
                        for (r, arow) in arows.iter().enumerate() {
                            step::<B, 0>(&mut acc[r][o], *arow, i, qx, ax, hw);
                        }
                    }
                }
            }
            let mut out = [[0f32; W]; R];
            for (orow, arow) in out.iter_mut().zip(&acc) {
                for (o, s) in orow.iter_mut().zip(arow) {
                    *o = hsum(_mm256_add_ps(s.v[0], s.v[1]));
                    if !B::SIGNED {
                        *o += _mm_cvtss_f32(_mm_movehdup_ps(s.off));
                    }
                }
            }
            out
        }

        /// Safe entry: `n_w` weight rows against `n_a` activation rows, in 2 × 2 tiles (then the
        /// single-row kernels for what is left).
        #[allow(clippy::too_many_arguments)]
        pub(in crate::avx2) fn vec_dot_tile<B: Legacy>(
            n: usize,
            w: &[u8],
            w_stride: usize,
            n_w: usize,
            a: &[u8],
            a_stride: usize,
            n_a: usize,
            out: &mut [f32],
            out_stride: usize,
        ) {
            if n_w == 0 || n_a == 0 {
                return;
            }
            // Bounds, checked once: the last weight and activation rows hold `nb` blocks.
            let (Some(w_last), Some(a_last)) = (
                last_row("vec_dot_tile: weight", n_w, w_stride, w.len()),
                last_row("vec_dot_tile: activation", n_a, a_stride, a.len()),
            ) else {
                return;
            };
            let nb = check_dot(n, QK, &w[w_last..], B::BLOCK, &a[a_last..], B::ABLOCK);
            assert!(
                w_stride >= nb * B::BLOCK && (n_a == 1 || a_stride >= nb * B::ABLOCK),
                "vec_dot_tile: a stride is shorter than a row"
            );
            assert!(
                out.len() >= (n_a - 1) * out_stride + n_w,
                "vec_dot_tile: output too small"
            );
            debug_assert!($avail());
            let (wp, ap) = (w.as_ptr(), a.as_ptr());
            let mut r = 0;
            while r < n_a {
                let mut o = 0;
                if r + 2 <= n_a {
                    while o + 2 <= n_w {
                        // SAFETY: rows r, r+1 and o, o+1 exist and hold `nb` blocks (checked above);
                        // the CPU has the features (installed only after detection).
                        let v = unsafe {
                            dot_tile::<B, 2, 2>(
                                nb,
                                wp.add(o * w_stride),
                                w_stride,
                                ap.add(r * a_stride),
                                a_stride,
                            )
                        };
                        out[r * out_stride + o..r * out_stride + o + 2].copy_from_slice(&v[0]);
                        out[(r + 1) * out_stride + o..(r + 1) * out_stride + o + 2]
                            .copy_from_slice(&v[1]);
                        o += 2;
                    }
                    if o < n_w {
                        // SAFETY: as above, one weight row.
                        let v = unsafe {
                            dot_tile::<B, 1, 2>(
                                nb,
                                wp.add(o * w_stride),
                                w_stride,
                                ap.add(r * a_stride),
                                a_stride,
                            )
                        };
                        out[r * out_stride + o] = v[0][0];
                        out[(r + 1) * out_stride + o] = v[1][0];
                    }
                    r += 2;
                } else {
                    // SAFETY: as above, one activation row.
                    unsafe {
                        dot_wmulti::<B>(
                            nb,
                            wp,
                            w_stride,
                            ap.add(r * a_stride),
                            &mut out[r * out_stride..r * out_stride + n_w],
                        )
                    };
                    r += 1;
                }
            }
        }

        /// `out.len()` weight rows against one activation row: groups of 4, then 2, then 1.
        ///
        /// # Safety
        /// As `dot_wrows`, for `out.len()` weight rows.
        #[target_feature(enable = $feat)]
        unsafe fn dot_wmulti<B: Legacy>(
            nb: usize,
            w: *const u8,
            w_stride: usize,
            a: *const u8,
            out: &mut [f32],
        ) {
            let mut r = 0;
            while r + 4 <= out.len() {
                // SAFETY: weight rows r..r+4 exist (caller).
                let v = unsafe { dot_wrows::<B, 4>(nb, w.add(r * w_stride), w_stride, a) };
                out[r..r + 4].copy_from_slice(&v);
                r += 4;
            }
            if r + 2 <= out.len() {
                // SAFETY: weight rows r..r+2 exist (caller).
                let v = unsafe { dot_wrows::<B, 2>(nb, w.add(r * w_stride), w_stride, a) };
                out[r..r + 2].copy_from_slice(&v);
                r += 2;
            }
            if r < out.len() {
                // SAFETY: weight row r exists (caller).
                let [v] = unsafe { dot_wrows::<B, 1>(nb, w.add(r * w_stride), w_stride, a) };
                out[r] = v;
            }
        }

        /// Safe entry: `out.len()` weight rows `w_stride` bytes apart against one activation row.
        pub(in crate::avx2) fn vec_dot_rows<B: Legacy>(
            n: usize,
            w: &[u8],
            w_stride: usize,
            a: &[u8],
            out: &mut [f32],
        ) {
            let Some(start) = last_row("vec_dot_rows", out.len(), w_stride, w.len()) else {
                return;
            };
            let nb = check_dot(n, QK, &w[start..], B::BLOCK, a, B::ABLOCK);
            assert!(
                w_stride >= nb * B::BLOCK,
                "vec_dot_rows: stride {w_stride} shorter than a row"
            );
            debug_assert!($avail());
            // SAFETY: the last weight row (and so every earlier one) holds `nb` blocks and the
            // activation row `nb` activation blocks (checked above); the CPU has the features (this
            // function is only installed after detection).
            unsafe { dot_wmulti::<B>(nb, w.as_ptr(), w_stride, a.as_ptr(), out) }
        }

        /// One weight row against `out.len()` activation rows: groups of 4 in registers, then 2, 1.
        ///
        /// # Safety
        /// As `dot_rows`, for `out.len()` rows.
        #[target_feature(enable = $feat)]
        unsafe fn dot_multi<B: Legacy>(
            nb: usize,
            w: *const u8,
            a: *const u8,
            stride: usize,
            out: &mut [f32],
        ) {
            let mut r = 0;
            while r + 4 <= out.len() {
                // SAFETY: rows r..r+4 exist (caller).
                let v = unsafe { dot_rows::<B, 4>(nb, w, a.add(r * stride), stride) };
                out[r..r + 4].copy_from_slice(&v);
                r += 4;
            }
            if r + 2 <= out.len() {
                // SAFETY: rows r..r+2 exist (caller).
                let v = unsafe { dot_rows::<B, 2>(nb, w, a.add(r * stride), stride) };
                out[r..r + 2].copy_from_slice(&v);
                r += 2;
            }
            if r < out.len() {
                // SAFETY: row r exists (caller).
                let [v] = unsafe { dot_rows::<B, 1>(nb, w, a.add(r * stride), stride) };
                out[r] = v;
            }
        }

        /// Single-row dot (`R` = 1 of `dot_rows`, not inlined into callers).
        ///
        /// # Safety
        /// As `dot_rows`.
        #[target_feature(enable = $feat)]
        unsafe fn dot_one<B: Legacy>(nb: usize, w: *const u8, a: *const u8) -> f32 {
            // SAFETY: forwarded from the caller.
            let [v] = unsafe { dot_rows::<B, 1>(nb, w, a, 0) };
            v
        }

        /// Safe entry points for a format, installed by `specialize` only once `available()` holds.
        pub(in crate::avx2) fn vec_dot<B: Legacy>(n: usize, w: &[u8], a: &[u8]) -> f32 {
            let nb = check_dot(n, QK, w, B::BLOCK, a, B::ABLOCK);
            debug_assert!($avail());
            // SAFETY: `check_dot` proved both rows hold `nb` blocks; the CPU has the features
            // (this function is only installed after detection).
            unsafe { dot_one::<B>(nb, w.as_ptr(), a.as_ptr()) }
        }

        pub(in crate::avx2) fn vec_dot_multi<B: Legacy>(
            n: usize,
            w: &[u8],
            a: &[u8],
            stride: usize,
            out: &mut [f32],
        ) {
            let Some(start) = last_row("vec_dot_multi", out.len(), stride, a.len()) else {
                return;
            };
            let nb = check_dot(n, QK, w, B::BLOCK, &a[start..], B::ABLOCK);
            debug_assert!($avail());
            // SAFETY: the last (furthest) activation row and the weight row hold `nb` blocks, hence
            // every row does; the CPU has the features (installed only after detection).
            unsafe { dot_multi::<B>(nb, w.as_ptr(), a.as_ptr(), stride, out) }
        }
    };
}

/// `maddubs` then `madd` by ones: AVX2's u8 × i8 dot, four products to an i32 lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_u8i8_avx2(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// AVX-VNNI's `vpdpbusd` (VEX): the same sums in one instruction.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
fn dot_u8i8_avxvnni(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s)
}

/// AVX-512 VNNI's `vpdpbusd` on 256-bit registers (EVEX; Zen 4 has it without AVX-VNNI).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
fn dot_u8i8_avx512vnni(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
}

/// The AVX2 loops (and the names the rest of the crate uses).
pub(super) mod plain {
    legacy_dots!(
        "avx2,fma,f16c",
        crate::avx2::available,
        super::dot_u8i8_avx2
    );
}
use plain::weight_block;
pub(super) use plain::{vec_dot, vec_dot_multi, vec_dot_rows, vec_dot_tile};

/// The loops with AVX-VNNI.
pub(super) mod avxvnni {
    legacy_dots!(
        "avx2,fma,f16c,avxvnni",
        crate::avx2::available_avxvnni,
        super::dot_u8i8_avxvnni
    );
}

/// The loops with AVX-512 VNNI on 256-bit registers.
pub(super) mod avx512vnni {
    legacy_dots!(
        "avx2,fma,f16c,avx512vnni,avx512vl",
        crate::avx2::available_avx512vnni,
        super::dot_u8i8_avx512vnni
    );
}

/// Decodes `nb` blocks: x = d·q (signed formats) or d·q + m (a multiply then an add, not an
/// FMA, so results equal the scalar reference bit for bit).
///
/// # Safety
/// `src` holds `nb` blocks, `dst` has room for `nb * 32` floats; AVX2, FMA, F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_blocks<B: Legacy>(nb: usize, src: *const u8, dst: *mut f32) {
    for i in 0..nb {
        // SAFETY: block i is inside `src` and its 32 outputs inside `dst` (caller).
        unsafe {
            let (qx, _, hw) = weight_block::<B>(src, i);
            // Lanes 0 and 1: d and m (m = 0 for signed formats).
            let dm = _mm_cvtph_ps(_mm_cvtsi64_si128(hw as i64));
            let (vd, vm) = (
                _mm256_broadcastss_ps(dm),
                _mm256_broadcastss_ps(_mm_movehdup_ps(dm)),
            );
            let lo = _mm256_castsi256_si128(qx);
            let hi = _mm256_extracti128_si256::<1>(qx);
            let parts = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
            let y = dst.add(i * QK);
            for (k, p) in parts.into_iter().enumerate() {
                let f = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(p)));
                let f = if B::SIGNED { f } else { _mm256_add_ps(f, vm) };
                _mm256_storeu_ps(y.add(8 * k), f);
            }
        }
    }
}

pub(super) fn dequantize<B: Legacy>(src: &[u8], dst: &mut [f32]) {
    let nb = check_blocks(src.len(), dst.len(), QK, B::BLOCK);
    debug_assert!(super::available());
    // SAFETY: `check_blocks` proved `src` holds `nb` blocks and `dst` has `nb * 32` floats;
    // the CPU has the features (installed only after detection).
    unsafe { dequantize_blocks::<B>(nb, src.as_ptr(), dst.as_mut_ptr()) }
}

/// Q8_0 weights.
pub(super) struct Q8_0;

impl Legacy for Q8_0 {
    const BLOCK: usize = q8_0::BLOCK;
    const ABLOCK: usize = q8_0::BLOCK;
    const AQS: usize = 2;
    const SIGNED: bool = true;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> __m256i {
        // SAFETY: the block's 32 quants follow its 2-byte scale (caller: BLOCK bytes).
        unsafe { _mm256_loadu_si256(p.add(2).cast()) }
    }
}

/// Q8_1 as weights (Q8_1 · Q8_1; its sum field is not needed).
pub(super) struct Q8_1;

impl Legacy for Q8_1 {
    const BLOCK: usize = q8_1::BLOCK;
    const ABLOCK: usize = q8_1::BLOCK;
    const AQS: usize = 4;
    const SIGNED: bool = true;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> __m256i {
        // SAFETY: the block's 32 quants follow its scale and sum (caller: BLOCK bytes).
        unsafe { _mm256_loadu_si256(p.add(4).cast()) }
    }
}

/// Round half away from zero (`f32::round`, C's `roundf`), exactly, sign of zero included:
/// on |v|, `|v| − trunc(|v|)` is exact, and the result moves up by one when that fraction is
/// ≥ ½; then v's sign is put back.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn round_away(v: __m256) -> __m256 {
    let sign = _mm256_set1_ps(-0.0);
    let av = _mm256_andnot_ps(sign, v);
    let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(av);
    let up = _mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_sub_ps(av, t), _mm256_set1_ps(0.5));
    let r = _mm256_add_ps(t, _mm256_and_ps(up, _mm256_set1_ps(1.0)));
    _mm256_or_ps(r, _mm256_and_ps(v, sign))
}

/// Quantizes `nb` blocks to Q8_0 (`SUM` = false: 34-byte blocks) or Q8_1 (`SUM` = true:
/// 36-byte blocks with s = d·Σq), with the reference's arithmetic: d = amax / 127,
/// id = 1 / d, q = round_away(x · id).
///
/// # Safety
/// `src` holds `nb * 32` floats, `dst` has room for `nb` blocks; AVX2, FMA, F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_blocks<const SUM: bool>(nb: usize, src: *const f32, dst: *mut u8) {
    let (block, qs) = if SUM {
        (q8_1::BLOCK, 4)
    } else {
        (q8_0::BLOCK, 2)
    };
    let sign = _mm256_set1_ps(-0.0);
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for i in 0..nb {
        // SAFETY: the 32 inputs of block i are inside `src` (caller).
        let x = unsafe {
            let p = src.add(i * QK);
            [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ]
        };
        let m = _mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign, x[0]), _mm256_andnot_ps(sign, x[1])),
            _mm256_max_ps(_mm256_andnot_ps(sign, x[2]), _mm256_andnot_ps(sign, x[3])),
        );
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let vid = _mm256_set1_ps(id);
        let mut q = [_mm256_setzero_si256(); 4];
        for (qk, xk) in q.iter_mut().zip(x) {
            *qk = _mm256_cvtps_epi32(round_away(_mm256_mul_ps(xk, vid)));
        }
        let packed = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let packed = _mm256_permutevar8x32_epi32(packed, order);
        let b = dst.wrapping_add(i * block);
        // SAFETY: block i (`block` bytes) is inside `dst` (caller); `qs + 32 <= block`.
        unsafe { _mm256_storeu_si256(b.add(qs).cast(), packed) };
        // SAFETY: the scale occupies bytes 0..2 of block i.
        unsafe { b.cast::<u16>().write_unaligned(to_f16_bits(d).to_le()) };
        if SUM {
            let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
            let sum = _mm_cvtsi128_si32(s);
            // SAFETY: the sum occupies bytes 2..4 of a Q8_1 block.
            unsafe {
                b.add(2)
                    .cast::<u16>()
                    .write_unaligned(to_f16_bits(sum as f32 * d).to_le())
            };
        }
    }
}

fn quantize_rows<const SUM: bool>(src: &[f32], dst: &mut [u8]) {
    let block = if SUM { q8_1::BLOCK } else { q8_0::BLOCK };
    let nb = check_blocks(dst.len(), src.len(), QK, block);
    debug_assert!(super::available());
    // SAFETY: `check_blocks` proved `dst` holds `nb` blocks for the `nb * 32` floats of
    // `src`; the CPU has the features (installed only after detection).
    unsafe { quantize_blocks::<SUM>(nb, src.as_ptr(), dst.as_mut_ptr()) }
}

/// Q8_0 quantization, byte-identical to `quants::q8_0::quantize`.
pub(super) fn quantize_q8_0(src: &[f32], dst: &mut [u8]) {
    quantize_rows::<false>(src, dst);
}

/// Q8_1 quantization, byte-identical to `quants::q8_1::quantize`.
pub(super) fn quantize_q8_1(src: &[f32], dst: &mut [u8]) {
    quantize_rows::<true>(src, dst);
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    fn inputs() -> Vec<Vec<f32>> {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let mut v = vec![
            vec![0.0; 64],
            // amax 127 gives d = 1 and id = 1: exact ties at ±k.5 must round away from zero.
            (0..64)
                .map(|j| {
                    if j == 0 {
                        127.0
                    } else {
                        (j as f32 - 32.0) + 0.5
                    }
                })
                .collect(),
            (0..64).map(|j| -((j % 7) as f32) * 1e-30).collect(),
            (0..64)
                .map(|j| if j % 2 == 0 { 3.0 } else { -3.0 })
                .collect(),
        ];
        // 1e7: d overflows f16 to infinity; 1e-6: d is an f16 subnormal.
        for scale in [1e-6f32, 1e-3, 1.0, 1e4, 1e7] {
            for _ in 0..20 {
                v.push((0..256).map(|_| next() * scale).collect());
            }
        }
        v
    }

    #[test]
    fn quantize_matches_reference_bytes() {
        if !super::super::available() {
            return;
        }
        for x in inputs() {
            let mut want = vec![0u8; x.len() / QK * q8_0::BLOCK];
            let mut got = vec![0u8; want.len()];
            q8_0::quantize(&x, &mut want);
            quantize_q8_0(&x, &mut got);
            assert_eq!(got, want, "Q8_0 {:?}", &x[..4]);
            let mut want = vec![0u8; x.len() / QK * q8_1::BLOCK];
            let mut got = vec![0u8; want.len()];
            q8_1::quantize(&x, &mut want);
            quantize_q8_1(&x, &mut got);
            assert_eq!(got, want, "Q8_1 {:?}", &x[..4]);
        }
    }

    #[test]
    fn round_away_matches_f32_round() {
        if !super::super::available() {
            return;
        }
        let xs = [
            0.5f32,
            -0.5,
            1.5,
            -1.5,
            2.5,
            -2.5,
            0.49999997,
            -0.49999997,
            126.5,
            -126.5,
            0.0,
            -0.0,
            3.4999998,
            8388607.5,
            1e-40,
        ];
        for x in xs {
            // SAFETY: AVX2 was detected above.
            let got = unsafe { round_one(x) };
            assert_eq!(got.to_bits(), x.round().to_bits(), "{x}");
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn round_one(x: f32) -> f32 {
        _mm256_cvtss_f32(round_away(_mm256_set1_ps(x)))
    }

    /// Every legacy kernel at short and odd block counts (the conformance rows are 64 blocks):
    /// dequantize bit-exact, dot within 1e-5 of the reference, tiles bit-identical to singles.
    fn check_format<B: Legacy>(ty: crate::GgmlType) {
        let r = crate::reference(ty);
        let at = r.vec_dot_type;
        let mut seed = 99u32;
        let mut next = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
        };
        for nb in 1..=5 {
            let n = nb * QK;
            let x: Vec<f32> = (0..n).map(|_| next()).collect();
            let mut w = vec![0u8; nb * B::BLOCK];
            (r.quantize)(&x, &mut w);
            let (mut want, mut got) = (vec![0f32; n], vec![1f32; n]);
            (r.dequantize)(&w, &mut want);
            dequantize::<B>(&w, &mut got);
            assert_eq!(got, want, "{ty} dequantize, {nb} blocks");
            let stride = nb * B::ABLOCK + 3;
            let rows = 7;
            let mut a = vec![0u8; rows * stride];
            for row in 0..rows {
                let y: Vec<f32> = (0..n).map(|_| next()).collect();
                (crate::reference(at).quantize)(
                    &y,
                    &mut a[row * stride..row * stride + nb * B::ABLOCK],
                );
            }
            for row in 0..rows {
                let ar = &a[row * stride..];
                let want = (r.vec_dot)(n, &w, ar);
                let got = vec_dot::<B>(n, &w, ar);
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{ty}: {got} vs {want}"
                );
            }
            for m in 1..=rows {
                let mut out = vec![0f32; m];
                vec_dot_multi::<B>(n, &w, &a, stride, &mut out);
                for (row, o) in out.iter().enumerate() {
                    let single = vec_dot::<B>(n, &w, &a[row * stride..]);
                    assert_eq!(o.to_bits(), single.to_bits(), "{ty}: row {row} of {m}");
                }
            }
        }
    }

    /// Weights of `ty` (`nb` blocks per row, `n_w` rows) and activations (`n_a` rows) from
    /// the reference quantizers, rows `stride` bytes apart.
    pub(in crate::avx2) fn operands(
        ty: crate::GgmlType,
        nb: usize,
        n_w: usize,
        n_a: usize,
    ) -> (Vec<u8>, usize, Vec<u8>, usize) {
        let r = crate::reference(ty);
        let at = r.vec_dot_type;
        let mut seed = 7u32;
        let mut next = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
        };
        let n = nb * QK;
        let (wb, ab) = (ty.row_bytes(n).unwrap(), at.row_bytes(n).unwrap());
        let (ws, as_) = (wb + 5, ab + 3);
        let mut w = vec![0u8; n_w * ws];
        for o in 0..n_w {
            let x: Vec<f32> = (0..n).map(|_| next()).collect();
            (r.quantize)(&x, &mut w[o * ws..o * ws + wb]);
        }
        let mut a = vec![0u8; n_a * as_];
        for row in 0..n_a {
            let y: Vec<f32> = (0..n).map(|_| next()).collect();
            (crate::reference(at).quantize)(&y, &mut a[row * as_..row * as_ + ab]);
        }
        (w, ws, a, as_)
    }

    /// Every form (single, multi, rows, tile) at a VNNI level gives the AVX2 level's bits.
    fn vnni_equals_avx2<B: Legacy>(ty: crate::GgmlType) {
        type Forms = (
            fn(usize, &[u8], &[u8]) -> f32,
            fn(usize, &[u8], &[u8], usize, &mut [f32]),
            fn(usize, &[u8], usize, &[u8], &mut [f32]),
            crate::dispatch::VecDotTileFn,
        );
        let mut levels: Vec<(&str, Forms)> = Vec::new();
        if super::super::available_avxvnni() {
            levels.push((
                "avxvnni",
                (
                    avxvnni::vec_dot::<B>,
                    avxvnni::vec_dot_multi::<B>,
                    avxvnni::vec_dot_rows::<B>,
                    avxvnni::vec_dot_tile::<B>,
                ),
            ));
        }
        if super::super::available_avx512vnni() {
            levels.push((
                "avx512vnni",
                (
                    avx512vnni::vec_dot::<B>,
                    avx512vnni::vec_dot_multi::<B>,
                    avx512vnni::vec_dot_rows::<B>,
                    avx512vnni::vec_dot_tile::<B>,
                ),
            ));
        }
        for nb in [1usize, 3, 8] {
            let n = nb * QK;
            let (n_w, n_a) = (7, 5);
            let (w, ws, a, as_) = operands(ty, nb, n_w, n_a);
            let mut want_tile = vec![0f32; n_a * n_w];
            vec_dot_tile::<B>(n, &w, ws, n_w, &a, as_, n_a, &mut want_tile, n_w);
            let mut want_rows = vec![0f32; n_w];
            vec_dot_rows::<B>(n, &w, ws, &a, &mut want_rows);
            let mut want_multi = vec![0f32; n_a];
            vec_dot_multi::<B>(n, &w, &a, as_, &mut want_multi);
            let want_one = vec_dot::<B>(n, &w, &a);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for (name, (one, multi, rows, tile)) in &levels {
                assert_eq!(
                    one(n, &w, &a).to_bits(),
                    want_one.to_bits(),
                    "{ty} {name} single"
                );
                let mut got = vec![0f32; n_a];
                multi(n, &w, &a, as_, &mut got);
                assert_eq!(
                    bits(&got),
                    bits(&want_multi),
                    "{ty} {name} multi, {nb} blocks"
                );
                let mut got = vec![0f32; n_w];
                rows(n, &w, ws, &a, &mut got);
                assert_eq!(
                    bits(&got),
                    bits(&want_rows),
                    "{ty} {name} rows, {nb} blocks"
                );
                let mut got = vec![0f32; n_a * n_w];
                tile(n, &w, ws, n_w, &a, as_, n_a, &mut got, n_w);
                assert_eq!(
                    bits(&got),
                    bits(&want_tile),
                    "{ty} {name} tile, {nb} blocks"
                );
            }
        }
    }

    #[test]
    fn vnni_levels_give_the_avx2_bits() {
        if !super::super::available() {
            return;
        }
        use super::super::{q4_0::Q4_0, q4_1::Q4_1, q5_0::Q5_0, q5_1::Q5_1};
        use crate::GgmlType as T;
        vnni_equals_avx2::<Q4_0>(T::Q4_0);
        vnni_equals_avx2::<Q4_1>(T::Q4_1);
        vnni_equals_avx2::<Q5_0>(T::Q5_0);
        vnni_equals_avx2::<Q5_1>(T::Q5_1);
        vnni_equals_avx2::<Q8_0>(T::Q8_0);
        vnni_equals_avx2::<Q8_1>(T::Q8_1);
        vnni_equals_avx2::<super::super::iq4_nl::Iq4Nl>(T::IQ4_NL);
    }

    #[test]
    fn legacy_formats_at_odd_block_counts() {
        if !super::super::available() {
            return;
        }
        use super::super::{q4_0::Q4_0, q4_1::Q4_1, q5_0::Q5_0, q5_1::Q5_1};
        use crate::GgmlType as T;
        check_format::<Q4_0>(T::Q4_0);
        check_format::<Q4_1>(T::Q4_1);
        check_format::<Q5_0>(T::Q5_0);
        check_format::<Q5_1>(T::Q5_1);
        check_format::<Q8_0>(T::Q8_0);
        check_format::<Q8_1>(T::Q8_1);
        check_format::<super::super::iq4_nl::Iq4Nl>(T::IQ4_NL);
    }

    #[test]
    #[should_panic(expected = "too short")]
    fn short_activation_rows_panic() {
        if !super::super::available() {
            panic!("too short (no AVX2 here)");
        }
        let w = [0u8; 2 * q8_0::BLOCK];
        let a = [0u8; 2 * q8_0::BLOCK];
        let mut out = [0f32; 2];
        // The second row would start at byte 40 and need 68 bytes.
        vec_dot_multi::<Q8_0>(64, &w, &a, 40, &mut out);
    }

    #[test]
    fn q8_1_self_dot_matches_reference() {
        if !super::super::available() {
            return;
        }
        let x: Vec<f32> = (0..96)
            .map(|j| ((j * 37 % 23) as f32 - 11.0) * 0.25)
            .collect();
        let mut q = vec![0u8; 3 * q8_1::BLOCK];
        q8_1::quantize(&x, &mut q);
        let want = q8_1::vec_dot(96, &q, &q);
        let got = vec_dot::<Q8_1>(96, &q, &q);
        assert!((got - want).abs() <= 1e-5 * want.abs(), "{got} vs {want}");
    }
}
