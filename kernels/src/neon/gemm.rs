//! The i8mm prefill GEMM of the 32-element formats: `smmla` multiplies a 2 × 8 block of two
//! weight rows by an 8 × 2 block of two activation rows, so four instructions give a block's
//! exact integer sums for a 2 × 2 tile. Activations come laid out by `crate::gemm::GemmActs`.
//!
//! Four blocks' 2 × 2 results are transposed into one vector per (weight row, activation row)
//! pair, which then takes exactly the float steps of the decode tile (`q8_0::Acc`), with the
//! same scales (`GemmActs` holds the activation scales converted exactly from their f16): the
//! GEMM gives the decode kernels' bits.

use super::q8_0::{halves, Acc, Legacy, QK};
use super::{available_i8mm, f16x4};
use crate::gemm::{GemmActs, D_LANES};
use core::arch::aarch64::*;
use core::arch::asm;

/// `smmla`: `acc` (2 × 2, row-major) plus `w` (2 × 8 i8, row-major) times `a` (2 × 8, row-major)
/// transposed.
///
/// # Safety
/// The CPU has FEAT_I8MM.
#[inline]
#[target_feature(enable = "neon,i8mm")]
unsafe fn mmla(mut acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
    // SAFETY: `smmla` reads and writes registers only; the CPU has FEAT_I8MM (caller).
    unsafe {
        asm!(
            "smmla {0:v}.4s, {1:v}.16b, {2:v}.16b",
            inout(vreg) acc,
            in(vreg) w,
            in(vreg) a,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// The 8-byte chunks `c` (0..4) of two 32-byte rows side by side: `[x[8c..8c+8], y[8c..8c+8]]`.
#[inline]
#[target_feature(enable = "neon")]
fn pair(x: [int8x16_t; 2], y: [int8x16_t; 2], c: usize) -> int8x16_t {
    let (x, y) = (
        vreinterpretq_s64_s8(x[c / 2]),
        vreinterpretq_s64_s8(y[c / 2]),
    );
    vreinterpretq_s8_s64(if c % 2 == 0 {
        vzip1q_s64(x, y)
    } else {
        vzip2q_s64(x, y)
    })
}

/// One activation row of the GEMM layout.
#[derive(Clone, Copy)]
struct ActRow<'a> {
    q: &'a [i8],
    d: &'a [f32],
    /// Q8_1 sums, block-major (`s[i * n_rows]` is this row's block i), or empty.
    s: &'a [f32],
    n_rows: usize,
}

impl ActRow<'_> {
    /// The 32 quants of block `i`.
    #[inline]
    #[target_feature(enable = "neon")]
    fn quants(&self, i: usize) -> [int8x16_t; 2] {
        let q = &self.q[i * QK..(i + 1) * QK];
        // SAFETY: `q` holds 32 bytes.
        unsafe { [vld1q_s8(q.as_ptr()), vld1q_s8(q.as_ptr().add(16))] }
    }

    /// Scales (and sums) of blocks `i..i + k`, missing lanes 0, as the decode tile has them.
    #[inline]
    #[target_feature(enable = "neon")]
    fn scales<B: Legacy>(&self, i: usize, k: usize) -> (float32x4_t, float32x4_t) {
        let (mut d, mut s) = ([0f32; 4], [0f32; 4]);
        for j in 0..k {
            d[j] = self.d[(i + j) * D_LANES];
            if B::MIN {
                s[j] = self.s[(i + j) * self.n_rows];
            }
        }
        // SAFETY: both arrays hold 4 floats.
        unsafe { (vld1q_f32(d.as_ptr()), vld1q_f32(s.as_ptr())) }
    }
}

/// Weight rows `w[0]`, `w[1]` against activation rows `a[0]`, `a[1]` (a row may be given twice
/// for a 1-wide edge): `[[w0·a0, w1·a0], [w0·a1, w1·a1]]`.
///
/// # Safety
/// Both weight rows hold `nb` blocks; the CPU has FEAT_I8MM.
#[target_feature(enable = "neon,i8mm")]
unsafe fn tile2x2<B: Legacy>(nb: usize, w: [*const u8; 2], a: [ActRow<'_>; 2]) -> [[f32; 2]; 2] {
    let mut acc = [[Acc::zero(); 2]; 2];
    let zero = vdupq_n_s32(0);
    let mut i = 0;
    while i < nb {
        let k = (nb - i).min(4);
        let mut v = [zero; 4];
        for (j, vj) in v.iter_mut().enumerate().take(k) {
            // SAFETY: block i + j lies inside both weight rows (caller).
            let (x0, x1) = unsafe {
                (
                    B::unpack(w[0].add((i + j) * B::BLOCK)),
                    B::unpack(w[1].add((i + j) * B::BLOCK)),
                )
            };
            let (y0, y1) = (a[0].quants(i + j), a[1].quants(i + j));
            for c in 0..4 {
                // SAFETY: the CPU has FEAT_I8MM (caller).
                *vj = unsafe { mmla(*vj, pair(x0, x1, c), pair(y0, y1, c)) };
            }
        }
        // v[j] = [w0·a0, w0·a1, w1·a0, w1·a1] of block i + j; one vector per pair, by block.
        let t0 = vreinterpretq_s64_s32(vtrn1q_s32(v[0], v[1]));
        let t1 = vreinterpretq_s64_s32(vtrn2q_s32(v[0], v[1]));
        let t2 = vreinterpretq_s64_s32(vtrn1q_s32(v[2], v[3]));
        let t3 = vreinterpretq_s64_s32(vtrn2q_s32(v[2], v[3]));
        let sums = [
            [
                vreinterpretq_s32_s64(vzip1q_s64(t0, t2)),
                vreinterpretq_s32_s64(vzip2q_s64(t0, t2)),
            ],
            [
                vreinterpretq_s32_s64(vzip1q_s64(t1, t3)),
                vreinterpretq_s32_s64(vzip2q_s64(t1, t3)),
            ],
        ];
        let mut dw = [vdupq_n_f32(0.0); 2];
        let mut mw = [vdupq_n_f32(0.0); 2];
        for o in 0..2 {
            // SAFETY: blocks i..i + k lie inside both weight rows (caller).
            unsafe {
                dw[o] = f16x4(halves(w[o], B::BLOCK, 0, i, k));
                if B::MIN {
                    mw[o] = f16x4(halves(w[o], B::BLOCK, 2, i, k));
                }
            }
        }
        for r in 0..2 {
            let (da, sa) = a[r].scales::<B>(i, k);
            for o in 0..2 {
                acc[r][o].add::<B>(sums[r][o], dw[o], da, mw[o], sa);
            }
        }
        i += k;
    }
    [0, 1].map(|r| [acc[r][0].total::<B>(), acc[r][1].total::<B>()])
}

/// `n_w` weight rows of `B` (`w_stride` bytes apart) against activation rows `r0..r0 + n_a` of
/// `acts`: `out[r * out_stride + o]`. Installed as `TypeKernels::gemm` only once
/// `available_i8mm()` holds.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm<B: Legacy>(
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
    if B::MIN {
        assert!(
            acts.s.len() >= nb * acts.n_rows,
            "gemm: Q4_1/Q5_1 weights need Q8_1 activations"
        );
    }
    debug_assert!(available_i8mm());
    let row = |r: usize| ActRow {
        q: &acts.q[r * nb * QK..(r + 1) * nb * QK],
        d: &acts.d[r * nb * D_LANES..(r + 1) * nb * D_LANES],
        s: if B::MIN { &acts.s[r..] } else { &[] },
        n_rows: acts.n_rows,
    };
    let wrow = |o: usize| w[o * w_stride..].as_ptr();
    let mut r = 0;
    while r < n_a {
        let (ra, rb) = (r0 + r, r0 + (r + 1).min(n_a - 1));
        let mut o = 0;
        while o < n_w {
            let ob = (o + 1).min(n_w - 1);
            // SAFETY: weight rows o and ob exist and hold `nb` blocks (checked above); the CPU
            // has FEAT_I8MM (installed only after detection).
            let v = unsafe { tile2x2::<B>(nb, [wrow(o), wrow(ob)], [row(ra), row(rb)]) };
            out[r * out_stride + o] = v[0][0];
            if ob > o {
                out[r * out_stride + ob] = v[0][1];
            }
            if rb > ra {
                out[(r + 1) * out_stride + o] = v[1][0];
                if ob > o {
                    out[(r + 1) * out_stride + ob] = v[1][1];
                }
            }
            o += 2;
        }
        r += 2;
    }
}
