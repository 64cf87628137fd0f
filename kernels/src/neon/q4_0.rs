//! Q4_0 (NEON): nibbles minus 8, signed, dotted with Q8_0 by the shared legacy tile.

use super::q8_0::{nibbles, Legacy};
use crate::quants::{q4_0, q8_0};
use core::arch::aarch64::*;

pub(super) struct Q4_0;

impl Legacy for Q4_0 {
    const BLOCK: usize = q4_0::BLOCK;
    const ABLOCK: usize = q8_0::BLOCK;
    const AQS: usize = 2;
    const MIN: bool = false;

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn unpack(p: *const u8) -> [int8x16_t; 2] {
        // SAFETY: the 16 nibble bytes follow the 2-byte scale (caller: BLOCK bytes at p).
        let q = unsafe { nibbles(p.add(2)) };
        let eight = vdupq_n_s8(8);
        q.map(|v| vsubq_s8(vreinterpretq_s8_u8(v), eight))
    }
}
