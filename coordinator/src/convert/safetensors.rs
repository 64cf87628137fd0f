//! A Hugging Face checkpoint's `.safetensors` files, memory-mapped: one file
//! (`model.safetensors`) or shards listed by `model.safetensors.index.json`.
//!
//! A safetensors file is an 8-byte little-endian header length, a JSON header mapping each
//! tensor name to `{dtype, shape, data_offsets: [begin, end]}` (offsets relative to the byte
//! after the header), then the data. Every length and offset is checked against the file's
//! size before anything is read, so a truncated or hostile shard is an error naming the file
//! and the tensor, never a panic or a huge allocation.

use super::ConvertError;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The largest JSON header we read (the format's own reference limit is 100 MB).
pub const MAX_HEADER: u64 = 100 << 20;

/// Element types we convert from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
    BF16,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
        }
    }
}

/// One tensor of the checkpoint: where its bytes are.
#[derive(Clone, Debug)]
pub struct StTensor {
    pub shard: usize,
    pub dtype: Dtype,
    /// As stored (row-major; the last dimension varies fastest).
    pub shape: Vec<u64>,
    /// Absolute byte range in the shard's file.
    pub begin: usize,
    pub end: usize,
}

impl StTensor {
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// A mapped shard.
pub struct Shard {
    pub path: PathBuf,
    map: memmap2::Mmap,
}

impl Shard {
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}

/// Every tensor of a checkpoint, by its Hugging Face name.
pub struct Checkpoint {
    pub shards: Vec<Shard>,
    pub tensors: BTreeMap<String, StTensor>,
}

impl Checkpoint {
    /// Opens `dir`'s `model.safetensors.index.json` and the shards it lists, or else its one
    /// `model.safetensors`.
    pub fn open(dir: &Path) -> Result<Checkpoint, ConvertError> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.is_file() {
            shard_files(&index)?
                .into_iter()
                .map(|f| dir.join(f))
                .collect()
        } else {
            let single = dir.join("model.safetensors");
            if !single.is_file() {
                return Err(ConvertError::Missing(format!(
                    "{} has neither model.safetensors nor model.safetensors.index.json",
                    dir.display()
                )));
            }
            vec![single]
        };
        let mut ck = Checkpoint {
            shards: Vec::with_capacity(files.len()),
            tensors: BTreeMap::new(),
        };
        for (i, path) in files.into_iter().enumerate() {
            let file = std::fs::File::open(&path).map_err(|e| ConvertError::io(&path, e))?;
            // SAFETY: the mapping is read-only and private to this process; like every
            // memory-mapped reader we rely on nobody truncating the file while we convert it.
            let map =
                unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ConvertError::io(&path, e))?;
            let shard = Shard { path, map };
            for (name, t) in parse_header(&shard.path, shard.bytes(), i)? {
                if ck.tensors.contains_key(&name) {
                    return Err(ConvertError::Checkpoint {
                        file: shard.path.clone(),
                        why: format!("tensor '{name}' is also in an earlier shard"),
                    });
                }
                ck.tensors.insert(name, t);
            }
            ck.shards.push(shard);
        }
        Ok(ck)
    }

    /// The tensor's raw bytes (checked at open to lie inside its shard).
    pub fn data(&self, t: &StTensor) -> &[u8] {
        &self.shards[t.shard].bytes()[t.begin..t.end]
    }
}

/// The distinct shard file names of an index, in first-seen order.
fn shard_files(index: &Path) -> Result<Vec<String>, ConvertError> {
    let text = super::read_text(index)?;
    let v: Value = serde_json::from_str(&text).map_err(|e| ConvertError::Checkpoint {
        file: index.to_path_buf(),
        why: format!("not JSON: {e}"),
    })?;
    let bad = |why: String| ConvertError::Checkpoint {
        file: index.to_path_buf(),
        why,
    };
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
    let mut out: Vec<String> = Vec::new();
    for (name, f) in map {
        let f = f
            .as_str()
            .ok_or_else(|| bad(format!("weight_map[\"{name}\"] is not a file name")))?;
        // Shards live beside the index: no directories, no way out of the folder.
        if f.is_empty() || f.contains('/') || f.contains('\\') || f == "." || f == ".." {
            return Err(bad(format!("weight_map[\"{name}\"]: bad shard name '{f}'")));
        }
        if !out.iter().any(|o| o == f) {
            out.push(f.to_string());
        }
    }
    if out.is_empty() {
        return Err(bad("\"weight_map\" is empty".into()));
    }
    Ok(out)
}

/// The tensors one shard's header describes, each checked to lie inside the file.
pub(super) fn parse_header(
    path: &Path,
    bytes: &[u8],
    index: usize,
) -> Result<Vec<(String, StTensor)>, ConvertError> {
    let bad = |why: String| ConvertError::Checkpoint {
        file: path.to_path_buf(),
        why,
    };
    let Some(len_bytes) = bytes.get(..8) else {
        return Err(bad(format!(
            "{} bytes: too short for a safetensors header",
            bytes.len()
        )));
    };
    let mut le = [0u8; 8];
    le.copy_from_slice(len_bytes);
    let n = u64::from_le_bytes(le);
    if n > MAX_HEADER || n > bytes.len() as u64 - 8 {
        return Err(bad(format!(
            "header length {n} exceeds the file ({} bytes) or the {MAX_HEADER}-byte cap: truncated or not a safetensors file",
            bytes.len()
        )));
    }
    let data_start = 8 + n as usize;
    let header: Value = serde_json::from_slice(&bytes[8..data_start])
        .map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let obj = header
        .as_object()
        .ok_or_else(|| bad("header is not a JSON object".into()))?;
    let data_len = (bytes.len() - data_start) as u64;
    let mut out = Vec::with_capacity(obj.len());
    for (name, info) in obj {
        if name == "__metadata__" {
            continue;
        }
        let tbad = |why: String| bad(format!("tensor '{name}': {why}"));
        let dtype = match info.get("dtype").and_then(Value::as_str) {
            Some("F32") => Dtype::F32,
            Some("F16") => Dtype::F16,
            Some("BF16") => Dtype::BF16,
            Some(other) => {
                return Err(ConvertError::Dtype {
                    tensor: name.clone(),
                    file: path.to_path_buf(),
                    dtype: other.to_string(),
                })
            }
            None => return Err(tbad("no \"dtype\"".into())),
        };
        let shape: Vec<u64> = info
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| tbad("no \"shape\" list".into()))?
            .iter()
            .map(Value::as_u64)
            .collect::<Option<Vec<u64>>>()
            .ok_or_else(|| tbad("\"shape\" holds a non-integer".into()))?;
        let offs: Vec<u64> = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let [b, e] = offs[..] else {
            return Err(tbad("\"data_offsets\" is not two integers".into()));
        };
        let n_el = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| tbad(format!("shape {shape:?} overflows")))?;
        let want = n_el
            .checked_mul(dtype.size() as u64)
            .ok_or_else(|| tbad(format!("shape {shape:?} overflows")))?;
        if b > e || e - b != want {
            return Err(tbad(format!(
                "data_offsets [{b}, {e}] do not hold {shape:?} of {} ({want} bytes)",
                dtype.name()
            )));
        }
        if e > data_len {
            return Err(ConvertError::Truncated {
                tensor: name.clone(),
                file: path.to_path_buf(),
                need: data_start as u64 + e,
                have: bytes.len() as u64,
            });
        }
        out.push((
            name.clone(),
            StTensor {
                shard: index,
                dtype,
                shape,
                begin: data_start + b as usize,
                end: data_start + e as usize,
            },
        ));
    }
    Ok(out)
}
