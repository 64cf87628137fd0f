//! Weights repacked at load into panels of rows, the layouts `TypeKernels::gemm_packed` (the
//! 32-element formats), `TypeKernels::dot_panels` (Q4_K, MXFP4) and
//! `TypeKernels::gemm_panels` (MXFP4) read.
//!
//! A GEMM register tile takes `PANEL` weight rows at once. In the GGUF layout it gathers their
//! blocks from `PANEL` places, and it converts each row's f16 scales on its own. In a panel the
//! tile's data for a pair of blocks is one contiguous run:
//!
//! ```text
//! panel (PANEL rows, the same bytes as PANEL GGUF rows):
//!   for each pair of blocks (2j, 2j+1):
//!     d: 8 f16   row 0 block 2j, row 0 block 2j+1, row 1 block 2j, ... row 3 block 2j+1
//!     m: 8 f16   likewise (Q4_1 and Q5_1 only)
//!     for each row: the rest of block 2j (fifth bits, nibbles or bytes), then of block 2j+1
//!   when the row has an odd number of blocks: the last block of each row, as in the file
//! ```
//!
//! The tile converts the 8 scales with one instruction and reads one run instead of `PANEL`.
//!
//! A Q4_K panel holds `KPANEL` rows for the decode kernel, which keeps one row in each lane
//! of a register: one instruction multiplies four weights of every row by the same four
//! activations, and the rows' scales are unpacked and converted together. Block `i` of the
//! panel's rows is one run of `KPANEL * 144` bytes:
//!
//! ```text
//!   d:      16 f16      row 0 .. row 15
//!   dmin:   16 f16      likewise
//!   scales: 12 × 16 B   byte k of the 12 packed scale bytes, row 0 .. row 15
//!   qs:     32 × 64 B   bytes 4j..4j+4 of the 128 nibble bytes, row 0 .. row 15
//! ```
//!
//! Nothing is converted or widened, so a panel holds exactly the bytes of its rows: a matrix
//! repacked takes the bytes it took mapped, and row `r`'s panel starts at byte `r * row_bytes`
//! as row `r` did. Rows past the last whole panel stay in the GGUF layout. The kernels read
//! the same values as from the file, and give the same bits.

use crate::types::GgmlType;

/// Rows per panel of the 32-element formats: the GEMM tile's weight rows.
pub const PANEL: usize = 4;

/// Rows per Q4_K and MXFP4 panel: the decode kernel's lanes (16 of 32 bits in a 512-bit
/// register). The MXFP4 layout is `mxpanel`'s.
pub const KPANEL: usize = 16;

/// The row every matmul job and chunk starts on: a multiple of every layout's panel, so a
/// chunk never splits one.
pub const ALIGN: usize = 16;

const _: () = assert!(ALIGN.is_multiple_of(PANEL) && ALIGN.is_multiple_of(KPANEL));

/// Bytes of a block's header (the f16 scale, then for Q4_1/Q5_1 the f16 min) for the formats
/// with a 4-row panel layout; `None` for the others.
pub fn header_bytes(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL => Some(2),
        GgmlType::Q4_1 | GgmlType::Q5_1 => Some(4),
        _ => None,
    }
}

/// Rows in one panel of `ty`'s layout; `None` when `ty` has none.
pub fn panel_rows(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q4_K | GgmlType::MXFP4 => Some(KPANEL),
        _ => header_bytes(ty).map(|_| PANEL),
    }
}

/// True when matrices of `ty` can be repacked here: the format has a panel layout and this
/// CPU's kernel table has a kernel that reads it.
pub fn available(ty: GgmlType) -> bool {
    let k = crate::kernels(ty);
    match ty {
        GgmlType::Q4_K => k.dot_panels.is_some(),
        GgmlType::MXFP4 => k.dot_panels.is_some() && k.gemm_panels.is_some(),
        _ => header_bytes(ty).is_some() && k.gemm_packed.is_some(),
    }
}

/// Rows of a matrix of `n_out` rows of `ty` that lie in whole panels (none without a layout).
pub fn packed_rows(ty: GgmlType, n_out: usize) -> usize {
    panel_rows(ty).map_or(0, |p| n_out - n_out % p)
}

/// Copies the first `n_out` rows of a `ty` matrix (`n_in` columns) from the GGUF layout in
/// `src` to the panel layout in `dst` (the same length: `n_out * row_bytes`).
///
/// # Panics
/// When `ty` has no panel layout, or the slices do not hold the rows.
pub fn repack(ty: GgmlType, n_in: usize, n_out: usize, src: &[u8], dst: &mut [u8]) {
    match ty {
        GgmlType::Q4_K => return kpanel::repack(n_in, n_out, src, dst),
        GgmlType::MXFP4 => return mxpanel::repack(n_in, n_out, src, dst),
        _ => {}
    }
    repack_legacy(ty, n_in, n_out, src, dst);
}

/// Row `row` of a matrix repacked by `repack`, back in the GGUF layout (`row_bytes` bytes).
///
/// # Panics
/// As `repack`; also when `row >= n_out` or `out` is shorter than a row.
pub fn unpack_row(
    ty: GgmlType,
    n_in: usize,
    n_out: usize,
    packed: &[u8],
    row: usize,
    out: &mut [u8],
) {
    match ty {
        GgmlType::Q4_K => return kpanel::unpack_rows(n_in, n_out, packed, row..row + 1, out),
        GgmlType::MXFP4 => return mxpanel::unpack_rows(n_in, n_out, packed, row..row + 1, out),
        _ => {}
    }
    unpack_row_legacy(ty, n_in, n_out, packed, row, out);
}

/// Rows `rows` of a matrix repacked by `repack`, back in the GGUF layout, one after another
/// in `out` (`rows.len() * row_bytes` bytes).
///
/// # Panics
/// As `unpack_row`, for every row of `rows`.
pub fn unpack_rows(
    ty: GgmlType,
    n_in: usize,
    n_out: usize,
    packed: &[u8],
    rows: std::ops::Range<usize>,
    out: &mut [u8],
) {
    match ty {
        GgmlType::Q4_K => return kpanel::unpack_rows(n_in, n_out, packed, rows, out),
        GgmlType::MXFP4 => return mxpanel::unpack_rows(n_in, n_out, packed, rows, out),
        _ => {}
    }
    let rb = ty.row_bytes(n_in).unwrap_or(0);
    for (k, r) in rows.enumerate() {
        unpack_row_legacy(ty, n_in, n_out, packed, r, &mut out[k * rb..(k + 1) * rb]);
    }
}

pub mod mxpanel;

/// The Q4_K panel layout (see the module's description).
pub mod kpanel {
    use super::KPANEL;
    use crate::types::GgmlType;

    /// Bytes of one Q4_K block.
    const BB: usize = 144;
    /// Bytes of block `i` of a panel's rows.
    pub const GROUP: usize = KPANEL * BB;
    /// Offsets inside a group: the f16 `d`s, the f16 `dmin`s, the transposed scale bytes and
    /// the nibble runs.
    pub const D: usize = 0;
    pub const DMIN: usize = 2 * KPANEL;
    pub const SCALES: usize = 4 * KPANEL;
    pub const QS: usize = SCALES + 12 * KPANEL;
    const _: () = assert!(QS + 128 * KPANEL == GROUP);

    fn row_bytes(n_in: usize, n_out: usize, len: usize) -> usize {
        let rb = GgmlType::Q4_K
            .row_bytes(n_in)
            .unwrap_or_else(|| panic!("repack: {n_in} columns is not whole Q4_K blocks"));
        assert!(
            n_out.checked_mul(rb).is_some_and(|b| b <= len),
            "repack: {n_out} rows of {rb} bytes do not fit in {len}"
        );
        rb
    }

    /// Row `o`'s block `b` (the GGUF bytes) into its panel's `group`.
    #[inline]
    fn put(group: &mut [u8; GROUP], o: usize, b: &[u8; BB]) {
        group[D + 2 * o..D + 2 * o + 2].copy_from_slice(&b[0..2]);
        group[DMIN + 2 * o..DMIN + 2 * o + 2].copy_from_slice(&b[2..4]);
        for k in 0..12 {
            group[SCALES + KPANEL * k + o] = b[4 + k];
        }
        for j in 0..32 {
            let at = QS + 4 * KPANEL * j + 4 * o;
            group[at..at + 4].copy_from_slice(&b[16 + 4 * j..20 + 4 * j]);
        }
    }

    /// Row `o`'s block back from its panel's `group` into `b`.
    #[inline]
    fn get(group: &[u8; GROUP], o: usize, b: &mut [u8; BB]) {
        b[0..2].copy_from_slice(&group[D + 2 * o..D + 2 * o + 2]);
        b[2..4].copy_from_slice(&group[DMIN + 2 * o..DMIN + 2 * o + 2]);
        for k in 0..12 {
            b[4 + k] = group[SCALES + KPANEL * k + o];
        }
        for j in 0..32 {
            let at = QS + 4 * KPANEL * j + 4 * o;
            b[16 + 4 * j..20 + 4 * j].copy_from_slice(&group[at..at + 4]);
        }
    }

    /// `s` as consecutive arrays of `N` bytes (its length is a multiple of `N`).
    fn arrays<const N: usize>(s: &[u8]) -> impl Iterator<Item = &[u8; N]> {
        s.chunks_exact(N)
            .map(|c| c.try_into().unwrap_or_else(|_| unreachable!()))
    }

    /// As `arrays`, mutable.
    fn arrays_mut<const N: usize>(s: &mut [u8]) -> impl Iterator<Item = &mut [u8; N]> {
        s.chunks_exact_mut(N)
            .map(|c| c.try_into().unwrap_or_else(|_| unreachable!()))
    }

    pub(super) fn repack(n_in: usize, n_out: usize, src: &[u8], dst: &mut [u8]) {
        let rb = row_bytes(n_in, n_out, src.len());
        assert!(dst.len() >= n_out * rb, "repack: destination too short");
        let full = n_out - n_out % KPANEL;
        for p in (0..full).step_by(KPANEL) {
            let panel = &mut dst[p * rb..(p + KPANEL) * rb];
            for o in 0..KPANEL {
                let row = &src[(p + o) * rb..(p + o + 1) * rb];
                for (group, b) in arrays_mut::<GROUP>(panel).zip(arrays::<BB>(row)) {
                    put(group, o, b);
                }
            }
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
            for (b, group) in arrays_mut::<BB>(out).zip(arrays::<GROUP>(panel)) {
                get(group, r % KPANEL, b);
            }
        }
    }

    /// Checks a `dot_panels` call: `out` is whole panels, `w` holds them at `n` columns, `a`
    /// one Q8_K row of `n`. Returns the blocks per row.
    pub(crate) fn check_shapes(n: usize, w: &[u8], a: &[u8], out: &[f32]) -> usize {
        assert!(
            n.is_multiple_of(crate::types::QK_K),
            "dot_panels: {n} columns"
        );
        let nb = n / crate::types::QK_K;
        assert!(
            out.len().is_multiple_of(KPANEL),
            "dot_panels: {} rows is not whole panels",
            out.len()
        );
        assert!(
            w.len() >= out.len() / KPANEL * nb * GROUP,
            "dot_panels: weights too short"
        );
        assert!(
            a.len() >= nb * crate::quants::q8_k::BLOCK_BYTES,
            "dot_panels: activations too short"
        );
        nb
    }

    /// The panel kernel `f` against the reference: every row of two panels of random Q4_K
    /// weights (real scales, random codes and 6-bit scale bytes, extreme activations
    /// included) gives the reference `vec_dot`'s bits.
    #[cfg(test)]
    pub(crate) fn check_dot_panels(f: crate::dispatch::PanelDotFn, name: &str) {
        use rand::{rngs::StdRng, Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(44);
        for nb in [1usize, 3, 16] {
            let n = nb * crate::types::QK_K;
            let rows = 2 * KPANEL;
            let mut w = Vec::new();
            for r in 0..rows {
                let x: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                let mut b = vec![0u8; crate::types::GgmlType::Q4_K.row_bytes(n).unwrap()];
                crate::quants::q4_k::quantize(&x, &mut b);
                if r % 3 == 1 {
                    // Random scale bytes and codes: every 6-bit scale and min, every nibble.
                    for blk in b.chunks_exact_mut(144) {
                        for v in &mut blk[4..] {
                            *v = rng.random();
                        }
                    }
                }
                w.extend(b);
            }
            for case in 0..3 {
                let x: Vec<f32> = (0..n)
                    .map(|i| match case {
                        0 => rng.random_range(-1.0f32..1.0),
                        // Activations at -128 and 127 once quantized (Q8_K's scale is -128 / the
                        // value of largest magnitude): the largest sums.
                        1 => {
                            if i % 2 == 0 {
                                1.0
                            } else {
                                -1.0
                            }
                        }
                        _ => 1.0,
                    })
                    .collect();
                let mut a = vec![0u8; nb * crate::quants::q8_k::BLOCK_BYTES];
                crate::quants::q8_k::quantize(&x, &mut a);
                let mut p = vec![0u8; w.len()];
                super::repack(crate::types::GgmlType::Q4_K, n, rows, &w, &mut p);
                let mut out = vec![0f32; rows];
                f(n, &p, &a, &mut out);
                let rb = w.len() / rows;
                for (r, &got) in out.iter().enumerate() {
                    let want = crate::quants::q4_k::vec_dot(n, &w[r * rb..(r + 1) * rb], &a);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{name}: {nb} blocks, case {case}, row {r}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

/// The geometry of one matrix: block bytes, header bytes, blocks per row, row bytes.
struct Geometry {
    bb: usize,
    h: usize,
    nb: usize,
    rb: usize,
}

fn geometry(ty: GgmlType, n_in: usize, n_out: usize, len: usize) -> Geometry {
    let h = header_bytes(ty).unwrap_or_else(|| panic!("repack: {ty} has no panel layout"));
    let rb = ty
        .row_bytes(n_in)
        .unwrap_or_else(|| panic!("repack: {n_in} columns is not whole {ty} blocks"));
    assert!(
        n_out.checked_mul(rb).is_some_and(|b| b <= len),
        "repack: {n_out} rows of {rb} bytes do not fit in {len}"
    );
    let bb = ty.type_size();
    Geometry {
        bb,
        h,
        nb: rb / bb,
        rb,
    }
}

/// Where block `i` of row `o` (both inside one panel) lies in the panel, as (header offset,
/// rest offset): the scale at `header`, the min at `header + 2 * PANEL * 2` (Q4_1/Q5_1), the
/// rest of the block (`bb - h` bytes) at `rest`. For the odd last block the whole block is at
/// `rest` and `header` is `None`.
fn place(g: &Geometry, o: usize, i: usize) -> (Option<usize>, usize) {
    let rest = g.bb - g.h;
    let group = 2 * PANEL * g.bb;
    if i / 2 < g.nb / 2 {
        let base = (i / 2) * group;
        let k = i % 2;
        (
            Some(base + (2 * o + k) * 2),
            base + 2 * PANEL * g.h + o * 2 * rest + k * rest,
        )
    } else {
        (None, (g.nb / 2) * group + o * g.bb)
    }
}

/// `repack` for the 4-row layout.
fn repack_legacy(ty: GgmlType, n_in: usize, n_out: usize, src: &[u8], dst: &mut [u8]) {
    let g = geometry(ty, n_in, n_out, src.len());
    assert!(dst.len() >= n_out * g.rb, "repack: destination too short");
    let full = n_out - n_out % PANEL;
    let rest = g.bb - g.h;
    for p in (0..full).step_by(PANEL) {
        let panel = &mut dst[p * g.rb..(p + PANEL) * g.rb];
        for o in 0..PANEL {
            let row = &src[(p + o) * g.rb..(p + o + 1) * g.rb];
            for (i, block) in row.chunks_exact(g.bb).enumerate() {
                match place(&g, o, i) {
                    (Some(h), r) => {
                        panel[h..h + 2].copy_from_slice(&block[..2]);
                        if g.h == 4 {
                            let m = h + 2 * PANEL * 2;
                            panel[m..m + 2].copy_from_slice(&block[2..4]);
                        }
                        panel[r..r + rest].copy_from_slice(&block[g.h..]);
                    }
                    (None, r) => panel[r..r + g.bb].copy_from_slice(block),
                }
            }
        }
    }
    dst[full * g.rb..n_out * g.rb].copy_from_slice(&src[full * g.rb..n_out * g.rb]);
}

/// `unpack_row` for the 4-row layout.
fn unpack_row_legacy(
    ty: GgmlType,
    n_in: usize,
    n_out: usize,
    packed: &[u8],
    row: usize,
    out: &mut [u8],
) {
    let g = geometry(ty, n_in, n_out, packed.len());
    assert!(row < n_out, "unpack_row: row {row} of {n_out}");
    let out = &mut out[..g.rb];
    if row >= n_out - n_out % PANEL {
        out.copy_from_slice(&packed[row * g.rb..(row + 1) * g.rb]);
        return;
    }
    let p = row - row % PANEL;
    let o = row % PANEL;
    let panel = &packed[p * g.rb..(p + PANEL) * g.rb];
    let rest = g.bb - g.h;
    for (i, block) in out.chunks_exact_mut(g.bb).enumerate() {
        match place(&g, o, i) {
            (Some(h), r) => {
                block[..2].copy_from_slice(&panel[h..h + 2]);
                if g.h == 4 {
                    let m = h + 2 * PANEL * 2;
                    block[2..4].copy_from_slice(&panel[m..m + 2]);
                }
                block[g.h..].copy_from_slice(&panel[r..r + rest]);
            }
            (None, r) => block.copy_from_slice(&panel[r..r + g.bb]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 56) as u8
            })
            .collect()
    }

    #[test]
    fn every_row_comes_back_and_no_byte_is_lost() {
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::MXFP4,
        ] {
            let panel = panel_rows(ty).unwrap();
            for nb in [1usize, 2, 3, 6, 7] {
                for n_out in [1usize, 3, 4, 5, 8, 11, 16, 19, 35] {
                    let n_in = nb * ty.block_size();
                    let rb = ty.row_bytes(n_in).unwrap();
                    let src = bytes(n_out * rb, (nb * 31 + n_out) as u64);
                    let mut dst = vec![0u8; src.len()];
                    repack(ty, n_in, n_out, &src, &mut dst);
                    let mut a = src.clone();
                    let mut b = dst.clone();
                    a.sort_unstable();
                    b.sort_unstable();
                    assert_eq!(
                        a, b,
                        "{ty} {nb} blocks {n_out} rows: bytes are not a permutation"
                    );
                    if n_out >= panel && (nb >= 2 || panel == KPANEL) {
                        assert_ne!(src, dst, "{ty} {nb} blocks {n_out} rows: nothing moved");
                    }
                    let mut row = vec![0u8; rb];
                    for r in 0..n_out {
                        unpack_row(ty, n_in, n_out, &dst, r, &mut row);
                        assert_eq!(row, src[r * rb..(r + 1) * rb], "{ty} {nb} blocks row {r}");
                    }
                    let mut all = vec![0u8; src.len()];
                    unpack_rows(ty, n_in, n_out, &dst, 0..n_out, &mut all);
                    assert_eq!(all, src, "{ty} {nb} blocks: unpack_rows");
                }
            }
        }
    }

    #[test]
    fn a_pair_is_one_run_of_scales_then_rows() {
        // Q4_1, 2 blocks per row, 4 rows: block (row o, i) has d = 10o + i, m = 100 + 10o + i,
        // nibbles all equal to 16o + 4i.
        let ty = GgmlType::Q4_1;
        let mut src = Vec::new();
        for o in 0..4u8 {
            for i in 0..2u8 {
                src.extend_from_slice(&[10 * o + i, 0, 100 + 10 * o + i, 0]);
                src.extend_from_slice(&[16 * o + 4 * i; 16]);
            }
        }
        let mut dst = vec![0u8; src.len()];
        repack(ty, 64, 4, &src, &mut dst);
        let d: Vec<u8> = dst[..16].iter().step_by(2).copied().collect();
        assert_eq!(d, [0, 1, 10, 11, 20, 21, 30, 31]);
        let m: Vec<u8> = dst[16..32].iter().step_by(2).copied().collect();
        assert_eq!(m, [100, 101, 110, 111, 120, 121, 130, 131]);
        for o in 0..4usize {
            let run = &dst[32 + o * 32..32 + (o + 1) * 32];
            assert!(run[..16].iter().all(|&b| b as usize == 16 * o), "row {o}");
            assert!(
                run[16..].iter().all(|&b| b as usize == 16 * o + 4),
                "row {o}"
            );
        }
    }

    #[test]
    fn a_q4_k_group_holds_each_field_of_sixteen_rows_together() {
        // Row o's block: every byte is o, but the f16 d is (o, 0x3c) and dmin (o, 0x40).
        let mut src = Vec::new();
        for o in 0..KPANEL as u8 {
            let mut b = [o; 144];
            b[1] = 0x3c;
            b[3] = 0x40;
            src.extend_from_slice(&b);
        }
        let mut dst = vec![0u8; src.len()];
        repack(GgmlType::Q4_K, 256, KPANEL, &src, &mut dst);
        for o in 0..KPANEL {
            assert_eq!(dst[kpanel::D + 2 * o..][..2], [o as u8, 0x3c]);
            assert_eq!(dst[kpanel::DMIN + 2 * o..][..2], [o as u8, 0x40]);
            for k in 0..12 {
                assert_eq!(dst[kpanel::SCALES + KPANEL * k + o], o as u8);
            }
            for j in 0..32 {
                assert_eq!(
                    dst[kpanel::QS + 4 * KPANEL * j + 4 * o..][..4],
                    [o as u8; 4]
                );
            }
        }
    }

    #[test]
    fn formats_without_a_layout_are_refused() {
        assert_eq!(header_bytes(GgmlType::Q6_K), None);
        assert_eq!(panel_rows(GgmlType::Q6_K), None);
        assert_eq!(packed_rows(GgmlType::Q6_K, 64), 0);
        assert!(!available(GgmlType::Q6_K));
        let err = std::panic::catch_unwind(|| {
            let mut d = vec![0u8; 210];
            repack(GgmlType::Q6_K, 256, 1, &[0u8; 210], &mut d);
        });
        assert!(err.is_err());
    }
}
