//! Numeric kernels for ringllm: GGUF block formats (dequantize, reference quantize, quantized
//! dot products) with a scalar reference for each, AVX2+FMA (x86_64) and NEON (aarch64) paths
//! chosen once at start-up, the matrix products built on them, the thread pool that runs them,
//! and the small element-wise ops of a transformer layer.
//!
//! Knows nothing of files or networks: every function works on byte slices and `f32` slices.

pub mod bandwidth;
pub mod dispatch;
pub mod gemm;
pub mod ktile;
pub mod matmul;
pub mod ops;
pub mod pool;
pub mod quants;
pub mod repack;
pub mod tolerance;
pub mod types;

#[cfg(target_arch = "x86_64")]
pub mod avx2;

#[cfg(target_arch = "aarch64")]
pub mod neon;

pub use dispatch::{isa, kernels, reference, Isa, TypeKernels};
pub use matmul::{matmul, matmul_many, ActBuffer, MatJob, QMatrix};
pub use pool::ThreadPool;
pub use types::{GgmlType, ALL_TYPES, QK_K};
