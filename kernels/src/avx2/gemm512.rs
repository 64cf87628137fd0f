//! Prefill GEMM for the 32-element ("legacy") formats with AVX-512 (F, BW, VL, VNNI): weight
//! rows times activation rows prepared once per batch (`crate::gemm::GemmActs`), in register
//! tiles of `W` weight rows × `R` activation rows.
//!
//! Two blocks share a 512-bit register: the low half holds an even block, the high half the
//! odd one after it. That is the decode kernel's pair of accumulators (even blocks in one,
//! odd in the other) side by side, and every other step is the decode kernel's too — exact
//! integer block sums (`vpdpbusd`), the scale product `dw · da` in f32, one FMA per block,
//! the halves added lane-wise, the same horizontal sum, and for Q4_1/Q5_1 the `m · s` terms
//! summed block by block — so each output is bit-identical to the decode kernel's dot.
//!
//! Signed formats are read as unsigned (`Pair512`), so per pair of blocks and (weight,
//! activation) pair the loop issues a load of the activations, a load and shift of their lane
//! sums (signed formats), `vpdpbusd`, a conversion, a scale multiply and an FMA: 64 products
//! in six instructions, where the AVX2 decode kernel spends about ten on 32.

use super::q8_0::{hsum, Legacy, PREFETCH_BYTES, QK};
use super::{q4_0::Q4_0, q4_1::Q4_1, q5_0::Q5_0, q5_1::Q5_1, q8_0::Q8_0, q8_0::Q8_1};
use crate::gemm::{GemmActs, D_LANES, LANE_SUMS};
use crate::quants::{q4_0, q4_1, q5_0, q5_1, q8_0, q8_1};
use crate::repack::PANEL;
use core::arch::x86_64::*;

/// A legacy format as the GEMM reads it: two consecutive blocks unpacked into one 512-bit
/// register as *unsigned* bytes, so `vpdpbusd` takes them as they are. A signed format adds
/// `2^BIAS_SHIFT` to every quant (Q8_0 flips the sign bit, Q4_0 keeps its raw nibbles, Q5_0
/// its raw five bits), and the tile starts each lane at `-2^BIAS_SHIFT` times the lane's
/// activation sum (`GemmActs::ls`): the lane's integer is exactly the signed Σ w·a the decode
/// kernel gets with the sign trick, for fewer instructions per block (no `|w|`, no sign mask,
/// no per-row negation).
pub(super) trait Pair512: Legacy {
    /// log2 of the bias of a signed format (unused for unsigned ones).
    const BIAS_SHIFT: u32;
    /// Bytes of a block's header (scale, and min or sum): what a panel gathers apart from
    /// the rest of the block (`crate::repack`).
    const HEADER: usize;

    /// Blocks `i` (bytes 0..32) and `i + 1` (bytes 32..64) at `p`, element j of each in byte
    /// j of its half, unsigned (biased when the format is signed).
    ///
    /// # Safety
    /// `p` points to two readable blocks and the CPU has what `available()` checks.
    unsafe fn unpack_pair(p: *const u8) -> __m512i;

    /// As `unpack_pair`, from the blocks' headerless rest: block `i`'s at `q`, block
    /// `i + 1`'s right after it (a row's run in a panel).
    ///
    /// # Safety
    /// `q` points to two readable rests and the CPU has what `available()` checks.
    unsafe fn unpack_rest_pair(q: *const u8) -> __m512i;
}

/// Two blocks' 16 nibble bytes each (at `p + QS` and `p + BLOCK + QS`) as 64 values 0..15:
/// low nibbles then high nibbles of the first block, then of the second (`nibbles` twice).
///
/// # Safety
/// Both 16-byte runs are readable; the CPU has AVX-512 F/BW.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn nibble_pair<const BLOCK: usize, const QS: usize>(p: *const u8) -> __m512i {
    // SAFETY: both runs are readable (caller).
    let y = unsafe {
        _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(p.add(QS).cast())),
            _mm_loadu_si128(p.add(BLOCK + QS).cast()),
        )
    };
    // [raw_i, raw_i, raw_{i+1}, raw_{i+1}], then the second copy of each shifted down by 4.
    let x = _mm512_permutexvar_epi64(
        _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
        _mm512_castsi256_si512(y),
    );
    let x = _mm512_mask_srli_epi16::<4>(x, 0xff00_ff00, x);
    _mm512_and_si512(x, _mm512_set1_epi8(0x0f))
}

/// Two blocks of 5-bit quants (nibbles at `p + QS`, fifth bits as a little-endian u32 at
/// `p + QH`, likewise `BLOCK` bytes on) as 64 values 0..31: `nibble_pair` with 16 added where
/// the bit is set.
///
/// # Safety
/// Both blocks are readable; the CPU has AVX-512 F/BW.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn five_bit_pair<const BLOCK: usize, const QH: usize, const QS: usize>(
    p: *const u8,
) -> __m512i {
    // SAFETY: both blocks are readable (caller).
    let (q, a, b) = unsafe {
        (
            nibble_pair::<BLOCK, QS>(p),
            u32::from_le(p.add(QH).cast::<u32>().read_unaligned()),
            u32::from_le(p.add(BLOCK + QH).cast::<u32>().read_unaligned()),
        )
    };
    let high: __mmask64 = u64::from(a) | u64::from(b) << 32;
    _mm512_mask_add_epi8(q, high, q, _mm512_set1_epi8(0x10))
}

/// Two full-byte blocks (quants at `p + QS` and `p + BLOCK + QS`), sign bits flipped.
///
/// # Safety
/// Both 32-byte runs are readable; the CPU has AVX-512 F/BW.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn byte_pair<const BLOCK: usize, const QS: usize>(p: *const u8) -> __m512i {
    // SAFETY: both runs are readable (caller).
    let x = unsafe {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_loadu_si256(p.add(QS).cast())),
            _mm256_loadu_si256(p.add(BLOCK + QS).cast()),
        )
    };
    _mm512_xor_si512(x, _mm512_set1_epi8(0x80u8 as i8))
}

macro_rules! pair512 {
    ($ty:ty, $shift:expr, $header:expr, |$p:ident| $body:expr, |$q:ident| $rest:expr) => {
        impl Pair512 for $ty {
            const BIAS_SHIFT: u32 = $shift;
            const HEADER: usize = $header;

            #[inline]
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
            unsafe fn unpack_pair($p: *const u8) -> __m512i {
                // SAFETY: two readable blocks at `p` (caller); every offset is inside them.
                unsafe { $body }
            }

            #[inline]
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
            unsafe fn unpack_rest_pair($q: *const u8) -> __m512i {
                // SAFETY: two readable rests at `q` (caller); every offset is inside them.
                unsafe { $rest }
            }
        }
    };
}

// Q4_0: d, 16 nibble bytes; w = q - 8, so q itself is w + 8.
pair512!(Q4_0, 3, 2, |p| nibble_pair::<{ q4_0::BLOCK }, 2>(p), |q| {
    nibble_pair::<16, 0>(q)
});
// Q4_1: d, m, 16 nibble bytes; unsigned.
pair512!(Q4_1, 0, 4, |p| nibble_pair::<{ q4_1::BLOCK }, 4>(p), |q| {
    nibble_pair::<16, 0>(q)
});
// Q5_0: d, qh (4 bytes), 16 nibble bytes; q | h << 4 is w + 16.
pair512!(
    Q5_0,
    4,
    2,
    |p| five_bit_pair::<{ q5_0::BLOCK }, 2, 6>(p),
    |q| five_bit_pair::<20, 0, 4>(q)
);
// Q5_1: d, m, qh, 16 nibble bytes; unsigned.
pair512!(
    Q5_1,
    0,
    4,
    |p| five_bit_pair::<{ q5_1::BLOCK }, 4, 8>(p),
    |q| five_bit_pair::<20, 0, 4>(q)
);
// Q8_0 / Q8_1 weights: i8 quants; flipping the sign bit adds 128.
pair512!(Q8_0, 7, 2, |p| byte_pair::<{ q8_0::BLOCK }, 2>(p), |q| {
    byte_pair::<32, 0>(q)
});
pair512!(Q8_1, 7, 4, |p| byte_pair::<{ q8_1::BLOCK }, 4>(p), |q| {
    byte_pair::<32, 0>(q)
});

/// True when this CPU has what the kernels here use (and the AVX2 kernels they build on).
pub fn available() -> bool {
    super::available()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

/// Weight rows per register tile. 4 × 4 measured best on a Zen 5 EPYC (pp512, 1 thread:
/// Gemma 536 and SmolLM2 613 tok/s; 2 × 4: 524 and 594; 2 × 8: 534 and 578; 4 × 2: 456, 474).
const W: usize = 4;
// A panel is one tile's weight rows.
const _: () = assert!(W == PANEL);
/// Batches of at most this many rows prefetch the weight rows `PREFETCH_BYTES` ahead, as
/// decode does. SmolLM2 served to 4 clients on a Zen 5 EPYC: 1.43× one client without the
/// hint (and through the AVX2 2 × 2 tile), 2.03× with it.
const STREAM_ROWS: usize = 8;

/// Activation rows per register tile.
const R: usize = 4;

/// The scales (and mins) of weight blocks `i` and `i + 1`: `dw_i` in lanes 0..8, `dw_{i+1}`
/// in 8..16; `mw_i` and `mw_{i+1}` each in all 8 lanes of a register (unsigned formats; zero
/// otherwise).
///
/// # Safety
/// `bw` points to two consecutive weight blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn pair_scales<B: Legacy>(bw: *const u8) -> (__m512, [__m256; 2]) {
    // SAFETY: both headers lie inside the two blocks (caller).
    let (h0, h1) = unsafe {
        (
            bw.cast::<u32>().read_unaligned(),
            bw.add(B::BLOCK).cast::<u32>().read_unaligned(),
        )
    };
    let (d0, d1) = (u64::from(h0 & 0xffff), u64::from(h1 & 0xffff));
    let (m0, m1) = if B::SIGNED {
        (0, 0)
    } else {
        (u64::from(h0 >> 16), u64::from(h1 >> 16))
    };
    // [dw_i, dw_{i+1}, mw_i, mw_{i+1}], exactly as the decode kernel's F16C conversion.
    let v = _mm_cvtph_ps(_mm_cvtsi64_si128(
        (d0 | d1 << 16 | m0 << 32 | m1 << 48) as i64,
    ));
    let idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let d = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
    // The mins broadcast straight from the register (lanes 2 and 3).
    let m0 = _mm256_broadcastss_ps(_mm_movehl_ps(v, v));
    let m1 = _mm256_broadcastss_ps(_mm_shuffle_ps::<0xff>(v, v));
    (d, [m0, m1])
}

/// The f32 scale of a single weight block `i` (the odd tail) and its min.
///
/// # Safety
/// `bw` points to one weight block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn one_scale<B: Legacy>(bw: *const u8) -> (f32, f32) {
    // SAFETY: the header lies inside the block (caller).
    let h = unsafe { bw.cast::<u32>().read_unaligned() };
    let h = if B::SIGNED { h & 0xffff } else { h };
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(h as i32));
    let mut m = [0f32; 4];
    // SAFETY: `m` holds 4 floats.
    unsafe { _mm_storeu_ps(m.as_mut_ptr(), v) };
    (m[0], m[1])
}

/// Where a tile's weight rows are read from: rows in the file's layout, or a panel.
trait Source<B: Pair512>: Copy {
    /// What the tile's rows share for a pair of blocks (a panel's converted scales).
    type Pair: Copy;
    /// Reads a panel (one run per pair of blocks).
    const PANEL: bool;

    /// The tile's `WT` rows starting at `w` (rows `stride` bytes apart, `nb` blocks each).
    fn new(w: *const u8, stride: usize, nb: usize) -> Self;

    /// # Safety
    /// Blocks `i` and `i + 1` exist; the CPU has the features.
    unsafe fn pair(self, i: usize) -> Self::Pair;

    /// Row `o`'s blocks `i` and `i + 1`: the unsigned quants, `dw_i` in lanes 0..8 and
    /// `dw_{i+1}` in 8..16, and the mins each in all 8 lanes (unsigned formats).
    ///
    /// # Safety
    /// As `pair`, and `p` is `pair(i)`.
    unsafe fn row(self, p: &Self::Pair, o: usize, i: usize) -> (__m512i, __m512, [__m256; 2]);

    /// A hint for row `o`'s data some way past block `i` (past the end is harmless).
    fn prefetch(self, o: usize, i: usize);

    /// Row `o`'s block `i` as the file has it: the odd last block.
    ///
    /// # Safety
    /// Block `i` exists and is the last of an odd count.
    unsafe fn block(self, o: usize, i: usize) -> *const u8;
}

/// Rows in the GGUF layout, `stride` bytes apart.
#[derive(Clone, Copy)]
struct Rows {
    w: *const u8,
    stride: usize,
}

impl<B: Pair512> Source<B> for Rows {
    type Pair = ();
    const PANEL: bool = false;

    fn new(w: *const u8, stride: usize, _: usize) -> Self {
        Rows { w, stride }
    }

    #[inline(always)]
    unsafe fn pair(self, _: usize) {}

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn row(self, _: &(), o: usize, i: usize) -> (__m512i, __m512, [__m256; 2]) {
        // SAFETY: blocks i and i + 1 of row o exist (caller).
        unsafe {
            let bw = self.w.add(o * self.stride + i * B::BLOCK);
            let (d, m) = pair_scales::<B>(bw);
            (B::unpack_pair(bw), d, m)
        }
    }

    #[inline(always)]
    fn prefetch(self, o: usize, i: usize) {
        let p = self
            .w
            .wrapping_add(o * self.stride + i * B::BLOCK + PREFETCH_BYTES);
        // SAFETY: a prefetch hint never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) };
    }

    #[inline(always)]
    unsafe fn block(self, o: usize, i: usize) -> *const u8 {
        // SAFETY: block i of row o exists (caller).
        unsafe { self.w.add(o * self.stride + i * B::BLOCK) }
    }
}

/// A panel of `PANEL` rows (`crate::repack`).
#[derive(Clone, Copy)]
struct Panel {
    p: *const u8,
    nb: usize,
}

impl Panel {
    /// Bytes of one pair of blocks of the panel's rows.
    const fn group<B: Legacy>() -> usize {
        2 * PANEL * B::BLOCK
    }
}

impl<B: Pair512> Source<B> for Panel {
    /// The pair's run, the rows' scales `[d0_i, d0_{i+1}, d1_i, …]` and mins likewise.
    type Pair = (*const u8, __m256, __m256);
    const PANEL: bool = true;

    fn new(w: *const u8, _: usize, nb: usize) -> Self {
        Panel { p: w, nb }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn pair(self, i: usize) -> Self::Pair {
        // SAFETY: the pair's run lies inside the panel (caller): 8 scales, then (unsigned
        // formats) 8 mins.
        unsafe {
            let g = self.p.add(i / 2 * Panel::group::<B>());
            let d = _mm256_cvtph_ps(_mm_loadu_si128(g.cast()));
            let m = if B::SIGNED {
                _mm256_setzero_ps()
            } else {
                _mm256_cvtph_ps(_mm_loadu_si128(g.add(2 * PANEL * 2).cast()))
            };
            (g, d, m)
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn row(self, p: &Self::Pair, o: usize, _: usize) -> (__m512i, __m512, [__m256; 2]) {
        let rest = B::BLOCK - B::HEADER;
        let (e, f) = (2 * o as i32, 2 * o as i32 + 1);
        let idx = _mm512_setr_epi32(e, e, e, e, e, e, e, e, f, f, f, f, f, f, f, f);
        let d = _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(p.1));
        let m = [
            _mm256_permutevar8x32_ps(p.2, _mm256_set1_epi32(e)),
            _mm256_permutevar8x32_ps(p.2, _mm256_set1_epi32(f)),
        ];
        // SAFETY: row o's run of the pair lies inside the panel (caller).
        let q = unsafe { B::unpack_rest_pair(p.0.add(2 * PANEL * B::HEADER + o * 2 * rest)) };
        (q, d, m)
    }

    #[inline(always)]
    fn prefetch(self, o: usize, i: usize) {
        let p = self
            .p
            .wrapping_add(i / 2 * Panel::group::<B>() + o * 64 + PREFETCH_BYTES);
        // SAFETY: a prefetch hint never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) };
    }

    #[inline(always)]
    unsafe fn block(self, o: usize, _: usize) -> *const u8 {
        // SAFETY: the odd last blocks follow the pairs, row by row (caller).
        unsafe { self.p.add(self.nb / 2 * Panel::group::<B>() + o * B::BLOCK) }
    }
}

/// Where a tile's activation rows are: quants, repeated scales and block-major sums of row
/// `r0`, with the strides between rows (and between blocks, for the sums).
#[derive(Clone, Copy)]
struct ActTile {
    q: *const i8,
    q_stride: usize,
    d: *const f32,
    d_stride: usize,
    s: *const f32,
    s_stride: usize,
    ls: *const i32,
    ls_stride: usize,
}

/// `$body` once for each `$i` in `0..$n` (`$n` a constant of at most 8), written out: the
/// accumulators a register tile indexes by `$i` then stay in registers (a loop LLVM left
/// rolled kept them on the stack).
macro_rules! unrolled {
    ($i:ident < $n:expr, $body:block) => {
        unrolled!(@ $i < $n, $body, 0 1 2 3 4 5 6 7)
    };
    (@ $i:ident < $n:expr, $body:block, $($k:literal)*) => {
        $(
            if $k < $n {
                let $i: usize = $k;
                $body
            }
        )*
    };
}

/// `WT` weight rows (from `w`, `w_stride` apart) against `RT` activation rows: `[r][o]`.
///
/// # Safety
/// Every weight row holds `nb` blocks of `B`; the activation rows `ActTile` points at hold
/// `nb` blocks each (and, for unsigned formats, 8 readable sums from `s + i * s_stride` for
/// every block `i`); the CPU has the features.
// Indexing by (r, o) keeps the register tile's shape readable.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile<B: Pair512, S: Source<B>, const WT: usize, const RT: usize, const PF: bool>(
    nb: usize,
    w: S,
    a: ActTile,
) -> [[f32; WT]; RT] {
    let zero = _mm512_setzero_si512();
    let bias = _mm_cvtsi32_si128(B::BIAS_SHIFT as i32);
    let mut acc = [[_mm512_setzero_ps(); WT]; RT];
    // Lane r of off[o]: the m·s terms of weight row o and activation row r, block by block.
    let mut off = [_mm256_setzero_ps(); WT];
    let mut i = 0;
    while i + 1 < nb {
        // SAFETY: blocks i and i + 1 lie inside every row (caller).
        let pair = unsafe { w.pair(i) };
        unrolled!(o < WT, {
            // SAFETY: blocks i and i + 1 lie inside every row (caller), so do the offsets.
            unsafe {
                if PF || S::PANEL {
                    // With few activation rows (batched decode) the weights stream from
                    // memory as in decode. A panel is one stream, so prefill prefetches it
                    // too: the panels a slab meets later are back in L1 when it gets there
                    // (Zen 5 EPYC, 64 weight × 512 activation rows: Q4_1 159 -> 189 GOP/s,
                    // Q8_0 220 -> 258; for the row layout the hints cost prefill ~5%).
                    w.prefetch(o, i);
                }
                let (ux, dw, mw) = w.row(&pair, o, i);
                unrolled!(r < RT, {
                    let qy = _mm512_loadu_si512(a.q.add(r * a.q_stride + i * QK).cast());
                    let start = if B::SIGNED {
                        let ls =
                            _mm512_loadu_si512(a.ls.add(r * a.ls_stride + i * LANE_SUMS).cast());
                        _mm512_sll_epi32(ls, bias)
                    } else {
                        zero
                    };
                    let sums = _mm512_dpbusd_epi32(start, ux, qy);
                    let d =
                        _mm512_mul_ps(dw, _mm512_loadu_ps(a.d.add(r * a.d_stride + i * D_LANES)));
                    acc[r][o] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sums), acc[r][o]);
                });
                if !B::SIGNED {
                    for (k, m) in mw.iter().enumerate() {
                        let s = _mm256_loadu_ps(a.s.add((i + k) * a.s_stride));
                        off[o] = _mm256_add_ps(off[o], _mm256_mul_ps(*m, s));
                    }
                }
            }
        });
        i += 2;
    }
    // Even and odd blocks' sums side by side, as the decode kernel's two accumulators.
    let mut lo = [[_mm256_setzero_ps(); WT]; RT];
    let mut hi = [[_mm256_setzero_ps(); WT]; RT];
    for r in 0..RT {
        for o in 0..WT {
            lo[r][o] = _mm512_castps512_ps256(acc[r][o]);
            hi[r][o] = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc[r][o])));
        }
    }
    if i < nb {
        // The odd last block, into the even accumulator as the decode kernel does.
        for o in 0..WT {
            // SAFETY: block i lies inside every row (caller).
            unsafe {
                let bw = w.block(o, i);
                let qx = B::unpack(bw);
                let (dw, mw) = one_scale::<B>(bw);
                let (ux, neg) = if B::SIGNED {
                    (_mm256_abs_epi8(qx), _mm256_movepi8_mask(qx))
                } else {
                    (qx, 0)
                };
                for r in 0..RT {
                    let qy = _mm256_loadu_si256(a.q.add(r * a.q_stride + i * QK).cast());
                    let qy = if B::SIGNED {
                        _mm256_mask_sub_epi8(qy, neg, _mm256_setzero_si256(), qy)
                    } else {
                        qy
                    };
                    let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ux, qy);
                    let d = _mm256_mul_ps(
                        _mm256_set1_ps(dw),
                        _mm256_loadu_ps(a.d.add(r * a.d_stride + i * D_LANES)),
                    );
                    lo[r][o] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sums), lo[r][o]);
                }
                if !B::SIGNED {
                    let s = _mm256_loadu_ps(a.s.add(i * a.s_stride));
                    off[o] = _mm256_add_ps(off[o], _mm256_mul_ps(_mm256_set1_ps(mw), s));
                }
            }
        }
    }
    let mut out = [[0f32; WT]; RT];
    for o in 0..WT {
        let mut offs = [0f32; 8];
        // SAFETY: `offs` holds 8 floats.
        unsafe { _mm256_storeu_ps(offs.as_mut_ptr(), off[o]) };
        for r in 0..RT {
            out[r][o] = hsum(_mm256_add_ps(lo[r][o], hi[r][o]));
            if !B::SIGNED {
                out[r][o] += offs[r];
            }
        }
    }
    out
}

/// `n_w` weight rows of `B` (`w_stride` bytes apart) against activation rows `r0..r0 + n_a` of
/// `acts`: `out[r * out_stride + o]`. Installed as `TypeKernels::gemm` only once `available()`
/// holds.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm<B: Pair512>(
    n: usize,
    w: &[u8],
    w_stride: usize,
    n_w: usize,
    acts: &GemmActs,
    r0: usize,
    n_a: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    drive::<B, Rows>(n, w, w_stride, n_w, acts, r0, n_a, out, out_stride);
}

/// `gemm` over rows repacked into panels (`crate::repack`): `w` starts at a panel, `n_w` is
/// whole panels and `w_stride` is the GGUF row's bytes (panel k starts at `k * PANEL *
/// w_stride`). The same bits as `gemm` over the rows before repacking. Installed as
/// `TypeKernels::gemm_packed` only once `available()` holds.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_packed<B: Pair512>(
    n: usize,
    w: &[u8],
    w_stride: usize,
    n_w: usize,
    acts: &GemmActs,
    r0: usize,
    n_a: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    assert!(
        n_w.is_multiple_of(PANEL),
        "gemm_packed: {n_w} rows is not whole panels of {PANEL}"
    );
    drive::<B, Panel>(n, w, w_stride, n_w, acts, r0, n_a, out, out_stride);
}

#[allow(clippy::too_many_arguments)]
fn drive<B: Pair512, S: Source<B>>(
    n: usize,
    w: &[u8],
    w_stride: usize,
    n_w: usize,
    acts: &GemmActs,
    r0: usize,
    n_a: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    if n_w == 0 || n_a == 0 {
        return;
    }
    assert!(
        n.is_multiple_of(QK),
        "gemm: {n} columns is not whole blocks"
    );
    let nb = n / QK;
    assert_eq!(
        acts.nb, nb,
        "gemm: activations hold {} blocks per row, weights {nb}",
        acts.nb
    );
    assert!(
        r0 + n_a <= acts.n_rows,
        "gemm: rows {r0}..{} of {} activation rows",
        r0 + n_a,
        acts.n_rows
    );
    assert!(
        w_stride >= nb * B::BLOCK && w.len() >= (n_w - 1) * w_stride + nb * B::BLOCK,
        "gemm: {n_w} weight rows do not fit"
    );
    assert!(
        out.len() >= (n_a - 1) * out_stride + n_w,
        "gemm: output too small"
    );
    let unsigned = !B::SIGNED;
    if unsigned {
        assert!(
            acts.s.len() >= nb * acts.n_rows + 8,
            "gemm: Q4_1/Q5_1 weights need Q8_1 activations"
        );
    }
    debug_assert!(available());
    let at = |r: usize| ActTile {
        q: acts.q[r * nb * QK..].as_ptr(),
        q_stride: nb * QK,
        d: acts.d[r * nb * D_LANES..].as_ptr(),
        d_stride: nb * D_LANES,
        s: if unsigned {
            acts.s[r..].as_ptr()
        } else {
            core::ptr::null()
        },
        s_stride: acts.n_rows,
        ls: acts.ls[r * nb * LANE_SUMS..].as_ptr(),
        ls_stride: nb * LANE_SUMS,
    };
    let wp = w.as_ptr();
    // Batches this small read each weight block for a few rows only: prefetch the weights
    // as decode does (a prefill batch finds them in cache, and the hints cost it ~5%).
    let stream = acts.n_rows <= STREAM_ROWS;
    let mut r = 0;
    while r < n_a {
        let rt = (n_a - r).min(R);
        let a = at(r0 + r);
        let mut o = 0;
        while o < n_w {
            let wt = (n_w - o).min(W);
            // SAFETY: rows o..o + wt and r0 + r..r0 + r + rt exist and hold `nb` blocks
            // (checked above); the sums are padded by 8 floats; the CPU has the features
            // (this function is only installed after detection).
            unsafe {
                let wo = S::new(wp.add(o * w_stride), w_stride, nb);
                macro_rules! run {
                    ($wt:literal, $rt:literal) => {{
                        let v = if stream {
                            tile::<B, S, $wt, $rt, true>(nb, wo, a)
                        } else {
                            tile::<B, S, $wt, $rt, false>(nb, wo, a)
                        };
                        for (k, row) in v.iter().enumerate() {
                            let at = (r + k) * out_stride + o;
                            out[at..at + $wt].copy_from_slice(row);
                        }
                    }};
                }
                match (wt, rt) {
                    (4, 8) => run!(4, 8),
                    (4, 7) => run!(4, 7),
                    (4, 6) => run!(4, 6),
                    (4, 5) => run!(4, 5),
                    (4, 4) => run!(4, 4),
                    (4, 3) => run!(4, 3),
                    (4, 2) => run!(4, 2),
                    (4, 1) => run!(4, 1),
                    (3, 8) => run!(3, 8),
                    (3, 7) => run!(3, 7),
                    (3, 6) => run!(3, 6),
                    (3, 5) => run!(3, 5),
                    (3, 4) => run!(3, 4),
                    (3, 3) => run!(3, 3),
                    (3, 2) => run!(3, 2),
                    (3, 1) => run!(3, 1),
                    (2, 8) => run!(2, 8),
                    (2, 7) => run!(2, 7),
                    (2, 6) => run!(2, 6),
                    (2, 5) => run!(2, 5),
                    (2, 4) => run!(2, 4),
                    (2, 3) => run!(2, 3),
                    (2, 2) => run!(2, 2),
                    (2, 1) => run!(2, 1),
                    (1, 8) => run!(1, 8),
                    (1, 7) => run!(1, 7),
                    (1, 6) => run!(1, 6),
                    (1, 5) => run!(1, 5),
                    (1, 4) => run!(1, 4),
                    (1, 3) => run!(1, 3),
                    (1, 2) => run!(1, 2),
                    _ => run!(1, 1),
                }
            }
            o += wt;
        }
        r += rt;
    }
}

#[cfg(test)]
mod tests {
    use super::super::q8_0::tests::operands;
    use super::*;
    use crate::GgmlType as T;

    /// Every (weight row, activation row) pair of the GEMM equals the decode kernel's dot bit
    /// for bit, at odd and even block counts, every tile shape and its edges, from any first
    /// activation row.
    fn gemm_equals_decode<B: Pair512>(ty: T) {
        let decode = super::super::q8_0::vec_dot::<B>;
        for nb in [1usize, 2, 3, 7, 20] {
            let n = nb * QK;
            let (n_w, n_a) = (5, 11);
            let (w, ws, a, as_) = operands(ty, nb, n_w, n_a);
            let at = crate::reference(ty).vec_dot_type;
            let mut acts = GemmActs::new();
            acts.prepare(at, &a, as_, n_a, nb);
            for r0 in [0usize, 1, 6] {
                for (nw, na) in [(n_w, n_a - r0), (1, 1), (2, 4), (3, 3), (4, 5)] {
                    let na = na.min(n_a - r0);
                    let stride = nw + 2;
                    let mut out = vec![f32::NAN; na * stride];
                    gemm::<B>(n, &w, ws, nw, &acts, r0, na, &mut out, stride);
                    for r in 0..na {
                        for o in 0..nw {
                            let want = decode(n, &w[o * ws..], &a[(r0 + r) * as_..]);
                            assert_eq!(
                                out[r * stride + o].to_bits(),
                                want.to_bits(),
                                "{ty}: {nb} blocks, tile {nw}x{na} from row {r0}: ({r}, {o})"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn gemm_gives_the_decode_bits() {
        if !available() {
            eprintln!("SKIPPED gemm_gives_the_decode_bits: this CPU lacks AVX-512 F/BW/VL/VNNI");
            return;
        }
        use super::super::q8_0::{Q8_0, Q8_1};
        use super::super::{q4_0::Q4_0, q4_1::Q4_1, q5_0::Q5_0, q5_1::Q5_1};
        gemm_equals_decode::<Q4_0>(T::Q4_0);
        gemm_equals_decode::<Q4_1>(T::Q4_1);
        gemm_equals_decode::<Q5_0>(T::Q5_0);
        gemm_equals_decode::<Q5_1>(T::Q5_1);
        gemm_equals_decode::<Q8_0>(T::Q8_0);
        gemm_equals_decode::<Q8_1>(T::Q8_1);
        gemm_equals_decode::<super::super::iq4_nl::Iq4Nl>(T::IQ4_NL);
    }

    /// The GEMM over repacked panels gives the GEMM's bits over the rows as they were, for
    /// every tile height, odd and even block counts, and batches small enough to prefetch.
    fn packed_equals_rows<B: Pair512>(ty: T) {
        for nb in [1usize, 2, 3, 7, 20] {
            let n = nb * QK;
            let (n_w, n_a) = (8, 11);
            let (padded, pws, a, as_) = operands(ty, nb, n_w, n_a);
            // Panels hold rows back to back.
            let ws = nb * B::BLOCK;
            let w: Vec<u8> = padded
                .chunks(pws)
                .flat_map(|row| &row[..ws])
                .copied()
                .collect();
            let mut packed = vec![0u8; n_w * ws];
            crate::repack::repack(ty, n, n_w, &w[..n_w * ws], &mut packed);
            let at = crate::reference(ty).vec_dot_type;
            for rows in [n_a, 3] {
                let mut acts = GemmActs::new();
                acts.prepare(at, &a, as_, rows, nb);
                for (nw, w0) in [(8usize, 0usize), (4, 4), (4, 0)] {
                    let mut want = vec![f32::NAN; rows * nw];
                    let mut got = vec![f32::NAN; rows * nw];
                    gemm::<B>(n, &w[w0 * ws..], ws, nw, &acts, 0, rows, &mut want, nw);
                    gemm_packed::<B>(n, &packed[w0 * ws..], ws, nw, &acts, 0, rows, &mut got, nw);
                    for (k, (g, x)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            x.to_bits(),
                            "{ty}: {nb} blocks, rows {w0}+{nw}, batch {rows}: output {k}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn packed_gemm_gives_the_gemm_bits() {
        if !available() {
            eprintln!("SKIPPED packed_gemm_gives_the_gemm_bits: this CPU lacks AVX-512");
            return;
        }
        use super::super::q8_0::Q8_0;
        use super::super::{q4_0::Q4_0, q4_1::Q4_1, q5_0::Q5_0, q5_1::Q5_1};
        packed_equals_rows::<Q4_0>(T::Q4_0);
        packed_equals_rows::<Q4_1>(T::Q4_1);
        packed_equals_rows::<Q5_0>(T::Q5_0);
        packed_equals_rows::<Q5_1>(T::Q5_1);
        packed_equals_rows::<Q8_0>(T::Q8_0);
        packed_equals_rows::<super::super::iq4_nl::Iq4Nl>(T::IQ4_NL);
    }

    #[test]
    fn unsigned_weights_refuse_q8_0_rows() {
        if !available() {
            eprintln!("SKIPPED unsigned_weights_refuse_q8_0_rows: this CPU lacks AVX-512");
            return;
        }
        use super::super::q4_1::Q4_1;
        let (w, ws, _, _) = operands(T::Q4_1, 2, 1, 1);
        let (_, _, a, as_) = operands(T::Q5_0, 2, 1, 1);
        let mut acts = GemmActs::new();
        acts.prepare(T::Q8_0, &a, as_, 1, 2);
        let err = std::panic::catch_unwind(|| {
            let mut out = [0f32; 1];
            gemm::<Q4_1>(64, &w, ws, 1, &acts, 0, 1, &mut out, 1);
        })
        .expect_err("Q4_1 weights against Q8_0 rows must be refused");
        let msg = err
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| err.downcast_ref::<&str>().copied())
            .unwrap_or("");
        assert!(msg.contains("Q8_1 activations"), "{msg}");
    }
}
