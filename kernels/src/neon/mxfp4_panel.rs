//! MXFP4 over repacked panels (`crate::repack::mxpanel`, `KPANEL` = 16 rows): four rows in the
//! lanes of each of four registers, as on x86 (`avx2/mxfp4_panel.rs`). A 16-byte part of a
//! run holds four code bytes of each of four rows; the codes go through the doubled E2M1 table
//! (`tbl`, signed: NEON multiplies i8 by i8, so no bias), and each lane sums its row's 32
//! products exactly: `sdot` against the four activations broadcast (dotprod), or widening
//! multiplies whose pairs are added within a row (baseline). Then, lane by lane, the
//! reference's float steps: `(da · dw) · s` added to the row's sum (no fused multiply-add), so
//! every row gets `vec_dot`'s bits, at both levels and in any batch.

use super::{f16_at, Dot, Sdot};
use crate::quants::mxfp4::KVALUES;
use crate::quants::q8_0;
use crate::quants::q8_k::blocks;
use crate::repack::mxpanel::{check_shapes, PanelKernel, E, GROUP, QS as PQS};
use crate::repack::KPANEL;
use core::arch::aarch64::*;

const AB: usize = q8_0::BLOCK;

/// Activation rows per register tile.
const R: usize = 4;

/// How a level sums a quad of rows: lane j of the result is row j's integer dot of the eight
/// code vectors `c` (four runs, low then high nibbles) with the activation block `ab`.
pub(super) trait Level {
    /// # Safety
    /// The CPU has the level's features.
    unsafe fn quad(c: &[int8x16_t; 8], ab: &[u8; AB]) -> int32x4_t;
}

/// The four activation bytes at `at` of a Q8_0 block, in every 32-bit lane.
#[inline]
#[target_feature(enable = "neon")]
fn act4(ab: &[u8; AB], at: usize) -> int8x16_t {
    let v = i32::from_le_bytes([ab[at], ab[at + 1], ab[at + 2], ab[at + 3]]);
    vreinterpretq_s8_s32(vdupq_n_s32(v))
}

/// Baseline NEON: a widening multiply per pair of rows; `sadalp` adds neighbouring products,
/// which belong to one row, and a final pairwise add finishes each row in its lane.
pub(super) struct Plain;

impl Level for Plain {
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn quad(c: &[int8x16_t; 8], ab: &[u8; AB]) -> int32x4_t {
        // Lanes: row 0 twice, row 1 twice (`lo`); rows 2 and 3 likewise (`hi`).
        let (mut lo, mut hi) = (vdupq_n_s32(0), vdupq_n_s32(0));
        for q in 0..4 {
            for (k, at) in [(2 * q, 2 + 4 * q), (2 * q + 1, 18 + 4 * q)] {
                let y = act4(ab, at);
                lo = vpadalq_s16(lo, vmull_s8(vget_low_s8(c[k]), vget_low_s8(y)));
                hi = vpadalq_s16(hi, vmull_high_s8(c[k], y));
            }
        }
        vpaddq_s32(lo, hi)
    }
}

impl Level for Sdot {
    #[inline]
    #[target_feature(enable = "neon,dotprod")]
    unsafe fn quad(c: &[int8x16_t; 8], ab: &[u8; AB]) -> int32x4_t {
        let mut s = vdupq_n_s32(0);
        for q in 0..4 {
            // SAFETY: this function has FEAT_DotProd.
            unsafe {
                s = Sdot::dot(s, c[2 * q], act4(ab, 2 + 4 * q));
                s = Sdot::dot(s, c[2 * q + 1], act4(ab, 18 + 4 * q));
            }
        }
        s
    }
}

/// `scale_half` of four E8M0 bytes (u32 lanes), from their bits: `(e − 1) << 23` for e ≥ 2,
/// `0x0020_0000 << e` for the two subnormals.
#[inline]
#[target_feature(enable = "neon")]
fn halves(e: uint32x4_t) -> float32x4_t {
    let big = vshlq_n_u32::<23>(vsubq_u32(e, vdupq_n_u32(1)));
    let small = vshlq_u32(vdupq_n_u32(0x0020_0000), vreinterpretq_s32_u32(e));
    let sub = vcltq_u32(e, vdupq_n_u32(2));
    vreinterpretq_f32_u32(vbslq_u32(sub, small, big))
}

/// Lanes `4k..4k + 4` of 16 bytes, widened to u32.
#[inline]
#[target_feature(enable = "neon")]
fn widen(v: uint8x16_t, k: usize) -> uint32x4_t {
    let h = if k < 2 {
        vmovl_u8(vget_low_u8(v))
    } else {
        vmovl_high_u8(v)
    };
    if k % 2 == 0 {
        vmovl_u16(vget_low_u16(h))
    } else {
        vmovl_high_u16(h)
    }
}

/// `N` activation rows against one panel of `nb` groups.
///
/// # Safety
/// The CPU has the level's features.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn panel<L: Level, const N: usize>(
    panel: &[u8],
    nb: usize,
    acts: [&[[u8; AB]]; N],
) -> [[f32; KPANEL]; N] {
    assert!(panel.len() >= nb * GROUP && acts.iter().all(|a| a.len() >= nb));
    // SAFETY: `KVALUES` is 16 readable bytes.
    let t = unsafe { vld1q_s8(KVALUES.as_ptr()) };
    let low4 = vdupq_n_u8(0x0f);
    let mut sum = [[vdupq_n_f32(0.0); 4]; N];
    let ld = |g: &[u8], at: usize| {
        let s = &g[at..at + 16];
        // SAFETY: `s` holds the 16 bytes read.
        unsafe { vld1q_u8(s.as_ptr()) }
    };
    for i in 0..nb {
        let g = &panel[i * GROUP..(i + 1) * GROUP];
        let e = ld(g, E);
        let da: [f32; N] = std::array::from_fn(|r| {
            // SAFETY: a Q8_0 block starts with its 2-byte scale.
            unsafe { f16_at(acts[r][i].as_ptr()) }
        });
        for k in 0..4 {
            let dw = halves(widen(e, k));
            let c: [int8x16_t; 8] = std::array::from_fn(|j| {
                let run = ld(g, PQS + 64 * (j / 2) + 16 * k);
                let idx = if j % 2 == 0 {
                    vandq_u8(run, low4)
                } else {
                    vshrq_n_u8::<4>(run)
                };
                vqtbl1q_s8(t, idx)
            });
            for r in 0..N {
                // SAFETY: the caller guarantees the level's features.
                let s = unsafe { L::quad(&c, &acts[r][i]) };
                let dd = vmulq_f32(vdupq_n_f32(da[r]), dw);
                sum[r][k] = vaddq_f32(sum[r][k], vmulq_f32(dd, vcvtq_f32_s32(s)));
            }
        }
    }
    let mut out = [[0f32; KPANEL]; N];
    for (o, s) in out.iter_mut().zip(sum) {
        for (k, v) in s.into_iter().enumerate() {
            // SAFETY: `o` holds 16 f32; lanes 4k..4k + 4.
            unsafe { vst1q_f32(o.as_mut_ptr().add(4 * k), v) };
        }
    }
    out
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
    for p in 0..n_w / KPANEL {
        let pw = &w[p * nb * GROUP..(p + 1) * nb * GROUP];
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
                    let acts: [&[[u8; AB]]; $k] =
                        std::array::from_fn(|j| blocks::<AB>(&a[(r + j) * a_stride..], nb));
                    // SAFETY: installed only where the level's features exist.
                    put(&unsafe { panel::<L, $k>(pw, nb, acts) })
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
}

/// The decode form: whole panels against one activation row.
pub(super) fn dot_panels<L: Level>(n: usize, w: &[u8], a: &[u8], out: &mut [f32]) {
    let n_w = out.len();
    gemm_panels::<L>(n, w, n_w, a, 0, 1, out, n_w);
}

impl PanelKernel for Plain {
    const GEMM: crate::dispatch::PanelGemmFn = gemm_panels::<Plain>;
}

impl PanelKernel for Sdot {
    const GEMM: crate::dispatch::PanelGemmFn = gemm_panels::<Sdot>;
}

/// MXFP4's panel kernels at level `L`: decode and prefill over repacked panels, and the row
/// kernels (rows in the GGUF layout, laid out as panels on the way).
pub(super) fn entry<L: Level + PanelKernel>(entry: &mut crate::dispatch::TypeKernels) {
    use crate::repack::mxpanel;
    entry.dot_panels = Some(dot_panels::<L>);
    entry.gemm_panels = Some(gemm_panels::<L>);
    entry.vec_dot_rows = Some(mxpanel::vec_dot_rows::<L>);
    entry.vec_dot_tile = Some(mxpanel::vec_dot_tile::<L>);
    entry.kgemm = Some(mxpanel::kgemm::<L>);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::repack::mxpanel::{check_gemm_panels, check_row_kernels};

    #[test]
    fn every_level_gives_the_reference_bits() {
        check_gemm_panels(gemm_panels::<Plain>, "neon");
        check_row_kernels::<Plain>("neon");
        if !super::super::available_dotprod() {
            eprintln!("SKIPPED neon mxfp4_panel at dotprod: no dotprod here");
            return;
        }
        check_gemm_panels(gemm_panels::<Sdot>, "neon+dotprod");
        check_row_kernels::<Sdot>("neon+dotprod");
    }
}
