//! The K-quant dot-product loops (NEON), shared by Q4_K, Q5_K and Q6_K: a format turns one
//! weight block and `R` Q8_K activation blocks into exact integer sums (`KQuant::block`, with
//! the level's `Dot`), and the loop here scales and accumulates them with the reference's own
//! float expression, so the NEON dots equal the scalar ones bit for bit.

use super::Dot;
use crate::dispatch::TypeKernels;
use crate::quants::q8_k::{self as q8, check_dot, check_dot_multi};
use crate::types::QK_K;
use core::arch::aarch64::*;

/// Bytes per Q8_K block.
pub(super) const AB: usize = q8::BLOCK_BYTES;
/// Offset of the quants in a Q8_K block.
pub(super) const AQS: usize = q8::QS;
/// Offset of the 16 i16 sums in a Q8_K block.
pub(super) const ABSUMS: usize = q8::BSUMS;

/// One K-quant weight format.
pub(super) trait KQuant: 'static {
    /// Bytes per weight block.
    const WB: usize;
    /// True when the format has minima (`x = d·sc·q − dmin·m`).
    const MIN: bool;

    /// `(d, dmin)` of the block at `w` (`dmin` = 0 without minima).
    ///
    /// # Safety
    /// `w` points to `WB` readable bytes.
    unsafe fn header(w: *const u8) -> (f32, f32);

    /// The exact integer sums of the block at `w` against the `R` activation blocks at `a`:
    /// `(Σ sc·Σq·a, Σ m·bsums)` per activation row.
    ///
    /// # Safety
    /// `w` points to `WB` readable bytes, every `a[r]` to a whole Q8_K block; the CPU has `D`'s
    /// features.
    unsafe fn block<D: Dot, const R: usize>(w: *const u8, a: [*const u8; R]) -> [(i32, i32); R];
}

/// Dots of the weight row at `w` with the `R` activation rows at `a`, `nb` blocks each. The
/// float steps per row are the reference's, in its order.
///
/// # Safety
/// Every row holds `nb` blocks; the CPU has `D`'s features.
#[inline]
#[target_feature(enable = "neon")]
pub(super) unsafe fn rows<K: KQuant, D: Dot, const R: usize>(
    nb: usize,
    w: *const u8,
    a: [*const u8; R],
) -> [f32; R] {
    let mut sum = [0f32; R];
    for i in 0..nb {
        // SAFETY: block i lies inside every row (caller); the CPU has D's features (caller).
        let (d, dmin, sums, ad) = unsafe {
            let wb = w.add(i * K::WB);
            let ab: [*const u8; R] = core::array::from_fn(|r| a[r].add(i * AB));
            let (d, dmin) = K::header(wb);
            let ad: [f32; R] = core::array::from_fn(|r| ab[r].cast::<f32>().read_unaligned());
            (d, dmin, K::block::<D, R>(wb, ab), ad)
        };
        for r in 0..R {
            let (sumi, summ) = sums[r];
            let ad = f32::from_bits(u32::from_le(ad[r].to_bits()));
            if K::MIN {
                sum[r] += ad * d * sumi as f32 - ad * dmin * summ as f32;
            } else {
                sum[r] += ad * d * sumi as f32;
            }
        }
    }
    sum
}

/// Installs the level-`D` kernels of K-quant format `K`.
pub(super) fn entry<K: KQuant, D: Dot>(entry: &mut TypeKernels) {
    entry.vec_dot = vec_dot::<K, D>;
    entry.vec_dot_multi = Some(vec_dot_multi::<K, D>);
}

pub(super) fn vec_dot<K: KQuant, D: Dot>(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, w, K::WB, a);
    debug_assert!(D::available());
    // SAFETY: `check_dot` proved both rows hold `nb` blocks; the CPU has D's features (this
    // function is only installed after detection).
    let [v] = unsafe { D::kquant::<K, 1>(nb, w.as_ptr(), [a.as_ptr()]) };
    v
}

pub(super) fn vec_dot_multi<K: KQuant, D: Dot>(
    n: usize,
    w: &[u8],
    a: &[u8],
    a_stride: usize,
    out: &mut [f32],
) {
    let nb = check_dot_multi(n, w, K::WB, a, a_stride, out.len());
    debug_assert!(D::available());
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    let mut r = 0;
    while out.len() - r >= 4 {
        let rows: [*const u8; 4] = core::array::from_fn(|k| ap.wrapping_add((r + k) * a_stride));
        // SAFETY: `check_dot_multi` proved every row holds `nb` blocks; the CPU has D's
        // features (installed only after detection).
        let v = unsafe { D::kquant::<K, 4>(nb, wp, rows) };
        out[r..r + 4].copy_from_slice(&v);
        r += 4;
    }
    while r < out.len() {
        // SAFETY: as above, one row.
        let [v] = unsafe { D::kquant::<K, 1>(nb, wp, [ap.wrapping_add(r * a_stride)]) };
        out[r] = v;
        r += 1;
    }
}

/// `Σ_j m_j · (bsums[2j] + bsums[2j+1])` for the eight minima `m` (one per byte) of a
/// Q4_K/Q5_K block and the Q8_K block at `a`, exactly.
///
/// # Safety
/// `a` points to a whole Q8_K block.
#[inline]
#[target_feature(enable = "neon")]
pub(super) unsafe fn mins_dot_bsums(m: u64, a: *const u8) -> i32 {
    // SAFETY: the 16 i16 sums lie inside the block (caller).
    let (b0, b1) = unsafe {
        (
            vld1q_s16(a.add(ABSUMS).cast()),
            vld1q_s16(a.add(ABSUMS + 16).cast()),
        )
    };
    // |bsum| ≤ 16 · 127, so a pair fits an i16.
    let pairs = vpaddq_s16(b0, b1);
    let mins = vreinterpretq_s16_u16(vmovl_u8(vcreate_u8(m)));
    let p = vmull_s16(vget_low_s16(pairs), vget_low_s16(mins));
    vaddvq_s32(vmlal_high_s16(p, pairs, mins))
}

/// The 16 activation quants at offset `off` of the Q8_K block at `a`.
///
/// # Safety
/// `a` points to a whole Q8_K block and `off + 16 <= QK_K`.
#[inline]
#[target_feature(enable = "neon")]
pub(super) unsafe fn aq(a: *const u8, off: usize) -> int8x16_t {
    debug_assert!(off + 16 <= QK_K);
    // SAFETY: inside the block's quants (caller).
    unsafe { vld1q_s8(a.add(AQS + off).cast()) }
}

/// Q8_K quantization (the activations of every K-quant dot, once per token), byte-identical
/// to `quants::q8_k::quantize`: the value of largest magnitude (the first on ties) gives
/// `iscale = −128 / max`, quants round half to even (`fcvtns`) and are clamped to 127.
pub(super) fn quantize(src: &[f32], dst: &mut [u8]) {
    let nb = q8::check_quantize(src, dst, AB);
    for (x, b) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(AB))
        .take(nb)
    {
        // SAFETY: `x` holds 256 floats and `b` a whole block; NEON is part of every aarch64 CPU.
        unsafe { quantize_block(x, b) };
    }
}

/// # Safety
/// `x` holds 256 floats and `b` at least one Q8_K block.
#[target_feature(enable = "neon")]
unsafe fn quantize_block(x: &[f32], b: &mut [u8]) {
    let mut m = vdupq_n_f32(0.0);
    for c in x.chunks_exact(4) {
        // SAFETY: `c` holds 4 floats. `fmaxnm` ignores NaN as the reference's `>` does.
        m = vmaxnmq_f32(m, vabsq_f32(unsafe { vld1q_f32(c.as_ptr()) }));
    }
    let amax = vmaxnmvq_f32(m);
    if amax == 0.0 || amax.is_nan() {
        b[..AB].fill(0);
        return;
    }
    // The first value of that magnitude, with its sign.
    let max = x.iter().copied().find(|v| v.abs() == amax).unwrap_or(amax);
    let iscale = -128.0 / max;
    let top = vdupq_n_s32(127);
    for (j, c) in x.chunks_exact(16).enumerate() {
        // SAFETY: `c` holds 16 floats.
        let q: [int32x4_t; 4] = unsafe {
            core::array::from_fn(|k| {
                vminq_s32(
                    vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(c.as_ptr().add(4 * k)), iscale)),
                    top,
                )
            })
        };
        let h = [
            vqmovn_high_s32(vqmovn_s32(q[0]), q[1]),
            vqmovn_high_s32(vqmovn_s32(q[2]), q[3]),
        ];
        let q8 = vqmovn_high_s16(vqmovn_s16(h[0]), h[1]);
        // SAFETY: quants 16j..16j + 16 lie inside the block.
        unsafe { vst1q_s8(b.as_mut_ptr().add(AQS + 16 * j).cast(), q8) };
        let s = vaddlvq_s8(q8);
        b[ABSUMS + 2 * j..ABSUMS + 2 * j + 2].copy_from_slice(&s.to_le_bytes());
    }
    b[..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_matches_reference_bytes() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let mut inputs: Vec<Vec<f32>> = vec![
            vec![0.0; QK_K],
            // Ties of magnitude: the first (negative here) sets the sign.
            (0..QK_K)
                .map(|j| match j {
                    3 => -2.0,
                    9 => 2.0,
                    _ => (j as f32 - 128.0) / 100.0,
                })
                .collect(),
            // Exact halves after scaling: round half to even.
            (0..QK_K)
                .map(|j| {
                    if j == 0 {
                        -128.0
                    } else {
                        (j % 64) as f32 - 31.5
                    }
                })
                .collect(),
        ];
        for scale in [1e-30f32, 1e-3, 1.0, 1e4, 1e30] {
            for _ in 0..10 {
                inputs.push((0..2 * QK_K).map(|_| next() * scale).collect());
            }
        }
        for x in inputs {
            let mut want = vec![0u8; x.len() / QK_K * AB];
            let mut got = vec![1u8; want.len()];
            q8::quantize(&x, &mut want);
            quantize(&x, &mut got);
            assert_eq!(got, want, "Q8_K {:?}", &x[..4]);
        }
    }
}
