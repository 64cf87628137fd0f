//! `TcpDataLink`: the data plane on a plain TCP stream, driven by blocking `read` and
//! `writev` on the thread that owns the link. Each frame is its header, its payload and its
//! seal (see `seal`), read through a small buffer so a decode-sized frame costs one `read`.
//! `uring::UringDataLink` puts the same wire on io_uring.

use crate::blocking::{finish_stream_frame, DataLink, LinkCloser};
use crate::error::TransportError;
use crate::frame::{FrameHeader, HEADER_LEN};
use crate::seal::{LinkKeys, Opener, Sealer, SEAL_LEN};
use crate::transport::{LinkCounters, TransportKind};
use std::io::{BufReader, IoSlice, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

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
