//! One conformance suite, run over every transport: links opened the way nodes open them
//! (`dial::connect_data_link` ↔ `dial::DataListener`), real sockets on loopback, real
//! processes for the crash case. Each test runs every transport in turn and names the one
//! that failed.

mod common;

use common::{key, pattern, runtime, within_named};

use ringllm_protocol::dial::{self, BoxLink, DataListener};
use ringllm_protocol::frame::DEFAULT_MAX_PAYLOAD;
use ringllm_protocol::{Dtype, FrameHeader, FrameKind, TransportKind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(10);
/// Env var that turns this test binary into a crashing peer (see `crash_child`).
const CHILD_ENV: &str = "RINGLLM_CONFORMANCE_CHILD";

fn frame(len: usize, seq: u64) -> (FrameHeader, Vec<u8>) {
    let p = pattern(len, seq);
    let h = FrameHeader::new(FrameKind::Hidden, Dtype::F32, seq, seq as u32, 1, 0, &p).unwrap();
    (h, p)
}

/// A listener for `kind` on a free loopback port.
fn listener(rt: &tokio::runtime::Runtime, kind: TransportKind) -> DataListener {
    let k = key("conformance");
    rt.block_on(async {
        DataListener::bind(
            "127.0.0.1:0".parse().unwrap(),
            &k,
            "server",
            kind,
            DEFAULT_MAX_PAYLOAD,
        )
    })
    .unwrap_or_else(|e| panic!("{kind}: bind: {e}"))
}

/// (client link, server link) over `kind`.
fn pair(rt: &tokio::runtime::Runtime, kind: TransportKind) -> (BoxLink, BoxLink) {
    let k = key("conformance");
    let l = listener(rt, kind);
    let addr = l.local_addr().unwrap().to_string();
    let server = rt.spawn(async move { l.accept(TIMEOUT).await });
    let client = rt
        .block_on(dial::connect_data_link(
            &dial::DialSpec {
                kind,
                addr: &addr,
                name: "client",
                timeout: TIMEOUT,
                max_payload: DEFAULT_MAX_PAYLOAD,
                ring_session: 42,
                role: dial::LinkRole::Input,
            },
            &k,
        ))
        .unwrap_or_else(|e| panic!("{kind}: connect: {e}"));
    let (server, info) = rt
        .block_on(server)
        .unwrap()
        .unwrap_or_else(|e| panic!("{kind}: accept: {e}"));
    assert_eq!(info.session, 42, "{kind}");
    assert_eq!(info.from, "client", "{kind}");
    assert_eq!(info.role, dial::LinkRole::Input, "{kind}");
    assert_eq!(info.transport, kind, "{kind}");
    assert_eq!(client.transport(), kind);
    assert_eq!(server.transport(), kind);
    (client, server)
}

/// Every transport, or those in `RINGLLM_CONFORMANCE_ONLY` (comma-separated). `kmod` runs
/// only when named there: it needs the kernel module, which only a QEMU guest can load
/// (`kmod/test-qemu` runs this binary there with `RINGLLM_CONFORMANCE_ONLY=kmod`).
fn each(f: impl Fn(&tokio::runtime::Runtime, TransportKind)) {
    let only = std::env::var("RINGLLM_CONFORMANCE_ONLY").unwrap_or_default();
    for kind in TransportKind::ALL {
        let named = only.split(',').any(|o| o == kind.name());
        if (!only.is_empty() || kind == TransportKind::Kmod) && !named {
            if kind == TransportKind::Kmod {
                eprintln!("-- kmod: not here (kmod/test-qemu runs it in a QEMU guest)");
            }
            continue;
        }
        let rt = runtime(1);
        eprintln!("-- {kind}");
        f(&rt, kind);
    }
}

#[test]
fn frames_of_1_byte_to_64_mib_arrive_in_order_both_ways() {
    let sizes = [
        1usize,
        7,
        2560,
        16 << 10,
        1399,
        1400,
        1401,
        100_000,
        1 << 20,
        64 << 20,
    ];
    each(|rt, kind| {
        let (mut c, mut s) = pair(rt, kind);
        let _rt_guard = rt.enter();
        let sender = std::thread::spawn(move || {
            for (i, &n) in sizes.iter().enumerate() {
                let (h, p) = frame(n, i as u64);
                c.send(&h, &p).unwrap();
            }
            c
        });
        let mut buf = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let h = s
                .recv(&mut buf)
                .unwrap_or_else(|e| panic!("{kind}: frame {i}: {e}"));
            assert_eq!(h.seq, i as u64, "{kind}: in order");
            assert_eq!(buf.len(), n, "{kind}");
            assert!(buf == pattern(n, i as u64), "{kind}: frame {i} intact");
        }
        let mut c = sender.join().unwrap();
        // And back.
        let (h, p) = frame(3000, 99);
        s.send(&h, &p).unwrap();
        let got = c.recv(&mut buf).unwrap();
        assert_eq!((got.seq, buf.len()), (99, 3000), "{kind}");
        assert_eq!(buf, p, "{kind}");
        let (fo, _, fi, _) = s.counters().snapshot();
        // The attach message counts on the link, except on udp where it came over the anchor.
        let attach = u64::from(!matches!(kind, TransportKind::Udp | TransportKind::Kmod));
        assert_eq!(
            (fi, fo),
            (sizes.len() as u64 + attach, 1),
            "{kind}: frame counters"
        );
    });
}

#[test]
fn a_slow_receiver_blocks_the_sender_and_nothing_is_lost() {
    each(|rt, kind| {
        let (mut c, mut s) = pair(rt, kind);
        let _rt_guard = rt.enter();
        const N: usize = 256;
        let sent = Arc::new(AtomicUsize::new(0));
        let sent2 = Arc::clone(&sent);
        let sender = std::thread::spawn(move || {
            for i in 0..N {
                let (h, p) = frame(1 << 20, i as u64);
                c.send(&h, &p).unwrap();
                sent2.fetch_add(1, Ordering::SeqCst);
            }
            c
        });
        // 256 MiB cannot sit in any transport's buffers: the sender must be held back.
        std::thread::sleep(Duration::from_millis(600));
        let early = sent.load(Ordering::SeqCst);
        assert!(
            early < N,
            "{kind}: all {N} MiB sent to a receiver that read nothing"
        );
        let mut buf = Vec::new();
        for i in 0..N {
            let h = s.recv(&mut buf).unwrap();
            assert_eq!(h.seq, i as u64, "{kind}");
            assert!(buf == pattern(1 << 20, i as u64), "{kind}: frame {i}");
        }
        let _c = sender.join().unwrap();
        eprintln!("{kind}: {early} of {N} 1 MiB frames sent before the receiver read");
    });
}

#[test]
fn peer_close_is_a_clean_close_at_a_frame_boundary() {
    each(|rt, kind| {
        let (mut c, s) = pair(rt, kind);
        let _rt_guard = rt.enter();
        let (h, p) = frame(5000, 1);
        c.send(&h, &p).unwrap();
        drop(c);
        let mut s = s;
        let r = within_named(&format!("{kind}: recv after close"), TIMEOUT, move || {
            let mut buf = Vec::new();
            let first = s.recv(&mut buf).map(|h| (h.seq, buf.len()));
            let second = s.recv(&mut buf).map(|h| h.seq);
            (first, second.map_err(|e| (e.is_closed(), e.to_string())))
        });
        assert_eq!(
            r.0.unwrap(),
            (1, 5000),
            "{kind}: the frame sent before close"
        );
        match r.1 {
            Err((true, _)) => {}
            other => panic!("{kind}: expected Closed, got {other:?}"),
        }
    });
}

#[test]
fn closer_unblocks_a_waiting_receiver() {
    each(|rt, kind| {
        let (mut c, s) = pair(rt, kind);
        let _rt_guard = rt.enter();
        let closer = s.closer().unwrap();
        let t = Instant::now();
        let mut s = s;
        let waiter = std::thread::spawn(move || {
            let mut buf = Vec::new();
            let r = s.recv(&mut buf).map(|_| ());
            (r, s)
        });
        std::thread::sleep(Duration::from_millis(100));
        closer.close();
        let (r, mut s) = within_named(&format!("{kind}: recv after closer"), TIMEOUT, move || {
            waiter.join().unwrap()
        });
        assert!(r.is_err(), "{kind}: recv returned a frame after close");
        eprintln!("{kind}: unblocked after {:?}", t.elapsed());
        // The link stays closed, both ways.
        assert!(s.recv(&mut Vec::new()).is_err(), "{kind}: a second recv");
        let (h, p) = frame(8, 1);
        assert!(s.send(&h, &p).is_err(), "{kind}: send after close");
        // The peer sees a clean close.
        let r = within_named(&format!("{kind}: the peer's recv"), TIMEOUT, move || {
            let mut buf = Vec::new();
            c.recv(&mut buf).map(|h| h.seq)
        });
        assert!(matches!(&r, Err(e) if e.is_closed()), "{kind}: {r:?}");
    });
}

#[test]
fn closer_unblocks_a_sender_held_back_by_a_receiver_that_does_not_read() {
    each(|rt, kind| {
        let (c, _s) = pair(rt, kind);
        let _rt_guard = rt.enter();
        let closer = c.closer().unwrap();
        let mut c = c;
        let sender = std::thread::spawn(move || {
            // Nobody reads: this blocks once the buffers and windows are full.
            let (h, p) = frame(1 << 20, 0);
            for _ in 0..1024 {
                if let Err(e) = c.send(&h, &p) {
                    return Some(e.to_string());
                }
            }
            None
        });
        std::thread::sleep(Duration::from_millis(500));
        closer.close();
        let r = within_named(&format!("{kind}: send after closer"), TIMEOUT, move || {
            sender.join().unwrap()
        });
        match r {
            Some(e) => eprintln!("{kind}: the blocked send ended with: {e}"),
            None => panic!("{kind}: 1 GiB sent to a peer that never reads"),
        }
    });
}

#[test]
fn recv_timeout_is_none_when_idle_then_gets_the_frame() {
    each(|rt, kind| {
        let (mut c, mut s) = pair(rt, kind);
        let _rt_guard = rt.enter();
        let mut buf = Vec::new();
        // Idle: a zero timeout polls, a longer one is waited out.
        for ms in [0, 1, 50] {
            let t = Instant::now();
            let r = s.recv_timeout(&mut buf, Duration::from_millis(ms)).unwrap();
            assert!(r.is_none(), "{kind}: {ms} ms");
            assert!(t.elapsed() >= Duration::from_millis(ms), "{kind}: early");
        }
        // Two frames: the first through a long timeout, the second by polling.
        let (h1, p1) = frame(33, 5);
        let (h2, p2) = frame(300_000, 6);
        c.send(&h1, &p1).unwrap();
        c.send(&h2, &p2).unwrap();
        let got = s.recv_timeout(&mut buf, TIMEOUT).unwrap().expect("a frame");
        assert_eq!((got.seq, &buf), (5, &p1), "{kind}");
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(h) = s.recv_timeout(&mut buf, Duration::ZERO).unwrap() {
                assert_eq!((h.seq, &buf), (6, &p2), "{kind}");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{kind}: the second frame never came"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let r = s.recv_timeout(&mut buf, Duration::from_millis(20)).unwrap();
        assert!(r.is_none(), "{kind}");
        // A frame that arrives while the receiver waits.
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            let (h, p) = frame(2 << 20, 7);
            c.send(&h, &p).unwrap();
            c
        });
        let got = s.recv_timeout(&mut buf, TIMEOUT).unwrap().expect("a frame");
        assert_eq!(got.seq, 7, "{kind}");
        assert!(buf == pattern(2 << 20, 7), "{kind}");
        // Once the peer is gone, a timed receive reports the close.
        drop(sender.join().unwrap());
        let r = s.recv_timeout(&mut buf, TIMEOUT);
        assert!(matches!(&r, Err(e) if e.is_closed()), "{kind}: {r:?}");
    });
}

#[test]
fn a_client_with_the_wrong_key_is_refused_and_the_listener_carries_on() {
    each(|rt, kind| {
        let k = key("conformance");
        let l = listener(rt, kind);
        let addr = l.local_addr().unwrap().to_string();
        let l = Arc::new(l);
        let l2 = Arc::clone(&l);
        let first = rt.spawn(async move { l2.accept(TIMEOUT).await.map(|_| ()) });
        let bad = rt.block_on(dial::connect_data_link(
            &dial::DialSpec {
                kind,
                addr: &addr,
                name: "intruder",
                timeout: TIMEOUT,
                max_payload: DEFAULT_MAX_PAYLOAD,
                ring_session: 1,
                role: dial::LinkRole::Input,
            },
            &key("another cluster"),
        ));
        let e = bad
            .err()
            .unwrap_or_else(|| panic!("{kind}: wrong key accepted"));
        eprintln!("{kind}: client sees: {e}");
        let server_side = rt.block_on(first).unwrap();
        let e = server_side
            .err()
            .unwrap_or_else(|| panic!("{kind}: server accepted the wrong key"));
        eprintln!("{kind}: server sees: {e}");
        // A good client still gets in.
        let l3 = Arc::clone(&l);
        let next = rt.spawn(async move { l3.accept(TIMEOUT).await });
        let mut c = rt
            .block_on(dial::connect_data_link(
                &dial::DialSpec {
                    kind,
                    addr: &addr,
                    name: "client",
                    timeout: TIMEOUT,
                    max_payload: DEFAULT_MAX_PAYLOAD,
                    ring_session: 2,
                    role: dial::LinkRole::Input,
                },
                &k,
            ))
            .unwrap_or_else(|e| panic!("{kind}: good client after a bad one: {e}"));
        let (mut s, _) = rt.block_on(next).unwrap().unwrap();
        let _rt_guard = rt.enter();
        let (h, p) = frame(100, 3);
        c.send(&h, &p).unwrap();
        let mut buf = Vec::new();
        assert_eq!(s.recv(&mut buf).unwrap().seq, 3, "{kind}");
    });
}

/// The crashing peer: connects a data link, sends one frame, then waits to be killed.
#[test]
#[ignore = "run by peer_crash_is_an_error_not_a_hang as a child process"]
fn crash_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (kind, addr) = spec.split_once('@').unwrap();
    let kind = TransportKind::from_name(kind).unwrap();
    let rt = runtime(1);
    let mut c = rt
        .block_on(dial::connect_data_link(
            &dial::DialSpec {
                kind,
                addr,
                name: "doomed",
                timeout: TIMEOUT,
                max_payload: DEFAULT_MAX_PAYLOAD,
                ring_session: 7,
                role: dial::LinkRole::Input,
            },
            &key("conformance"),
        ))
        .unwrap();
    let _g = rt.enter();
    let (h, p) = frame(2560, 1);
    c.send(&h, &p).unwrap();
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn peer_crash_is_an_error_not_a_hang() {
    each(|rt, kind| {
        let l = listener(rt, kind);
        let addr = l.local_addr().unwrap();
        let server = rt.spawn(async move { l.accept(TIMEOUT).await });
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "crash_child", "--ignored", "--nocapture"])
            .env(CHILD_ENV, format!("{}@{addr}", kind.name()))
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let (mut s, _) = rt.block_on(server).unwrap().unwrap();
        let _g = rt.enter();
        let mut buf = Vec::new();
        assert_eq!(s.recv(&mut buf).unwrap().seq, 1, "{kind}");
        child.kill().unwrap();
        let _ = child.wait();
        let t = Instant::now();
        let r = within_named(
            &format!("{kind}: recv after the peer was killed"),
            Duration::from_secs(20),
            move || {
                let mut buf = Vec::new();
                s.recv(&mut buf).map(|h| h.seq).map_err(|e| e.to_string())
            },
        );
        assert!(r.is_err(), "{kind}: a frame from a dead peer: {r:?}");
        eprintln!(
            "{kind}: noticed after {:?}: {}",
            t.elapsed(),
            r.unwrap_err()
        );
    });
}
