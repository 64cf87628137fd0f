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

/// ggml's `nearest_int`: round half to even.
#[inline]
pub fn nearest_int(v: f32) -> i32 {
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
