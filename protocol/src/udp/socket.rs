//! The Linux socket calls of reliable UDP: segmentation offload on send (UDP_SEGMENT in one
//! `sendmmsg`), coalesced receives (UDP_GRO), `ppoll` waits, and which send errors only lose
//! a datagram.

use super::wire::{DATA_HEADER_LEN, MAX_DATAGRAM};
use crate::seal::SEAL_LEN;
use std::io;
use std::net::UdpSocket;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

/// A send error that only loses the datagram (retransmission covers it): the peer's port is
/// closed for now (ICMP), or a buffer is full.
fn lost_datagram(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused | io::ErrorKind::WouldBlock
    ) || e.raw_os_error() == Some(libc::ENOBUFS)
}

/// Linux's UDP socket options for segmentation offload (not in `libc` for glibc targets).
const UDP_SEGMENT: libc::c_int = 103;
const UDP_GRO: libc::c_int = 104;
/// Most segments one UDP_SEGMENT send may carry (the kernel's UDP_MAX_SEGMENTS, older value).
const GSO_MAX_SEGMENTS: usize = 64;

pub(super) fn send_retrying(sock: &UdpSocket, d: &[u8]) -> io::Result<()> {
    loop {
        match sock.send(d) {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if lost_datagram(&e) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

/// What a segmentation-offload send did.
pub(super) enum Gso {
    /// Sent (or lost like any datagram): this many of the messages.
    Sent(usize),
    /// The kernel or device refused segmentation offload.
    Refused,
}

/// Sends `data` as datagrams of `seg` bytes (the last may be shorter) with UDP_SEGMENT, and
/// `extra` (if any) as one more datagram, in one `sendmmsg`.
pub(super) fn send_segmented(
    sock: &UdpSocket,
    data: &[u8],
    seg: usize,
    extra: Option<&[u8]>,
) -> io::Result<Gso> {
    let mut iov = [data, extra.unwrap_or(&[])].map(|b| libc::iovec {
        iov_base: b.as_ptr() as *mut libc::c_void,
        iov_len: b.len(),
    });
    let mut control = [0u64; 4];
    let count: usize = if extra.is_some() { 2 } else { 1 };
    // SAFETY: the messages point at `iov` and `control`, which outlive the call; the control
    // buffer (32 bytes, 8-aligned) has room for one cmsghdr with a u16 (CMSG_SPACE(2) = 24),
    // and CMSG_FIRSTHDR of a msghdr with that buffer is its start.
    let n = unsafe {
        let mut msgs: [libc::mmsghdr; 2] = std::mem::zeroed();
        for (m, v) in msgs.iter_mut().zip(iov.iter_mut()) {
            m.msg_hdr.msg_iov = v;
            m.msg_hdr.msg_iovlen = 1;
        }
        if data.len() > seg {
            let msg = &mut msgs[0].msg_hdr;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(2) as _;
            let c = libc::CMSG_FIRSTHDR(msg);
            (*c).cmsg_level = libc::SOL_UDP;
            (*c).cmsg_type = UDP_SEGMENT;
            (*c).cmsg_len = libc::CMSG_LEN(2) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), seg as u16);
        }
        loop {
            let n = libc::sendmmsg(sock.as_raw_fd(), msgs.as_mut_ptr(), count as _, 0);
            if n >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                break n;
            }
        }
    };
    if n >= 0 {
        return Ok(Gso::Sent(n as usize));
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EIO | libc::EINVAL | libc::EOPNOTSUPP | libc::ENOPROTOOPT) => Ok(Gso::Refused),
        _ if lost_datagram(&e) => Ok(Gso::Sent(1)),
        _ => Err(e),
    }
}

/// Waits until one of `fds` is readable, or `timeout`; which ones are.
pub(super) fn wait_readable<const N: usize>(
    fds: [RawFd; N],
    timeout: Duration,
) -> io::Result<[bool; N]> {
    let mut p = fds.map(|fd| libc::pollfd {
        fd,
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    });
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(3600) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `p` is a valid array of N pollfd for the duration of the call, `ts` a valid
    // timespec, and a null signal mask means "leave it".
    let r = unsafe { libc::ppoll(p.as_mut_ptr(), N as libc::nfds_t, &ts, std::ptr::null()) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok([false; N]);
        }
        return Err(e);
    }
    Ok(p.map(|q| q.revents != 0))
}

/// One datagram (or, with UDP_GRO, several of one size coalesced) if any is queued; never
/// blocks. Returns the bytes and the segment size when coalesced.
pub(super) fn recv_now(
    udp: &UdpSocket,
    buf: &mut [u8],
) -> io::Result<(usize, Option<usize>, bool)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = [0u64; 8];
    // SAFETY: `msg` points at `iov` (our buffer) and `control`, which outlive the call; the
    // cmsg walk stays inside what the kernel wrote (CMSG_FIRSTHDR/NXTHDR check the length).
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control) as _;
        let n = libc::recvmsg(udp.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut seg = None;
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == UDP_GRO {
                let len = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let d = libc::CMSG_DATA(c);
                seg = Some(if len >= 4 {
                    std::ptr::read_unaligned(d.cast::<i32>()).max(0) as usize
                } else {
                    std::ptr::read_unaligned(d.cast::<u16>()) as usize
                });
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
        let truncated = msg.msg_flags & libc::MSG_TRUNC != 0;
        Ok((n as usize, seg, truncated))
    }
}

// ---------------------------------------------------------------------------------------
// The link

/// Asks for coalesced runs of datagrams (one read for many); harmless where missing.
pub(super) fn enable_gro(socket: &UdpSocket) {
    let on: libc::c_int = 1;
    // SAFETY: passes a live c_int of the size given.
    let _ = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_UDP,
            UDP_GRO,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
}

/// Chunks of `chunk` frame bytes that one segmentation-offload send carries: as many sealed
/// datagrams as fit one UDP payload, at most `GSO_MAX_SEGMENTS`.
pub(super) fn chunks_per_send(chunk: usize) -> usize {
    (MAX_DATAGRAM / (DATA_HEADER_LEN + chunk + SEAL_LEN)).clamp(1, GSO_MAX_SEGMENTS)
}
