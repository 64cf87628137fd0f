//! The loader: what a model expects of every tensor (shape, type, required or not), checked
//! as each is read, and each matrix mapped, copied into owned memory or repacked into panels,
//! or left on disk for a streamer.

use super::{ExpertBias, Layer, Packed, Weight};
use crate::arch::{Hparams, TensorKind};
use crate::error::ModelError;
use crate::gguf::{GgufFile, TensorInfo};
use crate::stream::ExpertStore;
use ringllm_kernels::{kernels, repack, GgmlType};
use std::ops::Range;
use std::sync::Arc;

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

pub(super) struct Loader<'a> {
    pub(super) file: &'a GgufFile,
    pub(super) hp: &'a Hparams,
    pub(super) repack: bool,
    /// Copy every matrix not streamed into owned memory (a streaming model's tier A).
    pub(super) own: bool,
    /// The layer being loaded is streamed: its matrices stay on disk.
    pub(super) streamed_layer: Option<usize>,
    /// The layer being loaded reads its stacked experts from this store.
    pub(super) experts: Option<Arc<ExpertStore>>,
    /// Matrices repacked so far, by file offset (a tied head is the embedding again).
    pub(super) packed: std::rc::Rc<std::cell::RefCell<Vec<(usize, Packed)>>>,
}

impl<'a> Loader<'a> {
    pub(super) fn clone_settings(&self) -> Loader<'a> {
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
    pub(super) fn matrix(
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
    pub(super) fn vector(
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

    pub(super) fn layer(&self, il: usize) -> Result<Layer, ModelError> {
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
