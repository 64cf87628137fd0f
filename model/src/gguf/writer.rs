//! GGUF writer (version 3, little-endian): metadata in insertion order, tensors in insertion
//! order, each tensor's data aligned to the file's alignment.
//!
//! A tensor is added with its bytes (`add_tensor`) or declared by shape and type alone
//! (`add_tensor_info`); offsets follow from the sizes, so the header can be written before any
//! data exists and a file of any size streamed through [`TensorStream`] without holding it.

use super::error::GgufError;
use super::metadata::{Array, Value};
use super::reader::{DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS, MAX_NAME_LEN};
use ringllm_kernels::GgmlType;
use std::io::{self, Write};
use std::path::Path;

/// Where a tensor's data sits in a file: absolute offset and size in bytes.
pub type Placed = (u64, u64);

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    /// Encoded size in bytes.
    size: u64,
    /// `None`: declared only; the bytes come through a [`TensorStream`].
    data: Option<Vec<u8>>,
}

/// Builds a GGUF file: in memory (`to_bytes`), or header first with the tensor data streamed
/// after it (`stream`).
pub struct GgufWriter {
    version: u32,
    alignment: usize,
    kv: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        GgufWriter::new()
    }
}

const ALIGNMENT_KEY: &str = "general.alignment";

impl GgufWriter {
    /// Version 3, alignment 32, no metadata, no tensors.
    pub fn new() -> Self {
        GgufWriter {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            kv: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Sets the data alignment (a power of two); `general.alignment` is written when it is
    /// not the default 32.
    pub fn set_alignment(&mut self, alignment: usize) -> Result<(), GgufError> {
        if !alignment.is_power_of_two() || alignment > 1 << 30 {
            return Err(GgufError::InvalidInput(format!(
                "alignment {alignment} is not a power of two (at most 2^30)"
            )));
        }
        self.alignment = alignment;
        Ok(())
    }

    /// Sets the version field: 2 or 3 (they share one layout).
    pub fn set_version(&mut self, version: u32) -> Result<(), GgufError> {
        if !matches!(version, 2 | 3) {
            return Err(GgufError::InvalidInput(format!(
                "can only write GGUF versions 2 and 3, not {version}"
            )));
        }
        self.version = version;
        Ok(())
    }

    /// Adds a metadata entry; adding a key again replaces its value (keeping its position).
    /// `general.alignment` is always written as the writer's alignment (see `set_alignment`).
    pub fn add(&mut self, key: &str, value: Value) {
        match self.kv.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.kv.push((key.to_string(), value)),
        }
    }

    /// Adds a tensor of shape `dims` (GGML order, `dims[0]` the row length) whose encoded
    /// data is `data`.
    pub fn add_tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> Result<(), GgufError> {
        let size = self.check_tensor(name, dims, ty)?;
        if size != data.len() as u64 {
            return Err(GgufError::InvalidInput(format!(
                "tensor '{name}': {dims:?} of {ty} take {size} bytes, data has {}",
                data.len()
            )));
        }
        self.push(name, dims, ty, size, Some(data));
        Ok(())
    }

    /// Declares a tensor of shape `dims` whose data will be written through [`TensorStream`];
    /// returns its size in bytes.
    pub fn add_tensor_info(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
    ) -> Result<u64, GgufError> {
        let size = self.check_tensor(name, dims, ty)?;
        self.push(name, dims, ty, size, None);
        Ok(size)
    }

    fn push(&mut self, name: &str, dims: &[u64], ty: GgmlType, size: u64, data: Option<Vec<u8>>) {
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty,
            size,
            data,
        });
    }

    /// Checks a new tensor's name and shape; returns its encoded size.
    fn check_tensor(&self, name: &str, dims: &[u64], ty: GgmlType) -> Result<u64, GgufError> {
        let bad = |why: String| GgufError::InvalidInput(format!("tensor '{name}': {why}"));
        if name.len() > MAX_NAME_LEN {
            return Err(bad(format!("name longer than {MAX_NAME_LEN} bytes")));
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(bad("added twice".to_string()));
        }
        if dims.is_empty() || dims.len() > MAX_DIMS || dims.contains(&0) {
            return Err(bad(format!(
                "dims {dims:?}: need 1 to {MAX_DIMS} non-zero dimensions"
            )));
        }
        let n_el = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| bad(format!("element count of dims {dims:?} overflows")))?;
        let block = ty.block_size() as u64;
        if !dims[0].is_multiple_of(block) {
            return Err(bad(format!(
                "row length {} is not a multiple of the {ty} block size {block}",
                dims[0]
            )));
        }
        (n_el / block)
            .checked_mul(ty.type_size() as u64)
            .ok_or_else(|| bad(format!("{n_el} elements of {ty} overflow a 64-bit size")))
    }

    /// The metadata as written: `general.alignment` set to the writer's alignment (`align`
    /// holds that value).
    fn effective_kv<'a>(&'a self, align: &'a Value) -> Vec<(&'a str, &'a Value)> {
        let mut out: Vec<(&str, &Value)> = Vec::with_capacity(self.kv.len() + 1);
        let present = self.kv.iter().any(|(k, _)| k == ALIGNMENT_KEY);
        if !present && self.alignment != DEFAULT_ALIGNMENT {
            out.push((ALIGNMENT_KEY, align));
        }
        for (k, v) in &self.kv {
            out.push((k, if k == ALIGNMENT_KEY { align } else { v }));
        }
        out
    }

    #[cfg(test)]
    pub(crate) fn effective_kv_for_tests(&self) -> Vec<(String, Value)> {
        let align = Value::U32(self.alignment as u32);
        self.effective_kv(&align)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    /// The whole file. A tensor declared without data (`add_tensor_info`) is written as
    /// zeros; stream real data with [`GgufWriter::stream`].
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        // Writing into a Vec cannot fail.
        let _ = self.write_to(&mut out);
        out
    }

    /// Writes the file to `path` (declared-only tensors as zeros).
    pub fn write(&self, path: &Path) -> io::Result<()> {
        let mut f = io::BufWriter::new(std::fs::File::create(path)?);
        self.write_to(&mut f)?;
        f.flush()
    }

    /// Writes the file to `w` (declared-only tensors as zeros).
    pub fn write_to<W: Write>(&self, w: W) -> io::Result<()> {
        let mut s = self.stream(w)?;
        let zeros = vec![0u8; 1 << 16];
        while let Some((_, _, _, size)) = s.current() {
            let left = size - s.written;
            s.write_data(&zeros[..left.min(zeros.len() as u64) as usize])?;
        }
        s.finish().map(|_| ())
    }

    /// The file's header (through the padding before the first tensor's data) and the
    /// absolute offset and size of every tensor's data, in order, without writing any data:
    /// how a file assembled from pieces (a model slice sent to a node) is laid out. Every
    /// tensor must be declared without data (`add_tensor_info`).
    pub fn layout(&self) -> io::Result<(Vec<u8>, Vec<Placed>)> {
        if let Some(t) = self.tensors.iter().find(|t| t.data.is_some()) {
            return Err(invalid(format!(
                "tensor '{}' came with its data; layout() takes declared tensors only",
                t.name
            )));
        }
        let header = self.stream(Vec::new())?.w.inner;
        let align = self.alignment as u64;
        let mut at = header.len() as u64;
        let mut out = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            out.push((at, t.size));
            at = at
                .checked_add(t.size)
                .map(|e| e.next_multiple_of(align))
                .ok_or_else(|| invalid("tensor data exceeds 2^64 bytes".into()))?;
        }
        Ok((header, out))
    }

    /// Writes the header and the metadata to `w`, then returns the stream that takes the data
    /// of every declared tensor, in order (tensors added with their data are written as the
    /// stream reaches them).
    pub fn stream<W: Write>(&self, w: W) -> io::Result<TensorStream<'_, W>> {
        let mut w = Counting { inner: w, n: 0 };
        let align_value = Value::U32(self.alignment as u32);
        let kv = self.effective_kv(&align_value);
        w.write_all(&GGUF_MAGIC)?;
        w.write_all(&self.version.to_le_bytes())?;
        w.write_all(&(self.tensors.len() as u64).to_le_bytes())?;
        w.write_all(&(kv.len() as u64).to_le_bytes())?;
        for (k, v) in &kv {
            write_str(&mut w, k)?;
            w.write_all(&v.type_id().to_le_bytes())?;
            write_value(&mut w, v)?;
        }
        let align = self.alignment as u64;
        let mut rel = 0u64;
        for t in &self.tensors {
            write_str(&mut w, &t.name)?;
            w.write_all(&(t.dims.len() as u32).to_le_bytes())?;
            for d in &t.dims {
                w.write_all(&d.to_le_bytes())?;
            }
            w.write_all(&(t.ty as u32).to_le_bytes())?;
            w.write_all(&rel.to_le_bytes())?;
            rel = rel
                .checked_add(t.size)
                .map(|e| e.next_multiple_of(align))
                .ok_or_else(|| invalid("tensor data exceeds 2^64 bytes".into()))?;
        }
        pad(&mut w, align)?;
        let mut s = TensorStream {
            gguf: self,
            w,
            index: 0,
            written: 0,
        };
        s.skip_in_memory()?;
        Ok(s)
    }
}

/// The data part of a GGUF file being written: takes the bytes of each declared tensor in
/// order, pads between tensors, and checks every tensor gets exactly its size.
pub struct TensorStream<'a, W: Write> {
    gguf: &'a GgufWriter,
    w: Counting<W>,
    /// The tensor being written (`gguf.tensors.len()` when done).
    index: usize,
    /// Bytes of it written so far.
    written: u64,
}

impl<W: Write> TensorStream<'_, W> {
    /// Name, dims, type and size of the tensor whose data comes next; `None` when all are
    /// written.
    pub fn current(&self) -> Option<(&str, &[u64], GgmlType, u64)> {
        self.gguf
            .tensors
            .get(self.index)
            .map(|t| (t.name.as_str(), t.dims.as_slice(), t.ty, t.size))
    }

    /// Appends `bytes` to the current tensor's data; they must not run past its end. A tensor
    /// is complete when its last byte is written, and the stream moves to the next.
    pub fn write_data(&mut self, bytes: &[u8]) -> io::Result<()> {
        let Some(t) = self.gguf.tensors.get(self.index) else {
            return Err(invalid(format!(
                "{} bytes of tensor data after the last tensor",
                bytes.len()
            )));
        };
        let left = t.size - self.written;
        if bytes.len() as u64 > left {
            return Err(invalid(format!(
                "tensor '{}': {} bytes written where {left} were left of {}",
                t.name,
                bytes.len(),
                t.size
            )));
        }
        self.w.write_all(bytes)?;
        self.written += bytes.len() as u64;
        if self.written == t.size {
            self.next_tensor()?;
            self.skip_in_memory()?;
        }
        Ok(())
    }

    fn next_tensor(&mut self) -> io::Result<()> {
        pad(&mut self.w, self.gguf.alignment as u64)?;
        self.index += 1;
        self.written = 0;
        Ok(())
    }

    /// Writes the tensors that came with their data, up to the next declared one.
    fn skip_in_memory(&mut self) -> io::Result<()> {
        while let Some(t) = self.gguf.tensors.get(self.index) {
            match &t.data {
                Some(d) => {
                    self.w.write_all(d)?;
                    self.next_tensor()?;
                }
                None => break,
            }
        }
        Ok(())
    }

    /// Ends the file; an error if a tensor's data is missing or incomplete.
    pub fn finish(mut self) -> io::Result<W> {
        if let Some(t) = self.gguf.tensors.get(self.index) {
            return Err(invalid(format!(
                "tensor '{}': {} of its {} bytes were written",
                t.name, self.written, t.size
            )));
        }
        self.w.flush()?;
        Ok(self.w.inner)
    }
}

fn invalid(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, why)
}

struct Counting<W> {
    inner: W,
    n: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.n += k as u64;
        Ok(k)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn pad<W: Write>(w: &mut Counting<W>, align: u64) -> io::Result<()> {
    let n = w.n.next_multiple_of(align) - w.n;
    w.write_all(&vec![0u8; n as usize])
}

fn write_str<W: Write>(w: &mut W, s: &str) -> io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn write_value<W: Write>(w: &mut W, v: &Value) -> io::Result<()> {
    match v {
        Value::U8(x) => w.write_all(&x.to_le_bytes()),
        Value::I8(x) => w.write_all(&x.to_le_bytes()),
        Value::U16(x) => w.write_all(&x.to_le_bytes()),
        Value::I16(x) => w.write_all(&x.to_le_bytes()),
        Value::U32(x) => w.write_all(&x.to_le_bytes()),
        Value::I32(x) => w.write_all(&x.to_le_bytes()),
        Value::F32(x) => w.write_all(&x.to_le_bytes()),
        Value::Bool(x) => w.write_all(&[u8::from(*x)]),
        Value::Str(s) => write_str(w, s),
        Value::Array(a) => write_array(w, a),
        Value::U64(x) => w.write_all(&x.to_le_bytes()),
        Value::I64(x) => w.write_all(&x.to_le_bytes()),
        Value::F64(x) => w.write_all(&x.to_le_bytes()),
    }
}

fn write_array<W: Write>(w: &mut W, a: &Array) -> io::Result<()> {
    w.write_all(&a.elem_type_id().to_le_bytes())?;
    w.write_all(&(a.len() as u64).to_le_bytes())?;
    macro_rules! each {
        ($v:expr) => {{
            for x in $v {
                w.write_all(&x.to_le_bytes())?;
            }
            Ok(())
        }};
    }
    match a {
        Array::U8(v) => w.write_all(v),
        Array::I8(v) => each!(v),
        Array::U16(v) => each!(v),
        Array::I16(v) => each!(v),
        Array::U32(v) => each!(v),
        Array::I32(v) => each!(v),
        Array::F32(v) => each!(v),
        Array::Bool(v) => {
            let b: Vec<u8> = v.iter().map(|&x| u8::from(x)).collect();
            w.write_all(&b)
        }
        Array::Str(v) => {
            for s in v {
                write_str(w, s)?;
            }
            Ok(())
        }
        Array::U64(v) => each!(v),
        Array::I64(v) => each!(v),
        Array::F64(v) => each!(v),
        Array::Nested(v) => {
            for inner in v {
                write_array(w, inner)?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod stream_tests {
    use super::*;
    use crate::gguf::GgufFile;

    fn two_tensors(declared: bool) -> GgufWriter {
        let mut w = GgufWriter::new();
        w.add("general.architecture", Value::Str("llama".into()));
        let a: Vec<u8> = (0..40u8).collect();
        if declared {
            assert_eq!(w.add_tensor_info("a", &[10], GgmlType::F32).unwrap(), 40);
        } else {
            w.add_tensor("a", &[10], GgmlType::F32, a).unwrap();
        }
        w.add_tensor("b", &[3], GgmlType::F32, vec![7; 12]).unwrap();
        w
    }

    #[test]
    fn streamed_data_gives_the_same_file_as_data_in_memory() {
        let want = two_tensors(false).to_bytes();
        let w = two_tensors(true);
        let mut s = w.stream(Vec::new()).unwrap();
        assert_eq!(s.current().map(|c| c.0), Some("a"));
        let a: Vec<u8> = (0..40u8).collect();
        s.write_data(&a[..7]).unwrap();
        s.write_data(&a[7..]).unwrap();
        // "b" came with its data: written as the stream reached it.
        assert!(s.current().is_none());
        assert_eq!(s.finish().unwrap(), want);
        let f = GgufFile::from_bytes(want).unwrap();
        assert_eq!(f.tensor_data(f.tensor("a").unwrap()), &a[..]);
    }

    #[test]
    fn a_stream_refuses_too_many_or_too_few_bytes() {
        let w = two_tensors(true);
        let mut s = w.stream(Vec::new()).unwrap();
        let e = s.write_data(&[0; 41]).unwrap_err().to_string();
        assert!(e.contains("'a'") && e.contains("41 bytes"), "{e}");
        s.write_data(&[0; 39]).unwrap();
        let e = s.finish().unwrap_err().to_string();
        assert!(e.contains("39 of its 40"), "{e}");
        // Declared tensors left without data are zeros in `to_bytes`.
        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        assert_eq!(f.tensor_data(f.tensor("a").unwrap()), &[0u8; 40][..]);
        let full = two_tensors(false);
        let mut s = full.stream(Vec::new()).unwrap();
        assert!(s.write_data(&[1]).is_err());
    }
}
