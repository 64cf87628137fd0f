//! GGUF reader: parses and validates the header, metadata and tensor table of a memory-mapped
//! (or in-memory) file. Everything a caller can later ask for is checked here, so the
//! accessors cannot fail: every tensor's bytes lie inside the file.
//!
//! Layout (all little-endian): magic `GGUF`, version u32, tensor count u64, KV count u64,
//! KV entries (key string, value type u32, value), tensor infos (name string, n_dims u32,
//! dims u64 × n_dims, type u32, offset u64 relative to the data section), padding to the
//! alignment, tensor data. Strings are a u64 length and that many bytes.

use super::error::GgufError;
use super::metadata::{scalar_type_name, type_id, Array, Metadata, Value};
use ringllm_kernels::GgmlType;
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

/// The magic at byte 0.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of every tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// Longest metadata string value we accept (chat templates are ~10 KiB; vocab tokens are short).
pub const MAX_STRING_LEN: usize = 16 << 20;
/// Longest key or tensor name we accept (the specification caps keys at 65535 bytes).
pub const MAX_NAME_LEN: usize = 65535;
/// Most dimensions a tensor may have (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays of arrays we read.
pub const MAX_ARRAY_DEPTH: u32 = 4;

/// Smallest possible encoding of one KV entry: empty key, type id, one-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Smallest possible encoding of one tensor info: empty name, n_dims, type id, offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;

/// One entry of the tensor table, with its placement resolved to absolute file offsets.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the row length (contiguous elements).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    /// Bytes of data.
    pub size: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Number of rows: the product of every dimension but the first.
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }

    /// Elements per row (`dims[0]`).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }
}

enum Storage {
    Mmap(memmap2::Mmap),
    Bytes(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Bytes(v) => v,
        }
    }
}

/// A parsed, validated GGUF file.
pub struct GgufFile {
    storage: Storage,
    path: Option<PathBuf>,
    version: u32,
    alignment: usize,
    data_offset: usize,
    header_len: usize,
    header_hash: u64,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("bytes", &self.bytes().len())
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("header_hash", &format_args!("{:016x}", self.header_hash))
            .finish()
    }
}

/// Opens `path` for reading if it is a regular file (after symlinks); anything else is
/// refused by kind before `open`, which would block on a FIFO until a writer appears.
fn open_regular(path: &Path) -> Result<std::fs::File, GgufError> {
    let io = |cause| GgufError::Io {
        path: path.to_path_buf(),
        cause,
    };
    let not_regular = |ft: std::fs::FileType| {
        use std::os::unix::fs::FileTypeExt;
        let kind = if ft.is_dir() {
            "a directory"
        } else if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_socket() {
            "a socket"
        } else if ft.is_char_device() || ft.is_block_device() {
            "a device"
        } else {
            "not a file"
        };
        GgufError::NotRegularFile {
            path: path.to_path_buf(),
            kind,
        }
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(not_regular(meta.file_type()));
    }
    // O_NONBLOCK: should the path be swapped for a FIFO after the check, open still returns.
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(not_regular(meta.file_type()));
    }
    Ok(file)
}

impl GgufFile {
    /// Memory-maps `path`, then parses and validates it.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let file = open_regular(path)?;
        let io = |cause| GgufError::Io {
            path: path.to_path_buf(),
            cause,
        };
        let len = file.metadata().map_err(io)?.len();
        let storage = if len == 0 {
            Storage::Bytes(Vec::new())
        } else {
            // SAFETY: the mapping is read-only and private to this process; as with every
            // memory-mapped reader, the file must not be truncated or rewritten while mapped.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
            Storage::Mmap(map)
        };
        let mut f = GgufFile::parse(storage, false)?;
        f.path = Some(path.to_path_buf());
        Ok(f)
    }

    /// Like `open`, but the tokenizer's arrays (vocabulary, scores, merges) are checked and
    /// skipped instead of kept: what a node, which never tokenizes, opens (Gemma 3's 262,144
    /// tokens would otherwise cost tens of MiB of heap). The header hash is the same.
    pub fn open_lean(path: &Path) -> Result<GgufFile, GgufError> {
        let file = open_regular(path)?;
        let io = |cause| GgufError::Io {
            path: path.to_path_buf(),
            cause,
        };
        // SAFETY: as in `open`.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let mut f = GgufFile::parse(Storage::Mmap(map), true)?;
        f.path = Some(path.to_path_buf());
        Ok(f)
    }

    /// Parses and validates a GGUF held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        GgufFile::parse(Storage::Bytes(bytes), false)
    }

    fn parse(storage: Storage, lean: bool) -> Result<GgufFile, GgufError> {
        let p = parse(storage.bytes(), lean)?;
        let index = p
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            storage,
            path: None,
            version: p.version,
            alignment: p.alignment,
            data_offset: p.data_offset,
            header_len: p.header_len,
            header_hash: p.header_hash,
            metadata: p.metadata,
            tensors: p.tensors,
            index,
        })
    }

    /// 2 or 3.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// `general.alignment`, or 32.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Start of the tensor data section (aligned; at most the file length).
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    /// Bytes of header, metadata and tensor table (before the padding).
    pub fn header_len(&self) -> usize {
        self.header_len
    }

    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Tensors in file (table) order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).and_then(|&i| self.tensors.get(i))
    }

    /// The bytes of `t` (empty if `t` does not describe a range of this file, which cannot
    /// happen for the infos this file returned: their ranges were checked at open).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let range = usize::try_from(t.offset).ok().and_then(|start| {
            let len = usize::try_from(t.size).ok()?;
            Some(start..start.checked_add(len)?)
        });
        range.and_then(|r| self.bytes().get(r)).unwrap_or(&[])
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// Tells the kernel the mapped pages inside `range` will not be read again (their data
    /// was copied elsewhere), so they leave the resident set. A read later faults them back in
    /// from the file, unchanged. Does nothing for a file held in memory.
    pub fn release(&self, range: std::ops::Range<usize>) {
        let Storage::Mmap(map) = &self.storage else {
            return;
        };
        // SAFETY: sysconf only reads a constant of the system.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .ok()
            .filter(|&p| p > 0)
            .unwrap_or(4096);
        let start = range.start.next_multiple_of(page);
        let end = range.end.min(map.len()) / page * page;
        if end > start {
            // SAFETY: the mapping is a private read-only map of a file we never write through;
            // dropping its pages only means the next read fetches them from the file again.
            let r = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
            };
            if let Err(e) = r {
                tracing::debug!(error = %e, "madvise(DONTNEED) of repacked weights");
            }
        }
    }

    /// FNV-1a 64 of the header, metadata and tensor table bytes: identifies the model file
    /// without hashing the weights.
    pub fn header_hash(&self) -> u64 {
        self.header_hash
    }

    /// The path the file was opened from (`None` for `from_bytes`).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }
}

/// FNV-1a, 64-bit.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

struct Parsed {
    version: u32,
    alignment: usize,
    data_offset: usize,
    header_len: usize,
    header_hash: u64,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
}

/// A bounds-checked little-endian reader. `what` closures build error context only on error.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

type What<'w> = &'w dyn Fn() -> String;

impl<'a> Cursor<'a> {
    fn left(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize, what: What) -> Result<&'a [u8], GgufError> {
        let end = self.pos.checked_add(n);
        match end.and_then(|end| self.buf.get(self.pos..end)) {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
                need: n as u64,
                left: self.left() as u64,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: What) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: What) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: What) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A length-prefixed string's bytes, at most `cap` long.
    fn string_bytes(&mut self, cap: usize, what: What) -> Result<&'a [u8], GgufError> {
        let at = self.pos;
        let len = self.u64(&|| format!("length of {}", what()))?;
        if len > cap as u64 {
            return Err(GgufError::Invalid {
                what: what(),
                offset: at as u64,
                why: format!("string length {len} exceeds the limit of {cap} bytes"),
            });
        }
        // len <= cap fits in usize.
        self.take(len as usize, what)
    }

    /// A key or tensor name: must be valid UTF-8.
    fn name(&mut self, what: What) -> Result<String, GgufError> {
        let at = self.pos;
        let b = self.string_bytes(MAX_NAME_LEN, what)?;
        String::from_utf8(b.to_vec()).map_err(|e| GgufError::Invalid {
            what: what(),
            offset: at as u64,
            why: format!("not valid UTF-8 ({e})"),
        })
    }

    /// A string value. Invalid UTF-8 is replaced (U+FFFD) rather than refused: a single
    /// odd vocabulary entry should not make a model unreadable.
    fn string_value(&mut self, what: What) -> Result<String, GgufError> {
        let b = self.string_bytes(MAX_STRING_LEN, what)?;
        Ok(match std::str::from_utf8(b) {
            Ok(s) => s.to_string(),
            Err(_) => String::from_utf8_lossy(b).into_owned(),
        })
    }
}

/// Bytes of one fixed-size scalar of type `ty`, or `None` for strings, arrays and unknown ids.
fn fixed_size(ty: u32) -> Option<usize> {
    Some(match ty {
        type_id::U8 | type_id::I8 | type_id::BOOL => 1,
        type_id::U16 | type_id::I16 => 2,
        type_id::U32 | type_id::I32 | type_id::F32 => 4,
        type_id::U64 | type_id::I64 | type_id::F64 => 8,
        _ => return None,
    })
}

fn read_value(c: &mut Cursor, ty: u32, key: &str, at: usize) -> Result<Value, GgufError> {
    let what = || format!("value of key '{key}'");
    Ok(match ty {
        type_id::U8 => Value::U8(u8::from_le_bytes(c.array(&what)?)),
        type_id::I8 => Value::I8(i8::from_le_bytes(c.array(&what)?)),
        type_id::U16 => Value::U16(u16::from_le_bytes(c.array(&what)?)),
        type_id::I16 => Value::I16(i16::from_le_bytes(c.array(&what)?)),
        type_id::U32 => Value::U32(u32::from_le_bytes(c.array(&what)?)),
        type_id::I32 => Value::I32(i32::from_le_bytes(c.array(&what)?)),
        type_id::F32 => Value::F32(f32::from_le_bytes(c.array(&what)?)),
        type_id::BOOL => Value::Bool(c.array::<1>(&what)?[0] != 0),
        type_id::STRING => Value::Str(c.string_value(&what)?),
        type_id::ARRAY => Value::Array(read_array(c, key, 1)?),
        type_id::U64 => Value::U64(u64::from_le_bytes(c.array(&what)?)),
        type_id::I64 => Value::I64(i64::from_le_bytes(c.array(&what)?)),
        type_id::F64 => Value::F64(f64::from_le_bytes(c.array(&what)?)),
        id => {
            return Err(GgufError::UnknownValueType {
                key: key.to_string(),
                id,
                offset: at as u64,
            })
        }
    })
}

fn read_array(c: &mut Cursor, key: &str, depth: u32) -> Result<Array, GgufError> {
    let at = c.pos;
    let ty = c.u32(&|| format!("array element type of key '{key}'"))?;
    let count = c.u64(&|| format!("array length of key '{key}'"))?;
    let min_elem = match ty {
        type_id::STRING => 8,
        type_id::ARRAY => 12,
        t => fixed_size(t).ok_or(GgufError::UnknownValueType {
            key: key.to_string(),
            id: t,
            offset: at as u64,
        })?,
    };
    if ty == type_id::ARRAY && depth >= MAX_ARRAY_DEPTH {
        return Err(GgufError::Invalid {
            what: format!("array of key '{key}'"),
            offset: at as u64,
            why: format!("arrays nested more than {MAX_ARRAY_DEPTH} deep"),
        });
    }
    // Every element needs at least `min_elem` bytes: check before allocating anything.
    let need = count.checked_mul(min_elem as u64);
    let n = match need {
        Some(need) if need <= c.left() as u64 => count as usize,
        _ => {
            return Err(GgufError::Invalid {
                what: format!("array of key '{key}'"),
                offset: at as u64,
                why: format!(
                    "{count} elements of {} need at least {} bytes, {} left",
                    scalar_type_name(ty),
                    need.map_or_else(|| "2^64+".to_string(), |n| n.to_string()),
                    c.left()
                ),
            })
        }
    };
    let what = || format!("array of key '{key}'");
    macro_rules! fixed {
        ($variant:ident, $t:ty) => {{
            let raw = c.take(n * std::mem::size_of::<$t>(), &what)?;
            Array::$variant(
                raw.chunks_exact(std::mem::size_of::<$t>())
                    .map(|ch| {
                        let mut b = [0u8; std::mem::size_of::<$t>()];
                        b.copy_from_slice(ch);
                        <$t>::from_le_bytes(b)
                    })
                    .collect(),
            )
        }};
    }
    Ok(match ty {
        type_id::U8 => fixed!(U8, u8),
        type_id::I8 => fixed!(I8, i8),
        type_id::U16 => fixed!(U16, u16),
        type_id::I16 => fixed!(I16, i16),
        type_id::U32 => fixed!(U32, u32),
        type_id::I32 => fixed!(I32, i32),
        type_id::F32 => fixed!(F32, f32),
        type_id::U64 => fixed!(U64, u64),
        type_id::I64 => fixed!(I64, i64),
        type_id::F64 => fixed!(F64, f64),
        type_id::BOOL => Array::Bool(c.take(n, &what)?.iter().map(|&b| b != 0).collect()),
        type_id::STRING => {
            let mut v = Vec::with_capacity(n);
            for i in 0..n {
                v.push(c.string_value(&|| format!("element {i} of array '{key}'"))?);
            }
            Array::Str(v)
        }
        _ => {
            // Nested arrays (min_elem was only found for known types).
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(read_array(c, key, depth + 1)?);
            }
            Array::Nested(v)
        }
    })
}

/// Checks an array's structure and moves past it without keeping anything.
fn skip_array(c: &mut Cursor, key: &str, depth: u32) -> Result<(), GgufError> {
    let at = c.pos;
    let ty = c.u32(&|| format!("array element type of key '{key}'"))?;
    let count = c.u64(&|| format!("array length of key '{key}'"))?;
    let what = || format!("array of key '{key}'");
    match ty {
        type_id::STRING => {
            for i in 0..count {
                let len = c.u64(&|| format!("length of element {i} of array '{key}'"))?;
                let len = usize::try_from(len).unwrap_or(usize::MAX);
                c.take(len, &what)?;
            }
        }
        type_id::ARRAY if depth < MAX_ARRAY_DEPTH => {
            for _ in 0..count {
                skip_array(c, key, depth + 1)?;
            }
        }
        t => {
            let size = fixed_size(t).ok_or(GgufError::UnknownValueType {
                key: key.to_string(),
                id: t,
                offset: at as u64,
            })?;
            let n = count
                .checked_mul(size as u64)
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or(usize::MAX);
            c.take(n, &what)?;
        }
    }
    Ok(())
}

fn parse(buf: &[u8], lean: bool) -> Result<Parsed, GgufError> {
    let mut c = Cursor { buf, pos: 0 };
    let version = read_version(&mut c)?;
    let (n_kv, n_tensors) = read_counts(&mut c)?;
    let metadata = read_metadata(&mut c, n_kv, lean)?;
    let alignment = alignment_of(&metadata)?;
    let TensorTable {
        mut tensors,
        rel_offsets,
        info_at,
    } = read_tensor_table(&mut c, n_tensors, alignment)?;
    let header_len = c.pos;
    let aligned = header_len
        .checked_next_multiple_of(alignment)
        .unwrap_or(usize::MAX);
    let file_len = buf.len();
    place_tensors(&mut tensors, &rel_offsets, &info_at, aligned, file_len)?;
    check_no_overlap(&tensors, &info_at)?;

    Ok(Parsed {
        version,
        alignment,
        // Without tensors the padding after the table may be absent.
        data_offset: aligned.min(file_len),
        header_len,
        header_hash: fnv1a64(buf.get(..header_len).unwrap_or(buf)),
        metadata,
        tensors,
    })
}

/// The magic and a version this reader supports (2 or 3).
fn read_version(c: &mut Cursor) -> Result<u32, GgufError> {
    let magic: [u8; 4] = c.array(&|| "magic".to_string())?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic {
            found: magic.to_vec(),
        });
    }
    let version = c.u32(&|| "version".to_string())?;
    match version {
        2 | 3 => Ok(version),
        1 => Err(GgufError::UnsupportedVersion {
            version,
            why: "GGUF v1 (32-bit counts) is obsolete; re-convert the model with a current \
                  llama.cpp",
        }),
        v if matches!(v.swap_bytes(), 1..=3) => Err(GgufError::BigEndian {
            raw: v,
            swapped: v.swap_bytes(),
        }),
        _ => Err(GgufError::UnsupportedVersion {
            version,
            why: "only versions 2 and 3 are supported",
        }),
    }
}

/// The tensor and metadata KV counts, `(n_kv, n_tensors)`, each checked against the bytes
/// left (every entry needs a minimum size) so that nothing sized by them can exhaust memory.
fn read_counts(c: &mut Cursor) -> Result<(usize, usize), GgufError> {
    let count_at = c.pos;
    let n_tensors = c.u64(&|| "tensor count".to_string())?;
    let kv_at = c.pos;
    let n_kv = c.u64(&|| "metadata KV count".to_string())?;
    let left = c.left() as u64;
    let kv_min = n_kv.checked_mul(MIN_KV_BYTES);
    if kv_min.is_none_or(|m| m > left) {
        return Err(GgufError::Invalid {
            what: "metadata KV count".to_string(),
            offset: kv_at as u64,
            why: format!(
                "{n_kv} entries need at least {MIN_KV_BYTES} bytes each, only {left} bytes left"
            ),
        });
    }
    let ti_min = n_tensors.checked_mul(MIN_TENSOR_INFO_BYTES);
    let both = kv_min.zip(ti_min).and_then(|(a, b)| a.checked_add(b));
    if both.is_none_or(|m| m > left) {
        return Err(GgufError::Invalid {
            what: "tensor count".to_string(),
            offset: count_at as u64,
            why: format!(
                "{n_tensors} tensor infos need at least {MIN_TENSOR_INFO_BYTES} bytes each \
                 (after {n_kv} KV entries), only {left} bytes left"
            ),
        });
    }
    // Both counts are now bounded by the file length.
    Ok((n_kv as usize, n_tensors as usize))
}

/// `n_kv` metadata entries; `lean` skips the tokenizer's arrays (checked, not kept).
fn read_metadata(c: &mut Cursor, n_kv: usize, lean: bool) -> Result<Metadata, GgufError> {
    let mut metadata = Metadata::new();
    for i in 0..n_kv {
        let at = c.pos;
        let key = c.name(&|| format!("key of metadata entry {i}"))?;
        let ty_at = c.pos;
        let ty = c.u32(&|| format!("value type of key '{key}'"))?;
        if lean && ty == type_id::ARRAY && key.starts_with("tokenizer.") {
            skip_array(c, &key, 1)?;
            continue;
        }
        let value = read_value(c, ty, &key, ty_at)?;
        if metadata.get(&key).is_some() {
            return Err(GgufError::DuplicateKey {
                key,
                offset: at as u64,
            });
        }
        metadata.insert(key, value, at as u64);
    }
    Ok(metadata)
}

/// `general.alignment`, or the default: a power of two, at most 2^30.
fn alignment_of(metadata: &Metadata) -> Result<usize, GgufError> {
    Ok(match metadata.opt_u64("general.alignment")? {
        None => DEFAULT_ALIGNMENT,
        Some(a) => {
            let ok = usize::try_from(a)
                .ok()
                .filter(|a| a.is_power_of_two() && *a <= 1 << 30);
            ok.ok_or_else(|| GgufError::Invalid {
                what: "general.alignment".to_string(),
                offset: metadata.offset_of("general.alignment").unwrap_or(0),
                why: format!("{a} is not a power of two (at most 2^30)"),
            })?
        }
    })
}

/// The tensor infos as read: each tensor (its offset not yet placed), its data offset
/// relative to the data section, and where its info starts in the file.
struct TensorTable {
    tensors: Vec<TensorInfo>,
    rel_offsets: Vec<u64>,
    info_at: Vec<usize>,
}

/// `n_tensors` tensor infos (bounded by the file length by `read_counts`), names unique.
fn read_tensor_table(
    c: &mut Cursor,
    n_tensors: usize,
    alignment: usize,
) -> Result<TensorTable, GgufError> {
    let mut table = TensorTable {
        tensors: Vec::with_capacity(n_tensors),
        rel_offsets: Vec::with_capacity(n_tensors),
        info_at: Vec::with_capacity(n_tensors),
    };
    let mut index: HashMap<String, usize> = HashMap::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let at = c.pos;
        let (info, rel) = read_tensor_info(c, i, alignment)?;
        if index.insert(info.name.clone(), i).is_some() {
            return Err(GgufError::DuplicateTensor {
                name: info.name,
                offset: at as u64,
            });
        }
        table.tensors.push(info);
        table.rel_offsets.push(rel);
        table.info_at.push(at);
    }
    Ok(table)
}

/// Tensor info `i`: the tensor (offset 0 until placed) and its data offset relative to the
/// data section. Dimensions, type, size and alignment are checked here.
fn read_tensor_info(
    c: &mut Cursor,
    i: usize,
    alignment: usize,
) -> Result<(TensorInfo, u64), GgufError> {
    let file_len = c.buf.len();
    let at = c.pos;
    let name = c.name(&|| format!("name of tensor {i}"))?;
    let w = || format!("tensor info for '{name}'");
    let bad = |why: String| GgufError::BadTensor {
        name: name.clone(),
        offset: at as u64,
        why,
    };
    let n_dims = c.u32(&w)?;
    if n_dims == 0 || n_dims as usize > MAX_DIMS {
        return Err(bad(format!(
            "{n_dims} dimensions (must be 1 to {MAX_DIMS})"
        )));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        dims.push(c.u64(&w)?);
    }
    if let Some(j) = dims.iter().position(|&d| d == 0) {
        return Err(bad(format!("dimension {j} is 0 (dims {dims:?})")));
    }
    let n_el = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(|| bad(format!("element count of dims {dims:?} overflows")))?;
    let ty_id = c.u32(&w)?;
    let ty = GgmlType::from_id(ty_id).ok_or_else(|| GgufError::UnknownTensorType {
        name: name.clone(),
        id: ty_id,
        offset: at as u64,
    })?;
    let rel = c.u64(&w)?;
    let row_len = dims.first().copied().unwrap_or(1);
    let block = ty.block_size() as u64;
    if !row_len.is_multiple_of(block) {
        return Err(bad(format!(
            "row length {row_len} is not a multiple of the {ty} block size {block}"
        )));
    }
    let size = (n_el / block)
        .checked_mul(ty.type_size() as u64)
        .filter(|&s| s <= file_len as u64)
        .ok_or_else(|| {
            bad(format!(
                "{n_el} elements of {ty} do not fit in the file ({file_len} bytes)"
            ))
        })?;
    if !rel.is_multiple_of(alignment as u64) {
        return Err(bad(format!(
            "data offset {rel} is not a multiple of the alignment {alignment}"
        )));
    }
    Ok((
        TensorInfo {
            name,
            dims,
            ty,
            offset: 0,
            size,
        },
        rel,
    ))
}

/// Sets each tensor's offset to the data section (`aligned`) plus its relative offset,
/// checking that its data ends within the file.
fn place_tensors(
    tensors: &mut [TensorInfo],
    rel_offsets: &[u64],
    info_at: &[usize],
    aligned: usize,
    file_len: usize,
) -> Result<(), GgufError> {
    for ((t, &rel), &at) in tensors.iter_mut().zip(rel_offsets).zip(info_at) {
        let start = (aligned as u64).checked_add(rel);
        let end = start.and_then(|s| s.checked_add(t.size));
        match (start, end) {
            (Some(s), Some(e)) if e <= file_len as u64 => t.offset = s,
            _ => {
                return Err(GgufError::BadTensor {
                    name: t.name.clone(),
                    offset: at as u64,
                    why: format!(
                        "data at offset {rel} of the data section (byte {}) plus {} bytes \
                         extends past the end of the file ({file_len} bytes)",
                        start.map_or_else(|| "2^64+".to_string(), |s| s.to_string()),
                        t.size
                    ),
                })
            }
        }
    }
    Ok(())
}

/// No two tensors may share bytes.
fn check_no_overlap(tensors: &[TensorInfo], info_at: &[usize]) -> Result<(), GgufError> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| tensors.get(i).map_or(0, |t| t.offset));
    for pair in order.windows(2) {
        let &[ia, ib] = pair else { continue };
        if let (Some(a), Some(b), Some(&at)) = (tensors.get(ia), tensors.get(ib), info_at.get(ib)) {
            if a.offset + a.size > b.offset {
                return Err(GgufError::BadTensor {
                    name: b.name.clone(),
                    offset: at as u64,
                    why: format!(
                        "data at byte {} overlaps tensor '{}' (bytes {}..{})",
                        b.offset,
                        a.name,
                        a.offset,
                        a.offset + a.size
                    ),
                });
            }
        }
    }
    Ok(())
}
