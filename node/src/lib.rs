//! ringllm model slice: GGUF reading and writing, architectures as data, KV cache and the
//! forward pass over a contiguous range of layers, the limits checked before any of it is
//! allocated, and the node daemon (`daemon`) that serves a slice to a coordinator.

pub mod arch;
pub mod backend;
pub mod daemon;
pub mod error;
pub mod forward;
pub mod gguf;
#[cfg(feature = "gpu")]
pub mod gpu;
pub mod kv;
pub mod limits;
pub mod model;
pub mod skip;
pub mod slice;
pub mod stream;
pub mod synth;
pub mod sys;

pub use arch::{Arch, Hparams, LayerClass, TensorKind};
pub use backend::{BackendChoice, LayerBackend};
pub use error::ModelError;
pub use forward::Runner;
pub use kv::{KvCache, KvType};
pub use model::{LoadOptions, Model};
