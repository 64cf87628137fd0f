//! Q4_0 (AVX2): nibbles minus 8, signed, dotted with Q8_0 by the shared legacy loops.

use super::q8_0::{nibbles, Legacy};
use crate::quants::{q4_0, q8_0};
use core::arch::x86_64::*;

pub(super) struct Q4_0;

impl Legacy for Q4_0 {
    const BLOCK: usize = q4_0::BLOCK;
    const ABLOCK: usize = q8_0::BLOCK;
    const AQS: usize = 2;
    const SIGNED: bool = true;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> __m256i {
        // SAFETY: the 16 nibble bytes follow the 2-byte scale (caller: BLOCK bytes at p).
        let q = unsafe { nibbles(p.add(2)) };
        _mm256_sub_epi8(q, _mm256_set1_epi8(8))
    }
}
