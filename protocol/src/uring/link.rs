//! `UringDataLink`: the ring, the registered buffers, and `DataLink` over them.

use super::engine::{build_ring, os_error, retryable, round_up, Engine, Op};
use super::support::{setup_refused, support, unavailable, UringConfig};
use super::{MAX_CHAIN, MAX_OP_LEN};
use crate::blocking::{finish_stream_frame, DataLink, LinkCloser};
use crate::error::TransportError;
use crate::frame::{FrameHeader, HEADER_LEN};
use crate::seal::{LinkKeys, Opener, Sealer, SEAL_LEN};
use crate::transport::{LinkCounters, TransportKind};
use io_uring::types;
use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Data frames on a TCP stream driven through io_uring; byte for byte what `TcpDataLink`
/// writes and reads.
pub struct UringDataLink {
    // Declared first: dropped (the ring closed) before the buffers registered with it.
    pub(super) eng: Engine,
    pub(super) sbuf: Box<[u8]>,
    pub(super) rbuf: Box<[u8]>,
    /// Unread bytes of `rbuf` are `rpos..rend`.
    pub(super) rpos: usize,
    pub(super) rend: usize,
    max_payload: u32,
    sealer: Sealer,
    opener: Opener,
    counters: Arc<LinkCounters>,
    /// `usize::MAX` when zero-copy is off or unsupported.
    pub(super) zc_threshold: usize,
    pub(super) zc_chunk: usize,
    pub(super) zc_inflight: usize,
    /// Payload remainders of at least this size are received straight into the caller's
    /// buffer.
    pub(super) direct_min: usize,
    pub(super) memlock_limit: Option<u64>,
    pub(super) nomem_warned: bool,
}

static FIRST_LINK_LOGGED: AtomicBool = AtomicBool::new(false);

impl UringDataLink {
    /// Takes over a connected, authenticated TCP stream (switched to blocking mode); `keys`
    /// come from its handshake.
    pub fn new(
        stream: TcpStream,
        max_payload: u32,
        keys: &LinkKeys,
        cfg: UringConfig,
    ) -> Result<UringDataLink, TransportError> {
        let support = support()?;
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        let entries = cfg
            .ring_entries
            .clamp(2 * MAX_CHAIN as u32, 4096)
            .next_power_of_two();
        let ring = build_ring(entries).map_err(|e| setup_refused(&e, &support.kernel))?;

        let zc = support.send_zc && cfg.zc_threshold != usize::MAX;
        let zc_threshold = if zc {
            cfg.zc_threshold.max(1)
        } else {
            usize::MAX
        };
        let buffer = round_up(cfg.buffer.clamp(4 << 10, 256 << 20), 4096);
        let mut sbuf = vec![0u8; buffer].into_boxed_slice();
        let mut rbuf = vec![0u8; buffer].into_boxed_slice();
        let iov = [
            libc::iovec {
                iov_base: sbuf.as_mut_ptr().cast(),
                iov_len: sbuf.len(),
            },
            libc::iovec {
                iov_base: rbuf.as_mut_ptr().cast(),
                iov_len: rbuf.len(),
            },
        ];
        // SAFETY: both buffers are heap allocations owned by the link, never resized, and
        // freed only after the ring (the `eng` field is dropped first); the kernel accesses
        // them only through operations `Engine::run` waits for.
        unsafe { ring.submitter().register_buffers(&iov) }.map_err(|e| {
            let limit = support
                .memlock_limit
                .map_or("unlimited".into(), |l| format!("{} KiB", l >> 10));
            unavailable(
                io::ErrorKind::OutOfMemory,
                format!(
                    "registering {} KiB of io_uring buffers failed: {e} (they count against \
                     RLIMIT_MEMLOCK, now {limit}, shared by all processes of this user: raise \
                     it with `ulimit -l`, LimitMEMLOCK= in a systemd unit or memlock in \
                     /etc/security/limits.conf, or lower the uring buffer size)",
                    (sbuf.len() + rbuf.len()) >> 10
                ),
            )
        })?;

        let zc_chunk = cfg.zc_chunk.clamp(4 << 10, MAX_OP_LEN);
        let mut zc_inflight = cfg.zc_inflight.max(zc_chunk);
        if let Some(limit) = support.memlock_limit {
            let cap = usize::try_from(limit / 4).unwrap_or(usize::MAX);
            if zc_inflight > cap {
                zc_inflight = cap.max(4 << 10);
            }
        }
        let zc_chunk = zc_chunk.min(zc_inflight);
        let counters = Arc::new(LinkCounters::default());
        let fd = stream.as_raw_fd();
        let link = UringDataLink {
            eng: Engine {
                ring,
                stream,
                fd,
                next_id: 1,
                notifs: Vec::new(),
                counters: Arc::clone(&counters),
                poisoned: false,
                copied_logged: false,
                enter_failures: 0,
                cqes: Vec::with_capacity(64),
                sqes: Vec::with_capacity(MAX_CHAIN),
            },
            direct_min: rbuf.len() / 4,
            sbuf,
            rbuf,
            rpos: 0,
            rend: 0,
            max_payload,
            sealer: Sealer::new(&keys.send),
            opener: Opener::new(&keys.recv),
            counters,
            zc_threshold,
            zc_chunk,
            zc_inflight,
            memlock_limit: support.memlock_limit,
            nomem_warned: false,
        };
        let paths = link.paths();
        if !FIRST_LINK_LOGGED.swap(true, Ordering::Relaxed) {
            tracing::info!(kernel = %support.kernel, "io_uring transport: {paths}");
        }
        tracing::debug!(peer = ?link.eng.stream.peer_addr().ok(), "io_uring link: {paths}");
        Ok(link)
    }

    /// Which paths this link takes, in words (also logged when it is made).
    pub fn paths(&self) -> String {
        let zc = if self.zc_threshold == usize::MAX {
            "SEND_ZC off (unsupported or disabled)".to_string()
        } else {
            format!(
                "payloads ≥ {} KiB by SEND_ZC in {} KiB pieces (≤ {} KiB pinned)",
                self.zc_threshold >> 10,
                self.zc_chunk >> 10,
                self.zc_inflight >> 10
            )
        };
        format!(
            "frames ≤ {} B by WRITE_FIXED from a registered send buffer; larger ones by linked \
             SEND from the caller's memory; {zc}; reads by READ_FIXED into a {} KiB registered \
             buffer, payload remainders ≥ {} KiB by RECV straight into the caller's buffer",
            self.sbuf.len(),
            self.rbuf.len() >> 10,
            self.direct_min >> 10
        )
    }

    /// The underlying stream.
    pub fn stream(&self) -> &TcpStream {
        &self.eng.stream
    }

    /// Whether payloads of `len` bytes would go out by SEND_ZC.
    pub fn zero_copy_for(&self, len: usize) -> bool {
        len >= self.zc_threshold
    }
}

impl Drop for UringDataLink {
    fn drop(&mut self) {
        // Nothing is in flight on the registered buffers (every op is reaped before a method
        // returns). Unregistering now returns their RLIMIT_MEMLOCK share at once, instead of
        // whenever the kernel finishes tearing the ring down.
        let _ = self.eng.ring.submitter().unregister_buffers();
    }
}

impl DataLink for UringDataLink {
    fn send(&mut self, header: &FrameHeader, payload: &[u8]) -> Result<(), TransportError> {
        self.eng.check_usable()?;
        let head = header.encode();
        let seal = self.sealer.seal(&[&head, payload]);
        let total = HEADER_LEN + payload.len() + SEAL_LEN;
        if payload.len() < self.zc_threshold && total <= self.sbuf.len() {
            let p_end = HEADER_LEN + payload.len();
            self.sbuf[..HEADER_LEN].copy_from_slice(&head);
            self.sbuf[HEADER_LEN..p_end].copy_from_slice(payload);
            self.sbuf[p_end..total].copy_from_slice(&seal);
            self.write_small(total)?;
        } else {
            self.write_large(&head, payload, &seal)?;
        }
        self.counters.sent(total);
        Ok(())
    }

    fn recv(&mut self, buf: &mut Vec<u8>) -> Result<FrameHeader, TransportError> {
        self.eng.check_usable()?;
        let mut head = [0u8; HEADER_LEN];
        self.read_exact(&mut head)?;
        let h = FrameHeader::decode(&head, self.max_payload)?;
        buf.clear();
        buf.resize(h.len as usize, 0);
        let mut seal = [0u8; SEAL_LEN];
        let read = self
            .read_exact(buf)
            .and_then(|()| self.read_exact(&mut seal));
        finish_stream_frame(read, h, &head, buf, &seal, &mut self.opener, &self.counters)
    }

    fn recv_timeout(
        &mut self,
        buf: &mut Vec<u8>,
        timeout: Duration,
    ) -> Result<Option<FrameHeader>, TransportError> {
        self.eng.check_usable()?;
        if self.rpos == self.rend {
            self.rpos = 0;
            self.rend = 0;
            // Clamped: a timespec's seconds are signed.
            let t = timeout.clamp(
                Duration::from_millis(1),
                Duration::from_secs(u32::MAX.into()),
            );
            let ts = types::Timespec::from(t);
            let ops = [
                Op::ReadFixed {
                    ptr: self.rbuf.as_mut_ptr(),
                    len: self.rbuf.len(),
                },
                Op::LinkTimeout { ts: &ts },
            ];
            // SAFETY: the read points into the registered receive buffer, owned by `self`;
            // `ts` lives on this frame until `run` has reaped both completions.
            let res = unsafe { self.eng.run(&ops) }?;
            match res[0] {
                0 => return Err(TransportError::Closed),
                r if r > 0 => self.rend = r as usize,
                // Cancelled by the timeout, or interrupted: nothing arrived.
                r if r == -libc::ECANCELED || retryable(r) => return Ok(None),
                r => return Err(os_error(r)),
            }
        }
        self.recv(buf).map(Some)
    }

    fn closer(&self) -> Result<LinkCloser, TransportError> {
        Ok(LinkCloser::for_stream(self.eng.stream.try_clone()?))
    }

    fn counters(&self) -> Arc<LinkCounters> {
        Arc::clone(&self.counters)
    }

    fn transport(&self) -> TransportKind {
        TransportKind::Uring
    }
}
