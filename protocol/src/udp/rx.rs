//! The receiving direction of a reliable UDP link as a state machine: which chunks arrived,
//! frames being reassembled, the receive window, and acknowledgements. No I/O and no clock:
//! the time comes in as `now`, acks go out as bytes for the caller to seal and send.

use super::wire::{ack_header, AckHdr, DataHdr, Malformed, MAX_ACK_BITS};
use super::{End, UdpConfig, FRAME_OVERHEAD, POOL_MAX, TRACK_BITS};
use crate::error::ProtocolError;
use crate::frame::{FrameHeader, HEADER_LEN, MAX_CONTROL_LEN};
use std::collections::BTreeMap;
use std::time::Instant;

pub(super) struct RxFrame {
    pub(super) total: u32,
    pub(super) chunk_size: u32,
    pub(super) count: u32,
    pub(super) first_cseq: u64,
    pub(super) got: u32,
    pub(super) cost: u64,
    pub(super) head: [u8; HEADER_LEN],
    pub(super) header: Option<FrameHeader>,
    pub(super) payload: Vec<u8>,
}

impl RxFrame {
    pub(super) fn complete(&self) -> bool {
        self.got == self.count && self.header.is_some()
    }
}

/// The receiving direction.
pub(super) struct Rx {
    /// Every chunk sequence number below this arrived.
    pub(super) cum: u64,
    /// Ring of `TRACK_BITS` bits: chunk `c` (`cum <= c < cum + TRACK_BITS`) arrived.
    pub(super) bits: Vec<u64>,
    /// Highest chunk sequence number that arrived (0: none).
    pub(super) highest: u64,
    pub(super) frames: BTreeMap<u64, RxFrame>,
    /// The frame `recv` returns next.
    pub(super) next_take: u64,
    /// Cost of the frames in `frames` other than `next_take`'s.
    pub(super) buffered: u64,
    /// New chunks since the last ack.
    pub(super) unacked: usize,
    pub(super) ack_now: bool,
    pub(super) ack_at: Option<Instant>,
    /// A probe arrived: send a window update when `recv` takes a frame.
    pub(super) update_wanted: bool,
    /// A frame the peer sent that cannot be delivered, reported when `recv` reaches it.
    pub(super) poison: Option<(u64, ProtocolError)>,
    pub(super) end: Option<End>,
    pub(super) pool: Vec<Vec<u8>>,
}

pub(super) enum DataOutcome {
    /// Nothing for `recv` yet.
    Stored,
    /// The frame `recv` waits for is complete (or poisoned).
    Deliverable,
    Duplicate,
    Malformed(Malformed),
    /// The chunk's frame cannot be delivered (over the payload cap, or a bad frame header):
    /// `recv` reports it when it gets there (`now`: that is the next frame).
    Refused {
        now: bool,
    },
}

impl Rx {
    pub(super) fn new() -> Rx {
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

    pub(super) fn bit(&self, c: u64) -> bool {
        let i = c % TRACK_BITS;
        self.bits[(i / 64) as usize] >> (i % 64) & 1 == 1
    }

    pub(super) fn set_bit(&mut self, c: u64, on: bool) {
        let i = c % TRACK_BITS;
        let w = &mut self.bits[(i / 64) as usize];
        if on {
            *w |= 1 << (i % 64);
        } else {
            *w &= !(1 << (i % 64));
        }
    }

    /// Records that chunk `c` arrived and moves the cumulative point.
    pub(super) fn mark(&mut self, c: u64) {
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

    pub(super) fn take_buf(&mut self, len: usize) -> Vec<u8> {
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

    pub(super) fn poison(&mut self, frame: u64, e: ProtocolError) {
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
    pub(super) fn on_data(
        &mut self,
        d: &DataHdr,
        data: &[u8],
        max_payload: u32,
        cap: u64,
    ) -> DataOutcome {
        let max_len = max_payload.max(MAX_CONTROL_LEN) as u64;
        let want = match d.check() {
            Ok(n) => n,
            Err(m) => return DataOutcome::Malformed(m),
        };
        if data.len() != want {
            return DataOutcome::Malformed(Malformed::ChunkLength {
                index: d.index,
                frame: d.frame,
                len: data.len(),
                want,
            });
        }
        if d.cseq < self.cum || d.frame < self.next_take || self.bit(d.cseq) {
            self.ack_now = true;
            return DataOutcome::Duplicate;
        }
        if d.cseq >= self.cum + TRACK_BITS {
            return DataOutcome::Malformed(Malformed::BeyondWindow {
                cseq: d.cseq,
                cum: self.cum,
            });
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
                    return DataOutcome::Malformed(Malformed::Disagrees {
                        index: d.index,
                        frame: d.frame,
                    });
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
                        return DataOutcome::Malformed(Malformed::Overflow {
                            frame: d.frame,
                            total: d.total,
                            used: self.buffered,
                            cap,
                        });
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

    /// Whether frame `frame` needs no more chunks: delivered, complete, refused, or not one
    /// being reassembled (a kernel-module bank holding it can be released).
    pub(super) fn frame_settled(&self, frame: u64) -> bool {
        match self.frames.get(&frame) {
            Some(f) => f.got == f.count,
            None => true,
        }
    }

    /// A probe arrived: ack at once, and send a window update when `recv` takes a frame.
    pub(super) fn on_probe(&mut self) {
        self.ack_now = true;
        self.update_wanted = true;
    }

    /// Builds the ack (into `out`) if one is due at `now` (`true`); otherwise arms the
    /// delayed-ack timer if chunks wait for one.
    pub(super) fn ack_due(&mut self, now: Instant, cfg: &UdpConfig, out: &mut Vec<u8>) -> bool {
        let due =
            self.ack_now || self.unacked >= cfg.ack_every || self.ack_at.is_some_and(|t| t <= now);
        if due {
            self.build_ack(cfg.recv_buffer as u64, out);
        } else if self.unacked > 0 && self.ack_at.is_none() {
            self.ack_at = Some(now + cfg.ack_delay);
        }
        due
    }

    /// Takes the next frame if it is complete: its header, its payload swapped into `buf`
    /// (the caller's old buffer is kept for a later frame). Nothing is checked here.
    pub(super) fn take_complete(&mut self, buf: &mut Vec<u8>) -> Option<FrameHeader> {
        let next = self.next_take;
        let header = match self.frames.get(&next) {
            Some(f) if f.complete() => f.header?,
            _ => return None,
        };
        let f = self.frames.remove(&next)?;
        self.next_take += 1;
        // The frame after it, if buffered, leaves the window's accounting.
        let nt = self.next_take;
        if let Some(c) = self.frames.get(&nt).map(|n| n.cost) {
            self.buffered -= c;
        }
        // Hand the frame over without copying; keep the caller's old buffer for a later one.
        let mut payload = f.payload;
        std::mem::swap(buf, &mut payload);
        if payload.capacity() > 0 && self.pool.len() < POOL_MAX {
            self.pool.push(payload);
        }
        Some(header)
    }

    /// The ack for the current state (into `out`).
    pub(super) fn build_ack(&mut self, cap: u64, out: &mut Vec<u8>) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::udp::wire::{parse_ack, ACK_HEADER_LEN};

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
}
