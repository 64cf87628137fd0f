//! The converter's parsers on bytes built here: safetensors headers (truncated, overflowing,
//! misplaced), SentencePiece models, pre-tokenizer names, and the Q/K row permutation.

use super::safetensors::{parse_header, Dtype};
use super::vocab::{parse_spm, pre_name};
use super::{permuted_row, ConvertError};
use std::path::Path;

/// A safetensors file: `header` JSON, then `data_len` zero bytes.
fn st(header: &str, data_len: usize) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.resize(b.len() + data_len, 0);
    b
}

fn parse(b: &[u8]) -> Result<Vec<(String, super::safetensors::StTensor)>, ConvertError> {
    parse_header(Path::new("x.safetensors"), b, 0)
}

#[test]
fn a_good_header_gives_each_tensor_its_place() {
    let h = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}}"#;
    let b = st(h, 16);
    let t = parse(&b).unwrap();
    assert_eq!(t.len(), 2);
    let a = &t.iter().find(|x| x.0 == "a").unwrap().1;
    assert_eq!((a.dtype, a.shape.clone()), (Dtype::BF16, vec![2, 3]));
    assert_eq!((a.begin, a.end), (8 + h.len(), 8 + h.len() + 12));
}

#[test]
fn bad_headers_are_refused_naming_the_tensor() {
    let err = |b: &[u8]| parse(b).unwrap_err().to_string();
    // Data past the end of the file.
    let e = err(&st(
        r#"{"w":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}}"#,
        4,
    ));
    assert!(e.contains("'w'") && e.contains("truncated"), "{e}");
    // Offsets that do not hold the shape.
    let e = err(&st(
        r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}}"#,
        16,
    ));
    assert!(e.contains("'w'") && e.contains("16 bytes"), "{e}");
    // A shape whose size overflows.
    let huge = r#"{"w":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}}"#;
    assert!(err(&st(huge, 8)).contains("overflows"));
    // A dtype we do not convert.
    let e = err(&st(
        r#"{"w":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}"#,
        8,
    ));
    assert!(e.contains("'w'") && e.contains("I64"), "{e}");
    // A header length past the file, and a file too short for one.
    let mut b = st("{}", 0);
    b[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(err(&b).contains("header length"));
    assert!(err(&[1, 2, 3]).contains("too short"));
    assert!(err(&st("[1,2]", 0)).contains("not a JSON object"));
}

/// A protobuf field (varint key, then the payload as its wire type wants).
fn field(num: u64, wire: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![(num << 3 | wire) as u8];
    if wire == 2 {
        out.push(payload.len() as u8);
    }
    out.extend_from_slice(payload);
    out
}

fn piece(text: &str, score: f32, ty: u8) -> Vec<u8> {
    let mut m = field(1, 2, text.as_bytes());
    m.extend(field(2, 5, &score.to_le_bytes()));
    m.extend(field(3, 0, &[ty]));
    field(1, 2, &m)
}

#[test]
fn sentencepiece_models_are_read_and_truncation_is_refused() {
    let mut b = piece("<unk>", 0.0, 2);
    b.extend(piece("<0x41>", 0.0, 6));
    b.extend(piece("\u{2581}the", -3.5, 1));
    b.extend(field(3, 2, &field(3, 0, &[0]))); // add_dummy_prefix false
    let (t, prefix) = parse_spm(&b).unwrap();
    assert_eq!(t.text, ["<unk>", "<0x41>", "\u{2581}the"]);
    assert_eq!(t.types, [2, 6, 1]);
    assert_eq!(t.scores.as_deref(), Some(&[0.0, 0.0, -3.5][..]));
    assert!(!prefix);
    assert!(parse_spm(&b[..b.len() - 5]).is_err());
    assert!(parse_spm(&[]).unwrap_err().contains("no pieces"));
}

#[test]
fn pre_tokenizers_are_named_by_their_expression_or_refused() {
    let split = |re: &str| {
        serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": re}},
            {"type": "ByteLevel", "use_regex": false}]})
    };
    let p = Path::new("tokenizer.json");
    let llama3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    assert_eq!(pre_name(p, Some(&split(llama3))).unwrap(), "llama-bpe");
    let gpt2 = serde_json::json!({"type": "ByteLevel", "use_regex": true});
    assert_eq!(pre_name(p, Some(&gpt2)).unwrap(), "gpt-2");
    let e = pre_name(p, Some(&split(r"\p{L}+")))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("pre_tokenizer") && e.contains("unknown split expression"),
        "{e}"
    );
    assert!(pre_name(p, None).is_err());
}

#[test]
fn qk_rows_are_permuted_as_llama_cpp_reshapes_them() {
    // llama.cpp: reshape(n_head, 2, hd/2, ...).swapaxes(1, 2): GGUF row (h, i, t) is Hugging
    // Face row (h, t, i).
    let (n_head, hd) = (3, 8);
    for h in 0..n_head {
        for i in 0..hd / 2 {
            for t in 0..2 {
                assert_eq!(
                    permuted_row(h * hd + 2 * i + t, hd),
                    h * hd + t * hd / 2 + i
                );
            }
        }
    }
    // A permutation: every row taken once.
    let mut seen: Vec<usize> = (0..n_head * hd).map(|r| permuted_row(r, hd)).collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..n_head * hd).collect::<Vec<_>>());
}
