//! Hidden states on the wire: f32 as computed, or compressed to f16, bf16 or q8 (blocks of 32
//! int8 values sharing one f16 scale, like GGUF's Q8_0). Rows are encoded one after another;
//! q8 needs the row width to be a multiple of 32 so no block straddles two tokens.
//!
//! | dtype | bytes per value | rounding |
//! |---|---|---|
//! | f32 | 4 | exact |
//! | f16 | 2 | nearest even; beyond ±65504 saturates to ±65504 (not ∞) |
//! | bf16 | 2 | nearest even on the top 16 bits |
//! | q8 | 34/32 | scale = max\|x\|/127 per block, values rounded to nearest |

use crate::error::ProtocolError;
use crate::frame::Dtype;
use half::f16;

pub const Q8_BLOCK: usize = 32;
const Q8_BLOCK_BYTES: usize = 2 + Q8_BLOCK;

/// Appends `x` encoded as `dtype` to `out` (cleared first).
pub fn encode(dtype: Dtype, x: &[f32], out: &mut Vec<u8>) -> Result<(), ProtocolError> {
    out.clear();
    let len = dtype.bytes_for(x.len()).ok_or(ProtocolError::BadField {
        field: "activation count for this dtype",
        value: x.len() as u64,
    })?;
    out.reserve(len);
    match dtype {
        Dtype::Bytes => unreachable!("bytes_for(Bytes) is None"),
        Dtype::F32 => {
            for v in x {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        Dtype::F16 => {
            for &v in x {
                out.extend_from_slice(&to_f16_saturating(v).to_le_bytes());
            }
        }
        Dtype::Bf16 => {
            for &v in x {
                out.extend_from_slice(&to_bf16_bits(v).to_le_bytes());
            }
        }
        Dtype::Q8 => {
            for block in x.chunks_exact(Q8_BLOCK) {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                let scale = to_f16_saturating(amax / 127.0);
                let s = scale.to_f32();
                let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
                out.extend_from_slice(&scale.to_le_bytes());
                for &v in block {
                    let q = (v * inv).round().clamp(-127.0, 127.0) as i8;
                    out.push(q as u8);
                }
            }
        }
    }
    debug_assert_eq!(out.len(), len);
    Ok(())
}

/// Decodes `bytes` (of `dtype`) into `out`, whose length says how many values are expected.
pub fn decode(dtype: Dtype, bytes: &[u8], out: &mut [f32]) -> Result<(), ProtocolError> {
    let want = dtype.bytes_for(out.len()).ok_or(ProtocolError::BadField {
        field: "activation count for this dtype",
        value: out.len() as u64,
    })?;
    if bytes.len() != want {
        return Err(ProtocolError::Inconsistent(format!(
            "{} activations: {} bytes for {} values, expected {want}",
            dtype.name(),
            bytes.len(),
            out.len()
        )));
    }
    match dtype {
        Dtype::Bytes => unreachable!("bytes_for(Bytes) is None"),
        Dtype::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Dtype::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        Dtype::Bf16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        Dtype::Q8 => {
            for (o, b) in out
                .chunks_exact_mut(Q8_BLOCK)
                .zip(bytes.chunks_exact(Q8_BLOCK_BYTES))
            {
                let s = f16::from_le_bytes([b[0], b[1]]).to_f32();
                for (v, &q) in o.iter_mut().zip(&b[2..]) {
                    *v = (q as i8) as f32 * s;
                }
            }
        }
    }
    Ok(())
}

/// Encodes and decodes in place: what the next stage sees after the wire.
pub fn round_trip(dtype: Dtype, x: &mut [f32], scratch: &mut Vec<u8>) -> Result<(), ProtocolError> {
    encode(dtype, x, scratch)?;
    decode(dtype, scratch, x)
}

/// f16 with out-of-range values clamped to the largest finite f16 (an infinity would poison
/// the next layer's norm), NaN kept.
fn to_f16_saturating(v: f32) -> f16 {
    if v.is_nan() {
        return f16::NAN;
    }
    f16::from_f32(v.clamp(-65504.0, 65504.0))
}

/// bf16 bits of `v`, rounded to nearest even (NaN stays NaN).
fn to_bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    if v.is_nan() {
        return ((b >> 16) as u16) | 0x40;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                let u = (s as f32 / u32::MAX as f32) * 2.0 - 1.0;
                // A few large outliers, as residual streams have.
                if i % 97 == 0 {
                    u * 300.0
                } else {
                    u * 3.0
                }
            })
            .collect()
    }

    #[test]
    fn f32_is_exact_and_sizes_are_right() {
        let x = sample(640, 1);
        let mut buf = Vec::new();
        for (dt, len) in [
            (Dtype::F32, 2560),
            (Dtype::F16, 1280),
            (Dtype::Bf16, 1280),
            (Dtype::Q8, 680),
        ] {
            encode(dt, &x, &mut buf).unwrap();
            assert_eq!(buf.len(), len, "{}", dt.name());
        }
        let mut y = x.clone();
        round_trip(Dtype::F32, &mut y, &mut buf).unwrap();
        assert_eq!(x, y);
    }

    #[test]
    fn f16_matches_the_half_crate_and_saturates() {
        let mut x = sample(256, 2);
        x[3] = 1e6;
        x[4] = -1e6;
        let mut y = x.clone();
        round_trip(Dtype::F16, &mut y, &mut Vec::new()).unwrap();
        for (i, (&a, &b)) in x.iter().zip(&y).enumerate() {
            let want = if a.abs() > 65504.0 {
                65504f32.copysign(a)
            } else {
                f16::from_f32(a).to_f32()
            };
            assert_eq!(b, want, "value {i}: {a}");
        }
    }

    #[test]
    fn bf16_matches_the_half_crate() {
        let x = sample(1024, 3);
        let mut y = x.clone();
        round_trip(Dtype::Bf16, &mut y, &mut Vec::new()).unwrap();
        for (&a, &b) in x.iter().zip(&y) {
            assert_eq!(b, half::bf16::from_f32(a).to_f32(), "{a}");
        }
    }

    #[test]
    fn q8_error_is_within_half_a_step_of_each_blocks_scale() {
        let x = sample(640, 4);
        let mut y = x.clone();
        round_trip(Dtype::Q8, &mut y, &mut Vec::new()).unwrap();
        for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let step = f16::from_f32(amax / 127.0).to_f32();
            for (&a, &b) in xb.iter().zip(yb) {
                assert!(
                    (a - b).abs() <= step * 0.5 + amax * 1e-3,
                    "{a} -> {b}, step {step}"
                );
            }
        }
        // An all-zero block stays zero.
        let mut z = vec![0f32; 32];
        round_trip(Dtype::Q8, &mut z, &mut Vec::new()).unwrap();
        assert!(z.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let mut out = vec![0f32; 64];
        assert!(decode(Dtype::F16, &[0u8; 127], &mut out).is_err());
        assert!(decode(Dtype::Q8, &[0u8; 67], &mut out).is_err());
        assert!(encode(Dtype::Q8, &[0f32; 33], &mut Vec::new()).is_err());
        assert!(decode(Dtype::Q8, &[0u8; 68], &mut out).is_ok());
    }
}
