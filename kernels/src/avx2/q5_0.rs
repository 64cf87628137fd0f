//! Q5_0 (AVX2): nibbles plus a fifth bit, minus 16, dotted with Q8_0 by the shared legacy
//! loops.

use super::q8_0::{bits_to_bytes, nibbles, Legacy};
use crate::quants::{q5_0, q8_0};
use core::arch::x86_64::*;

pub(super) struct Q5_0;

impl Legacy for Q5_0 {
    const BLOCK: usize = q5_0::BLOCK;
    const ABLOCK: usize = q8_0::BLOCK;
    const AQS: usize = 2;
    const SIGNED: bool = true;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> __m256i {
        // SAFETY: qh is at bytes 2..6 and the nibbles at 6..22 (caller: BLOCK bytes at p).
        let (q, h) = unsafe { (nibbles(p.add(6)), bits_to_bytes(p.add(2))) };
        // (q | h<<4) − 16 as a signed byte: q when the bit is set, q | 0xf0 (= q − 16) when not.
        _mm256_or_si256(q, _mm256_andnot_si256(h, _mm256_set1_epi8(0xf0u8 as i8)))
    }
}
