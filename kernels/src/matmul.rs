//! Quantized matrix products: weights `W` (`n_out` rows of `n_in` elements, in a GGUF block
//! format) times activations `X` (`n_rows` rows of `n_in` f32).
//!
//! Activations are quantized once per call into each weight type's `vec_dot_type`; each
//! weight row is then loaded once and used against every activation row (in register tiles
//! when the ISA has `vec_dot_multi`). Several matrices sharing one input (Q/K/V, gate/up) go
//! in one call, so the threads meet once. Weight rows are handed to the pool's threads in
//! chunks, dynamically. Nothing is allocated once the buffers have grown to their working size.

use crate::dispatch::{kernels, TypeKernels};
use crate::gemm::GemmActs;
use crate::pool::{Chunks, SharedMut, ThreadPool};
use crate::repack::ALIGN;
use crate::types::GgmlType;

/// A weight matrix in a GGUF block format: `n_out` rows of `n_in` elements.
#[derive(Clone, Copy)]
pub struct QMatrix<'a> {
    pub ty: GgmlType,
    pub n_in: usize,
    pub n_out: usize,
    pub data: &'a [u8],
    /// The rows are repacked into panels (`crate::repack`), for `TypeKernels::gemm_packed`.
    pub packed: bool,
}

impl std::fmt::Debug for QMatrix<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "QMatrix({} {}x{}, {} bytes{})",
            self.ty,
            self.n_out,
            self.n_in,
            self.data.len(),
            if self.packed { ", in panels" } else { "" }
        )
    }
}

impl<'a> QMatrix<'a> {
    /// Bytes per weight row.
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.n_in).unwrap_or(0)
    }

    /// Row `i` as stored.
    ///
    /// # Panics
    /// When the rows are repacked (a panel interleaves its rows: use `dequantize_row`).
    pub fn row(&self, i: usize) -> &'a [u8] {
        assert!(
            !self.packed,
            "QMatrix::row: the rows are repacked into panels"
        );
        let rb = self.row_bytes();
        &self.data[i * rb..(i + 1) * rb]
    }

    /// Dequantizes row `i` into `out` (`n_in` values).
    pub fn dequantize_row(&self, i: usize, out: &mut [f32]) {
        let dequantize = kernels(self.ty).dequantize;
        if self.packed {
            let mut row = vec![0u8; self.row_bytes()];
            crate::repack::unpack_row(self.ty, self.n_in, self.n_out, self.data, i, &mut row);
            dequantize(&row, &mut out[..self.n_in]);
        } else {
            dequantize(self.row(i), &mut out[..self.n_in]);
        }
    }
}

/// Reusable scratch for quantized activations, one buffer per activation format.
#[derive(Default, Debug)]
pub struct ActBuffer {
    bufs: Vec<(GgmlType, Vec<u8>)>,
    /// The same rows laid out for the GEMM kernels (prefill), one per activation format.
    gemm: Vec<GemmActs>,
}

impl ActBuffer {
    pub fn new() -> ActBuffer {
        ActBuffer::default()
    }

    /// Makes room for `n_rows` rows of `n_in` elements in every activation format (call at
    /// set-up with the largest shapes so the per-token loop never allocates).
    pub fn reserve(&mut self, n_in: usize, n_rows: usize) {
        for ty in [
            GgmlType::F32,
            GgmlType::Q8_0,
            GgmlType::Q8_1,
            GgmlType::Q8_K,
        ] {
            let need = ty
                .row_bytes(n_in.next_multiple_of(ty.block_size()))
                .unwrap_or(0)
                * n_rows;
            self.get_mut(ty, need);
        }
    }

    fn get_mut(&mut self, ty: GgmlType, len: usize) -> &mut Vec<u8> {
        let i = match self.bufs.iter().position(|(t, _)| *t == ty) {
            Some(i) => i,
            None => {
                self.bufs.push((ty, Vec::new()));
                self.bufs.len() - 1
            }
        };
        let b = &mut self.bufs[i].1;
        if b.len() < len {
            b.resize(len, 0);
        }
        b
    }

    fn get(&self, ty: GgmlType) -> &[u8] {
        quantized(&self.bufs, ty)
    }
}

/// The quantized rows held for activation format `ty` (empty when none are).
fn quantized(bufs: &[(GgmlType, Vec<u8>)], ty: GgmlType) -> &[u8] {
    bufs.iter()
        .find(|(t, _)| *t == ty)
        .map_or(&[][..], |(_, b)| b.as_slice())
}

/// One product of a call to `matmul_many`: `out[r * w.n_out + o] = dot(W[o], X[r])`.
pub struct MatJob<'w, 'o> {
    pub w: QMatrix<'w>,
    pub out: &'o mut [f32],
}

/// Products per `matmul_many` call (Q/K/V is the most we need).
pub const MAX_JOBS: usize = 4;

/// Rows of activations per register tile.
const TILE: usize = 8;

/// Most weight rows a pool chunk holds.
const MAX_CHUNK: usize = 64;

/// Batches up to this many rows use the decode kernels (see `rows_times_acts`).
const SMALL_BATCH: usize = 8;

/// Batches at most this size quantize their activations on the calling thread.
const SERIAL_QUANTIZE_ROWS: usize = 4;

/// `out[r * n_out + o] = dot(W[o], X[r])` for every activation row `r` and weight row `o`.
/// `x` holds `n_rows` rows of `w.n_in` f32; `out` holds `n_rows * w.n_out` values.
pub fn matmul(
    pool: &ThreadPool,
    w: &QMatrix,
    x: &[f32],
    n_rows: usize,
    out: &mut [f32],
    acts: &mut ActBuffer,
) {
    matmul_many(pool, &mut [MatJob { w: *w, out }], x, n_rows, acts);
}

/// Several products of the same input `x` (`n_rows` rows of `n_in`), in one pass of the pool.
pub fn matmul_many(
    pool: &ThreadPool,
    jobs: &mut [MatJob],
    x: &[f32],
    n_rows: usize,
    acts: &mut ActBuffer,
) {
    let Some(first) = jobs.first() else { return };
    let n_in = first.w.n_in;
    assert_eq!(x.len(), n_rows * n_in, "matmul: activation shape");
    // Quantize the input once per activation format the jobs need.
    let mut formats: [Option<GgmlType>; 4] = [None; 4];
    for job in jobs.iter() {
        assert_eq!(
            job.w.n_in, n_in,
            "matmul_many: jobs must share the input width"
        );
        assert!(
            job.out.len() >= n_rows * job.w.n_out,
            "matmul: output too small"
        );
        assert!(
            job.w.data.len() >= job.w.n_out * job.w.row_bytes(),
            "matmul: weight data too short"
        );
        let at = kernels(job.w.ty).vec_dot_type;
        if !formats.contains(&Some(at)) {
            if let Some(slot) = formats.iter_mut().find(|s| s.is_none()) {
                *slot = Some(at);
            }
        }
    }
    for at in formats.into_iter().flatten() {
        let stride = at.row_bytes(n_in).unwrap_or_else(|| {
            panic!("matmul: {n_in} columns is not a whole number of {at} blocks")
        });
        let buf = &mut acts.get_mut(at, stride * n_rows)[..stride * n_rows];
        let quantize = kernels(at).quantize;
        if n_rows <= SERIAL_QUANTIZE_ROWS || pool.n_threads() == 1 {
            for (r, dst) in buf.chunks_exact_mut(stride).enumerate() {
                quantize(&x[r * n_in..(r + 1) * n_in], dst);
            }
        } else {
            let dst = SharedMut::new(buf);
            pool.for_ranges(n_rows, 1, &|r| {
                for row in r {
                    // SAFETY: each row index is handed to exactly one thread.
                    let d = unsafe { dst.slice(row * stride..(row + 1) * stride) };
                    quantize(&x[row * n_in..(row + 1) * n_in], d);
                }
            });
        }
    }
    // Rows laid out once more for the GEMM kernels of the formats that have one, whatever the
    // batch size (bit-identical to the decode kernel, so the choice never changes a result).
    // One row included: laying it out costs little, and the GEMM's 4-row tiles with two
    // blocks per 512-bit register (the signed formats made unsigned, no sign trick) decode
    // faster than the AVX2 kernel (Gemma 3 270M tg64 on a Zen 5 EPYC, 2 threads: 95.6 -> 120.3
    // tok/s; 1 thread 77.8 -> 86.6).
    {
        for at in formats.into_iter().flatten() {
            if !jobs
                .iter()
                .any(|j| kernels(j.w.ty).gemm.is_some() && kernels(j.w.ty).vec_dot_type == at)
            {
                continue;
            }
            let stride = at.row_bytes(n_in).unwrap_or(0);
            let slot = match acts.gemm.iter().position(|g| g.ty() == Some(at)) {
                Some(i) => i,
                None => {
                    acts.gemm.push(GemmActs::new());
                    acts.gemm.len() - 1
                }
            };
            let src = quantized(&acts.bufs, at);
            acts.gemm[slot].prepare_on(
                Some(pool),
                at,
                &src[..stride * n_rows],
                stride,
                n_rows,
                n_in / at.block_size(),
            );
        }
    }
    // One pool pass over the rows of every job.
    #[derive(Clone, Copy)]
    struct Part<'a> {
        w: QMatrix<'a>,
        k: &'static TypeKernels,
        a: &'a [u8],
        a_stride: usize,
        /// The batch in the GEMM layout, when this job's kernel takes it.
        g: Option<&'a GemmActs>,
        out: SharedMut<f32>,
        /// First global row index of this job.
        start: usize,
    }
    assert!(
        jobs.len() <= MAX_JOBS,
        "matmul_many: at most {MAX_JOBS} jobs"
    );
    let mut parts: [Option<Part>; MAX_JOBS] = [None; MAX_JOBS];
    let mut total = 0usize;
    for (slot, job) in parts.iter_mut().zip(jobs.iter_mut()) {
        // Every job starts on a panel boundary of the pool's row space, and chunks are whole
        // panels, so a chunk never splits a repacked panel (the gap rows are skipped).
        total = total.next_multiple_of(ALIGN);
        let k = kernels(job.w.ty);
        assert!(
            !job.w.packed || crate::repack::available(job.w.ty),
            "matmul: {} weights are repacked but this CPU's table has no kernel for panels",
            job.w.ty
        );
        let at = k.vec_dot_type;
        let a_stride = at.row_bytes(n_in).unwrap_or(0);
        *slot = Some(Part {
            w: job.w,
            k,
            a: &acts.get(at)[..a_stride * n_rows],
            a_stride,
            g: if k.gemm.is_some() {
                acts.gemm
                    .iter()
                    .find(|g| g.ty() == Some(at) && g.n_rows() == n_rows)
            } else {
                None
            },
            out: SharedMut::new(job.out),
            start: total,
        });
        total += job.w.n_out;
    }
    let chunk = (total / (pool.n_threads() * 16))
        .clamp(ALIGN, MAX_CHUNK)
        .next_multiple_of(ALIGN);
    let chunks = Chunks::new(total, chunk);
    pool.run(&|_| {
        let mut tile = [0f32; TILE];
        while let Some(range) = chunks.next_range() {
            let mut g = range.start;
            while g < range.end {
                // The job holding global row g, and the rows of it inside this chunk.
                let Some(p) = parts.iter().flatten().rfind(|p| p.start <= g) else {
                    return;
                };
                if g >= p.start + p.w.n_out {
                    // A gap before the next job's panel boundary.
                    g = parts
                        .iter()
                        .flatten()
                        .find(|q| q.start > g)
                        .map_or(range.end, |q| q.start.min(range.end));
                    continue;
                }
                let end = range.end.min(p.start + p.w.n_out);
                rows_times_acts(
                    p.w,
                    p.k,
                    p.a,
                    p.a_stride,
                    p.g,
                    n_rows,
                    g - p.start..end - p.start,
                    p.out,
                    &mut tile,
                );
                g = end;
            }
        }
    });
}

thread_local! {
    /// A chunk of repacked rows back in the GGUF layout, for the kernels that read rows.
    static ROWS: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Weight rows `rows` of `w` against all `n_rows` activation rows.
#[allow(clippy::too_many_arguments)]
fn rows_times_acts(
    w: QMatrix,
    k: &TypeKernels,
    a: &[u8],
    a_stride: usize,
    g: Option<&GemmActs>,
    n_rows: usize,
    rows: std::ops::Range<usize>,
    out: SharedMut<f32>,
    tile: &mut [f32; TILE],
) {
    let rb = w.row_bytes();
    let Some(dot_panels) = k.dot_panels.filter(|_| w.packed) else {
        let ws = &w.data[rows.start * rb..rows.end * rb];
        return rows_times_acts_in(w, ws, k, a, a_stride, g, n_rows, rows, out, tile);
    };
    assert!(
        rows.start.is_multiple_of(ALIGN),
        "matmul: a chunk of repacked rows starts inside a panel"
    );
    let mp = rows
        .end
        .min(crate::repack::packed_rows(w.ty, w.n_out))
        .saturating_sub(rows.start);
    if n_rows == 1 {
        // Decode: the chunk's whole panels in the panel kernel, rows after the matrix's last
        // panel (in the GGUF layout) in the row kernels.
        // SAFETY: output rows `rows` belong to this chunk alone.
        let o = unsafe { out.slice(rows.clone()) };
        if mp > 0 {
            dot_panels(
                w.n_in,
                &w.data[rows.start * rb..(rows.start + mp) * rb],
                a,
                &mut o[..mp],
            );
        }
        let tail = rows.start + mp..rows.end;
        if !tail.is_empty() {
            let ws = &w.data[tail.start * rb..tail.end * rb];
            let rows_w = QMatrix { packed: false, ..w };
            rows_times_acts_in(rows_w, ws, k, a, a_stride, g, 1, tail, out, tile);
        }
        return;
    }
    if let Some(gemm_panels) = k.gemm_panels {
        // A batch over the panels themselves (MXFP4): slabs of `SMALL_BATCH` activation rows
        // against the chunk's whole panels, the rows after the last panel in the row kernels.
        // The bits of `dot_panels` for every pair, so a row's result does not depend on its
        // batch.
        let m = rows.len();
        assert!(m <= MAX_CHUNK, "matmul: a chunk of {m} repacked rows");
        let mut buf = [0f32; SMALL_BATCH * MAX_CHUNK];
        for r0 in (0..n_rows).step_by(SMALL_BATCH) {
            let nr = (n_rows - r0).min(SMALL_BATCH);
            if mp > 0 {
                gemm_panels(
                    w.n_in,
                    &w.data[rows.start * rb..(rows.start + mp) * rb],
                    mp,
                    &a[r0 * a_stride..],
                    a_stride,
                    nr,
                    &mut buf,
                    m,
                );
            }
            for r in 0..nr {
                let at = (r0 + r) * w.n_out;
                // SAFETY: output rows `rows` of activation row r0 + r belong to this chunk.
                let o = unsafe { out.slice(at + rows.start..at + rows.start + mp) };
                o.copy_from_slice(&buf[r * m..r * m + mp]);
            }
        }
        let tail = rows.start + mp..rows.end;
        if !tail.is_empty() {
            let ws = &w.data[tail.start * rb..tail.end * rb];
            let rows_w = QMatrix { packed: false, ..w };
            rows_times_acts_in(rows_w, ws, k, a, a_stride, g, n_rows, tail, out, tile);
        }
        return;
    }
    // A batch: the chunk's rows back in the GGUF layout once, then the batch kernels (the
    // copy is a small part of a batch's work per row; decode never takes this path).
    ROWS.with_borrow_mut(|buf| {
        buf.resize(rows.len() * rb, 0);
        crate::repack::unpack_rows(w.ty, w.n_in, w.n_out, w.data, rows.clone(), buf);
        let rows_w = QMatrix { packed: false, ..w };
        rows_times_acts_in(rows_w, buf, k, a, a_stride, g, n_rows, rows, out, tile);
    });
}

/// Weight rows `rows` of `w`, whose bytes are `ws` (in the GGUF layout unless `w.packed` and
/// the kernel reads panels), against all `n_rows` activation rows.
#[allow(clippy::too_many_arguments)]
fn rows_times_acts_in(
    w: QMatrix,
    ws: &[u8],
    k: &TypeKernels,
    a: &[u8],
    a_stride: usize,
    g: Option<&GemmActs>,
    n_rows: usize,
    rows: std::ops::Range<usize>,
    out: SharedMut<f32>,
    tile: &mut [f32; TILE],
) {
    let n_in = w.n_in;
    let n_out = w.n_out;
    let rb = w.row_bytes();
    if n_rows == 1 && g.is_none() {
        // Decode without a GEMM kernel: one activation row; write the chunk's outputs as one slice.
        // SAFETY: output rows `rows` belong to this chunk alone.
        let o = unsafe { out.slice(rows.clone()) };
        match k.vec_dot_rows {
            Some(f) => f(n_in, ws, rb, a, o),
            None => {
                for (ov, wrow) in o.iter_mut().zip(ws.chunks_exact(rb)) {
                    *ov = (k.vec_dot)(n_in, wrow, a);
                }
            }
        }
        return;
    }
    if let (Some(f), Some(g)) = (k.gemm, g) {
        if rows.len() <= MAX_CHUNK {
            // Prefill and batched decode: slabs of `SMALL_BATCH` activation rows against the
            // chunk's weight rows in register tiles; the chunk's weights stay in L1/L2 across
            // slabs. Bit-identical to the decode kernel for every pair.
            let m = rows.len();
            // Repacked rows: the whole panels through the panel kernel, the rows after the
            // last panel (in the GGUF layout) through `f`.
            let (fp, mp) = match (w.packed, k.gemm_packed) {
                (true, Some(fp)) => {
                    assert!(
                        rows.start.is_multiple_of(ALIGN),
                        "matmul: a chunk of repacked rows starts inside a panel"
                    );
                    let mp = rows
                        .end
                        .min(crate::repack::packed_rows(w.ty, n_out))
                        .saturating_sub(rows.start);
                    (Some(fp), mp)
                }
                _ => (None, 0),
            };
            let mut buf = [0f32; SMALL_BATCH * MAX_CHUNK];
            let mut r0 = 0;
            while r0 < n_rows {
                let nr = (n_rows - r0).min(SMALL_BATCH);
                if let Some(fp) = fp.filter(|_| mp > 0) {
                    fp(n_in, ws, rb, mp, g, r0, nr, &mut buf[..nr * m], m);
                }
                if mp < m {
                    let len = (nr - 1) * m + m - mp;
                    f(
                        n_in,
                        &ws[mp * rb..],
                        rb,
                        m - mp,
                        g,
                        r0,
                        nr,
                        &mut buf[mp..mp + len],
                        m,
                    );
                }
                for r in 0..nr {
                    let at = (r0 + r) * n_out;
                    // SAFETY: output rows `rows` of activation row r0 + r belong to this chunk.
                    let o = unsafe { out.slice(at + rows.start..at + rows.end) };
                    o.copy_from_slice(&buf[r * m..(r + 1) * m]);
                }
                r0 += nr;
            }
            return;
        }
    }
    assert!(
        !w.packed,
        "matmul: repacked {} rows reached a kernel that reads rows",
        w.ty
    );
    if let Some(f) = k.kgemm.filter(|_| n_rows > SMALL_BATCH) {
        // K-quant prefill: the chunk's rows unpacked once into tiles, each tile against
        // every activation row (`crate::ktile`). The reference's bits, as every other path.
        f(
            n_in,
            ws,
            rb,
            rows.len(),
            a,
            a_stride,
            n_rows,
            &mut |c, o0, v| {
                let at = c * n_out + rows.start + o0;
                // SAFETY: output rows `rows` of every activation row belong to this chunk.
                unsafe { out.slice(at..at + v.len()) }.copy_from_slice(v);
            },
        );
        return;
    }
    if n_rows <= SMALL_BATCH {
        match k.vec_dot_tile {
            Some(f) if rows.len() <= MAX_CHUNK => {
                // A few activation rows: 2 × 2 tiles share each weight block's unpacking and
                // each activation block's load; bit-identical to the single-row decode kernel.
                let m = rows.len();
                let mut buf = [0f32; SMALL_BATCH * MAX_CHUNK];
                f(
                    n_in,
                    ws,
                    rb,
                    m,
                    a,
                    a_stride,
                    n_rows,
                    &mut buf[..n_rows * m],
                    m,
                );
                for r in 0..n_rows {
                    // SAFETY: output rows `rows` of activation row r belong to this chunk alone.
                    let o = unsafe { out.slice(r * n_out + rows.start..r * n_out + rows.end) };
                    o.copy_from_slice(&buf[r * m..(r + 1) * m]);
                }
                return;
            }
            _ => {}
        }
        if let Some(f) = k.vec_dot_rows {
            // A few activation rows (decode of several sequences): the decode kernel once per
            // activation row over this chunk of weight rows. The chunk is small enough to stay
            // in L1/L2 after the first pass, so the weights still stream from memory once, and
            // every row's result is bit-identical to its single-row decode.
            for r in 0..n_rows {
                // SAFETY: output rows `rows` of activation row r belong to this chunk alone.
                let o = unsafe { out.slice(r * n_out + rows.start..r * n_out + rows.end) };
                f(n_in, ws, rb, &a[r * a_stride..(r + 1) * a_stride], o);
            }
            return;
        }
    }
    // Slabs of `TILE` activation rows against every weight row of the chunk: the slab stays
    // in L1 while the chunk's weight rows (a few KiB each) come from L2 in turn. The other
    // order re-read every activation row from L2 for each weight row: a llama3-1b Q4_K_M
    // shape's pp512 went from 72-74 to 105-107 tok/s at 1 thread on a Zen 5 EPYC (139-142 to
    // 193-208 at 2). The same products, so the same bits.
    let mut r0 = 0;
    while r0 < n_rows {
        let nr = (n_rows - r0).min(TILE);
        let arows = &a[r0 * a_stride..(r0 + nr) * a_stride];
        for o in rows.clone() {
            let wrow = &ws[(o - rows.start) * rb..(o - rows.start + 1) * rb];
            match k.vec_dot_multi {
                Some(multi) if nr > 1 => multi(n_in, wrow, arows, a_stride, &mut tile[..nr]),
                _ => {
                    for (j, t) in tile[..nr].iter_mut().enumerate() {
                        *t = (k.vec_dot)(n_in, wrow, &arows[j * a_stride..(j + 1) * a_stride]);
                    }
                }
            }
            for (j, t) in tile[..nr].iter().enumerate() {
                let idx = (r0 + j) * n_out + o;
                // SAFETY: output column `o` belongs to this chunk alone.
                unsafe { out.slice(idx..idx + 1)[0] = *t };
            }
        }
        r0 += nr;
    }
}

/// Dequantizes row `row` of a matrix stored in `ty` (an embedding lookup).
pub fn dequantize_row(ty: GgmlType, data: &[u8], n_in: usize, row: usize, out: &mut [f32]) {
    QMatrix {
        ty,
        n_in,
        n_out: row + 1,
        data,
        packed: false,
    }
    .dequantize_row(row, out);
}
