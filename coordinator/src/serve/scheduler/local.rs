//! The stepper that runs the whole model in this process, and the runner helpers it shares
//! with the ring's stepper (`ring_step`).

use super::{Feed, Stepper};
use anyhow::Result;

/// The output head over the last row of every part that wants logits: `parts` gives each
/// part's row count and whether it wants logits, in the order of `x`'s rows; the logits land
/// in `logits`, one `vocab` row per wanting part.
pub fn head_logits(
    runner: &mut ringllm_model::Runner,
    x: &[f32],
    parts: impl Iterator<Item = (usize, bool)>,
    rows: &mut Vec<f32>,
    logits: &mut Vec<f32>,
) -> Result<()> {
    let d = runner.model.hp.d_model;
    let vocab = runner.model.hp.vocab;
    rows.clear();
    let mut row = 0;
    for (n, want) in parts {
        row += n;
        if want {
            rows.extend_from_slice(&x[(row - 1) * d..row * d]);
        }
    }
    let k = rows.len() / d;
    if k > 0 {
        runner.final_norm(rows, k)?;
        logits.resize(k * vocab, 0.0);
        runner.logits(rows, k, logits)?;
    }
    Ok(())
}

/// Embeds every feed's tokens, in order, into `x` (resized to the rows); returns the rows.
pub fn embed_feeds(
    runner: &ringllm_model::Runner,
    feeds: &[Feed],
    x: &mut Vec<f32>,
) -> Result<usize> {
    let d = runner.model.hp.d_model;
    let n: usize = feeds.iter().map(|f| f.tokens.len()).sum();
    x.resize(n * d, 0.0);
    let flat: Vec<u32> = feeds
        .iter()
        .flat_map(|f| f.tokens.iter().copied())
        .collect();
    runner.embed(&flat, &mut x[..n * d])?;
    Ok(n)
}

/// Runs `runner`'s layers over the feeds' rows of `x`, each with its slot's cache from
/// `caches` (slots in one step are distinct).
pub fn layers_for_feeds(
    runner: &mut ringllm_model::Runner,
    caches: &mut [ringllm_model::KvCache],
    feeds: &[Feed],
    x: &mut [f32],
) -> Result<()> {
    let mut refs: Vec<Option<&mut ringllm_model::KvCache>> = caches.iter_mut().map(Some).collect();
    let mut parts = Vec::with_capacity(feeds.len());
    for f in feeds {
        let c = refs
            .get_mut(f.slot)
            .and_then(|c| c.take())
            .ok_or_else(|| anyhow::anyhow!("slot {} twice in one step", f.slot))?;
        parts.push((c, f.tokens.len()));
    }
    runner.layers_multi(x, &mut parts, None)?;
    Ok(())
}

/// The whole model in this process.
pub struct LocalStepper {
    runner: ringllm_model::Runner,
    caches: Vec<ringllm_model::KvCache>,
    x: Vec<f32>,
    rows: Vec<f32>,
}

impl LocalStepper {
    pub fn new(
        runner: ringllm_model::Runner,
        slots: usize,
        ctx: usize,
        kv: ringllm_model::KvType,
    ) -> LocalStepper {
        let caches = (0..slots.max(1))
            .map(|_| runner.new_cache(ctx, kv))
            .collect();
        LocalStepper {
            runner,
            caches,
            x: Vec::new(),
            rows: Vec::new(),
        }
    }
}

impl Stepper for LocalStepper {
    fn step(&mut self, feeds: &[Feed], logits: &mut Vec<f32>) -> Result<()> {
        let d = self.runner.model.hp.d_model;
        let n = embed_feeds(&self.runner, feeds, &mut self.x)?;
        layers_for_feeds(
            &mut self.runner,
            &mut self.caches,
            feeds,
            &mut self.x[..n * d],
        )?;
        // The last row of every feed that wants logits, normed, in one head product.
        head_logits(
            &mut self.runner,
            &self.x[..n * d],
            feeds.iter().map(|f| (f.tokens.len(), f.want_logits)),
            &mut self.rows,
            logits,
        )?;
        Ok(())
    }

    fn len(&self, slot: usize) -> usize {
        self.caches.get(slot).map_or(0, |c| c.len)
    }

    fn truncate(&mut self, slot: usize, len: usize) -> bool {
        match self.caches.get_mut(slot) {
            Some(c) if c.can_truncate_to(len) => {
                c.truncate(len);
                true
            }
            _ => false,
        }
    }

    fn vocab(&self) -> usize {
        self.runner.model.hp.vocab
    }

    fn slots(&self) -> usize {
        self.caches.len()
    }

    fn max_batch(&self) -> usize {
        self.runner.max_batch()
    }
}
