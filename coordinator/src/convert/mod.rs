//! `ringllm convert`: a Hugging Face checkpoint folder (`config.json`, the tokenizer files,
//! `.safetensors` shards) to one GGUF file that ringllm and llama.cpp load.
//!
//! The shards are memory-mapped and never read whole; the GGUF header is written first (every
//! tensor's size follows from its shape and type), then each tensor is converted a chunk of
//! rows at a time — decoded to f32, transformed (`arch`), encoded in its output type with the
//! kernels' quantizers — and written, so memory stays at a few MiB whatever the model's size.
//! The file is written beside the output as `OUT.part` and renamed when complete; on any
//! error the partial file is removed.

mod arch;
mod config;
mod safetensors;
mod vocab;

use crate::progress::{self, Kind};
use arch::{HfArch, Planned, Source, Xf};
use config::HfConfig;
use ringllm_kernels::{kernels, GgmlType};
use ringllm_model::gguf::{GgufError, GgufWriter, TensorStream, Value};
use ringllm_model::synth::WeightMix;
use safetensors::{Checkpoint, Dtype};
use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

pub use safetensors::MAX_HEADER;

#[cfg(test)]
mod tests;

/// Why a checkpoint could not be converted; each names the file, key or tensor.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("{}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file the conversion needs is not there.
    #[error("{0}")]
    Missing(String),
    /// A JSON file (config, tokenizer) lacks a key or holds a bad value.
    #[error("{}: {}{why}", file.display(), if key.is_empty() { String::new() } else { format!("\"{key}\": ") })]
    Config {
        file: PathBuf,
        key: String,
        why: String,
    },
    /// `architectures[0]` is a model class we do not convert.
    #[error("{}: architecture '{class}' is not one we convert (known: {})", file.display(), known.join(", "))]
    UnknownArch {
        file: PathBuf,
        class: String,
        known: Vec<&'static str>,
    },
    /// A safetensors file is malformed.
    #[error("{}: {why}", file.display())]
    Checkpoint { file: PathBuf, why: String },
    /// A tensor's element type is not F32, F16 or BF16.
    #[error("tensor '{tensor}' in {}: dtype {dtype} is not one we convert (F32, F16, BF16)", file.display())]
    Dtype {
        tensor: String,
        file: PathBuf,
        dtype: String,
    },
    /// A tensor's data lies past the end of its shard.
    #[error("tensor '{tensor}' in {}: its data ends at byte {need} but the file has {have} bytes (truncated shard?)", file.display())]
    Truncated {
        tensor: String,
        file: PathBuf,
        need: u64,
        have: u64,
    },
    /// A tensor the architecture needs is not in the checkpoint.
    #[error("missing tensor '{tensor}' (needed by a {arch} model)")]
    MissingTensor { tensor: String, arch: &'static str },
    /// A tensor's shape is not what config.json implies.
    #[error("tensor '{tensor}' has shape {got:?}; config.json implies {want:?}")]
    Shape {
        tensor: String,
        want: Vec<u64>,
        got: Vec<u64>,
    },
    /// A checkpoint tensor that no GGUF tensor is made from.
    #[error("tensor '{tensor}' is not part of a {arch} model we know how to convert")]
    Unused { tensor: String, arch: &'static str },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("writing {}", path.display())]
    Output {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl ConvertError {
    fn io(path: &Path, source: std::io::Error) -> ConvertError {
        ConvertError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// The largest JSON or template file we read.
const MAX_TEXT: u64 = 256 << 20;

fn read_text(path: &Path) -> Result<String, ConvertError> {
    let meta = std::fs::metadata(path).map_err(|e| ConvertError::io(path, e))?;
    if meta.len() > MAX_TEXT {
        return Err(ConvertError::Checkpoint {
            file: path.to_path_buf(),
            why: format!("{} bytes: larger than the {MAX_TEXT}-byte cap", meta.len()),
        });
    }
    std::fs::read_to_string(path).map_err(|e| ConvertError::io(path, e))
}

/// What to convert.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    pub dir: PathBuf,
    pub output: PathBuf,
    /// The matrices' weight types: one type (`f16`, `q8_0`, ...) or the `q4_k_m` mix.
    pub mix: WeightMix,
    /// Threads quantizing each chunk of rows (the K-quants' search is the slow part).
    pub threads: usize,
}

/// What was written.
#[derive(Clone, Debug)]
pub struct ConvertReport {
    pub arch: &'static str,
    pub n_tensors: usize,
    pub bytes: u64,
    /// Bytes read from the checkpoint's tensors.
    pub read: u64,
    pub seconds: f64,
}

/// Converts `opts.dir` to `opts.output`.
pub fn convert(opts: &ConvertOptions) -> Result<ConvertReport, ConvertError> {
    let started = std::time::Instant::now();
    let part = part_path(&opts.output);
    let result = convert_to(opts, &part).and_then(|r| {
        std::fs::rename(&part, &opts.output).map_err(|e| ConvertError::Output {
            path: opts.output.clone(),
            source: e,
        })?;
        Ok(r)
    });
    match result {
        Ok(mut r) => {
            r.seconds = started.elapsed().as_secs_f64();
            Ok(r)
        }
        Err(e) => {
            if std::fs::metadata(&part).is_ok_and(|m| m.is_file()) {
                let _ = std::fs::remove_file(&part);
            }
            Err(e)
        }
    }
}

/// `OUT.part` beside `OUT`.
fn part_path(out: &Path) -> PathBuf {
    let mut name = out
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(".part");
    out.with_file_name(name)
}

/// The element type a `dtype` tensor is copied into unchanged.
fn same_type(d: Dtype) -> GgmlType {
    match d {
        Dtype::F32 => GgmlType::F32,
        Dtype::F16 => GgmlType::F16,
        Dtype::BF16 => GgmlType::BF16,
    }
}

fn convert_to(opts: &ConvertOptions, part: &Path) -> Result<ConvertReport, ConvertError> {
    let dir = &opts.dir;
    let cfg = HfConfig::open(dir)?;
    let class = cfg.architecture()?;
    let a = HfArch::from_class(&class).ok_or_else(|| ConvertError::UnknownArch {
        file: cfg.path.clone(),
        class: class.clone(),
        known: HfArch::classes(),
    })?;
    let dims = arch::Dims::read(&cfg)?;
    let ck = Checkpoint::open(dir)?;
    // Bare language-model names (`layers.0.…`) to the checkpoint's full names.
    let mut bare: BTreeMap<&str, &str> = BTreeMap::new();
    for name in ck.tensors.keys() {
        if let Some(b) = arch::text_name(name) {
            bare.insert(b, name);
        }
    }
    let find = |b: &str| bare.get(b).map(|f| (*f).to_string());
    let embd_name = find("embed_tokens.weight").ok_or_else(|| ConvertError::MissingTensor {
        tensor: "model.embed_tokens.weight".into(),
        arch: a.gguf_name(),
    })?;
    let embd = &ck.tensors[&embd_name];
    let rows = embd.shape.first().copied().unwrap_or(0);
    if rows == 0 || rows > 1 << 24 {
        return Err(ConvertError::Shape {
            tensor: embd_name.clone(),
            want: vec![u64::from(dims.d)],
            got: embd.shape.clone(),
        });
    }
    if let Some(v) = cfg.opt_u32("vocab_size")? {
        if u64::from(v) != rows {
            return Err(cfg.error(
                "vocab_size",
                format!("{v}, but '{embd_name}' has {rows} rows"),
            ));
        }
    }
    let vocab = vocab::read(dir, &cfg, rows as usize, a.is_gemma())?;
    let plan = arch::plan(a, &cfg, &dims, &find, rows, vocab.n_tokens as u64)?;
    for (name, want) in &plan.shapes {
        let got = &ck.tensors[name].shape;
        if got != want {
            return Err(ConvertError::Shape {
                tensor: name.clone(),
                want: want.clone(),
                got: got.clone(),
            });
        }
    }
    let used: HashSet<&str> = plan
        .tensors
        .iter()
        .filter_map(|p| match &p.src {
            Source::Hf(n) => Some(n.as_str()),
            Source::Values(_) => None,
        })
        .collect();
    for (b, full) in &bare {
        if !used.contains(full) && !arch::ignorable(a, b, plan.tied) {
            return Err(ConvertError::Unused {
                tensor: (*full).to_string(),
                arch: a.gguf_name(),
            });
        }
    }

    let mut w = GgufWriter::new();
    w.add("general.architecture", Value::Str(a.gguf_name().into()));
    let name = cfg
        .opt_str("_name_or_path")?
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .or_else(|| {
            dir.canonicalize()
                .ok()
                .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        })
        .unwrap_or_else(|| "converted".into());
    w.add("general.name", Value::Str(name));
    w.add("general.quantization_version", Value::U32(2));
    if let Some(ft) = opts.mix.file_type() {
        w.add("general.file_type", Value::U32(ft));
    }
    for (k, v) in arch::metadata(a, &cfg, &dims, vocab.n_tokens as u32)? {
        w.add(&k, v);
    }
    for (k, v) in vocab.kv {
        w.add(&k, v);
    }
    let mut types = Vec::with_capacity(plan.tensors.len());
    let mut total = 0u64;
    for p in &plan.tensors {
        let ty = if p.dims.len() == 1 {
            GgmlType::F32
        } else {
            opts.mix.matrix_type(
                p.kind,
                p.layer.unwrap_or(0),
                dims.n_layer,
                p.dims[0] as u32,
                plan.tied,
                dims.n_head / dims.n_head_kv.max(1),
            )
        };
        total += w.add_tensor_info(&p.gguf, &p.dims, ty)?;
        types.push(ty);
    }

    let out_err = |e: std::io::Error| ConvertError::Output {
        path: part.to_path_buf(),
        source: e,
    };
    let file = std::fs::File::create(part).map_err(out_err)?;
    let mut buf = std::io::BufWriter::with_capacity(8 << 20, &file);
    let bar = progress::task(Kind::Bytes);
    bar.start("convert", Some(total));
    let mut stream = w.stream(&mut buf).map_err(out_err)?;
    let mut read = 0u64;
    for (p, &ty) in plan.tensors.iter().zip(&types) {
        read += write_tensor(&ck, p, ty, &mut stream, &*bar, part, opts.threads)?;
    }
    stream.finish().map_err(out_err)?;
    buf.flush().map_err(out_err)?;
    drop(buf);
    file.sync_all().map_err(out_err)?;
    bar.finish();
    let bytes = file.metadata().map_err(out_err)?.len();
    Ok(ConvertReport {
        arch: a.gguf_name(),
        n_tensors: plan.tensors.len(),
        bytes,
        read,
        seconds: 0.0,
    })
}

/// The Hugging Face row that GGUF row `r` of a Q or K projection comes from, in heads of
/// `head_rows` rows: Hugging Face rotates the two halves of a head, GGUF (interleaved RoPE)
/// adjacent pairs, so GGUF row `2i + t` of a head is its Hugging Face row `t·head_rows/2 + i`.
fn permuted_row(r: usize, head_rows: usize) -> usize {
    let (h, j) = (r / head_rows, r % head_rows);
    h * head_rows + (j % 2) * (head_rows / 2) + j / 2
}

/// Encodes `rows` whole rows `src` into `dst`, split over up to `threads` threads by rows (the
/// formats are row-independent, so the bytes are the same for any thread count).
fn encode_rows(
    encode: ringllm_kernels::dispatch::QuantizeFn,
    src: &[f32],
    dst: &mut [u8],
    rows: usize,
    threads: usize,
) {
    let n = threads.clamp(1, rows.max(1));
    // Small chunks are not worth a thread.
    if n == 1 || src.len() < 1 << 16 {
        encode(src, dst);
        return;
    }
    let per = rows.div_ceil(n);
    let (row_len, row_bytes) = (src.len() / rows, dst.len() / rows);
    std::thread::scope(|s| {
        for (x, y) in src
            .chunks(per * row_len)
            .zip(dst.chunks_mut(per * row_bytes))
        {
            s.spawn(move || encode(x, y));
        }
    });
}

/// f32 values converted at a time.
const CHUNK_VALUES: usize = 1 << 20;

/// Writes tensor `p` in type `ty`; returns the checkpoint bytes it read.
fn write_tensor<W: Write + Send>(
    ck: &Checkpoint,
    p: &Planned,
    ty: GgmlType,
    stream: &mut TensorStream<'_, W>,
    bar: &dyn progress::Progress,
    part: &Path,
    threads: usize,
) -> Result<u64, ConvertError> {
    let werr = |e: std::io::Error| ConvertError::Output {
        path: part.to_path_buf(),
        source: e,
    };
    let name = match &p.src {
        Source::Values(v) => {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            stream.write_data(&bytes).map_err(werr)?;
            bar.advance(bytes.len() as u64);
            return Ok(0);
        }
        Source::Hf(n) => n,
    };
    let t = &ck.tensors[name];
    let raw = ck.data(t);
    // Rows along the first Hugging Face dimension; a vector is rows of one value.
    let all_rows = t.shape.first().copied().unwrap_or(1).max(1) as usize;
    let row_len = (t.n_elements() as usize) / all_rows;
    let rows = p.rows as usize;
    let es = t.dtype.size();
    if p.xf == Xf::None && same_type(t.dtype) == ty {
        let data = &raw[..rows * row_len * es];
        for c in data.chunks(CHUNK_VALUES * 4) {
            stream.write_data(c).map_err(werr)?;
            bar.advance(c.len() as u64);
        }
        return Ok(data.len() as u64);
    }
    let src_row = |r: usize| -> usize {
        match p.xf {
            Xf::Permute { n_head } => permuted_row(r, all_rows / n_head as usize),
            _ => r,
        }
    };
    if let Xf::Permute { n_head } = p.xf {
        let n = n_head as usize;
        if n == 0 || !all_rows.is_multiple_of(n) || !(all_rows / n).is_multiple_of(2) {
            return Err(ConvertError::Shape {
                tensor: name.clone(),
                want: vec![u64::from(n_head), 2],
                got: t.shape.clone(),
            });
        }
    }
    let decode = kernels(same_type(t.dtype)).dequantize;
    let encode = kernels(ty).quantize;
    let per_chunk = (CHUNK_VALUES / row_len.max(1)).max(1);
    let mut f = vec![0f32; per_chunk * row_len];
    let out_bytes = ty.row_bytes(per_chunk * row_len).ok_or_else(|| {
        GgufError::InvalidInput(format!(
            "tensor '{}': {per_chunk} x {row_len} of {ty}",
            p.gguf
        ))
    })?;
    let row_bytes = row_len * es;
    // Two output buffers: the writer thread writes one chunk while this thread decodes and
    // encodes the next, so the disk and the encoders work at once (the write's copy into
    // the page cache was half of an f16 convert's time, serial with the encoding).
    let (to_writer, filled) = std::sync::mpsc::sync_channel::<(Vec<u8>, usize)>(1);
    let (to_encoder, empty) = std::sync::mpsc::channel::<Vec<u8>>();
    for _ in 0..2 {
        // Cannot fail: the receiver is alive.
        let _ = to_encoder.send(vec![0u8; out_bytes]);
    }
    let wrote = std::thread::scope(|scope| -> Result<(), ConvertError> {
        let writer = scope.spawn(move || -> std::io::Result<()> {
            for (q, n) in filled {
                stream.write_data(&q[..n])?;
                bar.advance(n as u64);
                if to_encoder.send(q).is_err() {
                    break;
                }
            }
            Ok(())
        });
        let mut start = 0;
        let mut produced = Ok(());
        while start < rows {
            // The writer hands every buffer back unless it failed: then stop and report.
            let Ok(mut q) = empty.recv() else { break };
            let k = per_chunk.min(rows - start);
            for r in 0..k {
                let s = src_row(start + r) * row_bytes;
                decode(
                    &raw[s..s + row_bytes],
                    &mut f[r * row_len..(r + 1) * row_len],
                );
            }
            let vals = &mut f[..k * row_len];
            if p.xf == Xf::AddOne {
                vals.iter_mut().for_each(|v| *v += 1.0);
            }
            let Some(n) = ty.row_bytes(vals.len()) else {
                produced =
                    Err(GgufError::InvalidInput(format!("tensor '{}' in {ty}", p.gguf)).into());
                break;
            };
            encode_rows(encode, vals, &mut q[..n], k, threads);
            if to_writer.send((q, n)).is_err() {
                break;
            }
            start += k;
        }
        drop(to_writer);
        let written = writer
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the convert writer thread panicked")));
        written.map_err(werr)?;
        produced
    });
    wrote?;
    Ok((rows * row_bytes) as u64)
}
