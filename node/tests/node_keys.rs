//! Node keys against the daemon in process, over real sockets: a node with a node key serves
//! peers with valid ones, adopts its coordinator's revocation list and then refuses the
//! revoked name on a data link, refuses a forged certificate, and keeps serving throughout.

use ringllm_node::daemon;
use ringllm_node::test_util::{options, TestNode, GUARD};
use ringllm_protocol::control_conn;
use ringllm_protocol::ident::{NodeIdentity, Revocations};
use ringllm_protocol::key::hex;
use ringllm_protocol::{ClusterKey, Link, Role, TransportError};
use std::net::SocketAddr;
use std::path::PathBuf;

const KEY: &str = "node-keys-test-cluster-key";

fn key() -> ClusterKey {
    ClusterKey::from_bytes(KEY.as_bytes()).expect("a non-empty key")
}

fn keyed(name: &str) -> ClusterKey {
    let k = key();
    let id = NodeIdentity::generate(&k, name).expect("a node key");
    k.with_identity(id)
}

fn models_dir(test: &str) -> PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("node-keys-{test}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the models directory");
    dir
}

async fn dial(addr: SocketAddr, k: &ClusterKey, role: Role) -> Result<Link, TransportError> {
    control_conn::connect(
        &addr.to_string(),
        k,
        role,
        "peer",
        GUARD,
        daemon::MAX_PAYLOAD,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_adopts_its_coordinators_revocations_and_refuses_the_revoked_peer_by_name() {
    let node = TestNode::start(options("keeper", keyed("keeper"), &models_dir("revoke"))).await;
    // Before any revocation, a peer with a valid node key is let in and learns who we are.
    let link = dial(node.addr, &keyed("upstream-1"), Role::Upstream)
        .await
        .expect("a valid node key is let in");
    assert_eq!(link.session.peer.name, "keeper");
    assert_eq!(
        link.session.peer_cert.as_ref().map(|c| c.name.as_str()),
        Some("keeper")
    );
    drop(link);
    // A coordinator that revokes "upstream-1" connects (and leaves).
    let coord = key();
    let mut list = Revocations::default();
    list.insert("upstream-1").unwrap();
    coord.add_revoked(&list).unwrap();
    drop(
        dial(node.addr, &coord, Role::Coordinator)
            .await
            .expect("coordinator"),
    );
    // Now the revoked node is refused by name, and told so.
    let e = dial(node.addr, &keyed("upstream-1"), Role::Upstream)
        .await
        .err()
        .expect("a revoked node was let in");
    let text = e.to_string();
    assert!(
        text.contains("refused") && text.contains("\"upstream-1\" is revoked"),
        "{text}"
    );
    // Others still get in.
    dial(node.addr, &keyed("upstream-2"), Role::Upstream)
        .await
        .expect("another node is still served");
    node.stop().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_certificate_is_refused_and_the_node_keeps_serving() {
    let node = TestNode::start(options("guard", keyed("guard"), &models_dir("forged"))).await;
    // A valid node key for "intruder", its certificate renamed to "trusted" (the cluster's
    // signature kept): the seed still matches the public key, but the signature no longer
    // holds.
    let real = NodeIdentity::generate(&key(), "intruder").unwrap();
    let mut renamed = real.cert.clone();
    renamed.name = "trusted".into();
    let text = real
        .to_text()
        .replace(&hex(&real.cert.encode()), &hex(&renamed.encode()));
    let forged = NodeIdentity::from_text(&text).expect("well-formed, only unsigned");
    let e = dial(node.addr, &key().with_identity(forged), Role::Upstream)
        .await
        .err()
        .expect("a forged certificate was let in");
    assert!(
        e.to_string().contains("not signed by this cluster's key"),
        "{e}"
    );
    let link = dial(node.addr, &key(), Role::Monitor)
        .await
        .expect("the shared key alone is still let in");
    assert!(link.session.peer_cert.is_some());
    node.stop().await.expect("a clean stop");
}
