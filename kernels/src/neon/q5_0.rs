//! Q5_0 (NEON): nibbles plus a fifth bit, minus 16, dotted with Q8_0 by the shared legacy tile.

use super::q8_0::{bits_to_bytes, nibbles, Legacy};
use crate::quants::{q5_0, q8_0};
use core::arch::aarch64::*;

pub(super) struct Q5_0;

impl Legacy for Q5_0 {
    const BLOCK: usize = q5_0::BLOCK;
    const ABLOCK: usize = q8_0::BLOCK;
    const AQS: usize = 2;
    const MIN: bool = false;

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn unpack(p: *const u8) -> [int8x16_t; 2] {
        // SAFETY: qh is at bytes 2..6 and the nibbles at 6..22 (caller: BLOCK bytes at p).
        let (q, h) = unsafe { (nibbles(p.add(6)), bits_to_bytes(p.add(2))) };
        // (q | h<<4) − 16 as a signed byte: q when the bit is set, q | 0xf0 (= q − 16) when not.
        let f0 = vdupq_n_u8(0xf0);
        [0, 1].map(|k| vreinterpretq_s8_u8(vorrq_u8(q[k], vbicq_u8(f0, h[k]))))
    }
}
