//! ringllm's wire format and transports. The codecs (`frame`, `control`, `handshake`, `key`)
//! do no I/O; `tcp` runs them over tokio sockets behind the `transport` traits; `quic` carries
//! the same frames over QUIC with mutual TLS derived from the cluster key.

pub mod activations;
pub mod blocking;
pub mod control;
pub mod dial;
pub mod error;
pub mod frame;
pub mod handshake;
pub mod key;
pub mod quic;
pub mod seal;
pub mod tcp;
pub mod transport;
pub mod udp;
pub mod uring;

pub use blocking::{DataLink, LinkCloser, TcpDataLink};
pub use control::Control;
pub use error::{ProtocolError, TransportError};
pub use frame::{Dtype, FrameHeader, FrameKind, HEADER_LEN};
pub use handshake::Role;
pub use key::ClusterKey;
pub use quic::{QuicDataLink, QuicServer};
pub use transport::{FrameReceiver, FrameSender, Link, LinkCounters, TransportKind};
pub use uring::{UringConfig, UringDataLink};
