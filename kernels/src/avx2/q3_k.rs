//! Q3_K × Q8_K with AVX2: the 3-bit levels are rebuilt as unsigned bytes 0..8 (two bits from
//! `qs`, the third from `hmask`), `maddubs` against the signed activations, `madd` with the
//! signed 6-bit scales; the −4 offset comes out once per block through the activations'
//! `bsums` (`Σ s·(q−4)·a = Σ s·q·a − 4·Σ s·bsum`). Each block's integer sum is reduced to one
//! i32 and scaled with the reference's own float expression, so every form here (and the
//! AVX-512 rows) equals `quants::q3_k::vec_dot` bit for bit.

use super::q8_k::{f16_to_f32, hsum_epi32, load32, prefetch_ahead};
use crate::quants::q3_k::{BLOCK_BYTES as WB, D, HMASK, QS as WQS, SCALES};
use crate::quants::q8_k::{self as q8, blocks, check_dot, check_dot_multi, BSUMS, QS};
use std::arch::x86_64::*;

const AB: usize = q8::BLOCK_BYTES;

/// The sixteen signed scales `s − 32` of a block as bytes, unpacked in one register: the low
/// nibbles from bytes 0..8 (scales 0..8, then their high nibbles for 8..16), the two high bits
/// of scale `j` from byte `8 + j % 4` shifted right by `2 (j / 4)` (one variable dword shift).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales(b: &[u8; WB]) -> __m128i {
    // The 16 bytes ending with the block: two of `qs`, the 12 scale bytes, then `d`.
    const AT: usize = WB - 16;
    const _: () = assert!(SCALES == AT + 2 && SCALES + 12 <= WB);
    // SAFETY: bytes AT..WB lie inside the block.
    let x = unsafe { _mm_loadu_si128(b[AT..].as_ptr().cast()) };
    let m4 = _mm_set1_epi8(0x0f);
    let s = _mm_srli_si128::<2>(x);
    let low = _mm_and_si128(_mm_unpacklo_epi64(s, _mm_srli_epi16::<4>(s)), m4);
    let c = _mm_shuffle_epi8(
        x,
        _mm_setr_epi8(
            10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13,
        ),
    );
    let two = _mm_and_si128(
        _mm_srlv_epi32(c, _mm_setr_epi32(0, 2, 4, 6)),
        _mm_set1_epi8(3),
    );
    let v = _mm_or_si128(low, _mm_slli_epi16::<4>(two));
    _mm_sub_epi8(v, _mm_set1_epi8(32))
}

/// Bits `2k, 2k + 1` of every byte of `bits`, as bytes 0..4 (`k` is a constant after
/// inlining into the unrolled loops).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn crumb(bits: __m256i, k: usize) -> __m256i {
    let v = match k {
        0 => bits,
        1 => _mm256_srli_epi16::<2>(bits),
        2 => _mm256_srli_epi16::<4>(bits),
        _ => _mm256_srli_epi16::<6>(bits),
    };
    _mm256_and_si256(v, _mm256_set1_epi8(3))
}

/// Bit `b` of every byte of `hm`, moved to bit 2 (the value 4 or 0).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn third_bit(hm: __m256i, b: usize) -> __m256i {
    // 16-bit shifts by at most 5: bit 2 of each byte comes from bit b of the same byte.
    let v = match b {
        0 => _mm256_slli_epi16::<2>(hm),
        1 => _mm256_slli_epi16::<1>(hm),
        2 => hm,
        3 => _mm256_srli_epi16::<1>(hm),
        4 => _mm256_srli_epi16::<2>(hm),
        5 => _mm256_srli_epi16::<3>(hm),
        6 => _mm256_srli_epi16::<4>(hm),
        _ => _mm256_srli_epi16::<5>(hm),
    };
    _mm256_and_si256(v, _mm256_set1_epi8(4))
}

/// Shuffle mask broadcasting i16 lane `2k` of the low 128-bit lane and i16 lane `2k + 1` of
/// the high one: the scales of sub-blocks `8h + 2k` and `8h + 2k + 1` from `halves(..)[h]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn pair_mask(k: usize) -> __m256i {
    let pick = |i: usize| (2 * i as i16) | ((2 * i as i16 + 1) << 8);
    _mm256_setr_m128i(_mm_set1_epi16(pick(2 * k)), _mm_set1_epi16(pick(2 * k + 1)))
}

/// Sixteen i16 scales as two registers, the r-th holding scales `8r .. 8r + 8` in both
/// 128-bit lanes (for `pair_mask`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn halves(s16: __m256i) -> [__m256i; 2] {
    [
        _mm256_permute2x128_si256::<0x00>(s16, s16),
        _mm256_permute2x128_si256::<0x11>(s16, s16),
    ]
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
        let sc16 = _mm256_cvtepi8_epi16(scales(wb));
        let sh = halves(sc16);
        let hm = load32(&wb[HMASK..]);
        let mut sumi = [_mm256_setzero_si256(); R];
        for h in 0..2 {
            let bits = load32(&wb[WQS + 32 * h..]);
            for k in 0..4 {
                let q = _mm256_or_si256(crumb(bits, k), third_bit(hm, 4 * h + k));
                let s = _mm256_shuffle_epi8(sh[h], pair_mask(k));
                for r in 0..R {
                    let a8 = load32(&a[r][i][QS + 128 * h + 32 * k..]);
                    let p = _mm256_madd_epi16(s, _mm256_maddubs_epi16(q, a8));
                    sumi[r] = _mm256_add_epi32(sumi[r], p);
                }
            }
        }
        for r in 0..R {
            let ab = &a[r][i];
            let offset = _mm256_madd_epi16(sc16, load32(&ab[BSUMS..]));
            let t = hsum_epi32(_mm256_sub_epi32(sumi[r], _mm256_slli_epi32::<2>(offset)));
            sum[r] += q8::d_of(ab) * d * t as f32;
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
        let sc16 = _mm256_cvtepi8_epi16(scales(wb));
        let sh = halves(sc16);
        let hm = load32(&wb[HMASK..]);
        let mut sumi = [_mm512_setzero_si512(); R];
        for h in 0..2 {
            let bits = load32(&wb[WQS + 32 * h..]);
            let piece = |k: usize| _mm256_or_si256(crumb(bits, k), third_bit(hm, 4 * h + k));
            let sk = |k: usize| _mm256_shuffle_epi8(sh[h], pair_mask(k));
            for kk in 0..2 {
                let q = join(piece(2 * kk), piece(2 * kk + 1));
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
        for r in 0..R {
            let ab = &a[r][i];
            let offset = _mm256_madd_epi16(sc16, load32(&ab[BSUMS..]));
            let t = hsum_epi32(_mm256_sub_epi32(
                fold(sumi[r]),
                _mm256_slli_epi32::<2>(offset),
            ));
            sum[r] += q8::d_of(ab) * d * t as f32;
        }
    }
    sum
}

/// One block's exact integers (the lanes of `Σ s·(q − 4)·a`) for the decode dot, 512 bits
/// wide: crumbs `2p, 2p + 1` of a half in one register (their activations are contiguous),
/// each 256-bit half shifted by its own count (`vpsrlvw`/`vpsllvw`, the third bit likewise),
/// the scales spread by `vpermw`, `vpdpwssd` taking the scale product and the sum in one step.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn block_ints512(wb: &[u8; WB], ab: &[u8; AB], idx: &[__m512i; 4]) -> __m256i {
    let halves16 =
        |lo: i16, hi: i16| _mm512_inserti64x4::<1>(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi));
    let three = _mm512_set1_epi8(3);
    let four = _mm512_set1_epi8(4);
    let sc16 = _mm256_cvtepi8_epi16(scales(wb));
    let sc = _mm512_castsi256_si512(sc16);
    // SAFETY: the 32 bytes of `hmask` lie inside the block.
    let hm = _mm512_broadcast_i64x4(load32(&wb[HMASK..]));
    let mut acc = _mm512_setzero_si512();
    for h in 0..2 {
        let bits = _mm512_broadcast_i64x4(load32(&wb[WQS + 32 * h..]));
        for p in 0..2 {
            // Crumb k = 2p + half; its third bit is hmask bit 4h + k, moved to bit 2.
            let crumbs = _mm512_and_si512(
                _mm512_srlv_epi16(bits, halves16(4 * p as i16, 4 * p as i16 + 2)),
                three,
            );
            let b0 = (4 * h + 2 * p) as i16;
            let third = if b0 < 2 {
                _mm512_sllv_epi16(hm, halves16(2 - b0, 1 - b0))
            } else {
                _mm512_srlv_epi16(hm, halves16(b0 - 2, b0 - 1))
            };
            let q = _mm512_or_si512(crumbs, _mm512_and_si512(third, four));
            let at = QS + 128 * h + 64 * p;
            // SAFETY: 64 activation quants lie inside the block.
            let a8 = unsafe { _mm512_loadu_si512(ab[at..].as_ptr().cast()) };
            let s = _mm512_permutexvar_epi16(idx[2 * h + p], sc);
            acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(q, a8), s);
        }
    }
    let offset = _mm256_madd_epi16(sc16, load32(&ab[BSUMS..]));
    _mm256_sub_epi32(super::q4_k::fold(acc), _mm256_slli_epi32::<2>(offset))
}

/// The decode dot with `block_ints512`, blocks in fours as Q4_K's: the reference's bits.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot_one512(w: &[[u8; WB]], a: &[[u8; AB]]) -> f32 {
    use super::q6_k::quad_index;
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
    use crate::quants::q3_k as reference;

    #[test]
    fn random_blocks_match_reference() {
        super::super::q8_k::tests::check_exact(
            WB,
            &[D],
            reference::vec_dot,
            (vec_dot, vec_dot_multi),
        );
    }

    #[test]
    fn scale_unpacking_matches_the_reference() {
        if !super::super::available() {
            return;
        }
        let mut b = [0u8; WB];
        for seed in 0u32..256 {
            for (k, v) in b.iter_mut().enumerate() {
                *v = (seed.wrapping_mul(2_654_435_761).rotate_left(k as u32 * 3) >> 5) as u8;
            }
            // SAFETY: AVX2 is available (checked).
            let v = unsafe { scales(&b) };
            let mut got = [0i8; 16];
            // SAFETY: `got` holds 16 bytes.
            unsafe { _mm_storeu_si128(got.as_mut_ptr().cast(), v) };
            assert_eq!(got, reference::scales(&b), "seed {seed}");
        }
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
