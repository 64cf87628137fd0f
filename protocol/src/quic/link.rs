//! `QuicDataLink`: frames on the link's one bidirectional stream, from plain threads.

use super::errors::{conn_error, inside_frame, io_err, is_clean_close};
use super::{COALESCE, CODE_CLOSED, CODE_DONE, LINGER};
use crate::blocking::{DataLink, LinkCloser};
use crate::error::{ProtocolError, TransportError};
use crate::frame::{FrameHeader, HEADER_LEN};
use crate::transport::{LinkCounters, TransportKind};
use quinn::{ReadError, ReadExactError, VarInt, WriteError};
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// The stream half of a link: everything `QuicDataLink` does except blocking.
pub(super) struct Io {
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    max_payload: u32,
    peer: String,
    /// A header being read (`head_got` bytes so far); kept across a timed-out `recv_timeout`.
    head: [u8; HEADER_LEN],
    head_got: usize,
    scratch: Vec<u8>,
    counters: Arc<LinkCounters>,
}

impl Io {
    fn read_err(&self, e: ReadError, at_boundary: bool) -> TransportError {
        match e {
            ReadError::ConnectionLost(c) if is_clean_close(&c) => {
                if at_boundary {
                    TransportError::Closed
                } else {
                    inside_frame(&self.peer)
                }
            }
            ReadError::ConnectionLost(c) => conn_error(&c, &self.peer, "while receiving"),
            ReadError::Reset(code) => io_err(
                ErrorKind::ConnectionReset,
                format!(
                    "{} abandoned the frame stream (reset, code {code})",
                    self.peer
                ),
            ),
            other => io_err(
                ErrorKind::Other,
                format!("reading the frame stream from {}: {other}", self.peer),
            ),
        }
    }

    fn write_err(&self, e: WriteError) -> TransportError {
        match e {
            WriteError::ConnectionLost(c) if is_clean_close(&c) => TransportError::Closed,
            WriteError::ConnectionLost(c) => conn_error(&c, &self.peer, "while sending"),
            WriteError::Stopped(code) => io_err(
                ErrorKind::BrokenPipe,
                format!(
                    "{} stopped reading the frame stream (code {code})",
                    self.peer
                ),
            ),
            other => io_err(
                ErrorKind::Other,
                format!("writing the frame stream to {}: {other}", self.peer),
            ),
        }
    }

    pub(super) async fn write_frame(
        &mut self,
        header: &FrameHeader,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        let head = header.encode();
        let r = if payload.len() <= COALESCE {
            // One write, so header and payload leave in the same packet.
            self.scratch.clear();
            self.scratch.extend_from_slice(&head);
            self.scratch.extend_from_slice(payload);
            self.send.write_all(&self.scratch).await
        } else {
            match self.send.write_all(&head).await {
                Ok(()) => self.send.write_all(payload).await,
                Err(e) => Err(e),
            }
        };
        r.map_err(|e| self.write_err(e))?;
        self.counters.sent(HEADER_LEN + payload.len());
        Ok(())
    }

    /// Reads at least one more header byte.
    async fn fill_head(&mut self) -> Result<(), TransportError> {
        let at_boundary = self.head_got == 0;
        match self.recv.read(&mut self.head[self.head_got..]).await {
            Ok(Some(n)) => {
                self.head_got += n;
                Ok(())
            }
            Ok(None) if at_boundary => Err(TransportError::Closed),
            Ok(None) => Err(inside_frame(&self.peer)),
            Err(e) => Err(self.read_err(e, at_boundary)),
        }
    }

    /// The next frame; with `header_within`, `Ok(None)` when its header is not complete in
    /// time. The bytes of a partly received header stay in `head` for the next call
    /// (`RecvStream::read` is cancel-safe, and each read's progress is recorded before the
    /// next await). Once the header is in, the payload is read without a deadline.
    async fn read_frame(
        &mut self,
        buf: &mut Vec<u8>,
        header_within: Option<Duration>,
    ) -> Result<Option<FrameHeader>, TransportError> {
        let header = async {
            while self.head_got < HEADER_LEN {
                self.fill_head().await?;
            }
            Ok::<(), TransportError>(())
        };
        match header_within {
            None => header.await?,
            Some(t) => match tokio::time::timeout(t, header).await {
                Err(_) => return Ok(None),
                Ok(r) => r?,
            },
        }
        self.head_got = 0;
        let h = FrameHeader::decode(&self.head, self.max_payload)?;
        buf.clear();
        buf.resize(h.len as usize, 0);
        match self.recv.read_exact(buf).await {
            Ok(()) => {}
            Err(ReadExactError::FinishedEarly(n)) => {
                return Err(TransportError::Protocol(ProtocolError::Inconsistent(
                    format!(
                        "{} closed the stream after {n} of {} payload bytes",
                        self.peer, h.len
                    ),
                )))
            }
            Err(ReadExactError::ReadError(e)) => return Err(self.read_err(e, false)),
        }
        h.verify(buf)?;
        self.counters.received(HEADER_LEN + buf.len());
        Ok(Some(h))
    }
}

/// Blocking DataLink over one bidirectional QUIC stream: header + payload per frame exactly as
/// on TCP (no per-frame seal: TLS protects it). Captures `tokio::runtime::Handle::current()` at
/// creation and blocks on it, so its methods must be called from plain (non-runtime) threads
/// (calling them on a runtime worker panics, as `Handle::block_on` does).
///
/// `recv_timeout` gives up when no *complete header* arrives in time; the bytes of a partly
/// received header are kept for the next call, and once a header is in, it waits for the
/// payload. A peer that drops or closes its link at a frame boundary reads as
/// `TransportError::Closed`; a peer that goes silent (crash, pulled cable) fails the link
/// after `IDLE_TIMEOUT`. Dropping the link finishes the stream and lets what was sent arrive
/// (for up to `LINGER`) before the connection closes, in the background.
pub struct QuicDataLink {
    rt: tokio::runtime::Handle,
    pub(super) io: Io,
    /// The client's own endpoint (a server's links share the server's).
    endpoint: Option<quinn::Endpoint>,
}

impl QuicDataLink {
    pub(super) fn new(
        conn: quinn::Connection,
        send: quinn::SendStream,
        recv: quinn::RecvStream,
        endpoint: Option<quinn::Endpoint>,
        max_payload: u32,
        peer: String,
    ) -> QuicDataLink {
        QuicDataLink {
            rt: tokio::runtime::Handle::current(),
            io: Io {
                conn,
                send,
                recv,
                max_payload,
                peer,
                head: [0; HEADER_LEN],
                head_got: 0,
                scratch: Vec::new(),
                counters: Arc::new(LinkCounters::default()),
            },
            endpoint,
        }
    }

    /// The peer's UDP address.
    pub fn remote_address(&self) -> SocketAddr {
        self.io.conn.remote_address()
    }

    /// The peer, as errors name it ("'name' at addr").
    pub fn peer(&self) -> &str {
        &self.io.peer
    }

    /// The current RTT estimate.
    pub fn rtt(&self) -> Duration {
        self.io.conn.rtt()
    }

    /// The connection's statistics (packets, losses, congestion window, path MTU).
    pub fn stats(&self) -> quinn::ConnectionStats {
        self.io.conn.stats()
    }

    /// Writes raw bytes on the frame stream, outside any frame (tests: torn headers, garbage).
    #[doc(hidden)]
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<(), TransportError> {
        let io = &mut self.io;
        self.rt
            .block_on(io.send.write_all(bytes))
            .map_err(|e| io.write_err(e))
    }
}

impl DataLink for QuicDataLink {
    fn send(&mut self, header: &FrameHeader, payload: &[u8]) -> Result<(), TransportError> {
        self.rt.block_on(self.io.write_frame(header, payload))
    }

    fn recv(&mut self, buf: &mut Vec<u8>) -> Result<FrameHeader, TransportError> {
        match self.rt.block_on(self.io.read_frame(buf, None))? {
            Some(h) => Ok(h),
            None => unreachable!("read_frame without a timeout always returns a frame"),
        }
    }

    fn recv_timeout(
        &mut self,
        buf: &mut Vec<u8>,
        timeout: Duration,
    ) -> Result<Option<FrameHeader>, TransportError> {
        self.rt.block_on(self.io.read_frame(buf, Some(timeout)))
    }

    fn closer(&self) -> Result<LinkCloser, TransportError> {
        let conn = self.io.conn.clone();
        Ok(LinkCloser::new(move || {
            conn.close(VarInt::from_u32(CODE_CLOSED), b"link closed");
        }))
    }

    fn counters(&self) -> Arc<LinkCounters> {
        Arc::clone(&self.io.counters)
    }

    fn transport(&self) -> TransportKind {
        TransportKind::Quic
    }
}

impl Drop for QuicDataLink {
    fn drop(&mut self) {
        let _ = self.io.send.finish();
        let delivered = self.io.send.stopped();
        let conn = self.io.conn.clone();
        let endpoint = self.endpoint.take();
        // Runs in the background; if the runtime is gone, quinn closes the connection when its
        // last handle goes.
        self.rt.spawn(async move {
            let _ = tokio::time::timeout(LINGER, delivered).await;
            conn.close(VarInt::from_u32(CODE_DONE), b"done");
            if let Some(ep) = endpoint {
                let _ = tokio::time::timeout(Duration::from_secs(1), ep.wait_idle()).await;
            }
        });
    }
}
