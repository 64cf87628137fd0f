//! Model slices: the part of a model one node runs, as a GGUF file of its own.
//!
//! A slice file holds every metadata entry of the model, the tensors of its layers
//! (`blk.N.*` for N in the range, under their original names), the model's global tensors
//! (e.g. `rope_freqs.weight`) and, when it holds the head, the final norm and the output
//! matrix (the embedding, for a tied head). The embedding is otherwise left out, so the
//! vocabulary size travels as metadata (`VOCAB_KEY`). A node loads a slice as it loads the
//! whole model, with the same layer range.
//!
//! The coordinator lays a slice out (`SliceSource::build`) from its own copy of the model
//! and describes it piece by piece (piece 0 the header, then one piece per tensor) with a
//! BLAKE3 hash each; the node writes the pieces where they belong and checks every hash
//! (the daemon's `slices` module).

use crate::gguf::{GgufError, GgufFile, GgufWriter, Value};
use ringllm_protocol::control::{ModelIdentity, Piece, SliceKey, SliceOffer};
use std::ops::Range;
use std::path::Path;

/// Metadata key of a slice file: the model's vocabulary size (the embedding is not there to
/// tell it).
pub const VOCAB_KEY: &str = "ringllm.slice.vocab_size";
/// Metadata keys of a slice file: the layer range it holds.
pub const LAYER_START_KEY: &str = "ringllm.slice.layer_start";
pub const LAYER_END_KEY: &str = "ringllm.slice.layer_end";
/// Largest piece count an offer may carry (a model of 10,000 layers of 10 tensors).
pub const MAX_PIECES: usize = 100_000;
/// Largest slice an offer may describe: 4 TiB.
pub const MAX_SLICE_BYTES: u64 = 4 << 40;

/// Where a piece's bytes come from.
#[derive(Clone, Debug)]
pub enum PieceData {
    /// Built here (the header).
    Bytes(Vec<u8>),
    /// A range of the model file.
    File { offset: u64 },
}

#[derive(Clone, Debug)]
pub struct PieceSource {
    pub name: String,
    /// Offset in the slice file.
    pub offset: u64,
    pub len: u64,
    pub data: PieceData,
}

/// A slice laid out from a model file: every piece, where it goes and where it comes from.
#[derive(Clone, Debug)]
pub struct SliceSource {
    pub key: SliceKey,
    pub size: u64,
    pub pieces: Vec<PieceSource>,
}

/// Whether tensor `name` belongs in the slice of `layers` (with the head when `head`);
/// `tied`: the model has no `output.weight`, the head is the embedding.
pub fn wants_tensor(name: &str, layers: &Range<usize>, head: bool, tied: bool) -> bool {
    if let Some(rest) = name.strip_prefix("blk.") {
        return rest
            .split('.')
            .next()
            .and_then(|n| n.parse::<usize>().ok())
            .is_some_and(|il| layers.contains(&il));
    }
    if name == "token_embd.weight" {
        return head && tied;
    }
    if name.starts_with("output.") || name.starts_with("output_norm.") {
        return head;
    }
    // Anything else is global and small (rope frequencies): every slice has it.
    true
}

impl SliceSource {
    /// Lays out the slice of `file` (whose identity is `model`) holding `layers`, and the
    /// head when `head`.
    pub fn build(
        file: &GgufFile,
        model: ModelIdentity,
        layers: Range<usize>,
        head: bool,
    ) -> Result<SliceSource, GgufError> {
        let embd = file.tensor("token_embd.weight").ok_or_else(|| {
            GgufError::InvalidInput("the model has no token_embd.weight".to_string())
        })?;
        let vocab = embd.dims.get(1).copied().unwrap_or(0);
        let tied = file.tensor("output.weight").is_none();
        let mut w = GgufWriter::new();
        w.set_alignment(file.alignment())?;
        for (k, v) in file.metadata().iter() {
            if k == "general.alignment" || k.starts_with("ringllm.slice.") {
                continue;
            }
            w.add(k, v.clone());
        }
        w.add(VOCAB_KEY, Value::U64(vocab));
        w.add(LAYER_START_KEY, Value::U32(layers.start as u32));
        w.add(LAYER_END_KEY, Value::U32(layers.end as u32));
        let chosen: Vec<_> = file
            .tensors()
            .iter()
            .filter(|t| wants_tensor(&t.name, &layers, head, tied))
            .collect();
        for t in &chosen {
            w.add_tensor_info(&t.name, &t.dims, t.ty)?;
        }
        let (header, placed) = w
            .layout()
            .map_err(|e| GgufError::InvalidInput(e.to_string()))?;
        let mut pieces = Vec::with_capacity(chosen.len() + 1);
        let header_len = header.len() as u64;
        pieces.push(PieceSource {
            name: "header".to_string(),
            offset: 0,
            len: header_len,
            data: PieceData::Bytes(header),
        });
        let mut size = header_len;
        for (t, &(offset, len)) in chosen.iter().zip(&placed) {
            pieces.push(PieceSource {
                name: t.name.clone(),
                offset,
                len,
                data: PieceData::File { offset: t.offset },
            });
            size = offset + len;
        }
        Ok(SliceSource {
            key: SliceKey {
                model,
                layer_start: layers.start as u32,
                layer_end: layers.end as u32,
                head,
            },
            size,
            pieces,
        })
    }

    /// The bytes of piece `i` (from `file`, the model it was built from).
    pub fn bytes<'a>(&'a self, file: &'a GgufFile, i: usize) -> &'a [u8] {
        let Some(p) = self.pieces.get(i) else {
            return &[];
        };
        match &p.data {
            PieceData::Bytes(b) => b,
            PieceData::File { offset } => {
                let (a, n) = (*offset as usize, p.len as usize);
                file.bytes().get(a..a + n).unwrap_or(&[])
            }
        }
    }

    /// Bytes of the tensor data (every piece but the header).
    pub fn tensor_bytes(&self) -> u64 {
        self.pieces.iter().skip(1).map(|p| p.len).sum()
    }

    /// The offer that describes this slice, every piece hashed (on up to `threads` threads).
    pub fn offer(
        &self,
        file: &GgufFile,
        threads: usize,
        dry_run: bool,
        discard: bool,
    ) -> SliceOffer {
        let hashes = hash_all(
            &(0..self.pieces.len())
                .map(|i| self.bytes(file, i))
                .collect::<Vec<_>>(),
            threads,
        );
        SliceOffer {
            key: self.key.clone(),
            size: self.size,
            pieces: self
                .pieces
                .iter()
                .zip(hashes)
                .map(|(p, hash)| Piece {
                    name: p.name.clone(),
                    offset: p.offset,
                    len: p.len,
                    hash,
                })
                .collect(),
            dry_run,
            discard,
        }
    }
}

/// BLAKE3 of every buffer, spread over `threads` threads (largest first, each to the
/// least loaded thread).
pub fn hash_all(bufs: &[&[u8]], threads: usize) -> Vec<[u8; 32]> {
    let threads = threads.clamp(1, 64);
    let mut order: Vec<usize> = (0..bufs.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(bufs[i].len()));
    let mut bins: Vec<(u64, Vec<usize>)> = vec![(0, Vec::new()); threads];
    for i in order {
        if let Some(b) = bins.iter_mut().min_by_key(|b| b.0) {
            b.0 += bufs[i].len() as u64;
            b.1.push(i);
        }
    }
    let mut out = vec![[0u8; 32]; bufs.len()];
    std::thread::scope(|s| {
        let handles: Vec<_> = bins
            .into_iter()
            .filter(|b| !b.1.is_empty())
            .map(|(_, idx)| {
                s.spawn(move || {
                    idx.into_iter()
                        .map(|i| (i, *blake3::hash(bufs[i]).as_bytes()))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            // A hashing thread cannot panic short of a bug; its pieces then stay zero and
            // fail their check on the node, which asks for them again.
            if let Ok(v) = h.join() {
                for (i, hash) in v {
                    out[i] = hash;
                }
            }
        }
    });
    out
}

/// Checks an offer a peer sent before anything is allocated or written for it: pieces in
/// order, inside the file, not overlapping, header first; sizes within `MAX_*`.
pub fn check_offer(o: &SliceOffer) -> Result<(), String> {
    let k = &o.key;
    if k.layer_start > k.layer_end {
        return Err(format!(
            "layers {}..{} run backwards",
            k.layer_start, k.layer_end
        ));
    }
    if o.size > MAX_SLICE_BYTES {
        return Err(format!(
            "a slice of {} bytes is larger than the {} TiB a node takes",
            o.size,
            MAX_SLICE_BYTES >> 40
        ));
    }
    if o.pieces.is_empty() || o.pieces.len() > MAX_PIECES {
        return Err(format!(
            "{} pieces (1 to {MAX_PIECES} allowed)",
            o.pieces.len()
        ));
    }
    let mut end = 0u64;
    for (i, p) in o.pieces.iter().enumerate() {
        if i == 0 && p.offset != 0 {
            return Err("the first piece (the header) does not start the file".to_string());
        }
        if p.offset < end {
            return Err(format!("piece {i} ({}) overlaps the one before", p.name));
        }
        end = p
            .offset
            .checked_add(p.len)
            .filter(|&e| e <= o.size)
            .ok_or_else(|| format!("piece {i} ({}) runs past the {} bytes", p.name, o.size))?;
        if p.len == 0 {
            return Err(format!("piece {i} ({}) is empty", p.name));
        }
    }
    if end != o.size {
        return Err(format!(
            "the pieces end at byte {end}, the slice is {} bytes",
            o.size
        ));
    }
    Ok(())
}

/// Identity of a model file (what assignments name).
pub fn model_identity(path: &Path, file: &GgufFile) -> ModelIdentity {
    ModelIdentity {
        file_name: path
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
        size: file.bytes().len() as u64,
        header_hash: file.header_hash(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{LoadOptions, Model};
    use std::sync::Arc;

    fn identity() -> ModelIdentity {
        ModelIdentity {
            file_name: "m.gguf".into(),
            size: 1,
            header_hash: 2,
        }
    }

    #[test]
    fn tensor_choice() {
        let l = 2..4;
        assert!(wants_tensor("blk.2.attn_q.weight", &l, false, false));
        assert!(wants_tensor("blk.3.ffn_down.weight", &l, false, false));
        assert!(!wants_tensor("blk.4.ffn_down.weight", &l, false, false));
        assert!(!wants_tensor("blk.1.ffn_down.weight", &l, true, false));
        assert!(!wants_tensor("blk.x.ffn_down.weight", &l, true, false));
        assert!(!wants_tensor("token_embd.weight", &l, false, true));
        assert!(!wants_tensor("token_embd.weight", &l, true, false));
        assert!(wants_tensor("token_embd.weight", &l, true, true));
        assert!(wants_tensor("output.weight", &l, true, false));
        assert!(!wants_tensor("output_norm.weight", &l, false, false));
        assert!(wants_tensor("rope_freqs.weight", &l, false, false));
    }

    /// A small model of a real shape's kind (llama3-8b: untied head, rope frequencies;
    /// gemma3-1b: head tied to the embedding).
    fn small(name: &str) -> Arc<GgufFile> {
        use crate::synth::{shape, shape_model_bytes, ShapeSpec, WeightMix};
        let mut s = ShapeSpec::new(shape(name).unwrap(), WeightMix::Q4KM, 7);
        let sh = &mut s.shape;
        sh.n_layer = 4;
        sh.d_model = 256;
        sh.n_head = 4;
        sh.n_head_kv = 2;
        sh.head_dim = 64;
        sh.d_ff = 512;
        sh.vocab = sh.vocab_kind.min_vocab() + 11;
        sh.sliding_window = sh.sliding_window.min(8);
        Arc::new(GgufFile::from_bytes(shape_model_bytes(&s).unwrap()).unwrap())
    }

    /// A slice assembled from its pieces is a valid GGUF whose layers load and hold the
    /// same bytes as the model's; the offer passes its own check, and hashes match.
    #[test]
    fn slice_file_loads_like_the_model() {
        for shape in ["llama3-8b", "gemma3-1b"] {
            let file = small(shape);
            let tied = file.tensor("output.weight").is_none();
            assert_eq!(tied, shape == "gemma3-1b", "{shape}");
            let full = Model::load(Arc::clone(&file), &LoadOptions::default()).unwrap();
            let n = full.hp.n_layer;
            for (layers, head) in [(0..1, false), (1..n, true), (0..n, true), (2..3, false)] {
                let s = SliceSource::build(&file, identity(), layers.clone(), head).unwrap();
                let offer = s.offer(&file, 2, false, false);
                check_offer(&offer).unwrap();
                let mut bytes = vec![0u8; s.size as usize];
                for (i, p) in s.pieces.iter().enumerate() {
                    let b = s.bytes(&file, i);
                    assert_eq!(b.len() as u64, p.len);
                    assert_eq!(*blake3::hash(b).as_bytes(), offer.pieces[i].hash);
                    bytes[p.offset as usize..][..b.len()].copy_from_slice(b);
                }
                let sf = Arc::new(GgufFile::from_bytes(bytes).unwrap());
                assert_eq!(sf.tensor("token_embd.weight").is_some(), head && tied);
                assert_eq!(sf.tensor("output_norm.weight").is_some(), head);
                let m = Model::load(
                    Arc::clone(&sf),
                    &LoadOptions {
                        layers: Some(layers.clone()),
                        embedding: false,
                        head,
                        repack: false,
                        stream: None,
                        experts: None,
                    },
                )
                .unwrap();
                assert_eq!(m.hp.vocab, full.hp.vocab);
                assert_eq!(m.rope_freqs, full.rope_freqs);
                assert_eq!(m.layers.len(), layers.len());
                for (a, b) in m.layers.iter().zip(&full.layers[layers.clone()]) {
                    for (wa, wb) in a.matrices().iter().zip(b.matrices()) {
                        assert_eq!(wa.name, wb.name);
                        assert_eq!(m.matrix(wa).data, full.matrix(wb).data);
                    }
                }
                match (&m.output, &full.output) {
                    (Some(a), Some(b)) => assert_eq!(m.matrix(a).data, full.matrix(b).data),
                    (None, _) => assert!(!head),
                    (Some(_), None) => unreachable!(),
                }
                // Layers outside the slice are not there to load.
                if layers.end < n {
                    let r = Model::load(
                        Arc::clone(&sf),
                        &LoadOptions {
                            layers: Some(layers.start..layers.end + 1),
                            embedding: false,
                            head: false,
                            repack: false,
                            stream: None,
                            experts: None,
                        },
                    );
                    assert!(r.is_err());
                }
            }
        }
    }

    #[test]
    fn bad_offers_are_refused() {
        let good = SliceOffer {
            key: SliceKey {
                model: identity(),
                layer_start: 0,
                layer_end: 2,
                head: false,
            },
            size: 100,
            pieces: vec![
                Piece {
                    name: "header".into(),
                    offset: 0,
                    len: 40,
                    hash: [0; 32],
                },
                Piece {
                    name: "t".into(),
                    offset: 64,
                    len: 36,
                    hash: [0; 32],
                },
            ],
            dry_run: false,
            discard: false,
        };
        check_offer(&good).unwrap();
        let bad = |f: &dyn Fn(&mut SliceOffer)| {
            let mut o = good.clone();
            f(&mut o);
            check_offer(&o).unwrap_err()
        };
        assert!(bad(&|o| o.size = 99).contains("runs past"));
        assert!(bad(&|o| o.size = 101).contains("end at byte"));
        assert!(bad(&|o| o.pieces[1].offset = 30).contains("overlaps"));
        assert!(bad(&|o| o.pieces[0].offset = 1).contains("header"));
        assert!(bad(&|o| o.pieces[1].len = 0).contains("empty"));
        assert!(bad(&|o| o.pieces.clear()).contains("pieces"));
        assert!(bad(&|o| o.size = u64::MAX).contains("TiB"));
        assert!(bad(&|o| o.key.layer_start = 3).contains("backwards"));
        assert!(bad(&|o| o.pieces[1].offset = u64::MAX).contains("runs past"));
    }
}
