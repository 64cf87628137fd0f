//! `ringllm bench transports`: one-way latency (p50/p99, half a ping-pong round trip) and
//! throughput of every data-link transport, frame sizes 2.5 KB (Gemma 3 270M's hidden state),
//! 16 KB (an 8B model's) and 1 MiB, next to raw blocking sockets speaking the same frames
//! (header + payload; no seal, no handshake, no retransmission) over the same path.
//!
//! Both ends run in this process over loopback by default. Across machines or network
//! namespaces: `--echo-server HOST:PORT` on one side (it answers on PORT … PORT+6: tcp,
//! uring, udp, quic, raw tcp, raw udp, kmod), `--peer HOST:PORT` on the other.
//!
//! The echo side also measures what receiving the throughput burst cost it: CPU time of the
//! whole machine (every CPU's busy time in /proc/stat, softirqs included: where a kernel
//! module or the network stack does its work) and of its own process (getrusage), per MiB
//! received. It answers the burst's last frame with both figures. On one machine (loopback)
//! the machine figure includes the sender too.

use anyhow::{bail, Context, Result};
use clap::Args;
use ringllm_protocol::dial::{self, BoxLink, DataListener};
use ringllm_protocol::frame::DEFAULT_MAX_PAYLOAD;
use ringllm_protocol::{ClusterKey, Dtype, FrameHeader, FrameKind, TransportKind, HEADER_LEN};
use serde::Serialize;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::ExitCode;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(10);
/// The payload of acknowledgements (hidden-state frames are never empty).
const ACK: [u8; 4] = [0; 4];
/// Frame data per raw UDP datagram (the reliable UDP link's default chunk).
const RAW_UDP_CHUNK: usize = 1400;
/// The raw baselines' and the links' order of ports from the base port.
const KINDS: [Kind; 7] = [
    Kind::Link(TransportKind::Tcp),
    Kind::Link(TransportKind::Uring),
    Kind::Link(TransportKind::Udp),
    Kind::Link(TransportKind::Quic),
    Kind::RawTcp,
    Kind::RawUdp,
    Kind::Link(TransportKind::Kmod),
];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Link(TransportKind),
    RawTcp,
    RawUdp,
}

impl Kind {
    fn name(self) -> String {
        match self {
            Kind::Link(k) => k.name().to_string(),
            Kind::RawTcp => "raw tcp".into(),
            Kind::RawUdp => "raw udp".into(),
        }
    }
    fn offset(self) -> u16 {
        KINDS.iter().position(|&k| k == self).unwrap_or(0) as u16
    }
}

#[derive(Serialize)]
struct Row {
    transport: String,
    bytes: usize,
    p50_us: f64,
    p99_us: f64,
    /// p50 minus the raw socket's of the same family (TCP for tcp/uring/quic, UDP for udp).
    p50_over_raw_us: Option<f64>,
    mb_per_s: f64,
    /// CPU time the receiving machine spent per MiB of the burst (all CPUs' busy time).
    rx_machine_ms_per_mib: Option<f64>,
    /// CPU time the receiving process spent per MiB of the burst.
    rx_process_ms_per_mib: Option<f64>,
    /// Retransmissions, MAC failures and fast-path counters seen on the client's link.
    events: String,
}

/// A point in CPU time: the machine's busy nanoseconds (every CPU, from /proc/stat) and this
/// process's (getrusage).
#[derive(Clone, Copy)]
struct CpuMark {
    machine_ns: u64,
    process_ns: u64,
}

impl CpuMark {
    fn now() -> CpuMark {
        CpuMark {
            machine_ns: machine_busy_ns().unwrap_or(0),
            process_ns: process_cpu_ns(),
        }
    }

    /// What was spent since `self`, as the payload of the answer to a burst.
    fn since(self) -> [u8; 16] {
        let n = CpuMark::now();
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&n.machine_ns.saturating_sub(self.machine_ns).to_le_bytes());
        out[8..].copy_from_slice(&n.process_ns.saturating_sub(self.process_ns).to_le_bytes());
        out
    }
}

/// Busy time of every CPU (user, nice, system, irq, softirq, steal) in nanoseconds.
fn machine_busy_ns() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal
    let busy = [0, 1, 2, 5, 6, 7]
        .iter()
        .filter_map(|&i| f.get(i))
        .sum::<u64>();
    // SAFETY: sysconf takes no pointers.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some(busy * (1_000_000_000 / hz))
}

fn process_cpu_ns() -> u64 {
    // SAFETY: getrusage writes into the zeroed struct we pass.
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut r) } != 0 {
        return 0;
    }
    let ns = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    ns(r.ru_utime) + ns(r.ru_stime)
}

fn key() -> Result<ClusterKey> {
    Ok(ClusterKey::from_bytes(b"ringllm transport bench key")?)
}

fn frame(len: usize, tag: u64) -> Result<(FrameHeader, Vec<u8>)> {
    let payload: Vec<u8> = (0..len).map(|i| (i as u64 ^ tag) as u8).collect();
    let h = FrameHeader::new(FrameKind::Hidden, Dtype::F32, tag, 0, 1, 0, &payload)?;
    Ok((h, payload))
}

/// The echo side of one transport: answers every frame with itself; a frame with `pos == 1`
/// marks the end of a throughput burst and is answered with an empty frame.
fn echo_link(mut link: BoxLink) {
    let mut buf = Vec::new();
    let mut mark: Option<CpuMark> = None;
    while let Ok(h) = link.recv(&mut buf) {
        let r = if h.pos == 1 {
            let cpu = mark.take().map_or([0; 16], CpuMark::since);
            match FrameHeader::new(FrameKind::Hidden, Dtype::F32, h.seq, 2, 1, 0, &cpu) {
                Ok(ack) => link.send(&ack, &cpu),
                Err(_) => break,
            }
        } else if h.pos == 2 {
            mark.get_or_insert_with(CpuMark::now);
            continue;
        } else {
            link.send(&h, &buf)
        };
        if r.is_err() {
            break;
        }
    }
}

fn echo_raw_tcp(mut s: TcpStream) {
    let _ = s.set_nodelay(true);
    let mut head = [0u8; HEADER_LEN];
    let mut buf = Vec::new();
    let mut mark: Option<CpuMark> = None;
    loop {
        if s.read_exact(&mut head).is_err() {
            return;
        }
        let Ok(h) = FrameHeader::decode(&head, DEFAULT_MAX_PAYLOAD) else {
            return;
        };
        buf.resize(h.len as usize, 0);
        if s.read_exact(&mut buf).is_err() {
            return;
        }
        let r = if h.pos == 1 {
            let cpu = mark.take().map_or([0; 16], CpuMark::since);
            s.write_all(&ack_header(h.seq, &cpu))
                .and_then(|()| s.write_all(&cpu))
        } else if h.pos == 2 {
            mark.get_or_insert_with(CpuMark::now);
            Ok(())
        } else {
            s.write_all(&head).and_then(|()| s.write_all(&buf))
        };
        if r.is_err() {
            return;
        }
    }
}

fn ack_header(seq: u64, payload: &[u8]) -> [u8; HEADER_LEN] {
    FrameHeader::new(FrameKind::Hidden, Dtype::F32, seq, 2, 1, 0, payload)
        .map(|h| h.encode())
        .unwrap_or([0u8; HEADER_LEN])
}

/// Raw UDP: a frame is its header then payload cut into datagrams, no reliability.
fn raw_udp_send(s: &UdpSocket, to: Option<SocketAddr>, head: &[u8], payload: &[u8]) -> Result<()> {
    let mut all = Vec::with_capacity(head.len() + payload.len());
    all.extend_from_slice(head);
    all.extend_from_slice(payload);
    for c in all.chunks(RAW_UDP_CHUNK) {
        match to {
            Some(a) => s.send_to(c, a)?,
            None => s.send(c)?,
        };
    }
    Ok(())
}

/// Receives one raw UDP frame (header first); `None` on timeout (a datagram was lost).
fn raw_udp_recv(s: &UdpSocket, buf: &mut Vec<u8>) -> Result<Option<(FrameHeader, SocketAddr)>> {
    let mut dg = vec![0u8; 65536];
    let (n, from) = match s.recv_from(&mut dg) {
        Ok(x) => x,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            return Ok(None)
        }
        Err(e) => return Err(e.into()),
    };
    if n < HEADER_LEN {
        bail!("raw udp: short datagram");
    }
    let mut head = [0u8; HEADER_LEN];
    head.copy_from_slice(&dg[..HEADER_LEN]);
    let h = FrameHeader::decode(&head, DEFAULT_MAX_PAYLOAD)?;
    buf.clear();
    buf.extend_from_slice(&dg[HEADER_LEN..n]);
    while buf.len() < h.len as usize {
        match s.recv(&mut dg) {
            Ok(m) => buf.extend_from_slice(&dg[..m]),
            Err(_) => return Ok(None),
        }
    }
    Ok(Some((h, from)))
}

fn echo_raw_udp(s: UdpSocket) {
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    let mut buf = Vec::new();
    let mut mark: Option<CpuMark> = None;
    loop {
        match raw_udp_recv(&s, &mut buf) {
            Ok(Some((h, from))) => {
                let r = if h.pos == 1 {
                    let cpu = mark.take().map_or([0; 16], CpuMark::since);
                    raw_udp_send(&s, Some(from), &ack_header(h.seq, &cpu), &cpu)
                } else if h.pos == 2 {
                    mark.get_or_insert_with(CpuMark::now);
                    Ok(())
                } else {
                    raw_udp_send(&s, Some(from), &h.encode(), &buf)
                };
                if r.is_err() {
                    return;
                }
            }
            Ok(None) => continue,
            Err(_) => continue,
        }
    }
}

/// Serves every transport's echo from `base` port upwards until killed.
fn echo_server(base: SocketAddr, rt: &tokio::runtime::Runtime) -> Result<()> {
    let key = key()?;
    for kind in KINDS {
        let addr = SocketAddr::new(base.ip(), base.port() + kind.offset());
        match kind {
            Kind::Link(TransportKind::Kmod) if ringllm_protocol::kmod::probe().is_err() => {
                // Not loaded here: nothing to serve (the client says why it cannot connect).
                continue;
            }
            Kind::Link(t) => {
                let l = match rt.block_on(async {
                    DataListener::bind(addr, &key, "echo", t, DEFAULT_MAX_PAYLOAD)
                }) {
                    Ok(l) => l,
                    Err(e) => {
                        eprintln!("{}: not served: {e}", t.name());
                        continue;
                    }
                };
                rt.spawn(async move {
                    loop {
                        match l.accept(TIMEOUT).await {
                            Ok((link, _)) => {
                                std::thread::spawn(move || echo_link(link));
                            }
                            Err(e) => eprintln!("{}: {e}", t.name()),
                        }
                    }
                });
            }
            Kind::RawTcp => {
                let l = TcpListener::bind(addr)?;
                std::thread::spawn(move || {
                    for s in l.incoming().flatten() {
                        std::thread::spawn(move || echo_raw_tcp(s));
                    }
                });
            }
            Kind::RawUdp => {
                let s = UdpSocket::bind(addr)?;
                std::thread::spawn(move || echo_raw_udp(s));
            }
        }
    }
    Ok(())
}

enum Client {
    Link(BoxLink),
    RawTcp(TcpStream),
    RawUdp(UdpSocket),
}

impl Client {
    fn connect(kind: Kind, addr: SocketAddr, rt: &tokio::runtime::Runtime) -> Result<Client> {
        Ok(match kind {
            Kind::Link(t) => {
                let addr = addr.to_string();
                let spec = dial::DialSpec {
                    kind: t,
                    addr: &addr,
                    name: "bench",
                    timeout: TIMEOUT,
                    max_payload: DEFAULT_MAX_PAYLOAD,
                    ring_session: 1,
                    // The echo server sends every frame back on the same link.
                    role: dial::LinkRole::InputOutput,
                };
                Client::Link(rt.block_on(dial::connect_data_link(&spec, &key()?))?)
            }
            Kind::RawTcp => {
                let s = TcpStream::connect(addr)?;
                s.set_nodelay(true)?;
                Client::RawTcp(s)
            }
            Kind::RawUdp => {
                let any: SocketAddr = if addr.is_ipv4() {
                    "0.0.0.0:0".parse()?
                } else {
                    "[::]:0".parse()?
                };
                let s = UdpSocket::bind(any)?;
                s.connect(addr)?;
                s.set_read_timeout(Some(Duration::from_millis(500)))?;
                Client::RawUdp(s)
            }
        })
    }

    fn send(&mut self, h: &FrameHeader, p: &[u8]) -> Result<()> {
        match self {
            Client::Link(l) => l.send(h, p)?,
            Client::RawTcp(s) => {
                s.write_all(&h.encode())?;
                s.write_all(p)?;
            }
            Client::RawUdp(s) => raw_udp_send(s, None, &h.encode(), p)?,
        }
        Ok(())
    }

    /// The next frame; `None` when a raw UDP datagram was lost.
    fn recv(&mut self, buf: &mut Vec<u8>) -> Result<Option<FrameHeader>> {
        match self {
            Client::Link(l) => Ok(Some(l.recv(buf)?)),
            Client::RawTcp(s) => {
                let mut head = [0u8; HEADER_LEN];
                s.read_exact(&mut head)?;
                let h = FrameHeader::decode(&head, DEFAULT_MAX_PAYLOAD)?;
                buf.resize(h.len as usize, 0);
                s.read_exact(buf)?;
                Ok(Some(h))
            }
            Client::RawUdp(s) => Ok(raw_udp_recv(s, buf)?.map(|(h, _)| h)),
        }
    }

    fn events(&self) -> String {
        match self {
            Client::Link(l) => {
                let c = l.counters();
                c.events()
                    .iter()
                    .map(|(n, v)| format!("{n}={v}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            }
            _ => String::new(),
        }
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

/// Ping-pong latency and one-way burst throughput of one transport at one size.
fn measure(c: &mut Client, size: usize, iters: usize) -> Result<Measured> {
    let (h, p) = frame(size, 7)?;
    let mut buf = Vec::new();
    let mut rtts = Vec::with_capacity(iters);
    let warm = (iters / 10).max(3);
    let mut lost = 0;
    for i in 0..warm + iters {
        let t = Instant::now();
        c.send(&h, &p)?;
        match c.recv(&mut buf)? {
            Some(got) => {
                if got.len as usize != size || buf != p {
                    bail!("echo of a {size}-byte frame came back different");
                }
            }
            None => {
                lost += 1;
                if lost > iters / 10 + 3 {
                    bail!("too many lost frames (raw UDP has no retransmission)");
                }
                continue;
            }
        }
        if i >= warm {
            rtts.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    let p50 = percentile(&mut rtts, 0.5);
    let p99 = percentile(&mut rtts, 0.99);
    // Throughput: a burst of frames one way, then one that asks for an acknowledgement.
    let burst = ((64usize << 20) / size.max(1)).clamp(16, 4096);
    let t = Instant::now();
    // `pos` 2: not echoed; `pos` 1: answered with an empty frame.
    let hb = FrameHeader::new(FrameKind::Hidden, Dtype::F32, 8, 2, 1, 0, &p)?;
    for _ in 0..burst {
        c.send(&hb, &p)?;
    }
    let fin = FrameHeader::new(FrameKind::Hidden, Dtype::F32, 9, 1, 1, 0, &ACK)?;
    c.send(&fin, &ACK)?;
    let mut ok = false;
    for _ in 0..3 {
        if c.recv(&mut buf)?.is_some() {
            ok = true;
            break;
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let mbs = if ok {
        (burst * size) as f64 / secs / 1e6
    } else {
        f64::NAN
    };
    // The echo side's CPU time for the burst.
    let mib = (burst * size) as f64 / (1u64 << 20) as f64;
    let per_mib = |ns: u64| (ok && ns > 0).then(|| ns as f64 / 1e6 / mib);
    let word = |i: usize| {
        buf.get(i..i + 8)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u64::from_le_bytes)
    };
    Ok(Measured {
        p50,
        p99,
        mbs,
        rx_machine: per_mib(word(0)),
        rx_process: per_mib(word(8)),
    })
}

struct Measured {
    p50: f64,
    p99: f64,
    mbs: f64,
    rx_machine: Option<f64>,
    rx_process: Option<f64>,
}

/// `ringllm bench transports`.
#[derive(Args, Debug, Clone)]
pub struct TransportsBenchArgs {
    /// Only these transports (comma-separated; the raw baselines always run).
    #[arg(long = "transport", value_delimiter = ',')]
    pub transport_list: Vec<TransportKind>,
    /// Frame sizes in bytes (default 2560,16384,1048576).
    #[arg(long, value_delimiter = ',')]
    pub sizes: Vec<usize>,
    /// Round trips per size (a tenth of them for 1 MiB frames).
    #[arg(long, default_value_t = 2000)]
    pub iterations: usize,
    /// Measure against an echo server there (HOST:PORT) instead of one started in this
    /// process on loopback.
    #[arg(long)]
    pub peer: Option<String>,
    /// Run only the echo server, on HOST:PORT (… PORT+6), until killed.
    #[arg(long)]
    pub echo_server: Option<String>,
    /// Print results as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `ringllm bench transports`: see the module.
pub fn bench_transports(args: &TransportsBenchArgs) -> Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    if let Some(addr) = &args.echo_server {
        let a: SocketAddr = addr
            .parse()
            .with_context(|| format!("--echo-server {addr}"))?;
        echo_server(a, &rt)?;
        eprintln!("echo server on {a} (ports {}-{})", a.port(), a.port() + 6);
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    let base: SocketAddr = match &args.peer {
        Some(p) => p.parse().with_context(|| format!("--peer {p}"))?,
        None => {
            // A free block of 7 ports on loopback.
            let probe = TcpListener::bind("127.0.0.1:0")?;
            let port = probe.local_addr()?.port();
            drop(probe);
            let base = SocketAddr::from(([127, 0, 0, 1], port.min(65_000)));
            echo_server(base, &rt)?;
            base
        }
    };
    let sizes = if args.sizes.is_empty() {
        vec![2560, 16 << 10, 1 << 20]
    } else {
        args.sizes.clone()
    };
    let iters = args.iterations;
    let wanted: Vec<Kind> = if args.transport_list.is_empty() {
        KINDS.to_vec()
    } else {
        let mut v = vec![Kind::RawTcp, Kind::RawUdp];
        for t in &args.transport_list {
            v.push(Kind::Link(*t));
        }
        v
    };
    eprintln!("transports to {base}: sizes {sizes:?}, {iters} round trips each (one-way = half)");
    let mut rows: Vec<Row> = Vec::new();
    for kind in wanted {
        let addr = SocketAddr::new(base.ip(), base.port() + kind.offset());
        let mut c = match Client::connect(kind, addr, &rt) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("{}: cannot connect: {e:#}", kind.name());
                continue;
            }
        };
        for &size in &sizes {
            let n = if size >= 1 << 20 {
                (iters / 10).max(20)
            } else {
                iters
            };
            match measure(&mut c, size, n) {
                Ok(m) => rows.push(Row {
                    transport: kind.name(),
                    bytes: size,
                    p50_us: m.p50,
                    p99_us: m.p99,
                    p50_over_raw_us: None,
                    mb_per_s: m.mbs,
                    rx_machine_ms_per_mib: m.rx_machine,
                    rx_process_ms_per_mib: m.rx_process,
                    events: c.events(),
                }),
                Err(e) => eprintln!("{} at {size} bytes: {e:#}", kind.name()),
            }
        }
    }
    // Overheads against the raw socket of the same family, same size.
    let raw_of = |rows: &[Row], family: &str, size: usize| {
        rows.iter()
            .find(|r| r.transport == family && r.bytes == size)
            .map(|r| r.p50_us)
    };
    let over: Vec<Option<f64>> = rows
        .iter()
        .map(|r| {
            let fam = match r.transport.as_str() {
                "udp" | "kmod" => "raw udp",
                "raw tcp" | "raw udp" => return None,
                _ => "raw tcp",
            };
            raw_of(&rows, fam, r.bytes).map(|raw| r.p50_us - raw)
        })
        .collect();
    for (r, o) in rows.iter_mut().zip(over) {
        r.p50_over_raw_us = o;
    }
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "| transport | frame | one-way p50 µs | p99 µs | p50 − raw µs | MB/s | rx CPU ms/MiB machine | rx CPU ms/MiB process | counters |"
    );
    outln!("|---|---|---|---|---|---|---|---|---|");
    let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.2}"));
    for r in &rows {
        outln!(
            "| {} | {} | {:.1} | {:.1} | {} | {:.0} | {} | {} | {} |",
            r.transport,
            size_name(r.bytes),
            r.p50_us,
            r.p99_us,
            r.p50_over_raw_us
                .map_or("".to_string(), |v| format!("{v:+.1}")),
            r.mb_per_s,
            opt(r.rx_machine_ms_per_mib),
            opt(r.rx_process_ms_per_mib),
            r.events
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn size_name(b: usize) -> String {
    if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{} MiB", b >> 20)
    } else if b >= 1024 {
        format!("{:.1} KB", b as f64 / 1000.0)
    } else {
        format!("{b} B")
    }
}
