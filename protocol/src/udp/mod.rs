//! Reliable UDP data links: frames cut into sealed datagrams, selective acknowledgements,
//! retransmission timers, a congestion window and a receive window, on one connected UDP
//! socket per link. The TCP connection the link was negotiated on (the *anchor*) stays open
//! beside it: end of stream or an error on it is how a closed or crashed peer is noticed, and
//! shutting it down is how either side closes the link.
//!
//! # Layout
//!
//! * `wire`: the datagram format below, on byte slices (no I/O).
//! * `tx` and `rx`: the sending and receiving directions as state machines that take the
//!   time as an argument, so they can be driven without sockets or sleeps (`harness`, in
//!   tests, runs a sender and a receiver over a simulated lossy network on a virtual clock).
//! * `socket`: the Linux socket calls (GSO/GRO, `ppoll`).
//! * `shared`: what the owner thread and the I/O thread share.
//! * `reader`: reading the socket and running the timers, on either thread.
//! * `link`: `UdpDataLink`, the owner's `send` and `recv`.
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
//! checks the seal with `DatagramOpener::open` before reading any other byte: a forged
//! datagram is dropped and counted in `mac_failures`, a replayed or stale one in `replays`;
//! neither ever ends the link.
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

mod link;
mod reader;
mod rx;
mod shared;
mod socket;
mod tx;
pub mod wire;

#[cfg(test)]
mod harness;

pub use link::UdpDataLink;
pub use wire::{
    ACK_HEADER_LEN, DATA_HEADER_LEN, MAX_ACK_BITS, MAX_CHUNK, MAX_DATAGRAM, MIN_CHUNK, PROBE_LEN,
};

use crate::error::TransportError;
use std::io;
use std::sync::Arc;
use std::time::Duration;

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
    /// The configuration with its soft limits applied, or why it cannot work (an
    /// `InvalidInput` I/O error carrying a `UdpConfigError`).
    pub(crate) fn checked(mut self) -> Result<UdpConfig, TransportError> {
        let bad = |e: UdpConfigError| {
            Err(TransportError::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                e,
            )))
        };
        if !(MIN_CHUNK..=MAX_CHUNK).contains(&self.chunk_payload) {
            return bad(UdpConfigError::ChunkPayload(self.chunk_payload));
        }
        if !(1..=(MAX_ACK_BITS / 2) as usize).contains(&self.max_window) {
            return bad(UdpConfigError::MaxWindow(self.max_window));
        }
        if self.min_rto.is_zero() || self.min_rto > self.max_rto {
            return bad(UdpConfigError::Rto {
                min: self.min_rto,
                max: self.max_rto,
            });
        }
        if self.peer_timeout.is_zero() {
            return bad(UdpConfigError::PeerTimeout);
        }
        self.min_window = self.min_window.clamp(1, self.max_window);
        self.initial_window = self.initial_window.clamp(self.min_window, self.max_window);
        self.recv_buffer = self.recv_buffer.max(MIN_RECV_BUFFER as usize);
        self.ack_every = self.ack_every.max(1);
        self.initial_rto = self.initial_rto.clamp(self.min_rto, self.max_rto);
        Ok(self)
    }
}

/// A `UdpConfig` that cannot work (wrapped in an `InvalidInput` I/O error by
/// `UdpDataLink::new`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UdpConfigError {
    /// `chunk_payload` outside `MIN_CHUNK..=MAX_CHUNK`.
    #[error(
        "invalid UDP link configuration: chunk_payload {0} is outside {MIN_CHUNK}..={MAX_CHUNK}"
    )]
    ChunkPayload(usize),
    /// `max_window` outside `1..=MAX_ACK_BITS / 2` (an ack must cover two windows).
    #[error("invalid UDP link configuration: max_window {0} is outside 1..={max}", max = MAX_ACK_BITS / 2)]
    MaxWindow(usize),
    /// `min_rto` zero or above `max_rto`.
    #[error("invalid UDP link configuration: min_rto {min:?} must be above zero and at most max_rto {max:?}")]
    Rto { min: Duration, max: Duration },
    /// `peer_timeout` zero (every wait would fail at once).
    #[error("invalid UDP link configuration: peer_timeout is zero")]
    PeerTimeout,
}

/// Why a link stopped. The first reason sticks, and both directions report it.
#[derive(Clone, Debug, thiserror::Error)]
enum End {
    /// `closer()` (or a fatal error on our side after it was reported).
    #[error("the UDP link was closed")]
    LocalClose,
    /// End of stream on the anchor.
    #[error("the peer closed the UDP link")]
    PeerClosed,
    /// The anchor failed (reset: the peer process died).
    #[error("the UDP link's peer is gone: its anchor connection failed: {0}")]
    PeerReset(Arc<io::Error>),
    /// No authentic datagram from the peer for `peer_timeout` while waiting for it.
    #[error("timed out after {0:?} without hearing from the UDP link's peer")]
    TimedOut(Duration),
    /// A socket call failed: what the link was doing, and the error.
    #[error("UDP link failed: {doing}: {error}")]
    Failed {
        doing: &'static str,
        error: Arc<io::Error>,
    },
    /// `recv` reached a frame the peer sent that cannot be delivered; it reported why, and
    /// the link is over.
    #[error("UDP link failed: the peer sent a bad frame: {0}")]
    BadFrame(String),
}

impl End {
    /// A socket call failed while the link was `doing` something.
    fn failed(doing: &'static str, e: &io::Error) -> End {
        let error = match e.raw_os_error() {
            Some(code) => io::Error::from_raw_os_error(code),
            None => io::Error::new(e.kind(), e.to_string()),
        };
        End::Failed {
            doing,
            error: Arc::new(error),
        }
    }

    /// What `send` and `recv` return once the link has ended this way.
    fn send_error(&self) -> TransportError {
        let kind =
            match self {
                End::LocalClose => io::ErrorKind::NotConnected,
                End::PeerClosed => io::ErrorKind::BrokenPipe,
                End::PeerReset(_) => io::ErrorKind::ConnectionReset,
                End::TimedOut(d) => return TransportError::Timeout(
                    *d,
                    "without hearing from the UDP link's peer (wrong keys, a firewall dropping \
                     datagrams, or the peer is gone)",
                ),
                End::Failed { .. } | End::BadFrame(_) => io::ErrorKind::Other,
            };
        TransportError::Io(io::Error::new(kind, self.to_string()))
    }
}
