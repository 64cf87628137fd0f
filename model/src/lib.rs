//! ringllm model runtime: GGUF reading and writing, architectures as data, KV cache and the
//! forward pass over a contiguous range of layers, layer streaming and predictive skip,
//! synthetic models, and the limits checked before any of it is allocated. The node daemon
//! (`ringllm-node`) and the coordinator both drive it.

pub mod arch;
pub mod backend;
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
