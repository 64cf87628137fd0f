use super::*;
use ringllm_kernels::GgmlType;
use std::path::PathBuf;

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn sample_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add("general.architecture", Value::Str("llama".into()));
    w.add("t.u8", Value::U8(200));
    w.add("t.i8", Value::I8(-5));
    w.add("t.u16", Value::U16(60000));
    w.add("t.i16", Value::I16(-30000));
    w.add("t.u32", Value::U32(4_000_000_000));
    w.add("t.i32", Value::I32(-2_000_000_000));
    w.add("t.f32", Value::F32(1.25));
    w.add("t.bool", Value::Bool(true));
    w.add("t.str", Value::Str("héllo ▁world".into()));
    w.add("t.u64", Value::U64(u64::MAX));
    w.add("t.i64", Value::I64(i64::MIN));
    w.add("t.f64", Value::F64(-0.125));
    w.add("t.arr.u8", Value::Array(Array::U8(vec![1, 2, 3])));
    w.add("t.arr.i8", Value::Array(Array::I8(vec![-1, 2])));
    w.add("t.arr.u16", Value::Array(Array::U16(vec![9])));
    w.add("t.arr.i16", Value::Array(Array::I16(vec![-9, 9])));
    w.add("t.arr.u32", Value::Array(Array::U32(vec![7, 8, 9])));
    w.add("t.arr.i32", Value::Array(Array::I32(vec![-7, 8])));
    w.add("t.arr.f32", Value::Array(Array::F32(vec![0.5, -1.5])));
    w.add(
        "t.arr.bool",
        Value::Array(Array::Bool(vec![true, false, true])),
    );
    w.add(
        "t.arr.str",
        Value::Array(Array::Str(vec!["a".into(), String::new(), "ccc".into()])),
    );
    w.add("t.arr.u64", Value::Array(Array::U64(vec![u64::MAX])));
    w.add("t.arr.i64", Value::Array(Array::I64(vec![-1])));
    w.add("t.arr.f64", Value::Array(Array::F64(vec![1e300])));
    w.add("t.arr.empty", Value::Array(Array::U32(vec![])));
    w.add(
        "t.arr.nested",
        Value::Array(Array::Nested(vec![
            Array::U8(vec![1]),
            Array::Str(vec!["x".into()]),
        ])),
    );
    w.add_tensor("a", &[4, 3], GgmlType::F32, f32_bytes(&[1.0; 12]))
        .unwrap();
    w.add_tensor("b", &[5], GgmlType::F16, vec![7u8; 10])
        .unwrap();
    w.add_tensor("c", &[2, 1, 3], GgmlType::BF16, vec![3u8; 12])
        .unwrap();
    w
}

#[test]
fn writer_output_reads_back_identically() {
    for align in [32usize, 64, 8] {
        let mut w = sample_writer();
        w.set_alignment(align).unwrap();
        let bytes = w.to_bytes();
        let f = GgufFile::from_bytes(bytes.clone()).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.alignment(), align);
        assert_eq!(f.data_offset() % align, 0);
        assert!(f.data_offset() >= f.header_len());
        assert_eq!(f.bytes(), &bytes[..]);
        assert!(f.path().is_none());

        let mut want = w.effective_kv_for_tests();
        if align != 32 {
            assert_eq!(want[0].0, "general.alignment");
            want.remove(0);
            assert_eq!(
                f.metadata().u32("general.alignment").unwrap() as usize,
                align
            );
        }
        let got: Vec<(String, Value)> = f
            .metadata()
            .iter()
            .filter(|(k, _)| *k != "general.alignment")
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        assert_eq!(got, want);

        let names: Vec<&str> = f.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        let a = f.tensor("a").unwrap();
        assert_eq!(
            (a.dims.as_slice(), a.ty, a.size),
            (&[4u64, 3][..], GgmlType::F32, 48)
        );
        assert_eq!((a.n_elements(), a.n_rows(), a.row_len()), (12, 3, 4));
        assert_eq!(f.tensor_data(a), &f32_bytes(&[1.0; 12])[..]);
        let b = f.tensor("b").unwrap();
        assert_eq!(f.tensor_data(b), &[7u8; 10][..]);
        let c = f.tensor("c").unwrap();
        assert_eq!(c.dims, [2, 1, 3]);
        assert_eq!(c.n_rows(), 3);
        assert_eq!(f.tensor_data(c), &[3u8; 12][..]);
        for t in f.tensors() {
            assert_eq!(t.offset % align as u64, 0, "{}", t.name);
        }
        assert!(f.tensor("zz").is_none());

        // Same header → same hash; a different key → different hash.
        assert_eq!(
            GgufFile::from_bytes(bytes).unwrap().header_hash(),
            f.header_hash()
        );
        let mut w2 = sample_writer();
        w2.set_alignment(align).unwrap();
        w2.add("t.u8", Value::U8(201));
        let h2 = GgufFile::from_bytes(w2.to_bytes()).unwrap().header_hash();
        assert_ne!(h2, f.header_hash());
    }
}

#[test]
fn version_2_reads_and_empty_files_work() {
    let mut w = GgufWriter::new();
    w.set_version(2).unwrap();
    w.add("k", Value::Str("v".into()));
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(f.version(), 2);
    assert!(f.tensors().is_empty());
    assert!(f.data_offset() <= f.bytes().len());
    assert!(w.set_version(1).is_err());
    assert!(w.set_alignment(48).is_err());

    let empty = GgufWriter::new().to_bytes();
    let f = GgufFile::from_bytes(empty).unwrap();
    assert!(f.metadata().is_empty());
}

#[test]
fn writer_checks_tensor_data() {
    let mut w = GgufWriter::new();
    let e = w
        .add_tensor("x", &[4, 2], GgmlType::F32, vec![0; 31])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("'x'") && e.contains("32 bytes") && e.contains("31"),
        "{e}"
    );
    assert!(w
        .add_tensor("x", &[33], GgmlType::Q8_0, vec![0; 34])
        .is_err());
    assert!(w.add_tensor("x", &[0], GgmlType::F32, vec![]).is_err());
    assert!(w
        .add_tensor("x", &[1, 1, 1, 1, 1], GgmlType::F32, vec![0; 4])
        .is_err());
    assert!(w
        .add_tensor("x", &[u64::MAX, 2], GgmlType::F32, vec![])
        .is_err());
    w.add_tensor("x", &[32], GgmlType::Q8_0, vec![0; 34])
        .unwrap();
    assert!(w
        .add_tensor("x", &[32], GgmlType::Q8_0, vec![0; 34])
        .is_err());
}

#[test]
fn open_maps_a_file_and_reports_io_errors() {
    let dir = std::env::temp_dir().join(format!("ringllm-gguf-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("sample.gguf");
    sample_writer().write(&p).unwrap();
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(f.path(), Some(p.as_path()));
    assert_eq!(f.bytes(), &sample_writer().to_bytes()[..]);
    assert!(format!("{f:?}").contains("n_tensors: 3"));
    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let e = GgufFile::open(&empty).unwrap_err().to_string();
    assert!(e.contains("truncated") && e.contains("magic"), "{e}");
    let missing = dir.join("missing.gguf");
    let e = GgufFile::open(&missing).unwrap_err().to_string();
    assert!(e.contains("missing.gguf"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn model(name: &str) -> GgufFile {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("models")
        .join(name);
    assert!(
        p.exists(),
        "model file {} is missing: run scripts/fetch-models",
        p.display()
    );
    GgufFile::open(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn real_gemma3_file_reads() {
    let f = model("gemma-3-270m-q4_k_m.gguf");
    let md = f.metadata();
    assert!(matches!(f.version(), 2 | 3));
    assert_eq!(f.tensors().len(), 236);
    assert_eq!(md.str("general.architecture").unwrap(), "gemma3");
    let t = f.tensor("token_embd.weight").unwrap();
    assert_eq!(
        (t.dims.as_slice(), t.ty),
        (&[640u64, 262144][..], GgmlType::Q8_0)
    );
    assert_eq!(t.size, 640 / 32 * 34 * 262144);
    let t = f.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(
        (t.dims.as_slice(), t.ty),
        (&[640u64, 1024][..], GgmlType::Q5_0)
    );
    assert_eq!(md.str_array("tokenizer.ggml.tokens").unwrap().len(), 262144);
    assert_eq!(md.u32("gemma3.block_count").unwrap(), 18);
    assert_eq!(md.u32("gemma3.embedding_length").unwrap(), 640);
    assert!(md.f32_array("tokenizer.ggml.scores").unwrap().len() == 262144);
    assert!(md.i32_array("tokenizer.ggml.token_type").unwrap().len() == 262144);
    check_layout(&f);
}

#[test]
fn real_smollm2_file_reads() {
    let f = model("smollm2-135m-instruct-q4_1.gguf");
    let md = f.metadata();
    assert_eq!(f.tensors().len(), 272);
    assert_eq!(md.str("general.architecture").unwrap(), "llama");
    assert_eq!(md.u32("llama.block_count").unwrap(), 30);
    assert_eq!(md.u32("llama.embedding_length").unwrap(), 576);
    let t = f.tensor("token_embd.weight").unwrap();
    assert_eq!(t.dims.first(), Some(&576));
    let n_vocab = md.str_array("tokenizer.ggml.tokens").unwrap().len() as u64;
    assert_eq!(t.dims.get(1), Some(&n_vocab));
    assert_eq!(f.tensor("blk.0.attn_q.weight").unwrap().dims, [576, 576]);
    check_layout(&f);
}

/// Every tensor lies inside the data section, aligned, and the tensors (in offset order)
/// do not overlap; re-serialising the metadata gives back the file's own KV bytes.
fn check_layout(f: &GgufFile) {
    let mut spans: Vec<(u64, u64)> = Vec::new();
    for t in f.tensors() {
        assert!(t.offset >= f.data_offset() as u64);
        assert_eq!(
            (t.offset - f.data_offset() as u64) % f.alignment() as u64,
            0
        );
        assert_eq!(f.tensor_data(t).len() as u64, t.size);
        let expect = t.ty.row_bytes(t.row_len() as usize).unwrap() as u64 * t.n_rows();
        assert_eq!(t.size, expect, "{}", t.name);
        spans.push((t.offset, t.offset + t.size));
    }
    spans.sort();
    assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0));

    // Header round trip: writing the same metadata and tensor table reproduces the bytes.
    let mut w = GgufWriter::new();
    w.set_alignment(f.alignment()).unwrap();
    w.set_version(f.version()).unwrap();
    for (k, v) in f.metadata().iter() {
        w.add(k, v.clone());
    }
    let kv_only = w.to_bytes();
    let kv_end = GgufFile::from_bytes(kv_only.clone()).unwrap().header_len();
    // Same magic and version; the tensor count (bytes 8..16) differs; then the KV count and
    // the entries must be byte-identical.
    assert_eq!(&kv_only[..8], &f.bytes()[..8]);
    assert_eq!(&kv_only[16..kv_end], &f.bytes()[16..kv_end]);
}

#[test]
fn lean_open_skips_the_vocabulary_and_keeps_everything_else() {
    let dir = std::env::temp_dir().join(format!("ringllm-gguf-lean-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("gemma.gguf");
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("models")
        .join("gemma-3-270m-q4_k_m.gguf");
    let full = model("gemma-3-270m-q4_k_m.gguf");
    let lean = GgufFile::open_lean(&src).unwrap();
    assert_eq!(lean.header_hash(), full.header_hash());
    assert_eq!(lean.tensors(), full.tensors());
    assert_eq!(lean.data_offset(), full.data_offset());
    assert!(full.metadata().get("tokenizer.ggml.tokens").is_some());
    assert!(lean.metadata().get("tokenizer.ggml.tokens").is_none());
    assert!(lean.metadata().get("tokenizer.ggml.scores").is_none());
    assert_eq!(
        lean.metadata().str("general.architecture").unwrap(),
        "gemma3"
    );
    // A truncated file is refused in lean mode too, inside the skipped vocabulary.
    let bytes = full.bytes();
    std::fs::write(&p, &bytes[..full.header_len() / 2]).unwrap();
    let e = GgufFile::open_lean(&p).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
