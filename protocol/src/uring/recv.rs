//! The receive path: reads into the registered receive buffer, large payload remainders
//! straight into the caller's buffer.

use super::engine::{os_error, retryable, Op};
use super::link::UringDataLink;
use super::MAX_OP_LEN;
use crate::error::{ProtocolError, TransportError};
use std::io;

impl UringDataLink {
    /// Reads into the (empty) receive buffer; the bytes read, 0 at end of stream.
    fn fill(&mut self) -> Result<usize, TransportError> {
        self.rpos = 0;
        self.rend = 0;
        loop {
            let op = Op::ReadFixed {
                ptr: self.rbuf.as_mut_ptr(),
                len: self.rbuf.len(),
            };
            // SAFETY: the op points into the registered receive buffer, owned by `self` and
            // not accessed until `run` has reaped the completion.
            let res = unsafe { self.eng.run(&[op]) }?;
            match res[0] {
                r if r >= 0 => {
                    self.rend = r as usize;
                    return Ok(self.rend);
                }
                r if retryable(r) => {}
                r => return Err(os_error(r)),
            }
        }
    }

    /// Fills `dst` from the stream: `Closed` when it ends before the first byte, an error
    /// when it ends later.
    pub(super) fn read_exact(&mut self, dst: &mut [u8]) -> Result<(), TransportError> {
        let mut got = 0;
        let eof = |got: usize, want: usize| {
            if got == 0 {
                TransportError::Closed
            } else {
                TransportError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("connection closed after {got} of {want} bytes"),
                ))
            }
        };
        while got < dst.len() {
            if self.rpos < self.rend {
                let n = (self.rend - self.rpos).min(dst.len() - got);
                dst[got..got + n].copy_from_slice(&self.rbuf[self.rpos..self.rpos + n]);
                self.rpos += n;
                got += n;
                continue;
            }
            let want = dst.len() - got;
            if want < self.direct_min {
                if self.fill()? == 0 {
                    return Err(eof(got, dst.len()));
                }
                continue;
            }
            // Straight into `dst`, then (linked) refill the buffer with what follows.
            self.rpos = 0;
            self.rend = 0;
            let c = want.min(MAX_OP_LEN);
            let ops = [
                Op::Recv {
                    ptr: dst[got..].as_mut_ptr(),
                    len: c,
                },
                Op::ReadFixed {
                    ptr: self.rbuf.as_mut_ptr(),
                    len: self.rbuf.len(),
                },
            ];
            // SAFETY: `dst` is exclusively borrowed for this call and the receive buffer is
            // owned by `self`; neither is accessed until `run` has reaped both completions.
            let res = unsafe { self.eng.run(&ops) }?;
            match res[0] {
                0 => return Err(eof(got, dst.len())),
                r if r > 0 => {
                    got += r as usize;
                    if (r as usize) < c {
                        if res[1] > 0 {
                            return Err(TransportError::Protocol(ProtocolError::Inconsistent(
                                "io_uring ran a read after a short one in its chain".into(),
                            )));
                        }
                        continue;
                    }
                }
                r if retryable(r) => continue,
                r => return Err(os_error(r)),
            }
            // The linked read: data, end of stream (seen again by the next read), or an
            // error that the next read reports.
            if res[1] > 0 {
                self.rend = res[1] as usize;
            }
        }
        Ok(())
    }
}
