//! MXFP4 over repacked panels (`crate::repack::mxpanel`, `KPANEL` = 16 rows): one row in each
//! 32-bit lane. A 64-byte run of a group holds four code bytes of each of the 16 rows, so
//! one `vpdpbusd` (or `maddubs` pair) multiplies four codes of every row by the same four
//! activations (one broadcast). The codes go through the doubled E2M1 table plus `BIAS`, so
//! they are unsigned as `vpdpbusd` and `maddubs` want them; each lane starts at `−BIAS · Σa`
//! of the activation block, so it ends on the exact integer `block_sum` of the reference.
//! Then, lane by lane, the reference's float steps for the block: `(da · dw) · s` added to
//! the row's sum, with no FMA, so every row gets `vec_dot`'s bits — in any batch, since the
//! activation rows of a call never meet.
//!
//! The same kernel takes a few activation rows at once (`gemm_panels`, the prefill), each
//! unpacked block of codes serving all of them. The 512-bit form holds a panel in one
//! register; the 256-bit forms (AVX2, AVX-VNNI, AVX-512 VNNI on 256 bits) take it in two
//! halves of 8 rows.

use crate::quants::mxfp4::KVALUES;
use crate::quants::q8_0;
use crate::quants::q8_k::blocks;
use crate::repack::mxpanel::{check_shapes, PanelKernel, E, GROUP, QS as PQS};
use crate::repack::KPANEL;
use std::arch::x86_64::*;

const AB: usize = q8_0::BLOCK;

/// Added to every code (the doubled E2M1 values, −12..=12) to make it unsigned: 0..=24, so a
/// `maddubs` pair is at most 2 · 24 · 128 and four pairs added stay inside i16.
const BIAS: i32 = 12;

/// Activation rows per register tile.
const R: usize = 4;

/// An activation block's scale and the start of its lanes, `−BIAS · Σa`.
type Terms = (f32, i32);

thread_local! {
    /// The terms of a call's activation rows, row after row.
    static TERMS: std::cell::RefCell<Vec<Terms>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The terms of `n_a` rows of `nb` Q8_0 blocks (`a_stride` apart) into `t`, row after row.
/// Computed once per call for every panel of it: a tenth of a decode call's time while it
/// was scalar.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C (every x86 level's table is installed only where they
/// exist).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn act_terms(a: &[u8], a_stride: usize, n_a: usize, nb: usize, t: &mut Vec<Terms>) {
    t.clear();
    for r in 0..n_a {
        for ab in blocks::<AB>(&a[r * a_stride..], nb) {
            t.push(block_terms(ab));
        }
    }
}

/// One Q8_0 block's terms: its f16 scale widened (exact) and `−BIAS` times its quants' sum
/// (exact in i32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn block_terms(ab: &[u8; AB]) -> Terms {
    let q = ld256(ab, 2);
    // Ones (unsigned) times the quants (signed): pairs in i16, then fours in i32.
    let s = _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_set1_epi8(1), q),
        _mm256_set1_epi16(1),
    );
    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    let h = u16::from_le_bytes([ab[0], ab[1]]);
    let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))));
    (d, -BIAS * _mm_cvtsi128_si32(s))
}

/// The four activation bytes at `at` of a Q8_0 block, as one i32 (for a broadcast).
#[inline]
fn act4(ab: &[u8; AB], at: usize) -> i32 {
    i32::from_le_bytes([ab[at], ab[at + 1], ab[at + 2], ab[at + 3]])
}

/// `R` activation rows of a call: blocks and terms.
pub(super) struct Acts<'a, const N: usize> {
    a: [&'a [[u8; AB]]; N],
    t: [&'a [Terms]; N],
}

/// One level's panel kernel: `N` activation rows against one panel (`nb` groups).
pub(super) trait Level {
    /// # Safety
    /// The CPU has the level's features; `panel` holds `nb` groups and every row of `acts`
    /// `nb` blocks and terms.
    unsafe fn panel<const N: usize>(panel: &[u8], nb: usize, acts: &Acts<N>) -> [[f32; KPANEL]; N];
}

/// The panel GEMM of level `L` (see `dispatch::PanelGemmFn`).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_panels<L: Level>(
    n: usize,
    w: &[u8],
    n_w: usize,
    a: &[u8],
    a_stride: usize,
    n_a: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let nb = check_shapes(n, w, n_w, a, a_stride, n_a, out, out_stride);
    if n_a == 0 {
        return;
    }
    TERMS.with_borrow_mut(|t| {
        // SAFETY: installed only where the level's features (AVX2 and more) exist.
        unsafe { act_terms(a, a_stride, n_a, nb, t) };
        for p in 0..n_w / KPANEL {
            let panel = &w[p * nb * GROUP..(p + 1) * nb * GROUP];
            let mut r = 0;
            while r < n_a {
                let k = (n_a - r).min(R);
                let mut put = |v: &[[f32; KPANEL]]| {
                    for (j, v) in v.iter().enumerate() {
                        let at = (r + j) * out_stride + p * KPANEL;
                        out[at..at + KPANEL].copy_from_slice(v);
                    }
                };
                macro_rules! run {
                    ($k:literal) => {{
                        let acts = Acts::<$k> {
                            a: std::array::from_fn(|j| blocks::<AB>(&a[(r + j) * a_stride..], nb)),
                            t: std::array::from_fn(|j| &t[(r + j) * nb..(r + j + 1) * nb]),
                        };
                        // SAFETY: installed only where the level's features exist; the shapes
                        // were checked above.
                        put(&unsafe { L::panel::<$k>(panel, nb, &acts) })
                    }};
                }
                match k {
                    4 => run!(4),
                    3 => run!(3),
                    2 => run!(2),
                    _ => run!(1),
                }
                r += k;
            }
        }
    });
}

/// The decode form: whole panels against one activation row.
pub(super) fn dot_panels<L: Level>(n: usize, w: &[u8], a: &[u8], out: &mut [f32]) {
    let n_w = out.len();
    gemm_panels::<L>(n, w, n_w, a, 0, 1, out, n_w);
}

/// 16 bytes of `b` from `at`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld128(b: &[u8], at: usize) -> __m128i {
    let s = &b[at..at + 16];
    // SAFETY: `s` holds the 16 bytes read.
    unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
}

/// 8 bytes of `b` from `at`, in the low half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld64(b: &[u8], at: usize) -> __m128i {
    let s = &b[at..at + 8];
    // SAFETY: `s` holds the 8 bytes read.
    unsafe { _mm_loadl_epi64(s.as_ptr().cast()) }
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

/// The table plus `BIAS`, in one 128-bit lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn table128() -> __m128i {
    // SAFETY: `KVALUES` is 16 readable bytes.
    let t = unsafe { _mm_loadu_si128(KVALUES.as_ptr().cast()) };
    _mm_add_epi8(t, _mm_set1_epi8(BIAS as i8))
}

/// `scale_half` of E8M0 bytes in i32 lanes, from their bits: `(e − 1) << 23` for e ≥ 2 (a
/// normal float), `0x0020_0000 << e` for the two subnormals.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn halves256(e: __m256i) -> __m256 {
    let big = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
    let small = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
    let sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    _mm256_castsi256_ps(_mm256_blendv_epi8(big, small, sub))
}

/// As `halves256`, 16 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn halves512(e: __m512i) -> __m512 {
    let big = _mm512_slli_epi32::<23>(_mm512_sub_epi32(e, _mm512_set1_epi32(1)));
    let small = _mm512_sllv_epi32(_mm512_set1_epi32(0x0020_0000), e);
    let sub = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    _mm512_castsi512_ps(_mm512_mask_blend_epi32(sub, big, small))
}

/// AVX-512 (F, BW, VL, VNNI): a panel in one register.
pub(super) struct Avx512;

impl Level for Avx512 {
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn panel<const N: usize>(panel: &[u8], nb: usize, acts: &Acts<N>) -> [[f32; KPANEL]; N] {
        assert!(panel.len() >= nb * GROUP);
        let t = _mm512_broadcast_i32x4(table128());
        let low4 = _mm512_set1_epi8(0x0f);
        let mut sum = [_mm512_setzero_ps(); N];
        for i in 0..nb {
            let g = &panel[i * GROUP..(i + 1) * GROUP];
            let dw = halves512(_mm512_cvtepu8_epi32(ld128(g, E)));
            let mut c = [_mm512_setzero_si512(); 8];
            for q in 0..4 {
                let run = ld512(g, PQS + 64 * q);
                c[2 * q] = _mm512_shuffle_epi8(t, _mm512_and_si512(run, low4));
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(run), low4);
                c[2 * q + 1] = _mm512_shuffle_epi8(t, hi);
            }
            for (s, (a, t)) in sum.iter_mut().zip(acts.a.iter().zip(&acts.t)) {
                let (ab, (da, start)) = (&a[i], t[i]);
                let mut v = _mm512_set1_epi32(start);
                for q in 0..4 {
                    let al = _mm512_set1_epi32(act4(ab, 2 + 4 * q));
                    let ah = _mm512_set1_epi32(act4(ab, 18 + 4 * q));
                    v = _mm512_dpbusd_epi32(v, c[2 * q], al);
                    v = _mm512_dpbusd_epi32(v, c[2 * q + 1], ah);
                }
                let dd = _mm512_mul_ps(_mm512_set1_ps(da), dw);
                *s = _mm512_add_ps(*s, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(v)));
            }
        }
        let mut out = [[0f32; KPANEL]; N];
        for (o, s) in out.iter_mut().zip(sum) {
            // SAFETY: `o` holds 16 f32.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), s) };
        }
        out
    }
}

impl PanelKernel for Avx512 {
    const GEMM: crate::dispatch::PanelGemmFn = gemm_panels::<Avx512>;
}

macro_rules! level256 {
    ($name:ident, $feat:literal, $vnni:expr, $dpbusd:path) => {
        pub(super) struct $name;

        impl Level for $name {
            /// Each block's two halves of 8 rows in turn, so the panel is read once, in order.
            #[target_feature(enable = $feat)]
            unsafe fn panel<const N: usize>(
                panel: &[u8],
                nb: usize,
                acts: &Acts<N>,
            ) -> [[f32; KPANEL]; N] {
                assert!(panel.len() >= nb * GROUP);
                let t = _mm256_broadcastsi128_si256(table128());
                let low4 = _mm256_set1_epi8(0x0f);
                let ones = _mm256_set1_epi16(1);
                let mut sum = [[_mm256_setzero_ps(); 2]; N];
                for i in 0..nb {
                    let g = &panel[i * GROUP..(i + 1) * GROUP];
                    for h in 0..2 {
                        let e = ld64(g, E + 8 * h);
                        let dw = halves256(_mm256_cvtepu8_epi32(e));
                        let mut c = [_mm256_setzero_si256(); 8];
                        for q in 0..4 {
                            let run = ld256(g, PQS + 64 * q + 32 * h);
                            c[2 * q] = _mm256_shuffle_epi8(t, _mm256_and_si256(run, low4));
                            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(run), low4);
                            c[2 * q + 1] = _mm256_shuffle_epi8(t, hi);
                        }
                        for (s, (a, t)) in sum.iter_mut().zip(acts.a.iter().zip(&acts.t)) {
                            let (ab, (da, start)) = (&a[i], t[i]);
                            let v = if $vnni {
                                let mut v = _mm256_set1_epi32(start);
                                for q in 0..4 {
                                    let al = _mm256_set1_epi32(act4(ab, 2 + 4 * q));
                                    let ah = _mm256_set1_epi32(act4(ab, 18 + 4 * q));
                                    v = $dpbusd(v, c[2 * q], al);
                                    v = $dpbusd(v, c[2 * q + 1], ah);
                                }
                                v
                            } else {
                                // Four pairs of products in i16 (at most 4 · 2 · 24 · 128),
                                // then widened: exact.
                                let (mut lo, mut hi) =
                                    (_mm256_setzero_si256(), _mm256_setzero_si256());
                                for q in 0..4 {
                                    let al = _mm256_set1_epi32(act4(ab, 2 + 4 * q));
                                    let ah = _mm256_set1_epi32(act4(ab, 18 + 4 * q));
                                    lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(c[2 * q], al));
                                    hi = _mm256_add_epi16(
                                        hi,
                                        _mm256_maddubs_epi16(c[2 * q + 1], ah),
                                    );
                                }
                                let v = _mm256_add_epi32(
                                    _mm256_madd_epi16(lo, ones),
                                    _mm256_madd_epi16(hi, ones),
                                );
                                _mm256_add_epi32(v, _mm256_set1_epi32(start))
                            };
                            let dd = _mm256_mul_ps(_mm256_set1_ps(da), dw);
                            s[h] = _mm256_add_ps(s[h], _mm256_mul_ps(dd, _mm256_cvtepi32_ps(v)));
                        }
                    }
                }
                let mut out = [[0f32; KPANEL]; N];
                for (o, s) in out.iter_mut().zip(sum) {
                    // SAFETY: `o` holds 16 f32.
                    unsafe {
                        _mm256_storeu_ps(o.as_mut_ptr(), s[0]);
                        _mm256_storeu_ps(o.as_mut_ptr().add(8), s[1]);
                    }
                }
                out
            }
        }

        impl PanelKernel for $name {
            const GEMM: crate::dispatch::PanelGemmFn = gemm_panels::<$name>;
        }
    };
}

/// Never called: the plain level sums with `maddubs`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn no_dpbusd(acc: __m256i, _: __m256i, _: __m256i) -> __m256i {
    acc
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
fn dpbusd_avx(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(acc, u, s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
fn dpbusd_512vl(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, u, s)
}

level256!(Plain, "avx2,fma,f16c", false, no_dpbusd);
level256!(AvxVnni, "avx2,fma,f16c,avxvnni", true, dpbusd_avx);
level256!(
    Avx512Vnni,
    "avx2,fma,f16c,avx512vnni,avx512vl",
    true,
    dpbusd_512vl
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::repack::mxpanel::{check_gemm_panels, check_row_kernels};

    #[test]
    fn every_level_gives_the_reference_bits() {
        if !super::super::available() {
            eprintln!("SKIPPED mxfp4_panel: no AVX2 here");
            return;
        }
        check_gemm_panels(gemm_panels::<Plain>, "avx2");
        check_row_kernels::<Plain>("avx2");
        if super::super::available_avxvnni() {
            check_gemm_panels(gemm_panels::<AvxVnni>, "avx-vnni");
            check_row_kernels::<AvxVnni>("avx-vnni");
        }
        if super::super::available_avx512vnni() {
            check_gemm_panels(gemm_panels::<Avx512Vnni>, "avx512vnni-256");
            check_row_kernels::<Avx512Vnni>("avx512vnni-256");
        }
        if super::super::gemm512::available() && super::super::available_avx512vnni() {
            check_gemm_panels(gemm_panels::<Avx512>, "avx512");
            check_row_kernels::<Avx512>("avx512");
        }
    }
}
