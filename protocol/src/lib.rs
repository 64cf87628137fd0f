//! ringllm's wire format and transports.
//!
//! # Layout
//!
//! The codecs do no I/O: they encode and decode byte buffers and refuse what is malformed
//! with a `ProtocolError` (`error`).
//!
//! * `frame`: the 40-byte data-frame header, and the payload caps, one per role.
//! * `control`: control messages (assignments, heartbeats, errors, `Attach`).
//! * `handshake`: the versioned, mutually authenticated handshake every connection opens with.
//! * `key`: the cluster key. `ident`: node keys, their certificates, the revocation list.
//! * `seal`: per-frame and per-datagram authentication.
//! * `activations`: hidden states as f32, f16, bf16 or q8.
//!
//! The control plane runs on tokio: `control_conn` (a `transport::Link` over TCP, and the
//! handshake over any async stream). The data plane runs on blocking links owned by one
//! thread each, behind `blocking::DataLink`, one transport per file:
//!
//! * `tcp`: `TcpDataLink`, frames on a TCP stream.
//! * `uring`: `UringDataLink`, the same wire driven by io_uring (Linux only: elsewhere
//!   `dial` refuses `--transport uring` with `dial::uring_unavailable`).
//! * `udp`: `UdpDataLink`, reliable UDP (a folder: wire format, sender and receiver state
//!   machines, socket calls, the link).
//! * `kmod`: the kernel module's device (`kmod/`); `UdpDataLink::with_kmod` runs reliable
//!   UDP over it, its data datagrams taken off the wire before the socket layer.
//! * `quic`: `QuicDataLink`, QUIC with mutual TLS derived from the cluster key.
//!
//! `dial` opens a data link of any transport, both sides (`DialSpec`, `LinkRole`); `sock`
//! sets up every transport's sockets (buffer sizes, TCP tuning, UDP sockets); `transport`
//! holds `TransportKind` and the counters every link keeps; `untrusted::escape` makes text a
//! peer chose (names, reasons) safe to print and log.

pub mod activations;
pub mod blocking;
pub mod control;
pub mod control_conn;
pub mod dial;
pub mod error;
pub mod frame;
pub mod handshake;
pub mod ident;
pub mod key;
pub mod kmod;
pub mod quic;
pub mod seal;
pub mod sock;
pub mod tcp;
pub mod transport;
pub mod udp;
pub mod untrusted;
#[cfg(target_os = "linux")]
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
#[cfg(target_os = "linux")]
pub use uring::{UringConfig, UringDataLink};
