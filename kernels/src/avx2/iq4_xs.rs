//! IQ4_XS × Q8_K with AVX2 (and a 512-bit batch form): per 32-element sub-block the indices
//! are unpacked as nibbles and mapped through the codebook with one `pshufb`; the products
//! with the activations are summed as `maddubs(|a|, sign(w, a))` — the sign moved onto the
//! weights, whose magnitude is at most 127, so the activations' −128 is exact — and `madd`
//! with the sub-block scale widens them to i32. Each block's sum is reduced to one exact i32
//! and scaled with the reference's own float expression (`ad · d · sumi`, block by block), so
//! every form and level gives the reference's bits.

use super::q8_0::nibbles;
use super::q8_k::{f16_to_f32, hsum_epi32, prefetch_ahead};
use crate::quants::iq4_nl::KVALUES;
use crate::quants::iq4_xs::{BLOCK_BYTES as WB, QS as WQS, SCALES_H, SCALES_L};
use crate::quants::q8_k::{self as q8, blocks, check_dot, check_dot_multi, BSUMS, QS};
use std::arch::x86_64::*;

const AB: usize = q8::BLOCK_BYTES;

/// Byte `k` of entry `v`: bits `2k, 2k + 1` of `v`, shifted to bits 4..6 (the high part of
/// four sub-block scales from one byte of `scales_h`).
const HIGH_BITS: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut v = 0;
    while v < 256 {
        let mut k = 0;
        while k < 4 {
            t[v] |= (((v as u32) >> (2 * k)) & 3) << (8 * k + 4);
            k += 1;
        }
        v += 1;
    }
    t
};

/// The eight sub-block scales `ls − 32` of block `b` as i16, in both 128-bit lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn block_scales(b: &[u8; WB]) -> __m256i {
    let sl = u32::from_le_bytes([
        b[SCALES_L],
        b[SCALES_L + 1],
        b[SCALES_L + 2],
        b[SCALES_L + 3],
    ]);
    let hi = u64::from(HIGH_BITS[usize::from(b[SCALES_H])])
        | u64::from(HIGH_BITS[usize::from(b[SCALES_H + 1])]) << 32;
    let m4 = _mm_set1_epi8(0x0f);
    let x = _mm_cvtsi32_si128(sl as i32);
    // Nibble k of `sl` into byte k.
    let lo = _mm_unpacklo_epi8(
        _mm_and_si128(x, m4),
        _mm_and_si128(_mm_srli_epi16::<4>(x), m4),
    );
    let ls = _mm_or_si128(lo, _mm_cvtsi64_si128(hi as i64));
    let ls = _mm_sub_epi16(_mm_cvtepu8_epi16(ls), _mm_set1_epi16(32));
    _mm256_broadcastsi128_si256(ls)
}

/// Shuffle mask broadcasting i16 lane `j` of a 128-bit lane to all eight.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_mask(j: usize) -> __m256i {
    let pair = (2 * j as i16) | ((2 * j as i16 + 1) << 8);
    _mm256_set1_epi16(pair)
}

/// The codebook in both 128-bit lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn codebook() -> __m256i {
    // SAFETY: `KVALUES` is 16 readable bytes; `loadu` has no alignment requirement.
    _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(KVALUES.as_ptr().cast()) })
}

/// The 32 weights of sub-block `ib` of block `b` as signed bytes, in element order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sub_block(b: &[u8; WB], ib: usize, table: __m256i) -> __m256i {
    let q = &b[WQS + 16 * ib..WQS + 16 * ib + 16];
    // SAFETY: `q` holds the 16 bytes read.
    _mm256_shuffle_epi8(table, unsafe { nibbles(q.as_ptr()) })
}

/// Σ w·a·scale over 32 elements into eight i32 lanes: `maddubs(|a|, sign(w, a))` is exact
/// (|w| ≤ 127, |a| ≤ 128: a pair is at most 32,512), `madd` with the scale exact in i32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scaled_dot(w: __m256i, a: __m256i, scale: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(_mm256_abs_epi8(a), _mm256_sign_epi8(w, a));
    _mm256_madd_epi16(p, scale)
}

/// One weight row against `R` activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_rows<const R: usize>(w: &[[u8; WB]], a: [&[[u8; AB]]; R]) -> [f32; R] {
    for row in a {
        assert!(row.len() >= w.len());
    }
    let table = codebook();
    let mut sum = [0f32; R];
    for (i, wb) in w.iter().enumerate() {
        prefetch_ahead(wb);
        let d = f16_to_f32(wb[0], wb[1]);
        let scales = block_scales(wb);
        let mut acc = [_mm256_setzero_si256(); R];
        for ib in 0..8 {
            let q = sub_block(wb, ib, table);
            let s = _mm256_shuffle_epi8(scales, scale_mask(ib));
            for r in 0..R {
                let av = super::q8_k::load32(&a[r][i][QS + 32 * ib..]);
                acc[r] = _mm256_add_epi32(acc[r], scaled_dot(q, av, s));
            }
        }
        for r in 0..R {
            let ad = q8::d_of(&a[r][i]);
            sum[r] += ad * d * hsum_epi32(acc[r]) as f32;
        }
    }
    sum
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

/// `dot_rows` with AVX-512 (BW): two sub-blocks per 512-bit register. AVX-512 has no byte
/// `sign`, so the weights take the activations' signs by a masked negation; the i32 lanes
/// are exact, so folding the halves gives `dot_rows`'s integers and the same float steps.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn dot_rows512<const R: usize>(w: &[[u8; WB]], a: [&[[u8; AB]]; R]) -> [f32; R] {
    use super::q4_k::{fold, join};
    for row in a {
        assert!(row.len() >= w.len());
    }
    let table = codebook();
    let zero = _mm512_setzero_si512();
    let mut sum = [0f32; R];
    for (i, wb) in w.iter().enumerate() {
        prefetch_ahead(wb);
        let d = f16_to_f32(wb[0], wb[1]);
        let scales = block_scales(wb);
        let mut acc = [zero; R];
        for g in 0..4 {
            let q = join(sub_block(wb, 2 * g, table), sub_block(wb, 2 * g + 1, table));
            let s = join(
                _mm256_shuffle_epi8(scales, scale_mask(2 * g)),
                _mm256_shuffle_epi8(scales, scale_mask(2 * g + 1)),
            );
            for r in 0..R {
                let ab = &a[r][i][QS + 64 * g..QS + 64 * g + 64];
                // SAFETY: `ab` holds the 64 bytes read.
                let av = unsafe { _mm512_loadu_si512(ab.as_ptr().cast()) };
                let neg = _mm512_movepi8_mask(av);
                let sw = _mm512_mask_sub_epi8(q, neg, zero, q);
                let p = _mm512_maddubs_epi16(_mm512_abs_epi8(av), sw);
                acc[r] = _mm512_add_epi32(acc[r], _mm512_madd_epi16(p, s));
            }
        }
        for r in 0..R {
            let ad = q8::d_of(&a[r][i]);
            sum[r] += ad * d * hsum_epi32(fold(acc[r])) as f32;
        }
    }
    sum
}

/// One block's exact integer `Σ ls·w·a` in eight i32 lanes, 512 bits wide with VNNI: the
/// codebook biased by +128 (unsigned, 1..241) so `vpdpbusd` takes four products a step; each
/// 128-bit lane of the accumulator gathers one sub-block (low nibbles then high against the
/// activations' matching 16-byte quarters, paired by `vshufi64x2`), `vpmulld` applies the
/// scales, and the bias comes out through the block sums (`128 · Σ ls·bsum`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn block_ints512(wb: &[u8; WB], ab: &[u8; AB], table: __m512i, idx: &[__m512i; 2]) -> __m256i {
    let m4 = _mm512_set1_epi8(0x0f);
    let ls16 = _mm256_castsi256_si128(block_scales(wb));
    let ls32 = _mm512_castsi256_si512(_mm256_cvtepi16_epi32(ls16));
    let mut total = _mm512_setzero_si512();
    for h in 0..2 {
        // SAFETY: 64 bytes of indices and 128 activation quants lie inside the blocks.
        let (bits, a0, a1) = unsafe {
            (
                _mm512_loadu_si512(wb[WQS + 64 * h..].as_ptr().cast()),
                _mm512_loadu_si512(ab[QS + 128 * h..].as_ptr().cast()),
                _mm512_loadu_si512(ab[QS + 128 * h + 64..].as_ptr().cast()),
            )
        };
        let lo = _mm512_shuffle_epi8(table, _mm512_and_si512(bits, m4));
        let hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16::<4>(bits), m4));
        // Sub-block k of this half: its first 16 activations in lane k of `alo`, the rest in `ahi`.
        let alo = _mm512_shuffle_i64x2::<0x88>(a0, a1);
        let ahi = _mm512_shuffle_i64x2::<0xdd>(a0, a1);
        let acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, alo);
        let acc = _mm512_dpbusd_epi32(acc, hi, ahi);
        let sc = _mm512_permutexvar_epi32(idx[h], ls32);
        total = _mm512_add_epi32(total, _mm512_mullo_epi32(acc, sc));
    }
    let lspairs = _mm256_set_m128i(
        _mm_unpackhi_epi16(ls16, ls16),
        _mm_unpacklo_epi16(ls16, ls16),
    );
    let bias = _mm256_madd_epi16(lspairs, super::q8_k::load32(&ab[BSUMS..]));
    _mm256_sub_epi32(super::q4_k::fold(total), _mm256_slli_epi32::<7>(bias))
}

/// The decode dot with `block_ints512`, blocks in fours as Q4_K's: the reference's bits.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot_one512(w: &[[u8; WB]], a: &[[u8; AB]]) -> f32 {
    let table = _mm512_xor_si512(
        _mm512_broadcast_i32x4(_mm256_castsi256_si128(codebook())),
        _mm512_set1_epi8(-128),
    );
    let quad = |k: i32| {
        _mm512_setr_epi32(
            k,
            k,
            k,
            k,
            k + 1,
            k + 1,
            k + 1,
            k + 1,
            k + 2,
            k + 2,
            k + 2,
            k + 2,
            k + 3,
            k + 3,
            k + 3,
            k + 3,
        )
    };
    let idx = [quad(0), quad(4)];
    super::q8_k::dot_in_fours!(w, a, 0, |wb, ab| block_ints512(wb, ab, table, &idx))
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
    use crate::quants::iq4_xs as reference;

    #[test]
    fn random_blocks_match_reference() {
        super::super::q8_k::tests::check_against_reference(
            WB,
            &[0],
            (reference::dequantize, reference::vec_dot),
            (reference::dequantize, vec_dot, vec_dot_multi),
        );
    }

    /// Random blocks (every scale and index pattern, either sign of `d`) against Q8_K rows
    /// full of −128 and 127: the AVX2 dot and multi-row forms, and the AVX-512 one where the
    /// CPU has it, give the reference's bits.
    #[test]
    fn dots_give_the_reference_bits() {
        use half::f16;
        use rand::rngs::StdRng;
        use rand::{Rng, SeedableRng};
        if !super::super::available() {
            return;
        }
        let wide = super::super::gemm512::available();
        let mut rng = StdRng::seed_from_u64(23);
        for nb in [1usize, 3, 8] {
            let n = nb * crate::QK_K;
            let mut w: Vec<u8> = (0..nb * WB).map(|_| rng.random()).collect();
            for b in w.chunks_exact_mut(WB) {
                let d = rng.random_range(1e-3f32..2.0) * if rng.random() { 1.0 } else { -1.0 };
                b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
            }
            let rows = 13;
            let stride = nb * AB + 8;
            let mut acts = vec![0u8; rows * stride];
            for r in 0..rows {
                let x: Vec<f32> = (0..n)
                    .map(|_| match rng.random_range(0..4) {
                        0 => -1.0,
                        1 => 1.0,
                        _ => rng.random_range(-1.0f32..1.0),
                    })
                    .collect();
                q8::quantize(&x, &mut acts[r * stride..r * stride + nb * AB]);
            }
            let row = |r: usize| &acts[r * stride..r * stride + nb * AB];
            assert!(
                (0..rows).any(|r| row(r)[QS..].contains(&0x80)),
                "no −128 quants"
            );
            let want: Vec<u32> = (0..rows)
                .map(|r| reference::vec_dot(n, &w, row(r)).to_bits())
                .collect();
            for (r, want) in want.iter().enumerate() {
                assert_eq!(
                    vec_dot(n, &w, row(r)).to_bits(),
                    *want,
                    "{nb} blocks, row {r}"
                );
            }
            if wide {
                for (r, want) in want.iter().enumerate() {
                    assert_eq!(
                        vec_dot512(n, &w, row(r)).to_bits(),
                        *want,
                        "512-bit dot, {nb} blocks, row {r}"
                    );
                }
            }
            for k in 0..=rows {
                let mut out = vec![0f32; k];
                vec_dot_multi(n, &w, &acts, stride, &mut out);
                let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got[..], want[..k], "multi {k} rows, {nb} blocks");
                if wide {
                    vec_dot_multi512(n, &w, &acts, stride, &mut out);
                    let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got[..], want[..k], "multi512 {k} rows, {nb} blocks");
                }
            }
        }
    }

    #[test]
    fn scale_unpacking_matches_the_reference() {
        if !super::super::available() {
            return;
        }
        let mut b = [0u8; WB];
        for seed in 0u32..64 {
            for (k, v) in b[SCALES_H..WQS].iter_mut().enumerate() {
                *v = (seed.wrapping_mul(2_654_435_761).rotate_left(k as u32 * 5) >> 7) as u8;
            }
            // SAFETY: AVX2 is available (checked).
            let v = unsafe { block_scales(&b) };
            let mut got = [0i16; 16];
            // SAFETY: `got` holds 32 bytes.
            unsafe { _mm256_storeu_si256(got.as_mut_ptr().cast(), v) };
            let want = reference::scales(&b);
            for ib in 0..8 {
                assert_eq!(i32::from(got[ib]), want[ib]);
                assert_eq!(i32::from(got[8 + ib]), want[ib]);
            }
        }
    }
}
