//! The data plane: blocking frame links owned by one thread each. A node's compute thread
//! reads its input, runs its layers and writes its output on these without handing the frame
//! to any other thread, so a hop costs one `read` and one `writev` and no wake-ups; the
//! control plane (handshakes, heartbeats, assignments) stays on tokio.
//!
//! `DataLink` is the trait later transports (UDP, io_uring, the kernel module) implement for
//! the data plane; `TcpDataLink` is the TCP one.

use crate::error::{ProtocolError, TransportError};
use crate::frame::{FrameHeader, HEADER_LEN};
use crate::transport::LinkCounters;
use std::io::{BufReader, IoSlice, Read, Write};
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
}

/// Closes a link from another thread.
pub struct LinkCloser(TcpStream);

impl LinkCloser {
    pub fn close(&self) {
        let _ = self.0.shutdown(Shutdown::Both);
    }
}

pub struct TcpDataLink {
    r: BufReader<TcpStream>,
    w: TcpStream,
    max_payload: u32,
    counters: Arc<LinkCounters>,
}

impl TcpDataLink {
    /// Wraps a connected, authenticated stream (switched to blocking mode).
    pub fn new(stream: TcpStream, max_payload: u32) -> Result<TcpDataLink, TransportError> {
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        let w = stream.try_clone()?;
        Ok(TcpDataLink {
            r: BufReader::with_capacity(64 << 10, stream),
            w,
            max_payload,
            counters: Arc::new(LinkCounters::default()),
        })
    }
}

fn read_exact_or_closed<R: Read>(r: &mut R, buf: &mut [u8]) -> Result<(), TransportError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(if got == 0 {
                    TransportError::Closed
                } else {
                    TransportError::Io(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("connection closed after {got} of {} bytes", buf.len()),
                    ))
                })
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

impl DataLink for TcpDataLink {
    fn send(&mut self, header: &FrameHeader, payload: &[u8]) -> Result<(), TransportError> {
        let head = header.encode();
        let total = HEADER_LEN + payload.len();
        let mut done = 0;
        while done < total {
            let r = if done < HEADER_LEN {
                self.w
                    .write_vectored(&[IoSlice::new(&head[done..]), IoSlice::new(payload)])
            } else {
                self.w.write(&payload[done - HEADER_LEN..])
            };
            match r {
                Ok(0) => {
                    return Err(TransportError::Io(std::io::Error::new(
                        std::io::ErrorKind::WriteZero,
                        "the socket accepted no bytes",
                    )))
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.counters.sent(total);
        Ok(())
    }

    fn recv(&mut self, buf: &mut Vec<u8>) -> Result<FrameHeader, TransportError> {
        let mut head = [0u8; HEADER_LEN];
        read_exact_or_closed(&mut self.r, &mut head)?;
        let h = FrameHeader::decode(&head, self.max_payload)?;
        buf.clear();
        buf.resize(h.len as usize, 0);
        read_exact_or_closed(&mut self.r, buf).map_err(|e| match e {
            TransportError::Closed => TransportError::Protocol(ProtocolError::Inconsistent(
                "connection closed inside a frame".into(),
            )),
            e => e,
        })?;
        h.verify(buf)?;
        self.counters.received(HEADER_LEN + buf.len());
        Ok(h)
    }

    fn recv_timeout(
        &mut self,
        buf: &mut Vec<u8>,
        timeout: Duration,
    ) -> Result<Option<FrameHeader>, TransportError> {
        if self.r.buffer().is_empty() {
            let s = self.r.get_ref();
            s.set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
            let mut b = [0u8; 1];
            let r = s.peek(&mut b);
            s.set_read_timeout(None)?;
            match r {
                Ok(0) => return Err(TransportError::Closed),
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(None)
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return Ok(None),
                Err(e) => return Err(e.into()),
            }
        }
        self.recv(buf).map(Some)
    }

    fn closer(&self) -> Result<LinkCloser, TransportError> {
        Ok(LinkCloser(self.w.try_clone()?))
    }

    fn counters(&self) -> Arc<LinkCounters> {
        Arc::clone(&self.counters)
    }
}
