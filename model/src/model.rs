//! A model (or a contiguous slice of its layers) over a memory-mapped GGUF file: the
//! loader states what it expects of every tensor (shape, type, required or not) and checks it.

use crate::arch::{Arch, Hparams, LayerRecipe, TensorKind};
use crate::error::ModelError;
use crate::gguf::GgufFile;
use crate::stream::{ExpertGuard, ExpertStore, LayerGuard, Streamer};

mod loader;
use loader::Loader;
use ringllm_kernels::{GgmlType, QMatrix};
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
