//! The send path: a frame that fits the registered send buffer in one WRITE_FIXED, a larger
//! one as linked chains with the payload sent from the caller's slice.

use super::engine::{os_error, retryable, Op};
use super::link::UringDataLink;
use super::{MAX_CHAIN, MAX_OP_LEN, SEAL_OFF};
use crate::error::{ProtocolError, TransportError};
use crate::frame::HEADER_LEN;
use crate::seal::SEAL_LEN;
use std::io;

impl UringDataLink {
    /// Writes `sbuf[..total]`, which holds a whole frame, with WRITE_FIXED.
    pub(super) fn write_small(&mut self, total: usize) -> Result<(), TransportError> {
        let mut off = 0;
        while off < total {
            let op = Op::WriteFixed {
                ptr: self.sbuf[off..total].as_ptr(),
                len: total - off,
            };
            // SAFETY: the op points into the registered send buffer, owned by `self` and not
            // touched until `run` has reaped the completion.
            let res = unsafe { self.eng.run(&[op]) }?;
            match res[0] {
                0 => {
                    return Err(TransportError::Io(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "the socket accepted no bytes",
                    )))
                }
                r if r > 0 => off += r as usize,
                r if retryable(r) => {}
                r => return Err(os_error(r)),
            }
        }
        Ok(())
    }

    /// Header and seal from the send buffer, the payload from the caller's slice (by SEND_ZC
    /// when it is large enough), as linked chains.
    pub(super) fn write_large(
        &mut self,
        head: &[u8; HEADER_LEN],
        payload: &[u8],
        seal: &[u8; SEAL_LEN],
    ) -> Result<(), TransportError> {
        self.sbuf[..HEADER_LEN].copy_from_slice(head);
        self.sbuf[SEAL_OFF..SEAL_OFF + SEAL_LEN].copy_from_slice(seal);
        let r = self.write_large_inner(payload);
        // Never hand the slice back while the kernel holds it (error paths included).
        let drained = self.eng.wait_notifs(0);
        r.and(drained)
    }

    fn write_large_inner(&mut self, payload: &[u8]) -> Result<(), TransportError> {
        let len = payload.len();
        let body_end = HEADER_LEN + len;
        let total = body_end + SEAL_LEN;
        // Cleared for the rest of the frame when the kernel refuses to pin more pages.
        let mut zc = len >= self.zc_threshold;
        let mut off = 0;
        let mut stalls = 0u32;
        while off < total {
            if zc && off < body_end {
                let next = (body_end - off.max(HEADER_LEN)).min(self.zc_chunk);
                if self.eng.in_flight() + next > self.zc_inflight {
                    self.eng.wait_notifs(self.zc_inflight - next)?;
                }
            }
            let mut ops = [Op::LinkTimeout {
                ts: std::ptr::null(),
            }; MAX_CHAIN];
            let mut n = 0;
            let mut pos = off;
            if pos < HEADER_LEN {
                ops[n] = Op::Send {
                    ptr: self.sbuf[pos..HEADER_LEN].as_ptr(),
                    len: HEADER_LEN - pos,
                    more: true,
                };
                n += 1;
                pos = HEADER_LEN;
            }
            let mut pinned = self.eng.in_flight();
            while pos < body_end && n < MAX_CHAIN - 1 {
                let piece = &payload[pos - HEADER_LEN..];
                if zc {
                    let c = piece.len().min(self.zc_chunk);
                    if pinned + c > self.zc_inflight {
                        break;
                    }
                    pinned += c;
                    ops[n] = Op::SendZc {
                        ptr: piece.as_ptr(),
                        len: c,
                        more: true,
                    };
                    pos += c;
                } else {
                    let c = piece.len().min(MAX_OP_LEN);
                    ops[n] = Op::Send {
                        ptr: piece.as_ptr(),
                        len: c,
                        more: true,
                    };
                    pos += c;
                }
                n += 1;
            }
            if pos >= body_end && n < MAX_CHAIN {
                let s = SEAL_OFF + (pos - body_end);
                ops[n] = Op::Send {
                    ptr: self.sbuf[s..SEAL_OFF + SEAL_LEN].as_ptr(),
                    len: total - pos,
                    more: false,
                };
                n += 1;
            }
            // MSG_MORE only where the chain goes on: what the chain queued must go out now, or
            // a wait for its zero-copy notifications would wait for data TCP holds back.
            if let Some(Op::Send { more, .. } | Op::SendZc { more, .. }) = ops[..n].last_mut() {
                *more = false;
            }
            // SAFETY: header and seal ops point into the registered send buffer, owned by
            // `self` and untouched until `run` returns; payload ops point into `payload`,
            // borrowed for the whole of `send`, which waits for every zero-copy notification
            // (`write_large`) before it returns.
            let res = unsafe { self.eng.run(&ops[..n]) }?;

            // What went out is the prefix of the chain that completed in full, plus the short
            // op that broke it. Ops after a break are cancelled (`-ECANCELED`); an op that
            // fails when submitted (e.g. SEND_ZC's page accounting) cancels the ops before it
            // too. The first error other than a cancellation says why.
            let before = off;
            let mut unbroken = true;
            let mut cause = None;
            for (op, &r) in ops[..n].iter().zip(&res[..n]) {
                if r >= 0 {
                    if !unbroken {
                        if r > 0 {
                            return Err(TransportError::Protocol(ProtocolError::Inconsistent(
                                "io_uring ran a send after a broken one in its chain: the \
                                 stream is corrupt"
                                    .into(),
                            )));
                        }
                        continue;
                    }
                    off += r as usize;
                    unbroken = (r as usize) == op.len();
                    continue;
                }
                unbroken = false;
                if r != -libc::ECANCELED && cause.is_none() {
                    cause = Some((op, r));
                }
            }
            match cause {
                None => {}
                Some((_, r)) if retryable(r) => {}
                Some((Op::SendZc { .. }, r)) if r == -libc::ENOMEM => {
                    if self.eng.in_flight() > 0 {
                        // Our own pinned pages first.
                        self.eng.wait_notifs(0)?;
                    } else {
                        // Other links or processes of this user hold the memlock budget:
                        // copy the rest of this frame and pin less from now on.
                        zc = false;
                        self.zc_inflight = (self.zc_inflight / 2).max(64 << 10);
                        self.zc_chunk = self.zc_chunk.min(self.zc_inflight);
                        self.warn_nomem();
                    }
                }
                Some((_, r)) => return Err(os_error(r)),
            }
            if off == before {
                stalls += 1;
                if stalls > 1000 {
                    return Err(TransportError::Io(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "the socket accepts no bytes",
                    )));
                }
            } else {
                stalls = 0;
            }
        }
        Ok(())
    }

    fn warn_nomem(&mut self) {
        if !self.nomem_warned {
            self.nomem_warned = true;
            let limit = self
                .memlock_limit
                .map_or("unlimited".into(), |l| format!("{} KiB", l >> 10));
            tracing::warn!(
                "io_uring: SEND_ZC refused for lack of lockable memory (pinned pages count \
                 against RLIMIT_MEMLOCK, now {limit}, shared by all processes of a user without \
                 CAP_IPC_LOCK); sending the frame by copying and pinning less. Raise `ulimit -l` \
                 (LimitMEMLOCK= under systemd) to keep zero-copy"
            );
        }
    }
}
