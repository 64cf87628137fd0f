//! `UdpDataLink`: the owner's side of a reliable UDP link (`send`, `recv`, closing), which
//! reads the socket itself whenever it waits inside the link.

use super::reader::{io_thread, Reader};
use super::rx::Rx;
use super::shared::{lock, Shared};
use super::socket::{chunks_per_send, enable_gro, wait_readable};
use super::tx::{OutFrame, Tx};
use super::wire::DATA_HEADER_LEN;
use super::{End, UdpConfig, FRAME_OVERHEAD};
use crate::blocking::{DataLink, LinkCloser};
use crate::error::{ProtocolError, TransportError};
use crate::frame::{FrameHeader, HEADER_LEN};
use crate::seal::{DatagramOpener, DatagramSealer, LinkKeys, SEAL_LEN};
use crate::sock;
use crate::transport::{LinkCounters, TransportKind};
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A reliable, ordered frame link over one connected UDP socket (see the module docs).
pub struct UdpDataLink {
    shared: Arc<Shared>,
    scratch: Vec<u8>,
    ack_buf: Vec<u8>,
    local: SocketAddr,
    peer: SocketAddr,
}

/// Sets `owner_reading` for the life of the value. Clearing it hands the socket back to the
/// I/O thread without waking it: it looks again within `GRACE` (the owner is usually back in
/// `recv` well before), or at once when `send` has to wait for acknowledgements.
struct Reading<'a>(&'a Shared);

impl<'a> Reading<'a> {
    fn start(sh: &'a Shared) -> Reading<'a> {
        sh.read_gen.fetch_add(1, Ordering::SeqCst);
        sh.owner_reading.store(true, Ordering::SeqCst);
        Reading(sh)
    }
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        let sh = self.0;
        sh.owner_reading.store(false, Ordering::SeqCst);
        if sh.aside_long.load(Ordering::SeqCst) {
            // Once the I/O thread holds no lock it is waiting (or will see the flag).
            drop(lock(&sh.aside));
            sh.aside_cv.notify_one();
        }
    }
}

impl UdpDataLink {
    /// `socket`: bound, and connected to the peer's UDP address. `anchor`: the TCP stream the
    /// link was negotiated on; it stays open for the link's life: EOF/error on it means the
    /// peer closed or died, and shutting it down is how either side closes the link.
    /// `keys`: this direction pair's datagram keys (caller derives them).
    pub fn new(
        socket: UdpSocket,
        anchor: TcpStream,
        keys: &LinkKeys,
        max_payload: u32,
        cfg: UdpConfig,
    ) -> Result<UdpDataLink, TransportError> {
        UdpDataLink::build(socket, anchor, keys, max_payload, cfg, None)
    }

    /// A reliable UDP link whose data datagrams go through the kernel module: `dev` is the
    /// context `kmod::Device::for_link` opened for this socket. Acks and probes use `socket`.
    pub fn with_kmod(
        socket: UdpSocket,
        anchor: TcpStream,
        keys: &LinkKeys,
        max_payload: u32,
        cfg: UdpConfig,
        dev: crate::kmod::Device,
    ) -> Result<UdpDataLink, TransportError> {
        dev.set_wake_every(cfg.ack_every.max(1) as u64);
        UdpDataLink::build(socket, anchor, keys, max_payload, cfg, Some(dev))
    }

    fn build(
        socket: UdpSocket,
        anchor: TcpStream,
        keys: &LinkKeys,
        max_payload: u32,
        cfg: UdpConfig,
        kmod: Option<crate::kmod::Device>,
    ) -> Result<UdpDataLink, TransportError> {
        let cfg = cfg.checked()?;
        let peer = socket.peer_addr().map_err(|e| {
            TransportError::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("the UDP link's socket must be connected to the peer: {e}"),
            ))
        })?;
        let local = socket.local_addr()?;
        socket.set_nonblocking(false)?;
        sock::grow_buffers(socket2::SockRef::from(&socket));
        if kmod.is_none() {
            // (Over the module the socket carries acks only; GRO would only coalesce them.)
            enable_gro(&socket);
        }
        anchor.set_nonblocking(true)?;
        let anchor_poll = anchor.try_clone()?;
        // SAFETY: eventfd takes no pointers; a non-negative result is a new descriptor we own.
        let efd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(io::Error::last_os_error().into());
        }
        // SAFETY: `efd` is a fresh descriptor nothing else owns.
        let wake = unsafe { OwnedFd::from_raw_fd(efd) };
        let counters = Arc::new(LinkCounters::default());
        let shared = Arc::new(Shared {
            sock: socket,
            kmod,
            anchor: anchor_poll,
            sealer: DatagramSealer::new(&keys.send),
            counter: AtomicU64::new(1),
            tx: Mutex::new(Tx::new(&cfg)),
            rx: Mutex::new(Rx::new()),
            reader: Mutex::new(Reader::new(DatagramOpener::new(&keys.recv))),
            owner_reading: AtomicBool::new(false),
            aside: Mutex::new(false),
            aside_cv: Condvar::new(),
            aside_long: AtomicBool::new(false),
            read_gen: AtomicU64::new(0),
            wake,
            gso: AtomicBool::new(true),
            last_heard: AtomicU64::new(0),
            epoch: Instant::now(),
            counters,
            max_payload,
            cfg,
        });
        let sh = Arc::clone(&shared);
        std::thread::Builder::new()
            .name(format!("udp-link-{peer}"))
            .spawn(move || io_thread(sh, anchor))?;
        Ok(UdpDataLink {
            shared,
            scratch: Vec::with_capacity(64 << 10),
            ack_buf: Vec::with_capacity(256),
            local,
            peer,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// The kernel module's counters for this link's context (None: not a kmod link).
    pub fn kmod_stats(&self) -> Option<crate::kmod::KmodStats> {
        self.shared.kmod.as_ref().and_then(|d| d.stats().ok())
    }

    /// The congestion window, smoothed round trip and retransmission timeout now (for stats
    /// and tests).
    pub fn window_stats(&self) -> (usize, Option<Duration>, Duration) {
        let tx = lock(&self.shared.tx);
        (tx.cwnd as usize, tx.srtt, tx.rto)
    }

    /// The next frame if it is complete; `Err` when the link ended before it.
    fn take_frame(&mut self, buf: &mut Vec<u8>) -> Result<Take, TransportError> {
        let sh = &*self.shared;
        let mut rx = lock(&sh.rx);
        if let Some(End::LocalClose) = rx.end {
            return Err(TransportError::Closed);
        }
        if rx.poison.as_ref().is_some_and(|(f, _)| *f <= rx.next_take) {
            if let Some((_, e)) = rx.poison.take() {
                rx.end = Some(End::BadFrame(e.to_string()));
                return Err(e.into());
            }
        }
        let next = rx.next_take;
        let Some(header) = rx.take_complete(buf) else {
            if let Some(end) = &rx.end {
                return Err(match end {
                    End::PeerClosed if rx.frames.is_empty() => TransportError::Closed,
                    End::PeerClosed => {
                        let (got, count) =
                            rx.frames.get(&next).map_or((0, 0), |f| (f.got, f.count));
                        TransportError::Protocol(ProtocolError::Inconsistent(format!(
                            "the peer closed the UDP link inside frame {next} ({got} of \
                             {count} chunks arrived)"
                        )))
                    }
                    e => e.send_error(),
                });
            }
            return Ok(if rx.frames.contains_key(&next) {
                Take::Started
            } else {
                Take::Nothing
            });
        };
        let update = rx.update_wanted;
        if update {
            rx.update_wanted = false;
            rx.build_ack(sh.cfg.recv_buffer as u64, &mut self.ack_buf);
        }
        drop(rx);
        if update {
            sh.send_sealed(&[&self.ack_buf[..]], &mut self.scratch)?;
        }
        header.verify(buf)?;
        sh.counters.received(HEADER_LEN + buf.len());
        Ok(Take::Frame(header))
    }

    /// Waits for the next frame, reading the socket on this thread; `deadline`: give up with
    /// `None` if none has started by then.
    fn recv_inner(
        &mut self,
        buf: &mut Vec<u8>,
        deadline: Option<Instant>,
    ) -> Result<Option<FrameHeader>, TransportError> {
        let sh = Arc::clone(&self.shared);
        let mut reading: Option<Reading<'_>> = None;
        loop {
            let started = match self.take_frame(buf)? {
                Take::Frame(h) => return Ok(Some(h)),
                Take::Started => true,
                Take::Nothing => false,
            };
            let now = Instant::now();
            if !started && deadline.is_some_and(|d| now >= d) {
                return Ok(None);
            }
            if reading.is_none() {
                reading = Some(Reading::start(&sh));
                // The I/O thread may have stored the frame just before it stood aside.
                continue;
            }
            owner_wait(&sh, deadline.filter(|_| !started))?;
        }
    }
}

/// One wait of an owner that reads the socket itself: sleeps in `ppoll` until a datagram,
/// the anchor, a wake-up, the nearest timer or `deadline`, then takes one reader step.
fn owner_wait(sh: &Shared, deadline: Option<Instant>) -> Result<(), TransportError> {
    let now = Instant::now();
    let mut wake = sh.next_wakeup(now);
    if let Some(d) = deadline {
        wake = wake.min(d);
    }
    let [_, anchor, woken, _] = wait_readable(
        [
            sh.sock.as_raw_fd(),
            sh.anchor.as_raw_fd(),
            sh.wake.as_raw_fd(),
            sh.kmod_fd(),
        ],
        wake.saturating_duration_since(now),
    )?;
    if woken {
        sh.clear_wake();
    }
    let r = lock(&sh.reader).step(sh, anchor, true);
    if let Err(end) = r {
        sh.finish(end);
    }
    Ok(())
}

/// What `take_frame` found.
enum Take {
    Frame(FrameHeader),
    /// Part of the next frame arrived.
    Started,
    Nothing,
}

impl DataLink for UdpDataLink {
    fn send(&mut self, header: &FrameHeader, payload: &[u8]) -> Result<(), TransportError> {
        if header.len as usize != payload.len() {
            return Err(ProtocolError::Inconsistent(format!(
                "frame header says {} payload bytes, {} given",
                header.len,
                payload.len()
            ))
            .into());
        }
        let total = HEADER_LEN + payload.len();
        let total32 = u32::try_from(total).map_err(|_| ProtocolError::TooLarge {
            what: "frame",
            len: total as u64,
            max: u32::MAX as u64,
        })?;
        let shared = Arc::clone(&self.shared);
        let sh = &*shared;
        let cfg = &sh.cfg;
        let cs = cfg.chunk_payload;
        let seg = DATA_HEADER_LEN + cs + SEAL_LEN;
        let per_send = chunks_per_send(cs);
        let count = total.div_ceil(cs);
        let head = header.encode();
        let cost = total as u64 + FRAME_OVERHEAD;
        // While it waits for acknowledgements, the owner reads them itself.
        let mut reading: Option<Reading<'_>> = None;
        let mut tx = lock(&sh.tx);
        // Wait for the peer's receive window.
        loop {
            if let Some(e) = &tx.end {
                return Err(e.send_error());
            }
            if tx.frame_fits(cost) {
                break;
            }
            tx.window_shut(Instant::now());
            drop(tx);
            match reading {
                None => reading = Some(Reading::start(sh)),
                Some(_) => owner_wait(sh, None)?,
            }
            tx = lock(&sh.tx);
        }
        let out = OutFrame {
            head: &head,
            payload,
            frame: tx.start_frame(cost),
            chunk: cs,
            count,
            total: total32,
        };
        let mut i = 0usize;
        while i < count {
            let room = loop {
                if let Some(e) = &tx.end {
                    return Err(e.send_error());
                }
                let room = tx.room(cfg);
                if room > 0 {
                    break room;
                }
                drop(tx);
                match reading {
                    None => reading = Some(Reading::start(sh)),
                    Some(_) => owner_wait(sh, None)?,
                }
                tx = lock(&sh.tx);
            };
            let n = room.min(count - i).min(per_send);
            let first_cseq = tx.enqueue(&out, i, n, Instant::now());
            drop(tx);
            // Seal the batch into one buffer of equal-size datagrams (the frame's last chunk
            // may be shorter, and is then the batch's last) and send it in one go.
            self.scratch.clear();
            for k in i..i + n {
                let hdr = out.hdr(k, first_cseq + (k - i) as u64);
                let [a, b] = out.bytes(k);
                sh.append_sealed(&[&hdr[..], a, b], &mut self.scratch);
            }
            // An acknowledgement we owe the peer rides along (in a ping-pong it is never sent
            // on its own).
            let ack = if i == 0 {
                let mut rx = lock(&sh.rx);
                if rx.unacked > 0 {
                    rx.build_ack(cfg.recv_buffer as u64, &mut self.ack_buf);
                    true
                } else {
                    false
                }
            } else {
                false
            };
            if ack {
                let at = self.scratch.len();
                let ack_body = std::mem::take(&mut self.ack_buf);
                sh.append_sealed(&[&ack_body[..]], &mut self.scratch);
                self.ack_buf = ack_body;
                let (data, ack) = self.scratch.split_at(at);
                if let Err(e) = sh.send_batch(data, seg, Some(ack)) {
                    sh.finish(End::failed("sending datagrams", &e));
                    return Err(e.into());
                }
            } else if let Err(e) = sh.send_batch(&self.scratch, seg, None) {
                sh.finish(End::failed("sending datagrams", &e));
                return Err(e.into());
            }
            i += n;
            tx = lock(&sh.tx);
        }
        drop(tx);
        drop(reading);
        sh.counters.sent(total);
        Ok(())
    }

    fn recv(&mut self, buf: &mut Vec<u8>) -> Result<FrameHeader, TransportError> {
        match self.recv_inner(buf, None)? {
            Some(h) => Ok(h),
            None => Err(TransportError::Closed),
        }
    }

    fn recv_timeout(
        &mut self,
        buf: &mut Vec<u8>,
        timeout: Duration,
    ) -> Result<Option<FrameHeader>, TransportError> {
        self.recv_inner(buf, Some(Instant::now() + timeout))
    }

    fn closer(&self) -> Result<LinkCloser, TransportError> {
        let sh = Arc::clone(&self.shared);
        Ok(LinkCloser::new(move || {
            sh.finish(End::LocalClose);
            let _ = sh.anchor.shutdown(Shutdown::Both);
        }))
    }

    fn counters(&self) -> Arc<LinkCounters> {
        Arc::clone(&self.shared.counters)
    }

    fn transport(&self) -> TransportKind {
        match self.shared.kmod {
            Some(_) => TransportKind::Kmod,
            None => TransportKind::Udp,
        }
    }
}

impl Drop for UdpDataLink {
    fn drop(&mut self) {
        let sh = &*self.shared;
        let mut tx = lock(&sh.tx);
        if tx.end.is_some() || tx.unacked == 0 {
            drop(tx);
            // Everything arrived (or the link is over): close now.
            sh.finish(End::LocalClose);
            let _ = sh.anchor.shutdown(Shutdown::Both);
        } else {
            // The I/O thread closes once the peer has everything (or after `linger`).
            tx.linger_until = Some(Instant::now() + sh.cfg.linger);
        }
    }
}
