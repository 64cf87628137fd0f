//! The non-matmul kernels of a transformer layer: RMSNorm (rows, per head, sandwich
//! residual), bias, GLU activations, RoPE, the KV-cache store and causal attention over a
//! ring cache, and logit soft-capping.
//!
//! Every function records its dispatches into the caller's command encoder (nothing is
//! submitted here); each dispatch gets its own uniform parameter buffer. Buffers are f32
//! storage buffers bound whole; offsets are in elements. Sizes are checked on the host
//! before recording, so a wrong size is an `Err` naming the operation and the buffer, not a
//! wgpu validation panic.
//!
//! Reductions (norms, the softmax's maximum and sum) use subgroup operations when the device
//! has them (`gpu.summary().subgroups`) and a shared-memory tree otherwise; both variants are
//! built from the same WGSL with a different reduction prelude.

use crate::device::{Gpu, GpuError};
pub use ringllm_kernels::ops::RopeStyle;
use wgpu::{Buffer, CommandEncoder, ComputePipeline};

/// Workgroup size of the row-wise and element-wise kernels.
const WG: u32 = 256;
/// Workgroup size (and key tile) of attention.
const ATT_WG: u32 = 64;
/// Query heads of one KV head an attention workgroup takes together (the lanes of a vec4).
const ATT_HEADS: u32 = 4;
/// Largest head width attention takes (its shared q and accumulator rows).
pub const MAX_HEAD_DIM: u32 = 512;
/// Default keys per workgroup above which attention splits a (row, head) over several
/// workgroups (see `Ops::set_attention_split`).
pub const ATTN_SPLIT_KEYS: u32 = 256;
/// Attention splits keys only while its workgroups (units: a row and up to 4 query heads of
/// one KV head) are fewer than this, and into at most about this many workgroups in all:
/// enough to fill a GPU, with a small partial buffer.
const SPLIT_TARGET_GROUPS: u64 = 256;
/// Workgroups per grid dimension (the WebGPU limit).
const MAX_GROUPS: u64 = 65535;

const REDUCE_SHARED: &str = include_str!("shaders/ops_reduce_shared.wgsl");
const REDUCE_SUBGROUP: &str = include_str!("shaders/ops_reduce_subgroup.wgsl");
const NORM: &str = include_str!("shaders/ops_norm.wgsl");
const ELEM: &str = include_str!("shaders/ops_elem.wgsl");
const KV: &str = include_str!("shaders/ops_kv.wgsl");
const ATTN: &str = include_str!("shaders/ops_attn.wgsl");

const KV_F32: &str = "
@group(0) @binding(3) var<storage, read> kc: array<f32>;
@group(0) @binding(4) var<storage, read> vc: array<f32>;
fn load_k(e: u32) -> f32 { return kc[e]; }
fn load_v(e: u32) -> f32 { return vc[e]; }
";

const KV_F16: &str = "
@group(0) @binding(3) var<storage, read> kc: array<u32>;
@group(0) @binding(4) var<storage, read> vc: array<u32>;
fn load_k(e: u32) -> f32 { return unpack2x16float(kc[e >> 1u])[e & 1u]; }
fn load_v(e: u32) -> f32 { return unpack2x16float(vc[e >> 1u])[e & 1u]; }
";

/// The activation of a gated linear unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Glu {
    /// SwiGLU (Llama, SmolLM2, Qwen).
    Silu,
    /// GeGLU with the tanh approximation (Gemma).
    GeluTanh,
}

/// The attention shape of a layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnShape {
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    /// Score scale (1/sqrt(head_dim), or the model's query scale).
    pub scale: f32,
    /// Attention logit soft-capping (Gemma 2): each scaled score `s` becomes
    /// `softcap · tanh(s / softcap)` before the softmax; 0: none.
    pub softcap: f32,
}

/// One layer's cache of one sequence on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Ring size in positions: position `p` lives at slot `p % cap`.
    pub cap: u32,
    /// Sliding window: a query at `p` sees `p + 1 - window ..= p`.
    pub window: Option<u32>,
    /// f16 pairs packed in u32 (`cap * kvd / 2` words) instead of f32 (`cap * kvd`).
    pub f16: bool,
}

/// The compiled kernels (cheap to clone: the pipelines are shared handles).
#[derive(Clone)]
pub struct Ops {
    subgroups: bool,
    rms_norm: ComputePipeline,
    rms_norm_inplace: ComputePipeline,
    residual_norm: ComputePipeline,
    add_rows: ComputePipeline,
    add_bias: ComputePipeline,
    glu_silu: ComputePipeline,
    glu_gelu: ComputePipeline,
    softcap: ComputePipeline,
    rope_interleaved: ComputePipeline,
    rope_neox: ComputePipeline,
    kv_f32: ComputePipeline,
    kv_f16: ComputePipeline,
    attn_f32: ComputePipeline,
    attn_f16: ComputePipeline,
    attn_part_f32: ComputePipeline,
    attn_part_f16: ComputePipeline,
    attn_combine: ComputePipeline,
    split_keys: u32,
}

/// A buffer argument: its binding, the buffer, and how many bytes the dispatch reads or
/// writes from its start (checked against the buffer's size).
#[derive(Clone)]
struct Arg<'a> {
    binding: u32,
    what: &'static str,
    buf: &'a Buffer,
    need_bytes: u64,
}

fn arg<'a>(binding: u32, what: &'static str, buf: &'a Buffer, elems: u64) -> Arg<'a> {
    Arg {
        binding,
        what,
        buf,
        need_bytes: elems.saturating_mul(4),
    }
}

fn invalid(op: &str, why: impl std::fmt::Display) -> GpuError {
    GpuError::Invalid(format!("ops::{op}: {why}"))
}

/// `v` as a u32 shader parameter (element indices in the shaders are u32).
fn u32_of(op: &str, what: &str, v: u64) -> Result<u32, GpuError> {
    u32::try_from(v).map_err(|_| invalid(op, format!("{what} {v} does not fit in 32 bits")))
}

/// `a * b + c` in u64, which must stay a valid u32 element index.
fn span(op: &str, what: &str, a: u64, b: u64, c: u64) -> Result<u64, GpuError> {
    let v = a
        .checked_mul(b)
        .and_then(|v| v.checked_add(c))
        .ok_or_else(|| invalid(op, format!("{what} overflows")))?;
    u32_of(op, what, v)?;
    Ok(v)
}

fn distinct(op: &str, a: (&str, &Buffer), b: (&str, &Buffer)) -> Result<(), GpuError> {
    if a.1 == b.1 {
        return Err(invalid(
            op,
            format!("{} and {} must be different buffers", a.0, b.0),
        ));
    }
    Ok(())
}

/// A grid of `groups` workgroups folded into (x, y), each at most 65535.
fn grid(op: &str, groups: u64) -> Result<(u32, u32), GpuError> {
    let x = groups.min(MAX_GROUPS);
    let y = groups.div_ceil(MAX_GROUPS);
    if y > MAX_GROUPS {
        return Err(invalid(
            op,
            format!("{groups} workgroups exceed one dispatch"),
        ));
    }
    Ok((x as u32, y as u32))
}

/// Words of every parameter block: each kernel's `Params` struct is at most this many u32,
/// and the uniform binding must be at least the struct's size.
const PARAM_WORDS: usize = 16;

/// Parameter words (u32 and f32 bits), zero-padded to `PARAM_WORDS`.
fn words(mut w: Vec<u32>) -> Vec<u32> {
    debug_assert!(w.len() <= PARAM_WORDS);
    w.resize(PARAM_WORDS, 0);
    w
}

impl Ops {
    /// Compiles every kernel, with subgroup reductions if the device has them.
    pub fn new(gpu: &Gpu) -> Result<Ops, GpuError> {
        Self::with_subgroups(gpu, gpu.summary().subgroups.is_some())
    }

    /// Compiles every kernel with (or without) subgroup reductions; `true` fails on a device
    /// without subgroup operations. Tests use it to run both variants on one device.
    pub fn with_subgroups(gpu: &Gpu, subgroups: bool) -> Result<Ops, GpuError> {
        if subgroups && gpu.summary().subgroups.is_none() {
            return Err(gpu.op_error(
                "compiling ops",
                "subgroup reductions requested but the device has no subgroup operations",
            ));
        }
        let prelude = if subgroups {
            REDUCE_SUBGROUP
        } else {
            REDUCE_SHARED
        };
        let module = |wg: u32, body: &str| format!("const WG: u32 = {wg}u;\n{prelude}\n{body}");
        let norm = module(WG, NORM);
        let elem = module(WG, ELEM);
        let kv = module(WG, KV);
        let attn32 = module(ATT_WG, &ATTN.replace("//KV_DECL", KV_F32));
        let attn16 = module(ATT_WG, &ATTN.replace("//KV_DECL", KV_F16));
        let p = |label: &str, src: &str, entry: &str| gpu.pipeline(label, src, entry);
        Ok(Ops {
            subgroups,
            rms_norm: p("ops rms_norm", &norm, "rms_norm")?,
            rms_norm_inplace: p("ops rms_norm_inplace", &norm, "rms_norm_inplace")?,
            residual_norm: p("ops residual_norm", &norm, "residual_norm")?,
            add_rows: p("ops add_rows", &elem, "add_rows")?,
            add_bias: p("ops add_bias", &elem, "add_bias")?,
            glu_silu: p("ops glu_silu", &elem, "glu_silu")?,
            glu_gelu: p("ops glu_gelu_tanh", &elem, "glu_gelu_tanh")?,
            softcap: p("ops softcap", &elem, "softcap")?,
            rope_interleaved: p("ops rope_interleaved", &elem, "rope_interleaved")?,
            rope_neox: p("ops rope_neox", &elem, "rope_neox")?,
            kv_f32: p("ops kv_store_f32", &kv, "kv_store_f32")?,
            kv_f16: p("ops kv_store_f16", &kv, "kv_store_f16")?,
            attn_f32: p("ops attention_f32", &attn32, "attention")?,
            attn_f16: p("ops attention_f16", &attn16, "attention")?,
            attn_part_f32: p("ops attention_part_f32", &attn32, "attention_part")?,
            attn_part_f16: p("ops attention_part_f16", &attn16, "attention_part")?,
            attn_combine: p("ops attention_combine", &attn32, "attention_combine")?,
            split_keys: ATTN_SPLIT_KEYS,
        })
    }

    /// Keys per workgroup above which attention splits the keys of a unit (a row and up to
    /// 4 query heads) over several workgroups and merges their partial softmaxes (when the
    /// batch has few units); 0 never splits. Default `ATTN_SPLIT_KEYS`. Results agree either
    /// way within rounding; tests force both paths.
    pub fn set_attention_split(&mut self, keys: u32) {
        self.split_keys = keys;
    }

    /// Whether the reductions use subgroup operations.
    pub fn uses_subgroups(&self) -> bool {
        self.subgroups
    }

    /// Records one dispatch of `groups` workgroups after checking every buffer's size.
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &self,
        gpu: &Gpu,
        enc: &mut CommandEncoder,
        op: &str,
        pipe: &ComputePipeline,
        params: Vec<u32>,
        args: &[Arg<'_>],
        groups: u64,
    ) -> Result<(), GpuError> {
        let max_binding = gpu.summary().max_binding;
        for a in args {
            let size = a.buf.size();
            if a.need_bytes > size {
                return Err(invalid(
                    op,
                    format!(
                        "{} needs {} bytes but its buffer holds {size}",
                        a.what, a.need_bytes
                    ),
                ));
            }
            if size > max_binding {
                return Err(invalid(
                    op,
                    format!(
                        "{}'s buffer ({size} bytes) exceeds the device's largest binding \
                         ({max_binding} bytes)",
                        a.what
                    ),
                ));
            }
        }
        if groups == 0 {
            return Ok(());
        }
        let (gx, gy) = grid(op, groups)?;
        let params = words(params);
        let ub = gpu.uniform(op, bytemuck::cast_slice(&params));
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: ub.as_entire_binding(),
        }];
        entries.extend(args.iter().map(|a| wgpu::BindGroupEntry {
            binding: a.binding,
            resource: a.buf.as_entire_binding(),
        }));
        let bg = gpu.device().create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(op),
            layout: &pipe.get_bind_group_layout(0),
            entries: &entries,
        });
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some(op),
            timestamp_writes: None,
        });
        pass.set_pipeline(pipe);
        pass.set_bind_group(0, &bg, &[]);
        pass.dispatch_workgroups(gx, gy, 1);
        Ok(())
    }

    /// `out[r] = x[r] * w / sqrt(mean(x[r]²) + eps)` for `rows` rows of width `d`
    /// (`x` and `out` distinct buffers).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        gpu: &Gpu,
        enc: &mut CommandEncoder,
        x: &Buffer,
        x_off: u64,
        w: &Buffer,
        out: &Buffer,
        out_off: u64,
        rows: u32,
        d: u32,
        eps: f32,
    ) -> Result<(), GpuError> {
        const OP: &str = "rms_norm";
        distinct(OP, ("x", x), ("out", out))?;
        let xe = span(OP, "x range", rows.into(), d.into(), x_off)?;
        let oe = span(OP, "out range", rows.into(), d.into(), out_off)?;
        let params = vec![
            u32_of(OP, "x offset", x_off)?,
            u32_of(OP, "out offset", out_off)?,
            rows,
            d,
            eps.to_bits(),
        ];
        let args = [
            arg(1, "x", x, xe),
            arg(2, "w", w, d.into()),
            arg(3, "out", out, oe),
        ];
        self.dispatch(gpu, enc, OP, &self.rms_norm, params, &args, rows.into())
    }

    /// In place, per head: `x` viewed as `rows * heads` vectors of width `hd`, each normed
    /// with the same `w[hd]` (Gemma 3's QK-norm). With `heads = 1, hd = d` it is an in-place
    /// row norm (the final norm).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_heads(
        &self,
        gpu: &Gpu,
        enc: &mut CommandEncoder,
        x: &Buffer,
        x_off: u64,
        w: &Buffer,
        rows: u32,
        heads: u32,
        hd: u32,
        eps: f32,
    ) -> Result<(), GpuError> {
        const OP: &str = "rms_norm_heads";
        distinct(OP, ("x", x), ("w", w))?;
        let count = u64::from(rows) * u64::from(heads);
        let xe = span(OP, "x range", count, hd.into(), x_off)?;
        let params = vec![
            0,
            u32_of(OP, "x offset", x_off)?,
            u32_of(OP, "rows × heads", count)?,
            hd,
            eps.to_bits(),
        ];
        let args = [arg(2, "w", w, hd.into()), arg(3, "x", x, xe)];
        self.dispatch(gpu, enc, OP, &self.rms_norm_inplace, params, &args, count)
    }

    /// In place: `x[r] += b` for `rows` rows of width `d`.
    #[allow(clippy::too_many_arguments)]
    pub fn add_bias(
        &self,
        gpu: &Gpu,
        enc: &mut CommandEncoder,
        x: &Buffer,
        x_off: u64,
        b: &Buffer,
        rows: u32,
        d: u32,
    ) -> Result<(), GpuError> {
        const OP: &str = "add_bias";
        distinct(OP, ("x", x), ("b", b))?;
        let len = span(OP, "rows × d", rows.into(), d.into(), 0)?;
        let xe = span(OP, "x range", rows.into(), d.into(), x_off)?;
        let params = vec![u32_of(OP, "x offset", x_off)?, len as u32, d];
        let args = [arg(1, "b", b, d.into()), arg(2, "x", x, xe)];
        self.dispatch(
            gpu,
            enc,
            OP,
            &self.add_bias,
            params,
            &args,
            len.div_ceil(WG.into()),
        )
    }

    /// The residual add: `x[r] += o[r]`, or `x[r] += rms_norm(o[r]) * post_w` with Gemma's
    /// sandwich norm (`post_w` Some). Rows start at element 0 of both buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn residual(
        &self,
        gpu: &Gpu,
        enc: &mut CommandEncoder,
        x: &Buffer,
        o: &Buffer,
        post_w: Option<&Buffer>,
        rows: u32,
        d: u32,
        eps: f32,
    ) -> Result<(), GpuError> {
        const OP: &str = "residual";
        distinct(OP, ("x", x), ("o", o))?;
        let len = span(OP, "rows × d", rows.into(), d.into(), 0)?;
        match post_w {
            Some(w) => {
                distinct(OP, ("x", x), ("post_w", w))?;
                let params = vec![0, 0, rows, d, eps.to_bits()];
                let args = [
                    arg(1, "o", o, len),
                    arg(2, "post_w", w, d.into()),
                    arg(3, "x", x, len),
                ];
                self.dispatch(
                    gpu,
                    enc,
                    OP,
                    &self.residual_norm,
                    params,
                    &args,
                    rows.into(),
                )
            }
            None => {
                let params = vec![0, len as u32, d];
                let args = [arg(1, "o", o, len), arg(2, "x", x, len)];
                self.dispatch(
                    gpu,
                    enc,
                    OP,
                    &self.add_rows,
                    params,
                    &args,
                    len.div_ceil(WG.into()),
                )
            }
        }
    }

    /// In place: `gate = act(gate) * up` over `len` values.
    pub fn glu(
        &self,
        gpu: &Gpu,
        enc: &mut CommandEncoder,
        gate: &Buffer,
        up: &Buffer,
        len: u32,
        act: Glu,
    ) -> Result<(), GpuError> {
        const OP: &str = "glu";
        distinct(OP, ("gate", gate), ("up", up))?;
        let pipe = match act {
            Glu::Silu => &self.glu_silu,
            Glu::GeluTanh => &self.glu_gelu,
        };
        let args = [
            arg(1, "up", up, len.into()),
            arg(2, "gate", gate, len.into()),
        ];
        let groups = u64::from(len).div_ceil(WG.into());
        self.dispatch(gpu, enc, OP, pipe, vec![0, len], &args, groups)
    }

    /// In-place RoPE of `rows` rows of `x` (each `heads * hd` values, from element `x_off`).
    /// `cs` holds per row `half` (cos, sin) pairs as `2 * half` f32 (row `r` at
    /// `cs[r * 2 * half ..]`), computed on the host like `ops::rope_cos_sin`; only the first
    /// `2 * half` dims of each head rotate.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        gpu: &Gpu,
        enc: &mut CommandEncoder,
        x: &Buffer,
        x_off: u64,
        cs: &Buffer,
        rows: u32,
        heads: u32,
        hd: u32,
        half: u32,
        style: RopeStyle,
    ) -> Result<(), GpuError> {
        const OP: &str = "rope";
        distinct(OP, ("x", x), ("cs", cs))?;
        if 2 * u64::from(half) > u64::from(hd) {
            return Err(invalid(
                OP,
                format!("{half} rotated pairs do not fit a head of {hd}"),
            ));
        }
        let row = span(OP, "heads × hd", heads.into(), hd.into(), 0)?;
        let xe = span(OP, "x range", rows.into(), row, x_off)?;
        let pairs = span(
            OP,
            "rotated pairs",
            u64::from(rows) * u64::from(heads),
            half.into(),
            0,
        )?;
        let cse = span(OP, "cs range", rows.into(), 2 * u64::from(half), 0)?;
        let pipe = match style {
            RopeStyle::Interleaved => &self.rope_interleaved,
            RopeStyle::Neox => &self.rope_neox,
        };
        let params = vec![
            u32_of(OP, "x offset", x_off)?,
            pairs as u32,
            heads,
            0,
            hd,
            half,
        ];
        let args = [arg(1, "cs", cs, cse), arg(2, "x", x, xe)];
        self.dispatch(gpu, enc, OP, pipe, params, &args, pairs.div_ceil(WG.into()))
    }

    /// Stores `rows` rows of `k` and `v` (from element `kv_off` of both, rows of `kvd`) into
    /// the caches at slot `pos[pos_off + r] % cap`. `kc`/`vc` are f32 `[cap * kvd]`, or with
    /// `layout.f16` binary16 pairs packed in u32 (`[cap * kvd / 2]`, low half first, rounded
    /// to nearest even like `half::f16::from_f32`). `pos` is a u32 storage buffer.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store(
        &self,
        gpu: &Gpu,
        enc: &mut CommandEncoder,
        k: &Buffer,
        v: &Buffer,
        kv_off: u64,
        kc: &Buffer,
        vc: &Buffer,
        pos: &Buffer,
        pos_off: u64,
        rows: u32,
        kvd: u32,
        layout: &KvLayout,
    ) -> Result<(), GpuError> {
        const OP: &str = "kv_store";
        distinct(OP, ("kc", kc), ("vc", vc))?;
        if layout.cap == 0 || kvd == 0 {
            return Err(invalid(OP, "cache of zero positions or zero width"));
        }
        if layout.f16 && !kvd.is_multiple_of(2) {
            return Err(invalid(
                OP,
                format!("an f16 cache needs an even kvd, not {kvd}"),
            ));
        }
        let se = span(OP, "k/v range", rows.into(), kvd.into(), kv_off)?;
        let ce = span(OP, "cache", layout.cap.into(), kvd.into(), 0)?;
        let pe = span(OP, "pos range", rows.into(), 1, pos_off)?;
        let params = vec![
            u32_of(OP, "k/v offset", kv_off)?,
            u32_of(OP, "pos offset", pos_off)?,
            rows,
            kvd,
            layout.cap,
        ];
        // An f16 cache holds ce/2 u32 words: `arg` counts 4-byte elements.
        let (pipe, kb, vb, cwords, per_row) = if layout.f16 {
            (&self.kv_f16, 6, 7, ce / 2, kvd / 2)
        } else {
            (&self.kv_f32, 4, 5, ce, kvd)
        };
        let args = [
            arg(1, "k", k, se),
            arg(2, "v", v, se),
            arg(3, "pos", pos, pe),
            arg(kb, "kc", kc, cwords),
            arg(vb, "vc", vc, cwords),
        ];
        let groups = (u64::from(rows) * u64::from(per_row)).div_ceil(WG.into());
        self.dispatch(gpu, enc, OP, pipe, params, &args, groups)
    }

    /// Causal attention for `rows` consecutive rows of `q` (from row `q_row`, rows of
    /// `n_head * head_dim`) of one sequence whose cache is `kc`/`vc`: the row at position
    /// `p = pos[pos_off + r]` attends to positions `(window? max(0, p + 1 - window) : 0) ..= p`
    /// (and at most the last `cap`, which is all the ring holds), each at slot `pos % cap`,
    /// query head `h` using KV head `h / (n_head / n_head_kv)`. Output to `out` at the same
    /// rows as `q` (`out` distinct from `q`). Head width at most `MAX_HEAD_DIM`.
    ///
    /// One dispatch (a workgroup per row and block of up to 4 query heads sharing a KV
    /// head), or, when there are fewer than 256 such units and a row may see more than
    /// `set_attention_split` keys, two: the keys split over several workgroups per unit into a
    /// partial buffer allocated here, then merged.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        gpu: &Gpu,
        enc: &mut CommandEncoder,
        q: &Buffer,
        out: &Buffer,
        q_row: u32,
        kc: &Buffer,
        vc: &Buffer,
        pos: &Buffer,
        pos_off: u64,
        rows: u32,
        shape: &AttnShape,
        layout: &KvLayout,
    ) -> Result<(), GpuError> {
        const OP: &str = "attention";
        distinct(OP, ("q", q), ("out", out))?;
        let AttnShape {
            n_head,
            n_head_kv,
            head_dim: hd,
            scale,
            softcap,
        } = *shape;
        if !(softcap.is_finite() && softcap >= 0.0) {
            return Err(invalid(
                OP,
                format!("soft-cap {softcap} is not a number ≥ 0"),
            ));
        }
        if n_head == 0 || n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(invalid(
                OP,
                format!("{n_head} query heads do not group over {n_head_kv} KV heads"),
            ));
        }
        if hd == 0 || hd > MAX_HEAD_DIM {
            return Err(invalid(
                OP,
                format!("head width {hd} is outside 1..={MAX_HEAD_DIM}"),
            ));
        }
        if layout.cap == 0 || layout.window == Some(0) {
            return Err(invalid(OP, "cache of zero positions or a zero window"));
        }
        let qd = span(OP, "q row", n_head.into(), hd.into(), 0)?;
        let kvd = span(OP, "kv row", n_head_kv.into(), hd.into(), 0)?;
        let qe = span(OP, "q range", u64::from(q_row) + u64::from(rows), qd, 0)?;
        let ce = span(OP, "cache", layout.cap.into(), kvd, 0)?;
        let pe = span(OP, "pos range", rows.into(), 1, pos_off)?;
        let (pipe, part_pipe, cwords) = if layout.f16 {
            if !kvd.is_multiple_of(2) {
                return Err(invalid(
                    OP,
                    format!("an f16 cache needs an even kvd, not {kvd}"),
                ));
            }
            (&self.attn_f16, &self.attn_part_f16, ce / 2)
        } else {
            (&self.attn_f32, &self.attn_part_f32, ce)
        };
        // A workgroup takes up to ATT_HEADS query heads of one KV head (a unit), so each key
        // and value is loaded once for all of them.
        let group = n_head / n_head_kv;
        let ng = group.min(ATT_HEADS);
        let blocks = group.div_ceil(ng);
        let units = u64::from(rows) * u64::from(n_head_kv) * u64::from(blocks);
        let pairs = u64::from(rows) * u64::from(n_head);
        // Split the keys when few units would leave a GPU idle: the most keys a row can see
        // is the ring (or the window, if smaller).
        let max_keys = u64::from(layout.window.map_or(layout.cap, |w| w.min(layout.cap)));
        let splits = if self.split_keys > 0 && units > 0 && units < SPLIT_TARGET_GROUPS {
            max_keys
                .div_ceil(self.split_keys.into())
                .min(SPLIT_TARGET_GROUPS.div_ceil(units))
        } else {
            1
        };
        let chunk = max_keys.div_ceil(splits);
        let params = vec![
            q_row,
            rows,
            n_head,
            group,
            hd,
            qd as u32,
            kvd as u32,
            layout.cap,
            layout.window.unwrap_or(0),
            u32_of(OP, "pos offset", pos_off)?,
            scale.to_bits(),
            splits as u32,
            chunk as u32,
            ng,
            blocks,
            softcap.to_bits(),
        ];
        let args = [
            arg(1, "q", q, qe),
            arg(2, "pos", pos, pe),
            arg(3, "kc", kc, cwords),
            arg(4, "vc", vc, cwords),
        ];
        if splits <= 1 {
            let args = [&args[..], &[arg(5, "out", out, qe)]].concat();
            return self.dispatch(gpu, enc, OP, pipe, params, &args, units);
        }
        let part_len = span(OP, "partials", pairs * splits, u64::from(hd) + 2, 0)?;
        let part = gpu.storage("attention partials", part_len * 4)?;
        let part_args = [&args[..], &[arg(6, "partials", &part, part_len)]].concat();
        self.dispatch(
            gpu,
            enc,
            "attention (split keys)",
            part_pipe,
            params.clone(),
            &part_args,
            units * splits,
        )?;
        let comb_args = [arg(5, "out", out, qe), arg(6, "partials", &part, part_len)];
        self.dispatch(
            gpu,
            enc,
            "attention (merge splits)",
            &self.attn_combine,
            params,
            &comb_args,
            pairs,
        )
    }

    /// In place: `x = cap * tanh(x / cap)` over `len` values (final logit soft-capping).
    pub fn softcap(
        &self,
        gpu: &Gpu,
        enc: &mut CommandEncoder,
        x: &Buffer,
        len: u32,
        cap: f32,
    ) -> Result<(), GpuError> {
        const OP: &str = "softcap";
        if !(cap.is_finite() && cap > 0.0) {
            return Err(invalid(OP, format!("cap {cap} is not a positive number")));
        }
        let args = [arg(2, "x", x, len.into())];
        let groups = u64::from(len).div_ceil(WG.into());
        self.dispatch(
            gpu,
            enc,
            OP,
            &self.softcap,
            vec![0, len, 0, cap.to_bits()],
            &args,
            groups,
        )
    }
}
