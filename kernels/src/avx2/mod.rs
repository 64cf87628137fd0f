//! AVX2+FMA kernels, one file per format family. Chosen at start-up by `available()`;
//! every `unsafe fn` here is `#[target_feature(enable = "avx2,fma,f16c")]` and only called
//! after detection succeeded.

use crate::dispatch::{Isa, TypeKernels};
use crate::types::GgmlType;

mod legacy;
mod q4_k;
mod q5_k;
mod q6_k;
mod q8_k;

/// True when this CPU has every feature the AVX2 kernels use.
pub fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Replace the scalar functions of `entry` with AVX2 ones where we have them.
pub fn specialize(entry: &mut TypeKernels) {
    entry.isa = Isa::Avx2;
    // Per-format overrides are added here as they are written.
    match entry.ty {
        GgmlType::Q4_0 => {
            entry.vec_dot = legacy::vec_dot_q4_0;
            entry.vec_dot_multi = Some(legacy::multi_q4_0);
        }
        GgmlType::Q4_1 => {
            entry.vec_dot = legacy::vec_dot_q4_1;
            entry.vec_dot_multi = Some(legacy::multi_q4_1);
        }
        GgmlType::Q5_0 => {
            entry.vec_dot = legacy::vec_dot_q5_0;
            entry.vec_dot_multi = Some(legacy::multi_q5_0);
        }
        GgmlType::Q5_1 => {
            entry.vec_dot = legacy::vec_dot_q5_1;
            entry.vec_dot_multi = Some(legacy::multi_q5_1);
        }
        GgmlType::Q8_0 => {
            entry.vec_dot = legacy::vec_dot_q8_0;
            entry.vec_dot_multi = Some(legacy::multi_q8_0);
        }
        GgmlType::Q4_K => {
            entry.dequantize = q4_k::dequantize;
            entry.vec_dot = q4_k::vec_dot;
            entry.vec_dot_multi = Some(q4_k::vec_dot_multi);
        }
        GgmlType::Q5_K => {
            entry.dequantize = q5_k::dequantize;
            entry.vec_dot = q5_k::vec_dot;
            entry.vec_dot_multi = Some(q5_k::vec_dot_multi);
        }
        GgmlType::Q6_K => {
            entry.dequantize = q6_k::dequantize;
            entry.vec_dot = q6_k::vec_dot;
            entry.vec_dot_multi = Some(q6_k::vec_dot_multi);
        }
        GgmlType::Q8_K => {
            // Activations are quantized to Q8_K on every token: the AVX2 quantizer is
            // byte-identical to the reference.
            entry.dequantize = q8_k::dequantize;
            entry.quantize = q8_k::quantize;
        }
        _ => {}
    }
}
