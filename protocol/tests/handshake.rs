//! The handshake state machines driven by hand, message by message, with no I/O: success,
//! wrong keys on either side, version mismatch, replay and garbage.

mod common;

use common::key;

use ringllm_protocol::handshake::{
    ClientHandshake, Hello, HsMsg, ServerHandshake, ServerStep, Session, CAP_TCP, MSG_HEADER_LEN,
    PROTOCOL_MAJOR, PROTOCOL_MINOR,
};
use ringllm_protocol::{ClusterKey, ProtocolError, Role};

/// Splits the concatenation of whole handshake messages into its messages.
fn split_msgs(mut b: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let head: [u8; MSG_HEADER_LEN] = b[..MSG_HEADER_LEN].try_into().unwrap();
        let (_, len) = HsMsg::decode_header(&head).unwrap();
        out.push(b[..MSG_HEADER_LEN + len].to_vec());
        b = &b[MSG_HEADER_LEN + len..];
    }
    out
}

fn expect_continue(step: ServerStep) -> (ServerHandshake, Vec<u8>) {
    match step {
        ServerStep::Continue(hs, out) => (hs, out),
        ServerStep::Refuse(_, e) => panic!("server refused: {e}"),
    }
}

fn expect_refuse(step: ServerStep) -> (Vec<u8>, ProtocolError) {
    match step {
        ServerStep::Continue(..) => panic!("server continued"),
        ServerStep::Refuse(out, e) => (out, e),
    }
}

fn reject_text(raw: &[u8]) -> String {
    match HsMsg::decode(raw).unwrap() {
        HsMsg::Reject(r) => r,
        other => panic!("expected a reject, got {other:?}"),
    }
}

/// Everything a client sent in a successful handshake.
struct Transcript {
    client_hello: Vec<u8>,
    client_proof: Vec<u8>,
    client: Session,
    server: Session,
}

fn run_ok(client_key: &ClusterKey, server_key: &ClusterKey, role: Role) -> Transcript {
    let (mut client, client_hello) = ClientHandshake::start(client_key, role, "coord").unwrap();
    let (server, out) =
        expect_continue(ServerHandshake::on_hello(server_key, "node-a", &client_hello).unwrap());
    let msgs = split_msgs(&out);
    assert_eq!(msgs.len(), 2, "server hello and proof");
    client.on_hello(&msgs[0]).unwrap();
    let client_proof = client.on_proof(&msgs[1]).unwrap();
    let (server_session, accept) = server.on_proof(&client_proof).map_err(|(_, e)| e).unwrap();
    assert_eq!(HsMsg::decode(&accept).unwrap(), HsMsg::Accept);
    let client_session = client.on_verdict(&accept).unwrap();
    Transcript {
        client_hello,
        client_proof,
        client: client_session,
        server: server_session,
    }
}

#[test]
fn same_key_succeeds_with_one_session_key() {
    let k = key("correct horse battery staple\n");
    let t = run_ok(&k, &k, Role::Coordinator);
    assert_eq!(t.client.session_key, t.server.session_key);
    assert_ne!(t.client.session_key, [0u8; 32]);

    // Each side learned the other's hello.
    assert_eq!(t.client.peer.name, "node-a");
    assert_eq!(t.client.peer.role, Role::Node);
    assert_eq!(t.server.peer.name, "coord");
    assert_eq!(t.server.peer.role, Role::Coordinator);
    for peer in [&t.client.peer, &t.server.peer] {
        assert_eq!(peer.major, PROTOCOL_MAJOR);
        assert_eq!(peer.minor, PROTOCOL_MINOR);
        assert_eq!(peer.caps & CAP_TCP, CAP_TCP);
        assert_eq!(peer.cluster_id, k.id());
    }
    assert_ne!(t.client.peer.nonce, t.server.peer.nonce);

    // Another run of the same pair gets fresh nonces and so a different session key.
    let t2 = run_ok(&k, &k, Role::Upstream);
    assert_eq!(t2.server.peer.role, Role::Upstream);
    assert_ne!(t2.client.session_key, t.client.session_key);
    assert_ne!(t2.client_hello, t.client_hello);
}

#[test]
fn keys_differing_only_in_trailing_whitespace_agree() {
    run_ok(&key("k3y"), &key("k3y \r\n"), Role::Coordinator);
}

#[test]
fn empty_and_long_names_work() {
    // The shortest hello (empty name) and a name longer than MAX_NAME (truncated on send).
    let k = key("k");
    let (mut client, hello) = ClientHandshake::start(&k, Role::Upstream, "").unwrap();
    let long = "é".repeat(50);
    let (server, out) = expect_continue(ServerHandshake::on_hello(&k, &long, &hello).unwrap());
    let msgs = split_msgs(&out);
    client.on_hello(&msgs[0]).unwrap();
    let proof = client.on_proof(&msgs[1]).unwrap();
    let (ss, accept) = server.on_proof(&proof).map_err(|(_, e)| e).unwrap();
    let cs = client.on_verdict(&accept).unwrap();
    assert_eq!(ss.peer.name, "");
    assert_eq!(cs.peer.name, "é".repeat(32));
    assert_eq!(cs.session_key, ss.session_key);
}

#[test]
fn different_key_is_refused_by_cluster_id() {
    let (_, hello) = ClientHandshake::start(&key("alpha"), Role::Coordinator, "coord").unwrap();
    let server_key = key("beta");
    let (out, e) = expect_refuse(ServerHandshake::on_hello(&server_key, "node-a", &hello).unwrap());
    assert!(matches!(e, ProtocolError::Auth(_)), "{e:?}");
    let text = e.to_string();
    assert!(text.contains(&key("alpha").id_hex()), "{text}");
    assert!(text.contains(&server_key.id_hex()), "{text}");
    // The client is told why, and turns that into a Rejected error.
    let reason = reject_text(&out);
    assert!(reason.contains("node-a"), "{reason}");
    let (mut client, _) = ClientHandshake::start(&key("alpha"), Role::Coordinator, "c").unwrap();
    assert!(matches!(client.on_hello(&out), Err(ProtocolError::Rejected(r)) if r == reason));
}

#[test]
fn client_refuses_a_server_of_another_cluster() {
    // The client's own check on the server's hello.
    let (mut client, _) = ClientHandshake::start(&key("alpha"), Role::Coordinator, "c").unwrap();
    let (_, other_hello) = ClientHandshake::start(&key("beta"), Role::Node, "n").unwrap();
    assert!(matches!(
        client.on_hello(&other_hello),
        Err(ProtocolError::Auth(_))
    ));
}

fn forged_hello(cluster_id: [u8; 8], major: u16, role: Role, name: &str) -> Vec<u8> {
    HsMsg::Hello(Hello {
        major,
        minor: 0,
        caps: CAP_TCP,
        role,
        cluster_id,
        nonce: [0x5a; 32],
        name: name.into(),
    })
    .encode()
}

#[test]
fn client_rejects_a_server_that_does_not_know_the_key() {
    // An impostor server copies the public cluster id but signs with another key.
    let k = key("the real key");
    let impostor = key("a guess");
    let (mut client, client_hello) = ClientHandshake::start(&k, Role::Coordinator, "c").unwrap();
    let server_hello = forged_hello(k.id(), PROTOCOL_MAJOR, Role::Node, "evil");
    client.on_hello(&server_hello).unwrap();
    for proof in [
        impostor.mac(&[b"ringllm server proof v1\0", &client_hello, &server_hello]),
        [0u8; 32],
    ] {
        let r = client.on_proof(&HsMsg::Proof(proof).encode());
        assert!(
            matches!(&r, Err(ProtocolError::Auth(m)) if m.contains("evil")),
            "{r:?}"
        );
    }
    // Where a proof is due, an early accept is not taken for one.
    let r = client.on_proof(&HsMsg::Accept.encode());
    assert!(matches!(r, Err(ProtocolError::Handshake(_))), "{r:?}");
}

#[test]
fn server_rejects_a_client_that_does_not_know_the_key() {
    // The client copies the public cluster id into its hello but does not hold the key.
    let k = key("the real key");
    let impostor = key("a guess");
    let client_hello = forged_hello(k.id(), PROTOCOL_MAJOR, Role::Coordinator, "mallory");
    let (server, out) =
        expect_continue(ServerHandshake::on_hello(&k, "node-a", &client_hello).unwrap());
    let server_hello = &split_msgs(&out)[0];
    let proof = impostor.mac(&[b"ringllm client proof v1\0", &client_hello, server_hello]);
    match server.on_proof(&HsMsg::Proof(proof).encode()) {
        Ok(_) => panic!("the server accepted a proof made with the wrong key"),
        Err((reject, e)) => {
            assert!(
                matches!(&e, ProtocolError::Auth(m) if m.contains("mallory")),
                "{e:?}"
            );
            assert!(reject_text(&reject).contains("authentication failed"));
        }
    }
}

#[test]
fn server_rejects_anything_but_a_proof() {
    let k = key("k");
    for second in [
        HsMsg::Accept.encode(),
        HsMsg::Proof([1; 32]).encode(),
        b"RLHS\x02\x05\x00short".to_vec(),
        b"GET / HTTP/1.1\r\n".to_vec(),
    ] {
        let (_, hello) = ClientHandshake::start(&k, Role::Coordinator, "c").unwrap();
        let (server, _) = expect_continue(ServerHandshake::on_hello(&k, "n", &hello).unwrap());
        match server.on_proof(&second) {
            Ok(_) => panic!("accepted {second:?}"),
            Err((reject, _)) => assert!(!reject_text(&reject).is_empty()),
        }
    }
    // A client's rejection is passed on without an answer.
    let (_, hello) = ClientHandshake::start(&k, Role::Coordinator, "c").unwrap();
    let (server, _) = expect_continue(ServerHandshake::on_hello(&k, "n", &hello).unwrap());
    match server.on_proof(&HsMsg::Reject("no thanks".into()).encode()) {
        Ok(_) => panic!("accepted a reject"),
        Err((reject, e)) => {
            assert!(reject.is_empty());
            assert!(matches!(e, ProtocolError::Rejected(r) if r == "no thanks"));
        }
    }
}

#[test]
fn version_mismatch_is_refused_naming_both_versions() {
    let k = key("k");
    let hello = forged_hello(k.id(), 4, Role::Coordinator, "future");
    let (out, e) = expect_refuse(ServerHandshake::on_hello(&k, "node-a", &hello).unwrap());
    assert!(
        matches!(
            e,
            ProtocolError::Version {
                ours: 3,
                theirs: 4,
                ..
            }
        ),
        "{e:?}"
    );
    let text = e.to_string();
    assert!(
        text.contains("we speak 3") && text.contains("peer speaks 4"),
        "{text}"
    );
    assert!(reject_text(&out).contains("peer speaks 4"));
    // Peers of earlier versions (1: before slices were sent; 2: before stage layouts and
    // rounds) are refused too.
    for old in [1u16, 2] {
        let (_, e) = expect_refuse(
            ServerHandshake::on_hello(
                &k,
                "node-a",
                &forged_hello(k.id(), old, Role::Coordinator, "old"),
            )
            .unwrap(),
        );
        assert!(e.to_string().contains(&format!("peer speaks {old}")), "{e}");
    }

    // The client side applies the same check to the server's hello.
    let (mut client, _) = ClientHandshake::start(&k, Role::Coordinator, "c").unwrap();
    let r = client.on_hello(&forged_hello(k.id(), 0, Role::Node, "old"));
    assert!(
        matches!(
            r,
            Err(ProtocolError::Version {
                ours: 3,
                theirs: 0,
                ..
            })
        ),
        "{r:?}"
    );

    // A different minor version is compatible.
    let mut h = match HsMsg::decode(&forged_hello(
        k.id(),
        PROTOCOL_MAJOR,
        Role::Coordinator,
        "x",
    ))
    .unwrap()
    {
        HsMsg::Hello(h) => h,
        _ => unreachable!(),
    };
    h.minor = 7;
    expect_continue(ServerHandshake::on_hello(&k, "n", &HsMsg::Hello(h).encode()).unwrap());
}

#[test]
fn recorded_handshake_cannot_be_replayed() {
    let k = key("k");
    let t = run_ok(&k, &k, Role::Coordinator);
    // An eavesdropper replays the client's two messages to a fresh server.
    let (server, _) =
        expect_continue(ServerHandshake::on_hello(&k, "node-a", &t.client_hello).unwrap());
    match server.on_proof(&t.client_proof) {
        Ok(_) => panic!("a replayed proof was accepted"),
        Err((reject, e)) => {
            assert!(matches!(e, ProtocolError::Auth(_)), "{e:?}");
            assert!(!reject_text(&reject).is_empty());
        }
    }
}

#[test]
fn garbage_first_message_is_bad_magic() {
    let k = key("k");
    let r = ServerHandshake::on_hello(&k, "n", b"GET / HTTP/1.1\r\n");
    assert!(
        matches!(r, Err(ProtocolError::BadMagic { what: "handshake", found }) if &found == b"GET "),
        "{:?}",
        r.err()
    );
    let (mut client, _) = ClientHandshake::start(&k, Role::Coordinator, "c").unwrap();
    assert!(matches!(
        client.on_hello(b"SSH-2.0-OpenSSH_9.6\r\n"),
        Err(ProtocolError::BadMagic { .. })
    ));
}

#[test]
fn messages_out_of_order_are_refused() {
    let k = key("k");
    // A server receiving a proof first.
    let r = ServerHandshake::on_hello(&k, "n", &HsMsg::Proof([0; 32]).encode());
    assert!(
        matches!(r, Err(ProtocolError::Handshake(_))),
        "{:?}",
        r.err()
    );
    // A client receiving a proof or a verdict before the server's hello.
    let (client, _) = ClientHandshake::start(&k, Role::Coordinator, "c").unwrap();
    assert!(matches!(
        client.on_proof(&HsMsg::Proof([0; 32]).encode()),
        Err(ProtocolError::Handshake(_))
    ));
    assert!(matches!(
        client.on_verdict(&HsMsg::Accept.encode()),
        Err(ProtocolError::Handshake(_))
    ));
    // A client receiving a proof where the hello is due.
    let (mut client, _) = ClientHandshake::start(&k, Role::Coordinator, "c").unwrap();
    assert!(matches!(
        client.on_hello(&HsMsg::Proof([0; 32]).encode()),
        Err(ProtocolError::Handshake(_))
    ));
}

#[test]
fn final_reject_reaches_the_client() {
    let k = key("k");
    let (mut client, hello) = ClientHandshake::start(&k, Role::Coordinator, "c").unwrap();
    let (_, out) = expect_continue(ServerHandshake::on_hello(&k, "n", &hello).unwrap());
    let msgs = split_msgs(&out);
    client.on_hello(&msgs[0]).unwrap();
    client.on_proof(&msgs[1]).unwrap();
    let r = client.on_verdict(&HsMsg::Reject("full".into()).encode());
    assert!(matches!(r, Err(ProtocolError::Rejected(m)) if m == "full"));
}
