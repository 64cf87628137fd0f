//! Q4_K block format (scalar reference), byte-compatible with ggml's `block_q4_K`.
//!
//! Block of 256 values, 144 bytes: `f16 d | f16 dmin | scales[12] | qs[128]`.
//! Eight sub-blocks of 32 each have a 6-bit scale `sc` and a 6-bit min `m` (packed in
//! `scales` as ggml's `get_scale_min_k4`); `x = d * sc * q - dmin * m` with `q` a nibble.
//! Sub-blocks 2g and 2g+1 share the bytes `qs[32 g .. 32 g + 32]`: low nibbles, then high.
//!
//! The 6-bit scale packing and the scale/min fitting are shared with Q5_K.

use crate::quants::q8_k::{
    self, blocks, check_dequantize, check_dot, check_quantize, f16_at, nearest_int,
};
use crate::types::{GgmlType, QK_K};
use half::f16;

/// Activation format for dot products against Q4_K weights.
pub const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_K;

/// Bytes per block.
pub const BLOCK_BYTES: usize = 144;
/// Offset of the packed scales in a Q4_K or Q5_K block.
pub(crate) const SCALES: usize = 4;
/// Offset of `qs` in a block.
const QS: usize = 16;

/// Unpacks the eight 6-bit scales and eight 6-bit mins of a Q4_K/Q5_K block
/// (`get_scale_min_k4` for j = 0..8), as two little-endian words each: byte j of
/// `(scales_lo, scales_hi)` is the scale of sub-block j (j < 4 in `lo`), and likewise mins.
#[inline]
pub(crate) fn unpack_scales_words(s: &[u8; 12]) -> ([u32; 2], [u32; 2]) {
    let a = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let b = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let c = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let sc = [a & LOW6, (c & LOW4) | (((a >> 6) & LOW2) << 4)];
    let m = [b & LOW6, ((c >> 4) & LOW4) | (((b >> 6) & LOW2) << 4)];
    (sc, m)
}

/// The eight scales and eight mins of a Q4_K/Q5_K block.
#[inline]
pub(crate) fn unpack_scales(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let (sc, m) = unpack_scales_words(s);
    let bytes = |w: [u32; 2]| {
        let mut out = [0u8; 8];
        out[..4].copy_from_slice(&w[0].to_le_bytes());
        out[4..].copy_from_slice(&w[1].to_le_bytes());
        out
    };
    (bytes(sc), bytes(m))
}

/// Packs eight scales and eight mins (each < 64) as ggml's Q4_K/Q5_K quantizers do.
pub(crate) fn pack_scales(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        let (ls, lm) = (sc[j] & 63, m[j] & 63);
        if j < 4 {
            s[j] |= ls;
            s[j + 4] |= lm;
        } else {
            s[j + 4] = (ls & 0xf) | ((lm & 0xf) << 4);
            s[j - 4] |= (ls >> 4) << 6;
            s[j] |= (lm >> 4) << 6;
        }
    }
    s
}

/// The 12 scale bytes of a Q4_K/Q5_K block.
#[inline]
pub(crate) fn scale_bytes(b: &[u8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    s.copy_from_slice(&b[SCALES..SCALES + 12]);
    s
}

/// What `fit_scale_min` computes of a sub-block before its search (shared with the 8-lane
/// search in `avx2::kquant`, which must start from the same floats).
pub(crate) struct FitStart {
    pub lo: f32,
    pub hi: f32,
    pub sum_w: f32,
    pub sum_x: f32,
}

/// The sub-block's range and weighted sums; `Err(lo)` when it has no range (all values
/// equal, or NaN): then every level is 0, the scale 0 and the min `-lo`.
pub(crate) fn fit_start(x: &[f32], w: &[f32]) -> Result<FitStart, f32> {
    let lo = x.iter().fold(f32::INFINITY, |m, &v| m.min(v)).min(0.0);
    let hi = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    // Also catches NaN input (every comparison false).
    if hi.partial_cmp(&lo) != Some(std::cmp::Ordering::Greater) {
        return Err(lo);
    }
    let sum_w: f32 = w.iter().sum();
    let sum_x: f32 = x.iter().zip(w).map(|(v, wt)| v * wt).sum();
    Ok(FitStart {
        lo,
        hi,
        sum_w,
        sum_x,
    })
}

/// Fits the eight 32-value sub-blocks of a block (values `x`, weights `w`) with `nmax`,
/// `rmin`, `nstep` (rdelta 0.1): writes the levels into `l`, returns the scales and mins.
pub(crate) type Fit8 = fn(
    x: &[f32],
    w: &[f32; QK_K],
    nmax: u8,
    rmin: f32,
    nstep: u32,
    l: &mut [u8; QK_K],
) -> ([f32; 8], [f32; 8]);

/// The eight sub-blocks of `x` and `w` transposed for the lane-parallel searches (element i
/// of every sub-block together: `xt[i][j] = x[32 j + i]`), with each lane's start: `[lo, hi,
/// sum_w, sum_x]` by lane, and for a lane without a range the (scale, min) it ends with
/// (its start then holds a harmless range, and its result is replaced).
pub(crate) struct Lanes8 {
    pub xt: [[f32; 8]; 32],
    pub wt: [[f32; 8]; 32],
    pub start: [[f32; 8]; 4],
    pub degenerate: [Option<(f32, f32)>; 8],
}

pub(crate) fn lanes8(x: &[f32], w: &[f32; QK_K]) -> Lanes8 {
    let mut t = Lanes8 {
        xt: [[0f32; 8]; 32],
        wt: [[0f32; 8]; 32],
        start: [[0f32; 8]; 4],
        degenerate: [None; 8],
    };
    for j in 0..8 {
        for i in 0..32 {
            t.xt[i][j] = x[32 * j + i];
            t.wt[i][j] = w[32 * j + i];
        }
        let r = 32 * j..32 * j + 32;
        match fit_start(&x[r.clone()], &w[r]) {
            Ok(FitStart {
                lo,
                hi,
                sum_w,
                sum_x,
            }) => {
                t.start[0][j] = lo;
                t.start[1][j] = hi;
                t.start[2][j] = sum_w;
                t.start[3][j] = sum_x;
            }
            Err(lo) => {
                t.start[1][j] = 1.0;
                t.degenerate[j] = Some((0.0, -lo));
            }
        }
    }
    t
}

/// `Fit8` by `fit_scale_min`, sub-block by sub-block: the reference.
pub(crate) fn fit8_reference(
    x: &[f32],
    w: &[f32; QK_K],
    nmax: u8,
    rmin: f32,
    nstep: u32,
    l: &mut [u8; QK_K],
) -> ([f32; 8], [f32; 8]) {
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    for j in 0..8 {
        let r = 32 * j..32 * j + 32;
        (scales[j], mins[j]) = fit_scale_min(
            &x[r.clone()],
            &w[r.clone()],
            nmax,
            rmin,
            0.1,
            nstep,
            &mut l[r],
        );
    }
    (scales, mins)
}

/// Fits `x ≈ scale * q - min` with integer `q` in `0..=nmax` and `min >= 0`, minimising the
/// `w`-weighted squared error (the search of ggml's `make_qkx2_quants`): starting from the
/// plain min/max grid, tries `nstep + 1` slightly different grids `(nmax + rmin + rdelta·k) /
/// (max − min)` and solves the weighted least squares for scale and offset on each.
/// Writes the chosen `q` and returns `(scale, min)`. `x.len() <= 32`.
pub(crate) fn fit_scale_min(
    x: &[f32],
    w: &[f32],
    nmax: u8,
    rmin: f32,
    rdelta: f32,
    nstep: u32,
    q: &mut [u8],
) -> (f32, f32) {
    let n = x.len();
    assert!(
        n <= 32 && w.len() == n && q.len() == n,
        "fit_scale_min: bad lengths"
    );
    let FitStart {
        lo,
        hi,
        sum_w,
        sum_x,
    } = match fit_start(x, w) {
        Ok(start) => start,
        Err(lo) => {
            q.fill(0);
            return (0.0, -lo);
        }
    };
    let top = i32::from(nmax);
    let grid = |iscale: f32, out: &mut [u8]| {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = nearest_int(iscale * (v - lo)).clamp(0, top) as u8;
        }
    };
    let error = |scale: f32, offset: f32, qs: &[u8]| -> f32 {
        x.iter()
            .zip(w)
            .zip(qs)
            .map(|((&v, &wt), &l)| {
                let e = scale * f32::from(l) + offset - v;
                wt * e * e
            })
            .sum()
    };
    let range = hi - lo;
    let mut best_scale = range / f32::from(nmax);
    let mut best_offset = lo;
    grid(f32::from(nmax) / range, q);
    let mut best = error(best_scale, best_offset, q);
    let mut cand = [0u8; 32];
    let cand = &mut cand[..n];
    for k in 0..=nstep {
        grid((rmin + rdelta * k as f32 + f32::from(nmax)) / range, cand);
        let (mut sl, mut sll, mut sxl) = (0f32, 0f32, 0f32);
        for ((&v, &wt), &l) in x.iter().zip(w).zip(cand.iter()) {
            let l = f32::from(l);
            sl += wt * l;
            sll += wt * l * l;
            sxl += wt * l * v;
        }
        let det = sum_w * sll - sl * sl;
        if det <= 0.0 {
            continue;
        }
        let mut scale = (sum_w * sxl - sum_x * sl) / det;
        let mut offset = (sll * sum_x - sl * sxl) / det;
        if offset > 0.0 {
            offset = 0.0;
            scale = sxl / sll;
        }
        let e = error(scale, offset, cand);
        if e < best {
            q.copy_from_slice(cand);
            best = e;
            best_scale = scale;
            best_offset = offset;
        }
    }
    (best_scale, -best_offset)
}

/// Quantizes the scales/mins of one Q4_K/Q5_K block: 6-bit `sc`, `m` against f16 `d`,
/// `dmin`. Returns `(d, dmin, sc, m)` with `d` and `dmin` already rounded to f16.
pub(crate) fn quantize_scales(scales: &[f32; 8], mins: &[f32; 8]) -> (f16, f16, [u8; 8], [u8; 8]) {
    let max_scale = scales.iter().fold(0f32, |m, &v| m.max(v));
    let max_min = mins.iter().fold(0f32, |m, &v| m.max(v));
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..8 {
        sc[j] = nearest_int(inv_scale * scales[j]).clamp(0, 63) as u8;
        m[j] = nearest_int(inv_min * mins[j]).clamp(0, 63) as u8;
    }
    (
        f16::from_f32(max_scale / 63.0),
        f16::from_f32(max_min / 63.0),
        sc,
        m,
    )
}

/// Fits one block of 256 values for Q4_K (`nmax = 15`) or Q5_K (`nmax = 31`): writes the
/// levels into `l` and returns `(d, dmin, sc, m)`.
pub(crate) fn quantize_levels(
    x: &[f32],
    nmax: u8,
    l: &mut [u8; QK_K],
    fit8: Fit8,
) -> (f16, f16, [u8; 8], [u8; 8]) {
    let av = (x.iter().map(|v| v * v).sum::<f32>() / QK_K as f32).sqrt();
    let (rmin, nstep) = if nmax == 15 { (-1.0, 20) } else { (-0.5, 15) };
    let mut w = [0f32; QK_K];
    for (wt, v) in w.iter_mut().zip(x) {
        *wt = av + v.abs();
    }
    let (scales, mins) = fit8(x, &w, nmax, rmin, nstep, l);
    let (d, dmin, sc, m) = quantize_scales(&scales, &mins);
    // Re-fit the levels to the rounded scales.
    let (df, dminf) = (d.to_f32(), dmin.to_f32());
    for j in 0..8 {
        let dd = df * f32::from(sc[j]);
        if dd == 0.0 {
            continue;
        }
        let dm = dminf * f32::from(m[j]);
        for i in 32 * j..32 * j + 32 {
            l[i] = nearest_int((x[i] + dm) / dd).clamp(0, i32::from(nmax)) as u8;
        }
    }
    (d, dmin, sc, m)
}

pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    let nb = check_dequantize(src, BLOCK_BYTES, dst);
    for (b, y) in blocks::<BLOCK_BYTES>(src, nb)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b, 0);
        let dmin = f16_at(b, 2);
        let (sc, m) = unpack_scales(&scale_bytes(b));
        for g in 0..4 {
            let qs = &b[QS + 32 * g..QS + 32 * g + 32];
            let (d1, m1) = (d * f32::from(sc[2 * g]), dmin * f32::from(m[2 * g]));
            let (d2, m2) = (d * f32::from(sc[2 * g + 1]), dmin * f32::from(m[2 * g + 1]));
            let (lo, hi) = y[64 * g..64 * g + 64].split_at_mut(32);
            for ((yl, yh), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(qs) {
                *yl = d1 * f32::from(q & 0xf) - m1;
                *yh = d2 * f32::from(q >> 4) - m2;
            }
        }
    }
}

pub fn quantize(src: &[f32], dst: &mut [u8]) {
    quantize_with(src, dst, fit8_reference);
}

/// `quantize` with the scale search `fit8` (the reference's or a SIMD one giving its bits).
pub(crate) fn quantize_with(src: &[f32], dst: &mut [u8], fit8: Fit8) {
    let nb = check_quantize(src, dst, BLOCK_BYTES);
    for (x, b) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
        .take(nb)
    {
        let mut l = [0u8; QK_K];
        let (d, dmin, sc, m) = quantize_levels(x, 15, &mut l, fit8);
        b[0..2].copy_from_slice(&d.to_le_bytes());
        b[2..4].copy_from_slice(&dmin.to_le_bytes());
        b[SCALES..SCALES + 12].copy_from_slice(&pack_scales(&sc, &m));
        for g in 0..4 {
            for i in 0..32 {
                b[QS + 32 * g + i] = l[64 * g + i] | (l[64 * g + 32 + i] << 4);
            }
        }
    }
}

/// `Σ_j m_j · (bsums[2j] + bsums[2j+1])`: the activation sums each min multiplies.
pub(crate) fn mins_dot_bsums(m: &[u8; 8], a: &[u8; q8_k::BLOCK_BYTES]) -> i32 {
    (0..8)
        .map(|j| i32::from(m[j]) * (q8_k::bsum_of(a, 2 * j) + q8_k::bsum_of(a, 2 * j + 1)))
        .sum()
}

pub fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = check_dot(n, w, BLOCK_BYTES, a);
    let wbs = blocks::<BLOCK_BYTES>(w, nb);
    let abs = blocks::<{ q8_k::BLOCK_BYTES }>(a, nb);
    let mut sum = 0f32;
    for (b, ab) in wbs.iter().zip(abs) {
        let (sc, m) = unpack_scales(&scale_bytes(b));
        let mut sumi = 0i32;
        for g in 0..4 {
            let (mut lo, mut hi) = (0i32, 0i32);
            for i in 0..32 {
                let q = b[QS + 32 * g + i];
                lo += i32::from(q & 0xf) * q8_k::q_of(ab, 64 * g + i);
                hi += i32::from(q >> 4) * q8_k::q_of(ab, 64 * g + 32 + i);
            }
            sumi += i32::from(sc[2 * g]) * lo + i32::from(sc[2 * g + 1]) * hi;
        }
        let summ = mins_dot_bsums(&m, ab);
        let ad = q8_k::d_of(ab);
        sum += ad * f16_at(b, 0) * sumi as f32 - ad * f16_at(b, 2) * summ as f32;
    }
    sum
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// ggml's `get_scale_min_k4`, written out per index, to cross-check the word unpacking.
    fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
        if j < 4 {
            (q[j] & 63, q[j + 4] & 63)
        } else {
            (
                (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
                (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
            )
        }
    }

    /// Rows of pseudo-normal values (sum of uniforms), seeded.
    pub(crate) fn gaussian(seed: u64, n: usize) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n)
            .map(|_| (0..4).map(|_| rng.random::<f32>() - 0.5).sum::<f32>() * 1.7)
            .collect()
    }

    /// `vec_dot(w, quantize_q8k(a))` against `dot(dequantize(w), a)`, relative to Σ|w·a|.
    pub(crate) fn dot_error(
        n: usize,
        w: &[u8],
        a: &[f32],
        deq: fn(&[u8], &mut [f32]),
        dot: fn(usize, &[u8], &[u8]) -> f32,
    ) -> f64 {
        let mut aq = vec![0u8; n / QK_K * q8_k::BLOCK_BYTES];
        q8_k::quantize(a, &mut aq);
        let mut wf = vec![0f32; n];
        deq(w, &mut wf);
        let exact: f64 = wf
            .iter()
            .zip(a)
            .map(|(x, y)| f64::from(*x) * f64::from(*y))
            .sum();
        let scale: f64 = wf
            .iter()
            .zip(a)
            .map(|(x, y)| (f64::from(*x) * f64::from(*y)).abs())
            .sum();
        ((f64::from(dot(n, w, &aq)) - exact) / scale).abs()
    }

    pub(crate) fn rel_rmse(x: &[f32], y: &[f32]) -> f32 {
        let err: f32 = x.iter().zip(y).map(|(a, b)| (a - b) * (a - b)).sum();
        let norm: f32 = x.iter().map(|a| a * a).sum();
        (err / norm).sqrt()
    }

    #[test]
    fn scale_unpacking_matches_get_scale_min_k4() {
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..1000 {
            let q: [u8; 12] = rng.random();
            let (sc, m) = unpack_scales(&q);
            for j in 0..8 {
                assert_eq!((sc[j], m[j]), scale_min_k4(j, &q), "j={j} {q:?}");
            }
        }
        for _ in 0..1000 {
            let sc: [u8; 8] = rng.random::<[u8; 8]>().map(|v| v & 63);
            let m: [u8; 8] = rng.random::<[u8; 8]>().map(|v| v & 63);
            assert_eq!(unpack_scales(&pack_scales(&sc, &m)), (sc, m));
        }
    }

    #[test]
    fn hand_built_block_decodes() {
        let sc = [1, 2, 3, 4, 40, 50, 60, 63];
        let m = [0, 5, 17, 33, 1, 47, 63, 20];
        let mut b = vec![0u8; BLOCK_BYTES];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        b[SCALES..SCALES + 12].copy_from_slice(&pack_scales(&sc, &m));
        let level = |e: usize| ((e * 7 + e / 64) % 16) as u8;
        for g in 0..4 {
            for i in 0..32 {
                b[QS + 32 * g + i] = level(64 * g + i) | (level(64 * g + 32 + i) << 4);
            }
        }
        let mut y = vec![0f32; QK_K];
        dequantize(&b, &mut y);
        for (e, v) in y.iter().enumerate() {
            let j = e / 32;
            let want = 0.5 * f32::from(sc[j]) * f32::from(level(e)) - 0.25 * f32::from(m[j]);
            assert_eq!(*v, want, "element {e}");
        }
    }

    #[test]
    fn zero_and_constant_inputs_decode_without_nan() {
        for x in [
            vec![0f32; 2 * QK_K],
            vec![-1.5f32; 2 * QK_K],
            vec![2.0f32; 2 * QK_K],
        ] {
            let mut q = vec![0u8; 2 * BLOCK_BYTES];
            quantize(&x, &mut q);
            let mut y = vec![0f32; x.len()];
            dequantize(&q, &mut y);
            for (a, b) in x.iter().zip(&y) {
                assert!(
                    b.is_finite() && (a - b).abs() <= 0.02 * a.abs().max(1e-3),
                    "{a} -> {b}"
                );
            }
        }
    }

    #[test]
    fn roundtrip_and_dot_errors_are_small() {
        let n = 8 * QK_K;
        let x = gaussian(5, n);
        let mut q = vec![0u8; 8 * BLOCK_BYTES];
        quantize(&x, &mut q);
        let mut y = vec![0f32; n];
        dequantize(&q, &mut y);
        let rmse = rel_rmse(&x, &y);
        assert!(rmse < 0.1, "rmse {rmse}");
        let a = gaussian(6, n);
        let e = dot_error(n, &q, &a, dequantize, vec_dot);
        assert!(e < 1e-2, "dot error {e}");
    }
}
