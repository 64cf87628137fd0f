//! The MXFP4 panel layout: `KPANEL` rows for the kernels that keep one row in each 32-bit
//! lane of a register (`TypeKernels::dot_panels` and `gemm_panels`). Block `i` of the
//! panel's rows is one run of `KPANEL * 17` bytes:
//!
//! ```text
//!   e:  16 B        the E8M0 scale byte of row 0 .. row 15
//!   qs: 4 × 64 B    run g: code bytes 4g..4g+4 of row 0 .. row 15
//! ```
//!
//! A code byte j holds element j (low nibble) and element j + 16 (high nibble), so one
//! 64-byte run unpacked holds elements 4g..4g+4 of every row in its low nibbles and
//! 16+4g..16+4g+4 in its high ones: one instruction multiplies four codes of every row by the
//! same four activations. As the other layouts, a panel holds exactly the bytes of its rows.

use super::KPANEL;
use crate::quants::mxfp4::BLOCK as BB;
use crate::types::GgmlType;

/// Bytes of block `i` of a panel's rows.
pub const GROUP: usize = KPANEL * BB;
/// Offsets inside a group: the scale bytes, then the four runs of code bytes.
pub const E: usize = 0;
pub const QS: usize = KPANEL;
const _: () = assert!(QS + 4 * 4 * KPANEL == GROUP);

fn row_bytes(n_in: usize, n_out: usize, len: usize) -> usize {
    let rb = GgmlType::MXFP4
        .row_bytes(n_in)
        .unwrap_or_else(|| panic!("repack: {n_in} columns is not whole MXFP4 blocks"));
    assert!(
        n_out.checked_mul(rb).is_some_and(|b| b <= len),
        "repack: {n_out} rows of {rb} bytes do not fit in {len}"
    );
    rb
}

/// Row `o`'s block `b` (the GGUF bytes) into its panel's `group`.
#[inline]
fn put(group: &mut [u8], o: usize, b: &[u8]) {
    group[E + o] = b[0];
    for g in 0..4 {
        let at = QS + 4 * KPANEL * g + 4 * o;
        group[at..at + 4].copy_from_slice(&b[1 + 4 * g..5 + 4 * g]);
    }
}

/// Row `o`'s block back from its panel's `group` into `b`.
#[inline]
fn get(group: &[u8], o: usize, b: &mut [u8]) {
    b[0] = group[E + o];
    for g in 0..4 {
        let at = QS + 4 * KPANEL * g + 4 * o;
        b[1 + 4 * g..5 + 4 * g].copy_from_slice(&group[at..at + 4]);
    }
}

/// One panel from `KPANEL` rows of `rb` bytes, row `o` being `row(o)`.
fn panel_from<'a>(rb: usize, row: impl Fn(usize) -> &'a [u8], panel: &mut [u8]) {
    for o in 0..KPANEL {
        let r = row(o);
        for (group, b) in panel[..rb * KPANEL]
            .chunks_exact_mut(GROUP)
            .zip(r[..rb].chunks_exact(BB))
        {
            put(group, o, b);
        }
    }
}

pub(super) fn repack(n_in: usize, n_out: usize, src: &[u8], dst: &mut [u8]) {
    let rb = row_bytes(n_in, n_out, src.len());
    assert!(dst.len() >= n_out * rb, "repack: destination too short");
    let full = n_out - n_out % KPANEL;
    for p in (0..full).step_by(KPANEL) {
        let rows = &src[p * rb..(p + KPANEL) * rb];
        panel_from(rb, |o| &rows[o * rb..], &mut dst[p * rb..(p + KPANEL) * rb]);
    }
    dst[full * rb..n_out * rb].copy_from_slice(&src[full * rb..n_out * rb]);
}

pub(super) fn unpack_rows(
    n_in: usize,
    n_out: usize,
    packed: &[u8],
    rows: std::ops::Range<usize>,
    out: &mut [u8],
) {
    let rb = row_bytes(n_in, n_out, packed.len());
    assert!(rows.end <= n_out, "unpack_row: rows {rows:?} of {n_out}");
    let full = n_out - n_out % KPANEL;
    for (k, r) in rows.enumerate() {
        let out = &mut out[k * rb..(k + 1) * rb];
        if r >= full {
            out.copy_from_slice(&packed[r * rb..(r + 1) * rb]);
            continue;
        }
        let p = r - r % KPANEL;
        let panel = &packed[p * rb..(p + KPANEL) * rb];
        for (b, group) in out.chunks_exact_mut(BB).zip(panel.chunks_exact(GROUP)) {
            get(group, r % KPANEL, b);
        }
    }
}

/// `n_w` rows in the GGUF layout (the o-th at `w[o * w_stride..]`, `n_in` columns) as whole
/// panels in `buf`, the last panel filled up with copies of the last row: what the panel
/// kernels read, for the rows that were not repacked at load.
pub(crate) fn panels_of(n_in: usize, w: &[u8], w_stride: usize, n_w: usize, buf: &mut Vec<u8>) {
    let rb = GgmlType::MXFP4
        .row_bytes(n_in)
        .unwrap_or_else(|| panic!("panels_of: {n_in} columns is not whole MXFP4 blocks"));
    assert!(
        n_w > 0 && w_stride >= rb,
        "panels_of: {n_w} rows, stride {w_stride}"
    );
    assert!(
        w.len() >= (n_w - 1) * w_stride + rb,
        "panels_of: weights too short"
    );
    let panels = n_w.div_ceil(KPANEL);
    buf.resize(panels * KPANEL * rb, 0);
    for (p, panel) in buf.chunks_exact_mut(KPANEL * rb).enumerate() {
        let row = |o: usize| {
            let r = (p * KPANEL + o).min(n_w - 1);
            &w[r * w_stride..r * w_stride + rb]
        };
        panel_from(rb, row, panel);
    }
}

/// Checks a `gemm_panels` call: `n_w` rows (whole panels) at `n` columns in `w`, `n_a`
/// activation rows of `n` Q8_0 columns `a_stride` apart, and room in `out` for
/// `out[r * out_stride + o]`. Returns the blocks per row.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_shapes(
    n: usize,
    w: &[u8],
    n_w: usize,
    a: &[u8],
    a_stride: usize,
    n_a: usize,
    out: &[f32],
    out_stride: usize,
) -> usize {
    use crate::quants::{mxfp4, q8_0};
    assert!(n.is_multiple_of(mxfp4::QK), "gemm_panels: {n} columns");
    let nb = n / mxfp4::QK;
    assert!(
        n_w.is_multiple_of(KPANEL),
        "gemm_panels: {n_w} rows is not whole panels"
    );
    assert!(w.len() >= n_w * nb * BB, "gemm_panels: weights too short");
    if n_a > 0 {
        assert!(
            (n_a == 1 || a_stride >= nb * q8_0::BLOCK)
                && a.len() >= (n_a - 1) * a_stride + nb * q8_0::BLOCK,
            "gemm_panels: activations too short"
        );
        assert!(
            (n_a == 1 || out_stride >= n_w) && out.len() >= (n_a - 1) * out_stride + n_w,
            "gemm_panels: output too small"
        );
    }
    nb
}

/// Weights for the panel tests: rows of random codes whose scale bytes take every kind
/// (0, the subnormal halves, 2, ordinary, 127, huge, 254, 255) and quantized rows.
#[cfg(test)]
pub(crate) fn test_rows(n: usize, rows: usize, seed: u64) -> Vec<u8> {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    let mut rng = StdRng::seed_from_u64(seed);
    let rb = GgmlType::MXFP4.row_bytes(n).unwrap();
    let mut w = vec![0u8; rows * rb];
    for (r, row) in w.chunks_exact_mut(rb).enumerate() {
        if r % 3 == 0 {
            let x: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            crate::quants::mxfp4::quantize(&x, row);
        } else {
            rng.fill(row);
            for (i, b) in row.chunks_exact_mut(BB).enumerate() {
                b[0] = [0u8, 1, 2, 100, 127, 140, 254, 255][(i + r) % 8];
            }
        }
    }
    w
}

/// Q8_0 activation rows for the panel tests (`stride` bytes apart): random, extreme (±127
/// quants) and constant.
#[cfg(test)]
pub(crate) fn test_acts(n: usize, rows: usize, stride: usize, seed: u64) -> Vec<u8> {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    let mut rng = StdRng::seed_from_u64(seed);
    let ab = GgmlType::Q8_0.row_bytes(n).unwrap();
    let mut a = vec![0u8; rows * stride];
    for r in 0..rows {
        let x: Vec<f32> = (0..n)
            .map(|i| match r % 3 {
                0 => rng.random_range(-3.0f32..3.0),
                1 => {
                    if i % 2 == 0 {
                        1.0
                    } else {
                        -1.0
                    }
                }
                _ => 0.5,
            })
            .collect();
        crate::quants::q8_0::quantize(&x, &mut a[r * stride..r * stride + ab]);
    }
    a
}

/// The panel GEMM `f` against the reference: every pair of two panels of weights and up to 9
/// activation rows gives the reference `vec_dot`'s bits, whatever the number of activation
/// rows in the call.
#[cfg(test)]
pub(crate) fn check_gemm_panels(f: crate::dispatch::PanelGemmFn, name: &str) {
    use crate::quants::mxfp4;
    for nb in [1usize, 3, 16] {
        let n = nb * mxfp4::QK;
        let rows = 2 * KPANEL;
        let w = test_rows(n, rows, 44 + nb as u64);
        let rb = w.len() / rows;
        let mut p = vec![0u8; w.len()];
        super::repack(GgmlType::MXFP4, n, rows, &w, &mut p);
        let stride = GgmlType::Q8_0.row_bytes(n).unwrap() + 6;
        let a = test_acts(n, 9, stride, 7 + nb as u64);
        for n_a in [1usize, 2, 3, 4, 5, 9] {
            let out_stride = rows + 3;
            let mut out = vec![f32::NAN; (n_a - 1) * out_stride + rows];
            f(n, &p, rows, &a, stride, n_a, &mut out, out_stride);
            for r in 0..n_a {
                for o in 0..rows {
                    let want = mxfp4::vec_dot(n, &w[o * rb..(o + 1) * rb], &a[r * stride..]);
                    let got = out[r * out_stride + o];
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{name}: {nb} blocks, {n_a} rows, act {r}, row {o}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

/// A level's panel GEMM, for the row kernels below that lay rows out as panels first.
pub(crate) trait PanelKernel {
    const GEMM: crate::dispatch::PanelGemmFn;
}

/// Weight rows per slice the row kernels lay out at once: the matmul chunk's most (the
/// panels stay in L1/L2 for every activation row).
const SLICE: usize = 64;
/// Activation rows per pass of the row kernels.
const SLAB: usize = 8;

thread_local! {
    /// Rows laid out as panels by the row kernels.
    static PANELS: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `n_w` rows in the GGUF layout (`w_stride` apart) against `n_a` activation rows through
/// `K`'s panel GEMM, slice by slice: `store(r, o0, values)` receives activation row `r`
/// against rows `o0..o0 + values.len()`. Each pair gets the panel kernel's bits, which are
/// the reference's, whatever the slice.
#[allow(clippy::too_many_arguments)]
fn rows_through_panels<K: PanelKernel>(
    n: usize,
    w: &[u8],
    w_stride: usize,
    n_w: usize,
    a: &[u8],
    a_stride: usize,
    n_a: usize,
    store: &mut dyn FnMut(usize, usize, &[f32]),
) {
    if n_w == 0 || n_a == 0 {
        return;
    }
    PANELS.with_borrow_mut(|buf| {
        let mut tmp = [0f32; SLAB * SLICE];
        for o0 in (0..n_w).step_by(SLICE) {
            let m = (n_w - o0).min(SLICE);
            panels_of(n, &w[o0 * w_stride..], w_stride, m, buf);
            let mp = m.next_multiple_of(KPANEL);
            for r0 in (0..n_a).step_by(SLAB) {
                let k = (n_a - r0).min(SLAB);
                (K::GEMM)(n, buf, mp, &a[r0 * a_stride..], a_stride, k, &mut tmp, mp);
                for r in 0..k {
                    store(r0 + r, o0, &tmp[r * mp..r * mp + m]);
                }
            }
        }
    });
}

/// `TypeKernels::vec_dot_rows` through `K`'s panels.
pub(crate) fn vec_dot_rows<K: PanelKernel>(
    n: usize,
    w: &[u8],
    w_stride: usize,
    a: &[u8],
    out: &mut [f32],
) {
    let n_w = out.len();
    rows_through_panels::<K>(n, w, w_stride, n_w, a, 0, 1, &mut |_, o0, v| {
        out[o0..o0 + v.len()].copy_from_slice(v);
    });
}

/// `TypeKernels::vec_dot_tile` through `K`'s panels.
#[allow(clippy::too_many_arguments)]
pub(crate) fn vec_dot_tile<K: PanelKernel>(
    n: usize,
    w: &[u8],
    w_stride: usize,
    n_w: usize,
    a: &[u8],
    a_stride: usize,
    n_a: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    rows_through_panels::<K>(n, w, w_stride, n_w, a, a_stride, n_a, &mut |r, o0, v| {
        let at = r * out_stride + o0;
        out[at..at + v.len()].copy_from_slice(v);
    });
}

/// `TypeKernels::kgemm` (the batch kernel for rows in the GGUF layout) through `K`'s panels.
#[allow(clippy::too_many_arguments)]
pub(crate) fn kgemm<K: PanelKernel>(
    n: usize,
    w: &[u8],
    w_stride: usize,
    n_w: usize,
    a: &[u8],
    a_stride: usize,
    n_a: usize,
    store: &mut dyn FnMut(usize, usize, &[f32]),
) {
    rows_through_panels::<K>(n, w, w_stride, n_w, a, a_stride, n_a, store);
}

/// The row kernels of `K` (rows, tile, batch) against the reference at odd row counts and
/// strides: every pair the reference `vec_dot`'s bits.
#[cfg(test)]
pub(crate) fn check_row_kernels<K: PanelKernel>(name: &str) {
    use crate::quants::mxfp4;
    for nb in [1usize, 5] {
        let n = nb * mxfp4::QK;
        let rb = GgmlType::MXFP4.row_bytes(n).unwrap();
        for n_w in [1usize, 15, 17, 70] {
            let w_stride = rb + 3;
            let rows = test_rows(n, n_w, 3 + n_w as u64);
            let mut w = vec![0u8; n_w * w_stride];
            for o in 0..n_w {
                w[o * w_stride..o * w_stride + rb].copy_from_slice(&rows[o * rb..(o + 1) * rb]);
            }
            let a_stride = GgmlType::Q8_0.row_bytes(n).unwrap() + 2;
            let n_a = 11;
            let a = test_acts(n, n_a, a_stride, 9);
            let want = |r: usize, o: usize| {
                mxfp4::vec_dot(n, &rows[o * rb..(o + 1) * rb], &a[r * a_stride..]).to_bits()
            };
            let mut out = vec![0f32; n_w];
            vec_dot_rows::<K>(n, &w, w_stride, &a[a_stride..], &mut out);
            for (o, v) in out.iter().enumerate() {
                assert_eq!(v.to_bits(), want(1, o), "{name} rows: {nb} blocks, row {o}");
            }
            let out_stride = n_w + 1;
            let mut out = vec![0f32; n_a * out_stride];
            vec_dot_tile::<K>(
                n, &w, w_stride, n_w, &a, a_stride, n_a, &mut out, out_stride,
            );
            let mut got = vec![0f32; n_a * n_w];
            kgemm::<K>(n, &w, w_stride, n_w, &a, a_stride, n_a, &mut |r, o0, v| {
                got[r * n_w + o0..r * n_w + o0 + v.len()].copy_from_slice(v);
            });
            for r in 0..n_a {
                for o in 0..n_w {
                    let (t, k) = (out[r * out_stride + o], got[r * n_w + o]);
                    assert_eq!(
                        t.to_bits(),
                        want(r, o),
                        "{name} tile: {nb}, act {r}, row {o}"
                    );
                    assert_eq!(
                        k.to_bits(),
                        want(r, o),
                        "{name} batch: {nb}, act {r}, row {o}"
                    );
                }
            }
        }
    }
}
