//! Helpers shared by the scalar block formats.

use half::f16;

#[inline]
pub fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

#[inline]
pub fn put_f16(b: &mut [u8], i: usize, v: f32) {
    b[i..i + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// Round half away from zero (C's `roundf`).
#[inline]
pub fn round_away(v: f32) -> f32 {
    v.round()
}

/// ggml's `nearest_int`: round half to even. Below 2²² in magnitude it is ggml's own trick
/// (add 1.5·2²³, where the float's unit is 1, and read the integer off the mantissa): the
/// quantizers call this for every weight and every search step, and `round_ties_even` is a
/// call into libm on an x86_64 built without SSE4.1. Larger values, infinities and NaN take
/// `round_ties_even` (NaN gives 0).
#[inline]
pub fn nearest_int(v: f32) -> i32 {
    if v.abs() < 4_194_303.0 {
        let t = v + 12_582_912.0;
        (t.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
    } else {
        nearest_int_far(v)
    }
}

/// `nearest_int` outside ±2²²: out of line, so the compiler cannot evaluate it (a libm call)
/// on every value and select, which it does with `round_ties_even` inlined into the branch.
#[cold]
#[inline(never)]
fn nearest_int_far(v: f32) -> i32 {
    v.round_ties_even() as i32
}

/// Checks a weight row and an activation row hold `n` elements of their formats.
#[inline]
pub fn check_dot(n: usize, qk: usize, w: &[u8], wsize: usize, a: &[u8], asize: usize) -> usize {
    assert!(
        n.is_multiple_of(qk),
        "dot of {n} elements: not whole blocks of {qk}"
    );
    let nb = n / qk;
    assert!(
        w.len() >= nb * wsize && a.len() >= nb * asize,
        "dot of {n} elements: rows too short ({} and {} bytes)",
        w.len(),
        a.len()
    );
    nb
}

/// Where the last of `rows` rows, `stride` bytes apart, starts in a buffer of `len` bytes;
/// `None` when there are no rows. Panics (naming `what`) when the stride overflows or the last
/// row starts past the buffer: the bounds of a multi-row kernel, checked once.
#[inline]
pub fn last_row(what: &str, rows: usize, stride: usize, len: usize) -> Option<usize> {
    let last = rows.checked_sub(1)?;
    let start = last
        .checked_mul(stride)
        .unwrap_or_else(|| panic!("{what}: stride {stride} overflows"));
    assert!(start <= len, "{what}: {rows} rows do not fit");
    Some(start)
}

/// Checks `src` bytes hold the blocks `dst` asks for; returns the block count.
#[inline]
pub fn check_blocks(src_len: usize, dst_len: usize, qk: usize, size: usize) -> usize {
    assert!(
        dst_len.is_multiple_of(qk),
        "{dst_len} elements: not whole blocks of {qk}"
    );
    let nb = dst_len / qk;
    assert!(
        src_len >= nb * size,
        "{nb} blocks need {} bytes, have {src_len}",
        nb * size
    );
    nb
}

#[cfg(test)]
mod tests {
    use super::nearest_int;

    #[test]
    fn nearest_int_rounds_half_to_even_everywhere() {
        let mut xs = vec![
            0.0f32,
            -0.0,
            0.5,
            1.5,
            2.5,
            -0.5,
            -1.5,
            -2.5,
            0.49999997,
            -0.49999997,
            4_194_302.5,
            -4_194_302.5,
            4_194_303.0,
            4_194_304.5,
            -4_194_304.5,
            1e9,
            -1e9,
            8_388_609.0,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE,
        ];
        // Every half-integer and its neighbours up to ±300, and a sweep of bit patterns.
        for k in -600..=600 {
            let h = k as f32 * 0.5;
            xs.extend([
                h,
                f32::from_bits(h.to_bits() + 1),
                f32::from_bits(h.to_bits().max(1) - 1),
            ]);
        }
        let mut bits = 0x0123_4567u32;
        for _ in 0..200_000 {
            bits = bits.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            xs.push(f32::from_bits(bits));
        }
        for x in xs {
            assert_eq!(
                nearest_int(x),
                x.round_ties_even() as i32,
                "{x} ({:#x})",
                x.to_bits()
            );
        }
    }
}
