//! Q8_K with AVX2: the on-the-fly activation quantizer of every K-quant dot product
//! (byte-identical to the reference), dequantize, and the small vector helpers the other
//! K-quant files share.
//!
//! The helpers are safe `#[target_feature]` functions: callable without `unsafe` only from
//! code compiled with the same features, i.e. from the `unsafe fn` kernels, which are only
//! reached through entries `specialize` installed after `available()` succeeded.

use crate::quants::q8_k::{check_dequantize, check_quantize, BLOCK_BYTES, BSUMS, QS};
use crate::types::QK_K;
use std::arch::x86_64::*;

/// Loads 32 bytes from the start of `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn load32(b: &[u8]) -> __m256i {
    assert!(b.len() >= 32);
    // SAFETY: `b` has at least 32 readable bytes (checked); `loadu` needs no alignment.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

/// Loads 16 bytes from the start of `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn load16(b: &[u8]) -> __m128i {
    assert!(b.len() >= 16);
    // SAFETY: `b` has at least 16 readable bytes (checked); `loadu` needs no alignment.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

/// Loads 8 f32 from the start of `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn load_ps(x: &[f32]) -> __m256 {
    assert!(x.len() >= 8);
    // SAFETY: `x` has at least 8 readable floats (checked); `loadu` needs no alignment.
    unsafe { _mm256_loadu_ps(x.as_ptr()) }
}

/// Stores 8 f32 at the start of `y`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn store_ps(y: &mut [f32], v: __m256) {
    assert!(y.len() >= 8);
    // SAFETY: `y` has room for 8 floats (checked) and is borrowed mutably; no alignment needed.
    unsafe { _mm256_storeu_ps(y.as_mut_ptr(), v) }
}

/// Widens the 8 bytes `q` (low half of a register) as signed/unsigned to 8 f32 and stores
/// `d * q` into `y`: the dequantize step, with the reference's single multiply.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn store_scaled_i8(y: &mut [f32], q: __m128i, d: f32) {
    store_ps(
        y,
        _mm256_mul_ps(
            _mm256_set1_ps(d),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
        ),
    );
}

/// `d * q - m` for the 8 unsigned bytes in the low half of `q` (Q4_K/Q5_K dequantize: a
/// multiply then a subtract, no FMA, exactly as the reference rounds).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn store_scaled_u8_minus(y: &mut [f32], q: __m128i, d: f32, m: f32) {
    let v = _mm256_mul_ps(
        _mm256_set1_ps(d),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)),
    );
    store_ps(y, _mm256_sub_ps(v, _mm256_set1_ps(m)));
}

/// The four 8-byte quarters of a 32-byte register, each in the low half of an `__m128i`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn quarters(v: __m256i) -> [__m128i; 4] {
    let lo = _mm256_castsi256_si128(v);
    let hi = _mm256_extracti128_si256::<1>(v);
    [
        lo,
        _mm_unpackhi_epi64(lo, lo),
        hi,
        _mm_unpackhi_epi64(hi, hi),
    ]
}

/// Little-endian f16 bits → f32 (F16C).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn f16_to_f32(lo: u8, hi: u8) -> f32 {
    let bits = i32::from(u16::from_le_bytes([lo, hi]));
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
}

/// How far ahead of the block being decoded the weight stream is prefetched; 0: not at all.
/// An earlier machine's hardware prefetcher alone left a Q4_K row stream at ~60% of the
/// single-core read bandwidth, and 2 KiB ahead reached it. On the Zen 4 EPYC of 2026-12-07
/// software prefetching only cost: one thread streaming 512 MiB read 26 GB/s without it and
/// 21-24 GB/s with it 1-16 KiB ahead, and qwen3-8b Q4_K_M decoded 4.12 / 6.99 tok/s (1 / 2
/// threads) without it against 3.95 / 6.68 with 2 KiB (IQ4_XS gained 4.06 -> 4.29 at one
/// thread, Q3_K_M was level). Off, until a machine shows it helps.
const PREFETCH_DISTANCE: usize = 0;

/// Prefetches (into L1) the cache lines `PREFETCH_DISTANCE` bytes past `block`: one per
/// 64 bytes of block, so a stream of consecutive blocks touches every line ahead of use.
/// Prefetching never faults; past the end of the row it fetches the next weight row, which
/// is what a matrix product reads next.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn prefetch_ahead<const B: usize>(block: &[u8; B]) {
    if PREFETCH_DISTANCE == 0 {
        return;
    }
    let p = block.as_ptr().wrapping_add(PREFETCH_DISTANCE);
    let mut off = 0;
    while off < B {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off).cast());
        off += 64;
    }
}

/// Sum of the eight i32 lanes (exact: a block's sums cannot overflow).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s)))
}

/// The lane sums of `a` and of `b`, reduced together (exact, as `hsum_epi32`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum2_epi32(a: __m256i, b: __m256i) -> (i32, i32) {
    // a0+a1 a2+a3 b0+b1 b2+b3 | a4+a5 a6+a7 b4+b5 b6+b7
    let h = _mm256_hadd_epi32(a, b);
    let s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
    let s = _mm_hadd_epi32(s, s);
    (_mm_cvtsi128_si32(s), _mm_extract_epi32::<1>(s))
}

/// Lane b of the result is the sum of `v[b]`'s lanes (exact, as `hsum_epi32`): four blocks'
/// integers reduced together at about the price of one.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum4_epi32(v: [__m256i; 4]) -> __m128i {
    let a = _mm256_hadd_epi32(v[0], v[1]);
    let b = _mm256_hadd_epi32(v[2], v[3]);
    let c = _mm256_hadd_epi32(a, b);
    _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256::<1>(c))
}

/// Four f16 values (little-endian byte pairs at `off` of four blocks) as four f32 lanes: one
/// conversion from a register built in integer registers (four scalar stores read back as one
/// vector would stall on store forwarding).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn f16x4<const B: usize>(blocks: &[[u8; B]], off: usize) -> __m128 {
    let mut bits = 0u64;
    for (k, b) in blocks[..4].iter().enumerate() {
        bits |= u64::from(u16::from_le_bytes([b[off], b[off + 1]])) << (16 * k);
    }
    _mm_cvtph_ps(_mm_cvtsi64_si128(bits as i64))
}

/// The scales `d` of four activation blocks as four f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn act_d4(a: &[[u8; BLOCK_BYTES]]) -> __m128 {
    _mm_setr_ps(
        crate::quants::q8_k::d_of(&a[0]),
        crate::quants::q8_k::d_of(&a[1]),
        crate::quants::q8_k::d_of(&a[2]),
        crate::quants::q8_k::d_of(&a[3]),
    )
}

/// Adds the four lanes of `t` to `sum` in lane order: four blocks' float terms, computed
/// in one register, summed in block order as the reference does.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn add_in_order(mut sum: f32, t: __m128) -> f32 {
    // SAFETY: a register of four f32 is four f32.
    let t = unsafe { std::mem::transmute::<__m128, [f32; 4]>(t) };
    for v in t {
        sum += v;
    }
    sum
}

/// Dequantize whole Q8_K blocks (`y = d * q`, as the reference).
pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_dequantize(src, BLOCK_BYTES, dst);
    debug_assert!(super::available());
    // SAFETY: this entry is installed by `specialize` only after `available()` found
    // AVX2, FMA and F16C; the slices were checked to hold `nb` blocks.
    unsafe { dequantize_avx2(&src[..nb * BLOCK_BYTES], &mut dst[..nb * QK_K]) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_avx2(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for c in 0..QK_K / 32 {
            let q = quarters(load32(&b[QS + 32 * c..]));
            for (t, qt) in q.into_iter().enumerate() {
                store_scaled_i8(&mut y[32 * c + 8 * t..], qt, d);
            }
        }
    }
}

/// Quantize whole blocks to Q8_K, byte-identical to `quants::q8_k::quantize` for finite
/// input (the scan for the largest magnitude, `iscale = -128 / max`, the f32 product, round
/// half to even and the clamp at 127 are the same operations).
pub(super) fn quantize(src: &[f32], dst: &mut [u8]) {
    let nb = check_quantize(src, dst, BLOCK_BYTES);
    debug_assert!(super::available());
    for (x, b) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
        .take(nb)
    {
        // SAFETY: installed by `specialize` only after `available()` found AVX2, FMA, F16C.
        unsafe { quantize_block(x, b) }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_block(x: &[f32], b: &mut [u8]) {
    assert!(x.len() == QK_K && b.len() == BLOCK_BYTES);
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    // Largest magnitude. `max_ps(v, acc)` keeps `acc` when `v` is NaN, as the reference's
    // `>` comparison skips NaN.
    let mut m = [_mm256_setzero_ps(); 4];
    for c in 0..QK_K / 32 {
        for (t, mt) in m.iter_mut().enumerate() {
            *mt = _mm256_max_ps(_mm256_and_ps(load_ps(&x[32 * c + 8 * t..]), abs_mask), *mt);
        }
    }
    let m = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
    let s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    let amax = _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
    if amax == 0.0 {
        b.fill(0);
        return;
    }
    // The first value of that magnitude, with its sign.
    let target = _mm256_set1_ps(amax);
    let mut max = amax;
    for c in 0..QK_K / 8 {
        let v = load_ps(&x[8 * c..]);
        let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(
            _mm256_and_ps(v, abs_mask),
            target,
        ));
        if hit != 0 {
            max = x[8 * c + hit.trailing_zeros() as usize];
            break;
        }
    }
    let iscale = -128.0 / max;
    let iv = _mm256_set1_ps(iscale);
    let top = _mm256_set1_epi32(127);
    // Lane order fix-up after the two in-lane packs.
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for c in 0..QK_K / 64 {
        let mut v = [_mm256_setzero_si256(); 8];
        for (t, vt) in v.iter_mut().enumerate() {
            // `cvtps_epi32` rounds half to even under the default MXCSR, as the reference.
            let q = _mm256_cvtps_epi32(_mm256_mul_ps(iv, load_ps(&x[64 * c + 8 * t..])));
            *vt = _mm256_min_epi32(q, top);
        }
        for h in 0..2 {
            let ab = _mm256_packs_epi32(v[4 * h], v[4 * h + 1]);
            let cd = _mm256_packs_epi32(v[4 * h + 2], v[4 * h + 3]);
            let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), perm);
            let off = QS + 64 * c + 32 * h;
            // SAFETY: `off + 32 <= QS + QK_K <= BLOCK_BYTES == b.len()`; no alignment needed.
            unsafe { _mm256_storeu_si256(b[off..off + 32].as_mut_ptr().cast(), bytes) };
        }
        // bsums of the four runs of 16: s_k = v[2k] + v[2k+1], summed across lanes.
        let s0 = _mm256_add_epi32(v[0], v[1]);
        let s1 = _mm256_add_epi32(v[2], v[3]);
        let s2 = _mm256_add_epi32(v[4], v[5]);
        let s3 = _mm256_add_epi32(v[6], v[7]);
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
        let sums = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        let packed = _mm_packs_epi32(sums, sums);
        let off = BSUMS + 8 * c;
        b[off..off + 8].copy_from_slice(&_mm_cvtsi128_si64(packed).to_le_bytes());
    }
    b[..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
}

/// The decode dot of a format with one f16 scale per block (at byte `$d`), given the block's
/// exact integer lanes by `$ints(weight block, activation block)`: blocks in fours, their
/// integers reduced together (`hsum4_epi32`) and their float terms `ad · d · sumi` in the
/// lanes of one register, added in block order; the reference's steps, so its bits. A macro,
/// so the integer step inlines at the caller's kernel level.
macro_rules! dot_in_fours {
    ($w:expr, $a:expr, $d:expr, $ints:expr) => {{
        let (w, a) = ($w, $a);
        assert!(a.len() >= w.len());
        let ints = $ints;
        let mut sum = 0f32;
        let mut i = 0;
        while i + 4 <= w.len() {
            let mut si = [_mm256_setzero_si256(); 4];
            for b in 0..4 {
                super::q8_k::prefetch_ahead(&w[i + b]);
                si[b] = ints(&w[i + b], &a[i + b]);
            }
            let d = super::q8_k::f16x4(&w[i..], $d);
            let ad = super::q8_k::act_d4(&a[i..]);
            let t = _mm_mul_ps(
                _mm_mul_ps(ad, d),
                _mm_cvtepi32_ps(super::q8_k::hsum4_epi32(si)),
            );
            sum = super::q8_k::add_in_order(sum, t);
            i += 4;
        }
        for (wb, ab) in w[i..].iter().zip(&a[i..]) {
            let d = super::q8_k::f16_to_f32(wb[$d], wb[$d + 1]);
            sum += crate::quants::q8_k::d_of(ab) * d * super::q8_k::hsum_epi32(ints(wb, ab)) as f32;
        }
        sum
    }};
}
pub(super) use dot_in_fours;

/// `vec_dot_multi512`: `vec_dot_multi` through the file's `dot_rows512::<R>`, 8 activation
/// rows at a time, then 4, then 1 (the avx512 level: installed only once AVX-512 F/BW/VL were
/// detected). One definition for every K-quant file that has a `dot_rows512`.
macro_rules! multi512 {
    ($wb:expr, $ab:expr) => {
        pub(super) fn vec_dot_multi512(
            n: usize,
            w: &[u8],
            a: &[u8],
            a_stride: usize,
            out: &mut [f32],
        ) {
            let nb = check_dot_multi(n, w, $wb, a, a_stride, out.len());
            debug_assert!(super::gemm512::available());
            let w = blocks::<{ $wb }>(w, nb);
            let row = |r: usize| blocks::<{ $ab }>(&a[r * a_stride..], nb);
            let mut r = 0;
            while r < out.len() {
                let left = out.len() - r;
                // SAFETY: installed only after detection found the features; `row` checks
                // each row holds `nb` blocks.
                unsafe {
                    if left >= 8 {
                        let rows = std::array::from_fn::<_, 8, _>(|k| row(r + k));
                        out[r..r + 8].copy_from_slice(&dot_rows512::<8>(w, rows));
                        r += 8;
                    } else if left >= 4 {
                        let rows = std::array::from_fn::<_, 4, _>(|k| row(r + k));
                        out[r..r + 4].copy_from_slice(&dot_rows512::<4>(w, rows));
                        r += 4;
                    } else {
                        let [v] = dot_rows512::<1>(w, [row(r)]);
                        out[r] = v;
                        r += 1;
                    }
                }
            }
        }
    };
}
pub(super) use multi512;

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::quants::q8_k as reference;
    use half::f16;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    type Deq = fn(&[u8], &mut [f32]);
    type Dot = fn(usize, &[u8], &[u8]) -> f32;
    type Multi = fn(usize, &[u8], &[u8], usize, &mut [f32]);

    /// `nb` blocks of arbitrary bytes (every bit pattern of levels and scales), with the f16
    /// fields at `f16_at` set to finite values of either sign.
    fn random_blocks(rng: &mut StdRng, nb: usize, block: usize, f16_at: &[usize]) -> Vec<u8> {
        let mut w: Vec<u8> = (0..nb * block).map(|_| rng.random()).collect();
        for b in w.chunks_exact_mut(block) {
            for &o in f16_at {
                let v = rng.random_range(1e-3f32..2.0) * if rng.random() { 1.0 } else { -1.0 };
                b[o..o + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
        w
    }

    /// Q8_K rows with many extreme quants (-128, 127) and consistent `bsums`.
    fn random_q8k(rng: &mut StdRng, nb: usize) -> Vec<u8> {
        let mut a = vec![0u8; nb * BLOCK_BYTES];
        for b in a.chunks_exact_mut(BLOCK_BYTES) {
            let q: Vec<i8> = (0..QK_K)
                .map(|_| match rng.random_range(0..4) {
                    0 => -128,
                    1 => 127,
                    _ => rng.random(),
                })
                .collect();
            for (i, v) in q.iter().enumerate() {
                b[QS + i] = *v as u8;
            }
            for j in 0..16 {
                let s: i32 = q[16 * j..16 * j + 16].iter().map(|v| i32::from(*v)).sum();
                b[BSUMS + 2 * j..BSUMS + 2 * j + 2].copy_from_slice(&(s as i16).to_le_bytes());
            }
            b[..4].copy_from_slice(&rng.random_range(-0.1f32..0.1).to_le_bytes());
        }
        a
    }

    /// The AVX2 `deq`/`dot`/`multi` against the reference `ref_deq`/`ref_dot` on random
    /// blocks: dequantize bit-exact, dot within 1e-5 of Σ|w·a|, tiled equal to single.
    pub(in crate::avx2) fn check_against_reference(
        block: usize,
        f16_at: &[usize],
        (ref_deq, ref_dot): (Deq, Dot),
        (deq, dot, multi): (Deq, Dot, Multi),
    ) {
        if !super::super::available() {
            return;
        }
        let mut rng = StdRng::seed_from_u64(block as u64);
        for nb in [1, 3, 8] {
            let n = nb * QK_K;
            let w = random_blocks(&mut rng, nb, block, f16_at);
            let mut want = vec![0f32; n];
            let mut got = vec![1f32; n];
            ref_deq(&w, &mut want);
            deq(&w, &mut got);
            assert_eq!(got, want, "dequantize, {nb} blocks");
            let rows = 9;
            let stride = nb * BLOCK_BYTES + 4 * (nb % 2); // a stride longer than a row
            let mut acts = vec![0u8; rows * stride];
            for r in 0..rows {
                acts[r * stride..r * stride + nb * BLOCK_BYTES]
                    .copy_from_slice(&random_q8k(&mut rng, nb));
            }
            let mut af = vec![0f32; n];
            let mut single = vec![0f32; rows];
            for (r, s) in single.iter_mut().enumerate() {
                let a = &acts[r * stride..r * stride + nb * BLOCK_BYTES];
                reference::dequantize(a, &mut af);
                let mag: f64 = want
                    .iter()
                    .zip(&af)
                    .map(|(x, y)| f64::from(x * y).abs())
                    .sum();
                let (r_ref, r_simd) = (ref_dot(n, &w, a), dot(n, &w, a));
                let err = (f64::from(r_simd) - f64::from(r_ref)).abs() / mag;
                assert!(
                    err <= 1e-5,
                    "{nb} blocks row {r}: {r_simd} vs {r_ref} ({err})"
                );
                *s = r_simd;
            }
            for k in 0..=rows {
                let mut out = vec![0f32; k];
                multi(n, &w, &acts, stride, &mut out);
                assert_eq!(out[..], single[..k], "{k} rows");
            }
        }
    }

    /// The AVX2 `dot`/`multi` of a format whose reference is integer-exact per block: equal
    /// to `ref_dot` bit for bit on random blocks (every bit pattern of levels and scales) and
    /// extreme activations, the tiled form equal to the single one for 0..=9 rows.
    pub(in crate::avx2) fn check_exact(
        block: usize,
        f16_at: &[usize],
        ref_dot: Dot,
        (dot, multi): (Dot, Multi),
    ) {
        if !super::super::available() {
            return;
        }
        let mut rng = StdRng::seed_from_u64(block as u64 + 7);
        for nb in [1, 3, 8] {
            let n = nb * QK_K;
            let w = random_blocks(&mut rng, nb, block, f16_at);
            let rows = 9;
            let stride = nb * BLOCK_BYTES + 4 * (nb % 2);
            let mut acts = vec![0u8; rows * stride];
            for r in 0..rows {
                acts[r * stride..r * stride + nb * BLOCK_BYTES]
                    .copy_from_slice(&random_q8k(&mut rng, nb));
            }
            let single: Vec<u32> = (0..rows)
                .map(|r| {
                    let a = &acts[r * stride..r * stride + nb * BLOCK_BYTES];
                    let (want, got) = (ref_dot(n, &w, a), dot(n, &w, a));
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{nb} blocks row {r}: {got} vs {want}"
                    );
                    got.to_bits()
                })
                .collect();
            for k in 0..=rows {
                let mut out = vec![0f32; k];
                multi(n, &w, &acts, stride, &mut out);
                let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got[..], single[..k], "{k} rows");
            }
        }
    }

    /// A multi-row kernel of another level (`multi`) gives `dot`'s bits for every row count
    /// 0..=19 (the 8-, 4- and 1-row paths and their mixes), at 1, 3 and 8 blocks.
    pub(in crate::avx2) fn check_multi_bits(
        block: usize,
        f16_at: &[usize],
        dot: Dot,
        multi: Multi,
    ) {
        if !super::super::gemm512::available() {
            eprintln!("SKIPPED check_multi_bits: this CPU lacks AVX-512 F/BW/VL/VNNI");
            return;
        }
        let mut rng = StdRng::seed_from_u64(block as u64 + 1);
        for nb in [1, 3, 8] {
            let n = nb * QK_K;
            let w = random_blocks(&mut rng, nb, block, f16_at);
            let rows = 19;
            let stride = nb * BLOCK_BYTES + 4;
            let mut acts = vec![0u8; rows * stride];
            for r in 0..rows {
                acts[r * stride..r * stride + nb * BLOCK_BYTES]
                    .copy_from_slice(&random_q8k(&mut rng, nb));
            }
            let single: Vec<u32> = (0..rows)
                .map(|r| dot(n, &w, &acts[r * stride..r * stride + nb * BLOCK_BYTES]).to_bits())
                .collect();
            for k in 0..=rows {
                let mut out = vec![0f32; k];
                multi(n, &w, &acts, stride, &mut out);
                let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got[..], single[..k], "{k} rows, {nb} blocks");
            }
        }
    }

    #[test]
    fn quantize_is_byte_identical_to_reference() {
        if !super::super::available() {
            return;
        }
        let mut rng = StdRng::seed_from_u64(99);
        let n = 16 * QK_K;
        let mut inputs: Vec<Vec<f32>> = Vec::new();
        for scale in [1e-3f32, 1.0, 37.0, 1e4] {
            inputs.push(
                (0..n)
                    .map(|_| (rng.random::<f32>() - 0.5) * scale)
                    .collect(),
            );
        }
        // Ties between +max and -max, exact halves, zero and sign-only blocks.
        let mut x: Vec<f32> = (0..n).map(|i| ((i % 257) as f32 - 128.0) * 0.5).collect();
        x[QK_K..2 * QK_K].fill(0.0);
        x[2 * QK_K..3 * QK_K].fill(-0.0);
        x[3 * QK_K + 5] = 64.0;
        x[3 * QK_K + 9] = -64.0;
        inputs.push(x);
        let mut y = vec![3.0f32; n];
        y[7] = -3.0;
        inputs.push(y);
        for x in &inputs {
            let mut want = vec![0xaau8; n / QK_K * BLOCK_BYTES];
            let mut got = vec![0x55u8; want.len()];
            reference::quantize(x, &mut want);
            quantize(x, &mut got);
            assert_eq!(got, want);
            let mut dw = vec![0f32; n];
            let mut dg = vec![1f32; n];
            reference::dequantize(&want, &mut dw);
            dequantize(&got, &mut dg);
            assert_eq!(dg, dw);
        }
    }
}
