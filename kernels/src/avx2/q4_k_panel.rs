//! Q4_K decode over repacked panels (`crate::repack`, `KPANEL` = 16 rows): one row in each
//! 32-bit lane. A 64-byte run of a group holds four nibble bytes of each of the 16 rows, so
//! one `vpdpbusd` multiplies four weights of every row by the same four activations (one
//! broadcast). The sub-block sums are exact integers, scaled per lane by that row's 6-bit
//! scale; the scales and mins of all 16 rows are unpacked together from the transposed
//! scale bytes, the 16 `d`s and `dmin`s converted with one instruction each. The float
//! steps per block are the reference's, lane by lane: every row gets `vec_dot`'s bits.
//!
//! The 512-bit form holds the panel in one register; the 256-bit forms (AVX2, AVX-VNNI,
//! AVX-512 VNNI on 256 bits) take it in two halves of 8 rows.

use crate::quants::q8_k::{self as q8, QS};
use crate::repack::kpanel::{D, DMIN, GROUP, QS as PQS, SCALES};
use crate::repack::KPANEL;
use std::arch::x86_64::*;

const AB: usize = q8::BLOCK_BYTES;

use crate::repack::kpanel::check_shapes as check;

/// The 6-bit scales and mins of block `j` (0..8) of 16 rows, as u8 lanes, from the 12
/// transposed scale bytes `s` (ggml's `get_scale_min_k4`, 16 rows at a time).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales_mins(s: &[__m128i; 12]) -> ([__m128i; 8], [__m128i; 8]) {
    let low6 = _mm_set1_epi8(63);
    let low4 = _mm_set1_epi8(0x0f);
    let top2 = _mm_set1_epi8(0xc0u8 as i8);
    // Bits 6-7 of a byte moved to bits 4-5 (masked first, so no bit crosses a byte).
    let top = |v: __m128i| _mm_srli_epi16::<2>(_mm_and_si128(v, top2));
    let mut sc = [_mm_setzero_si128(); 8];
    let mut m = [_mm_setzero_si128(); 8];
    for j in 0..4 {
        sc[j] = _mm_and_si128(s[j], low6);
        m[j] = _mm_and_si128(s[j + 4], low6);
        sc[j + 4] = _mm_or_si128(_mm_and_si128(s[j + 8], low4), top(s[j]));
        m[j + 4] = _mm_or_si128(
            _mm_and_si128(_mm_srli_epi16::<4>(s[j + 8]), low4),
            top(s[j + 4]),
        );
    }
    (sc, m)
}

/// 16 bytes of `b` from `at`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld128(b: &[u8], at: usize) -> __m128i {
    let s = &b[at..at + 16];
    // SAFETY: `s` holds the 16 bytes read.
    unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
}

/// 32 bytes of `b` from `at`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld256(b: &[u8], at: usize) -> __m256i {
    let s = &b[at..at + 32];
    // SAFETY: `s` holds the 32 bytes read.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// 64 bytes of `b` from `at`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
fn ld512(b: &[u8], at: usize) -> __m512i {
    let s = &b[at..at + 64];
    // SAFETY: `s` holds the 64 bytes read.
    unsafe { _mm512_loadu_si512(s.as_ptr().cast()) }
}

/// The four activation bytes at `at` of a Q8_K block, as one i32 (for a broadcast).
#[inline]
fn act4(ab: &[u8; AB], at: usize) -> i32 {
    i32::from_le_bytes([ab[at], ab[at + 1], ab[at + 2], ab[at + 3]])
}

/// The eight sub-block sums of a Q8_K block's `bsums` (pairs of 16-sums).
#[inline]
fn sub_sums(ab: &[u8; AB]) -> [i32; 8] {
    std::array::from_fn(|j| q8::bsum_of(ab, 2 * j) + q8::bsum_of(ab, 2 * j + 1))
}

pub(super) fn dot_panels512(n: usize, w: &[u8], a: &[u8], out: &mut [f32]) {
    let nb = check(n, w, a, out);
    debug_assert!(super::gemm512::available() && super::available_avx512vnni());
    let a = q8::blocks::<AB>(a, nb);
    for (p, o) in out.chunks_exact_mut(KPANEL).enumerate() {
        let panel = &w[p * nb * GROUP..(p + 1) * nb * GROUP];
        // SAFETY: installed by `specialize_avx512` only where AVX-512 F/BW/VL/VNNI exist.
        let v = unsafe { panel512(panel, a) };
        o.copy_from_slice(&v);
    }
}

/// One panel (`a.len()` groups in `panel`) against the activation row.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn panel512(panel: &[u8], a: &[[u8; AB]]) -> [f32; KPANEL] {
    assert!(panel.len() >= a.len() * GROUP);
    let low4 = _mm512_set1_epi8(0x0f);
    let high4 = _mm512_set1_epi8(0xf0u8 as i8);
    let mut sum = _mm512_setzero_ps();
    for (i, ab) in a.iter().enumerate() {
        let g = &panel[i * GROUP..(i + 1) * GROUP];
        let d = _mm512_cvtph_ps(ld256(g, D));
        let dmin = _mm512_cvtph_ps(ld256(g, DMIN));
        let s: [__m128i; 12] = std::array::from_fn(|k| ld128(g, SCALES + KPANEL * k));
        let (sc, m) = scales_mins(&s);
        let mut si = _mm512_setzero_si512();
        for q in 0..4 {
            let (mut lo, mut hi) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            for c in 0..8 {
                let run = ld512(g, PQS + 64 * (8 * q + c));
                let al = _mm512_set1_epi32(act4(ab, QS + 64 * q + 4 * c));
                let ah = _mm512_set1_epi32(act4(ab, QS + 64 * q + 32 + 4 * c));
                lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(run, low4), al);
                // The high nibbles in place (16 × the code): exact in i32, divided out below.
                hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(run, high4), ah);
            }
            let hi = _mm512_srai_epi32::<4>(hi);
            si = _mm512_add_epi32(si, _mm512_mullo_epi32(lo, _mm512_cvtepu8_epi32(sc[2 * q])));
            si = _mm512_add_epi32(
                si,
                _mm512_mullo_epi32(hi, _mm512_cvtepu8_epi32(sc[2 * q + 1])),
            );
        }
        let bs = sub_sums(ab);
        let mut sm = _mm512_setzero_si512();
        for j in 0..8 {
            sm = _mm512_add_epi32(
                sm,
                _mm512_mullo_epi32(_mm512_cvtepu8_epi32(m[j]), _mm512_set1_epi32(bs[j])),
            );
        }
        let ad = _mm512_set1_ps(q8::d_of(ab));
        let t = _mm512_sub_ps(
            _mm512_mul_ps(_mm512_mul_ps(ad, d), _mm512_cvtepi32_ps(si)),
            _mm512_mul_ps(_mm512_mul_ps(ad, dmin), _mm512_cvtepi32_ps(sm)),
        );
        sum = _mm512_add_ps(sum, t);
    }
    let mut out = [0f32; KPANEL];
    // SAFETY: `out` holds 16 f32.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), sum) };
    out
}

macro_rules! panel256 {
    ($feat:literal, $vnni:expr) => {
        use super::*;

        pub(in crate::avx2) fn dot_panels(n: usize, w: &[u8], a: &[u8], out: &mut [f32]) {
            let nb = check(n, w, a, out);
            let a = q8::blocks::<AB>(a, nb);
            for (p, o) in out.chunks_exact_mut(KPANEL).enumerate() {
                let panel = &w[p * nb * GROUP..(p + 1) * nb * GROUP];
                // SAFETY: installed by `specialize*` only where the features exist.
                let v = unsafe { panel256(panel, a) };
                o.copy_from_slice(&v);
            }
        }

        /// One panel against the activation row: each block's two halves of 8 rows in
        /// turn, so the panel is read once, in order.
        #[target_feature(enable = $feat)]
        unsafe fn panel256(panel: &[u8], a: &[[u8; AB]]) -> [f32; KPANEL] {
            assert!(panel.len() >= a.len() * GROUP);
            let low4 = _mm256_set1_epi8(0x0f);
            let mut sums = [_mm256_setzero_ps(); 2];
            for (i, ab) in a.iter().enumerate() {
                let g = &panel[i * GROUP..(i + 1) * GROUP];
                for (half, sum) in sums.iter_mut().enumerate() {
                    let h = 8 * half;
                    let d = _mm256_cvtph_ps(ld128(g, D + 2 * h));
                    let dmin = _mm256_cvtph_ps(ld128(g, DMIN + 2 * h));
                    let s: [__m128i; 12] = std::array::from_fn(|k| ld128(g, SCALES + KPANEL * k));
                    let (sc, m) = scales_mins(&s);
                    // This half's 8 bytes of a 16-row vector, widened to i32 lanes.
                    let wide = |v: __m128i| {
                        _mm256_cvtepu8_epi32(if half == 0 { v } else { _mm_srli_si128::<8>(v) })
                    };
                    let mut si = _mm256_setzero_si256();
                    for q in 0..4 {
                        let (mut lo, mut hi) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                        for c in 0..8 {
                            let run = ld256(g, PQS + 64 * (8 * q + c) + 4 * h);
                            let al = _mm256_set1_epi32(act4(ab, QS + 64 * q + 4 * c));
                            let ah = _mm256_set1_epi32(act4(ab, QS + 64 * q + 32 + 4 * c));
                            let ql = _mm256_and_si256(run, low4);
                            let qh = _mm256_and_si256(_mm256_srli_epi16::<4>(run), low4);
                            if $vnni {
                                lo = dpbusd(lo, ql, al);
                                hi = dpbusd(hi, qh, ah);
                            } else {
                                // Pairs of products of codes below 16 stay inside i16, and so do
                                // eight of them added: the sums are exact, widened once below.
                                lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(ql, al));
                                hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(qh, ah));
                            }
                        }
                        let (sl, sh) = (wide(sc[2 * q]), wide(sc[2 * q + 1]));
                        if $vnni {
                            si = _mm256_add_epi32(si, _mm256_mullo_epi32(lo, sl));
                            si = _mm256_add_epi32(si, _mm256_mullo_epi32(hi, sh));
                        } else {
                            // A scale below 64 in both i16 halves of its lane: `madd` sums the
                            // lane's two pair sums, each times the scale.
                            let twice = |s: __m256i| _mm256_or_si256(s, _mm256_slli_epi32::<16>(s));
                            si = _mm256_add_epi32(si, _mm256_madd_epi16(lo, twice(sl)));
                            si = _mm256_add_epi32(si, _mm256_madd_epi16(hi, twice(sh)));
                        }
                    }
                    let bs = sub_sums(ab);
                    let mut sm = _mm256_setzero_si256();
                    for j in 0..8 {
                        sm = _mm256_add_epi32(
                            sm,
                            _mm256_mullo_epi32(wide(m[j]), _mm256_set1_epi32(bs[j])),
                        );
                    }
                    let ad = _mm256_set1_ps(q8::d_of(ab));
                    let t = _mm256_sub_ps(
                        _mm256_mul_ps(_mm256_mul_ps(ad, d), _mm256_cvtepi32_ps(si)),
                        _mm256_mul_ps(_mm256_mul_ps(ad, dmin), _mm256_cvtepi32_ps(sm)),
                    );
                    *sum = _mm256_add_ps(*sum, t);
                }
            }
            let mut out = [0f32; KPANEL];
            // SAFETY: `out` holds 16 f32.
            unsafe {
                _mm256_storeu_ps(out.as_mut_ptr(), sums[0]);
                _mm256_storeu_ps(out.as_mut_ptr().add(8), sums[1]);
            }
            out
        }
    };
}

/// AVX2 without VNNI: `maddubs` pairs added in i16, one `madd` by the scale per sub-block.
pub(super) mod plain {
    // Never called: `$vnni` is false here.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dpbusd(
        acc: std::arch::x86_64::__m256i,
        _: std::arch::x86_64::__m256i,
        _: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        acc
    }
    panel256!("avx2,fma,f16c", false);
}

pub(super) mod avxvnni {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    fn dpbusd(
        acc: std::arch::x86_64::__m256i,
        u: std::arch::x86_64::__m256i,
        s: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        std::arch::x86_64::_mm256_dpbusd_avx_epi32(acc, u, s)
    }
    panel256!("avx2,fma,f16c,avxvnni", true);
}

pub(super) mod avx512vnni {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    fn dpbusd(
        acc: std::arch::x86_64::__m256i,
        u: std::arch::x86_64::__m256i,
        s: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        std::arch::x86_64::_mm256_dpbusd_epi32(acc, u, s)
    }
    panel256!("avx2,fma,f16c,avx512vnni,avx512vl", true);
}

#[cfg(test)]
mod tests {
    use crate::repack::kpanel::check_dot_panels as check;

    #[test]
    fn every_level_gives_the_reference_bits() {
        if !super::super::available() {
            eprintln!("SKIPPED q4_k_panel: no AVX2 here");
            return;
        }
        check(super::plain::dot_panels, "avx2");
        if super::super::available_avxvnni() {
            check(super::avxvnni::dot_panels, "avx-vnni");
        }
        if super::super::available_avx512vnni() {
            check(super::avx512vnni::dot_panels, "avx512vnni-256");
        }
        if super::super::gemm512::available() && super::super::available_avx512vnni() {
            check(super::dot_panels512, "avx512");
        }
    }
}
