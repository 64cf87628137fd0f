//! A model (or a contiguous slice of its layers) over a memory-mapped GGUF file: the
//! loader states what it expects of every tensor (shape, type, required or not) and checks it.

use crate::arch::{Arch, Hparams, LayerRecipe, TensorKind};
use crate::error::ModelError;
use crate::gguf::{GgufFile, TensorInfo};
use crate::stream::{ExpertGuard, ExpertStore, LayerGuard, Streamer};
use ringllm_kernels::{kernels, repack, GgmlType, QMatrix};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// A 2-D weight matrix: `n_out` rows of `n_in` elements, inside the mapped file, or repacked
/// into panels at load (`ringllm_kernels::repack`).
#[derive(Clone, Debug)]
pub struct Weight {
    pub name: String,
    pub ty: GgmlType,
    pub n_in: usize,
    pub n_out: usize,
    range: Range<usize>,
    packed: Option<Packed>,
    /// Read from the streamer's buffer of its layer, not from the mapping.
    streamed: bool,
    /// Stacked experts read one expert at a time from the expert store
    /// ([`crate::stream::experts`]), never from the mapping.
    pub experts_streamed: bool,
}

impl Weight {
    pub fn bytes(&self) -> usize {
        self.range.len()
    }
}

/// A matrix's bytes copied at load into owned memory (the mapped pages they came from are
/// released), repacked into panels (`panels`) or as in the file; shared by the two `Weight`s
/// of a tied embedding and head.
#[derive(Clone)]
struct Packed(Arc<Vec<u8>>, bool);

impl std::fmt::Debug for Packed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Packed({} bytes, panels {})", self.0.len(), self.1)
    }
}

/// The weights of one repeating block.
#[derive(Debug)]
pub struct Layer {
    /// The steps both forward passes walk for this layer; the optional tensors below are
    /// loaded exactly when a step of it reads them.
    pub recipe: LayerRecipe,
    pub attn_norm: Vec<f32>,
    pub wq: Weight,
    /// Absent in a shared-KV layer (it reads another layer's cache).
    pub wk: Option<Weight>,
    /// Absent in a shared-KV layer and where V is K (`Step::VFromK`).
    pub wv: Option<Weight>,
    pub wo: Weight,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    /// The feed-forward's gate, up and down projections. In a mixture-of-experts layer
    /// (`router` set) each holds every expert's matrix stacked, expert `e`'s rows being
    /// `e·rows..(e+1)·rows` ([`Model::expert`]).
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
    /// The mixture-of-experts router, one row per expert.
    pub router: Option<Weight>,
    /// The router's bias, `[n_expert]` (gpt-oss).
    pub router_bias: Option<Vec<f32>>,
    /// Every expert's gate, up and down biases, expert `e`'s at `e·ff..` (`e·d..` for down)
    /// (gpt-oss).
    pub expert_bias: Option<ExpertBias>,
    /// The attention output projection's bias (gpt-oss).
    pub bo: Option<Vec<f32>>,
    /// One sink logit per query head (gpt-oss).
    pub attn_sinks: Option<Vec<f32>>,
    pub post_ffw_norm: Option<Vec<f32>>,
    /// Per-layer embedding input (Gemma 4): gate `[d → ple]`, projection `[ple → d]`, norm.
    pub ple_gate: Option<Weight>,
    pub ple_proj: Option<Weight>,
    pub ple_post_norm: Option<Vec<f32>>,
    /// The scalar the layer's output is multiplied by (Gemma 4).
    pub out_scale: Option<f32>,
}

impl Layer {
    /// The layer's weight matrices.
    pub fn matrices(&self) -> Vec<&Weight> {
        [
            Some(&self.wq),
            self.wk.as_ref(),
            self.wv.as_ref(),
            Some(&self.wo),
        ]
        .into_iter()
        .chain([Some(&self.gate), Some(&self.up), Some(&self.down)])
        .chain([self.router.as_ref()])
        .chain([self.ple_gate.as_ref(), self.ple_proj.as_ref()])
        .flatten()
        .collect()
    }

    /// Bytes of weight matrices (what the layer holds; what one decoded token reads unless it
    /// is a mixture of experts, [`Layer::active_bytes`]).
    pub fn weight_bytes(&self) -> usize {
        self.matrices().iter().map(|w| w.bytes()).sum()
    }

    /// Bytes of weights one decoded token reads: every matrix, but of a mixture of experts
    /// only the `n_used` of `n_expert` experts the router picks.
    pub fn active_bytes(&self, hp: &Hparams) -> usize {
        let all = self.weight_bytes();
        match (&self.router, hp.moe) {
            (Some(_), Some(m)) => {
                let experts = self.gate.bytes() + self.up.bytes() + self.down.bytes();
                all - experts + experts / m.n_expert * m.n_used
            }
            _ => all,
        }
    }
}

/// A mixture of experts's per-expert biases, stacked as the experts are.
#[derive(Debug)]
pub struct ExpertBias {
    /// `[n_expert × d_ff_exp]`.
    pub gate: Vec<f32>,
    /// `[n_expert × d_ff_exp]`.
    pub up: Vec<f32>,
    /// `[n_expert × d_model]`.
    pub down: Vec<f32>,
}

/// The weights that make every layer's per-layer embedding input from a token (Gemma 4
/// E2B/E4B): loaded with the token embedding.
#[derive(Debug)]
pub struct PleWeights {
    /// `[n_layer·ple, vocab]`: one row per token.
    pub token_embd: Weight,
    /// `[d → n_layer·ple]`: the scaled embedding projected to every layer's input.
    pub model_proj: Weight,
    /// `[ple]`.
    pub proj_norm: Vec<f32>,
}

/// What part of the model to load.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Layers to load (`None`: all).
    pub layers: Option<Range<usize>>,
    /// Load the token embedding (first stage / coordinator).
    pub embedding: bool,
    /// Load the final norm and output head (last stage / coordinator).
    pub head: bool,
    /// Repack the matrices whose format has a panel layout this CPU's kernels read
    /// (`ringllm_kernels::repack`) into owned memory, releasing their mapped pages: the
    /// prefill and decode GEMM read one run per panel instead of one per row. Off: the
    /// kernels read the mapped file as it is.
    pub repack: bool,
    /// Layers read from disk each token by this streamer instead of staying resident
    /// ([`crate::stream`]); every other matrix is then copied into owned memory at load (tier
    /// A), so that the kernel cannot evict it under the cgroup's memory pressure.
    pub stream: Option<Arc<Streamer>>,
    /// The experts of a mixture of experts read from disk into this cache as the router picks
    /// them; the rest of every layer is then copied into owned memory (tier A), as with
    /// `stream`.
    pub experts: Option<Arc<ExpertStore>>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            layers: None,
            embedding: true,
            head: true,
            repack: false,
            stream: None,
            experts: None,
        }
    }
}

#[derive(Debug)]
pub struct Model {
    file: Arc<GgufFile>,
    pub hp: Hparams,
    pub layer_range: Range<usize>,
    /// `layers[i]` is layer `layer_range.start + i`.
    pub layers: Vec<Layer>,
    pub tok_embd: Option<Weight>,
    pub output_norm: Option<Vec<f32>>,
    /// The output head (the embedding again when tied).
    pub output: Option<Weight>,
    /// Per-dimension RoPE frequency divisors (Llama 3.1 `rope_freqs`; Gemma 4's proportional
    /// RoPE of its full-attention layers).
    pub rope_freqs: Option<Vec<f32>>,
    /// Gemma 4's per-layer embeddings, with the token embedding.
    pub ple: Option<PleWeights>,
    /// LongRoPE divisors (Phi-3 128k): `rope_factors_long` and `rope_factors_short`, the
    /// runner picking one by its context (`Hparams::rope_orig_ctx`).
    pub rope_factors: Option<(Vec<f32>, Vec<f32>)>,
    /// The streamed tier, when some of the layers are read from disk each token.
    pub streamer: Option<Arc<Streamer>>,
    /// The expert cache, when experts are read from disk as they are picked.
    pub experts: Option<Arc<ExpertStore>>,
}

impl Model {
    /// Opens `path` and loads the whole model.
    pub fn open(path: &Path) -> Result<Model, ModelError> {
        let file = GgufFile::open(path)?;
        Model::load(Arc::new(file), &LoadOptions::default())
    }

    pub fn load(file: Arc<GgufFile>, opts: &LoadOptions) -> Result<Model, ModelError> {
        let md = file.metadata();
        md.require(&["general.architecture"])?;
        let arch_name = md.str("general.architecture")?.to_string();
        let arch =
            Arch::from_name(&arch_name).ok_or(ModelError::UnsupportedArch { name: arch_name })?;
        let embd_name = TensorKind::TokenEmbd.gguf_name(None);
        // The vocabulary size is the embedding's row count; a slice sent to a node holds no
        // embedding and says it in its metadata instead.
        let vocab = match file.tensor(&embd_name) {
            Some(embd_info) => {
                if embd_info.dims.len() != 2 {
                    return Err(ModelError::BadShape {
                        name: embd_name,
                        expected: vec![0, 0],
                        found: embd_info.dims.clone(),
                    });
                }
                embd_info.dims[1] as usize
            }
            None if md.get(crate::slice::VOCAB_KEY).is_some() && !opts.embedding => {
                md.u64(crate::slice::VOCAB_KEY)? as usize
            }
            None => return Err(ModelError::MissingTensor { name: embd_name }),
        };
        let mut hp = Hparams::from_metadata(arch, md, vocab)?;
        let layer_range = opts.layers.clone().unwrap_or(0..hp.n_layer);
        if layer_range.start > layer_range.end || layer_range.end > hp.n_layer {
            return Err(ModelError::LayerRange {
                start: layer_range.start,
                end: layer_range.end,
                n_layer: hp.n_layer,
            });
        }
        // Load-time rule: where the V projection is optional, a layer without one takes V
        // from K.
        if hp.v_proj_optional {
            for il in layer_range.clone() {
                let v = TensorKind::AttnV.gguf_name(Some(il));
                if hp.kv_source(il).is_none() && file.tensor(&v).is_none() {
                    hp.set_v_from_k(il);
                }
            }
        }
        check_split(&hp, &layer_range, opts.embedding)?;
        let loader = Loader {
            file: &file,
            hp: &hp,
            repack: opts.repack,
            own: opts.stream.is_some() || opts.experts.is_some(),
            streamed_layer: None,
            experts: None,
            packed: Default::default(),
        };
        let d = hp.d_model as u64;
        let tok_embd = if opts.embedding {
            // One row read per token: mapped, even when streaming (a tied head copies it).
            let l = Loader {
                own: false,
                ..loader.clone_settings()
            };
            Some(l.matrix(TensorKind::TokenEmbd, None, d, hp.vocab as u64)?)
        } else {
            None
        };
        let (output_norm, output) = if opts.head {
            let norm = loader.vector(TensorKind::OutputNorm, None, d)?;
            let out_name = TensorKind::Output.gguf_name(None);
            let out = if file.tensor(&out_name).is_some() {
                loader.matrix(TensorKind::Output, None, d, hp.vocab as u64)?
            } else {
                loader.matrix(TensorKind::TokenEmbd, None, d, hp.vocab as u64)?
            };
            (Some(norm), Some(out))
        } else {
            (None, None)
        };
        let ple = if opts.embedding && hp.ple_dim > 0 {
            let width = (hp.n_layer * hp.ple_dim) as u64;
            let l = Loader {
                own: false,
                ..loader.clone_settings()
            };
            Some(PleWeights {
                token_embd: l.matrix(
                    TensorKind::PerLayerTokenEmbd,
                    None,
                    width,
                    hp.vocab as u64,
                )?,
                model_proj: loader.matrix(TensorKind::PerLayerModelProj, None, d, width)?,
                proj_norm: loader.vector(TensorKind::PerLayerProjNorm, None, hp.ple_dim as u64)?,
            })
        } else {
            None
        };
        let rope_freqs = if file
            .tensor(&TensorKind::RopeFreqs.gguf_name(None))
            .is_some()
        {
            Some(loader.vector(TensorKind::RopeFreqs, None, (hp.rope_dim / 2) as u64)?)
        } else {
            None
        };
        let has = |kind: TensorKind| file.tensor(&kind.gguf_name(None)).is_some();
        let half = (hp.rope_dim / 2) as u64;
        let rope_factors = if has(TensorKind::RopeFactorsLong) || has(TensorKind::RopeFactorsShort)
        {
            Some((
                loader.vector(TensorKind::RopeFactorsLong, None, half)?,
                loader.vector(TensorKind::RopeFactorsShort, None, half)?,
            ))
        } else {
            None
        };
        let mut layers = Vec::with_capacity(layer_range.len());
        for il in layer_range.clone() {
            let streamed = opts.stream.as_ref().is_some_and(|s| s.streams(il));
            let l = Loader {
                streamed_layer: streamed.then_some(il),
                experts: opts.experts.as_ref().filter(|x| x.streams(il)).cloned(),
                ..loader.clone_settings()
            };
            layers.push(l.layer(il)?);
        }
        let model = Model {
            file,
            hp,
            layer_range,
            layers,
            tok_embd,
            output_norm,
            output,
            rope_freqs,
            ple,
            rope_factors,
            streamer: opts.stream.clone(),
            experts: opts.experts.clone(),
        };
        let packed = model.packed_bytes();
        if packed > 0 {
            tracing::info!(
                bytes = packed,
                isa = ringllm_kernels::isa().name(),
                "weights repacked into panels"
            );
        }
        Ok(model)
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    pub fn file_arc(&self) -> &Arc<GgufFile> {
        &self.file
    }

    /// A kernel view of `w` (a resident weight: a streamed one needs its layer's buffer,
    /// [`Model::matrix_in`]).
    pub fn matrix<'a>(&'a self, w: &'a Weight) -> QMatrix<'a> {
        self.matrix_in(w, None)
    }

    /// A kernel view of `w`, read from `layer` (its layer's streamed bytes) when it is
    /// streamed.
    pub fn matrix_in<'a>(
        &'a self,
        w: &'a Weight,
        layer: Option<&'a LayerGuard<'a>>,
    ) -> QMatrix<'a> {
        let (data, packed) = match (&w.packed, w.streamed, layer) {
            (Some(p), _, _) => (p.0.as_slice(), p.1),
            (None, true, Some(g)) => {
                let at = w.range.start - g.file_start;
                (&g[at..at + w.range.len()], false)
            }
            (None, true, None) => panic!("streamed weight {} read without its layer", w.name),
            (None, false, _) => (&self.file.bytes()[w.range.clone()], false),
        };
        QMatrix {
            ty: w.ty,
            n_in: w.n_in,
            n_out: w.n_out,
            data,
            packed,
        }
    }

    /// Expert `e`'s matrix of the stacked `w` (`rows` rows per expert: `d_ff_exp` for gate
    /// and up, `d_model` for down), read from `layer` when streamed.
    pub fn expert<'a>(
        &'a self,
        w: &'a Weight,
        e: usize,
        rows: usize,
        layer: Option<&'a LayerGuard<'a>>,
    ) -> QMatrix<'a> {
        let m = self.matrix_in(w, layer);
        let span = rows * m.row_bytes();
        QMatrix {
            n_out: rows,
            data: &m.data[e * span..(e + 1) * span],
            ..m
        }
    }

    /// Expert `e`'s matrix of the stacked `w` (`rows` rows per expert) from the expert cache's
    /// guard of that expert (`part`: 0 gate, 1 up, 2 down).
    pub fn streamed_expert<'a>(
        &self,
        w: &Weight,
        rows: usize,
        g: &'a ExpertGuard<'_>,
        part: usize,
    ) -> QMatrix<'a> {
        QMatrix {
            ty: w.ty,
            n_in: w.n_in,
            n_out: rows,
            data: g.part(part),
            packed: false,
        }
    }

    /// Every weight matrix loaded: the layers', then the embedding and the head (a tied pair
    /// appears twice).
    fn weights(&self) -> impl Iterator<Item = &Weight> {
        self.layers
            .iter()
            .flat_map(|l| l.matrices())
            .chain(self.tok_embd.iter())
            .chain(self.output.iter())
            .chain(self.ple.iter().flat_map(|p| [&p.token_embd, &p.model_proj]))
    }

    /// Bytes of weight matrices repacked into panels at load (a tied embedding and head
    /// counted once).
    pub fn packed_bytes(&self) -> usize {
        let mut seen: Vec<*const Vec<u8>> = Vec::new();
        let weights = self.weights();
        let mut total = 0;
        for p in weights.filter_map(|w| w.packed.as_ref().filter(|p| p.1)) {
            let at = Arc::as_ptr(&p.0);
            if !seen.contains(&at) {
                seen.push(at);
                total += p.0.len();
            }
        }
        total
    }

    /// Reads one byte of every page of the loaded weights so they are resident before the
    /// first token (and the resident set shows the slice); returns the bytes touched.
    pub fn prefault(&self) -> usize {
        let bytes = self.file.bytes();
        let mut total = 0usize;
        let mut acc = 0u8;
        let weights = self
            .weights()
            .filter(|w| !w.streamed && !w.experts_streamed);
        for w in weights {
            let r = match &w.packed {
                Some(p) => p.0.as_slice(),
                None => &bytes[w.range.clone()],
            };
            for i in (0..r.len()).step_by(4096) {
                acc ^= r[i];
            }
            total += r.len();
        }
        std::hint::black_box(acc);
        total
    }

    /// Bytes of weights read per decoded token by the loaded part of the model (every layer
    /// matrix plus the output head; one embedding row is negligible).
    pub fn weight_bytes_per_token(&self) -> usize {
        let layers: usize = self.layers.iter().map(|l| l.active_bytes(&self.hp)).sum();
        // Gemma 4's per-layer input projection is read whole for every token.
        let ple = self.ple.as_ref().map_or(0, |p| p.model_proj.bytes());
        layers + ple + self.output.as_ref().map_or(0, |w| w.bytes())
    }
}

/// Bytes of a matrix repacked between releases of its mapped pages.
const REPACK_STEP_BYTES: usize = 4 << 20;

/// Most threads a matrix is repacked on at load.
const MAX_REPACK_THREADS: usize = 8;

/// Asks the kernel to back the fresh, untouched buffer `v` with transparent huge pages
/// (Linux, THP in `madvise` mode or `always`). Filling 4.7 GB of repacked weights one 4 KiB
/// page fault at a time spent 6 of the 11 s of qwen3-8b Q4_K_M's load clearing pages in the
/// kernel. Advice only: where it is refused the buffer works as before.
fn huge_pages(v: &mut [u8]) {
    const HUGE: usize = 2 << 20;
    #[cfg(target_os = "linux")]
    if v.len() >= 2 * HUGE {
        let start = (v.as_mut_ptr() as usize).next_multiple_of(4096);
        let end = v.as_mut_ptr() as usize + v.len();
        let len = (end - start) & !4095;
        // SAFETY: the range lies inside `v`'s allocation; MADV_HUGEPAGE changes how later
        // faults are served, never the contents.
        let rc = unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
        if rc != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "madvise(HUGEPAGE)");
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (v, HUGE);
}

/// Refuses a matrix stored in one of the activation formats.
fn weight_format(t: &TensorInfo) -> Result<(), ModelError> {
    if matches!(t.ty, GgmlType::Q8_1 | GgmlType::Q8_K) {
        return Err(ModelError::BadType {
            name: t.name.clone(),
            ty: t.ty,
            why: "an activation format, not a weight format",
        });
    }
    Ok(())
}

struct Loader<'a> {
    file: &'a GgufFile,
    hp: &'a Hparams,
    repack: bool,
    /// Copy every matrix not streamed into owned memory (a streaming model's tier A).
    own: bool,
    /// The layer being loaded is streamed: its matrices stay on disk.
    streamed_layer: Option<usize>,
    /// The layer being loaded reads its stacked experts from this store.
    experts: Option<Arc<ExpertStore>>,
    /// Matrices repacked so far, by file offset (a tied head is the embedding again).
    packed: std::rc::Rc<std::cell::RefCell<Vec<(usize, Packed)>>>,
}

impl<'a> Loader<'a> {
    fn clone_settings(&self) -> Loader<'a> {
        Loader {
            file: self.file,
            hp: self.hp,
            repack: self.repack,
            own: self.own,
            streamed_layer: None,
            experts: None,
            packed: std::rc::Rc::clone(&self.packed),
        }
    }

    fn info(&self, kind: TensorKind, layer: Option<usize>) -> Result<&TensorInfo, ModelError> {
        let name = kind.gguf_name(layer);
        self.file
            .tensor(&name)
            .ok_or(ModelError::MissingTensor { name })
    }

    /// A matrix of `n_out` rows of `n_in` (GGUF dims `[n_in, n_out]`).
    fn matrix(
        &self,
        kind: TensorKind,
        layer: Option<usize>,
        n_in: u64,
        n_out: u64,
    ) -> Result<Weight, ModelError> {
        let [w] = self.matrix_views(kind, layer, n_in, [n_out])?;
        Ok(w)
    }

    /// [`Loader::matrix_rows`] as `N` views.
    fn matrix_views<const N: usize>(
        &self,
        kind: TensorKind,
        layer: Option<usize>,
        n_in: u64,
        parts: [u64; N],
    ) -> Result<[Weight; N], ModelError> {
        // `matrix_rows` makes one view per part.
        self.matrix_rows(kind, layer, n_in, &parts)?
            .try_into()
            .map_err(|_| ModelError::MissingTensor {
                name: kind.gguf_name(layer),
            })
    }

    /// A matrix of `Σ parts` rows of `n_in` split into consecutive runs of `parts[i]` rows,
    /// each a weight of its own over its rows of the file (a fused Q/K/V or gate/up matrix):
    /// no copy, and each view is repacked or streamed as a matrix of its own would be.
    fn matrix_rows(
        &self,
        kind: TensorKind,
        layer: Option<usize>,
        n_in: u64,
        parts: &[u64],
    ) -> Result<Vec<Weight>, ModelError> {
        let t = self.info(kind, layer)?;
        let n_out = parts
            .iter()
            .try_fold(0u64, |a, &p| a.checked_add(p))
            .unwrap_or(u64::MAX);
        if t.dims != [n_in, n_out] {
            return Err(ModelError::BadShape {
                name: t.name.clone(),
                expected: vec![n_in, n_out],
                found: t.dims.clone(),
            });
        }
        weight_format(t)?;
        let start = t.offset as usize;
        let range = start..start + t.size as usize;
        let n_in = n_in as usize;
        // Only a tensor that is exactly its rows (always so in a file the reader accepted).
        let row_bytes =
            t.ty.row_bytes(n_in)
                .filter(|rb| rb.checked_mul(n_out as usize) == Some(range.len()));
        if parts.len() > 1 && row_bytes.is_none() {
            return Err(ModelError::BadShape {
                name: t.name.clone(),
                expected: vec![n_in as u64, n_out],
                found: t.dims.clone(),
            });
        }
        let streamed = self.streamed_layer.is_some();
        let mut out = Vec::with_capacity(parts.len());
        let mut at = range.start;
        for (i, &rows) in parts.iter().enumerate() {
            let rows = rows as usize;
            let part = match row_bytes {
                Some(rb) => at..at + rb * rows,
                None => range.clone(),
            };
            at = part.end;
            let panels = self.repack
                && repack::available(t.ty)
                && repack::panel_rows(t.ty).is_some_and(|p| rows >= p)
                && row_bytes.is_some();
            let packed = if streamed {
                None
            } else if panels || self.own {
                Some(self.repacked(t.ty, n_in, rows, part.clone(), panels))
            } else {
                None
            };
            let name = if parts.len() > 1 {
                format!("{}[{i}]", t.name)
            } else {
                t.name.clone()
            };
            out.push(Weight {
                name,
                ty: t.ty,
                n_in,
                n_out: rows,
                range: part,
                packed,
                streamed,
                experts_streamed: false,
            });
        }
        Ok(out)
    }

    /// A stack of `n_expert` matrices of `n_out` rows of `n_in` (GGUF dims `[n_in, n_out,
    /// n_expert]`) as one weight of `n_expert · n_out` rows; repacked only when every expert
    /// is whole panels, so that no panel spans two experts.
    fn stacked(
        &self,
        kind: TensorKind,
        layer: Option<usize>,
        n_in: u64,
        n_out: u64,
        n_expert: u64,
    ) -> Result<Weight, ModelError> {
        let t = self.info(kind, layer)?;
        if t.dims != [n_in, n_out, n_expert] {
            return Err(ModelError::BadShape {
                name: t.name.clone(),
                expected: vec![n_in, n_out, n_expert],
                found: t.dims.clone(),
            });
        }
        weight_format(t)?;
        let (n_in, rows) = (n_in as usize, (n_out * n_expert) as usize);
        let start = t.offset as usize;
        let range = start..start + t.size as usize;
        if t.ty.row_bytes(n_in).and_then(|rb| rb.checked_mul(rows)) != Some(range.len()) {
            return Err(ModelError::BadShape {
                name: t.name.clone(),
                expected: vec![n_in as u64, n_out, n_expert],
                found: t.dims.clone(),
            });
        }
        let streamed = self.streamed_layer.is_some();
        let experts_streamed = !streamed && self.experts.is_some();
        let panels = self.repack
            && repack::available(t.ty)
            && repack::panel_rows(t.ty).is_some_and(|p| (n_out as usize).is_multiple_of(p));
        let packed = if streamed || experts_streamed {
            None
        } else if panels || self.own {
            Some(self.repacked(t.ty, n_in, rows, range.clone(), panels))
        } else {
            None
        };
        Ok(Weight {
            name: t.name.clone(),
            ty: t.ty,
            n_in,
            n_out: rows,
            range,
            packed,
            streamed,
            experts_streamed,
        })
    }

    /// The matrix at `range` of the file copied into owned memory, repacked into panels when
    /// `panels`, once per tensor; its mapped pages are released, so the resident total does
    /// not grow.
    fn repacked(
        &self,
        ty: GgmlType,
        n_in: usize,
        n_out: usize,
        range: Range<usize>,
        panels: bool,
    ) -> Packed {
        if let Some((_, p)) = self
            .packed
            .borrow()
            .iter()
            .find(|(at, _)| *at == range.start)
        {
            return p.clone();
        }
        // The tensor table was checked against the file, so the range lies inside it, and
        // the caller checked that it holds exactly `n_out` rows of `n_in`.
        let src = &self.file.bytes()[range.clone()];
        let mut dst = vec![0u8; src.len()];
        huge_pages(&mut dst);
        // A few MiB of rows at a time, each run's mapped pages released before the next is
        // read: the resident total never holds a large matrix twice (a 178 MB head was +103
        // MB of peak RSS repacked whole).
        let rb = src.len() / n_out.max(1);
        let step = (REPACK_STEP_BYTES / rb.max(1))
            .max(1)
            .next_multiple_of(repack::ALIGN);
        let steps: Vec<(usize, usize)> = (0..n_out)
            .step_by(step)
            .map(|r| (r, (r + step).min(n_out)))
            .collect();
        let file = self.file;
        // One run of rows: repacked (or copied), then its mapped pages released.
        let run = |(r, end): (usize, usize), out: &mut [u8]| {
            let (a, b) = (r * rb, end * rb);
            if panels {
                repack::repack(ty, n_in, end - r, &src[a..b], out);
            } else {
                out.copy_from_slice(&src[a..b]);
            }
            file.release(range.start + a..range.start + b);
        };
        // Large matrices on every core: the copy and the kernel's clearing of the fresh pages
        // (which happens on the thread that first writes them) split between the threads.
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(MAX_REPACK_THREADS)
            .min(steps.len());
        if threads <= 1 {
            for &(r, end) in &steps {
                run((r, end), &mut dst[r * rb..end * rb]);
            }
        } else {
            let per = steps.len().div_ceil(threads);
            std::thread::scope(|scope| {
                let mut rest: &mut [u8] = &mut dst;
                for group in steps.chunks(per) {
                    let (first, last) = (group[0].0, group[group.len() - 1].1);
                    let (mine, tail) = std::mem::take(&mut rest).split_at_mut((last - first) * rb);
                    rest = tail;
                    let run = &run;
                    scope.spawn(move || {
                        for &(r, end) in group {
                            run((r, end), &mut mine[(r - first) * rb..(end - first) * rb]);
                        }
                    });
                }
            });
        }
        let p = Packed(Arc::new(dst), panels);
        self.packed.borrow_mut().push((range.start, p.clone()));
        p
    }

    /// A tensor of exactly `dims` (a per-expert bias table), dequantized to f32.
    fn table(
        &self,
        kind: TensorKind,
        layer: Option<usize>,
        dims: &[u64],
    ) -> Result<Vec<f32>, ModelError> {
        let t = self.info(kind, layer)?;
        if t.dims != dims {
            return Err(ModelError::BadShape {
                name: t.name.clone(),
                expected: dims.to_vec(),
                found: t.dims.clone(),
            });
        }
        let n: u64 = dims.iter().product();
        let mut out = vec![0f32; n as usize];
        (kernels(t.ty).dequantize)(self.file.tensor_data(t), &mut out);
        Ok(out)
    }

    /// A 1-D tensor of `n` values, dequantized to f32.
    fn vector(
        &self,
        kind: TensorKind,
        layer: Option<usize>,
        n: u64,
    ) -> Result<Vec<f32>, ModelError> {
        let t = self.info(kind, layer)?;
        if t.dims != [n] {
            return Err(ModelError::BadShape {
                name: t.name.clone(),
                expected: vec![n],
                found: t.dims.clone(),
            });
        }
        let mut out = vec![0f32; n as usize];
        (kernels(t.ty).dequantize)(self.file.tensor_data(t), &mut out);
        Ok(out)
    }

    fn layer(&self, il: usize) -> Result<Layer, ModelError> {
        let hp = self.hp;
        let (d, q, kv, ff, hd, ple) = (
            hp.d_model as u64,
            hp.q_dim_of(il) as u64,
            hp.kv_dim_of(il) as u64,
            hp.d_ff_of(il) as u64,
            hp.head_dim_of(il) as u64,
            hp.ple_dim as u64,
        );
        let l = Some(il);
        let recipe = hp.recipe(il);
        let opt_vec = |kind, n| -> Result<Option<Vec<f32>>, ModelError> {
            if recipe.needs(kind) {
                self.vector(kind, l, n).map(Some)
            } else {
                Ok(None)
            }
        };
        let opt_mat = |kind, n_in, n_out| -> Result<Option<Weight>, ModelError> {
            if recipe.needs(kind) {
                self.matrix(kind, l, n_in, n_out).map(Some)
            } else {
                Ok(None)
            }
        };
        let out_scale = match opt_vec(TensorKind::LayerOutScale, 1)? {
            Some(v) if v[0].is_finite() => Some(v[0]),
            Some(v) => {
                return Err(ModelError::BadHparams {
                    arch: hp.arch.name(),
                    why: format!("{} is {}", TensorKind::LayerOutScale.gguf_name(l), v[0]),
                })
            }
            None => None,
        };
        let (wq, wk, wv) = if recipe.needs(TensorKind::AttnQkv) {
            let [wq, wk, wv] = self.matrix_views(TensorKind::AttnQkv, l, d, [q, kv, kv])?;
            (wq, Some(wk), Some(wv))
        } else {
            (
                self.matrix(TensorKind::AttnQ, l, d, q)?,
                opt_mat(TensorKind::AttnK, d, kv)?,
                opt_mat(TensorKind::AttnV, d, kv)?,
            )
        };
        let nh = hp.n_head as u64;
        let (router_bias, expert_bias) = match hp.moe {
            Some(m) if recipe.needs(TensorKind::FfnGateExpsBias) => {
                let (e, fe) = (m.n_expert as u64, m.d_ff_exp as u64);
                (
                    Some(self.vector(TensorKind::FfnGateInpBias, l, e)?),
                    Some(ExpertBias {
                        gate: self.table(TensorKind::FfnGateExpsBias, l, &[fe, e])?,
                        up: self.table(TensorKind::FfnUpExpsBias, l, &[fe, e])?,
                        down: self.table(TensorKind::FfnDownExpsBias, l, &[d, e])?,
                    }),
                )
            }
            _ => (None, None),
        };
        let ffn_norm = if recipe.needs(TensorKind::PostAttnNorm) && hp.ffn_norm_post_attn {
            self.vector(TensorKind::PostAttnNorm, l, d)?
        } else {
            self.vector(TensorKind::FfnNorm, l, d)?
        };
        let (gate, up, down, router) = match hp.moe {
            Some(m) if recipe.needs(TensorKind::FfnGateInp) => {
                let (e, fe) = (m.n_expert as u64, m.d_ff_exp as u64);
                (
                    self.stacked(TensorKind::FfnGateExps, l, d, fe, e)?,
                    self.stacked(TensorKind::FfnUpExps, l, d, fe, e)?,
                    self.stacked(TensorKind::FfnDownExps, l, fe, d, e)?,
                    Some(self.matrix(TensorKind::FfnGateInp, l, d, e)?),
                )
            }
            _ if recipe.needs(TensorKind::FfnGateUp) => {
                let [gate, up] = self.matrix_views(TensorKind::FfnGateUp, l, d, [ff, ff])?;
                (gate, up, self.matrix(TensorKind::FfnDown, l, ff, d)?, None)
            }
            _ => (
                self.matrix(TensorKind::FfnGate, l, d, ff)?,
                self.matrix(TensorKind::FfnUp, l, d, ff)?,
                self.matrix(TensorKind::FfnDown, l, ff, d)?,
                None,
            ),
        };
        Ok(Layer {
            attn_norm: self.vector(TensorKind::AttnNorm, l, d)?,
            wq,
            wk,
            wv,
            wo: self.matrix(TensorKind::AttnOutput, l, q, d)?,
            bq: opt_vec(TensorKind::AttnQBias, q)?,
            bk: opt_vec(TensorKind::AttnKBias, kv)?,
            bv: opt_vec(TensorKind::AttnVBias, kv)?,
            q_norm: opt_vec(TensorKind::AttnQNorm, hd)?,
            k_norm: opt_vec(TensorKind::AttnKNorm, hd)?,
            post_attn_norm: opt_vec(TensorKind::PostAttnNorm, d)?,
            ffn_norm,
            gate,
            up,
            down,
            router,
            router_bias,
            expert_bias,
            bo: opt_vec(TensorKind::AttnOutBias, d)?,
            attn_sinks: opt_vec(TensorKind::AttnSinks, nh)?,
            post_ffw_norm: opt_vec(TensorKind::PostFfwNorm, d)?,
            ple_gate: opt_mat(TensorKind::PerLayerInpGate, d, ple)?,
            ple_proj: opt_mat(TensorKind::PerLayerProj, ple, d)?,
            ple_post_norm: opt_vec(TensorKind::PerLayerPostNorm, d)?,
            out_scale,
            recipe,
        })
    }
}

/// Refuses a slice that cannot run on its own: a shared-KV layer whose source layer is in
/// another slice (its cache would live on another node), or layers with per-layer embedding
/// inputs without the token embedding they are computed from.
pub fn check_split(hp: &Hparams, layers: &Range<usize>, embedding: bool) -> Result<(), ModelError> {
    for il in layers.clone() {
        if let Some(src) = hp.kv_source(il) {
            if !layers.contains(&src) {
                return Err(ModelError::Unsplittable {
                    layers: layers.clone(),
                    why: format!(
                        "layer {il} reads the KV cache of layer {src}, which is not in it \
                         (a shared-KV layer must run with its source layer)"
                    ),
                });
            }
        }
    }
    if hp.ple_dim > 0 && !layers.is_empty() && !embedding {
        return Err(ModelError::Unsplittable {
            layers: layers.clone(),
            why: "its layers take per-layer embedding inputs computed from the token \
                  embedding, which this slice does not hold (a Gemma 4 E-model runs its layers \
                  in the process that embeds the tokens)"
                .into(),
        });
    }
    Ok(())
}
