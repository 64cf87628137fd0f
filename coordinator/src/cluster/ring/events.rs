//! What the nodes say, and whether they are well: control messages and lost links as events,
//! heartbeat watching, the cause of a failed data link, statistics, and the orderly end.

use super::{Event, Ring, HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT};
use crate::cluster::probe::{self, fault, NodeFault};
use anyhow::{bail, Result};
use ringllm_protocol::control::{Control, Stats};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Milliseconds since a node was last heard from, when that is over `HEARTBEAT_TIMEOUT`.
fn silent_too_long(t0: Instant, last_seen: &AtomicU64) -> Option<u64> {
    let now_ms = t0.elapsed().as_millis() as u64;
    let silent = now_ms.saturating_sub(last_seen.load(Ordering::Relaxed));
    (silent > HEARTBEAT_TIMEOUT.as_millis() as u64).then_some(silent)
}

/// The error of a node silent for `silent_ms`.
fn stopped_answering(who: &str, address: &str, silent_ms: u64) -> anyhow::Error {
    fault(
        address,
        format!(
            "{who} stopped answering: nothing heard for {:.1} s (link cut, machine down or \
             process frozen)",
            silent_ms as f64 / 1000.0
        ),
    )
}

/// A node silent this long on its control connection (it answers a heartbeat every
/// `HEARTBEAT_INTERVAL`, so this is one late reply) is asked for a handshake: a frozen node is
/// noticed after this and the probe's deadline, well before `HEARTBEAT_TIMEOUT`, and a live
/// one whose reply was merely late costs a connection.
const SUSPECT_AFTER: Duration =
    Duration::from_millis(HEARTBEAT_INTERVAL.as_millis() as u64 * 6 / 5);

/// How often one node is probed at most while it stays silent.
const SUSPECT_PROBE_EVERY: Duration = Duration::from_secs(1);

/// How often the nodes still loading their slices are asked for a handshake: one that
/// vanished (frozen, cut off) is noticed within this and the probe's deadline, not after
/// `READY_TIMEOUT`.
pub(super) const LOADING_PROBE_EVERY: Duration = Duration::from_secs(1);

impl Ring {
    /// The next control message from any node, failing on a lost node or after `timeout`;
    /// a timeout names the nodes in `from` (those not yet heard from).
    pub(super) fn next_control(
        &mut self,
        timeout: Duration,
        what: &str,
        from: &[usize],
    ) -> Result<(usize, Control)> {
        let deadline = Instant::now() + timeout;
        let what = if from.is_empty() {
            what.to_string()
        } else {
            let names: Vec<String> = from.iter().map(|&i| self.who(i)).collect();
            format!(
                "{what} from {} ({:.0} s)",
                names.join(", "),
                timeout.as_secs_f64()
            )
        };
        let what = what.as_str();
        let event = self.next_event(deadline, what).map_err(|e| match from {
            // A wait for one node that failed is that node's failure.
            [i] if probe::fault_of(&e).is_none() => fault(&self.nodes[*i].address, e.to_string()),
            _ => e,
        })?;
        match event {
            Event::Control { node, msg } => Ok((node, msg)),
            Event::Frame { node, h, .. } => Err(self.fault(
                node,
                format!(
                    "{}: unexpected {:?} frame while waiting for {what}",
                    self.who(node),
                    h.kind
                ),
            )),
            Event::Lost { node, why } => Err(self.fault(node, format!("{} {why}", self.who(node)))),
        }
    }

    /// An error pinned on node `i`.
    pub(super) fn fault(&self, i: usize, message: String) -> anyhow::Error {
        match self.nodes.get(i) {
            Some(n) => fault(&n.address, message),
            None => anyhow::anyhow!(message),
        }
    }

    /// The next control message within `wait`, or `None` when none came; a lost node or a
    /// stray frame fails, pinned on its node.
    pub(super) fn control_within(&mut self, wait: Duration) -> Result<Option<(usize, Control)>> {
        match self.poll_event(wait)? {
            None => Ok(None),
            Some(Event::Control { node, msg }) => Ok(Some((node, msg))),
            Some(Event::Frame { node, h }) => Err(self.fault(
                node,
                format!("{}: unexpected {:?} frame", self.who(node), h.kind),
            )),
            Some(Event::Lost { node, why }) => {
                Err(self.fault(node, format!("{} {why}", self.who(node))))
            }
        }
    }

    /// Asks nodes `which` for a handshake at once (each within `deadline`); fails on the
    /// first that misses it, pinned on it (`no_handshake`), saying it was `doing` what.
    pub(super) fn probe_nodes(
        &self,
        which: &[usize],
        deadline: Duration,
        doing: &str,
    ) -> Result<()> {
        let addrs: Vec<String> = which
            .iter()
            .map(|&i| self.nodes[i].address.clone())
            .collect();
        let key = self.key.clone();
        let answers = self
            .rt
            .block_on(probe::handshake_each(&addrs, &key, deadline));
        for (&i, r) in which.iter().zip(answers) {
            if let Err(why) = r {
                return Err(anyhow::Error::new(NodeFault {
                    address: self.nodes[i].address.clone(),
                    message: format!(
                        "{} stopped answering{doing}: no handshake within {:.2} s ({why}; \
                         process frozen, link cut or machine down)",
                        self.who(i),
                        deadline.as_secs_f64()
                    ),
                    no_handshake: true,
                }));
            }
        }
        Ok(())
    }

    /// Asks every node silent for over `SUSPECT_AFTER` (at most once per
    /// `SUSPECT_PROBE_EVERY`) for a handshake; fails, pinned on it, if one misses it.
    fn check_frozen(&mut self) -> Result<()> {
        if self.ready.is_empty() {
            return Ok(());
        }
        let now = Instant::now();
        let now_ms = self.t0.elapsed().as_millis() as u64;
        let suspects: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| {
                let n = &self.nodes[i];
                let silent = now_ms.saturating_sub(n.last_seen.load(Ordering::Relaxed));
                silent > SUSPECT_AFTER.as_millis() as u64
                    && n.probed_at
                        .is_none_or(|t| now.duration_since(t) >= SUSPECT_PROBE_EVERY)
            })
            .collect();
        if suspects.is_empty() {
            return Ok(());
        }
        for &i in &suspects {
            self.nodes[i].probed_at = Some(now);
        }
        let silent = |i: usize| {
            now_ms.saturating_sub(self.nodes[i].last_seen.load(Ordering::Relaxed)) as f64 / 1e3
        };
        tracing::debug!(nodes = ?suspects, "silent nodes: asking for a handshake");
        self.probe_nodes(&suspects, probe::SUSPECT_PROBE_DEADLINE, "")
            .map_err(|e| {
                let i = suspects
                    .iter()
                    .copied()
                    .find(|&i| probe::fault_of(&e).is_some_and(|(a, _)| a == self.nodes[i].address))
                    .unwrap_or(suspects[0]);
                e.context(format!("nothing heard for {:.1} s", silent(i)))
            })
    }

    /// The next event within `wait` (`None`: none came), without watching heartbeats.
    pub(super) fn poll_event(&mut self, wait: Duration) -> Result<Option<Event>> {
        let events = &mut self.events;
        self.rt.block_on(async {
            match tokio::time::timeout(wait, events.recv()).await {
                Ok(Some(e)) => Ok(Some(e)),
                Ok(None) => bail!("every link is closed"),
                Err(_) => Ok(None),
            }
        })
    }

    /// The next event, watching heartbeats meanwhile.
    fn next_event(&mut self, deadline: Instant, what: &str) -> Result<Event> {
        let t0 = self.t0;
        let nodes: Vec<(String, String, Arc<AtomicU64>)> = self
            .nodes
            .iter()
            .map(|n| {
                (
                    format!("node '{}' ({})", n.name, n.address),
                    n.address.clone(),
                    Arc::clone(&n.last_seen),
                )
            })
            .collect();
        let check_heartbeats = !self.ready.is_empty();
        let events = &mut self.events;
        self.rt.block_on(async {
            loop {
                let now = Instant::now();
                if now >= deadline {
                    bail!("timed out waiting for {what}");
                }
                let slice = (deadline - now).min(Duration::from_millis(250));
                match tokio::time::timeout(slice, events.recv()).await {
                    Ok(Some(e)) => return Ok(e),
                    Ok(None) => bail!("every link is closed"),
                    Err(_) => {}
                }
                if check_heartbeats {
                    for (who, address, seen) in &nodes {
                        if let Some(silent) = silent_too_long(t0, seen) {
                            return Err(stopped_answering(who, address, silent));
                        }
                    }
                }
            }
        })
    }

    /// After a data link failed: waits up to `wait` for a node's control connection to say
    /// why (a node shutting down says so before its links close), failing with that cause.
    pub(super) fn cause_within(&mut self, wait: Duration) -> Result<()> {
        let deadline = Instant::now() + wait;
        loop {
            self.check_health()?;
            let now = Instant::now();
            if now >= deadline {
                return Ok(());
            }
            match self.poll_event(deadline - now)? {
                Some(Event::Lost { node, why }) => {
                    return Err(self.fault(node, format!("{} {why}", self.who(node))))
                }
                Some(Event::Control {
                    node,
                    msg: Control::Error(e),
                }) => {
                    // A node's report that its neighbour went away: the neighbour's own
                    // word, if it comes, is the cause.
                    let first = format!("{}: {}", self.who(node), e.message);
                    let rest = deadline.saturating_duration_since(Instant::now());
                    if let Some(Event::Lost { node, why }) = self.poll_event(rest)? {
                        return Err(self.fault(node, format!("{} {why}", self.who(node))));
                    }
                    bail!("{first}");
                }
                Some(_) => {}
                None => return Ok(()),
            }
        }
    }

    /// Fails if any node was lost, reported an error, or went silent. A lost node is named
    /// before the errors others report about it.
    pub fn check_health(&mut self) -> Result<()> {
        let mut error = None;
        loop {
            match self.events.try_recv() {
                Ok(Event::Lost { node, why }) => {
                    return Err(self.fault(node, format!("{} {why}", self.who(node))))
                }
                Ok(Event::Control {
                    node,
                    msg: Control::Error(e),
                }) => {
                    error.get_or_insert_with(|| format!("{}: {}", self.who(node), e.message));
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        if let Some(e) = error {
            bail!("{e}");
        }
        for (i, n) in self.nodes.iter().enumerate() {
            if let Some(silent) = silent_too_long(self.t0, &n.last_seen) {
                return Err(stopped_answering(&self.who(i), &n.address, silent));
            }
        }
        self.check_frozen()
    }

    /// Every node's counters.
    pub fn stats(&mut self) -> Result<Vec<Stats>> {
        for i in 0..self.nodes.len() {
            self.send_control(i, &Control::GetStats)?;
        }
        let mut out: Vec<Option<Stats>> = vec![None; self.nodes.len()];
        while out.iter().any(|s| s.is_none()) {
            let pending: Vec<usize> = (0..out.len()).filter(|&i| out[i].is_none()).collect();
            let (i, msg) =
                self.next_control(Duration::from_secs(5), "node statistics", &pending)?;
            if let Control::Stats(s) = msg {
                out[i] = Some(s);
            }
        }
        Ok(out.into_iter().flatten().collect())
    }

    /// Tells every node the session is over and closes the links.
    pub fn shutdown(self, reason: &str) {
        for i in 0..self.nodes.len() {
            let _ = self.send_control(
                i,
                &Control::Shutdown {
                    reason: reason.to_string(),
                },
            );
        }
        // Give the writer tasks a moment to flush.
        self.rt.block_on(async {
            tokio::time::sleep(Duration::from_millis(50)).await;
        });
        self.rt.shutdown_timeout(Duration::from_millis(200));
    }
}
