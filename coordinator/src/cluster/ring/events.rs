//! What the nodes say, and whether they are well: control messages and lost links as events,
//! heartbeat watching, the cause of a failed data link, statistics, and the orderly end.

use super::{Event, Ring, HEARTBEAT_TIMEOUT};
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
fn stopped_answering(who: &str, silent_ms: u64) -> anyhow::Error {
    anyhow::anyhow!(
        "{who} stopped answering: nothing heard for {:.1} s (link cut, machine down or process frozen)",
        silent_ms as f64 / 1000.0
    )
}

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
        match self.next_event(deadline, what)? {
            Event::Control { node, msg } => Ok((node, msg)),
            Event::Frame { node, h, .. } => bail!(
                "{}: unexpected {:?} frame while waiting for {what}",
                self.who(node),
                h.kind
            ),
            Event::Lost { node, why } => bail!("{} {why}", self.who(node)),
        }
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
        let nodes: Vec<(String, Arc<AtomicU64>)> = self
            .nodes
            .iter()
            .map(|n| {
                (
                    format!("node '{}' ({})", n.name, n.address),
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
                    for (who, seen) in &nodes {
                        if let Some(silent) = silent_too_long(t0, seen) {
                            return Err(stopped_answering(who, silent));
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
                Some(Event::Lost { node, why }) => bail!("{} {why}", self.who(node)),
                Some(Event::Control {
                    node,
                    msg: Control::Error(e),
                }) => {
                    // A node's report that its neighbour went away: the neighbour's own
                    // word, if it comes, is the cause.
                    let first = format!("{}: {}", self.who(node), e.message);
                    let rest = deadline.saturating_duration_since(Instant::now());
                    if let Some(Event::Lost { node, why }) = self.poll_event(rest)? {
                        bail!("{} {why}", self.who(node));
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
                Ok(Event::Lost { node, why }) => bail!("{} {why}", self.who(node)),
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
                return Err(stopped_answering(&self.who(i), silent));
            }
        }
        Ok(())
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
