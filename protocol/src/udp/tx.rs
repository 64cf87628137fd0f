//! The sending direction of a reliable UDP link as a state machine: chunks in flight, the
//! congestion window, round-trip estimates, the retransmission timer, the peer's receive
//! window and probes of it. No I/O and no clock: every step takes the time as `now`, and
//! what must be sent goes into a `Resends` for the caller to seal and send.

use super::wire::{frame_range, AckHdr, DataHdr, Malformed, DATA_HEADER_LEN};
use super::{End, UdpConfig, DUP_THRESH, FIRST_PROBE, MAX_PROBE, MIN_RECV_BUFFER};
use crate::frame::HEADER_LEN;
use crate::transport::LinkCounters;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

pub(super) struct TxChunk {
    pub(super) hdr: [u8; DATA_HEADER_LEN],
    pub(super) data: Vec<u8>,
    pub(super) sent_at: Instant,
    pub(super) sends: u32,
    pub(super) acked: bool,
}

/// A frame being cut into chunks: its encoded header, its payload and its numbering.
pub(super) struct OutFrame<'a> {
    pub(super) head: &'a [u8; HEADER_LEN],
    pub(super) payload: &'a [u8],
    pub(super) frame: u64,
    /// Frame bytes per chunk (`UdpConfig::chunk_payload`).
    pub(super) chunk: usize,
    pub(super) count: usize,
    pub(super) total: u32,
}

impl OutFrame<'_> {
    /// Chunk `k`'s datagram header, as chunk sequence number `cseq`.
    pub(super) fn hdr(&self, k: usize, cseq: u64) -> [u8; DATA_HEADER_LEN] {
        DataHdr {
            chunk_size: self.chunk as u32,
            index: k as u32,
            count: self.count as u32,
            total: self.total,
            frame: self.frame,
            cseq,
        }
        .encode()
    }

    /// Chunk `k`'s frame bytes, as two slices (header part, payload part).
    pub(super) fn bytes(&self, k: usize) -> [&[u8]; 2] {
        let start = k * self.chunk;
        let end = (start + self.chunk).min(self.total as usize);
        frame_range(self.head, self.payload, start, end)
    }
}

/// Chunks to send again, copied out of the lock.
#[derive(Default)]
pub(super) struct Resends {
    pub(super) hdrs: Vec<[u8; DATA_HEADER_LEN]>,
    pub(super) data: Vec<u8>,
    pub(super) ends: Vec<usize>,
}

impl Resends {
    pub(super) fn push(&mut self, c: &TxChunk) {
        self.hdrs.push(c.hdr);
        self.data.extend_from_slice(&c.data);
        self.ends.push(self.data.len());
    }
    pub(super) fn clear(&mut self) {
        self.hdrs.clear();
        self.data.clear();
        self.ends.clear();
    }
}

/// The sending direction.
pub(super) struct Tx {
    pub(super) next_frame: u64,
    pub(super) next_cseq: u64,
    /// Chunk sequence number of `flight[0]` (`next_cseq` when empty).
    pub(super) base: u64,
    pub(super) flight: VecDeque<TxChunk>,
    /// Entries of `flight` not yet acknowledged.
    pub(super) unacked: usize,
    pub(super) cwnd: f64,
    pub(super) ssthresh: f64,
    /// Losses of chunks below this were already answered by a window cut.
    pub(super) recover: u64,
    pub(super) srtt: Option<Duration>,
    pub(super) rttvar: Duration,
    pub(super) rto: Duration,
    /// The retransmission timer runs from here while chunks are unacknowledged: set when
    /// the first goes out, restarted by every ack of new chunks and by every expiry.
    pub(super) timer_start: Option<Instant>,
    /// Expiries since the last progress (each doubles the timeout).
    pub(super) timeouts: u32,
    pub(super) peer_next_take: u64,
    pub(super) peer_cap: u64,
    /// Frames sent that the peer's application has not taken: (frame, cost).
    pub(super) window_frames: VecDeque<(u64, u64)>,
    pub(super) window_cost: u64,
    /// Since when we have been waiting for the peer (unacknowledged chunks or a closed
    /// receive window), for `peer_timeout`.
    pub(super) waiting_since: Option<Instant>,
    /// The owner waits for the peer's receive window: probe at this time.
    pub(super) probe_at: Option<Instant>,
    pub(super) probe_interval: Duration,
    /// The owner dropped the link: linger until everything is acknowledged or this time.
    pub(super) linger_until: Option<Instant>,
    pub(super) end: Option<End>,
    pub(super) pool: Vec<Vec<u8>>,
}

impl Tx {
    pub(super) fn new(cfg: &UdpConfig) -> Tx {
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
    pub(super) fn frame_fits(&self, cost: u64) -> bool {
        // The peer buffers frames beyond the one its application takes next, which it
        // always admits: that is the first of `window_frames` (or a later one).
        match self.window_frames.front() {
            None => true,
            Some(&(_, first)) => self.window_cost - first + cost <= self.peer_cap,
        }
    }

    /// The owner found the peer's receive window shut at `now`: start probing it (unless
    /// already).
    pub(super) fn window_shut(&mut self, now: Instant) {
        if self.probe_at.is_none() {
            self.probe_at = Some(now + FIRST_PROBE);
            self.probe_interval = FIRST_PROBE;
            self.waiting_since.get_or_insert(now);
        }
    }

    /// A frame costing `cost` fits the peer's window: stop probing, number the frame and
    /// count it in the window. Returns its frame sequence number.
    pub(super) fn start_frame(&mut self, cost: u64) -> u64 {
        if self.probe_at.take().is_some() && self.unacked == 0 {
            self.waiting_since = None;
        }
        let frame = self.next_frame;
        self.next_frame += 1;
        self.window_frames.push_back((frame, cost));
        self.window_cost += cost;
        frame
    }

    /// Puts chunks `from..from + n` of `f` in flight, sent at `now` (the caller seals and
    /// sends them). Returns the first one's chunk sequence number.
    pub(super) fn enqueue(&mut self, f: &OutFrame<'_>, from: usize, n: usize, now: Instant) -> u64 {
        if self.unacked == 0 {
            self.waiting_since = Some(now);
            self.timer_start = Some(now);
            self.timeouts = 0;
        }
        let first_cseq = self.next_cseq;
        for k in from..from + n {
            let hdr = f.hdr(k, self.next_cseq);
            let mut data = self.pool.pop().unwrap_or_default();
            data.clear();
            for p in f.bytes(k) {
                data.extend_from_slice(p);
            }
            self.flight.push_back(TxChunk {
                hdr,
                data,
                sent_at: now,
                sends: 1,
                acked: false,
            });
            self.next_cseq += 1;
            self.unacked += 1;
        }
        first_cseq
    }

    /// Chunks the owner may put in flight now.
    pub(super) fn room(&self, cfg: &UdpConfig) -> usize {
        let cwnd = (self.cwnd as usize).clamp(1, cfg.max_window);
        let by_cwnd = cwnd.saturating_sub(self.unacked);
        let by_span = (2 * cfg.max_window).saturating_sub(self.flight.len());
        by_cwnd.min(by_span)
    }

    /// When the retransmission timer expires.
    pub(super) fn timer_deadline(&self, cfg: &UdpConfig) -> Option<Instant> {
        let backoff = (self.rto * (1u32 << self.timeouts.min(8))).min(cfg.max_rto);
        self.timer_start.map(|t| t + backoff)
    }

    pub(super) fn on_rtt(&mut self, sample: Duration, cfg: &UdpConfig) {
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

    pub(super) fn on_loss(&mut self, cseq: u64, cfg: &UdpConfig) {
        if cseq >= self.recover {
            self.ssthresh = (self.cwnd / 2.0).max(cfg.min_window as f64);
            self.cwnd = self.ssthresh;
            self.recover = self.next_cseq;
        }
    }

    pub(super) fn on_acked(&mut self, n: usize, cfg: &UdpConfig) {
        for _ in 0..n {
            if self.cwnd < self.ssthresh {
                self.cwnd += 1.0;
            } else {
                self.cwnd += 1.0 / self.cwnd;
            }
        }
        self.cwnd = self.cwnd.min(cfg.max_window as f64);
    }

    pub(super) fn mark_resent(&mut self, i: usize, now: Instant) {
        let c = &mut self.flight[i];
        c.sends += 1;
        c.sent_at = now;
    }

    /// Applies an authentic ack; chunks to send again go to `out`. `Err` for an ack that
    /// cannot be right (it acknowledges chunks or frames never sent).
    pub(super) fn on_ack(
        &mut self,
        a: &AckHdr,
        bitmap: &[u8],
        now: Instant,
        cfg: &UdpConfig,
        counters: &LinkCounters,
        out: &mut Resends,
    ) -> Result<bool, Malformed> {
        if a.cum == 0 || a.cum > self.next_cseq {
            return Err(Malformed::AckBeyondSent {
                cum: a.cum,
                sent: self.next_cseq - 1,
            });
        }
        if a.next_take == 0 || a.next_take > self.next_frame {
            return Err(Malformed::TakeBeyondSent {
                next_take: a.next_take,
                sent: self.next_frame - 1,
            });
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
                    return Err(Malformed::SackBeyondSent {
                        cseq,
                        sent: self.next_cseq - 1,
                    });
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

    /// An authentic ack arrived at `now`: applies it (chunks to send again into `out`) and, if
    /// it opened a window while the owner probes, probes again soon only if still shut.
    pub(super) fn ack_arrived(
        &mut self,
        a: &AckHdr,
        bitmap: &[u8],
        now: Instant,
        cfg: &UdpConfig,
        counters: &LinkCounters,
        out: &mut Resends,
    ) -> Result<(), Malformed> {
        let opened = self.on_ack(a, bitmap, now, cfg, counters, out)?;
        if opened && self.probe_at.is_some() {
            // The owner re-checks the window; probe again only if still shut.
            self.probe_interval = FIRST_PROBE;
            self.probe_at = Some(now + FIRST_PROBE);
        }
        Ok(())
    }

    /// The sender's timers at `now`: retransmissions (into `out`), whether a probe is due,
    /// the peer timeout (`last_heard`: when the peer last sent something authentic) and the
    /// end of lingering. `Err`: the link is over.
    pub(super) fn tick(
        &mut self,
        now: Instant,
        last_heard: Instant,
        cfg: &UdpConfig,
        counters: &LinkCounters,
        out: &mut Resends,
    ) -> Result<bool, End> {
        if let Some(e) = &self.end {
            return Err(e.clone());
        }
        self.on_timer(now, cfg, counters, out);
        let mut probe = false;
        if let Some(p) = self.probe_at {
            if p <= now {
                probe = true;
                self.probe_interval = (self.probe_interval * 2).min(MAX_PROBE);
                self.probe_at = Some(now + self.probe_interval);
            }
        }
        if let Some(w) = self.waiting_since {
            let since = w.max(last_heard);
            if now.saturating_duration_since(since) >= cfg.peer_timeout {
                return Err(End::TimedOut(cfg.peer_timeout));
            }
        }
        if let Some(l) = self.linger_until {
            if self.unacked == 0 || now >= l {
                return Err(End::LocalClose);
            }
        }
        Ok(probe)
    }

    /// The sender's nearest timer: retransmission, probe, linger, peer timeout.
    pub(super) fn next_deadline(&self, cfg: &UdpConfig, last_heard: Instant) -> Option<Instant> {
        [
            self.timer_deadline(cfg),
            self.probe_at,
            self.linger_until,
            self.waiting_since
                .map(|w| w.max(last_heard) + cfg.peer_timeout),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// When the retransmission timer expired (no ack of new chunks for a timeout): sends
    /// again every unacknowledged chunk out for at least `rto` (into `out`), at most a
    /// window's worth, and restarts the timer with a doubled timeout.
    pub(super) fn on_timer(
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

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
