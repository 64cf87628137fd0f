//! Refused connections (a wrong key, an old version, garbage, a handshake that never ends),
//! logged so that a flood of them costs a few lines: anyone who can reach the port can
//! cause one, and one line each let a single host write 25,000 lines (5.7 MB) into a node's
//! log. In each interval the first refusal of each peer is logged in full, for at most
//! `FULL_LINES` peers; the others are counted, and `flush` (every `SUMMARY_INTERVAL`, and at
//! shutdown) sums them up in one line naming the peers refused most and the last reason of
//! each, so nothing is lost and a flood costs at most `FULL_LINES` + 1 lines per interval.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tracing::warn;

/// How often the refusals counted but not logged are summed up.
pub(super) const SUMMARY_INTERVAL: Duration = Duration::from_secs(10);
/// Refusals logged in full per interval (the first of each peer).
const FULL_LINES: usize = 4;
/// Peers counted apart per interval; past it they share one count (an attacker with many
/// addresses cannot grow the table).
const MAX_PEERS: usize = 1024;
/// Peers the summary names, the ones refused most first.
const NAMED: usize = 4;

/// The refusals of the current interval.
#[derive(Default)]
pub(super) struct Refusals {
    window: Mutex<Window>,
}

#[derive(Default)]
struct Window {
    started: Option<Instant>,
    /// By source address (`None`: unknown, as for QUIC handshakes).
    peers: HashMap<Option<IpAddr>, Peer>,
    /// Refusals logged in full.
    logged: usize,
    /// Refusals not logged from peers past `MAX_PEERS`.
    unlisted: u64,
}

#[derive(Default)]
struct Peer {
    /// Refusals counted, not logged.
    hidden: u64,
    /// The last of them, as it would have been logged.
    last: Option<String>,
}

impl Refusals {
    /// A refused connection from `ip`: logs `line` (built only when it is logged or kept) if
    /// it is the peer's first this interval and fewer than `FULL_LINES` were; else counts it.
    pub(super) fn refused(&self, ip: Option<IpAddr>, line: impl FnOnce() -> String) {
        let mut guard = self.window.lock().unwrap_or_else(|e| e.into_inner());
        let w = &mut *guard;
        w.started.get_or_insert_with(Instant::now);
        let first = !w.peers.contains_key(&ip);
        if first && w.peers.len() >= MAX_PEERS {
            w.unlisted += 1;
            return;
        }
        let p = w.peers.entry(ip).or_default();
        if first && w.logged < FULL_LINES {
            w.logged += 1;
            drop(guard);
            warn!("{}", line());
        } else {
            p.hidden += 1;
            p.last = Some(line());
        }
    }

    /// Logs one line summing up the refusals counted but not logged since the last call (if
    /// any), and starts a new interval.
    pub(super) fn flush(&self) {
        let w = std::mem::take(&mut *self.window.lock().unwrap_or_else(|e| e.into_inner()));
        if let Some(line) = w.summary() {
            warn!("{line}");
        }
    }
}

impl Window {
    fn summary(self) -> Option<String> {
        let mut hidden: Vec<(Option<IpAddr>, Peer)> = self
            .peers
            .into_iter()
            .filter(|(_, p)| p.hidden > 0)
            .collect();
        let total = hidden.iter().map(|(_, p)| p.hidden).sum::<u64>() + self.unlisted;
        if total == 0 {
            return None;
        }
        hidden.sort_by(|a, b| b.1.hidden.cmp(&a.1.hidden).then(a.0.cmp(&b.0)));
        let secs = self.started.map_or(0.0, |t| t.elapsed().as_secs_f64());
        let mut parts: Vec<String> = hidden
            .iter()
            .take(NAMED)
            .map(|(ip, p)| {
                let who = ip.map_or_else(|| "unknown peers".to_string(), |ip| ip.to_string());
                let last = p.last.as_deref().unwrap_or("");
                format!("{} from {who} (the last: {last})", p.hidden)
            })
            .collect();
        let rest_peers = hidden.len().saturating_sub(NAMED);
        let rest: u64 = hidden
            .iter()
            .skip(NAMED)
            .map(|(_, p)| p.hidden)
            .sum::<u64>();
        if rest_peers > 0 {
            parts.push(format!("{rest} from {rest_peers} other peer(s)"));
        }
        if self.unlisted > 0 {
            parts.push(format!(
                "{} from peers past the first {MAX_PEERS}",
                self.unlisted
            ));
        }
        Some(format!(
            "refused {total} more connection(s) in the last {secs:.1} s, counted rather than \
             logged one by one: {}",
            parts.join("; ")
        ))
    }
}

/// Sums up the refusals every `SUMMARY_INTERVAL` until `stopped` resolves (then once more).
pub(super) async fn summarize(refusals: &Refusals, stopped: impl std::future::Future<Output = ()>) {
    // The first tick one interval from now (not at once, which would cut the first short).
    let start = tokio::time::Instant::now() + SUMMARY_INTERVAL;
    let mut tick = tokio::time::interval_at(start, SUMMARY_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            _ = tick.tick() => refusals.flush(),
            _ = &mut stopped => break,
        }
    }
    refusals.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn a_flood_from_one_peer_is_one_line_and_a_count() {
        let r = Refusals::default();
        for i in 0..1000 {
            r.refused(ip("10.0.0.9"), || {
                format!("refused connection from 10.0.0.9:{i}: wrong key")
            });
        }
        // The first was logged; the other 999 are counted, the last one kept.
        let w = std::mem::take(&mut *r.window.lock().unwrap());
        assert_eq!(w.logged, 1);
        let s = w.summary().unwrap();
        assert!(s.starts_with("refused 999 more connection(s)"), "{s}");
        assert!(
            s.contains("999 from 10.0.0.9 (the last: refused connection from 10.0.0.9:999"),
            "{s}"
        );
        // A new interval starts empty: nothing more to say.
        r.flush();
        assert!(std::mem::take(&mut *r.window.lock().unwrap())
            .summary()
            .is_none());
    }

    #[test]
    fn many_peers_get_at_most_four_full_lines_and_a_bounded_table() {
        let r = Refusals::default();
        for i in 0..5000u32 {
            let a =
                std::net::Ipv6Addr::from(0xfd00_0000_0000_0000_0000_0000_0000_0000u128 + i as u128);
            r.refused(Some(IpAddr::V6(a)), || format!("peer {i}"));
        }
        let w = std::mem::take(&mut *r.window.lock().unwrap());
        assert_eq!(w.logged, FULL_LINES);
        assert_eq!(w.peers.len(), MAX_PEERS);
        assert_eq!(w.unlisted, 5000 - MAX_PEERS as u64);
        let s = w.summary().unwrap();
        assert!(s.starts_with("refused 4996 more connection(s)"), "{s}");
        assert!(
            s.contains(&format!("from peers past the first {MAX_PEERS}")),
            "{s}"
        );
        assert!(s.contains("from 1016 other peer(s)"), "{s}");
    }
}
