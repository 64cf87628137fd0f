//! QUIC transport (quinn on tokio): confidentiality and integrity on untrusted networks from
//! nothing but the cluster key file.
//!
//! # Certificates
//! Every process derives the same cluster CA from the key: an Ed25519 key whose seed is
//! `key.mac("ringllm quic ca v1")`, in a self-signed certificate with fixed parameters. It then
//! makes a fresh random Ed25519 leaf key and a certificate for it signed by that CA, with the
//! fixed name `SERVER_NAME`. TLS 1.3 (rustls, ring provider) runs with mutual authentication:
//! each side accepts only a chain to the cluster CA, so a machine without the key can neither
//! accept nor open a connection, nor read or alter one in flight. Session resumption and 0-RTT
//! are off: every connection does the full certificate exchange.
//!
//! # Handshake
//! On the first bidirectional stream (opened by the client), our RLHS handshake runs as on TCP
//! (`control_conn::client_handshake` / `control_conn::server_handshake`: peer name, role, cluster id, session
//! key). It is then bound to the TLS session: each side sends
//! `HMAC(session_key, BIND_LABEL ‖ "client"|"server" ‖ exporter)`, where `exporter` is the TLS
//! exporter value of this connection, and checks the peer's; a mismatch closes the connection.
//!
//! # Frames
//! The same stream then carries frames exactly as TCP does — 40-byte header and payload —
//! without the per-frame seal, since TLS already authenticates and encrypts every packet.
//! `QuicDataLink` is the blocking `DataLink` over it for the data plane's plain threads.
//!
//! # Transport parameters (`transport_config`)
//! One connection per link and one stream per connection; no datagrams. Windows of
//! `STREAM_WINDOW` (stream) and `CONNECTION_WINDOW` (connection, and the send buffer) so a
//! 64 MiB frame streams without flow-control stalls, while a receiver that stops reading holds
//! its sender back after that much. Keep-alives every `KEEP_ALIVE`, idle timeout
//! `IDLE_TIMEOUT` (a dead peer is noticed within seconds), initial RTT `INITIAL_RTT`. Cubic
//! congestion control, path MTU discovery from 1200 up to 1452 bytes (quinn's defaults), GSO
//! where the kernel has it.
//!
//! # Layout
//!
//! * `tls`: the cluster CA and each process's leaf certificate, the rustls and quinn
//!   configurations, the transport parameters.
//! * `errors`: connection and stream errors in words.
//! * `connect`: the channel binding, `QuicServer` and `connect` (setting a link up).
//! * `link`: `QuicDataLink`, the blocking `send` and `recv` over the frame stream.

mod connect;
mod errors;
mod link;
mod tls;

pub use connect::{connect, connect_data, QuicServer};
pub use link::QuicDataLink;
pub use tls::{cluster_ca, crypto_provider, transport_config, ClusterTls};

use std::time::Duration;

/// The DNS name in every leaf certificate, and the name clients ask for.
pub const SERVER_NAME: &str = "ringllm.cluster";
/// The one ALPN protocol both sides offer.
pub const ALPN: &[u8] = b"ringllm/1";
/// Label of the TLS exporter value the RLHS session is bound to.
const EXPORTER_LABEL: &[u8] = b"EXPORTER-ringllm-quic-binding-v1";
/// Label of the binding MACs.
const BIND_LABEL: &[u8] = b"ringllm quic binding v1\0";
/// Label of the cluster CA's key derivation.
const CA_LABEL: &[u8] = b"ringllm quic ca v1";

/// No packet from the peer for this long ends the connection (a crashed machine, a pulled
/// cable). Both sides send keep-alives every `KEEP_ALIVE`.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(5);
pub const KEEP_ALIVE: Duration = Duration::from_secs(1);
/// Flow-control window of the frame stream: what may be in flight (or buffered at a receiver
/// that is not reading) per link. Far above a LAN's bandwidth-delay product (10 Gbit/s × 1 ms
/// is 1.25 MB), so a large frame streams at line rate.
pub const STREAM_WINDOW: u32 = 16 << 20;
/// Connection-level receive window and send buffer.
pub const CONNECTION_WINDOW: u32 = 32 << 20;
/// Starting RTT estimate before the first sample (quinn's default, 333 ms, is for the
/// Internet; a LAN answers in well under a millisecond).
pub const INITIAL_RTT: Duration = Duration::from_millis(10);
/// Connections still in their handshakes that a server works on at once; more are refused.
pub const MAX_PENDING_HANDSHAKES: usize = 64;
/// How long a dropped link keeps delivering what it had sent before it closes.
const LINGER: Duration = Duration::from_secs(5);
/// Payloads up to this size go out in one write with their header.
const COALESCE: usize = 64 << 10;

/// Application close codes (on the wire, in CONNECTION_CLOSE).
const CODE_DONE: u32 = 0;
const CODE_CLOSED: u32 = 1;
const CODE_REFUSED: u32 = 2;
const CODE_SHUTDOWN: u32 = 3;
