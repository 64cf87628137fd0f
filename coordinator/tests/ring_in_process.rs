//! The coordinator's library driving node daemons started in this same process: two nodes on
//! `127.0.0.1:0` (real sockets, real handshakes), a ring built over them with
//! `Engine::load_ring`, and the single-process `Engine::load` as the oracle: greedy tokens and
//! every logit equal, bit for bit. The nodes stop through their shutdown future, no `kill`.
//! Nodes without the model get their slices from the coordinator: sent once, then reused from
//! their caches, and a corrupted cached tensor is fetched again.
//! Needs the test models (`scripts/fetch-models`). Timeouts are only hang guards.

use ringllm::cluster::ring::{RingSpec, StageSpec, StreamPolicy};
use ringllm::cluster::streaming::Choice;
use ringllm::engine::{Engine, ModelOptions};
use ringllm_node::daemon::NodeOptions;
use ringllm_node::test_util::{self, spawn_nodes, Nodes};
use ringllm_protocol::control::KvType;
use ringllm_protocol::{ClusterKey, Dtype};
use std::path::{Path, PathBuf};
use std::time::Duration;

const SMOL: &str = "smollm2-135m-instruct-q4_1.gguf";
const KEY: &str = "ring-in-process-test-key-0123456789abcdef";

fn models() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models")
}

fn start_nodes(names: &[&str]) -> Nodes {
    start_nodes_in(names, models(), scratch("cache-unused"))
}

/// A fresh directory for this test run.
fn scratch(what: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "ringllm-ring-in-process-{}-{what}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("a scratch directory");
    d
}

/// Nodes named `names` on a thread of their own, their models in `models_dir`, each its
/// slice cache under `cache_dir`.
fn start_nodes_in(names: &[&str], models_dir: PathBuf, cache_dir: PathBuf) -> Nodes {
    let key = ClusterKey::from_bytes(KEY.as_bytes()).expect("key");
    spawn_nodes(
        names
            .iter()
            .enumerate()
            .map(|(i, name)| NodeOptions {
                cache_dir: cache_dir.join(name),
                // Every other node keeps the file's layout: a ring may mix both.
                repack: i % 2 == 0,
                ..test_util::options(name, key.clone(), &models_dir)
            })
            .collect(),
    )
}

/// Stops the nodes; every one ended without an error.
fn stop(nodes: Nodes) {
    for r in nodes.stop() {
        r.expect("a node's serve ended with an error");
    }
}

fn options() -> ModelOptions {
    ModelOptions {
        model: models().join(SMOL),
        threads: Some(1),
        ctx: Some(128),
        batch: 64,
        kv: KvType::F32,
        repack: true,
        memory: None,
        stream: Default::default(),
        backend: ringllm_model::BackendChoice::Cpu,
    }
}

/// Feeds `prompt`, then `n` greedy tokens; returns the tokens and every step's logits.
fn greedy(engine: &mut Engine, prompt: &str, n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let ids = engine.tokenizer.encode(prompt, true).expect("tokenize");
    let mut logits = vec![engine.feed(&ids).expect("prefill").to_vec()];
    let mut out = Vec::new();
    for _ in 0..n {
        let last = logits.last().expect("logits");
        let next = last
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .expect("a non-empty vocabulary");
        out.push(next);
        logits.push(engine.feed(&[next]).expect("decode").to_vec());
    }
    (out, logits)
}

#[test]
fn a_ring_of_in_process_nodes_equals_the_single_process() {
    let nodes = start_nodes(&["n1", "n2"]);
    let spec = spec_of(&nodes, true);
    let prompt = "The three primary colours are";
    let mut one = Engine::load(&options()).expect("the single process loads");
    let (want_tokens, want_logits) = greedy(&mut one, prompt, 8);
    drop(one);

    let mut ring = Engine::load_ring(&options(), spec).expect("the ring builds");
    let (tokens, logits) = greedy(&mut ring, prompt, 8);
    ring.close();
    assert_eq!(
        tokens, want_tokens,
        "greedy tokens differ from the single process"
    );
    for (step, (a, b)) in logits.iter().zip(&want_logits).enumerate() {
        let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "logits of step {step} differ from the single process");
    }
    stop(nodes);
}

/// Several rounds per token (windows interleaved over the nodes) and the naive layout (every
/// layer of every node streamed from disk each token): the same bits as the single process.
#[test]
fn multi_round_and_streaming_rings_equal_the_single_process() {
    let nodes = start_nodes(&["n1", "n2"]);
    let prompt = "The three primary colours are";
    let mut one = Engine::load(&options()).expect("the single process loads");
    let want = greedy(&mut one, prompt, 6);
    drop(one);
    for (choice, rounds, streamed) in [
        (Choice::Rounds(3), 3, false),
        (Choice::Naive, 1, true),
        (Choice::Rounds(2), 2, false),
    ] {
        let spec = RingSpec {
            stream: StreamPolicy { off: false, choice },
            ..spec_of(&nodes, false)
        };
        let mut ring = Engine::load_ring(&options(), spec).expect("the ring builds");
        let r = ring.ring_mut().expect("a ring");
        assert_eq!(r.rounds, rounds, "{choice:?}");
        let sp = r.streaming.clone().expect("a streaming layout");
        let c = sp.chosen();
        assert_eq!(c.naive, streamed, "{choice:?}");
        for s in &c.stages {
            assert_eq!(s.windows.len(), rounds, "{choice:?}: {s:?}");
        }
        let got = greedy(&mut ring, prompt, 6);
        let stats = ring.ring_mut().expect("a ring").stats().expect("stats");
        ring.close();
        assert_eq!(
            got.0, want.0,
            "{choice:?}: tokens differ from the single process"
        );
        assert!(same_bits(&got.1, &want.1), "{choice:?}: logits differ");
        let read: u64 = stats.iter().map(|s| s.stream_bytes_read).sum();
        if streamed {
            // Every layer, every pass: at least the model's layers once per generated token.
            assert!(read > (6 * 50) << 20, "{choice:?}: {read} bytes read");
        } else {
            assert_eq!(read, 0, "{choice:?}: nothing streams when the layers fit");
        }
    }
    stop(nodes);
}

fn spec_of(nodes: &Nodes, send_slices: bool) -> RingSpec {
    RingSpec {
        key: ClusterKey::from_bytes(KEY.as_bytes()).expect("key"),
        stages: nodes
            .addrs
            .iter()
            .enumerate()
            .map(|(i, a)| StageSpec {
                name: format!("n{}", i + 1),
                address: Some(a.to_string()),
                layers: None,
                memory: None,
                threads: Some(1),
                transport: None,
            })
            .collect(),
        coordinator_memory: None,
        activations: Dtype::F32,
        send_slices,
        discard_cached_slices: false,
        stream: Default::default(),
        skip: None,
        wait: Duration::from_secs(10),
    }
}

fn same_bits(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
        })
}

/// Every cached slice file (`*.gguf`) under `dir`, sorted.
fn slice_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "gguf") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn nodes_without_the_model_get_their_slices_once_and_refetch_a_corrupted_tensor() {
    let empty = scratch("no-models");
    let cache = scratch("caches");
    let nodes = start_nodes_in(&["n1", "n2", "n3"], empty, cache.clone());
    let prompt = "The three primary colours are";
    let mut one = Engine::load(&options()).expect("the single process loads");
    let want = greedy(&mut one, prompt, 6);
    drop(one);

    // Without sending, a node that lacks the model says so and where it looked.
    let err = Engine::load_ring(&options(), spec_of(&nodes, false))
        .err()
        .expect("a ring of nodes without the model and without sending fails");
    let msg = format!("{err:#}");
    assert!(
        msg.contains("no model file") && msg.contains("--no-send"),
        "{msg}"
    );

    // First start: every node is sent its slice.
    let mut ring = Engine::load_ring(&options(), spec_of(&nodes, true)).expect("the ring builds");
    let sent = ring.ring_mut().expect("a ring").sent.clone();
    assert_eq!(sent.len(), 3, "every node was sent its slice: {sent:?}");
    assert!(
        sent.iter().all(|s| s.bytes > 0 && s.resent == 0),
        "{sent:?}"
    );
    let got = greedy(&mut ring, prompt, 6);
    ring.close();
    assert_eq!(
        got.0, want.0,
        "greedy tokens differ from the single process"
    );
    assert!(
        same_bits(&got.1, &want.1),
        "logits differ from the single process"
    );
    let files = slice_files(&cache);
    assert_eq!(files.len(), 3, "one cached slice per node: {files:?}");
    let weights: u64 = sent.iter().map(|s| s.bytes).sum();
    let model = std::fs::metadata(models().join(SMOL)).expect("model").len();
    assert!(
        weights < model + (3 << 20),
        "sent {weights} bytes for a {model}-byte model"
    );

    // Second start: the caches hold every slice; nothing is sent.
    let mut ring = Engine::load_ring(&options(), spec_of(&nodes, true)).expect("the ring builds");
    assert!(
        ring.ring_mut().expect("a ring").sent.is_empty(),
        "nothing to send"
    );
    let got = greedy(&mut ring, prompt, 6);
    ring.close();
    assert_eq!(got.0, want.0);
    assert!(same_bits(&got.1, &want.1));

    // A flipped byte in the middle of a cached slice: that tensor alone is sent again.
    let victim = &files[1];
    let mut bytes = std::fs::read(victim).expect("read the slice");
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(victim, &bytes).expect("corrupt the slice");
    // Without sending, the node refuses the corrupted slice instead of running it.
    let err = Engine::load_ring(&options(), spec_of(&nodes, false))
        .err()
        .expect("a corrupted cached slice is not used");
    assert!(format!("{err:#}").contains("no checked slice"), "{err:#}");
    let mut ring = Engine::load_ring(&options(), spec_of(&nodes, true)).expect("the ring builds");
    let sent = ring.ring_mut().expect("a ring").sent.clone();
    assert_eq!(
        sent.len(),
        1,
        "only the corrupted node is sent anything: {sent:?}"
    );
    assert_eq!(sent[0].pieces, 1, "one tensor is sent again: {sent:?}");
    let got = greedy(&mut ring, prompt, 6);
    ring.close();
    assert_eq!(got.0, want.0);
    assert!(same_bits(&got.1, &want.1));
    assert_eq!(std::fs::read(victim).expect("read").len(), bytes.len());
    assert_ne!(
        std::fs::read(victim).expect("read")[at],
        bytes[at],
        "the byte is repaired"
    );

    // A cold start (`bench --cold`): the nodes discard their slices and get them in full.
    let mut spec = spec_of(&nodes, true);
    spec.discard_cached_slices = true;
    let mut ring = Engine::load_ring(&options(), spec).expect("the ring builds");
    let again = ring.ring_mut().expect("a ring").sent.clone();
    assert_eq!(again.len(), 3, "{again:?}");
    assert_eq!(
        again.iter().map(|s| s.bytes).sum::<u64>(),
        weights,
        "every slice is sent in full again"
    );
    let got = greedy(&mut ring, prompt, 6);
    ring.close();
    assert_eq!(got.0, want.0);
    stop(nodes);
    let _ = std::fs::remove_dir_all(&cache);
}
