//! GGUF metadata values and the ordered key → value table with typed accessors.

use super::error::GgufError;
use std::collections::HashMap;
use std::fmt;

/// GGUF value type ids (`gguf_type` in the specification).
pub mod type_id {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array: one typed vector per element type. Arrays of arrays are `Nested`.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    Str(Vec<String>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
    Nested(Vec<Array>),
}

impl Value {
    /// The GGUF type id of this value.
    pub fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => type_id::U8,
            Value::I8(_) => type_id::I8,
            Value::U16(_) => type_id::U16,
            Value::I16(_) => type_id::I16,
            Value::U32(_) => type_id::U32,
            Value::I32(_) => type_id::I32,
            Value::F32(_) => type_id::F32,
            Value::Bool(_) => type_id::BOOL,
            Value::Str(_) => type_id::STRING,
            Value::Array(_) => type_id::ARRAY,
            Value::U64(_) => type_id::U64,
            Value::I64(_) => type_id::I64,
            Value::F64(_) => type_id::F64,
        }
    }

    /// Human-readable type, e.g. `u32`, `string`, `array of f32`.
    pub fn type_name(&self) -> String {
        match self {
            Value::Array(a) => format!("array of {}", a.elem_type_name()),
            other => scalar_type_name(other.type_id()).to_string(),
        }
    }

    /// The value as an integer, for any integer type.
    fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }
}

/// Name of a GGUF type id.
pub fn scalar_type_name(id: u32) -> &'static str {
    match id {
        type_id::U8 => "u8",
        type_id::I8 => "i8",
        type_id::U16 => "u16",
        type_id::I16 => "i16",
        type_id::U32 => "u32",
        type_id::I32 => "i32",
        type_id::F32 => "f32",
        type_id::BOOL => "bool",
        type_id::STRING => "string",
        type_id::ARRAY => "array",
        type_id::U64 => "u64",
        type_id::I64 => "i64",
        type_id::F64 => "f64",
        _ => "unknown",
    }
}

impl Array {
    /// The GGUF type id of the elements.
    pub fn elem_type_id(&self) -> u32 {
        match self {
            Array::U8(_) => type_id::U8,
            Array::I8(_) => type_id::I8,
            Array::U16(_) => type_id::U16,
            Array::I16(_) => type_id::I16,
            Array::U32(_) => type_id::U32,
            Array::I32(_) => type_id::I32,
            Array::F32(_) => type_id::F32,
            Array::Bool(_) => type_id::BOOL,
            Array::Str(_) => type_id::STRING,
            Array::U64(_) => type_id::U64,
            Array::I64(_) => type_id::I64,
            Array::F64(_) => type_id::F64,
            Array::Nested(_) => type_id::ARRAY,
        }
    }

    fn elem_type_name(&self) -> &'static str {
        scalar_type_name(self.elem_type_id())
    }

    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::Str(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Nested(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as integers (bools as 0/1), or `None` for float, string and nested arrays.
    fn as_i128s(&self) -> Option<Vec<i128>> {
        fn conv<T: Copy + Into<i128>>(v: &[T]) -> Vec<i128> {
            v.iter().map(|&x| x.into()).collect()
        }
        Some(match self {
            Array::U8(v) => conv(v),
            Array::I8(v) => conv(v),
            Array::U16(v) => conv(v),
            Array::I16(v) => conv(v),
            Array::U32(v) => conv(v),
            Array::I32(v) => conv(v),
            Array::U64(v) => conv(v),
            Array::I64(v) => conv(v),
            Array::Bool(v) => v.iter().map(|&b| i128::from(b)).collect(),
            _ => return None,
        })
    }
}

impl fmt::Display for Value {
    /// A short rendering: arrays show their type, length and first few elements.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::Str(s) => {
                let short: String = s.chars().take(60).collect();
                if short.len() < s.len() {
                    write!(f, "{short:?}... ({} bytes)", s.len())
                } else {
                    write!(f, "{s:?}")
                }
            }
            Value::Array(a) => fmt::Display::fmt(a, f),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
        }
    }
}

impl fmt::Display for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn head<T: fmt::Debug>(f: &mut fmt::Formatter<'_>, v: &[T]) -> fmt::Result {
            let shown: Vec<&T> = v.iter().take(4).collect();
            let more = if v.len() > 4 { ", ..." } else { "" };
            write!(f, "{shown:?}{more}")
        }
        write!(f, "[{}; {}] ", self.elem_type_name(), self.len())?;
        match self {
            Array::U8(v) => head(f, v),
            Array::I8(v) => head(f, v),
            Array::U16(v) => head(f, v),
            Array::I16(v) => head(f, v),
            Array::U32(v) => head(f, v),
            Array::I32(v) => head(f, v),
            Array::F32(v) => head(f, v),
            Array::Bool(v) => head(f, v),
            Array::Str(v) => head(f, v),
            Array::U64(v) => head(f, v),
            Array::I64(v) => head(f, v),
            Array::F64(v) => head(f, v),
            Array::Nested(v) => write!(f, "({} nested arrays)", v.len()),
        }
    }
}

#[derive(Clone, Debug)]
struct Entry {
    key: String,
    value: Value,
    /// Byte offset of the key in the file (0 for tables not read from a file).
    offset: u64,
}

/// The metadata table: keys in file order, with a hash index.
#[derive(Clone, Debug, Default)]
pub struct Metadata {
    entries: Vec<Entry>,
    index: HashMap<String, usize>,
}

impl Metadata {
    pub fn new() -> Metadata {
        Metadata::default()
    }

    /// Appends `key`; returns false (and changes nothing) when the key is already present.
    pub(crate) fn insert(&mut self, key: String, value: Value, offset: u64) -> bool {
        if self.index.contains_key(&key) {
            return false;
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push(Entry { key, value, offset });
        true
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.entry(key).map(|e| &e.value)
    }

    /// Byte offset of `key`'s entry in the file.
    pub fn offset_of(&self, key: &str) -> Option<u64> {
        self.entry(key).map(|e| e.offset)
    }

    fn entry(&self, key: &str) -> Option<&Entry> {
        self.index.get(key).and_then(|&i| self.entries.get(i))
    }

    /// Keys in file order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.key.as_str())
    }

    /// Key/value pairs in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|e| (e.key.as_str(), &e.value))
    }

    /// Ok when every key in `keys` is present; otherwise an error naming all missing ones.
    pub fn require(&self, keys: &[&str]) -> Result<(), GgufError> {
        let missing: Vec<String> = keys
            .iter()
            .filter(|k| !self.index.contains_key(**k))
            .map(|k| k.to_string())
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(GgufError::MissingKeys { keys: missing })
        }
    }

    fn need(&self, key: &str) -> Result<&Entry, GgufError> {
        self.entry(key).ok_or_else(|| GgufError::MissingKeys {
            keys: vec![key.to_string()],
        })
    }

    fn wrong(e: &Entry, expected: &'static str) -> GgufError {
        GgufError::WrongType {
            key: e.key.clone(),
            offset: e.offset,
            expected,
            found: e.value.type_name(),
        }
    }

    fn range(e: &Entry, value: impl fmt::Display, target: &'static str) -> GgufError {
        GgufError::OutOfRange {
            key: e.key.clone(),
            offset: e.offset,
            value: value.to_string(),
            target,
        }
    }

    fn int_of<T: TryFrom<i128>>(e: &Entry, target: &'static str) -> Result<T, GgufError> {
        let v = e
            .value
            .as_i128()
            .ok_or_else(|| Self::wrong(e, "an integer"))?;
        T::try_from(v).map_err(|_| Self::range(e, v, target))
    }

    fn f32_of(e: &Entry) -> Result<f32, GgufError> {
        match e.value {
            Value::F32(v) => Ok(v),
            Value::F64(v) => Ok(v as f32),
            _ => e
                .value
                .as_i128()
                .map(|v| v as f32)
                .ok_or_else(|| Self::wrong(e, "a number")),
        }
    }

    fn bool_of(e: &Entry) -> Result<bool, GgufError> {
        match e.value {
            Value::Bool(v) => Ok(v),
            _ => Err(Self::wrong(e, "bool")),
        }
    }

    fn str_of(e: &Entry) -> Result<&str, GgufError> {
        match &e.value {
            Value::Str(s) => Ok(s),
            _ => Err(Self::wrong(e, "string")),
        }
    }

    fn array_of(e: &Entry) -> Result<&Array, GgufError> {
        match &e.value {
            Value::Array(a) => Ok(a),
            _ => Err(Self::wrong(e, "an array")),
        }
    }

    fn str_array_of(e: &Entry) -> Result<&[String], GgufError> {
        match &e.value {
            Value::Array(Array::Str(v)) => Ok(v),
            _ => Err(Self::wrong(e, "array of string")),
        }
    }

    fn f32_array_of(e: &Entry) -> Result<Vec<f32>, GgufError> {
        match &e.value {
            Value::Array(Array::F32(v)) => Ok(v.clone()),
            Value::Array(Array::F64(v)) => Ok(v.iter().map(|&x| x as f32).collect()),
            Value::Array(a) => match a {
                Array::Bool(_) | Array::Str(_) | Array::Nested(_) => {
                    Err(Self::wrong(e, "array of numbers"))
                }
                _ => a
                    .as_i128s()
                    .map(|v| v.into_iter().map(|x| x as f32).collect())
                    .ok_or_else(|| Self::wrong(e, "array of numbers")),
            },
            _ => Err(Self::wrong(e, "array of numbers")),
        }
    }

    fn int_array_of<T: TryFrom<i128>>(
        e: &Entry,
        target: &'static str,
    ) -> Result<Vec<T>, GgufError> {
        let a = Self::array_of(e)?;
        let ints = a
            .as_i128s()
            .ok_or_else(|| Self::wrong(e, "array of integers or bools"))?;
        ints.into_iter()
            .map(|x| T::try_from(x).map_err(|_| Self::range(e, x, target)))
            .collect()
    }

    fn bool_array_of(e: &Entry) -> Result<Vec<bool>, GgufError> {
        match Self::array_of(e)? {
            Array::Bool(v) => Ok(v.clone()),
            a => a
                .as_i128s()
                .map(|v| v.into_iter().map(|x| x != 0).collect())
                .ok_or_else(|| Self::wrong(e, "array of bools or integers")),
        }
    }

    /// Any integer value that fits in `u32`.
    pub fn u32(&self, key: &str) -> Result<u32, GgufError> {
        Self::int_of(self.need(key)?, "u32")
    }

    /// Any non-negative integer value.
    pub fn u64(&self, key: &str) -> Result<u64, GgufError> {
        Self::int_of(self.need(key)?, "u64")
    }

    /// Any integer value that fits in `i32`.
    pub fn i32(&self, key: &str) -> Result<i32, GgufError> {
        Self::int_of(self.need(key)?, "i32")
    }

    /// An `f32` or `f64` value (narrowed) or any integer (converted).
    pub fn f32(&self, key: &str) -> Result<f32, GgufError> {
        Self::f32_of(self.need(key)?)
    }

    pub fn bool(&self, key: &str) -> Result<bool, GgufError> {
        Self::bool_of(self.need(key)?)
    }

    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        Self::str_of(self.need(key)?)
    }

    /// Any array value.
    pub fn array(&self, key: &str) -> Result<&Array, GgufError> {
        Self::array_of(self.need(key)?)
    }

    pub fn str_array(&self, key: &str) -> Result<&[String], GgufError> {
        Self::str_array_of(self.need(key)?)
    }

    /// An array of floats or integers, as `f32`.
    pub fn f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        Self::f32_array_of(self.need(key)?)
    }

    /// An array of integers (or bools, as 0/1) that all fit in `i32`.
    pub fn i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        Self::int_array_of(self.need(key)?, "i32")
    }

    /// An array of integers (or bools, as 0/1) that all fit in `u32`.
    pub fn u32_array(&self, key: &str) -> Result<Vec<u32>, GgufError> {
        Self::int_array_of(self.need(key)?, "u32")
    }

    /// An array of bools (or integers, nonzero = true).
    pub fn bool_array(&self, key: &str) -> Result<Vec<bool>, GgufError> {
        Self::bool_array_of(self.need(key)?)
    }

    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.entry(key).map(|e| Self::int_of(e, "u32")).transpose()
    }

    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.entry(key).map(|e| Self::int_of(e, "u64")).transpose()
    }

    pub fn opt_i32(&self, key: &str) -> Result<Option<i32>, GgufError> {
        self.entry(key).map(|e| Self::int_of(e, "i32")).transpose()
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>, GgufError> {
        self.entry(key).map(Self::f32_of).transpose()
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.entry(key).map(Self::bool_of).transpose()
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.entry(key).map(Self::str_of).transpose()
    }

    pub fn opt_str_array(&self, key: &str) -> Result<Option<&[String]>, GgufError> {
        self.entry(key).map(Self::str_array_of).transpose()
    }

    pub fn opt_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>, GgufError> {
        self.entry(key).map(Self::f32_array_of).transpose()
    }

    pub fn opt_i32_array(&self, key: &str) -> Result<Option<Vec<i32>>, GgufError> {
        self.entry(key)
            .map(|e| Self::int_array_of(e, "i32"))
            .transpose()
    }

    pub fn opt_u32_array(&self, key: &str) -> Result<Option<Vec<u32>>, GgufError> {
        self.entry(key)
            .map(|e| Self::int_array_of(e, "u32"))
            .transpose()
    }

    pub fn opt_bool_array(&self, key: &str) -> Result<Option<Vec<bool>>, GgufError> {
        self.entry(key).map(Self::bool_array_of).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md() -> Metadata {
        let mut m = Metadata::new();
        m.insert("a.u8".into(), Value::U8(7), 10);
        m.insert("a.i32neg".into(), Value::I32(-1), 20);
        m.insert("a.u64big".into(), Value::U64(1 << 40), 30);
        m.insert("a.f64".into(), Value::F64(0.5), 40);
        m.insert("a.str".into(), Value::Str("x".into()), 50);
        m.insert(
            "a.bools".into(),
            Value::Array(Array::Bool(vec![true, false])),
            60,
        );
        m.insert(
            "a.strs".into(),
            Value::Array(Array::Str(vec!["p".into(), "q".into()])),
            70,
        );
        m.insert("a.f32s".into(), Value::Array(Array::F32(vec![1.5])), 80);
        m
    }

    #[test]
    fn typed_accessors_convert_and_name_key_and_type() {
        let mut m = md();
        assert!(!m.insert("a.u8".into(), Value::U8(1), 0));
        assert_eq!(m.u32("a.u8").ok(), Some(7));
        assert_eq!(m.u64("a.u64big").ok(), Some(1 << 40));
        assert_eq!(m.f32("a.u8").ok(), Some(7.0));
        assert_eq!(m.f32("a.f64").ok(), Some(0.5));
        assert_eq!(m.str("a.str").ok(), Some("x"));
        assert_eq!(m.u32_array("a.bools").ok(), Some(vec![1, 0]));
        assert_eq!(m.bool_array("a.bools").ok(), Some(vec![true, false]));
        assert_eq!(m.f32_array("a.f32s").ok(), Some(vec![1.5]));
        assert_eq!(m.str_array("a.strs").map(|s| s.len()).ok(), Some(2));
        assert_eq!(m.opt_u32("nope").ok(), Some(None));
        assert_eq!(m.opt_str("a.str").ok(), Some(Some("x")));

        let e = m.u32("a.i32neg").unwrap_err().to_string();
        assert!(
            e.contains("a.i32neg") && e.contains("-1") && e.contains("byte 20"),
            "{e}"
        );
        let e = m.u32("a.u64big").unwrap_err().to_string();
        assert!(e.contains("does not fit u32"), "{e}");
        let e = m.opt_u32("a.str").unwrap_err().to_string();
        assert!(
            e.contains("a.str") && e.contains("string") && e.contains("byte 50"),
            "{e}"
        );
        let e = m.f32_array("a.strs").unwrap_err().to_string();
        assert!(e.contains("array of string"), "{e}");
        let e = m
            .require(&["a.u8", "x.one", "x.two"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("x.one") && e.contains("x.two") && !e.contains("a.u8"),
            "{e}"
        );
        assert_eq!(m.keys().next(), Some("a.u8"));
    }
}
