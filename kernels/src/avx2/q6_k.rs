//! Q6_K × Q8_K with AVX2+FMA: the 6-bit levels (0..64) are rebuilt as unsigned bytes,
//! `maddubs` against the signed activations, `madd` with the i8 sub-block scales; the −32
//! offset is taken out once per block through the activations' `bsums`
//! (`Σ sc·(q−32)·a = Σ sc·q·a − 32·Σ sc·bsum`).

use super::q4_k::fold;
use super::q8_k::{
    f16_to_f32, hsum_epi32, load16, load32, prefetch_ahead, quarters, store_scaled_i8,
};
use crate::quants::q6_k::{BLOCK_BYTES as WB, D, QH, SCALES};
use crate::quants::q8_k::{
    self as q8, blocks, check_dequantize, check_dot, check_dot_multi, BSUMS, QS,
};
use crate::types::QK_K;
use std::arch::x86_64::*;

const AB: usize = q8::BLOCK_BYTES;

/// The four 32-level pieces (values `128 h + 32 k ..`, k = 0..4) of half `h` of a block, as
/// unsigned bytes 0..64.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn levels(b: &[u8; WB], h: usize) -> [__m256i; 4] {
    let m4 = _mm256_set1_epi8(0x0f);
    let b1 = load32(&b[64 * h..]);
    let b2 = load32(&b[64 * h + 32..]);
    let hb = load32(&b[QH + 32 * h..]);
    let top = _mm256_set1_epi8(0x30);
    [
        _mm256_or_si256(
            _mm256_and_si256(b1, m4),
            _mm256_and_si256(_mm256_slli_epi16::<4>(hb), top),
        ),
        _mm256_or_si256(
            _mm256_and_si256(b2, m4),
            _mm256_and_si256(_mm256_slli_epi16::<2>(hb), top),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(b1), m4),
            _mm256_and_si256(hb, top),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(b2), m4),
            _mm256_and_si256(_mm256_srli_epi16::<2>(hb), top),
        ),
    ]
}

pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_dequantize(src, WB, dst);
    debug_assert!(super::available());
    // SAFETY: installed by `specialize` only after `available()` found AVX2, FMA and F16C.
    unsafe { dequantize_avx2(blocks::<WB>(src, nb), &mut dst[..nb * QK_K]) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_avx2(src: &[[u8; WB]], dst: &mut [f32]) {
    let m32 = _mm256_set1_epi8(32);
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b[D], b[D + 1]);
        for h in 0..2 {
            let q = levels(b, h);
            for (k, qk) in q.into_iter().enumerate() {
                let parts = quarters(_mm256_sub_epi8(qk, m32));
                let base = 128 * h + 32 * k;
                for (t, pt) in parts.into_iter().enumerate() {
                    let ds = d * f32::from(b[SCALES + (base + 8 * t) / 16] as i8);
                    store_scaled_i8(&mut y[base + 8 * t..], pt, ds);
                }
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

/// One block's exact integers: the lanes of `Σ sc·(q − 32)·a`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn block_ints(wb: &[u8; WB], ab: &[u8; AB]) -> __m256i {
    let scales = load16(&wb[SCALES..]);
    let sc16 = _mm256_cvtepi8_epi16(scales);
    let mut sumi = _mm256_setzero_si256();
    for h in 0..2 {
        let q = levels(wb, h);
        for (k, qk) in q.into_iter().enumerate() {
            let s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, scale_pair_mask(8 * h + 2 * k)));
            let a8 = load32(&ab[QS + 128 * h + 32 * k..]);
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(s, _mm256_maddubs_epi16(qk, a8)));
        }
    }
    let offset = _mm256_madd_epi16(sc16, load32(&ab[BSUMS..]));
    _mm256_sub_epi32(sumi, _mm256_slli_epi32::<5>(offset))
}

/// The decode dot, blocks in fours as Q4_K's `dot_one`: `dot_rows`'s bits.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_one(w: &[[u8; WB]], a: &[[u8; AB]]) -> f32 {
    super::q8_k::dot_in_fours!(w, a, D, block_ints)
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

/// Shuffle mask picking scale `j` for bytes 0..8 and scale `j + 1` for bytes 8..16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_pair_mask(j: usize) -> __m128i {
    let rep = 0x0101_0101_0101_0101u64;
    _mm_set_epi64x((rep * (j as u64 + 1)) as i64, (rep * j as u64) as i64)
}

/// One weight row against `R` activation rows (each weight block unpacked once, used against
/// every row; the per-row arithmetic does not depend on `R`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_rows<const R: usize>(w: &[[u8; WB]], a: [&[[u8; AB]]; R]) -> [f32; R] {
    for row in a {
        assert!(row.len() >= w.len());
    }
    let mut sum = [0f32; R];
    for (i, wb) in w.iter().enumerate() {
        prefetch_ahead(wb);
        let d = f16_to_f32(wb[D], wb[D + 1]);
        let scales = load16(&wb[SCALES..]);
        let sc16 = _mm256_cvtepi8_epi16(scales);
        let mut sumi = [_mm256_setzero_si256(); R];
        for h in 0..2 {
            let q = levels(wb, h);
            for (k, qk) in q.into_iter().enumerate() {
                let s =
                    _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, scale_pair_mask(8 * h + 2 * k)));
                for r in 0..R {
                    let a8 = load32(&a[r][i][QS + 128 * h + 32 * k..]);
                    let p = _mm256_madd_epi16(s, _mm256_maddubs_epi16(qk, a8));
                    sumi[r] = _mm256_add_epi32(sumi[r], p);
                }
            }
        }
        for r in 0..R {
            let ab = &a[r][i];
            let offset = _mm256_madd_epi16(sc16, load32(&ab[BSUMS..]));
            let s = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32::<5>(offset));
            sum[r] += q8::d_of(ab) * d * hsum_epi32(s) as f32;
        }
    }
    sum
}

/// `dot_rows` with AVX-512 (BW): two 32-level pieces (four 16-element sub-blocks) per
/// register. Exact i32 lane sums folded back to `dot_rows`'s, then `dot_rows`'s float steps:
/// bit-identical to the decode kernel.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn dot_rows512<const R: usize>(w: &[[u8; WB]], a: [&[[u8; AB]]; R]) -> [f32; R] {
    use super::q4_k::join;
    for row in a {
        assert!(row.len() >= w.len());
    }
    let mut sum = [0f32; R];
    for (i, wb) in w.iter().enumerate() {
        // Decode and small batches stream the weights from memory.
        prefetch_ahead(wb);
        let d = f16_to_f32(wb[D], wb[D + 1]);
        let scales = load16(&wb[SCALES..]);
        let sc16 = _mm256_cvtepi8_epi16(scales);
        let mut sumi = [_mm512_setzero_si512(); R];
        for h in 0..2 {
            let q = levels(wb, h);
            let sc = |k: usize| {
                _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, scale_pair_mask(8 * h + 2 * k)))
            };
            for kk in 0..2 {
                let qz = join(q[2 * kk], q[2 * kk + 1]);
                let s = join(sc(2 * kk), sc(2 * kk + 1));
                for r in 0..R {
                    let at = QS + 128 * h + 64 * kk;
                    let ab = &a[r][i][at..at + 64];
                    // SAFETY: `ab` holds the 64 bytes read.
                    let a8 = unsafe { _mm512_loadu_si512(ab.as_ptr().cast()) };
                    let p = _mm512_madd_epi16(s, _mm512_maddubs_epi16(qz, a8));
                    sumi[r] = _mm512_add_epi32(sumi[r], p);
                }
            }
        }
        for r in 0..R {
            let ab = &a[r][i];
            let offset = _mm256_madd_epi16(sc16, load32(&ab[BSUMS..]));
            let s = _mm256_sub_epi32(fold(sumi[r]), _mm256_slli_epi32::<5>(offset));
            sum[r] += q8::d_of(ab) * d * hsum_epi32(s) as f32;
        }
    }
    sum
}

/// `block_ints` 512 bits wide for the decode dot: levels 0,1 and 2,3 of each half in one
/// register each (their activations are contiguous), the high bits shifted per half by
/// `vpsllvw`/`vpsrlvw`, the scales spread by `vpermw` and `vpdpwssd` taking the scale product
/// and the sum in one step. The same exact integers as `block_ints`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn block_ints512(wb: &[u8; WB], ab: &[u8; AB], idx: &[__m512i; 4]) -> __m256i {
    let m4 = _mm512_set1_epi8(0x0f);
    let top = _mm512_set1_epi8(0x30);
    // Per 256-bit half: level 0 takes qh << 4, level 1 qh << 2; level 2 qh, level 3 qh >> 2.
    let shl = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2));
    let shr = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2));
    let scales = load16(&wb[SCALES..]);
    let sc16 = _mm256_cvtepi8_epi16(scales);
    let sc = _mm512_castsi256_si512(sc16);
    let mut acc = _mm512_setzero_si512();
    for h in 0..2 {
        // SAFETY: 64 bytes of `ql`, 32 of `qh` and 128 activation quants lie inside the blocks.
        let (b, hb, a01, a23) = unsafe {
            (
                _mm512_loadu_si512(wb[64 * h..].as_ptr().cast()),
                _mm512_broadcast_i64x4(load32(&wb[QH + 32 * h..])),
                _mm512_loadu_si512(ab[QS + 128 * h..].as_ptr().cast()),
                _mm512_loadu_si512(ab[QS + 128 * h + 64..].as_ptr().cast()),
            )
        };
        let q01 = _mm512_or_si512(
            _mm512_and_si512(b, m4),
            _mm512_and_si512(_mm512_sllv_epi16(hb, shl), top),
        );
        let q23 = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(b), m4),
            _mm512_and_si512(_mm512_srlv_epi16(hb, shr), top),
        );
        let s01 = _mm512_permutexvar_epi16(idx[2 * h], sc);
        let s23 = _mm512_permutexvar_epi16(idx[2 * h + 1], sc);
        acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(q01, a01), s01);
        acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(q23, a23), s23);
    }
    let offset = _mm256_madd_epi16(sc16, load32(&ab[BSUMS..]));
    _mm256_sub_epi32(fold(acc), _mm256_slli_epi32::<5>(offset))
}

/// Indices for `vpermw`: i16 lanes `8k..8k + 8` take scale `first + k` (four sub-blocks of 16).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) fn quad_index(first: i16) -> __m512i {
    let lo = _mm256_setr_epi16(
        first,
        first,
        first,
        first,
        first,
        first,
        first,
        first,
        first + 1,
        first + 1,
        first + 1,
        first + 1,
        first + 1,
        first + 1,
        first + 1,
        first + 1,
    );
    let hi = _mm256_add_epi16(lo, _mm256_set1_epi16(2));
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// `dot_one` with `block_ints512`: the same integers, the same float steps, the same bits.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot_one512(w: &[[u8; WB]], a: &[[u8; AB]]) -> f32 {
    let idx = [quad_index(0), quad_index(4), quad_index(8), quad_index(12)];
    super::q8_k::dot_in_fours!(w, a, D, |wb, ab| block_ints512(wb, ab, &idx))
}

pub(super) fn vec_dot512(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, w, WB, a);
    debug_assert!(super::gemm512::available());
    // SAFETY: installed by `specialize512` only after `gemm512::available()` found AVX-512
    // F/BW/VL and VNNI.
    unsafe { dot_one512(blocks::<WB>(w, nb), blocks::<AB>(a, nb)) }
}

super::q8_k::multi512!(WB, AB);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quants::q6_k as reference;

    #[test]
    fn random_blocks_match_reference() {
        super::super::q8_k::tests::check_against_reference(
            WB,
            &[D],
            (reference::dequantize, reference::vec_dot),
            (dequantize, vec_dot, vec_dot_multi),
        );
    }

    #[test]
    fn dot_gives_the_reference_bits() {
        // Each block's integer sums reduced exactly, then the reference's float steps.
        super::super::q8_k::tests::check_exact(
            WB,
            &[D],
            reference::vec_dot,
            (vec_dot, vec_dot_multi),
        );
    }

    #[test]
    fn avx512_dot_gives_the_reference_bits() {
        if !super::super::gemm512::available() {
            eprintln!("SKIPPED avx512_dot_gives_the_reference_bits: no AVX-512 F/BW/VL/VNNI");
            return;
        }
        super::super::q8_k::tests::check_exact(
            WB,
            &[D],
            reference::vec_dot,
            (vec_dot512, vec_dot_multi512),
        );
    }

    #[test]
    fn avx512_multi_gives_the_decode_bits() {
        super::super::q8_k::tests::check_multi_bits(WB, &[D], vec_dot, vec_dot_multi512);
    }
}
