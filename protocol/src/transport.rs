//! The transport trait every link implements (TCP now; UDP, QUIC, io_uring and the kernel
//! module later): send a frame, receive a frame, in order. A link is split into a sender and a
//! receiver so one task can wait for input while another writes.

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

/// Bytes and frames through a link, both directions.
#[derive(Debug, Default)]
pub struct LinkCounters {
    pub frames_out: AtomicU64,
    pub bytes_out: AtomicU64,
    pub frames_in: AtomicU64,
    pub bytes_in: AtomicU64,
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
