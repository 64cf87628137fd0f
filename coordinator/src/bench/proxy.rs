//! A TCP proxy that adds a fixed one-way latency, for tests: the kernel on our CI machines has
//! no `netem`, so link latency between nodes is simulated in user space.
//!
//! Each accepted connection gets one upstream connection and two independent directions. A
//! direction is a reader thread, which stamps every chunk it reads with `read time + delay` and
//! queues it, and a writer thread, which waits for each stamp and writes the chunk out. Reading
//! never waits for writing, so the proxy behaves like a pipe with latency (many chunks in
//! flight), not like stop-and-wait. Threads and blocking sockets rather than an async runtime:
//! tokio's timer has a 1 ms granularity, while the writer here sleeps to just before the deadline
//! and spins the rest, which keeps the added latency within tens of microseconds.
//!
//! The queue is unbounded: the proxy hides TCP flow control from the sender. It is meant for
//! test traffic, not for bulk transfers against a slow receiver.

use anyhow::{Context, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// How long a connection attempt to the target may take before the client is dropped.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Read buffer per direction; each read becomes one queued chunk.
const CHUNK: usize = 64 * 1024;
/// The writer sleeps until this long before a deadline, then spins (thread wake-up is coarse).
const SPIN_WINDOW: Duration = Duration::from_micros(200);

/// Listens on `listen`, and for every accepted connection opens one to `target` and copies bytes
/// both ways; every chunk read is written out `delay` after it was read (order kept, both
/// directions independently delayed, reading continues while earlier chunks wait — a pipe with
/// latency, not stop-and-wait). TCP_NODELAY on both sockets. Runs until the process is killed.
/// Logs (tracing) each connection.
pub fn run_delay_proxy(listen: &str, target: &str, delay: Duration) -> Result<()> {
    let target = resolve(target)?;
    let listener = TcpListener::bind(listen)
        .with_context(|| format!("delay proxy: cannot listen on {listen}"))?;
    serve_delay_proxy(listener, target, delay)
}

/// The body of [`run_delay_proxy`] on a listener the caller bound (tests bind `127.0.0.1:0`).
/// Returns only if accepting fails.
pub fn serve_delay_proxy(listener: TcpListener, target: SocketAddr, delay: Duration) -> Result<()> {
    let local = listener
        .local_addr()
        .context("delay proxy: listener address")?;
    tracing::info!("delay proxy {local} -> {target}, {delay:?} each way");
    let ids = AtomicU64::new(0);
    loop {
        let (client, peer) = match listener.accept() {
            Ok(c) => c,
            // A client that gave up between SYN and accept; keep serving the others.
            Err(e) if is_transient_accept_error(&e) => {
                tracing::warn!("delay proxy {local}: accept: {e}");
                continue;
            }
            Err(e) => return Err(e).with_context(|| format!("delay proxy: accept on {local}")),
        };
        let id = ids.fetch_add(1, Ordering::Relaxed);
        let spawned = thread::Builder::new()
            .name(format!("proxy-conn{id}"))
            .spawn(move || {
                if let Err(e) = connection(id, client, peer, target, delay) {
                    tracing::warn!("delay proxy conn {id} from {peer}: {e:#}");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("delay proxy conn {id} from {peer}: cannot start a thread: {e}");
        }
    }
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .with_context(|| format!("delay proxy: bad target address {addr}"))?
        .next()
        .with_context(|| format!("delay proxy: target address {addr} resolves to nothing"))
}

fn is_transient_accept_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset | ErrorKind::Interrupted
    )
}

/// Connects upstream and runs both directions to completion.
fn connection(
    id: u64,
    client: TcpStream,
    peer: SocketAddr,
    target: SocketAddr,
    delay: Duration,
) -> Result<()> {
    let upstream = TcpStream::connect_timeout(&target, CONNECT_TIMEOUT)
        .with_context(|| format!("connecting to {target}"))?;
    client
        .set_nodelay(true)
        .context("TCP_NODELAY on the client socket")?;
    upstream
        .set_nodelay(true)
        .context("TCP_NODELAY on the upstream socket")?;
    tracing::info!("delay proxy conn {id}: {peer} -> {target}");
    let up = direction(format!("proxy-conn{id}-up"), &client, &upstream, delay)?;
    let down = direction(format!("proxy-conn{id}-down"), &upstream, &client, delay)?;
    let up_bytes = up.join();
    let down_bytes = down.join();
    tracing::info!(
        "delay proxy conn {id}: {peer} closed ({up_bytes} bytes up, {down_bytes} bytes down)"
    );
    Ok(())
}

/// What a reader hands to its writer.
enum Msg {
    /// Bytes to write at the deadline.
    Data(Instant, Vec<u8>),
    /// The source is finished (at the deadline the destination learns it): `reset` when reading
    /// failed rather than reaching end of stream.
    End(Instant, bool),
}

/// The two threads of one direction.
struct Direction {
    reader: thread::JoinHandle<()>,
    writer: thread::JoinHandle<u64>,
}

impl Direction {
    /// Waits for both threads; returns the bytes written (0 if a thread panicked).
    fn join(self) -> u64 {
        let _ = self.reader.join();
        self.writer.join().unwrap_or(0)
    }
}

fn direction(name: String, src: &TcpStream, dst: &TcpStream, delay: Duration) -> Result<Direction> {
    let (tx, rx) = mpsc::channel();
    let src_r = src.try_clone().context("duplicating a socket")?;
    let src_w = src.try_clone().context("duplicating a socket")?;
    let dst_w = dst.try_clone().context("duplicating a socket")?;
    let reader = thread::Builder::new()
        .name(format!("{name}-r"))
        .spawn(move || read_side(src_r, tx, delay))
        .context("starting a proxy thread")?;
    let writer = thread::Builder::new()
        .name(format!("{name}-w"))
        .spawn(move || write_side(rx, src_w, dst_w))
        .context("starting a proxy thread")?;
    Ok(Direction { reader, writer })
}

fn read_side(mut src: TcpStream, tx: mpsc::Sender<Msg>, delay: Duration) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        let msg = match src.read(&mut buf) {
            Ok(0) => Msg::End(Instant::now() + delay, false),
            Ok(n) => Msg::Data(Instant::now() + delay, buf[..n].to_vec()),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::debug!("delay proxy: read: {e}");
                Msg::End(Instant::now() + delay, true)
            }
        };
        let last = matches!(msg, Msg::End(..));
        // A send error means the writer gave up (destination gone): nothing more to do.
        if tx.send(msg).is_err() || last {
            return;
        }
    }
}

/// Writes each chunk at its deadline; at the end closes the destination's write half (or the
/// whole destination when the source failed). Returns the number of bytes written.
fn write_side(rx: mpsc::Receiver<Msg>, src: TcpStream, mut dst: TcpStream) -> u64 {
    let mut written = 0u64;
    loop {
        match rx.recv() {
            Ok(Msg::Data(deadline, bytes)) => {
                sleep_until(deadline);
                if let Err(e) = dst.write_all(&bytes) {
                    // The destination is gone: tear the whole connection down so the reader of
                    // this direction and both threads of the other one finish too.
                    tracing::debug!("delay proxy: write: {e}");
                    let _ = src.shutdown(Shutdown::Both);
                    let _ = dst.shutdown(Shutdown::Both);
                    return written;
                }
                written += bytes.len() as u64;
            }
            Ok(Msg::End(deadline, reset)) => {
                sleep_until(deadline);
                let how = if reset {
                    Shutdown::Both
                } else {
                    Shutdown::Write
                };
                let _ = dst.shutdown(how);
                return written;
            }
            // The reader panicked; treat it as a failed source.
            Err(mpsc::RecvError) => {
                let _ = dst.shutdown(Shutdown::Both);
                return written;
            }
        }
    }
}

/// Sleeps until `deadline`: a thread sleep to just before it, then a spin for precision.
fn sleep_until(deadline: Instant) {
    loop {
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        let left = deadline - now;
        if left > SPIN_WINDOW {
            thread::sleep(left - SPIN_WINDOW);
        } else {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on 127.0.0.1:0; returns its address.
    fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                thread::spawn(move || {
                    conn.set_nodelay(true).unwrap();
                    let mut buf = [0u8; 4096];
                    loop {
                        match conn.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                if conn.write_all(&buf[..n]).is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
        addr
    }

    /// A proxy to `target` on 127.0.0.1:0; returns its address.
    fn proxy(target: SocketAddr, delay: Duration) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        thread::spawn(move || serve_delay_proxy(listener, target, delay));
        addr
    }

    #[test]
    fn ping_pong_is_correct_and_delayed_both_ways() {
        let delay = Duration::from_millis(5);
        let addr = proxy(echo_server(), delay);
        let mut conn = TcpStream::connect(addr).unwrap();
        conn.set_nodelay(true).unwrap();
        let mut min_rtt = Duration::MAX;
        for i in 0..100u32 {
            // Lengths vary so a misordered or merged chunk cannot go unnoticed.
            let msg: Vec<u8> =
                format!("ping {i} {}", "x".repeat((i as usize * 37) % 200)).into_bytes();
            let t0 = Instant::now();
            conn.write_all(&msg).unwrap();
            let mut back = vec![0u8; msg.len()];
            conn.read_exact(&mut back).unwrap();
            let rtt = t0.elapsed();
            assert_eq!(back, msg, "echo {i} differs");
            min_rtt = min_rtt.min(rtt);
            assert!(
                rtt >= 2 * delay,
                "round trip {i} took {rtt:?}, less than 2 x {delay:?}"
            );
        }
        eprintln!("min round trip through a {delay:?} proxy: {min_rtt:?}");
    }

    #[test]
    fn pipelined_chunks_keep_order_and_half_close_propagates() {
        let addr = proxy(echo_server(), Duration::from_millis(2));
        let mut conn = TcpStream::connect(addr).unwrap();
        conn.set_nodelay(true).unwrap();
        // Written back to back without waiting, so many chunks are in flight in the proxy.
        let sent: Vec<u8> = (0..200u32)
            .flat_map(|i| format!("<{i}>").into_bytes())
            .collect();
        for piece in sent.chunks(7) {
            conn.write_all(piece).unwrap();
        }
        conn.shutdown(Shutdown::Write).unwrap();
        let mut back = Vec::new();
        // read_to_end returns once the echo server's close has come back through the proxy.
        conn.read_to_end(&mut back).unwrap();
        assert_eq!(back, sent);
    }

    #[test]
    fn bad_addresses_are_named() {
        let e = run_delay_proxy("127.0.0.1:0", "no-such-address", Duration::ZERO).unwrap_err();
        assert!(format!("{e:#}").contains("no-such-address"), "{e:#}");
        let e = run_delay_proxy("999.1.1.1:1", "127.0.0.1:1", Duration::ZERO).unwrap_err();
        assert!(format!("{e:#}").contains("999.1.1.1:1"), "{e:#}");
    }
}
