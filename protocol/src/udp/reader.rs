//! Reading a reliable UDP link's socket and running its timers: one `Reader` step at a time,
//! taken by the owner while it waits inside the link, else by the link's I/O thread
//! (`io_thread`), which stands aside while the owner reads.

use super::rx::DataOutcome;
use super::shared::{lock, Shared};
use super::socket::{recv_now, wait_readable};
use super::tx::Resends;
use super::wire::{probe_bytes, Datagram, Malformed, PROBE_LEN};
use super::{End, DRAIN_MAX, GRACE, MAX_ASIDE};
use crate::seal::{DatagramOpener, SealError, SEAL_LEN};
use crate::transport::LinkCounters;
use std::io::{self, Read};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The receiving side's own state, used by whichever thread reads.
pub(super) struct Reader {
    opener: DatagramOpener,
    /// The owner is the one reading now (inside `recv`).
    owner: bool,
    resends: Resends,
    scratch: Vec<u8>,
    ack: Vec<u8>,
    buf: Vec<u8>,
}

impl Reader {
    pub(super) fn new(opener: DatagramOpener) -> Reader {
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
    pub(super) fn step(
        &mut self,
        sh: &Shared,
        anchor_ready: bool,
        owner: bool,
    ) -> Result<bool, End> {
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
                Err(e) => return Err(End::failed("receiving a datagram", &e)),
            }
        }
        if let Some(dev) = &sh.kmod {
            more |= self.drain_kmod(sh, dev)?;
        }
        if anchor_ready {
            check_anchor(sh)?;
        }
        self.on_timers(sh, Instant::now())?;
        Ok(more)
    }

    /// Takes the data datagrams the kernel module stored (each checked like one read from
    /// the socket) and releases the banks of frames that need nothing more. `Ok(true)`: more
    /// arrived meanwhile.
    fn drain_kmod(&mut self, sh: &Shared, dev: &crate::kmod::Device) -> Result<bool, End> {
        // Each datagram is checked (its seal first) and copied into its frame in place.
        let r = dev.drain(
            |d| self.on_datagram(sh, d),
            |frame| lock(&sh.rx).frame_settled(frame),
        );
        match r {
            Ok(_) => Ok(dev.pending()),
            Err(e) => Err(End::failed(
                "taking datagrams from the kernel module",
                &e.into(),
            )),
        }
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
        let malformed = |m: Malformed| {
            LinkCounters::bump(&counters.malformed);
            tracing::debug!("dropped a malformed UDP datagram: {m}");
        };
        let datagram = match Datagram::parse(covered) {
            Ok(d) => d,
            Err(m) => return malformed(m),
        };
        match datagram {
            Datagram::Data { hdr: h, data } => {
                let mut rx = lock(&sh.rx);
                match rx.on_data(&h, data, sh.max_payload, sh.cfg.recv_buffer as u64) {
                    DataOutcome::Stored => {}
                    DataOutcome::Refused { now } => {
                        drop(rx);
                        malformed(Malformed::Undeliverable(h.frame));
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
                    DataOutcome::Malformed(m) => malformed(m),
                }
            }
            Datagram::Ack { hdr: a, bitmap } => {
                self.resends.clear();
                let mut tx = lock(&sh.tx);
                if let Err(m) =
                    tx.ack_arrived(&a, bitmap, now, &sh.cfg, counters, &mut self.resends)
                {
                    drop(tx);
                    malformed(m);
                }
                if let Err(e) = sh.send_resends(&self.resends, &mut self.scratch) {
                    tracing::debug!("retransmission failed: {e}");
                }
            }
            Datagram::Probe => lock(&sh.rx).on_probe(),
        }
    }

    fn on_timers(&mut self, sh: &Shared, now: Instant) -> Result<(), End> {
        let cfg = &sh.cfg;
        // Acknowledgements.
        let due = lock(&sh.rx).ack_due(now, cfg, &mut self.ack);
        if due {
            sh.send_sealed(&[&self.ack[..]], &mut self.scratch)
                .map_err(|e| End::failed("sending an ack", &e))?;
        }
        // Retransmissions, probes, the peer timeout, lingering.
        self.resends.clear();
        let last_heard = sh.last_heard();
        let probe = lock(&sh.tx).tick(now, last_heard, cfg, &sh.counters, &mut self.resends)?;
        sh.send_resends(&self.resends, &mut self.scratch)
            .map_err(|e| End::failed("retransmitting", &e))?;
        if probe {
            sh.send_sealed(&[&probe_bytes()[..]], &mut self.scratch)
                .map_err(|e| End::failed("sending a probe", &e))?;
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
            Err(e) => return Err(End::PeerReset(Arc::new(e))),
        }
    }
}

pub(super) fn io_thread(sh: Arc<Shared>, anchor: TcpStream) {
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
        let [_, anchor_ready, _] = match wait_readable(
            [sh.sock.as_raw_fd(), anchor.as_raw_fd(), sh.kmod_fd()],
            timeout,
        ) {
            Ok(r) => r,
            Err(e) => return End::failed("waiting for datagrams", &e),
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
