//! Q4_1 (NEON): unsigned nibbles with a minimum, dotted with Q8_1 by the shared legacy tile.

use super::q8_0::{nibbles, Legacy};
use crate::quants::{q4_1, q8_1};
use core::arch::aarch64::*;

pub(super) struct Q4_1;

impl Legacy for Q4_1 {
    const BLOCK: usize = q4_1::BLOCK;
    const ABLOCK: usize = q8_1::BLOCK;
    const AQS: usize = 4;
    const MIN: bool = true;

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn unpack(p: *const u8) -> [int8x16_t; 2] {
        // SAFETY: the 16 nibble bytes follow d and m (caller: BLOCK bytes at p). Nibbles are
        // below 128, so they read the same as signed bytes.
        unsafe { nibbles(p.add(4)) }.map(|v| vreinterpretq_s8_u8(v))
    }
}
