//! Error budgets for every format, in one table. The conformance tests (`tests/conformance.rs`)
//! hold every kernel to these figures; change a figure only with a reason in the commit.
//!
//! Data: rows of N(0, 1) values, 8 blocks or more per row.
//! - `roundtrip_rmse`: RMS error of reference quantize → dequantize, relative to the RMS of
//!   the input.
//! - `dot_vs_float`: |vec_dot(w, quantize(a)) − dot(dequantize(w), a)| relative to
//!   Σ|w_i·a_i|: the cost of quantizing the activations on the fly.
//! - `simd_vs_reference`: |simd vec_dot − scalar vec_dot| relative to Σ|w_i·a_i|: only the
//!   summation order may differ (integer parts must agree exactly). Zero for the formats whose
//!   SIMD dots reduce each block to one exact integer and then scale it as the reference does:
//!   bit-identical at every level.

use crate::types::GgmlType;

#[derive(Clone, Copy, Debug)]
pub struct Budget {
    pub roundtrip_rmse: f32,
    pub dot_vs_float: f32,
    pub simd_vs_reference: f32,
}

/// The budget for `ty`.
pub fn budget(ty: GgmlType) -> Budget {
    let b = |roundtrip_rmse, dot_vs_float, simd_vs_reference| Budget {
        roundtrip_rmse,
        dot_vs_float,
        simd_vs_reference,
    };
    match ty {
        GgmlType::F32 => b(0.0, 1e-6, 1e-5),
        GgmlType::F16 => b(1e-3, 1e-6, 1e-5),
        GgmlType::BF16 => b(8e-3, 1e-6, 1e-5),
        GgmlType::Q8_0 | GgmlType::Q8_1 => b(8e-3, 1e-2, 1e-5),
        GgmlType::Q8_K => b(8e-3, 1e-2, 1e-5),
        GgmlType::Q6_K => b(3e-2, 1e-2, 1e-5),
        GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5_K => b(6e-2, 1e-2, 1e-5),
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4_K => b(1.2e-1, 1e-2, 1e-5),
        GgmlType::Q3_K => b(1.7e-1, 1e-2, 0.0),
        GgmlType::Q2_K => b(3.3e-1, 1e-2, 0.0),
        GgmlType::IQ4_NL | GgmlType::IQ4_XS => b(1.2e-1, 1e-2, 1e-5),
        // E2M1 codes under a power-of-two scale: coarser than a 4-bit integer grid.
        GgmlType::MXFP4 => b(2.0e-1, 1e-2, 0.0),
    }
}
