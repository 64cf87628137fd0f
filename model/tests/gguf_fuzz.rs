//! The GGUF reader against truncated, mutated and hand-crafted hostile files: it must return
//! an error naming what and where, never panic, and never hand out out-of-bounds tensor data.
//! Property tests run 256 cases by default; set PROPTEST_CASES to change that.

use proptest::prelude::*;
use ringllm_kernels::GgmlType;
use ringllm_model::gguf::{Array, GgufError, GgufFile, GgufWriter, Value};

/// A small valid file: several KV types (arrays, strings), three tensors. The last tensor's
/// data is a multiple of the alignment, so the file has no trailing padding and every strict
/// prefix is invalid.
fn sample() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add("general.architecture", Value::Str("llama".into()));
    w.add("general.name", Value::Str("fuzz ▁sample".into()));
    w.add("llama.block_count", Value::U32(2));
    w.add("llama.rope.freq_base", Value::F32(10000.0));
    w.add("x.i64", Value::I64(-3));
    w.add("x.f64", Value::F64(2.5));
    w.add("x.bool", Value::Bool(false));
    w.add("x.u8", Value::U8(9));
    w.add(
        "tokenizer.ggml.tokens",
        Value::Array(Array::Str(vec!["<unk>".into(), "<s>".into(), "▁a".into()])),
    );
    w.add(
        "tokenizer.ggml.scores",
        Value::Array(Array::F32(vec![0.0, -1.0, -2.0])),
    );
    w.add(
        "tokenizer.ggml.token_type",
        Value::Array(Array::I32(vec![2, 3, 1])),
    );
    w.add("x.bools", Value::Array(Array::Bool(vec![true, false])));
    w.add("x.u64s", Value::Array(Array::U64(vec![1, u64::MAX])));
    w.add(
        "x.nested",
        Value::Array(Array::Nested(vec![
            Array::U16(vec![1, 2]),
            Array::Str(vec!["z".into()]),
        ])),
    );
    w.add_tensor(
        "token_embd.weight",
        &[32, 3],
        GgmlType::Q8_0,
        vec![1u8; 3 * 34],
    )
    .unwrap();
    w.add_tensor("output_norm.weight", &[5], GgmlType::F32, vec![2u8; 20])
        .unwrap();
    w.add_tensor("blk.0.attn_q.weight", &[4, 4], GgmlType::F32, vec![3u8; 64])
        .unwrap();
    w.to_bytes()
}

/// Exercises everything a caller can reach on a file that parsed: must not panic, and every
/// tensor slice must be in bounds and of the declared size.
fn exercise(f: &GgufFile) {
    let len = f.bytes().len() as u64;
    assert!(f.data_offset() as u64 <= len);
    assert!(f.alignment().is_power_of_two());
    for t in f.tensors() {
        assert!(t.offset + t.size <= len, "{t:?} past {len}");
        assert_eq!(f.tensor_data(t).len() as u64, t.size);
        assert_eq!(f.tensor(&t.name).map(|x| x.offset), Some(t.offset));
        let _ = (t.n_elements(), t.n_rows(), t.row_len());
    }
    let md = f.metadata();
    let keys: Vec<String> = md.keys().map(String::from).collect();
    for k in &keys {
        let _ = md.u32(k);
        let _ = md.u64(k);
        let _ = md.f32(k);
        let _ = md.bool(k);
        let _ = md.str(k);
        let _ = md.str_array(k);
        let _ = md.f32_array(k);
        let _ = md.i32_array(k);
        let _ = md.u32_array(k);
        let _ = md.bool_array(k);
        let _ = md.get(k).map(|v| v.to_string());
    }
    let _ = md.require(&["general.architecture", "nope"]);
    let _ = f.header_hash();
}

#[test]
fn sample_is_valid() {
    let bytes = sample();
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    assert_eq!(f.tensors().len(), 3);
    let last = f.tensors().iter().map(|t| t.offset + t.size).max();
    assert_eq!(
        last,
        Some(bytes.len() as u64),
        "sample must have no trailing padding"
    );
    exercise(&f);
}

#[test]
fn every_strict_prefix_is_refused() {
    let bytes = sample();
    for n in 0..bytes.len() {
        match GgufFile::from_bytes(bytes[..n].to_vec()) {
            Ok(_) => panic!("prefix of {n} of {} bytes parsed", bytes.len()),
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("byte"),
                    "prefix {n}: message has no offset: {msg}"
                );
            }
        }
    }
}

proptest! {
    #[test]
    fn truncation_never_panics(cut in any::<prop::sample::Index>()) {
        let bytes = sample();
        let n = cut.index(bytes.len() + 1);
        let r = GgufFile::from_bytes(bytes[..n].to_vec());
        prop_assert_eq!(r.is_ok(), n == bytes.len());
    }

    #[test]
    fn mutations_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), any::<bool>()), 1..=8)
    ) {
        let mut bytes = sample();
        let len = bytes.len();
        for (pos, val, flip) in edits {
            let i = pos.index(len);
            if flip {
                bytes[i] ^= 1 << (val % 8);
            } else {
                bytes[i] = val;
            }
        }
        if let Ok(f) = GgufFile::from_bytes(bytes) {
            exercise(&f);
        }
    }

    /// Mutations of the length and count fields specifically: they drive allocation.
    #[test]
    fn big_field_mutations_never_panic(pos in any::<prop::sample::Index>(), val in any::<u64>()) {
        let mut bytes = sample();
        let i = pos.index(bytes.len() - 8);
        bytes[i..i + 8].copy_from_slice(&val.to_le_bytes());
        if let Ok(f) = GgufFile::from_bytes(bytes) {
            exercise(&f);
        }
    }
}

// ---- hand-crafted hostile files ---------------------------------------------------------

fn err(bytes: Vec<u8>) -> String {
    match GgufFile::from_bytes(bytes) {
        Ok(f) => panic!("hostile file parsed: {f:?}"),
        Err(e) => e.to_string(),
    }
}

fn assert_has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message {msg:?} lacks {p:?}");
    }
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len())
        .position(|w| w == needle)
        .unwrap_or_else(|| panic!("{needle:?} not in file"))
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Header with `n_tensors` and `n_kv`, version 3.
fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&n_kv.to_le_bytes());
    b
}

fn string(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

/// Byte offset of tensor `name`'s info (its name's length prefix) and of its fields.
struct InfoAt {
    start: usize,
    n_dims: usize,
}

fn info_at(bytes: &[u8], name: &str) -> InfoAt {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    let start = find(bytes, &needle);
    InfoAt {
        start,
        n_dims: start + 8 + name.len(),
    }
}

#[test]
fn wrong_magic() {
    let mut b = sample();
    b[..4].copy_from_slice(b"GGML");
    assert_has(&err(b), &["not a GGUF file", "magic", "byte 0"]);
    assert_has(
        &err(b"GG".to_vec()),
        &["truncated", "magic", "byte 0", "needs 4 bytes, 2 left"],
    );
}

#[test]
fn version_1_is_refused_clearly() {
    let mut b = sample();
    put_u32(&mut b, 4, 1);
    assert_has(&err(b), &["version 1", "byte 4", "obsolete"]);
    let mut b = sample();
    put_u32(&mut b, 4, 4);
    assert_has(&err(b), &["version 4", "byte 4"]);
}

#[test]
fn byte_swapped_version_is_big_endian() {
    let mut b = sample();
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert_has(&err(b), &["big-endian", "byte 4", "version 3"]);
}

#[test]
fn huge_string_length() {
    // The key of the first entry.
    let mut b = header(0, 1);
    b.extend_from_slice(&(u64::MAX / 2).to_le_bytes());
    b.extend_from_slice(&[b'a'; 64]);
    assert_has(
        &err(b),
        &["key of metadata entry 0", "byte 24", "exceeds the limit"],
    );

    // A string value longer than the file but under the cap.
    let mut b = sample();
    let key = b"general.name";
    let at = find(&b, key) + key.len() + 4; // value length field
    put_u64(&mut b, at, 1 << 20);
    assert_has(
        &err(b),
        &[
            "truncated",
            "value of key 'general.name'",
            &format!("byte {}", at + 8),
        ],
    );

    // A string value over the cap.
    let mut b = sample();
    put_u64(&mut b, at, 1 << 40);
    assert_has(
        &err(b),
        &["general.name", &format!("byte {at}"), "exceeds the limit"],
    );
}

#[test]
fn huge_array_length() {
    let mut b = sample();
    let key = b"tokenizer.ggml.scores";
    let arr = find(&b, key) + key.len() + 4; // element type, then count
    put_u64(&mut b, arr + 4, u64::MAX / 3);
    assert_has(
        &err(b),
        &[
            "array of key 'tokenizer.ggml.scores'",
            &format!("byte {arr}"),
            "elements",
        ],
    );

    // Strings: each needs at least its 8-byte length.
    let mut b = sample();
    let key = b"tokenizer.ggml.tokens";
    let arr = find(&b, key) + key.len() + 4;
    let n = (b.len() / 4) as u64;
    put_u64(&mut b, arr + 4, n);
    assert_has(
        &err(b),
        &["tokenizer.ggml.tokens", &format!("byte {arr}"), "at least"],
    );
}

#[test]
fn huge_tensor_and_kv_counts() {
    let mut b = sample();
    put_u64(&mut b, 8, u64::MAX);
    assert_has(&err(b), &["tensor count", "byte 8"]);
    let mut b = sample();
    put_u64(&mut b, 8, 1 << 40);
    assert_has(&err(b), &["tensor count", "byte 8"]);
    let mut b = sample();
    put_u64(&mut b, 16, u64::MAX / 13 + 1);
    assert_has(&err(b), &["KV count", "byte 16"]);
}

#[test]
fn tensor_offset_past_eof() {
    let mut b = sample();
    let i = info_at(&b, "output_norm.weight");
    let off = i.n_dims + 4 + 8 + 4;
    put_u64(&mut b, off, 1 << 20);
    assert_has(
        &err(b),
        &[
            "output_norm.weight",
            &format!("byte {}", i.start),
            "past the end",
        ],
    );
    let mut b = sample();
    put_u64(&mut b, off, u64::MAX - 31);
    assert_has(
        &err(b),
        &["output_norm.weight", &format!("byte {}", i.start)],
    );
}

#[test]
fn misaligned_tensor_offset() {
    let mut b = sample();
    let i = info_at(&b, "output_norm.weight");
    let off = i.n_dims + 4 + 8 + 4;
    let v = u64::from_le_bytes(b[off..off + 8].try_into().unwrap());
    put_u64(&mut b, off, v + 4);
    assert_has(
        &err(b),
        &[
            "output_norm.weight",
            &format!("byte {}", i.start),
            "not a multiple of the alignment 32",
        ],
    );
}

#[test]
fn overlapping_tensors() {
    let mut b = sample();
    let i = info_at(&b, "output_norm.weight");
    put_u64(&mut b, i.n_dims + 4 + 8 + 4, 0); // same offset as token_embd
    assert_has(&err(b), &["overlaps tensor", "byte"]);
}

#[test]
fn dims_overflow_zero_and_too_many() {
    let mut b = sample();
    let i = info_at(&b, "blk.0.attn_q.weight");
    put_u64(&mut b, i.n_dims + 4, 1 << 40);
    put_u64(&mut b, i.n_dims + 12, 1 << 40);
    assert_has(
        &err(b),
        &[
            "blk.0.attn_q.weight",
            &format!("byte {}", i.start),
            "overflows",
        ],
    );

    // Fits u64 but not the file.
    let mut b = sample();
    put_u64(&mut b, i.n_dims + 4, 1 << 20);
    assert_has(
        &err(b),
        &[
            "blk.0.attn_q.weight",
            &format!("byte {}", i.start),
            "do not fit",
        ],
    );

    let mut b = sample();
    put_u64(&mut b, i.n_dims + 12, 0);
    assert_has(&err(b), &["blk.0.attn_q.weight", "dimension 1 is 0"]);

    let mut b = sample();
    put_u32(&mut b, i.n_dims, 5);
    assert_has(
        &err(b),
        &[
            "blk.0.attn_q.weight",
            &format!("byte {}", i.start),
            "5 dimensions",
        ],
    );
}

#[test]
fn row_not_whole_blocks() {
    let mut b = sample();
    let i = info_at(&b, "token_embd.weight");
    put_u64(&mut b, i.n_dims + 4, 33);
    assert_has(
        &err(b),
        &[
            "token_embd.weight",
            &format!("byte {}", i.start),
            "Q8_0 block size 32",
        ],
    );
}

#[test]
fn unknown_tensor_type_id() {
    let mut b = sample();
    let i = info_at(&b, "output_norm.weight");
    put_u32(&mut b, i.n_dims + 4 + 8, 77);
    assert_has(
        &err(b),
        &[
            "output_norm.weight",
            "type id 77",
            &format!("byte {}", i.start),
        ],
    );
}

#[test]
fn unknown_value_type_and_deep_nesting() {
    let mut b = sample();
    let key = b"x.u8";
    let at = find(&b, key) + key.len();
    put_u32(&mut b, at, 13);
    assert_has(&err(b), &["'x.u8'", "type id 13", &format!("byte {at}")]);

    let mut b = header(0, 1);
    string(&mut b, "deep");
    b.extend_from_slice(&9u32.to_le_bytes());
    for _ in 0..10 {
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
    }
    b.extend_from_slice(&[0; 64]);
    assert_has(&err(b), &["'deep'", "nested", "byte"]);
}

#[test]
fn duplicate_key_and_tensor() {
    // Rename key "b" to "a".
    let mut w = GgufWriter::new();
    w.add("a", Value::U8(1));
    w.add("b", Value::U8(2));
    let mut d = w.to_bytes();
    let second = find(&d, &[1, 0, 0, 0, 0, 0, 0, 0, b'b']);
    d[second + 8] = b'a';
    assert_has(
        &err(d),
        &["duplicate metadata key 'a'", &format!("byte {second}")],
    );

    let mut w = GgufWriter::new();
    w.add_tensor("t1", &[1], GgmlType::F32, vec![0; 4]).unwrap();
    w.add_tensor("t2", &[1], GgmlType::F32, vec![0; 4]).unwrap();
    let mut d = w.to_bytes();
    let i = info_at(&d, "t2");
    d[i.start + 9] = b'1';
    assert_has(
        &err(d),
        &["duplicate tensor name 't1'", &format!("byte {}", i.start)],
    );
}

#[test]
fn bad_alignment_value() {
    let mut w = GgufWriter::new();
    w.set_alignment(64).unwrap();
    let mut b = w.to_bytes();
    let key = b"general.alignment";
    let at = find(&b, key);
    put_u32(&mut b, at + key.len() + 4, 48);
    assert_has(
        &err(b),
        &["general.alignment", &format!("byte {}", at - 8), "48"],
    );
}

#[test]
fn invalid_utf8_key_is_refused_but_values_are_lossy() {
    let mut w = GgufWriter::new();
    w.add("kk", Value::Str("vv".into()));
    let b = w.to_bytes();
    let at = find(&b, b"kk");
    let mut k = b.clone();
    k[at] = 0xff;
    assert_has(&err(k), &["key of metadata entry 0", "byte 24", "UTF-8"]);
    let at = find(&b, b"vv");
    let mut v = b;
    v[at] = 0xff;
    let f = GgufFile::from_bytes(v).unwrap();
    assert_eq!(f.metadata().str("kk").unwrap(), "\u{fffd}v");
}

#[test]
fn metadata_type_errors_name_key_and_offset() {
    let f = GgufFile::from_bytes(sample()).unwrap();
    let md = f.metadata();
    let at = md.offset_of("general.name").unwrap();
    let e = md.u32("general.name").unwrap_err();
    assert!(matches!(e, GgufError::WrongType { .. }));
    assert_has(
        &e.to_string(),
        &["general.name", "string", &format!("byte {at}")],
    );
    let e = md.u32("x.i64").unwrap_err().to_string();
    assert_has(&e, &["x.i64", "-3", "does not fit u32"]);
    assert_eq!(md.opt_bool("x.bool").unwrap(), Some(false));
    assert_eq!(md.u32_array("x.bools").unwrap(), vec![1, 0]);
    assert!(md.i32_array("x.u64s").is_err());
}
