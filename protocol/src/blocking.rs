//! The data plane: blocking frame links owned by one thread each. A node's compute thread
//! reads its input, runs its layers and writes its output on these without handing the frame
//! to any other thread, so a hop costs one `read` and one `writev` and no wake-ups; the
//! control plane (handshakes, heartbeats, assignments) stays on tokio.
//!
//! `DataLink` is the trait later transports (UDP, io_uring, the kernel module) implement for
//! the data plane; `TcpDataLink` is the TCP one.

use crate::error::{ProtocolError, TransportError};
use crate::frame::{FrameHeader, HEADER_LEN};
use crate::seal::{LinkKeys, Opener, SealError, Sealer, SEAL_LEN};
use crate::transport::{LinkCounters, TransportKind};
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

/// Data frames on a TCP stream: header, payload and the frame's seal (see `seal`).
pub struct TcpDataLink {
    r: BufReader<TcpStream>,
    w: TcpStream,
    max_payload: u32,
    sealer: Sealer,
    opener: Opener,
    counters: Arc<LinkCounters>,
}

impl TcpDataLink {
    /// Wraps a connected, authenticated stream (switched to blocking mode); `keys` come from
    /// its handshake.
    pub fn new(
        stream: TcpStream,
        max_payload: u32,
        keys: &LinkKeys,
    ) -> Result<TcpDataLink, TransportError> {
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        let w = stream.try_clone()?;
        Ok(TcpDataLink {
            r: BufReader::with_capacity(64 << 10, stream),
            w,
            max_payload,
            sealer: Sealer::new(&keys.send),
            opener: Opener::new(&keys.recv),
            counters: Arc::new(LinkCounters::default()),
        })
    }

    /// The underlying stream (for tests and for handing the socket to another engine).
    pub fn stream(&self) -> &TcpStream {
        &self.w
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

/// Writes all of `parts` with as few `writev` calls as the socket allows.
pub(crate) fn write_all_parts<W: Write>(w: &mut W, parts: &[&[u8]]) -> std::io::Result<()> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut done = 0;
    while done < total {
        // Skip the parts already written, and the written prefix of the current one.
        let mut skip = done;
        let mut slices = Vec::with_capacity(parts.len());
        for p in parts {
            if skip >= p.len() {
                skip -= p.len();
                continue;
            }
            slices.push(IoSlice::new(&p[skip..]));
            skip = 0;
        }
        match w.write_vectored(&slices) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::WriteZero,
                    "the socket accepted no bytes",
                ))
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
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
        let seal = self.sealer.seal(&[&head, payload]);
        write_all_parts(&mut self.w, &[&head, payload, &seal])?;
        self.counters.sent(HEADER_LEN + payload.len() + SEAL_LEN);
        Ok(())
    }

    fn recv(&mut self, buf: &mut Vec<u8>) -> Result<FrameHeader, TransportError> {
        let mut head = [0u8; HEADER_LEN];
        read_exact_or_closed(&mut self.r, &mut head)?;
        let h = FrameHeader::decode(&head, self.max_payload)?;
        buf.clear();
        buf.resize(h.len as usize, 0);
        let mut seal = [0u8; SEAL_LEN];
        let read = read_exact_or_closed(&mut self.r, buf)
            .and_then(|()| read_exact_or_closed(&mut self.r, &mut seal));
        finish_stream_frame(read, h, &head, buf, &seal, &mut self.opener, &self.counters)
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
        Ok(LinkCloser::for_stream(self.w.try_clone()?))
    }

    fn counters(&self) -> Arc<LinkCounters> {
        Arc::clone(&self.counters)
    }

    fn transport(&self) -> TransportKind {
        TransportKind::Tcp
    }
}
