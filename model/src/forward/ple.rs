//! Gemma 4's per-layer embeddings (E2B, E4B) on the CPU: each token gets an input of `ple`
//! values for every layer, made with the token's embedding (`embed`), and each layer adds a
//! gated projection of its input to the residual stream (`Step::PerLayerInput`).
//!
//! The input of layer `l` for token `t` with scaled embedding `x0`:
//! `(rms_norm(W_model_proj[l] · x0 / √d) · proj_norm + E_ple[t][l] · √ple) / √2`.

use super::layer::{add_rows, ROWS_PER_CHUNK};
use super::{Runner, Scratch};
use crate::error::ModelError;
use crate::model::{Layer, Model};
use crate::stream::LayerGuard;
use ringllm_kernels::matmul::{matmul, ActBuffer};
use ringllm_kernels::ops;
use ringllm_kernels::pool::SharedMut;
use ringllm_kernels::ThreadPool;

/// The inputs `embed` made, waiting for the `layers` calls on the same rows (in order, in
/// one call or several).
pub(super) struct PleInputs {
    /// Rows made.
    rows: usize,
    /// Rows handed to `layers` calls so far.
    used: usize,
    /// `[rows × n_layer × ple]`.
    data: Vec<f32>,
    /// One token's row of the per-layer embedding table.
    row: Vec<f32>,
    acts: ActBuffer,
}

impl PleInputs {
    /// Room for `values` inputs (a batch's worth; none for a model without them).
    pub(super) fn new(values: usize) -> PleInputs {
        PleInputs {
            rows: 0,
            used: 0,
            data: vec![0.0; values],
            row: Vec::new(),
            acts: ActBuffer::new(),
        }
    }
}

fn poisoned() -> ModelError {
    ModelError::Backend("per-layer embedding inputs: a thread panicked while making them".into())
}

impl Runner {
    /// Makes the per-layer inputs of `tokens` from their scaled embeddings `x` (`[n × d]`),
    /// for the next `layers` call; nothing for a model without per-layer embeddings.
    pub(super) fn per_layer_inputs(&self, tokens: &[u32], x: &[f32]) -> Result<(), ModelError> {
        let m = &*self.model;
        let Some(p) = &m.ple else {
            return Ok(());
        };
        let (d, pd) = (m.hp.d_model, m.hp.ple_dim);
        let width = m.hp.n_layer * pd;
        let n = tokens.len();
        let mut g = self.ple_inputs.lock().map_err(|_| poisoned())?;
        let g = &mut *g;
        if g.data.len() < n * width {
            g.data.resize(n * width, 0.0);
        }
        g.row.resize(width, 0.0);
        g.acts.reserve(d, n);
        let out = &mut g.data[..n * width];
        matmul(
            &self.pool,
            &m.matrix(&p.model_proj),
            &x[..n * d],
            n,
            out,
            &mut g.acts,
        );
        let proj_scale = 1.0 / (d as f32).sqrt();
        let embd_scale = (pd as f32).sqrt();
        let input_scale = std::f32::consts::FRAC_1_SQRT_2;
        let table = m.matrix(&p.token_embd);
        for (t, &tok) in tokens.iter().enumerate() {
            // `embed` checked every id against the vocabulary.
            table.dequantize_row(tok as usize, &mut g.row);
            let rows = &mut out[t * width..(t + 1) * width];
            for v in rows.iter_mut() {
                *v *= proj_scale;
            }
            ops::rms_norm_rows_inplace(rows, &p.proj_norm, m.hp.rms_eps);
            for (v, e) in rows.iter_mut().zip(&g.row) {
                *v = (*v + e * embd_scale) * input_scale;
            }
        }
        g.rows = n;
        g.used = 0;
        Ok(())
    }

    /// Copies the next `n` rows of inputs `embed` made into the scratch, for a `layers` call
    /// on those rows.
    pub(super) fn take_per_layer_inputs(&mut self, n: usize) -> Result<(), ModelError> {
        let width = self.model.hp.n_layer * self.model.hp.ple_dim;
        let mut g = self.ple_inputs.lock().map_err(|_| poisoned())?;
        if g.rows - g.used < n {
            return Err(ModelError::Backend(format!(
                "per-layer embedding inputs: {} rows embedded and not yet run, {n} rows run: \
                 embed the tokens before running the layers on them",
                g.rows - g.used
            )));
        }
        let from = g.used * width;
        self.scratch.ple_in[..n * width].copy_from_slice(&g.data[from..from + n * width]);
        g.used += n;
        Ok(())
    }
}

/// `Step::PerLayerInput` of layer `il` on `n` rows of `x`:
/// `x += rms_norm(Wproj · (gelu(Wgate · x) ⊙ input[il])) · post_norm`.
#[allow(clippy::too_many_arguments)]
pub(super) fn per_layer_input(
    pool: &ThreadPool,
    m: &Model,
    il: usize,
    l: &Layer,
    buf: Option<&LayerGuard<'_>>,
    x: &mut [f32],
    n: usize,
    s: &mut Scratch,
) {
    let (d, pd) = (m.hp.d_model, m.hp.ple_dim);
    let width = m.hp.n_layer * pd;
    let (Some(gate), Some(proj), Some(post)) = (&l.ple_gate, &l.ple_proj, &l.ple_post_norm) else {
        // The loader reads these exactly when the recipe has this step.
        debug_assert!(false, "layer {il}: per-layer input weights not loaded");
        return;
    };
    matmul(
        pool,
        &m.matrix_in(gate, buf),
        &x[..n * d],
        n,
        &mut s.ple[..n * pd],
        &mut s.acts,
    );
    {
        let g = SharedMut::new(&mut s.ple[..n * pd]);
        let inp = &s.ple_in;
        pool.for_ranges(n, ROWS_PER_CHUNK, &|rows| {
            for t in rows {
                // SAFETY: row t of the gate is touched by this call alone.
                let row = unsafe { g.slice(t * pd..(t + 1) * pd) };
                let input = &inp[t * width + il * pd..t * width + (il + 1) * pd];
                ops::glu_gelu_tanh(row, input);
            }
        });
    }
    matmul(
        pool,
        &m.matrix_in(proj, buf),
        &s.ple[..n * pd],
        n,
        &mut s.o[..n * d],
        &mut s.acts,
    );
    add_rows(
        pool,
        d,
        &mut x[..n * d],
        &mut s.o[..n * d],
        Some(post),
        m.hp.rms_eps,
    );
}
