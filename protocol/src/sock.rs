//! Socket setup shared by every transport: the buffer sizes asked of the kernel, TCP tuning
//! (no delay, keepalive, user timeout), listening sockets, and UDP sockets for reliable UDP
//! links and QUIC endpoints.

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};

/// Send and receive buffer size asked of the kernel for every ringllm socket (best effort: it
/// may grant less, see `net.core.rmem_max` and `net.core.wmem_max`). 4 MiB holds a few
/// milliseconds of a 10 Gbit/s link, so a burst of datagrams or a large frame does not
/// overflow the receiver while its thread is busy.
pub const SOCKET_BUFFER: usize = 4 << 20;

/// Low latency, big buffers, and a dead peer noticed within seconds (every ringllm TCP link).
pub fn tune_tcp(stream: &TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let s = socket2::SockRef::from(stream);
    // Best effort: a kernel limit (net.core.wmem_max) may cap these.
    let _ = s.set_send_buffer_size(SOCKET_BUFFER);
    let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
    // A dead peer or a pulled cable ends the connection within seconds, not the kernel's
    // default two hours: probe after 1 s idle, every 1 s, give up after 3 misses; unacked
    // data gives up after 5 s.
    let ka = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(1))
        .with_interval(Duration::from_secs(1))
        .with_retries(3);
    s.set_tcp_keepalive(&ka)?;
    #[cfg(target_os = "linux")]
    s.set_tcp_user_timeout(Some(Duration::from_secs(5)))?;
    Ok(())
}

/// Binds a listening TCP socket (SO_REUSEADDR, so a restarted node gets its port back at
/// once). Needs a tokio runtime.
pub fn listen_tcp(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let domain = socket2::Domain::for_address(addr);
    let s = socket2::Socket::new(domain, socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    s.set_reuse_address(true)?;
    let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
    s.bind(&addr.into())?;
    s.listen(128)?;
    s.set_nonblocking(true)?;
    TcpListener::from_std(s.into())
}

/// A bound UDP socket with `SOCKET_BUFFER` buffers. `reuse`: SO_REUSEADDR, so a per-link
/// socket can be bound to the node's listening port and `connect()`ed to one peer, next to
/// other sockets on that port. `nonblocking`: for a tokio-driven endpoint (QUIC).
pub fn udp_socket(addr: SocketAddr, reuse: bool, nonblocking: bool) -> std::io::Result<UdpSocket> {
    let s = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )?;
    if reuse {
        s.set_reuse_address(true)?;
    }
    // Best effort: a kernel limit may cap these.
    let _ = s.set_send_buffer_size(SOCKET_BUFFER);
    let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
    s.bind(&addr.into())?;
    if nonblocking {
        s.set_nonblocking(true)?;
    }
    Ok(s.into())
}

/// The blocking UDP socket of a reliable UDP link, bound to `local` with SO_REUSEADDR.
pub fn bind_udp_reuse(local: SocketAddr) -> std::io::Result<UdpSocket> {
    udp_socket(local, true, false)
}

/// Raises a socket's buffers to `SOCKET_BUFFER` where they are smaller (a socket made
/// elsewhere); best effort.
pub fn grow_buffers(s: socket2::SockRef<'_>) {
    if s.recv_buffer_size().is_ok_and(|n| n < SOCKET_BUFFER) {
        let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
    }
    if s.send_buffer_size().is_ok_and(|n| n < SOCKET_BUFFER) {
        let _ = s.set_send_buffer_size(SOCKET_BUFFER);
    }
}
