//! The per-type kernel table, built once at start-up from CPU feature detection (as ggml's
//! `type_traits_cpu[]`). Never detect inside a hot loop: callers fetch `kernels(ty)` once.

use crate::quants;
use crate::types::{GgmlType, ALL_TYPES};
use std::sync::OnceLock;

/// Dequantize whole blocks: `src` holds `dst.len() / block_size` blocks.
pub type DequantizeFn = fn(src: &[u8], dst: &mut [f32]);
/// Reference quantize whole blocks: `src.len()` is a multiple of the block size and `dst`
/// holds exactly `row_bytes(src.len())` bytes.
pub type QuantizeFn = fn(src: &[f32], dst: &mut [u8]);
/// Dot product of `n` elements: a weight row `w` in this type and an activation row `a` in
/// the type's `vec_dot_type`.
pub type VecDotFn = fn(n: usize, w: &[u8], a: &[u8]) -> f32;
/// One weight row against `out.len()` activation rows, the i-th starting at `a[i * a_stride..]`:
/// each weight block is decoded once and used against every activation row.
pub type VecDotMultiFn = fn(n: usize, w: &[u8], a: &[u8], a_stride: usize, out: &mut [f32]);

/// `out.len()` weight rows, the r-th at `w[r * w_stride..]`, against one activation row: the
/// decode shape, where amortizing the activation block and the call over several rows pays.
pub type VecDotRowsFn = fn(n: usize, w: &[u8], w_stride: usize, a: &[u8], out: &mut [f32]);

/// `n_w` weight rows (the o-th at `w[o * w_stride..]`) against `n_a` activation rows (the r-th
/// at `a[r * a_stride..]`): `out[r * out_stride + o]`. Each weight block is decoded once for
/// several activation rows and each activation block loaded once for several weight rows —
/// the shape of decoding a few sequences at once.
pub type VecDotTileFn = fn(
    n: usize,
    w: &[u8],
    w_stride: usize,
    n_w: usize,
    a: &[u8],
    a_stride: usize,
    n_a: usize,
    out: &mut [f32],
    out_stride: usize,
);

/// `n_w` weight rows (the o-th at `w[o * w_stride..]`) against activation rows `r0..r0 + n_a`
/// of a batch laid out once for the GEMM kernels: `out[r * out_stride + o]`. The prefill shape.
pub type GemmFn = fn(
    n: usize,
    w: &[u8],
    w_stride: usize,
    n_w: usize,
    acts: &crate::gemm::GemmActs,
    r0: usize,
    n_a: usize,
    out: &mut [f32],
    out_stride: usize,
);

/// `n_w` weight rows (the o-th at `w[o * w_stride..]`) against `n_a` Q8_K activation rows (the
/// c-th at `a[c * a_stride..]`): `store(c, o0, values)` receives the results of activation
/// row `c` against weight rows `o0..o0 + values.len()`. The K-quants' prefill shape.
pub type KGemmFn = fn(
    n: usize,
    w: &[u8],
    w_stride: usize,
    n_w: usize,
    a: &[u8],
    a_stride: usize,
    n_a: usize,
    store: &mut dyn FnMut(usize, usize, &[f32]),
);

/// Whole K-quant panels (`crate::repack::KPANEL` rows each, repacked; `w` starts at a panel)
/// of `n` columns against one activation row `a`: `out[o]` for each row of the panels
/// (`out.len()` a multiple of the panel's rows).
pub type PanelDotFn = fn(n: usize, w: &[u8], a: &[u8], out: &mut [f32]);

/// `n_w` rows in whole panels (`crate::repack::KPANEL` rows each, repacked; `w` starts at a
/// panel) of `n` columns against `n_a` activation rows (the r-th at `a[r * a_stride..]`):
/// `out[r * out_stride + o]`. The batch form of `PanelDotFn`, with its bits for every pair.
#[allow(clippy::too_many_arguments)]
pub type PanelGemmFn = fn(
    n: usize,
    w: &[u8],
    n_w: usize,
    a: &[u8],
    a_stride: usize,
    n_a: usize,
    out: &mut [f32],
    out_stride: usize,
);

/// Instruction set a kernel table was built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
    /// AVX2 with `vpdpbusd` (AVX-VNNI, or AVX-512 VNNI on 256-bit registers) for the dot
    /// products of the 32-element formats.
    Avx2Vnni,
    /// The VNNI level plus AVX-512 (F, BW, VL, VNNI) prefill GEMM kernels for the 32-element
    /// formats.
    Avx512,
    /// aarch64 Advanced SIMD (every aarch64 CPU).
    Neon,
    /// NEON with `sdot` (FEAT_DotProd) for every integer dot product.
    NeonDotprod,
    /// The dotprod level plus `smmla` (FEAT_I8MM) prefill GEMM kernels for the 32-element
    /// formats.
    NeonI8mm,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2+fma",
            Isa::Avx2Vnni => "avx2+vnni",
            Isa::Avx512 => "avx512+vnni",
            Isa::Neon => "neon",
            Isa::NeonDotprod => "neon+dotprod",
            Isa::NeonI8mm => "neon+i8mm",
        }
    }
}

/// Operations on one element type.
#[derive(Clone, Copy)]
pub struct TypeKernels {
    pub ty: GgmlType,
    pub isa: Isa,
    pub dequantize: DequantizeFn,
    pub quantize: QuantizeFn,
    /// Format the activations are quantized to before `vec_dot`.
    pub vec_dot_type: GgmlType,
    pub vec_dot: VecDotFn,
    /// Tiled form of `vec_dot`, where the ISA has one; otherwise callers loop `vec_dot`.
    pub vec_dot_multi: Option<VecDotMultiFn>,
    /// Several weight rows against one activation row, where the ISA has it.
    pub vec_dot_rows: Option<VecDotRowsFn>,
    /// Several weight rows against a few activation rows, where the ISA has it.
    pub vec_dot_tile: Option<VecDotTileFn>,
    /// Weight rows against a prepared batch of activation rows (prefill), where the ISA has it;
    /// bit-identical to `vec_dot` for every pair.
    pub gemm: Option<GemmFn>,
    /// `gemm` over weights repacked into panels (`crate::repack`): `w` starts at a panel and
    /// `n_w` is a whole number of panels. The same bits as `gemm`.
    pub gemm_packed: Option<GemmFn>,
    /// Weight rows against a batch of Q8_K rows through tiles of unpacked rows
    /// (`crate::ktile`), where the ISA has it: the K-quants' prefill. The bits of `vec_dot`
    /// (and of the scalar reference) for every pair.
    pub kgemm: Option<KGemmFn>,
    /// Decode over weights repacked into K-quant panels (`crate::repack`, `KPANEL` rows
    /// interleaved): whole panels against one activation row, each panel's rows in the lanes
    /// of one register. The bits of `vec_dot` for every row.
    pub dot_panels: Option<PanelDotFn>,
    /// Prefill over the same panels: whole panels against a batch of activation rows, each
    /// row in a lane as `dot_panels` has it (MXFP4). The bits of `dot_panels` for every pair.
    pub gemm_panels: Option<PanelGemmFn>,
}

impl std::fmt::Debug for TypeKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TypeKernels")
            .field("ty", &self.ty)
            .field("isa", &self.isa)
            .field("vec_dot_type", &self.vec_dot_type)
            .field("tiled", &self.vec_dot_multi.is_some())
            .field("gemm", &self.gemm.is_some())
            .field("gemm_packed", &self.gemm_packed.is_some())
            .field("kgemm", &self.kgemm.is_some())
            .field("dot_panels", &self.dot_panels.is_some())
            .field("gemm_panels", &self.gemm_panels.is_some())
            .finish()
    }
}

struct Table {
    isa: Isa,
    entries: Vec<TypeKernels>,
}

impl Table {
    fn get(&self, ty: GgmlType) -> &TypeKernels {
        // Every type in ALL_TYPES has an entry (built by `scalar_table`).
        self.entries
            .iter()
            .find(|k| k.ty == ty)
            .unwrap_or_else(|| unreachable!("no kernel entry for {ty}"))
    }
}

fn scalar_table() -> Table {
    Table {
        isa: Isa::Scalar,
        entries: ALL_TYPES
            .iter()
            .map(|&t| quants::scalar_kernels(t))
            .collect(),
    }
}

/// The level `RINGLLM_ISA` asks for (`scalar`; x86_64: `avx2`, `vnni`, `avx512`; aarch64: `neon`,
/// `dotprod`, `i8mm`; unset or `auto`: the best this CPU has). `RINGLLM_FORCE_SCALAR=1` is the older spelling of `RINGLLM_ISA=scalar`. A level the
/// CPU lacks, or a name we do not know, is refused on stderr and the best level is used.
fn requested() -> Option<Isa> {
    if std::env::var_os("RINGLLM_FORCE_SCALAR").is_some_and(|v| v != "0") {
        return Some(Isa::Scalar);
    }
    let v = std::env::var("RINGLLM_ISA").ok()?;
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "auto" => None,
        "scalar" => Some(Isa::Scalar),
        "avx2" => Some(Isa::Avx2),
        "vnni" | "avx2+vnni" => Some(Isa::Avx2Vnni),
        "avx512" | "avx512+vnni" => Some(Isa::Avx512),
        "neon" => Some(Isa::Neon),
        "dotprod" | "neon+dotprod" => Some(Isa::NeonDotprod),
        "i8mm" | "neon+i8mm" => Some(Isa::NeonI8mm),
        other => {
            eprintln!(
                "warning: RINGLLM_ISA={other}: write scalar, avx2, vnni, avx512, neon, dotprod, \
                 i8mm or auto; using the best this CPU has"
            );
            None
        }
    }
}

fn detected_table() -> Table {
    // Read once: a refused name is reported once.
    let requested = requested();
    if requested == Some(Isa::Scalar) {
        return scalar_table();
    }
    #[cfg(target_arch = "x86_64")]
    {
        let want = match requested {
            Some(w @ (Isa::Neon | Isa::NeonDotprod | Isa::NeonI8mm)) => {
                eprintln!(
                    "warning: RINGLLM_ISA={}: not an x86_64 level; using the best this CPU has",
                    w.name()
                );
                None
            }
            w => w,
        };
        if let (Some(v), true, None | Some(Isa::Avx512)) =
            (crate::avx2::vnni(), crate::avx2::gemm512::available(), want)
        {
            let mut table = scalar_table();
            table.isa = Isa::Avx512;
            for entry in &mut table.entries {
                crate::avx2::specialize_avx512(entry, v);
            }
            return table;
        }
        if want == Some(Isa::Avx512) {
            eprintln!("warning: RINGLLM_ISA=avx512: this CPU lacks AVX-512 F/BW/VL/VNNI; using the best it has");
        }
        if let (Some(v), None | Some(Isa::Avx2Vnni | Isa::Avx512)) = (crate::avx2::vnni(), want) {
            let mut table = scalar_table();
            table.isa = Isa::Avx2Vnni;
            for entry in &mut table.entries {
                crate::avx2::specialize_vnni(entry, v);
            }
            return table;
        }
        if want == Some(Isa::Avx2Vnni) {
            eprintln!("warning: RINGLLM_ISA=vnni: this CPU has no VNNI; using avx2");
        }
        if crate::avx2::available() {
            let mut table = scalar_table();
            table.isa = Isa::Avx2;
            for entry in &mut table.entries {
                crate::avx2::specialize(entry);
            }
            return table;
        }
    }
    #[cfg(target_arch = "aarch64")]
    let table = neon_table(requested);
    #[cfg(not(target_arch = "aarch64"))]
    let table = scalar_table();
    table
}

/// The best NEON level this CPU has, or the one `want` names (a level the CPU lacks is refused
/// with a warning and the best it has used; an x86 level names none of ours).
#[cfg(target_arch = "aarch64")]
fn neon_table(want: Option<Isa>) -> Table {
    use crate::neon;
    let want = match want {
        None | Some(Isa::Neon | Isa::NeonDotprod | Isa::NeonI8mm) => want,
        Some(other) => {
            eprintln!(
                "warning: RINGLLM_ISA={}: not an aarch64 level; using the best this CPU has",
                other.name()
            );
            None
        }
    };
    let mut table = scalar_table();
    let specialize: fn(&mut TypeKernels) = match want {
        None | Some(Isa::NeonI8mm) if neon::available_i8mm() => neon::specialize_i8mm,
        Some(Isa::NeonI8mm) if neon::available_dotprod() => {
            eprintln!("warning: RINGLLM_ISA=i8mm: this CPU has no I8MM; using dotprod");
            neon::specialize_dotprod
        }
        None | Some(Isa::NeonDotprod) if neon::available_dotprod() => neon::specialize_dotprod,
        Some(Isa::NeonI8mm | Isa::NeonDotprod) => {
            eprintln!(
                "warning: RINGLLM_ISA={}: this CPU has no dotprod; using neon",
                want.map_or("", |w| w.name())
            );
            neon::specialize
        }
        _ => neon::specialize,
    };
    for entry in &mut table.entries {
        specialize(entry);
    }
    table.isa = table.entries.first().map_or(Isa::Scalar, |e| e.isa);
    table
}

static SCALAR: OnceLock<Table> = OnceLock::new();
static DETECTED: OnceLock<Table> = OnceLock::new();

/// The fastest kernels this CPU supports, or the level `RINGLLM_ISA` names.
pub fn kernels(ty: GgmlType) -> &'static TypeKernels {
    DETECTED.get_or_init(detected_table).get(ty)
}

/// The scalar reference kernels: the oracle every optimized path is tested against.
pub fn reference(ty: GgmlType) -> &'static TypeKernels {
    SCALAR.get_or_init(scalar_table).get(ty)
}

/// The instruction set `kernels` chose.
pub fn isa() -> Isa {
    DETECTED.get_or_init(detected_table).isa
}
