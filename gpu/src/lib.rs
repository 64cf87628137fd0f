//! The GPU backend of ringllm: a node's slice of transformer layers run in WGSL compute
//! shaders through `wgpu` (Vulkan, Metal or DX12 from one code base).
//!
//! Weights are uploaded once, in their GGUF block layout, and dequantized inside the
//! shaders; the KV cache lives on the device; a slice's layers are encoded into one command
//! buffer per forward call, so the host waits once per slice, not once per operation.
//!
//! Every kernel binds whole buffers and takes element offsets in its own uniform parameters
//! (storage-binding offsets must be 256-byte aligned; row offsets are not).

pub mod device;
pub mod ops;
pub mod qmat;

pub use bytemuck;
pub use wgpu;

pub use device::{adapters, AdapterSummary, Gpu, GpuError, GpuOptions};
pub use ops::{AttnShape, Glu, KvLayout, Ops, RopeStyle};
pub use qmat::{bench_matvec, Matmul, MatmulVariant, QMatrix, GPU_TYPES};
