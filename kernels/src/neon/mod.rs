//! NEON kernels for aarch64, one file per format family (as `avx2/`). Three levels, chosen at
//! start-up in `dispatch.rs`:
//! - `neon`: every aarch64 CPU (Advanced SIMD is part of the base architecture);
//! - `neon+dotprod`: the integer dot products with `sdot` (Armv8.4, optional from 8.2);
//! - `neon+i8mm`: the dotprod level plus an `smmla` prefill GEMM for the 32-element formats.
//!
//! Every integer block sum is exact at every level and reduced to one i32 per block before any
//! float arithmetic, so the three levels give the same bits, and within a level the single,
//! multi, rows, tile and GEMM forms agree bit for bit.
//!
//! `sdot` and `smmla` are unstable as intrinsics on stable Rust: they are issued with `asm!`
//! from functions compiled with the matching target feature.

use crate::dispatch::{Isa, TypeKernels};
use crate::types::GgmlType;
use core::arch::aarch64::*;
use core::arch::asm;

mod float;
mod gemm;
mod iq4_nl;
mod iq4_xs;
mod kgemm;
mod kquant;
mod mxfp4;
mod mxfp4_panel;
pub mod ops;
mod q2_k;
mod q3_k;
mod q4_0;
mod q4_1;
mod q4_k;
mod q4_k_panel;
mod q5_0;
mod q5_1;
mod q5_k;
mod q6_k;
mod q8_0;
mod q8_k;

/// True when this CPU has `sdot` (FEAT_DotProd).
pub fn available_dotprod() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}

/// True when this CPU has `sdot` and `smmla` (FEAT_I8MM).
pub fn available_i8mm() -> bool {
    available_dotprod() && std::arch::is_aarch64_feature_detected!("i8mm")
}

/// How a level sums i8 × i8 products, and the kernels compiled for that level. `dot` adds the
/// products of `x` and `y` to the lanes of `acc`; which products land in which lane differs
/// between levels, the total of the four lanes does not. It is exact: no pair of i16 products
/// overflows, since |x·y| ≤ 128 · 127 for the 32-element formats (whose activation quantizers
/// never produce −128), |x| ≤ 32 for the K-quant weights (Q8_K activations may be −128) and
/// |x| ≤ 127 for IQ4_XS's codebook (2 · 127 · 128 < 2^15).
trait Dot: Copy + 'static {
    /// True when this CPU has the level's features.
    fn available() -> bool;

    /// # Safety
    /// The CPU has the level's features.
    unsafe fn dot(acc: int32x4_t, x: int8x16_t, y: int8x16_t) -> int32x4_t;

    /// `q8_0::tile` compiled for this level.
    ///
    /// # Safety
    /// As `q8_0::tile`, and the CPU has the level's features.
    unsafe fn legacy<B: q8_0::Legacy, const W: usize, const R: usize>(
        nb: usize,
        w: [*const u8; W],
        a: [*const u8; R],
    ) -> [[f32; W]; R];

    /// `q8_k::rows` compiled for this level.
    ///
    /// # Safety
    /// As `q8_k::rows`, and the CPU has the level's features.
    unsafe fn kquant<K: q8_k::KQuant, const R: usize>(
        nb: usize,
        w: *const u8,
        a: [*const u8; R],
    ) -> [f32; R];
}

/// Baseline NEON: widening multiplies (`smull`, `smlal2`) and a pairwise widening add.
#[derive(Clone, Copy)]
struct Plain;

impl Dot for Plain {
    fn available() -> bool {
        true
    }

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn dot(acc: int32x4_t, x: int8x16_t, y: int8x16_t) -> int32x4_t {
        let p = vmull_s8(vget_low_s8(x), vget_low_s8(y));
        let p = vmlal_high_s8(p, x, y);
        vpadalq_s16(acc, p)
    }

    unsafe fn legacy<B: q8_0::Legacy, const W: usize, const R: usize>(
        nb: usize,
        w: [*const u8; W],
        a: [*const u8; R],
    ) -> [[f32; W]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { q8_0::tile::<B, Plain, W, R>(nb, w, a) }
    }

    unsafe fn kquant<K: q8_k::KQuant, const R: usize>(
        nb: usize,
        w: *const u8,
        a: [*const u8; R],
    ) -> [f32; R] {
        // SAFETY: forwarded from the caller.
        unsafe { q8_k::rows::<K, Plain, R>(nb, w, a) }
    }
}

/// `sdot`: four products into each i32 lane in one instruction.
#[derive(Clone, Copy)]
struct Sdot;

impl Dot for Sdot {
    fn available() -> bool {
        available_dotprod()
    }

    #[inline]
    #[target_feature(enable = "dotprod")]
    unsafe fn dot(mut acc: int32x4_t, x: int8x16_t, y: int8x16_t) -> int32x4_t {
        // SAFETY: `sdot` reads and writes registers only; the caller guarantees the CPU has
        // FEAT_DotProd.
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

    #[target_feature(enable = "dotprod")]
    unsafe fn legacy<B: q8_0::Legacy, const W: usize, const R: usize>(
        nb: usize,
        w: [*const u8; W],
        a: [*const u8; R],
    ) -> [[f32; W]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { q8_0::tile::<B, Sdot, W, R>(nb, w, a) }
    }

    #[target_feature(enable = "dotprod")]
    unsafe fn kquant<K: q8_k::KQuant, const R: usize>(
        nb: usize,
        w: *const u8,
        a: [*const u8; R],
    ) -> [f32; R] {
        // SAFETY: forwarded from the caller.
        unsafe { q8_k::rows::<K, Sdot, R>(nb, w, a) }
    }
}

/// Four f16 values (the little-endian u16s of `bits`, lowest first) widened to f32, exactly.
/// `fcvtl` is issued with `asm!`: the f16 vector types are unstable on stable Rust.
#[inline]
#[target_feature(enable = "neon")]
pub(super) fn f16x4(bits: u64) -> float32x4_t {
    let h = vcreate_u16(bits);
    let out: float32x4_t;
    // SAFETY: `fcvtl` reads and writes registers only; it is part of base AArch64 (FP and
    // Advanced SIMD).
    unsafe {
        asm!(
            "fcvtl {0:v}.4s, {1:v}.4h",
            lateout(vreg) out,
            in(vreg) h,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    out
}

/// Eight f16 values at `p` widened to f32 (two vectors, lowest first).
///
/// # Safety
/// `p` points to 16 readable bytes.
#[inline]
#[target_feature(enable = "neon")]
pub(super) unsafe fn f16x8(p: *const u8) -> [float32x4_t; 2] {
    // SAFETY: 16 readable bytes at `p` (caller); `vld1q` has no alignment requirement.
    let h = unsafe { vld1q_u16(p.cast()) };
    let (lo, hi): (float32x4_t, float32x4_t);
    // SAFETY: `fcvtl`/`fcvtl2` read and write registers only (base AArch64).
    unsafe {
        asm!(
            "fcvtl {0:v}.4s, {2:v}.4h",
            "fcvtl2 {1:v}.4s, {2:v}.8h",
            // `lo` is written before `h` is read again: not a late output.
            out(vreg) lo,
            lateout(vreg) hi,
            in(vreg) h,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    [lo, hi]
}

/// Little-endian u16 at `p`.
///
/// # Safety
/// `p` points to 2 readable bytes.
#[inline]
#[target_feature(enable = "neon")]
pub(super) unsafe fn u16_at(p: *const u8) -> u64 {
    // SAFETY: 2 readable bytes (caller); `read_unaligned` has no alignment requirement.
    u64::from(u16::from_le(unsafe { p.cast::<u16>().read_unaligned() }))
}

/// One f16 at `p` as f32.
///
/// # Safety
/// `p` points to 2 readable bytes.
#[inline]
#[target_feature(enable = "neon")]
pub(super) unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: forwarded from the caller.
    vgetq_lane_f32::<0>(f16x4(unsafe { u16_at(p) }))
}

/// The NEON level: every format's dot products.
pub fn specialize(entry: &mut TypeKernels) {
    entry.isa = Isa::Neon;
    set_level::<Plain>(entry);
    if entry.ty == GgmlType::MXFP4 {
        mxfp4_panel::entry::<mxfp4_panel::Plain>(entry);
    }
}

/// The dotprod level: the NEON table with `sdot` for every integer dot product.
pub fn specialize_dotprod(entry: &mut TypeKernels) {
    entry.isa = Isa::NeonDotprod;
    set_level::<Sdot>(entry);
    // The K-quants' prefill through tiles of unpacked rows (`sdot` keeps each row in its lane;
    // the baseline's widening multiplies mix rows, so it keeps the row kernels).
    use crate::ktile::{Iq4Xs, Q2K, Q3K, Q4K, Q5K, Q6K};
    // Q4_K's decode over repacked panels: `sdot` keeps each row's products in its lane.
    if entry.ty == GgmlType::Q4_K {
        entry.dot_panels = Some(q4_k_panel::dot_panels);
    }
    // MXFP4's decode, prefill and row kernels over panels of 16 rows, with `sdot`.
    if entry.ty == GgmlType::MXFP4 {
        mxfp4_panel::entry::<Sdot>(entry);
    }
    entry.kgemm = match entry.ty {
        GgmlType::MXFP4 => entry.kgemm,
        GgmlType::Q4_K => Some(kgemm::kgemm::<Q4K>),
        GgmlType::Q5_K => Some(kgemm::kgemm::<Q5K>),
        GgmlType::Q6_K => Some(kgemm::kgemm::<Q6K>),
        GgmlType::Q3_K => Some(kgemm::kgemm::<Q3K>),
        GgmlType::Q2_K => Some(kgemm::kgemm::<Q2K>),
        GgmlType::IQ4_XS => Some(kgemm::kgemm::<Iq4Xs>),
        _ => None,
    };
}

/// The i8mm level: the dotprod table plus the `smmla` prefill GEMM of the 32-element formats.
pub fn specialize_i8mm(entry: &mut TypeKernels) {
    specialize_dotprod(entry);
    entry.isa = Isa::NeonI8mm;
    entry.gemm = match entry.ty {
        GgmlType::Q4_0 => Some(gemm::gemm::<q4_0::Q4_0>),
        GgmlType::Q4_1 => Some(gemm::gemm::<q4_1::Q4_1>),
        GgmlType::Q5_0 => Some(gemm::gemm::<q5_0::Q5_0>),
        GgmlType::Q5_1 => Some(gemm::gemm::<q5_1::Q5_1>),
        GgmlType::Q8_0 => Some(gemm::gemm::<q8_0::Q8_0>),
        GgmlType::Q8_1 => Some(gemm::gemm::<q8_0::Q8_1>),
        GgmlType::IQ4_NL => Some(gemm::gemm::<iq4_nl::Iq4Nl>),
        _ => None,
    };
}

/// The kernels both integer levels share, with `D` summing the integer products.
fn set_level<D: Dot>(entry: &mut TypeKernels) {
    match entry.ty {
        GgmlType::F32 => float::entry::<float::F32>(entry),
        GgmlType::F16 => float::entry::<float::F16>(entry),
        GgmlType::BF16 => float::entry::<float::BF16>(entry),
        GgmlType::Q4_0 => q8_0::entry::<q4_0::Q4_0, D>(entry),
        GgmlType::Q4_1 => q8_0::entry::<q4_1::Q4_1, D>(entry),
        GgmlType::Q5_0 => q8_0::entry::<q5_0::Q5_0, D>(entry),
        GgmlType::Q5_1 => q8_0::entry::<q5_1::Q5_1, D>(entry),
        GgmlType::Q8_0 => {
            q8_0::entry::<q8_0::Q8_0, D>(entry);
            // Activations are quantized to Q8_0 on every token: byte-identical to the
            // reference.
            entry.quantize = q8_0::quantize_q8_0;
        }
        GgmlType::Q8_1 => {
            q8_0::entry::<q8_0::Q8_1, D>(entry);
            entry.quantize = q8_0::quantize_q8_1;
        }
        GgmlType::Q4_K => q8_k::entry::<q4_k::Q4K, D>(entry),
        GgmlType::Q5_K => q8_k::entry::<q5_k::Q5K, D>(entry),
        GgmlType::Q6_K => q8_k::entry::<q6_k::Q6K, D>(entry),
        // Activations are quantized to Q8_K on every token: byte-identical to the reference.
        GgmlType::Q8_K => entry.quantize = q8_k::quantize,
        GgmlType::Q2_K => q8_k::entry::<q2_k::Q2K, D>(entry),
        GgmlType::Q3_K => q8_k::entry::<q3_k::Q3K, D>(entry),
        GgmlType::IQ4_NL => q8_0::entry::<iq4_nl::Iq4Nl, D>(entry),
        GgmlType::IQ4_XS => q8_k::entry::<iq4_xs::Iq4Xs, D>(entry),
        // Its one-row dot, and the rest through panels of 16 rows in the lanes of four
        // registers (`mxfp4_panel.rs`): the reference's bits everywhere.
        // (`specialize*` add the panel kernels of their level).
        GgmlType::MXFP4 => entry.vec_dot = mxfp4::vec_dot,
    }
    // The weight quantizers' scale searches, eight sub-blocks at a time (`ringllm convert`):
    // the reference's bytes.
    match entry.ty {
        GgmlType::Q4_K => entry.quantize = kquant::quantize_q4_k,
        GgmlType::Q5_K => entry.quantize = kquant::quantize_q5_k,
        GgmlType::Q6_K => entry.quantize = kquant::quantize_q6_k,
        GgmlType::Q3_K => entry.quantize = kquant::quantize_q3_k,
        _ => {}
    }
}

#[cfg(test)]
mod tests;
