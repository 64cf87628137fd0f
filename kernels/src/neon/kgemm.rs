//! The K-quants' prefill GEMM on NEON with `sdot` (the dotprod level): tiles of 16 unpacked
//! weight rows (`crate::ktile`, signed codes), four rows per register, one i32 lane per row.
//!
//! Each activation row's 4 quants of a group are loaded replicated (`ld1r`) and `sdot` adds
//! the 4 products into each row's lane. `sdot` is signed × signed, so the formats with a bias
//! (Q6_K, Q3_K, IQ4_XS) keep their values as codes and need no block-sum correction; the
//! formats with mins (Q4_K, Q5_K, Q2_K) get `summ` from the Q8_K block sums. Per sub-block the
//! lanes are multiplied by the rows' scales (`mla`); per block the reference's float steps,
//! lane by lane, in block order (no fused multiply-add): the reference `vec_dot`'s bits.

use crate::ktile::{KQuant, KTile, GROUPS, PAIRS, ROWS};
use crate::quants::q8_k::{BLOCK_BYTES as AB, BSUMS, QS};
use crate::types::QK_K;
use core::arch::aarch64::*;
use core::arch::asm;
use std::cell::RefCell;

thread_local! {
    /// Each pool thread's tile, grown to the widest matrix once.
    static TILE: RefCell<KTile> = RefCell::new(KTile::default());
}

/// Rows per register.
const L: usize = 4;
/// Registers per tile.
const V: usize = ROWS / L;

/// `acc + Σ x·y` per i32 lane, four i8 products each.
#[inline]
#[target_feature(enable = "dotprod")]
fn sdot(mut acc: int32x4_t, x: int8x16_t, y: int8x16_t) -> int32x4_t {
    // SAFETY: `sdot` reads and writes registers only; this function is compiled (and only
    // called) with FEAT_DotProd.
    unsafe {
        asm!(
            "sdot {0:v}.4s, {1:v}.16b, {2:v}.16b",
            inout(vreg) acc,
            in(vreg) x,
            in(vreg) y,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

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
                        raw[c][v] = sdot(raw[c][v], w[v], vreinterpretq_s8_s32(q));
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
    assert!(
        n.is_multiple_of(QK_K),
        "kgemm: {n} columns is not whole blocks"
    );
    let nb = n / QK_K;
    assert!(
        n_w == 0 || (w_stride >= nb * T::BLOCK && w.len() >= (n_w - 1) * w_stride + nb * T::BLOCK),
        "kgemm: {n_w} weight rows of {nb} blocks do not fit in {} bytes",
        w.len()
    );
    assert!(
        n_a == 0 || (a_stride >= nb * AB && a.len() >= (n_a - 1) * a_stride + nb * AB),
        "kgemm: {n_a} activation rows of {nb} blocks do not fit in {} bytes",
        a.len()
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
    use crate::ktile::{Iq4Xs, Q2K, Q3K, Q4K, Q5K, Q6K};
    use crate::quants::{iq4_xs, q2_k, q3_k, q4_k, q5_k, q6_k, q8_k};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// `f` against the reference dot for every pair, bit for bit (as the AVX2 test): random
    /// blocks, extreme activations, 21 weight rows by 5 activation rows.
    fn check<T: KQuant>(f: KGemmFn, f16s: &[usize], reference: fn(usize, &[u8], &[u8]) -> f32) {
        let mut rng = StdRng::seed_from_u64(T::BLOCK as u64 + 11);
        for nb in [1, 2] {
            let n = nb * QK_K;
            let (n_w, n_a) = (21, 5);
            let ws = nb * T::BLOCK + 3;
            let mut w: Vec<u8> = (0..n_w * ws).map(|_| rng.random()).collect();
            for r in 0..n_w {
                for b in w[r * ws..r * ws + nb * T::BLOCK].chunks_exact_mut(T::BLOCK) {
                    for &o in f16s {
                        let v = half::f16::from_f32(rng.random_range(-2.0f32..2.0));
                        b[o..o + 2].copy_from_slice(&v.to_le_bytes());
                    }
                }
            }
            let as_ = nb * AB + 5;
            let mut a = vec![0u8; n_a * as_];
            for c in 0..n_a {
                let x: Vec<f32> = (0..n)
                    .map(|_| match rng.random_range(0..4) {
                        0 => 4.0,
                        1 => -4.0,
                        _ => rng.random_range(-4.0f32..4.0),
                    })
                    .collect();
                q8_k::quantize(&x, &mut a[c * as_..c * as_ + nb * AB]);
            }
            let mut got = vec![f32::NAN; n_a * n_w];
            f(n, &w, ws, n_w, &a, as_, n_a, &mut |c, o0, v| {
                got[c * n_w + o0..c * n_w + o0 + v.len()].copy_from_slice(v)
            });
            for c in 0..n_a {
                for o in 0..n_w {
                    let want = reference(
                        n,
                        &w[o * ws..o * ws + nb * T::BLOCK],
                        &a[c * as_..c * as_ + nb * AB],
                    );
                    assert_eq!(
                        got[c * n_w + o].to_bits(),
                        want.to_bits(),
                        "{} {nb} blocks, weight row {o}, activation row {c}",
                        std::any::type_name::<T>()
                    );
                }
            }
        }
    }

    #[test]
    fn dotprod_gives_the_reference_bits() {
        if !super::super::available_dotprod() {
            return;
        }
        check::<Q4K>(kgemm::<Q4K>, &[0, 2], q4_k::vec_dot);
        check::<Q5K>(kgemm::<Q5K>, &[0, 2], q5_k::vec_dot);
        check::<Q6K>(kgemm::<Q6K>, &[208], q6_k::vec_dot);
        check::<Q3K>(kgemm::<Q3K>, &[108], q3_k::vec_dot);
        check::<Q2K>(kgemm::<Q2K>, &[80, 82], q2_k::vec_dot);
        check::<Iq4Xs>(kgemm::<Iq4Xs>, &[0], iq4_xs::vec_dot);
    }
}
