//! The GPU backend of the forward pass: a slice's weights uploaded once in their GGUF block
//! layout, the KV caches on the device, and every layer of a batch recorded into one command
//! buffer (one submission and one wait per call of `layers`).

use crate::arch::recipe::Buf;
use crate::arch::{FfnAct, Hparams, RopeTable, Step};
use crate::backend::{Batch, DeviceKv, LayerBackend};
use crate::error::ModelError;
use crate::forward::Observed;
use crate::kv::{KvCache, KvType};
use crate::model::{Model, Weight};
use ringllm_gpu::ops::{AttnShape, Glu, KvLayout, Ops};
use ringllm_gpu::qmat::{Matmul, QMatrix};
use ringllm_gpu::{bytemuck, wgpu, Gpu, GpuError};

/// One layer's weights on the device.
struct GpuLayer {
    attn_norm: wgpu::Buffer,
    wq: QMatrix,
    wk: QMatrix,
    wv: QMatrix,
    wo: QMatrix,
    bq: Option<wgpu::Buffer>,
    bk: Option<wgpu::Buffer>,
    bv: Option<wgpu::Buffer>,
    q_norm: Option<wgpu::Buffer>,
    k_norm: Option<wgpu::Buffer>,
    post_attn_norm: Option<wgpu::Buffer>,
    ffn_norm: wgpu::Buffer,
    gate: QMatrix,
    up: QMatrix,
    down: QMatrix,
    post_ffw_norm: Option<wgpu::Buffer>,
}

/// Scratch buffers on the device for batches up to `rows` rows.
struct Scratch {
    rows: usize,
    x: wgpu::Buffer,
    xn: wgpu::Buffer,
    q: wgpu::Buffer,
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    att: wgpu::Buffer,
    o: wgpu::Buffer,
    gate: wgpu::Buffer,
    up: wgpu::Buffer,
    pos: wgpu::Buffer,
    cs_local: wgpu::Buffer,
    cs_global: wgpu::Buffer,
}

/// The head on the device: final rows in, logits out (sized on first use).
struct Head {
    w: QMatrix,
    xin: Option<(usize, wgpu::Buffer, wgpu::Buffer)>,
}

/// A sequence's KV cache on the device: per layer of the slice, K and V.
#[derive(Debug)]
pub struct GpuKv {
    /// Which backend instance made it (a cache is refused by any other).
    owner: u64,
    layers: Vec<(wgpu::Buffer, wgpu::Buffer)>,
    bytes: u64,
}

impl DeviceKv for GpuKv {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
    fn device_bytes(&self) -> u64 {
        self.bytes
    }
}

pub struct GpuLayers {
    gpu: Gpu,
    id: u64,
    ops: Ops,
    mm: Matmul,
    layers: Vec<GpuLayer>,
    head: Option<Head>,
    scratch: Scratch,
}

fn be(e: GpuError) -> ModelError {
    ModelError::Backend(e.to_string())
}

fn f32_bytes(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

impl GpuLayers {
    /// Uploads `model`'s layers (and its head when it has one) to `gpu`, with scratch for
    /// batches up to `max_batch` rows.
    pub fn new(gpu: Gpu, model: &Model, max_batch: usize) -> Result<GpuLayers, ModelError> {
        if model.streamer.is_some() {
            return Err(ModelError::Backend(
                "layers streamed from disk run on the CPU backend only".into(),
            ));
        }
        for (i, l) in model.layers.iter().enumerate() {
            if let Some(step) = l.recipe.steps.iter().find(|s| !supports(**s)) {
                return Err(ModelError::UnsupportedStep {
                    step: step.name(),
                    layer: model.layer_range.start + i,
                    backend: "GPU",
                });
            }
        }
        if !model.hp.uniform_layers() {
            return Err(ModelError::Backend(
                "layers of different shapes (per-layer head sizes, KV heads, RoPE dimensions or \
                 feed-forward widths) run on the CPU backend only"
                    .into(),
            ));
        }
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ops = Ops::new(&gpu).map_err(be)?;
        let mm = Matmul::new(&gpu).map_err(be)?;
        let up_mat = |w: &Weight| -> Result<QMatrix, ModelError> {
            let m = model.matrix(w);
            if m.packed {
                return Err(ModelError::Backend(format!(
                    "{}: repacked weights cannot go to the GPU (load without repacking)",
                    w.name
                )));
            }
            QMatrix::upload(&gpu, w.ty, w.n_out, w.n_in, m.data, &w.name).map_err(be)
        };
        let up_vec = |label: &str, v: &[f32]| gpu.storage_init(label, f32_bytes(v)).map_err(be);
        let up_opt =
            |label: &str, v: &Option<Vec<f32>>| -> Result<Option<wgpu::Buffer>, ModelError> {
                v.as_ref().map(|v| up_vec(label, v)).transpose()
            };
        // Every step passed `supports`: the layer has its own K and V projections.
        fn need(w: &Option<Weight>) -> Result<&Weight, ModelError> {
            w.as_ref().ok_or_else(|| {
                ModelError::Backend("a layer without its own K or V projection".into())
            })
        }
        let mut layers = Vec::with_capacity(model.layers.len());
        for l in &model.layers {
            layers.push(GpuLayer {
                attn_norm: up_vec("attn_norm", &l.attn_norm)?,
                wq: up_mat(&l.wq)?,
                wk: up_mat(need(&l.wk)?)?,
                wv: up_mat(need(&l.wv)?)?,
                wo: up_mat(&l.wo)?,
                bq: up_opt("bq", &l.bq)?,
                bk: up_opt("bk", &l.bk)?,
                bv: up_opt("bv", &l.bv)?,
                q_norm: up_opt("q_norm", &l.q_norm)?,
                k_norm: up_opt("k_norm", &l.k_norm)?,
                post_attn_norm: up_opt("post_attn_norm", &l.post_attn_norm)?,
                ffn_norm: up_vec("ffn_norm", &l.ffn_norm)?,
                gate: up_mat(&l.gate)?,
                up: up_mat(&l.up)?,
                down: up_mat(&l.down)?,
                post_ffw_norm: up_opt("post_ffw_norm", &l.post_ffw_norm)?,
            });
        }
        let head = match &model.output {
            Some(w) => Some(Head {
                w: up_mat(w)?,
                xin: None,
            }),
            None => None,
        };
        let hp = &model.hp;
        let mb = max_batch.max(1) as u64;
        let half = (hp.rope_dim / 2) as u64;
        let buf =
            |label: &str, per_row: usize| gpu.storage(label, mb * per_row as u64 * 4).map_err(be);
        let scratch = Scratch {
            rows: mb as usize,
            x: buf("x", hp.d_model)?,
            xn: buf("xn", hp.d_model)?,
            q: buf("q", hp.q_dim())?,
            k: buf("k", hp.kv_dim())?,
            v: buf("v", hp.kv_dim())?,
            att: buf("att", hp.q_dim())?,
            o: buf("o", hp.d_model)?,
            gate: buf("gate", hp.d_ff)?,
            up: buf("up", hp.d_ff)?,
            pos: buf("pos", 1)?,
            cs_local: gpu.storage("cs_local", mb * half * 8).map_err(be)?,
            cs_global: gpu.storage("cs_global", mb * half * 8).map_err(be)?,
        };
        gpu.wait().map_err(be)?;
        tracing::info!(
            adapter = %gpu.summary(),
            layers = model.layers.len(),
            head = head.is_some(),
            "slice uploaded to the GPU"
        );
        Ok(GpuLayers {
            gpu,
            id,
            ops,
            mm,
            layers,
            head,
            scratch,
        })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Counts a forward call against `RINGLLM_GPU_FAIL_AFTER=N` (the tests' way to lose a
    /// device mid-request, as a driver reset would: once per process, at its N-th forward
    /// call on a GPU), then fails when the device is lost.
    fn check(&mut self) -> Result<(), ModelError> {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::OnceLock;
        static AT: OnceLock<Option<u64>> = OnceLock::new();
        static CALLS: AtomicU64 = AtomicU64::new(0);
        let at = AT.get_or_init(|| {
            std::env::var("RINGLLM_GPU_FAIL_AFTER")
                .ok()
                .and_then(|v| v.parse().ok())
        });
        if let Some(at) = at {
            if CALLS.fetch_add(1, Ordering::Relaxed) + 1 == *at {
                self.gpu.simulate_loss("RINGLLM_GPU_FAIL_AFTER reached");
            }
        }
        self.gpu.check_lost().map_err(be)
    }

    /// The device cache of `kv`, allocated on first use.
    fn device_kv<'a>(
        gpu: &Gpu,
        id: u64,
        model: &Model,
        kv: &'a mut KvCache,
    ) -> Result<&'a mut GpuKv, ModelError> {
        if kv.device.is_none() {
            let kvd = model.hp.kv_dim() as u64;
            let mut layers = Vec::with_capacity(kv.layers.len());
            let mut bytes = 0;
            for l in &kv.layers {
                let n = l.cap as u64 * kvd;
                let b = match kv.ty {
                    KvType::F32 => n * 4,
                    KvType::F16 => n * 2,
                };
                layers.push((
                    gpu.storage("k cache", b).map_err(be)?,
                    gpu.storage("v cache", b).map_err(be)?,
                ));
                bytes += 2 * b;
            }
            kv.device = Some(Box::new(GpuKv {
                owner: id,
                layers,
                bytes,
            }));
        }
        let dev = kv
            .device
            .as_mut()
            .and_then(|d| d.as_any_mut().downcast_mut::<GpuKv>())
            .ok_or_else(|| ModelError::Backend("a KV cache of another backend".into()))?;
        if dev.owner != id {
            return Err(ModelError::Backend(
                "a KV cache made by another GPU runner".into(),
            ));
        }
        Ok(dev)
    }
}

impl LayerBackend for GpuLayers {
    fn describe(&self) -> String {
        format!("gpu: {}", self.gpu.summary())
    }

    fn layers(
        &mut self,
        model: &Model,
        x: &mut [f32],
        parts: &mut [(&mut KvCache, usize)],
        batch: &Batch<'_>,
        mut observer: Option<crate::forward::LayerObserver<'_>>,
    ) -> Result<(), ModelError> {
        self.check()?;
        let hp = &model.hp;
        let n = batch.pos.len();
        let (d, hd) = (hp.d_model, hp.head_dim);
        if n > self.scratch.rows {
            return Err(ModelError::BatchTooLarge {
                n,
                max: self.scratch.rows,
            });
        }
        if self.layers.len() != model.layers.len() {
            return Err(ModelError::Backend(format!(
                "the GPU holds {} layers, the model slice has {}",
                self.layers.len(),
                model.layers.len()
            )));
        }
        let (gpu, id) = (self.gpu.clone(), self.id);
        // Every sequence's device cache, allocated before recording.
        let mut caches: Vec<(&GpuKv, &KvCache, usize, usize)> = Vec::with_capacity(parts.len());
        {
            let mut row = 0;
            let mut devs = Vec::with_capacity(parts.len());
            for (kv, k) in parts.iter_mut() {
                Self::device_kv(&gpu, id, model, kv)?;
                devs.push((row, *k));
                row += *k;
            }
            for ((kv, _), (row, k)) in parts.iter().zip(devs) {
                let dev = kv
                    .device
                    .as_ref()
                    .and_then(|d| d.as_any().downcast_ref::<GpuKv>())
                    .ok_or_else(|| ModelError::Backend("a KV cache of another backend".into()))?;
                caches.push((dev, &**kv, row, k));
            }
        }
        let s = &self.scratch;
        let pos: Vec<u32> = batch.pos.iter().map(|&p| p as u32).collect();
        gpu.queue()
            .write_buffer(&s.pos, 0, bytemuck::cast_slice(&pos));
        let cs = |t: &[(f32, f32)]| -> Vec<f32> { t.iter().flat_map(|&(c, s)| [c, s]).collect() };
        if !batch.rope_local.is_empty() {
            gpu.write_f32(&s.cs_local, 0, &cs(batch.rope_local));
        }
        if !batch.rope_global.is_empty() {
            gpu.write_f32(&s.cs_global, 0, &cs(batch.rope_global));
        }
        gpu.write_f32(&s.x, 0, &x[..n * d]);

        let rec = Rec {
            gpu: &gpu,
            ops: &self.ops,
            mm: &self.mm,
            s,
            hp,
            n,
            caches: &caches,
            shape: AttnShape {
                n_head: hp.n_head as u32,
                n_head_kv: hp.n_head_kv as u32,
                head_dim: hd as u32,
                scale: hp.query_scale,
                softcap: 0.0,
            },
        };
        let mut enc = gpu
            .device()
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("slice"),
            });
        let each_step = observer.as_ref().is_some_and(|o| o.wants_steps());
        for (i, (l, ml)) in self.layers.iter().zip(&model.layers).enumerate() {
            let il = model.layer_range.start + i;
            for &step in &ml.recipe.steps {
                encode_step(&rec, &mut enc, l, i, step)?;
                if each_step {
                    let Some(obs) = observer.as_deref_mut() else {
                        continue;
                    };
                    flush(&gpu, &mut enc);
                    for &b in step.outputs() {
                        let width = b.width(hp, il);
                        let mut rows_out = vec![0f32; n * width];
                        gpu.read_f32(s.buf(b), 0, &mut rows_out).map_err(be)?;
                        obs.step(&Observed {
                            layer: il,
                            step: step.name(),
                            buf: b.name(),
                            rows: &rows_out,
                            width,
                        });
                    }
                }
            }
            if let Some(obs) = observer.as_deref_mut() {
                flush(&gpu, &mut enc);
                gpu.read_f32(&s.x, 0, &mut x[..n * d]).map_err(be)?;
                obs.layer(il, &x[..n * d]);
            }
        }
        gpu.queue().submit([enc.finish()]);
        gpu.read_f32(&s.x, 0, &mut x[..n * d]).map_err(be)?;
        Ok(())
    }

    fn logits(
        &mut self,
        model: &Model,
        xn: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        self.check()?;
        let gpu = self.gpu.clone();
        let (d, vocab) = (model.hp.d_model, model.hp.vocab);
        let head = self.head.as_mut().ok_or_else(|| ModelError::NotInSlice {
            what: "output head",
            layers: model.layer_range.clone(),
        })?;
        if head.xin.as_ref().is_none_or(|(rows, _, _)| *rows < n) {
            let rows = n.max(1);
            head.xin = Some((
                rows,
                gpu.storage("head in", (rows * d * 4) as u64).map_err(be)?,
                gpu.storage("logits", (rows * vocab * 4) as u64)
                    .map_err(be)?,
            ));
        }
        let Some((_, xin, lout)) = head.xin.as_ref() else {
            return Err(ModelError::Backend("head buffers missing".into()));
        };
        gpu.write_f32(xin, 0, &xn[..n * d]);
        let mut enc = gpu
            .device()
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("head"),
            });
        self.mm
            .encode(&gpu, &mut enc, &head.w, xin, 0, lout, 0, n as u32)
            .map_err(be)?;
        if let Some(cap) = model.hp.final_logit_softcap {
            self.ops
                .softcap(&gpu, &mut enc, lout, (n * vocab) as u32, cap)
                .map_err(be)?;
        }
        gpu.queue().submit([enc.finish()]);
        gpu.read_f32(lout, 0, &mut out[..n * vocab]).map_err(be)?;
        Ok(())
    }
}

/// What recording one batch's steps needs: the device, its kernels, the scratch buffers, the
/// shape of the batch and every sequence's cache.
struct Rec<'a> {
    gpu: &'a Gpu,
    ops: &'a Ops,
    mm: &'a Matmul,
    s: &'a Scratch,
    hp: &'a Hparams,
    n: usize,
    caches: &'a [SeqCache<'a>],
    shape: AttnShape,
}

/// Records `step` of layer `l` (index `i` within the slice) into `e`: the GPU's walk of the
/// layer recipe, one arm per step (`arch::recipe`; the CPU's is `forward/layer.rs`).
fn encode_step(
    rec: &Rec<'_>,
    e: &mut wgpu::CommandEncoder,
    l: &GpuLayer,
    i: usize,
    step: Step,
) -> Result<(), ModelError> {
    let (gpu, ops, mm, s, hp, n) = (rec.gpu, rec.ops, rec.mm, rec.s, rec.hp, rec.n);
    let (d, qd, kvd, hd, ff) = (hp.d_model, hp.q_dim(), hp.kv_dim(), hp.head_dim, hp.d_ff);
    let (rows, eps) = (n as u32, hp.rms_eps);
    let half = (hp.rope_dim / 2) as u32;
    match step {
        Step::AttnNorm => ops
            .rms_norm(gpu, e, &s.x, 0, &l.attn_norm, &s.xn, 0, rows, d as u32, eps)
            .map_err(be)?,
        // A fused matrix is three row views of it, uploaded as matrices of their own.
        Step::QkvProj | Step::QkvFused => {
            for (w, out) in [(&l.wq, &s.q), (&l.wk, &s.k), (&l.wv, &s.v)] {
                mm.encode(gpu, e, w, &s.xn, 0, out, 0, rows).map_err(be)?;
            }
        }
        Step::QkvBias => {
            for (buf, bias, width) in [(&s.q, &l.bq, qd), (&s.k, &l.bk, kvd), (&s.v, &l.bv, kvd)] {
                if let Some(b) = bias {
                    ops.add_bias(gpu, e, buf, 0, b, rows, width as u32)
                        .map_err(be)?;
                }
            }
        }
        Step::QkNorm => {
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                for (buf, w, heads) in [(&s.q, qn, hp.n_head), (&s.k, kn, hp.n_head_kv)] {
                    ops.rms_norm_heads(gpu, e, buf, 0, w, rows, heads as u32, hd as u32, eps)
                        .map_err(be)?;
                }
            }
        }
        Step::Rope(table) => {
            let table = match table {
                RopeTable::Local => &s.cs_local,
                RopeTable::Global => &s.cs_global,
            };
            for (buf, heads) in [(&s.q, hp.n_head), (&s.k, hp.n_head_kv)] {
                ops.rope(
                    gpu,
                    e,
                    buf,
                    0,
                    table,
                    rows,
                    heads as u32,
                    hd as u32,
                    half,
                    hp.rope_style,
                )
                .map_err(be)?;
            }
        }
        Step::Attention {
            scale,
            softcap,
            sinks: _,
        } => {
            let shape = AttnShape {
                scale,
                softcap: softcap.unwrap_or(0.0),
                ..rec.shape
            };
            attention_step(gpu, ops, e, s, rec.caches, i, kvd, &shape)?;
        }
        Step::AttnOut => mm
            .encode(gpu, e, &l.wo, &s.att, 0, &s.o, 0, rows)
            .map_err(be)?,
        Step::AttnResidual { post_norm } => {
            let w = l.post_attn_norm.as_ref().filter(|_| post_norm);
            ops.residual(gpu, e, &s.x, &s.o, w, rows, d as u32, eps)
                .map_err(be)?;
        }
        Step::FfnNorm => ops
            .rms_norm(gpu, e, &s.x, 0, &l.ffn_norm, &s.xn, 0, rows, d as u32, eps)
            .map_err(be)?,
        Step::GateUp | Step::GateUpFused => {
            for (w, out) in [(&l.gate, &s.gate), (&l.up, &s.up)] {
                mm.encode(gpu, e, w, &s.xn, 0, out, 0, rows).map_err(be)?;
            }
        }
        Step::Glu(act) => {
            let act = match act {
                FfnAct::Silu => Glu::Silu,
                FfnAct::GeluTanh => Glu::GeluTanh,
                // Refused when the slice was uploaded (`supports`).
                FfnAct::SwigluOai => {
                    return Err(ModelError::UnsupportedStep {
                        step: step.name(),
                        layer: i,
                        backend: "GPU",
                    })
                }
            };
            ops.glu(gpu, e, &s.gate, &s.up, (n * ff) as u32, act)
                .map_err(be)?;
        }
        Step::FfnDown => mm
            .encode(gpu, e, &l.down, &s.gate, 0, &s.o, 0, rows)
            .map_err(be)?,
        Step::FfnResidual { post_norm } => {
            let w = l.post_ffw_norm.as_ref().filter(|_| post_norm);
            ops.residual(gpu, e, &s.x, &s.o, w, rows, d as u32, eps)
                .map_err(be)?;
        }
        // Refused when the slice was uploaded (`supports`).
        Step::QProj
        | Step::QkProj
        | Step::VFromK
        | Step::QNorm
        | Step::VNorm
        | Step::RopeQ(_)
        | Step::SharedAttention { .. }
        | Step::PerLayerInput
        | Step::OutScale
        | Step::Router { .. }
        | Step::Experts { .. }
        | Step::AttnOutBias
        | Step::PostAttnFfnNorm => {
            return Err(ModelError::UnsupportedStep {
                step: step.name(),
                layer: i,
                backend: "GPU",
            })
        }
    }
    Ok(())
}

/// A sequence's slice of the batch for the GPU: its device cache, its host cache (for the
/// layout), its first row and its row count.
type SeqCache<'a> = (&'a GpuKv, &'a KvCache, usize, usize);

/// The `Attention` step of layer `i` (index within the slice) for every sequence of the
/// batch: store its keys and values in its device cache, then attend.
#[allow(clippy::too_many_arguments)]
fn attention_step(
    gpu: &Gpu,
    ops: &Ops,
    e: &mut wgpu::CommandEncoder,
    s: &Scratch,
    caches: &[SeqCache<'_>],
    i: usize,
    kvd: usize,
    shape: &AttnShape,
) -> Result<(), ModelError> {
    for (dev, kv, row, k) in caches.iter() {
        if *k == 0 {
            continue;
        }
        let lkv = &kv.layers[i];
        let layout = KvLayout {
            cap: lkv.cap as u32,
            window: lkv.window.map(|w| w as u32),
            f16: kv.ty == KvType::F16,
        };
        let (kc, vc) = &dev.layers[i];
        ops.kv_store(
            gpu,
            e,
            &s.k,
            &s.v,
            *row as u64,
            kc,
            vc,
            &s.pos,
            *row as u64,
            *k as u32,
            kvd as u32,
            &layout,
        )
        .map_err(be)?;
        ops.attention(
            gpu,
            e,
            &s.q,
            &s.att,
            *row as u32,
            kc,
            vc,
            &s.pos,
            *row as u64,
            *k as u32,
            shape,
            &layout,
        )
        .map_err(be)?;
    }
    Ok(())
}

/// Submits what `enc` recorded so far and starts a new encoder (before a read-back).
fn flush(gpu: &Gpu, enc: &mut wgpu::CommandEncoder) {
    let done = std::mem::replace(
        enc,
        gpu.device()
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("slice"),
            }),
    );
    gpu.queue().submit([done.finish()]);
}

impl Scratch {
    /// The device buffer behind a recipe buffer.
    fn buf(&self, b: Buf) -> &wgpu::Buffer {
        match b {
            Buf::X => &self.x,
            Buf::Xn => &self.xn,
            Buf::Q => &self.q,
            Buf::K => &self.k,
            Buf::V => &self.v,
            Buf::Att => &self.att,
            Buf::O => &self.o,
            Buf::Gate | Buf::Ple => &self.gate,
            Buf::Up => &self.up,
        }
    }
}

/// Whether this backend runs `step`: checked for every step of every layer when a slice is
/// uploaded, so a recipe step added without a GPU kernel fails there by name.
fn supports(step: Step) -> bool {
    match step {
        Step::AttnNorm
        | Step::QkvProj
        | Step::QkvBias
        | Step::QkNorm
        | Step::Rope(_)
        | Step::Attention { sinks: false, .. }
        | Step::AttnOut
        | Step::AttnResidual { .. }
        | Step::FfnNorm
        | Step::GateUp
        | Step::Glu(FfnAct::Silu | FfnAct::GeluTanh)
        | Step::FfnDown
        | Step::FfnResidual { .. }
        | Step::QkvFused
        | Step::GateUpFused => true,
        // Gemma 4's steps: not on the GPU yet.
        Step::QProj
        | Step::QkProj
        | Step::VFromK
        | Step::QNorm
        | Step::VNorm
        | Step::RopeQ(_)
        | Step::SharedAttention { .. }
        | Step::PerLayerInput
        | Step::OutScale => false,
        // Mixture-of-experts layers and gpt-oss's sinks and biases: not on the GPU yet.
        Step::Router { .. }
        | Step::Experts { .. }
        | Step::Attention { sinks: true, .. }
        | Step::AttnOutBias
        | Step::PostAttnFfnNorm
        | Step::Glu(FfnAct::SwigluOai) => false,
    }
}
