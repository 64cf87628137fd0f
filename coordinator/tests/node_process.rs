//! Real `ringllm node` processes (the binary this crate builds), driven over real sockets by
//! the protocol crate's client: what a key holder can send a node process must be answered
//! with an error naming it, never a panic or an abort, and the process serves on. Also two
//! node processes sharing one slice cache, and a key holder that goes silent before its
//! assignment. Waits here are hang guards; no assertion depends on how long anything takes.

use ringllm_kernels::GgmlType;
use ringllm_model::gguf::GgufFile;
use ringllm_model::slice::{model_identity, SliceSource};
use ringllm_model::synth::{synth_model, SynthArch, SynthSpec};
use ringllm_model::KvType;
use ringllm_protocol::control::{
    Assignment, ErrorCode, Input, ModelIdentity, NextHop, SliceOffer, StageLayout,
};
use ringllm_protocol::control_conn::{self, control_of};
use ringllm_protocol::{
    ClusterKey, Control, Dtype, FrameHeader, FrameKind, Link, Role, TransportError,
};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Hang guard for every wait (far beyond what any step takes).
const GUARD: Duration = Duration::from_secs(60);
/// The cluster key committed for tests.
const KEY_FILE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/test-cluster.key"
);

fn key() -> ClusterKey {
    ClusterKey::load(Path::new(KEY_FILE)).expect("the test cluster key")
}

/// A fresh, empty directory for one test.
fn test_dir(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("node-process-{test}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the test directory");
    dir
}

/// A synthetic two-layer Llama written to `dir`: its path and identity.
fn synth_in(dir: &Path) -> (PathBuf, ModelIdentity) {
    let bytes = synth_model(&SynthSpec::new(SynthArch::Llama, GgmlType::F32, 7)).expect("synth");
    let path = dir.join("synth-llama.gguf");
    std::fs::write(&path, bytes).expect("write the model");
    let id = model_identity(&path, &GgufFile::open_lean(&path).expect("open"));
    (path, id)
}

/// A `ringllm node` process on `127.0.0.1:<a free port>`, killed when dropped.
struct NodeProc {
    child: Child,
    addr: String,
    log: Arc<Mutex<String>>,
}

impl NodeProc {
    fn start(name: &str, models: &Path, cache: &Path) -> NodeProc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ringllm"))
            .args([
                "node",
                "--listen",
                "127.0.0.1:0",
                "--key",
                KEY_FILE,
                "--threads",
                "1",
            ])
            .arg("--name")
            .arg(name)
            .arg("--models")
            .arg(models)
            .arg("--cache")
            .arg(cache)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start ringllm node");
        let stderr = child.stderr.take().expect("its stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split(" listening on ").nth(1) {
                    let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                    let _ = tx.send(addr);
                }
                let mut l = sink.lock().unwrap_or_else(|e| e.into_inner());
                l.push_str(&line);
                l.push('\n');
            }
        });
        let mut node = NodeProc {
            child,
            addr: String::new(),
            log,
        };
        match rx.recv_timeout(GUARD) {
            Ok(addr) => node.addr = addr,
            Err(_) => panic!("node '{name}' did not start:\n{}", node.log()),
        }
        node
    }

    fn log(&self) -> String {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Panics (with its log) unless the process still runs.
    fn assert_alive(&mut self) {
        if let Some(status) = self.child.try_wait().expect("wait") {
            panic!("the node process exited ({status}):\n{}", self.log());
        }
    }

    async fn connect(&self, name: &str) -> Link {
        control_conn::connect(
            &self.addr,
            &key(),
            Role::Coordinator,
            name,
            GUARD,
            ringllm_protocol::frame::COORDINATOR_MAX_PAYLOAD,
        )
        .await
        .expect("connect")
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn recv_control(link: &mut Link) -> Result<Control, TransportError> {
    let mut buf = Vec::new();
    let h = tokio::time::timeout(GUARD, link.rx.recv(&mut buf))
        .await
        .expect("no message from the node")?;
    Ok(control_of(&h, &buf)?)
}

async fn send(link: &mut Link, msg: &Control) {
    control_conn::send_control(link.tx.as_mut(), msg)
        .await
        .expect("send");
}

/// The node's first message, which must be its capabilities.
async fn capabilities(node: &NodeProc, link: &mut Link) {
    match recv_control(link).await {
        Ok(Control::Capabilities(_)) => {}
        other => panic!("expected capabilities, got {other:?}\n{}", node.log()),
    }
}

/// A whole-model, one-node assignment of `model` for session `session`.
fn assignment(session: u64, model: ModelIdentity) -> Assignment {
    Assignment {
        session,
        model,
        layer_start: 0,
        layer_end: 2,
        head: true,
        input: Input::Coordinator,
        next_hop: NextHop::Coordinator,
        activations: Dtype::F32,
        kv_ctx: 32,
        kv_type: KvType::F32,
        max_batch: 4,
        threads: 1,
        kv_slots: 1,
        layout: StageLayout::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_ranges_past_the_model_are_refused_by_name_and_the_node_process_serves_on() {
    let dir = test_dir("bad-assign");
    let (_, id) = synth_in(&dir);
    let mut node = NodeProc::start("checked", &dir, &dir.join("cache"));
    let mut link = node.connect("bad-coordinator").await;
    capabilities(&node, &mut link).await;
    let base = assignment(1, id);
    let windows = |windows: Vec<(u32, u32)>| StageLayout {
        windows,
        ..StageLayout::default()
    };
    // The first once aborted the node (a 34 GB list of layers); the others panicked the
    // assignment task (indexing layers the model lacks).
    let cases = [
        (0, u32::MAX, StageLayout::default(), "layers 0..4294967295"),
        (0, 3, StageLayout::default(), "layers 0..3"),
        (5, 7, StageLayout::default(), "layers 5..7"),
        (2, 2, StageLayout::default(), "layers 2..2"),
        (
            0,
            2,
            windows(vec![(0, 1), (1, u32::MAX)]),
            "layers 1..4294967295",
        ),
        (0, 2, windows(vec![(0, 1), (9, 2)]), "layers 9..2"),
        (
            0,
            2,
            StageLayout {
                streamed: vec![1, 1],
                ..StageLayout::default()
            },
            "streamed layer 1 is listed twice",
        ),
    ];
    for (session, (start, end, layout, needle)) in (2u64..).zip(cases) {
        let a = Assignment {
            session,
            layer_start: start,
            layer_end: end,
            layout,
            ..base.clone()
        };
        send(&mut link, &Control::Assign(a)).await;
        match recv_control(&mut link).await {
            Ok(Control::Error(e)) => {
                assert_eq!(e.code, ErrorCode::BadRequest, "{}", e.message);
                assert!(e.message.contains(needle), "{needle:?}: {}", e.message);
                assert!(e.message.contains("'checked'"), "{}", e.message);
            }
            other => panic!(
                "expected an error for {needle:?}, got {other:?}\n{}",
                node.log()
            ),
        }
        node.assert_alive();
    }
    // A good assignment after them is taken.
    send(&mut link, &Control::Assign(base)).await;
    match recv_control(&mut link).await {
        Ok(Control::Ready(r)) => assert_eq!(r.session, 1),
        other => panic!("expected ready, got {other:?}\n{}", node.log()),
    }
    // A release of a sequence the session has no slot for is refused (it was listed, and a
    // list of them grew without end between batches).
    send(&mut link, &Control::ReleaseSequence { seq: u64::MAX }).await;
    match recv_control(&mut link).await {
        Ok(Control::Error(e)) => assert!(
            e.message.contains("beyond the 1 slots assigned"),
            "{}",
            e.message
        ),
        other => panic!("expected an error, got {other:?}\n{}", node.log()),
    }
    node.assert_alive();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_holder_silent_before_its_assignment_yields_the_node_to_a_waiting_coordinator() {
    let dir = test_dir("silent-holder");
    let node = NodeProc::start("held", &dir, &dir.join("cache"));
    let mut silent = node.connect("silent-holder").await;
    capabilities(&node, &mut silent).await;
    // The next coordinator waits for the slot (up to the node's takeover wait, 7 s); the
    // holder, silent for 5 s while it waits, is dropped and told so.
    let mut next = node.connect("next-coordinator").await;
    capabilities(&node, &mut next).await;
    match recv_control(&mut silent).await {
        Ok(Control::Error(e)) => assert!(
            e.message
                .contains("heard nothing from this coordinator for 5 s"),
            "{}",
            e.message
        ),
        other => panic!("expected the silent holder to be told, got {other:?}"),
    }
    send(
        &mut next,
        &Control::Heartbeat {
            nonce: 5,
            reply: false,
        },
    )
    .await;
    assert_eq!(
        recv_control(&mut next).await.expect("a reply"),
        Control::Heartbeat {
            nonce: 5,
            reply: true
        }
    );
}

/// Sends every piece of `offer` (built from `source` of `file`) and waits for the node's
/// account of the finished transfer; the error it answered instead, if any.
async fn send_slice(
    link: &mut Link,
    file: &GgufFile,
    source: &SliceSource,
    offer: &SliceOffer,
) -> Result<(), String> {
    for i in 0..offer.pieces.len() {
        for chunk in source.bytes(file, i).chunks(1 << 20) {
            let h = FrameHeader::new(FrameKind::Slice, Dtype::Bytes, i as u64, 0, 0, 0, chunk)
                .expect("a slice frame");
            link.tx.send(&h, chunk).await.expect("send a piece");
        }
    }
    loop {
        match recv_control(link).await {
            Ok(Control::SliceProgress(p)) if p.done => {
                assert!(p.bad.is_empty(), "pieces failed their hash: {:?}", p.bad);
                return Ok(());
            }
            Ok(Control::SliceProgress(_)) => {}
            Ok(Control::Error(e)) => return Err(e.message),
            other => panic!("expected slice progress, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_node_processes_sharing_a_cache_receive_the_same_slice_at_once() {
    let dir = test_dir("shared-cache");
    let (path, id) = synth_in(&dir);
    let (empty, cache) = (dir.join("no-models"), dir.join("cache"));
    std::fs::create_dir_all(&empty).expect("mkdir");
    let mut left = NodeProc::start("left", &empty, &cache);
    let mut right = NodeProc::start("right", &empty, &cache);
    let (mut ll, mut rl) = (left.connect("c-left").await, right.connect("c-right").await);
    capabilities(&left, &mut ll).await;
    capabilities(&right, &mut rl).await;
    let file = GgufFile::open_lean(&path).expect("open");
    let source = SliceSource::build(&file, id.clone(), 0..2, true).expect("slice");
    let offer = source.offer(&file, 1, false, false);
    // Both are offered the slice before either has it: each needs every piece.
    for (node, link) in [(&left, &mut ll), (&right, &mut rl)] {
        send(link, &Control::SliceOffer(offer.clone())).await;
        match recv_control(link).await {
            Ok(Control::SliceNeed(n)) => assert_eq!(n.pieces.len(), offer.pieces.len()),
            other => panic!("expected a slice need, got {other:?}\n{}", node.log()),
        }
    }
    // One finishes (and renames its partial file into place) before the other.
    send_slice(&mut ll, &file, &source, &offer)
        .await
        .unwrap_or_else(|e| panic!("left: {e}\n{}", left.log()));
    send_slice(&mut rl, &file, &source, &offer)
        .await
        .unwrap_or_else(|e| panic!("right: {e}\n{}", right.log()));
    for (node, link, session) in [(&mut left, &mut ll, 1), (&mut right, &mut rl, 2)] {
        send(link, &Control::Assign(assignment(session, id.clone()))).await;
        match recv_control(link).await {
            Ok(Control::Ready(r)) => assert_eq!(r.session, session),
            other => panic!("expected ready, got {other:?}\n{}", node.log()),
        }
        node.assert_alive();
    }
    let mut files: Vec<String> = std::fs::read_dir(
        cache.join(
            ringllm_node::daemon::slices::paths(&cache, &offer.key)
                .dir
                .file_name()
                .expect("a model directory"),
        ),
    )
    .expect("the cache's model directory")
    .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
    .collect();
    files.sort();
    assert_eq!(files, ["layers-0-2-head.gguf", "layers-0-2-head.pieces"]);
}
