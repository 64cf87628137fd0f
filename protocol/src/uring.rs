//! The data plane on io_uring: the same frames as `TcpDataLink` (header ‖ payload ‖ seal, see
//! `tcp` and `seal`), written and read through one io_uring instance per link.
//!
//! * Frames that fit the registered send buffer (`UringConfig::buffer`, 64 KiB) are
//!   assembled there and written with one `IORING_OP_WRITE_FIXED`. Every read lands in a
//!   registered receive buffer through `IORING_OP_READ_FIXED`, which then serves headers,
//!   small payloads and seals like a `BufReader`.
//! * Larger frames go out as a linked chain `header → payload → seal` (one `io_uring_enter`):
//!   the payload straight from the caller's slice, by `IORING_OP_SEND` (the kernel copies)
//!   or, from `UringConfig::zc_threshold` bytes on, by `IORING_OP_SEND_ZC` in pieces. `send`
//!   returns only after the kernel's notifications say it no longer references the slice.
//!   Large payloads are received with `IORING_OP_RECV` (`MSG_WAITALL`) straight into the
//!   caller's buffer, linked to a `READ_FIXED` that picks up the seal and what follows it.
//! * `recv_timeout` links the first read to an `IORING_OP_LINK_TIMEOUT`.
//!
//! Zero-copy is not free, which is why the default threshold is high:
//! * A zero-copy `send` returns when the peer has acknowledged the data, not when it is
//!   queued: the sender waits for the wire (and buffers only what the receiver's window
//!   holds), where a copying send returns as soon as the socket buffer takes the bytes.
//! * The kernel pins the pages until then; for a user without `CAP_IPC_LOCK` the pinned bytes
//!   (and the registered buffers) count against `RLIMIT_MEMLOCK`, shared by every process of
//!   that user. A link keeps at most `zc_inflight` bytes pinned; when the kernel still
//!   refuses (`ENOMEM`) the piece is sent by copying and a warning says how to raise the
//!   limit.
//! * On loopback, and on NICs without scatter-gather, the kernel copies anyway
//!   (`LinkCounters::zc_copied`), and zero-copy is then slower than copying.
//!
//! Memory safety rests on one rule: no method returns while the kernel may still write into,
//! or read from, memory it was given, except for the read-only pages of a zero-copy send
//! whose link was shut down while the kernel still queued them (see `Engine::wait_notifs`).
//! Every operation goes through `Engine::run`, which waits for all completions of the chain
//! it submitted, on every path.

use crate::blocking::{finish_stream_frame, DataLink, LinkCloser};
use crate::error::{ProtocolError, TransportError};
use crate::frame::{FrameHeader, HEADER_LEN};
use crate::seal::{LinkKeys, Opener, Sealer, SEAL_LEN};
use crate::transport::{LinkCounters, TransportKind};
use io_uring::{cqueue, opcode, squeue, types, IoUring, Probe};
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// `IORING_SEND_ZC_REPORT_USAGE`: the notification says whether the kernel copied after all.
const SEND_ZC_REPORT_USAGE: u16 = 8;
/// `IORING_NOTIF_USAGE_ZC_COPIED`, in a notification's result.
const NOTIF_USAGE_ZC_COPIED: u32 = 1 << 31;
/// Registered buffer indices.
const SEND_BUF: u16 = 0;
const RECV_BUF: u16 = 1;
/// Longest chain of linked operations submitted at once.
const MAX_CHAIN: usize = 16;
/// Largest length given to one operation.
const MAX_OP_LEN: usize = 1 << 30;
/// Where a large frame's seal is staged in the send buffer (its header is at 0).
const SEAL_OFF: usize = 64;
/// How often a wait for zero-copy notifications checks whether the link was shut down.
const NOTIF_POLL: Duration = Duration::from_millis(50);
/// Consecutive failed `io_uring_enter` calls (10 ms apart) before the process is aborted
/// rather than letting the kernel write into memory that was handed back.
const MAX_ENTER_FAILURES: u32 = 1000;

/// What this kernel's io_uring offers us.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UringSupport {
    /// `IORING_OP_SEND_ZC` with usage reports (Linux 6.2 and later).
    pub send_zc: bool,
    /// The kernel release, for logs.
    pub kernel: String,
    /// The `RLIMIT_MEMLOCK` that registered buffers and pinned zero-copy pages count against,
    /// or `None` when it does not apply (`CAP_IPC_LOCK`, or unlimited).
    pub memlock_limit: Option<u64>,
}

/// Tuning of a `UringDataLink`.
#[derive(Clone, Debug)]
pub struct UringConfig {
    /// Payloads of at least this many bytes are sent with `IORING_OP_SEND_ZC` from the
    /// caller's slice (smaller ones by copying). `usize::MAX` turns zero-copy off. The default
    /// (4 MiB) keeps it to prefill-sized frames: on loopback zero-copy always loses (the
    /// kernel copies anyway), and on a NIC it saves one memory copy (a few % of the cost of
    /// sealing the same bytes) at the price of `send` waiting for the peer's acknowledgement.
    pub zc_threshold: usize,
    /// Zero-copy sends are issued in pieces of at most this many bytes.
    pub zc_chunk: usize,
    /// At most this many zero-copy bytes wait for their kernel notification at once (capped
    /// at a quarter of `RLIMIT_MEMLOCK` where that applies).
    pub zc_inflight: usize,
    /// Submission queue entries (at least 32).
    pub ring_entries: u32,
    /// Size of the registered send and receive buffers: frames up to this size (header and
    /// seal included) are written from the send buffer in one WRITE_FIXED; payload
    /// remainders of a quarter of it or more are received straight into the caller's buffer.
    pub buffer: usize,
}

impl Default for UringConfig {
    fn default() -> Self {
        UringConfig {
            zc_threshold: 4 << 20,
            zc_chunk: 1 << 20,
            zc_inflight: 8 << 20,
            ring_entries: 64,
            buffer: 64 << 10,
        }
    }
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "(unknown release)".into())
}

/// `RLIMIT_MEMLOCK` where it applies to io_uring's accounting (read from /proc, so no
/// unsafe calls).
fn memlock_limit() -> Option<u64> {
    const CAP_IPC_LOCK: u32 = 14;
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let cap_eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    if (cap_eff >> CAP_IPC_LOCK) & 1 == 1 {
        return None;
    }
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let soft = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max locked memory"))
        .and_then(|rest| rest.split_whitespace().next())?;
    soft.parse().ok()
}

fn unavailable(kind: io::ErrorKind, msg: String) -> TransportError {
    TransportError::Io(io::Error::new(
        kind,
        format!("io_uring transport unavailable: {msg}; use --transport tcp"),
    ))
}

/// Why `io_uring_setup` failed, in words an operator can act on.
fn setup_refused(e: &io::Error, kernel: &str) -> TransportError {
    match e.raw_os_error() {
        Some(libc::ENOSYS) => unavailable(
            io::ErrorKind::Unsupported,
            format!(
                "kernel {kernel} has no io_uring system calls (built without CONFIG_IO_URING, \
                 or older than 5.1)"
            ),
        ),
        Some(libc::EPERM) | Some(libc::EACCES) => {
            let sysctl = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| "?".into());
            unavailable(
                io::ErrorKind::PermissionDenied,
                format!(
                    "io_uring_setup was refused ({e}); kernel.io_uring_disabled = {sysctl} \
                     (0 allows everyone, 1 only members of kernel.io_uring_group, 2 nobody: \
                     `sysctl -w kernel.io_uring_disabled=0`), or a seccomp filter blocks \
                     io_uring (Docker's and Podman's default profiles do: allow io_uring_setup, \
                     io_uring_enter and io_uring_register)"
                ),
            )
        }
        Some(libc::ENOMEM) => unavailable(
            io::ErrorKind::OutOfMemory,
            format!(
                "io_uring_setup: {e} (the ring's memory counts against RLIMIT_MEMLOCK on older \
                 kernels: raise `ulimit -l`)"
            ),
        ),
        _ => unavailable(io::ErrorKind::Other, format!("io_uring_setup failed: {e}")),
    }
}

/// Checks that io_uring works here and has every opcode the link uses. Run at start-up by
/// `--transport uring`: the error says why io_uring is refused and what to change.
pub fn probe() -> Result<UringSupport, TransportError> {
    let kernel = kernel_release();
    let mut ring: IoUring = IoUring::new(8).map_err(|e| setup_refused(&e, &kernel))?;
    let mut p = Probe::new();
    ring.submitter().register_probe(&mut p).map_err(|e| {
        unavailable(
            io::ErrorKind::Unsupported,
            format!("kernel {kernel} cannot list its io_uring opcodes ({e}); Linux 6.0 or later is needed"),
        )
    })?;
    let needed = [
        (opcode::ReadFixed::CODE, "READ_FIXED"),
        (opcode::WriteFixed::CODE, "WRITE_FIXED"),
        (opcode::Send::CODE, "SEND"),
        (opcode::Recv::CODE, "RECV"),
        (opcode::LinkTimeout::CODE, "LINK_TIMEOUT"),
    ];
    let mut missing: Vec<&str> = needed
        .iter()
        .filter(|(code, _)| !p.is_supported(*code))
        .map(|&(_, name)| name)
        .collect();
    let params = ring.params();
    if !params.is_feature_ext_arg() {
        missing.push("IORING_FEAT_EXT_ARG");
    }
    if !params.is_feature_nodrop() {
        missing.push("IORING_FEAT_NODROP");
    }
    if !missing.is_empty() {
        return Err(unavailable(
            io::ErrorKind::Unsupported,
            format!(
                "kernel {kernel} lacks io_uring {} (Linux 6.0 or later is needed)",
                missing.join(", ")
            ),
        ));
    }
    let send_zc = p.is_supported(opcode::SendZc::CODE) && zc_usage_reports(&mut ring);
    Ok(UringSupport {
        send_zc,
        kernel,
        memlock_limit: memlock_limit(),
    })
}

/// Whether SEND_ZC accepts `IORING_SEND_ZC_REPORT_USAGE` (6.2+): tried on a Unix socket pair,
/// which does not do zero-copy, so a kernel that knows the flag answers `EOPNOTSUPP` (after
/// checking the flags) and one that does not answers `EINVAL`.
fn zc_usage_reports(ring: &mut IoUring) -> bool {
    static BYTE: [u8; 1] = [0];
    let Ok((a, _b)) = std::os::unix::net::UnixStream::pair() else {
        return false;
    };
    let e = opcode::SendZc::new(types::Fd(a.as_raw_fd()), BYTE.as_ptr(), 1)
        .flags(libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
        .zc_flags(SEND_ZC_REPORT_USAGE)
        .build()
        .user_data(1);
    // SAFETY: the buffer is a static; the socket `a` lives until after the loop below has
    // reaped the completion and any notification.
    if unsafe { ring.submission().push(&e) }.is_err() {
        return false;
    }
    let mut result = None;
    let mut notif_pending = false;
    for _ in 0..1000 {
        for cqe in ring.completion() {
            if cqueue::notif(cqe.flags()) {
                notif_pending = false;
            } else {
                result = Some(cqe.result());
                notif_pending = cqueue::more(cqe.flags());
            }
        }
        if result.is_some() && !notif_pending {
            break;
        }
        let _ = ring.submit_and_wait(1);
    }
    if notif_pending || result.is_none() {
        // Never leave with the kernel holding our socket's request: this ring is dropped
        // right after, which cancels and waits for it.
        return false;
    }
    matches!(result, Some(r) if r >= 0 || r == -libc::EOPNOTSUPP)
}

/// The probe result, once per process (the link constructor needs it; `probe` itself always
/// asks the kernel again).
fn support() -> Result<UringSupport, TransportError> {
    static SUPPORT: OnceLock<UringSupport> = OnceLock::new();
    if let Some(s) = SUPPORT.get() {
        return Ok(s.clone());
    }
    let s = probe()?;
    Ok(SUPPORT.get_or_init(|| s).clone())
}

/// One operation of a chain. Pointers, because the memory belongs to the link's registered
/// buffers or to the caller's slices; `Engine::run` states what they must satisfy.
#[derive(Clone, Copy)]
enum Op {
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
    fn len(&self) -> usize {
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

fn os_error(neg: i32) -> TransportError {
    TransportError::Io(io::Error::from_raw_os_error(-neg))
}

fn retryable(r: i32) -> bool {
    r == -libc::EINTR || r == -libc::EAGAIN
}

/// The ring of one link and the socket it works on.
struct Engine {
    ring: IoUring,
    stream: TcpStream,
    fd: RawFd,
    next_id: u64,
    /// Zero-copy sends whose notification has not come yet: (user data, bytes).
    notifs: Vec<(u64, usize)>,
    counters: Arc<LinkCounters>,
    /// Set when the link was shut down with zero-copy pages still queued in the kernel.
    poisoned: bool,
    copied_logged: bool,
    enter_failures: u32,
    cqes: Vec<(u64, i32, u32)>,
    sqes: Vec<squeue::Entry>,
}

impl Engine {
    fn in_flight(&self) -> usize {
        self.notifs.iter().map(|&(_, n)| n).sum()
    }

    /// Submits `ops` as one linked chain and waits for every one of their completions.
    ///
    /// # Safety
    /// Every pointer in `ops` must be valid for its length (for reads, writable and not
    /// accessed by anyone else) until this returns, and registered-buffer ops must point
    /// into the buffer registered under their index. The memory of a `SendZc` must further
    /// stay valid and unmodified until its notification is reaped by `wait_notifs`.
    unsafe fn run(&mut self, ops: &[Op]) -> Result<Results, TransportError> {
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
    fn wait_notifs(&mut self, target: usize) -> Result<(), TransportError> {
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

    fn check_usable(&self) -> Result<(), TransportError> {
        if self.poisoned {
            return Err(TransportError::Io(io::Error::new(
                io::ErrorKind::NotConnected,
                "the io_uring link was shut down with zero-copy data in flight",
            )));
        }
        Ok(())
    }
}

fn build_ring(entries: u32) -> io::Result<IoUring> {
    // COOP_TASKRUN (5.19) saves an interrupt per completion; SINGLE_ISSUER and DEFER_TASKRUN
    // are not used because a link may move to another thread between calls.
    IoUring::builder()
        .setup_coop_taskrun()
        .setup_cqsize(entries * 4)
        .build(entries)
        .or_else(|_| IoUring::builder().setup_cqsize(entries * 4).build(entries))
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to).saturating_mul(to)
}

/// Data frames on a TCP stream driven through io_uring; byte for byte what `TcpDataLink`
/// writes and reads.
pub struct UringDataLink {
    // Declared first: dropped (the ring closed) before the buffers registered with it.
    eng: Engine,
    sbuf: Box<[u8]>,
    rbuf: Box<[u8]>,
    /// Unread bytes of `rbuf` are `rpos..rend`.
    rpos: usize,
    rend: usize,
    max_payload: u32,
    sealer: Sealer,
    opener: Opener,
    counters: Arc<LinkCounters>,
    /// `usize::MAX` when zero-copy is off or unsupported.
    zc_threshold: usize,
    zc_chunk: usize,
    zc_inflight: usize,
    /// Payload remainders of at least this size are received straight into the caller's
    /// buffer.
    direct_min: usize,
    memlock_limit: Option<u64>,
    nomem_warned: bool,
}

static FIRST_LINK_LOGGED: AtomicBool = AtomicBool::new(false);

impl UringDataLink {
    /// Takes over a connected, authenticated TCP stream (switched to blocking mode); `keys`
    /// come from its handshake.
    pub fn new(
        stream: TcpStream,
        max_payload: u32,
        keys: &LinkKeys,
        cfg: UringConfig,
    ) -> Result<UringDataLink, TransportError> {
        let support = support()?;
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        let entries = cfg
            .ring_entries
            .clamp(2 * MAX_CHAIN as u32, 4096)
            .next_power_of_two();
        let ring = build_ring(entries).map_err(|e| setup_refused(&e, &support.kernel))?;

        let zc = support.send_zc && cfg.zc_threshold != usize::MAX;
        let zc_threshold = if zc {
            cfg.zc_threshold.max(1)
        } else {
            usize::MAX
        };
        let buffer = round_up(cfg.buffer.clamp(4 << 10, 256 << 20), 4096);
        let mut sbuf = vec![0u8; buffer].into_boxed_slice();
        let mut rbuf = vec![0u8; buffer].into_boxed_slice();
        let iov = [
            libc::iovec {
                iov_base: sbuf.as_mut_ptr().cast(),
                iov_len: sbuf.len(),
            },
            libc::iovec {
                iov_base: rbuf.as_mut_ptr().cast(),
                iov_len: rbuf.len(),
            },
        ];
        // SAFETY: both buffers are heap allocations owned by the link, never resized, and
        // freed only after the ring (the `eng` field is dropped first); the kernel accesses
        // them only through operations `Engine::run` waits for.
        unsafe { ring.submitter().register_buffers(&iov) }.map_err(|e| {
            let limit = support
                .memlock_limit
                .map_or("unlimited".into(), |l| format!("{} KiB", l >> 10));
            unavailable(
                io::ErrorKind::OutOfMemory,
                format!(
                    "registering {} KiB of io_uring buffers failed: {e} (they count against \
                     RLIMIT_MEMLOCK, now {limit}, shared by all processes of this user: raise \
                     it with `ulimit -l`, LimitMEMLOCK= in a systemd unit or memlock in \
                     /etc/security/limits.conf, or lower the uring buffer size)",
                    (sbuf.len() + rbuf.len()) >> 10
                ),
            )
        })?;

        let zc_chunk = cfg.zc_chunk.clamp(4 << 10, MAX_OP_LEN);
        let mut zc_inflight = cfg.zc_inflight.max(zc_chunk);
        if let Some(limit) = support.memlock_limit {
            let cap = usize::try_from(limit / 4).unwrap_or(usize::MAX);
            if zc_inflight > cap {
                zc_inflight = cap.max(4 << 10);
            }
        }
        let zc_chunk = zc_chunk.min(zc_inflight);
        let counters = Arc::new(LinkCounters::default());
        let fd = stream.as_raw_fd();
        let link = UringDataLink {
            eng: Engine {
                ring,
                stream,
                fd,
                next_id: 1,
                notifs: Vec::new(),
                counters: Arc::clone(&counters),
                poisoned: false,
                copied_logged: false,
                enter_failures: 0,
                cqes: Vec::with_capacity(64),
                sqes: Vec::with_capacity(MAX_CHAIN),
            },
            direct_min: rbuf.len() / 4,
            sbuf,
            rbuf,
            rpos: 0,
            rend: 0,
            max_payload,
            sealer: Sealer::new(&keys.send),
            opener: Opener::new(&keys.recv),
            counters,
            zc_threshold,
            zc_chunk,
            zc_inflight,
            memlock_limit: support.memlock_limit,
            nomem_warned: false,
        };
        let paths = link.paths();
        if !FIRST_LINK_LOGGED.swap(true, Ordering::Relaxed) {
            tracing::info!(kernel = %support.kernel, "io_uring transport: {paths}");
        }
        tracing::debug!(peer = ?link.eng.stream.peer_addr().ok(), "io_uring link: {paths}");
        Ok(link)
    }

    /// Which paths this link takes, in words (also logged when it is made).
    pub fn paths(&self) -> String {
        let zc = if self.zc_threshold == usize::MAX {
            "SEND_ZC off (unsupported or disabled)".to_string()
        } else {
            format!(
                "payloads ≥ {} KiB by SEND_ZC in {} KiB pieces (≤ {} KiB pinned)",
                self.zc_threshold >> 10,
                self.zc_chunk >> 10,
                self.zc_inflight >> 10
            )
        };
        format!(
            "frames ≤ {} B by WRITE_FIXED from a registered send buffer; larger ones by linked \
             SEND from the caller's memory; {zc}; reads by READ_FIXED into a {} KiB registered \
             buffer, payload remainders ≥ {} KiB by RECV straight into the caller's buffer",
            self.sbuf.len(),
            self.rbuf.len() >> 10,
            self.direct_min >> 10
        )
    }

    /// The underlying stream.
    pub fn stream(&self) -> &TcpStream {
        &self.eng.stream
    }

    /// Whether payloads of `len` bytes would go out by SEND_ZC.
    pub fn zero_copy_for(&self, len: usize) -> bool {
        len >= self.zc_threshold
    }

    /// Writes `sbuf[..total]`, which holds a whole frame, with WRITE_FIXED.
    fn write_small(&mut self, total: usize) -> Result<(), TransportError> {
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
    fn write_large(
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
    fn read_exact(&mut self, dst: &mut [u8]) -> Result<(), TransportError> {
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

impl Drop for UringDataLink {
    fn drop(&mut self) {
        // Nothing is in flight on the registered buffers (every op is reaped before a method
        // returns). Unregistering now returns their RLIMIT_MEMLOCK share at once, instead of
        // whenever the kernel finishes tearing the ring down.
        let _ = self.eng.ring.submitter().unregister_buffers();
    }
}

impl DataLink for UringDataLink {
    fn send(&mut self, header: &FrameHeader, payload: &[u8]) -> Result<(), TransportError> {
        self.eng.check_usable()?;
        let head = header.encode();
        let seal = self.sealer.seal(&[&head, payload]);
        let total = HEADER_LEN + payload.len() + SEAL_LEN;
        if payload.len() < self.zc_threshold && total <= self.sbuf.len() {
            let p_end = HEADER_LEN + payload.len();
            self.sbuf[..HEADER_LEN].copy_from_slice(&head);
            self.sbuf[HEADER_LEN..p_end].copy_from_slice(payload);
            self.sbuf[p_end..total].copy_from_slice(&seal);
            self.write_small(total)?;
        } else {
            self.write_large(&head, payload, &seal)?;
        }
        self.counters.sent(total);
        Ok(())
    }

    fn recv(&mut self, buf: &mut Vec<u8>) -> Result<FrameHeader, TransportError> {
        self.eng.check_usable()?;
        let mut head = [0u8; HEADER_LEN];
        self.read_exact(&mut head)?;
        let h = FrameHeader::decode(&head, self.max_payload)?;
        buf.clear();
        buf.resize(h.len as usize, 0);
        let mut seal = [0u8; SEAL_LEN];
        let read = self
            .read_exact(buf)
            .and_then(|()| self.read_exact(&mut seal));
        finish_stream_frame(read, h, &head, buf, &seal, &mut self.opener, &self.counters)
    }

    fn recv_timeout(
        &mut self,
        buf: &mut Vec<u8>,
        timeout: Duration,
    ) -> Result<Option<FrameHeader>, TransportError> {
        self.eng.check_usable()?;
        if self.rpos == self.rend {
            self.rpos = 0;
            self.rend = 0;
            // Clamped: a timespec's seconds are signed.
            let t = timeout.clamp(
                Duration::from_millis(1),
                Duration::from_secs(u32::MAX.into()),
            );
            let ts = types::Timespec::from(t);
            let ops = [
                Op::ReadFixed {
                    ptr: self.rbuf.as_mut_ptr(),
                    len: self.rbuf.len(),
                },
                Op::LinkTimeout { ts: &ts },
            ];
            // SAFETY: the read points into the registered receive buffer, owned by `self`;
            // `ts` lives on this frame until `run` has reaped both completions.
            let res = unsafe { self.eng.run(&ops) }?;
            match res[0] {
                0 => return Err(TransportError::Closed),
                r if r > 0 => self.rend = r as usize,
                // Cancelled by the timeout, or interrupted: nothing arrived.
                r if r == -libc::ECANCELED || retryable(r) => return Ok(None),
                r => return Err(os_error(r)),
            }
        }
        self.recv(buf).map(Some)
    }

    fn closer(&self) -> Result<LinkCloser, TransportError> {
        Ok(LinkCloser::for_stream(self.eng.stream.try_clone()?))
    }

    fn counters(&self) -> Arc<LinkCounters> {
        Arc::clone(&self.counters)
    }

    fn transport(&self) -> TransportKind {
        TransportKind::Uring
    }
}
