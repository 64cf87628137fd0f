//! What the owner thread and the I/O thread of a reliable UDP link share: the socket, the
//! sealer, both directions' state under their mutexes, and the hand-over between readers.

use super::reader::Reader;
use super::rx::Rx;
use super::socket::{send_retrying, send_segmented, Gso};
use super::tx::{Resends, Tx};
use super::{End, UdpConfig, IDLE_TICK};
use crate::seal::DatagramSealer;
use crate::transport::LinkCounters;
use std::io;
use std::net::{TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub(super) struct Shared {
    pub(super) sock: UdpSocket,
    /// The kernel module's context when the link runs over it (`TransportKind::Kmod`): data
    /// datagrams arrive in its banks and leave through its TX area; acks and probes use
    /// `sock` both ways.
    pub(super) kmod: Option<crate::kmod::Device>,
    /// A clone of the anchor, polled by whichever thread reads.
    pub(super) anchor: TcpStream,
    pub(super) sealer: DatagramSealer,
    /// The next packet counter (shared by the owner and the I/O thread).
    pub(super) counter: AtomicU64,
    pub(super) tx: Mutex<Tx>,
    pub(super) rx: Mutex<Rx>,
    /// Receiving, timers and acknowledgements; held by the thread that reads the socket, only
    /// while it works (never while it sleeps).
    pub(super) reader: Mutex<Reader>,
    /// The owner is inside `recv` and reads the socket itself; the I/O thread stands aside.
    pub(super) owner_reading: AtomicBool,
    /// The I/O thread waits on `aside_cv` for the owner to stop reading.
    pub(super) aside: Mutex<bool>,
    pub(super) aside_cv: Condvar,
    /// The I/O thread stands aside with long naps: wake it when the owner stops reading.
    pub(super) aside_long: AtomicBool,
    /// Counts the owner's reading spells (so the I/O thread can tell one long `recv` from
    /// many short ones).
    pub(super) read_gen: AtomicU64,
    /// Wakes an owner sleeping in `ppoll` (the link ended, or the I/O thread stored the frame
    /// it waits for).
    pub(super) wake: OwnedFd,
    /// UDP_SEGMENT works on this socket (cleared after the first refusal).
    pub(super) gso: AtomicBool,
    /// Nanoseconds after `epoch` when the peer last sent something authentic.
    pub(super) last_heard: AtomicU64,
    pub(super) epoch: Instant,
    pub(super) counters: Arc<LinkCounters>,
    pub(super) cfg: UdpConfig,
    /// The payload cap of data frames (control frames: `MAX_CONTROL_LEN`).
    pub(super) max_payload: u32,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// Seals `parts` as one datagram and sends it (`scratch` is the buffer to build it in).
    pub(super) fn send_sealed(&self, parts: &[&[u8]], scratch: &mut Vec<u8>) -> io::Result<()> {
        scratch.clear();
        self.append_sealed(parts, scratch);
        send_retrying(&self.sock, scratch)
    }

    /// Appends `parts` and their seal to `out`.
    pub(super) fn append_sealed(&self, parts: &[&[u8]], out: &mut Vec<u8>) {
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
    pub(super) fn send_batch(
        &self,
        buf: &[u8],
        seg: usize,
        extra: Option<&[u8]>,
    ) -> io::Result<()> {
        if let Some(dev) = &self.kmod {
            dev.send(buf, seg)?;
            if let Some(x) = extra {
                send_retrying(&self.sock, x)?;
            }
            return Ok(());
        }
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

    pub(super) fn send_resends(&self, r: &Resends, scratch: &mut Vec<u8>) -> io::Result<()> {
        let mut from = 0;
        for (h, &end) in r.hdrs.iter().zip(&r.ends) {
            match &self.kmod {
                Some(dev) => {
                    scratch.clear();
                    self.append_sealed(&[&h[..], &r.data[from..end]], scratch);
                    dev.send(scratch, scratch.len())?;
                }
                None => self.send_sealed(&[&h[..], &r.data[from..end]], scratch)?,
            }
            from = end;
        }
        Ok(())
    }

    /// The kernel module's descriptor, for `ppoll` (-1, which `ppoll` skips, without one).
    pub(super) fn kmod_fd(&self) -> std::os::fd::RawFd {
        self.kmod.as_ref().map_or(-1, |d| d.raw_fd())
    }

    pub(super) fn heard(&self, now: Instant) {
        let ns = now.saturating_duration_since(self.epoch).as_nanos() as u64;
        self.last_heard.fetch_max(ns, Ordering::Relaxed);
    }

    pub(super) fn last_heard(&self) -> Instant {
        self.epoch + Duration::from_nanos(self.last_heard.load(Ordering::Relaxed))
    }

    /// Wakes an owner sleeping in `ppoll` inside `recv`.
    pub(super) fn wake_owner(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd.
        let _ = unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    pub(super) fn clear_wake(&self) {
        let mut b = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live buffer from our (non-blocking) eventfd.
        let _ = unsafe { libc::read(self.wake.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
    }

    /// Ends the link for both directions (the first reason sticks) and wakes the owner.
    pub(super) fn finish(&self, end: End) {
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

    pub(super) fn ended(&self) -> bool {
        lock(&self.tx).end.is_some()
    }

    /// The earliest timer: retransmission, probe, delayed ack, linger, peer timeout.
    pub(super) fn next_wakeup(&self, now: Instant) -> Instant {
        let mut t = now + IDLE_TICK;
        let last_heard = self.last_heard();
        if let Some(x) = lock(&self.tx).next_deadline(&self.cfg, last_heard) {
            t = t.min(x);
        }
        if let Some(x) = lock(&self.rx).ack_at {
            t = t.min(x);
        }
        t.max(now)
    }
}
