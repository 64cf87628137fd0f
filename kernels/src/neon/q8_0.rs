//! Q8_0 and Q8_1 (NEON), and the machinery shared by every 32-element ("legacy") block format:
//! a format says how to unpack one block into 32 signed bytes (`Legacy`), and the generic tile
//! here does the rest, at every level.
//!
//! Per block and per (weight row, activation row) pair, the 32 products are summed as exact
//! integers (`Dot`); four consecutive blocks' sums are gathered into the lanes of one vector
//! (two pairwise adds), converted to f32 and accumulated with one FMA by the four blocks' scale
//! products. Formats with a minimum add `m·s` with a second FMA. Every form (single, multi,
//! rows, tile, and the i8mm GEMM) runs exactly these float operations per pair, so they agree
//! bit for bit, and every level does, since only the exact integer sums differ in how they are
//! formed.

use super::{f16_at, f16x4, u16_at, Dot};
use crate::dispatch::TypeKernels;
use crate::quants::common::{check_blocks, check_dot, last_row};
use crate::quants::{q8_0, q8_1};
use core::arch::aarch64::*;
use core::arch::asm;

/// Elements per block of every legacy format.
pub(super) const QK: usize = 32;

/// One 32-element weight block format, dotted with Q8_0 or Q8_1 activations.
pub(super) trait Legacy: 'static {
    /// Bytes per weight block. The f16 scale `d` is always at offset 0.
    const BLOCK: usize;
    /// Bytes per activation block (34 for Q8_0, 36 for Q8_1).
    const ABLOCK: usize;
    /// Offset of the 32 activation quants in an activation block.
    const AQS: usize;
    /// True when x = d·q + m with an f16 minimum `m` at offset 2 (Q4_1, Q5_1), dotted with
    /// Q8_1, whose f16 `s` at offset 2 carries the m term.
    const MIN: bool;

    /// The 32 quants of the block at `p` as signed bytes (elements 0..16, then 16..32).
    ///
    /// # Safety
    /// `p` points to `BLOCK` readable bytes.
    unsafe fn unpack(p: *const u8) -> [int8x16_t; 2];
}

/// Lanes 0..4 of the f16 at offset `off` of blocks `i..i + k` (`k` ≤ 4) of the row at `p`,
/// `size` bytes each, as the u16s of a u64 (missing lanes 0).
///
/// # Safety
/// Blocks `i..i + k` lie inside the row.
#[inline]
#[target_feature(enable = "neon")]
pub(super) unsafe fn halves(p: *const u8, size: usize, off: usize, i: usize, k: usize) -> u64 {
    let mut v = 0u64;
    for j in 0..k {
        // SAFETY: block i + j lies inside the row (caller) and `off + 2` inside a block.
        v |= unsafe { u16_at(p.add((i + j) * size + off)) } << (16 * j);
    }
    v
}

/// The exact sums of blocks `i..i + 4` of one pair, one per lane, from each block's four
/// partial lanes (`parts[j]`, zero beyond the row).
#[inline]
#[target_feature(enable = "neon")]
pub(super) fn gather(parts: [int32x4_t; 4]) -> int32x4_t {
    vpaddq_s32(
        vpaddq_s32(parts[0], parts[1]),
        vpaddq_s32(parts[2], parts[3]),
    )
}

/// Running sums of one pair: `d·q` terms and (formats with a minimum) `m·s` terms, four
/// blocks per lane set.
#[derive(Clone, Copy)]
pub(super) struct Acc {
    pub(super) v: float32x4_t,
    pub(super) m: float32x4_t,
}

impl Acc {
    #[inline]
    #[target_feature(enable = "neon")]
    pub(super) fn zero() -> Acc {
        Acc {
            v: vdupq_n_f32(0.0),
            m: vdupq_n_f32(0.0),
        }
    }

    /// Adds four blocks: exact integer sums `sums`, weight and activation scales `dw`, `da`,
    /// and (formats with a minimum) weight minima `mw` and activation sums `sa`.
    #[inline]
    #[target_feature(enable = "neon")]
    pub(super) fn add<B: Legacy>(
        &mut self,
        sums: int32x4_t,
        dw: float32x4_t,
        da: float32x4_t,
        mw: float32x4_t,
        sa: float32x4_t,
    ) {
        self.v = vfmaq_f32(self.v, vmulq_f32(dw, da), vcvtq_f32_s32(sums));
        if B::MIN {
            self.m = vfmaq_f32(self.m, mw, sa);
        }
    }

    #[inline]
    #[target_feature(enable = "neon")]
    pub(super) fn total<B: Legacy>(self) -> f32 {
        let v = vaddvq_f32(self.v);
        if B::MIN {
            v + vaddvq_f32(self.m)
        } else {
            v
        }
    }
}

/// Adds blocks `i..i + k` (k ≤ 4) of every pair to `acc`. Always inlined, so the main loop's
/// constant 4 unrolls the block loop and `D::dot` inlines into the level's function.
///
/// # Safety
/// Blocks `i..i + k` lie inside every row; the CPU has `D`'s features.
#[inline(always)]
unsafe fn group<B: Legacy, D: Dot, const W: usize, const R: usize>(
    acc: &mut [[Acc; W]; R],
    w: [*const u8; W],
    a: [*const u8; R],
    i: usize,
    k: usize,
) {
    // SAFETY: NEON is part of every aarch64 CPU; pointers and features as the caller
    // guarantees.
    unsafe {
        let zero = vdupq_n_s32(0);
        let mut parts = [[[zero; 4]; W]; R];
        for j in 0..k {
            let mut y = [[vdupq_n_s8(0); 2]; R];
            for (yr, ar) in y.iter_mut().zip(a) {
                // Block i + j lies inside every activation row (caller).
                let p = ar.add((i + j) * B::ABLOCK + B::AQS);
                *yr = [vld1q_s8(p.cast()), vld1q_s8(p.add(16).cast())];
            }
            for (o, wr) in w.iter().enumerate() {
                // Block i + j lies inside every weight row (caller).
                let q = B::unpack(wr.add((i + j) * B::BLOCK));
                for (r, yr) in y.iter().enumerate() {
                    parts[r][o][j] = D::dot(D::dot(zero, q[0], yr[0]), q[1], yr[1]);
                }
            }
        }
        let mut dw = [vdupq_n_f32(0.0); W];
        let mut mw = [vdupq_n_f32(0.0); W];
        for (o, wr) in w.iter().enumerate() {
            // Blocks i..i + k lie inside every weight row (caller).
            dw[o] = f16x4(halves(*wr, B::BLOCK, 0, i, k));
            if B::MIN {
                mw[o] = f16x4(halves(*wr, B::BLOCK, 2, i, k));
            }
        }
        for (r, ar) in a.iter().enumerate() {
            // Blocks i..i + k lie inside every activation row (caller).
            let da = f16x4(halves(*ar, B::ABLOCK, 0, i, k));
            let sa = if B::MIN {
                f16x4(halves(*ar, B::ABLOCK, 2, i, k))
            } else {
                vdupq_n_f32(0.0)
            };
            for o in 0..W {
                acc[r][o].add::<B>(gather(parts[r][o]), dw[o], da, mw[o], sa);
            }
        }
    }
}

/// Dots of `W` weight rows (starting at `w[o]`) with `R` activation rows (starting at `a[r]`),
/// `nb` blocks each: `[r][o]`. Each weight block is unpacked once for the `R` activation rows
/// and each activation block loaded once for the `W` weight rows.
///
/// # Safety
/// Every row holds `nb` blocks of its format; the CPU has `D`'s features.
#[inline]
#[target_feature(enable = "neon")]
pub(super) unsafe fn tile<B: Legacy, D: Dot, const W: usize, const R: usize>(
    nb: usize,
    w: [*const u8; W],
    a: [*const u8; R],
) -> [[f32; W]; R] {
    let mut acc = [[Acc::zero(); W]; R];
    let mut i = 0;
    while nb - i >= 4 {
        // SAFETY: blocks i..i + 4 lie inside every row (caller); the CPU has D's features.
        unsafe { group::<B, D, W, R>(&mut acc, w, a, i, 4) };
        i += 4;
    }
    if i < nb {
        // SAFETY: as above, blocks i..nb.
        unsafe { group::<B, D, W, R>(&mut acc, w, a, i, nb - i) };
    }
    let mut out = [[0f32; W]; R];
    for (orow, arow) in out.iter_mut().zip(&acc) {
        for (x, s) in orow.iter_mut().zip(arow) {
            *x = s.total::<B>();
        }
    }
    out
}

/// Installs the level-`D` legacy kernels of format `B`.
pub(super) fn entry<B: Legacy, D: Dot>(entry: &mut TypeKernels) {
    entry.dequantize = dequantize::<B>;
    entry.vec_dot = vec_dot::<B, D>;
    entry.vec_dot_multi = Some(vec_dot_multi::<B, D>);
    entry.vec_dot_rows = Some(vec_dot_rows::<B, D>);
    entry.vec_dot_tile = Some(vec_dot_tile::<B, D>);
}

/// `W` weight rows `w_stride` apart against `R` activation rows `a_stride` apart.
///
/// # Safety
/// As `tile`, for the rows named.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn tile_at<B: Legacy, D: Dot, const W: usize, const R: usize>(
    nb: usize,
    w: *const u8,
    w_stride: usize,
    a: *const u8,
    a_stride: usize,
) -> [[f32; W]; R] {
    let ws: [*const u8; W] = core::array::from_fn(|o| w.wrapping_add(o * w_stride));
    let as_: [*const u8; R] = core::array::from_fn(|r| a.wrapping_add(r * a_stride));
    // SAFETY: forwarded from the caller.
    unsafe { D::legacy::<B, W, R>(nb, ws, as_) }
}

pub(super) fn vec_dot<B: Legacy, D: Dot>(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, QK, w, B::BLOCK, a, B::ABLOCK);
    debug_assert!(D::available());
    // SAFETY: `check_dot` proved both rows hold `nb` blocks; the CPU has D's features (this
    // function is only installed after detection).
    let [[v]] = unsafe { tile_at::<B, D, 1, 1>(nb, w.as_ptr(), 0, a.as_ptr(), 0) };
    v
}

/// One weight row against `out.len()` activation rows `stride` bytes apart: 4, then 2, then 1.
pub(super) fn vec_dot_multi<B: Legacy, D: Dot>(
    n: usize,
    w: &[u8],
    a: &[u8],
    stride: usize,
    out: &mut [f32],
) {
    let Some(start) = last_row("vec_dot_multi", out.len(), stride, a.len()) else {
        return;
    };
    let nb = check_dot(n, QK, w, B::BLOCK, &a[start..], B::ABLOCK);
    debug_assert!(D::available());
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let mut r = 0;
    while out.len() - r >= 4 {
        // SAFETY: rows r..r + 4 exist and hold `nb` blocks (the last one was checked); the CPU
        // has D's features (installed only after detection).
        let v = unsafe { tile_at::<B, D, 1, 4>(nb, wp, 0, ap.add(r * stride), stride) };
        for (x, v) in out[r..r + 4].iter_mut().zip(v) {
            *x = v[0];
        }
        r += 4;
    }
    while r < out.len() {
        // SAFETY: as above, one row.
        let [[v]] = unsafe { tile_at::<B, D, 1, 1>(nb, wp, 0, ap.add(r * stride), 0) };
        out[r] = v;
        r += 1;
    }
}

/// `out.len()` weight rows `w_stride` bytes apart against one activation row: 4, then 1.
///
/// # Safety
/// Every weight row holds `nb` blocks, the activation row `nb` activation blocks; the CPU has
/// D's features.
unsafe fn wmulti<B: Legacy, D: Dot>(
    nb: usize,
    w: *const u8,
    w_stride: usize,
    a: *const u8,
    out: &mut [f32],
) {
    let mut o = 0;
    while out.len() - o >= 4 {
        // SAFETY: weight rows o..o + 4 exist (caller).
        let [v] = unsafe { tile_at::<B, D, 4, 1>(nb, w.add(o * w_stride), w_stride, a, 0) };
        out[o..o + 4].copy_from_slice(&v);
        o += 4;
    }
    while o < out.len() {
        // SAFETY: weight row o exists (caller).
        let [[v]] = unsafe { tile_at::<B, D, 1, 1>(nb, w.add(o * w_stride), 0, a, 0) };
        out[o] = v;
        o += 1;
    }
}

pub(super) fn vec_dot_rows<B: Legacy, D: Dot>(
    n: usize,
    w: &[u8],
    w_stride: usize,
    a: &[u8],
    out: &mut [f32],
) {
    let Some(start) = last_row("vec_dot_rows", out.len(), w_stride, w.len()) else {
        return;
    };
    let nb = check_dot(n, QK, &w[start..], B::BLOCK, a, B::ABLOCK);
    assert!(
        out.len() == 1 || w_stride >= nb * B::BLOCK,
        "vec_dot_rows: stride {w_stride} shorter than a row"
    );
    debug_assert!(D::available());
    // SAFETY: the last weight row (and so every earlier one) holds `nb` blocks and the
    // activation row `nb` activation blocks (checked above); the CPU has D's features.
    unsafe { wmulti::<B, D>(nb, w.as_ptr(), w_stride, a.as_ptr(), out) }
}

/// `n_w` weight rows against `n_a` activation rows in 2 × 2 tiles, then the single-row forms.
#[allow(clippy::too_many_arguments)]
pub(super) fn vec_dot_tile<B: Legacy, D: Dot>(
    n: usize,
    w: &[u8],
    w_stride: usize,
    n_w: usize,
    a: &[u8],
    a_stride: usize,
    n_a: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    if n_w == 0 || n_a == 0 {
        return;
    }
    let (Some(w_last), Some(a_last)) = (
        last_row("vec_dot_tile: weight", n_w, w_stride, w.len()),
        last_row("vec_dot_tile: activation", n_a, a_stride, a.len()),
    ) else {
        return;
    };
    let nb = check_dot(n, QK, &w[w_last..], B::BLOCK, &a[a_last..], B::ABLOCK);
    assert!(
        (n_w == 1 || w_stride >= nb * B::BLOCK) && (n_a == 1 || a_stride >= nb * B::ABLOCK),
        "vec_dot_tile: a stride is shorter than a row"
    );
    assert!(
        out.len() >= (n_a - 1) * out_stride + n_w,
        "vec_dot_tile: output too small"
    );
    debug_assert!(D::available());
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let mut r = 0;
    while r < n_a {
        if n_a - r >= 2 {
            let mut o = 0;
            while n_w - o >= 2 {
                // SAFETY: rows r, r + 1 and o, o + 1 exist and hold `nb` blocks (checked
                // above); the CPU has D's features (installed only after detection).
                let v = unsafe {
                    tile_at::<B, D, 2, 2>(
                        nb,
                        wp.add(o * w_stride),
                        w_stride,
                        ap.add(r * a_stride),
                        a_stride,
                    )
                };
                out[r * out_stride + o..r * out_stride + o + 2].copy_from_slice(&v[0]);
                out[(r + 1) * out_stride + o..(r + 1) * out_stride + o + 2].copy_from_slice(&v[1]);
                o += 2;
            }
            if o < n_w {
                // SAFETY: as above, one weight row.
                let v = unsafe {
                    tile_at::<B, D, 1, 2>(
                        nb,
                        wp.add(o * w_stride),
                        0,
                        ap.add(r * a_stride),
                        a_stride,
                    )
                };
                out[r * out_stride + o] = v[0][0];
                out[(r + 1) * out_stride + o] = v[1][0];
            }
            r += 2;
        } else {
            // SAFETY: as above, one activation row and every weight row.
            unsafe {
                wmulti::<B, D>(
                    nb,
                    wp,
                    w_stride,
                    ap.add(r * a_stride),
                    &mut out[r * out_stride..r * out_stride + n_w],
                )
            };
            r += 1;
        }
    }
}

/// Decodes whole blocks: x = d·q, or d·q + m (a multiply then an add, not an FMA, so results
/// equal the scalar reference bit for bit).
pub(super) fn dequantize<B: Legacy>(src: &[u8], dst: &mut [f32]) {
    let nb = check_blocks(src.len(), dst.len(), QK, B::BLOCK);
    // SAFETY: `check_blocks` proved `src` holds `nb` blocks and `dst` their floats; NEON is
    // part of every aarch64 CPU.
    unsafe { dequantize_blocks::<B>(nb, src.as_ptr(), dst) }
}

/// # Safety
/// `src` holds `nb` blocks and `dst` at least `nb * 32` floats.
#[target_feature(enable = "neon")]
unsafe fn dequantize_blocks<B: Legacy>(nb: usize, src: *const u8, dst: &mut [f32]) {
    for (i, y) in dst.chunks_exact_mut(QK).take(nb).enumerate() {
        // SAFETY: block i lies inside `src` (caller).
        let (q, d, m) = unsafe {
            let p = src.add(i * B::BLOCK);
            (
                B::unpack(p),
                f16_at(p),
                if B::MIN { f16_at(p.add(2)) } else { 0.0 },
            )
        };
        let (vd, vm) = (vdupq_n_f32(d), vdupq_n_f32(m));
        for (h, qh) in q.into_iter().enumerate() {
            let w16 = [vmovl_s8(vget_low_s8(qh)), vmovl_high_s8(qh)];
            for (k, w) in w16.into_iter().enumerate() {
                let parts = [vmovl_s16(vget_low_s16(w)), vmovl_high_s16(w)];
                for (t, p) in parts.into_iter().enumerate() {
                    let f = vmulq_f32(vd, vcvtq_f32_s32(p));
                    let f = if B::MIN { vaddq_f32(f, vm) } else { f };
                    let at = 16 * h + 8 * k + 4 * t;
                    // SAFETY: `y` holds 32 floats and `at + 4 <= 32`.
                    unsafe { vst1q_f32(y.as_mut_ptr().add(at), f) };
                }
            }
        }
    }
}

/// Q8_0 weights.
pub(super) struct Q8_0;

impl Legacy for Q8_0 {
    const BLOCK: usize = q8_0::BLOCK;
    const ABLOCK: usize = q8_0::BLOCK;
    const AQS: usize = 2;
    const MIN: bool = false;

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn unpack(p: *const u8) -> [int8x16_t; 2] {
        // SAFETY: the block's 32 quants follow its 2-byte scale (caller: BLOCK bytes).
        unsafe { [vld1q_s8(p.add(2).cast()), vld1q_s8(p.add(18).cast())] }
    }
}

/// Q8_1 as weights (Q8_1 · Q8_1; its sum field is not needed).
pub(super) struct Q8_1;

impl Legacy for Q8_1 {
    const BLOCK: usize = q8_1::BLOCK;
    const ABLOCK: usize = q8_1::BLOCK;
    const AQS: usize = 4;
    const MIN: bool = false;

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn unpack(p: *const u8) -> [int8x16_t; 2] {
        // SAFETY: the block's 32 quants follow its scale and sum (caller: BLOCK bytes).
        unsafe { [vld1q_s8(p.add(4).cast()), vld1q_s8(p.add(20).cast())] }
    }
}

/// 32 nibbles from the 16 bytes at `p`: low nibbles (elements 0..16), then high (16..32).
///
/// # Safety
/// `p` points to 16 readable bytes.
#[inline]
#[target_feature(enable = "neon")]
pub(super) unsafe fn nibbles(p: *const u8) -> [uint8x16_t; 2] {
    // SAFETY: 16 readable bytes (caller).
    let raw = unsafe { vld1q_u8(p) };
    [vandq_u8(raw, vdupq_n_u8(0x0f)), vshrq_n_u8::<4>(raw)]
}

/// Byte j is 0xff when bit j of the little-endian u32 at `p` is set, else 0 (elements 0..16,
/// then 16..32).
///
/// # Safety
/// `p` points to 4 readable bytes.
#[inline]
#[target_feature(enable = "neon")]
pub(super) unsafe fn bits_to_bytes(p: *const u8) -> [uint8x16_t; 2] {
    // SAFETY: 4 readable bytes (caller); `read_unaligned` has no alignment requirement.
    let bits = u32::from_le(unsafe { p.cast::<u32>().read_unaligned() });
    let b = bits.to_le_bytes();
    let spread = |lo: u8, hi: u8| vcombine_u8(vdup_n_u8(lo), vdup_n_u8(hi));
    let bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040_2010_0804_0201));
    [
        vtstq_u8(spread(b[0], b[1]), bit),
        vtstq_u8(spread(b[2], b[3]), bit),
    ]
}

/// `v` as f16 bits, rounded to nearest even (as `half::f16::from_f32`), with `fcvtn` (the f16
/// vector types are unstable on stable Rust).
#[inline]
#[target_feature(enable = "neon")]
fn to_f16_bits(v: f32) -> u16 {
    let h: uint16x4_t;
    // SAFETY: `fcvtn` reads and writes registers only (base AArch64).
    unsafe {
        asm!(
            "fcvtn {0:v}.4h, {1:v}.4s",
            lateout(vreg) h,
            in(vreg) vdupq_n_f32(v),
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    vget_lane_u16::<0>(h)
}

/// Quantizes `nb` blocks to Q8_0 (`SUM` = false: 34-byte blocks) or Q8_1 (`SUM` = true:
/// 36-byte blocks with s = d·Σq), with the reference's arithmetic: d = amax / 127, id = 1 / d,
/// q = round half away from zero (`fcvtas`, saturated to i8 as `as i8` does) of x · id.
///
/// # Safety
/// `src` holds `nb * 32` floats and `dst` has room for `nb` blocks.
#[target_feature(enable = "neon")]
unsafe fn quantize_blocks<const SUM: bool>(nb: usize, src: *const f32, dst: *mut u8) {
    let (block, qs) = if SUM {
        (q8_1::BLOCK, 4)
    } else {
        (q8_0::BLOCK, 2)
    };
    for i in 0..nb {
        // SAFETY: the 32 inputs of block i lie inside `src` (caller).
        let x: [float32x4_t; 8] = unsafe {
            let p = src.add(i * QK);
            core::array::from_fn(|k| vld1q_f32(p.add(4 * k)))
        };
        // `fmaxnm` ignores NaN as `f32::max` does.
        let mut m = vabsq_f32(x[0]);
        for v in &x[1..] {
            m = vmaxnmq_f32(m, vabsq_f32(*v));
        }
        let amax = vmaxnmvq_f32(m).max(0.0);
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q: [int32x4_t; 8] = x.map(|v| vcvtaq_s32_f32(vmulq_n_f32(v, id)));
        let h: [int16x8_t; 4] =
            core::array::from_fn(|k| vqmovn_high_s32(vqmovn_s32(q[2 * k]), q[2 * k + 1]));
        let b = [
            vqmovn_high_s16(vqmovn_s16(h[0]), h[1]),
            vqmovn_high_s16(vqmovn_s16(h[2]), h[3]),
        ];
        let out = dst.wrapping_add(i * block);
        // SAFETY: block i (`block` bytes) lies inside `dst` (caller); `qs + 32 <= block`.
        unsafe {
            vst1q_s8(out.add(qs).cast(), b[0]);
            vst1q_s8(out.add(qs + 16).cast(), b[1]);
            out.cast::<u16>().write_unaligned(to_f16_bits(d).to_le());
        }
        if SUM {
            let sum = vaddlvq_s8(b[0]) as i32 + vaddlvq_s8(b[1]) as i32;
            // SAFETY: the sum occupies bytes 2..4 of a Q8_1 block.
            unsafe {
                out.add(2)
                    .cast::<u16>()
                    .write_unaligned(to_f16_bits(sum as f32 * d).to_le())
            };
        }
    }
}

fn quantize_rows<const SUM: bool>(src: &[f32], dst: &mut [u8]) {
    let block = if SUM { q8_1::BLOCK } else { q8_0::BLOCK };
    let nb = check_blocks(dst.len(), src.len(), QK, block);
    // SAFETY: `check_blocks` proved `dst` holds `nb` blocks for the `nb * 32` floats of `src`;
    // NEON is part of every aarch64 CPU.
    unsafe { quantize_blocks::<SUM>(nb, src.as_ptr(), dst.as_mut_ptr()) }
}

/// Q8_0 quantization, byte-identical to `quants::q8_0::quantize`.
pub(super) fn quantize_q8_0(src: &[f32], dst: &mut [u8]) {
    quantize_rows::<false>(src, dst);
}

/// Q8_1 quantization, byte-identical to `quants::q8_1::quantize`.
pub(super) fn quantize_q8_1(src: &[f32], dst: &mut [u8]) {
    quantize_rows::<true>(src, dst);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_matches_reference_bytes() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let mut inputs = vec![
            vec![0.0; 64],
            // amax 127: d = 1, id = 1, so exact ties at ±k.5 must round away from zero.
            (0..64)
                .map(|j| {
                    if j == 0 {
                        127.0
                    } else {
                        (j as f32 - 32.0) + 0.5
                    }
                })
                .collect::<Vec<f32>>(),
            (0..64).map(|j| -((j % 7) as f32) * 1e-30).collect(),
            (0..64)
                .map(|j| if j % 2 == 0 { 3.0 } else { -3.0 })
                .collect(),
        ];
        // 1e7: d overflows f16 to infinity; 1e-6: d is an f16 subnormal.
        for scale in [1e-6f32, 1e-3, 1.0, 1e4, 1e7] {
            for _ in 0..20 {
                inputs.push((0..256).map(|_| next() * scale).collect());
            }
        }
        for x in inputs {
            let mut want = vec![0u8; x.len() / QK * q8_0::BLOCK];
            let mut got = vec![0u8; want.len()];
            q8_0::quantize(&x, &mut want);
            quantize_q8_0(&x, &mut got);
            assert_eq!(got, want, "Q8_0 {:?}", &x[..4]);
            let mut want = vec![0u8; x.len() / QK * q8_1::BLOCK];
            let mut got = vec![0u8; want.len()];
            q8_1::quantize(&x, &mut want);
            quantize_q8_1(&x, &mut got);
            assert_eq!(got, want, "Q8_1 {:?}", &x[..4]);
        }
    }
}
