//! An in-memory sender ↔ receiver pair for the reliable UDP state machines, on a virtual
//! clock: the sender's `Tx` and the receiver's `Rx` exchange datagrams through two simulated
//! one-way paths instead of sockets, and time is a value the test moves forward, so loss,
//! reordering and retransmission timeouts are exact and instant to test. Seals are left out
//! (they are checked before the state machines see a datagram; `seal` has its own tests).
//!
//! The driving code mirrors `link` and `reader`: cutting frames into chunks while the
//! congestion window and the peer's receive window allow, acknowledging when due, running
//! the sender's timers, and taking complete frames in order.

use super::rx::{DataOutcome, Rx};
use super::socket::chunks_per_send;
use super::tx::{OutFrame, Resends, Tx};
use super::wire::{probe_bytes, Datagram};
use super::{End, UdpConfig, FRAME_OVERHEAD};
use crate::frame::{Dtype, FrameHeader, FrameKind, HEADER_LEN};
use crate::transport::LinkCounters;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A small deterministic generator (xorshift64*), so a failing case replays exactly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// True with probability `p`.
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 > 1.0 - p
    }
}

/// What a path does to a datagram: `Some(delay)` delivers it after `delay`, `None` loses it.
type Fate = Box<dyn FnMut(&Datagram<'_>, &mut Rng) -> Option<Duration>>;

/// One direction of the simulated network.
struct Path {
    /// Datagrams in flight: when each arrives, and its bytes.
    queue: Vec<(Instant, Vec<u8>)>,
    fate: Fate,
    sent: usize,
    lost: usize,
}

impl Path {
    fn new(fate: Fate) -> Path {
        Path {
            queue: Vec::new(),
            fate,
            sent: 0,
            lost: 0,
        }
    }

    fn send(&mut self, now: Instant, bytes: Vec<u8>, rng: &mut Rng) {
        self.sent += 1;
        let d = Datagram::parse(&bytes).expect("the state machines send well-formed datagrams");
        match (self.fate)(&d, rng) {
            Some(delay) => self.queue.push((now + delay, bytes)),
            None => self.lost += 1,
        }
    }

    /// The datagrams due by `now`, in arrival order (equal times keep their sending order).
    fn due(&mut self, now: Instant) -> Vec<Vec<u8>> {
        let (due, later): (Vec<_>, Vec<_>) = self.queue.drain(..).partition(|(t, _)| *t <= now);
        self.queue = later;
        let mut due = due;
        due.sort_by_key(|(t, _)| *t);
        due.into_iter().map(|(_, b)| b).collect()
    }
}

/// Delivers every datagram after `latency`.
fn clean(latency: Duration) -> Fate {
    Box::new(move |_, _| Some(latency))
}

/// A frame waiting to be sent, or being cut into chunks (`next`: its first chunk not yet in
/// flight; `frame`: its sequence number once started).
struct Pending {
    head: [u8; HEADER_LEN],
    payload: Vec<u8>,
    frame: Option<u64>,
    next: usize,
}

/// A sender and a receiver over two simulated paths, on a virtual clock.
struct Pair {
    cfg: UdpConfig,
    now: Instant,
    rng: Rng,
    tx: Tx,
    rx: Rx,
    to_rx: Path,
    to_tx: Path,
    pending: VecDeque<Pending>,
    /// When the sender last heard from the receiver.
    last_heard: Instant,
    tx_counters: LinkCounters,
    rx_counters: LinkCounters,
    max_payload: u32,
    /// Frames the receiver took, in order.
    taken: Vec<(FrameHeader, Vec<u8>)>,
    /// The receiver's application takes frames (a stalled one stops the sender's window).
    taking: bool,
    resends: Resends,
    ack: Vec<u8>,
}

impl Pair {
    fn new(cfg: UdpConfig, to_rx: Fate, to_tx: Fate) -> Pair {
        let cfg = cfg.checked().expect("a valid configuration");
        let now = Instant::now();
        Pair {
            tx: Tx::new(&cfg),
            rx: Rx::new(),
            cfg,
            now,
            rng: Rng(0x9e37_79b9_7f4a_7c15),
            to_rx: Path::new(to_rx),
            to_tx: Path::new(to_tx),
            pending: VecDeque::new(),
            last_heard: now,
            tx_counters: LinkCounters::default(),
            rx_counters: LinkCounters::default(),
            max_payload: 1 << 20,
            taken: Vec::new(),
            taking: true,
            resends: Resends::default(),
            ack: Vec::new(),
        }
    }

    /// Queues a frame of `len` bytes of payload (a pattern that differs per frame).
    fn queue_frame(&mut self, len: usize) {
        let seq = self.pending.len() as u64 + self.taken.len() as u64 + 1;
        let payload: Vec<u8> = (0..len).map(|i| (i as u64 * 31 + seq * 7) as u8).collect();
        let h = FrameHeader::new(FrameKind::Hidden, Dtype::F16, seq, 0, 1, 0, &payload)
            .expect("a valid frame");
        self.pending.push_back(Pending {
            head: h.encode(),
            payload,
            frame: None,
            next: 0,
        });
    }

    /// What `send` does up to where it would wait: starts frames the peer's window admits
    /// and puts chunks in flight while the congestion window has room.
    fn pump_sender(&mut self) {
        let cs = self.cfg.chunk_payload;
        let per_send = chunks_per_send(cs);
        while let Some(p) = self.pending.front_mut() {
            let total = HEADER_LEN + p.payload.len();
            let count = total.div_ceil(cs);
            let frame = match p.frame {
                Some(f) => f,
                None => {
                    let cost = total as u64 + FRAME_OVERHEAD;
                    if !self.tx.frame_fits(cost) {
                        self.tx.window_shut(self.now);
                        return;
                    }
                    *p.frame.insert(self.tx.start_frame(cost))
                }
            };
            let out = OutFrame {
                head: &p.head,
                payload: &p.payload,
                frame,
                chunk: cs,
                count,
                total: total as u32,
            };
            while p.next < count {
                let n = self.tx.room(&self.cfg).min(count - p.next).min(per_send);
                if n == 0 {
                    return;
                }
                let first = self.tx.enqueue(&out, p.next, n, self.now);
                for k in p.next..p.next + n {
                    let mut d = out.hdr(k, first + (k - p.next) as u64).to_vec();
                    for part in out.bytes(k) {
                        d.extend_from_slice(part);
                    }
                    self.to_rx.send(self.now, d, &mut self.rng);
                }
                p.next += n;
            }
            self.pending.pop_front();
        }
    }

    /// The receiver's side of `Reader::on_datagram`.
    fn receiver_gets(&mut self, d: &[u8]) {
        match Datagram::parse(d).expect("well-formed") {
            Datagram::Data { hdr, data } => {
                match self
                    .rx
                    .on_data(&hdr, data, self.max_payload, self.cfg.recv_buffer as u64)
                {
                    DataOutcome::Duplicate => LinkCounters::bump(&self.rx_counters.duplicates),
                    DataOutcome::Malformed(m) => panic!("the sender sent a malformed chunk: {m}"),
                    DataOutcome::Refused { .. } => panic!(
                        "the sender sent an undeliverable frame: {:?}",
                        self.rx.poison
                    ),
                    DataOutcome::Stored | DataOutcome::Deliverable => {}
                }
            }
            Datagram::Probe => self.rx.on_probe(),
            Datagram::Ack { .. } => panic!("the sender sends no acks in this harness"),
        }
    }

    /// The sender's side of `Reader::on_datagram`: an ack, and what it makes it resend.
    fn sender_gets(&mut self, d: &[u8]) {
        self.last_heard = self.now;
        let Ok(Datagram::Ack { hdr, bitmap }) = Datagram::parse(d) else {
            panic!("the receiver sends only acks");
        };
        self.resends.clear();
        self.tx
            .ack_arrived(
                &hdr,
                bitmap,
                self.now,
                &self.cfg,
                &self.tx_counters,
                &mut self.resends,
            )
            .expect("the receiver's acks make sense");
        self.send_resends();
    }

    fn send_resends(&mut self) {
        let mut from = 0;
        for (h, &end) in self.resends.hdrs.iter().zip(&self.resends.ends) {
            let mut d = h.to_vec();
            d.extend_from_slice(&self.resends.data[from..end]);
            from = end;
            self.to_rx.send(self.now, d, &mut self.rng);
        }
    }

    /// What `recv` does with complete frames: takes them in order and answers a probe with
    /// a window update.
    fn take_frames(&mut self) {
        if !self.taking {
            return;
        }
        loop {
            let mut buf = Vec::new();
            let Some(h) = self.rx.take_complete(&mut buf) else {
                break;
            };
            h.verify(&buf).expect("an intact frame");
            if self.rx.update_wanted {
                self.rx.update_wanted = false;
                self.rx
                    .build_ack(self.cfg.recv_buffer as u64, &mut self.ack);
                let ack = self.ack.clone();
                self.to_tx.send(self.now, ack, &mut self.rng);
            }
            self.taken.push((h, buf));
        }
    }

    /// One step of `step`: arrivals at both ends, the receiver's acks, the sender's timers.
    /// `Err`: the sender's link ended.
    fn turn(&mut self) -> Result<(), End> {
        self.pump_sender();
        for d in self.to_rx.due(self.now) {
            self.receiver_gets(&d);
        }
        self.take_frames();
        if self.rx.ack_due(self.now, &self.cfg, &mut self.ack) {
            let ack = self.ack.clone();
            self.to_tx.send(self.now, ack, &mut self.rng);
        }
        for d in self.to_tx.due(self.now) {
            self.sender_gets(&d);
        }
        self.resends.clear();
        let probe = self.tx.tick(
            self.now,
            self.last_heard,
            &self.cfg,
            &self.tx_counters,
            &mut self.resends,
        )?;
        self.send_resends();
        if probe {
            self.to_rx
                .send(self.now, probe_bytes().to_vec(), &mut self.rng);
        }
        Ok(())
    }

    /// Runs turns `step` apart until `done` (`Some(time it took)`) or until `limit` of
    /// virtual time passed (`None`). `Err`: the sender's link ended.
    fn run(
        &mut self,
        step: Duration,
        limit: Duration,
        mut done: impl FnMut(&Pair) -> bool,
    ) -> Result<Option<Duration>, End> {
        let start = self.now;
        while !done(self) {
            if self.now - start >= limit {
                return Ok(None);
            }
            self.turn()?;
            self.now += step;
        }
        Ok(Some(self.now - start))
    }

    /// Runs until `n` frames were taken (within `limit`); the time it took.
    fn deliver(&mut self, n: usize, limit: Duration) -> Duration {
        let took = self
            .run(Duration::from_micros(100), limit, |p| p.taken.len() >= n)
            .unwrap_or_else(|e| panic!("the link ended: {e}"));
        took.unwrap_or_else(|| {
            panic!(
                "not done after {limit:?} of virtual time: {} of {} frames taken, {} chunks \
                 unacknowledged, {} datagrams lost",
                self.taken.len(),
                n,
                self.tx.unacked,
                self.to_rx.lost + self.to_tx.lost
            )
        })
    }

    /// Every frame taken is the one sent, in order.
    fn check_taken(&self, lens: &[usize]) {
        assert_eq!(self.taken.len(), lens.len());
        for (i, ((h, buf), &len)) in self.taken.iter().zip(lens).enumerate() {
            let seq = i as u64 + 1;
            assert_eq!(h.seq, seq);
            assert_eq!(buf.len(), len);
            assert!(buf
                .iter()
                .enumerate()
                .all(|(j, &b)| b == (j as u64 * 31 + seq * 7) as u8));
        }
    }

    fn retransmits(&self) -> u64 {
        self.tx_counters.retransmits.load(Ordering::Relaxed)
    }
}

fn small_chunks() -> UdpConfig {
    UdpConfig {
        chunk_payload: 200,
        ..UdpConfig::default()
    }
}

const MS: Duration = Duration::from_millis(1);
const LATENCY: Duration = Duration::from_micros(200);

#[test]
fn frames_arrive_whole_and_in_order_without_loss() {
    let mut p = Pair::new(small_chunks(), clean(LATENCY), clean(LATENCY));
    // One chunk, exactly one chunk, a chunk and a byte, many chunks.
    let lens = [10_000, 1, 200 - HEADER_LEN, 201 - HEADER_LEN, 50_000];
    for &l in &lens {
        p.queue_frame(l);
    }
    p.deliver(lens.len(), 100 * MS);
    p.check_taken(&lens);
    assert_eq!(p.retransmits(), 0);
    assert_eq!(p.rx_counters.duplicates.load(Ordering::Relaxed), 0);
    // Every chunk was acknowledged, and the timer stopped.
    let acked = p.run(Duration::from_micros(100), 10 * MS, |p| p.tx.unacked == 0);
    assert!(matches!(acked, Ok(Some(_))), "{acked:?}");
    assert_eq!(p.tx.timer_deadline(&p.cfg), None);
}

#[test]
fn a_lost_chunk_with_three_later_ones_acknowledged_is_resent_before_the_timer() {
    // The first transmission of chunk 3 is lost; chunks 4.. arrive.
    let mut lost_once = false;
    let fate: Fate = Box::new(move |d, _| match d {
        Datagram::Data { hdr, .. } if hdr.cseq == 3 && !lost_once => {
            lost_once = true;
            None
        }
        _ => Some(LATENCY),
    });
    let mut p = Pair::new(small_chunks(), fate, clean(LATENCY));
    p.queue_frame(5_000);
    let took = p.deliver(1, 100 * MS);
    p.check_taken(&[5_000]);
    assert_eq!(p.retransmits(), 1);
    // Recovered within a few round trips, long before the first timeout (20 ms).
    assert!(took < p.cfg.initial_rto, "took {took:?}");
    // The loss ended slow start: the threshold came down from its start at max_window.
    assert!(p.tx.ssthresh < p.cfg.max_window as f64);
}

#[test]
fn reordered_chunks_are_reassembled_and_second_copies_dropped() {
    // Each chunk arrives after a random delay of up to 2 ms: a heavily reordered path.
    let fate: Fate = Box::new(|_, rng| Some(LATENCY + Duration::from_micros(rng.next() % 2000)));
    let mut p = Pair::new(small_chunks(), fate, clean(LATENCY));
    let lens = [3_000, 20_000, 7];
    for &l in &lens {
        p.queue_frame(l);
    }
    p.deliver(lens.len(), 200 * MS);
    p.check_taken(&lens);
    // A chunk overtaken by three others looks lost and may be sent twice: the receiver
    // drops the second copy (counted), it never delivers it.
    assert!(p.rx_counters.duplicates.load(Ordering::Relaxed) <= p.retransmits());
}

#[test]
fn a_lost_tail_is_recovered_only_by_the_retransmission_timer() {
    // The frame's last chunk is lost once: nothing after it can reveal the loss.
    let mut lost_once = false;
    let fate: Fate = Box::new(move |d, _| match d {
        Datagram::Data { hdr, .. } if hdr.index + 1 == hdr.count && !lost_once => {
            lost_once = true;
            None
        }
        _ => Some(LATENCY),
    });
    // A fixed timeout (the measured round trip would bring it down to min_rto).
    let rto = 20 * MS;
    let cfg = UdpConfig {
        initial_rto: rto,
        min_rto: rto,
        ..small_chunks()
    };
    let mut p = Pair::new(cfg, fate, clean(LATENCY));
    p.queue_frame(2_000);
    // Not before the timeout...
    let r = p.run(Duration::from_micros(100), rto - MS, |_| false);
    assert!(matches!(r, Ok(None)), "{r:?}");
    assert!(p.taken.is_empty());
    assert_eq!(p.retransmits(), 0);
    // ...but soon after it.
    let took = p.deliver(1, 10 * MS);
    p.check_taken(&[2_000]);
    assert_eq!(p.retransmits(), 1);
    assert!(took < 3 * MS, "took {took:?} more");
}

#[test]
fn the_retransmission_timeout_doubles_per_expiry_up_to_max_rto() {
    // The receiver hears nothing: every expiry resends, each after twice the last wait.
    let mut p = Pair::new(small_chunks(), Box::new(|_, _| None), clean(LATENCY));
    p.queue_frame(100);
    let sent_at = p.now;
    let mut expiries = Vec::new();
    let mut seen = 0;
    let r = p.run(Duration::from_micros(100), 2_000 * MS, |p| {
        if p.retransmits() > seen {
            seen = p.retransmits();
            expiries.push(p.now - sent_at);
        }
        expiries.len() >= 6
    });
    assert!(matches!(r, Ok(Some(_))), "{r:?}");
    let gaps: Vec<Duration> = std::iter::once(expiries[0])
        .chain(expiries.windows(2).map(|w| w[1] - w[0]))
        .collect();
    let (rto, max) = (p.cfg.initial_rto, p.cfg.max_rto);
    for (i, g) in gaps.iter().enumerate() {
        let want = (rto * (1 << i)).min(max);
        // The clock moves in 100 µs steps: an expiry is seen at most one step late.
        assert!(
            *g >= want && *g <= want + Duration::from_micros(200),
            "wait {i} was {g:?}, expected {want:?} (all: {gaps:?})"
        );
    }
    assert_eq!(*gaps.last().unwrap(), max);
}

#[test]
fn silence_from_the_peer_ends_the_link_after_peer_timeout() {
    let mut p = Pair::new(
        UdpConfig {
            peer_timeout: 300 * MS,
            ..small_chunks()
        },
        Box::new(|_, _| None),
        clean(LATENCY),
    );
    p.queue_frame(100);
    let end = p.run(MS, 1_000 * MS, |_| false).unwrap_err();
    assert!(matches!(end, End::TimedOut(d) if d == 300 * MS), "{end:?}");
    assert!(p.now - p.last_heard >= 300 * MS);
}

#[test]
fn random_loss_both_ways_and_reordering_still_deliver_every_frame_intact() {
    // 10% of datagrams lost each way (acks and retransmissions too), delays of 0.2-1.2 ms.
    let lossy = || -> Fate {
        Box::new(|_, rng| {
            if rng.chance(0.10) {
                None
            } else {
                Some(LATENCY + Duration::from_micros(rng.next() % 1000))
            }
        })
    };
    let mut p = Pair::new(small_chunks(), lossy(), lossy());
    let lens: Vec<usize> = (0..30).map(|i| [1, 500, 4_000, 30_000][i % 4]).collect();
    for &l in &lens {
        p.queue_frame(l);
    }
    p.deliver(lens.len(), 10_000 * MS);
    p.check_taken(&lens);
    assert!(p.to_rx.lost > 0 && p.to_tx.lost > 0);
    assert!(p.retransmits() > 0);
    // Every chunk sent was needed, or answered a loss: no more retransmissions than a
    // small multiple of the losses.
    assert!(
        p.retransmits() as usize <= 4 * (p.to_rx.lost + p.to_tx.lost),
        "{} retransmissions for {} losses",
        p.retransmits(),
        p.to_rx.lost + p.to_tx.lost
    );
}

#[test]
fn a_receiver_that_stops_taking_frames_stops_the_sender_and_probes_reopen_it() {
    let mut p = Pair::new(
        UdpConfig {
            chunk_payload: 8_000,
            recv_buffer: 1 << 20,
            ..UdpConfig::default()
        },
        clean(LATENCY),
        clean(LATENCY),
    );
    p.taking = false;
    let lens = [400_000; 5];
    for &l in &lens {
        p.queue_frame(l);
    }
    // The receiver buffers the frame it takes next plus 1 MiB: three frames fit, not four.
    let r = p.run(Duration::from_micros(100), 50 * MS, |_| false);
    assert!(matches!(r, Ok(None)), "{r:?}");
    assert_eq!(p.tx.next_frame - 1, 3);
    assert!(p.tx.probe_at.is_some(), "the sender probes the shut window");
    assert!(p.rx.buffered <= p.cfg.recv_buffer as u64);
    // The application takes frames again: a window update after the next probe lets the
    // rest through.
    p.taking = true;
    p.deliver(lens.len(), 1_000 * MS);
    p.check_taken(&lens);
}
