//! Errors of model loading and running.

use crate::gguf::GgufError;
use ringllm_kernels::GgmlType;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
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
    /// Hyper-parameters that make no sense.
    #[error("invalid hyper-parameters: {0}")]
    Invalid(String),
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    BadToken { id: u32, vocab: usize },
    /// The sequence would exceed the KV cache.
    #[error("context full: position {pos} + {n} tokens exceeds the context of {ctx}")]
    ContextFull { pos: usize, n: usize, ctx: usize },
}
