//! GGUF files: a validating reader over a memory map (or bytes) and a writer.
//!
//! The reader checks every length against the bytes left before allocating and every tensor's
//! placement at open, so a hostile or truncated file yields an error naming what and where,
//! never a panic, and `GgufFile::tensor_data` cannot fail.

mod error;
mod metadata;
mod reader;
mod writer;

pub use error::GgufError;
pub use metadata::{scalar_type_name, type_id, Array, Metadata, Value};
pub use reader::{
    fnv1a64, GgufFile, TensorInfo, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS,
    MAX_NAME_LEN, MAX_STRING_LEN,
};
pub use writer::{GgufWriter, TensorStream};

#[cfg(test)]
mod tests;
