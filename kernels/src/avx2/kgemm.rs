//! The K-quants' prefill GEMM over tiles of unpacked weight rows (`crate::ktile`).
//!
//! A tile holds 16 weight rows; one register holds a 4-element group of 8 (AVX2) or 16
//! (AVX-512) of them, one i32 lane per row. Each activation row contributes its 4 quants of
//! the group broadcast to every lane, and `vpdpbusd` (or `maddubs` + `madd` without VNNI)
//! adds the 4 products into each row's lane. Per sub-block the lanes are multiplied by the
//! rows' scales; per block the Q8_K block sums meet the rows' mins or bias (`vpdpwssd` or
//! `madd`), and the block's float steps are the reference's, lane by lane, in block order
//! (multiplies, a subtraction, an add: no FMA). Every result has the bits of the reference
//! `vec_dot`.

use crate::ktile::{
    check_shapes, Iq4Xs, KQuant, KTile, GROUPS, PAIRS, Q2K, Q3K, Q4K, Q5K, Q6K, ROWS,
};
use crate::quants::iq4_nl::KVALUES;
use crate::quants::q8_k::{BLOCK_BYTES as AB, BSUMS, QS};
use crate::types::QK_K;
use std::arch::x86_64::*;
use std::cell::RefCell;

/// `KQuant::codes` with AVX2 (every level that runs these kernels has it): a tile is built
/// once per matrix product from every weight block, so its unpacking must keep up with the
/// GEMM (in scalar it took 30% of an IQ4_XS prefill).
pub(super) trait SimdCodes: KQuant {
    fn simd_codes(b: &[u8], out: &mut [u32; GROUPS]);
}

/// 32 bytes of `b` from `at`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld(b: &[u8], at: usize) -> __m256i {
    let s = &b[at..at + 32];
    // SAFETY: `s` holds the 32 bytes read.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// Stores codes of elements `e..e + 32`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn st(out: &mut [u32; GROUPS], e: usize, v: __m256i) {
    assert!(e + 32 <= 4 * GROUPS);
    // SAFETY: bytes e..e + 32 of the 256-byte array (checked above).
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast::<u8>().add(e).cast(), v) }
}

/// Each byte of `v` shifted right by `n` (`n` < 8; bits from the neighbour byte masked by
/// the caller).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn shr(v: __m256i, n: usize) -> __m256i {
    _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn codes_q4k(b: &[u8], out: &mut [u32; GROUPS]) {
    let m4 = _mm256_set1_epi8(0x0f);
    for k in 0..4 {
        let x = ld(b, 16 + 32 * k);
        st(out, 64 * k, _mm256_and_si256(x, m4));
        st(out, 64 * k + 32, _mm256_and_si256(shr(x, 4), m4));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn codes_q5k(b: &[u8], out: &mut [u32; GROUPS]) {
    let (m4, m1) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(1));
    let qh = ld(b, 16);
    let fifth = |bit: usize| _mm256_slli_epi16::<4>(_mm256_and_si256(shr(qh, bit), m1));
    for k in 0..4 {
        let x = ld(b, 48 + 32 * k);
        st(
            out,
            64 * k,
            _mm256_or_si256(_mm256_and_si256(x, m4), fifth(2 * k)),
        );
        let hi = _mm256_and_si256(shr(x, 4), m4);
        st(out, 64 * k + 32, _mm256_or_si256(hi, fifth(2 * k + 1)));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn codes_q6k(b: &[u8], out: &mut [u32; GROUPS]) {
    let (m4, m2) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(3));
    for h in 0..2 {
        let qh = ld(b, 128 + 32 * h);
        for k in 0..4 {
            let x = ld(b, 64 * h + 32 * (k % 2));
            let low = _mm256_and_si256(if k < 2 { x } else { shr(x, 4) }, m4);
            let high = _mm256_and_si256(shr(qh, 2 * k), m2);
            st(
                out,
                128 * h + 32 * k,
                _mm256_or_si256(low, _mm256_slli_epi16::<4>(high)),
            );
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn codes_q3k(b: &[u8], out: &mut [u32; GROUPS]) {
    let (m2, m1) = (_mm256_set1_epi8(3), _mm256_set1_epi8(1));
    let hm = ld(b, 0);
    for h in 0..2 {
        let x = ld(b, 32 + 32 * h);
        for k in 0..4 {
            let low = _mm256_and_si256(shr(x, 2 * k), m2);
            let high = _mm256_and_si256(shr(hm, 4 * h + k), m1);
            st(
                out,
                128 * h + 32 * k,
                _mm256_or_si256(low, _mm256_slli_epi16::<2>(high)),
            );
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn codes_q2k(b: &[u8], out: &mut [u32; GROUPS]) {
    let m2 = _mm256_set1_epi8(3);
    for h in 0..2 {
        let x = ld(b, 16 + 32 * h);
        for k in 0..4 {
            st(out, 128 * h + 32 * k, _mm256_and_si256(shr(x, 2 * k), m2));
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn codes_iq4xs(b: &[u8], out: &mut [u32; GROUPS]) {
    let m4 = _mm256_set1_epi8(0x0f);
    let table: [u8; 16] = KVALUES.map(|v| (i16::from(v) + 128) as u8);
    // SAFETY: `table` holds the 16 bytes read.
    let table = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(table.as_ptr().cast()) });
    // Two sub-blocks per load: the low nibbles of each 128-bit lane are its first 16
    // elements, the high nibbles the next 16.
    for p in 0..4 {
        let x = ld(b, crate::quants::iq4_xs::QS + 32 * p);
        let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(x, m4));
        let hi = _mm256_shuffle_epi8(table, _mm256_and_si256(shr(x, 4), m4));
        st(out, 64 * p, _mm256_permute2x128_si256::<0x20>(lo, hi));
        st(out, 64 * p + 32, _mm256_permute2x128_si256::<0x31>(lo, hi));
    }
}

macro_rules! simd_codes {
    ($t:ty, $f:ident) => {
        impl SimdCodes for $t {
            fn simd_codes(b: &[u8], out: &mut [u32; GROUPS]) {
                assert!(b.len() >= <$t>::BLOCK);
                debug_assert!(super::available());
                // SAFETY: the kernels that build tiles are installed only after detection
                // found AVX2, FMA and F16C.
                unsafe { $f(b, out) }
            }
        }
    };
}
simd_codes!(Q4K, codes_q4k);
simd_codes!(Q5K, codes_q5k);
simd_codes!(Q6K, codes_q6k);
simd_codes!(Q3K, codes_q3k);
simd_codes!(Q2K, codes_q2k);
simd_codes!(Iq4Xs, codes_iq4xs);

thread_local! {
    /// Each pool thread's tile, grown to the widest matrix once.
    static TILE: RefCell<KTile> = RefCell::new(KTile::default());
}

/// Asks for weight rows `rows` (each `len` bytes, `stride` apart) in L2: the next tile's
/// rows arrive while this tile meets every activation row (its unpacking otherwise waits on
/// memory at each block).
#[inline]
fn prefetch_rows(w: &[u8], stride: usize, rows: std::ops::Range<usize>, len: usize) {
    for r in rows {
        let row = &w[r * stride..r * stride + len];
        for line in row.chunks(64) {
            // SAFETY: a prefetch of an address inside `w`; SSE is part of x86_64.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
        }
    }
}

/// The i32 at `p` (unaligned).
#[inline(always)]
unsafe fn i32_at(p: *const u8) -> i32 {
    // SAFETY: the caller keeps `p..p + 4` inside an activation block.
    unsafe { std::ptr::read_unaligned(p.cast::<i32>()) }
}

/// The f32 at `p` (unaligned).
#[inline(always)]
unsafe fn f32_at(p: *const u8) -> f32 {
    // SAFETY: as `i32_at`.
    unsafe { std::ptr::read_unaligned(p.cast::<f32>()) }
}

/// The 16 rows of `t` against `C` activation rows (`a` at the first, `stride` apart), 512
/// bits wide: the results, one register per activation row, lane r = weight row r.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI available; each of the `C` rows holds `t.nb` Q8_K blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile512<T: KQuant, const C: usize>(
    t: &KTile,
    a: *const u8,
    stride: usize,
) -> [__m512; C] {
    let nsub = QK_K / T::SUB;
    let per_sub = T::SUB / 4;
    let mut acc = [_mm512_setzero_ps(); C];
    for i in 0..t.nb {
        // SAFETY (every pointer below): block i of the tile's buffers (built for `t.nb`
        // blocks) and of each activation row (caller).
        // SAFETY: inside block i of the tile's buffers, which hold `t.nb` blocks.
        let codes = unsafe { t.codes.as_ptr().add(i * GROUPS * ROWS) };
        // SAFETY: block i of the first activation row (the caller's rows hold `t.nb` blocks).
        let blk = unsafe { a.add(i * AB) };
        let mut s1 = [_mm512_setzero_si512(); C];
        for j in 0..nsub {
            let mut raw = [_mm512_setzero_si512(); C];
            for k in 0..per_sub {
                let g = j * per_sub + k;
                // SAFETY: inside block i of the tile's buffers, which hold `t.nb` blocks.
                let w = unsafe { _mm512_loadu_si512(codes.add(g * ROWS).cast()) };
                for c in 0..C {
                    // SAFETY: inside block i of activation row c (the caller's rows hold `t.nb` blocks).
                    let q = unsafe { i32_at(blk.add(c * stride + QS + 4 * g)) };
                    raw[c] = _mm512_dpbusd_epi32(raw[c], w, _mm512_set1_epi32(q));
                }
            }
            // SAFETY: inside block i of the tile's buffers, which hold `t.nb` blocks.
            let sv = unsafe { _mm512_loadu_si512(t.sc.as_ptr().add((i * nsub + j) * ROWS).cast()) };
            for c in 0..C {
                s1[c] = _mm512_add_epi32(s1[c], _mm512_mullo_epi32(raw[c], sv));
            }
        }
        let mut corr = [_mm512_setzero_si512(); C];
        for p in 0..PAIRS {
            let cv =
                // SAFETY: inside block i of the tile's buffers, which hold `t.nb` blocks.
                unsafe { _mm512_loadu_si512(t.coef.as_ptr().add((i * PAIRS + p) * ROWS).cast()) };
            for c in 0..C {
                // SAFETY: inside block i of activation row c (the caller's rows hold `t.nb` blocks).
                let bs = unsafe { i32_at(blk.add(c * stride + BSUMS + 4 * p)) };
                corr[c] = _mm512_dpwssd_epi32(corr[c], cv, _mm512_set1_epi32(bs));
            }
        }
        // SAFETY: inside block i of the tile's buffers, which hold `t.nb` blocks.
        let d = unsafe { _mm512_loadu_ps(t.d.as_ptr().add(i * ROWS)) };
        // SAFETY: inside block i of the tile's buffers, which hold `t.nb` blocks.
        let dmin = unsafe { _mm512_loadu_ps(t.dmin.as_ptr().add(i * ROWS)) };
        for c in 0..C {
            // SAFETY: inside block i of activation row c (the caller's rows hold `t.nb` blocks).
            let ad = _mm512_set1_ps(unsafe { f32_at(blk.add(c * stride)) });
            let x = if T::HAS_MIN {
                _mm512_sub_ps(
                    _mm512_mul_ps(_mm512_mul_ps(ad, d), _mm512_cvtepi32_ps(s1[c])),
                    _mm512_mul_ps(_mm512_mul_ps(ad, dmin), _mm512_cvtepi32_ps(corr[c])),
                )
            } else {
                _mm512_mul_ps(
                    _mm512_mul_ps(ad, d),
                    _mm512_cvtepi32_ps(_mm512_sub_epi32(s1[c], corr[c])),
                )
            };
            acc[c] = _mm512_add_ps(acc[c], x);
        }
    }
    acc
}

/// `TypeKernels::kgemm` with AVX-512: tiles of 16 rows against 8 activation rows at a time.
#[allow(clippy::too_many_arguments)]
pub(super) fn kgemm512<T: SimdCodes>(
    n: usize,
    w: &[u8],
    w_stride: usize,
    n_w: usize,
    a: &[u8],
    a_stride: usize,
    n_a: usize,
    store: &mut dyn FnMut(usize, usize, &[f32]),
) {
    let nb = check_shapes(
        "kgemm512",
        n,
        T::BLOCK,
        w.len(),
        w_stride,
        n_w,
        a.len(),
        a_stride,
        n_a,
    );
    debug_assert!(super::gemm512::available());
    TILE.with_borrow_mut(|t| {
        for o0 in (0..n_w).step_by(ROWS) {
            let rows = (n_w - o0).min(ROWS);
            t.build::<T>(
                &w[o0 * w_stride..],
                w_stride,
                rows,
                nb,
                T::simd_codes,
                false,
            );
            prefetch_rows(
                w,
                w_stride,
                o0 + ROWS..n_w.min(o0 + 2 * ROWS),
                nb * T::BLOCK,
            );
            let mut c = 0;
            macro_rules! step {
                ($cols:literal) => {{
                    // SAFETY: detection found the features (the table installs this only
                    // then); rows c..c + $cols hold `nb` blocks (checked above).
                    let acc =
                        // SAFETY: inside block i of the tile's buffers, which hold `t.nb` blocks.
                        unsafe { tile512::<T, $cols>(t, a.as_ptr().add(c * a_stride), a_stride) };
                    for (k, v) in acc.iter().enumerate() {
                        // SAFETY: a register of 16 f32 is 16 f32.
                        let out = unsafe { std::mem::transmute::<__m512, [f32; ROWS]>(*v) };
                        store(c + k, o0, &out[..rows]);
                    }
                    c += $cols;
                }};
            }
            while c < n_a {
                match n_a - c {
                    8.. => step!(8),
                    4.. => step!(4),
                    2.. => step!(2),
                    _ => step!(1),
                }
            }
        }
    });
}

/// The integer dot step of the 256-bit kernel: `acc + Σ u·s` per i32 lane (four u8 × i8).
/// Groups of 4 codes whose `maddubs` pairs add up in i16 without overflow: each pair is at
/// most 2 · MAX_CODE · 128 in magnitude (8 groups for Q4_K, 2 for Q6_K).
const fn i16_groups(max_code: u32) -> usize {
    (32767 / (2 * 128 * max_code)) as usize
}

macro_rules! kgemm256 {
    ($feat:literal, $avail:path, $dot:path, $name:ident, $plain:literal) => {
        /// 8 rows of `t` (`half` 0 or 1) against `C` activation rows, 256 bits wide.
        ///
        /// # Safety
        /// The features available; each of the `C` rows holds `t.nb` Q8_K blocks.
        #[target_feature(enable = $feat)]
        #[allow(clippy::needless_range_loop)]
        unsafe fn tile256<T: KQuant, const C: usize>(
            t: &KTile,
            half: usize,
            a: *const u8,
            stride: usize,
        ) -> [__m256; C] {
            let nsub = QK_K / T::SUB;
            let per_sub = T::SUB / 4;
            let h = 8 * half;
            let mut acc = [_mm256_setzero_ps(); C];
            for i in 0..t.nb {
                // SAFETY (every pointer below): as `tile512`.
                // SAFETY: inside block i of the tile's buffers, which hold `t.nb` blocks.
                let codes = unsafe { t.codes.as_ptr().add(i * GROUPS * ROWS + h) };
                // SAFETY: block i of the first activation row (the caller's rows hold `t.nb` blocks).
                let blk = unsafe { a.add(i * AB) };
                let mut s1 = [_mm256_setzero_si256(); C];
                for j in 0..nsub {
                    let mut raw = [_mm256_setzero_si256(); C];
                    if $plain {
                        // Without VNNI: the `maddubs` pairs of several groups added in i16
                        // (exact: `i16_groups`), widened by one `madd` per run.
                        let run = i16_groups(T::MAX_CODE).clamp(1, per_sub);
                        let ones = _mm256_set1_epi16(1);
                        for k0 in (0..per_sub).step_by(run) {
                            let mut p16 = [_mm256_setzero_si256(); C];
                            for k in k0..(k0 + run).min(per_sub) {
                                let g = j * per_sub + k;
                                // SAFETY: inside block i of the tile's buffers, which hold `t.nb` blocks.
                                let w = unsafe { _mm256_loadu_si256(codes.add(g * ROWS).cast()) };
                                for c in 0..C {
                                    // SAFETY: inside block i of activation row c (the caller's rows hold `t.nb` blocks).
                                    let q = unsafe { i32_at(blk.add(c * stride + QS + 4 * g)) };
                                    let p = _mm256_maddubs_epi16(w, _mm256_set1_epi32(q));
                                    p16[c] = _mm256_add_epi16(p16[c], p);
                                }
                            }
                            for c in 0..C {
                                raw[c] = _mm256_add_epi32(raw[c], _mm256_madd_epi16(p16[c], ones));
                            }
                        }
                    } else {
                        for k in 0..per_sub {
                            let g = j * per_sub + k;
                            // SAFETY: inside block i of the tile's buffers, which hold `t.nb` blocks.
                            let w = unsafe { _mm256_loadu_si256(codes.add(g * ROWS).cast()) };
                            for c in 0..C {
                                // SAFETY: inside block i of activation row c (the caller's rows hold `t.nb` blocks).
                                let q = unsafe { i32_at(blk.add(c * stride + QS + 4 * g)) };
                                raw[c] = $dot(raw[c], w, _mm256_set1_epi32(q));
                            }
                        }
                    }
                    // SAFETY: inside block i of the tile's buffers, which hold `t.nb` blocks.
                    let sv = unsafe {
                        _mm256_loadu_si256(t.sc.as_ptr().add((i * nsub + j) * ROWS + h).cast())
                    };
                    for c in 0..C {
                        s1[c] = _mm256_add_epi32(s1[c], _mm256_mullo_epi32(raw[c], sv));
                    }
                }
                let mut corr = [_mm256_setzero_si256(); C];
                for p in 0..PAIRS {
                    // SAFETY: inside block i of the tile's buffers, which hold `t.nb` blocks.
                    let cv = unsafe {
                        _mm256_loadu_si256(t.coef.as_ptr().add((i * PAIRS + p) * ROWS + h).cast())
                    };
                    for c in 0..C {
                        // SAFETY: inside block i of activation row c (the caller's rows hold `t.nb` blocks).
                        let bs = unsafe { i32_at(blk.add(c * stride + BSUMS + 4 * p)) };
                        corr[c] =
                            _mm256_add_epi32(corr[c], _mm256_madd_epi16(cv, _mm256_set1_epi32(bs)));
                    }
                }
                // SAFETY: inside block i of the tile's buffers, which hold `t.nb` blocks.
                let d = unsafe { _mm256_loadu_ps(t.d.as_ptr().add(i * ROWS + h)) };
                // SAFETY: inside block i of the tile's buffers, which hold `t.nb` blocks.
                let dmin = unsafe { _mm256_loadu_ps(t.dmin.as_ptr().add(i * ROWS + h)) };
                for c in 0..C {
                    // SAFETY: inside block i of activation row c (the caller's rows hold `t.nb` blocks).
                    let ad = _mm256_set1_ps(unsafe { f32_at(blk.add(c * stride)) });
                    let x = if T::HAS_MIN {
                        _mm256_sub_ps(
                            _mm256_mul_ps(_mm256_mul_ps(ad, d), _mm256_cvtepi32_ps(s1[c])),
                            _mm256_mul_ps(_mm256_mul_ps(ad, dmin), _mm256_cvtepi32_ps(corr[c])),
                        )
                    } else {
                        _mm256_mul_ps(
                            _mm256_mul_ps(ad, d),
                            _mm256_cvtepi32_ps(_mm256_sub_epi32(s1[c], corr[c])),
                        )
                    };
                    acc[c] = _mm256_add_ps(acc[c], x);
                }
            }
            acc
        }

        /// `TypeKernels::kgemm` on 256-bit registers: each half of a 16-row tile against 4
        /// activation rows at a time.
        #[allow(clippy::too_many_arguments)]
        pub(in crate::avx2) fn $name<T: SimdCodes>(
            n: usize,
            w: &[u8],
            w_stride: usize,
            n_w: usize,
            a: &[u8],
            a_stride: usize,
            n_a: usize,
            store: &mut dyn FnMut(usize, usize, &[f32]),
        ) {
            let nb = check_shapes(
                stringify!($name),
                n,
                T::BLOCK,
                w.len(),
                w_stride,
                n_w,
                a.len(),
                a_stride,
                n_a,
            );
            debug_assert!($avail());
            TILE.with_borrow_mut(|t| {
                for o0 in (0..n_w).step_by(ROWS) {
                    let rows = (n_w - o0).min(ROWS);
                    t.build::<T>(
                        &w[o0 * w_stride..],
                        w_stride,
                        rows,
                        nb,
                        T::simd_codes,
                        false,
                    );
                    prefetch_rows(
                        w,
                        w_stride,
                        o0 + ROWS..n_w.min(o0 + 2 * ROWS),
                        nb * T::BLOCK,
                    );
                    for half in 0..rows.div_ceil(8) {
                        let live = (rows - 8 * half).min(8);
                        let mut c = 0;
                        macro_rules! step {
                            ($cols:literal) => {{
                                // SAFETY: as `kgemm512`.
                                let acc = unsafe {
                                    tile256::<T, $cols>(
                                        t,
                                        half,
                                        a.as_ptr().add(c * a_stride),
                                        a_stride,
                                    )
                                };
                                for (k, v) in acc.iter().enumerate() {
                                    // SAFETY: a register of 8 f32 is 8 f32.
                                    let out =
                                        // SAFETY: a register of f32 lanes has the layout of the array.
                                        unsafe { std::mem::transmute::<__m256, [f32; 8]>(*v) };
                                    store(c + k, o0 + 8 * half, &out[..live]);
                                }
                                c += $cols;
                            }};
                        }
                        while c < n_a {
                            match n_a - c {
                                4.. => step!(4),
                                2.. => step!(2),
                                _ => step!(1),
                            }
                        }
                    }
                }
            });
        }
    };
}

/// `maddubs` then `madd` by ones, added: AVX2's u8 × i8 step. Exact for codes below 128
/// (a pair of products stays inside i16), which every K-quant but IQ4_XS has.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_avx2(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_add_epi32(
        acc,
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)),
    )
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
fn dot_avxvnni(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(acc, u, s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
fn dot_avx512vnni(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, u, s)
}

pub(super) mod plain {
    use super::*;
    kgemm256!(
        "avx2,fma,f16c",
        crate::avx2::available,
        dot_avx2,
        kgemm,
        true
    );
}

pub(super) mod avxvnni {
    use super::*;
    kgemm256!(
        "avx2,fma,f16c,avxvnni",
        crate::avx2::available_avxvnni,
        dot_avxvnni,
        kgemm,
        false
    );
}

pub(super) mod avx512vnni {
    use super::*;
    kgemm256!(
        "avx2,fma,f16c,avx512vnni,avx512vl",
        crate::avx2::available_avx512vnni,
        dot_avx512vnni,
        kgemm,
        false
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::KGemmFn;
    use crate::ktile::test_util::check_all;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn check_codes<T: SimdCodes>() {
        let mut rng = StdRng::seed_from_u64(T::BLOCK as u64 + 5);
        for _ in 0..50 {
            let b: Vec<u8> = (0..T::BLOCK).map(|_| rng.random()).collect();
            let (mut want, mut got) = ([0u32; GROUPS], [1u32; GROUPS]);
            T::codes(&b, &mut want);
            T::simd_codes(&b, &mut got);
            assert_eq!(got, want, "{} codes", std::any::type_name::<T>());
        }
    }

    #[test]
    fn simd_codes_are_the_scalar_codes() {
        if !super::super::available() {
            return;
        }
        check_codes::<Q4K>();
        check_codes::<Q5K>();
        check_codes::<Q6K>();
        check_codes::<Q3K>();
        check_codes::<Q2K>();
        check_codes::<Iq4Xs>();
    }

    #[test]
    fn avx512_gives_the_reference_bits() {
        if !super::super::gemm512::available() {
            return;
        }
        let k = [
            kgemm512::<Q4K> as KGemmFn,
            kgemm512::<Q5K>,
            kgemm512::<Q6K>,
            kgemm512::<Q3K>,
            kgemm512::<Q2K>,
            kgemm512::<Iq4Xs>,
        ];
        check_all(k.map(Some), 13);
    }

    #[test]
    fn avx2_gives_the_reference_bits() {
        if !super::super::available() {
            return;
        }
        check_all(
            [
                Some(plain::kgemm::<Q4K>),
                Some(plain::kgemm::<Q5K>),
                Some(plain::kgemm::<Q6K>),
                Some(plain::kgemm::<Q3K>),
                Some(plain::kgemm::<Q2K>),
                None,
            ],
            13,
        );
    }

    #[test]
    fn vnni_256_gives_the_reference_bits() {
        let k = match super::super::vnni() {
            Some(super::super::Vnni::Avx) => [
                avxvnni::kgemm::<Q4K> as KGemmFn,
                avxvnni::kgemm::<Q5K>,
                avxvnni::kgemm::<Q6K>,
                avxvnni::kgemm::<Q3K>,
                avxvnni::kgemm::<Q2K>,
                avxvnni::kgemm::<Iq4Xs>,
            ],
            Some(super::super::Vnni::Avx512) => [
                avx512vnni::kgemm::<Q4K> as KGemmFn,
                avx512vnni::kgemm::<Q5K>,
                avx512vnni::kgemm::<Q6K>,
                avx512vnni::kgemm::<Q3K>,
                avx512vnni::kgemm::<Q2K>,
                avx512vnni::kgemm::<Iq4Xs>,
            ],
            None => return,
        };
        check_all(k.map(Some), 13);
    }
}
