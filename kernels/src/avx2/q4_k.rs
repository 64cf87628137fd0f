//! Q4_K × Q8_K with AVX2+FMA: nibbles unpacked to unsigned bytes, `maddubs` against the
//! signed activations, `madd` with the sub-block scale, one FMA per block; the mins are
//! applied through the activations' `bsums` (one `madd` per block), as ggml does.

use super::q8_k::{
    act_d4, add_in_order, f16_to_f32, f16x4, hsum2_epi32, hsum4_epi32, load32, prefetch_ahead,
    quarters, store_scaled_u8_minus,
};
use crate::quants::q4_k::{unpack_scales, unpack_scales_words, BLOCK_BYTES as WB, SCALES};
use crate::quants::q8_k::{
    self as q8, blocks, check_dequantize, check_dot, check_dot_multi, BSUMS, QS,
};
use crate::types::QK_K;
use std::arch::x86_64::*;

const AB: usize = q8::BLOCK_BYTES;
/// Offset of `qs` in a Q4_K block.
const WQS: usize = 16;

/// The 12 scale bytes of a block.
#[inline]
fn scale_bytes(b: &[u8; WB]) -> [u8; 12] {
    let mut s = [0u8; 12];
    s.copy_from_slice(&b[SCALES..SCALES + 12]);
    s
}

pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_dequantize(src, WB, dst);
    debug_assert!(super::available());
    // SAFETY: installed by `specialize` only after `available()` found AVX2, FMA and F16C.
    unsafe { dequantize_avx2(blocks::<WB>(src, nb), &mut dst[..nb * QK_K]) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_avx2(src: &[[u8; WB]], dst: &mut [f32]) {
    let m4 = _mm256_set1_epi8(0x0f);
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b[0], b[1]);
        let dmin = f16_to_f32(b[2], b[3]);
        let (sc, m) = unpack_scales(&scale_bytes(b));
        for g in 0..4 {
            let bits = load32(&b[WQS + 32 * g..]);
            let lo = quarters(_mm256_and_si256(bits, m4));
            let hi = quarters(_mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4));
            let (d1, m1) = (d * f32::from(sc[2 * g]), dmin * f32::from(m[2 * g]));
            let (d2, m2) = (d * f32::from(sc[2 * g + 1]), dmin * f32::from(m[2 * g + 1]));
            for t in 0..4 {
                store_scaled_u8_minus(&mut y[64 * g + 8 * t..], lo[t], d1, m1);
                store_scaled_u8_minus(&mut y[64 * g + 32 + 8 * t..], hi[t], d2, m2);
            }
        }
    }
}

pub(super) fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, w, WB, a);
    debug_assert!(super::available());
    // SAFETY: installed by `specialize` only after `available()` found AVX2, FMA and F16C.
    unsafe { dot_one(blocks::<WB>(w, nb), blocks::<AB>(a, nb)) }
}

/// One block's exact integers against one activation block: the lanes of `Σ sc·q·a` and of
/// the mins against the block sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn block_ints(wb: &[u8; WB], ab: &[u8; AB], masks: &[__m256i; 8]) -> (__m256i, __m256i) {
    let m4 = _mm256_set1_epi8(0x0f);
    let dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    let (sc, m) = unpack_scales_words(&scale_bytes(wb));
    let sc = u64::from(sc[0]) | (u64::from(sc[1]) << 32);
    let m = u64::from(m[0]) | (u64::from(m[1]) << 32);
    let mins16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_cvtsi64_si128(m as i64), dup));
    let scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
    let mut sumi = _mm256_setzero_si256();
    for g in 0..4 {
        let bits = load32(&wb[WQS + 32 * g..]);
        let lo = _mm256_and_si256(bits, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
        let pl = _mm256_madd_epi16(
            _mm256_shuffle_epi8(scales, masks[2 * g]),
            _mm256_maddubs_epi16(lo, load32(&ab[QS + 64 * g..])),
        );
        let ph = _mm256_madd_epi16(
            _mm256_shuffle_epi8(scales, masks[2 * g + 1]),
            _mm256_maddubs_epi16(hi, load32(&ab[QS + 64 * g + 32..])),
        );
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
    }
    (sumi, _mm256_madd_epi16(mins16, load32(&ab[BSUMS..])))
}

/// The decode dot (one weight row, one activation row): blocks in fours, their integers
/// reduced together and their float terms computed in the lanes of one register, then
/// added in block order. The reference's steps, block by block: `dot_rows`'s bits.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_one(w: &[[u8; WB]], a: &[[u8; AB]]) -> f32 {
    assert!(a.len() >= w.len());
    let masks = scale_masks();
    let mut sum = 0f32;
    let mut i = 0;
    while i + 4 <= w.len() {
        let mut si = [_mm256_setzero_si256(); 4];
        let mut sm = [_mm256_setzero_si256(); 4];
        for b in 0..4 {
            prefetch_ahead(&w[i + b]);
            (si[b], sm[b]) = block_ints(&w[i + b], &a[i + b], &masks);
        }
        let (d, dmin) = (f16x4(&w[i..], 0), f16x4(&w[i..], 2));
        let ad = act_d4(&a[i..]);
        let t = _mm_sub_ps(
            _mm_mul_ps(_mm_mul_ps(ad, d), _mm_cvtepi32_ps(hsum4_epi32(si))),
            _mm_mul_ps(_mm_mul_ps(ad, dmin), _mm_cvtepi32_ps(hsum4_epi32(sm))),
        );
        sum = add_in_order(sum, t);
        i += 4;
    }
    for (wb, ab) in w[i..].iter().zip(&a[i..]) {
        let (si, sm) = block_ints(wb, ab, &masks);
        let (si, sm) = hsum2_epi32(si, sm);
        let (d, dmin) = (f16_to_f32(wb[0], wb[1]), f16_to_f32(wb[2], wb[3]));
        let ad = q8::d_of(ab);
        sum += ad * d * si as f32 - ad * dmin * sm as f32;
    }
    sum
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
    if out.len() - r >= 2 {
        // SAFETY: as above.
        let v = unsafe { dot_rows::<2>(w, [row(r), row(r + 1)]) };
        out[r..r + 2].copy_from_slice(&v);
        r += 2;
    }
    if r < out.len() {
        // SAFETY: as above.
        let [v] = unsafe { dot_rows::<1>(w, [row(r)]) };
        out[r] = v;
    }
}

/// The eight `scale_mask`s, hidden from the compiler's shuffle lowering: with a known
/// constant it turns each `vpshufb` into a shift and a broadcast, two instructions for one.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_masks() -> [__m256i; 8] {
    std::array::from_fn(|j| {
        let mut m = scale_mask(j);
        // SAFETY: an empty asm block that only claims to change the register.
        unsafe { std::arch::asm!("/* {0} */", inout(ymm_reg) m, options(pure, nomem, nostack)) };
        m
    })
}

/// Shuffle mask broadcasting i16 lane `j` of a 128-bit lane to all eight.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_mask(j: usize) -> __m256i {
    let pair = (2 * j as i16) | ((2 * j as i16 + 1) << 8);
    _mm256_set1_epi16(pair)
}

/// One weight row against `R` activation rows: each weight block is unpacked once and used
/// against every row. Per row the arithmetic is the same for every `R`, so the tiled and
/// single dots agree bit for bit.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_rows<const R: usize>(w: &[[u8; WB]], a: [&[[u8; AB]]; R]) -> [f32; R] {
    for row in a {
        assert!(row.len() >= w.len());
    }
    let m4 = _mm256_set1_epi8(0x0f);
    let dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    let mut sum = [0f32; R];
    for (i, wb) in w.iter().enumerate() {
        prefetch_ahead(wb);
        let d = f16_to_f32(wb[0], wb[1]);
        let dmin = f16_to_f32(wb[2], wb[3]);
        let (sc, m) = unpack_scales_words(&scale_bytes(wb));
        let sc = u64::from(sc[0]) | (u64::from(sc[1]) << 32);
        let m = u64::from(m[0]) | (u64::from(m[1]) << 32);
        // Each min times the two 16-sums of its sub-block: m_j in i16 lanes 2j and 2j+1.
        let mins16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_cvtsi64_si128(m as i64), dup));
        // The eight scales as i16, in both 128-bit lanes.
        let scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
        let mut sumi = [_mm256_setzero_si256(); R];
        for g in 0..4 {
            let bits = load32(&wb[WQS + 32 * g..]);
            let lo = _mm256_and_si256(bits, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
            let sl = _mm256_shuffle_epi8(scales, scale_mask(2 * g));
            let sh = _mm256_shuffle_epi8(scales, scale_mask(2 * g + 1));
            for r in 0..R {
                let ab = &a[r][i];
                let pl =
                    _mm256_madd_epi16(sl, _mm256_maddubs_epi16(lo, load32(&ab[QS + 64 * g..])));
                let ph = _mm256_madd_epi16(
                    sh,
                    _mm256_maddubs_epi16(hi, load32(&ab[QS + 64 * g + 32..])),
                );
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
            }
        }
        for r in 0..R {
            let ab = &a[r][i];
            let ad = q8::d_of(ab);
            let summ = _mm256_madd_epi16(mins16, load32(&ab[BSUMS..]));
            let (si, sm) = hsum2_epi32(sumi[r], summ);
            sum[r] += ad * d * si as f32 - ad * dmin * sm as f32;
        }
    }
    sum
}

/// Two 256-bit halves as one 512-bit register (`lo` in bits 0..256).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// The two 256-bit halves of `v` added lane-wise (exact: i32 sums that cannot overflow).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) fn fold(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// `dot_rows` with AVX-512 (BW): each 64-element group (a sub-block pair) in one register,
/// so the `maddubs`/`madd`/add of two sub-blocks are one instruction each. The i32 lane sums
/// are exact, so folding the halves gives `dot_rows`'s integers and every later step is
/// `dot_rows`'s: the results are bit-identical to the decode kernel.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn dot_rows512<const R: usize>(w: &[[u8; WB]], a: [&[[u8; AB]]; R]) -> [f32; R] {
    for row in a {
        assert!(row.len() >= w.len());
    }
    let m4 = _mm256_set1_epi8(0x0f);
    let dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    let mut sum = [0f32; R];
    for (i, wb) in w.iter().enumerate() {
        // Decode and small batches stream the weights from memory.
        prefetch_ahead(wb);
        let d = f16_to_f32(wb[0], wb[1]);
        let dmin = f16_to_f32(wb[2], wb[3]);
        let (sc, m) = unpack_scales_words(&scale_bytes(wb));
        let sc = u64::from(sc[0]) | (u64::from(sc[1]) << 32);
        let m = u64::from(m[0]) | (u64::from(m[1]) << 32);
        let mins16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_cvtsi64_si128(m as i64), dup));
        let scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
        let mut sumi = [_mm512_setzero_si512(); R];
        for g in 0..4 {
            let bits = load32(&wb[WQS + 32 * g..]);
            let q = join(
                _mm256_and_si256(bits, m4),
                _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4),
            );
            let s = join(
                _mm256_shuffle_epi8(scales, scale_mask(2 * g)),
                _mm256_shuffle_epi8(scales, scale_mask(2 * g + 1)),
            );
            for r in 0..R {
                let ab = &a[r][i][QS + 64 * g..QS + 64 * g + 64];
                // SAFETY: `ab` holds the 64 bytes read.
                let a8 = unsafe { _mm512_loadu_si512(ab.as_ptr().cast()) };
                let p = _mm512_madd_epi16(s, _mm512_maddubs_epi16(q, a8));
                sumi[r] = _mm512_add_epi32(sumi[r], p);
            }
        }
        for r in 0..R {
            let ab = &a[r][i];
            let ad = q8::d_of(ab);
            let summ = _mm256_madd_epi16(mins16, load32(&ab[BSUMS..]));
            let (si, sm) = hsum2_epi32(fold(sumi[r]), summ);
            sum[r] += ad * d * si as f32 - ad * dmin * sm as f32;
        }
    }
    sum
}

super::q8_k::multi512!(WB, AB);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quants::q4_k as reference;

    #[test]
    fn random_blocks_match_reference() {
        super::super::q8_k::tests::check_against_reference(
            WB,
            &[0, 2],
            (reference::dequantize, reference::vec_dot),
            (dequantize, vec_dot, vec_dot_multi),
        );
    }

    #[test]
    fn dot_gives_the_reference_bits() {
        // Each block's integer sums reduced exactly, then the reference's float steps.
        super::super::q8_k::tests::check_exact(
            WB,
            &[0, 2],
            reference::vec_dot,
            (vec_dot, vec_dot_multi),
        );
    }

    #[test]
    fn avx512_multi_gives_the_decode_bits() {
        super::super::q8_k::tests::check_multi_bits(WB, &[0, 2], vec_dot, vec_dot_multi512);
    }
}
