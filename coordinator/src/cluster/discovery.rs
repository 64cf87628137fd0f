//! Finding the nodes on the LAN by mDNS/DNS-SD (the `mdns-sd` crate): `ringllm node
//! --advertise` announces a `_ringllm._tcp.local.` service; `ringllm up --discover` and
//! `ringllm nodes` browse for it.
//!
//! A node advertises only what a coordinator needs to choose it: its port (and addresses),
//! its name, a hash of the cluster (`ClusterKey::discovery_hash`, a keyed hash that reveals
//! nothing about the key), and its capabilities: threads, memory budget, kernel level,
//! transport, version. Never the key. A browser keeps the services whose cluster hash equals
//! its own key's; anything else is another cluster and is left out with a log line. A node
//! that lies about its hash gains nothing: every connection still proves the key.
//!
//! Interfaces: by default every interface with an address takes part (loopback too); the
//! `interfaces` lists (`--mdns-interface`) restrict it to the named ones.

use anyhow::{anyhow, Context, Result};
use mdns_sd::{IfKind, ServiceDaemon, ServiceEvent, ServiceInfo};
use ringllm_protocol::ClusterKey;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
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

/// A node heard on the LAN.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Found {
    pub name: String,
    /// `ip:port` to connect to.
    pub address: String,
    /// Every address it advertised.
    pub addresses: Vec<String>,
    pub port: u16,
    /// Its cluster hash, and whether it is this key's.
    pub cluster: String,
    pub same_cluster: Option<bool>,
    pub threads: Option<u32>,
    pub memory_budget: Option<u64>,
    pub backend: Option<String>,
    pub transport: Option<String>,
    pub version: Option<String>,
    /// Seconds from the start of the browse to when it was heard.
    pub heard_after_s: f64,
}

/// What a browse heard.
#[derive(Clone, Debug, Default)]
pub struct Browse {
    /// Every node heard, by name.
    pub found: Vec<Found>,
    /// How long the browse ran.
    pub elapsed: Duration,
}

impl Browse {
    /// The nodes of the key's cluster, by name.
    pub fn matching(&self) -> Vec<&Found> {
        self.found
            .iter()
            .filter(|f| f.same_cluster == Some(true))
            .collect()
    }

    /// Seconds until the last node of the key's cluster was heard.
    pub fn last_match_s(&self) -> f64 {
        self.matching()
            .iter()
            .map(|f| f.heard_after_s)
            .fold(0.0, f64::max)
    }
}

/// The address to dial among those a service gave: IPv4 before IPv6, loopback last, then
/// the lowest (so every browse picks the same).
fn pick(addrs: &[IpAddr], port: u16) -> Option<String> {
    // An IPv6 link-local address cannot be dialled without its scope.
    let mut v: Vec<IpAddr> = addrs
        .iter()
        .copied()
        .filter(|ip| !matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local()))
        .collect();
    v.sort_by_key(|ip| (ip.is_loopback(), ip.is_ipv6(), *ip));
    v.first().map(|ip| SocketAddr::new(*ip, port).to_string())
}

/// Listens for `wait` and returns every node heard; with a key, marks which belong to its
/// cluster (and logs the others).
pub fn browse(key: Option<&ClusterKey>, wait: Duration, interfaces: &[String]) -> Result<Browse> {
    let d = daemon(interfaces)?;
    let rx = d
        .browse(SERVICE_TYPE)
        .map_err(|e| anyhow!("cannot browse mDNS: {e}"))
        .context("discovery")?;
    let want = key.map(|k| k.discovery_hash());
    let t0 = Instant::now();
    let deadline = t0 + wait;
    let mut found: BTreeMap<String, Found> = BTreeMap::new();
    loop {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        let ev = match rx.recv_timeout(deadline - now) {
            Ok(ev) => ev,
            Err(mdns_sd::RecvTimeoutError::Timeout) => break,
            Err(mdns_sd::RecvTimeoutError::Disconnected) => {
                warn!("the mDNS thread stopped before the browse ended");
                break;
            }
        };
        match ev {
            ServiceEvent::ServiceResolved(s) => {
                let txt = |k: &str| s.get_property_val_str(k).map(str::to_string);
                let addrs: Vec<IpAddr> = s.addresses.iter().map(|a| a.to_ip_addr()).collect();
                let Some(address) = pick(&addrs, s.port) else {
                    debug!("{}: no address yet", s.fullname);
                    continue;
                };
                let cluster = txt("cluster").unwrap_or_default();
                let name = txt("name").unwrap_or_else(|| s.fullname.clone());
                let same = want.as_ref().map(|w| *w == cluster);
                let heard = t0.elapsed().as_secs_f64();
                let f = Found {
                    name: name.chars().take(64).collect(),
                    address: address.clone(),
                    addresses: addrs.iter().map(|a| a.to_string()).collect(),
                    port: s.port,
                    cluster: cluster.chars().take(64).collect(),
                    same_cluster: same,
                    threads: txt("threads").and_then(|v| v.parse().ok()),
                    memory_budget: txt("memory").and_then(|v| v.parse().ok()),
                    backend: txt("backend"),
                    transport: txt("transport"),
                    version: txt("version"),
                    heard_after_s: found
                        .get(&s.fullname)
                        .map_or(heard, |old| old.heard_after_s),
                };
                if !found.contains_key(&s.fullname) {
                    if found.len() >= MAX_FOUND {
                        warn!(
                            "more than {MAX_FOUND} ringllm services on the LAN; ignoring the rest"
                        );
                        continue;
                    }
                    match same {
                        Some(false) => info!(
                            "ignoring node '{}' at {address}: cluster {} is not ours",
                            f.name, f.cluster
                        ),
                        _ => info!("found node '{}' at {address} after {heard:.2} s", f.name),
                    }
                }
                found.insert(s.fullname.clone(), f);
            }
            ServiceEvent::ServiceRemoved(_, fullname) => {
                if found.remove(&fullname).is_some() {
                    info!("{fullname} left");
                }
            }
            other => debug!("mDNS: {other:?}"),
        }
    }
    let elapsed = t0.elapsed();
    let _ = d.stop_browse(SERVICE_TYPE);
    if let Ok(rx) = d.shutdown() {
        let _ = rx.recv_timeout(Duration::from_secs(1));
    }
    let mut found: Vec<Found> = found.into_values().collect();
    found.sort_by(|a, b| a.name.cmp(&b.name).then(a.address.cmp(&b.address)));
    Ok(Browse { found, elapsed })
}

/// `up --discover` / `discover = true`: the addresses of this cluster's nodes, in name order,
/// after a browse of `wait`; says on stderr what it found, how fast, and what it left out.
/// Fails when it finds none.
pub fn discover_nodes(
    key: &ClusterKey,
    wait: Duration,
    interfaces: &[String],
) -> Result<Vec<Found>> {
    let b = browse(Some(key), wait, interfaces)?;
    let mine: Vec<Found> = b.matching().into_iter().cloned().collect();
    let others: Vec<String> = b
        .found
        .iter()
        .filter(|f| f.same_cluster != Some(true))
        .map(|f| format!("'{}' ({})", f.name, f.address))
        .collect();
    if mine.is_empty() {
        anyhow::bail!(
            "discovery: no node of cluster {} answered on mDNS within {:.1} s{} (start nodes \
             with `ringllm node --advertise`, or list them with --node)",
            key.discovery_hash(),
            wait.as_secs_f64(),
            if others.is_empty() {
                String::new()
            } else {
                format!("; heard {} of other clusters", others.join(", "))
            }
        );
    }
    notice!(
        "discovered {} node{} of cluster {} in {:.2} s: {}",
        mine.len(),
        if mine.len() == 1 { "" } else { "s" },
        key.discovery_hash(),
        b.last_match_s(),
        mine.iter()
            .map(|f| format!("'{}' ({})", f.name, f.address))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if !others.is_empty() {
        notice!(
            "ignored {} of another cluster: {}",
            others.len(),
            others.join(", ")
        );
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
        let v4: IpAddr = "10.0.0.2".parse().unwrap();
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let v6: IpAddr = "fe80::1".parse().unwrap();
        assert_eq!(pick(&[lo, v6, v4], 7701).unwrap(), "10.0.0.2:7701");
        let g6: IpAddr = "fd00::2".parse().unwrap();
        assert_eq!(pick(&[lo, v6, g6], 7701).unwrap(), "[fd00::2]:7701");
        assert_eq!(pick(&[v6], 7701), None);
        assert_eq!(pick(&[lo], 7701).unwrap(), "127.0.0.1:7701");
        assert_eq!(pick(&[], 7701), None);
    }
}
