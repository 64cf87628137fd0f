//! The io_uring data link over real loopback sockets: frames of every size both ways, against
//! itself and against `TcpDataLink` in both directions, back-pressure, closing from another
//! thread, and peers that misbehave (early close, forged seals, replays, huge lengths).
#![cfg(target_os = "linux")]

mod common;

use common::{data_frame, pattern, percentile, within};

use ringllm_protocol::frame::{FrameHeader, FLAG_ALL_TOKENS};
use ringllm_protocol::seal::{LinkKeys, SealError, Sealer, SEAL_LEN};
use ringllm_protocol::uring::{probe, UringConfig, UringDataLink};
use ringllm_protocol::{
    DataLink, Dtype, FrameKind, LinkCounters, ProtocolError, TcpDataLink, TransportError,
    HEADER_LEN,
};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

/// No test should come near this; it turns a hang into a failure.
const TEST_LIMIT: Duration = Duration::from_secs(120);
const MAX: u32 = 256 << 20;

/// A connected loopback pair: (initiator, acceptor).
fn socket_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

fn keys() -> (LinkKeys, LinkKeys) {
    let k = [0x5a; 32];
    (LinkKeys::derive(&k, true), LinkKeys::derive(&k, false))
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Uring,
    Tcp,
}

fn make(kind: Kind, s: TcpStream, k: &LinkKeys, max: u32) -> Box<dyn DataLink> {
    match kind {
        Kind::Uring => Box::new(UringDataLink::new(s, max, k, UringConfig::default()).unwrap()),
        Kind::Tcp => Box::new(TcpDataLink::new(s, max, k).unwrap()),
    }
}

/// An authenticated pair of links of the given kinds.
fn pair(a: Kind, b: Kind, max: u32) -> (Box<dyn DataLink>, Box<dyn DataLink>) {
    let (sa, sb) = socket_pair();
    let (ka, kb) = keys();
    (make(a, sa, &ka, max), make(b, sb, &kb, max))
}

fn uring_pair(cfg_a: UringConfig, cfg_b: UringConfig) -> (UringDataLink, UringDataLink) {
    let (sa, sb) = socket_pair();
    let (ka, kb) = keys();
    (
        UringDataLink::new(sa, MAX, &ka, cfg_a).unwrap(),
        UringDataLink::new(sb, MAX, &kb, cfg_b).unwrap(),
    )
}

fn load(c: &std::sync::atomic::AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

const SIZES: &[usize] = &[
    1,
    2,
    3,
    39,
    40,
    41,
    2560,
    4095,
    4096,
    4097,
    16 << 10,
    (16 << 10) + 1,
    65535,
    65536,
    65537,
    (64 << 10) * 3 + 7,
    (256 << 10) - 1,
    256 << 10,
    1 << 20,
    (1 << 20) + 3,
    4 << 20,
    (8 << 20) + 11,
    64 << 20,
];

/// Sends every size of `SIZES` from `tx` (on its own thread) and checks them on `rx`; both
/// links come back.
fn exchange(
    tx: Box<dyn DataLink>,
    mut rx: Box<dyn DataLink>,
    seed: u64,
) -> (Box<dyn DataLink>, Box<dyn DataLink>) {
    let sender = thread::spawn(move || {
        let mut tx = tx;
        for (i, &n) in SIZES.iter().enumerate() {
            let payload = pattern(n, seed + i as u64);
            tx.send(&data_frame(i as u64, &payload), &payload)
                .unwrap_or_else(|e| panic!("send of {n} bytes: {e}"));
        }
        tx
    });
    let mut buf = Vec::new();
    for (i, &n) in SIZES.iter().enumerate() {
        let h = rx
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("recv of {n} bytes: {e}"));
        assert_eq!(h.seq, i as u64, "frames in order");
        assert_eq!(h.pos, i as u32);
        assert_eq!(h.kind, FrameKind::Hidden);
        assert_eq!(h.len as usize, n);
        assert_eq!(buf.len(), n);
        assert!(
            buf == pattern(n, seed + i as u64),
            "payload {i} ({n} bytes) differs"
        );
    }
    let tx = sender.join().unwrap();
    (tx, rx)
}

fn wire_bytes() -> u64 {
    SIZES
        .iter()
        .map(|&n| (n + HEADER_LEN + SEAL_LEN) as u64)
        .sum()
}

fn both_ways(a: Kind, b: Kind) -> (Arc<LinkCounters>, Arc<LinkCounters>) {
    let (la, lb) = pair(a, b, MAX);
    let (ca, cb) = (la.counters(), lb.counters());
    let (la, lb) = exchange(la, lb, 100);
    let (_lb, _la) = exchange(lb, la, 200);
    let frames = SIZES.len() as u64;
    let bytes = wire_bytes();
    assert_eq!(ca.snapshot(), (frames, bytes, frames, bytes));
    assert_eq!(cb.snapshot(), (frames, bytes, frames, bytes));
    (ca, cb)
}

#[test]
fn probe_succeeds_and_reports_send_zc() {
    let s = probe().expect("io_uring is available on the test machine");
    assert!(s.send_zc, "this kernel ({}) has SEND_ZC", s.kernel);
    assert!(!s.kernel.is_empty());
}

#[test]
fn uring_to_uring_frames_of_every_size_both_ways() {
    within(TEST_LIMIT, || {
        let (ca, cb) = both_ways(Kind::Uring, Kind::Uring);
        for c in [&ca, &cb] {
            assert!(load(&c.zc_sends) > 0, "{:?}", c.events());
            assert!(load(&c.fixed_buf_ops) > 0, "{:?}", c.events());
            // Loopback copies zero-copy data; whatever the kernel did is reported.
            assert!(load(&c.zc_copied) <= load(&c.zc_sends));
            assert_eq!(load(&c.mac_failures), 0);
            assert_eq!(load(&c.replays), 0);
        }
    });
}

#[test]
fn uring_sender_to_tcp_receiver_and_back() {
    within(TEST_LIMIT, || {
        let (cu, ct) = both_ways(Kind::Uring, Kind::Tcp);
        assert!(load(&cu.zc_sends) > 0, "{:?}", cu.events());
        assert!(load(&cu.fixed_buf_ops) > 0);
        assert_eq!(load(&ct.zc_sends), 0);
    });
}

#[test]
fn tcp_sender_to_uring_receiver_and_back() {
    within(TEST_LIMIT, || {
        let (ct, cu) = both_ways(Kind::Tcp, Kind::Uring);
        assert!(load(&cu.zc_sends) > 0, "{:?}", cu.events());
        assert!(load(&cu.fixed_buf_ops) > 0);
        assert_eq!(load(&ct.fixed_buf_ops), 0);
    });
}

#[test]
fn small_frames_ping_pong_with_every_header_field() {
    within(TEST_LIMIT, || {
        let (mut a, mut b) = uring_pair(UringConfig::default(), UringConfig::default());
        let mut buf = Vec::new();
        for i in 0..2000u64 {
            let payload = pattern(4 * (1 + (i as usize % 700)), i);
            let n = (payload.len() / 4) as u32;
            let h = FrameHeader::new(
                FrameKind::Logits,
                Dtype::F32,
                i,
                i as u32 * 3,
                n,
                FLAG_ALL_TOKENS,
                &payload,
            )
            .unwrap();
            a.send(&h, &payload).unwrap();
            assert_eq!(b.recv(&mut buf).unwrap(), h);
            assert_eq!(buf, payload);
            b.send(&h, &payload).unwrap();
            assert_eq!(a.recv(&mut buf).unwrap(), h);
            assert_eq!(buf, payload);
        }
        let c = a.counters();
        // One fixed write per small frame at least, and fixed reads.
        assert!(load(&c.fixed_buf_ops) >= 4000, "{:?}", c.events());
        assert_eq!(load(&c.zc_sends), 0);
        assert_eq!(a.transport(), ringllm_protocol::TransportKind::Uring);
    });
}

#[test]
fn zero_copy_can_be_turned_off_and_pieces_configured() {
    within(TEST_LIMIT, || {
        let off = UringConfig {
            zc_threshold: usize::MAX,
            ..UringConfig::default()
        };
        let tiny = UringConfig {
            zc_threshold: 1,
            zc_chunk: 64 << 10,
            zc_inflight: 256 << 10,
            buffer: 4096,
            ..UringConfig::default()
        };
        let (a, b) = uring_pair(off, tiny);
        assert!(!a.zero_copy_for(64 << 20));
        assert!(b.zero_copy_for(1));
        let (ca, cb) = (a.counters(), b.counters());
        let (a, b) = exchange(Box::new(a), Box::new(b), 7);
        let _ = exchange(b, a, 8);
        assert_eq!(load(&ca.zc_sends), 0);
        // Every payload went by SEND_ZC in 64 KiB pieces.
        let pieces: usize = SIZES.iter().map(|n| n.div_ceil(64 << 10)).sum();
        assert!(load(&cb.zc_sends) >= pieces as u64, "{:?}", cb.events());
    });
}

#[test]
fn back_pressure_blocks_the_sender_until_the_receiver_reads() {
    within(TEST_LIMIT, || {
        for zc in [true, false] {
            let cfg = UringConfig {
                zc_threshold: if zc { 64 << 10 } else { usize::MAX },
                ..UringConfig::default()
            };
            let (mut a, mut b) = uring_pair(cfg.clone(), cfg);
            // 64 MiB in 1 MiB frames, far more than the socket buffers hold.
            const FRAMES: usize = 64;
            let sent = Arc::new(AtomicUsize::new(0));
            let sent2 = Arc::clone(&sent);
            let sender = thread::spawn(move || {
                for i in 0..FRAMES {
                    let p = pattern(1 << 20, i as u64);
                    a.send(&data_frame(i as u64, &p), &p).unwrap();
                    sent2.fetch_add(1, Ordering::SeqCst);
                }
                a
            });
            thread::sleep(Duration::from_millis(300));
            let before = sent.load(Ordering::SeqCst);
            assert!(
                before < FRAMES,
                "the sender did not block ({before} frames sent)"
            );
            let mut buf = Vec::new();
            for i in 0..FRAMES {
                let h = b.recv(&mut buf).unwrap();
                assert_eq!(h.seq, i as u64);
                assert!(buf == pattern(1 << 20, i as u64), "frame {i} differs");
            }
            let a = sender.join().unwrap();
            assert_eq!(sent.load(Ordering::SeqCst), FRAMES);
            assert_eq!(load(&a.counters().frames_out), FRAMES as u64);
        }
    });
}

#[test]
fn closer_unblocks_a_sender_stuck_on_a_peer_that_does_not_read() {
    within(TEST_LIMIT, || {
        for zc in [true, false] {
            let cfg = UringConfig {
                zc_threshold: if zc { 64 << 10 } else { usize::MAX },
                ..UringConfig::default()
            };
            let (mut a, _b) = uring_pair(cfg.clone(), cfg);
            let closer = a.closer().unwrap();
            let h = thread::spawn(move || {
                let p = pattern(4 << 20, 1);
                for i in 0..64u64 {
                    if let Err(e) = a.send(&data_frame(i, &p), &p) {
                        return Some(e);
                    }
                }
                None
            });
            thread::sleep(Duration::from_millis(300));
            closer.close();
            let r = h.join().unwrap();
            match r {
                Some(e) => eprintln!("zero-copy {zc}: the blocked send ended with: {e}"),
                None => panic!("all 256 MiB were sent to a peer that never reads"),
            }
        }
    });
}

/// A zero-copy send returns only once the peer has acknowledged the data; a peer that stops
/// reading keeps it queued. Closing the link from another thread still ends the wait, and the
/// link refuses to be used afterwards.
#[test]
fn closer_ends_a_wait_for_zero_copy_notifications() {
    within(TEST_LIMIT, || {
        for chunk in [64usize << 10, 1 << 20] {
            let cfg = UringConfig {
                zc_threshold: 1,
                zc_chunk: chunk,
                zc_inflight: 256 << 20,
                ..UringConfig::default()
            };
            let (mut a, _b) = uring_pair(cfg.clone(), cfg);
            let closer = a.closer().unwrap();
            let h = thread::spawn(move || {
                let p = pattern(3 << 20, 1);
                for i in 0..64u64 {
                    if let Err(e) = a.send(&data_frame(i, &p), &p) {
                        return (Some(e), a);
                    }
                }
                (None, a)
            });
            thread::sleep(Duration::from_millis(300));
            closer.close();
            let (r, mut a) = h.join().unwrap();
            match r {
                Some(TransportError::Io(e)) => {
                    assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}")
                }
                other => panic!("expected a broken pipe, got {other:?}"),
            }
            if probe().unwrap().memlock_limit.is_none() {
                // (With a small RLIMIT_MEMLOCK the kernel may refuse to pin and the link
                // copies instead.)
                assert!(load(&a.counters().zc_sends) > 0);
            }
            let p = pattern(10, 1);
            assert!(a.send(&data_frame(0, &p), &p).is_err());
            assert!(a.recv(&mut Vec::new()).is_err());
        }
    });
}

#[test]
fn peer_close_at_a_frame_boundary_is_closed() {
    within(TEST_LIMIT, || {
        for (a, b) in [
            (Kind::Uring, Kind::Uring),
            (Kind::Tcp, Kind::Uring),
            (Kind::Uring, Kind::Tcp),
        ] {
            let (mut la, mut lb) = pair(a, b, MAX);
            let small = pattern(10, 1);
            let big = pattern(3 << 20, 2);
            // A zero-copy send returns once the peer has the data, so it runs on its own
            // thread while the receiver reads.
            let sender = {
                let big = big.clone();
                thread::spawn(move || {
                    la.send(&data_frame(1, &small), &small).unwrap();
                    la.send(&data_frame(2, &big), &big).unwrap();
                })
            };
            let mut buf = Vec::new();
            assert_eq!(lb.recv(&mut buf).unwrap().seq, 1);
            assert_eq!(lb.recv(&mut buf).unwrap().seq, 2);
            assert!(buf == big);
            // The sender's link is dropped when its thread ends.
            sender.join().unwrap();
            let r = lb.recv(&mut buf);
            assert!(
                matches!(r, Err(TransportError::Closed)),
                "{a:?} → {b:?}: expected Closed, got {r:?}"
            );
            let r = lb.recv_timeout(&mut buf, Duration::from_secs(5));
            assert!(matches!(r, Err(TransportError::Closed)), "{r:?}");
        }
    });
}

/// A raw client socket that writes frames by hand (with the initiator's sealer), and the
/// io_uring link at the other end.
fn raw_and_uring(max: u32) -> (TcpStream, UringDataLink, Sealer) {
    let (raw, s) = socket_pair();
    let (ka, kb) = keys();
    let link = UringDataLink::new(s, max, &kb, UringConfig::default()).unwrap();
    (raw, link, Sealer::new(&ka.send))
}

#[test]
fn close_in_the_middle_of_a_frame_is_an_error_not_a_clean_close() {
    within(TEST_LIMIT, || {
        for cut in [20usize, HEADER_LEN, HEADER_LEN + 100, HEADER_LEN + 70_000] {
            let (mut raw, mut link, mut sealer) = raw_and_uring(MAX);
            let payload = pattern(100_000, 3);
            let h = data_frame(3, &payload);
            let mut wire = h.encode().to_vec();
            wire.extend_from_slice(&payload);
            wire.extend_from_slice(&sealer.seal(&[&h.encode(), &payload]));
            raw.write_all(&wire[..cut]).unwrap();
            raw.shutdown(std::net::Shutdown::Write).unwrap();
            let r = link.recv(&mut Vec::new());
            assert!(
                matches!(
                    r,
                    Err(TransportError::Io(_))
                        | Err(TransportError::Protocol(ProtocolError::Inconsistent(_)))
                ),
                "cut at {cut}: {r:?}"
            );
        }
    });
}

#[test]
fn corrupted_payload_is_a_checksum_error() {
    within(TEST_LIMIT, || {
        let (mut raw, mut link, mut sealer) = raw_and_uring(MAX);
        let payload = pattern(256, 7);
        let h = data_frame(7, &payload);
        let mut bad = payload.clone();
        bad[100] ^= 0x10;
        raw.write_all(&h.encode()).unwrap();
        raw.write_all(&bad).unwrap();
        raw.write_all(&sealer.seal(&[&h.encode(), &payload]))
            .unwrap();
        match link.recv(&mut Vec::new()) {
            Err(TransportError::Protocol(ProtocolError::Checksum { expected, .. })) => {
                assert_eq!(expected, h.crc)
            }
            other => panic!("expected a checksum error, got {other:?}"),
        }
    });
}

#[test]
fn forged_seal_mid_stream_is_refused_and_counted() {
    within(TEST_LIMIT, || {
        for size in [300usize, 300_000] {
            let (mut raw, mut link, mut sealer) = raw_and_uring(MAX);
            let mut buf = Vec::new();
            let payload = pattern(size, 1);
            let h = data_frame(1, &payload);
            raw.write_all(&h.encode()).unwrap();
            raw.write_all(&payload).unwrap();
            raw.write_all(&sealer.seal(&[&h.encode(), &payload]))
                .unwrap();
            assert_eq!(link.recv(&mut buf).unwrap(), h);

            // Intact CRC, a seal made with a guessed key.
            let payload2 = pattern(size, 2);
            let h2 = data_frame(2, &payload2);
            let mut forger = Sealer::new(&[0x42; 32]);
            let _ = forger.seal(&[b"burn counter 1"]);
            raw.write_all(&h2.encode()).unwrap();
            raw.write_all(&payload2).unwrap();
            raw.write_all(&forger.seal(&[&h2.encode(), &payload2]))
                .unwrap();
            match link.recv(&mut buf) {
                Err(TransportError::Seal(SealError::BadMac)) => {}
                other => panic!("expected a MAC failure, got {other:?}"),
            }
            let c = link.counters();
            assert_eq!(load(&c.mac_failures), 1);
            assert_eq!(load(&c.frames_in), 1);
        }
    });
}

#[test]
fn replayed_frame_mid_stream_is_refused_and_counted() {
    within(TEST_LIMIT, || {
        let (mut raw, mut link, mut sealer) = raw_and_uring(MAX);
        let mut buf = Vec::new();
        let payload = pattern(64, 5);
        let h = data_frame(5, &payload);
        let mut wire = h.encode().to_vec();
        wire.extend_from_slice(&payload);
        wire.extend_from_slice(&sealer.seal(&[&h.encode(), &payload]));
        raw.write_all(&wire).unwrap();
        assert_eq!(link.recv(&mut buf).unwrap(), h);
        raw.write_all(&wire).unwrap();
        match link.recv(&mut buf) {
            Err(TransportError::Seal(SealError::OutOfOrder {
                got: 1,
                expected: 2,
            })) => {}
            other => panic!("expected a replay refusal, got {other:?}"),
        }
        let c = link.counters();
        assert_eq!(load(&c.replays), 1);
        assert_eq!(load(&c.mac_failures), 0);
    });
}

/// What the conformance suite's recv_timeout case does not cover: an endless timeout is
/// clamped, not refused, and frames already in the registered receive buffer are returned
/// without waiting.
#[test]
fn recv_timeout_clamps_an_endless_wait_and_returns_buffered_frames_at_once() {
    within(TEST_LIMIT, || {
        let (mut a, mut b) = uring_pair(UringConfig::default(), UringConfig::default());
        let mut buf = Vec::new();
        let p = pattern(100, 8);
        a.send(&data_frame(8, &p), &p).unwrap();
        let h = b.recv_timeout(&mut buf, Duration::MAX).unwrap();
        assert_eq!(h.map(|h| h.seq), Some(8));
        let p = pattern(5000, 9);
        a.send(&data_frame(10, &p), &p).unwrap();
        a.send(&data_frame(11, &p), &p).unwrap();
        assert_eq!(b.recv(&mut buf).unwrap().seq, 10);
        let h = b.recv_timeout(&mut buf, Duration::from_millis(1)).unwrap();
        assert_eq!(h.map(|h| h.seq), Some(11));
        assert_eq!(buf, p);
    });
}

#[test]
fn oversized_frame_is_refused_before_reading_it() {
    within(TEST_LIMIT, || {
        let (mut raw, mut link, _) = raw_and_uring(1 << 20);
        let mut head = data_frame(1, &[0u8; 4]).encode();
        head[24..28].copy_from_slice(&(1u32 << 30).to_le_bytes());
        raw.write_all(&head).unwrap();
        let mut buf = Vec::new();
        let t0 = Instant::now();
        let r = link.recv(&mut buf);
        assert!(
            matches!(
                r,
                Err(TransportError::Protocol(ProtocolError::TooLarge { len, max, .. }))
                    if len == 1 << 30 && max == 1 << 20
            ),
            "{r:?}"
        );
        assert!(buf.capacity() < 1 << 20);
        // Hang guard only: nothing after the header was waited for.
        assert!(t0.elapsed() < Duration::from_secs(10));
    });
}

#[test]
fn wire_format_matches_tcp_data_link_byte_for_byte() {
    within(TEST_LIMIT, || {
        // The same frames from a TcpDataLink and a UringDataLink with the same keys produce
        // the same bytes on the wire.
        let frames: Vec<Vec<u8>> = [0usize, 1, 3000, 70_000, 2 << 20]
            .iter()
            .enumerate()
            .map(|(i, &n)| pattern(n.max(1), i as u64))
            .collect();
        let capture = |kind: Kind| {
            let (sa, mut sb) = socket_pair();
            let (ka, _) = keys();
            let frames = frames.clone();
            let h = thread::spawn(move || {
                let mut l = make(kind, sa, &ka, MAX);
                for (i, p) in frames.iter().enumerate() {
                    l.send(&data_frame(i as u64, p), p).unwrap();
                }
            });
            let mut wire = Vec::new();
            sb.read_to_end(&mut wire).unwrap();
            h.join().unwrap();
            wire
        };
        let a = capture(Kind::Tcp);
        let b = capture(Kind::Uring);
        assert_eq!(a.len(), b.len());
        assert!(a == b, "the wire bytes differ");
    });
}

// ---------------------------------------------------------------------------------------
// Measurement (run with `cargo test --release -p ringllm-protocol --test uring_link --
// --ignored --nocapture measure`).

/// One-way latency (half the round trip) of `size`-byte frames bounced between two links.
fn ping_pong_links(
    mut a: Box<dyn DataLink>,
    mut b: Box<dyn DataLink>,
    size: usize,
    iters: usize,
) -> (Duration, Duration) {
    let echo = thread::spawn(move || {
        let mut buf = Vec::new();
        while let Ok(h) = b.recv(&mut buf) {
            if b.send(&h, &buf).is_err() {
                break;
            }
        }
    });
    let p = pattern(size, 1);
    let h = data_frame(1, &p);
    let mut buf = Vec::new();
    let mut rtts = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        let t0 = Instant::now();
        a.send(&h, &p).unwrap();
        a.recv(&mut buf).unwrap();
        if i >= iters / 10 {
            rtts.push(t0.elapsed() / 2);
        }
    }
    drop(a);
    echo.join().unwrap();
    rtts.sort();
    (percentile(&rtts, 0.5), percentile(&rtts, 0.99))
}

/// The same with plain blocking sockets: `size` bytes written, read back whole.
fn ping_pong_raw(size: usize, iters: usize) -> (Duration, Duration) {
    let (mut a, mut b) = socket_pair();
    a.set_nodelay(true).unwrap();
    b.set_nodelay(true).unwrap();
    let echo = thread::spawn(move || {
        let mut buf = vec![0u8; size];
        while b.read_exact(&mut buf).is_ok() {
            if b.write_all(&buf).is_err() {
                break;
            }
        }
    });
    let p = pattern(size, 1);
    let mut buf = vec![0u8; size];
    let mut rtts = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        let t0 = Instant::now();
        a.write_all(&p).unwrap();
        a.read_exact(&mut buf).unwrap();
        if i >= iters / 10 {
            rtts.push(t0.elapsed() / 2);
        }
    }
    drop(a);
    echo.join().unwrap();
    rtts.sort();
    (percentile(&rtts, 0.5), percentile(&rtts, 0.99))
}

/// MiB/s of `count` frames of `size` bytes from `a` to `b`.
fn throughput_links(
    mut a: Box<dyn DataLink>,
    mut b: Box<dyn DataLink>,
    size: usize,
    count: usize,
) -> f64 {
    let p = pattern(size, 3);
    let h = data_frame(1, &p);
    let t0 = Instant::now();
    let sender = thread::spawn(move || {
        for _ in 0..count {
            a.send(&h, &p).unwrap();
        }
        a
    });
    let mut buf = Vec::new();
    for _ in 0..count {
        b.recv(&mut buf).unwrap();
    }
    let took = t0.elapsed();
    drop(sender.join().unwrap());
    (size * count) as f64 / (1 << 20) as f64 / took.as_secs_f64()
}

fn throughput_raw(size: usize, count: usize) -> f64 {
    let (mut a, mut b) = socket_pair();
    let p = pattern(size, 3);
    let t0 = Instant::now();
    let sender = thread::spawn(move || {
        for _ in 0..count {
            a.write_all(&p).unwrap();
        }
    });
    let mut buf = vec![0u8; size];
    for _ in 0..count {
        b.read_exact(&mut buf).unwrap();
    }
    let took = t0.elapsed();
    sender.join().unwrap();
    (size * count) as f64 / (1 << 20) as f64 / took.as_secs_f64()
}

/// MiB/s of `count` frames of `size` bytes sent by `a` to a plain socket that discards them:
/// the sender's path alone (its seal included, the receiver's checks left out).
fn sender_throughput(kind: Option<UringConfig>, size: usize, count: usize) -> (f64, u64, u64) {
    let (sa, mut sb) = socket_pair();
    let (ka, _) = keys();
    let drain = thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 20];
        while let Ok(n) = sb.read(&mut buf) {
            if n == 0 {
                break;
            }
        }
    });
    let mut a: Box<dyn DataLink> = match kind {
        Some(cfg) => Box::new(UringDataLink::new(sa, MAX, &ka, cfg).unwrap()),
        None => Box::new(TcpDataLink::new(sa, MAX, &ka).unwrap()),
    };
    let p = pattern(size, 3);
    let h = data_frame(1, &p);
    let t0 = Instant::now();
    for _ in 0..count {
        a.send(&h, &p).unwrap();
    }
    let took = t0.elapsed();
    let c = a.counters();
    drop(a);
    drain.join().unwrap();
    (
        (size * count) as f64 / (1 << 20) as f64 / took.as_secs_f64(),
        load(&c.zc_sends),
        load(&c.zc_copied),
    )
}

fn uring_boxed(cfg: UringConfig) -> (Box<dyn DataLink>, Box<dyn DataLink>) {
    let (a, b) = uring_pair(cfg.clone(), cfg);
    (Box::new(a), Box::new(b))
}

#[test]
#[ignore = "measurement; run explicitly with --ignored --nocapture"]
fn measure_latency_and_throughput() {
    // URING_MEASURE=small,large,sender,pair picks sections (all by default).
    let only = std::env::var("URING_MEASURE").unwrap_or_default();
    let run = |section: &str| only.is_empty() || only.split(',').any(|s| s == section);
    let iters = 20_000;
    if run("small") {
        println!("one-way latency over loopback (half the round trip), {iters} round trips:");
        for size in [2560usize, 16 << 10] {
            let (p50, p99) = ping_pong_raw(size, iters);
            println!("  {size:>6} B  raw socket  p50 {p50:>9.2?}  p99 {p99:>9.2?}");
            let (a, b) = pair(Kind::Tcp, Kind::Tcp, MAX);
            let (p50, p99) = ping_pong_links(a, b, size, iters);
            println!("  {size:>6} B  tcp link    p50 {p50:>9.2?}  p99 {p99:>9.2?}");
            let (a, b) = uring_boxed(UringConfig::default());
            let (p50, p99) = ping_pong_links(a, b, size, iters);
            println!("  {size:>6} B  uring link  p50 {p50:>9.2?}  p99 {p99:>9.2?}");
        }
    }
    if run("large") {
        println!("one-way latency of larger frames, uring copying vs SEND_ZC:");
        for size in [64usize << 10, 256 << 10, 1 << 20] {
            let it = 2000;
            let (a, b) = pair(Kind::Tcp, Kind::Tcp, MAX);
            let (t50, t99) = ping_pong_links(a, b, size, it);
            let (a, b) = uring_boxed(UringConfig {
                zc_threshold: usize::MAX,
                ..UringConfig::default()
            });
            let (c50, c99) = ping_pong_links(a, b, size, it);
            let (a, b) = uring_boxed(UringConfig {
                zc_threshold: 1,
                ..UringConfig::default()
            });
            let (z50, z99) = ping_pong_links(a, b, size, it);
            println!(
            "  {:>5} KiB  tcp p50 {t50:>9.2?} p99 {t99:>9.2?} | uring copy p50 {c50:>9.2?} p99 \
             {c99:>9.2?} | uring zc p50 {z50:>9.2?} p99 {z99:>9.2?}",
            size >> 10
        );
        }
    }
    if run("sender") {
        println!("sender alone (a plain socket drains), MiB/s:");
        for (size, count) in [
            (16usize << 10, 40_000),
            (64 << 10, 10_000),
            (256 << 10, 3000),
            (1 << 20, 1000),
            (16 << 20, 64),
        ] {
            let (tcp, _, _) = sender_throughput(None, size, count);
            let (copy, _, _) = sender_throughput(
                Some(UringConfig {
                    zc_threshold: usize::MAX,
                    ..UringConfig::default()
                }),
                size,
                count,
            );
            let (zc, sends, copied) = sender_throughput(
                Some(UringConfig {
                    zc_threshold: 1,
                    ..UringConfig::default()
                }),
                size,
                count,
            );
            println!(
                "  {:>5} KiB frames  tcp {tcp:>6.0}  uring copy {copy:>6.0}  uring zc {zc:>6.0} \
             (zc_sends {sends}, zc_copied {copied})",
                size >> 10
            );
        }
    }
    if run("pair") {
        println!("throughput over loopback:");
        for (size, count) in [
            (64usize << 10, 16_000),
            (256 << 10, 4000),
            (1 << 20, 1000),
            (16 << 20, 64),
        ] {
            let raw = throughput_raw(size, count);
            let (a, b) = pair(Kind::Tcp, Kind::Tcp, MAX);
            let tcp = throughput_links(a, b, size, count);
            let (a, b) = uring_boxed(UringConfig {
                zc_threshold: usize::MAX,
                ..UringConfig::default()
            });
            let copy = throughput_links(a, b, size, count);
            let (a, b) = uring_boxed(UringConfig {
                zc_threshold: 1,
                ..UringConfig::default()
            });
            let zc = throughput_links(a, b, size, count);
            println!(
            "  {:>5} KiB frames  raw {raw:>6.0} MiB/s  tcp {tcp:>6.0}  uring copy {copy:>6.0}  \
             uring zc {zc:>6.0}",
            size >> 10
        );
        }
    }
}
