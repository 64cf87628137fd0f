//! Errors of model loading and running.

use crate::gguf::GgufError;
use ringllm_kernels::GgmlType;
use std::ops::Range;

/// Why a model (or a slice of it) cannot be loaded or run. Messages name the tensor, key or
/// layer involved.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A streamed layer could not be read from disk.
    #[error("streaming layer {layer} from disk: {why}")]
    Stream { layer: usize, why: String },
    /// The file is not a readable GGUF (truncated, corrupted, wrong version...).
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// `general.architecture` names an architecture we do not run.
    #[error("unsupported architecture '{name}' (supported: {})", crate::arch::Arch::SUPPORTED.join(", "))]
    UnsupportedArch { name: String },
    /// A tensor the architecture needs is absent.
    #[error("tensor '{name}' is missing from the model file")]
    MissingTensor { name: String },
    /// A tensor has the wrong shape.
    #[error("tensor '{name}' has shape {found:?}, expected {expected:?}")]
    BadShape {
        name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    /// A tensor's type cannot be used where it is.
    #[error("tensor '{name}' has type {ty}, which cannot be used here: {why}")]
    BadType {
        name: String,
        ty: GgmlType,
        why: &'static str,
    },
    /// Hyper-parameters read from the metadata that make no sense together (zero sizes,
    /// head counts that do not divide, an odd RoPE dimension...).
    #[error("invalid hyper-parameters: {arch}: {why}")]
    BadHparams { arch: &'static str, why: String },
    /// A slice was asked for layers the model does not have.
    #[error("layer range {start}..{end} outside the model's {n_layer} layers")]
    LayerRange {
        start: usize,
        end: usize,
        n_layer: usize,
    },
    /// A part of the model this slice did not load (the token embedding lives with the
    /// coordinator, the output norm and head with the last stage).
    #[error("this model slice (layers {}..{}) holds no {what}", layers.start, layers.end)]
    NotInSlice {
        what: &'static str,
        layers: Range<usize>,
    },
    /// A KV cache used with a runner of other layers than it was made for.
    #[error("a KV cache made for other layers: it holds {cache} layers, this slice runs {slice}")]
    CacheMismatch { cache: usize, slice: usize },
    /// More tokens in one pass than the runner's scratch buffers were sized for.
    #[error("batch of {n} tokens exceeds the runner's maximum of {max}")]
    BatchTooLarge { n: usize, max: usize },
    /// A caller's buffer is smaller than the rows it asks for.
    #[error("{what}: buffer of {len} values, {need} needed")]
    BufferTooSmall {
        what: &'static str,
        len: usize,
        need: usize,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    BadToken { id: u32, vocab: usize },
    /// A skip predictor that does not fit this model.
    #[error("skip predictor: {why}")]
    SkipPredictor { why: String },
    /// The sequence would exceed the KV cache.
    #[error("context full: position {pos} + {n} tokens exceeds the context of {ctx}")]
    ContextFull { pos: usize, n: usize, ctx: usize },
    /// The backend (a GPU) failed: lost device, allocation, unsupported setting.
    /// A layer step the chosen backend does not implement (found when the backend opens).
    #[error("the {backend} backend cannot run step '{step}' of layer {layer}")]
    UnsupportedStep {
        step: &'static str,
        layer: usize,
        backend: &'static str,
    },
    #[error("backend: {0}")]
    Backend(String),
    /// A slice of layers that cannot run apart from the rest of the model.
    #[error("layers {}..{} cannot run as a slice: {why}", layers.start, layers.end)]
    Unsplittable { layers: Range<usize>, why: String },
}
