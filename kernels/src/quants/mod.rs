//! Scalar reference implementations of the GGUF block formats, one file per family.
//! These are the oracle for every SIMD path; they favour clarity over speed.

pub mod common;
pub mod float;
pub mod iq4_nl;
pub mod iq4_xs;
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
    }
}
