//! The seam between the forward pass and the hardware that runs it.
//!
//! A node's slice runs wholly on one backend. The CPU backend is the forward pass in
//! [`crate::forward`] itself (hand-written SIMD kernels, called op by op). Any other backend
//! implements [`LayerBackend`] at the granularity of the whole slice: one call runs every
//! layer of the slice on a batch, so a GPU records the slice's layers into one submission and
//! the host waits once, instead of once per matrix product or norm.
//!
//! Why a slice-level seam rather than one call per op (matmul, norm, RoPE, attention, …): a
//! per-op trait forces a host round trip or an opaque buffer type into every op signature,
//! and on a discrete GPU each round trip costs more than the op. The ops still exist one by
//! one inside each backend (`forward.rs` for the CPU, `ringllm_gpu::ops` and `qmat` for the
//! GPU), each tested against the scalar reference.

use crate::error::ModelError;
use crate::kv::KvCache;
use crate::model::Model;

/// Which backend runs a slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    Cpu,
    /// A GPU; fails when none can be opened.
    Gpu,
    /// A GPU when one that is not a software rasterizer is found, else the CPU.
    Auto,
}

impl std::str::FromStr for BackendChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(BackendChoice::Cpu),
            "gpu" => Ok(BackendChoice::Gpu),
            "auto" => Ok(BackendChoice::Auto),
            _ => Err(format!("unknown backend {s:?} (cpu, gpu or auto)")),
        }
    }
}

/// Device state a backend keeps per sequence (its KV cache on the device).
pub trait DeviceKv: Send + Sync + std::fmt::Debug {
    fn as_any(&self) -> &dyn std::any::Any;
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
    /// Bytes held on the device.
    fn device_bytes(&self) -> u64;
}

/// What the CPU side hands a backend for one batch.
pub struct Batch<'a> {
    /// Position of each row.
    pub pos: &'a [usize],
    /// RoPE (cos, sin) per row, `rope_dim / 2` pairs each, for sliding-window layers and for
    /// global layers (computed on the host in f64, as the CPU path does).
    pub rope_local: &'a [(f32, f32)],
    pub rope_global: &'a [(f32, f32)],
}

/// A backend that runs a whole slice of layers.
pub trait LayerBackend: Send {
    /// Short name for logs and capabilities: `"gpu: <adapter>"`.
    fn describe(&self) -> String;
    /// Runs every layer of `model`'s slice on the `n = Σ parts[i].1` rows of `x` (`[n × d]`,
    /// in place); `parts` as in `Runner::layers_multi`. Does not advance the caches' `len`
    /// (the runner does). With an `observer`, each layer's output is read back and shown to
    /// it (a submission per layer: for checks, not for speed).
    fn layers(
        &mut self,
        model: &Model,
        x: &mut [f32],
        parts: &mut [(&mut KvCache, usize)],
        batch: &Batch<'_>,
        observer: Option<crate::forward::LayerObserver<'_>>,
    ) -> Result<(), ModelError>;
    /// Logits `[n × vocab]` of `n` already-normed rows (the output head), soft-capping
    /// included.
    fn logits(
        &mut self,
        model: &Model,
        xn: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<(), ModelError>;
}

/// The GPU `choice` asks for: `Ok(None)` for the CPU, and for `auto` when no GPU other than a
/// software rasterizer opens (said in the log); an error for `gpu` when none opens, or when
/// this build has no GPU backend.
#[cfg(feature = "gpu")]
fn open_gpu(choice: BackendChoice) -> Result<Option<ringllm_gpu::Gpu>, ModelError> {
    if choice == BackendChoice::Cpu {
        return Ok(None);
    }
    let opts = ringllm_gpu::GpuOptions {
        allow_software: choice == BackendChoice::Gpu,
        ..Default::default()
    };
    match ringllm_gpu::Gpu::open(&opts) {
        Ok(gpu) => Ok(Some(gpu)),
        Err(e) if choice == BackendChoice::Auto => {
            tracing::info!("backend auto: {e}; running on the CPU");
            Ok(None)
        }
        Err(e) => Err(ModelError::Backend(format!("--backend gpu: {e}"))),
    }
}

#[cfg(not(feature = "gpu"))]
fn open_gpu(choice: BackendChoice) -> Result<Option<std::convert::Infallible>, ModelError> {
    match choice {
        BackendChoice::Gpu => Err(ModelError::Backend(
            "--backend gpu: this build has no GPU backend (built without the `gpu` feature)".into(),
        )),
        BackendChoice::Cpu | BackendChoice::Auto => Ok(None),
    }
}

/// The start-up check of a node's `--backend`: `Ok(None)` for the CPU (also `auto` with no
/// GPU), else the adapter's description and its measured speed of a quantized matrix ×
/// vector, bytes of weights per second (the planner's speed for this node).
pub fn probe(choice: BackendChoice) -> Result<Option<(String, f64)>, ModelError> {
    let Some(gpu) = open_gpu(choice)? else {
        return Ok(None);
    };
    #[cfg(feature = "gpu")]
    {
        // A Q4_0 matrix of 4096 × 4096 (9 MiB): large enough to leave the caches of an
        // integrated GPU, small enough to measure in well under a second.
        let (secs, bytes) =
            ringllm_gpu::qmat::bench_matvec(&gpu, ringllm_kernels::GgmlType::Q4_0, 4096, 4096, 8)
                .map_err(|e| ModelError::Backend(e.to_string()))?;
        let speed = if secs > 0.0 { bytes as f64 / secs } else { 0.0 };
        Ok(Some((format!("gpu: {}", gpu.summary()), speed)))
    }
    #[cfg(not(feature = "gpu"))]
    match gpu {}
}

/// Opens the backend `choice` asks for, for `model` (a slice with no streamed layers), with
/// batches up to `max_batch` rows. `Ok(None)`: the CPU.
pub fn open(
    choice: BackendChoice,
    model: &Model,
    max_batch: usize,
) -> Result<Option<Box<dyn LayerBackend>>, ModelError> {
    let Some(gpu) = open_gpu(choice)? else {
        return Ok(None);
    };
    #[cfg(feature = "gpu")]
    {
        Ok(Some(Box::new(crate::gpu::GpuLayers::new(
            gpu, model, max_batch,
        )?)))
    }
    #[cfg(not(feature = "gpu"))]
    {
        let _ = (model, max_batch);
        match gpu {}
    }
}
