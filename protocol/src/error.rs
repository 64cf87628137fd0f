//! Errors of the wire format and transports. Every variant says what was wrong in words a
//! log reader can act on; the texts are stable (the end-to-end tests look for some of them).

use thiserror::Error;

/// Bytes from a peer (or a key file) that do not follow the protocol. Decoders return these
/// without touching any I/O; a transport wraps them in `TransportError::Protocol`.
#[derive(Clone, Debug, Error)]
pub enum ProtocolError {
    /// The first bytes are not ours: something that is not ringllm talks to a ringllm port
    /// (`what`: a frame, a handshake message).
    #[error("not a ringllm {what}: magic bytes {found:02x?} (a port scan, a browser, or another program talking to a ringllm port?)")]
    BadMagic { what: &'static str, found: [u8; 4] },
    /// The peer speaks another version of `what` (the frame format, the handshake).
    #[error("{what} version mismatch: we speak {ours}, the peer speaks {theirs} (run the same ringllm release on every machine)")]
    Version {
        what: &'static str,
        ours: u32,
        theirs: u32,
    },
    /// A field holds a value it can never hold (an unknown frame kind, dtype or flag; a port
    /// of 0).
    #[error("invalid {field}: {value}")]
    BadField { field: &'static str, value: u64 },
    /// A length over the receiver's cap, refused before anything is allocated for it.
    #[error("{what} of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        what: &'static str,
        len: u64,
        max: u64,
    },
    /// Fields that are valid alone but disagree with each other or with the connection's
    /// state (a payload length that does not match the shape, a frame cut short, an
    /// unexpected message).
    #[error("inconsistent frame: {0}")]
    Inconsistent(String),
    /// The payload's CRC32C differs from the header's: the bytes changed on the way.
    #[error("frame checksum mismatch (CRC32C {found:08x}, header says {expected:08x}): corrupted in transit")]
    Checksum { expected: u32, found: u32 },
    /// A control payload that does not decode as a `Control` message (or does not encode
    /// within the cap).
    #[error("malformed control message: {0}")]
    Control(String),
    /// The handshake went wrong in form: messages out of order, a bad name or role.
    #[error("handshake: {0}")]
    Handshake(String),
    /// The handshake's proofs did not verify: the peer holds another cluster key, or
    /// replays an old handshake.
    #[error("authentication failed: {0}")]
    Auth(String),
    /// The peer refused us and said why (a handshake reject, an `Error` message instead of
    /// the expected answer).
    /// Its text is the peer's, escaped when shown (`untrusted::escape`).
    #[error("the peer refused the connection: {}", crate::untrusted::escape(.0))]
    Rejected(String),
    /// The peer's name is on the cluster's revocation list (`ringllm revoke`).
    #[error("node {name:?} is revoked (its name is on the cluster's revocation list, `ringllm revoke`): it may not join; give the machine a new node key under another name, or take the name off the list")]
    Revoked { name: String },
    /// A cluster key that cannot be read, parsed or used.
    #[error("cluster key: {0}")]
    Key(String),
}

/// What can go wrong on a link.
#[derive(Debug, Error)]
pub enum TransportError {
    /// The socket (or io_uring, or the QUIC endpoint) failed; its own message says how.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The peer's bytes broke the protocol (see `ProtocolError`).
    #[error("{0}")]
    Protocol(#[from] ProtocolError),
    /// The peer closed the link cleanly, between two frames.
    #[error("the peer closed the connection")]
    Closed,
    /// A frame's seal did not verify (forged, corrupted, replayed or out of order); stream
    /// links end on it, datagram links drop the datagram and count it instead.
    #[error("frame refused: {0}")]
    Seal(#[from] crate::seal::SealError),
    /// Nothing came within the time given (the duration, and what we were waiting for).
    #[error("timed out after {0:?} {1}")]
    Timeout(std::time::Duration, &'static str),
}

impl TransportError {
    /// True for a clean close at a frame boundary.
    pub fn is_closed(&self) -> bool {
        matches!(self, TransportError::Closed)
    }
}

/// A name given on the command line or in a cluster file that is none of ours.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum NameError {
    /// Not a transport (`TransportKind`).
    #[error("unknown transport '{0}' (tcp, udp, quic or uring)")]
    Transport(String),
    /// Not a KV cache type (`control::KvType`).
    #[error("'{0}' is not a KV cache type (f32 or f16)")]
    KvType(String),
}
