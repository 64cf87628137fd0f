//! Q8_1 block format (scalar reference). STUB: to be written.

use crate::types::GgmlType;

/// Activation format for dot products against Q8_1 weights.
pub const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_1;

pub fn dequantize(_src: &[u8], _dst: &mut [f32]) {
    unimplemented!("Q8_1 dequantize")
}

pub fn quantize(_src: &[f32], _dst: &mut [u8]) {
    unimplemented!("Q8_1 quantize")
}

pub fn vec_dot(_n: usize, _w: &[u8], _a: &[u8]) -> f32 {
    unimplemented!("Q8_1 vec_dot")
}
