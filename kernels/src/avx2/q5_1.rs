//! Q5_1 (AVX2): unsigned 5-bit values with a minimum, dotted with Q8_1 by the shared legacy
//! loops.

use super::q8_0::{bits_to_bytes, nibbles, Legacy};
use crate::quants::{q5_1, q8_1};
use core::arch::x86_64::*;

pub(super) struct Q5_1;

impl Legacy for Q5_1 {
    const BLOCK: usize = q5_1::BLOCK;
    const ABLOCK: usize = q8_1::BLOCK;
    const AQS: usize = 4;
    const SIGNED: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> __m256i {
        // SAFETY: qh is at bytes 4..8 and the nibbles at 8..24 (caller: BLOCK bytes at p).
        let (q, h) = unsafe { (nibbles(p.add(8)), bits_to_bytes(p.add(4))) };
        _mm256_or_si256(q, _mm256_and_si256(h, _mm256_set1_epi8(0x10)))
    }
}
