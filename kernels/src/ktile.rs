//! K-quant weight rows unpacked into tiles for the prefill GEMM (`TypeKernels::kgemm`).
//!
//! The decode kernels unpack each weight block once per activation row they meet, and load
//! each activation block once per weight row: about one load per multiply-add, so a prefill
//! batch ran no faster per row than decode. A tile unpacks `ROWS` weight rows once per matrix
//! product and lays them out so that one 512-bit register holds the same 4 elements of all 16
//! rows (one i32 lane per row). A GEMM kernel then multiplies that register by 4 activation
//! bytes broadcast from a Q8_K row (`vpdpbusd`): 64 multiply-adds per instruction, with one
//! weight load shared by every activation row of the kernel and one activation load by every
//! weight row.
//!
//! ```text
//! codes[(i * GROUPS + g) * ROWS + r]  u32: elements 4g..4g+4 of block i of row r, unsigned
//! sc[(i * nsub + j) * ROWS + r]       i32: sub-block j's scale
//! coef[(i * PAIRS + p) * ROWS + r]    two i16: the factors of the Q8_K block sums 2p and 2p+1
//! d[i * ROWS + r], dmin[...]          f32: the block's d and dmin
//! ```
//!
//! Every format is written as `value = code - bias` with an unsigned code, so that per block
//! and activation row
//!
//! ```text
//! S = Σ_j sc_j · Σ_{e in j} code_e · a_e        (vpdpbusd, then one multiply per sub-block)
//! C = Σ_h coef_h · bsum_h                        (vpdpwssd over the Q8_K 16-element sums)
//! ```
//!
//! A format with mins (Q4_K, Q5_K, Q2_K) has `sumi = S`, `summ = C` (coef = the min);
//! one with a bias (Q6_K 32, Q3_K 4, IQ4_XS 128) has `sumi = S − C` (coef = bias · scale).
//! These are the exact integers of the scalar reference, and the kernels then take the
//! reference's float steps for the block, in block order. So the GEMM gives the bits of the
//! reference `vec_dot` (and of every decode kernel, which does the same) for every pair.

use crate::quants::q8_k::f16_at;
use crate::quants::{iq4_nl, iq4_xs, q3_k, q4_k, q8_k};
use crate::types::QK_K;

/// Weight rows per tile: the i32 lanes of a 512-bit register.
pub const ROWS: usize = 16;
/// Groups of 4 elements per block.
pub const GROUPS: usize = QK_K / 4;
/// Pairs of Q8_K block sums (16 sums of 16 elements) per block.
pub const PAIRS: usize = 8;

/// A K-quant format as the tile sees it.
pub trait KQuant {
    /// Bytes per block.
    const BLOCK: usize;
    /// Elements per sub-block (16 or 32).
    const SUB: usize;
    /// `sumi = S` and `summ = C` (mins) rather than `sumi = S − C` (a bias).
    const HAS_MIN: bool;
    /// The bias (`value = code − BIAS`; 0 for the formats with mins).
    const BIAS: u8;
    /// The largest code.
    const MAX_CODE: u32;
    /// The codes of a block's 4-element groups (little-endian bytes: byte e of the array is
    /// element e). The scalar form: the GEMM kernels bring their own SIMD one.
    fn codes(b: &[u8], codes: &mut [u32; GROUPS]);
    /// The sub-block scales and the 16 block-sum factors of a block; returns (d, dmin).
    fn scales(b: &[u8], sc: &mut [i32; 16], coef: &mut [i16; 16]) -> (f32, f32);
}

const LOW4: u32 = 0x0f0f_0f0f;
const LOW2: u32 = 0x0303_0303;
const LOW1: u32 = 0x0101_0101;

#[inline]
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The nibble codes of Q4_K/Q5_K group `g` (`qs` at `qs`): the low nibbles of a 32-byte run
/// are elements 64k..64k+32, its high nibbles the next 32.
#[inline]
fn nibbles_k(b: &[u8], qs: usize, g: usize) -> u32 {
    let (k, e) = (g / 16, 4 * (g % 16));
    if e < 32 {
        u32_at(b, qs + 32 * k + e) & LOW4
    } else {
        (u32_at(b, qs + 32 * k + e - 32) >> 4) & LOW4
    }
}

/// Scales and mins of Q4_K/Q5_K (the same packing).
#[inline]
fn scales_mins(b: &[u8], sc: &mut [i32; 16], coef: &mut [i16; 16]) {
    let (s, m) = q4_k::unpack_scales(&q4_k::scale_bytes(b));
    for j in 0..8 {
        sc[j] = i32::from(s[j]);
        coef[2 * j] = i16::from(m[j]);
        coef[2 * j + 1] = i16::from(m[j]);
    }
}

pub struct Q4K;
impl KQuant for Q4K {
    const BLOCK: usize = 144;
    const SUB: usize = 32;
    const HAS_MIN: bool = true;
    const BIAS: u8 = 0;
    const MAX_CODE: u32 = 15;
    fn codes(b: &[u8], codes: &mut [u32; GROUPS]) {
        for (g, c) in codes.iter_mut().enumerate() {
            *c = nibbles_k(b, 16, g);
        }
    }
    fn scales(b: &[u8], sc: &mut [i32; 16], coef: &mut [i16; 16]) -> (f32, f32) {
        scales_mins(b, sc, coef);
        (f16_at(b, 0), f16_at(b, 2))
    }
}

pub struct Q5K;
impl KQuant for Q5K {
    const BLOCK: usize = 176;
    const SUB: usize = 32;
    const HAS_MIN: bool = true;
    const BIAS: u8 = 0;
    const MAX_CODE: u32 = 31;
    fn codes(b: &[u8], codes: &mut [u32; GROUPS]) {
        // qh at 16, qs at 48; the fifth bit of element 64k + 32h + i is bit 2k + h of qh[i].
        for (g, c) in codes.iter_mut().enumerate() {
            let (k, e) = (g / 16, 4 * (g % 16));
            let (h, i) = (e / 32, e % 32);
            let high = (u32_at(b, 16 + i) >> (2 * k + h)) & LOW1;
            *c = nibbles_k(b, 48, g) | (high << 4);
        }
    }
    fn scales(b: &[u8], sc: &mut [i32; 16], coef: &mut [i16; 16]) -> (f32, f32) {
        scales_mins(b, sc, coef);
        (f16_at(b, 0), f16_at(b, 2))
    }
}

pub struct Q6K;
impl KQuant for Q6K {
    const BLOCK: usize = 210;
    const SUB: usize = 16;
    const HAS_MIN: bool = false;
    const BIAS: u8 = 32;
    const MAX_CODE: u32 = 63;
    fn codes(b: &[u8], codes: &mut [u32; GROUPS]) {
        // Element 128h + 32k + l: low nibble or high nibble (k ≥ 2) of ql[64h + 32(k%2) + l],
        // top bits 2k, 2k+1 of qh[128 + 32h + l]; value = code − 32.
        for (g, c) in codes.iter_mut().enumerate() {
            let e = 4 * g;
            let (h, k, l) = (e / 128, (e % 128) / 32, e % 32);
            let x = u32_at(b, 64 * h + 32 * (k % 2) + l);
            let low = if k < 2 { x & LOW4 } else { (x >> 4) & LOW4 };
            let high = (u32_at(b, 128 + 32 * h + l) >> (2 * k)) & LOW2;
            *c = low | (high << 4);
        }
    }
    fn scales(b: &[u8], sc: &mut [i32; 16], coef: &mut [i16; 16]) -> (f32, f32) {
        for j in 0..16 {
            let s = i32::from(b[192 + j] as i8);
            sc[j] = s;
            coef[j] = (32 * s) as i16;
        }
        (f16_at(b, 208), 0.0)
    }
}

pub struct Q3K;
impl KQuant for Q3K {
    const BLOCK: usize = 110;
    const SUB: usize = 16;
    const HAS_MIN: bool = false;
    const BIAS: u8 = 4;
    const MAX_CODE: u32 = 7;
    fn codes(b: &[u8], codes: &mut [u32; GROUPS]) {
        // Element e = 128h + 32k + i: bits 2k.. of qs[32 + 32h + i], the third bit is bit
        // e / 32 of hmask[i]; value = code − 4.
        for (g, c) in codes.iter_mut().enumerate() {
            let e = 4 * g;
            let (h, k, i) = (e / 128, (e % 128) / 32, e % 32);
            let low = (u32_at(b, 32 + 32 * h + i) >> (2 * k)) & LOW2;
            let high = (u32_at(b, i) >> (e / 32)) & LOW1;
            *c = low | (high << 2);
        }
    }
    fn scales(b: &[u8], sc: &mut [i32; 16], coef: &mut [i16; 16]) -> (f32, f32) {
        for (j, &s) in q3_k::scales(b).iter().enumerate() {
            sc[j] = i32::from(s);
            coef[j] = 4 * i16::from(s);
        }
        (f16_at(b, 108), 0.0)
    }
}

pub struct Q2K;
impl KQuant for Q2K {
    const BLOCK: usize = 84;
    const SUB: usize = 16;
    const HAS_MIN: bool = true;
    const BIAS: u8 = 0;
    const MAX_CODE: u32 = 3;
    fn codes(b: &[u8], codes: &mut [u32; GROUPS]) {
        for (g, c) in codes.iter_mut().enumerate() {
            let e = 4 * g;
            let (h, k, i) = (e / 128, (e % 128) / 32, e % 32);
            *c = (u32_at(b, 16 + 32 * h + i) >> (2 * k)) & LOW2;
        }
    }
    fn scales(b: &[u8], sc: &mut [i32; 16], coef: &mut [i16; 16]) -> (f32, f32) {
        for j in 0..16 {
            sc[j] = i32::from(b[j] & 0xf);
            coef[j] = i16::from(b[j] >> 4);
        }
        (f16_at(b, 80), f16_at(b, 82))
    }
}

pub struct Iq4Xs;
impl KQuant for Iq4Xs {
    const BLOCK: usize = 136;
    const SUB: usize = 32;
    const HAS_MIN: bool = false;
    const BIAS: u8 = 128;
    const MAX_CODE: u32 = 241;
    fn codes(b: &[u8], codes: &mut [u32; GROUPS]) {
        // Sub-block ib: elements j < 16 are the low nibbles of qs[16 ib + j], the rest the
        // high nibbles of qs[16 ib + j − 16]; value = KVALUES[nibble] = code − 128.
        let qs = iq4_xs::QS;
        for (g, c) in codes.iter_mut().enumerate() {
            let (ib, j) = (g / 8, 4 * (g % 8));
            let x = if j < 16 {
                u32_at(b, qs + 16 * ib + j) & LOW4
            } else {
                (u32_at(b, qs + 16 * ib + j - 16) >> 4) & LOW4
            };
            let v = x
                .to_le_bytes()
                .map(|n| (i32::from(iq4_nl::KVALUES[usize::from(n)]) + 128) as u8);
            *c = u32::from_le_bytes(v);
        }
    }
    fn scales(b: &[u8], sc: &mut [i32; 16], coef: &mut [i16; 16]) -> (f32, f32) {
        for (j, &s) in iq4_xs::scales(b).iter().enumerate() {
            sc[j] = s;
            coef[2 * j] = (128 * s) as i16;
            coef[2 * j + 1] = (128 * s) as i16;
        }
        (f16_at(b, 0), 0.0)
    }
}

/// Checks the shapes of a `kgemm` call (`n` columns, `n_w` weight rows of `wb`-byte blocks,
/// `n_a` Q8_K rows); returns the blocks per row.
#[allow(clippy::too_many_arguments)]
pub fn check_shapes(
    name: &str,
    n: usize,
    wb: usize,
    w_len: usize,
    w_stride: usize,
    n_w: usize,
    a_len: usize,
    a_stride: usize,
    n_a: usize,
) -> usize {
    assert!(
        n.is_multiple_of(QK_K),
        "{name}: {n} columns is not whole blocks"
    );
    let nb = n / QK_K;
    assert!(
        n_w == 0 || (w_stride >= nb * wb && w_len >= (n_w - 1) * w_stride + nb * wb),
        "{name}: {n_w} weight rows of {nb} blocks do not fit in {w_len} bytes"
    );
    assert!(
        n_a == 0
            || (a_stride >= nb * q8_k::BLOCK_BYTES
                && a_len >= (n_a - 1) * a_stride + nb * q8_k::BLOCK_BYTES),
        "{name}: {n_a} activation rows of {nb} blocks do not fit in {a_len} bytes"
    );
    nb
}

/// Up to `ROWS` weight rows unpacked (see the module docs). Owned per thread and reused:
/// once grown to the widest matrix, building a tile allocates nothing.
#[derive(Default, Debug)]
pub struct KTile {
    pub nb: usize,
    pub nsub: usize,
    pub codes: Vec<u32>,
    pub sc: Vec<i32>,
    pub coef: Vec<i32>,
    pub d: Vec<f32>,
    pub dmin: Vec<f32>,
}

fn grow<T: Default + Clone>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}

impl KTile {
    /// Unpacks `rows` (≤ `ROWS`) rows of `nb` blocks of `T`, the r-th at `w[r * stride..]`;
    /// the lanes of missing rows are zero (their results are 0 and never stored).
    ///
    /// # Panics
    /// When `rows > ROWS` or `w` does not hold the rows.
    /// `codes` is `T::codes` or a SIMD form of it. `signed`: the codes of a format with a
    /// bias are stored as the values themselves (`code − BIAS`, which fits an i8 for every
    /// format here) and its block-sum factors are zero, for kernels whose dot product is
    /// signed × signed (NEON `sdot`): then `sumi = S` with no correction.
    pub fn build<T: KQuant>(
        &mut self,
        w: &[u8],
        stride: usize,
        rows: usize,
        nb: usize,
        codes_of: fn(&[u8], &mut [u32; GROUPS]),
        signed: bool,
    ) {
        let unbias = signed && !T::HAS_MIN && T::BIAS != 0;
        assert!(rows <= ROWS, "KTile: {rows} rows, at most {ROWS}");
        assert!(
            rows == 0 || w.len() >= (rows - 1) * stride + nb * T::BLOCK,
            "KTile: {rows} rows of {nb} blocks do not fit in {} bytes",
            w.len()
        );
        let nsub = QK_K / T::SUB;
        self.nb = nb;
        self.nsub = nsub;
        grow(&mut self.codes, nb * GROUPS * ROWS);
        grow(&mut self.sc, nb * nsub * ROWS);
        grow(&mut self.coef, nb * PAIRS * ROWS);
        grow(&mut self.d, nb * ROWS);
        grow(&mut self.dmin, nb * ROWS);
        let mut codes = [0u32; GROUPS];
        let mut sc = [0i32; 16];
        let mut coef = [0i16; 16];
        for i in 0..nb {
            for r in 0..ROWS {
                let (d, dmin) = if r < rows {
                    let at = r * stride + i * T::BLOCK;
                    let b = &w[at..at + T::BLOCK];
                    codes_of(b, &mut codes);
                    let dd = T::scales(b, &mut sc, &mut coef);
                    if unbias {
                        for c in codes.iter_mut() {
                            *c = u32::from_le_bytes(
                                c.to_le_bytes().map(|v| v.wrapping_sub(T::BIAS)),
                            );
                        }
                        coef.fill(0);
                    }
                    dd
                } else {
                    codes.fill(0);
                    sc.fill(0);
                    coef.fill(0);
                    (0.0, 0.0)
                };
                for (g, &c) in codes.iter().enumerate() {
                    self.codes[(i * GROUPS + g) * ROWS + r] = c;
                }
                for (j, &s) in sc[..nsub].iter().enumerate() {
                    self.sc[(i * nsub + j) * ROWS + r] = s;
                }
                for p in 0..PAIRS {
                    let pair =
                        u32::from(coef[2 * p] as u16) | (u32::from(coef[2 * p + 1] as u16) << 16);
                    self.coef[(i * PAIRS + p) * ROWS + r] = pair as i32;
                }
                self.d[i * ROWS + r] = d;
                self.dmin[i * ROWS + r] = dmin;
            }
        }
    }
}

/// The test every `kgemm` kernel passes (`avx2/kgemm.rs`, `neon/kgemm.rs`).
#[cfg(test)]
pub(crate) mod test_util {
    use super::*;
    use crate::dispatch::KGemmFn;
    use crate::quants::q8_k::{self, BLOCK_BYTES as AB};
    use crate::quants::{iq4_xs, q2_k, q3_k, q4_k, q5_k, q6_k};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    type Dot = fn(usize, &[u8], &[u8]) -> f32;

    /// `f` against the reference dot for every pair, bit for bit: random blocks (every bit
    /// pattern of levels and scales), activation rows with extreme quants, 21 weight rows
    /// (a whole tile and a partial one) by `n_a` activation rows, a row
    /// stride longer than a row.
    fn check<T: KQuant>(f: KGemmFn, f16s: &[usize], reference: Dot, n_a: usize) {
        let mut rng = StdRng::seed_from_u64(T::BLOCK as u64 + 11);
        for nb in [1, 3] {
            let n = nb * QK_K;
            let n_w = 21;
            let ws = nb * T::BLOCK + 3;
            let mut w: Vec<u8> = (0..n_w * ws).map(|_| rng.random()).collect();
            // Row 0 at every code's maximum and activation row 0 at -128 throughout: the
            // largest sums the i16 runs and the i32 lanes meet.
            w[..nb * T::BLOCK].fill(0xff);
            for r in 0..n_w {
                for b in w[r * ws..r * ws + nb * T::BLOCK].chunks_exact_mut(T::BLOCK) {
                    for &o in f16s {
                        let v = half::f16::from_f32(rng.random_range(-2.0f32..2.0));
                        b[o..o + 2].copy_from_slice(&v.to_le_bytes());
                    }
                }
            }
            let as_ = nb * AB + 5;
            let mut a = vec![0u8; n_a * as_];
            for c in 0..n_a {
                let x: Vec<f32> = (0..n)
                    .map(|_| match if c == 0 { 1 } else { rng.random_range(0..4) } {
                        0 => 4.0,
                        1 => -4.0,
                        _ => rng.random_range(-4.0f32..4.0),
                    })
                    .collect();
                q8_k::quantize(&x, &mut a[c * as_..c * as_ + nb * AB]);
            }
            let mut got = vec![f32::NAN; n_a * n_w];
            f(n, &w, ws, n_w, &a, as_, n_a, &mut |c, o0, v| {
                got[c * n_w + o0..c * n_w + o0 + v.len()].copy_from_slice(v)
            });
            for c in 0..n_a {
                for o in 0..n_w {
                    let want = reference(
                        n,
                        &w[o * ws..o * ws + nb * T::BLOCK],
                        &a[c * as_..c * as_ + nb * AB],
                    );
                    assert_eq!(
                        got[c * n_w + o].to_bits(),
                        want.to_bits(),
                        "{nb} blocks, weight row {o}, activation row {c}"
                    );
                }
            }
        }
    }

    /// `table`: the kernels of Q4_K, Q5_K, Q6_K, Q3_K, Q2_K and IQ4_XS (`None`: not at this
    /// level); `n_a` activation rows.
    pub(crate) fn check_all(table: [Option<KGemmFn>; 6], n_a: usize) {
        let [a, b, c, d, e, f] = table;
        if let Some(k) = a {
            check::<Q4K>(k, &[0, 2], q4_k::vec_dot, n_a);
        }
        if let Some(k) = b {
            check::<Q5K>(k, &[0, 2], q5_k::vec_dot, n_a);
        }
        if let Some(k) = c {
            check::<Q6K>(k, &[208], q6_k::vec_dot, n_a);
        }
        if let Some(k) = d {
            check::<Q3K>(k, &[108], q3_k::vec_dot, n_a);
        }
        if let Some(k) = e {
            check::<Q2K>(k, &[80, 82], q2_k::vec_dot, n_a);
        }
        if let Some(k) = f {
            check::<Iq4Xs>(k, &[0], iq4_xs::vec_dot, n_a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quants::q8_k;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Σ over blocks of the reference float steps on the tile's integers, written out in
    /// scalar: equal to the reference `vec_dot` bit for bit (this checks the unpacking;
    /// the SIMD kernels are checked against the reference directly).
    fn tile_dot<T: KQuant>(t: &KTile, r: usize, a: &[u8], signed: bool) -> f32 {
        let mut sum = 0f32;
        for i in 0..t.nb {
            let ab: &[u8; q8_k::BLOCK_BYTES] = a
                [i * q8_k::BLOCK_BYTES..(i + 1) * q8_k::BLOCK_BYTES]
                .try_into()
                .unwrap();
            let mut s = 0i32;
            for j in 0..t.nsub {
                let mut raw = 0i32;
                for g in j * T::SUB / 4..(j + 1) * T::SUB / 4 {
                    let c = t.codes[(i * GROUPS + g) * ROWS + r].to_le_bytes();
                    for (k, &v) in c.iter().enumerate() {
                        let v = if signed {
                            i32::from(v as i8)
                        } else {
                            i32::from(v)
                        };
                        raw += v * q8_k::q_of(ab, 4 * g + k);
                    }
                }
                s += t.sc[(i * t.nsub + j) * ROWS + r] * raw;
            }
            let mut c = 0i32;
            for p in 0..PAIRS {
                let pair = t.coef[(i * PAIRS + p) * ROWS + r] as u32;
                c += i32::from(pair as u16 as i16) * q8_k::bsum_of(ab, 2 * p)
                    + i32::from((pair >> 16) as u16 as i16) * q8_k::bsum_of(ab, 2 * p + 1);
            }
            let ad = q8_k::d_of(ab);
            let (d, dmin) = (t.d[i * ROWS + r], t.dmin[i * ROWS + r]);
            sum += if T::HAS_MIN {
                ad * d * s as f32 - ad * dmin * c as f32
            } else {
                ad * d * (s - c) as f32
            };
        }
        sum
    }

    fn check<T: KQuant>(f16s: &[usize], reference: fn(usize, &[u8], &[u8]) -> f32) {
        let mut rng = StdRng::seed_from_u64(T::BLOCK as u64);
        let nb = 3;
        let rows = 5;
        let mut w: Vec<u8> = (0..rows * nb * T::BLOCK).map(|_| rng.random()).collect();
        for b in w.chunks_exact_mut(T::BLOCK) {
            for &o in f16s {
                let v = half::f16::from_f32(rng.random_range(-2.0f32..2.0));
                b[o..o + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        let mut a = vec![0u8; nb * q8_k::BLOCK_BYTES];
        let x: Vec<f32> = (0..nb * QK_K)
            .map(|_| rng.random_range(-3.0f32..3.0))
            .collect();
        q8_k::quantize(&x, &mut a);
        let mut t = KTile::default();
        for signed in [false, true] {
            t.build::<T>(&w, nb * T::BLOCK, rows, nb, T::codes, signed);
            for r in 0..rows {
                let row = &w[r * nb * T::BLOCK..(r + 1) * nb * T::BLOCK];
                let want = reference(nb * QK_K, row, &a);
                let got = tile_dot::<T>(&t, r, &a, signed);
                assert_eq!(got.to_bits(), want.to_bits(), "row {r}, signed {signed}");
            }
            for r in rows..ROWS {
                assert_eq!(tile_dot::<T>(&t, r, &a, signed), 0.0, "padding row {r}");
            }
        }
    }

    #[test]
    fn tiles_hold_the_reference_integers() {
        use crate::quants::{q2_k, q5_k, q6_k};
        check::<Q4K>(&[0, 2], q4_k::vec_dot);
        check::<Q5K>(&[0, 2], q5_k::vec_dot);
        check::<Q6K>(&[208], q6_k::vec_dot);
        check::<Q3K>(&[108], q3_k::vec_dot);
        check::<Q2K>(&[80, 82], q2_k::vec_dot);
        check::<Iq4Xs>(&[0], iq4_xs::vec_dot);
    }
}
