//! Scalar reference implementations of the GGUF block formats, one file per family.
//! These are the oracle for every SIMD path; they favour clarity over speed.

pub mod common;
pub mod float;
pub mod iq4_nl;
pub mod iq4_xs;
pub mod mxfp4;
pub mod q2_k;
pub mod q3_k;
pub mod q4_0;
pub mod q4_1;
pub mod q4_k;
pub mod q5_0;
pub mod q5_1;
pub mod q5_k;
pub mod q6_k;
pub mod q8_0;
pub mod q8_1;
pub mod q8_k;

use crate::dispatch::{Isa, TypeKernels};
use crate::types::GgmlType;

/// The scalar kernel entry for `ty`.
pub fn scalar_kernels(ty: GgmlType) -> TypeKernels {
    macro_rules! entry {
        ($m:ident) => {
            TypeKernels {
                ty,
                isa: Isa::Scalar,
                dequantize: $m::dequantize,
                quantize: $m::quantize,
                vec_dot_type: $m::VEC_DOT_TYPE,
                vec_dot: $m::vec_dot,
                vec_dot_multi: None,
                vec_dot_rows: None,
                vec_dot_tile: None,
                gemm: None,
                gemm_packed: None,
                kgemm: None,
                dot_panels: None,
                gemm_panels: None,
            }
        };
    }
    match ty {
        GgmlType::F32 => TypeKernels {
            ty,
            isa: Isa::Scalar,
            dequantize: float::dequantize_f32,
            quantize: float::quantize_f32,
            vec_dot_type: GgmlType::F32,
            vec_dot: float::vec_dot_f32,
            vec_dot_multi: None,
            vec_dot_rows: None,
            vec_dot_tile: None,
            gemm: None,
            gemm_packed: None,
            kgemm: None,
            dot_panels: None,
            gemm_panels: None,
        },
        GgmlType::F16 => TypeKernels {
            ty,
            isa: Isa::Scalar,
            dequantize: float::dequantize_f16,
            quantize: float::quantize_f16,
            vec_dot_type: GgmlType::F32,
            vec_dot: float::vec_dot_f16,
            vec_dot_multi: None,
            vec_dot_rows: None,
            vec_dot_tile: None,
            gemm: None,
            gemm_packed: None,
            kgemm: None,
            dot_panels: None,
            gemm_panels: None,
        },
        GgmlType::BF16 => TypeKernels {
            ty,
            isa: Isa::Scalar,
            dequantize: float::dequantize_bf16,
            quantize: float::quantize_bf16,
            vec_dot_type: GgmlType::F32,
            vec_dot: float::vec_dot_bf16,
            vec_dot_multi: None,
            vec_dot_rows: None,
            vec_dot_tile: None,
            gemm: None,
            gemm_packed: None,
            kgemm: None,
            dot_panels: None,
            gemm_panels: None,
        },
        GgmlType::Q4_0 => entry!(q4_0),
        GgmlType::Q4_1 => entry!(q4_1),
        GgmlType::Q5_0 => entry!(q5_0),
        GgmlType::Q5_1 => entry!(q5_1),
        GgmlType::Q8_0 => entry!(q8_0),
        GgmlType::Q8_1 => entry!(q8_1),
        GgmlType::Q4_K => entry!(q4_k),
        GgmlType::Q5_K => entry!(q5_k),
        GgmlType::Q6_K => entry!(q6_k),
        GgmlType::Q8_K => entry!(q8_k),
        GgmlType::Q2_K => entry!(q2_k),
        GgmlType::Q3_K => entry!(q3_k),
        GgmlType::IQ4_NL => entry!(iq4_nl),
        GgmlType::IQ4_XS => entry!(iq4_xs),
        GgmlType::MXFP4 => entry!(mxfp4),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    /// The K-quant quantizers `ours` (Q4_K, Q5_K, Q6_K, Q3_K) against the reference, on rows
    /// with every kind of sub-block the search meets: normal values, heavy tails, all
    /// positive (the offset clamp), constant (no range), a single outlier, exact zeros, tiny
    /// and huge magnitudes, NaN: the bytes must be the reference quantizer's.
    pub(crate) fn check_kquant_quantizers(ours: [crate::dispatch::QuantizeFn; 4]) {
        use crate::quants::{q3_k, q4_k, q5_k, q6_k};
        use rand::rngs::StdRng;
        use rand::{Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(5);
        let n = 64 * crate::QK_K;
        let mut x = vec![0f32; n];
        for (k, v) in x.iter_mut().enumerate() {
            let sub = (k / 32) % 11;
            let u: f32 = rng.random_range(-1.0..1.0);
            *v = match sub {
                0 => u,
                1 => u * u * u * 40.0,
                2 => u.abs() + 0.25,
                3 => 0.75,
                4 => {
                    if k % 32 == 7 {
                        9.0
                    } else {
                        u * 0.01
                    }
                }
                5 => 0.0,
                6 => u * 1e-30,
                7 => u * 1e30,
                8 => {
                    if k % 32 == 3 {
                        f32::NAN
                    } else {
                        u
                    }
                }
                9 => -u.abs() - 1.0,
                _ => (u * 8.0).round() / 8.0,
            };
        }
        type Quantize = fn(&[f32], &mut [u8]);
        let cases: [(&str, Quantize, Quantize, usize); 4] = [
            ("Q4_K", q4_k::quantize, ours[0], q4_k::BLOCK_BYTES),
            ("Q5_K", q5_k::quantize, ours[1], q5_k::BLOCK_BYTES),
            ("Q6_K", q6_k::quantize, ours[2], q6_k::BLOCK_BYTES),
            ("Q3_K", q3_k::quantize, ours[3], q3_k::BLOCK_BYTES),
        ];
        for (name, reference, ours, size) in cases {
            let mut want = vec![0u8; n / crate::QK_K * size];
            let mut got = want.clone();
            reference(&x, &mut want);
            ours(&x, &mut got);
            for (b, (g, w)) in got.chunks(size).zip(want.chunks(size)).enumerate() {
                assert_eq!(g, w, "{name} block {b}");
            }
        }
    }
}
