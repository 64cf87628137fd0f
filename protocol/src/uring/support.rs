//! What this kernel's io_uring offers, the link's tuning, and why set-up failed.

use super::SEND_ZC_REPORT_USAGE;
use crate::error::TransportError;
use io_uring::{cqueue, opcode, types, IoUring, Probe};
use std::io;
use std::os::fd::AsRawFd;
use std::sync::OnceLock;

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

pub(super) fn unavailable(kind: io::ErrorKind, msg: String) -> TransportError {
    TransportError::Io(io::Error::new(
        kind,
        format!("io_uring transport unavailable: {msg}; use --transport tcp"),
    ))
}

/// Why `io_uring_setup` failed, in words an operator can act on.
pub(super) fn setup_refused(e: &io::Error, kernel: &str) -> TransportError {
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
pub(super) fn support() -> Result<UringSupport, TransportError> {
    static SUPPORT: OnceLock<UringSupport> = OnceLock::new();
    if let Some(s) = SUPPORT.get() {
        return Ok(s.clone());
    }
    let s = probe()?;
    Ok(SUPPORT.get_or_init(|| s).clone())
}
