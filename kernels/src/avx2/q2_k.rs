//! Q2_K × Q8_K with AVX2: the 2-bit levels as unsigned bytes, `maddubs` against the signed
//! activations, `madd` with the 4-bit scales; the mins through the activations' `bsums` (one
//! `madd` per block). Each block's integer sums are reduced to two i32 and scaled with the
//! reference's own float expression, so every form here (and the AVX-512 rows) equals
//! `quants::q2_k::vec_dot` bit for bit.

use super::q3_k::{crumb, halves, pair_mask};
use super::q8_k::{f16_to_f32, hsum_epi32, load16, load32, prefetch_ahead};
use crate::quants::q2_k::{BLOCK_BYTES as WB, D, QS as WQS, SCALES};
use crate::quants::q8_k::{self as q8, blocks, check_dot, check_dot_multi, BSUMS, QS};
use std::arch::x86_64::*;

const AB: usize = q8::BLOCK_BYTES;

/// The sixteen 4-bit scales and the sixteen 4-bit mins of a block, as bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales_mins(b: &[u8; WB]) -> (__m128i, __m128i) {
    let v = load16(&b[SCALES..]);
    let m4 = _mm_set1_epi8(0x0f);
    (
        _mm_and_si128(v, m4),
        _mm_and_si128(_mm_srli_epi16::<4>(v), m4),
    )
}

pub(super) fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, w, WB, a);
    debug_assert!(super::available());
    // SAFETY: installed by `specialize` only after `available()` found AVX2, FMA and F16C.
    let [r] = unsafe { dot_rows::<1>(blocks::<WB>(w, nb), [blocks::<AB>(a, nb)]) };
    r
}

pub(super) fn vec_dot_multi(n: usize, w: &[u8], a: &[u8], a_stride: usize, out: &mut [f32]) {
    let nb = check_dot_multi(n, w, WB, a, a_stride, out.len());
    debug_assert!(super::available());
    let w = blocks::<WB>(w, nb);
    let row = |r: usize| blocks::<AB>(&a[r * a_stride..], nb);
    let mut r = 0;
    while out.len() - r >= 4 {
        // SAFETY: installed by `specialize` only after `available()` found AVX2, FMA and
        // F16C; `row` checks each row holds `nb` blocks.
        let v = unsafe { dot_rows::<4>(w, [row(r), row(r + 1), row(r + 2), row(r + 3)]) };
        out[r..r + 4].copy_from_slice(&v);
        r += 4;
    }
    while r < out.len() {
        // SAFETY: as above.
        let [v] = unsafe { dot_rows::<1>(w, [row(r)]) };
        out[r] = v;
        r += 1;
    }
}

/// One weight row against `R` activation rows: each weight block is unpacked once and used
/// against every row.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_rows<const R: usize>(w: &[[u8; WB]], a: [&[[u8; AB]]; R]) -> [f32; R] {
    for row in a {
        assert!(row.len() >= w.len());
    }
    let mut sum = [0f32; R];
    for (i, wb) in w.iter().enumerate() {
        prefetch_ahead(wb);
        let d = f16_to_f32(wb[D], wb[D + 1]);
        let dmin = f16_to_f32(wb[D + 2], wb[D + 3]);
        let (sc, m) = scales_mins(wb);
        let sh = halves(_mm256_cvtepu8_epi16(sc));
        let mut sumi = [_mm256_setzero_si256(); R];
        for h in 0..2 {
            let bits = load32(&wb[WQS + 32 * h..]);
            for k in 0..4 {
                let q = crumb(bits, k);
                let s = _mm256_shuffle_epi8(sh[h], pair_mask(k));
                for r in 0..R {
                    let a8 = load32(&a[r][i][QS + 128 * h + 32 * k..]);
                    let p = _mm256_madd_epi16(s, _mm256_maddubs_epi16(q, a8));
                    sumi[r] = _mm256_add_epi32(sumi[r], p);
                }
            }
        }
        let m16 = _mm256_cvtepu8_epi16(m);
        for r in 0..R {
            let ab = &a[r][i];
            let ad = q8::d_of(ab);
            let summ = hsum_epi32(_mm256_madd_epi16(m16, load32(&ab[BSUMS..])));
            let t = hsum_epi32(sumi[r]);
            sum[r] += ad * d * t as f32 - ad * dmin * summ as f32;
        }
    }
    sum
}

/// `dot_rows` with AVX-512 (BW): two 32-level pieces (four sub-blocks) per register. The
/// integer block sums are exact and the float steps `dot_rows`'s: the same bits.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn dot_rows512<const R: usize>(w: &[[u8; WB]], a: [&[[u8; AB]]; R]) -> [f32; R] {
    use super::q4_k::{fold, join};
    for row in a {
        assert!(row.len() >= w.len());
    }
    let mut sum = [0f32; R];
    for (i, wb) in w.iter().enumerate() {
        prefetch_ahead(wb);
        let d = f16_to_f32(wb[D], wb[D + 1]);
        let dmin = f16_to_f32(wb[D + 2], wb[D + 3]);
        let (sc, m) = scales_mins(wb);
        let sh = halves(_mm256_cvtepu8_epi16(sc));
        let mut sumi = [_mm512_setzero_si512(); R];
        for h in 0..2 {
            let bits = load32(&wb[WQS + 32 * h..]);
            let sk = |k: usize| _mm256_shuffle_epi8(sh[h], pair_mask(k));
            for kk in 0..2 {
                let q = join(crumb(bits, 2 * kk), crumb(bits, 2 * kk + 1));
                let s = join(sk(2 * kk), sk(2 * kk + 1));
                for r in 0..R {
                    let at = QS + 128 * h + 64 * kk;
                    let ab = &a[r][i][at..at + 64];
                    // SAFETY: `ab` holds the 64 bytes read.
                    let a8 = unsafe { _mm512_loadu_si512(ab.as_ptr().cast()) };
                    let p = _mm512_madd_epi16(s, _mm512_maddubs_epi16(q, a8));
                    sumi[r] = _mm512_add_epi32(sumi[r], p);
                }
            }
        }
        let m16 = _mm256_cvtepu8_epi16(m);
        for r in 0..R {
            let ab = &a[r][i];
            let ad = q8::d_of(ab);
            let summ = hsum_epi32(_mm256_madd_epi16(m16, load32(&ab[BSUMS..])));
            let t = hsum_epi32(fold(sumi[r]));
            sum[r] += ad * d * t as f32 - ad * dmin * summ as f32;
        }
    }
    sum
}

super::q8_k::multi512!(WB, AB);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quants::q2_k as reference;

    #[test]
    fn random_blocks_match_reference() {
        super::super::q8_k::tests::check_exact(
            WB,
            &[D, D + 2],
            reference::vec_dot,
            (vec_dot, vec_dot_multi),
        );
    }

    #[test]
    fn avx512_multi_gives_the_decode_bits() {
        super::super::q8_k::tests::check_multi_bits(WB, &[D, D + 2], vec_dot, vec_dot_multi512);
    }
}
