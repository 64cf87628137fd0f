//! IQ4_NL (AVX2, VNNI, AVX-512): the 4-bit indices unpacked as Q4_0's nibbles and mapped
//! through the codebook with one `pshufb`, then dotted with Q8_0 by the shared legacy loops
//! (signed, as Q4_0) and the AVX-512 GEMM (the codebook biased by 128, as Q8_0's bytes).

use super::gemm512::{nibble_pair, Pair512};
use super::q8_0::{nibbles, Legacy};
use crate::quants::iq4_nl::{self, KVALUES};
use crate::quants::q8_0;
use core::arch::x86_64::*;

pub(super) struct Iq4Nl;

/// The codebook in both 128-bit lanes, as `pshufb` reads it.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn codebook() -> __m256i {
    // SAFETY: `KVALUES` is 16 readable bytes; `loadu` has no alignment requirement.
    let t = unsafe { _mm_loadu_si128(KVALUES.as_ptr().cast()) };
    _mm256_broadcastsi128_si256(t)
}

impl Legacy for Iq4Nl {
    const BLOCK: usize = iq4_nl::BLOCK;
    const ABLOCK: usize = q8_0::BLOCK;
    const AQS: usize = 2;
    const SIGNED: bool = true;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> __m256i {
        // SAFETY: the 16 index bytes follow the 2-byte scale (caller: BLOCK bytes at p).
        let q = unsafe { nibbles(p.add(2)) };
        _mm256_shuffle_epi8(codebook(), q)
    }
}

/// The codebook plus 128 (values 1..=241), in all four 128-bit lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn biased_codebook() -> __m512i {
    let t = _mm256_xor_si256(codebook(), _mm256_set1_epi8(0x80u8 as i8));
    _mm512_broadcast_i64x4(t)
}

// Header: d (2 bytes), then 16 index bytes; the biased values are w + 128.
impl Pair512 for Iq4Nl {
    const BIAS_SHIFT: u32 = 7;
    const HEADER: usize = 2;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn unpack_pair(p: *const u8) -> __m512i {
        // SAFETY: two readable blocks at `p` (caller).
        let q = unsafe { nibble_pair::<{ iq4_nl::BLOCK }, 2>(p) };
        _mm512_shuffle_epi8(biased_codebook(), q)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn unpack_rest_pair(q: *const u8) -> __m512i {
        // SAFETY: two readable 16-byte rests at `q` (caller).
        let q = unsafe { nibble_pair::<16, 0>(q) };
        _mm512_shuffle_epi8(biased_codebook(), q)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quants::common::put_f16;
    use crate::GgmlType;

    /// A block whose 32 indices are every value twice, and Q8_0 activations with ±127: the
    /// integer dot of the SIMD unpack equals the scalar `block_sum` exactly.
    #[test]
    fn unpack_is_the_codebook() {
        if !super::super::available() {
            return;
        }
        let mut b = [0u8; iq4_nl::BLOCK];
        put_f16(&mut b, 0, 1.0);
        for j in 0..16 {
            b[2 + j] = j as u8 | (((j * 7 + 3) % 16) as u8) << 4;
        }
        // SAFETY: AVX2 is available (checked); `b` is one block.
        let v = unsafe { Iq4Nl::unpack(b.as_ptr()) };
        let mut got = [0i8; 32];
        // SAFETY: `got` holds 32 bytes.
        unsafe { _mm256_storeu_si256(got.as_mut_ptr().cast(), v) };
        let mut want = [0f32; 32];
        iq4_nl::dequantize(&b, &mut want);
        for j in 0..32 {
            assert_eq!(f32::from(got[j]), want[j], "element {j}");
        }
    }

    /// The decode loops, tiles and rows at every level this CPU has give the reference's value
    /// within the summation-order budget, and each other's bits.
    #[test]
    fn every_level_agrees() {
        use crate::dispatch::TypeKernels;
        use crate::quants::scalar_kernels;
        if !super::super::available() {
            return;
        }
        let ty = GgmlType::IQ4_NL;
        let mut levels: Vec<TypeKernels> = Vec::new();
        let mut e = scalar_kernels(ty);
        super::super::specialize(&mut e);
        levels.push(e);
        if let Some(v) = super::super::vnni() {
            let mut e = scalar_kernels(ty);
            super::super::specialize_vnni(&mut e, v);
            levels.push(e);
            if super::super::gemm512::available() {
                let mut e = scalar_kernels(ty);
                super::super::specialize_avx512(&mut e, v);
                assert!(e.gemm.is_some() && e.gemm_packed.is_some());
                levels.push(e);
            }
        }
        let r = scalar_kernels(ty);
        let mut seed = 1u32;
        let mut next = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
        };
        for nb in [1usize, 2, 3, 7] {
            let n = 32 * nb;
            let x: Vec<f32> = (0..n).map(|_| next()).collect();
            let y: Vec<f32> = (0..n).map(|_| next()).collect();
            let mut w = vec![0u8; nb * iq4_nl::BLOCK];
            let mut a = vec![0u8; nb * q8_0::BLOCK];
            (r.quantize)(&x, &mut w);
            q8_0::quantize(&y, &mut a);
            let want = (r.vec_dot)(n, &w, &a);
            let mut first = None;
            for k in &levels {
                let got = (k.vec_dot)(n, &w, &a);
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{:?} {nb} blocks: {got} vs {want}",
                    k.isa
                );
                match first {
                    None => first = Some(got.to_bits()),
                    Some(f) => assert_eq!(got.to_bits(), f, "{:?} differs", k.isa),
                }
            }
        }
    }
}
