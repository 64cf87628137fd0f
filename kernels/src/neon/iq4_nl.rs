//! IQ4_NL (NEON): the 4-bit indices unpacked as Q4_0's nibbles and mapped through the codebook
//! with one `tbl` (`vqtbl1q_s8`) per 16, then dotted with Q8_0 by the shared legacy tile (and
//! the i8mm GEMM).

use super::q8_0::{nibbles, Legacy};
use crate::quants::iq4_nl::{self, KVALUES};
use crate::quants::q8_0;
use core::arch::aarch64::*;

pub(super) struct Iq4Nl;

/// The codebook as a table register.
#[inline]
#[target_feature(enable = "neon")]
pub(super) fn codebook() -> int8x16_t {
    // SAFETY: `KVALUES` is 16 readable bytes.
    unsafe { vld1q_s8(KVALUES.as_ptr()) }
}

impl Legacy for Iq4Nl {
    const BLOCK: usize = iq4_nl::BLOCK;
    const ABLOCK: usize = q8_0::BLOCK;
    const AQS: usize = 2;
    const MIN: bool = false;

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn unpack(p: *const u8) -> [int8x16_t; 2] {
        // SAFETY: the 16 index bytes follow the 2-byte scale (caller: BLOCK bytes at p).
        let q = unsafe { nibbles(p.add(2)) };
        let t = codebook();
        q.map(|v| vqtbl1q_s8(t, v))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn iq4_nl_matches_reference() {
        super::super::tests::check_legacy(crate::GgmlType::IQ4_NL);
    }
}
