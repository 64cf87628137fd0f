//! The K-quants' prefill GEMM on NEON with `sdot` (the dotprod level): tiles of 16 unpacked
//! weight rows (`crate::ktile`, signed codes), four rows per register, one i32 lane per row.
//!
//! Each activation row's 4 quants of a group are loaded replicated (`ld1r`) and `sdot` adds
//! the 4 products into each row's lane. `sdot` is signed × signed, so the formats with a bias
//! (Q6_K, Q3_K, IQ4_XS) keep their values as codes and need no block-sum correction; the
//! formats with mins (Q4_K, Q5_K, Q2_K) get `summ` from the Q8_K block sums. Per sub-block the
//! lanes are multiplied by the rows' scales (`mla`); per block the reference's float steps,
//! lane by lane, in block order (no fused multiply-add): the reference `vec_dot`'s bits.

use super::{Dot, Sdot};
use crate::ktile::{KQuant, KTile, GROUPS, PAIRS, ROWS};
use crate::quants::q8_k::{BLOCK_BYTES as AB, BSUMS, QS};
use crate::types::QK_K;
use core::arch::aarch64::*;
use std::cell::RefCell;

thread_local! {
    /// Each pool thread's tile, grown to the widest matrix once.
    static TILE: RefCell<KTile> = RefCell::new(KTile::default());
}

/// Rows per register.
const L: usize = 4;
/// Registers per tile.
const V: usize = ROWS / L;

/// The 16 rows of `t` against `C` activation rows (`a` at the first, `stride` apart):
/// per activation row, four registers of four rows' results.
///
/// # Safety
/// FEAT_DotProd available; each of the `C` rows holds `t.nb` Q8_K blocks; `t` was built
/// signed.
#[target_feature(enable = "neon,dotprod")]
unsafe fn tile<T: KQuant, const C: usize>(
    t: &KTile,
    a: *const u8,
    stride: usize,
) -> [[float32x4_t; V]; C] {
    let nsub = QK_K / T::SUB;
    let per_sub = T::SUB / 4;
    let mut acc = [[vdupq_n_f32(0.0); V]; C];
    for i in 0..t.nb {
        // SAFETY (every pointer below): block i of the tile's buffers (built for `t.nb`
        // blocks) and of each activation row (caller).
        let codes = unsafe { t.codes.as_ptr().add(i * GROUPS * ROWS) };
        let blk = unsafe { a.add(i * AB) };
        let mut s1 = [[vdupq_n_s32(0); V]; C];
        for j in 0..nsub {
            let mut raw = [[vdupq_n_s32(0); V]; C];
            for k in 0..per_sub {
                let g = j * per_sub + k;
                let w: [int8x16_t; V] = std::array::from_fn(|v| unsafe {
                    vld1q_s8(codes.add(g * ROWS + L * v).cast())
                });
                for c in 0..C {
                    let q = unsafe { vld1q_dup_s32(blk.add(c * stride + QS + 4 * g).cast()) };
                    for v in 0..V {
                        // SAFETY: this kernel runs only where FEAT_DotProd was detected.
                        raw[c][v] = unsafe { Sdot::dot(raw[c][v], w[v], vreinterpretq_s8_s32(q)) };
                    }
                }
            }
            let at = (i * nsub + j) * ROWS;
            for v in 0..V {
                let sv = unsafe { vld1q_s32(t.sc.as_ptr().add(at + L * v)) };
                for c in 0..C {
                    s1[c][v] = vmlaq_s32(s1[c][v], raw[c][v], sv);
                }
            }
        }
        let d: [float32x4_t; V] =
            std::array::from_fn(|v| unsafe { vld1q_f32(t.d.as_ptr().add(i * ROWS + L * v)) });
        if T::HAS_MIN {
            // summ = Σ_h coef_h · bsum_h, the factors split from their i16 pairs.
            let mut corr = [[vdupq_n_s32(0); V]; C];
            for p in 0..PAIRS {
                for v in 0..V {
                    let pair =
                        unsafe { vld1q_s32(t.coef.as_ptr().add((i * PAIRS + p) * ROWS + L * v)) };
                    let lo = vshrq_n_s32::<16>(vshlq_n_s32::<16>(pair));
                    let hi = vshrq_n_s32::<16>(pair);
                    for c in 0..C {
                        let bs = unsafe { blk.add(c * stride + BSUMS + 4 * p) };
                        let (b0, b1) = unsafe {
                            (
                                i32::from(bs.cast::<i16>().read_unaligned()),
                                i32::from(bs.add(2).cast::<i16>().read_unaligned()),
                            )
                        };
                        corr[c][v] = vmlaq_n_s32(vmlaq_n_s32(corr[c][v], lo, b0), hi, b1);
                    }
                }
            }
            let dmin: [float32x4_t; V] = std::array::from_fn(|v| unsafe {
                vld1q_f32(t.dmin.as_ptr().add(i * ROWS + L * v))
            });
            for c in 0..C {
                let ad = vdupq_n_f32(unsafe { blk.add(c * stride).cast::<f32>().read_unaligned() });
                for v in 0..V {
                    let x = vsubq_f32(
                        vmulq_f32(vmulq_f32(ad, d[v]), vcvtq_f32_s32(s1[c][v])),
                        vmulq_f32(vmulq_f32(ad, dmin[v]), vcvtq_f32_s32(corr[c][v])),
                    );
                    acc[c][v] = vaddq_f32(acc[c][v], x);
                }
            }
        } else {
            for c in 0..C {
                let ad = vdupq_n_f32(unsafe { blk.add(c * stride).cast::<f32>().read_unaligned() });
                for v in 0..V {
                    let x = vmulq_f32(vmulq_f32(ad, d[v]), vcvtq_f32_s32(s1[c][v]));
                    acc[c][v] = vaddq_f32(acc[c][v], x);
                }
            }
        }
    }
    acc
}

/// `TypeKernels::kgemm` at the dotprod level: tiles of 16 rows against 2 activation rows at
/// a time.
pub(super) fn kgemm<T: KQuant>(
    n: usize,
    w: &[u8],
    w_stride: usize,
    n_w: usize,
    a: &[u8],
    a_stride: usize,
    n_a: usize,
    store: &mut dyn FnMut(usize, usize, &[f32]),
) {
    let nb = crate::ktile::check_shapes(
        "kgemm",
        n,
        T::BLOCK,
        w.len(),
        w_stride,
        n_w,
        a.len(),
        a_stride,
        n_a,
    );
    debug_assert!(super::available_dotprod());
    TILE.with_borrow_mut(|t| {
        for o0 in (0..n_w).step_by(ROWS) {
            let rows = (n_w - o0).min(ROWS);
            t.build::<T>(&w[o0 * w_stride..], w_stride, rows, nb, T::codes, true);
            let mut c = 0;
            macro_rules! step {
                ($cols:literal) => {{
                    // SAFETY: installed only after detection found FEAT_DotProd; rows
                    // c..c + $cols hold `nb` blocks (checked above); the tile is signed.
                    let acc =
                        unsafe { tile::<T, $cols>(t, a.as_ptr().add(c * a_stride), a_stride) };
                    for (k, regs) in acc.iter().enumerate() {
                        let mut out = [0f32; ROWS];
                        for (v, r) in regs.iter().enumerate() {
                            // SAFETY: `out` holds 16 floats.
                            unsafe { vst1q_f32(out.as_mut_ptr().add(L * v), *r) };
                        }
                        store(c + k, o0, &out[..rows]);
                    }
                    c += $cols;
                }};
            }
            while c < n_a {
                match n_a - c {
                    2.. => step!(2),
                    _ => step!(1),
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::KGemmFn;
    use crate::ktile::test_util::check_all;
    use crate::ktile::{Iq4Xs, Q2K, Q3K, Q4K, Q5K, Q6K};

    #[test]
    fn dotprod_gives_the_reference_bits() {
        if !super::super::available_dotprod() {
            return;
        }
        let k = [
            kgemm::<Q4K> as KGemmFn,
            kgemm::<Q5K>,
            kgemm::<Q6K>,
            kgemm::<Q3K>,
            kgemm::<Q2K>,
            kgemm::<Iq4Xs>,
        ];
        check_all(k.map(Some), 5);
    }
}
