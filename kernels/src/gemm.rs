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

use crate::pool::{SharedMut, ThreadPool};
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
    /// `n_rows * nb * LANE_SUMS` negated sums of 4 consecutive quants (the groups `vpdpbusd`
    /// adds into one lane), laid out as `d`. Kernels that make a signed weight format unsigned
    /// (w + 2^k) start each lane at `2^k` times this, so the lane's exact integer sum is still
    /// Σ w·a.
    pub(crate) ls: Vec<i32>,
}

/// Lane sums per block in `GemmActs::ls` (32 quants, 4 per lane).
pub const LANE_SUMS: usize = QK / 4;

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
    /// `nb` blocks, on the calling thread.
    ///
    /// # Panics
    /// When `ty` is not Q8_0/Q8_1 or `src` is shorter than the rows.
    pub fn prepare(&mut self, ty: GgmlType, src: &[u8], stride: usize, n_rows: usize, nb: usize) {
        self.prepare_on(None, ty, src, stride, n_rows, nb);
    }

    /// As `prepare`, the rows split among `pool`'s threads when there is one (a prefill batch
    /// is laid out once per matrix product: on one thread it was a serial step of every one).
    pub fn prepare_on(
        &mut self,
        pool: Option<&ThreadPool>,
        ty: GgmlType,
        src: &[u8],
        stride: usize,
        n_rows: usize,
        nb: usize,
    ) {
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
        grow(&mut self.ls, n_rows * nb * LANE_SUMS);
        if sums {
            grow(&mut self.s, nb * n_rows + S_PAD);
        }
        let (q, d, ls) = (
            SharedMut::new(&mut self.q),
            SharedMut::new(&mut self.d),
            SharedMut::new(&mut self.ls),
        );
        let s = SharedMut::new(&mut self.s);
        let row = |r: usize| {
            let src = &src[r * stride..r * stride + nb * block];
            // SAFETY: row r's ranges of q, d and ls, and its sums (index i * n_rows + r), are
            // written by this call alone; the buffers hold every row (grown above).
            let (q, d, ls) = unsafe {
                (
                    q.slice(r * nb * QK..(r + 1) * nb * QK),
                    d.slice(r * nb * D_LANES..(r + 1) * nb * D_LANES),
                    ls.slice(r * nb * LANE_SUMS..(r + 1) * nb * LANE_SUMS),
                )
            };
            for (i, b) in src.chunks_exact(block).enumerate() {
                let quants = &b[qs..qs + QK];
                for (dst, &v) in q[i * QK..(i + 1) * QK].iter_mut().zip(quants) {
                    *dst = v as i8;
                }
                d[i * D_LANES..(i + 1) * D_LANES].fill(f16_at(b, 0));
                for (dst, four) in ls[i * LANE_SUMS..(i + 1) * LANE_SUMS]
                    .iter_mut()
                    .zip(quants.chunks_exact(4))
                {
                    *dst = -four.iter().map(|&v| i32::from(v as i8)).sum::<i32>();
                }
                if sums {
                    // SAFETY: as above.
                    unsafe { s.slice(i * n_rows + r..i * n_rows + r + 1)[0] = f16_at(b, 2) };
                }
            }
        };
        match pool {
            Some(pool) => pool.for_ranges(n_rows, PARALLEL_ROWS, &|rs| rs.for_each(row)),
            None => (0..n_rows).for_each(row),
        }
    }
}

/// Rows a thread lays out at a time (batches this small stay on the calling thread).
const PARALLEL_ROWS: usize = 8;

fn grow<T: Default + Clone>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}
