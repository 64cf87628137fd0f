//! Q4_1 (AVX2): unsigned nibbles with a minimum, dotted with Q8_1 by the shared legacy loops.

use super::q8_0::{nibbles, Legacy};
use crate::quants::{q4_1, q8_1};
use core::arch::x86_64::*;

pub(super) struct Q4_1;

impl Legacy for Q4_1 {
    const BLOCK: usize = q4_1::BLOCK;
    const ABLOCK: usize = q8_1::BLOCK;
    const AQS: usize = 4;
    const SIGNED: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> __m256i {
        // SAFETY: the 16 nibble bytes follow d and m (caller: BLOCK bytes at p).
        unsafe { nibbles(p.add(4)) }
    }
}
