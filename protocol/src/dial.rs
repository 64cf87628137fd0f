//! Opening data links of every transport, both sides.
//!
//! A data link always starts with an authenticated handshake (`handshake`) and an `Attach`
//! message naming the ring session and what the link carries:
//!
//! - **tcp** / **uring**: a TCP connection to the node's `--listen` port; the frames follow on
//!   it (sealed, see `seal`). io_uring only changes how each end drives its socket, so the
//!   two interoperate.
//! - **udp**: the same TCP connection carries the handshake and an `Attach` with the client's
//!   UDP port; the node answers once its own UDP socket (bound to the same port number,
//!   connected to the client's) is ready, and the frames travel as sealed datagrams. The TCP
//!   connection stays open as the link's anchor: its end is the link's end.
//! - **quic**: a QUIC connection to the node's UDP port of that number (TLS 1.3, mutual, from
//!   the cluster key), the handshake and `Attach` on its first stream.

use crate::blocking::{DataLink, TcpDataLink};
use crate::control::Control;
use crate::error::{ProtocolError, TransportError};
use crate::handshake::Session;
use crate::key::ClusterKey;
use crate::tcp::control_of;
use crate::transport::TransportKind;
use std::time::Duration;

pub type BoxLink = Box<dyn DataLink>;

/// What the opening side of a data link declared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachInfo {
    pub session: u64,
    pub from: String,
    pub input: bool,
    pub output: bool,
    pub transport: TransportKind,
}

/// Where this process stands on each transport, fixed at start-up.
#[derive(Clone, Debug)]
pub struct LocalTransports {
    /// Drive TCP-wire links (tcp, and the anchors of udp) with io_uring.
    pub uring: bool,
}

/// Client side: opens a data link of `kind` to the node listening at `addr`.
#[allow(clippy::too_many_arguments)]
pub async fn connect_data_link(
    kind: TransportKind,
    addr: &str,
    key: &ClusterKey,
    name: &str,
    timeout: Duration,
    max_payload: u32,
    ring_session: u64,
    input: bool,
    output: bool,
) -> Result<BoxLink, TransportError> {
    match kind {
        TransportKind::Tcp => Ok(Box::new(
            crate::tcp::connect_data(
                addr,
                key,
                name,
                timeout,
                max_payload,
                ring_session,
                input,
                output,
            )
            .await?,
        )),
        other => Err(TransportError::Io(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            format!("the {other} transport is not available in this build"),
        ))),
    }
}

/// Server side of a TCP connection that authenticated as a data link: reads its `Attach`
/// (within `timeout`) and finishes the link the client asked for. Blocking.
pub fn accept_tcp_data(
    stream: std::net::TcpStream,
    hs: &Session,
    max_payload: u32,
    timeout: Duration,
) -> Result<(BoxLink, AttachInfo), TransportError> {
    let mut link = TcpDataLink::new(stream, max_payload, &hs.link_keys())?;
    let mut buf = Vec::new();
    let h = link
        .recv_timeout(&mut buf, timeout)?
        .ok_or(TransportError::Timeout(
            timeout,
            "waiting for the attach message",
        ))?;
    let info = match control_of(&h, &buf)? {
        Control::Attach {
            session,
            from,
            input,
            output,
            transport,
            udp_port: _,
        } => AttachInfo {
            session,
            from,
            input,
            output,
            transport,
        },
        other => {
            return Err(ProtocolError::Inconsistent(format!(
                "expected an attach message, got {}",
                other.name()
            ))
            .into())
        }
    };
    match info.transport {
        TransportKind::Tcp => Ok((Box::new(link), info)),
        other => Err(ProtocolError::Inconsistent(format!(
            "the peer asked for a {other} link on a TCP connection, which this build cannot serve"
        ))
        .into()),
    }
}
