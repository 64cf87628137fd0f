//! The data plane: blocking frame links owned by one thread each. A node's compute thread
//! reads its input, runs its layers and writes its output on these without handing the frame
//! to any other thread, so a hop costs one `read` and one `writev` and no wake-ups; the
//! control plane (handshakes, heartbeats, assignments) stays on tokio.
//!
//! `DataLink` is the trait every data-plane transport implements, each in its own file:
//! `tcp::TcpDataLink`, `uring::UringDataLink`, `udp::UdpDataLink` and `quic::QuicDataLink`.
//! `LinkCloser` closes any of them from another thread. The end-of-frame checks the two
//! stream transports (TCP and io_uring) share are here too.

use crate::error::{ProtocolError, TransportError};
use crate::frame::{FrameHeader, HEADER_LEN};
use crate::seal::{Opener, SealError, SEAL_LEN};
use crate::transport::{LinkCounters, TransportKind};
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::time::Duration;

/// A blocking, ordered, checked frame link.
pub trait DataLink: Send {
    /// Writes the header and payload (one vectored write where the transport allows).
    fn send(&mut self, header: &FrameHeader, payload: &[u8]) -> Result<(), TransportError>;
    /// The next frame, its payload in `buf`.
    fn recv(&mut self, buf: &mut Vec<u8>) -> Result<FrameHeader, TransportError>;
    /// Like `recv`, but gives up with `Ok(None)` when no frame starts within `timeout`.
    fn recv_timeout(
        &mut self,
        buf: &mut Vec<u8>,
        timeout: Duration,
    ) -> Result<Option<FrameHeader>, TransportError>;
    /// A handle that can close the link from another thread (unblocking `recv`).
    fn closer(&self) -> Result<LinkCloser, TransportError>;
    fn counters(&self) -> Arc<LinkCounters>;
    /// Which transport this link runs on (its `Display` is the name for logs and stats).
    fn transport(&self) -> TransportKind;
}

/// Closes a link from another thread: a blocked `recv` or `send` on it returns an error soon
/// after.
pub struct LinkCloser(Box<dyn Fn() + Send + Sync>);

impl LinkCloser {
    pub fn new(f: impl Fn() + Send + Sync + 'static) -> LinkCloser {
        LinkCloser(Box::new(f))
    }

    /// A closer that shuts a TCP stream down both ways.
    pub fn for_stream(s: TcpStream) -> LinkCloser {
        LinkCloser::new(move || {
            let _ = s.shutdown(Shutdown::Both);
        })
    }

    pub fn close(&self) {
        (self.0)()
    }
}

/// The end of reading a stream frame whose header was `head` (`h` decoded): how reading its
/// payload and seal went, then the CRC, the seal and the counters.
pub(crate) fn finish_stream_frame(
    read: Result<(), TransportError>,
    h: FrameHeader,
    head: &[u8],
    payload: &[u8],
    seal: &[u8],
    opener: &mut Opener,
    counters: &LinkCounters,
) -> Result<FrameHeader, TransportError> {
    read.map_err(|e| match e {
        TransportError::Closed => TransportError::Protocol(ProtocolError::Inconsistent(
            "connection closed inside a frame".into(),
        )),
        e => e,
    })?;
    h.verify(payload)?;
    open_stream_frame(opener, counters, head, payload, seal)?;
    counters.received(HEADER_LEN + payload.len() + SEAL_LEN);
    Ok(h)
}

/// Checks a received stream frame's seal, counting failures.
pub(crate) fn open_stream_frame(
    opener: &mut Opener,
    counters: &LinkCounters,
    head: &[u8],
    payload: &[u8],
    seal: &[u8],
) -> Result<(), TransportError> {
    match opener.open_in_order(seal, &[head, payload]) {
        Ok(_) => Ok(()),
        Err(e) => {
            match e {
                SealError::BadMac => LinkCounters::bump(&counters.mac_failures),
                _ => LinkCounters::bump(&counters.replays),
            }
            Err(e.into())
        }
    }
}
