//! MXFP4 (AVX2, and so every x86 level): a block's 4-bit codes unpacked as Q4_0's nibbles and
//! mapped through the doubled E2M1 table with one `pshufb`, multiplied with the Q8_0
//! activations by the sign trick (`|w|` times `sign(a, w)`; |w| ≤ 12, so `maddubs` never
//! saturates), summed exactly to one integer per block, and scaled and accumulated block by
//! block in the reference's order: the scalar reference's bits.

use super::q8_0::nibbles;
use crate::quants::common::check_dot;
use crate::quants::mxfp4::{self, scale_half, KVALUES};
use crate::quants::q8_0;
use core::arch::x86_64::*;

/// The table in both 128-bit lanes, as `pshufb` reads it.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn table() -> __m256i {
    // SAFETY: `KVALUES` is 16 readable bytes; `loadu` has no alignment requirement.
    let t = unsafe { _mm_loadu_si128(KVALUES.as_ptr().cast()) };
    _mm256_broadcastsi128_si256(t)
}

/// The f16 at `p` as f32 (exact).
///
/// # Safety
/// `p` points to 2 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: two readable bytes (caller); no alignment requirement.
    let h = u16::from_le(unsafe { p.cast::<u16>().read_unaligned() });
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
}

/// The exact integer dot of the MXFP4 block at `w` and the Q8_0 block at `a`.
///
/// # Safety
/// `w` points to a whole MXFP4 block and `a` to a whole Q8_0 block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_sum(w: *const u8, a: *const u8, t: __m256i) -> i32 {
    // SAFETY: the 16 code bytes follow the scale byte; the 32 quants follow the f16 scale.
    let (q, y) = unsafe { (nibbles(w.add(1)), _mm256_loadu_si256(a.add(2).cast())) };
    let v = _mm256_shuffle_epi8(t, q);
    let p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(y, v));
    let p32 = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
    let s = _mm_add_epi32(
        _mm256_castsi256_si128(p32),
        _mm256_extracti128_si256::<1>(p32),
    );
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, mxfp4::QK, w, mxfp4::BLOCK, a, q8_0::BLOCK);
    let t = table();
    let mut sum = 0f32;
    for i in 0..nb {
        // SAFETY: `check_dot` found nb whole blocks in `w` and `a`.
        unsafe {
            let pw = w.as_ptr().add(i * mxfp4::BLOCK);
            let pa = a.as_ptr().add(i * q8_0::BLOCK);
            let s = block_sum(pw, pa, t);
            sum += f16_at(pa) * scale_half(*pw) * s as f32;
        }
    }
    sum
}

/// `vec_dot` of the table (AVX2, FMA and F16C were detected before this table was chosen).
pub(super) fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    // SAFETY: the table holding this function is chosen only on a CPU with AVX2, FMA, F16C.
    unsafe { dot(n, w, a) }
}

#[cfg(test)]
mod tests {
    #[test]
    fn vec_dot_is_the_references_bits() {
        if !super::super::available() {
            return;
        }
        crate::quants::mxfp4::check_vec_dot(super::vec_dot);
    }
}
