//! Real-size synthetic models written as a stream: the header first (offsets follow from the
//! sizes), then each matrix row by row from a small pool of valid quantized blocks, so a
//! 5 GB file takes seconds and a few MiB of memory.
//!
//! Each (type, row length) has a pool of blocks quantized once from N(0, 1/row_len) values
//! (the scale of the small synthetic models, which keeps every layer's activations O(1));
//! each block of a matrix is a pool block picked by a per-tensor pseudo-random sequence.
//! Norm weights are 1 + 0.1·N(0, 1), biases 0.1·N(0, 1), both F32.

use super::shape::{Shape, VocabKind, WeightMix};
use super::vocab::add_tokenizer;
use super::{add_arch_meta, ArchMeta, SynthArch};
use crate::arch::TensorKind;
use crate::gguf::{GgufError, GgufWriter, TensorStream, Value};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use ringllm_kernels::{reference, GgmlType};
use std::collections::HashMap;
use std::io::{self, Write};

/// Errors of writing a real-size synthetic model.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    /// The request cannot be built (bad layer count, vocabulary too small...).
    #[error(transparent)]
    Spec(#[from] GgufError),
    /// Writing the file failed.
    #[error("writing the synthetic model: {0}")]
    Io(#[from] io::Error),
}

/// What to write: a shape, possibly cut to fewer layers or a smaller vocabulary.
#[derive(Clone, Debug)]
pub struct ShapeSpec {
    pub shape: Shape,
    pub mix: WeightMix,
    pub seed: u64,
    /// Router rows of a mixture of experts scaled by `(1 + rank)^-router_skew` (0: not).
    pub router_skew: f32,
}

impl ShapeSpec {
    /// `shape` with its own layer count and vocabulary.
    pub fn new(shape: &Shape, mix: WeightMix, seed: u64) -> ShapeSpec {
        ShapeSpec {
            shape: shape.clone(),
            mix,
            seed,
            router_skew: 0.0,
        }
    }

    fn validate(&self) -> Result<(), GgufError> {
        let s = &self.shape;
        let bad = |why: String| Err(GgufError::InvalidInput(format!("shape {}: {why}", s.name)));
        if s.n_layer == 0 || s.n_layer > 1024 {
            return bad(format!("{} layers (1 to 1024)", s.n_layer));
        }
        let min = s.vocab_kind.min_vocab();
        if s.vocab < min || s.vocab > 1 << 20 {
            return bad(format!(
                "vocabulary {} (at least {min}, at most 2^20)",
                s.vocab
            ));
        }
        if let WeightMix::Single(GgmlType::Q8_1 | GgmlType::Q8_K) = self.mix {
            return bad("Q8_1 and Q8_K are activation formats, not weight formats".into());
        }
        Ok(())
    }
}

/// Pool blocks per (type, row length).
const POOL_UNITS: usize = 2048;

/// One tensor to write: name, dims, type and how its values are made.
#[derive(Clone, Debug)]
struct Planned {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    fill: Fill,
}

#[derive(Clone, Debug)]
enum Fill {
    /// Rows of pool blocks.
    Matrix,
    /// 1 + 0.1·N(0, 1).
    Norm,
    /// 0.1·N(0, 1).
    Bias,
    /// (1 + 0.1·N(0, 1))·scale.
    ScaledNorm(f32),
    /// These exact values.
    Values(Vec<f32>),
    /// An F32 router of `rows` rows: N(0, 1/row_len) scaled per row by `(1 + rank)^-skew`,
    /// the rows' ranks a permutation that depends on `layer`.
    SkewedRouter { skew: f32, layer: u32 },
}

/// The tensors of `spec` in file order: embedding, RoPE factors, each layer's tensors, final
/// norm, head.
fn plan(spec: &ShapeSpec) -> Vec<Planned> {
    let s = &spec.shape;
    if let Some(g) = super::gemma4::Gemma4Model::of_shape(s) {
        return g
            .tensors()
            .into_iter()
            .map(|t| {
                let dims: Vec<u64> = t.dims.iter().map(|&x| x.into()).collect();
                let (ty, fill) = match t.fill {
                    super::gemma4::G4Fill::Matrix => (
                        spec.mix.matrix_type(
                            t.kind,
                            t.layer.unwrap_or(0),
                            s.n_layer,
                            t.dims[0],
                            s.tied,
                            s.n_head / s.n_head_kv.max(1),
                        ),
                        Fill::Matrix,
                    ),
                    super::gemma4::G4Fill::Norm => (GgmlType::F32, Fill::Norm),
                    super::gemma4::G4Fill::ScaledNorm(k) => (GgmlType::F32, Fill::ScaledNorm(k)),
                    super::gemma4::G4Fill::Values(v) => (GgmlType::F32, Fill::Values(v)),
                };
                Planned {
                    name: t.kind.gguf_name(t.layer.map(|l| l as usize)),
                    dims,
                    ty,
                    fill,
                }
            })
            .collect();
    }
    let (d, q, kv) = (s.d_model, s.n_head * s.head_dim, s.n_head_kv * s.head_dim);
    let n_gqa = s.n_head / s.n_head_kv.max(1);
    let n_expert = s.experts().map_or(0, |e| e.0);
    let mut out = Vec::new();
    let matrix =
        |out: &mut Vec<Planned>, kind: TensorKind, il: Option<u32>, rows: u32, row_len: u32| {
            let ty = spec.mix.matrix_type_in(
                kind,
                il.unwrap_or(0),
                s.n_layer,
                row_len,
                s.tied,
                n_gqa,
                n_expert,
            );
            out.push(Planned {
                name: kind.gguf_name(il.map(|i| i as usize)),
                dims: vec![row_len.into(), rows.into()],
                ty,
                fill: Fill::Matrix,
            });
        };
    let vector = |out: &mut Vec<Planned>, kind: TensorKind, il: Option<u32>, n: u32, fill: Fill| {
        out.push(Planned {
            name: kind.gguf_name(il.map(|i| i as usize)),
            dims: vec![n.into()],
            ty: GgmlType::F32,
            fill,
        });
    };
    matrix(&mut out, TensorKind::TokenEmbd, None, s.vocab, d);
    if let Some(f) = s.rope_freqs() {
        vector(
            &mut out,
            TensorKind::RopeFreqs,
            None,
            s.head_dim / 2,
            Fill::Values(f),
        );
    }
    for il in 0..s.n_layer {
        let l = Some(il);
        vector(&mut out, TensorKind::AttnNorm, l, d, Fill::Norm);
        let fused = s.arch == SynthArch::Phi3;
        if fused {
            matrix(&mut out, TensorKind::AttnQkv, l, q + 2 * kv, d);
        } else {
            matrix(&mut out, TensorKind::AttnQ, l, q, d);
            matrix(&mut out, TensorKind::AttnK, l, kv, d);
            matrix(&mut out, TensorKind::AttnV, l, kv, d);
        }
        let oss = s.arch == SynthArch::GptOss;
        if s.arch == SynthArch::Qwen2 || oss {
            vector(&mut out, TensorKind::AttnQBias, l, q, Fill::Bias);
            vector(&mut out, TensorKind::AttnKBias, l, kv, Fill::Bias);
            vector(&mut out, TensorKind::AttnVBias, l, kv, Fill::Bias);
        }
        if s.arch.has_qk_norm() {
            // GGUF stores Gemma's RMSNorm weights as (1 + w): near 1 like the others.
            vector(&mut out, TensorKind::AttnQNorm, l, s.head_dim, Fill::Norm);
            vector(&mut out, TensorKind::AttnKNorm, l, s.head_dim, Fill::Norm);
        }
        matrix(&mut out, TensorKind::AttnOutput, l, d, q);
        if oss {
            vector(&mut out, TensorKind::AttnOutBias, l, d, Fill::Bias);
            vector(&mut out, TensorKind::AttnSinks, l, s.n_head, Fill::Bias);
        }
        if s.arch.has_sandwich_norms() {
            vector(&mut out, TensorKind::PostAttnNorm, l, d, Fill::Norm);
        }
        // gpt-oss's feed-forward pre-norm goes by `post_attention_norm`.
        let ffn_norm = if oss {
            TensorKind::PostAttnNorm
        } else {
            TensorKind::FfnNorm
        };
        vector(&mut out, ffn_norm, l, d, Fill::Norm);
        if s.experts().is_some() {
            moe_tensors(&mut out, spec, il, n_gqa);
            continue;
        }
        if fused {
            matrix(&mut out, TensorKind::FfnGateUp, l, 2 * s.d_ff, d);
        } else {
            matrix(&mut out, TensorKind::FfnGate, l, s.d_ff, d);
            matrix(&mut out, TensorKind::FfnUp, l, s.d_ff, d);
        }
        matrix(&mut out, TensorKind::FfnDown, l, d, s.d_ff);
        if s.arch.has_sandwich_norms() {
            vector(&mut out, TensorKind::PostFfwNorm, l, d, Fill::Norm);
        }
    }
    vector(&mut out, TensorKind::OutputNorm, None, d, Fill::Norm);
    if !s.tied {
        matrix(&mut out, TensorKind::Output, None, s.vocab, d);
    }
    out
}

/// A mixture-of-experts layer's feed-forward tensors: the router, the stacked experts (typed
/// by the mix's rule for experts) and, for gpt-oss, their biases.
fn moe_tensors(out: &mut Vec<Planned>, spec: &ShapeSpec, il: u32, n_gqa: u32) {
    let s = &spec.shape;
    let Some((ne, _, fe)) = s.experts() else {
        return;
    };
    let (d, oss) = (s.d_model, s.arch == SynthArch::GptOss);
    // The router in F32 (llama.cpp's quantizer leaves `ffn_gate_inp` alone); the
    // experts stacked, typed as their dense counterparts.
    out.push(Planned {
        name: TensorKind::FfnGateInp.gguf_name(Some(il as usize)),
        dims: vec![d.into(), ne.into()],
        ty: GgmlType::F32,
        fill: if spec.router_skew > 0.0 {
            Fill::SkewedRouter {
                skew: spec.router_skew,
                layer: il,
            }
        } else {
            Fill::Matrix
        },
    });
    if oss {
        out.push(Planned {
            name: TensorKind::FfnGateInpBias.gguf_name(Some(il as usize)),
            dims: vec![ne.into()],
            ty: GgmlType::F32,
            fill: Fill::Bias,
        });
    }
    for (kind, bias, row_len, rows) in [
        (TensorKind::FfnGateExps, TensorKind::FfnGateExpsBias, d, fe),
        (TensorKind::FfnUpExps, TensorKind::FfnUpExpsBias, d, fe),
        (TensorKind::FfnDownExps, TensorKind::FfnDownExpsBias, fe, d),
    ] {
        let ty = spec
            .mix
            .matrix_type(kind, il, s.n_layer, row_len, s.tied, n_gqa);
        out.push(Planned {
            name: kind.gguf_name(Some(il as usize)),
            dims: vec![row_len.into(), rows.into(), ne.into()],
            ty,
            fill: Fill::Matrix,
        });
        if oss {
            out.push(Planned {
                name: bias.gguf_name(Some(il as usize)),
                dims: vec![rows.into(), ne.into()],
                ty: GgmlType::F32,
                fill: Fill::Bias,
            });
        }
    }
}

/// The header: metadata, tokenizer, tensor infos (no data yet).
fn header(spec: &ShapeSpec, tensors: &[Planned]) -> Result<GgufWriter, GgufError> {
    let s = &spec.shape;
    let a = s.arch.name();
    let mut w = GgufWriter::new();
    w.add("general.architecture", Value::Str(a.to_string()));
    w.add(
        "general.name",
        Value::Str(format!(
            "synthetic {} ({} layers, vocab {}) {} seed {}",
            s.name,
            s.n_layer,
            s.vocab,
            spec.mix.name(),
            spec.seed
        )),
    );
    w.add("general.quantization_version", Value::U32(2));
    if let Some(ft) = spec.mix.file_type() {
        w.add("general.file_type", Value::U32(ft));
    }
    add_arch_meta(
        &mut w,
        &ArchMeta {
            arch: s.arch,
            ctx: s.ctx,
            d_model: s.d_model,
            n_layer: s.n_layer,
            d_ff: s.d_ff,
            n_head: s.n_head,
            n_head_kv: s.n_head_kv,
            head_dim: s.head_dim,
            vocab: s.vocab,
            sliding_window: s.sliding_window,
            rope_base: s.rope_base,
            rms_eps: s.rms_eps,
            softcaps: s.arch.softcaps(),
            experts: s.experts(),
        },
    );
    if let Some(g) = super::gemma4::Gemma4Model::of_shape(s) {
        g.add_meta(&mut w);
    }
    add_tokenizer(&mut w, s.vocab_kind, s.vocab);
    for t in tensors {
        w.add_tensor_info(&t.name, &t.dims, t.ty)?;
    }
    Ok(w)
}

/// Blocks to copy matrix rows from, per (type, row length).
struct Pools {
    seed: u64,
    pools: HashMap<(GgmlType, u32), Vec<u8>>,
}

impl Pools {
    /// Values per pool unit: one block, or 32 values of a float type.
    fn unit(ty: GgmlType) -> usize {
        ty.block_size().max(32)
    }

    fn get(&mut self, ty: GgmlType, row_len: u32) -> &[u8] {
        let seed = self.seed;
        self.pools.entry((ty, row_len)).or_insert_with(|| {
            let n = POOL_UNITS * Pools::unit(ty);
            let mut rng = StdRng::seed_from_u64(seed ^ (u64::from(row_len) << 8) ^ ty as u64);
            let scale = 1.0 / (row_len as f32).sqrt();
            let src: Vec<f32> = (0..n).map(|_| normal(&mut rng) * scale).collect();
            let mut dst = vec![0u8; n / ty.block_size() * ty.type_size()];
            (reference(ty).quantize)(&src, &mut dst);
            dst
        })
    }
}

/// A standard normal sample (Box–Muller).
fn normal(rng: &mut StdRng) -> f32 {
    let u1: f32 = 1.0 - rng.random::<f32>(); // (0, 1]
    let u2: f32 = rng.random::<f32>();
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

/// SplitMix64: the cheap per-block choice of pool unit.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Bytes handed to the stream at a time.
const CHUNK: usize = 1 << 20;

/// Produces tensor `index`'s data in chunks of about `CHUNK` bytes.
fn fill_tensor(
    pools: &mut Pools,
    seed: u64,
    index: usize,
    t: &Planned,
    mut sink: impl FnMut(&[u8]) -> io::Result<()>,
) -> io::Result<()> {
    let mut state = seed ^ (index as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    match &t.fill {
        Fill::Matrix => {
            let row_len = t.dims[0] as u32;
            let unit = Pools::unit(t.ty);
            let unit_bytes = unit / t.ty.block_size() * t.ty.type_size();
            let pool = pools.get(t.ty, row_len);
            let n_units = t.dims.iter().product::<u64>() / unit as u64;
            let mut buf = Vec::with_capacity(CHUNK + unit_bytes);
            for _ in 0..n_units {
                let u = (splitmix(&mut state) % POOL_UNITS as u64) as usize;
                buf.extend_from_slice(&pool[u * unit_bytes..(u + 1) * unit_bytes]);
                if buf.len() >= CHUNK {
                    sink(&buf)?;
                    buf.clear();
                }
            }
            if !buf.is_empty() {
                sink(&buf)?;
            }
            Ok(())
        }
        Fill::SkewedRouter { skew, layer } => {
            let mut rng = StdRng::seed_from_u64(state);
            let (skew, layer) = (*skew, *layer as usize);
            let (row_len, rows) = (t.dims[0] as usize, t.dims[1] as usize);
            let sd = 1.0 / (row_len as f32).sqrt();
            // A permutation of the ranks per layer: multiply by an odd number modulo a power
            // of two, or shift, for any other count.
            let rank = |e: usize| {
                if rows.is_power_of_two() {
                    (e * (2 * layer + 37) + layer) % rows
                } else {
                    (e + 7 * layer) % rows
                }
            };
            for e in 0..rows {
                let k = (1.0 + rank(e) as f32).powf(-skew);
                let row: Vec<u8> = (0..row_len)
                    .flat_map(|_| (normal(&mut rng) * sd * k).to_le_bytes())
                    .collect();
                sink(&row)?;
            }
            Ok(())
        }
        Fill::Norm | Fill::Bias | Fill::Values(_) | Fill::ScaledNorm(_) => {
            let mut rng = StdRng::seed_from_u64(state);
            let n = t.dims.iter().product::<u64>() as usize;
            let vals: Vec<f32> = match &t.fill {
                Fill::Norm => (0..n).map(|_| 1.0 + 0.1 * normal(&mut rng)).collect(),
                Fill::Bias => (0..n).map(|_| 0.1 * normal(&mut rng)).collect(),
                Fill::ScaledNorm(k) => (0..n).map(|_| (1.0 + 0.1 * normal(&mut rng)) * k).collect(),
                Fill::Values(v) => v.clone(),
                Fill::Matrix | Fill::SkewedRouter { .. } => Vec::new(),
            };
            let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
            sink(&bytes)
        }
    }
}

/// Writes the model of `spec` to `out` as a stream; returns the bytes written. The same spec
/// always gives the same bytes.
pub fn write_shape_model<W: Write>(spec: &ShapeSpec, out: W) -> Result<u64, SynthError> {
    spec.validate()?;
    let tensors = plan(spec);
    let w = header(spec, &tensors)?;
    let mut counted = CountingWrite { inner: out, n: 0 };
    let mut stream: TensorStream<'_, _> = w.stream(&mut counted)?;
    let mut pools = Pools {
        seed: spec.seed,
        pools: HashMap::new(),
    };
    for (i, t) in tensors.iter().enumerate() {
        fill_tensor(&mut pools, spec.seed, i, t, |b| stream.write_data(b))?;
    }
    stream.finish()?;
    counted.flush()?;
    Ok(counted.n)
}

/// The same model built in memory with `GgufWriter::add_tensor` (tests compare the two).
pub fn shape_model_bytes(spec: &ShapeSpec) -> Result<Vec<u8>, SynthError> {
    spec.validate()?;
    let tensors = plan(spec);
    let mut w = header(spec, &[])?;
    let mut pools = Pools {
        seed: spec.seed,
        pools: HashMap::new(),
    };
    for (i, t) in tensors.iter().enumerate() {
        let mut data = Vec::new();
        fill_tensor(&mut pools, spec.seed, i, t, |b| {
            data.extend_from_slice(b);
            Ok(())
        })?;
        w.add_tensor(&t.name, &t.dims, t.ty, data)?;
    }
    Ok(w.to_bytes())
}

/// Name, dims and type of every tensor `spec` writes, in file order.
pub fn shape_tensors(spec: &ShapeSpec) -> Vec<(String, Vec<u64>, GgmlType)> {
    plan(spec)
        .into_iter()
        .map(|t| (t.name, t.dims, t.ty))
        .collect()
}

/// The tokenizer-only part of a shape's header, as a GGUF without tensors (tokenizer tests).
pub fn tokenizer_gguf(kind: VocabKind, vocab: u32) -> Vec<u8> {
    let mut w = GgufWriter::new();
    add_tokenizer(&mut w, kind, vocab);
    w.to_bytes()
}

struct CountingWrite<W> {
    inner: W,
    n: u64,
}

impl<W: Write> Write for CountingWrite<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.n += k as u64;
        Ok(k)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}
