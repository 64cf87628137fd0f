//! The TCP transport over real loopback sockets: handshake through `connect`/`accept`, frames
//! of every size, control messages, and peers that misbehave (wrong key, garbage, silence,
//! early close, corruption).

mod common;

use common::{data_frame, key, pattern};

use ringllm_protocol::control::{Control, ErrorCode, ErrorMsg};
use ringllm_protocol::control_conn::{self, control_of, send_control};
use ringllm_protocol::frame::{DEFAULT_MAX_PAYLOAD, FLAG_ALL_TOKENS};
use ringllm_protocol::handshake::HsMsg;
use ringllm_protocol::seal::{SealError, Sealer, SEAL_LEN};
use ringllm_protocol::{
    ClusterKey, Dtype, FrameHeader, FrameKind, Link, ProtocolError, Role, TransportError,
    HEADER_LEN,
};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const HS_TIMEOUT: Duration = Duration::from_secs(5);
/// No test should come near this; it turns a hang into a failure.
const TEST_LIMIT: Duration = Duration::from_secs(30);

async fn within<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_LIMIT, f)
        .await
        .expect("test took too long")
}

fn bind() -> (TcpListener, SocketAddr) {
    let l = ringllm_protocol::sock::listen_tcp("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = l.local_addr().unwrap();
    (l, addr)
}

/// Accepts one connection on `l` and authenticates it.
async fn accept_one(
    l: &TcpListener,
    k: &ClusterKey,
    timeout: Duration,
    max_payload: u32,
) -> Result<Link, TransportError> {
    let (s, _) = l.accept().await?;
    control_conn::accept(s, k, "node-a", timeout, max_payload).await
}

/// A connected, authenticated pair: (client, server).
async fn link_pair(k: &ClusterKey, server_max_payload: u32) -> (Link, Link) {
    let (l, addr) = bind();
    let server_key = k.clone();
    let server =
        tokio::spawn(
            async move { accept_one(&l, &server_key, HS_TIMEOUT, server_max_payload).await },
        );
    let client = control_conn::connect(
        &addr.to_string(),
        k,
        Role::Coordinator,
        "coord",
        HS_TIMEOUT,
        DEFAULT_MAX_PAYLOAD,
    )
    .await
    .expect("client connects");
    let server = server.await.unwrap().expect("server accepts");
    (client, server)
}

#[tokio::test]
async fn connect_and_accept_authenticate_both_ways() {
    within(async {
        let k = key("loopback key");
        let (client, server) = link_pair(&k, DEFAULT_MAX_PAYLOAD).await;
        assert_eq!(client.session.session_key, server.session.session_key);
        assert_eq!(client.session.peer.name, "node-a");
        assert_eq!(client.session.peer.role, Role::Node);
        assert_eq!(server.session.peer.name, "coord");
        assert_eq!(server.session.peer.role, Role::Coordinator);
        assert!(
            server.peer_addr.starts_with("127.0.0.1:"),
            "{}",
            server.peer_addr
        );
        assert!(
            client.peer_addr.starts_with("127.0.0.1:"),
            "{}",
            client.peer_addr
        );
        // Nothing counted before the first frame: the handshake is not traffic.
        assert_eq!(client.counters.snapshot(), (0, 0, 0, 0));
        assert_eq!(server.counters.snapshot(), (0, 0, 0, 0));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_of_every_size_arrive_in_order_and_intact() {
    within(async {
        let (mut client, mut server) = link_pair(&key("k"), DEFAULT_MAX_PAYLOAD).await;
        let sizes: Vec<usize> = vec![
            1,
            2,
            3,
            39,
            40,
            41,
            4095,
            4096,
            4097,
            65535,
            65536,
            65537,
            (64 << 10) * 3 + 7,
            1 << 20,
            (1 << 20) + 3,
            4 << 20,
            8 << 20,
        ];
        let sent = sizes.clone();
        // The sender runs on its own task: an 8 MiB frame does not fit the socket buffers.
        let mut tx = client.tx;
        let sender = tokio::spawn(async move {
            for (i, &n) in sent.iter().enumerate() {
                let payload = pattern(n, i as u64);
                tx.send(&data_frame(i as u64, &payload), &payload).await?;
            }
            Ok::<_, TransportError>(tx)
        });
        let mut buf = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let h = server.rx.recv(&mut buf).await.expect("frame arrives");
            assert_eq!(h.seq, i as u64, "frames in order");
            assert_eq!(h.pos, i as u32);
            assert_eq!(h.kind, FrameKind::Hidden);
            assert_eq!(h.dtype, Dtype::F16);
            assert_eq!(h.len as usize, n);
            assert_eq!(buf.len(), n);
            assert!(
                buf == pattern(n, i as u64),
                "payload {i} ({n} bytes) differs"
            );
        }
        client.tx = sender.await.unwrap().unwrap();

        // Counters: one frame and header + payload bytes each, on both sides.
        let frames = sizes.len() as u64;
        let bytes: u64 = sizes
            .iter()
            .map(|&n| (n + HEADER_LEN + SEAL_LEN) as u64)
            .sum();
        assert_eq!(client.counters.snapshot(), (frames, bytes, 0, 0));
        assert_eq!(server.counters.snapshot(), (0, 0, frames, bytes));

        // The other direction works too, and is counted separately.
        let payload = pattern(100, 99);
        let h = FrameHeader::new(
            FrameKind::Logits,
            Dtype::F32,
            5,
            0,
            25,
            FLAG_ALL_TOKENS,
            &payload,
        )
        .unwrap();
        server.tx.send(&h, &payload).await.unwrap();
        let got = client.rx.recv(&mut buf).await.unwrap();
        assert_eq!(got, h);
        assert_eq!(buf, payload);
        assert_eq!(got.bytes_per_token(), 4);
        assert_eq!(
            server.counters.snapshot(),
            (1, (140 + SEAL_LEN) as u64, frames, bytes)
        );
        assert_eq!(
            client.counters.snapshot(),
            (frames, bytes, 1, (140 + SEAL_LEN) as u64)
        );
    })
    .await;
}

#[tokio::test]
async fn control_messages_round_trip_between_data_frames() {
    within(async {
        let (mut client, mut server) = link_pair(&key("k"), DEFAULT_MAX_PAYLOAD).await;
        let msgs = [
            Control::Heartbeat {
                nonce: 42,
                reply: false,
            },
            Control::GetStats,
            Control::Error(ErrorMsg {
                code: ErrorCode::ModelMissing,
                seq: Some(3),
                message: "no such file: model.gguf".into(),
            }),
            Control::Shutdown {
                reason: "ünïcødé".into(),
            },
        ];
        let mut buf = Vec::new();
        for (i, m) in msgs.iter().enumerate() {
            send_control(client.tx.as_mut(), m).await.unwrap();
            let payload = pattern(16, i as u64);
            client
                .tx
                .send(&data_frame(i as u64, &payload), &payload)
                .await
                .unwrap();
        }
        for (i, m) in msgs.iter().enumerate() {
            let h = server.rx.recv(&mut buf).await.unwrap();
            assert_eq!(h.kind, FrameKind::Control);
            assert_eq!(&control_of(&h, &buf).unwrap(), m);
            let h = server.rx.recv(&mut buf).await.unwrap();
            assert_eq!(h.seq, i as u64);
            // A data frame is not a control message.
            assert!(matches!(
                control_of(&h, &buf),
                Err(ProtocolError::Inconsistent(_))
            ));
        }
        // And back.
        let reply = Control::Heartbeat {
            nonce: 42,
            reply: true,
        };
        send_control(server.tx.as_mut(), &reply).await.unwrap();
        let h = client.rx.recv(&mut buf).await.unwrap();
        assert_eq!(control_of(&h, &buf).unwrap(), reply);
    })
    .await;
}

#[tokio::test]
async fn wrong_key_fails_on_both_sides_and_the_listener_carries_on() {
    within(async {
        let (l, addr) = bind();
        let k = key("the cluster key");
        let server = tokio::spawn(async move {
            let first = accept_one(&l, &k, HS_TIMEOUT, DEFAULT_MAX_PAYLOAD).await;
            let second = accept_one(&l, &k, HS_TIMEOUT, DEFAULT_MAX_PAYLOAD).await;
            (first, second)
        });
        let bad = control_conn::connect(
            &addr.to_string(),
            &key("another key"),
            Role::Coordinator,
            "intruder",
            HS_TIMEOUT,
            DEFAULT_MAX_PAYLOAD,
        )
        .await;
        match bad {
            Ok(_) => panic!("a client with the wrong key connected"),
            Err(TransportError::Protocol(ProtocolError::Rejected(r))) => {
                assert!(r.contains("node-a"), "{r}");
            }
            Err(e) => panic!("expected a rejection, got {e:?}"),
        }
        let good = control_conn::connect(
            &addr.to_string(),
            &key("the cluster key"),
            Role::Upstream,
            "friend",
            HS_TIMEOUT,
            DEFAULT_MAX_PAYLOAD,
        )
        .await
        .expect("the right key still gets in");
        let (first, second) = server.await.unwrap();
        match first {
            Ok(_) => panic!("the server accepted the wrong key"),
            Err(TransportError::Protocol(ProtocolError::Auth(m))) => {
                assert!(m.contains("intruder"), "{m}");
            }
            Err(e) => panic!("expected an auth error, got {e:?}"),
        }
        let second = second.expect("second client accepted");
        assert_eq!(second.session.peer.name, "friend");
        assert_eq!(second.session.session_key, good.session.session_key);
    })
    .await;
}

#[tokio::test]
async fn garbage_client_is_refused_promptly() {
    within(async {
        let (l, addr) = bind();
        let mut raw = TcpStream::connect(addr).await.unwrap();
        raw.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await
            .unwrap();
        let t0 = Instant::now();
        let r = accept_one(&l, &key("k"), HS_TIMEOUT, DEFAULT_MAX_PAYLOAD).await;
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        match r {
            Ok(_) => panic!("garbage accepted"),
            Err(TransportError::Protocol(ProtocolError::BadMagic { found, .. })) => {
                assert_eq!(&found, b"GET ");
            }
            Err(e) => panic!("expected BadMagic, got {e:?}"),
        }
    })
    .await;
}

#[tokio::test]
async fn silent_client_times_out() {
    within(async {
        let (l, addr) = bind();
        let _silent = TcpStream::connect(addr).await.unwrap();
        let limit = Duration::from_millis(300);
        let t0 = Instant::now();
        let r = accept_one(&l, &key("k"), limit, DEFAULT_MAX_PAYLOAD).await;
        let took = t0.elapsed();
        assert!(
            matches!(r, Err(TransportError::Timeout(d, _)) if d == limit),
            "{:?}",
            r.err()
        );
        assert!(took >= limit && took < Duration::from_secs(3), "{took:?}");
    })
    .await;
}

#[tokio::test]
async fn silent_server_times_out_the_client() {
    within(async {
        // The kernel completes the TCP connection, but nobody answers the hello.
        let (_l, addr) = bind();
        let limit = Duration::from_millis(300);
        let r = control_conn::connect(
            &addr.to_string(),
            &key("k"),
            Role::Coordinator,
            "c",
            limit,
            DEFAULT_MAX_PAYLOAD,
        )
        .await;
        assert!(
            matches!(r, Err(TransportError::Timeout(d, _)) if d == limit),
            "{:?}",
            r.err()
        );
    })
    .await;
}

#[tokio::test]
async fn clean_close_is_reported_as_closed() {
    within(async {
        let (client, mut server) = link_pair(&key("k"), DEFAULT_MAX_PAYLOAD).await;
        let mut tx = client.tx;
        let payload = pattern(10, 1);
        tx.send(&data_frame(1, &payload), &payload).await.unwrap();
        drop(tx);
        drop(client.rx);
        let mut buf = Vec::new();
        // The frame sent before the close is still delivered, then the close.
        assert_eq!(server.rx.recv(&mut buf).await.unwrap().seq, 1);
        let r = server.rx.recv(&mut buf).await;
        assert!(
            matches!(&r, Err(e) if e.is_closed()),
            "expected Closed, got {r:?}"
        );
        assert!(matches!(r, Err(TransportError::Closed)));
    })
    .await;
}

/// A raw socket that has done a real handshake, and the server's end of it.
async fn raw_client(k: &ClusterKey, server_max_payload: u32) -> (TcpStream, Link) {
    let (raw, server, _) = raw_client_session(k, server_max_payload).await;
    (raw, server)
}

/// A raw client socket, the server's link, and the raw side's sealer (to write frames by hand
/// that the server accepts).
async fn raw_client_session(k: &ClusterKey, server_max_payload: u32) -> (TcpStream, Link, Sealer) {
    let (l, addr) = bind();
    let server_key = k.clone();
    let server =
        tokio::spawn(
            async move { accept_one(&l, &server_key, HS_TIMEOUT, server_max_payload).await },
        );
    let mut raw = TcpStream::connect(addr).await.unwrap();
    let session = control_conn::client_handshake(&mut raw, k, Role::Coordinator, "raw")
        .await
        .expect("raw handshake");
    let server = server
        .await
        .unwrap()
        .expect("server accepts the raw client");
    assert_eq!(session.session_key, server.session.session_key);
    let sealer = Sealer::new(&session.link_keys().send);
    (raw, server, sealer)
}

#[tokio::test]
async fn close_in_the_middle_of_a_frame_is_an_error_not_a_clean_close() {
    within(async {
        let (mut raw, mut server) = raw_client(&key("k"), DEFAULT_MAX_PAYLOAD).await;
        let payload = pattern(64, 3);
        let h = data_frame(3, &payload);
        raw.write_all(&h.encode()[..20]).await.unwrap();
        raw.shutdown().await.unwrap();
        let mut buf = Vec::new();
        let r = server.rx.recv(&mut buf).await;
        assert!(matches!(r, Err(TransportError::Io(_))), "{r:?}");
    })
    .await;
}

#[tokio::test]
async fn corrupted_payload_is_a_checksum_error() {
    within(async {
        let (mut raw, mut server, mut sealer) =
            raw_client_session(&key("k"), DEFAULT_MAX_PAYLOAD).await;
        let mut buf = Vec::new();

        // First an intact frame written by hand, to show the raw path itself is sound.
        let payload = pattern(256, 7);
        let h = data_frame(7, &payload);
        raw.write_all(&h.encode()).await.unwrap();
        raw.write_all(&payload).await.unwrap();
        raw.write_all(&sealer.seal(&[&h.encode(), &payload]))
            .await
            .unwrap();
        assert_eq!(server.rx.recv(&mut buf).await.unwrap(), h);
        assert_eq!(buf, payload);

        // Then the same frame with one payload bit flipped in transit.
        let mut bad = payload.clone();
        bad[100] ^= 0x10;
        raw.write_all(&h.encode()).await.unwrap();
        raw.write_all(&bad).await.unwrap();
        raw.write_all(&sealer.seal(&[&h.encode(), &payload]))
            .await
            .unwrap();
        let r = server.rx.recv(&mut buf).await;
        match r {
            Err(TransportError::Protocol(ProtocolError::Checksum { expected, found })) => {
                assert_eq!(expected, h.crc);
                assert_ne!(found, h.crc);
            }
            other => panic!("expected a checksum error, got {other:?}"),
        }
        // Only the intact frame was counted.
        assert_eq!(
            server.counters.snapshot(),
            (0, 0, 1, (HEADER_LEN + 256 + SEAL_LEN) as u64)
        );
    })
    .await;
}

/// Someone who can write into the stream but lacks the session key: a frame whose CRC is
/// right but whose seal is not is refused, counted, and ends the link.
#[tokio::test]
async fn forged_seal_mid_stream_is_refused_and_counted() {
    within(async {
        let (mut raw, mut server, mut sealer) =
            raw_client_session(&key("k"), DEFAULT_MAX_PAYLOAD).await;
        let mut buf = Vec::new();
        let payload = pattern(300, 1);
        let h = data_frame(1, &payload);
        raw.write_all(&h.encode()).await.unwrap();
        raw.write_all(&payload).await.unwrap();
        raw.write_all(&sealer.seal(&[&h.encode(), &payload]))
            .await
            .unwrap();
        assert_eq!(server.rx.recv(&mut buf).await.unwrap(), h);

        // The next frame: intact CRC, a seal made with a guessed key.
        let payload2 = pattern(300, 2);
        let h2 = data_frame(2, &payload2);
        let mut forger = Sealer::new(&[0x42; 32]);
        let _ = forger.seal(&[b"burn counter 1"]);
        raw.write_all(&h2.encode()).await.unwrap();
        raw.write_all(&payload2).await.unwrap();
        raw.write_all(&forger.seal(&[&h2.encode(), &payload2]))
            .await
            .unwrap();
        match server.rx.recv(&mut buf).await {
            Err(TransportError::Seal(SealError::BadMac)) => {}
            other => panic!("expected a MAC failure, got {other:?}"),
        }
        assert_eq!(server.counters.mac_failures.load(Ordering::Relaxed), 1);
        assert_eq!(server.counters.frames_in.load(Ordering::Relaxed), 1);
    })
    .await;
}

/// A frame recorded off the wire and written again is refused (its counter is old).
#[tokio::test]
async fn replayed_frame_mid_stream_is_refused_and_counted() {
    within(async {
        let (mut raw, mut server, mut sealer) =
            raw_client_session(&key("k"), DEFAULT_MAX_PAYLOAD).await;
        let mut buf = Vec::new();
        let payload = pattern(64, 5);
        let h = data_frame(5, &payload);
        let mut wire = h.encode().to_vec();
        wire.extend_from_slice(&payload);
        wire.extend_from_slice(&sealer.seal(&[&h.encode(), &payload]));
        raw.write_all(&wire).await.unwrap();
        assert_eq!(server.rx.recv(&mut buf).await.unwrap(), h);
        raw.write_all(&wire).await.unwrap();
        match server.rx.recv(&mut buf).await {
            Err(TransportError::Seal(SealError::OutOfOrder {
                got: 1,
                expected: 2,
            })) => {}
            other => panic!("expected a replay refusal, got {other:?}"),
        }
        assert_eq!(server.counters.replays.load(Ordering::Relaxed), 1);
        assert_eq!(server.counters.mac_failures.load(Ordering::Relaxed), 0);
    })
    .await;
}

#[tokio::test]
async fn oversized_frame_is_refused_before_reading_it() {
    within(async {
        let (mut raw, mut server) = raw_client(&key("k"), 1 << 20).await;
        // A header announcing 1 GiB, with no payload behind it: the receiver must refuse at
        // once instead of waiting for (or allocating) the payload.
        let mut head = data_frame(1, &[0u8; 4]).encode();
        head[24..28].copy_from_slice(&(1u32 << 30).to_le_bytes());
        raw.write_all(&head).await.unwrap();
        let mut buf = Vec::new();
        let r = tokio::time::timeout(Duration::from_secs(2), server.rx.recv(&mut buf))
            .await
            .expect("refused without waiting for the payload");
        assert!(
            matches!(
                r,
                Err(TransportError::Protocol(ProtocolError::TooLarge { len, max, .. }))
                    if len == 1 << 30 && max == 1 << 20
            ),
            "{r:?}"
        );
        assert!(buf.capacity() < 1 << 20);
    })
    .await;
}

#[tokio::test]
async fn receiver_cap_applies_to_data_frames_sent_by_a_real_sender() {
    within(async {
        let (mut client, mut server) = link_pair(&key("k"), 1024).await;
        let mut buf = Vec::new();
        let small = pattern(1024, 1);
        client
            .tx
            .send(&data_frame(1, &small), &small)
            .await
            .unwrap();
        assert_eq!(server.rx.recv(&mut buf).await.unwrap().len, 1024);
        let big = pattern(1025, 2);
        client.tx.send(&data_frame(2, &big), &big).await.unwrap();
        let r = server.rx.recv(&mut buf).await;
        assert!(
            matches!(
                r,
                Err(TransportError::Protocol(ProtocolError::TooLarge { .. }))
            ),
            "{r:?}"
        );
    })
    .await;
}

#[tokio::test]
async fn server_reject_is_readable_by_a_raw_client() {
    within(async {
        // A client of another cluster, speaking the handshake by hand, is told why it is
        // refused before the server closes.
        let (l, addr) = bind();
        let server = tokio::spawn(async move {
            accept_one(&l, &key("server key"), HS_TIMEOUT, DEFAULT_MAX_PAYLOAD).await
        });
        let mut raw = TcpStream::connect(addr).await.unwrap();
        let (_, hello) = ringllm_protocol::handshake::ClientHandshake::start(
            &key("client key"),
            Role::Coordinator,
            "stranger",
        )
        .unwrap();
        raw.write_all(&hello).await.unwrap();
        let mut answer = Vec::new();
        raw.read_to_end(&mut answer).await.unwrap();
        match HsMsg::decode(&answer).unwrap() {
            HsMsg::Reject(r) => assert!(r.contains("cluster"), "{r}"),
            other => panic!("expected a reject, got {other:?}"),
        }
        assert!(matches!(
            server.await.unwrap(),
            Err(TransportError::Protocol(ProtocolError::Auth(_)))
        ));
    })
    .await;
}
