//! Errors of the wire format and transports. Every variant says what was wrong in words a
//! log reader can act on.

use thiserror::Error;

#[derive(Clone, Debug, Error)]
pub enum ProtocolError {
    #[error("not a ringllm {what}: magic bytes {found:02x?} (a port scan, a browser, or another program talking to a ringllm port?)")]
    BadMagic { what: &'static str, found: [u8; 4] },
    #[error("{what} version mismatch: we speak {ours}, the peer speaks {theirs} (run the same ringllm release on every machine)")]
    Version {
        what: &'static str,
        ours: u32,
        theirs: u32,
    },
    #[error("invalid {field}: {value}")]
    BadField { field: &'static str, value: u64 },
    #[error("{what} of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        what: &'static str,
        len: u64,
        max: u64,
    },
    #[error("inconsistent frame: {0}")]
    Inconsistent(String),
    #[error("frame checksum mismatch (CRC32C {found:08x}, header says {expected:08x}): corrupted in transit")]
    Checksum { expected: u32, found: u32 },
    #[error("malformed control message: {0}")]
    Control(String),
    #[error("handshake: {0}")]
    Handshake(String),
    #[error("authentication failed: {0}")]
    Auth(String),
    #[error("the peer refused the connection: {0}")]
    Rejected(String),
    #[error("cluster key: {0}")]
    Key(String),
}

/// What can go wrong on a link.
#[derive(Debug, Error)]
pub enum TransportError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Protocol(#[from] ProtocolError),
    #[error("the peer closed the connection")]
    Closed,
    #[error("frame refused: {0}")]
    Seal(#[from] crate::seal::SealError),
    #[error("timed out after {0:?} {1}")]
    Timeout(std::time::Duration, &'static str),
}

impl TransportError {
    /// True for a clean close at a frame boundary.
    pub fn is_closed(&self) -> bool {
        matches!(self, TransportError::Closed)
    }
}
