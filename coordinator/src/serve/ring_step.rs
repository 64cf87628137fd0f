//! The scheduler's stepper over a ring: the coordinator embeds, runs its local layers and the
//! head; every step's sequences travel the ring together as one batch (one frame each, one
//! pass per node). After a failure the ring is rebuilt over the nodes still there on the next
//! step.

use super::scheduler::{embed_feeds, head_logits, layers_for_feeds, Feed, Stepper};
use crate::cluster::ring::{Part, Ring};
use crate::engine::RingMode;
use anyhow::{anyhow, Result};
use ringllm_node::{KvCache, KvType, Runner};

/// A batch in the ring: its parts, which want logits, its rows.
type InFlight = (Vec<Part>, Vec<bool>, Vec<f32>);

pub struct RingStepper {
    mode: RingMode,
    ring: Option<Ring>,
    runner: Runner,
    local: Vec<KvCache>,
    lens: Vec<usize>,
    slots: usize,
    ctx: usize,
    kv: KvType,
    x: Vec<f32>,
    rows: Vec<f32>,
    node_logits: Vec<f32>,
    /// Batches sent and not yet collected.
    pending: std::collections::VecDeque<InFlight>,
}

impl RingStepper {
    pub fn new(mut mode: RingMode, slots: usize) -> Result<RingStepper> {
        let ctx = mode.args.ctx.unwrap_or(4096);
        let kv = mode.args.kv;
        let (runner, _) = mode.build(false, slots)?;
        let ring = mode.ring.take();
        let local = (0..slots).map(|_| runner.new_cache(ctx, kv)).collect();
        Ok(RingStepper {
            mode,
            ring,
            runner,
            local,
            lens: vec![0; slots],
            slots,
            ctx,
            kv,
            x: Vec::new(),
            rows: Vec::new(),
            node_logits: Vec::new(),
            pending: Default::default(),
        })
    }

    fn rebuild(&mut self) -> Result<()> {
        eprintln!("[rebuilding the ring over the nodes still there]");
        let (runner, _) = self.mode.build(true, self.slots)?;
        self.ring = self.mode.ring.take();
        self.local = (0..self.slots)
            .map(|_| runner.new_cache(self.ctx, self.kv))
            .collect();
        self.runner = runner;
        self.lens = vec![0; self.slots];
        Ok(())
    }
}

impl Stepper for RingStepper {
    fn step(&mut self, feeds: &[Feed], logits: &mut Vec<f32>) -> Result<()> {
        if self.ring.is_none() {
            self.rebuild()?;
            // Every slot starts over: a feed that continues an old sequence cannot run.
            if feeds.iter().any(|f| self.lens[f.slot] != 0) {
                anyhow::bail!("the ring was rebuilt; running sequences were lost");
            }
        }
        let d = self.mode.hp.d_model;
        let vocab = self.mode.hp.vocab;
        let n = embed_feeds(&self.runner, feeds, &mut self.x)?;
        let parts: Vec<Part> = feeds
            .iter()
            .map(|f| Part {
                seq: f.slot as u64,
                pos: self.lens[f.slot],
                n_tokens: f.tokens.len(),
            })
            .collect();
        let (runner, local) = (&mut self.runner, &mut self.local);
        let mut run_local = |x: &mut [f32]| layers_for_feeds(runner, local, feeds, x);
        let ring = self
            .ring
            .as_mut()
            .ok_or_else(|| anyhow!("the ring is down"))?;
        let r = ring.forward_multi(
            &parts,
            &mut self.x[..n * d],
            d,
            &mut self.node_logits,
            &mut run_local,
        );
        if let Err(e) = r {
            if let Some(old) = self.ring.take() {
                old.shutdown("failure");
            }
            return Err(e);
        }
        let head_on_node = ring.head_on_node;
        for f in feeds {
            self.lens[f.slot] += f.tokens.len();
            // Local layers advanced their own caches; keep them in step when there are none.
            let c = &mut self.local[f.slot];
            c.len = self.lens[f.slot];
        }
        logits.clear();
        if head_on_node {
            for (k, f) in feeds.iter().enumerate() {
                if f.want_logits {
                    logits.extend_from_slice(&self.node_logits[k * vocab..(k + 1) * vocab]);
                }
            }
            return Ok(());
        }
        head_logits(
            &mut self.runner,
            &self.x[..n * d],
            feeds.iter().map(|f| (f.tokens.len(), f.want_logits)),
            &mut self.rows,
            logits,
        )
    }

    fn depth(&self) -> usize {
        match &self.ring {
            Some(r) if r.pipelinable() => r.node_names().len() + 1,
            _ => 1,
        }
    }

    fn submit(&mut self, feeds: &[Feed]) -> Result<()> {
        if self.ring.is_none() {
            self.rebuild()?;
        }
        let d = self.mode.hp.d_model;
        let mut x = Vec::new();
        embed_feeds(&self.runner, feeds, &mut x)?;
        let parts: Vec<Part> = feeds
            .iter()
            .map(|f| Part {
                seq: f.slot as u64,
                pos: self.lens[f.slot],
                n_tokens: f.tokens.len(),
            })
            .collect();
        let ring = self
            .ring
            .as_mut()
            .ok_or_else(|| anyhow!("the ring is down"))?;
        if let Err(e) = ring.send_batch(&parts, &x, d) {
            self.abort();
            return Err(e);
        }
        for f in feeds {
            self.lens[f.slot] += f.tokens.len();
            self.local[f.slot].len = self.lens[f.slot];
        }
        let want = feeds.iter().map(|f| f.want_logits).collect();
        self.pending.push_back((parts, want, x));
        Ok(())
    }

    fn collect(&mut self, logits: &mut Vec<f32>) -> Result<()> {
        let (parts, want, mut x) = self
            .pending
            .pop_front()
            .ok_or_else(|| anyhow!("no batch in flight"))?;
        let d = self.mode.hp.d_model;
        let vocab = self.mode.hp.vocab;
        let ring = self
            .ring
            .as_mut()
            .ok_or_else(|| anyhow!("the ring is down"))?;
        if let Err(e) = ring.recv_batch(&parts, &mut x, d, &mut self.node_logits) {
            self.abort();
            return Err(e);
        }
        logits.clear();
        if ring.head_on_node {
            for (k, w) in want.iter().enumerate() {
                if *w {
                    logits.extend_from_slice(&self.node_logits[k * vocab..(k + 1) * vocab]);
                }
            }
            return Ok(());
        }
        head_logits(
            &mut self.runner,
            &x,
            parts.iter().zip(&want).map(|(p, w)| (p.n_tokens, *w)),
            &mut self.rows,
            logits,
        )
    }

    fn abort(&mut self) {
        self.pending.clear();
        if let Some(old) = self.ring.take() {
            old.shutdown("failure");
        }
    }

    fn len(&self, slot: usize) -> usize {
        self.lens.get(slot).copied().unwrap_or(0)
    }

    fn truncate(&mut self, slot: usize, len: usize) -> bool {
        let Some(&cur) = self.lens.get(slot) else {
            return false;
        };
        let ok = ringllm_node::kv::can_truncate(
            &self.mode.hp,
            self.ctx,
            self.runner.max_batch(),
            cur,
            len,
        );
        if ok {
            self.lens[slot] = self.lens[slot].min(len);
            self.local[slot].truncate(len);
        }
        ok
    }

    fn vocab(&self) -> usize {
        self.mode.hp.vocab
    }

    fn slots(&self) -> usize {
        self.slots
    }

    fn max_batch(&self) -> usize {
        self.runner.max_batch()
    }
}
