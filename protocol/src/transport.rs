//! The async frame traits of the control plane (`FrameSender`, `FrameReceiver`, and `Link`
//! which holds one of each; implemented by `control_conn` on tokio TCP), which transport a
//! data link uses (`TransportKind`), and the counters every link keeps (`LinkCounters`). The
//! blocking data-plane trait is `blocking::DataLink`.

use crate::error::TransportError;
use crate::frame::FrameHeader;
use crate::handshake::Session;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Sends whole frames. `send` writes the header and the payload together (one vectored write
/// on stream transports) without copying the payload.
pub trait FrameSender: Send {
    fn send<'a>(
        &'a mut self,
        header: &'a FrameHeader,
        payload: &'a [u8],
    ) -> BoxFut<'a, Result<(), TransportError>>;
}

/// Receives whole, checked frames (magic, version, size cap, CRC32C).
pub trait FrameReceiver: Send {
    /// The next frame; its payload lands in `buf` (resized to the payload length).
    fn recv<'a>(
        &'a mut self,
        buf: &'a mut Vec<u8>,
    ) -> BoxFut<'a, Result<FrameHeader, TransportError>>;
}

/// Which transport a data link uses. A node listens for its data links on its `--listen`
/// port: TCP (plain, or driven by io_uring; the wire is the same) or UDP (reliable UDP links
/// negotiated over a TCP connection to that port, and QUIC).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum TransportKind {
    #[default]
    Tcp,
    Udp,
    Quic,
    Uring,
    /// Reliable UDP whose data datagrams the kernel module (`kmod/`) takes off the wire.
    Kmod,
}

impl TransportKind {
    pub const ALL: [TransportKind; 5] = [
        TransportKind::Tcp,
        TransportKind::Udp,
        TransportKind::Quic,
        TransportKind::Uring,
        TransportKind::Kmod,
    ];

    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Udp => "udp",
            TransportKind::Quic => "quic",
            TransportKind::Uring => "uring",
            TransportKind::Kmod => "kmod",
        }
    }

    pub fn from_name(s: &str) -> Option<TransportKind> {
        TransportKind::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s.trim()))
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for TransportKind {
    type Err = crate::error::NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TransportKind::from_name(s).ok_or_else(|| crate::error::NameError::Transport(s.to_string()))
    }
}

/// Bytes and frames through a link, both directions, and the events a transport must not
/// hide: refused seals, retransmissions, which fast paths were taken.
#[derive(Debug, Default)]
pub struct LinkCounters {
    pub frames_out: AtomicU64,
    pub bytes_out: AtomicU64,
    pub frames_in: AtomicU64,
    pub bytes_in: AtomicU64,
    /// Frames or datagrams whose MAC did not verify (dropped on datagram links; the link is
    /// closed on stream links).
    pub mac_failures: AtomicU64,
    /// Datagrams (or stream frames) refused as replays or stale.
    pub replays: AtomicU64,
    /// Reliable UDP: chunks sent again after a loss.
    pub retransmits: AtomicU64,
    /// Reliable UDP: duplicate chunks received and dropped.
    pub duplicates: AtomicU64,
    /// Reliable UDP: authentic datagrams dropped as malformed (a chunk count or size that
    /// disagrees with its frame, the payload cap or the receive window; an unknown kind).
    pub malformed: AtomicU64,
    /// io_uring: sends that went through IORING_OP_SEND_ZC.
    pub zc_sends: AtomicU64,
    /// io_uring: zero-copy sends the kernel completed by copying after all (loopback does).
    pub zc_copied: AtomicU64,
    /// io_uring: reads and writes on registered (fixed) buffers.
    pub fixed_buf_ops: AtomicU64,
}

impl LinkCounters {
    pub fn sent(&self, bytes: usize) {
        self.frames_out.fetch_add(1, Ordering::Relaxed);
        self.bytes_out.fetch_add(bytes as u64, Ordering::Relaxed);
    }
    pub fn received(&self, bytes: usize) {
        self.frames_in.fetch_add(1, Ordering::Relaxed);
        self.bytes_in.fetch_add(bytes as u64, Ordering::Relaxed);
    }
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
    /// The non-zero event counters, for logs and stats ("mac_failures=2 retransmits=17").
    pub fn events(&self) -> Vec<(&'static str, u64)> {
        [
            ("mac_failures", &self.mac_failures),
            ("replays", &self.replays),
            ("retransmits", &self.retransmits),
            ("duplicates", &self.duplicates),
            ("malformed", &self.malformed),
            ("zc_sends", &self.zc_sends),
            ("zc_copied", &self.zc_copied),
            ("fixed_buf_ops", &self.fixed_buf_ops),
        ]
        .into_iter()
        .map(|(n, c)| (n, c.load(Ordering::Relaxed)))
        .filter(|&(_, v)| v > 0)
        .collect()
    }
    pub fn snapshot(&self) -> (u64, u64, u64, u64) {
        (
            self.frames_out.load(Ordering::Relaxed),
            self.bytes_out.load(Ordering::Relaxed),
            self.frames_in.load(Ordering::Relaxed),
            self.bytes_in.load(Ordering::Relaxed),
        )
    }
}

/// An authenticated connection.
pub struct Link {
    pub tx: Box<dyn FrameSender>,
    pub rx: Box<dyn FrameReceiver>,
    pub session: Session,
    /// The peer's address as we see it.
    pub peer_addr: String,
    pub counters: Arc<LinkCounters>,
}
