//! The node daemon in process: nodes on `127.0.0.1:0`, driven over real sockets by the
//! protocol crate's clients, stopped through their shutdown future. Timeouts here only keep a
//! broken daemon from hanging the test run; no assertion depends on timing.

use ringllm_kernels::GgmlType;
use ringllm_model::gguf::GgufFile;
use ringllm_model::synth::{synth_model, SynthArch, SynthSpec};
use ringllm_model::{KvType, LoadOptions, Model, Runner};
use ringllm_node::daemon::{self, NodeOptions};
use ringllm_node::test_util::{options, TestNode, GUARD};
use ringllm_protocol::control::{Assignment, Capabilities, Input, NextHop, StageLayout};
use ringllm_protocol::control_conn::{self, control_of};
use ringllm_protocol::dial::{self, BoxLink, DialSpec, LinkRole};
use ringllm_protocol::{
    ClusterKey, Control, Dtype, FrameHeader, FrameKind, Link, Role, TransportError, TransportKind,
};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const KEY: &str = "daemon-test-cluster-key-0123456789abcdef";

fn key(text: &str) -> ClusterKey {
    ClusterKey::from_bytes(text.as_bytes()).expect("a non-empty key")
}

/// A fresh, empty directory for one test's models.
fn models_dir(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("daemon-{test}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the models directory");
    dir
}

async fn connect(addr: SocketAddr, key: &ClusterKey) -> Result<Link, TransportError> {
    control_conn::connect(
        &addr.to_string(),
        key,
        Role::Coordinator,
        "test-coordinator",
        GUARD,
        daemon::MAX_PAYLOAD,
    )
    .await
}

async fn recv_control(link: &mut Link) -> Result<Control, TransportError> {
    let mut buf = Vec::new();
    let h = tokio::time::timeout(GUARD, link.rx.recv(&mut buf))
        .await
        .expect("no message from the node")?;
    Ok(control_of(&h, &buf)?)
}

async fn capabilities(link: &mut Link) -> Capabilities {
    match recv_control(link).await.expect("a message") {
        Control::Capabilities(c) => c,
        other => panic!("expected capabilities first, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_starts_serves_and_stops_cleanly() {
    let node = TestNode::start(options("solo", key(KEY), &models_dir("solo"))).await;
    let addr = node.addr;
    let mut link = connect(addr, &key(KEY)).await.expect("connect");
    let caps = capabilities(&mut link).await;
    assert_eq!(caps.node_name, "solo");
    assert_eq!(caps.transport, TransportKind::Tcp);
    assert!(caps.models.is_empty(), "{:?}", caps.models);
    drop(link);
    node.stop().await.expect("a clean stop");
    // The listener went with the daemon: nothing accepts on its port any more.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_serve_side_by_side_in_one_process() {
    let dir = models_dir("pair");
    let a = TestNode::start(options("left", key(KEY), &dir)).await;
    let b = TestNode::start(options("right", key(KEY), &dir)).await;
    assert_ne!(a.addr, b.addr);
    let mut la = connect(a.addr, &key(KEY)).await.expect("connect to left");
    let mut lb = connect(b.addr, &key(KEY)).await.expect("connect to right");
    assert_eq!(capabilities(&mut lb).await.node_name, "right");
    assert_eq!(capabilities(&mut la).await.node_name, "left");
    // Stopping one leaves the other serving.
    drop(la);
    a.stop().await.expect("left stops");
    let ping = Control::Heartbeat {
        nonce: 41,
        reply: false,
    };
    control_conn::send_control(lb.tx.as_mut(), &ping)
        .await
        .expect("send");
    match recv_control(&mut lb).await.expect("an answer") {
        Control::Heartbeat { nonce, reply } => assert!(reply && nonce == 41),
        other => panic!("expected a heartbeat reply, got {other:?}"),
    }
    drop(lb);
    b.stop().await.expect("right stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_cluster_key_is_refused_and_the_node_keeps_serving() {
    let node = TestNode::start(options("guarded", key(KEY), &models_dir("guarded"))).await;
    for _ in 0..2 {
        match connect(node.addr, &key("some-other-cluster-key")).await {
            Ok(_) => panic!("a client with another cluster key was let in"),
            Err(TransportError::Timeout(..)) => panic!("the node did not answer the handshake"),
            Err(_) => {}
        }
    }
    let mut link = connect(node.addr, &key(KEY))
        .await
        .expect("the right key is still let in");
    assert_eq!(capabilities(&mut link).await.node_name, "guarded");
    drop(link);
    node.stop().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_a_coordinator_connected_tells_it_and_returns() {
    let node = TestNode::start(options("busy", key(KEY), &models_dir("busy"))).await;
    let mut link = connect(node.addr, &key(KEY)).await.expect("connect");
    capabilities(&mut link).await;
    // The connection stays open while the node stops.
    node.stop().await.expect("a clean stop");
    match recv_control(&mut link).await.expect("a shutdown notice") {
        Control::Shutdown { reason } => assert!(reason.contains("'busy'"), "{reason}"),
        other => panic!("expected a shutdown notice, got {other:?}"),
    }
    let mut buf = Vec::new();
    let end = tokio::time::timeout(GUARD, link.rx.recv(&mut buf))
        .await
        .expect("the connection stays open after shutdown");
    assert!(end.is_err(), "a frame after the shutdown notice: {end:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_while_a_data_link_waits_for_its_attach_returns() {
    let node = TestNode::start(options("waiting", key(KEY), &models_dir("waiting"))).await;
    // Authenticated as a data link, then silent: the node waits for its `Attach`.
    let link = control_conn::connect(
        &node.addr.to_string(),
        &key(KEY),
        Role::Upstream,
        "silent-upstream",
        GUARD,
        daemon::MAX_PAYLOAD,
    )
    .await
    .expect("connect");
    node.stop().await.expect("a clean stop");
    drop(link);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_over_tcp_runs_a_frame_and_shutdown_ends_it() {
    session_round_trip(TransportKind::Tcp).await;
}

/// The UDP data link binds the UDP port of the listener's number (here one the OS chose).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_over_udp_runs_a_frame_and_shutdown_ends_it() {
    session_round_trip(TransportKind::Udp).await;
}

/// The QUIC endpoint is bound by `Listener::new` on the UDP port of the listener's number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_over_quic_runs_a_frame_and_shutdown_ends_it() {
    session_round_trip(TransportKind::Quic).await;
}

/// A one-node ring over a synthetic model: assignment, a data link over `transport`, a frame
/// through every layer and the head, logits equal to an in-process run; then shutdown with
/// the session live ends the session's data link and joins its compute thread.
async fn session_round_trip(transport: TransportKind) {
    let dir = models_dir(&format!("session-{transport}"));
    let bytes = synth_model(&SynthSpec::new(SynthArch::Llama, GgmlType::F32, 7)).expect("synth");
    let path = dir.join("synth-llama.gguf");
    std::fs::write(&path, &bytes).expect("write the model");
    let identity =
        ringllm_model::slice::model_identity(&path, &GgufFile::open_lean(&path).expect("open"));
    let model = Arc::new(
        Model::load(
            Arc::new(GgufFile::from_bytes(bytes).expect("read back")),
            &LoadOptions::default(),
        )
        .expect("load"),
    );
    let (d, vocab, n_layer) = (model.hp.d_model, model.hp.vocab, model.hp.n_layer);
    let (ctx, max_batch) = (32, 4);

    let node = TestNode::start(NodeOptions {
        transport,
        ..options("stage", key(KEY), &dir)
    })
    .await;
    let mut control = connect(node.addr, &key(KEY)).await.expect("connect");
    let caps = capabilities(&mut control).await;
    assert_eq!(caps.models, vec![identity.clone()]);
    assert_eq!(caps.transport, transport);
    let assign = Control::Assign(Assignment {
        session: 7,
        model: identity,
        layer_start: 0,
        layer_end: n_layer as u32,
        head: true,
        input: Input::Coordinator,
        next_hop: NextHop::Coordinator,
        activations: Dtype::F32,
        kv_ctx: ctx as u32,
        kv_type: KvType::F32,
        max_batch: max_batch as u32,
        threads: 1,
        kv_slots: 1,
        layout: Default::default(),
    });
    control_conn::send_control(control.tx.as_mut(), &assign)
        .await
        .expect("send the assignment");
    match recv_control(&mut control).await.expect("an answer") {
        Control::Ready(r) => assert_eq!((r.session, r.layer_end), (7, n_layer as u32)),
        other => panic!("expected ready, got {other:?}"),
    }
    let mut data = open_data_link(transport, node.addr, 7).await;

    // The same token through the same layers in this process.
    let mut runner = Runner::new(Arc::clone(&model), 1, max_batch, ctx);
    let mut cache = runner.new_cache(ctx, KvType::F32);
    let mut x = vec![0f32; d];
    runner.embed(&[3], &mut x).expect("embed");
    let payload: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    runner.layers(&mut x, 1, &mut cache, None).expect("layers");
    runner.final_norm(&mut x, 1).expect("norm");
    let mut want = vec![0f32; vocab];
    runner.logits(&x, 1, &mut want).expect("logits");

    let h = FrameHeader::new(FrameKind::Hidden, Dtype::F32, 0, 0, 1, 0, &payload).expect("header");
    let (got_h, got, data_back) = tokio::task::spawn_blocking(move || {
        data.send(&h, &payload).expect("send a frame");
        let mut buf = Vec::new();
        let got_h = data
            .recv_timeout(&mut buf, GUARD)
            .expect("receive")
            .expect("no answer from the node");
        (got_h, buf, data)
    })
    .await
    .expect("join");
    data = data_back;
    assert_eq!(got_h.kind, FrameKind::Logits);
    assert_eq!((got_h.seq, got_h.n_tokens), (0, 1));
    assert_eq!(got.len(), vocab * 2);
    let got: Vec<u16> = got
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    let want: Vec<u16> = want
        .iter()
        .map(|v| half::f16::from_f32(*v).to_bits())
        .collect();
    assert_eq!(got, want, "logits differ from the in-process run");

    node.stop().await.expect("a clean stop");
    // The session ended with the daemon: its data link is closed.
    let end = tokio::task::spawn_blocking(move || {
        let mut buf = Vec::new();
        data.recv_timeout(&mut buf, GUARD)
    })
    .await
    .expect("join");
    assert!(end.is_err(), "the data link outlived the daemon: {end:?}");
}

/// The coordinator's side of a data link of `kind` into and out of session `session`.
async fn open_data_link(kind: TransportKind, addr: SocketAddr, session: u64) -> BoxLink {
    let addr = addr.to_string();
    let spec = DialSpec {
        kind,
        addr: &addr,
        name: "test-coordinator",
        timeout: GUARD,
        max_payload: daemon::MAX_PAYLOAD,
        ring_session: session,
        role: LinkRole::InputOutput,
    };
    dial::connect_data_link(&spec, &key(KEY))
        .await
        .expect("open the data link")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_assignments_are_refused_and_the_node_keeps_serving() {
    let dir = models_dir("oversized");
    let bytes = synth_model(&SynthSpec::new(SynthArch::Llama, GgmlType::F32, 7)).expect("synth");
    let path = dir.join("synth-llama.gguf");
    std::fs::write(&path, &bytes).expect("write the model");
    let identity =
        ringllm_model::slice::model_identity(&path, &GgufFile::open_lean(&path).expect("open"));
    let n_layer = GgufFile::from_bytes(bytes)
        .map(|f| Model::load(Arc::new(f), &LoadOptions::default()).expect("load"))
        .expect("read back")
        .hp
        .n_layer as u32;
    let node = TestNode::start(options("stage", key(KEY), &dir)).await;
    let mut control = connect(node.addr, &key(KEY)).await.expect("connect");
    capabilities(&mut control).await;
    let base = Assignment {
        session: 1,
        model: identity,
        layer_start: 0,
        layer_end: n_layer,
        head: true,
        input: Input::Coordinator,
        next_hop: NextHop::Coordinator,
        activations: Dtype::F32,
        kv_ctx: 32,
        kv_type: KvType::F32,
        max_batch: 4,
        threads: 1,
        kv_slots: 1,
        layout: Default::default(),
    };
    // Each once aborted the node in the allocator (a 4-billion-thread pool, 614 GB of scratch).
    let cases = [
        (
            Assignment {
                threads: u32::MAX,
                ..base.clone()
            },
            "threads 4294967295 is more than ringllm accepts",
        ),
        (
            Assignment {
                max_batch: 100_000_000,
                ..base.clone()
            },
            "batch size 100000000 is more than ringllm accepts",
        ),
        (
            Assignment {
                kv_ctx: u32::MAX,
                ..base.clone()
            },
            "context size 4294967295 is more than ringllm accepts",
        ),
        (
            Assignment {
                kv_ctx: 2_000_000,
                kv_slots: 4000,
                ..base.clone()
            },
            "but only",
        ),
        (
            Assignment {
                layout: StageLayout {
                    windows: vec![(0, 2), (1, n_layer)],
                    ..Default::default()
                },
                ..base.clone()
            },
            "window 1..",
        ),
        (
            Assignment {
                layout: StageLayout {
                    windows: vec![(0, 1), (2, n_layer - 1)],
                    ..Default::default()
                },
                ..base.clone()
            },
            "do not span layers",
        ),
        (
            Assignment {
                layer_start: 0,
                layer_end: 2,
                head: false,
                layout: StageLayout {
                    streamed: vec![5],
                    ..Default::default()
                },
                ..base.clone()
            },
            "streamed layer 5 is not one of the stage's",
        ),
    ];
    for (session, (a, needle)) in (2u64..).zip(cases) {
        let a = Assignment { session, ..a };
        control_conn::send_control(control.tx.as_mut(), &Control::Assign(a))
            .await
            .expect("send the assignment");
        match recv_control(&mut control).await.expect("an answer") {
            Control::Error(e) => assert!(e.message.contains(needle), "{}", e.message),
            other => panic!("expected an error for {needle:?}, got {other:?}"),
        }
    }
    // Still serving, on the same connection.
    control_conn::send_control(control.tx.as_mut(), &Control::Assign(base))
        .await
        .expect("send the assignment");
    match recv_control(&mut control).await.expect("an answer") {
        Control::Ready(r) => assert_eq!(r.session, 1),
        other => panic!("expected ready, got {other:?}"),
    }
    drop(control);
    node.stop().await.expect("clean stop");
}

async fn monitor(addr: SocketAddr, key: &ClusterKey) -> Result<Link, TransportError> {
    control_conn::connect(
        &addr.to_string(),
        key,
        Role::Monitor,
        "test-status",
        GUARD,
        daemon::MAX_PAYLOAD,
    )
    .await
}

async fn ask_status(link: &mut Link) -> ringllm_protocol::control::NodeStatus {
    control_conn::send_control(link.tx.as_mut(), &Control::GetStatus)
        .await
        .expect("send get-status");
    match recv_control(link).await.expect("an answer") {
        Control::Status(s) => *s,
        other => panic!("expected a status, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_queries_are_answered_beside_the_coordinator_without_claiming_the_node() {
    let node = TestNode::start(options("watched", key(KEY), &models_dir("watched"))).await;
    // Before any coordinator: idle, and the same capabilities a coordinator would get.
    let mut m = monitor(node.addr, &key(KEY))
        .await
        .expect("monitor connects");
    let s = ask_status(&mut m).await;
    assert_eq!(s.node_name, "watched");
    assert_eq!(s.listen, node.addr.to_string());
    assert!(s.coordinator.is_none() && s.stage.is_none(), "{s:?}");
    // A coordinator takes the node; status queries go on, on the same and on new connections,
    // and name it.
    let mut coord = connect(node.addr, &key(KEY)).await.expect("connect");
    let caps = capabilities(&mut coord).await;
    assert_eq!(caps.matvec_bytes_per_s, s.matvec_bytes_per_s);
    assert_eq!(caps.memory_available, s.memory_budget);
    for _ in 0..3 {
        let s = ask_status(&mut m).await;
        let h = s.coordinator.expect("the coordinator is named");
        assert_eq!(h.name, "test-coordinator");
    }
    let mut m2 = monitor(node.addr, &key(KEY))
        .await
        .expect("a second monitor");
    assert!(ask_status(&mut m2).await.coordinator.is_some());
    // A monitor cannot act as a coordinator: anything but get-status is refused and closes it.
    control_conn::send_control(m2.tx.as_mut(), &Control::Shutdown { reason: "x".into() })
        .await
        .expect("send");
    assert!(matches!(recv_control(&mut m2).await, Ok(Control::Error(_))));
    // A wrong key gets no status.
    assert!(monitor(node.addr, &key("another key")).await.is_err());
    // The coordinator still holds the node and it still answers it.
    control_conn::send_control(
        coord.tx.as_mut(),
        &Control::Heartbeat {
            nonce: 7,
            reply: false,
        },
    )
    .await
    .expect("heartbeat");
    assert_eq!(
        recv_control(&mut coord).await.expect("a reply"),
        Control::Heartbeat {
            nonce: 7,
            reply: true
        }
    );
    assert!(ask_status(&mut m).await.coordinator.is_some());
    // Once the coordinator leaves, the node is idle again.
    drop(coord);
    let deadline = std::time::Instant::now() + GUARD;
    while ask_status(&mut m).await.coordinator.is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "the slot was never freed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(m);
    node.stop().await.expect("a clean stop");
}
