//! Activations laid out once per batch for the prefill GEMM kernels (`TypeKernels::gemm`).
//!
//! The decode kernels read activations in their GGUF block format (Q8_0: an f16 scale then 32
//! quants; Q8_1: scale, sum, quants) and convert the f16 scales of every (weight block,
//! activation block) pair they meet. A prefill batch meets each activation block once per
//! weight row, so the GEMM kernels want the conversion done once: the quants of a row are
//! packed back to back (two blocks fill a 512-bit register), each block's scale is an f32
//! repeated over the 8 lanes its block occupies, and the Q8_1 sums are f32, block-major (the 8
//! rows of a tile in one load). Every value is converted exactly from the quantized rows, so
//! a GEMM kernel can give the decode kernel's bits.

use crate::quants::common::f16_at;
use crate::quants::{q8_0, q8_1};
use crate::types::GgmlType;

/// Elements per block of the activation formats the GEMM kernels take (Q8_0, Q8_1).
pub const QK: usize = 32;

/// Lanes each block's scale is repeated over in `GemmActs::d`.
pub const D_LANES: usize = 8;

/// Extra floats after the last sum, so a tile may load 8 sums from any row.
const S_PAD: usize = 8;

/// Quantized activation rows in the GEMM layout (see the module docs). Owned and reused: once
/// grown to the largest batch, preparing a batch allocates nothing.
#[derive(Default, Debug)]
pub struct GemmActs {
    pub(crate) ty: Option<GgmlType>,
    pub(crate) n_rows: usize,
    /// Blocks per row.
    pub(crate) nb: usize,
    /// `n_rows * nb * 32` quants.
    pub(crate) q: Vec<i8>,
    /// `n_rows * nb * D_LANES` scales: block i of row r at `(r * nb + i) * D_LANES`, repeated.
    pub(crate) d: Vec<f32>,
    /// Q8_1 only: `nb * n_rows + S_PAD` sums, block-major: block i of row r at `i * n_rows + r`.
    pub(crate) s: Vec<f32>,
}

impl GemmActs {
    pub fn new() -> GemmActs {
        GemmActs::default()
    }

    /// The format the rows were prepared from.
    pub fn ty(&self) -> Option<GgmlType> {
        self.ty
    }

    pub fn n_rows(&self) -> usize {
        self.n_rows
    }

    /// Lays out `n_rows` rows of `ty` (Q8_0 or Q8_1), `stride` bytes apart in `src`, each of
    /// `nb` blocks.
    ///
    /// # Panics
    /// When `ty` is not Q8_0/Q8_1 or `src` is shorter than the rows.
    pub fn prepare(&mut self, ty: GgmlType, src: &[u8], stride: usize, n_rows: usize, nb: usize) {
        let (block, qs, sums) = match ty {
            GgmlType::Q8_0 => (q8_0::BLOCK, 2, false),
            GgmlType::Q8_1 => (q8_1::BLOCK, 4, true),
            other => panic!("GemmActs: {other} is not an activation format of the GEMM kernels"),
        };
        assert!(
            stride >= nb * block
                && (n_rows == 0 || src.len() >= (n_rows - 1) * stride + nb * block),
            "GemmActs: {n_rows} rows of {nb} {ty} blocks do not fit in {} bytes",
            src.len()
        );
        self.ty = Some(ty);
        self.n_rows = n_rows;
        self.nb = nb;
        grow(&mut self.q, n_rows * nb * QK);
        grow(&mut self.d, n_rows * nb * D_LANES);
        if sums {
            grow(&mut self.s, nb * n_rows + S_PAD);
        }
        for r in 0..n_rows {
            let row = &src[r * stride..r * stride + nb * block];
            for (i, b) in row.chunks_exact(block).enumerate() {
                let at = (r * nb + i) * QK;
                for (dst, &v) in self.q[at..at + QK].iter_mut().zip(&b[qs..qs + QK]) {
                    *dst = v as i8;
                }
                let at = (r * nb + i) * D_LANES;
                self.d[at..at + D_LANES].fill(f16_at(b, 0));
                if sums {
                    self.s[i * n_rows + r] = f16_at(b, 2);
                }
            }
        }
    }
}

fn grow<T: Default + Clone>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}
