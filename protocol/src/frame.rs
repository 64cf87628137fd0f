//! Data frames: a fixed 40-byte little-endian header followed by the raw payload bytes.
//!
//! ```text
//! offset size field
//!  0     4    magic      b"RLFR"
//!  4     2    version    FRAME_VERSION
//!  6     1    kind       FrameKind
//!  7     1    dtype      Dtype of the payload elements
//!  8     8    seq        sequence (conversation) id
//! 16     4    pos        position of the first token in the sequence
//! 20     4    n_tokens   tokens in the payload
//! 24     4    len        payload bytes
//! 28     4    flags      FLAG_* bits
//! 32     4    reserved   zero
//! 36     4    crc        CRC32C of header bytes 0..36 followed by the payload
//! ```
//!
//! Control messages travel as frames of kind `Control` whose payload is a bincode message
//! (see `control`), so one connection carries both, in order.

use crate::error::ProtocolError;

pub const FRAME_MAGIC: [u8; 4] = *b"RLFR";
pub const FRAME_VERSION: u16 = 1;
pub const HEADER_LEN: usize = 40;

// Payload caps, one per role. A receiver checks a frame's length against its cap before it
// allocates anything, so a peer cannot make it reserve more than this; the cap is the
// receiver's choice and never travels on the wire.

/// Largest control payload, whatever the link (control messages are assignments, heartbeats,
/// errors: kilobytes; 1 MiB leaves room for a long model or layer list).
pub const MAX_CONTROL_LEN: u32 = 1 << 20;
/// Largest data payload a node accepts, on its data links and its control connection: the
/// activations of a 512-token prefill of a d = 16384 model in f32 (512 × 16384 × 4 bytes).
pub const NODE_MAX_PAYLOAD: u32 = 32 << 20;
/// Largest data payload the coordinator accepts from a node, on its data links and control
/// connections: twice a node's, because what comes back from a ring's last stage may be
/// logits, whose rows (one per vocabulary entry) are longer than activations.
pub const COORDINATOR_MAX_PAYLOAD: u32 = 64 << 20;
/// Cap for tools, tests and benchmarks that are neither a node nor the coordinator (the
/// transport benchmarks' echo servers, the protocol tests): large enough for any frame they
/// send.
pub const DEFAULT_MAX_PAYLOAD: u32 = 256 << 20;

/// Ask the last stage to return the output of every token, not only the last one.
pub const FLAG_ALL_TOKENS: u32 = 1;
/// More frames of the same batch follow: a node runs every frame up to the first one without
/// this flag as one batch, and marks its outputs the same way.
pub const FLAG_MORE: u32 = 2;
/// Bits 8..16: the round of a multi-round ring the frame belongs to (which of the stage's
/// windows runs it).
pub const FLAG_ROUND_MASK: u32 = 0xff00;
pub const FLAG_ROUND_SHIFT: u32 = 8;
/// Every flag this version knows.
pub const KNOWN_FLAGS: u32 = FLAG_ALL_TOKENS | FLAG_MORE | FLAG_ROUND_MASK;

/// The round a frame's flags carry.
pub fn round_of(flags: u32) -> usize {
    ((flags & FLAG_ROUND_MASK) >> FLAG_ROUND_SHIFT) as usize
}

/// `flags` with `round` in its round bits (rounds above 255 cannot be expressed: the planner
/// makes at most a few).
pub fn with_round(flags: u32, round: usize) -> u32 {
    (flags & !FLAG_ROUND_MASK) | (((round.min(255)) as u32) << FLAG_ROUND_SHIFT)
}

/// What a frame carries. Discriminants are part of the wire format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// A bincode control message.
    Control = 1,
    /// Hidden states `[n_tokens × d]`, travelling from stage to stage.
    Hidden = 2,
    /// Logits `[n × vocab]`, from a last stage that holds the output head.
    Logits = 3,
    /// Bytes of a model slice being sent to a node (`seq` is the piece index; see
    /// `control::SliceOffer`), or of a link-speed probe (`seq` = `SLICE_PROBE`).
    Slice = 4,
}

/// `seq` of a `Slice` frame that carries no slice: a probe of the link's speed, discarded.
pub const SLICE_PROBE: u64 = u64::MAX;

impl FrameKind {
    pub fn from_u8(v: u8) -> Option<FrameKind> {
        Some(match v {
            1 => FrameKind::Control,
            2 => FrameKind::Hidden,
            3 => FrameKind::Logits,
            4 => FrameKind::Slice,
            _ => return None,
        })
    }
}

/// Element type of a tensor payload. Discriminants are part of the wire format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[repr(u8)]
pub enum Dtype {
    /// Opaque bytes (control messages).
    Bytes = 0,
    F32 = 1,
    F16 = 2,
    Bf16 = 3,
    /// Blocks of 32 int8 values with one f16 scale (34 bytes per 32 values).
    Q8 = 4,
}

impl Dtype {
    pub fn from_u8(v: u8) -> Option<Dtype> {
        Some(match v {
            0 => Dtype::Bytes,
            1 => Dtype::F32,
            2 => Dtype::F16,
            3 => Dtype::Bf16,
            4 => Dtype::Q8,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bytes => "bytes",
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::Q8 => "q8",
        }
    }

    pub fn from_name(s: &str) -> Option<Dtype> {
        Some(match s {
            "f32" => Dtype::F32,
            "f16" => Dtype::F16,
            "bf16" => Dtype::Bf16,
            "q8" => Dtype::Q8,
            _ => return None,
        })
    }

    /// Bytes taken by `n` elements (`None` for `Bytes`, or when `n` does not fit the type's
    /// block size).
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        match self {
            Dtype::Bytes => None,
            Dtype::F32 => n.checked_mul(4),
            Dtype::F16 | Dtype::Bf16 => n.checked_mul(2),
            Dtype::Q8 => n.is_multiple_of(32).then(|| n / 32 * 34),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub dtype: Dtype,
    pub seq: u64,
    pub pos: u32,
    pub n_tokens: u32,
    pub len: u32,
    pub flags: u32,
    pub crc: u32,
}

impl FrameHeader {
    /// A header for `payload`, with its CRC computed.
    pub fn new(
        kind: FrameKind,
        dtype: Dtype,
        seq: u64,
        pos: u32,
        n_tokens: u32,
        flags: u32,
        payload: &[u8],
    ) -> Result<FrameHeader, ProtocolError> {
        let len = u32::try_from(payload.len()).map_err(|_| ProtocolError::TooLarge {
            what: "frame payload",
            len: payload.len() as u64,
            max: u32::MAX as u64,
        })?;
        let mut h = FrameHeader {
            kind,
            dtype,
            seq,
            pos,
            n_tokens,
            len,
            flags,
            crc: 0,
        };
        h.crc = h.compute_crc(payload);
        Ok(h)
    }

    fn encode_prefix(&self, out: &mut [u8; HEADER_LEN]) {
        out[0..4].copy_from_slice(&FRAME_MAGIC);
        out[4..6].copy_from_slice(&FRAME_VERSION.to_le_bytes());
        out[6] = self.kind as u8;
        out[7] = self.dtype as u8;
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..20].copy_from_slice(&self.pos.to_le_bytes());
        out[20..24].copy_from_slice(&self.n_tokens.to_le_bytes());
        out[24..28].copy_from_slice(&self.len.to_le_bytes());
        out[28..32].copy_from_slice(&self.flags.to_le_bytes());
        out[32..36].copy_from_slice(&0u32.to_le_bytes());
    }

    fn compute_crc(&self, payload: &[u8]) -> u32 {
        let mut b = [0u8; HEADER_LEN];
        self.encode_prefix(&mut b);
        crc32c::crc32c_append(crc32c::crc32c(&b[..36]), payload)
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        self.encode_prefix(&mut b);
        b[36..40].copy_from_slice(&self.crc.to_le_bytes());
        b
    }

    /// Parses and checks a header; `max_payload` caps data payloads (control payloads are
    /// capped at `MAX_CONTROL_LEN`). The payload is checked later with `verify`.
    pub fn decode(b: &[u8; HEADER_LEN], max_payload: u32) -> Result<FrameHeader, ProtocolError> {
        if b[0..4] != FRAME_MAGIC {
            return Err(ProtocolError::BadMagic {
                what: "frame",
                found: b[0..4].try_into().unwrap_or([0; 4]),
            });
        }
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != FRAME_VERSION {
            return Err(ProtocolError::Version {
                what: "frame format",
                ours: FRAME_VERSION as u32,
                theirs: version as u32,
            });
        }
        let kind = FrameKind::from_u8(b[6]).ok_or(ProtocolError::BadField {
            field: "frame kind",
            value: b[6] as u64,
        })?;
        let dtype = Dtype::from_u8(b[7]).ok_or(ProtocolError::BadField {
            field: "frame dtype",
            value: b[7] as u64,
        })?;
        let mut seq = [0u8; 8];
        seq.copy_from_slice(&b[8..16]);
        let h = FrameHeader {
            kind,
            dtype,
            seq: u64::from_le_bytes(seq),
            pos: u32_at(16),
            n_tokens: u32_at(20),
            len: u32_at(24),
            flags: u32_at(28),
            crc: u32_at(36),
        };
        if u32_at(32) != 0 {
            return Err(ProtocolError::BadField {
                field: "frame reserved word",
                value: u32_at(32) as u64,
            });
        }
        if h.flags & !KNOWN_FLAGS != 0 {
            return Err(ProtocolError::BadField {
                field: "frame flags",
                value: h.flags as u64,
            });
        }
        let cap = match kind {
            FrameKind::Control => MAX_CONTROL_LEN,
            _ => max_payload,
        };
        if h.len > cap {
            return Err(ProtocolError::TooLarge {
                what: "frame payload",
                len: h.len as u64,
                max: cap as u64,
            });
        }
        match (kind, dtype) {
            (FrameKind::Control | FrameKind::Slice, Dtype::Bytes) => {}
            (FrameKind::Control | FrameKind::Slice, _) | (_, Dtype::Bytes) => {
                return Err(ProtocolError::BadField {
                    field: "frame dtype for its kind",
                    value: dtype as u64,
                })
            }
            _ => {
                if h.n_tokens == 0 || h.len == 0 || !h.len.is_multiple_of(h.n_tokens) {
                    return Err(ProtocolError::Inconsistent(format!(
                        "{} bytes do not split into {} tokens",
                        h.len, h.n_tokens
                    )));
                }
            }
        }
        Ok(h)
    }

    /// Checks the CRC over this header and `payload`.
    pub fn verify(&self, payload: &[u8]) -> Result<(), ProtocolError> {
        if payload.len() != self.len as usize {
            return Err(ProtocolError::Inconsistent(format!(
                "payload of {} bytes, header says {}",
                payload.len(),
                self.len
            )));
        }
        let crc = self.compute_crc(payload);
        if crc != self.crc {
            return Err(ProtocolError::Checksum {
                expected: self.crc,
                found: crc,
            });
        }
        Ok(())
    }

    /// Bytes per token of a data frame.
    pub fn bytes_per_token(&self) -> usize {
        (self.len / self.n_tokens.max(1)) as usize
    }
}

/// Payload of `values` as little-endian f32 bytes (appended to `out`).
pub fn f32_to_le_bytes(values: &[f32], out: &mut Vec<u8>) {
    out.reserve(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// Decodes little-endian f32 bytes into `out` (lengths must match: `bytes.len() == 4 × out.len()`).
pub fn le_bytes_to_f32(bytes: &[u8], out: &mut [f32]) -> Result<(), ProtocolError> {
    if bytes.len() != out.len() * 4 {
        return Err(ProtocolError::Inconsistent(format!(
            "{} payload bytes for {} f32 values",
            bytes.len(),
            out.len()
        )));
    }
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    Ok(())
}
