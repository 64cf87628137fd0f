//! Weights repacked at load into panels of `PANEL` rows, the layout `TypeKernels::gemm_packed`
//! reads.
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
//! Nothing is converted or widened, so a panel holds exactly the bytes of its rows: a matrix
//! repacked takes the bytes it took mapped, and row `r`'s panel starts at byte `r * row_bytes`
//! as row `r` did. Rows past the last whole panel stay in the GGUF layout. The kernels read
//! the same values as from the file, and give the same bits.

use crate::types::GgmlType;

/// Rows per panel: the GEMM tile's weight rows.
pub const PANEL: usize = 4;

/// Bytes of a block's header (the f16 scale, then for Q4_1/Q5_1 the f16 min) for the formats
/// with a panel layout; `None` for the others.
pub fn header_bytes(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL => Some(2),
        GgmlType::Q4_1 | GgmlType::Q5_1 => Some(4),
        _ => None,
    }
}

/// True when matrices of `ty` can be repacked here: the format has a panel layout and this
/// CPU's kernel table has a kernel that reads it.
pub fn available(ty: GgmlType) -> bool {
    header_bytes(ty).is_some() && crate::kernels(ty).gemm_packed.is_some()
}

/// Rows of a matrix of `n_out` rows that lie in whole panels.
pub fn packed_rows(n_out: usize) -> usize {
    n_out - n_out % PANEL
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

/// Copies the first `n_out` rows of a `ty` matrix (`n_in` columns) from the GGUF layout in
/// `src` to the panel layout in `dst` (the same length: `n_out * row_bytes`).
///
/// # Panics
/// When `ty` has no panel layout, or the slices do not hold the rows.
pub fn repack(ty: GgmlType, n_in: usize, n_out: usize, src: &[u8], dst: &mut [u8]) {
    let g = geometry(ty, n_in, n_out, src.len());
    assert!(dst.len() >= n_out * g.rb, "repack: destination too short");
    let full = packed_rows(n_out);
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
    let g = geometry(ty, n_in, n_out, packed.len());
    assert!(row < n_out, "unpack_row: row {row} of {n_out}");
    let out = &mut out[..g.rb];
    if row >= packed_rows(n_out) {
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
        ] {
            for nb in [1usize, 2, 3, 6, 7] {
                for n_out in [1usize, 3, 4, 5, 8, 11] {
                    let n_in = nb * 32;
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
                    if n_out >= PANEL && nb >= 2 {
                        assert_ne!(src, dst, "{ty} {nb} blocks {n_out} rows: nothing moved");
                    }
                    let mut row = vec![0u8; rb];
                    for r in 0..n_out {
                        unpack_row(ty, n_in, n_out, &dst, r, &mut row);
                        assert_eq!(row, src[r * rb..(r + 1) * rb], "{ty} {nb} blocks row {r}");
                    }
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
    fn formats_without_a_layout_are_refused() {
        assert_eq!(header_bytes(GgmlType::Q4_K), None);
        assert!(!available(GgmlType::Q6_K));
        let err = std::panic::catch_unwind(|| {
            let mut d = vec![0u8; 144];
            repack(GgmlType::Q4_K, 256, 1, &[0u8; 144], &mut d);
        });
        assert!(err.is_err());
    }
}
