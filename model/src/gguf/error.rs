//! Errors of GGUF reading and writing. Every message names what is wrong (key, tensor name,
//! field) and where (byte offset in the file) so a bad file can be diagnosed from the message.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or mapped. The cause is part of the message (not a
    /// `source`), so a chain printed with `{:#}` says it once.
    #[error("cannot read GGUF file {}: {cause}", path.display())]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },

    /// A directory, FIFO, socket or device where a model file should be: reading it would
    /// block (a FIFO) or make no sense, so it is refused before it is opened.
    #[error("{} is not a regular file ({kind}); give the path of a .gguf file", path.display())]
    NotRegularFile { path: PathBuf, kind: &'static str },

    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic at byte 0 is {found:02x?}, expected \"GGUF\" (47 47 55 46)")]
    BadMagic { found: Vec<u8> },

    /// The version field looks byte-swapped: a big-endian GGUF.
    #[error(
        "big-endian GGUF: version field at byte 4 reads {raw:#010x}, which is version {swapped} \
         byte-swapped; only little-endian GGUF files are supported"
    )]
    BigEndian { raw: u32, swapped: u32 },

    /// A version we do not read.
    #[error("unsupported GGUF version {version} (field at byte 4): {why}")]
    UnsupportedVersion { version: u32, why: &'static str },

    /// The file ends inside a field.
    #[error("truncated GGUF: {what} at byte {offset} needs {need} bytes, {left} left")]
    Truncated {
        what: String,
        offset: u64,
        need: u64,
        left: u64,
    },

    /// A length or count that cannot be right (too large for the bytes left, over a cap...).
    #[error("invalid GGUF: {what} at byte {offset}: {why}")]
    Invalid {
        what: String,
        offset: u64,
        why: String,
    },

    /// A metadata value type id outside the GGUF specification.
    #[error("invalid GGUF: metadata key '{key}' has unknown value type id {id} at byte {offset}")]
    UnknownValueType { key: String, id: u32, offset: u64 },

    /// A key appears twice.
    #[error("invalid GGUF: duplicate metadata key '{key}' at byte {offset}")]
    DuplicateKey { key: String, offset: u64 },

    /// A tensor element type id we do not know or implement.
    #[error(
        "tensor '{name}' (info at byte {offset}) has unknown or unsupported GGML type id {id}"
    )]
    UnknownTensorType { name: String, id: u32, offset: u64 },

    /// A tensor name appears twice.
    #[error("invalid GGUF: duplicate tensor name '{name}' (info at byte {offset})")]
    DuplicateTensor { name: String, offset: u64 },

    /// A tensor's shape, size or placement is invalid.
    #[error("invalid GGUF: tensor '{name}' (info at byte {offset}): {why}")]
    BadTensor {
        name: String,
        offset: u64,
        why: String,
    },

    /// Keys a caller needs are absent.
    #[error("missing metadata key(s): {}", keys.join(", "))]
    MissingKeys { keys: Vec<String> },

    /// A key is present with a type the caller cannot use.
    #[error("metadata key '{key}' (at byte {offset}) has type {found}, expected {expected}")]
    WrongType {
        key: String,
        offset: u64,
        expected: &'static str,
        found: String,
    },

    /// A numeric value does not fit the type the caller asked for.
    #[error("metadata key '{key}' (at byte {offset}): value {value} does not fit {target}")]
    OutOfRange {
        key: String,
        offset: u64,
        value: String,
        target: &'static str,
    },

    /// Bad input to the writer or the synthetic-model builder.
    #[error("invalid GGUF writer input: {0}")]
    InvalidInput(String),
}
