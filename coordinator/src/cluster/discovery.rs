//! Finding the nodes on the LAN by mDNS/DNS-SD (the `mdns-sd` crate): `ringllm node
//! --advertise` announces a `_ringllm._tcp.local.` service; `ringllm up --discover` and
//! `ringllm nodes` browse for it.
//!
//! A node advertises only what a coordinator needs to choose it: its port (and addresses),
//! its name, a hash of the cluster (`ClusterKey::discovery_hash`, a keyed hash that reveals
//! nothing about the key), and its capabilities: threads, memory budget, kernel level,
//! transport, version. Never the key.
//!
//! What a browse hears is a hint, never a trust decision: anyone on the LAN can announce a
//! service, with the cluster's (public) hash, any name and any address, or re-announce a real
//! node's name elsewhere, or announce hundreds. So with a key, every service that claims the
//! key's cluster is asked to prove it: the handshake (as a monitor, which never claims the
//! node) at every address heard for its name, within `PROBE_DEADLINE`. Addresses no node can
//! be at (port 0, unspecified, multicast, broadcast) are dropped with one log line each, and
//! so are those that do not answer; the services that answered are the nodes, and a full
//! table keeps them before the others. Every text a service carries is escaped before it is
//! shown or logged (`untrusted::escape`).
//!
//! Interfaces: by default every interface with an address takes part (loopback too); the
//! `interfaces` lists (`--mdns-interface`) restrict it to the named ones.

use anyhow::{anyhow, Context, Result};
use mdns_sd::{IfKind, ResolvedService, ServiceDaemon, ServiceEvent, ServiceInfo};
use ringllm_protocol::untrusted::escape;
use ringllm_protocol::ClusterKey;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

/// The DNS-SD service type of ringllm nodes.
pub const SERVICE_TYPE: &str = "_ringllm._tcp.local.";
/// How long `up --discover` and `ringllm nodes` listen by default.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(3);
/// Most nodes one browse keeps (a LAN flooded with fake services cannot grow it further).
pub const MAX_FOUND: usize = 256;

/// What a node announces.
#[derive(Clone, Debug)]
pub struct Advert {
    pub name: String,
    /// The address it listens on; an unspecified IP (`0.0.0.0`) advertises every address of
    /// the allowed interfaces.
    pub listen: SocketAddr,
    pub threads: u32,
    pub memory_budget: u64,
    /// Kernel level (`avx512`, `neon+dotprod`, ...).
    pub backend: String,
    pub transport: String,
    pub version: String,
}

/// A running advertisement; dropping it withdraws the service (a goodbye on the LAN) and
/// stops the mDNS thread.
pub struct Advertised {
    daemon: ServiceDaemon,
    fullname: String,
}

impl Drop for Advertised {
    fn drop(&mut self) {
        if let Ok(rx) = self.daemon.unregister(&self.fullname) {
            let _ = rx.recv_timeout(Duration::from_secs(1));
        }
        if let Ok(rx) = self.daemon.shutdown() {
            let _ = rx.recv_timeout(Duration::from_secs(1));
        }
    }
}

fn daemon(interfaces: &[String]) -> Result<ServiceDaemon> {
    let d = ServiceDaemon::new().map_err(|e| anyhow!("cannot start mDNS: {e}"))?;
    if !interfaces.is_empty() {
        d.disable_interface(IfKind::All)
            .map_err(|e| anyhow!("mDNS: {e}"))?;
        let names: Vec<IfKind> = interfaces.iter().map(|n| IfKind::Name(n.clone())).collect();
        d.enable_interface(names)
            .map_err(|e| anyhow!("mDNS: {e}"))?;
    }
    Ok(d)
}

/// A host label mDNS may carry: letters, digits and dashes.
fn dns_label(s: &str) -> String {
    let l: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let l = l.trim_matches('-');
    if l.is_empty() {
        "node".into()
    } else {
        l.chars().take(40).collect()
    }
}

/// At most `max` bytes of `s`, cut at a character boundary.
fn cut_utf8(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Announces a node of the cluster of `key` until the returned handle is dropped.
pub fn advertise(a: &Advert, key: &ClusterKey, interfaces: &[String]) -> Result<Advertised> {
    let d = daemon(interfaces)?;
    let props = [
        ("name", a.name.clone()),
        ("cluster", key.discovery_hash()),
        ("threads", a.threads.to_string()),
        ("memory", a.memory_budget.to_string()),
        ("backend", a.backend.clone()),
        ("transport", a.transport.clone()),
        ("version", a.version.clone()),
        ("proto", "1".into()),
    ];
    // The host name must be unique on the LAN: the node's name and port.
    let host = format!("{}-{}.local.", dns_label(&a.name), a.listen.port());
    let ip = if a.listen.ip().is_unspecified() {
        String::new()
    } else {
        a.listen.ip().to_string()
    };
    let mut info = ServiceInfo::new(
        SERVICE_TYPE,
        // A DNS label holds at most 63 bytes: the name is cut (the TXT `name` keeps it whole).
        &format!("{} {}", cut_utf8(&a.name, 40), a.listen.port()),
        &host,
        ip.as_str(),
        a.listen.port(),
        &props[..],
    )
    .map_err(|e| anyhow!("cannot describe the mDNS service: {e}"))?;
    if a.listen.ip().is_unspecified() {
        info = info.enable_addr_auto();
    }
    if !interfaces.is_empty() {
        info.set_interfaces(interfaces.iter().map(|n| IfKind::Name(n.clone())).collect());
    }
    let fullname = info.get_fullname().to_string();
    d.register(info)
        .map_err(|e| anyhow!("cannot advertise on mDNS: {e}"))?;
    info!("advertising {fullname} on mDNS");
    Ok(Advertised {
        daemon: d,
        fullname,
    })
}

/// A node heard on the LAN. Anyone on the LAN can announce a service, with any name and any
/// address, without the key: every text field here is escaped (`untrusted::escape`), and
/// with a key only `answered` says the node is one of the cluster's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Found {
    /// The name the node gave in its handshake once it answered; until then, the one
    /// announced.
    pub name: String,
    /// `ip:port` to connect to: the one that answered the key, else the first candidate.
    pub address: String,
    /// Every address it advertised.
    pub addresses: Vec<String>,
    pub port: u16,
    /// Every `ip:port` heard for this instance name that can be dialled: a name announced
    /// by several hosts keeps them all, and each is tried.
    pub candidates: Vec<String>,
    /// Its cluster hash, and whether it is this key's.
    pub cluster: String,
    pub same_cluster: Option<bool>,
    /// With a key, for a service claiming its cluster: whether a candidate answered the
    /// handshake (proving the key) within `PROBE_DEADLINE`. `None`: not asked.
    pub answered: Option<bool>,
    pub threads: Option<u32>,
    pub memory_budget: Option<u64>,
    pub backend: Option<String>,
    pub transport: Option<String>,
    pub version: Option<String>,
    /// Seconds from the start of the browse to when it was heard, or, once it answered the
    /// key, to when it answered.
    pub heard_after_s: f64,
}

/// What a browse heard.
#[derive(Clone, Debug, Default)]
pub struct Browse {
    /// Every node heard, by name: with a key, those that answered it first (at most
    /// `MAX_FOUND`).
    pub found: Vec<Found>,
    /// How long the browse ran.
    pub elapsed: Duration,
}

impl Browse {
    /// The nodes of the key's cluster (that answered its handshake), by name.
    pub fn matching(&self) -> Vec<&Found> {
        self.found
            .iter()
            .filter(|f| f.same_cluster == Some(true) && f.answered == Some(true))
            .collect()
    }

    /// Seconds until the last node of the key's cluster answered.
    pub fn last_match_s(&self) -> f64 {
        self.matching()
            .iter()
            .map(|f| f.heard_after_s)
            .fold(0.0, f64::max)
    }
}

/// How long a candidate has to answer the handshake: a node on a LAN answers in
/// milliseconds; a spoofed address (a dead host, a program that accepts and says nothing)
/// never does.
pub const PROBE_DEADLINE: Duration = super::probe::QUICK_PROBE_DEADLINE;
/// Most addresses kept per instance name.
const MAX_CANDIDATES: usize = 8;
/// Most instance names one browse tracks (far more than it reports, so a flood of fakes
/// cannot crowd out a node before its handshake is tried).
const MAX_HEARD: usize = 4096;
/// Handshake probes under way at once (each holds a socket).
const MAX_PROBES: usize = 256;
/// Names listed in one message before "and N more".
const MAX_LISTED: usize = 8;

/// Why a node cannot be at `ip:port` (a spoofed or broken announcement), if it cannot.
fn unusable(ip: IpAddr, port: u16) -> Option<&'static str> {
    if port == 0 {
        return Some("port 0");
    }
    match ip {
        IpAddr::V4(v4) if v4.is_unspecified() || v4.octets()[0] == 0 => {
            Some("an unspecified address")
        }
        IpAddr::V4(v4) if v4.is_broadcast() => Some("the broadcast address"),
        IpAddr::V6(v6) if v6.is_unspecified() => Some("an unspecified address"),
        // An IPv6 link-local address cannot be dialled without its scope.
        IpAddr::V6(v6) if v6.is_unicast_link_local() => Some("a link-local address"),
        ip if ip.is_multicast() => Some("a multicast address"),
        _ => None,
    }
}

/// The addresses to dial among those a service gave: IPv4 before IPv6, loopback last, then
/// the lowest (so every browse tries them in the same order); the unusable are left out.
fn dialable(addrs: &[IpAddr], port: u16) -> Vec<SocketAddr> {
    let mut v: Vec<IpAddr> = addrs
        .iter()
        .copied()
        .filter(|ip| unusable(*ip, port).is_none())
        .collect();
    v.sort_by_key(|ip| (ip.is_loopback(), ip.is_ipv6(), *ip));
    v.dedup();
    v.into_iter().map(|ip| SocketAddr::new(ip, port)).collect()
}

/// What one probe found.
struct ProbeResult {
    fullname: String,
    addr: SocketAddr,
    /// The node's name, or why it did not answer.
    outcome: Result<String, String>,
    /// Seconds from the start of the browse.
    at: f64,
}

/// Handshake probes, run on a small runtime of their own beside the mDNS browse, at most
/// `MAX_PROBES` at once (the rest wait in order).
struct Prober {
    rt: tokio::runtime::Runtime,
    key: ClusterKey,
    me: String,
    t0: Instant,
    tx: mpsc::Sender<ProbeResult>,
    rx: mpsc::Receiver<ProbeResult>,
    running: usize,
    queue: VecDeque<(String, SocketAddr)>,
}

impl Prober {
    fn new(key: &ClusterKey, t0: Instant) -> Result<Prober> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("discovery-probe")
            .enable_all()
            .build()
            .context("discovery: cannot start the handshake probes")?;
        let (tx, rx) = mpsc::channel();
        Ok(Prober {
            rt,
            key: key.clone(),
            me: super::status::asker_name("discovery"),
            t0,
            tx,
            rx,
            running: 0,
            queue: VecDeque::new(),
        })
    }

    fn probe(&mut self, fullname: String, addr: SocketAddr) {
        if self.running >= MAX_PROBES {
            self.queue.push_back((fullname, addr));
            return;
        }
        self.running += 1;
        let (key, me, tx, t0) = (self.key.clone(), self.me.clone(), self.tx.clone(), self.t0);
        self.rt.spawn(async move {
            // The ring's probe: a monitor's handshake, which proves the key and never
            // claims the node.
            let outcome =
                super::probe::handshake(&addr.to_string(), &key, &me, PROBE_DEADLINE).await;
            let at = t0.elapsed().as_secs_f64();
            let _ = tx.send(ProbeResult {
                fullname,
                addr,
                outcome,
                at,
            });
        });
    }

    /// The probes finished since the last call (each frees a place for a waiting one).
    fn finished(&mut self) -> Vec<ProbeResult> {
        let done: Vec<ProbeResult> = self.rx.try_iter().collect();
        self.running -= done.len().min(self.running);
        while self.running < MAX_PROBES {
            let Some((name, addr)) = self.queue.pop_front() else {
                break;
            };
            self.probe(name, addr);
        }
        done
    }

    fn idle(&self) -> bool {
        self.running == 0 && self.queue.is_empty()
    }
}

/// Where a candidate address stands.
#[derive(Clone, Debug, PartialEq)]
enum Probe {
    Untried,
    Running,
    Failed,
    /// It proved the key: the name it gave, and when (seconds into the browse).
    Answered(String, f64),
}

/// One instance name heard, with every address heard for it.
struct Entry {
    found: Found,
    /// Whether any announcement of this name carried the key's cluster hash (an attacker
    /// re-announcing the name with another hash does not stop its addresses being tried).
    claims_ours: bool,
    candidates: Vec<(SocketAddr, Probe)>,
    first_heard: f64,
}

impl Entry {
    fn has_answered(&self) -> bool {
        self.candidates
            .iter()
            .any(|(_, p)| matches!(p, Probe::Answered(..)))
    }

    /// Which entries a full table keeps: those that answered the key, then those still to be
    /// asked, then those of no cluster or another, then those that claimed ours and failed.
    fn rank(&self) -> u8 {
        if self.has_answered() {
            3
        } else if !self.claims_ours {
            1
        } else if self.candidates.iter().any(|(_, p)| *p != Probe::Failed) {
            2
        } else {
            0
        }
    }

    /// What this entry reports: one node per name that answered at its addresses (the
    /// name's first address in dialling order; an address an attacker added to a real
    /// node's name may be another real node, which answers with its own name), or, if none
    /// answered, the service as heard.
    fn report(self, key_given: bool) -> Vec<Found> {
        let mut f = self.found;
        f.candidates = self.candidates.iter().map(|(a, _)| a.to_string()).collect();
        f.heard_after_s = self.first_heard;
        let mut answers: Vec<(SocketAddr, String, f64)> = self
            .candidates
            .iter()
            .filter_map(|(a, p)| match p {
                Probe::Answered(name, at) => Some((*a, name.clone(), *at)),
                _ => None,
            })
            .collect();
        if answers.is_empty() {
            let first = self.candidates.first().map(|(a, _)| a.to_string());
            f.address = first.unwrap_or_default();
            f.answered = (key_given && self.claims_ours).then_some(false);
            return vec![f];
        }
        answers.sort_by_key(|(a, _, _)| (a.ip().is_loopback(), a.is_ipv6(), *a));
        let mut names = HashSet::new();
        answers.retain(|(_, name, _)| names.insert(name.clone()));
        answers
            .into_iter()
            .map(|(addr, name, at)| Found {
                name: if name.is_empty() {
                    f.name.clone()
                } else {
                    name
                },
                address: addr.to_string(),
                port: addr.port(),
                same_cluster: Some(true),
                answered: Some(true),
                heard_after_s: at,
                ..f.clone()
            })
            .collect()
    }
}

/// The state of one browse.
struct Browser {
    want: Option<String>,
    prober: Option<Prober>,
    t0: Instant,
    heard: BTreeMap<String, Entry>,
    /// Addresses already said to be unusable (each is logged once).
    refused: HashSet<(String, SocketAddr)>,
    said_full: bool,
}

/// `s`, at most `max` characters, escaped.
fn shown(s: &str, max: usize) -> String {
    let cut: String = s.chars().take(max).collect();
    escape(&cut).into_owned()
}

impl Browser {
    fn on_resolved(&mut self, s: &ResolvedService) {
        let txt = |k: &str| s.get_property_val_str(k).map(|v| shown(v, 64));
        let cluster = txt("cluster").unwrap_or_default();
        let name = s
            .get_property_val_str("name")
            .map_or_else(|| shown(&s.fullname, 64), |n| shown(n, 64));
        let ips: Vec<IpAddr> = s.addresses.iter().map(|a| a.to_ip_addr()).collect();
        self.say_unusable(&s.fullname, &name, &ips, s.port);
        let mut cands = dialable(&ips, s.port);
        // Loopback reaches this machine, not the announcer: only for a node that has
        // nothing else (one on this machine listening on loopback).
        if cands.iter().any(|a| !a.ip().is_loopback()) {
            cands.retain(|a| !a.ip().is_loopback());
        }
        let same = self.want.as_ref().map(|w| *w == cluster);
        if cands.is_empty() && !self.heard.contains_key(&s.fullname) {
            debug!("{}: no address to dial", shown(&s.fullname, 128));
            return;
        }
        let f = Found {
            name,
            address: String::new(),
            addresses: ips.iter().map(|a| a.to_string()).collect(),
            port: s.port,
            candidates: Vec::new(),
            cluster,
            same_cluster: same,
            answered: None,
            threads: txt("threads").and_then(|v| v.parse().ok()),
            memory_budget: txt("memory").and_then(|v| v.parse().ok()),
            backend: txt("backend"),
            transport: txt("transport"),
            version: txt("version"),
            heard_after_s: 0.0,
        };
        if !self.admit(&s.fullname, &f) {
            return;
        }
        let Some(e) = self.heard.get_mut(&s.fullname) else {
            return;
        };
        e.claims_ours |= same == Some(true);
        for a in &f.addresses {
            if !e.found.addresses.contains(a) && e.found.addresses.len() < MAX_CANDIDATES {
                e.found.addresses.push(a.clone());
            }
        }
        if !e.has_answered() {
            // The properties of the last announcement (a node that answered keeps its own).
            let (addresses, candidates) = (
                std::mem::take(&mut e.found.addresses),
                std::mem::take(&mut e.found.candidates),
            );
            e.found = Found {
                addresses,
                candidates,
                same_cluster: if e.claims_ours { Some(true) } else { same },
                ..f
            };
        }
        for c in cands {
            if e.candidates.len() < MAX_CANDIDATES && !e.candidates.iter().any(|(a, _)| *a == c) {
                e.candidates.push((c, Probe::Untried));
            }
        }
        self.start_probes(&s.fullname);
    }

    /// Logs, once each, the addresses of a service that no node can be at.
    fn say_unusable(&mut self, fullname: &str, name: &str, ips: &[IpAddr], port: u16) {
        for ip in ips {
            let Some(why) = unusable(*ip, port) else {
                continue;
            };
            let a = SocketAddr::new(*ip, port);
            // Link-local IPv6 addresses come with every service: not worth a line.
            if matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local()) {
                continue;
            }
            if self.refused.len() < MAX_HEARD && self.refused.insert((fullname.to_string(), a)) {
                info!("ignoring address {a} of '{name}': {why}");
            }
        }
    }

    /// Makes room for `fullname` if it is new; false if the table is full of better entries.
    fn admit(&mut self, fullname: &str, f: &Found) -> bool {
        if self.heard.contains_key(fullname) {
            return true;
        }
        let newcomer = Entry {
            found: f.clone(),
            claims_ours: f.same_cluster == Some(true),
            candidates: Vec::new(),
            first_heard: self.t0.elapsed().as_secs_f64(),
        };
        if self.heard.len() >= MAX_HEARD {
            // A newcomer still to be asked counts as such (rank 2), like those waiting.
            let rank = if newcomer.claims_ours { 2 } else { 1 };
            let worst = self
                .heard
                .iter()
                .map(|(k, e)| (e.rank(), k))
                .min()
                .filter(|(r, _)| *r < rank)
                .map(|(_, k)| k.clone());
            match worst {
                Some(k) => {
                    self.heard.remove(&k);
                }
                None => {
                    if !self.said_full {
                        warn!(
                            "more than {MAX_HEARD} ringllm services on the LAN; ignoring the rest"
                        );
                        self.said_full = true;
                    }
                    return false;
                }
            }
        }
        match f.same_cluster {
            Some(false) => info!(
                "ignoring node '{}' ({}): cluster {} is not ours",
                f.name,
                escape(fullname),
                f.cluster
            ),
            Some(true) => debug!("heard '{}'; asking it for the key", f.name),
            None => info!(
                "found node '{}' after {:.2} s",
                f.name, newcomer.first_heard
            ),
        }
        self.heard.insert(fullname.to_string(), newcomer);
        true
    }

    /// Starts a handshake at each untried address of `fullname` (if it claims our cluster).
    fn start_probes(&mut self, fullname: &str) {
        let (Some(p), Some(e)) = (self.prober.as_mut(), self.heard.get_mut(fullname)) else {
            return;
        };
        if !e.claims_ours {
            return;
        }
        for (addr, state) in e
            .candidates
            .iter_mut()
            .filter(|(_, s)| *s == Probe::Untried)
        {
            *state = Probe::Running;
            p.probe(fullname.to_string(), *addr);
        }
    }

    fn on_probes(&mut self) {
        let Some(p) = self.prober.as_mut() else {
            return;
        };
        for r in p.finished() {
            let Some(e) = self.heard.get_mut(&r.fullname) else {
                continue;
            };
            let Some(c) = e.candidates.iter_mut().find(|(a, _)| *a == r.addr) else {
                continue;
            };
            match r.outcome {
                Ok(name) => {
                    info!(
                        "found node '{name}' at {} after {:.2} s (it answered the key)",
                        r.addr, r.at
                    );
                    c.1 = Probe::Answered(name, r.at);
                }
                Err(why) => {
                    info!(
                        "dropping address {} of '{}': no handshake within {:.1} s ({why})",
                        r.addr,
                        e.found.name,
                        PROBE_DEADLINE.as_secs_f64()
                    );
                    c.1 = Probe::Failed;
                }
            }
        }
    }

    fn on_removed(&mut self, fullname: &str) {
        // A goodbye needs no key: one for a node that answered the key is not believed.
        match self.heard.get(fullname) {
            Some(e) if e.has_answered() => {
                debug!(
                    "{}: goodbye ignored (it answered the key)",
                    escape(fullname)
                );
            }
            Some(_) => {
                self.heard.remove(fullname);
                info!("{} left", escape(fullname));
            }
            None => {}
        }
    }

    /// The nodes heard: those that answered the key first, at most `MAX_FOUND`; one node
    /// announced under several names is reported once.
    fn finish(self, key_given: bool) -> Vec<Found> {
        let mut entries: Vec<Entry> = self.heard.into_values().collect();
        entries.sort_by(|a, b| {
            b.rank()
                .cmp(&a.rank())
                .then(a.first_heard.total_cmp(&b.first_heard))
        });
        let mut found: Vec<Found> = entries
            .into_iter()
            .flat_map(|e| e.report(key_given))
            .collect();
        // One node heard under several names (or at an address an attacker copied) once.
        let mut seen = HashSet::new();
        found.retain(|f| f.answered != Some(true) || seen.insert(f.address.clone()));
        if found.len() > MAX_FOUND {
            warn!(
                "{} ringllm services heard; listing {MAX_FOUND} (those that answered the key \
                 first)",
                found.len()
            );
            found.truncate(MAX_FOUND);
        }
        found.sort_by(|a, b| a.name.cmp(&b.name).then(a.address.cmp(&b.address)));
        found
    }
}

/// Listens for `wait` and returns every node heard; with a key, marks which belong to its
/// cluster (and logs the others) and asks each of those for the key (the handshake, at every
/// address heard for it, within `PROBE_DEADLINE`), waiting after `wait` for the probes
/// still under way.
pub fn browse(key: Option<&ClusterKey>, wait: Duration, interfaces: &[String]) -> Result<Browse> {
    let d = daemon(interfaces)?;
    let rx = d
        .browse(SERVICE_TYPE)
        .map_err(|e| anyhow!("cannot browse mDNS: {e}"))
        .context("discovery")?;
    let t0 = Instant::now();
    let mut b = Browser {
        want: key.map(|k| k.discovery_hash()),
        prober: key.map(|k| Prober::new(k, t0)).transpose()?,
        t0,
        heard: BTreeMap::new(),
        refused: HashSet::new(),
        said_full: false,
    };
    let deadline = t0 + wait;
    // Probe results are collected between mDNS events, at least this often.
    let poll = Duration::from_millis(10);
    loop {
        b.on_probes();
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        match rx.recv_timeout((deadline - now).min(poll)) {
            Ok(ServiceEvent::ServiceResolved(s)) => b.on_resolved(&s),
            Ok(ServiceEvent::ServiceRemoved(_, fullname)) => b.on_removed(&fullname),
            Ok(other) => debug!("mDNS: {other:?}"),
            Err(mdns_sd::RecvTimeoutError::Timeout) => {}
            Err(mdns_sd::RecvTimeoutError::Disconnected) => {
                warn!("the mDNS thread stopped before the browse ended");
                break;
            }
        }
    }
    let _ = d.stop_browse(SERVICE_TYPE);
    // The probes under way end within their deadline.
    let late = Instant::now() + PROBE_DEADLINE + Duration::from_millis(200);
    while b.prober.as_ref().is_some_and(|p| !p.idle()) && Instant::now() < late {
        std::thread::sleep(poll);
        b.on_probes();
    }
    let elapsed = t0.elapsed();
    if let Ok(rx) = d.shutdown() {
        let _ = rx.recv_timeout(Duration::from_secs(1));
    }
    let key_given = b.prober.is_some();
    if let Some(p) = b.prober.take() {
        p.rt.shutdown_background();
    }
    Ok(Browse {
        found: b.finish(key_given),
        elapsed,
    })
}

/// `'name' (address)` of each, at most `MAX_LISTED` then "and N more"; and how many.
fn listed<'a>(nodes: impl Iterator<Item = &'a Found>) -> (usize, String) {
    let all: Vec<String> = nodes
        .map(|f| format!("'{}' ({})", f.name, f.address))
        .collect();
    let mut text = all
        .iter()
        .take(MAX_LISTED)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if all.len() > MAX_LISTED {
        text.push_str(&format!(" and {} more", all.len() - MAX_LISTED));
    }
    (all.len(), text)
}

/// `up --discover` / `discover = true`: the addresses of this cluster's nodes, those that
/// answered its key, in name order, after a browse of `wait`; says on stderr what it found,
/// how fast, and what it left out. Fails only when no node answered the key: a service
/// that claims the cluster but does not answer (a spoofed announcement, a dead address) is
/// left out, never a reason to fail.
pub fn discover_nodes(
    key: &ClusterKey,
    wait: Duration,
    interfaces: &[String],
) -> Result<Vec<Found>> {
    let b = browse(Some(key), wait, interfaces)?;
    let mine: Vec<Found> = b.matching().into_iter().cloned().collect();
    let (n_silent, silent) = listed(
        b.found
            .iter()
            .filter(|f| f.same_cluster == Some(true) && f.answered != Some(true)),
    );
    let (n_others, others) = listed(b.found.iter().filter(|f| f.same_cluster != Some(true)));
    let hash = key.discovery_hash();
    if mine.is_empty() {
        let mut heard = Vec::new();
        if n_silent > 0 {
            heard.push(format!(
                "{n_silent} claimed it but did not answer its key within {:.1} s: {silent}",
                PROBE_DEADLINE.as_secs_f64()
            ));
        }
        if n_others > 0 {
            heard.push(format!("heard {n_others} of other clusters: {others}"));
        }
        anyhow::bail!(
            "discovery: no node of cluster {hash} answered on mDNS within {:.1} s{}{} (start \
             nodes with `ringllm node --advertise`, or list them with --node)",
            wait.as_secs_f64(),
            if heard.is_empty() { "" } else { "; " },
            heard.join("; ")
        );
    }
    notice!(
        "discovered {} node{} of cluster {hash} in {:.2} s: {}",
        mine.len(),
        if mine.len() == 1 { "" } else { "s" },
        b.last_match_s(),
        listed(mine.iter()).1
    );
    if n_silent > 0 {
        notice!(
            "left out {n_silent} that claimed cluster {hash} but did not answer its key within \
             {:.1} s: {silent}",
            PROBE_DEADLINE.as_secs_f64()
        );
    }
    if n_others > 0 {
        notice!("ignored {n_others} of another cluster: {others}");
    }
    Ok(mine)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_and_address_choice() {
        assert_eq!(dns_label("Desk PC:7701"), "desk-pc-7701");
        assert_eq!(dns_label("::"), "node");
        assert_eq!(cut_utf8("ééé", 3), "é");
        assert_eq!(cut_utf8("desk", 40), "desk");
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let strs = |v: Vec<SocketAddr>| v.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        let (v4, lo, v6, g6) = (
            ip("10.0.0.2"),
            ip("127.0.0.1"),
            ip("fe80::1"),
            ip("fd00::2"),
        );
        assert_eq!(
            strs(dialable(&[lo, v6, v4], 7701)),
            ["10.0.0.2:7701", "127.0.0.1:7701"]
        );
        assert_eq!(
            strs(dialable(&[lo, v6, g6], 7701)),
            ["[fd00::2]:7701", "127.0.0.1:7701"]
        );
        assert!(dialable(&[v6], 7701).is_empty());
        assert!(dialable(&[], 7701).is_empty());
    }

    #[test]
    fn addresses_no_node_can_be_at_are_refused_with_a_reason() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        for (a, port, why) in [
            ("10.0.0.2", 0, "port 0"),
            ("0.0.0.0", 7701, "an unspecified address"),
            ("0.1.2.3", 7701, "an unspecified address"),
            ("::", 7701, "an unspecified address"),
            ("224.0.0.251", 7701, "a multicast address"),
            ("ff02::fb", 7701, "a multicast address"),
            ("255.255.255.255", 7701, "the broadcast address"),
            ("fe80::1", 7701, "a link-local address"),
        ] {
            assert_eq!(unusable(ip(a), port), Some(why), "{a}:{port}");
            assert!(dialable(&[ip(a)], port).is_empty(), "{a}:{port}");
        }
        for a in ["10.0.0.2", "127.0.0.1", "192.168.1.255", "fd00::2"] {
            assert_eq!(unusable(ip(a), 7701), None, "{a}");
        }
    }
}
