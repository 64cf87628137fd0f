//! The QUIC transport over real UDP sockets on loopback: mutual TLS from the cluster key, the
//! RLHS handshake bound to it, frames of every size through the blocking `DataLink`, and peers
//! that misbehave (wrong key, foreign certificates, replayed and garbage datagrams, crashes).
//!
//! The runtime is built explicitly (multi-thread, 2 workers); links are used from std threads,
//! as the data plane does.

mod common;

use common::{data_frame, key, pattern, percentile, runtime, within};

use ringllm_protocol::control::Control;
use ringllm_protocol::frame::DEFAULT_MAX_PAYLOAD;
use ringllm_protocol::handshake::Session;
use ringllm_protocol::quic::{self, QuicDataLink, QuicServer};
use ringllm_protocol::{
    ClusterKey, DataLink, FrameKind, ProtocolError, Role, TransportError, HEADER_LEN,
};
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

const HS_TIMEOUT: Duration = Duration::from_secs(10);
/// No test should come near this; it turns a hang into a failure.
const TEST_LIMIT: Duration = Duration::from_secs(120);

type Accepted = Result<(QuicDataLink, Session, SocketAddr), TransportError>;

/// A server on 127.0.0.1 and a task accepting on it forever, handing results to the channel.
fn serve(
    rt: &tokio::runtime::Runtime,
    k: &ClusterKey,
    max_payload: u32,
) -> (Arc<QuicServer>, SocketAddr, mpsc::Receiver<Accepted>) {
    let server = rt
        .block_on(async { QuicServer::bind("127.0.0.1:0".parse().unwrap(), k, "node-a") })
        .expect("server binds");
    let server = Arc::new(server);
    let addr = server.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    let s = Arc::clone(&server);
    rt.spawn(async move {
        while let Some(r) = s.accept(HS_TIMEOUT, max_payload).await {
            if tx.send(r).is_err() {
                break;
            }
        }
    });
    (server, addr, rx)
}

fn connect_to(
    rt: &tokio::runtime::Runtime,
    addr: SocketAddr,
    k: &ClusterKey,
) -> Result<(QuicDataLink, Session), TransportError> {
    rt.block_on(quic::connect(
        &addr.to_string(),
        k,
        Role::Upstream,
        "coord",
        HS_TIMEOUT,
        DEFAULT_MAX_PAYLOAD,
    ))
}

/// The next accepted link, skipping failed attempts.
fn next_link(rx: &mpsc::Receiver<Accepted>) -> (QuicDataLink, Session, SocketAddr) {
    loop {
        match rx.recv_timeout(TEST_LIMIT).expect("the server accepts") {
            Ok(l) => return l,
            Err(e) => eprintln!("(skipping a failed connection: {e})"),
        }
    }
}

/// The next accepted connection's result, failed or not.
fn next_result(rx: &mpsc::Receiver<Accepted>) -> Accepted {
    rx.recv_timeout(TEST_LIMIT).expect("the server reports")
}

struct Pair {
    client: QuicDataLink,
    client_session: Session,
    server: QuicDataLink,
    server_session: Session,
}

fn pair_via(
    rt: &tokio::runtime::Runtime,
    addr: SocketAddr,
    rx: &mpsc::Receiver<Accepted>,
    k: &ClusterKey,
) -> Pair {
    let (client, client_session) = connect_to(rt, addr, k).expect("client connects");
    let (server, server_session, _) = next_link(rx);
    Pair {
        client,
        client_session,
        server,
        server_session,
    }
}

fn send_all(link: &mut QuicDataLink, sizes: &[usize], seed: u64) {
    for (i, &n) in sizes.iter().enumerate() {
        let p = pattern(n, seed + i as u64);
        link.send(&data_frame(i as u64, &p), &p).expect("send");
    }
}

fn recv_all(link: &mut QuicDataLink, sizes: &[usize], seed: u64) {
    let mut buf = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let h = link.recv(&mut buf).expect("recv");
        assert_eq!(h.seq, i as u64, "frames out of order");
        assert_eq!(buf.len(), n);
        assert!(
            buf == pattern(n, seed + i as u64),
            "frame {i} ({n} bytes) corrupted"
        );
    }
}

fn auth_error(e: &TransportError) -> bool {
    matches!(
        e,
        TransportError::Protocol(ProtocolError::Auth(_))
            | TransportError::Protocol(ProtocolError::Rejected(_))
    )
}

#[test]
fn frames_of_every_size_arrive_in_order_and_intact_both_ways() {
    within(TEST_LIMIT, || {
        let rt = runtime(2);
        let k = key("loopback key");
        let (_server, addr, rx) = serve(&rt, &k, DEFAULT_MAX_PAYLOAD);
        let Pair {
            mut client,
            client_session,
            mut server,
            server_session,
        } = pair_via(&rt, addr, &rx, &k);
        assert_eq!(client_session.session_key, server_session.session_key);
        assert!(client_session.initiator && !server_session.initiator);
        assert_eq!(client_session.peer.name, "node-a");
        assert_eq!(client_session.peer.role, Role::Node);
        assert_eq!(server_session.peer.name, "coord");
        assert_eq!(server_session.peer.role, Role::Upstream);
        assert_eq!(client.transport(), ringllm_protocol::TransportKind::Quic);
        assert_eq!(client.remote_address(), addr);
        // The handshake is not traffic.
        assert_eq!(client.counters().snapshot(), (0, 0, 0, 0));
        assert_eq!(server.counters().snapshot(), (0, 0, 0, 0));

        let sizes: Vec<usize> = vec![
            1,
            2,
            3,
            39,
            40,
            41,
            1199,
            1200,
            1201,
            2560,
            4095,
            4096,
            4097,
            65535,
            65536,
            65537,
            (1 << 20) + 3,
            4 << 20,
            16 << 20,
            (16 << 20) + 1,
            64 << 20,
            7,
        ];
        let total: u64 = sizes.iter().map(|&n| (HEADER_LEN + n) as u64).sum();
        let n = sizes.len() as u64;

        // Client → server while server → client, at the same time.
        let s1 = sizes.clone();
        let s2 = sizes.clone();
        let ct = thread::spawn(move || {
            send_all(&mut client, &s1, 100);
            recv_all(&mut client, &s2, 200);
            client
        });
        let sizes2 = sizes.clone();
        recv_all(&mut server, &sizes2, 100);
        send_all(&mut server, &sizes2, 200);
        let client = ct.join().expect("client thread");

        assert_eq!(client.counters().snapshot(), (n, total, n, total));
        // The client's last frames may still be counted on the server's side only once read,
        // which they all were.
        assert_eq!(server.counters().snapshot(), (n, total, n, total));

        // A control message in between data frames.
        let mut client = client;
        let (h, p) = Control::Heartbeat {
            nonce: 42,
            reply: false,
        }
        .to_frame()
        .unwrap();
        client.send(&h, &p).unwrap();
        let mut buf = Vec::new();
        let got = server.recv(&mut buf).unwrap();
        assert_eq!(got.kind, FrameKind::Control);
        assert!(matches!(
            Control::decode(&buf).unwrap(),
            Control::Heartbeat {
                nonce: 42,
                reply: false
            }
        ));
    });
}

#[test]
fn wrong_cluster_key_is_refused_on_both_sides_and_the_server_carries_on() {
    within(TEST_LIMIT, || {
        let rt = runtime(2);
        let k = key("the right key");
        let (_server, addr, rx) = serve(&rt, &k, DEFAULT_MAX_PAYLOAD);

        let e = connect_to(&rt, addr, &key("another key"))
            .err()
            .expect("wrong key refused");
        eprintln!("client with the wrong key: {e}");
        assert!(auth_error(&e), "{e:?}");
        assert!(e.to_string().contains("cluster"), "{e}");
        let e = next_result(&rx)
            .err()
            .expect("server refuses the wrong key");
        eprintln!("server facing the wrong key: {e}");
        assert!(auth_error(&e), "{e:?}");
        assert!(e.to_string().contains("cluster key"), "{e}");

        // The right key still gets in.
        let mut p = pair_via(&rt, addr, &rx, &k);
        send_all(&mut p.client, &[10, 5000], 1);
        recv_all(&mut p.server, &[10, 5000], 1);
    });
}

/// A raw quinn client trusting the cluster CA, presenting `client_cert` (or none).
fn raw_client_attempt(
    rt: &tokio::runtime::Runtime,
    addr: SocketAddr,
    k: &ClusterKey,
    client_cert: Option<rcgen::CertifiedKey<rcgen::KeyPair>>,
) -> Result<(), String> {
    rt.block_on(async {
        let provider = quic::crypto_provider();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(quic::cluster_ca(k).unwrap()).unwrap();
        let b = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots);
        let mut cfg = match client_cert {
            Some(ck) => {
                let key = rustls::pki_types::PrivateKeyDer::Pkcs8(
                    rustls::pki_types::PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()),
                );
                b.with_client_auth_cert(vec![ck.cert.der().clone()], key)
                    .unwrap()
            }
            None => b.with_no_client_auth(),
        };
        cfg.alpn_protocols = vec![quic::ALPN.to_vec()];
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(cfg).unwrap();
        let mut cc = quinn::ClientConfig::new(Arc::new(crypto));
        cc.transport_config(Arc::new(quic::transport_config(false)));
        let ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        let conn = ep
            .connect_with(cc, addr, quic::SERVER_NAME)
            .unwrap()
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        // TLS 1.3: the client may think it is done before the server has checked its
        // certificate; the refusal shows on the first use.
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| format!("open: {e}"))?;
        send.write_all(b"RLHS hello?")
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut b = [0u8; 7];
        recv.read_exact(&mut b)
            .await
            .map_err(|e| format!("read: {e}"))?;
        Ok(())
    })
}

#[test]
fn certificates_not_from_the_cluster_ca_are_refused() {
    within(TEST_LIMIT, || {
        let rt = runtime(2);
        let k = key("ca key");
        let (_server, addr, rx) = serve(&rt, &k, DEFAULT_MAX_PAYLOAD);

        // Self-signed, with the right name.
        let self_signed =
            rcgen::generate_simple_self_signed(vec![quic::SERVER_NAME.into()]).unwrap();
        let r = raw_client_attempt(&rt, addr, &k, Some(self_signed));
        eprintln!("self-signed client: {r:?}");
        assert!(r.is_err());
        let e = next_result(&rx)
            .err()
            .expect("server refuses a self-signed client");
        eprintln!("server: {e}");
        assert!(auth_error(&e), "{e:?}");

        // No client certificate at all.
        let r = raw_client_attempt(&rt, addr, &k, None);
        eprintln!("client without a certificate: {r:?}");
        assert!(r.is_err());
        let e = next_result(&rx)
            .err()
            .expect("server refuses a client without a certificate");
        eprintln!("server: {e}");
        assert!(auth_error(&e), "{e:?}");

        let mut p = pair_via(&rt, addr, &rx, &k);
        send_all(&mut p.client, &[123], 5);
        recv_all(&mut p.server, &[123], 5);
    });
}

/// A UDP relay between one client and a server that records the client's first datagrams
/// and can drop everything (a crashed peer or a pulled cable, as both ends see it).
struct Proxy {
    addr: SocketAddr,
    blackhole: Arc<AtomicBool>,
    captured: Arc<Mutex<Vec<Vec<u8>>>>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    fn new(server: SocketAddr) -> Proxy {
        let front = UdpSocket::bind("127.0.0.1:0").unwrap();
        let back = UdpSocket::bind("127.0.0.1:0").unwrap();
        back.connect(server).unwrap();
        for s in [&front, &back] {
            s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        }
        let addr = front.local_addr().unwrap();
        let blackhole = Arc::new(AtomicBool::new(false));
        let captured = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let client: Arc<Mutex<Option<SocketAddr>>> = Arc::new(Mutex::new(None));
        {
            let (front, back) = (front.try_clone().unwrap(), back.try_clone().unwrap());
            let (blackhole, captured, stop, client) = (
                blackhole.clone(),
                captured.clone(),
                stop.clone(),
                client.clone(),
            );
            thread::spawn(move || {
                let mut b = vec![0u8; 65536];
                while !stop.load(Ordering::Relaxed) {
                    let Ok((n, from)) = front.recv_from(&mut b) else {
                        continue;
                    };
                    *client.lock().unwrap() = Some(from);
                    {
                        let mut c = captured.lock().unwrap();
                        if c.len() < 32 {
                            c.push(b[..n].to_vec());
                        }
                    }
                    if !blackhole.load(Ordering::Relaxed) {
                        let _ = back.send(&b[..n]);
                    }
                }
            });
        }
        {
            let (blackhole, stop) = (blackhole.clone(), stop.clone());
            thread::spawn(move || {
                let mut b = vec![0u8; 65536];
                while !stop.load(Ordering::Relaxed) {
                    let Ok(n) = back.recv(&mut b) else { continue };
                    let to = *client.lock().unwrap();
                    if let (false, Some(to)) = (blackhole.load(Ordering::Relaxed), to) {
                        let _ = front.send_to(&b[..n], to);
                    }
                }
            });
        }
        Proxy {
            addr,
            blackhole,
            captured,
            stop,
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[test]
fn replayed_handshakes_and_garbage_datagrams_do_not_disturb_the_server() {
    within(TEST_LIMIT, || {
        let rt = runtime(2);
        let k = key("replay key");
        let (_server, addr, rx) = serve(&rt, &k, DEFAULT_MAX_PAYLOAD);
        let proxy = Proxy::new(addr);
        let mut first = pair_via(&rt, proxy.addr, &rx, &k);
        send_all(&mut first.client, &[100, 3000], 9);
        recv_all(&mut first.server, &[100, 3000], 9);

        // Replay everything the client sent, twice, from another socket, then garbage.
        let attacker = UdpSocket::bind("127.0.0.1:0").unwrap();
        let captured = proxy.captured.lock().unwrap().clone();
        assert!(!captured.is_empty());
        for _ in 0..2 {
            for d in &captured {
                attacker.send_to(d, addr).unwrap();
            }
        }
        for (i, n) in [0usize, 1, 5, 40, 1200, 1252, 1500, 9000]
            .into_iter()
            .enumerate()
        {
            let mut g = pattern(n, 77 + i as u64);
            attacker.send_to(&g, addr).unwrap();
            if n >= 1200 {
                // A long header claiming QUIC v1 with random contents.
                g[0] = 0xc3;
                g[1..5].copy_from_slice(&1u32.to_be_bytes());
                g[5] = 8;
                attacker.send_to(&g, addr).unwrap();
            }
        }
        // Replays of our own packets to the established connection's port from elsewhere.
        for d in captured.iter().rev().take(4) {
            attacker.send_to(d, addr).unwrap();
        }

        // The established link still works, both ways.
        send_all(&mut first.client, &[5, 70000], 10);
        recv_all(&mut first.server, &[5, 70000], 10);
        send_all(&mut first.server, &[6], 11);
        recv_all(&mut first.client, &[6], 11);

        // A new client gets in (the replayed handshakes fail in the background).
        let (mut c, _) = connect_to(&rt, addr, &k).expect("client connects after the replay");
        let (mut s, session, _) = next_link(&rx);
        assert_eq!(session.peer.name, "coord");
        send_all(&mut c, &[42], 12);
        recv_all(&mut s, &[42], 12);
    });
}

#[test]
fn peer_close_is_closed_and_frames_sent_before_it_arrive() {
    within(TEST_LIMIT, || {
        let rt = runtime(2);
        let k = key("close key");
        let (_server, addr, rx) = serve(&rt, &k, DEFAULT_MAX_PAYLOAD);

        // Client sends and drops at once; the server reads late.
        let mut p = pair_via(&rt, addr, &rx, &k);
        let sizes = [10, 2 << 20, 20];
        send_all(&mut p.client, &sizes, 3);
        drop(p.client);
        thread::sleep(Duration::from_millis(300));
        recv_all(&mut p.server, &sizes, 3);
        let mut buf = Vec::new();
        let e = p.server.recv(&mut buf).expect_err("closed");
        assert!(e.is_closed(), "{e:?}");
        // And stays so.
        assert!(p
            .server
            .recv_timeout(&mut buf, Duration::from_millis(10))
            .is_err());

        // The other direction.
        let mut p = pair_via(&rt, addr, &rx, &k);
        send_all(&mut p.server, &[1], 4);
        drop(p.server);
        recv_all(&mut p.client, &[1], 4);
        let e = p.client.recv(&mut buf).expect_err("closed");
        assert!(e.is_closed(), "{e:?}");
    });
}

#[test]
fn a_crashed_peer_is_an_error_within_seconds() {
    within(TEST_LIMIT, || {
        let rt = runtime(2);
        let k = key("crash key");
        let (_server, addr, rx) = serve(&rt, &k, DEFAULT_MAX_PAYLOAD);
        let proxy = Proxy::new(addr);
        let mut p = pair_via(&rt, proxy.addr, &rx, &k);
        send_all(&mut p.client, &[64], 1);
        recv_all(&mut p.server, &[64], 1);

        proxy.blackhole.store(true, Ordering::Relaxed);
        let t = Instant::now();
        let mut client = p.client;
        let sender = thread::spawn(move || {
            // Sends until flow control or the idle timeout stops it.
            let payload = vec![1u8; 1 << 20];
            let h = data_frame(0, &payload);
            loop {
                if let Err(e) = client.send(&h, &payload) {
                    return e;
                }
            }
        });
        let mut buf = Vec::new();
        let e = p
            .server
            .recv(&mut buf)
            .expect_err("the silent peer is noticed");
        eprintln!("server after {:?}: {e}", t.elapsed());
        assert!(!e.is_closed(), "a crash is not a clean close: {e:?}");
        assert!(e.to_string().contains("no packet"), "{e}");
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "took {:?}",
            t.elapsed()
        );
        let e = sender.join().unwrap();
        eprintln!("client sender after {:?}: {e}", t.elapsed());
        assert!(!e.is_closed(), "{e:?}");
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "took {:?}",
            t.elapsed()
        );
    });
}

#[test]
fn a_timed_out_recv_keeps_a_partly_received_header() {
    within(TEST_LIMIT, || {
        let rt = runtime(2);
        let k = key("torn key");
        let (_server, addr, rx) = serve(&rt, &k, DEFAULT_MAX_PAYLOAD);
        let mut p = pair_via(&rt, addr, &rx, &k);
        let payload = pattern(5000, 8);
        let h = data_frame(3, &payload).encode();
        let mut buf = Vec::new();
        // All but the header's last byte, in three pieces with waits in between, each longer
        // than the receiver's timeout: every piece is kept. (Once a header is whole, `recv_timeout`
        // waits for its payload.)
        for piece in [&h[..1], &h[1..17], &h[17..39]] {
            p.client.send_raw(piece).unwrap();
            thread::sleep(Duration::from_millis(50));
            if let Some(got) = p
                .server
                .recv_timeout(&mut buf, Duration::from_millis(5))
                .unwrap()
            {
                panic!("a frame without its payload: {got:?}");
            }
        }
        // The header's last byte and the payload: the frame is whole.
        p.client.send_raw(&h[39..]).unwrap();
        p.client.send_raw(&payload).unwrap();
        let got = p
            .server
            .recv_timeout(&mut buf, Duration::from_secs(20))
            .unwrap()
            .expect("the frame");
        assert_eq!(got.seq, 3);
        assert!(buf == payload);
        // Garbage where a header should be is refused.
        p.client.send_raw(&[0x55; HEADER_LEN]).unwrap();
        let e = p.server.recv(&mut buf).expect_err("garbage header");
        assert!(
            matches!(e, TransportError::Protocol(ProtocolError::BadMagic { .. })),
            "{e:?}"
        );
    });
}

#[test]
fn oversized_frames_are_refused() {
    within(TEST_LIMIT, || {
        let rt = runtime(2);
        let k = key("cap key");
        let (_server, addr, rx) = serve(&rt, &k, 1 << 20);
        let mut p = pair_via(&rt, addr, &rx, &k);
        let payload = vec![0u8; 2 << 20];
        p.client.send(&data_frame(0, &payload), &payload).unwrap();
        let mut buf = Vec::new();
        let e = p.server.recv(&mut buf).expect_err("too large");
        assert!(
            matches!(e, TransportError::Protocol(ProtocolError::TooLarge { .. })),
            "{e:?}"
        );
    });
}

#[test]
fn closing_the_server_ends_accept_but_not_its_links() {
    within(TEST_LIMIT, || {
        let rt = runtime(2);
        let k = key("server close key");
        let server = rt
            .block_on(async { QuicServer::bind("127.0.0.1:0".parse().unwrap(), &k, "node-a") })
            .unwrap();
        let server = Arc::new(server);
        let addr = server.local_addr().unwrap();
        let s = Arc::clone(&server);
        let accepted = rt.spawn(async move { s.accept(HS_TIMEOUT, DEFAULT_MAX_PAYLOAD).await });
        let (mut c, _) = connect_to(&rt, addr, &k).unwrap();
        let (mut l, _, _) = rt.block_on(accepted).unwrap().unwrap().unwrap();
        server.close();
        assert!(rt
            .block_on(server.accept(HS_TIMEOUT, DEFAULT_MAX_PAYLOAD))
            .is_none());
        send_all(&mut c, &[9], 1);
        recv_all(&mut l, &[9], 1);
        // New connections are refused.
        let e = rt
            .block_on(quic::connect(
                &addr.to_string(),
                &k,
                Role::Upstream,
                "late",
                Duration::from_secs(3),
                DEFAULT_MAX_PAYLOAD,
            ))
            .err()
            .expect("refused after close");
        eprintln!("connecting to a closed server: {e}");
        assert!(
            matches!(&e, TransportError::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused),
            "{e:?}"
        );
        // The link accepted before still works.
        send_all(&mut l, &[10], 2);
        recv_all(&mut c, &[10], 2);
    });
}

/// One-way latency of a 2.5 KB frame (half a ping-pong) and 1 MiB frame throughput over a
/// link pair; prints one line each.
fn measure(what: &str, client: &mut dyn DataLink, mut server: Box<dyn DataLink>) {
    let echo = thread::spawn(move || {
        let mut buf = Vec::new();
        loop {
            let h = server.recv(&mut buf).expect("echo");
            if h.seq == u64::MAX {
                break;
            }
            server.send(&h, &buf).expect("echo");
        }
        // Throughput phase: receive until the marker.
        let mut bytes = 0usize;
        loop {
            let h = server.recv(&mut buf).unwrap();
            if h.seq == u64::MAX {
                break;
            }
            bytes += buf.len();
        }
        bytes
    });

    let payload = pattern(2560, 1);
    let mut buf = Vec::new();
    let mut one_way = Vec::new();
    for i in 0..5000u64 {
        let h = data_frame(i, &payload);
        let t = Instant::now();
        client.send(&h, &payload).unwrap();
        client.recv(&mut buf).unwrap();
        if i >= 500 {
            one_way.push(t.elapsed() / 2);
        }
    }
    one_way.sort();
    println!(
        "{what} 2.5 KB one-way: p50 {:?} p99 {:?} (over {} ping-pongs)",
        percentile(&one_way, 0.5),
        percentile(&one_way, 0.99),
        one_way.len()
    );
    let end = data_frame(u64::MAX, &[0u8]);
    client.send(&end, &[0u8]).unwrap();

    let big = pattern(1 << 20, 2);
    let h = data_frame(1, &big);
    let frames = 1024;
    let t = Instant::now();
    for _ in 0..frames {
        client.send(&h, &big).unwrap();
    }
    client.send(&end, &[0u8]).unwrap();
    let bytes = echo.join().unwrap();
    let total = t.elapsed();
    assert_eq!(bytes, frames << 20);
    println!(
        "{what} 1 MiB frames: {:.0} MiB/s ({} MiB in {:?})",
        bytes as f64 / (1 << 20) as f64 / total.as_secs_f64(),
        bytes >> 20,
        total
    );
}

/// Loopback numbers for QUIC, and for TCP (sealed frames) beside them.
/// `cargo test --release -p ringllm-protocol --test quic_link -- --ignored --nocapture`.
#[test]
#[ignore]
fn measure_latency_and_throughput() {
    let rt = runtime(2);
    let k = key("measure key");
    let (_server, addr, rx) = serve(&rt, &k, DEFAULT_MAX_PAYLOAD);
    let p = pair_via(&rt, addr, &rx, &k);
    let mut client = p.client;
    measure("quic", &mut client, Box::new(p.server));
    println!("quic path: {:?}", client.stats().path);

    // TCP for comparison.
    let l = rt
        .block_on(async { ringllm_protocol::sock::listen_tcp("127.0.0.1:0".parse().unwrap()) })
        .unwrap();
    let taddr = l.local_addr().unwrap();
    let k2 = k.clone();
    let accepted = rt.spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let session =
            ringllm_protocol::control_conn::accept_stream(&mut s, &k2, "node-a", HS_TIMEOUT)
                .await
                .unwrap();
        ringllm_protocol::TcpDataLink::new(
            s.into_std().unwrap(),
            DEFAULT_MAX_PAYLOAD,
            &session.link_keys(),
        )
        .unwrap()
    });
    let mut tclient = rt
        .block_on(ringllm_protocol::dial::connect_data_link(
            &ringllm_protocol::dial::DialSpec {
                kind: ringllm_protocol::TransportKind::Tcp,
                addr: &taddr.to_string(),
                name: "coord",
                timeout: HS_TIMEOUT,
                max_payload: DEFAULT_MAX_PAYLOAD,
                ring_session: 1,
                role: ringllm_protocol::dial::LinkRole::Input,
            },
            &k,
        ))
        .unwrap();
    let mut tserver = rt.block_on(accepted).unwrap();
    let mut buf = Vec::new();
    tserver.recv(&mut buf).unwrap(); // Attach
    measure("tcp", tclient.as_mut(), Box::new(tserver));
}
