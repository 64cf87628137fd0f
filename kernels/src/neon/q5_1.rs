//! Q5_1 (NEON): unsigned nibbles plus a fifth bit, with a minimum, dotted with Q8_1 by the
//! shared legacy tile.

use super::q8_0::{bits_to_bytes, nibbles, Legacy};
use crate::quants::{q5_1, q8_1};
use core::arch::aarch64::*;

pub(super) struct Q5_1;

impl Legacy for Q5_1 {
    const BLOCK: usize = q5_1::BLOCK;
    const ABLOCK: usize = q8_1::BLOCK;
    const AQS: usize = 4;
    const MIN: bool = true;

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn unpack(p: *const u8) -> [int8x16_t; 2] {
        // SAFETY: d, m, then qh at bytes 4..8 and the nibbles at 8..24 (caller: BLOCK bytes).
        let (q, h) = unsafe { (nibbles(p.add(8)), bits_to_bytes(p.add(4))) };
        let ten = vdupq_n_u8(0x10);
        [0, 1].map(|k| vreinterpretq_s8_u8(vorrq_u8(q[k], vandq_u8(h[k], ten))))
    }
}
