//! ringllm's wire format and transports. The codecs (`frame`, `control`, `handshake`, `key`,
//! `seal`, `activations`) do no I/O; `tcp` runs them over tokio sockets for the control plane.
//! The data plane's blocking links implement `blocking::DataLink`: `TcpDataLink`,
//! `uring::UringDataLink` (the same wire on io_uring), `udp::UdpDataLink` (reliable UDP) and
//! `quic::QuicDataLink` (QUIC with mutual TLS derived from the cluster key); `dial` opens any
//! of them on both sides.

pub mod activations;
pub mod blocking;
pub mod control;
pub mod control_conn;
pub mod dial;
pub mod error;
pub mod frame;
pub mod handshake;
pub mod key;
pub mod quic;
pub mod seal;
pub mod sock;
pub mod tcp;
pub mod transport;
pub mod udp;
pub mod uring;

pub use blocking::{DataLink, LinkCloser};
pub use control::Control;
pub use error::{NameError, ProtocolError, TransportError};
pub use frame::{Dtype, FrameHeader, FrameKind, HEADER_LEN};
pub use handshake::Role;
pub use key::ClusterKey;
pub use quic::{QuicDataLink, QuicServer};
pub use tcp::TcpDataLink;
pub use transport::{FrameReceiver, FrameSender, Link, LinkCounters, TransportKind};
pub use udp::{UdpConfig, UdpDataLink};
pub use uring::{UringConfig, UringDataLink};
