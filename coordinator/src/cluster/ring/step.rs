//! One pass of hidden states through the ring: each segment of nodes is sent its rows (one
//! frame per sequence) and its output read back, local layers run in between; a ring of
//! nodes alone can have several batches in flight (`send_batch` / `recv_batch`).

use super::{Part, Ring, Stage, CAUSE_WAIT};
use anyhow::{anyhow, bail, Context, Result};
use ringllm_protocol::activations;
use ringllm_protocol::frame::{with_round, FLAG_MORE};
use ringllm_protocol::{FrameHeader, FrameKind};
use std::time::Duration;

/// How long a wait for a node's output blocks before the control connections are looked at:
/// a node that died mid-pass (and the answer to resume) is noticed through them within this.
const DATA_POLL: Duration = Duration::from_millis(50);

impl Ring {
    /// Runs one chunk through the ring: `x` holds `n` embedded rows of `d`; on return it holds
    /// the last stage's hidden states, or (head on a node) `logits` holds the last token's
    /// logits. `local` runs the coordinator's own layers when its stage comes.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        seq: u64,
        pos: usize,
        x: &mut [f32],
        n: usize,
        d: usize,
        logits: &mut [f32],
        local: &mut dyn FnMut(&mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let mut l = std::mem::take(&mut self.logits_buf);
        let r = self.forward_multi(
            &[Part {
                seq,
                pos,
                n_tokens: n,
            }],
            x,
            d,
            &mut l,
            local,
        );
        if r.is_ok() && self.head_on_node {
            let v = self.vocab;
            logits[..v].copy_from_slice(&l[..v]);
        }
        self.logits_buf = l;
        r
    }

    /// Runs a batch of sequences through the ring as one pass per stage: `parts[i]` is one
    /// sequence's tokens, and `x` holds their embedded rows in order. On return
    /// `x` holds the last stage's hidden states, or (head on a node) `logits` holds each
    /// part's last-token logits, in order.
    pub fn forward_multi(
        &mut self,
        parts: &[Part],
        x: &mut [f32],
        d: usize,
        logits: &mut Vec<f32>,
        local: &mut dyn FnMut(&mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let n: usize = parts.iter().map(|p| p.n_tokens).sum();
        let stages = self.stages.clone();
        // A multi-round ring: the token goes round `rounds` times, relayed here between rounds
        // (a round trip more per round, small against the disk reads such a ring waits for).
        for round in 0..self.rounds.max(1) {
            let mut seg = 0usize;
            for st in &stages {
                match st {
                    Stage::Local { .. } => local(&mut x[..n * d])?,
                    Stage::Segment { first, last } => {
                        self.send_segment(seg, *first, parts, x, d, round)?;
                        self.recv_segment(seg, *last, parts, x, d, logits)?;
                        seg += 1;
                    }
                }
            }
        }
        Ok(())
    }

    /// True when the ring is one run of nodes (no local layers): then a batch can be sent
    /// with `send_batch` and its result taken later with `recv_batch`, and several batches
    /// can be in the ring at once.
    pub fn pipelinable(&self) -> bool {
        self.rounds <= 1 && matches!(self.stages.as_slice(), [Stage::Segment { .. }])
    }

    /// Sends a batch into a pipelinable ring.
    pub fn send_batch(&mut self, parts: &[Part], x: &[f32], d: usize) -> Result<()> {
        match self.stages.first() {
            Some(&Stage::Segment { first, .. }) if self.stages.len() == 1 => {
                self.send_segment(0, first, parts, x, d, 0)
            }
            _ => bail!("this ring has local layers: batches cannot be pipelined"),
        }
    }

    /// Takes the result of the oldest batch sent with `send_batch`.
    pub fn recv_batch(
        &mut self,
        parts: &[Part],
        x: &mut [f32],
        d: usize,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        match self.stages.first() {
            Some(&Stage::Segment { last, .. }) if self.stages.len() == 1 => {
                self.recv_segment(0, last, parts, x, d, logits)
            }
            _ => bail!("this ring has local layers: batches cannot be pipelined"),
        }
    }

    /// Writes one frame per part into segment `seg` (all but the last flagged MORE).
    fn send_segment(
        &mut self,
        seg: usize,
        first: usize,
        parts: &[Part],
        x: &[f32],
        d: usize,
        round: usize,
    ) -> Result<()> {
        let who_first = self.who(first);
        let mut payload = std::mem::take(&mut self.scratch);
        let mut row = 0;
        for (
            k,
            &Part {
                seq,
                pos,
                n_tokens: m,
            },
        ) in parts.iter().enumerate()
        {
            activations::encode(self.activations, &x[row * d..(row + m) * d], &mut payload)?;
            row += m;
            let flags = with_round(if k + 1 < parts.len() { FLAG_MORE } else { 0 }, round);
            let h = FrameHeader::new(
                FrameKind::Hidden,
                self.activations,
                seq,
                pos as u32,
                m as u32,
                flags,
                &payload,
            )?;
            let links = self
                .links
                .get_mut(seg)
                .ok_or_else(|| anyhow!("no data link for segment {seg}"))?;
            if let Err(e) = links.input.send(&h, &payload) {
                self.cause_within(CAUSE_WAIT)?;
                bail!("{who_first}: sending the hidden state failed: {e}");
            }
        }
        self.scratch = payload;
        Ok(())
    }

    /// Reads segment `seg`'s output for `parts` into `x` (or `logits`).
    fn recv_segment(
        &mut self,
        seg: usize,
        last: usize,
        parts: &[Part],
        x: &mut [f32],
        d: usize,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let who_last = self.who(last);
        let mut payload = std::mem::take(&mut self.scratch);
        let mut row = 0;
        for (
            k,
            &Part {
                seq,
                pos,
                n_tokens: m,
            },
        ) in parts.iter().enumerate()
        {
            let h = loop {
                let links = self
                    .links
                    .get_mut(seg)
                    .ok_or_else(|| anyhow!("no data link for segment {seg}"))?;
                let out = links.output.as_mut().unwrap_or(&mut links.input);
                match out.recv_timeout(&mut payload, DATA_POLL) {
                    Ok(Some(h)) => break h,
                    Ok(None) => self.check_health()?,
                    Err(e) => {
                        // A closed data link usually means the node died or is shutting
                        // down: its control connection says which, if it says anything.
                        self.cause_within(CAUSE_WAIT)?;
                        let why = if e.is_closed() {
                            "closed the data link (process stopped?)".to_string()
                        } else {
                            e.to_string()
                        };
                        bail!("{who_last} {why}");
                    }
                }
            };
            if h.seq != seq || h.pos as usize != pos {
                bail!(
                    "{who_last}: output for sequence {} position {}, expected {seq} at {pos}",
                    h.seq,
                    h.pos
                );
            }
            match h.kind {
                FrameKind::Hidden => {
                    activations::decode(h.dtype, &payload, &mut x[row * d..(row + m) * d])
                        .with_context(|| who_last.clone())?;
                }
                FrameKind::Logits => {
                    let v = self.vocab;
                    if payload.len() != v * 2 {
                        bail!(
                            "{who_last}: logits frame of {} bytes, expected {}",
                            payload.len(),
                            v * 2
                        );
                    }
                    logits.resize((k + 1) * v, 0.0);
                    for (o, c) in logits[k * v..(k + 1) * v]
                        .iter_mut()
                        .zip(payload.chunks_exact(2))
                    {
                        *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
                    }
                }
                FrameKind::Control | FrameKind::Slice => {
                    bail!("{who_last}: {:?} frame on a data link", h.kind)
                }
            }
            row += m;
        }
        self.scratch = payload;
        Ok(())
    }
}
