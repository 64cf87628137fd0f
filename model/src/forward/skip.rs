//! Predictive layer skip in the forward pass: the decisions made at the decision layer for
//! the layers after it, the batch's plan (layers nobody runs, so a streamer need not read
//! them), and a layer run with some rows skipping it.

use super::attention::Seg;
use super::{Observer, Runner};
use crate::error::ModelError;
use crate::model::{Layer, Model};
use crate::skip::{cosine, SkipPolicy, SkipStats};
use crate::stream::LayerGuard;

/// Called at the decision point with the plan of the batch (`Runner::set_on_skip_plan`).
pub type SkipPlanHook = Box<dyn FnMut(usize, &[bool]) + Send>;

/// What the forward pass decided for one (token, layer).
pub(super) const RUN: u8 = 0;
pub(super) const SKIP: u8 = 1;
/// Run, though the predictor leaned to skipping (0.5 ≤ p < confidence): its real cosine is
/// measured and logged.
pub(super) const DOUBT: u8 = 2;

/// The skip decisions of the current batch and the buffers they need.
#[derive(Default)]
pub(super) struct SkipState {
    /// Index within the slice of the layer before which decisions are made.
    pub(super) decide_at: Option<usize>,
    /// Per layer of the slice: every token of the batch skips it (decided at `decide_at`).
    pub(super) plan: Vec<bool>,
    /// `n × layers of the slice`: RUN, SKIP or DOUBT.
    pub(super) rows: Vec<u8>,
    /// Decisions exist for the current batch.
    pub(super) active: bool,
    /// This layer's decision per row of the batch (SKIP rows are restored after it).
    pub(super) row_skip: Vec<bool>,
    pub(super) feats: Vec<f32>,
    /// Residual rows saved before a layer some rows skip or doubt.
    pub(super) saved: Vec<f32>,
    pub(super) stats: SkipStats,
}

impl Runner {
    /// Turns predictive layer skip on (`Some`) or off. The decision point is the first layer
    /// of this runner's slice when that is not layer 0 (a node of a ring sees only the state
    /// entering its window), else the predictor's decision layer. Refuses a predictor made
    /// for a model of another shape.
    pub fn set_skip(&mut self, policy: Option<SkipPolicy>) -> Result<(), ModelError> {
        let st = &mut self.skip_state;
        st.decide_at = None;
        st.active = false;
        let Some(pol) = policy else {
            self.skip = None;
            return Ok(());
        };
        if self.backend.is_some() {
            return Err(ModelError::SkipPredictor {
                why: "predictive layer skip runs on the CPU backend only".into(),
            });
        }
        let hp = &self.model.hp;
        let pm = &pol.predictor.model;
        if pm.n_layer != hp.n_layer || pm.d_model != hp.d_model {
            return Err(ModelError::SkipPredictor {
                why: format!(
                    "made for {} layers of width {}, this model has {} of width {}",
                    pm.n_layer, pm.d_model, hp.n_layer, hp.d_model
                ),
            });
        }
        let range = self.model.layer_range.clone();
        let e = if range.start > 0 {
            range.start
        } else {
            pol.predictor.decision_layer
        };
        st.decide_at = (e < range.end).then(|| e - range.start);
        let nl = range.len();
        st.plan = vec![false; nl];
        st.rows = vec![RUN; self.max_batch * nl];
        st.row_skip = vec![false; self.max_batch];
        st.feats = vec![0.0; pol.predictor.rank];
        st.saved = vec![0.0; self.max_batch * hp.d_model];
        self.skip = Some(pol);
        Ok(())
    }

    /// The skip policy in use.
    pub fn skip_policy(&self) -> Option<&SkipPolicy> {
        self.skip.as_ref()
    }

    /// Counters of skipping since the runner was made or `reset_skip_stats`.
    pub fn skip_stats(&self) -> SkipStats {
        self.skip_state.stats
    }

    pub fn reset_skip_stats(&mut self) {
        self.skip_state.stats = SkipStats::default();
    }

    /// The plan of the current batch: `plan[k]` is true when every token of the batch skips
    /// layer `layer_range.start + k`, so that layer is not run (its weights not read). Set at
    /// the decision point, before any layer it covers runs; all false before the decision
    /// point, without skip, or for layers nobody skips.
    pub fn skip_plan(&self) -> &[bool] {
        &self.skip_state.plan
    }

    /// Calls `hook(first, plan)` at each batch's decision point, before the layers of the
    /// plan run: `plan[k]` is true when layer `first + k` will not run at all for this batch
    /// (see `skip_plan`). For a streaming reader: layers it need not fetch.
    pub fn set_on_skip_plan(&mut self, hook: Option<SkipPlanHook>) {
        self.on_skip_plan = hook;
    }

    /// The decisions for layers `i..` of the slice (state `x` entering layer `i`), per row:
    /// skip where P(skip) ≥ confidence, at most `max_skip` layers in a row, never at position
    /// 0; then the batch's plan and its hook.
    pub(super) fn plan_skips(&mut self, x: &[f32], n: usize, i: usize) {
        let Some(pol) = self.skip.as_ref() else {
            return;
        };
        let m = &self.model;
        let (d, nl, start) = (m.hp.d_model, m.layers.len(), m.layer_range.start);
        let st = &mut self.skip_state;
        let pred = &pol.predictor;
        for r in 0..n {
            let rows = &mut st.rows[r * nl..(r + 1) * nl];
            rows.fill(RUN);
            // A sequence's first token is the attention sink every later token leans on (its
            // state barely changes, yet masking its keys hurts every later token): it always
            // runs every layer.
            if self.scratch.pos[r] == 0 {
                continue;
            }
            if pol.force.is_none() {
                pred.features(&x[r * d..(r + 1) * d], &mut st.feats);
            }
            let mut run = 0;
            for (j, cell) in rows.iter_mut().enumerate().skip(i) {
                let p = match &pol.force {
                    Some(f) => f32::from(u8::from(f(self.scratch.pos[r], start + j))),
                    None => pred.prob(&st.feats, start + i, start + j),
                };
                if p >= pol.confidence && run < pol.max_skip {
                    *cell = SKIP;
                    run += 1;
                } else {
                    run = 0;
                    if p >= 0.5 && p < pol.confidence {
                        *cell = DOUBT;
                    }
                }
            }
        }
        for (j, all) in st.plan.iter_mut().enumerate() {
            *all = j >= i && (0..n).all(|r| st.rows[r * nl + j] == SKIP);
        }
        st.active = true;
        if let Some(hook) = self.on_skip_plan.as_mut() {
            hook(start, &st.plan);
        }
    }

    /// Layer `il` (index `i` of the slice) with this batch's decisions: not run at all when
    /// every row skips it (their KV slots marked as holding nothing); else run, with the
    /// skipping rows' slots marked before attention and their residual rows restored after.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_with_skips(
        &mut self,
        m: &Model,
        il: usize,
        i: usize,
        l: &Layer,
        buf: Option<&LayerGuard<'_>>,
        x: &mut [f32],
        n: usize,
        segs: &mut [Seg<'_>],
        observer: Option<&mut (dyn Observer + '_)>,
    ) -> Result<(), ModelError> {
        let d = m.hp.d_model;
        let nl = m.layers.len();
        let st = &mut self.skip_state;
        st.stats.evaluations += n as u64;
        let cell = |r: usize| st.rows[r * nl + i];
        let skipped = (0..n).filter(|&r| cell(r) == SKIP).count();
        st.stats.skipped += skipped as u64;
        st.stats.skipped_weight_bytes += (skipped * l.weight_bytes()) as u64;
        if st.plan[i] {
            for seg in segs.iter_mut() {
                for t in 0..seg.n {
                    let slot = seg.kv.slot(seg.pos + t);
                    seg.kv.mark_skipped(slot);
                }
            }
            st.stats.layers_not_run += 1;
            st.stats.bytes_not_read += l.weight_bytes() as u64;
            return Ok(());
        }
        for r in (0..n).filter(|&r| cell(r) != RUN) {
            st.saved[r * d..(r + 1) * d].copy_from_slice(&x[r * d..(r + 1) * d]);
        }
        let mut row_skip = std::mem::take(&mut st.row_skip);
        for (r, s) in row_skip[..n].iter_mut().enumerate() {
            *s = cell(r) == SKIP;
        }
        let ran = self.layer(
            m,
            il,
            l,
            buf,
            x,
            n,
            segs,
            (skipped > 0).then_some(&row_skip[..n]),
            observer,
        );
        let st = &mut self.skip_state;
        st.row_skip = row_skip;
        ran?;
        for r in (0..n).filter(|&r| st.rows[r * nl + i] != RUN) {
            let before = &st.saved[r * d..(r + 1) * d];
            if st.rows[r * nl + i] == SKIP {
                x[r * d..(r + 1) * d].copy_from_slice(before);
            } else {
                st.stats.doubted += 1;
                let c = cosine(before, &x[r * d..(r + 1) * d]);
                tracing::debug!(
                    layer = il,
                    pos = self.scratch.pos[r],
                    cos = c,
                    "layer run although the skip predictor leaned to skipping it"
                );
            }
        }
        Ok(())
    }
}
