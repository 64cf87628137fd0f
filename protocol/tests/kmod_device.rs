//! The kernel module (`kmod/`) through its device, and reliable UDP links over it, against
//! datagrams fired from a raw socket: every malformed one counted and dropped by the module,
//! every forged one refused by the link's seal check, no frame lost, none made up.
//!
//! These need `/dev/ringllm`, which only a QEMU guest can give (this machine's kernel cannot
//! load modules): they are ignored here, and `kmod/test-qemu` runs them in a guest with
//! `--ignored`. The one test that needs no module checks what a missing module says.

mod common;

use common::pattern;
use ringllm_protocol::blocking::DataLink;
use ringllm_protocol::frame::DEFAULT_MAX_PAYLOAD;
use ringllm_protocol::kmod::{self, Device, KmodConfig, KmodError, MAGIC};
use ringllm_protocol::seal::LinkKeys;
use ringllm_protocol::udp::{UdpConfig, UdpDataLink};
use ringllm_protocol::{Dtype, FrameHeader, FrameKind};
use socket2::{Domain, Protocol, Socket, Type};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TAG: u32 = 0x5eed_0001;

/// A UDP packet (header + payload) for a raw socket; `len`: the UDP length field, if it
/// should lie.
fn udp_packet(sport: u16, dport: u16, payload: &[u8], len: Option<u16>) -> Vec<u8> {
    let mut p = Vec::with_capacity(8 + payload.len());
    p.extend_from_slice(&sport.to_be_bytes());
    p.extend_from_slice(&dport.to_be_bytes());
    let l = len.unwrap_or((8 + payload.len()) as u16);
    p.extend_from_slice(&l.to_be_bytes());
    p.extend_from_slice(&0u16.to_be_bytes()); // no checksum
    p.extend_from_slice(payload);
    p
}

/// The fields of a data datagram's header, to be bent one at a time.
#[derive(Clone, Copy)]
struct Hdr {
    kind: u8,
    version: u8,
    chunk_size: u16,
    index: u32,
    count: u32,
    total: u32,
    frame: u64,
    cseq: u64,
}

impl Hdr {
    fn good(frame: u64, index: u32, count: u32) -> Hdr {
        Hdr {
            kind: 1,
            version: 1,
            chunk_size: 1400,
            index,
            count,
            total: 1400 * count,
            frame,
            cseq: 1 + index as u64,
        }
    }
}

/// Magic, tag, header, `chunk` bytes of chunk data, a 24-byte seal that seals nothing.
fn datagram(tag: u32, h: Hdr, chunk: usize, seed: u64) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend_from_slice(&MAGIC.to_le_bytes());
    d.extend_from_slice(&tag.to_le_bytes());
    d.push(h.kind);
    d.push(h.version);
    d.extend_from_slice(&h.chunk_size.to_le_bytes());
    d.extend_from_slice(&h.index.to_le_bytes());
    d.extend_from_slice(&h.count.to_le_bytes());
    d.extend_from_slice(&h.total.to_le_bytes());
    d.extend_from_slice(&h.frame.to_le_bytes());
    d.extend_from_slice(&h.cseq.to_le_bytes());
    d.extend_from_slice(&pattern(chunk + 24, seed));
    d
}

struct Raw {
    sock: Socket,
    sport: u16,
}

impl Raw {
    fn new(sport: u16) -> Raw {
        let sock = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::UDP))
            .expect("a raw socket (run as root)");
        Raw { sock, sport }
    }

    fn fire(&self, dport: u16, payload: &[u8], len: Option<u16>) {
        let to = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0));
        self.sock
            .send_to(&udp_packet(self.sport, dport, payload, len), &to.into())
            .expect("raw send");
    }
}

/// The module-wide counters in /proc/ringllm.
fn proc_counter(name: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/ringllm").expect("/proc/ringllm");
    s.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("/proc/ringllm has no {name}:\n{s}"))
}

/// Packets every CPU's backlog queue dropped (the second column of /proc/net/softnet_stat).
fn backlog_drops() -> u64 {
    std::fs::read_to_string("/proc/net/softnet_stat")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| u64::from_str_radix(l.split_whitespace().nth(1)?, 16).ok())
        .sum()
}

/// Polls `f` until true (the hook runs in softirq context, usually before `send_to`
/// returns on loopback, but not always).
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(5), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_missing_module_says_what_to_do() {
    let e = Device::open_at(
        std::path::Path::new("/nonexistent/ringllm"),
        KmodConfig::default(),
    )
    .err()
    .expect("no device there");
    assert!(matches!(e, KmodError::NotLoaded), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("insmod") && msg.contains("kmod/README.md"),
        "{msg}"
    );
}

#[test]
#[ignore = "needs the ringllm kernel module: kmod/test-qemu runs it in a guest"]
fn the_module_places_what_is_well_formed_and_counts_the_rest() {
    kmod::probe().expect("the module is loaded");
    let dev = Device::open(KmodConfig {
        banks: 2,
        slots: 64,
        tx_bytes: 4096,
    })
    .unwrap();
    let (holder, port) = hold_port(&dev);
    let raw = Raw::new(40_001);
    foreign_datagrams_are_passed(&raw, port, &holder);
    malformed_datagrams_are_counted(&dev, &raw, port);
    well_formed_datagrams_are_placed_and_drained(&dev, &raw, port);
    drop(dev);
    eventually("the contexts are freed", || proc_counter("contexts") == 0);
    assert_eq!(proc_counter("bytes"), 0);
}

/// Binds a socket to a port and gives the port to `dev` (tag `TAG`): what the module leaves
/// alone lands on that socket. Another context cannot take the same port and tag.
fn hold_port(dev: &Device) -> (UdpSocket, u16) {
    let holder = UdpSocket::bind("127.0.0.1:0").unwrap();
    holder.set_nonblocking(true).unwrap();
    let port = holder.local_addr().unwrap().port();
    dev.set_port(port, TAG).unwrap();
    // Another context cannot take the same port and tag.
    let other = Device::open(KmodConfig {
        banks: 1,
        slots: 64,
        tx_bytes: 4096,
    })
    .unwrap();
    assert!(matches!(
        other.set_port(port, TAG),
        Err(KmodError::PortTaken { .. })
    ));
    drop(other);

    (holder, port)
}

/// Datagrams without our magic, or with a tag no link has: passed to the stack (the holder
/// gets the foreign ones) or counted as malformed.
fn foreign_datagrams_are_passed(raw: &Raw, port: u16, holder: &UdpSocket) {
    let g_malformed = proc_counter("dropped_malformed");
    let g_passed = proc_counter("passed");

    // Not ours: no magic. Left to the stack (the holder gets them).
    for i in 0..3u8 {
        raw.fire(port, &[i; 100], None);
    }
    // Our magic, to our port, with a tag no link has.
    raw.fire(port, &datagram(TAG + 1, Hdr::good(1, 0, 1), 100, 1), None);
    raw.fire(port, &datagram(TAG + 2, Hdr::good(1, 0, 1), 100, 2), None);
    eventually("passed and unknown tags counted", || {
        proc_counter("passed") >= g_passed + 3
            && proc_counter("dropped_malformed") >= g_malformed + 2
    });
    assert_eq!(proc_counter("passed"), g_passed + 3);
    assert_eq!(proc_counter("dropped_malformed"), g_malformed + 2);
    let mut got = [0u8; 256];
    let mut held = 0;
    eventually("the holder got the three", || {
        while holder.recv(&mut got).is_ok() {
            held += 1;
        }
        held == 3
    });
}

/// Datagrams malformed each one way, named.
fn bent_datagrams() -> Vec<(&'static str, Vec<u8>, Option<u16>)> {
    vec![
        (
            "short",
            datagram(TAG, Hdr::good(1, 0, 1), 0, 3)[..8 + 40].to_vec(),
            None,
        ),
        (
            "longer than a slot",
            datagram(
                TAG,
                Hdr {
                    chunk_size: 2100,
                    ..Hdr::good(1, 0, 1)
                },
                2100,
                4,
            ),
            None,
        ),
        (
            "kind 2",
            datagram(
                TAG,
                Hdr {
                    kind: 2,
                    ..Hdr::good(1, 0, 1)
                },
                100,
                5,
            ),
            None,
        ),
        (
            "version 9",
            datagram(
                TAG,
                Hdr {
                    version: 9,
                    ..Hdr::good(1, 0, 1)
                },
                100,
                6,
            ),
            None,
        ),
        (
            "count 0",
            datagram(
                TAG,
                Hdr {
                    count: 0,
                    ..Hdr::good(1, 0, 1)
                },
                100,
                7,
            ),
            None,
        ),
        (
            "index past count",
            datagram(TAG, Hdr::good(1, 5, 5), 100, 8),
            None,
        ),
        ("frame 0", datagram(TAG, Hdr::good(0, 0, 1), 100, 9), None),
        (
            "chunk longer than its chunk size",
            datagram(
                TAG,
                Hdr {
                    chunk_size: 64,
                    ..Hdr::good(1, 0, 1)
                },
                100,
                10,
            ),
            None,
        ),
        (
            "count beyond any frame",
            datagram(
                TAG,
                Hdr {
                    count: u32::MAX,
                    ..Hdr::good(1, 0, 1)
                },
                100,
                11,
            ),
            None,
        ),
        (
            "UDP length past the packet",
            datagram(TAG, Hdr::good(1, 0, 1), 100, 12),
            Some(1000),
        ),
    ]
}

/// Each malformed datagram is counted and dropped; none is placed.
fn malformed_datagrams_are_counted(dev: &Device, raw: &Raw, port: u16) {
    let bent = bent_datagrams();
    for (what, d, len) in &bent {
        let before = dev.stats().unwrap().dropped_malformed;
        raw.fire(port, d, *len);
        eventually(what, || {
            dev.stats().unwrap().dropped_malformed == before + 1
        });
    }
    let s = dev.stats().unwrap();
    assert_eq!(s.dropped_malformed, bent.len() as u64);
    assert_eq!(s.claimed, 0, "nothing malformed was placed");
}

/// Well-formed datagrams are placed one slot each, banks by frame; draining hands them over;
/// an arrival wakes a waiter; releasing a bank frees it.
fn well_formed_datagrams_are_placed_and_drained(dev: &Device, raw: &Raw, port: u16) {
    // Well formed (the module cannot check seals): placed, one slot each.
    let d0 = datagram(TAG, Hdr::good(7, 0, 3), 1400, 20);
    let d1 = datagram(TAG, Hdr::good(7, 1, 3), 1400, 21);
    raw.fire(port, &d0, None);
    raw.fire(port, &d1, None);
    eventually("two placed", || dev.stats().unwrap().claimed == 2);
    // The same slot again while it is full: dropped as busy.
    raw.fire(port, &d0, None);
    eventually("busy", || dev.stats().unwrap().dropped_busy == 1);
    // A second frame takes the second bank; a third finds none.
    let e0 = datagram(TAG, Hdr::good(8, 0, 1), 500, 22);
    raw.fire(port, &e0, None);
    eventually("second bank", || dev.stats().unwrap().claimed == 3);
    raw.fire(port, &datagram(TAG, Hdr::good(9, 0, 1), 500, 23), None);
    eventually("no bank", || dev.stats().unwrap().dropped_no_bank == 1);
    // Each bank names its source and frame.
    let mut frames = Vec::new();
    for b in 0..2 {
        let (src, frame, active) = dev.bank_src(b).unwrap();
        assert!(active);
        assert_eq!(src, SocketAddrV4::new(Ipv4Addr::LOCALHOST, 40_001));
        frames.push(frame);
    }
    frames.sort();
    assert_eq!(frames, vec![7, 8]);

    // Draining hands over exactly the placed datagrams, byte for byte, without the prefix.
    let mut taken: Vec<Vec<u8>> = Vec::new();
    let n = dev
        .drain(|d| taken.push(d.to_vec()), |frame| frame == 8)
        .unwrap();
    assert_eq!(n, 3);
    taken.sort();
    let mut want = vec![d0[8..].to_vec(), d1[8..].to_vec(), e0[8..].to_vec()];
    want.sort();
    assert_eq!(taken, want);
    // Frame 8's bank is free again (frame 7's is kept: not done).
    let active: Vec<bool> = (0..2).map(|b| dev.bank_src(b).unwrap().2).collect();
    assert_eq!(active.iter().filter(|&&a| a).count(), 1, "{active:?}");
    // Frame 9 now finds a bank; its arrival wakes a waiter.
    let seen = dev.wait_data(0, Duration::ZERO).unwrap();
    assert_eq!(
        dev.wait_data(seen, Duration::from_millis(20)).unwrap(),
        seen
    );
    let waiter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        Raw::new(40_002).fire(port, &datagram(TAG, Hdr::good(9, 0, 1), 500, 24), None);
    });
    assert_eq!(
        dev.wait_data(seen, Duration::from_secs(5)).unwrap(),
        seen + 1
    );
    waiter.join().unwrap();
    // RLK_IOC_RELEASE_BANK frees a bank too, and counts it.
    let b7 = (0..2)
        .find(|&b| dev.bank_src(b).unwrap().1 == 7)
        .expect("frame 7 still holds a bank");
    dev.release_bank(b7).unwrap();
    assert!(!dev.bank_src(b7).unwrap().2);
    let s = dev.stats().unwrap();
    assert_eq!((s.claimed, s.dropped_no_bank, s.dropped_busy), (4, 1, 1));
    assert_eq!((s.released, s.dropped_stale), (1, 0));
    // Frame 9's datagram was never taken: freeing its bank drops it, and says so.
    let b9 = (0..2)
        .find(|&b| dev.bank_src(b).unwrap().1 == 9)
        .expect("frame 9 holds a bank");
    dev.release_bank(b9).unwrap();
    let s = dev.stats().unwrap();
    assert_eq!((s.released, s.dropped_stale), (2, 1));
}

#[test]
#[ignore = "needs the ringllm kernel module: kmod/test-qemu runs it in a guest"]
fn datagrams_coalesced_into_one_skb_are_placed_one_by_one() {
    kmod::probe().expect("the module is loaded");
    let dev = Device::open(KmodConfig {
        banks: 4,
        slots: 64,
        tx_bytes: 4096,
    })
    .unwrap();
    let holder = UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = holder.local_addr().unwrap().port();
    dev.set_port(port, TAG).unwrap();
    // UDP segmentation offload: one send, one skb holding three datagrams of `seg` bytes
    // (loopback keeps it whole, as GRO hands a coalesced run to the hook on a real NIC).
    let ds: Vec<Vec<u8>> = (0..3)
        .map(|i| datagram(TAG, Hdr::good(11, i, 3), 500, 30 + i as u64))
        .collect();
    let seg = ds[0].len();
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let seg_c = seg as libc::c_int;
    // SAFETY: passes a live c_int of the size given.
    let r = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&sock),
            libc::SOL_UDP,
            103, // UDP_SEGMENT
            (&seg_c as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0, "UDP_SEGMENT: {}", std::io::Error::last_os_error());
    sock.send_to(&ds.concat(), ("127.0.0.1", port)).unwrap();
    eventually("three placed", || dev.stats().unwrap().claimed == 3);
    let s = dev.stats().unwrap();
    assert_eq!(s.coalesced, 1, "one skb held the three: {s:?}");
    assert_eq!(s.dropped_malformed, 0);
    let mut taken = Vec::new();
    dev.drain(|d| taken.push(d.to_vec()), |_| true).unwrap();
    taken.sort();
    let mut want: Vec<Vec<u8>> = ds.iter().map(|d| d[8..].to_vec()).collect();
    want.sort();
    assert_eq!(taken, want);
}

/// Two ends of a reliable UDP link over the module on loopback, with known keys.
fn kmod_pair() -> (UdpDataLink, UdpDataLink, LinkKeys, u16) {
    let ka = LinkKeys {
        send: [1; 32],
        recv: [2; 32],
    };
    let kb = ka.swapped();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a_anchor = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b_anchor, _) = l.accept().unwrap();
    let sa = UdpSocket::bind("127.0.0.1:0").unwrap();
    let sb = UdpSocket::bind("127.0.0.1:0").unwrap();
    sa.connect(sb.local_addr().unwrap()).unwrap();
    sb.connect(sa.local_addr().unwrap()).unwrap();
    let b_port = sb.local_addr().unwrap().port();
    let da = Device::for_link(&sa, &ka, KmodConfig::default()).unwrap();
    let db = Device::for_link(&sb, &kb, KmodConfig::default()).unwrap();
    let cfg = UdpConfig::default();
    let a =
        UdpDataLink::with_kmod(sa, a_anchor, &ka, DEFAULT_MAX_PAYLOAD, cfg.clone(), da).unwrap();
    let b = UdpDataLink::with_kmod(sb, b_anchor, &kb, DEFAULT_MAX_PAYLOAD, cfg, db).unwrap();
    (a, b, kb, b_port)
}

#[test]
#[ignore = "needs the ringllm kernel module: kmod/test-qemu runs it in a guest"]
fn a_link_over_the_module_delivers_every_frame_through_forgeries() {
    kmod::probe().expect("the module is loaded");
    let (mut a, mut b, kb, b_port) = kmod_pair();
    let b_tag = kmod::tags(&kb).0;
    let sizes = [
        1usize,
        1399,
        1400,
        2560,
        16 << 10,
        100_000,
        1 << 20,
        8 << 20,
    ];
    // A forger on the same wire: well-formed datagrams for the frames in flight, with seals
    // that seal nothing, and malformed ones, until the frames are through.
    let stop = Arc::new(AtomicBool::new(false));
    let forger = std::thread::spawn({
        let stop = Arc::clone(&stop);
        move || {
            let raw = Raw::new(40_100);
            let (mut forged, mut bent) = (0u64, 0u64);
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) || forged < 200 {
                let frame = 1 + i % sizes.len() as u64;
                let count = 800;
                let h = Hdr::good(frame, (i * 7 % count as u64) as u32, count);
                raw.fire(b_port, &datagram(b_tag, h, 1400, i), None);
                forged += 1;
                if i.is_multiple_of(4) {
                    raw.fire(
                        b_port,
                        &datagram(b_tag, Hdr { version: 3, ..h }, 100, i),
                        None,
                    );
                    bent += 1;
                }
                i += 1;
                if i.is_multiple_of(8) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            (forged, bent)
        }
    });
    let backlog0 = backlog_drops();
    let sender = std::thread::spawn(move || {
        for (i, &n) in sizes.iter().enumerate() {
            let p = pattern(n, i as u64);
            let h = FrameHeader::new(FrameKind::Hidden, Dtype::F32, i as u64, 0, 1, 0, &p).unwrap();
            a.send(&h, &p).unwrap();
        }
        a
    });
    let mut buf = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let h = b
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("frame {i}: {e}"));
        assert_eq!(h.seq, i as u64, "in order");
        assert!(
            buf.len() == n && buf == pattern(n, i as u64),
            "frame {i} intact"
        );
    }
    stop.store(true, Ordering::Relaxed);
    let (forged, bent) = forger.join().unwrap();
    let a = sender.join().unwrap();
    // Nothing made up arrives after the real frames.
    assert!(b
        .recv_timeout(&mut buf, Duration::from_millis(300))
        .unwrap()
        .is_none());
    let ks = b.kmod_stats().expect("a kmod link");
    let c = b.counters();
    // A forged seal is refused as a bad MAC, or as a replay when its made-up counter is
    // outside the window (checked first).
    let refused = c.mac_failures.load(Ordering::Relaxed) + c.replays.load(Ordering::Relaxed);
    // Loopback drops what overflows the backlog queue before any hook sees it.
    let lost = backlog_drops() - backlog0;
    eprintln!(
        "forged {forged}, malformed {bent}; module: {ks:?}; link: seals refused {refused}, \
         retransmits {}; backlog drops {lost}",
        a.counters().retransmits.load(Ordering::Relaxed)
    );
    assert!(
        ks.dropped_malformed <= bent && ks.dropped_malformed + lost >= bent,
        "every malformed datagram that reached the hook counted by the module"
    );
    assert!(
        refused > 0 && refused <= forged.min(ks.claimed),
        "forgeries refused by the seal check: {refused}"
    );
    // Each forgery was refused by the link or dropped by the module (its slot or every bank
    // was taken, or it landed in a bank the link had just freed); none was delivered.
    assert!(
        refused + ks.dropped_busy + ks.dropped_no_bank + ks.dropped_stale + lost >= forged,
        "every forgery accounted for"
    );
    assert_eq!(c.frames_in.load(Ordering::Relaxed), sizes.len() as u64);
}

#[test]
#[ignore = "needs the ringllm kernel module: kmod/test-qemu runs it in a guest"]
fn a_link_over_the_module_sends_through_its_tx_area() {
    kmod::probe().expect("the module is loaded");
    let (mut a, mut b, _, _) = kmod_pair();
    let p = pattern(1 << 20, 5);
    let h = FrameHeader::new(FrameKind::Hidden, Dtype::F32, 5, 0, 1, 0, &p).unwrap();
    a.send(&h, &p).unwrap();
    let mut buf = Vec::new();
    assert_eq!(b.recv(&mut buf).unwrap().seq, 5);
    assert!(buf == p);
    let (sa, sb) = (a.kmod_stats().unwrap(), b.kmod_stats().unwrap());
    // 1 MiB in 1400-byte chunks: every data datagram went out through a's TX area and into
    // b's banks (more if some were sent again).
    let chunks = (1 << 20) + 40;
    let chunks = (chunks as u64).div_ceil(1400);
    assert!(sa.sent >= chunks, "{sa:?}");
    assert!(sb.claimed >= chunks, "{sb:?}");
    assert_eq!(a.transport(), ringllm_protocol::TransportKind::Kmod);
}
