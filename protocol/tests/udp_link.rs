//! The reliable UDP transport over real loopback sockets and real threads: frames of every
//! size, a lossy relay, a relay that forges and replays datagrams, back-pressure, closing from
//! another thread, peers that close or crash, and wrong keys. No timing assertions beyond hang
//! guards; `udp_vs_tcp_numbers` (ignored) prints latency and throughput for comparison.

mod common;

use common::{data_frame, pattern, within};

use ringllm_protocol::seal::{DatagramSealer, LinkKeys, SEAL_LEN};
use ringllm_protocol::sock::bind_udp_reuse as bind_reuse;
use ringllm_protocol::udp::{UdpConfig, UdpDataLink, DATA_HEADER_LEN};
use ringllm_protocol::{
    DataLink, Dtype, FrameHeader, FrameKind, ProtocolError, TcpDataLink, TransportError, HEADER_LEN,
};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// No test should come near this; it turns a hang into a failure.
const TEST_LIMIT: Duration = Duration::from_secs(120);
const MAX_PAYLOAD: u32 = 64 << 20;

fn session_key() -> [u8; 32] {
    let mut k = [0u8; 32];
    getrandom::fill(&mut k).unwrap();
    k
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A connected TCP pair standing in for the links' negotiation connection.
fn anchor_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind(loopback()).unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

/// Two UDP sockets, each connected to `a_peer` / `b_peer` (None: to each other).
fn socket_pair() -> (UdpSocket, UdpSocket) {
    let a = bind_reuse(loopback()).unwrap();
    let b = bind_reuse(loopback()).unwrap();
    a.connect(b.local_addr().unwrap()).unwrap();
    b.connect(a.local_addr().unwrap()).unwrap();
    (a, b)
}

struct Pair {
    a: UdpDataLink,
    b: UdpDataLink,
    /// Clones of the anchors (to simulate a crash).
    anchor_a: TcpStream,
    /// Held so the anchor stays open as long as the pair.
    _anchor_b: TcpStream,
}

fn links(sa: UdpSocket, sb: UdpSocket, cfg_a: UdpConfig, cfg_b: UdpConfig) -> Pair {
    let key = session_key();
    links_with_keys(
        sa,
        sb,
        cfg_a,
        cfg_b,
        &LinkKeys::derive(&key, true),
        &LinkKeys::derive(&key, false),
    )
}

fn links_with_keys(
    sa: UdpSocket,
    sb: UdpSocket,
    cfg_a: UdpConfig,
    cfg_b: UdpConfig,
    ka: &LinkKeys,
    kb: &LinkKeys,
) -> Pair {
    let (ta, tb) = anchor_pair();
    let (anchor_a, anchor_b) = (ta.try_clone().unwrap(), tb.try_clone().unwrap());
    let a = UdpDataLink::new(sa, ta, ka, MAX_PAYLOAD, cfg_a).unwrap();
    let b = UdpDataLink::new(sb, tb, kb, MAX_PAYLOAD, cfg_b).unwrap();
    Pair {
        a,
        b,
        anchor_a,
        _anchor_b: anchor_b,
    }
}

fn direct_pair() -> Pair {
    let (sa, sb) = socket_pair();
    links(sa, sb, UdpConfig::default(), UdpConfig::default())
}

/// Sends frames `sizes` (payload seeded by index + `seed`) on `link` from a new thread.
fn send_all(
    mut link: UdpDataLink,
    sizes: Vec<usize>,
    seed: u64,
) -> JoinHandle<(UdpDataLink, Result<(), TransportError>)> {
    std::thread::spawn(move || {
        for (i, &n) in sizes.iter().enumerate() {
            let p = pattern(n, seed + i as u64);
            if let Err(e) = link.send(&data_frame(i as u64, &p), &p) {
                return (link, Err(e));
            }
        }
        (link, Ok(()))
    })
}

/// Receives frames `sizes` on `link` and checks each one.
fn recv_all(link: &mut UdpDataLink, sizes: &[usize], seed: u64) {
    let mut buf = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let h = link
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("frame {i} ({n} bytes): {e}"));
        assert_eq!(h.seq, i as u64, "frame {i} out of order");
        assert_eq!(h.len as usize, n, "frame {i}");
        assert!(buf == pattern(n, seed + i as u64), "frame {i} corrupted");
    }
}

fn frame_bytes(sizes: &[usize]) -> u64 {
    sizes.iter().map(|&n| (HEADER_LEN + n) as u64).sum()
}

/// Sends `sizes` from a to b, then from b to a, checking frames and counters (and, when
/// `clean`, that no seal was refused).
fn both_ways(mut p: Pair, sizes: Vec<usize>, clean: bool) -> Pair {
    let before = [p.a.counters().snapshot(), p.b.counters().snapshot()];
    let sender = send_all(p.a, sizes.clone(), 1000);
    recv_all(&mut p.b, &sizes, 1000);
    let (a, r) = sender.join().unwrap();
    r.unwrap();
    p.a = a;
    let sender = send_all(p.b, sizes.clone(), 2000);
    recv_all(&mut p.a, &sizes, 2000);
    let (b, r) = sender.join().unwrap();
    r.unwrap();
    p.b = b;
    let n = sizes.len() as u64;
    let bytes = frame_bytes(&sizes);
    for ((name, l), b) in [("a", &p.a), ("b", &p.b)].into_iter().zip(before) {
        let c = l.counters();
        let s = c.snapshot();
        assert_eq!(
            (s.0 - b.0, s.1 - b.1, s.2 - b.2, s.3 - b.3),
            (n, bytes, n, bytes),
            "counters of {name}"
        );
        if clean {
            assert_eq!(c.mac_failures.load(Ordering::Relaxed), 0, "{name}");
            assert_eq!(c.replays.load(Ordering::Relaxed), 0, "{name}");
        }
        assert_eq!(c.malformed.load(Ordering::Relaxed), 0, "{name}");
        assert_eq!(l.transport(), ringllm_protocol::TransportKind::Udp);
    }
    p
}

#[test]
fn frames_of_every_size_arrive_in_order_and_intact_both_ways() {
    within(TEST_LIMIT, || {
        let sizes = vec![
            1,
            2,
            39,
            40,
            41,
            1359,
            1360,
            1361,
            1400,
            2500,
            2801,
            65536,
            (64 << 10) * 3 + 7,
            1 << 20,
            (1 << 20) + 3,
            8 << 20,
            64 << 20,
            3,
        ];
        both_ways(direct_pair(), sizes, true);
    });
}

#[test]
fn many_small_frames_stream_without_waiting_for_the_receiver() {
    within(TEST_LIMIT, || {
        let sizes: Vec<usize> = (0..5000).map(|i| 1 + (i * 37) % 3000).collect();
        both_ways(direct_pair(), sizes, true);
    });
}

#[test]
fn control_frames_and_odd_chunk_sizes() {
    within(TEST_LIMIT, || {
        let (sa, sb) = socket_pair();
        let cfg = UdpConfig {
            chunk_payload: 64,
            max_window: 64,
            ..UdpConfig::default()
        };
        let mut p = links(sa, sb, cfg, UdpConfig::default());
        let ctl = b"a control message".to_vec();
        let h = FrameHeader::new(FrameKind::Control, Dtype::Bytes, 9, 0, 0, 0, &ctl).unwrap();
        p.a.send(&h, &ctl).unwrap();
        let empty = FrameHeader::new(FrameKind::Control, Dtype::Bytes, 10, 0, 0, 0, &[]).unwrap();
        p.a.send(&empty, &[]).unwrap();
        let mut buf = Vec::new();
        assert_eq!(p.b.recv(&mut buf).unwrap(), h);
        assert_eq!(buf, ctl);
        assert_eq!(p.b.recv(&mut buf).unwrap(), empty);
        assert!(buf.is_empty());
        // 64-byte chunks one way, 1400 the other.
        both_ways(p, vec![1, 24, 25, 100, 5000, 100_000], true);
    });
}

// ---------------------------------------------------------------------------------------
// The relay

#[derive(Clone, Default)]
struct RelayOpts {
    /// Drop this fraction of datagrams (each direction).
    loss: f64,
    /// Inject a forged datagram after every this many forwarded (0: never).
    forge_every: usize,
    /// Record every this many forwarded datagrams and send them again later (0: never).
    replay_every: usize,
    seed: u64,
}

#[derive(Default)]
struct RelayStats {
    forwarded: AtomicU64,
    dropped: AtomicU64,
    forged: AtomicU64,
    replayed: AtomicU64,
}

/// An in-process relay between two link sockets: each side's socket is connected to the
/// relay, which forwards, drops, forges and replays.
struct Relay {
    stop: Arc<AtomicBool>,
    /// Drop everything from now on.
    cut: Arc<AtomicBool>,
    /// Datagrams toward a (index 0) and toward b (index 1).
    stats: [Arc<RelayStats>; 2],
    threads: Vec<JoinHandle<()>>,
}

impl Relay {
    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

/// A forged datagram: random bytes, or a real datagram's header with fresh counters and a
/// wrong tag. Either fails the seal (its counter is far above anything sent).
fn forge(rng: &mut Rng, real: &[u8], i: u64) -> Vec<u8> {
    let mut d = if rng.next().is_multiple_of(2) {
        let n = 1 + (rng.next() % 1500) as usize;
        (0..n).map(|_| rng.next() as u8).collect::<Vec<u8>>()
    } else {
        let mut d = real.to_vec();
        let n = d.len();
        d[n - SEAL_LEN + 8..]
            .iter_mut()
            .for_each(|b| *b = rng.next() as u8);
        d
    };
    let n = d.len();
    if n >= SEAL_LEN {
        // A counter no real datagram reaches, so the seal check (not the replay window)
        // refuses it.
        let c = (1u64 << 62) + i;
        d[n - SEAL_LEN..n - SEAL_LEN + 8].copy_from_slice(&c.to_le_bytes());
    }
    d
}

fn relay_direction(
    from: UdpSocket,
    to: UdpSocket,
    opts: RelayOpts,
    stats: Arc<RelayStats>,
    stop: Arc<AtomicBool>,
    cut: Arc<AtomicBool>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        from.set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let mut rng = Rng(opts.seed | 1);
        let mut buf = vec![0u8; 65536];
        let mut recorded: Vec<Vec<u8>> = Vec::new();
        let mut n = 0usize;
        while !stop.load(Ordering::Relaxed) {
            let len = match from.recv(&mut buf) {
                Ok(len) => len,
                Err(_) => continue,
            };
            let d = &buf[..len];
            if cut.load(Ordering::Relaxed) || rng.chance(opts.loss) {
                stats.dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let _ = to.send(d);
            stats.forwarded.fetch_add(1, Ordering::Relaxed);
            n += 1;
            if opts.forge_every > 0 && n.is_multiple_of(opts.forge_every) {
                let i = stats.forged.fetch_add(1, Ordering::Relaxed);
                let _ = to.send(&forge(&mut rng, d, i));
            }
            if opts.replay_every > 0 && n.is_multiple_of(opts.replay_every) {
                recorded.push(d.to_vec());
            }
            // Replay a recording once it is old news (well behind the sender).
            if recorded.len() > 8 {
                let r = recorded.remove(0);
                let _ = to.send(&r);
                stats.replayed.fetch_add(1, Ordering::Relaxed);
            }
        }
        for r in recorded {
            let _ = to.send(&r);
            stats.replayed.fetch_add(1, Ordering::Relaxed);
        }
    })
}

/// Link sockets for a and b, both connected to a relay between them.
fn relayed_sockets(opts: RelayOpts) -> (UdpSocket, UdpSocket, Relay) {
    let sa = bind_reuse(loopback()).unwrap();
    let sb = bind_reuse(loopback()).unwrap();
    let ra = bind_reuse(loopback()).unwrap();
    let rb = bind_reuse(loopback()).unwrap();
    sa.connect(ra.local_addr().unwrap()).unwrap();
    ra.connect(sa.local_addr().unwrap()).unwrap();
    sb.connect(rb.local_addr().unwrap()).unwrap();
    rb.connect(sb.local_addr().unwrap()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let cut = Arc::new(AtomicBool::new(false));
    let stats = [
        Arc::new(RelayStats::default()),
        Arc::new(RelayStats::default()),
    ];
    let to_b = relay_direction(
        ra.try_clone().unwrap(),
        rb.try_clone().unwrap(),
        RelayOpts {
            seed: opts.seed ^ 0x55,
            ..opts.clone()
        },
        Arc::clone(&stats[1]),
        Arc::clone(&stop),
        Arc::clone(&cut),
    );
    let to_a = relay_direction(
        rb,
        ra,
        opts,
        Arc::clone(&stats[0]),
        Arc::clone(&stop),
        Arc::clone(&cut),
    );
    (
        sa,
        sb,
        Relay {
            stop,
            cut,
            stats,
            threads: vec![to_b, to_a],
        },
    )
}

fn lossy(loss: f64, seed: u64) {
    within(TEST_LIMIT, move || {
        let (sa, sb, mut relay) = relayed_sockets(RelayOpts {
            loss,
            seed,
            ..RelayOpts::default()
        });
        let mut p = links(sa, sb, UdpConfig::default(), UdpConfig::default());
        // Streams both ways, with 1 MiB frames among small ones.
        let sizes: Vec<usize> = (0..120)
            .map(|i| [2500, 1 << 20, 100, 70_000, 1, 1400][i % 6])
            .collect();
        p = both_ways(p, sizes, true);
        // Ping-pong: every loss of a frame's last chunk or of an ack must be recovered.
        let mut buf = Vec::new();
        let echo = std::thread::spawn(move || {
            let mut buf = Vec::new();
            for _ in 0..300 {
                let h = p.b.recv(&mut buf).unwrap();
                p.b.send(&h, &buf).unwrap();
            }
            p.b
        });
        for i in 0..300u64 {
            let body = pattern(2500, i);
            p.a.send(&data_frame(i, &body), &body).unwrap();
            let h = p.a.recv(&mut buf).unwrap();
            assert_eq!(h.seq, i);
            assert!(buf == body, "echo {i} corrupted");
        }
        let b = echo.join().unwrap();
        let (ca, cb) = (p.a.counters(), b.counters());
        let retransmits =
            ca.retransmits.load(Ordering::Relaxed) + cb.retransmits.load(Ordering::Relaxed);
        let dropped = relay.stats[0].dropped.load(Ordering::Relaxed)
            + relay.stats[1].dropped.load(Ordering::Relaxed);
        eprintln!(
            "loss {loss}: relay dropped {dropped}, retransmits a {:?} b {:?}, windows a {:?} b {:?}",
            ca.events(),
            cb.events(),
            p.a.window_stats(),
            b.window_stats()
        );
        assert!(dropped > 0);
        assert!(retransmits > 0);
        relay.stop();
    });
}

#[test]
fn one_percent_loss_loses_nothing() {
    lossy(0.01, 11);
}

#[test]
fn five_percent_loss_loses_nothing() {
    lossy(0.05, 12);
}

#[test]
fn forged_and_replayed_datagrams_are_dropped_and_counted() {
    within(TEST_LIMIT, || {
        let (sa, sb, mut relay) = relayed_sockets(RelayOpts {
            forge_every: 7,
            replay_every: 11,
            seed: 5,
            ..RelayOpts::default()
        });
        let mut p = links(sa, sb, UdpConfig::default(), UdpConfig::default());
        let sizes: Vec<usize> = (0..60).map(|i| [2500, 300_000, 10][i % 3]).collect();
        p = both_ways(p, sizes, false);
        relay.stop();
        let injected = |i: usize| {
            (
                relay.stats[i].forged.load(Ordering::Relaxed),
                relay.stats[i].replayed.load(Ordering::Relaxed),
            )
        };
        // Let the I/O threads read the last injections.
        let want = [injected(0), injected(1)];
        assert!(want[1].0 > 0 && want[1].1 > 0 && want[0].0 > 0 && want[0].1 > 0);
        let counted = |l: &UdpDataLink| {
            let c = l.counters();
            (
                c.mac_failures.load(Ordering::Relaxed),
                c.replays.load(Ordering::Relaxed),
            )
        };
        let t0 = Instant::now();
        while (counted(&p.a), counted(&p.b)) != (want[0], want[1])
            && t0.elapsed() < Duration::from_secs(5)
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            counted(&p.a),
            want[0],
            "a: (mac_failures, replays) vs injected"
        );
        assert_eq!(
            counted(&p.b),
            want[1],
            "b: (mac_failures, replays) vs injected"
        );
        assert_eq!(p.b.counters().malformed.load(Ordering::Relaxed), 0);
    });
}

#[test]
fn a_paused_receiver_stops_the_sender_and_it_resumes() {
    within(TEST_LIMIT, || {
        let (sa, sb) = socket_pair();
        let cfg = UdpConfig {
            recv_buffer: 1 << 20,
            // Shorter than the pause: probes keep the link alive.
            peer_timeout: Duration::from_millis(700),
            ..UdpConfig::default()
        };
        let mut p = links(sa, sb, cfg.clone(), cfg);
        let sent = Arc::new(AtomicUsize::new(0));
        let sizes = vec![256 << 10; 40];
        let (s2, sz) = (Arc::clone(&sent), sizes.clone());
        let mut a = p.a;
        let sender = std::thread::spawn(move || {
            for (i, &n) in sz.iter().enumerate() {
                let body = pattern(n, i as u64);
                a.send(&data_frame(i as u64, &body), &body).unwrap();
                s2.fetch_add(1, Ordering::Relaxed);
            }
            a
        });
        std::thread::sleep(Duration::from_millis(2000));
        let stuck_at = sent.load(Ordering::Relaxed);
        // The next frame plus 1 MiB of buffer (4 frames) at the receiver, and one frame the
        // sender has handed to the socket.
        assert!(
            stuck_at <= 8,
            "{stuck_at} frames sent to a receiver that reads none"
        );
        let mut buf = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let h = p.b.recv(&mut buf).unwrap();
            assert_eq!(h.seq, i as u64);
            assert!(buf == pattern(n, i as u64));
        }
        p.a = sender.join().unwrap();
        assert_eq!(sent.load(Ordering::Relaxed), 40);
    });
}

#[test]
fn an_owner_busy_elsewhere_does_not_stall_the_link() {
    within(TEST_LIMIT, || {
        // x talks to y (lossy, through a relay) and to z. x's thread first waits in z's
        // `recv`, then "computes" between frames from y: y's frames, their acks and their
        // retransmissions must flow all the same.
        let (sx, sy, mut relay) = relayed_sockets(RelayOpts {
            loss: 0.02,
            seed: 21,
            ..RelayOpts::default()
        });
        let p = links(sx, sy, UdpConfig::default(), UdpConfig::default());
        let (mut x_y, y) = (p.a, p.b);
        let mut q = direct_pair();
        let sizes: Vec<usize> = (0..20)
            .map(|i| if i % 2 == 0 { 1 << 20 } else { 3000 })
            .collect();
        let sender = send_all(y, sizes.clone(), 500);
        let z = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            let body = pattern(100, 1);
            q.b.send(&data_frame(0, &body), &body).unwrap();
            q.b
        });
        let mut buf = Vec::new();
        q.a.recv(&mut buf).unwrap();
        let mut got = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let h = x_y.recv(&mut buf).unwrap();
            assert_eq!(h.seq, i as u64);
            assert!(buf == pattern(n, 500 + i as u64), "frame {i} corrupted");
            got.push(i);
            std::thread::sleep(Duration::from_millis(20));
        }
        let (y, r) = sender.join().unwrap();
        r.unwrap();
        let _zb = z.join().unwrap();
        assert!(y.counters().retransmits.load(Ordering::Relaxed) > 0);
        assert_eq!(got.len(), sizes.len());
        relay.stop();
    });
}

#[test]
fn peer_close_is_closed_after_every_frame_even_through_loss() {
    within(TEST_LIMIT, || {
        let (sa, sb, mut relay) = relayed_sockets(RelayOpts {
            loss: 0.05,
            seed: 77,
            ..RelayOpts::default()
        });
        let mut p = links(sa, sb, UdpConfig::default(), UdpConfig::default());
        let sizes = vec![100, 1 << 20, 2500, 1];
        for (i, &n) in sizes.iter().enumerate() {
            let body = pattern(n, i as u64);
            p.a.send(&data_frame(i as u64, &body), &body).unwrap();
        }
        // Closing right after the last send: the link lingers until b has everything.
        drop(p.a);
        recv_all(&mut p.b, &sizes, 0);
        let mut buf = Vec::new();
        let r = p.b.recv(&mut buf);
        assert!(matches!(r, Err(TransportError::Closed)), "{r:?}");
        assert!(p.b.send(&data_frame(0, &[1]), &[1]).is_err());
        relay.stop();
    });
}

#[test]
fn peer_crash_mid_frame_is_an_error_not_a_hang() {
    within(TEST_LIMIT, || {
        let (sa, sb, mut relay) = relayed_sockets(RelayOpts::default());
        let p = links(sa, sb, UdpConfig::default(), UdpConfig::default());
        let (mut a, mut b) = (p.a, p.b);
        let (relay_cut, stats_b) = (Arc::clone(&relay.cut), Arc::clone(&relay.stats[1]));
        let sender = std::thread::spawn(move || {
            let body = pattern(8 << 20, 3);
            a.send(&data_frame(0, &body), &body)
        });
        // Once part of the frame went through, the peer "dies": its datagrams stop and the
        // kernel closes its anchor.
        while stats_b.forwarded.load(Ordering::Relaxed) < 200 {
            std::thread::sleep(Duration::from_millis(1));
        }
        relay_cut.store(true, Ordering::Relaxed);
        let t0 = Instant::now();
        p.anchor_a.shutdown(std::net::Shutdown::Both).unwrap();
        let mut buf = Vec::new();
        let r = b.recv(&mut buf);
        let took = t0.elapsed();
        assert!(
            matches!(
                r,
                Err(TransportError::Protocol(ProtocolError::Inconsistent(_)))
            ),
            "{r:?}"
        );
        assert!(took < Duration::from_secs(5), "noticed after {took:?}");
        assert!(sender.join().unwrap().is_err());
        relay.stop();
    });
}

#[test]
fn peer_reset_is_an_error_not_a_hang() {
    within(TEST_LIMIT, || {
        let (sa, sb) = socket_pair();
        let (ta, tb) = anchor_pair();
        let key = session_key();
        let mut b = UdpDataLink::new(
            sb,
            tb,
            &LinkKeys::derive(&key, false),
            MAX_PAYLOAD,
            UdpConfig::default(),
        )
        .unwrap();
        let t = std::thread::spawn(move || {
            let mut buf = Vec::new();
            let t0 = Instant::now();
            (b.recv(&mut buf), t0.elapsed())
        });
        // A raw peer sends one sealed chunk of a frame, then its process "dies" with data
        // unread on its anchor: the kernel resets the connection.
        let sealer = DatagramSealer::new(&LinkKeys::derive(&key, true).send);
        let mut hdr = [0u8; DATA_HEADER_LEN];
        hdr[0] = 1;
        hdr[1] = 1;
        hdr[2..4].copy_from_slice(&1400u16.to_le_bytes());
        hdr[8..12].copy_from_slice(&3u32.to_le_bytes());
        hdr[12..16].copy_from_slice(&3000u32.to_le_bytes());
        hdr[16..24].copy_from_slice(&1u64.to_le_bytes());
        hdr[24..32].copy_from_slice(&1u64.to_le_bytes());
        let payload = pattern(3000 - HEADER_LEN, 4);
        let data = [
            &data_frame(0, &payload).encode()[..],
            &payload[..1400 - HEADER_LEN],
        ]
        .concat();
        let seal = sealer.seal(1, &[&hdr[..], &data].concat());
        sa.send(&[&hdr[..], &data, &seal].concat()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let s = socket2::SockRef::from(&ta);
        s.set_linger(Some(Duration::ZERO)).unwrap();
        drop(ta);
        let (r, _) = t.join().unwrap();
        assert!(r.is_err(), "{r:?}");
    });
}

#[test]
fn wrong_keys_deliver_nothing() {
    within(TEST_LIMIT, || {
        let (sa, sb) = socket_pair();
        let cfg = UdpConfig {
            peer_timeout: Duration::from_millis(500),
            ..UdpConfig::default()
        };
        let mut p = links_with_keys(
            sa,
            sb,
            cfg.clone(),
            cfg,
            &LinkKeys::derive(&session_key(), true),
            &LinkKeys::derive(&session_key(), false),
        );
        let body = pattern(2500, 9);
        p.a.send(&data_frame(0, &body), &body).unwrap();
        let mut buf = Vec::new();
        assert!(p
            .b
            .recv_timeout(&mut buf, Duration::from_millis(300))
            .unwrap()
            .is_none());
        assert!(p.b.counters().mac_failures.load(Ordering::Relaxed) > 0);
        assert_eq!(p.b.counters().snapshot().2, 0);
        // The sender hears nothing authentic back and gives up.
        let err = loop {
            match p.a.send(&data_frame(1, &body), &body) {
                Ok(()) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => break e,
            }
        };
        assert!(matches!(err, TransportError::Timeout(..)), "{err}");
        assert!(
            p.b.recv_timeout(&mut buf, Duration::from_millis(50))
                .is_err()
                || buf.is_empty()
        );
    });
}

#[test]
fn a_frame_over_the_receivers_cap_is_an_error() {
    within(TEST_LIMIT, || {
        let (sa, sb) = socket_pair();
        let (ta, tb) = anchor_pair();
        let key = session_key();
        let mut a = UdpDataLink::new(
            sa,
            ta,
            &LinkKeys::derive(&key, true),
            MAX_PAYLOAD,
            UdpConfig::default(),
        )
        .unwrap();
        let mut b = UdpDataLink::new(
            sb,
            tb,
            &LinkKeys::derive(&key, false),
            2 << 20,
            UdpConfig::default(),
        )
        .unwrap();
        let body = pattern(3 << 20, 1);
        a.send(&data_frame(0, &body), &body).unwrap();
        let mut buf = Vec::new();
        let r = b.recv(&mut buf);
        assert!(
            matches!(
                r,
                Err(TransportError::Protocol(ProtocolError::TooLarge { .. }))
            ),
            "{r:?}"
        );
        assert!(b.counters().malformed.load(Ordering::Relaxed) > 0);
        // The link is over for good after that.
        assert!(b.recv(&mut buf).is_err());
        // A data frame under the control cap but over this receiver's cap is refused too.
        let (sa, sb) = socket_pair();
        let (ta, tb) = anchor_pair();
        let ka = LinkKeys::derive(&key, true);
        let kb = LinkKeys::derive(&key, false);
        let mut a = UdpDataLink::new(sa, ta, &ka, MAX_PAYLOAD, UdpConfig::default()).unwrap();
        let mut b = UdpDataLink::new(sb, tb, &kb, 1000, UdpConfig::default()).unwrap();
        let body = pattern(5000, 2);
        a.send(&data_frame(0, &body), &body).unwrap();
        let r = b.recv(&mut buf);
        assert!(
            matches!(
                r,
                Err(TransportError::Protocol(ProtocolError::TooLarge { .. }))
            ),
            "{r:?}"
        );
    });
}

#[test]
fn bind_reuse_shares_a_port_between_connected_sockets() {
    let listen = bind_reuse(loopback()).unwrap();
    let port_addr = listen.local_addr().unwrap();
    let p1 = UdpSocket::bind(loopback()).unwrap();
    let p2 = UdpSocket::bind(loopback()).unwrap();
    let p3 = UdpSocket::bind(loopback()).unwrap();
    let s1 = bind_reuse(port_addr).unwrap();
    s1.connect(p1.local_addr().unwrap()).unwrap();
    let s2 = bind_reuse(port_addr).unwrap();
    s2.connect(p2.local_addr().unwrap()).unwrap();
    for s in [&listen, &s1, &s2] {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    }
    p1.send_to(b"one", port_addr).unwrap();
    p2.send_to(b"two", port_addr).unwrap();
    p3.send_to(b"three", port_addr).unwrap();
    let mut buf = [0u8; 16];
    let n = s1.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"one");
    let n = s2.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"two");
    let (n, from) = listen.recv_from(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"three");
    assert_eq!(from, p3.local_addr().unwrap());
}

#[test]
fn bad_configuration_and_unconnected_sockets_are_refused() {
    let key = session_key();
    let keys = LinkKeys::derive(&key, true);
    let (ta, _tb) = anchor_pair();
    let s = bind_reuse(loopback()).unwrap();
    let e = UdpDataLink::new(
        s,
        ta.try_clone().unwrap(),
        &keys,
        MAX_PAYLOAD,
        UdpConfig::default(),
    )
    .err()
    .expect("unconnected socket refused");
    assert!(e.to_string().contains("connected"), "{e}");
    let (sa, _sb) = socket_pair();
    let e = UdpDataLink::new(
        sa,
        ta,
        &keys,
        MAX_PAYLOAD,
        UdpConfig {
            chunk_payload: 10,
            ..UdpConfig::default()
        },
    )
    .err()
    .expect("tiny chunks refused");
    assert!(e.to_string().contains("chunk_payload"), "{e}");
}

// ---------------------------------------------------------------------------------------
// Numbers, run by hand (one at a time; UDP_BENCH=latency or throughput for half, UDP_BENCH_ALL=1
// for more percentiles):
//   cargo test --release -p ringllm-protocol --test udp_link -- --ignored --nocapture --test-threads=1

fn percentiles(mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    if std::env::var_os("UDP_BENCH_ALL").is_some() {
        let q: Vec<Duration> = [50, 80, 90, 95, 97, 98, 99]
            .iter()
            .map(|p| v[v.len() * p / 100])
            .collect();
        println!("  p50..p99 {q:?} max {:?}", v[v.len() - 1]);
    }
    (v[v.len() / 2], v[v.len() * 99 / 100])
}

const PING_SIZE: usize = 2500;
const PINGS: usize = 5000;

fn raw_udp_ping_pong() -> (Duration, Duration) {
    let (a, b) = socket_pair();
    let echo = std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        for _ in 0..PINGS {
            let n = b.recv(&mut buf).unwrap();
            b.send(&buf[..n]).unwrap();
        }
    });
    let msg = vec![7u8; PING_SIZE + HEADER_LEN];
    let mut buf = vec![0u8; 65536];
    let mut v = Vec::with_capacity(PINGS);
    for _ in 0..PINGS {
        let t0 = Instant::now();
        a.send(&msg).unwrap();
        a.recv(&mut buf).unwrap();
        v.push(t0.elapsed() / 2);
    }
    echo.join().unwrap();
    percentiles(v)
}

fn link_ping_pong<L: DataLink + 'static>(mut a: L, mut b: L) -> (Duration, Duration) {
    let echo = std::thread::spawn(move || {
        let mut buf = Vec::new();
        for _ in 0..PINGS {
            let h = b.recv(&mut buf).unwrap();
            b.send(&h, &buf).unwrap();
        }
        b
    });
    let body = pattern(PING_SIZE, 1);
    let h = data_frame(1, &body);
    let mut buf = Vec::new();
    let mut v = Vec::with_capacity(PINGS);
    for _ in 0..PINGS {
        let t0 = Instant::now();
        a.send(&h, &body).unwrap();
        a.recv(&mut buf).unwrap();
        v.push(t0.elapsed() / 2);
    }
    let _b = echo.join().unwrap();
    percentiles(v)
}

/// MB/s of `n` 1 MiB frames from a to b.
fn link_throughput<L: DataLink + 'static>(mut a: L, mut b: L, n: usize) -> f64 {
    let body = pattern(1 << 20, 2);
    let h = data_frame(1, &body);
    // Warm up.
    let rx = std::thread::spawn(move || {
        let mut buf = Vec::new();
        for _ in 0..n + 5 {
            b.recv(&mut buf).unwrap();
        }
        b
    });
    for _ in 0..5 {
        a.send(&h, &body).unwrap();
    }
    let t0 = Instant::now();
    for _ in 0..n {
        a.send(&h, &body).unwrap();
    }
    let _b = rx.join().unwrap();
    (n as f64 * (1 << 20) as f64) / t0.elapsed().as_secs_f64() / 1e6
}

fn tcp_pair() -> (TcpDataLink, TcpDataLink) {
    let key = session_key();
    let (a, b) = anchor_pair();
    (
        TcpDataLink::new(a, MAX_PAYLOAD, &LinkKeys::derive(&key, true)).unwrap(),
        TcpDataLink::new(b, MAX_PAYLOAD, &LinkKeys::derive(&key, false)).unwrap(),
    )
}

#[test]
#[ignore]
fn udp_vs_tcp_numbers() {
    // UDP_BENCH=latency or throughput runs only that half.
    let what = std::env::var("UDP_BENCH").unwrap_or_default();
    if what != "throughput" {
        latency_numbers();
    }
    if what != "latency" {
        throughput_numbers();
    }
}

fn latency_numbers() {
    let raw = raw_udp_ping_pong();
    let p = direct_pair();
    let (ca, cb) = (p.a.counters(), p.b.counters());
    let udp = link_ping_pong(p.a, p.b);
    println!(
        "udp ping-pong events: a {:?} b {:?}",
        ca.events(),
        cb.events()
    );
    let (ta, tb) = tcp_pair();
    let tcp = link_ping_pong(ta, tb);
    println!("one-way latency of a {PING_SIZE}-byte frame (p50, p99):");
    println!("  raw UDP datagram ping-pong {:?} {:?}", raw.0, raw.1);
    println!("  UdpDataLink                {:?} {:?}", udp.0, udp.1);
    println!("  TcpDataLink                {:?} {:?}", tcp.0, tcp.1);
}

fn throughput_numbers() {
    // Alternating rounds, so that load from elsewhere on the machine hits both alike.
    let n = 200;
    let (mut tcp, mut udp) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let (ta, tb) = tcp_pair();
        tcp.push(link_throughput(ta, tb, n));
        let p = direct_pair();
        let ca = p.a.counters();
        udp.push(link_throughput(p.a, p.b, n));
        println!(
            "1 MiB frames: TcpDataLink {:.0} MB/s, UdpDataLink {:.0} MB/s; udp sender events {:?}",
            tcp[tcp.len() - 1],
            udp[udp.len() - 1],
            ca.events()
        );
    }
    tcp.sort_by(f64::total_cmp);
    udp.sort_by(f64::total_cmp);
    println!(
        "median: TcpDataLink {:.0} MB/s, UdpDataLink {:.0} MB/s ({:.0}%)",
        tcp[1],
        udp[1],
        udp[1] / tcp[1] * 100.0
    );
}

/// What one hop costs in CPU: a seal, and `send`/`recv` of a 2.5 KB frame without waiting.
#[test]
#[ignore]
fn udp_cpu_costs() {
    let key = session_key();
    let s = DatagramSealer::new(&LinkKeys::derive(&key, true).send);
    let d = vec![5u8; 1432];
    let t0 = Instant::now();
    let mut x = 0u8;
    for i in 0..100_000u64 {
        x ^= s.seal(i, &d)[9];
    }
    println!("seal of 1432 bytes: {:?} ({x})", t0.elapsed() / 100_000);
    let p = direct_pair();
    let (mut a, mut b) = (p.a, p.b);
    let body = pattern(PING_SIZE, 1);
    let h = data_frame(1, &body);
    let mut buf = Vec::new();
    let mut ts = Vec::new();
    let mut tr = Vec::new();
    for _ in 0..5000 {
        let t0 = Instant::now();
        a.send(&h, &body).unwrap();
        ts.push(t0.elapsed());
        let t1 = Instant::now();
        b.recv(&mut buf).unwrap();
        tr.push(t1.elapsed());
    }
    println!(
        "send {:?} recv-after-send {:?}",
        percentiles(ts),
        percentiles(tr)
    );
}
