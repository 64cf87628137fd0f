//! The datagram format of reliable UDP (see the table in the module docs of `udp`): data
//! chunks, acknowledgements and probes, encoded and decoded on byte slices without I/O. The
//! seal that ends every datagram is checked and removed before anything here runs.

use crate::frame::HEADER_LEN;
use crate::seal::SEAL_LEN;
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

const KIND_DATA: u8 = 1;
const KIND_ACK: u8 = 2;
const KIND_PROBE: u8 = 3;
const WIRE_VERSION: u8 = 1;

/// Why an authentic datagram was dropped: its numbers make no sense (counted in
/// `LinkCounters::malformed` and logged at debug level; the link goes on).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    /// Too short to hold a kind and a version.
    #[error("datagram of {0} bytes")]
    Short(usize),
    /// A wire version this build does not speak.
    #[error("wire version {0}")]
    Version(u8),
    /// An unknown kind, or a known kind of the wrong length.
    #[error("datagram kind {kind} of {len} bytes")]
    Kind { kind: u8, len: usize },
    /// A chunk size outside `MIN_CHUNK..=MAX_CHUNK`.
    #[error("chunk size {0} outside {MIN_CHUNK}..={MAX_CHUNK}")]
    ChunkSize(u64),
    /// A frame too short to hold its own frame header.
    #[error("frame of {0} bytes is shorter than its header")]
    ShortFrame(u64),
    /// The chunk count disagrees with the frame's size and the chunk size.
    #[error("{count} chunks for a frame of {total} bytes in chunks of {chunk_size}")]
    ChunkCount {
        count: u32,
        total: u64,
        chunk_size: u64,
    },
    /// A chunk index at or past the chunk count.
    #[error("chunk {index} of {count}")]
    ChunkIndex { index: u32, count: u32 },
    /// Frame 0, or a chunk sequence number too small for the chunk's index.
    #[error("frame {frame} chunk sequence {cseq} for chunk {index}")]
    Sequence { frame: u64, cseq: u64, index: u32 },
    /// The chunk's bytes disagree with the size its numbers give.
    #[error("chunk {index} of frame {frame} carries {len} bytes, its numbers say {want}")]
    ChunkLength {
        index: u32,
        frame: u64,
        len: usize,
        want: usize,
    },
    /// A chunk further ahead than the receiver tracks.
    #[error("chunk {cseq} is beyond the window (every chunk below {cum} arrived)")]
    BeyondWindow { cseq: u64, cum: u64 },
    /// A chunk whose frame numbers differ from earlier chunks of the same frame.
    #[error("chunk {index} of frame {frame} disagrees with earlier chunks of it")]
    Disagrees { index: u32, frame: u64 },
    /// A frame the receive buffer has no room for (the sender ignored the advertised window).
    #[error(
        "frame {frame} of {total} bytes overflows the receive buffer ({used} of {cap} bytes used)"
    )]
    Overflow {
        frame: u64,
        total: u32,
        used: u64,
        cap: u64,
    },
    /// An ack shorter than an ack header.
    #[error("ack of {0} bytes")]
    ShortAck(usize),
    /// An ack whose length disagrees with the bitmap size it states (or a bitmap too long).
    #[error("ack of {len} bytes says its bitmap has {bitmap}")]
    AckLength { len: usize, bitmap: usize },
    /// An ack of chunks never sent (its cumulative point).
    #[error("ack up to chunk {cum} when {sent} were sent")]
    AckBeyondSent { cum: u64, sent: u64 },
    /// An ack saying the peer's application takes a frame never sent.
    #[error("peer takes frame {next_take} next when {sent} were sent")]
    TakeBeyondSent { next_take: u64, sent: u64 },
    /// An ack's bitmap names a chunk never sent.
    #[error("ack for chunk {cseq} when {sent} were sent")]
    SackBeyondSent { cseq: u64, sent: u64 },
    /// A frame that cannot be delivered (over the payload cap, or a bad frame header); the
    /// receiver's `recv` reports why when it reaches the frame.
    #[error("frame {0} cannot be delivered")]
    Undeliverable(u64),
}

/// A data datagram's header: which bytes of which frame its chunk carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataHdr {
    /// Frame bytes in every chunk of the frame but the last.
    pub chunk_size: u32,
    pub index: u32,
    /// Chunks of the frame: `ceil(total / chunk_size)`.
    pub count: u32,
    /// Frame bytes: the frame header plus the payload.
    pub total: u32,
    /// Frame sequence number (1, 2, …).
    pub frame: u64,
    /// Chunk sequence number (1, 2, … across frames; what acknowledgements refer to).
    pub cseq: u64,
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
    pub fn encode(&self) -> [u8; DATA_HEADER_LEN] {
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
    pub(super) fn decode(b: &[u8]) -> DataHdr {
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
    pub fn check(&self) -> Result<usize, Malformed> {
        let cs = self.chunk_size as u64;
        if !(MIN_CHUNK as u64..=MAX_CHUNK as u64).contains(&cs) {
            return Err(Malformed::ChunkSize(cs));
        }
        let total = self.total as u64;
        if total < HEADER_LEN as u64 {
            return Err(Malformed::ShortFrame(total));
        }
        if self.count as u64 != total.div_ceil(cs) {
            return Err(Malformed::ChunkCount {
                count: self.count,
                total,
                chunk_size: cs,
            });
        }
        if self.index >= self.count {
            return Err(Malformed::ChunkIndex {
                index: self.index,
                count: self.count,
            });
        }
        if self.frame == 0 || self.cseq <= self.index as u64 {
            return Err(Malformed::Sequence {
                frame: self.frame,
                cseq: self.cseq,
                index: self.index,
            });
        }
        let start = self.index as u64 * cs;
        Ok((total - start).min(cs) as usize)
    }
}

/// An acknowledgement's header (its bitmap follows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AckHdr {
    /// Every chunk sequence number below this one arrived.
    pub cum: u64,
    /// The frame sequence number the receiving application takes next.
    pub next_take: u64,
    /// Receive buffer: bytes of frames the receiver holds beyond `next_take`'s.
    pub cap: u64,
}

pub(super) fn ack_header(a: &AckHdr, bitmap_bytes: usize) -> [u8; ACK_HEADER_LEN] {
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
pub fn parse_ack(b: &[u8]) -> Result<(AckHdr, &[u8]), Malformed> {
    if b.len() < ACK_HEADER_LEN {
        return Err(Malformed::ShortAck(b.len()));
    }
    let n = u16_at(b, 2) as usize;
    if b.len() != ACK_HEADER_LEN + n || n as u64 > MAX_ACK_BITS / 8 {
        return Err(Malformed::AckLength {
            len: b.len(),
            bitmap: n,
        });
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

pub(super) fn probe_bytes() -> [u8; PROBE_LEN] {
    let mut b = [0u8; PROBE_LEN];
    b[0] = KIND_PROBE;
    b[1] = WIRE_VERSION;
    b
}

/// What an authentic datagram says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Datagram<'a> {
    /// A chunk of a frame (its numbers not yet checked: `DataHdr::check`).
    Data { hdr: DataHdr, data: &'a [u8] },
    /// An acknowledgement and its bitmap (bit j: chunk `cum + 1 + j` arrived).
    Ack { hdr: AckHdr, bitmap: &'a [u8] },
    /// A probe of a closed receive window (answered by an ack).
    Probe,
}

impl<'a> Datagram<'a> {
    /// Reads the bytes a datagram's seal covered (the seal checked and removed).
    pub fn parse(covered: &'a [u8]) -> Result<Datagram<'a>, Malformed> {
        if covered.len() < 2 {
            return Err(Malformed::Short(covered.len()));
        }
        if covered[1] != WIRE_VERSION {
            return Err(Malformed::Version(covered[1]));
        }
        match covered[0] {
            KIND_DATA if covered.len() >= DATA_HEADER_LEN => Ok(Datagram::Data {
                hdr: DataHdr::decode(covered),
                data: &covered[DATA_HEADER_LEN..],
            }),
            KIND_ACK => {
                let (hdr, bitmap) = parse_ack(covered)?;
                Ok(Datagram::Ack { hdr, bitmap })
            }
            KIND_PROBE if covered.len() == PROBE_LEN => Ok(Datagram::Probe),
            kind => Err(Malformed::Kind {
                kind,
                len: covered.len(),
            }),
        }
    }
}

/// The frame bytes `start..end` (the frame being `head` then `payload`) as two slices.
pub(super) fn frame_range<'a>(
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
        assert_eq!(
            Datagram::parse(&b),
            Ok(Datagram::Data {
                hdr: h,
                data: &[][..]
            })
        );
    }

    #[test]
    fn parse_refuses_short_unknown_and_foreign_datagrams() {
        assert_eq!(Datagram::parse(&[1]), Err(Malformed::Short(1)));
        assert_eq!(Datagram::parse(&[1, 9, 0, 0]), Err(Malformed::Version(9)));
        assert_eq!(
            Datagram::parse(&[1, WIRE_VERSION, 0, 0]),
            Err(Malformed::Kind { kind: 1, len: 4 })
        );
        assert_eq!(Datagram::parse(&probe_bytes()), Ok(Datagram::Probe));
        let mut long_probe = probe_bytes().to_vec();
        long_probe.push(0);
        assert!(Datagram::parse(&long_probe).is_err());
        let ack = ack_header(
            &AckHdr {
                cum: 5,
                next_take: 2,
                cap: 1 << 20,
            },
            1,
        );
        let mut b = ack.to_vec();
        assert_eq!(
            Datagram::parse(&b),
            Err(Malformed::AckLength {
                len: ACK_HEADER_LEN,
                bitmap: 1
            })
        );
        b.push(0b101);
        assert!(matches!(
            Datagram::parse(&b),
            Ok(Datagram::Ack { hdr, bitmap: [0b101] }) if hdr.cum == 5 && hdr.next_take == 2
        ));
    }
}
