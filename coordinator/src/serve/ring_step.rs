//! The scheduler's stepper over a ring: the coordinator embeds, runs its local layers and the
//! head; every step's sequences travel the ring together as one batch (one frame each, one
//! pass per node). After a failure the ring is rebuilt over the nodes still there on the next
//! step; while idle, the nodes' heartbeats are checked every second, so a node lost between
//! requests is noticed (and the ring rebuilt) before the next request comes.

use super::scheduler::{embed_feeds, head_logits, layers_for_feeds, Feed, Stepper};
use super::Health;
use crate::cluster::probe;
use crate::cluster::ring::{Part, Ring};
use crate::engine::RingMode;
use anyhow::{anyhow, Result};
use ringllm_model::{KvCache, KvType, Runner};
use std::time::{Duration, Instant};

/// How long a client is told to wait (`Retry-After`) while the ring is down, and how often an
/// idle server tries to rebuild it.
const REBUILD_EVERY: Duration = Duration::from_secs(5);

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
    /// Why the ring went down, until it is rebuilt.
    down: Option<String>,
    /// Nodes left out of the ring (or not answering while it is down), as "name (address)".
    missing: Vec<String>,
    /// When an idle server last tried to rebuild the ring.
    last_attempt: Option<Instant>,
    /// The handshake probe of the missing nodes under way: the names of those that answer.
    probing: Option<std::thread::JoinHandle<Vec<String>>>,
}

impl RingStepper {
    pub fn new(mut mode: RingMode, slots: usize) -> Result<RingStepper> {
        let ctx = mode.args.ctx.unwrap_or(4096);
        let kv = mode.args.kv;
        // Nodes that do not answer yet are left out (unless they hold pinned layers) and
        // taken in when they come (`idle`).
        let (runner, _) = mode.build(true, slots)?;
        let ring = mode.ring.take();
        let local = (0..slots).map(|_| runner.new_cache(ctx, kv)).collect();
        let missing = missing_nodes(&mode, ring.as_ref());
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
            down: None,
            missing,
            last_attempt: None,
            probing: None,
        })
    }

    fn rebuild(&mut self) -> Result<()> {
        notice!("[rebuilding the ring over the nodes still there]");
        self.last_attempt = Some(Instant::now());
        self.lens = vec![0; self.slots];
        let (runner, _) = match self.mode.build(true, self.slots) {
            Ok(r) => r,
            Err(e) => {
                self.down = Some(format!("{e:#}"));
                self.missing = missing_nodes(&self.mode, None);
                return Err(e);
            }
        };
        self.ring = self.mode.ring.take();
        self.local = (0..self.slots)
            .map(|_| runner.new_cache(self.ctx, self.kv))
            .collect();
        self.runner = runner;
        self.missing = missing_nodes(&self.mode, self.ring.as_ref());
        self.down = None;
        let nodes = self.ring.as_ref().map_or(0, |r| r.node_names().len());
        notice!("[the ring is up again: {nodes} node(s)]");
        if !self.missing.is_empty() {
            notice!("[without {}]", self.missing.join(", "));
        }
        Ok(())
    }

    /// While idle with a ring that runs without some of its nodes: every `REBUILD_EVERY`,
    /// asks them for a handshake (on a thread of its own: the server keeps answering
    /// meanwhile), and when one finishes it rebuilds the ring to take it back (the caches of
    /// finished sequences are emptied: their next turn is computed anew). A frozen node, a
    /// node with another key or version, or another program on its port never finishes the
    /// handshake, so the working ring is left alone. True when it rebuilt.
    fn take_back_returned_nodes(&mut self) -> bool {
        if let Some(p) = self.probing.take() {
            if !p.is_finished() {
                self.probing = Some(p);
                return false;
            }
            // A ring rebuilt meanwhile (after a failure) may already hold these nodes: only
            // those still missing are taken back, or a working ring would be torn down for
            // nothing.
            let back: Vec<String> = p
                .join()
                .unwrap_or_default()
                .into_iter()
                .filter(|n| {
                    self.missing.iter().any(|m| {
                        m.strip_prefix(n.as_str())
                            .is_some_and(|r| r.starts_with(" ("))
                    })
                })
                .collect();
            return self.take_back(&back);
        }
        if self.missing.is_empty()
            || self
                .last_attempt
                .is_some_and(|t| t.elapsed() < REBUILD_EVERY)
        {
            return false;
        }
        self.last_attempt = Some(Instant::now());
        let candidates: Vec<(String, String)> = self
            .mode
            .spec
            .stages
            .iter()
            .filter_map(|s| Some((s.name.clone(), s.address.clone()?)))
            .filter(|(n, a)| self.missing.iter().any(|m| *m == format!("{n} ({a})")))
            .collect();
        let key = self.mode.spec.key.clone();
        self.probing = std::thread::Builder::new()
            .name("take-back probe".into())
            .spawn(move || {
                let addrs: Vec<String> = candidates.iter().map(|(_, a)| a.clone()).collect();
                let answers = probe::handshake_all(&addrs, &key, probe::QUICK_PROBE_DEADLINE);
                candidates
                    .into_iter()
                    .zip(answers)
                    .filter_map(|((n, a), r)| match r {
                        Ok(()) => Some(n),
                        Err(why) => {
                            tracing::debug!("{n} ({a}) is not back: {why}");
                            None
                        }
                    })
                    .collect()
            })
            .map_err(|e| tracing::warn!("cannot start the take-back probe: {e}"))
            .ok();
        false
    }

    /// Rebuilds the ring to take back the nodes `back` (they just finished the handshake).
    fn take_back(&mut self, back: &[String]) -> bool {
        if back.is_empty() {
            return false;
        }
        tracing::info!(nodes = ?back, "nodes are back; rebuilding the ring");
        notice!("[{} back: taking it into the ring]", back.join(", "));
        if let Some(old) = self.ring.take() {
            old.shutdown("re-planning with a node that came back");
        }
        if let Err(e) = self.rebuild() {
            notice!(
                "[the ring is down: {e:#}; trying again in {} s]",
                REBUILD_EVERY.as_secs()
            );
        }
        true
    }

    /// Drops the ring after a failure (it is rebuilt on the next step).
    fn lost(&mut self, why: &anyhow::Error) {
        self.mode.note_failure(why);
        self.pending.clear();
        if let Some(old) = self.ring.take() {
            old.shutdown("failure");
        }
        self.down = Some(format!("{why:#}"));
    }
}

/// The cluster's nodes that are not in `ring`: every node when it is `None`, but only those
/// that do not finish the handshake are named then (the others may be fine).
fn missing_nodes(mode: &RingMode, ring: Option<&Ring>) -> Vec<String> {
    let stages = mode.spec.stages.iter();
    let remote = stages.filter_map(|s| Some((s.name.as_str(), s.address.as_deref()?)));
    match ring {
        Some(r) => {
            let there: Vec<String> = r.node_names().into_iter().map(|(_, a)| a).collect();
            remote
                .filter(|(_, a)| !there.iter().any(|t| t == a))
                .map(|(n, a)| format!("{n} ({a})"))
                .collect()
        }
        None => {
            let remote: Vec<(&str, &str)> = remote.collect();
            let addrs: Vec<String> = remote.iter().map(|(_, a)| a.to_string()).collect();
            let answers = probe::handshake_all(&addrs, &mode.spec.key, probe::PROBE_DEADLINE);
            remote
                .iter()
                .zip(answers)
                .filter(|(_, r)| r.is_err())
                .map(|((n, a), _)| format!("{n} ({a})"))
                .collect()
        }
    }
}

impl Stepper for RingStepper {
    fn cluster(&self) -> Option<crate::cluster::status::ClusterView> {
        let spec = &self.mode.spec;
        Some(crate::cluster::status::ClusterView {
            key: spec.key.clone(),
            nodes: spec
                .stages
                .iter()
                .filter_map(|s| Some((s.name.clone(), s.address.clone()?)))
                .collect(),
        })
    }

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
            self.lost(&e);
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
            self.lost(&e);
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
            self.lost(&e);
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
            self.down.get_or_insert_with(|| "a step failed".into());
        }
    }

    fn health(&self) -> Option<Health> {
        let nodes = self.ring.as_ref().map_or_else(Vec::new, |r| {
            r.node_names()
                .into_iter()
                .map(|(n, a)| format!("{n} ({a})"))
                .collect()
        });
        let error = match (&self.down, self.missing.is_empty()) {
            (Some(why), _) => Some(why.clone()),
            (None, false) => Some(format!("the ring runs without {}", self.missing.join(", "))),
            (None, true) => None,
        };
        Some(Health {
            ready: self.ring.is_some(),
            nodes,
            missing: self.missing.clone(),
            error,
        })
    }

    fn idle(&mut self) -> bool {
        if let Some(ring) = self.ring.as_mut() {
            let Err(e) = ring.check_health() else {
                return self.take_back_returned_nodes();
            };
            tracing::warn!("the ring lost a node while idle: {e:#}");
            notice!("[a node was lost: {e:#}]");
            self.lost(&e);
        } else if self
            .last_attempt
            .is_some_and(|t| t.elapsed() < REBUILD_EVERY)
        {
            return false;
        }
        if let Err(e) = self.rebuild() {
            notice!(
                "[the ring is down: {e:#}; trying again in {} s]",
                REBUILD_EVERY.as_secs()
            );
        }
        true
    }

    fn retry_after_s(&self) -> Option<u64> {
        Some(REBUILD_EVERY.as_secs())
    }

    fn len(&self, slot: usize) -> usize {
        self.lens.get(slot).copied().unwrap_or(0)
    }

    fn truncate(&mut self, slot: usize, len: usize) -> bool {
        let Some(&cur) = self.lens.get(slot) else {
            return false;
        };
        if len > cur {
            return false;
        }
        let ok = ringllm_model::kv::can_truncate(
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
