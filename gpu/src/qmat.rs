//! Quantized weight matrices on the device and the matmul kernels over them.
//!
//! A [`QMatrix`] keeps the GGUF bits of every block, rearranged for 16-byte loads: each
//! buffer (a chunk of rows) holds region A, a multiple of 16 bytes a block (the quants of
//! the legacy formats and Q6_K, whole Q4_K and Q5_K blocks), then region B from the next
//! 16-byte boundary (the f16 scales of the legacy formats, Q6_K's scales and d), packed.
//! Float rows are padded with zeros to a multiple of 32 values. Q4_0 and Q8_0 thus take
//! their GGUF size (18 and 34 bytes a block) on the device, as Q2_K (84); Q5_0, Q6_K and
//! Q3_K 2 bytes more.
//! The shaders decode every format in units of 32 values (one legacy block, one K-quant
//! sub-block, 32 floats); the dequantized values are the bits of `ringllm_kernels`'
//! scalar `dequantize` (every product there is either a single rounding or exact in f32,
//! so the shader compiler's fused multiply-adds cannot change them; checked by the tests).
//!
//! [`Matmul::encode`] records `y = x·Wᵀ`: a dequant-matvec kernel for one activation row
//! (decode, see `shaders/matmul_matvec.wgsl` for its design and roofline), a tiled kernel
//! for several (prefill). A matrix larger than the device's largest storage binding is
//! split by rows into several buffers, one dispatch each.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ringllm_kernels::GgmlType;

use crate::device::{Gpu, GpuError};

/// Values per shader unit (one legacy block, one K-quant sub-block, 32 floats).
const UNIT: usize = 32;
/// Rows per matvec workgroup (`MV_ROWS` in matmul_matvec.wgsl).
const MV_ROWS: usize = 16;
/// Weight rows and activation rows per tiled-matmul workgroup (`MT_R`, `MT_M`).
const MT_R: usize = 32;
const MT_M: usize = 32;
/// Invocations per workgroup of the dequantize kernel.
const WG: usize = 64;
/// Smallest subgroup the subgroup matvec takes: its 256 invocations leave partials of at
/// most 64 subgroups (WebGPU guarantees 4).
const MIN_SUBGROUP: u32 = 4;
/// Workgroups per dispatch dimension (WebGPU's minimum, what wgpu's defaults allow).
const MAX_GROUPS: u32 = 65535;

/// How a GGUF block is split on the device: byte ranges `a` of the block, in order, make
/// its `a_bytes` (a multiple of 16) in region A; ranges `b` its `b_bytes` (zero-padded) in
/// region B.
#[derive(Clone, Copy, Debug)]
struct Split {
    a: &'static [(usize, usize)],
    a_bytes: usize,
    b: &'static [(usize, usize)],
    b_bytes: usize,
}

/// The device split of a quantized type, `None` for float types (rows of plain values)
/// and for the types we do not run on the GPU.
fn split(ty: GgmlType) -> Option<Split> {
    let s = |a, a_bytes, b, b_bytes| Split {
        a,
        a_bytes,
        b,
        b_bytes,
    };
    Some(match ty {
        GgmlType::Q4_0 => s(&[(2, 18)], 16, &[(0, 2)], 2),
        GgmlType::Q4_1 => s(&[(4, 20)], 16, &[(0, 4)], 4),
        // qh, then d and two zero bytes.
        GgmlType::Q5_0 => s(&[(6, 22)], 16, &[(2, 6), (0, 2)], 8),
        GgmlType::Q5_1 => s(&[(8, 24)], 16, &[(0, 8)], 8),
        GgmlType::Q8_0 => s(&[(2, 34)], 32, &[(0, 2)], 2),
        GgmlType::Q4_K => s(&[(0, 144)], 144, &[], 0),
        GgmlType::Q5_K => s(&[(0, 176)], 176, &[], 0),
        // ql and qh; the 16 scales, then d and two zero bytes.
        GgmlType::Q6_K => s(&[(0, 192)], 192, &[(192, 210)], 20),
        // qs; the 16 scale bytes, then d and dmin.
        GgmlType::Q2_K => s(&[(16, 80)], 64, &[(0, 16), (80, 84)], 20),
        // hmask and qs; the 12 scale bytes, then d and two zero bytes.
        GgmlType::Q3_K => s(&[(0, 96)], 96, &[(96, 110)], 16),
        GgmlType::IQ4_NL => s(&[(2, 18)], 16, &[(0, 2)], 2),
        // The 128 index bytes; d, scales_h and scales_l.
        GgmlType::IQ4_XS => s(&[(8, 136)], 128, &[(0, 8)], 8),
        // The 16 code bytes; the scale byte.
        GgmlType::MXFP4 => s(&[(1, 17)], 16, &[(0, 1)], 1),
        _ => return None,
    })
}

/// Device bytes of a chunk of `rows` rows of `cols` values of `ty` (a multiple of 16).
fn chunk_bytes(ty: GgmlType, rows: usize, cols: usize) -> Option<usize> {
    match split(ty) {
        Some(sp) => {
            let nb = rows.checked_mul(cols / ty.block_size())?;
            let b = nb.checked_mul(sp.b_bytes)?.checked_next_multiple_of(16)?;
            nb.checked_mul(sp.a_bytes)?.checked_add(b)
        }
        None if ty.is_float() => rows
            .checked_mul(cols.div_ceil(UNIT))?
            .checked_mul(UNIT * ty.type_size()),
        None => None,
    }
}

/// The device layout of GGUF rows `src` (`row_bytes` each) in `dst` (`chunk_bytes` long,
/// zeroed); returns the word offset of region B.
fn relayout(ty: GgmlType, src: &[u8], row_bytes: usize, dst: &mut [u8]) -> usize {
    match split(ty) {
        None => {
            let dev_row = dst.len() / (src.len() / row_bytes);
            for (s, d) in src
                .chunks_exact(row_bytes)
                .zip(dst.chunks_exact_mut(dev_row))
            {
                d[..row_bytes].copy_from_slice(s);
            }
            0
        }
        Some(sp) => {
            let size = ty.type_size();
            let nb = src.len() / size;
            let (ra, rb) = dst.split_at_mut(nb * sp.a_bytes);
            for (i, blk) in src.chunks_exact(size).enumerate() {
                let mut o = i * sp.a_bytes;
                for &(x, y) in sp.a {
                    ra[o..o + y - x].copy_from_slice(&blk[x..y]);
                    o += y - x;
                }
                let mut o = i * sp.b_bytes;
                for &(x, y) in sp.b {
                    rb[o..o + y - x].copy_from_slice(&blk[x..y]);
                    o += y - x;
                }
            }
            nb * sp.a_bytes / 4
        }
    }
}

/// The shader source of a format's `unit` function, `None` when unsupported.
fn unit_source(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => include_str!("shaders/quant_f32.wgsl"),
        GgmlType::F16 => include_str!("shaders/quant_f16.wgsl"),
        GgmlType::BF16 => include_str!("shaders/quant_bf16.wgsl"),
        GgmlType::Q4_0 => include_str!("shaders/quant_q4_0.wgsl"),
        GgmlType::Q4_1 => include_str!("shaders/quant_q4_1.wgsl"),
        GgmlType::Q5_0 => include_str!("shaders/quant_q5_0.wgsl"),
        GgmlType::Q5_1 => include_str!("shaders/quant_q5_1.wgsl"),
        GgmlType::Q8_0 => include_str!("shaders/quant_q8_0.wgsl"),
        GgmlType::Q4_K => include_str!("shaders/quant_q4_k.wgsl"),
        GgmlType::Q5_K => include_str!("shaders/quant_q5_k.wgsl"),
        GgmlType::Q6_K => include_str!("shaders/quant_q6_k.wgsl"),
        GgmlType::IQ4_NL => include_str!("shaders/quant_iq4_nl.wgsl"),
        GgmlType::IQ4_XS => include_str!("shaders/quant_iq4_xs.wgsl"),
        GgmlType::MXFP4 => include_str!("shaders/quant_mxfp4.wgsl"),
        GgmlType::Q8_1 | GgmlType::Q8_K => return None,
        GgmlType::Q2_K => include_str!("shaders/quant_q2_k.wgsl"),
        GgmlType::Q3_K => include_str!("shaders/quant_q3_k.wgsl"),
    })
}

/// Every weight type the GPU matmul runs (all of `GgmlType` but the activation-only Q8_1
/// and Q8_K).
pub const GPU_TYPES: [GgmlType; 16] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
];

/// One buffer of consecutive rows of a matrix.
struct Chunk {
    buf: wgpu::Buffer,
    row0: usize,
    rows: usize,
    /// Word offset of region B.
    soff: u32,
}

/// A weight matrix on the device: `rows` rows of `cols` values of type `ty`.
pub struct QMatrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    chunks: Vec<Chunk>,
    /// Units of 32 values per row.
    upr: u32,
}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QMatrix")
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("chunks", &self.chunks.len())
            .finish()
    }
}

impl QMatrix {
    /// Uploads a GGUF tensor: `rows` rows of `cols` values, `bytes` exactly
    /// `ty.row_bytes(cols) * rows` in the file's block layout. Errors (`GpuError::Invalid`)
    /// name the tensor (`label`) for unsupported types, shapes and wrong lengths. A matrix
    /// larger than the device's largest storage binding is split by rows into several buffers.
    pub fn upload(
        gpu: &Gpu,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
        label: &str,
    ) -> Result<QMatrix, GpuError> {
        let limits = gpu.device().limits();
        let max = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size);
        Self::upload_with_limit(gpu, ty, rows, cols, bytes, label, max)
    }

    /// [`QMatrix::upload`] with buffers of at most `max_chunk_bytes` bytes (tests of the
    /// row split use a small limit; `upload` passes the device's).
    #[doc(hidden)]
    pub fn upload_with_limit(
        gpu: &Gpu,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
        label: &str,
        max_chunk_bytes: u64,
    ) -> Result<QMatrix, GpuError> {
        let bad = |why: String| GpuError::Invalid(format!("weight matrix {label} ({ty}): {why}"));
        if unit_source(ty).is_none() {
            return Err(bad(format!(
                "type {ty} is not a weight format the GPU matmul supports (supported: {})",
                GPU_TYPES.map(|t| t.name()).join(", ")
            )));
        }
        if rows == 0 || cols == 0 {
            return Err(bad(format!("empty shape {rows} × {cols}")));
        }
        let row_bytes = ty.row_bytes(cols).ok_or_else(|| {
            bad(format!(
                "{cols} columns are not a whole number of {}-value blocks",
                ty.block_size()
            ))
        })?;
        let want = row_bytes
            .checked_mul(rows)
            .ok_or_else(|| bad(format!("{rows} rows × {row_bytes} bytes overflow")))?;
        if bytes.len() != want {
            return Err(bad(format!(
                "{} bytes given, {rows} rows × {cols} columns need {want}",
                bytes.len()
            )));
        }
        // Device bytes of a row, without region B's rounding to 16 bytes.
        let dev_row = match split(ty) {
            Some(sp) => (cols / ty.block_size()).checked_mul(sp.a_bytes + sp.b_bytes),
            None => chunk_bytes(ty, 1, cols),
        }
        .ok_or_else(|| bad(format!("{cols} columns overflow the device layout")))?;
        // Shader indices are u32 words within a chunk: keep every chunk below 2³¹ bytes.
        let limit = max_chunk_bytes.min(1 << 31);
        let fits = |r: usize| chunk_bytes(ty, r, cols).is_some_and(|b| b as u64 <= limit);
        let mut rows_per_chunk = ((limit / dev_row as u64) as usize).min(rows);
        while rows_per_chunk > 0 && !fits(rows_per_chunk) {
            rows_per_chunk -= 1;
        }
        if rows_per_chunk == 0 {
            return Err(bad(format!(
                "one row takes {dev_row} device bytes, more than a buffer binding allows ({limit})"
            )));
        }
        let upr = u32::try_from(cols.div_ceil(UNIT)).map_err(|_| bad("too many columns".into()))?;
        let mut chunks = Vec::new();
        let mut row0 = 0;
        while row0 < rows {
            let n = rows_per_chunk.min(rows - row0);
            let size =
                chunk_bytes(ty, n, cols).ok_or_else(|| bad("chunk size overflows".into()))?;
            let mut dev = vec![0u8; size];
            let soff = relayout(
                ty,
                &bytes[row0 * row_bytes..(row0 + n) * row_bytes],
                row_bytes,
                &mut dev,
            );
            let buf = gpu.storage_init(&format!("{label} rows {row0}..{}", row0 + n), &dev)?;
            chunks.push(Chunk {
                buf,
                row0,
                rows: n,
                soff: u32::try_from(soff).map_err(|_| bad("chunk too large".into()))?,
            });
            row0 += n;
        }
        tracing::debug!(label, %ty, rows, cols, chunks = chunks.len(), "weight matrix uploaded");
        Ok(QMatrix {
            ty,
            rows,
            cols,
            chunks,
            upr,
        })
    }

    /// Bytes the matrix takes on the device (all its buffers).
    pub fn device_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.buf.size()).sum()
    }

    /// How many buffers hold the matrix (more than one when it exceeds a storage binding).
    pub fn buffers(&self) -> usize {
        self.chunks.len()
    }
}

/// Which shader variant the matmul kernels use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulVariant {
    /// Matvec reductions with `subgroupAdd` (else through workgroup memory).
    pub subgroups: bool,
    /// Native f16 loads (`enable f16;`) for F16 weights instead of `unpack2x16float`; the
    /// one use of f16 (see shaders/quant_f16_native.wgsl for why no other).
    pub f16: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Matvec,
    Tiled,
    Dequant,
}

impl Kind {
    fn entry(self) -> &'static str {
        match self {
            Kind::Matvec => "matvec",
            Kind::Tiled => "matmul",
            Kind::Dequant => "dequant",
        }
    }
}

/// The uniform parameters of one dispatch (`Params` in matmul_common.wgsl).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    rows: u32,
    upr: u32,
    soff: u32,
    n: u32,
    x_off: u32,
    x_stride: u32,
    y_off: u32,
    y_stride: u32,
    row_base: u32,
    cols: u32,
    grid_x: u32,
    _pad: u32,
}

/// A grid of at least `groups` workgroups within `max` per dimension: (x, y).
fn grid(groups: usize, max: u32) -> Result<(u32, u32), GpuError> {
    let max = max as usize;
    let x = groups.clamp(1, max);
    let y = groups.div_ceil(x).max(1);
    if y > max {
        return Err(GpuError::Invalid(format!(
            "{groups} workgroups exceed a {max} × {max} grid"
        )));
    }
    Ok((x as u32, y as u32))
}

/// Compiled matmul pipelines, per (format, kernel), made on first use.
pub struct Matmul {
    variant: MatmulVariant,
    /// Workgroups per grid dimension (65535; tests lower it to exercise 2-D grids).
    max_groups: u32,
    pipes: Mutex<HashMap<(GgmlType, Kind), Arc<wgpu::ComputePipeline>>>,
}

impl Matmul {
    /// The matmul kernels in the best variant the device allows (subgroups and f16 when the
    /// device was opened with them).
    pub fn new(gpu: &Gpu) -> Result<Matmul, GpuError> {
        let s = gpu.summary();
        Self::with_variant(
            gpu,
            MatmulVariant {
                subgroups: s.subgroups.is_some_and(|n| n >= MIN_SUBGROUP),
                f16: s.f16,
            },
        )
    }

    /// The matmul kernels in `variant`; an error when it needs a feature the device lacks.
    pub fn with_variant(gpu: &Gpu, variant: MatmulVariant) -> Result<Matmul, GpuError> {
        let s = gpu.summary();
        if variant.subgroups && s.subgroups.is_none_or(|n| n < MIN_SUBGROUP) {
            return Err(GpuError::Invalid(format!(
                "matmul variant {variant:?}: {} has no subgroup operations in use with \
                 subgroups of {MIN_SUBGROUP} or more ({:?})",
                s.name, s.subgroups
            )));
        }
        if variant.f16 && !s.f16 {
            return Err(GpuError::Invalid(format!(
                "matmul variant {variant:?}: {} has no shader f16 in use",
                s.name
            )));
        }
        Ok(Matmul {
            variant,
            max_groups: MAX_GROUPS,
            pipes: Mutex::new(HashMap::new()),
        })
    }

    pub fn variant(&self) -> MatmulVariant {
        self.variant
    }

    /// Limits grids to `max` workgroups per dimension (at most 65535), so that tests reach
    /// the 2-D grids of huge matrices with small ones.
    #[doc(hidden)]
    pub fn with_grid_limit(mut self, max: u32) -> Matmul {
        self.max_groups = max.clamp(1, MAX_GROUPS);
        self
    }

    /// The WGSL module of `kind` for `ty` in this variant.
    fn source(&self, ty: GgmlType, kind: Kind) -> Result<String, GpuError> {
        let unit = unit_source(ty)
            .ok_or_else(|| GpuError::Invalid(format!("type {ty} has no GPU matmul kernel")))?;
        let mut s = String::new();
        if self.variant.f16 && ty == GgmlType::F16 {
            // Declares W as f16 and defines `unit`; `enable f16;` must come first.
            s.push_str(include_str!("shaders/quant_f16_native.wgsl"));
            s.push_str(include_str!("shaders/matmul_common.wgsl"));
        } else {
            s.push_str(include_str!("shaders/matmul_weights_u32.wgsl"));
            s.push_str(include_str!("shaders/matmul_common.wgsl"));
            s.push_str(unit);
        }
        match kind {
            Kind::Matvec => {
                s.push_str(include_str!("shaders/matmul_matvec.wgsl"));
                s.push_str(if self.variant.subgroups {
                    include_str!("shaders/matmul_reduce_subgroup.wgsl")
                } else {
                    include_str!("shaders/matmul_reduce_shared.wgsl")
                });
            }
            Kind::Tiled => s.push_str(include_str!("shaders/matmul_tiled.wgsl")),
            Kind::Dequant => s.push_str(include_str!("shaders/matmul_dequant.wgsl")),
        }
        Ok(s)
    }

    fn pipeline(
        &self,
        gpu: &Gpu,
        ty: GgmlType,
        kind: Kind,
    ) -> Result<Arc<wgpu::ComputePipeline>, GpuError> {
        let mut pipes = self
            .pipes
            .lock()
            .map_err(|_| GpuError::Invalid("matmul pipeline cache lock poisoned".into()))?;
        if let Some(p) = pipes.get(&(ty, kind)) {
            return Ok(Arc::clone(p));
        }
        let label = format!(
            "{} {ty}{}{}",
            kind.entry(),
            if self.variant.subgroups && kind == Kind::Matvec {
                " subgroups"
            } else {
                ""
            },
            if self.variant.f16 && ty == GgmlType::F16 {
                " native-f16"
            } else {
                ""
            }
        );
        let p = Arc::new(gpu.pipeline(&label, &self.source(ty, kind)?, kind.entry())?);
        pipes.insert((ty, kind), Arc::clone(&p));
        Ok(p)
    }

    /// Records y[n × rows] = x[n × cols] · Wᵀ (f32 in, f32 out) into `enc`: x holds
    /// row-major f32 rows starting at element `x_off` (row stride `w.cols`), y at element
    /// `y_off` (row stride `w.rows`). Whole buffers are bound (`x` and `y` must be different
    /// buffers); offsets go in each dispatch's uniform parameters. n = 1 runs the
    /// dequant-matvec kernel, n > 1 the tiled kernel; n = 0 records nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn encode(
        &self,
        gpu: &Gpu,
        enc: &mut wgpu::CommandEncoder,
        w: &QMatrix,
        x: &wgpu::Buffer,
        x_off: u64,
        y: &wgpu::Buffer,
        y_off: u64,
        n: u32,
    ) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let n64 = u64::from(n);
        let x_end = (w.cols as u64)
            .checked_mul(n64)
            .and_then(|v| v.checked_add(x_off));
        let y_end = (w.rows as u64)
            .checked_mul(n64)
            .and_then(|v| v.checked_add(y_off));
        let fits = |end: Option<u64>, buf: &wgpu::Buffer| {
            end.filter(|e| e.checked_mul(4).is_some_and(|b| b <= buf.size()) && *e <= 1 << 32)
        };
        let what = || format!("matmul of {n} rows by {:?}", w);
        if fits(x_end, x).is_none() {
            return Err(GpuError::Invalid(format!(
                "{}: activations end past element {:?} of a {}-byte buffer (offset {x_off})",
                what(),
                x_end,
                x.size()
            )));
        }
        if fits(y_end, y).is_none() {
            return Err(GpuError::Invalid(format!(
                "{}: outputs end past element {:?} of a {}-byte buffer (offset {y_off})",
                what(),
                y_end,
                y.size()
            )));
        }
        if x == y {
            return Err(GpuError::Invalid(format!(
                "{}: activations and outputs in one buffer (bound read-only and read-write \
                 in one dispatch); use two buffers",
                what()
            )));
        }
        let max_binding = gpu.device().limits().max_storage_buffer_binding_size;
        for (name, b) in [("activation", x), ("output", y)] {
            if !b.usage().contains(wgpu::BufferUsages::STORAGE) {
                return Err(GpuError::Invalid(format!(
                    "{}: the {name} buffer is not a storage buffer ({:?})",
                    what(),
                    b.usage()
                )));
            }
            if b.size() > max_binding {
                return Err(GpuError::Invalid(format!(
                    "{}: the {name} buffer ({} bytes) is larger than a storage binding \
                     ({max_binding} bytes); it is bound whole",
                    what(),
                    b.size()
                )));
            }
        }
        let kind = if n == 1 { Kind::Matvec } else { Kind::Tiled };
        let pipe = self.pipeline(gpu, w.ty, kind)?;
        let mut dispatches = Vec::with_capacity(w.chunks.len());
        for c in &w.chunks {
            let (groups, gz) = match kind {
                Kind::Matvec => (c.rows.div_ceil(MV_ROWS), 1),
                _ => (c.rows.div_ceil(MT_R), (n as usize).div_ceil(MT_M)),
            };
            let (gx, gy) = grid(groups, self.max_groups)?;
            let gz = u32::try_from(gz)
                .ok()
                .filter(|z| *z <= self.max_groups)
                .ok_or_else(|| GpuError::Invalid(format!("{}: too many rows", what())))?;
            let p = Params {
                rows: c.rows as u32,
                upr: w.upr,
                soff: c.soff,
                n,
                x_off: x_off as u32,
                x_stride: w.cols as u32,
                y_off: y_off as u32,
                y_stride: w.rows as u32,
                row_base: c.row0 as u32,
                cols: w.cols as u32,
                grid_x: gx,
                _pad: 0,
            };
            let bg = self.bind_group(gpu, &pipe, c, Some(x), y, &p);
            dispatches.push((bg, gx, gy, gz));
        }
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some(kind.entry()),
            timestamp_writes: None,
        });
        pass.set_pipeline(&pipe);
        for (bg, gx, gy, gz) in &dispatches {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(*gx, *gy, *gz);
        }
        Ok(())
    }

    fn bind_group(
        &self,
        gpu: &Gpu,
        pipe: &wgpu::ComputePipeline,
        c: &Chunk,
        x: Option<&wgpu::Buffer>,
        y: &wgpu::Buffer,
        p: &Params,
    ) -> wgpu::BindGroup {
        let params = gpu.uniform("matmul params", bytemuck::bytes_of(p));
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: c.buf.as_entire_binding(),
        }];
        if let Some(x) = x {
            entries.push(wgpu::BindGroupEntry {
                binding: 1,
                resource: x.as_entire_binding(),
            });
        }
        entries.push(wgpu::BindGroupEntry {
            binding: 2,
            resource: y.as_entire_binding(),
        });
        entries.push(wgpu::BindGroupEntry {
            binding: 3,
            resource: params.as_entire_binding(),
        });
        gpu.device().create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("matmul"),
            layout: &pipe.get_bind_group_layout(0),
            entries: &entries,
        })
    }

    /// The matrix dequantized by the shaders' own decoding, row-major `rows × cols` (checks
    /// that the device layout keeps the GGUF bits; debugging). Waits for the device.
    pub fn dequantize(&self, gpu: &Gpu, w: &QMatrix) -> Result<Vec<f32>, GpuError> {
        let pipe = self.pipeline(gpu, w.ty, Kind::Dequant)?;
        let stride = w.upr as usize * UNIT;
        let total = w
            .rows
            .checked_mul(stride)
            .filter(|t| *t as u64 * 4 <= gpu.device().limits().max_storage_buffer_binding_size)
            .ok_or_else(|| GpuError::Invalid(format!("dequantize {w:?}: too large")))?;
        let out = gpu.storage("dequantized", total as u64 * 4)?;
        let mut enc = gpu
            .device()
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("dequantize"),
            });
        {
            let mut dispatches = Vec::new();
            for c in &w.chunks {
                let (gx, gy) = grid((c.rows * w.upr as usize).div_ceil(WG), self.max_groups)?;
                let p = Params {
                    rows: c.rows as u32,
                    upr: w.upr,
                    soff: c.soff,
                    n: 1,
                    x_off: 0,
                    x_stride: 0,
                    y_off: 0,
                    y_stride: stride as u32,
                    row_base: c.row0 as u32,
                    cols: w.cols as u32,
                    grid_x: gx,
                    _pad: 0,
                };
                dispatches.push((self.bind_group(gpu, &pipe, c, None, &out, &p), gx, gy));
            }
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("dequantize"),
                timestamp_writes: None,
            });
            pass.set_pipeline(&pipe);
            for (bg, gx, gy) in &dispatches {
                pass.set_bind_group(0, bg, &[]);
                pass.dispatch_workgroups(*gx, *gy, 1);
            }
        }
        gpu.check_lost()?;
        gpu.queue().submit([enc.finish()]);
        let mut all = vec![0f32; total];
        gpu.read_f32(&out, 0, &mut all)?;
        if stride == w.cols {
            return Ok(all);
        }
        Ok(all
            .chunks_exact(stride)
            .flat_map(|r| r[..w.cols].iter().copied())
            .collect())
    }
}

/// Deterministic weight bytes of `ty` for benchmarks: pseudo-random quants with f16 scales
/// near 0.01 (no NaN or infinity), pseudo-random floats in (−1, 1) for float types.
#[doc(hidden)]
pub fn synthetic_weights(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Option<Vec<u8>> {
    let len = ty.row_bytes(cols)?.checked_mul(rows)?;
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut b: Vec<u8> = (0..len).map(|_| next() as u8).collect();
    let scale = |next: &mut dyn FnMut() -> u64| {
        half::f16::from_f32(0.005 + (next() % 1000) as f32 * 1e-5).to_le_bytes()
    };
    let val = |next: &mut dyn FnMut() -> u64| (next() % 2001) as f32 / 1000.0 - 1.0;
    match ty {
        GgmlType::F32 => b
            .chunks_exact_mut(4)
            .for_each(|c| c.copy_from_slice(&val(&mut next).to_le_bytes())),
        GgmlType::F16 => b
            .chunks_exact_mut(2)
            .for_each(|c| c.copy_from_slice(&half::f16::from_f32(val(&mut next)).to_le_bytes())),
        GgmlType::BF16 => b
            .chunks_exact_mut(2)
            .for_each(|c| c.copy_from_slice(&half::bf16::from_f32(val(&mut next)).to_le_bytes())),
        // Scale bytes near 2^-8 (values up to 0.05).
        GgmlType::MXFP4 => b
            .chunks_exact_mut(ty.type_size())
            .for_each(|blk| blk[0] = 118 + (next() % 4) as u8),
        _ => {
            let (size, fields): (usize, &[usize]) = match ty {
                GgmlType::Q4_0
                | GgmlType::Q5_0
                | GgmlType::Q8_0
                | GgmlType::IQ4_NL
                | GgmlType::IQ4_XS => (ty.type_size(), &[0]),
                GgmlType::Q6_K => (ty.type_size(), &[208]),
                GgmlType::Q2_K => (ty.type_size(), &[80, 82]),
                GgmlType::Q3_K => (ty.type_size(), &[108]),
                _ => (ty.type_size(), &[0, 2]),
            };
            for blk in b.chunks_exact_mut(size) {
                for &f in fields {
                    blk[f..f + 2].copy_from_slice(&scale(&mut next));
                }
            }
        }
    }
    Some(b)
}

/// Times the matvec of a `rows × cols` matrix of `ty` (synthetic weights): `iters` calls
/// recorded in one command buffer, after one warm-up call. Returns (seconds per call,
/// bytes one call reads: the matrix's device bytes plus the activations and outputs).
pub fn bench_matvec(
    gpu: &Gpu,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    iters: u32,
) -> Result<(f64, u64), GpuError> {
    let bytes = synthetic_weights(ty, rows, cols, 0x9e37_79b9_7f4a_7c15).ok_or_else(|| {
        GpuError::Invalid(format!("bench {ty}: {cols} columns are not whole blocks"))
    })?;
    let w = QMatrix::upload(gpu, ty, rows, cols, &bytes, "bench weights")?;
    drop(bytes);
    let mm = Matmul::new(gpu)?;
    let x = gpu.storage("bench x", cols as u64 * 4)?;
    let xs: Vec<f32> = (0..cols).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
    gpu.write_f32(&x, 0, &xs);
    let y = gpu.storage("bench y", rows as u64 * 4)?;
    let run = |k: u32| -> Result<f64, GpuError> {
        let mut enc = gpu
            .device()
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("bench matvec"),
            });
        for _ in 0..k {
            mm.encode(gpu, &mut enc, &w, &x, 0, &y, 0, 1)?;
        }
        let cb = enc.finish();
        let t = std::time::Instant::now();
        gpu.queue().submit([cb]);
        gpu.wait()?;
        Ok(t.elapsed().as_secs_f64())
    };
    run(1)?;
    let iters = iters.max(1);
    let secs = run(iters)? / f64::from(iters);
    Ok((secs, w.device_bytes() + 4 * (rows + cols) as u64))
}
