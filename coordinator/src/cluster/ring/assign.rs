//! Starting a planned ring: send the slices nodes lack, assign every node its layers, wait
//! until all have loaded them, connect the data links, and start the heartbeats.

use super::events::LOADING_PROBE_EVERY;
use super::{
    Ring, RingSpec, SegmentLinks, Sizing, Stage, CONNECT_TIMEOUT, HEARTBEAT_INTERVAL, READY_TIMEOUT,
};
use crate::cluster::planner;
use crate::cluster::probe::PROBE_DEADLINE;
use crate::progress;
use anyhow::{bail, Result};
use ringllm_model::gguf::GgufFile;
use ringllm_protocol::control::{
    Assignment, Control, Input, ModelIdentity, NextHop, Ready, StageLayout,
};
use ringllm_protocol::dial::{self, BoxLink, LinkRole};
use ringllm_protocol::frame::COORDINATOR_MAX_PAYLOAD;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

impl Ring {
    /// Sends the nodes that lack the model their slices (unless `spec.send_slices` is off),
    /// loads every node's slice (its runner and KV caches sized by `sizing`) and waits until
    /// all are ready.
    pub fn assign(
        &mut self,
        spec: &RingSpec,
        file: &Arc<GgufFile>,
        identity: &ModelIdentity,
        sizing: &Sizing,
    ) -> Result<()> {
        if spec.send_slices {
            self.sent = self.send_slices(spec, identity, file)?;
        }
        self.session =
            (self.t0.elapsed().as_nanos() as u64) ^ ((std::process::id() as u64) << 40) ^ 0x5eed;
        self.activations = spec.activations;
        let assigned = self.send_assignments(spec, identity, sizing)?;
        // From its assignment on, a node drops a coordinator silent for COORDINATOR_SILENCE
        // (5 s), and loading a slice from a cold disk can take longer than that: heartbeats
        // start now, not once every node is ready.
        self.start_heartbeats();
        self.wait_ready(&assigned)?;
        self.links = self.connect_data_links(spec)?;
        // Every node answered its assignment; the time spent connecting data links (seconds,
        // when SYNs are lost) was our silence, not theirs: count from now.
        let now = self.t0.elapsed().as_millis() as u64;
        for n in &self.nodes {
            n.last_seen.store(now, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Sends every node of every segment its assignment; returns the nodes assigned.
    fn send_assignments(
        &self,
        spec: &RingSpec,
        identity: &ModelIdentity,
        sizing: &Sizing,
    ) -> Result<Vec<usize>> {
        // Per remote node: its layers, input and next hop, from the plan in stage order.
        let remote_plans: Vec<&planner::StagePlan> = spec
            .stages
            .iter()
            .zip(&self.plan.stages)
            .filter(|(s, _)| s.address.is_some())
            .map(|(_, p)| p)
            .collect();
        let mut assigned = Vec::new();
        for seg in &self.stages {
            let Stage::Segment { first, last } = *seg else {
                continue;
            };
            for (i, &p) in remote_plans.iter().enumerate().take(last + 1).skip(first) {
                let a = self.assignment(spec, identity, sizing, p, i, first, last);
                assigned.push(i);
                self.send_control(i, &Control::Assign(a))?;
            }
        }
        // Assign the last nodes first? Nodes connect to their next hop while loading; the next
        // hop waits for its own assignment (TAKEOVER_WAIT), so any order works.
        Ok(assigned)
    }

    /// Node `i`'s assignment: plan `p`, in the segment of nodes `first..=last`.
    #[allow(clippy::too_many_arguments)]
    fn assignment(
        &self,
        spec: &RingSpec,
        identity: &ModelIdentity,
        sizing: &Sizing,
        p: &planner::StagePlan,
        i: usize,
        first: usize,
        last: usize,
    ) -> Assignment {
        let next_hop = if i == last {
            NextHop::Coordinator
        } else {
            NextHop::Node {
                name: self.nodes[i + 1].name.clone(),
                address: self.nodes[i + 1].address.clone(),
                transport: self.nodes[i + 1].caps.transport,
            }
        };
        Assignment {
            session: self.session,
            model: identity.clone(),
            layer_start: p.layers.start as u32,
            layer_end: p.layers.end as u32,
            head: p.holds_head,
            input: if i == first {
                Input::Coordinator
            } else {
                Input::Upstream
            },
            next_hop,
            activations: spec.activations,
            kv_ctx: sizing.ctx as u32,
            kv_type: sizing.kv,
            max_batch: sizing.max_batch as u32,
            threads: spec
                .stages
                .iter()
                .filter(|s| s.address.is_some())
                .nth(i)
                .and_then(|s| s.threads)
                .unwrap_or(0) as u32,
            kv_slots: sizing.slots.max(1) as u32,
            layout: self.layout(spec, i),
        }
    }

    /// Node `i`'s layer layout: its streaming windows, and the skip predictor.
    fn layout(&self, spec: &RingSpec, i: usize) -> StageLayout {
        let mut l = self
            .streaming
            .as_ref()
            .map(|sp| sp.layout(i))
            .unwrap_or_default();
        if let Some((bytes, confidence, max_skip)) = &spec.skip {
            l.skip_predictor = bytes.to_vec();
            l.skip_confidence_ppm = (confidence * 1e6) as u32;
            l.skip_max = *max_skip as u32;
        }
        l
    }

    /// Waits until every node in `assigned` has loaded its slice, reporting each.
    fn wait_ready(&mut self, assigned: &[usize]) -> Result<()> {
        // Cleared when dropped too: an error must not leave the spinner on screen.
        let bar = progress::task(progress::Kind::Spinner);
        bar.start(
            &format!("loading slices on {} node(s)", assigned.len()),
            None,
        );
        let mut ready: Vec<Option<Ready>> = vec![None; self.nodes.len()];
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut next_probe = Instant::now() + LOADING_PROBE_EVERY;
        while assigned.iter().any(|&i| ready[i].is_none()) {
            let pending: Vec<usize> = assigned
                .iter()
                .copied()
                .filter(|&i| ready[i].is_none())
                .collect();
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let names: Vec<String> = pending.iter().map(|&i| self.who(i)).collect();
                bail!(
                    "timed out waiting for the nodes to load their slices from {} ({:.0} s)",
                    names.join(", "),
                    READY_TIMEOUT.as_secs_f64()
                );
            }
            // A node busy loading does not answer heartbeats, but its daemon still takes a
            // handshake: one that misses it has vanished (frozen, cut off).
            if Instant::now() >= next_probe {
                self.probe_nodes(&pending, PROBE_DEADLINE, " while loading its slice")?;
                next_probe = Instant::now() + LOADING_PROBE_EVERY;
            }
            let wait = left.min(next_probe.saturating_duration_since(Instant::now()));
            let Some((i, msg)) = self.control_within(wait)? else {
                continue;
            };
            match msg {
                Control::Ready(r) if r.session == self.session => {
                    notice!("  {:<12} {:<22} layers {:>2}-{:<2} weights {:>7.1} MiB  kv {:>6.1} MiB  rss {:>7.1} MiB  load {} ms",
                            self.nodes[i].name,
                            self.nodes[i].address,
                            r.layer_start,
                            r.layer_end.saturating_sub(1),
                            r.weight_bytes as f64 / 1048576.0,
                            r.kv_bytes as f64 / 1048576.0,
                            r.rss_bytes as f64 / 1048576.0,
                            r.load_ms
                    );
                    ready[i] = Some(r);
                }
                Control::Error(e) => {
                    bar.finish();
                    return Err(self.fault(i, format!("{}: {}", self.who(i), e.message)));
                }
                _ => {}
            }
        }
        bar.finish();
        self.ready = ready.into_iter().flatten().collect();
        Ok(())
    }

    /// Data links: into each segment's first node, out of its last.
    fn connect_data_links(&self, spec: &RingSpec) -> Result<Vec<SegmentLinks>> {
        let mut links = Vec::new();
        for seg in &self.stages {
            let Stage::Segment { first, last } = *seg else {
                continue;
            };
            let connect = |i: usize, role: LinkRole| -> Result<BoxLink> {
                let n = &self.nodes[i];
                let dial = dial::DialSpec {
                    kind: n.caps.transport,
                    addr: &n.address,
                    name: "coordinator",
                    timeout: CONNECT_TIMEOUT,
                    max_payload: COORDINATOR_MAX_PAYLOAD,
                    ring_session: self.session,
                    role,
                };
                self.rt
                    .block_on(dial::connect_data_link(&dial, &spec.key))
                    .map_err(|e| self.fault(i, format!("{}: data link: {e}", self.who(i))))
            };
            let input = if first == last {
                connect(first, LinkRole::InputOutput)?
            } else {
                connect(first, LinkRole::Input)?
            };
            let output = if first == last {
                None
            } else {
                Some(connect(last, LinkRole::Output)?)
            };
            links.push(SegmentLinks { input, output });
        }
        let kinds: Vec<String> = links
            .iter()
            .flat_map(|l| std::iter::once(&l.input).chain(l.output.as_ref()))
            .map(|l| l.transport().to_string())
            .collect();
        notice!("  data links: {}", kinds.join(", "));
        Ok(links)
    }

    /// A heartbeat to every node each `HEARTBEAT_INTERVAL` from now on.
    fn start_heartbeats(&self) {
        let _g = self.rt.enter();
        for n in &self.nodes {
            let out = n.out.clone();
            tokio::spawn(async move {
                let mut nonce = 1000u64;
                loop {
                    tokio::time::sleep(HEARTBEAT_INTERVAL).await;
                    nonce += 1;
                    let Ok(f) = (Control::Heartbeat {
                        nonce,
                        reply: false,
                    })
                    .to_frame() else {
                        break;
                    };
                    if out.send(f).await.is_err() {
                        break;
                    }
                }
            });
        }
    }
}
