//! ringllm's wire format and transports. The codecs (`frame`, `control`, `handshake`, `key`)
//! do no I/O; `tcp` runs them over tokio sockets behind the `transport` traits. The data plane's
//! blocking links implement `blocking::DataLink`: `TcpDataLink`, and `udp::UdpDataLink`
//! (reliable UDP).

pub mod blocking;
pub mod control;
pub mod error;
pub mod frame;
pub mod handshake;
pub mod key;
pub mod seal;
pub mod tcp;
pub mod transport;
pub mod udp;

pub use blocking::{DataLink, LinkCloser, TcpDataLink};
pub use control::Control;
pub use error::{ProtocolError, TransportError};
pub use frame::{Dtype, FrameHeader, FrameKind, HEADER_LEN};
pub use handshake::Role;
pub use key::ClusterKey;
pub use transport::{FrameReceiver, FrameSender, Link, LinkCounters};
pub use udp::{UdpConfig, UdpDataLink};
