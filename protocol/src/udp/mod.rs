//! Reliable UDP data links: frames cut into sealed datagrams, selective acknowledgements,
//! retransmission timers, a congestion window and a receive window, on one connected UDP
//! socket per link. The TCP connection the link was negotiated on (the *anchor*) stays open
//! beside it: end of stream or an error on it is how a closed or crashed peer is noticed, and
//! shutting it down is how either side closes the link.
//!
//! # Threads
//!
//! The owner thread calls `send` and `recv`; a per-link I/O thread does what must go on while
//! the owner is elsewhere (computing, or blocked in another link's `recv`).
//!
//! * `send` cuts the frame into chunks, seals them and sends them itself, up to 44 per system
//!   call (UDP segmentation offload, falling back to one `send` each where the kernel or device
//!   refuses), with any acknowledgement this side owes riding along in the same `sendmmsg`. It
//!   keeps a copy of each chunk until it is acknowledged and waits only while the congestion
//!   window or the peer's receive window is full.
//! * Reading the socket (checking each datagram's seal before anything else, reassembling,
//!   acknowledging, retransmitting on timeouts, probing a closed receive window, watching the
//!   anchor) is a `Reader` step under a mutex that either thread may take. Whenever the owner
//!   waits inside the link (in `recv`, or in `send` for acknowledgements) it is the reader: it
//!   sleeps in `ppoll` on the socket, the anchor and an eventfd with a timeout set by the
//!   nearest timer, so a frame or an ack costs one wake-up, as on a plain socket, and `recv`
//!   swaps the reassembled payload into the caller's buffer without a copy.
//! * Otherwise the I/O thread is the reader, in the same kind of `ppoll` loop. While the owner
//!   reads, it stands aside on a condition variable, looking again after 1 ms (an owner that
//!   alternates `send` and `recv` is back long before, and never has to wake this thread),
//!   with naps doubling up to 50 ms during one long wait, after which the owner wakes it on
//!   leaving. A frame the I/O thread completes just as the owner starts reading is signalled
//!   through the eventfd.
//!
//! Receive buffers use UDP GRO where the kernel has it (a run of datagrams in one read). No
//! thread ever spins: every wait is a `ppoll`, a condition variable or a blocking send.
//!
//! # Datagrams
//!
//! Every datagram ends with a 24-byte seal (`DatagramSealer::seal`: the packet counter, u64
//! LE, and a 16-byte AES-GMAC tag over everything before the seal with the counter as nonce),
//! from a counter shared by both threads of the sending side, never reused. The receiver
//! checks the seal with `DatagramOpener::open` before reading any other byte: a forged datagram is dropped and
//! counted in `mac_failures`, a replayed or stale one in `replays`; neither ever ends the link.
//!
//! ```text
//! data (32-byte header, then ≤ chunk_payload bytes of the frame, then the seal)
//!  0  1  kind = 1
//!  1  1  version = 1
//!  2  2  chunk size: frame bytes in every chunk of this frame but the last (u16 LE)
//!  4  4  chunk index
//!  8  4  chunk count = ceil(frame bytes / chunk size)
//! 12  4  frame bytes: the 40-byte frame header plus the payload
//! 16  8  frame sequence number (1, 2, …)
//! 24  8  chunk sequence number (1, 2, … across frames; what acknowledgements refer to)
//!
//! ack (32-byte header, then the bitmap, then the seal)
//!  0  1  kind = 2
//!  1  1  version = 1
//!  2  2  bitmap bytes n (≤ 1024)
//!  4  4  zero
//!  8  8  cumulative: every chunk sequence number below this one arrived
//! 16  8  the frame sequence number the receiving application takes next
//! 24  8  receive buffer: bytes of frames (plus 256 per frame) the receiver holds beyond that
//! 32  n  bit j (LSB first) set: chunk cumulative + 1 + j arrived
//!
//! probe (8 bytes, then the seal): kind = 3, version = 1, six zero bytes. Answered by an ack.
//! ```
//!
//! # Windows and timers
//!
//! The sender keeps at most `cwnd` chunks unacknowledged (and at most twice `max_window`
//! between the oldest unacknowledged chunk and the newest), which bounds both its memory and
//! the burst a 64 MiB frame puts into the receiver's socket buffer. `cwnd` starts at
//! `initial_window`, grows by one per acknowledged chunk up to `ssthresh` and by one per
//! window after, and is halved (not below `min_window`) once per window in which a loss is
//! found. A chunk is retransmitted when an ack shows three later chunks arrived while it did
//! not (and it was not sent in the last two round trips), or when the retransmission timer
//! expires: it runs while chunks are unacknowledged and restarts on every ack of new chunks;
//! its timeout is `srtt + 4·rttvar` (Karn's rule: no samples from retransmitted chunks),
//! clamped to `min_rto..max_rto` and doubled per expiry without progress; on expiry every
//! unacknowledged chunk older than the timeout (at most a window's worth) is sent again.
//!
//! The receiver acknowledges after every `ack_every` new chunks, at once on a duplicate, a gap
//! or a probe, and otherwise within `ack_delay`. It holds at most `recv_buffer` bytes of frames
//! beyond the next one the application takes (which is always admitted, so any frame up to the
//! payload cap gets through), and advertises that in each ack; the sender does not start a
//! frame that would not fit, probes while it waits, and the receiver answers a probe, and sends
//! a window update from `recv` once a frame is taken after a probe. So a receiver that stops
//! calling `recv` stops the sender with bounded memory on both sides.
//!
//! # Closing
//!
//! `closer()` ends the link at once: both threads' waits return, the anchor is shut down.
//! Dropping the link closes it gracefully: the I/O thread keeps retransmitting until every
//! chunk is acknowledged (at most `linger`), then shuts the anchor down; the peer's `recv`
//! returns every frame, then `TransportError::Closed`. End of stream on the anchor while a
//! frame is incomplete, or a reset, is an error. A sender that hears nothing from its peer
//! for `peer_timeout` while it waits for acknowledgements fails with a timeout.
//!
//! # Counters
//!
//! `frames_out`/`bytes_out` count frames when `send` has handed all their chunks to the socket,
//! `frames_in`/`bytes_in` frames returned by `recv`; bytes are the frame's (the 40-byte header
//! plus the payload), without datagram headers, seals, acknowledgements or retransmissions.
//! `retransmits` counts chunks sent again, `duplicates` authentic chunks that had already
//! arrived, `mac_failures` and `replays` refused seals, `malformed` authentic datagrams that
//! made no sense (and were dropped).

use crate::blocking::{DataLink, LinkCloser};
use crate::error::{ProtocolError, TransportError};
use crate::frame::{FrameHeader, HEADER_LEN, MAX_CONTROL_LEN};
use crate::seal::{DatagramOpener, DatagramSealer, LinkKeys, SealError, SEAL_LEN};
use crate::transport::LinkCounters;
use std::collections::{BTreeMap, VecDeque};
use std::io::{self, Read};
use std::net::{Shutdown, SocketAddr, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Bytes of a data datagram's header.
pub const DATA_HEADER_LEN: usize = 32;
/// Bytes of an ack's header (the bitmap follows).
pub const ACK_HEADER_LEN: usize = 32;
/// Bytes of a probe (before its seal).
pub const PROBE_LEN: usize = 8;
/// Largest UDP payload over IPv4.
pub const MAX_DATAGRAM: usize = 65507;
/// Smallest chunk a link sends or accepts (the frame header always fits in chunk 0).
pub const MIN_CHUNK: usize = 64;
/// Largest chunk: a data datagram must fit in `MAX_DATAGRAM`.
pub const MAX_CHUNK: usize = MAX_DATAGRAM - DATA_HEADER_LEN - SEAL_LEN;
/// Chunks an ack's bitmap covers past the cumulative point.
pub const MAX_ACK_BITS: u64 = 8192;
/// The socket buffers `bind_reuse` asks for.
pub const SOCKET_BUFFER: usize = 4 << 20;

const KIND_DATA: u8 = 1;
const KIND_ACK: u8 = 2;
const KIND_PROBE: u8 = 3;
const WIRE_VERSION: u8 = 1;
/// Chunk sequence numbers the receiver tracks past its cumulative point (a ring of bits).
const TRACK_BITS: u64 = 4 * MAX_ACK_BITS;
/// What a buffered frame costs in the receive window beyond its bytes.
const FRAME_OVERHEAD: u64 = 256;
/// The receive buffer a sender assumes before the peer's first ack (and the least a receiver
/// may advertise).
const MIN_RECV_BUFFER: u64 = 1 << 20;
/// Chunks whose later neighbours arrived before a chunk counts as lost.
const DUP_THRESH: u64 = 3;
/// Longest the I/O thread sleeps without looking at its timers.
const IDLE_TICK: Duration = Duration::from_millis(10);
/// Datagrams the I/O thread reads before it looks at its timers again.
const DRAIN_MAX: usize = 128;
/// Receive buffers kept for reuse.
const POOL_MAX: usize = 4;
/// Longest the I/O thread stays aside after the owner stopped reading (while the owner
/// came back to `recv` quickly).
const GRACE: Duration = Duration::from_millis(1);
/// Longest nap of the I/O thread while the owner reads.
const MAX_ASIDE: Duration = Duration::from_millis(50);
const FIRST_PROBE: Duration = Duration::from_millis(1);
const MAX_PROBE: Duration = Duration::from_millis(200);

/// Tuning of a reliable UDP link. Both ends may differ; every field has a sane default.
#[derive(Clone, Debug)]
pub struct UdpConfig {
    /// Frame bytes per datagram (`MIN_CHUNK..=MAX_CHUNK`); 1400 keeps datagrams under a
    /// 1500-byte Ethernet MTU.
    pub chunk_payload: usize,
    /// Most chunks unacknowledged at once (the congestion window's ceiling), 1..=4096.
    pub max_window: usize,
    /// The congestion window at the start.
    pub initial_window: usize,
    /// The congestion window never shrinks below this.
    pub min_window: usize,
    /// Bytes of frames the receiver buffers beyond the next one `recv` returns (at least
    /// 1 MiB); a sender whose frames would not fit waits.
    pub recv_buffer: usize,
    /// Retransmission timeout before the first round-trip measurement.
    pub initial_rto: Duration,
    pub min_rto: Duration,
    pub max_rto: Duration,
    /// Longest an acknowledgement is held back to cover more chunks.
    pub ack_delay: Duration,
    /// Acknowledge at once after this many new chunks.
    pub ack_every: usize,
    /// Give up when the peer has sent nothing authentic for this long while we wait for it.
    pub peer_timeout: Duration,
    /// After the link is dropped, keep retransmitting unacknowledged chunks this long.
    pub linger: Duration,
}

impl Default for UdpConfig {
    fn default() -> Self {
        UdpConfig {
            chunk_payload: 1400,
            max_window: 256,
            initial_window: 128,
            min_window: 16,
            recv_buffer: 16 << 20,
            initial_rto: Duration::from_millis(20),
            min_rto: Duration::from_millis(4),
            max_rto: Duration::from_millis(200),
            ack_delay: Duration::from_micros(200),
            ack_every: 16,
            peer_timeout: Duration::from_secs(5),
            linger: Duration::from_secs(2),
        }
    }
}

impl UdpConfig {
    fn checked(mut self) -> Result<UdpConfig, TransportError> {
        let bad = |what: String| {
            Err(TransportError::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("invalid UDP link configuration: {what}"),
            )))
        };
        if !(MIN_CHUNK..=MAX_CHUNK).contains(&self.chunk_payload) {
            return bad(format!(
                "chunk_payload {} is outside {MIN_CHUNK}..={MAX_CHUNK}",
                self.chunk_payload
            ));
        }
        if !(1..=(MAX_ACK_BITS / 2) as usize).contains(&self.max_window) {
            return bad(format!(
                "max_window {} is outside 1..={}",
                self.max_window,
                MAX_ACK_BITS / 2
            ));
        }
        if self.min_rto.is_zero() || self.min_rto > self.max_rto {
            return bad(format!(
                "min_rto {:?} must be above zero and at most max_rto {:?}",
                self.min_rto, self.max_rto
            ));
        }
        if self.peer_timeout.is_zero() {
            return bad("peer_timeout is zero".into());
        }
        self.min_window = self.min_window.clamp(1, self.max_window);
        self.initial_window = self.initial_window.clamp(self.min_window, self.max_window);
        self.recv_buffer = self.recv_buffer.max(MIN_RECV_BUFFER as usize);
        self.ack_every = self.ack_every.max(1);
        self.initial_rto = self.initial_rto.clamp(self.min_rto, self.max_rto);
        Ok(self)
    }
}

/// A UDP socket with SO_REUSEADDR (so a per-link socket can be bound to the node's listening
/// port and `connect()`ed to one peer, next to other sockets on that port) and 4 MiB socket
/// buffers (the kernel may grant less: see `net.core.rmem_max`).
pub fn bind_reuse(local: SocketAddr) -> io::Result<UdpSocket> {
    let s = socket2::Socket::new(
        socket2::Domain::for_address(local),
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )?;
    s.set_reuse_address(true)?;
    let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
    let _ = s.set_send_buffer_size(SOCKET_BUFFER);
    s.bind(&local.into())?;
    Ok(s.into())
}

// ---------------------------------------------------------------------------------------
// Wire format

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DataHdr {
    chunk_size: u32,
    index: u32,
    count: u32,
    total: u32,
    frame: u64,
    cseq: u64,
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(x)
}

impl DataHdr {
    fn encode(&self) -> [u8; DATA_HEADER_LEN] {
        let mut b = [0u8; DATA_HEADER_LEN];
        b[0] = KIND_DATA;
        b[1] = WIRE_VERSION;
        b[2..4].copy_from_slice(&(self.chunk_size as u16).to_le_bytes());
        b[4..8].copy_from_slice(&self.index.to_le_bytes());
        b[8..12].copy_from_slice(&self.count.to_le_bytes());
        b[12..16].copy_from_slice(&self.total.to_le_bytes());
        b[16..24].copy_from_slice(&self.frame.to_le_bytes());
        b[24..32].copy_from_slice(&self.cseq.to_le_bytes());
        b
    }

    /// `b` is at least `DATA_HEADER_LEN` long (checked by the caller).
    fn decode(b: &[u8]) -> DataHdr {
        DataHdr {
            chunk_size: u16_at(b, 2) as u32,
            index: u32_at(b, 4),
            count: u32_at(b, 8),
            total: u32_at(b, 12),
            frame: u64_at(b, 16),
            cseq: u64_at(b, 24),
        }
    }

    /// Frame bytes this chunk carries, if its numbers agree with each other.
    fn check(&self) -> Result<usize, String> {
        let cs = self.chunk_size as u64;
        if !(MIN_CHUNK as u64..=MAX_CHUNK as u64).contains(&cs) {
            return Err(format!("chunk size {cs} outside {MIN_CHUNK}..={MAX_CHUNK}"));
        }
        let total = self.total as u64;
        if total < HEADER_LEN as u64 {
            return Err(format!("frame of {total} bytes is shorter than its header"));
        }
        if self.count as u64 != total.div_ceil(cs) {
            return Err(format!(
                "{} chunks for a frame of {total} bytes in chunks of {cs}",
                self.count
            ));
        }
        if self.index >= self.count {
            return Err(format!("chunk {} of {}", self.index, self.count));
        }
        if self.frame == 0 || self.cseq <= self.index as u64 {
            return Err(format!(
                "frame {} chunk sequence {} for chunk {}",
                self.frame, self.cseq, self.index
            ));
        }
        let start = self.index as u64 * cs;
        Ok((total - start).min(cs) as usize)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct AckHdr {
    cum: u64,
    next_take: u64,
    cap: u64,
}

fn ack_header(a: &AckHdr, bitmap_bytes: usize) -> [u8; ACK_HEADER_LEN] {
    let mut b = [0u8; ACK_HEADER_LEN];
    b[0] = KIND_ACK;
    b[1] = WIRE_VERSION;
    b[2..4].copy_from_slice(&(bitmap_bytes as u16).to_le_bytes());
    b[8..16].copy_from_slice(&a.cum.to_le_bytes());
    b[16..24].copy_from_slice(&a.next_take.to_le_bytes());
    b[24..32].copy_from_slice(&a.cap.to_le_bytes());
    b
}

/// An ack's header and bitmap, if its length agrees with itself.
fn parse_ack(b: &[u8]) -> Result<(AckHdr, &[u8]), String> {
    if b.len() < ACK_HEADER_LEN {
        return Err(format!("ack of {} bytes", b.len()));
    }
    let n = u16_at(b, 2) as usize;
    if b.len() != ACK_HEADER_LEN + n || n as u64 > MAX_ACK_BITS / 8 {
        return Err(format!("ack of {} bytes says its bitmap has {n}", b.len()));
    }
    Ok((
        AckHdr {
            cum: u64_at(b, 8),
            next_take: u64_at(b, 16),
            cap: u64_at(b, 24),
        },
        &b[ACK_HEADER_LEN..],
    ))
}

fn probe_bytes() -> [u8; PROBE_LEN] {
    let mut b = [0u8; PROBE_LEN];
    b[0] = KIND_PROBE;
    b[1] = WIRE_VERSION;
    b
}

/// The frame bytes `start..end` (the frame being `head` then `payload`) as two slices.
fn frame_range<'a>(
    head: &'a [u8; HEADER_LEN],
    payload: &'a [u8],
    start: usize,
    end: usize,
) -> [&'a [u8]; 2] {
    let (h0, h1) = (start.min(HEADER_LEN), end.min(HEADER_LEN));
    let (p0, p1) = (
        start.max(HEADER_LEN) - HEADER_LEN,
        end.max(HEADER_LEN) - HEADER_LEN,
    );
    [&head[h0..h1], &payload[p0..p1]]
}

// ---------------------------------------------------------------------------------------
// Shared state

/// Why a link stopped.
#[derive(Clone, Debug)]
enum End {
    /// `closer()` (or a fatal error on our side after it was reported).
    LocalClose,
    /// End of stream on the anchor.
    PeerClosed,
    /// The anchor failed (reset: the peer process died).
    PeerReset(String),
    /// No authentic datagram from the peer for `peer_timeout` while waiting for it.
    TimedOut(Duration),
    /// A socket error.
    Failed(String),
}

impl End {
    fn send_error(&self) -> TransportError {
        let io = |k, m: String| TransportError::Io(io::Error::new(k, m));
        match self {
            End::LocalClose => io(
                io::ErrorKind::NotConnected,
                "the UDP link was closed".into(),
            ),
            End::PeerClosed => io(
                io::ErrorKind::BrokenPipe,
                "the peer closed the UDP link".into(),
            ),
            End::PeerReset(m) => io(
                io::ErrorKind::ConnectionReset,
                format!("the UDP link's peer is gone: its anchor connection failed: {m}"),
            ),
            End::TimedOut(d) => TransportError::Timeout(
                *d,
                "without hearing from the UDP link's peer (wrong keys, a firewall dropping \
                 datagrams, or the peer is gone)",
            ),
            End::Failed(m) => io(io::ErrorKind::Other, format!("UDP link failed: {m}")),
        }
    }
}

struct TxChunk {
    hdr: [u8; DATA_HEADER_LEN],
    data: Vec<u8>,
    sent_at: Instant,
    sends: u32,
    acked: bool,
}

/// Chunks to send again, copied out of the lock.
#[derive(Default)]
struct Resends {
    hdrs: Vec<[u8; DATA_HEADER_LEN]>,
    data: Vec<u8>,
    ends: Vec<usize>,
}

impl Resends {
    fn push(&mut self, c: &TxChunk) {
        self.hdrs.push(c.hdr);
        self.data.extend_from_slice(&c.data);
        self.ends.push(self.data.len());
    }
    fn clear(&mut self) {
        self.hdrs.clear();
        self.data.clear();
        self.ends.clear();
    }
}

/// The sending direction.
struct Tx {
    next_frame: u64,
    next_cseq: u64,
    /// Chunk sequence number of `flight[0]` (`next_cseq` when empty).
    base: u64,
    flight: VecDeque<TxChunk>,
    /// Entries of `flight` not yet acknowledged.
    unacked: usize,
    cwnd: f64,
    ssthresh: f64,
    /// Losses of chunks below this were already answered by a window cut.
    recover: u64,
    srtt: Option<Duration>,
    rttvar: Duration,
    rto: Duration,
    /// The retransmission timer runs from here while chunks are unacknowledged: set when
    /// the first goes out, restarted by every ack of new chunks and by every expiry.
    timer_start: Option<Instant>,
    /// Expiries since the last progress (each doubles the timeout).
    timeouts: u32,
    peer_next_take: u64,
    peer_cap: u64,
    /// Frames sent that the peer's application has not taken: (frame, cost).
    window_frames: VecDeque<(u64, u64)>,
    window_cost: u64,
    /// Since when we have been waiting for the peer (unacknowledged chunks or a closed
    /// receive window), for `peer_timeout`.
    waiting_since: Option<Instant>,
    /// The owner waits for the peer's receive window: probe at this time.
    probe_at: Option<Instant>,
    probe_interval: Duration,
    /// The owner dropped the link: linger until everything is acknowledged or this time.
    linger_until: Option<Instant>,
    end: Option<End>,
    pool: Vec<Vec<u8>>,
}

impl Tx {
    fn new(cfg: &UdpConfig) -> Tx {
        Tx {
            next_frame: 1,
            next_cseq: 1,
            base: 1,
            flight: VecDeque::new(),
            unacked: 0,
            cwnd: cfg.initial_window as f64,
            ssthresh: cfg.max_window as f64,
            recover: 0,
            srtt: None,
            rttvar: Duration::ZERO,
            rto: cfg.initial_rto,
            timer_start: None,
            timeouts: 0,
            peer_next_take: 1,
            peer_cap: MIN_RECV_BUFFER,
            window_frames: VecDeque::new(),
            window_cost: 0,
            waiting_since: None,
            probe_at: None,
            probe_interval: FIRST_PROBE,
            linger_until: None,
            end: None,
            pool: Vec::new(),
        }
    }

    /// Whether a frame costing `cost` fits the peer's receive window now.
    fn frame_fits(&self, cost: u64) -> bool {
        // The peer buffers frames beyond the one its application takes next, which it
        // always admits: that is the first of `window_frames` (or a later one).
        match self.window_frames.front() {
            None => true,
            Some(&(_, first)) => self.window_cost - first + cost <= self.peer_cap,
        }
    }

    /// Chunks the owner may put in flight now.
    fn room(&self, cfg: &UdpConfig) -> usize {
        let cwnd = (self.cwnd as usize).clamp(1, cfg.max_window);
        let by_cwnd = cwnd.saturating_sub(self.unacked);
        let by_span = (2 * cfg.max_window).saturating_sub(self.flight.len());
        by_cwnd.min(by_span)
    }

    /// When the retransmission timer expires.
    fn timer_deadline(&self, cfg: &UdpConfig) -> Option<Instant> {
        let backoff = (self.rto * (1u32 << self.timeouts.min(8))).min(cfg.max_rto);
        self.timer_start.map(|t| t + backoff)
    }

    fn on_rtt(&mut self, sample: Duration, cfg: &UdpConfig) {
        match self.srtt {
            None => {
                self.srtt = Some(sample);
                self.rttvar = sample / 2;
            }
            Some(s) => {
                let diff = s.abs_diff(sample);
                self.rttvar = (self.rttvar * 3 + diff) / 4;
                self.srtt = Some((s * 7 + sample) / 8);
            }
        }
        let srtt = self.srtt.unwrap_or(sample);
        self.rto = (srtt + self.rttvar * 4).clamp(cfg.min_rto, cfg.max_rto);
    }

    fn on_loss(&mut self, cseq: u64, cfg: &UdpConfig) {
        if cseq >= self.recover {
            self.ssthresh = (self.cwnd / 2.0).max(cfg.min_window as f64);
            self.cwnd = self.ssthresh;
            self.recover = self.next_cseq;
        }
    }

    fn on_acked(&mut self, n: usize, cfg: &UdpConfig) {
        for _ in 0..n {
            if self.cwnd < self.ssthresh {
                self.cwnd += 1.0;
            } else {
                self.cwnd += 1.0 / self.cwnd;
            }
        }
        self.cwnd = self.cwnd.min(cfg.max_window as f64);
    }

    fn mark_resent(&mut self, i: usize, now: Instant) {
        let c = &mut self.flight[i];
        c.sends += 1;
        c.sent_at = now;
    }

    /// Applies an authentic ack; chunks to send again go to `out`. `Err` for an ack that
    /// cannot be right (it acknowledges chunks or frames never sent).
    fn on_ack(
        &mut self,
        a: &AckHdr,
        bitmap: &[u8],
        now: Instant,
        cfg: &UdpConfig,
        counters: &LinkCounters,
        out: &mut Resends,
    ) -> Result<bool, String> {
        if a.cum == 0 || a.cum > self.next_cseq {
            return Err(format!(
                "ack up to chunk {} when {} were sent",
                a.cum,
                self.next_cseq - 1
            ));
        }
        if a.next_take == 0 || a.next_take > self.next_frame {
            return Err(format!(
                "peer takes frame {} next when {} were sent",
                a.next_take,
                self.next_frame - 1
            ));
        }
        let mut opened = false;
        self.peer_cap = a.cap.max(MIN_RECV_BUFFER);
        if a.next_take > self.peer_next_take {
            self.peer_next_take = a.next_take;
            while let Some(&(f, c)) = self.window_frames.front() {
                if f >= a.next_take {
                    break;
                }
                self.window_frames.pop_front();
                self.window_cost -= c;
            }
            opened = true;
        }
        let mut newly = 0usize;
        let mut sample = None;
        while self.base < a.cum {
            let Some(c) = self.flight.pop_front() else {
                break;
            };
            self.base += 1;
            if !c.acked {
                self.unacked -= 1;
                newly += 1;
                if c.sends == 1 {
                    sample = Some(now.saturating_duration_since(c.sent_at));
                }
            }
            if self.pool.len() < 2 * cfg.max_window {
                self.pool.push(c.data);
            }
        }
        let mut highest_sacked = None;
        for (byte_i, &byte) in bitmap.iter().enumerate() {
            if byte == 0 {
                continue;
            }
            for bit in 0..8 {
                if byte >> bit & 1 == 0 {
                    continue;
                }
                let cseq = a.cum + 1 + (byte_i * 8 + bit) as u64;
                if cseq >= self.next_cseq {
                    return Err(format!(
                        "ack for chunk {cseq} when {} were sent",
                        self.next_cseq - 1
                    ));
                }
                if cseq < self.base {
                    continue;
                }
                let c = &mut self.flight[(cseq - self.base) as usize];
                if !c.acked {
                    c.acked = true;
                    self.unacked -= 1;
                    newly += 1;
                    if c.sends == 1 {
                        sample = Some(now.saturating_duration_since(c.sent_at));
                    }
                }
                highest_sacked = Some(cseq);
            }
        }
        if let Some(s) = sample {
            self.on_rtt(s, cfg);
        }
        if newly > 0 {
            self.on_acked(newly, cfg);
            opened = true;
        }
        // Fast retransmission: chunks with DUP_THRESH later chunks acknowledged, unless sent
        // again within the last two round trips.
        if let Some(h) = highest_sacked {
            let guard = self
                .srtt
                .map_or(cfg.min_rto, |s| (s * 2).max(Duration::from_micros(200)));
            let end = h.saturating_sub(DUP_THRESH).saturating_sub(self.base) as usize + 1;
            for i in 0..end.min(self.flight.len()) {
                let c = &self.flight[i];
                if c.acked || (c.sends > 1 && now.saturating_duration_since(c.sent_at) < guard) {
                    continue;
                }
                out.push(c);
                let cseq = self.base + i as u64;
                self.on_loss(cseq, cfg);
                self.mark_resent(i, now);
                LinkCounters::bump(&counters.retransmits);
            }
        }
        if self.unacked == 0 {
            self.timer_start = None;
            self.timeouts = 0;
            if self.probe_at.is_none() {
                self.waiting_since = None;
            }
        } else {
            self.waiting_since = Some(now);
            if newly > 0 {
                self.timer_start = Some(now);
                self.timeouts = 0;
            }
        }
        Ok(opened)
    }

    /// When the retransmission timer expired (no ack of new chunks for a timeout): sends
    /// again every unacknowledged chunk out for at least `rto` (into `out`), at most a
    /// window's worth, and restarts the timer with a doubled timeout.
    fn on_timer(
        &mut self,
        now: Instant,
        cfg: &UdpConfig,
        counters: &LinkCounters,
        out: &mut Resends,
    ) {
        if self.timer_deadline(cfg).is_none_or(|d| d > now) {
            return;
        }
        let mut budget = (self.cwnd as usize).max(cfg.min_window);
        for i in 0..self.flight.len() {
            let c = &self.flight[i];
            if c.acked || now.saturating_duration_since(c.sent_at) < self.rto {
                continue;
            }
            if budget == 0 {
                break;
            }
            budget -= 1;
            out.push(c);
            let cseq = self.base + i as u64;
            self.on_loss(cseq, cfg);
            self.mark_resent(i, now);
            LinkCounters::bump(&counters.retransmits);
        }
        self.timeouts += 1;
        self.timer_start = Some(now);
    }
}

struct RxFrame {
    total: u32,
    chunk_size: u32,
    count: u32,
    first_cseq: u64,
    got: u32,
    cost: u64,
    head: [u8; HEADER_LEN],
    header: Option<FrameHeader>,
    payload: Vec<u8>,
}

impl RxFrame {
    fn complete(&self) -> bool {
        self.got == self.count && self.header.is_some()
    }
}

/// The receiving direction.
struct Rx {
    /// Every chunk sequence number below this arrived.
    cum: u64,
    /// Ring of `TRACK_BITS` bits: chunk `c` (`cum <= c < cum + TRACK_BITS`) arrived.
    bits: Vec<u64>,
    /// Highest chunk sequence number that arrived (0: none).
    highest: u64,
    frames: BTreeMap<u64, RxFrame>,
    /// The frame `recv` returns next.
    next_take: u64,
    /// Cost of the frames in `frames` other than `next_take`'s.
    buffered: u64,
    /// New chunks since the last ack.
    unacked: usize,
    ack_now: bool,
    ack_at: Option<Instant>,
    /// A probe arrived: send a window update when `recv` takes a frame.
    update_wanted: bool,
    /// A frame the peer sent that cannot be delivered, reported when `recv` reaches it.
    poison: Option<(u64, ProtocolError)>,
    end: Option<End>,
    pool: Vec<Vec<u8>>,
}

enum DataOutcome {
    /// Nothing for `recv` yet.
    Stored,
    /// The frame `recv` waits for is complete (or poisoned).
    Deliverable,
    Duplicate,
    Malformed(String),
    /// The chunk's frame cannot be delivered (over the payload cap, or a bad frame header):
    /// `recv` reports it when it gets there (`now`: that is the next frame).
    Refused {
        now: bool,
    },
}

impl Rx {
    fn new() -> Rx {
        Rx {
            cum: 1,
            bits: vec![0; (TRACK_BITS / 64) as usize],
            highest: 0,
            frames: BTreeMap::new(),
            next_take: 1,
            buffered: 0,
            unacked: 0,
            ack_now: false,
            ack_at: None,
            update_wanted: false,
            poison: None,
            end: None,
            pool: Vec::new(),
        }
    }

    fn bit(&self, c: u64) -> bool {
        let i = c % TRACK_BITS;
        self.bits[(i / 64) as usize] >> (i % 64) & 1 == 1
    }

    fn set_bit(&mut self, c: u64, on: bool) {
        let i = c % TRACK_BITS;
        let w = &mut self.bits[(i / 64) as usize];
        if on {
            *w |= 1 << (i % 64);
        } else {
            *w &= !(1 << (i % 64));
        }
    }

    /// Records that chunk `c` arrived and moves the cumulative point.
    fn mark(&mut self, c: u64) {
        self.set_bit(c, true);
        self.highest = self.highest.max(c);
        if c != self.cum {
            // A gap: tell the sender soon so it can retransmit.
            self.ack_now = true;
        }
        while self.bit(self.cum) {
            self.set_bit(self.cum, false);
            self.cum += 1;
        }
        self.unacked += 1;
    }

    fn take_buf(&mut self, len: usize) -> Vec<u8> {
        let best = self
            .pool
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        match best {
            Some(i) => {
                let mut b = self.pool.swap_remove(i);
                b.clear();
                b.resize(len, 0);
                b
            }
            None => vec![0; len],
        }
    }

    fn poison(&mut self, frame: u64, e: ProtocolError) {
        if self.poison.is_none() {
            self.poison = Some((frame, e));
        }
        if let Some(f) = self.frames.remove(&frame) {
            if frame != self.next_take {
                self.buffered -= f.cost;
            }
        }
    }

    /// Stores an authentic data chunk.
    fn on_data(&mut self, d: &DataHdr, data: &[u8], max_payload: u32, cap: u64) -> DataOutcome {
        let max_len = max_payload.max(MAX_CONTROL_LEN) as u64;
        let want = match d.check() {
            Ok(n) => n,
            Err(m) => return DataOutcome::Malformed(m),
        };
        if data.len() != want {
            return DataOutcome::Malformed(format!(
                "chunk {} of frame {} carries {} bytes, its numbers say {want}",
                d.index,
                d.frame,
                data.len()
            ));
        }
        if d.cseq < self.cum || d.frame < self.next_take || self.bit(d.cseq) {
            self.ack_now = true;
            return DataOutcome::Duplicate;
        }
        if d.cseq >= self.cum + TRACK_BITS {
            return DataOutcome::Malformed(format!(
                "chunk {} is beyond the window (every chunk below {} arrived)",
                d.cseq, self.cum
            ));
        }
        if self.poison.as_ref().is_some_and(|(f, _)| *f == d.frame) {
            // Acknowledged (so the sender stops) but not kept: `recv` reports the frame.
            self.mark(d.cseq);
            return DataOutcome::Stored;
        }
        let first_cseq = d.cseq - d.index as u64;
        match self.frames.get(&d.frame) {
            Some(f) => {
                if (f.total, f.chunk_size, f.count, f.first_cseq)
                    != (d.total, d.chunk_size, d.count, first_cseq)
                {
                    return DataOutcome::Malformed(format!(
                        "chunk {} of frame {} disagrees with earlier chunks of it",
                        d.index, d.frame
                    ));
                }
            }
            None => {
                let len = d.total as u64 - HEADER_LEN as u64;
                if len > max_len {
                    self.mark(d.cseq);
                    self.poison(
                        d.frame,
                        ProtocolError::TooLarge {
                            what: "frame payload",
                            len,
                            max: max_len,
                        },
                    );
                    return DataOutcome::Refused {
                        now: d.frame == self.next_take,
                    };
                }
                let cost = d.total as u64 + FRAME_OVERHEAD;
                if d.frame != self.next_take {
                    if self.buffered + cost > cap {
                        return DataOutcome::Malformed(format!(
                            "frame {} of {} bytes overflows the receive buffer ({} of {cap} \
                             bytes used)",
                            d.frame, d.total, self.buffered
                        ));
                    }
                    self.buffered += cost;
                }
                let payload = self.take_buf(len as usize);
                self.frames.insert(
                    d.frame,
                    RxFrame {
                        total: d.total,
                        chunk_size: d.chunk_size,
                        count: d.count,
                        first_cseq,
                        got: 0,
                        cost,
                        head: [0; HEADER_LEN],
                        header: None,
                        payload,
                    },
                );
            }
        }
        self.mark(d.cseq);
        let Some(f) = self.frames.get_mut(&d.frame) else {
            return DataOutcome::Stored;
        };
        let start = d.index as usize * f.chunk_size as usize;
        let end = start + data.len();
        if start < HEADER_LEN {
            let h1 = end.min(HEADER_LEN);
            f.head[start..h1].copy_from_slice(&data[..h1 - start]);
        }
        if end > HEADER_LEN {
            let p0 = start.max(HEADER_LEN);
            f.payload[p0 - HEADER_LEN..end - HEADER_LEN].copy_from_slice(&data[p0 - start..]);
        }
        f.got += 1;
        if d.index == 0 {
            // MIN_CHUNK > HEADER_LEN: chunk 0 holds the whole frame header.
            let checked = FrameHeader::decode(&f.head, max_payload).and_then(|h| {
                if h.len as u64 + HEADER_LEN as u64 == f.total as u64 {
                    Ok(h)
                } else {
                    Err(ProtocolError::Inconsistent(format!(
                        "frame header says {} payload bytes, its datagrams carry {}",
                        h.len,
                        f.total as usize - HEADER_LEN
                    )))
                }
            });
            match checked {
                Ok(h) => f.header = Some(h),
                Err(e) => {
                    self.poison(d.frame, e);
                    return DataOutcome::Refused {
                        now: d.frame == self.next_take,
                    };
                }
            }
        }
        if d.frame == self.next_take && f.complete() {
            DataOutcome::Deliverable
        } else {
            DataOutcome::Stored
        }
    }

    /// The ack for the current state (into `out`).
    fn build_ack(&mut self, cap: u64, out: &mut Vec<u8>) {
        let from = self.cum + 1;
        let nbits = (self.highest + 1).saturating_sub(from).min(MAX_ACK_BITS);
        let nbytes = nbits.div_ceil(8) as usize;
        out.clear();
        out.extend_from_slice(&ack_header(
            &AckHdr {
                cum: self.cum,
                next_take: self.next_take,
                cap,
            },
            nbytes,
        ));
        let at = out.len();
        out.resize(at + nbytes, 0);
        for j in 0..nbits {
            if self.bit(from + j) {
                out[at + (j / 8) as usize] |= 1 << (j % 8);
            }
        }
        self.unacked = 0;
        self.ack_now = false;
        self.ack_at = None;
    }
}

struct Shared {
    sock: UdpSocket,
    /// A clone of the anchor, polled by whichever thread reads.
    anchor: TcpStream,
    sealer: DatagramSealer,
    /// The next packet counter (shared by the owner and the I/O thread).
    counter: AtomicU64,
    tx: Mutex<Tx>,
    rx: Mutex<Rx>,
    /// Receiving, timers and acknowledgements; held by the thread that reads the socket, only
    /// while it works (never while it sleeps).
    reader: Mutex<Reader>,
    /// The owner is inside `recv` and reads the socket itself; the I/O thread stands aside.
    owner_reading: AtomicBool,
    /// The I/O thread waits on `aside_cv` for the owner to stop reading.
    aside: Mutex<bool>,
    aside_cv: Condvar,
    /// The I/O thread stands aside with long naps: wake it when the owner stops reading.
    aside_long: AtomicBool,
    /// Counts the owner's reading spells (so the I/O thread can tell one long `recv` from
    /// many short ones).
    read_gen: AtomicU64,
    /// Wakes an owner sleeping in `ppoll` (the link ended, or the I/O thread stored the frame
    /// it waits for).
    wake: OwnedFd,
    /// UDP_SEGMENT works on this socket (cleared after the first refusal).
    gso: AtomicBool,
    /// Nanoseconds after `epoch` when the peer last sent something authentic.
    last_heard: AtomicU64,
    epoch: Instant,
    counters: Arc<LinkCounters>,
    cfg: UdpConfig,
    /// The payload cap of data frames (control frames: `MAX_CONTROL_LEN`).
    max_payload: u32,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

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

fn send_retrying(sock: &UdpSocket, d: &[u8]) -> io::Result<()> {
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
enum Gso {
    /// Sent (or lost like any datagram): this many of the messages.
    Sent(usize),
    /// The kernel or device refused segmentation offload.
    Refused,
}

/// Sends `data` as datagrams of `seg` bytes (the last may be shorter) with UDP_SEGMENT, and
/// `extra` (if any) as one more datagram, in one `sendmmsg`.
fn send_segmented(
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

impl Shared {
    /// Seals `parts` as one datagram and sends it (`scratch` is the buffer to build it in).
    fn send_sealed(&self, parts: &[&[u8]], scratch: &mut Vec<u8>) -> io::Result<()> {
        scratch.clear();
        self.append_sealed(parts, scratch);
        send_retrying(&self.sock, scratch)
    }

    /// Appends `parts` and their seal to `out`.
    fn append_sealed(&self, parts: &[&[u8]], out: &mut Vec<u8>) {
        // Every datagram takes a fresh counter: GMAC must never see one twice.
        let c = self.counter.fetch_add(1, Ordering::Relaxed);
        let start = out.len();
        for p in parts {
            out.extend_from_slice(p);
        }
        let seal = self.sealer.seal(c, &out[start..]);
        out.extend_from_slice(&seal);
    }

    /// Sends sealed datagrams of `seg` bytes laid end to end in `buf` (the last may be
    /// shorter), then the sealed datagram `extra`: one system call where the kernel allows
    /// segmentation offload, else one each.
    fn send_batch(&self, buf: &[u8], seg: usize, extra: Option<&[u8]>) -> io::Result<()> {
        if buf.len() <= seg || self.gso.load(Ordering::Relaxed) {
            match send_segmented(&self.sock, buf, seg, extra)? {
                Gso::Sent(n) => {
                    if let Some(x) = extra.filter(|_| n < 2) {
                        send_retrying(&self.sock, x)?;
                    }
                    return Ok(());
                }
                Gso::Refused => self.gso.store(false, Ordering::Relaxed),
            }
        }
        for d in buf.chunks(seg).chain(extra) {
            send_retrying(&self.sock, d)?;
        }
        Ok(())
    }

    fn send_resends(&self, r: &Resends, scratch: &mut Vec<u8>) -> io::Result<()> {
        let mut from = 0;
        for (h, &end) in r.hdrs.iter().zip(&r.ends) {
            self.send_sealed(&[&h[..], &r.data[from..end]], scratch)?;
            from = end;
        }
        Ok(())
    }

    fn heard(&self, now: Instant) {
        let ns = now.saturating_duration_since(self.epoch).as_nanos() as u64;
        self.last_heard.fetch_max(ns, Ordering::Relaxed);
    }

    fn last_heard(&self) -> Instant {
        self.epoch + Duration::from_nanos(self.last_heard.load(Ordering::Relaxed))
    }

    /// Wakes an owner sleeping in `ppoll` inside `recv`.
    fn wake_owner(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd.
        let _ = unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    fn clear_wake(&self) {
        let mut b = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live buffer from our (non-blocking) eventfd.
        let _ = unsafe { libc::read(self.wake.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
    }

    /// Ends the link for both directions (the first reason sticks) and wakes the owner.
    fn finish(&self, end: End) {
        {
            let mut tx = lock(&self.tx);
            if tx.end.is_none() {
                tx.end = Some(end.clone());
            }
        }
        {
            let mut rx = lock(&self.rx);
            if rx.end.is_none() {
                rx.end = Some(end);
            }
        }
        self.wake_owner();
        let _g = lock(&self.aside);
        self.aside_cv.notify_all();
    }

    fn ended(&self) -> bool {
        lock(&self.tx).end.is_some()
    }

    /// The earliest timer: retransmission, probe, delayed ack, linger, peer timeout.
    fn next_wakeup(&self, now: Instant) -> Instant {
        let mut t = now + IDLE_TICK;
        let mut at = |x: Option<Instant>| {
            if let Some(x) = x {
                t = t.min(x);
            }
        };
        {
            let tx = lock(&self.tx);
            at(tx.timer_deadline(&self.cfg));
            at(tx.probe_at);
            at(tx.linger_until);
            at(tx
                .waiting_since
                .map(|w| w.max(self.last_heard()) + self.cfg.peer_timeout));
        }
        at(lock(&self.rx).ack_at);
        t.max(now)
    }
}

/// Waits until one of `fds` is readable, or `timeout`; which ones are.
fn wait_readable<const N: usize>(fds: [RawFd; N], timeout: Duration) -> io::Result<[bool; N]> {
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
fn recv_now(udp: &UdpSocket, buf: &mut [u8]) -> io::Result<(usize, Option<usize>, bool)> {
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
        let cfg = cfg.checked()?;
        let peer = socket.peer_addr().map_err(|e| {
            TransportError::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("the UDP link's socket must be connected to the peer: {e}"),
            ))
        })?;
        let local = socket.local_addr()?;
        socket.set_nonblocking(false)?;
        let s = socket2::SockRef::from(&socket);
        if s.recv_buffer_size().is_ok_and(|n| n < SOCKET_BUFFER) {
            let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
        }
        if s.send_buffer_size().is_ok_and(|n| n < SOCKET_BUFFER) {
            let _ = s.set_send_buffer_size(SOCKET_BUFFER);
        }
        // Receive coalesced runs of datagrams (one read for many); harmless where missing.
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
                rx.end = Some(End::Failed(format!("the peer sent a bad frame: {e}")));
                return Err(e.into());
            }
        }
        let next = rx.next_take;
        let header = match rx.frames.get(&next) {
            Some(f) if f.complete() => f.header,
            _ => None,
        };
        let Some(header) = header else {
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
        let Some(f) = rx.frames.remove(&next) else {
            return Ok(Take::Nothing);
        };
        rx.next_take += 1;
        // The frame after it, if buffered, leaves the window's accounting.
        let nt = rx.next_take;
        if let Some(c) = rx.frames.get(&nt).map(|n| n.cost) {
            rx.buffered -= c;
        }
        // Hand the frame over without copying; keep the caller's old buffer for a later one.
        let mut payload = f.payload;
        std::mem::swap(buf, &mut payload);
        if payload.capacity() > 0 && rx.pool.len() < POOL_MAX {
            rx.pool.push(payload);
        }
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
    let [_, anchor, woken] = wait_readable(
        [
            sh.sock.as_raw_fd(),
            sh.anchor.as_raw_fd(),
            sh.wake.as_raw_fd(),
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
        let per_send = (MAX_DATAGRAM / seg).clamp(1, GSO_MAX_SEGMENTS);
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
            let now = Instant::now();
            if tx.probe_at.is_none() {
                tx.probe_at = Some(now + FIRST_PROBE);
                tx.probe_interval = FIRST_PROBE;
                tx.waiting_since.get_or_insert(now);
            }
            drop(tx);
            match reading {
                None => reading = Some(Reading::start(sh)),
                Some(_) => owner_wait(sh, None)?,
            }
            tx = lock(&sh.tx);
        }
        if tx.probe_at.take().is_some() && tx.unacked == 0 {
            tx.waiting_since = None;
        }
        let frame = tx.next_frame;
        tx.next_frame += 1;
        tx.window_frames.push_back((frame, cost));
        tx.window_cost += cost;
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
            let now = Instant::now();
            if tx.unacked == 0 {
                tx.waiting_since = Some(now);
                tx.timer_start = Some(now);
                tx.timeouts = 0;
            }
            let first_cseq = tx.next_cseq;
            for k in i..i + n {
                let start = k * cs;
                let end = (start + cs).min(total);
                let hdr = DataHdr {
                    chunk_size: cs as u32,
                    index: k as u32,
                    count: count as u32,
                    total: total32,
                    frame,
                    cseq: tx.next_cseq,
                }
                .encode();
                let mut data = tx.pool.pop().unwrap_or_default();
                data.clear();
                for p in frame_range(&head, payload, start, end) {
                    data.extend_from_slice(p);
                }
                tx.flight.push_back(TxChunk {
                    hdr,
                    data,
                    sent_at: now,
                    sends: 1,
                    acked: false,
                });
                tx.next_cseq += 1;
                tx.unacked += 1;
            }
            drop(tx);
            // Seal the batch into one buffer of equal-size datagrams (the frame's last chunk
            // may be shorter, and is then the batch's last) and send it in one go.
            self.scratch.clear();
            for k in i..i + n {
                let start = k * cs;
                let end = (start + cs).min(total);
                let hdr = DataHdr {
                    chunk_size: cs as u32,
                    index: k as u32,
                    count: count as u32,
                    total: total32,
                    frame,
                    cseq: first_cseq + (k - i) as u64,
                }
                .encode();
                let [a, b] = frame_range(&head, payload, start, end);
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
                    sh.finish(End::Failed(format!("sending datagrams: {e}")));
                    return Err(e.into());
                }
            } else if let Err(e) = sh.send_batch(&self.scratch, seg, None) {
                sh.finish(End::Failed(format!("sending datagrams: {e}")));
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

    fn transport(&self) -> &'static str {
        "udp"
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

// ---------------------------------------------------------------------------------------
// Reading and timers (on the I/O thread, or on the owner inside `recv`)

/// The receiving side's own state, used by whichever thread reads.
struct Reader {
    opener: DatagramOpener,
    /// The owner is the one reading now (inside `recv`).
    owner: bool,
    resends: Resends,
    scratch: Vec<u8>,
    ack: Vec<u8>,
    buf: Vec<u8>,
}

impl Reader {
    fn new(opener: DatagramOpener) -> Reader {
        Reader {
            opener,
            owner: false,
            resends: Resends::default(),
            scratch: Vec::with_capacity(2048),
            ack: Vec::with_capacity(256),
            // A read is at most one UDP payload, coalesced or not; the rest is headroom (and
            // truncation would be flagged).
            buf: vec![0u8; 128 << 10],
        }
    }

    /// Reads what is queued (at most `DRAIN_MAX` reads), looks at the anchor if it is
    /// readable, then runs the timers. `Ok(true)`: more may be queued. `Err`: the link ended.
    fn step(&mut self, sh: &Shared, anchor_ready: bool, owner: bool) -> Result<bool, End> {
        self.owner = owner;
        let mut more = true;
        for _ in 0..DRAIN_MAX {
            match recv_now(&sh.sock, &mut self.buf) {
                Ok((len, seg, truncated)) => {
                    if truncated {
                        LinkCounters::bump(&sh.counters.mac_failures);
                        continue;
                    }
                    let buf = std::mem::take(&mut self.buf);
                    match seg {
                        Some(s) if s > 0 && s < len => {
                            for d in buf[..len].chunks(s) {
                                self.on_datagram(sh, d);
                            }
                        }
                        _ => self.on_datagram(sh, &buf[..len]),
                    }
                    self.buf = buf;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    more = false;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // An ICMP error from an earlier send: the peer's port was closed for a
                // moment. The anchor tells whether the peer is gone.
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {}
                Err(e) => return Err(End::Failed(format!("receiving a datagram: {e}"))),
            }
        }
        if anchor_ready {
            check_anchor(sh)?;
        }
        self.on_timers(sh, Instant::now())?;
        Ok(more)
    }

    fn on_datagram(&mut self, sh: &Shared, d: &[u8]) {
        let counters = &*sh.counters;
        if d.len() < PROBE_LEN + SEAL_LEN {
            LinkCounters::bump(&counters.mac_failures);
            return;
        }
        let (covered, seal) = d.split_at(d.len() - SEAL_LEN);
        match self.opener.open(seal, covered) {
            Ok(_) => {}
            Err(SealError::BadMac) => {
                LinkCounters::bump(&counters.mac_failures);
                return;
            }
            Err(_) => {
                LinkCounters::bump(&counters.replays);
                return;
            }
        }
        let now = Instant::now();
        sh.heard(now);
        let malformed = |m: &str| {
            LinkCounters::bump(&counters.malformed);
            tracing::debug!("dropped a malformed UDP datagram: {m}");
        };
        if covered[1] != WIRE_VERSION {
            return malformed(&format!("wire version {}", covered[1]));
        }
        match covered[0] {
            KIND_DATA if covered.len() >= DATA_HEADER_LEN => {
                let h = DataHdr::decode(covered);
                let data = &covered[DATA_HEADER_LEN..];
                let mut rx = lock(&sh.rx);
                match rx.on_data(&h, data, sh.max_payload, sh.cfg.recv_buffer as u64) {
                    DataOutcome::Stored => {}
                    DataOutcome::Refused { now } => {
                        drop(rx);
                        malformed(&format!("frame {} cannot be delivered", h.frame));
                        if now && !self.owner && sh.owner_reading.load(Ordering::SeqCst) {
                            sh.wake_owner();
                        }
                    }
                    DataOutcome::Deliverable => {
                        drop(rx);
                        // The owner reads for itself when it waits in `recv`, unless it
                        // started just as this thread was reading: wake it then.
                        if !self.owner && sh.owner_reading.load(Ordering::SeqCst) {
                            sh.wake_owner();
                        }
                    }
                    DataOutcome::Duplicate => LinkCounters::bump(&counters.duplicates),
                    DataOutcome::Malformed(m) => malformed(&m),
                }
            }
            KIND_ACK => {
                let (a, bitmap) = match parse_ack(covered) {
                    Ok(x) => x,
                    Err(m) => return malformed(&m),
                };
                self.resends.clear();
                let mut tx = lock(&sh.tx);
                match tx.on_ack(&a, bitmap, now, &sh.cfg, counters, &mut self.resends) {
                    Ok(opened) => {
                        if opened && tx.probe_at.is_some() {
                            // The owner re-checks the window; probe again only if still shut.
                            tx.probe_interval = FIRST_PROBE;
                            tx.probe_at = Some(now + FIRST_PROBE);
                        }
                    }
                    Err(m) => {
                        drop(tx);
                        malformed(&m);
                    }
                }
                if let Err(e) = sh.send_resends(&self.resends, &mut self.scratch) {
                    tracing::debug!("retransmission failed: {e}");
                }
            }
            KIND_PROBE if covered.len() == PROBE_LEN => {
                let mut rx = lock(&sh.rx);
                rx.ack_now = true;
                rx.update_wanted = true;
            }
            k => malformed(&format!("datagram kind {k} of {} bytes", covered.len())),
        }
    }

    fn on_timers(&mut self, sh: &Shared, now: Instant) -> Result<(), End> {
        let cfg = &sh.cfg;
        // Acknowledgements.
        let due = {
            let mut rx = lock(&sh.rx);
            let due =
                rx.ack_now || rx.unacked >= cfg.ack_every || rx.ack_at.is_some_and(|t| t <= now);
            if due {
                rx.build_ack(cfg.recv_buffer as u64, &mut self.ack);
            } else if rx.unacked > 0 && rx.ack_at.is_none() {
                rx.ack_at = Some(now + cfg.ack_delay);
            }
            due
        };
        if due {
            sh.send_sealed(&[&self.ack[..]], &mut self.scratch)
                .map_err(|e| End::Failed(format!("sending an ack: {e}")))?;
        }
        // Retransmissions, probes, the peer timeout, lingering.
        self.resends.clear();
        let mut probe = false;
        {
            let mut tx = lock(&sh.tx);
            if let Some(e) = &tx.end {
                return Err(e.clone());
            }
            tx.on_timer(now, cfg, &sh.counters, &mut self.resends);
            if let Some(p) = tx.probe_at {
                if p <= now {
                    probe = true;
                    tx.probe_interval = (tx.probe_interval * 2).min(MAX_PROBE);
                    tx.probe_at = Some(now + tx.probe_interval);
                }
            }
            if let Some(w) = tx.waiting_since {
                let since = w.max(sh.last_heard());
                if now.saturating_duration_since(since) >= cfg.peer_timeout {
                    return Err(End::TimedOut(cfg.peer_timeout));
                }
            }
            if let Some(l) = tx.linger_until {
                if tx.unacked == 0 || now >= l {
                    return Err(End::LocalClose);
                }
            }
        }
        sh.send_resends(&self.resends, &mut self.scratch)
            .map_err(|e| End::Failed(format!("retransmitting: {e}")))?;
        if probe {
            sh.send_sealed(&[&probe_bytes()[..]], &mut self.scratch)
                .map_err(|e| End::Failed(format!("sending a probe: {e}")))?;
        }
        Ok(())
    }
}

/// Reads the anchor: end of stream or an error ends the link.
fn check_anchor(sh: &Shared) -> Result<(), End> {
    let mut b = [0u8; 256];
    loop {
        match (&sh.anchor).read(&mut b) {
            Ok(0) => {
                let local = lock(&sh.tx).end.clone();
                return Err(local.unwrap_or(End::PeerClosed));
            }
            // Nothing is sent on the anchor after the link is set up: ignore it.
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(End::PeerReset(e.to_string())),
        }
    }
}

fn io_thread(sh: Arc<Shared>, anchor: TcpStream) {
    let end = io_loop(&sh, &anchor);
    tracing::debug!(?end, "UDP link I/O thread ends");
    sh.finish(end);
    let _ = anchor.shutdown(Shutdown::Both);
}

fn io_loop(sh: &Shared, anchor: &TcpStream) -> End {
    let mut more = false;
    loop {
        if sh.owner_reading.load(Ordering::SeqCst) {
            // The owner reads (and runs the timers) inside `recv`: wait until it is done,
            // looking again after GRACE, then less and less often; once the naps are long,
            // the owner wakes this thread when it leaves `recv`.
            let mut nap = GRACE;
            let mut seen = sh.read_gen.load(Ordering::SeqCst);
            let mut aside = lock(&sh.aside);
            *aside = true;
            loop {
                sh.aside_long.store(nap > GRACE, Ordering::SeqCst);
                if !sh.owner_reading.load(Ordering::SeqCst) {
                    break;
                }
                if let Some(e) = lock(&sh.tx).end.clone() {
                    return e;
                }
                aside = sh
                    .aside_cv
                    .wait_timeout(aside, nap)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                let gen = sh.read_gen.load(Ordering::SeqCst);
                nap = if gen != seen {
                    // The owner left `recv` and came back: it is busy, keep the naps short.
                    seen = gen;
                    GRACE
                } else {
                    (nap * 2).min(MAX_ASIDE)
                };
            }
            sh.aside_long.store(false, Ordering::SeqCst);
            *aside = false;
            more = true;
            continue;
        }
        let now = Instant::now();
        let timeout = if more {
            Duration::ZERO
        } else {
            sh.next_wakeup(now).saturating_duration_since(now)
        };
        let [_, anchor_ready] =
            match wait_readable([sh.sock.as_raw_fd(), anchor.as_raw_fd()], timeout) {
                Ok(r) => r,
                Err(e) => return End::Failed(format!("waiting for datagrams: {e}")),
            };
        if sh.owner_reading.load(Ordering::SeqCst) {
            continue;
        }
        let r = lock(&sh.reader).step(sh, anchor_ready, false);
        match r {
            Ok(m) => more = m,
            Err(end) => return end,
        }
        if sh.ended() {
            if let Some(e) = lock(&sh.tx).end.clone() {
                return e;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_header_round_trips_and_checks_its_numbers() {
        let h = DataHdr {
            chunk_size: 1400,
            index: 2,
            count: 3,
            total: 40 + 3000,
            frame: 7,
            cseq: 99,
        };
        let b = h.encode();
        assert_eq!(DataHdr::decode(&b), h);
        assert_eq!(h.check(), Ok(3040 - 2800));
        assert!(DataHdr { count: 4, ..h }.check().is_err());
        assert!(DataHdr { index: 3, ..h }.check().is_err());
        assert!(DataHdr { cseq: 2, ..h }.check().is_err());
        assert!(DataHdr {
            total: 39,
            count: 1,
            index: 0,
            ..h
        }
        .check()
        .is_err());
        assert!(DataHdr {
            chunk_size: 10,
            ..h
        }
        .check()
        .is_err());
    }

    #[test]
    fn ack_bitmap_covers_what_arrived_past_the_cumulative_point() {
        let mut rx = Rx::new();
        for c in [1u64, 2, 4, 7, 12] {
            rx.mark(c);
        }
        assert_eq!(rx.cum, 3);
        let mut out = Vec::new();
        rx.build_ack(1 << 20, &mut out);
        let (a, bm) = parse_ack(&out).unwrap();
        assert_eq!(a.cum, 3);
        // Bits for chunks 4..=12: 4, 7 and 12.
        let got: Vec<u64> = (0..bm.len() * 8)
            .filter(|j| bm[j / 8] >> (j % 8) & 1 == 1)
            .map(|j| a.cum + 1 + j as u64)
            .collect();
        assert_eq!(got, vec![4, 7, 12]);
        rx.mark(3);
        assert_eq!(rx.cum, 5);
        for c in 5..=12 {
            if !rx.bit(c) {
                rx.mark(c);
            }
        }
        assert_eq!(rx.cum, 13);
        rx.build_ack(1 << 20, &mut out);
        assert_eq!(out.len(), ACK_HEADER_LEN);
    }

    #[test]
    fn sender_applies_cumulative_and_selective_acks() {
        let cfg = UdpConfig::default().checked().unwrap();
        let counters = LinkCounters::default();
        let mut tx = Tx::new(&cfg);
        let t0 = Instant::now();
        for _ in 0..10 {
            tx.flight.push_back(TxChunk {
                hdr: [0; DATA_HEADER_LEN],
                data: vec![1, 2, 3],
                sent_at: t0,
                sends: 1,
                acked: false,
            });
            tx.next_cseq += 1;
            tx.unacked += 1;
        }
        tx.next_frame = 2;
        let mut out = Resends::default();
        // Chunks 1..=3 arrived, 4 did not, 5..=9 did.
        let a = AckHdr {
            cum: 4,
            next_take: 1,
            cap: 1 << 20,
        };
        let later = t0 + Duration::from_millis(50);
        let opened = tx
            .on_ack(&a, &[0b1_1111], later, &cfg, &counters, &mut out)
            .unwrap();
        assert!(opened);
        assert_eq!(tx.base, 4);
        assert_eq!(tx.unacked, 10 - 3 - 5);
        // Chunk 4 has more than three later chunks acknowledged: retransmitted.
        assert_eq!(out.hdrs.len(), 1);
        assert_eq!(counters.retransmits.load(Ordering::Relaxed), 1);
        // Acks for chunks never sent are refused.
        let bad = AckHdr { cum: 12, ..a };
        assert!(tx
            .on_ack(&bad, &[], later, &cfg, &counters, &mut out)
            .is_err());
        let bad = AckHdr { next_take: 3, ..a };
        assert!(tx
            .on_ack(&bad, &[], later, &cfg, &counters, &mut out)
            .is_err());
    }
}
