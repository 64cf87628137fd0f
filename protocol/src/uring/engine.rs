//! The ring of one link: operations, chains of them, their completions and zero-copy
//! notifications.

use super::{
    MAX_CHAIN, MAX_ENTER_FAILURES, NOTIF_POLL, NOTIF_USAGE_ZC_COPIED, RECV_BUF, SEND_BUF,
    SEND_ZC_REPORT_USAGE,
};
use crate::error::{ProtocolError, TransportError};
use crate::transport::LinkCounters;
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

/// One operation of a chain. Pointers, because the memory belongs to the link's registered
/// buffers or to the caller's slices; `Engine::run` states what they must satisfy.
#[derive(Clone, Copy)]
pub(super) enum Op {
    WriteFixed {
        ptr: *const u8,
        len: usize,
    },
    ReadFixed {
        ptr: *mut u8,
        len: usize,
    },
    Send {
        ptr: *const u8,
        len: usize,
        more: bool,
    },
    SendZc {
        ptr: *const u8,
        len: usize,
        more: bool,
    },
    Recv {
        ptr: *mut u8,
        len: usize,
    },
    LinkTimeout {
        ts: *const types::Timespec,
    },
}

impl Op {
    pub(super) fn len(&self) -> usize {
        match *self {
            Op::WriteFixed { len, .. }
            | Op::ReadFixed { len, .. }
            | Op::Send { len, .. }
            | Op::SendZc { len, .. }
            | Op::Recv { len, .. } => len,
            Op::LinkTimeout { .. } => 0,
        }
    }

    fn entry(&self, fd: types::Fd) -> squeue::Entry {
        let send_flags = |more: bool| {
            libc::MSG_NOSIGNAL | libc::MSG_WAITALL | if more { libc::MSG_MORE } else { 0 }
        };
        // Lengths are capped at MAX_OP_LEN when the ops are made, so they fit a u32.
        match *self {
            Op::WriteFixed { ptr, len } => {
                opcode::WriteFixed::new(fd, ptr, len as u32, SEND_BUF).build()
            }
            Op::ReadFixed { ptr, len } => {
                opcode::ReadFixed::new(fd, ptr, len as u32, RECV_BUF).build()
            }
            Op::Send { ptr, len, more } => opcode::Send::new(fd, ptr, len as u32)
                .flags(send_flags(more))
                .build(),
            Op::SendZc { ptr, len, more } => opcode::SendZc::new(fd, ptr, len as u32)
                .flags(send_flags(more))
                .zc_flags(SEND_ZC_REPORT_USAGE)
                .build(),
            Op::Recv { ptr, len } => opcode::Recv::new(fd, ptr, len as u32)
                .flags(libc::MSG_WAITALL)
                .build(),
            Op::LinkTimeout { ts } => opcode::LinkTimeout::new(ts).build(),
        }
    }
}

/// A chain's results, in the order of its operations (`-ECANCELED` past its end).
type Results = [i32; MAX_CHAIN];

pub(super) fn os_error(neg: i32) -> TransportError {
    TransportError::Io(io::Error::from_raw_os_error(-neg))
}

pub(super) fn retryable(r: i32) -> bool {
    r == -libc::EINTR || r == -libc::EAGAIN
}

/// The ring of one link and the socket it works on.
pub(super) struct Engine {
    pub(super) ring: IoUring,
    pub(super) stream: TcpStream,
    pub(super) fd: RawFd,
    pub(super) next_id: u64,
    /// Zero-copy sends whose notification has not come yet: (user data, bytes).
    pub(super) notifs: Vec<(u64, usize)>,
    pub(super) counters: Arc<LinkCounters>,
    /// Set when the link was shut down with zero-copy pages still queued in the kernel.
    pub(super) poisoned: bool,
    pub(super) copied_logged: bool,
    pub(super) enter_failures: u32,
    pub(super) cqes: Vec<(u64, i32, u32)>,
    pub(super) sqes: Vec<squeue::Entry>,
}

impl Engine {
    pub(super) fn in_flight(&self) -> usize {
        self.notifs.iter().map(|&(_, n)| n).sum()
    }

    /// Submits `ops` as one linked chain and waits for every one of their completions.
    ///
    /// # Safety
    /// Every pointer in `ops` must be valid for its length (for reads, writable and not
    /// accessed by anyone else) until this returns, and registered-buffer ops must point
    /// into the buffer registered under their index. The memory of a `SendZc` must further
    /// stay valid and unmodified until its notification is reaped by `wait_notifs`.
    pub(super) unsafe fn run(&mut self, ops: &[Op]) -> Result<Results, TransportError> {
        if ops.is_empty() || ops.len() > MAX_CHAIN {
            return Err(TransportError::Protocol(ProtocolError::Inconsistent(
                format!("io_uring chain of {} operations", ops.len()),
            )));
        }
        let base = self.next_id;
        self.next_id += ops.len() as u64;
        let fd = types::Fd(self.fd);
        self.sqes.clear();
        for (i, op) in ops.iter().enumerate() {
            let mut e = op.entry(fd).user_data(base + i as u64);
            if i + 1 < ops.len() {
                e = e.flags(squeue::Flags::IO_LINK);
            }
            self.sqes.push(e);
        }
        // SAFETY: the caller keeps the memory of every op valid until this function returns
        // (and a SendZc's until its notification), and this function returns only after the
        // completions of all ops pushed here have been reaped. `push_multiple` pushes the
        // whole chain or nothing (the queue is empty between chains and has room for two).
        if unsafe { self.ring.submission().push_multiple(&self.sqes) }.is_err() {
            return Err(TransportError::Io(io::Error::other(
                "io_uring submission queue unexpectedly full",
            )));
        }
        let mut res: Results = [-libc::ECANCELED; MAX_CHAIN];
        let mut pending = ops.len();
        loop {
            self.reap(Some((base, ops, &mut res, &mut pending)));
            if pending == 0 {
                return Ok(res);
            }
            self.wait(None);
        }
    }

    /// Processes every available completion: results of the current chain (if any) and
    /// zero-copy notifications.
    fn reap(&mut self, mut chain: Option<(u64, &[Op], &mut Results, &mut usize)>) {
        self.cqes.clear();
        self.cqes.extend(
            self.ring
                .completion()
                .map(|c| (c.user_data(), c.result(), c.flags())),
        );
        for i in 0..self.cqes.len() {
            let (id, r, flags) = self.cqes[i];
            if cqueue::notif(flags) {
                self.notified(id, r);
                continue;
            }
            let Some((base, ops, res, pending)) = chain.as_mut() else {
                tracing::debug!(id, r, "io_uring: completion outside a chain ignored");
                continue;
            };
            let Some(i) = id
                .checked_sub(*base)
                .map(|i| i as usize)
                .filter(|&i| i < ops.len())
            else {
                tracing::debug!(id, r, "io_uring: stale completion ignored");
                continue;
            };
            res[i] = r;
            **pending = pending.saturating_sub(1);
            match ops[i] {
                Op::SendZc { len, .. } => {
                    if r >= 0 {
                        LinkCounters::bump(&self.counters.zc_sends);
                    }
                    if cqueue::more(flags) {
                        self.notifs.push((id, len));
                    }
                }
                Op::WriteFixed { .. } | Op::ReadFixed { .. } if r >= 0 => {
                    LinkCounters::bump(&self.counters.fixed_buf_ops);
                }
                _ => {}
            }
        }
    }

    fn notified(&mut self, id: u64, r: i32) {
        match self.notifs.iter().position(|&(n, _)| n == id) {
            Some(i) => {
                self.notifs.swap_remove(i);
            }
            None => tracing::debug!(id, "io_uring: notification for an unknown send"),
        }
        if r as u32 & NOTIF_USAGE_ZC_COPIED != 0 {
            LinkCounters::bump(&self.counters.zc_copied);
            if !self.copied_logged {
                self.copied_logged = true;
                tracing::info!(
                    peer = ?self.stream.peer_addr().ok(),
                    "io_uring: the kernel completed zero-copy sends by copying (always so on \
                     loopback; on a NIC without scatter-gather or checksum offload too): \
                     SEND_ZC gains nothing on this link"
                );
            }
        }
    }

    /// Waits for at least one completion (or `timeout`); true when it timed out.
    fn wait(&mut self, timeout: Option<Duration>) -> bool {
        let r = match timeout {
            None => self.ring.submit_and_wait(1),
            Some(t) => {
                let ts = types::Timespec::from(t);
                let args = types::SubmitArgs::new().timespec(&ts);
                self.ring.submitter().submit_with_args(1, &args)
            }
        };
        match r {
            Ok(_) => {
                self.enter_failures = 0;
                false
            }
            Err(e) => match e.raw_os_error() {
                Some(libc::ETIME) => true,
                // Interrupted, or the kernel is short of memory or has completions to flush
                // first (they are reaped before the next wait).
                Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY) => false,
                _ => {
                    self.enter_failed(e);
                    false
                }
            },
        }
    }

    /// `io_uring_enter` fails for a reason that should not happen. Operations may still be in
    /// flight on memory we must not hand back, so shut the socket (which completes every
    /// socket operation) and keep trying; abort the process rather than return with the
    /// kernel possibly writing into freed memory.
    fn enter_failed(&mut self, e: io::Error) {
        if self.enter_failures == 0 {
            tracing::error!("io_uring_enter failed: {e}; shutting the link down");
            let _ = self.stream.shutdown(Shutdown::Both);
        }
        self.enter_failures += 1;
        if self.enter_failures >= MAX_ENTER_FAILURES {
            eprintln!(
                "ringllm: io_uring_enter keeps failing ({e}) with operations in flight; aborting \
                 rather than returning memory the kernel may still write to"
            );
            std::process::abort();
        }
        std::thread::sleep(Duration::from_millis(10));
    }

    /// Waits until at most `target` zero-copy bytes await their notification. When the
    /// socket was shut down or failed while data is still queued (a peer that stopped
    /// reading keeps it queued forever), gives up and poisons the link: the kernel only
    /// ever reads those pages, which it pinned, so handing the caller's slice back is
    /// memory-safe; the data it may still send is on a link that is closed anyway.
    pub(super) fn wait_notifs(&mut self, target: usize) -> Result<(), TransportError> {
        let gone = || {
            TransportError::Io(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the link was shut down while zero-copy data was still queued in the kernel",
            ))
        };
        loop {
            self.reap(None);
            if self.in_flight() <= target {
                return Ok(());
            }
            if self.poisoned {
                return Err(gone());
            }
            if self.wait(Some(NOTIF_POLL)) && self.hung_up() {
                self.poisoned = true;
                return Err(gone());
            }
        }
    }

    /// Whether the socket is shut down both ways or has failed.
    fn hung_up(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.fd,
            events: 0,
            revents: 0,
        };
        // SAFETY: `p` is a valid pollfd for the duration of the call; a zero timeout does not
        // block.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n > 0 && p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
    }

    pub(super) fn check_usable(&self) -> Result<(), TransportError> {
        if self.poisoned {
            return Err(TransportError::Io(io::Error::new(
                io::ErrorKind::NotConnected,
                "the io_uring link was shut down with zero-copy data in flight",
            )));
        }
        Ok(())
    }
}

pub(super) fn build_ring(entries: u32) -> io::Result<IoUring> {
    // COOP_TASKRUN (5.19) saves an interrupt per completion; SINGLE_ISSUER and DEFER_TASKRUN
    // are not used because a link may move to another thread between calls.
    IoUring::builder()
        .setup_coop_taskrun()
        .setup_cqsize(entries * 4)
        .build(entries)
        .or_else(|_| IoUring::builder().setup_cqsize(entries * 4).build(entries))
}

pub(super) fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to).saturating_mul(to)
}
