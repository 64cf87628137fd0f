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
        ServerStep::Continue(hs, out) => (*hs, out),
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

/// Feeds the server's first answer (hello, `Ident` when both speak node identities, proof)
/// to the client; returns what the client sends back.
fn client_feed(client: &mut ClientHandshake, out: &[u8]) -> Result<Vec<u8>, ProtocolError> {
    let msgs = split_msgs(out);
    client.on_hello(&msgs[0])?;
    let mut at = 1;
    if client.expects_ident() {
        client.on_ident(&msgs[at])?;
        at += 1;
    }
    assert_eq!(msgs.len(), at + 1, "server hello, ident and proof");
    client.on_proof(&msgs[at])
}

/// Feeds the client's answer (`Ident` when expected, proof) to the server.
#[allow(clippy::result_large_err)]
fn server_feed(
    mut server: ServerHandshake,
    out: &[u8],
) -> Result<(Session, Vec<u8>), (Vec<u8>, ProtocolError)> {
    let msgs = split_msgs(out);
    let mut at = 0;
    if server.expects_ident() {
        server.on_ident(&msgs[0])?;
        at = 1;
    }
    server.on_proof(&msgs[at])
}

fn run_ok(client_key: &ClusterKey, server_key: &ClusterKey, role: Role) -> Transcript {
    let (mut client, client_hello) = ClientHandshake::start(client_key, role, "coord").unwrap();
    let (server, out) =
        expect_continue(ServerHandshake::on_hello(server_key, "node-a", &client_hello).unwrap());
    assert_eq!(split_msgs(&out).len(), 3, "server hello, ident and proof");
    let client_proof = client_feed(&mut client, &out).unwrap();
    let (server_session, accept) = server_feed(server, &client_proof)
        .map_err(|(_, e)| e)
        .unwrap();
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
    let proof = client_feed(&mut client, &out).unwrap();
    let (ss, accept) = server_feed(server, &proof).map_err(|(_, e)| e).unwrap();
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
    match server_feed(server, &t.client_proof) {
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
    let (mut client, _) = ClientHandshake::start(&k, Role::Coordinator, "c").unwrap();
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
    client_feed(&mut client, &out).unwrap();
    let r = client.on_verdict(&HsMsg::Reject("full".into()).encode());
    assert!(matches!(r, Err(ProtocolError::Rejected(m)) if m == "full"));
}

// ---- Node identities (protocol minor 2) ----

use ringllm_protocol::handshake::{Ident, CAP_IDENT, MAX_IDENT_BODY};
use ringllm_protocol::ident::{NodeCert, NodeIdentity, Revocations};

fn with_id(k: &ClusterKey, name: &str) -> ClusterKey {
    k.clone()
        .with_identity(NodeIdentity::generate(k, name).unwrap())
}

fn revoking(k: &ClusterKey, names: &[&str]) -> ClusterKey {
    // A fresh list: `from_bytes` gives every key its own.
    let k2 = ClusterKey::from_bytes(b"the cluster").unwrap();
    assert_eq!(k2.id(), k.id());
    let mut r = Revocations::default();
    for n in names {
        r.insert(n).unwrap();
    }
    k2.add_revoked(&r).unwrap();
    k2
}

/// Runs a whole handshake; `Err` holds the error each side saw (client, server).
fn run(
    client_key: &ClusterKey,
    role: Role,
    client_name: &str,
    server_key: &ClusterKey,
) -> Result<(Session, Session), (String, String)> {
    let (mut client, hello) = ClientHandshake::start(client_key, role, client_name).unwrap();
    let (server, out) = match ServerHandshake::on_hello(server_key, "srv", &hello).unwrap() {
        ServerStep::Continue(s, out) => (*s, out),
        ServerStep::Refuse(out, e) => {
            let c = client.on_hello(&out).unwrap_err();
            return Err((c.to_string(), e.to_string()));
        }
    };
    let mine = match client_feed(&mut client, &out) {
        Ok(m) => m,
        Err(e) => {
            // The client's reject reaches the server where it waits for the client's ident.
            let reject = HsMsg::Reject(e.to_string()).encode();
            let s = server_feed(server, &reject).map(|_| ()).unwrap_err().1;
            return Err((e.to_string(), s.to_string()));
        }
    };
    match server_feed(server, &mine) {
        Ok((ss, accept)) => Ok((client.on_verdict(&accept).unwrap(), ss)),
        Err((reject, e)) => {
            let c = client.on_verdict(&reject).unwrap_err();
            Err((c.to_string(), e.to_string()))
        }
    }
}

fn cluster() -> ClusterKey {
    key("the cluster")
}

#[test]
fn nodes_with_node_keys_learn_each_others_certified_names() {
    let k = cluster();
    let (a, b) = (with_id(&k, "node-a"), with_id(&k, "node-b"));
    let (cs, ss) = run(&a, Role::Upstream, "ignored", &b).unwrap();
    assert_eq!(cs.peer.name, "node-b");
    assert_eq!(cs.peer_cert.as_ref().unwrap().name, "node-b");
    assert_eq!(ss.peer.name, "node-a", "a node key sets the hello name");
    assert_eq!(ss.peer_cert.as_ref().unwrap().name, "node-a");
    assert_eq!(cs.session_key, ss.session_key);
    assert_ne!(cs.peer.caps & CAP_IDENT, 0);
    // A coordinator without a node key, and a plain shared-key pair, still get in.
    let (cs, ss) = run(&k, Role::Coordinator, "coordinator", &a).unwrap();
    assert!(ss.peer_cert.is_none() && cs.peer_cert.is_some());
    let (cs, ss) = run(&k, Role::Coordinator, "coordinator", &k).unwrap();
    assert!(ss.peer_cert.is_none() && cs.peer_cert.is_none());
}

#[test]
fn a_revoked_node_is_refused_by_name_on_both_sides() {
    let k = cluster();
    let bad = with_id(&k, "bad-node");
    // The coordinator holds the list and refuses the node it connects to.
    let coord = revoking(&k, &["bad-node"]);
    let (c, s) = run(&coord, Role::Coordinator, "coordinator", &bad).unwrap_err();
    assert!(c.contains("\"bad-node\" is revoked"), "{c}");
    assert!(s.contains("\"bad-node\" is revoked"), "{s}");
    // A node that holds the list refuses the revoked node connecting to it.
    let good =
        revoking(&k, &["bad-node"]).with_identity(NodeIdentity::generate(&k, "good").unwrap());
    let (c, s) = run(&bad, Role::Upstream, "x", &good).unwrap_err();
    assert!(
        c.contains("refused") && c.contains("\"bad-node\" is revoked"),
        "{c}"
    );
    assert!(s.contains("\"bad-node\" is revoked"), "{s}");
    // The name alone is refused too (the machine kept the cluster key, not its node key).
    let (_, s) = run(&k, Role::Upstream, "bad-node", &good).unwrap_err();
    assert!(s.contains("is revoked"), "{s}");
}

#[test]
fn a_node_adopts_the_revocation_list_of_a_coordinator_only() {
    let k = cluster();
    let node = with_id(&k, "good");
    let bad = with_id(&k, "bad-node");
    run(&bad, Role::Upstream, "x", &node).unwrap();
    // A monitor's list (or any non-coordinator's) would not be sent; the coordinator's is.
    let coord = revoking(&k, &["bad-node"]);
    run(&coord, Role::Monitor, "status", &node).unwrap();
    assert!(!node.is_revoked("bad-node"));
    run(&coord, Role::Coordinator, "coordinator", &node).unwrap();
    assert!(node.is_revoked("bad-node"));
    let (_, s) = run(&bad, Role::Upstream, "x", &node).unwrap_err();
    assert!(s.contains("\"bad-node\" is revoked"), "{s}");
}

/// A client whose `Ident` is replaced with `ident` (its proof recomputed with the cluster
/// key, as any key holder could): the server's verdict.
fn server_verdict_on(ident: Ident, name: &str) -> String {
    let k = cluster();
    let server = with_id(&k, "srv");
    let (mut client, hello) = ClientHandshake::start(&k, Role::Upstream, name).unwrap();
    let (server, out) = expect_continue(ServerHandshake::on_hello(&server, "srv", &hello).unwrap());
    client_feed(&mut client, &out).unwrap();
    let msgs = split_msgs(&out);
    let ident = HsMsg::Ident(Box::new(ident)).encode();
    let proof = k.mac(&[
        b"ringllm client proof v1\0",
        &hello,
        &msgs[0],
        &msgs[1],
        &ident,
    ]);
    let mut mine = ident;
    mine.extend_from_slice(&HsMsg::Proof(proof).encode());
    match server_feed(server, &mine) {
        Ok(_) => "accepted".into(),
        Err((reject, e)) => {
            assert_eq!(reject_text(&reject), e.to_string());
            e.to_string()
        }
    }
}

#[test]
fn forged_renamed_and_copied_certificates_are_refused() {
    let k = cluster();
    let real = NodeIdentity::generate(&k, "node-a").unwrap();
    let sig = [7u8; 64];
    // Renamed: the cluster's signature no longer matches.
    let mut renamed = real.cert.clone();
    renamed.name = "node-z".into();
    let e = server_verdict_on(
        Ident {
            cert: Some((renamed, sig)),
            revoked: None,
        },
        "node-z",
    );
    assert!(e.contains("not signed by this cluster's key"), "{e}");
    // Signed by another cluster's key.
    let other = NodeIdentity::generate(&key("another"), "node-a").unwrap();
    let e = server_verdict_on(
        Ident {
            cert: Some((other.cert.clone(), sig)),
            revoked: None,
        },
        "node-a",
    );
    assert!(e.contains("issued for cluster"), "{e}");
    // A real certificate, but the hello names someone else.
    let e = server_verdict_on(
        Ident {
            cert: Some((real.cert.clone(), sig)),
            revoked: None,
        },
        "node-b",
    );
    assert!(e.contains("calls itself \"node-b\""), "{e}");
    // A real certificate without its node key (a bad transcript signature).
    let e = server_verdict_on(
        Ident {
            cert: Some((real.cert.clone(), sig)),
            revoked: None,
        },
        "node-a",
    );
    assert!(e.contains("not a signature by its node key"), "{e}");
    // A signature of another handshake is refused too.
    let replayed = real.sign(b"another handshake");
    let e = server_verdict_on(
        Ident {
            cert: Some((real.cert.clone(), replayed)),
            revoked: None,
        },
        "node-a",
    );
    assert!(e.contains("not a signature by its node key"), "{e}");
}

#[test]
fn an_old_peer_is_told_to_upgrade_where_node_keys_are_used_and_served_where_not() {
    let k = cluster();
    let old_hello = |role| {
        HsMsg::Hello(Hello {
            major: PROTOCOL_MAJOR,
            minor: 1,
            caps: CAP_TCP,
            role,
            cluster_id: k.id(),
            nonce: [1; 32],
            name: "old".into(),
        })
        .encode()
    };
    // A node with a node key refuses an old client with a reject it can print.
    let node = with_id(&k, "node-a");
    let (out, e) = expect_refuse(
        ServerHandshake::on_hello(&node, "n", &old_hello(Role::Coordinator)).unwrap(),
    );
    assert!(e.to_string().contains("without node identities"), "{e}");
    assert!(reject_text(&out).contains("run the same ringllm release"));
    // A shared-key node serves it as before: no ident message, the old proofs.
    let (_, out) =
        expect_continue(ServerHandshake::on_hello(&k, "n", &old_hello(Role::Coordinator)).unwrap());
    assert_eq!(split_msgs(&out).len(), 2);
    // A coordinator with a revocation list refuses an old node's hello.
    let coord = revoking(&k, &["x"]);
    let (mut client, _) = ClientHandshake::start(&coord, Role::Coordinator, "c").unwrap();
    let e = client.on_hello(&old_hello(Role::Node)).unwrap_err();
    assert!(e.to_string().contains("without node identities"), "{e}");
}

#[test]
fn malformed_ident_messages_are_refused_before_allocating() {
    // A header announcing more than an ident may hold is refused from the header alone.
    let mut head = *b"RLHS\x05\x00\x00";
    head[5..7].copy_from_slice(&((MAX_IDENT_BODY + 1) as u16).to_le_bytes());
    assert!(matches!(
        HsMsg::decode_header(&head),
        Err(ProtocolError::TooLarge { .. })
    ));
    // Other types keep the small cap.
    let mut hello = *b"RLHS\x01\x00\x00";
    hello[5..7].copy_from_slice(&1025u16.to_le_bytes());
    assert!(HsMsg::decode_header(&hello).is_err());
    let k = cluster();
    let id = NodeIdentity::generate(&k, "n").unwrap();
    let mut r = Revocations::default();
    r.insert("gone").unwrap();
    let full = HsMsg::Ident(Box::new(Ident {
        cert: Some((id.cert.clone(), [3; 64])),
        revoked: Some(r),
    }))
    .encode();
    assert!(matches!(HsMsg::decode(&full), Ok(HsMsg::Ident(_))));
    // Every truncation (header length fixed up) is an error, never a panic.
    for cut in MSG_HEADER_LEN..full.len() {
        let mut b = full[..cut].to_vec();
        let len = (cut - MSG_HEADER_LEN) as u16;
        b[5..7].copy_from_slice(&len.to_le_bytes());
        assert!(HsMsg::decode(&b).is_err(), "cut at {cut}");
    }
    // Unknown flags, and trailing bytes.
    for body in [vec![4u8], vec![0u8, 0]] {
        let mut b = b"RLHS\x05".to_vec();
        b.extend_from_slice(&(body.len() as u16).to_le_bytes());
        b.extend_from_slice(&body);
        assert!(HsMsg::decode(&b).is_err(), "{body:?}");
    }
    // A certificate length byte past the body.
    let mut bad = full.clone();
    bad[MSG_HEADER_LEN + 1] = 255;
    assert!(HsMsg::decode(&bad).is_err());
    let _ = NodeCert::decode(&id.cert.encode()).unwrap();
}
