//! AVX2+FMA kernels, one file per format family. Chosen at start-up by `available()`;
//! every `unsafe fn` here is `#[target_feature(enable = "avx2,fma,f16c")]` and only called
//! after detection succeeded.

use crate::dispatch::{Isa, TypeKernels};

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
    let _ = entry;
}
